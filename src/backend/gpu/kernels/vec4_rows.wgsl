// The part of a matmul.wgsl access that reads `a` as 4-vectors (qaccess.wgsl,
// dense4.wgsl; appended after it): the binding and the GEMV's four-value step.

@group(0) @binding(1) var<storage, read> a: array<vec4<f32>>;

// A GEMV step takes four weight values (`wdot`, in the access, passes them here).
const wstep: u32 = 4u;

// acc[r] += a[r, k4-th group] . wv for the rows r < m.
fn accumulate4(acc: ptr<function, Acc8>, g: u32, wv: vec4<f32>) {
    let k4 = p.k / 4u;
    (*acc).r0 = (*acc).r0 + dot(a[g], wv);
    if (p.m > 1u) { (*acc).r1 = (*acc).r1 + dot(a[1u * k4 + g], wv); }
    if (p.m > 2u) { (*acc).r2 = (*acc).r2 + dot(a[2u * k4 + g], wv); }
    if (p.m > 3u) { (*acc).r3 = (*acc).r3 + dot(a[3u * k4 + g], wv); }
    if (p.m > 4u) { (*acc).r4 = (*acc).r4 + dot(a[4u * k4 + g], wv); }
    if (p.m > 5u) { (*acc).r5 = (*acc).r5 + dot(a[5u * k4 + g], wv); }
    if (p.m > 6u) { (*acc).r6 = (*acc).r6 + dot(a[6u * k4 + g], wv); }
    if (p.m > 7u) { (*acc).r7 = (*acc).r7 + dot(a[7u * k4 + g], wv); }
}

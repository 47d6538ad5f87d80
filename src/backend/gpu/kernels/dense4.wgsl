// Dense weights for matmul.wgsl when k is a multiple of 4 (every real model's widths):
// `a` and `w` are read as 4-vectors, one 16-byte (f32) or 8-byte (f16) load where
// dense.wgsl makes four scalar loads with a bound check each. The matmul sums the same
// values in the same order; the GEMVs take four weights per step, as qaccess.wgsl's.

@group(0) @binding(1) var<storage, read> a: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> w: array<vec4<W>>;

// k is a multiple of 4, so a step at k < p.k holds four values of the row.
fn aload4(row: u32, k: u32) -> vec4<f32> {
    if (k < p.k) {
        return a[(row * p.k + k) / 4u];
    }
    return vec4<f32>(0.0);
}

fn wload4(row: u32, k: u32) -> vec4<f32> {
    if (k < p.k) {
        return vec4<f32>(w[(row * p.k + k) / 4u]);
    }
    return vec4<f32>(0.0);
}

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

// A GEMV step: four weights of `col` at k = 4g.
const wstep: u32 = 4u;
fn wdot(acc: ptr<function, Acc8>, col: u32, g: u32) {
    accumulate4(acc, g, vec4<f32>(w[col * (p.k / 4u) + g]));
}

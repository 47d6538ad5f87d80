// GGUF block-quantized weights for matmul.wgsl: `w` is a chunk's blocks as the file
// stores them, decoded in registers four values at a time (quant.wgsl's `wq4`), with
// f32 accumulation; no f32 or f16 copy of the weights exists. k is a multiple of the
// block size (32 or 256 values), so of the matmul's 16-value k steps: loads need no
// bounds on k, and `a` is read as 4-vectors.

@group(0) @binding(1) var<storage, read> a: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> w: array<u32>;

fn aload4(row: u32, k: u32) -> vec4<f32> {
    return a[(row * p.k + k) / 4u];
}

fn wload4(row: u32, k: u32) -> vec4<f32> {
    return wq4(row, p.k, k);
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

// A GEMV step: four decoded weights of `col` at k = 4g.
const wstep: u32 = 4u;
fn wdot(acc: ptr<function, Acc8>, col: u32, g: u32) {
    accumulate4(acc, g, wq4(col, p.k, g * 4u));
}

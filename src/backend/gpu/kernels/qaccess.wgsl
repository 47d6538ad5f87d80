// GGUF block-quantized weights for matmul.wgsl: `w` is a chunk's blocks as the file
// stores them, decoded in registers four values at a time (quant.wgsl's `wq4`), with
// f32 accumulation; no f32 or f16 copy of the weights exists. k is a multiple of the
// block size (32 or 256 values), so of the matmul's 16-value k steps: loads need no
// bounds on k, and `a` is read as 4-vectors (its binding and the GEMV step's sums are
// vec4_rows.wgsl's, appended after this).

@group(0) @binding(2) var<storage, read> w: array<u32>;

fn aload4(row: u32, k: u32) -> vec4<f32> {
    return a[(row * p.k + k) / 4u];
}

fn wload4(row: u32, k: u32) -> vec4<f32> {
    return wq4(row, p.k, k);
}

// A GEMV step: four decoded weights of `col` at k = 4g.
fn wdot(acc: ptr<function, Acc8>, col: u32, g: u32) {
    accumulate4(acc, g, wq4(col, p.k, g * 4u));
}

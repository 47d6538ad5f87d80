// Dense weights for matmul.wgsl when k is a multiple of 4 (every real model's widths):
// `a` and `w` are read as 4-vectors, one 16-byte (f32) or 8-byte (f16) load where
// dense.wgsl makes four scalar loads with a bound check each. The matmul sums the same
// values in the same order; the GEMVs take four weights per step, as qaccess.wgsl's.
// The `a` binding and the GEMV step's sums are vec4_rows.wgsl's, appended after this.

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

// A GEMV step: four weights of `col` at k = 4g.
fn wdot(acc: ptr<function, Acc8>, col: u32, g: u32) {
    accumulate4(acc, g, vec4<f32>(w[col * (p.k / 4u) + g]));
}

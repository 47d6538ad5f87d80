// Dense weights for matmul.wgsl: `w` rows of `W` (f32, or f16 with shader-f16), `a`
// rows of f32, any k (reads past a row's end give zero).

@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<W>;

fn aload4(row: u32, k: u32) -> vec4<f32> {
    var v = vec4<f32>(0.0);
    for (var j = 0u; j < 4u; j = j + 1u) {
        if (k + j < p.k) {
            v[j] = a[row * p.k + k + j];
        }
    }
    return v;
}

fn wload4(row: u32, k: u32) -> vec4<f32> {
    var v = vec4<f32>(0.0);
    for (var j = 0u; j < 4u; j = j + 1u) {
        if (k + j < p.k) {
            v[j] = f32(w[row * p.k + k + j]);
        }
    }
    return v;
}

// acc[r] += a[r, kk] * wv for the rows r < m.
fn accumulate(acc: ptr<function, Acc8>, kk: u32, wv: f32) {
    (*acc).r0 = (*acc).r0 + a[kk] * wv;
    if (p.m > 1u) { (*acc).r1 = (*acc).r1 + a[1u * p.k + kk] * wv; }
    if (p.m > 2u) { (*acc).r2 = (*acc).r2 + a[2u * p.k + kk] * wv; }
    if (p.m > 3u) { (*acc).r3 = (*acc).r3 + a[3u * p.k + kk] * wv; }
    if (p.m > 4u) { (*acc).r4 = (*acc).r4 + a[4u * p.k + kk] * wv; }
    if (p.m > 5u) { (*acc).r5 = (*acc).r5 + a[5u * p.k + kk] * wv; }
    if (p.m > 6u) { (*acc).r6 = (*acc).r6 + a[6u * p.k + kk] * wv; }
    if (p.m > 7u) { (*acc).r7 = (*acc).r7 + a[7u * p.k + kk] * wv; }
}

// A GEMV step: one weight of `col` at k = g.
const wstep: u32 = 1u;
fn wdot(acc: ptr<function, Acc8>, col: u32, g: u32) {
    accumulate(acc, g, f32(w[col * p.k + g]));
}

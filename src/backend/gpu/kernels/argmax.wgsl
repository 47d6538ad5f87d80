// Greedy sampling on the device: the index of the largest logit of each row (the
// lowest index on ties, as the CPU sampler), so a decode step reads back 4 bytes per
// sequence instead of the vocabulary-wide logits. One workgroup per row. A row holding
// any non-finite value (NaN, ±inf) gives 0xffffffff, so the caller can report broken
// logits instead of picking a token from them.

struct Params {
    rows: u32,
    cols: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<u32>;

var<workgroup> best_v: array<f32, 256>;
var<workgroup> best_i: array<u32, 256>;
var<workgroup> non_finite: atomic<u32>;

// NaN or ±inf, read from the bits (no reliance on float comparisons with NaN).
fn is_non_finite(v: f32) -> bool {
    return (bitcast<u32>(v) & 0x7f800000u) == 0x7f800000u;
}

@compute @workgroup_size(256)
fn argmax(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let row = wg.x;
    var bv = -3.4028235e38;
    var bi = 0xffffffffu;
    var bad = false;
    for (var c = tid; c < p.cols; c = c + 256u) {
        let v = x[row * p.cols + c];
        if (is_non_finite(v)) {
            bad = true;
        } else if (v > bv || bi == 0xffffffffu) {
            bv = v;
            bi = c;
        }
    }
    if (bad) {
        atomicOr(&non_finite, 1u);
    }
    best_v[tid] = bv;
    best_i[tid] = bi;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (tid < s) {
            let ov = best_v[tid + s];
            let oi = best_i[tid + s];
            let mine_empty = best_i[tid] == 0xffffffffu;
            if (oi != 0xffffffffu && (mine_empty || ov > best_v[tid] || (ov == best_v[tid] && oi < best_i[tid]))) {
                best_v[tid] = ov;
                best_i[tid] = oi;
            }
        }
        workgroupBarrier();
    }
    if (tid == 0u) {
        // An empty row gives 0; a row with a non-finite value 0xffffffff.
        let id = select(best_i[0], 0u, best_i[0] == 0xffffffffu);
        out[row] = select(id, 0xffffffffu, atomicLoad(&non_finite) != 0u);
    }
}

// Causal self-attention for one sequence over its KV cache.
//
// Cache layout, one buffer per layer: [2 (k, v)][n_head][capacity][head_dim] of KV
// (f32, or f16 with shader-f16: half the memory and the bandwidth of long contexts).
// `kv_store`: writes the k and v parts of the slice's qkv rows (q | k | v, each C wide)
// into the cache at positions start_pos.. .
// `attend`: one workgroup per (row, head). The row at position `pos` attends over keys
// 0..=pos in tiles of 256: scores in workgroup memory, an online softmax (running max
// and sum, rescaling the partial output when the max grows), output dims owned by
// invocations 0..head_dim. Bounded workgroup memory for any context length.

struct Params {
    rows: u32,      // rows of this sequence in the batch
    row0: u32,      // its first row in qkv / out
    start_pos: u32, // position of its first row
    n_head: u32,
    head_dim: u32,
    capacity: u32,
    scale: f32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read_write> cache: array<KV>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

fn cache_index(kv: u32, head: u32, pos: u32, d: u32) -> u32 {
    return ((kv * p.n_head + head) * p.capacity + pos) * p.head_dim + d;
}

@compute @workgroup_size(256)
fn kv_store(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let c = p.n_head * p.head_dim;
    let i = gid.y * nwg.x * 256u + gid.x; // over rows x C
    if (i >= p.rows * c) {
        return;
    }
    let r = i / c;
    let e = i % c;
    let head = e / p.head_dim;
    let d = e % p.head_dim;
    let src = (p.row0 + r) * 3u * c;
    let pos = p.start_pos + r;
    cache[cache_index(0u, head, pos, d)] = KV(qkv[src + c + e]);
    cache[cache_index(1u, head, pos, d)] = KV(qkv[src + 2u * c + e]);
}

var<workgroup> q_s: array<f32, 256>;
var<workgroup> scores: array<f32, 256>;

@compute @workgroup_size(256)
fn attend(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let r = wg.x;    // row within the sequence
    let head = wg.y;
    let c = p.n_head * p.head_dim;
    let pos = p.start_pos + r;
    let n_keys = pos + 1u;
    if (tid < p.head_dim) {
        q_s[tid] = qkv[(p.row0 + r) * 3u * c + head * p.head_dim + tid];
    }
    workgroupBarrier();

    var m = -3.4028235e38; // running max (finite, so exp(m - m_new) never sees inf - inf)
    var l = 0.0;           // running sum of exp(score - m)
    var acc = 0.0;         // output dim `tid` (when tid < head_dim), scaled by exp(-m)
    for (var t0 = 0u; t0 < n_keys; t0 = t0 + 256u) {
        let j = t0 + tid;
        var s = -3.4028235e38;
        if (j < n_keys) {
            var dot = 0.0;
            let kb = cache_index(0u, head, j, 0u);
            for (var d = 0u; d < p.head_dim; d = d + 1u) {
                dot = dot + q_s[d] * f32(cache[kb + d]);
            }
            s = dot * p.scale;
        }
        let m_new = max(m, workgroup_max(tid, s));
        var e = 0.0;
        if (j < n_keys) {
            e = exp(s - m_new);
        }
        scores[tid] = e;
        let tile_sum = workgroup_sum(tid, e); // its barriers also publish `scores`
        let correction = exp(m - m_new);
        l = l * correction + tile_sum;
        if (tid < p.head_dim) {
            var a = acc * correction;
            let n = min(256u, n_keys - t0);
            let vb = cache_index(1u, head, t0, tid);
            for (var jj = 0u; jj < n; jj = jj + 1u) {
                a = a + scores[jj] * f32(cache[vb + jj * p.head_dim]);
            }
            acc = a;
        }
        m = m_new;
        workgroupBarrier(); // `scores` is rewritten by the next tile
    }
    if (tid < p.head_dim) {
        out[(p.row0 + r) * c + head * p.head_dim + tid] = acc / l;
    }
}

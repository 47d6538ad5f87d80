// Causal self-attention for one sequence over its KV cache, with grouped-query heads and
// RoPE.
//
// qkv rows: q (n_head heads) | k (n_kv_head heads) | v (n_kv_head heads), head_dim each.
// Cache layout, one buffer per layer: [2 (k, v)][n_kv_head][slots][head_dim] of KV
// (f32, or f16 with shader-f16: half the memory and the bandwidth of long contexts),
// position `pos` in slot `pos % slots`: `slots` is the capacity, or fewer for a ring that
// keeps a sliding window's last keys (the host stores a slice in pieces a ring can take).
// RoPE (`rope_mode` 1: neighbour pairs (x[2i], x[2i+1]), llama.cpp's layout; 2: halves
// (x[i], x[i + head_dim/2]), HF's): each pair is rotated by the angle pos·θ^(-2i/head_dim),
// whose cos and sin come from `rope`, a table the host computes in f64 (GPU sin/cos are
// only accurate near zero, and an f32 angle at position 8000 is off by ~1e-3 rad).
// `kv_store`: writes the k (rotated) and v parts of the slice's rows into the cache at
// positions start_pos.. .
// `attend`: one workgroup per (row, query head); query head h reads KV head
// h / (n_head / n_kv_head). The row at position `pos` attends over keys 0..=pos (the last
// `window` of them with a sliding window) in tiles
// of 256: scores in workgroup memory, an online softmax (running max and sum, rescaling
// the partial output when the max grows), output dims owned by invocations 0..head_dim.
// Bounded workgroup memory for any context length.

struct Params {
    rows: u32,      // rows of this sequence in the batch
    row0: u32,      // its first row in qkv / out
    start_pos: u32, // position of its first row
    n_head: u32,
    head_dim: u32,
    capacity: u32,  // positions of the sequence (the RoPE table's rows)
    scale: f32,
    n_kv_head: u32,
    rope_mode: u32, // 0 none, 1 neighbour pairs, 2 halves
    window: u32,    // sliding window: keys pos + 1 - window ..= pos; 0 for all
    slots: u32,     // positions the layer stores
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read_write> cache: array<KV>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> rope: array<vec2<f32>>; // [pos][head_dim/2] (cos, sin)

fn cache_index(kv: u32, head: u32, pos: u32, d: u32) -> u32 {
    return ((kv * p.n_kv_head + head) * p.slots + pos % p.slots) * p.head_dim + d;
}

fn row_width() -> u32 {
    return (p.n_head + 2u * p.n_kv_head) * p.head_dim;
}

// Value d of the head starting at qkv[base], rotated for position pos.
fn rotated(base: u32, d: u32, pos: u32) -> f32 {
    let x = qkv[base + d];
    if (p.rope_mode == 0u) {
        return x;
    }
    let half = p.head_dim / 2u;
    var i: u32;
    var partner: u32;
    var first: bool;
    if (p.rope_mode == 1u) {
        i = d / 2u;
        first = d % 2u == 0u;
        partner = select(d - 1u, d + 1u, first);
    } else {
        i = d % half;
        first = d < half;
        partner = select(d - half, d + half, first);
    }
    let cs = rope[pos * half + i];
    let y = qkv[base + partner];
    // (x0, x1) -> (x0 c - x1 s, x1 c + x0 s)
    return select(x * cs.x + y * cs.y, x * cs.x - y * cs.y, first);
}

@compute @workgroup_size(256)
fn kv_store(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let c = p.n_kv_head * p.head_dim;
    let i = gid.y * nwg.x * 256u + gid.x; // over rows x kv width
    if (i >= p.rows * c) {
        return;
    }
    let r = i / c;
    let e = i % c;
    let head = e / p.head_dim;
    let d = e % p.head_dim;
    let row = (p.row0 + r) * row_width();
    let k_base = row + p.n_head * p.head_dim + head * p.head_dim;
    let pos = p.start_pos + r;
    cache[cache_index(0u, head, pos, d)] = KV(rotated(k_base, d, pos));
    cache[cache_index(1u, head, pos, d)] = KV(qkv[k_base + c + d]);
}

var<workgroup> q_s: array<f32, 256>;
var<workgroup> scores: array<f32, 256>;

@compute @workgroup_size(256)
fn attend(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_index) tid: u32) {
    let r = wg.x;    // row within the sequence
    let q_head = wg.y;
    let head = q_head / (p.n_head / p.n_kv_head); // its KV head
    let pos = p.start_pos + r;
    let n_keys = pos + 1u;
    var first = 0u;
    if (p.window > 0u && n_keys > p.window) {
        first = n_keys - p.window;
    }
    if (tid < p.head_dim) {
        q_s[tid] = rotated((p.row0 + r) * row_width() + q_head * p.head_dim, tid, pos);
    }
    workgroupBarrier();

    var m = -3.4028235e38; // running max (finite, so exp(m - m_new) never sees inf - inf)
    var l = 0.0;           // running sum of exp(score - m)
    var acc = 0.0;         // output dim `tid` (when tid < head_dim), scaled by exp(-m)
    for (var t0 = first; t0 < n_keys; t0 = t0 + 256u) {
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
            let v0 = cache_index(1u, head, 0u, tid); // slot 0 of this head's values
            var slot = t0 % p.slots;
            for (var jj = 0u; jj < n; jj = jj + 1u) {
                a = a + scores[jj] * f32(cache[v0 + slot * p.head_dim]);
                slot = slot + 1u;
                if (slot == p.slots) {
                    slot = 0u;
                }
            }
            acc = a;
        }
        m = m_new;
        workgroupBarrier(); // `scores` is rewritten by the next tile
    }
    if (tid < p.head_dim) {
        out[((p.row0 + r) * p.n_head + q_head) * p.head_dim + tid] = acc / l;
    }
}

// out[m, n_off + n] = a[m, :] . w[n, :] (+ bias) for one chunk of block-quantized weight
// rows, decoded in registers (quant.wgsl's `wq4`, four values at a time) and accumulated
// in f32; no f32 or f16 copy of the weights exists. The same three kernels as
// matmul.wgsl: `qmatmul` (64x64 tiles for prefill and batch-invariant steps),
// `qgemv` (32 invocations per output column) and `qgemv_thread` (one per column, for
// CPU-backed adapters). k is a multiple of the block size, so of 4: `a` is read as
// 4-vectors.

struct Params {
    m: u32,          // rows of a and out
    k: u32,          // inner dimension
    n: u32,          // weight rows in this chunk
    n_off: u32,      // first output column of this chunk
    ldo: u32,        // row stride of out (all output columns)
    has_bias: u32,
    fuse_gelu: u32,
    group_cols: u32, // output columns per workgroup (the subgroup GEMV only)
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read> w: array<u32>;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;

fn finish(acc: f32, col: u32) -> f32 {
    var v = acc;
    if (p.has_bias != 0u) {
        v = v + bias[p.n_off + col];
    }
    if (p.fuse_gelu != 0u) {
        v = gelu_tanh(v);
    }
    return v;
}

const TILE: u32 = 64u;
const TK: u32 = 16u;

var<workgroup> a_tile: array<vec4<f32>, 256>; // [TK][TILE / 4]
var<workgroup> w_tile: array<vec4<f32>, 256>; // [TK][TILE / 4]

@compute @workgroup_size(16, 16)
fn qmatmul(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
           @builtin(local_invocation_index) tid: u32) {
    let row0 = wg.y * TILE;
    let col0 = wg.x * TILE;
    var acc: array<vec4<f32>, 4>;
    for (var i = 0u; i < 4u; i = i + 1u) {
        acc[i] = vec4<f32>(0.0);
    }
    // Loading: each invocation fetches 4 consecutive k of one row, for a and for w
    // (k is a multiple of 32, so a step of 16 never leaves a row part-way).
    let load_r = tid / 4u;        // 0..63: tile row
    let load_k = (tid % 4u) * 4u; // 0, 4, 8, 12
    let k4 = p.k / 4u;
    for (var k0 = 0u; k0 < p.k; k0 = k0 + TK) {
        let ar = row0 + load_r;
        let wr = col0 + load_r;
        var av = vec4<f32>(0.0);
        var wv = vec4<f32>(0.0);
        if (ar < p.m) {
            av = a[ar * k4 + (k0 + load_k) / 4u];
        }
        if (wr < p.n) {
            wv = wq4(wr, p.k, k0 + load_k);
        }
        // Transpose into k-major tiles: element (k, r) lives at [k][r / 4][r % 4].
        for (var j = 0u; j < 4u; j = j + 1u) {
            let kk = load_k + j;
            a_tile[kk * 16u + load_r / 4u][load_r % 4u] = av[j];
            w_tile[kk * 16u + load_r / 4u][load_r % 4u] = wv[j];
        }
        workgroupBarrier();
        for (var kk = 0u; kk < TK; kk = kk + 1u) {
            let av4 = a_tile[kk * 16u + lid.y];
            let wv4 = w_tile[kk * 16u + lid.x];
            acc[0] = acc[0] + av4.x * wv4;
            acc[1] = acc[1] + av4.y * wv4;
            acc[2] = acc[2] + av4.z * wv4;
            acc[3] = acc[3] + av4.w * wv4;
        }
        workgroupBarrier();
    }
    for (var i = 0u; i < 4u; i = i + 1u) {
        let r = row0 + lid.y * 4u + i;
        if (r < p.m) {
            for (var j = 0u; j < 4u; j = j + 1u) {
                let c = col0 + lid.x * 4u + j;
                if (c < p.n) {
                    out[r * p.ldo + p.n_off + c] = finish(acc[i][j], c);
                }
            }
        }
    }
}

// Up to 8 decode rows share each decoded weight group; accumulators as named scalars
// (see matmul.wgsl), rows at or past m skipped by uniform branches.
struct Acc8 {
    r0: f32,
    r1: f32,
    r2: f32,
    r3: f32,
    r4: f32,
    r5: f32,
    r6: f32,
    r7: f32,
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

fn row_of(acc: Acc8, r: u32) -> f32 {
    switch r {
        case 0u: { return acc.r0; }
        case 1u: { return acc.r1; }
        case 2u: { return acc.r2; }
        case 3u: { return acc.r3; }
        case 4u: { return acc.r4; }
        case 5u: { return acc.r5; }
        case 6u: { return acc.r6; }
        default: { return acc.r7; }
    }
}

var<workgroup> red: array<f32, 2048>; // [8 rows][256]

// 256 invocations = 8 output columns x 32 lanes; the lanes of a column decode 128
// consecutive weights per step (4 each), then a tree reduction in workgroup memory.
@compute @workgroup_size(256)
fn qgemv(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
         @builtin(local_invocation_index) tid: u32) {
    let col = (wg.y * nwg.x + wg.x) * 8u + tid / 32u;
    let lane = tid % 32u;
    var acc = Acc8();
    if (col < p.n) {
        for (var g = lane; g < p.k / 4u; g = g + 32u) {
            accumulate4(&acc, g, wq4(col, p.k, g * 4u));
        }
    }
    for (var r = 0u; r < p.m; r = r + 1u) {
        red[r * 256u + tid] = row_of(acc, r);
    }
    workgroupBarrier();
    for (var s = 16u; s > 0u; s = s >> 1u) {
        if (lane < s) {
            for (var r = 0u; r < p.m; r = r + 1u) {
                red[r * 256u + tid] = red[r * 256u + tid] + red[r * 256u + tid + s];
            }
        }
        workgroupBarrier();
    }
    if (lane == 0u && col < p.n) {
        for (var r = 0u; r < p.m; r = r + 1u) {
            out[r * p.ldo + p.n_off + col] = finish(red[r * 256u + tid], col);
        }
    }
}

// One invocation per output column, walking its blocks alone (CPU-backed adapters).
@compute @workgroup_size(64)
fn qgemv_thread(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let col = gid.y * nwg.x * 64u + gid.x;
    if (col >= p.n) {
        return;
    }
    var acc = Acc8();
    for (var g = 0u; g < p.k / 4u; g = g + 1u) {
        accumulate4(&acc, g, wq4(col, p.k, g * 4u));
    }
    for (var r = 0u; r < p.m; r = r + 1u) {
        out[r * p.ldo + p.n_off + col] = finish(row_of(acc, r), col);
    }
}

// The subgroup GEMV's step (gemv_sg.wgsl): four decoded weights of `col` at k = 4g.
const wstep: u32 = 4u;
fn wdot(acc: ptr<function, Acc8>, col: u32, g: u32) {
    accumulate4(acc, g, wq4(col, p.k, g * 4u));
}

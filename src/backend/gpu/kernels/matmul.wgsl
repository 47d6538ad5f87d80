// out[m, n_off + n] = act(a[m, :] . w[n, :] + bias[n_off + n]) for one chunk of weight rows.
//
// Weights are stored [out, in] row-major (the Rust side transposes Conv1D's [in, out]
// at load), in chunks of whole rows that each fit one storage binding: f32, f16 when
// the adapter has shader-f16 (dense.wgsl), or GGUF blocks decoded in registers
// (qaccess.wgsl); accumulation is always f32.
//
// `matmul`: prefill, and every row count in batch-invariant mode. A 64x64 output tile
// per 256-invocation workgroup, 4x4 outputs per invocation, K walked in steps of 16
// through workgroup memory (a and w tiles stored k-major so the inner loop reads
// contiguous 4-vectors). Edges are zero-filled.
//
// Its sum order is fixed by K alone: each output sums K in spans of KC values, each
// span from zero in k order (fma), then the spans' sums in span order. Whole (`split` =
// 0), one workgroup walks every span; split (`split` = 1; by default decode batches of
// up to 64 rows on a GPU), the grid's y also runs over the spans, each workgroup writes
// its span's raw sums to `out` laid out [span][m][ldo], and `matmul_reduce` adds them in
// span order and applies the bias and activation. Both walk a span with the same
// instructions, so a row's bits do not depend on how many rows came with it or on which
// way ran: a batch of 1..64 decode rows gets a grid as wide as the weights' columns
// times K's spans (a GPU full of workgroups, each weight still read once per step) and
// the same bits as a 512-row prefill.
// `gemv` / `gemv_thread`: decode (m <= 8 rows) outside batch-invariant mode: each
// weight is read once for all rows; the first for GPUs, the second for CPU-backed
// adapters (see below).

struct Params {
    m: u32,          // rows of a and out
    k: u32,          // inner dimension
    n: u32,          // weight rows in this chunk
    n_off: u32,      // first output column of this chunk
    ldo: u32,        // row stride of out (all output columns)
    has_bias: u32,
    fuse_gelu: u32,
    group_cols: u32, // output columns per workgroup (the subgroup GEMV only)
    split: u32,      // matmul: 1 = one K span per workgroup (see above)
    row_tiles: u32,  // matmul, split: 64-row tiles of a (the grid's y is span * row_tiles + tile)
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(3) var<storage, read> bias: array<f32>;
@group(0) @binding(4) var<storage, read_write> out: array<f32>;
// The spans' raw sums (`matmul_reduce` only).
@group(0) @binding(5) var<storage, read> part: array<f32>;
// Bindings 1 (`a`) and 2 (`w`), and how they are read, come from the access part the
// Rust side puts before this file: dense.wgsl (f32/f16 weights, a value at a time),
// dense4.wgsl (the same as 4-vectors, k a multiple of 4) or qaccess.wgsl (GGUF blocks).
// It defines `aload4(row, k)` and `wload4(row, k)` (values k..k+3 of a row, zero past
// its end), `wstep` (weight values one GEMV step takes: 1 in dense.wgsl, 4 in the
// others) and `wdot(acc, col, g)` (step g of column `col` into the 8 row sums).

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
// The K span of the sum order (a multiple of TK and of every block size).
const KC: u32 = 256u;

var<workgroup> a_tile: array<vec4<f32>, 256>; // [TK][TILE / 4]
var<workgroup> w_tile: array<vec4<f32>, 256>; // [TK][TILE / 4]

@compute @workgroup_size(16, 16)
fn matmul(@builtin(workgroup_id) wg: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>,
          @builtin(local_invocation_index) tid: u32) {
    var tile = wg.y;
    var span = 0u;
    var k_begin = 0u;
    var k_end = p.k;
    if (p.split != 0u) {
        tile = wg.y % p.row_tiles;
        span = wg.y / p.row_tiles;
        k_begin = span * KC;
        k_end = min(k_begin + KC, p.k);
    }
    let row0 = tile * TILE;
    let col0 = wg.x * TILE;
    // acc: the current span's sums; total: the spans' so far, in span order.
    var acc: array<vec4<f32>, 4>;
    var total: array<vec4<f32>, 4>;
    for (var i = 0u; i < 4u; i = i + 1u) {
        acc[i] = vec4<f32>(0.0);
        total[i] = vec4<f32>(0.0);
    }
    // Loading: each invocation fetches 4 consecutive k of one row, for a and for w.
    let load_r = tid / 4u;        // 0..63: tile row
    let load_k = (tid % 4u) * 4u; // 0, 4, 8, 12
    for (var k0 = k_begin; k0 < k_end; k0 = k0 + TK) {
        let ar = row0 + load_r;
        let wr = col0 + load_r;
        var av = vec4<f32>(0.0);
        var wv = vec4<f32>(0.0);
        if (ar < p.m) {
            av = aload4(ar, k0 + load_k);
        }
        if (wr < p.n) {
            wv = wload4(wr, k0 + load_k);
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
            acc[0] = fma(vec4<f32>(av4.x), wv4, acc[0]);
            acc[1] = fma(vec4<f32>(av4.y), wv4, acc[1]);
            acc[2] = fma(vec4<f32>(av4.z), wv4, acc[2]);
            acc[3] = fma(vec4<f32>(av4.w), wv4, acc[3]);
        }
        workgroupBarrier();
        // A span ends: its sums join the total (the first span's are the total).
        if ((k0 + TK) % KC == 0u || k0 + TK >= k_end) {
            for (var i = 0u; i < 4u; i = i + 1u) {
                if (k0 < k_begin + KC) {
                    total[i] = acc[i];
                } else {
                    total[i] = total[i] + acc[i];
                }
                acc[i] = vec4<f32>(0.0);
            }
        }
    }
    for (var i = 0u; i < 4u; i = i + 1u) {
        let r = row0 + lid.y * 4u + i;
        if (r < p.m) {
            for (var j = 0u; j < 4u; j = j + 1u) {
                let c = col0 + lid.x * 4u + j;
                if (c < p.n) {
                    if (p.split != 0u) {
                        out[(span * p.m + r) * p.ldo + p.n_off + c] = total[i][j];
                    } else {
                        out[r * p.ldo + p.n_off + c] = finish(total[i][j], c);
                    }
                }
            }
        }
    }
}

// Split matmul's second pass, over every output column at once (n_off = 0, ldo = n):
// out[r, c] = act(spans' sums in span order + bias[c]).
@compute @workgroup_size(64)
fn matmul_reduce(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 64u + gid.x;
    if (i >= p.m * p.ldo) {
        return;
    }
    let spans = (p.k + KC - 1u) / KC;
    var total = part[i];
    for (var s = 1u; s < spans; s = s + 1u) {
        total = total + part[s * p.m * p.ldo + i];
    }
    out[i] = finish(total, i % p.ldo);
}

// Decode batches: up to 8 rows share each weight read. Their accumulators are eight
// named scalars (a private array indexed by a loop variable would live in slow scratch
// memory); rows at or past m are skipped by uniform branches, so m = 1 does one FMA.
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

// 256 invocations = 8 output columns x 32 lanes. The lanes of a column read 32
// consecutive steps of weights (a 128- to 512-byte run in f32), the classic one-warp-per-row
// GEMV, then a tree reduction in workgroup memory.
@compute @workgroup_size(256)
fn gemv(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) tid: u32) {
    let col = (wg.y * nwg.x + wg.x) * 8u + tid / 32u;
    let lane = tid % 32u;
    var acc = Acc8();
    if (col < p.n) {
        for (var g = lane; g < p.k / wstep; g = g + 32u) {
            wdot(&acc, col, g);
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

// One invocation per output column, walking its weight row alone: no workgroup memory
// and no barriers. Uncoalesced on GPUs, but on CPU-backed Vulkan (lavapipe) it is 3x
// faster than the cooperative kernel, so the backend picks it for CPU-type adapters.
@compute @workgroup_size(64)
fn gemv_thread(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let col = gid.y * nwg.x * 64u + gid.x;
    if (col >= p.n) {
        return;
    }
    var acc = Acc8();
    for (var g = 0u; g < p.k / wstep; g = g + 1u) {
        wdot(&acc, col, g);
    }
    for (var r = 0u; r < p.m; r = r + 1u) {
        out[r * p.ldo + p.n_off + col] = finish(row_of(acc, r), col);
    }
}

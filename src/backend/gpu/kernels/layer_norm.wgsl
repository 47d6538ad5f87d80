// LayerNorm over each row, one 256-invocation workgroup per row. Two passes over the
// row (mean, then the mean of squared deviations) rather than E[x^2] - E[x]^2, which
// cancels catastrophically for rows with a large mean.
//
// `layer_norm`:     out = (x - mean) / sqrt(var + eps) * gain + shift
// `add_layer_norm`: x += y (written back: the residual stream), then out = LN(x)
// `rms_norm`:       out = x / sqrt(mean(x^2) + eps) * gain (Llama's RMSNorm)
// `add_rms_norm`:   x += y, then out = RMSNorm(x)
// `qk_norm`:        in place, RMSNorm of each query head of a qkv row with `gain` and of
//                   each key head with `shift` (the key gain); one workgroup per head,
//                   `rows` = rows × (query + key heads), `cols` = head size, `heads` =
//                   query heads << 16 | key heads. The value heads are left as they are.

struct Params {
    rows: u32,
    cols: u32,
    eps: f32,
    heads: u32, // qk_norm only
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> y: array<f32>;
@group(0) @binding(3) var<storage, read> gain: array<f32>;
@group(0) @binding(4) var<storage, read> shift: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<f32>;

fn normalize_row(row: u32, tid: u32) {
    let base = row * p.cols;
    var s = 0.0;
    for (var c = tid; c < p.cols; c = c + 256u) {
        s = s + x[base + c];
    }
    let mean = workgroup_sum(tid, s) / f32(p.cols);
    var q = 0.0;
    for (var c = tid; c < p.cols; c = c + 256u) {
        let d = x[base + c] - mean;
        q = q + d * d;
    }
    let inv = 1.0 / sqrt(workgroup_sum(tid, q) / f32(p.cols) + p.eps);
    for (var c = tid; c < p.cols; c = c + 256u) {
        out[base + c] = (x[base + c] - mean) * inv * gain[c] + shift[c];
    }
}

@compute @workgroup_size(256)
fn layer_norm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
              @builtin(local_invocation_index) tid: u32) {
    let row = wg.y * nwg.x + wg.x;
    if (row >= p.rows) {
        return;
    }
    normalize_row(row, tid);
}

@compute @workgroup_size(256)
fn add_layer_norm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                  @builtin(local_invocation_index) tid: u32) {
    let row = wg.y * nwg.x + wg.x;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.cols;
    for (var c = tid; c < p.cols; c = c + 256u) {
        x[base + c] = x[base + c] + y[base + c];
    }
    // Each invocation reads back only the columns it wrote, so no barrier is needed.
    normalize_row(row, tid);
}

fn rms_normalize_row(row: u32, tid: u32) {
    let base = row * p.cols;
    var q = 0.0;
    for (var c = tid; c < p.cols; c = c + 256u) {
        q = q + x[base + c] * x[base + c];
    }
    let inv = 1.0 / sqrt(workgroup_sum(tid, q) / f32(p.cols) + p.eps);
    for (var c = tid; c < p.cols; c = c + 256u) {
        out[base + c] = x[base + c] * inv * gain[c];
    }
}

@compute @workgroup_size(256)
fn rms_norm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
            @builtin(local_invocation_index) tid: u32) {
    let row = wg.y * nwg.x + wg.x;
    if (row >= p.rows) {
        return;
    }
    rms_normalize_row(row, tid);
}

@compute @workgroup_size(256)
fn add_rms_norm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
                @builtin(local_invocation_index) tid: u32) {
    let row = wg.y * nwg.x + wg.x;
    if (row >= p.rows) {
        return;
    }
    let base = row * p.cols;
    for (var c = tid; c < p.cols; c = c + 256u) {
        x[base + c] = x[base + c] + y[base + c];
    }
    rms_normalize_row(row, tid);
}

@compute @workgroup_size(256)
fn qk_norm(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
           @builtin(local_invocation_index) tid: u32) {
    let seg = wg.y * nwg.x + wg.x;
    if (seg >= p.rows) {
        return;
    }
    let nq = p.heads >> 16u;
    let nk = p.heads & 0xffffu;
    let row = seg / (nq + nk);
    let h = seg % (nq + nk);
    let base = (row * (nq + 2u * nk) + h) * p.cols;
    var q = 0.0;
    for (var c = tid; c < p.cols; c = c + 256u) {
        q = q + x[base + c] * x[base + c];
    }
    let inv = 1.0 / sqrt(workgroup_sum(tid, q) / f32(p.cols) + p.eps);
    // Each invocation rewrites only the columns it read.
    for (var c = tid; c < p.cols; c = c + 256u) {
        x[base + c] = x[base + c] * inv * select(shift[c], gain[c], h < nq);
    }
}

// Element-wise kernels over f32 activations: residual add and GELU (in place).
//
// `n` elements, one per invocation; the grid may be 2-D when n / 256 exceeds the
// 65535 workgroups one dimension allows, so the flat index folds y into x.

struct Params {
    n: u32,
    _pad0: u32,
    _pad1: u32,
    _pad2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> y: array<f32>;

// x += y
@compute @workgroup_size(256)
fn add(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i < p.n) {
        x[i] = x[i] + y[i];
    }
}

// x = gelu(x) (gelu_tanh is in common.wgsl)
@compute @workgroup_size(256)
fn gelu(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i < p.n) {
        x[i] = gelu_tanh(x[i]);
    }
}

// Element-wise kernels over f32 activations: residual add, GELU and scaling (in place),
// SwiGLU and GeGLU.
//
// `n` elements, one per invocation; the grid may be 2-D when n / 256 exceeds the
// 65535 workgroups one dimension allows, so the flat index folds y into x.

struct Params {
    n: u32,
    f: u32, // swiglu, geglu: output columns (the input has 2f: gate | up)
    s_bits: u32, // scale: the factor's f32 bits
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

// x = silu(gate) * up, where y is (T, 2f) holding gate | up and x is (T, f).
// silu(g) = g / (1 + exp(-g)): exp overflows to +inf for g < -88, giving -0, the limit.
@compute @workgroup_size(256)
fn swiglu(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i < p.n) {
        let t = i / p.f;
        let c = i % p.f;
        let g = y[t * 2u * p.f + c];
        x[i] = g / (1.0 + exp(-g)) * y[t * 2u * p.f + p.f + c];
    }
}

// x = gelu(gate) * up, where y is (T, 2f) holding gate | up and x is (T, f).
@compute @workgroup_size(256)
fn geglu(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i < p.n) {
        let t = i / p.f;
        let c = i % p.f;
        x[i] = gelu_tanh(y[t * 2u * p.f + c]) * y[t * 2u * p.f + p.f + c];
    }
}

// x *= s
@compute @workgroup_size(256)
fn scale(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i < p.n) {
        x[i] = x[i] * bitcast<f32>(p.s_bits);
    }
}

// Workgroup-wide reductions over 256 invocations (for kernels that need them; the Rust
// side appends this file after common.wgsl). Every invocation must call them.

var<workgroup> partial: array<f32, 256>;

fn workgroup_sum(tid: u32, v: f32) -> f32 {
    partial[tid] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (tid < s) {
            partial[tid] = partial[tid] + partial[tid + s];
        }
        workgroupBarrier();
    }
    let total = partial[0];
    workgroupBarrier();
    return total;
}

fn workgroup_max(tid: u32, v: f32) -> f32 {
    partial[tid] = v;
    workgroupBarrier();
    for (var s = 128u; s > 0u; s = s >> 1u) {
        if (tid < s) {
            partial[tid] = max(partial[tid], partial[tid + s]);
        }
        workgroupBarrier();
    }
    let m = partial[0];
    workgroupBarrier();
    return m;
}

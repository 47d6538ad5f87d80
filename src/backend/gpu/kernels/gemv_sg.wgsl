// Decode GEMV with subgroup reductions (appended to matmul.wgsl, dense or quantized, when the
// adapter has wgpu's subgroup feature, which the device is then opened with).
//
// Each subgroup owns whole output columns: its lanes stride along the column's weight
// row and `subgroupAdd` sums them, no workgroup memory traffic, no tree of barriers.
// Nothing assumes how wide a subgroup is, which invocations form one, or that it is
// full: each lane numbers itself by an exclusive prefix sum over its subgroup, each
// subgroup numbers itself with one workgroup atomic (taken by its lane 0), and the
// workgroup's `group_cols` columns (set by the host) are dealt out to however many
// subgroups there are. `wstep` is the weight values one lane takes per step (1 for
// dense.wgsl, 4 for the 4-vector accesses) and `wdot` accumulates them.

var<workgroup> sg_count: atomic<u32>;

@compute @workgroup_size(256)
fn SG_ENTRY(@builtin(workgroup_id) wg: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let lane = subgroupExclusiveAdd(1u);
    let size = subgroupAdd(1u);
    var mine = 0u;
    if (lane == 0u) {
        mine = atomicAdd(&sg_count, 1u); // workgroup memory starts at zero
    }
    let sg = subgroupMax(mine); // the other lanes hold 0
    workgroupBarrier();
    let nsg = atomicLoad(&sg_count);
    let first = (wg.y * nwg.x + wg.x) * p.group_cols;
    let last = min(first + p.group_cols, p.n);
    for (var col = first + sg; col < last; col = col + nsg) {
        var acc = Acc8();
        // The same trip count on every lane (only the last step's tail is masked), so
        // the subgroup is converged at each subgroupAdd below.
        for (var g0 = 0u; g0 < p.k / wstep; g0 = g0 + size) {
            if (g0 + lane < p.k / wstep) {
                wdot(&acc, col, g0 + lane);
            }
        }
        acc.r0 = subgroupAdd(acc.r0);
        if (p.m > 1u) { acc.r1 = subgroupAdd(acc.r1); }
        if (p.m > 2u) { acc.r2 = subgroupAdd(acc.r2); }
        if (p.m > 3u) { acc.r3 = subgroupAdd(acc.r3); }
        if (p.m > 4u) { acc.r4 = subgroupAdd(acc.r4); }
        if (p.m > 5u) { acc.r5 = subgroupAdd(acc.r5); }
        if (p.m > 6u) { acc.r6 = subgroupAdd(acc.r6); }
        if (p.m > 7u) { acc.r7 = subgroupAdd(acc.r7); }
        if (lane == 0u) {
            for (var r = 0u; r < p.m; r = r + 1u) {
                out[r * p.ldo + p.n_off + col] = finish(row_of(acc, r), col);
            }
        }
    }
}

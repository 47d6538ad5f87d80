// Embedding gather: out[r, :] = table[ids[r], :] for the ids that fall in this chunk of
// table rows [row0, row0 + chunk_rows). A table larger than one storage binding is
// gathered chunk by chunk, each dispatch writing only its own rows.

struct Params {
    rows: u32,
    cols: u32,
    row0: u32,
    chunk_rows: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> table: array<W>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(256)
fn embed(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x;
    if (i >= p.rows * p.cols) {
        return;
    }
    let r = i / p.cols;
    let id = ids[r];
    if (id >= p.row0 && id - p.row0 < p.chunk_rows) {
        out[i] = f32(table[(id - p.row0) * p.cols + i % p.cols]);
    }
}

// Embedding gather from a block-quantized table: out[r, :] = decoded table[ids[r], :]
// for the ids that fall in this chunk of table rows [row0, row0 + chunk_rows); each
// invocation decodes four values (quant.wgsl), equal to the reference's decoding.

struct Params {
    rows: u32,
    cols: u32,
    row0: u32,
    chunk_rows: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> ids: array<u32>;
@group(0) @binding(3) var<storage, read_write> out: array<vec4<f32>>;

@compute @workgroup_size(256)
fn qembed(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.y * nwg.x * 256u + gid.x; // a group of 4 output values
    let c4 = p.cols / 4u;
    if (i >= p.rows * c4) {
        return;
    }
    let r = i / c4;
    let id = ids[r];
    if (id >= p.row0 && id - p.row0 < p.chunk_rows) {
        out[i] = wq4(id - p.row0, p.cols, (i % c4) * 4u);
    }
}

//! The reference CPU backend: plain Rust, written to be read and trusted.
//!
//! Every other backend is tested against this one. It computes in f32 like HF
//! transformers (LayerNorm statistics in f64), keeps weights as f32 and uses rayon only
//! where it is free to do so: independent output rows and column blocks of a matmul,
//! independent rows of attention.

use rayon::prelude::*;

use super::{
    AttentionSpec, Backend, BackendError, BackendResult, HostMatrix, KvCache, KvLayout, KvRings, KvShape, MatrixLayout,
    SeqSlice, attention_pieces, check_attention, rope_row,
};
use crate::tensor::TensorView;

/// Output columns per parallel task in `linear`.
const COL_BLOCK: usize = 256;

pub struct ReferenceBackend;

pub struct RefMatrix {
    layout: MatrixLayout,
    /// Logical dims: `y = x @ W` maps `n_in` → `n_out`.
    n_in: usize,
    n_out: usize,
    /// As stored: `[n_in, n_out]` for InOut, `[n_out, n_in]` for OutIn.
    data: Vec<f32>,
}

pub struct RefKvCache {
    capacity: usize,
    width: usize,
    /// Per layer: (keys, values), each `[slots, width]`: position `pos` in slot
    /// `pos % slots` ([`KvRings`]).
    layers: Vec<(Vec<f32>, Vec<f32>)>,
    rings: KvRings,
}

impl KvCache for RefKvCache {
    fn shape(&self) -> KvShape {
        KvShape { n_layer: self.layers.len(), capacity: self.capacity, width: self.width }
    }
    fn rings(&self) -> &KvRings {
        &self.rings
    }
}

fn f32_data(t: &TensorView) -> BackendResult<Vec<f32>> {
    t.to_f32().map_err(BackendError::Invalid)
}

/// Dot product with eight independent partial sums (the compiler vectorizes this).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let (ac, bc) = (a.chunks_exact(8), b.chunks_exact(8));
    let tail: f32 = ac.remainder().iter().zip(bc.remainder()).map(|(x, y)| x * y).sum();
    for (x, y) in ac.zip(bc) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    acc.iter().sum::<f32>() + tail
}

/// SiLU (swish): `x · sigmoid(x)`, as `x / (1 + e^-x)`: finite for every finite `x`
/// (`e^-x` overflowing to infinity gives `-0`).
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
}

/// RMSNorm of one row with its statistics in f64: `x / sqrt(mean(x²) + eps) · gain`.
fn rms_norm_in_place(row: &mut [f32], gain: &[f32], eps: f32) {
    let mean_sq = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / row.len() as f64;
    let inv_rms = 1.0 / (mean_sq + eps as f64).sqrt();
    for (v, g) in row.iter_mut().zip(gain) {
        *v = (*v as f64 * inv_rms) as f32 * g;
    }
}

impl Backend for ReferenceBackend {
    type Matrix = RefMatrix;
    type Vector = Vec<f32>;
    type Act = HostMatrix;
    type KvCache = RefKvCache;

    fn name(&self) -> String {
        "reference".into()
    }

    fn load_matrix(&self, t: &TensorView, layout: MatrixLayout) -> BackendResult<RefMatrix> {
        let &[rows, cols] = t.shape else { refuse!("tensor {:?} has shape {:?}, expected 2 dims", t.name, t.shape) };
        let (n_in, n_out) = match layout {
            MatrixLayout::InOut => (rows, cols),
            MatrixLayout::OutIn => (cols, rows),
        };
        Ok(RefMatrix { layout, n_in, n_out, data: f32_data(t)? })
    }

    fn load_vector(&self, t: &TensorView) -> BackendResult<Vec<f32>> {
        check!(t.shape.len() == 1, "tensor {:?} has shape {:?}, expected 1 dim", t.name, t.shape);
        f32_data(t)
    }

    fn copy_kv_prefix(&self, src: &RefKvCache, dst: &mut RefKvCache, n: usize, head_dim: usize) -> BackendResult<()> {
        super::check_kv_copy(src, dst, n, head_dim)?;
        let w = src.width;
        for (layer, ((sk, sv), (dk, dv))) in src.layers.iter().zip(dst.layers.iter_mut()).enumerate() {
            for run in src.rings.copy_runs(&mut dst.rings, layer, n) {
                let (from, to) = (run.from * w..(run.from + run.len) * w, run.to * w..(run.to + run.len) * w);
                dk[to.clone()].copy_from_slice(&sk[from.clone()]);
                dv[to].copy_from_slice(&sv[from]);
            }
        }
        Ok(())
    }

    fn new_kv_cache_in(&self, layout: &KvLayout) -> BackendResult<RefKvCache> {
        layout.check()?;
        let n_layer = layout.slots.len();
        let layers = layout
            .slots
            .iter()
            .map(|&slots| {
                let n = slots
                    .checked_mul(layout.width)
                    .ok_or_else(|| BackendError::Memory("KV cache size overflows".into()))?;
                Ok((super::kv_zeros(n, 0.0, n_layer)?, super::kv_zeros(n, 0.0, n_layer)?))
            })
            .collect::<BackendResult<Vec<_>>>()?;
        Ok(RefKvCache { capacity: layout.capacity, width: layout.width, layers, rings: KvRings::new(layout) })
    }

    fn upload(&self, m: &HostMatrix) -> HostMatrix {
        m.clone()
    }

    fn embed(&self, table: &RefMatrix, ids: &[u32]) -> HostMatrix {
        assert_eq!(table.layout, MatrixLayout::OutIn, "embedding tables are [rows, dim]");
        let dim = table.n_in;
        let mut out = HostMatrix::zeros(ids.len(), dim);
        for (row, &id) in out.data.chunks_mut(dim).zip(ids) {
            row.copy_from_slice(&table.data[id as usize * dim..(id as usize + 1) * dim]);
        }
        out
    }

    fn layer_norm(&self, x: &HostMatrix, gain: &Vec<f32>, shift: &Vec<f32>, eps: f32) -> HostMatrix {
        let mut out = x.clone();
        out.data.par_chunks_mut(x.cols).for_each(|row| {
            let n = row.len() as f64;
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() / n;
            let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
            let inv_std = 1.0 / (var + eps as f64).sqrt();
            for ((v, g), b) in row.iter_mut().zip(gain).zip(shift) {
                *v = ((*v as f64 - mean) * inv_std) as f32 * g + b;
            }
        });
        out
    }

    fn linear(&self, x: &HostMatrix, w: &RefMatrix, bias: Option<&Vec<f32>>) -> HostMatrix {
        assert_eq!(x.cols, w.n_in, "linear: input width");
        let (n_in, n_out) = (w.n_in, w.n_out);
        let mut out = HostMatrix::zeros(x.rows, n_out);
        out.data.par_chunks_mut(n_out).enumerate().for_each(|(t, out_row)| {
            let x_row = x.row(t);
            out_row.par_chunks_mut(COL_BLOCK).enumerate().for_each(|(blk, seg)| {
                let j0 = blk * COL_BLOCK;
                match bias {
                    Some(b) => seg.copy_from_slice(&b[j0..j0 + seg.len()]),
                    None => seg.fill(0.0),
                }
                match w.layout {
                    // out[j] += Σ_k x[k] · W[k][j]: stream rows of W.
                    MatrixLayout::InOut => {
                        for (k, &xk) in x_row.iter().enumerate() {
                            let w_row = &w.data[k * n_out + j0..k * n_out + j0 + seg.len()];
                            for (o, &wv) in seg.iter_mut().zip(w_row) {
                                *o += xk * wv;
                            }
                        }
                    }
                    // out[j] += x · W[j]: one dot product per output.
                    MatrixLayout::OutIn => {
                        for (i, o) in seg.iter_mut().enumerate() {
                            let j = j0 + i;
                            *o += dot(x_row, &w.data[j * n_in..(j + 1) * n_in]);
                        }
                    }
                }
            });
        });
        out
    }

    fn gelu(&self, x: &mut HostMatrix) {
        x.data.par_iter_mut().for_each(|v| *v = gelu_tanh(*v));
    }

    fn add(&self, x: &mut HostMatrix, y: &HostMatrix) {
        assert_eq!((x.rows, x.cols), (y.rows, y.cols), "add: shapes");
        for (a, b) in x.data.iter_mut().zip(&y.data) {
            *a += b;
        }
    }

    fn rms_norm(&self, x: &HostMatrix, gain: &Vec<f32>, eps: f32) -> HostMatrix {
        let mut out = x.clone();
        if x.cols == 0 {
            return out;
        }
        out.data.par_chunks_mut(x.cols).for_each(|row| rms_norm_in_place(row, gain, eps));
        out
    }

    fn swiglu(&self, x: &HostMatrix) -> HostMatrix {
        let f = x.cols / 2;
        let mut out = HostMatrix::zeros(x.rows, f);
        for (o, row) in out.data.chunks_mut(f.max(1)).zip(x.data.chunks(x.cols.max(1))) {
            let (gate, up) = row.split_at(f);
            for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                *o = silu(g) * u;
            }
        }
        out
    }

    fn geglu(&self, x: &HostMatrix) -> HostMatrix {
        let f = x.cols / 2;
        let mut out = HostMatrix::zeros(x.rows, f);
        for (o, row) in out.data.chunks_mut(f.max(1)).zip(x.data.chunks(x.cols.max(1))) {
            let (gate, up) = row.split_at(f);
            for ((o, &g), &u) in o.iter_mut().zip(gate).zip(up) {
                *o = gelu_tanh(g) * u;
            }
        }
        out
    }

    fn scale(&self, x: &mut HostMatrix, s: f32) {
        x.data.iter_mut().for_each(|v| *v *= s);
    }

    fn qk_norm(
        &self,
        qkv: &mut HostMatrix,
        spec: &AttentionSpec,
        q_gain: &Vec<f32>,
        k_gain: &Vec<f32>,
        eps: f32,
    ) -> BackendResult<()> {
        super::check_qk_norm(qkv.cols, spec, q_gain.len(), k_gain.len())?;
        let (hd, nq, nk) = (spec.head_dim, spec.n_head, spec.n_kv_head);
        for row in qkv.data.chunks_mut(qkv.cols) {
            for (i, head) in row[..(nq + nk) * hd].chunks_mut(hd).enumerate() {
                rms_norm_in_place(head, if i < nq { q_gain } else { k_gain }, eps);
            }
        }
        Ok(())
    }

    fn attention(
        &self,
        qkv: &HostMatrix,
        seqs: &[SeqSlice],
        caches: &mut [&mut RefKvCache],
        layer: usize,
        spec: &AttentionSpec,
    ) -> BackendResult<HostMatrix> {
        check_attention(qkv.rows, qkv.cols, seqs, caches, layer, spec)?;
        let (hd, qw, kw) = (spec.head_dim, spec.q_width(), spec.kv_width());
        // 1. Rotate queries and keys.
        let mut qkv = qkv.clone();
        if let Some(rope) = &spec.rope {
            for seq in seqs {
                for (i, r) in seq.rows.clone().enumerate() {
                    rope_row(spec, rope, &mut qkv.data[r * qkv.cols..(r + 1) * qkv.cols], seq.start_pos + i);
                }
            }
        }
        let mut out = HostMatrix::zeros(qkv.rows, qw);
        // A ring layer takes a long slice in pieces ([`attention_pieces`]).
        for piece in attention_pieces(seqs, caches, layer, spec, usize::MAX) {
            // 2. Append each sequence's new keys and values.
            let mut row_info = vec![None; qkv.rows]; // (sequence, position) per row of the piece
            for (s, seq) in &piece {
                let cache = &mut *caches[*s];
                let (k_cache, v_cache) = &mut cache.layers[layer];
                for (i, r) in seq.rows.clone().enumerate() {
                    let pos = seq.start_pos + i;
                    let slot = cache.rings.slot(layer, pos);
                    let row = qkv.row(r);
                    k_cache[slot * kw..(slot + 1) * kw].copy_from_slice(&row[qw..qw + kw]);
                    v_cache[slot * kw..(slot + 1) * kw].copy_from_slice(&row[qw + kw..]);
                    row_info[r] = Some((*s, pos));
                }
                cache.rings.wrote(layer, seq.start_pos, seq.start_pos + seq.rows.len());
            }
            // 3. Each row attends over positions 0..=pos of its sequence, head by head;
            //    query head h reads key/value head h / group.
            let caches: Vec<&RefKvCache> = caches.iter().map(|c| &**c).collect();
            out.data.par_chunks_mut(qw).enumerate().for_each(|(r, out_row)| {
                let Some((s, pos)) = row_info[r] else { return };
                let cache = caches[s];
                let (k_cache, v_cache) = &cache.layers[layer];
                let first = spec.first_key(pos);
                let mut scores = vec![0.0f32; pos + 1 - first];
                for h in 0..spec.n_head {
                    let kv = (h / spec.group()) * hd;
                    let q = &qkv.row(r)[h * hd..(h + 1) * hd];
                    for (i, score) in scores.iter_mut().enumerate() {
                        let j = cache.rings.slot(layer, first + i);
                        *score = dot(q, &k_cache[j * kw + kv..j * kw + kv + hd]) * spec.scale;
                    }
                    softmax_in_place(&mut scores);
                    let o = &mut out_row[h * hd..(h + 1) * hd];
                    for (i, &p) in scores.iter().enumerate() {
                        let j = cache.rings.slot(layer, first + i);
                        for (ov, &vv) in o.iter_mut().zip(&v_cache[j * kw + kv..j * kw + kv + hd]) {
                            *ov += p * vv;
                        }
                    }
                }
            });
        }
        Ok(out)
    }

    fn select_rows(&self, x: &HostMatrix, rows: &[usize]) -> HostMatrix {
        let mut out = HostMatrix::zeros(rows.len(), x.cols);
        for (dst, &r) in out.data.chunks_mut(x.cols).zip(rows) {
            dst.copy_from_slice(x.row(r));
        }
        out
    }

    fn to_host(&self, x: &HostMatrix, out: &mut HostMatrix) -> BackendResult<()> {
        out.reshape(x.rows, x.cols);
        out.data.copy_from_slice(&x.data);
        Ok(())
    }
}

/// Numerically stable softmax; the normaliser is summed in f64, so long rows (thousands
/// of positions) carry no summation error worth the name.
pub fn softmax_in_place(v: &mut [f32]) {
    let max = v.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0.0f64;
    for x in v.iter_mut() {
        *x = (*x - max).exp();
        sum += *x as f64;
    }
    for x in v.iter_mut() {
        *x = (*x as f64 / sum) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_matches_known_values_and_survives_large_inputs() {
        // torch.nn.functional.gelu(x, approximate="tanh")
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-6);
        assert!((gelu_tanh(-0.5) - -0.154_286).abs() < 1e-6);
        // Miri models libm's tanh as a few ulp imprecise (tanh(huge) may be 1 - 2^-24);
        // real libms return exactly ±1 there, so the exact checks hold outside miri.
        let exact = |got: f32, want: f32| {
            if cfg!(miri) { (got - want).abs() <= 1e-6 * want.abs().max(1e-30) } else { got == want }
        };
        assert!(exact(gelu_tanh(1e3), 1e3));
        assert!(exact(gelu_tanh(-1e3), 0.0) || (cfg!(miri) && gelu_tanh(-1e3).abs() < 1e-3));
        assert!(exact(gelu_tanh(3e38), 3e38));
    }

    #[test]
    fn softmax_is_stable() {
        let mut v = [1000.0, 1000.0, -1e30];
        softmax_in_place(&mut v);
        assert_eq!(v, [0.5, 0.5, 0.0]);
    }
}

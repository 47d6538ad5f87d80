//! The backend interface: the handful of operations the models need, implemented once
//! per device: [`reference`] (plain Rust, the ground truth), [`cpu`] (SIMD, threads) and
//! `gpu` (WGSL through wgpu).
//!
//! Models are written once over [`Backend`]. A backend owns the form its weights take
//! ([`Backend::Matrix`]: f32 here, f16/quantized/GPU-resident elsewhere), its
//! activations and its KV-cache storage. Batches are flat: the rows of one forward
//! call may come from several sequences, each at its own position ([`SeqSlice`]), so
//! one call can prefill a prompt and decode a step for other sequences together.

pub mod cpu;
#[cfg(feature = "gpu")]
pub mod gpu;
pub mod reference;

use std::ops::Range;

use anyhow::ensure;

use crate::loaders::safetensors::TensorView;

/// How the fast backends store weights in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    F16,
    BF16,
}

impl WeightDtype {
    pub fn name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "f32",
            WeightDtype::F16 => "f16",
            WeightDtype::BF16 => "bf16",
        }
    }

    pub fn size(self) -> usize {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::F16 | WeightDtype::BF16 => 2,
        }
    }
}

/// The size of a KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    /// Layers it holds keys and values for.
    pub n_layer: usize,
    /// Positions it has room for.
    pub capacity: usize,
    /// Values per position and layer, for keys and for values each (the model width).
    pub width: usize,
}

/// What every backend's KV cache knows about itself, so that a batch is checked against
/// it before any kernel runs.
pub trait KvCache: Send {
    fn shape(&self) -> KvShape;
}

/// The checks every backend's [`Backend::attention`] makes before touching a cache, so
/// misuse is an error, the same one on every backend, and never an out-of-bounds write.
pub fn check_attention<K: KvCache>(
    qkv_rows: usize,
    qkv_cols: usize,
    seqs: &[SeqSlice],
    caches: &[&mut K],
    layer: usize,
    n_head: usize,
) -> anyhow::Result<()> {
    ensure!(seqs.len() == caches.len(), "attention: {} sequences but {} KV caches", seqs.len(), caches.len());
    ensure!(qkv_cols.is_multiple_of(3), "attention: qkv width {qkv_cols} is not 3 × the model width");
    let c = qkv_cols / 3;
    ensure!(n_head > 0 && c.is_multiple_of(n_head), "attention: width {c} does not split into {n_head} heads");
    let mut covered = 0;
    for (s, cache) in seqs.iter().zip(caches) {
        ensure!(
            s.rows.start == covered && s.rows.start <= s.rows.end && s.rows.end <= qkv_rows,
            "attention: sequence rows {:?} do not continue the batch's rows in order (next row {covered} of {qkv_rows})",
            s.rows
        );
        covered = s.rows.end;
        let shape = cache.shape();
        ensure!(shape.width == c, "attention: KV cache width {} but the model width is {c}", shape.width);
        ensure!(layer < shape.n_layer, "attention: layer {layer} but the KV cache has {} layers", shape.n_layer);
        let end = s.start_pos.checked_add(s.rows.len());
        ensure!(
            end.is_some_and(|e| e <= shape.capacity),
            "attention: positions {}..{} do not fit the KV cache of {} positions",
            s.start_pos,
            end.map_or("overflow".to_owned(), |e| e.to_string()),
            shape.capacity
        );
    }
    ensure!(covered == qkv_rows, "attention: the sequences cover {covered} of the batch's {qkv_rows} rows");
    Ok(())
}

/// How a weight matrix is stored in the file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MatrixLayout {
    /// `[in, out]`, used as `y = x @ W` (HF's GPT-2 `Conv1D`).
    InOut,
    /// `[out, in]`, used as `y = x @ W^T` (`nn.Linear`; an embedding table used as LM head).
    OutIn,
}

/// Rows `rows` of a batch belong to one sequence and sit at positions
/// `start_pos .. start_pos + rows.len()` of it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqSlice {
    pub rows: Range<usize>,
    pub start_pos: usize,
}

/// A dense row-major f32 matrix in host memory.
#[derive(Clone, Debug, PartialEq)]
pub struct HostMatrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl HostMatrix {
    pub fn zeros(rows: usize, cols: usize) -> Self {
        HostMatrix { rows, cols, data: vec![0.0; rows * cols] }
    }

    /// Resize to (rows, cols), keeping the allocation when it is large enough.
    pub fn reshape(&mut self, rows: usize, cols: usize) {
        self.rows = rows;
        self.cols = cols;
        self.data.resize(rows * cols, 0.0);
    }

    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

/// What [`Backend::argmax_rows`] gives for a row with a non-finite value.
pub const NON_FINITE_ROW: u32 = u32::MAX;

pub trait Backend: Sync {
    /// A weight matrix in the backend's own form.
    type Matrix: Send + Sync;
    /// A bias or LayerNorm gain/shift.
    type Vector: Send + Sync;
    /// Activations: a (rows, cols) matrix on the device.
    type Act;
    /// One sequence's keys and values for every layer.
    type KvCache: KvCache;

    /// Short name shown to users ("reference", "cpu", "gpu").
    fn name(&self) -> String;

    fn load_matrix(&self, t: &TensorView, layout: MatrixLayout) -> anyhow::Result<Self::Matrix>;
    fn load_vector(&self, t: &TensorView) -> anyhow::Result<Self::Vector>;
    /// KV storage for `capacity` positions of `n_layer` layers, `width` values per position.
    fn new_kv_cache(&self, n_layer: usize, capacity: usize, width: usize) -> anyhow::Result<Self::KvCache>;

    /// Activations from host data (inputs for tests and parity checks).
    fn upload(&self, m: &HostMatrix) -> Self::Act;

    /// Rows `ids` of an `OutIn` table: (T, cols). Ids are checked by the caller.
    fn embed(&self, table: &Self::Matrix, ids: &[u32]) -> Self::Act;
    /// Per-row LayerNorm with gain and shift.
    fn layer_norm(&self, x: &Self::Act, gain: &Self::Vector, shift: &Self::Vector, eps: f32) -> Self::Act;
    /// `x @ W (+ bias)`: (T, in) → (T, out).
    fn linear(&self, x: &Self::Act, w: &Self::Matrix, bias: Option<&Self::Vector>) -> Self::Act;
    /// GELU, tanh approximation, in place.
    fn gelu(&self, x: &mut Self::Act);
    /// `x += y`.
    fn add(&self, x: &mut Self::Act, y: &Self::Act);
    /// Causal multi-head attention. `qkv` is (T, 3C) with q | k | v; each sequence's k and
    /// v rows are first written into its cache at their positions, then every row attends
    /// over positions `0..=pos` of its own sequence. `caches[i]` belongs to `seqs[i]`.
    /// Returns (T, C). Arguments that do not fit the caches are an error
    /// ([`check_attention`]), never a panic.
    fn attention(
        &self,
        qkv: &Self::Act,
        seqs: &[SeqSlice],
        caches: &mut [&mut Self::KvCache],
        layer: usize,
        n_head: usize,
        scale: f32,
    ) -> anyhow::Result<Self::Act>;
    /// The given rows of `x`, in order.
    fn select_rows(&self, x: &Self::Act, rows: &[usize]) -> Self::Act;
    /// Copy to host memory, reusing `out`'s allocation.
    fn to_host(&self, x: &Self::Act, out: &mut HostMatrix) -> anyhow::Result<()>;
    /// Copy to a new host matrix.
    fn read(&self, x: &Self::Act) -> anyhow::Result<HostMatrix> {
        let mut out = HostMatrix::zeros(0, 0);
        self.to_host(x, &mut out)?;
        Ok(out)
    }

    /// Greedy sampling on the device: the index of the largest value of each row (the
    /// lowest on ties) into `out`, so only ids cross to the host; [`NON_FINITE_ROW`]
    /// for a row holding a NaN or an infinity. Returns `Ok(false)` when the backend has
    /// no such kernel; the caller then reads the logits instead.
    fn argmax_rows(&self, _x: &Self::Act, _out: &mut Vec<u32>) -> anyhow::Result<bool> {
        Ok(false)
    }

    // Fused forms. The defaults compose the ops above; a backend overrides them when
    // fusing saves memory traffic.

    /// `gelu(x @ W + bias)`.
    fn linear_gelu(&self, x: &Self::Act, w: &Self::Matrix, bias: Option<&Self::Vector>) -> Self::Act {
        let mut y = self.linear(x, w, bias);
        self.gelu(&mut y);
        y
    }
    /// `x += y; layer_norm(x)`: the residual add and the next block's LayerNorm.
    fn add_layer_norm(
        &self,
        x: &mut Self::Act,
        y: &Self::Act,
        gain: &Self::Vector,
        shift: &Self::Vector,
        eps: f32,
    ) -> Self::Act {
        self.add(x, y);
        self.layer_norm(x, gain, shift, eps)
    }
}

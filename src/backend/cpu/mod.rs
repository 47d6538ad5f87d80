//! The fast CPU backend: packed weights (f32, f16 or bf16), AVX2/FMA kernels with a
//! portable fallback, rayon threads, and recycled activation buffers so the decode
//! loop does not touch the heap after its first step.
//!
//! Ops and what they fuse:
//! - `linear` / `linear_gelu`: GEMV (decode) or blocked GEMM (prefill) over packed
//!   panels, with bias and GELU applied to each output tile while it is in L1;
//! - `add_layer_norm`: the residual add and the next LayerNorm in one pass per row;
//! - `attention`: per (row, head) task over an f32 or f16 KV cache.

pub mod matmul;
pub mod qmatmul;
pub mod simd;
pub mod team;
pub mod weights;

use std::ops::{Deref, DerefMut, Range};
use std::sync::{Arc, Mutex};

use half::f16;
use half::slice::HalfFloatSliceExt;
use rayon::prelude::*;

use super::{
    AttentionSpec, Backend, BackendError, BackendResult, HostMatrix, KvCache, KvLayout, KvRings, KvShape, MatrixLayout,
    SeqSlice, WeightDtype, attention_pieces, check_attention, check_qk_norm, dequantized_matrix, needs_pieces,
    rope_row,
};
use crate::tensor::GgmlType;
use crate::tensor::KvDtype;
use crate::tensor::{Dtype, TensorView};
pub use matmul::PackedMatrix;
use matmul::{Causal, Epilogue, matmul, matmul_batch_invariant, matmul_causal};
pub use qmatmul::QMatrix;
use qmatmul::{Q8Rows, QType};
pub use simd::Isa;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpuOptions {
    /// Weight storage; `None` keeps the file's dtype (f32, f16 or bf16).
    pub weight_dtype: Option<WeightDtype>,
    /// Store the KV cache as f16 (half the memory and attention bandwidth).
    pub kv_dtype: KvDtype,
    pub isa: Isa,
    /// Batch invariance (what the server runs with): every row of a forward call is
    /// computed in the same order whatever else is in the batch and however a prompt is
    /// chunked: dense matmuls always take the fixed-order GEMM path
    /// ([`matmul::matmul_batch_invariant`]; the quantized kernels are row-invariant
    /// already) and attention always the per-row path (never the blocked prefill one).
    pub batch_invariant: bool,
}

impl Default for CpuOptions {
    fn default() -> Self {
        CpuOptions { weight_dtype: None, kv_dtype: KvDtype::F32, isa: Isa::detect(), batch_invariant: false }
    }
}

pub struct CpuBackend {
    opts: CpuOptions,
    pool: Arc<BufferPool>,
    /// Scratch for activations quantized to 8-bit blocks, reused across calls.
    q8: Mutex<Vec<Q8Rows>>,
}

/// A weight matrix: packed floats, or GGUF blocks kept quantized.
pub enum CpuMatrix {
    Dense(PackedMatrix),
    Quant(QMatrix),
}

impl CpuMatrix {
    pub fn n_in(&self) -> usize {
        match self {
            CpuMatrix::Dense(m) => m.n_in,
            CpuMatrix::Quant(m) => m.n_in,
        }
    }
    pub fn n_out(&self) -> usize {
        match self {
            CpuMatrix::Dense(m) => m.n_out,
            CpuMatrix::Quant(m) => m.n_out,
        }
    }
    /// Bytes of weight data.
    pub fn bytes(&self) -> usize {
        match self {
            CpuMatrix::Dense(m) => m.bytes(),
            CpuMatrix::Quant(m) => m.bytes(),
        }
    }
}

impl CpuBackend {
    /// Every `Isa` value runs on this CPU (only detection makes the non-portable ones).
    pub fn new(opts: CpuOptions) -> BackendResult<Self> {
        Ok(CpuBackend { opts, pool: Arc::new(BufferPool::default()), q8: Mutex::new(Vec::new()) })
    }

    pub fn opts(&self) -> &CpuOptions {
        &self.opts
    }

    /// A zeroed `(rows, cols)` activation.
    fn take(&self, rows: usize, cols: usize) -> CpuAct {
        CpuAct { rows, cols, buf: self.pool.take(rows * cols, true, &self.pool) }
    }

    /// A `(rows, cols)` activation for a caller that writes every element: it may hold a
    /// recycled buffer's old values (zeroing them cost ~2% of a prefill).
    fn take_to_overwrite(&self, rows: usize, cols: usize) -> CpuAct {
        CpuAct { rows, cols, buf: self.pool.take(rows * cols, false, &self.pool) }
    }

    /// `x @ W (+ bias)`, GELU'd if asked: dense or quantized weights.
    fn linear_impl(&self, x: &CpuAct, w: &CpuMatrix, bias: Option<&Vec<f32>>, gelu: bool) -> CpuAct {
        // Both products write every output.
        let mut out = self.take_to_overwrite(x.rows, w.n_out());
        match w {
            CpuMatrix::Dense(w) => {
                let epi = Epilogue { bias: bias.map(|b| b.as_slice()), gelu };
                if self.opts.batch_invariant {
                    matmul_batch_invariant(self.opts.isa, x, x.rows, w, epi, &mut out)
                } else {
                    matmul(self.opts.isa, x, x.rows, w, epi, &mut out)
                }
            }
            CpuMatrix::Quant(w) => {
                assert_eq!(x.cols, w.n_in, "linear: input width");
                let mut q8 = self.q8.lock().unwrap_or_else(|p| p.into_inner()).pop().unwrap_or_default();
                qmatmul::quantize_rows(self.opts.isa, x, x.rows, w.n_in, &mut q8);
                qmatmul::qmatmul(self.opts.isa, w, &q8, x.rows, &mut out);
                self.q8.lock().unwrap_or_else(|p| p.into_inner()).push(q8);
                if let Some(b) = bias {
                    for row in out.chunks_mut(w.n_out) {
                        row.iter_mut().zip(b).for_each(|(o, b)| *o += b);
                    }
                }
                if gelu {
                    gelu_rows(self.opts.isa, &mut out);
                }
            }
        }
        out
    }
}

/// Recycles activation buffers: after the first decode step every buffer a step needs
/// is already here, so steady-state decoding makes no heap allocations.
#[derive(Default)]
struct BufferPool {
    free: Mutex<Vec<Vec<f32>>>,
}

const POOL_MAX_BUFFERS: usize = 64;

impl BufferPool {
    /// A buffer of `n` values: zeros if `zeroed`, else whatever a recycled buffer held
    /// (values some earlier activation wrote: initialised, merely stale).
    fn take(&self, n: usize, zeroed: bool, me: &Arc<BufferPool>) -> PooledBuf {
        let mut free = self.free.lock().unwrap_or_else(|e| e.into_inner());
        // Smallest free buffer that is large enough.
        let best = free
            .iter()
            .enumerate()
            .filter(|(_, v)| v.capacity() >= n)
            .min_by_key(|(_, v)| v.capacity())
            .map(|(i, _)| i);
        let mut data = match best {
            Some(i) => free.swap_remove(i),
            None => Vec::with_capacity(n),
        };
        drop(free);
        if zeroed {
            data.clear();
        }
        data.truncate(n);
        data.resize(n, 0.0);
        PooledBuf { data, pool: me.clone() }
    }
}

struct PooledBuf {
    data: Vec<f32>,
    pool: Arc<BufferPool>,
}

impl Drop for PooledBuf {
    fn drop(&mut self) {
        let mut free = self.pool.free.lock().unwrap_or_else(|e| e.into_inner());
        if free.len() < POOL_MAX_BUFFERS {
            free.push(std::mem::take(&mut self.data));
        }
    }
}

/// A (rows, cols) activation matrix in a recycled buffer.
pub struct CpuAct {
    pub rows: usize,
    pub cols: usize,
    buf: PooledBuf,
}

impl Deref for CpuAct {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.buf.data
    }
}

impl DerefMut for CpuAct {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.buf.data
    }
}

enum KvStore {
    F32(Vec<f32>),
    F16(Vec<f16>),
}

pub struct CpuKvCache {
    capacity: usize,
    width: usize,
    /// Per layer: keys, values; each head-major `[n_head, slots, head_dim]`, so one
    /// head's keys are one contiguous stream for attention (two where a ring wraps:
    /// position `pos` is in slot `pos % slots`, [`KvRings`]).
    layers: Vec<(KvStore, KvStore)>,
    rings: KvRings,
}

impl KvCache for CpuKvCache {
    fn shape(&self) -> KvShape {
        KvShape { n_layer: self.layers.len(), capacity: self.capacity, width: self.width }
    }
    fn rings(&self) -> &KvRings {
        &self.rings
    }
}

thread_local! {
    /// Per-thread scratch of the per-row attention path: the scores of one (row, head)
    /// (the kernels read f16 rows directly). Borrowed only around plain kernel calls
    /// (no rayon join inside, so no other task can run on this thread meanwhile).
    static ATTENTION_SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
}

fn kv_write(store: &mut KvStore, start: usize, vals: &[f32]) {
    match store {
        KvStore::F32(v) => v[start..start + vals.len()].copy_from_slice(vals),
        KvStore::F16(v) => v[start..start + vals.len()].convert_from_f32_slice(vals),
    }
}

/// A raw pointer into an output buffer whose disjoint ranges are written by team parts.
#[derive(Clone, Copy)]
struct TaskOut(*mut f32);
// SAFETY: parts write disjoint ranges (see each use), and the buffer outlives `team::run`.
unsafe impl Send for TaskOut {}
unsafe impl Sync for TaskOut {}

impl TaskOut {
    /// The address `i` values in (a method, so closures capture the Sync wrapper).
    fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// Below this many (query value × key) products, or for a decode step's few rows
/// ([`team::SPLIT_MAX_ROWS`]), decode attention runs on the spinning team (or one thread)
/// rather than rayon.
const PARALLEL_ATTENTION_WORK: usize = 1 << 16;

/// Rows per piece of a long prefill slice under a sliding window (see `attention`).
const WINDOW_PIECE_ROWS: usize = 512;

/// Sequences with at least this many new rows use matmul-shaped attention.
const BLOCKED_ATTENTION_MIN_ROWS: usize = 16;

/// Offset of head `h`, slot `slot` in a head-major cache layer of `slots` positions.
fn kv_index(slots: usize, hd: usize, h: usize, slot: usize) -> usize {
    (h * slots + slot) * hd
}

/// One (row, head) of decode attention over the key/value rows of `spans` (a wrapped
/// ring's end, then its start; the second may be empty): scores, softmax, weighted values
/// into `o`. The second run's sums continue the first's in position order: the bits of
/// one run.
fn attend_runs<T: simd::KvElem>(
    isa: Isa,
    q: &[f32],
    (k, v): (&[T], &[T]),
    spans: [Range<usize>; 2],
    scale: f32,
    scores: &mut [f32],
    o: &mut [f32],
) {
    let n1 = spans[0].len() / q.len().max(1);
    let (s1, s2) = scores.split_at_mut(n1);
    simd::dot_rows(isa, q, &k[spans[0].clone()], scale, s1);
    simd::dot_rows(isa, q, &k[spans[1].clone()], scale, s2);
    simd::softmax(isa, scores);
    let (s1, s2) = scores.split_at(n1);
    simd::weighted_rows(isa, s1, &v[spans[0].clone()], o);
    if !s2.is_empty() {
        simd::weighted_rows_add(isa, s2, &v[spans[1].clone()], o);
    }
}

/// The values of `runs` of a cache layer, in order, as f32: borrowed when they are one
/// f32 run, else gathered (f16 widened exactly).
fn rows_in_order<'a>(store: &'a KvStore, runs: &[Range<usize>]) -> std::borrow::Cow<'a, [f32]> {
    match store {
        KvStore::F32(x) if runs.iter().filter(|r| !r.is_empty()).count() <= 1 => {
            std::borrow::Cow::Borrowed(runs.iter().find(|r| !r.is_empty()).map_or(&x[..0], |r| &x[r.clone()]))
        }
        KvStore::F32(x) => runs.iter().flat_map(|r| x[r.clone()].iter().copied()).collect(),
        KvStore::F16(x) => runs.iter().flat_map(|r| x[r.clone()].iter().map(|v| v.to_f32())).collect(),
    }
}

/// Causal attention of one query head over one sequence's new rows, as two matmuls:
/// S = Q·Kᵀ (T × L, L = keys so far), masked row-wise softmax, O = P·V (T × hd).
/// Keys and values are packed into panels like weights, so the GEMM kernel does the work.
fn attention_head_blocked(
    isa: Isa,
    qkv: &[f32],
    seq: &SeqSlice,
    (k_store, v_store): &(KvStore, KvStore),
    (rings, layer): (&KvRings, usize),
    spec: &AttentionSpec,
    h: usize,
) -> Vec<f32> {
    let (hd, stride, kvh) = (spec.head_dim, spec.qkv_width(), h / spec.group());
    let t = seq.rows.len();
    let end = seq.start_pos + t;
    let slots = rings.slots(layer);
    // Keys k0..end: from the first key the slice's first row sees (all of them without a
    // sliding window), so a long prompt's windowed layers cost T × window, not T².
    let k0 = spec.first_key(seq.start_pos);
    let keys = end - k0;
    let mut q = Vec::with_capacity(t * hd);
    for r in seq.rows.clone() {
        q.extend(qkv[r * stride + h * hd..r * stride + (h + 1) * hd].iter().map(|v| v * spec.scale));
    }
    // This head's cached rows k0..end, in position order: one contiguous run (see
    // `kv_index`), or two where a ring wraps, gathered (f16 widened exactly).
    let s0 = rings.slot(layer, k0);
    let n1 = keys.min(slots - s0);
    let runs = [kv_index(slots, hd, kvh, s0)..kv_index(slots, hd, kvh, s0 + n1), {
        kv_index(slots, hd, kvh, 0)..kv_index(slots, hd, kvh, keys - n1)
    }];
    let k_t = PackedMatrix::pack_f32_rows(hd, keys, &rows_in_order(k_store, &runs), true);
    let mut scores = vec![0.0f32; t * keys];
    let none = Epilogue { bias: None, gelu: false };
    let start = seq.start_pos - k0;
    matmul_causal(isa, &q, t, &k_t, none, Causal::KeyColumns { start }, &mut scores);
    for (i, row) in scores.chunks_mut(keys).enumerate() {
        let pos = seq.start_pos + i;
        let (first, visible) = (spec.first_key(pos) - k0, pos + 1 - k0);
        row[..first].fill(0.0); // keys before a sliding window weigh 0
        simd::softmax(isa, &mut row[first..visible]);
        row[visible..].fill(0.0);
    }
    let v = PackedMatrix::pack_f32_rows(keys, hd, &rows_in_order(v_store, &runs), false);
    let mut out = vec![0.0f32; t * hd];
    matmul_causal(isa, &scores, t, &v, none, Causal::KeyInner { start }, &mut out);
    out
}

/// `f(row of x, row of out)` for every row: in parallel when there are several rows (a
/// decode step's single row stays on this thread). Rows of `x` are `x_cols` wide, rows of
/// `out` `out_cols`.
fn map_rows(x: &[f32], x_cols: usize, out: &mut [f32], out_cols: usize, f: impl Fn(&[f32], &mut [f32]) + Sync) {
    if x_cols == 0 || out_cols == 0 {
        return;
    }
    let rows = x.len() / x_cols;
    if rows > 1 && rows <= team::SPLIT_MAX_ROWS {
        team::split_mut(out, out_cols, &|first, o| {
            for (i, or) in o.chunks_mut(out_cols).enumerate() {
                f(&x[(first + i) * x_cols..(first + i + 1) * x_cols], or);
            }
        });
    } else if rows > 1 {
        x.par_chunks(x_cols).zip(out.par_chunks_mut(out_cols)).for_each(|(xr, or)| f(xr, or));
    } else {
        x.chunks(x_cols).zip(out.chunks_mut(out_cols)).for_each(|(xr, or)| f(xr, or));
    }
}

/// GELU in place over an activation: a decode step's few rows on the team, more with rayon.
fn gelu_rows(isa: Isa, x: &mut CpuAct) {
    if x.rows <= team::SPLIT_MAX_ROWS {
        team::split_mut(x, 4096, &|_, c| simd::gelu(isa, c));
    } else {
        x.par_chunks_mut(4096).for_each(|c| simd::gelu(isa, c));
    }
}

/// The residual add and a row op in one pass per row: `x += y`, then `f(row of x, row of
/// out)` (the next block's norm).
fn add_map_rows(x: &mut CpuAct, y: &CpuAct, out: &mut [f32], f: impl Fn(&[f32], &mut [f32]) + Sync) {
    assert_eq!((x.rows, x.cols), (y.rows, y.cols), "add: shapes");
    let cols = x.cols;
    if cols == 0 {
        return;
    }
    let one = |((xr, yr), or): ((&mut [f32], &[f32]), &mut [f32])| {
        for (a, b) in xr.iter_mut().zip(yr) {
            *a += b;
        }
        f(xr, or);
    };
    if x.rows > 1 && x.rows <= team::SPLIT_MAX_ROWS {
        team::split2_mut(&mut x[..], cols, out, cols, &|first, xs, os| {
            for (i, (xr, or)) in xs.chunks_mut(cols).zip(os.chunks_mut(cols)).enumerate() {
                one(((xr, &y[(first + i) * cols..(first + i + 1) * cols]), or));
            }
        });
    } else if x.rows > 1 {
        x.par_chunks_mut(cols).zip(y.par_chunks(cols)).zip(out.par_chunks_mut(cols)).for_each(one);
    } else {
        x.chunks_mut(cols).zip(y.chunks(cols)).zip(out.chunks_mut(cols)).for_each(one);
    }
}

impl CpuBackend {
    /// Steps 1 and 2 of [`Backend::attention`] for the sequences `seqs` (rows of `qkv`,
    /// already rotated), whose caches are `caches[index[i]]` (`caches[i]` without an
    /// index): their rows of `out`.
    #[allow(clippy::too_many_arguments)]
    fn attention_piece(
        &self,
        qkv: &[f32],
        seqs: &[SeqSlice],
        index: Option<&[usize]>,
        caches: &mut [&mut CpuKvCache],
        layer: usize,
        spec: &AttentionSpec,
        out: &mut CpuAct,
    ) {
        let cache_of = |s: usize| index.map_or(s, |i| i[s]);
        let isa = self.opts.isa;
        let (hd, stride, qw, kw) = (spec.head_dim, spec.qkv_width(), spec.q_width(), spec.kv_width());
        let (n_head, n_rows) = (spec.n_head, out.rows);
        // 1. Append the new keys and values.
        for (s, seq) in seqs.iter().enumerate() {
            let cache = &mut *caches[cache_of(s)];
            let slots = cache.rings.slots(layer);
            let (k, v) = &mut cache.layers[layer];
            for (i, r) in seq.rows.clone().enumerate() {
                let row = &qkv[r * stride..(r + 1) * stride];
                let slot = cache.rings.slot(layer, seq.start_pos + i);
                for h in 0..spec.n_kv_head {
                    let at = kv_index(slots, hd, h, slot);
                    kv_write(k, at, &row[qw + h * hd..qw + (h + 1) * hd]);
                    kv_write(v, at, &row[qw + kw + h * hd..qw + kw + (h + 1) * hd]);
                }
            }
            cache.rings.wrote(layer, seq.start_pos, seq.start_pos + seq.rows.len());
        }
        let caches: &[&mut CpuKvCache] = caches;
        // 2a. Long slices (prefill): per (sequence, head), S = Q·Kᵀ and O = P·V as matmuls.
        let blocked: Vec<usize> = (0..seqs.len())
            .filter(|&s| !self.opts.batch_invariant && seqs[s].rows.len() >= BLOCKED_ATTENTION_MIN_ROWS)
            .collect();
        let head_outputs: Vec<(usize, usize, Vec<f32>)> = if blocked.is_empty() {
            Vec::new() // the decode path: no allocation
        } else {
            blocked
                .iter()
                .flat_map(|&s| (0..n_head).map(move |h| (s, h)))
                .collect::<Vec<_>>()
                .into_par_iter()
                .map(|(s, h)| {
                    let cache = &caches[cache_of(s)];
                    let kv = (&cache.rings, layer);
                    (s, h, attention_head_blocked(isa, qkv, &seqs[s], &cache.layers[layer], kv, spec, h))
                })
                .collect()
        };
        for (s, h, o) in head_outputs {
            for (i, r) in seqs[s].rows.clone().enumerate() {
                out[r * qw + h * hd..r * qw + (h + 1) * hd].copy_from_slice(&o[i * hd..(i + 1) * hd]);
            }
        }
        // 2b. Short slices (decode): one task per (row, head): scores, softmax, weighted values.
        let short_rows = |r: usize| seqs.iter().position(|s| s.rows.contains(&r)).filter(|&s| !blocked.contains(&s));
        let one = |(task, o): (usize, &mut [f32])| {
            let (r, h) = (task / n_head, task % n_head);
            let kvh = h / spec.group();
            let Some(s) = short_rows(r) else { return };
            let pos = seqs[s].start_pos + (r - seqs[s].rows.start);
            let cache = &caches[cache_of(s)];
            let (k_store, v_store) = &cache.layers[layer];
            let q = &qkv[r * stride + h * hd..r * stride + (h + 1) * hd];
            // Scratch kept by each thread, reserved for the whole cache at once (so warm
            // decode steps never allocate) and never shrunk: a decode step runs thousands of
            // these tasks, and zeroing fresh stack buffers for each showed in profiles.
            ATTENTION_SCRATCH.with_borrow_mut(|scores| {
                let first = spec.first_key(pos);
                let n = pos + 1 - first;
                scores.clear();
                scores.reserve(cache.capacity.max(pos + 1));
                scores.resize(n, 0.0);
                // This head's cached rows first..=pos are contiguous (see `kv_index`), or
                // two runs where a ring wraps: its end, then its start.
                let slots = cache.rings.slots(layer);
                let s0 = cache.rings.slot(layer, first);
                let n1 = n.min(slots - s0);
                let span1 = kv_index(slots, hd, kvh, s0)..kv_index(slots, hd, kvh, s0 + n1);
                let span2 = kv_index(slots, hd, kvh, 0)..kv_index(slots, hd, kvh, n - n1);
                let spans = [span1, span2];
                // f16 rows are widened exactly as they are read: the same bits as f32 copies.
                match (k_store, v_store) {
                    (KvStore::F32(k), KvStore::F32(v)) => attend_runs(isa, q, (k, v), spans, spec.scale, scores, o),
                    (KvStore::F16(k), KvStore::F16(v)) => attend_runs(isa, q, (k, v), spans, spec.scale, scores, o),
                    _ => unreachable!("a layer's keys and values are stored alike (new_kv_cache_in)"),
                }
            })
        };
        // A parallel region costs a thread wake-up (~10-20 µs): worth it only when the
        // scores to compute are many.
        let work: usize = seqs.iter().map(|s| s.rows.len() * (s.start_pos + s.rows.len())).sum::<usize>() * qw;
        let (n_tasks, threads) = (out.len() / hd.max(1), rayon::current_num_threads());
        let parallel = work >= PARALLEL_ATTENTION_WORK;
        if parallel && n_rows > team::SPLIT_MAX_ROWS {
            out.par_chunks_mut(hd).enumerate().for_each(one);
        } else {
            // A decode step (or little work): the spinning team (a hand-off of ~1 µs) when
            // it is free, else rayon when the work is large, one thread when it is small.
            // The team's parts are dealt round-robin whole groups of query heads that share
            // a KV head (tasks `g·group .. (g+1)·group`: one row's heads of one group), so
            // the group's cached rows, read for its first head, are still in that core's
            // caches for the others; with too few groups to keep every thread busy, heads
            // are dealt one by one.
            let base = TaskOut(out.as_mut_ptr());
            let group = spec.group().max(1);
            let group = if n_tasks / group >= 2 * threads { group } else { 1 };
            let part = |p: usize| {
                for g in (p..n_tasks / group).step_by(threads) {
                    for task in g * group..(g + 1) * group {
                        // SAFETY: task `task` owns `out[task·hd .. (task+1)·hd]`, inside `out`
                        // (n_tasks·hd ≤ out.len()); each task belongs to exactly one part, and
                        // `team::run` returns only when every part is done.
                        let o = unsafe { std::slice::from_raw_parts_mut(base.at(task * hd), hd) };
                        one((task, o));
                    }
                }
            };
            if threads < 2 || n_tasks < threads || !team::run(threads, &part) {
                if parallel {
                    out.par_chunks_mut(hd).enumerate().for_each(one);
                } else {
                    out.chunks_mut(hd).enumerate().for_each(one);
                }
            }
        }
    }
}

impl Backend for CpuBackend {
    type Matrix = CpuMatrix;
    type Vector = Vec<f32>;
    type Act = CpuAct;
    type KvCache = CpuKvCache;

    fn name(&self) -> String {
        "cpu".into()
    }

    fn load_matrix(&self, t: &TensorView, layout: MatrixLayout) -> BackendResult<CpuMatrix> {
        let &[rows, cols] = t.shape else { refuse!("tensor {:?} has shape {:?}, expected 2 dims", t.name, t.shape) };
        let dtype = match (self.opts.weight_dtype, t.dtype) {
            (Some(d), _) => d,
            (None, Dtype::F16) => WeightDtype::F16,
            (None, Dtype::BF16) => WeightDtype::BF16,
            (None, _) => WeightDtype::F32,
        };
        // Read in place (no f32 copy of the tensor), and give the file's pages back as they
        // are packed: peak memory stays near the packed size.
        let b = t.bytes;
        let size = match t.dtype {
            Dtype::F32 => 4,
            Dtype::F16 | Dtype::BF16 => 2,
            other => refuse!("tensor {:?} has dtype {}, expected F32, F16 or BF16", t.name, other.name()),
        };
        check!(
            rows.checked_mul(cols).and_then(|n| n.checked_mul(size)) == Some(b.len()),
            "tensor {:?}: {} bytes for shape {:?}",
            t.name,
            b.len(),
            t.shape
        );
        let at = |i: usize| -> f32 {
            match t.dtype {
                Dtype::F32 => f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]),
                Dtype::F16 => half::f16::from_bits(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])).to_f32(),
                _ => half::bf16::from_bits(u16::from_le_bytes([b[2 * i], b[2 * i + 1]])).to_f32(),
            }
        };
        Ok(CpuMatrix::Dense(match layout {
            MatrixLayout::InOut => {
                // Each panel reads a column strip of every row: the source is done at the end.
                let m = PackedMatrix::pack_with(rows, cols, dtype, |k, j| at(k * cols + j), |_| {});
                crate::tensor::release(b);
                m
            }
            MatrixLayout::OutIn => PackedMatrix::pack_with(
                cols,
                rows,
                dtype,
                |k, j| at(j * cols + k),
                |done| crate::tensor::release(&b[done.start * cols * size..done.end * cols * size]),
            ),
        }))
    }

    /// Q8_0, Q4_0 and Q4_1 stay quantized (unless `--dtype` asks for floats), Q4_K and
    /// Q6_K too (held losslessly in blocks of 32, [`QMatrix::from_q4_k`],
    /// [`QMatrix::from_q6_k`]); the other block types (Q5_0, Q5_1, Q5_K) are decoded
    /// exactly and re-quantized to
    /// Q8_0 blocks (about 0.4% more rounding, far less than the file's own), so they run
    /// on the Q8_0 kernel instead of as f32 (4x the bytes per token).
    fn load_quantized(
        &self,
        name: &str,
        ty: GgmlType,
        n_out: usize,
        n_in: usize,
        bytes: &[u8],
    ) -> BackendResult<CpuMatrix> {
        match QType::from_ggml(ty) {
            Some(q) if self.opts.weight_dtype.is_none() && n_in.is_multiple_of(qmatmul::QK) => {
                let m = QMatrix::new_with(q, n_out, n_in, bytes, crate::tensor::release)
                    .map_err(|e| BackendError::Invalid(format!("tensor {name:?}: {e}")))?;
                Ok(CpuMatrix::Quant(m))
            }
            // Q5_0 as Q8_0 blocks of the same values: llama.cpp's q5_0 · q8_0 sums exactly.
            None if ty == GgmlType::Q5_0 && self.opts.weight_dtype.is_none() && n_in.is_multiple_of(qmatmul::QK) => {
                let q8 = crate::quant::to_q8_0(ty, bytes)
                    .unwrap_or_else(|| Err("not transcodable".into()))
                    .map_err(|e| BackendError::Invalid(format!("tensor {name:?}: {e}")))?;
                crate::tensor::release(bytes);
                let m = QMatrix::new_with(QType::Q8_0, n_out, n_in, &q8, |_| {})
                    .map_err(|e| BackendError::Invalid(format!("tensor {name:?}: {e}")))?;
                Ok(CpuMatrix::Quant(m))
            }
            None if ty == GgmlType::Q4K && self.opts.weight_dtype.is_none() => {
                let m = QMatrix::from_q4_k_with(n_out, n_in, bytes, crate::tensor::release)
                    .map_err(|e| BackendError::Invalid(format!("tensor {name:?}: {e}")))?;
                Ok(CpuMatrix::Quant(m))
            }
            None if ty == GgmlType::Q6K && self.opts.weight_dtype.is_none() => {
                let m = QMatrix::from_q6_k_with(n_out, n_in, bytes, crate::tensor::release)
                    .map_err(|e| BackendError::Invalid(format!("tensor {name:?}: {e}")))?;
                Ok(CpuMatrix::Quant(m))
            }
            None if self.opts.weight_dtype.is_none() && n_in.is_multiple_of(qmatmul::QK) && n_out > 0 => {
                // Row by row as the re-blocking reaches it, so neither an f32 nor a Q8_0 copy
                // of the whole matrix is ever held.
                check!(bytes.len().is_multiple_of(n_out), "tensor {name:?}: {} bytes for {n_out} rows", bytes.len());
                let row_bytes = bytes.len() / n_out;
                // Every row has the same type and length: the first one decoding to n_in
                // values means they all do.
                let values = crate::quant::dequantize(ty, &bytes[..row_bytes])
                    .map_err(|e| BackendError::Invalid(format!("tensor {name:?}: {e}")))?;
                check!(values.len() == n_in, "tensor {name:?}: a row decodes to {} values, not {n_in}", values.len());
                let m = QMatrix::requantized_q8_0(
                    n_out,
                    n_in,
                    |j| crate::quant::dequantize(ty, &bytes[j * row_bytes..(j + 1) * row_bytes]).unwrap_or_default(),
                    |rows| crate::tensor::release(&bytes[rows.start * row_bytes..rows.end * row_bytes]),
                )
                .map_err(|e| BackendError::Invalid(format!("tensor {name:?}: {e}")))?;
                Ok(CpuMatrix::Quant(m))
            }
            _ => dequantized_matrix(self, name, ty, n_out, n_in, bytes),
        }
    }

    fn load_vector(&self, t: &TensorView) -> BackendResult<Vec<f32>> {
        check!(t.shape.len() == 1, "tensor {:?} has shape {:?}, expected 1 dim", t.name, t.shape);
        t.to_f32().map_err(BackendError::Invalid)
    }

    fn copy_kv_prefix(&self, src: &CpuKvCache, dst: &mut CpuKvCache, n: usize, head_dim: usize) -> BackendResult<()> {
        super::check_kv_copy(src, dst, n, head_dim)?;
        // Head-major layers: each head's run of positions is contiguous in both caches.
        let (hd, n_head) = (head_dim, src.width / head_dim);
        for (layer, ((sk, sv), (dk, dv))) in src.layers.iter().zip(dst.layers.iter_mut()).enumerate() {
            let (ss, ds) = (src.rings.slots(layer), dst.rings.slots(layer));
            for run in src.rings.copy_runs(&mut dst.rings, layer, n) {
                for (s, d) in [(sk, &mut *dk), (sv, &mut *dv)] {
                    for h in 0..n_head {
                        let (from, to) = (kv_index(ss, hd, h, run.from), kv_index(ds, hd, h, run.to));
                        let len = run.len * hd;
                        match (s, &mut *d) {
                            (KvStore::F32(s), KvStore::F32(d)) => d[to..to + len].copy_from_slice(&s[from..from + len]),
                            (KvStore::F16(s), KvStore::F16(d)) => d[to..to + len].copy_from_slice(&s[from..from + len]),
                            _ => refuse!("KV copy between an f32 and an f16 cache"),
                        }
                    }
                }
            }
        }
        Ok(())
    }

    fn new_kv_cache_in(&self, layout: &KvLayout) -> BackendResult<CpuKvCache> {
        layout.check()?;
        let n_layer = layout.slots.len();
        let store = |slots: usize| -> BackendResult<KvStore> {
            let n = slots
                .checked_mul(layout.width)
                .ok_or_else(|| BackendError::Memory("KV cache size overflows".into()))?;
            Ok(if self.opts.kv_dtype == KvDtype::F16 {
                KvStore::F16(super::kv_zeros(n, f16::ZERO, n_layer)?)
            } else {
                KvStore::F32(super::kv_zeros(n, 0.0, n_layer)?)
            })
        };
        let layers = layout.slots.iter().map(|&s| Ok((store(s)?, store(s)?))).collect::<BackendResult<Vec<_>>>()?;
        Ok(CpuKvCache { capacity: layout.capacity, width: layout.width, layers, rings: KvRings::new(layout) })
    }

    fn upload(&self, m: &HostMatrix) -> CpuAct {
        let mut a = self.take_to_overwrite(m.rows, m.cols);
        a.copy_from_slice(&m.data);
        a
    }

    fn embed(&self, table: &CpuMatrix, ids: &[u32]) -> CpuAct {
        let dim = table.n_in();
        let mut out = self.take(ids.len(), dim);
        for (row, &id) in out.chunks_mut(dim).zip(ids) {
            match table {
                CpuMatrix::Dense(t) => t.column(id as usize, row),
                CpuMatrix::Quant(t) => t.dequantize_row(id as usize, row),
            }
        }
        out
    }

    fn layer_norm(&self, x: &CpuAct, gain: &Vec<f32>, shift: &Vec<f32>, eps: f32) -> CpuAct {
        assert!(gain.len() == x.cols && shift.len() == x.cols, "norm: gain and shift must be one per column");
        let mut out = self.take_to_overwrite(x.rows, x.cols);
        map_rows(x, x.cols, &mut out, x.cols, |xr, or| simd::layer_norm(xr, gain, shift, eps, or));
        out
    }

    fn linear(&self, x: &CpuAct, w: &CpuMatrix, bias: Option<&Vec<f32>>) -> CpuAct {
        self.linear_impl(x, w, bias, false)
    }

    fn linear_gelu(&self, x: &CpuAct, w: &CpuMatrix, bias: Option<&Vec<f32>>) -> CpuAct {
        self.linear_impl(x, w, bias, true)
    }

    fn gelu(&self, x: &mut CpuAct) {
        gelu_rows(self.opts.isa, x);
    }

    fn add(&self, x: &mut CpuAct, y: &CpuAct) {
        assert_eq!((x.rows, x.cols), (y.rows, y.cols), "add: shapes");
        for (a, b) in x.iter_mut().zip(y.iter()) {
            *a += b;
        }
    }

    fn add_layer_norm(&self, x: &mut CpuAct, y: &CpuAct, gain: &Vec<f32>, shift: &Vec<f32>, eps: f32) -> CpuAct {
        assert!(gain.len() == x.cols && shift.len() == x.cols, "norm: gain and shift must be one per column");
        let mut out = self.take_to_overwrite(x.rows, x.cols);
        add_map_rows(x, y, &mut out, |xr, or| simd::layer_norm(xr, gain, shift, eps, or));
        out
    }

    fn rms_norm(&self, x: &CpuAct, gain: &Vec<f32>, eps: f32) -> CpuAct {
        assert_eq!(gain.len(), x.cols, "norm: one gain per column");
        let mut out = self.take_to_overwrite(x.rows, x.cols);
        map_rows(x, x.cols, &mut out, x.cols, |xr, or| simd::rms_norm(xr, gain, eps, or));
        out
    }

    fn add_rms_norm(&self, x: &mut CpuAct, y: &CpuAct, gain: &Vec<f32>, eps: f32) -> CpuAct {
        assert_eq!(gain.len(), x.cols, "norm: one gain per column");
        let mut out = self.take_to_overwrite(x.rows, x.cols);
        add_map_rows(x, y, &mut out, |xr, or| simd::rms_norm(xr, gain, eps, or));
        out
    }

    fn swiglu(&self, x: &CpuAct) -> CpuAct {
        let (isa, f) = (self.opts.isa, x.cols / 2);
        let mut out = self.take_to_overwrite(x.rows, f); // `simd::swiglu` writes every element
        map_rows(x, x.cols, &mut out, f, |xr, or| {
            simd::swiglu(isa, &xr[..f], &xr[f..2 * f], or);
        });
        out
    }

    fn geglu(&self, x: &CpuAct) -> CpuAct {
        let (isa, f) = (self.opts.isa, x.cols / 2);
        let mut out = self.take_to_overwrite(x.rows, f);
        // gelu(gate) in place, then · up: the same GELU bits as `gelu` on every path.
        map_rows(x, x.cols, &mut out, f, |xr, or| {
            or.copy_from_slice(&xr[..f]);
            simd::gelu(isa, or);
            for (o, &u) in or.iter_mut().zip(&xr[f..2 * f]) {
                *o *= u;
            }
        });
        out
    }

    fn scale(&self, x: &mut CpuAct, s: f32) {
        x.iter_mut().for_each(|v| *v *= s);
    }

    fn qk_norm(
        &self,
        qkv: &mut CpuAct,
        spec: &AttentionSpec,
        q_gain: &Vec<f32>,
        k_gain: &Vec<f32>,
        eps: f32,
    ) -> BackendResult<()> {
        check_qk_norm(qkv.cols, spec, q_gain.len(), k_gain.len())?;
        let (hd, nq, nk, cols) = (spec.head_dim, spec.n_head, spec.n_kv_head, qkv.cols);
        let one_row = |row: &mut [f32]| {
            let mut tmp = vec![0.0f32; hd];
            for (i, head) in row[..(nq + nk) * hd].chunks_mut(hd).enumerate() {
                simd::rms_norm(head, if i < nq { q_gain } else { k_gain }, eps, &mut tmp);
                head.copy_from_slice(&tmp);
            }
        };
        if qkv.rows > 1 {
            qkv.par_chunks_mut(cols).for_each(one_row);
        } else {
            qkv.chunks_mut(cols).for_each(one_row);
        }
        Ok(())
    }

    fn attention(
        &self,
        qkv: &CpuAct,
        seqs: &[SeqSlice],
        caches: &mut [&mut CpuKvCache],
        layer: usize,
        spec: &AttentionSpec,
    ) -> BackendResult<CpuAct> {
        check_attention(qkv.rows, qkv.cols, seqs, caches, layer, spec)?;
        let (stride, qw, n_rows) = (spec.qkv_width(), spec.q_width(), qkv.rows);
        // 0. RoPE on a copy of the queries and keys, at each row's position.
        let rotated = spec.rope.as_ref().map(|rope| {
            let mut r = self.take_to_overwrite(qkv.rows, qkv.cols);
            r.copy_from_slice(qkv);
            for seq in seqs {
                for (i, row) in seq.rows.clone().enumerate() {
                    rope_row(spec, rope, &mut r[row * stride..(row + 1) * stride], seq.start_pos + i);
                }
            }
            r
        });
        let qkv: &[f32] = rotated.as_deref().unwrap_or(qkv);
        let mut out = self.take(n_rows, qw);
        // The matmul-shaped prefill computes rows × keys scores: under a sliding window it
        // goes in pieces of WINDOW_PIECE_ROWS rows, each reading its own window's keys.
        let window_rows = if self.opts.batch_invariant { usize::MAX } else { WINDOW_PIECE_ROWS };
        if !needs_pieces(seqs, caches, layer, spec, window_rows) {
            self.attention_piece(qkv, seqs, None, caches, layer, spec, &mut out);
            return Ok(out);
        }
        // A ring layer takes a long slice in pieces ([`attention_pieces`]).
        for piece in attention_pieces(seqs, caches, layer, spec, window_rows) {
            let (index, slices): (Vec<usize>, Vec<SeqSlice>) = piece.into_iter().unzip();
            self.attention_piece(qkv, &slices, Some(&index), caches, layer, spec, &mut out);
        }
        Ok(out)
    }

    fn select_rows(&self, x: &CpuAct, rows: &[usize]) -> CpuAct {
        let mut out = self.take_to_overwrite(rows.len(), x.cols);
        for (dst, &r) in out.chunks_mut(x.cols).zip(rows) {
            dst.copy_from_slice(&x[r * x.cols..(r + 1) * x.cols]);
        }
        out
    }

    fn to_host(&self, x: &CpuAct, out: &mut HostMatrix) -> BackendResult<()> {
        out.reshape(x.rows, x.cols);
        out.data.copy_from_slice(x);
        Ok(())
    }
}

/// Physical cores this process may run on: the CPUs in its affinity mask, counted once
/// per (package, core) pair, so SMT siblings do not double the default thread count
/// (matmul-bound work gains nothing from them). Falls back to the logical count.
pub fn physical_cores() -> usize {
    let logical = std::thread::available_parallelism().map_or(1, |n| n.get());
    #[cfg(target_os = "linux")]
    {
        // SAFETY: cpu_set_t is plain data; sched_getaffinity writes at most its size.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: pid 0 = this thread; the size passed is the set's own size.
        if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) } == 0 {
            let mut cores = std::collections::HashSet::new();
            for cpu in 0..libc::CPU_SETSIZE as usize {
                // SAFETY: cpu < CPU_SETSIZE, the set's capacity.
                if !unsafe { libc::CPU_ISSET(cpu, &set) } {
                    continue;
                }
                let topo = format!("/sys/devices/system/cpu/cpu{cpu}/topology");
                let read = |f: &str| std::fs::read_to_string(format!("{topo}/{f}")).ok();
                match (read("physical_package_id"), read("core_id")) {
                    (Some(p), Some(c)) => cores.insert((p.trim().to_owned(), c.trim().to_owned())),
                    _ => return logical,
                };
            }
            if !cores.is_empty() {
                return cores.len().min(logical);
            }
        }
    }
    logical
}

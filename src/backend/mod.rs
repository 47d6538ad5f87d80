//! The backend interface: the handful of operations the models need, implemented once
//! per device: [`reference`] (plain Rust, the ground truth), [`cpu`] (SIMD, threads) and
//! `gpu` (WGSL through wgpu).
//!
//! Models are written once over [`Backend`]: embeddings, LayerNorm and RMSNorm, linear
//! layers, GELU and SwiGLU, residual adds, and causal attention (RoPE, grouped-query heads)
//! over a KV cache. A backend owns the form its weights take
//! ([`Backend::Matrix`]: f32 here, f16/quantized/GPU-resident elsewhere), its
//! activations and its KV-cache storage. Batches are flat: the rows of one forward
//! call may come from several sequences, each at its own position ([`SeqSlice`]), so
//! one call can prefill a prompt and decode a step for other sequences together.

/// Returns [`BackendError::Invalid`] with the message (`format!`'s arguments) unless the
/// condition holds: an op's arguments that do not fit each other. `check!(Kind: cond,
/// ...)` returns that variant instead (`Unsupported`, `Memory`).
macro_rules! check {
    ($kind:ident: $cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err($crate::backend::BackendError::$kind(format!($($msg)+)));
        }
    };
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err($crate::backend::BackendError::Invalid(format!($($msg)+)));
        }
    };
}

/// Returns [`BackendError::Invalid`] with the message (`format!`'s arguments).
macro_rules! refuse {
    ($($msg:tt)+) => {
        return Err($crate::backend::BackendError::Invalid(format!($($msg)+)))
    };
}

pub(crate) use {check, refuse};

pub mod cpu;
#[cfg(feature = "gpu")]
pub mod gpu;
pub mod reference;

use std::ops::Range;

use std::sync::Arc;

use crate::tensor::{GgmlType, TensorView};
pub use crate::tensor::{KvDtype, WeightDtype};

/// Why a backend could not load a weight, make a cache or run an op. The models pass it
/// on; the engine reports it as a failed step, the loader as a weights error.
#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    /// The arguments do not fit each other or the backend's objects: shapes, caches,
    /// positions, a tensor's type or bytes (a malformed file or a caller's bug).
    #[error("{0}")]
    Invalid(String),
    /// Memory for a cache or a buffer could not be had, or its size overflows.
    #[error("{0}")]
    Memory(String),
    /// This backend or its device does not run it (a head size, a KV type, an adapter's
    /// missing feature).
    #[error("{0}")]
    Unsupported(String),
    /// The device failed: a GPU error, a lost device, a timeout, no adapter.
    #[error("{0}")]
    Device(String),
}

impl BackendError {
    /// The same kind of error, its message prefixed with what was being done.
    pub fn context(self, what: &str) -> Self {
        match self {
            BackendError::Invalid(m) => BackendError::Invalid(format!("{what}: {m}")),
            BackendError::Memory(m) => BackendError::Memory(format!("{what}: {m}")),
            BackendError::Unsupported(m) => BackendError::Unsupported(format!("{what}: {m}")),
            BackendError::Device(m) => BackendError::Device(format!("{what}: {m}")),
        }
    }
}

/// A backend's result.
pub type BackendResult<T> = Result<T, BackendError>;

/// The size of a KV cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvShape {
    /// Layers it holds keys and values for.
    pub n_layer: usize,
    /// Positions it has room for.
    pub capacity: usize,
    /// Values per position and layer, for keys and for values each: `n_kv_head × head_dim`
    /// (the model width when every query head has its own key/value head).
    pub width: usize,
}

/// Rotary position embedding (Su et al., 2021): the pairs of each query and key head are
/// rotated by `pos · base^(-2i/head_dim) / factor_i`, pair `i = 0 .. head_dim/2`.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    /// `base` above (`rope_theta`, llama.cpp's `rope.freq_base`).
    pub theta: f32,
    pub style: RopeStyle,
    /// Each pair's frequency is divided by its factor (`factor_i` above): RoPE scaling for
    /// contexts longer than training's. Llama 3's `llama3` scaling divides the low
    /// frequencies only (llama.cpp's `rope_freqs.weight` holds exactly these factors),
    /// `linear` scaling divides every one by the same factor. `None`: all 1.
    pub freq_factors: Option<Arc<[f32]>>,
}

impl Rope {
    /// RoPE with base `theta` and no scaling.
    pub fn new(theta: f32, style: RopeStyle) -> Self {
        Rope { theta, style, freq_factors: None }
    }

    /// cos and sin of pair `i`'s angle at `pos`, `pos · θ^(−2i/head_dim) / factor_i`, computed
    /// in f64 and rounded once (every backend rotates with these very values).
    pub fn cos_sin(&self, head_dim: usize, pos: usize, i: usize) -> (f32, f32) {
        let mut inv_freq = (self.theta as f64).powf(-((2 * i) as f64) / head_dim as f64);
        if let Some(f) = self.freq_factors.as_deref().and_then(|f| f.get(i)) {
            inv_freq /= *f as f64;
        }
        let angle = pos as f64 * inv_freq;
        (angle.cos() as f32, angle.sin() as f32)
    }
}

/// How a model stretches RoPE for contexts longer than it was trained on (HF's
/// `rope_scaling` / `rope_parameters`, llama.cpp's `rope.scaling.*` and `rope_freqs`),
/// as the per-pair frequency factors of [`Rope::freq_factors`].
#[derive(Clone, Debug, Default, PartialEq)]
pub enum RopeScaling {
    #[default]
    None,
    /// Every frequency divided by `factor` (HF's `linear`, llama.cpp's `linear`:
    /// positions interpolated; Gemma 3 4B and larger on their global layers).
    Linear { factor: f32 },
    /// Llama 3.1's (HF's `llama3`): wavelengths longer than
    /// `original_context / low_freq_factor` are divided by `factor`, those shorter than
    /// `original_context / high_freq_factor` kept, and those between blended smoothly.
    Llama3 { factor: f32, low_freq_factor: f32, high_freq_factor: f32, original_context: f32 },
}

impl RopeScaling {
    /// The factor of each of the `head_dim / 2` pairs of RoPE with base `theta`, as llama.cpp's
    /// converter writes them into `rope_freqs.weight` (HF's `_compute_llama3_parameters`
    /// gives the same values): in f32 arithmetic, step by step as that converter's torch code,
    /// so a converted file has its bytes. `None` without scaling.
    pub fn freq_factors(&self, theta: f32, head_dim: usize) -> Option<Vec<f32>> {
        let pairs = 0..head_dim / 2;
        match *self {
            RopeScaling::None => None,
            RopeScaling::Linear { factor } => Some(pairs.map(|_| factor).collect()),
            RopeScaling::Llama3 { factor, low_freq_factor: low, high_freq_factor: high, original_context: ctx } => {
                let (low_wavelen, high_wavelen) = ((ctx as f64 / low as f64) as f32, (ctx as f64 / high as f64) as f32);
                let span = (high as f64 - low as f64) as f32;
                Some(
                    pairs
                        .map(|i| {
                            let exponent = (2 * i) as f32 / head_dim as f32;
                            let freq = 1.0 / ((theta as f64).powf(exponent as f64) as f32);
                            let wavelen = std::f32::consts::TAU / freq;
                            if wavelen < high_wavelen {
                                1.0
                            } else if wavelen > low_wavelen {
                                factor
                            } else {
                                let smooth = (ctx / wavelen - low) / span;
                                1.0 / ((1.0 - smooth) / factor + smooth)
                            }
                        })
                        .collect(),
                )
            }
        }
    }
}

/// Which values of a head form the rotated pairs. The two are the same model up to a
/// permutation of the q/k projection rows, and llama.cpp's converter applies exactly that
/// permutation: HF's Llama weights rotate halves, the GGUF's rotate neighbours.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RopeStyle {
    /// `(x[2i], x[2i+1])`: the original Llama layout, llama.cpp's `LLAMA_ROPE_TYPE_NORM`.
    Adjacent,
    /// `(x[i], x[i + head_dim/2])`: HF's `rotate_half`, llama.cpp's `NEOX`.
    Halves,
}

/// The shape of one attention call. The `qkv` input is `(T, (n_head + 2·n_kv_head)·head_dim)`:
/// all query heads, then the key heads, then the value heads. Query head `h` reads key/value
/// head `h / (n_head / n_kv_head)` (grouped-query attention; multi-head when the counts are
/// equal). The output is `(T, n_head·head_dim)`.
#[derive(Clone, Debug, PartialEq)]
pub struct AttentionSpec {
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    /// Multiplies `q·k` (usually `1/sqrt(head_dim)`).
    pub scale: f32,
    /// Applied to queries and keys (at each row's position) before the keys are cached.
    pub rope: Option<Rope>,
    /// Sliding-window attention: the row at position `pos` sees keys
    /// `pos + 1 − window ..= pos` only (Gemma's, Mistral's local layers; HF's
    /// `sliding_window`, llama.cpp's `n_swa`). `None`: every earlier key.
    pub window: Option<usize>,
}

impl AttentionSpec {
    /// Multi-head attention without RoPE over `width` = `n_head × head_dim` (GPT-2).
    pub fn multi_head(width: usize, n_head: usize, scale: f32) -> Self {
        AttentionSpec { n_head, n_kv_head: n_head, head_dim: width / n_head.max(1), scale, rope: None, window: None }
    }
    /// The first key position the row at `pos` attends to.
    pub fn first_key(&self, pos: usize) -> usize {
        match self.window {
            Some(w) => (pos + 1).saturating_sub(w),
            None => 0,
        }
    }
    pub fn q_width(&self) -> usize {
        self.n_head * self.head_dim
    }
    pub fn kv_width(&self) -> usize {
        self.n_kv_head * self.head_dim
    }
    pub fn qkv_width(&self) -> usize {
        self.q_width() + 2 * self.kv_width()
    }
    /// Query heads per key/value head.
    pub fn group(&self) -> usize {
        self.n_head / self.n_kv_head
    }
    pub fn validate(&self) -> BackendResult<()> {
        check!(self.n_head > 0 && self.n_kv_head > 0 && self.head_dim > 0, "attention: no heads");
        check!(
            self.n_head.is_multiple_of(self.n_kv_head),
            "attention: {} query heads do not share {} key/value heads evenly",
            self.n_head,
            self.n_kv_head
        );
        check!(
            self.rope.is_none() || self.head_dim.is_multiple_of(2),
            "attention: RoPE needs an even head size, not {}",
            self.head_dim
        );
        if let Some(f) = self.rope.as_ref().and_then(|r| r.freq_factors.as_deref()) {
            check!(
                f.len() == self.head_dim / 2,
                "attention: {} RoPE frequency factors for {} rotated pairs",
                f.len(),
                self.head_dim / 2
            );
            check!(
                f.iter().all(|x| x.is_finite() && *x > 0.0),
                "attention: RoPE frequency factors must be finite and positive"
            );
        }
        check!(self.qkv_width() <= 1 << 24, "attention: implausibly wide heads");
        check!(self.window != Some(0), "attention: a sliding window of 0 keys");
        Ok(())
    }
}

/// Rotate the query and key heads of one `qkv` row (layout of [`AttentionSpec`]) for
/// position `pos`. Angles in f64, then rounded once to f32, so every backend that uses
/// this agrees exactly and HF's f32 angles differ by far less than the tolerance.
pub fn rope_row(spec: &AttentionSpec, rope: &Rope, row: &mut [f32], pos: usize) {
    let hd = spec.head_dim;
    let half = hd / 2;
    let mut small = [(0f32, 0f32); 128];
    let mut large = Vec::new();
    let cos_sin: &mut [(f32, f32)] = if half <= small.len() {
        &mut small[..half]
    } else {
        large.resize(half, (0.0, 0.0));
        &mut large
    };
    for (i, cs) in cos_sin.iter_mut().enumerate() {
        *cs = rope.cos_sin(hd, pos, i);
    }
    let rotated = spec.q_width() + spec.kv_width(); // queries and keys; values stay
    for head in row[..rotated].chunks_exact_mut(hd) {
        for (i, &(c, s)) in cos_sin.iter().enumerate() {
            let (a, b) = match rope.style {
                RopeStyle::Adjacent => (2 * i, 2 * i + 1),
                RopeStyle::Halves => (i, i + half),
            };
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * c - x1 * s;
            head[b] = x1 * c + x0 * s;
        }
    }
}

/// What every backend's KV cache knows about itself, so that a batch is checked against
/// it before any kernel runs.
pub trait KvCache: Send {
    fn shape(&self) -> KvShape;
    /// Which positions each layer stores and still holds.
    fn rings(&self) -> &KvRings;
}

/// How many positions each layer of a new KV cache stores. A layer of sliding-window
/// attention needs only the last `window` keys of a sequence, so it may store fewer than
/// `capacity` positions as a ring: position `pos` in slot `pos % slots`, a later
/// position overwriting an earlier one (llama.cpp's SWA cache, vLLM's sliding-window
/// blocks). Every other layer stores all `capacity` positions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Positions a sequence may reach.
    pub capacity: usize,
    /// Values per position and layer, for keys and for values each.
    pub width: usize,
    /// Per layer: positions stored (`capacity` for a whole layer, fewer for a ring).
    pub slots: Vec<usize>,
    /// Per layer: its attention's sliding window (`None`: every earlier key).
    pub windows: Vec<Option<usize>>,
}

impl KvLayout {
    /// Every one of `n_layer` layers stores all `capacity` positions.
    pub fn full(n_layer: usize, capacity: usize, width: usize) -> Self {
        KvLayout { capacity, width, slots: vec![capacity; n_layer], windows: vec![None; n_layer] }
    }

    /// One window per layer; slot counts between 1 and the capacity (0 only for an empty
    /// cache), and a ring only for a layer whose window it holds.
    pub fn check(&self) -> BackendResult<()> {
        check!(
            self.windows.len() == self.slots.len(),
            "KV layout: {} windows for {} layers",
            self.windows.len(),
            self.slots.len()
        );
        for (layer, (&s, &w)) in self.slots.iter().zip(&self.windows).enumerate() {
            check!(
                s <= self.capacity && (s > 0 || self.capacity == 0),
                "KV layout: layer {layer} stores {s} of {} positions",
                self.capacity
            );
            check!(w != Some(0), "KV layout: layer {layer} has a window of 0 keys");
            check!(
                s == self.capacity || w.is_some_and(|w| w <= s),
                "KV layout: layer {layer} keeps the last {s} of {} positions but attends to {}",
                self.capacity,
                w.map_or("every position".to_owned(), |w| format!("a window of {w}"))
            );
        }
        Ok(())
    }
}

/// A KV cache's per-layer bookkeeping of rings ([`KvLayout`]): how many positions each
/// layer stores and the first position it still holds, so that a sliding-window layer
/// whose keys were overwritten is an error, never a silent read of other positions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KvRings {
    capacity: usize,
    slots: Vec<usize>,
    windows: Vec<Option<usize>>,
    /// Per layer: positions before this one may have been overwritten.
    held_from: Vec<usize>,
}

/// `len` positions copied from slot `from` of one cache layer to slot `to` of another.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvRun {
    pub from: usize,
    pub to: usize,
    pub len: usize,
}

impl KvRings {
    pub fn new(layout: &KvLayout) -> Self {
        KvRings {
            capacity: layout.capacity,
            slots: layout.slots.clone(),
            windows: layout.windows.clone(),
            held_from: vec![0; layout.slots.len()],
        }
    }

    /// Whether every key a sequence continuing at position `n` reads is still held: a
    /// ring may have overwritten them (its sequence went on past `n`). A cache that does
    /// not must start again from position 0.
    pub fn continues_at(&self, n: usize) -> bool {
        self.windows.iter().zip(&self.held_from).all(|(w, &held)| {
            let first = (n + 1).saturating_sub(w.unwrap_or(usize::MAX));
            first == n || first >= held
        })
    }

    /// Whether every layer holds from no later a position than `other`'s does: a cache of
    /// the same tokens or more that reaches back as far serves every prefix `other` serves.
    pub fn reaches_back_as_far(&self, other: &KvRings) -> bool {
        self.held_from.len() == other.held_from.len()
            && self.held_from.iter().zip(&other.held_from).all(|(a, b)| a <= b)
    }

    /// Rows a forward may write past a sequence's end and then give back (rejected
    /// speculative drafts) with the window before that end still held: the fewest a
    /// ring layer takes at once ([`attention_pieces`]); `usize::MAX` without rings.
    pub fn max_rewind(&self) -> usize {
        (0..self.slots.len())
            .filter_map(|l| Some((self.slots[l] + 1).saturating_sub(self.windows[l]?)).filter(|_| self.is_ring(l)))
            .min()
            .unwrap_or(usize::MAX)
            .max(1)
    }

    /// Positions layer `layer` stores.
    pub fn slots(&self, layer: usize) -> usize {
        self.slots[layer]
    }

    /// The slot of position `pos` in layer `layer`.
    pub fn slot(&self, layer: usize, pos: usize) -> usize {
        pos % self.slots[layer].max(1)
    }

    /// Whether layer `layer` stores fewer positions than the cache's capacity.
    pub fn is_ring(&self, layer: usize) -> bool {
        self.slots[layer] < self.capacity
    }

    /// The first position layer `layer` still holds (0 for a whole layer): the positions
    /// from here to the last one written are in their slots.
    pub fn held_from(&self, layer: usize) -> usize {
        self.held_from[layer]
    }

    /// Positions `a..b` of layer `layer` were just written.
    pub fn wrote(&mut self, layer: usize, a: usize, b: usize) {
        if a >= b {
            return; // nothing written
        }
        let overwritten = b.saturating_sub(self.slots[layer]);
        let held = &mut self.held_from[layer];
        // Writing at or after what is held keeps it (less what the ring overwrote); a
        // write that starts earlier (a sequence restarted) holds from its own start.
        *held = if a >= *held { (*held).max(overwritten) } else { a.max(overwritten) };
    }

    /// Every layer holds every position again (the cache starts a new sequence).
    pub fn clear(&mut self) {
        self.held_from.fill(0);
    }

    /// The copies that give `dst`'s layer `layer` positions `0..n` of `src`'s, as far as
    /// `src` holds them and `dst` stores them (a ring keeps the last of them); `dst`
    /// then holds from the first position copied.
    pub fn copy_runs(&self, dst: &mut KvRings, layer: usize, n: usize) -> Vec<KvRun> {
        let (ss, ds) = (self.slots[layer].max(1), dst.slots[layer].max(1));
        let first = self.held_from[layer].max(n.saturating_sub(ds)).min(n);
        dst.held_from[layer] = first;
        let mut runs = Vec::new();
        let mut p = first;
        while p < n {
            let len = (n - p).min(ss - p % ss).min(ds - p % ds);
            runs.push(KvRun { from: p % ss, to: p % ds, len });
            p += len;
        }
        runs
    }
}

/// Rows per piece of sequence `s` ([`attention_pieces`]): what its ring layer takes at
/// once, at most `window_rows` under any sliding window; `usize::MAX` without a window.
fn rows_per_piece<K: KvCache>(
    caches: &[&mut K],
    s: usize,
    layer: usize,
    spec: &AttentionSpec,
    window_rows: usize,
) -> usize {
    let rings = caches[s].rings();
    match spec.window {
        Some(w) if rings.is_ring(layer) => (rings.slots(layer) + 1).saturating_sub(w).clamp(1, window_rows.max(1)),
        Some(_) => window_rows.max(1),
        None => usize::MAX,
    }
}

/// Whether an attention call must be split ([`attention_pieces`]): a slice longer than
/// its ring layer takes at once, or than `window_rows` under a sliding window (a backend
/// whose prefill costs rows × keys splits there so that each piece reads only its
/// window's keys; `usize::MAX` otherwise). It allocates nothing.
pub fn needs_pieces<K: KvCache>(
    seqs: &[SeqSlice],
    caches: &[&mut K],
    layer: usize,
    spec: &AttentionSpec,
    window_rows: usize,
) -> bool {
    (0..seqs.len().min(caches.len())).any(|s| seqs[s].rows.len() > rows_per_piece(caches, s, layer, spec, window_rows))
}

/// The rows of one attention call split into pieces that a ring layer can take at once:
/// a piece's keys are written before its rows attend, so a ring of `slots` positions
/// with a window of `w` takes `slots − w + 1` rows of a sequence at a time without
/// overwriting a key one of them reads; and a backend may ask for pieces of at most
/// `window_rows` under any sliding window ([`needs_pieces`]). Each piece lists
/// `(sequence index, its rows)`; almost always there is one piece, the whole call.
pub fn attention_pieces<K: KvCache>(
    seqs: &[SeqSlice],
    caches: &[&mut K],
    layer: usize,
    spec: &AttentionSpec,
    window_rows: usize,
) -> Vec<Vec<(usize, SeqSlice)>> {
    let per_piece = |s: usize| rows_per_piece(caches, s, layer, spec, window_rows);
    let n_pieces = (0..seqs.len()).map(|s| seqs[s].rows.len().div_ceil(per_piece(s)).max(1)).max().unwrap_or(1);
    (0..n_pieces)
        .map(|k| {
            (0..seqs.len())
                .filter_map(|s| {
                    let (c, seq) = (per_piece(s), &seqs[s]);
                    let skip = k.saturating_mul(c).min(seq.rows.len());
                    let take = c.min(seq.rows.len() - skip);
                    (take > 0 || n_pieces == 1).then(|| {
                        let start = seq.rows.start + skip;
                        (s, SeqSlice { rows: start..start + take, start_pos: seq.start_pos + skip })
                    })
                })
                .collect()
        })
        .collect()
}

/// The checks every backend's [`Backend::attention`] makes before touching a cache, so
/// misuse is an error, the same one on every backend, and never an out-of-bounds write.
pub fn check_attention<K: KvCache>(
    qkv_rows: usize,
    qkv_cols: usize,
    seqs: &[SeqSlice],
    caches: &[&mut K],
    layer: usize,
    spec: &AttentionSpec,
) -> BackendResult<()> {
    check!(seqs.len() == caches.len(), "attention: {} sequences but {} KV caches", seqs.len(), caches.len());
    spec.validate()?;
    check!(
        qkv_cols == spec.qkv_width(),
        "attention: qkv width {qkv_cols}, but {} query and 2 × {} key/value heads of {} make {}",
        spec.n_head,
        spec.n_kv_head,
        spec.head_dim,
        spec.qkv_width()
    );
    let c = spec.kv_width();
    let mut covered = 0;
    for (s, cache) in seqs.iter().zip(caches) {
        check!(
            s.rows.start == covered && s.rows.start <= s.rows.end && s.rows.end <= qkv_rows,
            "attention: sequence rows {:?} do not continue the batch's rows in order (next row {covered} of {qkv_rows})",
            s.rows
        );
        covered = s.rows.end;
        let shape = cache.shape();
        check!(shape.width == c, "attention: KV cache width {} but the key/value heads are {c} wide", shape.width);
        check!(layer < shape.n_layer, "attention: layer {layer} but the KV cache has {} layers", shape.n_layer);
        let end = s.start_pos.checked_add(s.rows.len());
        check!(
            end.is_some_and(|e| e <= shape.capacity),
            "attention: positions {}..{} do not fit the KV cache of {} positions",
            s.start_pos,
            end.map_or("overflow".to_owned(), |e| e.to_string()),
            shape.capacity
        );
        let rings = cache.rings();
        if rings.is_ring(layer) {
            check!(
                spec.window.is_some_and(|w| w <= rings.slots(layer)),
                "attention: layer {layer} of the KV cache keeps the last {} positions, but it attends to {}",
                rings.slots(layer),
                spec.window.map_or("every position".to_owned(), |w| format!("a window of {w}"))
            );
        }
        let first = spec.first_key(s.start_pos);
        check!(
            first == s.start_pos || first >= rings.held_from(layer),
            "attention: position {} needs the keys of layer {layer} from position {first}, but the KV cache \
             holds them from {} on (overwritten by later positions)",
            s.start_pos,
            rings.held_from(layer)
        );
    }
    check!(covered == qkv_rows, "attention: the sequences cover {covered} of the batch's {qkv_rows} rows");
    Ok(())
}

/// The checks of [`Backend::qk_norm`]: a `qkv` of the spec's width, gains of `head_dim`.
pub fn check_qk_norm(qkv_cols: usize, spec: &AttentionSpec, q_gain: usize, k_gain: usize) -> BackendResult<()> {
    spec.validate()?;
    check!(qkv_cols == spec.qkv_width(), "qk_norm: qkv width {qkv_cols}, but the heads make {}", spec.qkv_width());
    check!(
        q_gain == spec.head_dim && k_gain == spec.head_dim,
        "qk_norm: gains of {q_gain} and {k_gain} for heads of {}",
        spec.head_dim
    );
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

/// The checks of [`Backend::copy_kv_prefix`]: same layers and width, `n` inside both.
pub fn check_kv_copy<K: KvCache>(src: &K, dst: &K, n: usize, head_dim: usize) -> BackendResult<()> {
    let (a, b) = (src.shape(), dst.shape());
    check!(head_dim > 0 && a.width.is_multiple_of(head_dim), "KV copy: heads of {head_dim} in a width of {}", a.width);
    check!(
        a.n_layer == b.n_layer && a.width == b.width,
        "KV copy between caches of different shapes ({} × {} and {} × {})",
        a.n_layer,
        a.width,
        b.n_layer,
        b.width
    );
    check!(
        n <= a.capacity && n <= b.capacity,
        "KV copy of {n} positions between caches of {} and {}",
        a.capacity,
        b.capacity
    );
    Ok(())
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

/// `n` zeros, or an error naming the KV cache's size when memory cannot be had (a
/// context from a file can ask for more than the machine holds: an error, not an abort).
pub fn kv_zeros<T: Copy>(n: usize, zero: T, n_layer: usize) -> BackendResult<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        let gib = (n as f64) * (std::mem::size_of::<T>() as f64) * 2.0 * n_layer as f64 / (1u64 << 30) as f64;
        BackendError::Memory(format!("cannot allocate a KV cache of {gib:.1} GiB; use a smaller context (-c)"))
    })?;
    v.resize(n, zero);
    Ok(v)
}

/// A quantized `[n_out, n_in]` matrix decoded to f32 (bit-exact to gguf-py) and loaded
/// with [`Backend::load_matrix`].
pub fn dequantized_matrix<B: Backend + ?Sized>(
    backend: &B,
    name: &str,
    ty: GgmlType,
    n_out: usize,
    n_in: usize,
    bytes: &[u8],
) -> BackendResult<B::Matrix> {
    let values =
        crate::quant::dequantize(ty, bytes).map_err(|e| BackendError::Invalid(format!("tensor {name:?}: {e}")))?;
    crate::tensor::release(bytes);
    check!(
        Some(values.len()) == n_out.checked_mul(n_in),
        "tensor {name:?}: {} values decoded for a [{n_out}, {n_in}] matrix",
        values.len()
    );
    let raw: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
    let shape = [n_out, n_in];
    let view = TensorView { name, dtype: crate::tensor::Dtype::F32, shape: &shape, bytes: &raw };
    backend.load_matrix(&view, MatrixLayout::OutIn)
}

/// What [`Backend::argmax_rows`] gives for a row with a non-finite value.
pub const NON_FINITE_ROW: u32 = u32::MAX;

pub trait Backend: Sync + 'static {
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

    fn load_matrix(&self, t: &TensorView, layout: MatrixLayout) -> BackendResult<Self::Matrix>;
    /// A block-quantized GGUF matrix stored `[n_out, n_in]` (rows of `ty` blocks), used
    /// as [`MatrixLayout::OutIn`]. The default decodes it to f32 exactly
    /// ([`dequantized_matrix`]); a backend with kernels for `ty` keeps it quantized.
    fn load_quantized(
        &self,
        name: &str,
        ty: GgmlType,
        n_out: usize,
        n_in: usize,
        bytes: &[u8],
    ) -> BackendResult<Self::Matrix> {
        dequantized_matrix(self, name, ty, n_out, n_in, bytes)
    }
    fn load_vector(&self, t: &TensorView) -> BackendResult<Self::Vector>;
    /// KV storage for `capacity` positions of `n_layer` layers, `width` values per position.
    fn new_kv_cache(&self, n_layer: usize, capacity: usize, width: usize) -> BackendResult<Self::KvCache> {
        self.new_kv_cache_in(&KvLayout::full(n_layer, capacity, width))
    }
    /// KV storage laid out as `layout` says: rings for the layers that store fewer
    /// positions than the capacity ([`KvLayout`]).
    fn new_kv_cache_in(&self, layout: &KvLayout) -> BackendResult<Self::KvCache>;

    /// Copy the keys and values of positions `0..n` of every layer from `src` into `dst`,
    /// whose heads are `head_dim` wide (a prefix-cache hit: the server reuses a cached
    /// prompt prefix instead of computing it again). A ring layer copies the positions
    /// [`KvRings::copy_runs`] gives: those `src` still holds that `dst` stores.
    /// Caches of different widths or layer counts, or `n` past either capacity, are an
    /// error. A backend without it says so; the server then treats every lookup as a miss.
    fn copy_kv_prefix(
        &self,
        _src: &Self::KvCache,
        _dst: &mut Self::KvCache,
        _n: usize,
        _head_dim: usize,
    ) -> BackendResult<()> {
        Err(BackendError::Unsupported(format!("the {} backend cannot copy KV caches", self.name())))
    }

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
    /// Per-row RMSNorm with gain: `x / sqrt(mean(x²) + eps) · gain`.
    fn rms_norm(&self, x: &Self::Act, gain: &Self::Vector, eps: f32) -> Self::Act;
    /// SwiGLU: `x` is (T, 2F) holding gate | up; returns `silu(gate) · up`, (T, F).
    fn swiglu(&self, x: &Self::Act) -> Self::Act;
    /// GeGLU: `x` is (T, 2F) holding gate | up; returns `gelu(gate) · up` with
    /// [`Backend::gelu`]'s GELU, (T, F) (Gemma's MLP).
    fn geglu(&self, x: &Self::Act) -> Self::Act;
    /// `x *= s`, in place (Gemma's embedding scale).
    fn scale(&self, x: &mut Self::Act, s: f32);
    /// RMSNorm of each query head of a `qkv` activation (layout of [`AttentionSpec`]) with
    /// `q_gain` and of each key head with `k_gain` (`head_dim` gains each), in place, as
    /// [`Backend::rms_norm`] computes a row; the values are left as they are (Gemma 3's
    /// and Qwen 3's `q_norm`, `k_norm`).
    fn qk_norm(
        &self,
        qkv: &mut Self::Act,
        spec: &AttentionSpec,
        q_gain: &Self::Vector,
        k_gain: &Self::Vector,
        eps: f32,
    ) -> BackendResult<()>;
    /// Causal attention (layout of `qkv` in [`AttentionSpec`]). RoPE, if any, is applied
    /// to each row's queries and keys at its position; each sequence's keys and values are
    /// then written into its cache, and every row attends over positions `0..=pos` of its
    /// own sequence (positions `spec.first_key(pos)..=pos` with a sliding window).
    /// `caches[i]` belongs to `seqs[i]`. Returns (T, n_head·head_dim).
    /// Arguments that do not fit the caches are an error ([`check_attention`]), never a panic.
    fn attention(
        &self,
        qkv: &Self::Act,
        seqs: &[SeqSlice],
        caches: &mut [&mut Self::KvCache],
        layer: usize,
        spec: &AttentionSpec,
    ) -> BackendResult<Self::Act>;
    /// Whether this backend runs attention of this shape; models ask at load time, so an
    /// unsupported model fails before any work.
    fn supports(&self, spec: &AttentionSpec) -> BackendResult<()> {
        spec.validate()
    }
    /// The given rows of `x`, in order.
    fn select_rows(&self, x: &Self::Act, rows: &[usize]) -> Self::Act;
    /// Copy to host memory, reusing `out`'s allocation.
    fn to_host(&self, x: &Self::Act, out: &mut HostMatrix) -> BackendResult<()>;
    /// Copy to a new host matrix.
    fn read(&self, x: &Self::Act) -> BackendResult<HostMatrix> {
        let mut out = HostMatrix::zeros(0, 0);
        self.to_host(x, &mut out)?;
        Ok(out)
    }

    /// Greedy sampling on the device: the index of the largest value of each row (the
    /// lowest on ties) into `out`, so only ids cross to the host; [`NON_FINITE_ROW`]
    /// for a row holding a NaN or an infinity. Returns `Ok(false)` when the backend has
    /// no such kernel; the caller then reads the logits instead.
    fn argmax_rows(&self, _x: &Self::Act, _out: &mut Vec<u32>) -> BackendResult<bool> {
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
    /// `x += y; rms_norm(x)`: the residual add and the next block's RMSNorm.
    fn add_rms_norm(&self, x: &mut Self::Act, y: &Self::Act, gain: &Self::Vector, eps: f32) -> Self::Act {
        self.add(x, y);
        self.rms_norm(x, gain, eps)
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

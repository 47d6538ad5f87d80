//! Model definitions, each written once over the backend interface, and the interface
//! the engine drives them through ([`CausalLm`]) without knowing their architecture.
//!
//! - [`gpt2`]: GPT-2 (LayerNorm, learned positions, GELU MLP, tied head).
//! - [`llama`]: the Llama family (RMSNorm, RoPE, grouped-query attention, SwiGLU MLP).
//! - [`gemma3`]: Gemma 3 (sandwich RMSNorms, q/k norms, GeGLU, local sliding-window and
//!   global attention blocks, scaled embeddings).
//! - [`load`]: a model folder or a GGUF file → the right architecture.

pub mod gemma3;
pub mod gpt2;
pub mod llama;
pub mod load;
pub mod random;

use crate::backend::{Backend, BackendResult, KvCache, KvLayout, SeqSlice, check, refuse};

/// Positions a sliding-window layer's ring keeps beyond its window: rows a slice may
/// add at once before it is split ([`crate::backend::attention_pieces`]), and how far
/// back a cached sequence can be continued (llama.cpp sizes its SWA cache the same way,
/// window plus a micro-batch).
pub const RING_ROWS: usize = 512;
pub use gemma3::Gemma3;
pub use gpt2::Gpt2;
pub use llama::Llama;
pub use load::load_model;

/// One forward call: the flattened tokens of one or more sequences.
pub struct Batch<'a> {
    pub tokens: &'a [u32],
    pub seqs: &'a [SeqSlice],
}

/// Which rows get logits.
pub enum LogitRows<'a> {
    /// The last row of each sequence (generation).
    LastOfEachSeq,
    /// Every row (evaluation, tests).
    All,
    /// These rows of the batch, in this order (the server: every row of a prompt being
    /// scored, the last row of every other sequence). Each must be inside the batch.
    Rows(&'a [usize]),
}

/// A point in a forward pass where the activations are compared with a reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// The input to the first block (token embeddings, plus position embeddings for GPT-2).
    Embeddings,
    /// The residual stream after block `i`.
    Block(usize),
    /// The final norm's output.
    FinalNorm,
    /// The logits.
    Logits,
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            Stage::Embeddings => write!(f, "embeddings"),
            Stage::Block(i) => write!(f, "block {i}"),
            Stage::FinalNorm => write!(f, "final norm"),
            Stage::Logits => write!(f, "logits"),
        }
    }
}

/// What the engine, the CLI and the verifier know about a model, whatever its architecture.
#[derive(Clone, Debug, PartialEq)]
pub struct ModelInfo {
    /// `gpt2`, `llama`, `gemma3`.
    pub architecture: &'static str,
    pub vocab_size: usize,
    /// Positions the model was trained for: the largest KV cache it accepts.
    pub context_length: usize,
    pub n_layer: usize,
    pub n_params: usize,
    /// What an empty prompt starts from.
    pub bos_token_id: Option<u32>,
    /// Tokens that end generation.
    pub eos_token_ids: Vec<u32>,
}

/// What the loader needs of an architecture: the names its files give it, its config
/// from each kind of file, and its weights loaded over a backend. Each architecture file
/// implements it; [`load::registry`] lists them, once.
pub trait Architecture<B: Backend>: CausalLm<B> + Sized + 'static {
    type Config;
    /// GGUF `general.architecture` values.
    const GGUF_NAMES: &'static [&'static str];
    /// HF `config.json` `model_type` values.
    const HF_MODEL_TYPES: &'static [&'static str];
    fn config_from_hf(json: &str) -> Result<Self::Config, String>;
    fn config_from_gguf(file: &crate::loaders::gguf::GgufFile) -> Result<Self::Config, String>;
    fn load(
        backend: &B,
        config: Self::Config,
        weights: &crate::loaders::Weights,
    ) -> Result<Self, crate::loaders::checkpoint::WeightError>;
}

/// A causal language model over backend `B`: the engine's whole view of a model.
pub trait CausalLm<B: Backend>: Send + Sync {
    fn info(&self) -> &ModelInfo;

    /// Values per position and layer in the KV cache, for keys and for values each.
    fn kv_width(&self) -> usize;

    /// Values per key/value head (`kv_width` is a whole number of heads).
    fn kv_head_dim(&self) -> usize;

    /// Copy positions `0..n` of `src` into `dst` ([`Backend::copy_kv_prefix`]).
    fn copy_cache_prefix(&self, backend: &B, src: &B::KvCache, dst: &mut B::KvCache, n: usize) -> BackendResult<()> {
        backend.copy_kv_prefix(src, dst, n, self.kv_head_dim())
    }

    /// The sliding window of layer `layer`'s attention (`None`: global attention).
    fn layer_window(&self, _layer: usize) -> Option<usize> {
        None
    }

    /// A KV cache for one sequence of up to `capacity` tokens (at most the context). A
    /// sliding-window layer keeps a ring of its window plus [`RING_ROWS`] positions.
    fn new_cache(&self, backend: &B, capacity: usize) -> BackendResult<B::KvCache> {
        backend.new_kv_cache_in(&cache_layout(self, capacity, Some(RING_ROWS))?)
    }

    /// [`CausalLm::forward`], handing each intermediate [`Stage`] to `trace` as it is
    /// computed: what `forge verify` compares with HF's.
    fn forward_traced(
        &self,
        backend: &B,
        batch: &Batch,
        caches: &mut [&mut B::KvCache],
        which: LogitRows<'_>,
        trace: &mut dyn FnMut(Stage, &B::Act) -> BackendResult<()>,
    ) -> BackendResult<B::Act>;

    /// Run the batch through the model, appending to each sequence's cache, and return
    /// the logits of the requested rows: (rows, V).
    fn forward(
        &self,
        backend: &B,
        batch: &Batch,
        caches: &mut [&mut B::KvCache],
        which: LogitRows<'_>,
    ) -> BackendResult<B::Act> {
        self.forward_traced(backend, batch, caches, which, &mut |_, _| Ok(()))
    }
}

/// The KV layout of a cache of `capacity` positions for `model`: each sliding-window
/// layer a ring of its window plus `ring_rows` positions (`None`: every layer whole).
pub fn cache_layout<B: Backend, M: CausalLm<B> + ?Sized>(
    model: &M,
    capacity: usize,
    ring_rows: Option<usize>,
) -> BackendResult<KvLayout> {
    let info = model.info();
    check!(capacity <= info.context_length, "KV cache of {capacity} exceeds the context {}", info.context_length);
    let slots = (0..info.n_layer)
        .map(|l| match (model.layer_window(l), ring_rows) {
            (Some(w), Some(rows)) => capacity.min(w.saturating_add(rows)),
            _ => capacity,
        })
        .collect();
    let windows = (0..info.n_layer).map(|l| model.layer_window(l)).collect();
    Ok(KvLayout { capacity, width: model.kv_width(), slots, windows })
}

/// A model whose sliding-window layers keep rings of their window plus `ring_rows`
/// positions, or every position (`None`: llama.cpp's `--swa-full`, more memory for
/// prefix-cache hits anywhere in a finished sequence), instead of [`RING_ROWS`].
pub struct WindowCaches<B: Backend> {
    pub inner: Box<dyn CausalLm<B>>,
    pub ring_rows: Option<usize>,
}

impl<B: Backend> CausalLm<B> for WindowCaches<B> {
    fn info(&self) -> &ModelInfo {
        self.inner.info()
    }
    fn kv_width(&self) -> usize {
        self.inner.kv_width()
    }
    fn kv_head_dim(&self) -> usize {
        self.inner.kv_head_dim()
    }
    fn layer_window(&self, layer: usize) -> Option<usize> {
        self.inner.layer_window(layer)
    }
    fn new_cache(&self, backend: &B, capacity: usize) -> BackendResult<B::KvCache> {
        backend.new_kv_cache_in(&cache_layout(self, capacity, self.ring_rows)?)
    }
    fn copy_cache_prefix(&self, backend: &B, src: &B::KvCache, dst: &mut B::KvCache, n: usize) -> BackendResult<()> {
        self.inner.copy_cache_prefix(backend, src, dst, n)
    }
    fn forward(
        &self,
        backend: &B,
        batch: &Batch,
        caches: &mut [&mut B::KvCache],
        which: LogitRows<'_>,
    ) -> BackendResult<B::Act> {
        self.inner.forward(backend, batch, caches, which)
    }
    fn forward_traced(
        &self,
        backend: &B,
        batch: &Batch,
        caches: &mut [&mut B::KvCache],
        which: LogitRows<'_>,
        trace: &mut dyn FnMut(Stage, &B::Act) -> BackendResult<()>,
    ) -> BackendResult<B::Act> {
        self.inner.forward_traced(backend, batch, caches, which, trace)
    }
}

/// The checks every model makes on a batch before any kernel runs: token ids in the
/// vocabulary, sequence slices tiling the batch in order, each sequence inside the
/// context and its own cache, caches of the model's shape (`kv_width` per layer).
pub(crate) fn check_batch<K: KvCache>(
    info: &ModelInfo,
    kv_width: usize,
    batch: &Batch,
    caches: &[&mut K],
) -> BackendResult<()> {
    let (tokens, seqs) = (batch.tokens, batch.seqs);
    check!(seqs.len() == caches.len(), "one KV cache per sequence");
    if let Some(&bad) = tokens.iter().find(|&&t| t as usize >= info.vocab_size) {
        refuse!("token id {bad} is out of range (vocabulary size {})", info.vocab_size);
    }
    let mut covered = 0;
    for (s, cache) in seqs.iter().zip(caches.iter()) {
        check!(
            s.rows.start == covered && s.rows.start <= s.rows.end && s.rows.end <= tokens.len(),
            "sequence slices must tile the batch in order"
        );
        covered = s.rows.end;
        let end = s.start_pos.checked_add(s.rows.len()).filter(|&e| e <= info.context_length);
        let Some(end) = end else {
            refuse!(
                "sequence at position {} + {} tokens exceeds the model's context of {}",
                s.start_pos,
                s.rows.len(),
                info.context_length
            );
        };
        let shape = cache.shape();
        check!(
            shape.n_layer == info.n_layer && shape.width == kv_width,
            "KV cache of {} layers × {} does not fit this model ({} layers × {kv_width})",
            shape.n_layer,
            shape.width,
            info.n_layer,
        );
        check!(
            end <= shape.capacity,
            "sequence of {end} tokens does not fit its KV cache of {} positions",
            shape.capacity
        );
    }
    check!(covered == tokens.len(), "sequence slices must cover every token");
    Ok(())
}

/// The rows whose logits are wanted: all of `x`, or the last row of each sequence
/// (on the stack for up to 64 sequences: no allocation in a decode step).
/// The rows of [`LogitRows::Rows`] are inside the batch of `n_tokens` rows.
pub(crate) fn check_logit_rows(which: &LogitRows<'_>, n_tokens: usize) -> BackendResult<()> {
    if let LogitRows::Rows(rows) = which
        && let Some(&bad) = rows.iter().find(|&&r| r >= n_tokens)
    {
        refuse!("logits asked for row {bad} of a batch of {n_tokens}");
    }
    Ok(())
}

pub(crate) fn logit_rows<B: Backend>(backend: &B, x: B::Act, seqs: &[SeqSlice], which: LogitRows<'_>) -> B::Act {
    match which {
        LogitRows::All => x,
        LogitRows::Rows(rows) => backend.select_rows(&x, rows),
        LogitRows::LastOfEachSeq => {
            let mut last = [0usize; 64];
            let mut last_large = Vec::new();
            let rows = seqs.iter().filter(|s| !s.rows.is_empty()).map(|s| s.rows.end - 1);
            let last: &[usize] = if seqs.len() <= last.len() {
                let n = rows.zip(last.iter_mut()).map(|(r, slot)| *slot = r).count();
                &last[..n]
            } else {
                last_large.extend(rows);
                &last_large
            };
            backend.select_rows(&x, last)
        }
    }
}

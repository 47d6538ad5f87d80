//! Gemma 3 (Gemma Team, 2025), the text model, written once over the [`Backend`] interface.
//!
//! ```text
//! x = embed_tokens[tokens] · √C                                    // (T, C)
//! for each block i:
//!     qkv = rms_norm(x) @ [Wq | Wk | Wv]                           // (T, (H + 2·Hkv)·D)
//!     q, k = rms_norm(each q head), rms_norm(each k head)          // q_norm, k_norm
//!     a = attention(rope(q), rope(k), v) @ Wo                      // local or global, see below
//!     x = x + rms_norm(a)                                          // post_attention_norm
//!     m = (gelu(rms_norm(x) @ Wgate) · (rms_norm(x) @ Wup)) @ Wdown // GeGLU, F wide
//!     x = x + rms_norm(m)                                          // post_ffw_norm
//! logits = rms_norm(x) @ embed_tokensᵀ                             // tied head, (T, V)
//! ```
//!
//! Five blocks of six are local: sliding-window attention over the last `sliding_window`
//! keys with RoPE base 10 000; every sixth is global: all keys, base 10⁶ (HF's
//! `layer_types`, llama.cpp's swa pattern 6). Queries are scaled by
//! `query_pre_attn_scalar^-½` (1/√D for the 270M, 1B, 4B, 12B models). RoPE rotates
//! halves in both layouts: llama.cpp's converter does not permute Gemma's q/k rows.
//!
//! Gemma's RMSNorm multiplies by `1 + w`; llama.cpp's converter stores `1 + w` in the
//! GGUF, and an HF checkpoint's `w` gets its `1 +` at load, so both run [`Backend::rms_norm`].

use serde::Deserialize;

use crate::backend::{AttentionSpec, Backend, BackendError, BackendResult, Rope, RopeScaling, RopeStyle};
use crate::loaders::checkpoint::{Tensor, WeightError, Weights, concat_rows, load_matrix};
use crate::loaders::gguf::{GgufFile, MetaValue};
use crate::loaders::llama_config::{rope_scaling_of_gguf, rope_scaling_of_hf};
use crate::model::{Batch, CausalLm, LogitRows, ModelInfo, Stage, check_batch, check_logit_rows, logit_rows};
use crate::tensor::{Dtype, TensorView};

/// Larger models are refused before any allocation.
const MAX_DIM: usize = 1 << 20;
const MAX_CONTEXT: usize = 1 << 24;

/// Gemma 3 hyperparameters, from an HF `config.json` (`gemma3_text`) or a GGUF's `gemma3.*`.
#[derive(Clone, Debug, PartialEq)]
pub struct Gemma3Config {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub rms_norm_eps: f32,
    pub context_length: usize,
    /// Keys a local block's row sees, itself included.
    pub sliding_window: usize,
    /// Per block: whether it is local (sliding window).
    pub local: Vec<bool>,
    /// RoPE bases of the global and the local blocks.
    pub rope_theta: f32,
    pub rope_local_theta: f32,
    /// RoPE scaling of the global blocks (Gemma 3 4B and larger: linear, factor 8); the
    /// local blocks are never scaled, as in HF and llama.cpp.
    pub rope_scaling: RopeScaling,
    /// Queries are scaled by `query_pre_attn_scalar^-½`.
    pub query_pre_attn_scalar: f32,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// llama.cpp's Gemma 3 layout: blocks `i` with `i % 6 < 5` are local.
pub(crate) fn swa_pattern(n_layer: usize, pattern: usize) -> Vec<bool> {
    (0..n_layer).map(|i| pattern == 0 || i % pattern < pattern - 1).collect()
}

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

#[derive(Deserialize)]
struct RawGemma3 {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    head_dim: usize,
    #[serde(default = "default_eps")]
    rms_norm_eps: f32,
    max_position_embeddings: usize,
    sliding_window: usize,
    layer_types: Option<Vec<String>>,
    sliding_window_pattern: Option<usize>,
    #[serde(rename = "_sliding_window_pattern")]
    sliding_window_pattern_private: Option<usize>,
    rope_theta: Option<f32>,
    rope_local_base_freq: Option<f32>,
    rope_scaling: Option<serde_json::Value>,
    rope_parameters: Option<std::collections::HashMap<String, serde_json::Value>>,
    query_pre_attn_scalar: Option<f32>,
    final_logit_softcapping: Option<f32>,
    attn_logit_softcapping: Option<f32>,
    hidden_activation: Option<String>,
    #[serde(default)]
    attention_bias: bool,
    #[serde(default)]
    use_bidirectional_attention: bool,
    #[serde(default = "yes")]
    tie_word_embeddings: bool,
    bos_token_id: Option<u32>,
    eos_token_id: Option<OneOrMany>,
}

fn default_eps() -> f32 {
    1e-6
}
fn yes() -> bool {
    true
}

impl Gemma3Config {
    /// An HF `config.json` of `model_type` `gemma3_text` (transformers 4.50+ and 5.x layouts).
    pub fn from_hf_json(text: &str) -> Result<Self, String> {
        let raw: RawGemma3 = serde_json::from_str(text).map_err(|e| format!("invalid Gemma 3 config: {e}"))?;
        if let Some(t) = &raw.model_type
            && t != "gemma3_text"
        {
            return Err(format!("model_type {t:?} is not a Gemma 3 text config"));
        }
        if let Some(act) = raw.hidden_activation.as_deref()
            && act != "gelu_pytorch_tanh"
        {
            return Err(format!("hidden_activation {act:?} is not supported (Gemma 3's is gelu_pytorch_tanh)"));
        }
        if raw.final_logit_softcapping.is_some() || raw.attn_logit_softcapping.is_some() {
            return Err("logit soft-capping (Gemma 2) is not supported".into());
        }
        if raw.attention_bias || raw.use_bidirectional_attention {
            return Err("attention_bias and bidirectional attention are not supported".into());
        }
        if !raw.tie_word_embeddings {
            return Err("Gemma 3 with an untied head is not supported".into());
        }
        let (mut theta, mut local_theta) = (raw.rope_theta.unwrap_or(1e6), raw.rope_local_base_freq.unwrap_or(1e4));
        // transformers 4.x: `rope_scaling` scales the global blocks; 5.x: `rope_parameters`
        // per attention kind.
        let mut rope_scaling = match &raw.rope_scaling {
            Some(v) => rope_scaling_of_hf(v)?,
            None => RopeScaling::None,
        };
        if let Some(params) = &raw.rope_parameters {
            for (kind, p) in params {
                let t = p.get("rope_theta").and_then(|t| t.as_f64()).map(|t| t as f32);
                let scaling = || rope_scaling_of_hf(p).map_err(|e| format!("{kind}: {e}"));
                match kind.as_str() {
                    "full_attention" => {
                        theta = t.unwrap_or(theta);
                        rope_scaling = scaling()?;
                    }
                    "sliding_attention" => {
                        local_theta = t.unwrap_or(local_theta);
                        if scaling()? != RopeScaling::None {
                            return Err("RoPE scaling of the sliding-window blocks is not supported".into());
                        }
                    }
                    other => {
                        return Err(format!(
                            "rope_parameters key {other:?} is not an attention kind (full_attention, sliding_attention)"
                        ));
                    }
                }
            }
        }
        let n = raw.num_hidden_layers;
        if n > MAX_DIM {
            return Err(format!("{n} layers is implausibly many"));
        }
        let local = match &raw.layer_types {
            Some(types) => {
                if types.len() != n {
                    return Err(format!("{} layer_types for {n} layers", types.len()));
                }
                types
                    .iter()
                    .map(|t| match t.as_str() {
                        "sliding_attention" => Ok(true),
                        "full_attention" => Ok(false),
                        other => Err(format!("layer type {other:?} is not supported")),
                    })
                    .collect::<Result<_, _>>()?
            }
            None => swa_pattern(n, raw.sliding_window_pattern.or(raw.sliding_window_pattern_private).unwrap_or(6)),
        };
        let c = Gemma3Config {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            n_layer: n,
            n_head: raw.num_attention_heads,
            n_kv_head: raw.num_key_value_heads,
            head_dim: raw.head_dim,
            rms_norm_eps: raw.rms_norm_eps,
            context_length: raw.max_position_embeddings,
            sliding_window: raw.sliding_window,
            local,
            rope_theta: theta,
            rope_local_theta: local_theta,
            rope_scaling,
            // transformers' default when the config names none.
            query_pre_attn_scalar: raw.query_pre_attn_scalar.unwrap_or(256.0),
            bos_token_id: raw.bos_token_id,
            eos_token_ids: match raw.eos_token_id {
                None => Vec::new(),
                Some(OneOrMany::One(id)) => vec![id],
                Some(OneOrMany::Many(ids)) => ids,
            },
        };
        c.validate()?;
        Ok(c)
    }

    /// A GGUF file of `general.architecture` `gemma3`, with llama.cpp's defaults where the
    /// file is silent: local RoPE base 10 000, five local blocks of six.
    pub fn from_gguf(f: &GgufFile) -> Result<Self, String> {
        let arch = f.get("general.architecture").and_then(|v| v.as_str()).unwrap_or("");
        if arch != "gemma3" {
            return Err(format!("general.architecture {arch:?} is not gemma3"));
        }
        let num = |key: &str| -> Result<usize, String> {
            let full = format!("gemma3.{key}");
            let v = f.get(&full).ok_or_else(|| format!("metadata {full} is missing"))?;
            let n = v.as_u64().ok_or_else(|| format!("metadata {full} is a {}, not an integer", v.type_name()))?;
            usize::try_from(n).map_err(|_| format!("metadata {full} = {n} is too large"))
        };
        let float = |key: &str, default: f64| -> Result<f32, String> {
            let full = format!("gemma3.{key}");
            match f.get(&full) {
                Some(v) => v.as_f64().map(|x| x as f32).ok_or_else(|| format!("metadata {full} is not a number")),
                None => Ok(default as f32),
            }
        };
        let token = |key: &str| -> Result<Option<u32>, String> {
            match f.get(&format!("tokenizer.ggml.{key}")) {
                None => Ok(None),
                Some(v) => v
                    .as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .map(Some)
                    .ok_or_else(|| format!("metadata tokenizer.ggml.{key} is not a token id")),
            }
        };
        let rope_scaling = rope_scaling_of_gguf(f, "gemma3")?;
        let n_layer = num("block_count")?;
        if n_layer > MAX_DIM {
            return Err(format!("gemma3.block_count = {n_layer} is implausibly many"));
        }
        let (n_head, hidden_size) = (num("attention.head_count")?, num("embedding_length")?);
        let head_dim = num("attention.key_length")?;
        if f.get("gemma3.attention.value_length").is_some() && num("attention.value_length")? != head_dim {
            return Err("gemma3.attention.value_length differs from key_length: not supported".into());
        }
        let vocab_size = f.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()).map_or(0, |a| a.len());
        // llama.cpp: 1/√(C/H) for the 27B model (62 blocks), 1/√D for the others.
        let query_pre_attn_scalar = if n_layer == 62 { (hidden_size / n_head.max(1)) as f32 } else { head_dim as f32 };
        // As llama.cpp's loader: no window (or 0) means every block is global; the blocks'
        // kinds come from `sliding_window_pattern`, an array (one flag per block) or a
        // period n (the last block of every n is global), five of six by default.
        let window = match f.get("gemma3.attention.sliding_window") {
            None => 0,
            Some(_) => num("attention.sliding_window")?,
        };
        let key = "gemma3.attention.sliding_window_pattern";
        let local = match f.get(key) {
            _ if window == 0 => vec![false; n_layer],
            None => swa_pattern(n_layer, 6),
            Some(MetaValue::Array(_, flags)) => {
                if flags.len() != n_layer {
                    return Err(format!("metadata {key} has {} entries for {n_layer} blocks", flags.len()));
                }
                let flag = |v: &MetaValue| v.as_bool().or_else(|| v.as_u64().map(|n| n != 0));
                flags
                    .iter()
                    .map(|v| flag(v).ok_or_else(|| format!("metadata {key} holds a {}, not a flag", v.type_name())))
                    .collect::<Result<_, _>>()?
            }
            Some(v) => {
                let n = v.as_u64().ok_or_else(|| format!("metadata {key} is a {}, not a period", v.type_name()))?;
                swa_pattern(n_layer, usize::try_from(n).unwrap_or(usize::MAX))
            }
        };
        let context_length = num("context_length")?;
        let c = Gemma3Config {
            vocab_size,
            hidden_size,
            intermediate_size: num("feed_forward_length")?,
            n_layer,
            n_head,
            n_kv_head: match f.get("gemma3.attention.head_count_kv") {
                Some(_) => num("attention.head_count_kv")?,
                None => n_head,
            },
            head_dim,
            rms_norm_eps: float("attention.layer_norm_rms_epsilon", 1e-6)?,
            context_length,
            // Without local blocks the window is never used.
            sliding_window: if window == 0 { context_length } else { window },
            local,
            rope_theta: float("rope.freq_base", 1e6)?,
            rope_local_theta: float("rope.freq_base_swa", 10_000.0)?,
            rope_scaling,
            query_pre_attn_scalar,
            bos_token_id: token("bos_token_id")?,
            eos_token_ids: token("eos_token_id")?.into_iter().collect(),
        };
        c.validate()?;
        Ok(c)
    }

    pub fn validate(&self) -> Result<(), String> {
        let dims = [
            self.vocab_size,
            self.hidden_size,
            self.intermediate_size,
            self.n_layer,
            self.n_head,
            self.n_kv_head,
            self.head_dim,
            self.context_length,
            self.sliding_window,
        ];
        if dims.contains(&0) {
            return Err(
                "every size of the model (vocabulary, widths, layers, heads, context, window) must be positive".into(),
            );
        }
        if dims[..7].iter().any(|&d| d > MAX_DIM) || self.context_length > MAX_CONTEXT {
            return Err("a dimension of the model is implausibly large".into());
        }
        if self.local.len() != self.n_layer {
            return Err(format!("{} layer types for {} layers", self.local.len(), self.n_layer));
        }
        if !self.n_head.is_multiple_of(self.n_kv_head) || !self.head_dim.is_multiple_of(2) {
            return Err(format!(
                "{} heads over {} key/value heads of {} values: not a valid attention shape",
                self.n_head, self.n_kv_head, self.head_dim
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err("rms_norm_eps must be positive".into());
        }
        for t in [self.rope_theta, self.rope_local_theta] {
            if !(t.is_finite() && t > 1.0) {
                return Err(format!("RoPE base {t} must be a finite base above 1"));
            }
        }
        if !(self.query_pre_attn_scalar.is_finite() && self.query_pre_attn_scalar > 0.0) {
            return Err("query_pre_attn_scalar must be positive".into());
        }
        for id in self.bos_token_id.iter().chain(&self.eos_token_ids) {
            if *id as usize >= self.vocab_size {
                return Err(format!("special token id {id} is outside the vocabulary of {}", self.vocab_size));
            }
        }
        self.checked_n_params().map(|_| ()).ok_or_else(|| "the config describes too many parameters".into())
    }

    /// Parameters (the tied head counted once); `None` on overflow.
    pub fn checked_n_params(&self) -> Option<usize> {
        let (c, f, v, d) = (self.hidden_size, self.intermediate_size, self.vocab_size, self.head_dim);
        let q = self.n_head.checked_mul(d)?;
        let kv = self.n_kv_head.checked_mul(d)?;
        let attn = c.checked_mul(q.checked_mul(2)?.checked_add(kv.checked_mul(2)?)?)?;
        let block = attn.checked_add(c.checked_mul(f)?.checked_mul(3)?)?.checked_add(c * 4 + 2 * d)?;
        self.n_layer.checked_mul(block)?.checked_add(v.checked_mul(c)?)?.checked_add(c)
    }
}

struct Block<B: Backend> {
    attn_norm: B::Vector,
    wqkv: B::Matrix, // C → (H + 2·Hkv)·D
    q_norm: B::Vector,
    k_norm: B::Vector, // D each
    wo: B::Matrix,     // H·D → C
    post_attn_norm: B::Vector,
    ffn_norm: B::Vector,
    w_gate_up: B::Matrix, // C → 2F
    w_down: B::Matrix,    // F → C
    post_ffn_norm: B::Vector,
    spec: AttentionSpec,
}

pub struct Gemma3<B: Backend> {
    config: Gemma3Config,
    info: ModelInfo,
    embed: B::Matrix, // (V, C), also the head
    blocks: Vec<Block<B>>,
    norm: B::Vector,
}

/// The tensor names of the two layouts: (GGUF, HF) for each part of a block.
pub(crate) const PARTS: [(&str, &str); 13] = [
    ("attn_norm", "input_layernorm"),
    ("attn_q", "self_attn.q_proj"),
    ("attn_k", "self_attn.k_proj"),
    ("attn_v", "self_attn.v_proj"),
    ("attn_q_norm", "self_attn.q_norm"),
    ("attn_k_norm", "self_attn.k_norm"),
    ("attn_output", "self_attn.o_proj"),
    ("post_attention_norm", "post_attention_layernorm"),
    ("ffn_norm", "pre_feedforward_layernorm"),
    ("ffn_gate", "mlp.gate_proj"),
    ("ffn_up", "mlp.up_proj"),
    ("ffn_down", "mlp.down_proj"),
    ("post_ffw_norm", "post_feedforward_layernorm"),
];

impl<B: Backend> Gemma3<B> {
    pub fn load(backend: &B, config: Gemma3Config, weights: &Weights) -> Result<Self, WeightError> {
        config.validate().map_err(|message| WeightError::Config { architecture: "Gemma 3", message })?;
        let gguf = matches!(weights, Weights::Gguf(_));
        let name = |i: usize, gguf_part: &str| -> String {
            let (_, hf) = PARTS.iter().find(|p| p.0 == gguf_part).expect("a known part");
            if gguf { format!("blk.{i}.{gguf_part}.weight") } else { format!("model.layers.{i}.{hf}.weight") }
        };
        let (c, f, v, d) = (config.hidden_size, config.intermediate_size, config.vocab_size, config.head_dim);
        let get = |name: &str, shape: &[usize]| weights.require(name, shape);
        // Gemma's norms multiply by 1 + w: the GGUF holds 1 + w already, HF's files w.
        let norm = |name: &str, n: usize| -> Result<B::Vector, WeightError> {
            let t = get(name, &[n])?;
            let mut g = t.to_f32()?;
            if !gguf {
                g.iter_mut().for_each(|w| *w += 1.0);
            }
            let bytes: Vec<u8> = g.iter().flat_map(|x| x.to_le_bytes()).collect();
            Ok(backend.load_vector(&TensorView { name, dtype: Dtype::F32, shape: &[n], bytes: &bytes })?)
        };
        let matrix = |t: Tensor| load_matrix(backend, &t);
        let global_factors: Option<std::sync::Arc<[f32]>> =
            config.rope_scaling.freq_factors(config.rope_theta, d).map(Into::into);
        let blocks = (0..config.n_layer)
            .map(|i| {
                let n = |part: &str| name(i, part);
                let local = config.local[i];
                let spec = AttentionSpec {
                    n_head: config.n_head,
                    n_kv_head: config.n_kv_head,
                    head_dim: d,
                    scale: 1.0 / config.query_pre_attn_scalar.sqrt(),
                    rope: Some(if local {
                        Rope::new(config.rope_local_theta, RopeStyle::Halves)
                    } else {
                        Rope { freq_factors: global_factors.clone(), ..Rope::new(config.rope_theta, RopeStyle::Halves) }
                    }),
                    window: local.then_some(config.sliding_window),
                };
                backend.supports(&spec)?;
                let (qw, kw) = (spec.q_width(), spec.kv_width());
                let qkv = concat_rows(
                    &format!("layer {i} q|k|v"),
                    &[get(&n("attn_q"), &[qw, c])?, get(&n("attn_k"), &[kw, c])?, get(&n("attn_v"), &[kw, c])?],
                )?;
                let gate_up = concat_rows(
                    &format!("layer {i} gate|up"),
                    &[get(&n("ffn_gate"), &[f, c])?, get(&n("ffn_up"), &[f, c])?],
                )?;
                Ok(Block {
                    attn_norm: norm(&n("attn_norm"), c)?,
                    wqkv: matrix(qkv)?,
                    q_norm: norm(&n("attn_q_norm"), d)?,
                    k_norm: norm(&n("attn_k_norm"), d)?,
                    wo: matrix(get(&n("attn_output"), &[c, qw])?)?,
                    post_attn_norm: norm(&n("post_attention_norm"), c)?,
                    ffn_norm: norm(&n("ffn_norm"), c)?,
                    w_gate_up: matrix(gate_up)?,
                    w_down: matrix(get(&n("ffn_down"), &[c, f])?)?,
                    post_ffn_norm: norm(&n("post_ffw_norm"), c)?,
                    spec,
                })
            })
            .collect::<Result<Vec<_>, WeightError>>()?;
        let (embed_name, norm_name) = if gguf {
            ("token_embd.weight", "output_norm.weight")
        } else {
            ("model.embed_tokens.weight", "model.norm.weight")
        };
        if gguf && weights.get("output.weight")?.is_some() {
            return Err(WeightError::Unsupported("output.weight: Gemma 3 with an untied head is not supported".into()));
        }
        let info = ModelInfo {
            architecture: "gemma3",
            vocab_size: v,
            context_length: config.context_length,
            n_layer: config.n_layer,
            n_params: config.checked_n_params().unwrap_or(usize::MAX),
            bos_token_id: config.bos_token_id,
            eos_token_ids: config.eos_token_ids.clone(),
        };
        Ok(Gemma3 { embed: matrix(get(embed_name, &[v, c])?)?, norm: norm(norm_name, c)?, blocks, info, config })
    }

    pub fn config(&self) -> &Gemma3Config {
        &self.config
    }
}

impl<B: Backend> crate::model::Architecture<B> for Gemma3<B> {
    type Config = Gemma3Config;
    const GGUF_NAMES: &'static [&'static str] = &["gemma3"];
    const HF_MODEL_TYPES: &'static [&'static str] = &["gemma3_text"];

    fn config_from_hf(json: &str) -> Result<Gemma3Config, String> {
        Gemma3Config::from_hf_json(json)
    }

    fn config_from_gguf(file: &crate::loaders::gguf::GgufFile) -> Result<Gemma3Config, String> {
        Gemma3Config::from_gguf(file)
    }

    fn load(backend: &B, config: Gemma3Config, weights: &Weights) -> Result<Self, WeightError> {
        Gemma3::load(backend, config, weights)
    }
}

impl<B: Backend> CausalLm<B> for Gemma3<B> {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn kv_width(&self) -> usize {
        self.config.n_kv_head * self.config.head_dim
    }

    fn kv_head_dim(&self) -> usize {
        self.config.head_dim
    }

    fn layer_window(&self, layer: usize) -> Option<usize> {
        self.config.local.get(layer).is_some_and(|&l| l).then_some(self.config.sliding_window)
    }

    fn forward_traced(
        &self,
        backend: &B,
        batch: &Batch,
        caches: &mut [&mut B::KvCache],
        which: LogitRows<'_>,
        trace: &mut dyn FnMut(Stage, &B::Act) -> BackendResult<()>,
    ) -> BackendResult<B::Act> {
        check_batch(&self.info, self.kv_width(), batch, caches)?;
        check_logit_rows(&which, batch.tokens.len())?;
        let (eps, seqs) = (self.config.rms_norm_eps, batch.seqs);
        let mut x = backend.embed(&self.embed, batch.tokens); // (T, C)
        backend.scale(&mut x, (self.config.hidden_size as f32).sqrt());
        trace(Stage::Embeddings, &x)?;
        let first = self.blocks.first().ok_or_else(|| BackendError::Invalid("the model has no blocks".into()))?;
        let mut h = backend.rms_norm(&x, &first.attn_norm, eps); // (T, C)
        for (layer, b) in self.blocks.iter().enumerate() {
            let mut qkv = backend.linear(&h, &b.wqkv, None); // (T, (H + 2·Hkv)·D)
            backend.qk_norm(&mut qkv, &b.spec, &b.q_norm, &b.k_norm, eps)?;
            let attn = backend.attention(&qkv, seqs, caches, layer, &b.spec)?; // (T, H·D)
            let attn_out = backend.rms_norm(&backend.linear(&attn, &b.wo, None), &b.post_attn_norm, eps); // (T, C)
            h = backend.add_rms_norm(&mut x, &attn_out, &b.ffn_norm, eps); // x += attn; h = rms_norm(x)
            let gate_up = backend.linear(&h, &b.w_gate_up, None); // (T, 2F)
            let act = backend.geglu(&gate_up); // (T, F)
            let mlp_out = backend.rms_norm(&backend.linear(&act, &b.w_down, None), &b.post_ffn_norm, eps); // (T, C)
            match self.blocks.get(layer + 1) {
                Some(next) => h = backend.add_rms_norm(&mut x, &mlp_out, &next.attn_norm, eps),
                None => backend.add(&mut x, &mlp_out),
            }
            trace(Stage::Block(layer), &x)?;
        }
        let x = logit_rows(backend, x, seqs, which);
        let x = backend.rms_norm(&x, &self.norm, eps); // (rows, C)
        trace(Stage::FinalNorm, &x)?;
        let logits = backend.linear(&x, &self.embed, None); // (rows, V)
        trace(Stage::Logits, &logits)?;
        Ok(logits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn five_local_blocks_of_six() {
        let p = swa_pattern(13, 6);
        let global: Vec<usize> = (0..13).filter(|&i| !p[i]).collect();
        assert_eq!(global, [5, 11]);
    }

    /// llama.cpp's reading of a GGUF file's block kinds: five of six by default, a period,
    /// one flag per block, or no window at all.
    #[test]
    fn gguf_window_patterns() {
        use crate::loaders::gguf_write::{GgufPlan, GgufWriter};
        let config = |extra: &[(&str, Option<MetaValue>)]| {
            let mut plan = GgufPlan::default();
            plan.set("general.architecture", MetaValue::String("gemma3".into()));
            for (k, v) in [
                ("block_count", 7),
                ("context_length", 64),
                ("embedding_length", 32),
                ("feed_forward_length", 48),
                ("attention.head_count", 2),
                ("attention.key_length", 16),
                ("attention.sliding_window", 4),
            ] {
                plan.set(&format!("gemma3.{k}"), MetaValue::U32(v));
            }
            plan.set("tokenizer.ggml.tokens", MetaValue::Array(8, vec![MetaValue::String("a".into()); 5]));
            for (k, v) in extra {
                match v {
                    Some(v) => plan.set(&format!("gemma3.attention.{k}"), v.clone()),
                    None => plan.remove(&format!("gemma3.attention.{k}")),
                }
            }
            let bytes = GgufWriter::new(Vec::new(), plan).unwrap().finish().unwrap();
            Gemma3Config::from_gguf(&GgufFile::from_bytes("mem", bytes).unwrap())
        };
        let globals = |c: Gemma3Config| (0..c.n_layer).filter(|&i| !c.local[i]).collect::<Vec<_>>();
        assert_eq!(globals(config(&[]).unwrap()), [5]);
        assert_eq!(globals(config(&[("sliding_window_pattern", Some(MetaValue::U32(3)))]).unwrap()), [2, 5]);
        let flags = [1u8, 0, 0, 1, 1, 0, 1].map(|b| MetaValue::Bool(b == 1)).to_vec();
        let c = config(&[("sliding_window_pattern", Some(MetaValue::Array(7, flags.clone())))]).unwrap();
        assert_eq!((globals(c.clone()), c.sliding_window), (vec![1, 2, 5], 4));
        for window in [Some(MetaValue::U32(0)), None] {
            let c = config(&[("sliding_window", window)]).unwrap();
            assert_eq!((globals(c.clone()).len(), c.sliding_window), (7, 64));
        }
        // Period 0: every block local, as llama.cpp's set_swa_pattern has it.
        let c = config(&[("sliding_window_pattern", Some(MetaValue::U32(0)))]).unwrap();
        assert!(c.local.iter().all(|&l| l));
        let err = config(&[("sliding_window_pattern", Some(MetaValue::Array(7, flags[..6].to_vec())))]).unwrap_err();
        assert!(err.contains("6 entries for 7 blocks"), "{err}");
        let err = config(&[("sliding_window_pattern", Some(MetaValue::F32(6.0)))]).unwrap_err();
        assert!(err.contains("not a period"), "{err}");
    }

    #[test]
    fn hf_configs_of_both_transformers_layouts() {
        let base = r#""vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 3,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "max_position_embeddings": 128,
            "sliding_window": 4, "query_pre_attn_scalar": 16"#;
        let v5 = format!(
            r#"{{"model_type": "gemma3_text", {base}, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                "rope_parameters": {{"sliding_attention": {{"rope_type": "default", "rope_theta": 10000.0}},
                                     "full_attention": {{"rope_type": "default", "rope_theta": 1000000.0}}}}}}"#
        );
        let c = Gemma3Config::from_hf_json(&v5).unwrap();
        assert_eq!(c.local, [true, false, true]);
        assert_eq!((c.rope_theta, c.rope_local_theta), (1e6, 1e4));
        let v4 = format!(
            r#"{{"model_type": "gemma3_text", {base}, "sliding_window_pattern": 2, "rope_theta": 5e5, "rope_local_base_freq": 2e4}}"#
        );
        let c = Gemma3Config::from_hf_json(&v4).unwrap();
        assert_eq!(c.local, [true, false, true]);
        assert_eq!((c.rope_theta, c.rope_local_theta), (5e5, 2e4));
        let capped = format!(r#"{{"model_type": "gemma3_text", {base}, "final_logit_softcapping": 30.0}}"#);
        assert!(Gemma3Config::from_hf_json(&capped).unwrap_err().contains("soft-capping"));
        let scaled = format!(
            r#"{{"model_type": "gemma3_text", {base}, "rope_scaling": {{"rope_type": "linear", "factor": 8.0}}}}"#
        );
        // transformers 4.x: `rope_scaling` scales the global blocks (Gemma 3 4B's config).
        let c = Gemma3Config::from_hf_json(&scaled).unwrap();
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 8.0 });
        let yarn = format!(
            r#"{{"model_type": "gemma3_text", {base}, "rope_scaling": {{"rope_type": "yarn", "factor": 8.0}}}}"#
        );
        assert!(Gemma3Config::from_hf_json(&yarn).unwrap_err().contains("\"yarn\""));
        let local = format!(
            r#"{{"model_type": "gemma3_text", {base}, "rope_parameters": {{"sliding_attention": {{"rope_type": "linear", "factor": 2.0}}}}}}"#
        );
        assert!(Gemma3Config::from_hf_json(&local).unwrap_err().contains("sliding-window blocks"));
        let flat = format!(
            r#"{{"model_type": "gemma3_text", {base}, "rope_parameters": {{"rope_type": "default", "rope_theta": 1e6}}}}"#
        );
        assert!(Gemma3Config::from_hf_json(&flat).unwrap_err().contains("not an attention kind"));
    }
}

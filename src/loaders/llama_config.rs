//! Llama-family hyperparameters, from an HF `config.json` (`LlamaForCausalLM`,
//! `Qwen2ForCausalLM`, `Qwen3ForCausalLM`) or from a GGUF file's `llama.*`, `qwen2.*`,
//! `qwen3.*` metadata: all end in one validated [`LlamaConfig`].

use serde::Deserialize;

use super::gguf::GgufFile;
use crate::backend::RopeScaling;

/// Larger models are refused before any allocation.
const MAX_DIM: usize = 1 << 20;
const MAX_PARAMS: usize = 1 << 40;
const MAX_CONTEXT: usize = 1 << 24;

/// The members of the Llama family, by what each adds to Llama's block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LlamaVariant {
    Llama,
    /// Qwen 2 (and 2.5): biases on the q, k and v projections.
    Qwen2,
    /// Qwen 3: RMSNorm on each query and key head before RoPE (`q_norm`, `k_norm`).
    Qwen3,
}

impl LlamaVariant {
    /// HF's `model_type` and GGUF's `general.architecture`.
    pub fn name(self) -> &'static str {
        match self {
            LlamaVariant::Llama => "llama",
            LlamaVariant::Qwen2 => "qwen2",
            LlamaVariant::Qwen3 => "qwen3",
        }
    }

    pub fn from_name(name: &str) -> Option<Self> {
        [LlamaVariant::Llama, LlamaVariant::Qwen2, LlamaVariant::Qwen3].into_iter().find(|v| v.name() == name)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    pub variant: LlamaVariant,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub n_layer: usize,
    pub n_head: usize,
    pub n_kv_head: usize,
    pub head_dim: usize,
    pub rope_theta: f32,
    /// RoPE scaling from the config (HF) or the metadata (GGUF `rope.scaling.type`
    /// `linear`); a GGUF's `rope_freqs.weight` tensor is read by the model.
    pub rope_scaling: RopeScaling,
    pub rms_norm_eps: f32,
    /// Context length (`max_position_embeddings`, `llama.context_length`).
    pub context_length: usize,
    /// The output head is the token embedding (no `lm_head` / `output.weight`).
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    /// Tokens that end generation (HF allows a list: an instruct model's end-of-turn and
    /// end-of-text).
    pub eos_token_ids: Vec<u32>,
}

/// The RoPE scaling of an HF `rope_scaling` object or transformers 5's `rope_parameters`
/// of one attention kind: `default`, `linear` or `llama3`; any other type is refused by name.
pub fn rope_scaling_of_hf(v: &serde_json::Value) -> Result<RopeScaling, String> {
    if v.is_null() {
        return Ok(RopeScaling::None);
    }
    if !v.is_object() {
        return Err(format!("RoPE scaling {v} is not an object"));
    }
    let ty = v.get("rope_type").or_else(|| v.get("type")).and_then(|t| t.as_str()).unwrap_or("default");
    let num = |k: &str| -> Result<f32, String> {
        let x =
            v.get(k).and_then(|x| x.as_f64()).ok_or_else(|| format!("{ty} RoPE scaling needs a number {k}, in {v}"))?;
        if x.is_finite() && x > 0.0 && x < 1e9 {
            Ok(x as f32)
        } else {
            Err(format!("RoPE scaling {k} = {x} is not a positive number"))
        }
    };
    match ty {
        "default" => Ok(RopeScaling::None),
        "linear" => match num("factor")? {
            1.0 => Ok(RopeScaling::None),
            factor => Ok(RopeScaling::Linear { factor }),
        },
        "llama3" => {
            let (low_freq_factor, high_freq_factor) = (num("low_freq_factor")?, num("high_freq_factor")?);
            if high_freq_factor <= low_freq_factor {
                return Err(format!(
                    "llama3 RoPE scaling needs high_freq_factor ({high_freq_factor}) above low_freq_factor ({low_freq_factor})"
                ));
            }
            Ok(RopeScaling::Llama3 {
                factor: num("factor")?,
                low_freq_factor,
                high_freq_factor,
                original_context: num("original_max_position_embeddings")?,
            })
        }
        other => Err(format!("RoPE scaling {other:?} is not supported (supported: default, linear, llama3)")),
    }
}

/// A GGUF's `{arch}.rope.scaling.type` and `.factor` (or the older `{arch}.rope.scale_linear`),
/// read as llama.cpp reads them: the type defaults to `linear`, a factor of 0 or none means
/// no scaling. llama.cpp's converter writes Llama 3's scaling as the `rope_freqs.weight`
/// tensor instead, which the model reads.
pub fn rope_scaling_of_gguf(f: &GgufFile, arch: &str) -> Result<RopeScaling, String> {
    let ty = match f.get(&format!("{arch}.rope.scaling.type")) {
        None => "linear",
        Some(v) => v.as_str().ok_or_else(|| format!("metadata {arch}.rope.scaling.type is not a string"))?,
    };
    let factor = |key: &str| -> Result<Option<f64>, String> {
        let full = format!("{arch}.{key}");
        match f.get(&full) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .filter(|x| x.is_finite() && *x >= 0.0 && *x < 1e9)
                .map(Some)
                .ok_or_else(|| format!("metadata {full} is not a non-negative number")),
        }
    };
    match ty {
        "none" => Ok(RopeScaling::None),
        "linear" => match factor("rope.scaling.factor")?.or(factor("rope.scale_linear")?) {
            None => Ok(RopeScaling::None),
            Some(x) if x == 0.0 || x == 1.0 => Ok(RopeScaling::None),
            Some(x) => Ok(RopeScaling::Linear { factor: x as f32 }),
        },
        other => Err(format!("{arch}.rope.scaling.type {other:?} is not supported (supported: none, linear)")),
    }
}

/// A number or a list of numbers (`eos_token_id` in HF configs).
#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(u32),
    Many(Vec<u32>),
}

#[derive(Deserialize)]
struct RawLlama {
    model_type: Option<String>,
    vocab_size: usize,
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    rope_theta: Option<f32>,
    rope_parameters: Option<serde_json::Value>,
    rope_scaling: Option<serde_json::Value>,
    #[serde(default = "default_rms_eps")]
    rms_norm_eps: f32,
    max_position_embeddings: usize,
    #[serde(default)]
    tie_word_embeddings: bool,
    hidden_act: Option<String>,
    attention_bias: Option<bool>,
    #[serde(default)]
    mlp_bias: bool,
    use_sliding_window: Option<bool>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<OneOrMany>,
}

fn default_rms_eps() -> f32 {
    1e-6
}

impl LlamaConfig {
    /// An HF `config.json` of `model_type` `llama`, `qwen2` or `qwen3`.
    pub fn from_hf_json(text: &str) -> Result<Self, String> {
        let raw: RawLlama = serde_json::from_str(text).map_err(|e| format!("invalid Llama config: {e}"))?;
        let variant = match raw.model_type.as_deref() {
            None => LlamaVariant::Llama,
            Some(t) => LlamaVariant::from_name(t)
                .ok_or_else(|| format!("model_type {t:?} is not a Llama-family config (llama, qwen2, qwen3)"))?,
        };
        if raw.use_sliding_window == Some(true) {
            return Err("use_sliding_window is not supported for this architecture".into());
        }
        if let Some(act) = raw.hidden_act.as_deref()
            && act != "silu"
        {
            return Err(format!("hidden_act {act:?} is not supported (Llama's MLP is SwiGLU: silu)"));
        }
        // Qwen 2 has q/k/v biases whatever its config says; the others none.
        if (raw.attention_bias == Some(true) && variant != LlamaVariant::Qwen2) || raw.mlp_bias {
            return Err("attention_bias / mlp_bias are not supported (Llama has no biases)".into());
        }
        // transformers 5 writes `rope_parameters` (with `rope_theta` inside), 4.x `rope_scaling`.
        let rope_scaling = match (&raw.rope_parameters, &raw.rope_scaling) {
            (Some(p), _) if !p.is_null() => rope_scaling_of_hf(p)?,
            (_, Some(s)) => rope_scaling_of_hf(s)?,
            _ => RopeScaling::None,
        };
        let rope_theta = raw
            .rope_parameters
            .as_ref()
            .and_then(|p| p.get("rope_theta"))
            .and_then(|t| t.as_f64())
            .map(|t| t as f32)
            .or(raw.rope_theta)
            .unwrap_or(10000.0);
        let n_head = raw.num_attention_heads;
        let head_dim = match raw.head_dim {
            Some(d) => d,
            None if n_head > 0 => raw.hidden_size / n_head,
            None => 0,
        };
        let c = LlamaConfig {
            variant,
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            intermediate_size: raw.intermediate_size,
            n_layer: raw.num_hidden_layers,
            n_head,
            n_kv_head: raw.num_key_value_heads.unwrap_or(n_head),
            head_dim,
            rope_theta,
            rope_scaling,
            rms_norm_eps: raw.rms_norm_eps,
            context_length: raw.max_position_embeddings,
            tie_word_embeddings: raw.tie_word_embeddings,
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

    /// A GGUF file of `general.architecture` `llama`, `qwen2` or `qwen3`. `tie_word_embeddings` follows the
    /// absence of `output.weight`; BOS/EOS come from `tokenizer.ggml.*`.
    pub fn from_gguf(f: &GgufFile) -> Result<Self, String> {
        let arch = f.get("general.architecture").and_then(|v| v.as_str()).unwrap_or("");
        let variant = LlamaVariant::from_name(arch)
            .ok_or_else(|| format!("general.architecture {arch:?} is not llama, qwen2 or qwen3"))?;
        let key = |k: &str| format!("{arch}.{k}");
        let num = |key: &str| -> Result<usize, String> {
            let full = format!("{arch}.{key}");
            let v = f.get(&full).ok_or_else(|| format!("metadata {full} is missing"))?;
            let n = v.as_u64().ok_or_else(|| format!("metadata {full} is a {}, not an integer", v.type_name()))?;
            usize::try_from(n).map_err(|_| format!("metadata {full} = {n} is too large"))
        };
        let float = |key: &str, default: Option<f64>| -> Result<f32, String> {
            let full = format!("{arch}.{key}");
            match f.get(&full) {
                Some(v) => v.as_f64().map(|x| x as f32).ok_or_else(|| format!("metadata {full} is not a number")),
                None => default.map(|d| d as f32).ok_or_else(|| format!("metadata {full} is missing")),
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
        let n_head = num("attention.head_count")?;
        let hidden_size = num("embedding_length")?;
        let head_dim = match f.get(&key("attention.key_length")) {
            Some(_) => num("attention.key_length")?,
            None if n_head > 0 => hidden_size / n_head,
            None => 0,
        };
        if f.get(&key("attention.value_length")).is_some() && num("attention.value_length")? != head_dim {
            return Err(format!("{arch}.attention.value_length differs from key_length: not supported"));
        }
        if f.get(&key("rope.dimension_count")).is_some() && num("rope.dimension_count")? != head_dim {
            return Err(format!(
                "{arch}.rope.dimension_count differs from the head size (partial RoPE): not supported"
            ));
        }
        let rope_scaling = rope_scaling_of_gguf(f, arch)?;
        if f.get(&key("expert_count")).and_then(|v| v.as_u64()).is_some_and(|n| n > 0) {
            return Err("mixture-of-experts Llama models are not supported".into());
        }
        let vocab_size = match f.get(&key("vocab_size")) {
            Some(_) => num("vocab_size")?,
            None => f.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()).map_or(0, |a| a.len()),
        };
        let c = LlamaConfig {
            variant,
            vocab_size,
            hidden_size,
            intermediate_size: num("feed_forward_length")?,
            n_layer: num("block_count")?,
            n_head,
            n_kv_head: match f.get(&key("attention.head_count_kv")) {
                Some(_) => num("attention.head_count_kv")?,
                None => n_head,
            },
            head_dim,
            rope_theta: float("rope.freq_base", Some(10000.0))?,
            rope_scaling,
            rms_norm_eps: float("attention.layer_norm_rms_epsilon", None)?,
            context_length: num("context_length")?,
            tie_word_embeddings: f.tensor("output.weight").is_none(),
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
        ];
        if dims.contains(&0) {
            return Err("every size of the model (vocabulary, widths, layers, heads, context) must be positive".into());
        }
        if dims[..7].iter().any(|&d| d > MAX_DIM) {
            return Err("a dimension of the model is implausibly large".into());
        }
        if self.context_length > MAX_CONTEXT {
            return Err(format!("context length {} is implausibly large", self.context_length));
        }
        if !self.n_head.is_multiple_of(self.n_kv_head) {
            return Err(format!(
                "{} attention heads do not share {} key/value heads evenly",
                self.n_head, self.n_kv_head
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return Err(format!("head size {} is odd: RoPE rotates pairs", self.head_dim));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps > 0.0) {
            return Err("rms_norm_eps must be positive".into());
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 1.0) {
            return Err(format!("rope_theta {} must be a finite base above 1", self.rope_theta));
        }
        for id in self.bos_token_id.iter().chain(&self.eos_token_ids) {
            if *id as usize >= self.vocab_size {
                return Err(format!("special token id {id} is outside the vocabulary of {}", self.vocab_size));
            }
        }
        match self.checked_n_params() {
            Some(n) if n <= MAX_PARAMS => Ok(()),
            _ => Err(format!("the config describes more than {MAX_PARAMS} parameters")),
        }
    }

    /// Parameters (a tied head counted once); `None` on overflow.
    pub fn checked_n_params(&self) -> Option<usize> {
        let (c, f, v) = (self.hidden_size, self.intermediate_size, self.vocab_size);
        let q = self.n_head.checked_mul(self.head_dim)?;
        let kv = self.n_kv_head.checked_mul(self.head_dim)?;
        let attn = c.checked_mul(q.checked_mul(2)?.checked_add(kv.checked_mul(2)?)?)?;
        let mlp = c.checked_mul(f)?.checked_mul(3)?;
        let extra = match self.variant {
            LlamaVariant::Llama => 0,
            LlamaVariant::Qwen2 => q.checked_add(kv.checked_mul(2)?)?,
            LlamaVariant::Qwen3 => self.head_dim.checked_mul(2)?,
        };
        let block = attn.checked_add(mlp)?.checked_add(c.checked_mul(2)?)?.checked_add(extra)?;
        let embed = v.checked_mul(c)?;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        self.n_layer.checked_mul(block)?.checked_add(embed)?.checked_add(head)?.checked_add(c)
    }
}

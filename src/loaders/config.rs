//! GPT-2 `config.json`: every size (distilgpt2, 124M, medium, large, XL) comes from here.

use serde::Deserialize;

/// Larger configs are refused: a trillion parameters is past any GPT-2 this engine can hold.
pub const MAX_PARAMS: usize = 1 << 40;

#[derive(Clone, Debug, PartialEq)]
pub struct Gpt2Config {
    pub vocab_size: usize,
    /// Context length (`n_positions`, or the older `n_ctx`).
    pub n_positions: usize,
    pub n_embd: usize,
    pub n_layer: usize,
    pub n_head: usize,
    /// MLP width (`n_inner`, default 4 × n_embd).
    pub n_inner: usize,
    pub layer_norm_epsilon: f32,
    pub scale_attn_by_inverse_layer_idx: bool,
    pub bos_token_id: u32,
    pub eos_token_id: u32,
}

#[derive(Deserialize)]
struct RawConfig {
    model_type: Option<String>,
    vocab_size: usize,
    n_positions: Option<usize>,
    n_ctx: Option<usize>,
    n_embd: usize,
    n_layer: usize,
    n_head: usize,
    n_inner: Option<usize>,
    #[serde(default = "default_eps")]
    layer_norm_epsilon: f32,
    activation_function: Option<String>,
    scale_attn_weights: Option<bool>,
    #[serde(default)]
    scale_attn_by_inverse_layer_idx: bool,
    bos_token_id: Option<u32>,
    eos_token_id: Option<u32>,
}

fn default_eps() -> f32 {
    1e-5
}

impl Gpt2Config {
    pub fn from_json(text: &str) -> Result<Self, String> {
        let raw: RawConfig = serde_json::from_str(text).map_err(|e| format!("invalid GPT-2 config: {e}"))?;
        if let Some(t) = &raw.model_type
            && t != "gpt2"
        {
            return Err(format!("model_type {t:?} is not supported (expected \"gpt2\")"));
        }
        match raw.activation_function.as_deref() {
            None | Some("gelu_new") | Some("gelu_pytorch_tanh") => {}
            Some(other) => {
                return Err(format!("activation_function {other:?} is not supported (only tanh GELU, gelu_new)"));
            }
        }
        if raw.scale_attn_weights == Some(false) {
            return Err("scale_attn_weights=false is not supported".into());
        }
        let n_positions = raw.n_positions.or(raw.n_ctx).ok_or("config has neither n_positions nor n_ctx")?;
        let n_inner = match raw.n_inner {
            Some(f) => f,
            None => raw.n_embd.checked_mul(4).ok_or("n_embd is implausibly large")?,
        };
        let c = Gpt2Config {
            vocab_size: raw.vocab_size,
            n_positions,
            n_embd: raw.n_embd,
            n_layer: raw.n_layer,
            n_head: raw.n_head,
            n_inner,
            layer_norm_epsilon: raw.layer_norm_epsilon,
            scale_attn_by_inverse_layer_idx: raw.scale_attn_by_inverse_layer_idx,
            bos_token_id: raw.bos_token_id.unwrap_or(50256),
            eos_token_id: raw.eos_token_id.unwrap_or(50256),
        };
        c.validate()?;
        Ok(c)
    }

    /// A GGUF file of `general.architecture` `gpt2`, as llama.cpp's converter writes it.
    pub fn from_gguf(f: &super::gguf::GgufFile) -> Result<Self, String> {
        let num = |key: &str| -> Result<usize, String> {
            let full = format!("gpt2.{key}");
            let v = f.get(&full).ok_or_else(|| format!("metadata {full} is missing"))?;
            let n = v.as_u64().ok_or_else(|| format!("metadata {full} is a {}, not an integer", v.type_name()))?;
            usize::try_from(n).map_err(|_| format!("metadata {full} = {n} is too large"))
        };
        let token = |key: &str| -> Result<u32, String> {
            match f.get(&format!("tokenizer.ggml.{key}")) {
                None => Ok(50256),
                Some(v) => v
                    .as_u64()
                    .and_then(|n| u32::try_from(n).ok())
                    .ok_or_else(|| format!("metadata tokenizer.ggml.{key} is not a token id")),
            }
        };
        let vocab_size = match f.get("gpt2.vocab_size") {
            Some(_) => num("vocab_size")?,
            None => f.get("tokenizer.ggml.tokens").and_then(|v| v.as_array()).map_or(0, |a| a.len()),
        };
        let eps = f
            .get("gpt2.attention.layer_norm_epsilon")
            .map(|v| v.as_f64().ok_or("metadata gpt2.attention.layer_norm_epsilon is not a number"))
            .transpose()?
            .unwrap_or(1e-5) as f32;
        let c = Gpt2Config {
            vocab_size,
            n_positions: num("context_length")?,
            n_embd: num("embedding_length")?,
            n_layer: num("block_count")?,
            n_head: num("attention.head_count")?,
            n_inner: num("feed_forward_length")?,
            layer_norm_epsilon: eps,
            scale_attn_by_inverse_layer_idx: false,
            bos_token_id: token("bos_token_id")?,
            eos_token_id: token("eos_token_id")?,
        };
        c.validate()?;
        Ok(c)
    }

    /// Every rule a config must meet before a model is built from it; the loader and
    /// [`crate::model::Gpt2::load`] both call it, so a config assembled in code is held
    /// to the same rules as one read from a file.
    pub fn validate(&self) -> Result<(), String> {
        let dims = [self.vocab_size, self.n_positions, self.n_embd, self.n_layer, self.n_head, self.n_inner];
        if dims.contains(&0) {
            return Err("vocab_size, n_positions, n_embd, n_layer, n_head and n_inner must be positive".into());
        }
        if dims.iter().any(|&d| d > 1 << 24) {
            return Err("a dimension in config.json is implausibly large".into());
        }
        if !self.n_embd.is_multiple_of(self.n_head) {
            return Err(format!("n_embd {} is not divisible by n_head {}", self.n_embd, self.n_head));
        }
        if !(self.layer_norm_epsilon.is_finite() && self.layer_norm_epsilon > 0.0) {
            return Err("layer_norm_epsilon must be positive".into());
        }
        for (name, id) in [("bos_token_id", self.bos_token_id), ("eos_token_id", self.eos_token_id)] {
            if id as usize >= self.vocab_size {
                return Err(format!("{name} {id} is outside the vocabulary of {}", self.vocab_size));
            }
        }
        match self.checked_n_params() {
            Some(n) if n <= MAX_PARAMS => Ok(()),
            _ => Err(format!("the config describes more than {MAX_PARAMS} parameters")),
        }
    }

    pub fn head_dim(&self) -> usize {
        self.n_embd / self.n_head
    }

    /// Parameter count (tied head counted once); saturates for configs that
    /// [`validate`](Self::validate) refuses.
    pub fn n_params(&self) -> usize {
        self.checked_n_params().unwrap_or(usize::MAX)
    }

    /// Parameter count, or `None` when it overflows.
    pub fn checked_n_params(&self) -> Option<usize> {
        let (c, f) = (self.n_embd, self.n_inner);
        let mul = |a: usize, b: usize| a.checked_mul(b);
        let sum = |terms: &[Option<usize>]| terms.iter().try_fold(0usize, |acc, t| acc.checked_add((*t)?));
        let block = sum(&[
            mul(4, c),                                   // ln_1, ln_2
            mul(c, mul(3, c)?)?.checked_add(mul(3, c)?), // c_attn
            mul(c, c)?.checked_add(c),                   // attn c_proj
            mul(c, f)?.checked_add(f),                   // c_fc
            mul(f, c)?.checked_add(c),                   // mlp c_proj
        ])?;
        sum(&[mul(self.vocab_size, c), mul(self.n_positions, c), mul(self.n_layer, block), mul(2, c)])
    }

    /// The published GPT-2 family configs, for random-weight benchmarks.
    pub fn preset(name: &str) -> Option<Self> {
        let (n_layer, n_embd, n_head) = match name {
            "distilgpt2" => (6, 768, 12),
            "gpt2" => (12, 768, 12),
            "gpt2-medium" => (24, 1024, 16),
            "gpt2-large" => (36, 1280, 20),
            "gpt2-xl" => (48, 1600, 25),
            _ => return None,
        };
        Some(Gpt2Config {
            vocab_size: 50257,
            n_positions: 1024,
            n_embd,
            n_layer,
            n_head,
            n_inner: 4 * n_embd,
            layer_norm_epsilon: 1e-5,
            scale_attn_by_inverse_layer_idx: false,
            bos_token_id: 50256,
            eos_token_id: 50256,
        })
    }

    pub const PRESETS: [&'static str; 5] = ["distilgpt2", "gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl"];

    /// config.json in the Hub's modern layout.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(&serde_json::json!({
            "architectures": ["GPT2LMHeadModel"],
            "model_type": "gpt2",
            "activation_function": "gelu_new",
            "vocab_size": self.vocab_size,
            "n_positions": self.n_positions,
            "n_ctx": self.n_positions,
            "n_embd": self.n_embd,
            "n_layer": self.n_layer,
            "n_head": self.n_head,
            "n_inner": self.n_inner,
            "layer_norm_epsilon": self.layer_norm_epsilon,
            "scale_attn_by_inverse_layer_idx": self.scale_attn_by_inverse_layer_idx,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": true,
        }))
        .expect("serializable")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gpt2_124m_has_124m_params() {
        let c = Gpt2Config::preset("gpt2").unwrap();
        assert_eq!(c.n_params(), 124_439_808);
        let xl = Gpt2Config::preset("gpt2-xl").unwrap();
        assert_eq!(xl.n_params(), 1_557_611_200);
        assert_eq!(Gpt2Config::from_json(&c.to_json()).unwrap(), c);
    }

    #[test]
    fn rejects_bad_configs() {
        for (json, want) in [
            (r#"{"model_type":"llama","vocab_size":1,"n_positions":1,"n_embd":4,"n_layer":1,"n_head":1}"#, "llama"),
            (r#"{"vocab_size":1,"n_positions":1,"n_embd":5,"n_layer":1,"n_head":2}"#, "divisible"),
            (r#"{"vocab_size":1,"n_embd":4,"n_layer":1,"n_head":1}"#, "n_positions"),
            (r#"{"vocab_size":1,"n_positions":0,"n_embd":4,"n_layer":1,"n_head":1}"#, "positive"),
            (
                r#"{"vocab_size":1,"n_positions":1,"n_embd":4,"n_layer":1,"n_head":1,"activation_function":"relu"}"#,
                "relu",
            ),
            ("not json", "invalid"),
            // 4 * n_embd overflows before any other check could run.
            (r#"{"vocab_size":1,"n_positions":1,"n_embd":4611686018427387904,"n_layer":1,"n_head":1}"#, "large"),
            // Each dimension is plausible, the product is not.
            (
                r#"{"vocab_size":16777216,"n_positions":16777216,"n_embd":16777216,"n_inner":16777216,"n_layer":16777216,"n_head":1}"#,
                "parameters",
            ),
            (r#"{"vocab_size":10,"n_positions":1,"n_embd":4,"n_layer":1,"n_head":1}"#, "bos_token_id 50256"),
            (r#"{"vocab_size":1,"n_positions":1,"n_embd":4,"n_layer":0,"n_head":1}"#, "positive"),
            (r#"{"vocab_size":1,"n_positions":1,"n_embd":4,"n_layer":1,"n_head":0}"#, "positive"),
        ] {
            let e = Gpt2Config::from_json(json).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
    }
}

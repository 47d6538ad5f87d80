//! GPT-2 (Radford et al., 2019), written once over the [`Backend`] interface.
//!
//! ```text
//! x = wte[tokens] + wpe[positions]                      // (T, C)
//! for each block:
//!     x = x + c_proj(attention(c_attn(ln_1(x))))        // causal self-attention
//!     x = x + mlp_proj(gelu(c_fc(ln_2(x))))             // MLP, 4C wide
//! logits = ln_f(x) @ wte^T                              // (T, V), tied head
//! ```
//!
//! Weights come from HF's checkpoints. Their linear layers are `Conv1D`: stored
//! `[in, out]` and applied as `y = x @ W + b` (the transpose of `nn.Linear`), hence
//! [`MatrixLayout::InOut`]. There is no `lm_head` tensor: the output head is the token
//! embedding `wte` `[V, C]` read as `[out, in]`. The Hub's files name tensors `h.0...`,
//! `save_pretrained` writes `transformer.h.0...`; `h.N.attn.bias` is the causal-mask
//! buffer, not a parameter, and is ignored.

use crate::backend::{AttentionSpec, Backend, BackendError, BackendResult, MatrixLayout};
use crate::loaders::Gpt2Config;
use crate::loaders::checkpoint::{Tensor, TensorData, WeightError, Weights, load_matrix, load_vector};
use crate::model::{Batch, CausalLm, LogitRows, ModelInfo, Stage, check_batch, check_logit_rows, logit_rows};

struct Block<B: Backend> {
    ln_1: (B::Vector, B::Vector),
    c_attn: (B::Matrix, B::Vector),    // C → 3C
    attn_proj: (B::Matrix, B::Vector), // C → C
    ln_2: (B::Vector, B::Vector),
    c_fc: (B::Matrix, B::Vector),     // C → 4C
    mlp_proj: (B::Matrix, B::Vector), // 4C → C
}

pub struct Gpt2<B: Backend> {
    /// Validated at load; private so that the weights and the config cannot part.
    config: Gpt2Config,
    info: ModelInfo,
    wte: B::Matrix, // (V, C): token embedding and output head
    /// A GGUF's separate `output.weight` (V, C), when it has one.
    head: Option<B::Matrix>,
    wpe: B::Matrix, // (n_positions, C)
    blocks: Vec<Block<B>>,
    ln_f: (B::Vector, B::Vector),
}

/// Tensor lookup in HF's names (either prefix) or llama.cpp's GGUF names, with shapes
/// checked. HF's Conv1D matrices are `[in, out]`; llama.cpp's converter transposes them to
/// `[out, in]` rows, which is also what its quantized blocks need.
struct Names<'a> {
    weights: &'a Weights,
    prefix: &'static str,
    gguf: bool,
}

impl<'a> Names<'a> {
    /// The file's name for an HF-style name (`h.3.attn.c_attn.weight`).
    fn name(&self, hf: &str) -> String {
        if !self.gguf {
            // HF keeps the head at the top level whatever the body's prefix.
            return if hf.starts_with("lm_head") { hf.to_owned() } else { format!("{}{hf}", self.prefix) };
        }
        fn map(rest: &str) -> &str {
            match rest {
                "ln_1" => "attn_norm",
                "attn.c_attn" => "attn_qkv",
                "attn.c_proj" => "attn_output",
                "ln_2" => "ffn_norm",
                "mlp.c_fc" => "ffn_up",
                "mlp.c_proj" => "ffn_down",
                other => other,
            }
        }
        let (stem, kind) = hf.rsplit_once('.').unwrap_or((hf, ""));
        match stem {
            "wte" => "token_embd.weight".to_owned(),
            "wpe" => "position_embd.weight".to_owned(),
            "ln_f" => format!("output_norm.{kind}"),
            "lm_head" => "output.weight".to_owned(),
            _ => match stem.strip_prefix("h.").and_then(|r| r.split_once('.')) {
                Some((i, rest)) => format!("blk.{i}.{}.{kind}", map(rest)),
                None => hf.to_owned(),
            },
        }
    }

    fn get(&self, hf: &str, shape: &[usize]) -> Result<Tensor<'a>, WeightError> {
        self.weights.require(&self.name(hf), shape)
    }
}

impl<B: Backend> Gpt2<B> {
    /// From HF's safetensors (either naming scheme) or a GGUF written by llama.cpp's converter.
    pub fn load(backend: &B, config: Gpt2Config, weights: &Weights) -> Result<Self, WeightError> {
        config.validate().map_err(|message| WeightError::Config { architecture: "GPT-2", message })?;
        let gguf = matches!(weights, Weights::Gguf(_));
        let prefix = if !gguf && weights.get("transformer.wte.weight")?.is_some() { "transformer." } else { "" };
        let n = Names { weights, prefix, gguf };
        let (c, f, v) = (config.n_embd, config.n_inner, config.vocab_size);
        let vector =
            |name: &str, len: usize| -> Result<B::Vector, WeightError> { load_vector(backend, &n.get(name, &[len])?) };
        // A linear layer's weight: `[in, out]` Conv1D from HF, `[out, in]` rows from GGUF.
        let weight = |name: &str, n_in: usize, n_out: usize| -> Result<B::Matrix, WeightError> {
            if gguf {
                load_matrix(backend, &n.get(name, &[n_out, n_in])?)
            } else {
                Ok(backend.load_matrix(&n.get(name, &[n_in, n_out])?.view()?, MatrixLayout::InOut)?)
            }
        };
        let table = |name: &str, rows: usize| load_matrix(backend, &n.get(name, &[rows, c])?);
        let linear = |name: &str, n_in: usize, n_out: usize| -> Result<(B::Matrix, B::Vector), WeightError> {
            Ok((weight(&format!("{name}.weight"), n_in, n_out)?, vector(&format!("{name}.bias"), n_out)?))
        };
        let norm = |name: &str| -> Result<(B::Vector, B::Vector), WeightError> {
            Ok((vector(&format!("{name}.weight"), c)?, vector(&format!("{name}.bias"), c)?))
        };
        // GPT-2 ties the head to wte. HF files may repeat it as lm_head (it must be a
        // copy); a GGUF may carry it as `output.weight`, perhaps quantized to another type
        // than the embedding (older converters wrote it): used as the head, as llama.cpp does.
        let mut head = None;
        if let Some(t) = weights.get(&n.name("lm_head.weight"))? {
            if gguf {
                head = Some(table("lm_head.weight", v)?);
            } else {
                let wte = n.get("wte.weight", &[v, c])?;
                let same = match (&t.data, &wte.data) {
                    (TensorData::Float { bytes: a, .. }, TensorData::Float { bytes: b, .. }) => a == b,
                    _ => false,
                };
                if !same {
                    let message =
                        format!("{} differs from the token embedding: untied GPT-2 heads are not supported", t.name);
                    return Err(WeightError::Unsupported(message));
                }
            }
        }
        let blocks = (0..config.n_layer)
            .map(|i| {
                let p = format!("h.{i}");
                Ok(Block {
                    ln_1: norm(&format!("{p}.ln_1"))?,
                    c_attn: linear(&format!("{p}.attn.c_attn"), c, 3 * c)?,
                    attn_proj: linear(&format!("{p}.attn.c_proj"), c, c)?,
                    ln_2: norm(&format!("{p}.ln_2"))?,
                    c_fc: linear(&format!("{p}.mlp.c_fc"), c, f)?,
                    mlp_proj: linear(&format!("{p}.mlp.c_proj"), f, c)?,
                })
            })
            .collect::<Result<Vec<_>, WeightError>>()?;
        let info = ModelInfo {
            architecture: "gpt2",
            vocab_size: config.vocab_size,
            context_length: config.n_positions,
            n_layer: config.n_layer,
            n_params: config.n_params(),
            bos_token_id: Some(config.bos_token_id),
            eos_token_ids: vec![config.eos_token_id],
        };
        Ok(Gpt2 {
            info,
            wte: table("wte.weight", v)?,
            head,
            wpe: table("wpe.weight", config.n_positions)?,
            ln_f: norm("ln_f")?,
            blocks,
            config,
        })
    }

    pub fn config(&self) -> &Gpt2Config {
        &self.config
    }
}

impl<B: Backend> crate::model::Architecture<B> for Gpt2<B> {
    type Config = Gpt2Config;
    const GGUF_NAMES: &'static [&'static str] = &["gpt2"];
    const HF_MODEL_TYPES: &'static [&'static str] = &["gpt2"];

    fn config_from_hf(json: &str) -> Result<Gpt2Config, String> {
        Gpt2Config::from_json(json)
    }

    fn config_from_gguf(file: &crate::loaders::gguf::GgufFile) -> Result<Gpt2Config, String> {
        Gpt2Config::from_gguf(file)
    }

    fn load(backend: &B, config: Gpt2Config, weights: &Weights) -> Result<Self, WeightError> {
        Gpt2::load(backend, config, weights)
    }
}

impl<B: Backend> CausalLm<B> for Gpt2<B> {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn kv_width(&self) -> usize {
        self.config.n_embd
    }

    fn kv_head_dim(&self) -> usize {
        self.config.n_embd / self.config.n_head.max(1)
    }

    fn forward_traced(
        &self,
        backend: &B,
        batch: &Batch,
        caches: &mut [&mut B::KvCache],
        which: LogitRows<'_>,
        trace: &mut dyn FnMut(Stage, &B::Act) -> BackendResult<()>,
    ) -> BackendResult<B::Act> {
        let cfg = &self.config;
        let (tokens, seqs) = (batch.tokens, batch.seqs);
        check_batch(&self.info, self.kv_width(), batch, caches)?;
        check_logit_rows(&which, batch.tokens.len())?;
        // Positions of each row (on the stack for decode-sized batches: no allocation).
        let mut small = [0u32; 64];
        let mut large = Vec::new();
        let positions: &mut [u32] = if tokens.len() <= small.len() {
            &mut small[..tokens.len()]
        } else {
            large.resize(tokens.len(), 0);
            &mut large
        };
        for s in seqs {
            for (i, r) in s.rows.clone().enumerate() {
                positions[r] = (s.start_pos + i) as u32;
            }
        }

        let eps = cfg.layer_norm_epsilon;
        let scale = 1.0 / (cfg.head_dim() as f32).sqrt();
        let mut x = backend.embed(&self.wte, tokens); // (T, C)
        backend.add(&mut x, &backend.embed(&self.wpe, positions));
        trace(Stage::Embeddings, &x)?;
        let first_ln =
            &self.blocks.first().ok_or_else(|| BackendError::Invalid("the model has no blocks".into()))?.ln_1;
        let mut h = backend.layer_norm(&x, &first_ln.0, &first_ln.1, eps); // ln_1(x): (T, C)
        for (layer, b) in self.blocks.iter().enumerate() {
            // Attention: x = x + c_proj(attn(c_attn(ln_1(x)))).
            let qkv = backend.linear(&h, &b.c_attn.0, Some(&b.c_attn.1)); // (T, 3C)
            let layer_scale = if cfg.scale_attn_by_inverse_layer_idx { scale / (layer + 1) as f32 } else { scale };
            let spec = AttentionSpec::multi_head(cfg.n_embd, cfg.n_head, layer_scale);
            let attn = backend.attention(&qkv, seqs, caches, layer, &spec)?; // (T, C)
            let attn_out = backend.linear(&attn, &b.attn_proj.0, Some(&b.attn_proj.1)); // (T, C)
            h = backend.add_layer_norm(&mut x, &attn_out, &b.ln_2.0, &b.ln_2.1, eps); // x += attn; h = ln_2(x)
            // MLP: x = x + mlp_proj(gelu(c_fc(ln_2(x)))).
            let up = backend.linear_gelu(&h, &b.c_fc.0, Some(&b.c_fc.1)); // (T, 4C)
            let mlp_out = backend.linear(&up, &b.mlp_proj.0, Some(&b.mlp_proj.1)); // (T, C)
            match self.blocks.get(layer + 1) {
                // x += mlp; h = next block's ln_1(x)
                Some(next) => h = backend.add_layer_norm(&mut x, &mlp_out, &next.ln_1.0, &next.ln_1.1, eps),
                None => backend.add(&mut x, &mlp_out),
            }
            trace(Stage::Block(layer), &x)?;
        }
        // Only the rows whose next token is wanted go through ln_f and the (V × C) head.
        let x = logit_rows(backend, x, seqs, which);
        let x = backend.layer_norm(&x, &self.ln_f.0, &self.ln_f.1, eps); // (rows, C)
        trace(Stage::FinalNorm, &x)?;
        let logits = backend.linear(&x, self.head.as_ref().unwrap_or(&self.wte), None); // (rows, V)
        trace(Stage::Logits, &logits)?;
        Ok(logits)
    }
}

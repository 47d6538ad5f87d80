//! Llama (Touvron et al., 2023) and its family (SmolLM2, Qwen 2, Qwen 3, …), written once
//! over the [`Backend`] interface.
//!
//! ```text
//! x = embed_tokens[tokens]                                   // (T, C)
//! for each block:
//!     qkv = rms_norm(x) @ [Wq | Wk | Wv] (+ [bq | bk | bv])  // (T, (H + 2·Hkv)·D); biases: Qwen 2
//!     q, k = rms_norm(each q head), rms_norm(each k head)    // Qwen 3 only
//!     x = x + attention(rope(q), rope(k), v) @ Wo            // Hkv key/value heads, each shared by H/Hkv query heads
//!     x = x + (silu(rms_norm(x) @ Wgate) · (rms_norm(x) @ Wup)) @ Wdown   // SwiGLU MLP, F wide
//! logits = rms_norm(x) @ Whead                               // (T, V); Whead = embed_tokens when tied
//! ```
//!
//! Every projection is an `nn.Linear` without bias, stored `[out, in]`
//! ([`MatrixLayout::OutIn`]). q, k and v are loaded as one stacked matrix, as are gate and
//! up, so a block runs four matmuls. The same model reads HF folders (`model.layers.N.…`,
//! RoPE rotating halves of each head) and GGUF files (`blk.N.…`; llama.cpp's converter
//! permutes the q/k rows so RoPE rotates neighbouring pairs), see [`RopeStyle`]. Qwen's
//! GGUF files keep HF's row order: their RoPE rotates halves in both layouts.

use crate::backend::{AttentionSpec, Backend, BackendError, BackendResult, Rope, RopeStyle};
use crate::loaders::LlamaConfig;
use crate::loaders::checkpoint::{Tensor, WeightError, Weights, concat_rows, load_matrix, load_vector};
use crate::loaders::llama_config::LlamaVariant;
use crate::model::{Batch, CausalLm, LogitRows, ModelInfo, Stage, check_batch, check_logit_rows, logit_rows};
use crate::tensor::{Dtype, TensorView};

struct Block<B: Backend> {
    attn_norm: B::Vector,
    wqkv: B::Matrix,                         // C → (H + 2·Hkv)·D
    bqkv: Option<B::Vector>,                 // Qwen 2: (H + 2·Hkv)·D
    qk_norm: Option<(B::Vector, B::Vector)>, // Qwen 3: D each
    wo: B::Matrix,                           // H·D → C
    mlp_norm: B::Vector,
    w_gate_up: B::Matrix, // C → 2F
    w_down: B::Matrix,    // F → C
}

pub struct Llama<B: Backend> {
    config: LlamaConfig,
    info: ModelInfo,
    spec: AttentionSpec,
    embed: B::Matrix,        // (V, C)
    head: Option<B::Matrix>, // (V, C); None: tied to `embed`
    blocks: Vec<Block<B>>,
    norm: B::Vector,
}

/// Tensor names in the two layouts a Llama comes in.
struct Names {
    gguf: bool,
}

impl Names {
    fn embed(&self) -> &'static str {
        if self.gguf { "token_embd.weight" } else { "model.embed_tokens.weight" }
    }
    fn head(&self) -> &'static str {
        if self.gguf { "output.weight" } else { "lm_head.weight" }
    }
    fn norm(&self) -> &'static str {
        if self.gguf { "output_norm.weight" } else { "model.norm.weight" }
    }
    /// `part` is the HF name; the GGUF name follows llama.cpp's tensor map.
    fn block(&self, i: usize, part: &str) -> String {
        self.block_tensor(i, part, "weight")
    }
    /// A block's `weight` or `bias`.
    fn block_tensor(&self, i: usize, part: &str, kind: &str) -> String {
        if !self.gguf {
            return format!("model.layers.{i}.{part}.{kind}");
        }
        let g = match part {
            "input_layernorm" => "attn_norm",
            "self_attn.q_proj" => "attn_q",
            "self_attn.k_proj" => "attn_k",
            "self_attn.v_proj" => "attn_v",
            "self_attn.o_proj" => "attn_output",
            "post_attention_layernorm" => "ffn_norm",
            "mlp.gate_proj" => "ffn_gate",
            "mlp.up_proj" => "ffn_up",
            "mlp.down_proj" => "ffn_down",
            "self_attn.q_norm" => "attn_q_norm",
            "self_attn.k_norm" => "attn_k_norm",
            other => other,
        };
        format!("blk.{i}.{g}.{kind}")
    }
}

impl<B: Backend> Llama<B> {
    pub fn load(backend: &B, config: LlamaConfig, weights: &Weights) -> Result<Self, WeightError> {
        config.validate().map_err(|message| WeightError::Config { architecture: "Llama", message })?;
        let gguf = matches!(weights, Weights::Gguf(_));
        let names = Names { gguf };
        let rope_scaling = config.rope_scaling.freq_factors(config.rope_theta, config.head_dim);
        // llama.cpp's converter stores Llama 3's scaling as per-pair factors; linear scaling
        // from the metadata multiplies them, as llama.cpp applies both.
        let freq_factors = match weights.get("rope_freqs.weight")? {
            Some(t) => {
                let half = config.head_dim / 2;
                let stored = t.to_f32()?;
                if stored.len() != half {
                    let expected = format!("[{half}], one value per rotated pair");
                    return Err(WeightError::Shape { name: t.name, got: t.shape, expected });
                }
                Some(match &rope_scaling {
                    Some(linear) => stored.iter().zip(linear).map(|(a, b)| a * b).collect(),
                    None => stored,
                })
            }
            None => rope_scaling,
        };
        let spec = AttentionSpec {
            n_head: config.n_head,
            n_kv_head: config.n_kv_head,
            head_dim: config.head_dim,
            scale: 1.0 / (config.head_dim as f32).sqrt(),
            rope: Some(Rope {
                theta: config.rope_theta,
                // llama.cpp's converter permutes Llama's q/k rows only.
                style: if gguf && config.variant == LlamaVariant::Llama {
                    RopeStyle::Adjacent
                } else {
                    RopeStyle::Halves
                },
                freq_factors: freq_factors.map(Into::into),
            }),
            window: None,
        };
        backend.supports(&spec)?;
        let (c, f, v) = (config.hidden_size, config.intermediate_size, config.vocab_size);
        let (qw, kw) = (spec.q_width(), spec.kv_width());
        let get = |name: &str, shape: &[usize]| weights.require(name, shape);
        let vector = |name: &str| -> Result<B::Vector, WeightError> { load_vector(backend, &get(name, &[c])?) };
        let matrix = |t: Tensor| load_matrix(backend, &t);
        let blocks = (0..config.n_layer)
            .map(|i| {
                let n = |part: &str| names.block(i, part);
                let qkv = concat_rows(
                    &format!("layer {i} q|k|v"),
                    &[
                        get(&n("self_attn.q_proj"), &[qw, c])?,
                        get(&n("self_attn.k_proj"), &[kw, c])?,
                        get(&n("self_attn.v_proj"), &[kw, c])?,
                    ],
                )?;
                let gate_up = concat_rows(
                    &format!("layer {i} gate|up"),
                    &[get(&n("mlp.gate_proj"), &[f, c])?, get(&n("mlp.up_proj"), &[f, c])?],
                )?;
                let bqkv = match config.variant {
                    LlamaVariant::Qwen2 => {
                        let bias = |part: &str, len: usize| -> Result<Vec<f32>, WeightError> {
                            get(&names.block_tensor(i, part, "bias"), &[len])?.to_f32()
                        };
                        let mut b = bias("self_attn.q_proj", qw)?;
                        b.extend(bias("self_attn.k_proj", kw)?);
                        b.extend(bias("self_attn.v_proj", kw)?);
                        let bytes: Vec<u8> = b.iter().flat_map(|x| x.to_le_bytes()).collect();
                        let name = format!("layer {i} q|k|v bias");
                        let view = TensorView { name: &name, dtype: Dtype::F32, shape: &[b.len()], bytes: &bytes };
                        Some(backend.load_vector(&view)?)
                    }
                    _ => None,
                };
                let qk_norm = match config.variant {
                    LlamaVariant::Qwen3 => {
                        let norm = |part: &str| -> Result<B::Vector, WeightError> {
                            load_vector(backend, &get(&n(part), &[spec.head_dim])?)
                        };
                        Some((norm("self_attn.q_norm")?, norm("self_attn.k_norm")?))
                    }
                    _ => None,
                };
                Ok(Block {
                    attn_norm: vector(&n("input_layernorm"))?,
                    wqkv: matrix(qkv)?,
                    bqkv,
                    qk_norm,
                    wo: matrix(get(&n("self_attn.o_proj"), &[c, qw])?)?,
                    mlp_norm: vector(&n("post_attention_layernorm"))?,
                    w_gate_up: matrix(gate_up)?,
                    w_down: matrix(get(&n("mlp.down_proj"), &[c, f])?)?,
                })
            })
            .collect::<Result<Vec<_>, WeightError>>()?;
        let tied = config.tie_word_embeddings;
        if !tied && weights.get(names.head())?.is_none() {
            let message = "missing, and the model's head is not tied to its embedding: there is no output head";
            return Err(WeightError::Tensor { name: names.head().to_owned(), message: message.into() });
        }
        let head = if tied { None } else { Some(matrix(get(names.head(), &[v, c])?)?) };
        let info = ModelInfo {
            architecture: config.variant.name(),
            vocab_size: v,
            context_length: config.context_length,
            n_layer: config.n_layer,
            n_params: config.checked_n_params().unwrap_or(usize::MAX),
            bos_token_id: config.bos_token_id,
            eos_token_ids: config.eos_token_ids.clone(),
        };
        Ok(Llama {
            embed: matrix(get(names.embed(), &[v, c])?)?,
            head,
            norm: vector(names.norm())?,
            blocks,
            spec,
            info,
            config,
        })
    }

    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }
}

impl<B: Backend> crate::model::Architecture<B> for Llama<B> {
    type Config = LlamaConfig;
    const GGUF_NAMES: &'static [&'static str] = &["llama", "qwen2", "qwen3"];
    const HF_MODEL_TYPES: &'static [&'static str] = &["llama", "qwen2", "qwen3"];

    fn config_from_hf(json: &str) -> Result<LlamaConfig, String> {
        LlamaConfig::from_hf_json(json)
    }

    fn config_from_gguf(file: &crate::loaders::gguf::GgufFile) -> Result<LlamaConfig, String> {
        LlamaConfig::from_gguf(file)
    }

    fn load(backend: &B, config: LlamaConfig, weights: &Weights) -> Result<Self, WeightError> {
        Llama::load(backend, config, weights)
    }
}

impl<B: Backend> CausalLm<B> for Llama<B> {
    fn info(&self) -> &ModelInfo {
        &self.info
    }

    fn kv_width(&self) -> usize {
        self.spec.kv_width()
    }

    fn kv_head_dim(&self) -> usize {
        self.spec.head_dim
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
        trace(Stage::Embeddings, &x)?;
        let first = self.blocks.first().ok_or_else(|| BackendError::Invalid("the model has no blocks".into()))?;
        let mut h = backend.rms_norm(&x, &first.attn_norm, eps); // (T, C)
        for (layer, b) in self.blocks.iter().enumerate() {
            // Attention: x = x + Wo · attention(rope(q), rope(k), v).
            let mut qkv = backend.linear(&h, &b.wqkv, b.bqkv.as_ref()); // (T, (H + 2·Hkv)·D)
            if let Some((q_norm, k_norm)) = &b.qk_norm {
                backend.qk_norm(&mut qkv, &self.spec, q_norm, k_norm, eps)?;
            }
            let attn = backend.attention(&qkv, seqs, caches, layer, &self.spec)?; // (T, H·D)
            let attn_out = backend.linear(&attn, &b.wo, None); // (T, C)
            h = backend.add_rms_norm(&mut x, &attn_out, &b.mlp_norm, eps); // x += attn; h = rms_norm(x)
            // MLP: x = x + Wdown · (silu(Wgate · h) ⊙ Wup · h).
            let gate_up = backend.linear(&h, &b.w_gate_up, None); // (T, 2F)
            let act = backend.swiglu(&gate_up); // (T, F)
            let mlp_out = backend.linear(&act, &b.w_down, None); // (T, C)
            match self.blocks.get(layer + 1) {
                Some(next) => h = backend.add_rms_norm(&mut x, &mlp_out, &next.attn_norm, eps),
                None => backend.add(&mut x, &mlp_out),
            }
            trace(Stage::Block(layer), &x)?;
        }
        let x = logit_rows(backend, x, seqs, which);
        let x = backend.rms_norm(&x, &self.norm, eps); // (rows, C)
        trace(Stage::FinalNorm, &x)?;
        let logits = backend.linear(&x, self.head.as_ref().unwrap_or(&self.embed), None); // (rows, V)
        trace(Stage::Logits, &logits)?;
        Ok(logits)
    }
}

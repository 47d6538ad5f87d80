//! An HF model folder (config.json, safetensors, tokenizer.json) as GGUF contents, the way
//! llama.cpp's `convert_hf_to_gguf.py` lays them out, for `forge quantize DIR OUT.gguf`.
//!
//! - **Names:** HF tensor names become llama.cpp's (`model.layers.3.self_attn.q_proj.weight`
//!   → `blk.3.attn_q.weight`, GPT-2's `h.3.attn.c_attn.weight` → `blk.3.attn_qkv.weight`).
//! - **Architectures:** `llama`, `qwen2` (q/k/v biases), `qwen3` (q/k head norms), `gpt2`,
//!   `gemma3_text` (norm weights stored as `1 + w` in f32, as llama.cpp's converter
//!   does; the embedding cut to the tokenizer's ids).
//! - **Llama q/k rows** are permuted per head from HF's rotate-halves order to the
//!   neighbour pairs llama.cpp's RoPE rotates (row `i·hd/2 + j` of a head moves to `2j + i`);
//!   Qwen's keep HF's order (llama.cpp rotates their halves).
//! - **GPT-2's Conv1D** weights are stored `[in, out]`: transposed to `[out, in]`.
//! - **Types:** 1-D tensors (norms, biases) become F32, as llama.cpp needs; the rest keep
//!   the folder's F32/F16/BF16 until the quantizer converts them.
//! - **Metadata:** the architecture's hyper-parameters, and the tokenizer as
//!   `tokenizer.ggml.*`: a SentencePiece `tokenizer.model` where the converter takes one
//!   (pieces, scores, types; [`super::spm_model`]), else byte-level BPE (tokens, types,
//!   merges, the pre-tokenizer's llama.cpp name); special ids, BOS/EOS flags and the chat
//!   template as gguf-py's `SpecialVocab` finds them.
//!
//! Tensors the converter would not know are refused by name rather than dropped.

use std::borrow::Cow;
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::ConvertError;
use super::quantize::{Source, SourceTensor};
use super::spm_model::{PieceType, parse_pieces};
use crate::backend::RopeScaling;
use crate::loaders::WeightStore;
use crate::loaders::config::Gpt2Config;
use crate::loaders::gguf::{GgmlType, MetaValue};
use crate::loaders::llama_config::{LlamaConfig, LlamaVariant};
use crate::model::gemma3::{Gemma3Config, PARTS as GEMMA3_PARTS, swa_pattern};
use crate::tensor::Dtype;

enum Arch {
    Llama(LlamaConfig),
    Gpt2(Gpt2Config),
    Gemma3(Gemma3Config),
}

/// An opened HF folder.
pub struct HfModel {
    dir: PathBuf,
    arch: Arch,
    /// `config.json` names `head_dim` (convert_hf_to_gguf.py then writes the key and
    /// value lengths for any architecture).
    has_head_dim: bool,
    store: WeightStore,
}

fn read_text(path: &Path) -> Result<String, ConvertError> {
    std::fs::read_to_string(path).map_err(|e| ConvertError::file(path, format!("cannot read: {e}")))
}

fn read_json(path: &Path) -> Result<Value, ConvertError> {
    serde_json::from_str(&read_text(path)?).map_err(|e| ConvertError::file(path, format!("invalid JSON: {e}")))
}

fn u32v(v: usize) -> MetaValue {
    MetaValue::U32(u32::try_from(v).unwrap_or(u32::MAX))
}

impl HfModel {
    pub fn open(dir: &Path) -> Result<Self, ConvertError> {
        let config_path = dir.join("config.json");
        let text = read_text(&config_path)?;
        let config: Value =
            serde_json::from_str(&text).map_err(|e| ConvertError::file(&config_path, format!("invalid JSON: {e}")))?;
        let model_type = config["model_type"].as_str().map(str::to_owned);
        let bad = |e: String| ConvertError::file(&config_path, e);
        let arch = match model_type.as_deref() {
            Some("llama" | "qwen2" | "qwen3") => Arch::Llama(LlamaConfig::from_hf_json(&text).map_err(bad)?),
            Some("gpt2") | None => Arch::Gpt2(Gpt2Config::from_json(&text).map_err(bad)?),
            Some("gemma3_text") => {
                let c = Gemma3Config::from_hf_json(&text).map_err(bad)?;
                gemma3_fits_gguf(&c).map_err(bad)?;
                Arch::Gemma3(c)
            }
            Some(other) => {
                let message =
                    format!("model_type {other:?} cannot be converted (llama, qwen2, qwen3, gpt2, gemma3_text)");
                return Err(bad(message));
            }
        };
        if let Arch::Llama(c) = &arch
            && c.variant != LlamaVariant::Llama
            && c.rope_scaling != RopeScaling::None
            && !matches!(c.rope_scaling, RopeScaling::Linear { .. })
        {
            return Err(bad(format!(
                "{} with {:?} RoPE scaling cannot be converted",
                c.variant.name(),
                c.rope_scaling
            )));
        }
        let store = WeightStore::open_dir(dir)?;
        Ok(HfModel { dir: dir.to_owned(), arch, has_head_dim: !config["head_dim"].is_null(), store })
    }

    /// The GGUF contents: metadata and tensors (loaded, permuted or transposed on demand).
    pub fn source(&self) -> Result<Source<'_>, ConvertError> {
        let mut metadata = Vec::new();
        let mut set = |k: &str, v: MetaValue| metadata.push((k.to_owned(), v));
        let name = self.dir.canonicalize().ok().and_then(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()));
        let (arch, vocab_size) = match &self.arch {
            Arch::Llama(c) => (c.variant.name(), c.vocab_size),
            Arch::Gpt2(c) => ("gpt2", c.vocab_size),
            Arch::Gemma3(c) => ("gemma3", c.vocab_size),
        };
        set("general.architecture", MetaValue::String(arch.into()));
        set("general.type", MetaValue::String("model".into()));
        set("general.name", MetaValue::String(name.unwrap_or_else(|| "model".into())));
        match &self.arch {
            // As convert_hf_to_gguf.py's TextModel: Qwen's keys carry no vocabulary size
            // or RoPE dimensions, and key/value lengths only where the config names head_dim.
            Arch::Llama(c) if c.variant != LlamaVariant::Llama => {
                let key = |k: &str| format!("{arch}.{k}");
                set(&key("block_count"), u32v(c.n_layer));
                set(&key("context_length"), u32v(c.context_length));
                set(&key("embedding_length"), u32v(c.hidden_size));
                set(&key("feed_forward_length"), u32v(c.intermediate_size));
                set(&key("attention.head_count"), u32v(c.n_head));
                set(&key("attention.head_count_kv"), u32v(c.n_kv_head));
                if let RopeScaling::Linear { factor } = c.rope_scaling {
                    set(&key("rope.scaling.type"), MetaValue::String("linear".into()));
                    set(&key("rope.scaling.factor"), MetaValue::F32(factor));
                }
                set(&key("rope.freq_base"), MetaValue::F32(c.rope_theta));
                set(&key("attention.layer_norm_rms_epsilon"), MetaValue::F32(c.rms_norm_eps));
                if self.has_head_dim {
                    set(&key("attention.key_length"), u32v(c.head_dim));
                    set(&key("attention.value_length"), u32v(c.head_dim));
                }
            }
            Arch::Llama(c) => {
                set("llama.block_count", u32v(c.n_layer));
                set("llama.context_length", u32v(c.context_length));
                set("llama.embedding_length", u32v(c.hidden_size));
                set("llama.feed_forward_length", u32v(c.intermediate_size));
                set("llama.attention.head_count", u32v(c.n_head));
                set("llama.attention.head_count_kv", u32v(c.n_kv_head));
                set("llama.rope.freq_base", MetaValue::F32(c.rope_theta));
                set("llama.attention.layer_norm_rms_epsilon", MetaValue::F32(c.rms_norm_eps));
                set("llama.attention.key_length", u32v(c.head_dim));
                set("llama.attention.value_length", u32v(c.head_dim));
                set("llama.vocab_size", u32v(c.vocab_size));
                set("llama.rope.dimension_count", u32v(c.head_dim));
                // As convert_hf_to_gguf.py: linear scaling in the metadata, Llama 3's as
                // the `rope_freqs.weight` tensor (see `llama_tensors`).
                if let RopeScaling::Linear { factor } = c.rope_scaling {
                    set("llama.rope.scaling.type", MetaValue::String("linear".into()));
                    set("llama.rope.scaling.factor", MetaValue::F32(factor));
                }
            }
            // As convert_hf_to_gguf.py's Gemma3Model: the global blocks' RoPE base and
            // scaling, the local blocks' base, and the window.
            Arch::Gemma3(c) => {
                set("gemma3.block_count", u32v(c.n_layer));
                set("gemma3.context_length", u32v(c.context_length));
                set("gemma3.embedding_length", u32v(c.hidden_size));
                set("gemma3.feed_forward_length", u32v(c.intermediate_size));
                set("gemma3.attention.head_count", u32v(c.n_head));
                set("gemma3.attention.head_count_kv", u32v(c.n_kv_head));
                if let RopeScaling::Linear { factor } = c.rope_scaling {
                    set("gemma3.rope.scaling.type", MetaValue::String("linear".into()));
                    set("gemma3.rope.scaling.factor", MetaValue::F32(factor));
                }
                set("gemma3.rope.freq_base", MetaValue::F32(c.rope_theta));
                set("gemma3.rope.freq_base_swa", MetaValue::F32(c.rope_local_theta));
                set("gemma3.attention.layer_norm_rms_epsilon", MetaValue::F32(c.rms_norm_eps));
                set("gemma3.attention.key_length", u32v(c.head_dim));
                set("gemma3.attention.value_length", u32v(c.head_dim));
                set("gemma3.attention.sliding_window", u32v(c.sliding_window));
            }
            Arch::Gpt2(c) => {
                set("gpt2.block_count", u32v(c.n_layer));
                set("gpt2.context_length", u32v(c.n_positions));
                set("gpt2.embedding_length", u32v(c.n_embd));
                set("gpt2.feed_forward_length", u32v(c.n_inner));
                set("gpt2.attention.head_count", u32v(c.n_head));
                set("gpt2.attention.layer_norm_epsilon", MetaValue::F32(c.layer_norm_epsilon));
            }
        }
        metadata.extend(self.tokenizer_metadata(vocab_size)?);
        let tensors = match &self.arch {
            Arch::Llama(c) => self.llama_tensors(c)?,
            Arch::Gpt2(c) => self.gpt2_tensors(c)?,
            Arch::Gemma3(c) => self.gemma3_tensors(c)?,
        };
        Ok(Source { metadata, tensors })
    }

    /// `tokenizer.ggml.*` as convert_hf_to_gguf.py's `set_vocab` writes it: the
    /// vocabulary of a SentencePiece `tokenizer.model` where the architecture's converter
    /// prefers one (every one here but GPT-2), else byte-level BPE from tokenizer.json (or
    /// vocab.json + merges.txt); then gguf-py's `SpecialVocab` (special ids, BOS/EOS flags,
    /// the chat template) and each architecture's own keys.
    fn tokenizer_metadata(&self, vocab_size: usize) -> Result<Vec<(String, MetaValue)>, ConvertError> {
        let tc_path = self.dir.join("tokenizer_config.json");
        let tc = if tc_path.is_file() { Some(read_json(&tc_path)?) } else { None };
        let mut meta = Vec::new();
        let llama = matches!(&self.arch, Arch::Llama(c) if c.variant == LlamaVariant::Llama);
        if llama && let Some(b) = tc.as_ref().and_then(|tc| tc["add_prefix_space"].as_bool()) {
            meta.push(("tokenizer.ggml.add_space_prefix".to_owned(), MetaValue::Bool(b)));
        }
        let spm = self.dir.join("tokenizer.model");
        let sentencepiece = !matches!(self.arch, Arch::Gpt2(_)) && spm.is_file();
        let n_vocab = if sentencepiece {
            let (vocab, n) = self.spm_vocab(&spm, vocab_size, tc.as_ref())?;
            meta.extend(vocab);
            Some(n)
        } else {
            meta.extend(self.bpe_vocab(vocab_size)?);
            None
        };
        self.special_vocab(tc, n_vocab, &mut meta)?;
        let mut set = |k: &str, v: MetaValue| match meta.iter_mut().find(|(key, _)| key == k) {
            Some(slot) => slot.1 = v,
            None => meta.push((k.to_owned(), v)),
        };
        if sentencepiece && matches!(self.arch, Arch::Gemma3(_)) {
            set("tokenizer.ggml.add_space_prefix", MetaValue::Bool(false));
        }
        if llama && vocab_size == 32016 {
            // CodeLlama's infill tokens: only EOT has a GGUF key in the converter.
            set("tokenizer.ggml.eot_token_id", MetaValue::U32(32010));
        }
        if llama && vocab_size == 49152 {
            // The converter's rule for Granite's small models (SmolLM's size too).
            set("tokenizer.ggml.add_bos_token", MetaValue::Bool(false));
        }
        Ok(meta)
    }

    /// As the converter's `_create_vocab_sentencepiece`: every piece of the model with its
    /// score and type (user-defined pieces count as normal), then added_tokens.json and
    /// tokenizer_config.json's `added_tokens_decoder` over them; ids no one names are
    /// `[PAD{i}]`, unused. Returns the keys and the vocabulary's size.
    fn spm_vocab(
        &self,
        path: &Path,
        vocab_size: usize,
        tc: Option<&Value>,
    ) -> Result<(Vec<(String, MetaValue)>, usize), ConvertError> {
        let bytes = std::fs::read(path).map_err(|e| ConvertError::file(path, format!("cannot read: {e}")))?;
        let pieces = parse_pieces(&bytes).map_err(|e| ConvertError::file(path, e.to_string()))?;
        let mut tokens: Vec<(String, f32, i32)> = (0..vocab_size).map(|i| (format!("[PAD{i}]"), -10000.0, 5)).collect();
        // Pieces past the config's vocab_size are dropped, as the converter drops them.
        for (slot, p) in tokens.iter_mut().zip(&pieces) {
            let ty = match p.kind {
                PieceType::Unknown => 2,
                PieceType::Control => 3,
                PieceType::Unused => 5,
                PieceType::Byte => 6,
                PieceType::Normal | PieceType::UserDefined => 1,
            };
            *slot = (p.text.clone(), p.score, ty);
        }
        let added_path = self.dir.join("added_tokens.json");
        if added_path.is_file() {
            let added = read_json(&added_path)?;
            let added = added.as_object().ok_or_else(|| ConvertError::file(&added_path, "not an object"))?;
            for (text, id) in added {
                let id =
                    id.as_u64().ok_or_else(|| ConvertError::file(&added_path, format!("id of {text:?} is {id}")))?;
                if let Some(slot) = usize::try_from(id).ok().and_then(|i| tokens.get_mut(i)) {
                    *slot = (text.clone(), -1000.0, 4);
                }
            }
        }
        if let Some(decoder) = tc.and_then(|tc| tc["added_tokens_decoder"].as_object()) {
            for (id, t) in decoder {
                let bad = || {
                    ConvertError::file(
                        &self.dir.join("tokenizer_config.json"),
                        format!("added_tokens_decoder entry {id:?}"),
                    )
                };
                let id: usize = id.parse().map_err(|_| bad())?;
                let text = t["content"].as_str().ok_or_else(bad)?;
                let Some(slot) = tokens.get_mut(id) else { continue };
                *slot = if t["special"].as_bool() == Some(true) || looks_special(text) {
                    (text.to_owned(), -1000.0, 3)
                } else {
                    // User-defined tokens are stored pre-normalized: SentencePiece's space
                    // as a space.
                    (text.replace('\u{2581}', " "), -1000.0, 4)
                };
            }
        }
        let n = tokens.len();
        let mut texts = Vec::with_capacity(n);
        let mut scores = Vec::with_capacity(n);
        let mut types = Vec::with_capacity(n);
        for (text, score, ty) in tokens {
            texts.push(MetaValue::String(text));
            scores.push(MetaValue::F32(score));
            types.push(MetaValue::I32(ty));
        }
        let meta = vec![
            ("tokenizer.ggml.model".to_owned(), MetaValue::String("llama".into())),
            ("tokenizer.ggml.pre".to_owned(), MetaValue::String("default".into())),
            ("tokenizer.ggml.tokens".to_owned(), MetaValue::Array(8, texts)),
            ("tokenizer.ggml.scores".to_owned(), MetaValue::Array(6, scores)),
            ("tokenizer.ggml.token_type".to_owned(), MetaValue::Array(5, types)),
        ];
        Ok((meta, n))
    }

    /// Byte-level BPE, as the converter's `_set_vocab_gpt2`: tokens, types, merges and the
    /// pre-tokenizer's llama.cpp name, from tokenizer.json or vocab.json + merges.txt.
    fn bpe_vocab(&self, vocab_size: usize) -> Result<Vec<(String, MetaValue)>, ConvertError> {
        let tj = self.dir.join("tokenizer.json");
        let mut pre = "gpt-2";
        type Parts = (Vec<(String, u64)>, Vec<String>, Vec<(String, u64, bool)>);
        let (vocab, merges, added): Parts = if tj.is_file() {
            let root = read_json(&tj)?;
            let model = &root["model"];
            let bad = |message: String| ConvertError::file(&tj, message);
            if model["type"] != "BPE" {
                return Err(bad(format!("only BPE tokenizers convert (model.type {})", model["type"])));
            }
            if model["byte_fallback"].as_bool() == Some(true) || root["decoder"]["type"] != "ByteLevel" {
                return Err(bad("only byte-level BPE converts from tokenizer.json (this is a SentencePiece-style BPE: \
                     byte_fallback or a non-ByteLevel decoder; the folder's SentencePiece tokenizer.model would convert)"
                    .into()));
            }
            pre = pre_tokenizer_name(&root["pre_tokenizer"])
                .ok_or_else(|| bad(format!("pre_tokenizer {}: {UNKNOWN_PRE_TOKENIZER}", root["pre_tokenizer"])))?;
            let vocab = model["vocab"].as_object().ok_or_else(|| bad("no model.vocab".into()))?;
            let vocab = vocab.iter().map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(u64::MAX))).collect();
            let merges = model["merges"].as_array().ok_or_else(|| bad("no model.merges".into()))?;
            let merges = merges
                .iter()
                .map(|m| match m {
                    Value::String(s) => Ok(s.clone()),
                    Value::Array(p) if p.len() == 2 && p.iter().all(Value::is_string) => {
                        Ok(format!("{} {}", p[0].as_str().unwrap_or(""), p[1].as_str().unwrap_or("")))
                    }
                    _ => Err(bad(format!("malformed merge {m}"))),
                })
                .collect::<Result<_, _>>()?;
            let added = root["added_tokens"]
                .as_array()
                .into_iter()
                .flatten()
                .filter_map(|t| {
                    Some((
                        t["content"].as_str()?.to_owned(),
                        t["id"].as_u64()?,
                        t["special"].as_bool().unwrap_or(false),
                    ))
                })
                .collect();
            (vocab, merges, added)
        } else {
            let vj = self.dir.join("vocab.json");
            let vocab = read_json(&vj)?;
            let vocab = vocab.as_object().ok_or_else(|| ConvertError::file(&vj, "not an object"))?;
            let vocab: Vec<(String, u64)> =
                vocab.iter().map(|(k, v)| (k.clone(), v.as_u64().unwrap_or(u64::MAX))).collect();
            let mp = self.dir.join("merges.txt");
            let text = read_text(&mp)?;
            let merges =
                text.lines().filter(|l| !l.is_empty() && !l.starts_with("#version")).map(str::to_owned).collect();
            let eot = vocab.iter().find(|(k, _)| k == "<|endoftext|>").map(|(k, id)| (k.clone(), *id, true));
            (vocab, merges, eot.into_iter().collect())
        };
        // One text per id up to the model's vocabulary; ids no token uses are padding.
        let vocab_file = if tj.is_file() { tj.clone() } else { self.dir.join("vocab.json") };
        let mut tokens: Vec<Option<(String, i32)>> = vec![None; vocab_size];
        let mut place = |text: &str, id: u64, ty: i32| -> Result<(), ConvertError> {
            let slot = usize::try_from(id).ok().and_then(|i| tokens.get_mut(i));
            let slot = slot.ok_or_else(|| {
                let message = format!("token {text:?} has id {id}, outside the vocabulary of {vocab_size}");
                ConvertError::file(&vocab_file, message)
            })?;
            *slot = Some((text.to_owned(), ty));
            Ok(())
        };
        for (text, id) in &vocab {
            place(text, *id, 1)?;
        }
        for (text, id, special) in &added {
            place(text, *id, if *special || looks_special(text) { 3 } else { 4 })?;
        }
        let (texts, types): (Vec<MetaValue>, Vec<MetaValue>) = tokens
            .into_iter()
            .enumerate()
            .map(|(i, t)| {
                let (text, ty) = t.unwrap_or_else(|| (format!("[PAD{i}]"), 5));
                (MetaValue::String(text), MetaValue::I32(ty))
            })
            .unzip();
        Ok(vec![
            ("tokenizer.ggml.model".to_owned(), MetaValue::String("gpt2".into())),
            ("tokenizer.ggml.pre".to_owned(), MetaValue::String(pre.into())),
            ("tokenizer.ggml.tokens".to_owned(), MetaValue::Array(8, texts)),
            ("tokenizer.ggml.token_type".to_owned(), MetaValue::Array(5, types)),
            (
                "tokenizer.ggml.merges".to_owned(),
                MetaValue::Array(8, merges.into_iter().map(MetaValue::String).collect()),
            ),
        ])
    }

    /// gguf-py's `SpecialVocab`: special ids named by tokenizer_config.json and found among
    /// tokenizer.json's added tokens, else config.json's `*_token_id` (ids of `n_vocab` or
    /// more skipped); BOS/EOS/SEP flags from tokenizer.json's post-processor, else
    /// tokenizer_config.json; the chat template; the normalizer's lowercasing.
    fn special_vocab(
        &self,
        tc: Option<Value>,
        n_vocab: Option<usize>,
        meta: &mut Vec<(String, MetaValue)>,
    ) -> Result<(), ConvertError> {
        let mut types = vec!["bos", "eos", "unk", "sep", "pad", "cls", "mask"];
        // gguf-py's dict: a flag set again keeps its place.
        fn put(add: &mut Vec<(&'static str, bool)>, typ: &'static str, b: bool) {
            match add.iter_mut().find(|(t, _)| *t == typ) {
                Some(slot) => slot.1 = b,
                None => add.push((typ, b)),
            }
        }
        let tj_path = self.dir.join("tokenizer.json");
        let tj = if tj_path.is_file() { Some(read_json(&tj_path)?) } else { None };
        let mut tc = tc;
        let mut ids: Vec<(&str, u32)> = Vec::new();
        let mut add: Vec<(&'static str, bool)> = Vec::new();
        let mut flags: Vec<(&'static str, bool)> = Vec::new();
        let content = |tc: &Option<Value>, key: &str| -> Option<String> {
            let v = &tc.as_ref()?[key];
            v.as_str().or_else(|| v["content"].as_str()).map(str::to_owned)
        };
        if let Some(tj) = &tj {
            // gguf-py's _parse_normalizer, Sequences nested to any depth.
            let mut stack = vec![tj["normalizer"].clone()];
            while let Some(n) = stack.pop() {
                match n["type"].as_str() {
                    Some("Sequence") => {
                        stack.extend(n["normalizers"].as_array().into_iter().flatten().rev().cloned());
                    }
                    Some("Lowercase") => put(&mut flags, "lowercase", true),
                    Some("StripAccents") => put(&mut flags, "strip_accents", true),
                    Some("BertNormalizer") => {
                        for key in ["lowercase", "strip_accents"] {
                            if let Some(b) = n[key].as_bool() {
                                put(&mut flags, key, b);
                            }
                        }
                    }
                    _ => {}
                }
            }
            // gguf-py compares tokenizer_config's raw entries (a string, or an AddedToken
            // dict that equals no string) and treats empty ones and an empty config as unset.
            let raw = |tc: &Option<Value>, k: &str| tc.as_ref().map_or(Value::Null, |t| t[k].clone());
            let truthy = |v: &Value| match v {
                Value::Null | Value::Bool(false) => false,
                Value::String(s) => !s.is_empty(),
                Value::Object(o) => !o.is_empty(),
                Value::Array(a) => !a.is_empty(),
                Value::Number(_) | Value::Bool(true) => true,
            };
            let tc_set = tc.as_ref().is_some_and(&truthy);
            let is = |v: &Value, text: &str| v.as_str() == Some(text);
            let mut bos = raw(&tc, "bos_token");
            let mut cls = raw(&tc, "cls_token");
            let mut eos = raw(&tc, "eos_token");
            let sep = raw(&tc, "sep_token");
            if tc_set && let Some(t) = tc.as_mut() {
                if !truthy(&bos) && truthy(&cls) {
                    t["bos_token"] = cls.clone();
                    bos = cls.clone();
                }
                if !truthy(&eos) && truthy(&sep) {
                    t["eos_token"] = sep.clone();
                    eos = sep.clone();
                }
            }
            let pp = &tj["post_processor"];
            let processors = match pp["processors"].as_array() {
                Some(list) => list.clone(),
                None if pp.is_null() => vec![],
                None => vec![pp.clone()],
            };
            for p in &processors {
                match p["type"].as_str() {
                    Some("ByteLevel") => {
                        for typ in ["bos", "eos"] {
                            if !add.iter().any(|(t, _)| *t == typ) {
                                add.push((typ, false));
                            }
                        }
                    }
                    Some("TemplateProcessing") => {
                        let single = p["single"].as_array().cloned().unwrap_or_default();
                        let special =
                            |v: Option<&Value>| v.and_then(|v| v["SpecialToken"]["id"].as_str()).map(str::to_owned);
                        if single.len() > 1 {
                            if let Some(first) = special(single.first()) {
                                // As the converter: an unnamed leading token becomes BOS (or CLS).
                                if !tc_set {
                                    bos = Value::from(first.clone());
                                } else if !is(&bos, &first) && !is(&cls, &first) {
                                    if !truthy(&bos) {
                                        bos = Value::from(first.clone());
                                        if let Some(t) = tc.as_mut() {
                                            t["bos_token"] = bos.clone();
                                        }
                                    }
                                    if !truthy(&cls) {
                                        cls = Value::from(first.clone());
                                        if let Some(t) = tc.as_mut() {
                                            t["cls_token"] = cls.clone();
                                        }
                                    }
                                }
                                put(&mut add, "bos", is(&bos, &first) || is(&cls, &first));
                            }
                            if let Some(last) = special(single.last()) {
                                if !tc_set {
                                    eos = Value::from(last.clone());
                                } else if !is(&eos, &last) {
                                    // As the converter: the configured EOS (if any) becomes
                                    // EOT (or EOM), and the trailing token EOS.
                                    let moved = if !types.contains(&"eot") {
                                        Some("eot")
                                    } else if !types.contains(&"eom") {
                                        Some("eom")
                                    } else {
                                        None
                                    };
                                    if let (Some(kind), Some(t)) = (moved, tc.as_mut()) {
                                        types.push(kind);
                                        t[format!("{kind}_token")] = eos.clone();
                                    }
                                    eos = Value::from(last.clone());
                                    if let Some(t) = tc.as_mut() {
                                        t["eos_token"] = eos.clone();
                                    }
                                }
                                put(&mut add, "eos", is(&eos, &last));
                            }
                        }
                        let pair = p["pair"].as_array().cloned().unwrap_or_default();
                        let (first, last) = (special(single.first()), special(single.last()));
                        let (first, last) = if single.len() > 1 { (first, last) } else { (None, None) };
                        let start = usize::from(first.is_some() && special(pair.first()) == first);
                        let stop =
                            pair.len().saturating_sub(usize::from(last.is_some() && special(pair.last()) == last));
                        let pair = pair.get(start..stop.max(start)).unwrap_or_default();
                        let seq = |v: Option<&Value>| v.and_then(|v| v["Sequence"]["id"].as_str()).map(str::to_owned);
                        if pair.len() > 2
                            && seq(pair.first()).as_deref() == Some("A")
                            && seq(pair.last()).as_deref() == Some("B")
                        {
                            let middle = &pair[1..pair.len() - 1];
                            let is_sep = |v: Option<&Value>| special(v).is_some_and(|s| is(&sep, &s) || is(&eos, &s));
                            let mut add_sep = is_sep(middle.first()) && last.is_none();
                            if middle.len() == 2 && is_sep(middle.get(1)) {
                                add_sep = true;
                            }
                            put(&mut add, "sep", add_sep);
                            if add_sep
                                && !truthy(&sep)
                                && tc_set
                                && let Some(t) = tc.as_mut()
                            {
                                t["sep_token"] = eos.clone();
                            }
                        }
                    }
                    Some(other) => {
                        let message =
                            format!("post_processor {other} cannot be converted (ByteLevel, TemplateProcessing)");
                        return Err(ConvertError::file(&tj_path, message));
                    }
                    None => {}
                }
            }
        }
        let added_tokens = tj.as_ref().and_then(|tj| tj["added_tokens"].as_array()).cloned().unwrap_or_default();
        let mut set_id = |typ: &'static str, id: Option<u64>| {
            if let Some(id) = id.and_then(|id| u32::try_from(id).ok())
                && n_vocab.is_none_or(|n| (id as usize) < n)
                && !ids.iter().any(|(t, _)| *t == typ)
            {
                ids.push((typ, id));
            }
        };
        let tc_set = tc.as_ref().is_some_and(|t| t.as_object().is_some_and(|o| !o.is_empty()));
        if let Some(t) = tc.as_ref().filter(|_| tc_set) {
            for &typ in &types {
                if let Some(b) = t[format!("add_{typ}_token")].as_bool()
                    && !add.iter().any(|(a, _)| *a == typ)
                {
                    add.push((typ, b));
                }
                if let Some(c) = content(&tc, &format!("{typ}_token")) {
                    set_id(
                        typ,
                        added_tokens.iter().find(|a| a["content"] == c.as_str()).and_then(|a| a["id"].as_u64()),
                    );
                }
            }
        }
        let config = read_json(&self.dir.join("config.json"))?;
        for &typ in &types {
            let key = format!("{typ}_token_id");
            let v = if config[&key].is_null() { &config["text_config"][&key] } else { &config[&key] };
            let id = v.as_u64();
            set_id(typ, id);
        }
        for (typ, id) in ids {
            let key = match typ {
                "bos" => "bos_token_id",
                "eos" => "eos_token_id",
                "unk" => "unknown_token_id",
                "sep" => "seperator_token_id",
                "pad" => "padding_token_id",
                "mask" => "mask_token_id",
                "eot" => "eot_token_id",
                "eom" => "eom_token_id",
                _ => continue, // cls: the converter has no key for it
            };
            meta.push((format!("tokenizer.ggml.{key}"), MetaValue::U32(id)));
        }
        for (typ, b) in add {
            if matches!(typ, "bos" | "eos" | "sep") {
                meta.push((format!("tokenizer.ggml.add_{typ}_token"), MetaValue::Bool(b)));
            }
        }
        if let Some(t) = tc.as_ref().filter(|_| tc_set) {
            let jinja = self.dir.join("chat_template.jinja");
            let json = self.dir.join("chat_template.json");
            let alt = if jinja.is_file() {
                let default = read_text(&jinja)?;
                // With additional_chat_templates/*.jinja: a named list, as gguf-py reads it.
                let mut extra = Vec::new();
                if let Ok(dir) = std::fs::read_dir(self.dir.join("additional_chat_templates")) {
                    for entry in dir.flatten() {
                        let path = entry.path();
                        if path.extension().is_some_and(|e| e == "jinja") && path.is_file() {
                            let name = path.file_stem().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
                            extra.push(serde_json::json!({"name": name, "template": read_text(&path)?}));
                        }
                    }
                }
                if extra.is_empty() {
                    Some(Value::String(default))
                } else {
                    let mut list = vec![serde_json::json!({"name": "default", "template": default})];
                    list.extend(extra);
                    Some(Value::Array(list))
                }
            } else if json.is_file() {
                Some(read_json(&json)?["chat_template"].clone())
            } else {
                None
            };
            match t.get("chat_template").cloned().or(alt) {
                // gguf-py's add_string writes no empty string.
                Some(Value::String(s)) if !s.is_empty() => {
                    meta.push(("tokenizer.chat_template".to_owned(), MetaValue::String(s)))
                }
                Some(Value::Array(named)) => {
                    // gguf-py's add_chat_template: each named one under its (sanitized)
                    // name, their names listed (here sorted), the default as the template.
                    let mut names = Vec::new();
                    let mut default = None;
                    for choice in &named {
                        let name: String = choice["name"]
                            .as_str()
                            .unwrap_or("")
                            .chars()
                            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
                            .collect();
                        let Some(template) = choice["template"].as_str().filter(|t| !t.is_empty()) else { continue };
                        if name == "default" {
                            default = Some(template.to_owned());
                        } else if !name.is_empty() {
                            let key = format!("tokenizer.chat_template.{name}");
                            meta.retain(|(k, _)| *k != key);
                            meta.push((key, MetaValue::String(template.to_owned())));
                            names.push(name);
                        }
                    }
                    names.sort();
                    names.dedup();
                    if !names.is_empty() {
                        let names = names.into_iter().map(MetaValue::String).collect();
                        meta.push(("tokenizer.chat_templates".to_owned(), MetaValue::Array(8, names)));
                    }
                    if let Some(d) = default {
                        meta.push(("tokenizer.chat_template".to_owned(), MetaValue::String(d)));
                    }
                }
                _ => {}
            }
        }
        for (name, b) in flags {
            meta.push((format!("tokenizer.ggml.normalizer.{name}"), MetaValue::Bool(b)));
        }
        Ok(())
    }

    /// One HF tensor as a GGUF tensor; `reorder` rearranges its bytes (rows of
    /// `[rows, cols]` elements of `elem` bytes).
    fn tensor<'a>(
        &'a self,
        hf: &str,
        gguf: &str,
        reorder: Reorder,
        want: &[usize],
    ) -> Result<SourceTensor<'a>, ConvertError> {
        let view = self.store.get(hf).ok_or_else(|| ConvertError::tensor(hf, "missing"))?;
        if view.shape != want {
            return Err(ConvertError::tensor(hf, format!("shape {:?}; the config implies {want:?}", view.shape)));
        }
        let ty = match view.dtype {
            Dtype::F32 => GgmlType::F32,
            Dtype::F16 => GgmlType::F16,
            Dtype::BF16 => GgmlType::BF16,
            other => return Err(ConvertError::tensor(hf, format!("type {other:?}: only F32, F16 and BF16 convert"))),
        };
        let shape = view.shape.to_vec();
        if !(shape.len() == 2 || (shape.len() == 1 && matches!(reorder, Reorder::None | Reorder::PlusOne))) {
            return Err(ConvertError::tensor(hf, format!("shape {shape:?} (a matrix expected)")));
        }
        let one_d = shape.len() == 1;
        // ggml dims: innermost first.
        let mut dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        if let Reorder::Transpose = reorder {
            dims.reverse();
        }
        let bytes = view.bytes;
        let name = hf.to_owned();
        let load = move || -> Result<Cow<'a, [u8]>, ConvertError> {
            if one_d && (ty != GgmlType::F32 || matches!(reorder, Reorder::PlusOne)) {
                let mut values = crate::quant::dequantize(ty, bytes).map_err(|e| ConvertError::tensor(&name, e))?;
                if let Reorder::PlusOne = reorder {
                    // As the converter, which widens every tensor but an f16 one to f32
                    // before it adds 1: an f16 `1 + w` is rounded to f16.
                    for v in &mut values {
                        *v = if ty == GgmlType::F16 { half::f16::from_f32(*v + 1.0).to_f32() } else { *v + 1.0 };
                    }
                }
                return Ok(Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect()));
            }
            let elem = if ty == GgmlType::F32 { 4 } else { 2 };
            Ok(match reorder {
                Reorder::None | Reorder::PlusOne => Cow::Borrowed(bytes),
                Reorder::RopePairs(n_head) => Cow::Owned(
                    rope_pairs(bytes, shape[0], shape[1] * elem, n_head).map_err(|e| ConvertError::tensor(&name, e))?,
                ),
                Reorder::Transpose => Cow::Owned(transpose(bytes, shape[0], shape[1], elem)),
            })
        };
        Ok(SourceTensor {
            name: gguf.to_owned(),
            dims,
            ty: if one_d { GgmlType::F32 } else { ty },
            load: Box::new(load),
        })
    }

    /// Every tensor of the folder is mapped (`map`'s HF names) or `ignorable`.
    fn check_all_used(&self, map: &[TensorMap], ignorable: impl Fn(&str) -> bool) -> Result<(), ConvertError> {
        let used: std::collections::HashSet<&str> = map.iter().map(|m| m.0.as_str()).collect();
        for t in self.store.tensors() {
            if !used.contains(t.name) && !ignorable(t.name) {
                return Err(ConvertError::tensor(t.name, "has no GGUF name (not a tensor of this architecture)"));
            }
        }
        Ok(())
    }

    fn llama_tensors(&self, c: &LlamaConfig) -> Result<Vec<SourceTensor<'_>>, ConvertError> {
        let (v, d, f, hd) = (c.vocab_size, c.hidden_size, c.intermediate_size, c.head_dim);
        let (q, kv) = (c.n_head * hd, c.n_kv_head * hd);
        let mut map: Vec<TensorMap> = vec![
            ("model.embed_tokens.weight".into(), "token_embd.weight".into(), Reorder::None, vec![v, d]),
            ("model.norm.weight".into(), "output_norm.weight".into(), Reorder::None, vec![d]),
        ];
        if !c.tie_word_embeddings || self.store.get("lm_head.weight").is_some() {
            map.push(("lm_head.weight".into(), "output.weight".into(), Reorder::None, vec![v, d]));
        }
        // Llama's q and k rows are permuted to llama.cpp's interleaved RoPE pairs; Qwen's
        // rotate the two halves (NEOX) and keep HF's order.
        let (rq, rk) = match c.variant {
            LlamaVariant::Llama => (Reorder::RopePairs(c.n_head), Reorder::RopePairs(c.n_kv_head)),
            LlamaVariant::Qwen2 | LlamaVariant::Qwen3 => (Reorder::None, Reorder::None),
        };
        for i in 0..c.n_layer {
            let (hf, g) = (format!("model.layers.{i}."), format!("blk.{i}."));
            match c.variant {
                LlamaVariant::Llama => {}
                LlamaVariant::Qwen2 => {
                    for (h, n, len) in [("q_proj", "attn_q", q), ("k_proj", "attn_k", kv), ("v_proj", "attn_v", kv)] {
                        map.push((format!("{hf}self_attn.{h}.bias"), format!("{g}{n}.bias"), Reorder::None, vec![len]));
                    }
                }
                LlamaVariant::Qwen3 => {
                    for (h, n) in [("q_norm", "attn_q_norm"), ("k_norm", "attn_k_norm")] {
                        map.push((
                            format!("{hf}self_attn.{h}.weight"),
                            format!("{g}{n}.weight"),
                            Reorder::None,
                            vec![hd],
                        ));
                    }
                }
            }
            for (h, n, r, shape) in [
                ("input_layernorm.weight", "attn_norm.weight", Reorder::None, vec![d]),
                ("self_attn.q_proj.weight", "attn_q.weight", rq, vec![q, d]),
                ("self_attn.k_proj.weight", "attn_k.weight", rk, vec![kv, d]),
                ("self_attn.v_proj.weight", "attn_v.weight", Reorder::None, vec![kv, d]),
                ("self_attn.o_proj.weight", "attn_output.weight", Reorder::None, vec![d, q]),
                ("post_attention_layernorm.weight", "ffn_norm.weight", Reorder::None, vec![d]),
                ("mlp.gate_proj.weight", "ffn_gate.weight", Reorder::None, vec![f, d]),
                ("mlp.up_proj.weight", "ffn_up.weight", Reorder::None, vec![f, d]),
                ("mlp.down_proj.weight", "ffn_down.weight", Reorder::None, vec![d, f]),
            ] {
                map.push((hf.clone() + h, g.clone() + n, r, shape));
            }
        }
        self.check_all_used(&map, |n| n.ends_with("rotary_emb.inv_freq"))?;
        let mut tensors = Vec::with_capacity(map.len() + 1);
        if let RopeScaling::Llama3 { .. } = c.rope_scaling
            && let Some(factors) = c.rope_scaling.freq_factors(c.rope_theta, hd)
        {
            let bytes: Vec<u8> = factors.iter().flat_map(|x| x.to_le_bytes()).collect();
            tensors.push(SourceTensor {
                name: "rope_freqs.weight".into(),
                dims: vec![factors.len() as u64],
                ty: GgmlType::F32,
                load: Box::new(move || Ok(Cow::Owned(bytes.clone()))),
            });
        }
        for (h, g, r, shape) in map {
            tensors.push(self.tensor(&h, &g, r, &shape)?);
        }
        Ok(tensors)
    }

    fn gemma3_tensors(&self, c: &Gemma3Config) -> Result<Vec<SourceTensor<'_>>, ConvertError> {
        let (v, d, f, hd) = (c.vocab_size, c.hidden_size, c.intermediate_size, c.head_dim);
        let (q, kv) = (c.n_head * hd, c.n_kv_head * hd);
        // convert_hf_to_gguf.py cuts the embedding to the tokenizer's ids but writes a token
        // list of vocab_size: a file with fewer rows than tokens, which neither llama.cpp nor
        // forge loads. Such a folder is refused rather than written so.
        // (With a tokenizer.model the converter counts its padded vocabulary: no cut.)
        let tj = self.dir.join("tokenizer.json");
        if tj.is_file() && !self.dir.join("tokenizer.model").is_file() {
            let root = read_json(&tj)?;
            let n = |v: &Value| v.as_object().map(|o| o.len()).or(v.as_array().map(|a| a.len())).unwrap_or(0);
            let n_real = n(&root["model"]["vocab"]) + n(&root["added_tokens"]);
            if n_real < v {
                return Err(ConvertError::file(
                    &tj,
                    format!(
                        "{n_real} token ids for a vocab_size of {v}: llama.cpp's converter would cut the embedding to \
                         {n_real} rows and list {v} tokens, a file that does not load"
                    ),
                ));
            }
        }
        let mut map: Vec<TensorMap> = vec![
            ("model.embed_tokens.weight".into(), "token_embd.weight".into(), Reorder::None, vec![v, d]),
            ("model.norm.weight".into(), "output_norm.weight".into(), Reorder::PlusOne, vec![d]),
        ];
        for i in 0..c.n_layer {
            for (g, h) in GEMMA3_PARTS {
                let shape = match g {
                    "attn_q" => vec![q, d],
                    "attn_k" | "attn_v" => vec![kv, d],
                    "attn_q_norm" | "attn_k_norm" => vec![hd],
                    "attn_output" => vec![d, q],
                    "ffn_gate" | "ffn_up" => vec![f, d],
                    "ffn_down" => vec![d, f],
                    _ => vec![d], // the block's four norms
                };
                let r = if g.ends_with("norm") { Reorder::PlusOne } else { Reorder::None };
                map.push((format!("model.layers.{i}.{h}.weight"), format!("blk.{i}.{g}.weight"), r, shape));
            }
        }
        // The head is the embedding (Gemma 3 ties them; an untied config is refused). A saved
        // lm_head.weight equal to it is dropped, where llama.cpp's converter would write it
        // again as output.weight (Google's checkpoints and save_pretrained have none).
        if let (Some(head), Some(embed)) =
            (self.store.get("lm_head.weight"), self.store.get("model.embed_tokens.weight"))
            && (head.shape != embed.shape || head.bytes != embed.bytes)
        {
            return Err(ConvertError::Unsupported(
                "lm_head.weight differs from model.embed_tokens.weight: an untied Gemma 3 head cannot be converted"
                    .into(),
            ));
        }
        self.check_all_used(&map, |n| n == "lm_head.weight" || n.ends_with("rotary_emb.inv_freq"))?;
        map.into_iter().map(|(h, g, r, shape)| self.tensor(&h, &g, r, &shape)).collect()
    }

    fn gpt2_tensors(&self, c: &Gpt2Config) -> Result<Vec<SourceTensor<'_>>, ConvertError> {
        let prefix = if self.store.get("transformer.wte.weight").is_some() { "transformer." } else { "" };
        let (v, d, f, p) = (c.vocab_size, c.n_embd, c.n_inner, c.n_positions);
        let mut map: Vec<TensorMap> = vec![
            ("wte.weight".into(), "token_embd.weight".into(), Reorder::None, vec![v, d]),
            ("wpe.weight".into(), "position_embd.weight".into(), Reorder::None, vec![p, d]),
            ("ln_f.weight".into(), "output_norm.weight".into(), Reorder::None, vec![d]),
            ("ln_f.bias".into(), "output_norm.bias".into(), Reorder::None, vec![d]),
        ];
        for i in 0..c.n_layer {
            // Conv1D weights are [in, out]; norms are [C].
            for (h, n, conv1d, (n_in, n_out)) in [
                ("ln_1", "attn_norm", false, (d, d)),
                ("attn.c_attn", "attn_qkv", true, (d, 3 * d)),
                ("attn.c_proj", "attn_output", true, (d, d)),
                ("ln_2", "ffn_norm", false, (d, d)),
                ("mlp.c_fc", "ffn_up", true, (d, f)),
                ("mlp.c_proj", "ffn_down", true, (f, d)),
            ] {
                let (w, shape) =
                    if conv1d { (Reorder::Transpose, vec![n_in, n_out]) } else { (Reorder::None, vec![d]) };
                map.push((format!("h.{i}.{h}.weight"), format!("blk.{i}.{n}.weight"), w, shape));
                map.push((format!("h.{i}.{h}.bias"), format!("blk.{i}.{n}.bias"), Reorder::None, vec![n_out]));
            }
        }
        for m in &mut map {
            m.0 = format!("{prefix}{}", m.0);
        }
        // GPT-2's head is the token embedding (llama.cpp's gpt2 layout has no other): a
        // checkpoint whose lm_head differs is another model.
        let wte = self.store.get(&format!("{prefix}wte.weight"));
        if let (Some(head), Some(wte)) = (self.store.get("lm_head.weight"), wte)
            && (head.shape != wte.shape || head.dtype != wte.dtype || head.bytes != wte.bytes)
        {
            return Err(ConvertError::Unsupported(
                "lm_head.weight differs from wte.weight: an untied GPT-2 head cannot be converted".into(),
            ));
        }
        // The tied head and attention-mask buffers carry no weights of their own.
        let ignorable =
            |n: &str| n == "lm_head.weight" || n.ends_with(".attn.bias") || n.ends_with(".attn.masked_bias");
        self.check_all_used(&map, ignorable)?;
        map.into_iter().map(|(h, g, r, shape)| self.tensor(&h, &g, r, &shape)).collect()
    }
}

/// What a GGUF file cannot say about a Gemma 3 config, refused: llama.cpp's loader takes
/// five local blocks of six (the converter writes no layer types) and a query scale of
/// `1/√head_dim` (`1/√(width/heads)` for the 62-block 27B model).
fn gemma3_fits_gguf(c: &Gemma3Config) -> Result<(), String> {
    if c.local != swa_pattern(c.n_layer, 6) {
        return Err("layer_types other than Gemma 3's five sliding-window blocks then one global block cannot be \
                    converted: llama.cpp's converter writes no pattern, so its files imply that one"
            .into());
    }
    if !matches!(c.rope_scaling, RopeScaling::None | RopeScaling::Linear { .. }) {
        return Err(format!("{:?} RoPE scaling cannot be converted (none or linear)", c.rope_scaling));
    }
    let scalar = if c.n_layer == 62 { c.hidden_size / c.n_head.max(1) } else { c.head_dim };
    if c.query_pre_attn_scalar != scalar as f32 {
        return Err(format!(
            "query_pre_attn_scalar {} cannot be converted: a GGUF file implies {scalar}",
            c.query_pre_attn_scalar
        ));
    }
    Ok(())
}

/// llama.cpp's name (`tokenizer.ggml.pre`) for an HF byte-level pre-tokenizer: the
/// pipelines [`crate::tokenizer::pre_tokenizer_of_json`] recognizes (GPT-2's `ByteLevel`:
/// `gpt-2`; SmolLM's digits-split-then-`ByteLevel`: `smollm`; Llama 3's, Qwen 2's, Qwen 3.5's,
/// GPT-4o's and Tekken's `Split`: `llama-bpe`, `qwen2`, `qwen35`, `gpt-4o`, `tekken`; DeepSeek LLM's,
/// Coder's and V3's chains of `Split`s: `deepseek-llm`, `deepseek-coder`, `deepseek-v3`;
/// MiniCPM 5's: `minicpm5`).
/// Others have no name this project can vouch for, and are refused rather than mislabelled.
fn pre_tokenizer_name(pre: &Value) -> Option<&'static str> {
    crate::tokenizer::pre_tokenizer_of_json(pre).map(|p| p.gguf_name())
}

/// What is said of a pre-tokenizer [`pre_tokenizer_name`] does not know.
const UNKNOWN_PRE_TOKENIZER: &str = "not one whose llama.cpp name is known here (GPT-2's ByteLevel: gpt-2; \
    Digits + ByteLevel: smollm; Llama 3's, Qwen 2's, Qwen 3.5's, GPT-4o's and Tekken's Split + ByteLevel: \
    llama-bpe, qwen2, qwen35, gpt-4o, tekken; DeepSeek LLM's, Coder's and V3's chains of Splits + ByteLevel: \
    deepseek-llm, deepseek-coder, deepseek-v3; MiniCPM 5's: minicpm5)";

/// The converter's `does_token_look_special`: added tokens some models mark as not special
/// that it writes as control tokens.
fn looks_special(t: &str) -> bool {
    matches!(t, "<pad>" | "<mask>" | "<2mass>" | "[@BOS@]")
        || (t.starts_with("<|") && t.ends_with("|>"))
        || (t.starts_with("<\u{ff5c}") && t.ends_with("\u{ff5c}>"))
        || (t.starts_with("<unused") && t.ends_with('>'))
}

/// (HF name, GGUF name, byte reordering, HF shape the config implies).
type TensorMap = (String, String, Reorder, Vec<usize>);

#[derive(Clone, Copy)]
enum Reorder {
    None,
    /// Gemma's norm weights: `1 + w` (rounded to f16 for an f16 tensor).
    PlusOne,
    /// Llama q/k rows, per head of `n` heads, from halves to neighbour pairs.
    RopePairs(usize),
    /// `[rows, cols]` → `[cols, rows]`.
    Transpose,
}

/// Within each of `n_head` heads of `hd` rows, row `i·hd/2 + j` moves to `2j + i`.
fn rope_pairs(bytes: &[u8], rows: usize, row_bytes: usize, n_head: usize) -> Result<Vec<u8>, String> {
    if n_head == 0 || !rows.is_multiple_of(2 * n_head) {
        return Err(format!("{rows} rows do not split into {n_head} heads of pairs"));
    }
    let hd = rows / n_head;
    let mut out = vec![0u8; bytes.len()];
    for h in 0..n_head {
        for i in 0..2 {
            for j in 0..hd / 2 {
                let (src, dst) = (h * hd + i * hd / 2 + j, h * hd + 2 * j + i);
                out[dst * row_bytes..(dst + 1) * row_bytes]
                    .copy_from_slice(&bytes[src * row_bytes..(src + 1) * row_bytes]);
            }
        }
    }
    Ok(out)
}

fn transpose(bytes: &[u8], rows: usize, cols: usize, elem: usize) -> Vec<u8> {
    let mut out = vec![0u8; bytes.len()];
    for r in 0..rows {
        for c in 0..cols {
            let (src, dst) = ((r * cols + c) * elem, (c * rows + r) * elem);
            out[dst..dst + elem].copy_from_slice(&bytes[src..src + elem]);
        }
    }
    out
}

//! Tokenizers: byte-level BPE (GPT-2, SmolLM2, …) and SentencePiece BPE (Gemma,
//! Llama 2, …): loading, encoding, decoding, streaming decode.
//!
//! Loads HF `tokenizer.json`, the original `vocab.json` + `merges.txt`, or the
//! `tokenizer.ggml.*` metadata of a GGUF file (model `gpt2` or `llama`). Byte-level
//! encoding is pre-tokenize ([`pretokenize`]: GPT-2's, Llama 3's, Qwen 2's and 3.5's,
//! GPT-4o's and Tekken's patterns, llama.cpp's `smollm`; [`split_chain`]: DeepSeek's and
//! MiniCPM 5's chains of splits) → bytes → BPE merges by rank, with a per-word cache. SentencePiece
//! encoding is [`spm`]: `▁` for spaces, merges by score, byte fallback.
//! Special tokens (`<|endoftext|>`) are matched in the text only when asked
//! ([`Tokenizer::encode`] vs [`Tokenizer::encode_ordinary`]), as tiktoken does; tokens
//! a vocabulary marks user-defined and not special (Gemma's `\n\n`, `<h1>`) are matched always,
//! as HF and llama.cpp do.

mod byte_level;
mod hf_json;
mod pretokenize;
mod split_chain;
mod spm;
mod stream;

pub use pretokenize::{
    GPT4O_PATTERN, LLAMA3_PATTERN, QWEN2_PATTERN, QWEN35_PATTERN, TEKKEN_PATTERN, gpt4o_pieces, llama3_pieces,
    pre_tokenize, qwen35_pieces,
};
pub use split_chain::{
    DEEPSEEK_CODER_SPLITS, DEEPSEEK_LLM_SPLITS, DEEPSEEK_V3_SPLITS, MINICPM5_SPLITS, split_chain_pieces,
};
pub use stream::StreamDecoder;

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use serde_json::Value;

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("cannot read {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    #[error("{path}: {msg}")]
    Format { path: PathBuf, msg: String },
    #[error("token id {id} is out of range (vocabulary size {vocab_size})")]
    BadId { id: u32, vocab_size: usize },
}

type Result<T> = std::result::Result<T, TokenizerError>;

/// Words longer than this are not cached (they are rare and would bloat the cache).
const CACHE_MAX_WORD: usize = 64;
const CACHE_MAX_ENTRIES: usize = 1 << 16;

/// How text is split into words before BPE, named as llama.cpp's `tokenizer.ggml.pre`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreTokenizer {
    /// GPT-2's regex (`gpt-2`).
    Gpt2,
    /// llama.cpp's `smollm`: each `\p{N}` character is a word of its own, then GPT-2's
    /// regex on the rest (HF: `Digits(individual_digits)` before `ByteLevel`).
    SmolLm,
    /// Llama 3's pattern ([`LLAMA3_PATTERN`]: letters with one leading non-letter, numbers
    /// in threes, newlines kept with what precedes them); llama.cpp's `llama-bpe`, `llama3`.
    Llama3,
    /// Qwen 2's: Llama 3's with every digit alone ([`QWEN2_PATTERN`]); llama.cpp's `qwen2`.
    Qwen2,
    /// Qwen 3.5's: Qwen 2's with marks in words, not in punctuation runs
    /// ([`QWEN35_PATTERN`]); llama.cpp's `qwen35`.
    Qwen35,
    /// GPT-4o's ([`GPT4O_PATTERN`]: words split where lower case turns to upper, with
    /// their contractions; numbers in threes); llama.cpp's `gpt-4o`, `llama4`.
    Gpt4o,
    /// Mistral's Tekken ([`TEKKEN_PATTERN`]: GPT-4o's without contractions, every digit
    /// alone); llama.cpp's `tekken`.
    Tekken,
    /// DeepSeek LLM's chain of splits ([`DEEPSEEK_LLM_SPLITS`]: newlines, listed letters
    /// and punctuation with one leading space, trailing space, CJK runs, number runs);
    /// llama.cpp's `deepseek-llm`.
    DeepSeekLlm,
    /// DeepSeek LLM's own `tokenizer.json`: the same chain with every digit alone (its
    /// last step is HF's `Digits(individual_digits)`, where llama.cpp's has number runs;
    /// the two give the same ids on a vocabulary with no token of two digits).
    /// `forge quantize` names it `deepseek-llm`, as `convert_hf_to_gguf.py` does.
    DeepSeekLlmDigits,
    /// DeepSeek Coder's ([`DEEPSEEK_CODER_SPLITS`]: newlines, letters and punctuation with
    /// one leading space, CJK runs, every digit alone); llama.cpp's `deepseek-coder`.
    DeepSeekCoder,
    /// DeepSeek V3's and R1's ([`DEEPSEEK_V3_SPLITS`]: numbers in threes, CJK and kana
    /// runs, then letters with marks, punctuation with symbols); llama.cpp's `deepseek-v3`.
    DeepSeekV3,
    /// MiniCPM 5's ([`MINICPM5_SPLITS`]: numbers in threes, then Llama 3's pattern on
    /// each piece); llama.cpp's `minicpm5`.
    MiniCpm5,
}

impl PreTokenizer {
    /// llama.cpp's `tokenizer.ggml.pre` names this tokenizer runs: every name llama.cpp
    /// gives one of these patterns with no other special-token rule (not `jina-v1-en`,
    /// `jina-v2-code` or `roberta-bpe`, which add a separator token, nor `jina-v2-es` or
    /// `jina-v2-de`, which strip before `<mask>`; GLM's names only default to no BOS
    /// token, which the file's `bos_token_id` overrides in llama.cpp as here). (A word that
    /// is a whole vocabulary token is that token for every pre-tokenizer here; llama.cpp
    /// sets `ignore_merges` for some names only.)
    pub const GGUF_NAMES: [(&'static str, PreTokenizer); 59] = [
        ("gpt-2", PreTokenizer::Gpt2),
        ("phi-2", PreTokenizer::Gpt2),
        ("jina-es", PreTokenizer::Gpt2),
        ("jina-de", PreTokenizer::Gpt2),
        ("gigachat", PreTokenizer::Gpt2),
        ("a.x-4.0", PreTokenizer::Gpt2),
        ("mellum", PreTokenizer::Gpt2),
        ("modern-bert", PreTokenizer::Gpt2),
        ("mpt", PreTokenizer::Gpt2),
        ("olmo", PreTokenizer::Gpt2),
        ("jais", PreTokenizer::Gpt2),
        ("trillion", PreTokenizer::Gpt2),
        ("granite-docling", PreTokenizer::Gpt2),
        ("exaone4", PreTokenizer::Gpt2),
        ("smollm", PreTokenizer::SmolLm),
        ("starcoder", PreTokenizer::SmolLm),
        ("refact", PreTokenizer::SmolLm),
        ("command-r", PreTokenizer::SmolLm),
        ("codeshell", PreTokenizer::SmolLm),
        ("exaone", PreTokenizer::SmolLm),
        ("minerva-7b", PreTokenizer::SmolLm),
        ("mellum2", PreTokenizer::SmolLm),
        ("llama-bpe", PreTokenizer::Llama3),
        ("llama3", PreTokenizer::Llama3),
        ("llama-v3", PreTokenizer::Llama3),
        ("falcon3", PreTokenizer::Llama3),
        ("falcon-h1", PreTokenizer::Llama3),
        ("pixtral", PreTokenizer::Llama3),
        ("midm-2.0", PreTokenizer::Llama3),
        ("lfm2", PreTokenizer::Llama3),
        ("jina-v5-nano", PreTokenizer::Llama3),
        ("dbrx", PreTokenizer::Llama3),
        ("smaug-bpe", PreTokenizer::Llama3),
        ("chatglm-bpe", PreTokenizer::Llama3),
        ("glm4", PreTokenizer::Llama3),
        ("glm5", PreTokenizer::Llama3),
        ("qwen2", PreTokenizer::Qwen2),
        ("deepseek-r1-qwen", PreTokenizer::Qwen2),
        ("kormo", PreTokenizer::Qwen2),
        ("f2llmv2", PreTokenizer::Qwen2),
        ("megrez", PreTokenizer::Qwen2),
        ("stablelm2", PreTokenizer::Qwen2),
        ("hunyuan", PreTokenizer::Qwen2),
        ("solar-open", PreTokenizer::Qwen2),
        ("grok-2", PreTokenizer::Qwen2),
        ("qwen35", PreTokenizer::Qwen35),
        ("gpt-4o", PreTokenizer::Gpt4o),
        ("llama4", PreTokenizer::Gpt4o),
        ("kanana2", PreTokenizer::Gpt4o),
        ("talkie", PreTokenizer::Gpt4o),
        ("minimax-m2", PreTokenizer::Gpt4o),
        ("tekken", PreTokenizer::Tekken),
        ("deepseek-llm", PreTokenizer::DeepSeekLlm),
        ("deepseek-coder", PreTokenizer::DeepSeekCoder),
        ("deepseek-v3", PreTokenizer::DeepSeekV3),
        ("hunyuan-dense", PreTokenizer::DeepSeekV3),
        ("joyai-llm", PreTokenizer::DeepSeekV3),
        ("hy_v4", PreTokenizer::DeepSeekV3),
        ("minicpm5", PreTokenizer::MiniCpm5),
    ];

    /// The [`Self::GGUF_NAMES`] for which llama.cpp adds BOS when the file does not say
    /// (`add_bos = true` in `llama_vocab::load`); for the others it does not.
    pub const GGUF_NAMES_ADDING_BOS: [&'static str; 10] = [
        "llama3",
        "llama-v3",
        "llama-bpe",
        "falcon3",
        "falcon-h1",
        "pixtral",
        "midm-2.0",
        "lfm2",
        "jina-v5-nano",
        "tekken",
    ];

    /// The name llama.cpp's converter writes for this pre-tokenizer.
    pub fn gguf_name(self) -> &'static str {
        match self {
            PreTokenizer::Gpt2 => "gpt-2",
            PreTokenizer::SmolLm => "smollm",
            PreTokenizer::Llama3 => "llama-bpe",
            PreTokenizer::Qwen2 => "qwen2",
            PreTokenizer::Qwen35 => "qwen35",
            PreTokenizer::Gpt4o => "gpt-4o",
            PreTokenizer::Tekken => "tekken",
            PreTokenizer::DeepSeekLlm | PreTokenizer::DeepSeekLlmDigits => "deepseek-llm",
            PreTokenizer::DeepSeekCoder => "deepseek-coder",
            PreTokenizer::DeepSeekV3 => "deepseek-v3",
            PreTokenizer::MiniCpm5 => "minicpm5",
        }
    }

    fn gguf_names() -> String {
        Self::GGUF_NAMES.iter().map(|(n, _)| format!("{n:?}")).collect::<Vec<_>>().join(", ")
    }
}

/// A token matched in the text before the model runs (HF's added tokens, GGUF's control
/// and user-defined tokens).
struct Special {
    text: String,
    id: u32,
    /// Matched even by [`Tokenizer::encode_ordinary`] (not special: user-defined tokens).
    always: bool,
}

/// Which algorithm turns raw text into ids.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TokenizerModel {
    /// Byte-level BPE with a [`PreTokenizer`] (GPT-2; GGUF `gpt2`).
    ByteLevelBpe,
    /// SentencePiece BPE with byte fallback (GGUF `llama`).
    SentencePiece,
}

pub struct Tokenizer {
    pre: PreTokenizer,
    /// Set for SentencePiece vocabularies from GGUF; byte-level BPE otherwise.
    spm: Option<spm::Spm>,
    /// Set for character-level BPE from `tokenizer.json` (SentencePiece conversions);
    /// its merges are `merges`.
    char_bpe: Option<hf_json::CharBpe>,
    /// `tokenizer.json`'s normalizer steps, run on each segment between special tokens.
    normalizers: Vec<hf_json::Normalizer>,
    /// BOS and EOS ids that encoders of whole texts put first and last (GGUF
    /// `add_bos_token`, `add_eos_token`).
    add_bos: Option<u32>,
    add_eos: Option<u32>,
    /// Raw bytes of each token → id.
    encoder: HashMap<Vec<u8>, u32>,
    /// id → raw bytes (empty for ids the vocabulary does not use).
    decoder: Vec<Vec<u8>>,
    /// (left id, right id) → (rank, merged id).
    merges: HashMap<(u32, u32), (u32, u32)>,
    /// The token of each single byte; `None` where the vocabulary has none (GGUF files
    /// only). Such bytes are dropped before merging, as HF's BPE without an unknown token
    /// does (llama.cpp drops them after merging: the two differ only when a merge spans
    /// a dropped byte inside one pre-token).
    byte_ids: [Option<u32>; 256],
    /// Special tokens, longest first.
    specials: Vec<Special>,
    cache: Mutex<HashMap<Vec<u8>, Vec<u32>>>,
}

/// Bytes a byte-level vocabulary may go without: ASCII control bytes and lead bytes of
/// UTF-8 beyond plane 1 or never valid (SmolLM2's GGUF lacks 21 such, and so does the
/// `tokenizer.json` transformers makes of it); text loses those bytes, as in HF and
/// llama.cpp. Printable ASCII, continuation bytes and common lead bytes must be there.
fn may_lack_byte(b: u8) -> bool {
    b < 0x20 || b == 0x7f || b == 0xc0 || b == 0xc1 || b >= 0xf1
}

/// The byte a SentencePiece byte token spells (`<0x0A>` → 0x0A).
fn byte_token_value(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() == 2 { u8::from_str_radix(hex, 16).ok() } else { None }
}

/// Checks shared by every vocabulary built from files: no empty token (an empty special
/// would match everywhere, an endless encode; an empty one decodes to nothing), no two
/// special tokens on one id, ids of plausible size. Returns the largest id.
fn check_token_ids(path: &Path, vocab: &[(String, u32)], specials: &[Special]) -> Result<u32> {
    if let Some(s) = specials.iter().find(|s| s.text.is_empty()) {
        return Err(format_err(path, format!("special token {} has empty content", s.id)));
    }
    if let Some((_, id)) = vocab.iter().find(|(s, _)| s.is_empty()) {
        return Err(format_err(path, format!("vocab token {id} is the empty string")));
    }
    let mut special_ids: HashMap<u32, &str> = HashMap::with_capacity(specials.len());
    for Special { text: s, id, .. } in specials {
        if let Some(other) = special_ids.insert(*id, s.as_str())
            && other != s
        {
            return Err(format_err(path, format!("special tokens {other:?} and {s:?} share id {id}")));
        }
    }
    let max_id = vocab.iter().map(|v| v.1).chain(specials.iter().map(|s| s.id)).max().unwrap_or(0);
    if max_id > 10_000_000 {
        return Err(format_err(path, format!("token id {max_id} is implausibly large")));
    }
    Ok(max_id)
}

/// The BOS id an HF `tokenizer.json` post-processor puts before a single text: a
/// `TemplateProcessing` (alone or in a `Sequence`, as Llama 3's) whose `single` template
/// starts with a special token, e.g. `<|begin_of_text|>`.
fn bos_of_post_processor(post: &Value) -> Option<u32> {
    match post["type"].as_str()? {
        "Sequence" => post["processors"].as_array()?.iter().find_map(bos_of_post_processor),
        "TemplateProcessing" => {
            let first = &post["single"].as_array()?.first()?["SpecialToken"];
            let name = first["id"].as_str()?;
            let id = post["special_tokens"][name]["ids"].as_array()?.first()?.as_u64()?;
            u32::try_from(id).ok()
        }
        _ => None,
    }
}

/// The [`PreTokenizer`] an HF `tokenizer.json` pipeline amounts to, if it is one of the
/// pipelines byte-level models ship: GPT-2's `ByteLevel`, SmolLM2's `Digits` + `ByteLevel`,
/// Llama 3's, Qwen 2's, Qwen 3.5's, GPT-4o's and Tekken's `Split` (their pattern, isolated) or
/// DeepSeek's and MiniCPM 5's chains of them (DeepSeek LLM's and Coder's may end in HF's
/// `Digits`, which is a split on `\p{N}` or `\p{N}+`) + `ByteLevel` without a pattern.
pub fn pre_tokenizer_of_json(pre: &Value) -> Option<PreTokenizer> {
    let byte_level = |v: &Value, use_regex: bool| {
        v["type"] == "ByteLevel"
            && v["add_prefix_space"].as_bool() != Some(true)
            && v["use_regex"].as_bool().unwrap_or(true) == use_regex
    };
    if byte_level(pre, true) {
        return Some(PreTokenizer::Gpt2);
    }
    if pre["type"] != "Sequence" {
        return None;
    }
    match pre["pretokenizers"].as_array()?.as_slice() {
        [digits, bl] if digits["type"] == "Digits" && digits["individual_digits"] == true && byte_level(bl, true) => {
            Some(PreTokenizer::SmolLm)
        }
        [splits @ .., bl] if !splits.is_empty() && byte_level(bl, false) => {
            // A regex's `\r` and `\n` escapes match what the characters themselves do.
            let plain = |p: &str| p.replace("\\r", "\r").replace("\\n", "\n");
            let isolated = |v: &Value| {
                if v["type"] == "Digits" {
                    // HF splits off `char::is_numeric` (`\p{N}`) characters: alone or in runs.
                    return Some(if v["individual_digits"] == true { "\\p{N}" } else { "\\p{N}+" }.to_owned());
                }
                (v["type"] == "Split" && v["behavior"] == "Isolated" && v["invert"] != true)
                    .then(|| v["pattern"]["Regex"].as_str())
                    .flatten()
                    .map(plain)
            };
            let patterns = splits.iter().map(isolated).collect::<Option<Vec<String>>>()?;
            let mut llm_digits = DEEPSEEK_LLM_SPLITS;
            llm_digits[5] = "\\p{N}";
            let is = |chain: &[&str]| {
                patterns.len() == chain.len() && patterns.iter().zip(chain).all(|(p, c)| *p == plain(c))
            };
            [
                (&[LLAMA3_PATTERN][..], PreTokenizer::Llama3),
                (&[QWEN2_PATTERN], PreTokenizer::Qwen2),
                (&[QWEN35_PATTERN], PreTokenizer::Qwen35),
                (&[GPT4O_PATTERN], PreTokenizer::Gpt4o),
                (&[TEKKEN_PATTERN], PreTokenizer::Tekken),
                (&DEEPSEEK_LLM_SPLITS, PreTokenizer::DeepSeekLlm),
                (&llm_digits, PreTokenizer::DeepSeekLlmDigits),
                (&DEEPSEEK_CODER_SPLITS, PreTokenizer::DeepSeekCoder),
                (&DEEPSEEK_V3_SPLITS, PreTokenizer::DeepSeekV3),
                (&MINICPM5_SPLITS, PreTokenizer::MiniCpm5),
            ]
            .into_iter()
            .find_map(|(chain, pre)| is(chain).then_some(pre))
        }
        _ => None,
    }
}

fn format_err(path: &Path, msg: impl Into<String>) -> TokenizerError {
    TokenizerError::Format { path: path.to_owned(), msg: msg.into() }
}

fn read(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|source| TokenizerError::Io { path: path.to_owned(), source })
}

impl Tokenizer {
    /// Load from a model folder: `tokenizer.json` if present, else `vocab.json` + `merges.txt`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let tj = dir.join("tokenizer.json");
        if tj.is_file() {
            return Self::from_tokenizer_json(&tj);
        }
        let (vocab, merges) = (dir.join("vocab.json"), dir.join("merges.txt"));
        if vocab.is_file() && merges.is_file() {
            return Self::from_vocab_merges(&vocab, &merges);
        }
        Err(format_err(dir, "no tokenizer.json, and no vocab.json + merges.txt"))
    }

    /// Load HF `tokenizer.json`: byte-level BPE (GPT-2, SmolLM2, Llama 3, Qwen 2), or
    /// character-level BPE with byte fallback (SentencePiece conversions: Gemma, Llama 2,
    /// Mistral), with the normalizers, pre-tokenizers and decoders [`hf_json`] runs.
    pub fn from_tokenizer_json(path: &Path) -> Result<Self> {
        Self::parse_tokenizer_json(path, &read(path)?)
    }

    /// Parse the text of a `tokenizer.json`; `path` names it in error messages.
    pub fn parse_tokenizer_json(path: &Path, text: &str) -> Result<Self> {
        let root: Value = serde_json::from_str(text).map_err(|e| format_err(path, format!("invalid JSON: {e}")))?;
        let model = &root["model"];
        if model["type"].as_str() != Some("BPE") {
            return Err(format_err(path, format!("model type {} is not supported (only BPE)", model["type"])));
        }
        for key in ["dropout", "continuing_subword_prefix", "end_of_word_suffix"] {
            if !model[key].is_null() && model[key] != "" {
                return Err(format_err(path, format!("model.{key} = {} is not supported", model[key])));
            }
        }
        let normalizers = hf_json::normalizers_of_json(&root["normalizer"]).map_err(|e| format_err(path, e))?;
        let vocab = model["vocab"].as_object().ok_or_else(|| format_err(path, "model.vocab is not an object"))?;
        let vocab: Vec<(String, u32)> = vocab
            .iter()
            .map(|(k, v)| {
                let id = v.as_u64().and_then(|v| u32::try_from(v).ok());
                id.map(|id| (k.clone(), id)).ok_or_else(|| format_err(path, format!("vocab id of {k:?} is not a u32")))
            })
            .collect::<Result<_>>()?;
        let merges_v = model["merges"].as_array().ok_or_else(|| format_err(path, "model.merges is not an array"))?;
        let mut merges = Vec::with_capacity(merges_v.len());
        for m in merges_v {
            let pair = match m {
                Value::String(s) => s.split_once(' ').map(|(a, b)| (a.to_owned(), b.to_owned())),
                Value::Array(a) if a.len() == 2 => match (a[0].as_str(), a[1].as_str()) {
                    (Some(x), Some(y)) => Some((x.to_owned(), y.to_owned())),
                    _ => None,
                },
                _ => None,
            };
            merges.push(pair.ok_or_else(|| format_err(path, format!("malformed merge {m}")))?);
        }
        let mut specials = Vec::new();
        for t in root["added_tokens"].as_array().into_iter().flatten() {
            if let (Some(content), Some(id)) = (t["content"].as_str(), t["id"].as_u64()) {
                let id = u32::try_from(id).map_err(|_| format_err(path, "added token id is not a u32"))?;
                // HF matches a `normalized` added token in the normalized text, under its
                // normalized spelling; without a normalizer that is the raw text.
                if t["normalized"].as_bool() == Some(true) && !normalizers.is_empty() {
                    return Err(format_err(
                        path,
                        format!("added token {content:?} is matched after normalization, which is not supported"),
                    ));
                }
                let always = t["special"].as_bool() == Some(false);
                specials.push(Special { text: content.to_owned(), id, always });
            }
        }
        let mut tok = match pre_tokenizer_of_json(&root["pre_tokenizer"]) {
            Some(pre) => {
                let mut tok = Self::build(path, vocab, merges, specials, may_lack_byte)?;
                tok.pre = pre;
                tok
            }
            None => {
                let steps = hf_json::pre_steps_of_json(&root["pre_tokenizer"]).map_err(|e| {
                    format_err(
                        path,
                        format!(
                            "{e} (supported pre-tokenizers: ByteLevel with GPT-2's pattern; Digits(individual_digits) \
                             then ByteLevel (SmolLM2); Split with Llama 3's, Qwen 2's, Qwen 3.5's, GPT-4o's or Tekken's pattern, or \
                             DeepSeek LLM's, Coder's or V3's or MiniCPM 5's chain of Splits, then ByteLevel without its pattern; for character-level vocabularies none, Metaspace, Split on a \
                             string, or a Sequence of them)"
                        ),
                    )
                })?;
                let decoder = hf_json::char_decoder_of_json(&root["decoder"]).map_err(|e| format_err(path, e))?;
                Self::build_char(path, model, vocab, merges, specials, steps, decoder)?
            }
        };
        tok.normalizers = normalizers;
        tok.add_bos = bos_of_post_processor(&root["post_processor"]);
        Ok(tok)
    }

    /// A character-level BPE tokenizer (`tokenizer.json` of a SentencePiece conversion):
    /// tokens spelled as text, `▁` for a space, `<0xXX>` for bytes.
    fn build_char(
        path: &Path,
        model: &Value,
        vocab: Vec<(String, u32)>,
        merges: Vec<(String, String)>,
        mut specials: Vec<Special>,
        steps: Vec<hf_json::PreStep>,
        decoder: hf_json::CharDecoder,
    ) -> Result<Self> {
        let flag = |k: &str| -> Result<bool> {
            match &model[k] {
                Value::Null => Ok(false),
                v => v.as_bool().ok_or_else(|| format_err(path, format!("model.{k} is not a bool"))),
            }
        };
        let (byte_fallback, fuse_unk, ignore_merges) =
            (flag("byte_fallback")?, flag("fuse_unk")?, flag("ignore_merges")?);
        let max_id = check_token_ids(path, &vocab, &specials)?;
        let mut decoded = vec![Vec::new(); max_id as usize + 1];
        let mut byte_of_token = HashMap::new();
        // What HF's per-token decoder steps make of a token (added ones included).
        let mut decode_token = |id: u32, token: &str| {
            byte_of_token.remove(&id);
            decoded[id as usize] = match (decoder.byte_fallback, byte_token_value(token), decoder.space_char) {
                (true, Some(b), _) => {
                    byte_of_token.insert(id, b);
                    vec![b]
                }
                (_, _, Some(c)) => token.replace(c, " ").into_bytes(),
                (_, _, None) => token.as_bytes().to_vec(),
            };
        };
        let mut map = HashMap::with_capacity(vocab.len());
        let mut seen = std::collections::HashSet::with_capacity(vocab.len());
        for (token, id) in vocab {
            if !seen.insert(id) {
                return Err(format_err(path, format!("id {id} is used by two vocab tokens")));
            }
            decode_token(id, &token);
            map.insert(token, id);
        }
        for s in &specials {
            decode_token(s.id, &s.text);
        }
        let byte_tokens = byte_fallback.then(|| std::array::from_fn(|b| map.get(&format!("<0x{b:02X}>")).copied()));
        let unk = match model["unk_token"].as_str() {
            Some(u) => {
                Some(*map.get(u).ok_or_else(|| format_err(path, format!("unk_token {u:?} is not in the vocabulary")))?)
            }
            None => None,
        };
        let lookup = |s: &str| {
            map.get(s).copied().ok_or_else(|| format_err(path, format!("merge token {s:?} is not in the vocabulary")))
        };
        // A pair listed twice keeps its last rank, as HF's merge map does.
        let mut merge_map = HashMap::with_capacity(merges.len());
        for (rank, (a, b)) in merges.iter().enumerate() {
            let merged = lookup(&format!("{a}{b}"))?;
            merge_map.insert((lookup(a)?, lookup(b)?), (rank as u32, merged));
        }
        let added = specials.iter().map(|s| s.id).collect();
        specials.sort_by_key(|s| Reverse(s.text.len()));
        let char_bpe = hf_json::CharBpe {
            vocab: map,
            byte_tokens,
            unk,
            fuse_unk,
            ignore_merges,
            steps,
            byte_of_token,
            added,
            decoder,
        };
        Ok(Tokenizer {
            pre: PreTokenizer::Gpt2,
            spm: None,
            char_bpe: Some(char_bpe),
            normalizers: Vec::new(),
            add_bos: None,
            add_eos: None,
            encoder: HashMap::new(),
            decoder: decoded,
            merges: merge_map,
            byte_ids: [None; 256],
            specials,
            cache: Mutex::new(HashMap::new()),
        })
    }

    /// Load OpenAI's original files: `vocab.json` (encoder.json) and `merges.txt` (vocab.bpe).
    pub fn from_vocab_merges(vocab_path: &Path, merges_path: &Path) -> Result<Self> {
        Self::parse_vocab_merges(vocab_path, &read(vocab_path)?, merges_path, &read(merges_path)?)
    }

    /// Parse the texts of `vocab.json` and `merges.txt`; the paths name them in messages.
    pub fn parse_vocab_merges(vocab_path: &Path, vocab: &str, merges_path: &Path, text: &str) -> Result<Self> {
        let vocab: HashMap<String, u32> =
            serde_json::from_str(vocab).map_err(|e| format_err(vocab_path, format!("invalid vocab: {e}")))?;
        let mut merges = Vec::new();
        for (n, line) in text.lines().enumerate() {
            if (n == 0 && line.starts_with("#version")) || line.is_empty() {
                continue;
            }
            let (a, b) = line
                .split_once(' ')
                .ok_or_else(|| format_err(merges_path, format!("line {}: expected two tokens", n + 1)))?;
            merges.push((a.to_owned(), b.to_owned()));
        }
        // GPT-2's one special token lives in vocab.json; mark it special as HF does.
        let specials = vocab
            .get("<|endoftext|>")
            .map(|&id| vec![Special { text: "<|endoftext|>".to_owned(), id, always: false }])
            .unwrap_or_default();
        Self::build(vocab_path, vocab.into_iter().collect(), merges, specials, |_| false)
    }

    /// `may_lack(b)`: whether the vocabulary may go without a token for byte `b` (such
    /// bytes are then dropped from the text); any other missing byte is an error.
    fn build(
        path: &Path,
        vocab: Vec<(String, u32)>,
        merges: Vec<(String, String)>,
        mut specials: Vec<Special>,
        may_lack: fn(u8) -> bool,
    ) -> Result<Self> {
        let table = byte_level::byte_to_char_table();
        let max_id = check_token_ids(path, &vocab, &specials)?;
        let special_ids: HashMap<u32, &str> = specials.iter().map(|s| (s.id, s.text.as_str())).collect();
        let mut decoder = vec![Vec::new(); max_id as usize + 1];
        let mut encoder = HashMap::with_capacity(vocab.len());
        for (token, id) in &vocab {
            let bytes = match special_ids.get(id) {
                Some(s) => s.as_bytes().to_vec(),
                None => byte_level::token_string_to_bytes(token, &table)
                    .ok_or_else(|| format_err(path, format!("vocab token {token:?} is not byte-level text")))?,
            };
            if !decoder[*id as usize].is_empty() {
                return Err(format_err(path, format!("id {id} is used by two vocab tokens")));
            }
            decoder[*id as usize] = bytes.clone();
            encoder.insert(bytes, *id);
        }
        for s in &specials {
            decoder[s.id as usize] = s.text.as_bytes().to_vec();
        }
        let mut byte_ids = [None; 256];
        for b in 0..=255u8 {
            byte_ids[b as usize] = encoder.get(&[b][..]).copied();
        }
        if let Some(b) = (0..=255u8).find(|&b| byte_ids[b as usize].is_none() && !may_lack(b)) {
            return Err(format_err(path, format!("vocabulary lacks the single byte {b:#04x}")));
        }
        let lookup = |s: &str| -> Result<u32> {
            let bytes = byte_level::token_string_to_bytes(s, &table)
                .ok_or_else(|| format_err(path, format!("merge token {s:?} is not byte-level text")))?;
            encoder
                .get(&bytes)
                .copied()
                .ok_or_else(|| format_err(path, format!("merge token {s:?} is not in the vocabulary")))
        };
        let mut merge_map = HashMap::with_capacity(merges.len());
        for (rank, (a, b)) in merges.iter().enumerate() {
            let merged = lookup(&format!("{a}{b}"))?;
            merge_map.entry((lookup(a)?, lookup(b)?)).or_insert((rank as u32, merged));
        }
        specials.sort_by_key(|s| Reverse(s.text.len()));
        Ok(Tokenizer {
            pre: PreTokenizer::Gpt2,
            spm: None,
            char_bpe: None,
            normalizers: Vec::new(),
            add_bos: None,
            add_eos: None,
            encoder,
            decoder,
            merges: merge_map,
            byte_ids,
            specials,
            cache: Mutex::new(HashMap::new()),
        })
    }

    /// Build from the `tokenizer.ggml.*` metadata of a GGUF file: model `gpt2`
    /// (byte-level BPE) with pre-tokenizer `gpt-2` or `smollm`, or model `llama`
    /// (SentencePiece BPE, [`spm`]). Control (type 3) tokens are special (matched in text
    /// by [`Tokenizer::encode`], spelled as they are); user-defined (type 4) ones are
    /// matched always.
    pub fn from_gguf(g: &crate::loaders::gguf::GgufFile) -> Result<Self> {
        let path = g.path();
        let err = |msg: String| format_err(path, msg);
        let meta = |k: &str| g.get(k).ok_or_else(|| err(format!("no {k} in the metadata")));
        let string = |k: &str| meta(k)?.as_str().ok_or_else(|| err(format!("{k} is not a string")));
        let model = string("tokenizer.ggml.model")?;
        match model {
            "gpt2" => {}
            "llama" => return Self::from_gguf_spm(g),
            other => {
                return Err(err(format!(
                    "tokenizer.ggml.model = {other:?} is not supported (supported: \"gpt2\", byte-level BPE; \
                     \"llama\", SentencePiece BPE)"
                )));
            }
        }
        let (pre_name, pre) = match g.get("tokenizer.ggml.pre").map(|v| v.as_str()) {
            None => {
                return Err(err(format!(
                    "no tokenizer.ggml.pre: llama.cpp then uses its \"default\" pattern, which is not \
                     supported (supported: {})",
                    PreTokenizer::gguf_names()
                )));
            }
            Some(Some(name)) => match PreTokenizer::GGUF_NAMES.iter().find(|(n, _)| *n == name) {
                Some(&(n, p)) => (n, p),
                None => {
                    return Err(err(format!(
                        "tokenizer.ggml.pre = {name:?} is not supported (supported: {})",
                        PreTokenizer::gguf_names()
                    )));
                }
            },
            Some(None) => return Err(err("tokenizer.ggml.pre is not a string".into())),
        };
        let array = |k: &str| meta(k)?.as_array().ok_or_else(|| err(format!("{k} is not an array")));
        let tokens = array("tokenizer.ggml.tokens")?;
        let texts = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| t.as_str().ok_or_else(|| err(format!("token {i} is not a string"))))
            .collect::<Result<Vec<&str>>>()?;
        let types = match g.get("tokenizer.ggml.token_type") {
            Some(v) => Some(v.as_array().ok_or_else(|| err("tokenizer.ggml.token_type is not an array".into()))?),
            None => None,
        };
        if let Some(t) = types
            && t.len() != tokens.len()
        {
            return Err(err(format!("{} token types for {} tokens", t.len(), tokens.len())));
        }
        let mut vocab = Vec::with_capacity(tokens.len());
        let mut specials = Vec::new();
        for (i, &text) in texts.iter().enumerate() {
            let id = u32::try_from(i).map_err(|_| err("too many tokens".into()))?;
            let ty = types.map(|t| t[i].as_u64());
            match ty {
                Some(Some(t @ (3 | 4))) => specials.push(Special { text: text.to_owned(), id, always: t == 4 }),
                Some(Some(_)) | None => {}
                Some(None) => return Err(err(format!("token type {i} is not an integer"))),
            }
            vocab.push((text.to_owned(), id));
        }
        let mut merges = Vec::new();
        for (i, m) in array("tokenizer.ggml.merges")?.iter().enumerate() {
            let m = m.as_str().ok_or_else(|| err(format!("merge {i} is not a string")))?;
            let (a, b) = m.split_once(' ').ok_or_else(|| err(format!("merge {i} ({m:?}) is not two tokens")))?;
            merges.push((a.to_owned(), b.to_owned()));
        }
        let mut tok = Self::build(path, vocab, merges, specials, may_lack_byte)?;
        tok.pre = pre;
        let default_bos = PreTokenizer::GGUF_NAMES_ADDING_BOS.contains(&pre_name);
        tok.set_bos_eos_from_gguf(g, tokens.len(), default_bos)?;
        Ok(tok)
    }

    /// GGUF `add_bos_token` / `add_eos_token` with their ids, checked against the
    /// vocabulary; `default_bos`: whether BOS is added when the file does not say.
    fn set_bos_eos_from_gguf(
        &mut self,
        g: &crate::loaders::gguf::GgufFile,
        n_tokens: usize,
        default_bos: bool,
    ) -> Result<()> {
        let err = |msg: String| format_err(g.path(), msg);
        let id_of = |k: &str| -> Result<Option<u32>> {
            match g.get(k) {
                None => Ok(None),
                Some(v) => {
                    let id = v.as_u64().and_then(|v| u32::try_from(v).ok()).filter(|&v| (v as usize) < n_tokens);
                    id.map(Some).ok_or_else(|| err(format!("{k} is not a token id")))
                }
            }
        };
        let bos = id_of("tokenizer.ggml.bos_token_id")?;
        let flag = |k: &str, default: bool| match g.get(k) {
            Some(v) => v.as_bool().ok_or_else(|| err(format!("{k} is not a bool"))),
            None => Ok(default),
        };
        let add_bos = flag("tokenizer.ggml.add_bos_token", default_bos)?;
        let add_eos = flag("tokenizer.ggml.add_eos_token", false)?;
        let eos = id_of("tokenizer.ggml.eos_token_id")?;
        for k in ["tokenizer.ggml.unknown_token_id", "tokenizer.ggml.padding_token_id"] {
            id_of(k)?;
        }
        if add_bos {
            self.add_bos = Some(bos.ok_or_else(|| err("add_bos_token is set but there is no bos_token_id".into()))?);
        }
        if add_eos {
            self.add_eos = Some(eos.ok_or_else(|| err("add_eos_token is set but there is no eos_token_id".into()))?);
        }
        Ok(())
    }

    /// A SentencePiece vocabulary from GGUF metadata: `tokenizer.ggml.tokens`, `.scores`
    /// and `.token_type` (1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
    /// 6 byte `<0xXX>`), `add_space_prefix` (default true, as llama.cpp has it).
    fn from_gguf_spm(g: &crate::loaders::gguf::GgufFile) -> Result<Self> {
        let path = g.path();
        let err = |msg: String| format_err(path, msg);
        let meta = |k: &str| g.get(k).ok_or_else(|| err(format!("no {k} in the metadata")));
        let array = |k: &str| meta(k)?.as_array().ok_or_else(|| err(format!("{k} is not an array")));
        let tokens = array("tokenizer.ggml.tokens")?;
        let n = tokens.len();
        if n == 0 || n > 10_000_000 {
            return Err(err(format!("{n} tokens is not a plausible vocabulary")));
        }
        let scores = array("tokenizer.ggml.scores")?;
        let types = array("tokenizer.ggml.token_type")?;
        if scores.len() != n || types.len() != n {
            return Err(err(format!("{n} tokens but {} scores and {} token types", scores.len(), types.len())));
        }
        let mut pieces = Vec::with_capacity(n);
        let mut specials = Vec::new();
        let mut decoder = Vec::with_capacity(n);
        let mut byte_tokens = [None; 256];
        for i in 0..n {
            let text = tokens[i].as_str().ok_or_else(|| err(format!("token {i} is not a string")))?;
            let score = scores[i].as_f64().ok_or_else(|| err(format!("score {i} is not a number")))? as f32;
            let ty = types[i].as_u64().ok_or_else(|| err(format!("token type {i} is not an integer")))?;
            let id = i as u32;
            let bytes = match ty {
                6 => {
                    let b =
                        byte_token_value(text).ok_or_else(|| err(format!("byte token {i} is {text:?}, not <0xXX>")))?;
                    byte_tokens[b as usize].get_or_insert(id);
                    vec![b]
                }
                // Unknown (2) and control (3) tokens are matched when special tokens are parsed,
                // user-defined (4) ones always, as llama.cpp does.
                2..=4 if !text.is_empty() => {
                    specials.push(Special { text: text.to_owned(), id, always: ty == 4 });
                    text.as_bytes().to_vec()
                }
                _ => text.replace('▁', " ").into_bytes(),
            };
            // Merges may form any piece of the vocabulary, as llama.cpp's text → id map allows.
            pieces.push((text.to_owned(), id, score));
            decoder.push(bytes);
        }
        let unknown = match g.get("tokenizer.ggml.unknown_token_id") {
            Some(v) => Some(
                v.as_u64()
                    .and_then(|v| u32::try_from(v).ok())
                    .filter(|&v| (v as usize) < n)
                    .ok_or_else(|| err("tokenizer.ggml.unknown_token_id is not a token id".into()))?,
            ),
            None => None,
        };
        let add_space_prefix = match g.get("tokenizer.ggml.add_space_prefix") {
            Some(v) => v.as_bool().ok_or_else(|| err("tokenizer.ggml.add_space_prefix is not a bool".into()))?,
            None => true,
        };
        specials.sort_by_key(|s| Reverse(s.text.len()));
        let mut tok = Tokenizer {
            pre: PreTokenizer::Gpt2,
            spm: Some(spm::Spm::new(pieces, byte_tokens, unknown, add_space_prefix)),
            char_bpe: None,
            normalizers: Vec::new(),
            add_bos: None,
            add_eos: None,
            encoder: HashMap::new(),
            decoder,
            merges: HashMap::new(),
            byte_ids: [None; 256],
            specials,
            cache: Mutex::new(HashMap::new()),
        };
        // llama.cpp adds BOS to SentencePiece vocabularies unless the file says otherwise.
        tok.set_bos_eos_from_gguf(g, n, true)?;
        Ok(tok)
    }

    /// Which algorithm this tokenizer runs.
    pub fn model(&self) -> TokenizerModel {
        if self.spm.is_some() || self.char_bpe.is_some() {
            TokenizerModel::SentencePiece
        } else {
            TokenizerModel::ByteLevelBpe
        }
    }

    /// Whether every text decodes back to itself, byte for byte: byte-level BPE from
    /// `tokenizer.json` or `vocab.json` + `merges.txt` without a normalizer (a normalizer,
    /// SentencePiece's space prefix, an unknown token or a byte the vocabulary lacks change
    /// the text).
    pub fn round_trips(&self) -> bool {
        self.spm.is_none()
            && self.char_bpe.is_none()
            && self.normalizers.is_empty()
            && self.byte_ids.iter().all(Option::is_some)
    }

    /// The pre-tokenizer this tokenizer splits words with.
    pub fn pre_tokenizer(&self) -> PreTokenizer {
        self.pre
    }

    /// The BOS id to put before a whole prompt, when the model asks for one (GGUF
    /// `add_bos_token`); `None` for GPT-2's files.
    pub fn bos_to_add(&self) -> Option<u32> {
        self.add_bos
    }

    /// The EOS id to put after a whole text, when the model asks for one (GGUF `add_eos_token`).
    pub fn eos_to_add(&self) -> Option<u32> {
        self.add_eos
    }

    /// Number of ids (one past the largest token id).
    pub fn vocab_size(&self) -> usize {
        self.decoder.len()
    }

    /// Whether `id` is a special (control) token such as `<|im_end|>`: text never
    /// produces it (user-defined tokens, which text does produce, are not special).
    pub fn is_special(&self, id: u32) -> bool {
        self.specials.iter().any(|s| s.id == id && !s.always)
    }

    /// The id of a special token such as `<|endoftext|>`.
    pub fn special_id(&self, text: &str) -> Option<u32> {
        self.specials.iter().find(|s| s.text == text).map(|s| s.id)
    }

    /// Encode, mapping special-token text (`<|endoftext|>`) to its id, like HF's default `encode`.
    pub fn encode(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        self.encode_into(text, true, &mut ids);
        ids
    }

    /// Encode treating special-token text as text (it is spelled out), like tiktoken's
    /// `encode_ordinary`. Tokens the vocabulary marks user-defined, not special, are
    /// still matched (HF and llama.cpp always match them).
    pub fn encode_ordinary(&self, text: &str) -> Vec<u32> {
        let mut ids = Vec::new();
        self.encode_into(text, false, &mut ids);
        ids
    }

    fn encode_into(&self, text: &str, parse_special: bool, ids: &mut Vec<u32>) {
        let active = |s: &Special| parse_special || s.always;
        // The next occurrence of each special token at or after `cursor`. Each is searched
        // for again only once the cursor has passed it, so encoding stays linear in the
        // text for each special token, however many times they occur.
        let mut next: Vec<Option<usize>> =
            self.specials.iter().map(|s| if active(s) { text.find(s.text.as_str()) } else { None }).collect();
        let mut cursor = 0;
        let mut after_special = true;
        // Earliest match; among equal starts the longest (specials are sorted longest first).
        while let Some((at, i)) = next.iter().enumerate().filter_map(|(i, at)| at.map(|at| (at, i))).min() {
            let special = &self.specials[i];
            if at > cursor {
                self.encode_raw(&text[cursor..at], cursor == 0, after_special, ids);
            }
            ids.push(special.id);
            after_special = true;
            cursor = at + special.text.len();
            for (s, slot) in self.specials.iter().zip(&mut next) {
                if slot.is_some_and(|p| p < cursor) {
                    *slot = text[cursor..].find(s.text.as_str()).map(|p| cursor + p);
                }
            }
        }
        if cursor < text.len() {
            self.encode_raw(&text[cursor..], cursor == 0, after_special, ids);
        }
    }

    /// Encode text that holds no special token; `at_start`: it starts the input;
    /// `after_special`: it starts the input or follows a special token (where
    /// SentencePiece's space prefix goes).
    fn encode_raw(&self, text: &str, at_start: bool, after_special: bool, out: &mut Vec<u32>) {
        let mut normalized = std::borrow::Cow::Borrowed(text);
        for n in &self.normalizers {
            normalized = n.apply(normalized);
        }
        let text = normalized.as_ref();
        if let Some(spm) = &self.spm {
            spm.encode(text, after_special, out);
            return;
        }
        if let Some(cb) = &self.char_bpe {
            let mut words = vec![std::borrow::Cow::Borrowed(text)];
            for step in &cb.steps {
                words = step.run(words, at_start);
            }
            for w in &words {
                self.cached_word(w, out, |out| {
                    if cb.ignore_merges
                        && let Some(&id) = cb.vocab.get(w.as_ref())
                    {
                        out.push(id);
                        return;
                    }
                    let mut syms = Vec::with_capacity(w.len());
                    cb.initial_symbols(w, &mut syms);
                    merge_ids(syms.iter().copied(), &self.merges, out);
                });
            }
            return;
        }
        match self.pre {
            PreTokenizer::Gpt2 => {
                for piece in pre_tokenize(text) {
                    self.encode_word(piece, out);
                }
            }
            PreTokenizer::Llama3 | PreTokenizer::Qwen2 => {
                let digits = if self.pre == PreTokenizer::Llama3 { 3 } else { 1 };
                for piece in llama3_pieces(text, digits) {
                    self.encode_word(piece, out);
                }
            }
            PreTokenizer::Qwen35 => {
                for piece in qwen35_pieces(text) {
                    self.encode_word(piece, out);
                }
            }
            PreTokenizer::Gpt4o | PreTokenizer::Tekken => {
                for piece in gpt4o_pieces(text, self.pre == PreTokenizer::Tekken) {
                    self.encode_word(piece, out);
                }
            }
            PreTokenizer::DeepSeekLlm
            | PreTokenizer::DeepSeekLlmDigits
            | PreTokenizer::DeepSeekCoder
            | PreTokenizer::DeepSeekV3
            | PreTokenizer::MiniCpm5 => {
                let chain = split_chain::chain_of(self.pre).unwrap_or_default();
                split_chain::for_each_piece(text, chain, &mut |piece| self.encode_word(piece, out));
            }
            PreTokenizer::SmolLm => {
                // Every number character is a word; GPT-2's pattern splits the text between.
                let mut start = 0;
                for (i, c) in text.char_indices() {
                    if pretokenize::is_number(c) {
                        for piece in pre_tokenize(&text[start..i]) {
                            self.encode_word(piece, out);
                        }
                        self.encode_word(&text[i..i + c.len_utf8()], out);
                        start = i + c.len_utf8();
                    }
                }
                for piece in pre_tokenize(&text[start..]) {
                    self.encode_word(piece, out);
                }
            }
        }
    }

    /// BPE of one pre-token, through the cache.
    fn encode_word(&self, piece: &str, out: &mut Vec<u32>) {
        if let Some(&id) = self.encoder.get(piece.as_bytes()) {
            out.push(id);
            return;
        }
        self.cached_word(piece, out, |out| self.bpe(piece.as_bytes(), out));
    }

    /// The ids of one word: from the cache, or from `encode` (then cached).
    fn cached_word(&self, piece: &str, out: &mut Vec<u32>, encode: impl FnOnce(&mut Vec<u32>)) {
        let bytes = piece.as_bytes();
        if bytes.len() <= CACHE_MAX_WORD {
            let cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(ids) = cache.get(bytes) {
                out.extend_from_slice(ids);
                return;
            }
        }
        let start = out.len();
        encode(out);
        if bytes.len() <= CACHE_MAX_WORD {
            let mut cache = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            if cache.len() >= CACHE_MAX_ENTRIES {
                cache.clear();
            }
            cache.insert(bytes.to_vec(), out[start..].to_vec());
        }
    }

    /// Byte-pair merging of one pre-token's bytes (those the vocabulary lacks dropped).
    fn bpe(&self, bytes: &[u8], out: &mut Vec<u32>) {
        merge_ids(bytes.iter().filter_map(|&b| self.byte_ids[b as usize]), &self.merges, out);
    }

    /// The raw bytes of one token.
    pub fn token_bytes(&self, id: u32) -> Result<&[u8]> {
        match self.decoder.get(id as usize) {
            Some(b) if !b.is_empty() => Ok(b),
            _ => Err(TokenizerError::BadId { id, vocab_size: self.decoder.len() }),
        }
    }

    /// Concatenated raw bytes of `ids` (may end inside a UTF-8 character).
    pub fn decode_bytes(&self, ids: &[u32]) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        for &id in ids {
            out.extend_from_slice(self.token_bytes(id)?);
        }
        Ok(out)
    }

    /// Decode to text as HF's `decode` does: invalid UTF-8 becomes U+FFFD; for a
    /// character-level `tokenizer.json`, its decoder's steps ([`hf_json::CharDecoder`]:
    /// the space its pre-tokenizer put first is dropped, an invalid run of byte tokens is
    /// one U+FFFD a byte). The token bytes ([`Tokenizer::decode_bytes`], streaming) keep
    /// every space.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match &self.char_bpe {
            Some(cb) => {
                for &id in ids {
                    self.token_bytes(id)?;
                }
                Ok(cb.decode(ids, |id| &self.decoder[id as usize]))
            }
            None => Ok(String::from_utf8_lossy(&self.decode_bytes(ids)?).into_owned()),
        }
    }
}

/// Byte-pair merging: repeatedly merge the adjacent pair of lowest rank in `merges`
/// ((left, right) → (rank, merged)), leftmost first, starting from the symbols `ids`.
/// A heap over candidate pairs plus a linked list of symbols keeps this O(n log n) even
/// for very long words.
fn merge_ids(ids: impl Iterator<Item = u32> + Clone, merges: &HashMap<(u32, u32), (u32, u32)>, out: &mut Vec<u32>) {
    const NONE: usize = usize::MAX;
    struct Sym {
        id: u32,
        prev: usize,
        next: usize,
        alive: bool,
    }
    let n = ids.clone().count();
    if n <= 1 {
        out.extend(ids);
        return;
    }
    let mut syms: Vec<Sym> = ids
        .enumerate()
        .map(|(i, id)| Sym {
            id,
            prev: if i == 0 { NONE } else { i - 1 },
            next: if i + 1 == n { NONE } else { i + 1 },
            alive: true,
        })
        .collect();
    // (rank, left position, left id, right id), smallest first.
    let mut heap = BinaryHeap::new();
    let push_pair = |heap: &mut BinaryHeap<Reverse<(u32, usize, u32, u32)>>, syms: &[Sym], left: usize| {
        let right = syms[left].next;
        if right == NONE {
            return;
        }
        if let Some(&(rank, _)) = merges.get(&(syms[left].id, syms[right].id)) {
            heap.push(Reverse((rank, left, syms[left].id, syms[right].id)));
        }
    };
    for i in 0..n.saturating_sub(1) {
        push_pair(&mut heap, &syms, i);
    }
    while let Some(Reverse((_, left, left_id, right_id))) = heap.pop() {
        let right = syms[left].next;
        // Skip stale candidates whose symbols have since been merged away.
        if !syms[left].alive || syms[left].id != left_id || right == NONE || syms[right].id != right_id {
            continue;
        }
        let (_, merged) = merges[&(left_id, right_id)];
        syms[left].id = merged;
        syms[right].alive = false;
        let after = syms[right].next;
        syms[left].next = after;
        if after != NONE {
            syms[after].prev = left;
        }
        let before = syms[left].prev;
        if before != NONE {
            push_pair(&mut heap, &syms, before);
        }
        push_pair(&mut heap, &syms, left);
    }
    let mut i = 0;
    while i != NONE {
        out.push(syms[i].id);
        i = syms[i].next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny() -> Tokenizer {
        let mut vocab: Vec<(String, u32)> =
            (0..=255u8).map(|b| (byte_level::byte_to_char_table()[b as usize].to_string(), b as u32)).collect();
        vocab.extend([("aa".into(), 256), ("aaa".into(), 257), ("ab".into(), 258)]);
        let merges = vec![("a".into(), "a".into()), ("aa".into(), "a".into()), ("a".into(), "b".into())];
        Tokenizer::build(Path::new("test"), vocab, merges, vec![], |_| false).unwrap()
    }

    #[test]
    fn merges_by_rank_leftmost_first() {
        let t = tiny();
        assert_eq!(t.encode("aaaa"), [256, 256]);
        assert_eq!(t.encode("aaa"), [257]);
        assert_eq!(t.encode("aab"), [256, 98]);
        assert_eq!(t.encode("ab"), [258]);
        assert!(t.decode(&[9999]).is_err());
    }
}

//! The parts of an HF `tokenizer.json` pipeline besides byte-level pre-tokenizers:
//! normalizers (`NFC`, `Prepend`, `Replace`), the pre-tokenizers SentencePiece-style
//! vocabularies use (`Metaspace`, `Split` on a string), the BPE model over characters
//! with `byte_fallback` (Gemma, Llama 2, Mistral, TinyLlama as their Hub folders ship
//! them), and the decoder steps that undo them.
//!
//! HF tokenizers runs a text as: split on added tokens → normalize each remaining
//! segment → pre-tokenize it into words → BPE each word → ids. For a character-level
//! BPE model ([`CharBpe`]) a word is split into characters, each a vocabulary token if
//! there is one, else its bytes as `<0xXX>` tokens (`byte_fallback`), else the unknown
//! token (consecutive ones fused into one with `fuse_unk`); then the pair of lowest
//! merge rank is merged, leftmost first, until no pair is in the merges.

use std::borrow::Cow;
use std::collections::HashMap;

use serde_json::Value;
use unicode_normalization::UnicodeNormalization;

/// One normalizer step; a `Sequence` is a list of them.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum Normalizer {
    /// Unicode canonical composition (`NFC`; Qwen's tokenizers).
    Nfc,
    /// Put a string before non-empty text (`Prepend`; Llama 2's `▁`).
    Prepend(String),
    /// Replace every occurrence of a string (`Replace` with a `String` pattern).
    Replace { pattern: String, content: String },
}

impl Normalizer {
    pub(crate) fn apply<'a>(&self, text: Cow<'a, str>) -> Cow<'a, str> {
        match self {
            Normalizer::Nfc => {
                if unicode_normalization::is_nfc_quick(text.chars()) == unicode_normalization::IsNormalized::Yes {
                    text
                } else {
                    Cow::Owned(text.nfc().collect())
                }
            }
            Normalizer::Prepend(p) if !text.is_empty() => Cow::Owned(format!("{p}{text}")),
            Normalizer::Prepend(_) => text,
            Normalizer::Replace { pattern, content } if text.contains(pattern.as_str()) => {
                Cow::Owned(text.replace(pattern.as_str(), content))
            }
            Normalizer::Replace { .. } => text,
        }
    }
}

/// The most a normalizer sequence may multiply a text's length by (`Replace` steps whose
/// content is longer than their pattern compound; real files grow it at most 3×, `" "`
/// to `"▁"`).
const MAX_NORMALIZER_GROWTH: usize = 64;

/// The normalizer steps of `tokenizer.json`'s `normalizer` (null: none), refused where
/// they could multiply a text's length by more than [`MAX_NORMALIZER_GROWTH`].
pub(crate) fn normalizers_of_json(v: &Value) -> Result<Vec<Normalizer>, String> {
    let steps = normalizer_steps(v)?;
    let mut growth = 1usize;
    for n in &steps {
        match n {
            // NFC composes: it never lengthens a text by more than 3× (UTF-8 bytes).
            Normalizer::Nfc => growth = growth.saturating_mul(3),
            Normalizer::Prepend(p) if p.len() > 64 => {
                return Err("a Prepend of more than 64 bytes is not supported".into());
            }
            Normalizer::Prepend(_) => {}
            Normalizer::Replace { pattern, content } => {
                growth = growth.saturating_mul(content.len().div_ceil(pattern.len()).max(1))
            }
        }
    }
    if growth > MAX_NORMALIZER_GROWTH {
        return Err(format!(
            "normalizer {v} is not supported: it can make a text {growth}× longer (at most {MAX_NORMALIZER_GROWTH}×)"
        ));
    }
    Ok(steps)
}

fn normalizer_steps(v: &Value) -> Result<Vec<Normalizer>, String> {
    let string = |v: &Value, what: &str| v.as_str().map(str::to_owned).ok_or_else(|| format!("{what} is not a string"));
    match v["type"].as_str() {
        _ if v.is_null() => Ok(Vec::new()),
        Some("Sequence") => {
            let steps =
                v["normalizers"].as_array().ok_or("a normalizer Sequence without normalizers is not supported")?;
            let mut out = Vec::new();
            for s in steps {
                out.extend(normalizer_steps(s)?);
            }
            Ok(out)
        }
        Some("NFC") => Ok(vec![Normalizer::Nfc]),
        Some("Prepend") => Ok(vec![Normalizer::Prepend(string(&v["prepend"], "Prepend's prepend")?)]),
        Some("Replace") => {
            let pattern = v["pattern"]["String"].as_str().filter(|p| !p.is_empty()).ok_or_else(|| {
                format!("normalizer Replace with pattern {} is not supported (a non-empty String only)", v["pattern"])
            })?;
            Ok(vec![Normalizer::Replace {
                pattern: pattern.to_owned(),
                content: string(&v["content"], "Replace's content")?,
            }])
        }
        _ => Err(format!(
            "normalizer {v} is not supported (supported: NFC, Prepend, Replace with a string, Sequence of them)"
        )),
    }
}

/// When `Metaspace` puts its replacement character before a word.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PrependScheme {
    Always,
    /// Only before the text's first segment (not after an added token).
    First,
    Never,
}

/// How `Split` keeps the matches of its pattern.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum SplitBehavior {
    Removed,
    Isolated,
    MergedWithPrevious,
    MergedWithNext,
    Contiguous,
}

/// One pre-tokenizer step of a SentencePiece-style pipeline.
#[derive(Clone, Debug, PartialEq)]
pub(crate) enum PreStep {
    /// `Metaspace`: spaces become `replacement`, which is put first per `prepend`
    /// unless the word already starts with it; `split`: a word starts at each replacement.
    Metaspace { replacement: char, prepend: PrependScheme, split: bool },
    /// `Split` on a literal string.
    Split { pattern: String, behavior: SplitBehavior },
}

/// The pre-tokenizer steps of a SentencePiece-style `pre_tokenizer` (null: none).
pub(crate) fn pre_steps_of_json(v: &Value) -> Result<Vec<PreStep>, String> {
    match v["type"].as_str() {
        _ if v.is_null() => Ok(Vec::new()),
        Some("Sequence") => {
            let steps = v["pretokenizers"]
                .as_array()
                .ok_or("a pre_tokenizer Sequence without pretokenizers is not supported")?;
            let mut out = Vec::new();
            for s in steps {
                out.extend(pre_steps_of_json(s)?);
            }
            Ok(out)
        }
        Some("Metaspace") => {
            let mut chars = v["replacement"].as_str().unwrap_or_default().chars();
            let replacement = match (chars.next(), chars.next()) {
                (Some(c), None) => c,
                _ => {
                    return Err(format!(
                        "Metaspace with replacement {} is not supported (one character)",
                        v["replacement"]
                    ));
                }
            };
            // Older files say `add_prefix_space` instead of `prepend_scheme`.
            let prepend = match (v["prepend_scheme"].as_str(), v["add_prefix_space"].as_bool()) {
                (Some("always"), _) | (None, Some(true)) => PrependScheme::Always,
                (Some("first"), _) => PrependScheme::First,
                (Some("never"), _) | (None, Some(false)) => PrependScheme::Never,
                _ => return Err(format!("Metaspace prepend_scheme {} is not supported", v["prepend_scheme"])),
            };
            Ok(vec![PreStep::Metaspace { replacement, prepend, split: v["split"].as_bool().unwrap_or(true) }])
        }
        Some("Split") => {
            let pattern = v["pattern"]["String"].as_str().filter(|p| !p.is_empty()).ok_or_else(|| {
                format!(
                    "pre_tokenizer Split with pattern {} is not supported here (a non-empty String only)",
                    v["pattern"]
                )
            })?;
            if v["invert"].as_bool() == Some(true) {
                return Err("pre_tokenizer Split with invert is not supported".into());
            }
            let behavior = match v["behavior"].as_str() {
                Some("Removed") => SplitBehavior::Removed,
                Some("Isolated") => SplitBehavior::Isolated,
                Some("MergedWithPrevious") => SplitBehavior::MergedWithPrevious,
                Some("MergedWithNext") => SplitBehavior::MergedWithNext,
                Some("Contiguous") => SplitBehavior::Contiguous,
                _ => return Err(format!("Split behavior {} is not supported", v["behavior"])),
            };
            Ok(vec![PreStep::Split { pattern: pattern.to_owned(), behavior }])
        }
        _ => Err(format!("pre_tokenizer {v} is not supported")),
    }
}

/// Split `text` at the matches of `pattern`, keeping them as `behavior` says (the
/// folds of HF's `NormalizedString::split`); no piece is empty.
fn split_on<'a>(text: &'a str, pattern: &str, behavior: SplitBehavior) -> Vec<Cow<'a, str>> {
    // (start, end, is_match) spans that tile the text, none empty.
    let mut spans = Vec::new();
    let mut last = 0;
    for (at, m) in text.match_indices(pattern) {
        if at > last {
            spans.push((last, at, false));
        }
        spans.push((at, at + m.len(), true));
        last = at + m.len();
    }
    if last < text.len() {
        spans.push((last, text.len(), false));
    }
    if behavior == SplitBehavior::MergedWithNext {
        spans.reverse();
    }
    let mut out: Vec<(usize, usize)> = Vec::with_capacity(spans.len());
    let mut previous_match = false;
    for (s, e, is_match) in spans {
        let merge = match behavior {
            SplitBehavior::Removed if is_match => {
                previous_match = true;
                continue;
            }
            SplitBehavior::Removed | SplitBehavior::Isolated => false,
            SplitBehavior::MergedWithPrevious | SplitBehavior::MergedWithNext => is_match && !previous_match,
            SplitBehavior::Contiguous => is_match == previous_match,
        };
        match out.last_mut() {
            Some(last) if merge => *last = (last.0.min(s), last.1.max(e)),
            _ => out.push((s, e)),
        }
        previous_match = is_match;
    }
    if behavior == SplitBehavior::MergedWithNext {
        out.reverse();
    }
    out.into_iter().map(|(s, e)| Cow::Borrowed(&text[s..e])).collect()
}

impl PreStep {
    /// Apply to each word; `at_start`: the first word begins the whole input.
    pub(crate) fn run<'a>(&self, words: Vec<Cow<'a, str>>, at_start: bool) -> Vec<Cow<'a, str>> {
        let mut out = Vec::with_capacity(words.len());
        for (i, w) in words.into_iter().enumerate() {
            match self {
                PreStep::Metaspace { replacement, prepend, split } => {
                    let mut s = if w.contains(' ') { w.replace(' ', &replacement.to_string()) } else { w.into_owned() };
                    let first = i == 0 && at_start;
                    let put = match prepend {
                        PrependScheme::Always => true,
                        PrependScheme::First => first,
                        PrependScheme::Never => false,
                    };
                    if put && !s.is_empty() && !s.starts_with(*replacement) {
                        s.insert(0, *replacement);
                    }
                    if *split {
                        let rep = replacement.to_string();
                        let pieces = split_on(&s, &rep, SplitBehavior::MergedWithNext);
                        out.extend(pieces.into_iter().map(|p| Cow::Owned(p.into_owned())));
                    } else if !s.is_empty() {
                        out.push(Cow::Owned(s));
                    }
                }
                PreStep::Split { pattern, behavior } => match w {
                    Cow::Borrowed(b) => out.extend(split_on(b, pattern, *behavior)),
                    Cow::Owned(o) => {
                        out.extend(split_on(&o, pattern, *behavior).into_iter().map(|p| Cow::Owned(p.into_owned())))
                    }
                },
            }
        }
        out
    }
}

/// Undoing a SentencePiece-style pipeline in decode, as HF's decoders do: per token
/// `Replace("▁", " ")` or `Metaspace` (which also drops the `▁`s of the first token),
/// `ByteFallback` (a run of `<0xXX>` tokens becomes its text, or one U+FFFD a byte where
/// it is not UTF-8), `Fuse`, then `Strip` of leading spaces from the whole text.
pub(crate) struct CharDecoder {
    /// Replace this character with a space (`Replace("▁", " ")`, `Metaspace`).
    pub(crate) space_char: Option<char>,
    /// `<0xXX>` tokens decode to their byte (`ByteFallback`).
    pub(crate) byte_fallback: bool,
    /// The first token's replacement characters are dropped (`Metaspace` with a prefix).
    pub(crate) drop_first_spaces: bool,
    /// Leading spaces to drop from the decoded text (`Strip` after `Fuse`).
    pub(crate) strip_leading: usize,
}

/// The decoder of a character-level `tokenizer.json`: a `Sequence` of per-token steps
/// (`Replace` of one character by a space, `ByteFallback`, `Metaspace`), `Fuse`, then
/// `Strip` of leading spaces; other steps, other orders and no decoder at all (HF then
/// joins tokens with spaces) are refused.
pub(crate) fn char_decoder_of_json(v: &Value) -> Result<CharDecoder, String> {
    let mut d = CharDecoder { space_char: None, byte_fallback: false, drop_first_spaces: false, strip_leading: 0 };
    let steps: Vec<&Value> = match v["type"].as_str() {
        _ if v.is_null() => return Err("a character-level tokenizer without a decoder is not supported".into()),
        Some("Sequence") => v["decoders"].as_array().ok_or("decoder Sequence has no decoders array")?.iter().collect(),
        _ => vec![v],
    };
    let mut fused = false;
    let one_char = |v: &Value| {
        let mut c = v.as_str().unwrap_or_default().chars();
        match (c.next(), c.next()) {
            (Some(c), None) => Some(c),
            _ => None,
        }
    };
    for s in steps {
        let unsupported = || format!("decoder step {s} is not supported here");
        match s["type"].as_str() {
            Some("Replace") if s["content"] == " " && !fused => {
                d.space_char = Some(one_char(&s["pattern"]["String"]).ok_or_else(unsupported)?);
            }
            Some("ByteFallback") if !fused => d.byte_fallback = true,
            Some("Metaspace") if !fused => {
                d.space_char = Some(one_char(&s["replacement"]).ok_or_else(unsupported)?);
                d.drop_first_spaces = !(s["prepend_scheme"] == "never" || s["add_prefix_space"] == false);
            }
            Some("Fuse") => fused = true,
            Some("Strip") if fused && s["content"] == " " && s["stop"].as_u64() == Some(0) => {
                d.strip_leading = s["start"].as_u64().ok_or("Strip's start is not a count")? as usize;
            }
            _ => {
                return Err(format!(
                    "{} (supported: Replace of one character by \" \", ByteFallback and Metaspace, then Fuse, then Strip)",
                    unsupported()
                ));
            }
        }
    }
    Ok(d)
}

/// BPE over characters with byte fallback (HF's `BPE` model as SentencePiece
/// conversions configure it), and how its ids decode.
pub(crate) struct CharBpe {
    /// Token text as the vocabulary spells it (with `▁`) → id.
    pub(crate) vocab: HashMap<String, u32>,
    /// The `<0xXX>` token of each byte, when `byte_fallback` is set.
    pub(crate) byte_tokens: Option<[Option<u32>; 256]>,
    pub(crate) unk: Option<u32>,
    pub(crate) fuse_unk: bool,
    /// A word that is itself a vocabulary token is that token (`ignore_merges`).
    pub(crate) ignore_merges: bool,
    pub(crate) steps: Vec<PreStep>,
    /// The byte of each `<0xXX>` token, when the decoder has `ByteFallback`.
    pub(crate) byte_of_token: HashMap<u32, u8>,
    /// Ids of added tokens (kept as they are by the first-token rule of `Metaspace`).
    pub(crate) added: std::collections::HashSet<u32>,
    pub(crate) decoder: CharDecoder,
}

impl CharBpe {
    /// The symbols a word starts as, before merging, as HF's `merge_word` makes them: a
    /// character the vocabulary lacks becomes its `<0xXX>` tokens, else a pending
    /// unknown token, which is written out before the next vocabulary character (or at
    /// the end), fused with the next unknown one when `fuse_unk` is set. Byte-fallback
    /// characters do not write it out, so HF puts it after them; so does this. Without
    /// an unknown token the character is dropped, as in HF.
    pub(crate) fn initial_symbols(&self, word: &str, out: &mut Vec<u32>) {
        let mut pending_unk = false;
        let mut buf = [0u8; 4];
        for c in word.chars() {
            if let Some(&id) = self.vocab.get(c.encode_utf8(&mut buf) as &str) {
                if std::mem::take(&mut pending_unk) {
                    out.extend(self.unk);
                }
                out.push(id);
                continue;
            }
            if let Some(bytes) = &self.byte_tokens {
                let ids: Option<Vec<u32>> = c.encode_utf8(&mut buf).bytes().map(|b| bytes[b as usize]).collect();
                if let Some(ids) = ids {
                    out.extend(ids);
                    continue;
                }
            }
            if let Some(unk) = self.unk {
                if pending_unk && !self.fuse_unk {
                    out.push(unk);
                }
                pending_unk = true;
            }
        }
        if pending_unk {
            out.extend(self.unk);
        }
    }
}

impl CharBpe {
    /// `ids` as HF's decoder chain renders them; `bytes(id)` gives a token's bytes (`▁`
    /// already a space, `<0xXX>` its byte, an added token its text).
    pub(crate) fn decode<'a>(&self, ids: &[u32], bytes: impl Fn(u32) -> &'a [u8]) -> String {
        let mut out = String::new();
        let mut run = Vec::new();
        let flush = |run: &mut Vec<u8>, out: &mut String| {
            match std::str::from_utf8(run) {
                Ok(s) => out.push_str(s),
                Err(_) => out.extend(std::iter::repeat_n('\u{FFFD}', run.len())),
            }
            run.clear();
        };
        for (i, &id) in ids.iter().enumerate() {
            if let Some(&b) = self.byte_of_token.get(&id) {
                run.push(b);
                continue;
            }
            flush(&mut run, &mut out);
            let text = String::from_utf8_lossy(bytes(id));
            if i == 0 && self.decoder.drop_first_spaces && !self.added.contains(&id) {
                out.extend(text.chars().filter(|&c| c != ' '));
            } else {
                out.push_str(&text);
            }
        }
        flush(&mut run, &mut out);
        let strip = out.bytes().take(self.decoder.strip_leading).take_while(|&b| b == b' ').count();
        out.split_off(strip)
    }
}

//! Structured output: a constraint (a JSON schema, a regular expression, a Lark or GBNF
//! grammar) compiled by the `llguidance` library into a matcher over this model's
//! vocabulary. Before each token of a constrained sequence is picked, the matcher gives
//! the set of tokens that keep the output inside the language; every other token's
//! logit becomes −∞, and the sampler picks among the rest as it always does. The
//! picked token then advances the matcher.
//!
//! A constraint the library cannot enforce (an unknown JSON-schema keyword, a bad
//! regex, a grammar that does not parse) is an error when the request is checked, never
//! a silently unconstrained answer.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{InferenceCapabilities, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::Value;

use super::gbnf::gbnf_to_lark;
use crate::tokenizer::Tokenizer;

/// What a request constrains its output to.
#[derive(Clone, Debug, PartialEq)]
pub enum GrammarSpec {
    /// A JSON schema (OpenAI's `response_format: json_schema`, `--json-schema`).
    JsonSchema(Value),
    /// Any JSON object (`response_format: json_object`).
    JsonObject,
    /// A regular expression the whole output matches.
    Regex(String),
    /// A grammar in llguidance's Lark dialect.
    Lark(String),
    /// A grammar in llama.cpp's GBNF (converted to Lark).
    Gbnf(String),
}

impl GrammarSpec {
    /// A grammar file's text: Lark when it starts with `%llguidance` (llama.cpp's marker
    /// for llguidance grammars) or defines `start:`, else GBNF (llama.cpp's format).
    pub fn grammar(text: &str) -> Self {
        let t = text.trim_start();
        let lark = t.starts_with("%llguidance")
            || (!t.contains("::=")
                && t.lines().any(|l| l.trim_start().starts_with("start:") || l.trim_start().starts_with("start :")));
        if lark { GrammarSpec::Lark(text.to_owned()) } else { GrammarSpec::Gbnf(text.to_owned()) }
    }

    /// What kind of constraint this is, for messages.
    pub fn kind(&self) -> &'static str {
        match self {
            GrammarSpec::JsonSchema(_) => "JSON schema",
            GrammarSpec::JsonObject => "JSON object",
            GrammarSpec::Regex(_) => "regex",
            GrammarSpec::Lark(_) => "Lark grammar",
            GrammarSpec::Gbnf(_) => "GBNF grammar",
        }
    }
}

/// The model's vocabulary as llguidance sees it: each token's bytes, special tokens
/// marked so that no text can produce them. The library tokenizes text only to force
/// tokens, which is off here (the model picks every token), so the trie's greedy
/// tokenization serves, declared not canonical.
struct Vocab {
    trie: TokTrie,
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// What goes wrong with a constraint: the caller's (it cannot be compiled or enforced),
/// the model's (no token ends generation), or the matcher's while generating.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
pub enum GrammarError {
    /// The constraint cannot be compiled, or the library could not enforce it.
    #[error("{0}")]
    Invalid(String),
    #[error("structured output needs an end-of-generation token, and this model has none")]
    NoEndToken,
    /// llguidance could not be set up for this vocabulary.
    #[error("llguidance: {0}")]
    Setup(String),
    #[error("the output constraint failed: {0}")]
    Failed(String),
    #[error("the output constraint rejected token {token}: {message}")]
    Rejected { token: u32, message: String },
    #[error("the output constraint allows no token here")]
    NothingAllowed,
}

/// Compiles constraints for one model (its vocabulary and end-of-generation tokens);
/// built once per model, shared by every request.
pub struct Grammars {
    factory: ParserFactory,
    vocab: usize,
    end_of_generation: Arc<[u32]>,
}

impl Grammars {
    /// `vocab` is the model's output width (at least the tokenizer's size; ids past the
    /// tokenizer's are never allowed); `end_of_generation` the tokens that end a
    /// sequence, allowed where the constraint is complete.
    pub fn new(tokenizer: &Tokenizer, vocab: usize, end_of_generation: &[u32]) -> Result<Self, GrammarError> {
        let eos: Vec<u32> = end_of_generation.iter().copied().filter(|&t| (t as usize) < vocab).collect();
        let Some(&first) = eos.first() else { return Err(GrammarError::NoEndToken) };
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| match tokenizer.token_bytes(id) {
                Ok(b) if tokenizer.is_special(id) || eos.contains(&id) => {
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(b);
                    w
                }
                Ok(b) => b.to_vec(),
                Err(_) => Vec::new(),
            })
            .collect();
        let info = TokRxInfo::new(vocab as u32, first);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(&eos);
        let env: TokEnv = Arc::new(Vocab { trie });
        let caps = InferenceCapabilities::default();
        let slices = llguidance::earley::SlicedBiasComputer::general_slices();
        let mut factory = ParserFactory::new(&env, caps, &slices).map_err(|e| GrammarError::Setup(format!("{e:#}")))?;
        factory.quiet();
        Ok(Grammars { factory, vocab, end_of_generation: eos.into() })
    }

    /// Compile `spec`; an error says what the library could not enforce.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Constraint, GrammarError> {
        self.compile_inner(spec).map_err(GrammarError::Invalid)
    }

    fn compile_inner(&self, spec: &GrammarSpec) -> Result<Constraint, String> {
        let grammar = match spec {
            GrammarSpec::JsonSchema(schema) => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err(format!("a JSON schema must be an object, got {schema}"));
                }
                if let Some(option) = WEAKENING_OPTIONS.iter().find(|&&o| schema["x-guidance"][o] == true) {
                    return Err(format!(
                        "x-guidance {option} is refused: it would turn what llguidance cannot enforce into a warning"
                    ));
                }
                TopLevelGrammar::from_json_schema(compact(schema.clone()))
            }
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(serde_json::json!({"type": "object"})))
            }
            GrammarSpec::Regex(rx) => TopLevelGrammar::from_regex(rx),
            GrammarSpec::Lark(text) => TopLevelGrammar::from_lark(strict_lark(text.clone())?),
            GrammarSpec::Gbnf(text) => TopLevelGrammar::from_lark(strict_lark(gbnf_to_lark(text)?)?),
        };
        let parser = self.factory.create_parser(grammar).map_err(|e| format!("{}: {e}", spec.kind()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(format!("{}: {e}", spec.kind()));
        }
        Ok(Constraint { matcher, vocab: self.vocab, end_of_generation: self.end_of_generation.clone() })
    }
}

/// llguidance's `x-guidance` options that turn a part it cannot enforce into a warning
/// (`lenient`) or into something looser (`coerce_one_of`: `oneOf` read as `anyOf`).
const WEAKENING_OPTIONS: [&str; 2] = ["lenient", "coerce_one_of"];

/// A Lark grammar, refused if a JSON schema inside it (`%json {…}`) may set one of the
/// [`WEAKENING_OPTIONS`].
fn strict_lark(text: String) -> Result<String, String> {
    match WEAKENING_OPTIONS.iter().find(|&&o| text.contains("x-guidance") && text.contains(o)) {
        Some(option) => {
            Err(format!("x-guidance {option} is refused: it would turn what llguidance cannot enforce into a warning"))
        }
        None => Ok(text),
    }
}

/// JSON without optional whitespace (`{"a":1,"b":[2,3]}`) unless the schema sets
/// `whitespace_flexible` in its `x-guidance` options: a small model cannot then loop on
/// blank lines.
fn compact(mut schema: Value) -> Value {
    if let Some(o) = schema.as_object_mut()
        && let Some(g) = o.entry("x-guidance").or_insert_with(|| serde_json::json!({})).as_object_mut()
    {
        g.entry("whitespace_flexible").or_insert(Value::Bool(false));
    }
    schema
}

/// One sequence's constraint: where it stands in the language.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    vocab: usize,
    end_of_generation: Arc<[u32]>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Constraint").field("stopped", &self.matcher.is_stopped()).finish()
    }
}

/// The tokens allowed next, as a bit set over the vocabulary.
pub struct Mask(llguidance::toktrie::SimpleVob);

impl Constraint {
    /// The tokens allowed next (only end-of-generation once the output is complete).
    pub fn mask(&mut self) -> Result<Mask, GrammarError> {
        self.matcher.compute_mask_or_eos().map(Mask).map_err(|e| GrammarError::Failed(e.to_string()))
    }

    /// Set the logit of every token `mask` does not allow to −∞. Whether any is left.
    pub fn apply(&self, mask: &Mask, logits: &mut [f32]) -> bool {
        let bits = mask.0.as_slice();
        let mut any = false;
        let n = self.vocab.min(logits.len());
        for (w, chunk) in logits[..n].chunks_mut(32).enumerate() {
            let word = bits.get(w).copied().unwrap_or(0);
            any |= word != 0;
            if word == u32::MAX {
                continue;
            }
            for (b, v) in chunk.iter_mut().enumerate() {
                if word & (1 << b) == 0 {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        for v in logits.iter_mut().skip(self.vocab) {
            *v = f32::NEG_INFINITY;
        }
        any
    }

    /// Advance past `token` (not an end-of-generation token).
    pub fn accept(&mut self, token: u32) -> Result<(), GrammarError> {
        self.matcher.consume_token(token).map_err(|e| GrammarError::Rejected { token, message: e.to_string() })
    }

    /// Whether the output is complete: only an end of generation may follow.
    pub fn is_complete(&self) -> bool {
        self.matcher.is_stopped()
    }

    /// How many of `tokens` (a draft) the constraint accepts in order.
    pub fn accepts(&mut self, tokens: &[u32]) -> usize {
        self.matcher.validate_tokens(tokens).unwrap_or(0)
    }

    /// Whether `token` ends generation.
    pub fn is_end(&self, token: u32) -> bool {
        self.end_of_generation.contains(&token)
    }
}

//! Every check of a request before it reaches the engine: fields in range, the prompt
//! and `max_tokens` within the context and the KV pool, constraints refused; the result
//! is the engine's sampling parameters and the answer's settings.

use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::Value;

use super::Loaded;
use super::protocol::*;
use crate::engine::SamplingParams;
use crate::engine::grammar::{Constraint, GrammarSpec};
use crate::engine::scheduler::{BLOCK_TOKENS, blocks_for, positions_for};

/// Token ids from a request, each inside the vocabulary.
pub(super) fn check_ids(ids: &[i64], vocab: usize, param: &'static str) -> Result<Vec<u32>, ApiError> {
    ids.iter()
        .map(|&id| {
            u32::try_from(id)
                .ok()
                .filter(|&i| (i as usize) < vocab)
                .ok_or_else(|| ApiError::bad(param, format!("token id {id} is outside the vocabulary of {vocab}")))
        })
        .collect()
}

/// The output constraint a request asks for (OpenAI's `response_format`, llama-server's
/// `json_schema` and `grammar`, vLLM's `guided_*` and `structured_outputs`, SGLang's
/// `regex` and `ebnf`), compiled for the model; one that cannot be enforced is a 400
/// naming what could not, never unconstrained text.
pub(super) fn constraint_of(r: &GenRequest, l: &Loaded) -> Result<Option<Constraint>, ApiError> {
    let given = |v: &Option<Value>| v.as_ref().is_some_and(|v| !v.is_null());
    let mut asked: Vec<(&'static str, GrammarSpec)> = Vec::new();
    if let Some(f) = r.response_format.as_ref().filter(|f| !f.is_null()) {
        let spec = match f["type"].as_str() {
            Some("text") => None,
            // llama-server also takes a schema beside json_object.
            Some("json_object") => Some(match f.get("schema").filter(|s| !s.is_null()) {
                Some(schema) => GrammarSpec::JsonSchema(schema.clone()),
                None => GrammarSpec::JsonObject,
            }),
            Some("json_schema") => match f["json_schema"].get("schema").or_else(|| f.get("schema")) {
                Some(schema) => Some(GrammarSpec::JsonSchema(schema.clone())),
                None => {
                    return Err(ApiError::bad(
                        "response_format",
                        "response_format json_schema needs json_schema.schema (the schema itself)",
                    ));
                }
            },
            _ => {
                return Err(ApiError::bad(
                    "response_format",
                    format!("response_format type {} is not one of text, json_object, json_schema", f["type"]),
                ));
            }
        };
        asked.extend(spec.map(|s| ("response_format", s)));
    }
    let text = |name: &'static str, v: &Value| -> Result<String, ApiError> {
        v.as_str().map(str::to_owned).ok_or_else(|| ApiError::bad(name, format!("{name} must be a string")))
    };
    let schema = |name: &'static str, v: &Value| -> Result<GrammarSpec, ApiError> {
        match v {
            Value::String(s) => serde_json::from_str(s)
                .map(GrammarSpec::JsonSchema)
                .map_err(|e| ApiError::bad(name, format!("{name} is not valid JSON: {e}"))),
            v => Ok(GrammarSpec::JsonSchema(v.clone())),
        }
    };
    if let Some(v) = r.json_schema.as_ref().filter(|_| given(&r.json_schema)) {
        asked.push(("json_schema", schema("json_schema", v)?));
    }
    if let Some(v) = r.guided_json.as_ref().filter(|_| given(&r.guided_json)) {
        asked.push(("guided_json", schema("guided_json", v)?));
    }
    if let Some(v) = r.grammar.as_ref().filter(|_| given(&r.grammar)) {
        asked.push(("grammar", GrammarSpec::grammar(&text("grammar", v)?)));
    }
    if let Some(v) = r.guided_grammar.as_ref().filter(|_| given(&r.guided_grammar)) {
        asked.push(("guided_grammar", GrammarSpec::grammar(&text("guided_grammar", v)?)));
    }
    if let Some(v) = r.guided_regex.as_ref().filter(|_| given(&r.guided_regex)) {
        asked.push(("guided_regex", GrammarSpec::Regex(text("guided_regex", v)?)));
    }
    let choice = |name: &'static str, v: &Value| -> Result<GrammarSpec, ApiError> {
        let choices: Option<Vec<String>> = v
            .as_array()
            .and_then(|a| a.iter().map(|c| c.as_str().map(|c| serde_json::to_string(c).ok())).collect())
            .and_then(|c: Vec<Option<String>>| c.into_iter().collect());
        match choices {
            Some(c) if !c.is_empty() => Ok(GrammarSpec::Lark(format!("start: {}", c.join(" | ")))),
            _ => Err(ApiError::bad(name, format!("{name} must be a non-empty list of strings"))),
        }
    };
    if let Some(v) = r.guided_choice.as_ref().filter(|_| given(&r.guided_choice)) {
        asked.push(("guided_choice", choice("guided_choice", v)?));
    }
    // SGLang's.
    if let Some(v) = r.regex.as_ref().filter(|_| given(&r.regex)) {
        asked.push(("regex", GrammarSpec::Regex(text("regex", v)?)));
    }
    if let Some(v) = r.ebnf.as_ref().filter(|_| given(&r.ebnf)) {
        asked.push(("ebnf", GrammarSpec::grammar(&text("ebnf", v)?)));
    }
    // vLLM's current form: one object, each kind of constraint a key.
    if let Some(so) = r.structured_outputs.as_ref().filter(|_| given(&r.structured_outputs)) {
        const P: &str = "structured_outputs";
        let o = so.as_object().ok_or_else(|| ApiError::bad(P, "structured_outputs must be an object"))?;
        let before = asked.len();
        let mut no_whitespace = false;
        for (key, v) in o.iter().filter(|(_, v)| !v.is_null()) {
            let flag = |v: &Value| v.as_bool().ok_or_else(|| ApiError::bad(P, format!("{P}.{key} must be a boolean")));
            match key.as_str() {
                "json" => asked.push(("structured_outputs.json", schema("structured_outputs.json", v)?)),
                "regex" => {
                    asked.push(("structured_outputs.regex", GrammarSpec::Regex(text("structured_outputs.regex", v)?)))
                }
                "choice" => asked.push(("structured_outputs.choice", choice("structured_outputs.choice", v)?)),
                "grammar" => asked.push((
                    "structured_outputs.grammar",
                    GrammarSpec::grammar(&text("structured_outputs.grammar", v)?),
                )),
                "json_object" => {
                    if flag(v)? {
                        asked.push(("structured_outputs.json_object", GrammarSpec::JsonObject));
                    }
                }
                // How vLLM picks its backend: every constraint here is enforced.
                "disable_fallback" => {
                    flag(v)?;
                }
                "disable_any_whitespace" => no_whitespace = flag(v)?,
                // vLLM's default; `true` (objects closed unless the schema says) is not done here.
                "disable_additional_properties" if !flag(v)? => {}
                other => {
                    return Err(ApiError::bad(
                        P,
                        format!(
                            "structured_outputs.{other} is not supported (supported: json, regex, choice, \
                             grammar, json_object, disable_fallback, disable_any_whitespace, \
                             disable_additional_properties false)"
                        ),
                    ));
                }
            }
        }
        if asked.len() == before {
            return Err(ApiError::bad(
                P,
                "structured_outputs names no constraint (json, regex, choice, grammar or json_object)",
            ));
        }
        // JSON is compact unless the schema's `x-guidance` asks for free whitespace; this
        // flag overrides the schema.
        for (_, spec) in &mut asked[before..] {
            if let GrammarSpec::JsonSchema(Value::Object(o)) = spec
                && no_whitespace
            {
                let g = o.entry("x-guidance").or_insert_with(|| serde_json::json!({}));
                if let Some(g) = g.as_object_mut() {
                    g.insert("whitespace_flexible".into(), Value::Bool(false));
                }
            }
        }
    }
    // vLLM's older whitespace option cannot be honoured; its backend choice is moot.
    if given(&r.guided_whitespace_pattern) {
        return Err(ApiError::bad("guided_whitespace_pattern", "guided_whitespace_pattern is not supported"));
    }
    let (name, spec) = match asked.len() {
        0 => return Ok(None),
        1 => asked.pop().expect("one"),
        _ => {
            let names: Vec<&str> = asked.iter().map(|a| a.0).collect();
            return Err(ApiError::bad(asked[1].0, format!("give one output constraint, got {}", names.join(" and "))));
        }
    };
    let grammars = l.grammars.as_ref().map_err(|e| ApiError::bad(name, e.to_string()))?;
    grammars.compile(&spec).map(Some).map_err(|e| ApiError::bad(name, format!("{name} cannot be enforced: {e}")))
}

/// What is left of a request once checked: the job's fields and how to answer.
pub(super) struct Checked {
    pub(super) prompt: Vec<u32>,
    pub(super) max_tokens: usize,
    pub(super) sampling: SamplingParams,
    pub(super) logprobs: Option<usize>,
    /// Score the prompt too (completions' `echo` with `logprobs`).
    pub(super) prompt_logprobs: Option<usize>,
    pub(super) stops: Vec<String>,
    pub(super) stream: bool,
    pub(super) include_usage: bool,
    pub(super) ignore_eos: bool,
    /// Structured output.
    pub(super) constraint: Option<Constraint>,
}

pub(super) fn number(
    v: Option<f64>,
    param: &'static str,
    default: f64,
    ok: impl Fn(f64) -> bool,
    range: &str,
) -> Result<f64, ApiError> {
    match v {
        None => Ok(default),
        Some(x) if x.is_finite() && ok(x) => Ok(x),
        Some(x) => Err(ApiError::bad(param, format!("{param} must be {range}, got {x}"))),
    }
}

/// The longest stop sequence accepted.
pub(super) const MAX_STOP_BYTES: usize = 1024;

/// The checks both endpoints share, after each has built its prompt ids. `max_tokens`
/// may be 0 when the prompt is scored (`prompt_logprobs`): nothing is generated then.
pub(super) fn check_common(
    r: &GenRequest,
    l: &Loaded,
    prompt: Vec<u32>,
    logprobs: Option<usize>,
    prompt_logprobs: Option<usize>,
    default_max: Option<usize>,
) -> Result<Checked, ApiError> {
    if let Some(n) = r.n
        && n != 1
    {
        return Err(ApiError::bad("n", format!("n must be 1 (one choice per request), got {n}")));
    }
    let n_ctx = l.info.context_length;
    // Scoring a prompt without generating may fill the whole context.
    let score_only = prompt_logprobs.is_some() && r.max_tokens.or(r.max_completion_tokens) == Some(0);
    if prompt.len() > n_ctx || (prompt.len() == n_ctx && !score_only) {
        return Err(ApiError::bad(
            "prompt",
            format!(
                "the prompt is {} tokens but the context is {n_ctx}; it must leave room for one new token",
                prompt.len()
            ),
        ));
    }
    let pool_positions = l.scheduler.total_blocks() * BLOCK_TOKENS;
    if prompt.len() > pool_positions {
        return Err(ApiError::bad(
            "prompt",
            format!(
                "the prompt is {} tokens but the server's KV pool holds {pool_positions} (-c {})",
                prompt.len(),
                l.scheduler.ctx_size
            ),
        ));
    }
    let room = n_ctx - prompt.len();
    let max_tokens = match r.max_tokens.or(r.max_completion_tokens) {
        Some(0) if prompt_logprobs.is_some() => 0,
        Some(m) if m < 1 => {
            let what = if m == 0 { " (0 only with echo and logprobs: scoring the prompt)" } else { "" };
            return Err(ApiError::bad("max_tokens", format!("max_tokens must be at least 1{what}, got {m}")));
        }
        Some(m) if m as u64 > room as u64 => {
            return Err(ApiError::bad(
                "max_tokens",
                format!(
                    "the prompt ({} tokens) plus max_tokens ({m}) exceed the context of {n_ctx} tokens",
                    prompt.len()
                ),
            ));
        }
        Some(m) => m as usize,
        // Unasked, at most what the pool can hold beside the prompt.
        None => default_max
            .unwrap_or(room)
            .min(room)
            .min((l.scheduler.total_blocks() * BLOCK_TOKENS + 1).saturating_sub(prompt.len()))
            .max(1),
    };
    let pool = l.scheduler.total_blocks();
    let need = blocks_for(positions_for(prompt.len(), max_tokens));
    if need > pool {
        return Err(ApiError::bad(
            "max_tokens",
            format!(
                "the prompt plus max_tokens need {} KV positions but the server's pool holds {} (-c {})",
                need * BLOCK_TOKENS,
                pool * BLOCK_TOKENS,
                l.scheduler.ctx_size
            ),
        ));
    }
    // Unset fields take the defaults the CLI has (llama.cpp's, as llama-server's API).
    let d = SamplingParams::default();
    // Finite numbers here; their ranges are the CLI's (SamplingParams::validate).
    let finite = |_: f64| true;
    let temperature = number(r.temperature, "temperature", d.temperature.into(), finite, "finite")?;
    let top_p = number(r.top_p, "top_p", d.top_p.into(), finite, "finite")?;
    let min_p = number(r.min_p, "min_p", d.min_p.into(), finite, "finite")?;
    let repeat = number(r.repeat_penalty, "repeat_penalty", d.repeat_penalty.into(), finite, "finite")?;
    let presence = number(r.presence_penalty, "presence_penalty", d.presence_penalty.into(), finite, "finite")?;
    let frequency = number(r.frequency_penalty, "frequency_penalty", d.frequency_penalty.into(), finite, "finite")?;
    // llama-server's field: 0 = off, -1 = the whole context.
    let repeat_last_n = match r.repeat_last_n {
        None => d.repeat_last_n,
        Some(-1) => n_ctx,
        Some(n) if n >= 0 => usize::try_from(n).unwrap_or(usize::MAX),
        Some(n) => {
            let e = format!("repeat_last_n must be >= -1 (0 = off, -1 = the whole context), got {n}");
            return Err(ApiError::bad("repeat_last_n", e));
        }
    };
    let top_k = match r.top_k {
        None => d.top_k.min(l.info.vocab_size),
        Some(k) if k >= 0 => k.min(l.info.vocab_size as i64) as usize,
        Some(k) => return Err(ApiError::bad("top_k", format!("top_k must be >= 0 (0 = off), got {k}"))),
    };
    let stops = match &r.stop {
        None => Vec::new(),
        Some(Stop::One(s)) => vec![s.clone()],
        Some(Stop::Many(v)) => v.clone(),
    };
    if stops.len() > 4 {
        return Err(ApiError::bad("stop", format!("at most 4 stop sequences, got {}", stops.len())));
    }
    if stops.iter().any(|s| s.is_empty() || s.len() > MAX_STOP_BYTES) {
        return Err(ApiError::bad("stop", format!("a stop sequence must have 1 to {MAX_STOP_BYTES} bytes")));
    }
    // As the CLI's -s: -1 (or none) draws one.
    let seed = match r.seed {
        None | Some(-1) => SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64),
        Some(s) if s >= 0 => s as u64,
        Some(s) => {
            return Err(ApiError::bad("seed", format!("seed must be >= 0, or -1 for a random one, got {s}")));
        }
    };
    let sampling = SamplingParams {
        temperature: temperature as f32,
        top_k,
        top_p: top_p as f32,
        min_p: min_p as f32,
        repeat_penalty: repeat as f32,
        repeat_last_n,
        presence_penalty: presence as f32,
        frequency_penalty: frequency as f32,
        seed,
    };
    sampling.validate().map_err(|e| ApiError::bad(e.field.api_name(), e.api_message()))?;
    Ok(Checked {
        prompt,
        max_tokens,
        sampling,
        logprobs,
        prompt_logprobs,
        stops,
        stream: r.stream.unwrap_or(false),
        include_usage: r.stream_options.as_ref().and_then(|o| o.include_usage).unwrap_or(false),
        ignore_eos: r.ignore_eos.unwrap_or(false),
        constraint: constraint_of(r, l)?,
    })
}

//! Every check of a request before it reaches the engine: fields in range, the prompt
//! and `max_tokens` within the context and the KV pool, constraints refused; the result
//! is the engine's sampling parameters and the answer's settings.

use std::time::{SystemTime, UNIX_EPOCH};

use super::Loaded;
use super::protocol::*;
use crate::engine::SamplingParams;
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

/// A request that asks for constrained output is refused (400) rather than answered with
/// unconstrained text: structured output is not implemented.
pub(super) fn refuse_constraints(r: &GenRequest) -> Result<(), ApiError> {
    if let Some(f) = &r.response_format
        && !f.is_null()
        && f["type"] != "text"
    {
        return Err(ApiError::bad(
            "response_format",
            format!("response_format {} is not supported: this server does not enforce output formats", f["type"]),
        ));
    }
    let fields = [
        ("grammar", &r.grammar),
        ("json_schema", &r.json_schema),
        ("guided_json", &r.guided_json),
        ("guided_regex", &r.guided_regex),
        ("guided_choice", &r.guided_choice),
        ("guided_grammar", &r.guided_grammar),
    ];
    if let Some((name, _)) = fields.iter().find(|(_, v)| v.as_ref().is_some_and(|v| !v.is_null())) {
        return Err(ApiError::bad(
            name,
            format!("{name} is not supported: this server does not enforce output constraints"),
        ));
    }
    Ok(())
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
    let temperature =
        number(r.temperature, "temperature", d.temperature.into(), |x| (0.0..=100.0).contains(&x), "in [0, 100]")?;
    let top_p = number(r.top_p, "top_p", d.top_p.into(), |x| x > 0.0 && x <= 1.0, "in (0, 1]")?;
    let min_p = number(r.min_p, "min_p", d.min_p.into(), |x| (0.0..=1.0).contains(&x), "in [0, 1]")?;
    let repeat = number(r.repeat_penalty, "repeat_penalty", 1.0, |x| x > 0.0 && x <= 100.0, "in (0, 100]")?;
    let presence = number(r.presence_penalty, "presence_penalty", 0.0, |x| (-2.0..=2.0).contains(&x), "in [-2, 2]")?;
    let frequency = number(r.frequency_penalty, "frequency_penalty", 0.0, |x| (-2.0..=2.0).contains(&x), "in [-2, 2]")?;
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
    let seed = r
        .seed
        .map_or_else(|| SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64), |s| s as u64);
    let sampling = SamplingParams {
        temperature: temperature as f32,
        top_k,
        top_p: top_p as f32,
        min_p: min_p as f32,
        repeat_penalty: repeat as f32,
        repeat_last_n: d.repeat_last_n,
        presence_penalty: presence as f32,
        frequency_penalty: frequency as f32,
        seed,
    };
    sampling.validate().map_err(|e| ApiError::bad("temperature", e))?;
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
    })
}

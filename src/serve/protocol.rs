//! OpenAI's wire shapes: the request bodies the server accepts, its error JSON, and the
//! log-probability objects of completions and chat answers.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Deserialize;
use serde_json::{Value, json};

use crate::engine::TokenLogprobs;
use crate::engine::scheduler::Finish;
use crate::engine::text::{TextOut, TokenOut};

/// An error in OpenAI's shape.
pub struct ApiError {
    pub(super) status: StatusCode,
    pub(super) message: String,
    pub(super) param: Option<&'static str>,
}

impl ApiError {
    pub fn bad(param: &'static str, message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), param: Some(param) }
    }
    pub(super) fn status(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), param: None }
    }
    pub(super) fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "unavailable_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }
    pub(super) fn body(&self) -> Value {
        json!({"error": {
            "message": self.message,
            "type": self.kind(),
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::SERVICE_UNAVAILABLE {
            // Loading or draining: the client should reconnect, through its load
            // balancer, rather than retry on this replica's kept-alive connection.
            response
                .headers_mut()
                .insert(axum::http::header::CONNECTION, axum::http::HeaderValue::from_static("close"));
        }
        response
    }
}

pub(super) type ApiResult = Result<Response, ApiError>;

#[derive(Deserialize)]
pub(super) struct TokenizeRequest {
    pub(super) content: String,
    #[serde(default)]
    pub(super) add_special: bool,
    #[serde(default)]
    pub(super) with_pieces: bool,
}

#[derive(Deserialize)]
pub(super) struct DetokenizeRequest {
    pub(super) tokens: Vec<i64>,
}

/// A prompt: text, or token ids.
#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum Prompt {
    Text(String),
    Ids(Vec<i64>),
    Texts(Vec<String>),
}

#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(untagged)]
pub(super) enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
pub(super) struct ContentPart {
    #[serde(rename = "type")]
    pub(super) kind: String,
    #[serde(default)]
    pub(super) text: Option<String>,
}

#[derive(Deserialize)]
pub(super) struct ChatMessage {
    pub(super) role: String,
    #[serde(default)]
    pub(super) content: Option<Content>,
}

#[derive(Deserialize)]
pub(super) struct StreamOptions {
    #[serde(default)]
    pub(super) include_usage: Option<bool>,
}

/// The fields of both endpoints (each checks the ones that are its own).
#[derive(Deserialize)]
pub(super) struct GenRequest {
    #[serde(default)]
    pub(super) prompt: Option<Prompt>,
    #[serde(default)]
    pub(super) messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    pub(super) max_tokens: Option<i64>,
    #[serde(default)]
    pub(super) max_completion_tokens: Option<i64>,
    #[serde(default)]
    pub(super) temperature: Option<f64>,
    #[serde(default)]
    pub(super) top_p: Option<f64>,
    #[serde(default)]
    pub(super) top_k: Option<i64>,
    #[serde(default)]
    pub(super) min_p: Option<f64>,
    #[serde(default)]
    pub(super) repeat_penalty: Option<f64>,
    /// How many recent tokens the repeat penalty considers: 0 = off, -1 = the context.
    #[serde(default)]
    pub(super) repeat_last_n: Option<i64>,
    #[serde(default)]
    pub(super) seed: Option<i64>,
    #[serde(default)]
    pub(super) stop: Option<Stop>,
    #[serde(default)]
    pub(super) stream: Option<bool>,
    #[serde(default)]
    pub(super) stream_options: Option<StreamOptions>,
    /// Completions: an integer 0..=20; chat: a boolean.
    #[serde(default)]
    pub(super) logprobs: Option<Value>,
    #[serde(default)]
    pub(super) top_logprobs: Option<i64>,
    #[serde(default)]
    pub(super) echo: Option<bool>,
    #[serde(default)]
    pub(super) n: Option<i64>,
    #[serde(default)]
    pub(super) presence_penalty: Option<f64>,
    #[serde(default)]
    pub(super) frequency_penalty: Option<f64>,
    #[serde(default)]
    pub(super) user: Option<String>,
    #[serde(default)]
    pub(super) ignore_eos: Option<bool>,
    #[serde(default)]
    pub(super) suffix: Option<String>,
    /// Output constraints (structured output, [`super::validate::constraint_of`]):
    /// OpenAI's `response_format` (`text` is no constraint), llama-server's `grammar`
    /// and `json_schema`, vLLM's `guided_*` and `structured_outputs`, SGLang's `regex`
    /// and `ebnf`.
    #[serde(default)]
    pub(super) response_format: Option<Value>,
    #[serde(default)]
    pub(super) grammar: Option<Value>,
    #[serde(default)]
    pub(super) json_schema: Option<Value>,
    #[serde(default)]
    pub(super) guided_json: Option<Value>,
    #[serde(default)]
    pub(super) guided_regex: Option<Value>,
    #[serde(default)]
    pub(super) guided_choice: Option<Value>,
    #[serde(default)]
    pub(super) guided_grammar: Option<Value>,
    #[serde(default)]
    pub(super) guided_whitespace_pattern: Option<Value>,
    #[serde(default)]
    pub(super) structured_outputs: Option<Value>,
    #[serde(default)]
    pub(super) regex: Option<Value>,
    #[serde(default)]
    pub(super) ebnf: Option<Value>,
}

/// Completions' logprobs object for `tokens`.
/// Completions' `top_logprobs` entry: piece → log-probability, the most likely first.
pub(super) fn top_map(out: &TextOut, top: &[(u32, f64)]) -> Value {
    let mut map = serde_json::Map::new();
    for &(id, v) in top {
        map.entry(out.piece(id)).or_insert(json!(v));
    }
    Value::Object(map)
}

pub(super) fn completion_logprobs(out: &TextOut, tokens: &[TokenOut], base_chars: usize, text: &str) -> Value {
    let mut toks = Vec::new();
    let mut lps = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    for t in tokens {
        let Some(lp) = &t.logprobs else { continue };
        toks.push(json!(out.piece(t.id)));
        lps.push(json!(lp.logprob));
        tops.push(top_map(out, &lp.top));
        let off = text.get(..t.offset).map_or(0, |s| s.chars().count());
        offsets.push(json!(base_chars + off));
    }
    json!({"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

/// Each prompt token's start in `echo`, in characters: the tokens' bytes laid over the
/// echoed text, right-aligned, so tokens the tokenizer put before the text (a BOS) start
/// at 0; never past the text's end, where the generated tokens' offsets begin.
pub(super) fn prompt_offsets(lens: &[usize], echo: &str) -> Vec<usize> {
    let text = echo.as_bytes();
    let skip = lens.iter().sum::<usize>().saturating_sub(text.len());
    let (mut at, mut byte, mut chars) = (0usize, 0usize, 0usize);
    let mut offsets = Vec::with_capacity(lens.len());
    for &len in lens {
        let target = at.saturating_sub(skip).min(text.len());
        while byte < target {
            chars += usize::from(text[byte] & 0xC0 != 0x80); // a character starts here
            byte += 1;
        }
        offsets.push(chars);
        at += len;
    }
    offsets
}

/// The completions logprobs object for an echoed, scored prompt: every prompt token, the
/// first with `null` log-probabilities (nothing comes before it), the rest with their
/// scores from the scheduler; `text_offset`s are positions in the echoed text.
pub(super) fn prompt_logprobs_json(out: &TextOut, prompt: &[u32], scored: &[TokenLogprobs], echo: &str) -> Value {
    let (mut toks, mut lps, mut tops) = (Vec::new(), Vec::new(), Vec::new());
    let lens: Vec<usize> = prompt.iter().map(|&id| out.token_bytes(id).len()).collect();
    let offsets = prompt_offsets(&lens, echo);
    for (i, &id) in prompt.iter().enumerate() {
        let piece = out.piece(id);
        toks.push(json!(piece));
        match i.checked_sub(1).and_then(|j| scored.get(j)) {
            Some(lp) => {
                lps.push(json!(lp.logprob));
                tops.push(top_map(out, &lp.top));
            }
            None => {
                lps.push(Value::Null);
                tops.push(Value::Null);
            }
        }
    }
    json!({"tokens": toks, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

/// `a` followed by `b`, field by field (two completions logprobs objects).
pub(super) fn join_logprobs(mut a: Value, b: &Value) -> Value {
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        if let (Some(x), Some(y)) = (a[key].as_array_mut(), b[key].as_array()) {
            x.extend(y.iter().cloned());
        }
    }
    a
}

/// Chat's logprobs object (`content` entries) for `tokens`.
pub(super) fn chat_logprobs(out: &TextOut, tokens: &[TokenOut]) -> Value {
    let content: Vec<Value> = tokens
        .iter()
        .filter_map(|t| {
            let lp = t.logprobs.as_ref()?;
            let top: Vec<Value> = lp
                .top
                .iter()
                .map(|&(id, v)| json!({"token": out.piece(id), "logprob": v, "bytes": out.token_bytes(id)}))
                .collect();
            Some(json!({"token": out.piece(t.id), "logprob": lp.logprob, "bytes": out.token_bytes(t.id), "top_logprobs": top}))
        })
        .collect();
    json!({ "content": content })
}

pub(super) fn finish_name(f: Option<Finish>, stopped: bool) -> &'static str {
    match (f, stopped) {
        (_, true) | (Some(Finish::Eos), _) => "stop",
        _ => "length",
    }
}

#[cfg(test)]
mod tests {
    use super::prompt_offsets;

    /// Prompt offsets are positions in the echoed text: tokens before the text (a BOS
    /// the tokenizer added) start at 0, a character split over tokens counts once, and
    /// nothing points past the text.
    #[test]
    fn prompt_offsets_are_positions_in_the_echo() {
        // "<s>" + "Hello" + " world" over the text "Hello world".
        assert_eq!(prompt_offsets(&[3, 5, 6], "Hello world"), [0, 0, 5]);
        assert_eq!(prompt_offsets(&[5, 6], "Hello world"), [0, 5]);
        // "é" is two bytes, split over two tokens, then "!".
        assert_eq!(prompt_offsets(&[1, 1, 1], "é!"), [0, 1, 1]);
        assert_eq!(prompt_offsets(&[1, 2], "é!"), [0, 1]);
        // More text than tokens (the echo is what was sent): still inside it.
        assert_eq!(prompt_offsets(&[2, 2], "abcdef"), [0, 2]);
        assert!(prompt_offsets(&[], "x").is_empty());
    }
}

//! The HTTP API (axum): OpenAI's `/v1/completions`, `/v1/chat/completions` and
//! `/v1/models`, plus `/health`, `/metrics`, `/tokenize` and `/detokenize`.
//!
//! Every request is checked in full before it reaches the scheduler; an invalid field
//! is a 400 in OpenAI's error JSON naming it, a missing or wrong API key a 401, a full
//! queue a 429, a model still loading a 503, an unknown route a 404. Bodies are parsed
//! here (not by an extractor), so a malformed body is a 400 with the parser's message.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{StatusCode, header};
use axum::middleware::Next;
use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::mpsc;
use tokio_stream::StreamExt;
use tokio_stream::wrappers::ReceiverStream;

use super::Job;
use super::{AppState, Loaded};
use crate::chat::Message;
use crate::engine::scheduler::{BLOCK_TOKENS, Event, Finish, Request as EngineRequest, blocks_for, positions_for};
use crate::engine::text::{TextOut, TokenOut};
use crate::engine::{SamplingParams, TokenLogprobs};

/// An error in OpenAI's shape.
pub struct ApiError {
    status: StatusCode,
    message: String,
    param: Option<&'static str>,
}

impl ApiError {
    pub fn bad(param: &'static str, message: impl Into<String>) -> Self {
        ApiError { status: StatusCode::BAD_REQUEST, message: message.into(), param: Some(param) }
    }
    fn status(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError { status, message: message.into(), param: None }
    }
    fn kind(&self) -> &'static str {
        match self.status {
            StatusCode::UNAUTHORIZED => "authentication_error",
            StatusCode::NOT_FOUND => "not_found_error",
            StatusCode::TOO_MANY_REQUESTS => "rate_limit_error",
            StatusCode::SERVICE_UNAVAILABLE => "unavailable_error",
            s if s.is_server_error() => "server_error",
            _ => "invalid_request_error",
        }
    }
    fn body(&self) -> Value {
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
        (self.status, axum::Json(self.body())).into_response()
    }
}

type ApiResult = Result<Response, ApiError>;

pub fn router(state: Arc<AppState>) -> Router {
    let open = Router::new().route("/health", get(health));
    let guarded = Router::new()
        .route("/v1/completions", post(completions))
        .route("/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/metrics", get(metrics))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route_layer(axum::middleware::from_fn_with_state(state.clone(), auth));
    open.merge(guarded)
        .fallback(|| async { ApiError::status(StatusCode::NOT_FOUND, "no such route") })
        .method_not_allowed_fallback(|| async {
            ApiError::status(StatusCode::METHOD_NOT_ALLOWED, "this route does not take that method")
        })
        .with_state(state)
}

async fn auth(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &state.config.api_key {
        let given = req.headers().get(header::AUTHORIZATION).and_then(|v| v.to_str().ok());
        let ok = given.and_then(|v| v.strip_prefix("Bearer ")).is_some_and(|g| constant_time_eq(g.trim(), key));
        if !ok {
            state.metrics.requests_rejected.fetch_add(1, Ordering::Relaxed);
            return ApiError::status(
                StatusCode::UNAUTHORIZED,
                "invalid or missing API key (Authorization: Bearer KEY)",
            )
            .into_response();
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &str, b: &str) -> bool {
    a.len() == b.len() && a.bytes().zip(b.bytes()).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

fn loaded(state: &AppState) -> Result<&Loaded, ApiError> {
    state.loaded.get().ok_or_else(|| ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "the model is loading"))
}

async fn health(State(state): State<Arc<AppState>>) -> Response {
    match state.loaded.get() {
        Some(_) => axum::Json(json!({"status": "ok"})).into_response(),
        None => ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "the model is loading").into_response(),
    }
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], state.metrics.render()).into_response()
}

async fn models(State(state): State<Arc<AppState>>) -> ApiResult {
    let l = loaded(&state)?;
    Ok(axum::Json(json!({
        "object": "list",
        "data": [{
            "id": state.config.model_name,
            "object": "model",
            "created": l.created,
            "owned_by": "batch_forge",
            "meta": {
                "architecture": l.info.architecture,
                "n_vocab": l.info.vocab_size,
                "n_ctx_train": l.info.context_length,
                "n_params": l.info.n_params,
            },
        }],
    }))
    .into_response())
}

/// Request bodies past this many bytes are refused with 413.
const MAX_BODY: usize = 2 << 20;
/// How much of a refused body is still read (and dropped) before the 413 is sent, so a
/// client that is still sending reads the answer instead of a broken pipe (nginx's
/// "lingering close"). A body declared larger than this is refused without reading.
const DRAIN_LIMIT: usize = 64 << 20;

fn too_large() -> ApiError {
    ApiError {
        status: StatusCode::PAYLOAD_TOO_LARGE,
        message: format!("the request body is over the limit of {MAX_BODY} bytes"),
        param: Some("body"),
    }
}

/// The request body, up to [`MAX_BODY`] bytes; 413 past it (also when it is too slow
/// while being drained), 408 when a body within the limit does not arrive within
/// `timeout` (`--timeout`).
async fn read_body(body: Body, declared: Option<u64>, timeout: std::time::Duration) -> Result<Bytes, ApiError> {
    let mut total = 0usize;
    // Room for the declared length up front, so the buffer never doubles past the limit.
    let mut buf = Vec::with_capacity(declared.map_or(0, |n| n.min(MAX_BODY as u64) as usize));
    let read = async {
        let mut stream = body.into_data_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| ApiError::bad("body", format!("reading the request body: {e}")))?;
            total = total.saturating_add(chunk.len());
            if total <= MAX_BODY {
                buf.extend_from_slice(&chunk);
            } else if total > DRAIN_LIMIT {
                break;
            }
        }
        Ok::<(), ApiError>(())
    };
    let done = tokio::time::timeout(timeout, read).await;
    if total > MAX_BODY {
        return Err(too_large());
    }
    match done {
        Err(_) => Err(ApiError::status(StatusCode::REQUEST_TIMEOUT, "the request body came too slowly")),
        Ok(Err(e)) => Err(e),
        Ok(Ok(())) => Ok(Bytes::from(buf)),
    }
}

/// The body of `req`, refused at once when its declared length is past [`DRAIN_LIMIT`].
async fn body_of(state: &AppState, req: Request) -> Result<Bytes, ApiError> {
    let declared = req.headers().get(header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse::<u64>().ok());
    if declared.is_some_and(|n| n > DRAIN_LIMIT as u64) {
        return Err(too_large());
    }
    read_body(req.into_body(), declared, state.config.timeout).await
}

fn parse<T: for<'de> Deserialize<'de>>(body: &Bytes) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|e| ApiError::bad("body", format!("invalid JSON body: {e}")))
}

#[derive(Deserialize)]
struct TokenizeRequest {
    content: String,
    #[serde(default)]
    add_special: bool,
    #[serde(default)]
    with_pieces: bool,
}

async fn tokenize(State(state): State<Arc<AppState>>, req: Request) -> ApiResult {
    let body = body_of(&state, req).await?;
    let l = loaded(&state)?;
    let r: TokenizeRequest = parse(&body)?;
    let ids = if r.add_special {
        crate::engine::prompt_ids(&l.tokenizer, None, &r.content)
    } else {
        l.tokenizer.encode(&r.content)
    };
    let tokens: Vec<Value> = if r.with_pieces {
        ids.iter()
            .map(|&id| {
                let bytes = l.tokenizer.token_bytes(id).unwrap_or(&[]);
                let piece = match std::str::from_utf8(bytes) {
                    Ok(s) => json!(s),
                    Err(_) => json!(bytes),
                };
                json!({"id": id, "piece": piece})
            })
            .collect()
    } else {
        ids.iter().map(|&id| json!(id)).collect()
    };
    Ok(axum::Json(json!({ "tokens": tokens })).into_response())
}

#[derive(Deserialize)]
struct DetokenizeRequest {
    tokens: Vec<i64>,
}

async fn detokenize(State(state): State<Arc<AppState>>, req: Request) -> ApiResult {
    let body = body_of(&state, req).await?;
    let l = loaded(&state)?;
    let r: DetokenizeRequest = parse(&body)?;
    let ids = check_ids(&r.tokens, l.tokenizer.vocab_size(), "tokens")?;
    let text = l.tokenizer.decode(&ids).map_err(|e| ApiError::bad("tokens", e.to_string()))?;
    Ok(axum::Json(json!({ "content": text })).into_response())
}

fn check_ids(ids: &[i64], vocab: usize, param: &'static str) -> Result<Vec<u32>, ApiError> {
    ids.iter()
        .map(|&id| {
            u32::try_from(id)
                .ok()
                .filter(|&i| (i as usize) < vocab)
                .ok_or_else(|| ApiError::bad(param, format!("token id {id} is outside the vocabulary of {vocab}")))
        })
        .collect()
}

/// A prompt: text, or token ids.
#[derive(Deserialize)]
#[serde(untagged)]
enum Prompt {
    Text(String),
    Ids(Vec<i64>),
    Texts(Vec<String>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct ChatMessage {
    role: String,
    #[serde(default)]
    content: Option<Content>,
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

/// The fields of both endpoints (each checks the ones that are its own).
#[derive(Deserialize)]
struct GenRequest {
    #[serde(default)]
    prompt: Option<Prompt>,
    #[serde(default)]
    messages: Option<Vec<ChatMessage>>,
    #[serde(default)]
    max_tokens: Option<i64>,
    #[serde(default)]
    max_completion_tokens: Option<i64>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    top_k: Option<i64>,
    #[serde(default)]
    min_p: Option<f64>,
    #[serde(default)]
    repeat_penalty: Option<f64>,
    #[serde(default)]
    seed: Option<i64>,
    #[serde(default)]
    stop: Option<Stop>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    /// Completions: an integer 0..=20; chat: a boolean.
    #[serde(default)]
    logprobs: Option<Value>,
    #[serde(default)]
    top_logprobs: Option<i64>,
    #[serde(default)]
    echo: Option<bool>,
    #[serde(default)]
    n: Option<i64>,
    #[serde(default)]
    presence_penalty: Option<f64>,
    #[serde(default)]
    frequency_penalty: Option<f64>,
    #[serde(default)]
    user: Option<String>,
    #[serde(default)]
    ignore_eos: Option<bool>,
    #[serde(default)]
    suffix: Option<String>,
    /// Output constraints, refused until they are enforced: OpenAI's `response_format`
    /// (`text` is no constraint), llama-server's `grammar` and `json_schema`, vLLM's
    /// `guided_*`.
    #[serde(default)]
    response_format: Option<Value>,
    #[serde(default)]
    grammar: Option<Value>,
    #[serde(default)]
    json_schema: Option<Value>,
    #[serde(default)]
    guided_json: Option<Value>,
    #[serde(default)]
    guided_regex: Option<Value>,
    #[serde(default)]
    guided_choice: Option<Value>,
    #[serde(default)]
    guided_grammar: Option<Value>,
}

/// A request that asks for constrained output is refused (400) rather than answered with
/// unconstrained text: structured output is not implemented.
fn refuse_constraints(r: &GenRequest) -> Result<(), ApiError> {
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
struct Checked {
    prompt: Vec<u32>,
    max_tokens: usize,
    sampling: SamplingParams,
    logprobs: Option<usize>,
    /// Score the prompt too (completions' `echo` with `logprobs`).
    prompt_logprobs: Option<usize>,
    stops: Vec<String>,
    stream: bool,
    include_usage: bool,
    ignore_eos: bool,
}

fn number(
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
const MAX_STOP_BYTES: usize = 1024;

/// The checks both endpoints share, after each has built its prompt ids. `max_tokens`
/// may be 0 when the prompt is scored (`prompt_logprobs`): nothing is generated then.
fn check_common(
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

/// The request's place in the queue: released when the answer is done.
struct Slot(Arc<AppState>);

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::Relaxed);
    }
}

/// Queue the job; a full queue is a 429.
fn submit(
    state: &Arc<AppState>,
    l: &Loaded,
    c: &Checked,
) -> Result<(mpsc::UnboundedReceiver<Event>, Slot, u64), ApiError> {
    let limit = l.scheduler.parallel + state.config.max_queue;
    if state.in_flight.fetch_add(1, Ordering::Relaxed) >= limit {
        state.in_flight.fetch_sub(1, Ordering::Relaxed);
        return Err(ApiError::status(
            StatusCode::TOO_MANY_REQUESTS,
            format!("the server is busy ({limit} requests running or queued); retry later"),
        ));
    }
    let slot = Slot(state.clone());
    let (tx, rx) = mpsc::unbounded_channel();
    let id = state.next_id.fetch_add(1, Ordering::Relaxed);
    let request = EngineRequest {
        id,
        prompt: c.prompt.clone(),
        max_tokens: c.max_tokens,
        sampling: c.sampling.clone(),
        logprobs: c.logprobs,
        prompt_logprobs: c.prompt_logprobs,
        ignore_eos: c.ignore_eos,
        session: None,
        arrived: Instant::now(),
    };
    let job = Job { request, events: tx };
    l.jobs.send(job).map_err(|_| ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "the server is shutting down"))?;
    Ok((rx, slot, id))
}

fn unix_now() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Api {
    Completions,
    Chat,
}

async fn completions(State(state): State<Arc<AppState>>, req: Request) -> ApiResult {
    generation(state, req, Api::Completions).await
}

async fn chat_completions(State(state): State<Arc<AppState>>, req: Request) -> ApiResult {
    generation(state, req, Api::Chat).await
}

/// Either endpoint, with refusals counted.
async fn generation(state: Arc<AppState>, req: Request, api: Api) -> ApiResult {
    let result = match (body_of(&state, req).await, api) {
        (Err(e), _) => Err(e),
        (Ok(body), Api::Completions) => completions_inner(&state, &body).await,
        (Ok(body), Api::Chat) => chat_inner(&state, &body).await,
    };
    if result.is_err() {
        state.metrics.requests_rejected.fetch_add(1, Ordering::Relaxed);
    }
    result
}

/// A generation the scheduler failed: 503 when the server is shutting down, else 500.
fn generation_failed(state: &AppState, message: String) -> ApiError {
    let status = if state.stop.load(Ordering::Relaxed) {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::INTERNAL_SERVER_ERROR
    };
    ApiError::status(status, message)
}

async fn completions_inner(state: &Arc<AppState>, body: &Bytes) -> ApiResult {
    let l = loaded(state)?;
    let r: GenRequest = parse(body)?;
    refuse_constraints(&r)?;
    if r.messages.is_some() {
        return Err(ApiError::bad("messages", "messages belong to /v1/chat/completions; use prompt here"));
    }
    if r.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::bad("suffix", "suffix (insertion) is not supported"));
    }
    let vocab = l.info.vocab_size;
    let (prompt, prompt_text) = match &r.prompt {
        None => (crate::engine::prompt_ids(&l.tokenizer, l.info.bos_token_id, ""), String::new()),
        Some(Prompt::Text(t)) => (crate::engine::prompt_ids(&l.tokenizer, l.info.bos_token_id, t), t.clone()),
        Some(Prompt::Texts(v)) if v.len() == 1 => {
            (crate::engine::prompt_ids(&l.tokenizer, l.info.bos_token_id, &v[0]), v[0].clone())
        }
        Some(Prompt::Texts(v)) => {
            return Err(ApiError::bad("prompt", format!("one prompt per request, got {}", v.len())));
        }
        Some(Prompt::Ids(ids)) => {
            let mut ids = check_ids(ids, vocab, "prompt")?;
            if ids.is_empty() {
                ids.extend(l.info.bos_token_id);
            }
            let text = l.tokenizer.decode(&ids).unwrap_or_default();
            (ids, text)
        }
    };
    if prompt.is_empty() {
        return Err(ApiError::bad("prompt", "the prompt is empty and the model has no BOS token to start from"));
    }
    let logprobs = match &r.logprobs {
        None | Some(Value::Null) => None,
        Some(Value::Number(n)) => match n.as_i64() {
            Some(k @ 0..=20) => Some(k as usize),
            _ => return Err(ApiError::bad("logprobs", format!("logprobs must be an integer in 0..=20, got {n}"))),
        },
        Some(v) => return Err(ApiError::bad("logprobs", format!("logprobs must be an integer in 0..=20, got {v}"))),
    };
    let echo = r.echo.unwrap_or(false);
    // echo with logprobs scores the prompt as well (and allows max_tokens 0).
    let prompt_logprobs = if echo { logprobs } else { None };
    let c = check_common(&r, l, prompt, logprobs, prompt_logprobs, Some(16))?;
    let echo_text = if echo { prompt_text } else { String::new() };
    answer(state.clone(), Api::Completions, c, echo_text, r.user).await
}

async fn chat_inner(state: &Arc<AppState>, body: &Bytes) -> ApiResult {
    let l = loaded(state)?;
    let r: GenRequest = parse(body)?;
    refuse_constraints(&r)?;
    if r.prompt.is_some() {
        return Err(ApiError::bad("prompt", "prompt belongs to /v1/completions; use messages here"));
    }
    let Some(messages) = &r.messages else {
        return Err(ApiError::bad("messages", "messages is required"));
    };
    if messages.is_empty() {
        return Err(ApiError::bad("messages", "messages must not be empty"));
    }
    let mut msgs = Vec::with_capacity(messages.len());
    for m in messages {
        let content = match &m.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut s = String::new();
                for p in parts {
                    match (p.kind.as_str(), &p.text) {
                        ("text", Some(t)) => s.push_str(t),
                        (kind, _) => {
                            return Err(ApiError::bad(
                                "messages",
                                format!("content parts of type {kind:?} are not supported"),
                            ));
                        }
                    }
                }
                s
            }
        };
        msgs.push(Message { role: m.role.clone(), content });
    }
    let prompt =
        crate::engine::chat_prompt_ids(&l.tokenizer, l.chat_template.as_ref(), l.chat_template_error.as_deref(), &msgs)
            .map_err(|e| ApiError::bad("messages", format!("{e:#}")))?;
    if prompt.is_empty() {
        return Err(ApiError::bad("messages", "the chat template rendered an empty prompt"));
    }
    let logprobs = match &r.logprobs {
        None | Some(Value::Null) | Some(Value::Bool(false)) => {
            if r.top_logprobs.is_some_and(|k| k > 0) {
                return Err(ApiError::bad("top_logprobs", "top_logprobs needs logprobs: true"));
            }
            None
        }
        Some(Value::Bool(true)) => match r.top_logprobs.unwrap_or(0) {
            k @ 0..=20 => Some(k as usize),
            k => return Err(ApiError::bad("top_logprobs", format!("top_logprobs must be in 0..=20, got {k}"))),
        },
        Some(v) => return Err(ApiError::bad("logprobs", format!("logprobs must be a boolean, got {v}"))),
    };
    let c = check_common(&r, l, prompt, logprobs, None, None)?;
    answer(state.clone(), Api::Chat, c, String::new(), r.user).await
}

/// Completions' logprobs object for `tokens`.
/// Completions' `top_logprobs` entry: piece → log-probability, the most likely first.
fn top_map(out: &TextOut, top: &[(u32, f64)]) -> Value {
    let mut map = serde_json::Map::new();
    for &(id, v) in top {
        map.entry(out.piece(id)).or_insert(json!(v));
    }
    Value::Object(map)
}

fn completion_logprobs(out: &TextOut, tokens: &[TokenOut], base_chars: usize, text: &str) -> Value {
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
fn prompt_offsets(lens: &[usize], echo: &str) -> Vec<usize> {
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
fn prompt_logprobs_json(out: &TextOut, prompt: &[u32], scored: &[TokenLogprobs], echo: &str) -> Value {
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
fn join_logprobs(mut a: Value, b: &Value) -> Value {
    for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
        if let (Some(x), Some(y)) = (a[key].as_array_mut(), b[key].as_array()) {
            x.extend(y.iter().cloned());
        }
    }
    a
}

/// Chat's logprobs object (`content` entries) for `tokens`.
fn chat_logprobs(out: &TextOut, tokens: &[TokenOut]) -> Value {
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

fn finish_name(f: Option<Finish>, stopped: bool) -> &'static str {
    match (f, stopped) {
        (_, true) | (Some(Finish::Eos), _) => "stop",
        _ => "length",
    }
}

/// Run the checked request and answer it, whole or as a stream.
async fn answer(state: Arc<AppState>, api: Api, c: Checked, echo: String, user: Option<String>) -> ApiResult {
    let l = loaded(&state)?;
    let (rx, slot, id) = submit(&state, l, &c)?;
    let prompt_tokens = c.prompt.len();
    tracing::info!(
        id,
        ?api,
        prompt_tokens,
        max_tokens = c.max_tokens,
        stream = c.stream,
        user = user.as_deref(),
        "request"
    );
    let name = state.config.model_name.clone();
    let created = unix_now();
    let rid = match api {
        Api::Completions => format!("cmpl-{id}"),
        Api::Chat => format!("chatcmpl-{id}"),
    };
    if c.stream {
        let (tx, out_rx) = mpsc::channel::<Result<SseEvent, Infallible>>(64);
        tokio::spawn(stream_task(
            state.clone(),
            api,
            c,
            echo,
            rx,
            tx,
            slot,
            Meta { id, rid, name, created, prompt_tokens },
        ));
        // Keep-alive comments make a silent stream (queued, or a long prefill) notice a
        // client that hung up.
        let keep_alive = axum::response::sse::KeepAlive::new().interval(std::time::Duration::from_secs(1));
        let sse = Sse::new(ReceiverStream::new(out_rx)).keep_alive(keep_alive);
        return Ok(sse.into_response());
    }
    let started = Instant::now();
    let mut rx = rx;
    let mut out = TextOut::new(&l.tokenizer, &c.stops);
    let mut finish = None;
    let mut generated = 0;
    let mut cached = 0;
    let mut scored = Vec::new();
    while let Some(ev) = rx.recv().await {
        match ev {
            Event::Started { cached: n } => cached = n,
            Event::PromptLogprobs(v) => scored.extend(v),
            Event::EndToken { .. } => {} // not part of the text
            Event::Token { id, logprobs } => {
                generated += 1;
                if out.push(id, logprobs) {
                    break; // a stop string: dropping `rx` cancels the sequence
                }
            }
            Event::Finished { reason, generated: g } => {
                generated = g;
                finish = Some(reason);
                break;
            }
            Event::Failed(e) => return Err(generation_failed(&state, e)),
        }
    }
    drop(rx);
    if finish.is_none() && !out.stopped() {
        return Err(ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "the server is shutting down"));
    }
    out.finish();
    let (_, tokens) = out.take_ready(true);
    let usage = json!({"prompt_tokens": prompt_tokens, "completion_tokens": generated, "total_tokens": prompt_tokens + generated});
    let reason = finish_name(finish, out.stopped());
    log_done(id, prompt_tokens, generated, cached, started, reason);
    state.metrics.requests_ok.fetch_add(1, Ordering::Relaxed);
    state.metrics.e2e.observe(started.elapsed().as_secs_f64());
    drop(slot);
    let body = match api {
        Api::Completions => {
            let text = format!("{echo}{}", out.text());
            let mut lp = c.logprobs.map(|_| completion_logprobs(&out, &tokens, echo.chars().count(), out.text()));
            if c.prompt_logprobs.is_some() {
                let prompt = prompt_logprobs_json(&out, &c.prompt, &scored, &echo);
                lp = lp.map(|generated| join_logprobs(prompt, &generated));
            }
            json!({
                "id": rid, "object": "text_completion", "created": created, "model": name,
                "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": reason}],
                "usage": usage,
            })
        }
        Api::Chat => {
            let lp = c.logprobs.map(|_| chat_logprobs(&out, &tokens));
            json!({
                "id": rid, "object": "chat.completion", "created": created, "model": name,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": out.text()}, "logprobs": lp, "finish_reason": reason}],
                "usage": usage,
            })
        }
    };
    Ok(axum::Json(body).into_response())
}

fn log_done(id: u64, prompt_tokens: usize, generated: usize, cached: usize, started: Instant, reason: &str) {
    let secs = started.elapsed().as_secs_f64();
    tracing::info!(
        id,
        prompt_tokens,
        cached_prompt_tokens = cached,
        completion_tokens = generated,
        seconds = format!("{secs:.3}"),
        tokens_per_second = format!("{:.1}", generated as f64 / secs.max(1e-9)),
        finish_reason = reason,
        "done"
    );
}

struct Meta {
    id: u64,
    rid: String,
    name: String,
    created: u64,
    prompt_tokens: usize,
}

fn sse(v: &Value) -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default().data(v.to_string()))
}

/// Turn scheduler events into SSE chunks until the generation ends or the client goes
/// away (a failed send): returning drops `rx`, which cancels the sequence.
#[allow(clippy::too_many_arguments)]
async fn stream_task(
    state: Arc<AppState>,
    api: Api,
    c: Checked,
    echo: String,
    mut rx: mpsc::UnboundedReceiver<Event>,
    tx: mpsc::Sender<Result<SseEvent, Infallible>>,
    slot: Slot,
    m: Meta,
) {
    let Some(l) = state.loaded.get() else { return };
    let started = Instant::now();
    let mut out = TextOut::new(&l.tokenizer, &c.stops);
    let chunk = |text: &str, lp: Option<Value>, finish: Option<&str>| match api {
        Api::Completions => json!({
            "id": m.rid, "object": "text_completion", "created": m.created, "model": m.name,
            "choices": [{"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}],
        }),
        Api::Chat => {
            let delta = if finish.is_some() && text.is_empty() { json!({}) } else { json!({"content": text}) };
            json!({
                "id": m.rid, "object": "chat.completion.chunk", "created": m.created, "model": m.name,
                "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}],
            })
        }
    };
    let first = match api {
        Api::Chat => Some(json!({
            "id": m.rid, "object": "chat.completion.chunk", "created": m.created, "model": m.name,
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null}],
        })),
        // A scored prompt's echo waits for its log-probabilities (sent before the first token).
        Api::Completions if !echo.is_empty() && c.prompt_logprobs.is_none() => Some(chunk(&echo, None, None)),
        Api::Completions => None,
    };
    if let Some(f) = first
        && tx.send(sse(&f)).await.is_err()
    {
        state.metrics.requests_cancelled.fetch_add(1, Ordering::Relaxed);
        return;
    }
    let base_chars = echo.chars().count();
    let lp_of = |out: &TextOut, toks: &[TokenOut]| {
        c.logprobs.map(|_| match api {
            Api::Completions => completion_logprobs(out, toks, base_chars, out.text()),
            Api::Chat => chat_logprobs(out, toks),
        })
    };
    let mut generated = 0;
    let mut cached = 0;
    let mut finish = None;
    let mut scored = Vec::new();
    let mut echo_pending = c.prompt_logprobs.is_some();
    loop {
        // A client that hangs up is noticed even while the request waits or prefills.
        let ev = tokio::select! {
            ev = rx.recv() => ev,
            _ = tx.closed() => {
                state.metrics.requests_cancelled.fetch_add(1, Ordering::Relaxed);
                tracing::info!(id = m.id, "client went away; cancelled");
                return;
            }
        };
        let Some(ev) = ev else { break };
        if echo_pending && matches!(ev, Event::Token { .. } | Event::Finished { .. }) {
            // The prompt is scored: its echo, with every prompt token's log-probability.
            echo_pending = false;
            let lp = prompt_logprobs_json(&out, &c.prompt, &scored, &echo);
            if tx.send(sse(&chunk(&echo, Some(lp), None))).await.is_err() {
                state.metrics.requests_cancelled.fetch_add(1, Ordering::Relaxed);
                tracing::info!(id = m.id, "client went away; cancelled");
                return;
            }
        }
        match ev {
            Event::Started { cached: n } => cached = n,
            Event::PromptLogprobs(v) => scored.extend(v),
            Event::EndToken { .. } => {} // not part of the text
            Event::Token { id, logprobs } => {
                generated += 1;
                let stopped = out.push(id, logprobs);
                let (delta, toks) = out.take_ready(false);
                if (!delta.is_empty() || !toks.is_empty())
                    && tx.send(sse(&chunk(&delta, lp_of(&out, &toks), None))).await.is_err()
                {
                    state.metrics.requests_cancelled.fetch_add(1, Ordering::Relaxed);
                    tracing::info!(id = m.id, "client went away; cancelled");
                    return;
                }
                if stopped {
                    break;
                }
            }
            Event::Finished { reason, generated: g } => {
                generated = g;
                finish = Some(reason);
                break;
            }
            Event::Failed(e) => {
                let err = generation_failed(&state, e);
                let _ = tx.send(sse(&err.body())).await;
                let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
                if err.status != StatusCode::SERVICE_UNAVAILABLE {
                    state.metrics.requests_rejected.fetch_add(1, Ordering::Relaxed);
                }
                return;
            }
        }
    }
    drop(rx);
    if finish.is_none() && !out.stopped() {
        // The scheduler went away (shutdown): say so, and end the stream properly.
        let err = ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "the server is shutting down");
        let _ = tx.send(sse(&err.body())).await;
        let _ = tx.send(Ok(SseEvent::default().data("[DONE]"))).await;
        return;
    }
    out.finish();
    let (delta, toks) = out.take_ready(true);
    let reason = finish_name(finish, out.stopped());
    let last = chunk(&delta, if toks.is_empty() { None } else { lp_of(&out, &toks) }, Some(reason));
    let mut events = vec![sse(&last)];
    if c.include_usage {
        let usage = json!({
            "id": m.rid, "object": if api == Api::Chat { "chat.completion.chunk" } else { "text_completion" },
            "created": m.created, "model": m.name, "choices": [],
            "usage": {"prompt_tokens": m.prompt_tokens, "completion_tokens": generated, "total_tokens": m.prompt_tokens + generated},
        });
        events.push(sse(&usage));
    }
    events.push(Ok(SseEvent::default().data("[DONE]")));
    for e in events {
        if tx.send(e).await.is_err() {
            return;
        }
    }
    log_done(m.id, m.prompt_tokens, generated, cached, started, reason);
    state.metrics.requests_ok.fetch_add(1, Ordering::Relaxed);
    state.metrics.e2e.observe(started.elapsed().as_secs_f64());
    drop(slot);
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

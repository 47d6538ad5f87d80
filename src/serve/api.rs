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
use super::protocol::*;
use super::stream::{Meta, stream_task};
use super::validate::{Checked, check_common, check_ids};
use super::{AppState, Loaded};
use crate::chat::Message;
use crate::engine::scheduler::{Event, Request as EngineRequest};
use crate::engine::text::TextOut;

pub fn router(state: Arc<AppState>) -> Router {
    // Probes and the metrics routers scrape need no key (as vLLM guards only its API).
    let open = Router::new().route("/health", get(health)).route("/live", get(live)).route("/metrics", get(metrics));
    let guarded = Router::new()
        .route("/v1/completions", post(completions))
        .route("/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/chat/completions", post(chat_completions))
        .route("/v1/models", get(models))
        .route("/models", get(models))
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

/// Readiness: 200 once the model is loaded, 503 while it loads and while draining.
async fn health(State(state): State<Arc<AppState>>) -> Response {
    if state.draining.load(Ordering::Relaxed) {
        return ApiError::status(StatusCode::SERVICE_UNAVAILABLE, DRAINING).into_response();
    }
    match state.loaded.get() {
        Some(_) => axum::Json(json!({"status": "ok"})).into_response(),
        None => ApiError::status(StatusCode::SERVICE_UNAVAILABLE, "the model is loading").into_response(),
    }
}

/// Liveness: 200 while the process answers HTTP, loading and draining included.
async fn live() -> Response {
    axum::Json(json!({"status": "alive"})).into_response()
}

const DRAINING: &str = "the server is draining (shutting down); send the request to another replica";

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    (
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4; charset=utf-8")],
        state.metrics.render_for(&state.config.model_name),
    )
        .into_response()
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

async fn tokenize(State(state): State<Arc<AppState>>, req: Request) -> ApiResult {
    let body = body_of(&state, req).await?;
    let l = loaded(&state)?;
    let r: TokenizeRequest = parse(&body)?;
    let ids = if r.add_special { l.text.encode_with_bos(&r.content) } else { l.text.tokenizer.encode(&r.content) };
    let tokens: Vec<Value> = if r.with_pieces {
        ids.iter()
            .map(|&id| {
                let bytes = l.text.tokenizer.token_bytes(id).unwrap_or(&[]);
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

async fn detokenize(State(state): State<Arc<AppState>>, req: Request) -> ApiResult {
    let body = body_of(&state, req).await?;
    let l = loaded(&state)?;
    let r: DetokenizeRequest = parse(&body)?;
    let ids = check_ids(&r.tokens, l.text.tokenizer.vocab_size(), "tokens")?;
    let text = l.text.tokenizer.decode(&ids).map_err(|e| ApiError::bad("tokens", e.to_string()))?;
    Ok(axum::Json(json!({ "content": text })).into_response())
}

/// The request's place in the queue: released when the answer is done.
pub(super) struct Slot(Arc<AppState>);

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
    // Counted before the draining check (both SeqCst, as the drain's store and load): either
    // this request sees the drain, or the drain sees it in flight and waits for it.
    let before = state.in_flight.fetch_add(1, Ordering::SeqCst);
    if state.draining.load(Ordering::SeqCst) {
        state.in_flight.fetch_sub(1, Ordering::SeqCst);
        return Err(ApiError::status(StatusCode::SERVICE_UNAVAILABLE, DRAINING));
    }
    if before >= limit {
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
        constraint: c.constraint.clone(),
        pick_hook: None,
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
pub(super) enum Api {
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
    let result = match body_of(&state, req).await {
        Err(e) => Err(e),
        Ok(body) => {
            // Tokenizing, rendering the chat template and compiling a grammar are CPU
            // work (a large schema takes milliseconds): off the async workers, which
            // meanwhile stream other requests' tokens.
            let st = state.clone();
            let checked = tokio::task::spawn_blocking(move || match api {
                Api::Completions => check_completion(&st, &body),
                Api::Chat => check_chat(&st, &body),
            })
            .await;
            match checked {
                Ok(Ok((c, echo, user))) => answer(state.clone(), api, c, echo, user).await,
                Ok(Err(e)) => Err(e),
                Err(e) => Err(ApiError::status(
                    StatusCode::INTERNAL_SERVER_ERROR,
                    format!("checking the request failed: {e}"),
                )),
            }
        }
    };
    if result.is_err() {
        state.metrics.requests_rejected.fetch_add(1, Ordering::Relaxed);
    }
    result
}

/// A generation the scheduler failed: 503 when the server is shutting down, else 500.
pub(super) fn generation_failed(state: &AppState, message: String) -> ApiError {
    let status = if state.stop.load(Ordering::Relaxed) {
        StatusCode::SERVICE_UNAVAILABLE
    } else {
        StatusCode::INTERNAL_SERVER_ERROR
    };
    ApiError::status(status, message)
}

/// A checked request, the text to echo before the answer, and the caller's `user`.
type CheckedRequest = (Checked, String, Option<String>);

/// `/v1/completions`' body, checked and tokenized.
fn check_completion(state: &AppState, body: &Bytes) -> Result<CheckedRequest, ApiError> {
    let l = loaded(state)?;
    let r: GenRequest = parse(body)?;
    if r.messages.is_some() {
        return Err(ApiError::bad("messages", "messages belong to /v1/chat/completions; use prompt here"));
    }
    if r.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
        return Err(ApiError::bad("suffix", "suffix (insertion) is not supported"));
    }
    let vocab = l.info.vocab_size;
    let (prompt, prompt_text) = match &r.prompt {
        None => (l.text.prompt_ids(""), String::new()),
        Some(Prompt::Text(t)) => (l.text.prompt_ids(t), t.clone()),
        Some(Prompt::Texts(v)) if v.len() == 1 => (l.text.prompt_ids(&v[0]), v[0].clone()),
        Some(Prompt::Texts(v)) => {
            return Err(ApiError::bad("prompt", format!("one prompt per request, got {}", v.len())));
        }
        Some(Prompt::Ids(ids)) => {
            let mut ids = check_ids(ids, vocab, "prompt")?;
            if ids.is_empty() {
                ids.extend(l.info.bos_token_id);
            }
            let text = l.text.tokenizer.decode(&ids).unwrap_or_default();
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
    Ok((c, echo_text, r.user))
}

/// `/v1/chat/completions`' body, checked, rendered with the chat template and tokenized.
fn check_chat(state: &AppState, body: &Bytes) -> Result<CheckedRequest, ApiError> {
    let l = loaded(state)?;
    let r: GenRequest = parse(body)?;
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
    let prompt = l.text.chat_prompt_ids(&msgs).map_err(|e| ApiError::bad("messages", format!("{e:#}")))?;
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
    Ok((c, String::new(), r.user))
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
    let mut out = TextOut::new(&l.text.tokenizer, &c.stops);
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

pub(super) fn log_done(id: u64, prompt_tokens: usize, generated: usize, cached: usize, started: Instant, reason: &str) {
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

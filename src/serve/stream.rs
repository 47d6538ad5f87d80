//! Streamed answers: the engine's events for one request as server-sent events, in
//! OpenAI's chunk shapes, until the generation ends or the client goes away.

use std::convert::Infallible;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Instant;

use axum::http::StatusCode;
use axum::response::sse::Event as SseEvent;
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::AppState;
use super::api::{Api, Slot, generation_failed, log_done};
use super::protocol::*;
use super::validate::Checked;
use crate::engine::scheduler::Event;
use crate::engine::text::{TextOut, TokenOut};

pub(super) struct Meta {
    pub(super) id: u64,
    pub(super) rid: String,
    pub(super) name: String,
    pub(super) created: u64,
    pub(super) prompt_tokens: usize,
}

pub(super) fn sse(v: &Value) -> Result<SseEvent, Infallible> {
    Ok(SseEvent::default().data(v.to_string()))
}

/// Turn scheduler events into SSE chunks until the generation ends or the client goes
/// away (a failed send): returning drops `rx`, which cancels the sequence.
#[allow(clippy::too_many_arguments)]
pub(super) async fn stream_task(
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
    let mut out = TextOut::new(&l.text.tokenizer, &c.stops);
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

//! `forge serve`: an OpenAI-compatible HTTP server over the engine's scheduler.
//!
//! HTTP only: the generation loop is the engine's [`Scheduler`]; this module routes
//! requests into it and its events back out.
//!
//! - [`api`]: the routes (axum) and their handlers: submit to the engine, answer whole.
//! - `protocol`: OpenAI's request bodies, error JSON and logprobs shapes.
//! - `validate`: every check of a request before it reaches the engine.
//! - `stream`: streamed answers as server-sent events.
//! - [`http`]: the accept loop (timeouts for slow clients, a connection limit).
//! - [`run_engine`]: the scheduler's thread: jobs in from the handlers, each request's
//!   events out to its handler, requests whose client is gone aborted.
//!
//! Threads: the HTTP side runs on a tokio runtime; the scheduler runs on its own
//! thread (inside the backend's rayon pool), loads the model, then loops. `/health`
//! answers 503 until the model is loaded.

pub mod api;
pub mod http;
mod protocol;
mod stream;
mod validate;

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use tokio::sync::mpsc::UnboundedSender;

use crate::backend::Backend;
use crate::engine::scheduler::BLOCK_TOKENS;
use crate::engine::{Engine, Event, ModelText, Request, Scheduler};
pub use crate::engine::{Metrics, SchedulerConfig};
use crate::model::ModelInfo;

/// A request from a handler, with the channel its events go to.
pub struct Job {
    pub request: Request,
    pub events: UnboundedSender<Event>,
}

/// Server settings (the CLI's flags).
#[derive(Clone, Debug)]
pub struct ServeConfig {
    /// The id `/v1/models` reports.
    pub model_name: String,
    pub api_key: Option<String>,
    /// Requests that may wait beyond the `parallel` running ones before new ones get 429.
    pub max_queue: usize,
    /// `ctx_size` 0: `parallel` × the model's context.
    pub scheduler: SchedulerConfig,
    /// How long a client may take to send a request's headers, and again its body.
    pub timeout: std::time::Duration,
    /// Connections served at once; more wait to be accepted.
    pub max_connections: usize,
}

/// What the HTTP side needs once the model is loaded.
pub struct Loaded {
    /// The tokenizer, chat template and end-of-generation ids (the model stays on the
    /// scheduler's thread).
    pub text: ModelText,
    pub info: ModelInfo,
    pub created: u64,
    /// The scheduler's settings with the pool size resolved.
    pub scheduler: SchedulerConfig,
    pub jobs: std::sync::mpsc::Sender<Job>,
    /// Compiles structured-output constraints for this model (or why it cannot).
    pub grammars: Result<crate::engine::grammar::Grammars, crate::engine::grammar::GrammarError>,
}

/// State shared by the HTTP handlers and the scheduler thread.
pub struct AppState {
    pub config: ServeConfig,
    pub loaded: OnceLock<Loaded>,
    pub metrics: Arc<Metrics>,
    pub next_id: AtomicU64,
    /// Requests running or queued (a 429 past `parallel + max_queue`).
    pub in_flight: AtomicUsize,
    /// Set on SIGINT/SIGTERM: no new requests (503), `/health` answers 503, while the
    /// requests in flight finish.
    pub draining: AtomicBool,
    /// Set once draining is over: the scheduler fails what it holds and exits.
    pub stop: AtomicBool,
}

impl AppState {
    pub fn new(config: ServeConfig) -> Arc<Self> {
        Arc::new(AppState {
            config,
            loaded: OnceLock::new(),
            metrics: Arc::new(Metrics::default()),
            next_id: AtomicU64::new(1),
            in_flight: AtomicUsize::new(0),
            draining: AtomicBool::new(false),
            stop: AtomicBool::new(false),
        })
    }
}

/// [`run_engine`] was called a second time on the same [`AppState`].
#[derive(Debug, thiserror::Error)]
#[error("the server's model was loaded twice")]
pub struct LoadedTwice;

/// Run the scheduler over a loaded engine until `state.stop` is set: publish the parts
/// the HTTP side needs, then loop. Call it on the thread (and rayon pool) that should
/// run the model.
pub fn run_engine<B: Backend>(engine: Engine<B>, state: &AppState) -> Result<(), LoadedTwice> {
    let Engine { backend, model, text, speculation } = engine;
    let info = model.info().clone();
    let mut cfg = state.config.scheduler.clone();
    cfg.parallel = cfg.parallel.max(1);
    if cfg.ctx_size == 0 {
        cfg.ctx_size = cfg.parallel.saturating_mul(info.context_length);
    }
    cfg.ctx_size = (cfg.ctx_size / BLOCK_TOKENS).max(1) * BLOCK_TOKENS;
    cfg.batch_tokens = cfg.batch_tokens.max(1);
    let (tx, rx) = std::sync::mpsc::channel();
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let grammars = crate::engine::grammar::Grammars::new(&text.tokenizer, info.vocab_size, &text.end_of_generation);
    let end_of_generation = text.end_of_generation.clone();
    let scheduler = cfg.clone();
    let loaded = Loaded { text, info, created, scheduler, jobs: tx, grammars };
    if state.loaded.set(loaded).is_err() {
        return Err(LoadedTwice);
    }
    tracing::info!(slots = cfg.parallel, ctx_size = cfg.ctx_size, "ready: /health answers 200");
    let mut scheduler = Scheduler::new(&backend, &*model, cfg, end_of_generation, state.metrics.clone());
    if let Some(sp) = &speculation {
        tracing::info!("speculative decoding: {}", sp.describe());
        scheduler = scheduler.with_drafter(sp.drafter(), sp.draft_max, sp.draft_min).draft_while_at_most(sp.batch_max);
    }
    route(&mut scheduler, rx, &state.stop);
    Ok(())
}

/// Step the scheduler until `jobs` closes or `stop` is set, routing each request's
/// events to its handler; then every request still here gets `Failed("server is
/// shutting down")`.
fn route<B: Backend>(scheduler: &mut Scheduler<'_, B>, jobs: Receiver<Job>, stop: &AtomicBool) {
    let mut senders: HashMap<u64, UnboundedSender<Event>> = HashMap::new();
    let add = |scheduler: &mut Scheduler<'_, B>, senders: &mut HashMap<_, _>, job: Job| {
        senders.insert(job.request.id, job.events);
        scheduler.add(job.request);
    };
    let step_delay = scheduler.config().step_delay;
    let mut out = Vec::new();
    loop {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        // Block for work only when idle; otherwise take what has arrived.
        if !scheduler.busy() {
            match jobs.recv_timeout(Duration::from_millis(100)) {
                Ok(job) => add(scheduler, &mut senders, job),
                Err(RecvTimeoutError::Timeout) => continue,
                Err(RecvTimeoutError::Disconnected) => break,
            }
        }
        while let Ok(job) = jobs.try_recv() {
            add(scheduler, &mut senders, job);
        }
        // A client that disconnected (or a stop string found) closed its receiver.
        senders.retain(|&id, tx| {
            if tx.is_closed() && scheduler.abort(id) {
                tracing::info!(id, "request cancelled; its sequence is freed");
            }
            !tx.is_closed()
        });
        scheduler.step(&mut out);
        send(&mut senders, &mut out, scheduler);
        if !step_delay.is_zero() {
            std::thread::sleep(step_delay);
        }
    }
    // Jobs still in the channel get their answer too.
    while let Ok(job) = jobs.try_recv() {
        add(scheduler, &mut senders, job);
    }
    scheduler.shutdown("server is shutting down", &mut out);
    send(&mut senders, &mut out, scheduler);
}

/// Hand each event to its request's channel; a closed channel aborts the request.
fn send<B: Backend>(
    senders: &mut HashMap<u64, UnboundedSender<Event>>,
    out: &mut Vec<(u64, Event)>,
    scheduler: &mut Scheduler<'_, B>,
) {
    for (id, event) in out.drain(..) {
        let last = matches!(event, Event::Finished { .. } | Event::Failed(_));
        let Some(tx) = senders.get(&id) else { continue };
        if tx.send(event).is_err() || last {
            senders.remove(&id);
            if !last {
                scheduler.abort(id);
            }
        }
    }
}

/// Ask the scheduler to stop.
pub fn request_stop(state: &AppState) {
    state.stop.store(true, Ordering::Relaxed);
}

//! `forge serve`: an OpenAI-compatible HTTP server over a continuous-batching scheduler.
//!
//! - [`scheduler`]: the request engine; one loop, one forward per step over every
//!   active sequence, a KV block pool, a prefix cache. It knows neither the model's
//!   architecture nor HTTP.
//! - [`api`]: the routes (axum), request checks, OpenAI's JSON and SSE shapes.
//! - [`text`]: generated tokens to streamed text (whole characters, stop strings).
//! - [`metrics`]: counters and histograms for `/metrics`.
//! - [`http`]: the accept loop (timeouts for slow clients, a connection limit).
//!
//! Threads: the HTTP side runs on a tokio runtime; the scheduler runs on its own
//! thread (inside the backend's rayon pool), loads the model, then loops. `/health`
//! answers 503 until the model is loaded.

pub mod api;
pub mod http;
pub mod metrics;
pub mod scheduler;
pub mod text;

use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock};

use crate::backend::Backend;
use crate::chat::ChatTemplate;
use crate::engine::Engine;
use crate::model::ModelInfo;
use crate::tokenizer::Tokenizer;
pub use metrics::Metrics;
pub use scheduler::{Job, Scheduler, SchedulerConfig};

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
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    pub chat_template_error: Option<String>,
    pub info: ModelInfo,
    pub created: u64,
    /// The scheduler's settings with the pool size resolved.
    pub scheduler: SchedulerConfig,
    pub jobs: std::sync::mpsc::Sender<Job>,
}

/// State shared by the HTTP handlers and the scheduler thread.
pub struct AppState {
    pub config: ServeConfig,
    pub loaded: OnceLock<Loaded>,
    pub metrics: Arc<Metrics>,
    pub next_id: AtomicU64,
    /// Requests running or queued (a 429 past `parallel + max_queue`).
    pub in_flight: AtomicUsize,
    /// Set on SIGINT/SIGTERM: the scheduler fails what it holds and exits.
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
            stop: AtomicBool::new(false),
        })
    }
}

/// Run the scheduler over a loaded engine until `state.stop` is set: publish the parts
/// the HTTP side needs, then loop. Call it on the thread (and rayon pool) that should
/// run the model.
pub fn run_engine<B: Backend>(engine: Engine<B>, state: &AppState) -> anyhow::Result<()> {
    let Engine { backend, model, tokenizer, chat_template, chat_template_error, end_of_generation } = engine;
    let info = model.info().clone();
    let mut cfg = state.config.scheduler.clone();
    cfg.parallel = cfg.parallel.max(1);
    if cfg.ctx_size == 0 {
        cfg.ctx_size = cfg.parallel.saturating_mul(info.context_length);
    }
    cfg.ctx_size = (cfg.ctx_size / scheduler::BLOCK_TOKENS).max(1) * scheduler::BLOCK_TOKENS;
    cfg.batch_tokens = cfg.batch_tokens.max(1);
    let (tx, rx) = std::sync::mpsc::channel();
    let created = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let loaded =
        Loaded { tokenizer, chat_template, chat_template_error, info, created, scheduler: cfg.clone(), jobs: tx };
    if state.loaded.set(loaded).is_err() {
        anyhow::bail!("the server's model was loaded twice");
    }
    tracing::info!(slots = cfg.parallel, ctx_size = cfg.ctx_size, "ready: /health answers 200");
    let mut scheduler = Scheduler::new(&backend, &*model, cfg, end_of_generation, state.metrics.clone());
    scheduler.run(rx, &state.stop);
    Ok(())
}

/// Ask the scheduler to stop.
pub fn request_stop(state: &AppState) {
    state.stop.store(true, Ordering::Relaxed);
}

//! `forge serve`: the OpenAI-compatible HTTP server (flag names from llama-server).

use std::time::Duration;

use clap::Args;

use batch_forge::backend::Backend as _;
use batch_forge::serve::{self, AppState, SchedulerConfig, ServeConfig};

use super::{BackendArgs, with_backend};

#[derive(Args)]
pub struct ServeArgs {
    /// Model folder, GGUF file, or Hub id.
    #[arg(short = 'm', long)]
    model: String,
    /// A Jinja chat template file to use instead of the model's own (llama.cpp's and
    /// vLLM's --chat-template); for models whose files carry none.
    #[arg(long = "chat-template", value_name = "FILE")]
    chat_template: Option<std::path::PathBuf>,
    /// Address to listen on (0.0.0.0: every interface, as in the container image).
    #[arg(long, env = "FORGE_HOST", default_value = "127.0.0.1")]
    host: String,
    /// Port to listen on (0: any free port; the chosen one is printed).
    #[arg(long, default_value_t = 8080)]
    port: u16,
    /// Sequences decoded together in one forward (llama-server's -np).
    #[arg(long = "parallel", default_value_t = 4,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    parallel: u32,
    /// KV positions in the pool over all sequences (0: --parallel × the model's context).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 0)]
    ctx_size: usize,
    /// Tokens per forward at most: decode rows plus prompt chunks (chunked prefill).
    #[arg(short = 'b', long = "batch-size", default_value_t = 512,
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    batch_size: u32,
    /// Requests that may wait beyond the running ones; more get 429.
    #[arg(long, default_value_t = 64)]
    max_queue: usize,
    /// Require `Authorization: Bearer KEY` on every route but /health, /live and /metrics.
    #[arg(long, env = "FORGE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,
    /// The model id /v1/models reports (default: the model's file or folder name).
    #[arg(short = 'a', long)]
    alias: Option<String>,
    /// Do not keep finished sequences' KV caches for prompts that share their prefix.
    #[arg(long)]
    no_prefix_cache: bool,
    /// Let each forward use the fastest kernel for its shape (cpu backend). Faster for
    /// dense weights, but a request's output may then depend on what else is batched.
    #[arg(long)]
    no_batch_invariance: bool,
    /// Threads for the model (default: the physical cores).
    #[arg(short = 't', long)]
    threads: Option<usize>,
    /// Seconds a client may take to send a request's headers, and again its body; an
    /// idle keep-alive connection is closed after it (llama-server's -to).
    #[arg(long = "timeout", visible_alias = "to", default_value_t = 60,
          value_parser = clap::value_parser!(u64).range(1..=86400))]
    timeout: u64,
    /// Connections served at once; one more is answered 503 and closed.
    #[arg(long, default_value_t = 512, value_parser = clap::value_parser!(u32).range(1..=65536))]
    max_connections: u32,
    /// Seconds the requests in flight may take to finish after SIGTERM or Ctrl-C (new
    /// ones get 503 and /health answers 503 meanwhile); then what is left is cancelled.
    /// A second signal stops at once.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u64).range(0..=86400))]
    drain_timeout: u64,
    #[command(flatten)]
    backend: BackendArgs,
    #[command(flatten)]
    spec: super::SpecArgs,
}

pub fn run(args: ServeArgs) -> anyhow::Result<()> {
    args.backend.validate("serve")?;
    args.spec.validate()?;
    anyhow::ensure!(
        !(args.spec.is_on() && args.no_batch_invariance),
        "speculative decoding verifies drafts with the batch-invariant kernels; drop --no-batch-invariance"
    );
    if let Some(t) = args.threads {
        super::check_threads(&[t])?;
        super::warn_threads(&[t]);
    }
    anyhow::ensure!(args.api_key.as_deref() != Some(""), "--api-key must not be empty");
    let dir = super::model_dir(&args.model, true, "serve")?;
    let name = args
        .alias
        .clone()
        .unwrap_or_else(|| dir.file_name().map_or_else(|| args.model.clone(), |n| n.to_string_lossy().into_owned()));
    let config = ServeConfig {
        model_name: name,
        api_key: args.api_key.clone(),
        max_queue: args.max_queue,
        scheduler: SchedulerConfig {
            parallel: args.parallel as usize,
            ctx_size: args.ctx_size,
            batch_tokens: args.batch_size as usize,
            prefix_cache: !args.no_prefix_cache,
            initial_slack: batch_forge::engine::scheduler::INITIAL_SLACK,
            step_delay: std::time::Duration::from_millis(
                std::env::var("BATCH_FORGE_STEP_DELAY_MS").ok().and_then(|v| v.parse().ok()).unwrap_or(0),
            ),
        },
        timeout: Duration::from_secs(args.timeout),
        max_connections: args.max_connections as usize,
    };
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .try_init();
    let state = AppState::new(config);
    let runtime = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build()?;
    // Installed before the server takes connections, so no signal meets the default
    // action (an immediate kill) from "listening on" on.
    let mut signal_listener = {
        let _runtime = runtime.enter();
        Signals::new()
    };
    let listener = runtime
        .block_on(tokio::net::TcpListener::bind((args.host.as_str(), args.port)))
        .map_err(|e| anyhow::anyhow!("cannot listen on {}:{}: {e}", args.host, args.port))?;
    let addr = listener.local_addr()?;
    eprintln!("listening on http://{addr}");

    // The model loads and runs on its own thread; the HTTP side answers 503 meanwhile.
    let (done_tx, done_rx) = tokio::sync::oneshot::channel::<anyhow::Result<()>>();
    let engine_state = state.clone();
    let mut backend = args.backend.clone();
    backend.batch_invariant = !args.no_batch_invariance;
    let swa = backend.clone();
    let threads = args.threads;
    let chat_template = args.chat_template.clone();
    let spec = args.spec.clone();
    std::thread::Builder::new().name("scheduler".into()).spawn(move || {
        let result = super::in_pool(threads, || {
            with_backend!(backend, |b| {
                tracing::info!("loading {} (/health answers 503 until it is ready)", dir.display());
                let start = std::time::Instant::now();
                let mut engine = swa.load_engine(b, &dir)?;
                if let Some(file) = &chat_template {
                    engine.use_chat_template_file(file)?;
                }
                spec.apply(&mut engine, "serve")?;
                let info = engine.model.info().clone();
                let backend = engine.backend.name();
                // The CPU kernel level (replicas on different CPUs answer the same bits).
                let isa = if backend == "cpu" { batch_forge::backend::cpu::simd::Isa::detect().name() } else { "-" };
                tracing::info!(
                    architecture = info.architecture,
                    n_params = info.n_params,
                    context = info.context_length,
                    backend,
                    isa,
                    "model loaded in {:.2} s",
                    start.elapsed().as_secs_f64()
                );
                Ok(serve::run_engine(engine, &engine_state)?)
            })
        });
        let _ = done_tx.send(result);
    })?;

    let app = serve::api::router(state.clone());
    let stop_state = state.clone();
    let drain = Duration::from_secs(args.drain_timeout);
    let shutdown = async move {
        // One listener hears every signal for the life of the server: the first drains,
        // the second stops the drain, a later one exits at once (even in the grace period).
        let (signals_tx, mut signals) = tokio::sync::watch::channel(0u32);
        tokio::spawn(async move {
            let mut count = 0;
            loop {
                signal_listener.next().await;
                count += 1;
                if count >= 3 {
                    eprintln!("error: third signal; exiting now");
                    std::process::exit(1);
                }
                let _ = signals_tx.send(count);
            }
        });
        let _ = signals.wait_for(|&n| n >= 1).await;
        // Drain: refuse new requests (503, /health 503) while those in flight finish.
        stop_state.draining.store(true, std::sync::atomic::Ordering::SeqCst);
        let in_flight = || stop_state.in_flight.load(std::sync::atomic::Ordering::SeqCst);
        if in_flight() > 0 {
            tracing::info!(
                "draining: {} requests in flight may finish within {} s; new ones get 503 (a second signal stops now)",
                in_flight(),
                drain.as_secs()
            );
            let finished = async {
                while in_flight() > 0 {
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
            };
            tokio::select! {
                () = finished => tracing::info!("drained: every request in flight finished"),
                () = tokio::time::sleep(drain) => tracing::warn!("drain timeout: {} requests still in flight", in_flight()),
                _ = signals.wait_for(|&n| n >= 2) => tracing::info!("second signal: stopping now"),
            }
        }
        tracing::info!("shutting down: requests still in flight are cancelled");
        serve::request_stop(&stop_state);
        // Never hang: whatever is still open after a grace period is cut.
        std::thread::spawn(|| {
            std::thread::sleep(Duration::from_secs(10));
            eprintln!("error: shutdown grace period over; connections were cut");
            std::process::exit(1);
        });
    };
    let (timeout, max_connections) = (state.config.timeout, state.config.max_connections);
    runtime.block_on(async move {
        let server = serve::http::serve(listener, app, shutdown, timeout, max_connections);
        tokio::pin!(server);
        tokio::select! {
            () = &mut server => Ok(()),
            r = done_rx => match r {
                // Stopped on a signal: let the server finish its graceful shutdown.
                Ok(Ok(())) => {
                    server.await;
                    Ok(())
                }
                Ok(Err(e)) => Err(e.context("the model could not be served")),
                Err(_) => Err(anyhow::anyhow!("the scheduler thread ended without a result (a panic)")),
            },
        }
    })?;
    eprintln!("server stopped");
    Ok(())
}

/// SIGINT and SIGTERM, heard from the first call to `new` on: a signal that arrives
/// between two `next` calls is kept, not lost.
struct Signals {
    #[cfg(unix)]
    int: Option<tokio::signal::unix::Signal>,
    #[cfg(unix)]
    term: Option<tokio::signal::unix::Signal>,
}

impl Signals {
    fn new() -> Self {
        #[cfg(unix)]
        {
            use tokio::signal::unix::{SignalKind, signal};
            Signals { int: signal(SignalKind::interrupt()).ok(), term: signal(SignalKind::terminate()).ok() }
        }
        #[cfg(not(unix))]
        Signals {}
    }

    async fn next(&mut self) {
        #[cfg(unix)]
        {
            async fn recv(s: &mut Option<tokio::signal::unix::Signal>) {
                match s {
                    Some(s) => {
                        s.recv().await;
                    }
                    None => std::future::pending::<()>().await,
                }
            }
            tokio::select! {
                () = recv(&mut self.int) => {},
                () = recv(&mut self.term) => {},
            }
        }
        #[cfg(not(unix))]
        {
            let _ = tokio::signal::ctrl_c().await;
        }
    }
}

//! `forge perplexity -m MODEL -f FILE [-c 512]`: llama-perplexity's method and output
//! ([`batch_forge::engine::perplexity`]), so the two numbers compare.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::Context;
use clap::Args;

use batch_forge::backend::Backend;

use super::{BackendArgs, BackendChoice, with_backend};

#[derive(Args)]
pub struct PerplexityArgs {
    /// Model folder, .gguf file, or Hub repo id.
    #[arg(long, short)]
    model: String,
    /// The text to score (`-` = stdin).
    #[arg(short = 'f', long, value_name = "FILE")]
    file: PathBuf,
    /// Tokens per window; the second half of each is scored.
    #[arg(short = 'c', long = "ctx-size", value_name = "N", default_value_t = 512)]
    ctx_size: usize,
    /// Score at most N windows (llama.cpp's --chunks); default all.
    #[arg(long, value_name = "N")]
    chunks: Option<usize>,
    #[command(flatten)]
    backend: BackendArgs,
    /// Worker threads (default: the physical cores available to this process).
    #[arg(long, short)]
    threads: Option<usize>,
}

pub fn run(args: PerplexityArgs) -> anyhow::Result<()> {
    args.backend.validate("perplexity")?;
    anyhow::ensure!(args.backend.backend != BackendChoice::Both, "--backend both is for `forge generate` only");
    anyhow::ensure!(args.chunks != Some(0), "--chunks must be at least 1");
    super::check_threads(args.threads.as_slice())?;
    super::warn_threads(args.threads.as_slice());
    let text = if args.file.as_os_str() == "-" {
        super::read_stdin_utf8("the text on stdin")?
    } else {
        let bytes = std::fs::read(&args.file).with_context(|| format!("-f {}: cannot read", args.file.display()))?;
        String::from_utf8(bytes).map_err(|e| {
            anyhow::anyhow!("-f {}: not valid UTF-8 (byte {})", args.file.display(), e.utf8_error().valid_up_to())
        })?
    };
    super::in_pool(args.threads, || with_backend!(args.backend, |b| perplexity_on(b, &args, &text)))
}

fn perplexity_on<B: Backend>(backend: B, args: &PerplexityArgs, text: &str) -> anyhow::Result<()> {
    let path = super::model_dir(&args.model, true, "perplexity")?;
    let engine = args.backend.load_engine(backend, &path)?;
    let tokens = engine.perplexity_tokens(text);
    let n_ctx = args.ctx_size;
    let total = batch_forge::engine::perplexity::windows(tokens.len(), n_ctx);
    let n = args.chunks.map_or(total, |c| c.min(total));
    eprintln!(
        "perplexity: {} tokens, {n} windows of {n_ctx} (the second half of each scored) on {}",
        tokens.len(),
        engine.backend.name()
    );
    let start = Instant::now();
    let stdout = std::io::stdout();
    let state = engine.perplexity(&tokens, n_ctx, args.chunks, |s| {
        let mut out = stdout.lock();
        if s.windows == 1 {
            let per = start.elapsed().as_secs_f64();
            eprintln!("perplexity: {per:.2} s per window, about {:.1} s in all", per * n as f64);
        }
        write!(out, "[{}]{:.4},", s.windows, s.ppl()).map_err(super::stdout_error)?;
        Ok(out.flush().map_err(super::stdout_error)?)
    })?;
    let mut out = stdout.lock();
    writeln!(out).map_err(super::stdout_error)?;
    writeln!(out, "Final estimate: PPL = {:.4} +/- {:.5}", state.ppl(), state.uncertainty())
        .map_err(super::stdout_error)?;
    eprintln!("perplexity: {} tokens scored in {:.2} s", state.count, start.elapsed().as_secs_f64());
    Ok(())
}

//! `forge generate`: prompt → streamed text (or one JSON object with --json).

use std::io::Write;
use std::time::Instant;

use anyhow::Context;
use clap::Args;

use batch_forge::backend::Backend;
use batch_forge::engine::{Engine, GenerateParams, SamplingParams, StopReason};
use batch_forge::loaders::DEFAULT_MODEL;
use batch_forge::tokenizer::StreamDecoder;

use super::{BackendArgs, BackendChoice, with_backend};

#[derive(Args)]
pub struct GenerateArgs {
    /// The prompt (empty: start from <|endoftext|>).
    #[arg(conflicts_with = "prompt")]
    prompt_pos: Option<String>,
    /// The prompt, as an option.
    #[arg(long)]
    prompt: Option<String>,
    /// Model folder (config.json, model.safetensors, tokenizer.json) or Hub repo id.
    #[arg(long, short, default_value = DEFAULT_MODEL)]
    model: String,
    /// Number of tokens to generate (fewer if EOS comes first or the context fills).
    #[arg(long, short = 'n', default_value_t = 100)]
    max_new_tokens: usize,
    /// Always take the most likely token (same as --temperature 0).
    #[arg(long)]
    greedy: bool,
    /// Softmax temperature; 0 is greedy.
    #[arg(long, default_value_t = 0.8, allow_negative_numbers = true)]
    temperature: f32,
    /// Sample among the K most likely tokens only; 0 turns the cut off.
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    /// Sample from the smallest set of tokens whose probability reaches P, in (0, 1].
    #[arg(long, default_value_t = 0.95, allow_negative_numbers = true)]
    top_p: f32,
    /// RNG seed for sampling (default: from the clock; printed with --json).
    #[arg(long)]
    seed: Option<u64>,
    #[command(flatten)]
    backend: BackendArgs,
    /// Worker threads (default: the physical cores available to this process).
    #[arg(long, short)]
    threads: Option<usize>,
    /// Print one JSON object when done instead of streaming text.
    #[arg(long)]
    json: bool,
    /// Also print prompt and generated token ids (to stderr).
    #[arg(long)]
    show_ids: bool,
    /// Keep generating after <|endoftext|>.
    #[arg(long)]
    ignore_eos: bool,
}

pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64)
    });
    let sampling = SamplingParams {
        temperature: if args.greedy { 0.0 } else { args.temperature },
        top_k: args.top_k,
        top_p: args.top_p,
        seed,
    };
    sampling.validate().map_err(anyhow::Error::msg)?;
    args.backend.validate("generate")?;
    if args.backend.backend == BackendChoice::Both {
        #[cfg(feature = "gpu")]
        return super::in_pool(args.threads, || lockstep(&args, sampling));
        #[cfg(not(feature = "gpu"))]
        return Err(super::no_gpu_build());
    }
    super::in_pool(args.threads, || with_backend!(args.backend, |b| run_on(b, &args, sampling)))
}

/// `--backend both`: the cpu and gpu backends step together on the same tokens (the
/// cpu's choices). Each step prints the max |logit difference| and both argmaxes; the
/// first step whose argmax differs ends the run with an error naming it.
#[cfg(feature = "gpu")]
fn lockstep(args: &GenerateArgs, sampling: SamplingParams) -> anyhow::Result<()> {
    use batch_forge::backend::cpu::CpuBackend;
    use batch_forge::backend::gpu::GpuBackend;
    use batch_forge::engine::lockstep::lockstep;

    let dir = super::model_dir(&args.model, true)?;
    let cpu = Engine::load_dir(CpuBackend::new(args.backend.cpu_options()?)?, &dir)?;
    let gpu_backend = GpuBackend::new(args.backend.gpu_options()?)?;
    let device = gpu_backend.description();
    let gpu = Engine::load_dir(gpu_backend, &dir)?;
    let tok = &cpu.tokenizer;
    let prompt = args.prompt.as_deref().or(args.prompt_pos.as_deref()).unwrap_or("");
    let prompt_ids = if prompt.is_empty() { vec![cpu.model.config().bos_token_id] } else { tok.encode(prompt) };
    let params = GenerateParams { max_new_tokens: args.max_new_tokens, sampling, ignore_eos: args.ignore_eos };
    super::outln!("lockstep: cpu vs gpu on {device}, prompt {} tokens", prompt_ids.len());
    super::outln!("| step | tokens in | max abs logit diff | cpu argmax | gpu argmax | next token |");
    super::outln!("| ---: | ---: | ---: | ---: | ---: | --- |");
    let steps = lockstep(&cpu, &gpu, &prompt_ids, &params, |s| {
        let text = String::from_utf8_lossy(tok.token_bytes(s.next)?).into_owned();
        let (step, n, diff, ca, ga, next) = (s.step, s.tokens_in, s.max_abs_diff, s.argmax_a, s.argmax_b, s.next);
        super::outln!("| {step} | {n} | {diff:.3e} | {ca} | {ga} | {next} {text:?} |");
        Ok(())
    })?;
    if let Some(s) = steps.last().filter(|s| !s.agrees()) {
        anyhow::bail!(
            "cpu and gpu diverge at step {} (position {}): cpu argmax {}, gpu argmax {}, max abs logit diff {:.3e}",
            s.step,
            s.position,
            s.argmax_a,
            s.argmax_b,
            s.max_abs_diff
        );
    }
    let worst = steps.iter().map(|s| s.max_abs_diff).fold(0f32, batch_forge::compare::nan_max);
    super::outln!("cpu and gpu agree on every argmax; max abs logit diff over all steps {worst:.3e}");
    Ok(())
}

fn run_on<B: Backend>(backend: B, args: &GenerateArgs, sampling: SamplingParams) -> anyhow::Result<()> {
    let load_start = Instant::now();
    let dir = super::model_dir(&args.model, true)?;
    let engine = Engine::load_dir(backend, &dir)?;
    let load_time = load_start.elapsed();
    let tok = &engine.tokenizer;
    let prompt = args.prompt.as_deref().or(args.prompt_pos.as_deref()).unwrap_or("");
    let prompt_ids = if prompt.is_empty() { vec![engine.model.config().bos_token_id] } else { tok.encode(prompt) };
    let eos = engine.model.config().eos_token_id;

    let params =
        GenerateParams { max_new_tokens: args.max_new_tokens, sampling: sampling.clone(), ignore_eos: args.ignore_eos };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let mut stream = StreamDecoder::new();
    let mut text = String::new();
    let result = engine.generate(&prompt_ids, &params, |id| {
        if id == eos && !args.ignore_eos {
            return Ok(());
        }
        let start = text.len();
        stream.push_into(tok.token_bytes(id)?, &mut text);
        if !args.json {
            out.write_all(&text.as_bytes()[start..]).context("writing to stdout")?;
            out.flush().context("writing to stdout")?;
        }
        Ok(())
    })?;
    let tail = stream.finish();
    text.push_str(&tail);

    let n_new = result.generated_ids.len();
    let (prefill_s, decode_s) = (result.timings.prefill.as_secs_f64(), result.timings.decode.as_secs_f64());
    let decode_steps = n_new.saturating_sub(1);
    let rate = |n: usize, s: f64| if s > 0.0 { n as f64 / s } else { 0.0 };
    if args.json {
        let obj = serde_json::json!({
            "prompt_ids": result.prompt_ids,
            "generated_ids": result.generated_ids,
            "text": text,
            "backend": engine.backend.name(),
            "stop_reason": result.stop.as_str(),
            "seed": sampling.seed,
            "greedy": sampling.is_greedy(),
            "timings": {
                "load_s": load_time.as_secs_f64(),
                "prefill_s": prefill_s,
                "decode_s": decode_s,
                "prompt_tokens": result.prompt_ids.len(),
                "generated_tokens": n_new,
                "prefill_tok_s": rate(result.prompt_ids.len(), prefill_s),
                "decode_tok_s": rate(decode_steps, decode_s),
            },
        });
        writeln!(out, "{obj}").context("writing to stdout")?;
    } else {
        writeln!(out, "{tail}").context("writing to stdout")?;
    }
    drop(out);
    if result.stop == StopReason::ContextFull {
        eprintln!(
            "[stopped after {n_new} tokens: the model's context of {} tokens is full]",
            engine.model.config().n_positions
        );
    }
    if args.show_ids {
        eprintln!("prompt ids: {:?}", result.prompt_ids);
        eprintln!("generated ids: {:?}", result.generated_ids);
    }
    eprintln!(
        "[prompt {} tokens in {prefill_s:.2}s = {:.1} tok/s; generated {n_new} tokens in {:.2}s = {:.1} tok/s on {}]",
        result.prompt_ids.len(),
        rate(result.prompt_ids.len(), prefill_s),
        prefill_s + decode_s,
        rate(decode_steps, decode_s),
        engine.backend.name()
    );
    Ok(())
}

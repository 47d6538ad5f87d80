//! `forge bench`: llama-bench's measurements. pp N = one forward pass over N prompt
//! tokens; tg N = N one-token decode steps from an empty context. Each test runs once
//! to warm up, then `-r` times; the table shows mean ± standard deviation of tokens/s.

use std::time::Instant;

use rayon::prelude::*;

use anyhow::Context;
use clap::Args;

use batch_forge::backend::cpu::simd;
use batch_forge::backend::{Backend, SeqSlice};
use batch_forge::engine::sampler::Rng;
use batch_forge::engine::{SamplingParams, TokenPicker};
use batch_forge::loaders::{Gpt2Config, WeightStore};
use batch_forge::model::random::random_checkpoint;
use batch_forge::model::{Batch, Gpt2, LogitRows};

use super::{BackendArgs, BackendChoice, DtypeChoice, with_backend};
use batch_forge::loaders::safetensors::Dtype;

#[derive(Args)]
pub struct BenchArgs {
    /// Model folder or Hub id.
    #[arg(long, short, conflicts_with = "random")]
    model: Option<String>,
    /// Random weights of a published config (no download): gpt2, gpt2-medium, gpt2-large, gpt2-xl, distilgpt2.
    #[arg(long)]
    random: Option<String>,
    /// Prompt lengths to test (pp); 0 skips.
    #[arg(short = 'p', long = "n-prompt", value_delimiter = ',', default_value = "512")]
    n_prompt: Vec<usize>,
    /// Generation lengths to test (tg); 0 skips.
    #[arg(short = 'n', long = "n-gen", value_delimiter = ',', default_value = "128")]
    n_gen: Vec<usize>,
    /// Repetitions of each test.
    #[arg(short = 'r', long, default_value_t = 5)]
    repetitions: usize,
    /// Thread counts to test (default: the physical cores available to this process).
    #[arg(short = 't', long, value_delimiter = ',')]
    threads: Vec<usize>,
    #[command(flatten)]
    backend: BackendArgs,
    /// Instead of a model, measure memory read bandwidth (GB/s) at each thread count:
    /// the roofline for decoding, which streams every weight once per token.
    #[arg(long)]
    memory: bool,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.repetitions > 0, "-r must be at least 1");
    anyhow::ensure!(!args.threads.contains(&0), "-t: thread counts must be at least 1");
    args.backend.validate("bench")?;
    if args.memory {
        return bench_memory(&args);
    }
    let (label, config, store) = match (&args.random, &args.model) {
        (Some(name), _) => {
            let config = super::random_model::preset(name)?;
            let store = WeightStore::from_bytes(&format!("random {name}"), random_checkpoint(&config, 0))?;
            (format!("{name} (random)"), config, store)
        }
        (None, model) => {
            let model = model.as_deref().unwrap_or(batch_forge::loaders::DEFAULT_MODEL);
            let dir = super::model_dir(model, true)?;
            let config = Gpt2Config::from_file(&dir.join("config.json"))?;
            (model.to_owned(), config, WeightStore::open_dir(&dir)?)
        }
    };
    let stored = match store.get("wte.weight").or_else(|| store.get("transformer.wte.weight")).map(|t| t.dtype) {
        Some(Dtype::F16) => "f16",
        Some(Dtype::BF16) => "bf16",
        _ => "f32",
    };
    let mut dtype = match (args.backend.backend, args.backend.dtype) {
        (BackendChoice::Reference, _) | (_, DtypeChoice::F32) => "f32",
        (_, DtypeChoice::F16) => "f16",
        (_, DtypeChoice::Bf16) => "bf16",
        (_, DtypeChoice::Auto) => stored,
    }
    .to_owned();
    let bytes_per_param = if dtype == "f32" { 4 } else { 2 };
    if args.backend.kv_dtype == "f16" {
        dtype.push_str(" (kv f16)");
    }
    let info = Info { label, dtype, size_gib: (config.n_params() * bytes_per_param) as f64 / (1u64 << 30) as f64 };
    with_backend!(args.backend, |b| bench_on(b, &args, &info, config, &store))
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let var = if v.len() > 1 { v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (v.len() - 1) as f64 } else { 0.0 };
    (mean, var.sqrt())
}

struct Info {
    label: String,
    dtype: String,
    size_gib: f64,
}

fn bench_on<B: Backend>(
    backend: B,
    args: &BenchArgs,
    info: &Info,
    config: Gpt2Config,
    store: &WeightStore,
) -> anyhow::Result<()> {
    let params_m = config.n_params() as f64 / 1e6;
    let model = Gpt2::load(&backend, config, store)?;
    let n_ctx = model.config().n_positions;
    // The gpu backend does not use CPU threads: one row per test, threads shown as "-".
    let on_gpu = backend.name() == "gpu";
    let threads = if args.threads.is_empty() || on_gpu { vec![super::physical_cores()] } else { args.threads.clone() };
    super::outln!("| model | size | params | backend | dtype | threads | test | t/s |");
    super::outln!("| --- | ---: | ---: | --- | --- | ---: | --- | ---: |");
    let mut rng = Rng::new(1);
    let vocab = model.config().vocab_size as u64;
    for &t in &threads {
        anyhow::ensure!(t > 0, "-t must be at least 1");
        let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build()?;
        let tests = args
            .n_prompt
            .iter()
            .filter(|&&n| n > 0)
            .map(|&n| ("pp", n))
            .chain(args.n_gen.iter().filter(|&&n| n > 0).map(|&n| ("tg", n)));
        for (kind, n) in tests {
            anyhow::ensure!(n <= n_ctx, "{kind}{n} exceeds the model's context of {n_ctx}");
            let tokens: Vec<u32> = (0..n).map(|_| (rng.next_u64() % vocab) as u32).collect();
            let mut rates = Vec::new();
            // One KV cache per test, reused by every repetition (each starts again at
            // position 0), as a server reuses its caches and llama-bench its context.
            let mut cache = model.new_cache(&backend, n)?;
            for rep in 0..=args.repetitions {
                let seconds = pool
                    .install(|| -> anyhow::Result<f64> {
                        let start = Instant::now();
                        if kind == "pp" {
                            let seqs = [SeqSlice { rows: 0..n, start_pos: 0 }];
                            let logits = model.forward(
                                &backend,
                                &Batch { tokens: &tokens, seqs: &seqs },
                                &mut [&mut cache],
                                LogitRows::LastOfEachSeq,
                            )?;
                            backend.read(&logits)?;
                        } else {
                            let mut next = tokens[0];
                            // Greedy, on the device when the backend can (as generate does).
                            let mut picker = TokenPicker::new(SamplingParams::greedy())?;
                            for pos in 0..n {
                                let seqs = [SeqSlice { rows: 0..1, start_pos: pos }];
                                let logits = model.forward(
                                    &backend,
                                    &Batch { tokens: &[next], seqs: &seqs },
                                    &mut [&mut cache],
                                    LogitRows::LastOfEachSeq,
                                )?;
                                next = picker.pick(&backend, &logits, pos, pos)?;
                            }
                        }
                        Ok(start.elapsed().as_secs_f64())
                    })
                    .with_context(|| format!("running {kind}{n}"))?;
                if rep > 0 {
                    rates.push(n as f64 / seconds);
                }
            }
            let (mean, sd) = mean_sd(&rates);
            let t = if on_gpu { "-".to_string() } else { t.to_string() };
            super::outln!(
                "| {} | {:.2} GiB | {params_m:.1} M | {} | {} | {t} | {kind}{n} | {mean:.2} ± {sd:.2} |",
                info.label,
                info.size_gib,
                backend.name(),
                info.dtype
            );
        }
    }
    Ok(())
}

/// Read a 1 GiB buffer (huge pages) with all threads; report the median of `-r` runs.
fn bench_memory(args: &BenchArgs) -> anyhow::Result<()> {
    let n = 256 << 20;
    let data = batch_forge::backend::cpu::matmul::huge_page_vec(n, 1.0f32);
    let isa = simd::Isa::detect();
    let threads = if args.threads.is_empty() { vec![super::physical_cores()] } else { args.threads.clone() };
    super::outln!("| test | threads | GB/s (median) | GB/s (best) |");
    super::outln!("| --- | ---: | ---: | ---: |");
    for &t in &threads {
        anyhow::ensure!(t > 0, "-t must be at least 1");
        let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build()?;
        let mut rates: Vec<f64> = (0..=args.repetitions)
            .map(|_| {
                let start = Instant::now();
                let s: f32 = pool.install(|| data.par_chunks(n.div_ceil(t)).map(|c| simd::sum_isa(isa, c)).sum());
                std::hint::black_box(s);
                (n * 4) as f64 / start.elapsed().as_secs_f64() / 1e9
            })
            .skip(1)
            .collect();
        rates.sort_by(f64::total_cmp);
        super::outln!("| memory read 1 GiB | {t} | {:.1} | {:.1} |", rates[rates.len() / 2], rates[rates.len() - 1]);
    }
    Ok(())
}

//! `forge bench`: llama-bench's measurements. pp N = one forward pass over N prompt
//! tokens; tg N = N one-token decode steps from an empty context, or (`-f FILE`) the N
//! tokens after a real prompt's first, optionally with speculative decoding
//! (`--draft-ngram`, `--model-draft`) or a constraint (`--json-schema`, `--grammar`,
//! `--regex`). Each test runs once to warm up, then `-r` times; the table shows mean ±
//! standard deviation of tokens/s.
//! Every flag and every test is checked against the model before the first line is
//! printed; `-o md|json|jsonl|csv` picks llama-bench's output formats and field names.

use std::time::Instant;

use rayon::prelude::*;

use anyhow::Context;
use clap::Args;

use batch_forge::backend::cpu::simd;
use batch_forge::backend::{Backend, SeqSlice};
use batch_forge::chat::Message;
use batch_forge::engine::grammar::{Constraint, GrammarSpec, Grammars};
use batch_forge::engine::sampler::Rng;
use batch_forge::engine::scheduler::{BLOCK_TOKENS, blocks_for, positions_for};
use batch_forge::engine::{Engine, Event, Metrics, Request, SamplingParams, Scheduler, SchedulerConfig};
use batch_forge::loaders::{Gpt2Config, WeightStore, Weights};
use batch_forge::model::random::random_checkpoint;
use batch_forge::model::{Batch, CausalLm, Gpt2, LogitRows};
use batch_forge::tensor::KvDtype;

use super::{BackendArgs, BackendChoice, DtypeChoice, SplitChoice, with_backend};
use batch_forge::tensor::Dtype;

#[derive(Args)]
pub struct BenchArgs {
    /// Model folder, .gguf file, or Hub repo id.
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
    /// Sequences decoded together in the tg tests, as llama-batched-bench's `-npl`: each
    /// step is one forward of one row per sequence (each with its own KV cache), so
    /// the weights are read once for all of them; t/s counts every sequence's tokens.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    npl: Vec<usize>,
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
    /// Instead of a model, measure the FMA peak (GFLOP/s) of the CPU kernels' widest
    /// vectors at each thread count: the roofline for prefill, which is compute-bound.
    #[arg(long, conflicts_with = "memory")]
    flops: bool,
    /// Output format, as llama-bench's `-o`: a markdown table, a JSON array, JSON lines or CSV.
    #[arg(short = 'o', long, value_enum, default_value_t = OutputFormat::Md)]
    output: OutputFormat,
    /// Run the batch-invariant kernels (cpu and gpu; what `forge serve` runs), to measure
    /// what the guarantee costs.
    #[arg(long)]
    batch_invariant: bool,
    /// Start each tg sequence from this prompt (a text file, read as `forge generate -f`
    /// reads it) instead of one random token, and time the tg tokens after the prompt's
    /// first: llama-bench's depth (`tg128 @ d300`) with real text, which speculative
    /// decoding and structured output need.
    #[arg(short = 'f', long = "file", value_name = "FILE")]
    prompt_file: Option<std::path::PathBuf>,
    /// Wrap the -f text in the model's chat template, as one user message.
    #[arg(long, requires = "prompt_file")]
    chat: bool,
    #[command(flatten)]
    spec: super::SpecArgs,
    #[command(flatten)]
    constraint: super::generate::ConstraintArgs,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    Md,
    Json,
    Jsonl,
    Csv,
}

/// The name a model is shown by: a Hub id as given, a folder by its last component.
pub(super) fn display_name(model: &str) -> String {
    let path = std::path::Path::new(model);
    if path.is_file()
        && let Some(name) = path.file_name()
    {
        return name.to_string_lossy().into_owned();
    }
    if path.is_dir()
        && let Some(name) = std::fs::canonicalize(path).ok().as_deref().and_then(|p| p.file_name())
    {
        return name.to_string_lossy().into_owned();
    }
    model.to_owned()
}

/// The CPU's model name (Linux), for the record.
fn cpu_info() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|v| v.trim().to_owned())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_owned())
}

/// The tests to run, in order: ("pp", n) for each prompt length, then ("tg", n).
/// Most sequences one `--npl` test decodes together.
const MAX_SEQS: usize = 256;

fn tests(args: &BenchArgs) -> Vec<(&'static str, usize)> {
    let pp = args.n_prompt.iter().filter(|&&n| n > 0).map(|&n| ("pp", n));
    pp.chain(args.n_gen.iter().filter(|&&n| n > 0).map(|&n| ("tg", n))).collect()
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    anyhow::ensure!(args.repetitions > 0, "-r must be at least 1");
    anyhow::ensure!(
        args.npl.iter().all(|&b| (1..=MAX_SEQS).contains(&b)),
        "--npl: each count of sequences must be 1 to {MAX_SEQS}"
    );
    super::check_threads(&args.threads)?;
    args.backend.validate("bench")?;
    if args.memory || args.flops {
        anyhow::ensure!(args.output == OutputFormat::Md, "--memory and --flops print a markdown table only; drop -o");
        super::warn_threads(&args.threads);
        return if args.flops { bench_flops(&args) } else { bench_memory(&args) };
    }
    anyhow::ensure!(
        !tests(&args).is_empty(),
        "nothing to measure: every -p and -n length is 0 (give e.g. -p 512 -n 128, or --memory)"
    );
    args.spec.validate()?;
    let constraint = args.constraint.spec()?; // files readable, schemas JSON
    let needs_text = [
        (args.prompt_file.is_some(), "-f"),
        (args.spec.is_on(), "--draft-ngram and --model-draft"),
        (constraint.is_some(), "--json-schema, --grammar and --regex"),
    ];
    if let Some((_, what)) = needs_text.iter().find(|(on, _)| *on) {
        anyhow::ensure!(args.random.is_none(), "{what} need a model with its tokenizer (-m), not --random");
        anyhow::ensure!(
            args.n_gen.iter().any(|&n| n > 0),
            "{what} apply to the tg tests; give a generation length (-n)"
        );
    }
    super::warn_threads(&args.threads);
    if args.backend.backend == BackendChoice::Gpu && !args.threads.is_empty() {
        eprintln!("warning: -t does not apply to --backend gpu (one row per test, threads shown as -)");
    }
    let (label, source, stored) = match (&args.random, &args.model) {
        (Some(name), _) => {
            let config = super::random_model::preset(name)?;
            let store = WeightStore::from_bytes(&format!("random {name}"), random_checkpoint(&config, 0))?;
            let stored = super::stored_dtype(&store);
            (format!("{name} (random)"), Source::Random(config, Box::new(Weights::Safetensors(store))), stored)
        }
        (None, model) => {
            let model = model.as_deref().unwrap_or(batch_forge::loaders::DEFAULT_MODEL);
            let path = super::model_dir(model, true, "bench")?;
            let stored = super::stored_dtype_at(&path)?;
            (display_name(model), Source::Path(path), stored)
        }
    };
    let stored = match stored {
        Dtype::F16 => "f16",
        Dtype::BF16 => "bf16",
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
    // A GGUF whose blocks the cpu and gpu backends keep quantized: its type and bytes, as
    // llama-bench shows them.
    let mut file_bytes = None;
    if let (Source::Path(path), BackendChoice::Cpu | BackendChoice::Gpu, DtypeChoice::Auto) =
        (&source, args.backend.backend, args.backend.dtype)
        && let Some((ty, bytes)) = quantized_summary(path)?
    {
        dtype = ty;
        file_bytes = Some(bytes);
    }
    if args.backend.kv_dtype == KvDtype::F16 {
        dtype.push_str(" (kv f16)");
    }
    if args.batch_invariant {
        dtype.push_str(" (batch-invariant)");
    }
    match args.backend.split_k {
        SplitChoice::Auto => {}
        SplitChoice::On => dtype.push_str(" (split-k on)"),
        SplitChoice::Off => dtype.push_str(" (split-k off)"),
    }
    let mut args = args;
    // Verification rows must be computed as a lone decode row would be.
    args.backend.batch_invariant = args.batch_invariant || args.spec.is_on();
    if args.spec.is_on() && !args.batch_invariant {
        dtype.push_str(" (batch-invariant)");
    }
    let info =
        Info { label, dtype, kv: args.backend.kv_dtype.name().to_owned(), size_bytes: 0, bytes_per_param, file_bytes };
    with_backend!(args.backend, |b| bench_on(b, &args, info, &source))
}

/// For a GGUF with block-quantized matrices (which the cpu and gpu backends keep quantized): the
/// type holding most of its bytes (`q4_1`) and the bytes of all its tensors.
pub(super) fn quantized_summary(path: &std::path::Path) -> anyhow::Result<Option<(String, usize)>> {
    use batch_forge::loaders::gguf::{GgmlType, GgufFile};
    if !batch_forge::model::load::is_gguf(path) {
        return Ok(None);
    }
    let file = GgufFile::open(path)?;
    let mut by_type: Vec<(GgmlType, u64)> = Vec::new();
    for t in file.tensor_infos() {
        match by_type.iter_mut().find(|(ty, _)| *ty == t.ggml_type) {
            Some((_, n)) => *n += t.n_bytes,
            None => by_type.push((t.ggml_type, t.n_bytes)),
        }
    }
    let total: u64 = by_type.iter().map(|(_, n)| n).sum();
    // Every block type runs quantized on the cpu backend (Q8_0/Q4_0/Q4_1 as they are, Q4_K
    // as Q4_1 sub-blocks, Q6_K in blocks of 32, the others re-quantized to Q8_0).
    let float = [GgmlType::F32, GgmlType::F16, GgmlType::BF16];
    Ok(by_type
        .iter()
        .filter(|(ty, _)| !float.contains(ty))
        .max_by_key(|(_, n)| *n)
        .map(|(ty, _)| (ty.name().to_ascii_lowercase(), total as usize)))
}

/// The model to measure: random GPT-2 weights in memory, or a folder or GGUF file.
enum Source {
    Random(Gpt2Config, Box<Weights>),
    Path(std::path::PathBuf),
}

fn mean_sd(v: &[f64]) -> (f64, f64) {
    let mean = v.iter().sum::<f64>() / v.len() as f64;
    let var = if v.len() > 1 { v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (v.len() - 1) as f64 } else { 0.0 };
    (mean, var.sqrt())
}

struct Info {
    label: String,
    dtype: String,
    kv: String,
    /// The weights' bytes as llama-bench reports them: set once the model is loaded.
    size_bytes: usize,
    /// Bytes per parameter of float weights.
    bytes_per_param: usize,
    /// A quantized GGUF's tensor bytes (its size as stored).
    file_bytes: Option<usize>,
}

/// One measured test, with llama-bench's field names where it has them.
struct Row<'a> {
    info: &'a Info,
    n_params: usize,
    backend: String,
    threads: Option<usize>,
    kind: &'static str,
    n: usize,
    /// Sequences decoded together (tg; 1 for pp).
    seqs: usize,
    /// Seconds of each repetition.
    samples: Vec<f64>,
    /// Prompt tokens before a tg test (`-f`; llama-bench's depth).
    depth: usize,
    /// What the test's name adds: ` +ngram3`, ` +json-schema`.
    suffix: String,
    /// Speculative decoding: draft tokens verified and accepted over the repetitions.
    spec: Option<(u64, u64)>,
    /// tg: tokens each sequence generated in a timed run, on average (a constrained
    /// output may end before `n`).
    generated: Option<f64>,
}

impl Row<'_> {
    /// `pp512`, `tg128`, `tg128 x16` for 16 sequences decoded together, `tg128 @ d300`
    /// after a prompt of 300 tokens, `tg128 @ d300 +ngram3` with n-gram drafts.
    fn test(&self) -> String {
        let mut t = format!("{}{}", self.kind, self.n);
        if self.seqs > 1 {
            t.push_str(&format!(" x{}", self.seqs));
        }
        if self.depth > 0 {
            t.push_str(&format!(" @ d{}", self.depth));
        }
        t + &self.suffix
    }

    /// The share of drafted tokens accepted.
    fn acceptance(&self) -> Option<f64> {
        self.spec.map(|(d, a)| if d == 0 { 0.0 } else { a as f64 / d as f64 })
    }

    fn json(&self) -> serde_json::Value {
        let ns: Vec<u64> = self.samples.iter().map(|s| (s * 1e9).round() as u64).collect();
        let ts: Vec<f64> = self.samples.iter().map(|s| (self.n * self.seqs) as f64 / s).collect();
        let (avg_ns, sd_ns) = mean_sd(&self.samples.iter().map(|s| s * 1e9).collect::<Vec<_>>());
        let (avg_ts, sd_ts) = mean_sd(&ts);
        serde_json::json!({
            "build_version": env!("CARGO_PKG_VERSION"),
            "cpu_info": cpu_info(),
            "model_type": self.info.label,
            "model_size": self.info.size_bytes,
            "model_n_params": self.n_params,
            "backends": self.backend,
            "dtype": self.info.dtype,
            "type_k": self.info.kv,
            "type_v": self.info.kv,
            "n_threads": self.threads,
            "n_prompt": if self.kind == "pp" { self.n } else { 0 },
            "n_gen": if self.kind == "tg" { self.n } else { 0 },
            "n_depth": self.depth,
            "n_seqs": self.seqs,
            "test": self.test(),
            "n_gen_avg": self.generated,
            "n_drafted": self.spec.map(|s| s.0),
            "n_accepted": self.spec.map(|s| s.1),
            "accept_rate": self.acceptance(),
            "avg_ns": avg_ns.round() as u64,
            "stddev_ns": sd_ns.round() as u64,
            "avg_ts": avg_ts,
            "stddev_ts": sd_ts,
            "samples_ns": ns,
            "samples_ts": ts,
        })
    }
}

const CSV_FIELDS: [&str; 24] = [
    "build_version",
    "cpu_info",
    "model_type",
    "model_size",
    "model_n_params",
    "backends",
    "dtype",
    "type_k",
    "type_v",
    "n_threads",
    "n_prompt",
    "n_gen",
    "n_depth",
    "test",
    "n_gen_avg",
    "n_drafted",
    "n_accepted",
    "accept_rate",
    "avg_ns",
    "stddev_ns",
    "avg_ts",
    "stddev_ts",
    "samples_ns",
    "samples_ts",
];

/// Writes rows in the chosen format as they are measured.
struct Printer {
    format: OutputFormat,
    rows: usize,
}

impl Printer {
    fn begin(format: OutputFormat) -> anyhow::Result<Self> {
        match format {
            OutputFormat::Md => {
                super::outln!("| model | size | params | backend | dtype | threads | test | t/s |");
                super::outln!("| --- | ---: | ---: | --- | --- | ---: | --- | ---: |");
            }
            OutputFormat::Json => super::outln!("["),
            OutputFormat::Csv => super::outln!("{}", CSV_FIELDS.join(",")),
            OutputFormat::Jsonl => {}
        }
        Ok(Printer { format, rows: 0 })
    }

    fn row(&mut self, row: &Row) -> anyhow::Result<()> {
        let v = row.json();
        match self.format {
            OutputFormat::Md => {
                let (mean, sd) =
                    (v["avg_ts"].as_f64().unwrap_or(f64::NAN), v["stddev_ts"].as_f64().unwrap_or(f64::NAN));
                let t = row.threads.map_or("-".to_owned(), |t| t.to_string());
                let mut test = row.test();
                if let Some(rate) = row.acceptance() {
                    test.push_str(&format!(" ({:.0}% accepted)", 100.0 * rate));
                }
                if let Some(g) = row.generated.filter(|&g| g + 0.5 < row.n as f64) {
                    test.push_str(&format!(" ({g:.0} tokens)"));
                }
                super::outln!(
                    "| {} | {:.2} GiB | {:.1} M | {} | {} | {t} | {test} | {mean:.2} ± {sd:.2} |",
                    row.info.label,
                    row.info.size_bytes as f64 / (1u64 << 30) as f64,
                    row.n_params as f64 / 1e6,
                    row.backend,
                    row.info.dtype,
                );
            }
            OutputFormat::Json => {
                let sep = if self.rows > 0 { "," } else { "" };
                super::outln!("{sep}{}", serde_json::to_string_pretty(&v)?);
            }
            OutputFormat::Jsonl => super::outln!("{v}"),
            OutputFormat::Csv => {
                let cell = |x: &serde_json::Value| match x {
                    serde_json::Value::String(s) => format!("\"{}\"", s.replace('"', "\"\"")),
                    serde_json::Value::Array(a) => {
                        format!("\"{}\"", a.iter().map(|e| e.to_string()).collect::<Vec<_>>().join(" "))
                    }
                    serde_json::Value::Null => String::new(),
                    other => other.to_string(),
                };
                let cells: Vec<String> = CSV_FIELDS.iter().map(|f| cell(&v[*f])).collect();
                super::outln!("{}", cells.join(","));
            }
        }
        self.rows += 1;
        Ok(())
    }

    fn end(self) -> anyhow::Result<()> {
        if self.format == OutputFormat::Json {
            super::outln!("]");
        }
        Ok(())
    }
}

fn bench_on<B: Backend>(backend: B, args: &BenchArgs, info: Info, source: &Source) -> anyhow::Result<()> {
    match source {
        Source::Random(config, weights) => {
            let model = Gpt2::load(&backend, config.clone(), weights)?;
            bench_model(&backend, &model, None, args, info)
        }
        Source::Path(path) => {
            let mut engine = args.backend.load_engine(backend, path)?;
            args.spec.apply(&mut engine, "bench")?;
            bench_model(&engine.backend, &*engine.model, Some(&engine), args, info)
        }
    }
}

/// What a tg test feeds and holds each sequence to, from `-f`, `--chat` and the
/// constraint flags (none of them: one random token per sequence, unconstrained).
struct TgInput {
    /// The prompt every sequence starts from.
    prompt: Option<Vec<u32>>,
    constraint: Option<Constraint>,
    /// What the test's name adds: ` +ngram3`, ` +json-schema`.
    suffix: String,
}

fn tg_input<B: Backend>(engine: Option<&Engine<B>>, args: &BenchArgs) -> anyhow::Result<TgInput> {
    let mut input = TgInput { prompt: None, constraint: None, suffix: String::new() };
    let Some(engine) = engine else { return Ok(input) };
    if let Some(file) = &args.prompt_file {
        let text = std::fs::read_to_string(file).with_context(|| format!("-f {}: cannot read it", file.display()))?;
        let text = super::drop_trailing_newline(text);
        let ids =
            if args.chat { engine.chat_prompt_ids(&[Message::new("user", &text)])? } else { engine.prompt_ids(&text) };
        anyhow::ensure!(!ids.is_empty(), "-f {}: the prompt is empty", file.display());
        input.prompt = Some(ids);
    }
    if let Some(spec) = args.constraint.spec()? {
        let info = engine.model.info();
        let grammars = Grammars::new(&engine.text.tokenizer, info.vocab_size, &engine.text.end_of_generation)?;
        input.constraint = Some(grammars.compile(&spec).map_err(anyhow::Error::msg)?);
        input.suffix.push_str(match spec {
            GrammarSpec::JsonSchema(_) => " +json-schema",
            GrammarSpec::JsonObject => " +json",
            GrammarSpec::Regex(_) => " +regex",
            _ => " +grammar",
        });
    }
    match (&args.spec.draft_ngram, &args.spec.model_draft) {
        (Some(n), _) => input.suffix.push_str(&format!(" +ngram{n}")),
        (None, Some(_)) => input.suffix.push_str(" +draft"),
        (None, None) => {}
    }
    Ok(input)
}

/// One tg run's measurements.
struct TgRun {
    /// Seconds from the first generated token of every sequence (with a prompt) or from
    /// the start (without), to the end.
    seconds: f64,
    /// Tokens generated in that time, over all sequences.
    tokens: usize,
    /// Draft tokens verified, and accepted.
    drafted: u64,
    accepted: u64,
}

/// `seqs` sequences decoded together by the engine's scheduler, as generate and serve run
/// them (on the device where the backend can pick there), greedily. Without a prompt each
/// starts from one random token and all `n` tokens are timed; with one, each starts from
/// it and the `n` tokens after the prompt's own are timed, from the step in which the last
/// sequence got its first token. A constrained sequence may end before `n`.
fn tg_run<B: Backend>(
    backend: &B,
    model: &dyn CausalLm<B>,
    engine: Option<&Engine<B>>,
    input: &TgInput,
    starts: &[u32],
    n: usize,
    seqs: usize,
) -> anyhow::Result<TgRun> {
    let (prompt_len, extra) = match &input.prompt {
        Some(p) => (p.len(), 1),
        None => (1, 0),
    };
    let draft_rows = engine.and_then(|e| e.speculation.as_ref()).map_or(0, |s| s.draft_max);
    let config = SchedulerConfig {
        parallel: seqs,
        ctx_size: seqs * blocks_for(positions_for(prompt_len, n + extra)) * BLOCK_TOKENS,
        // Every prompt in one step, and every draft verified.
        batch_tokens: (seqs * prompt_len).max(seqs * (1 + draft_rows)),
        prefix_cache: false,
        // Every position up front: a tg run measures decoding, not a cache growing
        // (each sequence's cache is still allocated in the run, as a server request's is).
        initial_slack: usize::MAX,
        step_delay: std::time::Duration::ZERO,
    };
    let mut scheduler = match engine {
        Some(e) => e.scheduler(config),
        None => Scheduler::new(backend, model, config, Vec::new(), std::sync::Arc::new(Metrics::default())),
    };
    for (i, &t) in starts[..seqs].iter().enumerate() {
        let prompt = input.prompt.clone().unwrap_or_else(|| vec![t]);
        let mut r = Request::new(i as u64, prompt, n + extra, SamplingParams::greedy());
        r.ignore_eos = true; // a constrained sequence still ends once its output is complete
        r.constraint = input.constraint.clone();
        scheduler.add(r);
    }
    let start = Instant::now();
    let mut from = if extra == 0 { Some(start) } else { None };
    let (mut first, mut tokens) = (vec![false; seqs], 0);
    let mut events = Vec::with_capacity(2 * seqs);
    while scheduler.busy() {
        scheduler.step(&mut events);
        for (id, e) in events.drain(..) {
            match e {
                Event::Token { .. } | Event::EndToken { .. } => {
                    if from.is_some() {
                        tokens += 1;
                    } else {
                        first[id as usize] = true;
                    }
                }
                Event::Failed(e) => anyhow::bail!(e),
                _ => {}
            }
        }
        if from.is_none() && first.iter().all(|&f| f) {
            from = Some(Instant::now());
        }
    }
    let m = scheduler.metrics();
    Ok(TgRun {
        seconds: from.map_or(0.0, |f| f.elapsed().as_secs_f64()),
        tokens,
        drafted: m.spec_draft_tokens.load(std::sync::atomic::Ordering::Relaxed),
        accepted: m.spec_accepted_tokens.load(std::sync::atomic::Ordering::Relaxed),
    })
}

fn bench_model<B: Backend>(
    backend: &B,
    model: &dyn CausalLm<B>,
    engine: Option<&Engine<B>>,
    args: &BenchArgs,
    mut info: Info,
) -> anyhow::Result<()> {
    let n_params = model.info().n_params;
    info.size_bytes = info.file_bytes.unwrap_or(n_params.saturating_mul(info.bytes_per_param));
    let info = &info;
    let input = tg_input(engine, args)?;
    // Every test checked before any output.
    let n_ctx = model.info().context_length;
    for (kind, n) in tests(args) {
        anyhow::ensure!(n <= n_ctx, "{kind}{n} exceeds the model's context of {n_ctx} tokens");
        if let (Some(p), "tg") = (&input.prompt, kind) {
            let total = p.len() + n;
            anyhow::ensure!(
                total <= n_ctx,
                "tg{n} after the prompt of {} tokens needs {total} positions; the model's context is {n_ctx}",
                p.len()
            );
        }
    }
    // The gpu backend does not use CPU threads: one row per test, threads shown as "-".
    let on_gpu = backend.name() == "gpu";
    let threads = if args.threads.is_empty() || on_gpu { vec![super::physical_cores()] } else { args.threads.clone() };
    if backend.name() == "cpu" {
        // The kernels this run measures, once every test has passed validation.
        let isa = simd::Isa::detect();
        eprintln!("{}", isa.describe(Some(isa.fma_peak(0.05))));
    }
    let mut printer = Printer::begin(args.output)?;
    let mut rng = Rng::new(1);
    let vocab = model.info().vocab_size as u64;
    for &t in &threads {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build()?;
        for (kind, n, seqs) in runs(args) {
            let tokens: Vec<u32> = (0..n.max(seqs)).map(|_| (rng.next_u64() % vocab) as u32).collect();
            let mut samples = Vec::new();
            let (mut drafted, mut accepted, mut generated) = (0, 0, 0);
            // pp: one KV cache, reused by every repetition (each starts again at position
            // 0), as llama-bench reuses its context.
            let mut cache = if kind == "pp" { Some(model.new_cache(backend, n)?) } else { None };
            for rep in 0..=args.repetitions {
                let seconds = pool
                    .install(|| -> anyhow::Result<f64> {
                        if kind == "pp" {
                            let start = Instant::now();
                            let seqs = [SeqSlice { rows: 0..n, start_pos: 0 }];
                            let logits = model.forward(
                                backend,
                                &Batch { tokens: &tokens[..n], seqs: &seqs },
                                &mut [cache.as_mut().expect("pp has a cache")],
                                LogitRows::LastOfEachSeq,
                            )?;
                            backend.read(&logits)?;
                            return Ok(start.elapsed().as_secs_f64());
                        }
                        let run = tg_run(backend, model, engine, &input, &tokens, n, seqs)?;
                        anyhow::ensure!(
                            run.tokens > 0,
                            "tg{n}: every output was complete with its first token, so there is nothing to time \
                             (a constraint that allows longer outputs?)"
                        );
                        if rep > 0 {
                            (drafted, accepted, generated) =
                                (drafted + run.drafted, accepted + run.accepted, generated + run.tokens);
                        }
                        // As the time of n tokens per sequence at the measured rate (a
                        // constrained output may end sooner).
                        Ok(run.seconds * (n * seqs) as f64 / run.tokens as f64)
                    })
                    .with_context(|| format!("running {kind}{n}"))?;
                if rep > 0 {
                    samples.push(seconds);
                }
            }
            let threads = (!on_gpu).then_some(t);
            let tg = kind == "tg";
            printer.row(&Row {
                info,
                n_params,
                backend: backend.name().to_owned(),
                threads,
                kind,
                n,
                seqs,
                samples,
                depth: if tg { input.prompt.as_ref().map_or(0, |p| p.len()) } else { 0 },
                suffix: if tg { input.suffix.clone() } else { String::new() },
                spec: (tg && engine.is_some_and(|e| e.speculation.is_some())).then_some((drafted, accepted)),
                generated: tg.then_some(generated as f64 / args.repetitions as f64 / seqs as f64),
            })?;
        }
    }
    printer.end()
}

/// Each test with its sequence count: pp once, tg once per `--npl` value.
fn runs(args: &BenchArgs) -> Vec<(&'static str, usize, usize)> {
    let mut out = Vec::new();
    for (kind, n) in tests(args) {
        if kind == "pp" {
            out.push((kind, n, 1));
        } else {
            out.extend(args.npl.iter().map(|&b| (kind, n, b)));
        }
    }
    out
}

/// `rate()` run `repetitions` times after one warm-up run: (median, best).
fn median_and_best(repetitions: usize, mut rate: impl FnMut() -> f64) -> (f64, f64) {
    let mut rates: Vec<f64> = (0..=repetitions).map(|_| rate()).skip(1).collect();
    rates.sort_by(f64::total_cmp);
    (rates[rates.len() / 2], rates[rates.len() - 1])
}

/// Run the FMA probe on every thread at once (about 0.2 s a run); report the median of
/// `-r` runs, for the whole team and per thread.
fn bench_flops(args: &BenchArgs) -> anyhow::Result<()> {
    let isa = simd::Isa::detect();
    let threads = if args.threads.is_empty() { vec![super::physical_cores()] } else { args.threads.clone() };
    // Calibrate the rounds per run on one thread.
    let start = Instant::now();
    let probe = 1 << 20;
    std::hint::black_box(simd::fma_probe(isa, probe));
    let iters = ((0.2 / start.elapsed().as_secs_f64().max(1e-6)) * probe as f64).clamp(1e5, 1e10) as usize;
    super::outln!("| test | isa | threads | GFLOP/s (median) | GFLOP/s (best) | per thread |");
    super::outln!("| --- | --- | ---: | ---: | ---: | ---: |");
    for &t in &threads {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build()?;
        // One probe on each of the pool's threads at once.
        let (median, best) = median_and_best(args.repetitions, || {
            let start = Instant::now();
            let flops: f64 = pool.broadcast(|_| simd::fma_probe(isa, iters)).iter().sum();
            flops / start.elapsed().as_secs_f64() / 1e9
        });
        let (bits, name, per_thread) = (isa.vector_bits(), isa.name(), median / t as f64);
        super::outln!("| fma f32 ({bits}-bit) | {name} | {t} | {median:.1} | {best:.1} | {per_thread:.1} |");
    }
    Ok(())
}

/// Read a 1 GiB buffer (huge pages) with all threads; report the median of `-r` runs.
fn bench_memory(args: &BenchArgs) -> anyhow::Result<()> {
    let n = 256 << 20;
    let data = batch_forge::backend::cpu::weights::WeightBuf::filled(n, 1.0f32);
    let isa = simd::Isa::detect();
    let threads = if args.threads.is_empty() { vec![super::physical_cores()] } else { args.threads.clone() };
    super::outln!("| test | threads | GB/s (median) | GB/s (best) |");
    super::outln!("| --- | ---: | ---: | ---: |");
    for &t in &threads {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build()?;
        let (median, best) = median_and_best(args.repetitions, || {
            let start = Instant::now();
            let s: f32 = pool.install(|| data.par_chunks(n.div_ceil(t)).map(|c| simd::sum_isa(isa, c)).sum());
            std::hint::black_box(s);
            (n * 4) as f64 / start.elapsed().as_secs_f64() / 1e9
        });
        super::outln!("| memory read 1 GiB | {t} | {median:.1} | {best:.1} |");
    }
    Ok(())
}

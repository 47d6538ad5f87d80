//! Command-line interface: argument definitions and dispatch to the subcommands.

mod bench;
mod chat;
mod devices;
mod generate;
mod health;
mod inspect;
mod perplexity;
mod quantize;
mod random_model;
mod serve;
mod tokenize;
mod verify;

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

use batch_forge::backend::cpu::CpuOptions;
use batch_forge::backend::{Backend, WeightDtype};
use batch_forge::engine::Engine;
use batch_forge::loaders::{self, hub::HubClient};
use batch_forge::tensor::KvDtype;

/// `forge --version`: the crate version, the git commit it was built from, the features.
#[cfg(feature = "gpu")]
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (", env!("FORGE_GIT_COMMIT"), "; features: gpu)");
/// `forge --version` of a CPU-only build.
#[cfg(not(feature = "gpu"))]
const VERSION: &str = concat!(env!("CARGO_PKG_VERSION"), " (", env!("FORGE_GIT_COMMIT"), "; features: none, cpu only)");

#[derive(Parser)]
#[command(
    name = "forge",
    version = VERSION,
    about = "batch_forge: GPT-2, Llama-family and Gemma 3 inference (safetensors, GGUF), verified against Hugging Face transformers and llama.cpp"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, streaming it to stdout.
    Generate(Box<generate::GenerateArgs>),
    /// Talk with a model through its chat template (interactive; keeps the KV cache between turns).
    Chat(chat::ChatArgs),
    /// Perplexity of a text file, with llama-perplexity's method and output.
    Perplexity(perplexity::PerplexityArgs),
    /// Print the token ids of a text (or of JSON lines on stdin with --jsonl).
    Tokenize(tokenize::TokenizeArgs),
    /// Print the text of token ids (or of JSON lines on stdin with --jsonl).
    Detokenize(tokenize::DetokenizeArgs),
    /// Measure prompt processing (pp) and token generation (tg) speed, llama-bench style.
    Bench(bench::BenchArgs),
    /// Write a random-weight GPT-2 checkpoint folder of any published size.
    RandomModel(random_model::RandomModelArgs),
    /// List the GPU adapters the gpu backend can use, with their API and limits.
    Devices,
    /// Print the metadata and tensor table of a GGUF or safetensors file.
    Inspect(inspect::InspectArgs),
    /// Write a GGUF file quantized to another type (llama-quantize's types, choices and bytes).
    Quantize(quantize::QuantizeArgs),
    /// Serve the model over HTTP: OpenAI-compatible completions and chat, continuous batching.
    Serve(serve::ServeArgs),
    /// Check that a running server is ready (its /health answers 200): exit status 0 or 1.
    Health(health::HealthArgs),
    /// Compare the model stage by stage (embeddings, each block, final norm, logits)
    /// with a HF transformers dump from scripts/hf_reference.py.
    Verify(verify::VerifyArgs),
}

/// Which implementation runs the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    /// The fast CPU backend: SIMD kernels, all cores, f32/f16/bf16 weights.
    Cpu,
    /// The plain reference backend: the ground truth every backend is tested against.
    Reference,
    /// The GPU backend: WGSL kernels through wgpu (Vulkan, Metal, DX12).
    Gpu,
    /// `generate` only: cpu and gpu in lockstep, printing the max logit difference per
    /// step and stopping at the first step where their argmax differs.
    Both,
}

/// `--dtype`: how the cpu and gpu backends store weights.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum DtypeChoice {
    /// As stored in the file (f32, f16 or bf16).
    Auto,
    F32,
    F16,
    Bf16,
}

/// `--split-k`: whether the gpu's tiled matmul splits over K.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SplitChoice {
    Auto,
    On,
    Off,
}

/// Backend selection flags shared by `generate` and `bench`.
#[derive(clap::Args, Clone)]
pub struct BackendArgs {
    #[arg(long, value_enum, default_value_t = BackendChoice::Cpu)]
    pub backend: BackendChoice,
    /// Weight storage (cpu: f32/f16/bf16, gpu: f32/f16); 16-bit halves the bytes read per token.
    #[arg(long, value_enum, default_value_t = DtypeChoice::Auto)]
    pub dtype: DtypeChoice,
    /// KV-cache storage (cpu and gpu; f16 on the gpu needs shader-f16).
    #[arg(long, value_name = "f32|f16", default_value_t = KvDtype::F32)]
    pub kv_dtype: KvDtype,
    /// Sliding-window layers (Gemma 3) keep every position instead of a ring of their
    /// window plus 512 (llama.cpp's --swa-full): more memory, prefix-cache hits anywhere
    /// in a finished sequence.
    #[arg(long)]
    pub swa_full: bool,
    /// gpu: split the tiled matmul over K (auto: decode batches of up to 64 rows whose
    /// grid would be small, on a GPU). The same bits either way; for comparing the two.
    #[arg(long, value_enum, default_value_t = SplitChoice::Auto)]
    pub split_k: SplitChoice,
    /// Batch-invariant cpu kernels (set by `serve`, not a flag).
    #[arg(skip)]
    pub batch_invariant: bool,
}

impl BackendArgs {
    /// The model at `path` on `backend`, its KV caches laid out as these flags say.
    pub fn load_engine<B: Backend>(&self, backend: B, path: &std::path::Path) -> anyhow::Result<Engine<B>> {
        let engine = Engine::load(backend, path)?;
        Ok(if self.swa_full { engine.keep_whole_windows() } else { engine })
    }

    /// Every check of these flags that needs no device and no file, so a bad flag is
    /// reported first, on any machine (with or without a GPU driver).
    pub fn validate(&self, command: &str) -> anyhow::Result<()> {
        self.cpu_options()?;
        match self.backend {
            BackendChoice::Both if command != "generate" => {
                anyhow::bail!("--backend both runs cpu and gpu in lockstep and is for `forge generate` only")
            }
            BackendChoice::Gpu | BackendChoice::Both => {
                anyhow::ensure!(
                    self.dtype != DtypeChoice::Bf16,
                    "the gpu backend stores weights in f32 or f16; bf16 is cpu-only"
                );
                #[cfg(not(feature = "gpu"))]
                return Err(no_gpu_build());
            }
            _ => anyhow::ensure!(
                self.split_k == SplitChoice::Auto,
                "--split-k chooses how the gpu backend runs its matmul; add --backend gpu"
            ),
        }
        Ok(())
    }

    pub fn cpu_options(&self) -> anyhow::Result<CpuOptions> {
        let weight_dtype = match self.dtype {
            DtypeChoice::Auto => None,
            DtypeChoice::F32 => Some(WeightDtype::F32),
            DtypeChoice::F16 => Some(WeightDtype::F16),
            DtypeChoice::Bf16 => Some(WeightDtype::BF16),
        };
        if self.backend == BackendChoice::Reference {
            anyhow::ensure!(
                self.dtype == DtypeChoice::Auto && self.kv_dtype == KvDtype::F32,
                "the reference backend computes in f32 only; --dtype and --kv-dtype apply to --backend cpu"
            );
        }
        Ok(CpuOptions {
            weight_dtype,
            kv_dtype: self.kv_dtype,
            batch_invariant: self.batch_invariant,
            ..CpuOptions::default()
        })
    }

    #[cfg(feature = "gpu")]
    pub fn gpu_options(&self) -> anyhow::Result<batch_forge::backend::gpu::GpuOptions> {
        let cpu = self.cpu_options()?;
        Ok(batch_forge::backend::gpu::GpuOptions {
            weight_dtype: cpu.weight_dtype,
            kv_dtype: cpu.kv_dtype,
            batch_invariant: cpu.batch_invariant,
            split_k: match self.split_k {
                SplitChoice::Auto => None,
                SplitChoice::On => Some(true),
                SplitChoice::Off => Some(false),
            },
            ..Default::default()
        })
    }
}

/// Speculative decoding flags shared by `generate`, `chat` and `serve` (llama.cpp's names).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct SpecArgs {
    /// Speculative decoding by prompt lookup: draft the tokens that followed the latest
    /// earlier occurrence of the last N tokens (N, then shorter). The output is unchanged.
    #[arg(long = "draft-ngram", value_name = "N", conflicts_with = "model_draft",
          value_parser = clap::value_parser!(u32).range(1..=64))]
    pub draft_ngram: Option<u32>,
    /// Speculative decoding with a draft model (a folder or .gguf file with the same
    /// tokenizer, much smaller than the model; llama.cpp's -md). The output is unchanged.
    #[arg(long = "model-draft", value_name = "MODEL")]
    pub model_draft: Option<String>,
    /// Tokens drafted per step at most.
    #[arg(long = "draft-max", visible_alias = "draft", value_name = "N",
          default_value_t = batch_forge::engine::speculate::DEFAULT_DRAFT_MAX as u32,
          value_parser = clap::value_parser!(u32).range(1..=256))]
    pub draft_max: u32,
    /// Drafts shorter than N tokens are not verified.
    #[arg(long = "draft-min", value_name = "N", default_value_t = 0,
          value_parser = clap::value_parser!(u32).range(0..=256))]
    pub draft_min: u32,
    /// Draft only while at most N sequences run (serve; vLLM's disable_by_batch_size):
    /// a larger batch keeps the CPU busy, and verifying drafts then costs more than it saves.
    #[arg(long = "draft-batch-max", value_name = "N", default_value_t = DEFAULT_DRAFT_BATCH_MAX,
          value_parser = clap::value_parser!(u32).range(1..))]
    pub draft_batch_max: u32,
}

/// `--draft-batch-max`'s default: measured on a 2-core Zen 4, n-gram speculation on a
/// copying task gains at 4 streams, breaks even at 8 and loses at 16.
pub const DEFAULT_DRAFT_BATCH_MAX: u32 = 8;

impl SpecArgs {
    pub fn is_on(&self) -> bool {
        self.draft_ngram.is_some() || self.model_draft.is_some()
    }

    /// The checks that need no model.
    pub fn validate(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.draft_min <= self.draft_max,
            "--draft-min {} is larger than --draft-max {}",
            self.draft_min,
            self.draft_max
        );
        if !self.is_on() {
            let set = [
                (self.draft_max != batch_forge::engine::speculate::DEFAULT_DRAFT_MAX as u32, "--draft-max"),
                (self.draft_min != 0, "--draft-min"),
                (self.draft_batch_max != DEFAULT_DRAFT_BATCH_MAX, "--draft-batch-max"),
            ];
            if let Some((_, flag)) = set.iter().find(|(on, _)| *on) {
                anyhow::bail!("{flag} needs --draft-ngram N or --model-draft MODEL");
            }
        }
        Ok(())
    }

    /// Turn speculation on in `engine` (loading the draft model on its backend).
    pub fn apply<B: batch_forge::backend::Backend>(
        &self,
        engine: &mut batch_forge::engine::Engine<B>,
        command: &str,
    ) -> anyhow::Result<()> {
        use batch_forge::engine::{DraftMethod, Speculation};
        let (method, tokenizer) = match (&self.draft_ngram, &self.model_draft) {
            (Some(n), _) => (DraftMethod::Ngram(*n as usize), None),
            (None, Some(m)) => {
                let dir = model_dir(m, true, command)?;
                let l = batch_forge::model::load_model(&engine.backend, &dir)
                    .map_err(|e| anyhow::anyhow!("--model-draft {m}: {e:#}"))?;
                (DraftMethod::Model(l.model), Some(l.text.tokenizer))
            }
            (None, None) => return Ok(()),
        };
        let speculation = Speculation {
            method,
            draft_max: self.draft_max as usize,
            draft_min: self.draft_min as usize,
            batch_max: self.draft_batch_max as usize,
        };
        let what = speculation.describe();
        engine.speculate(speculation, tokenizer.as_ref()).map_err(|e| match &self.model_draft {
            Some(m) => anyhow::anyhow!("--model-draft {m}: {e:#}"),
            None => e.into(),
        })?;
        eprintln!("speculative decoding: {what}; batch-invariant kernels, so the tokens are those of plain decoding");
        Ok(())
    }
}

/// A software adapter is the only one: say that `--backend gpu` runs on the CPU here.
#[cfg(feature = "gpu")]
pub fn warn_if_software(gpu: &batch_forge::backend::gpu::GpuBackend) {
    if gpu.is_software() {
        eprintln!(
            "warning: {} is a software rasterizer: --backend gpu runs on the CPU here, far slower than --backend cpu",
            gpu.adapter_info().name
        );
    }
}

/// The error for `--backend gpu` in a build without the `gpu` feature.
#[cfg(not(feature = "gpu"))]
pub fn no_gpu_build() -> anyhow::Error {
    anyhow::anyhow!("this forge was built without GPU support (rebuild with the default `gpu` feature)")
}

/// `println!` that returns the write error instead of panicking, so `forge ... | head`
/// ends quietly (see [`is_broken_pipe`]).
macro_rules! outln {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*).map_err(anyhow::Error::from)?
    }};
}
pub(crate) use outln;

/// Run `$body` with `$b` bound to the chosen backend (each backend is its own type).
macro_rules! with_backend {
    ($args:expr, |$b:ident| $body:expr) => {{
        let opts = $args.cpu_options()?;
        match $args.backend {
            $crate::cli::BackendChoice::Cpu => {
                let $b = batch_forge::backend::cpu::CpuBackend::new(opts)?;
                $body
            }
            $crate::cli::BackendChoice::Reference => {
                let $b = batch_forge::backend::reference::ReferenceBackend;
                $body
            }
            $crate::cli::BackendChoice::Gpu => {
                #[cfg(feature = "gpu")]
                {
                    let $b = batch_forge::backend::gpu::GpuBackend::new($args.gpu_options()?)?;
                    eprintln!("gpu: {}", $b.description());
                    $crate::cli::warn_if_software(&$b);
                    if $args.dtype == $crate::cli::DtypeChoice::F16 && !$b.has_f16() {
                        eprintln!("warning: this adapter has no shader-f16; weights stay f32");
                    }
                    $body
                }
                #[cfg(not(feature = "gpu"))]
                {
                    return Err($crate::cli::no_gpu_build());
                }
            }
            $crate::cli::BackendChoice::Both => {
                anyhow::bail!("--backend both runs cpu and gpu in lockstep and is for `forge generate` only")
            }
        }
    }};
}
pub(crate) use with_backend;

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Generate(a) => generate::run(*a),
        Command::Chat(a) => chat::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Tokenize(a) => tokenize::run(a),
        Command::Detokenize(a) => tokenize::run_detokenize(a),
        Command::Bench(a) => bench::run(a),
        Command::RandomModel(a) => random_model::run(a),
        Command::Devices => devices::run(),
        Command::Inspect(a) => inspect::run(a),
        Command::Quantize(a) => quantize::run(a),
        Command::Verify(a) => verify::run(a),
        Command::Serve(a) => serve::run(a),
        Command::Health(a) => health::run(a),
    }
}

/// llama.cpp flags that have no meaning here, with the reason, so a user typing them by
/// habit gets "not supported" rather than a misparse (`-ngl` read as `-n gl`).
const UNSUPPORTED: &[(&[&str], &str)] = &[
    (&["-ngl", "--gpu-layers", "--n-gpu-layers"], "the whole model runs on one backend; use --backend gpu"),
    (&["-fa", "--flash-attn"], "attention is always fused (one pass with an online softmax)"),
    (&["-b", "--batch-size", "-ub", "--ubatch-size"], "the prompt is processed in one pass"),
    (&["--mlock", "--no-mmap", "--mmap", "-mmp", "--numa"], "weights are memory-mapped once and converted at load"),
    (&["-nkvo", "--no-kv-offload"], "the KV cache lives where the backend runs"),
    (&["-pg"], "combined prompt+generation tests are not implemented; use -p and -n"),
    (
        &["-sm", "--split-mode", "-mg", "--main-gpu", "-ts", "--tensor-split", "-dev", "--device"],
        "one GPU is used; BATCH_FORGE_GPU picks it",
    ),
    (&["-ctk", "--cache-type-k", "-ctv", "--cache-type-v"], "use --kv-dtype f32|f16"),
    (
        &["-cnv", "--conversation", "-i", "--interactive", "-if", "--interactive-first", "-r", "--reverse-prompt"],
        "generate runs one prompt; `forge chat -m MODEL` is the conversation mode (--chat wraps one prompt)",
    ),
    (
        &[
            "--mirostat",
            "--mirostat-lr",
            "--mirostat-ent",
            "--typical",
            "--xtc-probability",
            "--xtc-threshold",
            "--dry-multiplier",
        ],
        "this sampler is not implemented (use --temp, --top-k, --top-p, --min-p, --repeat-penalty, \
         --presence-penalty, --frequency-penalty)",
    ),
    (&["--lora", "--lora-scaled", "--control-vector"], "adapters are not implemented"),
    (&["-e", "--escape"], "escapes in -p are processed by default (--no-escape turns it off)"),
    (&["-no-cnv", "--no-conversation", "-st", "--single-turn"], "generate runs one prompt and ends; drop the flag"),
    (&["-sp", "--special"], "special tokens are printed as text only with forge detokenize"),
    (&["-cb", "--cont-batching", "-np", "--parallel"], "batching belongs to the server: forge serve -np N"),
    (&["-co", "--color"], "output is plain text"),
    (&["-tb", "--threads-batch"], "one thread count (-t) serves prompt and generation"),
    (&["-hf", "-hfr", "--hf-repo", "-hff", "--hf-file"], "give the Hub id to -m (e.g. -m openai-community/gpt2)"),
    (&["-mli", "--multiline-input", "-mu", "--model-url"], "not available in forge"),
];

/// Options whose next argument is a value (so `-p -fa` is a prompt, not a flag).
const TAKES_VALUE: &[&str] = &["-p", "--prompt", "-f", "--file", "-m", "--model", "--system-prompt", "--model-draft"];

/// llama.cpp's multi-letter single-dash names that forge has under a long name.
pub const ALIASES: &[(&str, &str)] =
    &[("-sys", "--system-prompt"), ("-np", "--parallel"), ("-md", "--model-draft"), ("-jf", "--json-schema-file")];

/// The command line with llama.cpp's aliases ([`ALIASES`]) spelled as forge's long names.
pub fn expand_aliases(args: Vec<std::ffi::OsString>) -> Vec<std::ffi::OsString> {
    let mut value_next = false;
    args.into_iter()
        .map(|a| {
            let s = a.to_str().unwrap_or("");
            let is_value = std::mem::replace(&mut value_next, TAKES_VALUE.contains(&s));
            match ALIASES.iter().find(|(from, _)| s == *from) {
                Some((_, to)) if !is_value => (*to).into(),
                _ => a,
            }
        })
        .collect()
}

/// The "not supported" error for the first llama.cpp-only flag in `args` (the
/// arguments after the program name), for `generate` and `bench`. `-r` means
/// repetitions in `bench` (llama-bench's), so it is only refused for `generate`.
pub fn unsupported_flag(args: &[std::ffi::OsString]) -> Option<String> {
    let command = args.first()?.to_str()?;
    if !matches!(command, "generate" | "bench" | "chat") {
        return None;
    }
    let mut skip = false;
    for arg in &args[1..] {
        let Some(arg) = arg.to_str() else { continue };
        if std::mem::take(&mut skip) {
            continue;
        }
        if arg == "--" {
            break;
        }
        if TAKES_VALUE.contains(&arg) {
            skip = true;
            continue;
        }
        let flag = arg.split('=').next().unwrap_or(arg);
        if command == "bench" && flag == "-r" {
            continue; // llama-bench's -r is repetitions, as ours
        }
        if let Some((_, why)) = UNSUPPORTED.iter().find(|(names, _)| names.contains(&flag)) {
            return Some(format!("not supported: {flag}: {why}"));
        }
        // Any other single-dash word (`-xyz`) is a llama.cpp-style long option that clap
        // would split into `-x yz`; a short option with its number attached (`-n40`) or
        // a negative number (`-1`, `-0.5`) is fine.
        let word = flag.strip_prefix('-').filter(|w| !w.starts_with('-')).unwrap_or("");
        let mut chars = word.chars();
        if let (Some(first), Some(second)) = (chars.next(), chars.next())
            && first.is_ascii_alphabetic()
            && !second.is_ascii_digit()
            && word[1..].parse::<f64>().is_err()
        {
            return Some(format!(
                "not supported: {flag}: forge has no such option (its short options are one letter, as -n 40; see --help)"
            ));
        }
    }
    None
}

/// An error writing to stdout, said as such (for engine callbacks, which take any error).
pub fn stdout_error(e: std::io::Error) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("writing to stdout: {e}"))
}

/// `--model`: a local folder, or a Hub id resolved through the HF cache. `command` is
/// the subcommand, named in the hint for fetching a missing model.
pub fn model_dir(model: &str, weights: bool, command: &str) -> anyhow::Result<PathBuf> {
    Ok(loaders::resolve_model(model, &HubClient::from_env(), weights, command)?)
}

/// All of stdin as UTF-8; `what` names it in the error (an invalid byte's offset).
pub fn read_stdin_utf8(what: &str) -> anyhow::Result<String> {
    use std::io::Read as _;
    let mut buf = Vec::new();
    std::io::stdin().lock().read_to_end(&mut buf).map_err(|e| anyhow::anyhow!("reading {what}: {e}"))?;
    String::from_utf8(buf)
        .map_err(|e| anyhow::anyhow!("{what} is not valid UTF-8 (byte {})", e.utf8_error().valid_up_to()))
}

/// Drop one trailing newline (`\n` or `\r\n`), as llama.cpp does for prompt files.
pub fn drop_trailing_newline(mut s: String) -> String {
    if s.ends_with('\n') {
        s.pop();
        if s.ends_with('\r') {
            s.pop();
        }
    }
    s
}

/// How the checkpoint stores its weights: the widest float dtype of its tensors (a
/// narrower `--dtype` rounds at least those). Block-quantized GGUF tensors are decoded to
/// f32, so they count as f32.
pub fn stored_dtype(store: &batch_forge::loaders::WeightStore) -> batch_forge::tensor::Dtype {
    widest_float(store.tensors().map(|t| t.dtype))
}

/// [`stored_dtype`] of a model folder or a GGUF file.
pub fn stored_dtype_at(path: &std::path::Path) -> anyhow::Result<batch_forge::tensor::Dtype> {
    use batch_forge::loaders::gguf::{GgmlType, GgufFile};
    use batch_forge::tensor::Dtype;
    if batch_forge::model::load::is_gguf(path) {
        let file = GgufFile::open(path)?;
        // The float type holding most matrix bytes: GGUF writers keep norms, biases and
        // position embeddings in f32 whatever the weights are.
        let mut bytes = [(Dtype::F32, 0u64), (Dtype::F16, 0), (Dtype::BF16, 0)];
        for t in file.tensor_infos().iter().filter(|t| t.dims.len() >= 2) {
            let i = match t.ggml_type {
                GgmlType::F32 => 0,
                GgmlType::F16 => 1,
                GgmlType::BF16 => 2,
                _ => continue,
            };
            bytes[i].1 = bytes[i].1.saturating_add(t.n_bytes);
        }
        return Ok(bytes.iter().rev().max_by_key(|(_, n)| *n).map_or(Dtype::F32, |(d, _)| *d));
    }
    Ok(stored_dtype(&batch_forge::loaders::WeightStore::open_dir(path)?))
}

fn widest_float(dtypes: impl Iterator<Item = batch_forge::tensor::Dtype>) -> batch_forge::tensor::Dtype {
    use batch_forge::tensor::Dtype;
    let dtypes: Vec<Dtype> = dtypes.collect();
    [Dtype::F64, Dtype::F32, Dtype::F16, Dtype::BF16]
        .into_iter()
        .find(|d| dtypes.contains(d))
        .map_or(Dtype::F32, |d| if d == Dtype::F64 { Dtype::F32 } else { d })
}

/// More threads than this is a typo, not a setting.
pub const MAX_THREADS: usize = 1024;

/// `-t` values: each at least 1 and at most [`MAX_THREADS`].
pub fn check_threads(threads: &[usize]) -> anyhow::Result<()> {
    for &t in threads {
        anyhow::ensure!(t >= 1, "-t/--threads must be at least 1");
        anyhow::ensure!(t <= MAX_THREADS, "-t/--threads {t}: at most {MAX_THREADS}");
    }
    Ok(())
}

/// A warning on stderr for thread counts above the CPUs this process may use.
pub fn warn_threads(threads: &[usize]) {
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    if let Some(&t) = threads.iter().filter(|&&t| t > cpus).max() {
        eprintln!(
            "warning: -t {t} is more than the {cpus} CPUs this process may use; the extra threads only wait for each other"
        );
    }
}

pub use batch_forge::backend::cpu::physical_cores;

/// Run `f` on a rayon pool of `threads` workers (default: the physical cores). Running the whole
/// job inside the pool, rather than calling into it from the main thread, keeps each
/// parallel op's fork/join within the workers (no cross-thread wake-up per op).
pub fn in_pool<R: Send>(threads: Option<usize>, f: impl FnOnce() -> anyhow::Result<R> + Send) -> anyhow::Result<R> {
    let n = threads.unwrap_or_else(physical_cores);
    check_threads(&[n])?;
    rayon::ThreadPoolBuilder::new().num_threads(n).build()?.install(f)
}

/// Output to a closed pipe (`forge generate | head`) ends the program quietly.
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| batch_forge::engine::io_error_kind(c) == Some(std::io::ErrorKind::BrokenPipe))
}

//! `forge generate`: prompt → streamed text (or one JSON object with --json).
//!
//! Flag names follow llama.cpp's `llama-cli` (`-p`, `-f`, `-n`, `--temp`, `-s`, `-c`,
//! `--min-p`, `--repeat-penalty`, ...), with the older long names kept as aliases.

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;

use batch_forge::backend::Backend;
use batch_forge::chat::Message;
use batch_forge::engine::grammar::{GrammarSpec, Grammars};
use batch_forge::engine::text::TextOut;
use batch_forge::engine::{Engine, GenerateParams, Generation, Halt, SamplingParams, StopReason};
use batch_forge::loaders::DEFAULT_MODEL;

use super::{BackendArgs, BackendChoice, with_backend};

/// `-s/--seed`: a number, or -1 for a random one (printed so the run can be repeated).
#[derive(Clone, Copy, Debug)]
pub struct Seed(pub Option<u64>);

fn parse_seed(s: &str) -> Result<Seed, String> {
    if s == "-1" {
        return Ok(Seed(None));
    }
    s.parse::<u64>()
        .map(|v| Seed(Some(v)))
        .map_err(|_| format!("{s:?} is not a seed: use 0 to 2^64-1, or -1 for a random one"))
}

/// Sampling flags, shared by `generate` and `chat`: llama.cpp's names, and the defaults
/// of [`SamplingParams::default`], which the server's API shares.
#[derive(Args)]
pub struct SamplingArgs {
    /// Always take the most likely token (same as --temp 0).
    #[arg(long, conflicts_with_all = ["temperature", "top_k", "top_p", "min_p"])]
    greedy: bool,
    /// Softmax temperature; 0 is greedy.
    #[arg(
        long = "temp",
        visible_alias = "temperature",
        value_name = "T",
        default_value_t = SamplingParams::default().temperature,
        allow_negative_numbers = true
    )]
    temperature: f32,
    /// Sample among the K most likely tokens only; 0 turns the cut off.
    #[arg(long, value_name = "K", default_value_t = SamplingParams::default().top_k)]
    top_k: usize,
    /// Sample from the smallest set of tokens whose probability reaches P, in (0, 1]; 1 = off.
    #[arg(long, value_name = "P", default_value_t = SamplingParams::default().top_p, allow_negative_numbers = true)]
    top_p: f32,
    /// Drop tokens less likely than P times the most likely one, P in [0, 1]; 0 = off.
    #[arg(long, value_name = "P", default_value_t = SamplingParams::default().min_p, allow_negative_numbers = true)]
    min_p: f32,
    /// Penalize tokens seen in the last --repeat-last-n (prompt included); 1 = off.
    #[arg(long, value_name = "X", default_value_t = SamplingParams::default().repeat_penalty,
          allow_negative_numbers = true)]
    repeat_penalty: f32,
    /// How many recent tokens the repeat penalty considers; 0 = off, -1 = the whole context.
    #[arg(long, value_name = "N", default_value_t = 64, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i64).range(-1..))]
    repeat_last_n: i64,
    /// Lower the logit of every token generated so far by X (OpenAI's presence
    /// penalty), X in [-2, 2]; 0 = off.
    #[arg(long, value_name = "X", default_value_t = 0.0, allow_negative_numbers = true)]
    presence_penalty: f32,
    /// Lower the logit of every token generated so far by X times its count (OpenAI's
    /// frequency penalty), X in [-2, 2]; 0 = off.
    #[arg(long, value_name = "X", default_value_t = 0.0, allow_negative_numbers = true)]
    frequency_penalty: f32,
    /// RNG seed for sampling; -1 (the default) picks one and prints it on stderr.
    #[arg(short = 's', long, value_name = "SEED", allow_negative_numbers = true, value_parser = parse_seed)]
    seed: Option<Seed>,
}

impl SamplingArgs {
    /// The sampling parameters; the seed is drawn here when it was not given.
    pub fn params(&self, n_ctx: usize) -> anyhow::Result<SamplingParams> {
        let seed = match self.seed {
            Some(Seed(Some(s))) => s,
            _ => std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64),
        };
        let sampling = SamplingParams {
            temperature: if self.greedy { 0.0 } else { self.temperature },
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: if self.repeat_last_n < 0 { n_ctx } else { self.repeat_last_n as usize },
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            seed,
        };
        sampling.validate()?;
        Ok(sampling)
    }
}

#[derive(Args)]
pub struct GenerateArgs {
    /// The prompt (same as -p; `-` reads stdin). Without any: read from stdin when it is
    /// not a terminal, else start from the model's BOS token (<|endoftext|> for GPT-2).
    #[arg(value_name = "PROMPT", conflicts_with_all = ["prompt", "file"])]
    prompt_pos: Option<String>,
    /// The prompt (escapes such as `\n` are processed unless --no-escape).
    #[arg(short = 'p', long, conflicts_with = "file", allow_hyphen_values = true)]
    prompt: Option<String>,
    /// Read the prompt from a file (`-` = stdin); one trailing newline is dropped, as llama.cpp does.
    #[arg(short = 'f', long, value_name = "FILE")]
    file: Option<PathBuf>,
    /// Model folder (config.json, model.safetensors, tokenizer.json), .gguf file, or Hub repo id.
    #[arg(long, short, default_value = DEFAULT_MODEL)]
    model: String,
    /// Tokens to generate; -1 = until end of text or the context is full.
    #[arg(short = 'n', long = "n-predict", visible_alias = "max-new-tokens", value_name = "N", default_value_t = 100,
          allow_negative_numbers = true, value_parser = clap::value_parser!(i64).range(-1..))]
    n_predict: i64,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// Use at most N positions of the model's context (prompt + generated); 0 = all of it.
    #[arg(short = 'c', long = "ctx-size", value_name = "N", default_value_t = 0)]
    ctx_size: usize,
    #[command(flatten)]
    backend: BackendArgs,
    /// Worker threads (default: the physical cores available to this process).
    #[arg(long, short)]
    threads: Option<usize>,
    /// Print one JSON object when done instead of streaming text.
    #[arg(long)]
    json: bool,
    /// With --json: each generated token's log-probability and the N (0 to 20) most
    /// likely tokens at its step, from the model's raw logits (before penalty,
    /// temperature and cuts).
    #[arg(long, value_name = "N", requires = "json", value_parser = clap::value_parser!(u8).range(0..=20))]
    logprobs: Option<u8>,
    /// Also print prompt and generated token ids (to stderr).
    #[arg(long)]
    show_ids: bool,
    /// Keep generating after the end-of-text token.
    #[arg(long)]
    ignore_eos: bool,
    /// Stop when the generated text contains STRING (repeatable, up to 4, as the API's
    /// `stop`); the string itself is not printed.
    #[arg(long = "stop", value_name = "STRING")]
    stop: Vec<String>,
    /// Treat the prompt as a user message: wrap it in the model's chat template (its
    /// `tokenizer.chat_template`) and generate the assistant's reply.
    #[arg(long)]
    chat: bool,
    /// A Jinja chat template file to use instead of the model's own (llama.cpp's and
    /// vLLM's --chat-template); with --chat, for models whose files carry none.
    #[arg(long = "chat-template", value_name = "FILE", requires = "chat")]
    chat_template: Option<std::path::PathBuf>,
    /// With --chat: a system message before the user's (llama.cpp's -sys).
    #[arg(long = "system-prompt", value_name = "TEXT", requires = "chat")]
    system_prompt: Option<String>,
    /// Take escapes in a command-line prompt literally (by default `\n`, `\t`, `\r`,
    /// `\\`, `\"`, `\'` and `\xHH` are turned into characters, as llama.cpp does).
    #[arg(long)]
    no_escape: bool,
    #[command(flatten)]
    spec: super::SpecArgs,
    #[command(flatten)]
    constraint: ConstraintArgs,
    /// Compute every row as `forge serve` does, whatever the rows beside it (the
    /// batch-invariant kernels; dense prefill up to ~15% slower): the tokens `forge serve`
    /// gives, and those of speculative decoding, which turns it on.
    #[arg(long)]
    batch_invariant: bool,
}

/// llama.cpp's escape processing of a command-line prompt: `\n`, `\r`, `\t`, `\'`, `\"`,
/// `\\` and `\xHH`; any other backslash is kept as it is.
fn process_escapes(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        if c != '\\' {
            out.push(c);
            continue;
        }
        match chars.peek().copied() {
            Some('n') => out.push('\n'),
            Some('r') => out.push('\r'),
            Some('t') => out.push('\t'),
            Some('\'') => out.push('\''),
            Some('"') => out.push('"'),
            Some('\\') => out.push('\\'),
            Some('x') => {
                let mut rest = chars.clone();
                rest.next();
                let hex: String = rest.by_ref().take(2).collect();
                match u8::from_str_radix(&hex, 16) {
                    Ok(b) if hex.len() == 2 && b.is_ascii() => {
                        out.push(char::from(b));
                        chars = rest;
                        continue;
                    }
                    _ => {
                        out.push('\\');
                        continue;
                    }
                }
            }
            _ => {
                out.push('\\');
                continue;
            }
        }
        chars.next();
    }
    out
}

/// Structured output (llama.cpp's names; each value is a file's path or the text itself).
#[derive(clap::Args, Clone, Debug, Default)]
pub struct ConstraintArgs {
    /// Output JSON that validates against this schema (a file, or the schema's text).
    #[arg(short = 'j', long = "json-schema", value_name = "SCHEMA", allow_hyphen_values = true,
          conflicts_with_all = ["grammar", "regex", "json_schema_file", "grammar_file"])]
    json_schema: Option<String>,
    /// --json-schema from a file (llama.cpp's -jf).
    #[arg(long = "json-schema-file", value_name = "FILE", conflicts_with_all = ["grammar", "regex", "grammar_file"])]
    json_schema_file: Option<PathBuf>,
    /// Output text in this grammar: GBNF (llama.cpp's format), or llguidance's Lark when
    /// it starts with `%llguidance` or defines `start:` (a file, or the grammar's text).
    #[arg(long, value_name = "GRAMMAR", allow_hyphen_values = true, conflicts_with_all = ["regex", "grammar_file"])]
    grammar: Option<String>,
    /// --grammar from a file.
    #[arg(long = "grammar-file", value_name = "FILE", conflicts_with = "regex")]
    grammar_file: Option<PathBuf>,
    /// Output text that matches this regular expression as a whole.
    #[arg(long, value_name = "REGEX", allow_hyphen_values = true)]
    regex: Option<String>,
}

impl ConstraintArgs {
    /// The constraint asked for, its files read; `None` when there is none.
    pub fn spec(&self) -> anyhow::Result<Option<GrammarSpec>> {
        let read = |flag: &str, path: &Path| {
            std::fs::read_to_string(path).with_context(|| format!("{flag} {}: cannot read it", path.display()))
        };
        // A value that names an existing file is read; one word that is not a file is a
        // missing file; anything else is the text itself.
        let text_or_file = |flag: &str, v: &str| -> anyhow::Result<String> {
            let path = Path::new(v);
            let text = v.trim_start().starts_with('{') || v.contains("::=") || v.contains(char::is_whitespace);
            match (text, path.is_file()) {
                (false, true) => read(flag, path),
                (false, false) => anyhow::bail!("{flag} {v}: no such file (or give the text itself)"),
                (true, _) => Ok(v.to_owned()),
            }
        };
        let schema = |flag: &str, text: String| -> anyhow::Result<GrammarSpec> {
            let v: serde_json::Value =
                serde_json::from_str(&text).map_err(|e| anyhow::anyhow!("{flag}: not valid JSON ({e})"))?;
            Ok(GrammarSpec::JsonSchema(v))
        };
        Ok(Some(match (&self.json_schema, &self.json_schema_file, &self.grammar, &self.grammar_file, &self.regex) {
            (Some(s), ..) => schema("--json-schema", text_or_file("--json-schema", s)?)?,
            (_, Some(f), ..) => schema("--json-schema-file", read("--json-schema-file", f)?)?,
            (_, _, Some(g), ..) => GrammarSpec::grammar(&text_or_file("--grammar", g)?),
            (_, _, _, Some(f), _) => GrammarSpec::grammar(&read("--grammar-file", f)?),
            (.., Some(r)) => GrammarSpec::Regex(r.clone()),
            _ => return Ok(None),
        }))
    }
}

/// Where the prompt text came from, for the stderr note.
enum PromptSource {
    Argument,
    File(PathBuf),
    Stdin,
    None,
}

use super::drop_trailing_newline;

fn read_stdin() -> anyhow::Result<String> {
    super::read_stdin_utf8("the prompt on stdin")
}

impl GenerateArgs {
    /// Every check that needs no model, device or input: bad flags are reported first.
    fn validate(&self) -> anyhow::Result<()> {
        if self.backend.backend == BackendChoice::Both {
            anyhow::ensure!(
                !self.json,
                "--backend both prints a table of per-step logit differences; it has no --json output"
            );
            anyhow::ensure!(self.stop.is_empty(), "--backend both compares logits step by step; it takes no --stop");
            anyhow::ensure!(
                !self.spec.is_on(),
                "--backend both compares logits step by step; it takes no --draft-ngram or --model-draft"
            );
            anyhow::ensure!(
                self.constraint.spec()?.is_none(),
                "--backend both compares logits step by step; it takes no --json-schema, --grammar or --regex"
            );
        }
        self.backend.validate("generate")?;
        self.spec.validate()?;
        self.constraint.spec()?; // files readable, schemas JSON
        super::check_threads(self.threads.as_slice())?;
        anyhow::ensure!(self.stop.len() <= 4, "at most 4 --stop strings, got {}", self.stop.len());
        anyhow::ensure!(self.stop.iter().all(|s| !s.is_empty()), "a --stop string must not be empty");
        Ok(())
    }

    fn sampling(&self, n_ctx: usize) -> anyhow::Result<SamplingParams> {
        self.sampling.params(n_ctx)
    }

    /// `-c` as a cap on the model's context (`None`: all of it); beyond the model's own
    /// context it is an error.
    fn max_context(&self, n_positions: usize) -> anyhow::Result<Option<usize>> {
        anyhow::ensure!(
            self.ctx_size <= n_positions,
            "-c {} exceeds the model's context of {n_positions} tokens (it has no position embeddings beyond it)",
            self.ctx_size
        );
        Ok((self.ctx_size > 0).then_some(self.ctx_size))
    }

    fn params(&self, sampling: SamplingParams) -> GenerateParams {
        GenerateParams {
            max_new_tokens: usize::try_from(self.n_predict).unwrap_or(usize::MAX),
            sampling,
            ignore_eos: self.ignore_eos,
            max_context: (self.ctx_size > 0).then_some(self.ctx_size), // checked by max_context()
            logprobs: self.logprobs.map(usize::from),
        }
    }

    /// The prompt text and where it came from.
    fn prompt_text(&self) -> anyhow::Result<(String, PromptSource)> {
        if let Some(p) = self.prompt.as_ref().or(self.prompt_pos.as_ref()) {
            if p == "-" {
                return Ok((drop_trailing_newline(read_stdin()?), PromptSource::Stdin));
            }
            let text = if self.no_escape { p.clone() } else { process_escapes(p) };
            return Ok((text, PromptSource::Argument));
        }
        match &self.file {
            Some(f) if f.as_os_str() == "-" => Ok((drop_trailing_newline(read_stdin()?), PromptSource::Stdin)),
            Some(f) => {
                let bytes =
                    std::fs::read(f).with_context(|| format!("-f {}: cannot read the prompt file", f.display()))?;
                let text = String::from_utf8(bytes).map_err(|e| {
                    anyhow::anyhow!("-f {}: not valid UTF-8 (byte {})", f.display(), e.utf8_error().valid_up_to())
                })?;
                Ok((drop_trailing_newline(text), PromptSource::File(f.clone())))
            }
            None if !std::io::stdin().is_terminal() => {
                // Said first, so a stdin that never closes is not a silent hang.
                eprintln!("no prompt given: reading it from stdin");
                Ok((drop_trailing_newline(read_stdin()?), PromptSource::Stdin))
            }
            None => Ok((String::new(), PromptSource::None)),
        }
    }
}

pub fn run(mut args: GenerateArgs) -> anyhow::Result<()> {
    // Flags first (a cheap check of the sampling values too; the seed and the
    // whole-context window are settled once the model is known).
    args.validate()?;
    // Verification rows must be computed as a lone decode row would be.
    args.backend.batch_invariant = args.batch_invariant || args.spec.is_on();
    args.sampling(0)?;
    super::warn_threads(args.threads.as_slice());
    let (prompt, source) = args.prompt_text()?;
    if args.backend.backend == BackendChoice::Both {
        #[cfg(feature = "gpu")]
        return super::in_pool(args.threads, || lockstep(&args, &prompt, &source));
        #[cfg(not(feature = "gpu"))]
        return Err(super::no_gpu_build());
    }
    super::in_pool(args.threads, || with_backend!(args.backend, |b| run_on(b, &args, &prompt, &source)))
}

/// Tokenize the prompt ([`Engine::prompt_ids`]: an empty one is the model's BOS token;
/// with --chat, the conversation through the model's chat template) and say on stderr
/// how many tokens came from a file or stdin.
fn prompt_ids<B: Backend>(
    engine: &Engine<B>,
    args: &GenerateArgs,
    prompt: &str,
    source: &PromptSource,
) -> anyhow::Result<Vec<u32>> {
    let ids = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system_prompt {
            messages.push(Message::new("system", system));
        }
        messages.push(Message::new("user", prompt));
        engine.chat_prompt_ids(&messages)?
    } else {
        engine.prompt_ids(prompt)
    };
    let n = if prompt.is_empty() && !args.chat { 0 } else { ids.len() };
    let from = match source {
        PromptSource::File(f) => Some(format!("{}", f.display())),
        PromptSource::Stdin => Some("stdin".to_owned()),
        PromptSource::Argument | PromptSource::None => None,
    };
    if let Some(from) = from {
        let start = if n == 0 { "; starting from the BOS token" } else { "" };
        eprintln!("read {n} prompt tokens from {from}{start}");
    }
    Ok(ids)
}

/// A sampled run says its seed, so a good sample can be reproduced.
fn announce_seed(sampling: &SamplingParams) {
    if !sampling.is_greedy() {
        eprintln!("seed: {} (pass -s {} to repeat this run)", sampling.seed, sampling.seed);
    }
}

/// `--backend both`: the cpu and gpu backends step together on the same tokens (the
/// cpu's choices). Each step prints the max |logit difference| and both argmaxes; the
/// first step whose argmax differs ends the run with an error naming it. Without
/// `--dtype`, the cpu side computes in f32 from the very values the gpu holds (a GGUF's
/// blocks decoded exactly, 16-bit weights widened): the reference path for the gpu's
/// in-register decoding, not the cpu's own 8-bit-activation quantized kernels.
#[cfg(feature = "gpu")]
fn lockstep(args: &GenerateArgs, prompt: &str, source: &PromptSource) -> anyhow::Result<()> {
    use batch_forge::backend::cpu::CpuBackend;
    use batch_forge::backend::gpu::GpuBackend;
    use batch_forge::engine::lockstep::lockstep;

    let dir = super::model_dir(&args.model, true, "generate")?;
    let mut cpu_options = args.backend.cpu_options()?;
    cpu_options.weight_dtype.get_or_insert(batch_forge::backend::WeightDtype::F32);
    let mut cpu = args.backend.load_engine(CpuBackend::new(cpu_options)?, &dir)?;
    if let Some(file) = &args.chat_template {
        cpu.use_chat_template_file(file)?; // the prompt's ids come from the cpu engine
    }
    let gpu_backend = GpuBackend::new(args.backend.gpu_options()?)?;
    super::warn_if_software(&gpu_backend);
    let device = gpu_backend.description();
    let gpu = args.backend.load_engine(gpu_backend, &dir)?;
    let tok = &cpu.text.tokenizer;
    let max_context = args.max_context(cpu.model.info().context_length)?;
    let prompt_ids = prompt_ids(&cpu, args, prompt, source)?;
    let n_ctx = cpu.check_prompt(prompt_ids.len(), max_context)?;
    let sampling = args.sampling(n_ctx)?;
    announce_seed(&sampling);
    let params = args.params(sampling);
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

/// The three phases of a run, each with its own token count and time (llama.cpp's
/// `load time`, `prompt eval time`, `eval time`). The first generated token comes from
/// the prompt pass; each later one from one decode step.
struct PhaseTimings {
    load: Duration,
    prompt_tokens: usize,
    prompt: Duration,
    decode_steps: usize,
    decode: Duration,
    generated: usize,
}

impl PhaseTimings {
    fn new(load: Duration, g: &Generation) -> Self {
        PhaseTimings {
            load,
            prompt_tokens: g.prompt_ids.len(),
            prompt: g.timings.prefill,
            decode_steps: g.generated_ids.len().saturating_sub(1),
            decode: g.timings.decode,
            generated: g.generated_ids.len(),
        }
    }

    fn rate(n: usize, t: Duration) -> Option<f64> {
        (n > 0 && t > Duration::ZERO).then(|| n as f64 / t.as_secs_f64())
    }

    fn total(&self) -> Duration {
        self.load + self.prompt + self.decode
    }

    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "load_s": self.load.as_secs_f64(),
            "prompt_tokens": self.prompt_tokens,
            "prompt_s": self.prompt.as_secs_f64(),
            "prompt_tok_s": Self::rate(self.prompt_tokens, self.prompt),
            "decode_steps": self.decode_steps,
            "decode_s": self.decode.as_secs_f64(),
            "decode_tok_s": Self::rate(self.decode_steps, self.decode),
            "generated_tokens": self.generated,
            "total_s": self.total().as_secs_f64(),
        })
    }

    /// llama.cpp-style lines for stderr.
    fn print(&self, backend: &str) {
        let line = |name: &str, t: Duration, n: usize, unit: &str| {
            let ms = t.as_secs_f64() * 1e3;
            match Self::rate(n, t) {
                Some(r) => eprintln!(
                    "{name:>10} = {ms:10.2} ms / {n:5} {unit:6} ({:8.2} ms per token, {r:8.2} tokens per second)",
                    ms / n as f64
                ),
                None => eprintln!("{name:>10} = {ms:10.2} ms / {n:5} {unit}"),
            }
        };
        eprintln!("timings on {backend}:");
        eprintln!("{:>10} = {:10.2} ms", "load", self.load.as_secs_f64() * 1e3);
        line("prompt", self.prompt, self.prompt_tokens, "tokens");
        line("decode", self.decode, self.decode_steps, "steps");
        eprintln!(
            "{:>10} = {:10.2} ms, {} tokens generated (the first by the prompt pass)",
            "total",
            self.total().as_secs_f64() * 1e3,
            self.generated
        );
    }
}

fn run_on<B: Backend>(backend: B, args: &GenerateArgs, prompt: &str, source: &PromptSource) -> anyhow::Result<()> {
    let dir = super::model_dir(&args.model, true, "generate")?; // a download is not load time
    let load_start = Instant::now();
    let mut engine = args.backend.load_engine(backend, &dir)?;
    if let Some(file) = &args.chat_template {
        engine.use_chat_template_file(file)?;
    }
    args.spec.apply(&mut engine, "generate")?;
    let constraint = match args.constraint.spec()? {
        Some(spec) => {
            let info = engine.model.info();
            let grammars = Grammars::new(&engine.text.tokenizer, info.vocab_size, &engine.text.end_of_generation)?;
            Some(grammars.compile(&spec).map_err(anyhow::Error::msg)?)
        }
        None => None,
    };
    let load_time = load_start.elapsed();
    let tok = &engine.text.tokenizer;
    let n_positions = engine.model.info().context_length;
    let max_context = args.max_context(n_positions)?;
    let prompt_ids = prompt_ids(&engine, args, prompt, source)?;
    // Before the seed is announced: a run that cannot start says only why.
    let n_ctx = engine.check_prompt(prompt_ids.len(), max_context)?;
    let sampling = args.sampling(n_ctx)?;
    announce_seed(&sampling);
    let params = args.params(sampling.clone());

    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    // The text as the API builds it: whole characters, stop strings cut (and text that
    // may begin one held back until it is decided).
    let mut text = TextOut::new(tok, &args.stop);
    // A constrained output ends at an end token even with --ignore-eos.
    let ends_at_eos = !args.ignore_eos || constraint.is_some();
    let result = engine.generate_constrained(&prompt_ids, &params, constraint, |id| {
        if engine.is_eos(id) && ends_at_eos {
            return Ok(());
        }
        let stopped = text.push(id, None);
        if !args.json {
            let (delta, _) = text.take_ready(false);
            out.write_all(delta.as_bytes()).map_err(super::stdout_error)?;
            out.flush().map_err(super::stdout_error)?;
        }
        if stopped { Err(Halt::Stop) } else { Ok(()) }
    })?;
    text.finish();
    let (tail, _) = text.take_ready(true);
    let text = text.text().to_owned();

    let timings = PhaseTimings::new(load_time, &result);
    if args.json {
        let mut obj = serde_json::json!({
            "prompt_ids": result.prompt_ids,
            "generated_ids": result.generated_ids,
            "text": text,
            "backend": engine.backend.name(),
            "stop_reason": result.stop.as_str(),
            "seed": sampling.seed,
            "greedy": sampling.is_greedy(),
            "timings": timings.json(),
        });
        if args.spec.is_on() {
            obj["speculation"] = serde_json::json!({
                "draft_tokens": result.draft_tokens,
                "accepted_tokens": result.accepted_tokens,
            });
        }
        if args.logprobs.is_some() {
            let text =
                |id: u32| tok.token_bytes(id).map(|b| String::from_utf8_lossy(b).into_owned()).unwrap_or_default();
            let entries: Vec<serde_json::Value> = result
                .logprobs
                .iter()
                .map(|t| {
                    let top: Vec<serde_json::Value> = t
                        .top
                        .iter()
                        .map(|&(id, lp)| serde_json::json!({ "id": id, "text": text(id), "logprob": lp }))
                        .collect();
                    serde_json::json!({ "id": t.id, "text": text(t.id), "logprob": t.logprob, "top_logprobs": top })
                })
                .collect();
            obj["logprobs"] = entries.into();
        }
        writeln!(out, "{obj}").map_err(super::stdout_error)?;
    } else {
        writeln!(out, "{tail}").map_err(super::stdout_error)?;
    }
    drop(out);
    if result.stop == StopReason::ContextFull {
        let whose = if n_ctx < n_positions { "context size (-c)" } else { "model's context" };
        eprintln!("[stopped after {} tokens: the {whose} of {n_ctx} tokens is full]", result.generated_ids.len());
    }
    if args.show_ids {
        eprintln!("prompt ids: {:?}", result.prompt_ids);
        eprintln!("generated ids: {:?}", result.generated_ids);
    }
    timings.print(&engine.backend.name());
    if args.spec.is_on() {
        print_acceptance(result.draft_tokens, result.accepted_tokens);
    }
    Ok(())
}

/// How many drafted tokens were accepted (stderr, after the timings).
pub fn print_acceptance(drafted: usize, accepted: usize) {
    let rate = if drafted > 0 { format!(" ({:.1}%)", 100.0 * accepted as f64 / drafted as f64) } else { String::new() };
    eprintln!("{:>10} = {accepted} of {drafted} drafted tokens accepted{rate}", "draft");
}

//! `forge chat`: an interactive conversation with a model that has a chat template
//! (llama.cpp's `llama-cli -cnv`). Each turn renders the whole conversation with the
//! template, and the KV cache is kept between turns: only the tokens a turn adds are
//! prefilled. Lines starting with `/` are commands: `/clear` starts over, `/exit` ends.

use std::io::{BufRead, IsTerminal, Write};
use std::time::Instant;

use anyhow::Context;
use clap::Args;

use batch_forge::backend::Backend;
use batch_forge::chat::Message;
use batch_forge::engine::text::TextOut;
use batch_forge::engine::{GenerateParams, Halt, StopReason};

use super::generate::SamplingArgs;
use super::{BackendArgs, BackendChoice, with_backend};

#[derive(Args)]
pub struct ChatArgs {
    /// A .gguf file or model folder whose files carry a chat template.
    #[arg(long, short)]
    model: String,
    /// A Jinja chat template file to use instead of the model's own (llama.cpp's and
    /// vLLM's --chat-template); for models whose files carry none.
    #[arg(long = "chat-template", value_name = "FILE")]
    chat_template: Option<std::path::PathBuf>,
    /// A system message that opens the conversation (llama.cpp's -sys).
    #[arg(long = "system-prompt", value_name = "TEXT")]
    system_prompt: Option<String>,
    /// Most tokens per reply; -1 = until end of turn or the context is full.
    #[arg(short = 'n', long = "n-predict", value_name = "N", default_value_t = -1, allow_negative_numbers = true,
          value_parser = clap::value_parser!(i64).range(-1..))]
    n_predict: i64,
    /// Positions for the whole conversation (prompt and replies); 0 = the model's context
    /// (the KV cache grows as the conversation does).
    #[arg(short = 'c', long = "ctx-size", value_name = "N", default_value_t = 0)]
    ctx_size: usize,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// End a reply where this string appears (up to 4, as the API's `stop`); the string
    /// itself is not printed or kept in the conversation.
    #[arg(long = "stop", value_name = "STRING")]
    stop: Vec<String>,
    #[command(flatten)]
    backend: BackendArgs,
    /// Worker threads (default: the physical cores available to this process).
    #[arg(long, short)]
    threads: Option<usize>,
    #[command(flatten)]
    spec: super::SpecArgs,
    /// Compute every row as `forge serve` does, whatever the rows beside it (the
    /// batch-invariant kernels; dense prefill up to ~15% slower): the tokens `forge serve`
    /// gives, and those of speculative decoding, which turns it on.
    #[arg(long)]
    batch_invariant: bool,
}

pub fn run(mut args: ChatArgs) -> anyhow::Result<()> {
    args.backend.validate("chat")?;
    args.spec.validate()?;
    args.backend.batch_invariant = args.batch_invariant || args.spec.is_on(); // verification rows as lone decode rows
    anyhow::ensure!(args.backend.backend != BackendChoice::Both, "--backend both is for `forge generate` only");
    super::check_threads(args.threads.as_slice())?;
    args.sampling.params(0)?;
    anyhow::ensure!(args.stop.len() <= 4, "at most 4 --stop strings, got {}", args.stop.len());
    anyhow::ensure!(args.stop.iter().all(|s| !s.is_empty()), "a --stop string must not be empty");
    super::warn_threads(args.threads.as_slice());
    super::in_pool(args.threads, || with_backend!(args.backend, |b| chat_on(b, &args)))
}

fn chat_on<B: Backend>(backend: B, args: &ChatArgs) -> anyhow::Result<()> {
    let path = super::model_dir(&args.model, true, "chat")?;
    let mut engine = args.backend.load_engine(backend, &path)?;
    args.spec.apply(&mut engine, "chat")?;
    if let Some(file) = &args.chat_template {
        engine.use_chat_template_file(file)?;
    }
    if let Some(e) = &engine.text.chat_template_error {
        anyhow::bail!("{}: the chat template cannot be used: {e}", args.model);
    }
    anyhow::ensure!(
        engine.text.chat_template.is_some(),
        "{} has no chat template (GGUF tokenizer.chat_template, or chat_template in tokenizer_config.json); \
         use `forge generate` for plain text",
        args.model
    );
    let n_positions = engine.model.info().context_length;
    anyhow::ensure!(args.ctx_size <= n_positions, "-c {} exceeds the model's context of {n_positions}", args.ctx_size);
    let n_ctx = if args.ctx_size > 0 { args.ctx_size } else { n_positions };
    let mut session = engine.new_session(n_ctx.saturating_sub(1).max(1));
    let sampling = args.sampling.params(n_ctx)?;
    if !sampling.is_greedy() {
        eprintln!("seed: {} (pass -s {} to repeat this conversation)", sampling.seed, sampling.seed);
    }
    let mut messages: Vec<Message> = args.system_prompt.iter().map(|s| Message::new("system", s)).collect();
    let interactive = std::io::stdin().is_terminal();
    eprintln!(
        "chat with {} on {} ({} positions); /clear starts over, /exit or end of input ends",
        args.model,
        engine.backend.name(),
        n_ctx
    );
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let mut turn = 0u64;
    loop {
        if interactive {
            eprint!("> ");
            std::io::stderr().flush().ok();
        }
        let Some(line) = lines.next() else { break };
        let line = line.context("reading stdin (is it UTF-8?)")?;
        let line = line.trim_end_matches('\r');
        match line.trim() {
            "/exit" | "/quit" => break,
            "/clear" => {
                messages.truncate(usize::from(args.system_prompt.is_some()));
                session.clear();
                eprintln!("[conversation cleared]");
                continue;
            }
            "" => continue,
            _ => {}
        }
        messages.push(Message::new("user", line));
        let ids = engine.chat_prompt_ids(&messages)?;
        let mut params = GenerateParams {
            max_new_tokens: usize::try_from(args.n_predict).unwrap_or(usize::MAX),
            sampling: sampling.clone(),
            ignore_eos: false,
            max_context: Some(n_ctx),
            logprobs: None,
        };
        params.sampling.seed = sampling.seed.wrapping_add(turn); // each turn its own draws, all repeatable
        turn += 1;
        // The reply as the API builds it: whole characters, stop strings cut.
        let mut text = TextOut::new(&engine.text.tokenizer, &args.stop);
        let stdout = std::io::stdout();
        let mut out = stdout.lock();
        let start = Instant::now();
        let result = engine.generate_in(&mut session, &ids, &params, |id| {
            if engine.is_eos(id) {
                return Ok(());
            }
            let stopped = text.push(id, None);
            let (delta, _) = text.take_ready(false);
            out.write_all(delta.as_bytes()).map_err(super::stdout_error)?;
            out.flush().map_err(super::stdout_error)?;
            if stopped { Err(Halt::Stop) } else { Ok(()) }
        });
        let generation = match result {
            Ok(g) => g,
            Err(e) => {
                messages.pop();
                eprintln!("error: {e:#} (/clear starts a new conversation)");
                if interactive {
                    continue;
                }
                return Err(e.into());
            }
        };
        text.finish();
        let (tail, _) = text.take_ready(true);
        writeln!(out, "{tail}").map_err(super::stdout_error)?;
        drop(out);
        let reply = text.text().to_owned();
        let seconds = start.elapsed().as_secs_f64();
        let n = generation.generated_ids.len();
        let full =
            if generation.stop == StopReason::ContextFull { "; the context is full, /clear to go on" } else { "" };
        let drafts = if args.spec.is_on() {
            format!(", {} of {} drafted accepted", generation.accepted_tokens, generation.draft_tokens)
        } else {
            String::new()
        };
        eprintln!(
            "[{} prompt tokens ({} cached), {n} generated, {:.1} tokens/s{drafts}{full}]",
            ids.len(),
            generation.reused_prompt_tokens,
            n as f64 / seconds.max(1e-9)
        );
        messages.push(Message::new("assistant", &reply));
    }
    Ok(())
}

//! Generation: tokenizer + model + backend, and the engine core every command runs on.
//!
//! - [`scheduler`]: the one generation loop (plan → run → update), continuous batching
//!   over a KV block pool; [`prefix_cache`] beside it.
//! - [`sampler`]: the one token picker's host half and the sampling parameters the CLI
//!   and the API share.
//! - [`Engine`]: a loaded model with its tokenizer and chat template; `generate` and
//!   sessions (`chat`) are single-request clients of the scheduler.
//! - [`speculate`]: speculative decoding (n-gram or draft-model drafts the scheduler
//!   verifies), giving the very tokens of plain decoding.
//! - [`text`]: tokens to text with stop strings; [`metrics`]: the loop's counters.
//! - [`perplexity`]: llama-perplexity's method, each window a scoring request on the
//!   scheduler; [`lockstep`]: two backends fed the same tokens, their logits compared
//!   (it calls the models directly: what it compares is not a picked token).

pub mod gbnf;
pub mod grammar;
pub mod lockstep;
pub mod logprobs;
pub mod metrics;
pub mod perplexity;
pub mod prefix_cache;
pub mod sampler;
pub mod scheduler;
pub mod speculate;
pub mod text;

use std::path::Path;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::backend::{Backend, HostMatrix, SeqSlice};
use crate::chat::{ChatTemplate, Message, TemplateError};
use crate::model::load::LoadError;
pub use crate::model::load::ModelText;
use crate::model::{Batch, CausalLm, LogitRows};
use crate::tokenizer::Tokenizer;
pub use logprobs::TokenLogprobs;
pub use metrics::Metrics;
pub use sampler::{Sampler, SamplingError, SamplingParams};
pub use scheduler::{Event, Finish, Request, Scheduler, SchedulerConfig};
pub use speculate::{DraftMethod, Speculation};

pub struct Engine<B: Backend> {
    pub backend: B,
    /// Any architecture: the engine only uses [`CausalLm`].
    pub model: Box<dyn CausalLm<B>>,
    /// The tokenizer, chat template and end-of-generation ids from the model's files.
    pub text: ModelText,
    /// Speculative decoding for every scheduler this engine makes ([`Engine::speculate`]).
    pub speculation: Option<Speculation<B>>,
}

/// One conversation, kept between calls of [`Engine::generate_in`]: a scheduler whose
/// one session is pinned, so the next prompt reuses the cached prefix it shares with the
/// tokens already processed, and a chat turn only prefills what is new.
pub struct Session<'e, B: Backend> {
    scheduler: Scheduler<'e, B>,
    /// Positions the session has room for.
    capacity: usize,
}

impl<B: Backend> Session<'_, B> {
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forget the cached tokens (the next prompt is prefilled whole).
    pub fn clear(&mut self) {
        self.scheduler.release_session(SESSION);
    }
}

#[derive(Clone, Debug)]
pub struct GenerateParams {
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Keep going after `<|endoftext|>`.
    pub ignore_eos: bool,
    /// Use at most this many positions of the model's context (llama.cpp's `-c`);
    /// `None`: all of it.
    pub max_context: Option<usize>,
    /// Report each generated token's log-probability and this many top alternatives
    /// ([`Generation::logprobs`]); `None`: none (greedy may then stay on the device).
    pub logprobs: Option<usize>,
}

impl GenerateParams {
    /// Greedy decoding of up to `max_new_tokens`, stopping at EOS, over the whole context.
    pub fn greedy(max_new_tokens: usize) -> Self {
        GenerateParams {
            max_new_tokens,
            sampling: SamplingParams::greedy(),
            ignore_eos: false,
            max_context: None,
            logprobs: None,
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// `max_new_tokens` reached.
    Length,
    /// The model produced an end-of-generation token.
    Eos,
    /// The context (the model's `n_positions`, or the `max_context` cap) is full.
    ContextFull,
    /// The caller's `on_token` asked to stop ([`Halt::Stop`]): a stop string appeared.
    Stop,
}

/// Why an `on_token` callback ends the run: [`Halt::Stop`] ends it early without failing
/// it ([`Engine::generate`] then returns with [`StopReason::Stop`]); [`Halt::Fail`] fails
/// it with the caller's own error, returned as [`EngineError::Callback`]. `?` on any
/// error type makes a `Fail`.
#[derive(Debug)]
pub enum Halt {
    Stop,
    Fail(CallerError),
}

/// A callback's own error, as the engine hands it back ([`EngineError::Callback`]).
pub type CallerError = Box<dyn std::error::Error + Send + Sync>;

impl<E: std::error::Error + Send + Sync + 'static> From<E> for Halt {
    fn from(e: E) -> Self {
        Halt::Fail(Box::new(e))
    }
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Length => "length",
            StopReason::Eos => "eos",
            StopReason::ContextFull => "context_full",
            StopReason::Stop => "stop",
        }
    }
}

#[derive(Clone, Debug, Default)]
pub struct Timings {
    /// Prompt pass plus the first token's sampling.
    pub prefill: Duration,
    /// All later one-token steps.
    pub decode: Duration,
}

#[derive(Clone, Debug)]
pub struct Generation {
    pub prompt_ids: Vec<u32>,
    pub generated_ids: Vec<u32>,
    pub stop: StopReason,
    pub timings: Timings,
    /// One entry per generated token when [`GenerateParams::logprobs`] asked for them.
    pub logprobs: Vec<TokenLogprobs>,
    /// Prompt tokens whose keys and values a session already held (not prefilled again).
    pub reused_prompt_tokens: usize,
    /// Speculative decoding: draft tokens verified, and those accepted.
    pub draft_tokens: usize,
    pub accepted_tokens: usize,
}

/// Why a generation, a scoring or perplexity run, or a setting failed: the prompt or the
/// parameters (the caller's), the engine's run (a failed step: non-finite logits, a cache
/// that could not grow, a constraint), or the caller's own callback.
#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("the prompt is empty (and the model has no BOS token to start from)")]
    EmptyPrompt,
    #[error("the context size must be at least 1")]
    NoContext,
    /// `whose`: "the context size (-c)" or "the model's context".
    #[error("the prompt is {len} tokens but {whose} is {n_ctx}; shorten the prompt")]
    PromptTooLong { len: usize, n_ctx: usize, whose: &'static str },
    #[error("the prompt is {len} tokens but the session holds {n_ctx}; start a new one or raise -c")]
    SessionFull { len: usize, n_ctx: usize },
    #[error(transparent)]
    Sampling(#[from] SamplingError),
    /// A step of the run failed (the scheduler's message).
    #[error("{0}")]
    Run(String),
    #[error("the engine dropped the request without an answer")]
    Dropped,
    /// Speculative decoding's settings, or a draft model that cannot draft for this one.
    #[error("{0}")]
    Speculation(String),
    /// Perplexity's windows and the text they cut (`-c`, `--chunks`, the text's length).
    #[error("{0}")]
    Windows(String),
    /// A lockstep of two engines that do not hold the same model.
    #[error("the two engines must load the same model")]
    ModelsDiffer,
    /// The caller's `on_token` (or perplexity's or lockstep's callback) failed: its own
    /// error, whole ([`io_error_kind`] finds a failed write in it).
    #[error(transparent)]
    Callback(CallerError),
}

impl EngineError {
    /// Whether the caller's input is at fault (the prompt, the context, the parameters).
    pub fn is_input(&self) -> bool {
        matches!(
            self,
            EngineError::EmptyPrompt
                | EngineError::NoContext
                | EngineError::PromptTooLong { .. }
                | EngineError::SessionFull { .. }
                | EngineError::Sampling(_)
                | EngineError::Speculation(_)
                | EngineError::Windows(_)
                | EngineError::ModelsDiffer
        )
    }
}

/// The kind of the `io::Error` that `error` is, or that an [`EngineError::Callback`]
/// carries (a callback's failed write: the CLI ends quietly on a broken pipe).
pub fn io_error_kind(error: &(dyn std::error::Error + 'static)) -> Option<std::io::ErrorKind> {
    if let Some(io) = error.downcast_ref::<std::io::Error>() {
        return Some(io.kind());
    }
    match error.downcast_ref::<EngineError>() {
        Some(EngineError::Callback(inner)) => io_error_kind(inner.as_ref()),
        _ => None,
    }
}

/// The id of the one request [`Engine::generate`] submits, and of a session's.
const ONLY_REQUEST: u64 = 0;
/// Rows per forward when [`Engine::score`] prefills a text.
pub const SCORE_CHUNK: usize = 512;
/// The session id of a [`Session`]'s requests.
const SESSION: u64 = 0;

impl<B: Backend> Engine<B> {
    /// Load a model folder (config.json, model.safetensors or shards, tokenizer files) or
    /// a GGUF file, of any supported architecture.
    pub fn load(backend: B, path: &Path) -> Result<Self, LoadError> {
        let l = crate::model::load_model(&backend, path)?;
        Ok(Engine { backend, model: l.model, text: l.text, speculation: None })
    }

    /// Keep every position of sliding-window layers instead of rings of the window plus
    /// [`crate::model::RING_ROWS`] (`--swa-full`; see [`crate::model::WindowCaches`]).
    pub fn keep_whole_windows(self) -> Self {
        let model = Box::new(crate::model::WindowCaches { inner: self.model, ring_rows: None });
        Engine { model, ..self }
    }

    /// Decode speculatively from now on (`--draft-ngram`, `--model-draft`). A draft
    /// model comes with its tokenizer, which must be this model's id for id over the ids
    /// both have ([`speculate::check_draft_vocabulary`]; padding may differ). The
    /// output stays that of plain decoding when the backend's kernels are
    /// batch-invariant (see [`speculate`]).
    pub fn speculate(
        &mut self,
        speculation: Speculation<B>,
        draft_tokenizer: Option<&Tokenizer>,
    ) -> Result<(), EngineError> {
        let refuse = |m: String| Err(EngineError::Speculation(m));
        if speculation.draft_max < 1 {
            return refuse("--draft-max must be at least 1".into());
        }
        if speculation.draft_min > speculation.draft_max {
            return refuse(format!(
                "--draft-min ({}) is larger than --draft-max ({})",
                speculation.draft_min, speculation.draft_max
            ));
        }
        match &speculation.method {
            DraftMethod::Ngram(n) if *n < 1 => return refuse("--draft-ngram must be at least 1".into()),
            DraftMethod::Ngram(_) => {}
            DraftMethod::Model(_) => {
                let Some(theirs) = draft_tokenizer else {
                    return refuse("a draft model needs its tokenizer to be checked".into());
                };
                let (mine, theirs_n) = (self.text.tokenizer.vocab_size(), theirs.vocab_size());
                // The output sizes may differ by padding (Qwen 2.5 0.5B's 151,936 and 7B's
                // 152,064 rows over one tokenizer).
                speculate::check_draft_vocabulary(
                    mine,
                    theirs_n,
                    |id| self.text.tokenizer.token_bytes(id).ok().map(<[u8]>::to_vec),
                    |id| theirs.token_bytes(id).ok().map(<[u8]>::to_vec),
                )?;
            }
        }
        self.speculation = Some(speculation);
        Ok(())
    }

    /// Use the Jinja chat template in the file at `path` instead of the one the model's
    /// files carry (llama.cpp's and vLLM's `--chat-template FILE`); BOS and EOS are the
    /// texts of the model's own tokens.
    pub fn use_chat_template_file(&mut self, path: &Path) -> Result<(), TemplateError> {
        let source = std::fs::read_to_string(path).map_err(|e| TemplateError::File {
            path: path.to_owned(),
            message: format!("cannot read the chat template: {e}"),
        })?;
        let text = |id: Option<u32>| {
            id.and_then(|id| self.text.tokenizer.token_bytes(id).ok())
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default()
        };
        let info = self.model.info();
        let (bos, eos) = (text(info.bos_token_id), text(info.eos_token_ids.first().copied()));
        let template = ChatTemplate::new(&source, &bos, &eos).map_err(|e| match e {
            TemplateError::Compile(m) => {
                TemplateError::File { path: path.to_owned(), message: format!("does not compile: {m}") }
            }
            e => e,
        })?;
        self.text.chat_template = Some(template);
        self.text.chat_template_error = None;
        Ok(())
    }

    /// [`ModelText::prompt_ids`].
    pub fn prompt_ids(&self, text: &str) -> Vec<u32> {
        self.text.prompt_ids(text)
    }

    /// [`ModelText::is_eos`].
    pub fn is_eos(&self, id: u32) -> bool {
        self.text.is_eos(id)
    }

    /// [`ModelText::chat_prompt_ids`].
    pub fn chat_prompt_ids(&self, messages: &[Message]) -> Result<Vec<u32>, TemplateError> {
        self.text.chat_prompt_ids(messages)
    }

    /// A session (a conversation) for up to `capacity` positions, capped by the model's
    /// context.
    pub fn new_session(&self, capacity: usize) -> Session<'_, B> {
        let capacity = capacity.min(self.model.info().context_length).max(1);
        Session { scheduler: self.scheduler(SchedulerConfig::single(capacity)), capacity }
    }

    /// A scheduler over this engine's model (the engine core every command runs on).
    pub fn scheduler(&self, config: SchedulerConfig) -> Scheduler<'_, B> {
        let s = Scheduler::new(
            &self.backend,
            &*self.model,
            config,
            self.text.end_of_generation.clone(),
            std::sync::Arc::new(Metrics::default()),
        );
        match &self.speculation {
            Some(sp) => s.with_drafter(sp.drafter(), sp.draft_max, sp.draft_min).draft_while_at_most(sp.batch_max),
            None => s,
        }
    }

    /// Logits for every position of `ids`, from one pass without a prior cache: (T, V).
    pub fn logits_all(&self, ids: &[u32]) -> Result<HostMatrix, EngineError> {
        self.check_prompt(ids.len(), None)?;
        let run = || -> crate::backend::BackendResult<HostMatrix> {
            let mut cache = self.model.new_cache(&self.backend, ids.len())?;
            let seqs = [SeqSlice { rows: 0..ids.len(), start_pos: 0 }];
            let out = self.model.forward(
                &self.backend,
                &Batch { tokens: ids, seqs: &seqs },
                &mut [&mut cache],
                LogitRows::All,
            )?;
            self.backend.read(&out)
        };
        run().map_err(|e| EngineError::Run(e.to_string()))
    }

    /// The context a run may use: the model's `n_positions`, capped by `max_context`
    /// (llama.cpp's `-c`). A prompt that is empty or does not fit is an error.
    pub fn check_prompt(&self, prompt_len: usize, max_context: Option<usize>) -> Result<usize, EngineError> {
        let n_positions = self.model.info().context_length;
        let n_ctx = max_context.map_or(n_positions, |c| c.min(n_positions));
        if prompt_len == 0 {
            return Err(EngineError::EmptyPrompt);
        }
        if n_ctx == 0 {
            return Err(EngineError::NoContext);
        }
        if prompt_len > n_ctx {
            let whose = if n_ctx < n_positions { "the context size (-c)" } else { "the model's context" };
            return Err(EngineError::PromptTooLong { len: prompt_len, n_ctx, whose });
        }
        Ok(n_ctx)
    }

    /// Generate from `prompt_ids`, calling `on_token` with each new id as soon as it is
    /// chosen: one request on the engine's scheduler.
    pub fn generate(
        &self,
        prompt_ids: &[u32],
        params: &GenerateParams,
        on_token: impl FnMut(u32) -> Result<(), Halt>,
    ) -> Result<Generation, EngineError> {
        self.generate_constrained(prompt_ids, params, None, on_token)
    }

    /// [`Engine::generate`] with the output held to `constraint` (structured output,
    /// [`grammar`]): it ends with [`StopReason::Eos`] once the output is complete.
    pub fn generate_constrained(
        &self,
        prompt_ids: &[u32],
        params: &GenerateParams,
        constraint: Option<grammar::Constraint>,
        on_token: impl FnMut(u32) -> Result<(), Halt>,
    ) -> Result<Generation, EngineError> {
        let n_ctx = self.check_prompt(prompt_ids.len(), params.max_context)?;
        let budget = params.max_new_tokens.min(n_ctx - prompt_ids.len());
        let positions = scheduler::positions_for(prompt_ids.len(), budget);
        let mut scheduler = self.scheduler(SchedulerConfig::single(positions));
        run_request(&mut scheduler, None, prompt_ids, budget, params, constraint, on_token)
    }

    /// Score `ids`: the log-probability of each token after the first given the ones
    /// before it, with the `top` most likely alternatives: what the server's `echo` with
    /// `logprobs` reports, and what an evaluation's log-likelihood sums. One request on
    /// the engine's scheduler, prefilled in chunks of at most [`SCORE_CHUNK`] rows, so the
    /// logits held at once stay bounded however long the text.
    pub fn score(&self, ids: &[u32], top: usize) -> Result<Vec<TokenLogprobs>, EngineError> {
        self.check_prompt(ids.len(), None)?;
        if ids.len() < 2 {
            return Ok(Vec::new()); // nothing comes after the first token
        }
        let mut scheduler = self.scoring_scheduler(ids.len());
        let mut scored = Vec::with_capacity(ids.len() - 1);
        score_on(&mut scheduler, ONLY_REQUEST, ids, top, |part| scored.extend(part))?;
        Ok(scored)
    }

    /// A scheduler for scoring prompts of up to `positions` tokens, one at a time, each
    /// prefilled in chunks of at most [`SCORE_CHUNK`] rows.
    pub(crate) fn scoring_scheduler(&self, positions: usize) -> Scheduler<'_, B> {
        let mut config = SchedulerConfig::single(scheduler::positions_for(positions, 0));
        config.batch_tokens = config.batch_tokens.min(SCORE_CHUNK);
        self.scheduler(config)
    }

    /// [`Engine::generate`] within a session: the cached prefix that `prompt_ids` shares
    /// with the session's tokens is reused, the rest is prefilled, and the session then
    /// holds the prompt and the generated tokens (all but the last). The context is the
    /// session's capacity + 1 (the last token is never cached), capped as in `generate`.
    pub fn generate_in(
        &self,
        session: &mut Session<'_, B>,
        prompt_ids: &[u32],
        params: &GenerateParams,
        on_token: impl FnMut(u32) -> Result<(), Halt>,
    ) -> Result<Generation, EngineError> {
        let n_ctx = self.check_prompt(prompt_ids.len(), params.max_context)?.min(session.capacity + 1);
        if prompt_ids.len() > n_ctx {
            return Err(EngineError::SessionFull { len: prompt_ids.len(), n_ctx });
        }
        // Total length never exceeds the context (HF cuts max_new_tokens the same way).
        let budget = params.max_new_tokens.min(n_ctx - prompt_ids.len());
        run_request(&mut session.scheduler, Some(SESSION), prompt_ids, budget, params, None, on_token)
    }
}

/// Score `ids` as request `id` on `scheduler` (one with nothing else to do): each token
/// after the first, in order, handed to `on_part` in the parts the steps produce.
pub(crate) fn score_on<B: Backend>(
    scheduler: &mut Scheduler<'_, B>,
    id: u64,
    ids: &[u32],
    top: usize,
    mut on_part: impl FnMut(Vec<TokenLogprobs>),
) -> Result<(), EngineError> {
    let mut request = Request::new(id, ids.to_vec(), 0, SamplingParams::greedy());
    request.prompt_logprobs = Some(top);
    scheduler.add(request);
    let mut scored = 0;
    let mut events = Vec::with_capacity(4);
    loop {
        scheduler.step(&mut events);
        for (_, event) in events.drain(..) {
            match event {
                Event::PromptLogprobs(part) => {
                    scored += part.len();
                    on_part(part);
                }
                Event::Finished { .. } => {
                    if scored != ids.len() - 1 {
                        return Err(EngineError::Run(format!("scored {scored} of {} tokens", ids.len() - 1)));
                    }
                    return Ok(());
                }
                Event::Failed(e) => return Err(EngineError::Run(e)),
                _ => {}
            }
        }
        if !scheduler.busy() {
            return Err(EngineError::Dropped);
        }
    }
}

/// Submit one request of up to `budget` tokens and step the scheduler until it ends,
/// handing each token to `on_token`.
fn run_request<B: Backend>(
    scheduler: &mut Scheduler<'_, B>,
    session: Option<u64>,
    prompt_ids: &[u32],
    budget: usize,
    params: &GenerateParams,
    constraint: Option<grammar::Constraint>,
    mut on_token: impl FnMut(u32) -> Result<(), Halt>,
) -> Result<Generation, EngineError> {
    let mut generation = Generation {
        prompt_ids: prompt_ids.to_vec(),
        generated_ids: Vec::with_capacity(budget),
        stop: if budget < params.max_new_tokens { StopReason::ContextFull } else { StopReason::Length },
        timings: Timings::default(),
        logprobs: Vec::new(),
        reused_prompt_tokens: 0,
        draft_tokens: 0,
        accepted_tokens: 0,
    };
    if budget == 0 {
        return Ok(generation);
    }
    params.sampling.validate()?;
    let mut request = Request::new(ONLY_REQUEST, prompt_ids.to_vec(), budget, params.sampling.clone());
    request.logprobs = params.logprobs;
    request.ignore_eos = params.ignore_eos;
    request.session = session;
    request.constraint = constraint;
    scheduler.add(request);
    let start = Instant::now();
    let spec = |s: &Scheduler<'_, B>| {
        let m = s.metrics();
        (m.spec_draft_tokens.load(Ordering::Relaxed), m.spec_accepted_tokens.load(Ordering::Relaxed))
    };
    let before = spec(scheduler);
    let done = |g: &mut Generation, s: &Scheduler<'_, B>| {
        g.timings.decode = start.elapsed() - g.timings.prefill;
        let after = spec(s);
        g.draft_tokens = (after.0 - before.0) as usize;
        g.accepted_tokens = (after.1 - before.1) as usize;
    };
    let mut events = Vec::with_capacity(4);
    loop {
        scheduler.step(&mut events);
        for (_, event) in events.drain(..) {
            let (id, logprobs) = match event {
                Event::Started { cached } => {
                    generation.reused_prompt_tokens = cached;
                    continue;
                }
                Event::PromptLogprobs(_) => continue,
                Event::Token { id, logprobs } => (id, logprobs),
                Event::EndToken { id, logprobs } => {
                    generation.stop = StopReason::Eos;
                    (id, logprobs)
                }
                Event::Finished { reason, .. } => {
                    if reason == Finish::Eos {
                        generation.stop = StopReason::Eos; // also a constrained output complete
                    }
                    done(&mut generation, scheduler);
                    return Ok(generation);
                }
                Event::Failed(e) => return Err(EngineError::Run(e)),
            };
            if generation.generated_ids.is_empty() {
                generation.timings.prefill = start.elapsed();
            }
            generation.generated_ids.push(id);
            generation.logprobs.extend(logprobs);
            if let Err(halt) = on_token(id) {
                scheduler.abort(ONLY_REQUEST);
                return match halt {
                    Halt::Stop => {
                        generation.stop = StopReason::Stop;
                        done(&mut generation, scheduler);
                        Ok(generation)
                    }
                    Halt::Fail(e) => Err(EngineError::Callback(e)),
                };
            }
        }
        if !scheduler.busy() {
            return Err(EngineError::Dropped);
        }
    }
}

//! Generation: tokenizer + model + backend, a KV cache per sequence, the
//! prefill-then-decode loop, sampling and stop conditions.

pub mod lockstep;
pub mod logprobs;
pub mod perplexity;
pub mod sampler;

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{bail, ensure};

use crate::backend::{Backend, HostMatrix, NON_FINITE_ROW, SeqSlice};
use crate::chat::{ChatTemplate, Message};
use crate::model::{Batch, CausalLm, LogitRows};
use crate::tokenizer::Tokenizer;
pub use logprobs::TokenLogprobs;
pub use sampler::{Sampler, SamplingParams};

/// [`Engine::prompt_ids`] from the parts (the server holds them apart from the model).
pub fn prompt_ids(tokenizer: &Tokenizer, bos_token_id: Option<u32>, text: &str) -> Vec<u32> {
    let mut ids: Vec<u32> = tokenizer.bos_to_add().into_iter().collect();
    ids.extend(tokenizer.encode(text));
    if ids.is_empty()
        && let Some(bos) = bos_token_id
    {
        ids.push(bos);
    }
    ids
}

/// [`Engine::chat_prompt_ids`] from the parts.
pub fn chat_prompt_ids(
    tokenizer: &Tokenizer,
    template: Option<&ChatTemplate>,
    template_error: Option<&str>,
    messages: &[Message],
) -> anyhow::Result<Vec<u32>> {
    let template = match (template, template_error) {
        (Some(t), _) => t,
        (None, Some(e)) => bail!("the model's chat template cannot be used: {e}"),
        (None, None) => bail!(
            "this model has no chat template (GGUF tokenizer.chat_template, or chat_template in tokenizer_config.json)"
        ),
    };
    Ok(tokenizer.encode(&template.render(messages, true)?))
}

pub struct Engine<B: Backend> {
    pub backend: B,
    /// Any architecture: the engine only uses [`CausalLm`].
    pub model: Box<dyn CausalLm<B>>,
    pub tokenizer: Tokenizer,
    /// The model's chat template, if its files carry one that compiles.
    pub chat_template: Option<ChatTemplate>,
    /// Why the files' template could not be used, if they carry a broken one.
    pub chat_template_error: Option<String>,
    /// Tokens that end generation ([`crate::model::load::Loaded::end_of_generation`]).
    pub end_of_generation: Vec<u32>,
}

/// One conversation's KV cache, kept between calls of [`Engine::generate_in`]: the next
/// prompt reuses the cached prefix it shares with the tokens already processed, so a
/// chat turn only prefills what is new.
pub struct Session<B: Backend> {
    cache: B::KvCache,
    /// Positions the cache has room for.
    capacity: usize,
    /// The tokens whose keys and values the cache holds, in order.
    tokens: Vec<u32>,
}

impl<B: Backend> Session<B> {
    /// Tokens whose keys and values are cached.
    pub fn cached_tokens(&self) -> &[u32] {
        &self.tokens
    }

    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Forget the cached tokens (the next prompt is prefilled whole).
    pub fn clear(&mut self) {
        self.tokens.clear();
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
}

impl StopReason {
    pub fn as_str(self) -> &'static str {
        match self {
            StopReason::Length => "length",
            StopReason::Eos => "eos",
            StopReason::ContextFull => "context_full",
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
}

/// The error for logits that are NaN or infinite: the weights or the arithmetic are
/// broken, and no token chosen from them would mean anything.
fn non_finite(step: usize, position: usize, first: Option<(usize, f32)>) -> anyhow::Error {
    let what = match first {
        Some((id, v)) => format!(" (token id {id}: {v})"),
        None => String::new(),
    };
    anyhow::anyhow!(
        "the model produced non-finite logits{what} at generation step {step} (position {position}); \
         the weights or the computation are broken (try --backend reference to compare)"
    )
}

/// Logits with a NaN or an infinity are an error naming the step and position.
pub fn ensure_finite(logits: &[f32], step: usize, position: usize) -> anyhow::Result<()> {
    match logits.iter().position(|v| !v.is_finite()) {
        Some(i) => Err(non_finite(step, position, Some((i, logits[i])))),
        None => Ok(()),
    }
}

/// Chooses each next token from one row of logits: greedy on the device where the
/// backend can (only the id is read back), else on the host from read-back logits.
/// Non-finite logits are an error naming the step. Keeps its scratch between steps, so
/// a warm decode loop does not allocate.
pub struct TokenPicker {
    sampler: Sampler,
    logits: HostMatrix,
    device_ids: Vec<u32>,
    /// Always read the logits back (for log-probabilities), never pick on the device.
    host_logits: bool,
}

impl TokenPicker {
    pub fn new(params: SamplingParams) -> anyhow::Result<Self> {
        let sampler = Sampler::new(params).map_err(anyhow::Error::msg)?;
        Ok(TokenPicker {
            sampler,
            logits: HostMatrix::zeros(0, 0),
            device_ids: Vec::with_capacity(1),
            host_logits: false,
        })
    }

    /// Read every step's logits back to the host, so [`TokenPicker::last_logits`] has them.
    pub fn keep_logits(&mut self) {
        self.host_logits = true;
    }

    /// The logits of the last [`TokenPicker::pick`] when it read them back (always after
    /// [`TokenPicker::keep_logits`]).
    pub fn last_logits(&self) -> Option<&[f32]> {
        (self.logits.rows == 1).then(|| self.logits.row(0))
    }

    /// Room for the repetition penalty's history over a context of `n_ctx` tokens.
    pub fn reserve(&mut self, n_ctx: usize) {
        self.sampler.reserve_history(n_ctx);
    }

    /// Record the prompt's tokens (for the repetition penalty; chosen tokens are
    /// recorded by [`TokenPicker::pick`]).
    pub fn accept_prompt(&mut self, ids: &[u32]) {
        self.sampler.accept(ids);
    }

    /// The token after the row `out` (logits of shape (1, V)) at `position`, generation step `step`.
    pub fn pick<B: Backend>(&mut self, backend: &B, out: &B::Act, step: usize, position: usize) -> anyhow::Result<u32> {
        let params = self.sampler.params();
        if params.is_greedy()
            && !params.penalizes()
            && !self.host_logits
            && backend.argmax_rows(out, &mut self.device_ids)?
        {
            return match self.device_ids[0] {
                NON_FINITE_ROW => Err(non_finite(step, position, None)),
                id => Ok(id),
            };
        }
        backend.to_host(out, &mut self.logits)?;
        let row = self.logits.row(0);
        ensure_finite(row, step, position)?;
        let id = self.sampler.sample(row);
        self.sampler.accept(&[id]);
        Ok(id)
    }
}

impl<B: Backend> Engine<B> {
    /// Load a model folder (config.json, model.safetensors or shards, tokenizer files) or
    /// a GGUF file, of any supported architecture.
    pub fn load(backend: B, path: &Path) -> anyhow::Result<Self> {
        let l = crate::model::load_model(&backend, path)?;
        Ok(Engine {
            backend,
            model: l.model,
            tokenizer: l.tokenizer,
            chat_template: l.chat_template,
            chat_template_error: l.chat_template_error,
            end_of_generation: l.end_of_generation,
        })
    }

    /// Use the Jinja chat template in the file at `path` instead of the one the model's
    /// files carry (llama.cpp's and vLLM's `--chat-template FILE`); BOS and EOS are the
    /// texts of the model's own tokens.
    pub fn use_chat_template_file(&mut self, path: &Path) -> anyhow::Result<()> {
        use anyhow::Context;
        let source = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read the chat template {}", path.display()))?;
        let text = |id: Option<u32>| {
            id.and_then(|id| self.tokenizer.token_bytes(id).ok())
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default()
        };
        let info = self.model.info();
        let (bos, eos) = (text(info.bos_token_id), text(info.eos_token_ids.first().copied()));
        let template = ChatTemplate::new(&source, &bos, &eos).with_context(|| path.display().to_string())?;
        self.chat_template = Some(template);
        self.chat_template_error = None;
        Ok(())
    }

    /// The token ids of a prompt as the model expects them: the tokenizer's ids, after the
    /// BOS token when the model's files ask for one (GGUF `add_bos_token`); an empty prompt
    /// is the BOS token alone (GPT-2's `<|endoftext|>`).
    pub fn prompt_ids(&self, text: &str) -> Vec<u32> {
        prompt_ids(&self.tokenizer, self.model.info().bos_token_id, text)
    }

    /// Whether `id` ends generation.
    pub fn is_eos(&self, id: u32) -> bool {
        self.end_of_generation.contains(&id)
    }

    /// The token ids of a conversation rendered with the model's chat template, ending
    /// with the assistant's turn opened (`add_generation_prompt`). The text is encoded as
    /// HF's `apply_chat_template` does: special-token text becomes its id, and nothing is
    /// added (the template writes any BOS itself).
    pub fn chat_prompt_ids(&self, messages: &[Message]) -> anyhow::Result<Vec<u32>> {
        chat_prompt_ids(&self.tokenizer, self.chat_template.as_ref(), self.chat_template_error.as_deref(), messages)
    }

    /// A session (KV cache) for up to `capacity` positions, capped by the model's context.
    pub fn new_session(&self, capacity: usize) -> anyhow::Result<Session<B>> {
        let capacity = capacity.min(self.model.info().context_length);
        let mut tokens = Vec::new();
        tokens.try_reserve_exact(capacity)?;
        Ok(Session { cache: self.model.new_cache(&self.backend, capacity)?, capacity, tokens })
    }

    /// Logits for every position of `ids`, from one pass without a prior cache: (T, V).
    pub fn logits_all(&self, ids: &[u32]) -> anyhow::Result<HostMatrix> {
        let mut cache = self.model.new_cache(&self.backend, ids.len())?;
        let seqs = [SeqSlice { rows: 0..ids.len(), start_pos: 0 }];
        let out = self.model.forward(
            &self.backend,
            &Batch { tokens: ids, seqs: &seqs },
            &mut [&mut cache],
            LogitRows::All,
        )?;
        self.backend.read(&out)
    }

    /// The context a run may use: the model's `n_positions`, capped by `max_context`
    /// (llama.cpp's `-c`). A prompt that is empty or does not fit is an error.
    pub fn check_prompt(&self, prompt_len: usize, max_context: Option<usize>) -> anyhow::Result<usize> {
        let n_positions = self.model.info().context_length;
        let n_ctx = max_context.map_or(n_positions, |c| c.min(n_positions));
        ensure!(prompt_len > 0, "the prompt is empty (and the model has no BOS token to start from)");
        ensure!(n_ctx > 0, "the context size must be at least 1");
        if prompt_len > n_ctx {
            let whose = if n_ctx < n_positions { "the context size (-c)" } else { "the model's context" };
            bail!("the prompt is {prompt_len} tokens but {whose} is {n_ctx}; shorten the prompt");
        }
        Ok(n_ctx)
    }

    /// Generate from `prompt_ids`, calling `on_token` with each new id as soon as it is chosen.
    pub fn generate(
        &self,
        prompt_ids: &[u32],
        params: &GenerateParams,
        on_token: impl FnMut(u32) -> anyhow::Result<()>,
    ) -> anyhow::Result<Generation> {
        let n_ctx = self.check_prompt(prompt_ids.len(), params.max_context)?;
        // The last chosen token is never fed back: prompt + budget - 1 positions.
        let budget = params.max_new_tokens.min(n_ctx - prompt_ids.len());
        let mut session = self.new_session((prompt_ids.len() + budget).saturating_sub(1).max(1))?;
        self.generate_in(&mut session, prompt_ids, params, on_token)
    }

    /// [`Engine::generate`] within a session: the cached prefix that `prompt_ids` shares
    /// with the session's tokens is reused, the rest is prefilled, and the session then
    /// holds the prompt and the generated tokens (all but the last). The context is the
    /// session's capacity + 1 (the last token is never cached), capped as in `generate`.
    pub fn generate_in(
        &self,
        session: &mut Session<B>,
        prompt_ids: &[u32],
        params: &GenerateParams,
        mut on_token: impl FnMut(u32) -> anyhow::Result<()>,
    ) -> anyhow::Result<Generation> {
        let n_ctx = self.check_prompt(prompt_ids.len(), params.max_context)?.min(session.capacity + 1);
        ensure!(
            prompt_ids.len() <= n_ctx,
            "the prompt is {} tokens but the session holds {n_ctx}; start a new one or raise -c",
            prompt_ids.len()
        );
        let mut picker = TokenPicker::new(params.sampling.clone())?;
        picker.reserve(n_ctx);
        picker.accept_prompt(prompt_ids);
        // Total length never exceeds the context (HF cuts max_new_tokens the same way).
        let budget = params.max_new_tokens.min(n_ctx - prompt_ids.len());
        let mut generation = Generation {
            prompt_ids: prompt_ids.to_vec(),
            generated_ids: Vec::with_capacity(budget),
            stop: if budget < params.max_new_tokens { StopReason::ContextFull } else { StopReason::Length },
            timings: Timings::default(),
            logprobs: Vec::new(),
            reused_prompt_tokens: 0,
        };
        if params.logprobs.is_some() {
            picker.keep_logits();
        }
        if budget == 0 {
            return Ok(generation);
        }
        // Reuse the longest cached prefix, but always run at least the prompt's last token
        // (its logits choose the first new one).
        let shared = session.tokens.iter().zip(prompt_ids).take_while(|(a, b)| a == b).count();
        let reuse = shared.min(prompt_ids.len() - 1);
        session.tokens.truncate(reuse);
        generation.reused_prompt_tokens = reuse;
        let start = Instant::now();
        let mut step_tokens = prompt_ids[reuse..].to_vec();
        let mut pos = reuse;
        loop {
            let seqs = [SeqSlice { rows: 0..step_tokens.len(), start_pos: pos }];
            let batch = Batch { tokens: &step_tokens, seqs: &seqs };
            let out = self.model.forward(&self.backend, &batch, &mut [&mut session.cache], LogitRows::LastOfEachSeq);
            let out = match out {
                Ok(out) => out,
                Err(e) => {
                    session.tokens.clear(); // the cache may hold part of this step
                    return Err(e);
                }
            };
            session.tokens.extend_from_slice(&step_tokens);
            let step = generation.generated_ids.len();
            let next = picker.pick(&self.backend, &out, step, pos + step_tokens.len() - 1)?;
            if generation.generated_ids.is_empty() {
                generation.timings.prefill = start.elapsed();
            }
            pos += step_tokens.len();
            if let (Some(n), Some(logits)) = (params.logprobs, picker.last_logits()) {
                generation.logprobs.push(logprobs::token_logprobs(logits, next, n));
            }
            generation.generated_ids.push(next);
            on_token(next)?;
            if self.is_eos(next) && !params.ignore_eos {
                generation.stop = StopReason::Eos;
                break;
            }
            if generation.generated_ids.len() == budget {
                break;
            }
            step_tokens.clear();
            step_tokens.push(next);
        }
        generation.timings.decode = start.elapsed() - generation.timings.prefill;
        Ok(generation)
    }
}

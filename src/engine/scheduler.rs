//! The engine core: one loop that owns the model and every sequence's KV cache and,
//! each step, runs a single forward over all active sequences (continuous batching).
//! Every command that generates is its client: `forge generate` and `chat` submit one
//! request and step until it ends, `forge bench` steps many, `forge serve` routes HTTP
//! requests in and outputs back.
//!
//! A step is plan → run → update:
//! - **plan**: admit waiting requests while their KV blocks are free (a request is
//!   dropped the moment [`Scheduler::abort`] is called), then choose the rows: one
//!   decode row for every running sequence, then the drafts to verify (speculative
//!   decoding; while prompts wait, they leave them up to half of the budget), then chunks of
//!   waiting prompts up to a per-step token budget (chunked prefill), so a long prompt
//!   never stalls the sequences already decoding;
//! - **run**: one forward over those rows, then the token picker: the argmax on the
//!   device when every sequence is greedy without penalties or logprobs and the backend
//!   can (only the ids are read back), else the logits on the host and each sequence's
//!   [`Sampler`];
//! - **update**: append the tokens, report them as [`Event`]s, retire finished
//!   sequences.
//!
//! KV memory is counted in blocks of [`BLOCK_TOKENS`] positions from one pool of
//! `ctx_size` positions: a request is admitted (first come, first served) when the
//! blocks for its prompt plus `max_tokens` are free, and waits otherwise. Finished
//! sequences leave their caches in a [`PrefixCache`] keyed by the hash chain of their
//! full blocks; a new prompt that starts with cached blocks copies those positions
//! instead of computing them again. A request that names a session (a conversation)
//! leaves its cache pinned to that session instead, and the session's next request
//! reuses every position it shares with it. A draft model's cache for a sequence
//! (speculative decoding) holds at most the positions that sequence reserved, so with
//! `--model-draft` each reserved position stands for the draft model's keys and values
//! as well as the model's. A sliding-window layer's cache is a ring
//! ([`crate::backend::KvRings`]): a cached or pinned cache is reused only where its rings
//! still hold the window before the shared prefix, and drafts are cut to what a ring can
//! give back.
//!
//! The loop knows nothing of the model's architecture ([`CausalLm`]), of HTTP or of
//! terminals: requests come in through [`Scheduler::add`], and each step appends what
//! happened to a list of `(request id, Event)`.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use super::grammar::{Constraint, GrammarError, Mask};
use super::logprobs::token_logprobs;
use super::metrics::{Gauges, Metrics};
use super::prefix_cache::PrefixCache;
pub use super::prefix_cache::{BLOCK_TOKENS, block_hashes, blocks_for};
use super::speculate::{DraftSeq, Drafter};
use super::{Sampler, SamplingParams, TokenLogprobs};
use crate::backend::{Backend, BackendResult, HostMatrix, KvCache, NON_FINITE_ROW, SeqSlice};
use crate::model::{Batch, CausalLm, LogitRows};

/// One request to generate (or to score a prompt).
#[derive(Clone, Debug)]
pub struct Request {
    /// The caller's id; every [`Event`] of this request carries it.
    pub id: u64,
    /// Prompt token ids (at least one, each inside the vocabulary; checked by the caller).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (prompt + max_tokens ≤ the context). 0 only with
    /// `prompt_logprobs`: the prompt is scored, nothing is generated.
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Report each token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
    /// Also score the prompt (OpenAI's `echo` with `logprobs`): the log-probability of
    /// every prompt token after the first, given the ones before it, with this many
    /// alternatives. Such a prompt is computed in full (no prefix-cache reuse), and the
    /// steps that prefill it compute logits for every row.
    pub prompt_logprobs: Option<usize>,
    /// Keep going after an end-of-generation token.
    pub ignore_eos: bool,
    /// A conversation this request continues: when it finishes, its cache stays pinned
    /// to the session (not in the shared prefix cache), and the session's next request
    /// reuses every cached position its prompt shares (`chat`).
    pub session: Option<u64>,
    /// Structured output: every token is picked among those the constraint allows,
    /// and the sequence ends when its output is complete.
    pub constraint: Option<Constraint>,
    /// Sees each picked token's logits (the model's, masked by the constraint if any;
    /// the sampler penalizes its own copy) and the token the sampler drew, and returns the
    /// token to take: a caller that compares or steers picks (`--backend both` feeds one
    /// backend the other's tokens). Its logits always come to the host, and its sequence
    /// is never drafted for (one pick per step).
    pub pick_hook: Option<PickHook>,
    pub arrived: Instant,
}

/// See [`Request::pick_hook`].
#[derive(Clone)]
pub struct PickHook(pub Arc<PickFn>);

/// (the pick's logits, the sampler's token) → the token to take.
pub type PickFn = dyn Fn(&[f32], u32) -> u32 + Send + Sync;

impl std::fmt::Debug for PickHook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PickHook")
    }
}

impl Request {
    /// A request with no log-probabilities, stopping at end of generation, in no session.
    pub fn new(id: u64, prompt: Vec<u32>, max_tokens: usize, sampling: SamplingParams) -> Self {
        Request {
            id,
            prompt,
            max_tokens,
            sampling,
            logprobs: None,
            prompt_logprobs: None,
            ignore_eos: false,
            session: None,
            constraint: None,
            pick_hook: None,
            arrived: Instant::now(),
        }
    }
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The model produced an end-of-generation token (not sent as a token).
    Eos,
    /// `max_tokens` reached.
    Length,
}

/// What a request's caller gets, in order: tokens, then one `Finished` or `Failed`.
#[derive(Debug)]
pub enum Event {
    /// The prompt is admitted; `cached` of its tokens came from a cache.
    Started {
        cached: usize,
    },
    /// Log-probabilities of prompt tokens, in order (a chunk's worth at a time; only
    /// for [`Request::prompt_logprobs`], all of them before the first `Token`).
    PromptLogprobs(Vec<TokenLogprobs>),
    Token {
        id: u32,
        logprobs: Option<TokenLogprobs>,
    },
    /// The end-of-generation token that ended the sequence, just before
    /// `Finished { reason: Eos }`: not part of the text (the server drops it; `generate`
    /// reports it as llama.cpp and HF do).
    EndToken {
        id: u32,
        logprobs: Option<TokenLogprobs>,
    },
    Finished {
        reason: Finish,
        generated: usize,
    },
    Failed(String),
}

/// How the loop batches.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Sequences decoded together at most (`-np`).
    pub parallel: usize,
    /// KV positions in the pool, over all sequences (`-c`); a multiple of [`BLOCK_TOKENS`].
    pub ctx_size: usize,
    /// Tokens per forward at most (decode rows plus prompt chunks; `-b`).
    pub batch_tokens: usize,
    /// Keep finished sequences' caches for reuse.
    pub prefix_cache: bool,
    /// Positions beyond its prompt a new sequence's cache holds at first (at most what
    /// its request reserves; it doubles when they are used up): [`INITIAL_SLACK`], or
    /// `usize::MAX` to allocate every reserved position up front (benchmarks).
    pub initial_slack: usize,
    /// A pause after every step: a test hook (`BATCH_FORGE_STEP_DELAY_MS`) that makes a
    /// tiny model's generation last long enough to hang up on or queue behind.
    pub step_delay: Duration,
}

impl SchedulerConfig {
    /// One sequence at a time over `positions` positions, a prompt in one forward, no
    /// prefix cache: a command that runs one request (`generate`, `chat`).
    pub fn single(positions: usize) -> Self {
        let ctx_size = blocks_for(positions) * BLOCK_TOKENS;
        SchedulerConfig {
            parallel: 1,
            ctx_size,
            batch_tokens: ctx_size,
            prefix_cache: false,
            initial_slack: INITIAL_SLACK,
            step_delay: Duration::ZERO,
        }
    }

    pub fn total_blocks(&self) -> usize {
        self.ctx_size / BLOCK_TOKENS
    }
}

/// Positions a new sequence's cache holds beyond its prompt at first (at most what its
/// request reserves); it doubles when they are used up, so a request for many tokens
/// that ends early never holds memory for all of them.
pub const INITIAL_SLACK: usize = 256;

/// Positions a request's cache needs: its prompt and every generated token but the
/// last (never fed back); the prompt alone when nothing is generated (a scored prompt).
pub fn positions_for(prompt_len: usize, max_tokens: usize) -> usize {
    if max_tokens == 0 { prompt_len.max(1) } else { (prompt_len + max_tokens).saturating_sub(1).max(1) }
}

/// The error for logits that are NaN or infinite: the weights or the arithmetic are
/// broken, and no token chosen from them would mean anything.
pub fn non_finite_message(step: usize, position: usize, first: Option<(usize, f32)>) -> String {
    let what = match first {
        Some((id, v)) => format!(" (token id {id}: {v})"),
        None => String::new(),
    };
    format!(
        "the model produced non-finite logits{what} at generation step {step} (position {position}); \
         the weights or the computation are broken (try --backend reference to compare)"
    )
}

/// A running sequence.
struct Seq<C> {
    request: Request,
    cache: C,
    /// Positions the cache has room for.
    capacity: usize,
    blocks: usize,
    /// Prompt and generated tokens; `tokens[..cached]` are in the cache, the rest wait
    /// to be fed (the prompt's remainder during prefill, the last sampled token after).
    tokens: Vec<u32>,
    cached: usize,
    generated: usize,
    sampler: Sampler,
    last_token_at: Option<Instant>,
    /// Draft tokens fed after the last sampled one in this step, to be verified.
    draft: Vec<u32>,
    /// How much to draft: [`DraftPace`].
    pace: DraftPace,
    /// The request's output constraint, if any.
    constraint: Option<Constraint>,
}

/// A sequence's draft length, adapted to how its drafts fare: it doubles (up to
/// `--draft-max`) while whole drafts are accepted, drops to one past the accepted part
/// of a draft that was cut, and after a draft of which nothing was accepted the sequence
/// pauses drafting for 1, 2, 4 … 32 steps. A draft that is never accepted then costs
/// one verification row every so many steps, and a copying sequence drafts long.
#[derive(Clone, Copy, Debug)]
pub struct DraftPace {
    /// Tokens to ask for at most.
    pub len: usize,
    /// Steps to skip drafting.
    pub pause: u32,
    /// The next pause after a wholly rejected draft.
    pub backoff: u32,
}

impl DraftPace {
    pub fn new(draft_max: usize) -> Self {
        DraftPace { len: draft_max, pause: 0, backoff: 1 }
    }

    /// Whether to draft this step (counting a paused step).
    pub fn wants(&mut self) -> bool {
        if self.pause > 0 {
            self.pause -= 1;
            return false;
        }
        true
    }

    /// After a draft of `drafted` tokens of which the first `accepted` were taken.
    pub fn update(&mut self, drafted: usize, accepted: usize, draft_max: usize) {
        if accepted == drafted {
            self.len = (self.len.max(drafted) * 2).min(draft_max);
            self.backoff = 1;
        } else if accepted > 0 {
            self.len = (accepted + 1).min(draft_max);
            self.backoff = 1;
        } else {
            self.len = 1;
            self.pause = self.backoff;
            self.backoff = (self.backoff * 2).min(32);
        }
    }
}

/// A session's cache between its requests.
struct Pinned<C> {
    session: u64,
    /// The id of the session's last request (a drafter keeps its state under it).
    request: u64,
    /// The tokens whose keys and values it holds.
    tokens: Vec<u32>,
    cache: C,
    capacity: usize,
    blocks: usize,
}

/// The loop's state: waiting requests, running sequences, the block pool, and scratch
/// reused by every step (a warm decode step does not allocate).
pub struct Scheduler<'m, B: Backend> {
    backend: &'m B,
    model: &'m dyn CausalLm<B>,
    config: SchedulerConfig,
    end_of_generation: Vec<u32>,
    waiting: VecDeque<Request>,
    running: Vec<Seq<B::KvCache>>,
    prefix: PrefixCache<B::KvCache>,
    pinned: Vec<Pinned<B::KvCache>>,
    /// Blocks held by running sequences and pinned sessions.
    used_blocks: usize,
    metrics: Arc<Metrics>,
    logits: HostMatrix,
    device_ids: Vec<u32>,
    feed: Vec<usize>,
    tokens: Vec<u32>,
    seqs: Vec<SeqSlice>,
    members: Vec<usize>,
    wanted: Vec<usize>,
    first: Vec<usize>,
    finished: Vec<(usize, Option<Finish>)>,
    /// The allocation of the per-step list of cache references, kept between steps.
    cache_refs: Vec<Option<&'static ()>>,
    /// Speculative decoding: what drafts, and the draft lengths (most, least).
    drafter: Option<(Box<dyn Drafter<B> + 'm>, usize, usize)>,
    /// Draft only while at most this many sequences run.
    draft_batch_max: usize,
    drafts: Vec<Vec<u32>>,
    /// The ids of the running sequences, for [`Drafter::keep_only`].
    running_ids: Vec<u64>,
    /// The mask of each member's first pick this step, for constrained sequences
    /// (computed while the forward runs).
    masks: Vec<Option<Result<Mask, GrammarError>>>,
}

impl<'m, B: Backend> Scheduler<'m, B> {
    pub fn new(
        backend: &'m B,
        model: &'m dyn CausalLm<B>,
        config: SchedulerConfig,
        end_of_generation: Vec<u32>,
        metrics: Arc<Metrics>,
    ) -> Self {
        metrics.kv_blocks_total.store(config.total_blocks() as u64, Ordering::Relaxed);
        let parallel = config.parallel.max(1);
        Scheduler {
            backend,
            model,
            config,
            end_of_generation,
            waiting: VecDeque::new(),
            running: Vec::with_capacity(parallel),
            prefix: PrefixCache::new(),
            pinned: Vec::new(),
            used_blocks: 0,
            metrics,
            logits: HostMatrix::zeros(0, 0),
            device_ids: Vec::with_capacity(parallel),
            feed: Vec::with_capacity(parallel),
            tokens: Vec::new(),
            seqs: Vec::with_capacity(parallel),
            members: Vec::with_capacity(parallel),
            wanted: Vec::new(),
            first: Vec::with_capacity(parallel),
            finished: Vec::with_capacity(parallel),
            cache_refs: Vec::with_capacity(parallel),
            drafter: None,
            draft_batch_max: usize::MAX,
            drafts: Vec::new(),
            running_ids: Vec::new(),
            masks: Vec::new(),
        }
    }

    /// Decode speculatively: each step, `drafter` proposes up to `draft_max` tokens for
    /// every decoding sequence (drafts shorter than `draft_min` are dropped) and the step
    /// verifies them (see [`super::speculate`]). The output stays that of plain decoding
    /// only when the backend's kernels are batch-invariant.
    pub fn with_drafter(mut self, drafter: Box<dyn Drafter<B> + 'm>, draft_max: usize, draft_min: usize) -> Self {
        self.drafter = Some((drafter, draft_max, draft_min));
        self
    }

    /// Draft only while at most `n` sequences run (vLLM's `disable_by_batch_size`): a
    /// larger batch keeps the hardware busy without drafts, and their rows cost more
    /// than they save.
    pub fn draft_while_at_most(mut self, n: usize) -> Self {
        self.draft_batch_max = n;
        self
    }

    /// The counters this scheduler updates.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    pub fn config(&self) -> &SchedulerConfig {
        &self.config
    }

    /// Whether anything is waiting or running.
    pub fn busy(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    /// Queue a request; it is admitted at a later step.
    pub fn add(&mut self, request: Request) {
        self.waiting.push_back(request);
        self.publish();
    }

    /// Drop a request (a client gone, a stop string found): its blocks are freed and it
    /// gets no more events. Whether it was here.
    pub fn abort(&mut self, id: u64) -> bool {
        if let Some(i) = self.waiting.iter().position(|r| r.id == id) {
            self.waiting.remove(i);
            return true;
        }
        let Some(i) = self.running.iter().position(|s| s.request.id == id) else { return false };
        let seq = self.running.remove(i);
        if seq.request.session.is_some() {
            // Between steps its cache holds exactly its cached positions: a session keeps
            // them for its next request.
            self.retire(seq);
        } else {
            self.used_blocks -= seq.blocks; // dropped, not cached (a stop string, a hang-up)
        }
        self.publish();
        true
    }

    /// Forget a session's pinned cache (`/clear` in a chat).
    pub fn release_session(&mut self, session: u64) {
        if let Some(i) = self.pinned.iter().position(|p| p.session == session) {
            self.used_blocks -= self.pinned.swap_remove(i).blocks;
        }
    }

    /// Fail every request (waiting or running) with `why`.
    pub fn shutdown(&mut self, why: &str, out: &mut Vec<(u64, Event)>) {
        for r in self.waiting.drain(..) {
            out.push((r.id, Event::Failed(why.to_owned())));
        }
        for seq in self.running.drain(..) {
            self.used_blocks -= seq.blocks;
            out.push((seq.request.id, Event::Failed(why.to_owned())));
        }
        self.publish();
    }

    /// One step: admit what fits, run one forward over every running sequence, pick
    /// their tokens, retire finished sequences; what happened is appended to `out`.
    pub fn step(&mut self, out: &mut Vec<(u64, Event)>) {
        self.step_once(out);
        // A drafter drops what it keeps for sequences that have ended (a draft model's
        // caches), also in steps that did not draft; a session's pinned sequence has not
        // ended (its next turn goes on from its draft cache too).
        if let Some((drafter, ..)) = self.drafter.as_mut() {
            self.running_ids.clear();
            self.running_ids.extend(self.running.iter().map(|s| s.request.id));
            self.running_ids.extend(self.pinned.iter().map(|p| p.request));
            drafter.keep_only(&self.running_ids);
        }
    }

    fn step_once(&mut self, out: &mut Vec<(u64, Event)>) {
        self.admit(out);
        if self.running.is_empty() {
            self.publish();
            return;
        }
        self.draft();
        self.plan();
        while self.grow(out) {
            self.plan(); // without the sequences that could not grow
        }
        if self.members.is_empty() {
            self.publish();
            return;
        }
        self.metrics.steps.fetch_add(1, Ordering::Relaxed);
        self.metrics.batch_sequences_max.fetch_max(self.members.len() as u64, Ordering::Relaxed);
        let on_device = match self.run() {
            Ok(r) => r,
            Err(e) => {
                // The caches of this batch may hold part of the step: fail its sequences.
                tracing::error!("forward failed: {e}");
                for k in (0..self.members.len()).rev() {
                    let seq = self.running.remove(self.members[k]);
                    self.used_blocks -= seq.blocks;
                    out.push((seq.request.id, Event::Failed(format!("the forward pass failed: {e}"))));
                }
                self.publish();
                return;
            }
        };
        self.update(on_device, out);
        self.publish();
    }

    /// Plan: decode rows first (every sequence with one token to feed), then prompt
    /// chunks in admission order under the remaining budget; fills the batch scratch.
    fn plan(&mut self) {
        let mut budget = self.config.batch_tokens.max(self.running.len());
        self.feed.clear();
        self.feed.resize(self.running.len(), 0);
        for (f, s) in self.feed.iter_mut().zip(&self.running) {
            if s.tokens.len() - s.cached == 1 {
                *f = 1;
                budget -= 1;
            }
        }
        // Then drafts to verify, before new prompts; while prompts wait for their
        // chunks, drafts leave them what they need up to half of what is left, so that
        // speculation never holds a prompt's prefill back for long.
        let waiting: usize = self.running.iter().map(|s| s.tokens.len() - s.cached).filter(|&p| p > 1).sum();
        let mut draft_budget = budget - waiting.min(budget.div_ceil(2));
        budget -= draft_budget;
        let least = self.drafter.as_ref().map_or(1, |d| d.2.max(1));
        for (f, s) in self.feed.iter_mut().zip(&mut self.running) {
            s.draft.truncate(draft_budget);
            if s.draft.len() < least {
                s.draft.clear(); // cut below --draft-min: not verified
            }
            *f += s.draft.len();
            draft_budget -= s.draft.len();
        }
        budget += draft_budget;
        for (f, s) in self.feed.iter_mut().zip(&self.running) {
            let pending = s.tokens.len() - s.cached;
            if pending > 1 && budget > 0 {
                *f = pending.min(budget);
                budget -= *f;
            }
        }
        self.tokens.clear();
        self.seqs.clear();
        self.members.clear();
        for (i, (&f, s)) in self.feed.iter().zip(&self.running).enumerate() {
            if f == 0 {
                continue;
            }
            let start = self.tokens.len();
            self.tokens.extend_from_slice(&s.tokens[s.cached..s.cached + f - s.draft.len()]);
            self.tokens.extend_from_slice(&s.draft);
            self.seqs.push(SeqSlice { rows: start..self.tokens.len(), start_pos: s.cached });
            self.members.push(i);
        }
    }

    /// Ask the drafter (if any) for the tokens that may follow every decoding sequence
    /// that has at least two tokens left to generate: at most `draft_max`, and one fewer
    /// than it has left, so that its verified rows stay inside what it reserved.
    fn draft(&mut self) {
        let Some((drafter, draft_max, draft_min)) = self.drafter.as_mut() else { return };
        if self.running.len() > self.draft_batch_max {
            return;
        }
        // One entry per running sequence, in order: drafts[i] is running[i]'s.
        let mut asked = Vec::with_capacity(self.running.len());
        for s in self.running.iter_mut() {
            let left = s.request.max_tokens.saturating_sub(s.generated);
            // Every running sequence is listed (a drafter keeps its state for those
            // asked for nothing this step); only the eligible ones are asked for tokens.
            let eligible = s.tokens.len() - s.cached == 1
                && !Self::scoring(s)
                && left >= 2
                && s.pace.wants()
                && s.request.pick_hook.is_none();
            let s = &*s;
            // A sliding-window ring can give back only so many rejected rows.
            let most = (*draft_max).min(s.cache.rings().max_rewind());
            let max = if eligible { s.pace.len.max(*draft_min).min(most).min(left - 1) } else { 0 };
            let reserved = positions_for(s.request.prompt.len(), s.request.max_tokens);
            asked.push(DraftSeq { id: s.request.id, tokens: &s.tokens, max, reserved });
        }
        self.drafts.resize_with(asked.len(), Vec::new);
        self.drafts.iter_mut().for_each(Vec::clear);
        if asked.is_empty() {
            return;
        }
        let backend = self.backend;
        if let Err(e) = drafter.propose(backend, &asked, &mut self.drafts[..asked.len()]) {
            tracing::warn!("drafting failed, this step decodes without drafts: {e}");
            return;
        }
        let least = (*draft_min).max(1);
        drop(asked);
        let vocab = self.model.info().vocab_size;
        for (d, s) in self.drafts.iter_mut().zip(self.running.iter_mut()) {
            // A draft model's vocabulary may be larger (padding): its ids past the
            // model's are never fed.
            if let Some(outside) = d.iter().position(|&t| t as usize >= vocab) {
                d.truncate(outside);
            }
            if let Some(c) = s.constraint.as_mut() {
                d.truncate(c.accepts(d)); // a draft the output may not take is not verified
            }
            if d.len() >= least {
                d.truncate(s.request.max_tokens.saturating_sub(s.generated + 1));
                std::mem::swap(&mut s.draft, d);
            }
        }
    }

    /// Whether `s` is scoring its prompt in this step (it needs every row's logits).
    fn scoring(s: &Seq<B::KvCache>) -> bool {
        s.request.prompt_logprobs.is_some() && s.cached < s.request.prompt.len()
    }

    /// Run: the forward over the planned rows, then the ids on the device or the logits
    /// on the host. Returns whether the ids came from the device; `first[k]` is member
    /// k's first logits row.
    fn run(&mut self) -> BackendResult<bool> {
        // A prompt being scored needs the logits of every row it feeds, every other
        // sequence those of its last row: `first[k]` is sequence k's first logits row
        // (per-row results do not depend on which rows are kept).
        // A sequence verifying a draft needs the logits of its rows from the last sampled
        // token on.
        let any_scored = self.members.iter().any(|&i| Self::scoring(&self.running[i]));
        let any_drafts = self.members.iter().any(|&i| !self.running[i].draft.is_empty());
        self.wanted.clear();
        self.first.clear();
        for (k, &i) in self.members.iter().enumerate() {
            self.first.push(self.wanted.len());
            let s = &self.running[i];
            let rows = self.seqs[k].rows.clone();
            if !(any_scored || any_drafts) {
                self.wanted.push(0); // only counted: row k is sequence k's last
            } else if Self::scoring(s) {
                self.wanted.extend(rows);
            } else {
                self.wanted.extend(rows.end - 1 - s.draft.len()..rows.end);
            }
        }
        let rows = if any_scored || any_drafts { LogitRows::Rows(&self.wanted) } else { LogitRows::LastOfEachSeq };
        // The ids alone suffice when every sequence takes the argmax of raw logits.
        let argmax_only = !any_scored
            && self.members.iter().all(|&i| {
                let (r, c) = (&self.running[i].request, &self.running[i].constraint);
                r.logprobs.is_none() && r.sampling.is_argmax() && c.is_none() && r.pick_hook.is_none()
            });
        // The list of cache references reuses one allocation across steps.
        let mut caches: Vec<&mut B::KvCache> = std::mem::take(&mut self.cache_refs)
            .into_iter()
            .map(|_| -> &mut B::KvCache { unreachable!("empty") })
            .collect();
        // Constrained sequences that pick a token this step: their masks are computed
        // on another thread while the forward runs.
        let mut constrained: Vec<(usize, &mut Constraint)> = Vec::new();
        for (s, &f) in self.running.iter_mut().zip(&self.feed).filter(|(_, f)| **f > 0) {
            let k = caches.len();
            let picks = s.cached + f - s.draft.len() == s.tokens.len() && s.request.max_tokens > 0;
            let Seq { cache, constraint, .. } = s;
            caches.push(cache);
            if let Some(c) = constraint.as_mut().filter(|_| picks) {
                constrained.push((k, c));
            }
        }
        let batch = Batch { tokens: &self.tokens, seqs: &self.seqs };
        let (model, backend) = (self.model, self.backend);
        let masks = &mut self.masks;
        masks.clear();
        masks.resize_with(caches.len(), || None);
        let result = if constrained.is_empty() {
            model.forward(backend, &batch, &mut caches, rows)
        } else {
            rayon::in_place_scope(|scope| {
                scope.spawn(|_| {
                    for (k, c) in constrained {
                        masks[k] = Some(c.mask());
                    }
                });
                model.forward(backend, &batch, &mut caches, rows)
            })
        };
        caches.clear();
        self.cache_refs = caches.into_iter().map(|_| -> Option<&'static ()> { unreachable!("empty") }).collect();
        let out = result?;
        if argmax_only && self.backend.argmax_rows(&out, &mut self.device_ids)? {
            return Ok(true);
        }
        self.backend.to_host(&out, &mut self.logits)?;
        Ok(false)
    }

    /// Update: score prompt rows, pick each sequence's token, report, retire.
    fn update(&mut self, on_device: bool, out: &mut Vec<(u64, Event)>) {
        let now = Instant::now();
        self.finished.clear();
        for k in 0..self.members.len() {
            let i = self.members[k];
            let fed = self.feed[i];
            let seq = &mut self.running[i];
            let id = seq.request.id;
            // The logits row of this sequence's last fed token (of the last sampled one
            // when it verifies a draft: the draft's rows follow).
            let row = self.first[k] + if Self::scoring(seq) { fed - 1 } else { 0 };
            if let Some(n) = seq.request.prompt_logprobs
                && seq.cached < seq.request.prompt.len()
            {
                // Its j-th row holds position cached + j: it scores the token after it
                // (the last prompt row chooses the first new token instead). Rows in
                // parallel: each is a log-softmax over the vocabulary.
                use rayon::prelude::*;
                let (prompt, logits, row0) = (&seq.request.prompt, &self.logits, self.first[k]);
                let rows = fed.min(prompt.len() - 1 - seq.cached);
                let results: Vec<Result<TokenLogprobs, (usize, usize, f32)>> = (0..rows)
                    .into_par_iter()
                    .map(|j| {
                        let row = logits.row(row0 + j);
                        let next = seq.cached + j + 1;
                        if let Some(t) = row.iter().position(|v| !v.is_finite()) {
                            return Err((next - 1, t, row[t]));
                        }
                        Ok(token_logprobs(row, prompt[next], n))
                    })
                    .collect();
                let broken = results.iter().find_map(|r| r.as_ref().err().copied());
                let scored: Vec<TokenLogprobs> = results.into_iter().filter_map(Result::ok).collect();
                if let Some((pos, t, v)) = broken {
                    let e = format!(
                        "the model produced non-finite logits (token id {t}: {v}) at prompt position {pos}; \
                         the weights or the computation are broken (try --backend reference to compare)"
                    );
                    out.push((id, Event::Failed(e)));
                    self.finished.push((i, None));
                    continue;
                }
                if !scored.is_empty() {
                    out.push((id, Event::PromptLogprobs(scored)));
                }
            }
            let drafted = seq.draft.len();
            seq.cached += fed - drafted;
            if seq.cached < seq.tokens.len() {
                continue; // a prompt chunk: more of the prompt to come
            }
            if seq.request.max_tokens == 0 {
                self.finished.push((i, Some(Finish::Length))); // the prompt is scored: done
                continue;
            }
            // Row j picks the token after the last sampled one and j drafts; it is used
            // only while every draft before it was the token picked there.
            let mut accepted = 0;
            for j in 0..=drafted {
                if j > 0 {
                    seq.cached += 1; // draft j - 1, now the last token, is in the cache
                }
                let (step, position) = (seq.generated, seq.cached - 1);
                let picked = if on_device {
                    match self.device_ids[row + j] {
                        NON_FINITE_ROW => Err(non_finite_message(step, position, None)),
                        id => Ok((id, None)),
                    }
                } else {
                    let logits = self.logits.row(row + j);
                    // One branch-free pass (it vectorizes); the position only when it fails.
                    let finite = logits.iter().fold(true, |f, v| f & v.is_finite());
                    match (!finite).then(|| logits.iter().position(|v| !v.is_finite())).flatten() {
                        Some(t) => Err(non_finite_message(step, position, Some((t, logits[t])))),
                        None => {
                            let cols = self.logits.cols;
                            let logits = &mut self.logits.data[(row + j) * cols..(row + j + 1) * cols];
                            // A constrained pick: the tokens the output may not take are −∞.
                            let allowed = match seq.constraint.as_mut() {
                                None => Ok(()),
                                Some(c) => {
                                    let mask = if j == 0 { self.masks[k].take() } else { None };
                                    mask.unwrap_or_else(|| c.mask()).and_then(|m| {
                                        if c.apply(&m, logits) { Ok(()) } else { Err(GrammarError::NothingAllowed) }
                                    })
                                }
                            };
                            allowed.map_err(|e| e.to_string()).map(|()| {
                                let mut id = seq.sampler.sample(logits);
                                if let Some(hook) = &seq.request.pick_hook {
                                    id = (hook.0)(logits, id);
                                    debug_assert!((id as usize) < logits.len(), "a pick hook's token {id}");
                                }
                                (id, seq.request.logprobs.map(|n| token_logprobs(logits, id, n)))
                            })
                        }
                    }
                };
                let (token, logprobs) = match picked {
                    Ok(p) => p,
                    Err(e) => {
                        out.push((id, Event::Failed(e)));
                        self.finished.push((i, None));
                        break;
                    }
                };
                seq.sampler.accept_generated(token);
                seq.generated += 1;
                self.metrics.generation_tokens.fetch_add(1, Ordering::Relaxed);
                match seq.last_token_at {
                    None => self.metrics.ttft.observe(now.duration_since(seq.request.arrived).as_secs_f64()),
                    Some(t) => self.metrics.itl.observe(now.duration_since(t).as_secs_f64()),
                }
                seq.last_token_at = Some(now);
                // A constrained output ends where its constraint allows an end of
                // generation and the model picks one, `ignore_eos` or not.
                let ends = !seq.request.ignore_eos || seq.constraint.is_some();
                if self.end_of_generation.contains(&token) && ends {
                    out.push((id, Event::EndToken { id: token, logprobs }));
                    self.finished.push((i, Some(Finish::Eos)));
                    break;
                }
                if let Some(Err(e)) = seq.constraint.as_mut().map(|c| c.accept(token)) {
                    out.push((id, Event::Failed(e.to_string())));
                    self.finished.push((i, None));
                    break;
                }
                seq.tokens.push(token);
                out.push((id, Event::Token { id: token, logprobs }));
                if seq.generated >= seq.request.max_tokens {
                    self.finished.push((i, Some(Finish::Length)));
                    break;
                }
                if seq.constraint.as_ref().is_some_and(Constraint::is_complete) {
                    self.finished.push((i, Some(Finish::Eos))); // nothing may follow
                    break;
                }
                if j == drafted || seq.draft[j] != token {
                    break;
                }
                accepted += 1;
            }
            if drafted > 0 {
                let draft_max = self.drafter.as_ref().map_or(1, |d| d.1);
                seq.pace.update(drafted, accepted as usize, draft_max);
                self.metrics.spec_drafts.fetch_add(1, Ordering::Relaxed);
                self.metrics.spec_draft_tokens.fetch_add(drafted as u64, Ordering::Relaxed);
                self.metrics.spec_accepted_tokens.fetch_add(accepted, Ordering::Relaxed);
                seq.draft.clear();
            }
        }
        self.finished.sort_unstable_by_key(|&(i, _)| std::cmp::Reverse(i));
        for f in 0..self.finished.len() {
            let (i, reason) = self.finished[f];
            let seq = self.running.remove(i);
            match reason {
                Some(reason) => {
                    out.push((seq.request.id, Event::Finished { reason, generated: seq.generated }));
                    self.retire(seq);
                }
                None => self.used_blocks -= seq.blocks, // failed: the cache is not trusted
            }
        }
    }

    /// A finished sequence's blocks go back to the pool, into the prefix cache with the
    /// tokens its cache holds, or stay pinned to its session.
    fn retire(&mut self, seq: Seq<B::KvCache>) {
        let mut tokens = seq.tokens;
        tokens.truncate(seq.cached);
        if let Some(session) = seq.request.session {
            // It holds the blocks of its cache until the session's next request (pinned
            // caches are not evicted: sessions are for a client that runs one, as chat).
            let blocks = blocks_for(seq.capacity);
            self.used_blocks = self.used_blocks - seq.blocks + blocks;
            let (cache, capacity, request) = (seq.cache, seq.capacity, seq.request.id);
            self.pinned.push(Pinned { session, request, tokens, cache, capacity, blocks });
            return;
        }
        self.used_blocks -= seq.blocks;
        if !self.config.prefix_cache || seq.cached < BLOCK_TOKENS {
            return;
        }
        let hashes = block_hashes(&tokens);
        // An entry already holding these blocks (refreshed, then) makes this cache
        // redundant, unless a ring of its own went on past the positions this one holds.
        let rings = seq.cache.rings().clone();
        if self.prefix.covers(&hashes, |c| c.rings().reaches_back_as_far(&rings)) {
            return;
        }
        // Keep only the blocks the cached tokens fill: a right-sized copy when the
        // sequence had reserved more (its max_tokens not all used).
        let fit = blocks_for(seq.cached);
        let mut kept = (seq.cache, blocks_for(seq.capacity).min(seq.blocks));
        if fit * BLOCK_TOKENS < seq.capacity
            && let Ok(mut small) = self.model.new_cache(self.backend, fit * BLOCK_TOKENS)
            && self.model.copy_cache_prefix(self.backend, &kept.0, &mut small, seq.cached).is_ok()
        {
            kept = (small, fit);
        }
        let (cache, blocks) = kept;
        self.prefix.insert(tokens, hashes, cache, blocks, |new, old| new.rings().reaches_back_as_far(old.rings()));
    }

    /// Admit waiting requests in arrival order while a slot and their blocks are free
    /// (evicting cached prefixes as needed); the first that does not fit waits, and so
    /// does everything behind it (no starvation of long prompts). A request reserves
    /// the blocks of its prompt plus `max_tokens`; its cache starts smaller when that is
    /// long ([`INITIAL_SLACK`]) and grows as it fills.
    fn admit(&mut self, out: &mut Vec<(u64, Event)>) {
        let total = self.config.total_blocks();
        let n_positions = self.model.info().context_length;
        while self.running.len() < self.config.parallel {
            let Some(req) = self.waiting.front() else { break };
            let positions = positions_for(req.prompt.len(), req.max_tokens);
            let need = blocks_for(positions);
            if need > total || positions > n_positions {
                let req = self.waiting.pop_front().expect("front exists");
                let e = format!(
                    "the request needs {positions} KV positions; the pool holds {} and the model's context {n_positions}",
                    total * BLOCK_TOKENS
                );
                out.push((req.id, Event::Failed(e)));
                continue;
            }
            let pinned = req.session.and_then(|s| self.pinned.iter().position(|p| p.session == s));
            let held = pinned.map_or(0, |p| self.pinned[p].blocks);
            while self.used_blocks - held + self.prefix.blocks() + need > total {
                if self.prefix.evict_one().is_none() {
                    break;
                }
            }
            if self.used_blocks - held + self.prefix.blocks() + need > total {
                break;
            }
            let mut req = self.waiting.pop_front().expect("front exists");
            let constraint = req.constraint.take();
            // Reuse cached positions, but always feed the prompt's last token (its
            // logits choose the first new one).
            let last = req.prompt.len() - 1;
            let mut cached = 0;
            let cache = match pinned.map(|p| self.pinned.swap_remove(p)) {
                Some(p) => {
                    // The session's own cache, in place: every position it shares.
                    self.used_blocks -= p.blocks;
                    cached = p.tokens.iter().zip(&req.prompt).take_while(|(a, b)| a == b).count().min(last);
                    if !p.cache.rings().continues_at(cached) {
                        // A sliding-window ring went on past the shared tokens: the
                        // window before them is gone, so the prompt is computed again.
                        cached = 0;
                    }
                    Ok((p.cache, p.capacity))
                }
                None => {
                    let capacity = positions.min(req.prompt.len().saturating_add(self.config.initial_slack));
                    self.model.new_cache(self.backend, capacity).map(|mut c| {
                        if self.config.prefix_cache && req.prompt_logprobs.is_none() {
                            let hashes = block_hashes(&req.prompt);
                            // A sliding-window ring holds the keys before `n` only when
                            // its sequence did not go far past `n`.
                            let usable = |c: &B::KvCache, n: usize| c.rings().continues_at(n.min(last));
                            if let Some((entry, n)) = self.prefix.lookup(&req.prompt, &hashes, usable) {
                                let n = n.min(last);
                                let src = &self.prefix.entries[entry].cache;
                                if n > 0 && self.model.copy_cache_prefix(self.backend, src, &mut c, n).is_ok() {
                                    cached = n;
                                    self.metrics.prefix_cache_hits.fetch_add(1, Ordering::Relaxed);
                                    self.metrics.prefix_cache_hit_tokens.fetch_add(n as u64, Ordering::Relaxed);
                                }
                            }
                        }
                        (c, capacity)
                    })
                }
            };
            let (cache, capacity) = match cache {
                Ok(c) => c,
                Err(e) => {
                    out.push((req.id, Event::Failed(format!("cannot allocate the KV cache: {e:#}"))));
                    continue;
                }
            };
            self.metrics.prompt_tokens.fetch_add(req.prompt.len() as u64, Ordering::Relaxed);
            let mut sampler = match Sampler::new(req.sampling.clone()) {
                Ok(s) => s,
                Err(e) => {
                    out.push((req.id, Event::Failed(e.to_string())));
                    continue;
                }
            };
            sampler.reserve_history(req.prompt.len() + req.max_tokens);
            sampler.accept(&req.prompt);
            out.push((req.id, Event::Started { cached }));
            self.used_blocks += need;
            let mut tokens = Vec::with_capacity(positions + 1);
            tokens.extend_from_slice(&req.prompt);
            self.running.push(Seq {
                request: req,
                cache,
                capacity,
                blocks: need,
                tokens,
                cached,
                generated: 0,
                sampler,
                last_token_at: None,
                draft: Vec::new(),
                pace: DraftPace::new(self.drafter.as_ref().map_or(1, |d| d.1)),
                constraint,
            });
        }
    }

    /// Grow the cache of every planned sequence whose rows do not fit it: doubled (at
    /// most to what its request reserved), its positions copied. A sequence whose cache
    /// cannot grow fails; returns whether one did (the step is then planned again).
    fn grow(&mut self, out: &mut Vec<(u64, Event)>) -> bool {
        let mut failed = false;
        let mut i = 0;
        while i < self.running.len() {
            let s = &mut self.running[i];
            let end = s.cached + self.feed[i];
            if end <= s.capacity {
                i += 1;
                continue;
            }
            let most = positions_for(s.request.prompt.len(), s.request.max_tokens);
            let capacity = end.max(s.capacity.saturating_mul(2)).min(most).max(end);
            let grown = self.model.new_cache(self.backend, capacity).and_then(|mut c| {
                self.model.copy_cache_prefix(self.backend, &s.cache, &mut c, s.cached)?;
                Ok(c)
            });
            match grown {
                Ok(c) => {
                    s.cache = c;
                    s.capacity = capacity;
                    i += 1;
                }
                Err(e) => {
                    let seq = self.running.remove(i);
                    self.feed.remove(i);
                    self.used_blocks -= seq.blocks;
                    out.push((seq.request.id, Event::Failed(format!("cannot grow the KV cache: {e:#}"))));
                    failed = true;
                }
            }
        }
        failed
    }

    fn publish(&self) {
        self.metrics.publish(Gauges {
            running: self.running.len() as u64,
            waiting: self.waiting.len() as u64,
            kv_blocks_used: (self.used_blocks + self.prefix.blocks()) as u64,
            kv_blocks_cached: self.prefix.blocks() as u64,
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn positions_leave_out_the_last_token() {
        assert_eq!(positions_for(5, 1), 5);
        assert_eq!(positions_for(5, 3), 7);
        assert_eq!(positions_for(5, 0), 5);
        assert_eq!(SchedulerConfig::single(17).ctx_size, 32);
    }
}

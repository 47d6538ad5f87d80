//! The request engine: one loop that owns the model and every sequence's KV cache and,
//! each step, runs a single forward over all active sequences (continuous batching).
//!
//! A step holds one decode row for every running sequence, then chunks of waiting
//! prompts up to a per-step token budget (chunked prefill), so a long prompt never
//! stalls the sequences already decoding. KV memory is counted in blocks of
//! [`BLOCK_TOKENS`] positions from one pool of `ctx_size` tokens: a request is admitted
//! (first come, first served) when the blocks for its prompt plus `max_tokens` are free,
//! and waits otherwise. Finished sequences leave their caches in a prefix cache keyed by
//! the hash chain of their full blocks; a new prompt that starts with cached blocks
//! copies those positions instead of computing them again. Cached entries hold pool
//! blocks too and are evicted least-recently-used when a request needs room.
//!
//! The loop knows nothing of the model's architecture ([`CausalLm`]) or of HTTP: jobs
//! arrive on a channel with a sender for their [`Event`]s, and a job whose receiver is
//! gone (a client that disconnected, a stop string found) is dropped with its blocks at
//! the next step.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

use tokio::sync::mpsc::UnboundedSender;

use crate::backend::{Backend, HostMatrix, SeqSlice};
use crate::engine::logprobs::token_logprobs;
use crate::engine::{Sampler, SamplingParams, TokenLogprobs};
use crate::model::{Batch, CausalLm, LogitRows};

use super::metrics::{Gauges, Metrics};

/// Positions per KV block: the unit of the pool and of prefix-cache matching.
pub const BLOCK_TOKENS: usize = 16;

/// What the scheduler needs to know about one request.
pub struct Job {
    pub id: u64,
    /// Prompt token ids (at least one, each inside the vocabulary; checked by the caller).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (prompt + max_tokens ≤ the context). 0 only with
    /// `prompt_logprobs`: the prompt is scored, nothing is generated.
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// OpenAI's penalties over the tokens generated so far: `logit -= presence` for a
    /// token that appeared, `logit -= frequency × count`.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Report each token's log-probability and this many alternatives.
    pub logprobs: Option<usize>,
    /// Also score the prompt (OpenAI's `echo` with `logprobs`): the log-probability of
    /// every prompt token after the first, given the ones before it, with this many
    /// alternatives. Such a prompt is computed in full (no prefix-cache reuse), and the
    /// steps that prefill it compute logits for every row.
    pub prompt_logprobs: Option<usize>,
    /// Keep going after an end-of-generation token.
    pub ignore_eos: bool,
    pub events: UnboundedSender<Event>,
    pub arrived: Instant,
}

/// Why a sequence ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The model produced an end-of-generation token (not sent as a token).
    Eos,
    /// `max_tokens` reached.
    Length,
}

/// What a job's receiver gets, in order: tokens, then one `Finished` or `Failed`.
#[derive(Debug)]
pub enum Event {
    /// The prompt is admitted; `cached` of its tokens came from the prefix cache.
    Started {
        cached: usize,
    },
    /// Log-probabilities of prompt tokens, in order (a chunk's worth at a time; only
    /// for [`Job::prompt_logprobs`], all of them before the first `Token`).
    PromptLogprobs(Vec<TokenLogprobs>),
    Token {
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
    /// A pause after every step: a test hook (`BATCH_FORGE_STEP_DELAY_MS`) that makes a
    /// tiny model's generation last long enough to hang up on or queue behind.
    pub step_delay: Duration,
}

impl SchedulerConfig {
    pub fn total_blocks(&self) -> usize {
        self.ctx_size / BLOCK_TOKENS
    }
}

/// Blocks for a sequence that caches `positions` positions.
pub fn blocks_for(positions: usize) -> usize {
    positions.div_ceil(BLOCK_TOKENS).max(1)
}

/// Positions a job's cache needs: its prompt and every generated token but the last
/// (never fed back); the prompt alone when nothing is generated (a scored prompt).
pub fn positions_for(prompt_len: usize, max_tokens: usize) -> usize {
    if max_tokens == 0 { prompt_len.max(1) } else { (prompt_len + max_tokens).saturating_sub(1).max(1) }
}

/// The hash chain of the full blocks of `tokens`: entry `i` identifies blocks `0..=i`
/// (FNV-1a over the previous link and the block's ids).
pub fn block_hashes(tokens: &[u32]) -> Vec<u64> {
    let mut out = Vec::with_capacity(tokens.len() / BLOCK_TOKENS);
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for block in tokens.chunks_exact(BLOCK_TOKENS) {
        for &t in block {
            for b in t.to_le_bytes() {
                h ^= u64::from(b);
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        out.push(h);
        // Mix in a separator so a chain is never a rehash of a longer block.
        h = h.rotate_left(17) ^ 0x9e37_79b9_7f4a_7c15;
    }
    out
}

/// A finished sequence's cache kept for reuse.
struct CacheEntry<C> {
    /// The tokens whose keys and values it holds.
    tokens: Vec<u32>,
    hashes: Vec<u64>,
    cache: C,
    blocks: usize,
    last_used: u64,
}

/// Finished sequences' caches, looked up by block hash chain, evicted LRU.
struct PrefixCache<C> {
    entries: Vec<CacheEntry<C>>,
    clock: u64,
}

impl<C> PrefixCache<C> {
    fn blocks(&self) -> usize {
        self.entries.iter().map(|e| e.blocks).sum()
    }

    /// The entry sharing the most full blocks with `tokens` (hashes checked, then the
    /// tokens themselves), and how many tokens that is.
    fn lookup(&mut self, tokens: &[u32], hashes: &[u64]) -> Option<(usize, usize)> {
        let mut best: Option<(usize, usize)> = None;
        for (i, e) in self.entries.iter().enumerate() {
            let blocks = e.hashes.iter().zip(hashes).take_while(|(a, b)| a == b).count();
            let n = blocks * BLOCK_TOKENS;
            if n > 0 && e.tokens[..n] == tokens[..n] && best.is_none_or(|(_, m)| n > m) {
                best = Some((i, n));
            }
        }
        if let Some((i, _)) = best {
            self.clock += 1;
            self.entries[i].last_used = self.clock;
        }
        best
    }

    /// Whether an entry holds all of `hashes`' blocks; it counts as used now if so.
    fn covers(&mut self, hashes: &[u64]) -> bool {
        let clock = self.clock + 1;
        match self.entries.iter_mut().find(|e| e.hashes.len() >= hashes.len() && e.hashes[..hashes.len()] == *hashes) {
            Some(e) => {
                self.clock = clock;
                e.last_used = clock;
                true
            }
            None => false,
        }
    }

    /// Keep `cache`, which holds `tokens` (whose full blocks hash to `hashes`); the
    /// caller has checked that no entry [`covers`](Self::covers) them already.
    fn insert(&mut self, tokens: Vec<u32>, hashes: Vec<u64>, cache: C, blocks: usize) {
        if hashes.is_empty() {
            return; // not one full block: nothing to reuse
        }
        // An entry whose full blocks the new one covers is redundant.
        self.entries.retain(|e| !(e.hashes.len() <= hashes.len() && e.hashes[..] == hashes[..e.hashes.len()]));
        self.clock += 1;
        self.entries.push(CacheEntry { tokens, hashes, cache, blocks, last_used: self.clock });
    }

    /// Drop the least recently used entry; its block count, or `None` when empty.
    fn evict_one(&mut self) -> Option<usize> {
        let i = self.entries.iter().enumerate().min_by_key(|(_, e)| e.last_used).map(|(i, _)| i)?;
        Some(self.entries.swap_remove(i).blocks)
    }
}

/// A running sequence.
struct Seq<C> {
    job: Job,
    cache: C,
    blocks: usize,
    /// Prompt and generated tokens; `tokens[..cached]` are in the cache, the rest wait
    /// to be fed (the prompt's remainder during prefill, the last sampled token after).
    tokens: Vec<u32>,
    cached: usize,
    generated: usize,
    sampler: Sampler,
    /// Occurrences of each generated token (for the OpenAI penalties).
    counts: std::collections::HashMap<u32, u32>,
    last_token_at: Option<Instant>,
}

/// The loop's state: waiting jobs, running sequences, the block pool.
pub struct Scheduler<'m, B: Backend> {
    backend: &'m B,
    model: &'m dyn CausalLm<B>,
    config: SchedulerConfig,
    end_of_generation: Vec<u32>,
    waiting: VecDeque<Job>,
    running: Vec<Seq<B::KvCache>>,
    prefix: PrefixCache<B::KvCache>,
    /// Blocks held by running sequences.
    used_blocks: usize,
    metrics: Arc<Metrics>,
    logits: HostMatrix,
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
        Scheduler {
            backend,
            model,
            config,
            end_of_generation,
            waiting: VecDeque::new(),
            running: Vec::new(),
            prefix: PrefixCache { entries: Vec::new(), clock: 0 },
            used_blocks: 0,
            metrics,
            logits: HostMatrix::zeros(0, 0),
        }
    }

    /// Whether anything is waiting or running.
    pub fn busy(&self) -> bool {
        !self.waiting.is_empty() || !self.running.is_empty()
    }

    pub fn submit(&mut self, job: Job) {
        self.waiting.push_back(job);
        self.publish();
    }

    /// Run until `jobs` closes or `stop` is set; then every job still here gets
    /// `Failed("server is shutting down")`.
    pub fn run(&mut self, jobs: Receiver<Job>, stop: &AtomicBool) {
        loop {
            if stop.load(Ordering::Relaxed) {
                break;
            }
            // Block for work only when idle; otherwise take what has arrived.
            if !self.busy() {
                match jobs.recv_timeout(Duration::from_millis(100)) {
                    Ok(job) => self.submit(job),
                    Err(RecvTimeoutError::Timeout) => continue,
                    Err(RecvTimeoutError::Disconnected) => break,
                }
            }
            while let Ok(job) = jobs.try_recv() {
                self.submit(job);
            }
            self.step();
            if !self.config.step_delay.is_zero() {
                std::thread::sleep(self.config.step_delay);
            }
        }
        // Jobs still in the channel get their answer too.
        while let Ok(job) = jobs.try_recv() {
            self.waiting.push_back(job);
        }
        self.shutdown("server is shutting down");
    }

    /// Fail every job (waiting or running) with `why`.
    pub fn shutdown(&mut self, why: &str) {
        for job in self.waiting.drain(..) {
            let _ = job.events.send(Event::Failed(why.to_owned()));
        }
        for seq in self.running.drain(..) {
            let _ = seq.job.events.send(Event::Failed(why.to_owned()));
        }
        self.used_blocks = 0;
        self.publish();
    }

    /// One scheduling step: drop cancelled jobs, admit what fits, run one forward over
    /// every running sequence, sample, and retire finished sequences.
    pub fn step(&mut self) {
        self.drop_cancelled();
        self.admit();
        if self.running.is_empty() {
            self.publish();
            return;
        }
        // Decode rows first (every sequence with one token to feed), then prompt chunks
        // in admission order under the remaining budget.
        let mut budget = self.config.batch_tokens.max(self.running.len());
        let mut feed = vec![0usize; self.running.len()];
        for (f, s) in feed.iter_mut().zip(&self.running) {
            if s.tokens.len() - s.cached == 1 {
                *f = 1;
                budget -= 1;
            }
        }
        for (f, s) in feed.iter_mut().zip(&self.running) {
            let pending = s.tokens.len() - s.cached;
            if pending > 1 && budget > 0 {
                *f = pending.min(budget);
                budget -= *f;
            }
        }
        let mut tokens = Vec::new();
        let mut seqs = Vec::new();
        let mut members = Vec::new(); // running index per batch sequence
        for (i, (&f, s)) in feed.iter().zip(&self.running).enumerate() {
            if f == 0 {
                continue;
            }
            let start = tokens.len();
            tokens.extend_from_slice(&s.tokens[s.cached..s.cached + f]);
            seqs.push(SeqSlice { rows: start..tokens.len(), start_pos: s.cached });
            members.push(i);
        }
        self.metrics.steps.fetch_add(1, Ordering::Relaxed);
        self.metrics.batch_sequences_max.fetch_max(members.len() as u64, Ordering::Relaxed);
        // A prompt being scored needs the logits of every row it feeds, every other
        // sequence those of its last row: `first[k]` is sequence k's first logits row
        // (per-row results do not depend on which rows are kept).
        let scoring = |s: &Seq<B::KvCache>| s.job.prompt_logprobs.is_some() && s.cached < s.job.prompt.len();
        let any_scored = members.iter().any(|&i| scoring(&self.running[i]));
        let (mut wanted, mut first) = (Vec::new(), Vec::new());
        if any_scored {
            for (k, &i) in members.iter().enumerate() {
                first.push(wanted.len());
                if scoring(&self.running[i]) {
                    wanted.extend(seqs[k].rows.clone());
                } else {
                    wanted.push(seqs[k].rows.end - 1);
                }
            }
        }
        let rows = if any_scored { LogitRows::Rows(&wanted) } else { LogitRows::LastOfEachSeq };
        let result = {
            let mut caches: Vec<&mut B::KvCache> =
                self.running.iter_mut().zip(&feed).filter(|(_, f)| **f > 0).map(|(s, _)| &mut s.cache).collect();
            let batch = Batch { tokens: &tokens, seqs: &seqs };
            self.model
                .forward(self.backend, &batch, &mut caches, rows)
                .and_then(|out| self.backend.to_host(&out, &mut self.logits))
        };
        if let Err(e) = result {
            // The caches of this batch may hold part of the step: fail its sequences.
            tracing::error!("forward failed: {e:#}");
            for &i in members.iter().rev() {
                let seq = self.running.remove(i);
                self.used_blocks -= seq.blocks;
                let _ = seq.job.events.send(Event::Failed(format!("the forward pass failed: {e:#}")));
            }
            self.publish();
            return;
        }
        let now = Instant::now();
        let mut finished = Vec::new();
        for (k, &i) in members.iter().enumerate() {
            let seq = &mut self.running[i];
            // The logits row of this sequence's last fed token.
            let row = if any_scored { first[k] + if scoring(seq) { feed[i] - 1 } else { 0 } } else { k };
            if let Some(n) = seq.job.prompt_logprobs
                && seq.cached < seq.job.prompt.len()
            {
                // Its j-th row holds position cached + j: it scores the token after it
                // (the last prompt row chooses the first new token instead). Rows in
                // parallel: each is a log-softmax over the vocabulary.
                use rayon::prelude::*;
                let (prompt, logits, row0) = (&seq.job.prompt, &self.logits, first[k]);
                let rows = feed[i].min(prompt.len() - 1 - seq.cached);
                let results: Vec<Result<TokenLogprobs, usize>> = (0..rows)
                    .into_par_iter()
                    .map(|j| {
                        let row = logits.row(row0 + j);
                        let next = seq.cached + j + 1;
                        if row.iter().any(|v| !v.is_finite()) {
                            return Err(next - 1);
                        }
                        Ok(token_logprobs(row, prompt[next], n))
                    })
                    .collect();
                let broken = results.iter().find_map(|r| r.as_ref().err().copied());
                let scored: Vec<TokenLogprobs> = results.into_iter().filter_map(Result::ok).collect();
                if let Some(pos) = broken {
                    let _ = seq
                        .job
                        .events
                        .send(Event::Failed(format!("the model produced non-finite logits at prompt position {pos}")));
                    finished.push((i, None));
                    continue;
                }
                if !scored.is_empty() {
                    let _ = seq.job.events.send(Event::PromptLogprobs(scored));
                }
            }
            seq.cached += feed[i];
            if seq.cached < seq.tokens.len() {
                continue; // a prompt chunk: more of the prompt to come
            }
            if seq.job.max_tokens == 0 {
                finished.push((i, Some(Finish::Length))); // the prompt is scored: done
                continue;
            }
            let logits = self.logits.row(row);
            match pick(seq, logits) {
                Ok((id, lp)) => {
                    seq.generated += 1;
                    self.metrics.generation_tokens.fetch_add(1, Ordering::Relaxed);
                    match seq.last_token_at {
                        None => self.metrics.ttft.observe(now.duration_since(seq.job.arrived).as_secs_f64()),
                        Some(t) => self.metrics.itl.observe(now.duration_since(t).as_secs_f64()),
                    }
                    seq.last_token_at = Some(now);
                    let eos = self.end_of_generation.contains(&id) && !seq.job.ignore_eos;
                    if eos {
                        finished.push((i, Some(Finish::Eos)));
                        continue;
                    }
                    seq.tokens.push(id);
                    *seq.counts.entry(id).or_default() += 1;
                    if seq.job.events.send(Event::Token { id, logprobs: lp }).is_err() {
                        continue; // cancelled: dropped at the next step
                    }
                    if seq.generated >= seq.job.max_tokens {
                        finished.push((i, Some(Finish::Length)));
                    }
                }
                Err(e) => {
                    let _ = seq.job.events.send(Event::Failed(e));
                    finished.push((i, None));
                }
            }
        }
        finished.sort_by_key(|&(i, _)| std::cmp::Reverse(i));
        for (i, reason) in finished {
            let seq = self.running.remove(i);
            match reason {
                Some(reason) => {
                    let _ = seq.job.events.send(Event::Finished { reason, generated: seq.generated });
                    self.retire(seq);
                }
                None => self.used_blocks -= seq.blocks, // failed: the cache is not trusted
            }
        }
        self.publish();
    }

    /// A finished sequence's blocks go back to the pool, or into the prefix cache with
    /// the tokens its cache holds.
    fn retire(&mut self, seq: Seq<B::KvCache>) {
        self.used_blocks -= seq.blocks;
        if !self.config.prefix_cache || seq.cached < BLOCK_TOKENS {
            return;
        }
        let mut tokens = seq.tokens;
        tokens.truncate(seq.cached);
        let hashes = block_hashes(&tokens);
        if self.prefix.covers(&hashes) {
            return; // an entry already holds these blocks (and was just refreshed)
        }
        // Keep only the blocks the cached tokens fill: a right-sized copy when the
        // sequence had reserved more (its max_tokens not all used).
        let fit = blocks_for(seq.cached);
        let mut kept = (seq.cache, seq.blocks);
        if fit < kept.1
            && let Ok(mut small) = self.model.new_cache(self.backend, fit * BLOCK_TOKENS)
            && self.model.copy_cache_prefix(self.backend, &kept.0, &mut small, seq.cached).is_ok()
        {
            kept = (small, fit);
        }
        let (cache, blocks) = kept;
        self.prefix.insert(tokens, hashes, cache, blocks);
    }

    fn drop_cancelled(&mut self) {
        self.waiting.retain(|j| !j.events.is_closed());
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].job.events.is_closed() {
                let seq = self.running.remove(i);
                tracing::info!(id = seq.job.id, "request cancelled; its sequence is freed");
                self.used_blocks -= seq.blocks;
            } else {
                i += 1;
            }
        }
    }

    /// Admit waiting jobs in arrival order while a slot and their blocks are free
    /// (evicting cached prefixes as needed); the first that does not fit waits, and
    /// so does everything behind it (no starvation of long prompts).
    fn admit(&mut self) {
        let total = self.config.total_blocks();
        while self.running.len() < self.config.parallel {
            let Some(job) = self.waiting.front() else { break };
            let positions = positions_for(job.prompt.len(), job.max_tokens);
            let need = blocks_for(positions);
            while self.used_blocks + self.prefix.blocks() + need > total {
                if self.prefix.evict_one().is_none() {
                    break;
                }
            }
            if self.used_blocks + self.prefix.blocks() + need > total {
                break;
            }
            let job = self.waiting.pop_front().expect("front exists");
            let capacity = (need * BLOCK_TOKENS).min(self.model.info().context_length).max(positions);
            let mut cache = match self.model.new_cache(self.backend, capacity) {
                Ok(c) => c,
                Err(e) => {
                    let _ = job.events.send(Event::Failed(format!("cannot allocate the KV cache: {e:#}")));
                    continue;
                }
            };
            // Reuse cached full blocks, but always feed the prompt's last token (its
            // logits choose the first new one).
            let mut cached = 0;
            if self.config.prefix_cache && job.prompt_logprobs.is_none() {
                let hashes = block_hashes(&job.prompt);
                if let Some((entry, n)) = self.prefix.lookup(&job.prompt, &hashes) {
                    let n = n.min(job.prompt.len() - 1);
                    let src = &self.prefix.entries[entry].cache;
                    if n > 0 && self.model.copy_cache_prefix(self.backend, src, &mut cache, n).is_ok() {
                        cached = n;
                        self.metrics.prefix_cache_hits.fetch_add(1, Ordering::Relaxed);
                        self.metrics.prefix_cache_hit_tokens.fetch_add(n as u64, Ordering::Relaxed);
                    }
                }
            }
            self.metrics.prompt_tokens.fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
            let mut sampler = match Sampler::new(job.sampling.clone()) {
                Ok(s) => s,
                Err(e) => {
                    let _ = job.events.send(Event::Failed(e));
                    continue;
                }
            };
            sampler.reserve_history(job.prompt.len() + job.max_tokens);
            sampler.accept(&job.prompt);
            let _ = job.events.send(Event::Started { cached });
            self.used_blocks += need;
            let tokens = job.prompt.clone();
            self.running.push(Seq {
                job,
                cache,
                blocks: need,
                tokens,
                cached,
                generated: 0,
                sampler,
                counts: Default::default(),
                last_token_at: None,
            });
        }
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

/// The next token of `seq` from its logits row: OpenAI's penalties on a copy when
/// asked, then the sampler; log-probabilities from the raw row.
fn pick<C>(seq: &mut Seq<C>, logits: &[f32]) -> Result<(u32, Option<TokenLogprobs>), String> {
    if let Some(i) = logits.iter().position(|v| !v.is_finite()) {
        return Err(format!("the model produced a non-finite logit (token id {i}) at position {}", seq.cached));
    }
    let job = &seq.job;
    let id = if (job.presence_penalty != 0.0 || job.frequency_penalty != 0.0) && !seq.counts.is_empty() {
        let mut row = logits.to_vec();
        for (&t, &c) in &seq.counts {
            if let Some(v) = row.get_mut(t as usize) {
                *v -= job.presence_penalty + job.frequency_penalty * c as f32;
            }
        }
        seq.sampler.sample(&row)
    } else {
        seq.sampler.sample(logits)
    };
    seq.sampler.accept(&[id]);
    Ok((id, job.logprobs.map(|n| token_logprobs(logits, id, n))))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_chains_identify_prefixes() {
        let a: Vec<u32> = (0..40).collect();
        let mut b = a.clone();
        b[20] = 999; // second block differs
        let (ha, hb) = (block_hashes(&a), block_hashes(&b));
        assert_eq!(ha.len(), 2); // 40 tokens: two full blocks
        assert_eq!(ha[0], hb[0]);
        assert_ne!(ha[1], hb[1]);
        // A chain link depends on every earlier block.
        let mut c = a.clone();
        c[0] = 7;
        assert_ne!(block_hashes(&c)[1], ha[1]);
        assert_eq!(blocks_for(0), 1);
        assert_eq!(blocks_for(16), 1);
        assert_eq!(blocks_for(17), 2);
        assert_eq!(positions_for(5, 1), 5);
    }

    #[test]
    fn prefix_cache_finds_the_longest_match_and_evicts_lru() {
        let mut p = PrefixCache { entries: Vec::new(), clock: 0 };
        let long: Vec<u32> = (0..48).collect();
        let short: Vec<u32> = (0..20).collect();
        p.insert(short.clone(), block_hashes(&short), "short", 2);
        p.insert(long.clone(), block_hashes(&long), "long", 3); // covers `short`'s one full block
        assert_eq!(p.entries.len(), 1);
        let other: Vec<u32> = (100..140).collect();
        p.insert(other.clone(), block_hashes(&other), "other", 3);
        let query: Vec<u32> = (0..40).chain([7, 7]).collect();
        let (i, n) = p.lookup(&query, &block_hashes(&query)).unwrap();
        assert_eq!((p.entries[i].cache, n), ("long", 32));
        assert!(p.lookup(&[5; 30], &block_hashes(&[5; 30])).is_none());
        // `long` was just used: `other` goes first.
        assert_eq!(p.evict_one(), Some(3));
        assert_eq!(p.entries[0].cache, "long");
        assert_eq!(p.blocks(), 3);
    }
}

//! Speculative decoding: a drafter proposes the tokens that may come next, and the
//! scheduler verifies them in the same step as a decode row, as `1 + draft` rows of one
//! sequence in the batch.
//!
//! The rule that keeps the output exactly that of plain decoding: verification row `j`
//! holds the logits plain decoding would compute at that position (the kernels are
//! batch-invariant: a row's result does not depend on the rows computed with it), the
//! sequence's own [`super::Sampler`] picks a token from it exactly as it would have (the
//! same RNG draws, the same penalties), and the next row is used only while the picked
//! token equals the draft that was fed there. Whatever is rejected is never seen: the
//! cache positions past the accepted tokens are overwritten by later steps. So ids and
//! log-probabilities are bit-identical with speculation on or off, greedy or seeded, and
//! a draft only decides how many tokens one step yields.
//!
//! Drafters:
//! - [`NgramDrafter`] (prompt lookup, llama.cpp's `--spec-type ngram`, vLLM's
//!   `[ngram]`): the tokens that followed the latest earlier occurrence of the
//!   sequence's last n tokens, n from the longest allowed down to 1.
//! - [`ModelDrafter`]: a small model with the same tokenizer, decoding greedily ahead
//!   on its own KV caches (llama.cpp's `--model-draft`).

use super::EngineError;
use super::sampler::argmax;
use super::scheduler::INITIAL_SLACK;
use crate::backend::{Backend, BackendResult, HostMatrix, KvCache, SeqSlice};
use crate::model::{Batch, CausalLm, LogitRows};

/// One sequence that may be drafted for this step.
pub struct DraftSeq<'a> {
    /// The request's id (a drafter may keep state per sequence under it).
    pub id: u64,
    /// Its tokens so far, prompt and generated; the last is the one this step feeds.
    pub tokens: &'a [u32],
    /// Tokens to propose at most.
    pub max: usize,
    /// KV positions its request reserved in the scheduler's block pool. A drafter that
    /// caches keys and values (a draft model) holds at most this many positions for it,
    /// so the pool's reservation bounds the draft model's caches too.
    pub reserved: usize,
}

/// Proposes draft tokens; the scheduler verifies them.
pub trait Drafter<B: Backend>: Send {
    /// Fill `drafts[i]` (cleared by the caller) with at most `seqs[i].max` tokens that
    /// may follow `seqs[i].tokens` (`max` 0: none this step, but the sequence runs on).
    /// Every running sequence is listed; what a drafter keeps for sequences that ended
    /// is dropped in [`Drafter::keep_only`]. An error drops this step's drafts (the step
    /// decodes one token per sequence as without speculation).
    fn propose(&mut self, backend: &B, seqs: &[DraftSeq<'_>], drafts: &mut [Vec<u32>]) -> BackendResult<()>;

    /// Drop what is kept for every sequence but `running` (the scheduler calls it after
    /// each step, also when it did not draft): a draft model's caches then never outlive
    /// the positions their sequences reserved.
    fn keep_only(&mut self, _running: &[u64]) {}
}

/// What drafts a scheduler's sequences (`--draft-ngram`, `--model-draft`, with
/// `--draft-max` and `--draft-min`).
pub struct Speculation<B: Backend> {
    pub method: DraftMethod<B>,
    /// Tokens drafted per step at most (llama.cpp's `--draft-max`).
    pub draft_max: usize,
    /// Drafts shorter than this are not verified (llama.cpp's `--draft-min`).
    pub draft_min: usize,
    /// Draft only while at most this many sequences run (`--draft-batch-max`).
    pub batch_max: usize,
}

pub enum DraftMethod<B: Backend> {
    /// Prompt lookup over n-grams of up to this many tokens.
    Ngram(usize),
    /// A draft model sharing the target's tokenizer, on the same backend.
    Model(Box<dyn CausalLm<B>>),
}

/// llama.cpp's `--draft-max` default.
pub const DEFAULT_DRAFT_MAX: usize = 16;

impl<B: Backend> Speculation<B> {
    /// A drafter over these settings, borrowing the draft model if there is one.
    pub fn drafter(&self) -> Box<dyn Drafter<B> + '_> {
        match &self.method {
            DraftMethod::Ngram(n) => Box::new(NgramDrafter::new(*n)),
            DraftMethod::Model(m) => Box::new(ModelDrafter::new(&**m)),
        }
    }

    /// One line for logs: `n-gram (n ≤ 3), up to 16 tokens`.
    pub fn describe(&self) -> String {
        let what = match &self.method {
            DraftMethod::Ngram(n) => format!("n-gram prompt lookup (n ≤ {n})"),
            DraftMethod::Model(m) => {
                let i = m.info();
                format!("a draft model ({}, {} parameters)", i.architecture, i.n_params)
            }
        };
        let batch = match self.batch_max {
            usize::MAX => String::new(),
            n => format!(", while at most {n} sequences run"),
        };
        format!("{what}, {} to {} tokens per step{batch}", self.draft_min.max(1), self.draft_max)
    }
}

/// How many more or fewer tokens a draft model's tokenizer may have than the model's
/// (llama.cpp's `SPEC_VOCAB_MAX_SIZE_DIFFERENCE`): the sizes of one family's models
/// differ by a few added tokens.
pub const MAX_DRAFT_VOCAB_DIFFERENCE: usize = 128;

/// Check that a draft model can draft for `target`: the same tokens, id by id, over the
/// ids both tokenizers have, and sizes at most [`MAX_DRAFT_VOCAB_DIFFERENCE`] apart.
/// `target_token` and `draft_token` give each id's bytes. (Ids one model lacks are never
/// fed to it: the scheduler cuts a draft at an id outside the model's vocabulary, and
/// the draft model does not draft for a sequence holding an id outside its own.)
pub fn check_draft_vocabulary(
    target_vocab: usize,
    draft_vocab: usize,
    target_token: impl Fn(u32) -> Option<Vec<u8>>,
    draft_token: impl Fn(u32) -> Option<Vec<u8>>,
) -> Result<(), EngineError> {
    if target_vocab.abs_diff(draft_vocab) > MAX_DRAFT_VOCAB_DIFFERENCE {
        return Err(EngineError::Speculation(format!(
            "the draft model's vocabulary has {draft_vocab} tokens but the model's has {target_vocab} \
             (at most {MAX_DRAFT_VOCAB_DIFFERENCE} apart); a draft model must share the model's tokenizer"
        )));
    }
    for id in 0..target_vocab.min(draft_vocab) as u32 {
        let (a, b) = (target_token(id), draft_token(id));
        if a != b {
            return Err(EngineError::Speculation(format!(
                "token {id} is {:?} in the model's vocabulary but {:?} in the draft model's; \
                 a draft model must share the model's tokenizer",
                a.as_deref().map(String::from_utf8_lossy),
                b.as_deref().map(String::from_utf8_lossy)
            )));
        }
    }
    Ok(())
}

/// Prompt lookup: the continuation of the latest earlier occurrence of the sequence's
/// last `n` tokens, trying `n = max_n` first and shorter n-grams after.
pub struct NgramDrafter {
    max_n: usize,
}

impl NgramDrafter {
    pub fn new(max_n: usize) -> Self {
        NgramDrafter { max_n: max_n.max(1) }
    }
}

/// Up to `max` tokens that followed the latest earlier occurrence of the last `n`
/// tokens of `tokens` (longest `n ≤ max_n` first); empty when none recurs.
pub fn ngram_lookup(tokens: &[u32], max_n: usize, max: usize, out: &mut Vec<u32>) {
    let len = tokens.len();
    if max == 0 {
        return;
    }
    for n in (1..=max_n.min(len.saturating_sub(1))).rev() {
        let key = &tokens[len - n..];
        // Latest start i < len - n with tokens[i..i + n] == key.
        if let Some(i) = (0..len - n).rev().find(|&i| &tokens[i..i + n] == key) {
            let from = i + n;
            let to = (from + max).min(len);
            out.extend_from_slice(&tokens[from..to]);
            return;
        }
    }
}

impl<B: Backend> Drafter<B> for NgramDrafter {
    fn propose(&mut self, _: &B, seqs: &[DraftSeq<'_>], drafts: &mut [Vec<u32>]) -> BackendResult<()> {
        for (s, d) in seqs.iter().zip(drafts.iter_mut()) {
            ngram_lookup(s.tokens, self.max_n, s.max, d);
        }
        Ok(())
    }
}

/// A draft model's cache for one sequence.
struct DraftCache<C> {
    id: u64,
    cache: C,
    capacity: usize,
    /// The tokens whose keys and values it holds.
    tokens: Vec<u32>,
}

/// Rows a draft model feeds per step to catch up on what its caches lack (a new
/// prompt): a step's catch-up is one forward of at most this many rows, however long
/// the prompts.
pub const CATCH_UP_CHUNK: usize = 512;

/// Greedy decoding with a draft model: per step, one forward of at most
/// [`CATCH_UP_CHUNK`] rows feeds each sequence what its draft cache lacks (the whole
/// prompt the first time, over several steps when it is long; then the tokens accepted
/// since), then one forward per further draft token, all sequences batched. A
/// sequence still catching up is not drafted. Each sequence's draft cache grows as it
/// fills, up to the positions its request reserved.
pub struct ModelDrafter<'m, B: Backend> {
    model: &'m dyn CausalLm<B>,
    caches: Vec<DraftCache<B::KvCache>>,
    logits: HostMatrix,
    ids: Vec<u32>,
    /// Rows per catch-up forward ([`CATCH_UP_CHUNK`]).
    chunk: usize,
}

impl<'m, B: Backend> ModelDrafter<'m, B> {
    pub fn new(model: &'m dyn CausalLm<B>) -> Self {
        ModelDrafter {
            model,
            caches: Vec::new(),
            logits: HostMatrix::zeros(0, 0),
            ids: Vec::new(),
            chunk: CATCH_UP_CHUNK,
        }
    }

    /// How many sequences it holds a KV cache for.
    pub fn cached_sequences(&self) -> usize {
        self.caches.len()
    }

    /// Catch up at most `rows` rows per step instead of [`CATCH_UP_CHUNK`].
    pub fn catch_up_in(mut self, rows: usize) -> Self {
        self.chunk = rows.max(1);
        self
    }

    /// The argmax of each row of `out` into `self.ids`.
    fn pick(&mut self, backend: &B, out: &B::Act) -> BackendResult<()> {
        if backend.argmax_rows(out, &mut self.ids)? {
            return Ok(());
        }
        backend.to_host(out, &mut self.logits)?;
        self.ids.clear();
        self.ids.extend((0..self.logits.rows).map(|r| argmax(self.logits.row(r))));
        Ok(())
    }

    /// One forward of `rows[k]` tokens after each listed cache's own, then (`pick`) the
    /// argmax of each one's last row into `self.ids`.
    fn run(&mut self, backend: &B, which: &[usize], rows: &[&[u32]], pick: bool) -> BackendResult<()> {
        let mut tokens = Vec::with_capacity(rows.iter().map(|r| r.len()).sum());
        let mut seqs = Vec::with_capacity(which.len());
        for (&c, r) in which.iter().zip(rows) {
            let start = tokens.len();
            tokens.extend_from_slice(r);
            seqs.push(SeqSlice { rows: start..tokens.len(), start_pos: self.caches[c].tokens.len() });
        }
        let mut caches: Vec<&mut B::KvCache> = Vec::with_capacity(which.len());
        // `which` is increasing: take the listed caches in order.
        let mut rest = &mut self.caches[..];
        let mut offset = 0;
        for &c in which {
            let (_, tail) = rest.split_at_mut(c - offset);
            let (one, tail) = tail.split_first_mut().expect("index inside");
            caches.push(&mut one.cache);
            rest = tail;
            offset = c + 1;
        }
        let out = self.model.forward(
            backend,
            &Batch { tokens: &tokens, seqs: &seqs },
            &mut caches,
            LogitRows::LastOfEachSeq,
        )?;
        drop(caches);
        for (&c, r) in which.iter().zip(rows) {
            self.caches[c].tokens.extend_from_slice(r);
        }
        if pick { self.pick(backend, &out) } else { Ok(()) }
    }
}

impl<B: Backend> Drafter<B> for ModelDrafter<'_, B> {
    fn keep_only(&mut self, running: &[u64]) {
        self.caches.retain(|c| running.contains(&c.id));
    }

    fn propose(&mut self, backend: &B, seqs: &[DraftSeq<'_>], drafts: &mut [Vec<u32>]) -> BackendResult<()> {
        let (context, vocab) = (self.model.info().context_length, self.model.info().vocab_size);
        // (cache index, sequence index, tokens to feed) of every sequence drafted.
        let mut plan: Vec<(usize, usize, usize)> = Vec::with_capacity(seqs.len());
        for (si, s) in seqs.iter().enumerate() {
            // It feeds at most every token and all but the last draft.
            let need = s.tokens.len() + s.max - 1;
            // The positions reserved for the sequence bound its draft cache: never more
            // than the pool accounts for (`need` fits them: it is at most the sequence's
            // tokens and drafts but the last), nor than the draft model's context.
            let most = s.reserved.min(context);
            if s.max == 0 || s.tokens.is_empty() || need > most {
                continue;
            }
            let ci = match self.caches.iter().position(|c| c.id == s.id) {
                Some(ci) => ci,
                None => {
                    let capacity = need.saturating_add(INITIAL_SLACK).min(most);
                    let cache =
                        self.model.new_cache(backend, capacity).map_err(|e| e.context("the draft model's KV cache"))?;
                    self.caches.push(DraftCache { id: s.id, cache, capacity, tokens: Vec::new() });
                    self.caches.len() - 1
                }
            };
            let c = &mut self.caches[ci];
            // Keep what it shares with the sequence; always feed the last token.
            let mut keep = c.tokens.iter().zip(s.tokens).take_while(|(a, b)| a == b).count().min(s.tokens.len() - 1);
            if !c.cache.rings().continues_at(keep) {
                keep = 0; // a sliding-window ring went on past the shared tokens: start again
            }
            c.tokens.truncate(keep);
            if s.tokens[keep..].iter().any(|&t| t as usize >= vocab) {
                continue; // a token this model does not have (the model's vocabulary is larger)
            }
            if need > c.capacity {
                let capacity = need.max(c.capacity.saturating_mul(2)).min(most);
                let mut grown =
                    self.model.new_cache(backend, capacity).map_err(|e| e.context("the draft model's KV cache"))?;
                self.model.copy_cache_prefix(backend, &c.cache, &mut grown, keep)?;
                c.cache = grown;
                c.capacity = capacity;
            }
            plan.push((ci, si, keep));
        }
        plan.sort_unstable_by_key(|p| p.0);
        if plan.is_empty() {
            return Ok(());
        }
        // One forward catches up: each sequence's pending tokens while they fit `chunk`
        // rows (it is drafted), else as many as fit but its last (it catches up over the
        // next steps and is not drafted in this one). A long new prompt thus costs the
        // step one bounded forward of the draft model, never a whole prefill.
        let mut room = self.chunk;
        let (mut which, mut rows, mut drafted) = (Vec::new(), Vec::new(), Vec::new());
        for &(ci, si, keep) in &plan {
            let tokens = seqs[si].tokens;
            let pending = tokens.len() - keep;
            let take = if pending <= room { pending } else { room.min(pending - 1) };
            if take == 0 {
                continue;
            }
            which.push(ci);
            rows.push(&tokens[keep..keep + take]);
            room -= take;
            if take == pending {
                drafted.push((ci, si, which.len() - 1));
            }
        }
        if which.is_empty() {
            return Ok(());
        }
        self.run(backend, &which, &rows, !drafted.is_empty())?;
        for &(_, si, k) in &drafted {
            drafts[si].push(self.ids[k]);
        }
        // Then one token per forward, for the sequences that want more.
        let mut active: Vec<(usize, usize)> = drafted.iter().map(|&(ci, si, _)| (ci, si)).collect();
        loop {
            active.retain(|&(_, si)| drafts[si].len() < seqs[si].max);
            if active.is_empty() {
                return Ok(());
            }
            let which: Vec<usize> = active.iter().map(|a| a.0).collect();
            let last: Vec<[u32; 1]> =
                active.iter().map(|&(_, si)| [*drafts[si].last().expect("one drafted")]).collect();
            let rows: Vec<&[u32]> = last.iter().map(|t| &t[..]).collect();
            self.run(backend, &which, &rows, true)?;
            for (k, &(_, si)) in active.iter().enumerate() {
                drafts[si].push(self.ids[k]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lookup(tokens: &[u32], max_n: usize, max: usize) -> Vec<u32> {
        let mut out = Vec::new();
        ngram_lookup(tokens, max_n, max, &mut out);
        out
    }

    #[test]
    fn ngram_lookup_takes_the_latest_longest_match() {
        // "1 2 3" recurs at the end; its latest earlier occurrence is followed by 9 8.
        let t = [1, 2, 3, 4, 5, 1, 2, 3, 9, 8, 7, 2, 3];
        // n = 2: "2 3" last occurred at 6..8, followed by 9 8 7 2 3.
        assert_eq!(lookup(&t, 2, 3), vec![9, 8, 7]);
        assert_eq!(lookup(&t, 2, 10), vec![9, 8, 7, 2, 3]);
        // n = 3 "7 2 3" does not recur, so n = 2 answers the same.
        assert_eq!(lookup(&t, 3, 3), vec![9, 8, 7]);
        // n = 1 only: "3" last occurred at 7.
        assert_eq!(lookup(&t, 1, 2), vec![9, 8]);
        // Nothing recurs.
        assert_eq!(lookup(&[1, 2, 3], 3, 4), Vec::<u32>::new());
        assert_eq!(lookup(&[5], 3, 4), Vec::<u32>::new());
        assert_eq!(lookup(&t, 2, 0), Vec::<u32>::new());
        // A run: the latest occurrence of "7 7" is one back, followed by one 7.
        assert_eq!(lookup(&[7, 7, 7, 7], 2, 5), vec![7]);
    }

    #[test]
    fn a_draft_model_must_share_the_vocabulary() {
        let same = |id: u32| Some(vec![id as u8]);
        assert!(check_draft_vocabulary(4, 4, same, same).is_ok());
        // Sizes a few tokens apart (a family's models): the shared ids must agree.
        assert!(check_draft_vocabulary(4, 5, same, same).is_ok());
        assert!(check_draft_vocabulary(200, 72, same, same).is_ok());
        let e = check_draft_vocabulary(4, 133, same, same).unwrap_err().to_string();
        assert!(e.contains("133 tokens but the model's has 4"), "{e}");
        let other = |id: u32| Some(vec![if id == 2 { b'x' } else { id as u8 }]);
        let e = check_draft_vocabulary(4, 4, same, other).unwrap_err().to_string();
        assert!(e.contains("token 2 is"), "{e}");
    }
}

//! Perplexity with llama.cpp's method (`llama-perplexity`), so the numbers compare: the
//! text is tokenized once (a BOS token in front when the model's files ask for one), cut
//! into non-overlapping windows of `n_ctx` tokens (the tail that fills no window is
//! dropped), each window runs from an empty cache, and only the second half of each window
//! is scored: the logits at positions `n_ctx/2 .. n_ctx-1` predict the next token. With a
//! BOS-adding model, each window's first token is replaced by BOS, as llama.cpp does.
//! The estimate is `exp(mean NLL)`, its uncertainty llama.cpp's
//! `sqrt((mean(NLL²) − mean(NLL)²) / (count − 1)) · PPL`.

use crate::backend::Backend;
use crate::engine::{Engine, EngineError, score_on};

/// The running totals after each window.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct PerplexityState {
    /// Windows done.
    pub windows: usize,
    /// Tokens scored.
    pub count: usize,
    /// Σ NLL and Σ NLL² (natural log).
    pub nll: f64,
    pub nll2: f64,
}

impl PerplexityState {
    pub fn ppl(&self) -> f64 {
        (self.nll / self.count as f64).exp()
    }

    /// llama.cpp's ± for the final estimate (0 with fewer than two tokens).
    pub fn uncertainty(&self) -> f64 {
        let n = self.count as f64;
        let mean = self.nll / n;
        let var = self.nll2 / n - mean * mean;
        if self.count > 1 && var > 0.0 { (var / (n - 1.0)).sqrt() * self.ppl() } else { 0.0 }
    }
}

/// The windows a text of `n_tokens` gives with `n_ctx` (llama.cpp needs at least two).
pub fn windows(n_tokens: usize, n_ctx: usize) -> usize {
    n_tokens.checked_div(n_ctx).unwrap_or(0)
}

impl<B: Backend> Engine<B> {
    /// The token ids llama-perplexity scores: the text tokenized with special-token text
    /// as plain text, after BOS when the model adds one.
    pub fn perplexity_tokens(&self, text: &str) -> Vec<u32> {
        let mut ids: Vec<u32> = self.text.tokenizer.bos_to_add().into_iter().collect();
        ids.extend(self.text.tokenizer.encode_ordinary(text));
        ids
    }

    /// Perplexity of `tokens` in windows of `n_ctx`; `max_windows` caps the windows (llama.cpp's
    /// `--chunks`); `on_window` sees the running state after each.
    pub fn perplexity(
        &self,
        tokens: &[u32],
        n_ctx: usize,
        max_windows: Option<usize>,
        mut on_window: impl FnMut(&PerplexityState) -> Result<(), super::CallerError>,
    ) -> Result<PerplexityState, EngineError> {
        let context = self.model.info().context_length;
        let refuse = |m: String| Err(EngineError::Windows(m));
        if n_ctx < 4 {
            return refuse(format!("-c {n_ctx}: windows need at least 4 tokens (half of each is scored)"));
        }
        if n_ctx > context {
            return refuse(format!("-c {n_ctx} exceeds the model's context of {context} tokens"));
        }
        let n = windows(tokens.len(), n_ctx);
        if n < 2 {
            return refuse(format!(
                "the text is {} tokens; perplexity with -c {n_ctx} needs at least {} (two windows, as llama.cpp)",
                tokens.len(),
                2 * n_ctx
            ));
        }
        if max_windows == Some(0) {
            return refuse("score at least one window".into());
        }
        let n = max_windows.map_or(n, |m| m.min(n));
        let bos = self.text.tokenizer.bos_to_add();
        let first = n_ctx / 2;
        let mut state = PerplexityState::default();
        // The engine's loop scores each window as a prompt (`prompt_logprobs`), in chunks
        // of at most SCORE_CHUNK rows as llama-perplexity's micro-batches: entry j is the
        // log-probability of window[j + 1] from the logits at position j.
        let mut scheduler = self.scoring_scheduler(n_ctx);
        let mut window = Vec::with_capacity(n_ctx);
        for w in 0..n {
            let start = w * n_ctx;
            window.clear();
            window.extend_from_slice(&tokens[start..start + n_ctx]);
            if let Some(bos) = bos {
                window[0] = bos;
            }
            let mut j = 0;
            score_on(&mut scheduler, w as u64, &window, 0, |part| {
                for lp in part {
                    if j >= first {
                        let nll = -lp.logprob;
                        state.nll += nll;
                        state.nll2 += nll * nll;
                        state.count += 1;
                    }
                    j += 1;
                }
            })
            .map_err(|e| match e {
                EngineError::Run(_) | EngineError::Dropped => {
                    EngineError::Run(format!("window {} (tokens {start}..{}): {e}", w + 1, start + n_ctx))
                }
                e => e,
            })?;
            state.windows += 1;
            on_window(&state).map_err(EngineError::Callback)?;
        }
        Ok(state)
    }
}

//! Two engines stepped together on the same tokens, to see where two backends part:
//! each step runs both forwards, compares their logits, and feeds both the token that
//! engine `a` samples. The first step whose argmaxes differ ends the run.
//! (`forge generate --backend both` runs cpu against gpu with it.)

use anyhow::ensure;

use super::sampler::argmax;
use super::{Engine, GenerateParams, Sampler, ensure_finite};
use crate::backend::{Backend, HostMatrix, SeqSlice};
use crate::compare::max_abs_diff;
use crate::model::{Batch, LogitRows};

/// One step of a lockstep run.
#[derive(Clone, Debug, PartialEq)]
pub struct LockstepStep {
    /// 0 is the prompt pass, then one per generated token.
    pub step: usize,
    /// Tokens fed in this step.
    pub tokens_in: usize,
    /// Position of the last token fed (the one whose logits are compared).
    pub position: usize,
    /// max |logit_a − logit_b| over the vocabulary (NaN if either has a NaN).
    pub max_abs_diff: f32,
    pub argmax_a: u32,
    pub argmax_b: u32,
    /// The token `a` sampled, fed to both next.
    pub next: u32,
}

impl LockstepStep {
    pub fn agrees(&self) -> bool {
        self.argmax_a == self.argmax_b
    }
}

/// Run `a` and `b` from `prompt_ids` for up to `params.max_new_tokens` steps (fewer at
/// EOS unless ignored, or when the context fills), calling `on_step` after each. Returns
/// every step; the last one is the divergence when its argmaxes differ.
pub fn lockstep<A: Backend, B: Backend>(
    a: &Engine<A>,
    b: &Engine<B>,
    prompt_ids: &[u32],
    params: &GenerateParams,
    mut on_step: impl FnMut(&LockstepStep) -> anyhow::Result<()>,
) -> anyhow::Result<Vec<LockstepStep>> {
    ensure!(a.model.info() == b.model.info(), "the two engines must load the same model");
    let n_ctx = a.check_prompt(prompt_ids.len(), params.max_context)?;
    let budget = params.max_new_tokens.min(n_ctx - prompt_ids.len());
    let capacity = (prompt_ids.len() + budget).saturating_sub(1).max(prompt_ids.len());
    let mut cache_a = a.model.new_cache(&a.backend, capacity)?;
    let mut cache_b = b.model.new_cache(&b.backend, capacity)?;
    let mut sampler = Sampler::new(params.sampling.clone()).map_err(anyhow::Error::msg)?;
    sampler.accept(prompt_ids);
    let (mut logits_a, mut logits_b) = (HostMatrix::zeros(0, 0), HostMatrix::zeros(0, 0));
    let (mut tokens, mut pos) = (prompt_ids.to_vec(), 0);
    let mut steps = Vec::new();
    for step in 0..budget {
        let seqs = [SeqSlice { rows: 0..tokens.len(), start_pos: pos }];
        let batch = Batch { tokens: &tokens, seqs: &seqs };
        let out_a = a.model.forward(&a.backend, &batch, &mut [&mut cache_a], LogitRows::LastOfEachSeq)?;
        a.backend.to_host(&out_a, &mut logits_a)?;
        let out_b = b.model.forward(&b.backend, &batch, &mut [&mut cache_b], LogitRows::LastOfEachSeq)?;
        b.backend.to_host(&out_b, &mut logits_b)?;
        let position = pos + tokens.len() - 1;
        for (name, logits) in [(a.backend.name(), &logits_a), (b.backend.name(), &logits_b)] {
            ensure_finite(&logits.data, step, position).map_err(|e| anyhow::anyhow!("{name}: {e}"))?;
        }
        let max_abs_diff = max_abs_diff(&logits_a.data, &logits_b.data);
        let s = LockstepStep {
            step,
            tokens_in: tokens.len(),
            position,
            max_abs_diff,
            argmax_a: argmax(logits_a.row(0)),
            argmax_b: argmax(logits_b.row(0)),
            next: sampler.sample(logits_a.row(0)),
        };
        sampler.accept_generated(s.next);
        on_step(&s)?;
        let (stop, next) = (!s.agrees() || (a.is_eos(s.next) && !params.ignore_eos), s.next);
        steps.push(s);
        if stop {
            break;
        }
        pos += tokens.len();
        tokens.clear();
        tokens.push(next);
    }
    Ok(steps)
}

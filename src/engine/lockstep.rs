//! Two engines stepped together on the same tokens, to see where two backends part:
//! each step runs both engines' schedulers one token on, compares the logits of their
//! picks, and feeds both the token that engine `a` samples. The first step whose argmaxes
//! differ ends the run. (`forge generate --backend both` runs cpu against gpu with it.)

use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

use super::sampler::argmax;
use super::scheduler::{Event, PickHook, Request, Scheduler, SchedulerConfig};
use super::{Engine, EngineError, GenerateParams, Metrics};
use crate::backend::Backend;
use crate::compare::max_abs_diff;

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
///
/// Each engine runs the one scheduler every command runs on, with one request whose
/// [`PickHook`] hands over the logits of each pick; `b`'s hook takes `a`'s token.
pub fn lockstep<A: Backend, B: Backend>(
    a: &Engine<A>,
    b: &Engine<B>,
    prompt_ids: &[u32],
    params: &GenerateParams,
    mut on_step: impl FnMut(&LockstepStep) -> Result<(), super::CallerError>,
) -> Result<Vec<LockstepStep>, EngineError> {
    if a.model.info() != b.model.info() {
        return Err(EngineError::ModelsDiffer);
    }
    let n_ctx = a.check_prompt(prompt_ids.len(), params.max_context)?;
    let budget = params.max_new_tokens.min(n_ctx - prompt_ids.len());
    if budget == 0 {
        return Ok(Vec::new());
    }
    params.sampling.validate()?;
    let capacity = (prompt_ids.len() + budget).saturating_sub(1).max(prompt_ids.len());
    // The logits of each side's latest pick, and the token `b` is to take.
    let logits_a = Arc::new(Mutex::new(Vec::new()));
    let logits_b = Arc::new(Mutex::new(Vec::new()));
    let forced = Arc::new(AtomicU32::new(0));
    let request = |hook: PickHook| {
        let mut r = Request::new(0, prompt_ids.to_vec(), budget, params.sampling.clone());
        r.ignore_eos = true; // the lockstep decides where to stop
        r.pick_hook = Some(hook);
        r
    };
    let keep = |into: &Arc<Mutex<Vec<f32>>>| {
        let into = into.clone();
        move |logits: &[f32]| {
            let mut v = into.lock().unwrap_or_else(|e| e.into_inner());
            v.clear();
            v.extend_from_slice(logits);
        }
    };
    let (keep_a, keep_b, take) = (keep(&logits_a), keep(&logits_b), forced.clone());
    let hook_a = PickHook(Arc::new(move |logits, id| {
        keep_a(logits);
        id
    }));
    let hook_b = PickHook(Arc::new(move |logits, _| {
        keep_b(logits);
        take.load(Ordering::Relaxed)
    }));
    let config = SchedulerConfig::single(capacity);
    let metrics = || Arc::new(Metrics::default());
    let eog = a.text.end_of_generation.clone();
    let mut sched_a = Scheduler::new(&a.backend, &*a.model, config.clone(), eog.clone(), metrics());
    let mut sched_b = Scheduler::new(&b.backend, &*b.model, config, eog, metrics());
    sched_a.add(request(hook_a));
    sched_b.add(request(hook_b));
    let mut steps = Vec::new();
    for step in 0..budget {
        let next = next_token(&mut sched_a, &a.backend.name())?;
        forced.store(next, Ordering::Relaxed);
        next_token(&mut sched_b, &b.backend.name())?;
        let (la, lb) =
            (logits_a.lock().unwrap_or_else(|e| e.into_inner()), logits_b.lock().unwrap_or_else(|e| e.into_inner()));
        let position = prompt_ids.len() - 1 + step;
        let s = LockstepStep {
            step,
            tokens_in: if step == 0 { prompt_ids.len() } else { 1 },
            position,
            max_abs_diff: max_abs_diff(&la, &lb),
            argmax_a: argmax(&la),
            argmax_b: argmax(&lb),
            next,
        };
        drop((la, lb));
        on_step(&s).map_err(EngineError::Callback)?;
        let stop = !s.agrees() || (a.is_eos(s.next) && !params.ignore_eos);
        steps.push(s);
        if stop {
            break;
        }
    }
    Ok(steps)
}

/// Step `scheduler` until its request picks a token; that token.
fn next_token<B: Backend>(scheduler: &mut Scheduler<'_, B>, name: &str) -> Result<u32, EngineError> {
    let mut events = Vec::with_capacity(4);
    loop {
        if !scheduler.busy() {
            return Err(EngineError::Run(format!("{name}: the engine ended the request early")));
        }
        scheduler.step(&mut events);
        for (_, event) in events.drain(..) {
            match event {
                Event::Token { id, .. } | Event::EndToken { id, .. } => return Ok(id),
                Event::Failed(e) => return Err(EngineError::Run(format!("{name}: {e}"))),
                _ => {}
            }
        }
    }
}

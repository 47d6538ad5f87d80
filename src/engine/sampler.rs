//! Next-token selection: presence/frequency and repetition penalties, greedy, top-k,
//! top-p, min-p, temperature, with a seeded RNG. One set of parameters
//! ([`SamplingParams`], llama.cpp's defaults) serves the CLI and the HTTP API.
//!
//! Order of operations, llama.cpp's default sampler chain: OpenAI's presence and
//! frequency penalties over the tokens generated so far (`logit -= presence` for a token
//! that appeared, `- frequency × count`, as vLLM applies them), then the repetition
//! penalty on those logits (llama.cpp's and HF's formula: a positive logit of a recent token is
//! divided by the penalty, a negative one multiplied) → keep the top k → keep the
//! smallest set whose probability reaches top p → drop tokens less likely than min p ×
//! the most likely one → divide the survivors' logits by the temperature → draw. The
//! three cuts see the untempered distribution, as in llama.cpp (HF `generate` applies
//! the temperature first; at temperature 1 the two agree). `temperature == 0` is greedy
//! (argmax of the penalized logits, lowest id on ties). `top_k == 0`, `top_p == 1`,
//! `min_p == 0` and `repeat_penalty == 1` (or `repeat_last_n == 0`) each turn their
//! step off.

use std::collections::VecDeque;

pub use crate::rng::Rng;

#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    /// Keep only tokens whose probability is at least `min_p` times the top token's; 0 = off.
    pub min_p: f32,
    /// Penalty for tokens among the last `repeat_last_n` (prompt included); 1 = off.
    pub repeat_penalty: f32,
    /// How many recent tokens the penalty looks at; 0 = off, `usize::MAX` = all.
    pub repeat_last_n: usize,
    /// OpenAI's presence penalty over the generated tokens, in [-2, 2]; 0 = off.
    pub presence_penalty: f32,
    /// OpenAI's frequency penalty over the generated tokens, in [-2, 2]; 0 = off.
    pub frequency_penalty: f32,
    pub seed: u64,
}

impl Default for SamplingParams {
    /// llama.cpp's defaults, for the CLI and the API alike: temperature 0.8, top-k 40,
    /// top-p 0.95, min-p 0.05, no penalties, seed 0.
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: 0,
        }
    }

    /// Every field within its range, the same for the CLI, the API and Python.
    pub fn validate(&self) -> Result<(), SamplingError> {
        use SamplingField as F;
        let check = |ok: bool, field, rule, got: f32| if ok { Ok(()) } else { Err(SamplingError { field, rule, got }) };
        let t = self.temperature;
        check(t.is_finite() && t >= 0.0, F::Temperature, "a finite number >= 0 (0 = greedy)", t)?;
        check(self.top_p > 0.0 && self.top_p <= 1.0, F::TopP, "in (0, 1] (1 = off)", self.top_p)?;
        check((0.0..=1.0).contains(&self.min_p), F::MinP, "in [0, 1] (0 = off)", self.min_p)?;
        let r = self.repeat_penalty;
        check(r.is_finite() && r > 0.0, F::RepeatPenalty, "a finite number > 0 (1 = off)", r)?;
        for (field, v) in [(F::PresencePenalty, self.presence_penalty), (F::FrequencyPenalty, self.frequency_penalty)] {
            check((-2.0..=2.0).contains(&v), field, "in [-2, 2] (0 = off)", v)?;
        }
        Ok(())
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Whether the repetition penalty changes anything (and so needs the token history).
    pub fn repeats(&self) -> bool {
        self.repeat_penalty != 1.0 && self.repeat_last_n > 0
    }

    /// Whether any penalty changes the logits (the repetition penalty, or OpenAI's).
    pub fn penalizes(&self) -> bool {
        self.repeats() || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }

    /// Whether the token is the argmax of the raw logits, which a backend may find on
    /// the device (greedy, no penalty).
    pub fn is_argmax(&self) -> bool {
        (self.is_greedy() || self.top_k == 1) && !self.penalizes()
    }
}

/// A sampling parameter, named as the CLI's flag and the API's field name it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SamplingField {
    Temperature,
    TopK,
    TopP,
    MinP,
    RepeatPenalty,
    RepeatLastN,
    PresencePenalty,
    FrequencyPenalty,
}

impl SamplingField {
    /// The CLI's flag, without its dashes (`top-p`).
    pub fn flag(self) -> &'static str {
        match self {
            SamplingField::Temperature => "temperature",
            SamplingField::TopK => "top-k",
            SamplingField::TopP => "top-p",
            SamplingField::MinP => "min-p",
            SamplingField::RepeatPenalty => "repeat-penalty",
            SamplingField::RepeatLastN => "repeat-last-n",
            SamplingField::PresencePenalty => "presence-penalty",
            SamplingField::FrequencyPenalty => "frequency-penalty",
        }
    }

    /// The API's field (`top_p`).
    pub fn api_name(self) -> &'static str {
        match self {
            SamplingField::Temperature => "temperature",
            SamplingField::TopK => "top_k",
            SamplingField::TopP => "top_p",
            SamplingField::MinP => "min_p",
            SamplingField::RepeatPenalty => "repeat_penalty",
            SamplingField::RepeatLastN => "repeat_last_n",
            SamplingField::PresencePenalty => "presence_penalty",
            SamplingField::FrequencyPenalty => "frequency_penalty",
        }
    }
}

/// A sampling parameter outside its range; shown with the CLI's flag name, and the API
/// answers with [`SamplingError::api_message`] and the field's API name.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{} must be {rule}, got {got}", field.flag())]
pub struct SamplingError {
    pub field: SamplingField,
    pub rule: &'static str,
    pub got: f32,
}

impl SamplingError {
    pub fn api_message(&self) -> String {
        format!("{} must be {}, got {}", self.field.api_name(), self.rule, self.got)
    }
}

pub struct Sampler {
    params: SamplingParams,
    rng: Rng,
    /// The last `repeat_last_n` tokens (prompt and generated), when the penalty is on.
    history: VecDeque<u32>,
    /// Occurrences of each generated token (for OpenAI's penalties), when they are on.
    counts: std::collections::HashMap<u32, u32>,
    /// Scratch reused across steps: (logit, id) candidates, their probabilities, and the
    /// distinct ids of the history.
    candidates: Vec<(f32, u32)>,
    probs: Vec<f64>,
    recent: Vec<u32>,
}

/// Index of the largest value; the lowest index among equals. NaNs are never chosen
/// (unless every value is NaN: then the last index, as [`argmax_reference`] gives).
///
/// Two passes the compiler vectorizes: the maximum over eight independent lanes (a
/// comparison per value, so a NaN never replaces a number), then the first index
/// holding it. The same index as the one-pass rule, faster over a 50k vocabulary.
pub fn argmax(logits: &[f32]) -> u32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = logits.chunks_exact(8);
    let tail = chunks.remainder();
    for c in chunks {
        for (m, &v) in lanes.iter_mut().zip(c) {
            *m = if v > *m { v } else { *m };
        }
    }
    let mut max = f32::NEG_INFINITY;
    for &v in lanes.iter().chain(tail) {
        max = if v > max { v } else { max };
    }
    match logits.iter().position(|&v| v == max) {
        Some(i) => i as u32,
        // Every value is NaN (or there are none).
        None => logits.len().saturating_sub(1) as u32,
    }
}

/// The one-pass rule [`argmax`] implements: a later value wins only when larger, or
/// when the best so far is NaN.
pub fn argmax_reference(logits: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] || logits[best].is_nan() {
            best = i;
        }
    }
    best as u32
}

/// llama.cpp's (and HF's) repetition penalty of one logit.
pub fn penalize(logit: f32, penalty: f32) -> f32 {
    if logit <= 0.0 { logit * penalty } else { logit / penalty }
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Result<Self, SamplingError> {
        params.validate()?;
        Ok(Sampler {
            rng: Rng::new(params.seed),
            params,
            history: VecDeque::new(),
            counts: std::collections::HashMap::new(),
            candidates: Vec::new(),
            probs: Vec::new(),
            recent: Vec::new(),
        })
    }

    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Room for the penalty's history of a sequence of up to `n_ctx` tokens, so a warm
    /// decode loop does not allocate.
    pub fn reserve_history(&mut self, n_ctx: usize) {
        if self.params.presence_penalty != 0.0 || self.params.frequency_penalty != 0.0 {
            self.counts.reserve(n_ctx.min(1 << 16));
        }
        if self.params.repeats() {
            let n = self.params.repeat_last_n.min(n_ctx);
            self.history.reserve(n);
            self.recent.reserve(n);
        }
    }

    /// Record a generated token: for the repetition penalty, and for OpenAI's penalties,
    /// which count generated tokens only.
    pub fn accept_generated(&mut self, id: u32) {
        if self.params.presence_penalty != 0.0 || self.params.frequency_penalty != 0.0 {
            *self.counts.entry(id).or_default() += 1;
        }
        self.accept(&[id]);
    }

    /// Record tokens of the sequence (the prompt; generated tokens go through
    /// [`Sampler::accept_generated`]) for the repetition penalty; a no-op when it is off.
    pub fn accept(&mut self, ids: &[u32]) {
        if !self.params.repeats() {
            return;
        }
        let n = self.params.repeat_last_n;
        let skip = ids.len().saturating_sub(n);
        for &id in &ids[skip..] {
            if self.history.len() == n {
                self.history.pop_front();
            }
            self.history.push_back(id);
        }
    }

    /// The next token: an index into `logits`, never a NaN entry unless all are NaN.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = &self.params;
        let greedy = p.is_greedy() || p.top_k == 1;
        let openai = !self.counts.is_empty();
        if greedy && !p.repeats() && !openai {
            return argmax(logits);
        }
        // Candidates ordered by raw logit: dividing by a positive temperature keeps the
        // order, so the division waits until the logits are differences from the max,
        // in f64 ((v − max) / t cannot overflow f64 for any f32 v and t > 0; dividing
        // first overflows f32 as t → 0 and turns the top logits into inf − inf = NaN).
        let c = &mut self.candidates;
        c.clear();
        c.extend(logits.iter().enumerate().map(|(i, &v)| (v, i as u32)));
        if openai {
            for (&id, &n) in &self.counts {
                if let Some((v, _)) = c.get_mut(id as usize) {
                    *v -= p.presence_penalty + p.frequency_penalty * n as f32;
                }
            }
        }
        if p.repeats() {
            let recent = &mut self.recent;
            recent.clear();
            recent.extend(self.history.iter().copied().filter(|&id| (id as usize) < c.len()));
            recent.sort_unstable();
            recent.dedup();
            for &id in recent.iter() {
                let v = &mut c[id as usize].0;
                *v = penalize(*v, p.repeat_penalty);
            }
        }
        if greedy {
            // `argmax` of the penalized logits, with its exact rule (ties and NaN included).
            let mut best = 0;
            for (i, &(v, _)) in c.iter().enumerate() {
                if v > c[best].0 || c[best].0.is_nan() {
                    best = i;
                }
            }
            return c.get(best).map_or(0, |&(_, id)| id);
        }
        c.retain(|(v, _)| !v.is_nan());
        let desc = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        if p.top_k > 0 && p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, desc);
            c.truncate(p.top_k);
        }
        c.sort_unstable_by(desc);
        let Some(&(max, first)) = c.first() else {
            return 0; // every logit is NaN
        };
        if max.is_infinite() {
            return first; // +inf outweighs everything (or all are -inf: the first is as good)
        }
        // The cuts use the untempered probabilities (relative to the top token's).
        let probs = &mut self.probs;
        probs.clear();
        probs.extend(c.iter().map(|&(v, _)| (f64::from(v) - f64::from(max)).exp()));
        let total: f64 = probs.iter().sum();
        // Nucleus: the shortest prefix whose mass reaches top_p.
        let mut keep = probs.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0;
            for (i, pr) in probs.iter().enumerate() {
                cum += pr / total;
                if cum >= f64::from(p.top_p) {
                    keep = i + 1;
                    break;
                }
            }
        }
        // Min-p: probs[0] is the top token's (relative) probability, exactly 1.
        if p.min_p > 0.0 {
            let floor = f64::from(p.min_p) * probs[0];
            keep = probs[..keep].iter().take_while(|&&pr| pr >= floor).count().max(1);
        }
        // Temperature on the survivors: exp((v − max) / t).
        let t = f64::from(p.temperature);
        for (pr, &(v, _)) in probs[..keep].iter_mut().zip(c.iter()) {
            *pr = ((f64::from(v) - f64::from(max)) / t).exp();
        }
        let kept_mass: f64 = probs[..keep].iter().sum();
        let mut u = self.rng.next_f64() * kept_mass;
        for (i, pr) in probs[..keep].iter().enumerate() {
            if u < *pr {
                return c[i].1;
            }
            u -= pr;
        }
        c[keep - 1].1
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_argmax_lowest_on_ties() {
        let mut s = Sampler::new(SamplingParams::greedy()).unwrap();
        assert_eq!(s.sample(&[1.0, 3.0, 3.0, -1.0]), 1);
        assert_eq!(argmax(&[f32::NAN, 1.0, 2.0]), 2);
    }

    /// The vectorized argmax gives the one-pass rule's index on rows full of ties, NaNs,
    /// infinities and signed zeros, of every length around the 8-lane chunks.
    #[test]
    fn argmax_equals_the_one_pass_rule() {
        let mut rng = Rng::new(5);
        let specials = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0, 1.0, -1.0];
        for len in (0..40).chain([50257]) {
            for _ in 0..200 {
                let row: Vec<f32> = (0..len)
                    .map(|_| match rng.next_u64() % 4 {
                        0 => specials[(rng.next_u64() % specials.len() as u64) as usize],
                        _ => (rng.next_u64() % 5) as f32 - 2.0,
                    })
                    .collect();
                assert_eq!(argmax(&row), argmax_reference(&row), "{row:?}");
            }
        }
        assert_eq!(argmax(&[f32::NAN; 11]), 10);
        assert_eq!(argmax(&[]), 0);
    }

    #[test]
    fn invalid_params_are_rejected() {
        for (t, p) in [(-1.0, 1.0), (f32::NAN, 1.0), (1.0, 0.0), (1.0, 1.5), (f32::INFINITY, 0.5)] {
            assert!(
                Sampler::new(SamplingParams { temperature: t, top_k: 0, top_p: p, ..SamplingParams::greedy() })
                    .is_err()
            );
        }
    }

    #[test]
    fn vanishing_temperature_tends_to_greedy() {
        // Dividing the logits by t first overflows f32 here (10 / 1e-38 = inf) and the top
        // logits become NaN after the max is subtracted: sampling went wrong exactly when
        // it should be almost greedy.
        let logits = [1.0, 10.0, 9.999, -3.0, f32::NAN, f32::NEG_INFINITY];
        for t in [1e-6, 1e-10, 1e-30, 1e-38, f32::MIN_POSITIVE, 1e-45] {
            let mut s = Sampler::new(SamplingParams {
                temperature: t,
                top_k: 0,
                top_p: 1.0,
                seed: 1,
                ..SamplingParams::greedy()
            })
            .unwrap();
            for _ in 0..200 {
                assert_eq!(s.sample(&logits), 1, "temperature {t}");
            }
        }
        // Exact ties at the top share the draw even as t → 0.
        let mut s = Sampler::new(SamplingParams {
            temperature: 1e-40,
            top_k: 0,
            top_p: 1.0,
            seed: 3,
            ..SamplingParams::greedy()
        })
        .unwrap();
        let picks: Vec<u32> = (0..200).map(|_| s.sample(&[5.0, 5.0, 1.0])).collect();
        assert!(picks.contains(&0) && picks.contains(&1) && !picks.contains(&2));
    }

    #[test]
    fn extreme_parameters_stay_well_defined() {
        let logits = [0.5, -1.0, 3.0, f32::MAX, -f32::MAX];
        for (t, k, p) in [(f32::MAX, 0, 1.0), (1e30, 3, 1e-30), (1.0, usize::MAX, 0.5), (1e-45, 2, 1.0)] {
            let mut s = Sampler::new(SamplingParams {
                temperature: t,
                top_k: k,
                top_p: p,
                seed: 9,
                ..SamplingParams::greedy()
            })
            .unwrap();
            for _ in 0..50 {
                assert!((s.sample(&logits) as usize) < logits.len());
            }
        }
        // A vast temperature flattens the distribution to uniform: every id appears.
        let mut s = Sampler::new(SamplingParams {
            temperature: 1e30,
            top_k: 0,
            top_p: 1.0,
            seed: 5,
            ..SamplingParams::greedy()
        })
        .unwrap();
        let mut seen = [false; 4];
        for _ in 0..400 {
            seen[s.sample(&[0.0, 100.0, -100.0, 7.0]) as usize] = true;
        }
        assert_eq!(seen, [true; 4]);
        // Infinite logits: +inf wins; all -inf gives a valid id; all NaN gives 0.
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 5,
            ..SamplingParams::greedy()
        })
        .unwrap();
        assert_eq!(s.sample(&[1.0, f32::INFINITY, 2.0]), 1);
        assert!(s.sample(&[f32::NEG_INFINITY; 3]) < 3);
        assert_eq!(s.sample(&[f32::NAN; 3]), 0);
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let logits = [0.0, 5.0, 4.9, 4.8, -3.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 2,
            top_p: 1.0,
            seed: 7,
            ..SamplingParams::greedy()
        })
        .unwrap();
        for _ in 0..200 {
            assert!(matches!(s.sample(&logits), 1 | 2));
        }
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 0.3,
            seed: 7,
            ..SamplingParams::greedy()
        })
        .unwrap();
        for _ in 0..200 {
            assert_eq!(s.sample(&logits), 1);
        }
    }

    #[test]
    fn sampling_follows_the_distribution_and_is_seeded() {
        // p = softmax([0, ln 3]) = [0.25, 0.75]
        let logits = [0.0, 3f32.ln()];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: 42,
            ..SamplingParams::greedy()
        })
        .unwrap();
        let ones = (0..20_000).filter(|_| s.sample(&logits) == 1).count() as f64 / 20_000.0;
        assert!((ones - 0.75).abs() < 0.015, "{ones}");
        let draw = |seed| {
            let mut s = Sampler::new(SamplingParams {
                temperature: 0.8,
                top_k: 0,
                top_p: 1.0,
                seed,
                ..SamplingParams::greedy()
            })
            .unwrap();
            (0..50).map(|_| s.sample(&[0.1, 0.2, 0.3, 0.4])).collect::<Vec<_>>()
        };
        assert_eq!(draw(1), draw(1));
        assert_ne!(draw(1), draw(2));
    }

    #[test]
    fn min_p_keeps_tokens_within_a_factor_of_the_top() {
        // Relative probabilities 1, 0.5, 0.1, 0.05: min-p 0.2 keeps ids 0 and 1 (2/3, 1/3).
        let logits = [0.0, 0.5f32.ln(), 0.1f32.ln(), 0.05f32.ln()];
        let params = SamplingParams { temperature: 1.0, min_p: 0.2, seed: 11, ..SamplingParams::greedy() };
        let mut s = Sampler::new(params).unwrap();
        let mut counts = [0usize; 4];
        for _ in 0..30_000 {
            counts[s.sample(&logits) as usize] += 1;
        }
        assert_eq!(counts[2] + counts[3], 0, "{counts:?}");
        let share = counts[1] as f64 / 30_000.0;
        assert!((share - 1.0 / 3.0).abs() < 0.015, "{share}");
        // min-p 1 keeps only the top token; 0 keeps all.
        let mut s = Sampler::new(SamplingParams { temperature: 1.0, min_p: 1.0, ..SamplingParams::greedy() }).unwrap();
        assert!((0..100).all(|_| s.sample(&logits) == 0));
        for bad in [-0.1, 1.5, f32::NAN] {
            assert!(Sampler::new(SamplingParams { min_p: bad, ..SamplingParams::greedy() }).is_err());
        }
    }

    #[test]
    fn repetition_penalty_follows_llama_cpp() {
        // Positive logits of recent tokens are divided, negative ones multiplied.
        assert_eq!(penalize(3.0, 1.5), 2.0);
        assert_eq!(penalize(-3.0, 1.5), -4.5);
        let logits = [2.0, 1.5, -1.0, 0.5];
        let params = SamplingParams { repeat_penalty: 2.0, repeat_last_n: 2, ..SamplingParams::greedy() };
        let mut s = Sampler::new(params.clone()).unwrap();
        assert_eq!(s.sample(&logits), 0, "no history yet");
        s.accept(&[0]);
        assert_eq!(s.sample(&logits), 1, "2.0 / 2 = 1.0 < 1.5");
        s.accept(&[1, 3]); // the window of 2 now holds 1 and 3: id 0 is free again
        assert_eq!(s.sample(&logits), 0);
        // Only the last `repeat_last_n` ids of a long accept count.
        let mut s = Sampler::new(params).unwrap();
        s.accept(&[0, 0, 0, 2, 3]);
        assert_eq!(s.sample(&logits), 0);
        // Off when the penalty is 1 or the window 0: history is not even kept.
        for params in [
            SamplingParams { repeat_penalty: 1.0, repeat_last_n: 64, ..SamplingParams::greedy() },
            SamplingParams { repeat_penalty: 3.0, repeat_last_n: 0, ..SamplingParams::greedy() },
        ] {
            let mut s = Sampler::new(params).unwrap();
            s.accept(&[0]);
            assert_eq!(s.sample(&logits), 0);
            assert!(s.history.is_empty());
        }
        for bad in [0.0, -1.0, f32::NAN, f32::INFINITY] {
            assert!(Sampler::new(SamplingParams { repeat_penalty: bad, ..SamplingParams::greedy() }).is_err());
        }
        // Out-of-range ids in the history are ignored, not a panic.
        let mut s =
            Sampler::new(SamplingParams { repeat_penalty: 2.0, repeat_last_n: 8, ..SamplingParams::greedy() }).unwrap();
        s.accept(&[u32::MAX, 99]);
        assert_eq!(s.sample(&logits), 0);
    }

    /// OpenAI's penalties: `presence` once per generated token, `frequency` per
    /// occurrence; prompt tokens never count; out of [-2, 2] is refused.
    #[test]
    fn presence_and_frequency_penalties_follow_openai() {
        let logits = [2.0, 1.8, 0.0];
        let presence = SamplingParams { presence_penalty: 0.5, ..SamplingParams::greedy() };
        assert!(!presence.is_argmax(), "a penalty needs the logits on the host");
        let mut s = Sampler::new(presence).unwrap();
        s.accept(&[0, 0, 0]); // the prompt: not counted
        assert_eq!(s.sample(&logits), 0);
        s.accept_generated(0); // 2.0 - 0.5 = 1.5 < 1.8
        assert_eq!(s.sample(&logits), 1);
        s.accept_generated(1); // 1.8 - 0.5 = 1.3 < 1.5
        assert_eq!(s.sample(&logits), 0);
        let frequency = SamplingParams { frequency_penalty: 0.15, ..SamplingParams::greedy() };
        let mut s = Sampler::new(frequency).unwrap();
        s.accept_generated(0); // 2.0 - 0.15 = 1.85 > 1.8
        assert_eq!(s.sample(&logits), 0);
        s.accept_generated(0); // 2.0 - 0.3 = 1.7 < 1.8
        assert_eq!(s.sample(&logits), 1);
        // A negative penalty favours repeats.
        let mut s = Sampler::new(SamplingParams { presence_penalty: -2.0, ..SamplingParams::greedy() }).unwrap();
        s.accept_generated(2); // 0.0 + 2.0 = 2.0: ties with token 0, the lower id wins
        assert_eq!(s.sample(&logits), 0);
        s.accept_generated(1); // 1.8 + 2.0 = 3.8
        assert_eq!(s.sample(&logits), 1);
        // OpenAI's penalties come before the repetition penalty (as the server has always
        // applied them): token 0 at -1.0 with both becomes (-1 - 0.5) × 2 = -3 < -2.7;
        // the other order would give -1 × 2 - 0.5 = -2.5 > -2.7.
        let both =
            SamplingParams { presence_penalty: 0.5, repeat_penalty: 2.0, repeat_last_n: 8, ..SamplingParams::greedy() };
        let mut s = Sampler::new(both).unwrap();
        s.accept_generated(0);
        assert_eq!(s.sample(&[-1.0, -2.7]), 1);
        for bad in [2.5, -2.01, f32::NAN, f32::INFINITY] {
            assert!(Sampler::new(SamplingParams { presence_penalty: bad, ..SamplingParams::greedy() }).is_err());
            assert!(Sampler::new(SamplingParams { frequency_penalty: bad, ..SamplingParams::greedy() }).is_err());
        }
    }

    #[test]
    fn the_penalty_applies_when_sampling_too() {
        // Token 0 leads by 1.0 (p = 0.576); a penalty of 100 turns its logit into 0.02:
        // p = e^-0.98 / (e^-0.98 + 2) = 0.158.
        let logits = [2.0, 1.0, 1.0];
        let params = SamplingParams {
            temperature: 1.0,
            repeat_penalty: 100.0,
            repeat_last_n: 4,
            seed: 3,
            ..SamplingParams::greedy()
        };
        let mut s = Sampler::new(params).unwrap();
        s.accept(&[0]);
        let share = (0..4000).filter(|_| s.sample(&logits) == 0).count() as f64 / 4000.0;
        assert!((share - 0.158).abs() < 0.025, "{share}");
    }

    #[test]
    fn cuts_see_the_untempered_distribution() {
        // Relative probabilities at t = 1: 1, 0.5, 0.1. min-p 0.3 keeps ids 0 and 1 whatever
        // the temperature (llama.cpp's order); at t = 10 they are then nearly equal.
        let logits = [0.0, 0.5f32.ln(), 0.1f32.ln()];
        let params = SamplingParams { temperature: 10.0, min_p: 0.3, seed: 5, ..SamplingParams::greedy() };
        let mut s = Sampler::new(params).unwrap();
        let mut counts = [0usize; 3];
        for _ in 0..20_000 {
            counts[s.sample(&logits) as usize] += 1;
        }
        assert_eq!(counts[2], 0, "{counts:?}");
        // Weights 1 and 0.5^(1/10) = 0.933: shares 0.517 and 0.483.
        let share = counts[1] as f64 / 20_000.0;
        assert!((share - 0.933 / 1.933).abs() < 0.015, "{share}");
    }
}

//! Log-probabilities of chosen tokens and their top alternatives, from the model's raw
//! logits: `log_softmax` before any penalty, temperature or cut (what HF's
//! `log_softmax(logits)` gives and what OpenAI-style `logprobs` report), in f64.

/// One generated token's log-probability and the `n` most likely tokens at its step.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub id: u32,
    pub logprob: f64,
    /// The `n` most likely tokens, most likely first (lowest id first on ties).
    pub top: Vec<(u32, f64)>,
}

/// `log_softmax(logits)[chosen]` and the top `n`, for one row of finite logits.
pub fn token_logprobs(logits: &[f32], chosen: u32, n: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let max = f64::from(max);
    let sum: f64 = logits.iter().map(|&v| (f64::from(v) - max).exp()).sum();
    let log_z = max + sum.ln();
    let lp = |v: f32| f64::from(v) - log_z;
    let logprob = logits.get(chosen as usize).map_or(f64::NEG_INFINITY, |&v| lp(v));
    if n == 0 {
        return TokenLogprobs { id: chosen, logprob, top: Vec::new() }; // no ranking needed
    }
    let mut order: Vec<u32> = (0..logits.len() as u32).collect();
    let n = n.min(order.len());
    let desc = |a: &u32, b: &u32| logits[*b as usize].total_cmp(&logits[*a as usize]).then(a.cmp(b));
    if n > 0 && n < order.len() {
        order.select_nth_unstable_by(n - 1, desc);
    }
    order.truncate(n);
    order.sort_unstable_by(desc);
    TokenLogprobs { id: chosen, logprob, top: order.into_iter().map(|i| (i, lp(logits[i as usize]))).collect() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_softmax_of_a_known_distribution() {
        // softmax([0, ln 3]) = [0.25, 0.75].
        let t = token_logprobs(&[0.0, 3f32.ln()], 0, 2);
        assert!((t.logprob - 0.25f64.ln()).abs() < 1e-7);
        assert_eq!(t.top.iter().map(|x| x.0).collect::<Vec<_>>(), [1, 0]);
        assert!((t.top[0].1 - 0.75f64.ln()).abs() < 1e-7);
        // Large logits do not overflow; ties list the lower id first; n beyond V is V.
        let t = token_logprobs(&[1000.0, 1000.0, -1000.0], 2, 10); // exp(1000) overflows f64
        assert_eq!(t.top.len(), 3);
        assert_eq!((t.top[0].0, t.top[1].0), (0, 1));
        assert!((t.top[0].1 - 0.5f64.ln()).abs() < 1e-9);
        assert_eq!(token_logprobs(&[1.0, 2.0], 1, 0).top, []);
    }
}

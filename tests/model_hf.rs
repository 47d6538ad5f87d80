//! Whole-model checks against HF transformers: greedy continuations, full logits,
//! top-10 logits at every position, KV-cache consistency, batched sequences.

mod common;

use batch_forge::compare::max_abs_diff;

use batch_forge::backend::{Backend, SeqSlice};
use batch_forge::engine::{GenerateParams, StopReason};
use batch_forge::model::{Batch, LogitRows};
use common::*;

#[test]
fn greedy_ids_match_hf_for_every_checkpoint_and_prompt() {
    for ckpt in CHECKPOINTS {
        let engine = engine(ckpt);
        let reference = reference(ckpt);
        for p in reference["prompts"].as_array().unwrap() {
            let text = p["text"].as_str().unwrap();
            let prompt_ids = ids(&p["prompt_ids"]);
            let tok = &engine.text.tokenizer;
            let encoded = if text.is_empty() { vec![50256] } else { tok.encode(text) };
            assert_eq!(encoded, prompt_ids, "{ckpt}: prompt ids of {text:?}");
            let params = GenerateParams::greedy(40);
            let g = engine.generate(&prompt_ids, &params, |_| Ok(())).unwrap();
            let want = ids(&p["generated_ids"]);
            assert_eq!(g.generated_ids, want, "{ckpt}: greedy continuation of {text:?}");
            if want.len() < 40 {
                assert_eq!(g.stop, StopReason::ContextFull, "{ckpt}: {text:?} should stop at the context");
            }
            assert_eq!(tok.decode(&g.generated_ids).unwrap(), p["generated_text"].as_str().unwrap());
        }
    }
}

#[test]
fn full_logits_match_hf_within_tolerance() {
    let mut worst = 0f32;
    for ckpt in CHECKPOINTS {
        let err = max_logit_error(&engine(ckpt), ckpt);
        assert!(err < LOGIT_TOL, "{ckpt}: max abs logit error {err:e}");
        worst = worst.max(err);
    }
    eprintln!("max abs logit error vs HF (full logits): {worst:e}");
}

#[test]
fn top10_logits_match_hf_at_every_position() {
    let mut worst = 0f32;
    for ckpt in CHECKPOINTS {
        let engine = engine(ckpt);
        for p in reference(ckpt)["prompts"].as_array().unwrap() {
            let mut seq = ids(&p["prompt_ids"]);
            seq.extend(ids(&p["generated_ids"]));
            let n_ctx = engine.model.info().context_length;
            seq.truncate(n_ctx);
            let logits = engine.logits_all(&seq).unwrap();
            for entry in p["top10"].as_array().unwrap() {
                let pos = entry["position"].as_u64().unwrap() as usize;
                if pos >= seq.len() {
                    continue;
                }
                let row = logits.row(pos);
                for (id, want) in ids(&entry["ids"]).iter().zip(entry["logits"].as_array().unwrap()) {
                    let err = (row[*id as usize] - want.as_f64().unwrap() as f32).abs();
                    assert!(err < LOGIT_TOL, "{ckpt} pos {pos} id {id}: error {err:e}");
                    worst = worst.max(err);
                }
                // The reference's best id is within tolerance of our best logit.
                assert!(row.iter().all(|v| v.is_finite()), "{ckpt} pos {pos}: non-finite logits");
                let best = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                assert!(best - row[ids(&entry["ids"])[0] as usize] < LOGIT_TOL, "{ckpt} pos {pos}: argmax differs");
            }
        }
    }
    eprintln!("max abs logit error vs HF (top-10, all positions): {worst:e}");
}

/// Prefill then one-token steps through the cache must equal one full pass.
#[test]
fn kv_cached_decoding_matches_full_recompute() {
    for ckpt in CHECKPOINTS {
        let engine = engine(ckpt);
        let p = &reference(ckpt)["prompts"][3];
        let mut seq = ids(&p["prompt_ids"]);
        seq.extend(ids(&p["generated_ids"]));
        seq.truncate(engine.model.info().context_length);
        let full = engine.logits_all(&seq).unwrap();
        let (b, m) = (&engine.backend, &engine.model);
        let mut cache = m.new_cache(b, seq.len()).unwrap();
        let split = 5;
        let mut worst = 0f32;
        let mut start = 0;
        for end in std::iter::once(split).chain(split + 1..=seq.len()) {
            let seqs = [SeqSlice { rows: 0..end - start, start_pos: start }];
            let out = m
                .forward(
                    b,
                    &Batch { tokens: &seq[start..end], seqs: &seqs },
                    &mut [&mut cache],
                    LogitRows::LastOfEachSeq,
                )
                .unwrap();
            let out = b.read(&out).unwrap();
            worst = nan_max(worst, max_abs_diff(out.row(0), full.row(end - 1)));
            start = end;
        }
        assert!(worst < 2e-5, "{ckpt}: cached vs full differ by {worst:e}");
    }
}

/// Several sequences at different positions in one forward call give the same logits
/// as each run alone: the batching seam the server will use.
#[test]
fn batched_sequences_match_separate_runs() {
    let engine = engine("tiny-gpt2");
    let (b, m) = (&engine.backend, &engine.model);
    let a: Vec<u32> = vec![464, 2068, 7586, 21831, 18045];
    let c: Vec<u32> = vec![15496, 11, 995];
    let mut cache_a = m.new_cache(b, 16).unwrap();
    let mut cache_c = m.new_cache(b, 16).unwrap();
    // Prefill `a` alone; then one batch: decode a's next token + prefill all of `c`.
    let seqs = [SeqSlice { rows: 0..4, start_pos: 0 }];
    m.forward(b, &Batch { tokens: &a[..4], seqs: &seqs }, &mut [&mut cache_a], LogitRows::LastOfEachSeq).unwrap();
    let tokens: Vec<u32> = std::iter::once(a[4]).chain(c.iter().copied()).collect();
    let seqs = [SeqSlice { rows: 0..1, start_pos: 4 }, SeqSlice { rows: 1..4, start_pos: 0 }];
    let out = m
        .forward(
            b,
            &Batch { tokens: &tokens, seqs: &seqs },
            &mut [&mut cache_a, &mut cache_c],
            LogitRows::LastOfEachSeq,
        )
        .unwrap();
    let out = b.read(&out).unwrap();
    let full_a = engine.logits_all(&a).unwrap();
    let full_c = engine.logits_all(&c).unwrap();
    let close = |x: &[f32], y: &[f32]| max_abs_diff(x, y) < 2e-5;
    assert!(close(out.row(0), full_a.row(4)));
    assert!(close(out.row(1), full_c.row(2)));
}

#[test]
fn bad_token_ids_and_overlong_prompts_are_errors() {
    let engine = engine("tiny-gpt2-hf-saved"); // n_positions 64
    let params = GenerateParams::greedy(5);
    let e = engine.generate(&[1, 50257], &params, |_| Ok(())).unwrap_err().to_string();
    assert!(e.contains("token id 50257 is out of range"), "{e}");
    let e = engine.generate(&vec![1; 65], &params, |_| Ok(())).unwrap_err().to_string();
    assert!(e.contains("65 tokens") && e.contains("context is 64"), "{e}");
    let e = engine.generate(&[], &params, |_| Ok(())).unwrap_err().to_string();
    assert!(e.contains("empty"), "{e}");
    // Exactly at the context: nothing more fits.
    let g = engine.generate(&vec![1; 64], &params, |_| Ok(())).unwrap();
    assert!(g.generated_ids.is_empty());
    assert_eq!(g.stop, StopReason::ContextFull);
    assert!(engine.text.tokenizer.decode(&[60000]).is_err());
}

//! The fast CPU backend on whole models: HF's greedy ids and logits, in f32 exactly as
//! the reference; and what 16-bit weights and an f16 KV cache do to the error.

mod common;

use batch_forge::backend::cpu::{CpuOptions, Isa, WeightDtype};
use common::*;

fn opts(weight_dtype: Option<WeightDtype>, kv_f16: bool, isa: Isa) -> CpuOptions {
    CpuOptions { weight_dtype, kv_f16, isa }
}

#[test]
fn f32_matches_hf_greedy_ids_and_logits_on_every_checkpoint() {
    for isa in [Isa::detect(), Isa::Portable] {
        for ckpt in ["tiny-gpt2", "tiny-gpt2-hf-saved"] {
            let e = cpu_engine(ckpt, opts(Some(WeightDtype::F32), false, isa));
            assert_eq!(greedy_matches(&e, ckpt), (8, 8), "{ckpt} {isa:?}");
            let err = max_logit_error(&e, ckpt);
            assert!(err < LOGIT_TOL, "{ckpt} {isa:?}: max abs logit error {err:e}");
            eprintln!("cpu {isa:?} f32 {ckpt}: max abs logit error vs HF {err:e}");
        }
    }
}

/// The f16 checkpoint kept as f16 in memory: the weights are exact, so everything holds.
#[test]
fn f16_checkpoint_kept_as_f16_matches_hf() {
    let ckpt = "tiny-gpt2-f16";
    let e = cpu_engine(ckpt, opts(None, false, Isa::detect()));
    assert_eq!(greedy_matches(&e, ckpt), (8, 8));
    let err = max_logit_error(&e, ckpt);
    assert!(err < LOGIT_TOL, "max abs logit error {err:e}");
    eprintln!("cpu f16-stored weights kept f16: max abs logit error vs HF {err:e}");
}

/// Converting f32 weights to 16 bits or storing the KV cache in f16 is lossy. These
/// bounds are the measured errors with about 2x headroom, so a regression (a wrong
/// rounding mode, a conversion bug) fails; the notes report the numbers.
#[test]
fn lossy_formats_stay_within_measured_bounds() {
    let ckpt = "tiny-gpt2";
    for (label, o, max_err, min_greedy) in [
        ("f16 weights", opts(Some(WeightDtype::F16), false, Isa::detect()), 0.012, 7),
        ("bf16 weights", opts(Some(WeightDtype::BF16), false, Isa::detect()), 0.08, 5),
        ("f16 KV cache", opts(Some(WeightDtype::F32), true, Isa::detect()), 0.006, 7),
    ] {
        let e = cpu_engine(ckpt, o);
        let err = max_logit_error(&e, ckpt);
        let (ok, n) = greedy_matches(&e, ckpt);
        eprintln!(
            "cpu {label} on {ckpt}: max abs logit error vs HF {err:.3e}, greedy continuations equal to HF: {ok}/{n}"
        );
        assert!(err < max_err, "{label}: {err:e}");
        assert!(ok >= min_greedy, "{label}: {ok}/{n}");
    }
}

//! The fast CPU backend on whole models: HF's greedy ids and logits, in f32 exactly as
//! the reference; and what 16-bit weights and an f16 KV cache do to the error.

mod common;

use batch_forge::backend::WeightDtype;
use batch_forge::backend::cpu::simd::isas_or_skip;
use batch_forge::backend::cpu::{CpuOptions, Isa};
use batch_forge::engine::Engine;
use batch_forge::tensor::KvDtype;
use common::*;

fn opts(weight_dtype: Option<WeightDtype>, kv_f16: bool, isa: Isa) -> CpuOptions {
    CpuOptions { weight_dtype, kv_dtype: if kv_f16 { KvDtype::F16 } else { KvDtype::F32 }, isa, batch_invariant: false }
}

#[test]
fn f32_matches_hf_greedy_ids_and_logits_on_every_checkpoint() {
    let isas = isas_or_skip();
    for isa in isas {
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

/// Converting f32 weights to 16 bits or storing the KV cache in f16 is lossy, so HF's
/// logits are no yardstick for the kernels. The yardstick is the reference backend fed
/// the same rounded weights and keys/values: the cpu backend must then agree with it
/// (f32 tolerance for rounded weights; see `lossy_tolerance` for the f16 KV cache and for
/// the bf16-rounded activations of the AVX512-BF16 path) and
/// give the same greedy ids. (The error against HF, which the rounding alone causes, is
/// printed for the notes.)
#[test]
fn lossy_formats_match_the_reference_fed_the_same_rounded_values() {
    let ckpt = "tiny-gpt2";
    let isas = isas_or_skip();
    for (isa, (label, o, rounded)) in isas.iter().flat_map(|&isa| {
        [
            ("f16 weights", opts(Some(WeightDtype::F16), false, isa), RoundedReference::new(WeightDtype::F16, false)),
            (
                "bf16 weights",
                opts(Some(WeightDtype::BF16), false, isa),
                RoundedReference {
                    bf16_activations: isa.has_bf16(),
                    ..RoundedReference::new(WeightDtype::BF16, false)
                },
            ),
            ("f16 KV cache", opts(Some(WeightDtype::F32), true, isa), RoundedReference::new(WeightDtype::F32, true)),
            (
                "f16 weights + f16 KV",
                opts(Some(WeightDtype::F16), true, isa),
                RoundedReference::new(WeightDtype::F16, true),
            ),
        ]
        .map(|case| (isa, case))
    }) {
        let e = cpu_engine(ckpt, o);
        let r = Engine::load(rounded, &fixture(ckpt)).unwrap();
        let tol = lossy_tolerance(&rounded, ckpt);
        let err = max_logit_diff(&e, &r, ckpt);
        let (ok, n) = greedy_agreement(&e, &r, ckpt);
        eprintln!(
            "cpu {isa:?} {label} on {ckpt}: max abs logit diff vs the rounded reference {err:.3e} (tolerance {tol:.1e}), \
             greedy equal {ok}/{n}; \
             vs HF {:.3e}, greedy equal to HF {:?}",
            max_logit_error(&e, ckpt),
            greedy_matches(&e, ckpt)
        );
        assert!(err < tol, "{isa:?} {label}: {err:e} (tolerance {tol:e})");
        assert_eq!((ok, n), (8, 8), "{isa:?} {label}");
    }
}

/// The comparison above bites: f16 weights against a reference that did not round them
/// (or rounded to bf16) fail the f32 tolerance, an f16 KV cache against a reference
/// that rounded nothing fails the f16-KV tolerance, and `vdpbf16ps` products against a
/// reference that keeps activations in f32 fail theirs.
#[test]
fn lossy_comparison_detects_the_wrong_rounding() {
    let ckpt = "tiny-gpt2";
    let kv = cpu_engine(ckpt, opts(Some(WeightDtype::F32), true, Isa::detect()));
    let tol = lossy_tolerance(&RoundedReference::new(WeightDtype::F32, true), ckpt);
    let unrounded = Engine::load(RoundedReference::new(WeightDtype::F32, false), &fixture(ckpt)).unwrap();
    let err = max_logit_diff(&kv, &unrounded, ckpt);
    assert!(err > tol, "f16 KV vs an unrounded reference differ by only {err:e} (tolerance {tol:e})");

    let ckpt = "tiny-gpt2";
    let e = cpu_engine(ckpt, opts(Some(WeightDtype::F16), false, Isa::detect()));
    for wrong in [WeightDtype::F32, WeightDtype::BF16] {
        let r = batch_forge::engine::Engine::load(RoundedReference::new(wrong, false), &fixture(ckpt)).unwrap();
        let err = max_logit_diff(&e, &r, ckpt);
        assert!(err > 10.0 * LOGIT_TOL, "f16 weights vs {wrong:?}-rounded reference differ by only {err:e}");
    }

    // bf16 weights on the AVX512-BF16 path against a reference that keeps the activations
    // in f32: beyond the tolerance its bf16-activation twin is held to.
    if let Some(isa) = batch_forge::backend::cpu::simd::avx512_bf16_or_skip() {
        let e = cpu_engine(ckpt, opts(Some(WeightDtype::BF16), false, isa));
        let rounded = RoundedReference { bf16_activations: true, ..RoundedReference::new(WeightDtype::BF16, false) };
        let tol = lossy_tolerance(&rounded, ckpt);
        let r = Engine::load(RoundedReference::new(WeightDtype::BF16, false), &fixture(ckpt)).unwrap();
        let err = max_logit_diff(&e, &r, ckpt);
        assert!(
            err > tol,
            "bf16 products vs a reference with f32 activations differ by only {err:e} (tolerance {tol:e})"
        );
    }
}

//! The GPU backend on whole models: HF's greedy ids exactly and HF's logits within the
//! same tolerance as the CPU backends, on every fixture checkpoint.
#![cfg(feature = "gpu")]

mod common;

use batch_forge::backend::WeightDtype;
use batch_forge::backend::gpu::GpuOptions;
use batch_forge::engine::Engine;
use batch_forge::tensor::KvDtype;
use common::*;

#[test]
fn gpu_matches_hf_greedy_ids_and_logits_on_every_checkpoint() {
    // f32 checkpoints in f32; the f16 checkpoint kept in f16 when the adapter can (its
    // weights are then exact, so the f32 tolerance still holds).
    for ckpt in CHECKPOINTS {
        let Some(b) = gpu_backend(GpuOptions::default()) else { return };
        let e = Engine::load(b, &fixture(ckpt)).unwrap();
        assert_eq!(greedy_matches(&e, ckpt), (8, 8), "{ckpt}");
        let err = max_logit_error(&e, ckpt);
        eprintln!("gpu {ckpt}: greedy 8/8, max abs logit error vs HF {err:e}");
        assert!(err < LOGIT_TOL, "{ckpt}: max abs logit error {err:e}");
    }
}

/// f16 weights and the f16 KV cache on the GPU: lossy, so compared with the reference
/// fed the same rounded values, at the f32 tolerance, and with the same greedy ids.
#[test]
fn gpu_lossy_formats_match_the_reference_fed_the_same_rounded_values() {
    let ckpt = "tiny-gpt2";
    let Some(probe) = gpu_backend(GpuOptions::default()) else { return };
    if !gpu_f16_or_skip(&probe, "f16 weights and KV cache on whole models") {
        return;
    }
    drop(probe);
    for (label, weights, kv_f16) in [
        ("f16 weights", WeightDtype::F16, false),
        ("f16 KV cache", WeightDtype::F32, true),
        ("f16 weights + f16 KV", WeightDtype::F16, true),
    ] {
        let o = GpuOptions {
            weight_dtype: Some(weights),
            kv_dtype: if kv_f16 { KvDtype::F16 } else { KvDtype::F32 },
            ..Default::default()
        };
        let e = Engine::load(gpu_backend(o).unwrap(), &fixture(ckpt)).unwrap();
        let rounded = RoundedReference::new(weights, kv_f16);
        let r = Engine::load(rounded, &fixture(ckpt)).unwrap();
        let tol = lossy_tolerance(&rounded, ckpt);
        let err = max_logit_diff(&e, &r, ckpt);
        let (ok, n) = greedy_agreement(&e, &r, ckpt);
        eprintln!(
            "gpu {label} on {ckpt}: max abs logit diff vs the rounded reference {err:.3e} (tolerance {tol:.1e}), \
             greedy equal {ok}/{n}; \
             vs HF {:.3e}",
            max_logit_error(&e, ckpt)
        );
        assert!(err < tol, "{label}: {err:e} (tolerance {tol:e})");
        assert_eq!((ok, n), (8, 8), "{label}");
    }
}

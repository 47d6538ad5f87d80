//! The GPU backend on whole models: HF's greedy ids exactly and HF's logits within the
//! same tolerance as the CPU backends, on every fixture checkpoint.
#![cfg(feature = "gpu")]

mod common;

use batch_forge::backend::cpu::WeightDtype;
use batch_forge::backend::gpu::GpuOptions;
use batch_forge::engine::Engine;
use common::*;

#[test]
fn gpu_matches_hf_greedy_ids_and_logits_on_every_checkpoint() {
    // f32 checkpoints in f32; the f16 checkpoint kept in f16 when the adapter can (its
    // weights are then exact, so the f32 tolerance still holds).
    for ckpt in CHECKPOINTS {
        let Some(b) = gpu_backend(GpuOptions::default()) else { return };
        let e = Engine::load_dir(b, &fixture(ckpt)).unwrap();
        assert_eq!(greedy_matches(&e, ckpt), (8, 8), "{ckpt}");
        let err = max_logit_error(&e, ckpt);
        eprintln!("gpu {ckpt}: greedy 8/8, max abs logit error vs HF {err:e}");
        assert!(err < LOGIT_TOL, "{ckpt}: max abs logit error {err:e}");
    }
}

/// f32 weights converted to f16 on the GPU: lossy, bounded like the CPU's f16 weights.
#[test]
fn gpu_f16_weights_stay_within_measured_bounds() {
    let ckpt = "tiny-gpt2";
    let Some(b) = gpu_backend(GpuOptions { weight_dtype: Some(WeightDtype::F16), ..Default::default() }) else {
        return;
    };
    if !b.has_f16() {
        eprintln!("SKIPPED: no shader-f16 on {}", b.description());
        return;
    }
    let e = Engine::load_dir(b, &fixture(ckpt)).unwrap();
    let err = max_logit_error(&e, ckpt);
    let (ok, n) = greedy_matches(&e, ckpt);
    eprintln!("gpu f16 weights on {ckpt}: max abs logit error vs HF {err:.3e}, greedy equal to HF: {ok}/{n}");
    assert!(err < 0.012, "{err:e}");
    assert!(ok >= 7, "{ok}/{n}");
}

/// The f16 KV cache on the GPU: lossy, bounded like the CPU's f16 KV cache (3.0e-3 there).
#[test]
fn gpu_f16_kv_cache_stays_within_measured_bounds() {
    let ckpt = "tiny-gpt2";
    if gpu_has_f16() != Some(true) {
        eprintln!("SKIPPED: no adapter with shader-f16");
        return;
    }
    let opts = GpuOptions { weight_dtype: Some(WeightDtype::F32), kv_f16: true, ..Default::default() };
    let e = Engine::load_dir(gpu_backend(opts).unwrap(), &fixture(ckpt)).unwrap();
    let err = max_logit_error(&e, ckpt);
    let (ok, n) = greedy_matches(&e, ckpt);
    eprintln!("gpu f16 KV cache on {ckpt}: max abs logit error vs HF {err:.3e}, greedy equal to HF: {ok}/{n}");
    assert!(err < 0.006, "{err:e}");
    assert!(ok >= 7, "{ok}/{n}");
}

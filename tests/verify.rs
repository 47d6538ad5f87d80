//! `forge verify` and `--logprobs` against HF transformers' stage-by-stage dumps
//! (`tests/fixtures/*/verify.safetensors`, written by `scripts/hf_reference.py` in float64).

mod common;

use std::process::{Command, Output};

use batch_forge::backend::Backend;
use batch_forge::backend::cpu::CpuOptions;
use batch_forge::backend::reference::ReferenceBackend;
use batch_forge::engine::Engine;
use batch_forge::engine::logprobs::token_logprobs;
use batch_forge::loaders::safetensors::{OwnedTensor, SafetensorsFile, serialize};
use batch_forge::model::Stage;
use batch_forge::verify::{Reference, Verification, tolerance, verify};
use common::*;
use serde_json::Value;

fn reference_of(checkpoint: &str) -> Reference {
    Reference::open(&fixture(checkpoint).join("verify.safetensors")).unwrap()
}

fn run_verify<B: Backend>(engine: &Engine<B>, reference: &Reference, tol: f64) -> Verification {
    verify(&engine.backend, engine.model.as_ref(), reference, tol, |s| engine.prompt_ids(s)).unwrap()
}

fn forge(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_forge")).args(args).env("HF_HUB_OFFLINE", "1").output().unwrap()
}

/// `forge verify --backend all --json` with extra flags.
fn verify_all_json(model: &std::path::Path, reference: &std::path::Path, flags: &[&str]) -> Output {
    let base = [
        "verify",
        "-m",
        model.to_str().unwrap(),
        "--reference",
        reference.to_str().unwrap(),
        "--backend",
        "all",
        "--json",
    ];
    forge(&[&base[..], flags].concat())
}

/// Add `delta` to element `index` of tensor `name` in a copied checkpoint.
fn perturb(dir: &std::path::Path, name: &str, index: usize, delta: f32) {
    let path = dir.join("model.safetensors");
    let file = SafetensorsFile::open(&path).unwrap();
    let mut found = false;
    let tensors: Vec<OwnedTensor> = file
        .names()
        .map(|n| {
            let t = file.get(n).unwrap();
            let mut bytes = t.bytes.to_vec();
            if n == name {
                let v = f32::from_le_bytes(bytes[index * 4..index * 4 + 4].try_into().unwrap());
                bytes[index * 4..index * 4 + 4].copy_from_slice(&(v + delta).to_le_bytes());
                found = true;
            }
            OwnedTensor { name: n.to_owned(), dtype: t.dtype, shape: t.shape.to_vec(), bytes }
        })
        .collect();
    assert!(found, "{name} not in the checkpoint");
    let out = serialize(&tensors, file.metadata());
    drop(file);
    std::fs::write(&path, out).unwrap();
}

/// Every fixture passes on the reference backend and on the cpu backend with each ISA,
/// at the f32 tolerance, with HF's token ids and HF's argmax at every position.
#[test]
fn every_fixture_passes_on_reference_and_cpu() {
    for checkpoint in CHECKPOINTS {
        let reference = reference_of(checkpoint);
        let mut runs = vec![("reference".to_owned(), run_verify(&engine(checkpoint), &reference, tolerance::F32))];
        for isa in batch_forge::backend::cpu::simd::isas_or_skip() {
            let e = cpu_engine(checkpoint, CpuOptions { isa, ..CpuOptions::default() });
            runs.push((format!("cpu {}", isa.name()), run_verify(&e, &reference, tolerance::F32)));
        }
        for (name, v) in runs {
            assert!(v.first_failure().is_none(), "{checkpoint} {name}: {:?}", v.first_failure());
            assert_eq!(v.tokens_equal, reference.prompts.len(), "{checkpoint} {name}");
            assert_eq!(v.stages.len(), reference.prompts[0].stages.len());
            let logits = v.stages.last().unwrap();
            assert_eq!(logits.stage, Stage::Logits);
            let (agree, total) = logits.argmax.unwrap();
            assert_eq!(agree, total, "{checkpoint} {name}");
            assert!(v.stages.iter().all(|s| s.max_rel < 5e-6), "{checkpoint} {name}: {:?}", v.stages);
        }
    }
}

/// One changed weight in block 1 fails at block 1: the embeddings and block 0 still pass.
#[test]
fn a_perturbed_weight_fails_at_its_block() {
    for (checkpoint, tensor, block) in [
        ("tiny-gpt2", "h.1.mlp.c_fc.weight", 1),
        ("tiny-gpt2-hf-saved", "transformer.h.2.attn.c_attn.weight", 2),
        ("tiny-gpt2", "h.0.ln_2.weight", 0),
    ] {
        let (_tmp, dir) = fixture_copy(checkpoint);
        perturb(&dir, tensor, 5, 0.5);
        let reference = reference_of(checkpoint);
        let e = Engine::load(ReferenceBackend, &dir).unwrap();
        let v = run_verify(&e, &reference, tolerance::F32);
        let fail = v.first_failure().unwrap_or_else(|| panic!("{checkpoint} {tensor}: no failure"));
        assert_eq!(fail.stage, Stage::Block(block), "{checkpoint} {tensor}: {:?}", v.stages);
        assert_eq!(v.stages.len(), block + 2, "stops at the failing stage");
        assert!(v.stages[..block + 1].iter().all(|s| s.ok()));
        assert!(fail.max_rel > 100.0 * tolerance::F32, "{}", fail.max_rel);
        // Through the CLI on every backend present, at f32 and at the lossy dtypes whose
        // rounding stays below the perturbation: each fails at the block, on its own.
        let r = fixture(checkpoint).join("verify.safetensors");
        for flags in [vec![], vec!["--dtype", "f16"], vec!["--kv-dtype", "f16"]] {
            let o = verify_all_json(&dir, &r, &flags);
            let err = String::from_utf8_lossy(&o.stderr);
            assert!(
                !o.status.success() && err.contains(&format!("block {block} is beyond its tolerance")),
                "{flags:?}: {err}"
            );
            let v: Value = serde_json::from_slice(&o.stdout).unwrap();
            for b in v["backends"].as_array().unwrap().iter().filter(|b| b.get("stages").is_some()) {
                let stages = b["stages"].as_array().unwrap();
                let last = stages.last().unwrap();
                assert_eq!(
                    (last["stage"].as_str(), last["ok"].as_bool()),
                    (Some(format!("block {block}").as_str()), Some(false)),
                    "{flags:?} {b}"
                );
                assert!(stages[..stages.len() - 1].iter().all(|s| s["ok"] == true), "{flags:?} {b}");
            }
        }
        let o = forge(&[
            "verify",
            "-m",
            dir.to_str().unwrap(),
            "--reference",
            r.to_str().unwrap(),
            "--backend",
            "reference",
        ]);
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(out.contains(&format!("| block {block} |")) && out.contains("FAIL"), "{out}");
    }
}

/// A reference made from another model fails: at the embeddings when the shapes agree,
/// up front when they do not; a file that is no reference is a clear error.
#[test]
fn a_reference_from_another_model_fails() {
    let e = engine("tiny-gpt2");
    let v = run_verify(&e, &reference_of("tiny-gpt2-f16"), tolerance::F32);
    assert_eq!(v.first_failure().map(|s| s.stage), Some(Stage::Embeddings));
    let err =
        verify(&e.backend, e.model.as_ref(), &reference_of("tiny-gpt2-hf-saved"), tolerance::F32, |s| e.prompt_ids(s))
            .err()
            .unwrap();
    assert!(format!("{err:#}").contains("3 blocks but the model has 2"), "{err:#}");
    let o = forge(&[
        "verify",
        "-m",
        fixture("tiny-gpt2").to_str().unwrap(),
        "--reference",
        fixture("tiny-gpt2/model.safetensors").to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("no \"n_layer\" in the metadata"), "{err}");
}

/// The CLI on every backend present, every dtype: the tables and the JSON agree, and
/// each lossy dtype stays within its stated tolerance (and above the f32 one: the
/// rounding is real).
#[test]
fn cli_verifies_every_backend_and_dtype() {
    for checkpoint in CHECKPOINTS {
        let m = fixture(checkpoint);
        let r = m.join("verify.safetensors");
        for (flags, lossy) in [
            (vec![], false),
            (vec!["--dtype", "f16"], checkpoint != "tiny-gpt2-f16"),
            (vec!["--dtype", "bf16"], true),
            (vec!["--kv-dtype", "f16"], true),
        ] {
            let o = verify_all_json(&m, &r, &flags);
            assert!(o.status.success(), "{checkpoint} {flags:?}: {}", String::from_utf8_lossy(&o.stderr));
            let v: Value = serde_json::from_slice(&o.stdout).unwrap();
            assert_eq!(v["ok"], true);
            for b in v["backends"].as_array().unwrap() {
                if let Some(why) = b["skipped"].as_str() {
                    // Only the gpu may be skipped: for bf16 always, otherwise not in CI.
                    let allowed = why.contains("bf16 is cpu-only") || !in_ci();
                    assert!(b["backend"] == "gpu" && allowed, "{checkpoint} {flags:?}: {b}");
                    continue;
                }
                let worst = b["stages"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|s| s["max_rel_error"].as_f64().unwrap())
                    .fold(0f64, f64::max);
                let lossy_here = lossy && b["backend"] != "reference";
                assert_eq!(worst > tolerance::F32, lossy_here, "{checkpoint} {flags:?} {}: {worst}", b["backend"]);
            }
        }
    }
}

/// `--logprobs` gives HF's log_softmax: at every position of every dump prompt, the top
/// 20 ids and their logprobs (torch's, from float64 logits) within 1e-4; and through the
/// CLI for the first generated token.
#[test]
fn logprobs_match_hf_log_softmax() {
    for checkpoint in CHECKPOINTS {
        let reference = reference_of(checkpoint);
        let e = cpu_engine(checkpoint, CpuOptions::default());
        let mut worst = 0f64;
        for p in &reference.prompts {
            let logits = e.logits_all(&p.ids).unwrap();
            for (pos, (ids, lps)) in p.top_ids.iter().zip(&p.top_logprobs).enumerate() {
                let ours = token_logprobs(logits.row(pos), ids[0], ids.len());
                // Ties within float noise may order differently: compare as id → logprob.
                for (id, lp) in ids.iter().zip(lps) {
                    let mine = token_logprobs(logits.row(pos), *id, 0).logprob;
                    worst = worst.max((mine - f64::from(*lp)).abs());
                }
                assert_eq!(ours.top[0].0, ids[0], "{checkpoint} position {pos}");
            }
        }
        assert!(worst < 1e-4, "{checkpoint}: {worst}");
        let p = &reference.prompts[0]; // "Hello"
        let o = forge(&[
            "generate",
            "-m",
            fixture(checkpoint).to_str().unwrap(),
            "-p",
            &p.text,
            "-n",
            "1",
            "--temp",
            "0",
            "--json",
            "--logprobs",
            "5",
        ]);
        let v: Value = serde_json::from_slice(&o.stdout).unwrap();
        let lp = &v["logprobs"][0];
        let last = p.ids.len() - 1;
        assert_eq!(lp["id"].as_u64().unwrap() as u32, p.top_ids[last][0]);
        assert!((lp["logprob"].as_f64().unwrap() - f64::from(p.top_logprobs[last][0])).abs() < 1e-4, "{lp}");
        let top = lp["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 5);
        for (t, want) in top.iter().zip(&p.top_logprobs[last]) {
            assert!((t["logprob"].as_f64().unwrap() - f64::from(*want)).abs() < 1e-4, "{t}");
        }
        assert_eq!(top[0]["text"], e.text.tokenizer.decode(&[p.top_ids[last][0]]).unwrap());
    }
    // --logprobs needs --json; more than 20 is refused.
    let m = fixture("tiny-gpt2");
    let o = forge(&["generate", "-m", m.to_str().unwrap(), "-p", "hi", "--logprobs", "3"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("--json"));
    let o = forge(&["generate", "-m", m.to_str().unwrap(), "-p", "hi", "--json", "--logprobs", "21"]);
    assert!(!o.status.success() && String::from_utf8_lossy(&o.stderr).contains("21"));
}

/// A dump that is malformed or says something else than it holds is a clear error (or,
/// for NaN values, a failure), never a panic.
#[test]
fn hostile_reference_dumps_are_errors() {
    use std::collections::BTreeMap;
    let src = SafetensorsFile::open(&fixture("tiny-gpt2/verify.safetensors")).unwrap();
    let base: Vec<OwnedTensor> = src
        .names()
        .map(|n| {
            let t = src.get(n).unwrap();
            OwnedTensor { name: n.to_owned(), dtype: t.dtype, shape: t.shape.to_vec(), bytes: t.bytes.to_vec() }
        })
        .collect();
    let meta = src.metadata().clone();
    let tmp = tempfile::tempdir().unwrap();
    let write = |tensors: &[OwnedTensor], meta: &BTreeMap<String, String>| {
        let path = tmp.path().join("ref.safetensors");
        std::fs::write(&path, serialize(tensors, meta)).unwrap();
        path
    };
    let edit = |name: &str, f: &dyn Fn(&mut OwnedTensor)| {
        let mut ts = base.clone();
        f(ts.iter_mut().find(|t| t.name == name).unwrap());
        ts
    };
    let with_meta = |k: &str, v: &str| {
        let mut m = meta.clone();
        m.insert(k.into(), v.into());
        m
    };
    let drop_name = |name: &str| base.iter().filter(|t| t.name != name).cloned().collect::<Vec<_>>();
    let cases: Vec<(Vec<OwnedTensor>, BTreeMap<String, String>, &str)> = vec![
        (base.clone(), with_meta("n_layer", "many"), "n_layer is not a number"),
        (base.clone(), with_meta("n_layer", "99999999999"), "absurd"),
        (base.clone(), with_meta("n_prompts", "5"), "lists 4 prompts but n_prompts is 5"),
        (base.clone(), with_meta("prompts", "{"), "not a JSON list"),
        (drop_name("p1.block.0"), meta.clone(), "no tensor \"p1.block.0\""),
        (
            edit("p0.input_ids", &|t| t.bytes[..8].copy_from_slice(&(-3i64).to_le_bytes())),
            meta.clone(),
            "not a token id",
        ),
        (edit("p2.logits", &|t| t.dtype = batch_forge::loaders::safetensors::Dtype::I32), meta.clone(), "expected F32"),
        (edit("p1.top_ids", &|t| t.shape = vec![t.shape[0] * t.shape[1]]), meta.clone(), "do not match"),
    ];
    for (tensors, meta, want) in cases {
        let path = write(&tensors, &meta);
        let err = Reference::open(&path).err().unwrap_or_else(|| panic!("{want}: accepted"));
        assert!(format!("{err:#}").contains(want), "{want}: {err:#}");
    }
    // A NaN in HF's numbers fails that stage (a NaN never passes a tolerance).
    let mut ts = base.clone();
    let t = ts.iter_mut().find(|t| t.name == "p3.block.1").unwrap();
    t.bytes[8..12].copy_from_slice(&f32::NAN.to_le_bytes());
    let path = write(&ts, &meta);
    let v = run_verify(&engine("tiny-gpt2"), &Reference::open(&path).unwrap(), tolerance::F32);
    let fail = v.first_failure().unwrap();
    assert_eq!((fail.stage, fail.prompt), (Stage::Block(1), 3));
    assert!(fail.max_rel.is_nan());
    // Through the CLI: one error line.
    let o = forge(&["verify", "-m", fixture("tiny-gpt2").to_str().unwrap(), "--reference", path.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(!o.status.success() && err.contains("block 1 is beyond its tolerance: max rel error NaN"), "{err}");
}

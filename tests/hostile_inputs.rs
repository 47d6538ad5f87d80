//! Misuse and hostile input through the library: each is an error with a message, on
//! every backend, never a panic, a hang or an out-of-bounds write.

mod common;

use std::path::Path;

use batch_forge::backend::cpu::simd::isas_or_skip;
use batch_forge::backend::cpu::{CpuBackend, CpuOptions};
use batch_forge::backend::reference::ReferenceBackend;
use batch_forge::backend::{AttentionSpec, Backend, HostMatrix, SeqSlice};
use batch_forge::engine::Engine;
use batch_forge::loaders::checkpoint::WeightError;
use batch_forge::loaders::{Gpt2Config, WeightStore};
use batch_forge::model::{Batch, Gpt2, LogitRows};
use batch_forge::tensor::KvDtype;
use batch_forge::tokenizer::Tokenizer;
use common::*;

/// Calls the forward pass (and attention directly) with caches and batches that do
/// not fit, and expects an error naming the problem each time.
fn forward_misuse_is_an_error<B: Backend>(e: &Engine<B>) {
    let (b, m) = (&e.backend, &e.model);
    let cfg =
        Gpt2Config::from_json(&std::fs::read_to_string(fixture("tiny-gpt2").join("config.json")).unwrap()).unwrap();
    let tokens = [1u32, 2, 3, 4, 5];
    let run = |tokens: &[u32], seqs: &[SeqSlice], cache: &mut B::KvCache| {
        let batch = Batch { tokens, seqs };
        m.forward(b, &batch, &mut [cache], LogitRows::LastOfEachSeq).err().map(|e| e.to_string())
    };
    let all = [SeqSlice { rows: 0..5, start_pos: 0 }];
    let cases: Vec<(B::KvCache, Vec<SeqSlice>, &str)> = vec![
        // A cache too small for the positions.
        (b.new_kv_cache(cfg.n_layer, 3, cfg.n_embd).unwrap(), all.to_vec(), "does not fit its KV cache"),
        // Too few layers, or the wrong width.
        (b.new_kv_cache(cfg.n_layer - 1, 10, cfg.n_embd).unwrap(), all.to_vec(), "does not fit this model"),
        (b.new_kv_cache(cfg.n_layer, 10, cfg.n_embd + 1).unwrap(), all.to_vec(), "does not fit this model"),
        // Positions that overflow usize, or run past the context.
        (
            b.new_kv_cache(cfg.n_layer, 10, cfg.n_embd).unwrap(),
            vec![SeqSlice { rows: 0..5, start_pos: usize::MAX - 2 }],
            "exceeds the model's context",
        ),
        (
            b.new_kv_cache(cfg.n_layer, 10, cfg.n_embd).unwrap(),
            vec![SeqSlice { rows: 0..5, start_pos: cfg.n_positions - 2 }],
            "exceeds the model's context",
        ),
        // Slices that do not tile the batch.
        (b.new_kv_cache(cfg.n_layer, 10, cfg.n_embd).unwrap(), vec![SeqSlice { rows: 1..5, start_pos: 0 }], "tile"),
        (b.new_kv_cache(cfg.n_layer, 10, cfg.n_embd).unwrap(), vec![SeqSlice { rows: 0..7, start_pos: 0 }], "tile"),
    ];
    for (mut cache, seqs, want) in cases {
        let err = run(&tokens, &seqs, &mut cache).unwrap_or_else(|| panic!("{}: {seqs:?} was accepted", b.name()));
        assert!(err.contains(want), "{}: {err:?} should mention {want:?}", b.name());
    }
    // One cache per sequence.
    let mut c1 = b.new_kv_cache(cfg.n_layer, 10, cfg.n_embd).unwrap();
    let two = [SeqSlice { rows: 0..2, start_pos: 0 }, SeqSlice { rows: 2..5, start_pos: 0 }];
    let err = m.forward(b, &Batch { tokens: &tokens, seqs: &two }, &mut [&mut c1], LogitRows::All).err().unwrap();
    assert!(err.to_string().contains("one KV cache per sequence"), "{err}");
    // An out-of-range token id.
    let err = run(&[cfg.vocab_size as u32], &[SeqSlice { rows: 0..1, start_pos: 0 }], &mut c1).unwrap();
    assert!(err.contains("out of range"), "{err}");

    // The backend's own attention refuses the same misuse (for callers other than the model).
    let c = cfg.n_embd;
    let qkv = b.upload(&HostMatrix::zeros(2, 3 * c));
    let mut cache = b.new_kv_cache(1, 4, c).unwrap();
    let cases: [(Vec<SeqSlice>, usize, usize, &str); 7] = [
        (vec![SeqSlice { rows: 0..2, start_pos: 3 }], 0, cfg.n_head, "do not fit the KV cache"),
        (vec![SeqSlice { rows: 0..2, start_pos: usize::MAX }], 0, cfg.n_head, "do not fit the KV cache"),
        (vec![SeqSlice { rows: 0..2, start_pos: 0 }], 1, cfg.n_head, "layer 1"),
        (vec![SeqSlice { rows: 0..2, start_pos: 0 }], 0, 0, "heads"),
        (vec![SeqSlice { rows: 0..1, start_pos: 0 }], 0, cfg.n_head, "cover"),
        (vec![SeqSlice { rows: 0..3, start_pos: 0 }], 0, cfg.n_head, "do not continue"),
        (vec![], 0, cfg.n_head, "cover"),
    ];
    for (seqs, layer, n_head, want) in cases {
        let spec = AttentionSpec::multi_head(c, n_head, 1.0);
        let err = b.attention(&qkv, &seqs, &mut [&mut cache][..seqs.len().min(1)], layer, &spec).err();
        let err = err.unwrap_or_else(|| panic!("{}: attention accepted {seqs:?} layer {layer}", b.name())).to_string();
        assert!(err.contains(want), "{}: {err:?} should mention {want:?}", b.name());
    }
    let mut narrow = b.new_kv_cache(1, 4, c - 1).unwrap();
    let spec = AttentionSpec::multi_head(c, cfg.n_head, 1.0);
    let err = b.attention(&qkv, &[SeqSlice { rows: 0..2, start_pos: 0 }], &mut [&mut narrow], 0, &spec);
    assert!(err.err().unwrap().to_string().contains("width"));
    // And the engine still works afterwards.
    assert_eq!(e.generate(&[1, 2], &greedy(3), |_| Ok(())).unwrap().generated_ids.len(), 3);
}

fn greedy(n: usize) -> batch_forge::engine::GenerateParams {
    batch_forge::engine::GenerateParams { ignore_eos: true, ..batch_forge::engine::GenerateParams::greedy(n) }
}

#[test]
fn forward_misuse_is_an_error_on_the_cpu_backends() {
    forward_misuse_is_an_error(&engine("tiny-gpt2"));
    let isas = isas_or_skip();
    for isa in isas {
        for kv_dtype in [KvDtype::F32, KvDtype::F16] {
            forward_misuse_is_an_error(&cpu_engine("tiny-gpt2", CpuOptions { kv_dtype, isa, ..Default::default() }));
        }
    }
}

#[cfg(feature = "gpu")]
#[test]
fn forward_misuse_is_an_error_on_the_gpu_backend() {
    let Some(b) = gpu_backend(Default::default()) else { return };
    forward_misuse_is_an_error(&Engine::load(b, &fixture("tiny-gpt2")).unwrap());
}

/// Configs built in code are held to the loader's rules: the model refuses them
/// instead of dividing by zero or indexing an empty block list.
#[test]
fn invalid_configs_are_refused_by_the_model_too() {
    let weights = batch_forge::loaders::Weights::Safetensors(WeightStore::open_dir(&fixture("tiny-gpt2")).unwrap());
    let good =
        Gpt2Config::from_json(&std::fs::read_to_string(fixture("tiny-gpt2").join("config.json")).unwrap()).unwrap();
    for (what, bad) in [
        ("n_layer 0", Gpt2Config { n_layer: 0, ..good.clone() }),
        ("n_head 0", Gpt2Config { n_head: 0, ..good.clone() }),
        ("n_head 3", Gpt2Config { n_head: 3, ..good.clone() }),
        ("eos outside", Gpt2Config { eos_token_id: 60000, ..good.clone() }),
        ("huge", Gpt2Config { n_layer: 1 << 24, n_embd: 1 << 24, n_inner: 1 << 24, ..good.clone() }),
    ] {
        let r = Gpt2::load(&ReferenceBackend, bad.clone(), &weights);
        let err = r.err().unwrap_or_else(|| panic!("{what} accepted"));
        assert!(matches!(err, WeightError::Config { architecture: "GPT-2", .. }), "{what}: {err:?}");
        assert!(err.to_string().contains("invalid GPT-2 config"), "{what}: {err}");
        assert!(CpuBackend::new(CpuOptions::default()).is_ok_and(|b| Gpt2::load(&b, bad, &weights).is_err()));
    }
    assert!(Gpt2::load(&ReferenceBackend, good, &weights).is_ok());
}

/// The library's errors say whose fault a failure is in their types, not only in their
/// words: a missing or misshapen tensor, a `--model` that names nothing, a quantization
/// its settings refuse, a reference dump that is not one or is of another model.
#[test]
fn loading_converting_and_verifying_errors_are_typed() {
    use batch_forge::convert::ConvertError;
    use batch_forge::convert::quantize::{FileType, QuantizeOptions, quantize_file};
    use batch_forge::loaders::ResolveError;
    use batch_forge::loaders::hub::HubClient;
    use batch_forge::model::load::LoadError;
    use batch_forge::verify::{Reference, VerifyError, tolerance, verify};

    let (_missing, dir) = fixture_copy("tiny-gpt2");
    rewrite_checkpoint(&dir, |t| t.retain(|t| t.name != "h.1.ln_2.bias"));
    match Engine::load(ReferenceBackend, &dir).map(|_| ()) {
        Err(LoadError::Weights { cause: WeightError::Missing { name }, .. }) => assert_eq!(name, "h.1.ln_2.bias"),
        other => panic!("{other:?}"),
    }
    let (_misshapen, dir) = fixture_copy("tiny-gpt2");
    rewrite_checkpoint(&dir, |t| {
        let w = t.iter_mut().find(|t| t.name == "h.0.mlp.c_proj.bias").unwrap();
        w.bytes.truncate(w.bytes.len() - 4);
        w.shape[0] -= 1;
    });
    match Engine::load(ReferenceBackend, &dir).map(|_| ()) {
        Err(LoadError::Weights { cause: WeightError::Shape { name, got, .. }, .. }) => {
            assert_eq!((name.as_str(), got), ("h.0.mlp.c_proj.bias", vec![63])); // n_embd 64, one cut
        }
        other => panic!("{other:?}"),
    }

    let hub = HubClient { offline: true, ..HubClient::from_env() };
    for nothing in ["./no/such/folder", "missing.gguf"] {
        let r = batch_forge::loaders::resolve_model(nothing, &hub, true, "generate");
        assert!(matches!(r, Err(ResolveError::Argument(_))), "{nothing}: {r:?}");
    }

    let out = tempfile::tempdir().unwrap();
    let q8 = fixture("tiny-gpt2").join("tiny-gpt2.q8_0.gguf");
    let opts = QuantizeOptions { ftype: FileType::Q4_0, pure: false, allow_requantize: false };
    match quantize_file(&q8, &out.path().join("q4.gguf"), &opts, |_, _, _| {}) {
        Err(ConvertError::Refused(m)) => assert!(m.contains("--allow-requantize"), "{m}"),
        other => panic!("{:?}", other.map(|p| p.len())),
    }

    let config = fixture("tiny-gpt2").join("config.json");
    assert!(matches!(Reference::open(&config), Err(VerifyError::File(_))));
    let weights = fixture("tiny-gpt2").join("model.safetensors");
    assert!(matches!(Reference::open(&weights), Err(VerifyError::Reference { .. })));
    let gpt2_dump = Reference::open(&fixture("tiny-gpt2").join("verify.safetensors")).unwrap();
    let llama = Engine::load(ReferenceBackend, &fixture("tiny-llama")).unwrap();
    let r = verify(&llama.backend, llama.model.as_ref(), &gpt2_dump, tolerance::F32, |s| llama.prompt_ids(s));
    match r.map(|_| ()) {
        Err(VerifyError::Mismatch(m)) => assert!(m.contains("outside the model's vocabulary"), "{m}"),
        other => panic!("{other:?}"),
    }
}

fn tokenizer_json_with(added: &str) -> String {
    let text = std::fs::read_to_string(fixture("gpt2-tokenizer/tokenizer.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
    v["added_tokens"] = serde_json::from_str(added).unwrap();
    v.to_string()
}

/// Tokenizer files that would make encoding endless or lossy are refused when loaded.
/// (A special token with empty content used to match at every position: memory grew
/// until the process was killed.)
#[test]
fn degenerate_tokenizer_files_are_refused() {
    let p = Path::new("tokenizer.json");
    let empty = tokenizer_json_with(r#"[{"id": 50256, "content": "", "special": true}]"#);
    let err = Tokenizer::parse_tokenizer_json(p, &empty).err().unwrap().to_string();
    assert!(err.contains("empty content"), "{err}");
    // Two special tokens on one id: "<|endoftext|>" would encode to an id that decodes as "<|x|>".
    let shared = tokenizer_json_with(
        r#"[{"id": 50256, "content": "<|endoftext|>", "special": true}, {"id": 50256, "content": "<|x|>", "special": true}]"#,
    );
    let err = Tokenizer::parse_tokenizer_json(p, &shared).err().unwrap().to_string();
    assert!(err.contains("share id 50256"), "{err}");
    // Two vocabulary entries for one id: decoding could not give back the text.
    let text = std::fs::read_to_string(fixture("gpt2-tokenizer/vocab.json")).unwrap();
    let dup = text.replacen("{", "{\"zzzz-duplicate\": 100, ", 1);
    let merges = std::fs::read_to_string(fixture("gpt2-tokenizer/merges.txt")).unwrap();
    let err = Tokenizer::parse_vocab_merges(Path::new("vocab.json"), &dup, Path::new("merges.txt"), &merges)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("two vocab tokens"), "{err}");
    let empty_vocab = text.replacen("{", "{\"\": 60000, ", 1);
    let err = Tokenizer::parse_vocab_merges(Path::new("vocab.json"), &empty_vocab, Path::new("merges.txt"), &merges)
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("empty string"), "{err}");
}

/// Special tokens that overlap, nest and repeat, in a text with many of them: every
/// accepted tokenizer encodes and decodes back to the text exactly.
#[test]
fn many_special_tokens_encode_and_round_trip() {
    let added = (0..50)
        .map(|i| format!(r#"{{"id": {}, "content": "<|s{i}|>", "special": true}}"#, 50257 + i))
        .chain([r#"{"id": 50400, "content": "<|s1", "special": true}"#.to_string()])
        .chain([r#"{"id": 50256, "content": "<|endoftext|>", "special": true}"#.to_string()])
        .collect::<Vec<_>>()
        .join(",");
    let tok = Tokenizer::parse_tokenizer_json(Path::new("tokenizer.json"), &tokenizer_json_with(&format!("[{added}]")))
        .unwrap();
    let mut text = String::new();
    for i in 0..2000 {
        text.push_str(&format!("word {i} <|s{}|><|s1<|endoftext|>x", i % 60));
    }
    let ids = tok.encode(&text);
    assert_eq!(tok.decode(&ids).unwrap(), text);
    assert!(ids.contains(&50400) && ids.contains(&(50257 + 49)) && ids.contains(&50256));
    // `<|s1|>` is matched whole, not as its prefix `<|s1`.
    assert_eq!(tok.encode("<|s1|>"), [50258]);
    assert_eq!(tok.encode("<|s1"), [50400]);
}

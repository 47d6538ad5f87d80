//! The properties the fuzz targets check, as plain functions of the input bytes: the
//! cargo-fuzz targets (fuzz_targets/) call them under libFuzzer, and
//! tests/fuzz_regressions.rs replays the committed seeds and every input a fuzzer ever
//! found (fuzz/regressions/) through them on stable Rust, in CI.
#![allow(dead_code)]

use batch_forge::engine::sampler::{Sampler, SamplingParams, argmax, penalize};
use batch_forge::loaders::Gpt2Config;
use batch_forge::loaders::safetensors::SafetensorsFile;
use batch_forge::tokenizer::StreamDecoder;
use batch_forge::tokenizer::Tokenizer;
use batch_forge::tokenizer::{PreTokenizer, split_chain_pieces};
use std::path::Path;
use std::sync::LazyLock;

/// Any byte string as a safetensors file: the header is validated or rejected with an
/// error, never a panic, and every tensor of an accepted file reads in bounds.
pub fn safetensors(data: &[u8]) {
    let Ok(file) = SafetensorsFile::from_bytes("fuzz", data.to_vec()) else { return };
    let names: Vec<String> = file.names().map(str::to_owned).collect();
    for name in names {
        let t = file.get(&name).expect("listed tensors exist");
        let elems = t.shape.iter().product::<usize>();
        assert_eq!(t.bytes.len(), elems * t.dtype.size(), "{name}: size");
        if let Ok(v) = t.to_f32() {
            assert_eq!(v.len(), elems);
        }
        if let Ok(v) = t.to_i64() {
            assert_eq!(v.len(), elems);
        }
    }
}

/// Any text as a GPT-2 `config.json`: accepted configs are consistent (every derived
/// size is computable without overflow), everything else is an error, never a panic.
pub fn config_json(data: &[u8]) {
    let Ok(text) = std::str::from_utf8(data) else { return };
    let Ok(c) = Gpt2Config::from_json(text) else { return };
    assert!(c.validate().is_ok());
    assert!(c.checked_n_params().is_some(), "an accepted config has a parameter count");
    assert!(c.head_dim() * c.n_head == c.n_embd);
    assert!(c.eos_token_id < c.vocab_size as u32 && c.bos_token_id < c.vocab_size as u32);
    // What it writes back reads back the same.
    assert_eq!(Gpt2Config::from_json(&c.to_json()).as_ref(), Ok(&c));
}

/// Any text as a `tokenizer.json`, then any text to encode with what it accepted:
/// loading is an error or a tokenizer that encodes in bounded time (libFuzzer's
/// -timeout) and decodes back to the exact input. Input: JSON, a 0 byte, the text.
pub fn tokenizer_json(data: &[u8]) {
    let split = data.iter().position(|&b| b == 0).unwrap_or(data.len());
    let Ok(json) = std::str::from_utf8(&data[..split]) else { return };
    let text = String::from_utf8_lossy(data.get(split + 1..).unwrap_or_default());
    let Ok(tok) = Tokenizer::parse_tokenizer_json(Path::new("tokenizer.json"), json) else { return };
    for ids in [tok.encode(&text), tok.encode_ordinary(&text)] {
        let bytes = tok.decode_bytes(&ids).expect("encoded ids decode");
        if tok.round_trips() {
            assert_eq!(bytes, text.as_bytes());
        }
        tok.decode(&ids).expect("encoded ids decode");
    }
}

/// Any `vocab.json` + `merges.txt` pair, then any text: as for `tokenizer_json`.
/// Input: vocab, a 0 byte, merges, a 0 byte, the text.
pub fn vocab_merges(data: &[u8]) {
    let mut parts = data.splitn(3, |&b| b == 0);
    let (Some(vocab), Some(merges)) = (parts.next(), parts.next()) else { return };
    let text = String::from_utf8_lossy(parts.next().unwrap_or_default());
    let (Ok(vocab), Ok(merges)) = (std::str::from_utf8(vocab), std::str::from_utf8(merges)) else { return };
    let (vp, mp) = (Path::new("vocab.json"), Path::new("merges.txt"));
    let Ok(tok) = Tokenizer::parse_vocab_merges(vp, vocab, mp, merges) else { return };
    for ids in [tok.encode(&text), tok.encode_ordinary(&text)] {
        assert_eq!(tok.decode_bytes(&ids).expect("encoded ids decode"), text.as_bytes());
    }
}

static TOKENIZER: LazyLock<Tokenizer> = LazyLock::new(|| {
    // From the fuzz crate (fuzz/) or the main crate (the repository root).
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = [root.join("tests/fixtures/gpt2-tokenizer"), root.join("../tests/fixtures/gpt2-tokenizer")]
        .into_iter()
        .find(|d| d.is_dir())
        .expect("tests/fixtures/gpt2-tokenizer");
    Tokenizer::from_dir(&dir).expect("the GPT-2 tokenizer fixture")
});

/// GPT-2's real tokenizer on arbitrary bytes: valid UTF-8 round-trips exactly through
/// encode → decode (with and without special-token matching), every id is in range,
/// encoding finishes in bounded time (libFuzzer's -timeout), and the chains of splits
/// (DeepSeek's, MiniCPM 5's) tile the text.
pub fn bpe_roundtrip(data: &[u8]) {
    let tok = &*TOKENIZER;
    let text = String::from_utf8_lossy(data);
    for ids in [tok.encode(&text), tok.encode_ordinary(&text)] {
        assert!(ids.iter().all(|&id| (id as usize) < tok.vocab_size()));
        let back = tok.decode_bytes(&ids).expect("encoded ids decode");
        assert_eq!(back, text.as_bytes(), "round trip of {text:?}");
    }
    // The chains of splits tile the text with non-empty pieces.
    for pre in
        [PreTokenizer::DeepSeekLlm, PreTokenizer::DeepSeekCoder, PreTokenizer::DeepSeekV3, PreTokenizer::MiniCpm5]
    {
        let pieces = split_chain_pieces(&text, pre).expect("a chain of splits");
        assert!(pieces.iter().all(|p| !p.is_empty()), "{pre:?}: an empty piece of {text:?}");
        assert_eq!(pieces.concat(), text, "{pre:?}: pieces of {text:?}");
    }
}

/// The streaming UTF-8 decoder on arbitrary bytes cut into arbitrary pieces: what it
/// emits, piece by piece and then at `finish`, equals a one-shot lossy decode of the
/// whole; every emitted piece is whole characters (it is a `String`), and what it holds
/// back is at most one partial character. Input: a cut table byte, then the bytes.
pub fn stream_decoder(data: &[u8]) {
    let Some((&cut, bytes)) = data.split_first() else { return };
    let mut d = StreamDecoder::new();
    let mut out = String::new();
    let step = usize::from(cut % 7) + 1;
    for (i, piece) in bytes.chunks(step).enumerate() {
        // Vary the piece length with the data so cuts fall everywhere.
        let piece = &piece[..piece.len().min(1 + (i + usize::from(cut)) % step)];
        d.push_into(piece, &mut out);
        assert!(d.pending_len() <= 3, "holds back more than a partial character");
    }
    out.push_str(&d.finish());
    let fed: Vec<u8> = bytes
        .chunks(step)
        .enumerate()
        .flat_map(|(i, p)| p[..p.len().min(1 + (i + usize::from(cut)) % step)].to_vec())
        .collect();
    assert_eq!(out, String::from_utf8_lossy(&fed));
}

fn f32_at(d: &[u8], i: usize) -> f32 {
    let mut b = [0u8; 4];
    for (k, x) in b.iter_mut().enumerate() {
        *x = d.get(i + k).copied().unwrap_or(0);
    }
    f32::from_le_bytes(b)
}

/// Sampling parameters, a token history and logits from raw bits (any f32: NaN, ±inf,
/// subnormals): invalid parameters are refused; accepted ones always return an id in
/// range that is not a NaN logit (unless every logit is NaN), the argmax of the
/// penalized logits when the temperature is 0.
pub fn sampler(data: &[u8]) {
    if data.len() < 29 {
        return;
    }
    let params = SamplingParams {
        temperature: f32_at(data, 0),
        top_k: u32::from_le_bytes([data[4], data[5], data[6], data[7]]) as usize % 70_000,
        top_p: f32_at(data, 8),
        seed: u64::from(u32::from_le_bytes([data[12], data[13], data[14], data[15]])),
        min_p: f32_at(data, 16),
        repeat_penalty: f32_at(data, 20),
        repeat_last_n: usize::from(data[24]),
        presence_penalty: 0.0,
        frequency_penalty: 0.0,
    };
    let history: Vec<u32> = data[25..29].iter().map(|&b| u32::from(b)).collect();
    let logits: Vec<f32> = data[29..].chunks(4).map(|c| f32_at(c, 0)).collect();
    let Ok(mut s) = Sampler::new(params.clone()) else {
        assert!(params.validate().is_err());
        return;
    };
    s.accept(&history);
    let recent = &history[history.len().saturating_sub(params.repeat_last_n)..];
    let penalized: Vec<f32> = logits
        .iter()
        .enumerate()
        .map(
            |(i, &v)| {
                if params.repeats() && recent.contains(&(i as u32)) { penalize(v, params.repeat_penalty) } else { v }
            },
        )
        .collect();
    for _ in 0..3 {
        let id = s.sample(&logits) as usize;
        assert!(logits.is_empty() || id < logits.len());
        if penalized.iter().any(|v| !v.is_nan()) {
            assert!(!penalized[id].is_nan(), "picked a NaN logit");
        }
        if params.temperature == 0.0 && !logits.is_empty() {
            assert_eq!(id, argmax(&penalized) as usize);
        }
    }
}

/// Any bytes as a GGUF file: validated or an error (never a panic, a hang or a huge
/// allocation); every tensor of an accepted file lies inside the file, aligned, with
/// exactly the bytes its type and dimensions need, and no two overlap.
pub fn gguf(data: &[u8]) {
    use batch_forge::loaders::gguf::GgufFile;
    let Ok(g) = GgufFile::from_bytes("fuzz", data.to_vec()) else { return };
    let h = g.header();
    assert!(h.alignment.is_power_of_two() && h.data_start % h.alignment == 0);
    let mut spans = Vec::new();
    for t in g.tensor_infos() {
        let bytes = g.tensor(&t.name).expect("listed tensors exist").bytes;
        assert_eq!(bytes.len() as u64, t.n_bytes);
        assert_eq!(t.ggml_type.bytes_for(t.n_elements()), Some(t.n_bytes));
        assert_eq!(t.offset % h.alignment, 0);
        assert!(h.data_start + t.offset + t.n_bytes <= data.len() as u64);
        spans.push((t.offset, t.offset + t.n_bytes));
    }
    spans.sort_unstable();
    assert!(spans.windows(2).all(|w| w[0].1 <= w[1].0), "overlapping tensors accepted");
    // Its tokenizer metadata: a tokenizer or an error, never a panic; an accepted one
    // encodes and decodes without panicking.
    if let Ok(tok) = Tokenizer::from_gguf(&g) {
        let ids = tok.encode("Hello 12 ½ <s> \u{4}");
        assert!(ids.iter().all(|&id| (id as usize) < tok.vocab_size()));
        let _ = tok.decode(&ids);
        // Its chat template: compiled and rendered, or an error.
        if let Ok(Some(t)) = batch_forge::chat::ChatTemplate::from_gguf(&g, &tok) {
            let _ = t.render(&[batch_forge::chat::Message::new("user", "hi")], true);
        }
    }
    // Its quantization: a plan or an error; a small file's tensors convert or fail cleanly.
    {
        use batch_forge::convert::quantize::{FileType, QuantizeOptions, Source, convert_tensor, plan_tensors};
        let src = Source::from_gguf(&g);
        for ftype in [FileType::Q4KM, FileType::Q8_0] {
            let opts = QuantizeOptions { ftype, pure: false, allow_requantize: true };
            if let Ok(plans) = plan_tensors(&src, &opts)
                && data.len() < 1 << 16
            {
                // The output's header: built, or an error (never a panic or a huge buffer).
                if let Ok(plan) = batch_forge::convert::quantize::plan_file(&src, &plans, ftype) {
                    let _ = plan.header();
                }
                for p in &plans {
                    let st = src.tensors.iter().find(|s| s.name == p.name).expect("planned from the table");
                    if let Ok(bytes) = (st.load)()
                        && let Ok(out) = convert_tensor(p, &bytes)
                    {
                        let n: u64 = p.dims.iter().product();
                        assert_eq!(Some(out.len() as u64), p.to.bytes_for(n), "{}", p.name);
                    }
                }
            }
        }
    }
    // A Llama model from it: a config and a model, or an error; a small model that loads
    // runs a forward pass without panicking.
    if let Ok(config) = batch_forge::loaders::LlamaConfig::from_gguf(&g)
        && config.checked_n_params().is_some_and(|n| n < 1 << 22)
    {
        use batch_forge::backend::SeqSlice;
        use batch_forge::backend::reference::ReferenceBackend;
        use batch_forge::model::{Batch, CausalLm, Llama, LogitRows};
        let weights = batch_forge::loaders::Weights::Gguf(g);
        if let Ok(m) = Llama::load(&ReferenceBackend, config, &weights)
            && let Ok(mut cache) = m.new_cache(&ReferenceBackend, 2)
        {
            let seqs = [SeqSlice { rows: 0..2, start_pos: 0 }];
            let _ = m.forward(
                &ReferenceBackend,
                &Batch { tokens: &[0, 1], seqs: &seqs },
                &mut [&mut cache],
                LogitRows::All,
            );
        }
    }
}

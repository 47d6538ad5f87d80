//! The tokenizer built from GGUF metadata (`tokenizer.ggml.*`) against HF transformers'
//! tokenizer built from the same GGUF: SmolLM2-135M-Instruct's (model `gpt2`, pre-tokenizer
//! `smollm`), kept as a tokenizer-only GGUF in tests/fixtures/smollm2-tokenizer/ with
//! HF's ids for 380 texts (scripts/make_gguf_tokenizer_fixture.py). transformers' GGUF
//! converter installs a bare ByteLevel pre-tokenizer; the truth is that tokenizer with the
//! pre-tokenizer `smollm` names (Digits(individual_digits) + ByteLevel, as SmolLM2's own
//! tokenizer.json and llama.cpp have it). The bare converter's ids are kept too
//! (`ids_gguf_converter`) and differ on 6 texts, all with numbers.

mod common;

use std::io::Write;
use std::process::{Command, Stdio};

use batch_forge::loaders::gguf::GgufFile;
use batch_forge::tokenizer::{PreTokenizer, Tokenizer};
use common::*;
use serde_json::Value;

fn smollm2() -> Tokenizer {
    Tokenizer::from_gguf(&GgufFile::open(&fixture("smollm2-tokenizer/tokenizer.gguf")).unwrap()).unwrap()
}

fn cases_with(key: &str) -> Vec<(String, Vec<u32>)> {
    std::fs::read_to_string(fixture("smollm2-tokenizer/cases.jsonl"))
        .unwrap()
        .split('\n')
        .filter(|l| !l.is_empty())
        .map(|l| {
            let v: Value = serde_json::from_str(l).unwrap();
            (v["text"].as_str().unwrap().to_owned(), ids(&v[key]))
        })
        .collect()
}

fn cases() -> Vec<(String, Vec<u32>)> {
    cases_with("ids")
}

#[test]
fn smollm2_ids_equal_hf() {
    let tok = smollm2();
    assert_eq!(tok.pre_tokenizer(), PreTokenizer::SmolLm);
    assert_eq!(tok.bos_to_add(), None, "SmolLM2's add_bos_token is false");
    assert_eq!(tok.vocab_size(), 49152);
    let cases = cases();
    assert_eq!(cases.len(), 380);
    let mut digits = 0;
    for (text, want) in &cases {
        assert_eq!(&tok.encode(text), want, "{text:?}");
        digits += usize::from(text.chars().any(|c| c.is_ascii_digit()));
        // Decoding gives the text back, less the bytes the vocabulary lacks (dropped, as HF does).
        let kept: String =
            text.chars().filter(|c| !matches!(c, '\x04' | '\x06' | '\x13' | '\x14' | '\x16' | '\x1d')).collect();
        assert_eq!(tok.decode(want).unwrap(), kept, "{text:?}");
    }
    assert!(digits >= 20, "only {digits} cases with digits");
    // The bare GGUF converter differs only where numbers meet the pre-tokenizer.
    let differ: Vec<String> = cases_with("ids_gguf_converter")
        .into_iter()
        .filter(|(t, conv)| &tok.encode(t) != conv)
        .map(|(t, _)| t)
        .collect();
    assert_eq!(differ.len(), 6, "{differ:?}");
    assert!(differ.iter().all(|t| t.chars().any(char::is_numeric)), "{differ:?}");
    // Specials are matched in text (HF's default), and spelled out with encode_ordinary.
    assert_eq!(tok.encode("<|im_start|>user"), [1, 4093]);
    assert!(tok.encode_ordinary("<|im_start|>").len() > 1);
}

/// `forge tokenize -m FILE.gguf` and `forge detokenize` through the CLI, on every case.
#[test]
fn cli_tokenizes_with_a_gguf_file() {
    let gguf = fixture("smollm2-tokenizer/tokenizer.gguf");
    let g = gguf.to_str().unwrap();
    let cases = cases();
    let input: String = cases.iter().map(|(t, _)| format!("{}\n", serde_json::json!({ "text": t }))).collect();
    let mut child = Command::new(env!("CARGO_BIN_EXE_forge"))
        .args(["tokenize", "--jsonl", "-m", g])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()).unwrap());
    let o = child.wait_with_output().unwrap();
    writer.join().unwrap();
    assert!(o.status.success());
    let out = String::from_utf8(o.stdout).unwrap();
    let got: Vec<Vec<u32>> = out.lines().map(|l| ids(&serde_json::from_str::<Value>(l).unwrap()["ids"])).collect();
    assert_eq!(got.len(), cases.len());
    for (g, (t, want)) in got.iter().zip(&cases) {
        assert_eq!(g, want, "{t:?}");
    }
    let o = Command::new(env!("CARGO_BIN_EXE_forge"))
        .args(["detokenize", "-m", g, "19556", "216", "33", "34"])
        .output()
        .unwrap();
    assert_eq!(o.stdout, b"Hello 12");
}

/// A minimal GGUF v3 file with the given metadata and no tensors.
fn gguf(meta: &[(&str, Meta)]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    b.extend((meta.len() as u64).to_le_bytes());
    let string = |b: &mut Vec<u8>, s: &str| {
        b.extend((s.len() as u64).to_le_bytes());
        b.extend(s.as_bytes());
    };
    for (k, v) in meta {
        string(&mut b, k);
        match v {
            Meta::Str(s) => {
                b.extend(8u32.to_le_bytes());
                string(&mut b, s);
            }
            Meta::U32(x) => {
                b.extend(4u32.to_le_bytes());
                b.extend(x.to_le_bytes());
            }
            Meta::Bool(x) => {
                b.extend(7u32.to_le_bytes());
                b.push(u8::from(*x));
            }
            Meta::Strs(items) => {
                b.extend(9u32.to_le_bytes());
                b.extend(8u32.to_le_bytes());
                b.extend((items.len() as u64).to_le_bytes());
                for s in items {
                    string(&mut b, s);
                }
            }
            Meta::I32s(items) => {
                b.extend(9u32.to_le_bytes());
                b.extend(5u32.to_le_bytes());
                b.extend((items.len() as u64).to_le_bytes());
                for x in items {
                    b.extend(x.to_le_bytes());
                }
            }
        }
    }
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    b
}

#[derive(Clone)]
enum Meta {
    Str(String),
    U32(u32),
    Bool(bool),
    Strs(Vec<String>),
    I32s(Vec<i32>),
}

/// The 256 byte-level tokens (token i is byte i), then "ab" (256) and "<s>" (257).
fn tiny_tokens() -> Vec<String> {
    let mut tokens: Vec<String> = (0..=255u8).map(|b| byte_char(b).to_string()).collect();
    tokens.push("ab".into());
    tokens.push("<s>".into());
    tokens
}

/// A tiny GPT-2-style tokenizer: [`tiny_tokens`], the merge "a b", "<s>" a control token
/// and the BOS, added to every text.
fn tiny_meta() -> Vec<(&'static str, Meta)> {
    let tokens = tiny_tokens();
    let mut types = vec![1; 257];
    types.push(3);
    vec![
        ("tokenizer.ggml.model", Meta::Str("gpt2".into())),
        ("tokenizer.ggml.pre", Meta::Str("gpt-2".into())),
        ("tokenizer.ggml.tokens", Meta::Strs(tokens)),
        ("tokenizer.ggml.token_type", Meta::I32s(types)),
        ("tokenizer.ggml.merges", Meta::Strs(vec!["a b".into()])),
        ("tokenizer.ggml.bos_token_id", Meta::U32(257)),
        ("tokenizer.ggml.add_bos_token", Meta::Bool(true)),
    ]
}

/// GPT-2's byte → printable character map.
fn byte_char(b: u8) -> char {
    let printable = |b: u8| (b'!'..=b'~').contains(&b) || (0xa1..=0xac).contains(&b) || b >= 0xae;
    if printable(b) {
        return char::from(b);
    }
    let n = (0..b).filter(|&x| !printable(x)).count() as u32;
    char::from_u32(256 + n).unwrap()
}

#[test]
fn a_tiny_gguf_tokenizer_works_and_hostile_metadata_is_refused() {
    let load = |meta: &[(&str, Meta)]| Tokenizer::from_gguf(&GgufFile::from_bytes("t.gguf", gguf(meta)).unwrap());
    let tok = load(&tiny_meta()).unwrap();
    assert_eq!(tok.encode("ab<s>b"), [256, 257, b'b' as u32]);
    assert_eq!(tok.bos_to_add(), Some(257));
    assert_eq!(tok.decode(&[256, 257]).unwrap(), "ab<s>");
    let with = |key: &str, v: Meta| {
        let mut m = tiny_meta();
        m.iter_mut().find(|(k, _)| *k == key).unwrap().1 = v;
        m
    };
    let without = |key: &str| tiny_meta().into_iter().filter(|(k, _)| *k != key).collect::<Vec<_>>();
    // llama.cpp's names for the patterns and chains select them.
    for (name, want) in [
        ("phi-2", PreTokenizer::Gpt2),
        ("starcoder", PreTokenizer::SmolLm),
        ("dbrx", PreTokenizer::Llama3),
        ("glm4", PreTokenizer::Llama3),
        ("deepseek-llm", PreTokenizer::DeepSeekLlm),
        ("deepseek-coder", PreTokenizer::DeepSeekCoder),
        ("deepseek-v3", PreTokenizer::DeepSeekV3),
        ("hunyuan-dense", PreTokenizer::DeepSeekV3),
        ("qwen35", PreTokenizer::Qwen35),
        ("minicpm5", PreTokenizer::MiniCpm5),
        ("llama-bpe", PreTokenizer::Llama3),
        ("pixtral", PreTokenizer::Llama3),
        ("qwen2", PreTokenizer::Qwen2),
        ("megrez", PreTokenizer::Qwen2),
        ("gpt-4o", PreTokenizer::Gpt4o),
        ("llama4", PreTokenizer::Gpt4o),
        ("tekken", PreTokenizer::Tekken),
    ] {
        assert_eq!(load(&with("tokenizer.ggml.pre", Meta::Str(name.into()))).unwrap().pre_tokenizer(), want);
    }
    // Without add_bos_token, llama.cpp's default for the name decides (dbrx and smaug-bpe
    // share Llama 3's pattern, not its default).
    for (name, bos) in
        [("llama-bpe", Some(257)), ("tekken", Some(257)), ("dbrx", None), ("deepseek-v3", None), ("glm4", None)]
    {
        let mut m = with("tokenizer.ggml.pre", Meta::Str(name.into()));
        m.retain(|(k, _)| *k != "tokenizer.ggml.add_bos_token");
        assert_eq!(load(&m).unwrap().bos_to_add(), bos, "{name}");
    }
    for (meta, want) in [
        (with("tokenizer.ggml.model", Meta::Str("bert".into())), "\"bert\" is not supported"),
        // SentencePiece needs scores and token types.
        (with("tokenizer.ggml.model", Meta::Str("llama".into())), "no tokenizer.ggml.scores"),
        (
            with("tokenizer.ggml.pre", Meta::Str("chameleon".into())),
            "\"chameleon\" is not supported (supported: \"gpt-2\", \"phi-2\",",
        ),
        (with("tokenizer.ggml.pre", Meta::U32(3)), "tokenizer.ggml.pre is not a string"),
        (with("tokenizer.ggml.tokens", Meta::I32s(vec![1, 2])), "token 0 is not a string"),
        (with("tokenizer.ggml.token_type", Meta::Strs(vec!["x".into(); 258])), "token type 0 is not an integer"),
        (with("tokenizer.ggml.token_type", Meta::I32s(vec![1; 3])), "3 token types for 258 tokens"),
        (with("tokenizer.ggml.merges", Meta::Strs(vec!["a".into()])), "merge 0 (\"a\") is not two tokens"),
        (with("tokenizer.ggml.merges", Meta::Strs(vec!["x y".into()])), "\"xy\" is not in the vocabulary"),
        (with("tokenizer.ggml.bos_token_id", Meta::U32(999)), "bos_token_id is not a token id"),
        (without("tokenizer.ggml.bos_token_id"), "add_bos_token is set but there is no bos_token_id"),
        (without("tokenizer.ggml.tokens"), "no tokenizer.ggml.tokens"),
        (without("tokenizer.ggml.model"), "no tokenizer.ggml.model"),
        (with("tokenizer.ggml.tokens", Meta::Strs(vec![String::new(); 258])), "has empty content"),
    ] {
        let err = load(&meta).err().unwrap_or_else(|| panic!("{want}: accepted")).to_string();
        assert!(err.contains(want), "{want}: {err}");
    }
    // No pre-tokenizer name: llama.cpp would use its "default" pattern, which is refused.
    for meta in [without("tokenizer.ggml.pre"), with("tokenizer.ggml.pre", Meta::Str("default".into()))] {
        let err = load(&meta).err().unwrap().to_string();
        assert!(err.contains("not supported"), "{err}");
    }
    // An empty ordinary token; a missing printable byte (refused) or control byte (dropped).
    let mut tokens = tiny_tokens();
    tokens[256] = String::new();
    let err = load(&with("tokenizer.ggml.tokens", Meta::Strs(tokens))).err().unwrap().to_string();
    assert!(err.contains("vocab token 256 is the empty string"), "{err}");
    let mut tokens = tiny_tokens();
    tokens[b'q' as usize] = "q-gone".into();
    let err = load(&with("tokenizer.ggml.tokens", Meta::Strs(tokens))).err().unwrap().to_string();
    assert!(err.contains("lacks the single byte 0x71"), "{err}");
    let mut tokens = tiny_tokens();
    tokens[4] = "no-4".into();
    let tok = load(&with("tokenizer.ggml.tokens", Meta::Strs(tokens))).unwrap();
    assert_eq!(tok.encode("a\u{4}b"), [u32::from(b'a'), u32::from(b'b')]);
}

/// The `smollm` split against `gpt-2` on a vocabulary that merges `Ġ1` and `12`: GPT-2's
/// pattern keeps " 12" one word (→ Ġ1, 2), smollm splits every digit off (→ Ġ, 1, 2).
#[test]
fn smollm_and_gpt2_pre_tokenizers_differ_where_they_should() {
    let mut tokens = tiny_tokens();
    tokens.extend(["Ġ1".to_owned(), "12".to_owned()]); // ids 258, 259
    let load = |pre: &str| {
        let mut m = tiny_meta();
        for (k, v) in &mut m {
            match *k {
                "tokenizer.ggml.pre" => *v = Meta::Str(pre.into()),
                "tokenizer.ggml.tokens" => *v = Meta::Strs(tokens.clone()),
                "tokenizer.ggml.token_type" => *v = Meta::I32s([vec![1; 257], vec![3], vec![1, 1]].concat()),
                "tokenizer.ggml.merges" => *v = Meta::Strs(vec!["a b".into(), "Ġ 1".into(), "1 2".into()]),
                _ => {}
            }
        }
        Tokenizer::from_gguf(&GgufFile::from_bytes("t.gguf", gguf(&m)).unwrap()).unwrap()
    };
    let (g, s) = (load("gpt-2"), load("smollm"));
    let (sp, one, two, x) = (u32::from(b' '), u32::from(b'1'), u32::from(b'2'), u32::from(b'x'));
    assert_eq!(g.encode(" 12"), [258, two]);
    assert_eq!(s.encode(" 12"), [sp, one, two]);
    assert_eq!(g.encode("x12"), [x, 259]);
    assert_eq!(s.encode("x12"), [x, one, two]);
    assert_eq!(s.encode("a½"), g.encode("a½")); // one number character either way
}

/// `forge tokenize` puts BOS first and EOS last when the GGUF asks for them.
#[test]
fn cli_adds_bos_and_eos_when_the_gguf_asks() {
    let mut meta = tiny_meta();
    meta.push(("tokenizer.ggml.eos_token_id", Meta::U32(256)));
    meta.push(("tokenizer.ggml.add_eos_token", Meta::Bool(true)));
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("tiny.gguf");
    std::fs::write(&path, gguf(&meta)).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_forge"))
        .args(["tokenize", "-m", path.to_str().unwrap(), "xab"])
        .output()
        .unwrap();
    assert_eq!(String::from_utf8(o.stdout).unwrap(), "[257,120,256,256]\n", "{}", String::from_utf8_lossy(&o.stderr));
}

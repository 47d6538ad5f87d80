//! The tokenizer against HF's ids for every fixture case, from both file formats.

mod common;

use batch_forge::tokenizer::{StreamDecoder, Tokenizer};
use common::*;
use serde_json::Value;

fn cases() -> Vec<Value> {
    std::fs::read_to_string(fixture("gpt2-tokenizer/cases.jsonl"))
        .unwrap()
        .split('\n')
        .filter(|l| !l.is_empty())
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn check_all(tok: &Tokenizer) {
    let cases = cases();
    assert_eq!(cases.len(), 363);
    let mut failures = Vec::new();
    for case in &cases {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids"]);
        let got = tok.encode_ordinary(text);
        if got != want {
            failures.push(format!("{} {text:?}: got {got:?} want {want:?}", case["category"]));
        }
        let want_special = case.get("ids_special").map(ids).unwrap_or(want.clone());
        if tok.encode(text) != want_special {
            failures.push(format!("special {text:?}"));
        }
        assert_eq!(tok.decode(&got).unwrap(), text, "round trip");
    }
    assert!(failures.is_empty(), "{} mismatches:\n{}", failures.len(), failures.join("\n"));
}

#[test]
fn tokenizer_json_matches_hf_on_every_case() {
    check_all(&Tokenizer::from_tokenizer_json(&fixture("gpt2-tokenizer/tokenizer.json")).unwrap());
}

#[test]
fn vocab_and_merges_match_hf_on_every_case() {
    let dir = fixture("gpt2-tokenizer");
    check_all(&Tokenizer::from_vocab_merges(&dir.join("vocab.json"), &dir.join("merges.txt")).unwrap());
}

#[test]
fn streaming_decode_emits_only_complete_utf8_and_equals_full_decode() {
    let tok = Tokenizer::from_dir(&fixture("gpt2-tokenizer")).unwrap();
    let mut held_back = 0;
    for case in cases() {
        let text = case["text"].as_str().unwrap();
        let mut stream = StreamDecoder::new();
        let mut out = String::new();
        for id in tok.encode_ordinary(text) {
            out.push_str(&stream.push(tok.token_bytes(id).unwrap()));
            held_back += usize::from(stream.pending_len() > 0);
        }
        out.push_str(&stream.finish());
        assert_eq!(out, text);
    }
    assert!(held_back > 10, "the cases should include characters split across tokens");
}

#[test]
fn special_token_id_and_out_of_range_ids() {
    let tok = Tokenizer::from_dir(&fixture("gpt2-tokenizer")).unwrap();
    assert_eq!(tok.special_id("<|endoftext|>"), Some(50256));
    assert_eq!(tok.encode("a<|endoftext|>b"), [64, 50256, 65]);
    assert_eq!(tok.decode(&[50256]).unwrap(), "<|endoftext|>");
    assert!(tok.decode(&[50257]).unwrap_err().to_string().contains("out of range"));
}

#[test]
fn malformed_tokenizer_files_give_errors() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("tokenizer.json");
    for (content, want) in [
        ("{", "invalid JSON"),
        (r#"{"model":{"type":"Unigram"}}"#, "not supported"),
        (r#"{"model":{"type":"BPE","vocab":{},"merges":[]},"pre_tokenizer":{"type":"Metaspace"}}"#, "not supported"),
        (
            r#"{"model":{"type":"BPE","vocab":{"a":0},"merges":[]},"pre_tokenizer":{"type":"ByteLevel"}}"#,
            "lacks the single byte",
        ),
    ] {
        std::fs::write(&p, content).unwrap();
        let e = Tokenizer::from_tokenizer_json(&p).err().unwrap().to_string();
        assert!(e.contains(want), "{e}");
    }
    assert!(Tokenizer::from_dir(dir.path().join("nope").as_path()).is_err());
}

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

/// Llama 3's and Qwen 2's pre-tokenizer patterns split 694 texts (fixture cases, edge cases,
/// multilingual corpus lines) as HF tokenizers' `Split(Regex, "isolated")` does, and a
/// byte-level BPE `tokenizer.json` with either model's pipeline (Split then ByteLevel
/// without its pattern) loads as that pre-tokenizer and gives HF's ids
/// (tests/fixtures/pretokenizers.jsonl, scripts/make_pretokenizer_fixture.py).
#[test]
fn llama3_and_qwen2_pre_tokenizers_equal_hf() {
    use batch_forge::tokenizer::{LLAMA3_PATTERN, PreTokenizer, QWEN2_PATTERN, llama3_pieces};
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(common::fixture("pretokenizers.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 694);
    let json = std::fs::read_to_string(common::fixture("tiny-llama/tokenizer.json")).unwrap();
    for (name, digits, pattern, want_pre) in
        [("llama3", 3, LLAMA3_PATTERN, PreTokenizer::Llama3), ("qwen2", 1, QWEN2_PATTERN, PreTokenizer::Qwen2)]
    {
        let mut root: serde_json::Value = serde_json::from_str(&json).unwrap();
        root["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]});
        let tok = Tokenizer::parse_tokenizer_json(std::path::Path::new("t.json"), &root.to_string()).unwrap();
        assert_eq!(tok.pre_tokenizer(), want_pre);
        let mut multi_digit = 0;
        for row in &rows {
            let text = row["text"].as_str().unwrap();
            let want: Vec<&str> = row[name].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
            assert_eq!(llama3_pieces(text, digits).collect::<Vec<_>>(), want, "{name}: {text:?}");
            assert_eq!(tok.encode(text), common::ids(&row[format!("{name}_ids")]), "{name}: {text:?}");
            multi_digit += usize::from(want.iter().any(|p| p.chars().filter(char::is_ascii_digit).count() > 1));
        }
        assert_eq!(multi_digit > 0, digits > 1, "{name}: pieces of several digits");
        // Another pattern is refused by name, not run as something else.
        root["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = serde_json::json!("\\s+");
        let err = Tokenizer::parse_tokenizer_json(std::path::Path::new("t.json"), &root.to_string()).err().unwrap();
        assert!(err.to_string().contains("is not supported"), "{err}");
    }
}

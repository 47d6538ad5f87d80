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
        (r#"{"model":{"type":"BPE","vocab":{},"merges":[],"dropout":0.1}}"#, "model.dropout = 0.1 is not supported"),
        (r#"{"model":{"type":"BPE","vocab":{},"merges":[]},"normalizer":{"type":"NFKC"}}"#, "normalizer"),
        (
            r#"{"model":{"type":"BPE","vocab":{},"merges":[]},"pre_tokenizer":{"type":"Split","pattern":{"Regex":"x+"},"behavior":"Isolated"}}"#,
            "Split with pattern",
        ),
        (
            r#"{"model":{"type":"BPE","vocab":{},"merges":[]},"pre_tokenizer":{"type":"Metaspace","replacement":"ab"}}"#,
            "Metaspace with replacement \"ab\" is not supported",
        ),
        (
            r#"{"model":{"type":"BPE","vocab":{"a":0},"merges":[],"unk_token":"<unk>"},"decoder":{"type":"Fuse"}}"#,
            "unk_token \"<unk>\" is not in",
        ),
        (r#"{"model":{"type":"BPE","vocab":{"a":0},"merges":[]},"decoder":{"type":"WordPiece"}}"#, "decoder step"),
        (
            r#"{"model":{"type":"BPE","vocab":{"a":0},"merges":[]},"normalizer":{"type":"NFC"},
                "added_tokens":[{"id":1,"content":"<s>","special":true,"normalized":true}]}"#,
            "matched after normalization",
        ),
        (
            r#"{"model":{"type":"BPE","vocab":{"a":0,"b":1},"merges":["a b"]},"decoder":{"type":"Fuse"}}"#,
            "merge token \"ab\" is not in",
        ),
        (r#"{"model":{"type":"BPE","vocab":{"a":0},"merges":[]}}"#, "without a decoder is not supported"),
        (
            r#"{"model":{"type":"BPE","vocab":{"a":0},"merges":[]},"decoder":{"type":"Sequence","decoders":[
                {"type":"Strip","content":" ","start":1,"stop":0},{"type":"Fuse"}]}}"#,
            "decoder step",
        ),
        (
            r#"{"model":{"type":"BPE","vocab":{"a":0},"merges":[]},"decoder":{"type":"Fuse"},"normalizer":{"type":"Sequence",
                "normalizers":[{"type":"Replace","pattern":{"String":"a"},"content":"aaaa"},
                {"type":"Replace","pattern":{"String":"a"},"content":"aaaa"},{"type":"Replace","pattern":{"String":"a"},"content":"aaaa"},
                {"type":"Replace","pattern":{"String":"a"},"content":"aaaa"}]}}"#,
            "256× longer",
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

fn jsonl(name: &str) -> Vec<Value> {
    std::fs::read_to_string(fixture(name)).unwrap().lines().map(|l| serde_json::from_str(l).unwrap()).collect()
}

/// SentencePiece-style `tokenizer.json` pipelines (character-level BPE with byte fallback
/// and `fuse_unk`: Llama 2's Prepend + Replace, Metaspace first and always-with-split,
/// Gemma's Replace + Split, NFC + Split on `▁` with each of HF's five behaviours) and
/// Qwen 2's byte-level one with its NFC normalizer give HF tokenizers' ids on 447 texts;
/// the character-level ones decode those ids, and id sequences text does not produce
/// (invalid byte runs, `▁▁` or an added token first), as HF decodes them
/// (tests/fixtures/spm-json, scripts/make_spm_json_fixture.py).
#[test]
fn sentencepiece_style_and_nfc_pipelines_equal_hf() {
    use batch_forge::tokenizer::TokenizerModel;
    let read =
        |name: &str| -> Value { serde_json::from_str(&std::fs::read_to_string(fixture(name)).unwrap()).unwrap() };
    let (spm, tiny_llama) = (read("spm-json/tokenizer.json"), read("tiny-llama/tokenizer.json"));
    let pipelines = read("spm-json/pipelines.json");
    let rows = jsonl("spm-json/cases.jsonl");
    assert_eq!(rows.len(), 447);
    let decode_rows = jsonl("spm-json/decode.jsonl");
    assert_eq!(decode_rows.len(), 9);
    assert_eq!(pipelines.as_object().unwrap().len(), 10);
    for (name, p) in pipelines.as_object().unwrap() {
        let mut root = if p["base"] == "tiny-llama" { tiny_llama.clone() } else { spm.clone() };
        for k in ["normalizer", "pre_tokenizer", "decoder"] {
            root[k] = p[k].clone();
        }
        let tok = Tokenizer::parse_tokenizer_json(std::path::Path::new("t.json"), &root.to_string()).unwrap();
        let byte_level = p["base"] == "tiny-llama";
        let want_model = if byte_level { TokenizerModel::ByteLevelBpe } else { TokenizerModel::SentencePiece };
        assert_eq!(tok.model(), want_model, "{name}");
        let (mut checked, mut decoded) = (0, 0);
        for row in &rows {
            let Some(want) = row.get(name.as_str()) else { continue };
            let text = row["text"].as_str().unwrap();
            let got = tok.encode(text);
            assert_eq!(got, ids(want), "{name}: {text:?}");
            checked += 1;
            if !byte_level {
                let want_text = row["decoded"].get(name.as_str()).and_then(Value::as_str).unwrap_or(text);
                assert_eq!(tok.decode(&got).unwrap(), want_text, "{name} decode: {text:?}");
                decoded += 1;
            }
        }
        assert!(checked >= 260, "{name}: {checked} texts");
        assert!(byte_level || decoded == checked, "{name}");
        if !byte_level {
            assert_eq!(tok.bos_to_add(), Some(1), "{name}");
            for row in &decode_rows {
                assert_eq!(
                    tok.decode(&ids(&row["ids"])).unwrap(),
                    row[name.as_str()].as_str().unwrap(),
                    "{name}: {row}"
                );
            }
        }
    }
    // The fixture tells the pipelines apart, and exercises NFC, byte fallback and `<unk>`.
    let differ =
        |a: &str, b: &str| rows.iter().filter(|r| r.get(a).is_some() && r.get(b).is_some() && r[a] != r[b]).count();
    for (a, b) in [
        ("llama2", "metaspace_first"),
        ("metaspace_first", "metaspace_always"),
        ("llama2", "gemma"),
        ("nfc_split_isolated", "nfc_split_contiguous"),
        ("nfc_split_merged_with_previous", "nfc_split_merged_with_next"),
        ("nfc_split_removed", "nfc_split_isolated"),
    ] {
        assert!(differ(a, b) > 0, "{a} and {b} give the same ids on every text");
    }
    let has = |name: &str, id: u32| {
        rows.iter().filter(|r| r[name].as_array().is_some_and(|a| a.contains(&id.into()))).count()
    };
    assert!(has("llama2", 0) > 1, "no <unk>");
    assert!(has("llama2", 3 + 0xE3) > 1, "no byte fallback");
    let nfc = rows.iter().find(|r| r["text"].as_str().unwrap().starts_with("e\u{301}t")).unwrap();
    let mut no_nfc = spm.clone();
    no_nfc["normalizer"] = serde_json::json!({"type": "Replace", "pattern": {"String": " "}, "content": "▁"});
    no_nfc["pre_tokenizer"] = pipelines["nfc_split_isolated"]["pre_tokenizer"].clone();
    let no_nfc = Tokenizer::parse_tokenizer_json(std::path::Path::new("t.json"), &no_nfc.to_string()).unwrap();
    assert_ne!(no_nfc.encode(nfc["text"].as_str().unwrap()), ids(&nfc["nfc_split_isolated"]), "NFC changes nothing");
}

/// GPT-4o's and Tekken's pre-tokenizer patterns (words split where lower case turns to
/// upper, marks and modifier letters in both cases) split 1,110 texts as HF tokenizers'
/// `Split(Regex, "isolated")` does, and a byte-level `tokenizer.json` with either pipeline
/// loads as that pre-tokenizer and gives HF's ids (tests/fixtures/pretokenizers-case-split.jsonl,
/// scripts/make_case_split_fixture.py, which checks the patterns against transformers').
#[test]
fn gpt4o_and_tekken_pre_tokenizers_equal_hf() {
    use batch_forge::tokenizer::{GPT4O_PATTERN, PreTokenizer, TEKKEN_PATTERN, gpt4o_pieces};
    let rows = jsonl("pretokenizers-case-split.jsonl");
    assert_eq!(rows.len(), 1110);
    let json = std::fs::read_to_string(fixture("tiny-llama/tokenizer.json")).unwrap();
    for (name, tekken, pattern, want_pre) in
        [("gpt4o", false, GPT4O_PATTERN, PreTokenizer::Gpt4o), ("tekken", true, TEKKEN_PATTERN, PreTokenizer::Tekken)]
    {
        let mut root: Value = serde_json::from_str(&json).unwrap();
        root["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": pattern}, "behavior": "Isolated", "invert": false},
            {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]});
        let tok = Tokenizer::parse_tokenizer_json(std::path::Path::new("t.json"), &root.to_string()).unwrap();
        assert_eq!(tok.pre_tokenizer(), want_pre);
        let (mut with_ids, mut case_splits) = (0, 0);
        for row in &rows {
            let text = row["text"].as_str().unwrap();
            let want: Vec<&str> = row[name].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
            let got: Vec<&str> = gpt4o_pieces(text, tekken).collect();
            assert_eq!(got, want, "{name}: {text:?}");
            if let Some(want_ids) = row.get(format!("{name}_ids")) {
                assert_eq!(tok.encode(text), ids(want_ids), "{name}: {text:?}");
                with_ids += 1;
            }
            // Pieces that begin with an upper-case letter right after a lower-case one.
            case_splits += usize::from(want.windows(2).any(|w| {
                w[0].chars().last().is_some_and(char::is_lowercase)
                    && w[1].chars().next().is_some_and(char::is_uppercase)
            }));
        }
        assert!(with_ids > 800, "{name}: {with_ids} texts with ids");
        assert!(case_splits > 3, "{name}: {case_splits} texts split at a case change");
    }
    assert_eq!(gpt4o_pieces("helloWorld DON'T", false).collect::<Vec<_>>(), ["hello", "World", " DON'T"]);
    assert_eq!(gpt4o_pieces("helloWorld DON'T", true).collect::<Vec<_>>(), ["hello", "World", " DON", "'T"]);
}

/// Qwen 3.5's pattern (Qwen 2's with marks in words) splits the same 1,110 texts as HF
/// tokenizers does, and a byte-level `tokenizer.json` with it loads as `qwen35` and gives
/// HF's ids (tests/fixtures/pretokenizers-case-split.jsonl, whose script checks the
/// pattern against transformers').
#[test]
fn qwen35_pre_tokenizer_equals_hf() {
    use batch_forge::tokenizer::{PreTokenizer, QWEN35_PATTERN, llama3_pieces, qwen35_pieces};
    let rows = jsonl("pretokenizers-case-split.jsonl");
    let json = std::fs::read_to_string(fixture("tiny-llama/tokenizer.json")).unwrap();
    let mut root: Value = serde_json::from_str(&json).unwrap();
    root["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": [
        {"type": "Split", "pattern": {"Regex": QWEN35_PATTERN}, "behavior": "Isolated", "invert": false},
        {"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}]});
    let tok = Tokenizer::parse_tokenizer_json(std::path::Path::new("t.json"), &root.to_string()).unwrap();
    assert_eq!(tok.pre_tokenizer(), PreTokenizer::Qwen35);
    let (mut with_ids, mut unlike_qwen2) = (0, 0);
    for row in &rows {
        let text = row["text"].as_str().unwrap();
        let want: Vec<&str> = row["qwen35"].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
        assert_eq!(qwen35_pieces(text).collect::<Vec<_>>(), want, "{text:?}");
        if let Some(want_ids) = row.get("qwen35_ids") {
            assert_eq!(tok.encode(text), ids(want_ids), "{text:?}");
            with_ids += 1;
        }
        unlike_qwen2 += usize::from(llama3_pieces(text, 1).collect::<Vec<_>>() != want);
    }
    assert!(with_ids > 800, "{with_ids} texts with ids");
    assert!(unlike_qwen2 > 100, "{unlike_qwen2} texts split unlike Qwen 2");
}

/// DeepSeek's and MiniCPM 5's chains of isolated regex splits (DeepSeek LLM, Coder, V3,
/// and LLM's and Coder's as their own files end them, with HF's `Digits`) split 1,120 texts (the pre-tokenizer
/// fixtures' texts, CJK, kana, Hangul, full-width forms, exotic and trailing spaces, 400
/// random mixes, spaces before numbers) as HF tokenizers' `Sequence` does, and a byte-level `tokenizer.json` with
/// the chain loads as that pre-tokenizer and gives HF's ids
/// (tests/fixtures/pretokenizers-split-chain.jsonl, scripts/make_split_chain_fixture.py,
/// which checks the chains against llama.cpp's).
#[test]
fn split_chains_equal_hf() {
    use batch_forge::tokenizer::{
        DEEPSEEK_CODER_SPLITS, DEEPSEEK_LLM_SPLITS, DEEPSEEK_V3_SPLITS, MINICPM5_SPLITS, PreTokenizer, llama3_pieces,
        split_chain_pieces,
    };
    let rows = jsonl("pretokenizers-split-chain.jsonl");
    assert_eq!(rows.len(), 1120);
    let json = std::fs::read_to_string(fixture("tiny-llama/tokenizer.json")).unwrap();
    let split = |p: &&str| serde_json::json!({"type": "Split", "pattern": {"Regex": p}, "behavior": "Isolated", "invert": false});
    let digits = |individual: bool| serde_json::json!({"type": "Digits", "individual_digits": individual});
    let steps = |chain: &[&str], last: Option<Value>| -> Vec<Value> {
        let mut v: Vec<Value> = chain.iter().map(split).collect();
        v.extend(last);
        v
    };
    let (llm, coder) = (&DEEPSEEK_LLM_SPLITS[..5], &DEEPSEEK_CODER_SPLITS[..4]);
    // (fixture key, pipeline as the fixture ran it, the same in another form, what loads)
    let cases = [
        ("deepseek-llm", steps(&DEEPSEEK_LLM_SPLITS, None), steps(llm, Some(digits(false))), PreTokenizer::DeepSeekLlm),
        (
            "deepseek-llm-digits",
            steps(llm, Some(digits(true))),
            steps(llm, Some(split(&"\\p{N}"))),
            PreTokenizer::DeepSeekLlmDigits,
        ),
        (
            "deepseek-coder",
            steps(coder, Some(digits(true))),
            steps(&DEEPSEEK_CODER_SPLITS, None),
            PreTokenizer::DeepSeekCoder,
        ),
        ("deepseek-v3", steps(&DEEPSEEK_V3_SPLITS, None), steps(&DEEPSEEK_V3_SPLITS, None), PreTokenizer::DeepSeekV3),
        ("minicpm5", steps(&MINICPM5_SPLITS, None), steps(&MINICPM5_SPLITS, None), PreTokenizer::MiniCpm5),
    ];
    let with_pre = |pipeline: &[Value]| {
        let mut root: Value = serde_json::from_str(&json).unwrap();
        let mut p = pipeline.to_vec();
        p.push(serde_json::json!({"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": false}));
        root["pre_tokenizer"] = serde_json::json!({"type": "Sequence", "pretokenizers": p});
        root
    };
    let load = |root: &Value| Tokenizer::parse_tokenizer_json(std::path::Path::new("t.json"), &root.to_string());
    for (name, pipeline, other_form, want_pre) in cases {
        let root = with_pre(&pipeline);
        let tok = load(&root).unwrap();
        assert_eq!(tok.pre_tokenizer(), want_pre);
        assert_eq!(load(&with_pre(&other_form)).unwrap().pre_tokenizer(), want_pre, "{name}: other form");
        let (mut with_ids, mut unlike_llama3) = (0, 0);
        for row in &rows {
            let text = row["text"].as_str().unwrap();
            let want: Vec<&str> = row[name].as_array().unwrap().iter().map(|p| p.as_str().unwrap()).collect();
            assert_eq!(split_chain_pieces(text, want_pre).unwrap(), want, "{name}: {text:?}");
            if let Some(want_ids) = row.get(format!("{name}_ids")) {
                assert_eq!(tok.encode(text), ids(want_ids), "{name}: {text:?}");
                with_ids += 1;
            }
            unlike_llama3 += usize::from(llama3_pieces(text, 3).collect::<Vec<_>>() != want);
        }
        assert!(with_ids > 1000, "{name}: {with_ids} texts with ids");
        // MiniCPM 5 differs from Llama 3 only where spaces run up to a number.
        let least = if name == "minicpm5" { 10 } else { 300 };
        assert!(unlike_llama3 > least, "{name}: {unlike_llama3} texts split unlike Llama 3");
        // A chain written with `\r` and `\n` escapes for the characters (or the characters
        // for the escapes) loads the same.
        let mut escaped = root.clone();
        for step in escaped["pre_tokenizer"]["pretokenizers"].as_array_mut().unwrap() {
            if let Some(p) = step["pattern"]["Regex"].as_str() {
                step["pattern"]["Regex"] = if p.contains(['\r', '\n']) {
                    p.replace('\r', "\\r").replace('\n', "\\n")
                } else {
                    p.replace("\\r", "\r").replace("\\n", "\n")
                }
                .into();
            }
        }
        assert_ne!(escaped, root);
        assert_eq!(load(&escaped).unwrap().pre_tokenizer(), want_pre);
        // A chain with a split changed is refused by name.
        let mut changed = root.clone();
        changed["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = serde_json::json!("\\s+");
        assert!(load(&changed).err().unwrap().to_string().contains("is not supported"));
    }
    // LLM's two endings split numbers differently.
    let pieces = |pre| split_chain_pieces("x 2024", pre).unwrap();
    assert_eq!(pieces(PreTokenizer::DeepSeekLlm), ["x", " ", "2024"]);
    assert_eq!(pieces(PreTokenizer::DeepSeekLlmDigits), ["x", " ", "2", "0", "2", "4"]);
    assert_eq!(split_chain_pieces("x", PreTokenizer::Llama3), None);
}

//! Chat templates against HF transformers' `apply_chat_template`
//! (`tests/fixtures/chat/cases.json`, written by `scripts/make_chat_fixture.py`): SmolLM2's
//! template and four others exercising what real templates use, over conversations with
//! system prompts, several turns, unicode, edge whitespace and empty messages.

use std::path::PathBuf;

use batch_forge::chat::{ChatTemplate, Message};
use batch_forge::loaders::gguf::GgufFile;
use batch_forge::tokenizer::Tokenizer;
use serde_json::Value;

fn fixture(p: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(p)
}

fn cases() -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture("chat/cases.json")).unwrap()).unwrap()
}

fn messages(v: &Value) -> Vec<Message> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|m| Message::new(m["role"].as_str().unwrap(), m["content"].as_str().unwrap()))
        .collect()
}

#[test]
fn every_case_renders_and_tokenizes_as_hf() {
    let all = cases();
    let (bos, eos) = (all["bos_token"].as_str().unwrap(), all["eos_token"].as_str().unwrap());
    let tokenizer =
        Tokenizer::from_gguf(&GgufFile::open(&fixture("smollm2-tokenizer/tokenizer.gguf")).unwrap()).unwrap();
    let mut checked = 0;
    for case in all["cases"].as_array().unwrap() {
        let name = case["template"].as_str().unwrap();
        let template = ChatTemplate::new(all["templates"][name].as_str().unwrap(), bos, eos).unwrap();
        let msgs = messages(&case["messages"]);
        let add_gen = case["add_generation_prompt"].as_bool().unwrap();
        let got = template.render(&msgs, add_gen);
        match case.get("text") {
            Some(text) => {
                let got = got.unwrap_or_else(|e| panic!("{name} {msgs:?}: {e:#}"));
                assert_eq!(got, text.as_str().unwrap(), "{name} {msgs:?} add_gen={add_gen}");
                let want: Vec<u32> =
                    case["ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
                assert_eq!(tokenizer.encode(&got), want, "{name} {msgs:?} add_gen={add_gen}: ids");
            }
            None => {
                let err = format!("{:#}", got.expect_err("HF raised here"));
                assert!(err.contains("must alternate"), "{name}: {err}");
            }
        }
        checked += 1;
    }
    assert_eq!(checked, 60);
}

/// The GGUF's own template, with BOS/EOS texts from its token ids.
#[test]
fn the_template_comes_from_the_gguf() {
    let file = GgufFile::open(&fixture("smollm2-tokenizer/tokenizer.gguf")).unwrap();
    let tokenizer = Tokenizer::from_gguf(&file).unwrap();
    let template = ChatTemplate::from_gguf(&file, &tokenizer).unwrap().expect("SmolLM2 has a chat template");
    let all = cases();
    let case = all["cases"].as_array().unwrap().iter().find(|c| c["template"] == "smollm2").unwrap();
    let got = template.render(&messages(&case["messages"]), case["add_generation_prompt"].as_bool().unwrap()).unwrap();
    assert_eq!(got, case["text"].as_str().unwrap());
}

/// Hostile templates: a syntax error at load, an endless loop stopped by fuel, an unknown
/// function: errors, never a hang or a panic.
#[test]
fn bad_templates_are_errors() {
    let err = ChatTemplate::new("{% for m in messages %}", "", "").unwrap_err();
    assert!(format!("{err:#}").contains("does not compile"), "{err:#}");
    // 10^10 steps (each range within minijinja's 100000 cap): only fuel stops it.
    let t = ChatTemplate::new(
        "{% for i in range(100000) %}{% for j in range(100000) %}{{ j }}{% endfor %}{% endfor %}",
        "",
        "",
    )
    .unwrap();
    let start = std::time::Instant::now();
    assert!(t.render(&[Message::new("user", "hi")], true).is_err());
    assert!(start.elapsed().as_secs() < 30, "fuel must stop it");
    let t = ChatTemplate::new("{{ no_such_function('%Y') }}", "", "").unwrap();
    assert!(t.render(&[], true).is_err());
    let t = ChatTemplate::new("{{ raise_exception('no system role') }}", "", "").unwrap();
    assert!(format!("{:#}", t.render(&[], true).unwrap_err()).contains("no system role"));
}

/// What HF's `apply_chat_template` passes besides the messages: `tools` and `documents`
/// are none, `strftime_now` formats the local date.
#[test]
fn the_context_has_what_hf_passes() {
    let t = ChatTemplate::new(
        "{% if tools is not none %}tools{% endif %}{% if documents is none %}no documents{% endif %} {{ strftime_now('%Y') }}",
        "",
        "",
    )
    .unwrap();
    let out = t.render(&[], false).unwrap();
    assert!(out.starts_with("no documents 20"), "{out}");
    assert_eq!(out.len(), "no documents 2026".len(), "{out}");
}

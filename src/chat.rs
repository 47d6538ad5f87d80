//! Chat templates: the Jinja template a model ships (GGUF `tokenizer.chat_template`; an HF
//! folder's `chat_template.jinja` or `tokenizer_config.json`), rendered as HF transformers'
//! `apply_chat_template` renders it: minijinja with jinja2's `trim_blocks` and
//! `lstrip_blocks`, Python's string methods (`.strip()`, `.startswith()`, …),
//! `raise_exception`, and HF's `tojson` (`json.dumps(ensure_ascii=False)`). The context
//! holds `messages`, `add_generation_prompt`, `bos_token` and `eos_token`.

use std::path::Path;

use anyhow::{Context, bail};
use minijinja::value::ValueKind;
use minijinja::{Environment, Error, ErrorKind, Value, context};
use serde::{Deserialize, Serialize};

use crate::loaders::gguf::GgufFile;
use crate::tokenizer::Tokenizer;

/// One turn of a conversation.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Message {
    pub role: String,
    pub content: String,
}

impl Message {
    pub fn new(role: &str, content: &str) -> Self {
        Message { role: role.to_owned(), content: content.to_owned() }
    }
}

/// Instructions one rendering may execute: far beyond any real template over a long
/// conversation, and a bound on a hostile one (`{% for i in range(10**9) %}`).
const FUEL: u64 = 50_000_000;

pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("bos_token", &self.bos_token).field("eos_token", &self.eos_token).finish()
    }
}

impl ChatTemplate {
    /// Compile `source`; a syntax error is an error here, not at the first message.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> anyhow::Result<Self> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| anyhow::anyhow!("chat template syntax config: {e}"))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_fuel(Some(FUEL));
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_filter("tojson", |v: Value| -> Result<String, Error> {
            let mut out = String::new();
            py_json(&v, &mut out)?;
            Ok(out)
        });
        env.add_template_owned("chat", source.to_owned())
            .map_err(|e| anyhow::anyhow!("the chat template does not compile: {e}"))?;
        Ok(ChatTemplate { env, bos_token: bos_token.to_owned(), eos_token: eos_token.to_owned() })
    }

    /// The template of a GGUF file (`tokenizer.chat_template`), if it has one; BOS and EOS
    /// are the texts of its `tokenizer.ggml.bos/eos_token_id` tokens.
    pub fn from_gguf(file: &GgufFile, tokenizer: &Tokenizer) -> anyhow::Result<Option<Self>> {
        let Some(v) = file.get("tokenizer.chat_template") else { return Ok(None) };
        let source = v.as_str().context("tokenizer.chat_template is not a string")?;
        let text = |key: &str| -> String {
            file.get(key)
                .and_then(|v| v.as_u64())
                .and_then(|id| u32::try_from(id).ok())
                .and_then(|id| tokenizer.token_bytes(id).ok())
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default()
        };
        Self::new(source, &text("tokenizer.ggml.bos_token_id"), &text("tokenizer.ggml.eos_token_id")).map(Some)
    }

    /// The template of an HF model folder: `chat_template.jinja`, else the `chat_template`
    /// of `tokenizer_config.json` (a string, or a list of named templates: `default`).
    pub fn from_dir(dir: &Path) -> anyhow::Result<Option<Self>> {
        let config_path = dir.join("tokenizer_config.json");
        let config: serde_json::Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => {
                serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", config_path.display()))?
            }
            Err(_) => serde_json::Value::Null,
        };
        let token = |key: &str| -> String {
            match &config[key] {
                serde_json::Value::String(s) => s.clone(),
                v => v["content"].as_str().unwrap_or_default().to_owned(),
            }
        };
        let jinja = dir.join("chat_template.jinja");
        let source = if jinja.is_file() {
            std::fs::read_to_string(&jinja).with_context(|| format!("cannot read {}", jinja.display()))?
        } else {
            match &config["chat_template"] {
                serde_json::Value::Null => return Ok(None),
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Array(list) => {
                    let default = list.iter().find(|t| t["name"] == "default").or(list.first());
                    match default.and_then(|t| t["template"].as_str()) {
                        Some(s) => s.to_owned(),
                        None => bail!("{}: chat_template list has no template", config_path.display()),
                    }
                }
                _ => bail!("{}: chat_template is neither a string nor a list", config_path.display()),
            }
        };
        Self::new(&source, &token("bos_token"), &token("eos_token")).map(Some)
    }

    /// The conversation as the model's prompt text. A template that raises (e.g. roles
    /// that do not alternate) or runs out of fuel is an error with its message.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> anyhow::Result<String> {
        let template = self.env.get_template("chat").map_err(|e| anyhow::anyhow!("chat template: {e}"))?;
        template
            .render(context! {
                messages => messages_value(messages),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.as_str(),
                eos_token => self.eos_token.as_str(),
            })
            .map_err(|e| anyhow::anyhow!("the chat template failed: {}", e.detail().unwrap_or(&e.to_string())))
    }
}

/// The messages as the template sees them: a list of `{role, content}` maps.
fn messages_value(messages: &[Message]) -> Value {
    let list: Vec<Value> = messages
        .iter()
        .map(|m| {
            let map: std::collections::BTreeMap<&str, Value> =
                [("role", Value::from(m.role.as_str())), ("content", Value::from(m.content.as_str()))].into();
            Value::from(map)
        })
        .collect();
    Value::from(list)
}

/// `json.dumps(v, ensure_ascii=False)`: Python's separators (`", "`, `": "`), non-ASCII
/// kept, strings escaped as JSON requires (the same set Python escapes).
fn py_json(v: &Value, out: &mut String) -> Result<(), Error> {
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => out.push_str(&v.to_string()),
        ValueKind::String => {
            let s = v.as_str().unwrap_or_default();
            out.push_str(
                &serde_json::to_string(s).map_err(|e| Error::new(ErrorKind::InvalidOperation, e.to_string()))?,
            );
        }
        ValueKind::Seq | ValueKind::Iterable => {
            out.push('[');
            for (i, item) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_json(&item, out)?;
            }
            out.push(']');
        }
        ValueKind::Map => {
            out.push('{');
            for (i, key) in v.try_iter()?.enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                py_json(&Value::from(key.to_string()), out)?;
                out.push_str(": ");
                py_json(&v.get_item(&key)?, out)?;
            }
            out.push('}');
        }
        _ => return Err(Error::new(ErrorKind::InvalidOperation, format!("tojson: cannot serialize {v}"))),
    }
    Ok(())
}

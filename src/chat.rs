//! Chat templates: the Jinja template a model ships (GGUF `tokenizer.chat_template`; an HF
//! folder's `chat_template.jinja` or `tokenizer_config.json`), rendered as HF transformers'
//! `apply_chat_template` renders it: minijinja with jinja2's `trim_blocks` and
//! `lstrip_blocks`, Python's string methods (`.strip()`, `.startswith()`, …),
//! `raise_exception`, and HF's `tojson` (`json.dumps(ensure_ascii=False)`). The context
//! holds `messages`, `add_generation_prompt`, `bos_token` and `eos_token`.

use std::path::{Path, PathBuf};

use minijinja::value::ValueKind;
use minijinja::{Environment, Error, ErrorKind, Value, context};
use serde::{Deserialize, Serialize};

use crate::loaders::gguf::GgufFile;
use crate::tokenizer::Tokenizer;

/// What can go wrong with a chat template: the file that holds it, its syntax, or its
/// rendering of a conversation (the last two are the template's or the caller's fault,
/// never the engine's).
#[derive(Debug, thiserror::Error)]
pub enum TemplateError {
    /// The file that holds the template cannot be read or is malformed.
    #[error("{}: {message}", path.display())]
    File { path: PathBuf, message: String },
    /// The template does not compile.
    #[error("the chat template does not compile: {0}")]
    Compile(String),
    /// Rendering failed: the template raised (`raise_exception`, e.g. roles that do not
    /// alternate), ran out of fuel, or met a value it cannot handle.
    #[error("the chat template failed: {0}")]
    Render(String),
    /// The model ships no template.
    #[error(
        "this model has no chat template (GGUF tokenizer.chat_template, or chat_template in tokenizer_config.json)"
    )]
    Missing,
    /// The model's template could not be loaded; why, as it was said at load.
    #[error("the model's chat template cannot be used: {0}")]
    Unusable(String),
}

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
    /// Further special tokens HF passes (`unk_token`, `pad_token`), where the files name them.
    extra_tokens: Vec<(&'static str, String)>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").field("bos_token", &self.bos_token).field("eos_token", &self.eos_token).finish()
    }
}

impl ChatTemplate {
    /// Compile `source`; a syntax error is an error here, not at the first message.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TemplateError> {
        let mut env = Environment::new();
        env.set_syntax(
            minijinja::syntax::SyntaxConfig::builder()
                .trim_blocks(true)
                .lstrip_blocks(true)
                .build()
                .map_err(|e| TemplateError::Compile(format!("syntax config: {e}")))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_fuel(Some(FUEL));
        env.add_function("raise_exception", |msg: String| -> Result<Value, Error> {
            Err(Error::new(ErrorKind::InvalidOperation, msg))
        });
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", |v: Value| -> Result<String, Error> {
            let mut out = String::new();
            py_json(&v, &mut out)?;
            Ok(out)
        });
        env.add_template_owned("chat", source.to_owned()).map_err(|e| TemplateError::Compile(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            bos_token: bos_token.to_owned(),
            eos_token: eos_token.to_owned(),
            extra_tokens: Vec::new(),
        })
    }

    /// The template of a GGUF file (`tokenizer.chat_template`), if it has one; BOS and EOS
    /// are the texts of its `tokenizer.ggml.bos/eos_token_id` tokens.
    pub fn from_gguf(file: &GgufFile, tokenizer: &Tokenizer) -> Result<Option<Self>, TemplateError> {
        let Some(v) = file.get("tokenizer.chat_template") else { return Ok(None) };
        let source = v.as_str().ok_or_else(|| TemplateError::File {
            path: file.path().to_owned(),
            message: "tokenizer.chat_template is not a string".into(),
        })?;
        let text = |key: &str| -> String {
            file.get(key)
                .and_then(|v| v.as_u64())
                .and_then(|id| u32::try_from(id).ok())
                .and_then(|id| tokenizer.token_bytes(id).ok())
                .map(|b| String::from_utf8_lossy(b).into_owned())
                .unwrap_or_default()
        };
        let mut t = Self::new(source, &text("tokenizer.ggml.bos_token_id"), &text("tokenizer.ggml.eos_token_id"))?;
        for (name, key) in
            [("unk_token", "tokenizer.ggml.unknown_token_id"), ("pad_token", "tokenizer.ggml.padding_token_id")]
        {
            if file.get(key).is_some() {
                t.extra_tokens.push((name, text(key)));
            }
        }
        Ok(Some(t))
    }

    /// The template of an HF model folder: `chat_template.jinja`, else the `chat_template`
    /// of `tokenizer_config.json` (a string, or a list of named templates: `default`).
    pub fn from_dir(dir: &Path) -> Result<Option<Self>, TemplateError> {
        let config_path = dir.join("tokenizer_config.json");
        let file_error = |path: &Path, message: String| TemplateError::File { path: path.to_owned(), message };
        let config: serde_json::Value = match std::fs::read_to_string(&config_path) {
            Ok(text) => {
                serde_json::from_str(&text).map_err(|e| file_error(&config_path, format!("invalid JSON: {e}")))?
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
            std::fs::read_to_string(&jinja).map_err(|e| file_error(&jinja, format!("cannot read it: {e}")))?
        } else {
            match &config["chat_template"] {
                serde_json::Value::Null => return Ok(None),
                serde_json::Value::String(s) => s.clone(),
                serde_json::Value::Array(list) => {
                    let default = list.iter().find(|t| t["name"] == "default").or(list.first());
                    match default.and_then(|t| t["template"].as_str()) {
                        Some(s) => s.to_owned(),
                        None => return Err(file_error(&config_path, "chat_template list has no template".into())),
                    }
                }
                _ => return Err(file_error(&config_path, "chat_template is neither a string nor a list".into())),
            }
        };
        let mut t = Self::new(&source, &token("bos_token"), &token("eos_token"))?;
        for name in ["unk_token", "pad_token"] {
            if !config[name].is_null() {
                t.extra_tokens.push((name, token(name)));
            }
        }
        Ok(Some(t))
    }

    /// The conversation as the model's prompt text. A template that raises (e.g. roles
    /// that do not alternate) or runs out of fuel is an error with its message.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> Result<String, TemplateError> {
        let template = self.env.get_template("chat").map_err(|e| TemplateError::Compile(e.to_string()))?;
        let extra: std::collections::BTreeMap<&str, Value> =
            self.extra_tokens.iter().map(|(k, v)| (*k, Value::from(v.as_str()))).collect();
        template
            .render(context! {
                messages => messages_value(messages),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token.as_str(),
                eos_token => self.eos_token.as_str(),
                tools => Value::from(()),
                documents => Value::from(()),
                ..Value::from(extra)
            })
            .map_err(|e| TemplateError::Render(e.detail().map_or_else(|| e.to_string(), str::to_owned)))
    }
}

/// HF's `strftime_now(format)`: the local time formatted by C's `strftime`.
fn strftime_now(format: String) -> Result<String, Error> {
    #[cfg(unix)]
    {
        let fmt = std::ffi::CString::new(format)
            .map_err(|_| Error::new(ErrorKind::InvalidOperation, "strftime_now: a NUL in the format"))?;
        // SAFETY: `time` with a null pointer only returns the time; `localtime_r` writes
        // the zeroed `tm` we own; `strftime` writes at most `buf.len()` bytes into `buf`
        // from a NUL-terminated format, returning how many (0 if they did not fit).
        unsafe {
            let now = libc::time(std::ptr::null_mut());
            let mut tm: libc::tm = std::mem::zeroed();
            if libc::localtime_r(&now, &mut tm).is_null() {
                return Err(Error::new(ErrorKind::InvalidOperation, "strftime_now: no local time"));
            }
            let mut buf = [0u8; 512];
            let n = libc::strftime(buf.as_mut_ptr().cast(), buf.len(), fmt.as_ptr(), &tm);
            Ok(String::from_utf8_lossy(&buf[..n]).into_owned())
        }
    }
    #[cfg(not(unix))]
    {
        let _ = format;
        Err(Error::new(ErrorKind::InvalidOperation, "strftime_now is not available on this platform"))
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

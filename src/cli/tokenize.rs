//! `forge tokenize` (text → ids) and `forge detokenize` (ids → text), one text or a
//! JSON-lines corpus on stdin.

use std::io::{BufRead, Write};

use anyhow::Context;
use clap::Args;

use batch_forge::loaders::DEFAULT_MODEL;
use batch_forge::tokenizer::Tokenizer;

#[derive(Args)]
pub struct TokenizeArgs {
    /// Text to tokenize; omitted or `-`: read stdin, tokenized exactly as read (a trailing
    /// newline included, unless --strip-newline).
    text: Option<String>,
    /// Model folder, Hub id or .gguf file whose tokenizer to use.
    #[arg(long, short, default_value = DEFAULT_MODEL)]
    model: String,
    /// Read JSON objects with a "text" string, one per line, from stdin; write each object
    /// back with an "ids" array added (other fields kept; a blank line stays blank).
    #[arg(long)]
    jsonl: bool,
    /// Treat special-token text such as `<|endoftext|>` as plain text (tiktoken's encode_ordinary).
    #[arg(long)]
    ordinary: bool,
    /// Drop one trailing newline of text read from stdin (as llama.cpp does for prompt files).
    #[arg(long, conflicts_with = "jsonl")]
    strip_newline: bool,
}

#[derive(Args)]
pub struct DetokenizeArgs {
    /// Token ids (separated by spaces or commas, or one JSON array such as `forge tokenize`
    /// prints); omitted: read them from stdin.
    ids: Vec<String>,
    /// Model folder, Hub id or .gguf file whose tokenizer to use.
    #[arg(long, short, default_value = DEFAULT_MODEL)]
    model: String,
    /// Read JSON objects with an "ids" array, one per line, from stdin; write each object
    /// back with a "text" string added (other fields kept; a blank line stays blank).
    #[arg(long, conflicts_with = "ids")]
    jsonl: bool,
}

/// The tokenizer of `--model`: a `.gguf` file's metadata, or a folder's (or Hub
/// repo's) tokenizer files.
fn tokenizer_for(model: &str, command: &str) -> anyhow::Result<Tokenizer> {
    let path = std::path::Path::new(model);
    if path.is_file() && path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
        let g = batch_forge::loaders::gguf::GgufFile::open(path)?;
        return Ok(Tokenizer::from_gguf(&g)?);
    }
    let dir = super::model_dir(model, false, command)?;
    Ok(Tokenizer::from_dir(&dir)?)
}

fn read_stdin_text() -> anyhow::Result<String> {
    super::read_stdin_utf8("stdin")
}

/// Each stdin line as a JSON object, passed to `f` to add its fields; blank lines are
/// written back blank so output line N answers input line N.
fn map_jsonl(
    mut f: impl FnMut(usize, &mut serde_json::Map<String, serde_json::Value>) -> anyhow::Result<()>,
) -> anyhow::Result<()> {
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    for (i, line) in std::io::stdin().lock().lines().enumerate() {
        let n = i + 1;
        let line = line.with_context(|| format!("stdin line {n}: not valid UTF-8"))?;
        if line.trim().is_empty() {
            writeln!(out)?;
            continue;
        }
        let v: serde_json::Value =
            serde_json::from_str(&line).with_context(|| format!("stdin line {n}: invalid JSON"))?;
        let serde_json::Value::Object(mut obj) = v else {
            anyhow::bail!("stdin line {n}: expected a JSON object");
        };
        f(n, &mut obj)?;
        writeln!(out, "{}", serde_json::Value::Object(obj))?;
    }
    out.flush()?;
    Ok(())
}

pub fn run(args: TokenizeArgs) -> anyhow::Result<()> {
    // Flags first, before the model is looked up (which may reach for the Hub).
    anyhow::ensure!(!(args.jsonl && args.text.is_some()), "--jsonl reads stdin; do not also pass TEXT");
    let from_stdin = args.text.as_deref().is_none_or(|t| t == "-");
    anyhow::ensure!(!args.strip_newline || from_stdin, "--strip-newline applies to text read from stdin");
    let tok = tokenizer_for(&args.model, "tokenize")?;
    // A whole text, as the model would see it: BOS first and EOS last when it asks for
    // them (GGUF add_bos_token / add_eos_token; llama-tokenize does the same).
    let encode = |s: &str| {
        let mut ids: Vec<u32> = tok.bos_to_add().into_iter().collect();
        ids.extend(if args.ordinary { tok.encode_ordinary(s) } else { tok.encode(s) });
        ids.extend(tok.eos_to_add());
        ids
    };
    if args.jsonl {
        return map_jsonl(|n, obj| {
            let text = obj
                .get("text")
                .and_then(|t| t.as_str())
                .with_context(|| format!("stdin line {n}: no \"text\" string"))?;
            let ids = encode(text);
            obj.insert("ids".into(), ids.into());
            Ok(())
        });
    }
    let text = match args.text {
        Some(t) if t != "-" => t,
        _ => {
            let s = read_stdin_text()?;
            if args.strip_newline {
                super::drop_trailing_newline(s)
            } else {
                if s.ends_with('\n') {
                    eprintln!(
                        "note: the text on stdin ends with a newline, which is tokenized too (--strip-newline drops it)"
                    );
                }
                s
            }
        }
    };
    super::outln!("{}", serde_json::to_string(&encode(&text))?);
    Ok(())
}

/// Token ids from arguments or stdin text: whitespace- or comma-separated numbers,
/// optionally inside one JSON-style `[...]`.
fn parse_ids(text: &str) -> anyhow::Result<Vec<u32>> {
    let t = text.trim();
    let t = t.strip_prefix('[').and_then(|t| t.strip_suffix(']')).unwrap_or(t);
    t.split(|c: char| c == ',' || c.is_whitespace())
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<u32>().map_err(|_| anyhow::anyhow!("{s:?} is not a token id (a number from 0 to 4294967295)"))
        })
        .collect()
}

fn ids_of(v: &serde_json::Value) -> Option<Vec<u32>> {
    v.as_array()?.iter().map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok())).collect()
}

pub fn run_detokenize(args: DetokenizeArgs) -> anyhow::Result<()> {
    let ids = if args.jsonl {
        None
    } else if args.ids.is_empty() {
        Some(parse_ids(&read_stdin_text()?).context("stdin")?)
    } else {
        Some(parse_ids(&args.ids.join(" "))?)
    };
    let tok = tokenizer_for(&args.model, "detokenize")?;
    match ids {
        None => map_jsonl(|n, obj| {
            let ids = obj
                .get("ids")
                .and_then(ids_of)
                .with_context(|| format!("stdin line {n}: no \"ids\" array of token ids"))?;
            let text = tok.decode(&ids).with_context(|| format!("stdin line {n}"))?;
            obj.insert("text".into(), text.into());
            Ok(())
        }),
        // The tokens' exact bytes (no newline added), so `tokenize | detokenize` gives the text back.
        Some(ids) => {
            let bytes = tok.decode_bytes(&ids)?;
            let mut out = std::io::stdout().lock();
            out.write_all(&bytes)?;
            out.flush()?;
            Ok(())
        }
    }
}

//! `forge tokenize`: text → ids, one text or a JSON-lines corpus on stdin.

use std::io::{BufRead, Read, Write};

use anyhow::Context;
use clap::Args;

use batch_forge::loaders::DEFAULT_MODEL;
use batch_forge::tokenizer::Tokenizer;

#[derive(Args)]
pub struct TokenizeArgs {
    /// Text to tokenize (read from stdin when omitted).
    text: Option<String>,
    /// Model folder or Hub id whose tokenizer to use.
    #[arg(long, short, default_value = DEFAULT_MODEL)]
    model: String,
    /// Read `{"text": ...}` objects, one per line, from stdin; write `{"ids": [...]}` per line.
    #[arg(long)]
    jsonl: bool,
    /// Treat special-token text such as `<|endoftext|>` as plain text (tiktoken's encode_ordinary).
    #[arg(long)]
    ordinary: bool,
}

pub fn run(args: TokenizeArgs) -> anyhow::Result<()> {
    // Flags first, before the model is looked up (which may reach for the Hub).
    anyhow::ensure!(!(args.jsonl && args.text.is_some()), "--jsonl reads stdin; do not also pass TEXT");
    let dir = super::model_dir(&args.model, false)?;
    let tok = Tokenizer::from_dir(&dir)?;
    let encode = |s: &str| {
        if args.ordinary { tok.encode_ordinary(s) } else { tok.encode(s) }
    };
    let stdout = std::io::stdout();
    let mut out = std::io::BufWriter::new(stdout.lock());
    if args.jsonl {
        for (n, line) in std::io::stdin().lock().lines().enumerate() {
            let line = line.with_context(|| format!("stdin line {}: not valid UTF-8", n + 1))?;
            if line.trim().is_empty() {
                continue;
            }
            let v: serde_json::Value =
                serde_json::from_str(&line).with_context(|| format!("stdin line {}: invalid JSON", n + 1))?;
            let text = v["text"].as_str().with_context(|| format!("stdin line {}: no \"text\" string", n + 1))?;
            writeln!(out, "{}", serde_json::json!({ "ids": encode(text) }))?;
        }
    } else {
        let text = match args.text {
            Some(t) => t,
            None => {
                let mut s = String::new();
                std::io::stdin().read_to_string(&mut s).context("stdin is not valid UTF-8")?;
                s
            }
        };
        writeln!(out, "{}", serde_json::to_string(&encode(&text))?)?;
    }
    out.flush()?;
    Ok(())
}

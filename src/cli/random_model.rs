//! `forge random-model`: a random-weight checkpoint folder in the Hub's layout.

use std::path::PathBuf;

use anyhow::Context;
use clap::Args;

use batch_forge::loaders::Gpt2Config;
use batch_forge::model::random::random_checkpoint;

#[derive(Args)]
pub struct RandomModelArgs {
    /// Published config to use: distilgpt2, gpt2, gpt2-medium, gpt2-large, gpt2-xl.
    #[arg(long, default_value = "gpt2")]
    preset: String,
    /// Output folder (created).
    #[arg(long)]
    out: PathBuf,
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Copy tokenizer.json / vocab.json / merges.txt from this folder, so the result can generate text.
    #[arg(long)]
    tokenizer_from: Option<PathBuf>,
}

pub fn preset(name: &str) -> anyhow::Result<Gpt2Config> {
    Gpt2Config::preset(name)
        .with_context(|| format!("unknown preset {name:?}; choose one of {}", Gpt2Config::PRESETS.join(", ")))
}

pub fn run(args: RandomModelArgs) -> anyhow::Result<()> {
    let config = preset(&args.preset)?;
    // A bad --tokenizer-from is reported before gigabytes of weights are written.
    if let Some(src) = &args.tokenizer_from {
        batch_forge::tokenizer::Tokenizer::from_dir(src)
            .with_context(|| format!("--tokenizer-from {}: no usable tokenizer there", src.display()))?;
    }
    std::fs::create_dir_all(&args.out).with_context(|| format!("cannot create {}", args.out.display()))?;
    std::fs::write(args.out.join("config.json"), config.to_json())?;
    let weights = args.out.join("model.safetensors");
    std::fs::write(&weights, random_checkpoint(&config, args.seed))
        .with_context(|| format!("cannot write {}", weights.display()))?;
    if let Some(src) = &args.tokenizer_from {
        for name in ["tokenizer.json", "vocab.json", "merges.txt"] {
            if src.join(name).is_file() {
                std::fs::copy(src.join(name), args.out.join(name)).with_context(|| format!("copying {name}"))?;
            }
        }
    }
    eprintln!("wrote {} ({} parameters) to {}", args.preset, config.n_params(), args.out.display());
    Ok(())
}

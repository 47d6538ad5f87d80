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
    /// Output folder (created; must be empty or absent unless --force).
    #[arg(long)]
    out: PathBuf,
    /// Write into a non-empty folder, replacing its config.json and model.safetensors.
    #[arg(long)]
    force: bool,
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
    // Never overwrite a model by accident.
    if args.out.exists() {
        anyhow::ensure!(args.out.is_dir(), "--out {}: exists and is not a folder", args.out.display());
        let non_empty = std::fs::read_dir(&args.out)
            .with_context(|| format!("cannot read {}", args.out.display()))?
            .next()
            .is_some();
        anyhow::ensure!(
            !non_empty || args.force,
            "--out {} is not empty; pass --force to replace the model files in it, or choose another folder",
            args.out.display()
        );
    }
    std::fs::create_dir_all(&args.out).with_context(|| format!("cannot create {}", args.out.display()))?;
    std::fs::write(args.out.join("config.json"), config.to_json())?;
    let weights = args.out.join("model.safetensors");
    std::fs::write(&weights, random_checkpoint(&config, args.seed))
        .with_context(|| format!("cannot write {}", weights.display()))?;
    if let Some(src) = &args.tokenizer_from {
        for name in ["tokenizer.json", "vocab.json", "merges.txt"] {
            let same = std::fs::canonicalize(src.join(name)).ok() == std::fs::canonicalize(args.out.join(name)).ok();
            if src.join(name).is_file() && !same {
                std::fs::copy(src.join(name), args.out.join(name)).with_context(|| format!("copying {name}"))?;
            }
        }
    }
    eprintln!("wrote {} ({} parameters) to {}", args.preset, config.n_params(), args.out.display());
    if args.tokenizer_from.is_none() && batch_forge::tokenizer::Tokenizer::from_dir(&args.out).is_err() {
        eprintln!(
            "note: {} has no tokenizer, so it can be benchmarked but cannot generate text; add \
             --tokenizer-from DIR (a folder with tokenizer.json, or vocab.json and merges.txt)",
            args.out.display()
        );
    }
    Ok(())
}

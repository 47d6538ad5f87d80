//! Everything that turns files into memory: safetensors, GGUF, config.json, model folders,
//! and the Hugging Face Hub cache/download.

pub mod config;
pub mod gguf;
pub mod hub;
pub mod safetensors;
pub mod weights;

use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

pub use config::Gpt2Config;
pub use weights::WeightStore;

/// The bytes of a model file: memory-mapped from disk, or built in memory (random
/// weights, tests, fuzzing). Readers validate a header against these bytes once and
/// then index them freely.
pub(crate) enum Backing {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Mapped(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// The default model: GPT-2 124M on the Hub.
pub const DEFAULT_MODEL: &str = "openai-community/gpt2";

/// Resolve `--model`: an existing folder is used as is; otherwise a Hub repo id is
/// fetched into (or found in) the HF cache. Returns the folder holding the model files.
/// With `weights` false only config and tokenizer files are fetched.
pub fn resolve_model(model: &str, hub: &hub::HubClient, weights: bool) -> anyhow::Result<PathBuf> {
    let as_path = Path::new(model);
    if as_path.is_dir() {
        return Ok(as_path.to_owned());
    }
    let looks_like_path =
        model.starts_with('.') || model.starts_with('/') || model.starts_with('~') || model.contains('\\');
    if looks_like_path || !hub::is_repo_id(model) {
        bail!("model folder {model:?} does not exist (and it is not a Hub repo id like openai-community/gpt2)");
    }
    fetch_from_hub(model, "main", hub, weights).with_context(|| {
        let how = format!(
            "to get the files, run `forge generate --model {model}` (or `huggingface-cli download {model}`) on a machine that reaches {}, \
             or pass a local folder holding config.json, model.safetensors and tokenizer.json with --model PATH",
            hub.endpoint
        );
        format!("cannot get model {model:?} from the Hub or the cache at {}; {how}", hub.cache_dir.display())
    })
}

fn fetch_from_hub(repo: &str, revision: &str, hub: &hub::HubClient, weights: bool) -> anyhow::Result<PathBuf> {
    let need = |name: &str| -> anyhow::Result<PathBuf> {
        hub.get_file(repo, revision, name)?.with_context(|| format!("{repo} has no {name}"))
    };
    let config = need("config.json")?;
    let dir = config.parent().expect("snapshot dir").to_owned();
    if hub.get_file(repo, revision, "tokenizer.json")?.is_none() {
        need("vocab.json")?;
        need("merges.txt")?;
    }
    if weights && hub.get_file(repo, revision, "model.safetensors")?.is_none() {
        let index = hub
            .get_file(repo, revision, "model.safetensors.index.json")?
            .with_context(|| format!("{repo} has neither model.safetensors nor model.safetensors.index.json"))?;
        for shard in weights::shard_files(&index)? {
            need(&shard)?;
        }
    }
    Ok(dir)
}

//! Everything that turns files into memory: safetensors, GGUF, config.json, model folders,
//! and the Hugging Face Hub cache/download.

pub mod checkpoint;
pub mod config;
pub mod gguf;
pub mod gguf_write;
pub mod hub;
pub mod llama_config;
pub mod progress;
pub mod safetensors;
pub mod weights;

use std::path::{Path, PathBuf};

/// Why `--model` could not be turned into files: the argument names nothing usable, or
/// the Hub and the cache could not supply the model.
#[derive(Debug, thiserror::Error)]
pub enum ResolveError {
    /// Not a folder, a `.gguf` file or a Hub repo id; or a repo not cached while offline.
    #[error("{0}")]
    Argument(String),
    #[error("cannot get model {model:?} from the Hub or the cache at {}: {cause}; {how}", cache.display())]
    Fetch { model: String, cache: PathBuf, cause: Box<FetchError>, how: String },
}

/// What the Hub or the cache could not supply.
#[derive(Debug, thiserror::Error)]
pub enum FetchError {
    #[error(transparent)]
    Hub(#[from] hub::HubError),
    /// The repo has no such file, or (offline) the cache has not.
    #[error("{0}")]
    Missing(String),
    /// The shard index names its shards wrongly.
    #[error(transparent)]
    Index(#[from] checkpoint::WeightError),
}

pub use checkpoint::Weights;
pub use config::Gpt2Config;
pub use llama_config::LlamaConfig;
pub use weights::WeightStore;

use crate::tensor::mapping::Mapping;
pub use crate::tensor::mapping::release;

/// The bytes of a model file: memory-mapped from disk, or built in memory (random
/// weights, tests, fuzzing). Readers validate a header against these bytes once and
/// then index them freely.
pub(crate) enum Backing {
    Mapped(Mapping),
    Owned(Vec<u8>),
}

impl std::ops::Deref for Backing {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        match self {
            Backing::Mapped(m) => &m.0,
            Backing::Owned(v) => v,
        }
    }
}

/// Whether `path` names a GGUF file (by its extension).
pub fn is_gguf(path: &Path) -> bool {
    path.is_file() && path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf"))
}

/// The default model: GPT-2 124M on the Hub.
pub const DEFAULT_MODEL: &str = "openai-community/gpt2";

/// Resolve `--model`: an existing folder or `.gguf` file is used as is; otherwise a Hub
/// repo id is fetched into (or found in) the HF cache. Returns the folder holding the
/// model files, or the GGUF file.
/// With `weights` false only config and tokenizer files are fetched. `command` is the
/// `forge` subcommand, named in the hint for getting a missing model.
pub fn resolve_model(model: &str, hub: &hub::HubClient, weights: bool, command: &str) -> Result<PathBuf, ResolveError> {
    let bail = |message: String| Err(ResolveError::Argument(message));
    let as_path = Path::new(model);
    if as_path.is_dir() {
        return Ok(as_path.to_owned());
    }
    const EXPECTED: &str = "--model takes a model folder (config.json, model.safetensors, tokenizer.json), \
                            a .gguf file, or a Hub repo id like openai-community/gpt2";
    if as_path.is_file() {
        if is_gguf(as_path) {
            return Ok(as_path.to_owned());
        }
        let folder = as_path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
        return bail(format!(
            "{model:?} is a file, not a model folder; {EXPECTED} (did you mean --model {}?)",
            folder.display()
        ));
    }
    // A name ending in a model file's extension, or with more than one `/`, is a path (a
    // Hub repo id is `name` or `owner/name`): say it does not exist rather than ask the Hub.
    let file_ext = as_path
        .extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| ["gguf", "safetensors", "bin", "pt", "pth", "json"].iter().any(|x| e.eq_ignore_ascii_case(x)));
    if file_ext {
        return bail(format!("no such file: {model:?}; {EXPECTED}"));
    }
    let looks_like_path = model.starts_with('.')
        || model.starts_with('/')
        || model.starts_with('~')
        || model.contains('\\')
        || model.matches('/').count() > 1;
    if looks_like_path || !hub::is_repo_id(model) {
        return bail(format!(
            "model folder {model:?} does not exist (and it is not a Hub repo id like openai-community/gpt2)"
        ));
    }
    if hub.offline && hub.cached_file(model, "main", "config.json").is_none() {
        return bail(format!(
            "HF_HUB_OFFLINE is set and {model} is not in the HF cache at {}; unset HF_HUB_OFFLINE to download it \
             (`forge {command} --model {model}`), or pass a local folder with --model PATH",
            hub.cache_dir.display()
        ));
    }
    fetch_from_hub(model, "main", hub, weights).map_err(|cause| {
        let how = format!(
            "to get the files, run `forge {command} --model {model}` (or `huggingface-cli download {model}`) on a machine that reaches {}, \
             or pass a local folder holding config.json, model.safetensors and tokenizer.json with --model PATH",
            hub.endpoint
        );
        ResolveError::Fetch { model: model.to_owned(), cache: hub.cache_dir.clone(), cause: Box::new(cause), how }
    })
}

fn fetch_from_hub(repo: &str, revision: &str, hub: &hub::HubClient, weights: bool) -> Result<PathBuf, FetchError> {
    let missing = |name: &str| {
        FetchError::Missing(if hub.offline {
            format!(
                "HF_HUB_OFFLINE is set and {name} of {repo} is not in the HF cache at {}; unset HF_HUB_OFFLINE to download it",
                hub.cache_dir.display()
            )
        } else {
            format!("{repo} has no {name}")
        })
    };
    let need = |name: &str| -> Result<PathBuf, FetchError> {
        hub.get_file(repo, revision, name)?.ok_or_else(|| missing(name))
    };
    let config = need("config.json")?;
    let dir = config.parent().expect("snapshot dir").to_owned();
    if hub.get_file(repo, revision, "tokenizer.json")?.is_none() {
        need("vocab.json")?;
        need("merges.txt")?;
    }
    if weights && hub.get_file(repo, revision, "model.safetensors")?.is_none() {
        let index = hub.get_file(repo, revision, "model.safetensors.index.json")?.ok_or_else(|| {
            if hub.offline {
                missing("model.safetensors")
            } else {
                FetchError::Missing(format!("{repo} has neither model.safetensors nor model.safetensors.index.json"))
            }
        })?;
        for shard in weights::shard_files(&index)? {
            need(&shard)?;
        }
    }
    Ok(dir)
}

//! All tensors of a model, from one `model.safetensors` or from shards listed in
//! `model.safetensors.index.json`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail};

use super::safetensors::{SafetensorsFile, TensorView};

pub struct WeightStore {
    files: Vec<SafetensorsFile>,
    /// tensor name → index into `files`.
    index: HashMap<String, usize>,
}

impl WeightStore {
    /// Open `model.safetensors`, or the shards named by `model.safetensors.index.json`, in `dir`.
    pub fn open_dir(dir: &Path) -> anyhow::Result<Self> {
        let single = dir.join("model.safetensors");
        if single.is_file() {
            return Self::from_files(&[single]);
        }
        let index = dir.join("model.safetensors.index.json");
        if index.is_file() {
            return Self::open_index(&index);
        }
        bail!("{}: no model.safetensors or model.safetensors.index.json", dir.display())
    }

    pub fn from_files(paths: &[PathBuf]) -> anyhow::Result<Self> {
        let files = paths.iter().map(|p| SafetensorsFile::open(p)).collect::<Result<Vec<_>, _>>()?;
        Self::from_opened(files)
    }

    /// Tensors held in memory (random-weight models for benchmarks).
    pub fn from_bytes(name: &str, bytes: Vec<u8>) -> anyhow::Result<Self> {
        Self::from_opened(vec![SafetensorsFile::from_bytes(name, bytes)?])
    }

    fn from_opened(files: Vec<SafetensorsFile>) -> anyhow::Result<Self> {
        let mut index = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            for name in f.names() {
                if index.insert(name.to_owned(), i).is_some() {
                    bail!("{}: tensor {name:?} appears in more than one shard", f.path().display());
                }
            }
        }
        Ok(WeightStore { files, index })
    }

    /// Shards listed in the `weight_map` of a `model.safetensors.index.json`.
    pub fn open_index(index_path: &Path) -> anyhow::Result<Self> {
        let shard_names = shard_files(index_path)?;
        let dir = index_path.parent().unwrap_or(Path::new("."));
        let paths: Vec<PathBuf> = shard_names.iter().map(|s| dir.join(s)).collect();
        Self::from_files(&paths).with_context(|| format!("loading shards of {}", index_path.display()))
    }

    pub fn get(&self, name: &str) -> Option<TensorView<'_>> {
        self.index.get(name).and_then(|&i| self.files[i].get(name))
    }

    /// Every tensor of every file.
    pub fn tensors(&self) -> impl Iterator<Item = TensorView<'_>> {
        self.files.iter().flat_map(|f| f.names().filter_map(|n| f.get(n)))
    }
}

/// The distinct shard file names of an index, in first-seen order. Names must be plain
/// file names in the same folder (no paths).
pub fn shard_files(index_path: &Path) -> anyhow::Result<Vec<String>> {
    let text = std::fs::read_to_string(index_path).with_context(|| format!("cannot read {}", index_path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", index_path.display()))?;
    let map = v["weight_map"].as_object().with_context(|| format!("{}: no weight_map object", index_path.display()))?;
    let mut shards: Vec<String> = Vec::new();
    for (tensor, file) in map {
        let file = file
            .as_str()
            .with_context(|| format!("{}: weight_map[{tensor:?}] is not a string", index_path.display()))?;
        if file.contains('/') || file.contains('\\') || file == ".." || file.is_empty() {
            bail!("{}: shard name {file:?} is not a plain file name", index_path.display());
        }
        if !shards.iter().any(|s| s == file) {
            shards.push(file.to_owned());
        }
    }
    if shards.is_empty() {
        bail!("{}: weight_map is empty", index_path.display());
    }
    Ok(shards)
}

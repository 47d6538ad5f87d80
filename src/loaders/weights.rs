//! All tensors of a model, from one `model.safetensors` or from shards listed in
//! `model.safetensors.index.json`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use super::checkpoint::WeightError;
use super::safetensors::{SafetensorsFile, TensorView};

fn file_error(path: &Path, message: impl Into<String>) -> WeightError {
    WeightError::File { path: path.to_owned(), message: message.into() }
}

pub struct WeightStore {
    files: Vec<SafetensorsFile>,
    /// tensor name → index into `files`.
    index: HashMap<String, usize>,
}

impl WeightStore {
    /// Open `model.safetensors`, or the shards named by `model.safetensors.index.json`, in `dir`.
    pub fn open_dir(dir: &Path) -> Result<Self, WeightError> {
        let single = dir.join("model.safetensors");
        if single.is_file() {
            return Self::from_files(&[single]);
        }
        let index = dir.join("model.safetensors.index.json");
        if index.is_file() {
            return Self::open_index(&index);
        }
        Err(file_error(dir, "no model.safetensors or model.safetensors.index.json"))
    }

    pub fn from_files(paths: &[PathBuf]) -> Result<Self, WeightError> {
        let files = paths.iter().map(|p| SafetensorsFile::open(p)).collect::<Result<Vec<_>, _>>()?;
        Self::from_opened(files)
    }

    /// Tensors held in memory (random-weight models for benchmarks).
    pub fn from_bytes(name: &str, bytes: Vec<u8>) -> Result<Self, WeightError> {
        Self::from_opened(vec![SafetensorsFile::from_bytes(name, bytes)?])
    }

    fn from_opened(files: Vec<SafetensorsFile>) -> Result<Self, WeightError> {
        let mut index = HashMap::new();
        for (i, f) in files.iter().enumerate() {
            for name in f.names() {
                if index.insert(name.to_owned(), i).is_some() {
                    return Err(file_error(f.path(), format!("tensor {name:?} appears in more than one shard")));
                }
            }
        }
        Ok(WeightStore { files, index })
    }

    /// Shards listed in the `weight_map` of a `model.safetensors.index.json`.
    pub fn open_index(index_path: &Path) -> Result<Self, WeightError> {
        let shard_names = shard_files(index_path)?;
        let dir = index_path.parent().unwrap_or(Path::new("."));
        let paths: Vec<PathBuf> = shard_names.iter().map(|s| dir.join(s)).collect();
        Self::from_files(&paths)
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
pub fn shard_files(index_path: &Path) -> Result<Vec<String>, WeightError> {
    let error = |message: String| file_error(index_path, message);
    let text = std::fs::read_to_string(index_path).map_err(|e| error(format!("cannot read: {e}")))?;
    let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| error(format!("invalid JSON: {e}")))?;
    let map = v["weight_map"].as_object().ok_or_else(|| error("no weight_map object".into()))?;
    let mut shards: Vec<String> = Vec::new();
    for (tensor, file) in map {
        let file = file.as_str().ok_or_else(|| error(format!("weight_map[{tensor:?}] is not a string")))?;
        if file.contains('/') || file.contains('\\') || file == ".." || file.is_empty() {
            return Err(error(format!("shard name {file:?} is not a plain file name")));
        }
        if !shards.iter().any(|s| s == file) {
            shards.push(file.to_owned());
        }
    }
    if shards.is_empty() {
        return Err(error("weight_map is empty".into()));
    }
    Ok(shards)
}

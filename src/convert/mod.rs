//! Writing model files: quantizing a GGUF file, or an HF folder converted on the fly
//! ([`from_hf`]), into another file type ([`quantize`]), as llama.cpp's `llama-quantize`
//! does, byte for byte.

pub mod from_hf;
pub mod quantize;
pub mod spm_model;

use std::path::{Path, PathBuf};

use crate::loaders::checkpoint::WeightError;
use crate::loaders::gguf::GgufError;
use crate::loaders::gguf_write::GgufWriteError;

/// Why a conversion or quantization failed: an input file, a tensor, a model this
/// converter does not write, or the output. (Causes are in the message, not `source()`.)
#[derive(Debug, thiserror::Error)]
pub enum ConvertError {
    /// An input file cannot be read, is malformed, or says what cannot be converted.
    #[error("{}: {message}", path.display())]
    File { path: PathBuf, message: String },
    /// A tensor: missing, misshapen, of a type that does not convert, or failing to encode.
    #[error("tensor {name:?}: {message}")]
    Tensor { name: String, message: String },
    /// What the model is cannot be written (an untied head, a file that would not load).
    #[error("{0}")]
    Unsupported(String),
    /// A setting refuses the work (re-quantizing without `--allow-requantize`, an output
    /// that is the input).
    #[error("{0}")]
    Refused(String),
    #[error(transparent)]
    Weights(#[from] WeightError),
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Write(#[from] GgufWriteError),
    #[error("cannot {action} {}: {cause}", path.display())]
    Output { action: &'static str, path: PathBuf, cause: std::io::Error },
}

impl ConvertError {
    pub(crate) fn file(path: &Path, message: impl Into<String>) -> Self {
        ConvertError::File { path: path.to_owned(), message: message.into() }
    }

    pub(crate) fn tensor(name: &str, message: impl Into<String>) -> Self {
        ConvertError::Tensor { name: name.to_owned(), message: message.into() }
    }
}

//! Writing model files: quantizing a GGUF file, or an HF folder converted on the fly
//! ([`from_hf`]), into another file type ([`quantize`]), as llama.cpp's `llama-quantize`
//! does, byte for byte.

pub mod from_hf;
pub mod quantize;
pub mod spm_model;

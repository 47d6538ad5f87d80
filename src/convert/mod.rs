//! Writing model files: quantizing a GGUF into another file type ([`quantize`]), as
//! llama.cpp's `llama-quantize` does, byte for byte.

pub mod quantize;

//! batch_forge: an LLM inference engine written from scratch, verifiable against
//! Hugging Face transformers.
//!
//! - [`tokenizer`]: byte-level BPE (GPT-2), streaming decode.
//! - [`loaders`]: safetensors, config.json, model folders, the HF Hub cache.
//! - [`model`]: GPT-2's forward pass, written once over the backend interface.
//! - [`backend`]: the backend interface and the reference CPU backend.
//! - [`engine`]: KV caches, prefill/decode loop, sampling.

pub mod backend;
pub mod engine;
pub mod loaders;
pub mod model;
pub mod tokenizer;

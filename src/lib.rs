//! batch_forge: an LLM inference engine written from scratch, verifiable against
//! Hugging Face transformers.
//!
//! - [`tensor`]: the ground floor: element and block types, borrowed tensors.
//! - [`tokenizer`]: byte-level BPE (GPT-2, and Llama-family models from GGUF metadata), streaming decode.
//! - [`chat`]: chat templates (Jinja), rendered as HF transformers renders them.
//! - [`loaders`]: safetensors, GGUF, config.json, model folders, the HF Hub cache.
//! - [`model`]: GPT-2 and Llama, each written once over the backend interface, and the
//!   interface the engine drives them through.
//! - [`backend`]: the backend interface and its implementations: the reference
//!   (plain Rust), the fast CPU backend (SIMD, threads) and the GPU backend (WGSL).
//! - [`engine`]: the engine core: the scheduler every command generates with (continuous
//!   batching, prefix cache, sessions), the sampler, scoring, lockstep comparison.
//! - [`compare`]: NaN-propagating error measures shared by the tests and the engine.
//! - [`rng`]: SplitMix64, the same numbers on every platform.
//! - [`quant`]: GGUF block formats, decoded to f32 (the reference for quantized kernels).
//! - [`verify`]: a model, stage by stage, against a Hugging Face reference dump.
//! - [`serve`]: the OpenAI-compatible HTTP server over the engine's scheduler.
//!
//! `docs/architecture.md` draws the floors and the arrows between them.

pub mod backend;
pub mod chat;
pub mod compare;
pub mod convert;
pub mod engine;
pub mod loaders;
pub mod model;
pub mod quant;
pub mod rng;
pub mod serve;
pub mod tensor;
pub mod tokenizer;
pub mod verify;

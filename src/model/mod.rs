//! Model definitions, each written once over the backend interface.

pub mod gpt2;

pub use gpt2::{Batch, Gpt2, LogitRows};
pub mod random;

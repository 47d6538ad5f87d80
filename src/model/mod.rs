//! Model definitions, each written once over the backend interface.

pub mod gpt2;

pub use gpt2::{Batch, Gpt2, LogitRows};
pub mod random;

/// A point in a forward pass where the activations are compared with a reference.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Stage {
    /// The input to the first block (token + position embeddings).
    Embeddings,
    /// The residual stream after block `i`.
    Block(usize),
    /// The final norm's output.
    FinalNorm,
    /// The logits.
    Logits,
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        match self {
            Stage::Embeddings => write!(f, "embeddings"),
            Stage::Block(i) => write!(f, "block {i}"),
            Stage::FinalNorm => write!(f, "final norm"),
            Stage::Logits => write!(f, "logits"),
        }
    }
}

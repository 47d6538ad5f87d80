//! Command-line interface: argument definitions and dispatch to the subcommands.

mod bench;
mod generate;
mod random_model;
mod tokenize;

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

use batch_forge::loaders::{self, hub::HubClient};

#[derive(Parser)]
#[command(
    name = "forge",
    version,
    about = "batch_forge: GPT-2 inference, verified against Hugging Face transformers"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt, streaming it to stdout.
    Generate(generate::GenerateArgs),
    /// Print the token ids of a text (or of JSON lines on stdin with --jsonl).
    Tokenize(tokenize::TokenizeArgs),
    /// Measure prompt processing (pp) and token generation (tg) speed, llama-bench style.
    Bench(bench::BenchArgs),
    /// Write a random-weight GPT-2 checkpoint folder of any published size.
    RandomModel(random_model::RandomModelArgs),
}

/// Which implementation runs the model.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum BackendChoice {
    /// The default CPU backend (currently the reference implementation).
    Cpu,
    /// The scalar reference backend: the ground truth every backend is tested against.
    Reference,
}

impl BackendChoice {
    pub fn label(self) -> &'static str {
        match self {
            BackendChoice::Cpu => "cpu",
            BackendChoice::Reference => "reference",
        }
    }
}

pub fn run(cli: Cli) -> anyhow::Result<()> {
    match cli.command {
        Command::Generate(a) => generate::run(a),
        Command::Tokenize(a) => tokenize::run(a),
        Command::Bench(a) => bench::run(a),
        Command::RandomModel(a) => random_model::run(a),
    }
}

/// `--model`: a local folder, or a Hub id resolved through the HF cache.
pub fn model_dir(model: &str, weights: bool) -> anyhow::Result<PathBuf> {
    loaders::resolve_model(model, &HubClient::from_env(), weights)
}

/// Size rayon's global pool (only possible once, before first use).
pub fn set_threads(threads: Option<usize>) -> anyhow::Result<()> {
    if let Some(n) = threads {
        anyhow::ensure!(n > 0, "--threads must be at least 1");
        rayon::ThreadPoolBuilder::new()
            .num_threads(n)
            .build_global()?;
    }
    Ok(())
}

/// Output to a closed pipe (`forge generate | head`) ends the program quietly.
pub fn is_broken_pipe(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        c.downcast_ref::<std::io::Error>()
            .is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
    })
}

//! `forge quantize IN OUT.gguf --type q4_0`: llama-quantize's file types, type choices and
//! bytes ([`batch_forge::convert::quantize`]); IN is a GGUF file or an HF folder.

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;

use batch_forge::convert::quantize::{FileType, QuantizeOptions, quantize_file};

use super::outln;

#[derive(Args)]
pub struct QuantizeArgs {
    /// A GGUF file (F32/F16/BF16, or quantized with --allow-requantize), or an HF model
    /// folder (Llama or GPT-2: config.json, safetensors, tokenizer.json).
    input: PathBuf,
    /// The GGUF file to write.
    output: PathBuf,
    /// File type: f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k_s, q4_k_m (= q4_k),
    /// q5_k_s, q5_k_m (= q5_k), q6_k.
    #[arg(long = "type", short = 't', value_name = "TYPE", value_parser = parse_type)]
    ftype: FileType,
    /// Give every quantized tensor the file type (no Q6_K head, no _M/_S mixes).
    #[arg(long)]
    pure: bool,
    /// Re-quantize tensors that are already block-quantized.
    #[arg(long)]
    allow_requantize: bool,
}

fn parse_type(s: &str) -> Result<FileType, String> {
    FileType::parse(s).ok_or_else(|| {
        let names: Vec<String> = FileType::all().map(|t| t.name().to_ascii_lowercase()).collect();
        format!("unknown type {s:?}; one of {}, q4_k, q5_k", names.join(", "))
    })
}

pub fn run(args: QuantizeArgs) -> anyhow::Result<()> {
    let opts = QuantizeOptions { ftype: args.ftype, pure: args.pure, allow_requantize: args.allow_requantize };
    let start = Instant::now();
    let (mut bytes_in, mut bytes_out) = (0u64, 0u64);
    let tensors = quantize_file(&args.input, &args.output, &opts, |i, n, t| {
        let n_el: u64 = t.dims.iter().product();
        let (a, b) = (t.from.bytes_for(n_el).unwrap_or(0), t.to.bytes_for(n_el).unwrap_or(0));
        bytes_in += a;
        bytes_out += b;
        let action = if t.from == t.to { "copied".to_owned() } else { format!("-> {}", t.to.name()) };
        eprintln!(
            "[{:4}/{:4}] {:<36} {:<16} {:>6} {action:<9} {:9.3} MiB -> {:9.3} MiB",
            i + 1,
            n,
            t.name,
            format!("{:?}", t.dims),
            t.from.name(),
            a as f64 / 1048576.0,
            b as f64 / 1048576.0
        );
    })?;
    outln!(
        "wrote {} ({}, {} tensors): {:.2} MiB -> {:.2} MiB in {:.1} s",
        args.output.display(),
        args.ftype.name(),
        tensors.len(),
        bytes_in as f64 / 1048576.0,
        bytes_out as f64 / 1048576.0,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

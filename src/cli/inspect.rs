//! `forge inspect FILE`: the metadata and tensor table of a GGUF or safetensors file.

use std::path::PathBuf;

use clap::Args;

use batch_forge::loaders::gguf::{GgufFile, MetaValue};
use batch_forge::loaders::safetensors::SafetensorsFile;

use super::outln;

#[derive(Args)]
pub struct InspectArgs {
    /// A `.gguf` or `.safetensors` file.
    file: PathBuf,
    /// Print every element of long metadata arrays (default: the first 8).
    #[arg(long)]
    full: bool,
}

pub fn run(args: InspectArgs) -> anyhow::Result<()> {
    let path = &args.file;
    anyhow::ensure!(path.is_file(), "{}: not a file (expected a .gguf or .safetensors file)", path.display());
    let mut magic = [0u8; 4];
    std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .map_err(|e| anyhow::anyhow!("{}: cannot read a GGUF or safetensors header: {e}", path.display()))?;
    if &magic == b"GGUF" { gguf(&args) } else { safetensors(&args) }
}

fn gguf(args: &InspectArgs) -> anyhow::Result<()> {
    let g = GgufFile::open(&args.file)?;
    let h = g.header();
    outln!(
        "{}: GGUF v{}, {} metadata keys, {} tensors, alignment {}, data at byte {}",
        args.file.display(),
        h.version,
        h.metadata.len(),
        h.tensors.len(),
        h.alignment,
        h.data_start
    );
    outln!();
    outln!("| key | type | value |");
    outln!("| --- | --- | --- |");
    for (k, v) in g.metadata() {
        outln!("| {} | {} | {} |", k.escape_debug(), type_label(v), show(v, args.full));
    }
    outln!();
    outln!("| tensor | type | shape | bytes |");
    outln!("| --- | --- | --- | ---: |");
    let mut total = 0u64;
    for t in g.tensor_infos() {
        // PyTorch order (outermost first), as safetensors and HF show shapes.
        let shape: Vec<u64> = t.dims.iter().rev().copied().collect();
        outln!("| {} | {} | {shape:?} | {} |", t.name.escape_debug(), t.ggml_type.name(), t.n_bytes);
        total += t.n_bytes;
    }
    outln!();
    outln!(
        "{} tensors, {} bytes of tensor data ({:.2} MiB)",
        g.tensor_infos().len(),
        total,
        total as f64 / (1u64 << 20) as f64
    );
    Ok(())
}

fn type_label(v: &MetaValue) -> String {
    match v.as_array() {
        Some(a) => format!("array[{}] of {}", a.len(), a.first().map_or("-", MetaValue::type_name)),
        None => v.type_name().to_owned(),
    }
}

fn show(v: &MetaValue, full: bool) -> String {
    let one = |v: &MetaValue| match v {
        MetaValue::String(s) => format!("{s:?}").replace('|', "\\|"),
        MetaValue::Array(_, a) => format!("[{} items]", a.len()),
        MetaValue::U8(x) => x.to_string(),
        MetaValue::I8(x) => x.to_string(),
        MetaValue::U16(x) => x.to_string(),
        MetaValue::I16(x) => x.to_string(),
        MetaValue::U32(x) => x.to_string(),
        MetaValue::I32(x) => x.to_string(),
        MetaValue::U64(x) => x.to_string(),
        MetaValue::I64(x) => x.to_string(),
        MetaValue::F32(x) => x.to_string(),
        MetaValue::F64(x) => x.to_string(),
        MetaValue::Bool(x) => x.to_string(),
    };
    let s = match v.as_array() {
        Some(a) => {
            let shown = if full { a.len() } else { a.len().min(8) };
            let items: Vec<String> = a[..shown].iter().map(one).collect();
            let more = if shown < a.len() { format!(", … {} more", a.len() - shown) } else { String::new() };
            format!("[{}{more}]", items.join(", "))
        }
        None => one(v),
    };
    // Long strings (a chat template) are cut unless --full.
    if !full && s.chars().count() > 200 {
        format!("{}… ({} chars)", s.chars().take(200).collect::<String>(), s.chars().count())
    } else {
        s
    }
}

fn safetensors(args: &InspectArgs) -> anyhow::Result<()> {
    let f = SafetensorsFile::open(&args.file)?;
    let names: Vec<&str> = f.names().collect();
    outln!("{}: safetensors, {} metadata keys, {} tensors", args.file.display(), f.metadata().len(), names.len());
    outln!();
    outln!("| key | value |");
    outln!("| --- | --- |");
    for (k, v) in f.metadata() {
        outln!("| {} | {v:?} |", k.escape_debug());
    }
    outln!();
    outln!("| tensor | type | shape | bytes |");
    outln!("| --- | --- | --- | ---: |");
    let mut total = 0u64;
    for n in &names {
        let t = f.get(n).expect("listed");
        outln!("| {} | {} | {:?} | {} |", n.escape_debug(), t.dtype.name(), t.shape, t.bytes.len());
        total += t.bytes.len() as u64;
    }
    outln!();
    outln!("{} tensors, {} bytes of tensor data ({:.2} MiB)", names.len(), total, total as f64 / (1u64 << 20) as f64);
    Ok(())
}

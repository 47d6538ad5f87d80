//! `forge quantize`: a GGUF file in, a GGUF file of another file type out, with
//! llama-quantize's choice of type for each tensor and its bytes.
//!
//! Which tensors are quantized, and to what, follows `llama-quantize`
//! (`llama_tensor_get_type`) for the file types offered here:
//! - only tensors of 2+ dims whose name ends in `weight` and is not a norm
//!   (`_norm.weight`), a position embedding or a MoE router; the rest are copied as-is;
//! - the output head (or a tied `token_embd`) gets Q6_K, or Q8_0 if its rows are not
//!   whole blocks of the file type (Q8_0 files keep Q8_0);
//! - the `_M` and `_S` mixes raise `attn_v`/`attn_qkv` and `ffn_down` of chosen layers
//!   (Q4_K_M/Q5_K_M: Q6_K on `use_more_bits` layers; Q4_K_S: Q5_K on the first ones);
//! - a row that is not whole blocks of its type falls back (Q4_K → Q5_0, Q5_K → Q5_1,
//!   Q6_K → Q8_0, then F16).
//!
//! `--pure` skips the mixes (every quantized tensor gets the file type, fallbacks
//! aside). The tensor table is ordered as llama.cpp orders it (non-layer tensors, then
//! by layer, names sorted), the metadata is copied in order with
//! `general.quantization_version` and `general.file_type` set last, so the output is
//! byte-identical to llama-quantize's (tests/quantize.rs).

use std::borrow::Cow;
use std::fs::File;
use std::io::BufWriter;
use std::path::Path;

use super::ConvertError;
use rayon::prelude::*;

use crate::loaders::gguf::{GgmlType, GgufFile, MetaValue};
use crate::loaders::gguf_write::{GgufPlan, GgufWriter};
use crate::quant::{self, encode};

/// llama.cpp's file types (`llama_ftype`) that `forge quantize` writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FileType {
    F32,
    F16,
    BF16,
    Q8_0,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q4KS,
    Q4KM,
    Q5KS,
    Q5KM,
    Q6K,
}

/// Each file type: llama-quantize's name, `general.file_type` (`llama_ftype`), and the
/// type most of its tensors get.
const FILE_TYPES: [(FileType, &str, u32, GgmlType); 13] = [
    (FileType::F32, "F32", 0, GgmlType::F32),
    (FileType::F16, "F16", 1, GgmlType::F16),
    (FileType::BF16, "BF16", 32, GgmlType::BF16),
    (FileType::Q8_0, "Q8_0", 7, GgmlType::Q8_0),
    (FileType::Q4_0, "Q4_0", 2, GgmlType::Q4_0),
    (FileType::Q4_1, "Q4_1", 3, GgmlType::Q4_1),
    (FileType::Q5_0, "Q5_0", 8, GgmlType::Q5_0),
    (FileType::Q5_1, "Q5_1", 9, GgmlType::Q5_1),
    (FileType::Q4KS, "Q4_K_S", 14, GgmlType::Q4K),
    (FileType::Q4KM, "Q4_K_M", 15, GgmlType::Q4K),
    (FileType::Q5KS, "Q5_K_S", 16, GgmlType::Q5K),
    (FileType::Q5KM, "Q5_K_M", 17, GgmlType::Q5K),
    (FileType::Q6K, "Q6_K", 18, GgmlType::Q6K),
];

impl FileType {
    /// Every file type.
    pub fn all() -> impl Iterator<Item = FileType> {
        FILE_TYPES.iter().map(|e| e.0)
    }

    fn entry(self) -> &'static (FileType, &'static str, u32, GgmlType) {
        FILE_TYPES.iter().find(|e| e.0 == self).expect("every file type is in the table")
    }

    /// llama-quantize's name (`Q4_K_M`, …).
    pub fn name(self) -> &'static str {
        self.entry().1
    }

    /// Parse a name, any case; `q4_k` and `q5_k` mean the `_M` mixes, as in llama-quantize.
    pub fn parse(s: &str) -> Option<FileType> {
        let up = s.to_ascii_uppercase();
        let up = match up.as_str() {
            "Q4_K" => "Q4_K_M",
            "Q5_K" => "Q5_K_M",
            other => other,
        };
        FILE_TYPES.iter().find(|e| e.1 == up).map(|e| e.0)
    }

    /// `general.file_type`.
    pub fn id(self) -> u32 {
        self.entry().2
    }

    /// The type most tensors get.
    pub fn default_type(self) -> GgmlType {
        self.entry().3
    }
}

#[derive(Clone, Copy, Debug)]
pub struct QuantizeOptions {
    pub ftype: FileType,
    /// Every quantized tensor gets the default type (no mixes, no Q6_K head).
    pub pure: bool,
    /// Allow re-quantizing tensors that are already block-quantized (lossy twice).
    pub allow_requantize: bool,
}

/// What happens to one tensor.
#[derive(Clone, Debug)]
pub struct TensorPlan {
    pub name: String,
    pub dims: Vec<u64>,
    pub from: GgmlType,
    pub to: GgmlType,
}

/// The layer of `blk.N.…` (as llama.cpp's `sscanf("blk.%d.")`), or −1.
fn layer_of(name: &str) -> i64 {
    let Some(rest) = name.strip_prefix("blk.") else { return -1 };
    let digits = rest.bytes().take_while(u8::is_ascii_digit).count();
    rest[..digits].parse::<i64>().map_or(-1, |l| l.min(1 << 32))
}

/// llama-quantize's rule: 2+ dims, a `weight`, not a norm, router, position or token-type table.
fn allows_quantization(name: &str, dims: &[u64]) -> bool {
    let n_dims = dims.iter().rposition(|&d| d != 1).map_or(1, |i| i + 1);
    n_dims >= 2
        && name.ends_with("weight")
        && !name.contains("_norm.weight")
        && !name.contains("ffn_gate_inp.weight")
        && name != "position_embd.weight"
        && name != "token_types.weight"
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Category {
    Output,
    TokenEmbd,
    AttnVLike,
    FfnDown,
    Other,
}

fn category(name: &str) -> Category {
    match name {
        "output.weight" => Category::Output,
        "token_embd.weight" => Category::TokenEmbd,
        _ if ["attn_qkv.weight", "attn_kv_b.weight", "attn_v.weight"].iter().any(|p| name.contains(p)) => {
            Category::AttnVLike
        }
        _ if name.contains("ffn_down") => Category::FfnDown,
        _ => Category::Other,
    }
}

/// Layers that get more bits in the `_M` mixes: the first and last eighth, and every
/// third in between.
fn use_more_bits(i: i64, n: i64) -> bool {
    i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2
}

/// A type whose blocks do not fit the row falls back to a 32-block type, then F16.
fn fallback(ty: GgmlType, ncols: u64) -> GgmlType {
    if ncols.is_multiple_of(ty.block_size()) {
        return ty;
    }
    let t = match ty {
        GgmlType::Q4K => GgmlType::Q5_0,
        GgmlType::Q5K => GgmlType::Q5_1,
        GgmlType::Q6K => GgmlType::Q8_0,
        other => other,
    };
    if ncols.is_multiple_of(t.block_size()) { t } else { GgmlType::F16 }
}

/// Each tensor's target type, in llama.cpp's table order.
pub fn plan_tensors(src: &Source, opts: &QuantizeOptions) -> Result<Vec<TensorPlan>, ConvertError> {
    let mut infos: Vec<&SourceTensor> = src.tensors.iter().collect();
    infos.sort_by(|a, b| (layer_of(&a.name), &a.name).cmp(&(layer_of(&b.name), &b.name)));
    let tied = !infos.iter().any(|t| t.name == "output.weight");
    let arch = src.get("general.architecture").and_then(MetaValue::as_str).unwrap_or("");
    let n_layer = match src.get(&format!("{arch}.block_count")).and_then(MetaValue::as_u64) {
        // Bounded so that llama.cpp's `7·n/8` cannot overflow on a hostile count.
        Some(n) => n.min(1 << 32) as i64,
        None => infos.iter().map(|t| layer_of(&t.name).saturating_add(1)).max().unwrap_or(0).min(1 << 32),
    };
    let n_attn_v = infos.iter().filter(|t| category(&t.name) == Category::AttnVLike).count() as i64;
    let (mut i_attn_v, mut i_ffn_down) = (0i64, 0i64);
    let ft = opts.ftype;
    let default = ft.default_type();
    let mut plans = Vec::with_capacity(infos.len());
    for info in infos {
        // ggml writes dims without trailing ones.
        let n_dims = info.dims.iter().rposition(|&d| d != 1).map_or(1, |i| i + 1);
        let mut dims = info.dims.iter().copied().take(n_dims).collect::<Vec<u64>>();
        dims.resize(n_dims, 1);
        let mut to = info.ty;
        if allows_quantization(&info.name, &dims) {
            to = default;
            if default.block_size() > 1 {
                if !opts.pure {
                    let cat = category(&info.name);
                    if cat == Category::Output || (tied && cat == Category::TokenEmbd) {
                        if !dims[0].is_multiple_of(default.block_size()) {
                            to = GgmlType::Q8_0;
                        } else if default != GgmlType::Q8_0 {
                            to = GgmlType::Q6K;
                        }
                    } else if cat == Category::AttnVLike {
                        match ft {
                            FileType::Q4KM | FileType::Q5KM if use_more_bits(i_attn_v, n_attn_v) => to = GgmlType::Q6K,
                            FileType::Q4KS if i_attn_v < 4 => to = GgmlType::Q5K,
                            _ => {}
                        }
                        i_attn_v += 1;
                    } else if cat == Category::FfnDown {
                        match ft {
                            FileType::Q4KM | FileType::Q5KM if use_more_bits(i_ffn_down, n_layer) => to = GgmlType::Q6K,
                            FileType::Q4KS if i_ffn_down < n_layer / 8 => to = GgmlType::Q5K,
                            _ => {}
                        }
                        i_ffn_down += 1;
                    }
                }
                to = fallback(to, dims[0]);
            }
        }
        if to != info.ty {
            if !quant::SUPPORTED.contains(&info.ty) {
                let message = format!("of type {}, which cannot be decoded for re-quantization", info.ty.name());
                return Err(ConvertError::tensor(&info.name, message));
            }
            if !opts.allow_requantize && info.ty.block_size() != 1 {
                return Err(ConvertError::Refused(format!(
                    "tensor {:?} is already {}: re-quantizing it loses precision twice (pass --allow-requantize to do it anyway)",
                    info.name,
                    info.ty.name()
                )));
            }
        }
        plans.push(TensorPlan { name: info.name.clone(), dims, from: info.ty, to });
    }
    Ok(plans)
}

/// The output's metadata and table: the input's keys in order, with the quantization
/// version and file type set last and split keys removed.
pub fn plan_file(src: &Source, tensors: &[TensorPlan], ftype: FileType) -> Result<GgufPlan, ConvertError> {
    let mut plan = GgufPlan::default();
    for (k, v) in &src.metadata {
        plan.set(k, v.clone());
    }
    plan.set("general.quantization_version", MetaValue::U32(2));
    plan.set("general.file_type", MetaValue::U32(ftype.id()));
    for k in ["split.no", "split.count", "split.tensors.count"] {
        plan.remove(k);
    }
    for t in tensors {
        plan.add_tensor(&t.name, &t.dims, t.to)?;
    }
    Ok(plan)
}

/// One tensor's bytes as `to`: copied if the type is unchanged, else decoded to f32 and
/// encoded row by row (rows in parallel; each row's bytes depend only on the row).
pub fn convert_tensor<'b>(t: &TensorPlan, bytes: &'b [u8]) -> Result<Cow<'b, [u8]>, ConvertError> {
    if t.from == t.to {
        return Ok(Cow::Borrowed(bytes));
    }
    let n: u64 = t.dims.iter().product();
    if n == 0 {
        return Ok(Cow::Owned(Vec::new()));
    }
    let blocks = |ty: GgmlType| {
        ty.bytes_for(t.dims[0]).map(|n| n as usize).ok_or_else(|| {
            ConvertError::tensor(&t.name, format!("rows of {} values are not whole {} blocks", t.dims[0], ty.name()))
        })
    };
    let (row_in, row_out) = (blocks(t.from)?, blocks(t.to)?);
    if row_in == 0 || !bytes.len().is_multiple_of(row_in) {
        return Err(ConvertError::tensor(&t.name, "its bytes are not whole rows"));
    }
    let mut out = vec![0u8; bytes.len() / row_in * row_out];
    out.par_chunks_mut(row_out)
        .zip(bytes.par_chunks(row_in))
        .try_for_each(|(o, row)| {
            let values = quant::dequantize(t.from, row)?;
            o.copy_from_slice(&encode::quantize(t.to, &values)?);
            Ok::<(), String>(())
        })
        .map_err(|e| ConvertError::tensor(&t.name, format!("to {}: {e}", t.to.name())))?;
    Ok(Cow::Owned(out))
}

/// A model's contents as a GGUF file holds them: metadata in order, and tensors (ggml
/// names, dims and types) whose bytes load on demand, so that only one tensor at a time
/// need be in memory.
pub struct Source<'a> {
    pub metadata: Vec<(String, MetaValue)>,
    pub tensors: Vec<SourceTensor<'a>>,
}

type LoadBytes<'a> = Box<dyn Fn() -> Result<Cow<'a, [u8]>, ConvertError> + 'a>;

pub struct SourceTensor<'a> {
    pub name: String,
    /// ggml order: `dims[0]` is the row length.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    pub load: LoadBytes<'a>,
}

impl<'a> Source<'a> {
    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.iter().find(|(k, _)| k == key).map(|(_, v)| v)
    }

    /// A GGUF file, as it is.
    pub fn from_gguf(g: &'a GgufFile) -> Source<'a> {
        let tensors = g
            .tensor_infos()
            .iter()
            .map(|info| {
                let name = info.name.clone();
                let load: LoadBytes<'a> = Box::new(move || Ok(Cow::Borrowed(g.tensor(&name).expect("listed").bytes)));
                SourceTensor { name: info.name.clone(), dims: info.dims.clone(), ty: info.ggml_type, load }
            })
            .collect();
        Source { metadata: g.metadata().to_vec(), tensors }
    }
}

/// Quantize a model (a GGUF file, or an HF folder converted on the fly) into `output`,
/// calling `progress(i, n, plan)` before each tensor. The file is written beside `output`
/// and renamed into place only when complete.
pub fn quantize_file(
    input: &Path,
    output: &Path,
    opts: &QuantizeOptions,
    progress: impl FnMut(usize, usize, &TensorPlan),
) -> Result<Vec<TensorPlan>, ConvertError> {
    if let (Ok(a), Ok(b)) = (input.canonicalize(), output.canonicalize())
        && a == b
    {
        return Err(ConvertError::Refused(format!("the output {} is the input file", output.display())));
    }
    if input.is_dir() {
        let model = super::from_hf::HfModel::open(input)?;
        quantize(&model.source()?, output, opts, progress)
    } else {
        let g = GgufFile::open(input)?;
        quantize(&Source::from_gguf(&g), output, opts, progress)
    }
}

/// Quantize `src` into the GGUF file `output` (see [`quantize_file`]).
pub fn quantize(
    src: &Source,
    output: &Path,
    opts: &QuantizeOptions,
    mut progress: impl FnMut(usize, usize, &TensorPlan),
) -> Result<Vec<TensorPlan>, ConvertError> {
    let tensors = plan_tensors(src, opts)?;
    let plan = plan_file(src, &tensors, opts.ftype)?;
    let mut name = output.file_name().unwrap_or_default().to_owned();
    name.push(".part");
    let tmp = output.with_file_name(name);
    let output_error = |action, path: &Path| {
        let path = path.to_owned();
        move |cause| ConvertError::Output { action, path, cause }
    };
    let file = File::create(&tmp).map_err(output_error("create", &tmp))?;
    let result = (|| -> Result<(), ConvertError> {
        let mut w = GgufWriter::new(BufWriter::new(file), plan)?;
        for (i, t) in tensors.iter().enumerate() {
            progress(i, tensors.len(), t);
            let st = src.tensors.iter().find(|s| s.name == t.name).expect("planned from the table");
            let bytes = (st.load)()?;
            w.write_tensor(&convert_tensor(t, &bytes)?)?;
        }
        let file = w.finish()?.into_inner().map_err(|e| output_error("write", &tmp)(e.into_error()))?;
        file.sync_all().map_err(output_error("write", &tmp))?;
        std::fs::rename(&tmp, output).map_err(output_error("move the finished file into place as", output))
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map(|()| tensors)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_rules() {
        assert_eq!(FileType::parse("q4_k"), Some(FileType::Q4KM));
        assert_eq!(FileType::parse("Q5_K_S"), Some(FileType::Q5KS));
        assert_eq!(FileType::parse("q3_k"), None);
        assert_eq!(layer_of("blk.12.attn_v.weight"), 12);
        assert_eq!(layer_of("output.weight"), -1);
        // 30 layers: the first 3, the last 4 and every third between.
        let more: Vec<i64> = (0..30).filter(|&i| use_more_bits(i, 30)).collect();
        assert_eq!(more, [0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29]);
        assert_eq!(fallback(GgmlType::Q4K, 576), GgmlType::Q5_0);
        assert_eq!(fallback(GgmlType::Q6K, 576), GgmlType::Q8_0);
        assert_eq!(fallback(GgmlType::Q8_0, 40), GgmlType::F16);
        assert!(!allows_quantization("blk.0.attn_norm.weight", &[64, 1]));
        assert!(!allows_quantization("position_embd.weight", &[64, 1024]));
        assert!(allows_quantization("blk.0.ffn_down.weight", &[64, 128]));
    }
}

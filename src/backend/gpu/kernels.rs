//! The WGSL kernel sources and their compiled pipelines.
//!
//! Each `.wgsl` file in `kernels/` is one family of entry points. A kernel's full source
//! is a header (`enable f16;` and `alias W = f16; alias KV = f16;` for 16-bit weights
//! and KV cache, the f32 aliases otherwise), then `common.wgsl`, then the file. [`kernel_sources`] lists every
//! variant the backend can compile, so the naga MSL test checks exactly what runs.
//!
//! The linear-layer kernels (`matmul.wgsl`: tiled matmul and the decode GEMVs) are
//! written once over how they read their operands: `dense.wgsl` for f32/f16 weights,
//! `dense4.wgsl` for the same as 4-vectors when k is a multiple of 4, `qaccess.wgsl` for
//! GGUF blocks decoded in registers (the last two with `vec4_rows.wgsl`). The
//! block-quantized variants (and `qembed.wgsl`) are compiled once per block format
//! ([`QUANT_FORMATS`]) on first use: their header names the block size, the block bytes
//! and the format's decoder from `quant.wgsl`.

use std::sync::atomic::{AtomicUsize, Ordering};

use crate::backend::{BackendError, BackendResult};
use crate::tensor::GgmlType;

/// (file name, source) of each kernel family.
const FILES: [(&str, &str); 6] = [
    ("elementwise.wgsl", include_str!("kernels/elementwise.wgsl")),
    ("layer_norm.wgsl", include_str!("kernels/layer_norm.wgsl")),
    ("matmul.wgsl", include_str!("kernels/matmul.wgsl")),
    ("attention.wgsl", include_str!("kernels/attention.wgsl")),
    ("embed.wgsl", include_str!("kernels/embed.wgsl")),
    ("argmax.wgsl", include_str!("kernels/argmax.wgsl")),
];

const COMMON: &str = include_str!("kernels/common.wgsl");
/// Workgroup reductions, appended for the files that use them.
const REDUCE: &str = include_str!("kernels/reduce.wgsl");
const USES_REDUCE: [&str; 2] = ["layer_norm.wgsl", "attention.wgsl"];

/// The entry points of each file.
pub const ENTRY_POINTS: [(&str, &[&str]); 7] = [
    ("elementwise.wgsl", &["add", "gelu", "swiglu", "geglu", "scale"]),
    ("layer_norm.wgsl", &["layer_norm", "add_layer_norm", "rms_norm", "add_rms_norm", "qk_norm"]),
    ("matmul.wgsl", &["matmul", "matmul_reduce", "gemv", "gemv_thread"]),
    ("attention.wgsl", &["kv_store", "attend"]),
    ("embed.wgsl", &["embed"]),
    ("argmax.wgsl", &["argmax"]),
    ("qembed.wgsl", &["qembed"]),
];

/// The block formats the quantized kernels decode in place, with each one's decoder in
/// `quant.wgsl` (`deq4_<name>`).
pub const QUANT_FORMATS: [(GgmlType, &str); 8] = [
    (GgmlType::Q8_0, "q8_0"),
    (GgmlType::Q4_0, "q4_0"),
    (GgmlType::Q4_1, "q4_1"),
    (GgmlType::Q5_0, "q5_0"),
    (GgmlType::Q5_1, "q5_1"),
    (GgmlType::Q4K, "q4_k"),
    (GgmlType::Q5K, "q5_k"),
    (GgmlType::Q6K, "q6_k"),
];

/// The files compiled once per block format: the linear layers (matmul.wgsl over the
/// block decoder, `qaccess.wgsl`) and the embedding gather.
const QUANT_FILES: [&str; 2] = ["matmul.wgsl", "qembed.wgsl"];
const QEMBED: &str = include_str!("kernels/qembed.wgsl");
const QUANT: &str = include_str!("kernels/quant.wgsl");
/// How matmul.wgsl reads its operands: dense weights (a value at a time, or as 4-vectors
/// when k is a multiple of 4), or GGUF blocks.
const DENSE_ACCESS: &str = include_str!("kernels/dense.wgsl");
const DENSE4_ACCESS: &str = concat!(include_str!("kernels/dense4.wgsl"), include_str!("kernels/vec4_rows.wgsl"));
const QUANT_ACCESS: &str = concat!(include_str!("kernels/qaccess.wgsl"), include_str!("kernels/vec4_rows.wgsl"));

/// The file the subgroup GEMV (`gemv_sg.wgsl`, entry point [`SUBGROUP_ENTRY`]) is
/// appended to when the adapter has subgroups. (No `enable subgroups;`: naga takes the
/// built-ins from wgpu's device feature and rejects the directive for now.)
pub const SUBGROUP_FILE: &str = "matmul.wgsl";
pub const SUBGROUP_ENTRY: &str = "gemv_sg";
const GEMV_SG: &str = include_str!("kernels/gemv_sg.wgsl");

/// matmul.wgsl's body after its operand access, with the subgroup GEMV when asked for.
fn linear_body(access: &str, subgroups: bool) -> String {
    let body = FILES.iter().find(|(name, _)| *name == SUBGROUP_FILE).expect("listed").1;
    let sg = if subgroups { GEMV_SG.replace("SG_ENTRY", SUBGROUP_ENTRY) } else { String::new() };
    format!("{access}\n{body}\n{sg}")
}

/// The full source of quantized kernel `file` (one of `QUANT_FILES`) for blocks of `ty`
/// (with the subgroup GEMV when `subgroups`).
pub fn quant_source(file: &str, ty: GgmlType, subgroups: bool) -> Option<String> {
    let name = QUANT_FORMATS.iter().find(|(t, _)| *t == ty)?.1;
    let body = match file {
        SUBGROUP_FILE => linear_body(QUANT_ACCESS, subgroups),
        "qembed.wgsl" => QEMBED.to_owned(),
        _ => return None,
    };
    let header = format!(
        "const QK: u32 = {}u;\nconst TS: u32 = {}u;\nfn deq4(b: u32, j: u32) -> vec4<f32> {{\n    return deq4_{name}(b, j);\n}}\n",
        ty.block_size(),
        ty.type_size()
    );
    Some(format!("{header}\n{COMMON}\n{QUANT}\n{body}"))
}

/// The full source of kernel `file` with weights and KV cache of type f16 (`f16 = true`)
/// or f32 (with the subgroup GEMV when `subgroups`).
pub fn source(file: &str, f16: bool, subgroups: bool) -> Option<String> {
    source_with(file, f16, subgroups, DENSE_ACCESS)
}

/// matmul.wgsl over dense weights read as 4-vectors (for k a multiple of 4).
pub fn dense4_source(f16: bool, subgroups: bool) -> String {
    source_with(SUBGROUP_FILE, f16, subgroups, DENSE4_ACCESS).expect("listed")
}

fn source_with(file: &str, f16: bool, subgroups: bool, dense_access: &str) -> Option<String> {
    let body = FILES.iter().find(|(name, _)| *name == file)?.1;
    let body = if file == SUBGROUP_FILE { linear_body(dense_access, subgroups) } else { body.to_owned() };
    let header =
        if f16 { "enable f16;\nalias W = f16;\nalias KV = f16;\n" } else { "alias W = f32;\nalias KV = f32;\n" };
    let reduce = if USES_REDUCE.contains(&file) { REDUCE } else { "" };
    Some(format!("{header}\n{COMMON}\n{reduce}\n{body}"))
}

/// Every (label, source) the backend may compile: each file in f32, the files that read
/// weights or the KV cache again in f16, the linear layers again over 4-vector dense
/// access, the quantized files per block format, and the GEMV files again with subgroups
/// (labels end in `+subgroups`).
pub fn kernel_sources() -> Vec<(String, String)> {
    let mut out = Vec::new();
    for subgroups in [false, true] {
        let sg = if subgroups { " +subgroups" } else { "" };
        for (file, _) in FILES {
            if subgroups && file != SUBGROUP_FILE {
                continue;
            }
            out.push((format!("{file} (f32){sg}"), source(file, false, subgroups).expect("listed")));
            if F16_FILES.contains(&file) {
                out.push((format!("{file} (f16){sg}"), source(file, true, subgroups).expect("listed")));
            }
            if file == SUBGROUP_FILE {
                out.push((format!("{file} (f32, vec4){sg}"), dense4_source(false, subgroups)));
                out.push((format!("{file} (f16, vec4){sg}"), dense4_source(true, subgroups)));
            }
        }
        for file in QUANT_FILES {
            if subgroups && file != SUBGROUP_FILE {
                continue;
            }
            for (ty, name) in QUANT_FORMATS {
                out.push((format!("{file} ({name}){sg}"), quant_source(file, ty, subgroups).expect("listed")));
            }
        }
    }
    out
}

/// Files whose kernels read weights (type `W`) or the KV cache (type `KV`).
const F16_FILES: [&str; 3] = ["matmul.wgsl", "embed.wgsl", "attention.wgsl"];

/// How a kernel binds its buffers. Binding 0 is always the kernel's parameters, a
/// uniform read at a dynamic offset into the per-submission arena, so one bind group
/// serves every dispatch on the same buffers and can be cached.
#[derive(Clone, Copy)]
enum Slot {
    Read,
    ReadWrite,
}

/// The storage bindings (1..) of each entry point, as the WGSL declares them.
fn slots(entry: &str) -> &'static [(u32, Slot)] {
    use Slot::*;
    match entry {
        "add" => &[(1, ReadWrite), (2, Read)],
        "gelu" => &[(1, ReadWrite)],
        "swiglu" | "geglu" => &[(1, ReadWrite), (2, Read)],
        "scale" => &[(1, ReadWrite)],
        "qk_norm" => &[(1, ReadWrite), (3, Read), (4, Read)],
        "rms_norm" => &[(1, ReadWrite), (3, Read), (5, ReadWrite)],
        "add_rms_norm" => &[(1, ReadWrite), (2, Read), (3, Read), (5, ReadWrite)],
        "layer_norm" => &[(1, ReadWrite), (3, Read), (4, Read), (5, ReadWrite)],
        "add_layer_norm" => &[(1, ReadWrite), (2, Read), (3, Read), (4, Read), (5, ReadWrite)],
        "matmul" | "gemv" | "gemv_thread" | "gemv_sg" => &[(1, Read), (2, Read), (3, Read), (4, ReadWrite)],
        "matmul_reduce" => &[(3, Read), (4, ReadWrite), (5, Read)],
        "kv_store" => &[(1, Read), (2, ReadWrite), (4, Read)],
        "attend" => &[(1, Read), (2, ReadWrite), (3, ReadWrite), (4, Read)],
        "embed" | "qembed" => &[(1, Read), (2, Read), (3, ReadWrite)],
        "argmax" => &[(1, Read), (2, ReadWrite)],
        _ => &[],
    }
}

/// A compute pipeline and its bind-group layout.
pub struct Kernel {
    pub pipeline: wgpu::ComputePipeline,
    pub layout: wgpu::BindGroupLayout,
    /// Distinguishes kernels in the bind-group cache.
    pub id: usize,
}

/// The linear-layer kernels of one matmul.wgsl module (one weight form and access).
pub struct LinearKernels {
    pub matmul: Kernel,
    pub gemv: Kernel,
    pub gemv_thread: Kernel,
    /// With subgroups only.
    pub gemv_sg: Option<Kernel>,
}

impl LinearKernels {
    fn build(device: &wgpu::Device, m: &wgpu::ShaderModule, subgroups: bool) -> BackendResult<Self> {
        Ok(LinearKernels {
            matmul: build_kernel(device, m, "matmul")?,
            gemv: build_kernel(device, m, "gemv")?,
            gemv_thread: build_kernel(device, m, "gemv_thread")?,
            gemv_sg: subgroups.then(|| build_kernel(device, m, SUBGROUP_ENTRY)).transpose()?,
        })
    }
}

/// Every pipeline the backend dispatches. `*_f16` exist when the device has shader-f16.
pub struct Kernels {
    pub add: Kernel,
    pub gelu: Kernel,
    pub swiglu: Kernel,
    pub geglu: Kernel,
    pub scale: Kernel,
    pub qk_norm: Kernel,
    pub layer_norm: Kernel,
    pub add_layer_norm: Kernel,
    pub rms_norm: Kernel,
    pub add_rms_norm: Kernel,
    /// The linear layers over dense f32 weights, read a value at a time.
    pub dense: LinearKernels,
    /// The split matmul's second pass (for every weight type: it reads only f32 sums).
    pub matmul_reduce: Kernel,
    pub kv_store: Kernel,
    pub attend: Kernel,
    pub embed: Kernel,
    pub argmax: Kernel,
    pub dense_f16: Option<LinearKernels>,
    pub embed_f16: Option<Kernel>,
    pub kv_store_f16: Option<Kernel>,
    pub attend_f16: Option<Kernel>,
    /// The linear layers over dense weights read as 4-vectors (k a multiple of 4).
    pub dense4: LinearKernels,
    pub dense4_f16: Option<LinearKernels>,
}

/// Distinguishes kernels in the bind-group cache (quantized kernels are built later
/// than the rest, so the ids come from one counter).
static NEXT_KERNEL_ID: AtomicUsize = AtomicUsize::new(1);

/// Compile one WGSL module; shader errors are caught in an error scope and returned,
/// naming the kernel, instead of reaching wgpu's panicking default handler.
fn compile_module(device: &wgpu::Device, label: &str, src: String) -> BackendResult<wgpu::ShaderModule> {
    let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let m = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label: Some(label),
        source: wgpu::ShaderSource::Wgsl(src.into()),
    });
    if let Some(e) = pollster::block_on(scope.pop()) {
        return Err(BackendError::Device(format!("kernel {label} failed to compile: {e}")));
    }
    Ok(m)
}

/// The pipeline of `entry` in `m`, with its bind-group layout from [`slots`].
fn build_kernel(device: &wgpu::Device, m: &wgpu::ShaderModule, entry: &str) -> BackendResult<Kernel> {
    let scope = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let mut entries = vec![wgpu::BindGroupLayoutEntry {
        binding: 0,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Uniform,
            has_dynamic_offset: true,
            min_binding_size: None,
        },
        count: None,
    }];
    entries.extend(slots(entry).iter().map(|&(binding, slot)| wgpu::BindGroupLayoutEntry {
        binding,
        visibility: wgpu::ShaderStages::COMPUTE,
        ty: wgpu::BindingType::Buffer {
            ty: wgpu::BufferBindingType::Storage { read_only: matches!(slot, Slot::Read) },
            has_dynamic_offset: false,
            min_binding_size: None,
        },
        count: None,
    }));
    let layout =
        device.create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: Some(entry), entries: &entries });
    let pipeline_layout = device.create_pipeline_layout(&wgpu::PipelineLayoutDescriptor {
        label: Some(entry),
        bind_group_layouts: &[Some(&layout)],
        immediate_size: 0,
    });
    let pipeline = device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label: Some(entry),
        layout: Some(&pipeline_layout),
        module: m,
        entry_point: Some(entry),
        compilation_options: Default::default(),
        cache: None,
    });
    if let Some(e) = pollster::block_on(scope.pop()) {
        return Err(BackendError::Device(format!("kernel {entry} failed to build: {e}")));
    }
    Ok(Kernel { pipeline, layout, id: NEXT_KERNEL_ID.fetch_add(1, Ordering::Relaxed) })
}

/// The kernels for weights in one GGUF block format, read in place.
pub struct QuantKernels {
    pub ty: GgmlType,
    pub linear: LinearKernels,
    pub embed: Kernel,
}

impl QuantKernels {
    /// Compile the kernels for blocks of `ty` (one of [`QUANT_FORMATS`]).
    pub fn compile(device: &wgpu::Device, ty: GgmlType, subgroups: bool) -> BackendResult<Self> {
        let module = |file: &str| -> BackendResult<wgpu::ShaderModule> {
            let src = quant_source(file, ty, subgroups)
                .ok_or_else(|| BackendError::Unsupported(format!("no GPU kernels for {} blocks", ty.name())))?;
            compile_module(device, &format!("{file} ({})", ty.name()), src)
        };
        let (mm, embed) = (module(SUBGROUP_FILE)?, module("qembed.wgsl")?);
        Ok(QuantKernels {
            ty,
            linear: LinearKernels::build(device, &mm, subgroups)?,
            embed: build_kernel(device, &embed, "qembed")?,
        })
    }
}

impl Kernels {
    /// Compile every kernel (errors name the kernel; see [`compile_module`]).
    pub fn compile(device: &wgpu::Device, f16: bool, subgroups: bool) -> BackendResult<Self> {
        let module = |file: &str, f16: bool| -> BackendResult<wgpu::ShaderModule> {
            let src = source(file, f16, subgroups)
                .ok_or_else(|| BackendError::Invalid(format!("unknown kernel file {file}")))?;
            compile_module(device, file, src)
        };
        let kernel = |m: &wgpu::ShaderModule, entry: &str| build_kernel(device, m, entry);
        let elementwise = module("elementwise.wgsl", false)?;
        let ln = module("layer_norm.wgsl", false)?;
        let mm = module("matmul.wgsl", false)?;
        let attn = module("attention.wgsl", false)?;
        let embed = module("embed.wgsl", false)?;
        let argmax = module("argmax.wgsl", false)?;
        // f16 variants: each module compiled once, then its entry points.
        let (mm16, embed16, attn16) = if f16 {
            (
                Some(module("matmul.wgsl", true)?),
                Some(module("embed.wgsl", true)?),
                Some(module("attention.wgsl", true)?),
            )
        } else {
            (None, None, None)
        };
        let f16_kernel = |m: &Option<wgpu::ShaderModule>, entry: &str| -> BackendResult<Option<Kernel>> {
            m.as_ref().map(|m| kernel(m, entry)).transpose()
        };
        let dense4 = |f16: bool| -> BackendResult<LinearKernels> {
            let label = if f16 { "matmul.wgsl (f16, vec4)" } else { "matmul.wgsl (f32, vec4)" };
            let m = compile_module(device, label, dense4_source(f16, subgroups))?;
            LinearKernels::build(device, &m, subgroups)
        };
        Ok(Kernels {
            add: kernel(&elementwise, "add")?,
            gelu: kernel(&elementwise, "gelu")?,
            swiglu: kernel(&elementwise, "swiglu")?,
            geglu: kernel(&elementwise, "geglu")?,
            scale: kernel(&elementwise, "scale")?,
            qk_norm: kernel(&ln, "qk_norm")?,
            layer_norm: kernel(&ln, "layer_norm")?,
            add_layer_norm: kernel(&ln, "add_layer_norm")?,
            rms_norm: kernel(&ln, "rms_norm")?,
            add_rms_norm: kernel(&ln, "add_rms_norm")?,
            dense: LinearKernels::build(device, &mm, subgroups)?,
            matmul_reduce: kernel(&mm, "matmul_reduce")?,
            kv_store: kernel(&attn, "kv_store")?,
            attend: kernel(&attn, "attend")?,
            embed: kernel(&embed, "embed")?,
            argmax: kernel(&argmax, "argmax")?,
            dense_f16: mm16.as_ref().map(|m| LinearKernels::build(device, m, subgroups)).transpose()?,
            embed_f16: f16_kernel(&embed16, "embed")?,
            kv_store_f16: f16_kernel(&attn16, "kv_store")?,
            attend_f16: f16_kernel(&attn16, "attend")?,
            dense4: dense4(false)?,
            dense4_f16: if f16 { Some(dense4(true)?) } else { None },
        })
    }
}

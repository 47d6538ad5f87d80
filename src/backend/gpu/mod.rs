//! The GPU backend: hand-written WGSL compute kernels run through wgpu (Vulkan on Linux
//! and NVIDIA, Metal on Apple Silicon, DX12 on Windows; Mesa's lavapipe in CI).
//!
//! - Weights are uploaded once at load, stored `[out, in]` in f32 or f16, and split into
//!   row chunks that each fit one storage binding (lavapipe allows 128 MiB; GPT-2's
//!   embedding table is 154 MB, gpt2-xl's 322 MB).
//! - Activations live in device buffers recycled through a size-class pool.
//! - The KV cache is resident: one buffer per layer per sequence.
//! - Every op records a dispatch into one open compute pass of one pending command
//!   encoder; nothing is submitted until a result is read back, so a whole forward step
//!   is one submission. Kernel parameters go into a per-submission uniform arena (written
//!   just before submitting) read at a dynamic offset, so bind groups depend only on
//!   buffers and are cached: a warm decode step creates none.
//! - Only what the caller asks for is read back: the selected rows' logits, or with
//!   [`Backend::argmax_rows`] just the greedy token ids (4 bytes per sequence).
//! - wgpu errors never panic: an uncaptured-error handler records them and the next
//!   read-back returns them as an error.

pub mod device;
pub mod kernels;

use std::collections::HashMap;
use std::num::NonZeroU64;
use std::sync::{Arc, Mutex, MutexGuard};

use wgpu::util::DeviceExt;

use super::WeightDtype;
use super::{
    AttentionSpec, Backend, BackendError, BackendResult, HostMatrix, KvCache, KvLayout, KvRings, KvShape, MatrixLayout,
    Rope, RopeStyle, SeqSlice, attention_pieces, check_attention, needs_pieces,
};
use crate::tensor::GgmlType;
use crate::tensor::KvDtype;
use crate::tensor::{Dtype, TensorView};
use kernels::{Kernel, Kernels, QuantKernels};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GpuOptions {
    /// Weight storage: `None` keeps f16 files in f16 (when the adapter has shader-f16)
    /// and stores everything else in f32. bf16 is not a GPU storage type here.
    pub weight_dtype: Option<WeightDtype>,
    /// Which decode GEMV kernel to use.
    pub gemv: GemvKernel,
    /// Store the KV cache in f16 (needs shader-f16).
    pub kv_dtype: KvDtype,
    /// How long a read-back waits for the device before it gives up with an error
    /// (`None`: [`DEFAULT_POLL_TIMEOUT`], or `BATCH_FORGE_GPU_TIMEOUT_S` seconds).
    pub poll_timeout: Option<std::time::Duration>,
    /// Batch invariance (what the server runs with): every linear layer takes the tiled
    /// matmul kernel, whose per-output sum order does not depend on the number of rows
    /// (whole or split over K), never the few-row GEMV (attention and the row ops are
    /// per row already).
    pub batch_invariant: bool,
    /// Split the tiled matmul over K's spans: `None` for decode-sized batches (up to 64
    /// rows) whose grid would be small, on a GPU only (never on a CPU-backed adapter);
    /// `Some(true)` whenever K has two spans and the sums fit; `Some(false)` never.
    /// Either way gives the same bits; tests and benchmarks compare the two. (Outside
    /// batch-invariant mode, batches of up to 8 rows take the GEMV, never the matmul.)
    pub split_k: Option<bool>,
    /// Split weight matrices into chunks of at most this many bytes (default: the
    /// adapter's largest storage binding). Tests use it to run the multi-chunk paths on
    /// small matrices.
    pub chunk_bytes: Option<u64>,
}

/// A read-back waits this long for the device by default: far past any single step of
/// the models here, even on a software adapter, yet a hung driver ends in an error.
pub const DEFAULT_POLL_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(300);

/// The decode GEMV kernels (see matmul.wgsl and gemv_sg.wgsl); the parity tests run each.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum GemvKernel {
    /// `Thread` on CPU-type adapters (lavapipe); on GPUs `Subgroup` where the adapter has
    /// subgroups, else `Cooperative`.
    #[default]
    Auto,
    /// 32 invocations per output column, coalesced reads, reduction in workgroup memory.
    Cooperative,
    /// One invocation per output column.
    Thread,
    /// A subgroup per output column, reduced with `subgroupAdd` (needs wgpu's subgroup
    /// feature).
    Subgroup,
}

/// Decode-sized batches (at most this many rows) use the GEMV kernel.
const GEMV_MAX_ROWS: usize = 8;
/// The K span of the matmul's sum order (matmul.wgsl's `KC`).
const MATMUL_SPAN: usize = 256;
/// A decode-sized matmul (at most 64 rows: one row tile) with fewer column tiles than
/// this runs split over K's spans on a GPU, then reduces them; the bits are the same
/// either way (see matmul.wgsl).
const SPLIT_BELOW_GROUPS: usize = 512;
/// The spans' sums of a split matmul take at most this many bytes (as pooled).
const SPLIT_MAX_BYTES: u64 = 64 << 20;
/// Kernel parameter slots per submission (a GPT-2 XL step needs about 600).
const PARAM_SLOTS: usize = 4096;

pub struct GpuBackend {
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    /// Largest storage binding, in bytes.
    max_binding: u64,
    max_groups: u32,
    f16: bool,
    /// The decode GEMV in use (never `Auto`).
    gemv: GemvKernel,
    /// Output columns per workgroup of the subgroup GEMV: 256 / the widest subgroup.
    sg_cols: u32,
    opts: GpuOptions,
    /// How long a read-back waits for the device.
    poll_timeout: std::time::Duration,
    adapter_f16: bool,
    kernels: Kernels,
    params_buf: wgpu::Buffer,
    param_slot: u64,
    dummy: wgpu::Buffer,
    /// RoPE cos/sin tables by (RoPE without its style, head_dim): the largest capacity built so far.
    rope_tables: Mutex<Vec<(Rope, usize, usize, wgpu::Buffer)>>,
    /// Kernels for block-quantized weights, compiled per format on first use.
    quant_kernels: Mutex<HashMap<GgmlType, Arc<QuantKernels>>>,
    /// The device was opened with wgpu's subgroup feature.
    subgroups: bool,
    /// Bytes of weights (matrices and vectors) uploaded so far.
    weight_bytes: std::sync::atomic::AtomicU64,
    /// Matmuls recorded split over K so far.
    split_matmuls: std::sync::atomic::AtomicU64,
    state: Mutex<State>,
    bind_groups: Arc<BindCache>,
    pool: Arc<Pool>,
    errors: Arc<Mutex<Option<BackendError>>>,
}

/// Most buffer bindings any kernel has (add_layer_norm), besides its parameters.
const MAX_BINDINGS: usize = 5;

/// A cached bind group's identity: the kernel and its buffer bindings (a fixed array,
/// so looking one up allocates nothing).
#[derive(PartialEq, Eq, Hash)]
struct BindKey {
    kernel: usize,
    buffers: [Option<BoundBuffer>; MAX_BINDINGS],
}

/// (binding, buffer, offset, size) of one buffer binding.
type BoundBuffer = (u32, wgpu::Buffer, u64, Option<NonZeroU64>);

type BindCache = Mutex<HashMap<BindKey, wgpu::BindGroup>>;

/// Cached bind groups hold their buffers alive; past this many the cache starts over.
const BIND_CACHE_MAX: usize = 4096;

#[derive(Default)]
struct State {
    /// The open compute pass of `encoder` (it holds the encoder until dropped).
    pass: Option<wgpu::ComputePass<'static>>,
    encoder: Option<wgpu::CommandEncoder>,
    /// Parameters of the dispatches recorded since the last submission.
    params: Vec<u8>,
    staging: Option<wgpu::Buffer>,
}

impl State {
    /// The pending encoder, with no pass open (for copies).
    fn encoder(&mut self, device: &wgpu::Device) -> &mut wgpu::CommandEncoder {
        self.pass = None;
        self.encoder.get_or_insert_with(|| device.create_command_encoder(&Default::default()))
    }

    /// The open compute pass, begun on the pending encoder if there is none.
    fn pass(&mut self, device: &wgpu::Device) -> &mut wgpu::ComputePass<'static> {
        if self.pass.is_none() {
            let enc = self.encoder.get_or_insert_with(|| device.create_command_encoder(&Default::default()));
            self.pass = Some(enc.begin_compute_pass(&Default::default()).forget_lifetime());
        }
        self.pass.as_mut().expect("just begun")
    }
}

impl GpuBackend {
    /// Open the chosen adapter (see [`device::choose_adapter`]) and compile the kernels.
    pub fn new(opts: GpuOptions) -> BackendResult<Self> {
        Self::check_options(&opts)?;
        let adapter = device::choose_adapter()?;
        Self::with_adapter(&adapter, opts)
    }

    /// The option checks that need no device, so a bad flag is reported before any
    /// adapter is looked for.
    pub fn check_options(opts: &GpuOptions) -> BackendResult<()> {
        check!(
            Unsupported: opts.weight_dtype != Some(WeightDtype::BF16),
            "the gpu backend stores weights in f32 or f16; bf16 is cpu-only"
        );
        check!(opts.chunk_bytes.is_none_or(|c| c >= 4), "chunk_bytes must be at least 4");
        Ok(())
    }

    pub fn with_adapter(adapter: &wgpu::Adapter, opts: GpuOptions) -> BackendResult<Self> {
        Self::check_options(&opts)?;
        let info = adapter.get_info();
        let want_f16 = opts.weight_dtype != Some(WeightDtype::F32) || opts.kv_dtype == KvDtype::F16;
        let (device, queue, f16, subgroups) = device::request_device(adapter, want_f16)?;
        check!(
            Unsupported: f16 || opts.kv_dtype != KvDtype::F16,
            "--kv-dtype f16 needs shader-f16, which {} does not have",
            info.name
        );
        let errors: Arc<Mutex<Option<BackendError>>> = Arc::default();
        let sink = errors.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut slot = sink.lock().unwrap_or_else(|p| p.into_inner());
            slot.get_or_insert_with(|| match e {
                wgpu::Error::OutOfMemory { .. } => BackendError::Memory(format!("GPU error: {e}")),
                e => BackendError::Device(format!("GPU error: {e}")),
            });
        }));
        let limits = device.limits();
        let kernels = Kernels::compile(&device, f16, subgroups)?;
        // Slots are aligned for both uniform (parameters) and storage (token ids) bindings.
        let param_slot = u64::from(limits.min_uniform_buffer_offset_alignment)
            .max(u64::from(limits.min_storage_buffer_offset_alignment))
            .max(64);
        let params_buf = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("kernel params"),
            size: param_slot * PARAM_SLOTS as u64,
            usage: wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let dummy = device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("unused binding"),
            size: 256,
            usage: wgpu::BufferUsages::STORAGE,
            mapped_at_creation: false,
        });
        let max_binding = limits.max_storage_buffer_binding_size.min(limits.max_buffer_size);
        let poll_timeout = match opts.poll_timeout {
            Some(t) => t,
            None => match std::env::var("BATCH_FORGE_GPU_TIMEOUT_S") {
                Ok(v) => v
                    .parse::<f64>()
                    .ok()
                    .filter(|s| s.is_finite() && *s > 0.0 && *s < 1e9)
                    .map(std::time::Duration::from_secs_f64)
                    .ok_or_else(|| {
                        BackendError::Invalid(format!(
                            "BATCH_FORGE_GPU_TIMEOUT_S={v:?} is not a positive number of seconds"
                        ))
                    })?,
                Err(_) => DEFAULT_POLL_TIMEOUT,
            },
        };
        let gemv = match opts.gemv {
            GemvKernel::Auto if info.device_type == wgpu::DeviceType::Cpu => GemvKernel::Thread,
            GemvKernel::Auto if subgroups => GemvKernel::Subgroup,
            GemvKernel::Auto => GemvKernel::Cooperative,
            GemvKernel::Subgroup => {
                check!(Unsupported: subgroups, "the subgroup GEMV needs subgroups, which {} does not have", info.name);
                GemvKernel::Subgroup
            }
            other => other,
        };
        // One column per subgroup when subgroups are as wide as they can be; narrower
        // ones leave some subgroups idle rather than queueing columns behind each other
        // (Metal and some Vulkan drivers report a minimum of 4 whatever they run).
        let sg_cols = (256 / info.subgroup_max_size.clamp(1, 256)).max(1);
        let backend = GpuBackend {
            adapter_f16: adapter.features().contains(wgpu::Features::SHADER_F16),
            poll_timeout,
            info,
            gemv,
            sg_cols,
            subgroups,
            max_binding,
            max_groups: limits.max_compute_workgroups_per_dimension,
            f16,
            opts,
            kernels,
            params_buf,
            param_slot,
            dummy,
            rope_tables: Mutex::default(),
            quant_kernels: Mutex::default(),
            weight_bytes: Default::default(),
            split_matmuls: Default::default(),
            state: Mutex::default(),
            bind_groups: Arc::default(),
            pool: Arc::new(Pool { device: device.clone(), free: Mutex::default() }),
            errors,
            device,
            queue,
        };
        backend.check()?;
        Ok(backend)
    }

    /// Adapter, API and weight storage, for logs and `forge bench`.
    pub fn description(&self) -> String {
        let gemv = match self.gemv {
            GemvKernel::Thread => "thread",
            GemvKernel::Subgroup => "subgroup",
            _ => "cooperative",
        };
        format!(
            "{} ({:?}, shader-f16: {}, subgroups: {}, gemv: {gemv})",
            self.info.name, self.info.backend, self.f16, self.subgroups
        )
    }

    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.info
    }

    /// Whether the adapter is a software rasterizer (lavapipe/llvmpipe, SwiftShader, WARP):
    /// it runs on the CPU, far slower than the cpu backend.
    pub fn is_software(&self) -> bool {
        self.info.device_type == wgpu::DeviceType::Cpu
    }

    /// Whether 16-bit weights are available (the adapter has shader-f16).
    pub fn has_f16(&self) -> bool {
        self.f16
    }

    /// How many matmuls ran split over K so far (tests check which way ran).
    pub fn split_matmuls(&self) -> u64 {
        self.split_matmuls.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Device memory taken by the weights loaded so far (matrices and vectors).
    pub fn weight_bytes(&self) -> u64 {
        self.weight_bytes.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A device buffer holding weights (counted in [`Self::weight_bytes`]).
    fn weight_buffer(&self, bytes: &[u8]) -> wgpu::Buffer {
        let buf = self.init_buffer(bytes, wgpu::BufferUsages::STORAGE);
        self.weight_bytes.fetch_add(buf.size(), std::sync::atomic::Ordering::Relaxed);
        buf
    }

    /// Whether the device was opened with subgroups (the subgroup GEMV can run).
    pub fn has_subgroups(&self) -> bool {
        self.subgroups
    }

    /// The largest storage binding the device allows, in bytes.
    pub fn max_binding_bytes(&self) -> u64 {
        self.max_binding
    }

    /// The most bytes one chunk of weight rows may hold: one storage binding (or the
    /// `chunk_bytes` option), at most 4 GiB (kernels address a chunk's bytes with u32),
    /// a whole number of words (so the padding to one stays inside the binding).
    /// The most weight rows in one chunk: the tiled matmul covers a chunk with one
    /// workgroup per 64 rows in one grid dimension.
    fn max_chunk_rows(&self) -> usize {
        self.max_groups as usize * 64
    }

    fn chunk_limit(&self) -> u64 {
        self.max_binding.min(u64::from(u32::MAX)).min(self.opts.chunk_bytes.unwrap_or(u64::MAX)) & !3
    }

    /// Whether the adapter offers shader-f16 at all (whether or not this backend asked
    /// for it), so tests can tell "not supported here" from "not turned on".
    pub fn adapter_supports_f16(&self) -> bool {
        self.adapter_f16
    }

    /// The first wgpu error since the last check, as an error.
    fn check(&self) -> BackendResult<()> {
        match self.errors.lock().unwrap_or_else(|p| p.into_inner()).take() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn fail(&self, msg: String) {
        self.errors
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_or_insert(BackendError::Invalid(format!("GPU error: {msg}")));
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Submit everything recorded so far (parameters first).
    fn submit(&self, st: &mut State) {
        st.pass = None;
        if !st.params.is_empty() {
            self.queue.write_buffer(&self.params_buf, 0, &st.params);
            st.params.clear();
        }
        if let Some(enc) = st.encoder.take() {
            self.queue.submit([enc.finish()]);
        }
    }

    fn take(&self, rows: usize, cols: usize) -> GpuAct {
        GpuAct { rows, cols, buf: self.pool.take(rows * cols * 4) }
    }

    /// (x, y) workgroup counts covering `n` workgroups within the per-dimension limit.
    fn grid(&self, n: usize) -> (u32, u32) {
        let max = self.max_groups as usize;
        if n <= max { (n as u32, 1) } else { (max as u32, n.div_ceil(max) as u32) }
    }

    /// Record one dispatch: `params` (u32 words) become binding 0, `bindings` the rest,
    /// and `data` (a small per-call input such as token ids) a storage binding into the
    /// same per-submission arena, right after the parameters. All dispatches of a step go
    /// into one compute pass; wgpu orders dependent ones. Bind groups without `data`
    /// depend only on buffers and are cached.
    fn dispatch(
        &self,
        k: &Kernel,
        params: &[u32],
        bindings: &[(u32, wgpu::BufferBinding<'_>)],
        groups: (u32, u32),
        data: Option<(u32, &[u32])>,
    ) {
        if groups.0 == 0 || groups.1 == 0 {
            return;
        }
        let data_bytes = data.map_or(0, |(_, d)| (d.len() as u64 * 4).next_multiple_of(self.param_slot));
        let needed = self.param_slot + data_bytes;
        if needed > self.params_buf.size() {
            self.fail(format!("{} bytes of kernel input exceed the {} byte arena", needed, self.params_buf.size()));
            return;
        }
        let mut st = self.lock();
        if st.params.len() as u64 + needed > self.params_buf.size() {
            self.submit(&mut st);
        }
        let offset = st.params.len() as u64;
        st.params.extend(params.iter().flat_map(|w| w.to_le_bytes()));
        st.params.resize((offset + self.param_slot) as usize, 0);
        if let Some((_, d)) = data {
            st.params.extend(d.iter().flat_map(|w| w.to_le_bytes()));
            st.params.resize((offset + needed) as usize, 0);
        }
        let make = || {
            let arena = |offset, size| {
                wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &self.params_buf,
                    offset,
                    size: NonZeroU64::new(size),
                })
            };
            let mut entries = vec![wgpu::BindGroupEntry { binding: 0, resource: arena(0, params.len() as u64 * 4) }];
            entries.extend(bindings.iter().map(|(i, b)| wgpu::BindGroupEntry {
                binding: *i,
                resource: wgpu::BindingResource::Buffer(b.clone()),
            }));
            if let Some((binding, d)) = data {
                entries.push(wgpu::BindGroupEntry {
                    binding,
                    resource: arena(offset + self.param_slot, (d.len() as u64 * 4).max(4)),
                });
            }
            self.device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: None,
                layout: &k.layout,
                entries: &entries,
            })
        };
        let bind_group = if data.is_none() && bindings.len() <= MAX_BINDINGS {
            let mut key = BindKey { kernel: k.id, buffers: Default::default() };
            for (slot, (i, b)) in key.buffers.iter_mut().zip(bindings) {
                *slot = Some((*i, b.buffer.clone(), b.offset, b.size));
            }
            let mut groups = self.bind_groups.lock().unwrap_or_else(|p| p.into_inner());
            if groups.len() >= BIND_CACHE_MAX {
                groups.clear();
            }
            groups.entry(key).or_insert_with(make).clone()
        } else {
            make()
        };
        let pass = st.pass(&self.device);
        pass.set_pipeline(&k.pipeline);
        pass.set_bind_group(0, &bind_group, &[offset as u32]);
        pass.dispatch_workgroups(groups.0, groups.1, 1);
    }

    fn with_encoder(&self, f: impl FnOnce(&mut wgpu::CommandEncoder)) {
        let mut st = self.lock();
        f(st.encoder(&self.device));
    }

    /// A fresh device buffer holding `bytes` (written at creation, so it cannot race the
    /// pending encoder the way a queue write into a recycled buffer would).
    fn init_buffer(&self, bytes: &[u8], usage: wgpu::BufferUsages) -> wgpu::Buffer {
        let mut padded;
        let contents = if !bytes.len().is_multiple_of(4) || bytes.is_empty() {
            padded = bytes.to_vec();
            padded.resize(bytes.len().next_multiple_of(4).max(4), 0);
            &padded[..]
        } else {
            bytes
        };
        self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor { label: None, contents, usage })
    }

    /// The RoPE table for `rope` and `head_dim` covering positions `0..capacity`:
    /// `[pos][head_dim/2]` (cos, sin) from [`Rope::cos_sin`], built once per (θ, frequency
    /// factors, head_dim) and rebuilt only for a larger capacity.
    fn rope_table(&self, rope: &Rope, head_dim: usize, capacity: usize) -> BackendResult<wgpu::Buffer> {
        let mut tables = self.rope_tables.lock().unwrap_or_else(|p| p.into_inner());
        // The style does not change the table, only which values it rotates.
        let key = Rope { style: RopeStyle::Halves, ..rope.clone() };
        if let Some((.., cap, buf)) = tables.iter().find(|t| t.0 == key && t.1 == head_dim)
            && *cap >= capacity
        {
            return Ok(buf.clone());
        }
        let half = head_dim / 2;
        let bytes = (capacity.max(1) as u64)
            .checked_mul(half as u64 * 8)
            .ok_or_else(|| BackendError::Memory("RoPE table size overflows".into()))?;
        check!(
            Memory: bytes <= self.max_binding,
            "a RoPE table of {capacity} positions needs {bytes} bytes, over the adapter's {} byte binding",
            self.max_binding
        );
        let mut data = Vec::with_capacity(bytes as usize);
        for pos in 0..capacity.max(1) {
            for i in 0..half {
                let (c, s) = rope.cos_sin(head_dim, pos, i);
                data.extend(c.to_le_bytes());
                data.extend(s.to_le_bytes());
            }
        }
        let buf = self.init_buffer(&data, wgpu::BufferUsages::STORAGE);
        tables.retain(|t| !(t.0 == key && t.1 == head_dim));
        tables.push((key, head_dim, capacity, buf.clone()));
        Ok(buf)
    }

    fn bias_binding<'a>(&'a self, bias: Option<&'a GpuVector>) -> wgpu::BufferBinding<'a> {
        match bias {
            Some(v) => v.buffer.as_entire_buffer_binding(),
            None => self.dummy.as_entire_buffer_binding(),
        }
    }

    /// The kernels for `ty` blocks, compiled on first use.
    fn quant_kernels(&self, ty: GgmlType) -> BackendResult<Arc<QuantKernels>> {
        let mut all = self.quant_kernels.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(k) = all.get(&ty) {
            return Ok(k.clone());
        }
        let k = Arc::new(QuantKernels::compile(&self.device, ty, self.subgroups)?);
        all.insert(ty, k.clone());
        Ok(k)
    }

    /// (matmul, gemv, embed) kernels for the weights of `m`.
    fn weight_kernels<'a>(&'a self, m: &'a GpuMatrix) -> (&'a Kernel, &'a Kernel, &'a Kernel) {
        let k = &self.kernels;
        let (set, embed) = match &m.quant {
            Some(q) => (&q.linear, &q.embed),
            None if m.dtype == WeightDtype::F16 => {
                let embed = k.embed_f16.as_ref().expect("f16 weights imply shader-f16");
                // Rows of whole 4-vectors take the vector-load variants (same matmul sums).
                let set = if m.cols > 0 && m.cols.is_multiple_of(4) { &k.dense4_f16 } else { &k.dense_f16 };
                (set.as_ref().expect("f16 weights imply shader-f16"), embed)
            }
            None => (if m.cols > 0 && m.cols.is_multiple_of(4) { &k.dense4 } else { &k.dense }, &k.embed),
        };
        let gemv = match self.gemv {
            GemvKernel::Thread => &set.gemv_thread,
            GemvKernel::Subgroup => set.gemv_sg.as_ref().expect("the subgroup GEMV implies subgroups"),
            _ => &set.gemv,
        };
        (&set.matmul, gemv, embed)
    }

    /// The K spans to split an (m x k) . (n x k)^T matmul over, or `None` to run it
    /// whole. Split when it has more than one span, its input fits one row block
    /// (`block` rows), its spans' sums fit one binding and [`SPLIT_MAX_BYTES`], and
    /// either the `split_k` option says so or, by default, it is a decode-sized batch
    /// (one 64-row tile) whose grid would be small on a GPU.
    fn split_spans(&self, m: usize, k: usize, n: usize, block: usize) -> Option<usize> {
        let spans = k.div_ceil(MATMUL_SPAN);
        let row_tiles = m.div_ceil(64);
        // The pool rounds a buffer up to a power of two.
        let bytes = spans.checked_mul(m).and_then(|v| v.checked_mul(n)).and_then(|v| v.checked_mul(4));
        let fits = m <= block
            && bytes.is_some_and(|b| (b.next_power_of_two() as u64) <= self.max_binding.min(SPLIT_MAX_BYTES))
            && spans * row_tiles <= self.max_groups as usize;
        // A CPU-backed adapter has a few threads, which the whole grid already fills:
        // there the second pass is only extra work (13% slower on lavapipe).
        let small = !self.is_software() && row_tiles == 1 && n.div_ceil(64) < SPLIT_BELOW_GROUPS;
        (spans > 1 && fits && self.opts.split_k.unwrap_or(small)).then_some(spans)
    }

    fn linear_impl(&self, x: &GpuAct, w: &GpuMatrix, bias: Option<&GpuVector>, gelu: bool) -> GpuAct {
        let (m, k, n) = (x.rows, w.cols, w.rows);
        let out = self.take(m, n);
        if x.cols != k {
            self.fail(format!("linear: input has {} columns, the weight expects {k}", x.cols));
            return out;
        }
        if m == 0 || n == 0 {
            return out;
        }
        let (matmul, gemv, _) = self.weight_kernels(w);
        let bias_b = self.bias_binding(bias);
        let flags = [u32::from(bias.is_some()), u32::from(gelu)];
        if m <= GEMV_MAX_ROWS && !self.opts.batch_invariant {
            for c in &w.chunks {
                let params = [
                    m as u32,
                    k as u32,
                    c.rows as u32,
                    c.row0 as u32,
                    n as u32,
                    flags[0],
                    flags[1],
                    self.sg_cols,
                    0,
                    1,
                ];
                let bindings = [
                    (1, x.binding()),
                    (2, c.buffer.as_entire_buffer_binding()),
                    (3, bias_b.clone()),
                    (4, out.binding()),
                ];
                let per_group = match self.gemv {
                    GemvKernel::Thread => 64,
                    GemvKernel::Subgroup => self.sg_cols as usize,
                    _ => 8,
                };
                self.dispatch(gemv, &params, &bindings, self.grid(c.rows.div_ceil(per_group)), None);
            }
            return out;
        }
        // Prefill: split the rows into blocks whose input and output each fit one
        // binding; blocks start at multiples of 64 rows, so every binding offset is a
        // multiple of 256 bytes (the strictest offset alignment wgpu allows).
        let widest = (k.max(n) * 4) as u64;
        let block = ((self.max_binding / widest / 64).max(1) * 64) as usize;
        if let Some(spans) = self.split_spans(m, k, n, block) {
            // Each workgroup sums one K span of one tile into `part` ([span][m][n]),
            // then one pass adds the spans in order and applies bias and activation.
            self.split_matmuls.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let row_tiles = m.div_ceil(64);
            let part = self.pool.take(spans * m * n * 4);
            let part_b = sub_binding(&part, 0, (spans * m * n * 4) as u64);
            for c in &w.chunks {
                let params = [m as u32, k as u32, c.rows as u32, c.row0 as u32, n as u32, 0, 0, 0, 1, row_tiles as u32];
                let bindings = [
                    (1, x.binding()),
                    (2, c.buffer.as_entire_buffer_binding()),
                    (3, bias_b.clone()),
                    (4, part_b.clone()),
                ];
                let groups = (c.rows.div_ceil(64) as u32, (spans * row_tiles) as u32);
                self.dispatch(matmul, &params, &bindings, groups, None);
            }
            let params = [m as u32, k as u32, n as u32, 0, n as u32, flags[0], flags[1], 0, 0, 1];
            let bindings = [(3, bias_b), (4, out.binding()), (5, part_b)];
            self.dispatch(&self.kernels.matmul_reduce, &params, &bindings, self.grid((m * n).div_ceil(64)), None);
            return out;
        }
        for m0 in (0..m).step_by(block) {
            let mb = block.min(m - m0);
            let a = sub_binding(&x.buf, (m0 * k * 4) as u64, (mb * k * 4) as u64);
            let o = sub_binding(&out.buf, (m0 * n * 4) as u64, (mb * n * 4) as u64);
            for c in &w.chunks {
                let params = [mb as u32, k as u32, c.rows as u32, c.row0 as u32, n as u32, flags[0], flags[1], 0, 0, 1];
                let bindings =
                    [(1, a.clone()), (2, c.buffer.as_entire_buffer_binding()), (3, bias_b.clone()), (4, o.clone())];
                self.dispatch(matmul, &params, &bindings, (c.rows.div_ceil(64) as u32, mb.div_ceil(64) as u32), None);
            }
        }
        out
    }
}

fn sub_binding(buf: &Pooled, offset: u64, size: u64) -> wgpu::BufferBinding<'_> {
    wgpu::BufferBinding { buffer: buf.buffer(), offset, size: NonZeroU64::new(size.max(4)) }
}

/// Recycled activation buffers, by power-of-two size class.
struct Pool {
    device: wgpu::Device,
    free: Mutex<HashMap<u64, Vec<wgpu::Buffer>>>,
}

const POOL_MAX_PER_CLASS: usize = 16;

impl Pool {
    fn take(self: &Arc<Self>, bytes: usize) -> Pooled {
        let class = (bytes as u64).next_power_of_two().max(256);
        let reused = self.free.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&class).and_then(Vec::pop);
        let buffer = reused.unwrap_or_else(|| {
            self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("activations"),
                size: class,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            })
        });
        Pooled { buffer: Some(buffer), pool: self.clone() }
    }
}

/// A pooled buffer; going back to the pool while commands that use it are still pending
/// is fine: a later user's commands are recorded after them and run in order.
struct Pooled {
    buffer: Option<wgpu::Buffer>,
    pool: Arc<Pool>,
}

impl Pooled {
    fn buffer(&self) -> &wgpu::Buffer {
        self.buffer.as_ref().expect("present until drop")
    }
}

impl Drop for Pooled {
    fn drop(&mut self) {
        if let Some(b) = self.buffer.take() {
            let mut free = self.pool.free.lock().unwrap_or_else(|p| p.into_inner());
            let list = free.entry(b.size()).or_default();
            if list.len() < POOL_MAX_PER_CLASS {
                list.push(b);
            }
        }
    }
}

/// A (rows, cols) f32 activation matrix on the device.
pub struct GpuAct {
    pub rows: usize,
    pub cols: usize,
    buf: Pooled,
}

impl GpuAct {
    fn binding(&self) -> wgpu::BufferBinding<'_> {
        sub_binding(&self.buf, 0, (self.rows * self.cols * 4) as u64)
    }
}

/// A weight matrix, `[out, in]` = (rows, cols), in chunks of whole rows.
pub struct GpuMatrix {
    pub rows: usize,
    pub cols: usize,
    /// The element type of dense weights (f32 for quantized ones: what they decode to).
    pub dtype: WeightDtype,
    /// Block-quantized weights: the format's kernels; the chunks hold the file's blocks.
    quant: Option<Arc<QuantKernels>>,
    chunks: Vec<Chunk>,
}

impl GpuMatrix {
    /// The GGUF block format the weights stay in on the device, if quantized.
    pub fn quant_type(&self) -> Option<GgmlType> {
        self.quant.as_ref().map(|q| q.ty)
    }

    /// Bytes of device memory the weights occupy.
    pub fn device_bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.buffer.size()).sum()
    }
}

struct Chunk {
    buffer: wgpu::Buffer,
    row0: usize,
    rows: usize,
}

pub struct GpuVector {
    buffer: wgpu::Buffer,
    len: usize,
}

/// One sequence's keys and values: per layer, [2][n_head][slots][head_dim] in f32 or f16
/// (position `pos` in slot `pos % slots`, [`KvRings`]).
pub struct GpuKvCache {
    layers: Vec<wgpu::Buffer>,
    f16: bool,
    capacity: usize,
    width: usize,
    rings: KvRings,
    bind_groups: Arc<BindCache>,
}

impl KvCache for GpuKvCache {
    fn shape(&self) -> KvShape {
        KvShape { n_layer: self.layers.len(), capacity: self.capacity, width: self.width }
    }
    fn rings(&self) -> &KvRings {
        &self.rings
    }
}

impl GpuKvCache {
    /// Bytes of device memory it holds (keys and values of every layer).
    pub fn device_bytes(&self) -> u64 {
        self.layers.iter().map(|b| b.size()).sum()
    }
}

impl Drop for GpuKvCache {
    /// Cached bind groups would keep the cache's memory alive: forget them.
    fn drop(&mut self) {
        let mut groups = self.bind_groups.lock().unwrap_or_else(|p| p.into_inner());
        groups.retain(|k, _| !k.buffers.iter().flatten().any(|(_, b, _, _)| self.layers.contains(b)));
    }
}

impl Backend for GpuBackend {
    type Matrix = GpuMatrix;
    type Vector = GpuVector;
    type Act = GpuAct;
    type KvCache = GpuKvCache;

    fn name(&self) -> String {
        "gpu".into()
    }

    fn load_matrix(&self, t: &TensorView, layout: MatrixLayout) -> BackendResult<GpuMatrix> {
        let &[d0, d1] = t.shape else { refuse!("tensor {:?} has shape {:?}, expected 2 dims", t.name, t.shape) };
        let data = t.to_f32().map_err(BackendError::Invalid)?;
        let (rows, cols) = match layout {
            MatrixLayout::OutIn => (d0, d1),
            MatrixLayout::InOut => (d1, d0),
        };
        let data = match layout {
            MatrixLayout::OutIn => data,
            MatrixLayout::InOut => {
                // [in, out] → [out, in]
                let mut tr = vec![0f32; data.len()];
                for (i, row) in data.chunks_exact(rows.max(1)).enumerate() {
                    for (o, &v) in row.iter().enumerate() {
                        tr[o * cols + i] = v;
                    }
                }
                tr
            }
        };
        // f16 when asked for (or stored so, by default) and the device can read it.
        let want_f16 = self.opts.weight_dtype.map_or(t.dtype == Dtype::F16, |d| d == WeightDtype::F16);
        let dtype = if want_f16 && self.f16 { WeightDtype::F16 } else { WeightDtype::F32 };
        let elem = dtype.size();
        let row_bytes = (cols * elem).max(1) as u64;
        check!(
            Unsupported: row_bytes <= self.chunk_limit(),
            "{}: one row of {cols} values exceeds the adapter's largest storage binding",
            t.name
        );
        let chunk_rows = ((self.chunk_limit() / row_bytes) as usize).clamp(1, self.max_chunk_rows());
        let mut chunks = Vec::new();
        for row0 in (0..rows).step_by(chunk_rows) {
            let n = chunk_rows.min(rows - row0);
            let part = &data[row0 * cols..(row0 + n) * cols];
            let bytes: Vec<u8> = match dtype {
                WeightDtype::F16 => part.iter().flat_map(|&v| half::f16::from_f32(v).to_le_bytes()).collect(),
                _ => part.iter().flat_map(|&v| v.to_le_bytes()).collect(),
            };
            chunks.push(Chunk { buffer: self.weight_buffer(&bytes), row0, rows: n });
        }
        self.check().map_err(|e| e.context(&format!("uploading {}", t.name)))?;
        Ok(GpuMatrix { rows, cols, dtype, quant: None, chunks })
    }

    /// Blocks in the formats of [`kernels::QUANT_FORMATS`] stay as the file stores them
    /// (device memory ≈ the tensor's bytes) and are decoded in the kernels' registers;
    /// other formats, or an explicit `--dtype`, are decoded to floats at upload.
    fn load_quantized(
        &self,
        name: &str,
        ty: GgmlType,
        n_out: usize,
        n_in: usize,
        bytes: &[u8],
    ) -> BackendResult<GpuMatrix> {
        if self.opts.weight_dtype.is_some() || !kernels::QUANT_FORMATS.iter().any(|(t, _)| *t == ty) {
            return super::dequantized_matrix(self, name, ty, n_out, n_in, bytes);
        }
        let (bs, ts) = (ty.block_size() as usize, ty.type_size() as usize);
        check!(n_in > 0 && n_in.is_multiple_of(bs), "{name}: rows of {n_in} values are not whole {} blocks", ty.name());
        let row_bytes = n_in / bs * ts;
        check!(
            n_out.checked_mul(row_bytes) == Some(bytes.len()),
            "{name}: {} bytes for [{n_out}, {n_in}] in {} blocks",
            bytes.len(),
            ty.name()
        );
        check!(
            Unsupported: row_bytes as u64 <= self.chunk_limit(),
            "{name}: one row of {n_in} values exceeds the adapter's largest storage binding"
        );
        let q = self.quant_kernels(ty)?;
        let chunk_rows = ((self.chunk_limit() / row_bytes as u64) as usize).clamp(1, self.max_chunk_rows());
        let mut chunks = Vec::new();
        for row0 in (0..n_out).step_by(chunk_rows) {
            let n = chunk_rows.min(n_out - row0);
            let part = &bytes[row0 * row_bytes..(row0 + n) * row_bytes];
            chunks.push(Chunk { buffer: self.weight_buffer(part), row0, rows: n });
            crate::tensor::release(part);
        }
        self.check().map_err(|e| e.context(&format!("uploading {name}")))?;
        Ok(GpuMatrix { rows: n_out, cols: n_in, dtype: WeightDtype::F32, quant: Some(q), chunks })
    }

    fn load_vector(&self, t: &TensorView) -> BackendResult<GpuVector> {
        let data = t.to_f32().map_err(BackendError::Invalid)?;
        let bytes: Vec<u8> = data.iter().flat_map(|v| v.to_le_bytes()).collect();
        Ok(GpuVector { buffer: self.weight_buffer(&bytes), len: data.len() })
    }

    fn new_kv_cache_in(&self, layout: &KvLayout) -> BackendResult<GpuKvCache> {
        layout.check()?;
        let (capacity, width) = (layout.capacity, layout.width);
        // Keys and values of one layer in one buffer, 2 or 4 bytes a value.
        let elem = self.opts.kv_dtype.size();
        let layer_bytes = |slots: usize| -> BackendResult<u64> {
            let bytes = slots
                .checked_mul(2)
                .and_then(|n| n.checked_mul(width))
                .and_then(|n| n.checked_mul(elem))
                .and_then(|n| u64::try_from(n).ok())
                .ok_or_else(|| BackendError::Memory("KV cache size overflows".into()))?;
            check!(
                Memory: bytes <= self.max_binding,
                "a KV cache layer of {slots} positions × {width} needs {bytes} bytes, over the adapter's \
                 {} byte storage binding",
                self.max_binding
            );
            Ok(bytes)
        };
        let sizes = layout.slots.iter().map(|&s| layer_bytes(s)).collect::<BackendResult<Vec<_>>>()?;
        let layers = sizes
            .iter()
            .map(|&bytes| {
                self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("kv cache"),
                    size: bytes.max(4).next_multiple_of(4),
                    // COPY_*: prefix-cache hits copy positions between caches.
                    usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                })
            })
            .collect();
        self.check()?;
        Ok(GpuKvCache {
            layers,
            f16: self.opts.kv_dtype == KvDtype::F16,
            capacity,
            width,
            rings: KvRings::new(layout),
            bind_groups: self.bind_groups.clone(),
        })
    }

    fn copy_kv_prefix(&self, src: &GpuKvCache, dst: &mut GpuKvCache, n: usize, head_dim: usize) -> BackendResult<()> {
        super::check_kv_copy(src, dst, n, head_dim)?;
        check!(src.f16 == dst.f16, "KV copy between an f32 and an f16 cache");
        // Each layer's buffer is [2][n_head][slots][head_dim]: one run per (k/v, head) and
        // run of slots.
        let elem = if src.f16 { 2u64 } else { 4 };
        let (hd, n_head) = (head_dim as u64, (src.width / head_dim) as u64);
        let aligned = |x: u64| x.is_multiple_of(wgpu::COPY_BUFFER_ALIGNMENT);
        check!(Unsupported: aligned(hd * elem), "KV copy: heads of {} bytes are not 4-byte aligned (odd f16 head size)", hd * elem);
        let plan: Vec<_> = (0..src.layers.len()).map(|l| src.rings.copy_runs(&mut dst.rings, l, n)).collect();
        if plan.iter().all(|runs| runs.is_empty()) {
            return Ok(());
        }
        self.with_encoder(|enc| {
            for (layer, runs) in plan.iter().enumerate() {
                let (s, d) = (&src.layers[layer], &dst.layers[layer]);
                let (ss, ds) = (src.rings.slots(layer) as u64, dst.rings.slots(layer) as u64);
                for run in runs {
                    for kv_head in 0..2 * n_head {
                        let from = (kv_head * ss + run.from as u64) * hd * elem;
                        let to = (kv_head * ds + run.to as u64) * hd * elem;
                        enc.copy_buffer_to_buffer(s, from, d, to, run.len as u64 * hd * elem);
                    }
                }
            }
        });
        self.check()
    }

    fn upload(&self, m: &HostMatrix) -> GpuAct {
        let out = self.take(m.rows, m.cols);
        let n = (m.rows * m.cols * 4) as u64;
        if n > 0 {
            let bytes: Vec<u8> = m.data.iter().flat_map(|v| v.to_le_bytes()).collect();
            let src = self.init_buffer(&bytes, wgpu::BufferUsages::COPY_SRC);
            self.with_encoder(|enc| enc.copy_buffer_to_buffer(&src, 0, out.buf.buffer(), 0, n));
        }
        out
    }

    fn embed(&self, table: &GpuMatrix, ids: &[u32]) -> GpuAct {
        let (t, c) = (ids.len(), table.cols);
        let out = self.take(t, c);
        if t == 0 || c == 0 {
            return out;
        }
        let (_, _, kernel) = self.weight_kernels(table);
        // The quantized gather decodes four values per invocation.
        let per_invocation = if table.quant.is_some() { 4 } else { 1 };
        for ch in &table.chunks {
            let params = [t as u32, c as u32, ch.row0 as u32, ch.rows as u32];
            let bindings = [(1, ch.buffer.as_entire_buffer_binding()), (3, out.binding())];
            // The ids travel in the parameter arena: no buffer is created per step.
            let groups = self.grid((t * c / per_invocation).div_ceil(256));
            self.dispatch(kernel, &params, &bindings, groups, Some((2, ids)));
        }
        out
    }

    fn layer_norm(&self, x: &GpuAct, gain: &GpuVector, shift: &GpuVector, eps: f32) -> GpuAct {
        let out = self.take(x.rows, x.cols);
        if gain.len != x.cols || shift.len != x.cols {
            self.fail(format!("layer_norm: {} columns but gain/shift of {}/{}", x.cols, gain.len, shift.len));
            return out;
        }
        let params = [x.rows as u32, x.cols as u32, eps.to_bits(), 0];
        let bindings = [
            (1, x.binding()),
            (3, gain.buffer.as_entire_buffer_binding()),
            (4, shift.buffer.as_entire_buffer_binding()),
            (5, out.binding()),
        ];
        self.dispatch(&self.kernels.layer_norm, &params, &bindings, self.grid(x.rows), None);
        out
    }

    fn add_layer_norm(&self, x: &mut GpuAct, y: &GpuAct, gain: &GpuVector, shift: &GpuVector, eps: f32) -> GpuAct {
        let out = self.take(x.rows, x.cols);
        if (y.rows, y.cols) != (x.rows, x.cols) || gain.len != x.cols || shift.len != x.cols {
            self.fail("add_layer_norm: shapes differ".into());
            return out;
        }
        let params = [x.rows as u32, x.cols as u32, eps.to_bits(), 0];
        let bindings = [
            (1, x.binding()),
            (2, y.binding()),
            (3, gain.buffer.as_entire_buffer_binding()),
            (4, shift.buffer.as_entire_buffer_binding()),
            (5, out.binding()),
        ];
        self.dispatch(&self.kernels.add_layer_norm, &params, &bindings, self.grid(x.rows), None);
        out
    }

    fn linear(&self, x: &GpuAct, w: &GpuMatrix, bias: Option<&GpuVector>) -> GpuAct {
        self.linear_impl(x, w, bias, false)
    }

    fn linear_gelu(&self, x: &GpuAct, w: &GpuMatrix, bias: Option<&GpuVector>) -> GpuAct {
        self.linear_impl(x, w, bias, true)
    }

    fn gelu(&self, x: &mut GpuAct) {
        let n = x.rows * x.cols;
        let params = [n as u32, 0, 0, 0];
        self.dispatch(&self.kernels.gelu, &params, &[(1, x.binding())], self.grid(n.div_ceil(256)), None);
    }

    fn add(&self, x: &mut GpuAct, y: &GpuAct) {
        if (y.rows, y.cols) != (x.rows, x.cols) {
            self.fail("add: shapes differ".into());
            return;
        }
        let n = x.rows * x.cols;
        let params = [n as u32, 0, 0, 0];
        self.dispatch(
            &self.kernels.add,
            &params,
            &[(1, x.binding()), (2, y.binding())],
            self.grid(n.div_ceil(256)),
            None,
        );
    }

    fn attention(
        &self,
        qkv: &GpuAct,
        seqs: &[SeqSlice],
        caches: &mut [&mut GpuKvCache],
        layer: usize,
        spec: &AttentionSpec,
    ) -> BackendResult<GpuAct> {
        check_attention(qkv.rows, qkv.cols, seqs, caches, layer, spec)?;
        self.supports(spec)?;
        let (n_head, head_dim, scale) = (spec.n_head, spec.head_dim, spec.scale);
        let c = spec.q_width();
        if head_dim > 256 {
            return Err(BackendError::Unsupported(format!(
                "attention: heads of {head_dim} values; the gpu kernels take at most 256"
            )));
        }
        let window = match spec.window {
            None => 0,
            Some(w) => u32::try_from(w).unwrap_or(u32::MAX),
        };
        let out = self.take(qkv.rows, c);
        // A ring layer takes a long slice in pieces ([`attention_pieces`]), each stored
        // before it attends.
        let pieces = if needs_pieces(seqs, caches, layer, spec, usize::MAX) {
            attention_pieces(seqs, caches, layer, spec, usize::MAX).into_iter().flatten().collect()
        } else {
            Vec::new() // the common case: the call as it is, no allocation
        };
        let whole = seqs.iter().cloned().enumerate();
        let pieces: &mut dyn Iterator<Item = (usize, SeqSlice)> =
            if pieces.is_empty() { &mut { whole } } else { &mut pieces.into_iter() };
        for (i, s) in pieces {
            let cache = &mut *caches[i];
            let rows = s.rows.len();
            if rows == 0 {
                continue;
            }
            cache.rings.wrote(layer, s.start_pos, s.start_pos + rows);
            let (rope_mode, table) = match &spec.rope {
                None => (0, self.dummy.clone()),
                Some(r) => {
                    let mode = match r.style {
                        RopeStyle::Adjacent => 1,
                        RopeStyle::Halves => 2,
                    };
                    (mode, self.rope_table(r, head_dim, cache.capacity)?)
                }
            };
            let params = [
                rows as u32,
                s.rows.start as u32,
                s.start_pos as u32,
                n_head as u32,
                head_dim as u32,
                cache.capacity as u32,
                scale.to_bits(),
                spec.n_kv_head as u32,
                rope_mode,
                window,
                cache.rings.slots(layer) as u32,
                0,
            ];
            let kv = cache.layers[layer].as_entire_buffer_binding();
            let k = &self.kernels;
            let (kv_store, attend) = if cache.f16 {
                match (k.kv_store_f16.as_ref(), k.attend_f16.as_ref()) {
                    (Some(store), Some(attend)) => (store, attend),
                    _ => {
                        return Err(BackendError::Unsupported(
                            "attention: an f16 KV cache on a backend without shader-f16 kernels".into(),
                        ));
                    }
                }
            } else {
                (&k.kv_store, &k.attend)
            };
            let rope = table.as_entire_buffer_binding();
            self.dispatch(
                kv_store,
                &params,
                &[(1, qkv.binding()), (2, kv.clone()), (4, rope.clone())],
                self.grid((rows * spec.kv_width()).div_ceil(256)),
                None,
            );
            self.dispatch(
                attend,
                &params,
                &[(1, qkv.binding()), (2, kv), (3, out.binding()), (4, rope)],
                (rows as u32, n_head as u32),
                None,
            );
        }
        Ok(out)
    }

    fn supports(&self, spec: &AttentionSpec) -> BackendResult<()> {
        spec.validate()?;
        if spec.head_dim > 256 {
            return Err(BackendError::Unsupported(format!(
                "attention: heads of {} values; the gpu kernels take at most 256",
                spec.head_dim
            )));
        }
        Ok(())
    }

    fn rms_norm(&self, x: &GpuAct, gain: &GpuVector, eps: f32) -> GpuAct {
        let out = self.take(x.rows, x.cols);
        if gain.len != x.cols {
            self.fail(format!("rms_norm: {} columns but a gain of {}", x.cols, gain.len));
            return out;
        }
        let params = [x.rows as u32, x.cols as u32, eps.to_bits(), 0];
        let bindings = [(1, x.binding()), (3, gain.buffer.as_entire_buffer_binding()), (5, out.binding())];
        self.dispatch(&self.kernels.rms_norm, &params, &bindings, self.grid(x.rows), None);
        out
    }

    fn add_rms_norm(&self, x: &mut GpuAct, y: &GpuAct, gain: &GpuVector, eps: f32) -> GpuAct {
        let out = self.take(x.rows, x.cols);
        if (y.rows, y.cols) != (x.rows, x.cols) || gain.len != x.cols {
            self.fail("add_rms_norm: shapes differ".into());
            return out;
        }
        let params = [x.rows as u32, x.cols as u32, eps.to_bits(), 0];
        let bindings =
            [(1, x.binding()), (2, y.binding()), (3, gain.buffer.as_entire_buffer_binding()), (5, out.binding())];
        self.dispatch(&self.kernels.add_rms_norm, &params, &bindings, self.grid(x.rows), None);
        out
    }

    fn swiglu(&self, x: &GpuAct) -> GpuAct {
        let f = x.cols / 2;
        let out = self.take(x.rows, f);
        if !x.cols.is_multiple_of(2) {
            self.fail(format!("swiglu: {} columns is not gate | up", x.cols));
            return out;
        }
        let n = x.rows * f;
        let params = [n as u32, f as u32, 0, 0];
        self.dispatch(
            &self.kernels.swiglu,
            &params,
            &[(1, out.binding()), (2, x.binding())],
            self.grid(n.div_ceil(256)),
            None,
        );
        out
    }

    fn geglu(&self, x: &GpuAct) -> GpuAct {
        let f = x.cols / 2;
        let out = self.take(x.rows, f);
        if !x.cols.is_multiple_of(2) {
            self.fail(format!("geglu: {} columns is not gate | up", x.cols));
            return out;
        }
        let n = x.rows * f;
        let params = [n as u32, f as u32, 0, 0];
        self.dispatch(
            &self.kernels.geglu,
            &params,
            &[(1, out.binding()), (2, x.binding())],
            self.grid(n.div_ceil(256)),
            None,
        );
        out
    }

    fn scale(&self, x: &mut GpuAct, s: f32) {
        let n = x.rows * x.cols;
        let params = [n as u32, 0, s.to_bits(), 0];
        self.dispatch(&self.kernels.scale, &params, &[(1, x.binding())], self.grid(n.div_ceil(256)), None);
    }

    fn qk_norm(
        &self,
        qkv: &mut GpuAct,
        spec: &AttentionSpec,
        q_gain: &GpuVector,
        k_gain: &GpuVector,
        eps: f32,
    ) -> BackendResult<()> {
        crate::backend::check_qk_norm(qkv.cols, spec, q_gain.len, k_gain.len)?;
        check!(Unsupported: spec.n_head < 1 << 16 && spec.n_kv_head < 1 << 16, "qk_norm: too many heads for the gpu kernel");
        let segments = qkv.rows * (spec.n_head + spec.n_kv_head);
        let heads = ((spec.n_head as u32) << 16) | spec.n_kv_head as u32;
        let params = [segments as u32, spec.head_dim as u32, eps.to_bits(), heads];
        let bindings = [
            (1, qkv.binding()),
            (3, q_gain.buffer.as_entire_buffer_binding()),
            (4, k_gain.buffer.as_entire_buffer_binding()),
        ];
        self.dispatch(&self.kernels.qk_norm, &params, &bindings, self.grid(segments), None);
        Ok(())
    }

    fn select_rows(&self, x: &GpuAct, rows: &[usize]) -> GpuAct {
        let out = self.take(rows.len(), x.cols);
        if let Some(&bad) = rows.iter().find(|&&r| r >= x.rows) {
            self.fail(format!("select_rows: row {bad} of {}", x.rows));
            return out;
        }
        let row_bytes = (x.cols * 4) as u64;
        if row_bytes > 0 {
            self.with_encoder(|enc| {
                for (i, &r) in rows.iter().enumerate() {
                    enc.copy_buffer_to_buffer(
                        x.buf.buffer(),
                        r as u64 * row_bytes,
                        out.buf.buffer(),
                        i as u64 * row_bytes,
                        row_bytes,
                    );
                }
            });
        }
        out
    }

    fn to_host(&self, x: &GpuAct, out: &mut HostMatrix) -> BackendResult<()> {
        out.reshape(x.rows, x.cols);
        self.read_back(&x.buf, x.rows * x.cols, |bytes| {
            for (o, b) in out.data.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        })
    }

    fn argmax_rows(&self, x: &GpuAct, out: &mut Vec<u32>) -> BackendResult<bool> {
        let ids = self.take(x.rows, 1);
        if x.rows > 0 && x.cols > 0 {
            let params = [x.rows as u32, x.cols as u32, 0, 0];
            let bindings = [(1, x.binding()), (2, ids.binding())];
            self.dispatch(&self.kernels.argmax, &params, &bindings, (x.rows as u32, 1), None);
        }
        out.clear();
        self.read_back(&ids.buf, x.rows, |bytes| {
            out.extend(bytes.chunks_exact(4).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])));
        })?;
        Ok(true)
    }
}

impl GpuBackend {
    /// Submit all pending work, wait for it, and hand the first `words` 4-byte values of
    /// `buf` to `use_bytes` straight from the mapped read-back buffer.
    fn read_back(&self, buf: &Pooled, words: usize, use_bytes: impl FnOnce(&[u8])) -> BackendResult<()> {
        let n = words as u64 * 4;
        // The state stays locked until the staging buffer is unmapped: it is shared, so a
        // second caller must not copy into it (or map it) while this one reads it.
        let mut st = self.lock();
        let staging = if n > 0 {
            if st.staging.as_ref().is_none_or(|s| s.size() < n) {
                st.staging = Some(self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("read-back"),
                    size: n.next_power_of_two(),
                    usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                }));
            }
            let staging = st.staging.clone().expect("just made");
            st.encoder(&self.device).copy_buffer_to_buffer(buf.buffer(), 0, &staging, 0, n);
            Some(staging)
        } else {
            None
        };
        self.submit(&mut st);
        let Some(staging) = staging else {
            self.wait()?;
            return self.check();
        };
        let slice = staging.slice(..n);
        let (tx, rx) = std::sync::mpsc::channel();
        slice.map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        let polled = self.wait();
        // Unmap whatever happens, so the next read-back can submit.
        let mapped = match rx.try_recv() {
            Ok(Ok(())) => {
                let read = slice.get_mapped_range().map(|m| use_bytes(&m));
                staging.unmap();
                Some(read)
            }
            _ => None,
        };
        if polled.is_err() && mapped.is_none() {
            // Timed out with the map still pending: this staging buffer cannot be reused.
            st.staging = None;
        }
        drop(st);
        polled?;
        self.check()?;
        match mapped {
            None => Err(BackendError::Device("mapping the read-back buffer failed".into())),
            Some(read) => read.map_err(|e| BackendError::Device(format!("reading the mapped buffer: {e}"))),
        }
    }

    /// Wait for all submitted work, at most `poll_timeout`.
    fn wait(&self) -> BackendResult<()> {
        let timeout = self.poll_timeout;
        match self.device.poll(wgpu::PollType::Wait { submission_index: None, timeout: Some(timeout) }) {
            Ok(_) => Ok(()),
            Err(wgpu::PollError::Timeout) => Err(BackendError::Device(format!(
                "the GPU did not finish within {:.1} s (set BATCH_FORGE_GPU_TIMEOUT_S to wait longer)",
                timeout.as_secs_f64()
            ))),
            Err(e) => Err(BackendError::Device(format!("waiting for the GPU: {e}"))),
        }
    }
}

//! Shared helpers for the integration tests: fixture paths and HF reference data.
#![allow(dead_code)]

use std::path::PathBuf;

use batch_forge::backend::cpu::{CpuBackend, CpuOptions};
use batch_forge::backend::reference::{RefKvCache, RefMatrix, ReferenceBackend};
use batch_forge::backend::{AttentionSpec, Backend, HostMatrix, MatrixLayout, SeqSlice, WeightDtype};
use batch_forge::compare::max_abs_diff;
pub use batch_forge::compare::nan_max;
use batch_forge::engine::{Engine, GenerateParams};
use batch_forge::loaders::safetensors::{Dtype, OwnedTensor, SafetensorsFile, TensorView};
use serde_json::Value;

/// The three HF fixture checkpoints (Hub layout f32, save_pretrained layout, f16).
pub const CHECKPOINTS: [&str; 3] = ["tiny-gpt2", "tiny-gpt2-hf-saved", "tiny-gpt2-f16"];

/// Max |logit - HF logit| we accept. HF's own float32 result differs from float64 by up
/// to 1.2e-5 and its KV-cache path from its full forward by 8e-6; a different but
/// correct f32 summation order lands in the same range. 1e-4 leaves 8x headroom yet is
/// 10x below the smallest mistake the fixtures measure (LayerNorm eps 1e-12 instead of
/// 1e-5: 1.0e-3; erf GELU instead of tanh: 2.0e-3).
pub const LOGIT_TOL: f32 = 1e-4;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

pub fn reference(checkpoint: &str) -> Value {
    let text = std::fs::read_to_string(fixture(checkpoint).join("reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect()
}

pub fn engine(checkpoint: &str) -> Engine<ReferenceBackend> {
    Engine::load(ReferenceBackend, &fixture(checkpoint)).unwrap()
}

pub fn cpu_engine(checkpoint: &str, opts: CpuOptions) -> Engine<CpuBackend> {
    Engine::load(CpuBackend::new(opts).unwrap(), &fixture(checkpoint)).unwrap()
}

/// Greedy continuations for every reference prompt: (matching prompts, total prompts).
pub fn greedy_matches<B: Backend>(engine: &Engine<B>, checkpoint: &str) -> (usize, usize) {
    let reference = reference(checkpoint);
    let prompts = reference["prompts"].as_array().unwrap();
    let params = GenerateParams::greedy(40);
    let ok = prompts
        .iter()
        .filter(|p| {
            let g = engine.generate(&ids(&p["prompt_ids"]), &params, |_| Ok(())).unwrap();
            g.generated_ids == ids(&p["generated_ids"])
        })
        .count();
    (ok, prompts.len())
}

/// The inputs of a checkpoint's full-logit references (token ids of 3 prompts).
pub fn full_logit_inputs(checkpoint: &str) -> Vec<Vec<u32>> {
    let refs = SafetensorsFile::open(&fixture(checkpoint).join("reference.safetensors")).unwrap();
    (0..3)
        .map(|i| {
            let t = refs.get(&format!("prompt{i}.input_ids")).unwrap();
            t.to_i64().unwrap().iter().map(|&x| u32::try_from(x).unwrap()).collect()
        })
        .collect()
}

/// Max |logit − HF| over the full-logit references of a checkpoint; NaN if any logit
/// is NaN (so `err < tol` fails).
pub fn max_logit_error<B: Backend>(engine: &Engine<B>, checkpoint: &str) -> f32 {
    let refs = SafetensorsFile::open(&fixture(checkpoint).join("reference.safetensors")).unwrap();
    let mut worst = 0f32;
    for (i, input) in full_logit_inputs(checkpoint).iter().enumerate() {
        let want = refs.get(&format!("prompt{i}.logits")).unwrap().to_f32().unwrap();
        let got = engine.logits_all(input).unwrap();
        worst = nan_max(worst, max_abs_diff(&got.data, &want));
    }
    worst
}

/// Max |logit_a − logit_b| of two engines on a checkpoint's full-logit inputs (NaN-propagating).
pub fn max_logit_diff<A: Backend, B: Backend>(a: &Engine<A>, b: &Engine<B>, checkpoint: &str) -> f32 {
    full_logit_inputs(checkpoint).iter().fold(0f32, |worst, input| {
        let (x, y) = (a.logits_all(input).unwrap(), b.logits_all(input).unwrap());
        nan_max(worst, max_abs_diff(&x.data, &y.data))
    })
}

/// Greedy continuations of two engines on every reference prompt: (equal, total).
pub fn greedy_agreement<A: Backend, B: Backend>(a: &Engine<A>, b: &Engine<B>, checkpoint: &str) -> (usize, usize) {
    let prompts = reference(checkpoint)["prompts"].as_array().unwrap().clone();
    let params = GenerateParams::greedy(40);
    let run = |p: &Value| ids(&p["prompt_ids"]);
    let ok = prompts
        .iter()
        .filter(|p| {
            let x = a.generate(&run(p), &params, |_| Ok(())).unwrap().generated_ids;
            let y = b.generate(&run(p), &params, |_| Ok(())).unwrap().generated_ids;
            x == y
        })
        .count();
    (ok, prompts.len())
}

pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| v == "true")
}

/// The reference backend fed exactly the values a lossy backend computes with: weight
/// matrices rounded to 16 bits as they load, keys and values rounded to f16 as they
/// enter the KV cache, and (where bf16 weights meet `vdpbf16ps`, see
/// [`Isa::has_bf16`](batch_forge::backend::cpu::Isa::has_bf16)) the activations of
/// every weight product rounded to bf16. A backend storing those formats must then agree
/// with it to f32 tolerance; only the rounding itself separates either from HF.
#[derive(Clone, Copy, Debug)]
pub struct RoundedReference {
    pub weights: WeightDtype,
    pub kv_f16: bool,
    pub bf16_activations: bool,
}

impl RoundedReference {
    /// Weights rounded to `weights`, the KV cache to f16 when `kv_f16`, no activation rounding.
    pub fn new(weights: WeightDtype, kv_f16: bool) -> Self {
        RoundedReference { weights, kv_f16, bf16_activations: false }
    }
}

/// How close a backend storing `rounded`'s formats must come to `rounded` on a checkpoint.
///
/// Rounded weights are inputs, identical on both sides, so the f32 tolerance holds. Keys
/// and values are computed before they are rounded, and two correct backends compute
/// them with f32 noise (~1e-7 relative): where a value sits within that noise of an f16
/// rounding boundary the two round it one f16 step (2^-11 ≈ 5e-4 relative) apart. Such
/// flips are rare but real, so an f16 KV cache is held to half of what rounding keys and
/// values to f16 moves the reference's own logits (its f16-KV vs f32-KV distance, both
/// computed by the reference, not by the backend under test). Not rounding at all, or
/// rounding to bf16, lands at or beyond that full distance and fails.
///
/// Activations rounded to bf16 before each weight product (the AVX512-BF16 path) flip
/// the same way, one bf16 step (2⁻⁸ relative) where an activation sits within f32 noise
/// of a rounding boundary, but each flip moves one product of thousands: they are held to
/// a twentieth of what that rounding moves the reference's logits (on tiny-gpt2: 2.1e-3
/// against a measured 1.4e-6; not rounding them lands at the full distance, 4.2e-2; a
/// kernel summing each output in two chains instead of one flipped enough to reach 2.1e-2).
pub fn lossy_tolerance(rounded: &RoundedReference, checkpoint: &str) -> f32 {
    if !rounded.kv_f16 && !rounded.bf16_activations {
        return LOGIT_TOL;
    }
    let with = Engine::load(RoundedReference { ..*rounded }, &fixture(checkpoint)).unwrap();
    let without = RoundedReference { kv_f16: false, bf16_activations: false, ..*rounded };
    let without = Engine::load(without, &fixture(checkpoint)).unwrap();
    let share = if rounded.kv_f16 { 0.5 } else { 0.05 };
    (share * max_logit_diff(&with, &without, checkpoint)).max(LOGIT_TOL)
}

pub fn round_to(dtype: WeightDtype, v: &[f32]) -> Vec<f32> {
    match dtype {
        WeightDtype::F32 => v.to_vec(),
        WeightDtype::F16 => v.iter().map(|&x| half::f16::from_f32(x).to_f32()).collect(),
        WeightDtype::BF16 => v.iter().map(|&x| half::bf16::from_f32(x).to_f32()).collect(),
    }
}

impl Backend for RoundedReference {
    type Matrix = RefMatrix;
    type Vector = Vec<f32>;
    type Act = HostMatrix;
    type KvCache = RefKvCache;

    fn name(&self) -> String {
        format!(
            "reference ({} weights, kv f16: {}, bf16 activations: {})",
            self.weights.name(),
            self.kv_f16,
            self.bf16_activations
        )
    }
    fn load_matrix(&self, t: &TensorView, layout: MatrixLayout) -> batch_forge::backend::BackendResult<RefMatrix> {
        let data = round_to(self.weights, &t.to_f32().map_err(batch_forge::backend::BackendError::Invalid)?);
        let owned = OwnedTensor::f32(t.name, t.shape.to_vec(), &data);
        ReferenceBackend.load_matrix(&view(&owned), layout)
    }
    fn load_vector(&self, t: &TensorView) -> batch_forge::backend::BackendResult<Vec<f32>> {
        ReferenceBackend.load_vector(t)
    }
    fn new_kv_cache_in(
        &self,
        layout: &batch_forge::backend::KvLayout,
    ) -> batch_forge::backend::BackendResult<RefKvCache> {
        ReferenceBackend.new_kv_cache_in(layout)
    }
    fn upload(&self, m: &HostMatrix) -> HostMatrix {
        m.clone()
    }
    fn embed(&self, table: &RefMatrix, ids: &[u32]) -> HostMatrix {
        ReferenceBackend.embed(table, ids)
    }
    fn layer_norm(&self, x: &HostMatrix, gain: &Vec<f32>, shift: &Vec<f32>, eps: f32) -> HostMatrix {
        ReferenceBackend.layer_norm(x, gain, shift, eps)
    }
    fn linear(&self, x: &HostMatrix, w: &RefMatrix, bias: Option<&Vec<f32>>) -> HostMatrix {
        if !self.bf16_activations {
            return ReferenceBackend.linear(x, w, bias);
        }
        let mut rounded = x.clone();
        rounded.data = round_to(WeightDtype::BF16, &x.data);
        ReferenceBackend.linear(&rounded, w, bias)
    }
    fn gelu(&self, x: &mut HostMatrix) {
        ReferenceBackend.gelu(x)
    }
    fn add(&self, x: &mut HostMatrix, y: &HostMatrix) {
        ReferenceBackend.add(x, y)
    }
    fn rms_norm(&self, x: &HostMatrix, gain: &Vec<f32>, eps: f32) -> HostMatrix {
        ReferenceBackend.rms_norm(x, gain, eps)
    }
    fn swiglu(&self, x: &HostMatrix) -> HostMatrix {
        ReferenceBackend.swiglu(x)
    }
    fn geglu(&self, x: &HostMatrix) -> HostMatrix {
        ReferenceBackend.geglu(x)
    }
    fn scale(&self, x: &mut HostMatrix, s: f32) {
        ReferenceBackend.scale(x, s)
    }
    fn qk_norm(
        &self,
        qkv: &mut HostMatrix,
        spec: &AttentionSpec,
        q_gain: &Vec<f32>,
        k_gain: &Vec<f32>,
        eps: f32,
    ) -> batch_forge::backend::BackendResult<()> {
        ReferenceBackend.qk_norm(qkv, spec, q_gain, k_gain, eps)
    }
    fn attention(
        &self,
        qkv: &HostMatrix,
        seqs: &[SeqSlice],
        caches: &mut [&mut RefKvCache],
        layer: usize,
        spec: &AttentionSpec,
    ) -> batch_forge::backend::BackendResult<HostMatrix> {
        if !self.kv_f16 {
            return ReferenceBackend.attention(qkv, seqs, caches, layer, spec);
        }
        // Keys and values as the f16 cache holds them; queries stay f32. (Rounding before
        // RoPE would not be what a cache of rotated keys holds.)
        if spec.rope.is_some() {
            return Err(batch_forge::backend::BackendError::Unsupported(
                "RoundedReference rounds the KV cache of models without RoPE only".into(),
            ));
        }
        let q = spec.q_width();
        let mut rounded = qkv.clone();
        for row in rounded.data.chunks_mut(qkv.cols) {
            let kv = round_to(WeightDtype::F16, &row[q..]);
            row[q..].copy_from_slice(&kv);
        }
        ReferenceBackend.attention(&rounded, seqs, caches, layer, spec)
    }
    fn select_rows(&self, x: &HostMatrix, rows: &[usize]) -> HostMatrix {
        ReferenceBackend.select_rows(x, rows)
    }
    fn to_host(&self, x: &HostMatrix, out: &mut HostMatrix) -> batch_forge::backend::BackendResult<()> {
        ReferenceBackend.to_host(x, out)
    }
}

/// The GPU backend for a test, or `None` (with a loud message) when this machine has no
/// adapter. Under CI (`CI=true`) a missing adapter fails the test instead: CI installs
/// lavapipe, so no adapter there means the GPU path went untested.
#[cfg(feature = "gpu")]
pub fn gpu_backend(opts: batch_forge::backend::gpu::GpuOptions) -> Option<batch_forge::backend::gpu::GpuBackend> {
    match batch_forge::backend::gpu::GpuBackend::new(opts) {
        Ok(b) => {
            eprintln!("gpu backend on {}", b.description());
            // The API we meant, never a fallback (wgpu is built without GL).
            let api = b.adapter_info().backend;
            if cfg!(target_os = "linux") {
                assert_eq!(api, wgpu::Backend::Vulkan, "GPU tests on Linux must run on Vulkan");
            }
            assert!(matches!(api, wgpu::Backend::Vulkan | wgpu::Backend::Metal | wgpu::Backend::Dx12), "{api:?}");
            Some(b)
        }
        Err(e) if std::env::var("CI").is_ok_and(|v| v == "true") => panic!("CI=true and the GPU backend failed: {e:#}"),
        Err(e) => {
            eprintln!(
                "\n*** SKIPPED: no usable GPU adapter ({e:#}); install mesa-vulkan-drivers to run the GPU tests ***\n"
            );
            None
        }
    }
}

/// An f32 tensor to load into a backend (parity tests).
pub fn tensor(shape: &[usize], data: &[f32]) -> OwnedTensor {
    OwnedTensor::f32("t", shape.to_vec(), data)
}

pub fn view(t: &OwnedTensor) -> TensorView<'_> {
    TensorView { name: &t.name, dtype: Dtype::F32, shape: &t.shape, bytes: &t.bytes }
}

/// Whether `b` runs the shader-f16 path; if not, a loud skip, and under CI a failure
/// when the adapter offers shader-f16 (then the path was dropped, not unsupported).
#[cfg(feature = "gpu")]
pub fn gpu_f16_or_skip(b: &batch_forge::backend::gpu::GpuBackend, what: &str) -> bool {
    if b.has_f16() {
        return true;
    }
    assert!(
        !(in_ci() && b.adapter_supports_f16()),
        "CI=true: {} offers shader-f16 but the backend did not enable it ({what})",
        b.description()
    );
    eprintln!("\n*** SKIPPED {what}: {} has no shader-f16 ***\n", b.description());
    false
}

/// Whether the subgroup GEMV can run here; a loud skip when the adapter has no subgroups.
#[cfg(feature = "gpu")]
#[allow(dead_code)]
pub fn gpu_subgroups_or_skip(b: &batch_forge::backend::gpu::GpuBackend, what: &str) -> bool {
    if b.has_subgroups() {
        return true;
    }
    // CI runs on lavapipe, whose subgroups (Mesa 22 and later) wgpu offers: there the
    // subgroup kernels must run, never skip.
    assert!(
        !(in_ci() && b.adapter_info().name.contains("llvmpipe")),
        "CI=true: {} is lavapipe, which has subgroups, but the backend did not enable them ({what})",
        b.description()
    );
    eprintln!("\n*** SKIPPED {what}: {} has no subgroups ***\n", b.description());
    false
}

/// Rewrite the `model.safetensors` of a copied checkpoint with `edit` of its tensors
/// (its metadata kept).
pub fn rewrite_checkpoint(dir: &std::path::Path, edit: impl FnOnce(&mut Vec<OwnedTensor>)) {
    use batch_forge::loaders::safetensors::serialize;
    let path = dir.join("model.safetensors");
    let file = SafetensorsFile::open(&path).unwrap();
    let mut tensors: Vec<OwnedTensor> = file
        .names()
        .map(|n| {
            let t = file.get(n).unwrap();
            OwnedTensor { name: n.to_owned(), dtype: t.dtype, shape: t.shape.to_vec(), bytes: t.bytes.to_vec() }
        })
        .collect();
    edit(&mut tensors);
    let out = serialize(&tensors, file.metadata());
    drop(file);
    std::fs::write(&path, out).unwrap();
}

/// Rewrite `wpe.weight` row `pos` of a copied checkpoint to NaN.
pub fn poison_position_embedding(dir: &std::path::Path, pos: usize) {
    rewrite_checkpoint(dir, |tensors| {
        for t in tensors.iter_mut().filter(|t| t.name.ends_with("wpe.weight")) {
            let row = t.shape[1] * 4;
            for v in t.bytes[pos * row..(pos + 1) * row].chunks_mut(4) {
                v.copy_from_slice(&f32::NAN.to_le_bytes());
            }
        }
    });
}

/// A copy of a fixture checkpoint in a temporary folder (kept alive by the returned guard).
pub fn fixture_copy(name: &str) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join(name);
    std::fs::create_dir_all(&dir).unwrap();
    for e in std::fs::read_dir(fixture(name)).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    (tmp, dir)
}

/// The greedy ids `scripts/hf_reference.py --greedy N` stored for each prompt of an HF
/// reference (`p{i}.greedy_ids`).
pub fn reference_greedy_ids(reference_path: &std::path::Path, n_prompts: usize) -> Vec<Vec<u32>> {
    let file = SafetensorsFile::open(reference_path).unwrap();
    (0..n_prompts)
        .map(|i| file.get(&format!("p{i}.greedy_ids")).unwrap().to_i64().unwrap().iter().map(|&x| x as u32).collect())
        .collect()
}

/// A model against an HF reference: every stage within the f32 bound, the prompts'
/// tokens and the logits' argmax equal, and 16 greedy ids (EOS ignored) equal to HF's.
pub fn check_against_hf<B: Backend>(
    label: &str,
    e: &Engine<B>,
    reference: &batch_forge::verify::Reference,
    greedy: &[Vec<u32>],
) {
    use batch_forge::verify::{tolerance, verify};
    let v = verify(&e.backend, e.model.as_ref(), reference, tolerance::F32, |s| e.prompt_ids(s)).unwrap();
    assert!(v.first_failure().is_none(), "{label}: {:?}", v.first_failure());
    assert_eq!(v.tokens_equal, reference.prompts.len(), "{label}: {:?}", v.token_mismatch);
    let logits = v.stages.last().unwrap();
    assert_eq!(logits.stage, batch_forge::model::Stage::Logits);
    let (agree, total) = logits.argmax.unwrap();
    assert_eq!(agree, total, "{label}: argmax");
    let params = GenerateParams { ignore_eos: true, ..GenerateParams::greedy(16) };
    for (p, want) in reference.prompts.iter().zip(greedy) {
        let got = e.generate(&p.ids, &params, |_| Ok(())).unwrap().generated_ids;
        assert_eq!(&got, want, "{label}: greedy ids after {:?}", p.text);
    }
}

/// [`check_against_hf`] on the reference backend, the cpu backend at every ISA level (f32
/// weights) and the gpu backend where there is one, for a model (folder or GGUF) and the
/// HF reference it is held to.
pub fn check_against_hf_on_every_backend(model: &std::path::Path, reference_path: &std::path::Path) {
    let reference = batch_forge::verify::Reference::open(reference_path).unwrap();
    let greedy = reference_greedy_ids(reference_path, reference.prompts.len());
    let name = model.display();
    check_against_hf(
        &format!("{name} reference"),
        &Engine::load(ReferenceBackend, model).unwrap(),
        &reference,
        &greedy,
    );
    for isa in batch_forge::backend::cpu::simd::isas_or_skip() {
        let opts = CpuOptions { weight_dtype: Some(WeightDtype::F32), isa, ..CpuOptions::default() };
        let e = Engine::load(CpuBackend::new(opts).unwrap(), model).unwrap();
        check_against_hf(&format!("{name} cpu {}", isa.name()), &e, &reference, &greedy);
    }
    #[cfg(feature = "gpu")]
    if let Some(b) = gpu_backend(batch_forge::backend::gpu::GpuOptions::default()) {
        check_against_hf(&format!("{name} gpu"), &Engine::load(b, model).unwrap(), &reference, &greedy);
    }
}

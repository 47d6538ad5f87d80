//! `forge verify`: a model on a backend against a stage-by-stage reference dump made by
//! HF transformers (`scripts/hf_reference.py`).
//!
//! For every prompt of the dump the model runs on the dump's token ids, and each
//! [`Stage`] of the forward pass (the embeddings, the residual stream after each block,
//! the final norm, the logits) is compared with HF's tensor. The measure is the
//! normalised error per position, `max_c |ours − HF| / max_c |HF|` over one row (the
//! `max_rel` of [`crate::compare::error_stats`] on that row, NaN-propagating), worst
//! over all positions and prompts: one tolerance fits stages whose magnitudes differ by
//! orders, and a position with huge activations (trained models have some) does not
//! hide an error at another. The stage fails when it exceeds the tolerance, and the
//! report names the prompt and the position of that worst row.

use std::path::Path;

use crate::backend::{Backend, BackendError, HostMatrix, SeqSlice};
use crate::compare::error_stats;
use crate::loaders::safetensors::{SafetensorsError, SafetensorsFile};
use crate::model::{Batch, CausalLm, LogitRows, Stage};

/// Why a verification could not run: a reference file that is not a reference dump, a
/// reference made from another model, or a backend that failed.
#[derive(Debug, thiserror::Error)]
pub enum VerifyError {
    #[error(transparent)]
    File(#[from] SafetensorsError),
    /// The file is safetensors but not what `scripts/hf_reference.py` writes.
    #[error("{}: {message}", path.display())]
    Reference { path: std::path::PathBuf, message: String },
    /// The reference and the model do not fit each other (made from another model, a
    /// prompt longer than the model's context).
    #[error("{0}")]
    Mismatch(String),
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// `return Err(message)` unless `cond` (for [`Reference::parse`]).
macro_rules! require {
    ($cond:expr, $($message:tt)+) => {
        if !$cond {
            return Err(format!($($message)+));
        }
    };
}

/// Normalised-error tolerances (max |ours − HF| / max |HF| per position), by the rounding
/// a run adds to HF's numbers: 2.5–7× the largest error measured on the three fixture
/// checkpoints and on random GPT-2 124M, on every backend (docs/correctness.md). The
/// f32 bound catches mistakes of 1e-4 and up; a lossy bound only catches what exceeds
/// its own rounding (one weight changed by 0.5 gives 1.2e-2: caught at f32, f16 and
/// f16 KV, not at bf16), so verify at f32 first.
pub mod tolerance {
    use crate::backend::WeightDtype;
    use crate::tensor::{Dtype, KvDtype};

    /// f32 weights and KV: float32 summation-order noise (measured ≤ 2.7e-6).
    pub const F32: f64 = 2e-5;
    /// Weights rounded to f16 as they load (measured ≤ 1.5e-3; with an f16 KV cache too ≤ 1.9e-3).
    pub const F16_WEIGHTS: f64 = 5e-3;
    /// Weights rounded to bf16 as they load (measured ≤ 9.8e-3; ≤ 1.25e-2 on the AVX512-BF16
    /// path, which rounds the activations of each weight product to bf16 too).
    pub const BF16_WEIGHTS: f64 = 2.5e-2;
    /// Keys and values rounded to f16 in the cache (measured ≤ 7.5e-4).
    pub const F16_KV: f64 = 3e-3;
    /// The cpu backend's default on Q8_0/Q4_0/Q4_1 GGUF blocks: activations quantized to
    /// 8-bit blocks as llama.cpp does (measured ≤ 9.3e-2 on the tiny random Llamas, whose
    /// large weights make it worst; ≤ 8.6e-2 on SmolLM2). It checks the wiring, not the
    /// digits: the kernels' own parity suite bounds them at 1e-5 against their arithmetic.
    pub const Q8_ACTIVATIONS: f64 = 0.15;
    /// Block types without a kernel (Q5_0, Q5_1, Q5_K) run re-quantized to Q8_0, and the
    /// k-quants' 256-wide rows hold larger outliers: 8-bit activations measured ≤ 2.3e-1
    /// on the 256-wide tiny random Llama (Q4_K and Q6_K on their own kernels included).
    pub const Q8_REQUANTIZED: f64 = 0.3;

    /// The tolerance for a run: the largest rounding it adds to a file stored as
    /// `stored`. Weights kept as stored (or widened) add nothing.
    pub fn for_run(stored: Dtype, weights: Option<WeightDtype>, kv: KvDtype) -> f64 {
        let w = match (weights, stored) {
            (Some(WeightDtype::F16), Dtype::F32) => F16_WEIGHTS,
            (Some(WeightDtype::BF16), Dtype::F32 | Dtype::F16) | (Some(WeightDtype::F16), Dtype::BF16) => BF16_WEIGHTS,
            _ => F32,
        };
        w.max(if kv == KvDtype::F16 { F16_KV } else { F32 })
    }
}

/// One prompt of a reference dump.
pub struct RefPrompt {
    pub text: String,
    pub ids: Vec<u32>,
    /// HF's tensors in stage order: embeddings, block 0..N-1, final norm, logits.
    pub stages: Vec<(Stage, HostMatrix)>,
    /// HF's top-K next tokens and their log_softmax at every position: (T, K) each.
    pub top_ids: Vec<Vec<u32>>,
    pub top_logprobs: Vec<Vec<f32>>,
}

/// A reference dump: its prompts and the metadata `scripts/hf_reference.py` wrote.
pub struct Reference {
    pub metadata: std::collections::BTreeMap<String, String>,
    pub n_layer: usize,
    pub prompts: Vec<RefPrompt>,
}

fn matrix(file: &SafetensorsFile, name: &str) -> Result<HostMatrix, String> {
    let t = file.get(name).ok_or_else(|| format!("the reference has no tensor {name:?}"))?;
    require!(t.shape.len() == 2, "reference tensor {name:?} has shape {:?}, expected (T, C)", t.shape);
    let data = t.to_f32()?;
    Ok(HostMatrix { rows: t.shape[0], cols: t.shape[1], data })
}

fn ints(file: &SafetensorsFile, name: &str) -> Result<(Vec<usize>, Vec<i64>), String> {
    let t = file.get(name).ok_or_else(|| format!("the reference has no tensor {name:?}"))?;
    Ok((t.shape.to_vec(), t.to_i64()?))
}

fn token_id(v: i64, name: &str) -> Result<u32, String> {
    u32::try_from(v).map_err(|_| format!("reference tensor {name:?} holds {v}, not a token id"))
}

impl Reference {
    pub fn open(path: &Path) -> Result<Self, VerifyError> {
        let file = SafetensorsFile::open(path)?;
        Self::parse(&file).map_err(|message| VerifyError::Reference { path: path.to_owned(), message })
    }

    fn parse(file: &SafetensorsFile) -> Result<Self, String> {
        let metadata = file.metadata().clone();
        let meta = |k: &str| {
            metadata
                .get(k)
                .ok_or_else(|| format!("no {k:?} in the metadata; is this a file written by scripts/hf_reference.py?"))
        };
        let n_layer: usize = meta("n_layer")?.parse().map_err(|_| "metadata n_layer is not a number")?;
        let n_prompts: usize = meta("n_prompts")?.parse().map_err(|_| "metadata n_prompts is not a number")?;
        let texts: Vec<String> =
            serde_json::from_str(meta("prompts")?).map_err(|_| "metadata prompts is not a JSON list")?;
        require!(texts.len() == n_prompts, "metadata lists {} prompts but n_prompts is {n_prompts}", texts.len());
        require!(n_layer <= 10_000, "metadata n_layer {n_layer} is absurd");
        let mut prompts = Vec::with_capacity(n_prompts);
        for (i, text) in texts.into_iter().enumerate() {
            let name = format!("p{i}.input_ids");
            let (shape, ids) = ints(file, &name)?;
            require!(shape.len() == 1 && !ids.is_empty(), "{name} has shape {shape:?}, expected (T,) with T > 0");
            let ids = ids.into_iter().map(|v| token_id(v, &name)).collect::<Result<Vec<u32>, _>>()?;
            let t = ids.len();
            let mut stages = vec![(Stage::Embeddings, matrix(file, &format!("p{i}.embeddings"))?)];
            for j in 0..n_layer {
                stages.push((Stage::Block(j), matrix(file, &format!("p{i}.block.{j}"))?));
            }
            stages.push((Stage::FinalNorm, matrix(file, &format!("p{i}.final_norm"))?));
            stages.push((Stage::Logits, matrix(file, &format!("p{i}.logits"))?));
            for (stage, m) in &stages {
                require!(m.rows == t, "p{i} {stage}: {} rows but the prompt has {t} tokens", m.rows);
            }
            let (top_shape, top) = ints(file, &format!("p{i}.top_ids"))?;
            let lp = matrix(file, &format!("p{i}.top_logprobs"))?;
            require!(
                top_shape.len() == 2 && top_shape[0] == t && lp.rows == t && lp.cols == top_shape[1],
                "p{i}: top_ids {top_shape:?} and top_logprobs ({}, {}) do not match {t} positions",
                lp.rows,
                lp.cols
            );
            let k = lp.cols;
            require!(k > 0, "p{i}: top_ids and top_logprobs hold no tokens (K = 0)");
            let top_ids = top
                .chunks(k.max(1))
                .map(|r| r.iter().map(|&v| token_id(v, "top_ids")).collect::<Result<Vec<u32>, _>>())
                .collect::<Result<Vec<_>, _>>()?;
            let top_logprobs = (0..t).map(|r| lp.row(r).to_vec()).collect();
            prompts.push(RefPrompt { text, ids, stages, top_ids, top_logprobs });
        }
        require!(!prompts.is_empty(), "the reference holds no prompts");
        Ok(Reference { metadata, n_layer, prompts })
    }

    /// Where the numbers came from, for the report's heading.
    pub fn describe(&self) -> String {
        let m = |k: &str| self.metadata.get(k).map_or("?", |v| v.as_str());
        let tokens: usize = self.prompts.iter().map(|p| p.ids.len()).sum();
        format!(
            "{} ({}) by HF transformers {}, torch {}, in {}, {}; {} prompts, {tokens} tokens",
            m("model"),
            m("architecture"),
            m("transformers"),
            m("torch"),
            m("dtype"),
            m("date"),
            self.prompts.len()
        )
    }
}

/// The comparison of one stage over all prompts.
#[derive(Clone, Debug)]
pub struct StageReport {
    pub stage: Stage,
    /// max |ours − HF| anywhere (not necessarily at `prompt`/`position`).
    pub max_abs: f64,
    /// max |ours − HF| / max |HF| of one position, the worst over all positions and
    /// prompts (NaN if anything was NaN).
    pub max_rel: f64,
    pub tolerance: f64,
    /// The prompt and position of `max_rel`.
    pub prompt: usize,
    pub position: usize,
    /// Logits only: positions whose argmax equals HF's, of all positions, and the
    /// smallest top-2 margin of HF's logits (how close a tie an argmax could flip on).
    pub argmax: Option<(usize, usize)>,
    pub min_margin: Option<f32>,
}

impl StageReport {
    pub fn ok(&self) -> bool {
        self.max_rel <= self.tolerance // false for NaN
    }
}

/// The whole comparison for one backend.
pub struct Verification {
    /// Prompts whose ids our tokenizer reproduces, of all prompts; the first that
    /// differs (prompt index, our ids).
    pub tokens_equal: usize,
    pub token_mismatch: Option<(usize, Vec<u32>)>,
    /// Stages in order, up to and including the first beyond its tolerance.
    pub stages: Vec<StageReport>,
}

impl Verification {
    pub fn first_failure(&self) -> Option<&StageReport> {
        self.stages.iter().find(|s| !s.ok())
    }
}

fn argmax(row: &[f32]) -> usize {
    crate::engine::sampler::argmax(row) as usize
}

/// Top-2 margin of one row of logits.
fn margin(row: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &v in row {
        if v > a {
            b = a;
            a = v;
        } else if v > b {
            b = v;
        }
    }
    a - b
}

/// Run every prompt of `reference` through `model` and compare each stage with HF's.
/// `tolerance` is the normalised error allowed at every stage. `encode` is the
/// tokenizer with the model's conventions ([`crate::engine::Engine::prompt_ids`]: BOS, the
/// empty prompt); its ids are compared with HF's, and the model always runs on HF's.
pub fn verify<B: Backend>(
    backend: &B,
    model: &dyn CausalLm<B>,
    reference: &Reference,
    tolerance: f64,
    encode: impl Fn(&str) -> Vec<u32>,
) -> Result<Verification, VerifyError> {
    let info = model.info();
    let mismatch = |message: String| Err(VerifyError::Mismatch(message));
    if reference.n_layer != info.n_layer {
        return mismatch(format!(
            "the reference has {} blocks but the model has {}: it was made from a different model",
            reference.n_layer, info.n_layer
        ));
    }
    if reference.prompts.is_empty() {
        return mismatch("the reference holds no prompts".into());
    }
    let mut tokens_equal = 0;
    let mut token_mismatch = None;
    // ours[p][s]: our tensor for prompt p, stage s.
    let mut ours: Vec<Vec<HostMatrix>> = Vec::new();
    for (i, p) in reference.prompts.iter().enumerate() {
        let mine = encode(&p.text);
        if mine == p.ids {
            tokens_equal += 1;
        } else if token_mismatch.is_none() {
            token_mismatch = Some((i, mine));
        }
        if let Some(&id) = p.ids.iter().find(|&&id| id as usize >= info.vocab_size) {
            return mismatch(format!(
                "prompt {i} holds token id {id}, outside the model's vocabulary of {}: the reference was made \
                 from a different model",
                info.vocab_size
            ));
        }
        if p.ids.len() > info.context_length {
            return mismatch(format!(
                "prompt {i} has {} tokens, more than the model's context of {}",
                p.ids.len(),
                info.context_length
            ));
        }
        let mut cache = model.new_cache(backend, p.ids.len())?;
        let seqs = [SeqSlice { rows: 0..p.ids.len(), start_pos: 0 }];
        let mut stages = Vec::with_capacity(p.stages.len());
        let mut misaligned = None;
        let traced = model.forward_traced(
            backend,
            &Batch { tokens: &p.ids, seqs: &seqs },
            &mut [&mut cache],
            LogitRows::All,
            &mut |stage, act| {
                let want = p.stages.get(stages.len()).map(|s| s.0);
                if want != Some(stage) {
                    let message = format!("the model's stage {stage} does not line up with the reference's {want:?}");
                    misaligned = Some(message.clone());
                    return Err(BackendError::Invalid(message)); // ends the forward
                }
                stages.push(backend.read(act)?);
                Ok(())
            },
        );
        if let Some(message) = misaligned {
            return mismatch(message);
        }
        traced?;
        if stages.len() != p.stages.len() {
            return mismatch(format!("the model has {} stages, the reference {}", stages.len(), p.stages.len()));
        }
        for ((stage, want), got) in p.stages.iter().zip(&stages) {
            if want.cols != got.cols {
                return mismatch(format!(
                    "{stage}: the reference is {} wide but the model {}: it was made from a different model",
                    want.cols, got.cols
                ));
            }
        }
        ours.push(stages);
    }
    let mut reports = Vec::new();
    for (s, &(stage, _)) in reference.prompts[0].stages.iter().enumerate() {
        let mut report = StageReport {
            stage,
            max_abs: 0.0,
            max_rel: 0.0,
            tolerance,
            prompt: 0,
            position: 0,
            argmax: None,
            min_margin: None,
        };
        for (i, p) in reference.prompts.iter().enumerate() {
            let (want, got) = (&p.stages[s].1, &ours[i][s]);
            for r in 0..want.rows {
                let e = error_stats(got.row(r), want.row(r));
                report.max_abs = if e.max_abs.is_nan() || report.max_abs.is_nan() {
                    f64::NAN
                } else {
                    report.max_abs.max(e.max_abs)
                };
                // A NaN is worse than any number, and the first NaN stays.
                let worse = (e.max_rel.is_nan() && !report.max_rel.is_nan()) || e.max_rel > report.max_rel;
                if worse {
                    report.max_rel = e.max_rel;
                    report.prompt = i;
                    report.position = r;
                }
            }
            if stage == Stage::Logits {
                let (agree, total) = report.argmax.unwrap_or((0, 0));
                let same = (0..want.rows).filter(|&r| argmax(want.row(r)) == argmax(got.row(r))).count();
                report.argmax = Some((agree + same, total + want.rows));
                let m = (0..want.rows).map(|r| margin(want.row(r))).fold(f32::INFINITY, f32::min);
                report.min_margin = Some(report.min_margin.map_or(m, |x| x.min(m)));
            }
        }
        let failed = !report.ok();
        reports.push(report);
        if failed {
            break;
        }
    }
    Ok(Verification { tokens_equal, token_mismatch, stages: reports })
}

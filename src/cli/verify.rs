//! `forge verify`: the model, stage by stage, against a HF transformers reference dump
//! (`scripts/hf_reference.py`), on one backend or all of them.

use std::path::PathBuf;

use clap::{Args, ValueEnum};

use batch_forge::backend::Backend;
use batch_forge::engine::Engine;
use batch_forge::loaders::DEFAULT_MODEL;
use batch_forge::tensor::KvDtype;
use batch_forge::verify::{Reference, Verification, tolerance, verify};

use super::{BackendArgs, BackendChoice, DtypeChoice, SplitChoice, with_backend};

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum VerifyBackend {
    Cpu,
    Reference,
    Gpu,
    /// reference, cpu and gpu (gpu skipped with a note when there is no adapter).
    All,
}

#[derive(Args)]
pub struct VerifyArgs {
    /// Model folder, .gguf file, or Hub repo id.
    #[arg(long, short, default_value = DEFAULT_MODEL)]
    model: String,
    /// The reference dump written by scripts/hf_reference.py.
    #[arg(long, value_name = "REF.safetensors")]
    reference: PathBuf,
    #[arg(long, value_enum, default_value_t = VerifyBackend::Cpu)]
    backend: VerifyBackend,
    /// Weight storage (cpu: f32/f16/bf16, gpu: f32/f16); the tolerance follows it.
    #[arg(long, value_enum, default_value_t = DtypeChoice::Auto)]
    dtype: DtypeChoice,
    /// KV-cache storage (cpu and gpu).
    #[arg(long, value_name = "f32|f16", default_value_t = KvDtype::F32)]
    kv_dtype: KvDtype,
    /// Override the normalised-error tolerance of every stage.
    #[arg(long, value_name = "X")]
    tolerance: Option<f64>,
    /// Worker threads (default: the physical cores available to this process).
    #[arg(long, short)]
    threads: Option<usize>,
    /// Print one JSON object instead of the tables.
    #[arg(long)]
    json: bool,
}

struct Run {
    name: &'static str,
    args: BackendArgs,
    tolerance: f64,
    label: String,
    /// Why `--backend all` skips this backend.
    skip: Option<String>,
}

pub fn run(args: VerifyArgs) -> anyhow::Result<()> {
    if let Some(t) = args.tolerance {
        anyhow::ensure!(t.is_finite() && t > 0.0, "--tolerance must be a positive number, got {t}");
    }
    super::check_threads(args.threads.as_slice())?;
    let choices: Vec<(&'static str, BackendChoice)> = match args.backend {
        VerifyBackend::Cpu => vec![("cpu", BackendChoice::Cpu)],
        VerifyBackend::Reference => vec![("reference", BackendChoice::Reference)],
        VerifyBackend::Gpu => vec![("gpu", BackendChoice::Gpu)],
        VerifyBackend::All => {
            vec![("reference", BackendChoice::Reference), ("cpu", BackendChoice::Cpu), ("gpu", BackendChoice::Gpu)]
        }
    };
    let all = args.backend == VerifyBackend::All;
    let mut runs = Vec::new();
    for (name, backend) in choices {
        // With `all`, the reference backend runs in f32 whatever --dtype says.
        let plain = all && backend == BackendChoice::Reference;
        let b = BackendArgs {
            backend,
            dtype: if plain { DtypeChoice::Auto } else { args.dtype },
            kv_dtype: if plain { KvDtype::F32 } else { args.kv_dtype },
            swa_full: false,
            split_k: SplitChoice::Auto,
            batch_invariant: false,
        };
        // With `all`, a backend that cannot run these flags (gpu and bf16, a build
        // without gpu) is skipped with the reason; asked for alone, it is an error.
        let skip = match b.validate("verify") {
            Ok(()) => None,
            Err(e) if all => Some(format!("{e:#}")),
            Err(e) => return Err(e),
        };
        runs.push(Run { name, args: b, tolerance: 0.0, label: String::new(), skip });
    }
    let reference = Reference::open(&args.reference)?;
    let dir = super::model_dir(&args.model, true, "verify")?;
    let stored = super::stored_dtype_at(&dir)?;
    let quantized = super::bench::quantized_summary(&dir)?.map(|(ty, _)| ty);
    for r in &mut runs {
        let weights = r.args.cpu_options()?.weight_dtype;
        r.tolerance = args.tolerance.unwrap_or_else(|| tolerance::for_run(stored, weights, r.args.kv_dtype));
        let mut dtype = match r.args.dtype {
            DtypeChoice::Auto => stored.name().to_ascii_lowercase(),
            d => format!("{d:?}").to_ascii_lowercase(),
        };
        // The cpu backend keeps these blocks quantized and quantizes activations to 8 bits.
        if let (Some(ty), BackendChoice::Cpu, DtypeChoice::Auto) = (&quantized, r.args.backend, r.args.dtype) {
            // (Q6_K keeps its blocks too, but its 256-wide rows hold larger outliers: the
            // looser bound, as measured on the tiny random Llama.)
            let native = ["q8_0", "q4_0", "q4_1"].contains(&ty.as_str());
            r.tolerance =
                args.tolerance.unwrap_or(if native { tolerance::Q8_ACTIVATIONS } else { tolerance::Q8_REQUANTIZED });
            let requant = match ty.as_str() {
                _ if native => "",
                "q6_k" => "",
                // Held losslessly as Q4_1 sub-blocks, its Q6_K parts exactly; Q5 fallbacks
                // (rows not a multiple of 256) are re-quantized.
                "q4_k" => " (any q5 parts re-quantized to q8_0)",
                _ => " re-quantized to q8_0",
            };
            dtype = format!("{ty}{requant} (8-bit activations: llama.cpp's arithmetic; --dtype f32 is HF's)");
        }
        r.label = format!("{dtype} weights, {} KV", r.args.kv_dtype);
    }
    let model_name = super::bench::display_name(&args.model);
    let mut results = Vec::new();
    let mut failures = Vec::new();
    for r in &runs {
        let outcome = match &r.skip {
            Some(why) => Err(why.clone()),
            None => match super::in_pool(args.threads, || {
                with_backend!(r.args, |b| check_on(b, &dir, &reference, r.tolerance))
            }) {
                Ok(v) => Ok(v),
                // With `all`, a GPU that cannot be set up (no adapter, no shader-f16 for
                // an f16 KV cache, ...) is skipped with the reason.
                Err(e) if all && r.args.backend == BackendChoice::Gpu => Err(format!("{e:#}")),
                Err(e) => return Err(e),
            },
        };
        let v = match outcome {
            Ok(v) => v,
            Err(why) => {
                if !args.json {
                    super::outln!("{}: skipped ({why})\n", r.name);
                }
                results.push(serde_json::json!({ "backend": r.name, "skipped": why }));
                continue;
            }
        };
        let failure = failure_line(r.name, &v, &reference);
        if !args.json {
            print_table(&model_name, r, &reference, &v, &args.reference)?;
        }
        results.push(json_of(r, &v, failure.as_deref()));
        failures.extend(failure);
    }
    if args.json {
        let obj = serde_json::json!({
            "model": model_name,
            "reference": { "path": args.reference.display().to_string(), "metadata": reference.metadata },
            "backends": results,
            "ok": failures.is_empty(),
        });
        super::outln!("{}", serde_json::to_string_pretty(&obj)?);
    }
    match failures.first() {
        None => Ok(()),
        Some(first) => anyhow::bail!("{first}"),
    }
}

fn check_on<B: Backend>(
    backend: B,
    dir: &std::path::Path,
    reference: &Reference,
    tolerance: f64,
) -> anyhow::Result<Verification> {
    let engine = Engine::load(backend, dir)?;
    Ok(verify(&engine.backend, engine.model.as_ref(), reference, tolerance, |s| engine.prompt_ids(s))?)
}

fn short(text: &str) -> String {
    let t: String = text.chars().take(40).collect();
    let t = if t.len() < text.len() { format!("{t}…") } else { t };
    format!("{t:?}")
}

/// The error for a failed run: the first stage beyond its tolerance, or a tokenizer
/// that does not give HF's ids.
fn failure_line(backend: &str, v: &Verification, reference: &Reference) -> Option<String> {
    if let Some(s) = v.first_failure() {
        let p = &reference.prompts[s.prompt];
        return Some(format!(
            "{backend}: {} is beyond its tolerance: max rel error {:.3e} > {:.1e} at prompt {} ({}) position {}",
            s.stage,
            s.max_rel,
            s.tolerance,
            s.prompt,
            short(&p.text),
            s.position
        ));
    }
    v.token_mismatch.as_ref().map(|(i, ours)| {
        format!(
            "{backend}: the tokenizer does not give HF's ids for prompt {i} ({}): ours {ours:?}, HF's {:?}",
            short(&reference.prompts[*i].text),
            reference.prompts[*i].ids
        )
    })
}

fn print_table(
    model: &str,
    r: &Run,
    reference: &Reference,
    v: &Verification,
    path: &std::path::Path,
) -> anyhow::Result<()> {
    super::outln!(
        "verify {model} on {} ({}), tolerance {:.1e} (max rel error per stage)",
        r.name,
        r.label,
        r.tolerance
    );
    super::outln!("reference {}: {}", path.display(), reference.describe());
    super::outln!("tokens: {} of {} prompts give HF's ids", v.tokens_equal, reference.prompts.len());
    super::outln!("| stage | max abs error | max rel error | worst rel error at | result |");
    super::outln!("| --- | ---: | ---: | --- | --- |");
    for s in &v.stages {
        let mut result = if s.ok() { "ok".to_owned() } else { "FAIL".to_owned() };
        if let (Some((agree, total)), Some(m)) = (s.argmax, s.min_margin) {
            result.push_str(&format!("; argmax {agree}/{total}, smallest HF top-2 margin {m:.2e}"));
        }
        super::outln!(
            "| {} | {:.2e} | {:.2e} | prompt {} position {} | {result} |",
            s.stage,
            s.max_abs,
            s.max_rel,
            s.prompt,
            s.position
        );
    }
    let n_stages = reference.prompts[0].stages.len();
    if v.stages.len() < n_stages {
        super::outln!("(the {} later stages are not compared: they inherit the failure)", n_stages - v.stages.len());
    }
    super::outln!();
    Ok(())
}

fn json_of(r: &Run, v: &Verification, failure: Option<&str>) -> serde_json::Value {
    let num = |x: f64| if x.is_finite() { serde_json::json!(x) } else { serde_json::json!(x.to_string()) };
    let stages: Vec<serde_json::Value> = v
        .stages
        .iter()
        .map(|s| {
            let mut o = serde_json::json!({
                "stage": s.stage.to_string(),
                "max_abs_error": num(s.max_abs),
                "max_rel_error": num(s.max_rel),
                "tolerance": s.tolerance,
                "prompt": s.prompt,
                "position": s.position,
                "ok": s.ok(),
            });
            if let (Some((agree, total)), Some(m)) = (s.argmax, s.min_margin) {
                o["argmax_agree"] = agree.into();
                o["argmax_total"] = total.into();
                o["min_top2_margin"] = num(f64::from(m));
            }
            o
        })
        .collect();
    serde_json::json!({
        "backend": r.name,
        "weights_kv": r.label,
        "tolerance": r.tolerance,
        "tokens_equal": v.tokens_equal,
        "stages": stages,
        "ok": failure.is_none(),
        "failure": failure,
    })
}

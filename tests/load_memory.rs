//! Loading a model does not hold the file and the packed weights in memory at once: the
//! peak resident memory while loading stays within 1.1× of what the loaded model keeps
//! (issue: a 124M f32 model once peaked at 2.1× its steady state). One test per binary,
//! so no other test moves this process's memory meanwhile. Linux only (`/proc`).

use std::path::Path;
use std::process::Command;

use batch_forge::backend::WeightDtype;
use batch_forge::backend::cpu::{CpuBackend, CpuOptions};
use batch_forge::engine::Engine;

/// A `VmRSS`/`VmHWM` line of /proc/self/status, in KiB.
fn status_kib(field: &str) -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let line =
        status.lines().find(|l| l.starts_with(field)).unwrap_or_else(|| panic!("no {field} in /proc/self/status"));
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

/// Load `model` with `opts`; the (peak, kept) growth of resident memory in MiB.
fn load_growth(model: &Path, opts: CpuOptions) -> (f64, f64) {
    // Writing 5 to clear_refs resets the peak (VmHWM) to the current resident size.
    std::fs::write("/proc/self/clear_refs", "5").unwrap();
    let base = status_kib("VmRSS:");
    assert!(status_kib("VmHWM:") <= base + 1024, "clear_refs did not reset VmHWM");
    let engine = Engine::load(CpuBackend::new(opts).unwrap(), model).unwrap();
    let (peak, kept) = (status_kib("VmHWM:"), status_kib("VmRSS:"));
    drop(engine);
    // Give the freed model back to the system, so the next case starts from a clean base.
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap memory to the system.
    unsafe {
        libc::malloc_trim(0);
    }
    ((peak - base) as f64 / 1024.0, (kept.saturating_sub(base)) as f64 / 1024.0)
}

fn forge(args: &[&str]) {
    let out = Command::new(env!("CARGO_BIN_EXE_forge")).args(args).output().unwrap();
    assert!(out.status.success(), "forge {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

#[test]
fn loading_peaks_within_a_tenth_of_the_loaded_model() {
    if !cfg!(target_os = "linux") {
        eprintln!("*** SKIPPED: peak memory is read from /proc (Linux only) ***");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let hf = dir.path().join("distilgpt2");
    let hf_s = hf.to_str().unwrap();
    let tokenizer = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures/gpt2-tokenizer");
    forge(&["random-model", "--preset", "distilgpt2", "--out", hf_s, "--tokenizer-from", tokenizer]);
    let q8 = dir.path().join("q8_0.gguf");
    forge(&["quantize", hf_s, q8.to_str().unwrap(), "--type", "q8_0"]);
    let f32w = CpuOptions { weight_dtype: Some(WeightDtype::F32), ..CpuOptions::default() };
    let f16w = CpuOptions { weight_dtype: Some(WeightDtype::F16), ..CpuOptions::default() };
    let mut cases = vec![
        ("distilgpt2 safetensors, f32", hf.clone(), f32w),
        ("distilgpt2 safetensors, f16", hf.clone(), f16w),
        ("distilgpt2 q8_0 gguf", q8.clone(), CpuOptions::default()),
    ];
    match std::env::var("BATCH_FORGE_SMOLLM2") {
        Ok(p) => cases.push(("SmolLM2 q4_1 gguf (q|k|v and gate|up joined)", p.into(), CpuOptions::default())),
        Err(_) => eprintln!("*** SKIPPED: SmolLM2 case (set BATCH_FORGE_SMOLLM2; .ci/run does) ***"),
    }
    for (name, path, opts) in cases {
        let (peak, kept) = load_growth(&path, opts);
        eprintln!("{name}: peak +{peak:.1} MiB, kept +{kept:.1} MiB ({:.2}x)", peak / kept);
        assert!(kept > 50.0, "{name}: the loaded model keeps only {kept:.1} MiB?");
        assert!(
            peak <= 1.1 * kept + 8.0,
            "{name}: loading peaked at +{peak:.1} MiB for a model that keeps +{kept:.1} MiB"
        );
    }
}

//! Every input the fuzzers start from (fuzz/seeds/) or ever found a crash, hang or
//! out-of-memory with (fuzz/regressions/), replayed through the same property checks
//! the cargo-fuzz targets run (fuzz/checks.rs), on stable Rust and in CI. A new finding
//! is added by copying libFuzzer's artifact into fuzz/regressions/<target>/.

#[path = "../fuzz/checks.rs"]
mod checks;

use std::path::Path;

fn replay(target: &str, check: fn(&[u8])) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz");
    let mut n = 0;
    for dir in ["seeds", "regressions"] {
        let Ok(entries) = std::fs::read_dir(root.join(dir).join(target)) else { continue };
        let mut files: Vec<_> = entries.map(|e| e.unwrap().path()).collect();
        files.sort();
        for f in files {
            let data = std::fs::read(&f).unwrap();
            eprintln!("{target}: {}", f.display());
            check(&data);
            n += 1;
        }
    }
    assert!(n > 0, "{target}: no seeds found under fuzz/seeds/{target}");
}

/// One test per fuzz target, named after it.
macro_rules! replay_targets {
    ($($target:ident),* $(,)?) => {$(
        #[test]
        fn $target() {
            replay(stringify!($target), checks::$target);
        }
    )*};
}

replay_targets!(safetensors, config_json, tokenizer_json, vocab_merges, bpe_roundtrip, stream_decoder, sampler, gguf);

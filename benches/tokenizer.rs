//! Tokenizer throughput (MB/s of UTF-8 input), single thread.
//! `BF_TOKENIZER_CORPUS=path/to/text cargo bench --bench tokenizer`; without it, the
//! fixture tokenizer cases concatenated 40 times. `scripts/tokenizer_speed.py` times HF
//! `tokenizers` on the same file for a side-by-side.

use std::hint::black_box;
use std::path::Path;

use batch_forge::tokenizer::Tokenizer;
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

fn corpus() -> String {
    if let Ok(p) = std::env::var("BF_TOKENIZER_CORPUS") {
        return std::fs::read_to_string(p).expect("BF_TOKENIZER_CORPUS is readable UTF-8");
    }
    let cases = std::fs::read_to_string("tests/fixtures/gpt2-tokenizer/cases.jsonl").unwrap();
    let texts: Vec<String> = cases
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["text"].as_str().unwrap().to_owned())
        .collect();
    texts.join("\n").repeat(40)
}

fn encode(c: &mut Criterion) {
    let tok = Tokenizer::from_dir(Path::new("tests/fixtures/gpt2-tokenizer")).unwrap();
    let text = corpus();
    let mut g = c.benchmark_group("tokenizer");
    g.sample_size(10);
    g.throughput(Throughput::Bytes(text.len() as u64));
    g.bench_function("encode_ordinary", |b| b.iter(|| tok.encode_ordinary(black_box(&text))));
    let ids = tok.encode_ordinary(&text);
    g.bench_function("decode", |b| b.iter(|| tok.decode(black_box(&ids)).unwrap()));
    g.finish();
}

criterion_group!(benches, encode);
criterion_main!(benches);

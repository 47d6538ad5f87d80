//! GPT-2's real tokenizer on arbitrary bytes: valid UTF-8 round-trips exactly through
//! encode → decode (with and without special-token matching), every id is in range,
//! encoding finishes in bounded time (libFuzzer's -timeout), and the chains of splits
//! (DeepSeek's, MiniCPM 5's) tile the text.
#![no_main]

#[path = "../checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::bpe_roundtrip(data));

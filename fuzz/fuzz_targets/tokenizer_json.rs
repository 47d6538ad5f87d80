//! Any text as a `tokenizer.json`, then any text to encode with what it accepted:
//! loading is an error or a tokenizer that encodes in bounded time (libFuzzer's
//! -timeout) into ids that decode, back to the exact input where the tokenizer
//! round-trips (byte-level without a normalizer). Input: JSON, a 0 byte, the text.
#![no_main]

#[path = "../checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::tokenizer_json(data));

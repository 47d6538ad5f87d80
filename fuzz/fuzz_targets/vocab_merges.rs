//! Any `vocab.json` + `merges.txt` pair, then any text: as for `tokenizer_json`.
//! Input: vocab, a 0 byte, merges, a 0 byte, the text.
#![no_main]

#[path = "../checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::vocab_merges(data));

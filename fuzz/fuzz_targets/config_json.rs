//! Any text as a GPT-2 `config.json`: accepted configs are consistent (every derived
//! size is computable without overflow), everything else is an error, never a panic.
#![no_main]

#[path = "../checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::config_json(data));

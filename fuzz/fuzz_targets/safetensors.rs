//! Any byte string as a safetensors file: the header is validated or rejected with an
//! error, never a panic, and every tensor of an accepted file reads in bounds.
#![no_main]

#[path = "../checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::safetensors(data));

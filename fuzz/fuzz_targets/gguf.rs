//! Any bytes as a GGUF file: validated or an error (never a panic, a hang or a huge
//! allocation); every tensor of an accepted file lies inside the file, aligned, with
//! exactly the bytes its type and dimensions need, and no two overlap.
#![no_main]

#[path = "../checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::gguf(data));

//! The streaming UTF-8 decoder on arbitrary bytes cut into arbitrary pieces: what it
//! emits, piece by piece and then at `finish`, equals a one-shot lossy decode of the
//! whole; every emitted piece is whole characters (it is a `String`), and what it holds
//! back is at most one partial character. Input: a cut table byte, then the bytes.
#![no_main]

#[path = "../checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::stream_decoder(data));

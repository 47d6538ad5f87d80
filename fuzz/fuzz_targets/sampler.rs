//! Sampling parameters and logits from raw bits (any f32: NaN, ±inf, subnormals):
//! invalid parameters are refused; accepted ones always return an id in range that is
//! not a NaN logit (unless every logit is NaN), greedy when the temperature is 0.
#![no_main]

#[path = "../checks.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::sampler(data));

//! Random-weight GPT-2 checkpoints of any config, for benchmarks without a download.
//!
//! Values follow GPT-2's initialisation (weights ~ N(0, 0.02), LayerNorm gain 1), with
//! small random biases, so activations have realistic scale. Tensors use the Hub's
//! names and layout, so the result loads exactly like a downloaded checkpoint.

use std::collections::BTreeMap;

use crate::loaders::Gpt2Config;
use crate::loaders::safetensors::{OwnedTensor, serialize};
use crate::rng::Rng;

fn normal(rng: &mut Rng, n: usize, mean: f32, std: f32) -> Vec<f32> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        // Box–Muller: two independent N(0, 1) values per pair of uniforms.
        let (u1, u2) = (rng.next_f64().max(f64::MIN_POSITIVE), rng.next_f64());
        let r = (-2.0 * u1.ln()).sqrt();
        let t = std::f64::consts::TAU * u2;
        out.push(mean + std * (r * t.cos()) as f32);
        out.push(mean + std * (r * t.sin()) as f32);
    }
    out.truncate(n);
    out
}

/// A complete `model.safetensors` image for `config`.
pub fn random_checkpoint(config: &Gpt2Config, seed: u64) -> Vec<u8> {
    let mut rng = Rng::new(seed);
    let (c, f) = (config.n_embd, config.n_inner);
    let mut t = Vec::new();
    let mut add = |name: String, shape: Vec<usize>, mean: f32, std: f32| {
        let n = shape.iter().product();
        t.push(OwnedTensor::f32(&name, shape, &normal(&mut rng, n, mean, std)));
    };
    add("wte.weight".into(), vec![config.vocab_size, c], 0.0, 0.02);
    add("wpe.weight".into(), vec![config.n_positions, c], 0.0, 0.01);
    for i in 0..config.n_layer {
        let p = format!("h.{i}");
        for ln in ["ln_1", "ln_2"] {
            add(format!("{p}.{ln}.weight"), vec![c], 1.0, 0.02);
            add(format!("{p}.{ln}.bias"), vec![c], 0.0, 0.02);
        }
        for (name, n_in, n_out) in
            [("attn.c_attn", c, 3 * c), ("attn.c_proj", c, c), ("mlp.c_fc", c, f), ("mlp.c_proj", f, c)]
        {
            add(format!("{p}.{name}.weight"), vec![n_in, n_out], 0.0, 0.02);
            add(format!("{p}.{name}.bias"), vec![n_out], 0.0, 0.02);
        }
    }
    add("ln_f.weight".into(), vec![c], 1.0, 0.02);
    add("ln_f.bias".into(), vec![c], 0.0, 0.02);
    let metadata = BTreeMap::from([("format".to_owned(), "pt".to_owned())]);
    serialize(&t, &metadata)
}

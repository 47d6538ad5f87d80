//! One parity suite for every backend: each op against the reference backend on random
//! inputs of awkward shapes and magnitudes, compared by normalised error.
//!
//! Error measure: NMSE = Σ(got − ref)² / Σ ref², as in llama.cpp's test-backend-ops, plus
//! the max error relative to the largest reference value. Bounds: f32 rounding
//! (ε = 6e-8) over dot products of up to 3072 terms in a different order gives relative
//! errors around √n·ε ≈ 3e-6, so NMSE ≲ 1e-11 when correct. We allow NMSE ≤ 1e-9 and
//! max-relative ≤ 2e-5. A wrong element, a missed tail or a transposed tile gives NMSE
//! near 1/n_out ≥ 2e-5 even when only one of 50257 outputs is wrong.
//!
//! The GPU kernels meet the same bounds: they accumulate in f32 too (tiles of 16 k-steps,
//! 32-lane tree reductions, an online softmax), and the transcendental builtins they
//! use (exp, tanh, sqrt) carry a few ulp of error each under WGSL's accuracy rules,
//! far inside 2e-5 relative. On lavapipe the worst NMSE is 2.3e-12 (linear+GELU, f16
//! weights) and the worst max-relative error 2.8e-6 (attention).
//!
//! 16-bit weights and KV caches are checked against the reference fed the same values
//! rounded to 16 bits, so the bound stays the f32 one: the kernels' conversions are exact.
//! So are the AVX512-BF16 products, whose activations are rounded to bf16: the reference's
//! matrix products get the same rounded activations.

mod common;

use batch_forge::backend::cpu::simd::{
    avx2_or_skip, avx512_bf16_or_skip, avx512_or_skip, avx512_vnni_or_skip, isas_or_skip,
};
use batch_forge::tensor::KvDtype;
use common::{round_to, tensor, view};

use batch_forge::backend::WeightDtype;
use batch_forge::backend::cpu::{CpuBackend, CpuOptions, Isa};
use batch_forge::backend::reference::ReferenceBackend;
use batch_forge::backend::{
    AttentionSpec, Backend, HostMatrix, KvCache, KvLayout, MatrixLayout, Rope, RopeScaling, RopeStyle, SeqSlice,
    rope_row,
};
use batch_forge::compare::error_stats;
use batch_forge::engine::sampler::Rng;

const NMSE_MAX: f64 = 1e-9;
const MAX_REL: f64 = 2e-5;

fn normal(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n)
        .map(|_| {
            let (u1, u2) = (rng.next_f64().max(1e-300), rng.next_f64());
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32 * scale
        })
        .collect()
}

fn host(rows: usize, cols: usize, data: Vec<f32>) -> HostMatrix {
    HostMatrix { rows, cols, data }
}

/// NMSE and max relative error of `got` against `want`, or why they fail the bounds.
/// NaN anywhere fails (the measures propagate it); so does a shape mismatch.
fn measure(got: &HostMatrix, want: &HostMatrix) -> Result<(f64, f64), String> {
    if (got.rows, got.cols) != (want.rows, want.cols) {
        return Err(format!("shape {}x{} vs {}x{}", got.rows, got.cols, want.rows, want.cols));
    }
    let e = error_stats(&got.data, &want.data);
    if e.within(NMSE_MAX, MAX_REL) {
        Ok((e.nmse, e.max_rel))
    } else {
        Err(format!("NMSE {:e}, max rel err {:e}", e.nmse, e.max_rel))
    }
}

#[track_caller]
fn compare(what: &str, got: &HostMatrix, want: &HostMatrix) -> (f64, f64) {
    measure(got, want).unwrap_or_else(|e| panic!("{what}: {e}"))
}

/// The harness itself must reject what a broken kernel produces: one wrong element of
/// 50257, a transposed tile, a single NaN, an all-NaN output, a wrong shape.
#[test]
fn the_harness_rejects_broken_outputs() {
    let mut rng = Rng::new(1);
    let want = host(1, 50257, normal(&mut rng, 50257, 1.0));
    assert_eq!(measure(&want, &want), Ok((0.0, 0.0)));
    let mut one_wrong = want.clone();
    one_wrong.data[31337] += 1.0;
    assert!(measure(&one_wrong, &want).is_err(), "one wrong element");
    let tile = host(16, 16, normal(&mut rng, 256, 1.0));
    let mut transposed = tile.clone();
    for i in 0..16 {
        for j in 0..16 {
            transposed.data[i * 16 + j] = tile.data[j * 16 + i];
        }
    }
    assert!(measure(&transposed, &tile).is_err(), "transposed tile");
    let mut one_nan = want.clone();
    one_nan.data[7] = f32::NAN;
    assert!(measure(&one_nan, &want).is_err(), "one NaN");
    let all_nan = host(1, 50257, vec![f32::NAN; 50257]);
    assert!(measure(&all_nan, &want).is_err(), "all NaN");
    assert!(measure(&want, &all_nan).is_err(), "NaN reference");
    let mut inf = want.clone();
    inf.data[0] = f32::INFINITY;
    assert!(measure(&inf, &want).is_err(), "an infinity");
    assert!(measure(&host(2, 3, vec![0.0; 6]), &host(3, 2, vec![0.0; 6])).is_err(), "shape");
    // Just inside the bounds passes: f32 rounding noise.
    let mut noise = want.clone();
    noise.data.iter_mut().for_each(|v| *v *= 1.0 + 1e-7);
    assert!(measure(&noise, &want).is_ok());
}

/// Worst (NMSE, max relative error) per op.
type Worst = Vec<(&'static str, (f64, f64))>;

/// Runs every op of `b` against the reference; returns the worst (NMSE, max rel) per op.
/// `bf16_activations`: the backend multiplies its bf16 weights by activations rounded to
/// bf16 (the AVX512-BF16 path), so the reference's weight products are fed them rounded
/// too and the f32 bounds still apply.
fn parity_suite<B: Backend>(b: &B, wdtype: WeightDtype, kv_f16: bool, bf16_activations: bool) -> Worst {
    let r = ReferenceBackend;
    let mut rng = Rng::new(42);
    let mut worst: Worst = Vec::new();
    let mut note = |op: &'static str, e: (f64, f64)| match worst.iter_mut().find(|(o, _)| *o == op) {
        Some(w) => w.1 = (w.1.0.max(e.0), w.1.1.max(e.1)),
        None => worst.push((op, e)),
    };
    let read = |a: &B::Act| b.read(a).unwrap();

    // linear / linear_gelu: GEMV rows (1..4), GEMM rows, KC edges, partial panels.
    let shapes = [
        (1, 1, 1),
        (1, 3, 17),
        (2, 17, 63),
        (3, 63, 65),
        (4, 65, 3),
        (5, 257, 33),
        (1, 768, 2304),
        (1, 3072, 768),
        (6, 513, 100),
        (9, 769, 40),
        (8, 1537, 20),
        (7, 768, 17),
        (13, 300, 1000),
        (512, 64, 65),
        (512, 768, 768),
        (1, 768, 50257),
    ];
    for (i, &(t, n_in, n_out)) in shapes.iter().enumerate() {
        let scale = [1e-3f32, 1.0, 1e3][i % 3];
        let x = host(t, n_in, normal(&mut rng, t * n_in, scale));
        let xr = if bf16_activations { host(t, n_in, round_to(WeightDtype::BF16, &x.data)) } else { x.clone() };
        let w = round_to(wdtype, &normal(&mut rng, n_in * n_out, 1.0 / (n_in as f32).sqrt()));
        let bias = normal(&mut rng, n_out, scale);
        for layout in [MatrixLayout::InOut, MatrixLayout::OutIn] {
            let shape = if layout == MatrixLayout::InOut { [n_in, n_out] } else { [n_out, n_in] };
            let wt = tensor(&shape, &w);
            let bt = tensor(&[n_out], &bias);
            let (wb, wr) = (b.load_matrix(&view(&wt), layout).unwrap(), r.load_matrix(&view(&wt), layout).unwrap());
            let (bb, br) = (b.load_vector(&view(&bt)).unwrap(), r.load_vector(&view(&bt)).unwrap());
            let xb = b.upload(&x);
            let what = format!("linear T={t} {n_in}->{n_out} {layout:?} scale {scale}");
            note("linear", compare(&what, &read(&b.linear(&xb, &wb, Some(&bb))), &r.linear(&xr, &wr, Some(&br))));
            note("linear (no bias)", compare(&what, &read(&b.linear(&xb, &wb, None)), &r.linear(&xr, &wr, None)));
            let mut want = r.linear(&xr, &wr, Some(&br));
            r.gelu(&mut want);
            note("linear_gelu", compare(&format!("gelu {what}"), &read(&b.linear_gelu(&xb, &wb, Some(&bb))), &want));
        }
    }

    // GELU alone, including 1e2..1e3 pre-activations (a tanh/exp overflow turns these into NaN).
    for (n, scale) in [(1, 1.0), (17, 1e3), (3072, 1e2), (4099, 3.0)] {
        let x = host(1, n, normal(&mut rng, n, scale));
        let mut got = b.upload(&x);
        b.gelu(&mut got);
        let mut want = x.clone();
        r.gelu(&mut want);
        note("gelu", compare(&format!("gelu n={n} scale {scale}"), &read(&got), &want));
    }

    // LayerNorm, and the fused residual add + LayerNorm.
    for (t, c, scale) in [(1, 1, 1.0), (3, 17, 1e-3), (5, 63, 1e3), (1, 768, 1.0), (512, 65, 10.0), (2, 1600, 1e2)] {
        let x = host(t, c, normal(&mut rng, t * c, scale));
        let y = host(t, c, normal(&mut rng, t * c, scale));
        let (g, s) = (tensor(&[c], &normal(&mut rng, c, 1.0)), tensor(&[c], &normal(&mut rng, c, 1.0)));
        let (gb, sb) = (b.load_vector(&view(&g)).unwrap(), b.load_vector(&view(&s)).unwrap());
        let (gr, sr) = (r.load_vector(&view(&g)).unwrap(), r.load_vector(&view(&s)).unwrap());
        let what = format!("layer_norm T={t} C={c} scale {scale}");
        note(
            "layer_norm",
            compare(&what, &read(&b.layer_norm(&b.upload(&x), &gb, &sb, 1e-5)), &r.layer_norm(&x, &gr, &sr, 1e-5)),
        );
        let mut xb = b.upload(&x);
        let got = b.add_layer_norm(&mut xb, &b.upload(&y), &gb, &sb, 1e-5);
        let mut xr = x.clone();
        r.add(&mut xr, &y);
        note("add_layer_norm", compare(&what, &read(&got), &r.layer_norm(&xr, &gr, &sr, 1e-5)));
        note("add", compare(&format!("add {what}"), &read(&xb), &xr));
    }

    // Embedding gather and row selection.
    for (v, c) in [(50, 17), (1000, 768)] {
        let table = tensor(&[v, c], &round_to(wdtype, &normal(&mut rng, v * c, 1.0)));
        let (tb, tr) = (
            b.load_matrix(&view(&table), MatrixLayout::OutIn).unwrap(),
            r.load_matrix(&view(&table), MatrixLayout::OutIn).unwrap(),
        );
        let ids = [0u32, (v - 1) as u32, 7, 7, 3];
        note("embed", compare("embed", &read(&b.embed(&tb, &ids)), &r.embed(&tr, &ids)));
        let x = host(5, c, normal(&mut rng, 5 * c, 1.0));
        note(
            "select_rows",
            compare("select_rows", &read(&b.select_rows(&b.upload(&x), &[4, 0, 2])), &r.select_rows(&x, &[4, 0, 2])),
        );
    }

    // Attention: prefill, decode steps at growing positions, and a mixed batch of two
    // sequences, with head sizes 64 and odd ones.
    for (n_head, hd, scale) in [(4, 16, 1.0), (3, 17, 10.0), (12, 64, 1.0), (25, 64, 0.1)] {
        let c = n_head * hd;
        let cap = 40;
        let (mut kb1, mut kb2) = (b.new_kv_cache(2, cap, c).unwrap(), b.new_kv_cache(2, cap, c).unwrap());
        let (mut kr1, mut kr2) = (r.new_kv_cache(2, cap, c).unwrap(), r.new_kv_cache(2, cap, c).unwrap());
        let steps: [(&[SeqSlice], usize); 5] = [
            (&[SeqSlice { rows: 0..17, start_pos: 0 }, SeqSlice { rows: 17..20, start_pos: 0 }], 20),
            (&[SeqSlice { rows: 0..1, start_pos: 17 }, SeqSlice { rows: 1..2, start_pos: 3 }], 2),
            (&[SeqSlice { rows: 0..1, start_pos: 18 }, SeqSlice { rows: 1..6, start_pos: 4 }], 6),
            (&[SeqSlice { rows: 0..0, start_pos: 19 }, SeqSlice { rows: 0..1, start_pos: 9 }], 1),
            // A chunked-prefill continuation (matmul-shaped path, keys before the chunk).
            (&[SeqSlice { rows: 0..20, start_pos: 19 }, SeqSlice { rows: 20..21, start_pos: 10 }], 21),
        ];
        for (seqs, t) in steps {
            let qkv = host(t, 3 * c, normal(&mut rng, t * 3 * c, scale));
            let mut want_in = qkv.clone();
            if kv_f16 {
                // The reference sees the keys and values the f16 cache will hold.
                for row in want_in.data.chunks_mut(3 * c) {
                    let kv = round_to(WeightDtype::F16, &row[c..]);
                    row[c..].copy_from_slice(&kv);
                }
            }
            for layer in 0..2 {
                let spec = AttentionSpec::multi_head(c, n_head, 1.0 / (hd as f32).sqrt());
                let got = b.attention(&b.upload(&qkv), seqs, &mut [&mut kb1, &mut kb2], layer, &spec).unwrap();
                let want = r.attention(&want_in, seqs, &mut [&mut kr1, &mut kr2], layer, &spec).unwrap();
                note("attention", compare(&format!("attention heads {n_head}x{hd} T={t}"), &read(&got), &want));
            }
        }
    }

    // Prefix-cache copies: positions 0..13 of a 20-position prefill, copied into a cache
    // of another capacity, attend exactly like a cache that prefilled those 13 itself;
    // misfit copies are errors.
    for (n_head, hd) in [(4, 16), (3, 6)] {
        let c = n_head * hd;
        let spec = AttentionSpec::multi_head(c, n_head, 0.3);
        let prompt = host(20, 3 * c, normal(&mut rng, 20 * 3 * c, 1.0));
        let (mut full, mut copied, mut own) =
            (b.new_kv_cache(2, 40, c).unwrap(), b.new_kv_cache(2, 24, c).unwrap(), b.new_kv_cache(2, 14, c).unwrap());
        let head = host(13, 3 * c, prompt.data[..13 * 3 * c].to_vec());
        for layer in 0..2 {
            b.attention(&b.upload(&prompt), &[SeqSlice { rows: 0..20, start_pos: 0 }], &mut [&mut full], layer, &spec)
                .unwrap();
            b.attention(&b.upload(&head), &[SeqSlice { rows: 0..13, start_pos: 0 }], &mut [&mut own], layer, &spec)
                .unwrap();
        }
        b.copy_kv_prefix(&full, &mut copied, 13, hd).unwrap();
        let next = host(1, 3 * c, normal(&mut rng, 3 * c, 1.0));
        for layer in 0..2 {
            let seq = [SeqSlice { rows: 0..1, start_pos: 13 }];
            let a = read(&b.attention(&b.upload(&next), &seq, &mut [&mut copied], layer, &spec).unwrap());
            let o = read(&b.attention(&b.upload(&next), &seq, &mut [&mut own], layer, &spec).unwrap());
            assert!(
                a.data.iter().zip(&o.data).all(|(x, y)| x.to_bits() == y.to_bits()),
                "{}: attention over a copied prefix differs from its own prefill (heads {n_head}x{hd})",
                b.name()
            );
        }
        assert!(b.copy_kv_prefix(&full, &mut copied, 25, hd).is_err(), "a copy past the capacity");
        let mut narrow = b.new_kv_cache(2, 24, c - hd).unwrap();
        assert!(b.copy_kv_prefix(&full, &mut narrow, 3, hd).is_err(), "a copy between widths");
        assert!(b.copy_kv_prefix(&full, &mut copied, 3, hd + 1).is_err(), "a head size that does not divide");
    }

    // The Llama ops: every backend has them.
    let probe = AttentionSpec {
        n_head: 2,
        n_kv_head: 1,
        head_dim: 2,
        scale: 1.0,
        rope: Some(Rope::new(1e4, RopeStyle::Halves)),
        window: None,
    };
    if let Err(e) = b.supports(&probe) {
        panic!("{} refuses the Llama ops (RMSNorm, SwiGLU, RoPE, grouped-query attention): {e}", b.name());
    }

    // RMSNorm, and the fused residual add + RMSNorm.
    for (t, c, scale) in [(1, 1, 1.0), (3, 17, 1e-3), (5, 63, 1e3), (1, 576, 1.0), (512, 65, 10.0), (2, 1600, 1e2)] {
        let x = host(t, c, normal(&mut rng, t * c, scale));
        let y = host(t, c, normal(&mut rng, t * c, scale));
        let g = tensor(&[c], &normal(&mut rng, c, 1.0));
        let (gb, gr) = (b.load_vector(&view(&g)).unwrap(), r.load_vector(&view(&g)).unwrap());
        let what = format!("rms_norm T={t} C={c} scale {scale}");
        note("rms_norm", compare(&what, &read(&b.rms_norm(&b.upload(&x), &gb, 1e-5)), &r.rms_norm(&x, &gr, 1e-5)));
        let mut xb = b.upload(&x);
        let got = b.add_rms_norm(&mut xb, &b.upload(&y), &gb, 1e-6);
        let mut xr = x.clone();
        r.add(&mut xr, &y);
        note("add_rms_norm", compare(&what, &read(&got), &r.rms_norm(&xr, &gr, 1e-6)));
    }

    // SwiGLU, including gates of ±1e3 (an exp overflow turns silu into NaN).
    for (t, f, scale) in [(1, 1, 1.0), (3, 17, 1e3), (5, 1536, 1e2), (512, 65, 3.0), (2, 4099, 10.0)] {
        let x = host(t, 2 * f, normal(&mut rng, t * 2 * f, scale));
        note(
            "swiglu",
            compare(&format!("swiglu T={t} F={f} scale {scale}"), &read(&b.swiglu(&b.upload(&x))), &r.swiglu(&x)),
        );
    }

    // Grouped-query attention with RoPE (both pair layouts, several bases, Llama 3's and
    // linear scaling), prefill, decode and chunked prefill over two sequences; then
    // positions near 8192.
    let llama3 =
        RopeScaling::Llama3 { factor: 32.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_context: 8192.0 };
    let specs = [
        (4, 2, 16, 1e4, RopeStyle::Adjacent, RopeScaling::None),
        (9, 3, 64, 1e5, RopeStyle::Halves, RopeScaling::None),
        (3, 1, 18, 5e5, RopeStyle::Halves, RopeScaling::None),
        (6, 6, 32, 1e4, RopeStyle::Adjacent, RopeScaling::None),
        (8, 2, 64, 5e5, RopeStyle::Adjacent, llama3),
        (4, 4, 16, 1e6, RopeStyle::Halves, RopeScaling::Linear { factor: 8.0 }),
        // The first spec's base and head size with scaling: a table cached by base alone fails.
        (4, 2, 16, 1e4, RopeStyle::Adjacent, RopeScaling::Linear { factor: 4.0 }),
    ];
    for (n_head, n_kv_head, head_dim, theta, style, scaling) in specs {
        let freq_factors = scaling.freq_factors(theta, head_dim).map(Into::into);
        let spec = AttentionSpec {
            n_head,
            n_kv_head,
            head_dim,
            scale: 1.0 / (head_dim as f32).sqrt(),
            rope: Some(Rope { theta, style, freq_factors }),
            window: None,
        };
        let (w, kw) = (spec.qkv_width(), spec.kv_width());
        for (cap, steps) in [
            (
                40,
                vec![
                    (vec![SeqSlice { rows: 0..17, start_pos: 0 }, SeqSlice { rows: 17..20, start_pos: 0 }], 20),
                    (vec![SeqSlice { rows: 0..1, start_pos: 17 }, SeqSlice { rows: 1..2, start_pos: 3 }], 2),
                    (vec![SeqSlice { rows: 0..20, start_pos: 18 }, SeqSlice { rows: 20..21, start_pos: 4 }], 21),
                ],
            ),
            (
                8200,
                vec![(vec![SeqSlice { rows: 0..18, start_pos: 8000 }, SeqSlice { rows: 18..19, start_pos: 8190 }], 19)],
            ),
        ] {
            let (mut kb1, mut kb2) = (b.new_kv_cache(1, cap, kw).unwrap(), b.new_kv_cache(1, cap, kw).unwrap());
            let (mut kr1, mut kr2) = (r.new_kv_cache(1, cap, kw).unwrap(), r.new_kv_cache(1, cap, kw).unwrap());
            for (seqs, t) in steps {
                let qkv = host(t, w, normal(&mut rng, t * w, 1.0));
                let got = b.attention(&b.upload(&qkv), &seqs, &mut [&mut kb1, &mut kb2], 0, &spec).unwrap();
                let want = if kv_f16 {
                    // The reference sees the rotated keys and values the f16 cache holds.
                    let mut rotated = qkv.clone();
                    for s in &seqs {
                        for (i, row) in s.rows.clone().enumerate() {
                            rope_row(
                                &spec,
                                spec.rope.as_ref().unwrap(),
                                &mut rotated.data[row * w..(row + 1) * w],
                                s.start_pos + i,
                            );
                        }
                    }
                    for row in rotated.data.chunks_mut(w) {
                        let kv = round_to(WeightDtype::F16, &row[spec.q_width()..]);
                        row[spec.q_width()..].copy_from_slice(&kv);
                    }
                    let plain = AttentionSpec { rope: None, ..spec };
                    r.attention(&rotated, &seqs, &mut [&mut kr1, &mut kr2], 0, &plain).unwrap()
                } else {
                    r.attention(&qkv, &seqs, &mut [&mut kr1, &mut kr2], 0, &spec).unwrap()
                };
                let what = format!(
                    "gqa+rope {n_head}/{n_kv_head}x{head_dim} base {theta} {style:?} T={t} pos {}",
                    seqs[0].start_pos
                );
                note("attention_rope_gqa", compare(&what, &read(&got), &want));
            }
        }
    }

    // The Gemma 3 ops: GeGLU, scaling, per-head q/k RMSNorm.
    for (t, f, scale) in [(1, 1, 1.0), (3, 17, 1e3), (5, 1536, 1e2), (512, 65, 3.0), (2, 4099, 10.0)] {
        let x = host(t, 2 * f, normal(&mut rng, t * 2 * f, scale));
        let what = format!("geglu T={t} F={f} scale {scale}");
        note("geglu", compare(&what, &read(&b.geglu(&b.upload(&x))), &r.geglu(&x)));
        let mut xb = b.upload(&x);
        b.scale(&mut xb, 25.298221);
        let mut xr = x.clone();
        r.scale(&mut xr, 25.298221);
        note("scale", compare(&what, &read(&xb), &xr));
    }
    for (t, n_head, n_kv_head, hd, scale) in [(1, 4, 1, 256, 1.0), (3, 3, 3, 18, 1e3), (70, 8, 2, 64, 1e-2)] {
        let spec = AttentionSpec { n_head, n_kv_head, head_dim: hd, scale: 1.0, rope: None, window: None };
        let w = spec.qkv_width();
        let x = host(t, w, normal(&mut rng, t * w, scale));
        let (gq, gk) = (tensor(&[hd], &normal(&mut rng, hd, 1.0)), tensor(&[hd], &normal(&mut rng, hd, 1.0)));
        let (qb, kb) = (b.load_vector(&view(&gq)).unwrap(), b.load_vector(&view(&gk)).unwrap());
        let (qr, kr) = (r.load_vector(&view(&gq)).unwrap(), r.load_vector(&view(&gk)).unwrap());
        let mut xb = b.upload(&x);
        b.qk_norm(&mut xb, &spec, &qb, &kb, 1e-6).unwrap();
        let mut xr = x.clone();
        r.qk_norm(&mut xr, &spec, &qr, &kr, 1e-6).unwrap();
        // The values pass through untouched.
        assert_eq!(&xr.data[spec.q_width() + spec.kv_width()..w], &x.data[spec.q_width() + spec.kv_width()..w]);
        note("qk_norm", compare(&format!("qk_norm T={t} {n_head}/{n_kv_head}x{hd}"), &read(&xb), &xr));
        assert!(
            b.qk_norm(&mut xb, &spec, &kb, &b.load_vector(&view(&tensor(&[3], &[1.0; 3]))).unwrap(), 1e-6).is_err()
        );
    }

    // Sliding-window attention: windows of 1, 5 and 16 keys over a prefill longer than the
    // window (the blocked path from 16 rows), decode steps and a chunked prefill across
    // the window's edge, and positions near 8192.
    for window in [1, 5, 16] {
        let spec = AttentionSpec {
            n_head: 4,
            n_kv_head: 1,
            head_dim: 32,
            scale: 0.25,
            rope: Some(Rope::new(1e4, RopeStyle::Halves)),
            window: Some(window),
        };
        let (w, kw) = (spec.qkv_width(), spec.kv_width());
        let steps = [
            (vec![SeqSlice { rows: 0..30, start_pos: 0 }, SeqSlice { rows: 30..33, start_pos: 0 }], 33),
            (vec![SeqSlice { rows: 0..1, start_pos: 30 }, SeqSlice { rows: 1..2, start_pos: 3 }], 2),
            (vec![SeqSlice { rows: 0..20, start_pos: 31 }, SeqSlice { rows: 20..21, start_pos: 4 }], 21),
        ];
        let (mut kb1, mut kb2) = (b.new_kv_cache(1, 60, kw).unwrap(), b.new_kv_cache(1, 60, kw).unwrap());
        let (mut kr1, mut kr2) = (r.new_kv_cache(1, 60, kw).unwrap(), r.new_kv_cache(1, 60, kw).unwrap());
        let plain = AttentionSpec { rope: None, ..spec.clone() };
        for (seqs, t) in steps {
            let mut qkv = host(t, w, normal(&mut rng, t * w, 1.0));
            if kv_f16 {
                // Keys and values the f16 cache holds exactly: no RoPE, values rounded.
                for row in qkv.data.chunks_mut(w) {
                    let kv = round_to(WeightDtype::F16, &row[spec.q_width()..]);
                    row[spec.q_width()..].copy_from_slice(&kv);
                }
            }
            let spec = if kv_f16 { &plain } else { &spec };
            let got = b.attention(&b.upload(&qkv), &seqs, &mut [&mut kb1, &mut kb2], 0, spec).unwrap();
            let want = r.attention(&qkv, &seqs, &mut [&mut kr1, &mut kr2], 0, spec).unwrap();
            let what = format!("window {window} T={t} pos {}", seqs[0].start_pos);
            note("attention_window", compare(&what, &read(&got), &want));
        }
    }

    // Sliding-window layers stored as rings of `slots` positions: the same outputs as whole
    // caches, bit for bit where the backend computes each row the same way (a slice under
    // 16 rows, or one the ring takes whole: the cpu's matmul-shaped prefill then packs the
    // same window of keys from either), and within the f32 bound of the reference
    // everywhere. Slices longer than a
    // ring takes at once go in pieces; three slots past the window (pieces of 4 rows),
    // 19 (pieces of 20: the cpu's matmul-shaped path over a wrapped ring) and none
    // (pieces of 1 row, w = 1) test that.
    for (window, slots) in [(5, 8), (5, 24), (1, 1)] {
        let spec = AttentionSpec {
            n_head: 4,
            n_kv_head: 2,
            head_dim: 16,
            scale: 0.25,
            rope: Some(Rope::new(1e4, RopeStyle::Halves)),
            window: Some(window),
        };
        let plain = AttentionSpec { rope: None, ..spec.clone() };
        let spec = if kv_f16 { &plain } else { &spec };
        let (w, kw, cap) = (spec.qkv_width(), spec.kv_width(), 80);
        let ring = KvLayout { capacity: cap, width: kw, slots: vec![slots], windows: vec![Some(window)] };
        let (mut rb1, mut rb2) = (b.new_kv_cache_in(&ring).unwrap(), b.new_kv_cache_in(&ring).unwrap());
        let (mut fb1, mut fb2) = (b.new_kv_cache(1, cap, kw).unwrap(), b.new_kv_cache(1, cap, kw).unwrap());
        let (mut fr1, mut fr2) = (r.new_kv_cache(1, cap, kw).unwrap(), r.new_kv_cache(1, cap, kw).unwrap());
        assert!(rb1.rings().is_ring(0) && !fb1.rings().is_ring(0));
        let mut steps = vec![
            vec![SeqSlice { rows: 0..13, start_pos: 0 }, SeqSlice { rows: 13..14, start_pos: 0 }],
            vec![SeqSlice { rows: 0..20, start_pos: 13 }, SeqSlice { rows: 20..22, start_pos: 1 }],
        ];
        for i in 0..12 {
            steps.push(vec![SeqSlice { rows: 0..1, start_pos: 33 + i }, SeqSlice { rows: 1..2, start_pos: 3 + i }]);
        }
        steps.push(vec![SeqSlice { rows: 0..0, start_pos: 45 }, SeqSlice { rows: 0..30, start_pos: 15 }]);
        for seqs in &steps {
            let t = seqs.last().unwrap().rows.end;
            let mut qkv = host(t, w, normal(&mut rng, t * w, 1.0));
            if kv_f16 {
                for row in qkv.data.chunks_mut(w) {
                    let kv = round_to(WeightDtype::F16, &row[spec.q_width()..]);
                    row[spec.q_width()..].copy_from_slice(&kv);
                }
            }
            let x = b.upload(&qkv);
            let got = read(&b.attention(&x, seqs, &mut [&mut rb1, &mut rb2], 0, spec).unwrap());
            let whole = read(&b.attention(&x, seqs, &mut [&mut fb1, &mut fb2], 0, spec).unwrap());
            let want = r.attention(&qkv, seqs, &mut [&mut fr1, &mut fr2], 0, spec).unwrap();
            let what = format!("window {window} in {slots} slots, slices {seqs:?}");
            note("attention_ring", compare(&what, &got, &want));
            if seqs.iter().all(|s| s.rows.len() < 16 || s.rows.len() <= slots + 1 - window) {
                assert!(
                    got.data.iter().zip(&whole.data).all(|(a, b)| a.to_bits() == b.to_bits()),
                    "{what}: ring ≠ whole"
                );
            }
        }
        // The ring of the first sequence (45 positions) no longer holds position 30's window.
        let qkv = b.upload(&host(1, w, normal(&mut rng, w, 1.0)));
        let held = rb1.rings().held_from(0);
        assert_eq!(held, 45 - slots, "window {window} in {slots} slots");
        if window > 1 {
            let back = SeqSlice { rows: 0..1, start_pos: held + window - 2 };
            let e = b.attention(&qkv, &[back], &mut [&mut rb1], 0, spec).err().expect("overwritten keys read");
            assert!(format!("{e:#}").contains("overwritten"), "{e:#}");
        }
        // A copy continues where the ring left off, into a ring or a whole cache alike.
        let (mut copy_ring, mut copy_whole) = (b.new_kv_cache_in(&ring).unwrap(), b.new_kv_cache(1, cap, kw).unwrap());
        b.copy_kv_prefix(&rb2, &mut copy_ring, 45, spec.head_dim).unwrap();
        b.copy_kv_prefix(&rb2, &mut copy_whole, 45, spec.head_dim).unwrap();
        let next = [SeqSlice { rows: 0..1, start_pos: 45 }];
        let a = read(&b.attention(&qkv, &next, &mut [&mut rb2], 0, spec).unwrap());
        for c in [&mut copy_ring, &mut copy_whole] {
            let got = read(&b.attention(&qkv, &next, &mut [c], 0, spec).unwrap());
            assert!(got.data.iter().zip(&a.data).all(|(x, y)| x.to_bits() == y.to_bits()), "copy of a ring");
        }
        // A whole cache's positions before the ring's are not in the ring: copying 45
        // positions into a ring keeps the last `slots` of them.
        let mut into_ring = b.new_kv_cache_in(&ring).unwrap();
        b.copy_kv_prefix(&fb2, &mut into_ring, 45, spec.head_dim).unwrap();
        assert_eq!(into_ring.rings().held_from(0), 45 - slots);
    }
    worst
}

fn run(opts: CpuOptions) {
    let b = CpuBackend::new(opts).unwrap();
    let wdtype = opts.weight_dtype.unwrap_or(WeightDtype::F32);
    let worst =
        parity_suite(&b, wdtype, opts.kv_dtype == KvDtype::F16, opts.isa.has_bf16() && wdtype == WeightDtype::BF16);
    eprintln!("{:?} {:?} kv={}: worst (NMSE, max rel) per op {worst:?}", opts.isa, wdtype, opts.kv_dtype);
}

fn opts(isa: Isa, dtype: WeightDtype, kv_f16: bool) -> CpuOptions {
    CpuOptions {
        weight_dtype: Some(dtype),
        kv_dtype: if kv_f16 { KvDtype::F16 } else { KvDtype::F32 },
        isa,
        batch_invariant: false,
    }
}

#[test]
fn reference_agrees_with_itself() {
    // The suite's own sanity: comparing the reference to itself gives exactly zero.
    let worst = parity_suite(&ReferenceBackend, WeightDtype::F32, false, false);
    assert!(worst.iter().all(|(_, e)| *e == (0.0, 0.0)), "{worst:?}");
}

#[test]
fn cpu_simd_f32() {
    let Some(isa) = avx2_or_skip() else { return };
    run(opts(isa, WeightDtype::F32, false));
}

#[test]
fn cpu_simd_f16_weights_and_f16_kv() {
    let Some(isa) = avx2_or_skip() else { return };
    run(opts(isa, WeightDtype::F16, true));
}

#[test]
fn cpu_simd_bf16_weights() {
    let Some(isa) = avx2_or_skip() else { return };
    run(opts(isa, WeightDtype::BF16, false));
}

#[test]
fn cpu_avx512_f32_f16_and_bf16() {
    for isa in [avx512_or_skip(), avx512_vnni_or_skip()].into_iter().flatten() {
        run(opts(isa, WeightDtype::F32, false));
        run(opts(isa, WeightDtype::F16, true));
        run(opts(isa, WeightDtype::BF16, false));
    }
}

/// bf16 weights meeting bf16-rounded activations in `vdpbf16ps` (AVX512-BF16), against
/// the reference fed the same rounded activations, at the f32 bounds.
#[test]
fn cpu_avx512_bf16_products() {
    let Some(isa) = avx512_bf16_or_skip() else { return };
    run(opts(isa, WeightDtype::BF16, false));
}

#[test]
fn cpu_portable_f32_and_f16() {
    run(opts(Isa::PORTABLE, WeightDtype::F32, false));
    run(opts(Isa::PORTABLE, WeightDtype::F16, true));
}

/// The GPU backend through the same suite with the same bounds: its kernels accumulate
/// in f32 like the CPU ones, only in another order. All three decode GEMV kernels run
/// (workgroup-memory, one-thread-per-column, and subgroup where the adapter has
/// subgroups), so the one a real GPU picks is checked here too; f16 weights and the f16 KV cache
/// (shader-f16) are checked against the reference fed the same f16-rounded values.
#[cfg(feature = "gpu")]
#[test]
fn gpu_every_kernel_variant() {
    use batch_forge::backend::gpu::{GemvKernel, GpuOptions};
    // (weights, decode GEMV, f16 KV cache)
    let variants = [
        (WeightDtype::F32, GemvKernel::Cooperative, false),
        (WeightDtype::F32, GemvKernel::Thread, false),
        (WeightDtype::F16, GemvKernel::Cooperative, true),
        (WeightDtype::F16, GemvKernel::Thread, false),
        (WeightDtype::F32, GemvKernel::Subgroup, false),
        (WeightDtype::F16, GemvKernel::Subgroup, false),
    ];
    let Some(probe) = common::gpu_backend(GpuOptions::default()) else { return };
    let has_f16 = common::gpu_f16_or_skip(&probe, "f16 weights and KV cache in the parity suite");
    let has_sg = common::gpu_subgroups_or_skip(&probe, "the subgroup GEMV in the parity suite");
    drop(probe);
    for (dtype, gemv, kv_f16) in variants {
        if (dtype == WeightDtype::F16 || kv_f16) && !has_f16 || gemv == GemvKernel::Subgroup && !has_sg {
            continue;
        }
        let o = GpuOptions {
            weight_dtype: Some(dtype),
            gemv,
            kv_dtype: if kv_f16 { KvDtype::F16 } else { KvDtype::F32 },
            ..Default::default()
        };
        let Some(b) = common::gpu_backend(o) else { return };
        let worst = parity_suite(&b, dtype, kv_f16, false);
        eprintln!("gpu {dtype:?} weights, {gemv:?} gemv, kv_f16={kv_f16}: worst (NMSE, max rel) per op {worst:?}");
    }
}

/// Random GGUF blocks of `ty` for an `[n_out, n_in]` matrix ([`random_blocks_any`]),
/// Q8_0 without the quant -128, which llama.cpp's quantizer never writes.
fn random_blocks(rng: &mut Rng, ty: batch_forge::loaders::gguf::GgmlType, n_out: usize, n_in: usize) -> Vec<u8> {
    let mut out = random_blocks_any(rng, ty, n_out, n_in);
    if ty == batch_forge::loaders::gguf::GgmlType::Q8_0 {
        for blk in out.chunks_mut(34) {
            blk[2..].iter_mut().filter(|b| **b == 0x80).for_each(|b| *b = 0x81);
        }
    }
    out
}

/// The quantized kernels (GGUF Q8_0/Q4_0/Q4_1/Q6_K blocks × activations quantized to 8-bit
/// blocks) against an independent f64 evaluation of the same block formula from the raw
/// bytes, on both ISAs, awkward shapes (partial panels of 16 rows, one block per row, decode
/// and prefill row counts) and activation magnitudes from 1e-3 to 1e3. The integer sums
/// are exact, so only f32 accumulation separates them: bound 1e-5 of Σ|block terms|.
/// Also: the activation quantizer meets its definition, and the embedding lookup of a
/// quantized table equals gguf-py's dequantization bit for bit. On a two-thread pool, so
/// batched decode (17 and 32 rows over three panels of 16) runs on the thread team, each
/// thread's run of panels checked here independently of the dispatch code.
#[test]
fn quantized_linear_matches_block_arithmetic() {
    rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap()
        .install(quantized_linear_matches_block_arithmetic_on_this_pool);
}

fn quantized_linear_matches_block_arithmetic_on_this_pool() {
    use batch_forge::backend::cpu::qmatmul::{Q8Rows, QK, quantize_rows};
    use batch_forge::loaders::gguf::GgmlType;
    let mut rng = Rng::new(77);
    let f16v = |b: &[u8], i: usize| half::f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32() as f64;
    for isa in isas_or_skip() {
        let b = CpuBackend::new(CpuOptions { weight_dtype: None, kv_dtype: KvDtype::F32, isa, batch_invariant: false })
            .unwrap();
        for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q6K] {
            for (n_out, n_in, t, scale) in [
                (1, 32, 1, 1.0),
                (3, 96, 2, 1e-3),
                (5, 576, 1, 1e3),
                (17, 1536, 5, 1.0),
                (49, 64, 33, 10.0),
                (4, 32, 4, 1.0),
                (40, 160, 17, 1.0),
                (48, 576, 32, 1e2),
                (40, 256, 17, 1e-2),
                (5, 768, 1, 1e3),
                (48, 512, 32, 1.0),
            ] {
                if ty == GgmlType::Q6K && n_in % 256 != 0 {
                    continue; // super-blocks of 256
                }
                let bytes = random_blocks(&mut rng, ty, n_out, n_in);
                let w = b.load_quantized("w", ty, n_out, n_in, &bytes).unwrap();
                let x = host(t, n_in, normal(&mut rng, t * n_in, scale));
                let got = b.read(&b.linear(&b.upload(&x), &w, None)).unwrap();
                let mut q8 = Q8Rows::default();
                quantize_rows(isa, &x.data, t, n_in, &mut q8);
                let nb = n_in / QK;
                let bs = bytes.len() / (n_out * nb); // per 32 values (Q6_K: unused)
                for r in 0..t {
                    for blk in 0..nb {
                        // The quantizer, llama.cpp's: d = amax / 127, q = roundf(x · (1/d))
                        // (half away from zero), stored d = f16(d), s = f16(d · Σq).
                        let xs = &x.data[r * n_in + blk * QK..r * n_in + (blk + 1) * QK];
                        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
                        let d = amax / 127.0;
                        let id = if d != 0.0 { 1.0 / d } else { 0.0 };
                        let want_q: Vec<i8> = xs.iter().map(|&v| (v * id).round() as i8).collect();
                        assert_eq!(&q8.q[r * n_in + blk * QK..r * n_in + (blk + 1) * QK], &want_q[..], "quantizer q");
                        assert_eq!(q8.d[r * nb + blk], half::f16::from_f32(d).to_f32(), "quantizer d");
                        let sum: i32 = want_q.iter().map(|&q| q as i32).sum();
                        assert_eq!(q8.s[r * nb + blk], half::f16::from_f32(d * sum as f32).to_f32(), "quantizer s");
                        let sum_lo: i32 = want_q[..16].iter().map(|&q| q as i32).sum();
                        assert_eq!((q8.sum[r * nb + blk], q8.sum_lo[r * nb + blk]), (sum, sum_lo), "quantizer sums");
                    }
                    for j in 0..n_out {
                        let (mut want, mut size) = (0f64, 0f64);
                        for blk in 0..nb {
                            let xq = &q8.q[r * n_in + blk * QK..r * n_in + (blk + 1) * QK];
                            let (dx, sx) = (q8.d[r * nb + blk] as f64, q8.s[r * nb + blk] as f64);
                            if ty == GgmlType::Q6K {
                                // Q6_K's layout read straight from the file's super-block:
                                // value u of half n = u / 128 takes a nibble of ql[64n + u % 64]
                                // (high for u % 128 ≥ 64) and bits 2·((u % 128) / 32) of
                                // qh[32n + u % 32]; w = d · scale[u / 16] · (q − 32).
                                let sb = &bytes[(j * nb / 8 + blk / 8) * 210..][..210];
                                let mut term = 0f64;
                                for (i, &xi) in xq.iter().enumerate() {
                                    let u = 32 * (blk % 8) + i;
                                    let (n, v) = (u / 128, u % 128);
                                    let low = sb[64 * n + v % 64] >> (4 * (v / 64)) & 15;
                                    let high = sb[128 + 32 * n + v % 32] >> (2 * (v / 32)) & 3;
                                    let q = (low | high << 4) as i64 - 32;
                                    let scale = sb[192 + u / 16] as i8 as i64;
                                    term += (scale * q * xi as i64) as f64;
                                }
                                let term = f16v(sb, 208) * dx * term;
                                want += term;
                                size += term.abs();
                                continue;
                            }
                            let wb = &bytes[(j * nb + blk) * bs..(j * nb + blk + 1) * bs];
                            let wq: Vec<i32> = match ty {
                                GgmlType::Q8_0 => wb[2..].iter().map(|&v| v as i8 as i32).collect(),
                                GgmlType::Q4_0 => {
                                    (0..32).map(|i| (wb[2 + i % 16] >> (4 * (i / 16)) & 15) as i32 - 8).collect()
                                }
                                _ => (0..32).map(|i| (wb[4 + i % 16] >> (4 * (i / 16)) & 15) as i32).collect(),
                            };
                            let isum: i64 = wq.iter().zip(xq).map(|(&a, &c)| a as i64 * c as i64).sum();
                            let mut term = f16v(wb, 0) * dx * isum as f64;
                            if ty == GgmlType::Q4_1 {
                                term += f16v(wb, 2) * sx;
                            }
                            want += term;
                            size += term.abs();
                        }
                        let g = got.data[r * n_out + j] as f64;
                        assert!(
                            (g - want).abs() <= 1e-5 * size + 1e-30,
                            "{ty:?} {} {n_out}x{n_in} T={t} scale {scale}: row {r} col {j}: {g} vs {want}",
                            isa.name()
                        );
                    }
                }
                // A NaN or infinite activation makes its outputs non-finite (never hidden).
                let mut bad = x.clone();
                bad.data[0] = if n_out % 2 == 0 { f32::NAN } else { f32::INFINITY };
                let out = b.read(&b.linear(&b.upload(&bad), &w, None)).unwrap();
                assert!(out.row(0).iter().all(|v| !v.is_finite()), "{ty:?}: {:?}", &out.row(0)[..n_out.min(4)]);
                // The embedding lookup of a quantized table is gguf-py's dequantization.
                let ids: Vec<u32> = (0..n_out as u32).rev().collect();
                let rows = b.read(&b.embed(&w, &ids)).unwrap();
                let all = batch_forge::quant::dequantize(ty, &bytes).unwrap();
                for (k, &id) in ids.iter().enumerate() {
                    let want = &all[id as usize * n_in..(id as usize + 1) * n_in];
                    assert!(
                        rows.row(k).iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{ty:?} embed row {id}"
                    );
                }
            }
        }
    }
}

/// The quantized kernels follow one order of arithmetic (see `qmatmul`'s module doc): the
/// AVX2 and AVX-512 VNNI kernels equal the portable path bit for bit, and each activation row's outputs are
/// the same bits whether it is multiplied alone (decode) or among others (prefill, chunks
/// of eight (VNNI), four (AVX2 Q8_0) or two (other AVX2 types) and remainders, on one
/// thread, rayon or the two-thread team): what the
/// server's batch invariance rests on.
#[test]
fn quantized_kernels_agree_bit_for_bit_whatever_the_rows() {
    rayon::ThreadPoolBuilder::new().num_threads(2).build().unwrap().install(quantized_kernels_agree_on_this_pool);
}

fn quantized_kernels_agree_on_this_pool() {
    use batch_forge::loaders::gguf::GgmlType;
    let fast_isas: Vec<Isa> = isas_or_skip().into_iter().filter(|&i| i != Isa::PORTABLE).collect();
    if fast_isas.is_empty() {
        return;
    }
    let mut rng = Rng::new(5);
    let backend = |isa| {
        CpuBackend::new(CpuOptions { weight_dtype: None, kv_dtype: KvDtype::F32, isa, batch_invariant: false }).unwrap()
    };
    let portable = backend(Isa::PORTABLE);
    let bits = |m: &HostMatrix| m.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
    for ty in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q4K, GgmlType::Q6K] {
        // Shapes: partial panels of 7, 13, 4 rows; rows in chunks of eight, then of four,
        // then 1-3 (VNNI; on AVX2 four at a time for Q8_0, else two): 5-7, 9, 11, 13, 14, 17, 33 rows;
        // (70, 512, 9) runs five panels on the thread team. Cases 5 and 9 have every
        // weight and activation at its extreme (Q8_0 -128, nibbles 15, q = ±127), case 9
        // with 11 rows (a chunk of eight, then three). Cases 6-8 end rows in a partial quad
        // of 3, 2 and 1 blocks (not for Q4_K's 256-wide super-blocks, always whole quads);
        // cases 10 and 14 have random f16 scales of any sign and size, subnormals and
        // zeros included (the SIMD paths widen them with `vcvtph2ps`, the portable one in
        // software). Cases 11-13 are batched decode: 17 and 32 rows (cases 11, 13) over
        // three panels of 16 (the first partial) on the thread team, and 33 rows (case 12)
        // past the team's limit (rayon); 15 and 16 run 13 and 14 rows (8 + 4 + 1, 8 + 4 + 2).
        for (case, (n_out, n_in, t, scale)) in [
            (7, 256, 7, 1.0),
            (13, 512, 6, 1e3),
            (4, 768, 9, 1e-3),
            (33, 256, 1, 10.0),
            (70, 512, 9, 1.0),
            (6, 256, 5, 1.0),
            (5, 96, 3, 1e2),
            (9, 576, 2, 1.0),
            (3, 160, 5, 1e-2),
            (5, 64, 11, 1.0),
            (7, 160, 4, 1.0),
            (40, 160, 17, 1.0),
            (50, 256, 33, 1.0),
            (48, 576, 32, 1.0),
            (7, 256, 4, 1.0),
            (21, 256, 13, 1.0),
            (9, 512, 14, 1e2),
        ]
        .into_iter()
        .enumerate()
        {
            if matches!(ty, GgmlType::Q4K | GgmlType::Q6K) && n_in % 256 != 0 {
                continue;
            }
            let odd_scales = case == 10 || case == 14; // 14: the k-quants' (256-wide)
            let extreme = case == 5 || case == 9;
            let mut bytes = if ty == GgmlType::Q4K {
                let mut b: Vec<u8> = (0..n_out * n_in / 256 * 144).map(|_| rng.next_u64() as u8).collect();
                for blk in b.chunks_mut(144) {
                    let d = half::f16::from_f32((rng.next_f64() as f32 + 0.05) * 0.002);
                    blk[..2].copy_from_slice(&d.to_bits().to_le_bytes());
                    blk[2..4].copy_from_slice(&d.to_bits().to_le_bytes());
                }
                b
            } else {
                random_blocks(&mut rng, ty, n_out, n_in)
            };
            if ty == GgmlType::Q6K {
                // Its d comes last; extremes: every q − 32 = −32, every scale −128 and (below)
                // every activation +127: the block's integer sum at its largest,
                // 2·128·16·32·127 < 2²⁴.
                for blk in bytes.chunks_mut(210) {
                    if odd_scales {
                        let r = rng.next_u64() as u16;
                        let bits = (r & 0x83FF) | ((r >> 10) % 15) << 10;
                        blk[208..].copy_from_slice(&bits.to_le_bytes());
                    }
                    if extreme {
                        blk[..192].fill(0);
                        blk[192..208].fill(0x80);
                    }
                }
            }
            // Q8_0 weights of -128 (llama.cpp never writes them; other writers may).
            let (bs, header) = match ty {
                GgmlType::Q8_0 => (34, 2),
                GgmlType::Q4_0 => (18, 2),
                GgmlType::Q4_1 => (20, 4),
                _ => (144, 16),
            };
            for blk in bytes.chunks_mut(bs).filter(|_| ty != GgmlType::Q6K) {
                if odd_scales {
                    // Sign and mantissa random, exponent 0 (zero or subnormal) to 14: finite.
                    for h in blk[..header].chunks_mut(2) {
                        let r = rng.next_u64() as u16;
                        let bits = (r & 0x83FF) | ((r >> 10) % 15) << 10;
                        h.copy_from_slice(&bits.to_le_bytes());
                    }
                }
                let quants = &mut blk[header..];
                if extreme {
                    quants.fill(if ty == GgmlType::Q8_0 { 0x80 } else { 0xFF });
                } else if ty == GgmlType::Q8_0 {
                    quants[rng.next_u64() as usize % 32] = 0x80;
                }
            }
            let x = if extreme && ty == GgmlType::Q6K {
                host(t, n_in, vec![scale; t * n_in])
            } else if extreme {
                host(t, n_in, (0..t * n_in).map(|i| if (i * 7) % 3 == 0 { -scale } else { scale }).collect())
            } else {
                host(t, n_in, normal(&mut rng, t * n_in, scale))
            };
            let run = |b: &CpuBackend, x: &HostMatrix| {
                let w = b.load_quantized("w", ty, n_out, n_in, &bytes).unwrap();
                b.read(&b.linear(&b.upload(x), &w, None)).unwrap()
            };
            let got_portable = run(&portable, &x);
            for &isa in &fast_isas {
                let fast = backend(isa);
                let got_fast = run(&fast, &x);
                let name = isa.name();
                assert!(got_fast.data.iter().all(|v| v.is_finite()), "{ty:?} {name}: non-finite outputs");
                assert_eq!(bits(&got_fast), bits(&got_portable), "{ty:?} {n_out}x{n_in} T={t}: {name} vs portable");
                for r in 0..t {
                    let alone = run(&fast, &host(1, n_in, x.row(r).to_vec()));
                    let want = bits(&host(1, n_out, got_fast.row(r).to_vec()));
                    assert_eq!(bits(&alone), want, "{ty:?} {name} row {r} alone");
                }
                // A row ending in a partial quad reads nothing past its last block: NaN in
                // the next row's first block leaves it the same bits.
                if n_in / 32 % 4 != 0 && t >= 2 {
                    let mut poisoned = x.clone();
                    poisoned.data[n_in..n_in + 32].fill(f32::NAN);
                    let got = run(&fast, &poisoned);
                    assert_eq!(
                        bits(&host(1, n_out, got.row(0).to_vec())),
                        bits(&host(1, n_out, got_fast.row(0).to_vec())),
                        "{ty:?} {name}: row 0 beside a NaN row"
                    );
                    assert!(got.row(1).iter().all(|v| v.is_nan()), "{ty:?} {name}: the NaN row");
                }
            }
        }
    }
}

/// Q4_K weights run on the Q4_1 kernel as sub-blocks `(d·scale)·q − dmin·min`: against an
/// f64 evaluation from the raw Q4_K bytes (6-bit scales and mins unpacked here, separately
/// from the loader), both ISAs, 1–3 super-blocks per row, partial panels, prefill and
/// decode; the embedding lookup equals gguf-py's dequantization bit for bit.
#[test]
fn q4_k_runs_as_exact_q4_1_sub_blocks() {
    use batch_forge::backend::cpu::qmatmul::{Q8Rows, QK, quantize_rows};
    use batch_forge::loaders::gguf::GgmlType;
    let mut rng = Rng::new(91);
    let f16v = |b: &[u8], i: usize| half::f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32() as f64;
    // Scale and min of sub-block j, 6 bits each (llama.cpp's get_scale_min_k4).
    let scale_min = |s: &[u8], j: usize| -> (f64, f64) {
        let (sc, m) = if j < 4 {
            (s[j] & 63, s[j + 4] & 63)
        } else {
            ((s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4), (s[j + 4] >> 4) | ((s[j] >> 6) << 4))
        };
        (sc as f64, m as f64)
    };
    for isa in isas_or_skip() {
        let b = CpuBackend::new(CpuOptions { weight_dtype: None, kv_dtype: KvDtype::F32, isa, batch_invariant: false })
            .unwrap();
        for (n_out, n_in, t, scale) in
            [(1, 256, 1, 1.0), (5, 512, 3, 1e3), (9, 768, 1, 1e-3), (6, 256, 17, 10.0), (37, 512, 5, 1.0)]
        {
            let mut bytes = vec![0u8; n_out * n_in / 256 * 144];
            for blk in bytes.chunks_mut(144) {
                blk.iter_mut().for_each(|b| *b = rng.next_u64() as u8);
                let d = half::f16::from_f32((rng.next_f64() as f32 + 0.05) * 0.002);
                let dmin = half::f16::from_f32((rng.next_f64() as f32 + 0.05) * 0.001);
                blk[..2].copy_from_slice(&d.to_bits().to_le_bytes());
                blk[2..4].copy_from_slice(&dmin.to_bits().to_le_bytes());
            }
            let w = b.load_quantized("w", GgmlType::Q4K, n_out, n_in, &bytes).unwrap();
            let x = host(t, n_in, normal(&mut rng, t * n_in, scale));
            let got = b.read(&b.linear(&b.upload(&x), &w, None)).unwrap();
            let mut q8 = Q8Rows::default();
            quantize_rows(isa, &x.data, t, n_in, &mut q8);
            let nb = n_in / QK;
            for r in 0..t {
                for j in 0..n_out {
                    let (mut want, mut size) = (0f64, 0f64);
                    for sb in 0..nb {
                        let blk = &bytes[(j * (n_in / 256) + sb / 8) * 144..][..144];
                        let sub = sb % 8;
                        let (sc, m) = scale_min(&blk[4..16], sub);
                        let q = |l: usize| {
                            let byte = blk[16 + sub / 2 * 32 + l];
                            (if sub % 2 == 0 { byte & 15 } else { byte >> 4 }) as i64
                        };
                        let xq = &q8.q[r * n_in + sb * QK..][..QK];
                        let isum: i64 = (0..QK).map(|l| q(l) * xq[l] as i64).sum();
                        let (dx, sx) = (q8.d[r * nb + sb] as f64, q8.s[r * nb + sb] as f64);
                        let term = f16v(blk, 0) * sc * dx * isum as f64 - f16v(blk, 2) * m * sx;
                        want += term;
                        size += term.abs();
                    }
                    let g = got.data[r * n_out + j] as f64;
                    assert!(
                        (g - want).abs() <= 1e-5 * size + 1e-30,
                        "q4_k {} {n_out}x{n_in} T={t}: row {r} col {j}: {g} vs {want}",
                        isa.name()
                    );
                }
            }
            let ids: Vec<u32> = (0..n_out as u32).rev().collect();
            let rows = b.read(&b.embed(&w, &ids)).unwrap();
            let all = batch_forge::quant::dequantize(GgmlType::Q4K, &bytes).unwrap();
            for (k, &id) in ids.iter().enumerate() {
                let want = &all[id as usize * n_in..(id as usize + 1) * n_in];
                assert!(rows.row(k).iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits()), "q4_k embed row {id}");
            }
        }
    }
}

/// Random whole blocks of any GGUF block format: random bytes (quants, packed scales,
/// high bits), then finite f16 scales where the format keeps them, so every value is
/// finite and of ordinary size.
fn random_blocks_any(rng: &mut Rng, ty: batch_forge::loaders::gguf::GgmlType, n_out: usize, n_in: usize) -> Vec<u8> {
    use batch_forge::loaders::gguf::GgmlType as G;
    let (bs, ts) = (ty.block_size() as usize, ty.type_size() as usize);
    let mut out = vec![0u8; n_out * n_in / bs * ts];
    rng_fill(rng, &mut out);
    let f16 = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
    for blk in out.chunks_mut(ts) {
        let d = (rng.next_f64() as f32 + 0.05) * 0.02;
        let m = (rng.next_f64() as f32 - 0.5) * 0.1;
        match ty {
            G::Q8_0 | G::Q4_0 | G::Q5_0 => blk[..2].copy_from_slice(&f16(d)),
            G::Q4_1 | G::Q5_1 => {
                blk[..2].copy_from_slice(&f16(d));
                blk[2..4].copy_from_slice(&f16(m));
            }
            // d · (6-bit scale) · q − dmin · (6-bit min).
            G::Q4K | G::Q5K => {
                blk[..2].copy_from_slice(&f16(d / 16.0));
                blk[2..4].copy_from_slice(&f16(m.abs() / 16.0));
            }
            G::Q6K => blk[208..210].copy_from_slice(&f16(d / 64.0)),
            other => panic!("no random blocks for {other:?}"),
        }
    }
    out
}

fn rng_fill(rng: &mut Rng, out: &mut [u8]) {
    for c in out.chunks_mut(8) {
        let v = rng.next_u64().to_le_bytes();
        c.copy_from_slice(&v[..c.len()]);
    }
}

/// Block-quantized weights resident on the GPU in their GGUF formats, decoded in the
/// kernels' registers: every format, every kernel (tiled matmul, the three decode GEMVs,
/// the batch-invariant path that takes the matmul for any row count) against the
/// reference fed the same blocks decoded to f32 (gguf-py's values), at the parity
/// suite's bounds; awkward shapes (one block per row, partial tiles and GEMV groups,
/// 1–8 decode rows, a 64-row tile edge) and activations from 1e-3 to 1e3. The
/// quantized embedding gather equals gguf-py's decoding bit for bit, and the device
/// holds the file's bytes, not a float copy.
#[cfg(feature = "gpu")]
#[test]
fn gpu_quantized_weights_every_format_and_kernel() {
    use batch_forge::backend::gpu::kernels::QUANT_FORMATS;
    use batch_forge::backend::gpu::{GemvKernel, GpuOptions};
    let variants = [
        ("cooperative gemv", GpuOptions { gemv: GemvKernel::Cooperative, ..Default::default() }),
        ("thread gemv", GpuOptions { gemv: GemvKernel::Thread, ..Default::default() }),
        ("subgroup gemv", GpuOptions { gemv: GemvKernel::Subgroup, ..Default::default() }),
        ("batch-invariant matmul", GpuOptions { batch_invariant: true, ..Default::default() }),
        // Weights split over many bindings (the path a model larger than one binding takes).
        ("chunks of 2 KiB", GpuOptions { chunk_bytes: Some(2048), ..Default::default() }),
        (
            "chunks of 2 KiB, matmul",
            GpuOptions { chunk_bytes: Some(2048), batch_invariant: true, ..Default::default() },
        ),
    ];
    let r = ReferenceBackend;
    let Some(probe) = common::gpu_backend(GpuOptions::default()) else { return };
    let has_sg = common::gpu_subgroups_or_skip(&probe, "the quantized subgroup GEMV");
    drop(probe);
    for (label, o) in variants {
        if o.gemv == GemvKernel::Subgroup && !has_sg {
            continue;
        }
        let Some(b) = common::gpu_backend(o) else { return };
        let mut rng = Rng::new(7);
        for (ty, name) in QUANT_FORMATS {
            let bs = ty.block_size() as usize;
            let mut worst = (0f64, 0f64);
            for (i, &(t, blocks, n_out)) in
                [(1, 1, 1), (1, 3, 67), (2, 2, 9), (3, 5, 130), (8, 4, 33), (5, 1, 257), (70, 3, 65), (9, 2, 300)]
                    .iter()
                    .enumerate()
            {
                let n_in = blocks * bs;
                let bytes = random_blocks_any(&mut rng, ty, n_out, n_in);
                let wb = b.load_quantized("w", ty, n_out, n_in, &bytes).unwrap();
                assert_eq!(wb.quant_type(), Some(ty), "{name}: kept in its blocks");
                let on_device = wb.device_bytes() as usize;
                match o.chunk_bytes {
                    None => assert_eq!(on_device, bytes.len().next_multiple_of(4), "{name}: device bytes"),
                    // Each chunk is padded to whole words.
                    Some(_) => assert!(on_device >= bytes.len() && on_device < bytes.len() + 4 * n_out, "{name}"),
                }
                let wr = r.load_quantized("w", ty, n_out, n_in, &bytes).unwrap();
                let scale = [1e-3f32, 1.0, 1e3][i % 3];
                let x = host(t, n_in, normal(&mut rng, t * n_in, scale));
                let bias = tensor(&[n_out], &normal(&mut rng, n_out, scale));
                let (bb, br) = (b.load_vector(&view(&bias)).unwrap(), r.load_vector(&view(&bias)).unwrap());
                let got = b.read(&b.linear(&b.upload(&x), &wb, Some(&bb))).unwrap();
                let what = format!("{label}: {name} linear T={t} {n_in}->{n_out} scale {scale}");
                let e = compare(&what, &got, &r.linear(&x, &wr, Some(&br)));
                worst = (worst.0.max(e.0), worst.1.max(e.1));
                // The gather decodes exactly what gguf-py decodes.
                let ids = [0u32, (n_out - 1) as u32, (n_out / 2) as u32, 0];
                let got = b.read(&b.embed(&wb, &ids)).unwrap();
                let all = batch_forge::quant::dequantize(ty, &bytes).unwrap();
                for (row, &id) in ids.iter().enumerate() {
                    let want = &all[id as usize * n_in..(id as usize + 1) * n_in];
                    let same = got.row(row).iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{label}: {name} embed row {id} differs from gguf-py's decoding");
                }
            }
            eprintln!("gpu {label}, {name}: worst (NMSE, max rel) {worst:?}");
        }
    }
}

/// The tiled matmul's two ways, whole and split over K's 256-value spans (what a decode
/// batch runs on a GPU), give every row the same bits whatever rows come with it: 70
/// rows whole are the truth, and 1, 3, 64 and 70 rows split, and 1 row whole, must
/// equal them bit for bit — f32, f16 (shader-f16) and block-quantized weights, with a
/// bias and with GELU, K from two spans to eight with ragged ends, activations from
/// 1e-3 to 1e3. The truth itself is within the parity bounds of the reference.
#[cfg(feature = "gpu")]
#[test]
fn gpu_matmul_split_or_whole_gives_the_same_bits() {
    use batch_forge::backend::gpu::{GpuBackend, GpuMatrix, GpuOptions};
    use batch_forge::loaders::gguf::GgmlType;
    let Some(probe) = common::gpu_backend(GpuOptions::default()) else { return };
    let has_f16 = common::gpu_f16_or_skip(&probe, "f16 weights in the split matmul");
    drop(probe);
    // Dense weights stored as `dtype`; block formats stay in their blocks (no dtype).
    let backend = |dtype: Option<WeightDtype>, split: bool, chunk_bytes: Option<u64>| {
        let o = GpuOptions {
            weight_dtype: dtype,
            batch_invariant: true,
            split_k: Some(split),
            chunk_bytes,
            ..Default::default()
        };
        common::gpu_backend(o).expect("the probe found an adapter")
    };
    let r = ReferenceBackend;
    let mut rng = Rng::new(11);
    // (dense dtype or block format, k, n)
    let cases: [(Result<WeightDtype, GgmlType>, usize, usize); 9] = [
        (Ok(WeightDtype::F32), 300, 67),
        (Ok(WeightDtype::F32), 1000, 130),
        (Ok(WeightDtype::F32), 1801, 70),
        (Ok(WeightDtype::F16), 777, 65),
        (Ok(WeightDtype::F16), 768, 66),
        (Err(GgmlType::Q8_0), 800, 67),
        (Err(GgmlType::Q4_0), 288, 129),
        (Err(GgmlType::Q4K), 1536, 65),
        (Err(GgmlType::Q6K), 512, 33),
    ];
    let (rows, pick) = (70, [(0..1), (5..8), (6..70), (0..70)]);
    for (i, &(kind, k, n)) in cases.iter().enumerate() {
        if kind == Ok(WeightDtype::F16) && !has_f16 {
            continue;
        }
        let scale = [1e-3f32, 1.0, 1e3][i % 3];
        let x = host(rows, k, normal(&mut rng, rows * k, scale));
        let bias = tensor(&[n], &normal(&mut rng, n, scale));
        let chunks = (i % 2 == 1).then_some(8192);
        let (whole, split) = (backend(kind.ok(), false, None), backend(kind.ok(), true, chunks));
        let (dense, blocks) = match kind {
            Ok(d) => (Some(tensor(&[n, k], &round_to(d, &normal(&mut rng, n * k, 1.0 / (k as f32).sqrt())))), None),
            Err(ty) => (None, Some(random_blocks_any(&mut rng, ty, n, k))),
        };
        let load = |b: &GpuBackend| -> GpuMatrix {
            let w = match (&dense, &blocks, kind) {
                (Some(w), _, _) => b.load_matrix(&view(w), MatrixLayout::OutIn).unwrap(),
                (_, Some(bytes), Err(ty)) => b.load_quantized("w", ty, n, k, bytes).unwrap(),
                _ => unreachable!(),
            };
            assert_eq!(w.quant_type(), kind.err(), "{kind:?}: the weights' form on the device");
            w
        };
        let wr = match (&dense, &blocks, kind) {
            (Some(w), _, _) => r.load_matrix(&view(w), MatrixLayout::OutIn).unwrap(),
            (_, Some(bytes), Err(ty)) => r.load_quantized("w", ty, n, k, bytes).unwrap(),
            _ => unreachable!(),
        };
        let br = r.load_vector(&view(&bias)).unwrap();
        for gelu in [false, true] {
            let what = format!("{kind:?} {k}->{n} scale {scale} gelu {gelu}");
            let run = |b: &GpuBackend, rows: std::ops::Range<usize>| -> HostMatrix {
                let (w, bb) = (load(b), b.load_vector(&view(&bias)).unwrap());
                let xs = host(rows.len(), k, x.data[rows.start * k..rows.end * k].to_vec());
                let xb = b.upload(&xs);
                let y = if gelu { b.linear_gelu(&xb, &w, Some(&bb)) } else { b.linear(&xb, &w, Some(&bb)) };
                b.read(&y).unwrap()
            };
            let truth = run(&whole, 0..rows);
            assert_eq!(whole.split_matmuls(), 0, "{what}: the whole side split");
            let mut want = r.linear(&x, &wr, Some(&br));
            if gelu {
                r.gelu(&mut want);
            }
            compare(&what, &truth, &want);
            let mut tries: Vec<_> = pick.iter().map(|p| ("split", &split, p.clone())).collect();
            tries.push(("whole", &whole, 3..4));
            for (way, b, p) in tries {
                let split_before = b.split_matmuls();
                let got = run(b, p.clone());
                assert_eq!(b.split_matmuls() > split_before, way == "split", "{what}: {way} ran the other way");
                assert_eq!((got.rows, got.cols), (p.len(), n), "{what}");
                for (j, row) in p.clone().enumerate() {
                    let same = got.row(j).iter().zip(truth.row(row)).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{what}: row {row} of {} rows {way} differs from the 70 rows whole", p.len());
                }
            }
        }
    }
}

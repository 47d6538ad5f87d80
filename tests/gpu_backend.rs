//! GPU-only checks beyond the shared parity suite (tests/backend_parity.rs): what only a
//! device backend can get wrong — extreme GELU inputs through the fused kernels, outputs
//! larger than one storage binding, greedy selection on the device, and errors that
//! must come back as errors rather than panics.
#![cfg(feature = "gpu")]

mod common;

use batch_forge::backend::WeightDtype;
use batch_forge::backend::gpu::{GpuBackend, GpuOptions};
use batch_forge::backend::reference::ReferenceBackend;
use batch_forge::backend::{
    AttentionSpec, Backend, HostMatrix, KvCache, KvShape, MatrixLayout, NON_FINITE_ROW, SeqSlice,
};
use batch_forge::compare::max_abs_diff;
use batch_forge::engine::sampler::{Rng, argmax};
use batch_forge::tensor::KvDtype;
use common::{tensor, view};

fn gpu() -> Option<GpuBackend> {
    common::gpu_backend(GpuOptions { weight_dtype: Some(WeightDtype::F32), ..Default::default() })
}

fn uniform(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| (rng.next_f64() as f32 * 2.0 - 1.0) * scale).collect()
}

/// GELU where a fast tanh overflows: up to ±3e38 (x³ is inf), in the standalone kernel
/// and fused into the matmul epilogue. Every output must be finite and equal the
/// reference's (gelu(x) = x for large positive x, -0 for large negative).
#[test]
fn gelu_survives_huge_pre_activations() {
    let Some(b) = gpu() else { return };
    let r = ReferenceBackend;
    let vals = [3e38f32, -3e38, 1e20, -1e20, 1e3, -1e3, 150.0, -150.0, 9.5, -9.5, 0.0, 1e-30];
    let x = HostMatrix { rows: 1, cols: vals.len(), data: vals.to_vec() };
    let mut got = b.upload(&x);
    b.gelu(&mut got);
    let got = b.read(&got).unwrap();
    let mut want = x.clone();
    r.gelu(&mut want);
    for (i, (g, w)) in got.data.iter().zip(&want.data).enumerate() {
        assert!(g.is_finite(), "gelu({}) = {g}", vals[i]);
        assert!((g - w).abs() <= 1e-6 * w.abs().max(1e-30), "gelu({}) = {g}, reference {w}", vals[i]);
    }
    // Fused: identity weights (k = n), so the pre-activations are exactly `vals`, via
    // both the GEMV (1 row) and the tiled matmul (9 rows).
    let n = vals.len();
    let eye: Vec<f32> = (0..n * n).map(|i| if i / n == i % n { 1.0 } else { 0.0 }).collect();
    let w = tensor(&[n, n], &eye);
    let (wb, wr) = (
        b.load_matrix(&view(&w), MatrixLayout::OutIn).unwrap(),
        r.load_matrix(&view(&w), MatrixLayout::OutIn).unwrap(),
    );
    for rows in [1, 9] {
        let x = HostMatrix { rows, cols: n, data: vals.iter().cycle().take(rows * n).copied().collect() };
        let got = b.read(&b.linear_gelu(&b.upload(&x), &wb, None)).unwrap();
        let mut want = r.linear(&x, &wr, None);
        r.gelu(&mut want);
        for (g, w) in got.data.iter().zip(&want.data) {
            assert!(g.is_finite() && (g - w).abs() <= 1e-6 * w.abs().max(1e-30), "fused gelu, {rows} rows: {g} vs {w}");
        }
    }
}

/// A (700, 50257) output is 141 MB, over lavapipe's 128 MiB binding: the matmul splits
/// its rows into blocks and the weight into row chunks. Compared with the reference.
#[test]
fn outputs_larger_than_one_binding() {
    let Some(b) = gpu() else { return };
    let r = ReferenceBackend;
    let mut rng = Rng::new(7);
    let (t, k, n) = (700, 8, 50257);
    let x = HostMatrix { rows: t, cols: k, data: uniform(&mut rng, t * k, 1.0) };
    let w = tensor(&[n, k], &uniform(&mut rng, n * k, 1.0));
    let bias = tensor(&[n], &uniform(&mut rng, n, 1.0));
    let got = b
        .read(&b.linear(
            &b.upload(&x),
            &b.load_matrix(&view(&w), MatrixLayout::OutIn).unwrap(),
            Some(&b.load_vector(&view(&bias)).unwrap()),
        ))
        .unwrap();
    let want = r.linear(
        &x,
        &r.load_matrix(&view(&w), MatrixLayout::OutIn).unwrap(),
        Some(&r.load_vector(&view(&bias)).unwrap()),
    );
    let worst = max_abs_diff(&got.data, &want.data);
    assert!(worst < 1e-5, "max abs error {worst}");
}

/// Greedy selection on the device equals the host's argmax, ties to the lowest index.
#[test]
fn device_argmax_matches_host() {
    let Some(b) = gpu() else { return };
    let mut rng = Rng::new(3);
    let cols = 50257;
    let mut data = uniform(&mut rng, 5 * cols, 10.0);
    data[cols + 17] = 99.0; // row 1: a tie between 17 and 40000
    data[cols + 40000] = 99.0;
    data[2 * cols + cols - 1] = 1e30; // row 2: the last column
    for v in &mut data[3 * cols..4 * cols] {
        *v = -5.0; // row 3: all equal → 0
    }
    data[4 * cols + 10] = -1e6; // row 4: the max is the lowest index of the rest
    let x = HostMatrix { rows: 5, cols, data };
    let mut ids = Vec::new();
    assert!(b.argmax_rows(&b.upload(&x), &mut ids).unwrap());
    let want: Vec<u32> = (0..5).map(|r| argmax(x.row(r))).collect();
    assert_eq!(ids, want);
    assert_eq!(ids[1..4], [17, cols as u32 - 1, 0]);
}

/// A row holding a NaN or an infinity anywhere gives NON_FINITE_ROW, so the engine can
/// report broken logits instead of sampling a token from them; other rows are unaffected.
#[test]
fn device_argmax_flags_non_finite_rows() {
    let Some(b) = gpu() else { return };
    let cols = 1000;
    let mut data: Vec<f32> = (0..5 * cols).map(|i| (i % 97) as f32).collect();
    data[3] = f32::NAN; // row 0: one NaN
    data[cols + cols - 1] = f32::INFINITY; // row 1: +inf in the last column
    data[2 * cols + 500] = f32::NEG_INFINITY; // row 2: -inf
    data[3 * cols..4 * cols].fill(f32::NAN); // row 3: all NaN
    let x = HostMatrix { rows: 5, cols, data };
    let mut ids = Vec::new();
    assert!(b.argmax_rows(&b.upload(&x), &mut ids).unwrap());
    assert_eq!(ids[..4], [NON_FINITE_ROW; 4]);
    assert_eq!(ids[4], argmax(x.row(4)));
}

/// Misuse is an error, not a panic or garbage, and the backend keeps working.
#[test]
fn errors_come_back_as_errors() {
    let Some(b) = gpu() else { return };
    let x = b.upload(&HostMatrix::zeros(2, 6));
    let mut cache = b.new_kv_cache(1, 4, 2).unwrap();
    // Positions 3..5 do not fit a cache of 4: refused before anything is recorded.
    let err = b
        .attention(
            &x,
            &[SeqSlice { rows: 0..2, start_pos: 3 }],
            &mut [&mut cache],
            0,
            &AttentionSpec::multi_head(2, 1, 1.0),
        )
        .err()
        .unwrap();
    assert!(err.to_string().contains("KV cache"), "{err}");
    // A kernel-level misuse (shapes that differ) comes back at the next read.
    let mut y = b.upload(&HostMatrix::zeros(1, 3));
    b.add(&mut y, &b.upload(&HostMatrix::zeros(2, 3)));
    assert!(b.read(&y).is_err());
    // The backend keeps working afterwards.
    let y = b.read(&b.upload(&HostMatrix { rows: 1, cols: 3, data: vec![1.0, 2.0, 3.0] })).unwrap();
    assert_eq!(y.data, [1.0, 2.0, 3.0]);
    // A cache larger than one binding is refused up front.
    assert!(b.new_kv_cache(1, 1 << 20, 1 << 10).is_err());
}

/// The f16 KV cache takes half the device memory of the f32 one, and its binding-size
/// check counts 2-byte values: a cache that only fits in f16 is accepted.
#[test]
fn f16_kv_cache_takes_half_the_memory() {
    let Some(f32_backend) = gpu() else { return };
    let o = GpuOptions { weight_dtype: Some(WeightDtype::F32), kv_dtype: KvDtype::F16, ..Default::default() };
    let Some(f16_backend) = common::gpu_backend(o) else { return };
    if !common::gpu_f16_or_skip(&f16_backend, "f16 KV cache size") {
        return;
    }
    let (n_layer, capacity, width) = (3, 100, 64);
    let a = f32_backend.new_kv_cache(n_layer, capacity, width).unwrap();
    let h = f16_backend.new_kv_cache(n_layer, capacity, width).unwrap();
    assert_eq!(a.device_bytes(), (n_layer * 2 * capacity * width * 4) as u64);
    assert_eq!(h.device_bytes(), a.device_bytes() / 2);
    assert_eq!(h.shape(), KvShape { n_layer, capacity, width });
    // Just over the largest binding in f32, under it in f16.
    let max = f32_backend.max_binding_bytes();
    let width = 1024;
    let capacity = usize::try_from(max / (2 * width as u64 * 4)).unwrap() + 1;
    assert!(f32_backend.new_kv_cache(1, capacity, width).is_err());
    let big = f16_backend.new_kv_cache(1, capacity, width).unwrap();
    assert!(big.device_bytes() <= max);
}

/// Several threads reading back at once each get their own data: the shared read-back
/// buffer is never written by one while another reads it.
#[test]
fn concurrent_read_backs_do_not_mix() {
    let Some(b) = gpu() else { return };
    let n = 50_000;
    let acts: Vec<_> = (0..4).map(|t| b.upload(&HostMatrix { rows: 1, cols: n, data: vec![t as f32; n] })).collect();
    std::thread::scope(|s| {
        for (t, a) in acts.iter().enumerate() {
            let b = &b;
            s.spawn(move || {
                for _ in 0..25 {
                    let got = b.read(a).unwrap();
                    assert!(got.data.iter().all(|&v| v == t as f32), "thread {t} read another's data");
                }
            });
        }
    });
}

/// A device that does not finish in time is an error naming the timeout, not a hang.
#[test]
fn a_wait_past_the_timeout_is_an_error() {
    let o = GpuOptions {
        weight_dtype: Some(WeightDtype::F32),
        poll_timeout: Some(std::time::Duration::from_nanos(1)),
        ..Default::default()
    };
    let Some(b) = common::gpu_backend(o) else { return };
    let mut rng = Rng::new(11);
    let (t, k, n) = (512, 768, 3072);
    let w = tensor(&[n, k], &uniform(&mut rng, n * k, 0.05));
    let x = HostMatrix { rows: t, cols: k, data: uniform(&mut rng, t * k, 1.0) };
    let wb = b.load_matrix(&view(&w), MatrixLayout::OutIn).unwrap();
    let err = b.read(&b.linear_gelu(&b.upload(&x), &wb, None)).expect_err("a 1 ns timeout expires");
    assert!(format!("{err:#}").contains("did not finish"), "{err:#}");
}

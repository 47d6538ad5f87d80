//! Criterion benches for the fast CPU backend's kernels at GPT-2 124M shapes.
//! `cargo bench --bench kernels`

use std::hint::black_box;

use batch_forge::backend::WeightDtype;
use batch_forge::backend::cpu::matmul::{Epilogue, PackedMatrix, matmul, matmul_batch_invariant};
use batch_forge::backend::cpu::qmatmul::{self, Q8Rows, QMatrix, QType};
use batch_forge::backend::cpu::simd::{self, Isa};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n)
        .map(|i| ((i as u32).wrapping_mul(2654435761).wrapping_add(seed) >> 8) as f32 / (1 << 24) as f32 - 0.5)
        .collect()
}

fn matmuls(c: &mut Criterion) {
    let isa = Isa::detect();
    let mut g = c.benchmark_group("matmul");
    g.sample_size(20);
    for (rows, n_in, n_out, name) in [
        (1, 768, 2304, "gemv c_attn"),
        (1, 768, 3072, "gemv c_fc"),
        (1, 3072, 768, "gemv mlp_proj"),
        (1, 768, 50257, "gemv lm_head"),
        (512, 768, 2304, "gemm c_attn T=512"),
        (512, 3072, 768, "gemm mlp_proj T=512"),
    ] {
        for dtype in [WeightDtype::F32, WeightDtype::F16] {
            let w_data = values(n_in * n_out, 1);
            let w = PackedMatrix::pack(n_in, n_out, dtype, |k, j| w_data[k * n_out + j]);
            let x = values(rows * n_in, 2);
            let bias = values(n_out, 3);
            let mut out = vec![0.0; rows * n_out];
            if rows == 1 {
                g.throughput(Throughput::Bytes(w.bytes() as u64));
            } else {
                g.throughput(Throughput::Elements((2 * rows * n_in * n_out) as u64));
            }
            g.bench_function(format!("{name} {}", dtype.name()), |b| {
                b.iter(|| matmul(isa, black_box(&x), rows, &w, Epilogue { bias: Some(&bias), gelu: false }, &mut out))
            });
        }
    }
    // Skinny GEMM (the server's batched decode, batch-invariant order): 16 rows against
    // one matrix held in L2 and against 12 streamed from memory (~113 MB in f32).
    for (n_mats, n_in, n_out, label) in [(1, 768, 768, "cached"), (12, 768, 3072, "stream")] {
        for dtype in [WeightDtype::F32, WeightDtype::F16] {
            let rows = 16;
            let mats: Vec<PackedMatrix> = (0..n_mats)
                .map(|m| {
                    let w_data = values(n_in * n_out, m as u32);
                    PackedMatrix::pack(n_in, n_out, dtype, |k, j| w_data[k * n_out + j])
                })
                .collect();
            let x = values(rows * n_in, 2);
            let mut out = vec![0.0; rows * n_out];
            g.throughput(Throughput::Elements((2 * rows * n_in * n_out * n_mats) as u64));
            g.bench_function(format!("skinny {label} {n_mats}x{n_out}x{n_in} T={rows} {}", dtype.name()), |b| {
                b.iter(|| {
                    for w in &mats {
                        matmul_batch_invariant(
                            isa,
                            black_box(&x),
                            rows,
                            w,
                            Epilogue { bias: None, gelu: false },
                            &mut out,
                        )
                    }
                })
            });
        }
    }
    g.finish();
}

fn elementwise(c: &mut Criterion) {
    let isa = Isa::detect();
    let mut g = c.benchmark_group("elementwise");
    let mut v = values(3072, 4);
    g.bench_function("gelu 3072", |b| b.iter(|| simd::gelu(isa, black_box(&mut v))));
    let (x, gain, shift) = (values(768, 5), values(768, 6), values(768, 7));
    let mut out = vec![0.0; 768];
    g.bench_function("layer_norm 768", |b| b.iter(|| simd::layer_norm(black_box(&x), &gain, &shift, 1e-5, &mut out)));
    let mut scores = values(1024, 8);
    g.bench_function("softmax 1024", |b| b.iter(|| simd::softmax(isa, black_box(&mut scores))));
    let (q, k) = (values(64, 9), values(64, 10));
    g.bench_function("dot 64", |b| b.iter(|| simd::dot(isa, black_box(&q), black_box(&k))));
    g.finish();
}

/// GGUF blocks of `ty` for `n` values (random quants, small positive scales).
fn blocks(ty: QType, n: usize, seed: u32) -> Vec<u8> {
    let v = values(n / 32 * ty.block_bytes(), seed);
    let mut bytes: Vec<u8> = v.iter().map(|x| (x * 512.0) as i32 as u8).collect();
    for blk in bytes.chunks_mut(ty.block_bytes()) {
        let scale = half::f16::from_f32(0.01).to_bits().to_le_bytes();
        blk[..2].copy_from_slice(&scale);
        if ty == QType::Q4_1 {
            blk[2..4].copy_from_slice(&scale);
        }
    }
    bytes
}

/// The quantized kernels at decode (1 row) and batched (4, 16, 64 rows) shapes. "stream":
/// 40 matrices of 3072 × 768 (~50-100 MB, past the caches, as a decode step reads them);
/// "cached": one 768 × 768 matrix that stays in L2 (the kernel's arithmetic alone).
fn qmatmuls(c: &mut Criterion) {
    let isa = Isa::detect();
    let mut g = c.benchmark_group("qmatmul");
    g.sample_size(20);
    for ty in [QType::Q8_0, QType::Q4_0, QType::Q4_1] {
        for (n_mats, n_out, n_in, label) in [(40, 3072, 768, "stream"), (1, 768, 768, "cached")] {
            let mats: Vec<QMatrix> = (0..n_mats)
                .map(|m| QMatrix::new(ty, n_out, n_in, &blocks(ty, n_out * n_in, m as u32)).unwrap())
                .collect();
            for rows in [1, 4, 16, 64] {
                if label == "stream" && rows > 1 {
                    continue;
                }
                let x = values(rows * n_in, 2);
                let mut q8 = Q8Rows::default();
                qmatmul::quantize_rows(isa, &x, rows, n_in, &mut q8);
                let mut out = vec![0.0; rows * n_out];
                g.throughput(Throughput::Bytes(mats.iter().map(|m| m.bytes() as u64).sum()));
                g.bench_function(format!("{} {label} {n_out}x{n_in} T={rows}", ty.name()), |b| {
                    b.iter(|| {
                        for m in &mats {
                            qmatmul::qmatmul(isa, m, black_box(&q8), rows, &mut out);
                        }
                    })
                });
            }
        }
    }
    g.finish();
}

criterion_group!(benches, matmuls, qmatmuls, elementwise);
criterion_main!(benches);

//! The arithmetic ceiling of batched decode, in the shapes of the AVX2 kernels: how many
//! multiply-adds a second the Q8_0 inner step (`qmatmul`'s four-row AVX2 path), the Q4_0/Q4_1
//! step (its two-row path) and the f32 micro-kernel (`matmul`'s 6 × 16 tile) can do when
//! their operands sit in L1, so that memory is out of the picture. `docs/benchmarks.md` and
//! `docs/serving.md` turn these into the most tokens/s a 16-sequence decode step can reach.
//! The inner loops leave out the kernels' per-block scale work (for Q4 about a sixth of the
//! kernel loop's instructions), so the figures are upper bounds. The compiled Q8_0 and f32
//! loops were checked (`objdump`) to be the kernels' instruction sequences, with no spills;
//! the Q4 loop spills a few vectors a block (the kernel two or three) and is still the
//! shorter loop.
//!
//! `cargo run --release --example int8_ceiling [THREADS]` (default 1: one core; 2 runs every
//! probe on two threads at once and sums them). x86-64 with AVX2 and FMA; elsewhere it says so.

#[cfg(target_arch = "x86_64")]
mod probe {
    use std::arch::x86_64::*;
    use std::hint::black_box;
    use std::time::Instant;

    /// Bytes of Q8_0 weights (or f32 panel floats × 4) swept again and again: fits L1 (32 KiB).
    const WEIGHT_BYTES: usize = 8192;
    /// One activation row of the Q4 probe: a block of 32 bytes per 256 weight bytes.
    const Q4_ROW: usize = WEIGHT_BYTES / 256 * 32;
    /// Multiply-adds a token in GPT-2 124M's products: 12 blocks × 7.08 M + the 38.6 M head.
    const GPT2_MACS: f64 = 123.5e6;

    /// The Q8_0 step of `panel_dot_avx2` with four activation rows: per 32 weight bytes
    /// (8 outputs × 4 inputs) one `psignb` for |w|, then per row a broadcast of 4 activation
    /// bytes, `psignb`, `vpmaddubsw`, `vpmaddwd` and `vpaddd` (the broadcasts shared by the
    /// two halves, as in the kernel). Returns a checksum.
    ///
    /// # Safety
    /// AVX2 is available.
    #[target_feature(enable = "avx2")]
    unsafe fn q8_0_step(w: &[i8], x: &[i8], reps: usize) -> i32 {
        assert!(w.len() >= WEIGHT_BYTES && x.len() >= 4 * 64);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_si256(); 2]; 4];
        for _ in 0..reps {
            for st in 0..WEIGHT_BYTES / 64 {
                for h in 0..2 {
                    // SAFETY: 64 · st + 32 · h + 32 ≤ WEIGHT_BYTES ≤ w.len() (asserted above).
                    let q = unsafe { _mm256_loadu_si256(w.as_ptr().add(64 * st + 32 * h) as *const __m256i) };
                    let a = _mm256_sign_epi8(q, q);
                    for (i, acc_i) in acc.iter_mut().enumerate() {
                        // SAFETY: i · 64 + 4 · (st % 16) + 4 ≤ 256 ≤ x.len() (asserted above).
                        let x4 = unsafe { (x.as_ptr().add(i * 64 + (st % 16) * 4) as *const i32).read_unaligned() };
                        let p16 = _mm256_maddubs_epi16(a, _mm256_sign_epi8(_mm256_set1_epi32(x4), q));
                        acc_i[h] = _mm256_add_epi32(acc_i[h], _mm256_madd_epi16(p16, ones));
                    }
                }
            }
        }
        let mut r = _mm256_setzero_si256();
        for row in acc {
            for v in row {
                r = _mm256_add_epi32(r, v);
            }
        }
        _mm256_extract_epi32::<0>(r)
    }

    /// The Q4_0/Q4_1 step of `panel_dot_avx2` (two activation rows): per 32 weight bytes
    /// (8 outputs × 8 inputs as low and high nibbles) the nibbles split once, then per row two
    /// broadcasts, two `vpmaddubsw` and a 16-bit add; per block of 32 inputs (4 steps) each
    /// row's 16-bit sums widened (`vpmaddwd`), converted and scaled into f32 (`vfmadd231ps`;
    /// the kernel also multiplies two scales and, for Q4_1, adds an offset term). The
    /// activations move on by a block (32 bytes) per block, rows [`Q4_ROW`] bytes apart, as
    /// the kernel's do, so no broadcast can be hoisted out of the loop. Returns a checksum.
    ///
    /// # Safety
    /// AVX2 and FMA are available.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn q4_step(w: &[i8], x: &[i8], reps: usize) -> f32 {
        assert!(w.len() >= WEIGHT_BYTES && x.len() >= 2 * Q4_ROW);
        let (ones, m4) = (_mm256_set1_epi16(1), _mm256_set1_epi8(0x0F));
        let scale = _mm256_set1_ps(1e-6);
        // The f32 sums in memory (L1), as the kernel keeps them, so the block's integer
        // work has the registers.
        let mut acc = [[[0.0f32; 8]; 2]; 2];
        for _ in 0..reps {
            for blk in 0..WEIGHT_BYTES / 256 {
                let mut isum = [[_mm256_setzero_si256(); 2]; 2];
                for st in 0..4 {
                    for h in 0..2 {
                        // SAFETY: 256 · blk + 64 · st + 32 · h + 32 ≤ WEIGHT_BYTES ≤ w.len().
                        let q = unsafe {
                            _mm256_loadu_si256(w.as_ptr().add(256 * blk + 64 * st + 32 * h) as *const __m256i)
                        };
                        let lo = _mm256_and_si256(q, m4);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
                        for (i, isum_i) in isum.iter_mut().enumerate() {
                            // SAFETY: i · Q4_ROW + 32 · blk + 4 · st + 16 + 4 ≤ 2 · Q4_ROW ≤
                            // x.len() (blk < Q4_ROW / 32, st < 4; asserted above).
                            let (xl, xh) = unsafe {
                                let p = x.as_ptr().add(i * Q4_ROW + 32 * blk + 4 * st);
                                ((p as *const i32).read_unaligned(), (p.add(16) as *const i32).read_unaligned())
                            };
                            let pair = _mm256_add_epi16(
                                _mm256_maddubs_epi16(lo, _mm256_set1_epi32(xl)),
                                _mm256_maddubs_epi16(hi, _mm256_set1_epi32(xh)),
                            );
                            isum_i[h] = _mm256_add_epi16(isum_i[h], pair);
                        }
                    }
                }
                for (acc_i, isum_i) in acc.iter_mut().zip(isum) {
                    for h in 0..2 {
                        let wide = _mm256_cvtepi32_ps(_mm256_madd_epi16(isum_i[h], ones));
                        let p = acc_i[h].as_mut_ptr();
                        // SAFETY: `acc_i[h]` holds 8 floats.
                        unsafe { _mm256_storeu_ps(p, _mm256_fmadd_ps(scale, wide, _mm256_loadu_ps(p))) };
                    }
                }
            }
        }
        let mut r = _mm256_setzero_ps();
        for row in acc {
            for v in row {
                // SAFETY: `v` holds 8 floats.
                r = _mm256_add_ps(r, unsafe { _mm256_loadu_ps(v.as_ptr()) });
            }
        }
        let mut out = [0.0f32; 8];
        // SAFETY: `out` holds 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), r) };
        out.iter().sum()
    }

    /// The f32 micro-kernel's shape: six activation rows broadcast against a 16-column
    /// panel row (two loads), twelve `vfmadd231ps` accumulators. Returns a checksum.
    ///
    /// # Safety
    /// AVX2 and FMA are available.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn f32_tile(w: &[f32], x: &[f32], reps: usize) -> f32 {
        let k_steps = WEIGHT_BYTES / 64;
        assert!(w.len() >= k_steps * 16 && x.len() >= 6 * k_steps);
        let mut acc = [[_mm256_setzero_ps(); 2]; 6];
        for _ in 0..reps {
            for k in 0..k_steps {
                // SAFETY: 16 · k + 16 ≤ w.len() (asserted above).
                let (b0, b1) =
                    unsafe { (_mm256_loadu_ps(w.as_ptr().add(16 * k)), _mm256_loadu_ps(w.as_ptr().add(16 * k + 8))) };
                for (r, acc_r) in acc.iter_mut().enumerate() {
                    let a = _mm256_set1_ps(x[r * k_steps + k]);
                    acc_r[0] = _mm256_fmadd_ps(a, b0, acc_r[0]);
                    acc_r[1] = _mm256_fmadd_ps(a, b1, acc_r[1]);
                }
            }
        }
        let mut r = _mm256_setzero_ps();
        for row in acc {
            r = _mm256_add_ps(r, _mm256_add_ps(row[0], row[1]));
        }
        let mut out = [0.0f32; 8];
        // SAFETY: `out` holds 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), r) };
        out.iter().sum()
    }

    /// (best, median) of the runs: the best is the ceiling (a busy host only slows a run).
    fn best_median(mut v: Vec<f64>) -> (f64, f64) {
        v.sort_by(f64::total_cmp);
        (v[v.len() - 1], v[v.len() / 2])
    }

    /// Runs `probe` on `threads` threads at once (each with its own copy of the operands,
    /// all released together by a barrier) and returns their multiply-adds over the wall
    /// time from the release to the last one's end, G multiply-adds/s.
    fn timed<T: Clone + Send>(threads: usize, data: &T, probe: &(dyn Fn(&T) -> f64 + Sync)) -> f64 {
        let start = std::sync::Barrier::new(threads + 1);
        std::thread::scope(|sc| {
            let jobs: Vec<_> = (0..threads)
                .map(|_| {
                    let (mine, start) = (data.clone(), &start);
                    sc.spawn(move || {
                        start.wait();
                        probe(&mine)
                    })
                })
                .collect();
            start.wait();
            let t = Instant::now();
            let macs: f64 = jobs.into_iter().map(|j| j.join().expect("probe thread")).sum();
            macs / t.elapsed().as_secs_f64() / 1e9
        })
    }

    pub fn run(threads: usize) {
        if !(std::is_x86_feature_detected!("avx2") && std::is_x86_feature_detected!("fma")) {
            println!("this probe measures the AVX2 paths; this CPU has no AVX2 + FMA");
            return;
        }
        let w8: Vec<i8> = (0..WEIGHT_BYTES).map(|i| ((i * 37) % 255) as i8).collect();
        let x8: Vec<i8> = (0..2 * Q4_ROW).map(|i| ((i * 13) % 255) as i8).collect();
        let wf: Vec<f32> = (0..WEIGHT_BYTES / 4).map(|i| (i % 7) as f32 * 1e-3).collect();
        let xf: Vec<f32> = (0..6 * WEIGHT_BYTES / 64).map(|i| (i % 5) as f32 * 1e-3).collect();
        let reps = 300_000;
        let (int8, float) = ((w8, x8), (wf, xf));
        let q8_0 = |(w, x): &(Vec<i8>, Vec<i8>)| {
            // SAFETY: AVX2 was detected above.
            black_box(unsafe { q8_0_step(black_box(w), black_box(x), reps) });
            (WEIGHT_BYTES * 4 * reps) as f64
        };
        let q4 = |(w, x): &(Vec<i8>, Vec<i8>)| {
            // SAFETY: AVX2 and FMA were detected above.
            black_box(unsafe { q4_step(black_box(w), black_box(x), reps) });
            (WEIGHT_BYTES * 2 * 2 * reps) as f64
        };
        let f32_tile = |(w, x): &(Vec<f32>, Vec<f32>)| {
            // SAFETY: AVX2 and FMA were detected above.
            black_box(unsafe { f32_tile(black_box(w), black_box(x), reps) });
            (WEIGHT_BYTES / 4 * 6 * reps) as f64
        };
        timed(threads, &int8, &q8_0); // warm-up: clocks up, pages touched
        let (mut r_q8, mut r_q4, mut r_f32) = (Vec::new(), Vec::new(), Vec::new());
        for _ in 0..5 {
            r_q8.push(timed(threads, &int8, &q8_0));
            r_q4.push(timed(threads, &int8, &q4));
            r_f32.push(timed(threads, &float, &f32_tile));
        }
        let fmt = |v: &[f64]| v.iter().map(|g| format!("{g:.1}")).collect::<Vec<_>>().join(" ");
        let ((q8_best, q8_median), (q4_best, q4_median)) = (best_median(r_q8.clone()), best_median(r_q4.clone()));
        let (f32_best, f32_median) = best_median(r_f32.clone());
        println!("{threads} thread(s) at once, operands in L1, G multiply-adds/s: best, median of 5 runs [runs]");
        println!(
            "  Q8_0 AVX2 step (psignb, vpmaddubsw, vpmaddwd, vpaddd), 4 rows: {q8_best:.1}, {q8_median:.1}  [{}]",
            fmt(&r_q8)
        );
        println!(
            "  Q4 AVX2 step (nibbles, 2 x vpmaddubsw, 16-bit sums), 2 rows:   {q4_best:.1}, {q4_median:.1}  [{}]",
            fmt(&r_q4)
        );
        println!(
            "  f32 FMA tile (6 rows x 16 columns):                           {f32_best:.1}, {f32_median:.1}  [{}]",
            fmt(&r_f32)
        );
        println!(
            "so a decode step of GPT-2 124M (123.5 M multiply-adds a token in its products) on these \
             threads runs at most at {:.0} tok/s in Q8_0 and {:.0} tok/s in f32 (best runs)",
            q8_best * 1e9 / GPT2_MACS,
            f32_best * 1e9 / GPT2_MACS
        );
    }
}

fn main() {
    let mut args = std::env::args_os().skip(1);
    let threads = match (args.next(), args.next()) {
        (None, _) => Some(1),
        (Some(a), None) => a.to_str().and_then(|a| a.parse::<usize>().ok()).filter(|n| (1..=256).contains(n)),
        _ => None,
    };
    let Some(threads) = threads else {
        eprintln!("usage: int8_ceiling [THREADS]   (THREADS: 1 to 256, default 1)");
        std::process::exit(2);
    };
    #[cfg(target_arch = "x86_64")]
    probe::run(threads);
    #[cfg(not(target_arch = "x86_64"))]
    println!("this probe measures the x86-64 AVX2 paths; nothing to measure here ({threads} thread(s) asked)");
}

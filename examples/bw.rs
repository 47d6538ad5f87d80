use std::arch::x86_64::*;
use std::time::Instant;
#[target_feature(enable = "avx2,fma")]
unsafe fn sum_streams(x: &[f32], streams: usize, pf: usize) -> f32 {
    unsafe {
        let n = x.len() / streams;
        let mut acc = [_mm256_setzero_ps(); 4];
        let p = x.as_ptr();
        let mut i = 0;
        while i + 32 <= n {
            for s in 0..streams {
                let q = p.add(s * n + i);
                if pf > 0 {
                    _mm_prefetch::<_MM_HINT_T0>(q.add(pf) as *const i8);
                }
                acc[0] = _mm256_add_ps(acc[0], _mm256_loadu_ps(q));
                acc[1] = _mm256_add_ps(acc[1], _mm256_loadu_ps(q.add(8)));
                acc[2] = _mm256_add_ps(acc[2], _mm256_loadu_ps(q.add(16)));
                acc[3] = _mm256_add_ps(acc[3], _mm256_loadu_ps(q.add(24)));
            }
            i += 32;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut o = [0f32; 8];
        _mm256_storeu_ps(o.as_mut_ptr(), v);
        o.iter().sum()
    }
}
fn main() {
    let huge = std::env::args().nth(1).as_deref() == Some("huge");
    let n = 256 << 20;
    let mut v: Vec<f32> = Vec::with_capacity(n);
    if huge {
        let p = v.as_mut_ptr() as usize;
        let start = (p + 0x1fffff) & !0x1fffff;
        let end = (p + n * 4) & !0x1fffff;
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
    v.resize(n, 1.0);
    for t in [1usize, 2] {
        for streams in [1usize, 2, 4] {
            for pf in [0usize, 256, 1024] {
                let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build().unwrap();
                let mut best = 0.0f64;
                for _ in 0..4 {
                    let s = Instant::now();
                    let r: f32 = pool.install(|| {
                        use rayon::prelude::*;
                        v.par_chunks(n / t).map(|c| unsafe { sum_streams(c, streams, pf) }).sum()
                    });
                    let gbs = (n * 4) as f64 / s.elapsed().as_secs_f64() / 1e9;
                    std::hint::black_box(r);
                    best = best.max(gbs);
                }
                println!("huge={huge} threads={t} streams={streams} pf={pf} best {best:.1} GB/s");
            }
        }
    }
}

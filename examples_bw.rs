use std::time::Instant;
fn sum(x: &[f32]) -> f32 {
    let mut acc = [0.0f32; 32];
    for c in x.chunks_exact(32) { for i in 0..32 { acc[i] += c[i]; } }
    acc.iter().sum()
}
fn main() {
    let huge = std::env::args().nth(1).as_deref() == Some("huge");
    let n = 256 << 20; // 1 GiB of f32
    let mut v: Vec<f32> = Vec::with_capacity(n);
    if huge {
        let p = v.as_mut_ptr() as usize;
        let start = (p + 0x1fffff) & !0x1fffff;
        let end = (p + n * 4) & !0x1fffff;
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
    v.resize(n, 1.0);
    for t in [1usize, 2] {
        let pool = rayon::ThreadPoolBuilder::new().num_threads(t).build().unwrap();
        let mut best = 0.0f64;
        for _ in 0..5 {
            let s = Instant::now();
            let r: f32 = pool.install(|| { use rayon::prelude::*; v.par_chunks(n / t).map(sum).sum() });
            let gbs = (n * 4) as f64 / s.elapsed().as_secs_f64() / 1e9;
            std::hint::black_box(r);
            best = best.max(gbs);
        }
        println!("huge={huge} threads={t} best {best:.1} GB/s");
    }
}

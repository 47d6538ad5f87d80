//! The x86-64 kernels of [`super`]: the AVX2/FMA and AVX-512 (and AVX-512 BF16) tile,
//! GEMV and packing routines, each computing the portable kernel's sums in its order.
#![allow(clippy::needless_range_loop)] // index loops over register arrays read clearest here

use std::arch::x86_64::*;

use half::{bf16, f16};

use super::{MR, NR, Tile};

pub(crate) type KernelFn<T> = unsafe fn(&Tile<T>, &mut [[f32; NR]; MR]);

/// A tile's prefetch region spread over its `kc` steps: step `k` touches byte
/// `k · step` of it (`step` ≤ one cache line whenever the region is at most `kc`
/// lines, as the skinny GEMM's shares are: `kc` panel rows of 64 bytes or fewer,
/// split between the row blocks).
#[derive(Clone, Copy)]
pub(crate) struct Prefetch {
    base: *const i8,
    step: usize,
}

impl Prefetch {
    pub(crate) fn new<T>(region: Option<&[T]>, kc: usize) -> Self {
        match region {
            Some(r) if kc > 0 => {
                Prefetch { base: r.as_ptr() as *const i8, step: std::mem::size_of_val(r).div_ceil(kc) }
            }
            _ => Prefetch { base: std::ptr::null(), step: 0 },
        }
    }

    pub(crate) fn is_some(&self) -> bool {
        !self.base.is_null()
    }

    /// Prefetch the line holding byte `k · step` of the region.
    #[inline(always)]
    pub(crate) fn at(&self, k: usize) {
        // SAFETY: a prefetch is a hint: it reads no memory the program can observe and
        // never faults, whatever the address (`wrapping_add` keeps the pointer
        // arithmetic itself defined).
        unsafe { _mm_prefetch::<_MM_HINT_T1>(self.base.wrapping_add(k * self.step)) }
    }
}

/// A tile kernel for element type `$t` on one vector width: checks the tile's slices,
/// then runs the micro-kernel for its row count (the AVX2 instantiation sends one- and
/// two-row tiles that need no fixed order to `gemv_rows`).
macro_rules! kernel {
    ($name:ident, $t:ty, $features:literal, $v:ty, $block_pf:ident, $load:expr $(, gemv = $gemv:ident)?) => {
        /// # Safety
        #[doc = concat!("Needs the CPU features `", $features, "`.")]
        #[target_feature(enable = $features)]
        pub(crate) unsafe fn $name(t: &Tile<$t>, acc: &mut [[f32; NR]; MR]) {
            assert!(t.panel.len() >= t.kc * NR, "panel slice too short");
            assert!(
                t.mr >= 1 && t.mr <= MR && t.a.len() >= (t.mr - 1) * t.lda + t.kc,
                "activation slice too short"
            );
            let load: unsafe fn(*const $t) -> $v = $load;
            let (a, b) = (t.a.as_ptr(), t.panel.as_ptr());
            let pf = Prefetch::new(t.prefetch, t.kc);
            // SAFETY (all pointer reads): k < kc and r < mr, within the lengths asserted
            // above; prefetches are hints that read nothing.
            unsafe {
                match t.mr {
                    $(
                        1 if !t.fixed_order => $gemv::<1, $t>(a, t.lda, b, t.kc, acc, load),
                        2 if !t.fixed_order => $gemv::<2, $t>(a, t.lda, b, t.kc, acc, load),
                    )?
                    1 => $block_pf::<1, $t>(a, t.lda, b, t.kc, acc, load, pf),
                    2 => $block_pf::<2, $t>(a, t.lda, b, t.kc, acc, load, pf),
                    3 => $block_pf::<3, $t>(a, t.lda, b, t.kc, acc, load, pf),
                    4 => $block_pf::<4, $t>(a, t.lda, b, t.kc, acc, load, pf),
                    5 => $block_pf::<5, $t>(a, t.lda, b, t.kc, acc, load, pf),
                    _ => $block_pf::<6, $t>(a, t.lda, b, t.kc, acc, load, pf),
                }
            }
        }
    };
}

/// The GEMM micro-kernel written once over the vector width: R × 16 accumulators
/// (`16 / W` registers of `W` lanes per row), one FMA chain per output in k order; and
/// its form with the prefetch switch decided once per tile, not per k step.
///
/// Both functions' safety contract: the vector width's features are available; `a`
/// points at `R` rows of `kc` readable f32s, `lda` apart; `b` at `kc` packed panel rows
/// of [`NR`] elements; `load` may be called on each `W` of them (its own features
/// available); `R ≤ MR`.
macro_rules! gemm_block {
    (
        $block:ident, $block_pf:ident, $v:ty, $w:literal,
        $zero:ident, $set1:ident, $fmadd:ident, $add:ident, $loadu:ident, $storeu:ident
    ) => {
        /// # Safety
        /// See [`gemm_block`].
        #[inline(always)]
        unsafe fn $block_pf<const R: usize, T>(
            a: *const f32,
            lda: usize,
            b: *const T,
            kc: usize,
            acc: &mut [[f32; NR]; MR],
            load: unsafe fn(*const T) -> $v,
            pf: Prefetch,
        ) {
            // SAFETY: forwarded from the caller.
            unsafe {
                if pf.is_some() {
                    $block::<R, true, T>(a, lda, b, kc, acc, load, pf)
                } else {
                    $block::<R, false, T>(a, lda, b, kc, acc, load, pf)
                }
            }
        }

        /// # Safety
        /// See [`gemm_block`].
        #[inline(always)]
        unsafe fn $block<const R: usize, const PF: bool, T>(
            a: *const f32,
            lda: usize,
            b: *const T,
            kc: usize,
            acc: &mut [[f32; NR]; MR],
            load: unsafe fn(*const T) -> $v,
            pf: Prefetch,
        ) {
            const NV: usize = NR / $w;
            unsafe {
                let mut s = [[$zero(); NV]; R];
                for k in 0..kc {
                    if PF {
                        pf.at(k);
                    }
                    let mut bv = [$zero(); NV];
                    for h in 0..NV {
                        bv[h] = load(b.add(k * NR + $w * h));
                    }
                    for r in 0..R {
                        let av = $set1(*a.add(r * lda + k));
                        for h in 0..NV {
                            s[r][h] = $fmadd(av, bv[h], s[r][h]);
                        }
                    }
                }
                for r in 0..R {
                    for h in 0..NV {
                        let p = acc[r].as_mut_ptr().add($w * h);
                        $storeu(p, $add($loadu(p), s[r][h]));
                    }
                }
            }
        }
    };
}

gemm_block!(
    block,
    block_pf,
    __m256,
    8,
    _mm256_setzero_ps,
    _mm256_set1_ps,
    _mm256_fmadd_ps,
    _mm256_add_ps,
    _mm256_loadu_ps,
    _mm256_storeu_ps
);
gemm_block!(
    block512,
    block512_pf,
    __m512,
    16,
    _mm512_setzero_ps,
    _mm512_set1_ps,
    _mm512_fmadd_ps,
    _mm512_add_ps,
    _mm512_loadu_ps,
    _mm512_storeu_ps
);

kernel!(kernel_f32_512, f32, "avx512f,avx512bw,avx512vl,avx2,fma,f16c", __m512, block512_pf, |p| unsafe {
    _mm512_loadu_ps(p)
});
kernel!(kernel_f16_512, f16, "avx512f,avx512bw,avx512vl,avx2,fma,f16c", __m512, block512_pf, |p| unsafe {
    _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
});
kernel!(kernel_bf16_512, bf16, "avx512f,avx512bw,avx512vl,avx2,fma,f16c", __m512, block512_pf, |p| unsafe {
    _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i))))
});

/// The AVX512-BF16 kernel: `acc[r] += Σ_q dot(pair_q(a_r), pair_q(panel))` with one
/// `vdpbf16ps` chain per output in pair order, for every row count (so a row's result
/// does not depend on the rows beside it). Each pair of panel rows (k, k + 1), 32 bf16
/// in one load, is interleaved column by column so that f32 lane j holds
/// (W[k][j], W[k + 1][j]); an odd last row is paired with zeros.
///
/// # Safety
/// Needs AVX512-BF16, AVX-512 F/BW/VL, AVX2, FMA and F16C.
#[target_feature(enable = "avx512bf16,avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(crate) unsafe fn kernel_bf16_dp(t: &Tile<bf16>, acc: &mut [[f32; NR]; MR]) {
    let pairs = t.pairs.expect("the bf16 kernel takes activation pairs");
    let n_pairs = t.kc.div_ceil(2);
    assert!(t.panel.len() >= t.kc * NR, "panel slice too short");
    assert!(t.mr >= 1 && t.mr <= MR && pairs.len() >= (t.mr - 1) * t.ldp + n_pairs, "activation pairs too short");
    let (a, b) = (pairs.as_ptr(), t.panel.as_ptr());
    let pf = Prefetch::new(t.prefetch, t.kc);
    // SAFETY (all pointer reads): pair q < kc / 2 reads panel rows 2q, 2q + 1 < kc, the
    // odd tail reads row kc - 1, and row r < mr reads pairs below (mr - 1)·ldp + n_pairs,
    // within the lengths asserted above; prefetches are hints that read nothing.
    unsafe {
        match t.mr {
            1 => dp_block::<1>(a, t.ldp, b, t.kc, acc, pf),
            2 => dp_block::<2>(a, t.ldp, b, t.kc, acc, pf),
            3 => dp_block::<3>(a, t.ldp, b, t.kc, acc, pf),
            4 => dp_block::<4>(a, t.ldp, b, t.kc, acc, pf),
            5 => dp_block::<5>(a, t.ldp, b, t.kc, acc, pf),
            _ => dp_block::<6>(a, t.ldp, b, t.kc, acc, pf),
        }
    }
}

/// Lane order of one interleaved pair of panel rows: 16-bit element 2j takes column j
/// of row k (element j of the load), element 2j + 1 column j of row k + 1 (16 + j).
const INTERLEAVE: [u16; 32] = {
    let mut idx = [0u16; 32];
    let mut j = 0;
    while j < 16 {
        idx[2 * j] = j as u16;
        idx[2 * j + 1] = 16 + j as u16;
        j += 1;
    }
    idx
};

/// The bf16 micro-kernel: `vdpbf16ps` over pairs of k, R × 16 accumulators.
///
/// # Safety
/// AVX-512 F and BF16 are available; `a` points at `R` rows of `kc.div_ceil(2)` bf16
/// pairs (u32) each, `ldp` apart; `b` at `kc` packed panel rows of [`NR`] bf16s; `R ≤ MR`.
#[inline(always)]
unsafe fn dp_block<const R: usize>(
    a: *const u32,
    ldp: usize,
    b: *const bf16,
    kc: usize,
    acc: &mut [[f32; NR]; MR],
    pf: Prefetch,
) {
    unsafe {
        let idx = _mm512_loadu_si512(INTERLEAVE.as_ptr() as *const __m512i);
        // One chain per output, in pair order: the order of a plain k-ordered sum, as
        // near as pairs allow. (Two chains, even and odd pairs, ran no faster with the
        // pairs broadcast from memory, and their other rounding flipped more bf16
        // roundings of the next layer's activations against the reference's.)
        let mut s = [_mm512_setzero_ps(); R];
        let dot = |s: __m512, a: u32, w: __m512i| {
            let av: __m512bh = std::mem::transmute(_mm512_set1_epi32(a as i32));
            // The broadcast pair as the memory operand (`{1to16}`).
            _mm512_dpbf16_ps(s, std::mem::transmute::<__m512i, __m512bh>(w), av)
        };
        for q in 0..kc / 2 {
            if pf.is_some() {
                pf.at(2 * q);
                pf.at(2 * q + 1);
            }
            let w = _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(b.add(2 * q * NR) as *const __m512i));
            for r in 0..R {
                s[r] = dot(s[r], a.add(r * ldp + q).read(), w);
            }
        }
        if kc % 2 == 1 {
            // Row kc - 1 alone: each column's bf16 in the low half of its lane, zero above.
            let q = kc / 2;
            let w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(b.add((kc - 1) * NR) as *const __m256i));
            for r in 0..R {
                s[r] = dot(s[r], a.add(r * ldp + q).read(), w);
            }
        }
        for r in 0..R {
            let p = acc[r].as_mut_ptr();
            _mm512_storeu_ps(p, _mm512_add_ps(_mm512_loadu_ps(p), s[r]));
        }
    }
}

kernel!(kernel_f32, f32, "avx2,fma,f16c", __m256, block_pf, |p| unsafe { _mm256_loadu_ps(p) }, gemv = gemv_rows);
kernel!(
    kernel_f16,
    f16,
    "avx2,fma,f16c",
    __m256,
    block_pf,
    |p| unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) },
    gemv = gemv_rows
);
kernel!(
    kernel_bf16,
    bf16,
    "avx2,fma,f16c",
    __m256,
    block_pf,
    |p| unsafe {
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i))))
    },
    gemv = gemv_rows
);

/// Few rows (decode): unroll k by 4 with independent accumulators, so the FMA latency
/// chain never limits how fast the panel streams in.
///
/// # Safety
/// AVX2 and FMA are available; `a` points at `R` rows of `kc` readable f32s, `lda`
/// apart; `b` at `kc` packed panel rows of [`NR`] elements; `load` may be called on
/// each of them (its own features available); `R ≤ MR`.
#[inline(always)]
unsafe fn gemv_rows<const R: usize, T>(
    a: *const f32,
    lda: usize,
    b: *const T,
    kc: usize,
    acc: &mut [[f32; NR]; MR],
    load: unsafe fn(*const T) -> __m256,
) {
    unsafe {
        let mut s = [[[_mm256_setzero_ps(); 2]; 4]; R];
        let mut k = 0;
        while k + 4 <= kc {
            for u in 0..4 {
                let b0 = load(b.add((k + u) * NR));
                let b1 = load(b.add((k + u) * NR + 8));
                for r in 0..R {
                    let av = _mm256_broadcast_ss(&*a.add(r * lda + k + u));
                    s[r][u][0] = _mm256_fmadd_ps(av, b0, s[r][u][0]);
                    s[r][u][1] = _mm256_fmadd_ps(av, b1, s[r][u][1]);
                }
            }
            k += 4;
        }
        while k < kc {
            let b0 = load(b.add(k * NR));
            let b1 = load(b.add(k * NR + 8));
            for r in 0..R {
                let av = _mm256_broadcast_ss(&*a.add(r * lda + k));
                s[r][0][0] = _mm256_fmadd_ps(av, b0, s[r][0][0]);
                s[r][0][1] = _mm256_fmadd_ps(av, b1, s[r][0][1]);
            }
            k += 1;
        }
        for r in 0..R {
            for h in 0..2 {
                let v = _mm256_add_ps(_mm256_add_ps(s[r][0][h], s[r][1][h]), _mm256_add_ps(s[r][2][h], s[r][3][h]));
                let p = acc[r].as_mut_ptr().add(8 * h);
                _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), v));
            }
        }
    }
}

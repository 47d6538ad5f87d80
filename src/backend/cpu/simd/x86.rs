//! The x86-64 kernels of [`super`]'s primitives: AVX2/FMA/F16C and AVX-512, each the
//! portable function's operations in the same order (so every path gives its bits).

use std::arch::x86_64::*;

use super::{SQRT_2_OVER_PI, TANH_CLAMP};

/// [`super::portable`] on x86-64: `f` compiled for FMA where the CPU has it.
#[inline(always)]
pub(crate) fn portable_with_fma<R>(f: impl FnOnce() -> R) -> R {
    if std::is_x86_feature_detected!("fma") {
        #[target_feature(enable = "fma")]
        fn with_fma<R>(f: impl FnOnce() -> R) -> R {
            f()
        }
        // SAFETY: the CPU has FMA (checked just above; std reports it only where the OS
        // also enables the AVX state that FMA's instructions use).
        return unsafe { with_fma(f) };
    }
    f()
}

/// `exp` and GELU written once over the vector width: the macro's body is the
/// portable [`super::exp`] and [`super::gelu_scalar`]'s operations in their order, and
/// each instantiation names one width's intrinsics (so every lane gives the portable
/// function's bits, on either width).
macro_rules! exp_gelu {
    (
        $features:literal, $v:ty, $exp:ident, $gelu:ident,
        set1 = $set1:ident, set1_i = $set1_i:ident, add = $add:ident, sub = $sub:ident,
        mul = $mul:ident, div = $div:ident, min = $min:ident, max = $max:ident,
        fmadd = $fmadd:ident, fnmadd = $fnmadd:ident, round = $round:ident,
        cvt_i = $cvt_i:ident, add_i = $add_i:ident, shl_i = $shl_i:ident, as_f = $as_f:ident
    ) => {
        /// [`super::exp`] on every lane: the same operations in the same order, so each
        /// lane is its bits.
        #[inline]
        #[target_feature(enable = $features)]
        pub(crate) fn $exp(x: $v) -> $v {
            let x = $min($max(x, $set1(-87.0)), $set1(88.0));
            let n =
                $round::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>($mul(x, $set1(std::f32::consts::LOG2_E)));
            // r = x - n·ln2, with ln2 split in two for accuracy.
            let r = $fnmadd(n, $set1(0.693_359_4), x);
            let r = $fnmadd(n, $set1(-2.121_944_4e-4), r);
            let mut p = $set1(1.987_569_1e-4);
            p = $fmadd(p, r, $set1(1.398_199_9e-3));
            p = $fmadd(p, r, $set1(8.333_452e-3));
            p = $fmadd(p, r, $set1(4.166_579_6e-2));
            p = $fmadd(p, r, $set1(1.666_666_5e-1));
            p = $fmadd(p, r, $set1(0.5));
            let r2 = $mul(r, r);
            p = $fmadd(p, r2, $add(r, $set1(1.0)));
            // Scale by 2^n through the exponent bits.
            let e = $shl_i::<23>($add_i($cvt_i(n), $set1_i(127)));
            $mul(p, $as_f(e))
        }

        /// GELU(x) = 0.5 x (1 + tanh(u)), tanh(u) = 1 - 2 / (exp(2u) + 1), u clamped.
        #[inline]
        #[target_feature(enable = $features)]
        pub(crate) fn $gelu(x: $v) -> $v {
            let x3 = $mul($mul(x, x), x);
            let u = $mul($set1(SQRT_2_OVER_PI), $fmadd($set1(0.044715), x3, x));
            let u = $min($max(u, $set1(-TANH_CLAMP)), $set1(TANH_CLAMP));
            let e = $exp($add(u, u));
            let one = $set1(1.0);
            let tanh = $sub(one, $div($set1(2.0), $add(e, one)));
            $mul($mul($set1(0.5), x), $add(one, tanh))
        }
    };
}

exp_gelu!(
    "avx2,fma",
    __m256,
    exp256,
    gelu256,
    set1 = _mm256_set1_ps,
    set1_i = _mm256_set1_epi32,
    add = _mm256_add_ps,
    sub = _mm256_sub_ps,
    mul = _mm256_mul_ps,
    div = _mm256_div_ps,
    min = _mm256_min_ps,
    max = _mm256_max_ps,
    fmadd = _mm256_fmadd_ps,
    fnmadd = _mm256_fnmadd_ps,
    round = _mm256_round_ps,
    cvt_i = _mm256_cvtps_epi32,
    add_i = _mm256_add_epi32,
    shl_i = _mm256_slli_epi32,
    as_f = _mm256_castsi256_ps
);
exp_gelu!(
    "avx512f,avx2,fma",
    __m512,
    exp512,
    gelu512,
    set1 = _mm512_set1_ps,
    set1_i = _mm512_set1_epi32,
    add = _mm512_add_ps,
    sub = _mm512_sub_ps,
    mul = _mm512_mul_ps,
    div = _mm512_div_ps,
    min = _mm512_min_ps,
    max = _mm512_max_ps,
    fmadd = _mm512_fmadd_ps,
    fnmadd = _mm512_fnmadd_ps,
    round = _mm512_roundscale_ps,
    cvt_i = _mm512_cvtps_epi32,
    add_i = _mm512_add_epi32,
    shl_i = _mm512_slli_epi32,
    as_f = _mm512_castsi512_ps
);

/// `out = gate / (1 + exp(-gate)) · up`, 8 lanes at a time (exp clamps its input, so
/// huge gates stay finite: silu(-1e30) = -0, silu(1e30) = 1e30).
///
/// # Safety
/// AVX2 and FMA are available; `gate`, `up` and `out` have the same length.
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn swiglu(gate: &[f32], up: &[f32], out: &mut [f32]) {
    let one = _mm256_set1_ps(1.0);
    let n8 = out.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        // SAFETY: i + 8 <= len of all three slices (equal lengths, checked by the caller).
        unsafe {
            let g = _mm256_loadu_ps(gate.as_ptr().add(i));
            let u = _mm256_loadu_ps(up.as_ptr().add(i));
            let e = exp256(_mm256_sub_ps(_mm256_setzero_ps(), g));
            let y = _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(one, e)), u);
            _mm256_storeu_ps(out.as_mut_ptr().add(i), y);
        }
    }
    for i in n8..out.len() {
        out[i] = super::silu_scalar(gate[i]) * up[i];
    }
}

/// [`gelu`] 16 lanes at a time (the tail as `gelu` does it): equal bits.
#[target_feature(enable = "avx512f,avx2,fma")]
pub(crate) fn gelu_avx512(v: &mut [f32]) {
    let mut chunks = v.chunks_exact_mut(16);
    for c in &mut chunks {
        // SAFETY: c has exactly 16 elements.
        unsafe { _mm512_storeu_ps(c.as_mut_ptr(), gelu512(_mm512_loadu_ps(c.as_ptr()))) };
    }
    gelu(chunks.into_remainder());
}

/// A GEMM tile row's epilogue in one register: `dst[0..16] = gelu?(acc + bias?)`,
/// each lane as [`gelu`] and a scalar add compute it.
///
/// # Safety
/// AVX-512 F, AVX2 and FMA are available; `dst` is valid for 16 writes.
#[inline]
#[target_feature(enable = "avx512f,avx2,fma")]
pub(crate) unsafe fn bias_gelu_store16(acc: &[f32; 16], bias: Option<&[f32; 16]>, gelu: bool, dst: *mut f32) {
    // SAFETY: `acc` and `bias` hold 16 values each; `dst` takes 16 (the caller's promise).
    unsafe {
        let mut v = _mm512_loadu_ps(acc.as_ptr());
        if let Some(b) = bias {
            v = _mm512_add_ps(v, _mm512_loadu_ps(b.as_ptr()));
        }
        if gelu {
            v = gelu512(v);
        }
        _mm512_storeu_ps(dst, v)
    }
}

#[target_feature(enable = "avx2,fma")]
pub(crate) fn gelu(v: &mut [f32]) {
    let mut chunks = v.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: c has exactly 8 elements.
        unsafe { _mm256_storeu_ps(c.as_mut_ptr(), gelu256(_mm256_loadu_ps(c.as_ptr()))) };
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let mut buf = [0.0f32; 8];
        buf[..rest.len()].copy_from_slice(rest);
        // SAFETY: buf has 8 elements.
        unsafe { _mm256_storeu_ps(buf.as_mut_ptr(), gelu256(_mm256_loadu_ps(buf.as_ptr()))) };
        rest.copy_from_slice(&buf[..rest.len()]);
    }
}

#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// # Safety
/// Needs AVX2, FMA and F16C; `rows.len() == scores.len() * q.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn dot_rows<T: super::KvElem>(q: &[f32], rows: &[T], scale: f32, scores: &mut [f32]) {
    let n = q.len();
    for (j, sc) in scores.iter_mut().enumerate() {
        // SAFETY: row j is inside `rows` (the caller's shape); `dot_by` inlines here.
        *sc = unsafe { dot_by(q, rows.get_unchecked(j * n..(j + 1) * n)) } * scale;
    }
}

/// Continues the sums from `out` when `add`, else from zero.
///
/// # Safety
/// Needs AVX2, FMA and F16C; `rows.len() == p.len() * out.len()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(crate) unsafe fn weighted_rows<T: super::KvElem>(p: &[f32], rows: &[T], out: &mut [f32], add: bool) {
    let n = out.len();
    let r = rows.as_ptr();
    // Columns in strips of up to 64 held in eight registers across all rows; each term
    // a multiply then an add, as the scalar `y += a * x` rounds.
    let mut c = 0;
    while c + 8 <= n {
        let w = ((n - c) / 8).min(8);
        let mut acc = [_mm256_setzero_ps(); 8];
        if add {
            for (u, a) in acc.iter_mut().enumerate().take(w) {
                // SAFETY: c + 8u + 8 ≤ n.
                *a = unsafe { _mm256_loadu_ps(out.as_ptr().add(c + 8 * u)) };
            }
        }
        for (j, &pj) in p.iter().enumerate() {
            let pv = _mm256_set1_ps(pj);
            for (u, a) in acc.iter_mut().enumerate().take(w) {
                // SAFETY: j < p.len() and c + 8u + 8 ≤ n, so the 8 values are inside row j.
                let v = unsafe { T::load8(r.add(j * n + c + 8 * u)) };
                *a = _mm256_add_ps(*a, _mm256_mul_ps(pv, v));
            }
        }
        for (u, a) in acc.iter().enumerate().take(w) {
            // SAFETY: c + 8u + 8 ≤ n.
            unsafe { _mm256_storeu_ps(out.as_mut_ptr().add(c + 8 * u), *a) };
        }
        c += 8 * w;
    }
    for (i, o) in out.iter_mut().enumerate().skip(c) {
        let mut acc = if add { *o } else { 0.0f32 };
        for (j, &pj) in p.iter().enumerate() {
            acc += pj * rows[j * n + i].widen();
        }
        *o = acc;
    }
}

/// An element type the row kernels read: f32, or f16 widened exactly (F16C).
pub trait Elem: Copy {
    /// Eight elements from `p`, as f32.
    ///
    /// # Safety
    /// Eight elements are readable at `p`; AVX2, FMA and F16C are available.
    unsafe fn load8(p: *const Self) -> __m256;
}

impl Elem for f32 {
    #[inline(always)]
    unsafe fn load8(p: *const f32) -> __m256 {
        // SAFETY: the caller's contract.
        unsafe { _mm256_loadu_ps(p) }
    }
}

impl Elem for half::f16 {
    #[inline(always)]
    unsafe fn load8(p: *const half::f16) -> __m256 {
        // SAFETY: the caller's contract (F16C included).
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }
}

/// # Safety
/// `a.len() == b.len()`; AVX2, FMA and F16C are available.
#[inline(always)]
unsafe fn dot_by<T: super::KvElem>(a: &[f32], b: &[T]) -> f32 {
    let n = a.len();
    let (pa, pb) = (a.as_ptr(), b.as_ptr());
    // SAFETY (all loads): i + 32 <= n or i + 8 <= n, both slices have n elements.
    unsafe {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 32 <= n {
            for (j, a) in acc.iter_mut().enumerate() {
                *a = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i + 8 * j)), T::load8(pb.add(i + 8 * j)), *a);
            }
            i += 32;
        }
        while i + 8 <= n {
            acc[0] = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), T::load8(pb.add(i)), acc[0]);
            i += 8;
        }
        let v = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let mut s = hsum(v);
        while i < n {
            s += a[i] * b[i].widen();
            i += 1;
        }
        s
    }
}

/// # Safety
/// `a.len() == b.len()`.
#[inline]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
    // SAFETY: the caller's contract; f32 loads need no F16C.
    unsafe { dot_by(a, b) }
}

/// The FMA peak probe written once over the vector width: twelve independent FMA
/// chains, then their sum (`forge bench --flops`).
macro_rules! fma_probe {
    ($features:literal, $name:ident, $set1:ident, $fmadd:ident, $add:ident, $zero:ident, $hsum:expr) => {
        #[target_feature(enable = $features)]
        pub(crate) fn $name(iters: usize) -> f32 {
            let (m, c) = ($set1(std::hint::black_box(0.999_999)), $set1(std::hint::black_box(1e-7)));
            let mut acc = [$set1(1.0); 12];
            for _ in 0..iters {
                for a in acc.iter_mut() {
                    *a = $fmadd(*a, m, c);
                }
            }
            $hsum(acc.iter().fold($zero(), |s, &a| $add(s, a)))
        }
    };
}

fma_probe!("avx2,fma", fma_probe256, _mm256_set1_ps, _mm256_fmadd_ps, _mm256_add_ps, _mm256_setzero_ps, hsum);
fma_probe!(
    "avx512f,avx2,fma",
    fma_probe512,
    _mm512_set1_ps,
    _mm512_fmadd_ps,
    _mm512_add_ps,
    _mm512_setzero_ps,
    _mm512_reduce_add_ps
);

#[target_feature(enable = "avx2,fma")]
pub(crate) fn sum(x: &[f32]) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 4];
    let chunks = x.chunks_exact(32);
    let tail: f32 = chunks.remainder().iter().sum();
    for c in chunks {
        for (j, a) in acc.iter_mut().enumerate() {
            // SAFETY: c has 32 elements.
            *a = _mm256_add_ps(*a, unsafe { _mm256_loadu_ps(c.as_ptr().add(8 * j)) });
        }
    }
    hsum(_mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]))) + tail
}

/// v[i] = exp(v[i] - max); returns the sum.
#[target_feature(enable = "avx2,fma")]
pub(crate) fn exp_sub_sum(v: &mut [f32], max: f32) -> f32 {
    let m = _mm256_set1_ps(max);
    let mut acc = _mm256_setzero_ps();
    let mut chunks = v.chunks_exact_mut(8);
    for c in &mut chunks {
        // SAFETY: c has 8 elements.
        unsafe {
            let e = exp256(_mm256_sub_ps(_mm256_loadu_ps(c.as_ptr()), m));
            _mm256_storeu_ps(c.as_mut_ptr(), e);
            acc = _mm256_add_ps(acc, e);
        }
    }
    let mut s = hsum(acc);
    for x in chunks.into_remainder() {
        *x = super::exp(*x - max);
        s += *x;
    }
    s
}

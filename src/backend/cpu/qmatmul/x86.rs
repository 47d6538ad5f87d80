//! The x86-64 kernels of [`super`]: the quantized panel dots on AVX2 (`maddubs`) and
//! AVX-512 VNNI (`vpdpbusd`), exact integer block dots scaled in the portable order.

use std::arch::x86_64::*;

use super::{BlockMeta, LANES, PANEL, QK, TOKENS, quantize_block_by};

/// How far ahead of the current step a panel's own weight stream is prefetched (bytes).
pub(super) const PF: usize = 1024;

/// Prefetch distances in bytes, quants and scales: `far == false` is the near
/// prefetch of the quants alone, to L1 (a panel streamed as it is read); `far`, both,
/// to L2 (the next panel, while several calls work on this one).
#[derive(Clone, Copy)]
pub(super) struct Prefetch {
    pub(super) far: bool,
    pub(super) quants: usize,
    pub(super) scales: usize,
}

/// Prefetch the quants' line `pf.quants` bytes past `q` (to L2 when `FAR`, else L1) and,
/// when `FAR` and `scales`, the scales' line `pf.scales` past `dm`.
#[inline(always)]
fn touch<const FAR: bool>(pf: Prefetch, q: *const u8, dm: *const u8, scales: bool) {
    // SAFETY: prefetches are hints, never dereferenced; the addresses are computed with
    // wrapping arithmetic.
    unsafe {
        if FAR {
            _mm_prefetch::<_MM_HINT_T1>(q.wrapping_add(pf.quants) as *const i8);
            if scales {
                _mm_prefetch::<_MM_HINT_T1>(dm.wrapping_add(pf.scales) as *const i8);
            }
        } else {
            _mm_prefetch::<_MM_HINT_T0>(q.wrapping_add(pf.quants) as *const i8);
        }
    }
}

/// Eight scales from `dm + i` (f16 when `H`, else f32), widened to f32.
///
/// # Safety
/// The eight are readable; AVX2 and F16C are available.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn scales8<const H: bool>(dm: *const u8, i: usize) -> __m256 {
    // SAFETY: the caller's contract.
    unsafe {
        if H {
            _mm256_cvtph_ps(_mm_loadu_si128(dm.add(2 * i) as *const __m128i))
        } else {
            _mm256_loadu_ps(dm.add(4 * i) as *const f32)
        }
    }
}

/// [`scales8`] for sixteen, on AVX-512.
///
/// # Safety
/// The sixteen are readable; AVX-512 F is available.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn scales16<const H: bool>(dm: *const u8, i: usize) -> __m512 {
    // SAFETY: the caller's contract.
    unsafe {
        if H {
            _mm512_cvtph_ps(_mm256_loadu_si256(dm.add(2 * i) as *const __m256i))
        } else {
            _mm512_loadu_ps(dm.add(4 * i) as *const f32)
        }
    }
}

/// One panel of sixteen interleaved rows (quants `qs`: `nb` blocks; scales `dm`, f16
/// when `H`, else f32; laid out as [`super::QMatrix`] says; type `TY`: 0 = Q8_0, 1 =
/// Q4_0, 2 = Q4_1) against `N` consecutive activation rows (`x`: N × nb × 32 i8; `d`,
/// `s`, `sum`: N × nb) into `out[..N]`, in the module doc's order, on AVX-512 VNNI.
/// Each register holds four bytes of all sixteen rows; `vpdpbusd` against four
/// activation bytes broadcast adds their products into each row's lane, so a block's
/// integer sums come out one row per lane. It multiplies unsigned by signed bytes:
/// Q8_0 runs on weights offset by 128 (`w ^ 0x80`), its sum started at `−128 · Σx`;
/// Q4_0's at `−8 · Σx` (nibbles − 8); Q4_1's at 0, its offsets `m · s` summed after.
/// Q6_K (`TY` 3: 24 quant bytes a row, `sub` its half-block i8 scales) sums each half
/// in its own chain, started at `−32 · Σx` of that half, then weights the halves by
/// their scales (`vpmulld`) before the block's scale.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C are available and every pointer covers
/// what is described above.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)] // i indexes several arrays
pub(super) unsafe fn panel_dot_vnni<const TY: u8, const H: bool, const N: usize, const FAR: bool>(
    qs: *const u8,
    dm: *const u8,
    sub: *const i8,
    nb: usize,
    pf: Prefetch,
    x: *const i8,
    d: *const f32,
    s: *const f32,
    sum: *const i32,
    sum_lo: *const i32,
    out: &mut [[f32; PANEL]; TOKENS],
) {
    let steps = match TY {
        0 => 8,
        3 => 6,
        _ => 4,
    };
    let ns = if TY == 2 { 2 } else { 1 };
    let row_stride = nb * QK;
    let (m4, flip) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(-128));
    let zero = _mm512_setzero_ps();
    // Activation row i's bytes j .. j + 4 of block b, broadcast to every lane.
    // SAFETY: block b of rows 0..N is readable (the caller's contract).
    let x4 = |i: usize, b: usize, j: usize| unsafe {
        _mm512_set1_epi32((x.add(i * row_stride + b * QK + j) as *const i32).read_unaligned())
    };
    // Block b against the N activation rows: the exact integer sums of the panel's
    // rows, one per lane, scaled by `d_w · d_x` into the block's float lane `b % 4`.
    // (The accumulators are indexed by a run-time lane, so they live in L1, a load and
    // a store per block and row: in registers, with the weights and broadcast
    // activations, they made the compiler spill worse.)
    let mut acc = [[zero; LANES]; N];
    for b in 0..nb {
        // SAFETY: block b of the panel (16 × 4 × steps bytes of quants, 16 · ns scales)
        // and of each activation row is in bounds (the caller's contract); prefetch
        // addresses are only hints.
        unsafe {
            let qp = qs.add(b * PANEL * 4 * steps);
            // Two chains of sums per row (the `vpdpbusd` latency), added at the end.
            let (mut isum, mut isum2) = ([_mm512_setzero_si512(); N], [_mm512_setzero_si512(); N]);
            for i in 0..N {
                let xs = *sum.add(i * nb + b);
                if TY == 0 {
                    isum[i] = _mm512_set1_epi32(-(xs << 7));
                } else if TY == 1 {
                    isum[i] = _mm512_set1_epi32(-(xs << 3));
                } else if TY == 3 {
                    let lo = *sum_lo.add(i * nb + b);
                    isum[i] = _mm512_set1_epi32(-(lo << 5));
                    isum2[i] = _mm512_set1_epi32(-((xs - lo) << 5));
                }
            }
            if TY == 3 {
                // Q6_K: four steps of low nibbles (values 4st.. and 16 + 4st..), their top
                // two bits from the two steps of highs: for value v, byte v % 8 of the
                // highs, bits 2·(v / 8), moved to bits 4-5 (16-bit shifts stay within
                // each byte for the bits kept by the mask).
                for line in 0..6 {
                    touch::<FAR>(pf, qp.add(64 * line), dm.add(b * PANEL * 2), line == 0);
                }
                let m30 = _mm512_set1_epi8(0x30);
                let qh = [_mm512_loadu_si512(qp.add(256) as *const _), _mm512_loadu_si512(qp.add(320) as *const _)];
                for st in 0..4 {
                    let q = _mm512_loadu_si512(qp.add(64 * st) as *const _);
                    let h = qh[st % 2];
                    let (hlo, hhi) = if st < 2 {
                        (_mm512_slli_epi16::<4>(h), h)
                    } else {
                        (_mm512_slli_epi16::<2>(h), _mm512_srli_epi16::<2>(h))
                    };
                    let lo = _mm512_or_si512(_mm512_and_si512(q, m4), _mm512_and_si512(hlo, m30));
                    let hi =
                        _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(q), m4), _mm512_and_si512(hhi, m30));
                    for i in 0..N {
                        isum[i] = _mm512_dpbusd_epi32(isum[i], lo, x4(i, b, 4 * st));
                        isum2[i] = _mm512_dpbusd_epi32(isum2[i], hi, x4(i, b, 16 + 4 * st));
                    }
                }
                let scale_of =
                    |h: usize| _mm512_cvtepi8_epi32(_mm_loadu_si128(sub.add((2 * b + h) * PANEL) as *const __m128i));
                let (s0, s1) = (scale_of(0), scale_of(1));
                for i in 0..N {
                    isum[i] = _mm512_mullo_epi32(isum[i], s0);
                    isum2[i] = _mm512_mullo_epi32(isum2[i], s1);
                }
            }
            // (Q6_K's steps were done above.)
            for st in 0..if TY == 3 { 0 } else { steps } {
                touch::<FAR>(pf, qp.add(64 * st), dm.add(b * ns * PANEL * if H { 2 } else { 4 }), st == 0);
                let q = _mm512_loadu_si512(qp.add(64 * st) as *const _);
                if TY == 0 {
                    let a = _mm512_xor_si512(q, flip);
                    for i in 0..N {
                        if st % 2 == 0 {
                            isum[i] = _mm512_dpbusd_epi32(isum[i], a, x4(i, b, 4 * st));
                        } else {
                            isum2[i] = _mm512_dpbusd_epi32(isum2[i], a, x4(i, b, 4 * st));
                        }
                    }
                } else {
                    let lo = _mm512_and_si512(q, m4);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4);
                    for i in 0..N {
                        isum[i] = _mm512_dpbusd_epi32(isum[i], lo, x4(i, b, 4 * st));
                        isum2[i] = _mm512_dpbusd_epi32(isum2[i], hi, x4(i, b, 16 + 4 * st));
                    }
                }
            }
            let dw = scales16::<H>(dm, b * ns * PANEL);
            let k = b % LANES;
            for i in 0..N {
                let scale = _mm512_mul_ps(dw, _mm512_set1_ps(*d.add(i * nb + b)));
                let v = _mm512_cvtepi32_ps(_mm512_add_epi32(isum[i], isum2[i]));
                acc[i][k] = _mm512_fmadd_ps(scale, v, acc[i][k]);
            }
        }
    }
    // Q4_1's offsets `m_w · s_x`, in their own lanes (in L1 as the accumulators).
    let mut off = [[zero; LANES]; N];
    if TY == 2 {
        for b in 0..nb {
            // SAFETY: block b's `m` scales and each row's `s` are in bounds.
            unsafe {
                let mw = scales16::<H>(dm, (b * 2 + 1) * PANEL);
                for i in 0..N {
                    off[i][b % LANES] = _mm512_fmadd_ps(mw, _mm512_set1_ps(*s.add(i * nb + b)), off[i][b % LANES]);
                }
            }
        }
    }
    for i in 0..N {
        let t: [__m512; LANES] =
            std::array::from_fn(|k| if TY == 2 { _mm512_add_ps(acc[i][k], off[i][k]) } else { acc[i][k] });
        let r = _mm512_add_ps(_mm512_add_ps(t[0], t[2]), _mm512_add_ps(t[1], t[3]));
        // SAFETY: out[i] is 16 f32s.
        unsafe { _mm512_storeu_ps(out[i].as_mut_ptr(), r) };
    }
}

/// [`panel_dot_vnni`] on AVX2, the panel's rows in two halves of eight (one 256-bit
/// lane per row): `maddubs` multiplies unsigned by signed bytes in pairs and `madd`
/// sums the pairs, so Q8_0 runs as `|w| · (x with w's sign)` (within i16: |x| ≤ 127),
/// Q4 on the nibbles as they are, a block's four steps summed in 16 bits (each step
/// adds four products, within ±7620, to a lane: ±30480 after four) before one `madd`. The
/// same exact integer sums and float order, so the results are bit-identical to
/// [`panel_dot_vnni`]'s and the portable path's. (With half the registers of AVX-512,
/// the accumulators live in L1, indexed by a run-time lane.)
///
/// # Safety
/// AVX2, FMA and F16C are available and every pointer covers what [`panel_dot_vnni`]
/// describes.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)] // i indexes several arrays
pub(super) unsafe fn panel_dot_avx2<const TY: u8, const H: bool, const N: usize, const FAR: bool>(
    qs: *const u8,
    dm: *const u8,
    sub: *const i8,
    nb: usize,
    pf: Prefetch,
    x: *const i8,
    d: *const f32,
    s: *const f32,
    sum: *const i32,
    sum_lo: *const i32,
    out: &mut [[f32; PANEL]; TOKENS],
) {
    let steps = match TY {
        0 => 8,
        3 => 6,
        _ => 4,
    };
    let ns = if TY == 2 { 2 } else { 1 };
    let row_stride = nb * QK;
    let (ones, m4) = (_mm256_set1_epi16(1), _mm256_set1_epi8(0x0F));
    let (zero, zero_i) = (_mm256_setzero_ps(), _mm256_setzero_si256());
    // SAFETY: as in `panel_dot_vnni`.
    let x4 = |i: usize, b: usize, j: usize| unsafe {
        _mm256_set1_epi32((x.add(i * row_stride + b * QK + j) as *const i32).read_unaligned())
    };
    // [row][half][lane], and Q4_1's offsets the same way.
    let mut acc = [[[zero; LANES]; 2]; N];
    let mut off = [[[zero; LANES]; 2]; N];
    for b in 0..nb {
        // SAFETY: as in `panel_dot_vnni`; each 64-byte step holds the two halves.
        unsafe {
            let qp = qs.add(b * PANEL * 4 * steps);
            let mut isum = [[zero_i; 2]; N];
            if TY == 3 {
                // Q6_K as on VNNI (values rebuilt from nibbles and highs), each half's
                // products widened to 32 bits per step (two steps would fit 16 bits, four
                // would not), then `− 32 · Σx` and the half's scale.
                let m30 = _mm256_set1_epi8(0x30);
                for line in 0..6 {
                    touch::<FAR>(pf, qp.add(64 * line), dm.add(b * PANEL * 2), line == 0);
                }
                for h in 0..2 {
                    let qh = [
                        _mm256_loadu_si256(qp.add(256 + 32 * h) as *const __m256i),
                        _mm256_loadu_si256(qp.add(320 + 32 * h) as *const __m256i),
                    ];
                    let (mut sa, mut sb) = ([zero_i; N], [zero_i; N]);
                    for st in 0..4 {
                        let q = _mm256_loadu_si256(qp.add(64 * st + 32 * h) as *const __m256i);
                        let hh = qh[st % 2];
                        let (hlo, hhi) = if st < 2 {
                            (_mm256_slli_epi16::<4>(hh), hh)
                        } else {
                            (_mm256_slli_epi16::<2>(hh), _mm256_srli_epi16::<2>(hh))
                        };
                        let lo = _mm256_or_si256(_mm256_and_si256(q, m4), _mm256_and_si256(hlo, m30));
                        let hi = _mm256_or_si256(
                            _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4),
                            _mm256_and_si256(hhi, m30),
                        );
                        for i in 0..N {
                            let pa = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, x4(i, b, 4 * st)), ones);
                            let pb = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, x4(i, b, 16 + 4 * st)), ones);
                            sa[i] = _mm256_add_epi32(sa[i], pa);
                            sb[i] = _mm256_add_epi32(sb[i], pb);
                        }
                    }
                    let scale_of = |half: usize| {
                        _mm256_cvtepi8_epi32(_mm_loadl_epi64(sub.add((2 * b + half) * PANEL + 8 * h) as *const __m128i))
                    };
                    let (s0, s1) = (scale_of(0), scale_of(1));
                    for i in 0..N {
                        let lo_sum = *sum_lo.add(i * nb + b);
                        let hi_sum = *sum.add(i * nb + b) - lo_sum;
                        let a = _mm256_sub_epi32(sa[i], _mm256_set1_epi32(lo_sum << 5));
                        let c = _mm256_sub_epi32(sb[i], _mm256_set1_epi32(hi_sum << 5));
                        isum[i][h] = _mm256_add_epi32(_mm256_mullo_epi32(a, s0), _mm256_mullo_epi32(c, s1));
                    }
                }
            }
            // (Q6_K's steps were done above.)
            for st in 0..if TY == 3 { 0 } else { steps } {
                touch::<FAR>(pf, qp.add(64 * st), dm.add(b * ns * PANEL * if H { 2 } else { 4 }), st == 0);
                for h in 0..2 {
                    let q = _mm256_loadu_si256(qp.add(64 * st + 32 * h) as *const __m256i);
                    if TY == 0 {
                        let a = _mm256_sign_epi8(q, q);
                        for i in 0..N {
                            let p16 = _mm256_maddubs_epi16(a, _mm256_sign_epi8(x4(i, b, 4 * st), q));
                            isum[i][h] = _mm256_add_epi32(isum[i][h], _mm256_madd_epi16(p16, ones));
                        }
                    } else {
                        let lo = _mm256_and_si256(q, m4);
                        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4);
                        for i in 0..N {
                            let pair = _mm256_add_epi16(
                                _mm256_maddubs_epi16(lo, x4(i, b, 4 * st)),
                                _mm256_maddubs_epi16(hi, x4(i, b, 16 + 4 * st)),
                            );
                            // 16-bit partial sums, widened after the last step.
                            isum[i][h] = _mm256_add_epi16(isum[i][h], pair);
                        }
                    }
                }
            }
            let k = b % LANES;
            for h in 0..2 {
                let dw = scales8::<H>(dm, b * ns * PANEL + 8 * h);
                for i in 0..N {
                    let isum = if TY == 0 || TY == 3 {
                        isum[i][h]
                    } else {
                        let wide = _mm256_madd_epi16(isum[i][h], ones);
                        if TY == 1 {
                            _mm256_sub_epi32(wide, _mm256_set1_epi32(*sum.add(i * nb + b) << 3))
                        } else {
                            wide
                        }
                    };
                    let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*d.add(i * nb + b)));
                    acc[i][h][k] = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(isum), acc[i][h][k]);
                }
                if TY == 2 {
                    let mw = scales8::<H>(dm, (b * 2 + 1) * PANEL + 8 * h);
                    for i in 0..N {
                        off[i][h][k] = _mm256_fmadd_ps(mw, _mm256_set1_ps(*s.add(i * nb + b)), off[i][h][k]);
                    }
                }
            }
        }
    }
    for i in 0..N {
        for h in 0..2 {
            let t: [__m256; LANES] =
                std::array::from_fn(|k| if TY == 2 { _mm256_add_ps(acc[i][h][k], off[i][h][k]) } else { acc[i][h][k] });
            let r = _mm256_add_ps(_mm256_add_ps(t[0], t[2]), _mm256_add_ps(t[1], t[3]));
            // SAFETY: out[i] is 16 f32s; lanes 8h .. 8h + 8.
            unsafe { _mm256_storeu_ps(out[i].as_mut_ptr().add(8 * h), r) };
        }
    }
}

/// `d` and `s` rounded to f16 (nearest even, as `half` rounds) and back, through F16C: the
/// vector quantizers' `to_f16`.
#[inline]
#[target_feature(enable = "f16c")]
pub(super) fn f16c_round_pair(d: f32, s: f32) -> (f32, f32) {
    let v = _mm_cvtph_ps(_mm_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm_setr_ps(d, s, 0.0, 0.0)));
    (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_shuffle_ps::<1>(v, v)))
}

/// [`quantize_block`], the same source compiled for AVX-512, where the compiler vectorizes
/// it sixteen wide (the baseline build has 128-bit SSE only), with the sums as two
/// widening vector reductions and `d`, `s` through F16C (the compiler had left 32 scalar
/// adds and a software f16 conversion: 5-7% of a 16-sequence decode step). The same bits:
/// integer sums are exact in any order, F16C rounds to nearest even as `half` does, and
/// the compiler keeps IEEE semantics (no contraction, Rust's saturating casts) whatever
/// the ISA.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) fn quantize_block_avx512(xb: &[f32; QK], qb: &mut [i8; QK]) -> BlockMeta {
    let sums = |qb: &[i8; QK]| {
        // SAFETY: `qb` holds 32 bytes; AVX-512 F is enabled for this function.
        unsafe {
            let half = |at: usize| {
                _mm512_reduce_add_epi32(_mm512_cvtepi8_epi32(_mm_loadu_si128(qb.as_ptr().add(at) as *const __m128i)))
            };
            let lo = half(0);
            (lo + half(16), lo)
        }
    };
    // (A closure: a `#[target_feature]` fn is not an `Fn`; F16C is enabled here.)
    let to_f16 = |d: f32, s: f32| f16c_round_pair(d, s);
    // A tree of maxima (the fold above is a chain of 32 dependent ones).
    let amax = |xb: &[f32; QK]| {
        // SAFETY: `xb` holds 32 floats; AVX-512 F is enabled for this function.
        unsafe {
            let (a, b) = (_mm512_loadu_ps(xb.as_ptr()), _mm512_loadu_ps(xb.as_ptr().add(16)));
            _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)))
        }
    };
    quantize_block_by(xb, qb, amax, sums, to_f16)
}

/// [`quantize_block`] for AVX2 hosts, as [`quantize_block_avx512`] is for AVX-512 ones:
/// the same source eight wide (the baseline build rounds through a `truncf` call per
/// value: 4% of a GPT-2 Q4_0 decode step on a Zen 3), the sums and maxima as vector
/// reductions, `d` and `s` through F16C. The same bits, for the same reasons.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn quantize_block_avx2(xb: &[f32; QK], qb: &mut [i8; QK]) -> BlockMeta {
    let sums = |qb: &[i8; QK]| {
        // SAFETY: `qb` holds 32 bytes; AVX2 is enabled for this function.
        unsafe {
            let half = |at: usize| {
                let b = _mm_loadu_si128(qb.as_ptr().add(at) as *const __m128i);
                // Sixteen i8 to i16, pairwise to eight i32, then a tree of adds.
                let w = _mm256_madd_epi16(_mm256_cvtepi8_epi16(b), _mm256_set1_epi16(1));
                let q = _mm_add_epi32(_mm256_castsi256_si128(w), _mm256_extracti128_si256::<1>(w));
                let q = _mm_add_epi32(q, _mm_unpackhi_epi64(q, q));
                _mm_cvtsi128_si32(_mm_add_epi32(q, _mm_shuffle_epi32::<0b01>(q)))
            };
            let lo = half(0);
            (lo + half(16), lo)
        }
    };
    // (A closure: a `#[target_feature]` fn is not an `Fn`; F16C is enabled here.)
    let to_f16 = |d: f32, s: f32| f16c_round_pair(d, s);
    // A tree of maxima of the magnitudes (sign bits cleared), as on AVX-512.
    let amax = |xb: &[f32; QK]| {
        // SAFETY: `xb` holds 32 floats; AVX is enabled for this function.
        unsafe {
            let abs = |i: usize| _mm256_andnot_ps(_mm256_set1_ps(-0.0), _mm256_loadu_ps(xb.as_ptr().add(8 * i)));
            let m = _mm256_max_ps(_mm256_max_ps(abs(0), abs(1)), _mm256_max_ps(abs(2), abs(3)));
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<1>(m, m)))
        }
    };
    quantize_block_by(xb, qb, amax, sums, to_f16)
}

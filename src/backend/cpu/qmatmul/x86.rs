//! The x86-64 kernels of [`super`]: the quantized panel dot, written once over the
//! vector width ([`Lanes`]) and compiled for AVX2 (`maddubs`) and AVX-512 VNNI
//! (`vpdpbusd`): exact integer block dots scaled in the portable order.

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

/// What differs between the two x86 widths of a panel dot: a register holds four bytes
/// of [`Lanes::ROWS`] panel rows, and four u8 · i8 products are added into each row's
/// 32-bit lane by `vpdpbusd` on AVX-512 VNNI ([`Vnni`]: sixteen rows, the panel in one
/// part) or by `maddubs` + `madd` on AVX2 ([`Avx2`]: eight rows, two parts). The kernel
/// [`panel_dot`] is written once over it. Both give the same exact integer sums and the
/// float steps are the same, so the results are bit-identical to each other's and to the
/// portable path's.
///
/// A value of an implementing type is the proof that its instruction set is available:
/// only an `unsafe` constructor makes one, called inside [`panel_dot_avx2`] or
/// [`panel_dot_vnni`], whose callers guarantee the features. Every method is inlined
/// into those functions.
trait Lanes: Copy {
    /// Panel rows per register.
    const ROWS: usize;
    /// Separate chains of Q8_0 sums per row (two hide `vpdpbusd`'s latency; AVX2 has half
    /// the registers).
    const Q8_CHAINS: usize;
    /// Q8_0's chain starts at `−Q8_BIAS · Σx` (VNNI multiplies unsigned bytes, so it runs
    /// on the weights offset by 128; AVX2 moves the signs to the activations instead).
    const Q8_BIAS: i32;
    /// A register of `ROWS` 32-bit (or 8- and 16-bit) integer lanes.
    type I: Copy;
    /// A register of `ROWS` f32 lanes.
    type F: Copy;
    /// The running integer sums of one row over a Q4 block's steps.
    type Nib: Copy;
    /// One `T` per part of the panel (`[T; PANEL / ROWS]`).
    type Parts<T: Copy>: Copy + std::ops::IndexMut<usize, Output = T>;

    /// `v` in every part.
    fn parts<T: Copy>(self, v: T) -> Self::Parts<T>;

    /// Four bytes of each of `ROWS` rows at `p`.
    ///
    /// # Safety
    /// `4 · ROWS` bytes at `p` are readable.
    unsafe fn load(self, p: *const u8) -> Self::I;
    /// The four bytes at `p` in every 32-bit lane.
    ///
    /// # Safety
    /// Four bytes at `p` are readable.
    unsafe fn bcast4(self, p: *const i8) -> Self::I;
    /// `ROWS` i8 scales at `p`, widened to i32.
    ///
    /// # Safety
    /// `ROWS` bytes at `p` are readable.
    unsafe fn widen_i8(self, p: *const i8) -> Self::I;
    /// `ROWS` scales from `dm + i` (f16 when `H`, else f32), widened to f32.
    ///
    /// # Safety
    /// The `ROWS` scales are readable.
    unsafe fn scales<const H: bool>(self, dm: *const u8, i: usize) -> Self::F;
    /// Stores `ROWS` floats at `p`.
    ///
    /// # Safety
    /// `ROWS` floats at `p` are writable.
    unsafe fn store(self, p: *mut f32, v: Self::F);

    fn zero_i(self) -> Self::I;
    fn splat_i8(self, v: i8) -> Self::I;
    fn splat_i32(self, v: i32) -> Self::I;
    fn and(self, a: Self::I, b: Self::I) -> Self::I;
    fn or(self, a: Self::I, b: Self::I) -> Self::I;
    /// 16-bit lanes shifted by 2 or 4 (`LEFT` or right).
    fn shift16<const LEFT: bool, const K: u32>(self, a: Self::I) -> Self::I;
    fn add_i32(self, a: Self::I, b: Self::I) -> Self::I;
    fn mul_i32(self, a: Self::I, b: Self::I) -> Self::I;
    /// `acc` + the four products of unsigned `u` and signed `x` per lane, exactly where
    /// each pair of products sums within i16 (AVX2's `maddubs`): `u` ≤ 63 against any
    /// i8, or `u` ≤ 128 against |x| ≤ 127 as [`Lanes::dot4_q8`] uses it.
    fn dot4(self, acc: Self::I, u: Self::I, x: Self::I) -> Self::I;
    /// Q8_0 weights `w` made ready for [`Lanes::dot4_q8`], once for all activation rows.
    fn prep_q8(self, w: Self::I) -> Self::I;
    /// `acc` + the four products of signed weights `w` (`wp` = `prep_q8(w)`) and `x` per
    /// lane, + `Q8_BIAS · Σx`.
    fn dot4_q8(self, acc: Self::I, wp: Self::I, w: Self::I, x: Self::I) -> Self::I;
    fn nib_zero(self) -> Self::Nib;
    /// One Q4 step: low nibbles `lo` against `xa`, high `hi` against `xb`.
    fn nib_step(self, acc: Self::Nib, lo: Self::I, hi: Self::I, xa: Self::I, xb: Self::I) -> Self::Nib;
    /// The block's 32-bit sums.
    fn nib_end(self, acc: Self::Nib) -> Self::I;

    fn zero_f(self) -> Self::F;
    fn splat_f(self, v: f32) -> Self::F;
    fn add_f(self, a: Self::F, b: Self::F) -> Self::F;
    fn mul_f(self, a: Self::F, b: Self::F) -> Self::F;
    /// `a · b + c`, fused.
    fn fma_f(self, a: Self::F, b: Self::F, c: Self::F) -> Self::F;
    fn to_f(self, a: Self::I) -> Self::F;
}

/// The [`Lanes`] methods that are the same at both widths but for the intrinsics' names.
macro_rules! same_shape {
    (
        int: $i:ty, float: $f:ty,
        load: $load:ident, store: $store:ident, zero_i: $zero_i:ident,
        set1_8: $set1_8:ident, set1_32: $set1_32:ident, and: $and:ident,
        or: $or:ident, add_32: $add_32:ident, mullo_32: $mullo_32:ident,
        zero_f: $zero_f:ident, set1_f: $set1_f:ident, add_f: $add_f:ident,
        mul_f: $mul_f:ident, fmadd: $fmadd:ident, cvt: $cvt:ident
    ) => {
        #[inline(always)]
        unsafe fn load(self, p: *const u8) -> $i {
            isa!($load(p as *const $i))
        }
        #[inline(always)]
        unsafe fn bcast4(self, p: *const i8) -> $i {
            isa!($set1_32((p as *const i32).read_unaligned()))
        }
        #[inline(always)]
        unsafe fn store(self, p: *mut f32, v: $f) {
            isa!($store(p, v))
        }
        #[inline(always)]
        fn zero_i(self) -> $i {
            isa!($zero_i())
        }
        #[inline(always)]
        fn splat_i8(self, v: i8) -> $i {
            isa!($set1_8(v))
        }
        #[inline(always)]
        fn splat_i32(self, v: i32) -> $i {
            isa!($set1_32(v))
        }
        #[inline(always)]
        fn and(self, a: $i, b: $i) -> $i {
            isa!($and(a, b))
        }
        #[inline(always)]
        fn or(self, a: $i, b: $i) -> $i {
            isa!($or(a, b))
        }
        #[inline(always)]
        fn add_i32(self, a: $i, b: $i) -> $i {
            isa!($add_32(a, b))
        }
        #[inline(always)]
        fn mul_i32(self, a: $i, b: $i) -> $i {
            isa!($mullo_32(a, b))
        }
        #[inline(always)]
        fn zero_f(self) -> $f {
            isa!($zero_f())
        }
        #[inline(always)]
        fn splat_f(self, v: f32) -> $f {
            isa!($set1_f(v))
        }
        #[inline(always)]
        fn add_f(self, a: $f, b: $f) -> $f {
            isa!($add_f(a, b))
        }
        #[inline(always)]
        fn mul_f(self, a: $f, b: $f) -> $f {
            isa!($mul_f(a, b))
        }
        #[inline(always)]
        fn fma_f(self, a: $f, b: $f, c: $f) -> $f {
            isa!($fmadd(a, b, c))
        }
        #[inline(always)]
        fn to_f(self, a: $i) -> $f {
            isa!($cvt(a))
        }
    };
}

use proof::{Avx2, Vnni};

/// The two widths, in a module of their own so that nothing else can make one without
/// `unsafe`.
mod proof {
    /// AVX2 (with FMA and F16C): eight rows a register.
    #[derive(Clone, Copy)]
    pub(super) struct Avx2(());

    /// AVX-512 F/BW/VL with VNNI: sixteen rows a register.
    #[derive(Clone, Copy)]
    pub(super) struct Vnni(());

    impl Avx2 {
        /// # Safety
        /// AVX2, FMA and F16C are available.
        pub(super) unsafe fn new() -> Self {
            Avx2(())
        }
    }

    impl Vnni {
        /// # Safety
        /// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C are available.
        pub(super) unsafe fn new() -> Self {
            Vnni(())
        }
    }
}

/// Intrinsics inside a [`Lanes`] method.
macro_rules! isa {
    ($e:expr) => {{
        // SAFETY: a value of the implementing type exists only where its instruction set
        // is available (see `Lanes`); a method that reads or writes through a pointer
        // passes on its own `# Safety` contract.
        unsafe { $e }
    }};
}

// An `Avx2` exists only where AVX2, FMA and F16C are available (see `Lanes`).
impl Lanes for Avx2 {
    const ROWS: usize = 8;
    const Q8_CHAINS: usize = 1;
    const Q8_BIAS: i32 = 0;
    type I = __m256i;
    type F = __m256;
    /// 16-bit partial sums: a step adds four products, within ±7620, to a lane, ±30480
    /// after a block's four; widened by one `madd` at the end.
    type Nib = __m256i;
    type Parts<T: Copy> = [T; 2];

    same_shape! {
        int: __m256i, float: __m256,
        load: _mm256_loadu_si256, store: _mm256_storeu_ps, zero_i: _mm256_setzero_si256,
        set1_8: _mm256_set1_epi8, set1_32: _mm256_set1_epi32, and: _mm256_and_si256,
        or: _mm256_or_si256, add_32: _mm256_add_epi32, mullo_32: _mm256_mullo_epi32,
        zero_f: _mm256_setzero_ps, set1_f: _mm256_set1_ps, add_f: _mm256_add_ps,
        mul_f: _mm256_mul_ps, fmadd: _mm256_fmadd_ps, cvt: _mm256_cvtepi32_ps
    }

    #[inline(always)]
    fn parts<T: Copy>(self, v: T) -> [T; 2] {
        [v; 2]
    }

    #[inline(always)]
    unsafe fn widen_i8(self, p: *const i8) -> __m256i {
        isa!(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
    }
    #[inline(always)]
    unsafe fn scales<const H: bool>(self, dm: *const u8, i: usize) -> __m256 {
        // SAFETY: the ISA (see `Lanes`) and the caller's contract for `dm`.
        unsafe {
            if H {
                _mm256_cvtph_ps(_mm_loadu_si128(dm.add(2 * i) as *const __m128i))
            } else {
                _mm256_loadu_ps(dm.add(4 * i) as *const f32)
            }
        }
    }
    #[inline(always)]
    fn shift16<const LEFT: bool, const K: u32>(self, a: __m256i) -> __m256i {
        // SAFETY: the ISA (see `Lanes`).
        unsafe {
            match (LEFT, K) {
                (true, 2) => _mm256_slli_epi16::<2>(a),
                (true, 4) => _mm256_slli_epi16::<4>(a),
                (false, 2) => _mm256_srli_epi16::<2>(a),
                (false, 4) => _mm256_srli_epi16::<4>(a),
                _ => unreachable!("shifts by 2 or 4"),
            }
        }
    }
    /// Pairs within i16: 2 · 63 · 127 < 2¹⁵.
    #[inline(always)]
    fn dot4(self, acc: __m256i, u: __m256i, x: __m256i) -> __m256i {
        isa!(_mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, x), _mm256_set1_epi16(1))))
    }
    /// `|w|`; the products run as `|w| · (x with w's sign)`, pairs within i16 as
    /// |x| ≤ 127.
    #[inline(always)]
    fn prep_q8(self, w: __m256i) -> __m256i {
        isa!(_mm256_sign_epi8(w, w))
    }
    #[inline(always)]
    fn dot4_q8(self, acc: __m256i, wp: __m256i, w: __m256i, x: __m256i) -> __m256i {
        self.dot4(acc, wp, isa!(_mm256_sign_epi8(x, w)))
    }
    #[inline(always)]
    fn nib_zero(self) -> __m256i {
        self.zero_i()
    }
    #[inline(always)]
    fn nib_step(self, acc: __m256i, lo: __m256i, hi: __m256i, xa: __m256i, xb: __m256i) -> __m256i {
        isa!(_mm256_add_epi16(acc, _mm256_add_epi16(_mm256_maddubs_epi16(lo, xa), _mm256_maddubs_epi16(hi, xb))))
    }
    #[inline(always)]
    fn nib_end(self, acc: __m256i) -> __m256i {
        isa!(_mm256_madd_epi16(acc, _mm256_set1_epi16(1)))
    }
}

// A `Vnni` exists only where AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C are available
// (see `Lanes`).
impl Lanes for Vnni {
    const ROWS: usize = 16;
    const Q8_CHAINS: usize = 2;
    const Q8_BIAS: i32 = 128;
    type I = __m512i;
    type F = __m512;
    /// Two chains of sums (the `vpdpbusd` latency), added at the end.
    type Nib = (__m512i, __m512i);
    type Parts<T: Copy> = [T; 1];

    same_shape! {
        int: __m512i, float: __m512,
        load: _mm512_loadu_si512, store: _mm512_storeu_ps, zero_i: _mm512_setzero_si512,
        set1_8: _mm512_set1_epi8, set1_32: _mm512_set1_epi32, and: _mm512_and_si512,
        or: _mm512_or_si512, add_32: _mm512_add_epi32, mullo_32: _mm512_mullo_epi32,
        zero_f: _mm512_setzero_ps, set1_f: _mm512_set1_ps, add_f: _mm512_add_ps,
        mul_f: _mm512_mul_ps, fmadd: _mm512_fmadd_ps, cvt: _mm512_cvtepi32_ps
    }

    #[inline(always)]
    fn parts<T: Copy>(self, v: T) -> [T; 1] {
        [v]
    }

    #[inline(always)]
    unsafe fn widen_i8(self, p: *const i8) -> __m512i {
        isa!(_mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i)))
    }
    #[inline(always)]
    unsafe fn scales<const H: bool>(self, dm: *const u8, i: usize) -> __m512 {
        // SAFETY: the ISA (see `Lanes`) and the caller's contract for `dm`.
        unsafe {
            if H {
                _mm512_cvtph_ps(_mm256_loadu_si256(dm.add(2 * i) as *const __m256i))
            } else {
                _mm512_loadu_ps(dm.add(4 * i) as *const f32)
            }
        }
    }
    #[inline(always)]
    fn shift16<const LEFT: bool, const K: u32>(self, a: __m512i) -> __m512i {
        // SAFETY: the ISA (see `Lanes`).
        unsafe {
            match (LEFT, K) {
                (true, 2) => _mm512_slli_epi16::<2>(a),
                (true, 4) => _mm512_slli_epi16::<4>(a),
                (false, 2) => _mm512_srli_epi16::<2>(a),
                (false, 4) => _mm512_srli_epi16::<4>(a),
                _ => unreachable!("shifts by 2 or 4"),
            }
        }
    }
    #[inline(always)]
    fn dot4(self, acc: __m512i, u: __m512i, x: __m512i) -> __m512i {
        isa!(_mm512_dpbusd_epi32(acc, u, x))
    }
    /// `w + 128` as unsigned bytes (`w ^ 0x80`).
    #[inline(always)]
    fn prep_q8(self, w: __m512i) -> __m512i {
        isa!(_mm512_xor_si512(w, _mm512_set1_epi8(-128)))
    }
    #[inline(always)]
    fn dot4_q8(self, acc: __m512i, wp: __m512i, _w: __m512i, x: __m512i) -> __m512i {
        self.dot4(acc, wp, x)
    }
    #[inline(always)]
    fn nib_zero(self) -> (__m512i, __m512i) {
        (self.zero_i(), self.zero_i())
    }
    #[inline(always)]
    fn nib_step(
        self,
        acc: (__m512i, __m512i),
        lo: __m512i,
        hi: __m512i,
        xa: __m512i,
        xb: __m512i,
    ) -> (__m512i, __m512i) {
        (self.dot4(acc.0, lo, xa), self.dot4(acc.1, hi, xb))
    }
    #[inline(always)]
    fn nib_end(self, acc: (__m512i, __m512i)) -> __m512i {
        self.add_i32(acc.0, acc.1)
    }
}

/// One panel of sixteen interleaved rows (quants `qs`: `nb` blocks; scales `dm`, f16
/// when `H`, else f32; laid out as [`super::QMatrix`] says; type `TY`: 0 = Q8_0, 1 =
/// Q4_0, 2 = Q4_1, 3 = Q6_K) against `N` consecutive activation rows (`x`: N × nb × 32
/// i8; `d`, `s`, `sum`, `sum_lo`: N × nb) into `out[..N]`, in the module doc's order,
/// on the vector width `L`.
///
/// Each register holds four bytes of `L::ROWS` rows; four activation bytes broadcast
/// are multiplied into each row's lane ([`Lanes::dot4`]), so a block's integer sums come
/// out one row per lane. Q8_0 starts at `−Q8_BIAS · Σx` ([`Lanes::dot4_q8`]); Q4_0's
/// nibbles run as they are, `8 · Σx` taken off at the block's end; Q4_1's offsets
/// `m · s` are summed in their own lanes. Q6_K (24 quant bytes a row, `sub` its
/// half-block i8 scales) rebuilds its values from the low nibbles and the highs and sums
/// each half in its own chain, started at `−32 · Σx` of that half, then weights the
/// halves by their scales before the block's scale. (The float accumulators are indexed
/// by a run-time lane, so they live in L1, a load and a store per block and row: in
/// registers, with the weights and broadcast activations, they made the compiler spill
/// worse.)
///
/// # Safety
/// `l`'s instruction set is available (a value of `L` is the proof) and every pointer
/// covers what is described above.
#[inline(always)]
#[allow(clippy::too_many_arguments, clippy::needless_range_loop)] // i indexes several arrays
unsafe fn panel_dot<L: Lanes, const TY: u8, const H: bool, const N: usize, const FAR: bool>(
    l: L,
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
    // The panel in `parts` registers a step, `part` bytes each.
    let (parts, part) = (PANEL / L::ROWS, 4 * L::ROWS);
    let row_stride = nb * QK;
    let (m4, m30) = (l.splat_i8(0x0F), l.splat_i8(0x30));
    let zero = l.zero_f();
    // [row][part][lane]: the blocks' sums, and Q4_1's offsets the same way.
    let mut acc = [l.parts([zero; LANES]); N];
    let mut off = [l.parts([zero; LANES]); N];
    for b in 0..nb {
        // SAFETY: block b of the panel (16 × 4 × steps bytes of quants, 16 · ns scales,
        // Q6_K's 2 × 16 sub-scales) and of each activation row is in bounds (the
        // caller's contract); prefetch addresses are only hints.
        unsafe {
            let qp = qs.add(b * PANEL * 4 * steps);
            // Activation row i's bytes j .. j + 4 of this block, broadcast.
            let x4 = |i: usize, j: usize| x.add(i * row_stride + b * QK + j);
            // The exact integer sums, [row][part].
            let mut isum = [l.parts(l.zero_i()); N];
            if TY == 3 {
                // Q6_K: four steps of low nibbles (values 4st.. and 16 + 4st..), their top
                // two bits from the two steps of highs: for value v, byte v % 8 of the
                // highs, bits 2·(v / 8), moved to bits 4-5 (16-bit shifts stay within
                // each byte for the bits kept by the mask).
                for line in 0..6 {
                    touch::<FAR>(pf, qp.add(64 * line), dm.add(b * PANEL * 2), line == 0);
                }
                for h in 0..parts {
                    let qh = [l.load(qp.add(256 + part * h)), l.load(qp.add(320 + part * h))];
                    let (mut sa, mut sb) = ([l.zero_i(); N], [l.zero_i(); N]);
                    for i in 0..N {
                        let (lo, all) = (*sum_lo.add(i * nb + b), *sum.add(i * nb + b));
                        sa[i] = l.splat_i32(-(lo << 5));
                        sb[i] = l.splat_i32(-((all - lo) << 5));
                    }
                    for st in 0..4 {
                        let q = l.load(qp.add(64 * st + part * h));
                        let hh = qh[st % 2];
                        let (hlo, hhi) = if st < 2 {
                            (l.shift16::<true, 4>(hh), hh)
                        } else {
                            (l.shift16::<true, 2>(hh), l.shift16::<false, 2>(hh))
                        };
                        let lo = l.or(l.and(q, m4), l.and(hlo, m30));
                        let hi = l.or(l.and(l.shift16::<false, 4>(q), m4), l.and(hhi, m30));
                        for i in 0..N {
                            sa[i] = l.dot4(sa[i], lo, l.bcast4(x4(i, 4 * st)));
                            sb[i] = l.dot4(sb[i], hi, l.bcast4(x4(i, 16 + 4 * st)));
                        }
                    }
                    let s0 = l.widen_i8(sub.add(2 * b * PANEL + L::ROWS * h));
                    let s1 = l.widen_i8(sub.add((2 * b + 1) * PANEL + L::ROWS * h));
                    for i in 0..N {
                        isum[i][h] = l.add_i32(l.mul_i32(sa[i], s0), l.mul_i32(sb[i], s1));
                    }
                }
            } else if TY == 0 {
                // [row][part][chain]: chain 0 of a row starts at −Q8_BIAS · Σx, the other at 0.
                let mut c = [l.parts([l.zero_i(); 2]); N];
                for i in 0..N {
                    let start = l.splat_i32(-(*sum.add(i * nb + b) * L::Q8_BIAS));
                    for h in 0..parts {
                        c[i][h][0] = start;
                    }
                }
                for st in 0..steps {
                    touch::<FAR>(pf, qp.add(64 * st), dm.add(b * PANEL * if H { 2 } else { 4 }), st == 0);
                    for h in 0..parts {
                        let w = l.load(qp.add(64 * st + part * h));
                        let wp = l.prep_q8(w);
                        let ch = st % L::Q8_CHAINS;
                        for i in 0..N {
                            c[i][h][ch] = l.dot4_q8(c[i][h][ch], wp, w, l.bcast4(x4(i, 4 * st)));
                        }
                    }
                }
                for i in 0..N {
                    for h in 0..parts {
                        isum[i][h] = if L::Q8_CHAINS == 2 { l.add_i32(c[i][h][0], c[i][h][1]) } else { c[i][h][0] };
                    }
                }
            } else {
                let mut c = [l.parts(l.nib_zero()); N];
                for st in 0..steps {
                    touch::<FAR>(pf, qp.add(64 * st), dm.add(b * ns * PANEL * if H { 2 } else { 4 }), st == 0);
                    for h in 0..parts {
                        let q = l.load(qp.add(64 * st + part * h));
                        let lo = l.and(q, m4);
                        let hi = l.and(l.shift16::<false, 4>(q), m4);
                        for i in 0..N {
                            let (xa, xb) = (l.bcast4(x4(i, 4 * st)), l.bcast4(x4(i, 16 + 4 * st)));
                            c[i][h] = l.nib_step(c[i][h], lo, hi, xa, xb);
                        }
                    }
                }
                for i in 0..N {
                    // Q4_0's nibbles are its values + 8.
                    let bias = if TY == 1 { -(*sum.add(i * nb + b) << 3) } else { 0 };
                    for h in 0..parts {
                        let wide = l.nib_end(c[i][h]);
                        isum[i][h] = if TY == 1 { l.add_i32(wide, l.splat_i32(bias)) } else { wide };
                    }
                }
            }
            let k = b % LANES;
            for h in 0..parts {
                let dw = l.scales::<H>(dm, b * ns * PANEL + L::ROWS * h);
                for i in 0..N {
                    let scale = l.mul_f(dw, l.splat_f(*d.add(i * nb + b)));
                    acc[i][h][k] = l.fma_f(scale, l.to_f(isum[i][h]), acc[i][h][k]);
                }
            }
        }
    }
    // Q4_1's offsets `m_w · s_x`, in their own lanes, after the blocks (inside their loop
    // they cost the 16-row kernel 10% of a batched product).
    if TY == 2 {
        for b in 0..nb {
            for h in 0..parts {
                // SAFETY: block b's `m` scales and each row's `s` are in bounds.
                unsafe {
                    let mw = l.scales::<H>(dm, (b * 2 + 1) * PANEL + L::ROWS * h);
                    for i in 0..N {
                        off[i][h][b % LANES] = l.fma_f(mw, l.splat_f(*s.add(i * nb + b)), off[i][h][b % LANES]);
                    }
                }
            }
        }
    }
    for i in 0..N {
        for h in 0..parts {
            let t: [L::F; LANES] =
                std::array::from_fn(|k| if TY == 2 { l.add_f(acc[i][h][k], off[i][h][k]) } else { acc[i][h][k] });
            let r = l.add_f(l.add_f(t[0], t[2]), l.add_f(t[1], t[3]));
            // SAFETY: out[i] is 16 f32s; lanes ROWS·h .. ROWS·(h + 1).
            unsafe { l.store(out[i].as_mut_ptr().add(L::ROWS * h), r) };
        }
    }
}

/// [`panel_dot`] on AVX-512 VNNI.
///
/// # Safety
/// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C are available and every pointer covers
/// what [`panel_dot`] describes.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
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
    // SAFETY: the caller's contract; it makes the `Vnni` proof.
    unsafe { panel_dot::<Vnni, TY, H, N, FAR>(Vnni::new(), qs, dm, sub, nb, pf, x, d, s, sum, sum_lo, out) }
}

/// [`panel_dot`] on AVX2, the panel's rows in two parts of eight.
///
/// # Safety
/// AVX2, FMA and F16C are available and every pointer covers what [`panel_dot`]
/// describes.
#[target_feature(enable = "avx2,fma,f16c")]
#[allow(clippy::too_many_arguments)]
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
    // SAFETY: the caller's contract; it makes the `Avx2` proof.
    unsafe { panel_dot::<Avx2, TY, H, N, FAR>(Avx2::new(), qs, dm, sub, nb, pf, x, d, s, sum, sum_lo, out) }
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

//! Packed weights and the matrix-multiply kernels: GEMV for decode, a panel-by-panel
//! "skinny" GEMM for a few dozen rows (a decode step of several sequences), and a
//! cache-blocked GEMM for prefill, all streaming each weight byte once per call.
//!
//! Weights are packed at load time into panels of [`NR`] = 16 output columns, each
//! panel stored k-major: `panel[p][k][j] = W[k][16p + j]` (zero-padded past `n_out`).
//! A panel is one contiguous stream, which is what both kernels want: GEMV reads each
//! panel once, front to back; the GEMM micro-kernel multiplies an `MR × KC` block of
//! activations by a `KC × 16` slice of a panel streamed from L2.
//!
//! Elements stay in their storage type (f32, f16, bf16) and are widened to f32 in
//! registers, so 16-bit weights halve the bytes each token streams. On a CPU with
//! AVX512-BF16, bf16 weights instead meet activations rounded to bf16 in `vdpbf16ps`
//! (two products per f32 lane and instruction, the way llama.cpp multiplies BF16
//! tensors): twice the multiply rate of widening, for one bf16 rounding of each
//! activation (relative 2⁻⁸ at most).

use half::{bf16, f16};
use rayon::prelude::*;

use super::simd::{self, Isa};
use super::weights::WeightBuf;
use crate::backend::WeightDtype;

/// Columns per panel: two AVX2 registers of f32.
pub const NR: usize = 16;
/// Rows per GEMM micro-kernel call: 6 × 2 accumulators + 2 B vectors + 1 broadcast fit in 16 ymm.
const MR: usize = 6;
/// Column group per parallel task in GEMM (8 panels): its slices of one K block (256 KiB
/// in f32, 192 KiB in f16 or bf16; see [`PanelElem::KC`]) stay in L2.
const NC_PANELS: usize = 8;
/// Up to this many rows, a call is treated as GEMV (stream panels once, all rows at a time).
const GEMV_MAX_ROWS: usize = 4;
/// Up to this many rows the GEMM walks panel by panel (see `run_group`).
const SKINNY_MAX_ROWS: usize = 32;

/// Panel storage in one of the supported element types.
pub enum PanelData {
    F32(WeightBuf<f32>),
    F16(WeightBuf<f16>),
    BF16(WeightBuf<bf16>),
}

pub struct PackedMatrix {
    pub n_in: usize,
    pub n_out: usize,
    pub n_panels: usize,
    pub data: PanelData,
}

impl PackedMatrix {
    /// Pack `get(k, j)` = W[k][j] (logical `[n_in, n_out]`) into panels of `dtype`, in a
    /// plain allocation: for products made at run time (attention's keys and values).
    pub fn pack(n_in: usize, n_out: usize, dtype: WeightDtype, get: impl Fn(usize, usize) -> f32 + Sync) -> Self {
        Self::pack_into(n_in, n_out, dtype, get, |_| {}, false)
    }

    /// Pack a weight matrix as [`PackedMatrix::pack`] does, into huge-page memory
    /// ([`WeightBuf`]), calling `done(columns)` after each run of output columns is
    /// packed (in order, [`PACK_CHUNK`] panels at a time), so the caller can give back
    /// the source of those columns while the rest is packed. Values go straight into the
    /// storage type (no f32 copy of a 16-bit matrix).
    pub fn pack_with(
        n_in: usize,
        n_out: usize,
        dtype: WeightDtype,
        get: impl Fn(usize, usize) -> f32 + Sync,
        done: impl FnMut(std::ops::Range<usize>),
    ) -> Self {
        Self::pack_into(n_in, n_out, dtype, get, done, true)
    }

    fn pack_into(
        n_in: usize,
        n_out: usize,
        dtype: WeightDtype,
        get: impl Fn(usize, usize) -> f32 + Sync,
        done: impl FnMut(std::ops::Range<usize>),
        weights: bool,
    ) -> Self {
        let n_panels = n_out.div_ceil(NR);
        let n = n_panels * n_in * NR;
        let data = match dtype {
            WeightDtype::F32 => PanelData::F32(fill_panels(n, n_in, n_out, 0.0, &get, |x| x, done, weights)),
            WeightDtype::F16 => {
                PanelData::F16(fill_panels(n, n_in, n_out, f16::ZERO, &get, f16::from_f32, done, weights))
            }
            WeightDtype::BF16 => {
                PanelData::BF16(fill_panels(n, n_in, n_out, bf16::ZERO, &get, bf16::from_f32, done, weights))
            }
        };
        PackedMatrix { n_in, n_out, n_panels, data }
    }

    /// [`PackedMatrix::pack`] in f32 of a row-major f32 matrix, `W[k][j] = m[k·n_out + j]`
    /// (`transposed` false) or `m[j·n_in + k]` (true): attention's values and keys, packed
    /// on the calling thread by row copies instead of one closure call per element.
    pub fn pack_f32_rows(n_in: usize, n_out: usize, m: &[f32], transposed: bool) -> Self {
        assert_eq!(m.len(), n_in * n_out, "pack_f32_rows: shape");
        let n_panels = n_out.div_ceil(NR);
        let mut data = vec![0.0f32; n_panels * n_in * NR];
        if n_in > 0 {
            for (p, panel) in data.chunks_exact_mut(n_in * NR).enumerate() {
                let (j0, nj) = (p * NR, NR.min(n_out - p * NR));
                if transposed {
                    // Row j of m is column j of W: scatter it down the panel.
                    for (jj, row) in m[j0 * n_in..(j0 + nj) * n_in].chunks_exact(n_in).enumerate() {
                        for (k, &v) in row.iter().enumerate() {
                            panel[k * NR + jj] = v;
                        }
                    }
                } else {
                    for (k, dst) in panel.chunks_exact_mut(NR).enumerate() {
                        dst[..nj].copy_from_slice(&m[k * n_out + j0..k * n_out + j0 + nj]);
                    }
                }
            }
        }
        PackedMatrix { n_in, n_out, n_panels, data: PanelData::F32(data.into()) }
    }

    pub fn dtype(&self) -> WeightDtype {
        match self.data {
            PanelData::F32(_) => WeightDtype::F32,
            PanelData::F16(_) => WeightDtype::F16,
            PanelData::BF16(_) => WeightDtype::BF16,
        }
    }

    pub fn bytes(&self) -> usize {
        self.n_panels * self.n_in * NR * self.dtype().size()
    }

    /// Column `j` (all k) into `out`: an embedding-table row when the table is the LM head.
    pub fn column(&self, j: usize, out: &mut [f32]) {
        assert!(j < self.n_out && out.len() == self.n_in, "column {j} out of range");
        let base = (j / NR) * self.n_in * NR + j % NR;
        match &self.data {
            PanelData::F32(d) => out.iter_mut().enumerate().for_each(|(k, o)| *o = d[base + k * NR]),
            PanelData::F16(d) => out.iter_mut().enumerate().for_each(|(k, o)| *o = d[base + k * NR].to_f32()),
            PanelData::BF16(d) => out.iter_mut().enumerate().for_each(|(k, o)| *o = d[base + k * NR].to_f32()),
        }
    }
}

/// Panels packed per parallel round in [`PackedMatrix::pack_with`] (1024 columns).
pub const PACK_CHUNK: usize = 64;

/// `n` panel elements of `[n_panels][n_in][NR]`, element (k, col) = `conv(get(k, col))`,
/// zero past `n_out`; `done` hears of each finished run of columns. `weights`: in
/// huge-page memory (else a plain allocation).
#[allow(clippy::too_many_arguments)]
fn fill_panels<T: Copy + Send + Sync>(
    n: usize,
    n_in: usize,
    n_out: usize,
    zero: T,
    get: &(impl Fn(usize, usize) -> f32 + Sync),
    conv: impl Fn(f32) -> T + Sync,
    mut done: impl FnMut(std::ops::Range<usize>),
    weights: bool,
) -> WeightBuf<T> {
    let mut v = if weights { WeightBuf::filled(n, zero) } else { vec![zero; n].into() };
    let panel_len = n_in * NR;
    if panel_len == 0 {
        return v;
    }
    for (c, chunk) in v.chunks_mut(PACK_CHUNK * panel_len).enumerate() {
        chunk.par_chunks_mut(panel_len).enumerate().for_each(|(i, panel)| {
            let p = c * PACK_CHUNK + i;
            for k in 0..n_in {
                for j in 0..NR {
                    let col = p * NR + j;
                    panel[k * NR + j] = if col < n_out { conv(get(k, col)) } else { zero };
                }
            }
        });
        done(c * PACK_CHUNK * NR..((c + 1) * PACK_CHUNK * NR).min(n_out));
    }
    v
}

/// What to do with each output after the dot products: add bias, optionally GELU.
#[derive(Clone, Copy)]
pub struct Epilogue<'a> {
    pub bias: Option<&'a [f32]>,
    pub gelu: bool,
}

/// Causal structure of an attention product, so masked work is skipped. `start` is the
/// position of row 0; row r sees keys `0..=start + r`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Causal {
    None,
    /// Output columns are keys (S = Q·Kᵀ): tiles wholly past the visible keys are skipped
    /// (left as they were; the caller masks them).
    KeyColumns {
        start: usize,
    },
    /// The inner dimension is keys (O = P·V): each row block stops at its last visible key
    /// (P is zero beyond it, so this is exact).
    KeyInner {
        start: usize,
    },
}

/// A raw output pointer that parallel tasks share; each writes a disjoint column range.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks given an OutPtr write only to their own disjoint column ranges (see
// `matmul`), so no two threads touch the same element.
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// Start of output row `r` (a method, so closures capture the whole `Send` wrapper).
    fn row(&self, r: usize, n_out: usize) -> *mut f32 {
        self.0.wrapping_add(r * n_out)
    }
}

/// `out[T, n_out] = x[T, n_in] @ W (+ bias) (→ GELU)`.
pub fn matmul(isa: Isa, x: &[f32], rows: usize, w: &PackedMatrix, epi: Epilogue, out: &mut [f32]) {
    matmul_causal(isa, x, rows, w, epi, Causal::None, out)
}

/// [`matmul`] whose every output row is bit-identical whatever `rows` is: every row
/// takes the GEMM order (K blocks of [`PanelElem::KC`], one FMA chain per output within a block,
/// blocks added in order; the skinny and the blocked loops both keep it), never the
/// few-row GEMV with its split accumulators.
/// What batch invariance costs on dense weights: decode loses the GEMV's four-way
/// unrolled chains (decode stays memory-bound; docs/serving.md, "Batch invariance").
pub fn matmul_batch_invariant(isa: Isa, x: &[f32], rows: usize, w: &PackedMatrix, epi: Epilogue, out: &mut [f32]) {
    matmul_impl(isa, x, rows, w, epi, Causal::None, true, out)
}

/// [`matmul`] that skips the work a causal mask makes void (see [`Causal`]).
pub fn matmul_causal(
    isa: Isa,
    x: &[f32],
    rows: usize,
    w: &PackedMatrix,
    epi: Epilogue,
    causal: Causal,
    out: &mut [f32],
) {
    matmul_impl(isa, x, rows, w, epi, causal, false, out)
}

#[allow(clippy::too_many_arguments)]
fn matmul_impl(
    isa: Isa,
    x: &[f32],
    rows: usize,
    w: &PackedMatrix,
    epi: Epilogue,
    causal: Causal,
    fixed_order: bool,
    out: &mut [f32],
) {
    assert!(causal == Causal::None || (epi.bias.is_none() && !epi.gelu), "causal products take no epilogue");
    let (n_in, n_out) = (w.n_in, w.n_out);
    assert_eq!(x.len(), rows * n_in, "matmul: input shape");
    assert_eq!(out.len(), rows * n_out, "matmul: output shape");
    if let Some(b) = epi.bias {
        assert_eq!(b.len(), n_out, "matmul: bias length");
    }
    if rows == 0 {
        return;
    }
    if n_in == 0 {
        // An empty sum: every output is the bias (or 0), GELU'd if asked, as the tiles'
        // epilogue would give (the K-blocks-outermost loop would write nothing).
        for row in out.chunks_mut(n_out.max(1)) {
            match epi.bias {
                Some(b) => row.copy_from_slice(b),
                None => row.fill(0.0),
            }
            if epi.gelu {
                simd::gelu(isa, row);
            }
        }
        return;
    }
    let optr = OutPtr(out.as_mut_ptr());
    let threads = rayon::current_num_threads();
    // bf16 weights on an AVX512-BF16 CPU: the activations rounded to bf16 once per call,
    // in (k, k + 1) pairs, for `vdpbf16ps` (every tile of the call, whatever its rows, so
    // a row's result does not depend on the batch). The buffer is the calling thread's,
    // reused across calls.
    let mut pairs = Vec::new();
    if matches!(w.data, PanelData::BF16(_)) && isa.has_bf16() && causal == Causal::None {
        pairs = BF16_PAIRS.take();
        bf16_pairs(x, rows, n_in, &mut pairs);
    }
    let act = Activations { x, pairs: (!pairs.is_empty()).then_some(&pairs[..]) };
    let run = |panels: std::ops::Range<usize>| {
        // The caller writes only columns [16·panels.start, 16·panels.end) ∩ [0, n_out) of
        // each of the `rows` output rows; callers' ranges are disjoint; `out` outlives them.
        let out_cols = |r: usize| optr.row(r, n_out);
        match &w.data {
            PanelData::F32(d) => run_group(isa, act, rows, n_in, n_out, d, panels, epi, causal, fixed_order, &out_cols),
            PanelData::F16(d) => run_group(isa, act, rows, n_in, n_out, d, panels, epi, causal, fixed_order, &out_cols),
            PanelData::BF16(d) => {
                run_group(isa, act, rows, n_in, n_out, d, panels, epi, causal, fixed_order, &out_cols)
            }
        }
    };
    matmul_panels(&run, rows, causal, threads, w.n_panels);
    // Kept for the next call unless a long prefill made it large (16 MiB).
    if !pairs.is_empty() && pairs.capacity() <= 4 << 20 {
        BF16_PAIRS.set(pairs);
    }
}

// The bf16 pairs start each K block at pair k0 / 2: the bf16 K block must be even.
const _: () = assert!(<bf16 as PanelElem>::KC.is_multiple_of(2));

thread_local! {
    /// The bf16 activation pairs of the last bf16 product on this thread (see `matmul_impl`).
    static BF16_PAIRS: std::cell::Cell<Vec<u32>> = const { std::cell::Cell::new(Vec::new()) };
}

/// Round-to-nearest-even f32 → bf16 bits (NaN stays NaN), as `half::bf16::from_f32`
/// rounds, written without branches so the loop over a row vectorizes.
#[inline(always)]
fn bf16_bits(v: f32) -> u32 {
    let b = v.to_bits();
    let rounded = b.wrapping_add(0x7fff + ((b >> 16) & 1)) >> 16;
    if v.is_nan() { (b >> 16) | 0x40 } else { rounded }
}

/// `x` (`rows × n_in`) rounded to bf16, each row as `n_in.div_ceil(2)` pairs
/// `bits(x[r][2q]) | bits(x[r][2q + 1]) << 16` (a zero past an odd row's end).
fn bf16_pairs(x: &[f32], rows: usize, n_in: usize, out: &mut Vec<u32>) {
    let ldp = n_in.div_ceil(2);
    out.clear();
    out.resize(rows * ldp, 0);
    let convert = |(dst, src): (&mut [u32], &[f32])| {
        let (whole, tail) = src.split_at(src.len() & !1);
        for (d, s) in dst.iter_mut().zip(whole.chunks_exact(2)) {
            *d = bf16_bits(s[0]) | bf16_bits(s[1]) << 16;
        }
        if let (Some(d), [last]) = (dst.last_mut(), tail) {
            *d = bf16_bits(*last);
        }
    };
    if rows * n_in >= 1 << 16 {
        out.par_chunks_mut(ldp).zip(x.par_chunks(n_in)).for_each(convert);
    } else {
        out.chunks_mut(ldp).zip(x.chunks(n_in)).for_each(convert);
    }
}

/// A call's activations: `x` (`rows × n_in` f32) and, on the bf16 path, its bf16 pairs
/// (`rows × n_in.div_ceil(2)`; see [`bf16_pairs`]).
#[derive(Clone, Copy)]
struct Activations<'a> {
    x: &'a [f32],
    pairs: Option<&'a [u32]>,
}

/// Split the panels between threads and run `run` on each share.
fn matmul_panels(
    run: &(dyn Fn(std::ops::Range<usize>) + Sync),
    rows: usize,
    causal: Causal,
    threads: usize,
    n_panels: usize,
) {
    if rows <= SKINNY_MAX_ROWS && causal == Causal::None && threads > 1 && n_panels >= threads {
        // Decode-sized work (one to a few dozen rows, a few hundred microseconds): one
        // contiguous run of panels per thread on the spinning team, which starts within a
        // microsecond where a rayon region costs a wake-up; a thread done early helps
        // finish the others' runs from their ends.
        if super::team::run_balanced(n_panels, 4, 2, &|r| run(r)) {
            return;
        }
    }
    // Otherwise (one thread, a busy team, prefill) split panels into contiguous runs: 16
    // per thread for GEMV (fine enough that work stealing evens out the threads), or
    // L2-sized column groups for GEMM.
    let group = if rows <= GEMV_MAX_ROWS { n_panels.div_ceil(threads * 16).max(1) } else { NC_PANELS };
    let n_groups = n_panels.div_ceil(group);
    (0..n_groups).into_par_iter().for_each(|g| run(g * group..((g + 1) * group).min(n_panels)));
}

/// Element types a panel can hold.
pub(crate) trait PanelElem: Copy + Send + Sync + 'static {
    /// K block of the GEMM: the `MR × KC` activations (12 or 18 KiB) stay in L1 while
    /// they meet the group's `KC × 16` panel slices, which stay in L2. Long blocks matter:
    /// between blocks a tile's partial sums go out to the output and come back (with
    /// 256, ~5% of an f16 prefill); 768 covers GPT-2's and SmolLM2's widths in one.
    const KC: usize;
    fn to_f32(self) -> f32;
    #[cfg(target_arch = "x86_64")]
    /// AVX2 micro-kernel for this element type.
    const KERNEL: x86::KernelFn<Self>;
    #[cfg(target_arch = "x86_64")]
    /// AVX-512 GEMM micro-kernel for this element type: the AVX2 GEMM kernel's arithmetic
    /// in the same order (so bit-identical results), one 512-bit register per 16-column
    /// panel row.
    const KERNEL512: x86::KernelFn<Self>;
    #[cfg(target_arch = "x86_64")]
    /// AVX512-BF16 kernel on bf16-rounded activation pairs, for bf16 only.
    const KERNEL_DP: Option<x86::KernelFn<Self>> = None;
}

impl PanelElem for f32 {
    const KC: usize = 512;
    fn to_f32(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    const KERNEL: x86::KernelFn<f32> = x86::kernel_f32;
    #[cfg(target_arch = "x86_64")]
    const KERNEL512: x86::KernelFn<f32> = x86::kernel_f32_512;
}

impl PanelElem for f16 {
    const KC: usize = 768;
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    const KERNEL: x86::KernelFn<f16> = x86::kernel_f16;
    #[cfg(target_arch = "x86_64")]
    const KERNEL512: x86::KernelFn<f16> = x86::kernel_f16_512;
}

impl PanelElem for bf16 {
    const KC: usize = 768;
    fn to_f32(self) -> f32 {
        bf16::to_f32(self)
    }
    #[cfg(target_arch = "x86_64")]
    const KERNEL: x86::KernelFn<bf16> = x86::kernel_bf16;
    #[cfg(target_arch = "x86_64")]
    const KERNEL512: x86::KernelFn<bf16> = x86::kernel_bf16_512;
    #[cfg(target_arch = "x86_64")]
    const KERNEL_DP: Option<x86::KernelFn<bf16>> = Some(x86::kernel_bf16_dp);
}

/// One micro-kernel call: `acc[r][0..16] (+)= Σ_k a[r][k] · panel[k][0..16]` for
/// `r < mr`, `k < kc`. `a` rows are `lda` apart; `acc` is `[MR][NR]`.
pub(crate) struct Tile<'a, T> {
    a: &'a [f32],
    lda: usize,
    /// On the AVX512-BF16 path: the same activations as bf16 pairs (see [`bf16_pairs`]),
    /// starting at this tile's first row and k / 2, rows `ldp` pairs apart. The portable
    /// and widening kernels use `a` and ignore them.
    pairs: Option<&'a [u32]>,
    ldp: usize,
    mr: usize,
    panel: &'a [T],
    kc: usize,
    /// One accumulator chain per output, in k order, whatever `mr` is (the GEMM
    /// micro-kernel's order), so a row's result does not depend on the rows beside it.
    fixed_order: bool,
    /// Weights to bring toward the cache while this tile computes (a share of the next
    /// panel, spread over its k steps): the skinny GEMM's way of overlapping the memory
    /// stream with the arithmetic. Never read, only prefetched.
    prefetch: Option<&'a [T]>,
}

/// The portable micro-kernel, in the x86 kernels' order of arithmetic so that every
/// path gives the same bits: per output, one FMA chain from zero over `k` (the GEMM
/// order, `x86::block`), or for a one- or two-row tile outside `fixed_order` four chains,
/// `k` into chain `k % 4` up to the last multiple of four and the rest into chain 0,
/// added as `(c0 + c1) + (c2 + c3)` (the GEMV order, `x86::gemv_rows`); the tile's sum
/// is then added to `acc`.
///
/// Never inlined: kept out of `tile`, which the x86 paths call for every tile.
#[inline(never)]
fn tile_portable<T: PanelElem>(t: &Tile<T>, acc: &mut [[f32; NR]; MR]) {
    simd::portable(|| tile_portable_body(t, acc))
}

#[inline(always)]
fn tile_portable_body<T: PanelElem>(t: &Tile<T>, acc: &mut [[f32; NR]; MR]) {
    let _ = t.prefetch; // a hint the portable loop leaves to the hardware
    let split = t.mr <= 2 && !t.fixed_order;
    let split_end = if split { t.kc / 4 * 4 } else { 0 };
    let mut s = [[[0.0f32; NR]; 4]; MR];
    for k in 0..t.kc {
        let b: [f32; NR] = std::array::from_fn(|j| t.panel[k * NR + j].to_f32());
        let chain = if k < split_end { k % 4 } else { 0 };
        for (r, s_r) in s.iter_mut().enumerate().take(t.mr) {
            let a = t.a[r * t.lda + k];
            for (c, bj) in s_r[chain].iter_mut().zip(b) {
                *c = a.mul_add(bj, *c);
            }
        }
    }
    for (acc_r, s_r) in acc.iter_mut().zip(&s).take(t.mr) {
        for j in 0..NR {
            acc_r[j] += if split { (s_r[0][j] + s_r[1][j]) + (s_r[2][j] + s_r[3][j]) } else { s_r[0][j] };
        }
    }
}

/// Copy `n ≤ NR` floats; a full tile row is a fixed-size copy the compiler inlines.
///
/// # Safety
/// `src` and `dst` are valid for `n` floats and do not overlap.
#[inline(always)]
unsafe fn copy_cols(src: *const f32, dst: *mut f32, n: usize) {
    // SAFETY: forwarded from the caller.
    unsafe {
        if n == NR { std::ptr::copy_nonoverlapping(src, dst, NR) } else { std::ptr::copy_nonoverlapping(src, dst, n) }
    }
}

/// Run the micro-kernel for one tile (dispatching on the ISA).
fn tile<T: PanelElem>(isa: Isa, t: &Tile<T>, acc: &mut [[f32; NR]; MR]) {
    #[cfg(target_arch = "x86_64")]
    if let (true, Some(_), Some(kernel)) = (isa.has_bf16(), t.pairs, T::KERNEL_DP) {
        // SAFETY: an AVX-512 BF16 `Isa` exists only where detection proved AVX512-BF16,
        // AVX-512 F/BW/VL and AVX2/FMA/F16C; the kernel checks the tile's bounds.
        return unsafe { kernel(t, acc) };
    }
    // AVX-512 for GEMM tiles of three rows or more. One- and two-row tiles (decode) stay
    // on AVX2: memory-bound there, and its 256-bit loads measured faster on Zen 4 than
    // 512-bit ones (f16 tg128 1 thread: 93 against 80 tok/s). Same bits either way.
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx512() && t.mr >= 3 {
        // SAFETY: an AVX-512 `Isa` exists only where detection proved AVX-512 F/BW/VL and
        // AVX2/FMA/F16C; the kernel checks the tile's bounds.
        return unsafe { T::KERNEL512(t, acc) };
    }
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        // SAFETY: an AVX2 `Isa` exists only where detection proved AVX2/FMA/F16C; the
        // kernel checks the tile's bounds.
        return unsafe { T::KERNEL(t, acc) };
    }
    let _ = isa;
    tile_portable(t, acc)
}

/// Bias and GELU on a finished tile, then store its valid columns.
#[allow(clippy::too_many_arguments)]
fn finish_tile(
    isa: Isa,
    acc: &mut [[f32; NR]; MR],
    mr: usize,
    r0: usize,
    j0: usize,
    nj: usize,
    epi: Epilogue,
    out_row: &dyn Fn(usize) -> *mut f32,
) {
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx512() && nj == NR {
        // A whole panel's row in one register: the same bits as the loop below.
        let bias = epi.bias.map(|b| <&[f32; NR]>::try_from(&b[j0..j0 + NR]).expect("16 bias values"));
        for (r, acc_r) in acc.iter().enumerate().take(mr) {
            // SAFETY: AVX-512 was detected (the `Isa`); row r0 + r < rows and columns
            // j0..j0 + 16 ≤ n_out belong to this task's panel range (see `matmul`).
            unsafe { simd::x86::bias_gelu_store16(acc_r, bias, epi.gelu, out_row(r0 + r).add(j0)) };
        }
        return;
    }
    for (r, acc_r) in acc.iter_mut().enumerate().take(mr) {
        let vals = &mut acc_r[..nj];
        if let Some(b) = epi.bias {
            for (v, bv) in vals.iter_mut().zip(&b[j0..j0 + nj]) {
                *v += bv;
            }
        }
        if epi.gelu {
            simd::gelu(isa, vals);
        }
        // SAFETY: row r0 + r < rows and columns j0..j0 + nj ≤ n_out belong to this task's
        // panel range (see `matmul`).
        unsafe { copy_cols(vals.as_ptr(), out_row(r0 + r).add(j0), nj) };
    }
}

#[allow(clippy::too_many_arguments)]
fn run_group<T: PanelElem>(
    isa: Isa,
    act: Activations,
    rows: usize,
    n_in: usize,
    n_out: usize,
    data: &[T],
    panels: std::ops::Range<usize>,
    epi: Epilogue,
    causal: Causal,
    fixed_order: bool,
    out_row: &dyn Fn(usize) -> *mut f32,
) {
    let mut acc = [[0.0f32; NR]; MR];
    let kc_max = T::KC;
    let panel = |p: usize| &data[p * n_in * NR..(p + 1) * n_in * NR];
    let x = act.x;
    // The pairs from row r0 and k0 on (k0 is a multiple of the even KC, or 0).
    let ldp = n_in.div_ceil(2);
    let pairs = |r0: usize, k0: usize| act.pairs.map(|p| &p[r0 * ldp + k0 / 2..]);
    if rows <= GEMV_MAX_ROWS && causal == Causal::None && !fixed_order {
        // GEMV: each panel is streamed once, front to back, for all rows together.
        for p in panels {
            acc = [[0.0; NR]; MR];
            tile(
                isa,
                &Tile {
                    a: x,
                    lda: n_in,
                    pairs: pairs(0, 0),
                    ldp,
                    mr: rows,
                    panel: panel(p),
                    kc: n_in,
                    fixed_order,
                    prefetch: None,
                },
                &mut acc,
            );
            let j0 = p * NR;
            finish_tile(isa, &mut acc, rows, 0, j0, NR.min(n_out - j0), epi, out_row);
        }
        return;
    }
    if rows <= SKINNY_MAX_ROWS && causal == Causal::None {
        // Skinny GEMM (a decode step of several sequences): panel by panel, so the group
        // is one front-to-back stream, each panel's K blocks summed in registers for one
        // row block after another while the panel sits in L1/L2. The same arithmetic per
        // output as the K-blocks-outermost loop below (blocks added in order).
        let (n_panels, row_blocks) = (n_out.div_ceil(NR), rows.div_ceil(MR));
        for p in panels {
            let (j0, nj) = (p * NR, NR.min(n_out - p * NR));
            // The next panel in memory (usually this task's next one): the tile of row
            // block b and K block k0 brings in the b-th of `row_blocks` shares of that
            // panel's same K block, so each of its k steps prefetches at most one line.
            let next = if p + 1 < n_panels { panel(p + 1) } else { &[] };
            for (b, r0) in (0..rows).step_by(MR).enumerate() {
                let mr = MR.min(rows - r0);
                acc = [[0.0; NR]; MR];
                for k0 in (0..n_in).step_by(kc_max) {
                    let kc = kc_max.min(n_in - k0);
                    let prefetch = next.get(k0 * NR..(k0 + kc) * NR).and_then(|block| {
                        let share = block.len().div_ceil(row_blocks);
                        let part = &block[(b * share).min(block.len())..((b + 1) * share).min(block.len())];
                        (!part.is_empty()).then_some(part)
                    });
                    let t = Tile {
                        a: &x[r0 * n_in + k0..],
                        lda: n_in,
                        pairs: pairs(r0, k0),
                        ldp,
                        mr,
                        panel: &panel(p)[k0 * NR..],
                        kc,
                        fixed_order,
                        prefetch,
                    };
                    tile(isa, &t, &mut acc);
                }
                finish_tile(isa, &mut acc, mr, r0, j0, nj, epi, out_row);
            }
        }
        return;
    }
    // GEMM: K blocks outermost. Within one, an MR × KC block of activations stays in L1
    // while it meets each panel's KC × 16 slice (the group's slices stay in L2); partial
    // sums wait in the output between K blocks, and the epilogue runs after the last.
    for k0 in (0..n_in).step_by(kc_max) {
        let last = k0 + kc_max.min(n_in - k0) == n_in;
        for r0 in (0..rows).step_by(MR) {
            let mr = MR.min(rows - r0);
            let visible = |start: usize| start + r0 + mr; // keys seen by this row block
            let k_end = match causal {
                Causal::KeyInner { start } => n_in.min(visible(start)),
                _ => n_in,
            };
            if k0 >= k_end {
                continue; // nothing visible in this K block; earlier blocks hold the sums
            }
            let kc = kc_max.min(k_end - k0);
            for p in panels.clone() {
                let (j0, nj) = (p * NR, NR.min(n_out - p * NR));
                if let Causal::KeyColumns { start } = causal
                    && j0 >= visible(start)
                {
                    continue;
                }
                for (r, acc_r) in acc.iter_mut().enumerate().take(mr) {
                    *acc_r = [0.0; NR];
                    if k0 > 0 {
                        // SAFETY: this task's own columns of row r0 + r (see `matmul`).
                        unsafe { copy_cols(out_row(r0 + r).add(j0), acc_r.as_mut_ptr(), nj) };
                    }
                }
                let t = Tile {
                    a: &x[r0 * n_in + k0..],
                    lda: n_in,
                    pairs: pairs(r0, k0),
                    ldp,
                    mr,
                    panel: &panel(p)[k0 * NR..],
                    kc,
                    fixed_order,
                    prefetch: None,
                };
                tile(isa, &t, &mut acc);
                if last {
                    finish_tile(isa, &mut acc, mr, r0, j0, nj, epi, out_row);
                } else {
                    for (r, acc_r) in acc.iter().enumerate().take(mr) {
                        // SAFETY: as above.
                        unsafe { copy_cols(acc_r.as_ptr(), out_row(r0 + r).add(j0), nj) };
                    }
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
pub(crate) mod x86;

#[cfg(test)]
mod tests {
    //! Small shapes on every path (GEMV, GEMM across a K-block edge, partial panels and
    //! row blocks, the causal variants), against a plain f64 sum. Small enough for
    //! `cargo +nightly miri test`, which checks the raw-pointer output writes.
    use super::*;

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut rng = crate::rng::Rng::new(seed);
        (0..n).map(|_| rng.next_f64() as f32 * 2.0 - 1.0).collect()
    }

    #[test]
    fn matmul_matches_a_plain_sum_on_awkward_shapes() {
        let shapes: &[(usize, usize, usize)] = if cfg!(miri) {
            &[(1, 5, 17), (3, 17, 33), (7, 260, 18), (7, 770, 5)]
        } else {
            // 13 rows: the skinny, panel-by-panel GEMM; 37: K blocks outermost.
            &[
                (1, 5, 17),
                (3, 17, 33),
                (7, 260, 18),
                (13, 513, 100),
                (13, 1600, 20),
                (9, 100, 20),
                (37, 300, 40),
                (37, 1600, 24),
            ]
        };
        for &(rows, n_in, n_out) in shapes {
            let x = values(rows * n_in, 1);
            let w = values(n_in * n_out, 2);
            let bias = values(n_out, 3);
            for dtype in [WeightDtype::F32, WeightDtype::F16, WeightDtype::BF16] {
                let packed = PackedMatrix::pack(n_in, n_out, dtype, |k, j| w[k * n_out + j]);
                let mut col = vec![0.0; n_in];
                packed.column(n_out - 1, &mut col);
                for isa in simd::isas_or_skip() {
                    for gelu in [false, true] {
                        let mut out = vec![f32::NAN; rows * n_out];
                        matmul(isa, &x, rows, &packed, Epilogue { bias: Some(&bias), gelu }, &mut out);
                        for r in 0..rows {
                            for j in 0..n_out {
                                let (mut want, mut magnitude) = (f64::from(bias[j]), 0.0);
                                // The AVX512-BF16 path multiplies bf16 weights by activations
                                // rounded to bf16: the sum it must give is of those.
                                let xdtype = if isa.has_bf16() && dtype == WeightDtype::BF16 {
                                    WeightDtype::BF16
                                } else {
                                    WeightDtype::F32
                                };
                                for k in 0..n_in {
                                    // The weight as stored: the last column read back is exact.
                                    let wk = if j == n_out - 1 { col[k] } else { round(dtype, w[k * n_out + j]) };
                                    let xk = round(xdtype, x[r * n_in + k]);
                                    want += f64::from(xk) * f64::from(wk);
                                    magnitude += (f64::from(xk) * f64::from(wk)).abs();
                                }
                                let want = if gelu { simd::gelu_scalar(want as f32) } else { want as f32 };
                                let got = out[r * n_out + j];
                                // f32 rounding grows with the sum's terms (~1e-5 at 1600): the
                                // long sums get that much more; the others keep the plain bound.
                                let long = if n_in > 1024 { 1e-7 * magnitude as f32 } else { 0.0 };
                                assert!(
                                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()) + long,
                                    "{isa:?} {dtype:?} {rows}x{n_in}->{n_out} gelu {gelu} [{r},{j}]: {got} vs {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }

    /// Every row of the batch-invariant matmul is bit-identical to the same row computed
    /// alone and at any place in any batch (the plain matmul's rows are not: its GEMV
    /// splits the sums four ways, which this test also shows, so it can fail).
    #[test]
    fn batch_invariant_rows_do_not_depend_on_the_batch() {
        // 40 rows take the K-blocks-outermost GEMM loop, up to 32 the skinny one: the same
        // bits either way.
        // 1601: an odd last K block (the bf16 products' zero-padded pair).
        let n_ins: &[usize] = if cfg!(miri) { &[300] } else { &[1600, 1601] }; // 2-4 K blocks
        for (&n_in, dtype) in
            n_ins.iter().flat_map(|n| [WeightDtype::F32, WeightDtype::F16, WeightDtype::BF16].map(|d| (n, d)))
        {
            let (n_out, big) = (40, 40);
            let x = values(big * n_in, 7);
            let w = values(n_in * n_out, 8);
            let bias = values(n_out, 9);
            let packed = PackedMatrix::pack(n_in, n_out, dtype, |k, j| w[k * n_out + j]);
            for isa in simd::isas_or_skip() {
                let epi = Epilogue { bias: Some(&bias), gelu: true };
                let mut all = vec![f32::NAN; big * n_out];
                matmul_batch_invariant(isa, &x, big, &packed, epi, &mut all);
                let mut plain_differs = false;
                for (start, rows) in [
                    (0, 1),
                    (5, 1),
                    (3, 2),
                    (4, 3),
                    (2, 4),
                    (1, 5),
                    (6, 7),
                    (12, 1),
                    (29, 1),
                    (3, 24),
                    (8, 32),
                    (39, 1),
                ] {
                    let xs = &x[start * n_in..(start + rows) * n_in];
                    let mut out = vec![f32::NAN; rows * n_out];
                    matmul_batch_invariant(isa, xs, rows, &packed, epi, &mut out);
                    let want = &all[start * n_out..(start + rows) * n_out];
                    let same = out.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
                    assert!(same, "{isa:?} {dtype:?}: rows {start}..{} differ from the 40-row batch", start + rows);
                    matmul(isa, xs, rows, &packed, epi, &mut out);
                    plain_differs |= out.iter().zip(want).any(|(a, b)| a.to_bits() != b.to_bits());
                }
                if isa.is_avx2() {
                    assert!(plain_differs, "the plain GEMV was expected to sum in another order");
                }
                // One thread (a plain loop) and two (the spinning team, or rayon when the
                // team is busy with another test): the same bits.
                if !cfg!(miri) {
                    for threads in [1, 2] {
                        let pool = rayon::ThreadPoolBuilder::new().num_threads(threads).build().unwrap();
                        for rows in [1, 3, 16, 40] {
                            let mut out = vec![f32::NAN; rows * n_out];
                            pool.install(|| {
                                matmul_batch_invariant(isa, &x[..rows * n_in], rows, &packed, epi, &mut out)
                            });
                            let same = out.iter().zip(&all).all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(same, "{isa:?} {dtype:?}: {rows} rows on {threads} threads differ");
                        }
                    }
                }
            }
        }
    }

    /// Every level's products give the portable path's bits (the bf16 weights of the
    /// AVX512-BF16 level excepted: `vdpbf16ps` rounds activations by design), for the GEMV
    /// (one to four rows, `n_in` not a multiple of four), the skinny GEMM and the blocked
    /// one, across K blocks, with bias and GELU, in both orders.
    #[test]
    #[cfg_attr(miri, ignore)] // portable against itself there, and slow
    fn every_level_equals_the_portable_path_bit_for_bit() {
        for &(rows, n_in, n_out) in &[
            (1, 5, 17),
            (1, 1027, 20),
            (2, 301, 33),
            (3, 17, 33),
            (4, 7, 20),
            (7, 260, 18),
            (13, 513, 100),
            (37, 1601, 40),
        ] {
            let x = values(rows * n_in, 21);
            // Weights of GELU's curved middle (scale 0.1) and of its tails (1e3).
            for (scale, dtype) in [0.1f32, 1e3]
                .into_iter()
                .flat_map(|s| [WeightDtype::F32, WeightDtype::F16, WeightDtype::BF16].map(|d| (s, d)))
            {
                let w: Vec<f32> = values(n_in * n_out, 22).iter().map(|v| v * scale).collect();
                let packed = PackedMatrix::pack(n_in, n_out, dtype, |k, j| w[k * n_out + j]);
                let bias: Vec<f32> = values(n_out, 23).iter().map(|v| v * 3.0).collect();
                let epi = Epilogue { bias: Some(&bias), gelu: true };
                let run = |isa, fixed: bool| {
                    let mut out = vec![f32::NAN; rows * n_out];
                    let f = if fixed { matmul_batch_invariant } else { matmul };
                    f(isa, &x, rows, &packed, epi, &mut out);
                    out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
                };
                // The portable body as an FMA-less CPU runs it (every `mul_add` a call to
                // `fmaf`) gives the bits of the FMA-compiled one that `simd::portable` picks.
                #[cfg(target_arch = "x86_64")]
                if rows <= 4 {
                    let (a, lda) = (&x[..], n_in);
                    // The first panel's layout, `panel[k][j] = W[k][j]` (every shape here has
                    // n_out ≥ 16).
                    let panel: Vec<f32> = (0..n_in * NR).map(|i| w[i / NR * n_out + i % NR]).collect();
                    for fixed_order in [false, true] {
                        let t = Tile {
                            a,
                            lda,
                            pairs: None,
                            ldp: 0,
                            mr: rows,
                            panel: &panel,
                            kc: n_in,
                            fixed_order,
                            prefetch: None,
                        };
                        let (mut plain, mut fused) = ([[0.25f32; NR]; MR], [[0.25f32; NR]; MR]);
                        tile_portable_body(&t, &mut plain);
                        tile_portable(&t, &mut fused);
                        assert_eq!(plain.map(|r| r.map(f32::to_bits)), fused.map(|r| r.map(f32::to_bits)));
                    }
                }
                for isa in simd::isas_or_skip() {
                    if isa.has_bf16() && dtype == WeightDtype::BF16 {
                        continue;
                    }
                    for fixed in [false, true] {
                        assert_eq!(
                            run(isa, fixed),
                            run(Isa::PORTABLE, fixed),
                            "{isa:?} {dtype:?} {rows}x{n_in}->{n_out} scale {scale} fixed {fixed}"
                        );
                    }
                }
            }
        }
    }

    /// The AVX-512 micro-kernels do the AVX2 ones' arithmetic in the same order, for every
    /// row count (`tile` sends 1-2 rows to AVX2, so whole products never reach the 512-bit
    /// kernel's 1- and 2-row arms; whole products are held to the portable bits above).
    #[test]
    fn avx512_kernels_equal_avx2_bit_for_bit() {
        let (Some(_), Some(_)) = (simd::avx512_or_skip(), simd::avx2_or_skip()) else { return };
        #[cfg(target_arch = "x86_64")]
        {
            let (kc, lda) = (37, 40);
            let a = values(MR * lda, 13);
            let panel: Vec<f32> = values(kc * NR, 14);
            let panel16: Vec<f16> = panel.iter().map(|&v| f16::from_f32(v)).collect();
            for mr in 1..=MR {
                let t =
                    Tile { a: &a, lda, pairs: None, ldp: 0, mr, panel: &panel, kc, fixed_order: true, prefetch: None };
                let t16 = Tile {
                    a: &a,
                    lda,
                    pairs: None,
                    ldp: 0,
                    mr,
                    panel: &panel16,
                    kc,
                    fixed_order: true,
                    prefetch: None,
                };
                let (mut x, mut y, mut x16, mut y16) =
                    ([[0.5f32; NR]; MR], [[0.5f32; NR]; MR], [[0.0; NR]; MR], [[0.0; NR]; MR]);
                // SAFETY: both ISAs were detected above; the tiles are in bounds.
                unsafe {
                    (f32::KERNEL512)(&t, &mut x);
                    (f32::KERNEL)(&t, &mut y);
                    (f16::KERNEL512)(&t16, &mut x16);
                    (f16::KERNEL)(&t16, &mut y16);
                }
                let bits = |m: &[[f32; NR]; MR]| m.iter().flatten().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&x), bits(&y), "f32 micro-kernel, {mr} rows");
                assert_eq!(bits(&x16), bits(&y16), "f16 micro-kernel, {mr} rows");
                assert!(x[mr - 1][0] != 0.5 && (mr == MR || x[mr][0] == 0.5), "{mr} rows: wrong rows written");
            }
        }
    }

    /// The activation pairs are `half`'s round-to-nearest-even bf16 bits, everywhere:
    /// ties both ways, subnormals, infinities, NaN, the f32 extremes, an odd row's pad.
    #[test]
    fn bf16_pairs_round_like_half() {
        let mut specials = vec![
            0.0f32,
            -0.0,
            1.0,
            f32::from_bits(0x3F80_8000), // 1 + 2⁻⁸: a tie, to even (down, 0x3F80)
            f32::from_bits(0x3F81_8000), // 1 + 3·2⁻⁸: a tie, to even (up, 0x3F82)
            f32::from_bits(0x3F80_8001), // just above a tie: up (0x3F81)
            f32::MIN_POSITIVE / 3.0,
            -f32::MIN_POSITIVE / 7.0,
            f32::MAX,
            f32::MIN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            -f32::NAN,
            f32::from_bits(0x7f80_0001), // a signalling NaN
            3.4e38,
        ];
        specials.extend(values(999, 31).iter().map(|v| v * 1e4));
        let n_in = specials.len(); // odd: the last pair is padded
        assert_eq!(n_in % 2, 1);
        let mut pairs = Vec::new();
        bf16_pairs(&specials, 1, n_in, &mut pairs);
        assert_eq!(pairs.len(), n_in.div_ceil(2));
        for (k, &v) in specials.iter().enumerate() {
            let got = (pairs[k / 2] >> (16 * (k % 2))) as u16;
            let want = bf16::from_f32(v);
            if v.is_nan() {
                assert!(bf16::from_bits(got).is_nan(), "[{k}] {v}: {got:#x} is not NaN");
            } else {
                assert_eq!(got, want.to_bits(), "[{k}] {v}");
            }
        }
        assert_eq!(pairs[n_in / 2] >> 16, 0, "pad");
        // The ties, spelled out (not only as `half` rounds them).
        assert_eq!((pairs[1] >> 16, pairs[2] & 0xFFFF, pairs[2] >> 16), (0x3F80, 0x3F82, 0x3F81), "ties to even");
        // Many rows (the parallel conversion) give the same bits as one at a time.
        let (rows, n) = (97, 1001);
        let x: Vec<f32> = values(rows * n, 32).iter().map(|v| v * 100.0).collect();
        let mut all = Vec::new();
        bf16_pairs(&x, rows, n, &mut all);
        for r in [0, 50, 96] {
            bf16_pairs(&x[r * n..(r + 1) * n], 1, n, &mut pairs);
            assert_eq!(&all[r * n.div_ceil(2)..(r + 1) * n.div_ceil(2)], &pairs[..], "row {r}");
        }
    }

    /// The AVX512-BF16 micro-kernel on every row count, even and odd `kc`: within f32
    /// accumulation of the exact sum of bf16 activations times bf16 weights, and every
    /// row's result independent of the rows beside it.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn avx512_bf16_kernel_sums_bf16_products() {
        let Some(_) = simd::avx512_bf16_or_skip() else { return };
        for kc in [1usize, 2, 37, 64, 767, 768] {
            let ldp = kc.div_ceil(2) + 3;
            let a: Vec<f32> = values(MR * 2 * ldp, 41).iter().map(|v| v * 30.0).collect();
            let mut pairs = Vec::new();
            bf16_pairs(&a, MR, 2 * ldp, &mut pairs);
            let panel: Vec<bf16> = values(kc * NR, 42).iter().map(|&v| bf16::from_f32(v * 5.0)).collect();
            let mut one_row = Vec::new();
            for mr in 1..=MR {
                let t = Tile {
                    a: &a,
                    lda: 2 * ldp,
                    pairs: Some(&pairs),
                    ldp,
                    mr,
                    panel: &panel,
                    kc,
                    fixed_order: true,
                    prefetch: None,
                };
                let mut acc = [[0.25f32; NR]; MR];
                // SAFETY: AVX512-BF16 was detected above; the tile is in bounds.
                unsafe { x86::kernel_bf16_dp(&t, &mut acc) };
                for r in 0..mr {
                    for j in 0..NR {
                        let (mut want, mut magnitude) = (0.25f64, 0.25f64);
                        for k in 0..kc {
                            let p = f64::from(bf16::from_f32(a[r * 2 * ldp + k]).to_f32())
                                * f64::from(panel[k * NR + j].to_f32());
                            want += p;
                            magnitude += p.abs();
                        }
                        let got = f64::from(acc[r][j]);
                        assert!((got - want).abs() <= 1e-6 * magnitude, "kc {kc} mr {mr} [{r},{j}]: {got} vs {want}");
                    }
                }
                assert!(mr == MR || acc[mr][0] == 0.25, "{mr} rows: row {mr} written");
                if mr == 1 {
                    one_row = acc[0].map(f32::to_bits).to_vec();
                }
                assert_eq!(acc[0].map(f32::to_bits).to_vec(), one_row, "kc {kc}: row 0 depends on {mr} rows");
            }
        }
    }

    fn round(dtype: WeightDtype, v: f32) -> f32 {
        match dtype {
            WeightDtype::F32 => v,
            WeightDtype::F16 => f16::from_f32(v).to_f32(),
            WeightDtype::BF16 => bf16::from_f32(v).to_f32(),
        }
    }

    #[test]
    fn packing_rows_equals_packing_by_element() {
        for &(n_in, n_out) in &[(0, 5), (5, 0), (1, 1), (64, 17), (17, 64), (3, 33), (100, 48)] {
            let m = values(n_in * n_out, 21);
            let by_rows = PackedMatrix::pack_f32_rows(n_in, n_out, &m, false);
            let by_elem = PackedMatrix::pack(n_in, n_out, WeightDtype::F32, |k, j| m[k * n_out + j]);
            let transposed = PackedMatrix::pack_f32_rows(n_in, n_out, &m, true);
            let by_elem_t = PackedMatrix::pack(n_in, n_out, WeightDtype::F32, |k, j| m[j * n_in + k]);
            let data = |p: &PackedMatrix| match &p.data {
                PanelData::F32(d) => d.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                _ => unreachable!("f32 panels"),
            };
            assert_eq!(data(&by_rows), data(&by_elem), "{n_in}x{n_out}");
            assert_eq!(data(&transposed), data(&by_elem_t), "{n_in}x{n_out} transposed");
            assert_eq!((by_rows.n_panels, transposed.n_panels), (by_elem.n_panels, by_elem.n_panels));
        }
    }

    #[test]
    fn causal_products_write_only_what_they_own() {
        // S = Q·Kᵀ with a prefix of 2 earlier keys: row i sees keys 0..=2+i; P·V likewise.
        let (t, hd, start) = (7, 5, 2);
        let keys = start + t;
        let q = values(t * hd, 4);
        let k = values(keys * hd, 5);
        for isa in simd::isas_or_skip() {
            let kt = PackedMatrix::pack(hd, keys, WeightDtype::F32, |d, j| k[j * hd + d]);
            let mut s = vec![0.0f32; t * keys];
            let none = Epilogue { bias: None, gelu: false };
            matmul_causal(isa, &q, t, &kt, none, Causal::KeyColumns { start }, &mut s);
            for i in 0..t {
                for j in 0..=start + i {
                    let want: f32 = (0..hd).map(|d| q[i * hd + d] * k[j * hd + d]).sum();
                    assert!((s[i * keys + j] - want).abs() < 1e-5, "{isa:?} S[{i},{j}]");
                }
            }
            // P: masked beyond each row's visible keys; O = P·V stops at the last visible key.
            let p: Vec<f32> = (0..t * keys).map(|i| if i % keys <= start + i / keys { 0.5 } else { 0.0 }).collect();
            let v = PackedMatrix::pack(keys, hd, WeightDtype::F32, |j, d| k[j * hd + d]);
            let mut o = vec![0.0f32; t * hd];
            matmul_causal(isa, &p, t, &v, none, Causal::KeyInner { start }, &mut o);
            for i in 0..t {
                for d in 0..hd {
                    let want: f32 = (0..=start + i).map(|j| 0.5 * k[j * hd + d]).sum();
                    assert!((o[i * hd + d] - want).abs() < 1e-5, "{isa:?} O[{i},{d}]");
                }
            }
        }
    }
}

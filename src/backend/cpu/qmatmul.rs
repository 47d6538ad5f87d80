//! Block-quantized weights kept as the GGUF file stores them (Q8_0, Q4_0, Q4_1; Q4_K as
//! exact Q4_1 sub-blocks with f32 scales, [`QMatrix::from_q4_k`]; Q6_K exactly in blocks
//! of 32 with two i8 half-block scales, [`QMatrix::from_q6_k`]), multiplied
//! with activations quantized to 8-bit blocks, as llama.cpp does: each 32-value block of a
//! weight row and of an activation row meet in one integer dot product, scaled once.
//!
//! Activations are quantized per row and block of 32 as llama.cpp's `quantize_row_q8_0/1`:
//! `d = max|x| / 127`, `q = round(x / d)` (half away from zero), with `d` and (for Q4_1)
//! `s = d · Σq` rounded to f16. Then, per block:
//!
//! | weights | block dot |
//! | --- | --- |
//! | Q8_0 (`d`, 32 × i8) | `d_w · d_x · Σ w·q` |
//! | Q4_0 (`d`, nibbles − 8) | `d_w · d_x · Σ (n − 8)·q` |
//! | Q4_1 (`d`, `m`, nibbles) | `d_w · d_x · Σ n·q + m_w · s_x` |
//! | Q6_K (`d`, scales `c₀`, `c₁` of the halves, 6-bit `n`) | `d_w · d_x · (c₀ · Σ₀ (n − 32)·q + c₁ · Σ₁ (n − 32)·q)` |
//!
//! The integer sums are exact; only the f32 accumulation over blocks differs from
//! llama.cpp's order. This is llama.cpp's arithmetic, not HF's: the 8-bit activations cost
//! about 1% relative error per layer against a dequantized f32 run (`--dtype f32` takes
//! that path, through [`super::PackedMatrix`]).
//!
//! **One order of arithmetic everywhere.** Each output keeps four float lanes; block `b`
//! goes to lane `k = b % 4` as `acc[k] = fma(d_w · d_x, Σ w·q, acc[k])` with the block's
//! integer sum complete first (Q4_0's `Σ (n − 8)·q` as `Σ n·q − 8·Σq`), plus for Q4_1
//! `off[k] = fma(m_w, s_x, off[k])`; then `t[k] = acc[k] + off[k]` and the output is
//! `(t0 + t2) + (t1 + t3)`. The SIMD kernels and the portable path follow it exactly, so
//! they agree bit for bit, and a row's result never depends on how many rows are
//! multiplied with it (decode and prefill, alone or batched: the server's batch invariance).
//!
//! Kernels, over a panel of sixteen interleaved weight rows ([`QMatrix`]): one register
//! holds four consecutive weight bytes of each of the sixteen rows, so one integer
//! multiply-add against four activation bytes broadcast (AVX-512 VNNI: `vpdpbusd`, Q8_0 on
//! weights offset by 128, the sum started at −128 · the activation block's sum; AVX2:
//! `maddubs` + `madd`, eight rows per 256-bit register) adds four products into each row's
//! own 32-bit lane. A block's integer sums thus come out one row per lane, with no
//! transposes or horizontal adds, and are scaled by one vector multiply and FMA per block
//! and activation row. Each weight block, loaded and unpacked once, meets up to eight
//! activation rows (on AVX2 four for Q8_0, two for the others). Described and measured
//! in `docs/benchmarks.md` ("What the kernels do").

use half::f16;
use rayon::prelude::*;

use super::simd::Isa;
use super::weights::WeightBuf;
use crate::tensor::GgmlType;

/// Values per block, for every type here.
pub const QK: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QType {
    Q8_0,
    Q4_0,
    Q4_1,
    /// GGUF Q6_K held in blocks of 32 ([`QMatrix::from_q6_k`]): 6-bit quants, the
    /// super-block's `d` per block, and the two 16-value sub-blocks' i8 scales.
    Q6K,
}

impl QType {
    /// The types GGUF stores in 32-value blocks that are kept as they are (Q4_K and Q6_K
    /// have their own constructors; the rest are re-quantized to Q8_0 at load).
    pub fn from_ggml(t: GgmlType) -> Option<QType> {
        match t {
            GgmlType::Q8_0 => Some(QType::Q8_0),
            GgmlType::Q4_0 => Some(QType::Q4_0),
            GgmlType::Q4_1 => Some(QType::Q4_1),
            _ => None,
        }
    }

    /// Bytes of a 32-value GGUF block (Q6_K has none: its blocks hold 256 values).
    pub fn block_bytes(self) -> usize {
        match self {
            QType::Q8_0 => 34,
            QType::Q4_0 => 18,
            QType::Q4_1 => 20,
            QType::Q6K => panic!("q6_k blocks hold 256 values in 210 bytes (QMatrix::from_q6_k)"),
        }
    }

    /// Bytes of quants per block.
    fn quant_bytes(self) -> usize {
        match self {
            QType::Q8_0 => 32,
            QType::Q4_0 | QType::Q4_1 => 16,
            // 16 bytes of low nibbles as Q4's, then 8 bytes of 2-bit highs.
            QType::Q6K => 24,
        }
    }

    /// Scales per block: `d`, and `m` for Q4_1.
    fn scales(self) -> usize {
        if self == QType::Q4_1 { 2 } else { 1 }
    }

    pub fn name(self) -> &'static str {
        match self {
            QType::Q8_0 => "q8_0",
            QType::Q4_0 => "q4_0",
            QType::Q4_1 => "q4_1",
            QType::Q6K => "q6_k",
        }
    }
}

/// Rows interleaved per panel (see [`QMatrix`]): sixteen 32-bit lanes, one 512-bit
/// register (or two 256-bit ones).
pub const PANEL: usize = 16;

/// A row's blocks are accumulated in [`LANES`] float lanes, block `b` in lane `b % 4`
/// (see the module doc).
pub const LANES: usize = 4;

/// A `[n_out, n_in]` matrix of `n_in / 32` blocks per row, rearranged at load into panels
/// of [`PANEL`] rows, so a decode step reads each panel as one sequential stream; a last
/// partial panel is padded with zero rows.
/// - Quants (`qs`), block by block, the panel's sixteen rows together in steps of four
///   bytes: `[r0 bytes 0-3][r1 bytes 0-3] … [r15 bytes 0-3][r0 bytes 4-7] …`, each row's
///   bytes as the file has them (Q8_0: 32 values; Q4: 16 bytes, value `i` in the low
///   nibble of byte `i` and value `i + 16` in its high nibble; Q6_K, repacked: those 16
///   bytes of low nibbles, then 8 bytes whose byte `i` holds the top two bits of values
///   `i`, `i + 8`, `i + 16`, `i + 24` at bits 0, 2, 4, 6). So one 512-bit load holds
///   four consecutive bytes of each of the sixteen rows, and one `vpdpbusd` against four
///   activation bytes broadcast adds four products into each row's own 32-bit lane: a
///   block's integer sums come out one row per lane, with no horizontal adds.
/// - Scales (`dm`), block by block: the sixteen rows' `d`, then (Q4_1) their `m`. They
///   stay f16 as the file has them (the kernels widen them, exactly), but for Q4_K's
///   sub-block scales `d · scale`, which need f32.
/// - Q6_K's half-block i8 scales (`sc`), block by block: the sixteen rows' first-half
///   scale, then their second-half one.
pub struct QMatrix {
    pub ty: QType,
    pub n_in: usize,
    pub n_out: usize,
    qs: WeightBuf<u8>,
    dm: Scales,
    /// Q6_K's sub-block scales, block by block: the sixteen rows' first-half i8 scale,
    /// then their second-half one (empty for the other types).
    sc: Vec<i8>,
}

/// Stored scales: f16 bits, or f32 where f16 cannot hold them exactly.
enum Scales {
    Half(WeightBuf<u16>),
    Full(WeightBuf<f32>),
}

impl Scales {
    /// `n` zero scales (in huge pages, as the quants).
    fn zeros(half: bool, n: usize) -> Scales {
        if half { Scales::Half(WeightBuf::filled(n, 0)) } else { Scales::Full(WeightBuf::filled(n, 0.0)) }
    }

    fn set(&mut self, i: usize, v: f32) {
        match self {
            Scales::Half(h) => {
                // The callers' values came from f16: the round trip is exact.
                debug_assert!(f16::from_f32(v).to_f32() == v || v.is_nan(), "scale {v} is not an f16");
                h[i] = f16::from_f32(v).to_bits();
            }
            Scales::Full(f) => f[i] = v,
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Scales::Half(h) => 2 * h.len(),
            Scales::Full(f) => 4 * f.len(),
        }
    }

    fn slice(&self, range: std::ops::Range<usize>) -> ScaleSlice<'_> {
        match self {
            Scales::Half(h) => ScaleSlice::Half(&h[range]),
            Scales::Full(f) => ScaleSlice::Full(&f[range]),
        }
    }
}

/// A slice of [`Scales`].
#[derive(Clone, Copy)]
enum ScaleSlice<'a> {
    Half(&'a [u16]),
    Full(&'a [f32]),
}

impl ScaleSlice<'_> {
    fn get(self, i: usize) -> f32 {
        match self {
            ScaleSlice::Half(h) => f16::from_bits(h[i]).to_f32(),
            ScaleSlice::Full(f) => f[i],
        }
    }
}

/// One row of a [`QMatrix`]: its panel's data and its place in the panel.
#[derive(Clone, Copy)]
struct RowRef<'a> {
    ty: QType,
    qs: &'a [u8],
    dm: ScaleSlice<'a>,
    sc: &'a [i8],
    r: usize,
}

impl RowRef<'_> {
    /// Block `b`: its quants as stored (Q4's 16 bytes or Q6_K's 24 first, then zeros), its
    /// scale `d` and its offset `m` (0 but for Q4_1).
    fn block(&self, b: usize) -> ([u8; QK], f32, f32) {
        let (qb, ns) = (self.ty.quant_bytes(), self.ty.scales());
        let mut q = [0u8; QK];
        let blk = &self.qs[b * PANEL * qb..(b + 1) * PANEL * qb];
        for (step, piece) in q[..qb].chunks_exact_mut(4).enumerate() {
            piece.copy_from_slice(&blk[(step * PANEL + self.r) * 4..][..4]);
        }
        let at = |kind: usize| self.dm.get(scale_index(ns, b, kind, self.r));
        (q, at(0), if ns == 2 { at(1) } else { 0.0 })
    }

    /// Q6_K's i8 scales of block `b`'s two halves.
    fn sub_scales(&self, b: usize) -> [i32; 2] {
        [0, 1].map(|h| i32::from(self.sc[(2 * b + h) * PANEL + self.r]))
    }
}

/// Value `i` (0..32) of a Q6_K-style block's 24 quant bytes, unsigned 0..63: the low
/// nibble from byte `i % 16` (high nibble for `i ≥ 16`), the top two bits from byte
/// `16 + i % 8`, bits `2 · (i / 8)`.
fn q6_value(q: &[u8], i: usize) -> i32 {
    let low = (q[i % 16] >> (4 * (i / 16))) & 0x0F;
    let high = (q[16 + i % 8] >> (2 * (i / 8))) & 3;
    i32::from(low | high << 4)
}

/// Where, in a panel's scales, row `r`'s scale `kind` (0: `d`, 1: `m`) of block `b` is.
fn scale_index(ns: usize, b: usize, kind: usize, r: usize) -> usize {
    (b * ns + kind) * PANEL + r
}

/// Bytes of one row of a k-quant matrix (super-blocks of 256 values, `block` bytes each),
/// checked: whole super-blocks, and exactly `n_out` rows in `len` bytes.
fn k_quant_row_bytes(name: &str, block: usize, n_out: usize, n_in: usize, len: usize) -> Result<usize, String> {
    const QK_K: usize = 256;
    if n_in == 0 || !n_in.is_multiple_of(QK_K) {
        return Err(format!("{name}: rows of {n_in} values are not whole blocks of {QK_K}"));
    }
    let row_bytes = n_in / QK_K * block;
    if Some(len) != row_bytes.checked_mul(n_out) {
        return Err(format!("{name}: {len} bytes for {n_out} rows of {row_bytes}"));
    }
    Ok(row_bytes)
}

/// Rows re-blocked between two calls of the loader's `done` in [`QMatrix::new_with`].
const RELEASE_ROWS: usize = 512;

impl QMatrix {
    /// `bytes` holds `n_out` rows of `n_in / 32` blocks of `ty`, as GGUF stores them.
    pub fn new(ty: QType, n_out: usize, n_in: usize, bytes: &[u8]) -> Result<Self, String> {
        Self::new_with(ty, n_out, n_in, bytes, |_| {})
    }

    /// [`QMatrix::new`], calling `done(bytes)` with the source bytes of each run of rows
    /// once they are re-blocked (so a loader can give them back while the rest is read).
    pub fn new_with(
        ty: QType,
        n_out: usize,
        n_in: usize,
        bytes: &[u8],
        mut done: impl FnMut(&[u8]),
    ) -> Result<Self, String> {
        if ty == QType::Q6K {
            return Err("q6_k: blocks of 256 values (QMatrix::from_q6_k)".into());
        }
        if n_in == 0 || !n_in.is_multiple_of(QK) {
            return Err(format!("{}: rows of {n_in} values are not whole blocks of {QK}", ty.name()));
        }
        let nb = n_in / QK;
        let row_bytes = nb * ty.block_bytes();
        if Some(bytes.len()) != row_bytes.checked_mul(n_out) {
            return Err(format!("{}: {} bytes for {n_out} rows of {row_bytes}", ty.name(), bytes.len()));
        }
        let header = ty.block_bytes() - ty.quant_bytes();
        let fill = |j: usize, b: usize, q: &mut [u8], dm: &mut [f32; 2], _: &mut [i8; 2]| {
            let blk = &bytes[j * row_bytes + b * ty.block_bytes()..][..ty.block_bytes()];
            q.copy_from_slice(&blk[header..]);
            for (i, v) in dm.iter_mut().take(ty.scales()).enumerate() {
                *v = f16_at(blk, 2 * i);
            }
        };
        Ok(Self::from_blocks(ty, true, n_out, n_in, fill, |rows| {
            done(&bytes[rows.start * row_bytes..rows.end * row_bytes])
        }))
    }

    /// GGUF Q4_K blocks held as Q4_1 blocks with f32 scales, losslessly: each sub-block of
    /// 32 is `(d·scale)·q − dmin·min` with 4-bit `q`, i.e. Q4_1 with `d' = d·scale` and
    /// `m' = −(dmin·min)` (exact f32 products of an f16 and a 6-bit integer), its nibbles
    /// repacked from Q4_K's sub-block pairs to Q4_1's halves. So Q4_K runs on the Q4_1
    /// kernel at 6 bits a weight (not re-quantized to Q8_0 at 9), and decodes bit-exactly.
    pub fn from_q4_k(n_out: usize, n_in: usize, bytes: &[u8]) -> Result<Self, String> {
        Self::from_q4_k_with(n_out, n_in, bytes, |_| {})
    }

    /// [`QMatrix::from_q4_k`] with `done` as in [`QMatrix::new_with`].
    pub fn from_q4_k_with(
        n_out: usize,
        n_in: usize,
        bytes: &[u8],
        mut done: impl FnMut(&[u8]),
    ) -> Result<Self, String> {
        const BLOCK: usize = 144;
        let row_bytes = k_quant_row_bytes("q4_k", BLOCK, n_out, n_in, bytes.len())?;
        let fill = |j: usize, b: usize, q: &mut [u8], dm: &mut [f32; 2], _: &mut [i8; 2]| {
            // Sub-block b of the row: sub-block b % 8 of super-block b / 8.
            let blk = &bytes[j * row_bytes + b / 8 * BLOCK..][..BLOCK];
            let sub = b % 8;
            let (sc, m) = crate::quant::k_scale_min(&blk[4..16], sub);
            dm[0] = f16_at(blk, 0) * f32::from(sc);
            dm[1] = -(f16_at(blk, 2) * f32::from(m));
            let chunk = &blk[16 + sub / 2 * 32..][..32];
            let nib = |l: usize| if sub.is_multiple_of(2) { chunk[l] & 0x0F } else { chunk[l] >> 4 };
            for (i, byte) in q.iter_mut().enumerate() {
                *byte = nib(i) | nib(i + 16) << 4;
            }
        };
        Ok(Self::from_blocks(QType::Q4_1, false, n_out, n_in, fill, |rows| {
            done(&bytes[rows.start * row_bytes..rows.end * row_bytes])
        }))
    }

    /// GGUF Q6_K blocks held exactly in blocks of 32, at 7 bits a weight (the file's 6.56
    /// plus the super-block's `d` repeated per block): each 32 values keep their 6-bit
    /// quants `q` (repacked from Q6_K's interleaved halves), the two i8 scales of their
    /// 16-value halves and `d`, so `w = (d · scale) · (q − 32)` as the file decodes. The
    /// kernels sum a block exactly as `scale₀ · Σ₀ (q − 32)·x + scale₁ · Σ₁ (q − 32)·x`
    /// (within ±2²⁴, exact in f32) and scale it by `d · d_x`: llama.cpp's arithmetic, with
    /// no re-quantization to Q8_0 (which rounded, and read 34 bytes per 32 weights).
    pub fn from_q6_k(n_out: usize, n_in: usize, bytes: &[u8]) -> Result<Self, String> {
        Self::from_q6_k_with(n_out, n_in, bytes, |_| {})
    }

    /// [`QMatrix::from_q6_k`] with `done` as in [`QMatrix::new_with`].
    pub fn from_q6_k_with(
        n_out: usize,
        n_in: usize,
        bytes: &[u8],
        mut done: impl FnMut(&[u8]),
    ) -> Result<Self, String> {
        const BLOCK: usize = 210;
        let row_bytes = k_quant_row_bytes("q6_k", BLOCK, n_out, n_in, bytes.len())?;
        let fill = |j: usize, b: usize, q: &mut [u8], dm: &mut [f32; 2], sc: &mut [i8; 2]| {
            // Block b of the row: values 32·(b % 8) .. + 32 of super-block b / 8, whose
            // value u sits in half n = u / 128 as Q6_K interleaves them (see `quant`).
            let blk = &bytes[j * row_bytes + b / 8 * BLOCK..][..BLOCK];
            let value = |u: usize| {
                let (n, v) = (u / 128, u % 128);
                let low = blk[64 * n + v % 64];
                let low = if v < 64 { low & 0x0F } else { low >> 4 };
                low | (blk[128 + 32 * n + v % 32] >> (2 * (v / 32)) & 3) << 4
            };
            let u0 = 32 * (b % 8);
            q.fill(0);
            for i in 0..QK {
                let v = value(u0 + i);
                q[i % 16] |= (v & 0x0F) << (4 * (i / 16));
                q[16 + i % 8] |= (v >> 4) << (2 * (i / 8));
            }
            *sc = [blk[192 + u0 / 16] as i8, blk[192 + u0 / 16 + 1] as i8];
            dm[0] = f16_at(blk, 208);
        };
        Ok(Self::from_blocks(QType::Q6K, true, n_out, n_in, fill, |rows| {
            done(&bytes[rows.start * row_bytes..rows.end * row_bytes])
        }))
    }

    /// A Q8_0 matrix re-quantized from rows of floats: `row(j)` gives row `j`'s `n_in`
    /// values (decoded once, when the re-blocking reaches it; a short row reads as zeros
    /// past its end) and `done` hears of each finished run of rows, as in
    /// [`QMatrix::new_with`]. Blocks round as [`quantize_q8_0`] does (llama-quantize's rule).
    pub fn requantized_q8_0(
        n_out: usize,
        n_in: usize,
        row: impl Fn(usize) -> Vec<f32>,
        done: impl FnMut(std::ops::Range<usize>),
    ) -> Result<Self, String> {
        if n_in == 0 || !n_in.is_multiple_of(QK) {
            return Err(format!("q8_0: rows of {n_in} values are not whole blocks of {QK}"));
        }
        // The current row, quantized: from_blocks visits rows in order, blocks within each.
        let current: std::cell::RefCell<(usize, Vec<u8>)> = std::cell::RefCell::new((usize::MAX, Vec::new()));
        let fill = |j: usize, b: usize, q: &mut [u8], dm: &mut [f32; 2], _: &mut [i8; 2]| {
            let mut cur = current.borrow_mut();
            if cur.0 != j {
                let mut values = row(j);
                values.resize(n_in, 0.0);
                *cur = (j, quantize_q8_0(&values));
            }
            let blk = &cur.1[b * 34..(b + 1) * 34];
            q.copy_from_slice(&blk[2..]);
            dm[0] = f16_at(blk, 0);
        };
        Ok(Self::from_blocks(QType::Q8_0, true, n_out, n_in, fill, done))
    }

    /// The panel-interleaved layout ([`QMatrix`]), each block's quants (in the file's
    /// order), `[d, m]` and (Q6_K) sub-block scales written by `fill(row, block, quants,
    /// scales, sub_scales)`; `half`: the scales are f16 values (kept as f16).
    /// `done(rows)` hears of each run of [`RELEASE_ROWS`] rows once it is written.
    fn from_blocks(
        ty: QType,
        half: bool,
        n_out: usize,
        n_in: usize,
        fill: impl Fn(usize, usize, &mut [u8], &mut [f32; 2], &mut [i8; 2]),
        mut done: impl FnMut(std::ops::Range<usize>),
    ) -> Self {
        let nb = n_in / QK;
        let (qb, ns) = (ty.quant_bytes(), ty.scales());
        let n_panels = n_out.div_ceil(PANEL);
        let panel_scales = nb * ns * PANEL;
        let mut qs = WeightBuf::filled(n_panels * nb * PANEL * qb, 0u8);
        let mut dm = Scales::zeros(half, n_panels * panel_scales);
        let mut subs = vec![0i8; if ty == QType::Q6K { n_panels * nb * 2 * PANEL } else { 0 }];
        let mut q = [0u8; QK];
        for j in 0..n_out {
            let (p, r) = (j / PANEL, j % PANEL);
            for b in 0..nb {
                let (mut sc, mut sub) = ([0f32; 2], [0i8; 2]);
                fill(j, b, &mut q[..qb], &mut sc, &mut sub);
                if ty == QType::Q6K {
                    for (h, v) in sub.into_iter().enumerate() {
                        subs[((p * nb + b) * 2 + h) * PANEL + r] = v;
                    }
                }
                let blk = &mut qs[(p * nb + b) * PANEL * qb..][..PANEL * qb];
                for (step, piece) in q[..qb].chunks_exact(4).enumerate() {
                    blk[(step * PANEL + r) * 4..][..4].copy_from_slice(piece);
                }
                for (kind, v) in sc.into_iter().take(ns).enumerate() {
                    dm.set(p * panel_scales + scale_index(ns, b, kind, r), v);
                }
            }
            if (j + 1).is_multiple_of(RELEASE_ROWS) || j + 1 == n_out {
                done(j / RELEASE_ROWS * RELEASE_ROWS..j + 1);
            }
        }
        QMatrix { ty, n_in, n_out, qs, dm, sc: subs }
    }

    /// Bytes of weight data in memory.
    pub fn bytes(&self) -> usize {
        self.qs.len() + self.dm.bytes() + self.sc.len()
    }

    fn blocks_per_row(&self) -> usize {
        self.n_in / QK
    }

    /// Panel `p`'s quants, scales and (Q6_K) sub-block scales. Always inlined: called once
    /// per panel and activation row block, and returned through memory it cost a
    /// store-forwarding stall per call (~5% of a SmolLM2 prefill).
    #[inline(always)]
    fn panel(&self, p: usize) -> (&[u8], ScaleSlice<'_>, &[i8]) {
        let nb = self.blocks_per_row();
        let (qp, sp) = (nb * PANEL * self.ty.quant_bytes(), nb * PANEL * self.ty.scales());
        let subs = if self.sc.is_empty() { &[][..] } else { &self.sc[p * nb * 2 * PANEL..(p + 1) * nb * 2 * PANEL] };
        (&self.qs[p * qp..(p + 1) * qp], self.dm.slice(p * sp..(p + 1) * sp), subs)
    }

    fn row(&self, j: usize) -> RowRef<'_> {
        let (qs, dm, sc) = self.panel(j / PANEL);
        RowRef { ty: self.ty, qs, dm, sc, r: j % PANEL }
    }

    /// Row `j` decoded to f32 (an embedding lookup), exactly as `quant::dequantize`.
    pub fn dequantize_row(&self, j: usize, out: &mut [f32]) {
        let row = self.row(j);
        for (b, vals) in out.chunks_exact_mut(QK).enumerate() {
            let (q, d, m) = row.block(b);
            match self.ty {
                QType::Q8_0 => {
                    for (v, &q) in vals.iter_mut().zip(&q) {
                        *v = d * (q as i8) as f32;
                    }
                }
                QType::Q4_0 => {
                    for i in 0..16 {
                        vals[i] = d * ((q[i] & 0x0F) as i32 - 8) as f32;
                        vals[i + 16] = d * ((q[i] >> 4) as i32 - 8) as f32;
                    }
                }
                QType::Q4_1 => {
                    for i in 0..16 {
                        vals[i] = d * (q[i] & 0x0F) as f32 + m;
                        vals[i + 16] = d * (q[i] >> 4) as f32 + m;
                    }
                }
                QType::Q6K => {
                    // As gguf-py: (d · scale) · (q − 32).
                    let sc = row.sub_scales(b);
                    for (i, v) in vals.iter_mut().enumerate() {
                        *v = (d * sc[i / 16] as f32) * (q6_value(&q, i) - 32) as f32;
                    }
                }
            }
        }
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// `values` (whole rows of whole blocks) as GGUF Q8_0 blocks, with llama.cpp's rule
/// (`quantize_row_q8_0`: `d = max|x| / 127` stored as f16, `q = round(x / d)`): how types
/// without a kernel here (Q5_0, Q5_1, Q5_K) reach the Q8_0 kernel.
pub fn quantize_q8_0(values: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(values.len() / QK * 34);
    values.chunks_exact(QK).for_each(|block| crate::quant::encode::q8_0(block, &mut out));
    out
}

/// Activation rows quantized to 8-bit blocks.
#[derive(Default)]
pub struct Q8Rows {
    pub blocks_per_row: usize,
    /// Per block: the scale `d` (f16-rounded).
    pub d: Vec<f32>,
    /// Per block: `d · Σq` (f16-rounded), for Q4_1's offset term.
    pub s: Vec<f32>,
    /// Per block: `Σq`, exact, for Q4_0's `Σ (n − 8)·q = Σ n·q − 8·Σq` and the VNNI Q8_0
    /// kernel's `Σ (w + 128)·q − 128·Σq`: it must equal the block's sum.
    pub sum: Vec<i32>,
    /// Per block: the sum of its first 16 `q` (Q6_K's sub-blocks: `Σ (q_w − 32)·q` per
    /// half needs each half's `Σq`).
    pub sum_lo: Vec<i32>,
    /// The 8-bit values, within ±127 (never −128: the AVX2 Q8_0 kernel's sign trick
    /// relies on it).
    pub q: Vec<i8>,
    /// Scratch of `quantize_rows`: `(d, s, Σq, Σq of the first 16)` per block, kept so warm
    /// decode steps do not allocate.
    meta: Vec<BlockMeta>,
}

/// A quantized activation block's `(d, s, Σq, Σq of its first 16)`.
type BlockMeta = (f32, f32, i32, i32);

/// `(roundf(v) as i32).clamp(-127, 127)` (ties away from zero; NaN gives 0) without a libm
/// call, in operations that vectorize: clamp first (the same result: ±127 rounds to
/// itself, and anything past it clamps there either way), truncate, then step by one where
/// the remainder reaches a half (`v − trunc(v)` is exact).
#[inline(always)]
fn round_half_away_clamped(v: f32) -> i8 {
    let c = if v.is_nan() { 0.0 } else { v.clamp(-127.0, 127.0) };
    let t = c.trunc();
    let frac = c - t;
    let r = t + if frac >= 0.5 {
        1.0
    } else if frac <= -0.5 {
        -1.0
    } else {
        0.0
    };
    // SAFETY: r is an integer within ±127 (c is finite and within ±127, so is its rounding).
    unsafe { r.to_int_unchecked::<i32>() as i8 }
}

/// One block of 32 activations quantized into `qb`: `(d, s, Σq, Σq of the first 16)` as
/// [`Q8Rows`] keeps them.
#[inline(always)]
fn quantize_block(xb: &[f32; QK], qb: &mut [i8; QK]) -> BlockMeta {
    let sums = |qb: &[i8; QK]| {
        let sum_lo: i32 = qb[..16].iter().map(|&q| q as i32).sum();
        (sum_lo + qb[16..].iter().map(|&q| q as i32).sum::<i32>(), sum_lo)
    };
    let to_f16 = |d: f32, s: f32| (f16::from_f32(d).to_f32(), f16::from_f32(s).to_f32());
    let amax = |xb: &[f32; QK]| xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    quantize_block_by(xb, qb, amax, sums, to_f16)
}

/// [`quantize_block`] with its largest magnitude (of finite values: any order gives the
/// same), its two sums (`Σq`, `Σq` of the first 16) and its rounding of `d` and `s` to f16
/// (round to nearest even) supplied.
#[inline(always)]
fn quantize_block_by(
    xb: &[f32; QK],
    qb: &mut [i8; QK],
    amax: impl Fn(&[f32; QK]) -> f32,
    sums: impl Fn(&[i8; QK]) -> (i32, i32),
    to_f16: impl Fn(f32, f32) -> (f32, f32),
) -> BlockMeta {
    // NaN or infinity anywhere makes the block's scale non-finite, so the outputs are
    // too and the engine's non-finite check sees it (f32::max would skip a NaN).
    let amax = amax(xb);
    let finite = xb.iter().fold(true, |f, v| f & v.is_finite());
    let amax = if finite { amax } else { f32::NAN };
    let dv = amax / 127.0;
    let id = if dv != 0.0 { 1.0 / dv } else { 0.0 };
    for (q, &v) in qb.iter_mut().zip(xb) {
        *q = round_half_away_clamped(v * id);
    }
    let (sum, sum_lo) = sums(qb);
    let (d, s) = to_f16(dv, dv * sum as f32);
    (d, s, sum, sum_lo)
}

/// Quantize `rows` rows of `n` values (`n` a multiple of 32), on `isa`'s quantizer (the
/// same bits on every one).
pub fn quantize_rows(isa: Isa, x: &[f32], rows: usize, n: usize, out: &mut Q8Rows) {
    assert!(n.is_multiple_of(QK) && x.len() >= rows * n, "quantize_rows: whole blocks of {QK} per row");
    let nb = n / QK;
    out.blocks_per_row = nb;
    out.q.resize(rows * n, 0);
    let mut meta = std::mem::take(&mut out.meta);
    meta.clear();
    meta.resize(rows * nb, (0.0, 0.0, 0, 0));
    #[cfg(target_arch = "x86_64")]
    let (wide, avx2) = (isa.is_avx512(), isa.is_avx2()); // F/BW/VL, AVX2, FMA, F16C detected
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa; // one quantizer off x86
    // Rows `first ..` of `x` into their quants `q` and block metadata `m`.
    let run = |first: usize, q: &mut [i8], m: &mut [BlockMeta]| {
        let xs = &x[first * n..first * n + q.len()];
        for ((xb, qb), mb) in xs.chunks_exact(QK).zip(q.chunks_exact_mut(QK)).zip(m.iter_mut()) {
            // Chunks of exactly QK (`chunks_exact`).
            let (xb, qb): (&[f32; QK], &mut [i8; QK]) = (xb.try_into().unwrap(), qb.try_into().unwrap());
            #[cfg(target_arch = "x86_64")]
            {
                *mb = if wide {
                    // SAFETY: the CPU has AVX-512 F/BW/VL, AVX2, FMA and F16C (detected above).
                    unsafe { x86::quantize_block_avx512(xb, qb) }
                } else if avx2 {
                    // SAFETY: the CPU has AVX2, FMA and F16C (detected above).
                    unsafe { x86::quantize_block_avx2(xb, qb) }
                } else {
                    quantize_block(xb, qb)
                };
            }
            #[cfg(not(target_arch = "x86_64"))]
            {
                *mb = quantize_block(xb, qb);
            }
        }
    };
    let q = &mut out.q[..rows * n];
    if n == 0 || rows <= 1 {
        run(0, q, &mut meta);
    } else if rows <= super::team::SPLIT_MAX_ROWS {
        // A decode step's rows on the team: a rayon region's wake-up costs more.
        super::team::split2_mut(q, n, &mut meta, nb, &run);
    } else {
        q.par_chunks_mut(n).zip(meta.par_chunks_mut(nb)).enumerate().for_each(|(r, (qr, mr))| run(r, qr, mr));
    }
    out.d.clear();
    out.d.extend(meta.iter().map(|m| m.0));
    out.s.clear();
    out.s.extend(meta.iter().map(|m| m.1));
    out.sum.clear();
    out.sum.extend(meta.iter().map(|m| m.2));
    out.sum_lo.clear();
    out.sum_lo.extend(meta.iter().map(|m| m.3));
    out.meta = meta;
}

/// Activation rows per kernel call on AVX-512 VNNI: each block of weights, loaded and
/// unpacked once, meets this many (kernels for 1-4 and 8 rows; 16 chains of integer sums
/// in registers at 8). Eight rather than four: prefill +8% (GPT-2 q8_0 and SmolLM2 Q4_1
/// pp512, Zen 4). The AVX2 kernel, with half the registers, takes at most
/// [`TOKENS_AVX2`], per type ([`tokens_avx2`]).
const TOKENS: usize = 8;

/// See [`TOKENS`]: at most four on AVX2, four for Q8_0 (its weights' load and `psignb`
/// shared by four rows: a 16-sequence GPT-2 Q8_0 decode step +5-20% over two on a Zen 3,
/// `docs/benchmarks.md`), two for the others (Q4_1 at four spilled: SmolLM2's 16-sequence
/// step −5-8%).
const TOKENS_AVX2: usize = 4;

/// Activation rows per AVX2 kernel call for weights of type `ty` (see [`TOKENS_AVX2`]);
/// the portable path takes the same chunks (it runs any count a row at a time).
fn tokens_avx2(ty: QType) -> usize {
    if ty == QType::Q8_0 { TOKENS_AVX2 } else { 2 }
}

/// Products of up to this many activation rows (decode, alone or batched) run on the
/// spinning thread team, one contiguous run of panels per thread, each panel meeting every
/// row while it is in cache; longer ones (prefill) go to rayon, a panel per task.
const TEAM_MAX_ROWS: usize = 32;

/// `out[t][j] = Σ_k W[j][k] · x[t][k]` for `t < xq rows`, `j < n_out`: (T, n_out).
pub fn qmatmul(isa: Isa, w: &QMatrix, xq: &Q8Rows, t_rows: usize, out: &mut [f32]) {
    let n_out = w.n_out;
    let nb = w.blocks_per_row();
    assert_eq!(xq.blocks_per_row * QK, w.n_in, "qmatmul: activation width");
    assert!(out.len() == t_rows * n_out && xq.q.len() >= t_rows * w.n_in, "qmatmul: output or activation rows");
    assert!(
        xq.d.len().min(xq.s.len()).min(xq.sum.len()).min(xq.sum_lo.len()) >= t_rows * nb,
        "qmatmul: activation scales"
    );
    // Tasks own output columns (rows of W), so a task writes the strided columns of `out`
    // for every token through a raw pointer.
    let out_ptr = OutPtr(out.as_mut_ptr());
    let n_panels = n_out.div_ceil(PANEL);
    let chunk = if isa.has_vnni() { TOKENS } else { tokens_avx2(w.ty) };
    // Panel p against every activation row, `chunk` rows a call, written to the output.
    // (`sums`: the kernel's output, one per claim of panels — four, or two when helping
    // — rather than one per panel: zeroing it, a `memset` call, showed in batched-decode
    // profiles.)
    let panel_rows = |p: usize, sums: &mut [[f32; PANEL]; TOKENS]| {
        let cols = (n_out - p * PANEL).min(PANEL);
        let mut t = 0;
        while t < t_rows {
            // `chunk` rows a call where `chunk` remain, else the rest (at most four: kernels
            // exist for 1-4 and 8 rows).
            let n = if t_rows - t >= chunk { chunk } else { (t_rows - t).min(chunk.min(4)) };
            // What this call prefetches: the first of several calls on a panel, the next
            // panel, to L2 while this one is worked from cache; otherwise (one call per
            // panel, or the panel already in cache) the next stretch of this panel.
            let ahead = if t == 0 && t_rows > n { Ahead::NextPanel } else { Ahead::Near };
            panel_dot(isa, w, p, xq, t, n, ahead, sums);
            for (i, row) in sums[..n].iter().enumerate() {
                // SAFETY: columns 16p .. 16p + cols of row t + i are inside the (t_rows,
                // n_out) output, and panel p's columns belong to this task alone.
                unsafe { out_ptr.write((t + i) * n_out + p * PANEL, &row[..cols]) };
            }
            t += n;
        }
    };
    let threads = rayon::current_num_threads();
    if t_rows <= TEAM_MAX_ROWS && threads > 1 {
        // Decode: contiguous runs of panels per thread, on the spinning team, a thread done
        // early finishing the others' runs from their ends. (Threads taking short runs from
        // one shared counter balanced well but read memory slower: the streams broke up.)
        let run = |r: std::ops::Range<usize>| {
            let mut sums = [[0f32; PANEL]; TOKENS];
            r.for_each(|p| panel_rows(p, &mut sums));
        };
        if super::team::run_balanced(n_panels, 4, 2, &run) {
            return;
        }
    }
    // On one thread, a plain loop: rayon's splitting (and, from outside its pool, a
    // hand-off and wake-up per call) cost a third of a streamed decode matrix.
    let fresh = || [[0f32; PANEL]; TOKENS];
    if n_panels > 1 && (t_rows > 1 || n_out * w.n_in >= 1 << 14) && threads > 1 {
        (0..n_panels).into_par_iter().for_each_init(fresh, |sums, p| panel_rows(p, sums));
    } else {
        let mut sums = fresh();
        (0..n_panels).for_each(|p| panel_rows(p, &mut sums));
    }
}

#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint elements (see `qmatmul`).
unsafe impl Send for OutPtr {}
// SAFETY: as above.
unsafe impl Sync for OutPtr {}
impl OutPtr {
    /// # Safety
    /// `i .. i + v.len()` is in bounds of the output and no other thread writes it.
    unsafe fn write(self, i: usize, v: &[f32]) {
        // SAFETY: the caller's contract.
        unsafe {
            if let Ok(whole) = <&[f32; PANEL]>::try_from(v) {
                // A whole panel's row: a fixed-size copy the compiler inlines (a `memcpy`
                // call for each of a batched step's hundreds of thousands showed in profiles).
                (self.0.add(i) as *mut [f32; PANEL]).write_unaligned(*whole);
            } else {
                std::ptr::copy_nonoverlapping(v.as_ptr(), self.0.add(i), v.len());
            }
        }
    }
}

/// What a kernel prefetches as it reads a panel.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Ahead {
    /// The panel's own quants, `x86::PF` bytes ahead, to L1.
    Near,
    /// The next panel's same block (quants and scales), to L2.
    NextPanel,
}

/// The sixteen rows of panel `p` against activation rows `t .. t + n` (n in 1..=4 or
/// [`TOKENS`] = 8; on the AVX2 kernel n ≤ [`tokens_avx2`]`(w.ty)`, four for Q8_0, else
/// two): `sums[i][r]` = row `16p + r` ·
/// activation row `t + i` (rows past the matrix's end, zero padding, give zeros).
#[allow(clippy::too_many_arguments)]
fn panel_dot(
    isa: Isa,
    w: &QMatrix,
    p: usize,
    xq: &Q8Rows,
    t: usize,
    n: usize,
    ahead: Ahead,
    sums: &mut [[f32; PANEL]; TOKENS],
) {
    let nb = xq.blocks_per_row;
    let n_in = nb * QK;
    assert!(nb * QK == w.n_in && (1..=TOKENS).contains(&n));
    assert!(
        (t + n) * n_in <= xq.q.len()
            && (t + n) * nb <= xq.d.len().min(xq.s.len()).min(xq.sum.len()).min(xq.sum_lo.len())
    );
    let (qs, dm, subs) = w.panel(p);
    assert!(w.ty != QType::Q6K || subs.len() == nb * 2 * PANEL);
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        let x = xq.q[t * n_in..].as_ptr();
        let (d, s, sum) = (xq.d[t * nb..].as_ptr(), xq.s[t * nb..].as_ptr(), xq.sum[t * nb..].as_ptr());
        let sum_lo = xq.sum_lo[t * nb..].as_ptr();
        let (q, sub) = (qs.as_ptr(), subs.as_ptr());
        let (sc, half) = match dm {
            ScaleSlice::Half(h) => (h.as_ptr() as *const u8, true),
            ScaleSlice::Full(f) => (f.as_ptr() as *const u8, false),
        };
        let pf = match ahead {
            Ahead::Near => x86::Prefetch { far: false, quants: x86::PF, scales: 0 },
            Ahead::NextPanel => {
                x86::Prefetch { far: true, quants: qs.len(), scales: w.dm.bytes() / w.n_out.div_ceil(PANEL) }
            }
        };
        // Kernel `$k` for (type, scale width, activation rows), with the prefetch kind.
        macro_rules! call {
            ($k:ident, $ty:literal, $h:literal, $n:literal) => {
                if pf.far {
                    x86::$k::<$ty, $h, $n, true>(q, sc, sub, nb, pf, x, d, s, sum, sum_lo, sums)
                } else {
                    x86::$k::<$ty, $h, $n, false>(q, sc, sub, nb, pf, x, d, s, sum, sum_lo, sums)
                }
            };
        }
        // The AVX2 kernel for 1-4 rows (Q8_0, type 0) or 1-2 rows (the others: no kernels
        // compiled that could never run).
        macro_rules! avx2 {
            (0, $h:literal) => {
                match n {
                    1 => call!(panel_dot_avx2, 0, $h, 1),
                    2 => call!(panel_dot_avx2, 0, $h, 2),
                    3 => call!(panel_dot_avx2, 0, $h, 3),
                    _ => call!(panel_dot_avx2, 0, $h, 4),
                }
            };
            ($ty:literal, $h:literal) => {
                match n {
                    1 => call!(panel_dot_avx2, $ty, $h, 1),
                    _ => call!(panel_dot_avx2, $ty, $h, 2),
                }
            };
        }
        // One kernel per (type, scale width, activation rows): VNNI where the CPU has it,
        // else AVX2.
        // (`tt`, not `literal`: a forwarded `literal` fragment would not match `avx2!`'s `0`.)
        macro_rules! go {
            ($ty:tt, $h:tt) => {
                if isa.has_vnni() {
                    match n {
                        1 => call!(panel_dot_vnni, $ty, $h, 1),
                        2 => call!(panel_dot_vnni, $ty, $h, 2),
                        3 => call!(panel_dot_vnni, $ty, $h, 3),
                        4 => call!(panel_dot_vnni, $ty, $h, 4),
                        _ => {
                            assert_eq!(n, 8);
                            call!(panel_dot_vnni, $ty, $h, 8)
                        }
                    }
                } else {
                    assert!(n <= tokens_avx2(w.ty));
                    avx2!($ty, $h)
                }
            };
        }
        // SAFETY: an AVX2 `Isa` exists only where detection found avx2+fma+f16c, an
        // AVX-512 VNNI one only where it also found AVX-512 F/BW/VL and VNNI; the panel
        // holds nb blocks of sixteen rows' quants and scales (`panel` slices them), and the
        // asserts above keep activation rows t..t+n (nb blocks each, with their scales and
        // sums) in bounds.
        unsafe {
            match (w.ty, half) {
                (QType::Q8_0, true) => go!(0, true),
                (QType::Q4_0, true) => go!(1, true),
                (QType::Q4_1, true) => go!(2, true),
                (QType::Q4_1, false) => go!(2, false),
                (QType::Q6K, true) => go!(3, true),
                (QType::Q8_0 | QType::Q4_0 | QType::Q6K, false) => {
                    unreachable!("Q8_0, Q4_0 and Q6_K scales are kept as f16")
                }
            }
        }
        return;
    }
    let _ = (isa, ahead);
    super::simd::portable(|| {
        for (i, row_sums) in sums[..n].iter_mut().enumerate() {
            let tr = t + i;
            let (x, blocks) = (&xq.q[tr * n_in..(tr + 1) * n_in], tr * nb..(tr + 1) * nb);
            for (r, sum) in row_sums.iter_mut().enumerate() {
                let row = RowRef { ty: w.ty, qs, dm, sc: subs, r };
                *sum = dot_scalar(row, x, &xq.d[blocks.clone()], &xq.s[blocks.clone()], &xq.sum[blocks.clone()]);
            }
        }
    })
}

/// The portable block dot, in the order the module's doc gives: each block's exact integer
/// sum, then `acc[b % 4] = fma(d_w · d_x, sum, acc[b % 4])`, Q4_1's offsets in their own
/// lanes; lane `k` ends as `acc[k] + off[k]` and the row as `(t0 + t2) + (t1 + t3)`.
#[inline(always)]
fn dot_scalar(row: RowRef, x: &[i8], d: &[f32], s: &[f32], sums: &[i32]) -> f32 {
    let (mut acc, mut off) = ([0f32; LANES], [0f32; LANES]);
    for (b, (((xb, &dx), &sx), &xsum)) in x.chunks_exact(QK).zip(d).zip(s).zip(sums).enumerate() {
        let (q, dw, m) = row.block(b);
        let isum: i32 = match row.ty {
            QType::Q8_0 => q.iter().zip(xb).map(|(&w, &v)| (w as i8) as i32 * v as i32).sum(),
            QType::Q4_0 | QType::Q4_1 => {
                let mut isum = 0i32;
                for i in 0..16 {
                    isum += (q[i] & 0x0F) as i32 * xb[i] as i32;
                    isum += (q[i] >> 4) as i32 * xb[i + 16] as i32;
                }
                if row.ty == QType::Q4_0 { isum - 8 * xsum } else { isum }
            }
            QType::Q6K => {
                // scale₀ · Σ₀ (q − 32)·x + scale₁ · Σ₁ (q − 32)·x: |·| ≤ 2·128·16·32·127 < 2²⁴.
                let sc = row.sub_scales(b);
                (0..2)
                    .map(|h| sc[h] * (16 * h..16 * h + 16).map(|i| (q6_value(&q, i) - 32) * xb[i] as i32).sum::<i32>())
                    .sum()
            }
        };
        // |isum| ≤ 32 · 128 · 127 < 2²⁴ (Q6_K: see above): exact in f32.
        let k = b % LANES;
        acc[k] = (dw * dx).mul_add(isum as f32, acc[k]);
        if row.ty == QType::Q4_1 {
            off[k] = m.mul_add(sx, off[k]);
        }
    }
    let t: [f32; LANES] = if row.ty == QType::Q4_1 { std::array::from_fn(|k| acc[k] + off[k]) } else { acc };
    (t[0] + t[2]) + (t[1] + t[3])
}

#[cfg(target_arch = "x86_64")]
mod x86;

#[cfg(test)]
mod tests {
    use super::round_half_away_clamped;

    /// The AVX2 and AVX-512 block quantizers (vector maxima, sums and F16C conversions)
    /// give the portable one's bits: random blocks of every magnitude, ties, subnormals,
    /// zeros, scales past f16's range, and non-finite values (NaN scales either way).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn vector_block_quantizers_equal_the_portable_one() {
        use super::x86::{quantize_block_avx2, quantize_block_avx512};
        use super::{BlockMeta, QK, quantize_block};
        use crate::backend::cpu::simd::{avx2_or_skip, avx512_or_skip};
        type Quantizer = fn(&[f32; QK], &mut [i8; QK]) -> BlockMeta;
        let mut quantizers: Vec<(&str, Quantizer)> = Vec::new();
        if avx2_or_skip().is_some() {
            // SAFETY: AVX2, FMA and F16C detected.
            quantizers.push(("avx2", |b, q| unsafe { quantize_block_avx2(b, q) }));
        }
        if avx512_or_skip().is_some() {
            // SAFETY: AVX-512 F/BW/VL, AVX2, FMA and F16C detected.
            quantizers.push(("avx512", |b, q| unsafe { quantize_block_avx512(b, q) }));
        }
        // (Each missing level is a loud skip, a failure under CI=true where the CPU claims
        // the flags.)
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let mut blocks: Vec<[f32; QK]> = Vec::new();
        for case in 0..20_000 {
            let scale = 10f32.powi((next() % 80) as i32 - 40);
            let mut b: [f32; QK] = std::array::from_fn(|_| ((next() % 20001) as f32 / 10000.0 - 1.0) * scale);
            match case % 10 {
                // Ties: the largest magnitude 127, so d = 1 and every other value, k + ½,
                // quantizes from an exact half.
                0 => b = std::array::from_fn(|i| if i == 31 { 127.0 } else { i as f32 - 15.5 }),
                1 => b[(next() % 32) as usize] = f32::NAN,
                2 => b[(next() % 32) as usize] = f32::INFINITY,
                3 => b = [0.0; QK],
                4 => b[(next() % 32) as usize] = f32::from_bits(1), // a subnormal
                5 => b[(next() % 32) as usize] = 3e38 * if next() % 2 == 0 { 1.0 } else { -1.0 },
                6 => b[(next() % 32) as usize] = -0.0,
                _ => {}
            }
            blocks.push(b);
        }
        for (name, quantize) in quantizers {
            for b in &blocks {
                let (mut qa, mut qb) = ([0i8; QK], [0i8; QK]);
                let want = quantize_block(b, &mut qa);
                let got = quantize(b, &mut qb);
                assert_eq!(qa, qb, "{name}: quants of {b:?}");
                let same = |x: f32, y: f32| x.to_bits() == y.to_bits() || (x.is_nan() && y.is_nan());
                assert!(same(want.0, got.0) && same(want.1, got.1), "{name}: scales of {b:?}: {want:?} vs {got:?}");
                assert_eq!((want.2, want.3), (got.2, got.3), "{name}: sums of {b:?}");
            }
        }
    }

    /// A block so small that 1/d overflows quantizes to zeros (no overflow, no panic).
    #[test]
    fn underflowing_blocks_quantize_to_zero() {
        let mut q8 = super::Q8Rows::default();
        let x = [1e-38f32; 32];
        super::quantize_rows(crate::backend::cpu::simd::Isa::detect(), &x, 1, 32, &mut q8);
        assert_eq!((q8.d[0], q8.s[0]), (0.0, 0.0));
    }

    /// Equal to `roundf` (then clamped to ±127) on ties, their neighbours, a sweep of the
    /// activation range and the extremes (NaN gives 0, infinities ±127).
    #[test]
    fn round_half_away_clamped_is_roundf_clamped() {
        let mut vs = vec![0.5f32, -0.5, 1.5, -1.5, 2.5, 126.5, -126.5, 127.0, -127.0, 0.0, -0.0, 1e-30];
        for k in -130..=130 {
            let t = k as f32 + 0.5;
            vs.extend([t, f32::from_bits(t.to_bits() + 1), f32::from_bits(t.to_bits() - 1)]);
        }
        vs.extend((0..100_000).map(|i| (i as f32 * 0.002_531) - 127.0));
        let extremes = [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 3e9, -3e9, f32::MAX, f32::MIN, 8388609.0];
        vs.extend(extremes);
        vs.extend([
            127.49999,
            127.5,
            -127.5,
            128.0,
            -128.0,
            126.99999,
            -126.99999,
            f32::MIN_POSITIVE,
            -f32::MIN_POSITIVE,
        ]);
        for v in vs {
            assert_eq!(round_half_away_clamped(v), (v.round() as i32).clamp(-127, 127) as i8, "{v}");
        }
    }
}

//! Block-quantized weights kept as the GGUF file stores them (Q8_0, Q4_0, Q4_1; Q4_K as
//! exact Q4_1 sub-blocks with f32 scales, [`QMatrix::from_q4_k`]), multiplied
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
//! `(t0 + t2) + (t1 + t3)`. (The SIMD kernels run lanes of blocks past a row's end, in its
//! last quad, as `fma(0, 0, acc)`, which the portable path skips: the same bits, as an
//! accumulator starting at +0 never becomes −0.) The SIMD kernels and the portable path follow it exactly, so
//! they agree bit for bit, and a row's result never depends on how many rows are
//! multiplied with it (decode and prefill, alone or batched: the server's batch invariance).
//!
//! Kernels, over a group of four interleaved weight rows and a quad of four blocks at a
//! time: each block gives, per row, a vector of 4 partial integer sums (AVX-512 VNNI: one
//! 512-bit `vpdpbusd` pair for all four rows, Q8_0 on weights offset by 128 less 128 · the
//! activation block's sum; AVX2: `maddubs`/`madd`, two rows per 256-bit register); the
//! quad's four such vectors are transposed and added (`unpack` + `add`, no horizontal
//! adds) into `[row][block]` sums, scaled by one vector multiply and FMA per quad. In
//! prefill each decoded weight block meets four activation rows.

use half::f16;
use rayon::prelude::*;

use super::simd::Isa;
use crate::loaders::gguf::GgmlType;

/// Values per block, for every type here.
pub const QK: usize = 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum QType {
    Q8_0,
    Q4_0,
    Q4_1,
}

impl QType {
    /// The types kept quantized; others are decoded to f32 at load.
    pub fn from_ggml(t: GgmlType) -> Option<QType> {
        match t {
            GgmlType::Q8_0 => Some(QType::Q8_0),
            GgmlType::Q4_0 => Some(QType::Q4_0),
            GgmlType::Q4_1 => Some(QType::Q4_1),
            _ => None,
        }
    }

    pub fn block_bytes(self) -> usize {
        match self {
            QType::Q8_0 => 34,
            QType::Q4_0 => 18,
            QType::Q4_1 => 20,
        }
    }

    /// Bytes of quants per block.
    fn quant_bytes(self) -> usize {
        match self {
            QType::Q8_0 => 32,
            QType::Q4_0 | QType::Q4_1 => 16,
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
        }
    }
}

/// Rows interleaved per group (see [`QMatrix`]).
pub const GROUP: usize = 4;

/// Blocks per quad: a row's blocks are accumulated in [`LANES`] float lanes, block `b`
/// in lane `b % 4` (see the module doc), and scales are stored a quad at a time.
pub const LANES: usize = 4;

/// A `[n_out, n_in]` matrix of `n_in / 32` blocks per row, rearranged at load into groups
/// of [`GROUP`] rows, so a decode step reads each group as one sequential stream; a last
/// partial group is padded with zero rows.
/// - Quants (`qs`), block by block, the group's four rows together: Q4 blocks as
///   `[r0 16 B][r1][r2][r3]` (as in the file), Q8_0 blocks split in halves,
///   `[r0 values 0-15][r1][r2][r3][r0 values 16-31][r1][r2][r3]`, so one 512-bit register
///   (or two 256-bit ones) holds the same 16 values of all four rows.
/// - Scales (`dm`), a quad of blocks at a time: `d` as `[r0: b0 b1 b2 b3][r1: …][r2: …]
///   [r3: …]`, then `m` (Q4_1) the same way; the blocks of a last partial quad past the
///   row's end have zero scales. They stay f16 as the file has them (the kernels widen
///   them, exactly), but for Q4_K's sub-block scales `d · scale`, which need f32.
pub struct QMatrix {
    pub ty: QType,
    pub n_in: usize,
    pub n_out: usize,
    qs: Vec<u8>,
    dm: Scales,
}

/// Stored scales: f16 bits, or f32 where f16 cannot hold them exactly.
enum Scales {
    Half(Vec<u16>),
    Full(Vec<f32>),
}

impl Scales {
    /// `n` zero scales (in huge pages, as the quants).
    fn zeros(half: bool, n: usize) -> Scales {
        use super::matmul::huge_page_vec;
        if half { Scales::Half(huge_page_vec(n, 0)) } else { Scales::Full(huge_page_vec(n, 0.0)) }
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

/// One row of a [`QMatrix`]: its group's data and its place in the group.
#[derive(Clone, Copy)]
struct RowRef<'a> {
    ty: QType,
    qs: &'a [u8],
    dm: ScaleSlice<'a>,
    r: usize,
}

impl RowRef<'_> {
    /// Block `b`: its quants in the file's order (Q4's 16 bytes first, then zeros), its
    /// scale `d` and its offset `m` (0 but for Q4_1).
    fn block(&self, b: usize) -> ([u8; QK], f32, f32) {
        let (qb, ns) = (self.ty.quant_bytes(), self.ty.scales());
        let mut q = [0u8; QK];
        let blk = &self.qs[b * GROUP * qb..(b + 1) * GROUP * qb];
        for (h, piece) in q[..qb].chunks_exact_mut(16).enumerate() {
            piece.copy_from_slice(&blk[(h * GROUP + self.r) * 16..][..16]);
        }
        let at = |kind: usize| self.dm.get(scale_index(ns, b, kind, self.r));
        (q, at(0), if ns == 2 { at(1) } else { 0.0 })
    }
}

/// Where, in a group's scales, row `r`'s scale `kind` (0: `d`, 1: `m`) of block `b` is.
fn scale_index(ns: usize, b: usize, kind: usize, r: usize) -> usize {
    (b / LANES * ns + kind) * GROUP * LANES + r * LANES + b % LANES
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
        if n_in == 0 || !n_in.is_multiple_of(QK) {
            return Err(format!("{}: rows of {n_in} values are not whole blocks of {QK}", ty.name()));
        }
        let nb = n_in / QK;
        let row_bytes = nb * ty.block_bytes();
        if Some(bytes.len()) != row_bytes.checked_mul(n_out) {
            return Err(format!("{}: {} bytes for {n_out} rows of {row_bytes}", ty.name(), bytes.len()));
        }
        let header = ty.block_bytes() - ty.quant_bytes();
        let fill = |j: usize, b: usize, q: &mut [u8], dm: &mut [f32; 2]| {
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
        const QK_K: usize = 256;
        const BLOCK: usize = 144;
        if n_in == 0 || !n_in.is_multiple_of(QK_K) {
            return Err(format!("q4_k: rows of {n_in} values are not whole blocks of {QK_K}"));
        }
        let row_bytes = n_in / QK_K * BLOCK;
        if Some(bytes.len()) != row_bytes.checked_mul(n_out) {
            return Err(format!("q4_k: {} bytes for {n_out} rows of {row_bytes}", bytes.len()));
        }
        let fill = |j: usize, b: usize, q: &mut [u8], dm: &mut [f32; 2]| {
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
        let fill = |j: usize, b: usize, q: &mut [u8], dm: &mut [f32; 2]| {
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

    /// The group-interleaved layout ([`QMatrix`]), each block's quants (in the file's
    /// order) and `[d, m]` written by `fill(row, block, quants, scales)`; `half`: the
    /// scales are f16 values (kept as f16).
    /// `done(rows)` hears of each run of [`RELEASE_ROWS`] rows once it is written.
    fn from_blocks(
        ty: QType,
        half: bool,
        n_out: usize,
        n_in: usize,
        fill: impl Fn(usize, usize, &mut [u8], &mut [f32; 2]),
        mut done: impl FnMut(std::ops::Range<usize>),
    ) -> Self {
        let nb = n_in / QK;
        let (qb, ns) = (ty.quant_bytes(), ty.scales());
        let n_groups = n_out.div_ceil(GROUP);
        let group_scales = nb.div_ceil(LANES) * ns * GROUP * LANES;
        let mut qs = super::matmul::huge_page_vec(n_groups * nb * GROUP * qb, 0u8);
        let mut dm = Scales::zeros(half, n_groups * group_scales);
        let mut q = [0u8; QK];
        for j in 0..n_out {
            let (g, r) = (j / GROUP, j % GROUP);
            for b in 0..nb {
                let mut sc = [0f32; 2];
                fill(j, b, &mut q[..qb], &mut sc);
                let blk = &mut qs[(g * nb + b) * GROUP * qb..][..GROUP * qb];
                for (h, piece) in q[..qb].chunks_exact(16).enumerate() {
                    blk[(h * GROUP + r) * 16..][..16].copy_from_slice(piece);
                }
                for (kind, v) in sc.into_iter().take(ns).enumerate() {
                    dm.set(g * group_scales + scale_index(ns, b, kind, r), v);
                }
            }
            if (j + 1).is_multiple_of(RELEASE_ROWS) || j + 1 == n_out {
                done(j / RELEASE_ROWS * RELEASE_ROWS..j + 1);
            }
        }
        QMatrix { ty, n_in, n_out, qs, dm }
    }

    /// Bytes of weight data in memory.
    pub fn bytes(&self) -> usize {
        self.qs.len() + self.dm.bytes()
    }

    fn blocks_per_row(&self) -> usize {
        self.n_in / QK
    }

    /// Group `g`'s quants and scales.
    fn group(&self, g: usize) -> (&[u8], ScaleSlice<'_>) {
        let nb = self.blocks_per_row();
        let (qg, sg) = (nb * GROUP * self.ty.quant_bytes(), nb.div_ceil(LANES) * LANES * GROUP * self.ty.scales());
        (&self.qs[g * qg..(g + 1) * qg], self.dm.slice(g * sg..(g + 1) * sg))
    }

    fn row(&self, j: usize) -> RowRef<'_> {
        let (qs, dm) = self.group(j / GROUP);
        RowRef { ty: self.ty, qs, dm, r: j % GROUP }
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
            }
        }
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// `values` (whole rows of whole blocks) as GGUF Q8_0 blocks, with llama.cpp's rule
/// (`quantize_row_q8_0`: `d = max|x| / 127` stored as f16, `q = round(x / d)`): how types
/// without a kernel here (Q5_0, Q5_1, the k-quants) reach the Q8_0 kernel.
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
    /// The 8-bit values, within ±127 (never −128: the AVX2 Q8_0 kernel's sign trick
    /// relies on it).
    pub q: Vec<i8>,
}

/// `roundf(v) as i32` (ties away from zero) without a libm call: truncate, then step by one
/// where the remainder reaches a half (exact for |v| < 2²³; beyond, v is an integer).
#[inline(always)]
fn round_half_away(v: f32) -> i32 {
    let t = v as i32;
    let frac = v - t as f32;
    // Saturating: an infinite or huge v (a block whose scale underflows) gives i32::MAX/MIN,
    // as `roundf(v) as i32` does.
    t.saturating_add(i32::from(frac >= 0.5)).saturating_sub(i32::from(frac <= -0.5))
}

/// Quantize `rows` rows of `n` values (`n` a multiple of 32).
pub fn quantize_rows(x: &[f32], rows: usize, n: usize, out: &mut Q8Rows) {
    let nb = n / QK;
    out.blocks_per_row = nb;
    out.d.resize(rows * nb, 0.0);
    out.s.resize(rows * nb, 0.0);
    out.sum.resize(rows * nb, 0);
    out.q.resize(rows * n, 0);
    type Block<'a> = ((&'a [f32], &'a mut [i8]), ((&'a mut f32, &'a mut f32), &'a mut i32));
    let one = |((xb, qb), ((d, s), total)): Block| {
        // NaN or infinity anywhere makes the block's scale non-finite, so the outputs are
        // too and the engine's non-finite check sees it (f32::max would skip a NaN). Two
        // branch-free folds, which the compiler vectorizes.
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let finite = xb.iter().fold(true, |f, v| f & v.is_finite());
        let amax = if finite { amax } else { f32::NAN };
        let dv = amax / 127.0;
        let id = if dv != 0.0 { 1.0 / dv } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = round_half_away(v * id).clamp(-127, 127) as i8;
            sum += *q as i32;
        }
        *d = f16::from_f32(dv).to_f32();
        *s = f16::from_f32(dv * sum as f32).to_f32();
        *total = sum;
    };
    let items = x[..rows * n]
        .chunks_exact(QK)
        .zip(out.q.chunks_exact_mut(QK))
        .zip(out.d.iter_mut().zip(out.s.iter_mut()).zip(out.sum.iter_mut()));
    if rows > 4 {
        x[..rows * n]
            .par_chunks_exact(QK)
            .zip(out.q.par_chunks_exact_mut(QK))
            .zip(out.d.par_iter_mut().zip(out.s.par_iter_mut()).zip(out.sum.par_iter_mut()))
            .with_min_len(64) // tasks of 64 blocks or more, not one each
            .for_each(one);
    } else {
        items.for_each(one);
    }
}

/// Output rows per parallel task in prefill (a multiple of [`GROUP`]).
const ROWS_PER_TASK: usize = 16;

/// Activation rows per prefill kernel call: each decoded weight group meets this many.
const TOKENS: usize = 4;

/// `out[t][j] = Σ_k W[j][k] · x[t][k]` for `t < xq rows`, `j < n_out`: (T, n_out).
pub fn qmatmul(isa: Isa, w: &QMatrix, xq: &Q8Rows, t_rows: usize, out: &mut [f32]) {
    let n_out = w.n_out;
    let nb = w.blocks_per_row();
    assert_eq!(xq.blocks_per_row * QK, w.n_in, "qmatmul: activation width");
    assert!(out.len() == t_rows * n_out && xq.q.len() >= t_rows * w.n_in, "qmatmul: output or activation rows");
    assert!(xq.d.len().min(xq.s.len()).min(xq.sum.len()) >= t_rows * nb, "qmatmul: activation scales");
    // Tasks own output columns (rows of W), so a task writes the strided columns of `out`
    // for every token through a raw pointer.
    let out_ptr = OutPtr(out.as_mut_ptr());
    let n_groups = n_out.div_ceil(GROUP);
    // Group g against activation rows t..t + n, written to the output.
    let group_rows = |g: usize, t: usize, n: usize| {
        let mut sums = [[0f32; GROUP]; TOKENS];
        group_dot(isa, w, g, xq, t, n, &mut sums);
        for (i, row) in sums[..n].iter().enumerate() {
            for (r, &v) in row.iter().enumerate().take(n_out - g * GROUP) {
                // SAFETY: (t + i, 4g + r) is inside the (t_rows, n_out) output, and group g's
                // columns belong to the caller's part or task alone.
                unsafe { out_ptr.write((t + i) * n_out + g * GROUP + r, v) };
            }
        }
    };
    if t_rows == 1 {
        // Decode: contiguous runs of row groups per thread, on the spinning team. (Threads
        // taking short runs from a shared counter balanced better but read memory slower.)
        let threads = rayon::current_num_threads();
        let part = |p: usize| {
            for g in n_groups * p / threads..n_groups * (p + 1) / threads {
                group_rows(g, 0, 1);
            }
        };
        if n_groups >= threads && super::team::run(threads, &part) {
            return;
        }
    }
    let groups_per_task = ROWS_PER_TASK / GROUP;
    let n_tasks = n_groups.div_ceil(groups_per_task);
    let task = |task: usize| {
        let groups = task * groups_per_task..((task + 1) * groups_per_task).min(n_groups);
        let mut t = 0;
        while t < t_rows {
            let n = (t_rows - t).min(TOKENS);
            for g in groups.clone() {
                group_rows(g, t, n);
            }
            t += n;
        }
    };
    // On one thread, a plain loop: rayon's splitting (and, from outside its pool, a
    // hand-off and wake-up per call) cost a third of a streamed decode matrix.
    if n_tasks > 1 && (t_rows > 1 || n_out * w.n_in >= 1 << 14) && rayon::current_num_threads() > 1 {
        (0..n_tasks).into_par_iter().for_each(task);
    } else {
        (0..n_tasks).for_each(task);
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
    /// `i` is in bounds of the output and no other thread writes it.
    unsafe fn write(self, i: usize, v: f32) {
        // SAFETY: the caller's contract.
        unsafe { *self.0.add(i) = v };
    }
}

/// The four rows of group `g` against activation rows `t .. t + n` (1 ≤ n ≤ [`TOKENS`]):
/// `sums[i][r]` = row `4g + r` · activation row `t + i`.
fn group_dot(isa: Isa, w: &QMatrix, g: usize, xq: &Q8Rows, t: usize, n: usize, sums: &mut [[f32; GROUP]; TOKENS]) {
    let nb = xq.blocks_per_row;
    let n_in = nb * QK;
    assert!(nb * QK == w.n_in && (1..=TOKENS).contains(&n));
    assert!((t + n) * n_in <= xq.q.len() && (t + n) * nb <= xq.d.len().min(xq.s.len()).min(xq.sum.len()));
    let (qs, dm) = w.group(g);
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        let x = xq.q[t * n_in..].as_ptr();
        let (d, s, sum) = (xq.d[t * nb..].as_ptr(), xq.s[t * nb..].as_ptr(), xq.sum[t * nb..].as_ptr());
        let q = qs.as_ptr();
        let (sc, half) = match dm {
            ScaleSlice::Half(h) => (h.as_ptr() as *const u8, true),
            ScaleSlice::Full(f) => (f.as_ptr() as *const u8, false),
        };
        // One kernel per (type, scale width, activation rows), with VNNI where the CPU has it.
        macro_rules! pick {
            ($ty:literal, $h:literal, $n:literal) => {{
                let f = if isa.has_vnni() { x86::group_dot_vnni::<$ty, $h, $n> } else { x86::group_dot::<$ty, $h, $n> };
                f(q, sc, nb, x, d, s, sum, sums)
            }};
        }
        macro_rules! go {
            ($ty:literal, $h:literal) => {
                match n {
                    1 => pick!($ty, $h, 1),
                    2 => pick!($ty, $h, 2),
                    3 => pick!($ty, $h, 3),
                    _ => pick!($ty, $h, 4),
                }
            };
        }
        // SAFETY: an AVX2 `Isa` exists only where detection found avx2+fma+f16c, an
        // AVX-512 VNNI one only where it also found AVX-512 F/BW/VL and VNNI; the group holds
        // nb × 4 blocks of quants and whole quads of scales (`group` slices them), and the
        // asserts above keep activation rows t..t+n (nb blocks each, with their scales and
        // sums) in bounds.
        unsafe {
            match (w.ty, half) {
                (QType::Q8_0, true) => go!(0, true),
                (QType::Q4_0, true) => go!(1, true),
                (QType::Q4_1, true) => go!(2, true),
                (QType::Q4_1, false) => go!(2, false),
                (QType::Q8_0 | QType::Q4_0, false) => unreachable!("Q8_0 and Q4_0 scales are kept as f16"),
            }
        }
        return;
    }
    let _ = isa;
    for (i, row_sums) in sums[..n].iter_mut().enumerate() {
        let tr = t + i;
        let (x, blocks) = (&xq.q[tr * n_in..(tr + 1) * n_in], tr * nb..(tr + 1) * nb);
        for (r, sum) in row_sums.iter_mut().enumerate() {
            let row = RowRef { ty: w.ty, qs, dm, r };
            *sum = dot_scalar(row, x, &xq.d[blocks.clone()], &xq.s[blocks.clone()], &xq.sum[blocks.clone()]);
        }
    }
}

/// The portable block dot, in the order the module's doc gives: each block's exact integer
/// sum, then `acc[b % 4] = fma(d_w · d_x, sum, acc[b % 4])`, Q4_1's offsets in their own
/// lanes; lane `k` ends as `acc[k] + off[k]` and the row as `(t0 + t2) + (t1 + t3)`.
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
        };
        // |isum| ≤ 32 · 128 · 127 < 2²⁴: exact in f32.
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
mod x86 {
    use std::arch::x86_64::*;

    use super::{GROUP, LANES, QK, TOKENS};

    /// How far ahead of the current block the weight stream is prefetched (bytes).
    const PF: usize = 1024;

    /// A quad's four blocks' vectors of partial integer sums, per 128-bit lane (one row)
    /// `[a0..a3]`, `[b0..b3]`, `[c0..c3]`, `[d0..d3]`, are transposed and added in two
    /// steps: [`pair_add`] of blocks 0, 1 gives `[a0+a2, b0+b2, a1+a3, b1+b3]` (and of
    /// blocks 2, 3 the same for c, d), then [`quad_add`] of the two gives per lane
    /// `[Σa, Σb, Σc, Σd]`. Integer sums, so the order of the additions does not matter.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn pair_add(a: __m256i, b: __m256i) -> __m256i {
        _mm256_add_epi32(_mm256_unpacklo_epi32(a, b), _mm256_unpackhi_epi32(a, b))
    }

    /// See [`pair_add`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn quad_add(ab: __m256i, cd: __m256i) -> __m256i {
        _mm256_add_epi32(_mm256_unpacklo_epi64(ab, cd), _mm256_unpackhi_epi64(ab, cd))
    }

    /// [`pair_add`] on 512-bit registers (four rows).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn pair_add_512(a: __m512i, b: __m512i) -> __m512i {
        _mm512_add_epi32(_mm512_unpacklo_epi32(a, b), _mm512_unpackhi_epi32(a, b))
    }

    /// [`quad_add`] on 512-bit registers (four rows).
    #[inline]
    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    fn quad_add_512(ab: __m512i, cd: __m512i) -> __m512i {
        _mm512_add_epi32(_mm512_unpacklo_epi64(ab, cd), _mm512_unpackhi_epi64(ab, cd))
    }

    /// Per 128-bit lane `[t0 t1 t2 t3]` → lane 0 holds `(t0 + t2) + (t1 + t3)`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn lane_total(t: __m256) -> __m256 {
        let h = _mm256_add_ps(t, _mm256_permute_ps::<0b01_00_11_10>(t)); // [t0+t2, t1+t3, ..]
        _mm256_add_ps(h, _mm256_permute_ps::<0b10_11_00_01>(h))
    }

    /// Four activation-block values (`f32` or `i32`) at `p`, `n` of them real (the rest
    /// read as zeros, never touched), as a 128-bit vector.
    ///
    /// # Safety
    /// `p .. p + n` is readable; AVX2 is available.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quad_ps(p: *const f32, n: usize) -> __m128 {
        // SAFETY: the caller's contract; masked-off lanes are not accessed.
        unsafe {
            if n == LANES {
                _mm_loadu_ps(p)
            } else {
                _mm_maskload_ps(p, _mm_cmpgt_epi32(_mm_set1_epi32(n as i32), _mm_setr_epi32(0, 1, 2, 3)))
            }
        }
    }

    /// [`quad_ps`] for `i32` (the same 32-bit lanes, moved as they are).
    ///
    /// # Safety
    /// As [`quad_ps`].
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn quad_epi32(p: *const i32, n: usize) -> __m128i {
        // SAFETY: as above.
        _mm_castps_si128(unsafe { quad_ps(p as *const f32, n) })
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

    /// One group of four interleaved rows (quants `qs`: `nb` blocks; scales `dm`, f16 when
    /// `H`, else f32: whole quads, `nb.div_ceil(4)` of them; laid out as [`super::QMatrix`] says; type `TY`: 0 = Q8_0, 1 = Q4_0, 2 = Q4_1) against `N`
    /// consecutive activation rows (`x`: N × nb × 32 i8; `d`, `s`, `sum`: N × nb) into
    /// `out[..N]`, in the module doc's order. Each block's weights are decoded once for the
    /// N rows; two rows per 256-bit register.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are available and every pointer covers what is described above.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)] // i, k, p index several arrays
    pub(super) unsafe fn group_dot<const TY: u8, const H: bool, const N: usize>(
        qs: *const u8,
        dm: *const u8,
        nb: usize,
        x: *const i8,
        d: *const f32,
        s: *const f32,
        sum: *const i32,
        out: &mut [[f32; GROUP]; TOKENS],
    ) {
        let (qb, ns) = if TY == 0 { (32, 1) } else { (16, 1 + usize::from(TY == 2)) };
        let row_stride = nb * QK;
        let (ones, m4) = (_mm256_set1_epi16(1), _mm256_set1_epi8(0x0F));
        let zero = _mm256_setzero_ps();
        let (mut acc, mut off) = ([[zero; 2]; N], [[zero; 2]; N]);
        for quad in 0..nb.div_ceil(LANES) {
            let n = (nb - quad * LANES).min(LANES);
            // Block k of the quad against the N activation rows: per row pair p (rows 2p,
            // 2p+1), 4 partial sums a row; zeros past the row's end. (Blocks by constant
            // index, never a loop over an array: the sums stay in registers.)
            let block = |k: usize| -> [[__m256i; 2]; N] {
                let b = quad * LANES + k;
                if k >= n {
                    return [[_mm256_setzero_si256(); 2]; N];
                }
                // SAFETY: block b of the group (4 × qb bytes) and of each activation row is in
                // bounds (the caller's contract); the prefetch address is only a hint (never
                // dereferenced, computed with wrapping).
                unsafe {
                    let qp = qs.add(b * GROUP * qb);
                    _mm_prefetch::<_MM_HINT_T0>(qp.wrapping_add(PF) as *const i8);
                    // Per row pair p: the registers that meet values 0-15 and 16-31 of the
                    // activation block.
                    let w: [(__m256i, __m256i); 2] = std::array::from_fn(|p| {
                        if TY == 0 {
                            let lo = _mm256_loadu_si256(qp.add(32 * p) as *const __m256i);
                            (lo, _mm256_loadu_si256(qp.add(64 + 32 * p) as *const __m256i))
                        } else {
                            let q = _mm256_loadu_si256(qp.add(32 * p) as *const __m256i);
                            (_mm256_and_si256(q, m4), _mm256_and_si256(_mm256_srli_epi16::<4>(q), m4))
                        }
                    });
                    std::array::from_fn(|i| {
                        let xp = x.add(i * row_stride + b * QK);
                        let xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128(xp as *const __m128i));
                        let xhi = _mm256_broadcastsi128_si256(_mm_loadu_si128(xp.add(16) as *const __m128i));
                        std::array::from_fn(|p| {
                            let (a, c) = w[p];
                            if TY == 0 {
                                // |w| · (x with w's sign): maddubs wants its first operand
                                // unsigned; products summed in pairs stay within i16.
                                let lo = _mm256_maddubs_epi16(_mm256_sign_epi8(a, a), _mm256_sign_epi8(xlo, a));
                                let hi = _mm256_maddubs_epi16(_mm256_sign_epi8(c, c), _mm256_sign_epi8(xhi, c));
                                _mm256_add_epi32(_mm256_madd_epi16(lo, ones), _mm256_madd_epi16(hi, ones))
                            } else {
                                // Nibble × i8 pairs stay within ±3810, two of them within i16.
                                let p16 = _mm256_add_epi16(_mm256_maddubs_epi16(a, xlo), _mm256_maddubs_epi16(c, xhi));
                                _mm256_madd_epi16(p16, ones)
                            }
                        })
                    })
                }
            };
            let (v0, v1) = (block(0), block(1));
            let ab: [[__m256i; 2]; N] = std::array::from_fn(|i| std::array::from_fn(|p| pair_add(v0[i][p], v1[i][p])));
            let (v2, v3) = (block(2), block(3));
            let cd: [[__m256i; 2]; N] = std::array::from_fn(|i| std::array::from_fn(|p| pair_add(v2[i][p], v3[i][p])));
            // SAFETY: the group's scales hold whole quads; activation scales are read for
            // the quad's n real blocks only.
            unsafe {
                let sc = quad * ns * GROUP * LANES;
                let dw = [scales8::<H>(dm, sc), scales8::<H>(dm, sc + 8)];
                let mw = if TY == 2 { [scales8::<H>(dm, sc + 16), scales8::<H>(dm, sc + 24)] } else { [zero; 2] };
                for i in 0..N {
                    let at = i * nb + quad * LANES;
                    let dx = _mm256_broadcast_ps(&quad_ps(d.add(at), n));
                    let xsum8 = if TY == 1 {
                        _mm256_slli_epi32::<3>(_mm256_broadcastsi128_si256(quad_epi32(sum.add(at), n)))
                    } else {
                        _mm256_setzero_si256()
                    };
                    let sx = if TY == 2 { _mm256_broadcast_ps(&quad_ps(s.add(at), n)) } else { zero };
                    for p in 0..2 {
                        let mut isum = quad_add(ab[i][p], cd[i][p]);
                        if TY == 1 {
                            isum = _mm256_sub_epi32(isum, xsum8);
                        }
                        acc[i][p] = _mm256_fmadd_ps(_mm256_mul_ps(dw[p], dx), _mm256_cvtepi32_ps(isum), acc[i][p]);
                        if TY == 2 {
                            off[i][p] = _mm256_fmadd_ps(mw[p], sx, off[i][p]);
                        }
                    }
                }
            }
        }
        for i in 0..N {
            for p in 0..2 {
                let t = if TY == 2 { _mm256_add_ps(acc[i][p], off[i][p]) } else { acc[i][p] };
                let h = lane_total(t);
                out[i][2 * p] = _mm256_cvtss_f32(h);
                out[i][2 * p + 1] = _mm_cvtss_f32(_mm256_extractf128_ps::<1>(h));
            }
        }
    }

    /// [`group_dot`] on 512-bit registers with AVX-512 VNNI: one register holds the same
    /// 16 values of all four rows, and `vpdpbusd` replaces `maddubs` + `madd` (Q8_0 on
    /// weights offset to unsigned, the offset taken back with the activation block's sum).
    /// Every block's integer sums are the same exact integers, so the results are
    /// bit-identical to [`group_dot`]'s.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C are available and every pointer covers what
    /// [`group_dot`] describes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)] // i and k index several arrays
    pub(super) unsafe fn group_dot_vnni<const TY: u8, const H: bool, const N: usize>(
        qs: *const u8,
        dm: *const u8,
        nb: usize,
        x: *const i8,
        d: *const f32,
        s: *const f32,
        sum: *const i32,
        out: &mut [[f32; GROUP]; TOKENS],
    ) {
        let (qb, ns) = if TY == 0 { (32, 1) } else { (16, 1 + usize::from(TY == 2)) };
        let row_stride = nb * QK;
        let (m4, flip) = (_mm512_set1_epi8(0x0F), _mm512_set1_epi8(-128));
        let (zero, zero_i) = (_mm512_setzero_ps(), _mm512_setzero_si512());
        let (mut acc, mut off) = ([zero; N], [zero; N]);
        for quad in 0..nb.div_ceil(LANES) {
            let n = (nb - quad * LANES).min(LANES);
            // Block k of the quad against the N activation rows (as in `group_dot`).
            let block = |k: usize| -> [__m512i; N] {
                let b = quad * LANES + k;
                if k >= n {
                    return [zero_i; N];
                }
                // SAFETY: as in `group_dot`.
                unsafe {
                    let qp = qs.add(b * GROUP * qb);
                    _mm_prefetch::<_MM_HINT_T0>(qp.wrapping_add(PF) as *const i8);
                    // The registers that meet values 0-15 and 16-31 of the activation block.
                    let (a, c) = if TY == 0 {
                        // vpdpbusd multiplies unsigned by signed bytes: the weights offset by
                        // 128 (w ^ 0x80) give Σ (w + 128)·x = Σ w·x + 128·Σx.
                        (
                            _mm512_xor_si512(_mm512_loadu_si512(qp as *const _), flip),
                            _mm512_xor_si512(_mm512_loadu_si512(qp.add(64) as *const _), flip),
                        )
                    } else {
                        let q = _mm512_loadu_si512(qp as *const _);
                        (_mm512_and_si512(q, m4), _mm512_and_si512(_mm512_srli_epi16::<4>(q), m4))
                    };
                    std::array::from_fn(|i| {
                        let xp = x.add(i * row_stride + b * QK);
                        let xlo = _mm512_broadcast_i32x4(_mm_loadu_si128(xp as *const __m128i));
                        let xhi = _mm512_broadcast_i32x4(_mm_loadu_si128(xp.add(16) as *const __m128i));
                        _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(zero_i, a, xlo), c, xhi)
                    })
                }
            };
            let (v0, v1) = (block(0), block(1));
            let ab: [__m512i; N] = std::array::from_fn(|i| pair_add_512(v0[i], v1[i]));
            let (v2, v3) = (block(2), block(3));
            let cd: [__m512i; N] = std::array::from_fn(|i| pair_add_512(v2[i], v3[i]));
            // SAFETY: as in `group_dot`; the masked loads touch the quad's n real blocks only.
            unsafe {
                let mask: __mmask8 = (1u8 << n) - 1;
                let sc = quad * ns * GROUP * LANES;
                let dw = scales16::<H>(dm, sc);
                let mw = if TY == 2 { scales16::<H>(dm, sc + 16) } else { zero };
                for i in 0..N {
                    let at = i * nb + quad * LANES;
                    let dx = _mm512_broadcast_f32x4(_mm_maskz_loadu_ps(mask, d.add(at)));
                    let mut isum = quad_add_512(ab[i], cd[i]);
                    if TY != 2 {
                        // Q8_0: less 128·Σx (the offset); Q4_0: less 8·Σx (nibbles − 8).
                        let xsum = _mm512_broadcast_i32x4(_mm_maskz_loadu_epi32(mask, sum.add(at)));
                        let shifted = if TY == 0 { _mm512_slli_epi32::<7>(xsum) } else { _mm512_slli_epi32::<3>(xsum) };
                        isum = _mm512_sub_epi32(isum, shifted);
                    }
                    acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(isum), acc[i]);
                    if TY == 2 {
                        let sx = _mm512_broadcast_f32x4(_mm_maskz_loadu_ps(mask, s.add(at)));
                        off[i] = _mm512_fmadd_ps(mw, sx, off[i]);
                    }
                }
            }
        }
        let firsts = _mm512_setr_epi32(0, 4, 8, 12, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0);
        for i in 0..N {
            let t = if TY == 2 { _mm512_add_ps(acc[i], off[i]) } else { acc[i] };
            let h = _mm512_add_ps(t, _mm512_permute_ps::<0b01_00_11_10>(t));
            let h = _mm512_add_ps(h, _mm512_permute_ps::<0b10_11_00_01>(h));
            let rows = _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, h));
            // SAFETY: out[i] is 4 f32s.
            unsafe { _mm_storeu_ps(out[i].as_mut_ptr(), rows) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::round_half_away;

    /// A block so small that 1/d overflows quantizes to zeros (no overflow, no panic).
    #[test]
    fn underflowing_blocks_quantize_to_zero() {
        let mut q8 = super::Q8Rows::default();
        let x = [1e-38f32; 32];
        super::quantize_rows(&x, 1, 32, &mut q8);
        assert_eq!((q8.d[0], q8.s[0]), (0.0, 0.0));
    }

    /// Equal to `roundf` on ties, their neighbours and a sweep of the activation range.
    #[test]
    fn round_half_away_is_roundf() {
        let mut vs = vec![0.5f32, -0.5, 1.5, -1.5, 2.5, 126.5, -126.5, 127.0, -127.0, 0.0, -0.0, 1e-30];
        for k in -130..=130 {
            let t = k as f32 + 0.5;
            vs.extend([t, f32::from_bits(t.to_bits() + 1), f32::from_bits(t.to_bits() - 1)]);
        }
        vs.extend((0..100_000).map(|i| (i as f32 * 0.002_531) - 127.0));
        for v in vs {
            assert_eq!(round_half_away(v), v.round() as i32, "{v}");
        }
        for v in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 3e9, -3e9, f32::MAX, f32::MIN, 8388609.0] {
            assert_eq!(round_half_away(v), v.round() as i32, "{v}");
        }
    }
}

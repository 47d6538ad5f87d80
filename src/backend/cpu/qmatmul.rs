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
//! Kernels: AVX2 (`maddubs`/`madd` on 32 bytes per block, four activation rows per weight
//! load in prefill) and a portable scalar path with the same integer arithmetic.

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

    /// f32 scales per block: `d`, and `m` for Q4_1.
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

/// A `[n_out, n_in]` matrix of `n_in / 32` blocks per row, rearranged at load: each
/// block's quants (`qs`, as in the file) apart from its scales widened to f32 (`dm`: `d`,
/// and `m` for Q4_1; f16 → f32 is exact), and the rows interleaved in groups of
/// [`GROUP`] block by block (`[group][block][row][…]`), so a decode step reads each group
/// as one sequential stream. A last partial group is padded with zero rows.
pub struct QMatrix {
    pub ty: QType,
    pub n_in: usize,
    pub n_out: usize,
    qs: Vec<u8>,
    dm: Vec<f32>,
}

/// One row of a [`QMatrix`]: its group's data and its place in the group.
#[derive(Clone, Copy)]
struct RowRef<'a> {
    ty: QType,
    qs: &'a [u8],
    dm: &'a [f32],
    r: usize,
}

impl<'a> RowRef<'a> {
    /// Block `b`: its quants and its scales.
    fn block(&self, b: usize) -> (&'a [u8], &'a [f32]) {
        let (qb, ns) = (self.ty.quant_bytes(), self.ty.scales());
        let i = b * GROUP + self.r;
        (&self.qs[i * qb..(i + 1) * qb], &self.dm[i * ns..(i + 1) * ns])
    }
}

impl QMatrix {
    /// `bytes` holds `n_out` rows of `n_in / 32` blocks of `ty`, as GGUF stores them.
    pub fn new(ty: QType, n_out: usize, n_in: usize, bytes: &[u8]) -> Result<Self, String> {
        if n_in == 0 || !n_in.is_multiple_of(QK) {
            return Err(format!("{}: rows of {n_in} values are not whole blocks of {QK}", ty.name()));
        }
        let nb = n_in / QK;
        let row_bytes = nb * ty.block_bytes();
        if Some(bytes.len()) != row_bytes.checked_mul(n_out) {
            return Err(format!("{}: {} bytes for {n_out} rows of {row_bytes}", ty.name(), bytes.len()));
        }
        let header = ty.block_bytes() - ty.quant_bytes();
        Ok(Self::from_blocks(ty, n_out, n_in, |j, b, q, dm| {
            let blk = &bytes[j * row_bytes + b * ty.block_bytes()..][..ty.block_bytes()];
            q.copy_from_slice(&blk[header..]);
            for (i, v) in dm.iter_mut().enumerate() {
                *v = f16_at(blk, 2 * i);
            }
        }))
    }

    /// GGUF Q4_K blocks held as Q4_1 blocks with f32 scales, losslessly: each sub-block of
    /// 32 is `(d·scale)·q − dmin·min` with 4-bit `q`, i.e. Q4_1 with `d' = d·scale` and
    /// `m' = −(dmin·min)` (exact f32 products of an f16 and a 6-bit integer), its nibbles
    /// repacked from Q4_K's sub-block pairs to Q4_1's halves. So Q4_K runs on the Q4_1
    /// kernel at 6 bits a weight (not re-quantized to Q8_0 at 9), and decodes bit-exactly.
    pub fn from_q4_k(n_out: usize, n_in: usize, bytes: &[u8]) -> Result<Self, String> {
        const QK_K: usize = 256;
        const BLOCK: usize = 144;
        if n_in == 0 || !n_in.is_multiple_of(QK_K) {
            return Err(format!("q4_k: rows of {n_in} values are not whole blocks of {QK_K}"));
        }
        let row_bytes = n_in / QK_K * BLOCK;
        if Some(bytes.len()) != row_bytes.checked_mul(n_out) {
            return Err(format!("q4_k: {} bytes for {n_out} rows of {row_bytes}", bytes.len()));
        }
        Ok(Self::from_blocks(QType::Q4_1, n_out, n_in, |j, b, q, dm| {
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
        }))
    }

    /// The group-interleaved layout, each block's quants and scales written by
    /// `fill(row, block, quants, scales)`.
    fn from_blocks(ty: QType, n_out: usize, n_in: usize, fill: impl Fn(usize, usize, &mut [u8], &mut [f32])) -> Self {
        let nb = n_in / QK;
        let (qb, ns) = (ty.quant_bytes(), ty.scales());
        let n_slots = n_out.div_ceil(GROUP) * GROUP * nb;
        let mut qs = super::matmul::huge_page_vec(n_slots * qb, 0u8);
        let mut dm = super::matmul::huge_page_vec(n_slots * ns, 0f32);
        for j in 0..n_out {
            let (g, r) = (j / GROUP, j % GROUP);
            for b in 0..nb {
                let slot = (g * nb + b) * GROUP + r;
                fill(j, b, &mut qs[slot * qb..(slot + 1) * qb], &mut dm[slot * ns..(slot + 1) * ns]);
            }
        }
        QMatrix { ty, n_in, n_out, qs, dm }
    }

    /// Bytes of weight data in memory.
    pub fn bytes(&self) -> usize {
        self.qs.len() + 4 * self.dm.len()
    }

    fn blocks_per_row(&self) -> usize {
        self.n_in / QK
    }

    /// Group `g`'s quants and scales.
    fn group(&self, g: usize) -> (&[u8], &[f32]) {
        let nb = self.blocks_per_row();
        let (qg, sg) = (nb * GROUP * self.ty.quant_bytes(), nb * GROUP * self.ty.scales());
        (&self.qs[g * qg..(g + 1) * qg], &self.dm[g * sg..(g + 1) * sg])
    }

    fn row(&self, j: usize) -> RowRef<'_> {
        let (qs, dm) = self.group(j / GROUP);
        RowRef { ty: self.ty, qs, dm, r: j % GROUP }
    }

    /// Row `j` decoded to f32 (an embedding lookup), exactly as `quant::dequantize`.
    pub fn dequantize_row(&self, j: usize, out: &mut [f32]) {
        let row = self.row(j);
        for (b, vals) in out.chunks_exact_mut(QK).enumerate() {
            let (q, sc) = row.block(b);
            let d = sc[0];
            match self.ty {
                QType::Q8_0 => {
                    for (v, &q) in vals.iter_mut().zip(q) {
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
                    let m = sc[1];
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
    out.q.resize(rows * n, 0);
    type Block<'a> = ((&'a [f32], &'a mut [i8]), (&'a mut f32, &'a mut f32));
    let one = |((xb, qb), (d, s)): Block| {
        // NaN or infinity anywhere makes the block's scale non-finite, so the outputs are
        // too and the engine's non-finite check sees it (f32::max would skip a NaN).
        let amax = xb.iter().fold(0.0f32, |m, v| if v.is_finite() && !m.is_nan() { m.max(v.abs()) } else { f32::NAN });
        let dv = amax / 127.0;
        let id = if dv != 0.0 { 1.0 / dv } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in qb.iter_mut().zip(xb) {
            *q = round_half_away(v * id).clamp(-127, 127) as i8;
            sum += *q as i32;
        }
        *d = f16::from_f32(dv).to_f32();
        *s = f16::from_f32(dv * sum as f32).to_f32();
    };
    let items =
        x[..rows * n].chunks_exact(QK).zip(out.q.chunks_exact_mut(QK)).zip(out.d.iter_mut().zip(out.s.iter_mut()));
    if rows > 4 {
        x[..rows * n]
            .par_chunks_exact(QK)
            .zip(out.q.par_chunks_exact_mut(QK))
            .zip(out.d.par_iter_mut().zip(out.s.par_iter_mut()))
            .for_each(one);
    } else {
        items.for_each(one);
    }
}

/// Output rows per parallel task (a multiple of [`GROUP`]).
const ROWS_PER_TASK: usize = 16;

/// `out[t][j] = Σ_k W[j][k] · x[t][k]` for `t < xq rows`, `j < n_out`: (T, n_out).
pub fn qmatmul(isa: Isa, w: &QMatrix, xq: &Q8Rows, t_rows: usize, out: &mut [f32]) {
    let n_out = w.n_out;
    assert_eq!(xq.blocks_per_row * QK, w.n_in, "qmatmul: activation width");
    assert!(out.len() == t_rows * n_out && xq.q.len() >= t_rows * w.n_in, "qmatmul: output or activation rows");
    // Tasks own output columns (rows of W), so a task writes the strided columns of `out`
    // for every token through a raw pointer.
    let out_ptr = OutPtr(out.as_mut_ptr());
    if t_rows == 1 {
        // Decode: contiguous runs of row groups per thread, on the spinning team.
        let n_groups = n_out.div_ceil(GROUP);
        let threads = rayon::current_num_threads();
        let part = |p: usize| {
            let mut sums = [0f32; 4];
            for g in n_groups * p / threads..n_groups * (p + 1) / threads {
                gemv4(isa, w, g, xq, &mut sums);
                for (i, &v) in sums.iter().enumerate().take(n_out - g * GROUP) {
                    // SAFETY: (0, 4g + i) is inside the output; group g belongs to part p alone.
                    unsafe { out_ptr.write(g * GROUP + i, v) };
                }
            }
        };
        if n_groups >= threads && super::team::run(threads, &part) {
            return;
        }
    }
    let n_tasks = n_out.div_ceil(ROWS_PER_TASK);
    let task = |task: usize| {
        let j0 = task * ROWS_PER_TASK;
        let j1 = (j0 + ROWS_PER_TASK).min(n_out);
        let mut sums = [0f32; 4];
        if t_rows == 1 {
            // Whole groups (ROWS_PER_TASK is a multiple of GROUP); padded rows are dropped.
            for g in j0 / GROUP..j1.div_ceil(GROUP) {
                gemv4(isa, w, g, xq, &mut sums);
                for (i, &v) in sums.iter().enumerate().take(n_out - g * GROUP) {
                    // SAFETY: (0, 4g + i) is inside the output and belongs to this task.
                    unsafe { out_ptr.write(g * GROUP + i, v) };
                }
            }
            return;
        }
        for j in j0..j1 {
            let row = w.row(j);
            let mut t = 0;
            while t < t_rows {
                let n = (t_rows - t).min(4);
                dot_rows(isa, row, xq, t, n, &mut sums);
                for (i, &v) in sums[..n].iter().enumerate() {
                    // SAFETY: (t + i, j) is inside the (t_rows, n_out) output, and column j
                    // belongs to this task alone.
                    unsafe { out_ptr.write((t + i) * n_out + j, v) };
                }
                t += n;
            }
        }
    };
    if n_tasks > 1 && (t_rows > 1 || n_out * w.n_in >= 1 << 14) {
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

/// The four rows of group `g` against activation row 0 into `sums`.
fn gemv4(isa: Isa, w: &QMatrix, g: usize, xq: &Q8Rows, sums: &mut [f32; 4]) {
    let nb = xq.blocks_per_row;
    assert!(nb * QK == w.n_in && xq.q.len() >= w.n_in && xq.d.len().min(xq.s.len()) >= nb);
    let (qs, dm) = w.group(g);
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        let (x, d, s) = (xq.q.as_ptr(), xq.d.as_ptr(), xq.s.as_ptr());
        let (q, sc) = (qs.as_ptr(), dm.as_ptr());
        // SAFETY: AVX2 detected (an AVX2 `Isa`); the group holds nb × 4 blocks (`group`
        // slices them) and the activation row nb blocks (asserted above).
        unsafe {
            match w.ty {
                QType::Q8_0 => x86::gemv4::<0>(q, sc, nb, x, d, s, sums),
                QType::Q4_0 => x86::gemv4::<1>(q, sc, nb, x, d, s, sums),
                QType::Q4_1 => x86::gemv4::<2>(q, sc, nb, x, d, s, sums),
            }
        }
        return;
    }
    let _ = isa;
    for (r, sum) in sums.iter_mut().enumerate() {
        let row = RowRef { ty: w.ty, qs, dm, r };
        *sum = dot_scalar(row, &xq.q[..w.n_in], &xq.d[..nb], &xq.s[..nb]);
    }
}

/// Dot products of one weight row with activation rows `t .. t + n` (n ≤ 4) into `sums`.
fn dot_rows(isa: Isa, row: RowRef, xq: &Q8Rows, t: usize, n: usize, sums: &mut [f32; 4]) {
    let nb = xq.blocks_per_row;
    let n_in = nb * QK;
    let ty = row.ty;
    assert!((1..=4).contains(&n) && (t + n) * n_in <= xq.q.len() && (t + n) * nb <= xq.d.len().min(xq.s.len()));
    assert!(row.qs.len() >= nb * GROUP * ty.quant_bytes() && row.dm.len() >= nb * GROUP * ty.scales());
    #[cfg(target_arch = "x86_64")]
    if isa.is_avx2() {
        let x = xq.q[t * n_in..].as_ptr();
        let (d, s) = (xq.d[t * nb..].as_ptr(), xq.s[t * nb..].as_ptr());
        // Pointers from the whole group (not block 0's slice), so reading every GROUP-th
        // block stays inside the borrow they come from.
        let (q, dm) = (row.qs[row.r * ty.quant_bytes()..].as_ptr(), row.dm[row.r * ty.scales()..].as_ptr());
        // SAFETY: an AVX2 `Isa` exists only where detection found avx2+fma+f16c; the
        // asserts above keep every block of the row (stride GROUP blocks from block 0)
        // and of activation rows t..t+n in bounds.
        unsafe {
            match (ty, n) {
                (QType::Q8_0, 1) => x86::dot_n::<0, 1>(q, dm, nb, x, d, s, sums),
                (QType::Q8_0, 2) => x86::dot_n::<0, 2>(q, dm, nb, x, d, s, sums),
                (QType::Q8_0, 3) => x86::dot_n::<0, 3>(q, dm, nb, x, d, s, sums),
                (QType::Q8_0, _) => x86::dot_n::<0, 4>(q, dm, nb, x, d, s, sums),
                (QType::Q4_0, 1) => x86::dot_n::<1, 1>(q, dm, nb, x, d, s, sums),
                (QType::Q4_0, 2) => x86::dot_n::<1, 2>(q, dm, nb, x, d, s, sums),
                (QType::Q4_0, 3) => x86::dot_n::<1, 3>(q, dm, nb, x, d, s, sums),
                (QType::Q4_0, _) => x86::dot_n::<1, 4>(q, dm, nb, x, d, s, sums),
                (QType::Q4_1, 1) => x86::dot_n::<2, 1>(q, dm, nb, x, d, s, sums),
                (QType::Q4_1, 2) => x86::dot_n::<2, 2>(q, dm, nb, x, d, s, sums),
                (QType::Q4_1, 3) => x86::dot_n::<2, 3>(q, dm, nb, x, d, s, sums),
                (QType::Q4_1, _) => x86::dot_n::<2, 4>(q, dm, nb, x, d, s, sums),
            }
        }
        return;
    }
    let _ = isa;
    for (i, sum) in sums[..n].iter_mut().enumerate() {
        let r = t + i;
        *sum =
            dot_scalar(row, &xq.q[r * n_in..(r + 1) * n_in], &xq.d[r * nb..(r + 1) * nb], &xq.s[r * nb..(r + 1) * nb]);
    }
}

/// The portable block dot: integer sums per block, f32 accumulation.
fn dot_scalar(row: RowRef, x: &[i8], d: &[f32], s: &[f32]) -> f32 {
    let mut acc = 0f32;
    for (b, ((xb, &dx), &sx)) in x.chunks_exact(QK).zip(d).zip(s).enumerate() {
        let (q, sc) = row.block(b);
        let dw = sc[0];
        acc += match row.ty {
            QType::Q8_0 => {
                let isum: i32 = q.iter().zip(xb).map(|(&w, &v)| (w as i8) as i32 * v as i32).sum();
                dw * dx * isum as f32
            }
            QType::Q4_0 => {
                let mut isum = 0i32;
                for i in 0..16 {
                    isum += ((q[i] & 0x0F) as i32 - 8) * xb[i] as i32;
                    isum += ((q[i] >> 4) as i32 - 8) * xb[i + 16] as i32;
                }
                dw * dx * isum as f32
            }
            QType::Q4_1 => {
                let mut isum = 0i32;
                for i in 0..16 {
                    isum += (q[i] & 0x0F) as i32 * xb[i] as i32;
                    isum += (q[i] >> 4) as i32 * xb[i + 16] as i32;
                }
                dw * dx * isum as f32 + sc[1] * sx
            }
        };
    }
    acc
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{GROUP, QK, QType};

    /// How far past the current four rows `gemv4` prefetches (bytes).
    const PF: usize = 1024;

    /// The 32 weights of a block as bytes, from its quants `q`: i8 for Q8_0 and Q4_0
    /// (nibble − 8), u8 nibbles for Q4_1.
    /// # Safety
    /// AVX2 is available and `q` points at a whole block's quants.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn weights(ty: QType, q: *const u8) -> __m256i {
        // SAFETY: the caller's contract.
        unsafe {
            match ty {
                QType::Q8_0 => _mm256_loadu_si256(q as *const __m256i),
                QType::Q4_0 | QType::Q4_1 => {
                    let qs = _mm_loadu_si128(q as *const __m128i);
                    let m4 = _mm_set1_epi8(0x0F);
                    let lo = _mm_and_si128(qs, m4);
                    let hi = _mm_and_si128(_mm_srli_epi16::<4>(qs), m4);
                    let w = _mm256_set_m128i(hi, lo);
                    if ty == QType::Q4_0 { _mm256_sub_epi8(w, _mm256_set1_epi8(8)) } else { w }
                }
            }
        }
    }

    /// Σ w·x over 32 bytes as 8 i32 lanes; `signed`: w is i8 (else u8).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn idot(w: __m256i, aw: __m256i, x: __m256i, signed: bool) -> __m256i {
        let p16 = if signed {
            // |w| · (x with w's sign): maddubs wants its first operand unsigned.
            _mm256_maddubs_epi16(aw, _mm256_sign_epi8(x, w))
        } else {
            _mm256_maddubs_epi16(w, x)
        };
        _mm256_madd_epi16(p16, _mm256_set1_epi16(1))
    }

    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// One group of four interleaved rows (quants `qs`, scales `dm`, `nb` blocks each,
    /// `[block][row]`) against one activation row: four independent accumulator chains,
    /// one sequential weight stream, one activation load per block.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are available; `qs`/`dm` cover `nb × 4` blocks, `x` nb × 32
    /// values, `d` and `s` nb values.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn gemv4<const TY: u8>(
        qs: *const u8,
        dm: *const f32,
        nb: usize,
        x: *const i8,
        d: *const f32,
        s: *const f32,
        out: &mut [f32; 4],
    ) {
        let ty = kind(TY);
        let (qb, ns) = (ty.quant_bytes(), ty.scales());
        let signed = TY != 2;
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut offs = [0f32; 4];
        for b in 0..nb {
            // SAFETY: block b of the group and of the activation row is in bounds; the
            // prefetch address is only a hint (never dereferenced, computed with wrapping).
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(qs.wrapping_add((b * 4) * qb + PF) as *const i8);
                let xv = _mm256_loadu_si256(x.add(b * QK) as *const __m256i);
                let dx = _mm256_set1_ps(*d.add(b));
                let sx = *s.add(b);
                for r in 0..4 {
                    let w = weights(ty, qs.add((b * 4 + r) * qb));
                    let aw = if signed { _mm256_sign_epi8(w, w) } else { w };
                    let p = _mm256_cvtepi32_ps(idot(w, aw, xv, signed));
                    let sc = dm.add((b * 4 + r) * ns);
                    acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_broadcast_ss(&*sc), dx), p, acc[r]);
                    if TY == 2 {
                        offs[r] = (*sc.add(1)).mul_add(sx, offs[r]);
                    }
                }
            }
        }
        for r in 0..4 {
            out[r] = hsum(acc[r]) + offs[r];
        }
    }

    fn kind(ty: u8) -> QType {
        match ty {
            0 => QType::Q8_0,
            1 => QType::Q4_0,
            _ => QType::Q4_1,
        }
    }

    /// Dot products of one weight row (block 0's quants `qs` and scales `dm`, then every
    /// [`super::GROUP`]-th block: the row's `nb` blocks of type `TY`: 0 = Q8_0, 1 = Q4_0,
    /// 2 = Q4_1) with `N` consecutive activation rows (`x`: N × nb × 32 i8; `d`, `s`:
    /// N × nb scales) into `sums[..N]`.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are available and every pointer covers what is described above.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dot_n<const TY: u8, const N: usize>(
        qs: *const u8,
        dm: *const f32,
        nb: usize,
        x: *const i8,
        d: *const f32,
        s: *const f32,
        sums: &mut [f32; 4],
    ) {
        let ty = kind(TY);
        let (qb, ns) = (ty.quant_bytes(), ty.scales());
        let signed = TY != 2;
        let mut acc = [_mm256_setzero_ps(); N];
        let mut offs = [0f32; N];
        let row_stride = nb * QK;
        for b in 0..nb {
            // SAFETY: block b of the weight row and of each activation row is in bounds
            // (the caller's contract).
            unsafe {
                let w = weights(ty, qs.add(b * GROUP * qb));
                let aw = if signed { _mm256_sign_epi8(w, w) } else { w };
                let dw = _mm256_broadcast_ss(&*dm.add(b * GROUP * ns));
                for i in 0..N {
                    let xv = _mm256_loadu_si256(x.add(i * row_stride + b * QK) as *const __m256i);
                    let p = _mm256_cvtepi32_ps(idot(w, aw, xv, signed));
                    let scale = _mm256_mul_ps(dw, _mm256_set1_ps(*d.add(i * nb + b)));
                    acc[i] = _mm256_fmadd_ps(scale, p, acc[i]);
                    if TY == 2 {
                        offs[i] = (*dm.add(b * GROUP * ns + 1)).mul_add(*s.add(i * nb + b), offs[i]);
                    }
                }
            }
        }
        for i in 0..N {
            sums[i] = hsum(acc[i]) + offs[i];
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

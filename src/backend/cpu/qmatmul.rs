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
//! **One order of arithmetic everywhere.** Each output is, block by block in order,
//! `acc = fma(d_w · d_x, Σ w·q, acc)` with the block's integer sum complete first (Q4_0's
//! `Σ (n − 8)·q` as `Σ n·q − 8·Σq`), plus for Q4_1 `off = fma(m_w, s_x, off)`, and finally
//! `acc + off`. The AVX2 kernels and the portable path follow it exactly, so they agree bit
//! for bit, and a row's result never depends on how many rows are multiplied with it
//! (decode and prefill, alone or batched: the server's batch invariance).
//!
//! Kernels: AVX2 over a group of four interleaved weight rows at a time: Q4 nibbles of two
//! rows in one register (`maddubs` on 16 + 16 bytes), Q8_0 with `sign`/`maddubs` (with
//! VNNI: `vpdpbusd` on the weights offset by 128, less 128 · the activation block's sum), the four
//! rows' integer sums gathered by `hadd` into one 4-lane vector, scaled by one FMA per
//! block; in prefill each decoded weight group meets four activation rows.

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
    /// Block `b`: its quants, its scale `d` and its offset `m` (0 but for Q4_1).
    fn block(&self, b: usize) -> (&'a [u8], f32, f32) {
        let (qb, ns) = (self.ty.quant_bytes(), self.ty.scales());
        let i = b * GROUP + self.r;
        let m = if ns == 2 { self.dm[b * GROUP * ns + GROUP + self.r] } else { 0.0 };
        (&self.qs[i * qb..(i + 1) * qb], self.dm[b * GROUP * ns + self.r], m)
    }
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
        Ok(Self::from_blocks(ty, n_out, n_in, fill, |rows| done(&bytes[rows.start * row_bytes..rows.end * row_bytes])))
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
        Ok(Self::from_blocks(QType::Q4_1, n_out, n_in, fill, |rows| {
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
        Ok(Self::from_blocks(QType::Q8_0, n_out, n_in, fill, done))
    }

    /// The group-interleaved layout, each block's quants and `[d, m]` written by
    /// `fill(row, block, quants, scales)`. Per block of a group the quants of its four rows
    /// follow each other, then their scales: `d0 d1 d2 d3` (and `m0 m1 m2 m3` for Q4_1).
    /// `done(rows)` hears of each run of [`RELEASE_ROWS`] rows once it is written.
    fn from_blocks(
        ty: QType,
        n_out: usize,
        n_in: usize,
        fill: impl Fn(usize, usize, &mut [u8], &mut [f32; 2]),
        mut done: impl FnMut(std::ops::Range<usize>),
    ) -> Self {
        let nb = n_in / QK;
        let (qb, ns) = (ty.quant_bytes(), ty.scales());
        let n_slots = n_out.div_ceil(GROUP) * GROUP * nb;
        let mut qs = super::matmul::huge_page_vec(n_slots * qb, 0u8);
        let mut dm = super::matmul::huge_page_vec(n_slots * ns, 0f32);
        for j in 0..n_out {
            let (g, r) = (j / GROUP, j % GROUP);
            for b in 0..nb {
                let gb = g * nb + b;
                let slot = gb * GROUP + r;
                let mut sc = [0f32; 2];
                fill(j, b, &mut qs[slot * qb..(slot + 1) * qb], &mut sc);
                for (k, v) in sc.into_iter().take(ns).enumerate() {
                    dm[gb * GROUP * ns + k * GROUP + r] = v;
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
            let (q, d, m) = row.block(b);
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
    /// Per block: `Σq`, exact, for Q4_0's `Σ (n − 8)·q = Σ n·q − 8·Σq`.
    pub sum: Vec<i32>,
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
        // Decode: contiguous runs of row groups per thread, on the spinning team.
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
        let (q, sc) = (qs.as_ptr(), dm.as_ptr());
        // One kernel per (type, activation rows), with VNNI where the CPU has it.
        macro_rules! pick {
            ($ty:literal, $n:literal) => {{
                let f = if isa.has_vnni() { x86::group_dot_vnni::<$ty, $n> } else { x86::group_dot::<$ty, $n> };
                f(q, sc, nb, x, d, s, sum, sums)
            }};
        }
        macro_rules! go {
            ($ty:literal) => {
                match n {
                    1 => pick!($ty, 1),
                    2 => pick!($ty, 2),
                    3 => pick!($ty, 3),
                    _ => pick!($ty, 4),
                }
            };
        }
        // SAFETY: an AVX2 `Isa` exists only where detection found avx2+fma+f16c, an
        // AVX-512 VNNI one only where it also found AVX-512 F/BW/VL and VNNI; the group holds
        // nb × 4 blocks (`group` slices them) and the asserts above keep activation rows
        // t..t+n (nb blocks each, with their scales and sums) in bounds.
        unsafe {
            match w.ty {
                QType::Q8_0 => go!(0),
                QType::Q4_0 => go!(1),
                QType::Q4_1 => go!(2),
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
/// sum, then `acc = fma(d_w · d_x, sum, acc)`; Q4_1's offsets apart, added last.
fn dot_scalar(row: RowRef, x: &[i8], d: &[f32], s: &[f32], sums: &[i32]) -> f32 {
    let (mut acc, mut off) = (0f32, 0f32);
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
        // |isum| ≤ 32 · 127 · 127 < 2²⁴: exact in f32.
        acc = (dw * dx).mul_add(isum as f32, acc);
        if row.ty == QType::Q4_1 {
            off = m.mul_add(sx, off);
        }
    }
    acc + off
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{GROUP, QK, TOKENS};

    /// How far ahead of the current block the weight stream is prefetched (bytes).
    const PF: usize = 1024;

    /// The four rows' integer sums from Q4 pair vectors (`[row a × 4 | row b × 4]` i32 lanes
    /// each): `[r0, r1, r2, r3]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn gather_pairs(i01: __m256i, i23: __m256i) -> __m128i {
        // [r0 r0 r2 r2 | r1 r1 r3 r3], then [r0 r2 r0 r2 | r1 r3 r1 r3].
        let h = _mm256_hadd_epi32(i01, i23);
        let h = _mm256_hadd_epi32(h, h);
        _mm_unpacklo_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h))
    }

    /// The four rows' integer sums from per-row vectors of 8 i32 lanes: `[r0, r1, r2, r3]`.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    fn gather_rows(i: [__m256i; 4]) -> __m128i {
        // Low half [r0 r1 r2 r3] over lanes 0-3, high half over lanes 4-7.
        let h = _mm256_hadd_epi32(_mm256_hadd_epi32(i[0], i[1]), _mm256_hadd_epi32(i[2], i[3]));
        _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256::<1>(h))
    }

    /// One group of four interleaved rows (quants `qs`, scales `dm`, `nb` blocks, laid out
    /// as [`super::QMatrix`] says; type `TY`: 0 = Q8_0, 1 = Q4_0, 2 = Q4_1) against `N`
    /// consecutive activation rows (`x`: N × nb × 32 i8; `d`, `s`, `sum`: N × nb) into
    /// `out[..N]`. Each block's weights are decoded once for the N rows.
    ///
    /// # Safety
    /// AVX2, FMA and F16C are available and every pointer covers what is described above.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn group_dot<const TY: u8, const N: usize>(
        qs: *const u8,
        dm: *const f32,
        nb: usize,
        x: *const i8,
        d: *const f32,
        s: *const f32,
        sum: *const i32,
        out: &mut [[f32; GROUP]; TOKENS],
    ) {
        // SAFETY: forwarded from the caller.
        unsafe { group_dot_impl::<TY, N, false>(qs, dm, nb, x, d, s, sum, out) }
    }

    /// [`group_dot`] with AVX-512 VNNI's `vpdpbusd` (on 256-bit registers) in place of
    /// `maddubs` + `madd` (for Q8_0 on weights offset to unsigned, the offset taken back
    /// with the activations' block sum): every block's integer sum is the same exact
    /// integer, so the results are bit-identical to the AVX2 kernel's.
    ///
    /// # Safety
    /// AVX-512 F/BW/VL/VNNI, AVX2, FMA and F16C are available and every pointer covers what
    /// [`group_dot`] describes.
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn group_dot_vnni<const TY: u8, const N: usize>(
        qs: *const u8,
        dm: *const f32,
        nb: usize,
        x: *const i8,
        d: *const f32,
        s: *const f32,
        sum: *const i32,
        out: &mut [[f32; GROUP]; TOKENS],
    ) {
        // SAFETY: forwarded from the caller.
        unsafe { group_dot_impl::<TY, N, true>(qs, dm, nb, x, d, s, sum, out) }
    }

    /// The body of [`group_dot`] (`VNNI` false) and [`group_dot_vnni`] (true), inlined into
    /// each so it is compiled with its features.
    #[inline(always)]
    #[allow(clippy::too_many_arguments, clippy::needless_range_loop)] // i indexes acc, off and x
    unsafe fn group_dot_impl<const TY: u8, const N: usize, const VNNI: bool>(
        qs: *const u8,
        dm: *const f32,
        nb: usize,
        x: *const i8,
        d: *const f32,
        s: *const f32,
        sum: *const i32,
        out: &mut [[f32; GROUP]; TOKENS],
    ) {
        let (qb, ns) = if TY == 0 { (32, 1) } else { (16, 1 + usize::from(TY == 2)) };
        let row_stride = nb * QK;
        // SAFETY: register constants; the features are enabled in both callers.
        let (ones, m4) = unsafe { (_mm256_set1_epi16(1), _mm256_set1_epi8(0x0F)) };
        // SAFETY: as above.
        let (mut acc, mut off) = unsafe { ([_mm_setzero_ps(); N], [_mm_setzero_ps(); N]) };
        for b in 0..nb {
            // SAFETY: block b of the group (4 × qb bytes of quants, 4 × ns scales) and of
            // each activation row is in bounds (the caller's contract); the prefetch address
            // is only a hint (never dereferenced, computed with wrapping).
            unsafe {
                let qp = qs.add(b * GROUP * qb);
                _mm_prefetch::<_MM_HINT_T0>(qp.wrapping_add(PF) as *const i8);
                let scales = dm.add(b * GROUP * ns);
                let dw = _mm_loadu_ps(scales);
                if TY == 0 && VNNI {
                    // vpdpbusd multiplies unsigned by signed bytes without saturating: the
                    // weights offset by 128 (w ^ 0x80) give Σ (w + 128)·x = Σ w·x + 128·Σx,
                    // and Σx is the block's stored sum: the same exact integer, with no
                    // per-row sign fix-up for every activation row.
                    let flip = _mm256_set1_epi8(-128);
                    let wu: [__m256i; 4] = std::array::from_fn(|r| {
                        _mm256_xor_si256(_mm256_loadu_si256(qp.add(r * 32) as *const __m256i), flip)
                    });
                    for i in 0..N {
                        let xv = _mm256_loadu_si256(x.add(i * row_stride + b * QK) as *const __m256i);
                        let dots: [__m256i; 4] =
                            std::array::from_fn(|r| _mm256_dpbusd_epi32(_mm256_setzero_si256(), wu[r], xv));
                        let isum = _mm_sub_epi32(gather_rows(dots), _mm_set1_epi32(128 * *sum.add(i * nb + b)));
                        let scale = _mm_mul_ps(dw, _mm_set1_ps(*d.add(i * nb + b)));
                        acc[i] = _mm_fmadd_ps(scale, _mm_cvtepi32_ps(isum), acc[i]);
                    }
                } else if TY == 0 {
                    let w: [__m256i; 4] = std::array::from_fn(|r| _mm256_loadu_si256(qp.add(r * 32) as *const __m256i));
                    let aw: [__m256i; 4] = std::array::from_fn(|r| _mm256_sign_epi8(w[r], w[r]));
                    for i in 0..N {
                        let xv = _mm256_loadu_si256(x.add(i * row_stride + b * QK) as *const __m256i);
                        // |w| · (x with w's sign): maddubs wants its first operand unsigned.
                        let dots: [__m256i; 4] = std::array::from_fn(|r| {
                            let sx = _mm256_sign_epi8(xv, w[r]);
                            _mm256_madd_epi16(_mm256_maddubs_epi16(aw[r], sx), ones)
                        });
                        let isum = gather_rows(dots);
                        let scale = _mm_mul_ps(dw, _mm_set1_ps(*d.add(i * nb + b)));
                        acc[i] = _mm_fmadd_ps(scale, _mm_cvtepi32_ps(isum), acc[i]);
                    }
                } else {
                    // Two rows' 16 bytes per register: low nibbles are values 0-15 of each
                    // row, high nibbles values 16-31.
                    let v01 = _mm256_loadu_si256(qp as *const __m256i);
                    let v23 = _mm256_loadu_si256(qp.add(32) as *const __m256i);
                    let (lo01, hi01) = (_mm256_and_si256(v01, m4), _mm256_and_si256(_mm256_srli_epi16::<4>(v01), m4));
                    let (lo23, hi23) = (_mm256_and_si256(v23, m4), _mm256_and_si256(_mm256_srli_epi16::<4>(v23), m4));
                    let mw = if TY == 2 { _mm_loadu_ps(scales.add(GROUP)) } else { _mm_setzero_ps() };
                    for i in 0..N {
                        let xp = x.add(i * row_stride + b * QK);
                        let xlo = _mm256_broadcastsi128_si256(_mm_loadu_si128(xp as *const __m128i));
                        let xhi = _mm256_broadcastsi128_si256(_mm_loadu_si128(xp.add(16) as *const __m128i));
                        let (i01, i23) = if VNNI {
                            let z = _mm256_setzero_si256();
                            (
                                _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(z, lo01, xlo), hi01, xhi),
                                _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(z, lo23, xlo), hi23, xhi),
                            )
                        } else {
                            // Nibble × i8 pairs stay within ±3810, two of them within i16.
                            let p01 =
                                _mm256_add_epi16(_mm256_maddubs_epi16(lo01, xlo), _mm256_maddubs_epi16(hi01, xhi));
                            let p23 =
                                _mm256_add_epi16(_mm256_maddubs_epi16(lo23, xlo), _mm256_maddubs_epi16(hi23, xhi));
                            (_mm256_madd_epi16(p01, ones), _mm256_madd_epi16(p23, ones))
                        };
                        let mut isum = gather_pairs(i01, i23);
                        if TY == 1 {
                            isum = _mm_sub_epi32(isum, _mm_set1_epi32(8 * *sum.add(i * nb + b)));
                        }
                        let scale = _mm_mul_ps(dw, _mm_set1_ps(*d.add(i * nb + b)));
                        acc[i] = _mm_fmadd_ps(scale, _mm_cvtepi32_ps(isum), acc[i]);
                        if TY == 2 {
                            off[i] = _mm_fmadd_ps(mw, _mm_set1_ps(*s.add(i * nb + b)), off[i]);
                        }
                    }
                }
            }
        }
        for i in 0..N {
            // SAFETY: out[i] is 4 f32s.
            unsafe { _mm_storeu_ps(out[i].as_mut_ptr(), _mm_add_ps(acc[i], off[i])) };
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

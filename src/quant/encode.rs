//! The reference quantizers: f32 rows into GGUF block formats, as `llama-quantize` writes them.
//!
//! Each function follows llama.cpp's `quantize_row_*_ref` rule for its format, down to
//! the order of the f32 operations, so a file written here is byte-identical to
//! llama-quantize's for the same input (tests/quantize.rs checks every type against the
//! llama.cpp build of `scripts/build_llama_cpp.sh`). ggml compiles these rules without
//! FMA contraction, and Rust never contracts, so plain f32 arithmetic reproduces them.
//!
//! | format | rule |
//! | --- | --- |
//! | Q8_0 | `d = amax/127`, `q = round(x/d)` |
//! | Q4_0, Q5_0 | `d = max/−8` (`/−16`), where `max` is the signed value of largest magnitude |
//! | Q4_1, Q5_1 | `d = (max − min)/15` (`/31`), `m = min` |
//! | Q4_K, Q5_K | per sub-block of 32, a weighted least-squares search for scale and min over 21 (16) candidate grids; 6-bit scales and mins relative to the block's largest |
//! | Q6_K | per sub-block of 16, the best of 19 candidate grids by weighted error; 8-bit scales relative to the block's largest |
//!
//! Non-finite values are refused (llama-quantize aborts on them too, after writing).

use half::f16;

use crate::tensor::GgmlType;

/// The formats [`quantize`] writes: every format [`super::dequantize`] decodes.
pub const WRITABLE: [GgmlType; 11] = super::SUPPORTED;

/// Encode `values` (a whole number of `ty` blocks) as `ty`, appending to `out`.
pub fn quantize_into(ty: GgmlType, values: &[f32], out: &mut Vec<u8>) -> Result<(), String> {
    if !WRITABLE.contains(&ty) {
        return Err(format!("quantizing to {} is not supported", ty.name()));
    }
    let bs = ty.block_size() as usize;
    if !values.len().is_multiple_of(bs) {
        return Err(format!("{} values are not whole {} blocks of {bs}", values.len(), ty.name()));
    }
    if let Some(i) = values.iter().position(|v| !v.is_finite()) {
        return Err(format!("value {i} is {} (only finite values can be quantized)", values[i]));
    }
    out.reserve(values.len() / bs * ty.type_size() as usize);
    let blocks = values.chunks_exact(bs);
    match ty {
        GgmlType::F32 => values.iter().for_each(|v| out.extend(v.to_le_bytes())),
        GgmlType::F16 => values.iter().for_each(|&v| out.extend(f16::from_f32(v).to_bits().to_le_bytes())),
        // Round to nearest even, as ggml's fp32→bf16 does for finite values.
        GgmlType::BF16 => values.iter().for_each(|&v| out.extend(half::bf16::from_f32(v).to_bits().to_le_bytes())),
        GgmlType::Q8_0 => blocks.for_each(|x| q8_0(x, out)),
        GgmlType::Q4_0 => blocks.for_each(|x| q4_0(x, out)),
        GgmlType::Q4_1 => blocks.for_each(|x| q4_1(x, out)),
        GgmlType::Q5_0 => blocks.for_each(|x| q5_0(x, out)),
        GgmlType::Q5_1 => blocks.for_each(|x| q5_1(x, out)),
        GgmlType::Q4K => blocks.for_each(|x| q4_k(x, out)),
        GgmlType::Q5K => blocks.for_each(|x| q5_k(x, out)),
        GgmlType::Q6K => blocks.for_each(|x| q6_k(x, out)),
        other => unreachable!("{} is checked against WRITABLE above", other.name()),
    }
    Ok(())
}

/// [`quantize_into`] into a new buffer.
pub fn quantize(ty: GgmlType, values: &[f32]) -> Result<Vec<u8>, String> {
    let mut out = Vec::new();
    quantize_into(ty, values, &mut out)?;
    Ok(out)
}

fn f16_bits(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_bits().to_le_bytes()
}

/// f32 → f16 → f32: the scale a decoder will see.
fn f16_round(v: f32) -> f32 {
    f16::from_f32(v).to_f32()
}

/// Round to nearest (ties to even) by adding 1.5·2²³: llama.cpp's `nearest_int`, exact
/// for |v| < 2²².
fn nearest_int(v: f32) -> i32 {
    let bits = (v + 12_582_912.0f32).to_bits() as i32;
    (bits & 0x007F_FFFF) - 0x0040_0000
}

/// The value of largest magnitude, with its sign (the first one on ties).
fn signed_absmax(x: &[f32]) -> (f32, f32) {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    (amax, max)
}

fn min_max(x: &[f32]) -> (f32, f32) {
    x.iter().fold((f32::MAX, -f32::MAX), |(lo, hi), &v| (if v < lo { v } else { lo }, if v > hi { v } else { hi }))
}

/// One Q8_0 block: `d = max|x| / 127` (f16), `q = round(x / d)`. A non-finite value makes
/// the scale NaN, never a silent 0 ([`quantize`] refuses such values before; the cpu
/// backend's load-time re-quantization relies on the NaN).
pub fn q8_0(x: &[f32], out: &mut Vec<u8>) {
    let amax = x.iter().fold(0.0f32, |m, v| if v.is_finite() && !m.is_nan() { m.max(v.abs()) } else { f32::NAN });
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out.extend(f16_bits(d));
    out.extend(x.iter().map(|&v| ((v * id).round() as i32).clamp(-127, 127) as i8 as u8));
}

/// Low nibbles hold values 0–15, high nibbles 16–31.
fn pack_nibbles(q: &[u8; 32], out: &mut Vec<u8>) {
    out.extend((0..16).map(|j| (q[j] & 0x0F) | (q[j + 16] & 0x0F) << 4));
}

/// Bit 4 of value j goes to bit j of a little-endian u32.
fn fifth_bits(q: &[u8; 32]) -> [u8; 4] {
    let qh = q.iter().enumerate().fold(0u32, |h, (j, &v)| h | u32::from(v >> 4 & 1) << j);
    qh.to_le_bytes()
}

/// Symmetric: q = min(levels − 1, trunc(x/d + offset + ½)).
fn symmetric(x: &[f32], levels: i32) -> (f32, [u8; 32]) {
    let (_, max) = signed_absmax(x);
    let d = max / -((levels / 2) as f32);
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let offset = (levels / 2) as f32 + 0.5;
    let mut q = [0u8; 32];
    for (q, &v) in q.iter_mut().zip(x) {
        *q = ((v * id + offset) as i8).clamp(0, (levels - 1) as i8).cast_unsigned();
    }
    (d, q)
}

/// Affine: q = trunc((x − min)/d + ½), d = (max − min)/(levels − 1).
fn affine(x: &[f32], levels: i32, clamp: bool) -> (f32, f32, [u8; 32]) {
    let (min, max) = min_max(x);
    let d = (max - min) / (levels - 1) as f32;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut q = [0u8; 32];
    for (q, &v) in q.iter_mut().zip(x) {
        let t = (v - min) * id + 0.5;
        *q = if clamp { (t as i8).min((levels - 1) as i8).cast_unsigned() } else { t as u8 };
    }
    (d, min, q)
}

fn q4_0(x: &[f32], out: &mut Vec<u8>) {
    let (d, q) = symmetric(x, 16);
    out.extend(f16_bits(d));
    pack_nibbles(&q, out);
}

fn q5_0(x: &[f32], out: &mut Vec<u8>) {
    let (d, q) = symmetric(x, 32);
    out.extend(f16_bits(d));
    out.extend(fifth_bits(&q));
    pack_nibbles(&q, out);
}

fn q4_1(x: &[f32], out: &mut Vec<u8>) {
    let (d, m, q) = affine(x, 16, true);
    out.extend(f16_bits(d));
    out.extend(f16_bits(m));
    pack_nibbles(&q, out);
}

fn q5_1(x: &[f32], out: &mut Vec<u8>) {
    let (d, m, q) = affine(x, 32, false);
    out.extend(f16_bits(d));
    out.extend(f16_bits(m));
    out.extend(fifth_bits(&q));
    pack_nibbles(&q, out);
}

/// Scale and min for one sub-block, `x ≈ scale · L − min` with L in 0..=nmax: start from
/// the min/max grid, then try `nstep + 1` grids of `nmax + rmin + rdelta·i` steps over
/// the range, each refitted by weighted least squares, and keep the lowest weighted
/// squared error (llama.cpp's `make_qkx2_quants`). Returns (scale, min as a positive
/// offset).
fn fit_scale_min(x: &[f32], w: &[f32], nmax: i32, rmin: f32, rdelta: f32, nstep: i32, l: &mut [u8]) -> (f32, f32) {
    let n = x.len();
    let (mut min, mut max) = (x[0], x[0]);
    let mut sum_w = w[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        if x[i] < min {
            min = x[i];
        }
        if x[i] > max {
            max = x[i];
        }
        sum_w += w[i];
        sum_x += w[i] * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l.fill(0);
        return (0.0, -min);
    }
    let nmax_f = nmax as f32;
    let mut iscale = nmax_f / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_error = 0.0f32;
    for i in 0..n {
        l[i] = nearest_int(iscale * (x[i] - min)).clamp(0, nmax) as u8;
        let diff = scale * f32::from(l[i]) + min - x[i];
        best_error += w[i] * (diff * diff);
    }
    let mut aux = [0u8; 32];
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax_f) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let li = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            aux[i] = li as u8;
            let lf = li as f32;
            sum_l += w[i] * lf;
            sum_l2 += w[i] * lf * lf;
            sum_xl += w[i] * lf * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut cur_error = 0.0f32;
            for i in 0..n {
                let diff = this_scale * f32::from(aux[i]) + this_min - x[i];
                cur_error += w[i] * (diff * diff);
            }
            if cur_error < best_error {
                l[..n].copy_from_slice(&aux[..n]);
                best_error = cur_error;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// Q4_K and Q5_K share everything but the number of levels and the search: eight
/// sub-blocks of 32 fitted independently (weights `rms(x) + |x|`), their scales and mins
/// stored as 6-bit multiples of the block's largest (`d`, `dmin`), then every value
/// re-rounded against the stored scales. Returns (d, dmin, 12 packed scale bytes, levels).
fn k_scales_mins(x: &[f32], nmax: i32, rmin: f32, nstep: i32) -> ([u8; 2], [u8; 2], [u8; 12], [u8; 256]) {
    let mut l = [0u8; 256];
    let (mut scales, mut mins) = ([0f32; 8], [0f32; 8]);
    let (mut max_scale, mut max_min) = (0.0f32, 0.0f32);
    for j in 0..8 {
        let xs = &x[32 * j..32 * j + 32];
        let sum_x2 = xs.iter().fold(0.0f32, |s, v| s + v * v);
        let av_x = (sum_x2 / 32.0).sqrt();
        let w: [f32; 32] = std::array::from_fn(|i| av_x + xs[i].abs());
        (scales[j], mins[j]) = fit_scale_min(xs, &w, nmax, rmin, 0.1, nstep, &mut l[32 * j..32 * j + 32]);
        if scales[j] > max_scale {
            max_scale = scales[j];
        }
        if mins[j] > max_min {
            max_min = mins[j];
        }
    }
    let inv_scale = if max_scale > 0.0 { 63.0 / max_scale } else { 0.0 };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let mut packed = [0u8; 12];
    for j in 0..8 {
        // The C stores the int in a u8 before clamping: keep the wrap.
        let ls = (nearest_int(inv_scale * scales[j]) as u8).min(63);
        let lm = (nearest_int(inv_min * mins[j]) as u8).min(63);
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0x0F) | (lm & 0x0F) << 4;
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    let (d, dmin) = (f16_round(max_scale / 63.0), f16_round(max_min / 63.0));
    for j in 0..8 {
        let (sc, m) = super::k_scale_min(&packed, j);
        let dl = d * f32::from(sc);
        if dl == 0.0 {
            continue;
        }
        let ml = dmin * f32::from(m);
        for i in 0..32 {
            l[32 * j + i] = nearest_int((x[32 * j + i] + ml) / dl).clamp(0, nmax) as u8;
        }
    }
    (f16_bits(max_scale / 63.0), f16_bits(max_min / 63.0), packed, l)
}

fn q4_k(x: &[f32], out: &mut Vec<u8>) {
    let (d, dmin, scales, l) = k_scales_mins(x, 15, -1.0, 20);
    out.extend(d);
    out.extend(dmin);
    out.extend(scales);
    // Sub-blocks 2c and 2c+1 share 32 bytes: low nibbles, then high.
    for c in 0..4 {
        out.extend((0..32).map(|i| l[64 * c + i] | l[64 * c + 32 + i] << 4));
    }
}

fn q5_k(x: &[f32], out: &mut Vec<u8>) {
    let (d, dmin, scales, l) = k_scales_mins(x, 31, -0.5, 15);
    out.extend(d);
    out.extend(dmin);
    out.extend(scales);
    // Bit 4 of sub-block s's value i is bit s of qh[i].
    out.extend((0..32).map(|i| (0..8).fold(0u8, |h, s| h | (l[32 * s + i] >> 4 & 1) << s)));
    for c in 0..4 {
        out.extend((0..32).map(|i| (l[64 * c + i] & 0x0F) | (l[64 * c + 32 + i] & 0x0F) << 4));
    }
}

/// Symmetric levels −nmax..nmax−1 for one sub-block, weighted by x²: the scale from the
/// largest value, then 18 nearby grids `nmax ± 0.1·k`, each refitted by least squares,
/// keeping the one that explains most (llama.cpp's `make_qx_quants`, rmse type 1).
/// Writes `l + nmax` and returns the scale.
fn fit_symmetric(x: &[f32], nmax: i32, l: &mut [u8]) -> f32 {
    let (amax, max) = signed_absmax(x);
    if amax < 1e-15 {
        l.fill(0);
        return 0.0;
    }
    let nmax_f = nmax as f32;
    let level = |iscale: f32, v: f32| nearest_int(iscale * v).clamp(-nmax, nmax - 1);
    let sums = |iscale: f32| {
        x.iter().fold((0.0f32, 0.0f32), |(lx, l2), &v| {
            let (w, lf) = (v * v, level(iscale, v) as f32);
            (lx + w * v * lf, l2 + w * lf * lf)
        })
    };
    let mut iscale = -nmax_f / max;
    for (l, &v) in l.iter_mut().zip(x) {
        *l = (level(iscale, v) + nmax) as u8;
    }
    let (sumlx, suml2) = sums(iscale);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in (-9..=9).filter(|&is| is != 0) {
        iscale = -(nmax_f + 0.1 * is as f32) / max;
        let (sumlx, suml2) = sums(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            for (l, &v) in l.iter_mut().zip(x) {
                *l = (level(iscale, v) + nmax) as u8;
            }
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

fn q6_k(x: &[f32], out: &mut Vec<u8>) {
    let mut l = [0u8; 256];
    let mut scales = [0f32; 16];
    let (mut max_scale, mut max_abs_scale) = (0.0f32, 0.0f32);
    for (ib, s) in scales.iter_mut().enumerate() {
        *s = fit_symmetric(&x[16 * ib..16 * ib + 16], 32, &mut l[16 * ib..16 * ib + 16]);
        if s.abs() > max_abs_scale {
            max_abs_scale = s.abs();
            max_scale = *s;
        }
    }
    if max_abs_scale < 1e-15 {
        out.extend([0u8; 210]);
        return;
    }
    let iscale = -128.0 / max_scale;
    let d = f16_round(1.0 / iscale);
    let qscales: [i8; 16] = std::array::from_fn(|ib| nearest_int(iscale * scales[ib]).min(127) as i8);
    for (j, &sc) in qscales.iter().enumerate() {
        let dl = d * f32::from(sc);
        if dl == 0.0 {
            continue;
        }
        for i in 0..16 {
            l[16 * j + i] = (nearest_int(x[16 * j + i] / dl).clamp(-32, 31) + 32) as u8;
        }
    }
    // Two halves of 128: ql holds low nibbles (values v and v+64 share a byte), qh the
    // top two bits of values v, v+32, v+64, v+96.
    let mut ql = [0u8; 128];
    let mut qh = [0u8; 64];
    for half in 0..2 {
        let (lb, qlb, qhb) = (&l[128 * half..], &mut ql[64 * half..], &mut qh[32 * half..]);
        for i in 0..32 {
            qlb[i] = (lb[i] & 0x0F) | (lb[i + 64] & 0x0F) << 4;
            qlb[i + 32] = (lb[i + 32] & 0x0F) | (lb[i + 96] & 0x0F) << 4;
            qhb[i] = lb[i] >> 4 | (lb[i + 32] >> 4) << 2 | (lb[i + 64] >> 4) << 4 | (lb[i + 96] >> 4) << 6;
        }
    }
    out.extend(ql);
    out.extend(qh);
    out.extend(qscales.map(i8::cast_unsigned));
    out.extend(f16_bits(1.0 / iscale));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nearest_int_rounds_ties_to_even() {
        assert_eq!([0.5, 1.5, 2.5, -0.5, -1.5, 3.49].map(nearest_int), [0, 2, 2, 0, -2, 3]);
    }
}

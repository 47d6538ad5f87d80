//! GGUF's block-quantized weight formats: the reference dequantization to f32 (here) and
//! the reference quantizers ([`encode`]).
//!
//! Each format stores a tensor row as blocks of `block_size` values, every block a few
//! f16 scales and packed small integers. This file is the plain, obviously-correct
//! decoding of each layout, written for reading; its results equal gguf-py's
//! `quants.dequantize` bit for bit (tests/quant.rs), including the order of the f32
//! operations (`(d · scale) · q − (dmin · min)`), so it can serve as the ground truth
//! for fast quantized kernels.
//!
//! | format | values/block | bytes/block | layout |
//! | --- | ---: | ---: | --- |
//! | Q8_0 | 32 | 34 | d f16, 32 × i8 |
//! | Q4_0 | 32 | 18 | d f16, 16 bytes of nibbles (low: values 0–15, high: 16–31), offset 8 |
//! | Q4_1 | 32 | 20 | d f16, m f16, nibbles as Q4_0, plus m |
//! | Q5_0 | 32 | 22 | d f16, 32 high bits (u32), nibbles as Q4_0, offset 16 |
//! | Q5_1 | 32 | 24 | d f16, m f16, high bits, nibbles, plus m |
//! | Q4_K | 256 | 144 | d, dmin f16, 12 bytes of 6-bit scales/mins for 8 sub-blocks of 32, 128 bytes of nibbles |
//! | Q5_K | 256 | 176 | as Q4_K plus 32 bytes of fifth bits |
//! | Q6_K | 256 | 210 | 128 bytes low nibbles, 64 bytes of 2-bit highs, 16 × i8 scales (sub-blocks of 16), d f16 |

pub mod encode;

use half::f16;

use crate::tensor::GgmlType;

/// f16 → f32, exact; a NaN keeps its payload and signalling bit (as numpy's cast does;
/// the `half` crate quiets it).
fn f16_to_f32(bits: u16) -> f32 {
    let (sign, exp, man) = (u32::from(bits >> 15), (bits >> 10) & 0x1F, u32::from(bits & 0x3FF));
    if exp == 0x1F && man != 0 {
        return f32::from_bits(sign << 31 | 0x7F80_0000 | man << 13);
    }
    f16::from_bits(bits).to_f32()
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16_to_f32(u16::from_le_bytes([b[i], b[i + 1]]))
}

/// The formats [`dequantize`] decodes.
pub const SUPPORTED: [GgmlType; 11] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q5_0,
    GgmlType::Q5_1,
    GgmlType::Q4K,
    GgmlType::Q5K,
    GgmlType::Q6K,
];

/// Decode `data` (whole blocks of `ty`) into f32 values.
pub fn dequantize(ty: GgmlType, data: &[u8]) -> Result<Vec<f32>, String> {
    if !SUPPORTED.contains(&ty) {
        return Err(format!("dequantizing {} is not supported", ty.name()));
    }
    let (bs, ts) = (ty.block_size() as usize, ty.type_size() as usize);
    if !data.len().is_multiple_of(ts) {
        return Err(format!("{} bytes are not whole {} blocks of {ts} bytes", data.len(), ty.name()));
    }
    let mut out = vec![0f32; data.len() / ts * bs];
    let blocks = data.chunks_exact(ts).zip(out.chunks_exact_mut(bs));
    match ty {
        GgmlType::F32 => blocks.for_each(|(b, y)| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]])),
        GgmlType::F16 => blocks.for_each(|(b, y)| y[0] = f16_at(b, 0)),
        // bf16 is the top half of an f32: exact, NaN payloads included.
        GgmlType::BF16 => {
            blocks.for_each(|(b, y)| y[0] = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16))
        }
        GgmlType::Q8_0 => blocks.for_each(|(b, y)| q8_0(b, y)),
        GgmlType::Q4_0 => blocks.for_each(|(b, y)| q4_0(b, y)),
        GgmlType::Q4_1 => blocks.for_each(|(b, y)| q4_1(b, y)),
        GgmlType::Q5_0 => blocks.for_each(|(b, y)| q5_0(b, y)),
        GgmlType::Q5_1 => blocks.for_each(|(b, y)| q5_1(b, y)),
        GgmlType::Q4K => blocks.for_each(|(b, y)| q4_k(b, y)),
        GgmlType::Q5K => blocks.for_each(|(b, y)| q5_k(b, y)),
        GgmlType::Q6K => blocks.for_each(|(b, y)| q6_k(b, y)),
        other => unreachable!("{} is checked against SUPPORTED above", other.name()),
    }
    Ok(out)
}

/// `data` (whole blocks of `ty`) as Q8_0 blocks holding exactly the same values, where the
/// type allows it: Q8_0 itself, Q4_0 and Q5_0, whose `d · (q − 8)` and `d · (q − 16)`
/// are a Q8_0 block with the same `d` and `q − 8`, `q − 16` as its i8 quants (llama.cpp's
/// dot products of these types with Q8_0 activations compute the very same sums).
/// `None` for other types; an error for bytes that are not whole blocks.
pub fn to_q8_0(ty: GgmlType, data: &[u8]) -> Option<Result<Vec<u8>, String>> {
    let quant: fn(&[u8], usize) -> i8 = match ty {
        GgmlType::Q8_0 => |b, i| b[2 + i] as i8,
        GgmlType::Q4_0 => |b, i| nibble(&b[2..18], i) as i8 - 8,
        GgmlType::Q5_0 => |b, i| five_bits(&b[2..6], &b[6..22], i) as i8 - 16,
        _ => return None,
    };
    let ts = ty.type_size() as usize;
    if !data.len().is_multiple_of(ts) {
        return Some(Err(format!("{} bytes are not whole {} blocks of {ts} bytes", data.len(), ty.name())));
    }
    let mut out = Vec::with_capacity(data.len() / ts * 34);
    for b in data.chunks_exact(ts) {
        out.extend_from_slice(&b[..2]);
        out.extend((0..32).map(|i| quant(b, i) as u8));
    }
    Some(Ok(out))
}

/// y = q · d.
fn q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (v, &q) in y.iter_mut().zip(&b[2..34]) {
        *v = f32::from(q as i8) * d;
    }
}

/// The 4-bit value `i` (0..32) of a 16-byte nibble array: low nibbles first, then high.
fn nibble(qs: &[u8], i: usize) -> u8 {
    if i < 16 { qs[i] & 0x0F } else { qs[i - 16] >> 4 }
}

/// y = d · (q − 8).
fn q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (i, v) in y.iter_mut().enumerate() {
        *v = d * f32::from(nibble(&b[2..18], i) as i8 - 8);
    }
}

/// y = d · q + m.
fn q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (i, v) in y.iter_mut().enumerate() {
        *v = d * f32::from(nibble(&b[4..20], i)) + m;
    }
}

/// The 5-bit value `i`: a nibble plus bit `i` of the little-endian u32 `qh` as bit 4.
fn five_bits(qh: &[u8], qs: &[u8], i: usize) -> u8 {
    let high = u32::from_le_bytes([qh[0], qh[1], qh[2], qh[3]]) >> i & 1;
    nibble(qs, i) | (high as u8) << 4
}

/// y = d · (q − 16).
fn q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (i, v) in y.iter_mut().enumerate() {
        *v = d * f32::from(five_bits(&b[2..6], &b[6..22], i) as i8 - 16);
    }
}

/// y = d · q + m.
fn q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    for (i, v) in y.iter_mut().enumerate() {
        *v = d * f32::from(five_bits(&b[4..8], &b[8..24], i)) + m;
    }
}

/// Scale and min of sub-block `j` (0..8) from the 12 packed bytes of Q4_K/Q5_K: six
/// bits each; sub-blocks 4–7 keep their low four bits in bytes 8–11 and their top two
/// in the spare top bits of bytes 0–7.
pub fn k_scale_min(s: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (s[j] & 0x3F, s[j + 4] & 0x3F)
    } else {
        ((s[j + 4] & 0x0F) | (s[j - 4] >> 6) << 4, (s[j + 4] >> 4) | (s[j] >> 6) << 4)
    }
}

/// Eight sub-blocks of 32: y = (d · scale) · q − (dmin · min), q from `q(sub, l)`.
fn k_quant(b: &[u8], y: &mut [f32], q: impl Fn(usize, usize) -> u8) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    for (sub, ys) in y.chunks_exact_mut(32).enumerate() {
        let (sc, m) = k_scale_min(&b[4..16], sub);
        let (dl, ml) = (d * f32::from(sc), dmin * f32::from(m));
        for (l, v) in ys.iter_mut().enumerate() {
            *v = dl * f32::from(q(sub, l)) - ml;
        }
    }
}

/// Sub-blocks 2c and 2c+1 share the 32 bytes of chunk c: low nibbles, then high.
fn k_nibble(qs: &[u8], sub: usize, l: usize) -> u8 {
    let byte = qs[sub / 2 * 32 + l];
    if sub.is_multiple_of(2) { byte & 0x0F } else { byte >> 4 }
}

fn q4_k(b: &[u8], y: &mut [f32]) {
    let qs = &b[16..144];
    k_quant(b, y, |sub, l| k_nibble(qs, sub, l));
}

/// As Q4_K, with bit `sub` of byte `l` of `qh` as the fifth bit.
fn q5_k(b: &[u8], y: &mut [f32]) {
    let (qh, qs) = (&b[16..48], &b[48..176]);
    k_quant(b, y, |sub, l| k_nibble(qs, sub, l) | (qh[l] >> sub & 1) << 4);
}

/// Two halves of 128 values; value v of half n takes a nibble of `ql[64n + v % 64]` (low
/// for v < 64) and bits 2·(v / 32) of `qh[32n + v % 32]` as its top two bits; each 16
/// values share an i8 scale: y = (d · scale) · (q − 32).
fn q6_k(b: &[u8], y: &mut [f32]) {
    let (ql, qh, scales) = (&b[0..128], &b[128..192], &b[192..208]);
    let d = f16_at(b, 208);
    for (i, v) in y.iter_mut().enumerate() {
        let (n, v_in) = (i / 128, i % 128);
        let low = ql[64 * n + v_in % 64];
        let low = if v_in < 64 { low & 0x0F } else { low >> 4 };
        let high = qh[32 * n + v_in % 32] >> (2 * (v_in / 32)) & 3;
        let q = (low | high << 4) as i8 - 32;
        *v = (d * f32::from(scales[i / 16] as i8)) * f32::from(q);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn to_q8_0_keeps_every_value() {
        // Blocks with every quant value and an awkward f16 scale.
        let d = half::f16::from_f32(-0.0173).to_bits().to_le_bytes();
        let mut q4 = d.to_vec();
        q4.extend((0..16u8).map(|i| i | (15 - i) << 4));
        let mut q5 = d.to_vec();
        q5.extend(0xA5C3_0F96u32.to_le_bytes());
        q5.extend((0..16u8).map(|i| (i * 7 % 16) | (i * 3 % 16) << 4));
        for (ty, b) in [(GgmlType::Q4_0, q4), (GgmlType::Q5_0, q5)] {
            let q8 = to_q8_0(ty, &b).unwrap().unwrap();
            assert_eq!(q8.len(), 34);
            assert_eq!(dequantize(GgmlType::Q8_0, &q8).unwrap(), dequantize(ty, &b).unwrap(), "{}", ty.name());
        }
        assert!(to_q8_0(GgmlType::Q4_1, &[0; 20]).is_none());
        assert!(to_q8_0(GgmlType::Q5_0, &[0; 21]).unwrap().is_err());
    }
}

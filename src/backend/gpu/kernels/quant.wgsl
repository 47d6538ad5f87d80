// GGUF block formats read in place: a weight chunk is its rows' blocks exactly as the
// file stores them, bound as `w: array<u32>` by the kernel that includes this file.
// Blocks are not 4-byte aligned (Q8_0 is 34 bytes, Q6_K 210), so bytes and u32s are
// read at any byte offset; every f16 sits at an even offset (all block sizes are even).
//
// `deq4(b, j)` returns values j..j+3 (j a multiple of 4) of the block at byte offset b,
// decoded as src/quant/mod.rs (gguf-py) decodes them. Every product there is exact in
// f32 (an f16 scale's 11 significant bits times integers of at most 12 bits together,
// Q6_K's `(d * scale) * q` included), and each value takes at most one rounding (the
// add of Q4_1/Q5_1's m, the subtract of Q4_K/Q5_K's min), so a fused multiply-add or
// a fast-math compiler gives the same bits: the decoded weights equal the reference's.
// The Rust side prepends `const QK` (values per block), `const TS` (bytes per block)
// and `fn deq4` choosing one of the `deq4_*` below.

fn byte_at(o: u32) -> u32 {
    return (w[o >> 2u] >> ((o & 3u) * 8u)) & 0xFFu;
}

// The little-endian u32 at byte offset o (two reads when unaligned; buffers are padded
// to whole words, so the second read stays inside).
fn u32_at(o: u32) -> u32 {
    let s = (o & 3u) * 8u;
    let lo = w[o >> 2u];
    if (s == 0u) {
        return lo;
    }
    return (lo >> s) | (w[(o >> 2u) + 1u] << (32u - s));
}

// The f16 at even byte offset o.
fn f16_at(o: u32) -> f32 {
    let pair = unpack2x16float(w[o >> 2u]);
    return select(pair.x, pair.y, (o & 2u) != 0u);
}

// The four bytes of q as signed values.
fn i8x4(q: u32) -> vec4<f32> {
    let s = bitcast<i32>(q);
    return vec4<f32>(vec4<i32>(extractBits(s, 0u, 8u), extractBits(s, 8u, 8u), extractBits(s, 16u, 8u),
                               extractBits(s, 24u, 8u)));
}

// The low four bits of each byte of q, unsigned.
fn nib4(q: u32) -> vec4<f32> {
    return vec4<f32>(vec4<u32>(q & 0xFu, (q >> 8u) & 0xFu, (q >> 16u) & 0xFu, (q >> 24u) & 0xFu));
}

// Values j..j+3 of a 32-value nibble array at byte offset o (low nibbles hold 0..15).
fn nibbles32(o: u32, j: u32) -> vec4<f32> {
    return nib4(u32_at(o + (j & 15u)) >> select(0u, 4u, j >= 16u));
}

// Bits j..j+3 of the little-endian u32 at o, as the fifth bit (16 or 0).
fn high5(o: u32, j: u32) -> vec4<f32> {
    let h = u32_at(o) >> j;
    return vec4<f32>(vec4<u32>(h & 1u, (h >> 1u) & 1u, (h >> 2u) & 1u, (h >> 3u) & 1u) * 16u);
}

// Q8_0: d, 32 x i8. y = q * d.
fn deq4_q8_0(b: u32, j: u32) -> vec4<f32> {
    return i8x4(u32_at(b + 2u + j)) * f16_at(b);
}

// Q4_0: d, 16 bytes of nibbles. y = d * (q - 8).
fn deq4_q4_0(b: u32, j: u32) -> vec4<f32> {
    return f16_at(b) * (nibbles32(b + 2u, j) - 8.0);
}

// Q4_1: d, m, nibbles. y = d * q + m.
fn deq4_q4_1(b: u32, j: u32) -> vec4<f32> {
    return f16_at(b) * nibbles32(b + 4u, j) + f16_at(b + 2u);
}

// Q5_0: d, 32 fifth bits, nibbles. y = d * (q - 16).
fn deq4_q5_0(b: u32, j: u32) -> vec4<f32> {
    return f16_at(b) * (nibbles32(b + 6u, j) + high5(b + 2u, j) - 16.0);
}

// Q5_1: d, m, fifth bits, nibbles. y = d * q + m.
fn deq4_q5_1(b: u32, j: u32) -> vec4<f32> {
    return f16_at(b) * (nibbles32(b + 8u, j) + high5(b + 4u, j)) + f16_at(b + 2u);
}

// Scale and min of sub-block `sub` (0..8) from the 12 packed bytes at o (Q4_K, Q5_K).
fn k_scale_min(o: u32, sub: u32) -> vec2<f32> {
    if (sub < 4u) {
        return vec2<f32>(f32(byte_at(o + sub) & 63u), f32(byte_at(o + sub + 4u) & 63u));
    }
    let lo = byte_at(o + sub + 4u);
    let sc = (lo & 15u) | ((byte_at(o + sub - 4u) >> 6u) << 4u);
    let mn = (lo >> 4u) | ((byte_at(o + sub) >> 6u) << 4u);
    return vec2<f32>(f32(sc), f32(mn));
}

// Q4_K: d, dmin, 12 scale bytes, 128 bytes of nibbles (sub-blocks 2c and 2c+1 share the
// 32 bytes of chunk c: low nibbles, then high). y = (d * scale) * q - (dmin * min).
fn deq4_q4_k(b: u32, j: u32) -> vec4<f32> {
    let sub = j / 32u;
    let sm = k_scale_min(b + 4u, sub);
    let q = nib4(u32_at(b + 16u + (sub / 2u) * 32u + (j & 31u)) >> ((sub & 1u) * 4u));
    return (f16_at(b) * sm.x) * q - f16_at(b + 2u) * sm.y;
}

// Q5_K: as Q4_K with 32 bytes of fifth bits before the nibbles (bit `sub` of byte l).
fn deq4_q5_k(b: u32, j: u32) -> vec4<f32> {
    let sub = j / 32u;
    let l = j & 31u;
    let sm = k_scale_min(b + 4u, sub);
    let low = nib4(u32_at(b + 48u + (sub / 2u) * 32u + l) >> ((sub & 1u) * 4u));
    let h = u32_at(b + 16u + l) >> sub;
    let fifth = vec4<f32>(vec4<u32>(h & 1u, (h >> 8u) & 1u, (h >> 16u) & 1u, (h >> 24u) & 1u) * 16u);
    return (f16_at(b) * sm.x) * (low + fifth) - f16_at(b + 2u) * sm.y;
}

// Q6_K: 128 bytes of low nibbles, 64 bytes of 2-bit highs, 16 x i8 scales, d. Value v of
// half n (128 values each) takes a nibble of ql[64n + v % 64] (low for v < 64) and bits
// 2 (v / 32) of qh[32n + v % 32]; y = (d * scale) * (q - 32), a scale per 16 values.
fn deq4_q6_k(b: u32, j: u32) -> vec4<f32> {
    let n = j / 128u;
    let v = j & 127u;
    let low = (u32_at(b + 64u * n + (v & 63u)) >> select(0u, 4u, v >= 64u)) & 0x0F0F0F0Fu;
    let high = (u32_at(b + 128u + 32u * n + (v & 31u)) >> (2u * (v / 32u))) & 0x03030303u;
    let q = nib4(low) + vec4<f32>(vec4<u32>(high & 3u, (high >> 8u) & 3u, (high >> 16u) & 3u, (high >> 24u) & 3u)) * 16.0;
    let scale = f32(extractBits(bitcast<i32>(byte_at(b + 192u + j / 16u)), 0u, 8u));
    return (f16_at(b + 208u) * scale) * (q - 32.0);
}

// Values k..k+3 (k a multiple of 4) of row `row` of a chunk whose rows hold `cols` values.
fn wq4(row: u32, cols: u32, k: u32) -> vec4<f32> {
    return deq4(row * (cols / QK) * TS + (k / QK) * TS, k % QK);
}

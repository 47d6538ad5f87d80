//! SentencePiece's `tokenizer.model`: the pieces of its `ModelProto` protobuf, read without
//! a protobuf library.
//!
//! Only what llama.cpp's converter takes from it (`SentencePieceProcessor.IdToPiece`,
//! `GetScore`, `IsUnknown`/`IsControl`/`IsUnused`/`IsByte`) is kept: each piece's text,
//! score and type, in id order. The trainer and normalizer specs are skipped. Every length
//! is checked against the bytes left, so a truncated or foreign file is an error naming the
//! offset, never a panic.

use std::fmt;

/// A piece's type, as `sentencepiece_model.proto` numbers them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PieceType {
    Normal = 1,
    Unknown = 2,
    Control = 3,
    UserDefined = 4,
    Unused = 5,
    Byte = 6,
}

/// One vocabulary entry; its id is its index.
#[derive(Clone, Debug, PartialEq)]
pub struct Piece {
    pub text: String,
    pub score: f32,
    pub kind: PieceType,
}

#[derive(Debug, PartialEq, Eq)]
pub struct SpmError {
    pub offset: usize,
    pub what: String,
}

impl fmt::Display for SpmError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "not a SentencePiece model: {} at byte {}", self.what, self.offset)
    }
}

impl std::error::Error for SpmError {}

/// A protobuf field's value: varints, fixed 32/64-bit words and length-delimited bytes.
enum Value<'a> {
    Varint(u64),
    Fixed64,
    Bytes(&'a [u8]),
    Fixed32(u32),
}

struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
    /// Offset of `buf` in the file, for messages.
    base: usize,
}

impl<'a> Reader<'a> {
    fn err(&self, what: impl Into<String>) -> SpmError {
        SpmError { offset: self.base + self.pos, what: what.into() }
    }

    fn varint(&mut self) -> Result<u64, SpmError> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let Some(&b) = self.buf.get(self.pos) else { return Err(self.err("truncated varint")) };
            self.pos += 1;
            v |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                return Ok(v);
            }
        }
        Err(self.err("varint longer than 10 bytes"))
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], SpmError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        let Some(end) = end else { return Err(self.err(format!("a field of {n} bytes runs past the end"))) };
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    /// The next (field number, value), or `None` at the end.
    fn field(&mut self) -> Result<Option<(u64, Value<'a>, usize)>, SpmError> {
        if self.pos == self.buf.len() {
            return Ok(None);
        }
        let key = self.varint()?;
        // Where the value starts (a message's first byte, past its length).
        let mut at = self.base + self.pos;
        let value = match key & 7 {
            0 => Value::Varint(self.varint()?),
            1 => {
                self.take(8)?;
                Value::Fixed64
            }
            2 => {
                let n = self.varint()?;
                let n = usize::try_from(n).map_err(|_| self.err("length does not fit in memory"))?;
                at = self.base + self.pos;
                Value::Bytes(self.take(n)?)
            }
            5 => {
                let b = self.take(4)?;
                Value::Fixed32(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            }
            w => return Err(self.err(format!("wire type {w} (groups are not used by ModelProto)"))),
        };
        Ok(Some((key >> 3, value, at)))
    }
}

/// The pieces of a `ModelProto` (field 1, repeated `SentencePiece`: 1 piece, 2 score,
/// 3 type), in id order.
pub fn parse_pieces(bytes: &[u8]) -> Result<Vec<Piece>, SpmError> {
    let mut top = Reader { buf: bytes, pos: 0, base: 0 };
    let mut pieces = Vec::new();
    while let Some((field, value, at)) = top.field()? {
        let (1, Value::Bytes(msg)) = (field, &value) else {
            if field == 1 {
                return Err(SpmError { offset: at, what: "field 1 (pieces) is not a message".into() });
            }
            continue;
        };
        let mut r = Reader { buf: msg, pos: 0, base: at };
        let (mut text, mut score, mut kind) = (None, 0.0f32, PieceType::Normal);
        while let Some((f, v, at)) = r.field()? {
            match (f, v) {
                (1, Value::Bytes(b)) => {
                    let s = std::str::from_utf8(b)
                        .map_err(|_| SpmError { offset: at, what: "a piece is not UTF-8".into() })?;
                    text = Some(s.to_owned());
                }
                (2, Value::Fixed32(w)) => score = f32::from_bits(w),
                (3, Value::Varint(t)) => {
                    kind = match t {
                        1 => PieceType::Normal,
                        2 => PieceType::Unknown,
                        3 => PieceType::Control,
                        4 => PieceType::UserDefined,
                        5 => PieceType::Unused,
                        6 => PieceType::Byte,
                        _ => return Err(SpmError { offset: at, what: format!("piece type {t}") }),
                    }
                }
                (1..=3, _) => {
                    return Err(SpmError { offset: at, what: format!("piece field {f} has the wrong wire type") });
                }
                _ => {}
            }
        }
        let text = text.ok_or_else(|| SpmError { offset: at, what: format!("piece {} has no text", pieces.len()) })?;
        pieces.push(Piece { text, score, kind });
    }
    if pieces.is_empty() {
        return Err(SpmError { offset: 0, what: "no pieces".into() });
    }
    Ok(pieces)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn varint(mut v: u64, out: &mut Vec<u8>) {
        loop {
            let b = (v & 0x7f) as u8;
            v >>= 7;
            if v == 0 {
                out.push(b);
                return;
            }
            out.push(b | 0x80);
        }
    }

    fn piece(text: &str, score: f32, kind: Option<u64>) -> Vec<u8> {
        let mut m = vec![0x0a];
        varint(text.len() as u64, &mut m);
        m.extend_from_slice(text.as_bytes());
        m.push(0x15);
        m.extend_from_slice(&score.to_le_bytes());
        if let Some(k) = kind {
            m.push(0x18);
            varint(k, &mut m);
        }
        let mut out = vec![0x0a];
        varint(m.len() as u64, &mut out);
        out.extend(m);
        out
    }

    #[test]
    fn pieces_in_order_with_unknown_fields_skipped() {
        let mut model = piece("<unk>", 0.0, Some(2));
        model.extend(piece("▁the", -1.5, None));
        // trainer_spec (field 2) and a varint field 9 are skipped.
        model.extend([0x12, 0x02, 0x08, 0x01, 0x48, 0x05]);
        model.extend(piece("<0x0A>", 0.0, Some(6)));
        let p = parse_pieces(&model).unwrap();
        let kinds: Vec<_> = p.iter().map(|p| (p.text.as_str(), p.score, p.kind)).collect();
        assert_eq!(
            kinds,
            [("<unk>", 0.0, PieceType::Unknown), ("▁the", -1.5, PieceType::Normal), ("<0x0A>", 0.0, PieceType::Byte)]
        );
    }

    #[test]
    fn damaged_models_are_errors() {
        let good = piece("ab", 1.0, Some(1));
        for cut in 1..good.len() {
            assert!(parse_pieces(&good[..cut]).is_err(), "cut at {cut}");
        }
        assert_eq!(parse_pieces(&[]).unwrap_err().what, "no pieces");
        assert!(parse_pieces(&piece("x", 0.0, Some(9))).unwrap_err().what.contains("piece type 9"));
        assert!(parse_pieces(&[0x0b]).unwrap_err().what.contains("wire type 3"));
        assert!(parse_pieces(&[0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f]).unwrap_err().what.contains("runs past"));
    }
}

//! GGUF reader (format versions 2 and 3), memory-mapped and zero-copy.
//!
//! Layout (little-endian):
//!
//! ```text
//! "GGUF" | version u32 | n_tensors u64 | n_kv u64
//! n_kv × (key: string, type u32, value)              metadata
//! n_tensors × (name: string, n_dims u32, dims u64 × n_dims, ggml type u32, offset u64)
//! padding to `general.alignment` (default 32)
//! tensor data: each tensor at data_start + offset (offsets aligned)
//! ```
//!
//! A string is a u64 length and that many UTF-8 bytes; an array is an element type u32,
//! a u64 count and the elements. `dims[0]` is the innermost (fastest-varying)
//! dimension, as ggml's `ne[0]`: a `[rows, cols]` PyTorch matrix is stored with
//! `dims = [cols, rows]`.
//!
//! Tensors may lie in the data section in any order, with gaps, as long as each is
//! aligned, in bounds and overlaps no other (llama.cpp is stricter: table order, each
//! at the padded end of the one before, names under 64 bytes); strings must be UTF-8.
//!
//! Every count, length, type, dimension, the alignment and every offset is checked
//! against the file before use, with checked arithmetic: a count is never trusted for
//! an allocation until the bytes it claims are known to be there, so a hostile file
//! gets a one-line error, never a panic, a hang or a huge allocation.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use super::Backing;
pub use crate::tensor::GgmlType;

/// GGUF's default data alignment.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's limit on tensor dimensions.
pub const MAX_DIMS: usize = 4;
/// Arrays nest at most this deep (real files use one level).
const MAX_ARRAY_DEPTH: usize = 3;
/// Most entries reserved ahead from a count read from the file; beyond it, collections
/// grow only as entries actually parse.
const RESERVE_MAX: usize = 4096;

#[derive(Debug, thiserror::Error)]
#[error("{path}: {msg}")]
pub struct GgufError {
    pub path: PathBuf,
    pub msg: String,
}

/// A metadata value.
#[derive(Clone, Debug, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    F32(f32),
    Bool(bool),
    String(String),
    /// GGUF's element type code (kept so that an empty array is written back as read)
    /// and the elements.
    Array(u32, Vec<MetaValue>),
    U64(u64),
    I64(i64),
    F64(f64),
}

impl MetaValue {
    pub fn type_name(&self) -> &'static str {
        match self {
            MetaValue::U8(_) => "u8",
            MetaValue::I8(_) => "i8",
            MetaValue::U16(_) => "u16",
            MetaValue::I16(_) => "i16",
            MetaValue::U32(_) => "u32",
            MetaValue::I32(_) => "i32",
            MetaValue::F32(_) => "f32",
            MetaValue::Bool(_) => "bool",
            MetaValue::String(_) => "string",
            MetaValue::Array(..) => "array",
            MetaValue::U64(_) => "u64",
            MetaValue::I64(_) => "i64",
            MetaValue::F64(_) => "f64",
        }
    }

    /// Any integer type that fits in u64 without loss.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v.into()),
            MetaValue::U16(v) => Some(v.into()),
            MetaValue::U32(v) => Some(v.into()),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    /// F32 or F64 as f64.
    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v.into()),
            MetaValue::F64(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(_, a) => Some(a),
            _ => None,
        }
    }
}

/// One tensor's entry in the table.
#[derive(Clone, Debug, PartialEq)]
pub struct GgufTensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the innermost dimension.
    pub dims: Vec<u64>,
    pub ggml_type: GgmlType,
    /// Offset from the start of the data section (a multiple of the alignment).
    pub offset: u64,
    /// Bytes of data.
    pub n_bytes: u64,
}

impl GgufTensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
}

/// A parsed, validated header: metadata in file order and the tensor table.
#[derive(Clone, Debug)]
pub struct GgufHeader {
    pub version: u32,
    pub metadata: Vec<(String, MetaValue)>,
    pub tensors: Vec<GgufTensorInfo>,
    pub alignment: u64,
    /// Where the data section starts in the file.
    pub data_start: u64,
}

/// Little-endian reads that fail with a message instead of reading past the end.
struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: usize, what: &str) -> Result<&'a [u8], String> {
        if n > self.remaining() {
            return Err(format!(
                "{what} at byte {} needs {n} bytes but the file has {} left (truncated?)",
                self.pos,
                self.remaining()
            ));
        }
        let s = &self.bytes[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Result<[u8; N], String> {
        Ok(self.take(N, what)?.try_into().expect("N bytes"))
    }

    fn u32(&mut self, what: &str) -> Result<u32, String> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Result<u64, String> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A length or count, checked to be coverable by the rest of the file at
    /// `min_item_bytes` per item before anything is allocated for it.
    fn count(&mut self, min_item_bytes: usize, what: &str) -> Result<usize, String> {
        let at = self.pos;
        let n = self.u64(what)?;
        let fits =
            usize::try_from(n).ok().filter(|&n| n.checked_mul(min_item_bytes).is_some_and(|b| b <= self.remaining()));
        fits.ok_or_else(|| {
            format!("{what} at byte {at} is {n}, more than the {} bytes left can hold", self.remaining())
        })
    }

    fn string(&mut self, what: &str) -> Result<String, String> {
        let n = self.count(1, what)?;
        let at = self.pos;
        let bytes = self.take(n, what)?;
        std::str::from_utf8(bytes)
            .map(str::to_owned)
            .map_err(|e| format!("{what} at byte {at} is not valid UTF-8 ({e})"))
    }

    /// One value of type `ty`. Messages name no key (the caller adds it once, on error):
    /// formatting it per element would make a long key times a long array quadratic.
    fn value(&mut self, ty: u32, depth: usize) -> Result<MetaValue, String> {
        let what = "value";
        Ok(match ty {
            0 => MetaValue::U8(self.array::<1>(what)?[0]),
            1 => MetaValue::I8(i8::from_le_bytes(self.array(what)?)),
            2 => MetaValue::U16(u16::from_le_bytes(self.array(what)?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array(what)?)),
            4 => MetaValue::U32(self.u32(what)?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array(what)?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array(what)?)),
            7 => match self.array::<1>(what)?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(format!("bool byte {b} is neither 0 nor 1")),
            },
            8 => MetaValue::String(self.string(what)?),
            9 => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(format!("arrays nested deeper than {MAX_ARRAY_DEPTH}"));
                }
                let elem = self.u32(what)?;
                let min = min_value_bytes(elem).ok_or_else(|| format!("unknown array element type {elem}"))?;
                let n = self.count(min, "array element count")?;
                // Grown as elements parse, never reserved from the count: an element is
                // far larger in memory than its smallest encoding.
                let mut items = Vec::with_capacity(n.min(RESERVE_MAX));
                for _ in 0..n {
                    items.push(self.value(elem, depth + 1)?);
                }
                MetaValue::Array(elem, items)
            }
            10 => MetaValue::U64(self.u64(what)?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array(what)?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array(what)?)),
            other => return Err(format!("unknown value type {other}")),
        })
    }
}

/// The fewest bytes a value of `ty` takes (for bounding counts before allocating).
fn min_value_bytes(ty: u32) -> Option<usize> {
    Some(match ty {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 => 8,     // the length
        9 => 4 + 8, // element type and count
        10..=12 => 8,
        _ => return None,
    })
}

/// Parse and validate the header of a complete GGUF file image.
pub fn parse_header(bytes: &[u8]) -> Result<GgufHeader, String> {
    let mut r = Reader { bytes, pos: 0 };
    let magic = r.array::<4>("magic").map_err(|_| format!("file is {} bytes, too short for GGUF", bytes.len()))?;
    if &magic != b"GGUF" {
        return Err(format!("not a GGUF file (magic {magic:02x?}, expected \"GGUF\")"));
    }
    let version = r.u32("version")?;
    match version {
        2 | 3 => {}
        1 => return Err("GGUF version 1 is not supported (convert it again with a current llama.cpp)".into()),
        v if (1..=3).contains(&v.swap_bytes()) => return Err("big-endian GGUF files are not supported".into()),
        v => return Err(format!("GGUF version {v} is not supported (2 and 3 are)")),
    }
    // Bound the counts by the smallest encoding of an entry before reserving anything.
    let n_tensors = r.count(8 + 4 + 4 + 8, "tensor count")?;
    let n_kv = r.count(8 + 4 + 1, "metadata count")?;

    let mut metadata = Vec::with_capacity(n_kv.min(RESERVE_MAX));
    let mut seen = HashMap::with_capacity(n_kv.min(RESERVE_MAX));
    for i in 0..n_kv {
        let key = r.string(&format!("metadata key {i}"))?;
        let ty = r.u32(&format!("type of {key:?}"))?;
        let value = r.value(ty, 0).map_err(|e| format!("metadata {key:?}: {e}"))?;
        if seen.insert(key.clone(), ()).is_some() {
            return Err(format!("metadata key {key:?} appears twice"));
        }
        metadata.push((key, value));
    }
    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, MetaValue::U32(a))) if a.is_power_of_two() => u64::from(*a),
        Some((_, v)) => return Err(format!("general.alignment must be a power-of-two u32, got {v:?}")),
    };

    let mut tensors = Vec::with_capacity(n_tensors.min(RESERVE_MAX));
    let mut names = HashMap::with_capacity(n_tensors.min(RESERVE_MAX));
    for i in 0..n_tensors {
        let name = r.string(&format!("name of tensor {i}"))?;
        let n_dims = r.u32(&format!("dimension count of {name:?}"))? as usize;
        if n_dims > MAX_DIMS {
            return Err(format!("tensor {name:?} has {n_dims} dimensions; ggml allows at most {MAX_DIMS}"));
        }
        let mut dims = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            dims.push(r.u64(&format!("dimensions of {name:?}"))?);
        }
        let type_id = r.u32(&format!("type of {name:?}"))?;
        let ggml_type =
            GgmlType::from_id(type_id).ok_or_else(|| format!("tensor {name:?} has unknown ggml type {type_id}"))?;
        let offset = r.u64(&format!("offset of {name:?}"))?;
        if let Some(d) = dims.iter().find(|&&d| d > i64::MAX as u64) {
            return Err(format!("tensor {name:?}: dimension {d} is negative as ggml's int64"));
        }
        let n_elements = dims
            .iter()
            .try_fold(1u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| format!("tensor {name:?}: dimensions {dims:?} overflow"))?;
        if dims.first().is_some_and(|&d| !d.is_multiple_of(ggml_type.block_size())) {
            return Err(format!(
                "tensor {name:?}: innermost dimension {} is not a multiple of the {} block size {}",
                dims[0],
                ggml_type.name(),
                ggml_type.block_size()
            ));
        }
        let n_bytes = ggml_type.bytes_for(n_elements).ok_or_else(|| {
            format!("tensor {name:?}: {n_elements} {} values do not fill whole blocks", ggml_type.name())
        })?;
        if !offset.is_multiple_of(alignment) {
            return Err(format!("tensor {name:?}: offset {offset} is not a multiple of the alignment {alignment}"));
        }
        if names.insert(name.clone(), ()).is_some() {
            return Err(format!("tensor {name:?} appears twice"));
        }
        tensors.push(GgufTensorInfo { name, dims, ggml_type, offset, n_bytes });
    }

    let data_start = (r.pos as u64).next_multiple_of(alignment);
    let data_len = (bytes.len() as u64).saturating_sub(data_start);
    if data_start > bytes.len() as u64 && !tensors.is_empty() {
        return Err(format!(
            "the data section would start at {data_start}, past the end of the file ({})",
            bytes.len()
        ));
    }
    // Every tensor in bounds, none overlapping another.
    let mut spans: Vec<(u64, u64, &str)> = Vec::with_capacity(tensors.len());
    for t in &tensors {
        let end = t.offset.checked_add(t.n_bytes).filter(|&e| e <= data_len).ok_or_else(|| {
            format!(
                "tensor {:?}: {} bytes at offset {} run past the end of the data ({data_len} bytes; truncated?)",
                t.name, t.n_bytes, t.offset
            )
        })?;
        spans.push((t.offset, end, &t.name));
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(format!("tensors {:?} and {:?} overlap in the data section", w[0].2, w[1].2));
        }
    }
    Ok(GgufHeader { version, metadata, tensors, alignment, data_start })
}

/// A borrowed tensor: its table entry and its bytes (any alignment).
#[derive(Clone, Copy, Debug)]
pub struct GgufTensor<'a> {
    pub info: &'a GgufTensorInfo,
    pub bytes: &'a [u8],
}

/// One GGUF file, validated, with zero-copy access to its tensors.
pub struct GgufFile {
    path: PathBuf,
    bytes: Backing,
    header: GgufHeader,
    meta_index: HashMap<String, usize>,
    tensor_index: HashMap<String, usize>,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let err = |msg: String| GgufError { path: path.to_owned(), msg };
        let file = File::open(path).map_err(|e| err(format!("cannot open: {e}")))?;
        // SAFETY: the map is read-only and private to this process. As for safetensors,
        // the one hazard is another process truncating the file while it is mapped;
        // model files are not rewritten in place, and the validated header keeps every
        // access in range of the length mapped here.
        let mmap = unsafe { super::Mapping::map(&file) }.map_err(|e| err(format!("cannot mmap: {e}")))?;
        Self::with_backing(path, Backing::Mapped(mmap))
    }

    /// A file image already in memory; `name` stands in for the path in messages.
    pub fn from_bytes(name: &str, bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::with_backing(Path::new(name), Backing::Owned(bytes))
    }

    fn with_backing(path: &Path, bytes: Backing) -> Result<Self, GgufError> {
        let header = parse_header(&bytes).map_err(|msg| GgufError { path: path.to_owned(), msg })?;
        let meta_index = header.metadata.iter().enumerate().map(|(i, (k, _))| (k.clone(), i)).collect();
        let tensor_index = header.tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
        Ok(GgufFile { path: path.to_owned(), bytes, header, meta_index, tensor_index })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn header(&self) -> &GgufHeader {
        &self.header
    }

    /// Metadata in file order.
    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.header.metadata
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.meta_index.get(key).map(|&i| &self.header.metadata[i].1)
    }

    pub fn tensor_infos(&self) -> &[GgufTensorInfo] {
        &self.header.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<GgufTensor<'_>> {
        let info = &self.header.tensors[*self.tensor_index.get(name)?];
        // In range: checked by `parse_header` against this very buffer.
        let start = (self.header.data_start + info.offset) as usize;
        Some(GgufTensor { info, bytes: &self.bytes[start..start + info.n_bytes as usize] })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A minimal GGUF writer for tests: metadata as (key, type, value bytes).
    fn file(version: u32, meta: &[(&str, u32, Vec<u8>)], tensors: &[(&str, &[u64], u32, u64)], data: &[u8]) -> Vec<u8> {
        let mut b = b"GGUF".to_vec();
        b.extend(version.to_le_bytes());
        b.extend((tensors.len() as u64).to_le_bytes());
        b.extend((meta.len() as u64).to_le_bytes());
        let s = |b: &mut Vec<u8>, s: &str| {
            b.extend((s.len() as u64).to_le_bytes());
            b.extend(s.as_bytes());
        };
        for (k, ty, v) in meta {
            s(&mut b, k);
            b.extend(ty.to_le_bytes());
            b.extend(v);
        }
        for (name, dims, ty, off) in tensors {
            s(&mut b, name);
            b.extend((dims.len() as u32).to_le_bytes());
            for d in *dims {
                b.extend(d.to_le_bytes());
            }
            b.extend(ty.to_le_bytes());
            b.extend(off.to_le_bytes());
        }
        while !b.len().is_multiple_of(32) {
            b.push(0);
        }
        b.extend(data);
        b
    }

    fn array_of(elem: u32, n: u64, body: &[u8]) -> Vec<u8> {
        let mut v = elem.to_le_bytes().to_vec();
        v.extend(n.to_le_bytes());
        v.extend(body);
        v
    }

    /// Arrays of one array each, `depth` deep, ending in an empty u8 array.
    fn nested(depth: usize) -> Vec<u8> {
        (1..depth).fold(array_of(0, 0, &[]), |inner, _| array_of(9, 1, &inner))
    }

    #[test]
    fn long_keys_and_long_arrays_parse_in_linear_time() {
        // A 64 KiB key over a 64 Ki-element array: formatting the key per element (as an
        // earlier version did) made this 4 GiB of work.
        let key = "k".repeat(1 << 16);
        let body = vec![7u8; 1 << 16];
        let f = file(3, &[(&key, 9, array_of(0, 1 << 16, &body))], &[], &[]);
        let g = GgufFile::from_bytes("t", f).unwrap();
        assert_eq!(g.get(&key).unwrap().as_array().unwrap().len(), 1 << 16);
        assert_eq!(nested(3).len(), 36);
        assert!(parse_header(&file(3, &[("k", 9, nested(3))], &[], &[])).is_ok());
    }

    fn string(s: &str) -> Vec<u8> {
        let mut v = (s.len() as u64).to_le_bytes().to_vec();
        v.extend(s.as_bytes());
        v
    }

    #[test]
    fn reads_metadata_and_tensors() {
        let mut arr = 8u32.to_le_bytes().to_vec();
        arr.extend(2u64.to_le_bytes());
        arr.extend(string("a"));
        arr.extend(string("bc"));
        let data: Vec<u8> = (0..66u8).collect();
        let f = file(
            3,
            &[("general.architecture", 8, string("llama")), ("tokens", 9, arr), ("n", 4, 7u32.to_le_bytes().to_vec())],
            &[("w", &[4, 2], 0, 0), ("q", &[32], 8, 32)],
            &data,
        );
        let g = GgufFile::from_bytes("t", f).unwrap();
        assert_eq!(g.get("general.architecture").and_then(MetaValue::as_str), Some("llama"));
        let toks: Vec<&str> =
            g.get("tokens").unwrap().as_array().unwrap().iter().filter_map(MetaValue::as_str).collect();
        assert_eq!(toks, ["a", "bc"]);
        assert_eq!(g.get("n").and_then(MetaValue::as_u64), Some(7));
        let w = g.tensor("w").unwrap();
        assert_eq!((w.info.ggml_type, w.info.n_bytes, w.bytes), (GgmlType::F32, 32, &data[..32]));
        let q = g.tensor("q").unwrap();
        assert_eq!((q.info.ggml_type, q.bytes.len()), (GgmlType::Q8_0, 34));
    }

    #[test]
    fn rejects_hostile_headers() {
        let mut huge_count = b"GGUF".to_vec();
        huge_count.extend(3u32.to_le_bytes());
        huge_count.extend(u64::MAX.to_le_bytes());
        huge_count.extend(0u64.to_le_bytes());
        let mut huge_string = file(3, &[], &[], &[]);
        huge_string.truncate(24);
        huge_string[16..24].copy_from_slice(&1u64.to_le_bytes());
        huge_string.extend(u64::MAX.to_le_bytes());
        huge_string.extend([0u8; 16]);
        let cases: Vec<(Vec<u8>, &str)> = vec![
            (b"GGU".to_vec(), "too short"),
            (b"GGML\x03\0\0\0".to_vec(), "not a GGUF file"),
            (file(1, &[], &[], &[]), "version 1"),
            (file(0x0300_0000, &[], &[], &[]), "big-endian"),
            (huge_count, "tensor count"),
            (huge_string, "metadata key 0"),
            (file(3, &[("k", 99, vec![])], &[], &[]), "metadata \"k\": unknown value type 99"),
            (file(3, &[("k", 7, vec![2])], &[], &[]), "neither 0 nor 1"),
            (file(3, &[("k", 4, vec![1, 0, 0, 0]), ("k", 4, vec![1, 0, 0, 0])], &[], &[]), "appears twice"),
            (file(3, &[("general.alignment", 4, 3u32.to_le_bytes().to_vec())], &[], &[]), "power-of-two"),
            (file(3, &[], &[("w", &[4], 77, 0)], &[0; 16]), "unknown ggml type 77"),
            (file(3, &[], &[("w", &[1, 1, 1, 1, 1], 0, 0)], &[0; 4]), "at most 4"),
            (file(3, &[], &[("w", &[1 << 40, 1 << 40], 0, 0)], &[]), "overflow"),
            (file(3, &[], &[("w", &[33], 8, 0)], &[0; 64]), "block size"),
            (file(3, &[], &[("w", &[4], 0, 16)], &[0; 64]), "alignment"),
            (file(3, &[], &[("w", &[4], 0, 0)], &[0; 8]), "past the end"),
            (file(3, &[], &[("w", &[4], 0, 0), ("v", &[16], 0, 0)], &[0; 64]), "overlap"),
            (file(3, &[], &[("w", &[4], 0, 0), ("w", &[4], 0, 32)], &[0; 64]), "appears twice"),
            (file(3, &[("k", 8, vec![2, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xfe])], &[], &[]), "UTF-8"),
            (file(0, &[], &[], &[]), "version 0 is not supported"),
            (file(3, &[], &[("w", &[0, u64::MAX], 0, 0)], &[]), "negative"),
            (file(3, &[("k", 9, nested(4))], &[], &[]), "nested deeper"),
            (file(3, &[("k", 9, array_of(0, u64::MAX, &[]))], &[], &[]), "array element count"),
            (file(3, &[("k", 9, array_of(8, 1 << 40, &[0; 64]))], &[], &[]), "array element count"),
        ];
        for (bytes, want) in cases {
            let e = parse_header(&bytes).unwrap_err();
            assert!(e.contains(want), "{e:?} should mention {want:?}");
        }
    }
}

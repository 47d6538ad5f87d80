//! Safetensors reader (zero-copy over mmap) and writer.
//!
//! Layout: 8-byte little-endian header length N, N bytes of JSON header, then the data
//! buffer. Every rule of the format is enforced before a byte of data is touched:
//! header size limit, UTF-8 JSON object, known dtypes, checked shape × dtype
//! arithmetic, and offsets that tile the data buffer exactly (contiguous, in bounds,
//! no gaps, no overlaps). Tensor data may sit at any alignment; readers convert with
//! `from_le_bytes` and never cast pointers.

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use super::Backing;
pub use crate::tensor::{Dtype, TensorView};

use serde_json::Value;

/// The format's own limit on the JSON header (100 MB).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;

#[derive(Debug, thiserror::Error)]
#[error("{path}: {msg}")]
pub struct SafetensorsError {
    pub path: PathBuf,
    pub msg: String,
}

type Result<T> = std::result::Result<T, SafetensorsError>;

#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Byte range inside the data buffer.
    pub begin: usize,
    pub end: usize,
}

/// A parsed, validated header.
#[derive(Clone, Debug)]
pub struct Header {
    pub tensors: BTreeMap<String, TensorInfo>,
    pub metadata: BTreeMap<String, String>,
    /// Offset of the data buffer from the start of the file (8 + N).
    pub data_start: usize,
}

/// Validate the header of a complete file image `bytes`.
pub fn parse_header(bytes: &[u8]) -> std::result::Result<Header, String> {
    if bytes.len() < 8 {
        return Err(format!("file is {} bytes, too short for a safetensors header", bytes.len()));
    }
    let n = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    if n > MAX_HEADER_BYTES {
        return Err(format!("header size {n} exceeds the {MAX_HEADER_BYTES}-byte limit"));
    }
    let header_end = 8usize
        .checked_add(usize::try_from(n).map_err(|_| "header size does not fit in memory")?)
        .ok_or("header size overflows")?;
    if header_end > bytes.len() {
        return Err(format!("header claims {n} bytes but the file has only {} after the size", bytes.len() - 8));
    }
    let text = std::str::from_utf8(&bytes[8..header_end]).map_err(|e| format!("header is not UTF-8: {e}"))?;
    let root: Value =
        serde_json::from_str(text.trim_end_matches(' ')).map_err(|e| format!("header is not valid JSON: {e}"))?;
    let obj = root.as_object().ok_or("header is not a JSON object")?;
    let data_len = bytes.len() - header_end;

    let mut tensors = BTreeMap::new();
    let mut metadata = BTreeMap::new();
    for (name, v) in obj {
        if name == "__metadata__" {
            let m = v.as_object().ok_or("__metadata__ is not an object")?;
            for (k, v) in m {
                let s = v.as_str().ok_or_else(|| format!("__metadata__ value of {k:?} is not a string"))?;
                metadata.insert(k.clone(), s.to_owned());
            }
            continue;
        }
        let dtype_s = v["dtype"].as_str().ok_or_else(|| format!("tensor {name:?}: missing dtype"))?;
        let dtype = Dtype::parse(dtype_s).ok_or_else(|| format!("tensor {name:?}: unknown dtype {dtype_s:?}"))?;
        let shape = v["shape"]
            .as_array()
            .ok_or_else(|| format!("tensor {name:?}: missing shape"))?
            .iter()
            .map(|d| d.as_u64().and_then(|d| usize::try_from(d).ok()))
            .collect::<Option<Vec<usize>>>()
            .ok_or_else(|| format!("tensor {name:?}: shape must be non-negative integers"))?;
        let offs = v["data_offsets"]
            .as_array()
            .filter(|a| a.len() == 2)
            .ok_or_else(|| format!("tensor {name:?}: data_offsets must be [begin, end]"))?;
        let off = |i: usize| offs[i].as_u64().and_then(|o| usize::try_from(o).ok());
        let (begin, end) = match (off(0), off(1)) {
            (Some(b), Some(e)) if b <= e => (b, e),
            _ => {
                return Err(format!("tensor {name:?}: invalid data_offsets {}", v["data_offsets"]));
            }
        };
        let nbytes = shape
            .iter()
            .try_fold(1usize, |acc, &d| acc.checked_mul(d))
            .and_then(|numel| numel.checked_mul(dtype.size()))
            .ok_or_else(|| format!("tensor {name:?}: shape {shape:?} overflows"))?;
        if end - begin != nbytes {
            return Err(format!(
                "tensor {name:?}: {dtype_s} {shape:?} needs {nbytes} bytes but data_offsets [{begin}, {end}] span {}",
                end - begin
            ));
        }
        if end > data_len {
            return Err(format!(
                "tensor {name:?}: data_offsets end {end} is past the data buffer ({data_len} bytes; file truncated?)"
            ));
        }
        tensors.insert(name.clone(), TensorInfo { dtype, shape, begin, end });
    }
    // Offsets must tile the buffer: sorted by begin, each starts where the last ended.
    let mut spans: Vec<(usize, usize, &str)> = tensors.iter().map(|(n, t)| (t.begin, t.end, n.as_str())).collect();
    spans.sort();
    let mut cursor = 0;
    for (b, e, name) in spans {
        if b != cursor {
            return Err(format!(
                "tensor {name:?} starts at {b}, expected {cursor}: data_offsets must be contiguous, without gaps or overlaps"
            ));
        }
        cursor = e;
    }
    if cursor != data_len {
        return Err(format!("data buffer is {data_len} bytes but the tensors cover {cursor}"));
    }
    Ok(Header { tensors, metadata, data_start: header_end })
}

/// One safetensors file, validated, with zero-copy access to its tensors.
pub struct SafetensorsFile {
    path: PathBuf,
    mmap: Backing,
    header: Header,
}

impl SafetensorsFile {
    pub fn open(path: &Path) -> Result<Self> {
        let err = |msg: String| SafetensorsError { path: path.to_owned(), msg };
        let file = File::open(path).map_err(|e| err(format!("cannot open: {e}")))?;
        // SAFETY: the map is read-only and private to this process. The one hazard of
        // mmap is another process truncating or rewriting the file while it is mapped;
        // model files are not modified in place by any tool we know of (HF writes new
        // blobs and renames), and a validated header means we never index out of range.
        let mmap = unsafe { super::Mapping::map(&file) }.map_err(|e| err(format!("cannot mmap: {e}")))?;
        let header = parse_header(&mmap.0).map_err(err)?;
        Ok(SafetensorsFile { path: path.to_owned(), mmap: Backing::Mapped(mmap), header })
    }

    /// A file image already in memory; `name` stands in for the path in messages.
    pub fn from_bytes(name: &str, bytes: Vec<u8>) -> Result<Self> {
        let header = parse_header(&bytes).map_err(|msg| SafetensorsError { path: name.into(), msg })?;
        Ok(SafetensorsFile { path: name.into(), mmap: Backing::Owned(bytes), header })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.header.metadata
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.header.tensors.keys().map(String::as_str)
    }

    pub fn get(&self, name: &str) -> Option<TensorView<'_>> {
        let (name, t) = self.header.tensors.get_key_value(name)?;
        let start = self.header.data_start + t.begin;
        let end = self.header.data_start + t.end;
        Some(TensorView { name, dtype: t.dtype, shape: &t.shape, bytes: &self.mmap[start..end] })
    }
}

/// A tensor to write: name, dtype, shape and little-endian bytes.
#[derive(Clone)]
pub struct OwnedTensor {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub bytes: Vec<u8>,
}

impl OwnedTensor {
    pub fn f32(name: &str, shape: Vec<usize>, data: &[f32]) -> Self {
        OwnedTensor {
            name: name.into(),
            dtype: Dtype::F32,
            shape,
            bytes: data.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }
}

/// Serialize tensors (in the given order) with optional metadata.
pub fn serialize(tensors: &[OwnedTensor], metadata: &BTreeMap<String, String>) -> Vec<u8> {
    let mut header = serde_json::Map::new();
    if !metadata.is_empty() {
        header.insert("__metadata__".into(), serde_json::to_value(metadata).expect("string map"));
    }
    let mut offset = 0usize;
    for t in tensors {
        let end = offset + t.bytes.len();
        header.insert(
            t.name.clone(),
            serde_json::json!({"dtype": t.dtype.name(), "shape": t.shape, "data_offsets": [offset, end]}),
        );
        offset = end;
    }
    let mut json = serde_json::to_string(&header).expect("serializable").into_bytes();
    // Pad the header with spaces so the data buffer is 8-byte aligned, as the reference writer does.
    while !(8 + json.len()).is_multiple_of(8) {
        json.push(b' ');
    }
    let mut out = Vec::with_capacity(8 + json.len() + offset);
    out.extend_from_slice(&(json.len() as u64).to_le_bytes());
    out.extend_from_slice(&json);
    for t in tensors {
        out.extend_from_slice(&t.bytes);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file_with(header: &str, data_len: usize) -> Vec<u8> {
        let mut v = (header.len() as u64).to_le_bytes().to_vec();
        v.extend_from_slice(header.as_bytes());
        v.extend(std::iter::repeat_n(0u8, data_len));
        v
    }

    #[test]
    fn round_trips_and_accepts_unaligned_data() {
        let t =
            vec![OwnedTensor::f32("a", vec![2, 3], &[1., 2., 3., 4., 5., 6.]), OwnedTensor::f32("b", vec![1], &[7.])];
        let bytes = serialize(&t, &BTreeMap::new());
        let h = parse_header(&bytes).unwrap();
        assert_eq!(h.tensors["a"].shape, [2, 3]);
        let back = SafetensorsFile::from_bytes("t", bytes).unwrap();
        assert_eq!(back.get("a").unwrap().to_f32().unwrap(), [1., 2., 3., 4., 5., 6.]);
        // An unpadded header leaves the data at an odd offset: the values still read back.
        let header = r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"y":{"dtype":"F16","shape":[1],"data_offsets":[8,10]}} "#;
        let mut odd = (header.len() as u64).to_le_bytes().to_vec();
        odd.extend_from_slice(header.as_bytes());
        odd.extend_from_slice(&1.5f32.to_le_bytes());
        odd.extend_from_slice(&(-2.25f32).to_le_bytes());
        odd.extend_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        let file = SafetensorsFile::from_bytes("odd", odd).unwrap();
        let x = file.get("x").unwrap();
        assert_eq!((x.bytes.as_ptr() as usize - file.mmap.as_ptr() as usize) % 4, (8 + header.len()) % 4);
        assert_ne!((8 + header.len()) % 4, 0, "the data must start unaligned for this test");
        assert_eq!(x.to_f32().unwrap(), [1.5, -2.25]);
        assert_eq!(file.get("y").unwrap().to_f32().unwrap(), [0.5]);
    }

    #[test]
    fn rejects_malformed_headers() {
        let cases: &[(&[u8], &str)] = &[
            (&[1, 2, 3], "too short"),
            (&u64::MAX.to_le_bytes(), "exceeds"),
            (&file_with("{", 0), "not valid JSON"),
            (&file_with("[]", 0), "not a JSON object"),
            (&file_with(r#"{"x":{"dtype":"F33","shape":[1],"data_offsets":[0,4]}}"#, 4), "unknown dtype"),
            (&file_with(r#"{"x":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#, 4), "needs 8 bytes"),
            (&file_with(r#"{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#, 2), "past the data buffer"),
            (&file_with(r#"{"x":{"dtype":"F32","shape":[1],"data_offsets":[4,0]}}"#, 4), "invalid data_offsets"),
            (
                &file_with(
                    r#"{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"y":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
                    4,
                ),
                "contiguous",
            ),
            (&file_with(r#"{"x":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#, 8), "cover 4"),
            (
                &file_with(r#"{"x":{"dtype":"F32","shape":[4294967296,4294967296,16],"data_offsets":[0,4]}}"#, 4),
                "overflows",
            ),
        ];
        for (bytes, want) in cases {
            let err = parse_header(bytes).unwrap_err();
            assert!(err.contains(want), "{err:?} should mention {want:?}");
        }
    }
}

//! GGUF writer (format version 3): the layout [`super::gguf`] reads, written as ggml's
//! `gguf_write` writes it, so that a file copied key by key and tensor by tensor comes
//! out byte-identical to llama.cpp's.
//!
//! The header (metadata in order, then the tensor table with each tensor's offset) is
//! written first and padded to the alignment; each tensor's bytes follow in table order,
//! each padded with zeros to the alignment (the last one too). Tensor data is streamed:
//! only one tensor need be in memory at a time.

use std::io::{Read, Write};

use super::gguf::{DEFAULT_ALIGNMENT, GgmlType, MAX_DIMS, MetaValue};

/// Why a GGUF file could not be written.
#[derive(Debug, thiserror::Error)]
pub enum GgufWriteError {
    /// The plan cannot be written: a tensor added twice or not whole blocks, a metadata
    /// value the format cannot hold, sizes that overflow.
    #[error("{0}")]
    Plan(String),
    /// Tensors written against the plan: one too many, too few, or of the wrong size.
    #[error("{0}")]
    Order(String),
    /// (The cause is in the message, not `source()`: printing the chain would repeat it.)
    #[error("writing the GGUF file: {0}")]
    Io(std::io::Error),
}

impl From<std::io::Error> for GgufWriteError {
    fn from(e: std::io::Error) -> Self {
        GgufWriteError::Io(e)
    }
}

type Result<T> = std::result::Result<T, GgufWriteError>;

/// The largest `general.alignment` written (ggml uses 32; a larger one only pads).
pub const MAX_ALIGNMENT: u32 = 1 << 20;

/// One planned tensor: name, ggml dims (`dims[0]` innermost) and type.
#[derive(Clone, Debug, PartialEq)]
pub struct PlannedTensor {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
}

impl PlannedTensor {
    /// Bytes of data, or `None` if the shape does not fit the type's blocks or overflows.
    pub fn n_bytes(&self) -> Option<u64> {
        let n = self.dims.iter().try_fold(1u64, |n, &d| n.checked_mul(d))?;
        self.ty.bytes_for(n)
    }
}

/// A file's metadata and tensor table, built before any data is written.
#[derive(Clone, Debug, Default)]
pub struct GgufPlan {
    metadata: Vec<(String, MetaValue)>,
    tensors: Vec<PlannedTensor>,
}

impl GgufPlan {
    /// Set `key`, as ggml's `gguf_set_val_*`: an existing entry is removed and the new one
    /// goes last.
    pub fn set(&mut self, key: &str, value: MetaValue) {
        self.remove(key);
        self.metadata.push((key.to_owned(), value));
    }

    pub fn remove(&mut self, key: &str) {
        self.metadata.retain(|(k, _)| k != key);
    }

    pub fn metadata(&self) -> &[(String, MetaValue)] {
        &self.metadata
    }

    pub fn tensors(&self) -> &[PlannedTensor] {
        &self.tensors
    }

    /// Add a tensor to the table (written in the order added).
    pub fn add_tensor(&mut self, name: &str, dims: &[u64], ty: GgmlType) -> Result<()> {
        if self.tensors.iter().any(|t| t.name == name) {
            return Err(GgufWriteError::Plan(format!("tensor {name:?} added twice")));
        }
        if dims.is_empty() || dims.len() > MAX_DIMS {
            return Err(GgufWriteError::Plan(format!("tensor {name:?} has {} dims (1 to {MAX_DIMS})", dims.len())));
        }
        let t = PlannedTensor { name: name.to_owned(), dims: dims.to_vec(), ty };
        if t.n_bytes().is_none() {
            let message = format!("tensor {name:?} of shape {dims:?} is not whole {} blocks", ty.name());
            return Err(GgufWriteError::Plan(message));
        }
        self.tensors.push(t);
        Ok(())
    }

    /// The alignment the file will use: `general.alignment` if set (a power-of-two u32).
    pub fn alignment(&self) -> Result<u64> {
        match self.metadata.iter().find(|(k, _)| k == "general.alignment") {
            None => Ok(DEFAULT_ALIGNMENT),
            Some((_, MetaValue::U32(a))) if a.is_power_of_two() && *a <= MAX_ALIGNMENT => Ok(u64::from(*a)),
            Some((_, v)) => {
                let message =
                    format!("general.alignment must be a power-of-two u32 of at most {MAX_ALIGNMENT}, got {v:?}");
                Err(GgufWriteError::Plan(message))
            }
        }
    }

    /// The header bytes, padded to the alignment.
    pub fn header(&self) -> Result<Vec<u8>> {
        let align = self.alignment()?;
        let mut b = b"GGUF".to_vec();
        b.extend(3u32.to_le_bytes());
        b.extend((self.tensors.len() as u64).to_le_bytes());
        b.extend((self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            check_array(k, v)?;
            string(&mut b, k);
            b.extend(type_id(v).to_le_bytes());
            value(&mut b, v);
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            string(&mut b, &t.name);
            b.extend((t.dims.len() as u32).to_le_bytes());
            t.dims.iter().for_each(|d| b.extend(d.to_le_bytes()));
            b.extend(t.ty.id().to_le_bytes());
            b.extend(offset.to_le_bytes());
            let padded = t.n_bytes().and_then(|n| n.checked_next_multiple_of(align));
            offset = padded
                .and_then(|n| offset.checked_add(n))
                .ok_or_else(|| GgufWriteError::Plan("tensor data overflows u64".into()))?;
        }
        b.resize(b.len().next_multiple_of(align as usize), 0);
        Ok(b)
    }
}

/// An array's elements must all be of its declared element type.
fn check_array(key: &str, v: &MetaValue) -> Result<()> {
    if let MetaValue::Array(elem, items) = v {
        for item in items {
            if type_id(item) != *elem {
                return Err(GgufWriteError::Plan(format!("{key}: array of type {elem} holds a {}", item.type_name())));
            }
            check_array(key, item)?;
        }
    }
    Ok(())
}

/// GGUF's type code for a value.
fn type_id(v: &MetaValue) -> u32 {
    match v {
        MetaValue::U8(_) => 0,
        MetaValue::I8(_) => 1,
        MetaValue::U16(_) => 2,
        MetaValue::I16(_) => 3,
        MetaValue::U32(_) => 4,
        MetaValue::I32(_) => 5,
        MetaValue::F32(_) => 6,
        MetaValue::Bool(_) => 7,
        MetaValue::String(_) => 8,
        MetaValue::Array(..) => 9,
        MetaValue::U64(_) => 10,
        MetaValue::I64(_) => 11,
        MetaValue::F64(_) => 12,
    }
}

fn string(b: &mut Vec<u8>, s: &str) {
    b.extend((s.len() as u64).to_le_bytes());
    b.extend(s.as_bytes());
}

fn value(b: &mut Vec<u8>, v: &MetaValue) {
    match v {
        MetaValue::U8(x) => b.push(*x),
        MetaValue::I8(x) => b.extend(x.to_le_bytes()),
        MetaValue::U16(x) => b.extend(x.to_le_bytes()),
        MetaValue::I16(x) => b.extend(x.to_le_bytes()),
        MetaValue::U32(x) => b.extend(x.to_le_bytes()),
        MetaValue::I32(x) => b.extend(x.to_le_bytes()),
        MetaValue::F32(x) => b.extend(x.to_le_bytes()),
        MetaValue::Bool(x) => b.push(u8::from(*x)),
        MetaValue::String(s) => string(b, s),
        MetaValue::Array(elem, items) => {
            b.extend(elem.to_le_bytes());
            b.extend((items.len() as u64).to_le_bytes());
            items.iter().for_each(|i| value(b, i));
        }
        MetaValue::U64(x) => b.extend(x.to_le_bytes()),
        MetaValue::I64(x) => b.extend(x.to_le_bytes()),
        MetaValue::F64(x) => b.extend(x.to_le_bytes()),
    }
}

/// Streams a planned file: the header at once, then each tensor's bytes in table order.
pub struct GgufWriter<W: Write> {
    out: W,
    plan: GgufPlan,
    align: u64,
    next: usize,
}

impl<W: Write> GgufWriter<W> {
    pub fn new(mut out: W, plan: GgufPlan) -> Result<Self> {
        let header = plan.header()?;
        out.write_all(&header)?;
        let align = plan.alignment()?;
        Ok(GgufWriter { out, plan, align, next: 0 })
    }

    /// The next tensor in the table, if any remain.
    pub fn next_tensor(&self) -> Option<&PlannedTensor> {
        self.plan.tensors.get(self.next)
    }

    /// Write the next tensor's bytes (exactly its planned size) and its padding.
    pub fn write_tensor(&mut self, bytes: &[u8]) -> Result<()> {
        let t = self
            .next_tensor()
            .ok_or_else(|| GgufWriteError::Order("every planned tensor is already written".into()))?;
        let want = t.n_bytes().expect("checked when added");
        if bytes.len() as u64 != want {
            return Err(GgufWriteError::Order(format!("tensor {:?}: {} bytes, planned {want}", t.name, bytes.len())));
        }
        self.out.write_all(bytes)?;
        let pad = want.next_multiple_of(self.align) - want;
        std::io::copy(&mut std::io::repeat(0).take(pad), &mut self.out)?;
        self.next += 1;
        Ok(())
    }

    /// Check that every tensor was written and flush.
    pub fn finish(mut self) -> Result<W> {
        if let Some(t) = self.next_tensor() {
            return Err(GgufWriteError::Order(format!("tensor {:?} was planned but not written", t.name)));
        }
        self.out.flush()?;
        Ok(self.out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::loaders::gguf::GgufFile;

    #[test]
    fn round_trips_through_the_reader() {
        let mut plan = GgufPlan::default();
        plan.set("general.architecture", MetaValue::String("llama".into()));
        plan.set("a.u32", MetaValue::U32(7));
        plan.set("a.empty", MetaValue::Array(8, vec![]));
        plan.set("a.nested", MetaValue::Array(9, vec![MetaValue::Array(4, vec![MetaValue::U32(1)])]));
        plan.set("a.u32", MetaValue::U32(8)); // replaced, moves last
        plan.add_tensor("w", &[32, 3], GgmlType::Q8_0).unwrap();
        plan.add_tensor("b", &[5], GgmlType::F32).unwrap();
        assert!(plan.add_tensor("w", &[32], GgmlType::F32).is_err());
        assert!(plan.add_tensor("odd", &[31], GgmlType::Q4_0).is_err());
        let mut bad = GgufPlan::default();
        bad.set("a", MetaValue::Array(4, vec![MetaValue::String("x".into())]));
        assert!(bad.header().unwrap_err().to_string().contains("holds a string"));
        bad.set("a", MetaValue::U32(1));
        bad.set("general.alignment", MetaValue::U32(1 << 31));
        assert!(bad.header().is_err());
        let mut w = GgufWriter::new(Vec::new(), plan).unwrap();
        assert!(w.write_tensor(&[0; 3]).is_err());
        w.write_tensor(&[1; 102]).unwrap();
        assert_eq!(w.next_tensor().unwrap().name, "b");
        w.write_tensor(&[2; 20]).unwrap();
        let bytes = w.finish().unwrap();
        let f = GgufFile::from_bytes("mem", bytes).unwrap();
        let keys: Vec<_> = f.metadata().iter().map(|(k, _)| k.as_str()).collect();
        assert_eq!(keys, ["general.architecture", "a.empty", "a.nested", "a.u32"]);
        assert_eq!(f.get("a.u32"), Some(&MetaValue::U32(8)));
        assert_eq!(f.get("a.empty"), Some(&MetaValue::Array(8, vec![])));
        assert_eq!(f.tensor("w").unwrap().bytes, &[1; 102][..]);
        assert_eq!(f.tensor("b").unwrap().bytes, &[2; 20][..]);
        assert_eq!(f.tensor("b").unwrap().info.offset, 128);
    }
}

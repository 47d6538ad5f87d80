//! The ground floor: the element and block types of tensors, and a borrowed tensor.
//! Loaders, backends, models and the CLI all speak these types; none of them is owned
//! by a file format.
//!
//! - [`Dtype`]: element types of safetensors files (and of plain GGUF tensors).
//! - [`GgmlType`]: ggml's tensor types, plain and block-quantized, with their geometry.
//! - [`TensorView`]: a tensor's dtype, shape and little-endian bytes, borrowed.
//! - [`WeightDtype`]: how a fast backend stores dense weights.
//! - [`KvDtype`]: how a backend stores keys and values.
//! - [`mapping`]: the file mappings tensors borrow from, and [`release`].

pub mod mapping;

pub use mapping::release;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dtype {
    Bool,
    U8,
    I8,
    F8E5M2,
    F8E4M3,
    I16,
    U16,
    F16,
    BF16,
    I32,
    U32,
    F32,
    F64,
    I64,
    U64,
}

impl Dtype {
    pub fn parse(s: &str) -> Option<Dtype> {
        use Dtype::*;
        Some(match s {
            "BOOL" => Bool,
            "U8" => U8,
            "I8" => I8,
            "F8_E5M2" => F8E5M2,
            "F8_E4M3" => F8E4M3,
            "I16" => I16,
            "U16" => U16,
            "F16" => F16,
            "BF16" => BF16,
            "I32" => I32,
            "U32" => U32,
            "F32" => F32,
            "F64" => F64,
            "I64" => I64,
            "U64" => U64,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        use Dtype::*;
        match self {
            Bool => "BOOL",
            U8 => "U8",
            I8 => "I8",
            F8E5M2 => "F8_E5M2",
            F8E4M3 => "F8_E4M3",
            I16 => "I16",
            U16 => "U16",
            F16 => "F16",
            BF16 => "BF16",
            I32 => "I32",
            U32 => "U32",
            F32 => "F32",
            F64 => "F64",
            I64 => "I64",
            U64 => "U64",
        }
    }

    pub fn size(self) -> usize {
        use Dtype::*;
        match self {
            Bool | U8 | I8 | F8E5M2 | F8E4M3 => 1,
            I16 | U16 | F16 | BF16 => 2,
            I32 | U32 | F32 => 4,
            F64 | I64 | U64 => 8,
        }
    }
}

/// A borrowed tensor: dtype, shape and its little-endian bytes (any alignment).
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    pub name: &'a str,
    pub dtype: Dtype,
    pub shape: &'a [usize],
    pub bytes: &'a [u8],
}

impl TensorView<'_> {
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// Convert F32/F16/BF16 data to f32.
    pub fn to_f32(&self) -> std::result::Result<Vec<f32>, String> {
        let b = self.bytes;
        Ok(match self.dtype {
            Dtype::F32 => b.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().expect("4"))).collect(),
            Dtype::F16 => {
                b.chunks_exact(2).map(|c| half::f16::from_le_bytes(c.try_into().expect("2")).to_f32()).collect()
            }
            Dtype::BF16 => {
                b.chunks_exact(2).map(|c| half::bf16::from_le_bytes(c.try_into().expect("2")).to_f32()).collect()
            }
            other => {
                return Err(format!("tensor {:?} has dtype {}, expected F32, F16 or BF16", self.name, other.name()));
            }
        })
    }

    /// Convert integer data to i64.
    pub fn to_i64(&self) -> std::result::Result<Vec<i64>, String> {
        let b = self.bytes;
        Ok(match self.dtype {
            Dtype::I64 => b.chunks_exact(8).map(|c| i64::from_le_bytes(c.try_into().expect("8"))).collect(),
            Dtype::I32 => b.chunks_exact(4).map(|c| i32::from_le_bytes(c.try_into().expect("4")) as i64).collect(),
            other => {
                return Err(format!("tensor {:?} has dtype {}, expected an integer type", self.name, other.name()));
            }
        })
    }
}

/// The ggml tensor types: id, name, and block geometry (elements per block, bytes per
/// block), as gguf-py's `GGML_QUANT_SIZES`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q5_0,
    Q5_1,
    Q8_0,
    Q8_1,
    Q2K,
    Q3K,
    Q4K,
    Q5K,
    Q6K,
    Q8K,
    Iq2Xxs,
    Iq2Xs,
    Iq3Xxs,
    Iq1S,
    Iq4Nl,
    Iq3S,
    Iq2S,
    Iq4Xs,
    I8,
    I16,
    I32,
    I64,
    F64,
    Iq1M,
    BF16,
    Tq1_0,
    Tq2_0,
    Mxfp4,
    Nvfp4,
    Q1_0,
}

impl GgmlType {
    const ALL: [GgmlType; 34] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2K,
        GgmlType::Q3K,
        GgmlType::Q4K,
        GgmlType::Q5K,
        GgmlType::Q6K,
        GgmlType::Q8K,
        GgmlType::Iq2Xxs,
        GgmlType::Iq2Xs,
        GgmlType::Iq3Xxs,
        GgmlType::Iq1S,
        GgmlType::Iq4Nl,
        GgmlType::Iq3S,
        GgmlType::Iq2S,
        GgmlType::Iq4Xs,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::Iq1M,
        GgmlType::BF16,
        GgmlType::Tq1_0,
        GgmlType::Tq2_0,
        GgmlType::Mxfp4,
        GgmlType::Nvfp4,
        GgmlType::Q1_0,
    ];

    /// (ggml id, name, elements per block, bytes per block).
    fn info(self) -> (u32, &'static str, u64, u64) {
        const QK_K: u64 = 256;
        use GgmlType::*;
        match self {
            F32 => (0, "F32", 1, 4),
            F16 => (1, "F16", 1, 2),
            Q4_0 => (2, "Q4_0", 32, 2 + 16),
            Q4_1 => (3, "Q4_1", 32, 2 + 2 + 16),
            Q5_0 => (6, "Q5_0", 32, 2 + 4 + 16),
            Q5_1 => (7, "Q5_1", 32, 2 + 2 + 4 + 16),
            Q8_0 => (8, "Q8_0", 32, 2 + 32),
            Q8_1 => (9, "Q8_1", 32, 4 + 4 + 32),
            Q2K => (10, "Q2_K", QK_K, 2 + 2 + QK_K / 16 + QK_K / 4),
            Q3K => (11, "Q3_K", QK_K, 2 + QK_K / 4 + QK_K / 8 + 12),
            Q4K => (12, "Q4_K", QK_K, 2 + 2 + QK_K / 2 + 12),
            Q5K => (13, "Q5_K", QK_K, 2 + 2 + QK_K / 2 + QK_K / 8 + 12),
            Q6K => (14, "Q6_K", QK_K, 2 + QK_K / 2 + QK_K / 4 + QK_K / 16),
            Q8K => (15, "Q8_K", QK_K, 4 + QK_K + QK_K / 8),
            Iq2Xxs => (16, "IQ2_XXS", QK_K, 2 + QK_K / 4),
            Iq2Xs => (17, "IQ2_XS", QK_K, 2 + QK_K / 4 + QK_K / 32),
            Iq3Xxs => (18, "IQ3_XXS", QK_K, 2 + QK_K / 4 + QK_K / 8),
            Iq1S => (19, "IQ1_S", QK_K, 2 + QK_K / 8 + QK_K / 16),
            Iq4Nl => (20, "IQ4_NL", 32, 2 + 16),
            Iq3S => (21, "IQ3_S", QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4),
            Iq2S => (22, "IQ2_S", QK_K, 2 + QK_K / 4 + QK_K / 16),
            Iq4Xs => (23, "IQ4_XS", QK_K, 2 + 2 + QK_K / 2 + QK_K / 64),
            I8 => (24, "I8", 1, 1),
            I16 => (25, "I16", 1, 2),
            I32 => (26, "I32", 1, 4),
            I64 => (27, "I64", 1, 8),
            F64 => (28, "F64", 1, 8),
            Iq1M => (29, "IQ1_M", QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32),
            BF16 => (30, "BF16", 1, 2),
            Tq1_0 => (34, "TQ1_0", QK_K, 2 + 4 * 13),
            Tq2_0 => (35, "TQ2_0", QK_K, 2 + 64),
            Mxfp4 => (39, "MXFP4", 32, 1 + 16),
            Nvfp4 => (40, "NVFP4", 64, 4 + 32),
            Q1_0 => (41, "Q1_0", 128, 2 + 16),
        }
    }

    pub fn from_id(id: u32) -> Option<GgmlType> {
        Self::ALL.into_iter().find(|t| t.info().0 == id)
    }

    pub fn id(self) -> u32 {
        self.info().0
    }

    pub fn name(self) -> &'static str {
        self.info().1
    }

    /// Elements per block (1 for plain types).
    pub fn block_size(self) -> u64 {
        self.info().2
    }

    /// Bytes per block.
    pub fn type_size(self) -> u64 {
        self.info().3
    }

    /// Bytes of `n_elements` values, or `None` when `n_elements` is not a whole number of
    /// blocks or the size overflows.
    pub fn bytes_for(self, n_elements: u64) -> Option<u64> {
        if !n_elements.is_multiple_of(self.block_size()) {
            return None;
        }
        (n_elements / self.block_size()).checked_mul(self.type_size())
    }
}

/// How the fast backends store weights in memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightDtype {
    F32,
    F16,
    BF16,
}

impl WeightDtype {
    pub fn name(self) -> &'static str {
        match self {
            WeightDtype::F32 => "f32",
            WeightDtype::F16 => "f16",
            WeightDtype::BF16 => "bf16",
        }
    }

    pub fn size(self) -> usize {
        match self {
            WeightDtype::F32 => 4,
            WeightDtype::F16 | WeightDtype::BF16 => 2,
        }
    }
}

/// How a backend stores the keys and values of its KV caches (`--kv-dtype`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum KvDtype {
    #[default]
    F32,
    F16,
}

impl KvDtype {
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
        }
    }

    /// Bytes per value.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 => 2,
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;

    /// `f32` or `f16` (the CLI's `--kv-dtype`).
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "f32" => Ok(KvDtype::F32),
            "f16" => Ok(KvDtype::F16),
            _ => Err(format!("{s:?} is not a KV dtype (use f32 or f16)")),
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

//! A model's tensors, whichever file holds them: safetensors (one file or shards) or
//! GGUF. Models ask for tensors by name and get row-major shapes (`[out, in]` for a
//! linear layer). Float tensors (safetensors, GGUF F32/F16/BF16) are borrowed from the
//! mapped file; block-quantized GGUF tensors stay in their blocks, for the backend to
//! keep ([`crate::backend::Backend::load_quantized`]) or decode
//! ([`crate::quant::dequantize`], bit-exact to gguf-py).

use std::borrow::Cow;
use std::path::PathBuf;

use super::WeightStore;
use super::gguf::{GgmlType, GgufError, GgufFile};
use super::safetensors::{Dtype, SafetensorsError, TensorView};
use crate::backend::{Backend, BackendError, MatrixLayout};

/// Why a model's weights could not be had: a file that cannot be read, a tensor that is
/// missing, misshapen or undecodable, a model form this engine does not run, or a backend
/// that could not take a tensor.
#[derive(Debug, thiserror::Error)]
pub enum WeightError {
    #[error(transparent)]
    Safetensors(#[from] SafetensorsError),
    #[error(transparent)]
    Gguf(#[from] GgufError),
    /// A file around the tensors: a shard index, a folder without weights.
    #[error("{}: {message}", path.display())]
    File { path: PathBuf, message: String },
    #[error("tensor {name:?} is missing from the checkpoint")]
    Missing { name: String },
    #[error("tensor {name:?} has shape {got:?}, expected {expected}")]
    Shape { name: String, got: Vec<usize>, expected: String },
    /// A tensor whose type or bytes cannot give the values asked for.
    #[error("tensor {name:?}: {message}")]
    Tensor { name: String, message: String },
    /// Weights of a form the architecture does not run (an untied head where it must be tied).
    #[error("{0}")]
    Unsupported(String),
    /// The configuration the weights are loaded for does not hold together.
    #[error("invalid {architecture} config: {message}")]
    Config { architecture: &'static str, message: String },
    #[error(transparent)]
    Backend(#[from] BackendError),
}

impl WeightError {
    fn tensor(name: &str, message: impl Into<String>) -> Self {
        WeightError::Tensor { name: name.to_owned(), message: message.into() }
    }
}

pub enum Weights {
    Safetensors(WeightStore),
    Gguf(GgufFile),
}

/// A tensor's bytes: floats, or GGUF blocks of one quantized type.
pub enum TensorData<'a> {
    Float { dtype: Dtype, bytes: Cow<'a, [u8]> },
    Quantized { ty: GgmlType, bytes: Cow<'a, [u8]> },
}

/// One tensor, borrowed from its file or assembled in memory.
pub struct Tensor<'a> {
    pub name: String,
    /// Row-major: the last dimension is contiguous (GGUF's `ne` reversed).
    pub shape: Vec<usize>,
    pub data: TensorData<'a>,
}

impl Tensor<'_> {
    /// The tensor as floats: quantized blocks are decoded to f32.
    pub fn to_float(&self) -> Result<Tensor<'_>, WeightError> {
        let data = match &self.data {
            TensorData::Float { dtype, bytes } => TensorData::Float { dtype: *dtype, bytes: Cow::Borrowed(bytes) },
            TensorData::Quantized { ty, bytes } => {
                let values = crate::quant::dequantize(*ty, bytes)
                    .map_err(|e| WeightError::tensor(&self.name, format!("{}: {e}", ty.name())))?;
                if values.len() != self.shape.iter().product::<usize>() {
                    let message = format!("{} values decoded for shape {:?}", values.len(), self.shape);
                    return Err(WeightError::tensor(&self.name, message));
                }
                TensorData::Float {
                    dtype: Dtype::F32,
                    bytes: Cow::Owned(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
                }
            }
        };
        Ok(Tensor { name: self.name.clone(), shape: self.shape.clone(), data })
    }

    /// A view for [`Backend::load_matrix`]/[`Backend::load_vector`]; quantized tensors
    /// must go through [`Tensor::to_float`] or [`load_matrix`] first.
    pub fn view(&self) -> Result<TensorView<'_>, WeightError> {
        match &self.data {
            TensorData::Float { dtype, bytes } => {
                Ok(TensorView { name: &self.name, dtype: *dtype, shape: &self.shape, bytes })
            }
            TensorData::Quantized { ty, .. } => {
                Err(WeightError::tensor(&self.name, format!("{}-quantized, not floats", ty.name())))
            }
        }
    }

    /// The values as f32, whatever the tensor's type (quantized blocks decoded).
    pub fn to_f32(&self) -> Result<Vec<f32>, WeightError> {
        self.to_float()?.view()?.to_f32().map_err(|e| WeightError::tensor(&self.name, e))
    }
}

impl Weights {
    /// The tensor called `name`, if the file has it.
    pub fn get(&self, name: &str) -> Result<Option<Tensor<'_>>, WeightError> {
        let tensor = self.get_quietly(name)?;
        if let Some(t) = &tensor {
            super::progress::advance(
                name,
                match &t.data {
                    TensorData::Float { bytes, .. } | TensorData::Quantized { bytes, .. } => bytes.len(),
                },
            );
        }
        Ok(tensor)
    }

    fn get_quietly(&self, name: &str) -> Result<Option<Tensor<'_>>, WeightError> {
        match self {
            Weights::Safetensors(store) => Ok(store.get(name).map(|t| Tensor {
                name: name.to_owned(),
                shape: t.shape.to_vec(),
                data: TensorData::Float { dtype: t.dtype, bytes: Cow::Borrowed(t.bytes) },
            })),
            Weights::Gguf(file) => {
                let Some(t) = file.tensor(name) else { return Ok(None) };
                let shape = t
                    .info
                    .dims
                    .iter()
                    .rev()
                    .map(|&d| usize::try_from(d))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|_| WeightError::tensor(name, "a dimension does not fit in memory"))?;
                let bytes = Cow::Borrowed(t.bytes);
                let data = match t.info.ggml_type {
                    GgmlType::F32 => TensorData::Float { dtype: Dtype::F32, bytes },
                    GgmlType::F16 => TensorData::Float { dtype: Dtype::F16, bytes },
                    GgmlType::BF16 => TensorData::Float { dtype: Dtype::BF16, bytes },
                    ty if crate::quant::SUPPORTED.contains(&ty) => TensorData::Quantized { ty, bytes },
                    ty => {
                        let message = format!("type {}, which this engine cannot decode", ty.name());
                        return Err(WeightError::tensor(name, message));
                    }
                };
                Ok(Some(Tensor { name: name.to_owned(), shape, data }))
            }
        }
    }

    /// A progress bar over every tensor's bytes, advanced by [`Weights::get`] until the
    /// returned guard is dropped (drawn only when stderr is a terminal).
    pub fn show_progress(&self, path: &std::path::Path) -> super::progress::LoadProgress {
        let total: usize = match self {
            Weights::Safetensors(store) => store.tensors().map(|t| t.bytes.len()).sum(),
            Weights::Gguf(file) => {
                file.tensor_infos().iter().filter_map(|i| file.tensor(&i.name)).map(|t| t.bytes.len()).sum()
            }
        };
        let name = path.file_name().map_or_else(|| path.display().to_string(), |n| n.to_string_lossy().into_owned());
        super::progress::start(&name, total as u64)
    }

    /// [`Weights::get`] for a tensor that must exist with this shape.
    pub fn require(&self, name: &str, shape: &[usize]) -> Result<Tensor<'_>, WeightError> {
        let t = self.get(name)?.ok_or_else(|| WeightError::Missing { name: name.to_owned() })?;
        if t.shape != shape {
            let expected = format!("{shape:?} for this config");
            return Err(WeightError::Shape { name: name.to_owned(), got: t.shape, expected });
        }
        Ok(t)
    }
}

/// Load an `[out, in]` tensor as an [`MatrixLayout::OutIn`] matrix: quantized blocks go to
/// [`Backend::load_quantized`], floats to [`Backend::load_matrix`].
pub fn load_matrix<B: Backend>(backend: &B, t: &Tensor) -> Result<B::Matrix, WeightError> {
    let &[n_out, n_in] = &t.shape[..] else {
        return Err(WeightError::Shape { name: t.name.clone(), got: t.shape.clone(), expected: "2 dims".into() });
    };
    match &t.data {
        TensorData::Quantized { ty, bytes } => Ok(backend.load_quantized(&t.name, *ty, n_out, n_in, bytes)?),
        TensorData::Float { .. } => Ok(backend.load_matrix(&t.view()?, MatrixLayout::OutIn)?),
    }
}

/// Load a 1-D tensor with [`Backend::load_vector`], quantized blocks decoded first.
pub fn load_vector<B: Backend>(backend: &B, t: &Tensor) -> Result<B::Vector, WeightError> {
    Ok(backend.load_vector(&t.to_float()?.view()?)?)
}

/// Matrices stacked along their rows (`[out, in]` layers that share an input, such as
/// q | k | v): one matrix, so the backend runs one matmul instead of three. Rows are
/// independent in every format, so bytes are joined as they are when all parts share a
/// type (quantized blocks stay quantized); a mix of Q8_0, Q5_0 and Q4_0 becomes Q8_0 blocks
/// of exactly the same values; other mixed types are decoded to f32 first.
pub fn concat_rows(name: &str, parts: &[Tensor]) -> Result<Tensor<'static>, WeightError> {
    let Some(first) = parts.first() else { return Err(WeightError::tensor(name, "nothing to join")) };
    let shape_error =
        |p: &Tensor, expected: String| WeightError::Shape { name: p.name.clone(), got: p.shape.clone(), expected };
    let cols = match first.shape[..] {
        [_, cols] => cols,
        _ => return Err(shape_error(first, format!("2 dims, to join into {name}"))),
    };
    let mut rows = 0usize;
    for p in parts {
        if p.shape.len() != 2 || p.shape[1] != cols {
            return Err(shape_error(p, format!("[_, {cols}], to join into {name}")));
        }
        rows = rows.checked_add(p.shape[0]).ok_or_else(|| WeightError::tensor(name, "row count overflows"))?;
    }
    let join = |parts: &[&[u8]]| -> Cow<'static, [u8]> { Cow::Owned(parts.concat()) };
    let kind = |t: &Tensor| match &t.data {
        TensorData::Float { dtype, .. } => (Some(*dtype), None),
        TensorData::Quantized { ty, .. } => (None, Some(*ty)),
    };
    let data = if parts.iter().all(|p| kind(p) == kind(first)) {
        let bytes: Vec<&[u8]> = parts
            .iter()
            .map(|p| match &p.data {
                TensorData::Float { bytes, .. } | TensorData::Quantized { bytes, .. } => bytes.as_ref(),
            })
            .collect();
        let joined = match &first.data {
            TensorData::Float { dtype, .. } => TensorData::Float { dtype: *dtype, bytes: join(&bytes) },
            TensorData::Quantized { ty, .. } => TensorData::Quantized { ty: *ty, bytes: join(&bytes) },
        };
        // The parts now live in the joined copy: their file pages can go (see `release`).
        bytes.iter().for_each(|b| super::release(b));
        joined
    } else if let Some(blocks) = parts
        .iter()
        .map(|p| match &p.data {
            TensorData::Quantized { ty, bytes } => crate::quant::to_q8_0(*ty, bytes),
            TensorData::Float { .. } => None,
        })
        .collect::<Option<Vec<_>>>()
    {
        // Mixed Q8_0 / Q5_0 / Q4_0 (Gemma's q, k in Q5_0 and v in Q8_0): every part as
        // Q8_0 blocks of exactly the same values, so the matrix stays quantized.
        let blocks = blocks.into_iter().collect::<Result<Vec<_>, _>>().map_err(|e| WeightError::tensor(name, e))?;
        TensorData::Quantized { ty: GgmlType::Q8_0, bytes: Cow::Owned(blocks.concat()) }
    } else {
        let mut out = Vec::new();
        for p in parts {
            let values = p.to_f32()?;
            out.extend(values.iter().flat_map(|v| v.to_le_bytes()));
        }
        TensorData::Float { dtype: Dtype::F32, bytes: Cow::Owned(out) }
    };
    Ok(Tensor { name: name.to_owned(), shape: vec![rows, cols], data })
}

//! Host tensors: storage precisions, borrowed views and owned data.

use super::size;
use crate::error::{Error, Result};
use half::{bf16, f16};

/// Storage precision of q, k, v and o. Accumulation is always f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Precision {
    /// IEEE single precision.
    F32,
    /// IEEE half: 10 mantissa bits, 5 exponent bits.
    F16,
    /// bfloat16: f32's 8 exponent bits, 7 mantissa bits; from f32 by
    /// round-to-nearest-even (NaN kept NaN).
    Bf16,
}

impl Precision {
    /// Bytes per stored element.
    pub fn bytes(self) -> usize {
        match self {
            Precision::F32 => 4,
            Precision::F16 | Precision::Bf16 => 2,
        }
    }

    /// Spacing of representable numbers just above 1.0 (machine epsilon).
    pub fn epsilon(self) -> f64 {
        match self {
            Precision::F32 => f32::EPSILON as f64,
            Precision::F16 => f16::EPSILON.to_f64(),
            Precision::Bf16 => bf16::EPSILON.to_f64(),
        }
    }

    /// Round an f32 value to this storage precision (identity for f32).
    pub fn round(self, x: f32) -> f32 {
        (self.rounding())(x)
    }

    /// The rounding to this storage precision, as a function (what a
    /// kernel applies to P before `P·V`).
    pub fn rounding(self) -> fn(f32) -> f32 {
        match self {
            Precision::F32 => |x| x,
            Precision::F16 => |x| f16::from_f32(x).to_f32(),
            Precision::Bf16 => |x| bf16::from_f32(x).to_f32(),
        }
    }

    /// `f32`, `f16` or `bf16`, as it parses.
    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::F16 => "f16",
            Precision::Bf16 => "bf16",
        }
    }
}

impl std::fmt::Display for Precision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Precision {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "f32" => Ok(Precision::F32),
            "f16" => Ok(Precision::F16),
            "bf16" => Ok(Precision::Bf16),
            other => Err(Error::UnknownName {
                what: "precision",
                name: other.to_string(),
                expected: "f32, f16 or bf16",
            }),
        }
    }
}

/// Borrowed element data of a host tensor.
#[derive(Clone, Copy, Debug)]
#[non_exhaustive]
pub enum HostData<'a> {
    /// f32 elements.
    F32(&'a [f32]),
    /// f16 elements.
    F16(&'a [f16]),
    /// bf16 elements.
    Bf16(&'a [bf16]),
}

impl<'a> HostData<'a> {
    /// The raw little-endian bytes (what a storage buffer holds).
    pub fn as_bytes(&self) -> &'a [u8] {
        match *self {
            HostData::F32(d) => bytemuck::cast_slice(d),
            HostData::F16(d) => bytemuck::cast_slice(d),
            HostData::Bf16(d) => bytemuck::cast_slice(d),
        }
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        match self {
            HostData::F32(d) => d.len(),
            HostData::F16(d) => d.len(),
            HostData::Bf16(d) => d.len(),
        }
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The element type.
    pub fn precision(&self) -> Precision {
        match self {
            HostData::F32(_) => Precision::F32,
            HostData::F16(_) => Precision::F16,
            HostData::Bf16(_) => Precision::Bf16,
        }
    }

    /// Widen every element to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            HostData::F32(d) => d.to_vec(),
            HostData::F16(d) => d.iter().map(|x| x.to_f32()).collect(),
            HostData::Bf16(d) => d.iter().map(|x| x.to_f32()).collect(),
        }
    }
}

/// A borrowed, row-major, contiguous 4-d tensor `(batch, seqlen, heads, head_dim)`.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    /// `(batch, seq, heads, dim)`.
    pub shape: [usize; 4],
    /// The elements, row-major.
    pub data: HostData<'a>,
}

impl<'a> TensorView<'a> {
    /// An f32 view of `data` with `shape`.
    pub fn f32(shape: [usize; 4], data: &'a [f32]) -> Self {
        Self {
            shape,
            data: HostData::F32(data),
        }
    }

    /// An f16 view of `data` with `shape`.
    pub fn f16(shape: [usize; 4], data: &'a [f16]) -> Self {
        Self {
            shape,
            data: HostData::F16(data),
        }
    }

    /// A bf16 view of `data` with `shape`.
    pub fn bf16(shape: [usize; 4], data: &'a [bf16]) -> Self {
        Self {
            shape,
            data: HostData::Bf16(data),
        }
    }

    /// A packed `(total, heads, dim)` tensor of a varlen call, as the batch
    /// of one the engine sees it as.
    pub fn packed_f32([total, heads, dim]: [usize; 3], data: &'a [f32]) -> Self {
        Self::f32([1, total, heads, dim], data)
    }

    /// [`TensorView::packed_f32`] for f16 data.
    pub fn packed_f16([total, heads, dim]: [usize; 3], data: &'a [f16]) -> Self {
        Self::f16([1, total, heads, dim], data)
    }

    /// [`TensorView::packed_f32`] for bf16 data.
    pub fn packed_bf16([total, heads, dim]: [usize; 3], data: &'a [bf16]) -> Self {
        Self::bf16([1, total, heads, dim], data)
    }

    /// The element type.
    pub fn precision(&self) -> Precision {
        self.data.precision()
    }

    /// The data must hold exactly as many elements as the shape says (a
    /// shape whose element count overflows is [`Error::SizeOverflow`]).
    pub fn check_len(&self, name: &'static str) -> Result<()> {
        let expected = size::elements(name, &self.shape)?;
        if self.data.len() != expected {
            return Err(Error::DataLength {
                tensor: name,
                shape: self.shape.to_vec(),
                expected,
                actual: self.data.len(),
            });
        }
        Ok(())
    }
}

/// Owned element data.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum TensorData {
    /// f32 elements.
    F32(Vec<f32>),
    /// f16 elements.
    F16(Vec<f16>),
    /// bf16 elements.
    Bf16(Vec<bf16>),
}

impl TensorData {
    /// Store f32 values in the given precision (rounding to nearest even
    /// for f16 and bf16).
    pub fn from_f32(values: Vec<f32>, precision: Precision) -> Self {
        match precision {
            Precision::F32 => TensorData::F32(values),
            Precision::F16 => TensorData::F16(values.into_iter().map(f16::from_f32).collect()),
            Precision::Bf16 => TensorData::Bf16(values.into_iter().map(bf16::from_f32).collect()),
        }
    }

    /// Decode the first `n` elements of raw little-endian bytes:
    /// `Error::DataLength` (elements) where `bytes` holds fewer.
    pub fn from_bytes(bytes: &[u8], precision: Precision, n: usize) -> Result<Self> {
        let held = bytes.len() / precision.bytes();
        let Some(bytes) = bytes.get(..n.saturating_mul(precision.bytes())) else {
            return Err(Error::DataLength {
                tensor: "the bytes",
                shape: vec![n],
                expected: n,
                actual: held,
            });
        };
        Ok(match precision {
            Precision::F32 => TensorData::F32(bytemuck::pod_collect_to_vec(bytes)),
            Precision::F16 => TensorData::F16(bytemuck::pod_collect_to_vec(bytes)),
            Precision::Bf16 => TensorData::Bf16(bytemuck::pod_collect_to_vec(bytes)),
        })
    }

    /// The element type.
    pub fn precision(&self) -> Precision {
        match self {
            TensorData::F32(_) => Precision::F32,
            TensorData::F16(_) => Precision::F16,
            TensorData::Bf16(_) => Precision::Bf16,
        }
    }

    /// Elements held.
    pub fn len(&self) -> usize {
        match self {
            TensorData::F32(d) => d.len(),
            TensorData::F16(d) => d.len(),
            TensorData::Bf16(d) => d.len(),
        }
    }

    /// Whether it holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Every element widened to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        self.as_host().to_f32()
    }

    /// A borrowed view of the elements.
    pub fn as_host(&self) -> HostData<'_> {
        match self {
            TensorData::F32(d) => HostData::F32(d),
            TensorData::F16(d) => HostData::F16(d),
            TensorData::Bf16(d) => HostData::Bf16(d),
        }
    }

    /// This data viewed as a 4-d tensor of `shape`.
    pub fn view(&self, shape: [usize; 4]) -> TensorView<'_> {
        TensorView {
            shape,
            data: self.as_host(),
        }
    }
}

/// An owned, row-major tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Its dims.
    pub shape: Vec<usize>,
    /// Its elements, row-major.
    pub data: TensorData,
}

impl Tensor {
    /// The element type.
    pub fn precision(&self) -> Precision {
        self.data.precision()
    }

    /// Every element widened to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        self.data.to_f32()
    }

    /// View a 4-d owned tensor as a [`TensorView`] (a packed 3-d one as
    /// its batch of one).
    pub fn view(&self) -> Result<TensorView<'_>> {
        let dims = match self.shape.as_slice() {
            [t, h, d] => vec![1, *t, *h, *d],
            other => other.to_vec(),
        };
        let shape: [usize; 4] = dims.as_slice().try_into().map_err(|_| Error::Rank {
            tensor: "tensor",
            shape: self.shape.clone(),
            rank: self.shape.len(),
            expected: 4,
        })?;
        Ok(TensorView {
            shape,
            data: self.data.as_host(),
        })
    }
}

//! Host tensors: shapes, storage precisions and the attention problem they define.

use crate::error::{Error, Result};
use half::f16;

/// Largest supported head dimension.
pub const MAX_HEAD_DIM: usize = 256;

/// Storage precision of q, k, v and o. Accumulation is always f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Precision {
    F32,
    F16,
}

impl Precision {
    /// Bytes per stored element.
    pub fn bytes(self) -> usize {
        match self {
            Precision::F32 => 4,
            Precision::F16 => 2,
        }
    }

    /// Spacing of representable numbers just above 1.0 (machine epsilon).
    pub fn epsilon(self) -> f64 {
        match self {
            Precision::F32 => f32::EPSILON as f64,
            Precision::F16 => f16::EPSILON.to_f64(),
        }
    }

    /// Round an f32 value to this storage precision (identity for f32).
    pub fn round(self, x: f32) -> f32 {
        match self {
            Precision::F32 => x,
            Precision::F16 => f16::from_f32(x).to_f32(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Precision::F32 => "f32",
            Precision::F16 => "f16",
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
            other => Err(Error::Dtype(format!(
                "unsupported precision `{other}` (expected f32 or f16)"
            ))),
        }
    }
}

/// Borrowed element data of a host tensor.
#[derive(Clone, Copy, Debug)]
pub enum HostData<'a> {
    F32(&'a [f32]),
    F16(&'a [f16]),
}

impl<'a> HostData<'a> {
    /// The raw little-endian bytes (what a storage buffer holds).
    pub fn as_bytes(&self) -> &'a [u8] {
        match *self {
            HostData::F32(d) => bytemuck::cast_slice(d),
            HostData::F16(d) => bytemuck::cast_slice(d),
        }
    }

    pub fn len(&self) -> usize {
        match self {
            HostData::F32(d) => d.len(),
            HostData::F16(d) => d.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn precision(&self) -> Precision {
        match self {
            HostData::F32(_) => Precision::F32,
            HostData::F16(_) => Precision::F16,
        }
    }

    /// Widen every element to f32.
    pub fn to_f32(&self) -> Vec<f32> {
        match self {
            HostData::F32(d) => d.to_vec(),
            HostData::F16(d) => d.iter().map(|x| x.to_f32()).collect(),
        }
    }
}

/// A borrowed, row-major, contiguous 4-d tensor `(batch, seqlen, heads, head_dim)`.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    pub shape: [usize; 4],
    pub data: HostData<'a>,
}

impl<'a> TensorView<'a> {
    pub fn f32(shape: [usize; 4], data: &'a [f32]) -> Self {
        Self {
            shape,
            data: HostData::F32(data),
        }
    }

    pub fn f16(shape: [usize; 4], data: &'a [f16]) -> Self {
        Self {
            shape,
            data: HostData::F16(data),
        }
    }

    pub fn precision(&self) -> Precision {
        self.data.precision()
    }
}

/// Owned element data.
#[derive(Clone, Debug, PartialEq)]
pub enum TensorData {
    F32(Vec<f32>),
    F16(Vec<f16>),
}

impl TensorData {
    /// Store f32 values in the given precision (rounding for f16).
    pub fn from_f32(values: Vec<f32>, precision: Precision) -> Self {
        match precision {
            Precision::F32 => TensorData::F32(values),
            Precision::F16 => TensorData::F16(values.into_iter().map(f16::from_f32).collect()),
        }
    }

    /// Decode the first `n` elements of raw little-endian bytes.
    pub fn from_bytes(bytes: &[u8], precision: Precision, n: usize) -> Self {
        let bytes = &bytes[..n * precision.bytes()];
        match precision {
            Precision::F32 => TensorData::F32(bytemuck::pod_collect_to_vec(bytes)),
            Precision::F16 => TensorData::F16(bytemuck::pod_collect_to_vec(bytes)),
        }
    }

    pub fn precision(&self) -> Precision {
        match self {
            TensorData::F32(_) => Precision::F32,
            TensorData::F16(_) => Precision::F16,
        }
    }

    pub fn len(&self) -> usize {
        match self {
            TensorData::F32(d) => d.len(),
            TensorData::F16(d) => d.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    pub fn to_f32(&self) -> Vec<f32> {
        self.as_host().to_f32()
    }

    pub fn as_host(&self) -> HostData<'_> {
        match self {
            TensorData::F32(d) => HostData::F32(d),
            TensorData::F16(d) => HostData::F16(d),
        }
    }
}

/// An owned, row-major tensor.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    pub shape: Vec<usize>,
    pub data: TensorData,
}

impl Tensor {
    pub fn precision(&self) -> Precision {
        self.data.precision()
    }

    pub fn to_f32(&self) -> Vec<f32> {
        self.data.to_f32()
    }

    /// View a 4-d owned tensor as a [`TensorView`].
    pub fn view(&self) -> Result<TensorView<'_>> {
        let shape: [usize; 4] = self.shape.as_slice().try_into().map_err(|_| {
            Error::Shape(format!(
                "expected a 4-d tensor, got rank {} {:?}",
                self.shape.len(),
                self.shape
            ))
        })?;
        Ok(TensorView {
            shape,
            data: self.data.as_host(),
        })
    }
}

/// The sizes of one attention call, validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttentionShape {
    pub batch: usize,
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
}

impl AttentionShape {
    /// Check every size rule of SPEC.md, naming the offending values.
    pub fn new(
        batch: usize,
        seqlen_q: usize,
        seqlen_k: usize,
        heads_q: usize,
        heads_kv: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let s = Self {
            batch,
            seqlen_q,
            seqlen_k,
            heads_q,
            heads_kv,
            head_dim,
        };
        s.validate()?;
        Ok(s)
    }

    fn validate(&self) -> Result<()> {
        let fields = [
            ("batch", self.batch),
            ("seqlen_q", self.seqlen_q),
            ("seqlen_k", self.seqlen_k),
            ("heads_q", self.heads_q),
            ("heads_kv", self.heads_kv),
            ("head_dim", self.head_dim),
        ];
        for (name, value) in fields {
            if value == 0 {
                return Err(Error::Shape(format!("{name} must be at least 1, got 0")));
            }
        }
        if self.head_dim > MAX_HEAD_DIM {
            return Err(Error::Shape(format!(
                "head_dim {} is larger than the supported maximum {MAX_HEAD_DIM}",
                self.head_dim
            )));
        }
        if self.heads_q % self.heads_kv != 0 {
            return Err(Error::Shape(format!(
                "heads_q ({}) must be a multiple of heads_kv ({})",
                self.heads_q, self.heads_kv
            )));
        }
        Ok(())
    }

    /// Derive and validate the shape from q, k, v views.
    pub fn from_views(q: &TensorView, k: &TensorView, v: &TensorView) -> Result<Self> {
        for (name, t) in [("q", q), ("k", k), ("v", v)] {
            let expected: usize = t.shape.iter().product();
            if t.data.len() != expected {
                return Err(Error::Shape(format!(
                    "{name} has shape {:?} ({expected} elements) but {} elements of data",
                    t.shape,
                    t.data.len()
                )));
            }
        }
        let [b, sq, hq, d] = q.shape;
        let [bk, sk, hk, dk] = k.shape;
        if k.shape != v.shape {
            return Err(Error::Shape(format!(
                "k and v shapes differ: k {:?}, v {:?}",
                k.shape, v.shape
            )));
        }
        if bk != b {
            return Err(Error::Shape(format!(
                "batch of q ({b}) and k/v ({bk}) differ"
            )));
        }
        if dk != d {
            return Err(Error::Shape(format!(
                "head_dim of q ({d}) and k/v ({dk}) differ"
            )));
        }
        if q.precision() != k.precision() || q.precision() != v.precision() {
            return Err(Error::Dtype(format!(
                "q, k, v must share one dtype, got {}, {}, {}",
                q.precision(),
                k.precision(),
                v.precision()
            )));
        }
        Self::new(b, sq, sk, hq, hk, d)
    }

    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.heads_q / self.heads_kv
    }

    pub fn q_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_q, self.heads_q, self.head_dim]
    }

    pub fn kv_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_k, self.heads_kv, self.head_dim]
    }

    pub fn lse_shape(&self) -> [usize; 3] {
        [self.batch, self.heads_q, self.seqlen_q]
    }

    pub fn q_len(&self) -> usize {
        self.batch * self.seqlen_q * self.heads_q * self.head_dim
    }

    pub fn kv_len(&self) -> usize {
        self.batch * self.seqlen_k * self.heads_kv * self.head_dim
    }

    pub fn lse_len(&self) -> usize {
        self.batch * self.heads_q * self.seqlen_q
    }
}

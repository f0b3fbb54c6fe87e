//! Tensors and options as the Python layer hands them over: a tensor is
//! `(address, shape, dtype)` of contiguous host memory, options a dict.

use flashattn::{
    Alibi, AttentionOptions, BlockMask, Error, HostData, Precision, Result, Sinks, TensorData,
    TensorView, Varlen, Window,
};
use half::{bf16, f16};
use pyo3::FromPyObject;

/// A read-only tensor: `(address, shape, dtype name)`.
#[derive(FromPyObject)]
pub struct Raw(usize, Vec<usize>, String);

/// A tensor the call writes (outputs, caches), same form as [`Raw`].
#[derive(FromPyObject)]
pub struct RawMut(pub Raw);

fn precision(name: &str) -> Result<Precision> {
    match name {
        "float32" => Ok(Precision::F32),
        "float16" => Ok(Precision::F16),
        "bfloat16" => Ok(Precision::Bf16),
        other => Err(unknown_dtype(other)),
    }
}

fn unknown_dtype(name: &str) -> Error {
    Error::UnknownName {
        what: "dtype",
        name: name.to_string(),
        expected: "float32, float16 or bfloat16",
    }
}

/// `n` elements at `ptr` (an empty tensor may have any address; a slice may not).
///
/// # Safety
/// As [`Raw::host`].
unsafe fn elements<'a, T>(ptr: usize, n: usize) -> &'a [T] {
    if n == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(ptr as *const T, n)
    }
}

impl Raw {
    pub fn shape(&self) -> &[usize] {
        &self.1
    }

    fn addr(&self) -> usize {
        self.0
    }

    fn dtype(&self) -> Result<Precision> {
        precision(&self.2)
    }

    fn len(&self) -> Result<usize> {
        self.shape()
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| Error::SizeOverflow {
                what: "a tensor",
                op: "element count",
                operands: self.shape().iter().map(|&d| d as u64).collect(),
                max: usize::MAX as u64,
            })
    }

    /// The elements.
    ///
    /// # Safety
    /// `ptr` is the address of `len()` live, aligned elements of `dtype`,
    /// unchanged by anyone else while the view lives.
    pub unsafe fn host(&self) -> Result<HostData<'_>> {
        let n = self.len()?;
        Ok(match self.dtype()? {
            Precision::F32 => HostData::F32(elements::<f32>(self.addr(), n)),
            Precision::F16 => HostData::F16(elements::<f16>(self.addr(), n)),
            Precision::Bf16 => HostData::Bf16(elements::<bf16>(self.addr(), n)),
            other => return Err(unknown_dtype(other.name())),
        })
    }

    /// A 4-d view, or a packed `(total, heads, dim)` one as its batch of one.
    ///
    /// # Safety
    /// As [`Raw::host`].
    pub unsafe fn view(&self) -> Result<TensorView<'_>> {
        let data = self.host()?;
        let shape = match *self.shape() {
            [b, s, h, d] => [b, s, h, d],
            [t, h, d] => [1, t, h, d],
            _ => {
                return Err(Error::Rank {
                    tensor: "a tensor",
                    shape: self.shape().to_vec(),
                    rank: self.shape().len(),
                    expected: 4,
                })
            }
        };
        Ok(TensorView { shape, data })
    }

    /// The elements of an f32 tensor.
    ///
    /// # Safety
    /// As [`Raw::host`].
    pub unsafe fn f32s(&self, name: &'static str) -> Result<&[f32]> {
        match self.host()? {
            HostData::F32(x) => Ok(x),
            other => Err(Error::DtypeMismatch {
                tensor: name,
                dtype: other.precision().name(),
                like: "the engine",
                expected: "f32",
            }),
        }
    }
}

impl Raw {
    /// The bytes of a one-byte tensor (int8, uint8 or float8_e4m3fn: a
    /// quantized cache's codes).
    ///
    /// # Safety
    /// As [`Raw::host`], for one-byte elements.
    pub unsafe fn codes(&self, name: &'static str) -> Result<&[u8]> {
        match self.2.as_str() {
            "int8" | "uint8" | "float8_e4m3fn" => Ok(elements::<u8>(self.addr(), self.len()?)),
            other => Err(Error::UnknownName {
                what: "code dtype",
                name: format!("{other} ({name})"),
                expected: "int8, uint8 or float8_e4m3fn",
            }),
        }
    }
}

impl RawMut {
    /// The bytes of a one-byte tensor (read), as [`Raw::codes`].
    ///
    /// # Safety
    /// As [`Raw::host`].
    pub unsafe fn codes(&self, name: &'static str) -> Result<&[u8]> {
        self.0.codes(name)
    }

    /// The elements of an f32 tensor (read).
    ///
    /// # Safety
    /// As [`Raw::host`].
    pub unsafe fn f32s(&self, name: &'static str) -> Result<&[f32]> {
        self.0.f32s(name)
    }

    /// Copy `bytes` into a one-byte tensor of exactly that many elements.
    ///
    /// # Safety
    /// As [`RawMut::write`].
    pub unsafe fn write_bytes(&self, bytes: &[u8], name: &'static str) -> Result<()> {
        self.codes(name)?;
        let n = self.0.len()?;
        if n != bytes.len() {
            return Err(Error::DataLength {
                tensor: name,
                shape: self.0.shape().to_vec(),
                expected: bytes.len(),
                actual: n,
            });
        }
        if !bytes.is_empty() {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.0.addr() as *mut u8, n);
        }
        Ok(())
    }
}

impl RawMut {
    /// The elements (read).
    ///
    /// # Safety
    /// As [`Raw::host`].
    pub unsafe fn host(&self) -> Result<HostData<'_>> {
        self.0.host()
    }

    /// Copy `data` into the tensor, whose dtype and size must be `data`'s.
    ///
    /// # Safety
    /// `ptr` is the address of `len()` live, aligned, writable elements of
    /// `dtype` that nothing else reads or writes during the copy.
    pub unsafe fn write(&self, data: &TensorData, name: &'static str) -> Result<()> {
        let dtype = self.0.dtype()?;
        if dtype != data.precision() {
            return Err(Error::DtypeMismatch {
                tensor: name,
                dtype: dtype.name(),
                like: "the result",
                expected: data.precision().name(),
            });
        }
        let n = self.0.len()?;
        if n != data.len() {
            return Err(Error::DataLength {
                tensor: name,
                shape: self.0.shape().to_vec(),
                expected: data.len(),
                actual: n,
            });
        }
        let bytes = data.as_host().as_bytes();
        if !bytes.is_empty() {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), self.0.addr() as *mut u8, bytes.len());
        }
        Ok(())
    }
}

/// The attention options, as a dict with every key present.
#[derive(FromPyObject)]
#[pyo3(from_item_all)]
pub struct Opts {
    causal: bool,
    window: (i64, i64),
    softcap: f32,
    scale: Option<f32>,
    /// `(slopes, shape)`: the slopes row-major with their tensor's shape,
    /// `(heads_q,)` or `(batch, heads_q)` exactly.
    alibi: Option<(Vec<f32>, Vec<usize>)>,
    sinks: Option<Vec<f32>>,
    /// `(bytes, (mb, mh, rows, cols), bm, bn)`.
    block_mask: Option<(Vec<u8>, [usize; 4], usize, usize)>,
    cu_seqlens: Option<(Vec<i32>, Vec<i32>)>,
    /// A shard's global `(q_offset, k_offset)`.
    positions: Option<(usize, usize)>,
    /// Dropout's `(p, seed, offset)`.
    dropout: Option<(f32, u64, u64)>,
}

impl Opts {
    /// The engine's options (validated against the problem by the call).
    pub fn build(&self) -> Result<AttentionOptions> {
        let mut opts = AttentionOptions::default().causal(self.causal);
        opts.window = Window::from_signed(self.window.0, self.window.1);
        // flash-attn's 0.0 is no softcap; any other value goes to the engine's check.
        if self.softcap != 0.0 {
            opts = opts.softcap(self.softcap);
        }
        if let Some(scale) = self.scale {
            opts = opts.scale(scale);
        }
        if let Some((slopes, shape)) = &self.alibi {
            opts = opts.alibi(Alibi::shaped(shape, slopes)?);
        }
        if let Some(sinks) = &self.sinks {
            opts = opts.sinks(Sinks::new(sinks));
        }
        if let Some((data, dims, bm, bn)) = &self.block_mask {
            opts = opts.block_mask(BlockMask::new(*dims, (*bm, *bn), data)?);
        }
        if let Some((q, k)) = &self.cu_seqlens {
            opts.varlen = Some(Varlen::new(q, k)?);
        }
        if let Some((q_offset, k_offset)) = self.positions {
            opts = opts.positions(q_offset, k_offset);
        }
        if let Some((p, seed, offset)) = self.dropout {
            opts = opts.dropout(p).dropout_seed(seed).dropout_offset(offset);
        }
        Ok(opts)
    }
}

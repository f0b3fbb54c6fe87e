//! `.npy` in and out: f32/f16 tensors (bf16 written as f32) and i32 (or i64)
//! index arrays, C order, little-endian. Reading checks the header first
//! ([`header`]): its dtype, order and rank, its element count (checked
//! arithmetic, `flashattn::api::size`) and that the file holds exactly the
//! bytes the shape needs, before the data is read or anything the size of
//! the shape is allocated. Writing (npyz) encodes the bytes; [`crate::outputs`]
//! commits a command's files together.

pub mod header;

use crate::error::{CliError, Result};
use flashattn::api::size;
use flashattn::{CacheQuant, Tensor, TensorData};
use half::f16;
use npyz::WriterBuilder;
use std::fs::File;
use std::io::Read;
use std::path::Path;

/// The element types the command line reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Element {
    F32,
    F16,
    I32,
    I64,
    I8,
    U8,
    Bool,
}

impl Element {
    /// The type of a little-endian (or byte-sized) plain dtype, `None` for
    /// any other (big-endian, structured, or one not read here).
    pub fn of(descr: &str) -> Option<Self> {
        let ty = descr
            .strip_prefix('<')
            .or_else(|| descr.strip_prefix('|'))
            .or_else(|| {
                descr
                    .strip_prefix('=')
                    .filter(|_| cfg!(target_endian = "little"))
            })?;
        Some(match ty {
            "f4" => Element::F32,
            "f2" => Element::F16,
            "i4" => Element::I32,
            "i8" => Element::I64,
            "i1" => Element::I8,
            "u1" => Element::U8,
            "b1" => Element::Bool,
            _ => return None,
        })
    }

    /// numpy's name of the type.
    pub fn numpy_name(self) -> &'static str {
        match self {
            Element::F32 => "float32",
            Element::F16 => "float16",
            Element::I32 => "int32",
            Element::I64 => "int64",
            Element::I8 => "int8",
            Element::U8 => "uint8",
            Element::Bool => "bool",
        }
    }

    pub fn bytes(self) -> u64 {
        match self {
            Element::F32 | Element::I32 => 4,
            Element::F16 => 2,
            Element::I64 => 8,
            Element::I8 | Element::U8 | Element::Bool => 1,
        }
    }
}

/// An open `.npy` file whose header has been read: the file positioned at
/// its data, and the data's length.
struct Npy {
    /// The file, or a stream's bytes read into memory ([`slurp`]).
    file: Box<dyn Read>,
    header: header::Header,
    /// Bytes after the header.
    data_len: u64,
    /// The file's element type, if one read here.
    element: Option<Element>,
}

/// Open `path` and read its header (`what` names it in every error); C
/// order only (the caller checks the element type).
fn open(what: &'static str, path: &Path) -> Result<Npy> {
    let read_error = |source| CliError::Read {
        what,
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(read_error)?;
    let meta = file.metadata().map_err(read_error)?;
    // A pipe, a FIFO or a device (`<(...)`, /dev/stdin) has no length to
    // check the header against: read it first.
    let (mut file, len): (Box<dyn Read>, u64) = if meta.is_file() || meta.is_dir() {
        (Box::new(file), meta.len())
    } else {
        let bytes = slurp(&mut file).map_err(read_error)?;
        let len = bytes.len() as u64;
        (Box::new(std::io::Cursor::new(bytes)), len)
    };
    let header = header::read(&mut file, len).map_err(|source| CliError::NotNpy {
        what,
        path: path.to_path_buf(),
        source,
    })?;
    if header.fortran_order {
        return Err(CliError::FortranOrder {
            what,
            path: path.to_path_buf(),
        });
    }
    Ok(Npy {
        file,
        data_len: len - header.data_offset,
        element: Element::of(&header.descr),
        header,
    })
}

/// A stream's `.npy` bytes, read to the end of what its header says: the
/// magic string, version and header length, then the header, then at most
/// the data its shape and dtype need and one byte more (so that a longer
/// stream is still a length error). `Vec` grows with the bytes that
/// arrive, so a header that claims a huge shape costs no allocation; a
/// stream that is not an `.npy` (or whose dtype or shape is one the reader
/// rejects) stops early and the header check names the problem.
fn slurp(r: &mut impl Read) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    r.take(12).read_to_end(&mut buf)?;
    let prefix_len = match buf.get(6..8) {
        Some([1, 0]) => 10,
        Some([2 | 3, 0]) => 12,
        _ => return Ok(buf),
    };
    let Some(field) = buf.get(8..prefix_len) else {
        return Ok(buf);
    };
    let text_len = field
        .iter()
        .rev()
        .fold(0u64, |n, &b| (n << 8) | u64::from(b));
    let header_len = prefix_len as u64 + text_len;
    r.take(header_len.saturating_sub(buf.len() as u64))
        .read_to_end(&mut buf)?;
    let Ok(header) = header::read(&mut &buf[..], buf.len() as u64) else {
        return Ok(buf);
    };
    let data = Element::of(&header.descr).and_then(|e| {
        let count = size::elements_u64("stream", &header.shape).ok()?;
        (count as u64).checked_mul(e.bytes())
    });
    let Some(data) = data else {
        return Ok(buf);
    };
    let have = buf.len() as u64 - header_len.min(buf.len() as u64);
    r.take((data + 1).saturating_sub(have))
        .read_to_end(&mut buf)?;
    Ok(buf)
}

/// [`open`], and the array must have rank `rank` (`expected` describes its dims).
fn open_rank(
    what: &'static str,
    path: &Path,
    (rank, expected): (usize, &'static str),
) -> Result<Npy> {
    let npy = open(what, path)?;
    if npy.header.shape.len() != rank {
        return Err(CliError::Rank {
            what,
            rank: npy.header.shape.len(),
            shape: npy
                .header
                .shape
                .iter()
                .map(|&d| usize::try_from(d).unwrap_or(usize::MAX))
                .collect(),
            expected,
        });
    }
    Ok(npy)
}

impl Npy {
    /// The shape and the data as `T` (the file's element type, `element`):
    /// the element count is checked and the file must hold exactly its
    /// bytes before they are read.
    fn data<T: bytemuck::Pod>(
        mut self,
        what: &'static str,
        path: &Path,
        element: Element,
    ) -> Result<(Vec<usize>, Vec<T>)> {
        let shape = &self.header.shape;
        let count = size::elements_u64(what, shape).map_err(|_| CliError::NpyTooLarge {
            what,
            path: path.to_path_buf(),
            shape: shape.clone(),
            max: size::MAX_ELEMENTS,
        })?;
        // At most 2^61 elements of at most 8 bytes: no u64 overflow.
        let bytes = count as u64 * element.bytes();
        if bytes != self.data_len {
            return Err(CliError::NpyDataLength {
                what,
                path: path.to_path_buf(),
                shape: shape.clone(),
                expected: bytes,
                actual: self.data_len,
            });
        }
        // The file holds these bytes, so this allocation is the file's size.
        let mut raw = Vec::with_capacity(bytes as usize);
        let read = (&mut self.file).take(bytes).read_to_end(&mut raw);
        if let Err(source) = read {
            return Err(CliError::Read {
                what,
                path: path.to_path_buf(),
                source,
            });
        }
        if raw.len() as u64 != bytes {
            return Err(CliError::NpyDataLength {
                what,
                path: path.to_path_buf(),
                shape: shape.clone(),
                expected: bytes,
                actual: raw.len() as u64,
            });
        }
        // Each dim is at most the element count (or 0), which fits usize.
        let dims = shape.iter().map(|&d| d as usize).collect();
        Ok((dims, bytemuck::pod_collect_to_vec(&raw)))
    }
}

/// Read a tensor, naming `what` (e.g. "q") in every error.
pub fn read(what: &'static str, path: &Path) -> Result<Tensor> {
    let npy = open(what, path)?;
    let (shape, data) = match npy.element {
        Some(Element::F32) => {
            let (shape, d) = npy.data::<f32>(what, path, Element::F32)?;
            (shape, TensorData::F32(d))
        }
        Some(Element::F16) => {
            let (shape, d) = npy.data::<f16>(what, path, Element::F16)?;
            (shape, TensorData::F16(d))
        }
        _ => {
            return Err(CliError::Dtype {
                what,
                path: path.to_path_buf(),
                dtype: npy.header.descr,
            })
        }
    };
    Ok(Tensor { shape, data })
}

/// Read an f32 array (ALiBi slopes, sink logits, block scales), naming
/// `what` in every error; any other dtype is `F32Dtype`.
pub fn read_f32(what: &'static str, path: &Path) -> Result<(Vec<usize>, Vec<f32>)> {
    let npy = open(what, path)?;
    match npy.element {
        Some(Element::F32) => npy.data::<f32>(what, path, Element::F32),
        element => Err(CliError::F32Dtype {
            what,
            path: path.to_path_buf(),
            dtype: element.map_or(npy.header.descr, |e| e.numpy_name().to_string()),
        }),
    }
}

/// Read a bool or uint8 array (a block mask) of rank `rank`, naming `what`
/// in every error; entries as bytes (nonzero: allowed).
pub fn read_mask(
    what: &'static str,
    path: &Path,
    rank: usize,
    expected: &'static str,
) -> Result<(Vec<usize>, Vec<u8>)> {
    let npy = open_rank(what, path, (rank, expected))?;
    match npy.element {
        Some(e @ (Element::Bool | Element::U8)) => npy.data::<u8>(what, path, e),
        _ => Err(CliError::MaskDtype {
            what,
            path: path.to_path_buf(),
            dtype: npy.header.descr,
        }),
    }
}

/// A quantized cache's codes (`quant`'s dtype: int8 for int8 codes, uint8
/// for FP8's e4m3 bytes) of rank 4, as bytes, naming `what` in every error.
pub fn read_codes(
    what: &'static str,
    path: &Path,
    quant: CacheQuant,
    expected: &'static str,
) -> Result<(Vec<usize>, Vec<u8>)> {
    let npy = open_rank(what, path, (4, expected))?;
    match (quant, npy.element) {
        (CacheQuant::Int8, Some(Element::I8)) => npy.data::<u8>(what, path, Element::I8),
        (CacheQuant::Fp8, Some(Element::U8)) => npy.data::<u8>(what, path, Element::U8),
        _ => Err(CliError::CacheCodes {
            what,
            path: path.to_path_buf(),
            dtype: npy.header.descr,
            precision: quant.name(),
            expected: code_dtype(quant),
        }),
    }
}

/// The numpy dtype of `quant`'s codes.
pub fn code_dtype(quant: CacheQuant) -> &'static str {
    match quant {
        CacheQuant::Int8 => "int8",
        _ => "uint8 (e4m3 bytes)",
    }
}

/// Whether `path` holds a quantized cache's codes (int8 or uint8), read
/// from its header only.
pub fn holds_codes(what: &'static str, path: &Path) -> Result<bool> {
    // A stream can be read once: it is read as floats (a FIFO opened a
    // second time would wait for a second writer).
    if std::fs::metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir()) {
        return Ok(false);
    }
    Ok(matches!(
        open(what, path)?.element,
        Some(Element::I8 | Element::U8)
    ))
}

/// A quantized cache's codes as an `.npy` file: int8 codes as int8, FP8's
/// as uint8.
pub fn encode_codes(shape: &[usize], codes: &[u8], quant: CacheQuant) -> std::io::Result<Vec<u8>> {
    let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    match quant {
        CacheQuant::Int8 => {
            let signed: Vec<i8> = codes.iter().map(|&c| c as i8).collect();
            encode_array(&shape, &signed)
        }
        _ => encode_array(&shape, codes),
    }
}

/// An index array (cache lengths, cache rows, a block table).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexArray {
    pub shape: Vec<usize>,
    pub data: Vec<i32>,
}

/// Read an int32 array of rank `rank` (int64 is accepted when every entry
/// fits in int32), naming `what` in every error; `expected` describes the
/// dims for the rank error, e.g. "1 dim (batch,)".
pub fn read_index(
    what: &'static str,
    path: &Path,
    rank: usize,
    expected: &'static str,
) -> Result<IndexArray> {
    let npy = open_rank(what, path, (rank, expected))?;
    let (shape, data) = match npy.element {
        Some(Element::I32) => npy.data::<i32>(what, path, Element::I32)?,
        Some(Element::I64) => {
            let (shape, wide) = npy.data::<i64>(what, path, Element::I64)?;
            (shape, narrow(what, path, &wide)?)
        }
        _ => {
            return Err(CliError::IndexDtype {
                what,
                path: path.to_path_buf(),
                dtype: npy.header.descr,
            })
        }
    };
    Ok(IndexArray { shape, data })
}

/// int64 entries as int32, or an error naming the first that does not fit.
fn narrow(what: &'static str, path: &Path, wide: &[i64]) -> Result<Vec<i32>> {
    wide.iter()
        .enumerate()
        .map(|(index, &value)| {
            i32::try_from(value).map_err(|_| CliError::IndexRange {
                what,
                path: path.to_path_buf(),
                index,
                value,
            })
        })
        .collect()
}

/// An `.npy` file's bytes for `t` (f32 or f16, C order).
pub fn encode(t: &Tensor) -> std::io::Result<Vec<u8>> {
    let shape: Vec<u64> = t.shape.iter().map(|&d| d as u64).collect();
    match &t.data {
        TensorData::F32(d) => encode_array(&shape, d),
        TensorData::F16(d) => encode_array(&shape, d),
        // numpy has no bf16: bf16 values (and any later precision) travel as
        // exactly equal f32 (docs/semantics.md).
        _ => encode_array(&shape, &t.to_f32()),
    }
}

/// An `.npy` file's bytes for `data` in C order with this shape.
pub fn encode_array<T: npyz::AutoSerialize + Copy>(
    shape: &[u64],
    data: &[T],
) -> std::io::Result<Vec<u8>> {
    let mut buf = Vec::new();
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(shape)
        .writer(&mut buf)
        .begin_nd()?;
    w.extend(data.iter().copied())?;
    w.finish()?;
    Ok(buf)
}

/// A bool array's `.npy` bytes (a dropout mask), shape in C order.
pub fn encode_bool(shape: &[usize], data: &[bool]) -> std::io::Result<Vec<u8>> {
    let shape: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    encode_array(&shape, data)
}

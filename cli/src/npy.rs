//! `.npy` in and out (npyz): f32/f16 tensors (bf16 written as f32) and i32 (or i64) index
//! arrays, C order, little-endian; outputs are written to a temporary file
//! and renamed, so a failed run leaves no file.

use crate::error::{CliError, Result};
use flashattn::{Tensor, TensorData};
use half::f16;
use npyz::{TypeChar, WriterBuilder};
use std::path::{Path, PathBuf};

/// A parsed `.npy` file: its header checked for C order and little-endian
/// plain data; its shape and element type.
struct Npy<'a> {
    file: npyz::NpyFile<&'a [u8]>,
    shape: Vec<usize>,
    /// The element type (`f` float, `i` signed int, ...) and its bytes;
    /// `None` for a structured or big-endian dtype.
    kind: Option<(TypeChar, u64)>,
    descr: String,
}

/// The whole file at `path`, naming `what` in the error.
fn read_bytes(what: &'static str, path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|source| CliError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })
}

/// Parse the header of `bytes` (the caller checks the element type).
fn parse<'a>(what: &'static str, path: &Path, bytes: &'a [u8]) -> Result<Npy<'a>> {
    let file = npyz::NpyFile::new(bytes).map_err(|source| CliError::NotNpy {
        what,
        path: path.to_path_buf(),
        source,
    })?;
    if file.order() != npyz::Order::C {
        return Err(CliError::FortranOrder {
            what,
            path: path.to_path_buf(),
        });
    }
    let shape: Vec<usize> = file.shape().iter().map(|&d| d as usize).collect();
    let dtype = file.dtype();
    let kind = match &dtype {
        npyz::DType::Plain(ts) if ts.endianness() != npyz::Endianness::Big => {
            Some((ts.type_char(), ts.size_field()))
        }
        _ => None,
    };
    Ok(Npy {
        file,
        shape,
        kind,
        descr: dtype.descr(),
    })
}

/// [`parse`], and the array must have rank `rank` (`expected` describes its dims).
fn parse_rank<'a>(
    what: &'static str,
    path: &Path,
    bytes: &'a [u8],
    (rank, expected): (usize, &'static str),
) -> Result<Npy<'a>> {
    let npy = parse(what, path, bytes)?;
    if npy.shape.len() != rank {
        return Err(CliError::Rank {
            what,
            rank: npy.shape.len(),
            shape: npy.shape,
            expected,
        });
    }
    Ok(npy)
}

/// Read a tensor, naming `what` (e.g. "q") in every error.
pub fn read(what: &'static str, path: &Path) -> Result<Tensor> {
    let bytes = read_bytes(what, path)?;
    let npy = parse(what, path, &bytes)?;
    let io = |source| CliError::NotNpy {
        what,
        path: path.to_path_buf(),
        source,
    };
    let data = match npy.kind {
        Some((TypeChar::Float, 4)) => TensorData::F32(npy.file.into_vec::<f32>().map_err(io)?),
        Some((TypeChar::Float, 2)) => TensorData::F16(npy.file.into_vec::<f16>().map_err(io)?),
        _ => {
            return Err(CliError::Dtype {
                what,
                path: path.to_path_buf(),
                dtype: npy.descr,
            })
        }
    };
    Ok(Tensor {
        shape: npy.shape,
        data,
    })
}

/// Read an f32 array (ALiBi slopes, sink logits), naming `what` in every error.
pub fn read_f32(what: &'static str, path: &Path) -> Result<(Vec<usize>, Vec<f32>)> {
    let t = read(what, path)?;
    match t.data {
        TensorData::F32(d) => Ok((t.shape, d)),
        _ => Err(CliError::Dtype {
            what,
            path: path.to_path_buf(),
            dtype: "float16 (expected float32)".into(),
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
    let bytes = read_bytes(what, path)?;
    let npy = parse_rank(what, path, &bytes, (rank, expected))?;
    let io = |source| CliError::NotNpy {
        what,
        path: path.to_path_buf(),
        source,
    };
    let data = match npy.kind {
        Some((TypeChar::Bool, 1)) => {
            let flags = npy.file.into_vec::<bool>().map_err(io)?;
            flags.into_iter().map(u8::from).collect()
        }
        Some((TypeChar::Uint, 1)) => npy.file.into_vec::<u8>().map_err(io)?,
        _ => {
            return Err(CliError::MaskDtype {
                what,
                path: path.to_path_buf(),
                dtype: npy.descr,
            })
        }
    };
    Ok((npy.shape, data))
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
    let bytes = read_bytes(what, path)?;
    let npy = parse_rank(what, path, &bytes, (rank, expected))?;
    let io = |source| CliError::NotNpy {
        what,
        path: path.to_path_buf(),
        source,
    };
    let data = match npy.kind {
        Some((TypeChar::Int, 4)) => npy.file.into_vec::<i32>().map_err(io)?,
        Some((TypeChar::Int, 8)) => {
            let wide = npy.file.into_vec::<i64>().map_err(io)?;
            narrow(what, path, &wide)?
        }
        _ => {
            return Err(CliError::IndexDtype {
                what,
                path: path.to_path_buf(),
                dtype: npy.descr,
            })
        }
    };
    Ok(IndexArray {
        shape: npy.shape,
        data,
    })
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
fn encode(t: &Tensor) -> std::io::Result<Vec<u8>> {
    let shape: Vec<u64> = t.shape.iter().map(|&d| d as u64).collect();
    match &t.data {
        TensorData::F32(d) => encode_array(&shape, d),
        TensorData::F16(d) => encode_array(&shape, d),
        // numpy has no bf16: bf16 values travel as (exactly equal) f32 (docs/semantics.md).
        TensorData::Bf16(_) => encode_array(&shape, &t.to_f32()),
    }
}

/// An `.npy` file's bytes for `data` in C order with this shape.
fn encode_array<T: npyz::AutoSerialize + Copy>(
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

/// Write every `(path, tensor)` or none: each goes to a temporary file next to
/// its destination, and only when all are written are they renamed.
pub fn write_all(outputs: &[(&Path, &Tensor)]) -> Result<()> {
    let mut temps: Vec<(PathBuf, &Path)> = Vec::new();
    let cleanup = |temps: &[(PathBuf, &Path)]| {
        for (t, _) in temps {
            let _ = std::fs::remove_file(t);
        }
    };
    for (path, tensor) in outputs {
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let temp = path.with_file_name(format!(".{name}.{}.partial", std::process::id()));
        let result = encode(tensor).and_then(|bytes| std::fs::write(&temp, bytes));
        if let Err(source) = result {
            let _ = std::fs::remove_file(&temp);
            cleanup(&temps);
            return Err(CliError::Write {
                path: path.to_path_buf(),
                source,
            });
        }
        temps.push((temp, path));
    }
    for (temp, path) in &temps {
        if let Err(source) = std::fs::rename(temp, path) {
            cleanup(&temps);
            return Err(CliError::Write {
                path: path.to_path_buf(),
                source,
            });
        }
    }
    Ok(())
}

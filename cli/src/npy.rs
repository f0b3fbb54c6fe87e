//! `.npy` in and out (npyz): f32/f16, C order, little-endian; outputs are
//! written to a temporary file and renamed, so a failed run leaves no file.

use crate::error::{CliError, Result};
use flashattn::{Tensor, TensorData};
use half::f16;
use npyz::{TypeChar, WriterBuilder};
use std::path::{Path, PathBuf};

/// Read a tensor, naming `what` (e.g. "q") in every error.
pub fn read(what: &'static str, path: &Path) -> Result<Tensor> {
    let bytes = std::fs::read(path).map_err(|source| CliError::Read {
        what,
        path: path.to_path_buf(),
        source,
    })?;
    let npy = npyz::NpyFile::new(&bytes[..]).map_err(|source| CliError::NotNpy {
        what,
        path: path.to_path_buf(),
        source,
    })?;
    if npy.order() != npyz::Order::C {
        return Err(CliError::FortranOrder {
            what,
            path: path.to_path_buf(),
        });
    }
    let shape: Vec<usize> = npy.shape().iter().map(|&d| d as usize).collect();
    let dtype = npy.dtype();
    let unsupported = || CliError::Dtype {
        what,
        path: path.to_path_buf(),
        dtype: dtype.descr(),
    };
    let npyz::DType::Plain(ts) = &dtype else {
        return Err(unsupported());
    };
    if ts.type_char() != TypeChar::Float || ts.endianness() == npyz::Endianness::Big {
        return Err(unsupported());
    }
    let io = |source| CliError::NotNpy {
        what,
        path: path.to_path_buf(),
        source,
    };
    let data = match ts.size_field() {
        4 => TensorData::F32(npy.into_vec::<f32>().map_err(io)?),
        2 => TensorData::F16(npy.into_vec::<f16>().map_err(io)?),
        _ => return Err(unsupported()),
    };
    Ok(Tensor { shape, data })
}

fn encode(t: &Tensor) -> std::io::Result<Vec<u8>> {
    let shape: Vec<u64> = t.shape.iter().map(|&d| d as u64).collect();
    match &t.data {
        TensorData::F32(d) => encode_array(&shape, d),
        TensorData::F16(d) => encode_array(&shape, d),
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

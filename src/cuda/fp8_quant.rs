//! The FP8 forward's quantization on the device (cuda/fp8_quant.cu): q, k
//! and v uploaded in f32 become e4m3 codes in rows of the FP8 forward's
//! padded head dim, with one f32 scale per (batch, head), q and k through
//! the seeded Walsh–Hadamard transform when asked — `crate::quant`'s codes
//! and scales bit for bit (tests/cuda.rs checks them under host
//! emulation). Two launches a tensor: each head's max, then its codes.

use super::context::CudaDevice;
use super::driver_error::driver;
use super::jit::Launch;
use super::kernel::{Family, KernelKey, QUANT_ROWS};
use crate::api::tensor::{Precision, TensorView};
use crate::error::{Error, Result};
use crate::quant::{check_finite, Fp8Layout, Fp8Tensor, Hadamard};
use cudarc::driver::{CudaSlice, DeviceRepr, LaunchConfig};

/// cuda/fp8_quant.cu's `QuantArgs`, field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QuantArgs {
    /// batch · seqlen · heads.
    pub rows: i32,
    pub seqlen: i32,
    pub heads: i32,
    /// Elements of an input row (the head dim).
    pub d: i32,
    /// Elements of a quantized row: `d`, or the transform's order.
    pub dim: i32,
    /// 1 where the row goes through the transform.
    pub hadamard: i32,
    /// The transform's `1/√dim` (unread without it).
    pub norm: f32,
}

// SAFETY: a #[repr(C)] struct of scalars, the kernel's by value.
unsafe impl DeviceRepr for QuantArgs {}

/// One tensor's quantization: the module, its arguments and its grid.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantLaunch {
    /// The module, its head dim the stored row.
    pub key: KernelKey,
    pub args: QuantArgs,
    /// Blocks of [`QUANT_ROWS`] rows.
    pub blocks: u32,
}

/// The launch quantizing a `(batch, seqlen, heads, d)` tensor, through
/// `transform` where given, into rows of `row` codes.
pub fn quant_launch(shape: [usize; 4], transform: Option<&Hadamard>, row: usize) -> Result<QuantLaunch> {
    let [batch, seqlen, heads, d] = shape;
    let dim = transform.map_or(d, |t| t.dim);
    if transform.is_some_and(|t| t.head_dim != d) || dim > row {
        return Err(Error::DimMismatch {
            dim: "head_dim",
            tensor: "the FP8 quantization's rows",
            value: dim,
            other: "the stored row",
            other_value: row,
        });
    }
    let key = KernelKey::new(Family::Fp8Quantize, Precision::F32, row, false, false);
    if key.head_dim != row || !Family::Fp8Quantize.takes(Precision::F32, row) {
        return Err(Error::Unsupported {
            what: "the CUDA backend's FP8 quantization",
            feature: "a stored row other than the FP8 forward's 128 codes",
        });
    }
    let rows = batch * seqlen * heads;
    let int = |what: &'static str, n: usize| {
        i32::try_from(n).map_err(|_| Error::Unsupported {
            what: "the CUDA backend's FP8 quantization",
            feature: what,
        })
    };
    Ok(QuantLaunch {
        key,
        args: QuantArgs {
            rows: int("more than 2^31 rows", rows)?,
            seqlen: seqlen as i32,
            heads: heads as i32,
            d: d as i32,
            dim: dim as i32,
            hadamard: i32::from(transform.is_some()),
            norm: transform.map_or(1.0, |t| t.norm),
        },
        blocks: rows.div_ceil(QUANT_ROWS) as u32,
    })
}

/// One tensor quantized on the device.
pub(crate) struct DeviceQuant {
    /// `(batch, seqlen, heads, row)` codes.
    pub codes: CudaSlice<u8>,
    /// `(batch, heads)` scales.
    pub scales: CudaSlice<f32>,
}

/// `x` (named `tensor` in errors) quantized on `dev` into rows of `row`
/// codes, through `transform` where given.
pub(crate) fn quantize(
    dev: &CudaDevice,
    x: &TensorView,
    tensor: &'static str,
    transform: Option<&Hadamard>,
    row: usize,
) -> Result<DeviceQuant> {
    x.check_len(tensor)?;
    let values = x.data.to_f32();
    check_finite(&values, tensor)?;
    let l = quant_launch(x.shape, transform, row)?;
    let [batch, _, heads, _] = x.shape;
    let s = &dev.stream;
    let x_dev = s.clone_htod(&values).map_err(driver("uploading an FP8 input"))?;
    // Unread without the transform, but a pointer all the same.
    let signs = transform.map_or(vec![1.0f32], |t| t.signs.clone());
    let signs = s.clone_htod(&signs).map_err(driver("uploading the transform's signs"))?;
    let mut absmax = s
        .alloc_zeros::<u32>(batch * heads)
        .map_err(driver("allocating the heads' maxima"))?;
    let mut scales = s
        .alloc_zeros::<f32>(batch * heads)
        .map_err(driver("allocating the FP8 scales"))?;
    let mut codes = s
        .alloc_zeros::<u8>(l.args.rows as usize * row)
        .map_err(driver("allocating the FP8 codes"))?;
    if l.blocks == 0 {
        return Ok(DeviceQuant { codes, scales });
    }
    let cfg = LaunchConfig {
        grid_dim: (l.blocks, 1, 1),
        block_dim: (l.key.tiles().threads() as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let (max_fn, codes_fn) = (dev.function(l.key, "fp8_absmax")?, dev.function(l.key, "fp8_codes")?);
    let mut launch = Launch::new(s, &max_fn);
    launch.input(&x_dev).input(&signs).output(&mut absmax).value(&l.args);
    // SAFETY: fp8_absmax's arguments in order (x, signs, the maxima,
    // QuantArgs by value); x holds `rows` rows of d floats, signs `dim`
    // (with the transform), the maxima batch × heads; a block's rows past
    // `rows` return.
    unsafe { launch.launch(cfg, "launching fp8_absmax") }?;
    let mut launch = Launch::new(s, &codes_fn);
    launch
        .input(&x_dev)
        .input(&signs)
        .input(&absmax)
        .output(&mut scales)
        .output(&mut codes)
        .value(&l.args);
    // SAFETY: fp8_codes's arguments in order; codes hold `rows` rows of
    // `row` (the module's HEAD_DIM), scales batch × heads.
    unsafe { launch.launch(cfg, "launching fp8_codes") }?;
    Ok(DeviceQuant { codes, scales })
}

/// `x` quantized on `dev` as q and k are under `layout` (of x's head
/// dim), into rows of `row` codes, and read back: what the FP8 forward
/// runs on, [`crate::quant::quantize`]'s codes and scales with rows `row`
/// long.
pub(crate) fn quantize_to_host(
    dev: &CudaDevice,
    x: &TensorView,
    layout: &Fp8Layout,
    row: usize,
) -> Result<Fp8Tensor> {
    let device = quantize(dev, x, "x", layout.transform.as_ref(), row)?;
    let s = &dev.stream;
    Ok(Fp8Tensor {
        shape: x.shape,
        dim: layout.dim(),
        row_len: row,
        codes: s.clone_dtoh(&device.codes).map_err(driver("reading the FP8 codes"))?,
        scales: s.clone_dtoh(&device.scales).map_err(driver("reading the FP8 scales"))?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn launches_cover_every_row_and_refuse_what_the_kernel_cannot_hold() {
        let l = quant_launch([2, 5, 3, 59], None, 128).unwrap();
        assert_eq!((l.args.rows, l.args.dim, l.args.hadamard), (30, 59, 0));
        assert_eq!(l.blocks, 8);
        assert_eq!(l.key.head_dim, 128);
        let t = Hadamard::new(59, 3);
        let l = quant_launch([1, 1, 1, 59], Some(&t), 128).unwrap();
        assert_eq!((l.args.dim, l.args.hadamard, l.args.norm), (64, 1, 0.125));
        assert!(matches!(
            quant_launch([1, 1, 1, 96], Some(&Hadamard::new(96, 1)), 64),
            Err(Error::DimMismatch { value: 128, other_value: 64, .. })
        ));
        assert!(matches!(
            quant_launch([1, 1, 1, 59], Some(&t), 64),
            Err(Error::Unsupported { .. })
        ));
        assert!(matches!(
            quant_launch([1, 1, 1, 60], Some(&t), 128),
            Err(Error::DimMismatch { .. })
        ));
    }
}

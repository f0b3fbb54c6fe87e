//! The TMA tensor maps of the Hopper forward (cuda/flash_fwd_wgmma.cu):
//! q, k and v seen as 4-D tensors (d, heads, seqlen, batch), innermost
//! first, read in boxes of 128-byte rows (64 f16/bf16 columns, or 128
//! e4m3 codes in the FP8 variant) × 1 head × `rows` rows × 1 batch entry
//! with the 128-byte swizzle, zeros outside the tensor (rows past seqlen,
//! columns past d). The parameters are a pure function, unit tested and
//! mirrored by cuda/emulate/check.cpp; [`encode`] hands them to the
//! driver's `cuTensorMapEncodeTiled`.

use super::driver_error::driver;
use crate::api::tensor::Precision;
use crate::error::{Error, Result};
use cudarc::driver::sys;
use cudarc::driver::DeviceRepr;

/// Bytes of a box's row: the 128B swizzle's row (the widest box inner
/// dimension it takes): 64 two-byte elements, or 128 one-byte codes.
pub const BOX_ROW_BYTES: usize = 128;

/// One `cuTensorMapEncodeTiled` call's shape arguments.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorMapParams {
    /// Elements along (d, heads, seqlen, batch).
    pub dims: [u64; 4],
    /// Bytes between neighbours along heads, seqlen and batch (d is
    /// contiguous); TMA needs each a multiple of 16.
    pub strides: [u64; 3],
    /// The box, in elements along the same dims.
    pub box_dims: [u32; 4],
}

/// The tensor map of a row-major (batch, seqlen, heads, d) tensor of
/// `elem_bytes`-byte elements (2, or 1 for e4m3 codes), read `rows` rows
/// at a time in boxes of [`BOX_ROW_BYTES`]; `None` where TMA cannot read
/// it (d not a multiple of 16 bytes' elements).
pub fn params(
    [batch, seqlen, heads, d]: [usize; 4],
    elem_bytes: usize,
    rows: usize,
) -> Option<TensorMapParams> {
    let row = d * elem_bytes;
    if !row.is_multiple_of(16) || rows == 0 || rows > 256 || !matches!(elem_bytes, 1 | 2) {
        return None;
    }
    let dims = [d, heads, seqlen, batch].map(|n| n as u64);
    let strides = [row, row * heads, row * heads * seqlen].map(|n| n as u64);
    Some(TensorMapParams {
        dims,
        strides,
        box_dims: [(BOX_ROW_BYTES / elem_bytes) as u32, 1, rows as u32, 1],
    })
}

/// A `CUtensorMap`: 128 opaque bytes, 64-byte aligned, passed by value
/// (`const __grid_constant__ TensorMap` in cuda/hopper.cuh).
#[repr(C, align(64))]
#[derive(Clone, Copy, Debug)]
pub(crate) struct TensorMap(pub [u64; 16]);

// SAFETY: #[repr(C, align(64))] 128 bytes, the layout of the C struct.
unsafe impl DeviceRepr for TensorMap {}

/// The driver's tensor map for `params` over device memory at `address`,
/// of f16 or bf16 elements.
pub(crate) fn encode(
    params: &TensorMapParams,
    precision: Precision,
    address: sys::CUdeviceptr,
) -> Result<TensorMap> {
    let data_type = match precision {
        Precision::F16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_FLOAT16,
        Precision::Bf16 => sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
        _ => {
            return Err(Error::Unsupported {
                what: "the CUDA backend's Hopper path",
                feature: "f32 storage (it takes f16 and bf16)",
            })
        }
    };
    encode_as(params, data_type, address)
}

/// The driver's tensor map for `params` over e4m3 codes (bytes: the copy
/// engine moves them as they are) at `address`.
pub(crate) fn encode_codes(params: &TensorMapParams, address: sys::CUdeviceptr) -> Result<TensorMap> {
    encode_as(params, sys::CUtensorMapDataType::CU_TENSOR_MAP_DATA_TYPE_UINT8, address)
}

fn encode_as(
    params: &TensorMapParams,
    data_type: sys::CUtensorMapDataType,
    address: sys::CUdeviceptr,
) -> Result<TensorMap> {
    let mut map = sys::CUtensorMap { opaque: [0; 16] };
    let element_strides = [1u32; 4];
    // SAFETY: every pointer is to an array of the rank (4, strides 3) it
    // declares, and the map is written in place; the driver checks the
    // values (alignment, strides, box) and says so in its result.
    let result = unsafe {
        sys::cuTensorMapEncodeTiled(
            &mut map,
            data_type,
            4,
            address as *mut std::ffi::c_void,
            params.dims.as_ptr(),
            params.strides.as_ptr(),
            params.box_dims.as_ptr(),
            element_strides.as_ptr(),
            sys::CUtensorMapInterleave::CU_TENSOR_MAP_INTERLEAVE_NONE,
            sys::CUtensorMapSwizzle::CU_TENSOR_MAP_SWIZZLE_128B,
            sys::CUtensorMapL2promotion::CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
            sys::CUtensorMapFloatOOBfill::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    };
    result
        .result()
        .map_err(driver("encoding a TMA tensor map"))?;
    Ok(TensorMap(map.opaque))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_tensor_map_is_d_heads_seqlen_batch_in_boxes_of_64_columns() {
        // (batch 2, seqlen 113, heads 4, d 40) in bf16, 128 rows a box.
        let p = params([2, 113, 4, 40], 2, 128).unwrap();
        assert_eq!(p.dims, [40, 4, 113, 2]);
        assert_eq!(p.strides, [80, 4 * 80, 113 * 4 * 80]);
        assert_eq!(p.box_dims, [64, 1, 128, 1]);
        // The box's row is the swizzle's 128 bytes; columns 40..64 read 0.
        assert_eq!(p.box_dims[0] as usize * 2, 128);
    }

    #[test]
    fn a_map_of_e4m3_codes_reads_boxes_of_128_codes() {
        // (batch 2, seqlen 45, heads 4, a row of 128 codes), 128 rows a box.
        let p = params([2, 45, 4, 128], 1, 128).unwrap();
        assert_eq!(p.strides, [128, 4 * 128, 45 * 4 * 128]);
        assert_eq!(p.box_dims, [128, 1, 128, 1]);
        assert!(params([1, 8, 1, 100], 1, 64).is_none());
        assert!(params([1, 8, 1, 128], 4, 64).is_none());
    }

    #[test]
    fn tma_needs_rows_of_whole_16_byte_units() {
        assert!(params([1, 8, 1, 36], 2, 128).is_none());
        assert!(params([1, 8, 1, 64], 2, 512).is_none());
        for d in (8..=128).step_by(8) {
            let p = params([3, 5, 7, d], 2, 64).unwrap();
            assert!(p.strides.iter().all(|s| s % 16 == 0), "{d}");
        }
    }

    #[test]
    fn the_map_is_the_c_struct() {
        assert_eq!(std::mem::size_of::<TensorMap>(), 128);
        assert_eq!(std::mem::align_of::<TensorMap>(), 64);
    }
}

//! The device's copy bandwidth: one buffer copied into another by the
//! driver (`cuMemcpyDtoDAsync`), timed by CUDA events on the stream — the
//! yardstick of decoding on a device cache, as the copy kernel
//! (`ops::bandwidth`) is on wgpu.

use super::context::CudaDevice;
use super::driver_error::driver;
use super::jit::timed;
use crate::error::{Error, Result};
use crate::ops::bandwidth::BandwidthResult;

/// Copy `bytes` from one device buffer into another `repeats` times after
/// one untimed warm-up, and time each. The source is zeroed by the driver:
/// device memory is backed when it is allocated, so zeros move at the
/// rate any data does (no lazily mapped zero pages, as on a CPU adapter).
pub(crate) fn copy_bandwidth(
    dev: &CudaDevice,
    bytes: u64,
    repeats: usize,
) -> Result<BandwidthResult> {
    let len = usize::try_from(bytes)
        .ok()
        .filter(|&n| n > 0)
        .ok_or(Error::EmptyDim { dim: "copy bytes" })?;
    let s = &dev.stream;
    let src = s
        .alloc_zeros::<u8>(len)
        .map_err(driver("allocating the copy source"))?;
    let mut dst = s
        .alloc_zeros::<u8>(len)
        .map_err(driver("allocating the copy destination"))?;
    let mut seconds = Vec::with_capacity(repeats);
    for i in 0..=repeats {
        let t = timed(s, "copying on the device", || {
            s.memcpy_dtod(&src, &mut dst)
                .map_err(driver("copying on the device"))
        })?;
        if i > 0 {
            seconds.push(t);
        }
    }
    Ok(BandwidthResult { bytes, seconds })
}

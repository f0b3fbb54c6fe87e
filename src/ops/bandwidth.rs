//! The adapter's storage bandwidth: the copy kernel moving one f32 buffer
//! into another, timed — the yardstick for kernels that stream memory, such
//! as decoding against a long KV cache (its K/V reads can at best approach
//! this rate).

use crate::error::{Error, Result};
use crate::kernels::{binding, BufferCopy, CopyParams};
use crate::runtime::{whole, Call, Dispatch, Gpu};

/// A timed copy on this adapter.
#[derive(Clone, Debug)]
pub struct BandwidthResult {
    /// Bytes copied per run (read once and written once).
    pub bytes: u64,
    /// Kernel seconds of each timed repeat.
    pub seconds: Vec<f64>,
}

impl BandwidthResult {
    /// The fastest repeat's seconds.
    pub fn min_seconds(&self) -> Option<f64> {
        self.seconds.iter().copied().reduce(f64::min)
    }

    /// GB/s (10⁹ bytes) moved by the fastest repeat: bytes read plus bytes
    /// written, `2 · bytes / seconds`.
    pub fn gbps(&self) -> f64 {
        self.min_seconds()
            .map_or(0.0, |t| 2.0 * self.bytes as f64 / t / 1e9)
    }
}

/// Copy `bytes` (rounded up to whole vec4s) `repeats` times after one
/// untimed warm-up, and time each.
pub async fn copy_bandwidth(gpu: &Gpu, bytes: u64, repeats: usize) -> Result<BandwidthResult> {
    let len4 = copy_len4(gpu, bytes)?;
    let words = (4 * len4) as usize;
    // A pattern, so the source is real data (not a page of zeroes).
    let data: Vec<f32> = (0..words).map(|i| (i % 1021) as f32).collect();
    let mut call = Call::new(gpu, None);
    let src = call.upload("copy source", bytemuck::cast_slice(&data))?;
    drop(data);
    let dst = call.storage("copy destination", 16 * len4)?;
    let dispatch = copy_dispatch(gpu, len4, &src, &dst)?;
    let mut seconds = Vec::with_capacity(repeats);
    for i in 0..=repeats {
        let before = call.stats.kernel_seconds;
        call.run(std::slice::from_ref(&dispatch)).await?;
        if i > 0 {
            seconds.push(call.stats.kernel_seconds - before);
        }
    }
    Ok(BandwidthResult {
        bytes: 16 * len4,
        seconds,
    })
}

/// `data` through the copy kernel once, read back (for tests of the copy;
/// `data.len()` must be a multiple of 4).
#[cfg(feature = "lab")]
pub async fn copy_f32(gpu: &Gpu, data: &[f32]) -> Result<Vec<f32>> {
    if !data.len().is_multiple_of(4) {
        return Err(Error::DataLength {
            tensor: "copy source",
            shape: vec![data.len().div_ceil(4), 4],
            expected: data.len().next_multiple_of(4),
            actual: data.len(),
        });
    }
    let len4 = copy_len4(gpu, (data.len() * 4) as u64)?;
    let mut call = Call::new(gpu, None);
    let src = call.upload("copy source", bytemuck::cast_slice(data))?;
    let dst = call.storage("copy destination", 16 * len4)?;
    let dispatch = copy_dispatch(gpu, len4, &src, &dst)?;
    call.run(std::slice::from_ref(&dispatch)).await?;
    let mut out = call.read(&[(&dst, 16 * len4)]).await?;
    Ok(bytemuck::pod_collect_to_vec(&out.pop().unwrap_or_default()))
}

/// vec4s of a copy of `bytes`: at least one, within one storage binding.
fn copy_len4(gpu: &Gpu, bytes: u64) -> Result<u64> {
    if bytes == 0 {
        return Err(Error::EmptyDim { dim: "copy bytes" });
    }
    // The request itself first: rounding a size near u64::MAX up to 16
    // would wrap to 0 and pass.
    gpu.within_binding("the copy", bytes)?;
    let len4 = bytes.div_ceil(16);
    gpu.within_binding("the copy", 16 * len4)?;
    Ok(len4)
}

/// The copy of `len4` vec4s from `src` to `dst`, its grid wrapped from x
/// into y at the device's limit.
fn copy_dispatch<'a>(
    gpu: &Gpu,
    len4: u64,
    src: &'a wgpu::Buffer,
    dst: &'a wgpu::Buffer,
) -> Result<Dispatch<'a>> {
    let groups = BufferCopy::groups(len4);
    let max = gpu.max_groups() as u64;
    let x = groups.clamp(1, max);
    let y = groups.div_ceil(x).max(1);
    if y > max {
        return Err(Error::GridTooLarge {
            what: "the copy's rows of workgroups",
            groups: y,
            max: gpu.max_groups(),
        });
    }
    let to_u32 = crate::kernels::params::to_u32;
    let params = CopyParams {
        len: to_u32("copy vec4s", len4 as usize)?,
        groups_x: x as u32,
        ..Default::default()
    };
    let kernel = BufferCopy {
        variant: gpu.variant(false, false),
        rows: false,
    };
    Ok(Dispatch {
        kernel: kernel.into(),
        uniforms: vec![(binding::COPY, bytemuck::bytes_of(&params).to_vec())],
        buffers: whole([(binding::COPY_SRC, src), (binding::COPY_DST, dst)]),
        grid: [x as u32, y as u32, 1],
        walk: None,
    })
}

//! Talking to the queue: device errors as `Result`s, submitting work and
//! waiting for it, and reading buffers back.

use super::gpu::Gpu;
use super::scope::checked;
use crate::error::{Error, Result};
use std::sync::atomic::Ordering;
use web_time::Instant;

/// Let the device make progress: blocks until idle on native backends; a
/// no-op on the web, where the browser drives callbacks.
fn wait_idle(gpu: &Gpu) -> Result<()> {
    gpu.device
        .poll(wgpu::PollType::wait_indefinitely())
        .map(|_| ())
        .map_err(|source| Error::Poll { source })
}

/// Submit `encoder`, wait for completion, and return the wall time. Every
/// submission the engine makes goes through here, and is counted
/// ([`Gpu::submissions`]).
pub async fn submit(gpu: &Gpu, encoder: wgpu::CommandEncoder) -> Result<f64> {
    let start = Instant::now();
    checked(&gpu.device, "submitting GPU work", || {
        gpu.queue.submit([encoder.finish()]);
        gpu.submissions.fetch_add(1, Ordering::Relaxed);
        Ok(())
    })
    .await?;
    let (tx, rx) = futures_channel::oneshot::channel();
    gpu.queue.on_submitted_work_done(move || {
        let _ = tx.send(());
    });
    wait_idle(gpu)?;
    rx.await.map_err(|_| Error::DeviceLost)?;
    let seconds = start.elapsed().as_secs_f64();
    gpu.take_uncaptured()?;
    Ok(seconds)
}

/// Copy the first `bytes` of each buffer back to the host, with one staging
/// buffer and one submission.
pub async fn read_back(gpu: &Gpu, buffers: &[(&wgpu::Buffer, u64)]) -> Result<Vec<Vec<u8>>> {
    let ranges: Vec<(&wgpu::Buffer, u64, u64)> = buffers.iter().map(|&(b, n)| (b, 0, n)).collect();
    read_back_at(gpu, &ranges).await
}

/// [`read_back`] of `(buffer, offset, bytes)` ranges (offsets multiples of 4).
pub async fn read_back_at(
    gpu: &Gpu,
    buffers: &[(&wgpu::Buffer, u64, u64)],
) -> Result<Vec<Vec<u8>>> {
    let padded: Vec<u64> = buffers
        .iter()
        .map(|(_, _, b)| (*b).max(4).next_multiple_of(4))
        .collect();
    let total: u64 = padded.iter().sum();
    let staging = gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("readback"),
        size: total,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut encoder = gpu.device.create_command_encoder(&Default::default());
    let mut offset = 0;
    for ((buffer, from, _), size) in buffers.iter().zip(&padded) {
        encoder.copy_buffer_to_buffer(buffer, *from, &staging, offset, *size);
        offset += size;
    }
    submit(gpu, encoder).await?;
    let data = map(gpu, &staging).await?;
    let mut out = Vec::with_capacity(buffers.len());
    let mut offset = 0usize;
    for ((_, _, bytes), size) in buffers.iter().zip(&padded) {
        out.push(data[offset..offset + *bytes as usize].to_vec());
        offset += *size as usize;
    }
    Ok(out)
}

/// The whole contents of a mapped-readable buffer.
async fn map(gpu: &Gpu, staging: &wgpu::Buffer) -> Result<Vec<u8>> {
    let (tx, rx) = futures_channel::oneshot::channel();
    staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
        let _ = tx.send(r);
    });
    wait_idle(gpu)?;
    rx.await
        .map_err(|_| Error::DeviceLost)?
        .map_err(|source| Error::Map { source })?;
    let data = staging
        .slice(..)
        .get_mapped_range()
        .map_err(|source| Error::MapRange { source })?
        .to_vec();
    staging.unmap();
    Ok(data)
}

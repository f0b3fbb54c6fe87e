//! Dispatches recorded into a caller's command encoder: one compute pass,
//! nothing submitted, waited on or read back. Uniform blocks and loop flags
//! go into buffers of their own, filled when created — not the pool's,
//! whose buffers a later call could take and overwrite through the queue
//! before the caller submits — and the recorded commands keep them alive
//! until they have run.

use super::buffers::{padded, STORAGE, UNIFORM};
use super::call::{bind_group, Dispatch};
use super::gpu::Gpu;
use super::scope::checked;
use crate::error::Result;
use wgpu::util::DeviceExt;

impl Gpu {
    /// A new buffer holding `words` (for side tables), with storage usage.
    pub fn buffer_with(&self, words: &[u32]) -> wgpu::Buffer {
        self.init_buffer(bytemuck::cast_slice(words), STORAGE)
    }

    /// A new zeroed storage buffer of at least `bytes`.
    pub fn zeroed_buffer(&self, bytes: u64) -> wgpu::Buffer {
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("flashattn encoded call"),
            size: padded(bytes.max(4)),
            usage: STORAGE,
            mapped_at_creation: false,
        })
    }

    fn init_buffer(&self, bytes: &[u8], usage: wgpu::BufferUsages) -> wgpu::Buffer {
        let mut contents = bytes.to_vec();
        contents.resize(padded(bytes.len() as u64) as usize, 0);
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("flashattn encoded call"),
                contents: &contents,
                usage,
            })
    }
}

/// Record `dispatches` into `encoder` in one compute pass (pipelines
/// compiled first where new; inside error scopes, so a mistake is a typed
/// error here and never reaches the app's own error handler).
pub async fn record(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    dispatches: &[Dispatch<'_>],
) -> Result<()> {
    let mut pipelines = Vec::with_capacity(dispatches.len());
    for d in dispatches {
        pipelines.push(gpu.pipelines.get(&gpu.device, &d.kernel).await?);
    }
    // The guard's flag is bound but never read: the caller checked the
    // loop limit before recording, so no kernel is cut short.
    let flag = gpu
        .loop_limit
        .limit()
        .map(|_| gpu.init_buffer(bytemuck::cast_slice(&[0u32, 0]), STORAGE));
    // The bind groups first, in a scope of their own: a range the device
    // cannot bind (a buffer without STORAGE usage, or of another device)
    // is an error here, before the pass is begun, since an invalid bind
    // group set in the app's encoder would invalidate everything the app
    // records in it and reach its error handler when it submits.
    let binds = checked(&gpu.device, "binding the app's buffers", || {
        let uniforms: Vec<Vec<(u32, wgpu::Buffer)>> = dispatches
            .iter()
            .map(|d| {
                let block = |(n, bytes): &(u32, Vec<u8>)| (*n, gpu.init_buffer(bytes, UNIFORM));
                d.uniforms.iter().map(block).collect()
            })
            .collect();
        Ok(dispatches
            .iter()
            .zip(&pipelines)
            .zip(&uniforms)
            .map(|((d, p), u)| bind_group(gpu, p, d, u, flag.as_ref()))
            .collect::<Vec<wgpu::BindGroup>>())
    })
    .await?;
    checked(&gpu.device, "recording kernels", || {
        let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("flashattn"),
            timestamp_writes: None,
        });
        for ((d, p), bind) in dispatches.iter().zip(&pipelines).zip(&binds) {
            pass.set_pipeline(p);
            pass.set_bind_group(0, bind, &[]);
            let [x, y, z] = d.grid;
            pass.dispatch_workgroups(x, y, z);
        }
        Ok(())
    })
    .await
}

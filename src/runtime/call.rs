//! One call on the device: the buffers it uses (from the pool, given back
//! when it ends), its dispatches encoded into one compute pass and timed,
//! the loop-limit guards and access counters read after each submission,
//! and its stats.

use super::buffers::{padded, STORAGE, UNIFORM};
use super::gpu::Gpu;
use super::scope::checked;
use super::submit::{read_back, submit};
use crate::api::output::{Accesses, Allocation, CallStats, Timing};
use crate::error::{Error, Result};
use crate::kernels::{binding, KernelKey};
use crate::plan::Plan;

/// One dispatch: a kernel, its uniform blocks and buffers, its grid.
#[derive(Debug)]
pub struct Dispatch<'a> {
    pub kernel: KernelKey,
    /// `(binding, bytes)` of each uniform block.
    pub uniforms: Vec<(u32, Vec<u8>)>,
    /// `(binding, range)` of each storage buffer ([`whole`] for entire ones).
    pub buffers: Vec<(u32, wgpu::BufferBinding<'a>)>,
    pub grid: [u32; 3],
    /// How far the kernel's long loop walks (rows or keys) and in steps of
    /// how many, for the loop-limit guard; `None` for kernels that cannot
    /// be split.
    pub walk: Option<(usize, u32)>,
}

/// A call in progress.
pub struct Call<'g> {
    pub gpu: &'g Gpu,
    pub stats: CallStats,
    /// Pooled buffers in use, given back when the call ends.
    held: Vec<wgpu::Buffer>,
    /// Uploads written to the queue but not yet submitted.
    uploads_pending: bool,
}

impl<'g> Call<'g> {
    pub fn new(gpu: &'g Gpu, plan: Option<Plan>) -> Self {
        Self {
            gpu,
            stats: CallStats {
                plan,
                pieces: 1,
                ..Default::default()
            },
            held: Vec::new(),
            uploads_pending: false,
        }
    }

    /// A storage buffer of at least `bytes` (contents undefined), recorded.
    pub fn storage(&mut self, label: &'static str, bytes: u64) -> Result<wgpu::Buffer> {
        let size = padded(bytes);
        let b = self.gpu.pool.take(&self.gpu.device, label, size, STORAGE)?;
        self.stats
            .allocations
            .push(Allocation { label, bytes: size });
        self.held.push(b.clone());
        Ok(b)
    }

    /// A storage buffer holding `bytes` (padded to 4), recorded.
    pub fn upload(&mut self, label: &'static str, bytes: &[u8]) -> Result<wgpu::Buffer> {
        let b = self.storage(label, bytes.len() as u64)?;
        write_padded(&self.gpu.queue, &b, bytes);
        self.uploads_pending = true;
        Ok(b)
    }

    /// A pooled buffer the stats do not count (uniforms, flags).
    fn scratch(&mut self, bytes: &[u8], usage: wgpu::BufferUsages) -> Result<wgpu::Buffer> {
        let size = padded(bytes.len() as u64);
        let b = self
            .gpu
            .pool
            .take(&self.gpu.device, "scratch", size, usage)?;
        write_padded(&self.gpu.queue, &b, bytes);
        self.held.push(b.clone());
        Ok(b)
    }

    /// Encode `dispatches` in one compute pass, submit, wait, and account for
    /// them; a kernel its guard caught short is a [`Error::LoopBudget`].
    pub async fn run(&mut self, dispatches: &[Dispatch<'_>]) -> Result<()> {
        let gpu = self.gpu;
        let mut pipelines = Vec::with_capacity(dispatches.len());
        for d in dispatches {
            pipelines.push(gpu.pipelines.get(&gpu.device, &d.kernel).await?);
        }
        if std::mem::take(&mut self.uploads_pending) {
            // Copy the inputs in a submission of their own, so the kernels'
            // time is theirs alone.
            submit(gpu, gpu.device.create_command_encoder(&Default::default())).await?;
        }
        let flags = self.loop_flags(dispatches)?;
        let uniforms = self.uniforms(dispatches)?;
        let clock = PassClock::new(gpu);
        let encoder = checked(&gpu.device, "encoding kernels", || {
            let mut encoder = gpu.device.create_command_encoder(&Default::default());
            let binds: Vec<wgpu::BindGroup> = dispatches
                .iter()
                .zip(&pipelines)
                .zip(&uniforms)
                .map(|((d, p), u)| self.bind_group(d, p, u, &flags))
                .collect();
            {
                let mut pass = encoder.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: None,
                    timestamp_writes: clock.as_ref().map(PassClock::writes),
                });
                for ((d, p), bind) in dispatches.iter().zip(&pipelines).zip(&binds) {
                    pass.set_pipeline(p);
                    pass.set_bind_group(0, bind, &[]);
                    let [x, y, z] = d.grid;
                    pass.dispatch_workgroups(x, y, z);
                }
            }
            if let Some(c) = &clock {
                c.resolve(&mut encoder);
            }
            Ok(encoder)
        })
        .await?;
        let wall = submit(gpu, encoder).await?;
        self.stats.dispatches += dispatches.len() as u32;
        let gpu_seconds = self
            .after_submit(dispatches, &flags, clock.as_ref())
            .await?;
        self.stats.timing = if gpu_seconds.is_some() {
            Timing::GpuTimestamps
        } else {
            Timing::WallClock
        };
        self.stats.kernel_seconds += gpu_seconds.unwrap_or(wall);
        Ok(())
    }

    /// One zeroed two-word flag buffer per kernel of the call, where the
    /// kernels carry the loop-budget guard.
    fn loop_flags(&mut self, dispatches: &[Dispatch]) -> Result<Vec<(KernelKey, wgpu::Buffer)>> {
        let mut flags: Vec<(KernelKey, wgpu::Buffer)> = Vec::new();
        if self.gpu.loop_limit.limit().is_none() {
            return Ok(flags);
        }
        // Guard: word 0 is set when cut short; word 1 stays 0 (it hides the
        // guard loop's bound from the compiler). Meter: word 1 is the fewest
        // iterations any invocation had left.
        let left = if self.gpu.settings.loop_meter {
            u32::MAX
        } else {
            0
        };
        let words = bytemuck::cast_slice::<u32, u8>(&[0, left]).to_vec();
        for d in dispatches {
            if !flags.iter().any(|(k, _)| *k == d.kernel) {
                let b = self.scratch(&words, STORAGE)?;
                flags.push((d.kernel, b));
            }
        }
        Ok(flags)
    }

    /// The uniform buffers of every dispatch.
    fn uniforms(&mut self, dispatches: &[Dispatch]) -> Result<Vec<Vec<(u32, wgpu::Buffer)>>> {
        dispatches
            .iter()
            .map(|d| {
                d.uniforms
                    .iter()
                    .map(|(b, bytes)| Ok((*b, self.scratch(bytes, UNIFORM)?)))
                    .collect()
            })
            .collect()
    }

    /// A dispatch's bind group, with the access counters and the loop flag
    /// where the kernels have them.
    fn bind_group(
        &self,
        d: &Dispatch,
        pipeline: &wgpu::ComputePipeline,
        uniforms: &[(u32, wgpu::Buffer)],
        flags: &[(KernelKey, wgpu::Buffer)],
    ) -> wgpu::BindGroup {
        let flag = flags.iter().find(|(k, _)| *k == d.kernel).map(|(_, f)| f);
        bind_group(self.gpu, pipeline, d, uniforms, flag)
    }

    /// Read the counters, flags and pass timestamps the submission wrote
    /// (one readback); the kernels' seconds when the timestamps are valid.
    async fn after_submit(
        &mut self,
        dispatches: &[Dispatch<'_>],
        flags: &[(KernelKey, wgpu::Buffer)],
        clock: Option<&PassClock>,
    ) -> Result<Option<f64>> {
        let gpu = self.gpu;
        let mut reads: Vec<(&wgpu::Buffer, u64)> = flags.iter().map(|(_, b)| (b, 8)).collect();
        if let Some(counter) = &gpu.io_counter {
            reads.push((counter, 8));
        }
        if let Some(c) = clock {
            reads.push((&c.resolved, PassClock::BYTES));
        }
        if reads.is_empty() {
            return Ok(None);
        }
        let mut words = read_back(gpu, &reads).await?;
        let seconds = match clock {
            Some(c) => words.pop().and_then(|w| c.seconds(&w)),
            None => None,
        };
        if let Some(counter) = &gpu.io_counter {
            let c: Vec<u32> = bytemuck::pod_collect_to_vec(&words[words.len() - 1]);
            gpu.queue.write_buffer(counter, 0, &[0; 8]);
            let counted = Accesses {
                reads: c[0] as u64,
                writes: c[1] as u64,
            };
            let prev = self.stats.measured_accesses.unwrap_or_default();
            self.stats.measured_accesses = Some(prev + counted);
        }
        for ((key, _), bytes) in flags.iter().zip(&words) {
            let [cut, left]: [u32; 2] = bytemuck::pod_read_unaligned(&bytes[..8]);
            if gpu.settings.loop_meter {
                let limit = gpu.loop_limit.limit().unwrap_or(0);
                self.stats
                    .loop_iterations
                    .push((key.name(), limit.saturating_sub(left)));
            } else if cut != 0 {
                return Err(self.cut_short(key, dispatches));
            }
        }
        Ok(seconds)
    }

    /// Learn from the first kernel its guard caught short and describe it.
    fn cut_short(&self, key: &KernelKey, dispatches: &[Dispatch]) -> Error {
        let limit = self.gpu.loop_limit.limit().unwrap_or(u32::MAX);
        let walk = dispatches
            .iter()
            .filter(|d| d.kernel == *key)
            .filter_map(|d| d.walk)
            .max_by_key(|w| w.0);
        if let Some((len, step)) = walk {
            if let Err(e) = self.gpu.loop_limit.learn(key, len, step) {
                return e;
            }
        }
        let len = walk.map_or(0, |w| w.0);
        let (rows, keys) = match key.loop_dim() {
            Some(crate::kernels::LoopDim::Rows) => (len, 0),
            _ => (0, len),
        };
        Error::LoopBudget {
            kernel: key.name(),
            rows,
            keys,
            limit,
        }
    }

    /// Copy buffers back (one submission).
    pub async fn read(&self, buffers: &[(&wgpu::Buffer, u64)]) -> Result<Vec<Vec<u8>>> {
        read_back(self.gpu, buffers).await
    }

    /// The call's stats; its buffers go back to the pool.
    pub fn finish(mut self) -> CallStats {
        std::mem::take(&mut self.stats)
    }
}

impl Drop for Call<'_> {
    fn drop(&mut self) {
        for b in self.held.drain(..) {
            self.gpu.pool.give_back(b);
        }
    }
}

/// Timestamps at the start and end of a call's compute pass, on adapters
/// with `TIMESTAMP_QUERY` (WebGPU's timestamp-query too).
struct PassClock {
    queries: wgpu::QuerySet,
    resolved: wgpu::Buffer,
    /// Nanoseconds per tick.
    period: f64,
}

impl PassClock {
    /// Two u64 ticks.
    const BYTES: u64 = 16;

    fn new(gpu: &Gpu) -> Option<Self> {
        if !gpu.features.contains(wgpu::Features::TIMESTAMP_QUERY) {
            return None;
        }
        let queries = gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("pass clock"),
            ty: wgpu::QueryType::Timestamp,
            count: 2,
        });
        let resolved = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("pass clock ticks"),
            size: Self::BYTES,
            usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
            mapped_at_creation: false,
        });
        Some(Self {
            queries,
            resolved,
            period: gpu.queue.get_timestamp_period() as f64,
        })
    }

    fn writes(&self) -> wgpu::ComputePassTimestampWrites<'_> {
        wgpu::ComputePassTimestampWrites {
            query_set: &self.queries,
            beginning_of_pass_write_index: Some(0),
            end_of_pass_write_index: Some(1),
        }
    }

    fn resolve(&self, encoder: &mut wgpu::CommandEncoder) {
        encoder.resolve_query_set(&self.queries, 0..2, &self.resolved, 0);
    }

    /// Seconds between the two ticks; `None` if the adapter wrote none or
    /// a clock that ran backwards (some drivers reset it between passes).
    fn seconds(&self, bytes: &[u8]) -> Option<f64> {
        let [start, end]: [u64; 2] = bytemuck::pod_read_unaligned(bytes.get(..16)?);
        (end > start && self.period > 0.0).then(|| (end - start) as f64 * self.period * 1e-9)
    }
}

/// `bytes` written at the start of `buffer`, zero-padded to 4.
fn write_padded(queue: &wgpu::Queue, buffer: &wgpu::Buffer, bytes: &[u8]) {
    if bytes.len().is_multiple_of(4) && !bytes.is_empty() {
        queue.write_buffer(buffer, 0, bytes);
    } else {
        let mut p = bytes.to_vec();
        p.resize(padded(bytes.len() as u64) as usize, 0);
        queue.write_buffer(buffer, 0, &p);
    }
}

/// A bind group for `pipeline` with `entries[i] = (binding, buffer)`.
/// Entire buffers as bindings.
pub fn whole<'a>(
    entries: impl IntoIterator<Item = (u32, &'a wgpu::Buffer)>,
) -> Vec<(u32, wgpu::BufferBinding<'a>)> {
    entries
        .into_iter()
        .map(|(n, b)| (n, b.as_entire_buffer_binding()))
        .collect()
}

/// A dispatch's bind group: its buffers and `uniforms`, with the access
/// counter and the loop `flag` where the kernels have them.
pub(crate) fn bind_group(
    gpu: &Gpu,
    pipeline: &wgpu::ComputePipeline,
    d: &Dispatch,
    uniforms: &[(u32, wgpu::Buffer)],
    flag: Option<&wgpu::Buffer>,
) -> wgpu::BindGroup {
    let mut entries: Vec<wgpu::BindGroupEntry> = d
        .buffers
        .iter()
        .map(|(binding, b)| wgpu::BindGroupEntry {
            binding: *binding,
            resource: wgpu::BindingResource::Buffer(b.clone()),
        })
        .collect();
    let extra = uniforms.iter().map(|(n, b)| (*n, b));
    let extra = extra
        .chain(gpu.io_counter.as_ref().map(|c| (binding::IO, c)))
        .chain(flag.map(|f| (binding::LOOP_BUDGET, f)));
    entries.extend(extra.map(|(binding, b)| wgpu::BindGroupEntry {
        binding,
        resource: b.as_entire_binding(),
    }));
    gpu.device.create_bind_group(&wgpu::BindGroupDescriptor {
        label: None,
        layout: &pipeline.get_bind_group_layout(0),
        entries: &entries,
    })
}

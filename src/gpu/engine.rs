//! The wgpu runtime: device, adapter facts, pipeline cache, buffer helpers with
//! allocation accounting.

use super::io::Accesses;
use super::shaders::{binding, Variant};
use super::split::{split, Split};
use crate::error::{Error, Result};
use crate::plan::{DeviceCaps, Plan};
use crate::tensor::{AttentionShape, Precision};
use std::collections::HashMap;
use std::sync::Mutex;
use web_time::Instant;
use wgpu::util::DeviceExt;

/// One storage buffer the engine allocated during a call.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    pub label: String,
    pub bytes: u64,
}

/// What one call did: the plan it ran, every device buffer it allocated
/// (all alive at once, so their sum is the call's peak), dispatch count and
/// the wall time of its GPU submissions.
#[derive(Clone, Debug, Default)]
pub struct CallStats {
    pub plan: Option<Plan>,
    pub allocations: Vec<Allocation>,
    pub dispatches: u32,
    /// Seconds from submit to completion of the call's kernels (no uploads or readbacks).
    pub kernel_seconds: f64,
    /// Storage-buffer elements the kernels read and write, counted
    /// analytically from the plan (see `gpu::io`).
    pub accesses: Accesses,
    /// The same, counted by the kernels themselves (engines made with
    /// [`Engine::with_io_counting`] only).
    pub measured_accesses: Option<Accesses>,
    /// Times the call was rerun in shorter pieces because llvmpipe's loop
    /// limit cut a kernel short (see [`Engine::has_loop_limiter`]).
    pub reruns: u32,
    /// On llvmpipe: this call's two words [budget spent, 0] that its kernels
    /// write (see `shaders/loop_budget.wgsl`); one per call, so concurrent
    /// calls on one engine cannot see each other's flags.
    pub(crate) loop_flag: Option<wgpu::Buffer>,
}

impl CallStats {
    /// The stats of a call that runs `plan`, before it has done anything.
    pub(crate) fn for_plan(plan: &Plan) -> Self {
        Self {
            plan: Some(plan.clone()),
            ..Default::default()
        }
    }

    /// Bytes of all buffers allocated by the call (they coexist).
    pub fn peak_bytes(&self) -> u64 {
        self.allocations.iter().map(|a| a.bytes).sum()
    }

    /// The largest single buffer.
    pub fn largest_allocation(&self) -> Option<&Allocation> {
        self.allocations.iter().max_by_key(|a| a.bytes)
    }
}

/// One dispatch: pipeline, `(binding, buffer)` pairs besides the attention
/// params at binding 0, and the grid.
pub(crate) type Step = (wgpu::ComputePipeline, Vec<(u32, wgpu::Buffer)>, [usize; 3]);

/// A GPU attention engine on one wgpu device.
///
/// Cheap to share: kernels take `&self`, pipelines are compiled once per
/// (plan, variant) and cached.
pub struct Engine {
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    limits: wgpu::Limits,
    features: wgpu::Features,
    binding_cap: Option<u64>,
    workgroup_storage_cap: Option<u32>,
    tiled_only: bool,
    /// Two atomic words (reads, writes) when kernels count their accesses.
    io_counter: Option<wgpu::Buffer>,
    /// Whether kernels carry the loop-budget guard (llvmpipe).
    loop_guard: bool,
    /// Longest run of rows or keys one dispatch may cover, per kernel and plan,
    /// learned when the loop guard fired.
    sequence_caps: Mutex<HashMap<String, usize>>,
    pipelines: Mutex<HashMap<(String, &'static str), wgpu::ComputePipeline>>,
}

impl std::fmt::Debug for Engine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Engine")
            .field("adapter", &self.info.name)
            .field("backend", &self.info.backend)
            .finish()
    }
}

/// llvmpipe (lavapipe on Vulkan, and the GL driver) ends every loop of an
/// invocation after 65535 iterations in total; see `shaders/loop_budget.wgsl`.
fn has_loop_limiter(info: &wgpu::AdapterInfo) -> bool {
    info.name.contains("llvmpipe")
}

/// The key of a learned sequence cap: the kernel and its whole plan.
fn cap_key(kernel: &str, plan: &Plan) -> String {
    format!("{kernel} {plan:?}")
}

/// Features flashattn uses when the adapter has them.
fn wanted_features(adapter: wgpu::Features) -> wgpu::Features {
    adapter
        & (wgpu::Features::SHADER_F16 | wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::SUBGROUP)
}

impl Engine {
    /// Create an engine on the best adapter: Vulkan, Metal or DX12 first, then
    /// GL. `WGPU_BACKEND` (e.g. `vulkan`, `gl`) restricts the choice.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn new() -> Result<Self> {
        pollster::block_on(Self::new_async())
    }

    /// Async form of [`Engine::new`] (the only form on the web).
    pub async fn new_async() -> Result<Self> {
        let from_env = std::env::var_os("WGPU_BACKEND").is_some();
        let mut tries = vec![wgpu::InstanceDescriptor::new_without_display_handle_from_env()];
        if !from_env {
            // GL through llvmpipe is a last resort: no f16, very slow compiles.
            tries[0].backends = wgpu::Backends::PRIMARY;
            let mut gl = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
            gl.backends = wgpu::Backends::SECONDARY;
            tries.push(gl);
        }
        let mut last = String::from("no backend tried");
        for desc in tries {
            let backends = desc.backends;
            let instance = wgpu::Instance::new(desc);
            let options = wgpu::RequestAdapterOptions {
                power_preference: wgpu::PowerPreference::HighPerformance,
                ..Default::default()
            };
            match instance.request_adapter(&options).await {
                Ok(adapter) => return Self::from_adapter(adapter).await,
                Err(e) => last = format!("{e} (backends {backends:?})"),
            }
        }
        Err(Error::NoAdapter(last))
    }

    /// Create an engine on a chosen adapter, requesting its real limits.
    pub async fn from_adapter(adapter: wgpu::Adapter) -> Result<Self> {
        let info = adapter.get_info();
        let (device, queue) = adapter
            .request_device(&wgpu::DeviceDescriptor {
                label: Some("flashattn"),
                required_features: wanted_features(adapter.features()),
                // The WebGPU defaults (16 KiB of workgroup storage) would halve the tiles.
                required_limits: adapter.limits(),
                ..Default::default()
            })
            .await
            .map_err(|e| Error::Device(format!("requesting a device on {}: {e}", info.name)))?;
        // Errors are captured by scopes around every call; anything that escapes
        // them is reported rather than aborting the host program.
        device.on_uncaptured_error(std::sync::Arc::new(|e| {
            eprintln!("flashattn: uncaptured wgpu error: {e}")
        }));
        Ok(Self::from_device(device, queue, info))
    }

    /// Wrap an existing device (its limits and features are read from it).
    pub fn from_device(device: wgpu::Device, queue: wgpu::Queue, info: wgpu::AdapterInfo) -> Self {
        let loop_guard = has_loop_limiter(&info);
        Self {
            limits: device.limits(),
            features: device.features(),
            device,
            queue,
            info,
            binding_cap: None,
            workgroup_storage_cap: None,
            tiled_only: false,
            io_counter: None,
            loop_guard,
            sequence_caps: Mutex::new(HashMap::new()),
            pipelines: Mutex::new(HashMap::new()),
        }
    }

    /// Pretend storage bindings hold at most `bytes` (to exercise and study how
    /// large problems are split; the device's own limit still applies).
    pub fn with_binding_limit(mut self, bytes: u64) -> Self {
        self.binding_cap = Some(bytes);
        self
    }

    /// Plan with at most `bytes` of workgroup storage (browser-like limits, M sweeps).
    pub fn with_workgroup_storage_limit(mut self, bytes: u32) -> Self {
        self.workgroup_storage_cap = Some(bytes);
        self
    }

    /// Run the tiled kernels (the GPU ones) even on a CPU adapter that has the
    /// lanes kernels: for comparisons, and to test the GPU path on lavapipe.
    pub fn with_tiled_kernels_only(mut self) -> Self {
        self.tiled_only = true;
        self
    }

    /// Compile instrumented kernels that count every storage element they read
    /// and write; each call's [`CallStats::measured_accesses`] holds the counts
    /// (32-bit counters: up to 4·10⁹ accesses per kind and submission). Slower;
    /// for tests and studies, one call at a time.
    pub fn with_io_counting(mut self) -> Self {
        self.io_counter = Some(self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("io counts"),
            size: 8,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        }));
        self
    }

    /// The kernel variant for these flags on this engine (instrumented or not).
    pub(crate) fn variant(&self, masked: bool, softcap: bool) -> Variant {
        Variant {
            masked,
            softcap,
            count_io: self.io_counter.is_some(),
            loop_guard: self.loop_guard,
        }
    }

    /// Whether this adapter cuts long-running loops short (llvmpipe), so
    /// kernels report it and calls rerun in shorter pieces.
    pub fn has_loop_limiter(&self) -> bool {
        self.loop_guard
    }

    /// The longest run of rows or keys one dispatch of `kernel` under `plan`
    /// may cover (unbounded until the loop guard has fired for it).
    pub(crate) fn sequence_cap(&self, kernel: &str, plan: &Plan) -> usize {
        self.sequence_caps
            .lock()
            .ok()
            .and_then(|caps| caps.get(&cap_key(kernel, plan)).copied())
            .unwrap_or(usize::MAX)
    }

    /// How a host-tensor call on `shape` is cut: pieces that fit one storage
    /// binding and the dispatch limit, at most `max_seq` rows and keys each.
    pub(crate) fn pieces(
        &self,
        shape: &AttentionShape,
        precision: Precision,
        max_seq: usize,
    ) -> Result<Vec<Split>> {
        split(
            shape,
            precision.bytes() as u64,
            self.max_binding(),
            self.max_groups() as usize,
            max_seq,
        )
    }

    /// Run `attempt` with the longest run of rows and keys one dispatch of
    /// `kernel` may cover, halving it each time the loop guard fires, until a
    /// run completes; returns its result and the number of reruns.
    pub(crate) async fn with_reruns<T, F, Fut>(
        &self,
        kernel: &str,
        plan: &Plan,
        longest: usize,
        mut attempt: F,
    ) -> Result<(T, u32)>
    where
        F: FnMut(usize) -> Fut,
        Fut: std::future::Future<Output = Result<T>>,
    {
        let mut reruns = 0;
        loop {
            let max_seq = self.sequence_cap(kernel, plan);
            match attempt(max_seq).await {
                Err(Error::LoopBudget(_)) => {
                    self.halve_sequence_cap(kernel, plan, longest.min(max_seq))?;
                    reruns += 1;
                }
                other => return other.map(|out| (out, reruns)),
            }
        }
    }

    /// After the loop guard fired on a call whose longest piece covered
    /// `longest` rows or keys: remember half of it for this kernel and plan,
    /// or fail when a piece is already as short as one tile.
    fn halve_sequence_cap(&self, kernel: &str, plan: &Plan, longest: usize) -> Result<()> {
        let floor = plan.br.max(plan.bc) as usize;
        if longest <= floor {
            return Err(Error::Unsupported(format!(
                "the {kernel} kernel exceeds {}'s loop limit (65535 loop iterations per invocation) even on {longest} rows and keys",
                self.info.name
            )));
        }
        self.sequence_caps
            .lock()
            .map_err(|_| Error::Device("sequence caps poisoned by a panic".into()))?
            .insert(cap_key(kernel, plan), (longest / 2).max(floor));
        Ok(())
    }

    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }

    pub fn queue(&self) -> &wgpu::Queue {
        &self.queue
    }

    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.info
    }

    pub fn limits(&self) -> &wgpu::Limits {
        &self.limits
    }

    pub fn features(&self) -> wgpu::Features {
        self.features
    }

    /// The limits the planner sees.
    pub fn caps(&self) -> DeviceCaps {
        let mut caps = DeviceCaps::from_adapter(&self.limits, self.features, &self.info);
        if let Some(cap) = self.workgroup_storage_cap {
            caps.max_workgroup_storage = caps.max_workgroup_storage.min(cap);
        }
        if self.tiled_only {
            caps.lane_subgroup = None;
        }
        caps
    }

    /// Largest byte size one storage binding may have.
    pub fn max_binding(&self) -> u64 {
        let device = self
            .limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size);
        self.binding_cap.map_or(device, |c| c.min(device))
    }

    /// Most workgroups per dispatch dimension.
    pub fn max_groups(&self) -> u32 {
        self.limits.max_compute_workgroups_per_dimension
    }

    /// One line naming the adapter and backend.
    pub fn describe(&self) -> String {
        format!(
            "{} ({:?}, {:?}, driver {} {})",
            self.info.name,
            self.info.backend,
            self.info.device_type,
            self.info.driver,
            self.info.driver_info
        )
    }

    /// A compiled pipeline for `source`'s `entry`, cached by the source text
    /// (which is generated one-to-one from plan and variant).
    pub(crate) async fn pipeline(
        &self,
        source: &str,
        entry: &'static str,
    ) -> Result<wgpu::ComputePipeline> {
        let key = (source.to_string(), entry);
        if let Some(p) = self.lock_pipelines()?.get(&key) {
            return Ok(p.clone());
        }
        let pipeline = self
            .checked(&format!("compiling kernel `{entry}`"), || {
                Ok(self.compile(source, entry))
            })
            .await?;
        self.lock_pipelines()?.insert(key, pipeline.clone());
        Ok(pipeline)
    }

    fn compile(&self, source: &str, entry: &'static str) -> wgpu::ComputePipeline {
        let module = self
            .device
            .create_shader_module(wgpu::ShaderModuleDescriptor {
                label: Some(entry),
                source: wgpu::ShaderSource::Wgsl(source.into()),
            });
        self.device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(entry),
                layout: None,
                module: &module,
                entry_point: Some(entry),
                compilation_options: Default::default(),
                cache: None,
            })
    }

    fn lock_pipelines(
        &self,
    ) -> Result<std::sync::MutexGuard<'_, HashMap<(String, &'static str), wgpu::ComputePipeline>>>
    {
        self.pipelines
            .lock()
            .map_err(|_| Error::Device("pipeline cache poisoned by a panic".into()))
    }

    /// Number of compiled pipelines held.
    pub fn cached_pipelines(&self) -> usize {
        self.pipelines.lock().map(|p| p.len()).unwrap_or(0)
    }

    /// A zeroed storage buffer of at least `bytes` (rounded up to 4), recorded in `stats`.
    pub(crate) fn storage(&self, stats: &mut CallStats, label: &str, bytes: u64) -> wgpu::Buffer {
        let size = bytes.max(4).next_multiple_of(4);
        stats.allocations.push(Allocation {
            label: label.to_string(),
            bytes: size,
        });
        self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        })
    }

    /// A storage buffer holding `bytes` (padded to 4), recorded in `stats`.
    pub(crate) fn upload(&self, stats: &mut CallStats, label: &str, bytes: &[u8]) -> wgpu::Buffer {
        let mut padded;
        let contents = if bytes.len() % 4 == 0 && !bytes.is_empty() {
            bytes
        } else {
            padded = bytes.to_vec();
            padded.resize(bytes.len().max(4).next_multiple_of(4), 0);
            &padded
        };
        stats.allocations.push(Allocation {
            label: label.to_string(),
            bytes: contents.len() as u64,
        });
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some(label),
                contents,
                usage: wgpu::BufferUsages::STORAGE
                    | wgpu::BufferUsages::COPY_SRC
                    | wgpu::BufferUsages::COPY_DST,
            })
    }

    /// A uniform buffer (not counted: it is a few bytes of parameters).
    pub(crate) fn uniform<T: bytemuck::Pod>(&self, value: &T) -> wgpu::Buffer {
        self.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: Some("params"),
                contents: bytemuck::bytes_of(value),
                usage: wgpu::BufferUsages::UNIFORM,
            })
    }

    /// Run `f` with validation and out-of-memory errors captured, so a device
    /// error becomes an `Err` naming `what` instead of a panic.
    pub(crate) async fn checked<T>(&self, what: &str, f: impl FnOnce() -> Result<T>) -> Result<T> {
        let validation = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let result = f();
        let oom = oom.pop().await;
        let validation = validation.pop().await;
        if let Some(e) = oom {
            return Err(Error::Device(format!("{what}: out of device memory: {e}")));
        }
        if let Some(e) = validation {
            return Err(Error::Device(format!("{what}: {e}")));
        }
        result
    }

    /// Let the device make progress: blocks until idle on native backends;
    /// a no-op on the web, where the browser drives callbacks.
    fn wait_idle(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::wait_indefinitely())
            .map(|_| ())
            .map_err(|e| Error::Device(format!("waiting for the GPU: {e}")))
    }

    /// Submit a call's kernels, wait for them, and record their time (and, on
    /// an instrumented engine, their counted accesses) in `stats`.
    pub(crate) async fn submit(
        &self,
        encoder: wgpu::CommandEncoder,
        stats: &mut CallStats,
    ) -> Result<()> {
        stats.kernel_seconds += self.submit_raw(encoder).await?;
        if let Some(counter) = &self.io_counter {
            let words: Vec<u32> = bytemuck::pod_collect_to_vec(&self.read_back(counter, 8).await?);
            self.queue.write_buffer(counter, 0, &[0; 8]);
            let counted = Accesses {
                reads: words[0] as u64,
                writes: words[1] as u64,
            };
            stats.measured_accesses = Some(stats.measured_accesses.unwrap_or_default() + counted);
        }
        if let Some(flag) = &stats.loop_flag {
            if self.read_back(flag, 4).await? != [0; 4] {
                return Err(Error::LoopBudget(self.info.name.clone()));
            }
        }
        Ok(())
    }

    /// Submit `encoder`, wait for completion, and return the wall time.
    async fn submit_raw(&self, encoder: wgpu::CommandEncoder) -> Result<f64> {
        let start = Instant::now();
        self.checked("submitting GPU work", || {
            self.queue.submit([encoder.finish()]);
            Ok(())
        })
        .await?;
        let (tx, rx) = futures_channel::oneshot::channel();
        self.queue.on_submitted_work_done(move || {
            let _ = tx.send(());
        });
        self.wait_idle()?;
        rx.await
            .map_err(|_| Error::Device("the device was lost before the work completed".into()))?;
        Ok(start.elapsed().as_secs_f64())
    }

    /// Copy `bytes` bytes of `buffer` back to the host.
    pub(crate) async fn read_back(&self, buffer: &wgpu::Buffer, bytes: u64) -> Result<Vec<u8>> {
        let size = bytes.max(4).next_multiple_of(4);
        let staging = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("readback"),
            size,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let mut encoder = self.device.create_command_encoder(&Default::default());
        encoder.copy_buffer_to_buffer(buffer, 0, &staging, 0, size);
        self.submit_raw(encoder).await?;
        let (tx, rx) = futures_channel::oneshot::channel();
        staging.slice(..).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
        self.wait_idle()?;
        rx.await
            .map_err(|_| Error::Device("readback callback never ran".into()))?
            .map_err(|e| Error::Device(format!("mapping a readback buffer: {e}")))?;
        let data = staging
            .slice(..)
            .get_mapped_range()
            .map_err(|e| Error::Device(format!("reading a mapped buffer: {e}")))?
            .to_vec();
        staging.unmap();
        Ok(data[..bytes as usize].to_vec())
    }

    /// A bind group for `pipeline` with `buffers[i]` at binding `i` where
    /// present, plus the access counters on an instrumented engine and the
    /// loop-budget flag on llvmpipe.
    pub(crate) fn bind(
        &self,
        stats: &mut CallStats,
        pipeline: &wgpu::ComputePipeline,
        buffers: &[(u32, &wgpu::Buffer)],
    ) -> wgpu::BindGroup {
        if self.loop_guard && stats.loop_flag.is_none() {
            stats.loop_flag = Some(self.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("loop budget"),
                size: 8,
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: false,
            }));
        }
        let io = self.io_counter.as_ref().map(|c| (binding::IO, c));
        let guard = stats.loop_flag.as_ref().map(|c| (binding::LOOP_BUDGET, c));
        let entries: Vec<wgpu::BindGroupEntry> = buffers
            .iter()
            .chain(io.iter())
            .chain(guard.iter())
            .map(|(binding, b)| wgpu::BindGroupEntry {
                binding: *binding,
                resource: b.as_entire_binding(),
            })
            .collect();
        self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        })
    }
}

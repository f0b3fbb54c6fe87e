//! The public face of the wgpu backend: an [`Engine`] owns one device and
//! offers the operations on it. Every method is a thin call into `ops`;
//! the blocking forms exist on native targets, the `*_async` forms
//! everywhere (they are the ones to use on the web).

use crate::api::decode::{
    CacheShape, DecodeOutput, DecodeProblem, DecodeSpec, DecodeStep, HostKvCache,
};
use crate::kv_quant::QuantKvCache;
use crate::api::inputs::{BackwardInputs, ForwardInputs};
use crate::api::options::{AttentionOptions, Fp8Options};
use crate::api::output::{BackwardOutput, CallStats, ForwardOutput, Timing};
use crate::api::problem::Problem;
use crate::api::shape::AttentionShape;
use crate::api::tensor::{Precision, TensorView};
#[cfg(not(target_arch = "wasm32"))]
use crate::backend::attend::{AttentionBackend, Capabilities};
use crate::error::Result;
use crate::kernels::{AttentionBindings, AttentionBuffers, DecodeBindings, GradientBindings};
use crate::ops;
use crate::ops::bandwidth::BandwidthResult;
use crate::ops::ceiling::{CeilingResult, CeilingShape};
use crate::plan::{
    plan_backward, plan_forward, DecodePlan, DeviceCaps, Pass, Plan, PlanOverrides, PlanRequest,
    Planned,
};
use crate::quant::Fp8Tensor;
use crate::runtime::adapter;
use crate::runtime::scope::scoped;
use crate::runtime::{Gpu, KvCache};
#[cfg(not(target_arch = "wasm32"))]
use crate::tune::{self, TuneCache, TuneReport, TuneRequest};
#[cfg(feature = "lab")]
use crate::verify::matrix::{self, MatrixEntry};
use crate::verify::wgpu::{Routed, Verifier};
use crate::verify::{CallKind, Checked, DeviceKey, VerdictStore, VerifyMode};

/// A GPU attention engine on one wgpu device.
///
/// `Send + Sync`: share one engine between threads (`&Engine`, or an
/// `Arc`); calls from many threads at once are safe and give the bits a
/// serial run gives. Methods take `&self`; pipelines are compiled once per
/// kernel and cached, and buffers are reused across calls from a pool
/// capped by [`Engine::with_pool_limit`].
#[derive(Debug)]
pub struct Engine {
    gpu: Gpu,
    /// Where forward and backward look up tuned plans (`None`: the formula).
    #[cfg(not(target_arch = "wasm32"))]
    tuned: Option<TuneCache>,
    /// The kernel families' verdicts on this device (see [`crate::verify`]).
    verifier: Verifier,
}

impl Engine {
    /// An engine on the best adapter: hardware first, then Vulkan/Metal/DX12
    /// before GL. `WGPU_BACKEND` (e.g. `vulkan`, `gl`) restricts the choice.
    ///
    /// ```
    /// let engine = flashattn::Engine::new()?; // Error::NoAdapter where none exists
    /// println!("{}", engine.describe());
    /// # Ok::<(), flashattn::Error>(())
    /// ```
    #[cfg(not(target_arch = "wasm32"))]
    pub fn new() -> Result<Self> {
        pollster::block_on(Self::new_async())
    }

    /// Async form of [`Engine::new`] (the only form on the web).
    pub async fn new_async() -> Result<Self> {
        Self::from_adapter(&adapter::best_adapter().await?).await
    }

    /// An engine on a chosen adapter, with its real limits.
    pub async fn from_adapter(adapter: &wgpu::Adapter) -> Result<Self> {
        Self::on(adapter::open(adapter).await?)
    }

    /// A guest on an app's device, opened on `adapter`. The engine plans
    /// with the features (shader-f16, subgroups, cooperative matrices,
    /// timestamp queries) and limits the device was opened with, and the
    /// adapter's cooperative-matrix configurations. It never replaces the
    /// device's uncaptured-error handler: its own work runs inside error
    /// scopes and its device errors come back as [`Error`](crate::Error)s;
    /// whatever the app does wrong on the device stays the app's.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn from_device(
        adapter: &wgpu::Adapter,
        device: wgpu::Device,
        queue: wgpu::Queue,
    ) -> Result<Self> {
        pollster::block_on(Self::from_device_async(adapter, device, queue))
    }

    /// Async form of [`Engine::from_device`].
    pub async fn from_device_async(
        adapter: &wgpu::Adapter,
        device: wgpu::Device,
        queue: wgpu::Queue,
    ) -> Result<Self> {
        Self::on(adapter::wrap(adapter, device, queue).await?)
    }

    /// An engine on `gpu` with the default settings: kernels verified as
    /// `FLASHATTN_VERIFY` says (on first use by default), verdicts kept in
    /// flashattn's cache directory where there is one.
    fn on(gpu: Gpu) -> Result<Self> {
        let store = VerdictStore::new(VerifyMode::from_env()?, DeviceKey::of_adapter(&gpu.info));
        #[cfg(not(target_arch = "wasm32"))]
        let store = store.with_disk(crate::verify::VerdictCache::default_location());
        #[cfg(all(feature = "lab-fault", not(target_arch = "wasm32")))]
        let fault = crate::verify::Fault::from_env()?;
        #[cfg(not(all(feature = "lab-fault", not(target_arch = "wasm32"))))]
        let fault = None;
        Ok(Self {
            gpu,
            #[cfg(not(target_arch = "wasm32"))]
            tuned: None,
            verifier: Verifier { store, fault },
        })
    }

    /// Verify kernels as `mode` says (instead of `FLASHATTN_VERIFY`'s).
    pub fn with_verification(mut self, mode: VerifyMode) -> Self {
        self.verifier.store = self.verifier.store.with_mode(mode);
        self
    }

    /// Keep verdicts in `cache` (`None`: in memory only, checked again by
    /// every process) instead of flashattn's cache directory.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn with_verdict_cache(mut self, cache: Option<crate::verify::VerdictCache>) -> Self {
        self.verifier.store = self.verifier.store.with_disk(cache);
        self
    }

    /// Plant `fault`: every output of its family perturbed, as a driver
    /// that miscompiles the family would (tests of verification; the
    /// `lab` feature only).
    #[cfg(feature = "lab")]
    pub fn with_fault(mut self, fault: crate::verify::Fault) -> Self {
        self.verifier.fault = Some(fault);
        self
    }

    /// How kernels are verified.
    pub fn verify_mode(&self) -> VerifyMode {
        self.verifier.store.mode()
    }

    /// Where verdicts are kept on disk (`None`: memory only).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn verdict_cache(&self) -> Option<&crate::verify::VerdictCache> {
        self.verifier.store.disk()
    }

    /// Every verdict this engine knows: checked now or read from the cache.
    pub fn verdicts(&self) -> Vec<Checked> {
        self.verifier.store.known()
    }

    /// Known-answer checks this engine ran (not read from the cache), and
    /// the seconds they took in all.
    pub fn checks_run(&self) -> (u32, f64) {
        let s = &self.verifier.store;
        (s.checks_run(), s.check_seconds())
    }

    /// What verification decides for a forward or backward call (its
    /// family's check run first where [`Engine::verify_mode`] says): the
    /// overrides the call runs with (a fallback's family forced) and the
    /// verdicts; `flashattn plan` shows them.
    #[cfg(all(feature = "lab", not(target_arch = "wasm32")))]
    pub fn verify_call(
        &self,
        pass: Pass,
        shape: &AttentionShape,
        precision: Precision,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<Routed> {
        let call = match pass {
            Pass::Forward => CallKind::Forward,
            Pass::Backward => CallKind::Backward,
        };
        let problem = Problem::new(*shape, precision, opts)?;
        let route = self
            .verifier
            .route(&self.gpu, call, &problem, overrides, *overrides);
        pollster::block_on(route)
    }

    /// What verification decides for a decoding step of `problem`: the
    /// decode kernel it runs (where its check failed, the tiled one) and the verdicts.
    #[cfg(all(feature = "lab", not(target_arch = "wasm32")))]
    pub fn verify_decode(&self, problem: &DecodeProblem) -> Result<Routed> {
        problem.check()?;
        pollster::block_on(self.verifier.route_decode(&self.gpu, Some(problem), None))
    }

    /// Every row of this device's verification matrix (see
    /// [`crate::verify::matrix`]), in order: what `flashattn doctor` runs.
    #[cfg(feature = "lab")]
    pub fn verification_matrix(&self) -> Vec<MatrixEntry> {
        matrix::entries(&self.gpu)
    }

    /// Run one row of the matrix now (no verdict is read or kept).
    #[cfg(all(feature = "lab", not(target_arch = "wasm32")))]
    pub fn run_matrix_entry(&self, entry: &MatrixEntry) -> matrix::MatrixRow {
        let fault = self.verifier.fault.as_ref();
        pollster::block_on(matrix::run(&self.gpu, entry, fault))
    }

    /// Run the plans `flashattn tune` ([`Engine::tune`]) stored in `cache`
    /// where it has one for a call's adapter, pass and problem class and
    /// the call passes no overrides; the formula plan otherwise. Off by
    /// default.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn with_tuned_plans(mut self, cache: TuneCache) -> Self {
        self.tuned = Some(cache);
        self
    }

    /// The cached winner a call of `pass` over `shape` under `opts` would
    /// run on this engine (tuned plans on, an entry for its class that
    /// still plans here); `None`: the formula plan.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn tuned_overrides(
        &self,
        pass: Pass,
        shape: &AttentionShape,
        precision: Precision,
        opts: &AttentionOptions,
    ) -> Option<PlanOverrides> {
        let cache = self.tuned.as_ref()?;
        tune::tuned_overrides(&self.gpu, cache, pass, shape, precision, opts)
    }

    /// The overrides a call runs with: the caller's, or where it passes
    /// none and tuned plans are on, the cached winner for the problem.
    #[cfg_attr(target_arch = "wasm32", allow(unused_variables))]
    fn overrides_for(
        &self,
        pass: Pass,
        problem: &Problem<'_>,
        overrides: &PlanOverrides,
    ) -> PlanOverrides {
        #[cfg(not(target_arch = "wasm32"))]
        if *overrides == PlanOverrides::default() {
            let p = problem;
            if let Some(o) = self.tuned_overrides(pass, &p.shape, p.precision, p.opts) {
                return o;
            }
        }
        *overrides
    }

    /// Pretend storage bindings hold at most `bytes` (to exercise and study
    /// how large problems are split; the device's own limit still applies).
    #[cfg(feature = "lab")]
    pub fn with_binding_limit(mut self, bytes: u64) -> Self {
        self.gpu.settings.binding_cap = Some(bytes);
        self
    }

    /// Plan with at most `bytes` of workgroup storage (browser-like limits, M sweeps).
    pub fn with_workgroup_storage_limit(mut self, bytes: u32) -> Self {
        self.gpu.settings.workgroup_storage_cap = Some(bytes);
        self
    }

    /// Run the tiled kernels by default, even on a CPU adapter that has the
    /// lanes kernels or a GPU that defaults to the coop or registers ones:
    /// for comparisons, and to test the tiled path on lavapipe.
    pub fn with_tiled_kernels_only(mut self) -> Self {
        self.gpu.settings.tiled_only = true;
        self
    }

    /// Plan as if the device had 8×8 f32 cooperative matrices (where it has
    /// subgroups) and run the coop forward with them emulated in plain WGSL:
    /// tests of the coop kernel's tiles, layouts and softmax on devices
    /// without cooperative matrices (lavapipe). Not fast.
    #[cfg(feature = "lab")]
    pub fn with_emulated_coop(mut self) -> Self {
        self.gpu.settings.emulate_coop = true;
        self
    }

    /// Do not split calls by their predicted loop count; only the guards
    /// catch kernels the loop limit cut short (which then rerun). For
    /// testing the guards.
    #[cfg(feature = "lab")]
    pub fn without_loop_prediction(mut self) -> Self {
        self.gpu.settings.no_loop_prediction = true;
        self
    }

    /// Compile kernels that measure the loop iterations they take (as the
    /// adapter's loop limit counts them) into
    /// [`CallStats::loop_iterations`], instead of guarding against the limit:
    /// for checking the loop model on adapters that have one.
    #[cfg(feature = "lab")]
    pub fn with_loop_meter(mut self) -> Self {
        self.gpu.settings.loop_meter = true;
        self
    }

    /// Compile instrumented kernels that count every storage element they
    /// read and write; each call's [`CallStats::measured_accesses`] holds the
    /// counts (32-bit counters: up to 4·10⁹ accesses per kind and
    /// submission). Slower; for tests and studies, one call at a time.
    #[cfg(feature = "lab")]
    pub fn with_io_counting(mut self) -> Self {
        let counter = self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("io counts"),
            size: 8,
            usage: crate::runtime::buffers::STORAGE,
            mapped_at_creation: false,
        });
        self.gpu.queue.write_buffer(&counter, 0, &[0; 8]);
        self.gpu.io_counter = Some(counter);
        self
    }

    /// Keep at most `bytes` of idle device buffers between calls (default
    /// 512 MiB; 0 keeps none, so every call allocates its own). Buffers a
    /// call returns past the cap are freed; [`Engine::trim`] frees the
    /// idle ones now.
    pub fn with_pool_limit(mut self, bytes: u64) -> Self {
        self.gpu.pool = crate::runtime::buffers::BufferPool::with_cap(bytes);
        self
    }

    /// Free the idle device buffers the engine keeps for later calls
    /// (compiled pipelines and verdicts stay). Safe while other threads
    /// run calls: their buffers come back to the pool when they end.
    pub fn trim(&self) {
        self.gpu.pool.trim();
    }

    /// Bytes of idle device buffers kept for later calls (at most the
    /// cap set by [`Engine::with_pool_limit`]).
    pub fn pooled_bytes(&self) -> u64 {
        self.gpu.pool.idle_bytes()
    }

    /// Queue submissions this engine has made itself since it was created:
    /// the loop-limit probe, known-answer checks, host-tensor and
    /// device-buffer calls and read-backs. Recording an encoded call
    /// ([`Engine::encode_forward`]) adds none once its family is verified,
    /// so an app can check that its own submits are the only ones.
    pub fn submissions(&self) -> u64 {
        self.gpu
            .submissions
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// The runtime under this engine: its device, caches and settings, for
    /// dispatching kernels directly (`runtime::Call`, `kernels::*`).
    #[cfg(feature = "lab")]
    pub fn runtime(&self) -> &Gpu {
        &self.gpu
    }

    /// The loop limit the probe measured on this adapter (`None`: none).
    pub fn loop_limit(&self) -> Option<u32> {
        self.gpu.loop_limit.limit()
    }

    /// The wgpu device the engine runs on.
    pub fn device(&self) -> &wgpu::Device {
        &self.gpu.device
    }

    /// The queue it submits to.
    pub fn queue(&self) -> &wgpu::Queue {
        &self.gpu.queue
    }

    /// What the adapter says of itself.
    pub fn adapter_info(&self) -> &wgpu::AdapterInfo {
        &self.gpu.info
    }

    /// The limits the device was granted.
    pub fn limits(&self) -> &wgpu::Limits {
        &self.gpu.limits
    }

    /// The features the device was granted.
    pub fn features(&self) -> wgpu::Features {
        self.gpu.features
    }

    /// The clock [`CallStats::kernel_seconds`] comes from on this adapter:
    /// GPU timestamps where it has `TIMESTAMP_QUERY`, else the wall clock.
    pub fn timing(&self) -> Timing {
        if self.gpu.features.contains(wgpu::Features::TIMESTAMP_QUERY) {
            Timing::GpuTimestamps
        } else {
            Timing::WallClock
        }
    }

    /// The limits the planner sees.
    pub fn caps(&self) -> DeviceCaps {
        self.gpu.caps()
    }

    /// Largest byte size one storage binding may have.
    pub fn max_binding(&self) -> u64 {
        self.gpu.max_binding()
    }

    /// One line naming the adapter and backend.
    pub fn describe(&self) -> String {
        self.gpu.describe()
    }

    /// Number of compiled pipelines held.
    pub fn cached_pipelines(&self) -> usize {
        self.gpu.pipelines.len()
    }

    /// The forward plan for a problem under `overrides`, with its clamps
    /// (tuned plans aside: see [`Engine::tuned_overrides`]).
    pub fn plan(
        &self,
        shape: &AttentionShape,
        precision: Precision,
        overrides: &PlanOverrides,
    ) -> Result<Planned> {
        plan_forward(
            &PlanRequest::for_shape(shape, precision, *overrides),
            &self.caps(),
        )
    }

    /// The backward plan for a problem under `overrides`, with its clamps
    /// (tuned plans aside: see [`Engine::tuned_overrides`]).
    pub fn plan_backward(
        &self,
        shape: &AttentionShape,
        precision: Precision,
        overrides: &PlanOverrides,
    ) -> Result<Planned> {
        plan_backward(
            &PlanRequest::for_shape(shape, precision, *overrides),
            &self.caps(),
        )
    }
}

/// The operations, blocking (native) and async.
impl Engine {
    /// Exact attention forward on host tensors.
    ///
    /// ```
    /// use flashattn::{AttentionOptions, Engine, ForwardInputs, TensorView};
    ///
    /// let engine = Engine::new()?;
    /// let x: Vec<f32> = (0..16 * 2 * 32).map(|i| (i % 7) as f32 / 7.0).collect();
    /// let view = TensorView::f32([1, 16, 2, 32], &x); // (batch, seq, heads, head_dim)
    /// let opts = AttentionOptions::default().causal(true);
    /// let out = engine.forward(&ForwardInputs::new(view, view, view), &opts)?;
    /// // Within docs/semantics.md's accuracy rule of the f64 reference.
    /// for check in flashattn::accuracy::check_forward(&out, &view, &view, &view, &opts)? {
    ///     assert!(check.passed(), "{check}");
    /// }
    /// # Ok::<(), flashattn::Error>(())
    /// ```
    #[cfg(not(target_arch = "wasm32"))]
    pub fn forward(
        &self,
        inputs: &ForwardInputs,
        opts: &AttentionOptions,
    ) -> Result<ForwardOutput> {
        self.forward_with(inputs, opts, &PlanOverrides::default())
    }

    /// [`Engine::forward`] with plan overrides. Problems larger than one
    /// storage binding, the dispatch grid or the adapter's loop limit are
    /// split, never rejected.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn forward_with(
        &self,
        inputs: &ForwardInputs,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<ForwardOutput> {
        pollster::block_on(self.forward_async(inputs, opts, overrides))
    }

    /// [`Engine::forward_with`] as a future.
    pub async fn forward_async(
        &self,
        inputs: &ForwardInputs<'_>,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<ForwardOutput> {
        scoped(&self.gpu.device, "a forward", async {
            let problem = Problem::forward(inputs, opts)?;
            let routed = self.route(CallKind::Forward, &problem, overrides).await?;
            let run = &routed.overrides;
            let mut out = ops::forward::forward(&self.gpu, inputs, &problem, run).await?;
            routed.finish(&mut out.stats, &mut out.o, self.verifier.fault.as_ref());
            Ok(out)
        })
        .await
    }

    /// Verify the family a forward or backward call of `problem` runs
    /// (see [`crate::verify`]) under the caller's overrides, or a tuned
    /// plan's where it gives none: the overrides to run it with.
    async fn route(
        &self,
        call: CallKind,
        problem: &Problem<'_>,
        overrides: &PlanOverrides,
    ) -> Result<Routed> {
        let pass = match call {
            CallKind::Backward => Pass::Backward,
            _ => Pass::Forward,
        };
        let run = self.overrides_for(pass, problem, overrides);
        self.verifier
            .route(&self.gpu, call, problem, overrides, run)
            .await
    }

    /// FP8 (e4m3) attention forward (docs/semantics.md): q, k, v (any storage
    /// precision) quantized on the device with per-(batch, head) scales, q
    /// and k through the seeded Hadamard transform when `fp8` asks; `o` is
    /// f32. Runs as one dispatch set: past one storage binding, the grid or
    /// the loop limit it is an error, not split.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn forward_fp8(
        &self,
        inputs: &ForwardInputs,
        opts: &AttentionOptions,
        fp8: &Fp8Options,
    ) -> Result<ForwardOutput> {
        self.forward_fp8_with(inputs, opts, fp8, &PlanOverrides::default())
    }

    /// [`Engine::forward_fp8`] with plan overrides.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn forward_fp8_with(
        &self,
        inputs: &ForwardInputs,
        opts: &AttentionOptions,
        fp8: &Fp8Options,
        overrides: &PlanOverrides,
    ) -> Result<ForwardOutput> {
        pollster::block_on(self.forward_fp8_async(inputs, opts, fp8, overrides))
    }

    /// [`Engine::forward_fp8_with`] as a future.
    pub async fn forward_fp8_async(
        &self,
        inputs: &ForwardInputs<'_>,
        opts: &AttentionOptions,
        fp8: &Fp8Options,
        overrides: &PlanOverrides,
    ) -> Result<ForwardOutput> {
        scoped(&self.gpu.device, "an FP8 forward", async {
            ops::fp8::forward(&self.gpu, inputs, opts, fp8, overrides).await
        })
        .await
    }

    /// One tensor quantized to e4m3 by the device's kernels and read back:
    /// exactly what the FP8 forward runs on (and what
    /// [`crate::quant::quantize`] computes on the host).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn quantize_fp8(&self, x: &TensorView, fp8: &Fp8Options) -> Result<Fp8Tensor> {
        pollster::block_on(self.quantize_fp8_async(x, fp8))
    }

    /// [`Engine::quantize_fp8`] as a future.
    pub async fn quantize_fp8_async(
        &self,
        x: &TensorView<'_>,
        fp8: &Fp8Options,
    ) -> Result<Fp8Tensor> {
        scoped(&self.gpu.device, "quantizing to FP8", async {
            ops::fp8::quantize(&self.gpu, x, fp8).await
        })
        .await
    }

    /// Gradients dq, dk, dv from the forward's inputs, its `o` and `lse`, and
    /// the output gradient.
    ///
    /// ```
    /// use flashattn::{AttentionOptions, BackwardInputs, Engine, ForwardInputs, TensorView};
    ///
    /// let engine = Engine::new()?;
    /// let x: Vec<f32> = (0..16 * 2 * 32).map(|i| (i % 5) as f32 / 5.0).collect();
    /// let view = TensorView::f32([1, 16, 2, 32], &x);
    /// let opts = AttentionOptions::default().causal(true);
    /// let fwd = engine.forward(&ForwardInputs::new(view, view, view), &opts)?;
    /// let d_o = view; // the loss's gradient with respect to o
    /// let inputs = BackwardInputs::new(ForwardInputs::new(view, view, view), &fwd, d_o)?;
    /// let grads = engine.backward(&inputs, &opts)?;
    /// for check in flashattn::accuracy::check_backward(&grads, &view, &view, &view, &d_o, &opts)? {
    ///     assert!(check.passed(), "{check}");
    /// }
    /// # Ok::<(), flashattn::Error>(())
    /// ```
    #[cfg(not(target_arch = "wasm32"))]
    pub fn backward(
        &self,
        inputs: &BackwardInputs,
        opts: &AttentionOptions,
    ) -> Result<BackwardOutput> {
        self.backward_with(inputs, opts, &PlanOverrides::default())
    }

    /// [`Engine::backward`] with plan overrides.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn backward_with(
        &self,
        inputs: &BackwardInputs,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<BackwardOutput> {
        pollster::block_on(self.backward_async(inputs, opts, overrides))
    }

    /// [`Engine::backward_with`] as a future.
    pub async fn backward_async(
        &self,
        inputs: &BackwardInputs<'_>,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<BackwardOutput> {
        scoped(&self.gpu.device, "a backward", async {
            let problem = Problem::backward(inputs, opts)?;
            let routed = self.route(CallKind::Backward, &problem, overrides).await?;
            let run = &routed.overrides;
            let mut out = ops::backward::backward(&self.gpu, inputs, &problem, run).await?;
            routed.finish(&mut out.stats, &mut out.dq, self.verifier.fault.as_ref());
            Ok(out)
        })
        .await
    }

    /// Time every candidate plan of one pass on this adapter, store the
    /// fastest in the request's cache and report them all (see
    /// `tune`).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn tune(&self, req: &TuneRequest) -> Result<TuneReport> {
        pollster::block_on(self.tune_async(req))
    }

    /// [`Engine::tune`] as a future.
    #[cfg(not(target_arch = "wasm32"))]
    pub async fn tune_async(&self, req: &TuneRequest) -> Result<TuneReport> {
        scoped(&self.gpu.device, "tuning", async {
            tune::tune(&self.gpu, req).await
        })
        .await
    }

    /// Forward, then backward with its `o` and `lse`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn forward_backward(
        &self,
        inputs: &ForwardInputs,
        d_o: &TensorView,
        opts: &AttentionOptions,
    ) -> Result<(ForwardOutput, BackwardOutput)> {
        pollster::block_on(self.forward_backward_async(inputs, d_o, opts))
    }

    /// [`Engine::forward_backward`] as a future.
    pub async fn forward_backward_async(
        &self,
        inputs: &ForwardInputs<'_>,
        d_o: &TensorView<'_>,
        opts: &AttentionOptions,
    ) -> Result<(ForwardOutput, BackwardOutput)> {
        let none = PlanOverrides::default();
        let fwd = self.forward_async(inputs, opts, &none).await?;
        let inputs = BackwardInputs::new(*inputs, &fwd, *d_o)?;
        let bwd = self.backward_async(&inputs, opts, &none).await?;
        Ok((fwd, bwd))
    }

    /// Forward on caller-owned device buffers (data stays on the GPU). Every
    /// tensor must fit one storage binding and the call the adapter's loop
    /// limit ([`crate::Error::LoopBudget`] otherwise): this API never splits.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn forward_buffers(
        &self,
        buffers: &AttentionBuffers,
        shape: &AttentionShape,
        precision: Precision,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<CallStats> {
        pollster::block_on(self.forward_buffers_async(buffers, shape, precision, opts, overrides))
    }

    /// [`Engine::forward_buffers`] as a future.
    pub async fn forward_buffers_async(
        &self,
        buffers: &AttentionBuffers<'_>,
        shape: &AttentionShape,
        precision: Precision,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<CallStats> {
        scoped(&self.gpu.device, "a forward on buffers", async {
            let problem = Problem::new(*shape, precision, opts)?;
            let routed = self.route(CallKind::Forward, &problem, overrides).await?;
            let run = &routed.overrides;
            let mut stats =
                ops::forward::forward_buffers(&self.gpu, buffers, &problem, run).await?;
            stats.verification = routed.verification;
            Ok(stats)
        })
        .await
    }

    /// Record the forward of `problem` into the app's `encoder`, on ranges
    /// of the app's own buffers (`bindings`: any offsets that are multiples
    /// of the device's `min_storage_buffer_offset_alignment`), and return
    /// the plan it runs. Nothing is submitted, waited on or read back: the
    /// app submits the encoder with its own passes, and `o` and `lse` are
    /// written when that submission runs. Everything is checked first —
    /// misaligned offsets (`MisalignedBinding`), ranges outside their
    /// buffer (`BindingOutsideBuffer`) or too small for the shape
    /// (`BufferTooSmall`), an output range intersecting another tensor's
    /// (`OverlappingBindings`), a call past one storage binding, the
    /// dispatch grid or the adapter's loop limit (it is never split) — and
    /// on an error nothing has been recorded. The kernel family is verified
    /// on first use as for every call (a known-answer check the engine
    /// submits itself, once per family and device). Outputs may lie in the
    /// buffer the inputs are bound from: WebGPU binds one buffer read-only
    /// or writable in a dispatch, not both, so such a call runs the
    /// kernels' form that binds every tensor writable (a pipeline of its
    /// own; inputs in buffers of their own keep the read-only loads drivers
    /// may cache).
    ///
    /// ```
    /// # fn main() -> flashattn::Result<()> {
    /// use flashattn::{AttentionBindings, AttentionOptions, AttentionShape, Engine, Precision, Problem};
    /// let engine = Engine::new()?;
    /// let shape = AttentionShape::new(1, 64, 64, 4, 4, 32)?;
    /// let opts = AttentionOptions::default().causal(true);
    /// let problem = Problem::new(shape, Precision::F32, &opts)?;
    /// // The app's buffers, tensors at 256-byte aligned offsets: inputs in
    /// // one, outputs in another (so the inputs stay read-only).
    /// let tensor = (shape.q_len() * 4) as u64;
    /// let buffer = |label, size| engine.device().create_buffer(&flashattn::wgpu::BufferDescriptor {
    ///     label: Some(label),
    ///     size,
    ///     usage: flashattn::wgpu::BufferUsages::STORAGE,
    ///     mapped_at_creation: false,
    /// });
    /// let (inputs, outputs) = (buffer("inputs", 3 * tensor), buffer("outputs", 2 * tensor));
    /// let at = |b, i: u64, bytes: u64| flashattn::wgpu::BufferBinding {
    ///     buffer: b,
    ///     offset: i * tensor,
    ///     size: flashattn::wgpu::BufferSize::new(bytes),
    /// };
    /// let bindings = AttentionBindings {
    ///     q: at(&inputs, 0, tensor), k: at(&inputs, 1, tensor), v: at(&inputs, 2, tensor),
    ///     o: at(&outputs, 0, tensor), lse: at(&outputs, 1, (shape.lse_len() * 4) as u64),
    /// };
    /// let mut encoder = engine.device().create_command_encoder(&Default::default());
    /// engine.encode_forward(&mut encoder, &problem, &bindings)?;
    /// engine.queue().submit([encoder.finish()]);
    /// # Ok(()) }
    /// ```
    #[cfg(not(target_arch = "wasm32"))]
    pub fn encode_forward(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        problem: &Problem,
        bindings: &AttentionBindings,
    ) -> Result<Plan> {
        pollster::block_on(self.encode_forward_async(encoder, problem, bindings))
    }

    /// [`Engine::encode_forward`] as a future (it resolves once the
    /// pipelines are compiled and the family verified; the work itself is
    /// only recorded).
    pub async fn encode_forward_async(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        problem: &Problem<'_>,
        bindings: &AttentionBindings<'_>,
    ) -> Result<Plan> {
        scoped(&self.gpu.device, "recording a forward", async {
            let none = PlanOverrides::default();
            let routed = self.route(CallKind::Forward, problem, &none).await?;
            ops::forward::encode(&self.gpu, encoder, bindings, problem, &routed.overrides).await
        })
        .await
    }

    /// Record the backward of `problem` into the app's `encoder` on ranges
    /// of its buffers (the forward's q, k, v, o, lse and the output gradient
    /// in; dq, dk, dv out, in ranges that intersect no other), and return
    /// the plan it runs: [`Engine::encode_forward`]'s contract — nothing
    /// submitted, everything checked before anything is recorded, the
    /// family verified on first use. D (`rowsum(dO·O)`) goes into the
    /// caller's scratch ([`Engine::scratch_size`] bytes, a range that
    /// intersects no other), or where none is given a buffer created for
    /// the call. Sinks
    /// (whose gradient has no binding here) are `Unsupported`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn encode_backward(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        problem: &Problem,
        bindings: &GradientBindings,
    ) -> Result<Plan> {
        pollster::block_on(self.encode_backward_async(encoder, problem, bindings))
    }

    /// Bytes of scratch an encoded call of `pass` over `problem` uses: the
    /// size of [`GradientBindings::scratch`] for a backward (D, one f32 per
    /// row and query head); 0 for a forward, which needs none.
    pub fn scratch_size(&self, pass: Pass, problem: &Problem) -> u64 {
        match pass {
            Pass::Forward => 0,
            Pass::Backward => ops::backward::scratch_size(&problem.shape),
        }
    }

    /// [`Engine::encode_backward`] as a future.
    pub async fn encode_backward_async(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        problem: &Problem<'_>,
        bindings: &GradientBindings<'_>,
    ) -> Result<Plan> {
        scoped(&self.gpu.device, "recording a backward", async {
            let none = PlanOverrides::default();
            let routed = self.route(CallKind::Backward, problem, &none).await?;
            ops::backward::encode(&self.gpu, encoder, bindings, problem, &routed.overrides).await
        })
        .await
    }

    /// Record the FP8 forward of `problem` into the app's `encoder` on
    /// ranges of its buffers, and return the plan of its attention kernel:
    /// [`Engine::forward_fp8`]'s results, with [`Engine::encode_forward`]'s
    /// contract (nothing submitted, everything checked before anything is
    /// recorded, outputs may share the inputs' buffer where no ranges
    /// intersect). q, k and v are f32 (`problem.precision` must be
    /// [`Precision::F32`]: they are quantized on the device, as the host
    /// call quantizes its f32 values); o is f32 and lse as always. The
    /// codes and, where the stored rows are longer than the head dim, the
    /// padded output go into `scratch` ([`Engine::fp8_scratch_size`] bytes,
    /// a range intersecting no other) or, where none is given, buffers
    /// created for the call; the padded rows are copied, cut to the head
    /// dim, into o within the recorded work. The inputs' values are not
    /// checked (they are on the device): a non-finite one gives non-finite
    /// outputs rather than `NonFiniteInput`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn encode_forward_fp8(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        problem: &Problem,
        fp8: &Fp8Options,
        bindings: &AttentionBindings,
        scratch: Option<&wgpu::BufferBinding>,
    ) -> Result<Plan> {
        pollster::block_on(self.encode_forward_fp8_async(encoder, problem, fp8, bindings, scratch))
    }

    /// [`Engine::encode_forward_fp8`] as a future.
    pub async fn encode_forward_fp8_async(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        problem: &Problem<'_>,
        fp8: &Fp8Options,
        bindings: &AttentionBindings<'_>,
        scratch: Option<&wgpu::BufferBinding<'_>>,
    ) -> Result<Plan> {
        scoped(&self.gpu.device, "recording an FP8 forward", async {
            let none = PlanOverrides::default();
            ops::fp8::encode(&self.gpu, encoder, bindings, scratch, problem, fp8, &none).await
        })
        .await
    }

    /// Bytes of scratch [`Engine::encode_forward_fp8`] uses for `problem`
    /// under `fp8`: the codes of q, k and v and, where the stored rows are
    /// longer than the head dim, the padded output, each at an offset the
    /// device binds.
    pub fn fp8_scratch_size(&self, problem: &Problem, fp8: &Fp8Options) -> u64 {
        ops::fp8::Scratch::new(&self.gpu, &problem.shape, fp8).total
    }

    /// Naive attention: `S = scale·QKᵀ` and `P = softmax(S)` stored, then `O = PV`.
    /// Takes the band, score options and dropout (the same mask as every
    /// backend); other layouts are `Unsupported`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn naive_forward(
        &self,
        inputs: &ForwardInputs,
        opts: &AttentionOptions,
    ) -> Result<ForwardOutput> {
        pollster::block_on(self.naive_forward_async(inputs, opts))
    }

    /// [`Engine::naive_forward`] as a future.
    pub async fn naive_forward_async(
        &self,
        inputs: &ForwardInputs<'_>,
        opts: &AttentionOptions,
    ) -> Result<ForwardOutput> {
        scoped(&self.gpu.device, "a naive forward", async {
            ops::naive::naive_forward(&self.gpu, inputs, opts).await
        })
        .await
    }

    /// Naive gradients: S, P, dP/dS stored; dQ, dK, dV as matmuls over them.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn naive_backward(
        &self,
        inputs: &ForwardInputs,
        d_o: &TensorView,
        opts: &AttentionOptions,
    ) -> Result<BackwardOutput> {
        pollster::block_on(self.naive_backward_async(inputs, d_o, opts))
    }

    /// [`Engine::naive_backward`] as a future.
    pub async fn naive_backward_async(
        &self,
        inputs: &ForwardInputs<'_>,
        d_o: &TensorView<'_>,
        opts: &AttentionOptions,
    ) -> Result<BackwardOutput> {
        scoped(&self.gpu.device, "a naive backward", async {
            ops::naive::naive_backward(&self.gpu, inputs, d_o, opts).await
        })
        .await
    }

    /// The practical ceiling: the tuned f32 matmul of one of attention's
    /// products (`shape`: S = QKᵀ or O = PV) at N, d, timed `repeats` times
    /// after a warm-up.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn matmul_ceiling(
        &self,
        shape: CeilingShape,
        n: usize,
        d: usize,
        repeats: usize,
    ) -> Result<CeilingResult> {
        pollster::block_on(self.matmul_ceiling_async(shape, n, d, repeats))
    }

    /// [`Engine::matmul_ceiling`] as a future.
    pub async fn matmul_ceiling_async(
        &self,
        shape: CeilingShape,
        n: usize,
        d: usize,
        repeats: usize,
    ) -> Result<CeilingResult> {
        scoped(&self.gpu.device, "the matmul ceiling", async {
            ops::ceiling::matmul_ceiling(&self.gpu, shape, n, d, repeats).await
        })
        .await
    }

    /// The adapter's storage bandwidth: `bytes` (rounded up to 16; at most
    /// one storage binding) copied by the copy kernel `repeats` times after
    /// a warm-up; [`BandwidthResult::gbps`] is bytes read plus written per
    /// second of the fastest repeat.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn copy_bandwidth(&self, bytes: u64, repeats: usize) -> Result<BandwidthResult> {
        pollster::block_on(self.copy_bandwidth_async(bytes, repeats))
    }

    /// [`Engine::copy_bandwidth`] as a future.
    pub async fn copy_bandwidth_async(
        &self,
        bytes: u64,
        repeats: usize,
    ) -> Result<BandwidthResult> {
        scoped(&self.gpu.device, "the copy bandwidth", async {
            ops::bandwidth::copy_bandwidth(&self.gpu, bytes, repeats).await
        })
        .await
    }

    /// An all-zero KV cache on the device, kept between decoding steps.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn kv_cache(&self, shape: CacheShape, precision: Precision) -> Result<KvCache> {
        pollster::block_on(self.kv_cache_async(shape, precision))
    }

    /// [`Engine::kv_cache`] as a future.
    pub async fn kv_cache_async(&self, shape: CacheShape, precision: Precision) -> Result<KvCache> {
        scoped(&self.gpu.device, "creating a KV cache", async {
            KvCache::zeros(&self.gpu, shape, precision)
        })
        .await
    }

    /// A device copy of a host KV cache.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn upload_kv_cache(&self, host: &HostKvCache) -> Result<KvCache> {
        pollster::block_on(self.upload_kv_cache_async(host))
    }

    /// [`Engine::upload_kv_cache`] as a future.
    pub async fn upload_kv_cache_async(&self, host: &HostKvCache) -> Result<KvCache> {
        scoped(&self.gpu.device, "uploading a KV cache", async {
            KvCache::upload(&self.gpu, host)
        })
        .await
    }

    /// An empty quantized KV cache on the device (docs/kv-quantization.md):
    /// zero codes, every block scale `MIN_CACHE_SCALE`; its steps' q,
    /// `k_new`, `v_new` and o in `precision`. [`Engine::decode`] and
    /// [`Engine::encode_decode`] take it as they take a plain cache.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn quantized_kv_cache(
        &self,
        shape: CacheShape,
        quant: crate::CacheQuant,
        precision: Precision,
    ) -> Result<KvCache> {
        pollster::block_on(self.quantized_kv_cache_async(shape, quant, precision))
    }

    /// [`Engine::quantized_kv_cache`] as a future.
    pub async fn quantized_kv_cache_async(
        &self,
        shape: CacheShape,
        quant: crate::CacheQuant,
        precision: Precision,
    ) -> Result<KvCache> {
        scoped(&self.gpu.device, "creating a KV cache", async {
            KvCache::zeros_quantized(&self.gpu, shape, quant, precision)
        })
        .await
    }

    /// A device copy of a quantized host cache: its codes, four per word,
    /// then its block scales, in one buffer for K and one for V (checked as
    /// [`QuantKvCache::new`] checks).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn upload_quantized_kv_cache(&self, host: &QuantKvCache) -> Result<KvCache> {
        pollster::block_on(self.upload_quantized_kv_cache_async(host))
    }

    /// [`Engine::upload_quantized_kv_cache`] as a future.
    pub async fn upload_quantized_kv_cache_async(&self, host: &QuantKvCache) -> Result<KvCache> {
        scoped(&self.gpu.device, "uploading a KV cache", async {
            KvCache::upload_quantized(&self.gpu, host)
        })
        .await
    }

    /// A quantized device cache's codes and scales, on the host
    /// (`Error::CacheFormat` for a plain cache, which
    /// [`Engine::read_kv_cache`] reads).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_quantized_kv_cache(&self, cache: &KvCache) -> Result<QuantKvCache> {
        pollster::block_on(self.read_quantized_kv_cache_async(cache))
    }

    /// [`Engine::read_quantized_kv_cache`] as a future.
    pub async fn read_quantized_kv_cache_async(&self, cache: &KvCache) -> Result<QuantKvCache> {
        scoped(&self.gpu.device, "reading a KV cache", async {
            cache.read_quantized(&self.gpu).await
        })
        .await
    }

    /// A KV cache on ranges of the app's own buffers: K on `k`, V on `v`
    /// (`(outer, inner, heads_kv, head_dim)` row-major in `precision`, f16
    /// and bf16 two per word; one buffer or two, the ranges disjoint:
    /// `OverlappingBindings` otherwise). Each
    /// range is checked as an encoded call's are — an offset that is a
    /// multiple of the device's `min_storage_buffer_offset_alignment`
    /// (`MisalignedBinding`), inside its buffer (`BindingOutsideBuffer`),
    /// room for the cache (`BufferTooSmall`), within one storage binding
    /// (`BindingTooLarge`). The cache keeps clones of the buffer handles and
    /// binds exactly the cache's bytes from each offset; its contents are
    /// whatever the app put there (zeros in a new buffer). The buffers need
    /// `STORAGE` usage (`BufferUsage`), and `COPY_SRC` for
    /// [`Engine::read_kv_cache`]. A
    /// latent shape ([`CacheShape::latent`]) lives on `k` alone: V is read
    /// from it, and `v` is neither checked nor bound.
    pub fn kv_cache_in(
        &self,
        shape: CacheShape,
        precision: Precision,
        k: wgpu::BufferBinding,
        v: wgpu::BufferBinding,
    ) -> Result<KvCache> {
        ops::decode::cache_in(&self.gpu, shape, precision, &k, &v)
    }

    /// A device KV cache's contents, on the host.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn read_kv_cache(&self, cache: &KvCache) -> Result<HostKvCache> {
        pollster::block_on(self.read_kv_cache_async(cache))
    }

    /// [`Engine::read_kv_cache`] as a future.
    pub async fn read_kv_cache_async(&self, cache: &KvCache) -> Result<HostKvCache> {
        scoped(&self.gpu.device, "reading a KV cache", async {
            cache.read(&self.gpu).await
        })
        .await
    }

    /// The decode plan a step would run with (splits, tiles, and why).
    pub fn plan_decode(
        &self,
        problem: &DecodeProblem,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodePlan> {
        problem.check()?;
        ops::decode::plan(&self.gpu, problem, opts, num_splits, None)
    }

    /// [`Engine::plan_decode`] on a forced decode kernel (`Lanes`, or
    /// `Tiled` for the workgroup-memory one): what a step runs after a
    /// failed lanes check.
    pub fn plan_decode_on(
        &self,
        problem: &DecodeProblem,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
        kernel: Option<crate::plan::KernelFamily>,
    ) -> Result<DecodePlan> {
        problem.check()?;
        ops::decode::plan(&self.gpu, problem, opts, num_splits, kernel)
    }

    /// One decoding step on a device cache: the step's `k_new`/`v_new`
    /// appended in place (by a kernel), then attention over each sequence's
    /// keys, split across workgroups as planned (`num_splits` `None` or
    /// `Some(0)`) or as asked. A step that fails validation changes nothing.
    ///
    /// ```
    /// use flashattn::{AttentionOptions, CacheLayout, CacheShape, DecodeStep, Engine};
    /// use flashattn::{HostKvCache, TensorData, TensorView};
    ///
    /// let engine = Engine::new()?;
    /// // Two sequences of up to 64 tokens, 2 key/value heads of 32.
    /// let shape = CacheShape::new(CacheLayout::Dense { batch: 2, capacity: 64 }, 2, 32)?;
    /// let n = 2 * 64 * 2 * 32;
    /// let k = TensorData::F32((0..n).map(|i| (i % 9) as f32 / 9.0).collect());
    /// let host = HostKvCache::new(shape, k.clone(), k)?;
    /// let mut cache = engine.upload_kv_cache(&host)?;
    /// // One new token per sequence (4 query heads), appended after the
    /// // 10 and 20 tokens cached so far.
    /// let (q, new) = (vec![0.1f32; 2 * 4 * 32], vec![0.5f32; 2 * 2 * 32]);
    /// let lens = [10, 20];
    /// let new = TensorView::f32([2, 1, 2, 32], &new);
    /// let step = DecodeStep::new(TensorView::f32([2, 1, 4, 32], &q), &lens).append(new, new);
    /// let opts = AttentionOptions::default();
    /// let out = engine.decode(&mut cache, &step, &opts, None)?;
    /// for check in flashattn::accuracy::check_decode(&out, &host, &step, &opts)? {
    ///     assert!(check.passed(), "{check}");
    /// }
    /// # Ok::<(), flashattn::Error>(())
    /// ```
    #[cfg(not(target_arch = "wasm32"))]
    pub fn decode(
        &self,
        cache: &mut KvCache,
        step: &DecodeStep,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodeOutput> {
        pollster::block_on(self.decode_async(cache, step, opts, num_splits))
    }

    /// [`Engine::decode`] as a future.
    pub async fn decode_async(
        &self,
        cache: &mut KvCache,
        step: &DecodeStep<'_>,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodeOutput> {
        scoped(&self.gpu.device, "a decoding step", async {
            self.routed_step(step, *cache.shape(), cache.precision(), cache.quant(), async |kernel| {
                ops::decode::decode(&self.gpu, cache, step, opts, num_splits, kernel).await
            })
            .await
        })
        .await
    }

    /// Record one decoding step into the app's `encoder`, on `cache` (the
    /// engine's or on the app's buffers, [`Engine::kv_cache_in`]) and the
    /// app's ranges `bindings`, and return the plan it runs. `step` gives
    /// the shapes and the host index arrays ([`DecodeStep::spec`] reads them
    /// off a host step). Where `bindings.new_kv` is given, the step's
    /// `seqlen_new` rows are appended first, as [`Engine::decode`] appends
    /// them; where it is `None` they count as appended already (by
    /// [`Engine::encode_append`] earlier in the encoder, or a step that
    /// appends none): either way each sequence attends to its
    /// `cache_seqlens[b] + seqlen_new` keys. Splits as planned (`num_splits`
    /// `None` or `Some(0)`) or as asked, within the adapter's loop limit;
    /// their partials go to `bindings.scratch`
    /// ([`Engine::decode_scratch_size`] bytes) or a buffer created for the
    /// call. [`Engine::encode_forward`]'s contract: nothing submitted,
    /// waited on or read back; the step and every range checked before
    /// anything is recorded (the typed errors of [`Engine::decode`] and of
    /// the ranges: `MisalignedBinding`, `BindingOutsideBuffer`,
    /// `BufferTooSmall`, `OverlappingBindings`), on an error nothing
    /// recorded; the decode family verified on first use. The index arrays
    /// go into buffers the recorded commands keep alive.
    ///
    /// ```no_run
    /// # fn main() -> flashattn::Result<()> {
    /// use flashattn::wgpu::{BufferBinding, BufferDescriptor, BufferSize, BufferUsages};
    /// use flashattn::{AttentionOptions, CacheLayout, CacheShape, DecodeBindings, DecodeSpec, Engine, Precision};
    /// let engine = Engine::new()?;
    /// let (batch, heads_q, heads_kv, d) = (2, 8, 2, 64);
    /// let layout = CacheLayout::Dense { batch, capacity: 256 };
    /// let shape = CacheShape::new(layout, heads_kv, d)?;
    /// let buffer = |label, size| engine.device().create_buffer(&BufferDescriptor {
    ///     label: Some(label),
    ///     size,
    ///     usage: BufferUsages::STORAGE | BufferUsages::COPY_DST,
    ///     mapped_at_creation: false,
    /// });
    /// let at = |b, offset, bytes| BufferBinding { buffer: b, offset, size: BufferSize::new(bytes) };
    /// // The app's buffers, ranges at 256-byte aligned offsets: the cache
    /// // (K and V) in one, the step's inputs in another, its outputs in a
    /// // third (WebGPU binds a buffer read-only or writable in a dispatch,
    /// // not both, and the append writes the cache while reading k_new).
    /// let cache_bytes = (shape.len() * 4) as u64;
    /// let kv = buffer("kv cache", 2 * cache_bytes);
    /// let cache = engine.kv_cache_in(shape, Precision::F32, at(&kv, 0, cache_bytes), at(&kv, cache_bytes, cache_bytes))?;
    /// // q is 4096 bytes, k_new and v_new 1024 each, lse 64.
    /// let (q_bytes, new_bytes) = ((batch * heads_q * d * 4) as u64, (batch * heads_kv * d * 4) as u64);
    /// let inputs = buffer("step inputs", q_bytes + 2 * new_bytes);
    /// let outputs = buffer("step outputs", q_bytes + 256);
    /// let lens = [17, 40]; // tokens already cached per sequence
    /// let step = DecodeSpec::new([batch, 1, heads_q, d], &lens).append(1);
    /// let bindings = DecodeBindings::new(
    ///     at(&inputs, 0, q_bytes),
    ///     at(&outputs, 0, q_bytes),
    ///     at(&outputs, q_bytes, (batch * heads_q * 4) as u64),
    /// )
    /// .append(at(&inputs, q_bytes, new_bytes), at(&inputs, q_bytes + new_bytes, new_bytes));
    /// let mut encoder = engine.device().create_command_encoder(&Default::default());
    /// let opts = AttentionOptions::default().causal(true);
    /// engine.encode_decode(&mut encoder, &cache, &step, &bindings, &opts, None)?;
    /// engine.queue().submit([encoder.finish()]);
    /// # Ok(()) }
    /// ```
    #[cfg(not(target_arch = "wasm32"))]
    pub fn encode_decode(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        cache: &KvCache,
        step: &DecodeSpec,
        bindings: &DecodeBindings,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodePlan> {
        let call = self.encode_decode_async(encoder, cache, step, bindings, opts, num_splits);
        pollster::block_on(call)
    }

    /// [`Engine::encode_decode`] as a future (it resolves once the
    /// pipelines are compiled and the family verified; the work itself is
    /// only recorded).
    pub async fn encode_decode_async(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        cache: &KvCache,
        step: &DecodeSpec<'_>,
        bindings: &DecodeBindings<'_>,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodePlan> {
        scoped(&self.gpu.device, "recording a decoding step", async {
            let p = DecodeProblem::of_spec(step, cache.shape(), cache.precision())?;
            let routed = self
                .verifier
                .route_decode(&self.gpu, Some(&p), cache.quant())
                .await?;
            let kernel = routed.decode_kernel;
            let mut run = ops::decode::Step::new(&self.gpu, cache, &p, opts, num_splits, kernel)?;
            run.encode(encoder, bindings).await
        })
        .await
    }

    /// Record only the append of a step's `seqlen_new` rows per sequence,
    /// `k_new` and `v_new` on ranges of the app's buffers (not the cache's),
    /// into `cache` at `cache_seqlens[b]..` — what [`Engine::encode_decode`]
    /// does first when given them: for apps that append a layer's keys and
    /// values apart from attending. [`Engine::encode_decode`] later in the
    /// encoder with the same `step` and no `new_kv` attends to them. The
    /// same checks and contract; a step of no new rows records nothing.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn encode_append(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        cache: &KvCache,
        step: &DecodeSpec,
        k_new: wgpu::BufferBinding,
        v_new: wgpu::BufferBinding,
    ) -> Result<()> {
        pollster::block_on(self.encode_append_async(encoder, cache, step, k_new, v_new))
    }

    /// [`Engine::encode_append`] as a future.
    pub async fn encode_append_async(
        &self,
        encoder: &mut wgpu::CommandEncoder,
        cache: &KvCache,
        step: &DecodeSpec<'_>,
        k_new: wgpu::BufferBinding<'_>,
        v_new: wgpu::BufferBinding<'_>,
    ) -> Result<()> {
        scoped(&self.gpu.device, "recording an append", async {
            let p = DecodeProblem::of_spec(step, cache.shape(), cache.precision())?;
            let routed = self
                .verifier
                .route_decode(&self.gpu, Some(&p), cache.quant())
                .await?;
            let opts = AttentionOptions::default();
            let mut run =
                ops::decode::Step::new(&self.gpu, cache, &p, &opts, None, routed.decode_kernel)?;
            run.encode_append(encoder, &k_new, &v_new).await
        })
        .await
    }

    /// Bytes of scratch an encoded step of `problem` planned as `plan`
    /// ([`Engine::plan_decode`], or the plan [`Engine::encode_decode`]
    /// returned) uses: the size of [`DecodeBindings::scratch`], the splits'
    /// partial o and lse; 0 for a step in one split.
    pub fn decode_scratch_size(&self, problem: &DecodeProblem, plan: &DecodePlan) -> u64 {
        ops::decode::scratch_size(&self.gpu, problem, plan)
    }

    /// A decoding step on a cache of `shape` and `precision` (of `quant`
    /// codes, or plain): the family it runs verified, `run` on the decode
    /// kernel verification picked, and the verdict in the output's stats.
    async fn routed_step(
        &self,
        step: &DecodeStep<'_>,
        shape: CacheShape,
        precision: Precision,
        quant: Option<crate::CacheQuant>,
        run: impl AsyncFnOnce(Option<crate::plan::KernelFamily>) -> Result<DecodeOutput>,
    ) -> Result<DecodeOutput> {
        let problem = DecodeProblem::new(step, &shape, precision).ok();
        let routed = self
            .verifier
            .route_decode(&self.gpu, problem.as_ref(), quant)
            .await?;
        let mut out = run(routed.decode_kernel).await?;
        routed.finish(&mut out.stats, &mut out.o, self.verifier.fault.as_ref());
        Ok(out)
    }

    /// [`Engine::decode`] on a host cache (uploaded, and read back when the
    /// step appends): what the command line does.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn decode_host(
        &self,
        cache: &mut HostKvCache,
        step: &DecodeStep,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodeOutput> {
        pollster::block_on(self.decode_host_async(cache, step, opts, num_splits))
    }

    /// [`Engine::decode_host`] on a quantized host cache (uploaded, and its
    /// codes and scales read back when the step appends; the append kernel
    /// quantizes by docs/kv-quantization.md's rule).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn decode_quantized_host(
        &self,
        cache: &mut QuantKvCache,
        step: &DecodeStep,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodeOutput> {
        let call = self.decode_quantized_host_async(cache, step, opts, num_splits);
        pollster::block_on(call)
    }

    /// [`Engine::decode_quantized_host`] as a future.
    pub async fn decode_quantized_host_async(
        &self,
        cache: &mut QuantKvCache,
        step: &DecodeStep<'_>,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodeOutput> {
        scoped(&self.gpu.device, "a decoding step", async {
            self.routed_step(step, cache.shape, cache.precision, Some(cache.quant), async |kernel| {
                let gpu = &self.gpu;
                ops::decode::decode_quantized_host(gpu, cache, step, opts, num_splits, kernel).await
            })
            .await
        })
        .await
    }

    /// [`Engine::decode_host`] as a future.
    pub async fn decode_host_async(
        &self,
        cache: &mut HostKvCache,
        step: &DecodeStep<'_>,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodeOutput> {
        scoped(&self.gpu.device, "a decoding step", async {
            self.routed_step(step, cache.shape, cache.precision(), None, async |kernel| {
                ops::decode::decode_host(&self.gpu, cache, step, opts, num_splits, kernel).await
            })
            .await
        })
        .await
    }
}

/// The wgpu engine as the one call model ([`crate::Backend`] dispatches
/// through it): the blocking host-tensor calls, decoding on an uploaded
/// copy of the host cache.
#[cfg(not(target_arch = "wasm32"))]
impl AttentionBackend for Engine {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: format!("wgpu on {}", self.describe()),
            backward: true,
            decode: true,
            fp8: true,
            dropout: true,
            quantized_cache: true,
            latent_cache: true,
            plan_overrides: true,
        }
    }

    fn forward(
        &self,
        inputs: &ForwardInputs,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<ForwardOutput> {
        self.forward_with(inputs, opts, overrides)
    }

    fn forward_fp8(
        &self,
        inputs: &ForwardInputs,
        opts: &AttentionOptions,
        fp8: &Fp8Options,
        overrides: &PlanOverrides,
    ) -> Result<ForwardOutput> {
        self.forward_fp8_with(inputs, opts, fp8, overrides)
    }

    fn backward(
        &self,
        inputs: &BackwardInputs,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<BackwardOutput> {
        self.backward_with(inputs, opts, overrides)
    }

    fn decode(
        &self,
        cache: &mut HostKvCache,
        step: &DecodeStep,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodeOutput> {
        self.decode_host(cache, step, opts, num_splits)
    }

    fn decode_quantized(
        &self,
        cache: &mut QuantKvCache,
        step: &DecodeStep,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodeOutput> {
        self.decode_quantized_host(cache, step, opts, num_splits)
    }
}

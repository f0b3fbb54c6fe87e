//! The CUDA backend (feature `cuda`): FlashAttention-2's forward and
//! backward as CUDA C kernels (the top-level `cuda/` folder), compiled at
//! run time by NVRTC for the device's architecture and loaded through the
//! driver API (cudarc, loaded dynamically: a build with the feature runs
//! everywhere, and without libcuda, NVRTC or a device [`Cuda::new`]
//! returns [`Error::CudaUnavailable`](crate::Error::CudaUnavailable)
//! naming what is missing, never a panic).
//!
//! Three kernel paths ([`plan`] picks one per call from the device's
//! properties; [`KernelPath`] or `FLASHATTN_CUDA_KERNEL=scalar|mma|hopper|auto`
//! forces one, and `no-hopper` is auto without the Hopper forward):
//!
//! - Hopper (cuda/flash_fwd_wgmma.cu, cuda/hopper.cuh), the forward on
//!   compute capability 9.x for f16/bf16 with d % 8 == 0 at padded head
//!   dims 64 and 128: FlashAttention-3's structure — a producer warpgroup
//!   issuing TMA copies (tensor maps from the driver, [`tensor_map`]) into
//!   a two-stage ring on mbarriers, two consumer warpgroups running
//!   `wgmma` for Q Kᵀ and P V with the softmax of the next tile overlapping
//!   the current P V and taking turns at the tensor cores (named barriers),
//!   registers moved between roles by `setmaxnreg`. The
//!   backward stays on the sm80 kernels; `mma` forces the forward off for
//!   comparison. Compiled and assembled for sm_90a and run under host
//!   emulation, not yet run on a GPU;
//! - tensor cores (cuda/flash_fwd_mma.cu, cuda/flash_bwd_mma.cu): f16/bf16
//!   storage at padded head dims up to 128 on compute capability 8.0+:
//!   `mma.sync` m16n8k16 with f32 accumulators, `ldmatrix` fragments and
//!   `cp.async` double-buffered K/V (or Q/dO) tiles;
//! - scalar (cuda/flash_fwd.cu, cuda/flash_bwd.cu): f32 FMAs on tiles
//!   converted to f32 in shared memory; every f32 call (f32 inputs keep
//!   these kernels, they are not converted to f16), head dims past 128,
//!   and devices where the mma kernels' shared memory does not fit.
//!
//! The sm80 and scalar kernels take every mask, score and layout option of docs/semantics.md but a v head
//! dim of its own: causal, local windows, softcap, scale, GQA/MQA, empty
//! rows, ALiBi (per head or per batch entry), attention sinks (their
//! gradient `dsinks` too), block-sparse masks of any block size and packed
//! (varlen) batches, alone or together, head dims 1..=576 (past 128 on
//! the scalar kernels, past 256 at wide variants); both backwards
//! are deterministic (no atomics). The band and softcap are compile-time
//! variants (`KernelKey`); the layouts are not: `layout::Layout`, the last
//! argument of every kernel, points at their side buffers (null when off)
//! and the kernels branch on it uniformly, so no variant is added for them:
//!
//! - ALiBi: `s -= slope · |i + off − j|` after the softcap, one f32 product;
//! - sinks: the forward folds `exp(sink − m)` into each row's sum at the
//!   end (a row with no key: `o = 0`, `lse = sink`); the backward needs
//!   nothing but that `lse`, and `dsinks` is summed on the host in f64, in
//!   row order, from the kernels' `D` read back (deterministic);
//! - block masks: the host lists, for each launch's tiles, the inner tiles
//!   each block visits (`layout::tile_lists`, built by `api::tile_lists`
//!   from `api::block_mask::tile_fate` under the band, encoded by
//!   `layout::cuda_words`), so masked tiles are never loaded; only a
//!   partial tile tests the mask per pair;
//! - packed batches: the grid's z is the sequence, each block reads its
//!   rows from `cu_seqlens` and takes the sequence's lengths (so its band,
//!   ALiBi offset and mask grid are its own); blocks past a short sequence
//!   exit at once.
//!
//! Dropout (docs/dropout.md) is a compile-time variant too (`HAS_DROPOUT`;
//! without it the kernels are the code they were): each block draws a
//! tile's keep bits in shared memory, one Philox call per row and 8 keys,
//! where the tile's operands load (cuda/dropout.cuh), from the call's key,
//! first stream and threshold (`problem::DropoutArgs`, every attention
//! kernel's last argument) at the sequence's index, the query head and the
//! positions in the sequence, so the mask is `dropout_mask`'s bit for bit.
//!
//! The Hopper forward takes the band and score options (causal, windows,
//! softcap, scale, GQA/MQA, empty rows) and the layouts (its TMA maps of a
//! packed batch span the packed tensor); calls with dropout run the sm80
//! kernels (the plan says so). `Unsupported`: a v head dim other
//! than q's in the forward and backward (their kernels hold one head dim).
//!
//! The FP8 (e4m3) forward ([`Cuda::forward_fp8`]) runs on Hopper alone
//! (wgmma on e4m3): q, k and v quantized on the device (`fp8_quant`:
//! `crate::quant`'s codes and scales, the Hadamard transform included),
//! then the Hopper forward's FP8 variant on the codes, Vᵀ transposed in
//! shared memory; the band and score options, quantized rows up to 128.
//!
//! Decoding (cuda/flash_decode.cu, [`decode`]) keeps the KV cache in device
//! memory ([`CudaKvCache`]: dense or paged, plain or int8/FP8 codes with
//! block scales); a step copies only its own inputs (counted in
//! [`CallStats::uploaded_bytes`](crate::CallStats::uploaded_bytes)), appends on the device (quantizing by docs/kv-quantization.md's rule),
//! attends in `num_splits` splits (as asked, or planned to fill the SMs) and
//! merges them by their lse. A block takes up to 16 query rows of one
//! sequence and kv head (its GQA group's heads × seqlen_q), so K and V are
//! read once for the group. It takes the band and score options, ALiBi,
//! sinks, v's own head dim and head dims up to 576 (MLA-like shapes) on
//! plain, quantized and latent caches; block masks and packed batches are
//! `Unsupported` in decoding on every backend.
//!
//! - [`kernel`]: the typed key of each compiled variant, its tiles and source;
//! - [`plan`]: which variants a call runs on a device, and why;
//! - [`tensor_map`]: the Hopper forward's TMA tensor maps;
//! - [`compile`]: NVRTC, source to PTX;
//! - [`context`]: the driver, device 0 and the module cache;
//! - [`jit`]: PTX loaded by the driver's JIT (`cuModuleLoadDataEx`) with
//!   its logs kept, each kernel's registers, spills and shared memory as
//!   built, and launches;
//! - disk_cache: PTX kept between processes, named by a hash of source,
//!   options and architecture (`FLASHATTN_CUDA_CACHE` to place it;
//!   [`warm_ptx_cache`] fills it over all cores);
//! - layout: the run-time layouts' struct, side buffers and tile lists;
//! - forward and backward: uploads, launches, readbacks;
//! - [`decode`]: the device cache, a step's uploads, splits and launches;
//! - [`fp8_quant`]: the FP8 forward's inputs to e4m3 codes on the device;
//! - bandwidth: the device's copy bandwidth, decoding's yardstick;
//! - [`verify`]: each kernel path checked on first use (Hopper → sm80 →
//!   scalar where one fails), and `flashattn doctor --backend cuda`'s matrix.
//!
//! Tests without a GPU (tests/cuda.rs): the typed error without a driver,
//! every variant through NVRTC where libnvrtc loads (and ptxas's spill
//! count), and the kernels run on the CPU under cuda/emulate/ against a
//! double reference where a C++20 compiler is named:
//!
//! ```text
//! pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12
//! export LD_LIBRARY_PATH=$SITE/nvidia/cuda_nvrtc/lib    # libnvrtc.so.12
//! export FLASHATTN_PTXAS=$SITE/nvidia/cuda_nvcc/bin/ptxas  # optional: spills
//! export FLASHATTN_CXX=g++                                 # optional: emulation
//! FLASHATTN_REQUIRE_NVRTC=1 cargo test --release --features cuda --test cuda
//! ```

mod backward;
mod bandwidth;
pub mod compile;
pub mod context;
pub mod decode;
mod disk_cache;
mod driver_error;
mod forward;
mod fp8;
pub mod fp8_quant;
pub mod jit;
pub mod kernel;
mod layout;
pub mod plan;
mod problem;
pub mod tensor_map;
pub mod verify;

pub use compile::Arch;
pub use context::{CudaDevice, ModuleReport};
pub use plan::{DeviceProps, KernelPath};
// For the command line's `doctor` and the tests.
#[cfg(feature = "lab")]
pub use {
    context::{driver_present, versions, Versions},
    disk_cache::warm as warm_ptx_cache,
    plan::CudaPlan,
};

pub use decode::CudaKvCache;

use crate::api::decode::{CacheShape, DecodeOutput, DecodeStep, HostKvCache};
use crate::api::tensor::Precision;
use crate::kv_quant::{CacheQuant, QuantKvCache};
use crate::api::inputs::{BackwardInputs, ForwardInputs};
use crate::api::options::{AttentionOptions, Fp8Options};
use crate::api::output::{BackwardOutput, ForwardOutput};
use crate::api::problem::Problem;
use crate::backend::attend::{AttentionBackend, Capabilities};
use crate::choice::{Operation, Workload};
use crate::error::{Error, Result};
use crate::plan::PlanOverrides;

/// Whether the CUDA kernels take `workload` (no device needed): `Ok`, or
/// the typed error a call on this backend would return.
pub fn takes(workload: &Workload) -> Result<()> {
    let unsupported = |feature| {
        Err(Error::Unsupported {
            what: problem::WHAT,
            feature,
        })
    };
    match workload.operation {
        Operation::Attention => problem::Call::new(&workload.problem()?).map(drop),
        // The Hopper FP8 forward (sm_90a: `Cuda::takes` checks the
        // device): band and score options, quantized rows up to 128.
        Operation::Fp8 => {
            let shape = &workload.shape;
            crate::quant::Fp8Layout::check_supported(shape, &workload.opts)?;
            // The transform's order (the next power of two) is within 128
            // exactly when the head dim is.
            if fp8::fp8_row(shape.head_dim).is_none() {
                return unsupported("FP8 past head dim 128 (the Hopper FP8 forward's rows)");
            }
            // Its softmax takes each row's max of the raw dot products.
            if workload.opts.scale_for(shape.head_dim) <= 0.0 {
                return unsupported("FP8 with a score scale of 0 or below");
            }
            problem::Call::new(&workload.problem()?).map(drop)
        }
        // Decoding (plain or quantized caches) runs cuda/flash_decode.cu,
        // with the options every backend's decoding takes and v's own head dim.
        Operation::Decode | Operation::QuantizedDecode => {
            let shape = &workload.shape;
            workload.opts.for_decoding(shape.batch, shape.heads_q)?;
            let p = workload.problem()?;
            for (tensor, head_dim) in [("q/k", shape.head_dim), ("v", shape.head_dim_v)] {
                if head_dim > kernel::MAX_HEAD_DIM {
                    return Err(Error::HeadDimTooLarge {
                        tensor,
                        head_dim,
                        max: kernel::MAX_HEAD_DIM,
                    });
                }
            }
            problem::Problem::of(&p).map(drop)
        }
    }
}

/// The CUDA backend on device 0.
#[derive(Debug)]
pub struct Cuda {
    device: CudaDevice,
    path: KernelPath,
    /// Each kernel path's verdicts on this device (see [`crate::verify`]).
    verifier: verify::CudaVerifier,
}

impl Cuda {
    /// Open device 0: `Error::CudaUnavailable` naming the missing driver,
    /// NVRTC or device. The kernel path is `FLASHATTN_CUDA_KERNEL`'s (auto
    /// when unset).
    pub fn new() -> Result<Self> {
        let path = KernelPath::from_env()?;
        let device = CudaDevice::open()?;
        Ok(Self {
            verifier: verify::CudaVerifier::new(&device)?,
            device,
            path,
        })
    }

    /// The same device with its kernels compiled for `arch` (`--arch`): an
    /// older architecture than the device's, e.g. `compute_80` on an H100.
    pub fn with_arch(self, arch: Arch) -> Result<Self> {
        Ok(Self {
            device: self.device.with_arch(arch)?,
            ..self
        })
    }

    /// The same device with the kernel path `path`.
    pub fn with_kernels(self, path: KernelPath) -> Self {
        Self { path, ..self }
    }

    /// The device's properties, as the plan sees them.
    pub fn props(&self) -> &DeviceProps {
        &self.device.props
    }

    /// The path kernels are chosen by.
    pub fn kernel_path(&self) -> KernelPath {
        self.path
    }

    /// One line naming the device.
    pub fn describe(&self) -> String {
        self.device.describe()
    }

    /// The NVRTC architecture its kernels are compiled for.
    pub fn arch(&self) -> String {
        self.device.arch()
    }

    /// `key`'s module as the driver's JIT built it on this device, loaded
    /// the way every call loads it: the JIT logs, and each kernel's
    /// registers, local memory (spills) and shared memory.
    pub fn module_report(&self, key: kernel::KernelKey) -> Result<ModuleReport> {
        self.device.module_report(key)
    }

    /// How kernel paths are verified (`FLASHATTN_VERIFY`).
    pub fn verify_mode(&self) -> crate::verify::VerifyMode {
        self.verifier.store.mode()
    }

    /// The device, its compute capability and architecture, the driver's
    /// and NVRTC's versions (`flashattn doctor`).
    pub fn about(&self) -> Vec<(&'static str, String)> {
        let p = &self.device.props;
        let (driver, nvrtc) = verify::versions();
        vec![
            ("compute capability", format!("{}.{}", p.major, p.minor)),
            ("kernels compiled for", self.device.arch()),
            ("CUDA driver", driver),
            ("NVRTC", nvrtc),
            ("kernel path", format!("{:?}", self.path)),
        ]
    }

    /// Every row of this device's verification matrix (`flashattn doctor
    /// --backend cuda`).
    pub fn verification_matrix(&self) -> Vec<verify::CudaEntry> {
        verify::entries(&self.device.props)
    }

    /// Run one row of the matrix now (no verdict read or kept).
    pub fn run_matrix_entry(&self, entry: &verify::CudaEntry) -> crate::verify::matrix::MatrixRow {
        verify::run(&self.device, entry, self.verifier.fault.as_ref())
    }

    /// The path a call runs after its family's verdict (see
    /// [`crate::verify`]), and that verdict; `problem` `None`: a call the
    /// op will reject.
    fn verified(
        &self,
        call: crate::verify::CallKind,
        problem: Option<plan::PlanProblem>,
        path: KernelPath,
    ) -> Result<(KernelPath, Option<crate::verify::Verification>)> {
        match problem {
            Some(p) => self.verifier.route(&self.device, call, &p, path),
            None => Ok((path, None)),
        }
    }

    /// Put the verdict into the stats; perturb `output` where a planted
    /// fault hits the family that ran (lab builds' tests).
    fn finish(
        &self,
        verification: Option<crate::verify::Verification>,
        stats: &mut crate::api::output::CallStats,
        output: &mut crate::api::tensor::Tensor,
    ) {
        if let Some(ran) = verification.as_ref().and_then(|v| v.ran()) {
            crate::verify::Fault::perturb(self.verifier.fault.as_ref(), &ran.family, output);
        }
        stats.verification = verification;
    }

    /// Exact attention forward: o and lse.
    pub fn forward(
        &self,
        inputs: &ForwardInputs,
        opts: &AttentionOptions,
    ) -> Result<ForwardOutput> {
        self.forward_on(self.path, inputs, opts)
    }

    /// The forward on kernel path `path` (this handle's own is ignored;
    /// any but `Auto` is forced: it runs whatever its verdict).
    pub fn forward_on(
        &self,
        path: KernelPath,
        inputs: &ForwardInputs,
        opts: &AttentionOptions,
    ) -> Result<ForwardOutput> {
        let problem = Problem::forward(inputs, opts)?;
        let ForwardInputs { q, k, v } = inputs;
        let plan = problem::Call::new(&problem).map(|c| c.plan_problem()).ok();
        let call = crate::verify::CallKind::Forward;
        let (path, verification) = self.verified(call, plan, path)?;
        let mut out = forward::forward(&self.device, path, q, k, v, &problem)?;
        self.finish(verification, &mut out.stats, &mut out.o);
        Ok(out)
    }

    /// The backward on kernel path `path` (as [`Cuda::forward_on`]).
    pub fn backward_on(
        &self,
        path: KernelPath,
        inputs: &BackwardInputs,
        opts: &AttentionOptions,
    ) -> Result<BackwardOutput> {
        let problem = Problem::backward(inputs, opts)?;
        let plan = problem::Call::new(&problem).map(|c| c.plan_problem()).ok();
        let call = crate::verify::CallKind::Backward;
        let (path, verification) = self.verified(call, plan, path)?;
        let mut out = backward::backward(&self.device, path, inputs, &problem)?;
        self.finish(verification, &mut out.stats, &mut out.dq);
        Ok(out)
    }

    /// The device's copy bandwidth: `bytes` copied from one device buffer
    /// into another by the driver `repeats` times after a warm-up, each
    /// timed by CUDA events; [`BandwidthResult::gbps`](crate::BandwidthResult::gbps)
    /// is bytes read plus written per second of the fastest repeat — what
    /// decoding on a [`CudaKvCache`], which reads each element once, is
    /// held against.
    pub fn copy_bandwidth(&self, bytes: u64, repeats: usize) -> Result<crate::BandwidthResult> {
        bandwidth::copy_bandwidth(&self.device, bytes, repeats)
    }

    /// An all-zero KV cache of `shape` in device memory, of `precision`
    /// elements.
    pub fn kv_cache(&self, shape: CacheShape, precision: Precision) -> Result<CudaKvCache> {
        decode::alloc(&self.device, shape, precision, None)
    }

    /// An empty quantized KV cache of `shape` in device memory: zero
    /// `quant` codes, every block scale `MIN_CACHE_SCALE`; its steps' q,
    /// `k_new`, `v_new` and o are of `precision`.
    pub fn quantized_kv_cache(
        &self,
        shape: CacheShape,
        quant: CacheQuant,
        precision: Precision,
    ) -> Result<CudaKvCache> {
        decode::alloc(&self.device, shape, precision, Some(quant))
    }

    /// A host KV cache copied to device memory (once: steps then append to
    /// it on the device).
    pub fn upload_kv_cache(&self, host: &HostKvCache) -> Result<CudaKvCache> {
        decode::upload(&self.device, host)
    }

    /// A quantized host KV cache (codes and scales) copied to device memory.
    pub fn upload_quantized_kv_cache(&self, host: &QuantKvCache) -> Result<CudaKvCache> {
        decode::upload_quantized(&self.device, host)
    }

    /// A plain device KV cache's contents on the host (a quantized one is
    /// `Error::CacheFormat`).
    pub fn read_kv_cache(&self, cache: &CudaKvCache) -> Result<HostKvCache> {
        decode::read(&self.device, cache)
    }

    /// A quantized device KV cache's codes and scales on the host (a plain
    /// one is `Error::CacheFormat`).
    pub fn read_quantized_kv_cache(&self, cache: &CudaKvCache) -> Result<QuantKvCache> {
        decode::read_quantized(&self.device, cache)
    }

    /// One decoding step on a device cache (cuda/flash_decode.cu): the
    /// step's `k_new`/`v_new` appended in place by a kernel (quantized by
    /// docs/kv-quantization.md's rule on a quantized cache), then each
    /// query row's attention over its sequence's keys, bottom-right aligned
    /// per sequence, in `num_splits` splits merged by their LSE (`None` or
    /// `Some(0)`: as many as fill the SMs; at most 128). Only
    /// the step's inputs are copied to the device, never the cache (their
    /// bytes: the output's `stats.uploaded_bytes`). A step that fails
    /// validation copies, launches and changes nothing.
    pub fn decode(
        &self,
        cache: &mut CudaKvCache,
        step: &DecodeStep,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodeOutput> {
        let (shape, precision) = (*cache.shape(), cache.precision());
        self.verified_step(&shape, precision, step, opts, || {
            decode::decode(&self.device, cache, step, opts, num_splits)
        })
    }

    /// [`Cuda::decode`] on a host cache: uploaded once, the same kernels,
    /// and the cache read back in place when the step appends.
    pub fn decode_host(
        &self,
        cache: &mut HostKvCache,
        step: &DecodeStep,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodeOutput> {
        let (shape, precision) = (cache.shape, cache.precision());
        self.verified_step(&shape, precision, step, opts, || {
            decode::decode_host(&self.device, cache, step, opts, num_splits)
        })
    }

    /// [`Cuda::decode_host`] on a quantized host cache (its codes and
    /// scales read back when the step appends).
    pub fn decode_quantized_host(
        &self,
        cache: &mut QuantKvCache,
        step: &DecodeStep,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodeOutput> {
        let (shape, precision) = (cache.shape, cache.precision);
        self.verified_step(&shape, precision, step, opts, || {
            decode::decode_quantized_host(&self.device, cache, step, opts, num_splits)
        })
    }

    /// A decoding step `run`s once the decode kernels are verified on
    /// first use (a check that cannot be posed, from a step that fails
    /// validation, is left to `run`'s own errors); the verdict goes into
    /// its stats.
    fn verified_step(
        &self,
        shape: &CacheShape,
        precision: Precision,
        step: &DecodeStep,
        opts: &AttentionOptions,
        run: impl FnOnce() -> Result<DecodeOutput>,
    ) -> Result<DecodeOutput> {
        let problem = crate::api::decode::DecodeProblem::new(step, shape, precision)
            .map(|p| verify::decode_problem(p.precision, p.head_dim, opts))
            .ok();
        let call = crate::verify::CallKind::Decode;
        let (_, verification) = self.verified(call, problem, self.path)?;
        let mut out = run()?;
        self.finish(verification, &mut out.stats, &mut out.o);
        Ok(out)
    }

    /// Whether this device's kernels take `workload` (what the kernels take, and the
    /// FP8 forward only where the Hopper kernels run: sm_90a).
    pub fn takes(&self, workload: &Workload) -> Result<()> {
        takes(workload)?;
        if workload.operation == Operation::Fp8 {
            fp8::runs_on(&self.device.props)?;
        }
        Ok(())
    }

    /// The FP8 (e4m3) forward (docs/semantics.md): q, k and v quantized on
    /// the device (`crate::quant`'s codes and scales bit for bit, q and k
    /// through the Hadamard transform where `fp8` asks), then the Hopper
    /// forward on the codes with wgmma on e4m3; `o` in f32. Hopper only
    /// (`Error::CudaArchUnfit` elsewhere), quantized rows up to 128, the
    /// band and score options.
    pub fn forward_fp8(
        &self,
        inputs: &ForwardInputs,
        opts: &AttentionOptions,
        fp8: &Fp8Options,
    ) -> Result<ForwardOutput> {
        fp8::forward_fp8(&self.device, inputs, opts, fp8)
    }

    /// One tensor quantized to e4m3 on the device and read back: what
    /// [`Cuda::forward_fp8`] runs on — [`crate::quant::quantize`]'s codes
    /// and scales, in rows of the FP8 forward's 128 codes.
    pub fn quantize_fp8(&self, x: &crate::api::tensor::TensorView, fp8: &Fp8Options) -> Result<crate::quant::Fp8Tensor> {
        // Before the transform's signs, which are as many as the head dim.
        x.check_len("x")?;
        let layout = crate::quant::Fp8Layout::new(x.shape[3], fp8);
        let row = fp8::stored_row(&layout)?;
        fp8_quant::quantize_to_host(&self.device, x, &layout, row)
    }

    /// Gradients dq, dk, dv from the forward's o and lse.
    pub fn backward(
        &self,
        inputs: &BackwardInputs,
        opts: &AttentionOptions,
    ) -> Result<BackwardOutput> {
        self.backward_on(self.path, inputs, opts)
    }
}

/// The CUDA backend as the one call model: plan overrides are the wgpu
/// planner's and are ignored here (the kernel path is the handle's).
impl AttentionBackend for Cuda {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: format!("cuda on {}", self.describe()),
            backward: true,
            decode: true,
            fp8: fp8::runs_on(&self.device.props).is_ok(),
            dropout: true,
            quantized_cache: true,
            latent_cache: true,
            plan_overrides: false,
        }
    }

    fn forward(
        &self,
        inputs: &ForwardInputs,
        opts: &AttentionOptions,
        _: &PlanOverrides,
    ) -> Result<ForwardOutput> {
        Cuda::forward(self, inputs, opts)
    }

    fn forward_fp8(
        &self,
        inputs: &ForwardInputs,
        opts: &AttentionOptions,
        fp8: &Fp8Options,
        _: &PlanOverrides,
    ) -> Result<ForwardOutput> {
        Cuda::forward_fp8(self, inputs, opts, fp8)
    }

    fn backward(
        &self,
        inputs: &BackwardInputs,
        opts: &AttentionOptions,
        _: &PlanOverrides,
    ) -> Result<BackwardOutput> {
        Cuda::backward(self, inputs, opts)
    }

    fn decode(
        &self,
        cache: &mut HostKvCache,
        step: &DecodeStep,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodeOutput> {
        Cuda::decode_host(self, cache, step, opts, num_splits)
    }

    fn decode_quantized(
        &self,
        cache: &mut QuantKvCache,
        step: &DecodeStep,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodeOutput> {
        Cuda::decode_quantized_host(self, cache, step, opts, num_splits)
    }
}

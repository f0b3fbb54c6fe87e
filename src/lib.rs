//! # flashattn
//!
//! FlashAttention — exact, IO-aware attention — as a portable Rust engine.
//! The forward pass tiles Q into blocks of `Br` rows and streams K/V blocks of
//! `Bc` keys through workgroup memory with an online softmax, so the N×N score
//! matrix never reaches a storage buffer. Kernels are WGSL run through wgpu
//! (Vulkan, Metal, DX12, GL, WebGPU); a multi-threaded CPU backend computes
//! the same thing where no adapter exists, and an f64 reference checks both.
//!
//! ```no_run
//! use flashattn::{AttentionOptions, Engine, ForwardInputs, TensorView};
//!
//! # fn main() -> flashattn::Result<()> {
//! let engine = Engine::new()?; // best adapter, its real limits
//! let (b, s, h, d) = (1, 128, 4, 64);
//! let q = vec![0.1f32; b * s * h * d];
//! let view = TensorView::f32([b, s, h, d], &q);
//! let inputs = ForwardInputs::new(view, view, view);
//! let out = engine.forward(&inputs, &AttentionOptions::default().causal(true))?;
//! println!("o[0] = {}, lse[0] = {}", out.o.to_f32()[0], out.lse[0]);
//! # Ok(()) }
//! ```
//!
//! Semantics (shapes, masks, LSE, empty rows, accuracy) follow the contract in
//! [docs/semantics.md](https://github.com/flashattn/flashattn/blob/main/docs/semantics.md):
//! `q` is `(batch, seqlen_q, heads_q, head_dim)`, `k`/`v` are
//! `(batch, seqlen_k, heads_kv, head_dim)`, `lse` is `(batch, heads_q, seqlen_q)`.
//!
//! ## Public API
//! Everything an app names is re-exported here at the root (`flashattn::X`):
//! [`Engine`] (the wgpu backend), [`Backend`] (choose and run any backend
//! through [`AttentionBackend`]), the tensors, shapes and options callers
//! hand in, the outputs and stats they get back, and [`Error`]. Five
//! modules are public as namespaces of free functions: [`cpu`] (the CPU
//! backend), [`reference`](mod@reference) (the f64 reference), [`accuracy`]
//! (docs/semantics.md's accuracy rule), [`quant`] (FP8 on the host) and
//! [`random`] (seeded test data).
//!
//! ## Layers
//! Internally, from the bottom up; a module imports only from its own
//! layer and those below (`tests/layering.rs` checks it):
//! 1. `error`, [`random`], `disk_cache`, `philox` (dropout's generator);
//! 2. `api`: what callers hand in and get back (tensors, shapes, options,
//!    outputs, stats, the plan and verdicts they report), shared by every
//!    backend;
//! 3. `plan`: pure planning, problem + device limits → tiles and pieces;
//!    [`quant`]: FP8 (e4m3) quantization and incoherent processing on the
//!    host, which the wgpu kernels reproduce bit for bit;
//! 4. [`reference`](mod@reference) and [`accuracy`]: the f64 reference and
//!    docs/semantics.md's accuracy rule; [`AttentionBackend`], the one call
//!    model every backend implements;
//! 5. `kernels`: one unit per kernel — WGSL module, typed key, grid,
//!    bindings, storage-access count, loop cost; [`cpu`], the CPU backend;
//! 6. `runtime`: the device, pipelines by kernel key, pooled buffers,
//!    submission and readback, the adapter's loop limit;
//! 7. `ops`: forward, backward, decoding, the naive baseline, the matmul
//!    ceiling and the copy bandwidth, built from kernels and the runtime;
//! 8. `verify`: every kernel family checked on first use on each device
//!    (a small known-answer run under the accuracy rule), the verdicts
//!    cached, failed families skipped for the next one;
//! 9. `tune`, then [`Engine`] (the operations' public face), then `choice`
//!    (what `auto` measures), the CUDA backend, and [`Backend`] on top.
//!
//! ## Cargo features
//! - `cuda`: the CUDA backend ([`Backend::Cuda`], `BackendKind::Cuda`).
//! - `lab`: unstable, for the project's own tests and command line: the
//!   internal modules above become public, with test hooks such as
//!   planted faults, emulated cooperative matrices and storage-access
//!   counting. Nothing under it is part of the public API.

#![cfg_attr(not(feature = "lab"), warn(missing_docs))]

/// Declares an internal module: `pub(crate)`, or `pub` under the `lab`
/// feature so the project's tests and command line reach its insides.
macro_rules! internal {
    ($(#[$attr:meta])* $name:ident) => {
        $(#[$attr])*
        #[cfg(feature = "lab")]
        #[doc(hidden)]
        pub mod $name;
        $(#[$attr])*
        #[cfg(not(feature = "lab"))]
        pub(crate) mod $name;
    };
}

pub mod accuracy;
internal!(api);
internal!(backend);
internal!(
    #[cfg(not(target_arch = "wasm32"))]
    choice
);
pub mod cpu;
internal!(
    #[cfg(all(feature = "cuda", not(target_arch = "wasm32")))]
    cuda
);
internal!(
    #[cfg(not(target_arch = "wasm32"))]
    disk_cache
);
internal!(engine);
internal!(error);
internal!(kernels);
internal!(ops);
internal!(philox);
internal!(plan);
pub mod kv_quant;
pub mod quant;
pub mod random;
pub mod reference;
internal!(runtime);
internal!(
    #[cfg(not(target_arch = "wasm32"))]
    tune
);
internal!(verify);

pub use api::block_mask::{BlockGrid, BlockMask};
pub use api::decode::{
    BlockTable, CacheLayout, CacheShape, DecodeOutput, DecodeProblem, DecodeSpec, DecodeStep,
    HostKvCache, PageTable,
};
pub use api::dropout::Dropout;
pub use api::dropout_rule::{dropout_mask, DropoutMask};
pub use api::inputs::{BackwardInputs, ForwardInputs};
pub use api::merge::merge_partials;
pub use api::options::{AttentionOptions, Fp8Options, Mask, Positions, Window};
pub use api::output::{Accesses, Allocation, BackwardOutput, CallStats, ForwardOutput, Timing};
pub use api::problem::Problem;
pub use api::scores::{Alibi, Sinks};
pub use api::shape::{AttentionShape, Layout, MAX_HEAD_DIM};
pub use api::size::MAX_ELEMENTS;
pub use api::tensor::{HostData, Precision, Tensor, TensorData, TensorView};
pub use api::varlen::Varlen;
pub use backend::{AttentionBackend, Backend, BackendKind, Capabilities, Choice, Cuda};
#[cfg(not(target_arch = "wasm32"))]
pub use choice::{Operation, ProbeCache, Workload};
pub use cpu::Cpu;
#[cfg(all(feature = "cuda", not(target_arch = "wasm32")))]
pub use cuda::{Arch, CudaKvCache, DeviceProps, KernelPath};
pub use engine::Engine;
pub use error::{Error, Result};
pub use kernels::{AttentionBindings, AttentionBuffers, DecodeBindings, GradientBindings};
pub use kv_quant::{
    CacheQuant, QuantKvCache, QuantizedKv, ScaleBlocks, MIN_CACHE_SCALE, SCALE_BLOCK_TOKENS,
};
pub use ops::bandwidth::BandwidthResult;
pub use ops::ceiling::{CeilingResult, CeilingShape};
pub use plan::{
    Clamp, DecodePlan, DecodeTiles, DeviceCaps, KernelFamily, Pass, Plan, PlanOverrides, Planned,
    Splits, StorageKind,
};
pub use quant::Fp8Tensor;
pub use runtime::KvCache;
#[cfg(not(target_arch = "wasm32"))]
pub use tune::{MaskKind, TuneCache, TuneKey, TuneReport, TuneRequest, Tuned, TunedCandidate};
#[cfg(not(target_arch = "wasm32"))]
pub use verify::VerdictCache;
pub use verify::{CallKind, Checked, FamilyKey, Verdict, Verification, VerifyMode};
/// The wgpu this crate is built on, for apps that pass their own devices and buffers.
pub use wgpu;

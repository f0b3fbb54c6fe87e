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
//! use flashattn::{AttentionOptions, Engine, TensorView};
//!
//! # fn main() -> flashattn::Result<()> {
//! let engine = Engine::new()?; // best adapter, its real limits
//! let (b, s, h, d) = (1, 128, 4, 64);
//! let q = vec![0.1f32; b * s * h * d];
//! let view = TensorView::f32([b, s, h, d], &q);
//! let out = engine.forward(&view, &view, &view, &AttentionOptions::default().causal(true))?;
//! println!("o[0] = {}, lse[0] = {}", out.o.to_f32()[0], out.lse[0]);
//! # Ok(()) }
//! ```
//!
//! Semantics (shapes, masks, LSE, empty rows, accuracy) follow the contract in
//! [docs/semantics.md](https://github.com/flashattn/flashattn/blob/main/docs/semantics.md):
//! `q` is `(batch, seqlen_q, heads_q, head_dim)`, `k`/`v` are
//! `(batch, seqlen_k, heads_kv, head_dim)`, `lse` is `(batch, heads_q, seqlen_q)`.
//!
//! ## Layers
//! - [`api`]: what callers hand in and get back (tensors, shapes, options,
//!   outputs and stats), shared by every backend;
//! - [`plan`]: pure planning, problem + device limits → tiles and pieces;
//! - [`kernels`]: one unit per kernel — WGSL module, typed key, grid,
//!   bindings, storage-access count, loop cost;
//! - [`runtime`]: the device, pipelines by kernel key, pooled buffers,
//!   submission and readback, the adapter's loop limit;
//! - [`ops`]: forward, backward, decoding, the naive baseline, the matmul
//!   ceiling and the copy bandwidth, built from kernels and the runtime;
//!   [`Engine`] is their public face;
//! - [`cpu`], [`reference`](mod@reference), [`accuracy`]: the CPU backend, the f64
//!   reference and docs/semantics.md's accuracy rule; [`Backend`] chooses;
//! - [`quant`]: FP8 (e4m3) quantization and incoherent processing on the
//!   host, which the wgpu kernels reproduce bit for bit;
//! - [`verify`]: every kernel family checked on first use on each device
//!   (a small known-answer run under the accuracy rule), the verdicts
//!   cached, failed families skipped for the next one.

pub mod accuracy;
pub mod api;
pub mod backend;
#[cfg(not(target_arch = "wasm32"))]
pub mod choice;
pub mod cpu;
#[cfg(all(feature = "cuda", not(target_arch = "wasm32")))]
pub mod cuda;
#[cfg(not(target_arch = "wasm32"))]
pub mod disk_cache;
pub mod engine;
pub mod error;
pub mod kernels;
pub mod ops;
pub mod plan;
pub mod quant;
pub mod random;
pub mod reference;
pub mod runtime;
#[cfg(not(target_arch = "wasm32"))]
pub mod tune;
pub mod verify;

pub use api::decode::{
    BlockTable, CacheLayout, CacheShape, DecodeOutput, DecodeProblem, DecodeSpec, DecodeStep,
    HostKvCache,
};
pub use api::inputs::BackwardInputs;
pub use api::options::{AttentionOptions, Fp8Options, Mask, Window};
pub use api::output::{Accesses, Allocation, BackwardOutput, CallStats, ForwardOutput, Timing};
pub use api::problem::Problem;
pub use api::shape::{AttentionShape, Layout, MAX_HEAD_DIM};
pub use api::tensor::{HostData, Precision, Tensor, TensorData, TensorView};
pub use backend::{AttentionBackend, Backend, BackendKind, Capabilities, Choice};
#[cfg(not(target_arch = "wasm32"))]
pub use choice::{Operation, ProbeCache, Workload};
pub use engine::Engine;
pub use error::{Error, Result};
pub use kernels::{AttentionBindings, AttentionBuffers, DecodeBindings, GradientBindings};
pub use ops::bandwidth::BandwidthResult;
pub use ops::ceiling::{CeilingResult, CeilingShape};
pub use plan::{
    candidates, plan_backward, plan_decode, plan_forward, Candidate, Clamp, DecodePlan, DeviceCaps,
    KernelFamily, Pass, Plan, PlanOverrides, PlanRequest, Planned, StorageKind,
};
pub use runtime::KvCache;
#[cfg(not(target_arch = "wasm32"))]
pub use tune::{TuneCache, TuneReport, TuneRequest, TunedCandidate};
#[cfg(not(target_arch = "wasm32"))]
pub use verify::VerdictCache;
pub use verify::{CallKind, FamilyKey, Verdict, Verification, VerifyMode};
/// The wgpu this crate is built on, for apps that pass their own devices and buffers.
pub use wgpu;

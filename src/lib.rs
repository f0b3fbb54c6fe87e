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
//! Semantics (shapes, masks, LSE, empty rows, accuracy) follow SPEC.md:
//! `q` is `(batch, seqlen_q, heads_q, head_dim)`, `k`/`v` are
//! `(batch, seqlen_k, heads_kv, head_dim)`, `lse` is `(batch, heads_q, seqlen_q)`.

pub mod accuracy;
pub mod attention;
pub mod bench;
pub mod cpu;
pub mod error;
pub mod gpu;
pub mod options;
pub mod plan;
// Charts for the CLI; plotters has no embedded-font API on wasm32 (browsers draw text).
#[cfg(not(target_arch = "wasm32"))]
pub mod plot;
pub mod precision;
pub mod random;
pub mod reference;
pub mod tensor;

pub use attention::{Backend, BackendKind, BackwardOutput, ForwardOutput};
pub use error::{Error, Result};
pub use gpu::{AttentionBuffers, CallStats, Engine};
pub use options::{AttentionOptions, Mask, Window};
pub use plan::{
    plan_backward, plan_forward, DeviceCaps, KernelFamily, Plan, PlanOverrides, PlanRequest,
    StorageKind,
};
pub use tensor::{
    AttentionShape, HostData, Precision, Tensor, TensorData, TensorView, MAX_HEAD_DIM,
};

//! Kernels as typed units. Each file is one kernel (or one family): its
//! WGSL module (composed in [`compose`]), its typed key ([`KernelKey`], what
//! the runtime caches pipelines by), its grid, its bindings, its analytic
//! storage-access count and its loop cost. Nothing here touches a device.

pub mod band;
pub mod compose;
pub mod copy;
pub mod decode;
pub mod flash_backward;
pub mod flash_forward;
pub mod flash_forward_coop;
pub mod key;
pub mod loop_probe;
pub mod loops;
pub mod matmul;
pub mod naive;
pub mod params;
pub mod quantize;
pub mod side;
pub mod walk;

pub use compose::{binding, LoopCheck, Variant};
#[cfg(feature = "lab")]
pub use compose::KernelSource;
pub use copy::BufferCopy;
pub use decode::{DecodeBindings, DecodeMerge, FlashDecode, KvAppend};
pub use flash_backward::{
    BackwardBindings, BackwardBuffers, BackwardPart, FlashBackward, GradientBindings,
};
pub use flash_forward::{AttentionBindings, AttentionBuffers, FlashForward};
pub use key::KernelKey;
pub use loop_probe::LoopProbe;
pub use loops::{LoopCost, LoopDim};
pub use matmul::{Epilogue, MatmulForm, MatmulProblem};
#[cfg(feature = "lab")]
pub use matmul::{Matmul, MatmulSpec};
pub use naive::{Naive, NaiveEntry};
pub use params::{CopyParams, DecodeParams, MatmulParams, Params, Piece, QuantParams, Uniform};
pub use quantize::{Fp8Quantize, QuantPass};
pub use side::SideTables;
pub use walk::{SeqDims, Sequences, Walk};
#[cfg(feature = "lab")]
pub use walk::{wgsl_words, Visit, WgslTileLists};

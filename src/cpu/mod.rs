//! The CPU backend: FlashAttention computed the way fast CPU kernels do it,
//! with the semantics of the GPU kernels (docs/semantics.md), on all cores (rayon).
//!
//! - **Work split**: forward tasks are (batch, query head, block of 128
//!   query rows), with key splits merged by LSE where that leaves fewer
//!   than two tasks per thread (decode-shaped problems); the backward is one
//!   fused pass of tasks per (batch, kv head, strip of key blocks), each
//!   producing its blocks' dK/dV and its own dQ sums, which are added in
//!   strip order afterwards — five products per tile, no atomics,
//!   bit-identical runs.
//! - **Products**: Q·Kᵀ, P·V (and dP, dV, dK, dQ) run on one
//!   register-blocked micro-kernel (`micro`): 12×32 tiles of C in zmm
//!   registers on AVX-512, 6×16 in ymm on AVX2+FMA, 6×16 in q registers
//!   on NEON, 4×16 on the portable fallback. The forward's K/V blocks are 128 KiB (256 keys
//!   at d 64, from L2), the backward's tiles fill the L1 (64 × 64); both are
//!   laid out once per call (K transposed; rows an odd number of cache
//!   lines apart, `pack::stride`), f16 storage widened to f32 on
//!   load, and a block on a mask's edge is computed only over the keys its
//!   rows see. Work buffers are kept for the next call (`pool`).
//! - **Softmax**: online, per block of S, with a branch-free `exp` on the
//!   kernel's FMA that vectorizes (`vmath`), the row max folded from its
//!   lanes only when a block raises it and the row sums kept in lanes;
//!   scores, masks, block skipping and narrowing live in one place
//!   (`scores`); P is rounded to the storage precision before P·V.
//! - **Instruction sets** ([`Isa`]): detected at run time; the same
//!   generic source is compiled per set inside `#[target_feature]` entry
//!   points, so one code path is tested on every set the machine has.
//!
//! Why our own micro-kernel and not a crate, measured (AMD EPYC Zen 4,
//! AVX-512, one thread, on a host shared with other builds, so ±30%): on
//! the block products this backend runs (64×64×64, 64×256×64, 64×64×256,
//! C += A·B) this kernel ran at 42–73 GFLOP/s, `gemm` 0.18 at 37–66 and
//! `matrixmultiply` 0.3 (no AVX-512 kernel) at 32–58, in the same runs.
//! A crate was no faster on these shapes; ours reads Pᵀ and dSᵀ at any
//! strides with no copy, inlines into the softmax loop compiled for the
//! same instruction set, adds no dependencies and builds for wasm32. (On
//! large products, 1024×1024×64, the crates' packing and cache blocking
//! win: 31–43 against 22–33 GFLOP/s; the backend never runs one.) The
//! first, plain-Rust form of the AVX-512 tile kept its sums in a float
//! array that the compiler spilled to the stack each step (23 GFLOP/s);
//! the x86 and NEON tiles are therefore written in intrinsics over arrays
//! of vector registers, which stay in registers.

mod attend;
mod backward;
mod codes;
mod decode;
mod forward;
mod fp8;
mod isa;
mod merge;
mod micro;
mod pack;
mod pool;
mod scores;
mod vmath;

/// The backward's D = rowsum(dO ∘ O) and the sinks' gradient from it,
/// shared with the GPU backends' dsinks in f16/bf16.
pub(crate) use backward::{row_deltas, sink_gradients};
pub use fp8::forward_fp8;
pub use isa::Isa;

use crate::api::decode::{DecodeOutput, DecodeStep, HostKvCache};
use crate::api::inputs::{BackwardInputs, ForwardInputs};
use crate::api::options::{AttentionOptions, Fp8Options};
use crate::api::output::{BackwardOutput, ForwardOutput};
use crate::backend::attend::{AttentionBackend, Capabilities};
use crate::error::Result;
use crate::kv_quant::QuantKvCache;
use crate::plan::PlanOverrides;

/// The CPU backend on one instruction set.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cpu {
    isa: Isa,
}

impl Default for Cpu {
    fn default() -> Self {
        Self::new()
    }
}

impl Cpu {
    /// On the fastest instruction set this machine has.
    pub fn new() -> Self {
        Self { isa: Isa::detect() }
    }

    /// On `isa`, which this machine must have (`Error::IsaUnavailable`).
    pub fn with_isa(isa: Isa) -> Result<Self> {
        Ok(Self { isa: isa.check()? })
    }

    /// The instruction set its kernels use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Exact attention forward: o and lse.
    pub fn forward(
        &self,
        inputs: &ForwardInputs,
        opts: &AttentionOptions,
    ) -> Result<ForwardOutput> {
        forward::forward(self.isa, &inputs.q, &inputs.k, &inputs.v, opts)
    }

    /// Gradients dq, dk, dv from the forward's o and lse.
    pub fn backward(
        &self,
        inputs: &BackwardInputs,
        opts: &AttentionOptions,
    ) -> Result<BackwardOutput> {
        backward::backward(self.isa, inputs, opts)
    }

    /// One decoding step on a host cache: validate, append, attend.
    pub fn decode(
        &self,
        cache: &mut HostKvCache,
        step: &DecodeStep,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodeOutput> {
        decode::decode(self.isa, cache, step, opts, num_splits)
    }

    /// One decoding step on a quantized host cache: validate, append
    /// (quantizing), attend on the codes' values.
    pub fn decode_quantized(
        &self,
        cache: &mut QuantKvCache,
        step: &DecodeStep,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodeOutput> {
        decode::decode_quantized(self.isa, cache, step, opts, num_splits)
    }
}

/// The CPU backend as the one call model: plan overrides are the wgpu
/// planner's and are ignored here.
impl AttentionBackend for Cpu {
    fn capabilities(&self) -> Capabilities {
        Capabilities {
            name: format!("cpu ({} threads)", rayon::current_num_threads()),
            backward: true,
            decode: true,
            fp8: true,
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
        Cpu::forward(self, inputs, opts)
    }

    fn forward_fp8(
        &self,
        inputs: &ForwardInputs,
        opts: &AttentionOptions,
        fp8: &Fp8Options,
        _: &PlanOverrides,
    ) -> Result<ForwardOutput> {
        fp8::forward_fp8(inputs, opts, fp8)
    }

    fn backward(
        &self,
        inputs: &BackwardInputs,
        opts: &AttentionOptions,
        _: &PlanOverrides,
    ) -> Result<BackwardOutput> {
        Cpu::backward(self, inputs, opts)
    }

    fn decode(
        &self,
        cache: &mut HostKvCache,
        step: &DecodeStep,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodeOutput> {
        Cpu::decode(self, cache, step, opts, num_splits)
    }

    fn decode_quantized(
        &self,
        cache: &mut QuantKvCache,
        step: &DecodeStep,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodeOutput> {
        Cpu::decode_quantized(self, cache, step, opts, num_splits)
    }
}

/// [`Cpu::forward`] on the fastest instruction set.
pub fn forward(inputs: &ForwardInputs, opts: &AttentionOptions) -> Result<ForwardOutput> {
    Cpu::new().forward(inputs, opts)
}

/// [`Cpu::backward`] on the fastest instruction set.
pub fn backward(inputs: &BackwardInputs, opts: &AttentionOptions) -> Result<BackwardOutput> {
    Cpu::new().backward(inputs, opts)
}

/// [`Cpu::decode`] on the fastest instruction set.
pub fn decode(
    cache: &mut HostKvCache,
    step: &DecodeStep,
    opts: &AttentionOptions,
    num_splits: Option<usize>,
) -> Result<DecodeOutput> {
    Cpu::new().decode(cache, step, opts, num_splits)
}

/// [`Cpu::decode_quantized`] on the fastest instruction set.
pub fn decode_quantized(
    cache: &mut QuantKvCache,
    step: &DecodeStep,
    opts: &AttentionOptions,
    num_splits: Option<usize>,
) -> Result<DecodeOutput> {
    Cpu::new().decode_quantized(cache, step, opts, num_splits)
}

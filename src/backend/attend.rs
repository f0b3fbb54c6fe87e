//! The one call model every backend implements: [`AttentionBackend`] —
//! the forward, the FP8 forward, the backward and a decoding step, with the
//! same arguments on the wgpu engine, the CPU backend and CUDA — and
//! [`Capabilities`], what a backend runs. [`crate::Backend`] dispatches
//! through it, so a new operation is added to one trait, not to one match
//! per backend.

use crate::api::decode::{DecodeOutput, DecodeStep, HostKvCache};
use crate::kv_quant::QuantKvCache;
use crate::api::inputs::{BackwardInputs, ForwardInputs};
use crate::api::options::{AttentionOptions, Fp8Options};
use crate::api::output::{BackwardOutput, ForwardOutput};
use crate::error::Result;
use crate::plan::PlanOverrides;

/// What a backend runs (every backend runs the forward).
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Capabilities {
    /// One line naming the backend and its device.
    pub name: String,
    /// The backward (`dq`, `dk`, `dv`).
    pub backward: bool,
    /// Decoding steps on a KV cache.
    pub decode: bool,
    /// The FP8 (e4m3) forward.
    pub fp8: bool,
    /// Attention dropout, forward and backward (docs/dropout.md).
    pub dropout: bool,
    /// Decoding steps on int8 and FP8 caches (docs/kv-quantization.md).
    pub quantized_cache: bool,
    /// Decoding steps on latent caches, whose V is a view of K
    /// ([`CacheShape::latent`](crate::CacheShape::latent), docs/decoding.md).
    pub latent_cache: bool,
    /// Whether [`PlanOverrides`] steer its kernels (the wgpu planner's
    /// tiles and families); elsewhere they are ignored.
    pub plan_overrides: bool,
}

/// Attention on one backend: host tensors in, host tensors out, each call
/// validated in full before any work (a typed error naming the problem).
pub trait AttentionBackend: std::fmt::Debug {
    /// What this backend runs.
    fn capabilities(&self) -> Capabilities;

    /// Exact attention forward: `o` and `lse`.
    fn forward(
        &self,
        inputs: &ForwardInputs,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<ForwardOutput>;

    /// The FP8 (e4m3) forward: `o` f32 (`Error::Unsupported` where
    /// [`Capabilities::fp8`] is false).
    fn forward_fp8(
        &self,
        inputs: &ForwardInputs,
        opts: &AttentionOptions,
        fp8: &Fp8Options,
        overrides: &PlanOverrides,
    ) -> Result<ForwardOutput>;

    /// Gradients `dq`, `dk`, `dv` given the forward's `o` and `lse`.
    fn backward(
        &self,
        inputs: &BackwardInputs,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<BackwardOutput>;

    /// One decoding step on a host cache, `k_new`/`v_new` appended in place
    /// first; `num_splits` `None` lets the backend split the keys as it
    /// plans (a backend that does not split takes any value: the result is
    /// the same within the accuracy rule). A step that fails validation
    /// leaves the cache unchanged.
    fn decode(
        &self,
        cache: &mut HostKvCache,
        step: &DecodeStep,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodeOutput>;

    /// One decoding step on a quantized (int8 or FP8) host cache, as
    /// [`decode`](Self::decode): the new rows quantized in place first
    /// (`Error::Unsupported` where [`Capabilities::quantized_cache`] is false).
    fn decode_quantized(
        &self,
        cache: &mut QuantKvCache,
        step: &DecodeStep,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodeOutput>;
}

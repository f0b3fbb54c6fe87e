//! The CPU backend's FP8 (e4m3) forward (docs/semantics.md): q, k, v quantized by
//! [`crate::quant`] — the same codes and scales the wgpu kernels produce,
//! bit for bit — then the same online softmax as the f32 forward on their
//! dequantized values, P quantized to e4m3 at its own scale before `P·V`,
//! f32 accumulation; `o` is f32.

use crate::api::inputs::ForwardInputs;
use crate::api::options::{AttentionOptions, Fp8Options};
use crate::api::output::{CallStats, ForwardOutput};
use crate::api::problem::Problem;
use crate::api::tensor::Precision;
use crate::api::tensor::TensorData;
use crate::error::Result;
use crate::quant::{round_p, Fp8Layout};

/// FP8 attention forward on the CPU: `o` f32, `lse` as always.
pub fn forward_fp8(
    inputs: &ForwardInputs,
    opts: &AttentionOptions,
    fp8: &Fp8Options,
) -> Result<ForwardOutput> {
    let (shape, layout) = Fp8Layout::checked(inputs, opts, fp8)?;
    let quantized = layout.quantize(inputs)?;
    // Each tensor's scales multiply its values here; the kernels fold them
    // into the scores and the output instead (equal up to rounding).
    let qkv = quantized.map(|t| t.dequantize());
    let opts = layout.options(opts);
    let problem = Problem::padded(layout.padded(&shape), Precision::F32, &opts)?;
    let (o, lse) = super::forward::forward_f32(
        super::Isa::detect(),
        &problem,
        &qkv[0],
        &qkv[1],
        &qkv[2],
        super::vmath::Rounding::By(round_p),
    );
    let o = TensorData::F32(layout.trim(&o));
    Ok(ForwardOutput::new(shape, o, lse, CallStats::default()))
}

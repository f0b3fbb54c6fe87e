//! The FP8 quantization kernels (`fp8_quant.wgsl`, with `hadamard.wgsl` and
//! `e4m3.wgsl`): one tensor's per-(batch, head) maxima (after the optional
//! Walsh–Hadamard transform), its scales, its e4m3 codes — the values
//! `crate::quant` computes on the host, bit for bit.

use super::compose::{binding, Access, Composer, KernelSource, Variant, E4M3};
use crate::plan::StorageKind;

const QUANT: &str = include_str!("../../shaders/fp8_quant.wgsl");
const HADAMARD: &str = include_str!("../../shaders/hadamard.wgsl");

/// Invocations per workgroup.
pub const QUANT_WORKGROUP: u32 = 64;
/// Elements of workgroup memory the rows of one workgroup fill (at most):
/// `QROWS = max(1, ROW_ELEMENTS / QN)` rows.
pub const ROW_ELEMENTS: u32 = 512;

/// Which of the three passes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum QuantPass {
    /// Per-(batch, head) max |x| (atomic, into a zeroed buffer).
    Absmax,
    /// Scales from the maxima.
    Scales,
    /// The codes, four per u32.
    Codes,
}

/// One quantization kernel for rows of `head_dim` values, through the
/// transform of order `head_dim.next_power_of_two()` when `hadamard`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Fp8Quantize {
    pub pass: QuantPass,
    pub head_dim: u32,
    pub hadamard: bool,
    pub variant: Variant,
}

impl Fp8Quantize {
    pub const NAME: &'static str = "fp8 quantize";

    /// Values per quantized row: the transform's order, or the head dim.
    pub fn dim(&self) -> u32 {
        if self.hadamard {
            self.head_dim.next_power_of_two()
        } else {
            self.head_dim
        }
    }

    /// Rows each workgroup of the absmax and codes passes handles.
    pub fn rows_per_group(&self) -> u32 {
        (ROW_ELEMENTS / self.dim()).max(1)
    }

    pub fn source(&self) -> KernelSource {
        let mut c = Composer::new(StorageKind::F32);
        c.override_u32("WG", QUANT_WORKGROUP)
            .override_u32("D", self.head_dim)
            .override_u32("QN", self.dim())
            .override_u32("QROWS", self.rows_per_group())
            .override_bool("HADAMARD", self.hadamard)
            .common(self.variant)
            .buffers(StorageKind::F32, &[("x", binding::QUANT_X, Access::Read)])
            .push(E4M3)
            .push(QUANT)
            .push(HADAMARD);
        c.finish(self.entry())
    }

    pub fn entry(&self) -> &'static str {
        match self.pass {
            QuantPass::Absmax => "absmax_main",
            QuantPass::Scales => "scales_main",
            QuantPass::Codes => "codes_main",
        }
    }

    /// The grid over a tensor `[batch, seqlen, heads]`: row blocks × heads ×
    /// batch, or one invocation per (batch, head) for the scales.
    pub fn grid(&self, [batch, seqlen, heads]: [u32; 3]) -> [u32; 3] {
        match self.pass {
            QuantPass::Scales => [(batch * heads).div_ceil(QUANT_WORKGROUP), 1, 1],
            _ => [seqlen.div_ceil(self.rows_per_group()), heads, batch],
        }
    }
}

//! What a call ran, as its statistics report it: the planner's [`Plan`]
//! (tile sizes and thread layout, a plain `Copy + Eq + Hash` value that also
//! keys compiled kernels), its kernel family, storage and cooperative-matrix
//! form. The planner (`plan`) makes them; the planner's rules and the
//! methods that derive the kernels' sizes live there.

use super::tensor::Precision;
use crate::error::{Error, Result};

/// Which family of kernels a plan runs (forward or backward).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KernelFamily {
    /// `flash_fwd.wgsl`, `flash_bwd_*.wgsl`: tiles in workgroup memory, sized
    /// by the Br/Bc formula. The kernels for GPUs (and for every head dim).
    #[default]
    Tiled,
    /// `flash_fwd_lanes.wgsl`, `flash_bwd_lanes.wgsl`: rows owned by the
    /// lanes of a subgroup-sized workgroup, the other operand's rows shared
    /// by subgroup broadcast, no workgroup memory. For CPU adapters, where
    /// per-invocation memory accesses are what costs.
    Lanes,
    /// `flash_fwd_coop.wgsl` (forward only): Q·Kᵀ and P·V on cooperative
    /// matrices (tensor cores), where the device has them (see `plan::coop`).
    Coop,
    /// `flash_fwd_regs.wgsl`, `flash_bwd_regs_*.wgsl`: tiles in workgroup
    /// memory read as vec4s into per-invocation register micro-tiles (RM
    /// rows × its keys, RM rows × its output columns), row reductions by
    /// subgroup shuffles where they fit one subgroup. The default on GPUs.
    Registers,
}

impl KernelFamily {
    /// The name it parses from.
    pub fn name(self) -> &'static str {
        match self {
            KernelFamily::Tiled => "tiled",
            KernelFamily::Lanes => "lanes",
            KernelFamily::Coop => "coop",
            KernelFamily::Registers => "registers",
        }
    }
}

impl std::str::FromStr for KernelFamily {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "tiled" => Ok(KernelFamily::Tiled),
            "lanes" => Ok(KernelFamily::Lanes),
            "coop" => Ok(KernelFamily::Coop),
            "registers" => Ok(KernelFamily::Registers),
            _ => Err(Error::UnknownName {
                what: "kernel",
                name: s.to_string(),
                expected: "tiled, lanes, registers or coop",
            }),
        }
    }
}

/// How q, k, v and o are stored in the kernels' storage buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum StorageKind {
    /// f32 elements.
    F32,
    /// f16 pairs packed in `u32`, `unpack2x16float`: runs on every adapter.
    F16Packed,
    /// `enable f16;` and `array<f16>`: needs SHADER_F16.
    F16Native,
    /// bf16 pairs packed in `u32`, widened and rounded with bit operations
    /// (WGSL has no bf16 type): runs on every adapter.
    Bf16,
    /// FP8 e4m3 codes packed four per `u32`, decoded on load, with
    /// per-(batch, head) scales; the FP8 forward's q, k, v only (its outputs
    /// are f32). The planner never picks it: the FP8 forward sets it.
    Fp8,
}

impl StorageKind {
    /// The precision of the tensors a kernel with this storage writes
    /// (f32 for FP8, whose outputs are f32).
    pub fn precision(self) -> Precision {
        match self {
            StorageKind::F32 | StorageKind::Fp8 => Precision::F32,
            StorageKind::F16Packed | StorageKind::F16Native => Precision::F16,
            StorageKind::Bf16 => Precision::Bf16,
        }
    }

    /// How a kernel with this storage stores its outputs.
    pub fn output(self) -> StorageKind {
        match self {
            StorageKind::Fp8 => StorageKind::F32,
            other => other,
        }
    }

    /// The storage in words.
    pub fn name(self) -> &'static str {
        match self {
            StorageKind::F32 => "f32",
            StorageKind::F16Packed => "f16 (packed u32)",
            StorageKind::F16Native => "f16 (native)",
            StorageKind::Bf16 => "bf16 (packed u32)",
            StorageKind::Fp8 => "fp8 e4m3 (packed u32, per-head scales)",
        }
    }
}

/// Tile sizes and thread layout of the forward or backward kernels.
///
/// Each workgroup owns `br` query rows of one (batch, head) and loops over
/// key/value blocks of `bc` rows; `threads_per_row` invocations share a row.
/// A lanes plan has one invocation per row and no workgroup storage.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Plan {
    /// The kernel family.
    pub kernel: KernelFamily,
    /// The head dim of q and k.
    pub head_dim: u32,
    /// The head dim of v and o.
    pub head_dim_v: u32,
    /// How q, k, v and o are stored.
    pub storage: StorageKind,
    /// M in bytes, as used (the device limit or an override).
    pub m_bytes: u32,
    /// The formula's values before clamping: `ceil(M/4d)` and `min(that, d)`.
    pub bc_formula: u32,
    /// The formula's `br` before clamping.
    pub br_formula: u32,
    /// Query rows per workgroup.
    pub br: u32,
    /// Keys per K/V tile.
    pub bc: u32,
    /// Invocations sharing one query row.
    pub threads_per_row: u32,
    /// Invocations per workgroup.
    pub workgroup_size: u32,
    /// Bytes of `var<workgroup>` the kernel declares.
    pub workgroup_bytes: u32,
    /// The cooperative-matrix form of a coop plan (`None` for the others).
    pub coop: Option<CoopForm>,
    /// Registers kernels: query (or key) rows each invocation owns (RM);
    /// 1 elsewhere. Invocations `(g, t)`: rows `g·RM..`, keys and vec4
    /// columns `t + k·threads_per_row`.
    pub rows_per_thread: u32,
    /// Registers kernels: row max and sum by subgroup shuffles (else
    /// through workgroup memory).
    pub subgroup_reduce: bool,
    /// Registers kernels: the next K/V tile loads into a second buffer
    /// while the current one is used.
    pub double_buffer: bool,
}

/// The cooperative-matrix configuration a coop kernel is built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CoopForm {
    /// 16×16×16, f16 inputs, f32 accumulators (NVIDIA, AMD, Intel).
    F16x16,
    /// 8×8×8, f32 inputs and accumulators (Apple's simdgroup matrices).
    F32x8,
    /// The 8×8 f32 kernel with its cooperative operations written out in
    /// plain WGSL (`kernels::flash_forward_coop::emulated_body`): never
    /// planned from a device's caps; `Engine::with_emulated_coop` swaps it
    /// in for F32x8 so the kernel runs on devices without cooperative
    /// matrices (lavapipe), for tests.
    Emulated,
}

impl CoopForm {
    /// The matrices' side N.
    pub fn n(self) -> u32 {
        match self {
            CoopForm::F16x16 => 16,
            CoopForm::F32x8 | CoopForm::Emulated => 8,
        }
    }

    /// Bytes of one input element in workgroup memory (Q, K/V and P tiles).
    pub fn element_bytes(self) -> u32 {
        match self {
            CoopForm::F16x16 => 2,
            CoopForm::F32x8 | CoopForm::Emulated => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CoopForm::F16x16 => "16×16 f16 cooperative matrices with f32 accumulators",
            CoopForm::F32x8 => "8×8 f32 cooperative matrices",
            CoopForm::Emulated => "8×8 f32 matrices emulated in plain WGSL",
        }
    }
}

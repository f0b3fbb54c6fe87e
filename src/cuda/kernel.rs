//! The CUDA kernels' variants: a typed key per compiled module, the tile
//! sizes each variant is built with, and its NVRTC source (cuda/common.cuh
//! after the key's defines, then the kernel file: one copy of the shared
//! pieces, no duplicated kernels). Two paths: the scalar kernels (f32 FMAs
//! on f32 tiles, every precision) and the sm80 tensor-core kernels
//! (`mma.sync`, `ldmatrix`, `cp.async`; f16/bf16 storage only, padded head
//! dims up to [`MMA_MAX_HEAD_DIM`]), and the Hopper forward and dK/dV
//! (`wgmma`, TMA, mbarriers, warp specialization; sm_90a, padded head dims
//! 64 and 128). Dropout is a variant of the scalar and sm80 kernels
//! (`HAS_DROPOUT`); the Hopper ones have none, and the plan sends dropout
//! to the sm80 ones.

use crate::api::tensor::Precision;
use crate::kv_quant::CacheQuant;

/// cuda/common.cuh: conversions, masks, scores, tile loads.
const COMMON: &str = include_str!("../../cuda/common.cuh");
/// cuda/philox.cuh: dropout's generator.
const PHILOX: &str = include_str!("../../cuda/philox.cuh");
/// cuda/dropout.cuh: the `Dropout` argument, keep-bit tiles, dropped P.
const DROPOUT: &str = include_str!("../../cuda/dropout.cuh");
const FORWARD: &str = include_str!("../../cuda/flash_fwd.cu");
const BACKWARD: &str = include_str!("../../cuda/flash_bwd.cu");
/// cuda/bwd_dot.cuh: `flash_bwd_dot`, in both backward modules.
const BACKWARD_DOT: &str = include_str!("../../cuda/bwd_dot.cuh");
/// cuda/mma.cuh: the mma.sync / ldmatrix / cp.async wrappers.
const MMA: &str = include_str!("../../cuda/mma.cuh");
const FORWARD_MMA: &str = include_str!("../../cuda/flash_fwd_mma.cu");
const BACKWARD_MMA: &str = include_str!("../../cuda/flash_bwd_mma.cu");
/// cuda/hopper.cuh: the wgmma / mbarrier / TMA / setmaxnreg wrappers.
const HOPPER: &str = include_str!("../../cuda/hopper.cuh");
const FORWARD_WGMMA: &str = include_str!("../../cuda/flash_fwd_wgmma.cu");
const BACKWARD_WGMMA: &str = include_str!("../../cuda/flash_bwd_wgmma.cu");
/// cuda/flash_decode.cu: append, split-KV decoding and the merge.
const DECODE: &str = include_str!("../../cuda/flash_decode.cu");
/// cuda/e4m3.cuh: e4m3 codes as src/quant.rs defines them.
const E4M3: &str = include_str!("../../cuda/e4m3.cuh");
/// cuda/fp8_quant.cu: the FP8 forward's quantization.
const FP8_QUANT: &str = include_str!("../../cuda/fp8_quant.cu");
/// Rows a block of cuda/fp8_quant.cu quantizes (`QUANT_WARPS`: a warp a row).
pub const QUANT_ROWS: usize = 4;
/// Threads of a decode block (`DECODE_THREADS` in cuda/flash_decode.cu).
pub const DECODE_THREADS: usize = 128;
/// Keys a decode block scores per tile (`DECODE_KEYS`).
pub const DECODE_KEYS: usize = 64;
/// Query rows of one sequence and kv head (its GQA group's heads ×
/// seqlen_q positions) a decode block owns (`DECODE_ROWS`): each K/V row
/// it loads serves them all.
pub const DECODE_ROWS: usize = 16;

/// Head dims up to [`STEPPED_MAX_HEAD_DIM`] are compiled in steps of this
/// many columns (the rest load as zeros), so 8 widths cover 1..=256.
pub const HEAD_DIM_STEP: usize = 32;
/// The largest head dim compiled in steps of [`HEAD_DIM_STEP`]; past it,
/// the [`WIDE_HEAD_DIMS`].
pub const STEPPED_MAX_HEAD_DIM: usize = 256;
/// The largest head dim (of q and k, and of v in decoding) the CUDA
/// kernels take: MLA's 576 (512 + 64 rotary), the API's own maximum.
pub const MAX_HEAD_DIM: usize = 576;
/// The scalar kernels' padded head dims past [`STEPPED_MAX_HEAD_DIM`]:
/// three widths cover 257..=576 (a zero column costs a wide head dim
/// little, and each width is a set of variants to compile). In decoding
/// a thread's output columns, ⌈HEAD_DIM / DECODE_THREADS⌉, are 3, 4 and 5;
/// the forward's and backward's tiles shrink to fit ([`KernelKey::tiles`]).
pub const WIDE_HEAD_DIMS: [usize; 3] = [384, 512, 576];
/// The largest (padded) head dim of the tensor-core kernels: past it a
/// warp's f32 accumulators (HEAD_DIM / 2 per lane, twice in dK/dV) no
/// longer fit in registers, and the scalar kernels run.
pub const MMA_MAX_HEAD_DIM: usize = 128;
/// The Hopper forward's padded head dims: whole 64-column TMA boxes (128
/// B, the 128B swizzle's row), at most two (its f32 O and S fragments, 64
/// floats each per thread, stay within 240 registers).
pub const WGMMA_HEAD_DIMS: [usize; 2] = [64, 128];
/// The FP8 Hopper forward's padded head dim: a row of 128 e4m3 codes is
/// one 128-byte TMA box; quantized rows up to it run padded to it.
pub const FP8_HEAD_DIM: usize = 128;
/// Static shared memory every sm80+ device gives a block without opt-in.
pub const STATIC_SHARED_LIMIT: usize = 48 * 1024;

/// Which source file (module) a key compiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// cuda/flash_fwd.cu: `flash_fwd`.
    Forward,
    /// cuda/flash_bwd.cu: `flash_bwd_dot`, `flash_bwd_dkdv`, `flash_bwd_dq`.
    Backward,
    /// cuda/flash_fwd_mma.cu: `flash_fwd` on tensor cores (f16/bf16).
    ForwardMma,
    /// cuda/flash_bwd_mma.cu: the backward's three kernels on tensor cores.
    BackwardMma,
    /// cuda/flash_fwd_wgmma.cu: `flash_fwd` for Hopper (sm_90a only).
    ForwardWgmma,
    /// cuda/flash_bwd_wgmma.cu: `flash_bwd_dot`, the Hopper
    /// `flash_bwd_dkdv` (sm_90a only), which at head dim 64 adds dQ's
    /// partials into an f32 workspace, `flash_bwd_dq_convert`, which
    /// rounds it to dq, and `flash_bwd_dq_wgmma`, dQ per query block
    /// (head dim 128).
    BackwardWgmma,
    /// cuda/flash_decode.cu: `kv_append`, `flash_decode` (split-KV) and
    /// `flash_decode_merge` on a device cache, plain or quantized.
    Decode,
    /// cuda/fp8_quant.cu: `fp8_absmax` and `fp8_codes`, the FP8 forward's
    /// f32 inputs to e4m3 codes and scales (rows of [`FP8_HEAD_DIM`]).
    Fp8Quantize,
}

impl Family {
    pub const ALL: [Family; 8] = [
        Family::Forward,
        Family::Backward,
        Family::ForwardMma,
        Family::BackwardMma,
        Family::ForwardWgmma,
        Family::BackwardWgmma,
        Family::Decode,
        Family::Fp8Quantize,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Family::Forward => "flash_fwd",
            Family::Backward => "flash_bwd",
            Family::ForwardMma => "flash_fwd_mma",
            Family::BackwardMma => "flash_bwd_mma",
            Family::ForwardWgmma => "flash_fwd_wgmma",
            Family::BackwardWgmma => "flash_bwd_wgmma",
            Family::Decode => "flash_decode",
            Family::Fp8Quantize => "fp8_quant",
        }
    }

    /// The kernels (entry points) its module holds.
    pub fn entry_points(self) -> &'static [&'static str] {
        if self == Family::Decode {
            &["kv_append", "flash_decode", "flash_decode_merge"]
        } else if self == Family::Fp8Quantize {
            &["fp8_absmax", "fp8_codes"]
        } else if self == Family::ForwardMma {
            // Head dims off whole 16-byte chunks: a kernel of their own.
            &["flash_fwd", "flash_fwd_unaligned"]
        } else if self.is_forward() {
            &["flash_fwd"]
        } else if self == Family::BackwardWgmma {
            &["flash_bwd_dot", "flash_bwd_dkdv", "flash_bwd_dq_convert", "flash_bwd_dq_wgmma"]
        } else {
            &["flash_bwd_dot", "flash_bwd_dkdv", "flash_bwd_dq"]
        }
    }

    /// The sm80 tensor-core kernels.
    pub fn is_mma(self) -> bool {
        matches!(self, Family::ForwardMma | Family::BackwardMma)
    }

    /// The Hopper kernels: sm_90a only (wgmma, setmaxnreg).
    pub fn is_wgmma(self) -> bool {
        matches!(self, Family::ForwardWgmma | Family::BackwardWgmma)
    }

    pub fn is_forward(self) -> bool {
        matches!(
            self,
            Family::Forward | Family::ForwardMma | Family::ForwardWgmma
        )
    }

    /// Whether this family compiles `precision` at padded head dim `head_dim`.
    pub fn takes(self, precision: Precision, head_dim: usize) -> bool {
        match self {
            Family::Forward | Family::Backward | Family::Decode => {
                head_dim <= STEPPED_MAX_HEAD_DIM || WIDE_HEAD_DIMS.contains(&head_dim)
            }
            Family::ForwardMma | Family::BackwardMma => {
                precision != Precision::F32 && head_dim <= MMA_MAX_HEAD_DIM
            }
            Family::ForwardWgmma | Family::BackwardWgmma => {
                precision != Precision::F32 && WGMMA_HEAD_DIMS.contains(&head_dim)
            }
            // f32 inputs, rows of the FP8 forward's padded head dim.
            Family::Fp8Quantize => precision == Precision::F32 && head_dim == FP8_HEAD_DIM,
        }
    }
}

/// One compiled module: everything a compile-time define depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KernelKey {
    pub family: Family,
    pub precision: Precision,
    /// The head dim rounded up to [`HEAD_DIM_STEP`].
    pub head_dim: usize,
    /// Causal and/or local window (the bounds are launch arguments).
    pub band: bool,
    pub softcap: bool,
    /// Dropout (`p > 0`; the seed, offset and threshold are launch
    /// arguments). Never the Hopper forward's nor decoding's.
    pub dropout: bool,
    /// The decode family's cache codes (`None`: a cache of the storage
    /// precision); in the Hopper forward `Some(CacheQuant::Fp8)` is its FP8
    /// variant (e4m3 codes in, f32 out: [`KernelKey::fp8_forward`]);
    /// `None` in every other family.
    pub quant: Option<CacheQuant>,
}

/// A variant's thread-block shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Tiles {
    /// Rows a block owns: query rows (forward, dQ) or keys (dK/dV); the
    /// scalar backward's tiles are square (rows = keys).
    pub rows: usize,
    /// Rows of the other side per streamed tile (keys, or queries for dK/dV).
    pub keys: usize,
    /// Lanes per row: a power of two, so a row's lanes share a warp (the
    /// tensor-core kernels: the quad of 4 that holds an accumulator row).
    pub lanes: usize,
    /// Threads per block.
    pub threads: usize,
}

impl Tiles {
    pub fn threads(&self) -> usize {
        self.threads
    }

    /// Warps per block.
    pub fn warps(&self) -> usize {
        self.threads / 32
    }
}

impl KernelKey {
    /// The key for a problem of head dim `head_dim` (1..=[`MAX_HEAD_DIM`]):
    /// padded to the step, or for the Hopper kernel to 64 or 128 (whole TMA
    /// boxes; past 128 it pads to the step and no plan picks it), for the
    /// scalar kernels past [`STEPPED_MAX_HEAD_DIM`] to one of
    /// [`WIDE_HEAD_DIMS`] (the tensor-core ones take none past 128).
    pub fn new(
        family: Family,
        precision: Precision,
        head_dim: usize,
        band: bool,
        softcap: bool,
    ) -> Self {
        let stepped = head_dim.div_ceil(HEAD_DIM_STEP).max(1) * HEAD_DIM_STEP;
        let head_dim = match family {
            Family::ForwardWgmma | Family::BackwardWgmma => WGMMA_HEAD_DIMS
                .into_iter()
                .find(|&w| stepped <= w)
                .unwrap_or(stepped),
            Family::Forward | Family::Backward | Family::Decode if stepped > STEPPED_MAX_HEAD_DIM => WIDE_HEAD_DIMS
                .into_iter()
                .find(|&w| stepped <= w)
                .unwrap_or(stepped),
            _ => stepped,
        };
        Self {
            family,
            precision,
            head_dim,
            band,
            softcap,
            dropout: false,
            quant: None,
        }
    }

    /// The same variant with dropout on or off (the Hopper forward and
    /// decoding: off).
    pub fn with_dropout(self, dropout: bool) -> Self {
        Self {
            dropout: dropout && !self.family.is_wgmma() && self.family != Family::Decode,
            ..self
        }
    }

    /// The decode variant for a cache of `quant` codes (`None`: plain);
    /// other families stay as they are.
    pub fn with_quant(self, quant: Option<CacheQuant>) -> Self {
        Self {
            quant: quant.filter(|_| self.family == Family::Decode),
            ..self
        }
    }

    /// The Hopper forward's FP8 variant (cuda/flash_fwd_wgmma.cu's
    /// `IS_FP8`): q, k and v as e4m3 codes with per-head scales, o and lse
    /// in f32 (its precision), a quantized row of `dim` codes padded to
    /// [`FP8_HEAD_DIM`].
    pub fn fp8_forward(dim: usize, band: bool, softcap: bool) -> Self {
        Self {
            quant: Some(CacheQuant::Fp8),
            ..Self::new(Family::ForwardWgmma, Precision::F32, dim.max(FP8_HEAD_DIM), band, softcap)
        }
    }

    /// Whether this is the Hopper forward's FP8 variant.
    pub fn is_fp8(&self) -> bool {
        self.family == Family::ForwardWgmma && self.quant == Some(CacheQuant::Fp8)
    }

    /// Every variant there is: what the NVRTC test compiles.
    pub fn all() -> Vec<Self> {
        let mut keys = Vec::new();
        for family in Family::ALL {
            for precision in [Precision::F32, Precision::F16, Precision::Bf16] {
                for head_dim in (HEAD_DIM_STEP..=MAX_HEAD_DIM).step_by(HEAD_DIM_STEP) {
                    if !family.takes(precision, head_dim) {
                        continue;
                    }
                    // The quantization has no score options.
                    let options = match family {
                        Family::Fp8Quantize => &[false][..],
                        _ => &[false, true][..],
                    };
                    for &band in options {
                        for &softcap in options {
                            let key = Self::new(family, precision, head_dim, band, softcap);
                            keys.push(key);
                            if family == Family::Decode {
                                for quant in CacheQuant::ALL {
                                    keys.push(key.with_quant(Some(quant)));
                                }
                            } else if !family.is_wgmma() && family != Family::Fp8Quantize {
                                keys.push(key.with_dropout(true));
                            }
                        }
                    }
                }
            }
        }
        for band in [false, true] {
            for softcap in [false, true] {
                keys.push(Self::fp8_forward(FP8_HEAD_DIM, band, softcap));
            }
        }
        keys
    }

    /// Tile sizes, chosen here for every padded head dim. Every tile is
    /// held in f32 in shared memory with one column of padding; the sizes
    /// keep a block within the 48 KiB of static shared memory every sm80+
    /// device has, at 128 threads (64 for the backward at d 32), and each
    /// lane at most 32 (forward) or 2 × 18 (backward) f32 accumulators,
    /// which stay in registers. Up to d 256 the streamed tile is about 16
    /// KiB; past it ([`WIDE_HEAD_DIMS`]), a row's lanes are at most a warp
    /// (32 lanes: 18 columns each at d 576), the forward streams the most
    /// keys that fit (16 for 4 query rows at d 576, never under 8: dropout's
    /// keep bits come 8 keys at a time) and the backward's tiles are 8 × 8
    /// in dynamic shared memory (72 KiB at d 576, within every sm80+
    /// device's opt-in).
    ///
    /// The tensor-core kernels, 4 warps: the forward FA2's 128 query rows
    /// (32 a warp) against 64-key tiles, 64 rows (16 a warp) at d 96, at d
    /// 128 with a softcap or dropout, and with both; the backward 16 owned
    /// rows a warp (64 a block), streamed tiles of 64 rows up to d 64 and
    /// 32 past it. A lane's
    /// S/dP fragments (keys / 2 floats a row tile) and accumulators (d / 2
    /// floats a row tile, two sets in dK/dV) stay within sm80's 255
    /// registers.
    pub fn tiles(&self) -> Tiles {
        let d = self.head_dim;
        match self.family {
            Family::Forward => scalar_forward_tiles(d),
            Family::Backward => scalar_backward_tiles(d),
            // FA2's forward: 4 warps of 32 rows against 64-key tiles (a
            // lane's O, d floats, and S, 32 a row tile, in registers), where
            // ptxas keeps that within 255 registers without spilling (for
            // sm_80 and sm_90a, as measured): not at d 96 (its chunks do not
            // divide the block's threads), nor at d 128 with a softcap (its
            // tanh per score) or dropout (its keep bits), nor with both at
            // any d; else 16 rows a warp.
            Family::ForwardMma => Tiles {
                rows: if d != 96
                    && !(d == 128 && (self.softcap || self.dropout))
                    && !(self.softcap && self.dropout)
                {
                    128
                } else {
                    64
                },
                keys: 64,
                lanes: 4,
                threads: 128,
            },
            Family::BackwardMma => Tiles {
                rows: 64,
                keys: if d <= 64 { 64 } else { 32 },
                lanes: 4,
                threads: 128,
            },
            // A producer warpgroup and two consumers of 64 rows; 128 keys,
            // wgmma's n for S (at d 128, 160 KiB of Q and two K/V stages).
            Family::ForwardWgmma => Tiles {
                rows: 128,
                keys: 128,
                lanes: 4,
                threads: 384,
            },
            // dK/dV: a producer warpgroup and two consumers of 64 keys;
            // 64 queries a step, wgmma's n for S^T and dP^T (whose f32
            // fragments, 32 floats each, sit beside dK's and dV's).
            Family::BackwardWgmma => Tiles {
                rows: 128,
                keys: 64,
                lanes: 4,
                threads: 384,
            },
            // Up to DECODE_ROWS query rows of a kv head's group a block.
            Family::Decode => Tiles {
                rows: DECODE_ROWS,
                keys: DECODE_KEYS,
                lanes: 32,
                threads: DECODE_THREADS,
            },
            // A warp a row.
            Family::Fp8Quantize => Tiles {
                rows: QUANT_ROWS,
                keys: 0,
                lanes: 32,
                threads: QUANT_ROWS * 32,
            },
        }
    }

    /// Bytes of static shared memory the variant declares (the tensor-core
    /// kernels' tiles are dynamic; the sm80 forward's allowed pairs of a
    /// boundary tile are a bit each): with dropout, the keep bits of a tile
    /// too (a bit per pair; cuda/dropout.cuh's `KeepTile`).
    pub fn shared_bytes(&self) -> usize {
        let t = self.tiles();
        let floats = match self.family {
            Family::Forward => forward_shared_floats(t.rows, t.keys, self.head_dim),
            Family::Backward if self.wide_backward() => 2 * t.rows * t.rows + 2 * t.rows,
            Family::Backward => backward_shared_floats(t.rows, self.head_dim),
            // The sm80 forward's allowed-pair bits (a bit per pair).
            Family::ForwardMma => t.rows * t.keys / 32,
            Family::BackwardMma | Family::ForwardWgmma | Family::BackwardWgmma => 0,
            // The rows' q, a tile's scores (P in place, a padding column)
            // and each row's m, l and rescale (the quantized append's block
            // maximum, DECODE_THREADS floats, is smaller than them).
            Family::Decode => t.rows * (self.head_dim + t.keys + 1 + 3),
            // Each warp's row, transformed in place.
            Family::Fp8Quantize => t.rows * self.head_dim,
        };
        let keep = if self.dropout { t.rows * t.keys / 8 } else { 0 };
        floats * 4 + keep
    }

    /// Whether the variant is the Hopper dK/dV that also adds dQ's
    /// partials (padded head dim 64; at 128 they spilled, and the backward
    /// runs the module's `flash_bwd_dq_wgmma`).
    pub fn adds_dq(&self) -> bool {
        self.family == Family::BackwardWgmma && self.head_dim == 64
    }

    /// Bytes of dynamic shared memory a launch gives the variant: the
    /// tensor-core kernels' layout, and the wide scalar backward's four
    /// tiles (their `SMEM_BYTES`, which the kernels check with a
    /// static_assert). Rows of `head_dim + 8` elements: the 16
    /// bytes of padding put ldmatrix's 8 rows in different banks.
    pub fn dynamic_shared_bytes(&self) -> usize {
        let t = self.tiles();
        let row = (self.head_dim + 8) * self.precision.bytes();
        match self.family {
            // Its four tiles (the static ones' rows: f32, one column of padding).
            Family::Backward if self.wide_backward() => 4 * t.rows * (self.head_dim + 1) * 4,
            Family::Forward | Family::Backward | Family::Decode | Family::Fp8Quantize => 0,
            // Q, then one buffer of K and one of V (each loads while the
            // other is in use).
            Family::ForwardMma => (t.rows + 2 * t.keys) * row,
            // Two owned tiles (K, V or Q, dO), two stages of two streamed,
            // then two stages of dK/dV's step rows' LSE and D (f32).
            Family::BackwardMma => (2 * t.rows + 4 * t.keys) * row + 4 * t.keys * 4,
            // Unpadded rows (TMA's 128B swizzle spreads the banks), 1 KiB to
            // align the tiles to the swizzle atoms, then 10 mbarriers (8 B).
            // FP8: rows of 1-byte codes, a V^T buffer a stage (head_dim
            // rows of a tile's keys), 12 mbarriers.
            Family::ForwardWgmma if self.is_fp8() => {
                1024 + (t.rows + 2 * 3 * t.keys) * self.head_dim + 12 * 8
            }
            Family::ForwardWgmma => {
                let bytes = self.head_dim * self.precision.bytes();
                1024 + (t.rows + 4 * t.keys) * bytes + 10 * 8
            }
            // dK/dV: K and V, two stages of Q and dO, (where it adds dQ)
            // two buffers of a step's dS (queries x keys) and each
            // consumer's dQ partial (f32 rows of 64 + 8), each stage's LSE
            // and D rows (f32), then 5 mbarriers. dQ (where dK/dV does not
            // add it): Q and dO of a block's rows, two stages of K and V
            // tiles of as many keys, 5 mbarriers. The larger of the two.
            Family::BackwardWgmma => {
                let bytes = self.head_dim * self.precision.bytes();
                let dq = match self.adds_dq() {
                    true => 2 * t.keys * t.rows * self.precision.bytes() + 2 * t.keys * (64 + 8) * 4,
                    false => 0,
                };
                let dkdv = 1024 + (2 * t.rows + 4 * t.keys) * bytes + dq + 2 * 2 * t.keys * 4 + 5 * 8;
                dkdv.max(1024 + 6 * t.rows * bytes + 5 * 8)
            }
        }
    }

    /// The scalar backward at a wide head dim: its tiles in dynamic shared
    /// memory (past 48 KiB at 8 × 8).
    fn wide_backward(&self) -> bool {
        self.family == Family::Backward && self.head_dim > STEPPED_MAX_HEAD_DIM
    }

    /// Buffers of each streamed tile (the sm80 forward: one of K and one
    /// of V, the scalar kernels' plain loads: one).
    pub fn stages(&self) -> usize {
        if self.family == Family::BackwardMma || self.family.is_wgmma() {
            2
        } else {
            1
        }
    }

    /// A name for logs, errors and the PTX files the tests write.
    pub fn label(&self) -> String {
        format!(
            "{}_{}_d{}{}{}{}{}",
            self.family.name(),
            self.precision.name(),
            self.head_dim,
            if self.band { "_band" } else { "" },
            if self.softcap { "_softcap" } else { "" },
            if self.dropout { "_dropout" } else { "" },
            self.quant.map_or(String::new(), |q| format!("_{}", q.name())),
        )
    }

    /// The NVRTC source: the defines, the shared headers, the kernel file.
    pub fn source(&self) -> String {
        let t = self.tiles();
        let storage = match self.precision {
            Precision::F32 => 0,
            Precision::F16 => 1,
            Precision::Bf16 => 2,
        };
        // BLOCK_ROWS, BLOCK_THREADS, SMEM_BYTES and IS_FORWARD are for
        // cuda/emulate/check.cpp's launches (and SMEM_BYTES for the mma
        // kernels' layout check and the wide scalar backward's tiles;
        // TENSOR_CORES for check.cpp's fragment self-test).
        let mut defines = format!(
            "#define HEAD_DIM {}\n#define STORAGE {storage}\n#define HAS_BAND {}\n\
             #define HAS_SOFTCAP {}\n#define HAS_DROPOUT {}\n#define THREADS_PER_ROW {}\n\
             #define BLOCK_ROWS {}\n#define BLOCK_THREADS {}\n#define SMEM_BYTES {}\n\
             #define IS_FORWARD {}\n#define IS_WGMMA {}\n#define TENSOR_CORES {}\n#define IS_FP8 {}\n",
            self.head_dim,
            u8::from(self.band),
            u8::from(self.softcap),
            u8::from(self.dropout),
            t.lanes,
            t.rows,
            t.threads,
            self.dynamic_shared_bytes(),
            u8::from(self.family.is_forward()),
            u8::from(self.family.is_wgmma()),
            u8::from(self.family.is_mma() || self.family.is_wgmma()),
            u8::from(self.is_fp8()),
        );
        let body = match self.family {
            Family::Forward => {
                defines += &format!("#define BLOCK_M {}\n#define BLOCK_N {}\n", t.rows, t.keys);
                FORWARD.to_string()
            }
            Family::Backward => {
                defines += &format!("#define BLOCK {}\n", t.rows);
                format!("{BACKWARD_DOT}\n{BACKWARD}")
            }
            Family::ForwardMma => {
                defines += &format!("#define BLOCK_M {}\n#define BLOCK_N {}\n", t.rows, t.keys);
                format!("{MMA}\n{FORWARD_MMA}")
            }
            Family::BackwardMma => {
                defines += &format!("#define BLOCK_M {}\n#define BLOCK_N {}\n", t.rows, t.keys);
                format!("{MMA}\n{BACKWARD_DOT}\n{BACKWARD_MMA}")
            }
            Family::ForwardWgmma => {
                defines += &format!("#define BLOCK_M {}\n#define BLOCK_N {}\n", t.rows, t.keys);
                format!("{MMA}\n{HOPPER}\n{FORWARD_WGMMA}")
            }
            Family::BackwardWgmma => {
                defines += &format!("#define BLOCK_M {}\n#define BLOCK_N {}\n", t.rows, t.keys);
                format!("{MMA}\n{HOPPER}\n{BACKWARD_DOT}\n{BACKWARD_WGMMA}")
            }
            Family::Decode => {
                let quant = match self.quant {
                    None => 0,
                    Some(CacheQuant::Int8) => 1,
                    Some(CacheQuant::Fp8) => 2,
                };
                defines += &format!(
                    "#define CACHE_QUANT {quant}\n#define DECODE_THREADS {}\n\
                     #define DECODE_KEYS {}\n#define DECODE_ROWS {}\n",
                    t.threads, t.keys, t.rows
                );
                format!("{E4M3}\n{DECODE}")
            }
            Family::Fp8Quantize => format!("{E4M3}\n{FP8_QUANT}"),
        };
        format!("{defines}{COMMON}\n{PHILOX}\n{DROPOUT}\n{body}")
    }
}

/// The scalar forward's tiles at padded head dim `d` ([`KernelKey::tiles`]).
fn scalar_forward_tiles(d: usize) -> Tiles {
    // Up to 32 output columns per lane; 128 threads.
    let lanes = (d / 32).next_power_of_two().min(32);
    let rows = 128 / lanes;
    // Q (rows × d) and K/V (keys × d) about 16 KiB each; wide:
    // as many keys as fit.
    let mut keys = match d <= STEPPED_MAX_HEAD_DIM {
        true => ((4096 / d).min(32) / lanes).max(1) * lanes,
        false => 32,
    };
    // Whole groups of 8 keys: dropout's keep bits (cuda/dropout.cuh).
    while keys > 8 && forward_shared_floats(rows, keys, d) * 4 + rows * keys / 8 > STATIC_SHARED_LIMIT
    {
        keys /= 2;
    }
    Tiles {
        rows,
        keys,
        lanes,
        threads: 128,
    }
}

/// The scalar backward's tiles at padded head dim `d` ([`KernelKey::tiles`]).
fn scalar_backward_tiles(d: usize) -> Tiles {
    // 16 columns of dK and of dV (or dQ) per lane; 18 at d 576.
    let lanes = (d / 16).next_power_of_two().min(32);
    // Four (block × d) f32 tiles within about 34 KiB; wide: 8
    // (whole groups of 8 keys for dropout's keep bits), the
    // tiles in dynamic shared memory.
    let block = match d <= STEPPED_MAX_HEAD_DIM {
        true => prev_power_of_two((2048 / d).min(32)),
        false => 8,
    };
    Tiles {
        rows: block,
        keys: block,
        lanes,
        threads: block * lanes,
    }
}

/// The scalar forward's shared floats: Q (rows) and K/V (keys) tiles of
/// `d + 1` floats a row, and P.
fn forward_shared_floats(rows: usize, keys: usize, d: usize) -> usize {
    (rows + keys) * (d + 1) + rows * keys
}

/// The scalar dK/dV kernel's (dQ's are fewer): K, V, Q, dO tiles, Pᵀ,
/// dSᵀ, lse and D.
fn backward_shared_floats(block: usize, d: usize) -> usize {
    4 * block * (d + 1) + 2 * block * block + 2 * block
}

fn prev_power_of_two(x: usize) -> usize {
    1 << (usize::BITS - 1 - x.max(1).leading_zeros())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_variant_fits_static_shared_memory_and_whole_warps_per_row() {
        for key in KernelKey::all() {
            let t = key.tiles();
            assert!(key.shared_bytes() <= STATIC_SHARED_LIMIT, "{}", key.label());
            // Within sm86/sm89's 99 KiB opt-in, the smallest sm80+ limit
            // (Hopper's kernel: within sm90's 227 KiB).
            let limit = if key.family.is_wgmma() { 227 } else { 99 };
            assert!(
                key.dynamic_shared_bytes() <= limit * 1024,
                "{}",
                key.label()
            );
            assert!(
                t.lanes.is_power_of_two() && t.lanes <= 32,
                "{}",
                key.label()
            );
            assert_eq!(key.head_dim % t.lanes, 0, "{}", key.label());
            assert!(
                t.threads() <= 1024 && t.threads() % 32 == 0,
                "{}",
                key.label()
            );
            if key.family == Family::Forward {
                // Whole rounds of keys a lane, or (wide) one key a lane at most.
                assert!(t.keys % t.lanes == 0 || key.head_dim > STEPPED_MAX_HEAD_DIM, "{}", key.label());
            }
            if matches!(key.family, Family::Forward | Family::Backward) {
                // Dropout's keep bits: whole groups of 8 keys.
                assert_eq!(t.keys % 8, 0, "{}", key.label());
                // The accumulators a lane holds (two sets in dK/dV).
                let cols = key.head_dim / t.lanes;
                assert!(cols <= if key.family.is_forward() { 32 } else { 18 }, "{}", key.label());
            }
            if key.family.is_mma() {
                // 16 rows a warp, or in the forward 32 (as FA2) where its
                // registers allow; ldmatrix.x4 takes streamed rows 16 at a
                // time, the forward's allowed bits 32 keys a word.
                let forward_pair = key.family.is_forward() && t.rows == 32 * t.warps();
                assert!(t.rows == 16 * t.warps() || forward_pair, "{}", key.label());
                assert_eq!(t.keys % if key.family.is_forward() { 32 } else { 16 }, 0);
                assert!(key.precision != Precision::F32);
            }
        }
    }

    #[test]
    fn the_tensor_core_kernels_take_f16_and_bf16_up_to_d128() {
        let all = KernelKey::all();
        let mma = |p| {
            all.iter()
                .filter(|k| k.family == Family::ForwardMma && k.precision == p)
                .map(|k| k.head_dim)
                .max()
        };
        assert_eq!(
            (
                mma(Precision::F32),
                mma(Precision::F16),
                mma(Precision::Bf16)
            ),
            (None, Some(128), Some(128))
        );
        // Scalar: 2 families × 3 precisions × (8 steps and 3 wide head
        // dims) × 4 options; mma: 2 families × f16/bf16 × d 32..128 × 4
        // options; both with and without dropout; Hopper: f16/bf16 × d 64,
        // 128 × 4 options, no dropout; decoding: every precision and head
        // dim (8 steps and 3 wide ones) × 4 options × plain, int8 and FP8
        // caches; the Hopper dK/dV as its forward; the Hopper FP8 forward's
        // 4 options; the FP8 quantization, one.
        assert_eq!(
            all.len(),
            2 * (2 * 3 * (8 + 3) * 4 + 2 * 2 * 4 * 4) + 2 * (2 * 2 * 4) + 3 * (8 + 3) * 4 * 3 + 4 + 1
        );
        let d128 = KernelKey::new(Family::BackwardMma, Precision::F16, 128, false, false);
        assert_eq!(d128.dynamic_shared_bytes(), (128 + 128) * 136 * 2 + 4 * 32 * 4);
        // The forward at d 128: Q (128 rows), K and V (64 each): 68 KiB.
        let forward = KernelKey::new(Family::ForwardMma, Precision::Bf16, 128, false, false);
        assert_eq!(forward.dynamic_shared_bytes(), (128 + 2 * 64) * 136 * 2);
        assert_eq!((forward.tiles().rows, forward.tiles().keys), (128, 64));
    }

    #[test]
    fn the_hopper_kernel_pads_to_64_or_128_and_fits_its_layout() {
        let key = |d| KernelKey::new(Family::ForwardWgmma, Precision::Bf16, d, true, false);
        assert_eq!(
            (key(8).head_dim, key(64).head_dim, key(72).head_dim),
            (64, 64, 128)
        );
        // Q (128 × 128) and two stages of K and V (128 × 128) in bf16: 160
        // KiB, plus the alignment slack and the barriers.
        assert_eq!(key(128).dynamic_shared_bytes(), 1024 + 160 * 1024 + 80);
        assert_eq!(key(64).dynamic_shared_bytes(), 1024 + 80 * 1024 + 80);
        assert_eq!((key(64).tiles().threads, key(64).stages()), (384, 2));
        // The backward at d 128 launches with its dQ kernel's layout, the
        // larger: Q and dO (128 rows), two stages of K and V (128 keys).
        let backward = KernelKey::new(Family::BackwardWgmma, Precision::Bf16, 128, false, false);
        assert_eq!(backward.dynamic_shared_bytes(), 1024 + 6 * 128 * 256 + 40);
        assert!(key(128).source().contains("#define IS_WGMMA 1"));
        assert!(key(128).source().contains("#define IS_FP8 0\n"));
    }

    /// The FP8 variant: e4m3 codes (a byte a column) at d 128, a V^T buffer
    /// a stage, two more barriers; its own label and define; in `all()`.
    #[test]
    fn the_fp8_hopper_forward_is_a_variant_of_its_own() {
        let fp8 = KernelKey::fp8_forward(100, true, false);
        assert_eq!((fp8.head_dim, fp8.precision), (FP8_HEAD_DIM, Precision::F32));
        assert!(fp8.is_fp8() && !KernelKey::new(Family::ForwardWgmma, Precision::F16, 128, true, false).is_fp8());
        assert_eq!(fp8.label(), "flash_fwd_wgmma_f32_d128_band_fp8");
        assert!(fp8.source().contains("#define IS_FP8 1\n"));
        // Q (128 rows), then two stages of K, V and V^T (128 rows each) of 128 codes.
        assert_eq!(fp8.dynamic_shared_bytes(), 1024 + (128 + 6 * 128) * 128 + 12 * 8);
        assert_eq!(KernelKey::fp8_forward(8, false, false).head_dim, 128);
        let all = KernelKey::all();
        assert_eq!(all.iter().filter(|k| k.is_fp8()).count(), 4);
        // with_quant stays the decode family's.
        let plain = KernelKey::new(Family::ForwardWgmma, Precision::F16, 128, false, false);
        assert_eq!(plain.with_quant(Some(CacheQuant::Fp8)).quant, None);
    }

    /// Up to d 256 the scalar tiles are the ~16 KiB ones; past it a row's
    /// lanes stop at a warp and the tiles shrink to the largest powers of
    /// two within 48 KiB.
    #[test]
    fn the_scalar_tiles_shrink_to_fit_the_wide_head_dims() {
        let tiles = |family, d| {
            let t = KernelKey::new(family, Precision::F16, d, false, false).tiles();
            (t.rows, t.keys, t.lanes, t.threads)
        };
        assert_eq!(tiles(Family::Forward, 128), (32, 32, 4, 128));
        assert_eq!(tiles(Family::Forward, 256), (16, 16, 8, 128));
        assert_eq!(tiles(Family::Forward, 384), (8, 16, 16, 128));
        // 16 keys would be 48.6 KiB.
        assert_eq!(tiles(Family::Forward, 512), (8, 8, 16, 128));
        assert_eq!(tiles(Family::Forward, 576), (4, 16, 32, 128));
        assert_eq!(tiles(Family::Backward, 128), (16, 16, 8, 128));
        assert_eq!(tiles(Family::Backward, 256), (8, 8, 16, 128));
        for d in WIDE_HEAD_DIMS {
            assert_eq!(tiles(Family::Backward, d), (8, 8, 32, 256), "d {d}");
        }
        let key = KernelKey::new(Family::Forward, Precision::F16, 576, true, false).with_dropout(true);
        assert_eq!(key.shared_bytes(), ((4 + 16) * 577 + 4 * 16) * 4 + 4 * 16 / 8);
        assert_eq!(key.dynamic_shared_bytes(), 0);
        // The backward's four 8 × 577 f32 tiles dynamic, Pᵀ, dSᵀ, lse and D static.
        let key = KernelKey::new(Family::Backward, Precision::F16, 576, true, false);
        assert_eq!(key.shared_bytes(), (2 * 64 + 2 * 8) * 4);
        assert_eq!(key.dynamic_shared_bytes(), 4 * 8 * 577 * 4);
        assert!(key.source().contains(&format!("#define SMEM_BYTES {}\n", 4 * 8 * 577 * 4)));
        let narrow = KernelKey::new(Family::Backward, Precision::F16, 256, true, false);
        assert_eq!(narrow.dynamic_shared_bytes(), 0);
    }

    /// Dropout is its own variant (define, label, the keep bits' shared
    /// memory: a bit per pair of a tile) of every family but the Hopper one.
    #[test]
    fn dropout_variants_have_their_define_label_and_keep_bits() {
        let key = |family| KernelKey::new(family, Precision::F16, 64, true, false);
        for family in [
            Family::Forward,
            Family::Backward,
            Family::ForwardMma,
            Family::BackwardMma,
        ] {
            let (plain, dropout) = (key(family), key(family).with_dropout(true));
            assert!(plain.source().contains("#define HAS_DROPOUT 0\n"));
            assert!(dropout.source().contains("#define HAS_DROPOUT 1\n"));
            assert_eq!(dropout.label(), format!("{}_dropout", plain.label()));
            let t = dropout.tiles();
            assert_eq!(
                dropout.shared_bytes(),
                plain.shared_bytes() + t.rows * t.keys / 8
            );
            assert_eq!(dropout.dynamic_shared_bytes(), plain.dynamic_shared_bytes());
        }
        let hopper = key(Family::ForwardWgmma).with_dropout(true);
        assert!(!hopper.dropout && hopper.source().contains("#define HAS_DROPOUT 0\n"));
    }

    #[test]
    fn head_dims_round_up_to_the_step() {
        let key = |d| KernelKey::new(Family::Forward, Precision::F16, d, false, false).head_dim;
        assert_eq!(
            (key(1), key(32), key(33), key(200), key(256)),
            (32, 32, 64, 224, 256)
        );
        // The scalar kernels past 256: to 384, 512 or 576, each a variant there is.
        let all = KernelKey::all();
        for family in [Family::Forward, Family::Backward, Family::Decode] {
            let wide = |d| KernelKey::new(family, Precision::Bf16, d, false, false);
            assert_eq!(
                [257, 300, 384, 385, 512, 513, 576].map(|d| wide(d).head_dim),
                [384, 384, 384, 512, 512, 576, 576]
            );
            assert!([200, 300, 576].iter().all(|&d| all.contains(&wide(d))));
        }
        // The tensor-core kernels stop at 128.
        assert!(all
            .iter()
            .all(|k| !(k.family.is_mma() || k.family.is_wgmma()) || k.head_dim <= MMA_MAX_HEAD_DIM));
    }
}

//! The CUDA kernels' variants: a typed key per compiled module, the tile
//! sizes each variant is built with, and its NVRTC source (cuda/common.cuh
//! after the key's defines, then the kernel file: one copy of the shared
//! pieces, no duplicated kernels).

use crate::api::tensor::Precision;

/// cuda/common.cuh: conversions, masks, scores, tile loads.
const COMMON: &str = include_str!("../../cuda/common.cuh");
const FORWARD: &str = include_str!("../../cuda/flash_fwd.cu");
const BACKWARD: &str = include_str!("../../cuda/flash_bwd.cu");

/// Head dims are compiled in steps of this many columns (the rest load as
/// zeros), so 8 widths cover every head dim 1..=256.
pub const HEAD_DIM_STEP: usize = 32;
/// The largest head dim the CUDA kernels take.
pub const MAX_HEAD_DIM: usize = 256;

/// Which source file (module) a key compiles.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Family {
    /// cuda/flash_fwd.cu: `flash_fwd`.
    Forward,
    /// cuda/flash_bwd.cu: `flash_bwd_dot`, `flash_bwd_dkdv`, `flash_bwd_dq`.
    Backward,
}

impl Family {
    pub const ALL: [Family; 2] = [Family::Forward, Family::Backward];

    pub fn name(self) -> &'static str {
        match self {
            Family::Forward => "flash_fwd",
            Family::Backward => "flash_bwd",
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
}

/// A variant's thread-block shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Tiles {
    /// Query rows per block (the backward's tiles are square: rows = keys).
    pub rows: usize,
    /// Keys per block.
    pub keys: usize,
    /// Lanes per row: a power of two, so a row's lanes share a warp.
    pub lanes: usize,
}

impl Tiles {
    pub fn threads(&self) -> usize {
        self.rows * self.lanes
    }
}

impl KernelKey {
    /// The key for a problem of head dim `head_dim` (1..=[`MAX_HEAD_DIM`]).
    pub fn new(
        family: Family,
        precision: Precision,
        head_dim: usize,
        band: bool,
        softcap: bool,
    ) -> Self {
        Self {
            family,
            precision,
            head_dim: head_dim.div_ceil(HEAD_DIM_STEP).max(1) * HEAD_DIM_STEP,
            band,
            softcap,
        }
    }

    /// Every variant there is: what the NVRTC test compiles.
    pub fn all() -> Vec<Self> {
        let mut keys = Vec::new();
        for family in Family::ALL {
            for precision in [Precision::F32, Precision::F16, Precision::Bf16] {
                for head_dim in (HEAD_DIM_STEP..=MAX_HEAD_DIM).step_by(HEAD_DIM_STEP) {
                    for band in [false, true] {
                        for softcap in [false, true] {
                            keys.push(Self::new(family, precision, head_dim, band, softcap));
                        }
                    }
                }
            }
        }
        keys
    }

    /// Tile sizes. Every tile is held in f32 in shared memory with one
    /// column of padding; the sizes keep a block within the 48 KiB of
    /// static shared memory every sm80+ device has, at 128 threads (64 for
    /// the backward at d 32), and each lane at 32 (forward) or 2 × 16
    /// (backward) f32 accumulators, which stay in registers.
    pub fn tiles(&self) -> Tiles {
        let d = self.head_dim;
        match self.family {
            Family::Forward => {
                // 32 output columns per lane; 128 threads.
                let lanes = (d / 32).next_power_of_two();
                let rows = 128 / lanes;
                // Q (rows × d) and K/V (keys × d) about 16 KiB each.
                let keys = ((4096 / d).min(32) / lanes).max(1) * lanes;
                Tiles { rows, keys, lanes }
            }
            Family::Backward => {
                // 16 columns of dK and of dV (or dQ) per lane.
                let lanes = (d / 16).next_power_of_two();
                // Four (block × d) f32 tiles within about 34 KiB.
                let block = prev_power_of_two((2048 / d).min(32));
                Tiles {
                    rows: block,
                    keys: block,
                    lanes,
                }
            }
        }
    }

    /// Bytes of static shared memory the variant declares.
    pub fn shared_bytes(&self) -> usize {
        let t = self.tiles();
        let pad = self.head_dim + 1;
        let floats = match self.family {
            Family::Forward => t.rows * pad + t.keys * pad + t.rows * t.keys,
            // dK/dV's: K, V, Q, dO tiles, Pᵀ, dSᵀ, lse and D.
            Family::Backward => 4 * t.rows * pad + 2 * t.rows * t.rows + 2 * t.rows,
        };
        floats * 4
    }

    /// A name for logs, errors and the PTX files the tests write.
    pub fn label(&self) -> String {
        format!(
            "{}_{}_d{}{}{}",
            self.family.name(),
            self.precision.name(),
            self.head_dim,
            if self.band { "_band" } else { "" },
            if self.softcap { "_softcap" } else { "" },
        )
    }

    /// The NVRTC source: the defines, the shared header, the kernel file.
    pub fn source(&self) -> String {
        let t = self.tiles();
        let storage = match self.precision {
            Precision::F32 => 0,
            Precision::F16 => 1,
            Precision::Bf16 => 2,
        };
        let mut defines = format!(
            "#define HEAD_DIM {}\n#define STORAGE {storage}\n#define HAS_BAND {}\n\
             #define HAS_SOFTCAP {}\n#define THREADS_PER_ROW {}\n",
            self.head_dim,
            u8::from(self.band),
            u8::from(self.softcap),
            t.lanes,
        );
        let body = match self.family {
            Family::Forward => {
                defines += &format!("#define BLOCK_M {}\n#define BLOCK_N {}\n", t.rows, t.keys);
                FORWARD
            }
            Family::Backward => {
                defines += &format!("#define BLOCK {}\n", t.rows);
                BACKWARD
            }
        };
        format!("{defines}{COMMON}\n{body}")
    }
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
            assert!(key.shared_bytes() <= 48 * 1024, "{}", key.label());
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
                assert_eq!(t.keys % t.lanes, 0, "{}", key.label());
            }
        }
    }

    #[test]
    fn head_dims_round_up_to_the_step() {
        let key = |d| KernelKey::new(Family::Forward, Precision::F16, d, false, false).head_dim;
        assert_eq!(
            (key(1), key(32), key(33), key(200), key(256)),
            (32, 32, 64, 224, 256)
        );
    }
}

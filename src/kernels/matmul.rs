//! The matmul kernels (`matmul.wgsl`, tiled, for GPUs; `matmul_lanes.wgsl`
//! on CPU adapters): `C = epilogue(A · op(B))` batched over (batch, heads)
//! with strides. They measure the adapter's practical ceiling and run the
//! naive baseline's products.

use super::compose::{binding, section, unroll, Access, Composer, KernelSource, Unroll, Variant};
use super::params::MatmulParams;
use crate::api::output::Accesses;
use crate::plan::StorageKind;

const TILED: &str = include_str!("../../shaders/matmul.wgsl");
const COMMON: &str = include_str!("../../shaders/matmul_common.wgsl");
const LANES: &str = include_str!("../../shaders/matmul_lanes.wgsl");

/// Rows and columns of C per workgroup, and the K step (see matmul.wgsl).
pub const TILE_MN: u32 = 64;
pub const TILE_K: u32 = 16;
/// Longest row the lanes matmul keeps in registers (K for `dot`, N for `axpy`).
pub const LANES_MAX_ROW: u32 = 256;
/// Rows of C per lane in the lanes matmul. Unlike the lanes forward, it runs
/// fastest with one: on lavapipe at N 4096, d 64, two rows per lane took the
/// dot form from 27.3 to 19.0 GFLOP/s and the naive forward from 325 to
/// 583 ms (both forms at two rows).
pub const LANES_MATMUL_ROWS: u32 = 1;

/// What the matmul does with each result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Epilogue {
    /// `alpha · acc`.
    Scale = 0,
    /// Attention scores: `scale`, softcap and mask from the attention params.
    Scores = 1,
}

/// Which matmul kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MatmulForm {
    /// `matmul.wgsl`, any shape; `aligned`: M, N multiples of 64 and K of 16.
    Tiled { aligned: bool },
    /// `matmul_lanes.wgsl` on `lanes`-wide subgroups, `rows` rows of C per
    /// lane: the `dot` form when B is transposed (K = 4·`chunks`), else
    /// `axpy` (N = 4·`chunks`).
    Lanes { lanes: u32, chunks: u32, rows: u32 },
}

/// One matmul kernel: operand storage, form, epilogue and variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Matmul {
    /// Storage of A, B and C.
    pub storage: [StorageKind; 3],
    pub b_trans: bool,
    pub form: MatmulForm,
    pub epilogue: Epilogue,
    pub variant: Variant,
}

/// A matmul problem: operand storage, whether B is read transposed, the
/// epilogue, strides, and the batch (times `params.heads`).
#[derive(Clone, Copy, Debug)]
pub struct MatmulProblem {
    pub storage: [StorageKind; 3],
    pub b_trans: bool,
    pub epilogue: Epilogue,
    pub params: MatmulParams,
    pub batch: usize,
}

/// A matmul ready to dispatch: its kernel, parameters and grid.
#[derive(Clone, Copy, Debug)]
pub struct MatmulSpec {
    pub kernel: Matmul,
    pub params: MatmulParams,
    pub grid: [u32; 3],
}

impl MatmulProblem {
    /// The kernel and grid for this problem. `lanes` is the adapter's lanes
    /// subgroup ([`crate::plan::DeviceCaps::lane_subgroup`]): where the shape
    /// allows, the lanes kernel runs, else the tiled one.
    pub fn spec(&self, variant: Variant, lanes: Option<u32>) -> MatmulSpec {
        let p = &self.params;
        let form = self.form(lanes);
        let z = (self.batch * p.heads as usize) as u32;
        let grid = match form {
            MatmulForm::Tiled { .. } => [p.n.div_ceil(TILE_MN), p.m.div_ceil(TILE_MN), z],
            // Each workgroup owns lanes × rows rows of C.
            MatmulForm::Lanes { lanes, rows, .. } => [1, p.m.div_ceil(lanes * rows), z],
        };
        MatmulSpec {
            kernel: Matmul {
                storage: self.storage,
                b_trans: self.b_trans,
                form,
                epilogue: self.epilogue,
                variant,
            },
            params: *p,
            grid,
        }
    }

    /// The lanes kernel where the adapter has it, the row it keeps in
    /// registers (K for Bᵀ, N otherwise) is a multiple of 4 up to
    /// [`LANES_MAX_ROW`], and every row it accesses as vec4s starts on a
    /// multiple of 4; else the tiled kernel.
    fn form(&self, lanes: Option<u32>) -> MatmulForm {
        let p = &self.params;
        let aligned = p.m.is_multiple_of(TILE_MN)
            && p.n.is_multiple_of(TILE_MN)
            && p.k.is_multiple_of(TILE_K);
        let tiled = MatmulForm::Tiled { aligned };
        let Some(lanes) = lanes else { return tiled };
        let row = if self.b_trans { p.k } else { p.n };
        let quads = |xs: &[u32]| xs.iter().all(|x| x % 4 == 0);
        let b_rows = quads(&[p.ldb, p.b_batch, p.b_head]);
        // The dot form also stores C four columns at a time, in f32.
        let dot = self.b_trans;
        let a_rows = !dot || quads(&[p.lda, p.a_batch, p.a_head]);
        let c_f32 = self.storage[2] == StorageKind::F32;
        let c_rows = !dot || (c_f32 && quads(&[p.n, p.ldc, p.c_batch, p.c_head]));
        if row % 4 == 0 && row > 0 && row <= LANES_MAX_ROW && a_rows && b_rows && c_rows {
            MatmulForm::Lanes {
                lanes,
                chunks: row / 4,
                rows: LANES_MATMUL_ROWS,
            }
        } else {
            tiled
        }
    }
}

impl MatmulSpec {
    /// FLOPs of one run (2·M·N·K per batch entry).
    pub fn flops(&self) -> f64 {
        let p = &self.params;
        2.0 * p.m as f64 * p.n as f64 * p.k as f64 * self.grid[2] as f64
    }

    /// Storage accesses: A once per column tile and B once per row tile
    /// (tiled), or A once and all of B per subgroup of rows (lanes); C once.
    pub fn accesses(&self) -> Accesses {
        let p = &self.params;
        let (m, n, k) = (p.m as u64, p.n as u64, p.k as u64);
        let reads = match self.kernel.form {
            MatmulForm::Tiled { .. } => {
                let tiles = |x: u64| x.div_ceil(TILE_MN as u64);
                m * k * tiles(n) + n * k * tiles(m)
            }
            MatmulForm::Lanes { lanes, rows, .. } => {
                m * k + n * k * m.div_ceil((lanes * rows) as u64)
            }
        };
        Accesses {
            reads,
            writes: m * n,
        }
        .times(self.grid[2] as u64)
    }

    /// Loop iterations per invocation: the K loop of the tiled kernel (with
    /// its tile loads), the column or K loop of the lanes kernel.
    pub fn loop_iterations(&self) -> u64 {
        let p = &self.params;
        let steps = match self.kernel.form {
            MatmulForm::Tiled { .. } => p.k.div_ceil(TILE_K) as u64 * (1 + 4),
            MatmulForm::Lanes { lanes, .. } if self.kernel.b_trans => p.n.div_ceil(lanes) as u64,
            MatmulForm::Lanes { lanes, .. } => p.k.div_ceil(lanes) as u64,
        };
        steps + 2
    }
}

impl Matmul {
    pub const NAME: &'static str = "matmul";

    /// The entry point of this kernel's module.
    pub fn entry(&self) -> &'static str {
        match self.form {
            MatmulForm::Tiled { .. } => "main",
            MatmulForm::Lanes { .. } if self.b_trans => "dot",
            MatmulForm::Lanes { .. } => "axpy",
        }
    }

    pub fn source(&self) -> KernelSource {
        let [a, b, c] = self.storage;
        let native = self.storage.contains(&StorageKind::F16Native);
        let mut k = Composer::new(if native {
            StorageKind::F16Native
        } else {
            StorageKind::F32
        });
        k.override_bool("B_TRANS", self.b_trans)
            .override_u32("EPILOGUE", self.epilogue as u32);
        let (access, body) = match self.form {
            MatmulForm::Tiled { aligned } => {
                k.override_bool("ALIGNED", aligned);
                (
                    [Access::Read, Access::Read, Access::Write],
                    TILED.to_string(),
                )
            }
            MatmulForm::Lanes {
                lanes,
                chunks,
                rows,
            } => {
                k.override_u32("SG", lanes).override_u32("RPL", rows);
                let form = if self.b_trans { "dot" } else { "axpy" };
                let n = Unroll {
                    lanes,
                    chunks,
                    v_chunks: chunks,
                    rows,
                    cols: 1,
                };
                (lanes_access(self.b_trans), unroll(&section(LANES, form), n))
            }
        };
        k.common(self.variant)
            .buffers(a, &[("a", binding::A, access[0])])
            .buffers(b, &[("b", binding::B, access[1])])
            .buffers(c, &[("c", binding::C, access[2])])
            .push(COMMON)
            .push(&body)
            .finish(self.entry())
    }
}

/// How the lanes forms access A, B and C: `dot` reads rows of A and B and
/// stores C as vec4s; `axpy` reads A by element, B as vec4s, stores C by element.
fn lanes_access(dot: bool) -> [Access; 3] {
    if dot {
        [Access::Read4, Access::Read4, Access::Write4]
    } else {
        [Access::Read, Access::Read4, Access::Write]
    }
}

//! Host side of the matmuls (`shaders/matmul.wgsl`, tiled, and
//! `shaders/matmul_lanes.wgsl` on CPU adapters): the adapter's practical
//! ceiling, measured on attention's dominant shape (N×d times d×N), and the
//! matmuls of the naive baseline.

use super::engine::{CallStats, Engine, Step};
use super::params::{Params, Piece};
use super::shaders::{self, Epilogue, MatmulKernel, Variant};
use crate::error::Result;
use crate::options::AttentionOptions;
use crate::plan::StorageKind;
use crate::random::Rng;
use crate::tensor::AttentionShape;
use bytemuck::{Pod, Zeroable};

/// Rows and columns of C per workgroup, and the K step (see matmul.wgsl).
pub const TILE_MN: usize = 64;
pub const TILE_K: usize = 16;

/// The WGSL twin is `MatmulParams` in matmul.wgsl.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct MatmulParams {
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub lda: u32,
    pub ldb: u32,
    pub ldc: u32,
    pub a_batch: u32,
    pub a_head: u32,
    pub b_batch: u32,
    pub b_head: u32,
    pub c_batch: u32,
    pub c_head: u32,
    pub heads: u32,
    pub group: u32,
    pub alpha: f32,
    pub _pad: u32,
}

/// One matmul of a problem: the kernel text and its launch.
pub(crate) struct MatmulSpec {
    pub source: String,
    pub kernel: MatmulKernel,
    pub entry: &'static str,
    pub params: MatmulParams,
    pub grid: [usize; 3],
}

/// Longest row the lanes matmul keeps in registers (K for `dot`, N for `axpy`).
pub const LANES_MAX_ROW: u32 = 256;
/// Rows of C per lane in the lanes matmul. Unlike the lanes forward, it runs
/// fastest with one: on lavapipe at N 4096, d 64, two rows per lane took the
/// dot form from 27.3 to 19.0 GFLOP/s and the naive forward from 325 to
/// 583 ms (both forms at two rows).
pub const LANES_MATMUL_ROWS: u32 = 1;

impl MatmulSpec {
    /// `C = epilogue(A·op(B))` batched over `batch · heads` with these strides.
    /// `lanes` is the adapter's lanes subgroup ([`crate::DeviceCaps::lane_subgroup`]):
    /// where the shape allows, the lanes kernel runs, else the tiled one.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        storages: [StorageKind; 3],
        b_trans: bool,
        epilogue: Epilogue,
        variant: Variant,
        params: MatmulParams,
        batch: usize,
        lanes: Option<u32>,
    ) -> Self {
        let [a, b, c] = storages;
        let kernel = Self::choose(&params, b_trans, c, lanes);
        let z = batch * params.heads as usize;
        let grid = match kernel {
            MatmulKernel::Tiled { .. } => [
                (params.n as usize).div_ceil(TILE_MN),
                (params.m as usize).div_ceil(TILE_MN),
                z,
            ],
            // Each workgroup owns lanes × rows rows of C.
            MatmulKernel::Lanes { lanes, rows, .. } => {
                [1, (params.m as usize).div_ceil((lanes * rows) as usize), z]
            }
        };
        Self {
            source: shaders::matmul(a, b, c, b_trans, kernel, epilogue, variant),
            kernel,
            entry: kernel.entry(b_trans),
            grid,
            params,
        }
    }

    /// The lanes kernel where the adapter has it, the row it keeps in
    /// registers (K for Bᵀ, N otherwise) is a multiple of 4 up to
    /// [`LANES_MAX_ROW`], and every row it accesses as vec4s starts on a
    /// multiple of 4; else the tiled kernel.
    fn choose(p: &MatmulParams, b_trans: bool, c: StorageKind, lanes: Option<u32>) -> MatmulKernel {
        let aligned = p.m as usize % TILE_MN == 0
            && p.n as usize % TILE_MN == 0
            && p.k as usize % TILE_K == 0;
        let tiled = MatmulKernel::Tiled { aligned };
        let Some(lanes) = lanes else { return tiled };
        let row = if b_trans { p.k } else { p.n };
        let quads = |xs: &[u32]| xs.iter().all(|x| x % 4 == 0);
        let b_rows = quads(&[p.ldb, p.b_batch, p.b_head]);
        // The dot form also stores C four columns at a time, in f32.
        let a_rows = !b_trans || quads(&[p.lda, p.a_batch, p.a_head]);
        let c_rows =
            !b_trans || (c == StorageKind::F32 && quads(&[p.n, p.ldc, p.c_batch, p.c_head]));
        if row % 4 == 0 && row > 0 && row <= LANES_MAX_ROW && a_rows && b_rows && c_rows {
            MatmulKernel::Lanes {
                lanes,
                chunks: row / 4,
                rows: LANES_MATMUL_ROWS,
            }
        } else {
            tiled
        }
    }

    /// FLOPs of one run (2·M·N·K per batch entry).
    pub fn flops(&self) -> f64 {
        2.0 * self.params.m as f64
            * self.params.n as f64
            * self.params.k as f64
            * self.grid[2] as f64
    }
}

/// A timed matmul on this adapter.
#[derive(Clone, Debug)]
pub struct CeilingResult {
    pub n: usize,
    pub d: usize,
    /// Which matmul kernel ran (`tiled` or `lanes`).
    pub kernel: &'static str,
    /// Kernel seconds of each repeat.
    pub seconds: Vec<f64>,
    pub flops: f64,
}

impl CeilingResult {
    /// GFLOP/s of the fastest repeat.
    pub fn gflops(&self) -> f64 {
        let best = self.seconds.iter().cloned().fold(f64::INFINITY, f64::min);
        self.flops / best / 1e9
    }
}

impl Engine {
    /// The practical ceiling: `C = X·Yᵀ` with X, Y of N×d f32 (the shape of
    /// S = QKᵀ), C of N×N f32, timed `repeats` times after a warm-up.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn matmul_ceiling(&self, n: usize, d: usize, repeats: usize) -> Result<CeilingResult> {
        pollster::block_on(self.matmul_ceiling_async(n, d, repeats))
    }

    /// [`Engine::matmul_ceiling`] as a future.
    pub async fn matmul_ceiling_async(
        &self,
        n: usize,
        d: usize,
        repeats: usize,
    ) -> Result<CeilingResult> {
        let shape = AttentionShape::new(1, n, n, 1, 1, d)?;
        let spec = MatmulSpec::new(
            [StorageKind::F32; 3],
            true,
            Epilogue::Scale,
            self.variant(false, false),
            MatmulParams {
                m: n as u32,
                n: n as u32,
                k: d as u32,
                lda: d as u32,
                ldb: d as u32,
                ldc: n as u32,
                heads: 1,
                group: 1,
                alpha: 1.0,
                ..Default::default()
            },
            1,
            self.caps().lane_subgroup,
        );
        let mut rng = Rng::new(11);
        let x = rng.normal_vec(n * d, 1.0);
        let y = rng.normal_vec(n * d, 1.0);
        let mut stats = CallStats::default();
        let xb = self.upload(&mut stats, "x", bytemuck::cast_slice(&x));
        let yb = self.upload(&mut stats, "y", bytemuck::cast_slice(&y));
        let cb = self.storage(&mut stats, "c", (n * n * 4) as u64);
        let params = Params::new(&Piece::whole(shape), &AttentionOptions::default())?;
        let mut seconds = Vec::new();
        for i in 0..=repeats {
            let mut run = CallStats::default();
            let steps = [self.matmul_step(&spec, [&xb, &yb, &cb], &mut run).await?];
            self.run_steps("running the matmul ceiling", &steps, &params, &[], &mut run)
                .await?;
            if i > 0 {
                seconds.push(run.kernel_seconds);
            }
        }
        Ok(CeilingResult {
            n,
            d,
            kernel: match spec.kernel {
                MatmulKernel::Tiled { .. } => "tiled",
                MatmulKernel::Lanes { .. } => "lanes",
            },
            seconds,
            flops: spec.flops(),
        })
    }

    /// The pipeline, bindings (A, B, C and the matmul params) and grid of a
    /// matmul; its storage accesses are added to `stats`.
    pub(crate) async fn matmul_step(
        &self,
        spec: &MatmulSpec,
        [a, b, c]: [&wgpu::Buffer; 3],
        stats: &mut CallStats,
    ) -> Result<Step> {
        stats.accesses += super::io::matmul(spec);
        let pipeline = self.pipeline(&spec.source, spec.entry).await?;
        let params = self.uniform(&spec.params);
        Ok((
            pipeline,
            vec![(1, a.clone()), (2, b.clone()), (3, c.clone()), (14, params)],
            spec.grid,
        ))
    }
}

//! The adapter's practical ceiling: the tuned matmul on one of attention's
//! two product shapes, f32, timed.

use super::naive::{nn_params, nt_params};
use crate::api::shape::AttentionShape;
use crate::error::Result;
use crate::kernels::{binding, Epilogue, MatmulParams, MatmulProblem, Params, Piece};
use crate::plan::StorageKind;
use crate::random::Rng;
use crate::runtime::{whole, Call, Dispatch, Gpu};

/// Which of attention's products the ceiling times (equal FLOPs: 2·N²·d).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CeilingShape {
    /// `S = Q·Kᵀ`: N×d · d×N. With a shallow inner dimension its cost is
    /// storing the N×N output, which flash never does: not an upper bound
    /// for flash where stores are dear (CPU adapters).
    Scores,
    /// `O = P·V`: N×N · N×d. The inner dimension is deep, so the cost is in
    /// the multiply-adds: the bound for arithmetic.
    Values,
}

impl CeilingShape {
    /// The shape in words.
    pub fn describe(self) -> &'static str {
        match self {
            CeilingShape::Scores => "N×d · d×N (S = QKᵀ)",
            CeilingShape::Values => "N×N · N×d (O = PV)",
        }
    }

    /// Whether B is read transposed, and the strides: those of the naive
    /// baseline's products for one head.
    fn params(self, attention: &AttentionShape) -> (bool, MatmulParams) {
        match self {
            CeilingShape::Scores => (true, nt_params(attention, attention.head_dim, 1.0)),
            CeilingShape::Values => (false, nn_params(attention, attention.head_dim_v, 1.0)),
        }
    }
}

/// A timed matmul on this adapter.
#[derive(Clone, Debug)]
pub struct CeilingResult {
    /// Which product.
    pub shape: CeilingShape,
    /// The matrices' rows.
    pub n: usize,
    /// The shared (inner) dimension.
    pub d: usize,
    /// Which matmul kernel ran (`tiled` or `lanes`).
    pub kernel: &'static str,
    /// Kernel seconds of each repeat.
    pub seconds: Vec<f64>,
    /// Floating-point operations per second reached.
    pub flops: f64,
}

impl CeilingResult {
    /// GFLOP/s of the fastest repeat.
    pub fn gflops(&self) -> f64 {
        let best = self.seconds.iter().cloned().fold(f64::INFINITY, f64::min);
        self.flops / best / 1e9
    }
}

/// The matmul of `shape` timed `repeats` times after a warm-up.
pub async fn matmul_ceiling(
    gpu: &Gpu,
    shape: CeilingShape,
    n: usize,
    d: usize,
    repeats: usize,
) -> Result<CeilingResult> {
    let attention = AttentionShape::new(1, n, n, 1, 1, d)?;
    let (b_trans, params) = shape.params(&attention);
    let (m, cols, k) = (params.m as usize, params.n as usize, params.k as usize);
    let problem = MatmulProblem {
        storage: [StorageKind::F32; 3],
        b_trans,
        epilogue: Epilogue::Scale,
        params,
        batch: 1,
    };
    let spec = problem.spec(gpu.variant(false, false), gpu.caps().lane_subgroup);
    let mut rng = Rng::new(11);
    let x = rng.normal_vec(m * k, 1.0);
    let y = rng.normal_vec(k * cols, 1.0);
    let mut call = Call::new(gpu, None);
    let xb = call.upload("x", bytemuck::cast_slice(&x))?;
    let yb = call.upload("y", bytemuck::cast_slice(&y))?;
    let cb = call.storage("c", (m * cols * 4) as u64)?;
    let params = Params::new(&Piece::whole(attention), &Default::default())?;
    let dispatch = Dispatch {
        kernel: spec.kernel.into(),
        uniforms: vec![
            (binding::PARAMS, bytemuck::bytes_of(&params).to_vec()),
            (binding::MATMUL, bytemuck::bytes_of(&spec.params).to_vec()),
        ],
        buffers: whole([(binding::A, &xb), (binding::B, &yb), (binding::C, &cb)]),
        grid: spec.grid,
        walk: None,
    };
    let mut seconds = Vec::new();
    for i in 0..=repeats {
        let before = call.stats.kernel_seconds;
        call.run(std::slice::from_ref(&dispatch)).await?;
        if i > 0 {
            seconds.push(call.stats.kernel_seconds - before);
        }
    }
    Ok(CeilingResult {
        shape,
        n,
        d,
        kernel: match spec.kernel.form {
            crate::kernels::MatmulForm::Tiled { .. } => "tiled",
            crate::kernels::MatmulForm::Lanes { .. } => "lanes",
        },
        seconds,
        flops: spec.flops(),
    })
}

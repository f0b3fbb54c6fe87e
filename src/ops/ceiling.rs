//! The adapter's practical ceiling: the tuned matmul on attention's dominant
//! shape, `C = X·Yᵀ` with X, Y of N×d f32 and C of N×N f32 (S = QKᵀ), timed.

use crate::api::shape::AttentionShape;
use crate::error::Result;
use crate::kernels::{binding, Epilogue, MatmulParams, MatmulProblem, Params, Piece};
use crate::plan::StorageKind;
use crate::random::Rng;
use crate::runtime::{Call, Dispatch, Gpu};

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

/// The matmul timed `repeats` times after a warm-up.
pub async fn matmul_ceiling(
    gpu: &Gpu,
    n: usize,
    d: usize,
    repeats: usize,
) -> Result<CeilingResult> {
    let shape = AttentionShape::new(1, n, n, 1, 1, d)?;
    let problem = MatmulProblem {
        storage: [StorageKind::F32; 3],
        b_trans: true,
        epilogue: Epilogue::Scale,
        params: MatmulParams {
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
        batch: 1,
    };
    let spec = problem.spec(gpu.variant(false, false), gpu.caps().lane_subgroup);
    let mut rng = Rng::new(11);
    let x = rng.normal_vec(n * d, 1.0);
    let y = rng.normal_vec(n * d, 1.0);
    let mut call = Call::new(gpu, None);
    let xb = call.upload("x", bytemuck::cast_slice(&x))?;
    let yb = call.upload("y", bytemuck::cast_slice(&y))?;
    let cb = call.storage("c", (n * n * 4) as u64)?;
    let params = Params::new(&Piece::whole(shape), &Default::default())?;
    let dispatch = Dispatch {
        kernel: spec.kernel.into(),
        uniforms: vec![
            (binding::PARAMS, bytemuck::bytes_of(&params).to_vec()),
            (binding::MATMUL, bytemuck::bytes_of(&spec.params).to_vec()),
        ],
        buffers: vec![(binding::A, &xb), (binding::B, &yb), (binding::C, &cb)],
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

//! `--backend auto`, decided by what is faster for the problem (SPEC.md): a
//! hardware GPU when there is one; where the only adapters run on the CPU,
//! each that has its fast (lanes) kernels for the problem is timed against
//! the CPU backend on a slice of the problem, and the faster wins. Software
//! adapters without them would run the tiled kernels, which are shaped for
//! GPUs: on a CPU every per-invocation load they make is a loop over the
//! SIMD lanes, and under llvmpipe's GL driver their first compile takes
//! minutes; such adapters are passed over for the CPU backend, and the
//! reason says so.

use crate::api::inputs::BackwardInputs;
use crate::api::options::AttentionOptions;
use crate::api::shape::AttentionShape;
use crate::api::tensor::{Precision, TensorData, TensorView};
use crate::cpu;
use crate::engine::Engine;
use crate::error::Result;
use crate::plan::{plan_forward, DeviceCaps, KernelFamily, PlanRequest};
use crate::random::Rng;
use crate::runtime::adapter::{adapters, is_software};
use web_time::Instant;

/// What a backend is chosen for: `auto` measures on (a slice of) it.
#[derive(Clone, Copy, Debug)]
pub struct Workload {
    pub shape: AttentionShape,
    pub precision: Precision,
    pub opts: AttentionOptions,
    /// The backward runs too (after a forward).
    pub backward: bool,
}

/// The decision and why.
pub enum Decision {
    Gpu(Box<Engine>, String),
    Cpu(String),
}

/// Longest sequence and most heads of the slice `auto` times: enough work
/// to keep two cores and a CPU adapter's SIMD lanes busy, a fraction of a
/// second on either.
const PROBE_SEQLEN: usize = 512;
const PROBE_HEADS: usize = 4;

/// Decide for `workload` on this machine.
pub async fn choose(workload: &Workload) -> Result<Decision> {
    let found = adapters().await;
    let Some(best) = found.first() else {
        return Ok(Decision::Cpu(
            "no GPU adapter found; the CPU backend".into(),
        ));
    };
    let info = best.get_info();
    if !is_software(&info) {
        let engine = Engine::from_adapter(best).await?;
        let why = format!("a hardware GPU: {}", engine.describe());
        return Ok(Decision::Gpu(Box::new(engine), why));
    }
    let mut passed = Vec::new();
    for adapter in &found {
        let info = adapter.get_info();
        let caps = DeviceCaps::from_adapter(&adapter.limits(), adapter.features(), &info);
        let req = PlanRequest::for_shape(&workload.shape, workload.precision, Default::default());
        if plan_forward(&req, &caps)?.plan.kernel == KernelFamily::Lanes {
            let engine = Engine::from_adapter(adapter).await?;
            return race(engine, workload).await;
        }
        passed.push(format!("{} ({:?})", info.name, info.backend));
    }
    Ok(Decision::Cpu(format!(
        "the only adapters run on the CPU ({}) and have no lanes kernels for this problem \
         (no fixed-size subgroups, or head_dim not a multiple of 4 up to 128): their tiled \
         kernels are built for GPUs and run slower than the CPU backend there",
        passed.join(", ")
    )))
}

/// Time a slice of the workload on the engine and on the CPU backend.
async fn race(engine: Engine, w: &Workload) -> Result<Decision> {
    let slice = Slice::new(w);
    let views = slice.views();
    // The first GPU run compiles the kernels; it is not timed.
    slice.run_gpu(&engine, &views).await?;
    let gpu = slice.run_gpu(&engine, &views).await?;
    let cpu = slice.run_cpu(&views)?;
    let s = &slice.shape;
    let what = format!(
        "{} is a CPU adapter; on a slice of this problem ({} × {} tokens, {} heads{}) its lanes kernels took {:.1} ms and the CPU backend {:.1} ms",
        engine.adapter_info().name,
        s.seqlen_q,
        s.seqlen_k,
        s.heads_q,
        if w.backward { ", forward and backward" } else { "" },
        gpu * 1e3,
        cpu * 1e3
    );
    Ok(if gpu <= cpu {
        Decision::Gpu(Box::new(engine), format!("{what}: using wgpu"))
    } else {
        Decision::Cpu(format!("{what}: using the CPU backend"))
    })
}

/// Seeded inputs of the slice `auto` times.
struct Slice {
    shape: AttentionShape,
    opts: AttentionOptions,
    backward: bool,
    data: [TensorData; 4],
}

impl Slice {
    fn new(w: &Workload) -> Self {
        let s = &w.shape;
        let heads_kv = (PROBE_HEADS / s.group()).clamp(1, s.heads_kv);
        let shape = AttentionShape {
            batch: 1,
            seqlen_q: s.seqlen_q.min(PROBE_SEQLEN),
            seqlen_k: s.seqlen_k.min(PROBE_SEQLEN),
            heads_q: heads_kv * s.group(),
            heads_kv,
            head_dim: s.head_dim,
        };
        let mut rng = Rng::new(17);
        let mut make = |n| TensorData::from_f32(rng.normal_vec(n, 1.0), w.precision);
        let data = [shape.q_len(), shape.kv_len(), shape.kv_len(), shape.q_len()].map(&mut make);
        Self {
            shape,
            opts: w.opts,
            backward: w.backward,
            data,
        }
    }

    fn views(&self) -> [TensorView<'_>; 4] {
        let s = &self.shape;
        let shapes = [s.q_shape(), s.kv_shape(), s.kv_shape(), s.q_shape()];
        [0, 1, 2, 3].map(|i| TensorView {
            shape: shapes[i],
            data: self.data[i].as_host(),
        })
    }

    /// Seconds of one run on the engine, uploads and readbacks included.
    async fn run_gpu(&self, e: &Engine, [q, k, v, d_o]: &[TensorView<'_>; 4]) -> Result<f64> {
        let start = Instant::now();
        let none = Default::default();
        let fwd = e.forward_async(q, k, v, &self.opts, &none).await?;
        if self.backward {
            let inputs = BackwardInputs::new([*q, *k, *v], &fwd, *d_o)?;
            e.backward_async(&inputs, &self.opts, &none).await?;
        }
        Ok(start.elapsed().as_secs_f64())
    }

    /// Seconds of one run on the CPU backend.
    fn run_cpu(&self, [q, k, v, d_o]: &[TensorView<'_>; 4]) -> Result<f64> {
        let start = Instant::now();
        let fwd = cpu::forward(q, k, v, &self.opts)?;
        if self.backward {
            let inputs = BackwardInputs::new([*q, *k, *v], &fwd, *d_o)?;
            cpu::backward(&inputs, &self.opts)?;
        }
        Ok(start.elapsed().as_secs_f64())
    }
}

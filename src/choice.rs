//! `--backend auto`, decided by what is faster for the problem (SPEC.md): a
//! hardware GPU when there is one; where the only adapters run on the CPU
//! (llvmpipe over Vulkan or GL, SwiftShader, WARP), each is timed against
//! the CPU backend on a slice of the problem, with the kernels it would run
//! (lanes where it has fixed-size subgroups, else tiled), and the fastest
//! wins. The reason given carries the times.

use crate::api::inputs::BackwardInputs;
use crate::api::options::AttentionOptions;
use crate::api::shape::AttentionShape;
use crate::api::tensor::{Precision, TensorData, TensorView};
use crate::cpu;
use crate::engine::Engine;
use crate::error::Result;
use crate::plan::{plan_forward, PlanRequest};
use crate::random::Rng;
use crate::runtime::adapter::{adapters, is_software};
use web_time::Instant;

/// What a backend is chosen for: `auto` measures on (a slice of) it.
#[derive(Clone, Debug)]
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
            "no GPU adapter found: the CPU backend".into(),
        ));
    };
    if !is_software(&best.get_info()) {
        let engine = Engine::from_adapter(best).await?;
        let why = format!("a hardware GPU: {}", engine.describe());
        return Ok(Decision::Gpu(Box::new(engine), why));
    }
    let slice = Slice::new(workload);
    let views = slice.views();
    let cpu = slice.run_cpu(&views)?;
    let mut timed = Vec::new();
    let mut fastest: Option<(Engine, f64)> = None;
    for adapter in &found {
        let engine = Engine::from_adapter(adapter).await?;
        // The first run compiles the kernels; it is not timed.
        slice.run_gpu(&engine, &views).await?;
        let t = slice.run_gpu(&engine, &views).await?;
        timed.push(format!("{} {:.1} ms", label(&engine, workload), t * 1e3));
        if fastest.as_ref().is_none_or(|(_, best)| t < *best) {
            fastest = Some((engine, t));
        }
    }
    let s = &slice.shape;
    let what = format!(
        "the only adapters run on the CPU; on a slice of this problem ({} × {} tokens, {} heads{}) {} and the CPU backend {:.1} ms",
        s.seqlen_q,
        s.seqlen_k,
        s.heads_q,
        if workload.backward { ", forward and backward" } else { "" },
        timed.join(", "),
        cpu * 1e3
    );
    Ok(match fastest {
        Some((engine, t)) if t <= cpu => {
            let why = format!("{what}: using {}", engine.adapter_info().name);
            Decision::Gpu(Box::new(engine), why)
        }
        _ => Decision::Cpu(format!("{what}: using the CPU backend")),
    })
}

/// An adapter and the kernels it runs for the workload, for the reason.
fn label(engine: &Engine, w: &Workload) -> String {
    let info = engine.adapter_info();
    let req = PlanRequest::for_shape(&w.shape, w.precision, Default::default());
    let kernels = plan_forward(&req, &engine.caps()).map_or("no", |p| p.plan.kernel.name());
    format!("{} ({:?}, {kernels} kernels) took", info.name, info.backend)
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
            head_dim_v: s.head_dim_v,
        };
        let mut rng = Rng::new(17);
        let mut make = |n| TensorData::from_f32(rng.normal_vec(n, 1.0), w.precision);
        let data = [shape.q_len(), shape.kv_len(), shape.v_len(), shape.o_len()].map(&mut make);
        // The band and score options only: per-head, per-block and
        // per-sequence inputs belong to the whole problem, not the slice.
        let opts = AttentionOptions {
            causal: w.opts.causal,
            window: w.opts.window,
            softcap: w.opts.softcap,
            scale: w.opts.scale,
            ..Default::default()
        };
        Self {
            shape,
            opts,
            backward: w.backward,
            data,
        }
    }

    fn views(&self) -> [TensorView<'_>; 4] {
        let s = &self.shape;
        let shapes = [s.q_shape(), s.kv_shape(), s.v_shape(), s.o_shape()];
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

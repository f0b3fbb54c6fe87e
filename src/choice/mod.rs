//! `--backend auto`, decided by what is faster for the problem (docs/semantics.md): a
//! hardware GPU when there is one; where the only adapters run on the CPU
//! (llvmpipe over Vulkan or GL, SwiftShader, WARP), every path is timed on
//! a slice of the problem — each adapter's lanes kernels (where it has
//! them) and its tiled kernels, and the CPU backend — and the fastest wins.
//! Absolute speed on a CPU adapter depends on the host's instruction set by
//! an order of magnitude, so nothing here is decided by name. The decision
//! is cached on disk per machine and problem class ([`ProbeCache`]), so the
//! probe runs on the first call only. The reason given carries the times
//! and the margin; the library never prints it.

pub mod cache;

pub use cache::ProbeCache;

use crate::api::inputs::{BackwardInputs, ForwardInputs};
use crate::api::options::AttentionOptions;
use crate::api::problem::Problem;
use crate::api::shape::AttentionShape;
use crate::api::tensor::{Precision, TensorData, TensorView};
use crate::cpu::Cpu;
use crate::disk_cache::Entry;
use crate::engine::Engine;
use crate::error::Result;
use crate::plan::{plan_forward, KernelFamily, PlanOverrides, PlanRequest};
use crate::random::Rng;
use crate::runtime::adapter::{adapters, is_software};
use web_time::Instant;

/// What a backend is chosen for: `auto` measures on (a slice of) it.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct Workload {
    /// The problem's shape.
    pub shape: AttentionShape,
    /// The inputs' storage precision.
    pub precision: Precision,
    /// Masks, scores and layouts.
    pub opts: AttentionOptions,
    /// The backward runs too (after a forward).
    pub backward: bool,
    /// What runs: attention, its FP8 form, or decoding steps on a cache.
    pub operation: Operation,
}

impl Workload {
    /// A forward of `shape` in `precision` under `opts` (no backward).
    pub fn new(shape: AttentionShape, precision: Precision, opts: AttentionOptions) -> Self {
        Self {
            shape,
            precision,
            opts,
            backward: false,
            operation: Operation::Attention,
        }
    }

    /// Whether the backward runs too (after a forward).
    pub fn backward(mut self, backward: bool) -> Self {
        self.backward = backward;
        self
    }

    /// What runs: attention, its FP8 form, or decoding steps.
    pub fn operation(mut self, operation: Operation) -> Self {
        self.operation = operation;
        self
    }

    /// The attention call it describes, validated.
    pub fn problem(&self) -> Result<Problem<'_>> {
        Problem::new(self.shape, self.precision, &self.opts)
    }
}

/// The kind of call a [`Workload`] is (backends do not all take each).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum Operation {
    /// Attention (the forward, and the backward if asked).
    #[default]
    Attention,
    /// The FP8 (e4m3) forward.
    Fp8,
    /// Decoding steps on a KV cache.
    Decode,
    /// Decoding steps on a quantized (int8, FP8) KV cache.
    QuantizedDecode,
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

/// One path `auto` timed, and its time on the slice.
#[derive(Clone, Debug, PartialEq)]
pub struct Timed {
    pub name: String,
    pub seconds: f64,
}

/// The fastest of `timed` (the first on a tie) and the reason: every time,
/// the winner, and how much faster it was than the runner-up.
pub fn fastest(timed: &[Timed]) -> Option<(usize, String)> {
    let best = (0..timed.len()).min_by(|&a, &b| timed[a].seconds.total_cmp(&timed[b].seconds))?;
    let times: Vec<String> = timed
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let took = if i == 0 { " took" } else { "" };
            format!("{}{took} {:.1} ms", t.name, t.seconds * 1e3)
        })
        .collect();
    let next = (0..timed.len())
        .filter(|&i| i != best)
        .min_by(|&a, &b| timed[a].seconds.total_cmp(&timed[b].seconds));
    let margin = next.map_or(String::new(), |n| {
        let ratio = timed[n].seconds / timed[best].seconds.max(f64::MIN_POSITIVE);
        format!(", {ratio:.2}x faster than {}", timed[n].name)
    });
    let why = format!("{}: using {}{margin}", times.join(", "), timed[best].name);
    Some((best, why))
}

/// A path the slice can run on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Path {
    Gpu {
        adapter: usize,
        kernels: KernelFamily,
    },
    Cpu,
}

/// Decide for `workload` on this machine, with the default cache.
pub async fn choose(workload: &Workload) -> Result<Decision> {
    choose_with(workload, ProbeCache::default_location().as_ref()).await
}

/// Decide for `workload`, reading and writing `cache` when given.
pub async fn choose_with(workload: &Workload, cache: Option<&ProbeCache>) -> Result<Decision> {
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
    let key = probe_key(&found, workload);
    if let Some((cache, hit)) = cache.and_then(|c| Some((c, c.get(&key)?))) {
        let note = format!(
            "measured earlier on this machine, cached in {}",
            cache.path().display()
        );
        if let Some(d) = from_cache(&found, &hit, &note).await? {
            return Ok(d);
        }
    }
    let (decision, winner, reason) = measure(&found, workload).await?;
    let stored = cache.map(|c| {
        c.put(
            &key,
            &Entry {
                value: winner,
                note: reason,
            },
        )
    });
    Ok(match (decision, stored) {
        (d, Some(Err(e))) => d.note(&format!("not cached: {e}")),
        (d, _) => d,
    })
}

impl Decision {
    fn note(self, note: &str) -> Decision {
        match self {
            Decision::Gpu(e, why) => Decision::Gpu(e, format!("{why} ({note})")),
            Decision::Cpu(why) => Decision::Cpu(format!("{why} ({note})")),
        }
    }
}

/// The key of this machine and problem class.
fn probe_key(found: &[wgpu::Adapter], w: &Workload) -> String {
    let adapters: Vec<String> = found
        .iter()
        .map(|a| {
            let i = a.get_info();
            format!("{} {:?} {} {}", i.name, i.backend, i.driver, i.driver_info)
        })
        .collect();
    let (s, o) = (Slice::shape(w), &w.opts);
    format!(
        "{}; {}; d {} dv {} {} group {} slice {}x{} causal {} window {:?},{:?} softcap {} {}",
        adapters.join(", "),
        cache::cpu_model(),
        s.head_dim,
        s.head_dim_v,
        w.precision,
        s.group(),
        s.seqlen_q,
        s.seqlen_k,
        o.causal,
        o.window.left,
        o.window.right,
        o.softcap_value() > 0.0,
        if w.backward { "backward" } else { "forward" }
    )
}

/// The id a path is cached under.
fn path_id(found: &[wgpu::Adapter], p: Path) -> String {
    match p {
        Path::Cpu => "cpu".into(),
        Path::Gpu { adapter, kernels } => {
            let i = found[adapter].get_info();
            format!("{}|{:?}|{}", i.name, i.backend, kernels.name())
        }
    }
}

/// The cached winner, when it is still one of the paths found.
async fn from_cache(found: &[wgpu::Adapter], hit: &Entry, note: &str) -> Result<Option<Decision>> {
    let why = format!("{} ({note})", hit.note);
    if hit.value == "cpu" {
        return Ok(Some(Decision::Cpu(why)));
    }
    for adapter in 0..found.len() {
        for kernels in [KernelFamily::Lanes, KernelFamily::Coop, KernelFamily::Tiled] {
            if path_id(found, Path::Gpu { adapter, kernels }) == hit.value {
                let engine = gpu_engine(&found[adapter], kernels).await?;
                return Ok(Some(Decision::Gpu(Box::new(engine), why)));
            }
        }
    }
    Ok(None)
}

/// An engine on `adapter` that runs `kernels`.
async fn gpu_engine(adapter: &wgpu::Adapter, kernels: KernelFamily) -> Result<Engine> {
    let engine = Engine::from_adapter(adapter).await?;
    Ok(match kernels {
        KernelFamily::Tiled => engine.with_tiled_kernels_only(),
        KernelFamily::Lanes | KernelFamily::Coop | KernelFamily::Registers => engine,
    })
}

/// The kernel families an engine runs for the workload: lanes or coop where
/// its planner picks them, and always the tiled ones.
fn families(engine: &Engine, w: &Workload) -> Vec<KernelFamily> {
    let req = PlanRequest::for_shape(&w.shape, w.precision, Default::default());
    match plan_forward(&req, &engine.caps()).map(|p| p.plan.kernel) {
        Ok(k @ (KernelFamily::Lanes | KernelFamily::Coop)) => vec![k, KernelFamily::Tiled],
        _ => vec![KernelFamily::Tiled],
    }
}

/// Time every path on the slice: the decision, the winner's id, the reason.
async fn measure(found: &[wgpu::Adapter], w: &Workload) -> Result<(Decision, String, String)> {
    let slice = Slice::new(w);
    let [q, k, v, d_o] = slice.views();
    let inputs = ForwardInputs::new(q, k, v);
    let (mut paths, mut timed) = (Vec::new(), Vec::new());
    for (adapter, a) in found.iter().enumerate() {
        let engine = Engine::from_adapter(a).await?;
        let info = engine.adapter_info().clone();
        for kernels in families(&engine, w) {
            let o = PlanOverrides {
                kernel: Some(kernels),
                ..Default::default()
            };
            // The first run compiles the kernels; it is not timed.
            slice.run_gpu(&engine, &inputs, &d_o, &o).await?;
            let t = slice.run_gpu(&engine, &inputs, &d_o, &o).await?;
            let t = t.min(slice.run_gpu(&engine, &inputs, &d_o, &o).await?);
            let name = format!(
                "{} ({:?}, {} kernels)",
                info.name,
                info.backend,
                kernels.name()
            );
            timed.push(Timed { name, seconds: t });
            paths.push(Path::Gpu { adapter, kernels });
        }
    }
    let cpu = Cpu::new();
    let t = slice
        .run_cpu(&cpu, &inputs, &d_o)?
        .min(slice.run_cpu(&cpu, &inputs, &d_o)?);
    let name = format!("the CPU backend ({})", cpu.isa().name());
    timed.push(Timed { name, seconds: t });
    paths.push(Path::Cpu);
    let (best, why) = fastest(&timed).unwrap_or((paths.len() - 1, String::new()));
    let s = &slice.shape;
    let what = format!(
        "the only adapters run on the CPU; on a slice of this problem ({} × {} tokens, {} heads{}{}) {why}",
        s.seqlen_q,
        s.seqlen_k,
        s.heads_q,
        if w.backward { ", forward and backward" } else { "" },
        match w.operation {
            Operation::Decode | Operation::QuantizedDecode => {
                ", the attention kernels timed for the decoding step"
            }
            _ => "",
        },
    );
    let winner = path_id(found, paths[best]);
    let decision = match paths[best] {
        Path::Gpu { adapter, kernels } => Decision::Gpu(
            Box::new(gpu_engine(&found[adapter], kernels).await?),
            what.clone(),
        ),
        Path::Cpu => Decision::Cpu(what.clone()),
    };
    Ok((decision, winner, what))
}

/// Seeded inputs of the slice `auto` times.
struct Slice {
    shape: AttentionShape,
    opts: AttentionOptions,
    backward: bool,
    data: [TensorData; 4],
}

impl Slice {
    /// The slice's sizes: at most 512 × 512 tokens and about 4 heads.
    fn shape(w: &Workload) -> AttentionShape {
        let s = &w.shape;
        let heads_kv = (PROBE_HEADS / s.group()).clamp(1, s.heads_kv);
        AttentionShape {
            batch: 1,
            seqlen_q: s.seqlen_q.min(PROBE_SEQLEN),
            seqlen_k: s.seqlen_k.min(PROBE_SEQLEN),
            heads_q: heads_kv * s.group(),
            heads_kv,
            head_dim: s.head_dim,
            head_dim_v: s.head_dim_v,
        }
    }

    fn new(w: &Workload) -> Self {
        let shape = Slice::shape(w);
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

    /// Seconds of one run on the engine, uploads and readbacks included
    /// (`d_o` only where the workload runs the backward).
    async fn run_gpu(
        &self,
        e: &Engine,
        i: &ForwardInputs<'_>,
        d_o: &TensorView<'_>,
        o: &PlanOverrides,
    ) -> Result<f64> {
        let start = Instant::now();
        let fwd = e.forward_async(i, &self.opts, o).await?;
        if self.backward {
            let inputs = BackwardInputs::new(*i, &fwd, *d_o)?;
            e.backward_async(&inputs, &self.opts, o).await?;
        }
        Ok(start.elapsed().as_secs_f64())
    }

    /// Seconds of one run on the CPU backend.
    fn run_cpu(&self, cpu: &Cpu, i: &ForwardInputs<'_>, d_o: &TensorView<'_>) -> Result<f64> {
        let start = Instant::now();
        let fwd = cpu.forward(i, &self.opts)?;
        if self.backward {
            let inputs = BackwardInputs::new(*i, &fwd, *d_o)?;
            cpu.backward(&inputs, &self.opts)?;
        }
        Ok(start.elapsed().as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn timed(name: &str, ms: f64) -> Timed {
        Timed {
            name: name.into(),
            seconds: ms / 1e3,
        }
    }

    #[test]
    fn the_fastest_path_wins_and_the_reason_gives_every_time_and_the_margin() {
        let lanes = timed("llvmpipe (Vulkan, lanes kernels)", 21.4);
        let tiled = timed("llvmpipe (Vulkan, tiled kernels)", 80.0);
        let cpu = timed("the CPU backend (avx512)", 10.7);
        // An AVX-512 host: the CPU backend beats both kernel families.
        let (i, why) = fastest(&[lanes.clone(), tiled.clone(), cpu.clone()]).unwrap();
        assert_eq!(i, 2);
        assert_eq!(
            why,
            "llvmpipe (Vulkan, lanes kernels) took 21.4 ms, llvmpipe (Vulkan, tiled kernels) 80.0 ms, \
             the CPU backend (avx512) 10.7 ms: using the CPU backend (avx512), \
             2.00x faster than llvmpipe (Vulkan, lanes kernels)"
        );
        // A host where the adapter's lanes kernels are fastest.
        let slow_cpu = timed("the CPU backend (portable)", 50.0);
        let (i, why) = fastest(&[lanes.clone(), tiled.clone(), slow_cpu]).unwrap();
        assert_eq!(i, 0);
        assert!(
            why.ends_with("2.34x faster than the CPU backend (portable)"),
            "{why}"
        );
        // GL only: no lanes kernels, the tiled ones against the CPU backend.
        let (i, why) = fastest(&[timed("llvmpipe (Gl, tiled kernels)", 353.5), cpu]).unwrap();
        assert_eq!(i, 1);
        assert!(
            why.contains("using the CPU backend (avx512), 33.04x faster"),
            "{why}"
        );
        assert_eq!(fastest(&[]), None);
        assert_eq!(fastest(&[tiled]).unwrap().0, 0);
    }
}

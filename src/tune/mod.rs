//! Autotuning: every candidate plan ([`crate::plan::candidates()`]) of one
//! pass is timed on the real adapter — one untimed run (it compiles the
//! kernels), then the best of a few, read from GPU timestamps where the
//! adapter has them and the wall clock otherwise — and the fastest is kept
//! on disk ([`TuneCache`]) for this adapter, driver, build and problem
//! class. Engines made `with_tuned_plans` run a cached winner where one
//! exists and the formula plan otherwise.

pub mod cache;

pub use cache::{MaskKind, TuneCache, TuneKey, Tuned};

use crate::api::inputs::{BackwardInputs, ForwardInputs};
use crate::api::options::AttentionOptions;
use crate::api::output::{CallStats, ForwardOutput, Timing};
use crate::api::problem::Problem;
use crate::api::shape::AttentionShape;
use crate::api::tensor::{Precision, TensorData, TensorView};
use crate::error::{Error, Result};
use crate::ops;
use crate::ops::prepare::plan_request;
use crate::plan::{candidates, Candidate, Pass, Plan, PlanOverrides};
use crate::random::Rng;
use crate::runtime::Gpu;
use std::path::PathBuf;

/// What to tune: one pass over one problem shape.
#[derive(Clone, Debug)]
#[non_exhaustive]
pub struct TuneRequest {
    /// Which pass.
    pub pass: Pass,
    /// The problem's shape.
    pub shape: AttentionShape,
    /// The inputs' storage precision.
    pub precision: Precision,
    /// Whether the mask is causal.
    pub causal: bool,
    /// Timed runs per candidate after its untimed first run; the best counts.
    pub repeats: usize,
    /// Where the winner is stored (`None`: nowhere).
    pub cache: Option<TuneCache>,
}

impl TuneRequest {
    /// `pass` over `shape`, without a mask, 3 timed runs per candidate, the
    /// winner stored in [`TuneCache::default_location`].
    pub fn new(pass: Pass, shape: AttentionShape, precision: Precision) -> Self {
        Self {
            pass,
            shape,
            precision,
            causal: false,
            repeats: 3,
            cache: TuneCache::default_location(),
        }
    }

    /// Tune the causal problem.
    pub fn causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// Timed runs per candidate.
    pub fn repeats(mut self, repeats: usize) -> Self {
        self.repeats = repeats;
        self
    }

    /// Where the winner is stored (`None`: nowhere).
    pub fn cache(mut self, cache: Option<TuneCache>) -> Self {
        self.cache = cache;
        self
    }

    fn options(&self) -> AttentionOptions {
        AttentionOptions::default().causal(self.causal)
    }

    fn mask(&self) -> MaskKind {
        if self.causal {
            MaskKind::Causal
        } else {
            MaskKind::None
        }
    }
}

/// One candidate as timed.
#[derive(Clone, Debug, PartialEq)]
pub struct TunedCandidate {
    /// The candidate's name.
    pub label: String,
    /// The overrides that give it.
    pub overrides: PlanOverrides,
    /// The plan it ran.
    pub plan: Plan,
    /// The best of the timed runs, seconds of kernel time (infinite where
    /// it failed).
    pub seconds: f64,
    /// Why the candidate failed to run, if it did.
    pub error: Option<String>,
}

/// Every candidate's time, the winner, the clock, and where it was stored.
#[derive(Clone, Debug)]
pub struct TuneReport {
    /// The cache entry's key.
    pub key: TuneKey,
    /// The clock the times come from.
    pub timing: Timing,
    /// Every candidate, timed.
    pub candidates: Vec<TunedCandidate>,
    /// Index of the fastest candidate (the first on a tie).
    pub winner: usize,
    /// The cache file the winner was written to.
    pub stored: Option<PathBuf>,
}

impl TuneReport {
    /// The fastest candidate.
    pub fn winner(&self) -> &TunedCandidate {
        &self.candidates[self.winner]
    }
}

/// Time every candidate of `req` on `gpu`, keep the fastest in the
/// request's cache, and report them all.
pub async fn tune(gpu: &Gpu, req: &TuneRequest) -> Result<TuneReport> {
    if req.repeats == 0 {
        return Err(Error::EmptyDim { dim: "repeats" });
    }
    let (shape, opts) = (req.shape, req.options());
    // A request's shape is built field by field: checked before its inputs are made.
    shape.check()?;
    let problem = Problem::new(shape, req.precision, &opts)?;
    let plan_req = plan_request(&problem, PlanOverrides::default());
    let list = candidates(&plan_req, req.pass, &gpu.caps())?;
    let inputs = Inputs::new(&shape, req.precision);
    let [q, k, v, d_o] = inputs.views(&shape);
    let qkv = ForwardInputs::new(q, k, v);
    let (timed, timing) = match req.pass {
        Pass::Forward => time_forward(gpu, &qkv, &problem, &list, req.repeats).await?,
        Pass::Backward => time_backward(gpu, &qkv, &d_o, &problem, &list, req.repeats).await?,
    };
    let winner = (0..timed.len())
        .min_by(|&a, &b| timed[a].seconds.total_cmp(&timed[b].seconds))
        .unwrap_or(0);
    let key = TuneKey::new(&gpu.info, req.pass, &shape, req.precision, req.mask());
    let mut report = TuneReport {
        key,
        timing,
        candidates: timed,
        winner,
        stored: None,
    };
    if let Some(cache) = &req.cache {
        cache.put(&report.key, &note(&report))?;
        report.stored = Some(cache.path().to_path_buf());
    }
    Ok(report)
}

/// The winner as the cache keeps it.
fn note(report: &TuneReport) -> Tuned {
    let w = report.winner();
    let p = &w.plan;
    Tuned {
        overrides: w.overrides,
        note: format!(
            "{}: {} Br {} × Bc {}, {} invocations/row, {:.3} ms ({:?}) of {} candidates",
            w.label,
            p.kernel.name(),
            p.br,
            p.bc,
            p.threads_per_row,
            w.seconds * 1e3,
            report.timing,
            report.candidates.len()
        ),
    }
}

/// Each forward candidate, timed by [`best_of`].
async fn time_forward(
    gpu: &Gpu,
    qkv: &ForwardInputs<'_>,
    problem: &Problem<'_>,
    list: &[Candidate],
    repeats: usize,
) -> Result<(Vec<TunedCandidate>, Timing)> {
    let (mut out, mut timing) = (Vec::new(), Timing::default());
    for (i, c) in list.iter().enumerate() {
        let o = &c.overrides;
        let run = move || async move {
            Ok(ops::forward::forward(gpu, qkv, problem, o)
                .await?
                .stats)
        };
        out.push(record(i, c, best_of(repeats, run).await, &mut timing)?);
    }
    Ok((out, timing))
}

/// Each backward candidate on the formula forward's output, timed by
/// [`best_of`].
async fn time_backward(
    gpu: &Gpu,
    qkv: &ForwardInputs<'_>,
    d_o: &TensorView<'_>,
    problem: &Problem<'_>,
    list: &[Candidate],
    repeats: usize,
) -> Result<(Vec<TunedCandidate>, Timing)> {
    let fwd: ForwardOutput =
        ops::forward::forward(gpu, qkv, problem, &PlanOverrides::default()).await?;
    let inputs = BackwardInputs::new(*qkv, &fwd, *d_o)?;
    let (mut out, mut timing) = (Vec::new(), Timing::default());
    for (i, c) in list.iter().enumerate() {
        let (o, inputs) = (&c.overrides, &inputs);
        let run = move || async move {
            Ok(ops::backward::backward(gpu, inputs, problem, o)
                .await?
                .stats)
        };
        out.push(record(i, c, best_of(repeats, run).await, &mut timing)?);
    }
    Ok((out, timing))
}

/// One untimed run (it compiles the kernels), then the fastest of `repeats`.
async fn best_of<F, Fut>(repeats: usize, run: F) -> Result<CallStats>
where
    F: Fn() -> Fut,
    Fut: std::future::Future<Output = Result<CallStats>>,
{
    run().await?;
    let mut best = run().await?;
    for _ in 1..repeats {
        let stats = run().await?;
        if stats.kernel_seconds < best.kernel_seconds {
            best = stats;
        }
    }
    Ok(best)
}

/// A candidate as timed. A candidate that fails to run is reported and
/// never wins; the formula plan failing fails the tuning (it is the plan
/// every untuned call runs).
fn record(
    i: usize,
    c: &Candidate,
    best: Result<CallStats>,
    timing: &mut Timing,
) -> Result<TunedCandidate> {
    let (seconds, error) = match best {
        Ok(stats) => {
            *timing = stats.timing;
            (stats.kernel_seconds, None)
        }
        Err(e) if i == 0 => return Err(e),
        Err(e) => (f64::INFINITY, Some(e.to_string())),
    };
    Ok(TunedCandidate {
        label: c.label.clone(),
        overrides: c.overrides,
        plan: c.plan,
        seconds,
        error,
    })
}

/// Seeded q, k, v and dO for a tuning run.
struct Inputs {
    data: [TensorData; 4],
}

impl Inputs {
    fn new(s: &AttentionShape, precision: Precision) -> Self {
        let mut rng = Rng::new(13);
        let mut make = |n| TensorData::from_f32(rng.normal_vec(n, 1.0), precision);
        Self {
            data: [s.q_len(), s.kv_len(), s.v_len(), s.o_len()].map(&mut make),
        }
    }

    fn views(&self, s: &AttentionShape) -> [TensorView<'_>; 4] {
        let shapes = [s.q_shape(), s.kv_shape(), s.v_shape(), s.o_shape()];
        [0, 1, 2, 3].map(|i| self.data[i].view(shapes[i]))
    }
}

/// The cached winner for `pass` over `shape` under `opts` on `gpu`, where
/// the options are ones the tuner covers and the winner still plans on this
/// device (its limits or settings may have changed since).
pub fn tuned_overrides(
    gpu: &Gpu,
    cache: &TuneCache,
    pass: Pass,
    shape: &AttentionShape,
    precision: Precision,
    opts: &AttentionOptions,
) -> Option<PlanOverrides> {
    let key = TuneKey::new(&gpu.info, pass, shape, precision, MaskKind::of(opts)?);
    let tuned = cache.get(&key)?;
    let problem = Problem::new(*shape, precision, opts).ok()?;
    let req = plan_request(&problem, tuned.overrides);
    pass.plan(&req, &gpu.caps()).ok()?;
    Some(tuned.overrides)
}

#[cfg(test)]
mod tests;

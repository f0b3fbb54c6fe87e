//! Shared test harness: one engine per test process, deterministic cases,
//! docs/semantics.md's accuracy rule.
#![allow(dead_code)]

pub mod arena;
pub mod decode;
pub mod fp8;
pub mod kv_quant;
pub mod shards;

use flashattn::accuracy::{check_forward, Check};
use flashattn::random::Rng;
use flashattn::{
    AttentionOptions, Engine, ForwardInputs, ForwardOutput, KernelFamily, PlanOverrides, Precision,
    TensorData, TensorView,
};

/// The engine for this process, or `None` when no adapter exists and the
/// run does not require one (see flashattn-testkit: FLASHATTN_REQUIRE_GPU=1,
/// set by CI and scripts/test.sh, makes a missing adapter fail the test).
#[allow(unused_imports)] // not every test binary has GPU tests
pub use flashattn_testkit::engine;

/// An engine on the tiled decode kernel (the GPUs' one) on this adapter,
/// even where it has the lanes kernel; `None` as [`engine`].
#[allow(dead_code)] // the decode suites' only
pub fn tiled_engine() -> Option<&'static Engine> {
    engine()?;
    static TILED: std::sync::OnceLock<Engine> = std::sync::OnceLock::new();
    Some(TILED.get_or_init(|| Engine::new().unwrap().with_tiled_kernels_only()))
}

/// A GPU suite's cases: `all` with FLASHATTN_FULL_MATRIX=1, else `each`,
/// which reaches each distinct kernel code path at least once (pipelines
/// are what a driver without a shader cache spends its time compiling, so
/// the default spreads precisions and options over the shapes instead of
/// multiplying them).
pub fn matrix<T>(each: T, all: T) -> T {
    if flashattn_testkit::full_matrix() {
        all
    } else {
        each
    }
}

/// Owned inputs of one case: the values (already rounded to the case's
/// precision) as f32, and stored in that precision.
pub struct Inputs {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
    /// q, k, v in the case's precision.
    pub stored: [TensorData; 3],
    pub q_shape: [usize; 4],
    pub kv_shape: [usize; 4],
    pub v_shape: [usize; 4],
    /// o's (and do's) shape.
    pub o_shape: [usize; 4],
    pub precision: Precision,
}

impl Inputs {
    /// An output gradient (stored by [`output_grad`]) as a view of o's shape.
    pub fn grad<'a>(&self, g: &'a TensorData) -> TensorView<'a> {
        g.view(self.o_shape)
    }

    pub fn views(&self) -> [TensorView<'_>; 3] {
        let [q, k, v] = &self.stored;
        [
            q.view(self.q_shape),
            k.view(self.kv_shape),
            v.view(self.v_shape),
        ]
    }
}

/// One forward test case.
#[derive(Clone, Debug)]
pub struct Case {
    pub batch: usize,
    pub seqlen_q: usize,
    pub seqlen_k: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    /// v's head dim (o's, dv's).
    pub head_dim_v: usize,
    pub precision: Precision,
    pub opts: AttentionOptions,
    /// Standard deviation of q and k entries (large values stress the softmax).
    pub std: f32,
    pub overrides: PlanOverrides,
    pub seed: u64,
}

impl Case {
    pub fn new(seqlen_q: usize, seqlen_k: usize, head_dim: usize) -> Self {
        Self {
            batch: 1,
            seqlen_q,
            seqlen_k,
            heads_q: 2,
            heads_kv: 2,
            head_dim,
            head_dim_v: head_dim,
            precision: Precision::F32,
            opts: AttentionOptions::default(),
            std: 1.0,
            overrides: PlanOverrides::default(),
            seed: 7,
        }
    }

    pub fn heads(mut self, q: usize, kv: usize) -> Self {
        self.heads_q = q;
        self.heads_kv = kv;
        self
    }

    /// v with a head dim of its own.
    pub fn dv(mut self, dv: usize) -> Self {
        self.head_dim_v = dv;
        self
    }

    pub fn batch(mut self, b: usize) -> Self {
        self.batch = b;
        self
    }

    pub fn f16(self) -> Self {
        self.precision(Precision::F16)
    }

    pub fn bf16(self) -> Self {
        self.precision(Precision::Bf16)
    }

    pub fn precision(mut self, p: Precision) -> Self {
        self.precision = p;
        self
    }

    /// These options (a packed batch set by [`Case::varlen`] stays).
    pub fn opts(mut self, opts: AttentionOptions) -> Self {
        let varlen = self.opts.varlen.take();
        self.opts = opts;
        self.opts.varlen = self.opts.varlen.take().or(varlen);
        self
    }

    /// A packed batch of sequences of these lengths (q and k/v): the
    /// tensors become `(total, heads, d)`, seen as a batch of one.
    pub fn varlen(mut self, lens_q: &[usize], lens_k: &[usize]) -> Self {
        let cu = |lens: &[usize]| -> Vec<i32> {
            std::iter::once(0)
                .chain(lens.iter().scan(0, |acc, &n| {
                    *acc += n as i32;
                    Some(*acc)
                }))
                .collect()
        };
        let (cq, ck) = (cu(lens_q), cu(lens_k));
        self.opts.varlen = Some(flashattn::Varlen::new(&cq, &ck).unwrap());
        self.batch = 1;
        self.seqlen_q = lens_q.iter().sum();
        self.seqlen_k = lens_k.iter().sum();
        self
    }

    pub fn std(mut self, std: f32) -> Self {
        self.std = std;
        self
    }

    pub fn overrides(mut self, o: PlanOverrides) -> Self {
        self.overrides = o;
        self
    }

    pub fn inputs(&self) -> Inputs {
        let mut rng =
            Rng::new(self.seed ^ (self.seqlen_q as u64) << 20 ^ (self.head_dim as u64) << 40);
        let q_shape = [self.batch, self.seqlen_q, self.heads_q, self.head_dim];
        let kv_shape = [self.batch, self.seqlen_k, self.heads_kv, self.head_dim];
        let v_shape = [self.batch, self.seqlen_k, self.heads_kv, self.head_dim_v];
        let nq: usize = q_shape.iter().product();
        let nk: usize = kv_shape.iter().product();
        let nv: usize = v_shape.iter().product();
        let round =
            |v: Vec<f32>| -> Vec<f32> { v.into_iter().map(|x| self.precision.round(x)).collect() };
        let q = round(rng.normal_vec(nq, self.std));
        let k = round(rng.normal_vec(nk, self.std));
        let v = round(rng.normal_vec(nv, 1.0));
        let store = |v: &[f32]| TensorData::from_f32(v.to_vec(), self.precision);
        Inputs {
            stored: [store(&q), store(&k), store(&v)],
            q,
            k,
            v,
            q_shape,
            kv_shape,
            v_shape,
            o_shape: [self.batch, self.seqlen_q, self.heads_q, self.head_dim_v],
            precision: self.precision,
        }
    }
}

/// A seeded random block mask of `case`'s (longest) sequences with blocks
/// of `block`, `heads` grids (1 broadcasts) and `density` of them allowed.
pub fn block_mask(
    case: &Case,
    block: (usize, usize),
    density: f64,
    heads: usize,
    seed: u64,
) -> flashattn::BlockMask {
    let (sq, sk) = case
        .opts
        .varlen
        .as_ref()
        .map_or((case.seqlen_q, case.seqlen_k), |v| v.max_seqlens());
    let grid = flashattn::BlockGrid::new(sq, sk, block).unwrap();
    flashattn::BlockMask::random(grid, heads, density, seed)
}

/// A causal mask.
pub fn causal() -> AttentionOptions {
    AttentionOptions::default().causal(true)
}

/// A local window in flash-attention's convention (negative: unbounded).
pub fn window(l: i64, r: i64) -> AttentionOptions {
    {
        let mut o = AttentionOptions::default();
        o.window = flashattn::Window::from_signed(l, r);
        o
    }
}

/// Every layout and score term at once: a packed batch with an empty
/// sequence, ALiBi per sequence, sinks, a per-head block mask of 7×13
/// blocks, a causal window, softcap, GQA and v's own head dim.
pub fn everything_at_once() -> Case {
    use flashattn::{Alibi, Sinks};
    let (lq, lk) = ([21, 0, 45, 30], [30, 12, 17, 30]);
    let slopes: Vec<f32> = (0..16).map(|i| 0.02 * (i + 1) as f32).collect();
    let base = Case::new(1, 1, 40).dv(24).heads(4, 2).varlen(&lq, &lk);
    let mask = block_mask(&base, (7, 13), 0.5, 4, 4);
    let opts = AttentionOptions::default()
        .causal(true)
        .window(Some(20), None)
        .softcap(7.0)
        .alibi(Alibi::new(&slopes))
        .sinks(Sinks::new(&[0.1, -0.3, 1.0, 2.0]))
        .block_mask(mask);
    base.opts(opts)
}

/// Assert a forward output meets the accuracy rule.
pub fn assert_accurate(case: &Case, inputs: &Inputs, out: &ForwardOutput) -> [Check; 2] {
    let [q, k, v] = inputs.views();
    let checks = check_forward(out, &q, &k, &v, &case.opts).expect("reference");
    for c in &checks {
        assert!(c.passed(), "{case:?}\n{c}");
    }
    assert_eq!(
        out.o.precision(),
        case.precision,
        "output keeps the input dtype"
    );
    if std::env::var_os("FLASHATTN_VERBOSE").is_some() {
        eprintln!(
            "{} {:?}: {} | {}",
            case.seqlen_q,
            out.stats.plan.map(|p| (p.br, p.bc, p.threads_per_row)),
            checks[0],
            checks[1]
        );
    }
    checks
}

/// The other kernel families a case also runs where it forces none: tiled
/// where the planner picked lanes (CPU adapters) or coop (cooperative
/// matrices), and registers (the GPUs' default) unless the case fixes the
/// tiled kernels' tiles.
pub fn other_families(case: &Case, picked: Option<KernelFamily>) -> Vec<PlanOverrides> {
    let o = case.overrides;
    if o.kernel.is_some() || o.fixes_registers() {
        return Vec::new();
    }
    let mut out = Vec::new();
    if matches!(picked, Some(KernelFamily::Lanes | KernelFamily::Coop)) {
        out.push(o.kernel(KernelFamily::Tiled));
    }
    let tiles = o.br.is_some() || o.bc.is_some() || o.threads_per_row.is_some();
    if picked != Some(KernelFamily::Registers) && !tiles {
        out.push(o.kernel(KernelFamily::Registers));
    }
    out
}

/// Run a case on the GPU and check it, and with the other kernel families
/// on the same case (see [`other_families`]).
pub fn run_gpu(engine: &Engine, case: &Case) -> ForwardOutput {
    run_gpu_on(engine, case, true)
}

/// [`run_gpu`] with FLASHATTN_FULL_MATRIX=1; by default the planner's
/// kernels only, for cases that are values of code paths which other tests
/// run on every family (sizes, group sizes, windows, scales).
pub fn run_gpu_values(engine: &Engine, case: &Case) -> ForwardOutput {
    run_gpu_on(engine, case, flashattn_testkit::full_matrix())
}

fn run_gpu_on(engine: &Engine, case: &Case, every_family: bool) -> ForwardOutput {
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let run = |overrides: &PlanOverrides| {
        let out = engine
            .forward_with(&ForwardInputs::new(q, k, v), &case.opts, overrides)
            .unwrap_or_else(|e| panic!("{case:?}: {e}"));
        assert_accurate(case, &inputs, &out);
        out
    };
    let out = run(&case.overrides);
    if every_family {
        for o in other_families(case, out.stats.plan.map(|p| p.kernel)) {
            run(&o);
        }
    }
    out
}

/// A seeded output gradient for a case: its values (rounded to the case's
/// precision) and the same stored in that precision.
pub fn output_grad(case: &Case) -> (Vec<f32>, TensorData) {
    let mut rng = Rng::new(case.seed ^ 0xd0);
    let n = case.batch * case.seqlen_q * case.heads_q * case.head_dim_v;
    let g: Vec<f32> = rng
        .normal_vec(n, 1.0)
        .into_iter()
        .map(|x| case.precision.round(x))
        .collect();
    let stored = TensorData::from_f32(g.clone(), case.precision);
    (g, stored)
}

/// [`run_gpu_backward`], and with the other kernel families on the same
/// case (see [`other_families`]).
pub fn run_gpu_backward_both(engine: &Engine, case: &Case) -> flashattn::BackwardOutput {
    let out = run_gpu_backward(engine, case);
    for o in other_families(case, out.stats.plan.map(|p| p.kernel)) {
        run_gpu_backward(engine, &case.clone().overrides(o));
    }
    out
}

/// Forward then backward on the GPU, both checked against the f64 reference.
pub fn run_gpu_backward(engine: &Engine, case: &Case) -> flashattn::BackwardOutput {
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let fwd = engine
        .forward_with(&ForwardInputs::new(q, k, v), &case.opts, &case.overrides)
        .unwrap_or_else(|e| panic!("{case:?}: {e}"));
    let (_, g) = output_grad(case);
    let d_o = inputs.grad(&g);
    let inputs = flashattn::BackwardInputs::new(ForwardInputs::new(q, k, v), &fwd, d_o).unwrap();
    let out = engine
        .backward_with(&inputs, &case.opts, &case.overrides)
        .unwrap_or_else(|e| panic!("{case:?}: {e}"));
    let checks =
        flashattn::accuracy::check_backward(&out, &q, &k, &v, &d_o, &case.opts).expect("reference");
    for c in &checks {
        assert!(c.passed(), "{case:?}\n{c}");
    }
    if std::env::var_os("FLASHATTN_VERBOSE").is_some() {
        eprintln!("{case:?}\n  {} | {} | {}", checks[0], checks[1], checks[2]);
    }
    assert_eq!(out.dq.precision(), case.precision);
    out
}

/// The CPU forward and backward of `case` on every instruction set this
/// machine runs, each checked against the f64 reference and the baseline;
/// `more` sees each set's backend, backward inputs and gradients.
pub fn check_cpu(
    case: &Case,
    mut more: impl FnMut(
        flashattn::cpu::Isa,
        &flashattn::cpu::Cpu,
        &flashattn::BackwardInputs,
        &flashattn::BackwardOutput,
    ),
) {
    use flashattn::{BackwardInputs, ForwardInputs};
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let (_, g) = output_grad(case);
    let d_o = inputs.grad(&g);
    for &isa in flashattn::cpu::Isa::available() {
        let cpu = flashattn::cpu::Cpu::with_isa(isa).unwrap();
        let fail = |e: flashattn::Error| -> ! { panic!("{isa:?} {case:?}: {e}") };
        let fwd = cpu
            .forward(&ForwardInputs::new(q, k, v), &case.opts)
            .unwrap_or_else(|e| fail(e));
        assert_accurate(case, &inputs, &fwd);
        let bwd_inputs = BackwardInputs::new(ForwardInputs::new(q, k, v), &fwd, d_o).unwrap();
        let bwd = cpu
            .backward(&bwd_inputs, &case.opts)
            .unwrap_or_else(|e| fail(e));
        let checks = flashattn::accuracy::check_backward(&bwd, &q, &k, &v, &d_o, &case.opts);
        for c in checks.unwrap() {
            assert!(c.passed(), "{isa:?} {case:?}\n{c}");
        }
        more(isa, &cpu, &bwd_inputs, &bwd);
    }
}

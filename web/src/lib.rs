//! flashattn in the browser: the wasm-bindgen entry points `web/main.js` calls.
//!
//! Everything the page shows comes from the library itself: the planner, the
//! same WGSL kernels run through wgpu's WebGPU backend, the CPU backend, the
//! f64 reference and docs/semantics.md's accuracy rule, all compiled to wasm32. The page
//! holds no copy of any kernel. Every entry point returns a JSON string, so
//! the JavaScript side stays a thin view.

use flashattn::accuracy::{check_backward, check_decode, check_forward, Check};
use flashattn::random::Rng;
use flashattn::{
    cpu, AttentionOptions, AttentionShape, BackwardInputs, CacheLayout, CacheShape, DecodeProblem,
    DecodeStep, Engine, ForwardInputs, HostKvCache, PlanOverrides, Planned, Precision, TensorData,
    TensorView,
};
use serde::Serialize;
use std::cell::RefCell;
use std::rc::Rc;
use wasm_bindgen::prelude::*;
use web_time::Instant;

thread_local! {
    // One device for the page: pipelines are cached in it across runs.
    static ENGINE: RefCell<Option<Rc<Engine>>> = const { RefCell::new(None) };
}

fn js_err(e: impl std::fmt::Display) -> JsError {
    JsError::new(&e.to_string())
}

fn to_json(value: &impl Serialize) -> Result<String, JsError> {
    serde_json::to_string(value).map_err(js_err)
}

/// The page's engine, created on first use on the browser's WebGPU adapter.
async fn engine() -> Result<Rc<Engine>, JsError> {
    if let Some(e) = ENGINE.with(|e| e.borrow().clone()) {
        return Ok(e);
    }
    let engine = Rc::new(Engine::new_async().await.map_err(|e| {
        JsError::new(&format!(
            "no WebGPU device: {e}. Use a browser with WebGPU enabled \
             (Chromium: --enable-unsafe-webgpu when headless)"
        ))
    })?);
    ENGINE.with(|e| *e.borrow_mut() = Some(engine.clone()));
    Ok(engine)
}

#[derive(Serialize)]
struct Limits {
    max_compute_workgroup_storage_size: u32,
    max_compute_invocations_per_workgroup: u32,
    max_compute_workgroup_size_x: u32,
    max_compute_workgroups_per_dimension: u32,
    max_storage_buffer_binding_size: u64,
    max_buffer_size: u64,
    max_storage_buffers_per_shader_stage: u32,
}

impl From<&wgpu::Limits> for Limits {
    fn from(l: &wgpu::Limits) -> Self {
        Self {
            max_compute_workgroup_storage_size: l.max_compute_workgroup_storage_size,
            max_compute_invocations_per_workgroup: l.max_compute_invocations_per_workgroup,
            max_compute_workgroup_size_x: l.max_compute_workgroup_size_x,
            max_compute_workgroups_per_dimension: l.max_compute_workgroups_per_dimension,
            max_storage_buffer_binding_size: l.max_storage_buffer_binding_size,
            max_buffer_size: l.max_buffer_size,
            max_storage_buffers_per_shader_stage: l.max_storage_buffers_per_shader_stage,
        }
    }
}

#[derive(Serialize)]
struct DeviceReport {
    /// wgpu's adapter name (browsers often leave it empty; the page adds
    /// `GPUAdapter.info`'s vendor and architecture).
    adapter: String,
    backend: String,
    device_type: String,
    /// What the device was granted: the engine requests the adapter's limits.
    granted: Limits,
    /// What a browser grants when a page asks for nothing.
    webgpu_defaults: Limits,
    shader_f16: bool,
    timestamp_query: bool,
    /// The f16 storage path the planner picks on this device.
    f16_storage: &'static str,
}

/// Create the engine and describe the adapter, its granted limits and features.
#[wasm_bindgen]
pub async fn device_info() -> Result<String, JsError> {
    let e = engine().await?;
    // The storage path is the same for every sequence length.
    let shape = AttentionShape::new(1, 1024, 1024, 1, 1, 64).map_err(js_err)?;
    let f16_plan = e
        .plan(&shape, Precision::F16, &PlanOverrides::default())
        .map_err(js_err)?
        .plan;
    to_json(&DeviceReport {
        adapter: e.adapter_info().name.clone(),
        backend: format!("{:?}", e.adapter_info().backend),
        device_type: format!("{:?}", e.adapter_info().device_type),
        granted: e.limits().into(),
        webgpu_defaults: (&wgpu::Limits::default()).into(),
        shader_f16: e.features().contains(wgpu::Features::SHADER_F16),
        timestamp_query: e.features().contains(wgpu::Features::TIMESTAMP_QUERY),
        f16_storage: f16_plan.storage.name(),
    })
}

#[derive(Serialize)]
struct PlanReport {
    text: String,
    storage: &'static str,
    m_bytes: u32,
    bc_formula: u32,
    br_formula: u32,
    br: u32,
    bc: u32,
    threads_per_row: u32,
    workgroup_size: u32,
    workgroup_bytes: u32,
    clamps: Vec<String>,
}

impl From<&Planned> for PlanReport {
    fn from(planned: &Planned) -> Self {
        let p = &planned.plan;
        Self {
            text: planned.to_string(),
            storage: p.storage.name(),
            m_bytes: p.m_bytes,
            bc_formula: p.bc_formula,
            br_formula: p.br_formula,
            br: p.br,
            bc: p.bc,
            threads_per_row: p.threads_per_row,
            workgroup_size: p.workgroup_size,
            workgroup_bytes: p.workgroup_bytes,
            clamps: planned.clamps.iter().map(|c| c.to_string()).collect(),
        }
    }
}

#[derive(Serialize)]
struct CheckReport {
    name: String,
    max_error: f64,
    bound: f64,
    baseline_error: f64,
    passed: bool,
    non_finite: Option<String>,
}

impl From<&Check> for CheckReport {
    fn from(c: &Check) -> Self {
        Self {
            name: c.name.clone(),
            max_error: c.max_error,
            bound: c.bound,
            baseline_error: c.baseline_error,
            passed: c.passed(),
            non_finite: c.non_finite.clone(),
        }
    }
}

#[derive(Serialize)]
struct CaseReport {
    seqlen: usize,
    head_dim: usize,
    heads: usize,
    causal: bool,
    precision: String,
    /// The kernel family the forward and backward ran (`tiled` unless the
    /// case forced another).
    kernel: String,
    backward_kernel: String,
    plan: PlanReport,
    /// Best of the timed runs: submit to completion of the kernel.
    kernel_ms: f64,
    /// Best of the timed runs: upload, kernel and readback.
    wall_ms: f64,
    gflops: f64,
    dispatches: u32,
    peak_bytes: u64,
    /// The CPU backend (single-threaded in wasm) on the same inputs.
    cpu_ms: f64,
    backward_plan: PlanReport,
    /// Best of the timed backward runs (dq, dk, dv from o, lse and do).
    backward_kernel_ms: f64,
    backward_wall_ms: f64,
    backward_gflops: f64,
    /// o, lse, then dq, dk, dv.
    checks: Vec<CheckReport>,
    passed: bool,
    /// The first forward's and backward's verification (which family ran
    /// and its known-answer verdict on this device).
    verification: String,
    backward_verification: String,
}

/// A call's verification verdict, in words.
fn verdict_of(stats: &flashattn::CallStats) -> String {
    stats
        .verification
        .as_ref()
        .map_or("none".into(), |v| v.to_string())
}

/// Timed runs after the warm-up (which compiles the pipeline).
const TIMED_RUNS: usize = 3;

/// Run one forward and backward on WebGPU with seeded inputs
/// `(1, seqlen, heads, head_dim)` and output gradient, time them, and check o,
/// lse, dq, dk and dv against the f64 reference with docs/semantics.md's rule.
#[wasm_bindgen]
pub async fn run_case(
    seqlen: usize,
    head_dim: usize,
    heads: usize,
    causal: bool,
    precision: String,
    seed: u64,
    kernel: Option<String>,
) -> Result<String, JsError> {
    let e = engine().await?;
    let precision: Precision = precision.parse().map_err(js_err)?;
    // A forced kernel family (`registers`, `tiled`), else the planner's.
    let mut overrides = PlanOverrides::default();
    overrides.kernel = kernel
        .as_deref()
        .map(str::parse)
        .transpose()
        .map_err(js_err)?;
    let shape = AttentionShape::new(1, seqlen, seqlen, heads, heads, head_dim).map_err(js_err)?;
    let opts = AttentionOptions::default().causal(causal);
    let mut rng = Rng::new(seed);
    let mut make = |n| TensorData::from_f32(rng.normal_vec(n, 1.0), precision);
    let (q, k, v, d_o) = (
        make(shape.q_len()),
        make(shape.kv_len()),
        make(shape.kv_len()),
        make(shape.q_len()),
    );
    fn view(shape: [usize; 4], data: &TensorData) -> TensorView<'_> {
        TensorView {
            shape,
            data: data.as_host(),
        }
    }
    let (qv, kv, vv, dov) = (
        view(shape.q_shape(), &q),
        view(shape.kv_shape(), &k),
        view(shape.kv_shape(), &v),
        view(shape.q_shape(), &d_o),
    );
    let inputs = ForwardInputs::new(qv, kv, vv);

    // The warm-up compiles the kernel; its result is the one checked.
    let out = e
        .forward_async(&inputs, &opts, &overrides)
        .await
        .map_err(js_err)?;
    let (mut kernel, mut wall) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..TIMED_RUNS {
        let start = Instant::now();
        let timed = e
            .forward_async(&inputs, &opts, &overrides)
            .await
            .map_err(js_err)?;
        wall = wall.min(start.elapsed().as_secs_f64());
        kernel = kernel.min(timed.stats.kernel_seconds);
    }
    let start = Instant::now();
    cpu::forward(&inputs, &opts).map_err(js_err)?;
    let cpu_seconds = start.elapsed().as_secs_f64();

    // The backward reads the forward's o and lse, as in training.
    let bwd_inputs = BackwardInputs::new(inputs, &out, dov).map_err(js_err)?;
    let bwd = e
        .backward_async(&bwd_inputs, &opts, &overrides)
        .await
        .map_err(js_err)?;
    let (mut bwd_kernel, mut bwd_wall) = (f64::INFINITY, f64::INFINITY);
    for _ in 0..TIMED_RUNS {
        let start = Instant::now();
        let timed = e
            .backward_async(&bwd_inputs, &opts, &overrides)
            .await
            .map_err(js_err)?;
        bwd_wall = bwd_wall.min(start.elapsed().as_secs_f64());
        bwd_kernel = bwd_kernel.min(timed.stats.kernel_seconds);
    }

    let mut checks = check_forward(&out, &qv, &kv, &vv, &opts)
        .map_err(js_err)?
        .to_vec();
    checks.extend(check_backward(&bwd, &qv, &kv, &vv, &dov, &opts).map_err(js_err)?);
    let forward_plan = e.plan(&shape, precision, &overrides).map_err(js_err)?;
    let backward_plan = e
        .plan_backward(&shape, precision, &overrides)
        .map_err(js_err)?;
    // In f64: seqlen² can pass a 32-bit usize where q's elements fit.
    let flops = 4.0 * heads as f64 * (seqlen as f64).powi(2) * head_dim as f64
        / if causal { 2.0 } else { 1.0 };
    // Five matmuls against the forward's two (FlashAttention-2's convention).
    let bwd_flops = 2.5 * flops;
    to_json(&CaseReport {
        seqlen,
        head_dim,
        heads,
        causal,
        precision: precision.to_string(),
        kernel: forward_plan.plan.kernel.name().to_string(),
        backward_kernel: backward_plan.plan.kernel.name().to_string(),
        plan: PlanReport::from(&forward_plan),
        kernel_ms: kernel * 1e3,
        wall_ms: wall * 1e3,
        // Timer resolution in browsers is coarse; never divide by zero.
        gflops: flops / kernel.max(1e-6) / 1e9,
        dispatches: out.stats.dispatches,
        peak_bytes: out.stats.peak_bytes(),
        cpu_ms: cpu_seconds * 1e3,
        backward_plan: PlanReport::from(&backward_plan),
        backward_kernel_ms: bwd_kernel * 1e3,
        backward_wall_ms: bwd_wall * 1e3,
        backward_gflops: bwd_flops / bwd_kernel.max(1e-6) / 1e9,
        passed: checks.iter().all(|c| c.passed()),
        checks: checks.iter().map(CheckReport::from).collect(),
        verification: verdict_of(&out.stats),
        backward_verification: verdict_of(&bwd.stats),
    })
}

#[derive(Serialize)]
struct LayoutReport {
    name: String,
    precision: String,
    /// The forward's plan (the same kernels as every other case, with the
    /// layout's variant).
    plan: String,
    dispatches: u32,
    /// o, lse, then dq, dk, dv (and dsinks with sinks).
    checks: Vec<CheckReport>,
    /// With dropout: the largest |o − the CPU backend's o| for the same
    /// seed (the same mask), held below 1e-4.
    cpu_o_diff: Option<f32>,
    passed: bool,
    verification: String,
}

/// One layout self-test case: shape (batch, seqlen_q, seqlen_k, heads_q,
/// heads_kv, head_dim, head_dim_v) and options.
fn layout_case(name: &str) -> Result<(AttentionShape, AttentionOptions), JsError> {
    use flashattn::Varlen;
    use flashattn::{Alibi, Sinks};
    use flashattn::{BlockGrid, BlockMask};
    let shape = |b, sq, sk, hq, hk, d| AttentionShape::new(b, sq, sk, hq, hk, d).map_err(js_err);
    let causal = AttentionOptions::default().causal(true);
    let mask = |sq, sk, heads| {
        let grid = BlockGrid::new(sq, sk, (7, 13)).map_err(js_err)?;
        Ok::<_, JsError>(BlockMask::random(grid, heads, 0.4, 5))
    };
    Ok(match name {
        "alibi" => (
            shape(2, 37, 45, 4, 2, 24)?,
            causal.alibi(Alibi::standard(4)),
        ),
        "sinks" => (
            shape(1, 40, 29, 2, 1, 32)?,
            causal.window(Some(8), None).sinks(Sinks::new(&[0.5, -1.0])),
        ),
        "block-sparse" => (
            shape(1, 45, 57, 2, 2, 16)?,
            causal.block_mask(mask(45, 57, 2)?),
        ),
        "varlen" => {
            let v = Varlen::new(&[0, 13, 13, 42, 50], &[0, 20, 29, 29, 46]).map_err(js_err)?;
            let slopes: Vec<f32> = (0..8).map(|i| 0.05 * (i + 1) as f32).collect();
            let opts = causal
                .varlen(v)
                .alibi(Alibi::new(&slopes))
                .sinks(Sinks::new(&[0.0, 1.0]))
                .block_mask(mask(29, 20, 1)?);
            (shape(1, 50, 46, 2, 1, 24)?, opts)
        }
        "d512" => (shape(1, 9, 11, 1, 1, 512)?, causal),
        "dropout" => (
            shape(2, 37, 45, 4, 2, 24)?,
            causal.dropout(0.2).dropout_seed(11).dropout_offset(3),
        ),
        "dv" => (
            shape(1, 17, 21, 2, 1, 192)?
                .with_head_dim_v(128)
                .map_err(js_err)?,
            causal,
        ),
        other => return Err(JsError::new(&format!("no layout case `{other}`"))),
    })
}

/// A layout self-test case (ALiBi, sinks, block-sparse, a packed batch,
/// d 512, v's own head dim, dropout) forward and backward on WebGPU with
/// seeded inputs, every output checked against the f64 reference (and with
/// dropout o against the CPU backend's for the same seed).
#[wasm_bindgen]
pub async fn run_layout_case(
    name: String,
    precision: String,
    seed: u64,
) -> Result<String, JsError> {
    let e = engine().await?;
    let precision: Precision = precision.parse().map_err(js_err)?;
    let (shape, opts) = layout_case(&name)?;
    let mut rng = Rng::new(seed);
    let mut make = |n| TensorData::from_f32(rng.normal_vec(n, 1.0), precision);
    let data = [shape.q_len(), shape.kv_len(), shape.v_len(), shape.o_len()].map(&mut make);
    let shapes = [
        shape.q_shape(),
        shape.kv_shape(),
        shape.v_shape(),
        shape.o_shape(),
    ];
    let [qv, kv, vv, dov] = [0, 1, 2, 3].map(|i| TensorView {
        shape: shapes[i],
        data: data[i].as_host(),
    });
    let none = PlanOverrides::default();
    let inputs = ForwardInputs::new(qv, kv, vv);
    let out = e
        .forward_async(&inputs, &opts, &none)
        .await
        .map_err(js_err)?;
    let bwd_inputs = BackwardInputs::new(inputs, &out, dov).map_err(js_err)?;
    let bwd = e
        .backward_async(&bwd_inputs, &opts, &none)
        .await
        .map_err(js_err)?;
    let mut checks = check_forward(&out, &qv, &kv, &vv, &opts)
        .map_err(js_err)?
        .to_vec();
    checks.extend(check_backward(&bwd, &qv, &kv, &vv, &dov, &opts).map_err(js_err)?);
    let cpu_o_diff = if opts.dropout.is_active() {
        let cpu_o = cpu::forward(&inputs, &opts).map_err(js_err)?.o.to_f32();
        let o = out.o.to_f32();
        Some(
            o.iter()
                .zip(&cpu_o)
                .map(|(a, b)| (a - b).abs())
                .fold(0.0, f32::max),
        )
    } else {
        None
    };
    let plan = e.plan(&shape, precision, &none).map_err(js_err)?;
    to_json(&LayoutReport {
        name,
        precision: precision.to_string(),
        plan: plan.to_string(),
        dispatches: out.stats.dispatches,
        cpu_o_diff,
        passed: checks.iter().all(|c| c.passed()) && cpu_o_diff.is_none_or(|d| d < 1e-4),
        checks: checks.iter().map(CheckReport::from).collect(),
        verification: verdict_of(&out.stats),
    })
}

#[derive(Serialize)]
struct Heatmap {
    seqlen: usize,
    head_dim: usize,
    causal: bool,
    /// Row-major `seqlen × seqlen` softmax probabilities.
    p: Vec<f64>,
    /// Largest `|Σ_j p_ij − 1|` over rows: shows the LSE normalizes exactly.
    max_row_sum_error: f64,
}

/// The most tokens [`heatmap`] draws.
const MAX_HEATMAP: usize = 1024;

/// The attention matrix of a small seeded example, rebuilt from the GPU's LSE
/// output as `P = exp(S − lse)` (what a backward pass does). The forward
/// itself never stores P.
#[wasm_bindgen]
pub async fn heatmap(
    seqlen: usize,
    head_dim: usize,
    causal: bool,
    seed: u64,
) -> Result<String, JsError> {
    // P is seqlen² f64 values in the JSON the page draws.
    if seqlen > MAX_HEATMAP {
        return Err(JsError::new(&format!(
            "the heatmap draws at most {MAX_HEATMAP} tokens, got {seqlen}"
        )));
    }
    let e = engine().await?;
    let shape = AttentionShape::new(1, seqlen, seqlen, 1, 1, head_dim).map_err(js_err)?;
    let opts = AttentionOptions::default().causal(causal);
    let mut rng = Rng::new(seed);
    // Keys are noisy copies of the queries, so each token attends mostly to
    // itself and a few look-alikes: a visible diagonal instead of noise.
    let q = rng.normal_vec(shape.q_len(), 1.2);
    let k: Vec<f32> = q
        .iter()
        .zip(rng.normal_vec(shape.kv_len(), 1.5))
        .map(|(a, n)| a + n)
        .collect();
    let v = rng.normal_vec(shape.kv_len(), 1.0);
    let out = e
        .forward_async(
            &ForwardInputs::new(
                TensorView::f32(shape.q_shape(), &q),
                TensorView::f32(shape.kv_shape(), &k),
                TensorView::f32(shape.kv_shape(), &v),
            ),
            &opts,
            &PlanOverrides::default(),
        )
        .await
        .map_err(js_err)?;
    let scale = opts.scale_for(head_dim) as f64;
    let mask = opts.mask(&shape);
    let mut p = vec![0.0; seqlen * seqlen];
    let mut max_row_sum_error = 0.0f64;
    for i in 0..seqlen {
        let lse = out.lse[i] as f64;
        let qi = &q[i * head_dim..][..head_dim];
        let mut sum = 0.0;
        for j in mask.key_range(i) {
            let kj = &k[j * head_dim..][..head_dim];
            let s: f64 = qi.iter().zip(kj).map(|(a, b)| *a as f64 * *b as f64).sum();
            let pij = (s * scale - lse).exp();
            p[i * seqlen + j] = pij;
            sum += pij;
        }
        max_row_sum_error = max_row_sum_error.max((sum - 1.0).abs());
    }
    to_json(&Heatmap {
        seqlen,
        head_dim,
        causal,
        p,
        max_row_sum_error,
    })
}

/// A worked example: one query, scores 1.414, 0.707, 0.707 (scale 1,
/// `q = 1.414`, `k = 1, 0.5, 0.5`), values 1, 0, 1.
const EXAMPLE_Q: f32 = 1.414;
const EXAMPLE_K: [f32; 3] = [1.0, 0.5, 0.5];
const EXAMPLE_V: [f32; 3] = [1.0, 0.0, 1.0];

#[derive(Serialize)]
struct Step {
    keys: [usize; 2],
    scores: Vec<f64>,
    block_max: f64,
    /// `exp(m_old − m_new)`: how much the running sums shrink.
    alpha: f64,
    m: f64,
    l: f64,
    /// Unnormalized accumulator `Σ exp(s − m)·v`.
    acc: f64,
    /// The running answer `acc / l`.
    o: f64,
}

#[derive(Serialize)]
struct WorkedExample {
    block: usize,
    scores: Vec<f64>,
    v: Vec<f64>,
    steps: Vec<Step>,
    online_o: f64,
    online_lse: f64,
    /// Whole-row softmax, for comparison.
    weights: Vec<f64>,
    softmax_o: f64,
    softmax_lse: f64,
    /// The WGSL kernel on WebGPU with `Bc = block`.
    gpu_o: f32,
    gpu_lse: f32,
    gpu_plan: String,
}

/// Online softmax over the worked example in blocks of `block` keys, step by
/// step, next to whole-row softmax and the GPU kernel run with `Bc = block`.
#[wasm_bindgen]
pub async fn worked_example(block: usize) -> Result<String, JsError> {
    if !(1..=EXAMPLE_K.len()).contains(&block) {
        return Err(JsError::new(&format!(
            "block must be 1..={}, got {block}",
            EXAMPLE_K.len()
        )));
    }
    let scores: Vec<f64> = EXAMPLE_K
        .iter()
        .map(|&k| EXAMPLE_Q as f64 * k as f64)
        .collect();
    let v: Vec<f64> = EXAMPLE_V.iter().map(|&x| x as f64).collect();

    // The recurrence the kernel runs per query row (FlashAttention Algorithm 1).
    let (mut m, mut l, mut acc) = (f64::NEG_INFINITY, 0.0, 0.0);
    let mut steps = Vec::new();
    for start in (0..scores.len()).step_by(block) {
        let end = (start + block).min(scores.len());
        let s = &scores[start..end];
        let block_max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let m_new = m.max(block_max);
        let alpha = (m - m_new).exp();
        l = l * alpha + s.iter().map(|x| (x - m_new).exp()).sum::<f64>();
        acc = acc * alpha
            + s.iter()
                .zip(&v[start..end])
                .map(|(x, vj)| (x - m_new).exp() * vj)
                .sum::<f64>();
        m = m_new;
        steps.push(Step {
            keys: [start, end],
            scores: s.to_vec(),
            block_max,
            alpha,
            m,
            l,
            acc,
            o: acc / l,
        });
    }

    let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
    let total: f64 = scores.iter().map(|x| (x - max).exp()).sum();
    let weights: Vec<f64> = scores.iter().map(|x| (x - max).exp() / total).collect();
    let softmax_o = weights.iter().zip(&v).map(|(w, x)| w * x).sum();

    let e = engine().await?;
    let overrides = PlanOverrides::default()
        .bc(block as u32)
        .br(1)
        .threads_per_row(1);
    let out = e
        .forward_async(
            &ForwardInputs::new(
                TensorView::f32([1, 1, 1, 1], &[EXAMPLE_Q]),
                TensorView::f32([1, 3, 1, 1], &EXAMPLE_K),
                TensorView::f32([1, 3, 1, 1], &EXAMPLE_V),
            ),
            &AttentionOptions::default().scale(1.0),
            &overrides,
        )
        .await
        .map_err(js_err)?;
    let gpu_plan = out.stats.plan.map(|p| p.to_string()).unwrap_or_default();
    to_json(&WorkedExample {
        block,
        scores,
        v,
        steps,
        online_o: acc / l,
        online_lse: m + l.ln(),
        weights,
        softmax_o,
        softmax_lse: max + total.ln(),
        gpu_o: out.o.to_f32()[0],
        gpu_lse: out.lse[0],
        gpu_plan,
    })
}

/// The decode panel's model: 8 query heads over 2 kv heads of d 64, two
/// sequences (the second two thirds as long as the first).
const DECODE_HEADS_Q: usize = 8;
const DECODE_HEADS_KV: usize = 2;
const DECODE_HEAD_DIM: usize = 64;

#[derive(Serialize)]
struct DecodeReport {
    cache_len: usize,
    page_size: usize,
    /// 0: the planner chose.
    requested_splits: usize,
    precision: String,
    batch: usize,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    /// Each sequence's tokens before the first step.
    start_lens: Vec<usize>,
    /// Pages in the cache (shuffled among the sequences).
    pages: usize,
    /// Timed steps (after one untimed warm-up step, which compiles the kernels).
    steps: usize,
    /// The splits each timed step ran with.
    splits: Vec<usize>,
    /// The last step's plan, with the planner's reasons.
    plan: String,
    /// Mean wall time of a timed step: uploads, append, decode, merge, readback.
    step_ms: f64,
    /// A step appends one token to each sequence: `step_ms / batch`.
    token_ms: f64,
    tokens_per_s: f64,
    /// Mean submit-to-completion time of a step's kernels.
    kernel_ms: f64,
    /// The CPU backend (single-threaded in wasm) on the checked step.
    cpu_step_ms: f64,
    /// The checked step (the last one), 0-based among the timed ones.
    checked_step: usize,
    /// WebGPU's o and lse, then the CPU backend's, against the f64 reference.
    checks: Vec<CheckReport>,
    max_o_diff: f64,
    max_lse_diff: f64,
    /// The device cache after the checked step equals the CPU backend's.
    cache_identical: bool,
    passed: bool,
    /// The checked step's verification verdict.
    verification: String,
}

/// Build a paged KV cache on the device (pages shuffled among the two
/// sequences, the first `cache_len` tokens random), run `steps` decoding
/// steps with `decode_async` — each appends one token per sequence and
/// attends causally — and time them; check the last step against the CPU
/// backend run on the same cache contents (read back from the device), both
/// under docs/semantics.md's rule against the f64 reference, and compare the caches
/// after it. `num_splits` 0 lets the planner split the keys.
#[wasm_bindgen]
pub async fn decode_case(
    cache_len: usize,
    page_size: usize,
    num_splits: usize,
    steps: usize,
    precision: String,
    seed: u64,
) -> Result<String, JsError> {
    if cache_len == 0 || page_size == 0 || steps == 0 {
        return Err(JsError::new(
            "cache length, page size and steps must be at least 1",
        ));
    }
    let e = engine().await?;
    let precision: Precision = precision.parse().map_err(js_err)?;
    let (hq, hk, d) = (DECODE_HEADS_Q, DECODE_HEADS_KV, DECODE_HEAD_DIM);
    let mut lens = vec![cache_len, (cache_len / 3 * 2).max(1)];
    let start_lens = lens.clone();
    let batch = lens.len();
    // Room for the warm-up step and the timed ones (checked: these come
    // from the page, and usize is 32 bits here).
    let tokens = cache_len
        .checked_add(steps)
        .and_then(|n| n.checked_add(1))
        .ok_or_else(|| JsError::new("the cache tokens overflow usize"))?;
    let max_pages = tokens.div_ceil(page_size);
    let pages = batch
        .checked_mul(max_pages)
        .ok_or_else(|| JsError::new("the pages (batch × max_pages) overflow usize"))?;
    let Ok(page_count) = i32::try_from(pages) else {
        return Err(JsError::new(&format!(
            "{pages} pages do not fit the block table's int32 entries"
        )));
    };
    let mut rng = Rng::new(seed);
    let mut table: Vec<i32> = (0..page_count).collect();
    for i in (1..table.len()).rev() {
        table.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
    }
    let layout = CacheLayout::Paged { pages, page_size };
    let shape = CacheShape::new(layout, hk, d).map_err(js_err)?;
    let mut random = |n| TensorData::from_f32(rng.normal_vec(n, 1.0), precision);
    let host = HostKvCache::new(shape, random(shape.len()), random(shape.len())).map_err(js_err)?;
    let mut cache = e.upload_kv_cache_async(&host).await.map_err(js_err)?;
    drop(host);
    let opts = AttentionOptions::default().causal(true);
    let splits_arg = (num_splits > 0).then_some(num_splits);

    let (mut wall, mut kernels, mut used) = (0.0, 0.0, Vec::new());
    let mut checked = None;
    let mut plan = String::new();
    for s in 0..=steps {
        let (q, k, v) = (
            random(batch * hq * d),
            random(batch * hk * d),
            random(batch * hk * d),
        );
        // Within the cache, whose elements CacheShape::new held to the limit.
        let lens_i32: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
        let step = DecodeStep::new(q.view([batch, 1, hq, d]), &lens_i32)
            .block_table(&table, max_pages)
            .append(k.view([batch, 1, hk, d]), v.view([batch, 1, hk, d]));
        let last = s == steps;
        let before = if last {
            Some(e.read_kv_cache_async(&cache).await.map_err(js_err)?)
        } else {
            None
        };
        let start = Instant::now();
        let out = e
            .decode_async(&mut cache, &step, &opts, splits_arg)
            .await
            .map_err(js_err)?;
        let seconds = start.elapsed().as_secs_f64();
        if s > 0 {
            wall += seconds;
            kernels += out.stats.kernel_seconds;
            used.push(out.num_splits);
        }
        if let Some(before) = before {
            let problem = DecodeProblem::new(&step, cache.shape(), precision).map_err(js_err)?;
            plan = e
                .plan_decode(&problem, &opts, splits_arg)
                .map_err(js_err)?
                .to_string();
            let mut cpu_cache = before.clone();
            let start = Instant::now();
            let cpu_out = cpu::decode(&mut cpu_cache, &step, &opts, splits_arg).map_err(js_err)?;
            let cpu_seconds = start.elapsed().as_secs_f64();
            let mut checks = Vec::new();
            for (who, o) in [("wgpu", &out), ("cpu", &cpu_out)] {
                for c in check_decode(o, &before, &step, &opts).map_err(js_err)? {
                    let mut r = CheckReport::from(&c);
                    r.name = format!("{who} {}", c.name);
                    checks.push(r);
                }
            }
            let diff = |a: &[f32], b: &[f32]| {
                a.iter()
                    .zip(b)
                    .filter(|(x, y)| x.is_finite() || y.is_finite())
                    .map(|(x, y)| (f64::from(*x) - f64::from(*y)).abs())
                    .fold(0.0, f64::max)
            };
            let after = e.read_kv_cache_async(&cache).await.map_err(js_err)?;
            checked = Some((
                checks,
                diff(&out.o.to_f32(), &cpu_out.o.to_f32()),
                diff(&out.lse, &cpu_out.lse),
                (after == cpu_cache, verdict_of(&out.stats)),
                cpu_seconds,
            ));
        }
        for l in &mut lens {
            *l += 1;
        }
    }
    let Some((checks, max_o_diff, max_lse_diff, (cache_identical, verification), cpu_seconds)) =
        checked
    else {
        return Err(JsError::new("no step was checked"));
    };
    let step_seconds = wall / steps as f64;
    to_json(&DecodeReport {
        cache_len,
        page_size,
        requested_splits: num_splits,
        precision: precision.to_string(),
        batch,
        heads_q: hq,
        heads_kv: hk,
        head_dim: d,
        start_lens,
        pages,
        steps,
        splits: used,
        plan,
        step_ms: step_seconds * 1e3,
        token_ms: step_seconds / batch as f64 * 1e3,
        tokens_per_s: batch as f64 / step_seconds.max(1e-9),
        kernel_ms: kernels / steps as f64 * 1e3,
        cpu_step_ms: cpu_seconds * 1e3,
        checked_step: steps - 1,
        passed: cache_identical && checks.iter().all(|c| c.passed),
        checks,
        max_o_diff,
        max_lse_diff,
        cache_identical,
        verification,
    })
}

#[derive(Serialize)]
struct VerdictReport {
    family: String,
    call: String,
    precision: String,
    flags: Vec<String>,
    /// `verified`, `failed`, `not yet checked` or `verification off`.
    verdict: String,
    /// The check's worst output against its bound.
    detail: Option<String>,
    /// The check's time (its kernels compiled on first use), ms.
    ms: f64,
    /// Read from a cache rather than checked now (never in the browser:
    /// verdicts live as long as the page's engine).
    cached: bool,
}

#[derive(Serialize)]
struct VerdictsReport {
    mode: String,
    /// Checks the engine ran (one per family key, on the family's first call).
    checks_run: u32,
    check_ms: f64,
    known: Vec<VerdictReport>,
}

/// Every kernel family's verdict on this device so far: each was checked
/// before its first call served the page.
#[wasm_bindgen]
pub async fn verdicts() -> Result<String, JsError> {
    let e = engine().await?;
    let (checks_run, seconds) = e.checks_run();
    let known = e
        .verdicts()
        .into_iter()
        .map(|c| {
            let evidence = c.verdict.evidence();
            VerdictReport {
                family: c.family.family.to_string(),
                call: c.family.call.name().to_string(),
                precision: c.family.precision.to_string(),
                flags: c.family.flags.clone(),
                verdict: c.verdict.word().to_string(),
                detail: evidence.map(|e| e.detail.clone()),
                ms: evidence.map_or(0.0, |e| e.seconds * 1e3),
                cached: evidence.is_some_and(|e| e.cached),
            }
        })
        .collect();
    to_json(&VerdictsReport {
        mode: e.verify_mode().name().to_string(),
        checks_run,
        check_ms: seconds * 1e3,
        known,
    })
}

/// Route Rust panics to the browser console (otherwise they read as
/// "unreachable executed").
#[wasm_bindgen(start)]
pub fn start() {
    console_error_panic_hook::set_once();
}

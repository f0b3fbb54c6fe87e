//! `flashattn demo`: a forward at a realistic shape on the backend `auto`
//! chooses (and says why), checked against the f64 reference.

use crate::args::DemoArgs;
use crate::error::{CliError, Result};
use flashattn::accuracy::check_forward;
use flashattn::random::Rng;
use flashattn::{
    AttentionOptions, AttentionShape, Backend, BackendKind, ForwardInputs, PlanOverrides,
    Precision, TensorData, TensorView, Workload,
};
use std::time::Instant;

pub fn run(a: DemoArgs) -> Result<()> {
    let precision: Precision = a.precision.parse()?;
    let kind: BackendKind = a.backend.parse()?;
    let shape = AttentionShape::new(a.batch, a.seqlen, a.seqlen, a.heads, a.heads, a.head_dim)?;
    crate::bench::host_memory_ok(|| "this problem".into(), crate::bench::input_bytes(&shape))?;
    let opts = AttentionOptions::default().causal(a.causal);
    let workload = Workload::new(shape, precision, opts.clone());
    let choice = Backend::open(kind, &workload)?;
    println!("backend: {}", choice.backend.name());
    println!("why: {}", choice.reason);
    if let (Backend::Cpu, BackendKind::Auto) = (&choice.backend, kind) {
        // `why` says whether a software adapter was timed slower or none exists.
        println!("NOTICE: running on the CPU backend, as no hardware GPU adapter was found (why: above). With a GPU and its Vulkan, Metal or DX12 driver, flashattn runs there; `--backend wgpu` tries a software adapter (Mesa's lavapipe, Debian's mesa-vulkan-drivers) if one is installed.");
    }
    println!(
        "problem: batch {}, seqlen {}, heads {}, head_dim {}, {precision}{}",
        a.batch,
        a.seqlen,
        a.heads,
        a.head_dim,
        if a.causal { ", causal" } else { "" }
    );
    let mut rng = Rng::new(a.seed);
    let mut make = |n| TensorData::from_f32(rng.normal_vec(n, 1.0), precision);
    let data = [shape.q_len(), shape.kv_len(), shape.kv_len()].map(&mut make);
    let shapes = [shape.q_shape(), shape.kv_shape(), shape.kv_shape()];
    let [q, k, v] = [0, 1, 2].map(|i| TensorView {
        shape: shapes[i],
        data: data[i].as_host(),
    });
    run_and_check(&choice.backend, &ForwardInputs::new(q, k, v), &opts, &a)
}

/// Time one forward (after a warm-up that compiles the kernels) and check it.
fn run_and_check(
    backend: &Backend,
    qkv: &ForwardInputs,
    opts: &AttentionOptions,
    a: &DemoArgs,
) -> Result<()> {
    let none = PlanOverrides::default();
    if let Backend::Wgpu(engine) = backend {
        let q = qkv.q;
        let shape = qkv.shape()?;
        println!("plan:");
        for line in engine
            .plan(&shape, q.precision(), &none)?
            .to_string()
            .lines()
        {
            println!("  {line}");
        }
        backend.forward(qkv, opts, &none)?;
    }
    let start = Instant::now();
    let out = backend.forward(qkv, opts, &none)?;
    let wall = start.elapsed().as_secs_f64();
    let kernel = if out.stats.kernel_seconds > 0.0 {
        out.stats.kernel_seconds
    } else {
        wall
    };
    let flops = 4.0 * (a.batch * a.heads * a.seqlen * a.seqlen * a.head_dim) as f64
        / if a.causal { 2.0 } else { 1.0 };
    println!(
        "time: {:.1} ms kernel, {:.1} ms with transfers; {:.2} GFLOP/s",
        kernel * 1e3,
        wall * 1e3,
        flops / kernel / 1e9
    );
    println!("checking against the f64 reference...");
    let checks = check_forward(&out, &qkv.q, &qkv.k, &qkv.v, opts)?;
    for c in &checks {
        println!("  {c}");
    }
    let failed = checks.iter().filter(|c| !c.passed()).count();
    if failed > 0 {
        return Err(CliError::Inaccurate {
            failed,
            checked: checks.len(),
        });
    }
    println!("result: PASS (docs/semantics.md accuracy rule)");
    Ok(())
}

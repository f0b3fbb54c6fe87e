//! `flashattn demo`: a forward at a realistic shape on the best backend,
//! checked against the f64 reference.

use super::args::DemoArgs;
use flashattn::accuracy::check_forward;
use flashattn::random::Rng;
use flashattn::{
    AttentionOptions, AttentionShape, Backend, BackendKind, Error, PlanOverrides, Precision,
    Result, TensorData, TensorView,
};
use std::time::Instant;

pub fn run(a: DemoArgs) -> Result<()> {
    let precision: Precision = a.precision.parse()?;
    let kind: BackendKind = a.backend.parse()?;
    let shape = AttentionShape::new(a.batch, a.seqlen, a.seqlen, a.heads, a.heads, a.head_dim)?;
    let opts = AttentionOptions::default().causal(a.causal);
    let (backend, notice) = Backend::open(kind)?;
    if let Some(n) = notice {
        println!("{n}");
    }
    if let (Backend::Cpu, BackendKind::Auto) = (&backend, kind) {
        println!("NOTICE: running on the CPU backend; install a Vulkan driver (e.g. mesa-vulkan-drivers) for the GPU path.");
    }
    println!("backend: {}", backend.name());
    println!(
        "problem: batch {}, seqlen {}, heads {}, head_dim {}, {precision}{}",
        a.batch,
        a.seqlen,
        a.heads,
        a.head_dim,
        if a.causal { ", causal" } else { "" }
    );

    let mut rng = Rng::new(a.seed);
    let make = |rng: &mut Rng, n| TensorData::from_f32(rng.normal_vec(n, 1.0), precision);
    let q = make(&mut rng, shape.q_len());
    let k = make(&mut rng, shape.kv_len());
    let v = make(&mut rng, shape.kv_len());
    let (qv, kv, vv) = (
        TensorView {
            shape: shape.q_shape(),
            data: q.as_host(),
        },
        TensorView {
            shape: shape.kv_shape(),
            data: k.as_host(),
        },
        TensorView {
            shape: shape.kv_shape(),
            data: v.as_host(),
        },
    );

    let none = PlanOverrides::default();
    if let Backend::Wgpu(engine) = &backend {
        let plan = engine.plan(&shape, precision, &none)?;
        println!("plan:");
        for line in plan.to_string().lines() {
            println!("  {line}");
        }
        // Compile the pipeline outside the timed run.
        backend.forward(&qv, &kv, &vv, &opts, &none)?;
    }
    let start = Instant::now();
    let out = backend.forward(&qv, &kv, &vv, &opts, &none)?;
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
    let checks = check_forward(&out, &qv, &kv, &vv, &opts)?;
    for c in &checks {
        println!("  {c}");
    }
    if checks.iter().all(|c| c.passed()) {
        println!("result: PASS (SPEC.md accuracy rule)");
        Ok(())
    } else {
        Err(Error::Device(
            "the result does not meet the accuracy rule".into(),
        ))
    }
}

//! Criterion benches: forward and backward, flash vs naive WGSL vs CPU, plus
//! the matmul ceiling, on one adapter in one process. Throughput is in FLOPs
//! (criterion prints it as elements/s: read "Gelem/s" as GFLOP/s). GPU cases
//! are timed by their kernel time, not by uploads and readbacks.
//!
//! `cargo bench --bench attention` runs seqlen 256..8192, d 64 and 128,
//! causal and not (slow on a CPU adapter); FLASHATTN_BENCH_QUICK=1 shrinks it
//! to one small case per kind so CI proves the benches still run.

use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use flashattn::{CeilingShape, Engine, Precision};
use flashattn_cli::bench::{self, Implementation, Matrix, Pass};
use std::time::Duration;

fn attention(c: &mut Criterion) {
    let quick = std::env::var("FLASHATTN_BENCH_QUICK").is_ok_and(|v| v == "1");
    let engine = match Engine::new() {
        Ok(e) => {
            eprintln!("benchmarking on {}", e.describe());
            Some(e)
        }
        Err(e) => {
            eprintln!("no adapter ({e}): only the CPU backend is benchmarked");
            None
        }
    };
    let (seqlens, dims): (&[usize], &[usize]) = if quick {
        (&[128], &[64])
    } else {
        (&[256, 512, 1024, 2048, 4096, 8192], &[64, 128])
    };
    let implementations: &[Implementation] = if engine.is_some() {
        &[
            Implementation::Flash,
            Implementation::Naive,
            Implementation::Cpu,
        ]
    } else {
        &[Implementation::Cpu]
    };
    for pass in [Pass::Forward, Pass::Backward] {
        for &d in dims {
            for causal in [false, true] {
                let mut group = c.benchmark_group(format!(
                    "{pass:?}/d{d}{}",
                    if causal { "/causal" } else { "" }
                ));
                group
                    .sample_size(10)
                    .warm_up_time(Duration::from_millis(100));
                let cases = Matrix {
                    passes: vec![pass],
                    implementations: implementations.to_vec(),
                    seqlens: seqlens.to_vec(),
                    head_dims: vec![d],
                    causal: vec![causal],
                    dropouts: vec![0.0],
                    heads: 1,
                    batch: 1,
                    precision: Precision::F32,
                }
                .cases();
                for case in cases {
                    // A case the device cannot run (naive past the binding
                    // limit) is reported and left out, never timed as a number.
                    if let Some(e) = bench::run(engine.as_ref(), &case, 0).error {
                        eprintln!("skipping {case:?}: {e}");
                        continue;
                    }
                    group.throughput(Throughput::Elements(case.flops() as u64));
                    let id = BenchmarkId::new(format!("{:?}", case.implementation), case.seqlen);
                    group.bench_function(id, |b| {
                        b.iter_custom(|iters| {
                            let r = bench::run(engine.as_ref(), &case, iters as usize);
                            if let Some(e) = r.error {
                                panic!("{case:?} failed: {e}");
                            }
                            Duration::from_secs_f64(r.seconds.iter().sum())
                        })
                    });
                }
                group.finish();
            }
        }
    }
    if let Some(e) = &engine {
        let mut group = c.benchmark_group("matmul_ceiling");
        group.sample_size(10);
        for &d in dims {
            let n = if quick { 128 } else { 2048 };
            group.throughput(Throughput::Elements((2 * n * n * d) as u64));
            group.bench_function(BenchmarkId::new(format!("d{d}"), n), |b| {
                b.iter_custom(|iters| {
                    match e.matmul_ceiling(CeilingShape::Values, n, d, iters as usize) {
                        Ok(r) => Duration::from_secs_f64(r.seconds.iter().sum()),
                        Err(err) => panic!("matmul ceiling failed: {err}"),
                    }
                })
            });
        }
        group.finish();
    }
}

criterion_group!(benches, attention);
criterion_main!(benches);

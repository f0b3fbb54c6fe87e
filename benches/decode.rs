//! Criterion benches of decoding against a paged KV cache (FlashDecoding):
//! batch 1 and 8, 32 query heads over 8 kv heads, d 128, caches of 1k and 8k
//! tokens per sequence, f16 and f32, the planner's splits against one split
//! (`num_splits = Some(1)`), a wgpu device cache against the CPU backend.
//!
//! One iteration is one step of a generation loop: each sequence appends one
//! token (at position L − 1, the same slot every iteration, so the cache
//! does not grow) and attends to its L keys. It is timed as the whole call —
//! uploading q and the new k/v, the append, decode and merge kernels, and
//! reading o and lse back — since that is what a step costs; the kernels'
//! share is printed at the end. Throughput counts the K and V bytes a step
//! reads (criterion's "GiB/s"). Cases the device cannot hold (a cache over
//! one storage binding: 128 MiB on lavapipe) are reported and left out.
//!
//! `cargo bench --bench decode`. Defaults are kept short for CPU adapters
//! (10 flat samples, 1 s of measurement); FLASHATTN_BENCH_DECODE_32K=1 adds
//! 32k-token caches (slow on lavapipe), FLASHATTN_BENCH_QUICK=1 shrinks the
//! matrix to 1k tokens at batch 1 so CI proves the bench still runs (as
//! does `cargo test --benches`, which runs each case once).

use criterion::{
    criterion_group, criterion_main, BenchmarkId, Criterion, SamplingMode, Throughput,
};
use flashattn::random::Rng;
use flashattn::{
    cpu, AttentionOptions, CacheLayout, CacheShape, DecodeProblem, DecodeStep, Engine, HostKvCache,
    Precision, TensorData,
};
use std::time::{Duration, Instant};

const HEADS_Q: usize = 32;
const HEADS_KV: usize = 8;
const HEAD_DIM: usize = 128;
const PAGE_SIZE: usize = 256;

fn flag(name: &str) -> bool {
    std::env::var(name).is_ok_and(|v| v == "1")
}

/// Seeded values, cheaply: a block of normals repeated (timing does not
/// depend on the values, only on their being finite and varied).
fn values(n: usize, rng: &mut Rng) -> Vec<f32> {
    let block = rng.normal_vec(n.min(1 << 20), 1.0);
    block.iter().copied().cycle().take(n).collect()
}

/// A step's host inputs and a cache of `batch` sequences of `len` tokens.
struct Case {
    batch: usize,
    len: usize,
    precision: Precision,
    cache: HostKvCache,
    table: Vec<i32>,
    max_pages: usize,
    lens: Vec<i32>,
    q: TensorData,
    k_new: TensorData,
    v_new: TensorData,
}

impl Case {
    fn new(batch: usize, len: usize, precision: Precision, rng: &mut Rng) -> Self {
        let max_pages = len.div_ceil(PAGE_SIZE);
        let pages = batch * max_pages;
        // Pages in a shuffled order, as a serving engine's free list leaves them.
        let mut table: Vec<i32> = (0..pages as i32).collect();
        for i in (1..table.len()).rev() {
            table.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        let layout = CacheLayout::Paged {
            pages,
            page_size: PAGE_SIZE,
        };
        let shape = CacheShape::new(layout, HEADS_KV, HEAD_DIM).expect("cache shape");
        let mut data = || TensorData::from_f32(values(shape.len(), rng), precision);
        let cache = HostKvCache::new(shape, data(), data()).expect("cache");
        let mut small = |n| TensorData::from_f32(rng.normal_vec(n, 1.0), precision);
        Self {
            batch,
            len,
            precision,
            cache,
            table,
            max_pages,
            lens: vec![len as i32 - 1; batch],
            q: small(batch * HEADS_Q * HEAD_DIM),
            k_new: small(batch * HEADS_KV * HEAD_DIM),
            v_new: small(batch * HEADS_KV * HEAD_DIM),
        }
    }

    fn step(&self) -> DecodeStep<'_> {
        let (b, d) = (self.batch, HEAD_DIM);
        DecodeStep::new(self.q.view([b, 1, HEADS_Q, d]), &self.lens)
            .block_table(&self.table, self.max_pages)
            .append(
                self.k_new.view([b, 1, HEADS_KV, d]),
                self.v_new.view([b, 1, HEADS_KV, d]),
            )
    }

    /// K and V bytes one step reads.
    fn bytes_read(&self) -> u64 {
        (2 * self.batch * self.len * HEADS_KV * HEAD_DIM * self.precision.bytes()) as u64
    }
}

/// What the summary prints for one case.
struct Row {
    id: String,
    splits: usize,
    call: f64,
    /// Submit-to-completion time of the kernels (wgpu only).
    kernels: Option<f64>,
    /// The planner's reasons for its splits (wgpu, planner cases).
    why: Option<String>,
}

fn decode(c: &mut Criterion) {
    // `cargo test --benches` runs each case once without `--bench`: keep it small.
    let testing = !std::env::args().any(|a| a == "--bench");
    let quick = flag("FLASHATTN_BENCH_QUICK") || testing;
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
    let (batches, mut lens): (&[usize], Vec<usize>) = if quick {
        (&[1], vec![1024])
    } else {
        (&[1, 8], vec![1024, 8192])
    };
    if flag("FLASHATTN_BENCH_DECODE_32K") {
        lens.push(32768);
    }
    let opts = AttentionOptions::default().causal(true);
    let splits_choices = [(None, "planner"), (Some(1), "1 split")];
    let mut rows = Vec::new();
    let mut rng = Rng::new(17);
    for &batch in batches {
        for precision in [Precision::F16, Precision::F32] {
            let mut group = c.benchmark_group(format!("decode/b{batch}/{precision}"));
            group
                .sample_size(10)
                .sampling_mode(SamplingMode::Flat)
                .warm_up_time(Duration::from_millis(200))
                .measurement_time(Duration::from_secs(1));
            for &len in &lens {
                let case = Case::new(batch, len, precision, &mut rng);
                group.throughput(Throughput::Bytes(case.bytes_read()));
                if let Some(e) = &engine {
                    match e.upload_kv_cache(&case.cache) {
                        Err(err) => eprintln!("skipping wgpu b{batch} {precision} {len}: {err}"),
                        Ok(mut cache) => {
                            for (splits, name) in splits_choices {
                                let step = case.step();
                                // Untimed: compiles the pipelines, and says how it splits.
                                let first = e
                                    .decode(&mut cache, &step, &opts, splits)
                                    .expect("wgpu decode");
                                let (mut calls, mut kernels, mut n) = (0.0, 0.0, 0usize);
                                let label = format!("wgpu/{name}");
                                let id = BenchmarkId::new(&label, len);
                                group.bench_function(id, |b| {
                                    b.iter_custom(|iters| {
                                        let start = Instant::now();
                                        for _ in 0..iters {
                                            let out = e
                                                .decode(&mut cache, &step, &opts, splits)
                                                .expect("wgpu decode");
                                            kernels += out.stats.kernel_seconds;
                                        }
                                        let t = start.elapsed();
                                        calls += t.as_secs_f64();
                                        n += iters as usize;
                                        t
                                    })
                                });
                                let problem = DecodeProblem::new(&step, cache.shape(), precision)
                                    .expect("decode problem");
                                let why = e
                                    .plan_decode(&problem, &opts, splits)
                                    .map_or_else(|err| err.to_string(), |p| p.reasons.join("; "));
                                rows.push(Row {
                                    id: format!("b{batch}/{precision}/{label}/{len}"),
                                    splits: first.num_splits,
                                    call: calls / n.max(1) as f64,
                                    kernels: Some(kernels / n.max(1) as f64),
                                    why: splits.is_none().then_some(why),
                                });
                            }
                        }
                    }
                }
                for (splits, name) in splits_choices {
                    let label = format!("cpu/{name}");
                    let id = BenchmarkId::new(&label, len);
                    let mut host = case.cache.clone();
                    let step = case.step();
                    let first = cpu::decode(&mut host, &step, &opts, splits).expect("cpu decode");
                    let (mut calls, mut n) = (0.0, 0usize);
                    group.bench_function(id, |b| {
                        b.iter_custom(|iters| {
                            let start = Instant::now();
                            for _ in 0..iters {
                                cpu::decode(&mut host, &step, &opts, splits).expect("cpu decode");
                            }
                            let t = start.elapsed();
                            calls += t.as_secs_f64();
                            n += iters as usize;
                            t
                        })
                    });
                    rows.push(Row {
                        id: format!("b{batch}/{precision}/{label}/{len}"),
                        splits: first.num_splits,
                        call: calls / n.max(1) as f64,
                        kernels: None,
                        why: None,
                    });
                }
            }
            group.finish();
        }
    }
    eprintln!(
        "\ndecode steps: the splits each ran with, the mean call, and the wgpu kernels' share"
    );
    eprintln!(
        "{:<40} {:>6} {:>10} {:>10}",
        "case", "splits", "call ms", "kernels ms"
    );
    for r in &rows {
        let kernels = r.kernels.map_or("-".into(), |k| format!("{:.3}", k * 1e3));
        eprintln!(
            "{:<40} {:>6} {:>10.3} {:>10}",
            r.id,
            r.splits,
            r.call * 1e3,
            kernels
        );
    }
    for r in rows.iter().filter(|r| r.why.is_some()) {
        eprintln!("{}: {}", r.id, r.why.as_deref().unwrap_or_default());
    }
}

criterion_group!(benches, decode);
criterion_main!(benches);

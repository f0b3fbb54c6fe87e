//! `flashattn bench`: the benchmark cases from the command line, side by side
//! in one run — flash vs naive WGSL vs CPU, the matmul ceiling, memory and
//! storage accesses — as a table, JSON, CSV and plots.

use super::args::BenchArgs;
use flashattn::bench::{self, BenchCase, BenchResult, Implementation, Pass};
use flashattn::{Engine, Error, PlanOverrides, Precision, Result};
use indicatif::{ProgressBar, ProgressStyle};
use serde::Serialize;
use std::collections::BTreeMap;

/// The matmul ceiling for one head dim.
#[derive(Clone, Debug, Serialize)]
pub struct Ceiling {
    pub head_dim: usize,
    pub n: usize,
    /// The matmul kernel that ran (`tiled`, or `lanes` on CPU adapters).
    pub kernel: String,
    pub gflops: f64,
}

/// One point of the workgroup-storage sweep (Theorem 2).
#[derive(Clone, Debug, Serialize)]
pub struct SweepPoint {
    pub m_bytes: u32,
    pub br: u32,
    pub bc: u32,
    pub reads: u64,
    pub writes: u64,
    pub seconds: f64,
}

/// Everything one `bench` run measured.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub adapter: String,
    pub ceilings: Vec<Ceiling>,
    pub results: Vec<BenchResult>,
    pub sweep_seqlen: usize,
    pub sweep_head_dim: usize,
    pub sweep: Vec<SweepPoint>,
    /// Storage accesses of the naive forward at the sweep's size (independent of M).
    pub sweep_naive_accesses: Option<u64>,
    /// The largest storage binding the adapter allows (where naive stops).
    pub max_binding_bytes: Option<u64>,
}

fn list<T: std::str::FromStr<Err = Error>>(s: &str) -> Result<Vec<T>> {
    s.split(',')
        .filter(|x| !x.is_empty())
        .map(|x| x.trim().parse())
        .collect()
}

fn sizes(what: &str, s: &str) -> Result<Vec<usize>> {
    s.split(',')
        .filter(|x| !x.is_empty())
        .map(|x| {
            x.trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| {
                    Error::Option(format!("--{what} expects positive integers, got `{x}`"))
                })
        })
        .collect()
}

pub fn run(a: BenchArgs) -> Result<()> {
    let passes: Vec<Pass> = list(&a.passes)?;
    let impls: Vec<Implementation> = list(&a.impls)?;
    let seqlens = sizes("seqlens", &a.seqlens)?;
    let dims = sizes("head-dims", &a.head_dims)?;
    let precision: Precision = a.precision.parse()?;
    let causal = match a.causal.as_str() {
        "no" | "false" => vec![false],
        "yes" | "true" => vec![true],
        "both" => vec![false, true],
        other => {
            return Err(Error::Option(format!(
                "--causal expects no, yes or both, got `{other}`"
            )))
        }
    };
    if let Some(p) = &a.plot {
        super::plot_path_ok(p)?;
    }
    let engine = match Engine::new() {
        Ok(e) => Some(e),
        Err(e) if impls.iter().all(|i| *i == Implementation::Cpu) => {
            eprintln!("flashattn: {e}; benchmarking the CPU backend only");
            None
        }
        Err(e) => return Err(e),
    };
    let adapter = engine
        .as_ref()
        .map_or("none (CPU only)".to_string(), |e| e.describe());
    let cases = bench::matrix(
        &passes, &impls, &seqlens, &dims, &causal, a.heads, a.batch, precision,
    );
    let sweep_steps = if a.sweep_m && engine.is_some() { 4 } else { 0 };
    let bar = ProgressBar::new((cases.len() + dims.len() + sweep_steps) as u64);
    bar.set_style(
        ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} [{elapsed}]")
            .map_err(|e| Error::Io(format!("progress bar: {e}")))?,
    );

    let mut ceilings = Vec::new();
    if let Some(e) = &engine {
        for &d in &dims {
            // The ceiling's C is N×N f32: stay within one storage binding.
            let max_n = ((e.max_binding() / 4) as f64).sqrt() as usize;
            let n = seqlens
                .iter()
                .copied()
                .max()
                .unwrap_or(1024)
                .clamp(256, 4096)
                .min(max_n);
            bar.set_message(format!("matmul ceiling, N {n}, d {d}"));
            let c = e.matmul_ceiling(n, d, a.repeats.max(1))?;
            ceilings.push(Ceiling {
                head_dim: d,
                n,
                kernel: c.kernel.to_string(),
                gflops: c.gflops(),
            });
            bar.inc(1);
        }
    }
    let mut results = Vec::new();
    for case in &cases {
        bar.set_message(label(case));
        results.push(bench::run(engine.as_ref(), case, a.repeats.max(1)));
        bar.inc(1);
    }
    let (sweep_seqlen, sweep_head_dim) = (a.sweep_seqlen, dims.first().copied().unwrap_or(64));
    let mut sweep = Vec::new();
    let mut sweep_naive_accesses = None;
    if let (true, Some(e)) = (a.sweep_m, &engine) {
        let case = BenchCase {
            pass: Pass::Forward,
            implementation: Implementation::Flash,
            batch: 1,
            heads: 1,
            seqlen: sweep_seqlen,
            head_dim: sweep_head_dim,
            causal: false,
            precision,
        };
        let inputs = bench::BenchInputs::new(&case)?;
        let [q, k, v, _] = inputs.views();
        let max_m = e.caps().max_workgroup_storage;
        for m in [max_m / 8, max_m / 4, max_m / 2, max_m] {
            bar.set_message(format!("M sweep, M = {m} bytes"));
            let o = PlanOverrides {
                max_workgroup_storage: Some(m),
                ..Default::default()
            };
            let out = e.forward_with(&q, &k, &v, &case.options(), &o)?;
            let plan = out
                .stats
                .plan
                .clone()
                .ok_or_else(|| Error::Plan("no plan recorded".into()))?;
            sweep.push(SweepPoint {
                m_bytes: m,
                br: plan.br,
                bc: plan.bc,
                reads: out.stats.accesses.reads,
                writes: out.stats.accesses.writes,
                seconds: out.stats.kernel_seconds,
            });
            bar.inc(1);
        }
        sweep_naive_accesses = e
            .naive_forward(&q, &k, &v, &case.options())
            .ok()
            .map(|n| n.stats.accesses.total());
    }
    bar.finish_and_clear();

    let report = Report {
        max_binding_bytes: engine.as_ref().map(|e| e.max_binding()),
        adapter,
        ceilings,
        results,
        sweep_seqlen,
        sweep_head_dim,
        sweep,
        sweep_naive_accesses,
    };
    print_table(&report);
    if let Some(path) = &a.json {
        let text =
            serde_json::to_string_pretty(&report).map_err(|e| Error::Io(format!("JSON: {e}")))?;
        super::write_text(path, &text)?;
    }
    if let Some(path) = &a.csv {
        super::write_text(path, &csv_text(&report)?)?;
    }
    if let Some(path) = &a.plot {
        for written in super::plots::write(&report, path)? {
            eprintln!("wrote {}", written.display());
        }
    }
    Ok(())
}

fn label(c: &BenchCase) -> String {
    format!(
        "{:?} {:?} N {} d {}{}",
        c.pass,
        c.implementation,
        c.seqlen,
        c.head_dim,
        if c.causal { " causal" } else { "" }
    )
}

fn ceiling_of(report: &Report, d: usize) -> Option<f64> {
    report
        .ceilings
        .iter()
        .find(|c| c.head_dim == d)
        .map(|c| c.gflops)
}

fn print_table(report: &Report) {
    println!("adapter: {}", report.adapter);
    for c in &report.ceilings {
        println!(
            "ceiling: {} matmul N×d · d×N, N {}, d {}: {:.2} GFLOP/s",
            c.kernel, c.n, c.head_dim, c.gflops
        );
    }
    println!(
        "\n{:<8} {:<6} {:<6} {:>6} {:>4} {:>10} {:>10} {:>8} {:>8} {:>10} {:>12}",
        "pass",
        "impl",
        "causal",
        "N",
        "d",
        "min ms",
        "median ms",
        "GFLOP/s",
        "ceiling",
        "peak MiB",
        "accesses M"
    );
    for r in &report.results {
        let c = &r.case;
        let head = format!(
            "{:<8} {:<6} {:<6} {:>6} {:>4}",
            format!("{:?}", c.pass).to_lowercase(),
            format!("{:?}", c.implementation).to_lowercase(),
            if c.causal { "yes" } else { "no" },
            c.seqlen,
            c.head_dim
        );
        match (&r.error, r.min_seconds(), r.median_seconds(), r.gflops()) {
            (None, Some(min), Some(med), Some(g)) => {
                let frac = ceiling_of(report, c.head_dim)
                    .filter(|_| c.implementation != Implementation::Cpu)
                    .map_or("-".to_string(), |x| format!("{:.0}%", 100.0 * g / x));
                let gpu = c.implementation != Implementation::Cpu;
                println!(
                    "{head} {:>10.1} {:>10.1} {:>8.2} {:>8} {:>10} {:>12}",
                    min * 1e3,
                    med * 1e3,
                    g,
                    frac,
                    if gpu {
                        format!("{:.1}", r.peak_bytes as f64 / (1 << 20) as f64)
                    } else {
                        "-".into()
                    },
                    if gpu {
                        format!("{:.2}", r.accesses().total() as f64 / 1e6)
                    } else {
                        "-".into()
                    },
                );
            }
            (Some(e), ..) => println!("{head}   FAILED: {e}"),
            _ => println!("{head}   no measurement"),
        }
    }
    // Ratios measured side by side: flash against each baseline.
    let mut by_key: BTreeMap<(String, usize, bool, usize), BTreeMap<String, f64>> = BTreeMap::new();
    for r in &report.results {
        if let Some(t) = r.min_seconds() {
            let c = &r.case;
            by_key
                .entry((
                    format!("{:?}", c.pass).to_lowercase(),
                    c.head_dim,
                    c.causal,
                    c.seqlen,
                ))
                .or_default()
                .insert(format!("{:?}", c.implementation).to_lowercase(), t);
        }
    }
    let lines: Vec<String> = by_key
        .iter()
        .filter_map(|((pass, d, causal, n), t)| {
            let flash = t.get("flash")?;
            let vs = |name: &str| t.get(name).map(|x| format!("{:.2}x vs {name}", x / flash));
            let parts: Vec<String> = ["naive", "cpu"].iter().filter_map(|n| vs(n)).collect();
            (!parts.is_empty()).then(|| {
                format!(
                    "  {pass} N {n} d {d}{}: flash {}",
                    if *causal { " causal" } else { "" },
                    parts.join(", ")
                )
            })
        })
        .collect();
    if !lines.is_empty() {
        println!("\nspeedup of flash (time of the other / time of flash, same run):");
        lines.iter().for_each(|l| println!("{l}"));
    }
    if !report.sweep.is_empty() {
        println!(
            "\nTheorem 2 sweep: flash forward, N {}, d {} — storage accesses vs workgroup storage M",
            report.sweep_seqlen, report.sweep_head_dim
        );
        println!(
            "{:>9} {:>4} {:>4} {:>14} {:>14} {:>10}",
            "M bytes", "Br", "Bc", "accesses", "accesses × M", "ms"
        );
        for p in &report.sweep {
            let a = p.reads + p.writes;
            println!(
                "{:>9} {:>4} {:>4} {:>14} {:>14.3e} {:>10.1}",
                p.m_bytes,
                p.br,
                p.bc,
                a,
                a as f64 * p.m_bytes as f64,
                p.seconds * 1e3
            );
        }
        if let (Some(naive), Some(last)) = (report.sweep_naive_accesses, report.sweep.last()) {
            println!(
                "naive forward: {naive} accesses ({:.2}x flash at the largest M)",
                naive as f64 / (last.reads + last.writes) as f64
            );
        }
    }
}

#[derive(Serialize)]
struct CsvRow<'a> {
    pass: &'a str,
    implementation: &'a str,
    causal: bool,
    batch: usize,
    heads: usize,
    seqlen: usize,
    head_dim: usize,
    precision: &'a str,
    min_ms: Option<f64>,
    median_ms: Option<f64>,
    gflops: Option<f64>,
    fraction_of_ceiling: Option<f64>,
    peak_bytes: u64,
    reads: u64,
    writes: u64,
    error: Option<&'a str>,
}

fn csv_text(report: &Report) -> Result<String> {
    let mut w = csv::Writer::from_writer(Vec::new());
    for r in &report.results {
        let c = &r.case;
        let (pass, imp) = (
            format!("{:?}", c.pass).to_lowercase(),
            format!("{:?}", c.implementation).to_lowercase(),
        );
        w.serialize(CsvRow {
            pass: &pass,
            implementation: &imp,
            causal: c.causal,
            batch: c.batch,
            heads: c.heads,
            seqlen: c.seqlen,
            head_dim: c.head_dim,
            precision: c.precision.name(),
            min_ms: r.min_seconds().map(|t| t * 1e3),
            median_ms: r.median_seconds().map(|t| t * 1e3),
            gflops: r.gflops(),
            fraction_of_ceiling: r
                .gflops()
                .zip(ceiling_of(report, c.head_dim))
                .map(|(g, x)| g / x),
            peak_bytes: r.peak_bytes,
            reads: r.reads,
            writes: r.writes,
            error: r.error.as_deref(),
        })
        .map_err(|e| Error::Io(format!("CSV: {e}")))?;
    }
    let bytes = w.into_inner().map_err(|e| Error::Io(format!("CSV: {e}")))?;
    String::from_utf8(bytes).map_err(|e| Error::Io(format!("CSV: {e}")))
}

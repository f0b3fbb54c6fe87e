//! What one `flashattn bench` run measured, and its table and CSV: flash
//! against naive WGSL and the CPU side by side, the matmul ceiling, memory,
//! storage accesses and the workgroup-storage sweep.

use crate::bench::BenchResult;
use crate::error::{CliError, Result};
use serde::Serialize;
use std::collections::BTreeMap;

/// A matmul ceiling for one head dim.
#[derive(Clone, Debug, Serialize)]
pub struct Ceiling {
    /// `scores` (N×d · d×N: on GPUs bound by storing N² outputs) or
    /// `values` (N×N · N×d: deep, its cost in the multiply-adds).
    pub shape: &'static str,
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
    /// How the wgpu rows' kernel times were taken.
    pub timing: String,
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

/// The ceiling of head dim `d`: the faster of its matmuls (equal FLOPs),
/// so flash's fraction of it (the column "ceiling") is never flattered by
/// a slow shape.
fn ceiling_of(report: &Report, d: usize) -> Option<f64> {
    report
        .ceilings
        .iter()
        .filter(|c| c.head_dim == d)
        .map(|c| c.gflops)
        .reduce(f64::max)
}

/// [`Ceiling::shape`] of the P·V product.
pub const VALUES: &str = "values";

impl Report {
    /// The whole report on stdout: ceilings, one row per case, speedups,
    /// and the sweep.
    pub fn print(&self) {
        println!("adapter: {}", self.adapter);
        println!("kernel times: {}; CPU rows: wall clock", self.timing);
        println!("ceiling column: flash's GFLOP/s over the faster matmul of its head dim");
        for c in &self.ceilings {
            let dims = if c.shape == VALUES {
                "N×N · N×d (O = PV)"
            } else {
                "N×d · d×N (S = QKᵀ)"
            };
            println!(
                "ceiling: {} matmul {dims}, N {}, d {}: {:.2} GFLOP/s",
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
        self.results
            .iter()
            .for_each(|r| println!("{}", self.row(r)));
        self.print_speedups();
        self.print_cpu_ratios();
        self.print_dropout_costs();
        self.print_sweep();
    }

    /// The results without dropout: what the other sections compare.
    fn undropped(&self) -> impl Iterator<Item = &BenchResult> {
        self.results.iter().filter(|r| r.case.dropout == 0.0)
    }

    /// Each case with dropout against the same case without, measured in
    /// the same run (time with / time without).
    fn print_dropout_costs(&self) {
        let lines: Vec<String> = self
            .results
            .iter()
            .filter(|r| r.case.dropout > 0.0)
            .filter_map(|r| {
                let c = &r.case;
                let plain = self.undropped().find(|o| {
                    let k = &o.case;
                    (k.pass, k.implementation, k.head_dim, k.causal, k.seqlen)
                        == (c.pass, c.implementation, c.head_dim, c.causal, c.seqlen)
                })?;
                let (with, without) = (r.median_seconds()?, plain.median_seconds()?);
                Some(format!(
                    "  {} {} N {} d {}{}: dropout {} {:.1} ms / none {:.1} ms = {:.2}x",
                    c.pass.name(),
                    c.implementation.name(),
                    c.seqlen,
                    c.head_dim,
                    if c.causal { " causal" } else { "" },
                    c.dropout,
                    with * 1e3,
                    without * 1e3,
                    with / without
                ))
            })
            .collect();
        if !lines.is_empty() {
            println!(
                "
dropout's cost (median time with / without, same run):"
            );
            lines.iter().for_each(|l| println!("{l}"));
        }
    }

    /// One case's table row.
    fn row(&self, r: &BenchResult) -> String {
        let c = &r.case;
        let head = format!(
            "{:<8} {:<6} {:<6} {:>6} {:>4}",
            c.pass.name(),
            c.implementation.name(),
            if c.causal { "yes" } else { "no" },
            c.seqlen,
            c.head_dim
        );
        let tail = if c.dropout > 0.0 {
            format!("  dropout {}", c.dropout)
        } else {
            String::new()
        };
        format!("{}{tail}", self.row_values(r, head))
    }

    fn row_values(&self, r: &BenchResult, head: String) -> String {
        let c = &r.case;
        let (Some(min), Some(med), Some(g)) = (r.min_seconds(), r.median_seconds(), r.gflops())
        else {
            return match &r.error {
                Some(e) => format!("{head}   FAILED: {e}"),
                None => format!("{head}   no measurement"),
            };
        };
        let gpu = c.implementation.on_gpu();
        let on_gpu = |text: String| if gpu { text } else { "-".into() };
        let frac = ceiling_of(self, c.head_dim)
            .filter(|_| gpu)
            .map_or("-".to_string(), |x| format!("{:.0}%", 100.0 * g / x));
        format!(
            "{head} {:>10.1} {:>10.1} {:>8.2} {:>8} {:>10} {:>12}",
            min * 1e3,
            med * 1e3,
            g,
            frac,
            on_gpu(format!("{:.1}", r.peak_bytes as f64 / (1 << 20) as f64)),
            on_gpu(format!("{:.2}", r.accesses().total() as f64 / 1e6)),
        )
    }

    /// Ratios measured side by side: flash against each baseline.
    fn print_speedups(&self) {
        type Key = (&'static str, usize, bool, usize);
        let mut by_key: BTreeMap<Key, BTreeMap<&'static str, f64>> = BTreeMap::new();
        for r in self.undropped() {
            if let Some(t) = r.min_seconds() {
                let c = &r.case;
                by_key
                    .entry((c.pass.name(), c.head_dim, c.causal, c.seqlen))
                    .or_default()
                    .insert(c.implementation.name(), t);
            }
        }
        let lines: Vec<String> = by_key
            .iter()
            .filter_map(|((pass, d, causal, n), t)| {
                let flash = t.get("flash")?;
                let vs = |name: &str| t.get(name).map(|x| format!("{:.2}x vs {name}", x / flash));
                let parts: Vec<String> = ["naive", "cpu"].iter().filter_map(|n| vs(n)).collect();
                let causal = if *causal { " causal" } else { "" };
                (!parts.is_empty())
                    .then(|| format!("  {pass} N {n} d {d}{causal}: flash {}", parts.join(", ")))
            })
            .collect();
        if !lines.is_empty() {
            println!("\nspeedup of flash (time of the other / time of flash, same run):");
            lines.iter().for_each(|l| println!("{l}"));
        }
    }

    /// The CPU backend against the outside baselines and the adapter's
    /// kernels, as throughput ratios (time of the other / time of cpu), and
    /// its causal time against the non-causal one.
    fn print_cpu_ratios(&self) {
        let t = |pass: &str, i: &str, d: usize, causal: bool, n: usize| {
            self.undropped()
                .find(|r| {
                    let c = &r.case;
                    (
                        c.pass.name(),
                        c.implementation.name(),
                        c.head_dim,
                        c.causal,
                        c.seqlen,
                    ) == (pass, i, d, causal, n)
                })
                .and_then(|r| r.min_seconds())
        };
        let mut keys: Vec<(usize, bool, usize)> = self
            .results
            .iter()
            .map(|r| (r.case.head_dim, r.case.causal, r.case.seqlen))
            .collect();
        keys.dedup();
        keys.sort();
        keys.dedup();
        let others = ["torch", "numpy", "flash", "tiled", "registers"];
        let mut lines = Vec::new();
        for &(d, causal, n) in &keys {
            let both =
                |i: &str| Some(t("forward", i, d, causal, n)? + t("backward", i, d, causal, n)?);
            let ratios = |cpu: Option<f64>, of: &dyn Fn(&str) -> Option<f64>| -> Vec<String> {
                let Some(cpu) = cpu else { return Vec::new() };
                let r = others
                    .iter()
                    .filter_map(|o| Some(format!("{:.2}x {o}", of(o)? / cpu)));
                let mut v = vec![format!("cpu {:.1} ms", cpu * 1e3)];
                v.extend(r);
                v
            };
            let tag = format!("N {n} d {d}{}", if causal { " causal" } else { "" });
            let f = ratios(t("forward", "cpu", d, causal, n), &|o| {
                t("forward", o, d, causal, n)
            });
            if f.len() > 1 {
                lines.push(format!("  forward {tag}: {}", f.join(", ")));
            }
            let fb = ratios(both("cpu"), &|o| both(o));
            if fb.len() > 1 {
                lines.push(format!("  forward+backward {tag}: {}", fb.join(", ")));
            }
            if let (true, Some(c), Some(nc)) = (
                causal,
                t("forward", "cpu", d, true, n),
                t("forward", "cpu", d, false, n),
            ) {
                lines.push(format!(
                    "  forward {tag}: cpu causal / non-causal time {:.2}",
                    c / nc
                ));
            }
        }
        let notes: Vec<&str> = self
            .results
            .iter()
            .filter_map(|r| r.note.as_deref())
            .collect();
        if !lines.is_empty() {
            let mut seen = notes.clone();
            seen.sort();
            seen.dedup();
            println!(
                "\nCPU backend throughput as a multiple of each other's (time of the other / time of cpu, same run){}:",
                if seen.is_empty() { String::new() } else { format!("; {}", seen.join(", ")) }
            );
            lines.iter().for_each(|l| println!("{l}"));
        }
    }

    /// Storage accesses against workgroup storage M (Theorem 2).
    fn print_sweep(&self) {
        if self.sweep.is_empty() {
            return;
        }
        println!(
            "\nTheorem 2 sweep: flash forward, N {}, d {} — storage accesses vs workgroup storage M",
            self.sweep_seqlen, self.sweep_head_dim
        );
        println!(
            "{:>9} {:>4} {:>4} {:>14} {:>14} {:>10}",
            "M bytes", "Br", "Bc", "accesses", "accesses × M", "ms"
        );
        for p in &self.sweep {
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
        if let (Some(naive), Some(last)) = (self.sweep_naive_accesses, self.sweep.last()) {
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
    dropout: f32,
    min_ms: Option<f64>,
    median_ms: Option<f64>,
    gflops: Option<f64>,
    fraction_of_ceiling: Option<f64>,
    peak_bytes: u64,
    reads: u64,
    writes: u64,
    error: Option<&'a str>,
}

/// The results table as CSV.
pub fn csv_text(report: &Report) -> Result<String> {
    let mut w = csv::Writer::from_writer(Vec::new());
    for r in &report.results {
        let c = &r.case;
        w.serialize(CsvRow {
            pass: c.pass.name(),
            implementation: c.implementation.name(),
            causal: c.causal,
            batch: c.batch,
            heads: c.heads,
            seqlen: c.seqlen,
            head_dim: c.head_dim,
            precision: c.precision.name(),
            dropout: c.dropout,
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
        })?;
    }
    let bytes = w
        .into_inner()
        .map_err(|e| CliError::Csv(e.into_error().into()))?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

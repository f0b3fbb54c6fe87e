//! `flashattn tune`: the planner's candidate plans timed on this adapter
//! for each (pass, seqlen, head dim, precision) asked, the fastest cached
//! for forward and backward calls (`Engine::with_tuned_plans`); a table per
//! problem, and JSON with every time.

use super::bench::{list, sizes};
use super::write_text;
use crate::args::TuneArgs;
use crate::error::{CliError, Result};
use flashattn::{AttentionShape, Engine, Pass, Precision, TuneCache, TuneReport, TuneRequest};
use serde::Serialize;
use std::path::PathBuf;

/// Every problem tuned in one run, for `--json`.
#[derive(Debug, Serialize)]
struct Run {
    adapter: String,
    timer: String,
    cache: Option<PathBuf>,
    problems: Vec<Problem>,
}

#[derive(Debug, Serialize)]
struct Problem {
    pass: &'static str,
    seqlen: usize,
    head_dim: usize,
    precision: String,
    causal: bool,
    heads: usize,
    batch: usize,
    key: String,
    winner: String,
    candidates: Vec<Row>,
}

#[derive(Debug, Serialize)]
struct Row {
    label: String,
    kernel: &'static str,
    br: u32,
    bc: u32,
    threads_per_row: u32,
    workgroup_size: u32,
    workgroup_bytes: u32,
    /// `null` where the candidate failed.
    ms: Option<f64>,
    fastest: bool,
    error: Option<String>,
}

/// The passes `--pass` names.
fn passes(s: &str) -> Result<Vec<Pass>> {
    match s {
        "both" => Ok(vec![Pass::Forward, Pass::Backward]),
        one => one.parse().map(|p| vec![p]).map_err(|_| CliError::BadFlag {
            flag: "--pass",
            expected: "forward, backward or both",
            value: s.to_string(),
        }),
    }
}

/// The cache `--cache-dir` (or the environment) names.
fn cache_of(dir: &Option<PathBuf>) -> Option<TuneCache> {
    dir.as_deref()
        .map(TuneCache::in_dir)
        .or_else(TuneCache::default_location)
}

pub fn run(a: TuneArgs) -> Result<()> {
    if a.backend != "wgpu" {
        return Err(CliError::BadFlag {
            flag: "--backend",
            expected: "wgpu (the only backend with candidate plans to tune)",
            value: a.backend,
        });
    }
    crate::outputs::check(&crate::outputs::given(&[("--json", a.json.as_ref())]))?;
    // The winners are written as each problem is timed: a cache directory
    // that is a file would fail only after the first timing.
    if let Some(dir) = &a.cache_dir {
        if std::fs::metadata(dir).is_ok_and(|m| !m.is_dir()) {
            return Err(CliError::BadFlag {
                flag: "--cache-dir",
                expected: "a directory (created if missing)",
                value: dir.display().to_string(),
            });
        }
    }
    let seqlens = sizes("--seqlens", &a.seqlens)?;
    let dims = sizes("--head-dim", &a.head_dim)?;
    let precisions: Vec<Precision> = list(&a.precision)?;
    let passes = passes(&a.pass)?;
    if a.repeats == 0 {
        return Err(CliError::BadFlag {
            flag: "--repeats",
            expected: "at least 1",
            value: "0".into(),
        });
    }
    // Every shape is checked before anything is timed.
    let mut problems = Vec::new();
    for (&n, &d) in seqlens
        .iter()
        .flat_map(|n| dims.iter().map(move |d| (n, d)))
    {
        let shape = AttentionShape::new(a.batch, n, n, a.heads, a.heads, d)?;
        for &precision in &precisions {
            problems.extend(passes.iter().map(|&pass| (pass, shape, precision)));
        }
    }
    let cache = cache_of(&a.cache_dir);
    let engine = Engine::new()?;
    println!("adapter: {}", engine.describe());
    println!("timer: {}", engine.timing().describe());
    let mut out = Vec::new();
    for (pass, shape, precision) in problems {
        let req = TuneRequest::new(pass, shape, precision)
            .causal(a.causal)
            .repeats(a.repeats)
            .cache(cache.clone());
        let report = engine.tune(&req)?;
        print_table(&req, &report);
        out.push(problem(&req, &report));
    }
    match &cache {
        Some(c) => println!("\ncached in {}", c.path().display()),
        None => println!(
            "\nnot cached: no cache directory (give --cache-dir or set FLASHATTN_CACHE_DIR)"
        ),
    }
    if let Some(path) = &a.json {
        let run = Run {
            adapter: engine.describe(),
            timer: engine.timing().describe().into(),
            cache: cache.map(|c| c.path().to_path_buf()),
            problems: out,
        };
        write_text(path, &serde_json::to_string_pretty(&run)?)?;
    }
    Ok(())
}

fn mask_name(causal: bool) -> &'static str {
    if causal {
        "causal"
    } else {
        "no mask"
    }
}

/// One problem's candidates, the fastest marked.
fn print_table(req: &TuneRequest, r: &TuneReport) {
    let s = &req.shape;
    println!(
        "\n{}, N {}, d {}, {}, {} heads × batch {}, {}:",
        req.pass.name(),
        s.seqlen_q,
        s.head_dim,
        req.precision,
        s.heads_q,
        s.batch,
        mask_name(req.causal)
    );
    println!(
        "  {:<16} {:>9} {:>15} {:>7} {:>11}",
        "candidate", "Br×Bc", "invocations/row", "kernel", "time (ms)"
    );
    for (i, c) in r.candidates.iter().enumerate() {
        let p = &c.plan;
        let mark = match &c.error {
            Some(e) => format!("  failed: {e}"),
            None if i == r.winner => "  <- fastest".into(),
            None => String::new(),
        };
        let time = match c.error {
            Some(_) => "-".into(),
            None => format!("{:.3}", c.seconds * 1e3),
        };
        println!(
            "  {:<16} {:>9} {:>15} {:>7} {:>11}{mark}",
            c.label,
            format!("{}×{}", p.br, p.bc),
            p.threads_per_row,
            p.kernel.name(),
            time
        );
    }
    let (w, formula) = (r.winner(), &r.candidates[0]);
    if r.winner == 0 {
        println!("  winner: the formula plan");
    } else {
        let speedup = formula.seconds / w.seconds.max(f64::MIN_POSITIVE);
        println!(
            "  winner: {}, {speedup:.2}x faster than the formula plan",
            w.label
        );
    }
}

fn problem(req: &TuneRequest, r: &TuneReport) -> Problem {
    let rows = r
        .candidates
        .iter()
        .enumerate()
        .map(|(i, c)| Row {
            label: c.label.clone(),
            kernel: c.plan.kernel.name(),
            br: c.plan.br,
            bc: c.plan.bc,
            threads_per_row: c.plan.threads_per_row,
            workgroup_size: c.plan.workgroup_size,
            workgroup_bytes: c.plan.workgroup_bytes,
            ms: c.error.is_none().then_some(c.seconds * 1e3),
            fastest: i == r.winner,
            error: c.error.clone(),
        })
        .collect();
    Problem {
        pass: req.pass.name(),
        seqlen: req.shape.seqlen_q,
        head_dim: req.shape.head_dim,
        precision: req.precision.to_string(),
        causal: req.causal,
        heads: req.shape.heads_q,
        batch: req.shape.batch,
        key: r.key.to_string(),
        winner: r.winner().label.clone(),
        candidates: rows,
    }
}

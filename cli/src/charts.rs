//! The pictures of `flashattn bench --plot FILE.svg|png`: three charts next to
//! FILE — `-time` (time vs N), `-memory` (peak storage vs N, flash vs naive,
//! including what naive would need where it fails) and `-accesses` (storage
//! accesses vs workgroup storage M, Theorem 2).

use crate::bench::{Implementation, Pass};
use crate::error::{CliError, Result};
use crate::plot::{render, Chart, Series};
use crate::report::Report;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// `dir/stem-suffix.ext` for `dir/stem.ext`.
pub fn sibling(path: &Path, suffix: &str) -> Result<PathBuf> {
    let stem = path
        .file_stem()
        .and_then(|s| s.to_str())
        .ok_or_else(|| CliError::PlotName {
            path: path.to_path_buf(),
        })?;
    let ext = path.extension().and_then(|s| s.to_str()).unwrap_or("");
    Ok(path.with_file_name(format!("{stem}-{suffix}.{ext}")))
}

fn name(pass: Pass, imp: Implementation, d: usize, causal: bool) -> String {
    format!(
        "{} {} d{d}{}",
        imp.name(),
        pass.name(),
        if causal { " causal" } else { "" }
    )
}

/// Write the three charts; returns the paths written.
pub fn write(report: &Report, path: &Path) -> Result<Vec<PathBuf>> {
    let charts = [
        ("time", time_chart(report)),
        ("memory", memory_chart(report)),
        ("accesses", accesses_chart(report)),
    ];
    let mut written = Vec::new();
    for (suffix, chart) in charts {
        if let Some(chart) = chart {
            let out = sibling(path, suffix)?;
            render(&chart, &out)?;
            written.push(out);
        }
    }
    Ok(written)
}

type Lines = BTreeMap<String, Vec<(f64, f64)>>;

fn series(m: Lines) -> Vec<Series> {
    m.into_iter().map(|(n, p)| Series::new(n, p)).collect()
}

fn mib(bytes: u64) -> f64 {
    bytes as f64 / (1u64 << 20) as f64
}

/// Median time against N, one line per implementation and case.
fn time_chart(report: &Report) -> Option<Chart> {
    let mut time = Lines::new();
    for r in &report.results {
        let c = &r.case;
        if let Some(t) = r.median_seconds() {
            let key = name(c.pass, c.implementation, c.head_dim, c.causal);
            time.entry(key)
                .or_default()
                .push((c.seqlen as f64, t * 1e3));
        }
    }
    (!time.is_empty()).then(|| Chart {
        // The adapter's name only: the full description overflows the title.
        title: format!(
            "Attention time vs N — {}",
            report.adapter.split(" (").next().unwrap_or(&report.adapter)
        ),
        x_label: "sequence length N".into(),
        y_label: "median time (ms)".into(),
        log_x: true,
        log_y: true,
        series: series(time),
    })
}

/// Peak storage against N: flash as measured; naive as it needs (measured
/// where it ran, computed where it could not); the binding limit.
fn memory_chart(report: &Report) -> Option<Chart> {
    let mut memory = Lines::new();
    for r in &report.results {
        let c = &r.case;
        let key = name(c.pass, c.implementation, c.head_dim, c.causal);
        let point = match c.implementation {
            Implementation::Flash if r.error.is_none() => (key, mib(r.peak_bytes)),
            Implementation::Naive => (format!("{key} (needed)"), mib(c.naive_bytes())),
            _ => continue,
        };
        memory
            .entry(point.0)
            .or_default()
            .push((c.seqlen as f64, point.1));
    }
    if memory.is_empty() {
        return None;
    }
    if let Some(limit) = report.max_binding_bytes {
        // Naive's S alone must fit one binding: the line it crosses where it fails.
        let xs = report.results.iter().map(|r| r.case.seqlen as f64);
        let (lo, hi) = xs.fold((f64::MAX, 0f64), |(a, b), x| (a.min(x), b.max(x)));
        let line = vec![(lo, mib(limit)), (hi, mib(limit))];
        memory.insert("one storage binding (adapter limit)".into(), line);
    }
    Some(Chart {
        title: "Peak storage-buffer memory vs N: flash is linear, naive quadratic".into(),
        x_label: "sequence length N".into(),
        y_label: "MiB of storage buffers".into(),
        log_x: true,
        log_y: true,
        series: series(memory),
    })
}

/// Storage accesses against workgroup storage M (Theorem 2).
fn accesses_chart(report: &Report) -> Option<Chart> {
    if report.sweep.is_empty() {
        return None;
    }
    let at = |y: &dyn Fn(&crate::report::SweepPoint) -> f64| -> Vec<(f64, f64)> {
        report
            .sweep
            .iter()
            .map(|p| (p.m_bytes as f64 / 1024.0, y(p)))
            .collect()
    };
    let mut s = vec![Series::new(
        "flash forward (analytic = counted)",
        at(&|p| (p.reads + p.writes) as f64),
    )];
    if let Some(n) = report.sweep_naive_accesses {
        s.push(Series::new("naive forward", at(&|_| n as f64)));
    }
    Some(Chart {
        title: format!(
            "Storage accesses vs workgroup storage M (N {}, d {}): flash falls like 1/M",
            report.sweep_seqlen, report.sweep_head_dim
        ),
        x_label: "M (KiB of workgroup storage)".into(),
        y_label: "elements read + written".into(),
        log_x: true,
        log_y: true,
        series: s,
    })
}

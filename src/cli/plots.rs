//! The pictures of `flashattn bench --plot FILE.svg|png`: three charts next to
//! FILE — `-time` (time vs N), `-memory` (peak storage vs N, flash vs naive,
//! including what naive would need where it fails) and `-accesses` (storage
//! accesses vs workgroup storage M, Theorem 2).

use super::bench::Report;
use flashattn::bench::{Implementation, Pass};
use flashattn::plot::{render, Chart, Series};
use flashattn::{Error, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// `dir/stem-suffix.ext` for `dir/stem.ext`.
pub fn sibling(path: &Path, suffix: &str) -> Result<PathBuf> {
    let stem = path.file_stem().and_then(|s| s.to_str()).ok_or_else(|| {
        Error::Option(format!("--plot needs a file name, got {}", path.display()))
    })?;
    let ext = path.extension().and_then(|s| s.to_str()).unwrap_or("");
    Ok(path.with_file_name(format!("{stem}-{suffix}.{ext}")))
}

fn name(pass: Pass, imp: Implementation, d: usize, causal: bool) -> String {
    format!(
        "{} {} d{d}{}",
        format!("{imp:?}").to_lowercase(),
        format!("{pass:?}").to_lowercase(),
        if causal { " causal" } else { "" }
    )
}

/// Write the three charts; returns the paths written.
pub fn write(report: &Report, path: &Path) -> Result<Vec<PathBuf>> {
    let mut written = Vec::new();
    let mut time: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    let mut memory: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for r in &report.results {
        let c = &r.case;
        let key = name(c.pass, c.implementation, c.head_dim, c.causal);
        if let Some(t) = r.median_seconds() {
            time.entry(key.clone())
                .or_default()
                .push((c.seqlen as f64, t * 1e3));
        }
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        match c.implementation {
            Implementation::Flash if r.error.is_none() => {
                memory
                    .entry(key)
                    .or_default()
                    .push((c.seqlen as f64, mib(r.peak_bytes)));
            }
            Implementation::Naive => {
                // What naive allocates, measured where it ran and computed where it could not.
                let label = format!("{key} (needed)");
                memory
                    .entry(label)
                    .or_default()
                    .push((c.seqlen as f64, mib(c.naive_bytes())));
            }
            _ => {}
        }
    }
    let series = |m: BTreeMap<String, Vec<(f64, f64)>>| -> Vec<Series> {
        m.into_iter().map(|(n, p)| Series::new(n, p)).collect()
    };
    if !time.is_empty() {
        let out = sibling(path, "time")?;
        render(
            &Chart {
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
            },
            &out,
        )?;
        written.push(out);
    }
    if let (Some(limit), false) = (report.max_binding_bytes, memory.is_empty()) {
        // Naive's S alone must fit one binding: the line it crosses where it fails.
        let xs: Vec<f64> = report
            .results
            .iter()
            .map(|r| r.case.seqlen as f64)
            .collect();
        let (lo, hi) = xs
            .iter()
            .fold((f64::MAX, 0f64), |(a, b), &x| (a.min(x), b.max(x)));
        let mib = limit as f64 / (1u64 << 20) as f64;
        memory.insert(
            "one storage binding (adapter limit)".into(),
            vec![(lo, mib), (hi, mib)],
        );
    }
    if !memory.is_empty() {
        let out = sibling(path, "memory")?;
        render(
            &Chart {
                title: "Peak storage-buffer memory vs N: flash is linear, naive quadratic".into(),
                x_label: "sequence length N".into(),
                y_label: "MiB of storage buffers".into(),
                log_x: true,
                log_y: true,
                series: series(memory),
            },
            &out,
        )?;
        written.push(out);
    }
    if !report.sweep.is_empty() {
        let out = sibling(path, "accesses")?;
        let flash: Vec<(f64, f64)> = report
            .sweep
            .iter()
            .map(|p| (p.m_bytes as f64 / 1024.0, (p.reads + p.writes) as f64))
            .collect();
        let mut s = vec![Series::new("flash forward (analytic = counted)", flash)];
        if let Some(n) = report.sweep_naive_accesses {
            let xs: Vec<(f64, f64)> = report
                .sweep
                .iter()
                .map(|p| (p.m_bytes as f64 / 1024.0, n as f64))
                .collect();
            s.push(Series::new("naive forward", xs));
        }
        render(
            &Chart {
                title: format!(
                    "Storage accesses vs workgroup storage M (N {}, d {}): flash falls like 1/M",
                    report.sweep_seqlen, report.sweep_head_dim
                ),
                x_label: "M (KiB of workgroup storage)".into(),
                y_label: "elements read + written".into(),
                log_x: true,
                log_y: true,
                series: s,
            },
            &out,
        )?;
        written.push(out);
    }
    Ok(written)
}

//! `flashattn bench`: the benchmark cases from the command line, side by side
//! in one run — flash vs naive WGSL vs CPU, the matmul ceiling, memory and
//! storage accesses — as a table, JSON, CSV and plots; with `--decode`,
//! decoding steps against KV caches next to the copy bandwidth.

use super::{plot_path_ok, write_text};
use crate::args::BenchArgs;
use crate::args::DecodeBenchArgs;
use crate::baselines::Baselines;
use crate::bench::{self, BenchCase, BenchInputs, Implementation, Matrix, Pass};
use crate::charts;
use crate::decode_bench::{
    self as db, CopyBandwidth, DecodeBackend, DecodeReport, DecodeSet, SplitMode,
};
use crate::error::{CliError, Result};
use crate::layout_bench::{self as lb, LayoutConfig};
use crate::report::{self, csv_text, Ceiling, Report, SweepPoint};
use flashattn::{CeilingShape, Engine, ForwardInputs, PlanOverrides, Precision};
use indicatif::{ProgressBar, ProgressStyle};

/// Comma-separated values of one flag. A list with no value (`""`, `","`)
/// is the value type's own error for an empty name: a flag given with
/// nothing in it asks for nothing to run, which is a mistake, not a no-op.
pub(crate) fn list<T: std::str::FromStr>(s: &str) -> std::result::Result<Vec<T>, T::Err> {
    let items: Vec<&str> = s.split(',').filter(|x| !x.is_empty()).collect();
    if items.is_empty() {
        return "".parse().map(|x| vec![x]);
    }
    items.into_iter().map(|x| x.trim().parse()).collect()
}

/// What the report says of how its wgpu rows were timed.
fn timing_of(engine: Option<&Engine>) -> String {
    engine.map_or("no adapter".into(), |e| e.timing().describe().into())
}

/// Comma-separated positive integers of `flag`, at least one.
pub(crate) fn sizes(flag: &'static str, s: &str) -> Result<Vec<usize>> {
    let bad = |x: &str| CliError::BadFlag {
        flag,
        expected: "positive integers",
        value: x.to_string(),
    };
    let sizes = s
        .split(',')
        .filter(|x| !x.is_empty())
        .map(|x| {
            x.trim()
                .parse::<usize>()
                .ok()
                .filter(|&n| n > 0)
                .ok_or_else(|| bad(x))
        })
        .collect::<Result<Vec<usize>>>()?;
    if sizes.is_empty() {
        return Err(bad(s));
    }
    Ok(sizes)
}

/// A count flag that must be at least 1 (`--heads`, `--batch`).
fn positive(flag: &'static str, n: usize) -> Result<usize> {
    match n {
        0 => Err(CliError::BadFlag {
            flag,
            expected: "a positive integer",
            value: n.to_string(),
        }),
        n => Ok(n),
    }
}

/// The case matrix the flags ask for.
fn matrix(a: &BenchArgs) -> Result<Matrix> {
    let causal = match a.causal.as_str() {
        "no" | "false" => vec![false],
        "yes" | "true" => vec![true],
        "both" => vec![false, true],
        other => {
            return Err(CliError::BadFlag {
                flag: "--causal",
                expected: "no, yes or both",
                value: other.to_string(),
            })
        }
    };
    let bad_dropouts = || CliError::BadFlag {
        flag: "--dropouts",
        expected: "probabilities in [0, 1), comma-separated",
        value: a.dropouts.clone(),
    };
    let dropouts: Vec<f32> = list(&a.dropouts).map_err(|_| bad_dropouts())?;
    if dropouts.is_empty() || dropouts.iter().any(|p| !(0.0..1.0).contains(p)) {
        return Err(bad_dropouts());
    }
    Ok(Matrix {
        passes: list(&a.passes)?,
        implementations: list(&a.impls)?,
        seqlens: sizes("--seqlens", &a.seqlens)?,
        head_dims: sizes("--head-dims", &a.head_dims)?,
        causal,
        dropouts,
        heads: positive("--heads", a.heads)?,
        batch: positive("--batch", a.batch)?,
        precision: a.precision.parse::<Precision>()?,
    })
}

pub fn run(a: BenchArgs) -> Result<()> {
    // Where the report goes is checked before a run that may take minutes.
    crate::outputs::check(&crate::outputs::given(&[
        ("--json", a.json.as_ref()),
        ("--csv", a.csv.as_ref()),
        ("--plot", a.plot.as_ref()),
    ]))?;
    // As tune: a run of no timed repeats has nothing to report.
    if a.repeats == 0 {
        return Err(CliError::BadFlag {
            flag: "--repeats",
            expected: "at least 1",
            value: "0".into(),
        });
    }
    if a.decode.on {
        return decode(&a);
    }
    if a.sparse || a.varlen {
        return layouts(&a);
    }
    let m = matrix(&a)?;
    if let Some(p) = &a.plot {
        plot_path_ok(p)?;
    }
    let engine = match Engine::new() {
        Ok(e) => Some(e),
        Err(e) if m.implementations.iter().all(|i| !i.on_gpu()) => {
            eprintln!("flashattn: {e}; benchmarking the CPU backend only");
            None
        }
        Err(e) => return Err(e.into()),
    };
    let cases = m.cases();
    let sweep_steps = if a.sweep_m && engine.is_some() { 4 } else { 0 };
    let bar = ProgressBar::new((cases.len() + m.head_dims.len() + sweep_steps) as u64);
    bar.set_style(ProgressStyle::with_template(
        "{bar:30} {pos}/{len} {msg} [{elapsed}]",
    )?);
    let repeats = a.repeats.max(1);
    let ceilings = match &engine {
        Some(e) => ceilings(e, &m, repeats, &bar)?,
        None => Vec::new(),
    };
    let outside = m.implementations.iter().any(|i| i.outside());
    let baselines = outside.then(|| Baselines::new(&a.python)).transpose()?;
    let mut results = Vec::new();
    for case in &cases {
        bar.set_message(case.label());
        results.push(match &baselines {
            Some(b) if case.implementation.outside() => b.run(case, repeats),
            _ => bench::run(engine.as_ref(), case, repeats),
        });
        bar.inc(1);
    }
    let sweep_head_dim = m.head_dims.first().copied().unwrap_or(64);
    let (sweep, sweep_naive_accesses) = match (&engine, a.sweep_m) {
        (Some(e), true) => sweep(e, a.sweep_seqlen, sweep_head_dim, m.precision, &bar)?,
        _ => (Vec::new(), None),
    };
    bar.finish_and_clear();
    let report = Report {
        max_binding_bytes: engine.as_ref().map(|e| e.max_binding()),
        adapter: engine
            .as_ref()
            .map_or("none (CPU only)".into(), |e| e.describe()),
        timing: timing_of(engine.as_ref()),
        ceilings,
        results,
        sweep_seqlen: a.sweep_seqlen,
        sweep_head_dim,
        sweep,
        sweep_naive_accesses,
    };
    report.print();
    write_outputs(&report, &a)
}

/// `--sparse` (the density sweep) or `--varlen` (packed against one by one).
fn layouts(a: &BenchArgs) -> Result<()> {
    if let Some(p) = &a.plot {
        plot_path_ok(p)?;
    }
    let m = matrix(a)?;
    let config = LayoutConfig {
        seqlen: a.sparse_seqlen,
        head_dim: m.head_dims.first().copied().unwrap_or(64),
        heads: a.heads,
        causal: m.causal[0],
        precision: m.precision,
        repeats: a.repeats.max(1),
    };
    let densities: Vec<f64> = list(&a.densities).map_err(|_| CliError::BadFlag {
        flag: "--densities",
        expected: "fractions in (0, 1], comma-separated",
        value: a.densities.clone(),
    })?;
    if densities.iter().any(|d| !(*d > 0.0 && *d <= 1.0)) {
        return Err(CliError::BadFlag {
            flag: "--densities",
            expected: "fractions in (0, 1], comma-separated",
            value: a.densities.clone(),
        });
    }
    let block = super::layouts::parse_block_size("--sparse-block", &a.sparse_block)?;
    let lens = sizes("--varlen-lens", &a.varlen_lens)?;
    let engine = Engine::new()?;
    let bar = ProgressBar::new_spinner();
    bar.set_style(ProgressStyle::with_template("{spinner} {msg} [{elapsed}]")?);
    let progress = |msg: String| {
        bar.set_message(msg);
        bar.tick();
    };
    let json = if a.sparse {
        let counting = Engine::new()?.with_io_counting();
        let r = lb::sparse_sweep(
            &engine,
            Some(&counting),
            &config,
            (&densities, block),
            progress,
        )?;
        bar.finish_and_clear();
        r.print();
        if let Some(p) = &a.plot {
            r.plot(p)?;
            println!("wrote {}", p.display());
        }
        serde_json::to_string_pretty(&r)?
    } else {
        let r = lb::varlen_vs_separate(&engine, &config, &lens, progress)?;
        bar.finish_and_clear();
        r.print();
        serde_json::to_string_pretty(&r)?
    };
    if let Some(path) = &a.json {
        write_text(path, &json)?;
    }
    Ok(())
}

/// The matmul ceilings (S = QKᵀ and O = PV shapes) for every head dim.
fn ceilings(e: &Engine, m: &Matrix, repeats: usize, bar: &ProgressBar) -> Result<Vec<Ceiling>> {
    let mut out = Vec::new();
    for &d in &m.head_dims {
        // The ceiling's C is N×N f32: stay within one storage binding.
        let max_n = ((e.max_binding() / 4) as f64).sqrt() as usize;
        let longest = m.seqlens.iter().copied().max().unwrap_or(1024);
        let n = longest.clamp(256, 4096).min(max_n);
        bar.set_message(format!("matmul ceilings, N {n}, d {d}"));
        for (shape, name) in [
            (CeilingShape::Scores, "scores"),
            (CeilingShape::Values, report::VALUES),
        ] {
            let c = e.matmul_ceiling(shape, n, d, repeats)?;
            out.push(Ceiling {
                shape: name,
                head_dim: d,
                n,
                kernel: c.kernel.to_string(),
                gflops: c.gflops(),
            });
        }
        bar.inc(1);
    }
    Ok(out)
}

/// The flash forward's storage accesses at M/8, M/4, M/2 and M, and the
/// naive forward's at the same size (Theorem 2).
fn sweep(
    e: &Engine,
    seqlen: usize,
    head_dim: usize,
    precision: Precision,
    bar: &ProgressBar,
) -> Result<(Vec<SweepPoint>, Option<u64>)> {
    let case = BenchCase {
        pass: Pass::Forward,
        implementation: Implementation::Flash,
        batch: 1,
        heads: 1,
        seqlen,
        head_dim,
        causal: false,
        precision,
        dropout: 0.0,
    };
    let inputs = BenchInputs::new(&case)?;
    let [q, k, v, _] = inputs.views();
    let max_m = e.caps().max_workgroup_storage;
    let mut points = Vec::new();
    for m in [max_m / 8, max_m / 4, max_m / 2, max_m] {
        bar.set_message(format!("M sweep, M = {m} bytes"));
        let o = PlanOverrides::default().max_workgroup_storage(m);
        let out = e.forward_with(&ForwardInputs::new(q, k, v), &case.options(), &o)?;
        let plan = e.plan(&out.shape, precision, &o)?.plan;
        points.push(SweepPoint {
            m_bytes: m,
            br: plan.br,
            bc: plan.bc,
            reads: out.stats.accesses.reads,
            writes: out.stats.accesses.writes,
            seconds: out.stats.kernel_seconds,
        });
        bar.inc(1);
    }
    let naive = e
        .naive_forward(&ForwardInputs::new(q, k, v), &case.options())
        .ok();
    Ok((points, naive.map(|n| n.stats.accesses.total())))
}

/// JSON, CSV and charts, as the flags ask.
fn write_outputs(report: &Report, a: &BenchArgs) -> Result<()> {
    if let Some(path) = &a.json {
        write_text(path, &serde_json::to_string_pretty(report)?)?;
    }
    if let Some(path) = &a.csv {
        write_text(path, &csv_text(report)?)?;
    }
    if let Some(path) = &a.plot {
        for written in charts::write(report, path)? {
            eprintln!("wrote {}", written.display());
        }
    }
    Ok(())
}

/// The decode set the flags ask for: explicit flags, else `--quick`'s
/// tiny values, else the full set (docs/semantics.md's decode shapes: 32 query
/// heads, 8 kv heads, d 128).
fn decode_set(d: &DecodeBenchArgs, repeats: usize) -> Result<(DecodeSet, u64)> {
    let pick = |given: Option<usize>, quick: usize, full: usize| {
        given.unwrap_or(if d.quick { quick } else { full })
    };
    let lists = |given: &Option<String>, quick: &str, full: &str| {
        given
            .clone()
            .unwrap_or_else(|| if d.quick { quick } else { full }.to_string())
    };
    // heads_q, heads_kv, head_dim: --mla's are DeepSeek's whether quick or not.
    let (quick, full) = match d.mla {
        true => ([128, 1, db::MLA_WIDTH], [128, 1, db::MLA_WIDTH]),
        false => ([4, 2, 32], [32, 8, 128]),
    };
    let set = DecodeSet {
        backends: list(&d.backends)?,
        batches: sizes("--batches", &lists(&d.batches, "1,2", "1,8"))?,
        cache_lens: sizes(
            "--cache-lens",
            &lists(&d.cache_lens, "128,512", "1024,8192,32768"),
        )?,
        heads_q: pick(d.heads_q, quick[0], full[0]),
        heads_kv: pick(d.heads_kv, quick[1], full[1]),
        head_dim: pick(d.head_dim, quick[2], full[2]),
        latent_v: d.mla.then_some(db::MLA_V_WIDTH),
        dtypes: list::<db::CacheDtype>(d.dtypes.as_deref().unwrap_or("f16,f32,int8,fp8"))?,
        splits: list::<SplitMode>(&d.splits)?,
        max_tokens: d.max_tokens,
        repeats: repeats.max(1),
    };
    flashattn::AttentionShape::new(1, 1, 1, set.heads_q, set.heads_kv, set.head_dim)?;
    if let Some(v_width) = set.latent_v {
        let one = flashattn::CacheLayout::Dense {
            batch: 1,
            capacity: 1,
        };
        flashattn::CacheShape::latent(one, set.heads_kv, set.head_dim, v_width)?;
    }
    #[cfg(not(feature = "cuda"))]
    if set.backends.contains(&DecodeBackend::Cuda) {
        return Err(flashattn::Error::BackendNotBuilt { backend: "cuda" }.into());
    }
    let copy_mib = d.copy_mib.unwrap_or(if d.quick { 4 } else { 64 });
    if copy_mib == 0 {
        return Err(CliError::BadFlag {
            flag: "--copy-mib",
            expected: "a positive number of MiB",
            value: "0".into(),
        });
    }
    Ok((set, copy_mib << 20))
}

/// The CUDA rows' device and its copy bandwidth over `bytes`, or why
/// there is none (the rows then fail with the same reason).
#[cfg(feature = "cuda")]
fn cuda_device(cuda: &db::CudaBackend, bytes: u64, repeats: usize) -> db::CudaDevice {
    let cuda = match cuda {
        Ok(c) => c,
        Err(e) => {
            return db::CudaDevice {
                device: None,
                copy: None,
                error: Some(crate::error::one_line(e)),
            }
        }
    };
    let copy = cuda.copy_bandwidth(bytes, repeats);
    db::CudaDevice {
        device: Some(cuda.describe()),
        copy: copy.as_ref().ok().map(|r| CopyBandwidth {
            bytes: r.bytes,
            gbps: r.gbps(),
        }),
        error: copy.err().map(|e| crate::error::one_line(&e)),
    }
}

/// `bench --decode`: the copy bandwidths, then every group of the set.
fn decode(a: &BenchArgs) -> Result<()> {
    let (set, copy_bytes) = decode_set(&a.decode, a.repeats)?;
    // An adapter only for wgpu rows (its copy kernel is their yardstick alone).
    let engine = match set.backends.contains(&DecodeBackend::Wgpu) {
        true => Some(Engine::new()?),
        false => None,
    };
    let baselines = set
        .backends
        .contains(&DecodeBackend::Torch)
        .then(|| Baselines::new(&a.python))
        .transpose()?;
    let (groups, skipped) = set.groups();
    #[cfg(feature = "cuda")]
    let cuda = set
        .backends
        .contains(&DecodeBackend::Cuda)
        .then(flashattn::cuda::Cuda::new);
    let bar = ProgressBar::new(groups.len() as u64 + 2);
    bar.set_style(ProgressStyle::with_template(
        "{bar:30} {pos}/{len} {msg} [{elapsed}]",
    )?);
    bar.set_message("copy bandwidth");
    let copy = match &engine {
        Some(e) => {
            let r = e.copy_bandwidth(copy_bytes.min(e.max_binding()), set.repeats)?;
            Some(CopyBandwidth {
                bytes: r.bytes,
                gbps: r.gbps(),
            })
        }
        None => None,
    };
    bar.inc(1);
    let host_copy = CopyBandwidth {
        bytes: copy_bytes,
        gbps: db::host_copy_gbps(copy_bytes as usize, set.repeats),
    };
    #[cfg(feature = "cuda")]
    let cuda_device = cuda.as_ref().map(|c| {
        bar.set_message("cuda copy bandwidth");
        cuda_device(
            c,
            db::cuda_copy_bytes(&set, &groups, copy_bytes),
            set.repeats,
        )
    });
    #[cfg(not(feature = "cuda"))]
    let cuda_device = None;
    bar.inc(1);
    let devices = db::Devices {
        engine: engine.as_ref(),
        baselines: baselines.as_ref(),
        #[cfg(feature = "cuda")]
        cuda: cuda.as_ref(),
    };
    let mut report = DecodeReport {
        adapter: engine.as_ref().map_or("none".into(), |e| e.describe()),
        timing: timing_of(engine.as_ref()),
        copy,
        host_copy,
        cuda: cuda_device,
        cpu_threads: rayon::current_num_threads(),
        cpu_isa: flashattn::cpu::Cpu::new().isa().name().into(),
        heads_q: set.heads_q,
        heads_kv: set.heads_kv,
        head_dim: set.head_dim,
        latent_v: set.latent_v,
        repeats: set.repeats,
        results: Vec::new(),
        skipped,
        max_tokens: set.max_tokens,
    };
    for g in &groups {
        bar.set_message(format!(
            "decode batch {} cache {} {}",
            g.batch,
            g.cache_len,
            g.dtype.name()
        ));
        report.results.extend(db::run_group(&devices, &set, g));
        // Rewritten after every group: a run stopped by a time limit keeps
        // the groups that finished.
        write_decode_outputs(a, &report)?;
        bar.inc(1);
    }
    bar.finish_and_clear();
    report.print();
    write_decode_outputs(a, &report)
}

/// The report as JSON and CSV where `--json` and `--csv` name files.
fn write_decode_outputs(a: &BenchArgs, report: &DecodeReport) -> Result<()> {
    if let Some(path) = &a.json {
        write_text(path, &serde_json::to_string_pretty(report)?)?;
    }
    if let Some(path) = &a.csv {
        write_text(path, &db::csv_text(report)?)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_empty_list_is_an_error() {
        for s in ["", ",", ",,"] {
            assert!(matches!(
                sizes("--seqlens", s),
                Err(CliError::BadFlag {
                    flag: "--seqlens",
                    ..
                })
            ));
            assert!(matches!(
                list::<Precision>(s),
                Err(flashattn::Error::UnknownName { .. })
            ));
        }
        assert_eq!(sizes("--seqlens", "16, 32,").unwrap(), vec![16, 32]);
        assert_eq!(list::<f32>("0.5,").unwrap(), vec![0.5]);
    }

    #[test]
    fn heads_and_batch_are_positive() {
        assert!(matches!(
            positive("--heads", 0),
            Err(CliError::BadFlag {
                flag: "--heads",
                ..
            })
        ));
        assert_eq!(positive("--batch", 3).unwrap(), 3);
    }
}

//! `flashattn doctor`: what a bug report needs. The device (adapter, API,
//! driver, limits, features), the verification settings, then the whole
//! verification matrix of the device's kernel families (forward, backward
//! and decode; f32, f16 and bf16; every layout), each row run now and its
//! worst output's error printed against the accuracy rule's bound. Rows run
//! a few at a time and print in order as they finish; `--json` gives the
//! same report as one JSON document. Any row that fails or cannot run makes
//! the command exit non-zero.

use crate::args::DoctorArgs;
use crate::error::{CliError, Result};
use flashattn::verify::matrix::{MatrixRow, RowResult};
use flashattn::{CallKind, Engine};
use serde::Serialize;
use std::sync::Mutex;
use std::time::Instant;

/// Rows run at once (each compiles its kernels on one thread).
const MAX_WORKERS: usize = 4;

pub fn run(a: DoctorArgs) -> Result<()> {
    match a.backend.as_str() {
        "wgpu" => wgpu(&a),
        "cuda" => cuda(&a),
        other => Err(CliError::BadFlag {
            flag: "--backend",
            expected: "wgpu or cuda",
            value: other.to_string(),
        }),
    }
}

/// A named value of the device section.
#[derive(Clone, Debug, Serialize)]
pub struct Named<T> {
    pub name: String,
    pub value: T,
}

fn named<T>(name: &str, value: T) -> Named<T> {
    Named {
        name: name.to_string(),
        value,
    }
}

/// The device under test.
#[derive(Clone, Debug, Serialize)]
pub struct Device {
    pub name: String,
    /// Vulkan, Metal, Dx12, Gl, BrowserWebGpu or CUDA.
    pub api: String,
    /// Driver, ids, device type, subgroup sizes, loop limit, host CPU.
    pub about: Vec<Named<String>>,
    pub limits: Vec<Named<u64>>,
    pub features: Vec<Named<bool>>,
}

/// One row of the matrix, as printed.
#[derive(Clone, Debug, Serialize)]
pub struct Row {
    pub family: String,
    pub call: String,
    pub precision: String,
    pub flags: Vec<String>,
    pub layout: String,
    pub covers: String,
    /// `pass`, `FAIL` or `error`.
    pub result: String,
    /// The worst output (`o: max error … <= bound …`), where it ran.
    pub worst: Option<String>,
    pub max_error: Option<f64>,
    pub bound: Option<f64>,
    /// Why the row could not run.
    pub error: Option<String>,
    pub seconds: f64,
}

impl From<MatrixRow> for Row {
    fn from(r: MatrixRow) -> Self {
        let (worst, max_error, bound, error) = match &r.result {
            RowResult::Pass(j) | RowResult::Fail(j) => (
                Some(j.worst.clone()),
                Some(j.max_error),
                Some(j.bound),
                None,
            ),
            RowResult::Error(e) => (None, None, None, Some(e.clone())),
        };
        Self {
            family: r.family.family.to_string(),
            call: r.family.call.name().to_string(),
            precision: r.family.precision.to_string(),
            flags: r.family.flags.clone(),
            layout: r.case.name().to_string(),
            covers: r.case.covers().to_string(),
            result: r.result.word().to_string(),
            worst,
            max_error,
            bound,
            error,
            seconds: r.seconds,
        }
    }
}

/// The whole report.
#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub flashattn: &'static str,
    pub backend: &'static str,
    pub device: Device,
    /// How calls verify kernels (FLASHATTN_VERIFY) and where verdicts are
    /// kept; the matrix itself always runs every row now.
    pub verification: Vec<Named<String>>,
    pub rows: Vec<Row>,
    pub passed: usize,
    pub failed: usize,
    pub errors: usize,
    pub seconds: f64,
}

fn wgpu(a: &DoctorArgs) -> Result<()> {
    let call = call_filter(a)?;
    let engine = Engine::new()?;
    let device = wgpu_device(&engine);
    let cache = engine
        .verdict_cache()
        .map_or("none (memory only)".into(), |c| {
            c.path().display().to_string()
        });
    let verification = vec![
        named("mode", engine.verify_mode().name().to_string()),
        named("verdict cache", cache),
    ];
    let mut entries = engine.verification_matrix();
    entries.retain(|e| call.is_none_or(|c| e.family.call == c));
    finish(a, device, verification, &entries, |e| {
        engine.run_matrix_entry(e)
    })
}

/// `--call`, parsed.
fn call_filter(a: &DoctorArgs) -> Result<Option<CallKind>> {
    let Some(call) = &a.call else { return Ok(None) };
    [CallKind::Forward, CallKind::Backward, CallKind::Decode]
        .into_iter()
        .find(|c| c.name() == call)
        .map(Some)
        .ok_or_else(|| CliError::BadFlag {
            flag: "--call",
            expected: "forward, backward or decode",
            value: call.clone(),
        })
}

/// The adapter, its limits and the features flashattn uses.
fn wgpu_device(engine: &Engine) -> Device {
    let i = engine.adapter_info();
    let caps = engine.caps();
    let mut about = vec![
        named("device type", format!("{:?}", i.device_type)),
        named("vendor id", format!("{:#06x}", i.vendor)),
        named("device id", format!("{:#06x}", i.device)),
        named("driver", i.driver.clone()),
        named("driver info", i.driver_info.clone()),
        named(
            "subgroup sizes",
            format!("{}..={}", i.subgroup_min_size, i.subgroup_max_size),
        ),
        named(
            "loop limit",
            engine.loop_limit().map_or("none (measured)".into(), |n| {
                format!("{n} iterations per invocation (measured)")
            }),
        ),
        named("host CPU", flashattn::choice::cache::cpu_model()),
    ];
    let m = caps.coop_matrix;
    about.push(named(
        "cooperative matrices",
        [
            (m.f32_8x8, "8x8 f32"),
            (m.f16_16x16_f32, "16x16 f16 (f32 accumulators)"),
            (m.f16_16x16_f16, "16x16 f16"),
        ]
        .iter()
        .filter(|(on, _)| *on)
        .map(|(_, n)| *n)
        .collect::<Vec<_>>()
        .join(", "),
    ));
    let l = engine.limits();
    let limits = [
        (
            "max_compute_workgroup_storage_size",
            l.max_compute_workgroup_storage_size,
        ),
        (
            "max_compute_invocations_per_workgroup",
            l.max_compute_invocations_per_workgroup,
        ),
        (
            "max_compute_workgroup_size_x",
            l.max_compute_workgroup_size_x,
        ),
        (
            "max_compute_workgroups_per_dimension",
            l.max_compute_workgroups_per_dimension,
        ),
        (
            "max_storage_buffers_per_shader_stage",
            l.max_storage_buffers_per_shader_stage,
        ),
    ]
    .map(|(n, v)| named(n, u64::from(v)))
    .into_iter()
    .chain([
        named(
            "max_storage_buffer_binding_size",
            l.max_storage_buffer_binding_size,
        ),
        named("max_buffer_size", l.max_buffer_size),
    ])
    .collect();
    use flashattn::wgpu::Features as F;
    let f = engine.features();
    let features = [
        ("SHADER_F16", F::SHADER_F16),
        ("SUBGROUP", F::SUBGROUP),
        ("TIMESTAMP_QUERY", F::TIMESTAMP_QUERY),
        (
            "EXPERIMENTAL_COOPERATIVE_MATRIX",
            F::EXPERIMENTAL_COOPERATIVE_MATRIX,
        ),
    ]
    .into_iter()
    .map(|(n, x)| named(n, f.contains(x)))
    .collect();
    Device {
        name: i.name.clone(),
        api: format!("{:?}", i.backend),
        about,
        limits,
        features,
    }
}

/// Run every entry (printing the table as rows finish unless `--json`),
/// then the summary or the JSON; an error if any row did not pass.
fn finish<E: Sync>(
    a: &DoctorArgs,
    device: Device,
    verification: Vec<Named<String>>,
    entries: &[E],
    run: impl Fn(&E) -> MatrixRow + Sync,
) -> Result<()> {
    let backend = if a.backend == "cuda" { "cuda" } else { "wgpu" };
    if !a.json {
        print_device(&device, &verification);
        println!(
            "\nverification matrix: {} checks, each run now against the f64 reference under the accuracy rule (docs/semantics.md)",
            entries.len()
        );
        println!(
            "{:<10} {:<8} {:<5} {:<8} {:<6} {:<48} {:>7}  flags",
            "family", "call", "prec", "layout", "result", "worst output", "ms"
        );
    }
    let start = Instant::now();
    let rows = run_all(entries, run, !a.json);
    let count = |word: &str| rows.iter().filter(|r| r.result == word).count();
    let report = Report {
        flashattn: env!("CARGO_PKG_VERSION"),
        backend,
        device,
        verification,
        passed: count("pass"),
        failed: count("FAIL"),
        errors: count("error"),
        seconds: start.elapsed().as_secs_f64(),
        rows,
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        println!(
            "\n{} checks: {} pass, {} FAIL, {} error; {:.1} s",
            report.rows.len(),
            report.passed,
            report.failed,
            report.errors,
            report.seconds
        );
    }
    if report.failed + report.errors > 0 {
        return Err(CliError::DoctorFailed {
            failed: report.failed,
            errors: report.errors,
            rows: report.rows.len(),
        });
    }
    Ok(())
}

fn print_device(d: &Device, verification: &[Named<String>]) {
    println!("flashattn {} doctor", env!("CARGO_PKG_VERSION"));
    println!("device: {} ({})", d.name, d.api);
    for n in &d.about {
        println!("  {}: {}", n.name, n.value);
    }
    println!("limits:");
    for n in &d.limits {
        println!("  {}  {}", n.name, n.value);
    }
    let yes = |b: bool| if b { "yes" } else { "no" };
    let features: Vec<String> = d
        .features
        .iter()
        .map(|n| format!("{} {}", n.name, yes(n.value)))
        .collect();
    println!("features: {}", features.join(", "));
    for n in verification {
        println!("verification {}: {}", n.name, n.value);
    }
}

/// One row's table line.
fn line(r: &Row) -> String {
    let worst = match (&r.worst, &r.error) {
        (Some(w), _) => w.clone(),
        (None, Some(e)) => e.clone(),
        (None, None) => String::new(),
    };
    format!(
        "{:<10} {:<8} {:<5} {:<8} {:<6} {:<48} {:>7.0}  {}",
        r.family,
        r.call,
        r.precision,
        r.layout,
        r.result,
        worst,
        r.seconds * 1e3,
        r.flags.join(", ")
    )
}

/// Run the entries on a few threads; with `show`, print each row's line
/// in order as soon as it and every row before it are done.
fn run_all<E: Sync>(entries: &[E], run: impl Fn(&E) -> MatrixRow + Sync, show: bool) -> Vec<Row> {
    let workers = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, MAX_WORKERS);
    let next = std::sync::atomic::AtomicUsize::new(0);
    // The rows done, and how many of them are printed.
    let done: Mutex<(Vec<Option<Row>>, usize)> = Mutex::new((vec![None; entries.len()], 0));
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(entry) = entries.get(i) else { break };
                let row = Row::from(run(entry));
                let Ok(mut guard) = done.lock() else { break };
                let (rows, printed) = &mut *guard;
                rows[i] = Some(row);
                while let Some(Some(r)) = rows.get(*printed) {
                    if show {
                        println!("{}", line(r));
                    }
                    *printed += 1;
                }
            });
        }
    });
    let rows = done.into_inner().map(|(rows, _)| rows).unwrap_or_default();
    rows.into_iter().flatten().collect()
}

/// The CUDA kernel paths of device 0: its properties, the driver's and
/// NVRTC's versions, and the matrix of its families.
#[cfg(feature = "cuda")]
fn cuda(a: &DoctorArgs) -> Result<()> {
    let call = call_filter(a)?;
    let cuda = flashattn::cuda::Cuda::new()?;
    let p = cuda.props();
    let device = Device {
        name: p.name.clone(),
        api: "CUDA".into(),
        about: cuda.about().into_iter().map(|(n, v)| named(n, v)).collect(),
        limits: vec![
            named("multiprocessors", p.sms as u64),
            named(
                "shared memory per block (opt-in)",
                p.smem_per_block_optin as u64,
            ),
            named("shared memory per multiprocessor", p.smem_per_sm as u64),
            named("threads per multiprocessor", p.max_threads_per_sm as u64),
        ],
        features: Vec::new(),
    };
    let verification = vec![named("mode", cuda.verify_mode().name().to_string())];
    let mut entries = cuda.verification_matrix();
    entries.retain(|e| call.is_none_or(|c| e.call == c));
    finish(a, device, verification, &entries, |e| {
        cuda.run_matrix_entry(e)
    })
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: &DoctorArgs) -> Result<()> {
    Err(flashattn::Error::BackendNotBuilt { backend: "cuda" }.into())
}

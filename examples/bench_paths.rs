//! Kernel paths side by side on one GPU, the way the GPU checks benchmark
//! (scripts/gpu-check.sh, steps 8 and 9): each shape's inputs generated
//! once and run by every implementation asked for; torch's SDPA answered by
//! one Python process started once (`cli/src/baselines.py --serve`, CUDA
//! events on the GPU); the flashattn paths timed by their own device clocks
//! (CUDA events, wgpu timestamp queries); every flashattn output compared
//! with another path's; the JSON rewritten after every case, so a timeout
//! keeps what ran. Exits 1 when two paths disagree or a flashattn path
//! fails.
//!
//! ```text
//! cargo run --release --features cuda --example bench_paths -- \
//!     --impls cuda-hopper,cuda-mma,torch --passes forward --seqlens 1024,4096 \
//!     --head-dims 64,128 --precisions f16,bf16 --json bench.json
//! ```
//!
//! Implementations: flash, tiled, registers, coop (wgpu), cuda, cuda-scalar,
//! cuda-mma, cuda-hopper (feature `cuda`), torch. Each flashattn output is
//! compared with `--compare-with`'s (run untimed when it is not in
//! `--impls`), that one with the first other; they agree when the largest
//! difference is within 8 units of the storage precision at the other's
//! largest magnitude (each path meets docs/semantics.md's rule against the f64
//! reference in the accuracy tests; this catches a path gone wrong at sizes
//! the reference cannot reach). `--dry-run` lists the cases and checks the
//! Python driver's protocol, with no GPU.

use clap::Parser;
use flashattn::{AttentionOptions, BackwardInputs, Engine, ForwardInputs, Precision, TensorView};
use flashattn_cli::bench::{BenchCase, BenchInputs, BenchResult, Implementation, Pass};
use serde::Serialize;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};

#[derive(Parser, Debug)]
#[command(about = "Benchmark kernel paths side by side, each output compared with another path")]
struct Args {
    /// Implementations, comma-separated (flash, tiled, registers, coop, cuda,
    /// cuda-scalar, cuda-mma, cuda-hopper, torch).
    #[arg(long)]
    impls: String,
    /// The path every other flashattn output is compared with (default: the
    /// first flashattn one of --impls).
    #[arg(long)]
    compare_with: Option<String>,
    #[arg(long, default_value = "forward")]
    passes: String,
    #[arg(long, default_value = "1024")]
    seqlens: String,
    #[arg(long, default_value = "64")]
    head_dims: String,
    /// no, yes or both.
    #[arg(long, default_value = "both")]
    causal: String,
    #[arg(long, default_value = "f16")]
    precisions: String,
    #[arg(long, default_value_t = 4)]
    batch: usize,
    #[arg(long, default_value_t = 16)]
    heads: usize,
    /// Timed repeats after the warm-up.
    #[arg(long, default_value_t = 3)]
    repeats: usize,
    /// Untimed runs of each flashattn path first, until this many
    /// milliseconds have passed (at least one): an idle GPU's clocks take
    /// a while to rise, and one millisecond-long run does not raise them.
    #[arg(long, default_value_t = 200.0)]
    warmup_ms: f64,
    /// Rewritten after every case.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
    /// The interpreter of cli/src/baselines.py --serve (torch).
    #[arg(long, env = "FLASHATTN_PYTHON", default_value = "python3")]
    python: String,
    /// torch's device.
    #[arg(long, default_value = "cuda")]
    torch_device: String,
    /// Start no new shape after this many seconds (the rest are listed as
    /// not run), so a run under a hard time limit ends on its own.
    #[arg(long)]
    max_seconds: Option<f64>,
    /// List the cases and check the Python driver's protocol; run nothing.
    #[arg(long)]
    dry_run: bool,
}

type BoxError = Box<dyn std::error::Error>;

/// One JSON row: `flashattn bench`'s, and the comparison.
#[derive(Serialize)]
struct Row {
    #[serde(flatten)]
    result: BenchResult,
    #[serde(skip_serializing_if = "Option::is_none")]
    compared_with: Option<&'static str>,
    /// Per output tensor: (name, max |x - other|, tolerance).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    differences: Vec<(&'static str, f64, f64)>,
    #[serde(skip_serializing_if = "Option::is_none")]
    agrees: Option<bool>,
}

fn list<T: std::str::FromStr>(s: &str) -> Result<Vec<T>, BoxError>
where
    T::Err: std::fmt::Display,
{
    s.split(',')
        .filter(|x| !x.is_empty())
        .map(|x| x.trim().parse().map_err(|e: T::Err| e.to_string().into()))
        .collect()
}

/// The cases of one shape: every implementation, then the comparison's own
/// path where it is not among them (untimed).
struct Shape {
    base: BenchCase,
    impls: Vec<Implementation>,
}

fn shapes(a: &Args, impls: &[Implementation]) -> Result<Vec<Shape>, BoxError> {
    let causal = match a.causal.as_str() {
        "no" => vec![false],
        "yes" => vec![true],
        "both" => vec![false, true],
        other => return Err(format!("--causal: no, yes or both, not {other}").into()),
    };
    let mut out = Vec::new();
    for pass in list::<Pass>(&a.passes)? {
        for precision in list::<Precision>(&a.precisions)? {
            for &head_dim in &list::<usize>(&a.head_dims)? {
                for &causal in &causal {
                    for &seqlen in &list::<usize>(&a.seqlens)? {
                        let base = BenchCase {
                            pass,
                            implementation: impls[0],
                            batch: a.batch,
                            heads: a.heads,
                            seqlen,
                            head_dim,
                            causal,
                            precision,
                            dropout: 0.0,
                        };
                        out.push(Shape {
                            base,
                            impls: impls.to_vec(),
                        });
                    }
                }
            }
        }
    }
    Ok(out)
}

/// torch's SDPA in one Python process for the whole run.
struct Torch {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    /// Why torch cannot answer, if it cannot (its first line said so).
    unavailable: Option<String>,
    device: String,
}

impl Torch {
    fn start(python: &str, device: &str) -> Result<Self, BoxError> {
        let script =
            std::env::temp_dir().join(format!("flashattn-torch-{}.py", std::process::id()));
        std::fs::write(&script, include_str!("../cli/src/baselines.py"))?;
        let mut child = Command::new(python)
            .arg(&script)
            .arg("--serve")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {python}: {e}"))?;
        let (stdin, stdout) = (child.stdin.take(), child.stdout.take());
        let (Some(stdin), Some(stdout)) = (stdin, stdout) else {
            return Err("no pipes to the Python driver".into());
        };
        let mut torch = Self {
            child,
            stdin,
            stdout: BufReader::new(stdout),
            unavailable: None,
            device: device.into(),
        };
        let ready = torch.reply()?;
        let _ = std::fs::remove_file(&script);
        torch.unavailable = ready["error"].as_str().map(String::from);
        eprintln!("torch driver: {ready}");
        Ok(torch)
    }

    fn reply(&mut self) -> Result<serde_json::Value, BoxError> {
        let mut line = String::new();
        self.stdout.read_line(&mut line)?;
        serde_json::from_str(line.trim())
            .map_err(|e| format!("Python driver said {line:?}: {e}").into())
    }

    /// `case` timed by torch: seconds of each repeat, or the reply's error.
    fn run(&mut self, case: &BenchCase, repeats: usize) -> Result<Vec<f64>, BoxError> {
        let dtype = match case.precision {
            Precision::F16 => "float16",
            Precision::Bf16 => "bfloat16",
            _ => "float32",
        };
        let request = serde_json::json!({
            "pass": case.pass.name(), "batch": case.batch, "heads": case.heads,
            "seqlen": case.seqlen, "head_dim": case.head_dim, "causal": case.causal,
            "repeats": repeats, "device": self.device, "dtype": dtype,
        });
        writeln!(self.stdin, "{request}")?;
        self.stdin.flush()?;
        let reply = self.reply()?;
        if let Some(e) = reply["error"].as_str() {
            return Err(e.into());
        }
        Ok(reply["seconds"]
            .as_array()
            .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
            .unwrap_or_default())
    }
}

impl Drop for Torch {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The backends a run needs, opened once.
struct Backends {
    engine: Option<Engine>,
    #[cfg(feature = "cuda")]
    cuda: Option<flashattn::Cuda>,
}

impl Backends {
    fn open(impls: &[Implementation]) -> Result<Self, BoxError> {
        let engine = impls
            .iter()
            .any(|i| i.on_gpu())
            .then(Engine::new)
            .transpose()?;
        if let Some(e) = &engine {
            eprintln!("wgpu on {} ({})", e.describe(), e.timing().describe());
        }
        #[cfg(feature = "cuda")]
        let cuda = impls
            .iter()
            .any(|i| cuda_path(*i).is_some())
            .then(flashattn::Cuda::new)
            .transpose()?;
        #[cfg(feature = "cuda")]
        if let Some(c) = &cuda {
            eprintln!("CUDA on {}", c.describe());
        }
        Ok(Self {
            engine,
            #[cfg(feature = "cuda")]
            cuda,
        })
    }
}

#[cfg(feature = "cuda")]
fn cuda_path(i: Implementation) -> Option<flashattn::KernelPath> {
    use flashattn::KernelPath;
    match i {
        Implementation::Cuda => Some(KernelPath::Auto),
        Implementation::CudaScalar => Some(KernelPath::Scalar),
        Implementation::CudaMma => Some(KernelPath::Mma),
        Implementation::CudaHopper => Some(KernelPath::Hopper),
        _ => None,
    }
}

/// Output tensors by name (o, or dq, dk and dv) as f32.
type Tensors = Vec<(&'static str, Vec<f32>)>;

/// A flashattn output: o, or dq, dk and dv.
enum Output {
    Forward(flashattn::ForwardOutput),
    Backward(flashattn::BackwardOutput),
}

impl Output {
    fn seconds(&self) -> f64 {
        match self {
            Output::Forward(o) => o.stats.kernel_seconds,
            Output::Backward(b) => b.stats.kernel_seconds,
        }
    }

    fn tensors(&self) -> Tensors {
        match self {
            Output::Forward(o) => vec![("o", o.o.to_f32())],
            Output::Backward(b) => vec![
                ("dq", b.dq.to_f32()),
                ("dk", b.dk.to_f32()),
                ("dv", b.dv.to_f32()),
            ],
        }
    }
}

/// One run of `case` on its flashattn implementation (a backward's forward
/// first, untimed, on the same path).
fn run_once(
    b: &Backends,
    case: &BenchCase,
    [q, k, v, d_o]: [TensorView; 4],
    opts: &AttentionOptions,
) -> Result<Output, BoxError> {
    #[cfg(feature = "cuda")]
    if let Some(path) = cuda_path(case.implementation) {
        let c = b.cuda.as_ref().ok_or("no CUDA backend")?;
        let fwd = c.forward_on(path, &ForwardInputs::new(q, k, v), opts)?;
        return Ok(match case.pass {
            Pass::Forward => Output::Forward(fwd),
            Pass::Backward => {
                let inputs = BackwardInputs::new(ForwardInputs::new(q, k, v), &fwd, d_o)?;
                Output::Backward(c.backward_on(path, &inputs, opts)?)
            }
        });
    }
    let e = b
        .engine
        .as_ref()
        .ok_or("no wgpu adapter (or a CUDA path in a build without the cuda feature)")?;
    let kernel = match case.implementation {
        Implementation::Tiled => Some(flashattn::KernelFamily::Tiled),
        Implementation::Registers => Some(flashattn::KernelFamily::Registers),
        Implementation::Coop => Some(flashattn::KernelFamily::Coop),
        Implementation::Flash => None,
        other => return Err(format!("{} is not a flashattn path here", other.name()).into()),
    };
    let mut overrides = flashattn::PlanOverrides::default();
    overrides.kernel = kernel;
    let fwd = e.forward_with(&ForwardInputs::new(q, k, v), opts, &overrides)?;
    Ok(match case.pass {
        Pass::Forward => Output::Forward(fwd),
        Pass::Backward => {
            let inputs = BackwardInputs::new(ForwardInputs::new(q, k, v), &fwd, d_o)?;
            Output::Backward(e.backward_with(&inputs, opts, &overrides)?)
        }
    })
}

/// Largest |x - y| per tensor of `a` against `b`, with the tolerance: 8
/// units of `precision` at b's largest magnitude.
fn differences(a: &Tensors, b: &Tensors, precision: Precision) -> Vec<(&'static str, f64, f64)> {
    a.iter()
        .zip(b)
        .map(|((name, x), (_, y))| {
            let scale = y.iter().fold(0f64, |m, v| m.max(f64::from(v.abs())));
            let diff = x
                .iter()
                .zip(y)
                .map(|(p, q)| f64::from((p - q).abs()))
                .fold(0f64, |m, d| {
                    if d.is_nan() || m.is_nan() {
                        f64::NAN
                    } else {
                        m.max(d)
                    }
                });
            let tolerance = 8.0 * precision.epsilon() * scale.max(1e-30) + 1e-6;
            (*name, diff, tolerance)
        })
        .collect()
}

fn write_json(path: &Option<std::path::PathBuf>, rows: &[Row]) -> Result<(), BoxError> {
    let Some(path) = path else { return Ok(()) };
    let tmp = path.with_extension("json.part");
    std::fs::write(
        &tmp,
        serde_json::to_string_pretty(&serde_json::json!({ "results": rows }))?,
    )?;
    std::fs::rename(&tmp, path)?;
    Ok(())
}

fn main() {
    let args = Args::parse();
    match run(&args) {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("bench_paths: {e}");
            std::process::exit(2);
        }
    }
}

/// The whole run; `Ok(false)` when paths disagree or a flashattn path failed.
fn run(a: &Args) -> Result<bool, BoxError> {
    let mut impls: Vec<Implementation> = list(&a.impls)?;
    let flash: Vec<Implementation> = impls.iter().copied().filter(|i| !i.outside()).collect();
    let compare = match &a.compare_with {
        Some(name) => name.parse::<Implementation>()?,
        None => *flash
            .first()
            .ok_or("--impls names no flashattn path to compare")?,
    };
    if compare.outside() {
        return Err("--compare-with must be a flashattn path".into());
    }
    if !impls.contains(&compare) {
        impls.push(compare);
    }
    if impls.iter().filter(|i| !i.outside()).count() < 2 {
        return Err("one flashattn path alone: name another with --compare-with".into());
    }
    let shapes = shapes(a, &impls)?;
    if shapes.is_empty() {
        return Err("no cases: --passes, --precisions, --head-dims or --seqlens is empty".into());
    }
    let timed = |i: &Implementation| flash.contains(i) || i.outside();
    if a.dry_run {
        for s in &shapes {
            for &implementation in &s.impls {
                let case = BenchCase {
                    implementation,
                    ..s.base
                };
                println!("{} {}", case.label(), case.precision.name());
            }
        }
        if impls.contains(&Implementation::Torch) {
            let mut torch = Torch::start(&a.python, "cpu")?;
            let tiny = BenchCase {
                seqlen: 16,
                head_dim: 16,
                batch: 1,
                heads: 1,
                implementation: Implementation::Torch,
                precision: Precision::F32,
                ..shapes[0].base
            };
            match torch.run(&tiny, 1) {
                Ok(s) => println!("torch driver: a tiny case on the CPU took {s:?} s"),
                Err(e) => println!("torch driver answered: {e}"),
            }
        }
        return Ok(true);
    }
    let backends = Backends::open(&impls)?;
    let mut torch = match impls.contains(&Implementation::Torch) {
        true => Some(Torch::start(&a.python, &a.torch_device)?),
        false => None,
    };
    let mut rows: Vec<Row> = Vec::new();
    let mut ok = true;
    let started = std::time::Instant::now();
    for (n, shape) in shapes.iter().enumerate() {
        if a.max_seconds
            .is_some_and(|max| started.elapsed().as_secs_f64() > max)
        {
            eprintln!(
                "--max-seconds spent: {} of {} shapes not run",
                shapes.len() - n,
                shapes.len()
            );
            for s in &shapes[n..] {
                eprintln!("  not run: {} {}", s.base.label(), s.base.precision.name());
            }
            break;
        }
        let inputs = BenchInputs::new(&shape.base)?;
        let opts = shape.base.options();
        let first = rows.len();
        let mut outputs: Vec<(Implementation, Tensors)> = Vec::new();
        for &imp in &shape.impls {
            let case = BenchCase {
                implementation: imp,
                ..shape.base
            };
            let mut result = BenchResult::new(&case);
            if imp.outside() {
                let torch = torch.as_mut().ok_or("torch was not started")?;
                match torch.unavailable.clone() {
                    Some(why) => result.error = Some(why),
                    None => match torch.run(&case, a.repeats) {
                        Ok(s) => result.seconds = s,
                        Err(e) => result.error = Some(e.to_string()),
                    },
                }
            } else {
                let repeats = if timed(&imp) { a.repeats } else { 0 };
                let warmup = std::time::Duration::from_secs_f64(a.warmup_ms.max(0.0) / 1e3);
                let warming = std::time::Instant::now();
                let mut last = None;
                let mut timed_runs = 0;
                while timed_runs < repeats || last.is_none() {
                    let warm = last.is_some() && warming.elapsed() >= warmup;
                    match run_once(&backends, &case, inputs.views(), &opts) {
                        Ok(out) => {
                            if warm {
                                result.seconds.push(out.seconds());
                                timed_runs += 1;
                            }
                            last = Some(out);
                        }
                        Err(e) => {
                            result.error = Some(e.to_string());
                            ok = false;
                            break;
                        }
                    }
                }
                if let Some(out) = last {
                    outputs.push((imp, out.tensors()));
                }
            }
            report(&result);
            rows.push(Row {
                result,
                compared_with: None,
                differences: Vec::new(),
                agrees: None,
            });
            write_json(&a.json, &rows)?;
        }
        ok &= compare_outputs(&mut rows[first..], &outputs, compare, shape.base.precision);
        write_json(&a.json, &rows)?;
    }
    Ok(ok)
}

/// Each flashattn output of a shape against `compare`'s (that one against
/// the first other); the verdicts into the rows. Whether all agree.
fn compare_outputs(
    rows: &mut [Row],
    outputs: &[(Implementation, Tensors)],
    compare: Implementation,
    precision: Precision,
) -> bool {
    let Some(reference) = outputs.iter().find(|(i, _)| *i == compare) else {
        return outputs.is_empty();
    };
    let mut all = true;
    for (imp, tensors) in outputs {
        let other = if *imp == compare {
            outputs.iter().find(|(i, _)| *i != compare)
        } else {
            Some(reference)
        };
        let Some((other_imp, other)) = other else {
            continue;
        };
        let diffs = differences(tensors, other, precision);
        let agrees = diffs.iter().all(|(_, d, t)| d <= t);
        all &= agrees;
        let text: Vec<String> = diffs
            .iter()
            .map(|(n, d, t)| format!("{n} {d:.3e} (tolerance {t:.3e})"))
            .collect();
        eprintln!(
            "  {} against {}: {} {}",
            imp.name(),
            other_imp.name(),
            text.join(", "),
            if agrees { "agree" } else { "DISAGREE" }
        );
        if let Some(row) = rows
            .iter_mut()
            .find(|r| r.result.case.implementation == *imp)
        {
            row.compared_with = Some(other_imp.name());
            row.differences = diffs;
            row.agrees = Some(agrees);
        }
    }
    all
}

/// One line per finished case: median time and TFLOP/s, or the error.
fn report(r: &BenchResult) {
    let c = &r.case;
    let what = match (&r.error, r.median_seconds()) {
        (Some(e), _) => format!("error: {e}"),
        (None, Some(t)) => format!("{:.3} ms, {:.1} TFLOP/s", t * 1e3, r.flops / t / 1e12),
        (None, None) => "untimed (compared only)".into(),
    };
    println!("{} {}: {what}", c.label(), c.precision.name());
    let _ = std::io::stdout().flush();
}

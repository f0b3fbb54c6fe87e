//! `flashattn bench --sparse` and `bench --varlen`: the block-sparse density
//! sweep (forward and backward time at each density against density × the
//! dense time, measured in one run, and the storage accesses counted against
//! the analytic ones) and a packed batch against its sequences run one by
//! one. Times are the fastest kernel time of the repeats (submit to
//! completion of the call's kernels); the cases compared run in turn in
//! every round, so a change of load on the host affects them alike.

use crate::bench::Pass;
use crate::error::{CliError, Result};
use crate::plot::{render, Chart, Series};
use flashattn::random::Rng;
use flashattn::Varlen;
use flashattn::{
    Accesses, AttentionOptions, AttentionShape, BackwardInputs, CallStats, Engine, Precision,
    TensorData, TensorView,
};
use flashattn::{BlockGrid, BlockMask, ForwardInputs};

use serde::Serialize;
use std::path::Path;

/// What a layout benchmark runs on.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct LayoutConfig {
    pub seqlen: usize,
    pub head_dim: usize,
    pub heads: usize,
    pub causal: bool,
    #[serde(skip)]
    pub precision: Precision,
    pub repeats: usize,
}

/// One density of the sweep.
#[derive(Clone, Debug, Serialize)]
pub struct SparsePoint {
    pub pass: Pass,
    /// The density asked for and the mask's own (blocks allowed).
    pub target: f64,
    pub density: f64,
    pub seconds: f64,
    /// This time over density × the dense time (1 is proportional).
    pub ratio: f64,
    /// Storage elements read and written (analytic).
    pub reads: u64,
    pub writes: u64,
    /// The instrumented kernels' count, `[reads, writes]` (engines that
    /// count), which must equal the analytic one.
    pub counted: Option<[u64; 2]>,
}

impl SparsePoint {
    fn accesses(&self) -> Accesses {
        Accesses {
            reads: self.reads,
            writes: self.writes,
        }
    }
}

/// The density sweep.
#[derive(Clone, Debug, Serialize)]
pub struct SparseReport {
    pub adapter: String,
    pub config: LayoutConfig,
    pub block: (usize, usize),
    /// Fastest dense (no mask) time of each pass.
    pub dense_seconds: Vec<(Pass, f64)>,
    pub points: Vec<SparsePoint>,
}

/// Seeded q, k, v, dO of `batch` × `rows` query and `keys` key rows.
struct Inputs {
    q: TensorData,
    k: TensorData,
    v: TensorData,
    d_o: TensorData,
    shapes: [[usize; 4]; 2],
}

impl Inputs {
    /// The sizes come from flags: checked (AttentionShape) before any allocation.
    fn new(c: &LayoutConfig, rows: usize, keys: usize, seed: u64) -> Result<Self> {
        let (h, d) = (c.heads, c.head_dim);
        let shape = AttentionShape::new(1, rows, keys, h, h, d)?;
        let what = || format!("{rows} × {keys} tokens, {h} heads, head_dim {d}");
        crate::bench::host_memory_ok(what, crate::bench::input_bytes(&shape))?;
        let mut rng = Rng::new(seed);
        let mut make = |n| TensorData::from_f32(rng.normal_vec(n, 1.0), c.precision);
        Ok(Self {
            q: make(shape.q_len()),
            k: make(shape.kv_len()),
            v: make(shape.kv_len()),
            d_o: make(shape.q_len()),
            shapes: [shape.q_shape(), shape.kv_shape()],
        })
    }

    /// q, k, v, dO as views.
    fn views(&self) -> [TensorView<'_>; 4] {
        let [q, k] = self.shapes;
        [
            self.q.view(q),
            self.k.view(k),
            self.v.view(k),
            self.d_o.view(q),
        ]
    }
}

/// One run of `pass` on `inputs` (`fwd`: the forward's outputs, for the
/// backward), its stats.
fn run(e: &Engine, inputs: &Inputs, opts: &AttentionOptions, pass: Pass) -> Result<CallStats> {
    let [q, k, v, d_o] = inputs.views();
    Ok(match pass {
        Pass::Forward => e.forward(&ForwardInputs::new(q, k, v), opts)?.stats,
        Pass::Backward => {
            let fwd = e.forward(&ForwardInputs::new(q, k, v), opts)?;
            let b = BackwardInputs::new(ForwardInputs::new(q, k, v), &fwd, d_o)?;
            e.backward(&b, opts)?.stats
        }
    })
}

/// The fastest kernel time of each of `cases` over `repeats` rounds, each
/// round running every case once in turn (so a change of load on the host
/// affects them alike), after an untimed warm-up round that compiles the
/// kernels; and each case's last stats.
fn interleaved(
    e: &Engine,
    inputs: &Inputs,
    cases: &[AttentionOptions],
    pass: Pass,
    repeats: usize,
) -> Result<Vec<(f64, CallStats)>> {
    let mut best: Vec<(f64, CallStats)> = Vec::new();
    for opts in cases {
        best.push((f64::INFINITY, run(e, inputs, opts, pass)?));
    }
    for _ in 0..repeats.max(1) {
        for (opts, b) in cases.iter().zip(best.iter_mut()) {
            let stats = run(e, inputs, opts, pass)?;
            if stats.kernel_seconds < b.0 {
                *b = (stats.kernel_seconds, stats);
            }
        }
    }
    Ok(best)
}

/// The density sweep at `densities` with blocks of `block`, each forward
/// and backward against the dense time of the same run; with `counting`
/// (an engine made `with_io_counting`), the counted accesses too.
pub fn sparse_sweep(
    e: &Engine,
    counting: Option<&Engine>,
    c: &LayoutConfig,
    (densities, block): (&[f64], (usize, usize)),
    mut progress: impl FnMut(String),
) -> Result<SparseReport> {
    let inputs = Inputs::new(c, c.seqlen, c.seqlen, 17)?;
    let dense_opts = AttentionOptions::default().causal(c.causal);
    let grid = BlockGrid::new(c.seqlen, c.seqlen, block)?;
    let mut report = SparseReport {
        adapter: e.describe(),
        config: *c,
        block,
        dense_seconds: Vec::new(),
        points: Vec::new(),
    };
    let masks: Vec<BlockMask> = densities
        .iter()
        .enumerate()
        .map(|(i, &d)| BlockMask::random(grid, c.heads, d, 100 + i as u64))
        .collect();
    let mut cases = vec![dense_opts.clone()];
    cases.extend(
        masks
            .iter()
            .map(|m| dense_opts.clone().block_mask(m.clone())),
    );
    for pass in [Pass::Forward, Pass::Backward] {
        progress(format!(
            "{}: dense and {} densities, interleaved",
            pass.name(),
            densities.len()
        ));
        let times = interleaved(e, &inputs, &cases, pass, c.repeats)?;
        let dense = times[0].0;
        report.dense_seconds.push((pass, dense));
        for ((&target, mask), (opts, (seconds, stats))) in densities
            .iter()
            .zip(&masks)
            .zip(cases.iter().zip(&times).skip(1))
        {
            progress(format!(
                "{} density {target}: counting accesses",
                pass.name()
            ));
            let counted = match counting {
                Some(ce) => run(ce, &inputs, opts, pass)?.measured_accesses,
                None => None,
            };
            report.points.push(SparsePoint {
                pass,
                target,
                density: mask.density(),
                seconds: *seconds,
                ratio: seconds / (mask.density() * dense),
                reads: stats.accesses.reads,
                writes: stats.accesses.writes,
                counted: counted.map(|a| [a.reads, a.writes]),
            });
        }
    }
    Ok(report)
}

impl SparseReport {
    /// The table `bench --sparse` prints.
    pub fn print(&self) {
        let c = &self.config;
        println!("adapter: {}", self.adapter);
        println!(
            "block-sparse sweep: N {}, d {}, heads {}, {}{}, blocks {}×{}, fastest of {} (kernel time)",
            c.seqlen,
            c.head_dim,
            c.heads,
            c.precision,
            if c.causal { ", causal" } else { "" },
            self.block.0,
            self.block.1,
            c.repeats
        );
        println!("| pass | density | time | density × dense | ratio | accesses | counted |");
        println!("|---|---:|---:|---:|---:|---:|---:|");
        for (pass, dense) in &self.dense_seconds {
            println!(
                "| {} | dense | {:.1} ms | — | — | — | — |",
                pass.name(),
                dense * 1e3
            );
            for p in self.points.iter().filter(|p| p.pass == *pass) {
                let counted = match p.counted {
                    Some([r, w]) if r == p.reads && w == p.writes => "= analytic".to_string(),
                    Some([r, w]) => format!("{r} + {w} (≠ analytic)"),
                    None => "—".into(),
                };
                println!(
                    "| {} | {:.1}% | {:.1} ms | {:.1} ms | {:.2} | {:.1} M | {counted} |",
                    pass.name(),
                    p.density * 100.0,
                    p.seconds * 1e3,
                    p.density * dense * 1e3,
                    p.ratio,
                    p.accesses().total() as f64 / 1e6
                );
            }
        }
    }

    /// Time against density, each pass with its proportional line.
    pub fn chart(&self) -> Chart {
        let mut series = Vec::new();
        for (pass, dense) in &self.dense_seconds {
            let mut measured: Vec<(f64, f64)> = self
                .points
                .iter()
                .filter(|p| p.pass == *pass)
                .map(|p| (p.density * 100.0, p.seconds * 1e3))
                .collect();
            measured.push((100.0, dense * 1e3));
            let ideal = vec![
                (measured[0].0, measured[0].0 / 100.0 * dense * 1e3),
                (100.0, dense * 1e3),
            ];
            series.push(Series::new(format!("{} (measured)", pass.name()), measured));
            series.push(Series::new(
                format!("{}: density × dense", pass.name()),
                ideal,
            ));
        }
        let c = &self.config;
        Chart {
            title: format!(
                "Block-sparse time vs density — N {}, d {}, blocks {}×{}, {}",
                c.seqlen,
                c.head_dim,
                self.block.0,
                self.block.1,
                self.adapter.split(" (").next().unwrap_or(&self.adapter)
            ),
            x_label: "density: blocks allowed (%)".into(),
            y_label: "fastest kernel time (ms)".into(),
            log_x: false,
            log_y: false,
            series,
        }
    }

    pub fn plot(&self, path: &Path) -> Result<()> {
        Ok(render(&self.chart(), path)?)
    }
}

/// A packed batch against the same sequences run one by one.
#[derive(Clone, Debug, Serialize)]
pub struct VarlenReport {
    pub adapter: String,
    pub config: LayoutConfig,
    pub lens: Vec<usize>,
    /// Per pass: the packed batch's time, the sum of the sequences' times,
    /// their ratio, and the dispatches of each.
    pub passes: Vec<VarlenPass>,
}

#[derive(Clone, Debug, Serialize)]
pub struct VarlenPass {
    pub pass: Pass,
    pub packed_seconds: f64,
    pub separate_seconds: f64,
    pub ratio: f64,
    pub packed_dispatches: u32,
    pub separate_dispatches: u32,
}

/// Sequences of `lens` (queries and keys alike) in one packed call against
/// one call per sequence, forward and backward.
pub fn varlen_vs_separate(
    e: &Engine,
    c: &LayoutConfig,
    lens: &[usize],
    mut progress: impl FnMut(String),
) -> Result<VarlenReport> {
    let mut cu = vec![0i32];
    for &n in lens {
        let next = i32::try_from(n)
            .ok()
            .and_then(|n| cu[cu.len() - 1].checked_add(n));
        cu.push(next.ok_or_else(|| CliError::BadFlag {
            flag: "--varlen-lens",
            expected: "lengths whose sum fits in int32 (cu_seqlens)",
            value: format!("{lens:?}"),
        })?);
    }
    let total = cu[cu.len() - 1] as usize;
    let packed = Inputs::new(c, total, total, 23)?;
    let opts = AttentionOptions::default()
        .causal(c.causal)
        .varlen(Varlen::new(&cu, &cu)?);
    let dense = AttentionOptions::default().causal(c.causal);
    let separate: Vec<Inputs> = lens
        .iter()
        .enumerate()
        .map(|(i, &n)| Inputs::new(c, n, n, 29 + i as u64))
        .collect::<Result<_>>()?;
    let mut report = VarlenReport {
        adapter: e.describe(),
        config: *c,
        lens: lens.to_vec(),
        passes: Vec::new(),
    };
    for pass in [Pass::Forward, Pass::Backward] {
        progress(format!(
            "{}: packed and one by one, interleaved",
            pass.name()
        ));
        let (mut packed_seconds, mut separate_seconds) = (f64::INFINITY, f64::INFINITY);
        let (mut packed_dispatches, mut separate_dispatches) = (0, 0);
        run(e, &packed, &opts, pass)?;
        for inputs in &separate {
            run(e, inputs, &dense, pass)?;
        }
        for _ in 0..c.repeats.max(1) {
            let stats = run(e, &packed, &opts, pass)?;
            packed_seconds = packed_seconds.min(stats.kernel_seconds);
            packed_dispatches = stats.dispatches;
            let (mut sum, mut dispatches) = (0.0, 0);
            for inputs in &separate {
                let stats = run(e, inputs, &dense, pass)?;
                sum += stats.kernel_seconds;
                dispatches += stats.dispatches;
            }
            separate_seconds = separate_seconds.min(sum);
            separate_dispatches = dispatches;
        }
        report.passes.push(VarlenPass {
            pass,
            packed_seconds,
            separate_seconds,
            ratio: packed_seconds / separate_seconds,
            packed_dispatches,
            separate_dispatches,
        });
    }
    Ok(report)
}

impl VarlenReport {
    pub fn print(&self) {
        let c = &self.config;
        println!("adapter: {}", self.adapter);
        println!(
            "packed batch of {} sequences {:?} (d {}, heads {}, {}{}), fastest of {} (kernel time)",
            self.lens.len(),
            self.lens,
            c.head_dim,
            c.heads,
            c.precision,
            if c.causal { ", causal" } else { "" },
            c.repeats
        );
        println!("| pass | packed (one call) | one by one (sum) | packed / sum | dispatches |");
        println!("|---|---:|---:|---:|---:|");
        for p in &self.passes {
            println!(
                "| {} | {:.1} ms | {:.1} ms | {:.2} | {} vs {} |",
                p.pass.name(),
                p.packed_seconds * 1e3,
                p.separate_seconds * 1e3,
                p.ratio,
                p.packed_dispatches,
                p.separate_dispatches
            );
        }
    }
}

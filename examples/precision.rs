//! The precision study, in two parts.
//!
//! 1. One row at a time: whole-row softmax, the online
//!    softmax over blocks of B keys, and the wrong "independent softmax per
//!    block", in f32, in pure f16 and with f16 storage + f32 math, measured
//!    against f64 on seeded random rows, for the probabilities and for the
//!    attention output `o = softmax(s)·v`.
//! 2. Whole problems in every storage format (`flashattn_cli::lowp`): f32,
//!    f16, bf16, FP8 and FP8 with incoherent processing, on normal inputs,
//!    on inputs with outlier channels and on FlashAttention-3's outlier
//!    distribution, against the f64 reference on the original f32 inputs,
//!    swept over N (the planner's kernel) and over the key block size Bc
//!    (the tiled kernel), on the best adapter (the CPU backend without one:
//!    N only).
//!
//! `cargo run --release --example precision [-- OUT.svg|png]` prints the
//! tables and writes the attention chart to OUT (default
//! `docs/precision.svg`), the softmax chart next to it (`OUT-softmax.svg`),
//! and part 2's charts (`OUT-lowp.svg`, RMSE vs N; `OUT-lowp-blocks.svg`,
//! RMSE vs Bc). `FLASHATTN_PRECISION_QUICK=1` runs part 2 on small sizes.

use std::path::{Path, PathBuf};

use flashattn::random::Rng;
use flashattn::{Backend, Engine, KernelFamily, PlanOverrides};
use flashattn_cli::lowp::{self, Format, InputKind, Point, Problem};
use flashattn_cli::plot::{self, Chart, Series};
use flashattn_cli::precision::{
    attention_f64, blockwise_independent_attention, blockwise_independent_softmax, max_abs_diff,
    online_attention, online_attention_split, online_softmax, online_softmax_split, softmax_f64,
    whole_row_attention, whole_row_softmax, Arith, F16Storage, Merge, StudyError, F16, F32,
};
use rayon::prelude::*;

const N: usize = 1024;
const ROWS: usize = 1000;
/// Scores ~ N(0, 2²): `q·k/√d` of moderately peaked attention, so the
/// running max grows many times along a row and the rescaling is exercised.
const SCORE_STD: f32 = 2.0;
const BLOCKS: [usize; 11] = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024];
/// Methods per block size: online (flashattn's running merge) in three
/// precisions, FlashAttention-1's block-local merge in f16, independent
/// blocks in two precisions.
const METHODS: [&str; 6] = [
    "f32 online",
    "f16 online",
    "f16 online FA1 merge",
    "f16 storage online",
    "f32 independent",
    "f16 independent",
];
const WHOLE: [&str; 3] = ["f32 whole row", "f16 whole row", "f16 storage whole row"];

/// Max absolute errors: `[block][method]` and the whole-row baselines.
#[derive(Clone, Copy)]
struct Errors {
    blocks: [[f64; 6]; BLOCKS.len()],
    whole: [f64; 3],
}

impl Errors {
    const ZERO: Self = Self {
        blocks: [[0.0; 6]; BLOCKS.len()],
        whole: [0.0; 3],
    };

    fn max(mut self, other: Self) -> Self {
        for (a, b) in self
            .blocks
            .iter_mut()
            .flatten()
            .zip(other.blocks.iter().flatten())
        {
            *a = a.max(*b);
        }
        for (a, b) in self.whole.iter_mut().zip(other.whole) {
            *a = a.max(b);
        }
        self
    }
}

/// Errors of one row: (softmax probabilities, attention output).
fn row_errors(s: &[f32], v: &[f32]) -> Result<(Errors, Errors), StudyError> {
    let p_ref = softmax_f64(s);
    let o_ref = attention_f64(s, v)?;
    let o_err = |o: f32| (f64::from(o) - o_ref).abs();
    let (mut p, mut o) = (Errors::ZERO, Errors::ZERO);
    for (i, &b) in BLOCKS.iter().enumerate() {
        let sizes: Vec<usize> = s.chunks(b).map(<[f32]>::len).collect();
        p.blocks[i] = [
            max_abs_diff(&online_softmax::<F32>(s, b)?, &p_ref),
            max_abs_diff(&online_softmax::<F16>(s, b)?, &p_ref),
            max_abs_diff(
                &online_softmax_split::<F16>(s, &sizes, Merge::BlockLocal)?,
                &p_ref,
            ),
            max_abs_diff(&online_softmax::<F16Storage>(s, b)?, &p_ref),
            max_abs_diff(&blockwise_independent_softmax::<F32>(s, b)?, &p_ref),
            max_abs_diff(&blockwise_independent_softmax::<F16>(s, b)?, &p_ref),
        ];
        o.blocks[i] = [
            o_err(online_attention::<F32>(s, v, b)?),
            o_err(online_attention::<F16>(s, v, b)?),
            o_err(online_attention_split::<F16>(
                s,
                v,
                &sizes,
                Merge::BlockLocal,
            )?),
            o_err(online_attention::<F16Storage>(s, v, b)?),
            o_err(blockwise_independent_attention::<F32>(s, v, b)?),
            o_err(blockwise_independent_attention::<F16>(s, v, b)?),
        ];
    }
    fn whole<R: Arith>(s: &[f32], v: &[f32], p_ref: &[f64]) -> Result<(f64, f32), StudyError> {
        Ok((
            max_abs_diff(&whole_row_softmax::<R>(s), p_ref),
            whole_row_attention::<R>(s, v)?,
        ))
    }
    for (k, (pe, ov)) in [
        whole::<F32>(s, v, &p_ref)?,
        whole::<F16>(s, v, &p_ref)?,
        whole::<F16Storage>(s, v, &p_ref)?,
    ]
    .into_iter()
    .enumerate()
    {
        p.whole[k] = pe;
        o.whole[k] = o_err(ov);
    }
    Ok((p, o))
}

fn print_table(what: &str, e: &Errors) {
    println!("\nmax |error| vs f64 whole-row, {what}:");
    print!("{:>6}", "B");
    for m in METHODS {
        print!(" {m:>20}");
    }
    println!();
    for (b, row) in BLOCKS.iter().zip(&e.blocks) {
        print!("{b:>6}");
        for x in row {
            print!(" {x:>20.3e}");
        }
        println!();
    }
    for (name, x) in WHOLE.iter().zip(e.whole) {
        println!("{name:>25}: {x:.3e}");
    }
}

fn chart(what: &str, e: &Errors) -> Chart {
    let b = |i: usize| BLOCKS[i] as f64;
    let mut series: Vec<Series> = METHODS
        .iter()
        .enumerate()
        .map(|(m, name)| {
            Series::new(
                *name,
                // A log axis cannot show an exact 0 (never seen in practice).
                (0..BLOCKS.len())
                    .map(|i| (b(i), e.blocks[i][m]))
                    .filter(|p| p.1 > 0.0)
                    .collect(),
            )
        })
        .collect();
    for (name, x) in WHOLE.iter().zip(e.whole).take(2) {
        series.push(Series::new(
            format!("{name} (baseline)"),
            vec![(b(0), x), (b(BLOCKS.len() - 1), x)],
        ));
    }
    Chart {
        title: format!("{what}: max |error| vs f64, N = {N}, {ROWS} rows"),
        x_label: "block size B (keys per block)".into(),
        y_label: "max absolute error".into(),
        log_x: true,
        log_y: true,
        series,
    }
}

/// `path` with `-suffix` added to its stem.
fn sibling(path: &Path, suffix: &str) -> PathBuf {
    let stem = path.file_stem().unwrap_or_default().to_string_lossy();
    let ext = path.extension().unwrap_or_default().to_string_lossy();
    path.with_file_name(format!("{stem}-{suffix}.{ext}"))
}

/// Part 2's sizes: N swept at d 128, Bc swept at N 1024, d 64 (d 128's K
/// and V tiles leave lavapipe's 32 KiB little room); two heads.
struct Sizes {
    seqlens: Vec<usize>,
    head_dim: usize,
    block_seqlen: usize,
    block_head_dim: usize,
    blocks: Vec<u32>,
}

impl Sizes {
    fn new(quick: bool) -> Self {
        if quick {
            return Self {
                seqlens: vec![64, 256],
                head_dim: 64,
                block_seqlen: 128,
                block_head_dim: 32,
                blocks: vec![4, 16],
            };
        }
        Self {
            seqlens: vec![256, 1024, 4096, 8192],
            head_dim: 128,
            block_seqlen: 1024,
            block_head_dim: 64,
            blocks: vec![4, 8, 16, 32],
        }
    }
}

/// Every (input kind, format) at one problem (its inputs seeded by N, so a
/// block sweep sees the same inputs at every Bc); `x` labels the points.
fn measure_all(
    backend: &Backend,
    p: &Problem,
    x: usize,
    overrides: &PlanOverrides,
) -> Result<Vec<Point>, Box<dyn std::error::Error>> {
    let mut out = Vec::new();
    for kind in InputKind::ALL {
        let data = p.inputs(kind, 15 + p.seqlen as u64);
        let reference = lowp::reference(p, &data)?;
        for format in Format::ALL {
            let error = lowp::measure(backend, format, (p, &data), &reference, overrides)?;
            out.push(Point {
                kind,
                format,
                x,
                error,
            });
        }
    }
    Ok(out)
}

/// A table of RMSE (max |error|) per (inputs, format) row and `x` column.
fn print_lowp_table(points: &[Point], x_name: &str) {
    let mut xs: Vec<usize> = points.iter().map(|p| p.x).collect();
    xs.sort_unstable();
    xs.dedup();
    print!("| inputs | format |");
    xs.iter().for_each(|x| print!(" {x_name} = {x} |"));
    println!("\n|---|---|{}", "---:|".repeat(xs.len()));
    for kind in InputKind::ALL {
        for format in Format::ALL {
            print!("| {} | {} |", kind.name(), format.name());
            for &x in &xs {
                match points
                    .iter()
                    .find(|p| p.kind == kind && p.format == format && p.x == x)
                {
                    Some(p) => print!(" {:.2e} ({:.1e}) |", p.error.rmse, p.error.max),
                    None => print!(" — |"),
                }
            }
            println!();
        }
    }
    for kind in InputKind::ALL {
        let gains: Vec<String> = lowp::hadamard_gain(points, kind)
            .iter()
            .map(|(x, g)| format!("{x_name} {x}: {g:.2}x"))
            .collect();
        println!(
            "FP8 RMSE / FP8 + Hadamard RMSE, {}: {}",
            kind.name(),
            gains.join(", ")
        );
    }
}

/// The series part 2's charts draw (f32 is ~1e-7 everywhere: left out).
const CHART_PAIRS: [(InputKind, Format); 8] = [
    (InputKind::Normal, Format::F16),
    (InputKind::Normal, Format::Bf16),
    (InputKind::Normal, Format::Fp8),
    (InputKind::Normal, Format::Fp8Hadamard),
    (InputKind::OutlierChannels, Format::Fp8),
    (InputKind::OutlierChannels, Format::Fp8Hadamard),
    (InputKind::Fa3, Format::Fp8),
    (InputKind::Fa3, Format::Fp8Hadamard),
];

/// Part 2: the formats swept over N, then over Bc; tables and charts (the
/// files written).
fn low_precision(out: &Path) -> Result<Vec<PathBuf>, Box<dyn std::error::Error>> {
    let sizes = Sizes::new(std::env::var_os("FLASHATTN_PRECISION_QUICK").is_some());
    let engine = Engine::new();
    let backend = match engine {
        Ok(e) => Backend::Wgpu(Box::new(e)),
        Err(e) => {
            println!("\nno adapter ({e}): part 2 runs on the CPU backend, N only");
            Backend::Cpu
        }
    };
    println!("\nPart 2 on {}", backend.name());
    let mut by_n = Vec::new();
    for &n in &sizes.seqlens {
        let p = Problem {
            seqlen: n,
            heads: 2,
            head_dim: sizes.head_dim,
        };
        by_n.extend(measure_all(&backend, &p, n, &PlanOverrides::default())?);
    }
    println!(
        "\nRMSE (max |error|) of o vs the f64 reference on the f32 inputs: batch 1, heads 2, d {}, the planner's kernel",
        sizes.head_dim
    );
    print_lowp_table(&by_n, "N");
    let title = format!("RMSE of o vs N (d {}, 2 heads)", sizes.head_dim);
    let mut written = vec![sibling(out, "lowp")];
    let chart = lowp::chart(title, "N (queries = keys)", &by_n, &CHART_PAIRS);
    plot::render(&chart, &written[0])?;
    if !matches!(backend, Backend::Wgpu(_)) {
        return Ok(written);
    }
    let mut by_block = Vec::new();
    let p = Problem {
        seqlen: sizes.block_seqlen,
        heads: 2,
        head_dim: sizes.block_head_dim,
    };
    for &bc in &sizes.blocks {
        let overrides = PlanOverrides::default().bc(bc).kernel(KernelFamily::Tiled);
        by_block.extend(measure_all(&backend, &p, bc as usize, &overrides)?);
    }
    println!(
        "\nRMSE (max |error|) by key block size Bc: the tiled kernel, N {}, d {}, 2 heads",
        p.seqlen, p.head_dim
    );
    print_lowp_table(&by_block, "Bc");
    let title = format!(
        "RMSE of o vs Bc (tiled kernel, N {}, d {})",
        p.seqlen, p.head_dim
    );
    let chart = lowp::chart(title, "key block size Bc", &by_block, &CHART_PAIRS);
    written.push(sibling(out, "lowp-blocks"));
    plot::render(&chart, &written[1])?;
    Ok(written)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "docs/precision.svg".into()),
    );
    // Inputs rounded to f16 once, so every method and the f64 reference see
    // the same exactly representable numbers and only arithmetic differs.
    let mut rng = Rng::new(6);
    let f16 = |x: f32| half::f16::from_f32(x).to_f32();
    let rows: Vec<(Vec<f32>, Vec<f32>)> = (0..ROWS)
        .map(|_| {
            let s = rng.normal_vec(N, SCORE_STD).into_iter().map(f16).collect();
            let v = rng.normal_vec(N, 1.0).into_iter().map(f16).collect();
            (s, v)
        })
        .collect();
    let per_row = rows
        .par_iter()
        .map(|(s, v)| row_errors(s, v))
        .collect::<Result<Vec<_>, StudyError>>()?;
    let (p, o) = per_row
        .into_iter()
        .fold((Errors::ZERO, Errors::ZERO), |(p, o), (pr, or)| {
            (p.max(pr), o.max(or))
        });
    println!(
        "{ROWS} rows of N = {N} scores ~ N(0, {SCORE_STD}²), v ~ N(0, 1), inputs rounded to f16; seed 6"
    );
    print_table("softmax probabilities", &p);
    print_table("attention output o = softmax(s)·v", &o);

    if let Some(dir) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(dir)?;
    }
    plot::render(&chart("Attention output o = softmax(s)·v", &o), &out)?;
    let soft = sibling(&out, "softmax");
    plot::render(&chart("Softmax probabilities", &p), &soft)?;
    println!("\nwrote {} and {}", out.display(), soft.display());
    for path in low_precision(&out)? {
        println!("wrote {}", path.display());
    }
    Ok(())
}

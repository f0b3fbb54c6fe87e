//! The precision study (seeds, exercise 6): whole-row softmax, the online
//! softmax over blocks of B keys, and the wrong "independent softmax per
//! block", in f32, in pure f16 and with f16 storage + f32 math, measured
//! against f64 on seeded random rows, for the probabilities and for the
//! attention output `o = softmax(s)·v`.
//!
//! `cargo run --release --example precision [-- OUT.svg|png]` prints two
//! tables and writes the attention chart to OUT (default `docs/precision.svg`)
//! and the softmax chart next to it (`OUT-softmax.svg`).

use std::path::{Path, PathBuf};

use flashattn::random::Rng;
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

fn softmax_path(path: &Path) -> PathBuf {
    let stem = path.file_stem().unwrap_or_default().to_string_lossy();
    let ext = path.extension().unwrap_or_default().to_string_lossy();
    path.with_file_name(format!("{stem}-softmax.{ext}"))
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
    let soft = softmax_path(&out);
    plot::render(&chart("Softmax probabilities", &p), &soft)?;
    println!("\nwrote {} and {}", out.display(), soft.display());
    Ok(())
}

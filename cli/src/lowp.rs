//! The precision study's second part: whole attention problems in every
//! storage format flashattn has — f32, f16, bf16, FP8 (e4m3) and FP8 with
//! incoherent processing — measured against the f64 reference on the
//! original f32 inputs (RMSE and max |error| of `o`), on normal inputs, on
//! inputs with outlier channels in q and k, and on FlashAttention-3's
//! outlier distribution. `examples/precision.rs` sweeps it over N and the
//! key block size and prints and plots the results.

use crate::plot::{Chart, Series};
use flashattn::accuracy::{error_stats, ErrorStats};
use flashattn::random::{outlier_channels, scale_channels, Rng};
use flashattn::reference::ReferenceOutput;
use flashattn::{
    AttentionOptions, Backend, ForwardInputs, Fp8Options, PlanOverrides, Precision, Result,
    TensorData, TensorView,
};

/// A storage format of q, k, v.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Format {
    F32,
    F16,
    Bf16,
    Fp8,
    /// FP8 with q and k through the seeded Walsh–Hadamard transform.
    Fp8Hadamard,
}

impl Format {
    pub const ALL: [Format; 5] = [
        Format::F32,
        Format::F16,
        Format::Bf16,
        Format::Fp8,
        Format::Fp8Hadamard,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Format::F32 => "f32",
            Format::F16 => "f16",
            Format::Bf16 => "bf16",
            Format::Fp8 => "FP8",
            Format::Fp8Hadamard => "FP8 + Hadamard",
        }
    }

    /// The storage precision, for the formats that have one.
    fn precision(self) -> Option<Precision> {
        match self {
            Format::F32 => Some(Precision::F32),
            Format::F16 => Some(Precision::F16),
            Format::Bf16 => Some(Precision::Bf16),
            Format::Fp8 | Format::Fp8Hadamard => None,
        }
    }

    fn fp8(self) -> Fp8Options {
        match self {
            Format::Fp8Hadamard => Fp8Options::hadamard(Fp8Options::DEFAULT_SEED),
            _ => Fp8Options::default(),
        }
    }
}

/// What q, k and v hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum InputKind {
    /// Every entry `N(0, 1)`.
    Normal,
    /// `N(0, 1)`, with four channels of q and k ×10, ×20, ×35 and ×50 (the
    /// same channels in every row), as LLM activations have.
    OutlierChannels,
    /// FlashAttention-3's FP8 study: every entry of q, k and v
    /// `N(0, 1) + N(0, 10²)·Bernoulli(0.001)`.
    Fa3,
}

impl InputKind {
    pub const ALL: [InputKind; 3] = [
        InputKind::Normal,
        InputKind::OutlierChannels,
        InputKind::Fa3,
    ];

    pub fn name(self) -> &'static str {
        match self {
            InputKind::Normal => "normal",
            InputKind::OutlierChannels => "outlier channels",
            InputKind::Fa3 => "FA3 outliers",
        }
    }
}

/// One problem: batch 1, `heads` query and kv heads, N queries and keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Problem {
    pub seqlen: usize,
    pub heads: usize,
    pub head_dim: usize,
}

impl Problem {
    pub fn shape(&self) -> [usize; 4] {
        [1, self.seqlen, self.heads, self.head_dim]
    }

    /// q, k, v in f32, seeded.
    pub fn inputs(&self, kind: InputKind, seed: u64) -> [Vec<f32>; 3] {
        let mut rng = Rng::new(seed);
        let n = self.shape().iter().product();
        let channels = outlier_channels(self.head_dim);
        std::array::from_fn(|t| match kind {
            InputKind::Normal => rng.normal_vec(n, 1.0),
            InputKind::OutlierChannels => {
                let mut x = rng.normal_vec(n, 1.0);
                if t < 2 {
                    scale_channels(&mut x, self.head_dim, &channels);
                }
                x
            }
            InputKind::Fa3 => rng.normal_with_outliers(n, 0.001, 10.0),
        })
    }
}

/// The f64 reference on the original (f32) inputs.
pub fn reference(p: &Problem, data: &[Vec<f32>; 3]) -> Result<ReferenceOutput> {
    let [q, k, v] = data.each_ref().map(|x| TensorView::f32(p.shape(), x));
    flashattn::reference::forward(&q, &k, &v, &AttentionOptions::default())
}

/// The error of `o` in `format` against `reference`: inputs rounded to the
/// format (f16, bf16) or quantized (FP8) by the backend's own path.
pub fn measure(
    backend: &Backend,
    format: Format,
    (p, data): (&Problem, &[Vec<f32>; 3]),
    reference: &ReferenceOutput,
    overrides: &PlanOverrides,
) -> Result<ErrorStats> {
    let opts = AttentionOptions::default();
    let out = match format.precision() {
        Some(precision) => {
            let stored = data
                .each_ref()
                .map(|x| TensorData::from_f32(x.clone(), precision));
            let [q, k, v] = stored.each_ref().map(|t| t.view(p.shape()));
            backend.forward(&ForwardInputs::new(q, k, v), &opts, overrides)?
        }
        None => {
            let [q, k, v] = data.each_ref().map(|x| TensorView::f32(p.shape(), x));
            backend.forward_fp8(
                &ForwardInputs::new(q, k, v),
                &opts,
                &format.fp8(),
                overrides,
            )?
        }
    };
    let o: Vec<f64> = out.o.to_f32().into_iter().map(f64::from).collect();
    Ok(error_stats(&o, &reference.o))
}

/// One measured point of a sweep.
#[derive(Clone, Copy, Debug)]
pub struct Point {
    pub kind: InputKind,
    pub format: Format,
    /// N, or the key block size.
    pub x: usize,
    pub error: ErrorStats,
}

/// RMSE with incoherent processing over RMSE without, per `x`, for `kind`.
pub fn hadamard_gain(points: &[Point], kind: InputKind) -> Vec<(usize, f64)> {
    let rmse = |f: Format, x: usize| {
        points
            .iter()
            .find(|p| p.kind == kind && p.format == f && p.x == x)
            .map(|p| p.error.rmse)
    };
    let mut xs: Vec<usize> = points
        .iter()
        .filter(|p| p.kind == kind)
        .map(|p| p.x)
        .collect();
    xs.sort_unstable();
    xs.dedup();
    xs.into_iter()
        .filter_map(|x| Some((x, rmse(Format::Fp8, x)? / rmse(Format::Fp8Hadamard, x)?)))
        .collect()
}

/// A log-log chart of RMSE against `x` for the given (kind, format) pairs.
pub fn chart(
    title: String,
    x_label: &str,
    points: &[Point],
    pairs: &[(InputKind, Format)],
) -> Chart {
    let series = pairs
        .iter()
        .map(|&(kind, format)| {
            let xy = points
                .iter()
                .filter(|p| p.kind == kind && p.format == format && p.error.rmse > 0.0)
                .map(|p| (p.x as f64, p.error.rmse))
                .collect();
            Series::new(format!("{}, {}", format.name(), kind.name()), xy)
        })
        .collect();
    Chart {
        title,
        x_label: x_label.into(),
        y_label: "RMSE of o vs the f64 reference".into(),
        log_x: true,
        log_y: true,
        series,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn inputs_have_the_outliers_they_claim() {
        let p = Problem {
            seqlen: 64,
            heads: 2,
            head_dim: 64,
        };
        let max = |x: &[f32]| x.iter().fold(0f32, |m, v| m.max(v.abs()));
        let [q, _, v] = p.inputs(InputKind::Normal, 1);
        assert!(max(&q) < 6.0);
        let [q, k, v2] = p.inputs(InputKind::OutlierChannels, 1);
        assert!(max(&q) > 60.0 && max(&k) > 60.0, "channels ×50");
        assert!(max(&v2) < 6.0, "v keeps no outliers");
        let [q, _, _] = p.inputs(InputKind::Fa3, 1);
        assert!(max(&q) > 8.0, "rare N(0, 100) outliers");
        assert_eq!(v.len(), 64 * 2 * 64);
    }

    #[test]
    fn fp8_with_hadamard_beats_fp8_on_outlier_channels_and_bf16_is_coarser_than_f16() {
        let p = Problem {
            seqlen: 96,
            heads: 2,
            head_dim: 64,
        };
        let none = PlanOverrides::default();
        let mut points = Vec::new();
        for kind in [InputKind::Normal, InputKind::OutlierChannels] {
            let data = p.inputs(kind, 3);
            let r = reference(&p, &data).unwrap();
            for format in Format::ALL {
                let error = measure(&Backend::Cpu, format, (&p, &data), &r, &none).unwrap();
                points.push(Point {
                    kind,
                    format,
                    x: p.seqlen,
                    error,
                });
            }
        }
        let get = |k, f| {
            points
                .iter()
                .find(|p| p.kind == k && p.format == f)
                .unwrap()
                .error
                .rmse
        };
        let n = InputKind::Normal;
        assert!(get(n, Format::F32) < 1e-6);
        assert!(get(n, Format::F16) < get(n, Format::Bf16));
        assert!(get(n, Format::Bf16) < get(n, Format::Fp8));
        let gain = hadamard_gain(&points, InputKind::OutlierChannels);
        assert_eq!(gain.len(), 1);
        assert!(gain[0].1 > 2.0, "{gain:?}");
        let c = chart("t".into(), "N", &points, &[(n, Format::Fp8)]);
        assert_eq!(c.series[0].points.len(), 1);
    }
}

//! FP8 cases shared by the CPU, wgpu and CUDA suites (tests/fp8.rs,
//! tests/cuda.rs): problems with outlier channels, FP8's rule (RMSE within
//! 10% of the naive f64 quantization, the LSE under the accuracy rule),
//! empty rows and bad inputs, and the quantizer's hard inputs.

use super::Case;
use flashattn::accuracy::Fp8Report;
use flashattn::random::{outlier_channels, scale_channels, Rng};
use flashattn::{AttentionOptions, ForwardInputs, ForwardOutput, Fp8Options, TensorView};

/// One FP8 problem: sizes and options (a [`Case`]), and the q/k channels
/// made outliers.
#[derive(Clone, Debug)]
pub struct Fp8Case {
    pub case: Case,
    /// `(channel, factor)` applied to every row of q and k.
    pub outliers: Vec<(usize, f32)>,
}

impl Fp8Case {
    pub fn new(case: Case) -> Self {
        Self {
            case,
            outliers: Vec::new(),
        }
    }
    /// Four channels of q and k ×10, ×20, ×35 and ×50, as in LLM activations.
    pub fn outliers(self) -> Self {
        let outliers = outlier_channels(self.case.head_dim).to_vec();
        Self { outliers, ..self }
    }

    pub fn shapes(&self) -> [[usize; 4]; 3] {
        let c = &self.case;
        let q = [c.batch, c.seqlen_q, c.heads_q, c.head_dim];
        let kv = [c.batch, c.seqlen_k, c.heads_kv, c.head_dim];
        [q, kv, kv]
    }

    /// q, k, v in f32 (q and k with their outlier channels).
    pub fn inputs(&self) -> [Vec<f32>; 3] {
        let mut rng = Rng::new(17);
        let shapes = self.shapes();
        std::array::from_fn(|t| {
            let mut x = rng.normal_vec(shapes[t].iter().product(), 1.0);
            if t < 2 {
                scale_channels(&mut x, self.case.head_dim, &self.outliers);
            }
            x
        })
    }

    pub fn opts(&self) -> &AttentionOptions {
        &self.case.opts
    }
}

pub fn views<'a>(case: &Fp8Case, data: &'a [Vec<f32>; 3]) -> [TensorView<'a>; 3] {
    let s = case.shapes();
    [0, 1, 2].map(|t| TensorView::f32(s[t], &data[t]))
}

/// The kernel adds no error of its own beyond rounding P: its RMSE is
/// within 10% of the naive f64 quantization's, and its LSE, which P's
/// rounding does not reach, meets docs/semantics.md's accuracy rule on the inputs as
/// quantized (`Fp8Report::lse_rule`, whose rustdoc derives why).
pub fn assert_close_to_naive(case: &Fp8Case, fp8: &Fp8Options, r: &Fp8Report) {
    let lse = &r.lse_rule;
    eprintln!(
        "{case:?} {fp8:?}: o {} | naive {} | lse {} | rule on the quantized inputs: {lse}",
        r.o, r.naive, r.lse
    );
    assert!(r.naive.rmse > 0.0, "{case:?}: quantization changed nothing");
    assert!(
        r.rmse_ratio() <= 1.1,
        "{case:?} {fp8:?}: RMSE {:.4e} vs naive f64 {:.4e} (ratio {:.3})",
        r.o.rmse,
        r.naive.rmse,
        r.rmse_ratio()
    );
    assert!(lse.passed(), "{case:?} {fp8:?}: {lse}");
}

pub fn cases() -> Vec<Fp8Case> {
    let causal = AttentionOptions::default().causal(true);
    let window = AttentionOptions::default().window(Some(20), Some(5));
    vec![
        Fp8Case::new(Case::new(97, 113, 64)),
        Fp8Case::new(Case::new(113, 97, 59).opts(causal)),
        Fp8Case::new(Case::new(64, 80, 32).heads(4, 2).batch(2)),
        Fp8Case::new(Case::new(80, 64, 128).heads(4, 1).opts(window)),
        Fp8Case::new(Case::new(70, 90, 24).opts(AttentionOptions::default().softcap(5.0))),
        Fp8Case::new(Case::new(33, 47, 3)),
    ]
}

pub const HADAMARD: Fp8Options = Fp8Options::hadamard(9);

/// Rows that see no key give o = 0 and lse = -inf; a non-finite input is
/// an error naming it; the layouts and a v head dim of its own are
/// `Unsupported` (FP8 takes the band and score options only).
pub fn check_empty_rows_and_bad_inputs(
    forward: impl Fn(&ForwardInputs, &AttentionOptions) -> flashattn::Result<ForwardOutput>,
) {
    let case = Fp8Case::new(Case::new(40, 10, 32).opts(AttentionOptions::default().causal(true)));
    let data = case.inputs();
    let [q, k, v] = views(&case, &data);
    let out = forward(&ForwardInputs::new(q, k, v), case.opts()).unwrap();
    // Rows 0..30 see no key.
    let o = out.o.to_f32();
    for h in 0..2 {
        for i in 0..30 {
            assert_eq!(out.lse[h * 40 + i], f32::NEG_INFINITY);
            assert!(o[(i * 2 + h) * 32..][..32].iter().all(|&x| x == 0.0));
        }
    }
    let mut bad = data.clone();
    bad[1][5] = f32::INFINITY;
    let [q, k, v] = views(&case, &bad);
    let err = forward(&ForwardInputs::new(q, k, v), case.opts()).unwrap_err();
    assert!(
        matches!(
            err,
            flashattn::Error::NonFiniteInput {
                tensor: "k",
                index: 5
            }
        ),
        "{err:?}"
    );
    let [q, k, v] = views(&case, &data);
    let sinks = flashattn::Sinks::new(&[0.0, 1.0]);
    let with_sinks = case.opts().clone().sinks(sinks);
    let err = forward(&ForwardInputs::new(q, k, v), &with_sinks).unwrap_err();
    assert!(
        matches!(
            err,
            flashattn::Error::Unsupported {
                feature: "attention sinks",
                ..
            }
        ),
        "{err:?}"
    );
    let v24: Vec<f32> = vec![0.5; 10 * 2 * 24];
    let v24 = TensorView::f32([1, 10, 2, 24], &v24);
    let err = forward(&ForwardInputs::new(q, k, v24), case.opts()).unwrap_err();
    assert!(
        matches!(err, flashattn::Error::Unsupported { .. }),
        "{err:?}"
    );
}

/// Heads of every kind for the quantizer: magnitudes from 2⁻⁶⁰ to 2⁶⁰
/// (random mantissas hit exact ties of `max/448` and of the codes), a head
/// of zeros, one below 2⁻¹¹⁷ (scale 0), one of subnormal f32 values, one
/// whose max is 448 (scale 1) and whose other values lie exactly on e4m3
/// rounding ties.
pub fn quantizer_inputs(heads: usize, seqlen: usize, d: usize) -> Vec<f32> {
    let mut rng = Rng::new(d as u64 * 7 + 1);
    let mut x = rng.normal_vec(seqlen * heads * d, 1.0);
    let factors: Vec<f32> = (0..heads)
        .map(|h| match h {
            0 => 0.0,
            1 => 1e-37,
            2 => 1e-41,
            _ => 2f32.powi((rng.next_u64() % 121) as i32 - 60) * (1.0 + rng.uniform() as f32),
        })
        .collect();
    let ties = [
        448.0,
        1.0625,
        1.1875,
        2.5 / 512.0,
        0.5 / 512.0,
        7.5 / 512.0,
        1.9375,
        -1.0625,
        -0.0,
        3.0,
        0.0146484375,
        240.0,
    ];
    for (i, v) in x.iter_mut().enumerate() {
        let (s, h, c) = (i / (heads * d), (i / d) % heads, i % d);
        *v = if h == 3 {
            ties[(s * d + c) % ties.len()]
        } else {
            *v * factors[h]
        };
    }
    x
}

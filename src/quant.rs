//! FP8 (e4m3) quantization exactly as docs/semantics.md defines it, on the host: the
//! CPU backend's FP8 path, the f64 FP8 baseline and the tests of the wgpu
//! quantization kernels (which must produce these bits) all use it.
//!
//! - **e4m3** (`e4m3fn`, FlashAttention-3's FP8): 1 sign, 4 exponent bits
//!   (bias 7), 3 mantissa bits, no infinities; ±448 is the largest finite
//!   value, `0x7f`/`0xff` are NaN and never produced; subnormals are
//!   multiples of 2⁻⁹.
//! - **Scales**: one f32 per (batch, head), `scale = max|x| / 448` (f32
//!   division); a head whose `max|x|` is below 2⁻¹¹⁷ (where that scale would
//!   not be a normal f32) quantizes to zeros with scale 0.
//! - **Codes**: `x8 = e4m3(x / scale)`, the exact quotient rounded to nearest
//!   even, saturating at ±448; zero (of either sign) is code 0.
//! - **Incoherent processing** ([`Hadamard`]): q and k rows multiplied along
//!   the head dim by `H·diag(signs)/√n` — the Walsh–Hadamard matrix of order
//!   `n`, random ±1 signs from a seed — before their scales are taken. A head
//!   dim `d` that is not a power of two is zero-padded to `n =
//!   d.next_power_of_two()` inside the transform, so the rows become `n`
//!   long; `q·k` is unchanged in exact arithmetic either way.
//! - **Subnormal f32** values (inputs and every intermediate of the
//!   transform) are flushed to zero first, so adapters that flush them agree.
//! - **P** is quantized with its own scale [`P_SCALE`] `= 1/448` before
//!   `P·V` ([`round_p`]): P ≤ 1 after the running max is subtracted, so its
//!   largest value maps to e4m3's largest.
//!
//! Stored rows are padded with zero codes to a multiple of 4 elements
//! ([`row_len`]), so that a row starts on a word of four codes.

use crate::api::inputs::ForwardInputs;
use crate::api::options::{AttentionOptions, Fp8Options};
use crate::api::shape::AttentionShape;
use crate::api::tensor::TensorView;
use crate::error::{Error, Result};
use crate::random::Rng;
use rayon::prelude::*;

/// The largest finite e4m3 value.
pub const E4M3_MAX: f32 = 448.0;
/// The code of +448 (saturation).
pub const E4M3_SATURATED: u8 = 0x7e;
/// The scale P is quantized with before `P·V`.
pub const P_SCALE: f32 = 1.0 / E4M3_MAX;
/// Below this `max|x|` a head quantizes to zeros (`max|x| / 448` would not
/// be a normal f32): 2⁻¹¹⁷.
pub const MIN_ABSMAX: f32 = f32::from_bits(10 << 23);

/// The value of an e4m3 code (NaN for `0x7f`/`0xff`).
pub fn e4m3_to_f32(code: u8) -> f32 {
    let sign = if code & 0x80 != 0 { -1.0 } else { 1.0 };
    let (e, m) = ((code >> 3) & 0xf, code & 7);
    let magnitude = match (e, m) {
        (0, m) => m as f32 * (1.0 / 512.0),
        (15, 7) => f32::NAN,
        (e, m) => (8 + m) as f32 * 2f32.powi(e as i32 - 10),
    };
    sign * magnitude
}

/// `x` rounded to the nearest e4m3 value, ties to even, saturating at ±448;
/// zero gives code 0. `x` must not be NaN.
pub fn e4m3_from_f64(x: f64) -> u8 {
    let sign = if x < 0.0 { 0x80 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX as f64 {
        return sign | E4M3_SATURATED;
    }
    if a == 0.0 {
        return 0;
    }
    // a is a normal f64 here: its exponent is exact.
    let mut e = ((a.to_bits() >> 52) & 0x7ff) as i32 - 1023;
    let step = e.max(-6) - 3;
    let mut n = (a * 2f64.powi(-step)).round_ties_even() as u32;
    let code = if e >= -6 {
        if n == 16 {
            (n, e) = (8, e + 1);
        }
        if e > 8 || (e == 8 && n > 14) {
            E4M3_SATURATED
        } else {
            (((e + 7) as u8) << 3) | (n - 8) as u8
        }
    } else {
        // Subnormal: n multiples of 2⁻⁹ (n = 8 is the smallest normal, code 8).
        n as u8
    };
    if code == 0 {
        0
    } else {
        sign | code
    }
}

/// `x` with a subnormal f32 value flushed to zero.
pub fn flush(x: f32) -> f32 {
    if x.abs() < f32::MIN_POSITIVE {
        0.0
    } else {
        x
    }
}

/// The scale of a head whose largest magnitude is `absmax`.
pub fn head_scale(absmax: f32) -> f32 {
    if absmax < MIN_ABSMAX {
        0.0
    } else {
        absmax / E4M3_MAX
    }
}

/// The code of `x / scale`, the exact quotient rounded (0 for scale 0).
pub fn quantize_value(x: f32, scale: f32) -> u8 {
    if scale == 0.0 || x == 0.0 {
        return 0;
    }
    // The f64 quotient of two f32s lies on the same side of every e4m3
    // rounding boundary as the exact one (they are at least 2⁻²⁹ apart
    // relative, the quotient within 2⁻⁵³), so this rounds the exact quotient.
    e4m3_from_f64(x as f64 / scale as f64)
}

/// P quantized to e4m3 at its own scale, as the kernels do before `P·V`:
/// `e4m3(p · 448) / 448` with `p · 448` in f32.
pub fn round_p(p: f32) -> f32 {
    e4m3_to_f32(e4m3_from_f64((p * E4M3_MAX) as f64)) * P_SCALE
}

/// Stored elements per row of a head dim (or transform) of `dim`: a
/// multiple of 4.
pub fn row_len(dim: usize) -> usize {
    dim.next_multiple_of(4)
}

/// The random orthogonal transform of incoherent processing:
/// `x ↦ H·diag(signs)·x / √n` on rows zero-padded from `head_dim` to `n`.
#[derive(Clone, Debug, PartialEq)]
pub struct Hadamard {
    /// The rows' length before padding.
    pub head_dim: usize,
    /// The transform's order: `head_dim.next_power_of_two()`.
    pub dim: usize,
    /// ±1 per transformed element, from the seed.
    pub signs: Vec<f32>,
    /// `1/√n` as an f32, applied after the butterflies.
    pub norm: f32,
}

impl Hadamard {
    /// The transform of rows `head_dim` long, its signs drawn from `seed`.
    pub fn new(head_dim: usize, seed: u64) -> Self {
        let dim = head_dim.next_power_of_two();
        let mut rng = Rng::new(seed);
        let signs = (0..dim)
            .map(|_| if rng.next_u64() >> 63 == 1 { -1.0 } else { 1.0 })
            .collect();
        Self {
            head_dim,
            dim,
            signs,
            norm: (1.0 / (dim as f64).sqrt()) as f32,
        }
    }

    /// One row (`head_dim` values) transformed (`dim` values), with the
    /// butterflies in the order the kernel runs them: stages h = 1, 2, 4, …
    /// pairing element j with j + h; subnormal results flushed at every step.
    pub fn apply(&self, row: &[f32]) -> Vec<f32> {
        let n = self.dim;
        let mut y: Vec<f32> = (0..n)
            .map(|i| row.get(i).map_or(0.0, |&x| flush(x) * self.signs[i]))
            .collect();
        let mut h = 1;
        while h < n {
            for start in (0..n).step_by(2 * h) {
                for j in start..start + h {
                    let (a, b) = (y[j], y[j + h]);
                    y[j] = flush(a + b);
                    y[j + h] = flush(a - b);
                }
            }
            h *= 2;
        }
        y.iter().map(|&x| flush(x * self.norm)).collect()
    }
}

/// A tensor quantized to e4m3: codes and per-(batch, head) scales.
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Tensor {
    /// `(batch, seqlen, heads, head_dim)` before quantization.
    pub shape: [usize; 4],
    /// Elements of each quantized row before padding: the head dim, or the
    /// transform's order with incoherent processing.
    pub dim: usize,
    /// Stored elements per row (`dim` padded to a multiple of 4 with zeros,
    /// or wider where another tensor of the problem needs it).
    pub row_len: usize,
    /// `(batch, seqlen, heads, row_len)` codes.
    pub codes: Vec<u8>,
    /// `(batch, heads)` scales.
    pub scales: Vec<f32>,
}

impl Fp8Tensor {
    /// Each code's value and its head's scale, in storage order.
    fn values(&self) -> impl Iterator<Item = (f32, f32)> + '_ {
        let [_, seqlen, heads, _] = self.shape;
        self.codes.iter().enumerate().map(move |(i, &c)| {
            let row = i / self.row_len;
            let (b, h) = (row / (seqlen * heads), row % heads);
            (e4m3_to_f32(c), self.scales[b * heads + h])
        })
    }

    /// The values the codes stand for, `(batch, seqlen, heads, row_len)`.
    pub fn dequantize(&self) -> Vec<f32> {
        self.values().map(|(x, s)| x * s).collect()
    }

    /// [`Fp8Tensor::dequantize`] in f64 (exact: a code's value has 4
    /// significant bits, a scale 24).
    pub fn dequantize_f64(&self) -> Vec<f64> {
        self.values().map(|(x, s)| x as f64 * s as f64).collect()
    }
}

/// How one attention problem's q, k and v are quantized: q and k through
/// the transform (if any); every row stored `row_len` long, so that one
/// head dim serves the attention kernel (v's extra elements are zeros).
#[derive(Clone, Debug, PartialEq)]
pub struct Fp8Layout {
    /// The head dim of q and k.
    pub head_dim: usize,
    /// The transform q and k go through (`None`: none).
    pub transform: Option<Hadamard>,
    /// Every stored row's length.
    pub row_len: usize,
}

impl Fp8Layout {
    /// The FP8 forward's checks on `inputs` under `opts` (the options
    /// valid, and the ones FP8 takes): their shape and its layout under
    /// `fp8`.
    pub fn checked(
        inputs: &ForwardInputs,
        opts: &AttentionOptions,
        fp8: &Fp8Options,
    ) -> Result<(AttentionShape, Self)> {
        let shape = inputs.shape()?;
        opts.validate()?;
        Self::check_supported(&shape, opts)?;
        Ok((shape, Self::new(shape.head_dim, fp8)))
    }

    /// Elements of a quantized q or k row: the head dim, or the
    /// transform's order.
    pub fn dim(&self) -> usize {
        self.transform.as_ref().map_or(self.head_dim, |t| t.dim)
    }

    /// The layout of a problem with this head dim under `opts`.
    pub fn new(head_dim: usize, opts: &Fp8Options) -> Self {
        let transform = opts.hadamard.map(|seed| Hadamard::new(head_dim, seed));
        let dim = transform.as_ref().map_or(head_dim, |t| t.dim);
        Self {
            head_dim,
            transform,
            row_len: row_len(dim),
        }
    }

    /// q, k (transformed) and v quantized.
    pub fn quantize(&self, inputs: &ForwardInputs) -> Result<[Fp8Tensor; 3]> {
        let t = self.transform.as_ref();
        Ok([
            quantize(&inputs.q, "q", t, self.row_len)?,
            quantize(&inputs.k, "k", t, self.row_len)?,
            quantize(&inputs.v, "v", None, self.row_len)?,
        ])
    }

    /// The problem the attention kernel runs: rows `row_len` long.
    pub fn padded(&self, shape: &AttentionShape) -> AttentionShape {
        AttentionShape {
            head_dim: self.row_len,
            head_dim_v: self.row_len,
            ..*shape
        }
    }

    /// `opts` with the score scale of the real head dim made explicit.
    pub fn options(&self, opts: &AttentionOptions) -> AttentionOptions {
        AttentionOptions {
            scale: Some(opts.scale_for(self.head_dim)),
            ..opts.clone()
        }
    }

    /// The FP8 forward takes the band and score options, and v of q's head
    /// dim (its codes share one row length).
    pub fn check_supported(shape: &AttentionShape, opts: &AttentionOptions) -> Result<()> {
        opts.no_dropout("the FP8 forward")?;
        opts.band_only("the FP8 forward")?;
        if shape.head_dim_v != shape.head_dim {
            return Err(Error::Unsupported {
                what: "the FP8 forward",
                feature: "a v head dim of its own",
            });
        }
        Ok(())
    }

    /// Output rows `row_len` long cut back to the head dim.
    pub fn trim<T: Copy>(&self, o: &[T]) -> Vec<T> {
        o.chunks(self.row_len)
            .flat_map(|r| r[..self.head_dim].iter().copied())
            .collect()
    }
}

/// Every element of `x` must be finite (NaN and ±inf have no scale).
pub fn check_finite(x: &[f32], tensor: &'static str) -> Result<()> {
    match x.iter().position(|v| !v.is_finite()) {
        Some(index) => Err(Error::NonFiniteInput { tensor, index }),
        None => Ok(()),
    }
}

/// Quantize `x` (named `tensor` in errors), through `transform` when given,
/// into rows of `row_len` (at least the quantized row's length).
pub fn quantize(
    x: &TensorView,
    tensor: &'static str,
    transform: Option<&Hadamard>,
    row_len: usize,
) -> Result<Fp8Tensor> {
    let [batch, seqlen, heads, d] = x.shape;
    x.check_len(tensor)?;
    let values = x.data.to_f32();
    check_finite(&values, tensor)?;
    if let Some(t) = transform.filter(|t| t.head_dim != d) {
        return Err(Error::DimMismatch {
            dim: "head_dim",
            tensor,
            value: d,
            other: "the Hadamard transform",
            other_value: t.head_dim,
        });
    }
    let dim = transform.map_or(d, |t| t.dim);
    if row_len < dim || !row_len.is_multiple_of(4) {
        return Err(Error::DimMismatch {
            dim: "row length",
            tensor,
            value: row_len,
            other: "its quantized rows (a multiple of 4 at least)",
            other_value: row_len.max(dim).next_multiple_of(4),
        });
    }
    // Rows (b, s, h) after the transform, each `dim` long.
    let rows: Vec<Vec<f32>> = values
        .par_chunks(d.max(1))
        .map(|r| match transform {
            Some(t) => t.apply(r),
            None => r.iter().map(|&x| flush(x)).collect(),
        })
        .collect();
    let mut absmax = vec![0f32; batch * heads];
    for (i, r) in rows.iter().enumerate() {
        let bh = (i / (seqlen * heads)) * heads + i % heads;
        absmax[bh] = r.iter().fold(absmax[bh], |m, x| m.max(x.abs()));
    }
    let scales: Vec<f32> = absmax.iter().map(|&a| head_scale(a)).collect();
    let mut codes = vec![0u8; rows.len() * row_len];
    codes
        .par_chunks_mut(row_len)
        .zip(&rows)
        .enumerate()
        .for_each(|(i, (out, r))| {
            let scale = scales[(i / (seqlen * heads)) * heads + i % heads];
            for (c, &x) in out.iter_mut().zip(r) {
                *c = quantize_value(x, scale);
            }
        });
    Ok(Fp8Tensor {
        shape: x.shape,
        dim,
        row_len,
        codes,
        scales,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_finite_code_round_trips_and_is_ordered() {
        let mut last = f32::NEG_INFINITY;
        // Negative codes from -448 up to -0, then positive ones to 448.
        let order = (0x81..=0xfeu8).rev().chain(0x00..=0x7e);
        for code in order {
            let v = e4m3_to_f32(code);
            assert!(v.is_finite(), "{code:#x}");
            assert!(v > last || (v == 0.0 && last == 0.0), "{code:#x}: {v}");
            last = v;
            if code != 0x80 {
                assert_eq!(e4m3_from_f64(v as f64), code, "{v}");
            }
        }
        assert_eq!(e4m3_to_f32(0x7e), 448.0);
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9));
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6));
        assert!(e4m3_to_f32(0x7f).is_nan());
    }

    #[test]
    fn rounding_is_to_nearest_even_and_saturates() {
        // Between 1 (0x38) and 1.125 (0x39): the tie goes to the even code.
        assert_eq!(e4m3_from_f64(1.0625), 0x38);
        assert_eq!(e4m3_from_f64(1.0625 + 1e-9), 0x39);
        assert_eq!(e4m3_from_f64(1.1875), 0x3a);
        // Subnormals: 2.5 · 2⁻⁹ ties to 2 · 2⁻⁹; half the smallest is 0.
        assert_eq!(e4m3_from_f64(2.5 / 512.0), 0x02);
        assert_eq!(e4m3_from_f64(0.5 / 512.0), 0x00);
        assert_eq!(e4m3_from_f64(0.51 / 512.0), 0x01);
        // 7.5 · 2⁻⁹ ties up to 8 · 2⁻⁹ = 2⁻⁶, the smallest normal.
        assert_eq!(e4m3_from_f64(7.5 / 512.0), 0x08);
        // 15.5 · 2⁻³ rounds to 16 · 2⁻³ = 2: the next binade.
        assert_eq!(e4m3_from_f64(1.9375), 0x40);
        assert_eq!(e4m3_from_f64(-1.9375), 0xc0);
        for big in [448.0, 460.0, 470.0, 1e6] {
            assert_eq!(e4m3_from_f64(big), 0x7e, "{big}");
            assert_eq!(e4m3_from_f64(-big), 0xfe, "{big}");
        }
        assert_eq!(e4m3_from_f64(-0.0), 0);
        assert_eq!(e4m3_from_f64(-1e-9), 0);
    }

    #[test]
    fn scales_and_quotients() {
        assert_eq!(head_scale(448.0), 1.0);
        assert_eq!(head_scale(MIN_ABSMAX / 2.0), 0.0);
        assert!(head_scale(MIN_ABSMAX) >= f32::MIN_POSITIVE);
        // The largest magnitude maps to 448 (or saturates there).
        for absmax in [1.0f32, 3.7, 1e-20, 6e30] {
            let s = head_scale(absmax);
            assert_eq!(quantize_value(absmax, s), 0x7e);
            assert_eq!(quantize_value(-absmax, s), 0xfe);
        }
        assert_eq!(quantize_value(5.0, 0.0), 0);
        assert_eq!(quantize_value(2.0, 2.0), 0x38);
    }

    #[test]
    fn p_keeps_its_largest_value_and_rounds_the_rest() {
        assert_eq!(round_p(1.0), 1.0);
        assert_eq!(round_p(0.0), 0.0);
        let p = 0.3f32;
        let r = round_p(p);
        assert!((r - p).abs() <= p / 16.0, "{r}");
    }

    #[test]
    fn hadamard_is_orthogonal_and_pads() {
        for d in [1, 4, 59, 64, 256] {
            let t = Hadamard::new(d, 11);
            assert_eq!(t.dim, d.next_power_of_two());
            let mut rng = Rng::new(d as u64);
            let (a, b) = (rng.normal_vec(d, 1.0), rng.normal_vec(d, 1.0));
            let dot = |x: &[f32], y: &[f32]| x.iter().zip(y).map(|(p, q)| p * q).sum::<f32>();
            let (ta, tb) = (t.apply(&a), t.apply(&b));
            assert_eq!(ta.len(), t.dim);
            assert!((dot(&a, &b) - dot(&ta, &tb)).abs() < 1e-4 * d as f32);
            assert!((dot(&a, &a) - dot(&ta, &ta)).abs() < 1e-4 * d as f32);
        }
        // One channel ×40 is spread over every transformed element.
        let mut x = vec![0.1f32; 64];
        x[3] = 40.0;
        let y = Hadamard::new(64, 5).apply(&x);
        let max = y.iter().fold(0f32, |m, v| m.max(v.abs()));
        assert!(max < 6.0, "{max}");
    }

    #[test]
    fn quantize_checks_its_inputs() {
        let x = [1.0f32, f32::NAN, 0.0, 2.0];
        let view = TensorView::f32([1, 1, 1, 4], &x);
        assert!(matches!(
            quantize(&view, "q", None, 4),
            Err(Error::NonFiniteInput {
                tensor: "q",
                index: 1
            })
        ));
        let x = [1.0f32, -3.0, 0.5, 2.0, 0.0, 0.0, 0.0, 1e-3];
        let view = TensorView::f32([1, 2, 1, 4], &x);
        let t = quantize(&view, "k", None, 8).unwrap();
        assert_eq!(t.scales, vec![3.0 / 448.0]);
        assert_eq!(t.codes[1], 0xfe);
        assert!(t.codes[4..8].iter().all(|&c| c == 0), "padding");
        let back = t.dequantize();
        assert_eq!(back[1], -3.0);
        assert!(quantize(&view, "k", None, 2).is_err());
        assert!(quantize(&view, "k", Some(&Hadamard::new(8, 1)), 8).is_err());
    }
}

//! Vectorizable elementwise math for the online softmax: `exp` and `tanh`
//! in branch-free f32 arithmetic (so a block of scores becomes vector
//! instructions, where `f32::exp` is a library call per element), and lane-
//! wise max and sum. All are `#[inline(always)]`: they take the instruction
//! set of the entry point they are inlined into (`isa.rs`).

use crate::api::tensor::Precision;

/// Lanes of the reductions' accumulators (a multiple of every vector width).
const LANES: usize = 16;

/// `exp(x)` to about 1 ulp (Cephes' `expf`): `2^n · exp(r)` with
/// `n = round(x / ln 2)`, `r = x − n·ln 2` in two parts, and a degree-6
/// polynomial for `exp(r)`. Below −87.3 (where `exp` leaves f32's normal
/// range) the result is 0, and above 88 it stays at `exp(88)` — `exp(−inf) = 0` exactly, as masked scores need.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 · 2^23: adding it rounds to an integer held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    let xc = x.clamp(-87.336_55, 88.0);
    let t = xc * LOG2E + MAGIC;
    let n = t - MAGIC;
    let r = xc - n * LN2_HI - n * LN2_LO;
    let mut p = 1.987_569_2e-4;
    p = p * r + 1.398_2e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 0.166_666_65;
    p = p * r + 0.5;
    let y = p * r * r + r + 1.0;
    let bits = t.to_bits().wrapping_sub(MAGIC.to_bits()).wrapping_add(127) << 23;
    let e = y * f32::from_bits(bits);
    if x < -87.336_55 {
        0.0
    } else {
        e
    }
}

/// `tanh(x) = sign(x) · (1 − e) / (1 + e)` with `e = exp(−2|x|)`: the
/// absolute error stays near f32's epsilon, which is what a soft-capped
/// score `C · tanh(s / C)` needs.
#[inline(always)]
pub(crate) fn tanh(x: f32) -> f32 {
    let e = exp(-2.0 * x.abs());
    ((1.0 - e) / (1.0 + e)).copysign(x)
}

/// The largest element (−inf for none).
#[inline(always)]
pub(crate) fn max(xs: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (l, x) in lanes.iter_mut().zip(c) {
            *l = if *x > *l { *x } else { *l };
        }
    }
    rest.iter()
        .chain(&lanes)
        .fold(f32::NEG_INFINITY, |m, &x| if x > m { x } else { m })
}

/// `xs[i] = exp(xs[i] − m)` for every element; returns their sum.
#[inline(always)]
pub(crate) fn exp_sub_sum(xs: &mut [f32], m: f32) -> f32 {
    let mut lanes = [0f32; LANES];
    let mut chunks = xs.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (l, x) in lanes.iter_mut().zip(c.iter_mut()) {
            *x = exp(*x - m);
            *l += *x;
        }
    }
    let mut sum = 0.0;
    for x in chunks.into_remainder() {
        *x = exp(*x - m);
        sum += *x;
    }
    sum + lanes.iter().sum::<f32>()
}

/// `Σ a_i · b_i` in lanes (a fixed order: the same inputs, the same sum).
#[inline(always)]
pub(crate) fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut lanes = [0f32; LANES];
    let (ca, cb) = (a.chunks_exact(LANES), b.chunks_exact(LANES));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for ((l, x), y) in lanes.iter_mut().zip(x).zip(y) {
            *l += x * y;
        }
    }
    tail + lanes.iter().sum::<f32>()
}

/// `xs *= a`.
#[inline(always)]
pub(crate) fn scale(xs: &mut [f32], a: f32) {
    xs.iter_mut().for_each(|x| *x *= a);
}

/// How P (and dS) are rounded before the products that use them: not at
/// all (f32 storage), or by a function (the storage precision's rounding,
/// or e4m3 at P's scale for FP8).
pub(crate) type Rounding = Option<fn(f32) -> f32>;

/// The rounding of `precision` storage.
pub(crate) fn rounding_of(precision: Precision) -> Rounding {
    (precision != Precision::F32).then(|| precision.rounding())
}

/// P rounded before it multiplies V or Q (SPEC.md): the one place the CPU
/// backend does it.
#[inline(always)]
pub(crate) fn round_with(rounding: Rounding, xs: &mut [f32]) {
    if let Some(round) = rounding {
        xs.iter_mut().for_each(|x| *x = round(*x));
    }
}

/// [`round_with`] the rounding of `precision` storage.
#[inline(always)]
pub(crate) fn round_to(precision: Precision, xs: &mut [f32]) {
    round_with(rounding_of(precision), xs);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_libm_and_zero_below_range() {
        let mut worst = 0f64;
        for i in -8700..=8799 {
            let x = i as f32 * 0.01 + 0.003;
            let (got, want) = (exp(x) as f64, (x as f64).exp());
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 2.5 * f32::EPSILON as f64, "relative error {worst}");
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp(-100.0), 0.0);
        assert_eq!(exp(0.0), 1.0);
    }

    #[test]
    fn tanh_is_close_in_absolute_terms() {
        for i in -2000..=2000 {
            let x = i as f32 * 0.005;
            let err = (tanh(x) as f64 - (x as f64).tanh()).abs();
            assert!(err < 3.0 * f32::EPSILON as f64, "tanh({x}) off by {err}");
        }
    }

    #[test]
    fn reductions_cover_every_element() {
        let xs: Vec<f32> = (0..37).map(|i| ((i * 7) % 37) as f32 - 3.0).collect();
        assert_eq!(max(&xs), 33.0);
        assert_eq!(max(&[]), f32::NEG_INFINITY);
        let ones = vec![1f32; 37];
        assert_eq!(dot(&xs, &ones), xs.iter().sum::<f32>());
        let mut zs = vec![0f32; 37];
        assert_eq!(exp_sub_sum(&mut zs, 0.0), 37.0);
    }
}

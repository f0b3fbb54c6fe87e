//! Vectorizable elementwise math for the online softmax: `exp` and `tanh`
//! in branch-free f32 arithmetic on the kernel's multiply-add (so a block
//! of scores becomes vector FMAs, where `f32::exp` is a library call per
//! element and an unfused `a * b + c` two instructions), and lane-wise max
//! and sum reduced in a fixed tree. All are `#[inline(always)]`: they take
//! the instruction set of the entry point they are inlined into (`isa.rs`).

use super::micro::Kernel;
use crate::api::tensor::Precision;

/// Lanes of the reductions' accumulators (a multiple of every vector width).
pub(crate) const LANES: usize = 16;

/// Below this `exp` is 0 (f32's normal range ends at about −87.34).
const EXP_LO: f32 = -87.336_55;

/// `exp(x)` to about 1 ulp (Cephes' `expf`): `2^n · exp(r)` with
/// `n = round(x / ln 2)`, `r = x − n·ln 2` in two parts, and a degree-6
/// polynomial for `exp(r)`, every step a multiply-add of `K`. Below −87.3
/// (where `exp` leaves f32's normal range) the result is 0, and above 88 it
/// stays at `exp(88)` — `exp(−inf) = 0` exactly, as masked scores need.
#[inline(always)]
pub(crate) fn exp<K: Kernel>(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_359_4;
    const LN2_LO: f32 = -2.121_944_4e-4;
    // 1.5 · 2^23: adding it rounds to an integer held in the low mantissa bits.
    const MAGIC: f32 = 12_582_912.0;
    // `(bits(t) − bits(MAGIC) + 127) << 23` as one shift and one add.
    const BIAS: u32 = 127u32.wrapping_sub(MAGIC.to_bits()) << 23;
    let xc = x.clamp(EXP_LO, 88.0);
    let t = K::madd(xc, LOG2E, MAGIC);
    let n = t - MAGIC;
    let r = K::madd(n, -LN2_LO, K::madd(n, -LN2_HI, xc));
    let mut p = 1.987_569_2e-4;
    p = K::madd(p, r, 1.398_2e-3);
    p = K::madd(p, r, 8.333_452e-3);
    p = K::madd(p, r, 4.166_579_6e-2);
    p = K::madd(p, r, 0.166_666_65);
    p = K::madd(p, r, 0.5);
    let y = K::madd(p, r * r, r) + 1.0;
    let e = y * f32::from_bits((t.to_bits() << 23).wrapping_add(BIAS));
    if x < EXP_LO {
        0.0
    } else {
        e
    }
}

/// `tanh(x) = sign(x) · (1 − e) / (1 + e)` with `e = exp(−2|x|)`: the
/// absolute error stays near f32's epsilon, which is what a soft-capped
/// score `C · tanh(s / C)` needs.
#[inline(always)]
pub(crate) fn tanh<K: Kernel>(x: f32) -> f32 {
    let e = exp::<K>(-2.0 * x.abs());
    ((1.0 - e) / (1.0 + e)).copysign(x)
}

/// Per-lane partial results of a reduction: lane `j` covers the elements
/// at positions `j (mod LANES)`.
pub(crate) type Lanes = [f32; LANES];

/// `a` folded by `f` from the first lane to the last. (A pairwise tree
/// makes the vectorizer split the loops that produce `a` into 2-lane
/// pieces; a chain leaves them whole.)
#[inline(always)]
fn fold(a: Lanes, f: impl Fn(f32, f32) -> f32) -> f32 {
    a[1..].iter().fold(a[0], |acc, &x| f(acc, x))
}

#[inline(always)]
fn fmax(a: f32, b: f32) -> f32 {
    if b > a {
        b
    } else {
        a
    }
}

/// The largest of the lanes.
#[inline(always)]
pub(crate) fn fold_max(lanes: Lanes) -> f32 {
    fold(lanes, fmax)
}

/// The sum of the lanes.
#[inline(always)]
pub(crate) fn fold_sum(lanes: Lanes) -> f32 {
    fold(lanes, |a, b| a + b)
}

/// Lane-wise maxima of `xs` (−inf in lanes no element reaches).
#[inline(always)]
pub(crate) fn lane_max(xs: &[f32]) -> Lanes {
    let mut lanes = [f32::NEG_INFINITY; LANES];
    let chunks = xs.chunks_exact(LANES);
    let rest = chunks.remainder();
    for c in chunks {
        for (l, x) in lanes.iter_mut().zip(c) {
            *l = fmax(*l, *x);
        }
    }
    for (l, x) in lanes.iter_mut().zip(rest) {
        *l = fmax(*l, *x);
    }
    lanes
}

/// Whether some lane exceeds `m`.
#[inline(always)]
pub(crate) fn any_above(lanes: &Lanes, m: f32) -> bool {
    lanes.iter().fold(false, |hit, &l| hit | (l > m))
}

/// `xs[i] = exp(xs[i] − m)` for every element; returns their lane sums.
#[inline(always)]
pub(crate) fn exp_sub_lanes<K: Kernel>(xs: &mut [f32], m: f32) -> Lanes {
    let mut lanes = [0f32; LANES];
    let mut chunks = xs.chunks_exact_mut(LANES);
    for c in &mut chunks {
        for (l, x) in lanes.iter_mut().zip(c.iter_mut()) {
            *x = exp::<K>(*x - m);
            *l += *x;
        }
    }
    for (l, x) in lanes.iter_mut().zip(chunks.into_remainder()) {
        *x = exp::<K>(*x - m);
        *l += *x;
    }
    lanes
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
    tail + fold_sum(lanes)
}

/// `xs *= a`.
#[inline(always)]
pub(crate) fn scale(xs: &mut [f32], a: f32) {
    xs.iter_mut().for_each(|x| *x *= a);
}

/// Storage elements the CPU backend widens to f32 on load, in loops the
/// vectorizer turns into whole-register conversions (`half`'s own `to_f32`
/// checks for F16C at run time per element and is never vectorized).
pub(crate) trait Widen: Copy {
    /// `dst[i] = src[i]` as f32, exactly.
    fn widen<K: Kernel>(src: &[Self], dst: &mut [f32]);
}

impl Widen for f32 {
    #[inline(always)]
    fn widen<K: Kernel>(src: &[f32], dst: &mut [f32]) {
        dst.copy_from_slice(src);
    }
}

impl Widen for half::bf16 {
    #[inline(always)]
    fn widen<K: Kernel>(src: &[half::bf16], dst: &mut [f32]) {
        for (d, s) in dst.iter_mut().zip(src) {
            *d = f32::from_bits((s.to_bits() as u32) << 16);
        }
    }
}

impl Widen for half::f16 {
    #[inline(always)]
    fn widen<K: Kernel>(src: &[half::f16], dst: &mut [f32]) {
        // SAFETY: a kernel runs only inside its instruction set's entry point.
        unsafe { K::widen_f16(src, dst) }
    }
}

/// How P (and dS) are rounded before the products that use them: not at
/// all (f32 storage), to the storage precision (in vectorizable
/// arithmetic: a call into `half` per element cost the f16 forward a third
/// of its time), or by a function (e4m3 at P's scale for FP8).
#[derive(Clone, Copy, Debug)]
pub(crate) enum Rounding {
    Exact,
    F16,
    Bf16,
    By(fn(f32) -> f32),
}

/// The rounding of `precision` storage.
pub(crate) fn rounding_of(precision: Precision) -> Rounding {
    match precision {
        Precision::F32 => Rounding::Exact,
        Precision::F16 => Rounding::F16,
        Precision::Bf16 => Rounding::Bf16,
    }
}

/// `x` rounded to the nearest f16 (ties to even) and back, as
/// `f16::from_f32(x).to_f32()` but branch-free.
#[inline(always)]
pub(crate) fn round_f16(x: f32) -> f32 {
    const MIN_NORMAL: f32 = 6.103_515_6e-5; // 2^-14
    let a = x.abs();
    // Below f16's normal range the quantum is 2^-24, the ulp of 0.5:
    // adding and taking away 0.5 rounds to it, ties to even.
    let small = (a + 0.5) - 0.5;
    // Within it, 13 mantissa bits dropped to nearest even (a carry into
    // the exponent is the right result).
    let b = a.to_bits();
    let normal = f32::from_bits((b + 0x0fff + ((b >> 13) & 1)) & !0x1fff);
    let r = if a < MIN_NORMAL { small } else { normal };
    // Past f16's largest finite value (65504) the rounding overflowed.
    let r = if r > 65504.0 { f32::INFINITY } else { r };
    if a.is_nan() {
        x
    } else {
        r.copysign(x)
    }
}

/// `x` rounded to the nearest bf16 (ties to even) and back, branch-free.
#[inline(always)]
pub(crate) fn round_bf16(x: f32) -> f32 {
    let b = x.to_bits();
    let r = f32::from_bits((b + 0x7fff + ((b >> 16) & 1)) & 0xffff_0000);
    if x.is_nan() {
        x
    } else {
        r
    }
}

/// P rounded before it multiplies V or Q (docs/semantics.md): the one place the CPU
/// backend does it.
#[inline(always)]
pub(crate) fn round_with(rounding: Rounding, xs: &mut [f32]) {
    match rounding {
        Rounding::Exact => {}
        Rounding::F16 => xs.iter_mut().for_each(|x| *x = round_f16(*x)),
        Rounding::Bf16 => xs.iter_mut().for_each(|x| *x = round_bf16(*x)),
        Rounding::By(round) => xs.iter_mut().for_each(|x| *x = round(*x)),
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

    use crate::cpu::micro::Portable;

    /// A kernel whose multiply-add is fused (`f32::mul_add`, exact with or
    /// without hardware FMA), where this target has one.
    #[cfg(target_arch = "x86_64")]
    type Fused = crate::cpu::micro::Avx2;
    #[cfg(target_arch = "aarch64")]
    type Fused = crate::cpu::micro::Neon;
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    type Fused = Portable;

    fn exp_within_two_ulp<K: Kernel>() {
        let mut worst = 0f64;
        for i in -8700..=8799 {
            let x = i as f32 * 0.01 + 0.003;
            let (got, want) = (exp::<K>(x) as f64, (x as f64).exp());
            worst = worst.max(((got - want) / want).abs());
        }
        assert!(worst < 2.5 * f32::EPSILON as f64, "relative error {worst}");
        assert_eq!(exp::<K>(f32::NEG_INFINITY), 0.0);
        assert_eq!(exp::<K>(-100.0), 0.0);
        assert_eq!(exp::<K>(0.0), 1.0);
    }

    #[test]
    fn exp_is_within_two_ulp_of_libm_and_zero_below_range() {
        exp_within_two_ulp::<Portable>();
        exp_within_two_ulp::<Fused>();
    }

    fn tanh_close<K: Kernel>() {
        for i in -2000..=2000 {
            let x = i as f32 * 0.005;
            let err = (tanh::<K>(x) as f64 - (x as f64).tanh()).abs();
            assert!(err < 3.0 * f32::EPSILON as f64, "tanh({x}) off by {err}");
        }
    }

    #[test]
    fn tanh_is_close_in_absolute_terms() {
        tanh_close::<Portable>();
        tanh_close::<Fused>();
    }

    #[test]
    fn rounding_to_f16_and_bf16_matches_half() {
        let specials = [
            0.0f32, -0.0, 1.0, 65504.0, 65519.99, 65520.0, 1e-8, 2.98e-8, 6.1e-5,
        ];
        let sweep = (0..u32::MAX / 997).map(|i| f32::from_bits(i * 997));
        for x in specials
            .into_iter()
            .chain(sweep)
            .chain([f32::INFINITY, f32::NAN])
        {
            for x in [x, -x] {
                let want = half::f16::from_f32(x).to_f32();
                assert!(
                    same(round_f16(x), want),
                    "f16 of {x:e} ({:#x})",
                    x.to_bits()
                );
                let want = half::bf16::from_f32(x).to_f32();
                assert!(same(round_bf16(x), want), "bf16 of {x:e}");
            }
        }
    }

    /// The same value, or both NaN.
    fn same(got: f32, want: f32) -> bool {
        got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan())
    }

    /// Every f16 and bf16, widened by a kernel (with a tail past its vectors).
    struct WidenEvery;

    impl crate::cpu::isa::Task for WidenEvery {
        type Output = ();
        fn run<K: Kernel>(self) {
            let all: Vec<u16> = (0..=u16::MAX).chain(0..7).collect();
            let mut out = vec![0f32; all.len()];
            let f16s: Vec<half::f16> = all.iter().map(|&b| half::f16::from_bits(b)).collect();
            Widen::widen::<K>(&f16s, &mut out);
            for (h, x) in f16s.iter().zip(&out) {
                assert!(same(*x, h.to_f32()), "f16 {:#06x}: {x}", h.to_bits());
            }
            let bf16s: Vec<half::bf16> = all.iter().map(|&b| half::bf16::from_bits(b)).collect();
            Widen::widen::<K>(&bf16s, &mut out);
            for (h, x) in bf16s.iter().zip(&out) {
                assert!(same(*x, h.to_f32()), "bf16 {:#06x}: {x}", h.to_bits());
            }
        }
    }

    #[test]
    fn widening_is_exact_for_every_f16_and_bf16() {
        for &isa in crate::cpu::isa::Isa::available() {
            isa.run(WidenEvery);
        }
    }

    #[test]
    fn reductions_cover_every_element() {
        let xs: Vec<f32> = (0..37).map(|i| ((i * 7) % 37) as f32 - 3.0).collect();
        assert_eq!(fold_max(lane_max(&xs)), 33.0);
        assert_eq!(fold_max(lane_max(&[])), f32::NEG_INFINITY);
        let ones = vec![1f32; 37];
        assert_eq!(dot(&xs, &ones), xs.iter().sum::<f32>());
        let mut zs = vec![0f32; 37];
        assert_eq!(fold_sum(exp_sub_lanes::<Portable>(&mut zs, 0.0)), 37.0);
        assert!(any_above(&lane_max(&xs), 32.5) && !any_above(&lane_max(&xs), 33.0));
    }
}

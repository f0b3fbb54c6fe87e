//! The numerics of FlashAttention's tiling on one row, in three precisions:
//! whole-row softmax, the online (blockwise, rescaled) softmax that
//! flashattn's kernels use, and the wrong "independent softmax per block".
//! `examples/precision.rs` measures them against [`softmax_f64`] and
//! [`attention_f64`]; the tests here pin down that online == whole row.
//!
//! Every operation's result goes through [`Arith::op`] and the value written
//! out through [`Arith::out`], so one generic implementation runs in f32
//! ([`F32`]), as a pure half-precision kernel ([`F16`]) and as flashattn's
//! own f16 path ([`F16Storage`]: f16 in memory, f32 in registers).
//!
//! The online loop follows `shaders/flash_fwd.wgsl` (FlashAttention-2 form):
//! per block, `m_new = max(m, max s_j)`, `alpha = exp(m - m_new)`,
//! `l *= alpha`, `acc *= alpha`, then every key adds `p = exp(s_j - m_new)`
//! to `l` and `p·v_j` to `acc`; finally `o = acc / l`. With one block
//! (`alpha = 0`) it performs exactly the whole-row operations, bit for bit.

use half::f16;

/// Bad arguments to the study's functions.
#[derive(Debug, PartialEq, Eq, thiserror::Error)]
pub enum StudyError {
    #[error("softmax block size must be at least 1")]
    EmptyBlock,
    #[error("block sizes {sizes:?} must be at least 1 each and add up to the row length {n}")]
    BadSplit { sizes: Vec<usize>, n: usize },
    #[error("a row has {scores} scores but {values} values")]
    Lengths { scores: usize, values: usize },
}

type Result<T, E = StudyError> = std::result::Result<T, E>;

/// Rounding of a precision: what happens to each computed value.
pub trait Arith {
    /// Short name for tables and legends.
    const NAME: &'static str;
    /// Rounds the result of one arithmetic operation (subtraction, `exp`,
    /// product, sum, quotient) to the precision it is computed in.
    fn op(x: f32) -> f32;
    /// Rounds a value written to memory as the result.
    fn out(x: f32) -> f32;
}

/// Everything in f32.
pub struct F32;

/// A pure half-precision kernel: every intermediate (`s - m`, `exp`, the
/// rescale factor `alpha`, every partial sum of `l` and `acc`, products and
/// quotients) is an f16 value. Computing an operation in f32 and rounding
/// once gives the correctly rounded f16 result for `+ - × ÷` (f32 has more
/// than twice f16's 11 bits) and within an f16 ulp for `exp`.
pub struct F16;

/// f16 tensors with f32 arithmetic, as flashattn's f16 storage does (and as
/// FlashAttention keeps softmax statistics and accumulators in f32): only
/// the result is rounded to f16. Inputs are f16 values already (the study
/// rounds them), so this measures what f16 storage itself costs.
pub struct F16Storage;

fn to_f16(x: f32) -> f32 {
    f16::from_f32(x).to_f32()
}

impl Arith for F32 {
    const NAME: &'static str = "f32";
    fn op(x: f32) -> f32 {
        x
    }
    fn out(x: f32) -> f32 {
        x
    }
}

impl Arith for F16 {
    const NAME: &'static str = "f16";
    fn op(x: f32) -> f32 {
        to_f16(x)
    }
    fn out(x: f32) -> f32 {
        to_f16(x)
    }
}

impl Arith for F16Storage {
    const NAME: &'static str = "f16 storage, f32 math";
    fn op(x: f32) -> f32 {
        x
    }
    fn out(x: f32) -> f32 {
        to_f16(x)
    }
}

fn check_block(block: usize) -> Result<()> {
    if block == 0 {
        return Err(StudyError::EmptyBlock);
    }
    Ok(())
}

/// Block sizes `block, block, ..., rest` covering `n` keys.
fn uniform(n: usize, block: usize) -> Result<Vec<usize>> {
    check_block(block)?;
    Ok((0..n).step_by(block).map(|i| block.min(n - i)).collect())
}

/// The row cut at `sizes`: every size at least 1, together exactly `n`.
fn split(n: usize, sizes: &[usize]) -> Result<Vec<std::ops::Range<usize>>> {
    if sizes.contains(&0) || sizes.iter().sum::<usize>() != n {
        return Err(StudyError::BadSplit {
            sizes: sizes.to_vec(),
            n,
        });
    }
    let mut start = 0;
    Ok(sizes
        .iter()
        .map(|&b| {
            start += b;
            start - b..start
        })
        .collect())
}

fn check_len(s: &[f32], v: &[f32]) -> Result<()> {
    if s.len() != v.len() {
        return Err(StudyError::Lengths {
            scores: s.len(),
            values: v.len(),
        });
    }
    Ok(())
}

/// `p = exp(x - m)` rounded as a kernel computes it.
fn weight<R: Arith>(x: f32, m: f32) -> f32 {
    R::op(R::op(x - m).exp())
}

fn row_max(s: &[f32]) -> f32 {
    s.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// Textbook softmax of a whole row: max, `exp(s - max)`, sum, divide.
/// A row of `-inf` only gives zeros, never NaN.
pub fn whole_row_softmax<R: Arith>(s: &[f32]) -> Vec<f32> {
    let m = row_max(s);
    if m == f32::NEG_INFINITY {
        return vec![0.0; s.len()];
    }
    let p: Vec<f32> = s.iter().map(|&x| weight::<R>(x, m)).collect();
    let l = p.iter().fold(0.0, |l, &p| R::op(l + p));
    p.iter().map(|&p| R::out(R::op(p / l))).collect()
}

/// How a block joins the running state `(m, l, acc)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Merge {
    /// flashattn's kernel (FlashAttention-2): with `m_new = max(m, max s_j)`,
    /// rescale `l` and `acc` by `exp(m - m_new)`, then add every key's
    /// `p = exp(s_j - m_new)` and `p·v_j` straight into them.
    Running,
    /// FlashAttention-1's Algorithm 1 and the worked example below: the
    /// block's own sums `l̃ = Σ exp(s_j - m̃)` and `Σ exp(s_j - m̃)·v_j` (`m̃`
    /// its max), merged as `l = exp(m - m_new)·l + exp(m̃ - m_new)·l̃`.
    BlockLocal,
}

/// One pass over the blocks: running max, sum and (with `v`) accumulator.
fn online_core<R: Arith>(
    s: &[f32],
    v: Option<&[f32]>,
    sizes: &[usize],
    merge: Merge,
) -> Result<(f32, f32, f32)> {
    let (mut m, mut l, mut acc) = (f32::NEG_INFINITY, 0.0f32, 0.0f32);
    for range in split(s.len(), sizes)? {
        let sc = &s[range.clone()];
        let vc = v.map(|v| &v[range]);
        let m_blk = row_max(sc);
        let m_new = m.max(m_blk);
        if m_new == f32::NEG_INFINITY {
            continue; // all keys so far masked: nothing to add, no -inf - -inf
        }
        // exp(m - m_new) is exactly 1 when the max did not grow, 0 at start.
        let rescale = |from: f32| {
            if from == f32::NEG_INFINITY {
                0.0
            } else {
                weight::<R>(from, m_new)
            }
        };
        let alpha = rescale(m);
        // Sums over this block, from `l0`/`acc0`, with weights exp(s - base).
        let add = |base: f32, l0: f32, acc0: f32| {
            let (mut l, mut acc) = (l0, acc0);
            for (j, &x) in sc.iter().enumerate() {
                let p = weight::<R>(x, base);
                l = R::op(l + p);
                if let Some(vc) = vc {
                    acc = R::op(acc + R::op(p * vc[j]));
                }
            }
            (l, acc)
        };
        (l, acc) = match merge {
            Merge::Running => add(m_new, R::op(l * alpha), R::op(acc * alpha)),
            Merge::BlockLocal => {
                let (l_blk, acc_blk) = add(m_blk, 0.0, 0.0);
                let beta = rescale(m_blk);
                (
                    R::op(R::op(l * alpha) + R::op(l_blk * beta)),
                    R::op(R::op(acc * alpha) + R::op(acc_blk * beta)),
                )
            }
        };
        m = m_new;
    }
    Ok((m, l, acc))
}

/// Softmax from online statistics: one pass over blocks of `block` scores
/// finds the max and the sum as flashattn does ([`Merge::Running`]), a
/// second pass writes `exp(s - m) / l`. Error if `block` is 0.
pub fn online_softmax<R: Arith>(s: &[f32], block: usize) -> Result<Vec<f32>> {
    online_softmax_split::<R>(s, &uniform(s.len(), block)?, Merge::Running)
}

/// [`online_softmax`] over blocks of the given sizes, which must add up to
/// the row length, merged by `merge`.
pub fn online_softmax_split<R: Arith>(
    s: &[f32],
    sizes: &[usize],
    merge: Merge,
) -> Result<Vec<f32>> {
    let (m, l, _) = online_core::<R>(s, None, sizes, merge)?;
    if m == f32::NEG_INFINITY {
        return Ok(vec![0.0; s.len()]);
    }
    Ok(s.iter()
        .map(|&x| R::out(R::op(weight::<R>(x, m) / l)))
        .collect())
}

/// The wrong tiling: each block of `block` scores normalized on its own
/// (its own max and sum), never corrected by the others. Every block sums
/// to 1, so the row sums to the number of blocks. Error if `block` is 0.
pub fn blockwise_independent_softmax<R: Arith>(s: &[f32], block: usize) -> Result<Vec<f32>> {
    check_block(block)?;
    Ok(s.chunks(block).flat_map(whole_row_softmax::<R>).collect())
}

/// `softmax(s) · v` the textbook way: max, weights, sum, then the weighted
/// sum of `v` divided by the sum (one division, as a kernel does).
pub fn whole_row_attention<R: Arith>(s: &[f32], v: &[f32]) -> Result<f32> {
    check_len(s, v)?;
    let m = row_max(s);
    if m == f32::NEG_INFINITY {
        return Ok(0.0);
    }
    let (mut l, mut acc) = (0.0f32, 0.0f32);
    for (&x, &vj) in s.iter().zip(v) {
        let p = weight::<R>(x, m);
        l = R::op(l + p);
        acc = R::op(acc + R::op(p * vj));
    }
    Ok(R::out(R::op(acc / l)))
}

/// `softmax(s) · v` as flashattn's forward kernel computes it: keys in
/// blocks of `block`, the accumulator and sum rescaled by
/// `exp(m_old - m_new)` whenever the running max grows ([`Merge::Running`]),
/// one division at the end. Error if `block` is 0 or the lengths differ.
pub fn online_attention<R: Arith>(s: &[f32], v: &[f32], block: usize) -> Result<f32> {
    online_attention_split::<R>(s, v, &uniform(s.len(), block)?, Merge::Running)
}

/// [`online_attention`] over blocks of the given sizes, which must add up
/// to the row length, merged by `merge`.
pub fn online_attention_split<R: Arith>(
    s: &[f32],
    v: &[f32],
    sizes: &[usize],
    merge: Merge,
) -> Result<f32> {
    check_len(s, v)?;
    let (_, l, acc) = online_core::<R>(s, Some(v), sizes, merge)?;
    if l == 0.0 {
        return Ok(0.0);
    }
    Ok(R::out(R::op(acc / l)))
}

/// The wrong tiling applied to attention: every block's output
/// `softmax(s_block) · v_block` is added up as if it were the row's.
pub fn blockwise_independent_attention<R: Arith>(
    s: &[f32],
    v: &[f32],
    block: usize,
) -> Result<f32> {
    check_block(block)?;
    check_len(s, v)?;
    let mut o = 0.0f32;
    for (sc, vc) in s.chunks(block).zip(v.chunks(block)) {
        o = R::op(o + whole_row_attention::<F32Then<R>>(sc, vc)?);
    }
    Ok(R::out(o))
}

/// `R`'s arithmetic without the final rounding to storage, for partial
/// results that stay in registers.
struct F32Then<R>(std::marker::PhantomData<R>);

impl<R: Arith> Arith for F32Then<R> {
    const NAME: &'static str = R::NAME;
    fn op(x: f32) -> f32 {
        R::op(x)
    }
    fn out(x: f32) -> f32 {
        x
    }
}

/// Softmax of a row in f64: the reference every variant is measured against.
pub fn softmax_f64(s: &[f32]) -> Vec<f64> {
    let m = s
        .iter()
        .map(|&x| f64::from(x))
        .fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return vec![0.0; s.len()];
    }
    let p: Vec<f64> = s.iter().map(|&x| (f64::from(x) - m).exp()).collect();
    let l: f64 = p.iter().sum();
    p.iter().map(|p| p / l).collect()
}

/// `softmax(s) · v` in f64.
pub fn attention_f64(s: &[f32], v: &[f32]) -> Result<f64> {
    check_len(s, v)?;
    Ok(softmax_f64(s)
        .iter()
        .zip(v)
        .map(|(p, &vj)| p * f64::from(vj))
        .sum())
}

/// Largest `|a - b|` over two rows.
pub fn max_abs_diff(a: &[f32], b: &[f64]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(&a, b)| (f64::from(a) - b).abs())
        .fold(0.0, f64::max)
}

#[cfg(test)]
mod tests {
    use super::*;
    use flashattn::random::Rng;

    const BLOCKS: [usize; 9] = [1, 2, 3, 8, 32, 100, 128, 1024, 5000];
    const MERGES: [Merge; 2] = [Merge::Running, Merge::BlockLocal];

    fn row(seed: u64, n: usize) -> (Vec<f32>, Vec<f32>) {
        let mut rng = Rng::new(seed);
        (rng.normal_vec(n, 2.0), rng.normal_vec(n, 1.0))
    }

    #[test]
    fn online_softmax_matches_whole_row_in_f32_for_every_block_size() {
        for seed in 0..4 {
            let (s, v) = row(seed, 1024);
            let whole = whole_row_softmax::<F32>(&s);
            let o_whole = whole_row_attention::<F32>(&s, &v).unwrap();
            for (b, merge) in BLOCKS.iter().flat_map(|&b| MERGES.map(|m| (b, m))) {
                let sizes = uniform(s.len(), b).unwrap();
                let p = online_softmax_split::<F32>(&s, &sizes, merge).unwrap();
                let err = whole
                    .iter()
                    .zip(&p)
                    .map(|(a, b)| (a - b).abs())
                    .fold(0.0f32, f32::max);
                assert!(err < 1e-6, "softmax, block {b}, {merge:?}: max error {err}");
                let o = online_attention_split::<F32>(&s, &v, &sizes, merge).unwrap();
                assert!(
                    (o - o_whole).abs() < 1e-6,
                    "attention, block {b}, {merge:?}: {o} vs {o_whole}"
                );
            }
        }
    }

    #[test]
    fn one_block_is_the_whole_row_bit_for_bit() {
        let (s, v) = row(7, 1000);
        for merge in MERGES {
            assert_eq!(
                online_softmax_split::<F16>(&s, &[1000], merge).unwrap(),
                whole_row_softmax::<F16>(&s)
            );
            assert_eq!(
                online_attention_split::<F16>(&s, &v, &[1000], merge).unwrap(),
                whole_row_attention::<F16>(&s, &v).unwrap()
            );
        }
        assert_eq!(
            online_softmax::<F16>(&s, 4096).unwrap(),
            whole_row_softmax::<F16>(&s)
        );
    }

    #[test]
    fn f32_online_is_close_to_f64_and_f16_is_not_exact() {
        let (s, v) = row(3, 1024);
        let reference = softmax_f64(&s);
        let o_ref = attention_f64(&s, &v).unwrap();
        let e32 = max_abs_diff(&online_softmax::<F32>(&s, 32).unwrap(), &reference);
        let e16 = max_abs_diff(&online_softmax::<F16>(&s, 32).unwrap(), &reference);
        assert!(e32 < 1e-6, "f32 softmax error {e32}");
        assert!(e16 > 1e-5 && e16 < 0.05, "f16 softmax error {e16}");
        let o32 = online_attention::<F32>(&s, &v, 32).unwrap();
        assert!((f64::from(o32) - o_ref).abs() < 1e-5);
    }

    #[test]
    fn independent_blocks_are_clearly_wrong() {
        // Max error over 16 rows: on a single row the wrong attention output
        // can land near the right one by chance.
        let rows: Vec<_> = (0..16).map(|seed| row(100 + seed, 1024)).collect();
        for b in [2, 8, 32, 128] {
            let (mut p_err, mut o_err) = (0.0f64, 0.0f64);
            for (s, v) in &rows {
                let p = blockwise_independent_softmax::<F32>(s, b).unwrap();
                p_err = p_err.max(max_abs_diff(&p, &softmax_f64(s)));
                let o = blockwise_independent_attention::<F32>(s, v, b).unwrap();
                o_err = o_err.max((f64::from(o) - attention_f64(s, v).unwrap()).abs());
            }
            assert!(p_err > 0.1, "block {b}: softmax error only {p_err}");
            assert!(o_err > 0.1, "block {b}: attention error only {o_err}");
        }
        // One block covering the row is the correct softmax again.
        let (s, _) = &rows[0];
        let p = blockwise_independent_softmax::<F32>(s, 1024).unwrap();
        assert!(max_abs_diff(&p, &softmax_f64(s)) < 1e-6);
    }

    /// A worked example: scores (1.414, 0.707, 0.707), v = (1, 0, 1)
    /// split as blocks {2, 1} and {1, 2}; softmax = (0.5035, 0.2483, 0.2483).
    #[test]
    fn worked_example_gives_0_752() {
        let (s, v) = ([1.414f32, 0.707, 0.707], [1.0f32, 0.0, 1.0]);
        for merge in [Merge::Running, Merge::BlockLocal] {
            for sizes in [&[2, 1][..], &[1, 2], &[1, 1, 1], &[3]] {
                let o = online_attention_split::<F32>(&s, &v, sizes, merge).unwrap();
                assert!((o - 0.7518).abs() < 5e-4, "{merge:?} {sizes:?}: {o}");
                assert_eq!(format!("{o:.3}"), "0.752");
                let p = online_softmax_split::<F32>(&s, sizes, merge).unwrap();
                for (got, want) in p.iter().zip([0.5035, 0.2483, 0.2483]) {
                    assert!((got - want).abs() < 1e-4, "{merge:?} {sizes:?}: {p:?}");
                }
            }
        }
    }

    #[test]
    fn masked_rows_and_bad_arguments() {
        let s = [f32::NEG_INFINITY; 4];
        assert_eq!(online_softmax::<F16>(&s, 2).unwrap(), vec![0.0; 4]);
        assert_eq!(online_attention::<F16>(&s, &[1.0; 4], 2).unwrap(), 0.0);
        let s = [f32::NEG_INFINITY, f32::NEG_INFINITY, 0.0, 0.0];
        assert_eq!(
            online_softmax::<F32>(&s, 2).unwrap(),
            vec![0.0, 0.0, 0.5, 0.5]
        );
        assert_eq!(online_softmax::<F32>(&s, 0), Err(StudyError::EmptyBlock));
        assert_eq!(
            online_attention::<F32>(&s, &[1.0], 2),
            Err(StudyError::Lengths {
                scores: 4,
                values: 1
            })
        );
        for sizes in [&[1, 2][..], &[4, 0]] {
            let r = online_softmax_split::<F32>(&s, sizes, Merge::BlockLocal);
            assert!(matches!(r, Err(StudyError::BadSplit { .. })), "{sizes:?}");
        }
    }
}

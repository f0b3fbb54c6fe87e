//! The forward's inner loop, shared by the forward and decoding: a block
//! of query rows streams the key blocks its masks reach (skipping blocks
//! no row sees), `S = Q·Kᵀ` and `O += P·V` on the micro-kernel, and the
//! online softmax on each block of S in between with the vectorized `exp`.

use super::micro::{gemm, Dims, Kernel, Mat};
use super::scores::{ScoreRow, ScoreRule, Visibility};
use super::vmath::{self, Rounding};

/// Sizes every block shares: head dim, its padded width, keys per block.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    pub d: usize,
    pub dpad: usize,
    pub bc: usize,
}

/// One block of keys as the products read it: Kᵀ `(d, bc)` and V `(bc, dpad)`.
pub(crate) struct KeyBlock<'a> {
    pub kt: &'a [f32],
    pub v: &'a [f32],
}

/// A task's own buffers for sources that copy their blocks.
#[derive(Default)]
pub(crate) struct Scratch {
    pub kt: Vec<f32>,
    pub v: Vec<f32>,
}

/// Where key blocks come from: packed tensors, or a (paged) KV cache.
pub(crate) trait KeySource {
    /// Keys `kb · bc ..` (zeros past the last key).
    fn block<'s>(&'s self, kb: usize, scratch: &'s mut Scratch) -> KeyBlock<'s>;
}

/// The rows of one task: row `r`'s q at `q.data[r · q.rs ..][..d]`.
pub(crate) struct Query<'a> {
    pub q: Mat<'a>,
    pub rows: &'a [ScoreRow],
}

/// A task's rows: normalized outputs `(rows, dpad)` and their LSE (−inf
/// and o = 0 for a row that saw no key).
pub(crate) struct Partial {
    pub o: Vec<f32>,
    pub lse: Vec<f32>,
}

/// The block's work buffers: scores/probabilities, output sums, and each
/// row's running max `m`, running sum `l`, block max and rescale factor.
struct Work {
    s: Vec<f32>,
    o: Vec<f32>,
    m: Vec<f32>,
    l: Vec<f32>,
    block_max: Vec<f32>,
    alpha: Vec<f32>,
}

impl Work {
    fn new(g: &Geometry, n: usize) -> Self {
        Self {
            s: vec![0f32; n * g.bc],
            o: vec![0f32; n * g.dpad],
            m: vec![f32::NEG_INFINITY; n],
            l: vec![0f32; n],
            block_max: vec![0f32; n],
            alpha: vec![0f32; n],
        }
    }
}

/// Attention of `q`'s rows over the keys their ranges allow.
#[inline(always)]
pub(crate) fn attend<K: Kernel, S: KeySource>(
    g: &Geometry,
    rule: &ScoreRule,
    q: &Query,
    src: &S,
    round_p: Rounding,
) -> Partial {
    let n = q.rows.len();
    let mut w = Work::new(g, n);
    let mut scratch = Scratch::default();
    let span = ScoreRule::span(q.rows);
    if !span.is_empty() {
        for kb in span.start / g.bc..span.end.div_ceil(g.bc) {
            let keys = kb * g.bc..(kb + 1) * g.bc;
            let vis = ScoreRule::visibility(q.rows, &keys);
            if vis == Visibility::Skip {
                continue;
            }
            let blk = src.block(kb, &mut scratch);
            let s_dims = Dims {
                m: n,
                n: g.bc,
                k: g.d,
            };
            gemm::<K>(s_dims, q.q, Mat::rows(blk.kt, g.bc), &mut w.s, g.bc, false);
            online_update::<K>(g, rule, q.rows, (&keys, vis), &mut w, round_p);
            let pv = Dims {
                m: n,
                n: g.dpad,
                k: g.bc,
            };
            gemm::<K>(
                pv,
                Mat::rows(&w.s, g.bc),
                Mat::rows(blk.v, g.dpad),
                &mut w.o,
                g.dpad,
                true,
            );
        }
    }
    finish(g, w)
}

/// The online-softmax step of every row on its block of scores: the
/// scores and their block max, then every row's new max and rescale factor
/// (one vectorized loop over the rows), then P, the sums and the rescaled
/// output. P is left in `w.s`, rounded by `round_p`; the sums take P
/// unrounded. A row that sees no key of the block keeps its state and
/// gets P = 0.
#[inline(always)]
fn online_update<K: Kernel>(
    g: &Geometry,
    rule: &ScoreRule,
    rows: &[ScoreRow],
    (keys, vis): (&std::ops::Range<usize>, Visibility),
    w: &mut Work,
    round_p: Rounding,
) {
    for ((row, s), bm) in rows
        .iter()
        .zip(w.s.chunks_exact_mut(g.bc))
        .zip(&mut w.block_max)
    {
        rule.apply::<K>(row, keys, vis, s);
        *bm = vmath::max(s);
    }
    for ((m, a), bm) in w.m.iter_mut().zip(&mut w.alpha).zip(&w.block_max) {
        let new = m.max(*bm);
        *a = if new == f32::NEG_INFINITY {
            1.0
        } else {
            vmath::exp::<K>(*m - new)
        };
        *m = new;
    }
    let o = w.o.chunks_exact_mut(g.dpad);
    let s = w.s.chunks_exact_mut(g.bc);
    for (r, (s, o)) in s.zip(o).enumerate().take(rows.len()) {
        if w.block_max[r] == f32::NEG_INFINITY {
            s.fill(0.0);
            continue;
        }
        let alpha = w.alpha[r];
        w.l[r] = w.l[r] * alpha + vmath::exp_sub_sum::<K>(s, w.m[r]);
        if alpha != 1.0 {
            vmath::scale(o, alpha);
        }
        vmath::round_with(round_p, s);
    }
}

/// Normalize every row and take its LSE.
#[inline(always)]
fn finish(g: &Geometry, mut w: Work) -> Partial {
    let lse =
        w.m.iter()
            .zip(&w.l)
            .zip(w.o.chunks_exact_mut(g.dpad))
            .map(|((&m, &l), o)| {
                if l > 0.0 {
                    vmath::scale(o, 1.0 / l);
                    m + l.ln()
                } else {
                    o.fill(0.0);
                    f32::NEG_INFINITY
                }
            })
            .collect();
    Partial { o: w.o, lse }
}

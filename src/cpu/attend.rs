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

/// A row's running max and sum.
#[derive(Clone, Copy)]
struct Running {
    m: f32,
    l: f32,
}

/// The block's work buffers: scores/probabilities and output sums.
struct Work {
    s: Vec<f32>,
    o: Vec<f32>,
    state: Vec<Running>,
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
    let init = Running {
        m: f32::NEG_INFINITY,
        l: 0.0,
    };
    let mut w = Work {
        s: vec![0f32; n * g.bc],
        o: vec![0f32; n * g.dpad],
        state: vec![init; n],
    };
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
            for (r, row) in q.rows.iter().enumerate() {
                online_update(g, rule, (row, &keys, vis), &mut w, r, round_p);
            }
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

/// Row `r`'s online-softmax step on its scores: rescale its sums to the
/// new max and leave P (rounded by `round_p`) in `w.s`; the sums take P
/// unrounded.
#[inline(always)]
fn online_update(
    g: &Geometry,
    rule: &ScoreRule,
    (row, keys, vis): (&ScoreRow, &std::ops::Range<usize>, Visibility),
    w: &mut Work,
    r: usize,
    round_p: Rounding,
) {
    let s = &mut w.s[r * g.bc..][..g.bc];
    rule.apply(row, keys, vis, s);
    let block_max = vmath::max(s);
    if block_max == f32::NEG_INFINITY {
        s.fill(0.0);
        return;
    }
    let st = &mut w.state[r];
    let m = st.m.max(block_max);
    let alpha = vmath::exp(st.m - m);
    st.l = st.l * alpha + vmath::exp_sub_sum(s, m);
    st.m = m;
    if alpha != 1.0 {
        vmath::scale(&mut w.o[r * g.dpad..][..g.dpad], alpha);
    }
    vmath::round_with(round_p, s);
}

/// Normalize every row and take its LSE.
#[inline(always)]
fn finish(g: &Geometry, mut w: Work) -> Partial {
    let lse = w
        .state
        .iter()
        .zip(w.o.chunks_exact_mut(g.dpad))
        .map(|(st, o)| {
            if st.l > 0.0 {
                vmath::scale(o, 1.0 / st.l);
                st.m + st.l.ln()
            } else {
                o.fill(0.0);
                f32::NEG_INFINITY
            }
        })
        .collect();
    Partial { o: w.o, lse }
}

//! The forward's inner loop, shared by the forward and decoding: a block
//! of query rows streams the key blocks its masks reach (skipping blocks
//! no row sees), `S = Q·Kᵀ` and `O += P·V` on the micro-kernel, and the
//! online softmax on each block of S in between with the vectorized `exp`.

use super::micro::{gemm, row_dots, Dims, Kernel, Mat, Operand};
use super::scores::{ScoreRow, ScoreRule, Visibility};
use super::vmath::{self, Lanes, Rounding, LANES};

/// Sizes every block shares: q/k's head dim and v's, their padded widths,
/// keys per block.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Geometry {
    pub d: usize,
    pub dpad: usize,
    pub dv: usize,
    pub dvpad: usize,
    pub bc: usize,
}

impl Geometry {
    pub fn new([d, dv]: [usize; 2], bc: usize) -> Self {
        Self {
            d,
            dpad: super::pack::padded(d),
            dv,
            dvpad: super::pack::padded(dv),
            bc,
        }
    }
}

/// One block of keys as the products read it: K in either layout and V
/// in rows of `ldv` (at least `dvpad`), from the block's key `from`; f32,
/// or a quantized cache's codes with each key's scales.
pub(crate) struct KeyBlock<'a, B = f32> {
    pub k: Keys<'a, B>,
    pub v: &'a [B],
    pub ldv: usize,
    /// The key of the block (0 its first) K's, V's and the scales' data start at.
    pub from: usize,
    pub scales: Option<KeyScales<'a>>,
}

impl<'a> KeyBlock<'a> {
    /// f32 keys and values from the block's first key.
    pub fn plain(k: Keys<'a>, v: &'a [f32], ldv: usize) -> Self {
        Self {
            k,
            v,
            ldv,
            from: 0,
            scales: None,
        }
    }
}

/// Each key's K and V scale (a quantized cache's block scales), from the
/// block data's first key: scores are multiplied by K's before the softmax,
/// probabilities by V's before `P·V`.
pub(crate) struct KeyScales<'a> {
    pub k: &'a [f32],
    pub v: &'a [f32],
}

/// A block's keys: transposed for the micro-kernel (many query rows per
/// key, packed once per call), or in rows (a cache's rows as they are, for
/// the few rows of decoding: [`row_dots`]).
pub(crate) enum Keys<'a, B = f32> {
    /// Kᵀ, `(d, bc)` in rows of the given stride.
    Transposed(&'a [B], usize),
    /// K in rows of the given stride, each `dpad` long (zero past `d`, or,
    /// where `d` is `dpad`, the row's own elements).
    Rows(&'a [B], usize),
}

/// Where key blocks come from (packed tensors).
pub(crate) trait KeySource {
    /// Keys `kb · bc ..` (zeros past the last key).
    fn block(&self, kb: usize) -> KeyBlock<'_>;
}

/// The rows of one task: row `r`'s q at `q.data[r · q.rs ..][..d]`
/// (zero-padded to `dpad` for [`Keys::Rows`]).
pub(crate) struct Query<'a> {
    pub q: Mat<'a>,
    pub rows: &'a [ScoreRow],
}

/// A task's rows: normalized outputs `(rows, dvpad)` and their LSE (−inf
/// and o = 0 for a row that saw no key).
pub(crate) struct Partial {
    pub o: Vec<f32>,
    pub lse: Vec<f32>,
}

/// The block's work buffers: scores/probabilities, output sums, and each
/// row's running max `m`, running sum `l` (in lanes, folded at the end),
/// new max and rescale factor.
struct Work {
    /// `s`'s row stride ([`super::pack::stride`] of the block's keys).
    lds: usize,
    s: Vec<f32>,
    o: Vec<f32>,
    m: Vec<f32>,
    l: Vec<Lanes>,
    new_max: Vec<f32>,
    alpha: Vec<f32>,
    /// Dropout's keep bits of one row of the block.
    keep: Vec<bool>,
}

impl Work {
    fn new(g: &Geometry, n: usize) -> Self {
        let lds = super::pack::stride(g.bc);
        Self {
            lds,
            s: vec![0f32; n * lds],
            o: vec![0f32; n * g.dvpad],
            m: vec![f32::NEG_INFINITY; n],
            l: vec![[0f32; LANES]; n],
            new_max: vec![0f32; n],
            alpha: vec![0f32; n],
            keep: vec![false; g.bc],
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
    let mut stream = Stream::new(g, rule, q, round_p);
    for kb in stream.key_blocks() {
        if let Some(reach) = stream.reach(kb) {
            stream.update::<K, f32>(&reach, &src.block(kb));
        }
    }
    stream.finish()
}

/// One block of rows streaming key blocks: what [`attend`] loops over, and
/// decoding interleaves across kv heads (each block of the cache read once
/// for all of them).
pub(crate) struct Stream<'a> {
    g: &'a Geometry,
    rule: &'a ScoreRule<'a>,
    q: &'a Query<'a>,
    round_p: Rounding,
    w: Work,
}

impl<'a> Stream<'a> {
    pub fn new(g: &'a Geometry, rule: &'a ScoreRule, q: &'a Query, round_p: Rounding) -> Self {
        Self {
            g,
            rule,
            q,
            round_p,
            w: Work::new(g, q.rows.len()),
        }
    }

    /// The key blocks some row reaches.
    pub fn key_blocks(&self) -> std::ops::Range<usize> {
        let span = ScoreRule::span(self.q.rows);
        if span.is_empty() {
            0..0
        } else {
            span.start / self.g.bc..span.end.div_ceil(self.g.bc)
        }
    }

    /// What the rows see of block `kb`; `None` when no row sees any key
    /// (the block is neither loaded nor computed).
    pub fn reach(&self, kb: usize) -> Option<Reach> {
        let (g, rows) = (self.g, self.q.rows);
        let (keys, vis) = ScoreRule::narrow(rows, &(kb * g.bc..(kb + 1) * g.bc));
        let vis = self.rule.refine(rows, &keys, vis);
        (vis != Visibility::Skip).then_some(Reach { kb, keys, vis })
    }

    /// Block `reach.kb`'s scores, online softmax and `O += P·V`.
    #[inline(always)]
    pub fn update<K: Kernel, B: Operand>(&mut self, reach: &Reach, blk: &KeyBlock<B>) {
        let (g, q, w) = (self.g, self.q, &mut self.w);
        let n = q.rows.len();
        let nc = reach.keys.len();
        // The first key reached, in the block's data.
        let c0 = reach.keys.start - reach.kb * g.bc - blk.from;
        let s_dims = Dims {
            m: n,
            n: nc,
            k: g.d,
        };
        match blk.k {
            Keys::Transposed(kt, ld) => gemm::<K, _>(
                s_dims,
                q.q,
                Mat::rows(&kt[c0..], ld),
                &mut w.s,
                w.lds,
                false,
            ),
            Keys::Rows(k, ld) => {
                // Both operands' rows are zero-padded to dpad.
                let dims = Dims {
                    k: g.dpad,
                    ..s_dims
                };
                row_dots::<K, _>(dims, q.q, Mat::rows(&k[c0 * ld..], ld), &mut w.s, w.lds);
            }
        }
        let scales = blk.scales.as_ref();
        if let Some(scales) = scales {
            scale_columns(&mut w.s, w.lds, n, &scales.k[c0..][..nc]);
        }
        online_update::<K>(g, self.rule, q.rows, reach, w, self.round_p);
        if let Some(scales) = scales {
            scale_columns(&mut w.s, w.lds, n, &scales.v[c0..][..nc]);
        }
        let pv = Dims {
            m: n,
            n: g.dvpad,
            k: nc,
        };
        let v = Mat::rows(&blk.v[c0 * blk.ldv..], blk.ldv);
        gemm::<K, _>(pv, Mat::rows(&w.s, w.lds), v, &mut w.o, g.dvpad, true);
    }

    /// Every row normalized, with its LSE.
    pub fn finish(self) -> Partial {
        finish(self.g, self.w, self.rule.keep_scale())
    }
}

/// Column `c` of each of the first `rows` rows (of stride `ld`) times `by[c]`.
#[inline(always)]
fn scale_columns(s: &mut [f32], ld: usize, rows: usize, by: &[f32]) {
    for row in s.chunks_exact_mut(ld).take(rows) {
        for (x, &k) in row.iter_mut().zip(by) {
            *x *= k;
        }
    }
}

/// The keys of block `kb` that its rows reach (whole micro-kernel panels),
/// and what they see of them.
pub(crate) struct Reach {
    kb: usize,
    pub keys: std::ops::Range<usize>,
    vis: Visibility,
}

/// The online-softmax step of every row on its block of scores: the
/// scores and each row's new max (folded from lane maxima only where some
/// lane exceeds the running max, which after the first blocks is rare),
/// then every row's rescale factor (one vectorized loop over the rows),
/// then P, the lane sums and the rescaled output. P is left in `w.s`,
/// rounded by `round_p`; the sums take P unrounded. A row that has seen no
/// key yet keeps its state and gets P = 0.
#[inline(always)]
fn online_update<K: Kernel>(
    g: &Geometry,
    rule: &ScoreRule,
    rows: &[ScoreRow],
    reach: &Reach,
    w: &mut Work,
    round_p: Rounding,
) {
    let (keys, vis) = (&reach.keys, reach.vis);
    let nc = keys.len();
    let maxima = w.new_max.iter_mut().zip(&w.m);
    for ((row, s), (new, &m)) in rows.iter().zip(w.s.chunks_exact_mut(w.lds)).zip(maxima) {
        let s = &mut s[..nc];
        rule.apply::<K>(row, keys, vis, s);
        let lanes = vmath::lane_max(s);
        *new = if vmath::any_above(&lanes, m) {
            vmath::fold_max(lanes)
        } else {
            m
        };
    }
    for ((m, a), &new) in w.m.iter_mut().zip(&mut w.alpha).zip(&w.new_max) {
        *a = if new == f32::NEG_INFINITY {
            1.0
        } else {
            vmath::exp::<K>(*m - new)
        };
        *m = new;
    }
    let o = w.o.chunks_exact_mut(g.dvpad);
    let s = w.s.chunks_exact_mut(w.lds);
    for (r, (s, o)) in s.zip(o).enumerate().take(rows.len()) {
        let s = &mut s[..nc];
        let (m, alpha) = (w.m[r], w.alpha[r]);
        if m == f32::NEG_INFINITY {
            // The max passes NaN over: a row whose allowed scores are all
            // NaN (a NaN in its q) poisons its sum, so that it comes out
            // NaN as torch's would, not as an empty row.
            if s.iter().any(|x| x.is_nan()) {
                w.l[r][0] = f32::NAN;
            }
            s.fill(0.0);
            continue;
        }
        let p = vmath::exp_sub_lanes::<K>(s, m);
        for (l, p) in w.l[r].iter_mut().zip(p) {
            *l = *l * alpha + p;
        }
        if alpha != 1.0 {
            vmath::scale(o, alpha);
        }
        // Dropout zeroes dropped P after the row sum (the LSE is the
        // undropped one); 1/(1 − p) is applied to O at the end.
        if let Some(d) = &rule.dropout {
            d.keep_row(rows[r].i, keys, &mut w.keep);
            for (x, &k) in s.iter_mut().zip(&w.keep) {
                *x = if k { *x } else { 0.0 };
            }
        }
        vmath::round_with(round_p, s);
    }
}

/// Normalize every row (times dropout's `keep_scale`, 1 without) and take
/// its LSE.
#[inline(always)]
fn finish(g: &Geometry, mut w: Work, keep_scale: f32) -> Partial {
    let lse =
        w.m.iter()
            .zip(&w.l)
            .zip(w.o.chunks_exact_mut(g.dvpad))
            .map(|((&m, &l), o)| {
                let l = vmath::fold_sum(l);
                // A NaN score (a NaN or infinity in q, k or v) makes l NaN:
                // the row comes out NaN, as in torch, not empty.
                if l > 0.0 || l.is_nan() {
                    vmath::scale(o, keep_scale / l);
                    m + l.ln()
                } else {
                    o.fill(0.0);
                    f32::NEG_INFINITY
                }
            })
            .collect();
    Partial { o: w.o, lse }
}

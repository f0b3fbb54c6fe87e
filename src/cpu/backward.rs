//! The CPU backward: FlashAttention-2's, written independently of the
//! reference and of the accuracy rule's baseline.
//!
//! It takes the forward's `lse` as given (`P = exp(s - lse)`, no softmax is
//! recomputed) and `D = rowsum(dO ∘ O)`. Two deterministic passes, no atomics:
//! pass 1 runs one task per (sequence, kv head, block of `BC` keys) and
//! accumulates that block's dK and dV over the group's query heads and the
//! band of rows that can see the block; pass 2 runs one task per (sequence,
//! query head, block of `BR` rows) and accumulates dQ over the key blocks
//! those rows can see. Every task loops in a fixed order, so repeated runs
//! are bit-identical. Key tiles are stored transposed, `(d, n)`, so a row of
//! scores is a sum of contiguous axpys the compiler vectorizes. Scores and
//! masks follow the pair rule (`api::pair_rule`: ALiBi, the band and block
//! masks per sequence); with sinks, `dsink_h = −Σ exp(sink_h − lse)·D` is
//! summed in row order.

use crate::api::inputs::BackwardInputs;
use crate::api::options::AttentionOptions;
use crate::api::output::{BackwardOutput, CallStats};
use crate::api::pair_rule::PairRule;
use crate::api::shape::{AttentionShape, Layout};
use crate::api::tensor::{Precision, TensorData};
use crate::api::varlen::{sequences, Sequence};
use crate::error::Result;
use rayon::prelude::*;
use std::ops::Range;

/// Query rows per dQ task.
const BR: usize = 64;
/// Keys per dK/dV task and per key tile.
const BC: usize = 64;

/// The tensors of one backward call, f32, in the standard layouts: `q`,
/// `d_o` `(batch, seqlen_q, heads_q, d)` (dO with v's head dim), `k`, `v`
/// `(batch, seqlen_k, heads_kv, d)`, `lse` as the forward wrote it.
struct Tensors<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub d_o: &'a [f32],
    pub lse: &'a [f32],
}

/// Everything a task reads: inputs, `D`, and the problem's constants.
struct Ctx<'a> {
    x: &'a Tensors<'a>,
    /// `D = rowsum(dO ∘ O)`, laid out like `lse`.
    delta: Vec<f32>,
    shape: AttentionShape,
    opts: &'a AttentionOptions,
    seqs: Vec<Sequence>,
    ql: Layout,
    kl: Layout,
    vl: Layout,
    ol: Layout,
    scale: f32,
    precision: Precision,
}

/// One query row: where it lives in q and dO, its `lse` and `D`.
struct Row {
    at_q: usize,
    at_o: usize,
    lse: f32,
    delta: f32,
}

/// K and V of one key block of one kv head, transposed to `(d, n)` and `(dv, n)`.
struct KeyTile {
    keys: Range<usize>,
    kt: Vec<f32>,
    vt: Vec<f32>,
}

/// Gradients dq, dk, dv (and dsinks) on the CPU, from the forward's `o` and `lse`.
pub fn backward(inputs: &BackwardInputs, opts: &AttentionOptions) -> Result<BackwardOutput> {
    let shape = inputs.shape()?;
    opts.validate_for(&shape)?;
    let precision = inputs.q.precision();
    let i = inputs;
    let [q, k, v, o, d_o] = [i.q, i.k, i.v, i.o, i.d_o].map(|t| t.data.to_f32());
    let tensors = Tensors {
        q: &q,
        k: &k,
        v: &v,
        d_o: &d_o,
        lse: i.lse,
    };
    let ctx = Ctx {
        x: &tensors,
        delta: row_deltas(&shape, &o, &d_o),
        shape,
        opts,
        seqs: sequences(&shape, opts.varlen.as_ref()),
        ql: Layout::q(&shape),
        kl: Layout::kv(&shape),
        vl: Layout::v(&shape),
        ol: Layout::o(&shape),
        scale: opts.scale_for(shape.head_dim),
        precision,
    };
    let (dk, dv) = ctx.key_pass();
    let dq = ctx.query_pass();
    let grads = [dq, dk, dv].map(|g| TensorData::from_f32(g, precision));
    let out = BackwardOutput::new(&shape, grads, CallStats::default()).with_dsinks(ctx.dsinks());
    Ok(out.packed(opts.varlen.is_some()))
}

/// `D_i = Σ_x dO_ix · O_ix` for every row, in `lse`'s layout.
fn row_deltas(shape: &AttentionShape, o: &[f32], d_o: &[f32]) -> Vec<f32> {
    let (sq, hq) = (shape.seqlen_q, shape.heads_q);
    let ol = Layout::o(shape);
    (0..shape.lse_len())
        .into_par_iter()
        .map(|r| {
            let at = ol.row(r / (hq * sq), r % sq, (r / sq) % hq);
            let (a, b) = (&o[at..][..ol.dim], &d_o[at..][..ol.dim]);
            a.iter().zip(b).map(|(x, y)| x * y).sum()
        })
        .collect()
}

/// `y += a · x`.
#[inline]
fn axpy(y: &mut [f32], a: f32, x: &[f32]) {
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// The first `i` in `0..n` where `pred` is false (`pred` holds on a prefix).
fn partition(n: usize, pred: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if pred(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

impl Ctx<'_> {
    fn rule(&self, seq: &Sequence, h: usize) -> PairRule<'_> {
        PairRule::new(self.opts, seq, h, [self.shape.heads_q, self.shape.head_dim])
    }

    fn row(&self, seq: &Sequence, h: usize, i: usize) -> Row {
        let r = seq.lse_index(h, i);
        let flat = seq.q.start + i;
        Row {
            at_q: self.ql.row(0, flat, h),
            at_o: self.ol.row(0, flat, h),
            lse: self.x.lse[r],
            delta: self.delta[r],
        }
    }

    /// `dsink_h = −Σ exp(sink_h − lse)·D` over each head's rows, in order.
    fn dsinks(&self) -> Option<Vec<f32>> {
        let sinks = self.opts.sinks.as_ref()?;
        let mut out = vec![0f32; self.shape.heads_q];
        for (h, (ds, &sink)) in out.iter_mut().zip(sinks.logits()).enumerate() {
            for seq in &self.seqs {
                for i in 0..seq.len_q() {
                    let r = seq.lse_index(h, i);
                    *ds -= (sink - self.x.lse[r]).exp() * self.delta[r];
                }
            }
        }
        Some(out)
    }

    /// The rows of `rule`'s sequence that may see some key of `keys`: both
    /// ends of the band `keys(i)` never decrease with `i`, so they form one range.
    fn rows_seeing(&self, rule: &PairRule, len_q: usize, keys: &Range<usize>) -> Range<usize> {
        let first = partition(len_q, |i| rule.keys(i).end <= keys.start);
        let end = partition(len_q, |i| rule.keys(i).start < keys.end);
        first..end.max(first)
    }

    /// The keys some row of `rows` may see (empty rows see none).
    fn keys_seen(rule: &PairRule, rows: Range<usize>) -> Range<usize> {
        let (mut lo, mut hi) = (usize::MAX, 0);
        for i in rows {
            let r = rule.keys(i);
            if !r.is_empty() {
                lo = lo.min(r.start);
                hi = hi.max(r.end);
            }
        }
        lo.min(hi)..hi
    }

    /// The columns of `tile` row `i` may see by the band, relative to the tile.
    fn cols(rule: &PairRule, i: usize, tile: &KeyTile) -> Range<usize> {
        let r = rule.keys(i);
        let (lo, hi) = (r.start.max(tile.keys.start), r.end.min(tile.keys.end));
        if lo >= hi {
            return 0..0;
        }
        lo - tile.keys.start..hi - tile.keys.start
    }

    fn load_tile(&self, seq: &Sequence, hk: usize, keys: Range<usize>) -> KeyTile {
        let (n, d, dv) = (keys.len(), self.kl.dim, self.vl.dim);
        let mut kt = vec![0f32; d * n];
        let mut vt = vec![0f32; dv * n];
        for (c, j) in keys.clone().enumerate() {
            let flat = seq.k.start + j;
            let (ka, va) = (self.kl.row(0, flat, hk), self.vl.row(0, flat, hk));
            for x in 0..d {
                kt[x * n + c] = self.x.k[ka + x];
            }
            for x in 0..dv {
                vt[x * n + c] = self.x.v[va + x];
            }
        }
        KeyTile { keys, kt, vt }
    }

    /// For `row` (row `i`) against `tile`'s columns `cols`: P into `p` and dS
    /// into `ds`, both rounded to the storage precision (dS without the
    /// scale); pairs the block mask masks are 0.
    fn row_grads(
        &self,
        (rule, row, i): (&PairRule, &Row, usize),
        tile: &KeyTile,
        cols: Range<usize>,
        [p, ds]: [&mut [f32]; 2],
    ) {
        let (n, d, dv) = (tile.keys.len(), self.ql.dim, self.ol.dim);
        let (q, g) = (&self.x.q[row.at_q..][..d], &self.x.d_o[row.at_o..][..dv]);
        p[cols.clone()].fill(0.0);
        ds[cols.clone()].fill(0.0);
        for (x, &qx) in q.iter().enumerate() {
            axpy(&mut p[cols.clone()], qx, &tile.kt[x * n..][cols.clone()]);
        }
        for (x, &gx) in g.iter().enumerate() {
            axpy(&mut ds[cols.clone()], gx, &tile.vt[x * n..][cols.clone()]);
        }
        for c in cols {
            let j = tile.keys.start + c;
            if !rule.allows(i, j) {
                (p[c], ds[c]) = (0.0, 0.0);
                continue;
            }
            let (s, dcap) = rule.score(p[c], i, j);
            let pc = (s - row.lse).exp();
            p[c] = self.precision.round(pc);
            ds[c] = self.precision.round(pc * (ds[c] - row.delta) * dcap);
        }
    }

    /// Pass 1: dK and dV of every key block, scattered into the layouts.
    fn key_pass(&self) -> (Vec<f32>, Vec<f32>) {
        let sh = &self.shape;
        let tasks: Vec<(usize, usize, usize)> = self
            .seqs
            .iter()
            .enumerate()
            .flat_map(|(n, s)| {
                (0..sh.heads_kv)
                    .flat_map(move |hk| (0..s.len_k().div_ceil(BC)).map(move |kb| (n, hk, kb)))
            })
            .collect();
        let block = |n: usize, kb: usize| kb * BC..((kb + 1) * BC).min(self.seqs[n].len_k());
        let tiles: Vec<(Vec<f32>, Vec<f32>)> = tasks
            .par_iter()
            .map(|&(n, hk, kb)| self.key_block(&self.seqs[n], hk, block(n, kb)))
            .collect();
        let (mut dk, mut dv) = (vec![0f32; sh.kv_len()], vec![0f32; sh.v_len()]);
        let (d, dvd) = (sh.head_dim, sh.head_dim_v);
        for (&(n, hk, kb), (tk, tv)) in tasks.iter().zip(&tiles) {
            for (c, j) in block(n, kb).enumerate() {
                let flat = self.seqs[n].k.start + j;
                dk[self.kl.row(0, flat, hk)..][..d].copy_from_slice(&tk[c * d..][..d]);
                dv[self.vl.row(0, flat, hk)..][..dvd].copy_from_slice(&tv[c * dvd..][..dvd]);
            }
        }
        (dk, dv)
    }

    /// dK `(n, d)` and dV `(n, dv)` of the keys `keys` of kv head `hk` of
    /// `seq`, summed over the group's query heads, scaled and rounded.
    fn key_block(&self, seq: &Sequence, hk: usize, keys: Range<usize>) -> (Vec<f32>, Vec<f32>) {
        let (d, dvd) = (self.kl.dim, self.vl.dim);
        let tile = self.load_tile(seq, hk, keys);
        let n = tile.keys.len();
        let (mut dk, mut dv) = (vec![0f32; n * d], vec![0f32; n * dvd]);
        let (mut p, mut ds) = ([0f32; BC], [0f32; BC]);
        let g = self.shape.group();
        for h in hk * g..(hk + 1) * g {
            let rule = self.rule(seq, h);
            for i in self.rows_seeing(&rule, seq.len_q(), &tile.keys) {
                let row = self.row(seq, h, i);
                let cols = Self::cols(&rule, i, &tile);
                if cols.is_empty() || row.lse == f32::NEG_INFINITY {
                    continue;
                }
                self.row_grads((&rule, &row, i), &tile, cols.clone(), [&mut p, &mut ds]);
                let (q, gr) = (&self.x.q[row.at_q..][..d], &self.x.d_o[row.at_o..][..dvd]);
                for c in cols {
                    axpy(&mut dk[c * d..][..d], ds[c], q);
                    axpy(&mut dv[c * dvd..][..dvd], p[c], gr);
                }
            }
        }
        let prec = self.precision;
        dk.iter_mut().for_each(|x| *x = prec.round(*x * self.scale));
        dv.iter_mut().for_each(|x| *x = prec.round(*x));
        (dk, dv)
    }

    /// Pass 2: dQ of every query block, scattered into q's layout.
    fn query_pass(&self) -> Vec<f32> {
        let sh = &self.shape;
        let tasks: Vec<(usize, usize, usize)> = self
            .seqs
            .iter()
            .enumerate()
            .flat_map(|(n, s)| {
                (0..sh.heads_q)
                    .flat_map(move |h| (0..s.len_q().div_ceil(BR)).map(move |qb| (n, h, qb)))
            })
            .collect();
        let block = |n: usize, qb: usize| qb * BR..((qb + 1) * BR).min(self.seqs[n].len_q());
        let tiles: Vec<Vec<f32>> = tasks
            .par_iter()
            .map(|&(n, h, qb)| self.query_block(&self.seqs[n], h, block(n, qb)))
            .collect();
        let mut dq = vec![0f32; sh.q_len()];
        let d = sh.head_dim;
        for (&(n, h, qb), tq) in tasks.iter().zip(&tiles) {
            for (r, i) in block(n, qb).enumerate() {
                let flat = self.seqs[n].q.start + i;
                dq[self.ql.row(0, flat, h)..][..d].copy_from_slice(&tq[r * d..][..d]);
            }
        }
        dq
    }

    /// dQ `(rows, d)` of the rows `rows` of query head `h` of `seq`, over
    /// the key blocks they can see, scaled and rounded.
    fn query_block(&self, seq: &Sequence, h: usize, rows: Range<usize>) -> Vec<f32> {
        let d = self.ql.dim;
        let hk = h / self.shape.group();
        let rule = self.rule(seq, h);
        let mut dq = vec![0f32; rows.len() * d];
        let (mut p, mut ds) = ([0f32; BC], [0f32; BC]);
        let seen = Self::keys_seen(&rule, rows.clone());
        let mut k0 = seen.start / BC * BC;
        while k0 < seen.end {
            let keys = k0..(k0 + BC).min(seq.len_k());
            k0 += BC;
            if rule.skips(&rows, &keys) {
                continue;
            }
            let tile = self.load_tile(seq, hk, keys);
            for (r, i) in rows.clone().enumerate() {
                let row = self.row(seq, h, i);
                let cols = Self::cols(&rule, i, &tile);
                if cols.is_empty() || row.lse == f32::NEG_INFINITY {
                    continue;
                }
                self.row_grads((&rule, &row, i), &tile, cols.clone(), [&mut p, &mut ds]);
                let out = &mut dq[r * d..][..d];
                for c in cols {
                    let flat = seq.k.start + tile.keys.start + c;
                    axpy(out, ds[c], &self.x.k[self.kl.row(0, flat, hk)..][..d]);
                }
            }
        }
        let prec = self.precision;
        dq.iter_mut().for_each(|x| *x = prec.round(*x * self.scale));
        dq
    }
}

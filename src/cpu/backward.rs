//! The CPU backward: FlashAttention-2's, written independently of the
//! reference and of the accuracy rule's baseline.
//!
//! It takes the forward's `lse` as given (`P = exp(s - lse)`, no softmax is
//! recomputed) and `D = rowsum(dO ∘ O)`. Two deterministic passes, no atomics:
//! pass 1 runs one task per (batch, kv head, block of `BC` keys) and
//! accumulates that block's dK and dV over the group's query heads and the
//! band of rows that can see the block; pass 2 runs one task per (batch,
//! query head, block of `BR` rows) and accumulates dQ over the key blocks
//! those rows can see. Every task loops in a fixed order, so repeated runs
//! are bit-identical. Key tiles are stored transposed, `(d, n)`, so a row of
//! scores is a sum of contiguous axpys the compiler vectorizes.

use crate::api::inputs::BackwardInputs;
use crate::api::options::{AttentionOptions, Mask};
use crate::api::output::{BackwardOutput, CallStats};
use crate::api::shape::{lse_index, AttentionShape, Layout};
use crate::api::tensor::{Precision, TensorData};
use crate::error::Result;
use rayon::prelude::*;
use std::ops::Range;

/// Query rows per dQ task.
const BR: usize = 64;
/// Keys per dK/dV task and per key tile.
const BC: usize = 64;

/// The tensors of one backward call, f32, in the standard layouts: `q`, `o`,
/// `d_o` `(batch, seqlen_q, heads_q, d)`, `k`, `v` `(batch, seqlen_k,
/// heads_kv, d)`, `lse` `(batch, heads_q, seqlen_q)` as the forward wrote it.
struct Tensors<'a> {
    pub q: &'a [f32],
    pub k: &'a [f32],
    pub v: &'a [f32],
    pub o: &'a [f32],
    pub d_o: &'a [f32],
    pub lse: &'a [f32],
}

/// Everything a task reads: inputs, `D`, and the problem's constants.
struct Ctx<'a> {
    x: &'a Tensors<'a>,
    /// `D = rowsum(dO ∘ O)`, laid out like `lse`.
    delta: Vec<f32>,
    shape: AttentionShape,
    ql: Layout,
    kl: Layout,
    scale: f32,
    softcap: f32,
    mask: Mask,
    precision: Precision,
}

/// One query row: where it lives in q/dO and its `lse` and `D`.
struct Row {
    at: usize,
    lse: f32,
    delta: f32,
}

/// K and V of one key block of one kv head, transposed to `(d, n)`.
struct KeyTile {
    keys: Range<usize>,
    kt: Vec<f32>,
    vt: Vec<f32>,
}

/// Gradients dq, dk, dv on the CPU, from the forward's `o` and `lse`.
pub fn backward(inputs: &BackwardInputs, opts: &AttentionOptions) -> Result<BackwardOutput> {
    let shape = inputs.shape()?;
    super::check(&shape, opts)?;
    let precision = inputs.q.precision();
    let i = inputs;
    let [q, k, v, o, d_o] = [i.q, i.k, i.v, i.o, i.d_o].map(|t| t.data.to_f32());
    let tensors = Tensors {
        q: &q,
        k: &k,
        v: &v,
        o: &o,
        d_o: &d_o,
        lse: i.lse,
    };
    let [dq, dk, dv] = gradients(&shape, &tensors, opts, precision);
    let grads = [dq, dk, dv].map(|g| TensorData::from_f32(g, precision));
    Ok(BackwardOutput::new(&shape, grads, CallStats::default()))
}

/// Gradients `[dq, dk, dv]` in the standard layouts, rounded to `precision`.
fn gradients(
    shape: &AttentionShape,
    inputs: &Tensors,
    opts: &AttentionOptions,
    precision: Precision,
) -> [Vec<f32>; 3] {
    let ctx = Ctx {
        x: inputs,
        delta: row_deltas(shape, inputs.o, inputs.d_o),
        shape: *shape,
        ql: Layout::q(shape),
        kl: Layout::kv(shape),
        scale: opts.scale_for(shape.head_dim),
        softcap: opts.softcap_value(),
        mask: opts.mask(shape),
        precision,
    };
    let (dk, dv) = ctx.key_pass();
    let dq = ctx.query_pass();
    [dq, dk, dv]
}

/// `D_i = Σ_x dO_ix · O_ix` for every row, in `lse`'s layout.
fn row_deltas(shape: &AttentionShape, o: &[f32], d_o: &[f32]) -> Vec<f32> {
    let (sq, hq) = (shape.seqlen_q, shape.heads_q);
    let ql = Layout::q(shape);
    (0..shape.lse_len())
        .into_par_iter()
        .map(|r| {
            let at = ql.row(r / (hq * sq), r % sq, (r / sq) % hq);
            let (a, b) = (&o[at..][..ql.dim], &d_o[at..][..ql.dim]);
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
    fn row(&self, b: usize, h: usize, i: usize) -> Row {
        let r = lse_index(&self.shape, b, h, i);
        Row {
            at: self.ql.row(b, i, h),
            lse: self.x.lse[r],
            delta: self.delta[r],
        }
    }

    /// The rows that may see some key of `keys`: both ends of the band
    /// `key_range(i)` never decrease with `i`, so they form one range.
    fn rows_seeing(&self, keys: &Range<usize>) -> Range<usize> {
        let sq = self.shape.seqlen_q;
        let first = partition(sq, |i| self.mask.key_range(i).end <= keys.start);
        let end = partition(sq, |i| self.mask.key_range(i).start < keys.end);
        first..end.max(first)
    }

    /// The keys some row of `rows` may see (empty rows see none).
    fn keys_seen(&self, rows: Range<usize>) -> Range<usize> {
        let (mut lo, mut hi) = (usize::MAX, 0);
        for i in rows {
            let r = self.mask.key_range(i);
            if !r.is_empty() {
                lo = lo.min(r.start);
                hi = hi.max(r.end);
            }
        }
        lo.min(hi)..hi
    }

    /// The columns of `tile` row `i` may see, relative to the tile.
    fn cols(&self, i: usize, tile: &KeyTile) -> Range<usize> {
        let r = self.mask.key_range(i);
        let (lo, hi) = (r.start.max(tile.keys.start), r.end.min(tile.keys.end));
        if lo >= hi {
            return 0..0;
        }
        lo - tile.keys.start..hi - tile.keys.start
    }

    fn load_tile(&self, b: usize, hk: usize, keys: Range<usize>) -> KeyTile {
        let (n, d) = (keys.len(), self.kl.dim);
        let mut kt = vec![0f32; d * n];
        let mut vt = vec![0f32; d * n];
        for (c, j) in keys.clone().enumerate() {
            let at = self.kl.row(b, j, hk);
            for x in 0..d {
                kt[x * n + c] = self.x.k[at + x];
                vt[x * n + c] = self.x.v[at + x];
            }
        }
        KeyTile { keys, kt, vt }
    }

    /// For `row` against `tile`'s columns `cols`: P into `p` and dS into
    /// `ds`, both rounded to the storage precision (dS without the scale).
    fn row_grads(
        &self,
        row: &Row,
        tile: &KeyTile,
        cols: Range<usize>,
        p: &mut [f32],
        ds: &mut [f32],
    ) {
        let (n, d) = (tile.keys.len(), self.ql.dim);
        let (q, g) = (&self.x.q[row.at..][..d], &self.x.d_o[row.at..][..d]);
        p[cols.clone()].fill(0.0);
        ds[cols.clone()].fill(0.0);
        for x in 0..d {
            axpy(&mut p[cols.clone()], q[x], &tile.kt[x * n..][cols.clone()]);
            axpy(&mut ds[cols.clone()], g[x], &tile.vt[x * n..][cols.clone()]);
        }
        for c in cols {
            let mut s = p[c] * self.scale;
            let mut dcap = 1.0;
            if self.softcap > 0.0 {
                let t = (s / self.softcap).tanh();
                s = self.softcap * t;
                dcap = 1.0 - t * t;
            }
            let pc = (s - row.lse).exp();
            p[c] = self.precision.round(pc);
            ds[c] = self.precision.round(pc * (ds[c] - row.delta) * dcap);
        }
    }

    /// Pass 1: dK and dV of every key block, scattered into the layouts.
    fn key_pass(&self) -> (Vec<f32>, Vec<f32>) {
        let sh = &self.shape;
        let tasks: Vec<(usize, usize, usize)> = (0..sh.batch)
            .flat_map(|b| {
                (0..sh.heads_kv)
                    .flat_map(move |hk| (0..sh.seqlen_k.div_ceil(BC)).map(move |kb| (b, hk, kb)))
            })
            .collect();
        let tiles: Vec<(Vec<f32>, Vec<f32>)> = tasks
            .par_iter()
            .map(|&(b, hk, kb)| self.key_block(b, hk, kb * BC..((kb + 1) * BC).min(sh.seqlen_k)))
            .collect();
        let (mut dk, mut dv) = (vec![0f32; sh.kv_len()], vec![0f32; sh.kv_len()]);
        let d = sh.head_dim;
        for (&(b, hk, kb), (tk, tv)) in tasks.iter().zip(&tiles) {
            for (c, j) in (kb * BC..((kb + 1) * BC).min(sh.seqlen_k)).enumerate() {
                let at = self.kl.row(b, j, hk);
                dk[at..][..d].copy_from_slice(&tk[c * d..][..d]);
                dv[at..][..d].copy_from_slice(&tv[c * d..][..d]);
            }
        }
        (dk, dv)
    }

    /// dK and dV `(n, d)` of the keys `keys` of kv head `hk`, summed over
    /// the group's query heads, scaled and rounded.
    fn key_block(&self, b: usize, hk: usize, keys: Range<usize>) -> (Vec<f32>, Vec<f32>) {
        let d = self.kl.dim;
        let rows = self.rows_seeing(&keys);
        let tile = self.load_tile(b, hk, keys);
        let n = tile.keys.len();
        let (mut dk, mut dv) = (vec![0f32; n * d], vec![0f32; n * d]);
        let (mut p, mut ds) = ([0f32; BC], [0f32; BC]);
        let g = self.shape.group();
        for h in hk * g..(hk + 1) * g {
            for i in rows.clone() {
                let row = self.row(b, h, i);
                let cols = self.cols(i, &tile);
                if cols.is_empty() || row.lse == f32::NEG_INFINITY {
                    continue;
                }
                self.row_grads(&row, &tile, cols.clone(), &mut p, &mut ds);
                let (q, gr) = (&self.x.q[row.at..][..d], &self.x.d_o[row.at..][..d]);
                for c in cols {
                    axpy(&mut dk[c * d..][..d], ds[c], q);
                    axpy(&mut dv[c * d..][..d], p[c], gr);
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
        let tasks: Vec<(usize, usize, usize)> = (0..sh.batch)
            .flat_map(|b| {
                (0..sh.heads_q)
                    .flat_map(move |h| (0..sh.seqlen_q.div_ceil(BR)).map(move |qb| (b, h, qb)))
            })
            .collect();
        let tiles: Vec<Vec<f32>> = tasks
            .par_iter()
            .map(|&(b, h, qb)| self.query_block(b, h, qb * BR..((qb + 1) * BR).min(sh.seqlen_q)))
            .collect();
        let mut dq = vec![0f32; sh.q_len()];
        let d = sh.head_dim;
        for (&(b, h, qb), tq) in tasks.iter().zip(&tiles) {
            for (r, i) in (qb * BR..((qb + 1) * BR).min(sh.seqlen_q)).enumerate() {
                dq[self.ql.row(b, i, h)..][..d].copy_from_slice(&tq[r * d..][..d]);
            }
        }
        dq
    }

    /// dQ `(rows, d)` of the rows `rows` of query head `h`, over the key
    /// blocks they can see, scaled and rounded.
    fn query_block(&self, b: usize, h: usize, rows: Range<usize>) -> Vec<f32> {
        let d = self.ql.dim;
        let hk = h / self.shape.group();
        let mut dq = vec![0f32; rows.len() * d];
        let (mut p, mut ds) = ([0f32; BC], [0f32; BC]);
        let seen = self.keys_seen(rows.clone());
        let mut k0 = seen.start / BC * BC;
        while k0 < seen.end {
            let tile = self.load_tile(b, hk, k0..(k0 + BC).min(self.shape.seqlen_k));
            for (r, i) in rows.clone().enumerate() {
                let row = self.row(b, h, i);
                let cols = self.cols(i, &tile);
                if cols.is_empty() || row.lse == f32::NEG_INFINITY {
                    continue;
                }
                self.row_grads(&row, &tile, cols.clone(), &mut p, &mut ds);
                let out = &mut dq[r * d..][..d];
                for c in cols {
                    let j = tile.keys.start + c;
                    axpy(out, ds[c], &self.x.k[self.kl.row(b, j, hk)..][..d]);
                }
            }
            k0 += BC;
        }
        let prec = self.precision;
        dq.iter_mut().for_each(|x| *x = prec.round(*x * self.scale));
        dq
    }
}

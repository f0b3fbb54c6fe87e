//! The CPU backward: FlashAttention-2's, on the micro-kernel, written
//! independently of the reference and of the accuracy rule's baseline.
//!
//! It takes the forward's `lse` as given (`P = exp(s − lse)`, no softmax is
//! recomputed) and `D = rowsum(dO ∘ O)`. Two passes, no atomics: pass 1 runs
//! one task per (batch, kv head, key block) and accumulates that block's
//! `dV += Pᵀ·dO` and `dK += dSᵀ·Q` over the group's query heads and the
//! query blocks that can see it; pass 2 runs one task per (batch, query
//! head, query block) and accumulates `dQ += dS·K` over the key blocks its
//! rows can see. Both recompute S, P, dP and dS per tile with the same
//! code ([`tile_grads`]), and every task sums in a fixed order, so repeated
//! runs are bit-identical.

use super::attend::Geometry;
use super::forward::{key_block, BR};
use super::isa::{Isa, Task};
use super::micro::{gemm, Dims, Kernel, Mat};
use super::pack::{self, Panels};
use super::scores::{rows_seeing, ScoreRow, ScoreRule, Visibility};
use super::vmath;
use crate::api::inputs::BackwardInputs;
use crate::api::options::{AttentionOptions, Mask};
use crate::api::output::{BackwardOutput, CallStats};
use crate::api::shape::{lse_index, AttentionShape, Layout};
use crate::api::tensor::{Precision, TensorData};
use crate::error::Result;
use rayon::prelude::*;
use std::ops::Range;

/// Everything the tasks read, laid out for the products.
struct Ctx<'a> {
    shape: AttentionShape,
    g: Geometry,
    /// q and dO per query head, rows of `dpad` floats.
    q: Panels,
    d_o: Panels,
    /// Kᵀ and Vᵀ in `(d, bc)` blocks, and K in rows of `dpad`, per kv head.
    kt: Panels,
    vt: Panels,
    k: Panels,
    lse: &'a [f32],
    /// `D = rowsum(dO ∘ O)`, laid out like `lse`.
    delta: Vec<f32>,
    rule: ScoreRule,
    mask: Mask,
    precision: Precision,
}

/// Gradients dq, dk, dv on `isa`'s kernels, from the forward's `o` and `lse`.
pub(crate) fn backward(
    isa: Isa,
    inputs: &BackwardInputs,
    opts: &AttentionOptions,
) -> Result<BackwardOutput> {
    let shape = inputs.shape()?;
    opts.validate()?;
    let i = inputs;
    let [q, k, v, o, d_o] = [i.q, i.k, i.v, i.o, i.d_o].map(|t| t.data.to_f32());
    let d = shape.head_dim;
    let bc = key_block(d);
    let (ql, kl, b) = (Layout::q(&shape), Layout::kv(&shape), shape.batch);
    let ctx = Ctx {
        shape,
        g: Geometry {
            d,
            dpad: pack::padded(d),
            bc,
        },
        q: pack::rows(&q, &ql, b, shape.seqlen_q),
        d_o: pack::rows(&d_o, &ql, b, shape.seqlen_q),
        kt: pack::transposed(&k, &kl, b, bc),
        vt: pack::transposed(&v, &kl, b, bc),
        k: pack::rows(&k, &kl, b, shape.seqlen_k.div_ceil(bc) * bc),
        lse: i.lse,
        delta: row_deltas(&shape, &o, &d_o),
        rule: ScoreRule::new(opts, d),
        mask: opts.mask(&shape),
        precision: inputs.q.precision(),
    };
    let (dk, dv) = ctx.key_pass(isa);
    let dq = ctx.query_pass(isa);
    let grads = [dq, dk, dv].map(|g| TensorData::from_f32(g, ctx.precision));
    Ok(BackwardOutput::new(&shape, grads, CallStats::default()))
}

/// `D_i = Σ_x dO_ix · O_ix` for every row, in `lse`'s layout.
fn row_deltas(shape: &AttentionShape, o: &[f32], d_o: &[f32]) -> Vec<f32> {
    let (sq, hq) = (shape.seqlen_q, shape.heads_q);
    let ql = Layout::q(shape);
    (0..shape.lse_len())
        .into_par_iter()
        .map(|r| {
            let at = ql.row(r / (hq * sq), r % sq, (r / sq) % hq);
            vmath::dot(&o[at..][..ql.dim], &d_o[at..][..ql.dim])
        })
        .collect()
}

/// One tile's P and dS `(rows, bc)`, both rounded to the storage precision
/// (dS without the scale).
struct Tile {
    p: Vec<f32>,
    ds: Vec<f32>,
}

/// A block of query rows of one head against one block of keys.
struct TileAt<'r> {
    b: usize,
    h: usize,
    rows: &'r [ScoreRow],
    kb: usize,
    vis: Visibility,
}

impl Ctx<'_> {
    /// The rows `rows` as the scores see them.
    fn score_rows(&self, rows: Range<usize>) -> Vec<ScoreRow> {
        rows.map(|i| ScoreRow {
            i,
            keys: self.mask.key_range(i),
        })
        .collect()
    }

    /// S, P, dP and dS of one tile: `S = Q·Kᵀ`, `dP = dO·Vᵀ` on the
    /// micro-kernel, then `P = exp(S − lse)`, `dS = P ∘ (dP − D) ∘ ∂cap`.
    #[inline(always)]
    fn tile_grads<K: Kernel>(&self, at: &TileAt, t: &mut Tile) {
        let g = &self.g;
        let (n, i0) = (at.rows.len(), at.rows[0].i);
        let hk = at.h / self.shape.group();
        let (qa, ka) = (i0 * g.dpad, at.kb * g.d * g.bc);
        let dims = Dims {
            m: n,
            n: g.bc,
            k: g.d,
        };
        let (q, kt) = (
            self.q.mat(at.b, at.h, qa, g.dpad),
            self.kt.mat(at.b, hk, ka, g.bc),
        );
        gemm::<K>(dims, q, kt, &mut t.p, g.bc, false);
        let (d_o, vt) = (
            self.d_o.mat(at.b, at.h, qa, g.dpad),
            self.vt.mat(at.b, hk, ka, g.bc),
        );
        gemm::<K>(dims, d_o, vt, &mut t.ds, g.bc, false);
        let keys = at.kb * g.bc..(at.kb + 1) * g.bc;
        for (r, row) in at.rows.iter().enumerate() {
            let at_lse = lse_index(&self.shape, at.b, at.h, row.i);
            let (lse, delta) = (self.lse[at_lse], self.delta[at_lse]);
            let p = &mut t.p[r * g.bc..][..g.bc];
            let ds = &mut t.ds[r * g.bc..][..g.bc];
            if lse == f32::NEG_INFINITY {
                p.fill(0.0);
                ds.fill(0.0);
                continue;
            }
            self.rule.apply::<K>(row, &keys, at.vis, p);
            for (s, dp) in p.iter_mut().zip(ds.iter_mut()) {
                let pc = vmath::exp::<K>(*s - lse);
                // Masked scores are −inf, where the softcap's slope is not finite.
                let dcap = if pc > 0.0 { self.rule.dcap(*s) } else { 0.0 };
                *dp = pc * (*dp - delta) * dcap;
                *s = pc;
            }
            vmath::round_to(self.precision, p);
            vmath::round_to(self.precision, ds);
        }
    }

    /// Pass 1: dK and dV of every key block, scattered into the layouts.
    fn key_pass(&self, isa: Isa) -> (Vec<f32>, Vec<f32>) {
        let s = &self.shape;
        let blocks = s.seqlen_k.div_ceil(self.g.bc);
        let tiles: Vec<[Vec<f32>; 2]> = (0..s.batch * s.heads_kv * blocks)
            .into_par_iter()
            .map(|t| isa.run(KeyTask { ctx: self, task: t }))
            .collect();
        let (mut dk, mut dv) = (vec![0f32; s.kv_len()], vec![0f32; s.kv_len()]);
        let (kl, d, dp) = (Layout::kv(s), s.head_dim, self.g.dpad);
        for (t, [tk, tv]) in tiles.iter().enumerate() {
            let (bh, kb) = (t / blocks, t % blocks);
            let (b, hk) = (bh / s.heads_kv, bh % s.heads_kv);
            for (c, j) in (kb * self.g.bc..((kb + 1) * self.g.bc).min(s.seqlen_k)).enumerate() {
                let at = kl.row(b, j, hk);
                dk[at..][..d].copy_from_slice(&tk[c * dp..][..d]);
                dv[at..][..d].copy_from_slice(&tv[c * dp..][..d]);
            }
        }
        (dk, dv)
    }

    /// Pass 2: dQ of every query block, scattered into q's layout.
    fn query_pass(&self, isa: Isa) -> Vec<f32> {
        let s = &self.shape;
        let blocks = s.seqlen_q.div_ceil(BR);
        let tiles: Vec<Vec<f32>> = (0..s.batch * s.heads_q * blocks)
            .into_par_iter()
            .map(|t| isa.run(QueryTask { ctx: self, task: t }))
            .collect();
        let mut dq = vec![0f32; s.q_len()];
        let (ql, d, dp) = (Layout::q(s), s.head_dim, self.g.dpad);
        for (t, tq) in tiles.iter().enumerate() {
            let (bh, qb) = (t / blocks, t % blocks);
            let (b, h) = (bh / s.heads_q, bh % s.heads_q);
            for (r, i) in (qb * BR..((qb + 1) * BR).min(s.seqlen_q)).enumerate() {
                dq[ql.row(b, i, h)..][..d].copy_from_slice(&tq[r * dp..][..d]);
            }
        }
        dq
    }
}

/// dK and dV `(bc, dpad)` of one key block of one kv head.
struct KeyTask<'a, 'c> {
    ctx: &'c Ctx<'a>,
    task: usize,
}

impl Task for KeyTask<'_, '_> {
    type Output = [Vec<f32>; 2];
    #[inline(always)]
    fn run<K: Kernel>(self) -> [Vec<f32>; 2] {
        let c = self.ctx;
        let (s, g) = (&c.shape, &c.g);
        let blocks = s.seqlen_k.div_ceil(g.bc);
        let (bh, kb) = (self.task / blocks, self.task % blocks);
        let (b, hk) = (bh / s.heads_kv, bh % s.heads_kv);
        let keys = kb * g.bc..((kb + 1) * g.bc).min(s.seqlen_k);
        let seeing = rows_seeing(&c.mask, s.seqlen_q, &keys);
        let (mut dk, mut dv) = (vec![0f32; g.bc * g.dpad], vec![0f32; g.bc * g.dpad]);
        let mut t = Tile {
            p: vec![0f32; BR * g.bc],
            ds: vec![0f32; BR * g.bc],
        };
        let first = seeing.start / BR * BR;
        for h in hk * s.group()..(hk + 1) * s.group() {
            for i0 in (first..seeing.end).step_by(BR) {
                let rows = c.score_rows(i0..(i0 + BR).min(s.seqlen_q));
                let vis = ScoreRule::visibility(&rows, &(kb * g.bc..(kb + 1) * g.bc));
                if vis == Visibility::Skip {
                    continue;
                }
                let at = TileAt {
                    b,
                    h,
                    rows: &rows,
                    kb,
                    vis,
                };
                c.tile_grads::<K>(&at, &mut t);
                let n = rows.len();
                let dims = Dims {
                    m: g.bc,
                    n: g.dpad,
                    k: n,
                };
                let (d_o, q) = (
                    c.d_o.mat(b, h, i0 * g.dpad, g.dpad),
                    c.q.mat(b, h, i0 * g.dpad, g.dpad),
                );
                gemm::<K>(
                    dims,
                    Mat::transposed(&t.p, g.bc),
                    d_o,
                    &mut dv,
                    g.dpad,
                    true,
                );
                gemm::<K>(dims, Mat::transposed(&t.ds, g.bc), q, &mut dk, g.dpad, true);
            }
        }
        let prec = c.precision;
        dk.iter_mut()
            .for_each(|x| *x = prec.round(*x * c.rule.scale));
        vmath::round_to(prec, &mut dv);
        [dk, dv]
    }
}

/// dQ `(rows, dpad)` of one query block of one query head.
struct QueryTask<'a, 'c> {
    ctx: &'c Ctx<'a>,
    task: usize,
}

impl Task for QueryTask<'_, '_> {
    type Output = Vec<f32>;
    #[inline(always)]
    fn run<K: Kernel>(self) -> Vec<f32> {
        let c = self.ctx;
        let (s, g) = (&c.shape, &c.g);
        let blocks = s.seqlen_q.div_ceil(BR);
        let (bh, qb) = (self.task / blocks, self.task % blocks);
        let (b, h) = (bh / s.heads_q, bh % s.heads_q);
        let rows = c.score_rows(qb * BR..((qb + 1) * BR).min(s.seqlen_q));
        let n = rows.len();
        let mut dq = vec![0f32; n * g.dpad];
        let mut t = Tile {
            p: vec![0f32; n * g.bc],
            ds: vec![0f32; n * g.bc],
        };
        let span = ScoreRule::span(&rows);
        let hk = h / s.group();
        for kb in span.start / g.bc..span.end.div_ceil(g.bc) {
            let vis = ScoreRule::visibility(&rows, &(kb * g.bc..(kb + 1) * g.bc));
            if vis == Visibility::Skip {
                continue;
            }
            c.tile_grads::<K>(
                &TileAt {
                    b,
                    h,
                    rows: &rows,
                    kb,
                    vis,
                },
                &mut t,
            );
            let k = c.k.mat(b, hk, kb * g.bc * g.dpad, g.dpad);
            let dims = Dims {
                m: n,
                n: g.dpad,
                k: g.bc,
            };
            gemm::<K>(dims, Mat::rows(&t.ds, g.bc), k, &mut dq, g.dpad, true);
        }
        let prec = c.precision;
        dq.iter_mut()
            .for_each(|x| *x = prec.round(*x * c.rule.scale));
        dq
    }
}

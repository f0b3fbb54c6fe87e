//! The CPU backward: FlashAttention-2's, on the micro-kernel, written
//! independently of the reference and of the accuracy rule's baseline.
//!
//! It takes the forward's `lse` as given (`P = exp(s − lse)`, no softmax is
//! recomputed) and `D = rowsum(dO ∘ O)`. One fused pass, no atomics: a task
//! per (batch, kv head, strip of key blocks) walks its key blocks and, for
//! each, the group's query heads and the query blocks that can see it; per
//! tile it computes `S = Q·Kᵀ` and `dP = dO·Vᵀ`, then P and dS
//! ([`Ctx::tile_grads`]), and runs the three products that use them:
//! `dV += Pᵀ·dO` and `dK += dSᵀ·Q` into the block's own sums, `dQ += dS·K`
//! into the task's own dQ sums for the group's rows — five products per
//! tile, where a dK/dV pass and a separate dQ pass need seven. The strips'
//! dQ sums are then added in strip order. A strip takes every `strips`-th
//! key block (so under a causal mask the strips get equal work), and
//! `strips` is the fewest that gives every thread a few tasks. Every sum
//! runs in a fixed order, so repeated runs are bit-identical.

use super::attend::Geometry;
use super::forward::Blocks;
use super::isa::{Isa, Task};
use super::micro::{gemm, Dims, Kernel, Mat};
use super::pack::{self, Panels};
use super::pool::Buffer;
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
    /// Query rows per tile.
    br: usize,
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
    /// Key-block strips per (batch, kv head): one task each.
    strips: usize,
}

/// Gradients dq, dk, dv on `isa`'s kernels, from the forward's `o` and `lse`.
pub(crate) fn backward(
    isa: Isa,
    inputs: &BackwardInputs,
    opts: &AttentionOptions,
) -> Result<BackwardOutput> {
    let shape = inputs.shape()?;
    opts.validate()?;
    super::check_layouts(&shape, opts)?;
    let i = inputs;
    let [q, k, v, o, d_o] = [&i.q, &i.k, &i.v, &i.o, &i.d_o].map(pack::widened);
    let d = shape.head_dim;
    let Blocks { rows: br, keys: bc } = Blocks::backward(d);
    let (ql, kl, b) = (Layout::q(&shape), Layout::kv(&shape), shape.batch);
    let ctx = Ctx {
        shape,
        g: Geometry {
            d,
            dpad: pack::padded(d),
            bc,
        },
        br,
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
        strips: strips(&shape, bc),
    };
    let parts: Vec<KeyOut> = (0..b * shape.heads_kv * ctx.strips)
        .into_par_iter()
        .map(|t| isa.run(KeyTask { ctx: &ctx, task: t }))
        .collect();
    let (dk, dv) = ctx.scatter_kv(&parts);
    let dq = ctx.reduce_dq(&parts);
    let grads = [dq, dk, dv].map(|g| TensorData::from_f32(g, ctx.precision));
    Ok(BackwardOutput::new(&shape, grads, CallStats::default()))
}

/// Strips per (batch, kv head): enough for four tasks per thread, at most
/// one per key block.
fn strips(shape: &AttentionShape, bc: usize) -> usize {
    let per_head = (4 * rayon::current_num_threads()).div_ceil(shape.batch * shape.heads_kv);
    per_head.clamp(1, shape.seqlen_k.div_ceil(bc).max(1))
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

    /// Key block `kb` of kv head `hk` of batch entry `b` against every
    /// query block of the group that sees it: its `dK` and `dV` sums into
    /// `kv`, the group's `dQ` sums (`(group, seqlen_q, dpad)`) into `dq`.
    #[inline(always)]
    fn key_block<K: Kernel>(
        &self,
        (b, hk, kb): (usize, usize, usize),
        t: &mut Tile,
        kv: [&mut [f32]; 2],
        dq: &mut [f32],
    ) {
        let (s, g) = (&self.shape, &self.g);
        let [dk, dv] = kv;
        let block = kb * g.bc..(kb + 1) * g.bc;
        let seeing = rows_seeing(
            &self.mask,
            s.seqlen_q,
            &(kb * g.bc..block.end.min(s.seqlen_k)),
        );
        let first = seeing.start / self.br * self.br;
        for (hl, h) in (hk * s.group()..(hk + 1) * s.group()).enumerate() {
            for i0 in (first..seeing.end).step_by(self.br) {
                let rows = self.score_rows(i0..(i0 + self.br).min(s.seqlen_q));
                let vis = ScoreRule::visibility(&rows, &block);
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
                self.tile_grads::<K>(&at, t);
                let n = rows.len();
                let kv_dims = Dims {
                    m: g.bc,
                    n: g.dpad,
                    k: n,
                };
                let (d_o, q) = (
                    self.d_o.mat(b, h, i0 * g.dpad, g.dpad),
                    self.q.mat(b, h, i0 * g.dpad, g.dpad),
                );
                gemm::<K>(kv_dims, Mat::transposed(&t.p, g.bc), d_o, dv, g.dpad, true);
                gemm::<K>(kv_dims, Mat::transposed(&t.ds, g.bc), q, dk, g.dpad, true);
                let q_dims = Dims {
                    m: n,
                    n: g.dpad,
                    k: g.bc,
                };
                let k = self.k.mat(b, hk, kb * g.bc * g.dpad, g.dpad);
                let dq = &mut dq[(hl * s.seqlen_q + i0) * g.dpad..];
                gemm::<K>(q_dims, Mat::rows(&t.ds, g.bc), k, dq, g.dpad, true);
            }
        }
        let prec = self.precision;
        dk.iter_mut()
            .for_each(|x| *x = prec.round(*x * self.rule.scale));
        vmath::round_to(prec, dv);
    }

    /// Every task's dK and dV rows, in k's and v's layouts.
    fn scatter_kv(&self, parts: &[KeyOut]) -> (Vec<f32>, Vec<f32>) {
        let s = &self.shape;
        let (d, dp, bc) = (s.head_dim, self.g.dpad, self.g.bc);
        let (mut dk, mut dv) = (vec![0f32; s.kv_len()], vec![0f32; s.kv_len()]);
        let row = s.heads_kv * d;
        dk.par_chunks_mut(row.max(1))
            .zip(dv.par_chunks_mut(row.max(1)))
            .enumerate()
            .for_each(|(r, (dk, dv))| {
                let (b, j) = (r / s.seqlen_k, r % s.seqlen_k);
                let (kb, c) = (j / bc, j % bc);
                for hk in 0..s.heads_kv {
                    let part = &parts[(b * s.heads_kv + hk) * self.strips + kb % self.strips];
                    let at = ((kb / self.strips) * bc + c) * dp;
                    dk[hk * d..][..d].copy_from_slice(&part.dk[at..][..d]);
                    dv[hk * d..][..d].copy_from_slice(&part.dv[at..][..d]);
                }
            });
        (dk, dv)
    }

    /// dQ: every row's sums over the strips, in strip order, scaled and
    /// rounded, in q's layout.
    fn reduce_dq(&self, parts: &[KeyOut]) -> Vec<f32> {
        let s = &self.shape;
        let (d, dp, sq) = (s.head_dim, self.g.dpad, s.seqlen_q);
        let mut dq = vec![0f32; s.q_len()];
        let prec = self.precision;
        dq.par_chunks_mut((s.heads_q * d).max(1))
            .enumerate()
            .for_each(|(r, out)| {
                let (b, i) = (r / sq, r % sq);
                for (h, out) in out.chunks_exact_mut(d.max(1)).enumerate() {
                    let (hk, hl) = (h / s.group(), h % s.group());
                    let strips = &parts[(b * s.heads_kv + hk) * self.strips..][..self.strips];
                    let at = (hl * sq + i) * dp;
                    out.fill(0.0);
                    for part in strips {
                        out.iter_mut()
                            .zip(&part.dq[at..][..d])
                            .for_each(|(y, x)| *y += x);
                    }
                    out.iter_mut()
                        .for_each(|x| *x = prec.round(*x * self.rule.scale));
                }
            });
        dq
    }
}

/// One task's results: dK and dV `(bc, dpad)` of each of its key blocks in
/// the order it ran them, scaled and rounded, and its dQ sums over them for
/// the group's query heads `(group, seqlen_q, dpad)`, not yet scaled.
struct KeyOut {
    dk: Buffer,
    dv: Buffer,
    dq: Buffer,
}

/// Strip `task % strips` of kv head `task / strips` (over batch entries):
/// key blocks `strip, strip + strips, ...`.
struct KeyTask<'a, 'c> {
    ctx: &'c Ctx<'a>,
    task: usize,
}

impl Task for KeyTask<'_, '_> {
    type Output = KeyOut;
    #[inline(always)]
    fn run<K: Kernel>(self) -> KeyOut {
        let c = self.ctx;
        let (s, g) = (&c.shape, &c.g);
        let (bh, strip) = (self.task / c.strips, self.task % c.strips);
        let (b, hk) = (bh / s.heads_kv, bh % s.heads_kv);
        let blocks: Vec<usize> = (strip..s.seqlen_k.div_ceil(g.bc))
            .step_by(c.strips)
            .collect();
        let size = g.bc * g.dpad;
        let mut out = KeyOut {
            dk: Buffer::zeroed(blocks.len() * size),
            dv: Buffer::zeroed(blocks.len() * size),
            dq: Buffer::zeroed(s.group() * s.seqlen_q * g.dpad),
        };
        let mut t = Tile {
            p: vec![0f32; c.br * g.bc],
            ds: vec![0f32; c.br * g.bc],
        };
        let kv = out
            .dk
            .chunks_exact_mut(size)
            .zip(out.dv.chunks_exact_mut(size));
        for (&kb, (dk, dv)) in blocks.iter().zip(kv) {
            c.key_block::<K>((b, hk, kb), &mut t, [dk, dv], &mut out.dq);
        }
        out
    }
}

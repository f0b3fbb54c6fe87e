//! The CPU backward: FlashAttention-2's, on the micro-kernel, written
//! independently of the reference and of the accuracy rule's baseline.
//!
//! It takes the forward's `lse` as given (`P = exp(s − lse)`, no softmax is
//! recomputed) and `D = rowsum(dO ∘ O)`. One fused pass, no atomics: a task
//! per (sequence, kv head, strip of key blocks) walks its key blocks and, for
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
use crate::api::options::AttentionOptions;
use crate::api::output::{BackwardOutput, CallStats};
use crate::api::pair_rule::PairRule;
use crate::api::problem::Problem;
use crate::api::shape::{AttentionShape, Layout};
use crate::api::tensor::{Precision, TensorData};
use crate::api::varlen::{sequences, Sequence};
use crate::error::Result;
use rayon::prelude::*;
use std::ops::Range;

/// Everything the tasks read, laid out for the products.
struct Ctx<'a> {
    shape: AttentionShape,
    opts: &'a AttentionOptions,
    seqs: Vec<Sequence>,
    g: Geometry,
    /// Query rows per tile.
    br: usize,
    /// q and dO per (sequence, query head), rows of `dpad` and `dvpad` floats.
    q: Panels,
    d_o: Panels,
    /// Kᵀ `(d, bc)` and Vᵀ `(dv, bc)` blocks, and K in rows of `dpad`, per
    /// (sequence, kv head).
    kt: Panels,
    vt: Panels,
    k: Panels,
    lse: &'a [f32],
    /// `D = rowsum(dO ∘ O)`, laid out like `lse`.
    delta: Vec<f32>,
    scale: f32,
    precision: Precision,
    /// Key-block strips per (sequence, kv head): one task each.
    strips: usize,
}

/// Gradients dq, dk, dv (and dsinks) on `isa`'s kernels, from the
/// forward's `o` and `lse`.
pub(crate) fn backward(
    isa: Isa,
    inputs: &BackwardInputs,
    opts: &AttentionOptions,
) -> Result<BackwardOutput> {
    let problem = Problem::backward(inputs, opts)?;
    let shape = problem.shape;
    let i = inputs;
    let [q, k, v, o, d_o] = [&i.q, &i.k, &i.v, &i.o, &i.d_o].map(pack::widened);
    let dims = [shape.head_dim, shape.head_dim_v];
    let Blocks { rows: br, keys: bc } = Blocks::backward(dims);
    let seqs = sequences(&shape, opts.varlen.as_ref());
    let q_rows: Vec<Range<usize>> = seqs.iter().map(|s| s.q.clone()).collect();
    let k_rows: Vec<Range<usize>> = seqs.iter().map(|s| s.k.clone()).collect();
    let (ql, ol, kl, vl) = (
        Layout::q(&shape),
        Layout::o(&shape),
        Layout::kv(&shape),
        Layout::v(&shape),
    );
    let whole = |n: usize| n;
    let g = Geometry::new(dims, bc);
    let ctx = Ctx {
        shape,
        opts,
        g,
        br,
        q: pack::rows(&q, &ql, &q_rows, whole, g.dpad),
        d_o: pack::rows(&d_o, &ol, &q_rows, whole, g.dvpad),
        kt: pack::transposed(&k, &kl, &k_rows, bc, bc),
        vt: pack::transposed(&v, &vl, &k_rows, bc, bc),
        k: pack::rows(&k, &kl, &k_rows, |n| n.div_ceil(bc) * bc, g.dpad),
        lse: i.lse,
        delta: row_deltas(&shape, &sink_output(isa, &q, &k, &v, &o, &problem), &d_o),
        scale: problem.scale,
        precision: inputs.q.precision(),
        strips: strips(&shape, &seqs, bc),
        seqs,
    };
    let tasks = ctx.seqs.len() * shape.heads_kv * ctx.strips;
    let parts: Vec<KeyOut> = (0..tasks)
        .into_par_iter()
        .map(|t| isa.run(KeyTask { ctx: &ctx, task: t }))
        .collect();
    let (dk, dv) = ctx.scatter_kv(&parts);
    let dq = ctx.reduce_dq(&parts);
    let grads = [dq, dk, dv].map(|g| TensorData::from_f32(g, ctx.precision));
    let [dq, dk, dv] = grads;
    let out =
        BackwardOutput::new(&shape, dq, dk, dv, CallStats::default()).with_dsinks(ctx.dsinks());
    Ok(out.packed(opts.varlen.is_some()))
}

/// Strips per (sequence, kv head): enough for four tasks per thread, at
/// most one per key block of the longest sequence.
fn strips(shape: &AttentionShape, seqs: &[Sequence], bc: usize) -> usize {
    let heads = (seqs.len() * shape.heads_kv).max(1);
    let per_head = (4 * rayon::current_num_threads()).div_ceil(heads);
    let longest = seqs.iter().map(Sequence::len_k).max().unwrap_or(0);
    per_head.clamp(1, longest.div_ceil(bc).max(1))
}

/// The `O` whose `D` the gradients take: the stored `o`, except in low
/// precision with sinks, where it is recomputed in f32 with P unrounded (one
/// forward more) so that `D` is `Σ_j P·dP` to f32 accuracy. `dsink_h` is a
/// single sum of `P_sink · D` over every row of a head, and from an `o`
/// rounded to f16 every `D` carries that rounding, as a materialized
/// baseline's does: a small case's few dsinks then land anywhere within a
/// few times the baseline's error (seen up to 4×). Recomputed, they sit at
/// f32 rounding (1e-7 where the f16 baseline errs by 1e-4).
fn sink_output<'o>(
    isa: Isa,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &'o [f32],
    problem: &Problem,
) -> std::borrow::Cow<'o, [f32]> {
    match (&problem.opts.sinks, vmath::rounding_of(problem.precision)) {
        (Some(_), vmath::Rounding::F16 | vmath::Rounding::Bf16) => {
            let (o32, _) =
                super::forward::forward_f32(isa, problem, q, k, v, vmath::Rounding::Exact);
            std::borrow::Cow::Owned(o32)
        }
        _ => std::borrow::Cow::Borrowed(o),
    }
}

/// docs/semantics.md's sink gradient: `dsink_h = −Σ exp(sink_h − lse) · D`
/// over every row of head `h`, in row order, in f64 (deterministic), from
/// `lse` and D (the GPU backends', which compute D on the device).
pub(crate) fn sink_gradients(
    sinks: &[f32],
    seqs: &[Sequence],
    lse: &[f32],
    delta: &[f32],
) -> Vec<f32> {
    let per_head = |(h, &sink): (usize, &f32)| {
        let mut sum = 0f64;
        for seq in seqs {
            for i in 0..seq.len_q() {
                let at = seq.lse_index(h, i);
                sum += (sink as f64 - lse[at] as f64).exp() * delta[at] as f64;
            }
        }
        -sum as f32
    };
    sinks.iter().enumerate().map(per_head).collect()
}

/// `D_i = Σ_x dO_ix · O_ix` for every row, in `lse`'s layout (a packed
/// batch's is its batch of one's).
pub(crate) fn row_deltas(shape: &AttentionShape, o: &[f32], d_o: &[f32]) -> Vec<f32> {
    let (sq, hq) = (shape.seqlen_q, shape.heads_q);
    let ol = Layout::o(shape);
    (0..shape.lse_len())
        .into_par_iter()
        .map(|r| {
            let at = ol.row(r / (hq * sq), r % sq, (r / sq) % hq);
            vmath::dot(&o[at..][..ol.dim], &d_o[at..][..ol.dim])
        })
        .collect()
}

/// One tile's P and dS `(rows, bc)`, both rounded to the storage precision
/// (dS without the scale), and dropout's keep bits of one row.
struct Tile {
    p: Vec<f32>,
    ds: Vec<f32>,
    keep: Vec<bool>,
}

/// One row's P and dS under dropout, from its scores in `p` and `dP = dO·Vᵀ`
/// in `ds`: P ∘ keep (dV's factor; 1/(1 − p) is applied to the dV sums) and
/// `dS = P ∘ (dP ∘ keep/(1 − p) − D) ∘ ∂cap`.
#[inline(always)]
fn dropped_grads<K: Kernel>(
    at: &TileAt,
    row: &ScoreRow,
    (lse, delta): (f32, f32),
    keep: &[bool],
    (p, ds): (&mut [f32], &mut [f32]),
) {
    let rp = at.rule.keep_scale();
    let keys = at.kb * p.len()..;
    let keep = &keep[..p.len()];
    if at.rule.softcap == 0.0 {
        // No softcap: ∂cap is 1 wherever P > 0 (and P = 0 elsewhere), so
        // the loop has no call and no branch and vectorizes.
        for ((s, dp), &kept) in p.iter_mut().zip(ds.iter_mut()).zip(keep) {
            let pc = vmath::exp::<K>(*s - lse);
            let k = f32::from(u8::from(kept));
            *dp = pc * (*dp * (rp * k) - delta);
            *s = pc * k;
        }
        return;
    }
    for (((s, dp), &kept), j) in p.iter_mut().zip(ds.iter_mut()).zip(keep).zip(keys) {
        let pc = vmath::exp::<K>(*s - lse);
        let dcap = if pc > 0.0 {
            at.rule.dcap(*s, row.i, j)
        } else {
            0.0
        };
        // keep as 1.0 or 0.0: no branch on a random bit.
        let k = f32::from(u8::from(kept));
        *dp = pc * (*dp * (rp * k) - delta) * dcap;
        *s = pc * k;
    }
}

/// A block of query rows of one head of sequence `n` against one block of
/// keys, under the head's score rule.
struct TileAt<'r, 'a> {
    n: usize,
    h: usize,
    rows: &'r [ScoreRow],
    kb: usize,
    vis: Visibility,
    rule: &'r ScoreRule<'a>,
}

impl Ctx<'_> {
    /// The rows `rows` of a sequence as the scores see them.
    fn score_rows(pair: &PairRule, rows: Range<usize>) -> Vec<ScoreRow> {
        rows.map(|i| ScoreRow {
            i,
            keys: pair.keys(i),
            slope: None,
        })
        .collect()
    }

    /// S, P, dP and dS of one tile: `S = Q·Kᵀ`, `dP = dO·Vᵀ` on the
    /// micro-kernel, then `P = exp(S − lse)`, `dS = P ∘ (dP − D) ∘ ∂cap`.
    #[inline(always)]
    fn tile_grads<K: Kernel>(&self, at: &TileAt, t: &mut Tile) {
        let g = &self.g;
        let seq = &self.seqs[at.n];
        let (n, i0) = (at.rows.len(), at.rows[0].i);
        let hk = at.h / self.shape.group();
        let ka = at.kb * g.bc;
        let s_dims = Dims {
            m: n,
            n: g.bc,
            k: g.d,
        };
        let (q, kt) = (
            self.q.mat(at.n, at.h, i0 * g.dpad, g.dpad),
            self.kt.mat(at.n, hk, ka * g.d, g.bc),
        );
        gemm::<K, _>(s_dims, q, kt, &mut t.p, g.bc, false);
        let (d_o, vt) = (
            self.d_o.mat(at.n, at.h, i0 * g.dvpad, g.dvpad),
            self.vt.mat(at.n, hk, ka * g.dv, g.bc),
        );
        let dp_dims = Dims { k: g.dv, ..s_dims };
        gemm::<K, _>(dp_dims, d_o, vt, &mut t.ds, g.bc, false);
        let keys = ka..ka + g.bc;
        for (r, row) in at.rows.iter().enumerate() {
            let at_lse = seq.lse_index(at.h, row.i);
            let (lse, delta) = (self.lse[at_lse], self.delta[at_lse]);
            let p = &mut t.p[r * g.bc..][..g.bc];
            let ds = &mut t.ds[r * g.bc..][..g.bc];
            if lse == f32::NEG_INFINITY {
                p.fill(0.0);
                ds.fill(0.0);
                continue;
            }
            at.rule.apply::<K>(row, &keys, at.vis, p);
            if let Some(d) = &at.rule.dropout {
                d.keep_row(row.i, &keys, &mut t.keep);
                dropped_grads::<K>(at, row, (lse, delta), &t.keep, (p, ds));
            } else {
                for (j, (s, dp)) in keys.clone().zip(p.iter_mut().zip(ds.iter_mut())) {
                    let pc = vmath::exp::<K>(*s - lse);
                    // Masked scores are −inf, where the softcap's slope is not finite.
                    let dcap = if pc > 0.0 {
                        at.rule.dcap(*s, row.i, j)
                    } else {
                        0.0
                    };
                    *dp = pc * (*dp - delta) * dcap;
                    *s = pc;
                }
            }
            vmath::round_to(self.precision, p);
            vmath::round_to(self.precision, ds);
        }
    }

    /// Key blocks `blocks` (with their `dK` and `dV` sums) of kv head `hk`
    /// of sequence `n` against every query block of the group that sees
    /// them, the group's `dQ` sums (`(group, len_q, dpad)`) into `dq`. The
    /// key blocks take turns on each query block, so that its Q, dO and dQ
    /// rows are read once for all of them: one key block at a time streams
    /// the whole of them per block, from past the L2 at long sequences
    /// (3 MiB at N 4096, d 64). Each sum still adds its terms in the order
    /// of one block at a time (dQ's by key block, dK's and dV's by head,
    /// then query block), so the gradients are bit-identical.
    #[inline(always)]
    fn key_blocks<K: Kernel>(
        &self,
        (n, hk): (usize, usize),
        blocks: &mut [KeyBlockSums],
        t: &mut Tile,
        dq: &mut [f32],
    ) {
        let (s, g, seq) = (&self.shape, &self.g, &self.seqs[n]);
        let keys = |kb: usize| kb * g.bc..(kb + 1) * g.bc;
        for (hl, h) in (hk * s.group()..(hk + 1) * s.group()).enumerate() {
            let pair = PairRule::new(self.opts, seq, h, [s.heads_q, s.head_dim]);
            let rule = ScoreRule::of_pair(&pair);
            // Each block's query blocks: from the one holding its first
            // row that sees it to its last such row.
            let reach: Vec<Range<usize>> = blocks
                .iter()
                .map(|b| {
                    let block = keys(b.kb);
                    let end = block.end.min(seq.len_k());
                    let seeing = rows_seeing(&pair.band, seq.len_q(), &(block.start..end));
                    seeing.start / self.br * self.br..seeing.end
                })
                .collect();
            let first = reach.iter().map(|r| r.start).min().unwrap_or(0);
            let last = reach.iter().map(|r| r.end).max().unwrap_or(0);
            for i0 in (first..last).step_by(self.br) {
                let rows = Self::score_rows(&pair, i0..(i0 + self.br).min(seq.len_q()));
                for (b, reach) in blocks.iter_mut().zip(&reach) {
                    if reach.contains(&i0) {
                        self.tile::<K>((n, hk, h, hl, i0), &rows, &rule, b, t, dq);
                    }
                }
            }
        }
        for b in blocks {
            self.finish_block(b);
        }
    }

    /// One tile: query block `i0` (its `rows`) of head `h` (the `hl`-th of
    /// kv head `hk`'s group) against key block `b.kb`, unless no pair of it
    /// is allowed.
    #[inline(always)]
    fn tile<K: Kernel>(
        &self,
        (n, hk, h, hl, i0): (usize, usize, usize, usize, usize),
        rows: &[ScoreRow],
        rule: &ScoreRule,
        b: &mut KeyBlockSums,
        t: &mut Tile,
        dq: &mut [f32],
    ) {
        let (g, len_q) = (&self.g, self.seqs[n].len_q());
        let block = b.kb * g.bc..(b.kb + 1) * g.bc;
        let vis = ScoreRule::visibility(rows, &block);
        let vis = rule.refine(rows, &block, vis);
        if vis == Visibility::Skip {
            return;
        }
        let at = TileAt {
            n,
            h,
            rows,
            kb: b.kb,
            vis,
            rule,
        };
        self.tile_grads::<K>(&at, t);
        let m = rows.len();
        let (d_o, q) = (
            self.d_o.mat(n, h, i0 * g.dvpad, g.dvpad),
            self.q.mat(n, h, i0 * g.dpad, g.dpad),
        );
        let dv_dims = Dims {
            m: g.bc,
            n: g.dvpad,
            k: m,
        };
        gemm::<K, _>(
            dv_dims,
            Mat::transposed(&t.p, g.bc),
            d_o,
            b.dv,
            g.dvpad,
            true,
        );
        let dk_dims = Dims {
            n: g.dpad,
            ..dv_dims
        };
        gemm::<K, _>(dk_dims, Mat::transposed(&t.ds, g.bc), q, b.dk, g.dpad, true);
        let q_dims = Dims {
            m,
            n: g.dpad,
            k: g.bc,
        };
        let k = self.k.mat(n, hk, b.kb * g.bc * g.dpad, g.dpad);
        let dq = &mut dq[(hl * len_q + i0) * g.dpad..];
        gemm::<K, _>(q_dims, Mat::rows(&t.ds, g.bc), k, dq, g.dpad, true);
    }

    /// A key block's dK scaled and both sums rounded to storage (dV times
    /// dropout's `1 / (1 − p)` first).
    fn finish_block(&self, b: &mut KeyBlockSums) {
        let prec = self.precision;
        b.dk.iter_mut()
            .for_each(|x| *x = prec.round(*x * self.scale));
        if self.opts.dropout.is_active() {
            // dV = (P ∘ keep)ᵀ·dO / (1 − p): the scale once, on the sums.
            let rp = self.opts.dropout.scale();
            b.dv.iter_mut().for_each(|x| *x = prec.round(*x * rp));
        } else {
            vmath::round_to(prec, b.dv);
        }
    }

    /// Every task's dK and dV rows, in k's and v's layouts.
    fn scatter_kv(&self, parts: &[KeyOut]) -> (Vec<f32>, Vec<f32>) {
        let s = &self.shape;
        let (d, dv, bc) = (s.head_dim, s.head_dim_v, self.g.bc);
        let (dp, dvp) = (self.g.dpad, self.g.dvpad);
        let (mut dk, mut dvs) = (vec![0f32; s.kv_len()], vec![0f32; s.v_len()]);
        dk.par_chunks_mut((s.heads_kv * d).max(1))
            .zip(dvs.par_chunks_mut((s.heads_kv * dv).max(1)))
            .enumerate()
            .for_each(|(r, (dk, dvs))| {
                let n = self.seqs.partition_point(|x| x.k.end <= r);
                let Some(seq) = self.seqs.get(n) else { return };
                let j = r - seq.k.start;
                let (kb, c) = (j / bc, j % bc);
                for hk in 0..s.heads_kv {
                    let part = &parts[(n * s.heads_kv + hk) * self.strips + kb % self.strips];
                    let at = (kb / self.strips) * bc + c;
                    dk[hk * d..][..d].copy_from_slice(&part.dk[at * dp..][..d]);
                    dvs[hk * dv..][..dv].copy_from_slice(&part.dv[at * dvp..][..dv]);
                }
            });
        (dk, dvs)
    }

    /// dQ: every row's sums over the strips, in strip order, scaled and
    /// rounded, in q's layout.
    fn reduce_dq(&self, parts: &[KeyOut]) -> Vec<f32> {
        let s = &self.shape;
        let (d, dp) = (s.head_dim, self.g.dpad);
        let mut dq = vec![0f32; s.q_len()];
        let prec = self.precision;
        dq.par_chunks_mut((s.heads_q * d).max(1))
            .enumerate()
            .for_each(|(r, out)| {
                let n = self.seqs.partition_point(|x| x.q.end <= r);
                let Some(seq) = self.seqs.get(n) else { return };
                let i = r - seq.q.start;
                for (h, out) in out.chunks_exact_mut(d.max(1)).enumerate() {
                    let (hk, hl) = (h / s.group(), h % s.group());
                    let strips = &parts[(n * s.heads_kv + hk) * self.strips..][..self.strips];
                    let at = (hl * seq.len_q() + i) * dp;
                    out.fill(0.0);
                    for part in strips {
                        out.iter_mut()
                            .zip(&part.dq[at..][..d])
                            .for_each(|(y, x)| *y += x);
                    }
                    out.iter_mut()
                        .for_each(|x| *x = prec.round(*x * self.scale));
                }
            });
        dq
    }

    /// With sinks, `dsink_h = −Σ exp(sink_h − lse) · D` over every row of
    /// head `h`, summed in row order (in f64: deterministic and exact to
    /// f32).
    fn dsinks(&self) -> Option<Vec<f32>> {
        let sinks = self.opts.sinks.as_ref()?.logits();
        let per_head = |(h, &sink): (usize, &f32)| {
            let mut sum = 0f64;
            for seq in &self.seqs {
                for i in 0..seq.len_q() {
                    let at = seq.lse_index(h, i);
                    let p = (sink as f64 - self.lse[at] as f64).exp();
                    sum += p * self.delta[at] as f64;
                }
            }
            -sum as f32
        };
        Some(sinks.iter().enumerate().map(per_head).collect())
    }
}

/// One task's results: dK `(bc, dpad)` and dV `(bc, dvpad)` of each of its
/// key blocks in the order it ran them, scaled and rounded, and its dQ
/// sums over them for the group's query heads `(group, len_q, dpad)`, not
/// yet scaled.
struct KeyOut {
    dk: Buffer,
    dv: Buffer,
    dq: Buffer,
}

/// Strip `task % strips` of kv head `task / strips` (over sequences):
/// key blocks `strip, strip + strips, ...`.
struct KeyTask<'a, 'c> {
    ctx: &'c Ctx<'a>,
    task: usize,
}

/// Key blocks that take turns on each query block (`Ctx::key_blocks`):
/// their dK and dV sums (128 KiB at d 64) stay in L2 beside the query
/// block's rows. 8 and 16 measured no faster at N 4096 with a 2 MiB L2;
/// 4 leaves room in smaller ones.
const KEY_BLOCKS_TOGETHER: usize = 4;

/// A key block of a task and its dK and dV sums.
struct KeyBlockSums<'a> {
    kb: usize,
    dk: &'a mut [f32],
    dv: &'a mut [f32],
}

impl Task for KeyTask<'_, '_> {
    type Output = KeyOut;
    #[inline(always)]
    fn run<K: Kernel>(self) -> KeyOut {
        let c = self.ctx;
        let (s, g) = (&c.shape, &c.g);
        let (nh, strip) = (self.task / c.strips, self.task % c.strips);
        let (n, hk) = (nh / s.heads_kv, nh % s.heads_kv);
        let seq = &c.seqs[n];
        let blocks: Vec<usize> = (strip..seq.len_k().div_ceil(g.bc))
            .step_by(c.strips)
            .collect();
        let mut out = KeyOut {
            dk: Buffer::zeroed(blocks.len() * g.bc * g.dpad),
            dv: Buffer::zeroed(blocks.len() * g.bc * g.dvpad),
            dq: Buffer::zeroed(s.group() * seq.len_q() * g.dpad),
        };
        let mut t = Tile {
            p: vec![0f32; c.br * g.bc],
            ds: vec![0f32; c.br * g.bc],
            keep: vec![false; g.bc],
        };
        let mut sums: Vec<KeyBlockSums> = out
            .dk
            .chunks_exact_mut((g.bc * g.dpad).max(1))
            .zip(out.dv.chunks_exact_mut((g.bc * g.dvpad).max(1)))
            .zip(&blocks)
            .map(|((dk, dv), &kb)| KeyBlockSums { kb, dk, dv })
            .collect();
        for group in sums.chunks_mut(KEY_BLOCKS_TOGETHER) {
            c.key_blocks::<K>((n, hk), group, &mut t, &mut out.dq);
        }
        out
    }
}

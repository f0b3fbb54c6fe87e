//! The CPU forward: one rayon task per (sequence, query head, block of
//! query rows), each streaming the key blocks its rows can see through
//! [`attend`]; block sizes from [`Blocks::forward`]. Where that gives too
//! few tasks for the threads (decode-shaped problems: few rows, many keys)
//! the keys are split too and the splits merged by their LSE. A packed
//! batch's sequences are tasks like a batch's entries; a sink joins each
//! row's softmax after the merge.

use super::attend::{attend, Geometry, KeyBlock, KeySource, Keys, Partial, Query};
use super::isa::{Isa, Task};
use super::merge::{merge_row, with_sink};
use super::micro::{Kernel, Mat};
use super::pack::{self, Panels};
use super::scores::{ScoreRow, ScoreRule};
use super::vmath::{rounding_of, Rounding};
use crate::api::inputs::ForwardInputs;
use crate::api::options::{AttentionOptions, Mask};
use crate::api::output::{CallStats, ForwardOutput};
use crate::api::pair_rule::PairRule;
use crate::api::problem::Problem;
use crate::api::shape::{AttentionShape, Layout};
use crate::api::tensor::{TensorData, TensorView};
use crate::api::varlen::{sequences, Sequence};
use crate::error::Result;
use rayon::prelude::*;
use std::ops::Range;

/// Query rows and keys per block of a task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Blocks {
    pub rows: usize,
    pub keys: usize,
}

impl Blocks {
    /// `rows` query rows; K and V blocks of `keys × (d + dv)` f32 that
    /// together fill `bytes`: at least 32 and at most 256 keys, a multiple
    /// of 32 (two micro-kernel panels).
    fn sized([d, dv]: [usize; 2], rows: usize, bytes: usize) -> Self {
        let per_key = 4 * (pack::padded(d) + pack::padded(dv));
        let keys = (bytes / per_key / 32 * 32).clamp(32, 256);
        Self { rows, keys }
    }

    /// The backward's tiles for head dims `[d, dv]`: 64 query rows, K and
    /// V blocks filling a 32 KiB L1 data cache (64 keys at d 64).
    pub fn backward(dims: [usize; 2]) -> Self {
        Self::sized(dims, 64, 32 << 10)
    }

    /// The forward's: 128 rows and K and V blocks of 128 KiB together
    /// (256 keys at d 64, read from L2), so the online softmax's per-row
    /// work on each block (block max, rescale) spreads over many keys — 9%
    /// less time than the backward's blocks at N 4096, d 64, one thread.
    /// Blocks on a mask's edge are narrowed to what their rows see
    /// ([`ScoreRule::narrow`]), so a causal mask wastes little of them; a
    /// local window narrower than four such blocks gets the backward's
    /// blocks, which follow its band more closely.
    pub fn forward(dims: [usize; 2], mask: &Mask) -> Self {
        let big = Self::sized(dims, 128, 128 << 10);
        let band = mask.left.zip(mask.right).map(|(l, r)| l + r + 1);
        if band.is_some_and(|w| w < 4 * big.keys as i64) {
            Self::backward(dims)
        } else {
            big
        }
    }
}

/// Everything the tasks read.
struct Ctx<'a> {
    shape: AttentionShape,
    opts: &'a AttentionOptions,
    seqs: Vec<Sequence>,
    /// Each sequence's first row block in the task order (and one past
    /// the last): tasks run (sequence, head, row block).
    first_block: Vec<usize>,
    q: &'a [f32],
    kt: Panels,
    v: Panels,
    /// The row strides of `kt`'s blocks and of `v` ([`pack::stride`]).
    ldk: usize,
    ldv: usize,
    round_p: Rounding,
    g: Geometry,
    /// Query rows per task.
    br: usize,
    /// Keys per split (a multiple of `bc`) and the number of splits.
    split_keys: usize,
    splits: usize,
}

/// Exact attention forward on `isa`'s kernels.
pub(crate) fn forward(
    isa: Isa,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    opts: &AttentionOptions,
) -> Result<ForwardOutput> {
    let problem = Problem::forward(&ForwardInputs::new(*q, *k, *v), opts)?;
    let precision = problem.precision;
    let [qf, kf, vf] = [q, k, v].map(pack::widened);
    let (o, lse) = forward_f32(isa, &problem, &qf, &kf, &vf, rounding_of(precision));
    let o = TensorData::from_f32(o, precision);
    let out = ForwardOutput::new(problem.shape, o, lse, CallStats::default());
    Ok(out.packed(problem.packed()))
}

/// The forward of `problem` on f32 data in its shape's standard layouts,
/// P rounded by `round_p` before `P·V`: `(o, lse)` (the FP8 path's core too).
pub(crate) fn forward_f32(
    isa: Isa,
    problem: &Problem,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    round_p: Rounding,
) -> (Vec<f32>, Vec<f32>) {
    let (shape, opts) = (problem.shape, problem.opts);
    let dims = [shape.head_dim, shape.head_dim_v];
    let Blocks { rows: br, keys: bc } = Blocks::forward(dims, &problem.mask);
    let seqs = sequences(&shape, opts.varlen.as_ref());
    let key_rows: Vec<Range<usize>> = seqs.iter().map(|s| s.k.clone()).collect();
    let mut first_block = vec![0];
    for s in &seqs {
        first_block
            .push(first_block[first_block.len() - 1] + shape.heads_q * s.len_q().div_ceil(br));
    }
    let tasks = first_block[seqs.len()];
    let longest = seqs.iter().map(Sequence::len_k).max().unwrap_or(0);
    let (split_keys, splits) = key_splits(tasks, longest, bc);
    let (ldk, ldv) = (pack::stride(bc), pack::stride(shape.head_dim_v));
    let ctx = Ctx {
        shape,
        opts,
        kt: pack::transposed(k, &Layout::kv(&shape), &key_rows, bc, ldk),
        v: pack::rows(
            v,
            &Layout::v(&shape),
            &key_rows,
            |n| n.div_ceil(bc) * bc,
            ldv,
        ),
        ldk,
        ldv,
        seqs,
        first_block,
        q,
        round_p,
        g: Geometry::new(dims, bc),
        br,
        split_keys,
        splits,
    };
    let parts: Vec<Partial> = (0..tasks * splits)
        .into_par_iter()
        .map(|t| isa.run(BlockTask { ctx: &ctx, task: t }))
        .collect();
    ctx.assemble(&parts)
}

/// Keys per split and splits: one split unless the tasks are fewer than
/// two per thread, then enough splits of at least two key blocks each.
pub(crate) fn key_splits(tasks: usize, keys: usize, bc: usize) -> (usize, usize) {
    let blocks = keys.div_ceil(bc);
    let want = (2 * rayon::current_num_threads()).div_ceil(tasks.max(1));
    let splits = want.min(blocks / 2).max(1);
    let per = blocks.div_ceil(splits).max(1);
    (per * bc, blocks.div_ceil(per).max(1))
}

/// Task `task`: split `task % splits` of a block of rows.
struct BlockTask<'a, 'c> {
    ctx: &'c Ctx<'a>,
    task: usize,
}

impl Task for BlockTask<'_, '_> {
    type Output = Partial;
    #[inline(always)]
    fn run<K: Kernel>(self) -> Partial {
        let c = self.ctx;
        let s = &c.shape;
        let (split, block) = (self.task % c.splits, self.task / c.splits);
        let n = c.first_block.partition_point(|&f| f <= block) - 1;
        let seq = &c.seqs[n];
        let q_blocks = seq.len_q().div_ceil(c.br);
        let (h, qb) = (
            (block - c.first_block[n]) / q_blocks,
            (block - c.first_block[n]) % q_blocks,
        );
        let pair = PairRule::new(c.opts, seq, h, [s.heads_q, s.head_dim]);
        let keys = split * c.split_keys..((split + 1) * c.split_keys).min(seq.len_k());
        let rows: Vec<ScoreRow> = (qb * c.br..((qb + 1) * c.br).min(seq.len_q()))
            .map(|i| ScoreRow {
                i,
                keys: clip(pair.keys(i), &keys),
                slope: None,
            })
            .collect();
        let ql = Layout::q(s);
        // The block's rows side by side: in q's layout they are a whole
        // row of heads apart, which for 8 heads of 64 or 128 puts them in
        // a few L1 sets, too few to hold them between the product's passes.
        let ld = pack::stride(s.head_dim);
        let mut q = vec![0f32; rows.len() * ld];
        for (r, row) in q.chunks_exact_mut(ld).enumerate() {
            let at = ql.row(0, seq.q.start + qb * c.br + r, h);
            row[..s.head_dim].copy_from_slice(&c.q[at..][..s.head_dim]);
        }
        let query = Query {
            q: Mat::rows(&q, ld),
            rows: &rows,
        };
        let src = Packed {
            ctx: c,
            n,
            hk: h / s.group(),
        };
        attend::<K, _>(&c.g, &ScoreRule::of_pair(&pair), &query, &src, c.round_p)
    }
}

/// `a ∩ b` (an empty range starts where it ends).
pub(crate) fn clip(a: Range<usize>, b: &Range<usize>) -> Range<usize> {
    let start = a.start.max(b.start);
    start..a.end.min(b.end).max(start)
}

/// The packed K and V of kv head `hk` of sequence `n`.
struct Packed<'a, 'c> {
    ctx: &'c Ctx<'a>,
    n: usize,
    hk: usize,
}

impl KeySource for Packed<'_, '_> {
    #[inline(always)]
    fn block(&self, kb: usize) -> KeyBlock<'_> {
        let (c, g) = (self.ctx, &self.ctx.g);
        let kt = &c.kt.head(self.n, self.hk)[kb * g.d * c.ldk..][..g.d * c.ldk];
        let v = &c.v.head(self.n, self.hk)[kb * g.bc * c.ldv..][..g.bc * c.ldv];
        KeyBlock::plain(Keys::Transposed(kt, c.ldk), v, c.ldv)
    }
}

impl Ctx<'_> {
    /// Every block's splits merged (and its sinks added), in o's and lse's
    /// layouts; o's rows in parallel (first touch of fresh memory costs as
    /// much as the copy).
    fn assemble(&self, parts: &[Partial]) -> (Vec<f32>, Vec<f32>) {
        let s = &self.shape;
        let (dv, hq) = (s.head_dim_v, s.heads_q);
        let sinks = self.opts.sinks.as_ref().map(|x| x.logits());
        let mut o = vec![0f32; s.o_len()];
        // Each row's LSE for every head, in o's row order.
        let mut row_lse = vec![f32::NEG_INFINITY; s.lse_len()];
        o.par_chunks_mut((hq * dv).max(1))
            .zip(row_lse.par_chunks_mut(hq.max(1)))
            .enumerate()
            .for_each(|(r, (out, lse))| {
                let n = self.seqs.partition_point(|x| x.q.end <= r);
                let Some(seq) = self.seqs.get(n) else { return };
                let i = r - seq.q.start;
                let (q_blocks, (qb, at)) =
                    (seq.len_q().div_ceil(self.br), (i / self.br, i % self.br));
                for (h, (out, lse)) in out.chunks_exact_mut(dv.max(1)).zip(lse).enumerate() {
                    let block = self.first_block[n] + h * q_blocks + qb;
                    let splits = &parts[block * self.splits..][..self.splits];
                    *lse = merge_row(splits, at, self.g.dvpad, out);
                    if let Some(sinks) = sinks {
                        *lse = with_sink(out, *lse, sinks[h]);
                    }
                }
            });
        let mut lse = vec![f32::NEG_INFINITY; s.lse_len()];
        for seq in &self.seqs {
            for (i, r) in seq.q.clone().enumerate() {
                for h in 0..hq {
                    lse[seq.lse_index(h, i)] = row_lse[r * hq + h];
                }
            }
        }
        (o, lse)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn few_tasks_split_the_keys_into_whole_blocks() {
        let threads = rayon::current_num_threads();
        let (per, splits) = key_splits(1, 3000, 64);
        assert!(splits >= 2 && per.is_multiple_of(64) && per * splits >= 3000);
        assert!(per * (splits - 1) < 3000, "no empty split");
        // Enough tasks, or too few keys: one split.
        assert_eq!(key_splits(2 * threads, 3000, 64).1, 1);
        assert_eq!(key_splits(1, 100, 64).1, 1);
    }

    #[test]
    fn key_blocks_fit_the_cache_and_the_micro_kernel() {
        let mask = |left, right| Mask {
            offset: 0,
            left,
            right,
            seqlen_k: 4096,
        };
        let (full, causal, window) = (
            mask(None, None),
            mask(None, Some(0)),
            mask(Some(64), Some(0)),
        );
        for d in 1..=256 {
            for b in [Blocks::backward([d, d]), Blocks::forward([d, d], &full)] {
                let bc = b.keys;
                assert!(
                    bc.is_multiple_of(32) && (32..=256).contains(&bc),
                    "d {d}: {bc}"
                );
            }
            let dims = [d, d];
            assert_eq!(Blocks::forward(dims, &causal), Blocks::forward(dims, &full));
            assert_eq!(Blocks::forward(dims, &window), Blocks::backward(dims));
        }
        assert_eq!(Blocks::backward([64, 64]), Blocks { rows: 64, keys: 64 });
        assert_eq!(
            Blocks::forward([64, 64], &full),
            Blocks {
                rows: 128,
                keys: 256
            }
        );
        assert_eq!(Blocks::forward([128, 128], &full).keys, 128);
        // v's own head dim counts in the blocks' bytes.
        assert_eq!(Blocks::forward([192, 128], &full).keys, 96);
    }
}

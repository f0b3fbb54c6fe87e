//! The CPU forward: one rayon task per (batch, query head, block of query
//! rows), each streaming the key blocks its rows can see through
//! [`attend`]; block sizes from [`Blocks::forward`]. Where that gives too
//! few tasks for the threads (decode-shaped problems: few rows, many keys)
//! the keys are split too and the splits merged by their LSE.

use super::attend::{attend, Geometry, KeyBlock, KeySource, Partial, Query, Scratch};
use super::isa::{Isa, Task};
use super::merge::merge_row;
use super::micro::{Kernel, Mat};
use super::pack::{self, Panels};
use super::scores::{ScoreRow, ScoreRule};
use super::vmath::{rounding_of, Rounding};
use crate::api::options::{AttentionOptions, Mask};
use crate::api::output::{CallStats, ForwardOutput};
use crate::api::shape::{AttentionShape, Layout};
use crate::api::tensor::{TensorData, TensorView};
use crate::error::Result;
use rayon::prelude::*;

/// Query rows and keys per block of a task.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Blocks {
    pub rows: usize,
    pub keys: usize,
}

impl Blocks {
    /// 64 query rows; K and V blocks of `keys × d` f32 that together fill
    /// `bytes`: at least 32 and at most 256 keys, a multiple of 32 (two
    /// micro-kernel panels).
    fn sized(d: usize, rows: usize, bytes: usize) -> Self {
        let per_key = 2 * 4 * pack::padded(d);
        let keys = (bytes / per_key / 32 * 32).clamp(32, 256);
        Self { rows, keys }
    }

    /// The backward's tiles: 64 query rows, K and V blocks filling a 32 KiB
    /// L1 data cache (64 keys at d 64).
    pub fn backward(d: usize) -> Self {
        Self::sized(d, 64, 32 << 10)
    }

    /// The forward's: 128 rows and K and V blocks of 128 KiB together
    /// (256 keys at d 64, read from L2), so the online softmax's per-row
    /// work on each block (block max, rescale) spreads over many keys — 9%
    /// less time than the backward's blocks at N 4096, d 64, one thread.
    /// Blocks on a mask's edge are narrowed to what their rows see
    /// ([`ScoreRule::narrow`]), so a causal mask wastes little of them; a
    /// local window narrower than four such blocks gets the backward's
    /// blocks, which follow its band more closely.
    pub fn forward(d: usize, mask: &Mask) -> Self {
        let big = Self::sized(d, 128, 128 << 10);
        let band = mask.left.zip(mask.right).map(|(l, r)| l + r + 1);
        if band.is_some_and(|w| w < 4 * big.keys as i64) {
            Self::backward(d)
        } else {
            big
        }
    }
}

/// Everything the tasks read.
struct Ctx<'a> {
    shape: AttentionShape,
    q: &'a [f32],
    kt: Panels,
    v: Panels,
    rule: ScoreRule,
    mask: Mask,
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
    [q, k, v]: [&TensorView; 3],
    opts: &AttentionOptions,
) -> Result<ForwardOutput> {
    let shape = AttentionShape::from_views(q, k, v)?;
    opts.validate()?;
    super::check_layouts(&shape, opts)?;
    let precision = q.precision();
    let [qf, kf, vf] = [q, k, v].map(pack::widened);
    let (o, lse) = forward_f32(isa, shape, [&qf, &kf, &vf], opts, rounding_of(precision));
    let o = TensorData::from_f32(o, precision);
    Ok(ForwardOutput::new(shape, o, lse, CallStats::default()))
}

/// The forward on f32 data in the standard layouts of a validated `shape`,
/// P rounded by `round_p` before `P·V`: `(o, lse)` (the FP8 path's core too).
pub(crate) fn forward_f32(
    isa: Isa,
    shape: AttentionShape,
    [q, k, v]: [&[f32]; 3],
    opts: &AttentionOptions,
    round_p: Rounding,
) -> (Vec<f32>, Vec<f32>) {
    let d = shape.head_dim;
    let mask = opts.mask(&shape);
    let Blocks { rows: br, keys: bc } = Blocks::forward(d, &mask);
    let kl = Layout::kv(&shape);
    let rows = shape.seqlen_k.div_ceil(bc) * bc;
    let tasks = shape.batch * shape.heads_q * shape.seqlen_q.div_ceil(br);
    let (split_keys, splits) = key_splits(tasks, shape.seqlen_k, bc);
    let ctx = Ctx {
        shape,
        q,
        kt: pack::transposed(k, &kl, shape.batch, bc),
        v: pack::rows(v, &kl, shape.batch, rows),
        rule: ScoreRule::new(opts, d),
        mask,
        round_p,
        g: Geometry {
            d,
            dpad: pack::padded(d),
            bc,
        },
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
    let per = blocks.div_ceil(splits);
    (per * bc, blocks.div_ceil(per))
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
        let q_blocks = s.seqlen_q.div_ceil(c.br);
        let (bh, qb) = (block / q_blocks, block % q_blocks);
        let (b, h) = (bh / s.heads_q, bh % s.heads_q);
        let keys = split * c.split_keys..((split + 1) * c.split_keys).min(s.seqlen_k);
        let rows: Vec<ScoreRow> = (qb * c.br..((qb + 1) * c.br).min(s.seqlen_q))
            .map(|i| ScoreRow {
                i,
                keys: clip(c.mask.key_range(i), &keys),
            })
            .collect();
        let ql = Layout::q(s);
        let query = Query {
            q: Mat::rows(&c.q[ql.row(b, qb * c.br, h)..], s.heads_q * s.head_dim),
            rows: &rows,
        };
        let src = Packed {
            ctx: c,
            b,
            hk: h / s.group(),
        };
        attend::<K, _>(&c.g, &c.rule, &query, &src, c.round_p)
    }
}

/// `a ∩ b` (an empty range starts where it ends).
pub(crate) fn clip(
    a: std::ops::Range<usize>,
    b: &std::ops::Range<usize>,
) -> std::ops::Range<usize> {
    let start = a.start.max(b.start);
    start..a.end.min(b.end).max(start)
}

/// The packed K and V of kv head `hk` of batch entry `b`.
struct Packed<'a, 'c> {
    ctx: &'c Ctx<'a>,
    b: usize,
    hk: usize,
}

impl KeySource for Packed<'_, '_> {
    #[inline(always)]
    fn block<'s>(&'s self, kb: usize, _: &'s mut Scratch) -> KeyBlock<'s> {
        let g = &self.ctx.g;
        KeyBlock {
            kt: &self.ctx.kt.head(self.b, self.hk)[kb * g.d * g.bc..][..g.d * g.bc],
            v: &self.ctx.v.head(self.b, self.hk)[kb * g.bc * g.dpad..][..g.bc * g.dpad],
        }
    }
}

impl Ctx<'_> {
    /// Every block's splits merged, in o's and lse's layouts; o's rows in
    /// parallel (first touch of fresh memory costs as much as the copy).
    fn assemble(&self, parts: &[Partial]) -> (Vec<f32>, Vec<f32>) {
        let s = &self.shape;
        let (d, hq, sq) = (s.head_dim, s.heads_q, s.seqlen_q);
        let q_blocks = sq.div_ceil(self.br);
        let mut o = vec![0f32; s.q_len()];
        // Each row's LSE for every head, in o's row order.
        let mut row_lse = vec![f32::NEG_INFINITY; s.lse_len()];
        o.par_chunks_mut((hq * d).max(1))
            .zip(row_lse.par_chunks_mut(hq.max(1)))
            .enumerate()
            .for_each(|(r, (out, lse))| {
                let (b, i) = (r / sq, r % sq);
                let (qb, at) = (i / self.br, i % self.br);
                for (h, (out, lse)) in out.chunks_exact_mut(d.max(1)).zip(lse).enumerate() {
                    let block = (b * hq + h) * q_blocks + qb;
                    let splits = &parts[block * self.splits..][..self.splits];
                    *lse = merge_row(splits, at, self.g.dpad, out);
                }
            });
        let lse = (0..s.lse_len())
            .map(|x| {
                let (bh, i) = (x / sq, x % sq);
                row_lse[(bh / hq * sq + i) * hq + bh % hq]
            })
            .collect();
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
            for b in [Blocks::backward(d), Blocks::forward(d, &full)] {
                let bc = b.keys;
                assert!(
                    bc.is_multiple_of(32) && (32..=256).contains(&bc),
                    "d {d}: {bc}"
                );
            }
            assert_eq!(Blocks::forward(d, &causal), Blocks::forward(d, &full));
            assert_eq!(Blocks::forward(d, &window), Blocks::backward(d));
        }
        assert_eq!(Blocks::backward(64), Blocks { rows: 64, keys: 64 });
        assert_eq!(
            Blocks::forward(64, &full),
            Blocks {
                rows: 128,
                keys: 256
            }
        );
        assert_eq!(Blocks::forward(128, &full).keys, 128);
    }
}

//! The CPU forward: the same tiled online-softmax algorithm as the WGSL
//! kernels, in f32 on all cores (rayon), one task per block of query rows.

use crate::api::options::{AttentionOptions, Mask};
use crate::api::output::{CallStats, ForwardOutput};
use crate::api::shape::{lse_index, AttentionShape, Layout};
use crate::api::tensor::{TensorData, TensorView};
use crate::error::Result;
use rayon::prelude::*;

/// Query rows per task.
const BR: usize = 16;
/// Keys per block of the online softmax.
const BC: usize = 64;

/// What every task reads.
struct Problem {
    shape: AttentionShape,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    scale: f32,
    softcap: f32,
    mask: Mask,
    /// What P is rounded to before `P·V` (the storage precision, or e4m3).
    round_p: fn(f32) -> f32,
}

/// One block of query rows: its output rows and their LSE.
struct Block {
    acc: Vec<f32>,
    lse: Vec<f32>,
}

/// Exact attention forward on the CPU.
pub fn forward(
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    opts: &AttentionOptions,
) -> Result<ForwardOutput> {
    let shape = AttentionShape::from_views(q, k, v)?;
    opts.validate()?;
    let precision = q.precision();
    let qkv = [q, k, v].map(|t| t.data.to_f32());
    let (o, lse) = attend(shape, qkv, opts, precision.rounding());
    let o = TensorData::from_f32(o, precision);
    Ok(ForwardOutput::new(shape, o, lse, CallStats::default()))
}

/// The forward on f32 data in the standard layouts of `shape`, P rounded
/// by `round_p` before `P·V`: `(o, lse)` (the FP8 path's core too).
pub(crate) fn attend(
    shape: AttentionShape,
    [q, k, v]: [Vec<f32>; 3],
    opts: &AttentionOptions,
    round_p: fn(f32) -> f32,
) -> (Vec<f32>, Vec<f32>) {
    let p = Problem {
        shape,
        q,
        k,
        v,
        scale: opts.scale_for(shape.head_dim),
        softcap: opts.softcap_value(),
        mask: opts.mask(&shape),
        round_p,
    };
    let q_blocks = shape.seqlen_q.div_ceil(BR);
    let tasks: Vec<(usize, usize, usize)> = (0..shape.batch)
        .flat_map(|b| (0..shape.heads_q).flat_map(move |h| (0..q_blocks).map(move |qb| (b, h, qb))))
        .collect();
    let blocks: Vec<Block> = tasks.par_iter().map(|&t| p.block(t)).collect();
    p.assemble(&tasks, blocks)
}

/// A row's running softmax state.
struct RowState {
    m: f32,
    l: f32,
}

impl Problem {
    /// Rows `qb·BR..` of head `h` of batch entry `b`, streaming the key
    /// blocks some row may see (skip, don't mask).
    fn block(&self, (b, h, qb): (usize, usize, usize)) -> Block {
        let s = &self.shape;
        let d = s.head_dim;
        let rows = qb * BR..((qb + 1) * BR).min(s.seqlen_q);
        let mut state: Vec<RowState> = rows
            .clone()
            .map(|_| RowState {
                m: f32::NEG_INFINITY,
                l: 0.0,
            })
            .collect();
        let mut acc = vec![0f32; rows.len() * d];
        let lo = rows
            .clone()
            .map(|i| self.mask.key_range(i).start)
            .min()
            .unwrap_or(0);
        let hi = rows
            .clone()
            .map(|i| self.mask.key_range(i).end)
            .max()
            .unwrap_or(0);
        let mut scores = vec![0f32; BC];
        for k0 in (lo..hi).step_by(BC) {
            let keys = k0..(k0 + BC).min(hi);
            for (r, i) in rows.clone().enumerate() {
                let out = &mut acc[r * d..][..d];
                self.row_block((b, h, i), keys.clone(), &mut scores, &mut state[r], out);
            }
        }
        let mut lse = vec![f32::NEG_INFINITY; rows.len()];
        for (r, st) in state.iter().enumerate() {
            let out = &mut acc[r * d..][..d];
            if st.l > 0.0 {
                out.iter_mut().for_each(|x| *x /= st.l);
                lse[r] = st.m + st.l.ln();
            } else {
                out.iter_mut().for_each(|x| *x = 0.0);
            }
        }
        Block { acc, lse }
    }

    /// One row against one block of keys: the online-softmax update.
    fn row_block(
        &self,
        (b, h, i): (usize, usize, usize),
        keys: std::ops::Range<usize>,
        s: &mut [f32],
        st: &mut RowState,
        out: &mut [f32],
    ) {
        let shape = &self.shape;
        let (ql, kl, d) = (Layout::q(shape), Layout::kv(shape), shape.head_dim);
        let hk = h / shape.group();
        let allowed = self.mask.key_range(i);
        let qrow = &self.q[ql.row(b, i, h)..][..d];
        let mut block_max = f32::NEG_INFINITY;
        for (c, j) in keys.clone().enumerate() {
            s[c] = if allowed.contains(&j) {
                let krow = &self.k[kl.row(b, j, hk)..][..d];
                let x = qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f32>() * self.scale;
                if self.softcap > 0.0 {
                    self.softcap * (x / self.softcap).tanh()
                } else {
                    x
                }
            } else {
                f32::NEG_INFINITY
            };
            block_max = block_max.max(s[c]);
        }
        if block_max == f32::NEG_INFINITY {
            return;
        }
        let m_new = st.m.max(block_max);
        let alpha = (st.m - m_new).exp();
        st.m = m_new;
        st.l *= alpha;
        out.iter_mut().for_each(|x| *x *= alpha);
        for (c, j) in keys.enumerate() {
            let p = (s[c] - m_new).exp();
            st.l += p;
            if p != 0.0 {
                let p = (self.round_p)(p);
                let vrow = &self.v[kl.row(b, j, hk)..][..d];
                out.iter_mut().zip(vrow).for_each(|(o, x)| *o += p * x);
            }
        }
    }

    /// The blocks' rows in o's and lse's layouts.
    fn assemble(
        &self,
        tasks: &[(usize, usize, usize)],
        blocks: Vec<Block>,
    ) -> (Vec<f32>, Vec<f32>) {
        let s = &self.shape;
        let (ql, d) = (Layout::q(s), s.head_dim);
        let mut o = vec![0f32; s.q_len()];
        let mut lse = vec![f32::NEG_INFINITY; s.lse_len()];
        for (&(b, h, qb), block) in tasks.iter().zip(blocks) {
            for (r, l) in block.lse.iter().enumerate() {
                let i = qb * BR + r;
                o[ql.row(b, i, h)..][..d].copy_from_slice(&block.acc[r * d..][..d]);
                lse[lse_index(s, b, h, i)] = *l;
            }
        }
        (o, lse)
    }
}

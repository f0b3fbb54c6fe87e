//! The CPU forward: the same tiled online-softmax algorithm as the WGSL
//! kernels, in f32 on all cores (rayon), one task per block of query rows
//! of one sequence and head. Scores, masks and sinks follow the pair rule
//! (`api::pair_rule`), and key blocks the block mask leaves no pair in are
//! skipped (`PairRule::skips`).

use crate::api::options::AttentionOptions;
use crate::api::output::{CallStats, ForwardOutput};
use crate::api::pair_rule::PairRule;
use crate::api::shape::{AttentionShape, Layout};
use crate::api::tensor::{Precision, TensorData, TensorView};
use crate::api::varlen::{sequences, Sequence};
use crate::error::Result;
use rayon::prelude::*;

/// Query rows per task.
const BR: usize = 16;
/// Keys per block of the online softmax.
const BC: usize = 64;

/// What every task reads.
struct Problem<'a> {
    shape: AttentionShape,
    opts: &'a AttentionOptions,
    seqs: Vec<Sequence>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    precision: Precision,
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
    opts.validate_for(&shape)?;
    let p = Problem {
        shape,
        opts,
        seqs: sequences(&shape, opts.varlen.as_ref()),
        q: q.data.to_f32(),
        k: k.data.to_f32(),
        v: v.data.to_f32(),
        precision: q.precision(),
    };
    let tasks: Vec<(usize, usize, usize)> = p
        .seqs
        .iter()
        .enumerate()
        .flat_map(|(n, s)| {
            (0..shape.heads_q)
                .flat_map(move |h| (0..s.len_q().div_ceil(BR)).map(move |qb| (n, h, qb)))
        })
        .collect();
    let blocks: Vec<Block> = tasks.par_iter().map(|&t| p.block(t)).collect();
    let (o, lse) = p.assemble(&tasks, blocks);
    let o = TensorData::from_f32(o, p.precision);
    let out = ForwardOutput::new(shape, o, lse, CallStats::default());
    Ok(out.packed(opts.varlen.is_some()))
}

/// A row's running softmax state.
struct RowState {
    m: f32,
    l: f32,
}

impl Problem<'_> {
    /// Rows `qb·BR..` of head `h` of sequence `n`, streaming the key
    /// blocks some row may see (skip, don't mask).
    fn block(&self, (n, h, qb): (usize, usize, usize)) -> Block {
        let seq = &self.seqs[n];
        let dv = self.shape.head_dim_v;
        let rule = PairRule::new(self.opts, seq, h, [self.shape.heads_q, self.shape.head_dim]);
        let rows = qb * BR..((qb + 1) * BR).min(seq.len_q());
        // A sink is a key of score sink_h and value 0 (its value adds nothing).
        let start = rule.sink.map_or((f32::NEG_INFINITY, 0.0), |s| (s, 1.0));
        let mut state: Vec<RowState> = rows
            .clone()
            .map(|_| RowState {
                m: start.0,
                l: start.1,
            })
            .collect();
        let mut acc = vec![0f32; rows.len() * dv];
        let lo = rows.clone().map(|i| rule.keys(i).start).min().unwrap_or(0);
        let hi = rows.clone().map(|i| rule.keys(i).end).max().unwrap_or(0);
        let mut scores = vec![0f32; BC];
        for k0 in (lo..hi).step_by(BC) {
            let keys = k0..(k0 + BC).min(hi);
            if rule.skips(&rows, &keys) {
                continue;
            }
            for (r, i) in rows.clone().enumerate() {
                let out = &mut acc[r * dv..][..dv];
                self.row_block(
                    (seq, h, i),
                    (&rule, keys.clone()),
                    &mut scores,
                    &mut state[r],
                    out,
                );
            }
        }
        let mut lse = vec![f32::NEG_INFINITY; rows.len()];
        for (r, st) in state.iter().enumerate() {
            let out = &mut acc[r * dv..][..dv];
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
        (seq, h, i): (&Sequence, usize, usize),
        (rule, keys): (&PairRule, std::ops::Range<usize>),
        s: &mut [f32],
        st: &mut RowState,
        out: &mut [f32],
    ) {
        let shape = &self.shape;
        let (ql, kl, vl) = (Layout::q(shape), Layout::kv(shape), Layout::v(shape));
        let (d, dv) = (shape.head_dim, shape.head_dim_v);
        let hk = h / shape.group();
        let qrow = &self.q[ql.row(0, seq.q.start + i, h)..][..d];
        let mut block_max = f32::NEG_INFINITY;
        for (c, j) in keys.clone().enumerate() {
            s[c] = if rule.allows(i, j) {
                let krow = &self.k[kl.row(0, seq.k.start + j, hk)..][..d];
                let x: f32 = qrow.iter().zip(krow).map(|(a, b)| a * b).sum();
                rule.score(x, i, j).0
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
                let p = self.precision.round(p);
                let vrow = &self.v[vl.row(0, seq.k.start + j, hk)..][..dv];
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
        let (ol, dv) = (Layout::o(s), s.head_dim_v);
        let mut o = vec![0f32; s.o_len()];
        let mut lse = vec![f32::NEG_INFINITY; s.lse_len()];
        for (&(n, h, qb), block) in tasks.iter().zip(blocks) {
            let seq = &self.seqs[n];
            for (r, l) in block.lse.iter().enumerate() {
                let i = qb * BR + r;
                o[ol.row(0, seq.q.start + i, h)..][..dv]
                    .copy_from_slice(&block.acc[r * dv..][..dv]);
                lse[seq.lse_index(h, i)] = *l;
            }
        }
        (o, lse)
    }
}

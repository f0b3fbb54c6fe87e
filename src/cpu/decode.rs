//! Decoding on the CPU, the same way the WGSL kernels do it: `k_new`/`v_new`
//! written into the cache in place, then FlashDecoding's split and merge —
//! one task per (sequence, kv head, split) runs the online softmax for the
//! packed rows of the kv head's query group over its keys (so each K/V row
//! is read once per group) and returns their normalized partial output and
//! LSE; the merge combines the splits by their LSE.

use crate::api::decode::{DecodeOutput, DecodeProblem, DecodeStep, HostKvCache};
use crate::api::options::AttentionOptions;
use crate::api::output::CallStats;
use crate::api::tensor::{HostData, TensorData, TensorView};
use crate::error::{Error, Result};
use crate::plan::{plan_splits, DecodeRequest, SplitLimits, Splits};
use rayon::prelude::*;
use std::ops::Range;

/// Keys per block of the online softmax (and the splits' granularity).
const BLOCK: usize = 64;

/// One decoding step on a host cache: validate, append, attend. A step that
/// fails validation leaves the cache as it was.
pub fn decode(
    cache: &mut HostKvCache,
    step: &DecodeStep,
    opts: &AttentionOptions,
    num_splits: Option<usize>,
) -> Result<DecodeOutput> {
    opts.validate()?;
    let p = DecodeProblem::new(step, &cache.shape, cache.precision())?;
    if let Some([k_new, v_new]) = &step.new_kv {
        append(&mut cache.k, k_new, &p)?;
        append(&mut cache.v, v_new, &p)?;
    }
    let splits = cpu_splits(&p, num_splits)?;
    let work = Work {
        p: &p,
        q: step.q.data.to_f32(),
        cache,
        scale: opts.scale_for(p.head_dim),
        softcap: opts.softcap_value(),
        opts,
        splits,
    };
    let tasks: Vec<(usize, usize, usize)> = (0..p.batch)
        .flat_map(|b| {
            (0..p.heads_kv).flat_map(move |hk| (0..splits.num_splits).map(move |s| (b, hk, s)))
        })
        .collect();
    let partials: Vec<Partial> = tasks.par_iter().map(|&t| work.partial(t)).collect();
    let (o, lse) = work.merge(&partials);
    let o = TensorData::from_f32(o, p.precision);
    Ok(DecodeOutput::new(
        &p,
        o,
        lse,
        splits.num_splits,
        CallStats::default(),
    ))
}

/// The splits the planner gives the CPU: enough tasks for every thread.
fn cpu_splits(p: &DecodeProblem, num_splits: Option<usize>) -> Result<Splits> {
    let req = DecodeRequest {
        batch: p.batch,
        seqlen_q: p.seqlen_q,
        heads_q: p.heads_q,
        heads_kv: p.heads_kv,
        head_dim: p.head_dim,
        max_seqlen_k: p.max_seqlen_k(),
        precision: p.precision,
        num_splits,
        f16_native: None,
    };
    let limits = SplitLimits {
        parallelism: rayon::current_num_threads(),
        max_keys: usize::MAX,
        max_binding: u64::MAX,
    };
    let tasks = p.batch * p.heads_kv;
    Ok(plan_splits(&req, BLOCK, tasks, 0, &limits)?.0)
}

/// Copy the rows of `new` (`(batch, seqlen_new, heads_kv, d)`) to their cache rows.
fn append(cache: &mut TensorData, new: &TensorView, p: &DecodeProblem) -> Result<()> {
    fn copy<T: Copy>(c: &mut [T], n: &[T], p: &DecodeProblem) {
        let len = p.cache.row_len();
        for (src, (_, _, dst)) in p.appended_rows().enumerate() {
            c[dst * len..][..len].copy_from_slice(&n[src * len..][..len]);
        }
    }
    match (cache, new.data) {
        (TensorData::F32(c), HostData::F32(n)) => copy(c, n, p),
        (TensorData::F16(c), HostData::F16(n)) => copy(c, n, p),
        (TensorData::Bf16(c), HostData::Bf16(n)) => copy(c, n, p),
        (c, n) => {
            return Err(Error::DtypeMismatch {
                tensor: "k_new/v_new",
                dtype: n.precision().name(),
                like: "the kv cache",
                expected: c.precision().name(),
            })
        }
    }
    Ok(())
}

/// One task's result: per packed row, the normalized output and its LSE.
struct Partial {
    o: Vec<f32>,
    lse: Vec<f32>,
}

/// What every task reads.
struct Work<'a> {
    p: &'a DecodeProblem,
    q: Vec<f32>,
    cache: &'a HostKvCache,
    scale: f32,
    softcap: f32,
    opts: &'a AttentionOptions,
    splits: Splits,
}

/// A packed row's running softmax state.
struct Row {
    m: f32,
    l: f32,
}

impl Work<'_> {
    /// Packed row `r` of kv head `hk`: token `r / group`, query head `hk · group + r % group`.
    fn row(&self, hk: usize, r: usize) -> (usize, usize) {
        let g = self.p.group();
        (r / g, hk * g + r % g)
    }

    /// Sequence `b`, kv head `hk`, split `s`: the group's rows over the split's keys.
    fn partial(&self, (b, hk, s): (usize, usize, usize)) -> Partial {
        let p = self.p;
        let (d, rows) = (p.head_dim, p.group() * p.seqlen_q);
        let mask = p.mask(b, self.opts);
        let split = s * self.splits.keys_per_split;
        let split = split..(split + self.splits.keys_per_split).min(p.seqlen_k(b));
        let ranges: Vec<Range<usize>> = (0..rows)
            .map(|r| clip(mask.key_range(self.row(hk, r).0), &split))
            .collect();
        let visible = ranges.iter().filter(|r| !r.is_empty());
        let lo = visible.clone().map(|r| r.start).min().unwrap_or(0);
        let hi = visible.map(|r| r.end).max().unwrap_or(0);
        let mut state: Vec<Row> = (0..rows)
            .map(|_| Row {
                m: f32::NEG_INFINITY,
                l: 0.0,
            })
            .collect();
        let mut acc = vec![0f32; rows * d];
        let (mut kb, mut vb) = (vec![0f32; BLOCK * d], vec![0f32; BLOCK * d]);
        let mut scores = vec![0f32; BLOCK];
        for k0 in (lo..hi).step_by(BLOCK) {
            let keys = k0..(k0 + BLOCK).min(hi);
            self.load_block(b, hk, keys.clone(), &mut kb, &mut vb);
            for (r, range) in ranges.iter().enumerate() {
                let (i, h) = self.row(hk, r);
                let qrow = &self.q[((b * p.seqlen_q + i) * p.heads_q + h) * d..][..d];
                let block = Block {
                    keys: keys.clone(),
                    allowed: range,
                    k: &kb,
                    v: &vb,
                };
                self.update(
                    qrow,
                    &block,
                    &mut scores,
                    &mut state[r],
                    &mut acc[r * d..][..d],
                );
            }
        }
        let mut lse = vec![f32::NEG_INFINITY; rows];
        for (r, st) in state.iter().enumerate() {
            let out = &mut acc[r * d..][..d];
            if st.l > 0.0 {
                out.iter_mut().for_each(|x| *x /= st.l);
                lse[r] = st.m + st.l.ln();
            }
        }
        Partial { o: acc, lse }
    }

    /// K and V rows `keys` of kv head `hk` of sequence `b`, widened to f32.
    fn load_block(&self, b: usize, hk: usize, keys: Range<usize>, kb: &mut [f32], vb: &mut [f32]) {
        let (d, row_len) = (self.p.head_dim, self.cache.shape.row_len());
        for (c, t) in keys.enumerate() {
            let at = self.p.cache_row(b, t) * row_len + hk * d;
            widen(&self.cache.k, at, &mut kb[c * d..][..d]);
            widen(&self.cache.v, at, &mut vb[c * d..][..d]);
        }
    }

    /// One row's online-softmax update over one block of keys.
    fn update(&self, qrow: &[f32], blk: &Block, s: &mut [f32], st: &mut Row, out: &mut [f32]) {
        let d = qrow.len();
        let mut block_max = f32::NEG_INFINITY;
        for (c, j) in blk.keys.clone().enumerate() {
            s[c] = if blk.allowed.contains(&j) {
                let krow = &blk.k[c * d..][..d];
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
        for (c, &sc) in s.iter().enumerate().take(blk.keys.len()) {
            let p = (sc - m_new).exp();
            st.l += p;
            if p != 0.0 {
                // Row sums use the unrounded P; P·V uses P in storage precision.
                let p = self.p.precision.round(p);
                let vrow = &blk.v[c * d..][..d];
                out.iter_mut().zip(vrow).for_each(|(o, x)| *o += p * x);
            }
        }
    }

    /// Combine the splits of every row by their LSE, into o's and lse's layouts.
    fn merge(&self, partials: &[Partial]) -> (Vec<f32>, Vec<f32>) {
        let p = self.p;
        let (d, g, n) = (p.head_dim, p.group(), self.splits.num_splits);
        let mut o = vec![0f32; p.q_len()];
        let mut lse = vec![f32::NEG_INFINITY; p.lse_len()];
        for (task, chunk) in partials.chunks(n).enumerate() {
            let (b, hk) = (task / p.heads_kv, task % p.heads_kv);
            for r in 0..g * p.seqlen_q {
                let (i, h) = self.row(hk, r);
                let m = chunk
                    .iter()
                    .map(|x| x.lse[r])
                    .fold(f32::NEG_INFINITY, f32::max);
                if m == f32::NEG_INFINITY {
                    continue; // no split saw a key: o = 0, lse = -inf
                }
                let total = m + chunk.iter().map(|x| (x.lse[r] - m).exp()).sum::<f32>().ln();
                let out = &mut o[((b * p.seqlen_q + i) * p.heads_q + h) * d..][..d];
                for part in chunk.iter().filter(|x| x.lse[r] > f32::NEG_INFINITY) {
                    let w = (part.lse[r] - total).exp();
                    out.iter_mut()
                        .zip(&part.o[r * d..][..d])
                        .for_each(|(o, x)| *o += w * x);
                }
                lse[(b * p.heads_q + h) * p.seqlen_q + i] = total;
            }
        }
        (o, lse)
    }
}

/// One block of keys as one row sees it.
struct Block<'a> {
    keys: Range<usize>,
    allowed: &'a Range<usize>,
    k: &'a [f32],
    v: &'a [f32],
}

/// `a ∩ b` (empty ranges start where they end).
fn clip(a: Range<usize>, b: &Range<usize>) -> Range<usize> {
    let start = a.start.max(b.start);
    start..a.end.min(b.end).max(start)
}

/// `out.len()` elements of `data` from `at`, as f32.
fn widen(data: &TensorData, at: usize, out: &mut [f32]) {
    let n = out.len();
    match data {
        TensorData::F32(x) => out.copy_from_slice(&x[at..][..n]),
        TensorData::F16(x) => out
            .iter_mut()
            .zip(&x[at..][..n])
            .for_each(|(o, h)| *o = h.to_f32()),
        TensorData::Bf16(x) => out
            .iter_mut()
            .zip(&x[at..][..n])
            .for_each(|(o, h)| *o = h.to_f32()),
    }
}

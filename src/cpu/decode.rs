//! Decoding on the CPU, the same way the WGSL kernels do it: `k_new`/`v_new`
//! written into the cache in place, then FlashDecoding's split and merge —
//! one task per (sequence, kv head, split) runs the forward's inner loop
//! ([`attend`], the same micro-kernels and online softmax) for the packed
//! rows of the kv head's query group over its keys (so each K/V block is
//! read once per group, through the page table, widened to f32) and returns
//! their normalized partial output and LSE; the merge combines the splits
//! by their LSE.

use crate::api::decode::{DecodeOutput, DecodeProblem, DecodeStep, HostKvCache};
use crate::api::options::AttentionOptions;
use crate::api::output::CallStats;
use crate::api::tensor::{HostData, TensorData, TensorView};
use crate::error::{Error, Result};
use crate::plan::{plan_splits, DecodeRequest, SplitLimits, Splits};
use rayon::prelude::*;

use super::attend::{attend, Geometry, KeyBlock, KeySource, Partial, Query, Scratch};
use super::forward::clip;
use super::isa::{Isa, Task};
use super::merge::merge_row;
use super::micro::{Kernel, Mat};
use super::scores::{ScoreRow, ScoreRule};
use super::vmath::rounding_of;

/// Keys per block of the online softmax (and the splits' granularity).
const BLOCK: usize = 64;

/// One decoding step on a host cache: validate, append, attend. A step that
/// fails validation leaves the cache as it was.
pub(crate) fn decode(
    isa: Isa,
    cache: &mut HostKvCache,
    step: &DecodeStep,
    opts: &AttentionOptions,
    num_splits: Option<usize>,
) -> Result<DecodeOutput> {
    opts.validate()?;
    opts.band_only("decoding")?;
    opts.whole_sequences("decoding")?;
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
        rule: ScoreRule::new(opts, p.head_dim),
        opts,
        splits,
        g: Geometry::new([p.head_dim; 2], BLOCK),
    };
    let tasks: Vec<(usize, usize, usize)> = (0..p.batch)
        .flat_map(|b| {
            (0..p.heads_kv).flat_map(move |hk| (0..splits.num_splits).map(move |s| (b, hk, s)))
        })
        .collect();
    let partials: Vec<Partial> = tasks
        .par_iter()
        .map(|&task| isa.run(SplitTask { work: &work, task }))
        .collect();
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
        kernel: None,
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
pub(crate) fn append(cache: &mut TensorData, new: &TensorView, p: &DecodeProblem) -> Result<()> {
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

/// What every task reads.
struct Work<'a> {
    p: &'a DecodeProblem,
    q: Vec<f32>,
    cache: &'a HostKvCache,
    rule: ScoreRule<'static>,
    opts: &'a AttentionOptions,
    splits: Splits,
    g: Geometry,
}

impl Work<'_> {
    /// Packed row `r` of kv head `hk`: token `r / group`, query head `hk · group + r % group`.
    fn row(&self, hk: usize, r: usize) -> (usize, usize) {
        let g = self.p.group();
        (r / g, hk * g + r % g)
    }

    /// The group's packed q rows of sequence `b`, kv head `hk`, `(rows, d)`.
    fn packed_q(&self, b: usize, hk: usize) -> Vec<f32> {
        let p = self.p;
        let (d, rows) = (p.head_dim, p.group() * p.seqlen_q);
        let mut q = vec![0f32; rows * d];
        for (r, out) in q.chunks_exact_mut(d).enumerate() {
            let (i, h) = self.row(hk, r);
            out.copy_from_slice(&self.q[((b * p.seqlen_q + i) * p.heads_q + h) * d..][..d]);
        }
        q
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
                let out = &mut o[((b * p.seqlen_q + i) * p.heads_q + h) * d..][..d];
                lse[(b * p.heads_q + h) * p.seqlen_q + i] = merge_row(chunk, r, self.g.dpad, out);
            }
        }
        (o, lse)
    }
}

/// Sequence `b`, kv head `hk`, split `s`: the group's rows over the split's keys.
struct SplitTask<'a, 'w> {
    work: &'w Work<'a>,
    task: (usize, usize, usize),
}

impl Task for SplitTask<'_, '_> {
    type Output = Partial;
    #[inline(always)]
    fn run<K: Kernel>(self) -> Partial {
        let (w, (b, hk, s)) = (self.work, self.task);
        let p = w.p;
        let mask = p.mask(b, w.opts);
        let split = s * w.splits.keys_per_split;
        let split = split..(split + w.splits.keys_per_split).min(p.seqlen_k(b));
        let rows: Vec<ScoreRow> = (0..p.group() * p.seqlen_q)
            .map(|r| {
                let (i, _) = w.row(hk, r);
                let keys = clip(mask.key_range(i), &split);
                ScoreRow { i, keys }
            })
            .collect();
        let q = w.packed_q(b, hk);
        let query = Query {
            q: Mat::rows(&q, p.head_dim),
            rows: &rows,
        };
        let src = CacheBlocks { work: w, b, hk };
        attend::<K, _>(&w.g, &w.rule, &query, &src, rounding_of(p.precision))
    }
}

/// Key blocks read from the cache through its page table, widened to f32.
struct CacheBlocks<'a, 'w> {
    work: &'w Work<'a>,
    b: usize,
    hk: usize,
}

impl KeySource for CacheBlocks<'_, '_> {
    #[inline(always)]
    fn block<'s>(&'s self, kb: usize, scratch: &'s mut Scratch) -> KeyBlock<'s> {
        let (w, g) = (self.work, &self.work.g);
        let (d, row_len) = (g.d, w.cache.shape.row_len());
        scratch.kt.resize(d * g.bc, 0.0);
        scratch.v.resize(g.bc * g.dpad, 0.0);
        let mut row = vec![0f32; d];
        let keys = kb * g.bc..((kb + 1) * g.bc).min(w.p.seqlen_k(self.b));
        for c in 0..g.bc {
            let v = &mut scratch.v[c * g.dpad..][..d];
            if keys.contains(&(kb * g.bc + c)) {
                let at = w.p.cache_row(self.b, kb * g.bc + c) * row_len + self.hk * d;
                widen(&w.cache.k, at, &mut row);
                widen(&w.cache.v, at, v);
            } else {
                row.fill(0.0);
                v.fill(0.0);
            }
            for (x, k) in row.iter().enumerate() {
                scratch.kt[x * g.bc + c] = *k;
            }
        }
        KeyBlock {
            kt: &scratch.kt,
            v: &scratch.v,
        }
    }
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

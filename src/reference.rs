//! The f64 reference every correctness test compares against, and the naive
//! materialized baseline (S and P stored, storage-precision rounding) that the
//! accuracy rule measures the reference's own rounding noise with.

use crate::api::decode::{DecodeProblem, DecodeStep, HostKvCache};
use crate::api::options::{AttentionOptions, Fp8Options};
use crate::api::shape::{lse_index, AttentionShape, Layout};
use crate::api::tensor::{Precision, TensorData, TensorView};
use crate::error::Result;
use crate::quant::{e4m3_from_f64, e4m3_to_f32, Fp8Layout, E4M3_MAX};
use rayon::prelude::*;

/// Output of a reference computation, in f64.
#[derive(Clone, Debug)]
pub struct ReferenceOutput {
    /// `(batch, seqlen_q, heads_q, head_dim)`
    pub o: Vec<f64>,
    /// `(batch, heads_q, seqlen_q)`, natural-log; `-inf` for empty rows.
    pub lse: Vec<f64>,
}

/// The scores of one row after scale, softcap and mask, `None` where masked.
fn row_scores<F: Fn(usize) -> f64>(
    n_keys: usize,
    range: std::ops::Range<usize>,
    dot: F,
    scale: f64,
    softcap: f64,
) -> Vec<Option<f64>> {
    (0..n_keys)
        .map(|j| {
            if !range.contains(&j) {
                return None;
            }
            let s = dot(j) * scale;
            Some(if softcap > 0.0 {
                softcap * (s / softcap).tanh()
            } else {
                s
            })
        })
        .collect()
}

/// Exact attention forward in f64 on the (already rounded) inputs.
pub fn forward(
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    opts: &AttentionOptions,
) -> Result<ReferenceOutput> {
    let shape = AttentionShape::from_views(q, k, v)?;
    opts.validate()?;
    let widen =
        |t: &TensorView| -> Vec<f64> { t.data.to_f32().iter().map(|&x| x as f64).collect() };
    let (qf, kf, vf) = (widen(q), widen(k), widen(v));
    Ok(forward_f64(&qf, &kf, &vf, &shape, opts))
}

/// [`forward`] on f64 slices already in the standard layout.
pub fn forward_f64(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    shape: &AttentionShape,
    opts: &AttentionOptions,
) -> ReferenceOutput {
    forward_rows([q, k, v], shape, opts, |p| p)
}

/// FP8's yardstick: the same quantization as the FP8 kernels (the codes and
/// scales of [`crate::quant`]), computed naively in f64 — S whole, P =
/// exp(S − row max) quantized to e4m3 at its own scale before `P·V`, the
/// row sum from the unquantized P, as the kernels keep it. `o` is cut back
/// to the head dim.
pub fn fp8_naive(
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    opts: &AttentionOptions,
    fp8: &Fp8Options,
) -> Result<ReferenceOutput> {
    let shape = AttentionShape::from_views(q, k, v)?;
    opts.validate()?;
    let layout = Fp8Layout::new(shape.head_dim, fp8);
    let [qd, kd, vd] = layout.quantize([q, k, v])?.map(|t| t.dequantize_f64());
    let round = |p: f64| e4m3_to_f32(e4m3_from_f64(p * E4M3_MAX as f64)) as f64 / E4M3_MAX as f64;
    let padded = layout.padded(&shape);
    let out = forward_rows([&qd, &kd, &vd], &padded, &layout.options(opts), round);
    Ok(ReferenceOutput {
        o: layout.trim(&out.o),
        lse: out.lse,
    })
}

/// Attention in f64, P rounded by `round_p` before `P·V` (the identity for
/// the reference).
fn forward_rows<R: Fn(f64) -> f64 + Sync>(
    [q, k, v]: [&[f64]; 3],
    shape: &AttentionShape,
    opts: &AttentionOptions,
    round_p: R,
) -> ReferenceOutput {
    let (ql, kl) = (Layout::q(shape), Layout::kv(shape));
    let d = shape.head_dim;
    let scale = opts.scale_for(d) as f64;
    let softcap = opts.softcap_value() as f64;
    let mask = opts.mask(shape);
    collect_rows(shape, |b, i, h| {
        let hk = h / shape.group();
        let qrow = &q[ql.row(b, i, h)..][..d];
        let dot = |j: usize| {
            let krow = &k[kl.row(b, j, hk)..][..d];
            qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f64>()
        };
        let s = row_scores(shape.seqlen_k, mask.key_range(i), dot, scale, softcap);
        let m = s
            .iter()
            .flatten()
            .cloned()
            .fold(f64::NEG_INFINITY, f64::max);
        let mut o = vec![0.0; d];
        if m == f64::NEG_INFINITY {
            return (o, f64::NEG_INFINITY);
        }
        let mut l = 0.0;
        for (j, sj) in s.iter().enumerate() {
            if let Some(sj) = sj {
                let p = (sj - m).exp();
                l += p;
                let (p, vrow) = (round_p(p), &v[kl.row(b, j, hk)..][..d]);
                for (acc, x) in o.iter_mut().zip(vrow) {
                    *acc += p * x;
                }
            }
        }
        o.iter_mut().for_each(|x| *x /= l);
        (o, m + l.ln())
    })
}

/// The naive baseline of the accuracy rule: S and P materialized per row in f32,
/// P rounded to the storage precision before `P·V`, O rounded to it at the end.
pub fn naive_baseline(
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    opts: &AttentionOptions,
) -> Result<ReferenceOutput> {
    let shape = AttentionShape::from_views(q, k, v)?;
    opts.validate()?;
    let prec = q.precision();
    let (qf, kf, vf) = (q.data.to_f32(), k.data.to_f32(), v.data.to_f32());
    let (ql, kl) = (Layout::q(&shape), Layout::kv(&shape));
    let d = shape.head_dim;
    let scale = opts.scale_for(d);
    let softcap = opts.softcap_value();
    let mask = opts.mask(&shape);
    Ok(collect_rows(&shape, |b, i, h| {
        let hk = h / shape.group();
        let qrow = &qf[ql.row(b, i, h)..][..d];
        let range = mask.key_range(i);
        let s: Vec<f32> = range
            .clone()
            .map(|j| {
                let krow = &kf[kl.row(b, j, hk)..][..d];
                let x = qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f32>() * scale;
                if softcap > 0.0 {
                    softcap * (x / softcap).tanh()
                } else {
                    x
                }
            })
            .collect();
        if s.is_empty() {
            return (vec![0.0; d], f64::NEG_INFINITY);
        }
        let m = s.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
        let e: Vec<f32> = s.iter().map(|x| (x - m).exp()).collect();
        let l: f32 = e.iter().sum();
        let mut o = vec![0.0f32; d];
        for (j, ej) in range.zip(&e) {
            let p = prec.round(ej / l);
            let vrow = &vf[kl.row(b, j, hk)..][..d];
            for (acc, x) in o.iter_mut().zip(vrow) {
                *acc += p * x;
            }
        }
        let o = o.iter().map(|&x| prec.round(x) as f64).collect();
        (o, (m + l.ln()) as f64)
    }))
}

/// Run `row(b, i, h) -> (o_row, lse)` over every query row in parallel and
/// assemble the outputs in the standard layouts.
fn collect_rows<F>(shape: &AttentionShape, row: F) -> ReferenceOutput
where
    F: Fn(usize, usize, usize) -> (Vec<f64>, f64) + Sync,
{
    let (sq, hq, d) = (shape.seqlen_q, shape.heads_q, shape.head_dim);
    let rows: Vec<(Vec<f64>, f64)> = (0..shape.batch * sq * hq)
        .into_par_iter()
        .map(|r| row(r / (sq * hq), (r / hq) % sq, r % hq))
        .collect();
    let mut out = ReferenceOutput {
        o: Vec::with_capacity(shape.q_len()),
        lse: vec![0.0; shape.lse_len()],
    };
    // Rows come in (b, i, h) order, which is exactly o's layout.
    for (r, (o, lse)) in rows.into_iter().enumerate() {
        debug_assert_eq!(o.len(), d);
        out.o.extend_from_slice(&o);
        let (b, i, h) = (r / (sq * hq), (r / hq) % sq, r % hq);
        out.lse[lse_index(shape, b, h, i)] = lse;
    }
    out
}

/// The storage precision's rounding applied to a whole output (for reporting).
pub fn round_all(values: &[f64], precision: Precision) -> Vec<f64> {
    values
        .iter()
        .map(|&x| precision.round(x as f32) as f64)
        .collect()
}

/// Gradients of attention, in f64 (or f32 for the baseline), standard layouts.
#[derive(Clone, Debug)]
pub struct ReferenceGrads {
    pub dq: Vec<f64>,
    pub dk: Vec<f64>,
    pub dv: Vec<f64>,
}

/// The arithmetic the row-wise backward needs, for f64 (reference) and f32
/// (baseline and CPU backend).
pub(crate) trait Real:
    Copy
    + Send
    + Sync
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::AddAssign
{
    const ZERO: Self;
    const ONE: Self;
    fn from_f32(x: f32) -> Self;
    fn exp(self) -> Self;
    fn tanh(self) -> Self;
}

macro_rules! impl_real {
    ($t:ty) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            fn from_f32(x: f32) -> Self {
                x as $t
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
        }
    };
}
impl_real!(f32);
impl_real!(f64);

/// One backward problem in `T` arithmetic: inputs in the standard layouts,
/// and the rounding applied to P and dS before the products that use them.
pub(crate) struct RowBackward<'a, T, R> {
    pub shape: &'a AttentionShape,
    pub q: &'a [T],
    pub k: &'a [T],
    pub v: &'a [T],
    pub d_o: &'a [T],
    pub opts: &'a AttentionOptions,
    pub round: R,
}

/// One task's gradients: dq of the group's rows, dk and dv of its kv head.
struct TaskGrads<T> {
    dq: Vec<T>,
    dk: Vec<T>,
    dv: Vec<T>,
}

fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    a.iter().zip(b).fold(T::ZERO, |acc, (&x, &y)| acc + x * y)
}

impl<T: Real, R: Fn(T) -> T + Sync> RowBackward<'_, T, R> {
    /// Row-wise attention backward by recomputation: for each query row, P
    /// from the scores, dP = dO·Vᵀ, D = Σ P·dP, dS = P·(dP - D)·softcap'.
    /// Parallel over (batch, kv head); within a task the group's heads and
    /// rows run in a fixed order, so the result is deterministic.
    pub fn run(&self) -> (Vec<T>, Vec<T>, Vec<T>) {
        let shape = self.shape;
        let tasks: Vec<(usize, usize)> = (0..shape.batch)
            .flat_map(|b| (0..shape.heads_kv).map(move |hk| (b, hk)))
            .collect();
        let results: Vec<TaskGrads<T>> = tasks.par_iter().map(|&t| self.task(t)).collect();
        let (ql, kl, d, g) = (
            Layout::q(shape),
            Layout::kv(shape),
            shape.head_dim,
            shape.group(),
        );
        let mut dq = vec![T::ZERO; shape.q_len()];
        let mut dk = vec![T::ZERO; shape.kv_len()];
        let mut dv = vec![T::ZERO; shape.kv_len()];
        for (&(b, hk), t) in tasks.iter().zip(results) {
            for gi in 0..g {
                for i in 0..shape.seqlen_q {
                    dq[ql.row(b, i, hk * g + gi)..][..d]
                        .copy_from_slice(&t.dq[(gi * shape.seqlen_q + i) * d..][..d]);
                }
            }
            for j in 0..shape.seqlen_k {
                dk[kl.row(b, j, hk)..][..d].copy_from_slice(&t.dk[j * d..][..d]);
                dv[kl.row(b, j, hk)..][..d].copy_from_slice(&t.dv[j * d..][..d]);
            }
        }
        (dq, dk, dv)
    }

    /// Every row of the group of kv head `hk` of batch entry `b`.
    fn task(&self, (b, hk): (usize, usize)) -> TaskGrads<T> {
        let s = self.shape;
        let (d, g) = (s.head_dim, s.group());
        let mut t = TaskGrads {
            dq: vec![T::ZERO; g * s.seqlen_q * d],
            dk: vec![T::ZERO; s.seqlen_k * d],
            dv: vec![T::ZERO; s.seqlen_k * d],
        };
        for gi in 0..g {
            for i in 0..s.seqlen_q {
                self.row(&mut t, (b, hk, gi), i);
            }
        }
        let scale = T::from_f32(self.opts.scale_for(d));
        t.dk.iter_mut().for_each(|x| *x = *x * scale);
        t
    }

    /// Row `i` of query head `hk·g + gi`: its dq, and its share of dk, dv.
    fn row(&self, t: &mut TaskGrads<T>, (b, hk, gi): (usize, usize, usize), i: usize) {
        let s = self.shape;
        let (ql, kl, d) = (Layout::q(s), Layout::kv(s), s.head_dim);
        let range = self.opts.mask(s).key_range(i);
        if range.is_empty() {
            return;
        }
        let h = hk * s.group() + gi;
        let qrow = &self.q[ql.row(b, i, h)..][..d];
        let grow = &self.d_o[ql.row(b, i, h)..][..d];
        let scale = T::from_f32(self.opts.scale_for(d));
        let cap = self.opts.softcap_value();
        let softcap = T::from_f32(cap);
        // Scores and the softcap derivative.
        let (sc, dcap): (Vec<T>, Vec<T>) = range
            .clone()
            .map(|j| {
                let x = dot(qrow, &self.k[kl.row(b, j, hk)..][..d]) * scale;
                if cap > 0.0 {
                    let th = (x / softcap).tanh();
                    (softcap * th, T::ONE - th * th)
                } else {
                    (x, T::ONE)
                }
            })
            .unzip();
        let m = sc
            .iter()
            .cloned()
            .fold(sc[0], |a, b| if b > a { b } else { a });
        let e: Vec<T> = sc.iter().map(|&x| (x - m).exp()).collect();
        let l = e.iter().fold(T::ZERO, |a, &b| a + b);
        let p: Vec<T> = e.iter().map(|&x| x / l).collect();
        let dp: Vec<T> = range
            .clone()
            .map(|j| dot(grow, &self.v[kl.row(b, j, hk)..][..d]))
            .collect();
        let dsum = p.iter().zip(&dp).fold(T::ZERO, |a, (&x, &y)| a + x * y);
        let dq_row = &mut t.dq[(gi * s.seqlen_q + i) * d..][..d];
        for (c, j) in range.enumerate() {
            let pj = (self.round)(p[c]);
            let ds = (self.round)(p[c] * (dp[c] - dsum) * dcap[c]);
            let krow = &self.k[kl.row(b, j, hk)..][..d];
            for x in 0..d {
                dq_row[x] += ds * krow[x];
                t.dk[j * d + x] += ds * qrow[x];
                t.dv[j * d + x] += pj * grow[x];
            }
        }
        dq_row.iter_mut().for_each(|x| *x = *x * scale);
    }
}

/// The shape of a backward problem without `o`/`lse` (the reference and the
/// baseline recompute them).
fn backward_shape(
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    d_o: &TensorView,
    opts: &AttentionOptions,
) -> Result<AttentionShape> {
    let shape = AttentionShape::from_views(q, k, v)?;
    shape.check_like_q(d_o, q, "do")?;
    opts.validate()?;
    Ok(shape)
}

/// Exact gradients in f64 on the (already rounded) inputs.
pub fn backward(
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    d_o: &TensorView,
    opts: &AttentionOptions,
) -> Result<ReferenceGrads> {
    let shape = backward_shape(q, k, v, d_o, opts)?;
    let widen =
        |t: &TensorView| -> Vec<f64> { t.data.to_f32().iter().map(|&x| x as f64).collect() };
    let (q, k, v, d_o) = (widen(q), widen(k), widen(v), widen(d_o));
    let (dq, dk, dv) = RowBackward {
        shape: &shape,
        q: &q,
        k: &k,
        v: &v,
        d_o: &d_o,
        opts,
        round: |x| x,
    }
    .run();
    Ok(ReferenceGrads { dq, dk, dv })
}

/// Row-wise gradients in f32 with P and dS rounded to the storage precision
/// before the matmuls that use them and the results rounded to it: the
/// accuracy rule's baseline, and the CPU backend's backward.
fn backward_in_storage_precision(
    shape: &AttentionShape,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    d_o: &TensorView,
    opts: &AttentionOptions,
) -> [Vec<f32>; 3] {
    let prec = q.precision();
    let [q, k, v, d_o] = [q, k, v, d_o].map(|t| t.data.to_f32());
    let (dq, dk, dv) = RowBackward {
        shape,
        q: &q,
        k: &k,
        v: &v,
        d_o: &d_o,
        opts,
        round: |x| prec.round(x),
    }
    .run();
    [dq, dk, dv].map(|g| g.into_iter().map(|x| prec.round(x)).collect())
}

/// The accuracy rule's backward baseline (see [`backward_in_storage_precision`]).
pub fn naive_backward_baseline(
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    d_o: &TensorView,
    opts: &AttentionOptions,
) -> Result<ReferenceGrads> {
    let shape = backward_shape(q, k, v, d_o, opts)?;
    let [dq, dk, dv] = backward_in_storage_precision(&shape, q, k, v, d_o, opts)
        .map(|g| g.into_iter().map(f64::from).collect());
    Ok(ReferenceGrads { dq, dk, dv })
}

/// The cache after `step`'s append, by SPEC.md's rule: token `t` of sequence
/// `b` goes to page `block_table[b, t / page_size]`, slot `t % page_size`
/// (a dense cache: row `cache_batch_idx[b]`, position `t`). Validates first.
pub fn decode_cache(cache: &HostKvCache, step: &DecodeStep) -> Result<HostKvCache> {
    DecodeProblem::new(step, &cache.shape, cache.precision())?;
    let mut out = cache.clone();
    let Some([k_new, v_new]) = step.new_kv else {
        return Ok(out);
    };
    let [batch, seqlen_new, _, _] = k_new.shape;
    let row_len = cache.shape.row_len();
    for (dst, src) in [(&mut out.k, &k_new), (&mut out.v, &v_new)] {
        let mut values = dst.to_f32();
        let new = src.data.to_f32();
        for b in 0..batch {
            for t in 0..seqlen_new {
                let row = spec_row(cache, step, b, step.cache_seqlens[b] as usize + t);
                values[row * row_len..][..row_len]
                    .copy_from_slice(&new[(b * seqlen_new + t) * row_len..][..row_len]);
            }
        }
        *dst = TensorData::from_f32(values, cache.precision());
    }
    Ok(out)
}

/// Cache row of token `t` of sequence `b`, straight from SPEC.md's wording.
fn spec_row(cache: &HostKvCache, step: &DecodeStep, b: usize, t: usize) -> usize {
    let [_, inner, _, _] = cache.shape.dims();
    match step.block_table {
        Some(table) => table.pages[b * table.max_pages + t / inner] as usize * inner + t % inner,
        None => step.cache_batch_idx.map_or(b, |idx| idx[b] as usize) * inner + t,
    }
}

/// Decoding in f64 and, beside it, the naive baseline: each sequence's keys
/// (the cache after the append) attended as a batch-1 forward, so a sequence
/// with `seqlen_k[b]` keys has the offset `seqlen_k[b] − seqlen_q`.
pub fn decode(
    cache: &HostKvCache,
    step: &DecodeStep,
    opts: &AttentionOptions,
) -> Result<[ReferenceOutput; 2]> {
    opts.validate()?;
    let updated = decode_cache(cache, step)?;
    let p = DecodeProblem::new(step, &cache.shape, cache.precision())?;
    let (prec, d, row_len) = (p.precision, p.head_dim, cache.shape.row_len());
    let q = step.q.data.to_f32();
    let (kc, vc) = (updated.k.to_f32(), updated.v.to_f32());
    let per_seq = p.seqlen_q * p.heads_q;
    let mut outs = [(); 2].map(|_| ReferenceOutput {
        o: vec![0.0; p.q_len()],
        lse: vec![f64::NEG_INFINITY; p.lse_len()],
    });
    for b in 0..p.batch {
        let Some(shape) = p.sequence(b) else {
            continue; // no keys: o = 0, lse = -inf
        };
        let gather = |c: &[f32]| -> TensorData {
            let rows = (0..shape.seqlen_k).flat_map(|t| {
                let row = spec_row(cache, step, b, t);
                c[row * row_len..][..row_len].iter().copied()
            });
            TensorData::from_f32(rows.collect(), prec)
        };
        let (kb, vb) = (gather(&kc), gather(&vc));
        let qb = TensorData::from_f32(q[b * per_seq * d..][..per_seq * d].to_vec(), prec);
        let (qv, kv, vv) = (
            qb.view(shape.q_shape()),
            kb.view(shape.kv_shape()),
            vb.view(shape.kv_shape()),
        );
        let results = [
            forward(&qv, &kv, &vv, opts)?,
            naive_baseline(&qv, &kv, &vv, opts)?,
        ];
        for (out, r) in outs.iter_mut().zip(results) {
            out.o[b * per_seq * d..][..per_seq * d].copy_from_slice(&r.o);
            out.lse[b * per_seq..][..per_seq].copy_from_slice(&r.lse);
        }
    }
    Ok(outs)
}

//! The f64 reference every correctness test compares against, and the naive
//! materialized baseline (S and P stored, storage-precision rounding) that the
//! accuracy rule measures the reference's own rounding noise with. Both
//! score pairs with the pair rule (scale, softcap, ALiBi, band and block
//! masks, sinks, dropout's keep bits) over the batch's sequences (dense or
//! packed).

use crate::api::decode::{DecodeProblem, DecodeStep, HostKvCache};
use crate::api::inputs::ForwardInputs;
use crate::api::options::{AttentionOptions, Fp8Options};
use crate::api::pair_rule::PairRule;
use crate::api::scores::{Alibi, Real};
use crate::api::shape::AttentionShape;
use crate::api::tensor::{Precision, TensorData, TensorView};
use crate::api::varlen::{sequences, Sequence};
use crate::error::Result;
use crate::quant::{e4m3_from_f64, e4m3_to_f32, Fp8Layout, E4M3_MAX};
use rayon::prelude::*;

/// Output of a reference computation, in f64.
#[derive(Clone, Debug)]
pub struct ReferenceOutput {
    /// `(batch, seqlen_q, heads_q, head_dim_v)` (packed: `(total_q, heads_q, head_dim_v)`)
    pub o: Vec<f64>,
    /// `(batch, heads_q, seqlen_q)` (packed: `(heads_q, total_q)`),
    /// natural-log; `-inf` for empty rows (the sink's logit with sinks).
    pub lse: Vec<f64>,
}

/// One problem's inputs in `T`, in the flat `(rows, heads, dim)` layouts.
struct Problem<'a, T> {
    shape: AttentionShape,
    opts: &'a AttentionOptions,
    q: &'a [T],
    k: &'a [T],
    v: &'a [T],
}

impl<T: Real> Problem<'_, T> {
    fn rule(&self, seq: &Sequence, h: usize) -> PairRule<'_> {
        PairRule::new(self.opts, seq, h, [self.shape.heads_q, self.shape.head_dim])
    }

    /// Row `i` of query head `h` of `seq`: the scores of its allowed keys,
    /// `(key, score, softcap derivative)`.
    fn scores(&self, rule: &PairRule, seq: &Sequence, h: usize, i: usize) -> Vec<(usize, T, T)> {
        let s = &self.shape;
        let (d, hk) = (s.head_dim, h / s.group());
        let qrow = &self.q[((seq.q.start + i) * s.heads_q + h) * d..][..d];
        rule.keys(i)
            .filter(|&j| rule.allows(i, j))
            .map(|j| {
                let krow = &self.k[((seq.k.start + j) * s.heads_kv + hk) * d..][..d];
                let (sc, dcap) = rule.score(dot(qrow, krow), i, j);
                (j, sc, dcap)
            })
            .collect()
    }

    /// The row's softmax weights `weight(exp(s − m), l)` (`e / l` exactly,
    /// or rounded as a baseline rounds it), its LSE, and the sink's weight.
    fn softmax(
        &self,
        scores: &[(usize, T, T)],
        sink: Option<f32>,
        weight: &impl Fn(T, T) -> T,
    ) -> Softmax<T> {
        let sink = sink.map(T::from_f32);
        let start = sink.unwrap_or(T::NEG_INFINITY);
        let m = scores
            .iter()
            .fold(start, |a, &(_, x, _)| if x > a { x } else { a });
        if m <= T::NEG_INFINITY {
            return Softmax {
                p: vec![],
                lse: T::NEG_INFINITY,
                sink: T::ZERO,
            };
        }
        let e: Vec<T> = scores.iter().map(|&(_, x, _)| (x - m).exp()).collect();
        let e_sink = sink.map_or(T::ZERO, |x| (x - m).exp());
        let l = e.iter().fold(e_sink, |a, &b| a + b);
        Softmax {
            p: e.iter().map(|&x| weight(x, l)).collect(),
            lse: m + l.ln(),
            sink: e_sink / l,
        }
    }

    /// Row `i` of head `h` of `seq`: `(o row, lse)`.
    fn row(&self, seq: &Sequence, h: usize, i: usize, weight: &impl Fn(T, T) -> T) -> (Vec<T>, T) {
        let s = &self.shape;
        let (dv, hk) = (s.head_dim_v, h / s.group());
        let rule = self.rule(seq, h);
        let scores = self.scores(&rule, seq, h, i);
        let sm = self.softmax(&scores, rule.sink, weight);
        let mut o = vec![T::ZERO; dv];
        for (&(j, _, _), &p) in scores.iter().zip(&sm.p) {
            if rule.dropout.is_some_and(|d| !d.keeps(i, j)) {
                continue;
            }
            let vrow = &self.v[((seq.k.start + j) * s.heads_kv + hk) * dv..][..dv];
            for (acc, &x) in o.iter_mut().zip(vrow) {
                *acc += p * x;
            }
        }
        // Kept weights scaled by 1/(1 − p) once, on O (as flash-attention does).
        if rule.dropout.is_some() {
            let rp = self.keep_scale();
            o.iter_mut().for_each(|x| *x = *x * rp);
        }
        (o, sm.lse)
    }

    /// Dropout's `1 / (1 − p)` (1 without dropout).
    fn keep_scale(&self) -> T {
        T::from_f64(1.0 / (1.0 - self.opts.dropout.p as f64))
    }

    /// The factor pair `(i, j)` takes in P·V under dropout: `1 / (1 − p)`
    /// where kept, 0 where dropped, 1 without dropout.
    fn kept(&self, rule: &PairRule, i: usize, j: usize) -> T {
        match rule.dropout {
            Some(d) if d.keeps(i, j) => self.keep_scale(),
            Some(_) => T::ZERO,
            None => T::ONE,
        }
    }

    /// Every row, in parallel, assembled in o's and lse's layouts; `weight`
    /// makes the softmax weights, `out` rounds each output.
    fn forward(&self, weight: impl Fn(T, T) -> T + Sync, out: impl Fn(T) -> T) -> (Vec<T>, Vec<T>) {
        let s = &self.shape;
        let seqs = sequences(s, self.opts.varlen.as_ref());
        let tasks: Vec<(usize, usize, usize)> = seqs
            .iter()
            .enumerate()
            .flat_map(|(n, seq)| {
                (0..seq.len_q()).flat_map(move |i| (0..s.heads_q).map(move |h| (n, i, h)))
            })
            .collect();
        let rows: Vec<(Vec<T>, T)> = tasks
            .par_iter()
            .map(|&(n, i, h)| self.row(&seqs[n], h, i, &weight))
            .collect();
        let mut o = Vec::with_capacity(s.o_len());
        let mut lse = vec![T::NEG_INFINITY; s.lse_len()];
        // Tasks run over sequences, rows, heads: exactly o's row order.
        for (&(n, i, h), (row, l)) in tasks.iter().zip(rows) {
            o.extend(row.into_iter().map(&out));
            lse[seqs[n].lse_index(h, i)] = l;
        }
        (o, lse)
    }
}

/// A row's softmax.
struct Softmax<T> {
    /// Weights of the allowed keys, in their order.
    p: Vec<T>,
    lse: T,
    /// The sink's weight `exp(sink − lse)` (0 without).
    sink: T,
}

fn dot<T: Real>(a: &[T], b: &[T]) -> T {
    a.iter().zip(b).fold(T::ZERO, |acc, (&x, &y)| acc + x * y)
}

fn widen(t: &TensorView) -> Vec<f64> {
    t.data.to_f32().iter().map(|&x| x as f64).collect()
}

/// Exact attention forward in f64 on the (already rounded) inputs.
pub fn forward(
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    opts: &AttentionOptions,
) -> Result<ReferenceOutput> {
    let shape = AttentionShape::from_views(q, k, v)?;
    opts.validate_for(&shape)?;
    let (qf, kf, vf) = (widen(q), widen(k), widen(v));
    Ok(forward_f64(&qf, &kf, &vf, &shape, opts))
}

/// [`forward`] on f64 slices already in the standard layouts.
///
/// # Panics
///
/// Where a slice is shorter than `shape` says or `opts` does not fit
/// `shape` (unchecked here, as the reference's inner loop; [`forward`]
/// checks both and returns the typed error).
pub fn forward_f64(
    q: &[f64],
    k: &[f64],
    v: &[f64],
    shape: &AttentionShape,
    opts: &AttentionOptions,
) -> ReferenceOutput {
    let p = Problem {
        shape: *shape,
        opts,
        q,
        k,
        v,
    };
    let (o, lse) = p.forward(|e, l| e / l, |x| x);
    ReferenceOutput { o, lse }
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
    Fp8Layout::check_supported(&shape, opts)?;
    let layout = Fp8Layout::new(shape.head_dim, fp8);
    let [qd, kd, vd] = layout
        .quantize(&ForwardInputs::new(*q, *k, *v))?
        .map(|t| t.dequantize_f64());
    let round = |p: f64| e4m3_to_f32(e4m3_from_f64(p * E4M3_MAX as f64)) as f64 / E4M3_MAX as f64;
    let opts = layout.options(opts);
    let p = Problem {
        shape: layout.padded(&shape),
        opts: &opts,
        q: &qd,
        k: &kd,
        v: &vd,
    };
    let (o, lse) = p.forward(|e, l| round(e) / l, |x| x);
    Ok(ReferenceOutput {
        o: layout.trim(&o),
        lse,
    })
}

/// The naive baseline of the accuracy rule: S and P materialized per row in
/// f32, P rounded to the storage precision before `P·V`, O rounded to it at
/// the end.
pub fn naive_baseline(
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    opts: &AttentionOptions,
) -> Result<ReferenceOutput> {
    let shape = AttentionShape::from_views(q, k, v)?;
    opts.validate_for(&shape)?;
    let prec = q.precision();
    let (qf, kf, vf) = (q.data.to_f32(), k.data.to_f32(), v.data.to_f32());
    let p = Problem {
        shape,
        opts,
        q: &qf,
        k: &kf,
        v: &vf,
    };
    let (o, lse) = p.forward(|e, l| prec.round(e / l), |x| prec.round(x));
    let widen = |x: Vec<f32>| x.into_iter().map(f64::from).collect();
    Ok(ReferenceOutput {
        o: widen(o),
        lse: widen(lse),
    })
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
    /// The gradient of q.
    pub dq: Vec<f64>,
    /// The gradient of k.
    pub dk: Vec<f64>,
    /// The gradient of v.
    pub dv: Vec<f64>,
    /// `(heads_q,)`, with sinks.
    pub dsinks: Option<Vec<f64>>,
}

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

/// One task's gradients: dq of the group's rows, dk and dv of its kv head,
/// the sinks' gradients of the group's heads.
struct TaskGrads<T> {
    dq: Vec<T>,
    dk: Vec<T>,
    dv: Vec<T>,
    dsinks: Vec<T>,
}

/// The gradients `[dq, dk, dv]` and `dsinks`.
type Grads<T> = ([Vec<T>; 3], Vec<T>);

impl<T: Real, R: Fn(T) -> T + Sync> RowBackward<'_, T, R> {
    /// Row-wise attention backward by recomputation: for each query row, P
    /// from the scores, dP = dO·Vᵀ, D = Σ P·dP, dS = P·(dP - D)·softcap',
    /// dsink = −P_sink·D. Parallel over (sequence, kv head); within a task
    /// the group's heads and rows run in a fixed order, so the result is
    /// deterministic.
    pub fn run(&self) -> Grads<T> {
        let shape = self.shape;
        let seqs = sequences(shape, self.opts.varlen.as_ref());
        let tasks: Vec<(usize, usize)> = (0..seqs.len())
            .flat_map(|n| (0..shape.heads_kv).map(move |hk| (n, hk)))
            .collect();
        let results: Vec<TaskGrads<T>> = tasks
            .par_iter()
            .map(|&(n, hk)| self.task(&seqs[n], hk))
            .collect();
        let (d, dv, g) = (shape.head_dim, shape.head_dim_v, shape.group());
        let mut dq = vec![T::ZERO; shape.q_len()];
        let mut dk = vec![T::ZERO; shape.kv_len()];
        let mut dvs = vec![T::ZERO; shape.v_len()];
        let mut dsinks = vec![T::ZERO; shape.heads_q];
        for (&(n, hk), t) in tasks.iter().zip(results) {
            let seq = &seqs[n];
            for gi in 0..g {
                let h = hk * g + gi;
                dsinks[h] += t.dsinks[gi];
                for i in 0..seq.len_q() {
                    dq[((seq.q.start + i) * shape.heads_q + h) * d..][..d]
                        .copy_from_slice(&t.dq[(gi * seq.len_q() + i) * d..][..d]);
                }
            }
            for j in 0..seq.len_k() {
                let row = (seq.k.start + j) * shape.heads_kv + hk;
                dk[row * d..][..d].copy_from_slice(&t.dk[j * d..][..d]);
                dvs[row * dv..][..dv].copy_from_slice(&t.dv[j * dv..][..dv]);
            }
        }
        ([dq, dk, dvs], dsinks)
    }

    fn problem(&self) -> Problem<'_, T> {
        Problem {
            shape: *self.shape,
            opts: self.opts,
            q: self.q,
            k: self.k,
            v: self.v,
        }
    }

    /// Every row of the group of kv head `hk` of sequence `seq`.
    fn task(&self, seq: &Sequence, hk: usize) -> TaskGrads<T> {
        let s = self.shape;
        let (d, g) = (s.head_dim, s.group());
        let mut t = TaskGrads {
            dq: vec![T::ZERO; g * seq.len_q() * d],
            dk: vec![T::ZERO; seq.len_k() * d],
            dv: vec![T::ZERO; seq.len_k() * s.head_dim_v],
            dsinks: vec![T::ZERO; g],
        };
        for gi in 0..g {
            for i in 0..seq.len_q() {
                self.row(&mut t, seq, hk, gi, i);
            }
        }
        let scale = T::from_f32(self.opts.scale_for(d));
        t.dk.iter_mut().for_each(|x| *x = *x * scale);
        t
    }

    /// Row `i` of query head `hk·g + gi`: its dq, its share of dk, dv and
    /// of its head's dsink.
    fn row(&self, t: &mut TaskGrads<T>, seq: &Sequence, hk: usize, gi: usize, i: usize) {
        let s = self.shape;
        let (d, dv) = (s.head_dim, s.head_dim_v);
        let h = hk * s.group() + gi;
        let p = self.problem();
        let rule = p.rule(seq, h);
        let scores = p.scores(&rule, seq, h, i);
        if scores.is_empty() {
            return; // no key: o = 0, so D = 0 and every gradient term is 0
        }
        let sm = p.softmax(&scores, rule.sink, &|e, l| e / l);
        let at = (seq.q.start + i) * s.heads_q + h;
        let (qrow, grow) = (&self.q[at * d..][..d], &self.d_o[at * dv..][..dv]);
        let vrow = |j: usize| &self.v[((seq.k.start + j) * s.heads_kv + hk) * dv..][..dv];
        // Under dropout dP' = dO·Vᵀ ∘ keep/(1 − p), and P·V's weights are P ∘ keep/(1 − p).
        let kept: Vec<T> = scores
            .iter()
            .map(|&(j, _, _)| p.kept(&rule, i, j))
            .collect();
        let dp: Vec<T> = scores
            .iter()
            .zip(&kept)
            .map(|(&(j, _, _), &k)| dot(grow, vrow(j)) * k)
            .collect();
        let dsum = sm.p.iter().zip(&dp).fold(T::ZERO, |a, (&x, &y)| a + x * y);
        t.dsinks[gi] += T::ZERO - sm.sink * self.stored_d(&scores, &sm.p, &kept, grow, &vrow);
        let scale = T::from_f32(self.opts.scale_for(d));
        let dq_row = &mut t.dq[(gi * seq.len_q() + i) * d..][..d];
        for (c, &(j, _, dcap)) in scores.iter().enumerate() {
            let pj = (self.round)(sm.p[c]) * kept[c];
            let ds = (self.round)(sm.p[c] * (dp[c] - dsum) * dcap);
            let krow = &self.k[((seq.k.start + j) * s.heads_kv + hk) * d..][..d];
            for x in 0..d {
                dq_row[x] += ds * krow[x];
                t.dk[j * d + x] += ds * qrow[x];
            }
            for (acc, &g) in t.dv[j * dv..][..dv].iter_mut().zip(grow) {
                *acc += pj * g;
            }
        }
        dq_row.iter_mut().for_each(|x| *x = *x * scale);
    }
}

impl<T: Real, R: Fn(T) -> T + Sync> RowBackward<'_, T, R> {
    /// D = rowsum(dO ∘ O) of a row with the output as stored — P rounded
    /// before P·V and O rounded, as a materialized implementation holds
    /// them (exact where `round` is the identity, so the reference's is the
    /// exact Σ P·dP): the sinks' gradient takes D from the stored O.
    fn stored_d<'v>(
        &self,
        scores: &[(usize, T, T)],
        p: &[T],
        kept: &[T],
        grow: &[T],
        vrow: &impl Fn(usize) -> &'v [T],
    ) -> T
    where
        T: 'v,
    {
        let mut o = vec![T::ZERO; grow.len()];
        for ((&(j, _, _), &pj), &k) in scores.iter().zip(p).zip(kept) {
            let pj = (self.round)(pj) * k;
            for (acc, &x) in o.iter_mut().zip(vrow(j)) {
                *acc += pj * x;
            }
        }
        o.iter()
            .zip(grow)
            .fold(T::ZERO, |a, (&x, &g)| a + (self.round)(x) * g)
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
    shape.check_like_o(d_o, q, "do")?;
    opts.validate_for(&shape)?;
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
    let (q, k, v, d_o) = (widen(q), widen(k), widen(v), widen(d_o));
    let ([dq, dk, dv], dsinks) = RowBackward {
        shape: &shape,
        q: &q,
        k: &k,
        v: &v,
        d_o: &d_o,
        opts,
        round: |x| x,
    }
    .run();
    Ok(ReferenceGrads {
        dq,
        dk,
        dv,
        dsinks: opts.sinks.is_some().then_some(dsinks),
    })
}

/// The accuracy rule's backward baseline: row-wise gradients in f32 with P
/// and dS rounded to the storage precision before the matmuls that use
/// them, and the results rounded to it (dsinks stay f32).
pub fn naive_backward_baseline(
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    d_o: &TensorView,
    opts: &AttentionOptions,
) -> Result<ReferenceGrads> {
    let shape = backward_shape(q, k, v, d_o, opts)?;
    let prec = q.precision();
    let [qf, kf, vf, gf] = [q, k, v, d_o].map(|t| t.data.to_f32());
    let (grads, dsinks) = RowBackward {
        shape: &shape,
        q: &qf,
        k: &kf,
        v: &vf,
        d_o: &gf,
        opts,
        round: |x| prec.round(x),
    }
    .run();
    let [dq, dk, dv] = grads.map(|g| g.into_iter().map(|x| prec.round(x) as f64).collect());
    Ok(ReferenceGrads {
        dq,
        dk,
        dv,
        dsinks: opts
            .sinks
            .is_some()
            .then(|| dsinks.into_iter().map(f64::from).collect()),
    })
}

/// The cache after `step`'s append, by docs/semantics.md's rule: token `t` of sequence
/// `b` goes to page `block_table[b, t / page_size]`, slot `t % page_size`
/// (a dense cache: row `cache_batch_idx[b]`, position `t`). Validates first.
pub fn decode_cache(cache: &HostKvCache, step: &DecodeStep) -> Result<HostKvCache> {
    DecodeProblem::new(step, &cache.shape, cache.precision())?;
    let mut out = cache.clone();
    // A latent cache takes k_new alone: its V is a view of K.
    let (k_new, v_new) = match (step.new_kv, step.new_latent) {
        (Some([k, v]), _) => (k, Some(v)),
        (None, Some(k)) => (k, None),
        (None, None) => return Ok(out),
    };
    let [batch, seqlen_new, _, _] = k_new.shape;
    let s = &cache.shape;
    let mut writes = vec![(&mut out.k, k_new, s.row_len())];
    if let Some(v_new) = v_new {
        writes.push((&mut out.v, v_new, s.v_row_len()));
    }
    for (dst, src, row_len) in writes {
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

/// Cache row of token `t` of sequence `b`, straight from docs/semantics.md's wording.
fn spec_row(cache: &HostKvCache, step: &DecodeStep, b: usize, t: usize) -> usize {
    let [_, inner, _, _] = cache.shape.dims();
    match step.block_table {
        Some(table) => table.pages[b * table.max_pages + t / inner] as usize * inner + t % inner,
        None => step.cache_batch_idx.map_or(b, |idx| idx[b] as usize) * inner + t,
    }
}

/// Decoding in f64 and, beside it, the naive baseline: each sequence's keys
/// (the cache after the append) attended as a batch-1 forward, so a sequence
/// with `seqlen_k[b]` keys has the offset `seqlen_k[b] − seqlen_q` (and
/// slopes given per sequence, its own row of them).
pub fn decode(
    cache: &HostKvCache,
    step: &DecodeStep,
    opts: &AttentionOptions,
) -> Result<[ReferenceOutput; 2]> {
    let updated = decode_cache(cache, step)?;
    let p = DecodeProblem::new(step, &cache.shape, cache.precision())?;
    opts.for_decoding(p.batch, p.heads_q)?;
    let (prec, d, dv) = (p.precision, p.head_dim, p.head_dim_v);
    let q = step.q.data.to_f32();
    let (kc, vc) = (updated.k.to_f32(), updated.v.to_f32());
    let per_seq = p.seqlen_q * p.heads_q;
    let mut outs = [(); 2].map(|_| ReferenceOutput {
        o: vec![0.0; p.o_len()],
        lse: vec![f64::NEG_INFINITY; p.lse_len()],
    });
    for b in 0..p.batch {
        let Some(shape) = p.sequence(b) else {
            // No keys: o = 0, lse = -inf, or the sink's logit.
            if let Some(s) = &opts.sinks {
                for out in outs.iter_mut() {
                    for (h, &sink) in s.logits().iter().enumerate() {
                        out.lse[(b * p.heads_q + h) * p.seqlen_q..][..p.seqlen_q].fill(sink as f64);
                    }
                }
            }
            continue;
        };
        let gather = |c: &[f32], row_len: usize| -> TensorData {
            let rows = (0..shape.seqlen_k).flat_map(|t| {
                let row = spec_row(cache, step, b, t);
                c[row * row_len..][..row_len].iter().copied()
            });
            TensorData::from_f32(rows.collect(), prec)
        };
        let kb = gather(&kc, cache.shape.row_len());
        let vb = if cache.shape.latent {
            // V is the first head_dim_v columns of each head's row of K.
            let (hkv, kc) = (p.heads_kv, &kc);
            let rows = (0..shape.seqlen_k).flat_map(|t| {
                let row = spec_row(cache, step, b, t);
                (0..hkv).flat_map(move |hk| kc[(row * hkv + hk) * d..][..dv].iter().copied())
            });
            TensorData::from_f32(rows.collect(), prec)
        } else {
            gather(&vc, cache.shape.v_row_len())
        };
        let qb = TensorData::from_f32(q[b * per_seq * d..][..per_seq * d].to_vec(), prec);
        let (qv, kv, vv) = (
            qb.view(shape.q_shape()),
            kb.view(shape.kv_shape()),
            vb.view(shape.v_shape()),
        );
        let opts_b = match &opts.alibi {
            Some(a) if a.per_batch(p.heads_q) => {
                let slopes = &a.slopes()[b * p.heads_q..][..p.heads_q];
                opts.clone().alibi(Alibi::new(slopes))
            }
            _ => opts.clone(),
        };
        let results = [
            forward(&qv, &kv, &vv, &opts_b)?,
            naive_baseline(&qv, &kv, &vv, &opts_b)?,
        ];
        for (out, r) in outs.iter_mut().zip(results) {
            out.o[b * per_seq * dv..][..per_seq * dv].copy_from_slice(&r.o);
            out.lse[b * per_seq..][..per_seq].copy_from_slice(&r.lse);
        }
    }
    Ok(outs)
}

//! The f64 reference every correctness test compares against, and the naive
//! materialized baseline (S and P stored, storage-precision rounding) that the
//! accuracy rule measures the reference's own rounding noise with.

use crate::error::Result;
use crate::options::AttentionOptions;
use crate::tensor::{AttentionShape, Precision, TensorView};
use rayon::prelude::*;

/// Output of a reference computation, in f64.
#[derive(Clone, Debug)]
pub struct ReferenceOutput {
    /// `(batch, seqlen_q, heads_q, head_dim)`
    pub o: Vec<f64>,
    /// `(batch, heads_q, seqlen_q)`, natural-log; `-inf` for empty rows.
    pub lse: Vec<f64>,
}

/// Flat index helpers for the `(batch, seq, heads, dim)` layout.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Layout {
    pub seqlen: usize,
    pub heads: usize,
    pub dim: usize,
}

impl Layout {
    pub fn q(shape: &AttentionShape) -> Self {
        Self {
            seqlen: shape.seqlen_q,
            heads: shape.heads_q,
            dim: shape.head_dim,
        }
    }

    pub fn kv(shape: &AttentionShape) -> Self {
        Self {
            seqlen: shape.seqlen_k,
            heads: shape.heads_kv,
            dim: shape.head_dim,
        }
    }

    /// Offset of the first element of row `(b, s, h)`.
    #[inline]
    pub fn row(&self, b: usize, s: usize, h: usize) -> usize {
        ((b * self.seqlen + s) * self.heads + h) * self.dim
    }
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
                let vrow = &v[kl.row(b, j, hk)..][..d];
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
        out.lse[(b * hq + h) * sq + i] = lse;
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

//! The CPU backend: the same tiled online-softmax algorithm as the WGSL kernel,
//! in f32 on all cores (rayon). It is the fallback when no adapter exists.

use crate::attention::{BackwardOutput, ForwardOutput};
use crate::error::Result;
use crate::gpu::CallStats;
use crate::options::AttentionOptions;
use crate::reference::{backward_in_storage_precision, validate_backward, Layout};
use crate::tensor::{AttentionShape, Tensor, TensorData, TensorView};
use rayon::prelude::*;

/// Query rows per task.
const BR: usize = 16;
/// Keys per block of the online softmax.
const BC: usize = 64;

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
    let (qf, kf, vf) = (q.data.to_f32(), k.data.to_f32(), v.data.to_f32());
    let (ql, kl) = (Layout::q(&shape), Layout::kv(&shape));
    let d = shape.head_dim;
    let scale = opts.scale_for(d);
    let softcap = opts.softcap_value();
    let mask = opts.mask(&shape);
    let q_blocks = shape.seqlen_q.div_ceil(BR);

    let tasks: Vec<(usize, usize, usize)> = (0..shape.batch)
        .flat_map(|b| (0..shape.heads_q).flat_map(move |h| (0..q_blocks).map(move |qb| (b, h, qb))))
        .collect();
    let results: Vec<(Vec<f32>, Vec<f32>)> = tasks
        .par_iter()
        .map(|&(b, h, qb)| {
            let hk = h / shape.group();
            let rows = qb * BR..((qb + 1) * BR).min(shape.seqlen_q);
            let n = rows.len();
            let mut m = vec![f32::NEG_INFINITY; n];
            let mut l = vec![0f32; n];
            let mut acc = vec![0f32; n * d];
            // Skip, don't mask: visit only keys some row of the block may see.
            let lo = rows
                .clone()
                .map(|i| mask.key_range(i).start)
                .min()
                .unwrap_or(0);
            let hi = rows
                .clone()
                .map(|i| mask.key_range(i).end)
                .max()
                .unwrap_or(0);
            let mut s = vec![0f32; BC];
            for k0 in (lo..hi).step_by(BC) {
                let keys = k0..(k0 + BC).min(hi);
                for (r, i) in rows.clone().enumerate() {
                    let allowed = mask.key_range(i);
                    let qrow = &qf[ql.row(b, i, h)..][..d];
                    let mut block_max = f32::NEG_INFINITY;
                    for (c, j) in keys.clone().enumerate() {
                        s[c] = if allowed.contains(&j) {
                            let krow = &kf[kl.row(b, j, hk)..][..d];
                            let x = qrow.iter().zip(krow).map(|(a, b)| a * b).sum::<f32>() * scale;
                            if softcap > 0.0 {
                                softcap * (x / softcap).tanh()
                            } else {
                                x
                            }
                        } else {
                            f32::NEG_INFINITY
                        };
                        block_max = block_max.max(s[c]);
                    }
                    if block_max == f32::NEG_INFINITY {
                        continue;
                    }
                    let m_new = m[r].max(block_max);
                    let alpha = (m[r] - m_new).exp();
                    m[r] = m_new;
                    l[r] *= alpha;
                    let out = &mut acc[r * d..][..d];
                    out.iter_mut().for_each(|x| *x *= alpha);
                    for (c, j) in keys.clone().enumerate() {
                        let p = (s[c] - m_new).exp();
                        l[r] += p;
                        if p != 0.0 {
                            let p = precision.round(p);
                            let vrow = &vf[kl.row(b, j, hk)..][..d];
                            out.iter_mut().zip(vrow).for_each(|(o, x)| *o += p * x);
                        }
                    }
                }
            }
            let mut lse = vec![f32::NEG_INFINITY; n];
            for r in 0..n {
                let out = &mut acc[r * d..][..d];
                if l[r] > 0.0 {
                    out.iter_mut().for_each(|x| *x /= l[r]);
                    lse[r] = m[r] + l[r].ln();
                } else {
                    out.iter_mut().for_each(|x| *x = 0.0);
                }
            }
            (acc, lse)
        })
        .collect();

    let mut o = vec![0f32; shape.q_len()];
    let mut lse = vec![f32::NEG_INFINITY; shape.lse_len()];
    for (&(b, h, qb), (acc, l)) in tasks.iter().zip(results) {
        for (r, lr) in l.iter().enumerate() {
            let i = qb * BR + r;
            o[ql.row(b, i, h)..][..d].copy_from_slice(&acc[r * d..][..d]);
            lse[(b * shape.heads_q + h) * shape.seqlen_q + i] = *lr;
        }
    }
    Ok(ForwardOutput {
        o: Tensor {
            shape: shape.q_shape().to_vec(),
            data: TensorData::from_f32(o, precision),
        },
        lse,
        shape,
        stats: CallStats::default(),
    })
}

/// Gradients on the CPU: row-wise recomputation in f32 (P and dS rounded to
/// the storage precision before use), parallel over (batch, kv head), so the
/// result is deterministic. `o` and `lse` are validated but not needed: the
/// CPU recomputes each row's softmax exactly.
pub fn backward(
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    o: &TensorView,
    lse: &[f32],
    d_o: &TensorView,
    opts: &AttentionOptions,
) -> Result<BackwardOutput> {
    let shape = validate_backward(q, k, v, o, lse, d_o, opts)?;
    let precision = q.precision();
    let [dq, dk, dv] = backward_in_storage_precision(&shape, q, k, v, d_o, opts);
    let tensor = |shape: [usize; 4], x: Vec<f32>| Tensor {
        shape: shape.to_vec(),
        data: TensorData::from_f32(x, precision),
    };
    Ok(BackwardOutput {
        dq: tensor(shape.q_shape(), dq),
        dk: tensor(shape.kv_shape(), dk),
        dv: tensor(shape.kv_shape(), dv),
        stats: CallStats::default(),
    })
}

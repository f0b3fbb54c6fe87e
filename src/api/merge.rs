//! Exact merging of partial attention by LSE: the results of one query
//! shard over several key shards (ring attention's steps, split-KV's
//! splits) combine into the attention over all their keys.

use super::output::{CallStats, ForwardOutput};
use super::tensor::TensorData;
use crate::error::{Error, Result};

/// Merge partial outputs of the same queries over disjoint key shards, in
/// f32: `lse = log Σ exp(lse_s)`, `o = Σ exp(lse_s − lse) · o_s`. Rows
/// whose every part has `lse = −∞` (no key in any shard) give `o = 0`,
/// `lse = −∞`. Every part must have the first's o shape
/// ([`Error::ShapeMismatch`]) and hold as many o and lse elements as the
/// first's problem shape says ([`Error::DataLength`]); `o` comes back f32.
///
/// ```
/// use flashattn::{merge_partials, AttentionOptions, Cpu, ForwardInputs, TensorView};
///
/// let (q, k) = (vec![0.5f32; 8 * 16], vec![0.25f32; 8 * 16]);
/// let q = TensorView::f32([1, 8, 1, 16], &q);
/// let cpu = Cpu::new();
/// // Keys 0..4 and 4..8 of one causal sequence, attended shard by shard.
/// let mut parts = Vec::new();
/// for k0 in [0, 4] {
///     let shard = TensorView::f32([1, 4, 1, 16], &k[k0 * 16..(k0 + 4) * 16]);
///     let opts = AttentionOptions::default().causal(true).positions(0, k0);
///     parts.push(cpu.forward(&ForwardInputs::new(q, shard, shard), &opts)?);
/// }
/// let merged = merge_partials(&parts)?;
/// let all = TensorView::f32([1, 8, 1, 16], &k);
/// let whole = cpu.forward(&ForwardInputs::new(q, all, all), &AttentionOptions::default().causal(true))?;
/// for (a, b) in merged.lse.iter().zip(&whole.lse) {
///     assert!((a - b).abs() < 1e-5);
/// }
/// # Ok::<(), flashattn::Error>(())
/// ```
pub fn merge_partials(parts: &[ForwardOutput]) -> Result<ForwardOutput> {
    let first = parts.first().ok_or(Error::EmptyDim { dim: "parts" })?;
    check_parts(first, parts)?;
    let shape = first.shape;
    let (rows, heads, dv) = (shape.seqlen_q, shape.heads_q, shape.head_dim_v);
    let os: Vec<Vec<f32>> = parts.iter().map(|p| p.o.to_f32()).collect();
    let mut o = vec![0f32; os[0].len()];
    let mut lse = vec![f32::NEG_INFINITY; first.lse.len()];
    // lse is (batch, heads, rows); o is (batch, rows, heads, dv).
    for (at, out) in lse.iter_mut().enumerate() {
        let (b, h, i) = (at / (heads * rows), at / rows % heads, at % rows);
        let row = ((b * rows + i) * heads + h) * dv;
        let rows_of = parts.iter().zip(&os).map(|(p, o)| (&o[row..row + dv], p.lse[at]));
        *out = merge_rows(rows_of, &mut o[row..row + dv]);
    }
    let mut merged = ForwardOutput::new(shape, TensorData::F32(o), lse, CallStats::default());
    merged.o.shape = first.o.shape.clone();
    Ok(merged)
}

/// Every part has the first's o shape, and o and lse hold as many elements
/// as the first's problem shape says (the fields are public: a part put
/// together by hand, or received from another rank, is checked here).
fn check_parts(first: &ForwardOutput, parts: &[ForwardOutput]) -> Result<()> {
    first.shape.check()?;
    let (o_len, lse_len) = (first.shape.o_len(), first.shape.lse_len());
    for part in parts {
        if part.o.shape != first.o.shape {
            return Err(Error::ShapeMismatch {
                tensor: "a partial o",
                shape: part.o.shape.clone(),
                like: "the first partial o",
                expected: first.o.shape.clone(),
            });
        }
        for (tensor, shape, expected, actual) in [
            ("a partial o", first.shape.o_shape().to_vec(), o_len, part.o.data.len()),
            ("a partial lse", first.shape.lse_shape().to_vec(), lse_len, part.lse.len()),
        ] {
            if actual != expected {
                return Err(Error::DataLength {
                    tensor,
                    shape,
                    expected,
                    actual,
                });
            }
        }
        // A partial lse is finite or −∞ (a row that saw no key of its
        // shard); NaN or +∞ would make every weight of the row NaN.
        if let Some((index, &value)) = part
            .lse
            .iter()
            .enumerate()
            .find(|(_, l)| l.is_nan() || **l == f32::INFINITY)
        {
            return Err(Error::NonFinite {
                tensor: "a partial lse",
                index,
                value,
            });
        }
    }
    Ok(())
}

/// One row of several parts, each `(o row, lse)`, merged into `out` (f32):
/// returns the merged LSE. A row no part saw gets `out = 0` and −∞, a part
/// of NaN lse makes it NaN; one part is copied as it is (its weight is
/// exactly 1).
pub(crate) fn merge_rows<'a>(
    parts: impl Iterator<Item = (&'a [f32], f32)> + Clone,
    out: &mut [f32],
) -> f32 {
    // Unlike f32::max, a NaN wins: a part that met a NaN score (a NaN or
    // infinity in the inputs) makes the row NaN, as in torch, not empty.
    let m = parts.clone().map(|(_, l)| l).fold(f32::NEG_INFINITY, |a, b| {
        if a.is_nan() || b.is_nan() {
            f32::NAN
        } else {
            a.max(b)
        }
    });
    if m.is_nan() {
        out.fill(f32::NAN);
        return m;
    }
    out.fill(0.0);
    if m == f32::NEG_INFINITY {
        return m;
    }
    let n = out.len();
    let mut it = parts.clone();
    if let (Some((only, l)), None) = (it.next(), it.next()) {
        out.copy_from_slice(&only[..n]);
        return l;
    }
    let total = m + parts.clone().map(|(_, l)| (l - m).exp()).sum::<f32>().ln();
    for (o, l) in parts.filter(|(_, l)| *l > f32::NEG_INFINITY) {
        let w = (l - total).exp();
        out.iter_mut().zip(&o[..n]).for_each(|(y, x)| *y += w * x);
    }
    total
}

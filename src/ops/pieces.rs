//! Host side of split calls: gathering a piece's inputs from the whole
//! problem, and assembling the whole outputs from the pieces' — scattered
//! rows, LSE-weighted merges of pieces over different keys of the same rows
//! (FlashDecoding's merge), and partial gradients summed in a fixed order.

use crate::api::shape::{lse_index, AttentionShape, Layout};
use crate::api::tensor::{HostData, Precision, TensorData};
use crate::plan::Split;
use std::ops::Range;

/// The rows of `split` of a q-shaped tensor.
pub fn gather_rows(data: HostData, shape: &AttentionShape, s: &Split) -> TensorData {
    gather(data, Layout::q(shape), &s.batch, &s.rows, &s.q_heads(shape))
}

/// The keys of `split` of a k-shaped tensor.
pub fn gather_keys(data: HostData, shape: &AttentionShape, s: &Split) -> TensorData {
    gather(data, Layout::kv(shape), &s.batch, &s.keys, &s.kv_heads)
}

/// The `(batch, rows, heads)` block of a standard-layout tensor.
fn gather(
    data: HostData,
    layout: Layout,
    batch: &Range<usize>,
    rows: &Range<usize>,
    heads: &Range<usize>,
) -> TensorData {
    fn copy<T: Copy>(
        src: &[T],
        l: Layout,
        b: &Range<usize>,
        r: &Range<usize>,
        h: &Range<usize>,
    ) -> Vec<T> {
        let n = h.len() * l.dim;
        let mut out = Vec::with_capacity(b.len() * r.len() * n);
        for bi in b.clone() {
            for i in r.clone() {
                let start = l.row(bi, i, h.start);
                out.extend_from_slice(&src[start..start + n]);
            }
        }
        out
    }
    match data {
        HostData::F32(d) => TensorData::F32(copy(d, layout, batch, rows, heads)),
        HostData::F16(d) => TensorData::F16(copy(d, layout, batch, rows, heads)),
        HostData::Bf16(d) => TensorData::Bf16(copy(d, layout, batch, rows, heads)),
    }
}

/// The `(batch, heads, rows)` block of an LSE-layout array.
pub fn gather_lse(lse: &[f32], shape: &AttentionShape, s: &Split) -> Vec<f32> {
    let mut out = Vec::new();
    for b in s.batch.clone() {
        for h in s.q_heads(shape) {
            let start = lse_index(shape, b, h, 0);
            out.extend_from_slice(&lse[start + s.rows.start..start + s.rows.end]);
        }
    }
    out
}

/// Visit each row of the `(batch, rows, heads)` block of `dst` with the
/// matching chunk of the packed `src`.
fn for_block<T: Copy>(
    dst: &mut [T],
    layout: Layout,
    (batch, rows, heads): (&Range<usize>, &Range<usize>, &Range<usize>),
    src: &[T],
    mut f: impl FnMut(&mut [T], &[T]),
) {
    let n = heads.len() * layout.dim;
    let mut chunks = src.chunks_exact(n);
    for b in batch.clone() {
        for i in rows.clone() {
            if let Some(chunk) = chunks.next() {
                let start = layout.row(b, i, heads.start);
                f(&mut dst[start..start + n], chunk);
            }
        }
    }
}

/// The forward's whole outputs, assembled from pieces.
pub struct ForwardAssembly {
    shape: AttentionShape,
    /// Pieces cover different keys of the same rows: merge by LSE in f32.
    keys_split: bool,
    o_merged: Vec<f32>,
    /// Pieces cover disjoint rows: copy them exactly.
    o_exact: TensorData,
    lse: Vec<f32>,
}

impl ForwardAssembly {
    pub fn new(shape: AttentionShape, precision: Precision, pieces: &[Split]) -> Self {
        let keys_split = pieces.iter().any(|p| p.keys.len() != shape.seqlen_k);
        let n = if keys_split { shape.q_len() } else { 0 };
        Self {
            shape,
            keys_split,
            o_merged: vec![0.0; n],
            o_exact: TensorData::from_f32(
                vec![0.0; if keys_split { 0 } else { shape.q_len() }],
                precision,
            ),
            lse: vec![f32::NEG_INFINITY; shape.lse_len()],
        }
    }

    /// Fold in one piece's `o` and `lse`.
    pub fn add(&mut self, s: &Split, o: &TensorData, lse: &[f32]) {
        if self.keys_split {
            self.merge(s, &o.to_f32(), lse);
            return;
        }
        let (shape, l) = (&self.shape, Layout::q(&self.shape));
        let block = (&s.batch, &s.rows, &s.q_heads(shape));
        // Pieces run in the call's precision; convert anything else.
        let converted;
        let o = if o.precision() == self.o_exact.precision() {
            o
        } else {
            converted = TensorData::from_f32(o.to_f32(), self.o_exact.precision());
            &converted
        };
        match (&mut self.o_exact, o) {
            (TensorData::F32(dst), TensorData::F32(src)) => {
                for_block(dst, l, block, src, |d, x| d.copy_from_slice(x))
            }
            (TensorData::F16(dst), TensorData::F16(src)) => {
                for_block(dst, l, block, src, |d, x| d.copy_from_slice(x))
            }
            (TensorData::Bf16(dst), TensorData::Bf16(src)) => {
                for_block(dst, l, block, src, |d, x| d.copy_from_slice(x))
            }
            _ => {}
        }
        let local = s.shape(shape);
        for (bl, b) in s.batch.clone().enumerate() {
            for (hl, h) in s.q_heads(shape).enumerate() {
                let src = &lse[lse_index(&local, bl, hl, 0)..][..local.seqlen_q];
                let dst = lse_index(shape, b, h, s.rows.start);
                self.lse[dst..dst + local.seqlen_q].copy_from_slice(src);
            }
        }
    }

    /// Weigh the running output and the piece's by their shares of the new LSE.
    fn merge(&mut self, s: &Split, o: &[f32], lse: &[f32]) {
        let shape = &self.shape;
        let local = s.shape(shape);
        let d = shape.head_dim;
        let (ql, ll) = (Layout::q(shape), Layout::q(&local));
        for (bl, b) in s.batch.clone().enumerate() {
            for (hl, h) in s.q_heads(shape).enumerate() {
                for (il, i) in s.rows.clone().enumerate() {
                    let part = lse[lse_index(&local, bl, hl, il)];
                    let slot = lse_index(shape, b, h, i);
                    let prev = self.lse[slot];
                    let new = log_add_exp(prev, part);
                    if new == f32::NEG_INFINITY {
                        continue;
                    }
                    let (wa, wb) = ((prev - new).exp(), (part - new).exp());
                    let dst = &mut self.o_merged[ql.row(b, i, h)..][..d];
                    let src = &o[ll.row(bl, il, hl)..][..d];
                    for (x, y) in dst.iter_mut().zip(src) {
                        *x = *x * wa + *y * wb;
                    }
                    self.lse[slot] = new;
                }
            }
        }
    }

    /// `(o, lse)`, o in `precision`.
    pub fn finish(self, precision: Precision) -> (TensorData, Vec<f32>) {
        if self.keys_split {
            (TensorData::from_f32(self.o_merged, precision), self.lse)
        } else {
            (self.o_exact, self.lse)
        }
    }
}

/// `log(exp(a) + exp(b))`, `-inf` when both are.
pub fn log_add_exp(a: f32, b: f32) -> f32 {
    let m = a.max(b);
    if m == f32::NEG_INFINITY {
        return m;
    }
    m + ((a - m).exp() + (b - m).exp()).ln()
}

/// The backward's whole gradients: each piece's are partial sums (dQ over
/// its keys, dK/dV over its rows), added in piece order.
pub struct GradAssembly {
    shape: AttentionShape,
    grads: [Vec<f32>; 3],
}

impl GradAssembly {
    pub fn new(shape: AttentionShape) -> Self {
        Self {
            shape,
            grads: [shape.q_len(), shape.kv_len(), shape.kv_len()].map(|n| vec![0.0; n]),
        }
    }

    /// Add one piece's `[dq, dk, dv]`.
    pub fn add(&mut self, s: &Split, parts: &[TensorData; 3]) {
        let shape = &self.shape;
        let (ql, kl) = (Layout::q(shape), Layout::kv(shape));
        let qh = s.q_heads(shape);
        let blocks = [
            (ql, (&s.batch, &s.rows, &qh)),
            (kl, (&s.batch, &s.keys, &s.kv_heads)),
            (kl, (&s.batch, &s.keys, &s.kv_heads)),
        ];
        for ((dst, part), (layout, block)) in self.grads.iter_mut().zip(parts).zip(blocks) {
            for_block(dst, layout, block, &part.to_f32(), |d, x| {
                d.iter_mut().zip(x).for_each(|(a, b)| *a += b)
            });
        }
    }

    /// `[dq, dk, dv]` in `precision`.
    pub fn finish(self, precision: Precision) -> [TensorData; 3] {
        self.grads.map(|g| TensorData::from_f32(g, precision))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn log_add_exp_handles_empty() {
        assert_eq!(
            log_add_exp(f32::NEG_INFINITY, f32::NEG_INFINITY),
            f32::NEG_INFINITY
        );
        assert!((log_add_exp(0.0, 0.0) - 2f32.ln()).abs() < 1e-6);
    }
}

//! Host side of split calls: where each piece's rows and keys lie in the
//! whole problem, gathering a piece's inputs, and assembling the whole
//! outputs from the pieces' — copied rows, LSE-weighted merges of pieces
//! over different keys of the same rows (FlashDecoding's merge), partial
//! gradients summed in a fixed order, and the sinks' gradients.
//!
//! Rows are flat rows of the `(rows, heads, dim)` layouts a batch `(batch,
//! seqlen, heads, dim)` flattens to, so dense pieces (a batch entry's rows
//! and keys) and packed ones (a window of every sequence's rows and keys)
//! are alike: runs of flat rows, which a piece's buffers hold one after
//! another.

use crate::api::shape::{AttentionShape, Layout};
use crate::api::tensor::{HostData, Precision, TensorData};
use crate::api::varlen::Varlen;
use crate::kernels::{SeqDims, Sequences};
use crate::plan::Split;
use std::ops::Range;

/// The `lse` layout of a batch of `rows_per_batch` rows (`(batch, heads,
/// seqlen)`; a packed batch is one batch entry of all its rows).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LseLayout {
    pub rows_per_batch: usize,
    pub heads: usize,
}

impl LseLayout {
    pub fn of(shape: &AttentionShape) -> Self {
        Self {
            rows_per_batch: shape.seqlen_q.max(1),
            heads: shape.heads_q,
        }
    }

    /// Index of flat row `r`, head `h`.
    pub fn index(&self, h: usize, r: usize) -> usize {
        let n = self.rows_per_batch;
        (r / n * self.heads + h) * n + r % n
    }
}

/// Where one piece lies in the whole problem.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PieceRows {
    /// Runs of flat q (o, do, dq) rows, and of k (v, dk, dv) rows.
    pub q: Vec<Range<usize>>,
    pub k: Vec<Range<usize>>,
    pub q_heads: Range<usize>,
    pub kv_heads: Range<usize>,
    /// Whether the piece covers key 0 of its rows (it alone holds the sinks).
    pub first_keys: bool,
}

impl PieceRows {
    /// Dense piece `s` of `shape`.
    pub fn dense(shape: &AttentionShape, s: &Split) -> Self {
        let runs = |n: usize, r: &Range<usize>| {
            s.batch
                .clone()
                .map(|b| b * n + r.start..b * n + r.end)
                .collect()
        };
        Self {
            q: runs(shape.seqlen_q, &s.rows),
            k: runs(shape.seqlen_k, &s.keys),
            q_heads: s.q_heads(shape),
            kv_heads: s.kv_heads.clone(),
            first_keys: s.keys.start == 0,
        }
    }

    /// Packed piece `s` of a packed batch: the windows `s.rows` and
    /// `s.keys` (sequence-relative) of every sequence.
    pub fn packed(shape: &AttentionShape, varlen: &Varlen, s: &Split) -> Self {
        let window = |r: Range<usize>, w: &Range<usize>| {
            (r.start + w.start).min(r.end)..(r.start + w.end).min(r.end)
        };
        let (mut q, mut k) = (Vec::new(), Vec::new());
        for b in 0..varlen.batch() {
            let (rq, rk) = varlen.rows(b);
            q.push(window(rq, &s.rows));
            k.push(window(rk, &s.keys));
        }
        Self {
            q,
            k,
            q_heads: s.q_heads(shape),
            kv_heads: s.kv_heads.clone(),
            first_keys: s.keys.start == 0,
        }
    }

    /// The piece's packed sequences (each its window), their offsets those
    /// of the whole sequences.
    pub fn sequences(&self, varlen: &Varlen) -> Sequences {
        let seqs = (0..varlen.batch())
            .map(|b| {
                let (rq, rk) = varlen.rows(b);
                SeqDims {
                    b,
                    rows: self.q[b].len(),
                    keys: self.k[b].len(),
                    offset: rk.len() as i64 - rq.len() as i64,
                }
            })
            .collect();
        Sequences::packed(seqs)
    }

    /// Rows of q and of k the piece holds.
    pub fn lens(&self) -> (usize, usize) {
        let n = |runs: &[Range<usize>]| runs.iter().map(|r| r.len()).sum();
        (n(&self.q), n(&self.k))
    }

    /// The piece's rows of a q-side tensor of `layout` (q, o, do).
    pub fn gather_q(&self, data: HostData, layout: Layout) -> TensorData {
        gather(data, layout, &self.q, &self.q_heads)
    }

    /// The piece's rows of a k-side tensor of `layout` (k, v).
    pub fn gather_k(&self, data: HostData, layout: Layout) -> TensorData {
        gather(data, layout, &self.k, &self.kv_heads)
    }

    /// The piece's entries of the whole `lse`, in its own layout `local`.
    pub fn gather_lse(&self, lse: &[f32], whole: LseLayout, local: LseLayout) -> Vec<f32> {
        let (rows, _) = self.lens();
        let mut out = vec![0.0; rows * self.q_heads.len()];
        self.each_lse(whole, local, |g, l| out[l] = lse[g]);
        out
    }

    /// Visit every (whole, local) lse index pair of the piece.
    fn each_lse(&self, whole: LseLayout, local: LseLayout, mut f: impl FnMut(usize, usize)) {
        for (hl, h) in self.q_heads.clone().enumerate() {
            let mut rl = 0;
            for run in &self.q {
                for r in run.clone() {
                    f(whole.index(h, r), local.index(hl, rl));
                    rl += 1;
                }
            }
        }
    }
}

/// The flat rows `runs` of heads `heads` of a tensor of `layout`, one
/// after another.
fn gather(
    data: HostData,
    layout: Layout,
    runs: &[Range<usize>],
    heads: &Range<usize>,
) -> TensorData {
    fn copy<T: Copy>(src: &[T], l: Layout, runs: &[Range<usize>], h: &Range<usize>) -> Vec<T> {
        let n = h.len() * l.dim;
        let mut out = Vec::with_capacity(runs.iter().map(|r| r.len()).sum::<usize>() * n);
        for r in runs.iter().flat_map(|r| r.clone()) {
            let start = flat(l, r, h.start);
            out.extend_from_slice(&src[start..start + n]);
        }
        out
    }
    match data {
        HostData::F32(d) => TensorData::F32(copy(d, layout, runs, heads)),
        HostData::F16(d) => TensorData::F16(copy(d, layout, runs, heads)),
        HostData::Bf16(d) => TensorData::Bf16(copy(d, layout, runs, heads)),
    }
}

/// Offset of flat row `r`, head `h` of a tensor of `layout`.
fn flat(l: Layout, r: usize, h: usize) -> usize {
    (r * l.heads + h) * l.dim
}

/// Visit each flat row of `runs` of `dst` (heads `heads`) with the matching
/// chunk of the packed `src`.
fn for_runs<T: Copy>(
    dst: &mut [T],
    layout: Layout,
    runs: &[Range<usize>],
    heads: &Range<usize>,
    src: &[T],
    mut f: impl FnMut(&mut [T], &[T]),
) {
    let n = heads.len() * layout.dim;
    let mut chunks = src.chunks_exact(n);
    for r in runs.iter().flat_map(|r| r.clone()) {
        if let Some(chunk) = chunks.next() {
            let start = flat(layout, r, heads.start);
            f(&mut dst[start..start + n], chunk);
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
    pub fn new(shape: AttentionShape, precision: Precision, keys_split: bool) -> Self {
        let n = if keys_split { shape.o_len() } else { 0 };
        Self {
            shape,
            keys_split,
            o_merged: vec![0.0; n],
            o_exact: TensorData::from_f32(
                vec![0.0; if keys_split { 0 } else { shape.o_len() }],
                precision,
            ),
            lse: vec![f32::NEG_INFINITY; shape.lse_len()],
        }
    }

    /// Fold in one piece's `o` and `lse` (`local`: the piece's lse layout).
    pub fn add(&mut self, p: &PieceRows, o: &TensorData, lse: &[f32], local: LseLayout) {
        let whole = LseLayout::of(&self.shape);
        if self.keys_split {
            self.merge(p, &o.to_f32(), lse, local);
            return;
        }
        let l = Layout::o(&self.shape);
        let (runs, heads) = (p.q.as_slice(), &p.q_heads);
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
                for_runs(dst, l, runs, heads, src, |d, x| d.copy_from_slice(x))
            }
            (TensorData::F16(dst), TensorData::F16(src)) => {
                for_runs(dst, l, runs, heads, src, |d, x| d.copy_from_slice(x))
            }
            (TensorData::Bf16(dst), TensorData::Bf16(src)) => {
                for_runs(dst, l, runs, heads, src, |d, x| d.copy_from_slice(x))
            }
            _ => {}
        }
        let all = &mut self.lse;
        p.each_lse(whole, local, |g, l| all[g] = lse[l]);
    }

    /// Weigh the running output and the piece's by their shares of the new LSE.
    fn merge(&mut self, p: &PieceRows, o: &[f32], lse: &[f32], local: LseLayout) {
        let (whole, dv) = (LseLayout::of(&self.shape), self.shape.head_dim_v);
        let ol = Layout::o(&self.shape);
        let hl_count = p.q_heads.len();
        let mut rl = 0;
        for r in p.q.iter().flat_map(|r| r.clone()) {
            for (hl, h) in p.q_heads.clone().enumerate() {
                let part = lse[local.index(hl, rl)];
                let slot = whole.index(h, r);
                let prev = self.lse[slot];
                let new = log_add_exp(prev, part);
                if new == f32::NEG_INFINITY {
                    continue;
                }
                let (wa, wb) = ((prev - new).exp(), (part - new).exp());
                let dst = &mut self.o_merged[flat(ol, r, h)..][..dv];
                let src = &o[(rl * hl_count + hl) * dv..][..dv];
                for (x, y) in dst.iter_mut().zip(src) {
                    *x = *x * wa + *y * wb;
                }
                self.lse[slot] = new;
            }
            rl += 1;
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
/// its keys, dK/dV over its rows), added in piece order; with sinks, each
/// row's share of dsinks comes from the piece that holds its key 0.
pub struct GradAssembly {
    shape: AttentionShape,
    grads: [Vec<f32>; 3],
    dsinks: Vec<f32>,
}

impl GradAssembly {
    pub fn new(shape: AttentionShape) -> Self {
        Self {
            shape,
            grads: [shape.q_len(), shape.kv_len(), shape.v_len()].map(|n| vec![0.0; n]),
            dsinks: vec![0.0; shape.heads_q],
        }
    }

    /// Add one piece's `[dq, dk, dv]` and its dsinks (local heads).
    pub fn add(&mut self, p: &PieceRows, parts: &[TensorData; 3], dsinks: Option<&[f32]>) {
        let shape = &self.shape;
        let (ql, kl, vl) = (Layout::q(shape), Layout::kv(shape), Layout::v(shape));
        let blocks = [
            (ql, p.q.as_slice(), &p.q_heads),
            (kl, p.k.as_slice(), &p.kv_heads),
            (vl, p.k.as_slice(), &p.kv_heads),
        ];
        for ((dst, part), (layout, runs, heads)) in self.grads.iter_mut().zip(parts).zip(blocks) {
            for_runs(dst, layout, runs, heads, &part.to_f32(), |d, x| {
                d.iter_mut().zip(x).for_each(|(a, b)| *a += b)
            });
        }
        if let Some(ds) = dsinks.filter(|_| p.first_keys) {
            for (h, x) in p.q_heads.clone().zip(ds) {
                self.dsinks[h] += x;
            }
        }
    }

    /// `[dq, dk, dv]` in `precision`, and dsinks.
    pub fn finish(self, precision: Precision) -> ([TensorData; 3], Vec<f32>) {
        (
            self.grads.map(|g| TensorData::from_f32(g, precision)),
            self.dsinks,
        )
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

    #[test]
    fn lse_layouts_index_dense_and_packed_batches() {
        let dense = LseLayout {
            rows_per_batch: 5,
            heads: 3,
        };
        // (batch 1, head 2, row 4) is flat row 9.
        assert_eq!(dense.index(2, 9), (3 + 2) * 5 + 4);
        let packed = LseLayout {
            rows_per_batch: 12,
            heads: 3,
        };
        assert_eq!(packed.index(2, 9), 2 * 12 + 9);
    }

    #[test]
    fn packed_pieces_are_windows_of_every_sequence() {
        let v = Varlen::new(&[0, 5, 5, 12], &[0, 3, 9, 9]).unwrap();
        let shape = AttentionShape::new(1, 12, 9, 2, 1, 4).unwrap();
        let s = Split {
            batch: 0..1,
            kv_heads: 0..1,
            rows: 4..8,
            keys: 0..4,
        };
        let p = PieceRows::packed(&shape, &v, &s);
        assert_eq!(p.q, vec![4..5, 5..5, 9..12]);
        assert_eq!(p.k, vec![0..3, 3..7, 9..9]);
        let seqs = p.sequences(&v);
        assert_eq!(seqs.seqs[0].offset, 3 - 5);
        assert_eq!((seqs.seqs[2].rows, seqs.seqs[2].keys), (3, 0));
    }
}

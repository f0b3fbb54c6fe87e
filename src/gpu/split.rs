//! Splitting problems larger than one storage binding or dispatch: pieces over
//! (batch, kv heads, rows, keys), host gather/scatter, and the LSE merge that
//! recombines pieces over different keys of the same rows (FlashDecoding).

use crate::error::{Error, Result};
use crate::reference::Layout;
use crate::tensor::{AttentionShape, HostData, TensorData};
use std::ops::Range;

/// One piece of a split problem: batch entries, kv heads (with their query
/// heads), query rows and keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Split {
    pub batch: Range<usize>,
    pub kv_heads: Range<usize>,
    pub rows: Range<usize>,
    pub keys: Range<usize>,
}

impl Split {
    pub fn shape(&self, full: &AttentionShape) -> AttentionShape {
        AttentionShape {
            batch: self.batch.len(),
            seqlen_q: self.rows.len(),
            seqlen_k: self.keys.len(),
            heads_q: self.kv_heads.len() * full.group(),
            heads_kv: self.kv_heads.len(),
            head_dim: full.head_dim,
        }
    }

    pub fn q_heads(&self, full: &AttentionShape) -> Range<usize> {
        self.kv_heads.start * full.group()..self.kv_heads.end * full.group()
    }
}

/// Bytes of q, k/v and lse a piece of the given extents binds.
fn piece_bytes(s: &AttentionShape, elem: u64) -> [u64; 3] {
    [
        s.q_len() as u64 * elem,
        s.kv_len() as u64 * elem,
        s.lse_len() as u64 * 4,
    ]
}

/// Cut `shape` into pieces whose bindings fit in `max_binding` bytes, whose
/// batch and head grid dimensions fit in `max_groups`, and that cover at most
/// `max_seq` rows and keys (the engine lowers it on adapters that cut long
/// loops short). Whole batches and kv heads are preferred; rows and keys are
/// split only when one kv head is too big (split keys are merged by LSE, as in
/// FlashDecoding).
pub(crate) fn split(
    shape: &AttentionShape,
    elem: u64,
    max_binding: u64,
    max_groups: usize,
    max_seq: usize,
) -> Result<Vec<Split>> {
    let g = shape.group();
    let fits = |nb: usize, nh: usize, rows: usize, keys: usize| {
        let s = AttentionShape {
            batch: nb,
            seqlen_q: rows,
            seqlen_k: keys,
            heads_q: nh * g,
            heads_kv: nh,
            head_dim: shape.head_dim,
        };
        nb <= max_groups
            && nh * g <= max_groups
            && rows <= max_seq
            && keys <= max_seq
            && piece_bytes(&s, elem).iter().all(|&b| b <= max_binding)
    };
    let (b, h, sq, sk) = (shape.batch, shape.heads_kv, shape.seqlen_q, shape.seqlen_k);
    if fits(b, h, sq, sk) {
        return Ok(vec![Split {
            batch: 0..b,
            kv_heads: 0..h,
            rows: 0..sq,
            keys: 0..sk,
        }]);
    }
    let chunks = |n: usize, step: usize| {
        (0..n)
            .step_by(step.max(1))
            .map(move |s| s..(s + step).min(n))
    };
    let mut out = Vec::new();
    let heads_per = (1..=h).rev().find(|&nh| fits(1, nh, sq, sk));
    if let Some(nh) = heads_per {
        for bi in 0..b {
            for hs in chunks(h, nh) {
                out.push(Split {
                    batch: bi..bi + 1,
                    kv_heads: hs,
                    rows: 0..sq,
                    keys: 0..sk,
                });
            }
        }
        return Ok(out);
    }
    let row_bytes = (g * shape.head_dim) as u64 * elem;
    let rows_per = (max_binding / row_bytes).min(sq.min(max_seq) as u64) as usize;
    let keys_per =
        (max_binding / (shape.head_dim as u64 * elem)).min(sk.min(max_seq) as u64) as usize;
    if rows_per == 0 || keys_per == 0 || g > max_groups {
        return Err(Error::Unsupported(format!(
            "one query row of a kv-head group needs {row_bytes} bytes, more than one storage binding ({max_binding} bytes)"
        )));
    }
    for bi in 0..b {
        for hk in 0..h {
            for rows in chunks(sq, rows_per) {
                for keys in chunks(sk, keys_per) {
                    out.push(Split {
                        batch: bi..bi + 1,
                        kv_heads: hk..hk + 1,
                        rows: rows.clone(),
                        keys,
                    });
                }
            }
        }
    }
    Ok(out)
}

/// Copy the `(batch, rows, heads)` block of a standard-layout tensor.
pub fn gather<T: Copy>(
    src: &[T],
    layout: Layout,
    batch: &Range<usize>,
    rows: &Range<usize>,
    heads: &Range<usize>,
) -> Vec<T> {
    let d = layout.dim;
    let mut out = Vec::with_capacity(batch.len() * rows.len() * heads.len() * d);
    for b in batch.clone() {
        for i in rows.clone() {
            let start = layout.row(b, i, heads.start);
            out.extend_from_slice(&src[start..start + heads.len() * d]);
        }
    }
    out
}

/// Visit the rows of the `(batch, rows, heads)` block of a standard-layout
/// tensor in `dst` together with the matching chunks of the packed `src`.
fn for_block<T: Copy>(
    dst: &mut [T],
    layout: Layout,
    batch: &Range<usize>,
    rows: &Range<usize>,
    heads: &Range<usize>,
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

/// Inverse of [`gather`].
pub fn scatter<T: Copy>(
    dst: &mut [T],
    layout: Layout,
    batch: &Range<usize>,
    rows: &Range<usize>,
    heads: &Range<usize>,
    src: &[T],
) {
    for_block(dst, layout, batch, rows, heads, src, |d, s| {
        d.copy_from_slice(s)
    });
}

pub fn host_gather(
    data: HostData,
    layout: Layout,
    batch: &Range<usize>,
    rows: &Range<usize>,
    heads: &Range<usize>,
) -> TensorData {
    match data {
        HostData::F32(d) => TensorData::F32(gather(d, layout, batch, rows, heads)),
        HostData::F16(d) => TensorData::F16(gather(d, layout, batch, rows, heads)),
    }
}

/// Fold one piece's (o, lse) into the running result by LSE weights; pieces
/// over different keys of the same rows combine exactly.
pub fn merge_piece(
    shape: &AttentionShape,
    s: &Split,
    o: &[f32],
    lse: &[f32],
    o_full: &mut [f32],
    lse_full: &mut [f32],
) {
    let local = s.shape(shape);
    let d = shape.head_dim;
    let (ql, ll) = (Layout::q(shape), Layout::q(&local));
    for (bl, b) in s.batch.clone().enumerate() {
        for (hl, h) in s.q_heads(shape).enumerate() {
            for (il, i) in s.rows.clone().enumerate() {
                let part = lse[(bl * local.heads_q + hl) * local.seqlen_q + il];
                let slot = (b * shape.heads_q + h) * shape.seqlen_q + i;
                let prev = lse_full[slot];
                let new = log_add_exp(prev, part);
                if new == f32::NEG_INFINITY {
                    continue;
                }
                let (wa, wb) = ((prev - new).exp(), (part - new).exp());
                let dst = &mut o_full[ql.row(b, i, h)..][..d];
                let src = &o[ll.row(bl, il, hl)..][..d];
                for (x, y) in dst.iter_mut().zip(src) {
                    *x = *x * wa + *y * wb;
                }
                lse_full[slot] = new;
            }
        }
    }
}

fn log_add_exp(a: f32, b: f32) -> f32 {
    let m = a.max(b);
    if m == f32::NEG_INFINITY {
        return m;
    }
    m + ((a - m).exp() + (b - m).exp()).ln()
}

/// Add `src`, laid out as the `(batch, rows, heads)` block of a
/// standard-layout tensor, into `dst` (partial gradients of split pieces).
pub fn scatter_add(
    dst: &mut [f32],
    layout: Layout,
    batch: &Range<usize>,
    rows: &Range<usize>,
    heads: &Range<usize>,
    src: &[f32],
) {
    for_block(dst, layout, batch, rows, heads, src, |d, s| {
        d.iter_mut().zip(s).for_each(|(x, y)| *x += y)
    });
}

/// The `(batch, heads, rows)` block of an LSE-layout array.
pub fn gather_lse(lse: &[f32], shape: &AttentionShape, s: &Split) -> Vec<f32> {
    let mut out = Vec::new();
    for b in s.batch.clone() {
        for h in s.q_heads(shape) {
            let start = (b * shape.heads_q + h) * shape.seqlen_q;
            out.extend_from_slice(&lse[start + s.rows.start..start + s.rows.end]);
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(b: usize, sq: usize, sk: usize, hq: usize, hk: usize, d: usize) -> AttentionShape {
        AttentionShape::new(b, sq, sk, hq, hk, d).unwrap()
    }

    #[test]
    fn small_problem_is_one_piece() {
        let s = shape(2, 100, 50, 4, 2, 64);
        assert_eq!(split(&s, 4, 1 << 27, 65535, usize::MAX).unwrap().len(), 1);
    }

    #[test]
    fn sequence_cap_bounds_rows_and_keys() {
        let s = shape(2, 1000, 700, 4, 2, 64);
        let pieces = split(&s, 4, 1 << 27, 65535, 256).unwrap();
        assert!(pieces
            .iter()
            .all(|p| p.rows.len() <= 256 && p.keys.len() <= 256));
        // Every (batch, kv head) covers 4 row runs × 3 key runs.
        assert_eq!(pieces.len(), 2 * 2 * 4 * 3);
    }

    #[test]
    fn split_covers_everything_once() {
        let s = shape(2, 37, 29, 4, 2, 8);
        for cap in [4096u64, 2048, 512, 64] {
            let pieces = split(&s, 4, cap, 65535, usize::MAX).unwrap();
            let mut seen = vec![0u32; s.batch * s.heads_kv * s.seqlen_q * s.seqlen_k];
            for p in &pieces {
                let ls = p.shape(&s);
                for (bytes, _) in piece_bytes(&ls, 4).iter().zip(0..) {
                    assert!(*bytes <= cap, "{p:?} at cap {cap}");
                }
                for b in p.batch.clone() {
                    for h in p.kv_heads.clone() {
                        for i in p.rows.clone() {
                            for j in p.keys.clone() {
                                seen[((b * s.heads_kv + h) * s.seqlen_q + i) * s.seqlen_k + j] += 1;
                            }
                        }
                    }
                }
            }
            assert!(seen.iter().all(|&c| c == 1), "cap {cap}");
        }
    }

    #[test]
    fn grid_limit_splits_heads() {
        let s = shape(1, 4, 4, 8, 8, 4);
        let pieces = split(&s, 4, 1 << 20, 4, usize::MAX).unwrap();
        assert!(pieces.len() >= 2);
        assert!(pieces.iter().all(|p| p.kv_heads.len() <= 4));
    }

    #[test]
    fn log_add_exp_handles_empty() {
        assert_eq!(
            log_add_exp(f32::NEG_INFINITY, f32::NEG_INFINITY),
            f32::NEG_INFINITY
        );
        assert!((log_add_exp(0.0, 0.0) - 2f32.ln()).abs() < 1e-6);
    }
}

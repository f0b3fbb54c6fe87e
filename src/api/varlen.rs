//! Packed batches of unequal sequences (flash-attention's
//! `flash_attn_varlen_func`) and the sequences of any batch: where each
//! sequence's rows live, its mask offset and its LSE entries. Every backend
//! and the reference walk a batch through [`sequences`], so a dense batch
//! is only the case of equal lengths.
//!
//! A packed q is `(total_q, heads_q, d)`, k/v `(total_k, heads_kv, d)`;
//! sequence `b` is rows `cu_seqlens_q[b]..cu_seqlens_q[b + 1]` of q against
//! rows `cu_seqlens_k[b]..cu_seqlens_k[b + 1]` of k/v. The engine sees a
//! packed tensor as a batch of one (`[1, total, heads, d]`), whose flat
//! row-major layout it is; `lse` is `(heads_q, total_q)`, the `(1, heads_q,
//! total_q)` of that view.

use super::shape::AttentionShape;
use crate::error::{Error, Result};
use std::ops::Range;
use std::sync::Arc;

/// Validated prefix sums of a packed batch's sequence lengths.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Varlen {
    cu_q: Arc<[i32]>,
    cu_k: Arc<[i32]>,
}

impl Varlen {
    /// `cu_seqlens_q` and `cu_seqlens_k`: `batch + 1` entries each, from 0,
    /// nondecreasing (empty sequences allowed). That they end at the packed
    /// tensors' totals is checked against them ([`Varlen::check_totals`]).
    pub fn new(cu_seqlens_q: &[i32], cu_seqlens_k: &[i32]) -> Result<Self> {
        check_prefix("cu_seqlens_q", cu_seqlens_q)?;
        check_prefix("cu_seqlens_k", cu_seqlens_k)?;
        if cu_seqlens_k.len() != cu_seqlens_q.len() {
            return Err(Error::IndexLength {
                tensor: "cu_seqlens_k",
                len: cu_seqlens_k.len(),
                expected: cu_seqlens_q.len(),
            });
        }
        Ok(Self {
            cu_q: cu_seqlens_q.into(),
            cu_k: cu_seqlens_k.into(),
        })
    }

    /// Sequences in the batch.
    pub fn batch(&self) -> usize {
        self.cu_q.len() - 1
    }

    /// Cumulative query lengths, `batch + 1` entries from 0.
    pub fn cu_seqlens_q(&self) -> &[i32] {
        &self.cu_q
    }

    /// Cumulative key lengths, `batch + 1` entries from 0.
    pub fn cu_seqlens_k(&self) -> &[i32] {
        &self.cu_k
    }

    /// Rows of q and of k/v of sequence `b`.
    pub fn rows(&self, b: usize) -> (Range<usize>, Range<usize>) {
        let r = |cu: &[i32]| cu[b] as usize..cu[b + 1] as usize;
        (r(&self.cu_q), r(&self.cu_k))
    }

    /// Total rows of q and of k/v.
    pub fn totals(&self) -> (usize, usize) {
        let last = |cu: &[i32]| cu[cu.len() - 1] as usize;
        (last(&self.cu_q), last(&self.cu_k))
    }

    /// The longest sequence's rows of q and of k/v.
    pub fn max_seqlens(&self) -> (usize, usize) {
        (0..self.batch()).fold((0, 0), |(mq, mk), b| {
            let (q, k) = self.rows(b);
            (mq.max(q.len()), mk.max(k.len()))
        })
    }

    /// The packed tensors must have exactly the rows the sums end at.
    pub fn check_totals(&self, total_q: usize, total_k: usize) -> Result<()> {
        let (q, k) = self.totals();
        for (tensor, last, rows_of, total) in [
            ("cu_seqlens_q", q, "q", total_q),
            ("cu_seqlens_k", k, "k/v", total_k),
        ] {
            if last != total {
                return Err(Error::CuSeqlensTotal {
                    tensor,
                    last: last as i64,
                    rows_of,
                    total,
                });
            }
        }
        Ok(())
    }
}

/// 0 first, nondecreasing, at least two entries.
fn check_prefix(tensor: &'static str, cu: &[i32]) -> Result<()> {
    if cu.len() < 2 {
        return Err(Error::IndexLength {
            tensor,
            len: cu.len(),
            expected: 2,
        });
    }
    if cu[0] != 0 {
        return Err(Error::CuSeqlensStart {
            tensor,
            first: cu[0] as i64,
        });
    }
    match cu.windows(2).position(|w| w[1] < w[0]) {
        Some(i) => Err(Error::CuSeqlensDecrease {
            tensor,
            index: i + 1,
            value: cu[i + 1] as i64,
            previous: cu[i] as i64,
        }),
        None => Ok(()),
    }
}

/// One sequence of a batch, in the flat row spaces of its tensors: q (and
/// o, do, dq) rows `q`, k (and v, dk, dv) rows `k` of the `(rows, heads,
/// dim)` layouts that a batch `(batch, seqlen, heads, dim)` flattens to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sequence {
    /// Its index in the batch.
    pub index: usize,
    pub q: Range<usize>,
    pub k: Range<usize>,
    /// `lse` index of (head 0, row 0), and between heads.
    pub lse_start: usize,
    pub lse_head_stride: usize,
}

impl Sequence {
    pub fn len_q(&self) -> usize {
        self.q.len()
    }

    pub fn len_k(&self) -> usize {
        self.k.len()
    }

    /// Index of `lse[h, i]` of this sequence's row `i`.
    pub fn lse_index(&self, h: usize, i: usize) -> usize {
        self.lse_start + h * self.lse_head_stride + i
    }
}

/// The sequences of `shape`: its batch entries, or with `varlen` (whose
/// shape is the packed batch of one) the packed sequences.
pub fn sequences(shape: &AttentionShape, varlen: Option<&Varlen>) -> Vec<Sequence> {
    match varlen {
        None => (0..shape.batch)
            .map(|b| Sequence {
                index: b,
                q: b * shape.seqlen_q..(b + 1) * shape.seqlen_q,
                k: b * shape.seqlen_k..(b + 1) * shape.seqlen_k,
                lse_start: b * shape.heads_q * shape.seqlen_q,
                lse_head_stride: shape.seqlen_q,
            })
            .collect(),
        Some(v) => (0..v.batch())
            .map(|b| {
                let (q, k) = v.rows(b);
                Sequence {
                    index: b,
                    lse_start: q.start,
                    lse_head_stride: shape.seqlen_q,
                    q,
                    k,
                }
            })
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_sums_are_validated() {
        assert!(Varlen::new(&[0, 3, 3, 7], &[0, 2, 5, 5]).is_ok());
        assert!(matches!(
            Varlen::new(&[1, 3], &[0, 2]),
            Err(Error::CuSeqlensStart { first: 1, .. })
        ));
        assert!(matches!(
            Varlen::new(&[0, 3, 2], &[0, 2, 4]),
            Err(Error::CuSeqlensDecrease {
                index: 2,
                value: 2,
                previous: 3,
                ..
            })
        ));
        assert!(matches!(
            Varlen::new(&[0, 3], &[0, 2, 4]),
            Err(Error::IndexLength { expected: 2, .. })
        ));
        let v = Varlen::new(&[0, 3, 3, 7], &[0, 2, 5, 5]).unwrap();
        assert!(matches!(
            v.check_totals(7, 6),
            Err(Error::CuSeqlensTotal {
                last: 5,
                total: 6,
                ..
            })
        ));
        assert_eq!(v.max_seqlens(), (4, 3));
    }

    #[test]
    fn dense_batches_are_sequences_of_equal_length() {
        let shape = AttentionShape::new(2, 3, 5, 4, 2, 8).unwrap();
        let s = sequences(&shape, None);
        assert_eq!(s[1].q, 3..6);
        assert_eq!(s[1].k, 5..10);
        // lse is (batch, heads, seqlen_q).
        assert_eq!(s[1].lse_index(2, 1), (4 + 2) * 3 + 1);
        let packed = AttentionShape::new(1, 7, 5, 4, 2, 8).unwrap();
        let v = Varlen::new(&[0, 3, 3, 7], &[0, 2, 5, 5]).unwrap();
        let s = sequences(&packed, Some(&v));
        assert_eq!((s[2].q.clone(), s[2].k.clone()), (3..7, 5..5));
        // lse is (heads, total_q).
        assert_eq!(s[2].lse_index(1, 2), 7 + 3 + 2);
    }
}

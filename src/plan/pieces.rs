//! Cutting a problem into pieces: over (batch, kv heads, rows, keys), so that
//! each piece fits one storage binding, the dispatch grid, and the adapter's
//! loop limit. Pure: the host code that gathers, runs and merges pieces is
//! in `ops::pieces`.

use crate::api::shape::AttentionShape;
use crate::api::tensor::Precision;
use crate::error::{Error, Result};
use std::ops::Range;

/// What bounds one piece.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PieceLimits {
    /// Bytes per stored element.
    pub elem: u64,
    /// Largest storage binding, bytes.
    pub max_binding: u64,
    /// Most workgroups per dispatch dimension (batch and heads are grid dimensions).
    pub max_groups: usize,
    /// Most query rows one piece may cover (the loop limit of kernels that
    /// loop over rows).
    pub max_rows: usize,
    /// Most keys one piece may cover (the loop limit of kernels that loop
    /// over keys).
    pub max_keys: usize,
}

impl PieceLimits {
    /// No limit but the element size (APIs that never split).
    pub fn unbounded(precision: Precision) -> Self {
        Self {
            elem: precision.bytes() as u64,
            max_binding: u64::MAX,
            max_groups: usize::MAX,
            max_rows: usize::MAX,
            max_keys: usize::MAX,
        }
    }
}

/// One piece of a split problem: batch entries, kv heads (with their query
/// heads), query rows and keys.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Split {
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
            head_dim_v: full.head_dim_v,
        }
    }

    pub fn q_heads(&self, full: &AttentionShape) -> Range<usize> {
        self.kv_heads.start * full.group()..self.kv_heads.end * full.group()
    }
}

/// Bytes of q, k, v, o and lse a piece of the given extents binds.
fn piece_bytes(s: &AttentionShape, elem: u64) -> [u64; 5] {
    [
        s.q_len() as u64 * elem,
        s.kv_len() as u64 * elem,
        s.v_len() as u64 * elem,
        s.o_len() as u64 * elem,
        s.lse_len() as u64 * 4,
    ]
}

impl PieceLimits {
    /// Whether a piece of `nb` batch entries, `nh` kv heads (with their query
    /// heads), `rows` rows and `keys` keys of `shape` is within the limits.
    fn fits(&self, shape: &AttentionShape, nb: usize, nh: usize, rows: usize, keys: usize) -> bool {
        let g = shape.group();
        let piece = AttentionShape {
            batch: nb,
            seqlen_q: rows,
            seqlen_k: keys,
            heads_q: nh * g,
            heads_kv: nh,
            head_dim: shape.head_dim,
            head_dim_v: shape.head_dim_v,
        };
        nb <= self.max_groups
            && nh * g <= self.max_groups
            && rows <= self.max_rows
            && keys <= self.max_keys
            && piece_bytes(&piece, self.elem)
                .iter()
                .all(|&b| b <= self.max_binding)
    }
}

/// Cut `shape` into pieces within `limits`. Whole batches and kv heads are
/// preferred; rows and keys are split only when one kv head is too big or
/// too long (split keys are merged by LSE, as in FlashDecoding).
pub fn split(shape: &AttentionShape, limits: &PieceLimits) -> Result<Vec<Split>> {
    let (b, h, sq, sk) = (shape.batch, shape.heads_kv, shape.seqlen_q, shape.seqlen_k);
    if limits.fits(shape, b, h, sq, sk) {
        return Ok(vec![Split {
            batch: 0..b,
            kv_heads: 0..h,
            rows: 0..sq,
            keys: 0..sk,
        }]);
    }
    if let Some(nh) = (1..=h).rev().find(|&nh| limits.fits(shape, 1, nh, sq, sk)) {
        let pieces = (0..b).flat_map(|bi| {
            chunks(h, nh).map(move |kv_heads| Split {
                batch: bi..bi + 1,
                kv_heads,
                rows: 0..sq,
                keys: 0..sk,
            })
        });
        return Ok(pieces.collect());
    }
    by_rows_and_keys(shape, limits)
}

/// Cut a packed batch (`shape`: its batch of one; sequences of at most
/// `longest` = (rows, keys)) within `limits`: by kv heads where the whole
/// rows do not fit a binding or the grid, and into windows of every
/// sequence's rows and keys (`Split::rows` and `keys` are then
/// sequence-relative) where the longest is past the loop limit.
pub fn split_packed(
    shape: &AttentionShape,
    longest: (usize, usize),
    limits: &PieceLimits,
) -> Result<Vec<Split>> {
    let (sq, sk, h) = (shape.seqlen_q, shape.seqlen_k, shape.heads_kv);
    let whole = PieceLimits {
        max_rows: usize::MAX,
        max_keys: usize::MAX,
        ..*limits
    };
    let Some(nh) = (1..=h).rev().find(|&nh| whole.fits(shape, 1, nh, sq, sk)) else {
        let g = shape.group();
        let elem = limits.elem;
        return Err(Error::BindingTooLarge {
            what: "one kv head's group of a packed batch",
            bytes: (sq * g * shape.head_dim.max(shape.head_dim_v)) as u64 * elem,
            max: limits.max_binding,
        });
    };
    // Every sequence empty: one (empty) window.
    let windows = |n: usize, cap: usize| -> Vec<Range<usize>> {
        let w: Vec<Range<usize>> = chunks(n, cap.clamp(1, n.max(1))).collect();
        if w.is_empty() {
            std::iter::once(0..0).collect()
        } else {
            w
        }
    };
    let (rows, keys) = (
        windows(longest.0, limits.max_rows),
        windows(longest.1, limits.max_keys),
    );
    let mut out = Vec::new();
    for kv_heads in chunks(h, nh) {
        for r in &rows {
            for k in &keys {
                out.push(Split {
                    batch: 0..1,
                    kv_heads: kv_heads.clone(),
                    rows: r.clone(),
                    keys: k.clone(),
                });
            }
        }
    }
    Ok(out)
}

/// One kv head per piece, rows and keys in runs that fit.
fn by_rows_and_keys(shape: &AttentionShape, limits: &PieceLimits) -> Result<Vec<Split>> {
    let (g, elem) = (shape.group(), limits.elem);
    let d = shape.head_dim.max(shape.head_dim_v) as u64;
    if g > limits.max_groups {
        return Err(Error::GridTooLarge {
            what: "one kv head's group of query heads",
            groups: g as u64,
            max: limits.max_groups as u32,
        });
    }
    let row_bytes = g as u64 * d * elem;
    let run = |n: usize, cap: usize, bytes: u64| {
        (limits.max_binding / bytes).min(n.min(cap) as u64) as usize
    };
    let rows_per = run(shape.seqlen_q, limits.max_rows, row_bytes);
    let keys_per = run(shape.seqlen_k, limits.max_keys, d * elem);
    if rows_per == 0 || keys_per == 0 {
        return Err(Error::BindingTooLarge {
            what: "one query row of a kv-head group",
            bytes: row_bytes,
            max: limits.max_binding,
        });
    }
    let mut out = Vec::new();
    for bi in 0..shape.batch {
        for hk in 0..shape.heads_kv {
            for rows in chunks(shape.seqlen_q, rows_per) {
                for keys in chunks(shape.seqlen_k, keys_per) {
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

/// `0..n` in runs of `step`.
fn chunks(n: usize, step: usize) -> impl Iterator<Item = Range<usize>> {
    (0..n)
        .step_by(step.max(1))
        .map(move |s| s..(s + step).min(n))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shape(b: usize, sq: usize, sk: usize, hq: usize, hk: usize, d: usize) -> AttentionShape {
        AttentionShape::new(b, sq, sk, hq, hk, d).unwrap()
    }

    fn limits(
        max_binding: u64,
        max_groups: usize,
        max_rows: usize,
        max_keys: usize,
    ) -> PieceLimits {
        PieceLimits {
            elem: 4,
            max_binding,
            max_groups,
            max_rows,
            max_keys,
        }
    }

    #[test]
    fn small_problem_is_one_piece() {
        let s = shape(2, 100, 50, 4, 2, 64);
        assert_eq!(
            split(&s, &limits(1 << 27, 65535, usize::MAX, usize::MAX))
                .unwrap()
                .len(),
            1
        );
    }

    #[test]
    fn sequence_cap_bounds_rows_and_keys() {
        let s = shape(2, 1000, 700, 4, 2, 64);
        let pieces = split(&s, &limits(1 << 27, 65535, 256, 256)).unwrap();
        assert!(pieces
            .iter()
            .all(|p| p.rows.len() <= 256 && p.keys.len() <= 256));
        // Every (batch, kv head) covers 4 row runs × 3 key runs.
        assert_eq!(pieces.len(), 2 * 2 * 4 * 3);
        // Only the dimension that is capped is cut.
        let pieces = split(&s, &limits(1 << 27, 65535, usize::MAX, 256)).unwrap();
        assert!(pieces
            .iter()
            .all(|p| p.rows == (0..1000) && p.keys.len() <= 256));
        assert_eq!(pieces.len(), 2 * 2 * 3);
        let pieces = split(&s, &limits(1 << 27, 65535, 300, usize::MAX)).unwrap();
        assert!(pieces
            .iter()
            .all(|p| p.keys == (0..700) && p.rows.len() <= 300));
        assert_eq!(pieces.len(), 2 * 2 * 4);
    }

    #[test]
    fn split_covers_everything_once() {
        let s = shape(2, 37, 29, 4, 2, 8);
        for cap in [4096u64, 2048, 512, 64] {
            let pieces = split(&s, &limits(cap, 65535, usize::MAX, usize::MAX)).unwrap();
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
    fn packed_batches_split_by_heads_and_windows() {
        let s = shape(1, 1000, 800, 4, 2, 16);
        let one = split_packed(
            &s,
            (300, 200),
            &limits(1 << 27, 65535, usize::MAX, usize::MAX),
        );
        assert_eq!(one.unwrap().len(), 1);
        // The loop limit cuts windows of every sequence: 3 row × 2 key windows.
        let w = split_packed(&s, (300, 200), &limits(1 << 27, 65535, 128, 128)).unwrap();
        assert_eq!(w.len(), 3 * 2);
        assert!(w
            .iter()
            .all(|p| p.kv_heads == (0..2) && p.rows.len() <= 128));
        // A binding holding one kv head's rows: per kv head.
        let h = split_packed(
            &s,
            (300, 200),
            &limits(1000 * 2 * 16 * 4, 65535, usize::MAX, usize::MAX),
        );
        assert_eq!(h.unwrap().len(), 2);
        assert!(matches!(
            split_packed(&s, (300, 200), &limits(64, 65535, usize::MAX, usize::MAX)),
            Err(Error::BindingTooLarge { .. })
        ));
        // Every sequence empty: one piece.
        let e = shape(1, 1, 1, 4, 2, 16);
        assert_eq!(
            split_packed(&e, (0, 0), &limits(1 << 27, 65535, 8, 8))
                .unwrap()
                .len(),
            1
        );
    }

    #[test]
    fn grid_limit_splits_heads() {
        let s = shape(1, 4, 4, 8, 8, 4);
        let pieces = split(&s, &limits(1 << 20, 4, usize::MAX, usize::MAX)).unwrap();
        assert!(pieces.len() >= 2);
        assert!(pieces.iter().all(|p| p.kv_heads.len() <= 4));
    }

    #[test]
    fn impossible_pieces_are_typed_errors() {
        let s = shape(1, 8, 8, 4, 1, 64);
        assert!(matches!(
            split(&s, &limits(1 << 20, 2, usize::MAX, usize::MAX)),
            Err(Error::GridTooLarge {
                groups: 4,
                max: 2,
                ..
            })
        ));
        assert!(matches!(
            split(&s, &limits(100, 65535, usize::MAX, usize::MAX)),
            Err(Error::BindingTooLarge {
                bytes: 1024,
                max: 100,
                ..
            })
        ));
    }
}

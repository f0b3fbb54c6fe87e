//! The causal/local band every mask reduces to: key `j` is allowed for row
//! `i` iff `i + off - left <= j <= i + off + right` (bottom-right aligned,
//! `off = seqlen_k - seqlen_q`), within `0 <= j < seqlen_k`.

/// The allowed keys of each query row: `i + off - left <= j <= i + off + right`,
/// intersected with `0 <= j < seqlen_k`. Causal is `right = 0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mask {
    pub offset: i64,
    pub left: Option<i64>,
    pub right: Option<i64>,
    pub seqlen_k: i64,
}

impl Mask {
    /// The band of `seqlen_q` rows over `seqlen_k` keys with a window of
    /// `left` and `right` keys (`None`: unbounded) around each row's diagonal.
    ///
    /// A window wider than the sequences is stored clamped (left to
    /// `seqlen_k`, right to `seqlen_q`), which allows exactly the same keys:
    /// row `i`'s diagonal `i + off` lies in `[-(seqlen_q - 1), seqlen_k - 1]`,
    /// so a left side of `seqlen_k` already reaches key 0 and a right side
    /// of `seqlen_q` already passes the last key. A caller's window of any
    /// size then stays within the i64 band arithmetic and the i32 bounds
    /// the kernels read.
    pub fn new(
        seqlen_q: usize,
        seqlen_k: usize,
        left: Option<usize>,
        right: Option<usize>,
    ) -> Self {
        Self {
            offset: seqlen_k as i64 - seqlen_q as i64,
            left: left.map(|l| l.min(seqlen_k) as i64),
            right: right.map(|r| r.min(seqlen_q) as i64),
            seqlen_k: seqlen_k as i64,
        }
    }

    /// Whether any mask beyond the sequence bounds is active.
    pub fn is_active(&self) -> bool {
        self.left.is_some() || self.right.is_some()
    }

    /// Half-open range of keys row `i` may attend to (empty when `start >= end`).
    pub fn key_range(&self, i: usize) -> std::ops::Range<usize> {
        let center = i as i64 + self.offset;
        let lo = self.left.map_or(0, |l| (center - l).max(0));
        let hi = self
            .right
            .map_or(self.seqlen_k, |r| (center + r + 1).min(self.seqlen_k));
        let lo = lo.min(self.seqlen_k) as usize;
        let hi = hi.max(0) as usize;
        lo..hi.max(lo)
    }

    /// Whether row `i` may attend to key `j`.
    pub fn allows(&self, i: usize, j: usize) -> bool {
        self.key_range(i).contains(&j)
    }
}

#[cfg(test)]
mod tests {
    use super::Mask;
    use crate::api::options::{AttentionOptions, Window};

    /// An empty row (no key allowed), whatever its range's bounds.
    const EMPTY: (usize, usize) = (0, 0);

    /// One problem of the table: sizes, mask, and each row's allowed keys
    /// as a half-open range, worked out by hand from SPEC.md: key `j` is
    /// allowed for row `i` iff `i + off - left <= j <= i + off + right` and
    /// `0 <= j < seqlen_k`, with `off = seqlen_k - seqlen_q` (bottom-right
    /// alignment), causal meaning `right = 0`, and a side of -1 unbounded.
    struct Row {
        seqlen_q: usize,
        seqlen_k: usize,
        causal: bool,
        /// flash-attention's `(left, right)`; -1 is unbounded.
        window: (i64, i64),
        keys: &'static [(usize, usize)],
    }

    #[rustfmt::skip]
    const TABLE: &[Row] = &[
        // off 2: the last row sees every key, each row above one fewer.
        Row { seqlen_q: 3, seqlen_k: 5, causal: true, window: (-1, -1), keys: &[(0, 3), (0, 4), (0, 5)] },
        // off -2: rows 0 and 1 lie above the diagonal's start and see nothing.
        Row { seqlen_q: 5, seqlen_k: 3, causal: true, window: (-1, -1), keys: &[EMPTY, EMPTY, (0, 1), (0, 2), (0, 3)] },
        // off 2, window (1, 1): centers 2..5, the last one clipped at key 5.
        Row { seqlen_q: 4, seqlen_k: 6, causal: false, window: (1, 1), keys: &[(1, 4), (2, 5), (3, 6), (4, 6)] },
        // off -2, window (2, 0): centers -2..3, left side clipped at key 0.
        Row { seqlen_q: 6, seqlen_k: 4, causal: false, window: (2, 0), keys: &[EMPTY, EMPTY, (0, 1), (0, 2), (0, 3), (1, 4)] },
        // off 2, window (0, -1): each row sees its center and every key after.
        Row { seqlen_q: 3, seqlen_k: 5, causal: false, window: (0, -1), keys: &[(2, 5), (3, 5), (4, 5)] },
        // Causal with a left window of 1 on a square problem.
        Row { seqlen_q: 4, seqlen_k: 4, causal: true, window: (1, -1), keys: &[(0, 1), (0, 2), (1, 3), (2, 4)] },
        // Causal ANDed with a right window of 3: the causal side wins.
        Row { seqlen_q: 2, seqlen_k: 3, causal: true, window: (-1, 3), keys: &[(0, 2), (0, 3)] },
        // off 7, window (3, 3): centers 7 and 8, clipped at key 9.
        Row { seqlen_q: 2, seqlen_k: 9, causal: false, window: (3, 3), keys: &[(4, 9), (5, 9)] },
        // off -3, window (0, 0): only rows 3 and 4 have their own key.
        Row { seqlen_q: 5, seqlen_k: 2, causal: false, window: (0, 0), keys: &[EMPTY, EMPTY, EMPTY, (0, 1), (1, 2)] },
        // No mask: every key.
        Row { seqlen_q: 2, seqlen_k: 3, causal: false, window: (-1, -1), keys: &[(0, 3), (0, 3)] },
        // Windows wider than any sequence allow every key.
        Row { seqlen_q: 3, seqlen_k: 4, causal: false, window: (i64::MAX, i64::MAX), keys: &[(0, 4), (0, 4), (0, 4)] },
        // A decoding sequence with an empty cache: no key at all.
        Row { seqlen_q: 2, seqlen_k: 0, causal: true, window: (-1, -1), keys: &[EMPTY, EMPTY] },
    ];

    #[test]
    fn key_ranges_match_a_table_worked_out_by_hand() {
        for (n, row) in TABLE.iter().enumerate() {
            assert_eq!(row.keys.len(), row.seqlen_q, "table row {n}");
            let opts = AttentionOptions {
                causal: row.causal,
                window: Window::from_signed(row.window.0, row.window.1),
                ..Default::default()
            };
            let mask: Mask = opts.mask_for(row.seqlen_q, row.seqlen_k);
            for (i, &(start, end)) in row.keys.iter().enumerate() {
                let got = mask.key_range(i);
                let want = start..end;
                let ok = if want.is_empty() {
                    got.is_empty()
                } else {
                    got == want
                };
                assert!(
                    ok,
                    "table row {n}, query row {i}: got {got:?}, expected {want:?}"
                );
                for j in 0..row.seqlen_k + 2 {
                    assert_eq!(mask.allows(i, j), want.contains(&j), "row {n}, ({i}, {j})");
                }
            }
        }
    }
}

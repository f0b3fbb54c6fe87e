//! The causal/local band every mask reduces to: key `j` is allowed for row
//! `i` iff `i + off - left <= j <= i + off + right` (bottom-right aligned,
//! `off = seqlen_k - seqlen_q`), within `0 <= j < seqlen_k`.

/// The allowed keys of each query row: `i + off - left <= j <= i + off + right`,
/// intersected with `0 <= j < seqlen_k`. Causal is `right = 0`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mask {
    /// `seqlen_k - seqlen_q`: where the bottom-right aligned diagonal sits.
    pub offset: i64,
    /// Keys allowed before the diagonal (`None`: all).
    pub left: Option<i64>,
    /// Keys allowed after the diagonal (`None`: all).
    pub right: Option<i64>,
    /// Keys in the sequence.
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
        Self::at(seqlen_q, seqlen_k, seqlen_k as i64 - seqlen_q as i64, left, right)
    }

    /// The band with its diagonal at `offset` (row `i`'s diagonal key is
    /// `i + offset`): a shard of a longer sequence, where `offset` is
    /// `q_offset - k_offset` of the global positions.
    ///
    /// Rows' diagonals then lie in `[offset, offset + seqlen_q - 1]`: a
    /// left side of `offset + seqlen_q` already reaches key 0 from every
    /// row, and a right side of `seqlen_k - offset` passes the last key,
    /// so wider windows are stored clamped to those (at least 0).
    pub fn at(
        seqlen_q: usize,
        seqlen_k: usize,
        offset: i64,
        left: Option<usize>,
        right: Option<usize>,
    ) -> Self {
        let (sq, sk) = (seqlen_q as i64, seqlen_k as i64);
        let clamp = |w: usize, reach: i64| (w.min(i64::MAX as usize) as i64).min(reach.max(0));
        Self {
            offset,
            left: left.map(|l| clamp(l, offset + sq)),
            right: right.map(|r| clamp(r, sk - offset)),
            seqlen_k: sk,
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

//! The mask band as the kernels walk it (`visible_keys`, `visible_rows` and
//! `block_range` in common.wgsl), for the kernels' analytic storage-access
//! counts: each count visits exactly the blocks its kernel's loops visit.

use super::params::Params;

/// The band of one sequence of a dispatch; `masked` as the kernel variant.
pub struct Band<'a> {
    pub params: &'a Params,
    pub masked: bool,
    /// The sequence's diagonal offset, rows and keys (as `Seq` in common.wgsl).
    pub offset: i64,
    pub rows: i64,
    pub keys: i64,
}

impl Band<'_> {
    /// Local keys [lo, hi) that absolute rows first..=last may see.
    pub fn keys(&self, first: i64, last: i64) -> (i64, i64) {
        let p = self.params;
        let n = self.keys;
        if !self.masked {
            return (0, n);
        }
        let k0 = p.k_start as i64;
        let lo = (first + self.offset - p.window_left as i64 - k0).clamp(0, n);
        let hi = (last + self.offset + p.window_right as i64 + 1 - k0).clamp(0, n);
        (lo, hi.max(lo))
    }

    /// Local rows [lo, hi) that may see absolute keys first..=last.
    pub fn rows(&self, first: i64, last: i64) -> (i64, i64) {
        let p = self.params;
        let n = self.rows;
        if !self.masked {
            return (0, n);
        }
        let q0 = p.q_start as i64;
        let lo = (first - self.offset - p.window_right as i64 - q0).clamp(0, n);
        let hi = (last - self.offset + p.window_left as i64 + 1 - q0).clamp(0, n);
        (lo, hi.max(lo))
    }
}

/// Blocks of `b` covering [lo, hi) of `n` entries, as the kernels loop over
/// them: (start, in-range entries) of each.
pub fn blocks(lo: i64, hi: i64, b: u64, n: u64) -> impl Iterator<Item = (u64, u64)> {
    let begin = lo as u64 / b;
    let end = if hi > lo {
        (hi as u64).div_ceil(b)
    } else {
        begin
    };
    (begin..end).map(move |i| (i * b, b.min(n - i * b)))
}

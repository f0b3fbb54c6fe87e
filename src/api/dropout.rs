//! Attention dropout (flash-attention's `dropout_p`): the option, its
//! validation and the generator's inputs it fixes (key, streams,
//! threshold). The mapping from an element's global coordinates to its
//! keep bit, which every backend draws the same way (docs/dropout.md):
//!
//! The mask is never stored: each element's bit is a pure function of
//! `(seed, offset, batch, head, row, column)` through Philox4x32-10
//! ([`crate::philox`]). One call yields 128 bits, which cover 8
//! consecutive columns of a row at 16 bits each:
//!
//! - key `= [seed as u32, (seed >> 32) as u32]`;
//! - counter `= [col >> 3, row, lo(x), hi(x)]` with
//!   `x = offset + batch · heads_q + head` (64-bit, wrapping);
//! - element `e = col & 7` takes the 16 bits `out[e >> 1] >> (16 · (e & 1))`;
//! - it is kept iff those bits are `>= round(p · 65536)`.
//!
//! `batch` is the sequence's index (in a packed batch too), `head` the
//! query head, `row` and `col` the positions in the sequence (plus the
//! shard's global offsets with [`Positions`](super::options::Positions)),
//! so a packed batch draws the same mask as the padded batch it packs.
//! [`DropoutRule`](super::dropout_rule::DropoutRule) draws the bits.
//! `offset` counts (batch, head) streams, as flash-attention's Philox
//! offset does: a caller that wants a fresh mask per call advances it by
//! at least `batch · heads_q`.

use crate::error::{Error, Result};

/// Dropout of attention probabilities: keep each with probability `1 − p`
/// and scale the kept ones by `1 / (1 − p)`. `p = 0` is no dropout.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct Dropout {
    /// The probability of dropping, in `[0, 1)`.
    pub p: f32,
    /// The generator's key; required when `p > 0`.
    pub seed: Option<u64>,
    /// The first (batch, head) stream of the call (see the module docs).
    pub offset: u64,
}

impl Dropout {
    /// Dropout with probability `p` drawn from `seed`, at offset 0.
    pub fn new(p: f32, seed: u64) -> Self {
        Self {
            p,
            seed: Some(seed),
            offset: 0,
        }
    }

    /// `InvalidDropout` for `p` outside `[0, 1)` (or NaN), and
    /// `MissingDropoutSeed` for `p > 0` without a seed.
    pub fn validate(&self) -> Result<()> {
        if !(0.0..1.0).contains(&self.p) {
            return Err(Error::InvalidDropout { p: self.p });
        }
        if self.p > 0.0 && self.seed.is_none() {
            return Err(Error::MissingDropoutSeed { p: self.p });
        }
        Ok(())
    }

    /// Whether any element can be dropped (`p > 0`).
    pub fn is_active(&self) -> bool {
        self.p > 0.0
    }

    /// The 16-bit threshold: an element is kept iff its bits are at least this
    /// (`round(p · 65536)`, at most 65536, which keeps nothing).
    pub fn threshold(&self) -> u32 {
        (self.p as f64 * 65536.0).round() as u32
    }

    /// The factor kept probabilities are scaled by, `1 / (1 − p)`.
    pub fn scale(&self) -> f32 {
        (1.0 / (1.0 - self.p as f64)) as f32
    }

    /// The Philox key of the seed.
    pub fn key(&self) -> [u32; 2] {
        let seed = self.seed.unwrap_or(0);
        [seed as u32, (seed >> 32) as u32]
    }

    /// The stream words (counter words 2 and 3) of sequence `batch`, query
    /// head `head` of `heads_q`.
    pub fn stream(&self, batch: usize, head: usize, heads_q: usize) -> [u32; 2] {
        let x = self
            .offset
            .wrapping_add((batch as u64).wrapping_mul(heads_q as u64))
            .wrapping_add(head as u64);
        [x as u32, (x >> 32) as u32]
    }
}

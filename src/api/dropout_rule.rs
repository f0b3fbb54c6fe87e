//! Dropout's keep bits: [`DropoutRule`], the bits of one (sequence, query
//! head) as the reference, the naive baseline and the CPU backend ask for
//! them, and [`dropout_mask`], a whole problem's mask for debugging. The
//! mapping is documented in [`super::dropout`] and docs/dropout.md.

use super::options::AttentionOptions;
use super::shape::AttentionShape;
use super::varlen::sequences;
use crate::error::Result;
use crate::philox::{philox4x32_10, philox4x32_10_lanes};
use std::ops::Range;

/// One (sequence, query head)'s keep bits: what the reference, the naive
/// baseline and the CPU backend ask for each pair.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DropoutRule {
    key: [u32; 2],
    stream: [u32; 2],
    threshold: u32,
    /// `1 / (1 − p)`.
    scale: f32,
    /// The global position of the sequence's row 0 and key 0.
    origin: (usize, usize),
}

/// Groups of 8 columns drawn per vectorized step of [`DropoutRule::keep_row`].
const LANES: usize = 8;

impl DropoutRule {
    /// The rule of sequence `batch`, query head `head` under `opts`
    /// (validated); `None` without dropout.
    pub fn new(opts: &AttentionOptions, batch: usize, head: usize, heads_q: usize) -> Option<Self> {
        let d = opts.dropout;
        d.is_active().then(|| Self {
            key: d.key(),
            stream: d.stream(batch, head, heads_q),
            threshold: d.threshold(),
            scale: d.scale(),
            origin: opts.positions.map_or((0, 0), |p| (p.q_offset, p.k_offset)),
        })
    }

    /// The factor kept probabilities take, `1 / (1 − p)` in f32.
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// Whether pair `(i, j)` of the sequence (its own positions) is kept.
    pub fn keeps(&self, i: usize, j: usize) -> bool {
        let (row, col) = (self.origin.0 + i, self.origin.1 + j);
        let out = philox4x32_10(self.counter(row, col >> 3), self.key);
        let e = col & 7;
        ((out[e >> 1] >> (16 * (e & 1))) & 0xffff) >= self.threshold
    }

    fn counter(&self, row: usize, group: usize) -> [u32; 4] {
        [group as u32, row as u32, self.stream[0], self.stream[1]]
    }

    /// The keep bits of row `i` over `keys` into `keep[..keys.len()]`,
    /// [`LANES`] Philox calls at a time (vectorized by the compiler).
    #[inline(always)]
    pub fn keep_row(&self, i: usize, keys: &Range<usize>, keep: &mut [bool]) {
        if keys.is_empty() {
            return;
        }
        let row = self.origin.0 + i;
        let (first, last) = (self.origin.1 + keys.start, self.origin.1 + keys.end);
        let groups = (first >> 3)..((last - 1) >> 3) + 1;
        let mut g0 = groups.start;
        while g0 < groups.end {
            let c = [
                std::array::from_fn(|l| (g0 + l) as u32),
                [row as u32; LANES],
                [self.stream[0]; LANES],
                [self.stream[1]; LANES],
            ];
            let out = philox4x32_10_lanes(c, self.key);
            // Every bit of the step without branches, then the part in `keys`.
            let mut bits = [false; 8 * LANES];
            for (l, group) in bits.chunks_exact_mut(8).enumerate() {
                for (e, b) in group.iter_mut().enumerate() {
                    *b = ((out[e >> 1][l] >> (16 * (e & 1))) & 0xffff) >= self.threshold;
                }
            }
            let (lo, hi) = ((g0 * 8).max(first), ((g0 + LANES) * 8).min(last));
            keep[lo - first..hi - first].copy_from_slice(&bits[lo - g0 * 8..hi - g0 * 8]);
            g0 += LANES;
        }
    }
}

/// The dropout mask of a problem as bool `(batch, heads_q, seqlen_q,
/// seqlen_k)`, true where kept: the keep bit of every pair whether or not
/// the attention masks allow it (for a packed batch: one entry per
/// sequence, its longest lengths, false past a sequence's own). All true
/// without dropout. For debugging small problems: its size is checked
/// like a tensor's.
pub fn dropout_mask(shape: &AttentionShape, opts: &AttentionOptions) -> Result<DropoutMask> {
    // The shape may have been built field by field.
    shape.check()?;
    opts.validate_for(shape)?;
    let (sq, sk) = opts
        .varlen
        .as_ref()
        .map_or((shape.seqlen_q, shape.seqlen_k), |v| v.max_seqlens());
    // Sized before anything is allocated (the sequences' list included).
    let dims = [opts.batch_of(shape), shape.heads_q, sq, sk];
    let n = super::size::elements("the dropout mask", &dims)?;
    let mut keep = Vec::new();
    keep.try_reserve_exact(n)
        .map_err(|_| crate::Error::HostMemory {
            what: "the dropout mask",
            bytes: n as u64,
        })?;
    keep.resize(n, false);
    let seqs = sequences(shape, opts.varlen.as_ref());
    for seq in &seqs {
        for h in 0..shape.heads_q {
            let rule = DropoutRule::new(opts, seq.index, h, shape.heads_q);
            for i in 0..seq.len_q() {
                let at = ((seq.index * shape.heads_q + h) * sq + i) * sk;
                let row = &mut keep[at..][..seq.len_k()];
                match &rule {
                    Some(r) => r.keep_row(i, &(0..seq.len_k()), row),
                    None => row.fill(true),
                }
            }
        }
    }
    Ok(DropoutMask { dims, keep })
}

/// A dropout mask, as [`dropout_mask`] returns it.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct DropoutMask {
    /// `(batch, heads_q, seqlen_q, seqlen_k)`.
    pub dims: [usize; 4],
    /// Row-major, true where kept.
    pub keep: Vec<bool>,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::dropout::Dropout;

    /// A packed batch of 2^14 sequences, one of 2^14 tokens: its mask holds
    /// 2^42 entries (4 TiB), within the element limit but no host's
    /// memory on most, and 2^14 × 2^14 × 2^14 × 2^6 (2^48) on any: a typed
    /// error, not an abort.
    #[cfg(target_pointer_width = "64")]
    #[test]
    fn a_mask_no_host_can_hold_is_an_error() {
        let n = 1usize << 14;
        let mut cu = vec![n as i32; n + 1];
        cu[0] = 0;
        let shape = AttentionShape::new(1, n, n, 64, 64, 1).unwrap();
        let mut opts = AttentionOptions::default().dropout(0.1).dropout_seed(1);
        opts.varlen = Some(crate::Varlen::new(&cu, &cu).unwrap());
        let e = dropout_mask(&shape, &opts).unwrap_err();
        assert!(
            matches!(e, crate::Error::HostMemory { bytes, .. } if bytes == 1 << 48),
            "{e:?}"
        );
    }

    fn rule(p: f32, seed: u64) -> DropoutRule {
        let opts = AttentionOptions::default().dropout(p).dropout_seed(seed);
        DropoutRule::new(&opts, 1, 2, 4).unwrap()
    }

    #[test]
    fn the_vectorized_row_matches_pair_by_pair() {
        let r = rule(0.3, 0xdead_beef_0123_4567);
        for keys in [0..1, 3..4, 5..13, 0..64, 7..200, 61..131] {
            let mut keep = vec![false; keys.len()];
            r.keep_row(9, &keys, &mut keep);
            for (c, j) in keys.clone().enumerate() {
                assert_eq!(keep[c], r.keeps(9, j), "keys {keys:?}, key {j}");
            }
        }
    }

    #[test]
    fn the_mapping_is_the_documented_one() {
        // Pair (5, 19) of sequence 1, head 2 of 4, offset 3: stream 3 + 6,
        // column group 2, element 3 = the high half of word 1.
        let opts = AttentionOptions::default()
            .dropout(0.5)
            .dropout_seed(0x0000_0007_0000_0009)
            .dropout_offset(3);
        let r = DropoutRule::new(&opts, 1, 2, 4).unwrap();
        let out = philox4x32_10([2, 5, 9, 0], [9, 7]);
        assert_eq!(r.keeps(5, 19), (out[1] >> 16) >= 32768);
        assert_eq!(opts.dropout.threshold(), 32768);
    }

    #[test]
    fn thresholds_round_p_to_16_bits() {
        let t = |p: f32| Dropout::new(p, 1).threshold();
        assert_eq!((t(0.0), t(0.1), t(0.5)), (0, 6554, 32768));
        assert_eq!(t(0.999_999_9), 65536); // nothing kept
        assert!(!rule(0.999_999_9, 3).keeps(0, 0));
    }
}

//! Attention options (scale, softcap, masks, ALiBi, sinks, block-sparse
//! masks, packed batches) and the band arithmetic every backend shares.

pub use super::band::Mask;
use super::block_mask::BlockMask;
use super::dropout::Dropout;
use super::scores::{Alibi, Sinks};
use super::shape::AttentionShape;
use super::varlen::Varlen;
use crate::error::{Error, Result};

/// A local attention window `(left, right)` around the bottom-right-aligned diagonal.
/// `None` on a side means unbounded, like `-1` in flash-attention.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Window {
    /// Keys allowed left of (before) the diagonal; `None`: all.
    pub left: Option<usize>,
    /// Keys allowed right of (after) the diagonal; `None`: all.
    pub right: Option<usize>,
}

impl Window {
    /// A window of `left` keys before and `right` keys after the diagonal
    /// (`None`: unbounded on that side).
    pub fn new(left: Option<usize>, right: Option<usize>) -> Self {
        Self { left, right }
    }

    /// Build from flash-attention's convention, where a negative value is
    /// unbounded (a side past `usize::MAX`, on a 32-bit target, is kept as
    /// `usize::MAX`: wider than any sequence, it allows the same keys).
    pub fn from_signed(left: i64, right: i64) -> Self {
        let side = |x: i64| (x >= 0).then(|| usize::try_from(x).unwrap_or(usize::MAX));
        Self {
            left: side(left),
            right: side(right),
        }
    }

    /// Whether neither side is bounded (no window).
    pub fn is_unbounded(&self) -> bool {
        self.left.is_none() && self.right.is_none()
    }
}

/// Where a shard of a longer sequence sits: the global positions of q's
/// first row and of k's first key. Ring attention's partial calls attend a
/// shard of queries to a shard of keys with the masks and ALiBi of the
/// whole sequence: row `i` is global row `q_offset + i`, key `j` global key
/// `k_offset + j`, and the band's diagonal (bottom-right aligned over the
/// whole sequence, whose q and k have one length) is at `i + q_offset −
/// k_offset`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Positions {
    /// Global position of q's first row.
    pub q_offset: usize,
    /// Global position of k's first key.
    pub k_offset: usize,
}

impl Positions {
    /// The largest offset taken (the kernels keep positions in 32-bit integers).
    pub const MAX: usize = 1 << 29;

    /// A shard whose q starts at global row `q_offset` and k at `k_offset`.
    pub fn new(q_offset: usize, k_offset: usize) -> Self {
        Self { q_offset, k_offset }
    }

    /// Where the band's diagonal sits: `q_offset − k_offset`.
    pub fn diagonal(&self) -> i64 {
        self.q_offset as i64 - self.k_offset as i64
    }
}

/// What to compute besides plain softmax attention. Cheap to clone: the
/// per-head and per-block inputs are shared. Build from the default with
/// the setters:
///
/// ```
/// use flashattn::AttentionOptions;
///
/// let opts = AttentionOptions::default().causal(true).window(Some(128), None).softcap(30.0);
/// assert!(opts.validate().is_ok());
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct AttentionOptions {
    /// Bottom-right aligned causal mask.
    pub causal: bool,
    /// Local window; combined with `causal` by AND.
    pub window: Window,
    /// Soft-capping `C · tanh(s / C)` when `Some(C)` with `C > 0`.
    pub softcap: Option<f32>,
    /// Score scale; `None` means `1 / sqrt(head_dim)`.
    pub scale: Option<f32>,
    /// ALiBi slopes, `(heads_q,)` or `(batch, heads_q)`.
    pub alibi: Option<Alibi>,
    /// Attention sinks, one logit per query head.
    pub sinks: Option<Sinks>,
    /// A block-sparse mask, ANDed with the others.
    pub block_mask: Option<BlockMask>,
    /// A packed batch of sequences of their own lengths: q, k, v are then
    /// `(total, heads, d)`, passed as views of batch 1.
    pub varlen: Option<Varlen>,
    /// A shard of a longer sequence: masks and ALiBi at global positions
    /// (`None`: q and k are whole, the band bottom-right aligned).
    pub positions: Option<Positions>,
    /// Dropout of the attention probabilities (`p = 0`: none).
    pub dropout: Dropout,
}

impl AttentionOptions {
    /// Set the bottom-right aligned causal mask.
    pub fn causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    /// Set the local window: `left` keys before the diagonal, `right` after (`None`: unbounded).
    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.window = Window { left, right };
        self
    }

    /// Softcap scores at `cap` (`C · tanh(s / C)`).
    pub fn softcap(mut self, cap: f32) -> Self {
        self.softcap = Some(cap);
        self
    }

    /// Scale scores by `scale` instead of `1 / sqrt(head_dim)`.
    pub fn scale(mut self, scale: f32) -> Self {
        self.scale = Some(scale);
        self
    }

    /// Add ALiBi biases.
    pub fn alibi(mut self, alibi: Alibi) -> Self {
        self.alibi = Some(alibi);
        self
    }

    /// Add attention sinks.
    pub fn sinks(mut self, sinks: Sinks) -> Self {
        self.sinks = Some(sinks);
        self
    }

    /// AND a block-sparse mask with the others.
    pub fn block_mask(mut self, mask: BlockMask) -> Self {
        self.block_mask = Some(mask);
        self
    }

    /// Treat q, k, v as a packed batch of sequences.
    pub fn varlen(mut self, varlen: Varlen) -> Self {
        self.varlen = Some(varlen);
        self
    }

    /// Treat q and k as shards of a longer sequence starting at global
    /// positions `q_offset` and `k_offset` (a partial call of ring attention).
    pub fn positions(mut self, q_offset: usize, k_offset: usize) -> Self {
        self.positions = Some(Positions::new(q_offset, k_offset));
        self
    }

    /// Drop attention probabilities with probability `p` (kept ones scaled
    /// by `1 / (1 − p)`); `p > 0` needs [`dropout_seed`](Self::dropout_seed).
    pub fn dropout(mut self, p: f32) -> Self {
        self.dropout.p = p;
        self
    }

    /// The seed dropout's mask is drawn from.
    pub fn dropout_seed(mut self, seed: u64) -> Self {
        self.dropout.seed = Some(seed);
        self
    }

    /// The first (batch, head) stream of dropout's generator (flash-attention's
    /// Philox offset; docs/dropout.md).
    pub fn dropout_offset(mut self, offset: u64) -> Self {
        self.dropout.offset = offset;
        self
    }

    /// For paths without dropout kernels: `Unsupported` when dropout is on.
    pub fn no_dropout(&self, what: &'static str) -> Result<()> {
        refuse(what, [(self.dropout.is_active(), "dropout")])
    }

    /// Reject non-finite scales and softcaps, and dropout outside `[0, 1)`
    /// or without a seed, before any work is done.
    pub fn validate(&self) -> Result<()> {
        self.dropout.validate()?;
        if let Some(scale) = self.scale.filter(|s| !s.is_finite()) {
            return Err(Error::NonFiniteScale { scale });
        }
        if let Some(softcap) = self.softcap.filter(|c| !c.is_finite() || *c < 0.0) {
            return Err(Error::InvalidSoftcap { softcap });
        }
        Ok(())
    }

    /// [`AttentionOptions::validate`], and every per-head, per-block and
    /// per-sequence input against the problem's shape (for a packed batch,
    /// the shape of its batch-of-one view).
    pub fn validate_for(&self, shape: &AttentionShape) -> Result<()> {
        self.validate()?;
        let (batch, seqlens) = match &self.varlen {
            Some(v) => {
                if shape.batch != 1 {
                    return Err(Error::PackedBatch {
                        tensor: "q",
                        batch: shape.batch,
                    });
                }
                v.check_totals(shape.seqlen_q, shape.seqlen_k)?;
                (v.batch(), v.max_seqlens())
            }
            None => (shape.batch, (shape.seqlen_q, shape.seqlen_k)),
        };
        self.validate_score_terms(batch, shape.heads_q)?;
        if let Some(m) = &self.block_mask {
            m.validate_for(batch, shape.heads_q, seqlens)?;
        }
        if let Some(p) = &self.positions {
            for (which, position) in [("q_offset", p.q_offset), ("k_offset", p.k_offset)] {
                if position > Positions::MAX {
                    return Err(Error::PositionTooLarge {
                        which,
                        position,
                        max: Positions::MAX,
                    });
                }
            }
            // A sink joins every shard's softmax (a merge would count it
            // once per shard); block masks and packed batches index the
            // shard, not the sequence.
            refuse(
                "shard positions",
                [
                    (self.varlen.is_some(), "packed (varlen) batches"),
                    (self.sinks.is_some(), "attention sinks"),
                    (self.block_mask.is_some(), "block-sparse masks"),
                ],
            )?;
        }
        Ok(())
    }

    /// ALiBi's slopes and the sinks against `batch` sequences of `heads_q`
    /// query heads.
    fn validate_score_terms(&self, batch: usize, heads_q: usize) -> Result<()> {
        if let Some(a) = &self.alibi {
            a.validate_for(batch, heads_q)?;
        }
        if let Some(s) = &self.sinks {
            s.validate_for(heads_q)?;
        }
        Ok(())
    }

    /// The options of a decoding step of `batch` sequences and `heads_q`
    /// query heads: [`validate`](Self::validate), slopes and sinks checked
    /// against the step, and `Unsupported` for what indexes a call's own
    /// sequences rather than the cache's (packed batches, block masks,
    /// shard positions) and for dropout (inference only).
    pub fn for_decoding(&self, batch: usize, heads_q: usize) -> Result<()> {
        self.validate()?;
        self.whole_sequences("decoding")?;
        refuse(
            "decoding",
            [
                (self.varlen.is_some(), "packed (varlen) batches"),
                (self.block_mask.is_some(), "block-sparse masks"),
                (self.dropout.is_active(), "dropout"),
            ],
        )?;
        self.validate_score_terms(batch, heads_q)
    }

    /// For calls on whole sequences only (decoding): `Unsupported` with
    /// shard positions.
    pub fn whole_sequences(&self, what: &'static str) -> Result<()> {
        refuse(what, [(self.positions.is_some(), "shard positions")])
    }

    /// For paths that take the band and score options only (the naive
    /// baseline, the FP8 forward): `Unsupported` naming the first layout
    /// given. Dropout is not a layout: see [`AttentionOptions::no_dropout`].
    pub fn band_only(&self, what: &'static str) -> Result<()> {
        refuse(
            what,
            [
                (self.varlen.is_some(), "packed (varlen) batches"),
                (self.alibi.is_some(), "ALiBi"),
                (self.sinks.is_some(), "attention sinks"),
                (self.block_mask.is_some(), "block-sparse masks"),
            ],
        )
    }

    /// Sequences in the batch: the packed ones, or the batch entries.
    pub fn batch_of(&self, shape: &AttentionShape) -> usize {
        self.varlen.as_ref().map_or(shape.batch, |v| v.batch())
    }

    /// Whether any mask (band or block) can exclude keys.
    pub fn masks_any(&self, shape: &AttentionShape) -> bool {
        self.mask(shape).is_active() || self.block_mask.is_some()
    }

    /// The scale actually used for a head dimension.
    pub fn scale_for(&self, head_dim: usize) -> f32 {
        self.scale
            .unwrap_or_else(|| (1.0 / (head_dim as f64).sqrt()) as f32)
    }

    /// The softcap actually used (`0` = off).
    pub fn softcap_value(&self) -> f32 {
        self.softcap.filter(|c| *c > 0.0).unwrap_or(0.0)
    }

    /// The mask reduced to one band `lo(i) <= j <= hi(i)` for the given shape.
    pub fn mask(&self, shape: &AttentionShape) -> Mask {
        self.mask_for(shape.seqlen_q, shape.seqlen_k)
    }

    /// The band for `seqlen_q` rows over `seqlen_k` keys (which may be 0,
    /// as a decoding sequence with an empty cache has).
    pub fn mask_for(&self, seqlen_q: usize, seqlen_k: usize) -> Mask {
        // Causal is a window whose right side is 0 (ANDed with any other right bound).
        let right = if self.causal {
            Some(0)
        } else {
            self.window.right
        };
        let offset = self
            .positions
            .map_or(seqlen_k as i64 - seqlen_q as i64, |p| p.diagonal());
        Mask::at(seqlen_q, seqlen_k, offset, self.window.left, right)
    }
}

/// FP8 (e4m3) forward options (docs/semantics.md): whether q and k go through
/// incoherent processing before they are quantized.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct Fp8Options {
    /// The seed of the random ±1 signs of the Walsh–Hadamard transform
    /// applied to q and k along the head dim (`--hadamard`); `None`: none.
    pub hadamard: Option<u64>,
}

impl Fp8Options {
    /// The seed `--hadamard` uses unless told otherwise.
    pub const DEFAULT_SEED: u64 = 0x4ada_3a2d;

    /// Incoherent processing with the signs of `seed`.
    pub const fn hadamard(seed: u64) -> Self {
        Self {
            hadamard: Some(seed),
        }
    }
}

/// `Unsupported { what, feature }` for the first feature given, in order.
fn refuse<const N: usize>(what: &'static str, features: [(bool, &'static str); N]) -> Result<()> {
    match features.into_iter().find(|(on, _)| *on) {
        Some((_, feature)) => Err(Error::Unsupported { what, feature }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod band_rule {
    use super::{AttentionOptions, Mask, Window};

    /// An empty row (no key allowed), whatever its range's bounds.
    const EMPTY: (usize, usize) = (0, 0);

    /// One problem of the table: sizes, mask, and each row's allowed keys
    /// as a half-open range, worked out by hand from docs/semantics.md: key `j` is
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

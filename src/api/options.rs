//! Attention options (scale, softcap, masks, ALiBi, sinks, block-sparse
//! masks, packed batches) and the band arithmetic every backend shares.

pub use super::band::Mask;
use super::block_mask::BlockMask;
use super::scores::{Alibi, Sinks};
use super::shape::AttentionShape;
use super::varlen::Varlen;
use crate::error::{Error, Result};

/// A local attention window `(left, right)` around the bottom-right-aligned diagonal.
/// `None` on a side means unbounded, like `-1` in flash-attention.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Window {
    pub left: Option<usize>,
    pub right: Option<usize>,
}

impl Window {
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

    pub fn is_unbounded(&self) -> bool {
        self.left.is_none() && self.right.is_none()
    }
}

/// What to compute besides plain softmax attention. Cheap to clone: the
/// per-head and per-block inputs are shared.
#[derive(Clone, Debug, Default, PartialEq)]
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
}

impl AttentionOptions {
    pub fn causal(mut self, causal: bool) -> Self {
        self.causal = causal;
        self
    }

    pub fn window(mut self, left: Option<usize>, right: Option<usize>) -> Self {
        self.window = Window { left, right };
        self
    }

    pub fn softcap(mut self, cap: f32) -> Self {
        self.softcap = Some(cap);
        self
    }

    pub fn scale(mut self, scale: f32) -> Self {
        self.scale = Some(scale);
        self
    }

    pub fn alibi(mut self, alibi: Alibi) -> Self {
        self.alibi = Some(alibi);
        self
    }

    pub fn sinks(mut self, sinks: Sinks) -> Self {
        self.sinks = Some(sinks);
        self
    }

    pub fn block_mask(mut self, mask: BlockMask) -> Self {
        self.block_mask = Some(mask);
        self
    }

    pub fn varlen(mut self, varlen: Varlen) -> Self {
        self.varlen = Some(varlen);
        self
    }

    /// Reject non-finite scales and softcaps before any work is done.
    pub fn validate(&self) -> Result<()> {
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
        if let Some(a) = &self.alibi {
            a.validate_for(batch, shape.heads_q)?;
        }
        if let Some(s) = &self.sinks {
            s.validate_for(shape.heads_q)?;
        }
        if let Some(m) = &self.block_mask {
            m.validate_for(batch, shape.heads_q, seqlens)?;
        }
        Ok(())
    }

    /// For paths that take the band and score options only (the naive
    /// baseline, the FP8 forward): `Unsupported` naming the first layout
    /// given.
    pub fn band_only(&self, what: &'static str) -> Result<()> {
        let unsupported = [
            (self.varlen.is_some(), "packed (varlen) batches"),
            (self.alibi.is_some(), "ALiBi"),
            (self.sinks.is_some(), "attention sinks"),
            (self.block_mask.is_some(), "block-sparse masks"),
        ];
        match unsupported.into_iter().find(|(on, _)| *on) {
            Some((_, feature)) => Err(Error::Unsupported { what, feature }),
            None => Ok(()),
        }
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
        Mask::new(seqlen_q, seqlen_k, self.window.left, right)
    }
}

/// FP8 (e4m3) forward options (SPEC.md): whether q and k go through
/// incoherent processing before they are quantized.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Fp8Options {
    /// The seed of the random ±1 signs of the Walsh–Hadamard transform
    /// applied to q and k along the head dim (`--hadamard`); `None`: none.
    pub hadamard: Option<u64>,
}

impl Fp8Options {
    /// The seed `--hadamard` uses unless told otherwise.
    pub const DEFAULT_SEED: u64 = 0x4ada_3a2d;

    /// Incoherent processing with the signs of `seed`.
    pub fn hadamard(seed: u64) -> Self {
        Self {
            hadamard: Some(seed),
        }
    }
}

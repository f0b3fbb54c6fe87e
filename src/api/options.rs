//! Attention options (scale, softcap, masks) and the mask arithmetic every backend shares.

use super::shape::AttentionShape;
use crate::error::{Error, Result};

/// A local attention window `(left, right)` around the bottom-right-aligned diagonal.
/// `None` on a side means unbounded, like `-1` in flash-attention.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Window {
    pub left: Option<usize>,
    pub right: Option<usize>,
}

impl Window {
    /// Build from flash-attention's convention, where a negative value is unbounded.
    pub fn from_signed(left: i64, right: i64) -> Self {
        let side = |x: i64| if x < 0 { None } else { Some(x as usize) };
        Self {
            left: side(left),
            right: side(right),
        }
    }

    pub fn is_unbounded(&self) -> bool {
        self.left.is_none() && self.right.is_none()
    }
}

/// What to compute besides plain softmax attention.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct AttentionOptions {
    /// Bottom-right aligned causal mask.
    pub causal: bool,
    /// Local window; combined with `causal` by AND.
    pub window: Window,
    /// Soft-capping `C · tanh(s / C)` when `Some(C)` with `C > 0`.
    pub softcap: Option<f32>,
    /// Score scale; `None` means `1 / sqrt(head_dim)`.
    pub scale: Option<f32>,
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
        Mask {
            offset: seqlen_k as i64 - seqlen_q as i64,
            left: self.window.left.map(|l| l as i64),
            right: right.map(|r| r as i64),
            seqlen_k: seqlen_k as i64,
        }
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

//! The one place the CPU backend turns `q·k` into scores: scale, softcap,
//! ALiBi's bias, the band and the block mask, and which key blocks a block
//! of rows may skip. Forward,
//! backward and decode all call these, so their scores are bit-identical
//! (the backward's `s − lse` is exact at a row's maximum) and a new score
//! term or skipping predicate is added here once.

use super::micro::{Kernel, PAD};
use super::vmath;
use crate::api::block_mask::{tile_fate, MaskView, Tile, TileFate};
use crate::api::dropout_rule::DropoutRule;
use crate::api::options::{AttentionOptions, Mask};
use crate::api::pair_rule::PairRule;
use std::ops::Range;

/// Scale and softcap of a call, and the per-(sequence, head) terms.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ScoreRule<'a> {
    pub scale: f32,
    /// `C` of `C · tanh(s / C)`; 0 = off.
    pub softcap: f32,
    /// ALiBi's slope and the band's offset: `s −= slope · |i + off − j|`.
    pub alibi: Option<(f32, i64)>,
    /// The block mask of the (sequence, head), with the band its tile test
    /// intersects.
    pub block: Option<(MaskView<'a>, Mask)>,
    /// Dropout's keep bits (applied to P, not to the scores).
    pub dropout: Option<DropoutRule>,
}

/// One query row as the scores see it: its position `i` and the keys its mask allows (already clipped to what the task walks).
#[derive(Clone, Debug)]
pub(crate) struct ScoreRow {
    pub i: usize,
    pub keys: Range<usize>,
    /// ALiBi's slope where the row has its own (decoding packs a GQA
    /// group's query heads into one stream); `None`: the rule's.
    pub slope: Option<f32>,
}

/// What a block of rows sees of a block of keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Visibility {
    /// No row sees any key: the block is never loaded or computed.
    Skip,
    /// Every row sees every key: no mask is applied.
    Full,
    /// Some pairs are masked.
    Partial,
}

impl<'a> ScoreRule<'a> {
    /// Scale and softcap only (decoding adds its slopes per query head).
    pub fn new(opts: &AttentionOptions, head_dim: usize) -> Self {
        Self {
            scale: opts.scale_for(head_dim),
            softcap: opts.softcap_value(),
            alibi: None,
            block: None,
            dropout: None,
        }
    }

    /// Every term of one (sequence, query head).
    pub fn of_pair(rule: &PairRule<'a>) -> Self {
        Self {
            scale: rule.scale,
            softcap: rule.softcap,
            alibi: rule.slope.map(|slope| (slope, rule.band.offset)),
            block: rule.block.map(|view| (view, rule.band)),
            dropout: rule.dropout,
        }
    }

    /// `vis` (what the band leaves of `rows × keys`) under the block mask
    /// too: a tile with no allowed pair is skipped, one with masked pairs
    /// is partial. `rows` are consecutive.
    pub fn refine(&self, rows: &[ScoreRow], keys: &Range<usize>, vis: Visibility) -> Visibility {
        let (Some((view, band)), Some(first), Some(last)) =
            (&self.block, rows.first(), rows.last())
        else {
            return vis;
        };
        if vis == Visibility::Skip {
            return vis;
        }
        let tile = Tile {
            rows: first.i..last.i + 1,
            keys: keys.clone(),
        };
        match tile_fate(view, band, &tile) {
            TileFate::Skipped => Visibility::Skip,
            TileFate::Partial => Visibility::Partial,
            TileFate::Full => vis,
        }
    }

    /// What `rows` see of `keys`.
    pub fn visibility(rows: &[ScoreRow], keys: &Range<usize>) -> Visibility {
        let sees = |r: &ScoreRow| r.keys.start < keys.end && keys.start < r.keys.end;
        let all = |r: &ScoreRow| r.keys.start <= keys.start && keys.end <= r.keys.end;
        if !rows.iter().any(sees) {
            Visibility::Skip
        } else if rows.iter().all(all) {
            Visibility::Full
        } else {
            Visibility::Partial
        }
    }

    /// The keys of `block` that some row sees, widened to whole
    /// micro-kernel panels ([`PAD`] keys from the block's start) inside the
    /// block, and what the rows see of them: a block on a mask's edge is
    /// computed only as far as its rows reach (half of a diagonal block
    /// under a causal mask is never computed).
    pub fn narrow(rows: &[ScoreRow], block: &Range<usize>) -> (Range<usize>, Visibility) {
        let clipped = |r: &ScoreRow| {
            let lo = r.keys.start.max(block.start);
            lo..r.keys.end.min(block.end).max(lo)
        };
        let seen = rows.iter().map(clipped).filter(|k| !k.is_empty());
        let lo = seen.clone().map(|k| k.start).min();
        let (Some(lo), Some(hi)) = (lo, seen.map(|k| k.end).max()) else {
            return (block.start..block.start, Visibility::Skip);
        };
        let lo = block.start + (lo - block.start) / PAD * PAD;
        let hi = (block.start + (hi - block.start).div_ceil(PAD) * PAD).min(block.end);
        let cols = lo..hi;
        let vis = Self::visibility(rows, &cols);
        (cols, vis)
    }

    /// The keys some row sees (empty when none does).
    pub fn span(rows: &[ScoreRow]) -> Range<usize> {
        let seen = rows.iter().filter(|r| !r.keys.is_empty());
        let lo = seen.clone().map(|r| r.keys.start).min().unwrap_or(0);
        let hi = seen.map(|r| r.keys.end).max().unwrap_or(0);
        lo..hi.max(lo)
    }

    /// Turn one row of dot products against `keys` into scores in place:
    /// `scale · x`, soft-capped, less ALiBi's bias, and −inf where the
    /// row's band or block mask forbids.
    #[inline(always)]
    pub fn apply<K: Kernel>(
        &self,
        row: &ScoreRow,
        keys: &Range<usize>,
        vis: Visibility,
        s: &mut [f32],
    ) {
        let s = &mut s[..keys.len()];
        if self.softcap > 0.0 {
            let (cap, inv) = (self.softcap, self.scale / self.softcap);
            s.iter_mut()
                .for_each(|x| *x = cap * vmath::tanh::<K>(*x * inv));
        } else {
            vmath::scale(s, self.scale);
        }
        if let Some((slope, off)) = self.alibi {
            let slope = row.slope.unwrap_or(slope);
            // One f32 product per pair, as the kernels and the reference round it.
            let at = row.i as i64 + off - keys.start as i64;
            for (c, x) in s.iter_mut().enumerate() {
                *x -= slope * (at - c as i64).unsigned_abs() as f32;
            }
        }
        if vis == Visibility::Partial {
            let lo = row.keys.start.clamp(keys.start, keys.end) - keys.start;
            let hi = row.keys.end.clamp(keys.start, keys.end) - keys.start;
            let hi = hi.max(lo);
            s[..lo].fill(f32::NEG_INFINITY);
            s[hi..].fill(f32::NEG_INFINITY);
            if let Some((view, _)) = &self.block {
                mask_blocks(view, row.i, keys, s);
            }
        }
    }

    /// Dropout's `1 / (1 − p)`, 1 without dropout.
    pub fn keep_scale(&self) -> f32 {
        self.dropout.map_or(1.0, |d| d.scale())
    }

    /// `∂s/∂(scale·x)` at the score `s` that [`apply`](Self::apply)
    /// produced for `(i, j)`: `1 − tanh²` of the soft-capped score (ALiBi's
    /// bias added back) with softcap, else 1.
    #[inline(always)]
    pub fn dcap(&self, s: f32, i: usize, j: usize) -> f32 {
        if self.softcap > 0.0 {
            let bias = self.alibi.map_or(0.0, |(slope, off)| {
                slope * (i as i64 + off - j as i64).unsigned_abs() as f32
            });
            let t = (s + bias) / self.softcap;
            1.0 - t * t
        } else {
            1.0
        }
    }
}

/// −inf on the keys of `keys` whose block the mask forbids to row `i`,
/// one block column at a time.
fn mask_blocks(view: &MaskView, i: usize, keys: &Range<usize>, s: &mut [f32]) {
    let bn = view.grid.bn;
    let mut j = keys.start;
    while j < keys.end {
        let end = ((j / bn + 1) * bn).min(keys.end);
        if !view.allows(i, j) {
            s[j - keys.start..end - keys.start].fill(f32::NEG_INFINITY);
        }
        j = end;
    }
}

/// The rows of `0..seqlen_q` that may see some key of `keys`: both ends of
/// the band `key_range(i)` never decrease with `i`, so they form one range.
pub(crate) fn rows_seeing(mask: &Mask, seqlen_q: usize, keys: &Range<usize>) -> Range<usize> {
    let first = partition(seqlen_q, |i| mask.key_range(i).end <= keys.start);
    let end = partition(seqlen_q, |i| mask.key_range(i).start < keys.end);
    first..end.max(first)
}

/// The first `i` in `0..n` where `pred` is false (`pred` holds on a prefix).
fn partition(n: usize, pred: impl Fn(usize) -> bool) -> usize {
    let (mut lo, mut hi) = (0, n);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if pred(mid) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    lo
}

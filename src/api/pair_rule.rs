//! The rule that scores and masks every pair of one (sequence, query
//! head): scale, softcap, ALiBi's bias, the band, the block mask, and the
//! head's sink, and dropout's keep bits — shared by the reference and the CPU backend (the kernels
//! apply the same terms in `shaders/common.wgsl`).

use super::band::Mask;
use super::block_mask::MaskView;
use super::dropout_rule::DropoutRule;
use super::options::AttentionOptions;
use super::scores::Real;
use super::varlen::Sequence;
use std::ops::Range;

/// How every pair of one (sequence, query head) is scored and masked.
#[derive(Clone, Copy, Debug)]
pub struct PairRule<'a> {
    /// The causal/window band, with the sequence's own offset.
    pub band: Mask,
    pub block: Option<MaskView<'a>>,
    pub slope: Option<f32>,
    pub scale: f32,
    pub softcap: f32,
    /// The sink logit of the head, if any.
    pub sink: Option<f32>,
    /// Dropout's keep bits of the (sequence, head); `None` without dropout.
    pub dropout: Option<DropoutRule>,
}

impl<'a> PairRule<'a> {
    /// The rule of sequence `seq`, query head `h` under `opts` (validated)
    /// for a problem of `heads_q` query heads and head dim `head_dim`.
    pub fn new(
        opts: &'a AttentionOptions,
        seq: &Sequence,
        h: usize,
        [heads_q, head_dim]: [usize; 2],
    ) -> Self {
        Self {
            band: opts.mask_for(seq.len_q(), seq.len_k()),
            block: opts.block_mask.as_ref().map(|m| m.view(seq.index, h)),
            slope: opts.alibi.as_ref().map(|a| a.slope(seq.index, h, heads_q)),
            scale: opts.scale_for(head_dim),
            softcap: opts.softcap_value(),
            sink: opts.sinks.as_ref().map(|s| s.logits()[h]),
            dropout: DropoutRule::new(opts, seq.index, h, heads_q),
        }
    }

    /// The keys row `i` may see by the band (the block mask may still
    /// mask some: [`PairRule::allows`]).
    pub fn keys(&self, i: usize) -> Range<usize> {
        self.band.key_range(i)
    }

    /// Whether row `i` may attend to key `j` (sequence-relative).
    pub fn allows(&self, i: usize, j: usize) -> bool {
        self.band.allows(i, j) && self.block.is_none_or(|m| m.allows(i, j))
    }

    /// The final score of `(i, j)` from its raw dot product `q·k`, and the
    /// softcap's derivative there (1 without softcap).
    pub fn score<T: Real>(&self, dot: T, i: usize, j: usize) -> (T, T) {
        let s = dot * T::from_f32(self.scale);
        let (s, dcap) = if self.softcap > 0.0 {
            let c = T::from_f32(self.softcap);
            let th = (s / c).tanh();
            (c * th, T::ONE - th * th)
        } else {
            (s, T::ONE)
        };
        (s - self.bias::<T>(i, j), dcap)
    }

    /// ALiBi's `slope · |i + off − j|` (0 without ALiBi): exact in f64,
    /// rounded once in f32 (as the kernels' one f32 product rounds).
    pub fn bias<T: Real>(&self, i: usize, j: usize) -> T {
        match self.slope {
            Some(slope) => {
                let distance = (i as i64 + self.band.offset - j as i64).unsigned_abs();
                T::from_f64(slope as f64 * distance as f64)
            }
            None => T::ZERO,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::scores::Alibi;

    #[test]
    fn alibi_biases_by_distance_from_the_aligned_diagonal() {
        let opts = AttentionOptions::default().alibi(Alibi::new(&[0.5]));
        let shape = crate::api::shape::AttentionShape::new(1, 2, 5, 1, 1, 4).unwrap();
        let seq = &crate::api::varlen::sequences(&shape, None)[0];
        let rule = PairRule::new(&opts, seq, 0, [1, 4]);
        // off = 3: row 0 sits at key 3.
        assert_eq!(rule.bias::<f64>(0, 3), 0.0);
        assert_eq!(rule.bias::<f64>(0, 0), 1.5);
        assert_eq!(rule.bias::<f64>(1, 0), 2.0);
        assert_eq!(rule.score(2.0f64, 1, 4), (1.0 - 0.0, 1.0));
    }
}

//! The terms a score gains beyond scale and softcap — ALiBi's slopes and
//! attention sinks' logits — and the arithmetic the row-wise computations
//! share ([`Real`]). [`super::pair_rule`] applies them.
//!
//! docs/semantics.md: `s = scale · q·k`, then `s = C·tanh(s / C)` with softcap `C`,
//! then `s -= slope · |i + off − j|` with ALiBi, then the masks. A sink is
//! one virtual key per query head with score `sink_h` and value 0.

use crate::error::{Error, Result};
use std::sync::Arc;

/// ALiBi slopes, `(heads_q,)` or `(batch, heads_q)` (flash-attention's
/// `alibi_slopes`).
#[derive(Clone, Debug, PartialEq)]
pub struct Alibi {
    slopes: Arc<[f32]>,
}

impl Alibi {
    /// Slopes per query head, `(heads_q,)`, or per sequence and head, `(batch, heads_q)`.
    pub fn new(slopes: &[f32]) -> Self {
        Self {
            slopes: slopes.into(),
        }
    }

    /// The ALiBi paper's slopes for `heads` heads: the geometric sequence
    /// `2^(-8/n), 2^(-16/n), …` (for a power of two `n`; others interleave
    /// the next power's, as the paper's code does).
    pub fn standard(heads: usize) -> Self {
        let pow2 = |n: usize| (1..=n).map(move |i| 2f64.powf(-8.0 * i as f64 / n as f64));
        let n = heads.next_power_of_two();
        let slopes: Vec<f32> = if n == heads {
            pow2(n).map(|s| s as f32).collect()
        } else {
            let base = n / 2;
            let extra = pow2(2 * base).step_by(2).take(heads - base);
            pow2(base).chain(extra).map(|s| s as f32).collect()
        };
        Self::new(&slopes)
    }

    /// The slopes as given.
    pub fn slopes(&self) -> &[f32] {
        &self.slopes
    }

    /// Whether there is one row of slopes per batch entry.
    pub fn per_batch(&self, heads_q: usize) -> bool {
        self.slopes.len() != heads_q
    }

    /// The slope of batch entry `b`, query head `h`.
    pub fn slope(&self, b: usize, h: usize, heads_q: usize) -> f32 {
        if self.per_batch(heads_q) {
            self.slopes[b * heads_q + h]
        } else {
            self.slopes[h]
        }
    }

    /// `(heads_q,)` or `(batch, heads_q)`, every slope finite.
    pub fn validate_for(&self, batch: usize, heads_q: usize) -> Result<()> {
        let len = self.slopes.len();
        // checked: a packed batch's sequence count times heads may not fit a usize.
        if len != heads_q && batch.checked_mul(heads_q) != Some(len) {
            return Err(Error::AlibiSlopes {
                len,
                heads_q,
                batch,
            });
        }
        all_finite("alibi_slopes", &self.slopes)
    }
}

/// Attention sinks: one logit per query head (gpt-oss).
#[derive(Clone, Debug, PartialEq)]
pub struct Sinks {
    logits: Arc<[f32]>,
}

impl Sinks {
    /// One sink logit per query head.
    pub fn new(logits: &[f32]) -> Self {
        Self {
            logits: logits.into(),
        }
    }

    /// The logits as given.
    pub fn logits(&self) -> &[f32] {
        &self.logits
    }

    /// `(heads_q,)`, every logit finite.
    pub fn validate_for(&self, heads_q: usize) -> Result<()> {
        if self.logits.len() != heads_q {
            return Err(Error::IndexLength {
                tensor: "sinks",
                len: self.logits.len(),
                expected: heads_q,
            });
        }
        all_finite("sinks", &self.logits)
    }
}

fn all_finite(tensor: &'static str, values: &[f32]) -> Result<()> {
    match values.iter().position(|x| !x.is_finite()) {
        Some(index) => Err(Error::NonFinite {
            tensor,
            index,
            value: values[index],
        }),
        None => Ok(()),
    }
}

/// The arithmetic the row-wise computations need, for f64 (reference) and
/// f32 (baseline and CPU backend).
pub trait Real:
    Copy
    + Send
    + Sync
    + PartialOrd
    + std::ops::Add<Output = Self>
    + std::ops::Sub<Output = Self>
    + std::ops::Mul<Output = Self>
    + std::ops::Div<Output = Self>
    + std::ops::AddAssign
{
    const ZERO: Self;
    const ONE: Self;
    const NEG_INFINITY: Self;
    fn from_f32(x: f32) -> Self;
    fn from_f64(x: f64) -> Self;
    fn exp(self) -> Self;
    fn ln(self) -> Self;
    fn tanh(self) -> Self;
}

macro_rules! impl_real {
    ($t:ty) => {
        impl Real for $t {
            const ZERO: Self = 0.0;
            const ONE: Self = 1.0;
            const NEG_INFINITY: Self = <$t>::NEG_INFINITY;
            fn from_f32(x: f32) -> Self {
                x as $t
            }
            fn from_f64(x: f64) -> Self {
                x as $t
            }
            fn exp(self) -> Self {
                <$t>::exp(self)
            }
            fn ln(self) -> Self {
                <$t>::ln(self)
            }
            fn tanh(self) -> Self {
                <$t>::tanh(self)
            }
        }
    };
}
impl_real!(f32);
impl_real!(f64);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn standard_slopes_follow_the_paper() {
        let s = Alibi::standard(8);
        assert_eq!(s.slopes()[0], 0.5);
        assert_eq!(s.slopes()[7], 1.0 / 256.0);
        assert_eq!(Alibi::standard(12).slopes().len(), 12);
    }

    #[test]
    fn per_head_inputs_are_validated() {
        let a = Alibi::new(&[0.5, 0.25]);
        assert!(a.validate_for(3, 2).is_ok());
        assert!(Alibi::new(&[0.5; 6]).validate_for(3, 2).is_ok());
        assert!(matches!(
            Alibi::new(&[0.5; 5]).validate_for(3, 2),
            Err(Error::AlibiSlopes { len: 5, .. })
        ));
        assert!(matches!(
            Alibi::new(&[0.5, f32::NAN]).validate_for(1, 2),
            Err(Error::NonFinite { index: 1, .. })
        ));
        assert!(matches!(
            Sinks::new(&[0.0, f32::INFINITY]).validate_for(2),
            Err(Error::NonFinite {
                tensor: "sinks",
                index: 1,
                ..
            })
        ));
        assert!(matches!(
            Sinks::new(&[0.0]).validate_for(2),
            Err(Error::IndexLength { expected: 2, .. })
        ));
    }
}

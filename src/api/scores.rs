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
    /// The array's shape, where the caller gave it ([`Alibi::shaped`]).
    shape: Option<Arc<[usize]>>,
}

impl Alibi {
    /// Slopes per query head, `(heads_q,)`, or per sequence and head,
    /// `(batch, heads_q)`, flattened in row-major order: told apart by
    /// their count alone.
    pub fn new(slopes: &[f32]) -> Self {
        Self {
            slopes: slopes.into(),
            shape: None,
        }
    }

    /// Slopes with the shape of the array they came from (a file, a
    /// tensor), row-major: [`validate_for`](Self::validate_for) then takes
    /// exactly `(heads_q,)` or `(batch, heads_q)`, not another shape of
    /// the same count. `Error::DataLength` if the shape does not hold
    /// `slopes.len()` entries, `Error::SizeOverflow` if its element count
    /// overflows.
    pub fn shaped(shape: &[usize], slopes: &[f32]) -> Result<Self> {
        let expected = super::size::elements("alibi_slopes", shape)?;
        if expected != slopes.len() {
            return Err(Error::DataLength {
                tensor: "alibi_slopes",
                shape: shape.to_vec(),
                expected,
                actual: slopes.len(),
            });
        }
        Ok(Self {
            slopes: slopes.into(),
            shape: Some(shape.into()),
        })
    }

    /// The shape given to [`Alibi::shaped`], `None` for [`Alibi::new`].
    pub fn shape(&self) -> Option<&[usize]> {
        self.shape.as_deref()
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

    /// `(heads_q,)` or `(batch, heads_q)`, every slope finite: by shape
    /// where one was given (`Error::AlibiShape`), else by count
    /// (`Error::AlibiSlopes`).
    pub fn validate_for(&self, batch: usize, heads_q: usize) -> Result<()> {
        if let Some(shape) = &self.shape {
            if **shape != [heads_q] && **shape != [batch, heads_q] {
                return Err(Error::AlibiShape {
                    shape: shape.to_vec(),
                    heads_q,
                    batch,
                });
            }
        }
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
            Alibi::shaped(&[2], &[0.5, f32::NAN]).unwrap().validate_for(1, 2),
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

    #[test]
    fn a_slopes_shape_whose_count_overflows_says_so() {
        // It once reported a DataLength of usize::MAX expected elements.
        assert!(matches!(
            Alibi::shaped(&[usize::MAX, 2], &[0.5; 6]),
            Err(Error::SizeOverflow {
                what: "alibi_slopes",
                ..
            })
        ));
        assert!(matches!(
            Alibi::shaped(&[2, 2], &[0.5; 6]),
            Err(Error::DataLength {
                expected: 4,
                actual: 6,
                ..
            })
        ));
    }

    #[test]
    fn shaped_slopes_take_exactly_heads_or_batch_by_heads() {
        // batch 2, heads_q 4.
        for shape in [&[4][..], &[2, 4]] {
            let n = shape.iter().product::<usize>();
            let a = Alibi::shaped(shape, &vec![0.5; n]).unwrap();
            assert!(a.validate_for(2, 4).is_ok(), "{shape:?}");
            assert_eq!(a.shape(), Some(shape));
        }
        // The same counts in other shapes: (4, 2), (1, 4), (8,), (2, 2, 2).
        for shape in [&[4, 2][..], &[1, 4], &[8], &[2, 2, 2]] {
            let n = shape.iter().product::<usize>();
            let a = Alibi::shaped(shape, &vec![0.5; n]).unwrap();
            match a.validate_for(2, 4) {
                Err(Error::AlibiShape {
                    shape: given,
                    heads_q: 4,
                    batch: 2,
                }) => assert_eq!(given, shape),
                other => panic!("{shape:?}: {other:?}"),
            }
        }
        // (1, heads_q) is (batch, heads_q) for a batch of one.
        let one = Alibi::shaped(&[1, 4], &[0.5; 4]).unwrap();
        assert!(one.validate_for(1, 4).is_ok());
        assert!(matches!(
            Alibi::shaped(&[2, 4], &[0.5; 7]),
            Err(Error::DataLength {
                expected: 8,
                actual: 7,
                ..
            })
        ));
        let text = Alibi::shaped(&[4, 2], &[0.5; 8])
            .unwrap()
            .validate_for(2, 4)
            .unwrap_err()
            .to_string();
        assert!(text.contains("(4, 2)") && text.contains("(2, 4)"), "{text}");
        // Unshaped slopes are told apart by count, as before.
        assert!(Alibi::new(&[0.5; 8]).validate_for(2, 4).is_ok());
    }
}

//! One attention call, validated once: [`Problem`] holds the shape, the
//! storage precision and the options, with what every backend derives from
//! the options resolved here — the causal/window band, the score scale, the
//! softcap, a packed batch's longest sequence. The wgpu planner and
//! kernels, the CPU backend, the CUDA backend and the verification of
//! first use all take it, so the options are read in one place.

use super::band::Mask;
use super::inputs::{BackwardInputs, ForwardInputs};
use super::options::AttentionOptions;
use super::shape::AttentionShape;
use super::tensor::Precision;
use crate::error::Result;

/// A validated attention call (forward or backward).
#[derive(Clone, Copy, Debug)]
pub struct Problem<'a> {
    /// Its shape (a packed batch: its batch of one).
    pub shape: AttentionShape,
    /// The storage precision of q, k and v.
    pub precision: Precision,
    /// Its options, validated against the shape.
    pub opts: &'a AttentionOptions,
    /// The causal/window band over the whole shape.
    pub mask: Mask,
    /// The score scale (`1/√d` unless given).
    pub scale: f32,
    /// The softcap, 0 when off.
    pub softcap: f32,
    /// The most query rows and keys of one sequence (a packed batch's
    /// longest; else the shape's lengths).
    pub longest: (usize, usize),
}

impl<'a> Problem<'a> {
    /// `opts` checked against `shape` (every size rule, scale, softcap and
    /// layout): the typed error naming the first problem, else the call.
    pub fn new(
        shape: AttentionShape,
        precision: Precision,
        opts: &'a AttentionOptions,
    ) -> Result<Self> {
        // The shape may have been built field by field.
        shape.check()?;
        Self::padded(shape, precision, opts)
    }

    /// [`Problem::new`] but for the head dims' maximum: FP8's problem on
    /// rows zero-padded for its transform (a power of two, which may pass
    /// `MAX_HEAD_DIM`), whose unpadded shape was checked.
    pub(crate) fn padded(
        shape: AttentionShape,
        precision: Precision,
        opts: &'a AttentionOptions,
    ) -> Result<Self> {
        opts.validate_for(&shape)?;
        Ok(Self {
            shape,
            precision,
            opts,
            mask: opts.mask(&shape),
            scale: opts.scale_for(shape.head_dim),
            softcap: opts.softcap_value(),
            longest: opts
                .varlen
                .as_ref()
                .map_or((shape.seqlen_q, shape.seqlen_k), |v| v.max_seqlens()),
        })
    }

    /// A forward of `q`, `k`, `v` under `opts`.
    pub fn forward(inputs: &ForwardInputs, opts: &'a AttentionOptions) -> Result<Self> {
        Self::new(inputs.shape()?, inputs.q.precision(), opts)
    }

    /// A backward of `inputs` under `opts` (o, do and lse checked too).
    pub fn backward(inputs: &BackwardInputs, opts: &'a AttentionOptions) -> Result<Self> {
        Self::new(inputs.shape()?, inputs.q.precision(), opts)
    }

    /// The band masks some pairs.
    pub fn banded(&self) -> bool {
        self.mask.is_active()
    }

    /// Scores are softcapped.
    pub fn softcapped(&self) -> bool {
        self.softcap > 0.0
    }

    /// A packed batch of variable-length sequences.
    pub fn packed(&self) -> bool {
        self.opts.varlen.is_some()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::varlen::Varlen;
    use crate::error::Error;

    #[test]
    fn options_are_resolved_once_and_checked_against_the_shape() {
        let shape = AttentionShape::new(1, 10, 12, 4, 2, 16).unwrap();
        let opts = AttentionOptions::default().causal(true).softcap(30.0);
        let p = Problem::new(shape, Precision::F16, &opts).unwrap();
        assert_eq!(p.scale, 0.25);
        assert!(p.banded() && p.softcapped() && !p.packed());
        assert_eq!(
            (p.mask.offset, p.mask.right, p.longest),
            (2, Some(0), (10, 12))
        );
        let packed =
            AttentionOptions::default().varlen(Varlen::new(&[0, 3, 10], &[0, 8, 12]).unwrap());
        let p = Problem::new(shape, Precision::F32, &packed).unwrap();
        assert_eq!(p.longest, (7, 8));
        assert!(!p.banded() && p.packed());
        let bad = AttentionOptions::default().softcap(f32::NAN);
        assert!(matches!(
            Problem::new(shape, Precision::F32, &bad),
            Err(Error::InvalidSoftcap { .. })
        ));
    }
}

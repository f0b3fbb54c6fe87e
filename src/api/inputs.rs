//! What a backward pass takes: the forward's inputs, what the forward saved
//! (o and lse) and the output gradient, validated in one place for every
//! backend.

use super::output::ForwardOutput;
use super::shape::AttentionShape;
use super::tensor::TensorView;
use crate::error::{Error, Result};

/// The inputs of a backward pass. `o` and `lse` are the forward's outputs
/// for the same q, k, v and options; `d_o` has o's shape and dtype
/// (o has v's head dim).
#[derive(Clone, Copy, Debug)]
pub struct BackwardInputs<'a> {
    pub q: TensorView<'a>,
    pub k: TensorView<'a>,
    pub v: TensorView<'a>,
    pub o: TensorView<'a>,
    /// `(batch, heads_q, seqlen_q)`, natural log, `-inf` for empty rows.
    pub lse: &'a [f32],
    pub d_o: TensorView<'a>,
}

impl<'a> BackwardInputs<'a> {
    /// The inputs of the backward that follows `forward` on q, k, v.
    pub fn new(
        [q, k, v]: [TensorView<'a>; 3],
        forward: &'a ForwardOutput,
        d_o: TensorView<'a>,
    ) -> Result<Self> {
        Ok(Self {
            q,
            k,
            v,
            o: forward.o.view()?,
            lse: &forward.lse,
            d_o,
        })
    }

    /// Validate every tensor against q, k, v (docs/semantics.md's rules) and return
    /// the problem's shape.
    pub fn shape(&self) -> Result<AttentionShape> {
        let shape = AttentionShape::from_views(&self.q, &self.k, &self.v)?;
        shape.check_like_o(&self.o, &self.q, "o")?;
        shape.check_like_o(&self.d_o, &self.q, "do")?;
        if self.lse.len() != shape.lse_len() {
            return Err(Error::DataLength {
                tensor: "lse",
                shape: shape.lse_shape().to_vec(),
                expected: shape.lse_len(),
                actual: self.lse.len(),
            });
        }
        Ok(shape)
    }
}

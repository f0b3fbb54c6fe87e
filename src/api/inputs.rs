//! What a forward pass takes (q, k, v) and what a backward pass takes: the
//! forward's inputs, what the forward saved (o and lse) and the output
//! gradient, validated in one place for every backend.

use super::output::ForwardOutput;
use super::shape::AttentionShape;
use super::tensor::TensorView;
use crate::error::{Error, Result};

/// The inputs of a forward pass: `q` is `(batch, seqlen_q, heads_q,
/// head_dim)`, `k` and `v` are `(batch, seqlen_k, heads_kv, head_dim)`
/// (docs/semantics.md).
///
/// ```
/// use flashattn::{ForwardInputs, TensorView};
///
/// let x = vec![0.5f32; 2 * 8 * 4 * 16];
/// let view = TensorView::f32([2, 8, 4, 16], &x);
/// let inputs = ForwardInputs::new(view, view, view);
/// assert_eq!(inputs.shape()?.seqlen_q, 8);
/// # Ok::<(), flashattn::Error>(())
/// ```
#[derive(Clone, Copy, Debug)]
pub struct ForwardInputs<'a> {
    /// The queries.
    pub q: TensorView<'a>,
    /// The keys.
    pub k: TensorView<'a>,
    /// The values.
    pub v: TensorView<'a>,
}

impl<'a> ForwardInputs<'a> {
    /// The inputs `q`, `k`, `v` (checked when a call takes them).
    pub fn new(q: TensorView<'a>, k: TensorView<'a>, v: TensorView<'a>) -> Self {
        Self { q, k, v }
    }

    /// Validate q, k, v against each other (docs/semantics.md's rules) and
    /// return the problem's shape.
    pub fn shape(&self) -> Result<AttentionShape> {
        AttentionShape::from_views(&self.q, &self.k, &self.v)
    }
}

/// The inputs of a backward pass. `o` and `lse` are the forward's outputs
/// for the same q, k, v and options; `d_o` has o's shape and dtype
/// (o has v's head dim).
#[derive(Clone, Copy, Debug)]
pub struct BackwardInputs<'a> {
    /// The forward's queries.
    pub q: TensorView<'a>,
    /// The forward's keys.
    pub k: TensorView<'a>,
    /// The forward's values.
    pub v: TensorView<'a>,
    /// The forward's output.
    pub o: TensorView<'a>,
    /// `(batch, heads_q, seqlen_q)`, natural log, `-inf` for empty rows.
    pub lse: &'a [f32],
    /// The gradient of the loss with respect to `o`.
    pub d_o: TensorView<'a>,
}

impl<'a> BackwardInputs<'a> {
    /// The inputs of the backward that follows `forward` on q, k, v.
    pub fn new(
        inputs: ForwardInputs<'a>,
        forward: &'a ForwardOutput,
        d_o: TensorView<'a>,
    ) -> Result<Self> {
        let ForwardInputs { q, k, v } = inputs;
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

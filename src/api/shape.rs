//! The sizes of one attention problem, validated, and the row-major layout
//! every backend indexes tensors with.

use super::size;
use super::tensor::TensorView;
use crate::error::{Error, Result};

/// Largest supported head dimension (of q/k and of v).
pub const MAX_HEAD_DIM: usize = 576;

/// The sizes of one attention call, validated.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AttentionShape {
    /// Sequences in the batch.
    pub batch: usize,
    /// Query tokens per sequence.
    pub seqlen_q: usize,
    /// Key/value tokens per sequence.
    pub seqlen_k: usize,
    /// Query heads.
    pub heads_q: usize,
    /// Key/value heads (`heads_q` is a multiple).
    pub heads_kv: usize,
    /// The head dim of q and k.
    pub head_dim: usize,
    /// The head dim of v, o and dv (`head_dim` unless v has its own, as
    /// DeepSeek's MLA has: 192 for q/k, 128 for v).
    pub head_dim_v: usize,
}

impl AttentionShape {
    /// Check every size rule of docs/semantics.md, naming the offending values; v
    /// has q's head dim (see [`AttentionShape::with_head_dim_v`]).
    pub fn new(
        batch: usize,
        seqlen_q: usize,
        seqlen_k: usize,
        heads_q: usize,
        heads_kv: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let s = Self {
            batch,
            seqlen_q,
            seqlen_k,
            heads_q,
            heads_kv,
            head_dim,
            head_dim_v: head_dim,
        };
        s.check()?;
        Ok(s)
    }

    /// This shape with v's own head dim (o and dv take it too).
    pub fn with_head_dim_v(self, head_dim_v: usize) -> Result<Self> {
        let s = Self { head_dim_v, ..self };
        s.check()?;
        Ok(s)
    }

    /// Check every size rule of docs/semantics.md on a shape built field by field
    /// (what [`AttentionShape::new`] checks): every size at least 1, head
    /// dims within [`MAX_HEAD_DIM`], heads_q a multiple of heads_kv, and the
    /// element count of q, k, v and o within this target's limit
    /// ([`Error::SizeOverflow`], see docs/semantics-limits.md), so every
    /// product of these sizes the engine computes fits a `usize`.
    pub fn check(&self) -> Result<()> {
        let fields = [
            ("batch", self.batch),
            ("seqlen_q", self.seqlen_q),
            ("seqlen_k", self.seqlen_k),
            ("heads_q", self.heads_q),
            ("heads_kv", self.heads_kv),
            ("head_dim", self.head_dim),
            ("head_dim_v", self.head_dim_v),
        ];
        if let Some((dim, _)) = fields.into_iter().find(|(_, v)| *v == 0) {
            return Err(Error::EmptyDim { dim });
        }
        for (tensor, head_dim) in [("q/k", self.head_dim), ("v", self.head_dim_v)] {
            if head_dim > MAX_HEAD_DIM {
                return Err(Error::HeadDimTooLarge {
                    tensor,
                    head_dim,
                    max: MAX_HEAD_DIM,
                });
            }
        }
        if !self.heads_q.is_multiple_of(self.heads_kv) {
            return Err(Error::HeadsNotDivisible {
                heads_q: self.heads_q,
                heads_kv: self.heads_kv,
            });
        }
        // lse's (batch, heads_q, seqlen_q) divides q's count.
        for (tensor, dims) in [
            ("q", self.q_shape()),
            ("k", self.kv_shape()),
            ("v", self.v_shape()),
            ("o", self.o_shape()),
        ] {
            size::elements(tensor, &dims)?;
        }
        Ok(())
    }

    /// Derive and validate the shape from q, k, v views: k and v share
    /// (batch, seqlen, heads); v's last dim is `head_dim_v`.
    pub fn from_views(q: &TensorView, k: &TensorView, v: &TensorView) -> Result<Self> {
        for (name, t) in [("q", q), ("k", k), ("v", v)] {
            t.check_len(name)?;
        }
        if k.shape[..3] != v.shape[..3] {
            let mut expected = k.shape;
            expected[3] = v.shape[3];
            return Err(Error::ShapeMismatch {
                tensor: "v",
                shape: v.shape.to_vec(),
                like: "k",
                expected: expected.to_vec(),
            });
        }
        let [b, sq, hq, d] = q.shape;
        let [bk, sk, hk, dk] = k.shape;
        for (dim, value, other_value) in [("batch", b, bk), ("head_dim", d, dk)] {
            if value != other_value {
                return Err(Error::DimMismatch {
                    dim,
                    tensor: "q",
                    value,
                    other: "k",
                    other_value,
                });
            }
        }
        same_dtype(k, q, "k")?;
        same_dtype(v, q, "v")?;
        Self::new(b, sq, sk, hq, hk, d)?.with_head_dim_v(v.shape[3])
    }

    /// `t` must have o's shape and q's dtype (as `o` and `do` must).
    pub fn check_like_o(&self, t: &TensorView, q: &TensorView, name: &'static str) -> Result<()> {
        t.check_len(name)?;
        if t.shape != self.o_shape() {
            return Err(Error::ShapeMismatch {
                tensor: name,
                shape: t.shape.to_vec(),
                // Not "o": o itself is checked here too.
                like: "the forward's o: q's with v's head dim",
                expected: self.o_shape().to_vec(),
            });
        }
        same_dtype(t, q, name)
    }

    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.heads_q / self.heads_kv
    }

    /// q's shape: `(batch, seqlen_q, heads_q, head_dim)`.
    pub fn q_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_q, self.heads_q, self.head_dim]
    }

    /// The shape of k (and dk).
    pub fn kv_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_k, self.heads_kv, self.head_dim]
    }

    /// The shape of v (and dv).
    pub fn v_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_k, self.heads_kv, self.head_dim_v]
    }

    /// The shape of o (and do).
    pub fn o_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_q, self.heads_q, self.head_dim_v]
    }

    /// lse's shape: `(batch, heads_q, seqlen_q)`.
    pub fn lse_shape(&self) -> [usize; 3] {
        [self.batch, self.heads_q, self.seqlen_q]
    }

    /// Elements of q.
    pub fn q_len(&self) -> usize {
        self.q_shape().iter().product()
    }

    /// Elements of k (and dk).
    pub fn kv_len(&self) -> usize {
        self.kv_shape().iter().product()
    }

    /// Elements of v (and dv).
    pub fn v_len(&self) -> usize {
        self.v_shape().iter().product()
    }

    /// Elements of o (and do).
    pub fn o_len(&self) -> usize {
        self.o_shape().iter().product()
    }

    /// Elements of lse.
    pub fn lse_len(&self) -> usize {
        self.batch * self.heads_q * self.seqlen_q
    }

    /// Whether v has a head dim of its own.
    pub fn has_head_dim_v(&self) -> bool {
        self.head_dim_v != self.head_dim
    }
}

/// `t` (called `name`) must have q's dtype.
fn same_dtype(t: &TensorView, q: &TensorView, name: &'static str) -> Result<()> {
    if t.precision() != q.precision() {
        return Err(Error::DtypeMismatch {
            tensor: name,
            dtype: t.precision().name(),
            like: "q",
            expected: q.precision().name(),
        });
    }
    Ok(())
}

/// Flat index arithmetic of the `(batch, seq, heads, dim)` layout.
#[derive(Clone, Copy, Debug)]
pub struct Layout {
    /// Rows per sequence.
    pub seqlen: usize,
    /// Heads.
    pub heads: usize,
    /// Elements per row.
    pub dim: usize,
}

impl Layout {
    /// The layout of q (and dq).
    pub fn q(shape: &AttentionShape) -> Self {
        Self {
            seqlen: shape.seqlen_q,
            heads: shape.heads_q,
            dim: shape.head_dim,
        }
    }

    /// The layout of k (and dk).
    pub fn kv(shape: &AttentionShape) -> Self {
        Self {
            seqlen: shape.seqlen_k,
            heads: shape.heads_kv,
            dim: shape.head_dim,
        }
    }

    /// The layout of v (and dv).
    pub fn v(shape: &AttentionShape) -> Self {
        Self {
            dim: shape.head_dim_v,
            ..Self::kv(shape)
        }
    }

    /// The layout of o (and do).
    pub fn o(shape: &AttentionShape) -> Self {
        Self {
            dim: shape.head_dim_v,
            ..Self::q(shape)
        }
    }

    /// Offset of the first element of row `(b, s, h)`.
    #[inline]
    pub fn row(&self, b: usize, s: usize, h: usize) -> usize {
        ((b * self.seqlen + s) * self.heads + h) * self.dim
    }
}

/// Offset of `lse[b, h, i]` in the `(batch, heads_q, seqlen_q)` layout.
#[cfg(feature = "lab")]
#[inline]
pub fn lse_index(shape: &AttentionShape, b: usize, h: usize, i: usize) -> usize {
    (b * shape.heads_q + h) * shape.seqlen_q + i
}

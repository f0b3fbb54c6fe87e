//! Laying the f32 inputs out once per call in the shapes the micro-kernel
//! reads: per (batch, head), rows padded with zeros to a multiple of the
//! micro-kernel's columns, or blocks of keys transposed to `(d, bc)`. Zero
//! padding adds nothing to a dot product and masked keys get P = 0, so the
//! padding never reaches a result. O(N·d) work against the O(N²·d) products.

use super::micro::{Mat, PAD};
use super::pool::Buffer;
use crate::api::shape::Layout;
use crate::api::tensor::{HostData, TensorView};
use rayon::prelude::*;
use std::borrow::Cow;

/// A tensor's values as f32: f32 storage borrowed as it is, f16 and bf16
/// widened (in parallel).
pub(crate) fn widened<'a>(t: &TensorView<'a>) -> Cow<'a, [f32]> {
    fn widen<T: Copy + Sync>(x: &[T], f: impl Fn(T) -> f32 + Sync) -> Cow<'static, [f32]> {
        Cow::Owned(x.par_iter().with_min_len(4096).map(|&v| f(v)).collect())
    }
    match t.data {
        HostData::F32(x) => Cow::Borrowed(x),
        HostData::F16(x) => widen(x, |v| v.to_f32()),
        HostData::Bf16(x) => widen(x, |v| v.to_f32()),
    }
}

/// One tensor laid out per (batch, head), `per_head` floats each.
pub(crate) struct Panels {
    data: Buffer,
    per_head: usize,
    heads: usize,
}

impl Panels {
    /// The panel of head `h` of batch entry `b`.
    pub fn head(&self, b: usize, h: usize) -> &[f32] {
        &self.data[(b * self.heads + h) * self.per_head..][..self.per_head]
    }

    /// Head `h` of batch entry `b` from float `at` on, as rows of `ld`.
    pub fn mat(&self, b: usize, h: usize, at: usize, ld: usize) -> Mat<'_> {
        Mat::rows(&self.head(b, h)[at..], ld)
    }
}

/// `d` rounded up to the micro-kernel's column granularity.
pub(crate) fn padded(d: usize) -> usize {
    d.div_ceil(PAD) * PAD
}

/// Panels of `per_head` zeros for every (batch entry, head) of `l`, each
/// filled in parallel by `fill(b, h, panel)`.
fn per_head(
    l: &Layout,
    batch: usize,
    per_head: usize,
    fill: impl Fn(usize, usize, &mut [f32]) + Sync,
) -> Panels {
    let mut data = Buffer::zeroed(batch * l.heads * per_head);
    data.par_chunks_mut(per_head.max(1))
        .enumerate()
        .for_each(|(bh, panel)| fill(bh / l.heads, bh % l.heads, panel));
    Panels {
        data,
        per_head,
        heads: l.heads,
    }
}

/// `t` (layout `l`, `batch` entries) as per-head row-major panels of
/// `rows` rows (at least `l.seqlen`) of `padded(d)` floats.
pub(crate) fn rows(t: &[f32], l: &Layout, batch: usize, rows: usize) -> Panels {
    let (d, dp) = (l.dim, padded(l.dim));
    per_head(l, batch, rows * dp, |b, h, panel| {
        for s in 0..l.seqlen {
            panel[s * dp..][..d].copy_from_slice(&t[l.row(b, s, h)..][..d]);
        }
    })
}

/// `t` as per-head blocks of `bc` rows, each transposed to `(d, bc)`:
/// block `kb` of a head starts at `kb · d · bc`.
pub(crate) fn transposed(t: &[f32], l: &Layout, batch: usize, bc: usize) -> Panels {
    let d = l.dim;
    per_head(l, batch, l.seqlen.div_ceil(bc) * bc * d, |b, h, panel| {
        for s in 0..l.seqlen {
            let block = &mut panel[s / bc * bc * d..][..bc * d];
            let row = &t[l.row(b, s, h)..][..d];
            for (x, v) in row.iter().enumerate() {
                block[x * bc + s % bc] = *v;
            }
        }
    })
}

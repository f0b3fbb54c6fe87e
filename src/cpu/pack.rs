//! Laying the f32 inputs out once per call in the shapes the micro-kernel
//! reads: per (sequence, head), rows padded with zeros to a multiple of the
//! micro-kernel's columns, or blocks of keys transposed to `(d, bc)`. Zero
//! padding adds nothing to a dot product and masked keys get P = 0, so the
//! padding never reaches a result. O(N·d) work against the O(N²·d) products.

use super::micro::{Mat, PAD};
use super::pool::Buffer;
use crate::api::shape::Layout;
use crate::api::tensor::{HostData, TensorView};
use rayon::prelude::*;
use std::borrow::Cow;
use std::ops::Range;

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

/// One tensor laid out per (sequence, head): a panel each, sized by its
/// sequence's length (a packed batch's sequences differ).
pub(crate) struct Panels {
    data: Buffer,
    /// Where the panel of (sequence `n`, head `h`) starts, at `n · heads + h`;
    /// one more entry holds the end.
    starts: Vec<usize>,
    heads: usize,
}

impl Panels {
    /// The panel of head `h` of sequence `n`.
    pub fn head(&self, n: usize, h: usize) -> &[f32] {
        let at = n * self.heads + h;
        &self.data[self.starts[at]..self.starts[at + 1]]
    }

    /// Head `h` of sequence `n` from float `at` on, as rows of `ld`.
    pub fn mat(&self, n: usize, h: usize, at: usize, ld: usize) -> Mat<'_> {
        Mat::rows(&self.head(n, h)[at..], ld)
    }
}

/// `d` rounded up to the micro-kernel's column granularity.
pub(crate) fn padded(d: usize) -> usize {
    d.div_ceil(PAD) * PAD
}

/// A row stride of at least `n` floats (a multiple of [`PAD`]) spanning
/// an odd number of 64-byte lines. With an even number (a head dim of 64
/// or 128, a block of 256 keys) a panel's rows fall into a few of the L1's
/// sets, more rows than it has ways, and evict each other between the
/// micro-kernel's passes over them.
pub(crate) fn stride(n: usize) -> usize {
    let n = padded(n);
    if (n / PAD).is_multiple_of(2) {
        n + PAD
    } else {
        n
    }
}

/// Panels of zeros for every (sequence, head) of `l`, `size(rows)` floats
/// for a sequence of `rows` rows, each filled in parallel by `fill(n, h,
/// panel)`.
fn per_head(
    l: &Layout,
    seqs: &[Range<usize>],
    size: impl Fn(usize) -> usize,
    fill: impl Fn(usize, usize, &mut [f32]) + Sync,
) -> Panels {
    let mut starts = vec![0];
    for seq in seqs {
        for _ in 0..l.heads {
            starts.push(starts[starts.len() - 1] + size(seq.len()));
        }
    }
    let mut data = Buffer::zeroed(starts[starts.len() - 1]);
    let mut panels = Vec::with_capacity(starts.len() - 1);
    let mut rest: &mut [f32] = &mut data;
    for w in starts.windows(2) {
        let (panel, tail) = rest.split_at_mut(w[1] - w[0]);
        panels.push(panel);
        rest = tail;
    }
    panels
        .into_par_iter()
        .enumerate()
        .for_each(|(nh, panel)| fill(nh / l.heads, nh % l.heads, panel));
    Panels {
        data,
        starts,
        heads: l.heads,
    }
}

/// `t` (layout `l`; sequence `n` is the rows `seqs[n]` of its flat row
/// space) as per-head row-major panels of `rows(len)` rows (at least the
/// sequence's `len`) of `ld` floats (at least `padded(dim)`).
pub(crate) fn rows(
    t: &[f32],
    l: &Layout,
    seqs: &[Range<usize>],
    rows: impl Fn(usize) -> usize,
    ld: usize,
) -> Panels {
    let (d, dp) = (l.dim, ld);
    per_head(
        l,
        seqs,
        |len| rows(len) * dp,
        |n, h, panel| {
            for (s, r) in seqs[n].clone().enumerate() {
                panel[s * dp..][..d].copy_from_slice(&t[l.row(0, r, h)..][..d]);
            }
        },
    )
}

/// `t` as per-head blocks of `bc` rows, each transposed to `(dim, bc)` in
/// rows of `ld` floats (at least `bc`): block `kb` of a sequence's head
/// starts at `kb · dim · ld`.
pub(crate) fn transposed(
    t: &[f32],
    l: &Layout,
    seqs: &[Range<usize>],
    bc: usize,
    ld: usize,
) -> Panels {
    let d = l.dim;
    per_head(
        l,
        seqs,
        |len| len.div_ceil(bc) * ld * d,
        |n, h, panel| {
            for (s, r) in seqs[n].clone().enumerate() {
                let block = &mut panel[s / bc * ld * d..][..ld * d];
                let row = &t[l.row(0, r, h)..][..d];
                for (x, v) in row.iter().enumerate() {
                    block[x * ld + s % bc] = *v;
                }
            }
        },
    )
}

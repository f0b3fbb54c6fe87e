//! Combining the partial results of key splits by their LSE
//! (FlashDecoding's merge), for the forward's key splits and decoding,
//! and a sink's virtual key added to a finished row.

use super::attend::Partial;
use crate::api::merge::merge_rows;

/// Row `r` of the splits `parts` of one block of rows (their outputs in
/// rows of `ld` floats), combined into `out`; returns the combined LSE.
/// A row no split saw keeps `out = 0` and gets −inf.
pub(crate) fn merge_row(parts: &[Partial], r: usize, ld: usize, out: &mut [f32]) -> f32 {
    let n = out.len();
    merge_rows(parts.iter().map(|p| (&p.o[r * ld..][..n], p.lse[r])), out)
}

/// A row's normalized output `o` and LSE with a sink's virtual key (score
/// `sink`, value 0) added to its softmax: the LSE gains `exp(sink)`, the
/// output shrinks by `exp(lse − lse')`. A row that saw no key gets o = 0,
/// lse = sink.
pub(crate) fn with_sink(o: &mut [f32], lse: f32, sink: f32) -> f32 {
    if lse == f32::NEG_INFINITY {
        o.fill(0.0);
        return sink;
    }
    let m = lse.max(sink);
    let total = m + ((lse - m).exp() + (sink - m).exp()).ln();
    let w = (lse - total).exp();
    o.iter_mut().for_each(|x| *x *= w);
    total
}

//! The checks of an app's buffer ranges before a call on them is recorded:
//! each offset a multiple of the device's storage-offset alignment, each
//! range inside its buffer, large enough for its tensor and within one
//! storage binding, and no output range intersecting another tensor's. An
//! output may share a buffer with an input: the call then runs kernels that
//! declare their inputs writable too (`Variant::aliased`), since WebGPU
//! forbids one buffer bound read-only and writable in a dispatch but allows
//! it bound writable several times.

use crate::api::shape::AttentionShape;
use crate::api::tensor::Precision;
use crate::error::{Error, Result};
use crate::kernels::AttentionBindings;
use crate::runtime::{padded, Gpu};

/// The bytes each tensor of a problem needs in a binding (padded to 4):
/// q, k, v and o (do, dq, dk and dv like them) in the storage precision,
/// lse in f32.
pub struct TensorBytes {
    pub q: u64,
    pub kv: u64,
    pub v: u64,
    pub o: u64,
    pub lse: u64,
}

impl TensorBytes {
    /// Those of `shape` in `precision`, once its sizes are checked (a
    /// caller may have built it field by field).
    pub fn of(shape: &AttentionShape, precision: Precision) -> Result<Self> {
        shape.check()?;
        let elem = precision.bytes() as u64;
        let need = |n: usize, e: u64| padded(n as u64 * e);
        Ok(Self {
            q: need(shape.q_len(), elem),
            kv: need(shape.kv_len(), elem),
            v: need(shape.v_len(), elem),
            o: need(shape.o_len(), elem),
            lse: need(shape.lse_len(), 4),
        })
    }
}

/// One tensor's range and the bytes its tensor needs.
pub struct Range<'r, 'a> {
    pub tensor: &'static str,
    pub binding: &'r wgpu::BufferBinding<'a>,
    pub needs: u64,
}

impl<'r, 'a> Range<'r, 'a> {
    /// `tensor`'s range `binding`, which must hold `needs` bytes.
    pub fn new(tensor: &'static str, binding: &'r wgpu::BufferBinding<'a>, needs: u64) -> Self {
        Self {
            tensor,
            binding,
            needs,
        }
    }

    /// The ranges of a forward's q, k, v, o and lse in `b`, in that order,
    /// each needing its tensor's bytes in `t`.
    pub fn attention(b: &'r AttentionBindings<'a>, t: &TensorBytes) -> Vec<Self> {
        let needs = [t.q, t.kv, t.v, t.o, t.lse];
        b.named()
            .into_iter()
            .zip(needs)
            .map(|((tensor, binding), needs)| Self::new(tensor, binding, needs))
            .collect()
    }
}

/// The bytes `r` binds: its size, or the rest of its buffer.
fn bound(r: &Range) -> (u64, u64) {
    let b = r.binding;
    let size = b
        .size
        .map_or(b.buffer.size().saturating_sub(b.offset), |s| s.get());
    (b.offset, b.offset.saturating_add(size))
}

/// Whether `a` and `b` bind intersecting bytes of one buffer.
fn overlap(a: &Range, b: &Range) -> bool {
    let ((a0, a1), (b0, b1)) = (bound(a), bound(b));
    a.binding.buffer == b.binding.buffer && a0 < b1 && b0 < a1
}

/// Check `inputs` and `outputs` (a typed error naming the first tensor
/// whose range fails), and say whether an output shares a buffer with an
/// input (the call needs its aliased kernels). Inputs may overlap each
/// other; an output may overlap nothing.
pub fn check(gpu: &Gpu, inputs: &[Range], outputs: &[Range]) -> Result<bool> {
    for (n, o) in outputs.iter().enumerate() {
        let others = inputs.iter().chain(&outputs[..n]);
        if let Some(other) = others.into_iter().find(|r| overlap(r, o)) {
            return Err(Error::OverlappingBindings {
                output: o.tensor,
                other: other.tensor,
            });
        }
    }
    let alignment = gpu.limits.min_storage_buffer_offset_alignment;
    for r in inputs.iter().chain(outputs) {
        let (tensor, offset) = (r.tensor, r.binding.offset);
        // wgpu would report it at the bind group, as a validation error
        // with no name of the tensor.
        if !r.binding.buffer.usage().contains(wgpu::BufferUsages::STORAGE) {
            return Err(Error::BufferUsage {
                tensor,
                missing: "STORAGE",
            });
        }
        let buffer_size = r.binding.buffer.size();
        if offset % alignment as u64 != 0 {
            return Err(Error::MisalignedBinding {
                tensor,
                offset,
                alignment,
            });
        }
        let size = r
            .binding
            .size
            .map_or(buffer_size.saturating_sub(offset), |s| s.get());
        // An offset near u64::MAX must not wrap past the check.
        if offset.checked_add(size).is_none_or(|end| end > buffer_size) {
            return Err(Error::BindingOutsideBuffer {
                tensor,
                offset,
                size,
                buffer_size,
            });
        }
        if size < r.needs {
            return Err(Error::BufferTooSmall {
                buffer: tensor,
                size,
                needed: r.needs,
            });
        }
        gpu.within_binding(tensor, r.needs)?;
    }
    Ok(outputs.iter().any(|o| shares_buffer(o, inputs)))
}

/// Whether `r` lies in a buffer one of `others` is bound from.
pub fn shares_buffer(r: &Range, others: &[Range]) -> bool {
    others.iter().any(|o| o.binding.buffer == r.binding.buffer)
}

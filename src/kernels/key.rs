//! Every kernel flashattn runs, as one typed key: what shapes its code and
//! its pipeline. The runtime caches compiled pipelines by this key.

use super::compose::KernelSource;
use super::copy::BufferCopy;
use super::decode::{DecodeMerge, FlashDecode, KvAppend};
use super::flash_backward::{BackwardPart, FlashBackward};
use super::flash_forward::FlashForward;
use super::loop_probe::LoopProbe;
use super::loops::LoopDim;
use super::matmul::Matmul;
use super::naive::Naive;
use super::quantize::Fp8Quantize;

/// A kernel and everything its pipeline depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum KernelKey {
    FlashForward(FlashForward),
    FlashBackward(FlashBackward),
    Matmul(Matmul),
    Naive(Naive),
    LoopProbe(LoopProbe),
    FlashDecode(FlashDecode),
    KvAppend(KvAppend),
    DecodeMerge(DecodeMerge),
    BufferCopy(BufferCopy),
    Fp8Quantize(Fp8Quantize),
}

impl KernelKey {
    /// The kernel's module text, entry point and override values.
    pub fn source(&self) -> KernelSource {
        match self {
            KernelKey::FlashForward(k) => k.source(),
            KernelKey::FlashBackward(k) => k.source(),
            KernelKey::Matmul(k) => k.source(),
            KernelKey::Naive(k) => k.source(),
            KernelKey::LoopProbe(k) => k.source(),
            KernelKey::FlashDecode(k) => k.source(),
            KernelKey::KvAppend(k) => k.source(),
            KernelKey::DecodeMerge(k) => k.source(),
            KernelKey::BufferCopy(k) => k.source(),
            KernelKey::Fp8Quantize(k) => k.source(),
        }
    }

    /// The sequence the kernel's long loop walks, for kernels whose calls
    /// can be split along it.
    pub fn loop_dim(&self) -> Option<LoopDim> {
        match self {
            KernelKey::FlashForward(_) | KernelKey::FlashDecode(_) => Some(LoopDim::Keys),
            KernelKey::FlashBackward(k) => match k.part {
                BackwardPart::DkDv => Some(LoopDim::Rows),
                BackwardPart::Dq => Some(LoopDim::Keys),
                _ => None,
            },
            _ => None,
        }
    }

    /// A short name for messages.
    pub fn name(&self) -> &'static str {
        match self {
            KernelKey::FlashForward(_) => FlashForward::NAME,
            KernelKey::FlashBackward(k) => k.name(),
            KernelKey::Matmul(_) => Matmul::NAME,
            KernelKey::Naive(_) => Naive::NAME,
            KernelKey::LoopProbe(_) => LoopProbe::NAME,
            KernelKey::FlashDecode(_) => FlashDecode::NAME,
            KernelKey::KvAppend(_) => KvAppend::NAME,
            KernelKey::DecodeMerge(_) => DecodeMerge::NAME,
            KernelKey::BufferCopy(_) => BufferCopy::NAME,
            KernelKey::Fp8Quantize(_) => Fp8Quantize::NAME,
        }
    }
}

impl From<FlashForward> for KernelKey {
    fn from(k: FlashForward) -> Self {
        KernelKey::FlashForward(k)
    }
}

impl From<FlashBackward> for KernelKey {
    fn from(k: FlashBackward) -> Self {
        KernelKey::FlashBackward(k)
    }
}

impl From<Matmul> for KernelKey {
    fn from(k: Matmul) -> Self {
        KernelKey::Matmul(k)
    }
}

impl From<Naive> for KernelKey {
    fn from(k: Naive) -> Self {
        KernelKey::Naive(k)
    }
}

impl From<LoopProbe> for KernelKey {
    fn from(k: LoopProbe) -> Self {
        KernelKey::LoopProbe(k)
    }
}

impl From<FlashDecode> for KernelKey {
    fn from(k: FlashDecode) -> Self {
        KernelKey::FlashDecode(k)
    }
}

impl From<KvAppend> for KernelKey {
    fn from(k: KvAppend) -> Self {
        KernelKey::KvAppend(k)
    }
}

impl From<DecodeMerge> for KernelKey {
    fn from(k: DecodeMerge) -> Self {
        KernelKey::DecodeMerge(k)
    }
}

impl From<BufferCopy> for KernelKey {
    fn from(k: BufferCopy) -> Self {
        KernelKey::BufferCopy(k)
    }
}

impl From<Fp8Quantize> for KernelKey {
    fn from(k: Fp8Quantize) -> Self {
        KernelKey::Fp8Quantize(k)
    }
}

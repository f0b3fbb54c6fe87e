//! The copy kernel (`copy.wgsl`): one f32 buffer into another, a vec4 per
//! invocation — the adapter's storage bandwidth, measured by
//! [`crate::ops::bandwidth`].

use super::compose::{binding, Access, Composer, KernelSource, Variant};
use crate::plan::StorageKind;

const COPY: &str = include_str!("../../shaders/copy.wgsl");

/// Invocations per workgroup (the WebGPU default limit allows 256).
pub const COPY_WORKGROUP: u32 = 256;

/// The copy kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BufferCopy {
    /// Access counters and loop guard (no mask or softcap code is used).
    pub variant: Variant,
}

impl BufferCopy {
    pub const NAME: &'static str = "copy";

    pub fn source(&self) -> KernelSource {
        let mut c = Composer::new(StorageKind::F32);
        c.override_u32("WG", COPY_WORKGROUP).common(self.variant);
        c.storage(
            StorageKind::F32,
            &[
                ("src", binding::COPY_SRC, Access::Read4),
                ("dst", binding::COPY_DST, Access::Write4),
            ],
        );
        c.push(COPY).finish("main")
    }

    /// Workgroups of a copy of `len4` vec4s.
    pub fn groups(len4: u64) -> u64 {
        len4.div_ceil(COPY_WORKGROUP as u64)
    }
}

//! The copy kernel (`copy.wgsl`): one f32 buffer into another, a vec4 per
//! invocation — the adapter's storage bandwidth, measured by
//! [`crate::ops::bandwidth`] — or row by row, each row cut to a shorter
//! one (the encoded FP8 forward's padded output trimmed into the app's).

use super::compose::{binding, section, Access, Composer, KernelSource, Variant};
use crate::plan::StorageKind;

const COPY: &str = include_str!("../../shaders/copy.wgsl");

/// Invocations per workgroup (the WebGPU default limit allows 256).
pub const COPY_WORKGROUP: u32 = 256;

/// The copy kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BufferCopy {
    /// Access counters and loop guard (no mask or softcap code is used).
    pub variant: Variant,
    /// Copy rows, keeping the first `dst_row` elements of each `src_row`
    /// (an element per invocation), instead of whole vec4s.
    pub rows: bool,
}

impl BufferCopy {
    pub const NAME: &'static str = "copy";

    pub fn source(&self) -> KernelSource {
        let mut c = Composer::new(StorageKind::F32);
        c.override_u32("WG", COPY_WORKGROUP).common(self.variant);
        let (read, write, body, entry) = match self.rows {
            false => (Access::Read4, Access::Write4, "copy", "main"),
            true => (Access::Read, Access::Write, "rows", "rows_main"),
        };
        c.storage(
            StorageKind::F32,
            &[
                ("src", binding::COPY_SRC, read),
                ("dst", binding::COPY_DST, write),
            ],
        );
        c.push(&section(COPY, "common"))
            .push(&section(COPY, body))
            .finish(entry)
    }

    /// Workgroups of a copy of `len` items (vec4s, or the rows' elements).
    pub fn groups(len: u64) -> u64 {
        len.div_ceil(COPY_WORKGROUP as u64)
    }
}

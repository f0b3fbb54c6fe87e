//! WGSL composition: the one place that turns a [`Plan`] and a [`Variant`] into
//! shader text. WGSL has no `#include`, so kernels are a generated prelude of
//! constants, `common.wgsl`, storage accessors instantiated from a template per
//! buffer, and the kernel body.

use crate::plan::{Plan, StorageKind};

pub const COMMON: &str = include_str!("../../shaders/common.wgsl");
pub const STORAGE_F32: &str = include_str!("../../shaders/storage_f32.wgsl");
pub const STORAGE_F16_PACKED: &str = include_str!("../../shaders/storage_f16_packed.wgsl");
pub const STORAGE_F16_NATIVE: &str = include_str!("../../shaders/storage_f16_native.wgsl");
pub const FLASH_FWD: &str = include_str!("../../shaders/flash_fwd.wgsl");
pub const NAIVE_FWD: &str = include_str!("../../shaders/naive_fwd.wgsl");

/// Which specialized code paths a kernel contains. A variant without a mask
/// contains no mask code (the flags are `const`, so branches fold away).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Variant {
    /// Causal and/or local window.
    pub masked: bool,
    pub softcap: bool,
}

/// Whether a buffer is read or written by the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
}

fn template(storage: StorageKind) -> &'static str {
    match storage {
        StorageKind::F32 => STORAGE_F32,
        StorageKind::F16Packed => STORAGE_F16_PACKED,
        StorageKind::F16Native => STORAGE_F16_NATIVE,
    }
}

/// The text of one `// @section` of a storage template.
fn section(template: &str, name: &str) -> String {
    let marker = format!("// @{name}");
    let mut out = String::new();
    let mut inside = false;
    for line in template.lines() {
        if line.starts_with("// @") {
            inside = line.trim() == marker;
            continue;
        }
        if inside {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// Declarations and accessors for the given buffers in one storage kind:
/// `load_{name}` for reads, `store_{name}` for writes, and `round_storage`.
pub fn storage_decls(storage: StorageKind, buffers: &[(&str, u32, Access)]) -> String {
    let t = template(storage);
    let mut out = section(t, "common");
    for &(name, binding, access) in buffers {
        let part = match access {
            Access::Read => "read",
            Access::Write => "write",
        };
        out.push_str(
            &section(t, part)
                .replace("{name}", name)
                .replace("{binding}", &binding.to_string()),
        );
    }
    out
}

/// `const` lines for every `(name, value)`.
fn consts(values: &[(&str, String)]) -> String {
    values
        .iter()
        .map(|(n, v)| format!("const {n} = {v};\n"))
        .collect()
}

fn prelude(storage: StorageKind, constants: &[(&str, String)]) -> String {
    let mut s = String::new();
    if storage == StorageKind::F16Native {
        s.push_str("enable f16;\n");
    }
    s.push_str(&consts(constants));
    s.push_str(COMMON);
    s
}

/// The q, k, v, o, lse bindings every forward kernel uses (binding 0 is `params`).
fn forward_buffers(storage: StorageKind) -> String {
    let mut s = storage_decls(
        storage,
        &[
            ("q", 1, Access::Read),
            ("k", 2, Access::Read),
            ("v", 3, Access::Read),
            ("o", 4, Access::Write),
        ],
    );
    // LSE is f32 whatever the storage precision.
    s.push_str(
        &section(STORAGE_F32, "write")
            .replace("{name}", "lse")
            .replace("{binding}", "5"),
    );
    s
}

fn flags(variant: Variant) -> [(&'static str, String); 2] {
    [
        ("IS_MASKED", variant.masked.to_string()),
        ("HAS_SOFTCAP", variant.softcap.to_string()),
    ]
}

/// The flash forward kernel for a plan: the tile sizes in the text are the
/// plan's, so the declared workgroup bytes equal `plan.workgroup_bytes`.
pub fn flash_forward(plan: &Plan, variant: Variant) -> String {
    let u = |x: u32| format!("{x}u");
    let mut c = vec![
        ("BR", u(plan.br)),
        ("BC", u(plan.bc)),
        ("D", u(plan.head_dim)),
        ("TC", u(plan.threads_per_row)),
        ("WG", u(plan.workgroup_size)),
        ("SC", u(plan.scores_per_thread())),
        ("ACC", u(plan.acc_per_thread())),
    ];
    c.extend(flags(variant));
    let mut s = prelude(plan.storage, &c);
    s.push_str(&forward_buffers(plan.storage));
    s.push_str(FLASH_FWD);
    s
}

/// The naive (materialized S/P) forward kernels; entry points `scores`,
/// `softmax`, `pv`.
pub fn naive_forward(head_dim: u32, storage: StorageKind, variant: Variant) -> String {
    let mut c = vec![("D", format!("{head_dim}u"))];
    c.extend(flags(variant));
    let mut s = prelude(storage, &c);
    s.push_str(&forward_buffers(storage));
    s.push_str(NAIVE_FWD);
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_are_split() {
        let read = section(STORAGE_F32, "read");
        assert!(read.contains("fn load_{name}"));
        assert!(!read.contains("store_"));
        let decls = storage_decls(StorageKind::F16Packed, &[("q", 1, Access::Read)]);
        assert!(decls.contains("@binding(1) var<storage, read> q_buf: array<u32>"));
        assert!(decls.contains("fn round_storage"));
    }
}

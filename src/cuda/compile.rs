//! NVRTC: a kernel variant's source to PTX for one virtual architecture.

use super::kernel::KernelKey;
use crate::error::{Error, Result};
use cudarc::nvrtc::{self, CompileError, CompileOptions, Ptx};

/// Whether libnvrtc can be loaded (cudarc panics on first use otherwise).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { nvrtc::sys::is_culib_present() }
}

/// The NVRTC architecture option for compute capability `major.minor`:
/// `compute_90a` on Hopper (the arch-specific features FA3's path needs),
/// else `compute_XY`.
pub fn arch_for(major: i32, minor: i32) -> String {
    let suffix = if (major, minor) == (9, 0) { "a" } else { "" };
    format!("compute_{major}{minor}{suffix}")
}

/// The NVRTC options for `arch` (also part of the disk cache's hash).
pub fn options(arch: &str) -> Vec<String> {
    vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()]
}

/// Compile `key`'s module for `arch` (e.g. `compute_80`, `compute_90a`).
pub fn compile_ptx(key: &KernelKey, arch: &str) -> Result<Ptx> {
    if !nvrtc_present() {
        return Err(Error::CudaUnavailable {
            missing: "NVRTC (libnvrtc, e.g. pip's nvidia-cuda-nvrtc-cu12 on LD_LIBRARY_PATH)",
        });
    }
    let opts = CompileOptions {
        options: options(arch),
        // No fast math (NVRTC's default): exact expf/logf/tanhf and IEEE
        // division, since the accuracy rule is tight for f32 storage.
        name: Some(format!("{}.cu", key.label())),
        ..Default::default()
    };
    nvrtc::compile_ptx_with_opts(key.source(), opts).map_err(|e| Error::CudaCompile {
        kernel: key.label(),
        arch: arch.to_string(),
        log: match e {
            CompileError::CompileError { log, .. } => log.to_string_lossy().into_owned(),
            other => format!("{other:?}"),
        },
    })
}

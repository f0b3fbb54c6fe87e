//! NVRTC: a kernel variant's source to PTX for one virtual architecture.

use super::kernel::KernelKey;
use crate::error::{Error, Result};
use cudarc::nvrtc::{self, CompileError, CompileOptions, Ptx};

/// Whether libnvrtc can be loaded (cudarc panics on first use otherwise).
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { nvrtc::sys::is_culib_present() }
}

/// NVRTC's version (major, minor), where libnvrtc loads.
pub fn nvrtc_version() -> Option<(i32, i32)> {
    if !nvrtc_present() {
        return None;
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: libnvrtc loads (checked above).
    let status = unsafe { nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
    (status == nvrtc::sys::nvrtcResult::NVRTC_SUCCESS).then_some((major, minor))
}

/// `FLASHATTN_CUDA_BOUNDED_WAIT_MS`: the GPU checks' bound on each
/// mbarrier wait of the Hopper kernel (cuda/hopper.cuh): past it the
/// waiting thread prints its block, thread, barrier and phase and traps,
/// instead of hanging. Unset (or not a positive number): unbounded.
pub fn bounded_wait_ms() -> Option<u32> {
    std::env::var("FLASHATTN_CUDA_BOUNDED_WAIT_MS")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .filter(|&ms| ms > 0)
}

/// An NVRTC virtual architecture: `compute_XY`, or `compute_XYa` (the
/// features of exactly X.Y, such as Hopper's wgmma and setmaxnreg).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Arch {
    /// Compute capability X.
    pub major: i32,
    /// Compute capability .Y.
    pub minor: i32,
    /// The `a` suffix: PTX that runs on compute capability X.Y only.
    pub specific: bool,
}

impl Arch {
    /// What a device of compute capability `major.minor` is compiled for:
    /// `compute_90a` on Hopper (the features FA3's path needs), else
    /// `compute_XY`.
    pub fn for_device(major: i32, minor: i32) -> Self {
        Self {
            major,
            minor,
            specific: (major, minor) == (9, 0),
        }
    }

    /// NVRTC's name for it.
    pub fn name(&self) -> String {
        let suffix = if self.specific { "a" } else { "" };
        format!("compute_{}{}{suffix}", self.major, self.minor)
    }

    /// Whether its PTX loads on `device` (compute capability
    /// `major.minor`): an architecture no newer than the device's, and the
    /// device's own for an `a` one.
    pub fn check_runs_on(&self, device: &str, major: i32, minor: i32) -> Result<()> {
        let unfit = |why| {
            Err(Error::CudaArchUnfit {
                arch: self.name(),
                device: format!("{device} (compute capability {major}.{minor})"),
                why,
            })
        };
        if (self.major, self.minor) > (major, minor) {
            unfit("the device is older than the architecture")
        } else if self.specific && (self.major, self.minor) != (major, minor) {
            unfit("an `a` architecture runs on exactly its own compute capability")
        } else {
            Ok(())
        }
    }
}

impl std::str::FromStr for Arch {
    type Err = Error;
    /// `compute_80`, `sm_90a` or `90a`: compute capability 8.0 or later
    /// (what the kernels need).
    fn from_str(s: &str) -> Result<Self> {
        let digits = s
            .strip_prefix("compute_")
            .or_else(|| s.strip_prefix("sm_"))
            .unwrap_or(s);
        let (digits, specific) = match digits.strip_suffix('a') {
            Some(d) => (d, true),
            None => (digits, false),
        };
        let parsed = (digits.len() >= 2 && digits.bytes().all(|b| b.is_ascii_digit()))
            .then(|| digits.split_at(digits.len() - 1))
            .and_then(|(major, minor)| Some((major.parse().ok()?, minor.parse().ok()?)));
        match parsed {
            Some((major, minor)) if major >= 8 => Ok(Self {
                major,
                minor,
                specific,
            }),
            _ => Err(Error::UnknownName {
                what: "CUDA architecture",
                name: s.to_string(),
                expected:
                    "compute_80 or later (e.g. compute_80, compute_86, compute_90, compute_90a)",
            }),
        }
    }
}

/// The NVRTC options for `key` on `arch` (also part of the disk cache's
/// hash): the Hopper kernel's mbarrier waits bounded where
/// [`bounded_wait_ms`] asks (the other kernels have none).
pub fn options(key: &KernelKey, arch: &str) -> Vec<String> {
    options_bounded(key, arch, bounded_wait_ms())
}

/// [`options`] with the wait bound given.
pub fn options_bounded(key: &KernelKey, arch: &str, bound_ms: Option<u32>) -> Vec<String> {
    let mut opts = vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()];
    if let Some(ms) = bound_ms.filter(|_| key.family.is_wgmma()) {
        opts.push(format!("-DFLASHATTN_BOUNDED_WAIT_MS={ms}"));
    }
    opts
}

/// Compile `key`'s module for `arch` (e.g. `compute_80`, `compute_90a`).
pub fn compile_ptx(key: &KernelKey, arch: &str) -> Result<Ptx> {
    compile_ptx_with(key, arch, options(key, arch))
}

/// [`compile_ptx`] with these NVRTC options ([`options_bounded`]'s).
pub fn compile_ptx_with(key: &KernelKey, arch: &str, options: Vec<String>) -> Result<Ptx> {
    if !nvrtc_present() {
        return Err(Error::CudaUnavailable {
            missing: "NVRTC (libnvrtc, e.g. pip's nvidia-cuda-nvrtc-cu12 on LD_LIBRARY_PATH)",
        });
    }
    let opts = CompileOptions {
        options,
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::tensor::Precision;
    use crate::cuda::kernel::Family;

    #[test]
    fn the_wait_bound_reaches_the_hopper_kernel_alone() {
        let key = |family| KernelKey::new(family, Precision::F16, 64, true, false);
        let bounded = options_bounded(&key(Family::ForwardWgmma), "compute_90a", Some(4000));
        assert!(bounded.contains(&"-DFLASHATTN_BOUNDED_WAIT_MS=4000".to_string()));
        let plain = options_bounded(&key(Family::ForwardWgmma), "compute_90a", None);
        assert_eq!(plain, ["--gpu-architecture=compute_90a", "--std=c++17"]);
        // The other kernels have no mbarrier waits: their PTX (and its cache
        // entry) stays the same.
        let mma = options_bounded(&key(Family::ForwardMma), "compute_90a", Some(4000));
        assert_eq!(mma, plain);
    }
}

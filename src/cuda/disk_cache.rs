//! PTX kept on disk between processes, named by a hash of what it was
//! compiled from (source, NVRTC options, architecture), so a changed kernel
//! or option never reuses a stale file. Best effort: a cache that cannot be
//! read or written only costs a compile.

use super::compile::{compile_ptx, options};
use super::kernel::KernelKey;
use crate::error::Result;
use cudarc::nvrtc::Ptx;
use std::path::PathBuf;

/// `FLASHATTN_CUDA_CACHE`, else `cuda` in flashattn's cache directory
/// ([`crate::disk_cache::cache_dir`]); `None` with neither (no caching).
fn cache_dir() -> Option<PathBuf> {
    crate::disk_cache::env_dir("FLASHATTN_CUDA_CACHE")
        .or_else(|| crate::disk_cache::cache_dir().map(|d| d.join("cuda")))
}

/// FNV-1a, 64 bits: stable across Rust versions and platforms, unlike
/// std's hasher, so file names stay valid from one build to the next.
fn fnv1a(parts: &[&str]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for b in part.bytes().chain([0]) {
            h = (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
    h
}

/// The file name of `key`'s PTX for `arch`.
fn file_name(key: &KernelKey, arch: &str) -> String {
    let source = key.source();
    let opts = options(key, arch).join(" ");
    let hash = fnv1a(&[&source, &opts, arch]);
    format!("{}-{arch}-{hash:016x}.ptx", key.label())
}

/// `key`'s PTX for `arch`: from the cache, or compiled and stored there.
pub(crate) fn cached_ptx(key: &KernelKey, arch: &str) -> Result<Ptx> {
    let Some(dir) = cache_dir() else {
        return compile_ptx(key, arch);
    };
    let path = dir.join(file_name(key, arch));
    if let Ok(text) = std::fs::read_to_string(&path) {
        return Ok(Ptx::from_src(text));
    }
    let ptx = compile_ptx(key, arch)?;
    // Written under a temporary name and renamed, so a process reading the
    // cache never sees half a file.
    let tmp = dir.join(format!(".{}.{}", file_name(key, arch), std::process::id()));
    let stored = std::fs::create_dir_all(&dir)
        .and_then(|()| std::fs::write(&tmp, ptx.to_src()))
        .and_then(|()| std::fs::rename(&tmp, &path));
    if stored.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    Ok(ptx)
}

/// Compile every key of `keys` for `arch` into the cache, over all cores
/// (rayon's pool): what a later load of each finds there. The errors of
/// those that failed; without a cache folder, compiling only checks them.
#[cfg(feature = "lab")]
pub fn warm(keys: &[KernelKey], arch: &str) -> Vec<crate::error::Error> {
    use rayon::prelude::*;
    keys.par_iter()
        .filter_map(|key| cached_ptx(key, arch).err())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::tensor::Precision;
    use crate::cuda::kernel::Family;

    #[test]
    fn names_change_with_the_variant_and_the_architecture() {
        let f16 = KernelKey::new(Family::Forward, Precision::F16, 64, false, false);
        let bf16 = KernelKey {
            precision: Precision::Bf16,
            ..f16
        };
        let names = [
            file_name(&f16, "compute_80"),
            file_name(&f16, "compute_90a"),
            file_name(&bf16, "compute_80"),
        ];
        assert_eq!(names[0], file_name(&f16, "compute_80"), "stable");
        assert!(names[0].starts_with("flash_fwd_f16_d64-compute_80-"));
        assert!(names[0] != names[1] && names[0] != names[2] && names[1] != names[2]);
        // Nothing hashed: FNV-1a's offset basis.
        assert_eq!(fnv1a(&[]), 0xcbf2_9ce4_8422_2325);
    }
}

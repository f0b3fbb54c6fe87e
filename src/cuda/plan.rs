//! Which CUDA kernels a call runs, as a pure function of the device's
//! properties and the problem: on compute capability 9.x the Hopper
//! forward (wgmma + TMA) for f16/bf16 with d % 8 == 0 up to d 128, with
//! the Hopper backward (D, dK/dV with, at head dim 64, dQ's ordered
//! partials, else a dQ kernel of its own; dropout,
//! which they do not draw, runs the sm80 kernels); else the tensor-core (mma) kernels for
//! f16/bf16 up to head dim [`MMA_MAX_HEAD_DIM`] on compute capability 8.0
//! or later when their shared memory fits, the scalar kernels otherwise,
//! or the path a caller forces ([`KernelPath`], `FLASHATTN_CUDA_KERNEL`, the
//! command line's `--kernel` with `--backend cuda`). Unit-tested with
//! made-up A100/H100/H200 properties; `flashattn plan --backend cuda`
//! prints [`CudaPlan::explain`].

use super::compile::Arch;
use super::kernel::{Family, KernelKey, MMA_MAX_HEAD_DIM, WGMMA_HEAD_DIMS};
#[cfg(feature = "lab")]
use super::kernel::STATIC_SHARED_LIMIT;
use crate::api::tensor::Precision;
use crate::error::{Error, Result};

/// Which kernels to run: chosen ([`KernelPath::Auto`]) or forced.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KernelPath {
    /// The fastest path the device and the call take.
    #[default]
    Auto,
    /// The scalar kernels (f32 FMAs on f32 tiles), any precision.
    Scalar,
    /// The sm80 tensor-core kernels; an error where they cannot run (on
    /// Hopper: the Hopper forward forced off, for comparison).
    Mma,
    /// The Hopper forward and backward; an error where they cannot run.
    Hopper,
    /// What `Auto` chooses with the Hopper forward left out: the sm80
    /// tensor-core kernels where they run, the scalar ones elsewhere (what
    /// the GPU checks run once the Hopper smoke test has failed).
    NoHopper,
}

impl std::str::FromStr for KernelPath {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "scalar" => Ok(Self::Scalar),
            "mma" => Ok(Self::Mma),
            "hopper" => Ok(Self::Hopper),
            "no-hopper" => Ok(Self::NoHopper),
            other => Err(Error::UnknownName {
                what: "CUDA kernel path",
                name: other.to_string(),
                expected: "auto, scalar, mma, hopper or no-hopper",
            }),
        }
    }
}

impl KernelPath {
    /// `FLASHATTN_CUDA_KERNEL` (auto when unset or empty).
    pub fn from_env() -> Result<Self> {
        match std::env::var("FLASHATTN_CUDA_KERNEL") {
            Ok(v) if !v.is_empty() => v.parse(),
            _ => Ok(Self::Auto),
        }
    }
}

/// What the plan needs to know about a device (cudarc's device
/// attributes, or made up for tests and `flashattn plan`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DeviceProps {
    /// The device's name.
    pub name: String,
    /// Compute capability X.
    pub major: i32,
    /// Compute capability .Y.
    pub minor: i32,
    /// Streaming multiprocessors.
    pub sms: usize,
    /// Shared memory one block may opt in to (bytes).
    pub smem_per_block_optin: usize,
    /// Shared memory per multiprocessor (bytes).
    pub smem_per_sm: usize,
    /// Resident threads per multiprocessor.
    pub max_threads_per_sm: usize,
    /// What the kernels are compiled for: the device's own architecture
    /// unless overridden (`--arch`, `FLASHATTN_CUDA_ARCH`), and what the
    /// plan chooses by (compute_80 on an H100 runs the sm80 path).
    pub arch: Arch,
}

impl DeviceProps {
    /// An A100-like device: 108 SMs, 164 KiB shared memory per SM.
    pub fn a100() -> Self {
        Self::made_up("A100-like", 8, 0, 108, 163 * 1024, 164 * 1024)
    }
    /// An H100 SXM-like device: 132 SMs, 228 KiB per SM (227 per block).
    pub fn h100() -> Self {
        Self::made_up("H100-like", 9, 0, 132, 227 * 1024, 228 * 1024)
    }
    /// An H200-like device: H100's SMs and shared memory.
    pub fn h200() -> Self {
        Self::made_up("H200-like", 9, 0, 132, 227 * 1024, 228 * 1024)
    }
    fn made_up(name: &str, major: i32, minor: i32, sms: usize, block: usize, sm: usize) -> Self {
        Self {
            name: name.into(),
            major,
            minor,
            sms,
            smem_per_block_optin: block,
            smem_per_sm: sm,
            max_threads_per_sm: 2048,
            arch: Arch::for_device(major, minor),
        }
    }
}

/// The problem's compile-time facts.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PlanProblem {
    pub precision: Precision,
    pub head_dim: usize,
    pub band: bool,
    pub softcap: bool,
    /// A softmax scale above 0: the Hopper forward takes the row max of
    /// raw dot products and folds the scale into exp2's argument.
    pub positive_scale: bool,
    /// Dropout (`p > 0`): the scalar and sm80 kernels' dropout variants.
    pub dropout: bool,
}

/// The kernels of one call: a forward and a backward module (D, dK/dV and
/// dQ; on the Hopper path at head dim 64 the dK/dV kernel adds dQ's
/// partials and `flash_bwd_dq_convert` rounds them, past it
/// `flash_bwd_dq_wgmma` computes dQ).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CudaPlan {
    pub forward: KernelKey,
    pub backward: KernelKey,
    /// Why this path, in a few words.
    pub reason: &'static str,
    /// Why the forward is not the Hopper kernel, where it is not.
    pub not_hopper: Option<&'static str>,
}

/// Why the Hopper forward cannot run `p` on `dev`, if it cannot.
fn hopper_blocker(dev: &DeviceProps, p: &PlanProblem) -> Option<&'static str> {
    let key = KernelKey::new(
        Family::ForwardWgmma,
        p.precision,
        p.head_dim,
        p.band,
        p.softcap,
    );
    if p.precision == Precision::F32 {
        Some("f32 storage (the Hopper forward takes f16 and bf16)")
    } else if !p.positive_scale {
        Some("a scale of 0 or below (the Hopper forward takes each row's max of the raw dot products)")
    } else if p.dropout {
        Some("dropout (the Hopper forward draws no mask; the sm80 kernels do)")
    } else if dev.major != 9 {
        Some("compute capability other than 9.x (wgmma and setmaxnreg are sm_90a's)")
    } else if dev.arch != Arch::for_device(9, 0) {
        Some("kernels compiled for an architecture other than compute_90a (wgmma and setmaxnreg are its own)")
    } else if !p.head_dim.is_multiple_of(8) {
        Some("a head dim not a multiple of 8 (TMA reads rows of whole 16-byte units)")
    } else if !WGMMA_HEAD_DIMS.contains(&key.head_dim) {
        Some("a head dim past 128 (the Hopper forward's O and S fragments would spill)")
    } else if key.dynamic_shared_bytes() > dev.smem_per_block_optin {
        Some("more shared memory than the device gives a block (the Hopper forward's)")
    } else if key_of(Family::BackwardWgmma, p).dynamic_shared_bytes() > dev.smem_per_block_optin {
        Some("more shared memory than the device gives a block (the Hopper dK/dV's)")
    } else {
        None
    }
}

/// `family`'s variant for `p`.
fn key_of(family: Family, p: &PlanProblem) -> KernelKey {
    KernelKey::new(family, p.precision, p.head_dim, p.band, p.softcap).with_dropout(p.dropout)
}

/// Why the tensor-core kernels cannot run `p` on `dev`, if they cannot.
fn mma_blocker(dev: &DeviceProps, p: &PlanProblem) -> Option<&'static str> {
    let forward = KernelKey::new(
        Family::ForwardMma,
        p.precision,
        p.head_dim,
        p.band,
        p.softcap,
    )
    .with_dropout(p.dropout);
    let backward = KernelKey::new(
        Family::BackwardMma,
        p.precision,
        p.head_dim,
        p.band,
        p.softcap,
    )
    .with_dropout(p.dropout);
    // Dynamic shared memory plus the static (dropout's keep bits).
    let smem = |k: KernelKey| k.dynamic_shared_bytes() + k.shared_bytes();
    if p.precision == Precision::F32 {
        Some("f32 storage (the tensor-core kernels take f16 and bf16)")
    } else if forward.head_dim > MMA_MAX_HEAD_DIM {
        Some("a head dim past 128 (the tensor-core accumulators would spill)")
    } else if dev.major < 8 {
        Some("compute capability below 8.0 (no mma.sync m16n8k16 for bf16, no cp.async)")
    } else if smem(forward).max(smem(backward)) > dev.smem_per_block_optin {
        Some("more shared memory than the device gives a block")
    } else {
        None
    }
}

/// The kernels `problem` runs on `dev` under `path`: an error only when
/// [`KernelPath::Mma`] is forced where those kernels cannot run.
pub fn plan(dev: &DeviceProps, problem: &PlanProblem, path: KernelPath) -> Result<CudaPlan> {
    let blocker = mma_blocker(dev, problem);
    let not_hopper = hopper_blocker(dev, problem);
    let key = |family| key_of(family, problem);
    let hopper = match (path, not_hopper.or(blocker)) {
        (KernelPath::Hopper, Some(why)) => {
            return Err(Error::Unsupported {
                what: "the CUDA backend's Hopper path",
                feature: why,
            })
        }
        (KernelPath::Hopper, None) => Some("the Hopper kernels, as requested"),
        (KernelPath::Auto, None) => Some(
            "Hopper: the wgmma + TMA forward and backward on compute capability 9.x",
        ),
        _ => None,
    };
    if let Some(reason) = hopper {
        return Ok(CudaPlan {
            forward: key(Family::ForwardWgmma),
            backward: key(Family::BackwardWgmma),
            reason,
            not_hopper: None,
        });
    }
    let (mma, reason) = match (path, blocker) {
        (KernelPath::Scalar, _) => (false, "the scalar kernels, as requested"),
        (KernelPath::Mma, Some(why)) => {
            return Err(Error::Unsupported {
                what: "the CUDA backend's tensor-core path",
                feature: why,
            })
        }
        (KernelPath::Mma | KernelPath::Hopper, None) => {
            (true, "the tensor-core kernels, as requested")
        }
        (KernelPath::Auto | KernelPath::NoHopper, None) => {
            (true, "tensor cores: f16/bf16 on compute capability 8.0+")
        }
        (KernelPath::Auto | KernelPath::NoHopper, Some(why)) => (false, why),
        (KernelPath::Hopper, Some(why)) => (false, why),
    };
    let (fwd, bwd) = match mma {
        true => (Family::ForwardMma, Family::BackwardMma),
        false => (Family::Forward, Family::Backward),
    };
    Ok(CudaPlan {
        forward: key(fwd),
        backward: key(bwd),
        reason,
        not_hopper: match path {
            KernelPath::Mma => Some("the sm80 tensor-core kernels forced"),
            KernelPath::Scalar => Some("the scalar kernels forced"),
            KernelPath::NoHopper => Some("the Hopper forward turned off (no-hopper)"),
            _ => not_hopper,
        },
    })
}

impl CudaPlan {
    /// Lines naming each module's tiles, warps, stages and shared memory,
    /// and how many blocks of it one of `dev`'s SMs holds.
    #[cfg(feature = "lab")]
    pub fn explain(&self, dev: &DeviceProps) -> Vec<String> {
        let mut lines = vec![format!("path: {}", self.reason)];
        if let Some(why) = self.not_hopper {
            lines.push(format!("not the Hopper forward: {why}"));
        }
        lines.extend([
            "occupancy counts shared memory and threads, not registers (tests/cuda.rs prints ptxas's)"
                .to_string(),
        ]);
        for (what, key) in [("forward", &self.forward), ("backward", &self.backward)] {
            let t = key.tiles();
            let smem = key.shared_bytes() + key.dynamic_shared_bytes();
            // The driver reserves 1 KiB of shared memory per block.
            let by_smem = dev.smem_per_sm / (smem + 1024);
            let by_threads = dev.max_threads_per_sm / t.threads;
            let blocks = by_smem.min(by_threads);
            lines.push(format!(
                "{what}: {} ({}), {} rows × {} streamed per block, {} warps, {} stage{}, \
                 {smem} B shared ({}), {blocks} blocks per SM ({}), {} blocks resident",
                key.label(),
                if key.family.is_wgmma() {
                    "wgmma + TMA + mbarriers; 1 producer and 2 consumer warpgroups"
                } else if key.family.is_mma() {
                    "mma.sync m16n8k16 + ldmatrix + cp.async"
                } else {
                    "f32 FMAs"
                },
                t.rows,
                t.keys,
                t.warps(),
                key.stages(),
                if key.stages() > 1 { "s" } else { "" },
                if smem > STATIC_SHARED_LIMIT {
                    "dynamic, opted in past 48 KiB"
                } else {
                    "within 48 KiB"
                },
                if by_smem < by_threads {
                    "limited by shared memory"
                } else {
                    "limited by threads"
                },
                blocks * dev.sms,
            ));
        }
        lines
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn problem(precision: Precision, head_dim: usize) -> PlanProblem {
        PlanProblem {
            precision,
            head_dim,
            band: true,
            softcap: false,
            positive_scale: true,
            dropout: false,
        }
    }

    #[test]
    fn f16_and_bf16_take_tensor_cores_on_a100_h100_and_h200() {
        for dev in [
            DeviceProps::a100(),
            DeviceProps::h100(),
            DeviceProps::h200(),
        ] {
            let (forward, backward) = match dev.major {
                9 => (Family::ForwardWgmma, Family::BackwardWgmma),
                _ => (Family::ForwardMma, Family::BackwardMma),
            };
            for precision in [Precision::F16, Precision::Bf16] {
                for d in [40, 64, 96, 128] {
                    let p = plan(&dev, &problem(precision, d), KernelPath::Auto).unwrap();
                    assert_eq!((p.forward.family, p.backward.family), (forward, backward));
                    assert!(p.forward.band && !p.forward.softcap);
                }
            }
        }
    }

    #[test]
    fn hopper_takes_the_wgmma_forward_unless_forced_off_or_the_head_dim_is_off_8() {
        let h100 = DeviceProps::h100();
        let p = plan(&h100, &problem(Precision::F16, 96), KernelPath::Auto).unwrap();
        assert_eq!(p.forward.head_dim, 128);
        // Forced off: the sm80 kernels, saying so.
        let off = plan(&h100, &problem(Precision::F16, 96), KernelPath::Mma).unwrap();
        assert_eq!(off.forward.family, Family::ForwardMma);
        assert_eq!(off.backward.family, Family::BackwardMma);
        assert!(off.explain(&h100)[1].contains("forced"));
        // d 36: TMA's rows are not whole 16-byte units; the sm80 kernels, with why.
        let odd = plan(&h100, &problem(Precision::Bf16, 36), KernelPath::Auto).unwrap();
        assert_eq!(odd.forward.family, Family::ForwardMma);
        assert!(odd.not_hopper.unwrap().contains("multiple of 8"));
        // A scale of 0 or below: the sm80 forward.
        let negative = PlanProblem {
            positive_scale: false,
            ..problem(Precision::Bf16, 128)
        };
        let sm80 = plan(&h100, &negative, KernelPath::Auto).unwrap();
        assert_eq!(sm80.forward.family, Family::ForwardMma);
        assert!(sm80.not_hopper.unwrap().contains("scale of 0 or below"));
        // Forcing Hopper where it cannot run is an error naming why.
        let a100 = DeviceProps::a100();
        for (dev, p) in [
            (&a100, problem(Precision::F16, 64)),
            (&h100, problem(Precision::F32, 64)),
            (&h100, problem(Precision::F16, 160)),
            (&h100, problem(Precision::F16, 36)),
        ] {
            let err = plan(dev, &p, KernelPath::Hopper).unwrap_err();
            assert!(err.to_string().contains("Hopper path"), "{err}");
        }
        let forced = plan(&h100, &problem(Precision::F16, 64), KernelPath::Hopper).unwrap();
        assert_eq!(forced.forward.family, Family::ForwardWgmma);
        assert_eq!("hopper".parse::<KernelPath>().unwrap(), KernelPath::Hopper);
        let text = forced.explain(&h100).join("\n");
        // 82 KiB: two blocks per SM.
        assert!(
            text.contains("128 rows × 128 streamed per block, 12 warps, 2 stages, 83024 B"),
            "{text}"
        );
        assert!(text.contains("2 blocks per SM"), "{text}");
        // The dK/dV: K and V (128 keys), two stages of Q and dO (64 rows),
        // two buffers of dS, two dQ partials, their LSE and D rows and 5
        // mbarriers; dQ in the same module.
        assert!(
            text.contains("backward: flash_bwd_wgmma_f16_d64_band (wgmma + TMA + mbarriers; 1 producer and 2 consumer warpgroups), 128 rows × 64 streamed per block, 12 warps, 2 stages, 137256 B"),
            "{text}"
        );
    }

    /// Dropout runs the dropout variants: on Hopper the sm80 forward (the
    /// Hopper forward draws no mask, and forcing it is an error naming why),
    /// f32 on the scalar kernels; without it no variant has dropout.
    #[test]
    fn dropout_runs_the_sm80_or_scalar_dropout_variants() {
        let h100 = DeviceProps::h100();
        let dropout = |p| PlanProblem {
            dropout: true,
            ..p
        };
        let sm80 = plan(
            &h100,
            &dropout(problem(Precision::Bf16, 128)),
            KernelPath::Auto,
        )
        .unwrap();
        assert_eq!(
            (sm80.forward.family, sm80.backward.family),
            (Family::ForwardMma, Family::BackwardMma)
        );
        assert!(sm80.forward.dropout && sm80.backward.dropout);
        assert!(sm80.not_hopper.unwrap().contains("dropout"));
        let forced = plan(
            &h100,
            &dropout(problem(Precision::Bf16, 128)),
            KernelPath::Hopper,
        );
        assert!(forced.unwrap_err().to_string().contains("dropout"));
        let scalar = plan(
            &h100,
            &dropout(problem(Precision::F32, 64)),
            KernelPath::Auto,
        )
        .unwrap();
        assert_eq!(scalar.forward.family, Family::Forward);
        assert!(scalar.forward.dropout && scalar.backward.dropout);
        let plain = plan(&h100, &problem(Precision::Bf16, 128), KernelPath::Auto).unwrap();
        assert_eq!(plain.forward.family, Family::ForwardWgmma);
        assert!(!plain.forward.dropout && !plain.backward.dropout);
    }

    #[test]
    fn f32_long_heads_and_old_devices_run_the_scalar_kernels() {
        let a100 = DeviceProps::a100();
        let mut turing = DeviceProps::a100();
        turing.major = 7;
        for (dev, p) in [
            (&a100, problem(Precision::F32, 64)),
            (&a100, problem(Precision::F16, 160)),
            (&turing, problem(Precision::Bf16, 64)),
        ] {
            let chosen = plan(dev, &p, KernelPath::Auto).unwrap();
            assert_eq!(chosen.forward.family, Family::Forward, "{p:?}");
            assert_eq!(chosen.backward.family, Family::Backward, "{p:?}");
            // Forcing the tensor cores there is an error naming why.
            let forced = plan(dev, &p, KernelPath::Mma).unwrap_err();
            assert!(forced.to_string().contains(chosen.reason), "{forced}");
        }
    }

    /// Past 256 (MLA's 576, an odd 300) every path runs the scalar
    /// kernels at a wide padded head dim, and forcing the tensor cores or
    /// the Hopper forward says why not.
    #[test]
    fn wide_head_dims_run_the_scalar_kernels_at_a_wide_variant() {
        for dev in [DeviceProps::a100(), DeviceProps::h200()] {
            for (d, padded) in [(300, 384), (512, 512), (576, 576)] {
                for precision in [Precision::F32, Precision::Bf16] {
                    let p = problem(precision, d);
                    let chosen = plan(&dev, &p, KernelPath::Auto).unwrap();
                    assert_eq!(chosen.forward.family, Family::Forward, "d {d}");
                    assert_eq!(chosen.backward.family, Family::Backward, "d {d}");
                    assert_eq!((chosen.forward.head_dim, chosen.backward.head_dim), (padded, padded));
                    if precision == Precision::Bf16 {
                        assert!(chosen.reason.contains("past 128"), "{}", chosen.reason);
                        assert!(plan(&dev, &p, KernelPath::Mma).is_err());
                        assert!(plan(&dev, &p, KernelPath::Hopper).is_err());
                    }
                }
            }
        }
    }

    #[test]
    fn a_device_with_little_shared_memory_falls_back() {
        let mut small = DeviceProps::a100();
        small.smem_per_block_optin = 48 * 1024;
        // d 64's forward fits (37 KiB) but its backward (54 KiB) does not.
        let p = plan(&small, &problem(Precision::F16, 64), KernelPath::Auto).unwrap();
        assert_eq!(p.forward.family, Family::Forward);
        assert!(p.reason.contains("shared memory"));
    }

    #[test]
    fn scalar_can_be_forced_and_paths_parse() {
        let p = plan(
            &DeviceProps::h200(),
            &problem(Precision::F16, 64),
            KernelPath::Scalar,
        )
        .unwrap();
        assert_eq!(p.forward.family, Family::Forward);
        assert_eq!("mma".parse::<KernelPath>().unwrap(), KernelPath::Mma);
        assert!("tensor".parse::<KernelPath>().is_err());
    }

    /// no-hopper: auto with the Hopper forward left out — the sm80 kernels
    /// where they run, the scalar ones elsewhere (never an error).
    #[test]
    fn no_hopper_is_auto_without_the_hopper_forward() {
        let h200 = DeviceProps::h200();
        assert_eq!(
            "no-hopper".parse::<KernelPath>().unwrap(),
            KernelPath::NoHopper
        );
        for (precision, d, family) in [
            (Precision::F16, 64, Family::ForwardMma),
            (Precision::Bf16, 128, Family::ForwardMma),
            (Precision::F32, 64, Family::Forward),
            (Precision::F16, 200, Family::Forward),
        ] {
            let p = plan(&h200, &problem(precision, d), KernelPath::NoHopper).unwrap();
            assert_eq!(p.forward.family, family, "{precision:?} d {d}");
            assert!(p.explain(&h200)[1].contains("turned off"), "{p:?}");
        }
    }

    /// `--arch`: the plan chooses by the architecture compiled for, and
    /// an architecture the device cannot run is a typed error.
    #[test]
    fn an_older_architecture_on_hopper_runs_the_sm80_path() {
        let h100 = DeviceProps::h100();
        let mut sm80_build = h100.clone();
        sm80_build.arch = "compute_80".parse().unwrap();
        let mut plain_90 = h100.clone();
        plain_90.arch = "sm_90".parse().unwrap();
        for (dev, family) in [
            (&h100, Family::ForwardWgmma),
            (&sm80_build, Family::ForwardMma),
            (&plain_90, Family::ForwardMma),
        ] {
            let p = plan(dev, &problem(Precision::Bf16, 128), KernelPath::Auto).unwrap();
            assert_eq!(p.forward.family, family, "{}", dev.arch.name());
        }
        assert!(plan(
            &sm80_build,
            &problem(Precision::Bf16, 128),
            KernelPath::Hopper
        )
        .is_err());
        let arch = |s: &str| s.parse::<Arch>();
        assert_eq!(arch("compute_90a").unwrap(), Arch::for_device(9, 0));
        assert_eq!(arch("90a").unwrap().name(), "compute_90a");
        assert_eq!(arch("sm_86").unwrap().name(), "compute_86");
        assert_eq!(Arch::for_device(8, 6).name(), "compute_86");
        for bad in ["compute_75", "compute_9", "compute_x0", "sm_", "hopper"] {
            assert!(matches!(arch(bad), Err(Error::UnknownName { .. })), "{bad}");
        }
        let runs = |a: &str, major, minor| arch(a).unwrap().check_runs_on("gpu", major, minor);
        assert!(runs("compute_80", 9, 0).is_ok());
        assert!(runs("compute_90a", 9, 0).is_ok());
        for (a, major, minor) in [
            ("compute_90", 8, 0),
            ("compute_90a", 10, 0),
            ("compute_86", 8, 0),
        ] {
            assert!(
                matches!(runs(a, major, minor), Err(Error::CudaArchUnfit { .. })),
                "{a} on {major}.{minor}"
            );
        }
    }

    #[test]
    fn the_explanation_names_tiles_warps_stages_and_occupancy() {
        let h200 = DeviceProps::h200();
        let p = plan(&h200, &problem(Precision::Bf16, 128), KernelPath::Mma).unwrap();
        let text = p.explain(&h200).join("\n");
        // d 128 forward: FA2's 128 rows against 64-key tiles, 4 warps, one
        // buffer of K and one of V: Q, K and V in 68 KiB and the boundary
        // tiles' allowed bits in 1 KiB: 3 blocks per SM on 228 KiB, 396 on
        // 132 SMs.
        assert!(
            text.contains("128 rows × 64 streamed per block, 4 warps, 1 stage, 70656 B"),
            "{text}"
        );
        assert!(
            text.contains("3 blocks per SM (limited by shared memory), 396 blocks resident"),
            "{text}"
        );
        let a100 = DeviceProps::a100();
        let text = p.explain(&a100).join("\n");
        assert!(text.contains("2 blocks per SM"), "{text}");
    }
}

//! Run-time instruction-set dispatch: every hot loop of the CPU backend is
//! generic over a [`Kernel`] (its micro-tile shape and multiply-add) and is
//! compiled once per instruction set inside a `#[target_feature]` entry
//! point, so the same source becomes AVX-512, AVX2+FMA, NEON or portable
//! code, and the fastest the machine has is picked when a call starts.

use super::micro::Portable;
#[cfg(target_arch = "x86_64")]
use super::micro::{Avx2, Avx512};
use crate::error::{Error, Result};
use std::sync::OnceLock;

/// An instruction set the CPU backend has kernels for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Isa {
    /// x86-64 with AVX-512F (and AVX2, FMA, F16C): 16-lane vectors.
    Avx512,
    /// x86-64 with AVX2, FMA and F16C (every AVX2 chip has it): 8-lane vectors.
    Avx2Fma,
    /// aarch64's Advanced SIMD (always present there): 4-lane vectors with FMA.
    Neon,
    /// Whatever the compiler targets by default, without FMA.
    Portable,
}

/// Work compiled per instruction set: `run` is monomorphized for each
/// [`Kernel`] and inlined into that set's `#[target_feature]` entry point.
pub(crate) trait Task {
    type Output;
    fn run<K: super::micro::Kernel>(self) -> Self::Output;
}

impl Isa {
    /// The instruction set [`Cpu::new`](super::Cpu::new) runs: the one
    /// `$FLASHATTN_CPU_ISA` names (`avx512`, `avx2+fma`, `neon`,
    /// `portable`) where the machine has it, else the fastest it has. The
    /// variable lets an AVX-512 machine run and time the AVX2 kernels; a
    /// name it does not know, or a set the machine lacks, is ignored.
    pub fn detect() -> Isa {
        let chosen = std::env::var("FLASHATTN_CPU_ISA").ok().and_then(|name| {
            Isa::available()
                .iter()
                .copied()
                .find(|isa| isa.name() == name.trim())
        });
        chosen.unwrap_or(Isa::available()[0])
    }

    /// Every instruction set this machine runs, fastest first.
    pub fn available() -> &'static [Isa] {
        static AVAILABLE: OnceLock<Vec<Isa>> = OnceLock::new();
        AVAILABLE.get_or_init(detect_all)
    }

    /// `Ok(self)` when this machine can run it.
    pub fn check(self) -> Result<Isa> {
        if Isa::available().contains(&self) {
            Ok(self)
        } else {
            Err(Error::IsaUnavailable { isa: self.name() })
        }
    }

    /// The name it parses from.
    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx512 => "avx512",
            Isa::Avx2Fma => "avx2+fma",
            Isa::Neon => "neon",
            Isa::Portable => "portable",
        }
    }

    /// Run `task` compiled for this instruction set. An instruction set the
    /// machine lacks (only reachable past [`Isa::check`]) runs the portable code.
    pub(crate) fn run<T: Task>(self, task: T) -> T::Output {
        if !Isa::available().contains(&self) {
            return task.run::<Portable>();
        }
        match self {
            // SAFETY: `available()` detected the features these entry points enable.
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => unsafe { run_avx512(task) },
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2Fma => unsafe { run_avx2(task) },
            #[cfg(target_arch = "aarch64")]
            Isa::Neon => task.run::<super::micro::Neon>(),
            _ => task.run::<Portable>(),
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma,f16c")]
unsafe fn run_avx512<T: Task>(task: T) -> T::Output {
    task.run::<Avx512>()
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn run_avx2<T: Task>(task: T) -> T::Output {
    task.run::<Avx2>()
}

/// The instruction sets this machine runs, fastest first (detected once).
fn detect_all() -> Vec<Isa> {
    // NEON is part of aarch64's base instruction set: nothing to detect.
    let mut out = if cfg!(target_arch = "aarch64") {
        vec![Isa::Neon]
    } else {
        Vec::new()
    };
    #[cfg(target_arch = "x86_64")]
    {
        let avx2 = std::arch::is_x86_feature_detected!("avx2")
            && std::arch::is_x86_feature_detected!("fma")
            && std::arch::is_x86_feature_detected!("f16c");
        if avx2 && std::arch::is_x86_feature_detected!("avx512f") {
            out.push(Isa::Avx512);
        }
        if avx2 {
            out.push(Isa::Avx2Fma);
        }
    }
    out.push(Isa::Portable);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On aarch64 the NEON kernels are the ones that run (the tests of the
    /// CPU backend run every available set; this one fails if NEON is not
    /// among them); on x86-64 they never are.
    #[test]
    fn the_targets_own_kernels_come_first() {
        let all = Isa::available();
        assert_eq!(all.last(), Some(&Isa::Portable));
        #[cfg(target_arch = "aarch64")]
        assert_eq!(all, [Isa::Neon, Isa::Portable]);
        #[cfg(not(target_arch = "aarch64"))]
        assert!(!all.contains(&Isa::Neon));
        if std::env::var_os("FLASHATTN_CPU_ISA").is_none() {
            assert_eq!(Isa::detect(), all[0]);
        }
    }
}

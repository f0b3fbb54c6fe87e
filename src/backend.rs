//! Choosing and running a backend: wgpu (an [`Engine`]), the CPU, or CUDA
//! (feature `cuda`). `auto` takes CUDA where it opens and takes the problem,
//! else a hardware GPU when there is one; where the only adapters run on
//! the CPU (llvmpipe over Vulkan or GL, SwiftShader, WARP) it measures the
//! problem on the fastest kernels such an adapter has against the CPU
//! backend and takes the faster — and always says why.

use crate::engine::Engine;
use crate::error::{Error, Result};
// Running a backend blocks on the GPU's futures, which only native targets can.
#[cfg(not(target_arch = "wasm32"))]
use crate::{
    api::decode::{DecodeOutput, DecodeStep, HostKvCache},
    api::inputs::BackwardInputs,
    api::options::{AttentionOptions, Fp8Options},
    api::output::{BackwardOutput, CallStats, ForwardOutput},
    api::tensor::TensorView,
    choice::{choose, Decision, Workload},
    cpu,
    plan::PlanOverrides,
    verify::Verification,
};

/// Which implementation to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// CUDA where a CUDA device opens and takes the problem (builds with
    /// the `cuda` feature); else a hardware GPU when one exists; else the
    /// faster of a CPU adapter's kernels and the CPU backend, measured on
    /// the problem.
    Auto,
    Wgpu,
    Cpu,
    Cuda,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            Self::Auto => "auto",
            Self::Wgpu => "wgpu",
            Self::Cpu => "cpu",
            Self::Cuda => "cuda",
        }
    }
}

impl std::str::FromStr for BackendKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "wgpu" => Ok(Self::Wgpu),
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda),
            other => Err(Error::UnknownName {
                what: "backend",
                name: other.to_string(),
                expected: "auto, wgpu, cpu or cuda",
            }),
        }
    }
}

/// `auto` in a build with the `cuda` feature: CUDA on device 0 when it
/// opens and takes the workload (an NVIDIA GPU runs its own kernels faster
/// than wgpu's portable ones), else why not, for the reason given.
#[cfg(feature = "cuda")]
#[cfg(not(target_arch = "wasm32"))]
fn auto_cuda(workload: &Workload) -> std::result::Result<Choice, String> {
    let cuda = crate::cuda::Cuda::new().map_err(|e| e.to_string())?;
    crate::cuda::takes(workload).map_err(|e| format!("{e}, on {}", cuda.describe()))?;
    Ok(Choice {
        reason: format!(
            "CUDA on {} (auto prefers CUDA where a CUDA device opens)",
            cuda.describe()
        ),
        backend: Backend::Cuda(Box::new(cuda)),
    })
}

/// A ready backend.
#[derive(Debug)]
pub enum Backend {
    Wgpu(Box<Engine>),
    Cpu,
    /// The CUDA kernels on device 0 (feature `cuda`).
    #[cfg(all(feature = "cuda", not(target_arch = "wasm32")))]
    Cuda(Box<crate::cuda::Cuda>),
}

/// A backend and the reason it was chosen, for the user.
#[derive(Debug)]
pub struct Choice {
    pub backend: Backend,
    pub reason: String,
}

impl Backend {
    /// Open the backend `kind` asks for; for `Auto`, choose for `workload`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn open(kind: BackendKind, workload: &Workload) -> Result<Choice> {
        match kind {
            BackendKind::Cpu => Ok(Choice {
                backend: Backend::Cpu,
                reason: "the CPU backend, as requested".into(),
            }),
            BackendKind::Wgpu => {
                let e = Engine::new()?;
                let reason = format!("wgpu on {}, as requested", e.describe());
                Ok(Choice {
                    backend: Backend::Wgpu(Box::new(e)),
                    reason,
                })
            }
            BackendKind::Auto => {
                #[cfg(feature = "cuda")]
                let not_cuda = match auto_cuda(workload) {
                    Ok(choice) => return Ok(choice),
                    Err(why) => why,
                };
                #[allow(unused_mut)]
                let mut choice = match pollster::block_on(choose(workload))? {
                    Decision::Gpu(engine, reason) => Choice {
                        backend: Backend::Wgpu(engine),
                        reason,
                    },
                    Decision::Cpu(reason) => Choice {
                        backend: Backend::Cpu,
                        reason,
                    },
                };
                #[cfg(feature = "cuda")]
                {
                    choice.reason = format!("{} (not CUDA: {not_cuda})", choice.reason);
                }
                Ok(choice)
            }
            #[cfg(feature = "cuda")]
            BackendKind::Cuda => {
                let cuda = crate::cuda::Cuda::new()?;
                let reason = format!("CUDA on {}, as requested", cuda.describe());
                Ok(Choice {
                    backend: Backend::Cuda(Box::new(cuda)),
                    reason,
                })
            }
            #[cfg(not(feature = "cuda"))]
            BackendKind::Cuda => Err(Error::BackendNotBuilt { backend: "cuda" }),
        }
    }

    /// One line naming the backend.
    pub fn name(&self) -> String {
        match self {
            Backend::Wgpu(e) => format!("wgpu on {}", e.describe()),
            Backend::Cpu => format!("cpu ({} threads)", rayon::current_num_threads()),
            #[cfg(all(feature = "cuda", not(target_arch = "wasm32")))]
            Backend::Cuda(c) => format!("cuda on {}", c.describe()),
        }
    }

    #[cfg(not(target_arch = "wasm32"))]
    pub fn forward(
        &self,
        [q, k, v]: [&TensorView; 3],
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<ForwardOutput> {
        let on_cpu = || cpu::forward(q, k, v, opts);
        match self {
            Backend::Wgpu(e) => or_cpu(e.forward_with(q, k, v, opts, overrides), on_cpu, |o| {
                &mut o.stats
            }),
            Backend::Cpu => on_cpu(),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.forward(q, k, v, opts),
        }
    }

    /// The FP8 (e4m3) forward: `o` f32.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn forward_fp8(
        &self,
        qkv: [&TensorView; 3],
        opts: &AttentionOptions,
        fp8: &Fp8Options,
        overrides: &PlanOverrides,
    ) -> Result<ForwardOutput> {
        match self {
            Backend::Wgpu(e) => e.forward_fp8_with(qkv, opts, fp8, overrides),
            Backend::Cpu => cpu::forward_fp8(qkv[0], qkv[1], qkv[2], opts, fp8),
            #[cfg(feature = "cuda")]
            Backend::Cuda(_) => Err(Error::Unsupported {
                what: "the CUDA backend",
                feature: "FP8 (e4m3)",
            }),
        }
    }

    /// Gradients given the forward's `o` and `lse` (in `inputs`).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn backward(
        &self,
        inputs: &BackwardInputs,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<BackwardOutput> {
        let on_cpu = || cpu::backward(inputs, opts);
        match self {
            Backend::Wgpu(e) => or_cpu(e.backward_with(inputs, opts, overrides), on_cpu, |o| {
                &mut o.stats
            }),
            Backend::Cpu => on_cpu(),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.backward(inputs, opts),
        }
    }

    /// One decoding step on a host cache (appended in place when the step
    /// has `k_new`/`v_new`); `num_splits` `None` lets the planner split.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn decode(
        &self,
        cache: &mut HostKvCache,
        step: &DecodeStep,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodeOutput> {
        match self {
            // A step that fails verification has not touched the cache.
            Backend::Wgpu(e) => {
                let wgpu = e.decode_host(cache, step, opts, num_splits);
                or_cpu(
                    wgpu,
                    || cpu::decode(cache, step, opts, num_splits),
                    |o| &mut o.stats,
                )
            }
            Backend::Cpu => cpu::decode(cache, step, opts, num_splits),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.decode(cache, step, opts),
        }
    }
}

/// A wgpu call's result; where every kernel family that could run it
/// failed its known-answer check on this device, the CPU backend's instead
/// (never wrong numbers), with why in its stats' verification.
#[cfg(not(target_arch = "wasm32"))]
fn or_cpu<T>(
    wgpu: Result<T>,
    cpu: impl FnOnce() -> Result<T>,
    stats: fn(&mut T) -> &mut CallStats,
) -> Result<T> {
    match wgpu {
        Err(Error::VerificationFailed { call, tried }) => {
            let mut out = cpu()?;
            let why = format!("every wgpu {call} kernel family failed its check ({tried})");
            stats(&mut out).verification = Some(Verification::cpu_instead(why));
            Ok(out)
        }
        other => other,
    }
}

//! Choosing and running a backend: wgpu (an [`Engine`]), the CPU, or CUDA
//! (feature `cuda`). `auto` takes CUDA where it opens and takes the problem,
//! else a hardware GPU when there is one; where the only adapters run on
//! the CPU (llvmpipe over Vulkan or GL, SwiftShader, WARP) it measures the
//! problem on the fastest kernels such an adapter has against the CPU
//! backend and takes the faster — and always says why.

pub mod attend;

pub use attend::{AttentionBackend, Capabilities};

use crate::engine::Engine;
use crate::error::{Error, Result};
// Running a backend blocks on the GPU's futures, which only native targets can.
#[cfg(not(target_arch = "wasm32"))]
use crate::{
    api::decode::{DecodeOutput, DecodeStep, HostKvCache},
    kv_quant::QuantKvCache,
    api::inputs::{BackwardInputs, ForwardInputs},
    api::options::{AttentionOptions, Fp8Options},
    api::output::{BackwardOutput, CallStats, ForwardOutput},
    choice::{choose, Decision, Workload},
    cpu::Cpu,
    plan::PlanOverrides,
    verify::Verification,
};

/// Which implementation to run (`"auto"`, `"wgpu"`, `"cpu"` or `"cuda"`
/// parse to these).
///
/// ```
/// use flashattn::BackendKind;
///
/// let kind: BackendKind = "cpu".parse()?;
/// assert_eq!(kind, BackendKind::Cpu);
/// assert_eq!(kind.name(), "cpu");
/// # Ok::<(), flashattn::Error>(())
/// ```
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum BackendKind {
    /// CUDA where a CUDA device opens and takes the problem (builds with
    /// the `cuda` feature); else a hardware GPU when one exists; else the
    /// faster of a CPU adapter's kernels and the CPU backend, measured on
    /// the problem.
    Auto,
    /// The WGSL kernels on a wgpu adapter ([`Engine`]).
    Wgpu,
    /// The CPU backend.
    Cpu,
    /// The CUDA kernels (builds without the `cuda` feature answer
    /// [`Error::BackendNotBuilt`] when asked for it).
    Cuda,
}

impl BackendKind {
    /// The name it parses from.
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
    cuda.takes(workload).map_err(|e| format!("{e}, on {}", cuda.describe()))?;
    Ok(Choice {
        reason: format!(
            "CUDA on {} (auto prefers CUDA where a CUDA device opens)",
            cuda.describe()
        ),
        backend: Backend::Cuda(Box::new(cuda)),
    })
}

/// A ready backend: run any operation through [`Backend::as_attention`]
/// or the methods below (which fall back to the CPU where every wgpu
/// kernel family failed its check on the device).
///
/// ```
/// use flashattn::{AttentionOptions, Backend, ForwardInputs, PlanOverrides, TensorView};
///
/// let x = vec![0.25f32; 1 * 16 * 2 * 32];
/// let view = TensorView::f32([1, 16, 2, 32], &x);
/// let backend = Backend::Cpu;
/// let opts = AttentionOptions::default().causal(true);
/// let out = backend.forward(&ForwardInputs::new(view, view, view), &opts, &PlanOverrides::default())?;
/// assert_eq!(out.lse.len(), 1 * 2 * 16);
/// # Ok::<(), flashattn::Error>(())
/// ```
#[derive(Debug)]
#[non_exhaustive]
pub enum Backend {
    /// The WGSL kernels on a wgpu device.
    Wgpu(Box<Engine>),
    /// The CPU backend on this machine's fastest instruction set.
    Cpu,
    /// The CUDA kernels on device 0; only builds with the `cuda` feature
    /// can make one (without it, [`Cuda`] has no values).
    Cuda(Box<Cuda>),
}

#[cfg(all(feature = "cuda", not(target_arch = "wasm32")))]
pub use crate::cuda::Cuda;

/// The CUDA backend's handle in a build without the `cuda` feature: it
/// has no values, so [`Backend::Cuda`] exists in every build but only a
/// build with the feature can hold one.
#[cfg(not(all(feature = "cuda", not(target_arch = "wasm32"))))]
#[derive(Debug)]
pub struct Cuda {
    _never: std::convert::Infallible,
}

#[cfg(not(all(feature = "cuda", not(target_arch = "wasm32"))))]
impl Cuda {
    /// A value of this type cannot exist; code holding one is unreachable.
    #[cfg(not(target_arch = "wasm32"))]
    fn absurd(&self) -> ! {
        let never = self._never;
        match never {}
    }
}

/// A backend and the reason it was chosen, for the user.
#[derive(Debug)]
#[non_exhaustive]
pub struct Choice {
    /// The backend, ready to run.
    pub backend: Backend,
    /// Why it was chosen (what `auto` measured or found).
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

    /// The backend as the one call model ([`AttentionBackend`]) every
    /// operation below dispatches through.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn as_attention(&self) -> &dyn AttentionBackend {
        match self {
            Backend::Wgpu(e) => e.as_ref(),
            Backend::Cpu => fastest_cpu(),
            #[cfg(feature = "cuda")]
            Backend::Cuda(c) => c.as_ref(),
            #[cfg(not(feature = "cuda"))]
            Backend::Cuda(c) => c.absurd(),
        }
    }

    /// Which implementation this is.
    pub fn kind(&self) -> BackendKind {
        match self {
            Backend::Wgpu(_) => BackendKind::Wgpu,
            Backend::Cpu => BackendKind::Cpu,
            Backend::Cuda(_) => BackendKind::Cuda,
        }
    }

    /// What the backend runs.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn capabilities(&self) -> Capabilities {
        self.as_attention().capabilities()
    }

    /// One line naming the backend.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn name(&self) -> String {
        self.capabilities().name
    }

    /// Exact attention forward: `o` and `lse`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn forward(
        &self,
        inputs: &ForwardInputs,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<ForwardOutput> {
        or_cpu(
            self,
            self.as_attention().forward(inputs, opts, overrides),
            || AttentionBackend::forward(fastest_cpu(), inputs, opts, overrides),
            |o| &mut o.stats,
        )
    }

    /// The FP8 (e4m3) forward: `o` f32.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn forward_fp8(
        &self,
        inputs: &ForwardInputs,
        opts: &AttentionOptions,
        fp8: &Fp8Options,
        overrides: &PlanOverrides,
    ) -> Result<ForwardOutput> {
        or_cpu(
            self,
            self.as_attention().forward_fp8(inputs, opts, fp8, overrides),
            || fastest_cpu().forward_fp8(inputs, opts, fp8, overrides),
            |o| &mut o.stats,
        )
    }

    /// Gradients given the forward's `o` and `lse` (in `inputs`).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn backward(
        &self,
        inputs: &BackwardInputs,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<BackwardOutput> {
        or_cpu(
            self,
            self.as_attention().backward(inputs, opts, overrides),
            || fastest_cpu().backward(inputs, opts),
            |o| &mut o.stats,
        )
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
        // A step that fails verification has not touched the cache.
        or_cpu(
            self,
            self.as_attention().decode(cache, step, opts, num_splits),
            || fastest_cpu().decode(cache, step, opts, num_splits),
            |o| &mut o.stats,
        )
    }

    /// One decoding step on a quantized host cache (the new rows quantized
    /// in place first); `num_splits` as for [`decode`](Self::decode).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn decode_quantized(
        &self,
        cache: &mut QuantKvCache,
        step: &DecodeStep,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> Result<DecodeOutput> {
        or_cpu(
            self,
            self.as_attention()
                .decode_quantized(cache, step, opts, num_splits),
            || fastest_cpu().decode_quantized(cache, step, opts, num_splits),
            |o| &mut o.stats,
        )
    }
}

/// The CPU backend on this machine's fastest instruction set.
#[cfg(not(target_arch = "wasm32"))]
fn fastest_cpu() -> &'static Cpu {
    static CPU: std::sync::OnceLock<Cpu> = std::sync::OnceLock::new();
    CPU.get_or_init(Cpu::new)
}

/// A call's result; where every kernel family that could run it failed
/// its known-answer check on this device, the CPU backend's instead
/// (never wrong numbers), with why in its stats' verification.
#[cfg(not(target_arch = "wasm32"))]
fn or_cpu<T>(
    backend: &Backend,
    wgpu: Result<T>,
    cpu: impl FnOnce() -> Result<T>,
    stats: fn(&mut T) -> &mut CallStats,
) -> Result<T> {
    match wgpu {
        Err(Error::VerificationFailed { call, tried }) => {
            let mut out = cpu()?;
            let why = format!(
                "every {} {call} kernel family failed its check ({tried})",
                backend.kind().name()
            );
            stats(&mut out).verification = Some(Verification::cpu_instead(why));
            Ok(out)
        }
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::tensor::TensorData;
    use crate::random::Rng;

    /// `Backend::Cpu` reaches the CPU backend through the one call model:
    /// its forward passes the accuracy rule against the f64 reference, its
    /// capabilities say what it runs, and an op it lacks nowhere is typed.
    #[test]
    fn the_cpu_backend_runs_through_the_trait() {
        let backend = Backend::Cpu;
        let caps = backend.capabilities();
        assert!(caps.backward && caps.decode && caps.fp8 && !caps.plan_overrides);
        assert_eq!(backend.kind(), BackendKind::Cpu);
        let shape = [1, 9, 2, 16];
        let mut rng = Rng::new(7);
        let data: Vec<TensorData> = (0..3)
            .map(|_| TensorData::F32(rng.normal_vec(9 * 2 * 16, 1.0)))
            .collect();
        let [q, k, v] = [0, 1, 2].map(|i| data[i].view(shape));
        let opts = AttentionOptions::default().causal(true);
        let out = backend
            .forward(&ForwardInputs::new(q, k, v), &opts, &PlanOverrides::default())
            .unwrap();
        for check in crate::accuracy::check_forward(&out, &q, &k, &v, &opts).unwrap() {
            assert!(check.passed(), "{check}");
        }
        let bad = TensorData::F32(vec![0.0; 9 * 2 * 8]);
        let short = bad.view([1, 9, 2, 8]);
        assert!(matches!(
            backend.forward(&ForwardInputs::new(q, short, v), &opts, &PlanOverrides::default()),
            Err(Error::DimMismatch {
                dim: "head_dim",
                ..
            })
        ));
    }
}

//! Backend-independent results and the backend choice used by the CLI and demo.

use crate::error::{Error, Result};
use crate::gpu::{CallStats, Engine};
use crate::tensor::{AttentionShape, Tensor};
// Only the blocking `Backend` methods use these, and they are native-only.
#[cfg(not(target_arch = "wasm32"))]
use crate::{cpu, options::AttentionOptions, plan::PlanOverrides, tensor::TensorView};

/// The result of a forward pass.
#[derive(Clone, Debug)]
pub struct ForwardOutput {
    /// `(batch, seqlen_q, heads_q, head_dim)`, in the inputs' precision.
    pub o: Tensor,
    /// `(batch, heads_q, seqlen_q)`, f32, natural log; `-inf` for rows with no allowed key.
    pub lse: Vec<f32>,
    pub shape: AttentionShape,
    /// What the call did on the device (empty on the CPU backend).
    pub stats: CallStats,
}

impl ForwardOutput {
    pub fn lse_tensor(&self) -> Tensor {
        Tensor {
            shape: self.shape.lse_shape().to_vec(),
            data: crate::tensor::TensorData::F32(self.lse.clone()),
        }
    }
}

/// The result of a backward pass: gradients in the inputs' shapes and precision.
#[derive(Clone, Debug)]
pub struct BackwardOutput {
    pub dq: Tensor,
    pub dk: Tensor,
    pub dv: Tensor,
    /// What the call did on the device (empty on the CPU backend).
    pub stats: CallStats,
}

/// Which implementation to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendKind {
    /// The GPU when an adapter exists, else the CPU.
    Auto,
    Wgpu,
    Cpu,
    Cuda,
}

impl std::str::FromStr for BackendKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "wgpu" => Ok(Self::Wgpu),
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda),
            other => Err(Error::Option(format!(
                "unknown backend `{other}` (expected auto, wgpu, cpu or cuda)"
            ))),
        }
    }
}

/// A ready backend.
#[derive(Debug)]
pub enum Backend {
    Wgpu(Box<Engine>),
    Cpu,
}

#[cfg(not(target_arch = "wasm32"))]
impl Backend {
    /// Open the requested backend. For `Auto`, a missing adapter falls back to
    /// the CPU and the returned notice says so.
    pub fn open(kind: BackendKind) -> Result<(Self, Option<String>)> {
        match kind {
            BackendKind::Cpu => Ok((Backend::Cpu, None)),
            BackendKind::Wgpu => Ok((Backend::Wgpu(Box::new(Engine::new()?)), None)),
            BackendKind::Auto => match Engine::new() {
                Ok(e) => {
                    let note = format!("using the GPU backend on {}", e.describe());
                    Ok((Backend::Wgpu(Box::new(e)), Some(note)))
                }
                Err(e) => Ok((
                    Backend::Cpu,
                    Some(format!(
                        "no GPU adapter ({e}); falling back to the CPU backend"
                    )),
                )),
            },
            BackendKind::Cuda => Err(Error::Unsupported(
                "the cuda backend is not built into this binary (rebuild with `--features cuda`)"
                    .into(),
            )),
        }
    }

    pub fn name(&self) -> String {
        match self {
            Backend::Wgpu(e) => format!("wgpu on {}", e.describe()),
            Backend::Cpu => format!("cpu ({} threads)", rayon::current_num_threads()),
        }
    }

    pub fn forward(
        &self,
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<ForwardOutput> {
        match self {
            Backend::Wgpu(e) => e.forward_with(q, k, v, opts, overrides),
            Backend::Cpu => cpu::forward(q, k, v, opts),
        }
    }

    /// Gradients given the forward's `o` and `lse`.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        o: &TensorView,
        lse: &[f32],
        d_o: &TensorView,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<BackwardOutput> {
        match self {
            Backend::Wgpu(e) => e.backward_with(q, k, v, o, lse, d_o, opts, overrides),
            Backend::Cpu => cpu::backward(q, k, v, o, lse, d_o, opts),
        }
    }
}

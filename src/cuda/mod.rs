//! The CUDA backend (feature `cuda`): FlashAttention-2's forward and
//! backward as CUDA C kernels (the top-level `cuda/` folder), compiled at
//! run time by NVRTC for the device's architecture and loaded through the
//! driver API (cudarc, loaded dynamically: a build with the feature runs
//! everywhere, and without libcuda, NVRTC or a device [`Cuda::new`]
//! returns [`Error::CudaUnavailable`](crate::Error::CudaUnavailable)
//! naming what is missing, never a panic).
//!
//! This first increment computes with f32 FMAs on tiles converted to f32 in
//! shared memory (f16 and bf16 storage converted on load, f32
//! accumulation), not yet with tensor-core MMAs, cp.async or the Hopper
//! path (issue 12). It takes the band and score options (causal, local
//! windows, softcap, scale, GQA/MQA, empty rows) and head dims 1..=256;
//! other layouts are `Unsupported`.
//!
//! - [`kernel`]: the typed key of each compiled variant, its tiles and source;
//! - [`compile`]: NVRTC, source to PTX;
//! - [`context`]: the driver, device 0 and the module cache;
//! - disk_cache: PTX kept between processes, named by a hash of source,
//!   options and architecture (`FLASHATTN_CUDA_CACHE` to place it);
//! - forward and backward: uploads, launches, readbacks.
//!
//! Tests without a GPU (tests/cuda.rs): the typed error without a driver,
//! every variant through NVRTC where libnvrtc loads (and ptxas's spill
//! count), and the kernels run on the CPU under cuda/emulate/ against a
//! double reference where a C++20 compiler is named:
//!
//! ```text
//! pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12
//! export LD_LIBRARY_PATH=$SITE/nvidia/cuda_nvrtc/lib    # libnvrtc.so.12
//! export FLASHATTN_PTXAS=$SITE/nvidia/cuda_nvcc/bin/ptxas  # optional: spills
//! export FLASHATTN_CXX=g++                                 # optional: emulation
//! FLASHATTN_REQUIRE_NVRTC=1 cargo test --release --features cuda --test cuda
//! ```

mod backward;
pub mod compile;
pub mod context;
mod disk_cache;
mod forward;
pub mod kernel;
mod problem;

pub use context::{driver_present, CudaDevice};

use crate::api::inputs::BackwardInputs;
use crate::api::options::AttentionOptions;
use crate::api::output::{BackwardOutput, ForwardOutput};
use crate::api::tensor::TensorView;
use crate::error::Result;

/// The CUDA backend on device 0.
#[derive(Debug)]
pub struct Cuda {
    device: CudaDevice,
}

impl Cuda {
    /// Open device 0: `Error::CudaUnavailable` naming the missing driver,
    /// NVRTC or device.
    pub fn new() -> Result<Self> {
        Ok(Self {
            device: CudaDevice::open()?,
        })
    }

    /// One line naming the device.
    pub fn describe(&self) -> String {
        self.device.describe()
    }

    /// Exact attention forward: o and lse.
    pub fn forward(
        &self,
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        opts: &AttentionOptions,
    ) -> Result<ForwardOutput> {
        forward::forward(&self.device, [q, k, v], opts)
    }

    /// Gradients dq, dk, dv from the forward's o and lse.
    pub fn backward(
        &self,
        inputs: &BackwardInputs,
        opts: &AttentionOptions,
    ) -> Result<BackwardOutput> {
        backward::backward(&self.device, inputs, opts)
    }
}

//! The wgpu backend: engine, kernels' host code and WGSL composition.

mod backward;
mod engine;
mod forward;
pub mod io;
mod matmul;
mod naive;
mod params;
pub mod shaders;
mod split;

pub use engine::{Allocation, CallStats, Engine};
pub use forward::AttentionBuffers;
pub use matmul::CeilingResult;
pub use params::Params;

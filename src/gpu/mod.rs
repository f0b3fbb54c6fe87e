//! The wgpu backend: engine, kernels' host code and WGSL composition.

mod engine;
mod forward;
mod naive;
mod params;
pub mod shaders;

pub use engine::{Allocation, CallStats, Engine};
pub use forward::AttentionBuffers;
pub use params::Params;

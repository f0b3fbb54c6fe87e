//! The CPU backend: the same semantics as the GPU kernels, in f32 on all
//! cores (rayon). The fallback where no adapter exists, and the faster path
//! on some CPU-only machines (see `--backend auto`).

mod backward;
mod decode;
mod forward;
mod fp8;

pub use backward::backward;
pub use decode::decode;
pub use forward::forward;
pub use fp8::forward_fp8;

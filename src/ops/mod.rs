//! Operations built from kernels and the runtime: the flash forward and
//! backward (on host tensors, split and rerun as needed; or on device
//! buffers), the FP8 forward, decoding against KV caches, the naive
//! baseline, the matmul ceiling and the copy bandwidth.

pub mod backward;
pub mod bandwidth;
pub mod bindings;
pub mod ceiling;
pub mod decode;
pub mod forward;
pub mod fp8;
pub mod naive;
pub mod pieces;
pub mod prepare;
pub mod reruns;

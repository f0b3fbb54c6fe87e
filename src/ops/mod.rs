//! Operations built from kernels and the runtime: the flash forward and
//! backward (on host tensors, split and rerun as needed; or on device
//! buffers), decoding against KV caches, the naive baseline, the matmul
//! ceiling and the copy bandwidth.

pub mod backward;
pub mod bandwidth;
pub mod ceiling;
pub mod decode;
pub mod forward;
pub mod naive;
pub mod pieces;
pub mod reruns;

use crate::api::options::AttentionOptions;
use crate::error::{Error, Result};

/// The options the wgpu kernels take.
fn check_features(opts: &AttentionOptions) -> Result<()> {
    let unsupported = [
        (opts.varlen.is_some(), "packed (varlen) batches"),
        (opts.alibi.is_some(), "ALiBi"),
        (opts.sinks.is_some(), "attention sinks"),
        (opts.block_mask.is_some(), "block-sparse masks"),
    ];
    match unsupported.into_iter().find(|(on, _)| *on) {
        Some((_, feature)) => Err(Error::Unsupported {
            what: "the wgpu backend",
            feature,
        }),
        None => Ok(()),
    }
}

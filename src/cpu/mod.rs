//! The CPU backend: the same semantics as the GPU kernels, in f32 on all
//! cores (rayon). The fallback where no adapter exists, and the faster path
//! on some CPU-only machines (see `--backend auto`).

mod backward;
mod decode;
mod forward;

pub use backward::backward;
pub use decode::decode;
pub use forward::forward;

use crate::api::options::AttentionOptions;
use crate::api::shape::AttentionShape;
use crate::error::{Error, Result};

/// The options validated for `shape`, and the layouts this backend takes.
fn check(shape: &AttentionShape, opts: &AttentionOptions) -> Result<()> {
    opts.validate_for(shape)?;
    let unsupported = [
        (shape.has_head_dim_v(), "a head dim of v of its own"),
        (opts.varlen.is_some(), "packed (varlen) batches"),
        (opts.alibi.is_some(), "ALiBi"),
        (opts.sinks.is_some(), "attention sinks"),
        (opts.block_mask.is_some(), "block-sparse masks"),
    ];
    match unsupported.into_iter().find(|(on, _)| *on) {
        Some((_, feature)) => Err(Error::Unsupported {
            what: "the CPU backend",
            feature,
        }),
        None => Ok(()),
    }
}

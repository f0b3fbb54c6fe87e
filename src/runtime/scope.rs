//! Device errors as `Result`s: validation and out-of-memory errors raised
//! while creating pipelines or encoding and submitting work are captured by
//! error scopes and returned, never left to abort the program.

use crate::error::{Error, Result};

/// Run `f` with validation and out-of-memory errors captured, so a device
/// error becomes an `Err` naming `during` instead of a panic.
pub async fn checked<T>(
    device: &wgpu::Device,
    during: &'static str,
    f: impl FnOnce() -> Result<T>,
) -> Result<T> {
    let validation = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let oom = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
    let result = f();
    let oom = oom.pop().await;
    let validation = validation.pop().await;
    if let Some(source) = oom {
        return Err(Error::OutOfMemory { during, source });
    }
    if let Some(source) = validation {
        return Err(Error::Device { during, source });
    }
    result
}

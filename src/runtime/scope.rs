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
    captured(during, oom, validation).and(result)
}

/// Run the future `work` inside validation and out-of-memory scopes: what
/// the inner [`checked`] scopes around compiling, encoding and submitting
/// do not catch (creating buffers, writing them) becomes an `Err` naming
/// `during`, so no device error of the engine's reaches the device's
/// uncaptured-error handler (on a wrapped device, the app's). wgpu's scopes
/// belong to the thread that pushed them; the guards are not `Send`, so the
/// future stays on that thread.
pub async fn scoped<T>(
    device: &wgpu::Device,
    during: &'static str,
    work: impl std::future::Future<Output = Result<T>>,
) -> Result<T> {
    let validation = device.push_error_scope(wgpu::ErrorFilter::Validation);
    let oom = device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
    let result = work.await;
    let oom = oom.pop().await;
    let validation = validation.pop().await;
    captured(during, oom, validation).and(result)
}

/// The scopes' errors as one `Err`, out of memory first.
fn captured(
    during: &'static str,
    oom: Option<wgpu::Error>,
    validation: Option<wgpu::Error>,
) -> Result<()> {
    if let Some(source) = oom {
        return Err(Error::OutOfMemory { during, source });
    }
    match validation {
        Some(source) => Err(Error::Device { during, source }),
        None => Ok(()),
    }
}

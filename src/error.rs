//! One error type for the whole crate, split by who has to act on it.

use thiserror::Error;

/// Everything that can go wrong in flashattn.
///
/// The variants separate *bad input* (`Shape`, `Dtype`, `Option`), *bad
/// configuration* (`Plan`), *the hardware can't* (`Unsupported`, `NoAdapter`)
/// and *execution failed* (`Device`, `Io`), so callers can react to each.
#[derive(Debug, Error)]
pub enum Error {
    /// A tensor's shape is wrong or inconsistent with the others.
    #[error("shape error: {0}")]
    Shape(String),
    /// A tensor's element type is not supported or does not match.
    #[error("dtype error: {0}")]
    Dtype(String),
    /// An attention option is invalid (scale, softcap, window).
    #[error("invalid option: {0}")]
    Option(String),
    /// The requested or overridden tile plan cannot run on this device.
    #[error("plan error: {0}")]
    Plan(String),
    /// The device or backend cannot do what was asked.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// No GPU adapter could be found.
    #[error(
        "no GPU adapter found ({0}); install a Vulkan driver (on Debian: `apt-get install -y mesa-vulkan-drivers` \
         gives the CPU-based lavapipe) or use the CPU backend (`--backend cpu`)"
    )]
    NoAdapter(String),
    /// The device reported an error while creating or running a kernel.
    #[error("device error: {0}")]
    Device(String),
    /// A kernel ran into the adapter's loop limit (llvmpipe ends every loop of
    /// an invocation after 65535 iterations in total). Calls on host tensors
    /// handle it by rerunning in shorter pieces; it reaches callers only from
    /// APIs that cannot split (device buffers, the naive baseline).
    #[error(
        "a kernel ran past {0}'s loop limit (65535 loop iterations per invocation in total) and stopped short, \
         so its results were discarded; the host-tensor API reruns such calls in shorter pieces"
    )]
    LoopBudget(String),
    /// Reading or writing a file failed.
    #[error("{0}")]
    Io(String),
}

/// Shorthand for `Result<T, flashattn::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

//! Kernels verified on first use. Drivers differ exactly where fast kernels
//! lean on them (zero-initialisation, loop limits, subgroup operations,
//! cooperative matrices, the CUDA driver's own PTX compiler), so before a
//! kernel family first serves a call on a device the engine runs a small
//! known-answer check there and compares it with the f64 reference under
//! the accuracy rule of docs/semantics.md ([`crate::accuracy`]).
//!
//! - **What is checked** ([`cases`]): per family, per precision and per
//!   code-path flag ([`FamilyKey`]); the family's own ops (the same
//!   planner, pipelines and dispatches as real calls, the family forced) on
//!   one small case: odd sizes, a causal window, GQA, more key tiles than
//!   the family double-buffers (so K/V rings wrap), a row with a score near
//!   +100 (forward); the backward where the family has one (from the CPU
//!   backend's forward); with dropout (its own family) the same case with a
//!   fixed seed; decoding (a paged cache, an append, one split and three)
//!   when decoding first runs.
//! - **Verdicts** ([`Verdict`]): `verified`, `failed` (the worst output's
//!   error against its bound, or the error the check's call returned),
//!   `not yet checked`, `off`. Each call's [`crate::CallStats::verification`]
//!   says what it ran and why.
//! - **The cache** ([`VerdictCache`]): verdicts from the accuracy rule are
//!   kept on disk, one line per (device, flashattn version, family), so a
//!   check runs once per device and version; a check whose call returned
//!   an error is kept for the process only. In the browser (wasm32) there
//!   is no disk: verdicts last as long as the engine.
//! - **Fallbacks** ([`fallback`]): a family that failed is skipped for the
//!   next one — coop → registers → tiled and lanes → tiled on wgpu, Hopper
//!   → sm80 → scalar on CUDA. A family the caller forced runs whatever its
//!   verdict (tests of a family force it); when the last family of a chain
//!   fails too the call is [`crate::Error::VerificationFailed`], which
//!   [`crate::Backend`] answers with the CPU backend.
//! - **The setting** ([`VerifyMode`]): `off`, `first_use` (the default) or
//!   `always` (a check before every call), on the engine
//!   ([`crate::Engine::with_verification`]) or by `FLASHATTN_VERIFY`.
//! - [`matrix`]: every family the device offers × forward, backward and
//!   decode × f32, f16 and bf16 × every layout — what `flashattn doctor`
//!   runs and prints.

#![warn(missing_docs)]

pub mod cases;
#[cfg(not(target_arch = "wasm32"))]
pub mod disk;
pub mod fallback;
pub mod fault;
pub mod key;
// The verification matrix: `flashattn doctor` and the CUDA backend's checks.
#[cfg(any(feature = "lab", feature = "cuda"))]
pub mod matrix;

pub mod store;
// The verdicts live with the call statistics that carry them.
pub use crate::api::verdict;
pub mod wgpu;

#[cfg(not(target_arch = "wasm32"))]
pub use disk::VerdictCache;
#[cfg(any(feature = "lab", feature = "cuda"))]
pub use fault::Fault;
pub use key::DeviceKey;
pub use store::VerdictStore;
pub use verdict::{CallKind, Checked, FamilyKey, Verdict, Verification};
#[cfg(any(feature = "lab", feature = "cuda"))]
pub use verdict::Evidence;

use crate::error::{Error, Result};

/// When the known-answer checks run.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum VerifyMode {
    /// Never: every family runs unchecked (stats say `verification off`).
    Off,
    /// Once per family on each device and flashattn version, before its
    /// first call; the verdict is cached (on disk where there is one).
    #[default]
    FirstUse,
    /// Before every call, ignoring cached verdicts (for chasing a driver
    /// that fails now and then; each call pays for a check).
    Always,
}

impl VerifyMode {
    /// The setting's name (what `FLASHATTN_VERIFY` takes).
    pub fn name(self) -> &'static str {
        match self {
            VerifyMode::Off => "off",
            VerifyMode::FirstUse => "first_use",
            VerifyMode::Always => "always",
        }
    }

    /// `FLASHATTN_VERIFY` (`off`, `first_use` or `always`); the default
    /// where it is unset or empty, an error naming it where it is anything
    /// else.
    pub fn from_env() -> Result<Self> {
        #[cfg(not(target_arch = "wasm32"))]
        if let Ok(v) = std::env::var("FLASHATTN_VERIFY") {
            if !v.is_empty() {
                return v.parse();
            }
        }
        Ok(Self::default())
    }
}

impl std::str::FromStr for VerifyMode {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "off" => Ok(Self::Off),
            "first_use" | "first-use" => Ok(Self::FirstUse),
            "always" => Ok(Self::Always),
            other => Err(Error::UnknownName {
                what: "verification mode (FLASHATTN_VERIFY)",
                name: other.to_string(),
                expected: "off, first_use or always",
            }),
        }
    }
}

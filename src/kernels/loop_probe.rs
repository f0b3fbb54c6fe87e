//! The loop-limit probe (`loop_probe.wgsl`): how many loop iterations one
//! invocation may take on this adapter.

use super::compose::KernelSource;

const PROBE: &str = include_str!("../../shaders/loop_probe.wgsl");

/// The probe's loop bound: far above llvmpipe's 65535, cheap anywhere.
pub const PROBE_BOUND: u32 = 1 << 20;

/// The probe kernel (one invocation; binding 0 holds `[bound, done]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct LoopProbe;

impl LoopProbe {
    pub const NAME: &'static str = "loop-limit probe";

    pub fn source(&self) -> KernelSource {
        KernelSource {
            text: PROBE.to_string(),
            entry: "main",
            overrides: Vec::new(),
        }
    }
}

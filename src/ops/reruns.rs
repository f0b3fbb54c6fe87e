//! How host-tensor calls are cut and rerun: the limits every piece must
//! respect (one storage binding, the dispatch grid, and the loop limit of
//! each kernel the call runs, predicted or learned), and the loop that
//! reruns a call with shorter pieces when a kernel's guard still fires.

use crate::api::tensor::Precision;
use crate::error::{Error, Result};
use crate::kernels::{KernelKey, LoopCost, LoopDim};
use crate::plan::PieceLimits;
use crate::runtime::Gpu;
use std::future::Future;

/// More reruns than halvings of any length that fits in memory.
const MAX_RERUNS: u32 = 40;

/// The piece limits for a call running `kernels` in `precision` on `gpu`.
pub fn piece_limits(
    gpu: &Gpu,
    precision: Precision,
    kernels: &[(KernelKey, LoopCost)],
) -> Result<PieceLimits> {
    let predict = !gpu.settings.no_loop_prediction;
    let mut limits = PieceLimits {
        elem: precision.bytes() as u64,
        max_binding: gpu.max_binding(),
        max_groups: gpu.max_groups() as usize,
        max_rows: usize::MAX,
        max_keys: usize::MAX,
    };
    for (key, cost) in kernels {
        let len = gpu.loop_limit.max_len(key, cost, predict)?;
        match cost.dim {
            LoopDim::Rows => limits.max_rows = limits.max_rows.min(len),
            LoopDim::Keys => limits.max_keys = limits.max_keys.min(len),
        }
    }
    Ok(limits)
}

/// Run `attempt` with the piece limits of `kernels`, and again each time a
/// kernel's guard catches it short (by then the runtime has learned a
/// shorter length for it); returns the result and the number of reruns.
pub async fn with_reruns<T, F, Fut>(
    gpu: &Gpu,
    precision: Precision,
    kernels: &[(KernelKey, LoopCost)],
    mut attempt: F,
) -> Result<(T, u32)>
where
    F: FnMut(PieceLimits) -> Fut,
    Fut: Future<Output = Result<T>>,
{
    let mut reruns = 0;
    loop {
        let limits = piece_limits(gpu, precision, kernels)?;
        match attempt(limits).await {
            // Each rerun at least halves a length, so this ends; the bound
            // only guards against a kernel that never learns.
            Err(Error::LoopBudget { .. }) if reruns < MAX_RERUNS => reruns += 1,
            other => return other.map(|out| (out, reruns)),
        }
    }
}

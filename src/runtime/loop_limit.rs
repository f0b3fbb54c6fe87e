//! The adapter's loop limit, found by behaviour: llvmpipe (lavapipe, and
//! Mesa's GL on a CPU) ends every loop of an invocation once it has counted
//! 65535 iterations in total, silently. A probe at engine creation measures
//! the limit (or its absence); calls are then split so that every kernel's
//! predicted iterations stay within it ([`crate::kernels::LoopCost`]), and
//! every kernel carries a guard that reports when it was cut short anyway —
//! then the call reruns with the driving dimension halved, and the shorter
//! length is remembered for that kernel.

use crate::error::{Error, Result};
use crate::kernels::{KernelKey, LoopCost};
use std::collections::HashMap;
use std::sync::Mutex;

/// What is known about the adapter's loop limit.
#[derive(Default)]
pub struct LoopLimit {
    /// Iterations one invocation may take; `None` when the probe completed.
    limit: Option<u32>,
    /// Longest run a kernel could cover without being cut short, learned
    /// when its guard fired, by kernel.
    learned: Mutex<HashMap<KernelKey, usize>>,
}

impl LoopLimit {
    /// What the probe measured: `Some(limit)`, or `None` for no limit.
    pub fn new(limit: Option<u32>) -> Self {
        Self {
            limit,
            learned: Mutex::default(),
        }
    }

    /// The limit the probe measured (`None`: no limit).
    pub fn limit(&self) -> Option<u32> {
        self.limit
    }

    /// The longest length along its loop that `key` may walk in one dispatch:
    /// what the guard taught us, and (unless `predict` is off) what `cost`
    /// predicts. `usize::MAX` without a limit.
    pub fn max_len(&self, key: &KernelKey, cost: &LoopCost, predict: bool) -> Result<usize> {
        let Some(limit) = self.limit else {
            return Ok(usize::MAX);
        };
        let learned = self
            .learned
            .lock()
            .map_err(|_| Error::Poisoned {
                what: "the learned loop caps",
            })?
            .get(key)
            .copied()
            .unwrap_or(usize::MAX);
        // A tenth of the budget in reserve: the model is checked against the
        // driver (tests/loop_limit.rs), but where a kernel with barriers runs
        // out mid-loop its guard's report can be lost with the rest of its
        // workgroup's writes, so the prediction must not come up short.
        let budget = limit - limit / 10;
        let predicted = if predict {
            cost.max_len(budget)
        } else {
            usize::MAX
        };
        let len = learned.min(predicted);
        if len == 0 {
            return Err(Error::LoopLimitTooLow {
                kernel: key.name(),
                limit,
                length: cost.step as usize,
            });
        }
        Ok(len)
    }

    /// `key` was cut short walking `len` entries: remember half of that
    /// (whole steps of `step`), or fail when even one step is too long.
    pub fn learn(&self, key: &KernelKey, len: usize, step: u32) -> Result<()> {
        let limit = self.limit.unwrap_or(u32::MAX);
        let step = step.max(1) as usize;
        if len <= step {
            return Err(Error::LoopLimitTooLow {
                kernel: key.name(),
                limit,
                length: len,
            });
        }
        let half = (len / 2 / step).max(1) * step;
        let mut learned = self.learned.lock().map_err(|_| Error::Poisoned {
            what: "the learned loop caps",
        })?;
        let cap = learned.entry(*key).or_insert(usize::MAX);
        *cap = (*cap).min(half);
        Ok(())
    }
}

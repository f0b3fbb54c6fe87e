//! Planning: pure functions from a problem and the device's limits to tile
//! sizes ([`plan_forward`], [`plan_backward`]) and to pieces ([`split`]).
//! Nothing here touches a device, so every rule is unit-tested with made-up
//! limits.

pub mod backward;
#[cfg(not(target_arch = "wasm32"))]
pub mod candidates;
pub mod caps;
pub mod coop;
pub mod decode;
pub mod forward;
pub mod pass;
pub mod pieces;
pub mod registers;
pub mod request;
pub mod tiles;

pub use backward::plan_backward;
#[cfg(not(target_arch = "wasm32"))]
pub use candidates::{candidates, Candidate};
pub use pass::Pass;
pub use caps::{CoopMatrixShapes, DeviceCaps};
pub use coop::CoopForm;
pub use decode::{
    plan_decode, plan_splits, DecodePlan, DecodeRequest, DecodeTiles, SplitLimits, Splits,
};
pub use forward::plan_forward;
pub use pieces::{split, split_packed, PieceLimits, Split};
pub use request::{KernelFamily, PlanOverrides, PlanRequest, StorageKind};
pub use tiles::{padded_chunks, Clamp, Plan, Planned};
// The planner's constants and formulas, for the tests that check them.
#[cfg(all(feature = "lab", not(target_arch = "wasm32")))]
pub use candidates::MAX_CANDIDATES;
#[cfg(feature = "lab")]
pub use {
    caps::{SubgroupSizes, LANE_SUBGROUPS},
    coop::{COOP_MAX_HEAD_DIM, COOP_WORKGROUP},
    forward::{LANES_MAX_HEAD_DIM, LANES_ROWS_PER_LANE},
    registers::{registers_backward_bytes, REG_MAX_ACC, REG_MAX_ROWS, REG_MAX_SCORES},
    tiles::{
        backward_workgroup_bytes, forward_workgroup_bytes, registers_forward_bytes, RegTiles,
        GRANULARITY, MAX_ACC_PER_THREAD, MAX_SCORES_PER_THREAD, MAX_THREADS_PER_ROW,
        TARGET_WORKGROUP, WORKING_BYTES,
    },
};

#[cfg(test)]
mod tests;

//! Planning: pure functions from a problem and the device's limits to tile
//! sizes ([`plan_forward`], [`plan_backward`]) and to pieces ([`split`]).
//! Nothing here touches a device, so every rule is unit-tested with made-up
//! limits.

pub mod backward;
pub mod candidates;
pub mod caps;
pub mod coop;
pub mod decode;
pub mod forward;
pub mod matrix;
pub mod pieces;
pub mod registers;
pub mod request;
pub mod tiles;

pub use backward::plan_backward;
pub use candidates::{candidates, Candidate, Pass, MAX_CANDIDATES};
pub use caps::{CoopMatrixShapes, DeviceCaps, SubgroupSizes, LANE_SUBGROUPS};
pub use coop::{CoopForm, COOP_MAX_HEAD_DIM, COOP_WORKGROUP};
pub use decode::{
    plan_decode, plan_splits, DecodePlan, DecodeRequest, DecodeTiles, SplitLimits, Splits,
};
pub use forward::{plan_forward, LANES_MAX_HEAD_DIM, LANES_ROWS_PER_LANE};
pub use pieces::{split, split_packed, PieceLimits, Split};
pub use registers::{registers_backward_bytes, REG_MAX_ACC, REG_MAX_ROWS, REG_MAX_SCORES};
pub use request::{KernelFamily, PlanOverrides, PlanRequest, StorageKind};
pub use tiles::{
    backward_workgroup_bytes, forward_workgroup_bytes, padded_chunks, registers_forward_bytes,
    Clamp, Plan, Planned, RegTiles, GRANULARITY, MAX_ACC_PER_THREAD, MAX_SCORES_PER_THREAD,
    MAX_THREADS_PER_ROW, TARGET_WORKGROUP, WORKING_BYTES,
};

#[cfg(test)]
mod tests;

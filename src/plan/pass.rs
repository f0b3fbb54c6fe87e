//! Which pass a plan is for: the forward or the backward.

use super::backward::plan_backward;
use super::caps::DeviceCaps;
use super::forward::plan_forward;
use super::request::PlanRequest;
use super::tiles::Planned;
use crate::error::{Error, Result};

/// Which kernels a plan is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum Pass {
    /// The forward (o and lse).
    Forward,
    /// The backward (dq, dk, dv).
    Backward,
}

impl Pass {
    /// `forward` or `backward`, as it parses.
    pub fn name(self) -> &'static str {
        match self {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
        }
    }

    /// The planner of this pass.
    pub fn plan(self, req: &PlanRequest, caps: &DeviceCaps) -> Result<Planned> {
        match self {
            Pass::Forward => plan_forward(req, caps),
            Pass::Backward => plan_backward(req, caps),
        }
    }
}

impl std::str::FromStr for Pass {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "forward" => Ok(Pass::Forward),
            "backward" => Ok(Pass::Backward),
            _ => Err(Error::UnknownName {
                what: "pass",
                name: s.to_string(),
                expected: "forward or backward",
            }),
        }
    }
}

//! A planted fault, for tests of verification itself: every output of one
//! kernel family (its check's too) is perturbed, as a driver that
//! miscompiles that family would. Planted only in test builds:
//! `Engine::with_fault` (the `lab` feature), or `FLASHATTN_LAB_FAULT=<family>`
//! / `<family>:<forward|backward|decode>` (the `lab-fault` feature, which
//! only the tests turn on: the command line's tests plant it in the binary
//! they run, and a binary built for use ignores it).

use super::verdict::{CallKind, FamilyKey};
use crate::api::tensor::{Tensor, TensorData};
use crate::error::{Error, Result};

/// Which family's outputs to perturb.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Fault {
    /// The family's name (`lanes`, `registers`, `tiled`, `coop`, `hopper`,
    /// `sm80`, `scalar`).
    pub family: String,
    /// Only this kind of call (`None`: every call of the family).
    pub call: Option<CallKind>,
}

/// How far every perturbed element moves: far past any bound of the rule.
const OFFSET: f32 = 0.5;

impl Fault {
    /// `FLASHATTN_LAB_FAULT`, in builds with the `lab-fault` feature.
    #[cfg(all(feature = "lab-fault", not(target_arch = "wasm32")))]
    pub fn from_env() -> Result<Option<Self>> {
        match std::env::var("FLASHATTN_LAB_FAULT") {
            Ok(v) if !v.is_empty() => v.parse().map(Some),
            _ => Ok(None),
        }
    }

    /// Whether a call of `family` is perturbed.
    pub fn hits(&self, family: &FamilyKey) -> bool {
        family.family == self.family && self.call.is_none_or(|c| c == family.call)
    }

    /// Perturb `t` (a call's o, or dq) where the fault hits `family`.
    pub fn perturb(fault: Option<&Fault>, family: &FamilyKey, t: &mut Tensor) {
        if fault.is_some_and(|f| f.hits(family)) {
            let moved: Vec<f32> = t.to_f32().into_iter().map(|x| x + OFFSET).collect();
            t.data = TensorData::from_f32(moved, t.precision());
        }
    }
}

impl std::str::FromStr for Fault {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        let bad = || {
            Error::UnknownName {
            what: "planted fault (FLASHATTN_LAB_FAULT)",
            name: s.to_string(),
            expected: "a family (lanes, tiled, registers, coop, hopper, sm80, scalar), optionally :forward, :backward or :decode",
        }
        };
        let (family, call) = match s.split_once(':') {
            Some((f, c)) => (f, Some(c)),
            None => (s, None),
        };
        let families = [
            "lanes",
            "tiled",
            "registers",
            "coop",
            "hopper",
            "sm80",
            "scalar",
        ];
        if !families.contains(&family) {
            return Err(bad());
        }
        let call = match call {
            None => None,
            Some("forward") => Some(CallKind::Forward),
            Some("backward") => Some(CallKind::Backward),
            Some("decode") => Some(CallKind::Decode),
            Some(_) => return Err(bad()),
        };
        Ok(Self {
            family: family.to_string(),
            call,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::tensor::Precision;

    #[test]
    fn a_fault_moves_one_familys_outputs_only() {
        let fault: Fault = "lanes:forward".parse().unwrap();
        let key = |family, call| FamilyKey {
            call,
            family,
            precision: Precision::F16,
            flags: Vec::new(),
        };
        let t = || Tensor {
            shape: vec![2],
            data: TensorData::from_f32(vec![1.0, -2.0], Precision::F16),
        };
        let mut hit = t();
        Fault::perturb(Some(&fault), &key("lanes", CallKind::Forward), &mut hit);
        assert_eq!(hit.to_f32(), [1.5, -1.5]);
        for (family, call) in [("lanes", CallKind::Backward), ("tiled", CallKind::Forward)] {
            let mut missed = t();
            Fault::perturb(Some(&fault), &key(family, call), &mut missed);
            assert_eq!(missed.to_f32(), [1.0, -2.0]);
        }
        assert!("registers".parse::<Fault>().unwrap().call.is_none());
        assert!(matches!(
            "warp".parse::<Fault>(),
            Err(Error::UnknownName { .. })
        ));
        assert!("tiled:sideways".parse::<Fault>().is_err());
    }
}

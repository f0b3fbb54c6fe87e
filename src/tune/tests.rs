//! Timing and recording candidates, without a device.

use super::*;
use crate::plan::{plan_forward, DeviceCaps, PlanRequest};
use std::cell::Cell;

fn stats(seconds: f64) -> CallStats {
    CallStats {
        kernel_seconds: seconds,
        timing: Timing::GpuTimestamps,
        ..Default::default()
    }
}

#[test]
fn the_first_run_is_not_timed_and_the_fastest_repeat_counts() {
    let times = [9.0, 3.0, 1.0, 2.0];
    let calls = Cell::new(0);
    let run = || {
        let t = times[calls.get()];
        calls.set(calls.get() + 1);
        async move { Ok(stats(t)) }
    };
    let best = pollster::block_on(best_of(3, run)).unwrap();
    assert_eq!((best.kernel_seconds, calls.get()), (1.0, 4));
    // One failing run fails the candidate.
    let calls = Cell::new(0);
    let failing = || {
        calls.set(calls.get() + 1);
        let n = calls.get();
        async move {
            match n {
                2 => Err(Error::DeviceLost),
                _ => Ok(stats(1.0)),
            }
        }
    };
    assert!(matches!(
        pollster::block_on(best_of(3, failing)),
        Err(Error::DeviceLost)
    ));
}

#[test]
fn a_failing_candidate_never_wins_but_a_failing_formula_plan_fails_the_tuning() {
    let caps = DeviceCaps::webgpu_default();
    let plan = plan_forward(&PlanRequest::new(64, Precision::F32), &caps)
        .unwrap()
        .plan;
    let c = Candidate {
        label: "Br/2".into(),
        overrides: PlanOverrides::default(),
        plan,
    };
    let mut timing = Timing::WallClock;
    let ok = record(1, &c, Ok(stats(0.002)), &mut timing).unwrap();
    assert_eq!(
        (ok.seconds, ok.error, timing),
        (0.002, None, Timing::GpuTimestamps)
    );
    let failed = record(1, &c, Err(Error::DeviceLost), &mut timing).unwrap();
    assert_eq!(failed.seconds, f64::INFINITY);
    assert!(failed.error.unwrap().contains("device was lost"));
    assert!(matches!(
        record(0, &c, Err(Error::DeviceLost), &mut timing),
        Err(Error::DeviceLost)
    ));
}

//! Kernel times come from the adapter's timestamps where it has
//! `TIMESTAMP_QUERY` (lavapipe and Chromium's WebGPU do), and say so.

mod common;

use common::Case;
use flashattn::{CallStats, ForwardInputs, Timing};
use std::time::Instant;

/// A call's stats and the host's wall time around it.
fn timed(f: impl FnOnce() -> CallStats) -> (CallStats, f64) {
    let start = Instant::now();
    let stats = f();
    (stats, start.elapsed().as_secs_f64())
}

#[test]
fn kernel_times_come_from_timestamps_where_the_adapter_has_them() {
    let Some(e) = common::engine() else { return };
    let expected = if e
        .features()
        .contains(flashattn::wgpu::Features::TIMESTAMP_QUERY)
    {
        Timing::GpuTimestamps
    } else {
        Timing::WallClock
    };
    assert_eq!(e.timing(), expected);
    for case in [Case::new(200, 300, 64), Case::new(64, 64, 32).f16()] {
        let (fwd, wall) = timed(|| common::run_gpu(e, &case).stats);
        assert_eq!(fwd.timing, expected);
        // The kernels' own time: positive, and within the call's wall time
        // (which adds uploads, readbacks and the driver's latency).
        assert!(
            fwd.kernel_seconds > 0.0 && fwd.kernel_seconds <= wall,
            "{} s of kernels in {wall} s",
            fwd.kernel_seconds
        );
        let (bwd, wall) = timed(|| common::run_gpu_backward(e, &case).stats);
        assert_eq!(bwd.timing, expected);
        assert!(bwd.kernel_seconds > 0.0 && bwd.kernel_seconds <= wall);
    }
}

#[test]
fn the_cpu_backend_reports_wall_time() {
    let case = Case::new(33, 47, 16);
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let out = flashattn::cpu::forward(&ForwardInputs::new(q, k, v), &case.opts).unwrap();
    assert_eq!(out.stats.timing, Timing::WallClock);
}

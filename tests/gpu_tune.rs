//! The autotuner on the real adapter: every candidate timed, the winner
//! cached, and engines with tuned plans on run it (still accurate); a
//! damaged cache falls back to the formula plan.

mod common;

use common::{assert_accurate, output_grad, Case};
use flashattn::plan::{candidates, PlanRequest};
use flashattn::tune::{MaskKind, TuneKey, Tuned};
use flashattn::{
    BackwardInputs, Engine, ForwardInputs, Pass, PlanOverrides, Precision, TuneCache, TuneRequest,
};

/// A second engine on the test adapter (the shared one has tuned plans off).
fn tuned_engine(cache: &TuneCache) -> Engine {
    Engine::new()
        .expect("the adapter the shared engine found")
        .with_tuned_plans(cache.clone())
}

#[test]
fn a_tuned_forward_times_every_candidate_and_runs_the_winner() {
    let Some(e) = common::engine() else { return };
    let dir = tempfile::tempdir().unwrap();
    let cache = TuneCache::in_dir(dir.path());
    let case = Case::new(128, 128, 64);
    let shape = flashattn::AttentionShape::new(1, 128, 128, 2, 2, 64).unwrap();
    let req = TuneRequest::new(Pass::Forward, shape, Precision::F32)
        .repeats(2)
        .cache(Some(cache.clone()));
    let report = e.tune(&req).unwrap();
    let expected = candidates(
        &PlanRequest::for_shape(&shape, Precision::F32, PlanOverrides::default()),
        Pass::Forward,
        &e.caps(),
    )
    .unwrap();
    let labels = |c: &[_]| -> Vec<String> {
        c.iter()
            .map(|c: &flashattn::plan::Candidate| c.label.clone())
            .collect()
    };
    let timed: Vec<String> = report.candidates.iter().map(|c| c.label.clone()).collect();
    assert_eq!(timed, labels(&expected));
    assert!(report.candidates.len() >= 2, "{report:?}");
    for c in &report.candidates {
        assert!(
            c.seconds > 0.0 && c.seconds.is_finite() && c.error.is_none(),
            "{c:?}"
        );
    }
    let best = report.winner().seconds;
    assert!(report.candidates.iter().all(|c| c.seconds >= best));
    assert_eq!(report.timing, e.timing());
    assert_eq!(report.stored.as_deref(), Some(cache.path()));
    assert_eq!(report.key.mask, MaskKind::None);
    assert_eq!(
        cache.get(&report.key).unwrap().overrides,
        report.winner().overrides
    );
    // An engine with tuned plans on runs the winner, accurately; one
    // without runs the formula plan.
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let tuned = tuned_engine(&cache);
    let out = tuned
        .forward(&ForwardInputs::new(q, k, v), &case.opts)
        .unwrap();
    assert_eq!(out.stats.plan, Some(report.winner().plan));
    let lookup = tuned.tuned_overrides(Pass::Forward, &shape, Precision::F32, &case.opts);
    assert_eq!(lookup, Some(report.winner().overrides));
    assert_eq!(
        e.tuned_overrides(Pass::Forward, &shape, Precision::F32, &case.opts),
        None
    );
    assert_accurate(&case, &inputs, &out);
    let plain = e.forward(&ForwardInputs::new(q, k, v), &case.opts).unwrap();
    assert_eq!(plain.stats.plan, Some(report.candidates[0].plan));
    // A causal call is another problem class: no tuned plan for it yet.
    let causal = Case::new(128, 128, 64).opts(common::causal());
    let out = tuned
        .forward(&ForwardInputs::new(q, k, v), &causal.opts)
        .unwrap();
    assert_eq!(out.stats.plan, Some(report.candidates[0].plan));
}

#[test]
fn a_cached_backward_plan_is_used_and_a_damaged_cache_is_ignored() {
    let Some(e) = common::engine() else { return };
    let dir = tempfile::tempdir().unwrap();
    let cache = TuneCache::in_dir(dir.path());
    let case = Case::new(64, 64, 32);
    let shape = flashattn::AttentionShape::new(1, 64, 64, 2, 2, 32).unwrap();
    let list = candidates(
        &PlanRequest::for_shape(&shape, Precision::F32, PlanOverrides::default()),
        Pass::Backward,
        &e.caps(),
    )
    .unwrap();
    // Not the formula plan, so running it shows the cache was read.
    let chosen = list.last().unwrap();
    assert_ne!(chosen.plan, list[0].plan);
    let key = TuneKey::new(
        e.adapter_info(),
        Pass::Backward,
        &shape,
        Precision::F32,
        MaskKind::None,
    );
    let entry = Tuned {
        overrides: chosen.overrides,
        note: chosen.label.clone(),
    };
    cache.put(&key, &entry).unwrap();
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let tuned = tuned_engine(&cache);
    let fwd = tuned
        .forward(&ForwardInputs::new(q, k, v), &case.opts)
        .unwrap();
    let (_, d_o) = output_grad(&case);
    let bwd_inputs =
        BackwardInputs::new(ForwardInputs::new(q, k, v), &fwd, inputs.grad(&d_o)).unwrap();
    let bwd = tuned.backward(&bwd_inputs, &case.opts).unwrap();
    assert_eq!(bwd.stats.plan, Some(chosen.plan));
    let reference = e.backward(&bwd_inputs, &case.opts).unwrap();
    assert_eq!(reference.stats.plan, Some(list[0].plan));
    // The same gradients within f32 rounding, whichever tiles ran.
    for (a, b) in [
        (&bwd.dq, &reference.dq),
        (&bwd.dk, &reference.dk),
        (&bwd.dv, &reference.dv),
    ] {
        let (a, b) = (a.to_f32(), b.to_f32());
        let worst = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max);
        assert!(worst < 1e-4, "gradients differ by {worst}");
    }
    // Garbage in the cache file: the formula plan, no error.
    std::fs::write(cache.path(), b"\xff\x00garbage\n\t\t\n").unwrap();
    let bwd = tuned.backward(&bwd_inputs, &case.opts).unwrap();
    assert_eq!(bwd.stats.plan, Some(list[0].plan));
}

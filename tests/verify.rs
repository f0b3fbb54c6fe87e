//! Kernels verified on first use (src/verify) on this device: the first
//! call of each kernel family runs its known-answer check and says so in
//! its stats; a fault planted in one family (the `lab` feature's hook)
//! makes the engine fall back, say why, and still meet the accuracy rule;
//! verdicts survive a restart and a new version checks again. Each engine
//! here keeps its verdicts in a directory of its own, so what one test
//! learns never reaches another.

mod common;

use common::decode::DecodeCase;
use common::{assert_accurate, causal, output_grad, Case};
use flashattn::accuracy::{check_backward, check_forward};
use flashattn::verify::{Fault, Verdict};
use flashattn::{
    Backend, BackwardInputs, CallKind, Engine, Error, ForwardInputs, ForwardOutput, KernelFamily,
    PlanOverrides, VerdictCache, Verification, VerifyMode,
};
use std::path::Path;

/// A fresh engine (checks on first use) keeping its verdicts in `dir`,
/// keyed by flashattn version `version`; `None` (skipped as the harness
/// says) without an adapter.
fn engine_in(dir: &Path, version: &str) -> Option<Engine> {
    common::engine()?;
    let cache = VerdictCache::in_dir(dir).with_version(version);
    Some(
        Engine::new()
            .expect("an adapter")
            .with_verification(VerifyMode::FirstUse)
            .with_verdict_cache(Some(cache)),
    )
}

/// The forward case every test runs: odd sizes, GQA, causal.
fn case() -> Case {
    Case::new(33, 47, 32).heads(4, 2).opts(causal())
}

fn forward(e: &Engine, case: &Case, overrides: &PlanOverrides) -> flashattn::Result<ForwardOutput> {
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    e.forward_with(&ForwardInputs::new(q, k, v), &case.opts, overrides)
}

fn verification(out: &ForwardOutput) -> &Verification {
    out.stats
        .verification
        .as_ref()
        .expect("a verdict in the stats")
}

/// The family the planner picks for `case` on `e` (lanes on lavapipe,
/// registers or coop on GPUs).
fn default_family(e: &Engine, case: &Case) -> KernelFamily {
    let shape = flashattn::AttentionShape::new(1, 33, 47, 4, 2, 32).unwrap();
    e.plan(&shape, case.precision, &PlanOverrides::default())
        .unwrap()
        .plan
        .kernel
}

/// A verdict a check ran now (not read from the cache) and its seconds.
fn fresh_check(v: &Verdict) -> f64 {
    match v {
        Verdict::Verified(e) if !e.cached => e.seconds,
        other => panic!("expected a check run now that passed, got {other}"),
    }
}

#[test]
fn the_first_call_of_each_family_runs_its_check() {
    let dir = tempfile::tempdir().unwrap();
    let Some(e) = engine_in(dir.path(), "test") else {
        return;
    };
    let c = case();
    let first = forward(&e, &c, &PlanOverrides::default()).unwrap();
    let v = verification(&first);
    let ran = v.ran().unwrap();
    assert_eq!(ran.family.call, CallKind::Forward);
    assert_eq!(
        ran.family.family,
        first.stats.plan.unwrap().kernel.name(),
        "{v}"
    );
    let forward_ms = fresh_check(&ran.verdict) * 1e3;
    assert!(v.to_string().ends_with(": verified"), "{v}");
    assert_eq!(e.checks_run().0, 1);
    // The second call of the family reuses the verdict.
    let again = forward(&e, &c, &PlanOverrides::default()).unwrap();
    assert!(verification(&again).ran().unwrap().verdict.is_verified());
    assert_eq!(e.checks_run().0, 1);
    assert_accurate(&c, &c.inputs(), &again);

    // The backward's family, a forced family, another precision, decoding:
    // each checked once, on its first call.
    let inputs = c.inputs();
    let [q, k, v] = inputs.views();
    let (_, g) = output_grad(&c);
    let bwd_in = BackwardInputs::new(ForwardInputs::new(q, k, v), &first, inputs.grad(&g)).unwrap();
    let bwd = e.backward(&bwd_in, &c.opts).unwrap();
    let bv = bwd.stats.verification.as_ref().unwrap();
    assert_eq!(bv.ran().unwrap().family.call, CallKind::Backward);
    let backward_ms = fresh_check(&bv.ran().unwrap().verdict) * 1e3;
    assert_eq!(e.checks_run().0, 2);
    let tiled = PlanOverrides::default().kernel(KernelFamily::Tiled);
    let forced = forward(&e, &c, &tiled).unwrap();
    let fv = verification(&forced);
    assert!(
        fv.forced && fv.ran().unwrap().family.family == "tiled",
        "{fv}"
    );
    let expected = if default_family(&e, &c) == KernelFamily::Tiled {
        2
    } else {
        3
    };
    assert_eq!(e.checks_run().0, expected);
    let f16 = forward(&e, &c.clone().f16(), &PlanOverrides::default()).unwrap();
    assert_eq!(
        verification(&f16).ran().unwrap().family.precision,
        flashattn::Precision::F16
    );
    assert_eq!(e.checks_run().0, expected + 1);
    let step = DecodeCase::new(&[40, 9], 32).append(1).paged(5).data();
    let opts = step.case.opts.clone();
    let out = step.check(|cache, s| e.decode_host(cache, s, &opts, None));
    let dv = out.stats.verification.as_ref().unwrap();
    assert_eq!(dv.ran().unwrap().family.call, CallKind::Decode, "{dv}");
    let decode_ms = fresh_check(&dv.ran().unwrap().verdict) * 1e3;
    assert_eq!(e.checks_run().0, expected + 2);
    // Every verdict the engine holds passed; the cost of the checks.
    let verdicts = e.verdicts();
    assert_eq!(verdicts.len() as u32, e.checks_run().0);
    assert!(verdicts.iter().all(|c| c.verdict.is_verified()));
    eprintln!(
        "check cost on {}: forward {forward_ms:.0} ms, backward {backward_ms:.0} ms, decode {decode_ms:.0} ms; {} checks, {:.0} ms in all",
        e.describe(),
        e.checks_run().0,
        e.checks_run().1 * 1e3
    );
}

/// Dropout compiles a mask into the kernels: its calls are a family of
/// their own, checked on first use against the reference's mask, and a
/// fault planted there makes the dropout call fall back.
#[test]
fn dropout_is_a_family_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let Some(e) = engine_in(dir.path(), "test") else {
        return;
    };
    let plain = case();
    let mut c = case();
    c.opts = c.opts.dropout(0.2).dropout_seed(11);
    forward(&e, &plain, &PlanOverrides::default()).unwrap();
    let out = forward(&e, &c, &PlanOverrides::default()).unwrap();
    let v = verification(&out);
    let ran = v.ran().unwrap();
    assert!(ran.family.flags.iter().any(|f| f == "dropout"), "{v}");
    fresh_check(&ran.verdict);
    assert_eq!(e.checks_run().0, 2, "the plain and the dropout family");
    assert_accurate(&c, &c.inputs(), &out);
    // The backward's dropout family too, checked against the same mask.
    let inputs = c.inputs();
    let [q, k, vv] = inputs.views();
    let (_, g) = output_grad(&c);
    let bwd_in = BackwardInputs::new(ForwardInputs::new(q, k, vv), &out, inputs.grad(&g)).unwrap();
    let bwd = e.backward(&bwd_in, &c.opts).unwrap();
    let bv = bwd.stats.verification.as_ref().unwrap().ran().unwrap();
    assert!(bv.family.flags.iter().any(|f| f == "dropout"), "{bv:?}");
    fresh_check(&bv.verdict);
    for check in check_backward(&bwd, &q, &k, &vv, &inputs.grad(&g), &c.opts).unwrap() {
        assert!(check.passed(), "{check}");
    }

    let family = default_family(&e, &plain);
    let fault: Fault = family.name().parse().unwrap();
    let faulty = engine_in(dir.path(), "faulty").unwrap().with_fault(fault);
    let out = forward(&faulty, &c, &PlanOverrides::default()).unwrap();
    let v = verification(&out);
    assert!(v.fell_back(), "{v}");
    assert!(
        v.tried[0].family.flags.iter().any(|f| f == "dropout"),
        "{v}"
    );
    assert_accurate(&c, &c.inputs(), &out);
}

/// A quantized cache compiles other code into the decode kernels (the
/// append that quantizes, the loads that scale): its steps are a family
/// of their own, checked on first use against the rule's codes and the
/// reference; a fault planted there makes the step fall back.
#[test]
fn a_quantized_cache_is_a_decode_family_of_its_own() {
    let dir = tempfile::tempdir().unwrap();
    let Some(e) = engine_in(dir.path(), "test") else {
        return;
    };
    let data = DecodeCase::new(&[40, 9], 32).append(2).paged(5).data();
    let opts = data.case.opts.clone();
    for (i, quant) in flashattn::CacheQuant::ALL.into_iter().enumerate() {
        let out = data.check_quantized(quant, |c, s| e.decode_quantized_host(c, s, &opts, None));
        let v = out.stats.verification.as_ref().unwrap();
        let ran = v.ran().unwrap();
        let flag = format!("{} cache", quant.name());
        assert!(ran.family.flags.contains(&flag), "{v}");
        fresh_check(&ran.verdict);
        assert_eq!(e.checks_run().0, i as u32 + 1, "one family per format");
    }
    let first = {
        let out = data.check_quantized(flashattn::CacheQuant::Int8, |c, s| {
            e.decode_quantized_host(c, s, &opts, None)
        });
        out.stats.verification.unwrap().ran().unwrap().family.family
    };
    let fault: Fault = first.parse().unwrap();
    let faulty = engine_in(dir.path(), "faulty").unwrap().with_fault(fault);
    let mut cache =
        flashattn::QuantKvCache::quantize(&data.cache, flashattn::CacheQuant::Int8).unwrap();
    let result = faulty.decode_quantized_host(&mut cache, &data.step(), &opts, None);
    if first == KernelFamily::Lanes.name() {
        let out = data.check_quantized(flashattn::CacheQuant::Int8, |c, s| {
            faulty.decode_quantized_host(c, s, &opts, None)
        });
        let v = out.stats.verification.as_ref().unwrap();
        assert!(v.fell_back() && v.tried[0].verdict.is_failed(), "{v}");
        assert!(
            v.tried[0].family.flags.contains(&"int8 cache".to_string()),
            "{v}"
        );
    } else {
        // The tiled kernel is the last of the chain.
        assert!(result.is_err(), "a faulty {first} family must not run");
    }
}

#[test]
fn a_planted_fault_makes_the_engine_fall_back_say_why_and_meet_the_rule() {
    let dir = tempfile::tempdir().unwrap();
    let Some(plain) = engine_in(dir.path(), "test") else {
        return;
    };
    let c = case();
    let family = default_family(&plain, &c);
    let fault: Fault = family.name().parse().unwrap();
    let e = engine_in(dir.path(), "faulty").unwrap().with_fault(fault);
    let out = forward(&e, &c, &PlanOverrides::default()).unwrap();
    let v = verification(&out);
    assert!(v.fell_back(), "{v}");
    let failed = &v.tried[0];
    assert_eq!(failed.family.family, family.name());
    match &failed.verdict {
        Verdict::Failed(why) => assert!(why.detail.starts_with("o: max error"), "{why:?}"),
        other => panic!("the faulty family's verdict: {other}"),
    }
    let text = v.to_string();
    assert!(
        text.contains(": failed (o: max error") && text.contains(" → fallback to "),
        "{text}"
    );
    // The fallback ran, and its result meets the rule.
    let ran = v.ran().unwrap();
    assert!(ran.verdict.is_verified(), "{text}");
    assert_eq!(ran.family.family, out.stats.plan.unwrap().kernel.name());
    assert_accurate(&c, &c.inputs(), &out);

    // Forced, the faulty family runs (and the fault is real: its output
    // fails the rule), its verdict reported.
    let forced = PlanOverrides::default().kernel(family);
    let bad = forward(&e, &c, &forced).unwrap();
    let bv = verification(&bad);
    assert!(bv.forced && bv.ran().unwrap().verdict.is_failed(), "{bv}");
    assert!(bv.to_string().ends_with("run anyway, as forced"), "{bv}");
    let inputs = c.inputs();
    let [q, k, vv] = inputs.views();
    let checks = check_forward(&bad, &q, &k, &vv, &c.opts).unwrap();
    assert!(!checks[0].passed(), "the planted fault must spoil o");

    // The backward falls back as well where its family is the faulty one.
    let (_, g) = output_grad(&c);
    let bwd_in = BackwardInputs::new(ForwardInputs::new(q, k, vv), &out, inputs.grad(&g)).unwrap();
    let bwd = e.backward(&bwd_in, &c.opts).unwrap();
    let bwv = bwd.stats.verification.as_ref().unwrap();
    if bwv.tried[0].family.family == family.name() {
        assert!(bwv.fell_back() && bwv.tried[0].verdict.is_failed(), "{bwv}");
    }
    for check in check_backward(&bwd, &q, &k, &vv, &inputs.grad(&g), &c.opts).unwrap() {
        assert!(check.passed(), "{check}");
    }
}

#[test]
fn when_every_family_fails_the_call_is_an_error_and_backend_runs_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let Some(e) = engine_in(dir.path(), "test") else {
        return;
    };
    // The tiled kernels are the end of every chain.
    let e = e
        .with_tiled_kernels_only()
        .with_fault("tiled".parse().unwrap());
    let c = case();
    match forward(&e, &c, &PlanOverrides::default()) {
        Err(Error::VerificationFailed { call, tried }) => {
            assert_eq!(call, "forward");
            assert!(tried.contains("tiled forward f32: failed"), "{tried}");
        }
        other => panic!(
            "expected VerificationFailed, got {:?}",
            other.map(|o| o.stats)
        ),
    }
    let backend = Backend::Wgpu(Box::new(e));
    let inputs = c.inputs();
    let [q, k, v] = inputs.views();
    let out = backend
        .forward(
            &ForwardInputs::new(q, k, v),
            &c.opts,
            &PlanOverrides::default(),
        )
        .unwrap();
    let why = verification(&out).to_string();
    assert!(why.ends_with("→ the CPU backend ran the call"), "{why}");
    assert_accurate(&c, &inputs, &out);
}

#[test]
fn verdicts_survive_a_restart_and_a_new_version_checks_again() {
    let dir = tempfile::tempdir().unwrap();
    let Some(first) = engine_in(dir.path(), "1.0.0") else {
        return;
    };
    let c = case();
    forward(&first, &c, &PlanOverrides::default()).unwrap();
    assert_eq!(first.checks_run().0, 1);
    drop(first);
    // A new engine (a new process reads the same file) runs no check.
    let second = engine_in(dir.path(), "1.0.0").unwrap();
    let out = forward(&second, &c, &PlanOverrides::default()).unwrap();
    assert_eq!(second.checks_run().0, 0);
    match &verification(&out).ran().unwrap().verdict {
        Verdict::Verified(e) => assert!(e.cached && e.detail.starts_with("o: max error")),
        other => panic!("{other}"),
    }
    assert!(verification(&out)
        .to_string()
        .ends_with("verified (cached)"));
    // A new flashattn version checks again.
    let newer = engine_in(dir.path(), "1.0.1").unwrap();
    forward(&newer, &c, &PlanOverrides::default()).unwrap();
    assert_eq!(newer.checks_run().0, 1);

    // A failed verdict is kept too: a later engine without the fault skips
    // the family on the cached verdict, without checking anything.
    let family = default_family(&newer, &c);
    let faulty = engine_in(dir.path(), "2.0.0")
        .unwrap()
        .with_fault(family.name().parse().unwrap());
    forward(&faulty, &c, &PlanOverrides::default()).unwrap();
    let later = engine_in(dir.path(), "2.0.0").unwrap();
    let out = forward(&later, &c, &PlanOverrides::default()).unwrap();
    let v = verification(&out);
    assert!(v.fell_back(), "{v}");
    assert!(
        matches!(&v.tried[0].verdict, Verdict::Failed(e) if e.cached),
        "{v}"
    );
    assert_eq!(later.checks_run().0, 0);
    assert_accurate(&c, &c.inputs(), &out);
}

#[test]
fn off_runs_nothing_and_always_checks_every_call() {
    let dir = tempfile::tempdir().unwrap();
    let Some(e) = engine_in(dir.path(), "test") else {
        return;
    };
    let c = case();
    let off = e.with_verification(VerifyMode::Off);
    let out = forward(&off, &c, &PlanOverrides::default()).unwrap();
    assert_eq!(verification(&out).ran().unwrap().verdict, Verdict::Off);
    assert_eq!(off.checks_run().0, 0);
    let always = off.with_verification(VerifyMode::Always);
    for n in 1..=2 {
        forward(&always, &c, &PlanOverrides::default()).unwrap();
        assert_eq!(always.checks_run().0, n);
    }
    assert_eq!(
        "first_use".parse::<VerifyMode>().unwrap(),
        VerifyMode::FirstUse
    );
    assert!(matches!(
        "sometimes".parse::<VerifyMode>(),
        Err(Error::UnknownName { .. })
    ));
}

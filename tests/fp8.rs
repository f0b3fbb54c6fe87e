//! FP8 (e4m3) forward (docs/semantics.md) on the CPU backend and on wgpu: not held
//! to the accuracy rule, so measured — RMSE against the f64 reference within
//! 10% of the same quantization computed naively in f64, and with
//! incoherent processing RMSE at least 2× lower on inputs with outlier
//! channels — and the quantized q, k, v of the wgpu kernels bit-identical
//! to the host's (`flashattn::quant`).

mod common;

use common::fp8::{
    assert_close_to_naive, cases, check_empty_rows_and_bad_inputs, quantizer_inputs, views,
    Fp8Case, HADAMARD,
};
use common::Case;
use flashattn::accuracy::{fp8_report, Fp8Report};
use flashattn::{ForwardInputs, Fp8Options, TensorView};

/// The CPU backend's FP8 forward, measured.
fn cpu_report(case: &Fp8Case, fp8: &Fp8Options) -> Fp8Report {
    let data = case.inputs();
    let [q, k, v] = views(case, &data);
    let out = flashattn::cpu::forward_fp8(&ForwardInputs::new(q, k, v), case.opts(), fp8).unwrap();
    assert_eq!(out.o.precision(), flashattn::Precision::F32);
    assert_eq!(out.o.shape, case.shapes()[0].to_vec());
    fp8_report(&out, &ForwardInputs::new(q, k, v), case.opts(), fp8).unwrap()
}

#[test]
fn cpu_fp8_is_within_ten_percent_of_naive_f64_quantization() {
    for case in cases() {
        for fp8 in [Fp8Options::default(), HADAMARD] {
            assert_close_to_naive(&case, &fp8, &cpu_report(&case, &fp8));
        }
    }
}

/// The LSE bound is the rule's, thousands of times tighter than the
/// quantization error of q and k: an LSE off by 1e-3 nats in one row (what
/// summing the e4m3-rounded P instead of P would do) fails it.
#[test]
fn fp8_lse_rule_catches_a_small_lse_error() {
    let case = Fp8Case::new(Case::new(97, 113, 64));
    let data = case.inputs();
    let [q, k, v] = views(&case, &data);
    for fp8 in [Fp8Options::default(), HADAMARD] {
        let mut out =
            flashattn::cpu::forward_fp8(&ForwardInputs::new(q, k, v), case.opts(), &fp8).unwrap();
        let r = fp8_report(&out, &ForwardInputs::new(q, k, v), case.opts(), &fp8).unwrap();
        assert!(r.lse_rule.passed(), "{}", r.lse_rule);
        assert!(
            r.lse_rule.bound < 1e-4 && r.lse.max > 1e-2,
            "{} | {}",
            r.lse_rule,
            r.lse
        );
        out.lse[50] += 1e-3;
        let planted = fp8_report(&out, &ForwardInputs::new(q, k, v), case.opts(), &fp8).unwrap();
        assert!(!planted.lse_rule.passed(), "{}", planted.lse_rule);
    }
}

#[test]
fn cpu_hadamard_halves_the_error_on_outlier_channels() {
    for case in [
        Fp8Case::new(Case::new(128, 128, 64)).outliers(),
        Fp8Case::new(Case::new(96, 128, 128).heads(4, 2)).outliers(),
        Fp8Case::new(Case::new(64, 64, 59)).outliers(),
    ] {
        let plain = cpu_report(&case, &Fp8Options::default());
        let rotated = cpu_report(&case, &HADAMARD);
        let gain = plain.o.rmse / rotated.o.rmse;
        eprintln!(
            "{case:?}: without {} | with {} | {gain:.2}x",
            plain.o, rotated.o
        );
        assert!(gain >= 2.0, "{case:?}: Hadamard cut RMSE only {gain:.2}x");
    }
}

#[test]
fn cpu_fp8_empty_rows_and_bad_inputs() {
    check_empty_rows_and_bad_inputs(|i, opts| flashattn::cpu::forward_fp8(i, opts, &HADAMARD));
}

// ---- wgpu ----

use common::engine;
use flashattn::quant::{quantize, Fp8Layout};
use flashattn::{KernelFamily, PlanOverrides};

#[test]
fn gpu_quantization_is_bit_identical_to_the_host() {
    let Some(e) = engine() else { return };
    for d in [1, 3, 16, 59, 64, 128, 256] {
        let (seqlen, heads) = (13, 40);
        let x = quantizer_inputs(heads, seqlen, d);
        for shape in [[1, seqlen, heads, d], [2, seqlen, heads / 2, d]] {
            let view = TensorView::f32(shape, &x);
            for fp8 in [Fp8Options::default(), HADAMARD] {
                let gpu = e.quantize_fp8(&view, &fp8).unwrap();
                let layout = Fp8Layout::new(d, &fp8);
                let host = quantize(&view, "x", layout.transform.as_ref(), layout.row_len).unwrap();
                let bits = |s: &[f32]| s.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&gpu.scales), bits(&host.scales), "{shape:?} {fp8:?}");
                let diff = gpu.codes.iter().zip(&host.codes).position(|(a, b)| a != b);
                assert_eq!(diff, None, "{shape:?} {fp8:?}: codes differ");
                assert_eq!(gpu, host, "{shape:?} {fp8:?}");
            }
        }
    }
}

/// The FP8 forward on wgpu, measured; on a CPU adapter both kernels.
fn gpu_reports(case: &Fp8Case, fp8: &Fp8Options) -> Vec<Fp8Report> {
    let Some(e) = engine() else { return vec![] };
    let data = case.inputs();
    let [q, k, v] = views(case, &data);
    let mut kernels = vec![PlanOverrides::default()];
    let tiled = PlanOverrides::default().kernel(KernelFamily::Tiled);
    let mut out = Vec::new();
    while let Some(o) = kernels.pop() {
        let f = e
            .forward_fp8_with(&ForwardInputs::new(q, k, v), case.opts(), fp8, &o)
            .unwrap();
        assert_eq!(f.o.precision(), flashattn::Precision::F32);
        let plan = f.stats.plan.unwrap();
        assert_eq!(plan.storage, flashattn::StorageKind::Fp8);
        if plan.kernel == KernelFamily::Lanes {
            kernels.push(tiled);
        }
        out.push(fp8_report(&f, &ForwardInputs::new(q, k, v), case.opts(), fp8).unwrap());
    }
    out
}

#[test]
fn gpu_fp8_is_within_ten_percent_of_naive_f64_quantization() {
    for case in cases() {
        for fp8 in [Fp8Options::default(), HADAMARD] {
            for r in gpu_reports(&case, &fp8) {
                assert_close_to_naive(&case, &fp8, &r);
            }
        }
    }
}

#[test]
fn gpu_hadamard_halves_the_error_on_outlier_channels() {
    for case in [
        Fp8Case::new(Case::new(128, 128, 64)).outliers(),
        Fp8Case::new(Case::new(64, 64, 59)).outliers(),
        Fp8Case::new(Case::new(96, 128, 128).heads(4, 2)).outliers(),
    ] {
        let plain = gpu_reports(&case, &Fp8Options::default());
        let rotated = gpu_reports(&case, &HADAMARD);
        for (p, r) in plain.iter().zip(&rotated) {
            let gain = p.o.rmse / r.o.rmse;
            eprintln!("{case:?}: without {} | with {} | {gain:.2}x", p.o, r.o);
            assert!(gain >= 2.0, "{case:?}: Hadamard cut RMSE only {gain:.2}x");
        }
    }
}

#[test]
fn gpu_fp8_empty_rows_and_bad_inputs() {
    let Some(e) = engine() else { return };
    check_empty_rows_and_bad_inputs(|i, opts| e.forward_fp8(i, opts, &HADAMARD));
}

/// The CPU backend's FP8 forward runs on rows padded for the Hadamard
/// transform, which at head dims past 512 are wider than `MAX_HEAD_DIM`
/// (576 → 1024): the padded problem is internal and is not held to the
/// callers' head-dim limit (the unpadded shape is).
#[test]
fn cpu_fp8_pads_wide_heads_past_the_head_dim_limit() {
    let (s, d) = (3, 576);
    let mut rng = flashattn::random::Rng::new(4);
    let x = rng.normal_vec(s * d, 1.0);
    let view = TensorView::f32([1, s, 1, d], &x);
    let out = flashattn::cpu::forward_fp8(
        &ForwardInputs::new(view, view, view),
        &flashattn::AttentionOptions::default(),
        &Fp8Options::hadamard(1),
    )
    .unwrap();
    assert_eq!(out.o.shape, vec![1, s, 1, d]);
    assert!(out.o.to_f32().iter().all(|v| v.is_finite()));
}

/// On wgpu the same transform's rows (1024) are wider than the kernels
/// take: a typed error saying so, not a head dim the caller never passed.
#[test]
fn wgpu_fp8_names_the_transform_past_its_head_dims() {
    let Some(e) = engine() else { return };
    let (s, d) = (3, 520);
    let x = flashattn::random::Rng::new(4).normal_vec(s * d, 1.0);
    let view = TensorView::f32([1, s, 1, d], &x);
    let inputs = ForwardInputs::new(view, view, view);
    let opts = flashattn::AttentionOptions::default();
    let err = e
        .forward_fp8(&inputs, &opts, &Fp8Options::hadamard(1))
        .unwrap_err();
    assert!(
        matches!(
            err,
            flashattn::Error::Unsupported {
                what: "the wgpu FP8 forward",
                ..
            }
        ),
        "{err}"
    );
    // Without the transform the rows are 520: it runs.
    let out = e
        .forward_fp8(&inputs, &opts, &Fp8Options::default())
        .unwrap();
    assert!(out.o.to_f32().iter().all(|v| v.is_finite()));
}

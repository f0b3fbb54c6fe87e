//! The CPU backend on the layouts a model brings. Head dims past 256 run
//! forward and backward against the f64 reference under SPEC.md's rule, on
//! every instruction set this machine runs; packed batches, ALiBi, sinks,
//! block masks and v's own head dim are not on the SIMD backend yet and
//! must fail with a typed `Unsupported` error, forward and backward, before
//! any work. No adapter needed.

mod common;

use common::{assert_accurate, block_mask, causal, output_grad, Case};
use flashattn::accuracy::check_backward;
use flashattn::api::scores::{Alibi, Sinks};
use flashattn::cpu::{Cpu, Isa};
use flashattn::{
    AttentionOptions, AttentionShape, BackwardInputs, CallStats, Error, ForwardOutput, TensorData,
};

/// The CPU forward and backward of `case` on every instruction set, each
/// checked against the reference.
fn run(case: &Case) {
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let (_, g) = output_grad(case);
    let d_o = inputs.grad(&g);
    for &isa in Isa::available() {
        let cpu = Cpu::with_isa(isa).unwrap();
        let fail = |e: flashattn::Error| -> ! { panic!("{isa:?} {case:?}: {e}") };
        let fwd = cpu
            .forward(&q, &k, &v, &case.opts)
            .unwrap_or_else(|e| fail(e));
        assert_accurate(case, &inputs, &fwd);
        let bwd_inputs = BackwardInputs::new([q, k, v], &fwd, d_o).unwrap();
        let bwd = cpu
            .backward(&bwd_inputs, &case.opts)
            .unwrap_or_else(|e| fail(e));
        for c in check_backward(&bwd, &q, &k, &v, &d_o, &case.opts).unwrap() {
            assert!(c.passed(), "{isa:?} {case:?}\n{c}");
        }
    }
}

#[test]
fn cpu_wide_heads() {
    for d in [288, 384, 512] {
        run(&Case::new(23, 31, d).heads(2, 1));
    }
    run(&Case::new(31, 23, 512).opts(causal()).f16());
}

/// `Unsupported { what: "the CPU backend", feature }` from the forward and
/// from the backward (on a forward output of the right shape).
fn assert_unsupported(case: &Case, feature: &str) {
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let is_expected = |e: &Error| {
        matches!(e, Error::Unsupported { what, feature: f } if *what == "the CPU backend" && *f == feature)
    };
    let cpu = Cpu::new();
    match cpu.forward(&q, &k, &v, &case.opts) {
        Err(e) if is_expected(&e) => {}
        other => panic!("{case:?}: expected Unsupported({feature}), got {other:?}"),
    }
    let shape = AttentionShape::from_views(&q, &k, &v).unwrap();
    let o = TensorData::from_f32(vec![0.0; shape.o_len()], case.precision);
    let fwd = ForwardOutput::new(shape, o, vec![0.0; shape.lse_len()], CallStats::default());
    let (_, g) = output_grad(case);
    let bwd_inputs = BackwardInputs::new([q, k, v], &fwd, inputs.grad(&g)).unwrap();
    match cpu.backward(&bwd_inputs, &case.opts) {
        Err(e) if is_expected(&e) => {}
        other => panic!("{case:?}: backward expected Unsupported({feature}), got {other:?}"),
    }
}

#[test]
fn cpu_layouts_not_yet_taken_are_typed_errors() {
    let case = Case::new(33, 45, 16).heads(4, 2);
    let mask = block_mask(&case, (7, 13), 0.5, 1, 3);
    let with = |opts: AttentionOptions| case.clone().opts(opts);
    let d = AttentionOptions::default;
    assert_unsupported(&with(d().alibi(Alibi::standard(4))), "ALiBi");
    assert_unsupported(&with(d().sinks(Sinks::new(&[0.5; 4]))), "attention sinks");
    assert_unsupported(&with(d().block_mask(mask)), "block-sparse masks");
    let packed = Case::new(1, 1, 16).varlen(&[9, 0, 20], &[14, 3, 0]);
    assert_unsupported(&packed, "packed (varlen) batches");
    assert_unsupported(&case.clone().dv(24), "a v head dim of its own");
}

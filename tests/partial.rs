//! Partial attention at global positions (ring attention's primitives) on
//! the CPU backend and wgpu: a sequence cut into shards that slice through
//! causal diagonals and windows, each query shard attended to each key
//! shard with `AttentionOptions::positions`, the parts merged by LSE
//! (`merge_partials`), must be the attention of the whole sequence; the
//! shard pairs' gradients, given the whole o and lse, must sum to its
//! gradients. Judged against the f64 reference of the *whole* problem
//! (computed without positions) under docs/semantics.md's accuracy rule.

mod common;

use common::shards::{cases, check_case};
use flashattn::{merge_partials, AttentionOptions, Cpu, Error, ForwardInputs, TensorView};

#[test]
fn cpu_shards_merge_into_the_whole_sequence() {
    let cpu = Cpu::new();
    for case in cases() {
        check_case(&cpu, &case);
    }
}

#[test]
fn wgpu_shards_merge_into_the_whole_sequence() {
    let Some(engine) = common::engine() else {
        return;
    };
    for case in cases() {
        check_case(engine, &case);
    }
}

/// A shard that no query of it can see (causal, keys all in its future):
/// every row is empty, o = 0 and lse = −∞, and merging it changes nothing.
#[test]
fn a_shard_in_the_future_is_empty_and_merges_away() {
    let x = vec![0.5f32; 4 * 2 * 8];
    let view = TensorView::f32([1, 4, 2, 8], &x);
    let opts = AttentionOptions::default().causal(true).positions(0, 4);
    let out = Cpu::new()
        .forward(&ForwardInputs::new(view, view, view), &opts)
        .unwrap();
    assert!(out.lse.iter().all(|&l| l == f32::NEG_INFINITY));
    assert!(out.o.to_f32().iter().all(|&v| v == 0.0));
    let seen = Cpu::new()
        .forward(
            &ForwardInputs::new(view, view, view),
            &AttentionOptions::default().causal(true).positions(0, 0),
        )
        .unwrap();
    let merged = merge_partials(&[seen.clone(), out]).unwrap();
    assert_eq!(merged.lse, seen.lse);
    assert_eq!(merged.o.to_f32(), seen.o.to_f32());
}

#[test]
fn positions_refuse_what_belongs_to_whole_sequences() {
    let x = vec![0.5f32; 4 * 2 * 8];
    let view = TensorView::f32([1, 4, 2, 8], &x);
    let inputs = ForwardInputs::new(view, view, view);
    let sinks = AttentionOptions::default()
        .positions(4, 0)
        .sinks(flashattn::Sinks::new(&[0.0, 0.0]));
    match Cpu::new().forward(&inputs, &sinks) {
        Err(Error::Unsupported { feature, .. }) => assert_eq!(feature, "attention sinks"),
        other => panic!("expected Unsupported, got {other:?}"),
    }
    let far = AttentionOptions::default().positions(flashattn::Positions::MAX + 1, 0);
    match Cpu::new().forward(&inputs, &far) {
        Err(Error::PositionTooLarge {
            which,
            position,
            max,
        }) => {
            assert_eq!(
                (which, position, max),
                ("q_offset", max + 1, flashattn::Positions::MAX)
            )
        }
        other => panic!("expected PositionTooLarge, got {other:?}"),
    }
    assert!(merge_partials(&[]).is_err());
}

/// A forward's (o, lse) on the CPU backend, whole: a part to corrupt.
fn one_part() -> flashattn::ForwardOutput {
    let x = vec![0.5f32; 4 * 2 * 8];
    let view = TensorView::f32([1, 4, 2, 8], &x);
    Cpu::new()
        .forward(
            &ForwardInputs::new(view, view, view),
            &AttentionOptions::default(),
        )
        .unwrap()
}

/// Partials are public structs (a ring's peers send their o and lse):
/// one whose lse or o holds fewer elements than its shape says, or whose
/// problem shape disagrees with its o, is a typed error, not a slice past
/// the end.
#[test]
fn merging_parts_of_the_wrong_length_is_a_typed_error() {
    let part = one_part();
    let mut short_lse = part.clone();
    short_lse.lse.pop();
    let mut short_o = part.clone();
    short_o.o.data = flashattn::TensorData::F32(vec![0.0; 10]);
    let mut wide = part.clone();
    wide.shape.head_dim_v = 16;
    // The first part's problem shape says how rows are laid out: o must
    // hold it.
    let cases = [
        ([part.clone(), short_lse.clone()], "a partial lse"),
        ([short_lse, part.clone()], "a partial lse"),
        ([part.clone(), short_o.clone()], "a partial o"),
        ([short_o, part.clone()], "a partial o"),
        ([wide, part], "a partial o"),
    ];
    for (parts, tensor) in cases {
        match merge_partials(&parts) {
            Err(Error::DataLength { tensor: t, .. }) => assert_eq!(t, tensor),
            other => panic!("expected DataLength for {tensor}, got {other:?}"),
        }
    }
}

/// A partial lse is finite or −∞; NaN or +∞ (a part corrupted on its way
/// from another rank) would turn the whole row's weights into NaN.
#[test]
fn merging_a_part_whose_lse_is_nan_or_plus_infinity_is_a_typed_error() {
    let part = one_part();
    let mut empty = part.clone();
    empty.lse[2] = f32::NEG_INFINITY;
    merge_partials(&[part.clone(), empty]).expect("an empty row is −∞");
    for bad in [f32::NAN, f32::INFINITY] {
        let mut broken = part.clone();
        broken.lse[5] = bad;
        match merge_partials(&[part.clone(), broken]) {
            Err(Error::NonFinite {
                tensor: "a partial lse",
                index: 5,
                ..
            }) => {}
            other => panic!("expected NonFinite for {bad}, got {other:?}"),
        }
    }
}

//! Every layout a model brings, on the GPU against the f64 reference under
//! docs/semantics.md's rule: ALiBi, attention sinks (and their gradients), block-sparse
//! masks of any block size, packed (varlen) batches — each alone and with
//! causal masks, windows, softcap and GQA, f32, f16 and bf16, forward and
//! backward, the lanes kernels and the tiled ones where both apply.

mod common;

use common::{block_mask, causal, engine, matrix, run_gpu, run_gpu_backward_both, window, Case};
use flashattn::{Alibi, Sinks};
use flashattn::{AttentionOptions, Error, ForwardInputs, TensorView};
use flashattn::{BlockGrid, BlockMask};

/// Forward (both kernels) and backward (both kernels) of `case`.
fn both_passes(case: &Case) {
    let Some(e) = engine() else { return };
    run_gpu(e, case);
    run_gpu_backward_both(e, case);
}

#[test]
fn alibi_alone_and_with_masks_softcap_gqa() {
    let Some(e) = engine() else { return };
    let per_head = |o: AttentionOptions, h| o.alibi(Alibi::standard(h));
    // Each option with ALiBi in f32 (d 64, GQA) or f16 (d 59), in turn
    // (both with FLASHATTN_FULL_MATRIX=1).
    for (i, opts) in [
        AttentionOptions::default(),
        causal(),
        window(9, 4),
        AttentionOptions::default().softcap(5.0),
    ]
    .into_iter()
    .enumerate()
    {
        if matrix(i % 2 == 0, true) {
            run_gpu(
                e,
                &Case::new(61, 77, 64)
                    .heads(4, 2)
                    .opts(per_head(opts.clone(), 4)),
            );
        }
        if matrix(i % 2 == 1, true) {
            run_gpu(e, &Case::new(77, 61, 59).opts(per_head(opts, 2)).f16());
        }
    }
    // (batch, heads_q) slopes, steep enough to dominate the scores.
    let slopes: Vec<f32> = (0..6).map(|i| 0.05 + 0.3 * i as f32).collect();
    let per_batch = causal().alibi(Alibi::new(&slopes));
    run_gpu(
        e,
        &Case::new(40, 50, 32)
            .batch(2)
            .heads(3, 1)
            .opts(per_batch.clone()),
    );
    both_passes(&Case::new(45, 53, 32).batch(2).heads(3, 1).opts(per_batch));
    both_passes(
        &Case::new(37, 41, 40)
            .heads(4, 2)
            .opts(per_head(window(6, 6).softcap(8.0), 4))
            .f16(),
    );
}

#[test]
fn sinks_alone_and_with_masks_softcap_gqa() {
    let Some(e) = engine() else { return };
    let sinks = |h: usize| Sinks::new(&(0..h).map(|i| i as f32 - 1.5).collect::<Vec<_>>());
    // Each option with sinks in f32 (d 64, GQA) or f16 (d 24), in turn
    // (both with FLASHATTN_FULL_MATRIX=1).
    for (i, opts) in [
        AttentionOptions::default(),
        causal(),
        window(5, 0),
        AttentionOptions::default().softcap(4.0),
    ]
    .into_iter()
    .enumerate()
    {
        if matrix(i % 2 == 0, true) {
            run_gpu(
                e,
                &Case::new(53, 61, 64)
                    .heads(4, 1)
                    .opts(opts.clone().sinks(sinks(4))),
            );
        }
        if matrix(i % 2 == 1, true) {
            run_gpu(e, &Case::new(61, 53, 24).opts(opts.sinks(sinks(2))).f16());
        }
    }
    // Rows with no allowed key: o = 0 and lse = the sink, exactly.
    let case = Case::new(40, 10, 32).opts(causal().sinks(sinks(2)));
    let out = run_gpu(e, &case);
    let o = out.o.to_f32();
    for h in 0..2 {
        for i in 0..30 {
            assert_eq!(
                out.lse[h * 40 + i],
                sinks(2).logits()[h],
                "row {i} head {h}"
            );
            assert!(o[(i * 2 + h) * 32..][..32].iter().all(|&x| x == 0.0));
        }
    }
    both_passes(&Case::new(40, 10, 32).opts(causal().sinks(sinks(2))));
    both_passes(
        &Case::new(47, 59, 32)
            .heads(4, 2)
            .opts(window(7, 3).sinks(sinks(4)))
            .f16(),
    );
}

/// In f16 and bf16 the dsinks come from an O recomputed in f32 (as the CPU
/// and CUDA backends take them), so they sit at f32 rounding, far inside
/// the baseline's error; from the stored O's D they land anywhere within a
/// few times it.
#[test]
fn dsinks_in_low_precision_sit_at_f32_rounding() {
    let Some(e) = engine() else { return };
    let sinks = Sinks::new(&[1.7, -2.4, 0.3, 3.1]);
    for case in [
        Case::new(29, 53, 16)
            .heads(4, 2)
            .batch(2)
            .opts(causal().sinks(sinks.clone()))
            .f16(),
        Case::new(40, 33, 24)
            .heads(4, 4)
            .opts(window(6, 2).sinks(sinks.clone()))
            .bf16(),
    ] {
        let out = common::run_gpu_backward(e, &case);
        let inputs = case.inputs();
        let [q, k, v] = inputs.views();
        let (_, g) = common::output_grad(&case);
        let checks =
            flashattn::accuracy::check_backward(&out, &q, &k, &v, &inputs.grad(&g), &case.opts)
                .unwrap();
        let c = checks
            .iter()
            .find(|c| c.name == "dsinks")
            .expect("a dsinks check");
        assert!(c.max_error <= c.baseline_error / 10.0, "{case:?}\n{c}");
    }
}

#[test]
fn dsinks_are_deterministic() {
    let Some(e) = engine() else { return };
    let case = Case::new(300, 200, 16)
        .heads(2, 1)
        .opts(AttentionOptions::default().sinks(Sinks::new(&[0.5, -2.0])));
    let a = run_gpu_backward_both(e, &case);
    let b = run_gpu_backward_both(e, &case);
    assert_eq!(a.dsinks, b.dsinks);
    assert_eq!(a.dsinks.as_ref().map(Vec::len), Some(2));
}

#[test]
fn block_masks_of_odd_block_sizes_and_densities() {
    let Some(e) = engine() else { return };
    for (i, (bm, bn)) in [(7, 13), (13, 7), (16, 16), (3, 5)].into_iter().enumerate() {
        // Densities are values: one per block size, in turn (all three with
        // FLASHATTN_FULL_MATRIX=1).
        for (j, density) in [0.1, 0.3, 0.6].into_iter().enumerate() {
            if !matrix(i % 3 == j, true) {
                continue;
            }
            let case = Case::new(67, 83, 32).heads(4, 2);
            let mask = block_mask(&case, (bm, bn), density, 4, (i * 3 + j) as u64);
            run_gpu(e, &case.opts(AttentionOptions::default().block_mask(mask)));
        }
    }
    // With causal masks, windows, softcap, f16; one grid broadcast to every head.
    let case = Case::new(70, 70, 59).f16();
    let mask = block_mask(&case, (7, 13), 0.5, 1, 9);
    for opts in [
        causal(),
        window(20, 5),
        AttentionOptions::default().softcap(5.0),
    ] {
        run_gpu(e, &case.clone().opts(opts.block_mask(mask.clone())));
    }
}

#[test]
fn block_masks_leave_rows_empty_and_skip_tiles() {
    let Some(e) = engine() else { return };
    // Every third block row is empty: those rows give o = 0, lse = -inf.
    let case = Case::new(64, 96, 32).heads(2, 2);
    let grid = BlockGrid::new(64, 96, (8, 16)).unwrap();
    let mask = BlockMask::from_fn(grid, [1, 2], |_, h, r, c| {
        r % 3 != 1 && (r + c + h) % 2 == 0
    });
    let dense = run_gpu(e, &case);
    let out = run_gpu(
        e,
        &case
            .clone()
            .opts(AttentionOptions::default().block_mask(mask)),
    );
    for h in 0..2 {
        for i in (8..16).chain(32..40) {
            assert_eq!(out.lse[h * 64 + i], f32::NEG_INFINITY);
        }
    }
    // Skip, don't mask: tiles without an allowed pair are never loaded.
    assert!(
        out.stats.accesses.reads < dense.stats.accesses.reads * 7 / 10,
        "{:?} vs {:?}",
        out.stats.accesses,
        dense.stats.accesses
    );
}

/// Mask blocks that are whole numbers of the kernels' tiles (64×64 and
/// 128×256 over the lanes and tiled kernels' tiles): every tile lies in one
/// block, the kernels are built without the per-pair mask test
/// (`Variant::partial`), and the results must still follow the mask, alone,
/// under a causal band and in a packed batch.
#[test]
fn block_masks_aligned_to_the_tiles() {
    let case = Case::new(300, 333, 32).heads(4, 2);
    for (block, density) in [((64, 64), 0.3), ((128, 256), 0.5)] {
        let mask = block_mask(&case, block, density, 4, 11);
        let dense = AttentionOptions::default();
        both_passes(&case.clone().opts(dense.block_mask(mask.clone())));
        both_passes(&case.clone().opts(causal().block_mask(mask)));
    }
    let packed = Case::new(1, 1, 32)
        .heads(2, 1)
        .varlen(&[200, 0, 70], &[130, 64, 300]);
    let mask = block_mask(&packed, (64, 64), 0.5, 2, 4);
    both_passes(&packed.opts(causal().block_mask(mask)));
}

#[test]
fn block_mask_builders() {
    let g = BlockGrid::new(90, 90, (8, 8)).unwrap();
    let case = Case::new(90, 90, 32).heads(4, 1);
    // The builders give masks (host code), the kernels are the same: each
    // forward, one also backward (all backward with FLASHATTN_FULL_MATRIX=1).
    let e = engine();
    for (i, mask) in [
        BlockMask::local_global(g, 1, 1),
        BlockMask::strided(g, 2, 3),
        BlockMask::bigbird(g, 4, 1, 1, 2, 5),
    ]
    .into_iter()
    .enumerate()
    {
        let case = case.clone().opts(causal().block_mask(mask));
        if matrix(i == 0, true) {
            both_passes(&case);
        } else if let Some(e) = e {
            run_gpu(e, &case);
        }
    }
}

#[test]
fn block_sparse_backward() {
    let case = Case::new(59, 71, 40).heads(4, 2);
    let mask = block_mask(&case, (7, 13), 0.4, 4, 2);
    both_passes(
        &case
            .clone()
            .opts(AttentionOptions::default().block_mask(mask.clone())),
    );
    both_passes(
        &case
            .clone()
            .opts(causal().softcap(6.0).block_mask(mask.clone())),
    );
    both_passes(&case.f16().opts(window(10, 10).block_mask(mask)));
}

#[test]
fn packed_batches_with_empty_sequences() {
    let Some(e) = engine() else { return };
    // Sequence 1 has no queries, sequence 2 no keys, sequence 3 more
    // queries than keys.
    let (lq, lk) = ([9, 0, 37, 50, 20], [14, 23, 0, 31, 20]);
    for (i, opts) in [
        AttentionOptions::default(),
        causal(),
        window(8, 2),
        AttentionOptions::default().softcap(5.0),
    ]
    .into_iter()
    .enumerate()
    {
        let case = Case::new(1, 1, 32).heads(4, 2).opts(opts).varlen(&lq, &lk);
        let out = run_gpu(e, &case);
        assert_eq!(out.o.shape, vec![116, 4, 32]);
        // One dispatch for the whole packed batch.
        assert_eq!(out.stats.dispatches, 1);
        // f16 with two of the options (all four with FLASHATTN_FULL_MATRIX=1).
        if matrix(i % 2 == 1, true) {
            run_gpu(e, &case.f16());
        }
    }
    let case = Case::new(1, 1, 24)
        .heads(2, 1)
        .opts(causal())
        .varlen(&lq, &lk);
    let out = run_gpu(e, &case);
    // The sequence without keys: every row empty.
    // Sequence 2 (no keys) starts after 9 + 0 rows.
    let start = 9;
    for h in 0..2 {
        for i in 0..37 {
            assert_eq!(out.lse[h * 116 + start + i], f32::NEG_INFINITY);
        }
    }
}

#[test]
fn packed_batches_backward() {
    let (lq, lk) = ([9, 0, 37, 20], [14, 23, 0, 33]);
    both_passes(&Case::new(1, 1, 32).heads(4, 2).varlen(&lq, &lk));
    both_passes(
        &Case::new(1, 1, 40)
            .heads(2, 2)
            .opts(causal())
            .varlen(&lq, &lk)
            .f16(),
    );
    both_passes(
        &Case::new(1, 1, 24)
            .heads(2, 1)
            .opts(window(5, 5).softcap(5.0))
            .varlen(&lq, &lk),
    );
    both_passes(&Case::new(1, 1, 16).opts(causal()).varlen(&lq, &lk).bf16());
}

#[test]
fn everything_at_once() {
    let case = common::everything_at_once();
    both_passes(&case);
    both_passes(&case.clone().f16());
    both_passes(&case.bf16());
}

#[test]
fn packed_calls_past_the_loop_limit_split_into_windows() {
    let Some(e) = engine() else { return };
    // d 256 tiled over 2500 keys is past llvmpipe's limit: windows of every
    // sequence's keys, merged by LSE (with sinks counted once).
    let tiled = flashattn::PlanOverrides::default().kernel(flashattn::KernelFamily::Tiled);
    let case = Case::new(1, 1, 256)
        .heads(1, 1)
        .opts(causal().sinks(Sinks::new(&[0.5])))
        .varlen(&[20, 40, 3], &[2500, 30, 60])
        .overrides(tiled);
    let out = run_gpu(e, &case);
    if e.loop_limit().is_some() {
        assert!(out.stats.pieces >= 2, "{:?}", out.stats);
    }
    run_gpu_backward_both(e, &case);
    // Pieces by kv heads where a binding holds one head's rows only.
    let small = flashattn::Engine::new()
        .unwrap()
        .with_binding_limit(200 * 2 * 16 * 4);
    let case = Case::new(1, 1, 16)
        .heads(4, 2)
        .varlen(&[50, 150], &[60, 90]);
    let out = run_gpu(&small, &case);
    assert!(out.stats.pieces >= 2);
    run_gpu_backward_both(&small, &case);
}

#[test]
fn bad_layouts_are_typed_errors() {
    let Some(e) = engine() else { return };
    let case = Case::new(20, 30, 16).heads(4, 2);
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let err = |opts: AttentionOptions| e.forward(&ForwardInputs::new(q, k, v), &opts).unwrap_err();
    assert!(matches!(
        err(AttentionOptions::default().alibi(Alibi::new(&[0.5; 3]))),
        Error::AlibiSlopes {
            len: 3,
            heads_q: 4,
            ..
        }
    ));
    assert!(matches!(
        err(AttentionOptions::default().sinks(Sinks::new(&[0.0, f32::NAN, 0.0, 0.0]))),
        Error::NonFinite {
            tensor: "sinks",
            index: 1,
            ..
        }
    ));
    let wrong = BlockMask::local_global(BlockGrid::new(20, 40, (7, 13)).unwrap(), 1, 0);
    assert!(matches!(
        err(AttentionOptions::default().block_mask(wrong)),
        Error::BlockMaskDim {
            value: 4,
            expected: 3,
            ..
        }
    ));
    let cu = flashattn::Varlen::new(&[0, 10, 19], &[0, 15, 30]).unwrap();
    assert!(matches!(
        err(AttentionOptions::default().varlen(cu)),
        Error::CuSeqlensTotal {
            last: 19,
            total: 20,
            ..
        }
    ));
    let batched = TensorView::f32([2, 10, 4, 16], &inputs.q);
    let cu = flashattn::Varlen::new(&[0, 10, 20], &[0, 15, 30]).unwrap();
    assert!(matches!(
        e.forward(
            &ForwardInputs::new(batched, k, v),
            &AttentionOptions::default().varlen(cu)
        ),
        Err(Error::PackedBatch { batch: 2, .. }) | Err(Error::DimMismatch { .. })
    ));
}

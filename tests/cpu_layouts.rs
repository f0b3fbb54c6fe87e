//! The CPU backend on every layout a model brings, forward and backward,
//! against the f64 reference under docs/semantics.md's rule, on every instruction set
//! this machine runs: ALiBi, sinks (and dsinks), block-sparse masks of odd
//! block sizes, packed batches with empty sequences, v's own head dim, head
//! dims past 256 — alone and with causal masks, windows, softcap and GQA,
//! f32 and f16. No adapter needed.

mod common;

use common::{block_mask, causal, check_cpu, window, Case};
use flashattn::AttentionOptions;
use flashattn::{Alibi, Sinks};
use flashattn::{BlockGrid, BlockMask};
use flashattn::{Cpu, Error, ForwardInputs, TensorView};

/// The CPU forward and backward of `case` on every instruction set, each
/// checked against the reference; dsinks exactly when the case has sinks.
fn run(case: &Case) {
    check_cpu(case, |_, _, _, bwd| {
        assert_eq!(bwd.dsinks.is_some(), case.opts.sinks.is_some());
    });
}

#[test]
fn cpu_alibi_and_sinks() {
    let sinks = Sinks::new(&[0.5, -1.0, 2.0, 0.0]);
    for opts in [
        AttentionOptions::default(),
        causal(),
        window(9, 3),
        AttentionOptions::default().softcap(5.0),
    ] {
        run(&Case::new(61, 77, 32)
            .heads(4, 2)
            .opts(opts.clone().alibi(Alibi::standard(4))));
        run(&Case::new(77, 61, 24)
            .heads(4, 1)
            .opts(opts.sinks(sinks.clone()))
            .f16());
    }
    // Rows with no key: o = 0, lse = the sink.
    run(&Case::new(40, 10, 16)
        .heads(4, 4)
        .opts(causal().sinks(sinks)));
    let per_batch: Vec<f32> = (0..6).map(|i| 0.1 * (i + 1) as f32).collect();
    run(&Case::new(33, 45, 16)
        .batch(2)
        .heads(3, 3)
        .opts(causal().alibi(Alibi::new(&per_batch))));
}

#[test]
fn cpu_block_masks() {
    for (i, (bm, bn)) in [(7, 13), (13, 7), (64, 64)].into_iter().enumerate() {
        for (j, density) in [0.1, 0.35, 0.6].into_iter().enumerate() {
            let case = Case::new(83, 97, 32).heads(4, 2);
            let mask = block_mask(&case, (bm, bn), density, 4, (3 * i + j) as u64);
            run(&case.opts(AttentionOptions::default().block_mask(mask)));
        }
    }
    let case = Case::new(70, 70, 24).f16();
    let mask = block_mask(&case, (7, 13), 0.5, 1, 9);
    for opts in [
        causal(),
        window(20, 5),
        AttentionOptions::default().softcap(4.0),
    ] {
        run(&case.clone().opts(opts.block_mask(mask.clone())));
    }
    // Rows left empty by the mask.
    let grid = BlockGrid::new(64, 96, (8, 16)).unwrap();
    let empty_rows = BlockMask::from_fn(grid, [1, 1], |_, _, r, c| r % 3 != 1 && (r + c) % 2 == 0);
    run(&Case::new(64, 96, 16).opts(AttentionOptions::default().block_mask(empty_rows)));
}

#[test]
fn cpu_packed_batches() {
    let (lq, lk) = ([9, 0, 37, 50, 20], [14, 23, 0, 31, 20]);
    for opts in [AttentionOptions::default(), causal(), window(8, 2)] {
        run(&Case::new(1, 1, 32)
            .heads(4, 2)
            .opts(opts.clone())
            .varlen(&lq, &lk));
        run(&Case::new(1, 1, 24)
            .heads(2, 1)
            .opts(opts)
            .varlen(&lq, &lk)
            .f16());
    }
}

#[test]
fn cpu_v_head_dims_and_wide_heads() {
    for (d, dv) in [(192, 128), (40, 24), (24, 40)] {
        run(&Case::new(37, 45, d).dv(dv).heads(4, 2));
        run(&Case::new(45, 37, d).dv(dv).opts(causal()).f16());
    }
    for d in [288, 384, 512] {
        run(&Case::new(23, 31, d).heads(2, 1));
    }
    run(&Case::new(31, 23, 512).opts(causal()).f16());
    // The widest: MLA's latent width 576 with its first 512 as v.
    run(&Case::new(13, 19, 576).dv(512).heads(2, 1));
    run(&Case::new(19, 13, 576).dv(512).opts(causal()).f16());
}

#[test]
fn cpu_everything_at_once() {
    let case = common::everything_at_once();
    run(&case);
    run(&case.f16());
}

/// Few rows over many keys (one task, fewer than the threads): the
/// forward splits the keys and merges the splits by their LSE, per sequence
/// of a packed batch, with the sink added once after the merge and ALiBi
/// and a block mask on every split.
#[test]
fn cpu_split_keys_under_every_layout() {
    let (lq, lk) = ([1, 0, 0], [1500, 0, 70]);
    let sinks = Sinks::new(&[0.5]);
    for opts in [causal(), window(300, 0), AttentionOptions::default()] {
        let opts = opts.alibi(Alibi::standard(1)).sinks(sinks.clone());
        run(&Case::new(1, 1, 32).heads(1, 1).opts(opts).varlen(&lq, &lk));
    }
    let case = Case::new(2, 2000, 40).heads(1, 1);
    let mask = block_mask(&case, (1, 64), 0.4, 1, 5);
    run(&case
        .clone()
        .opts(AttentionOptions::default().block_mask(mask.clone())));
    run(&case.f16().opts(causal().block_mask(mask).sinks(sinks)));
}

/// A block mask whose public `dims` or `grid` were changed after it was
/// built no longer matches its data: a typed error before any work, not a
/// slice past the end of its blocks.
#[test]
fn a_block_mask_changed_field_by_field_is_a_typed_error() {
    let x = vec![0.5f32; 4 * 2 * 8];
    let view = TensorView::f32([1, 4, 2, 8], &x);
    let inputs = ForwardInputs::new(view, view, view);
    let mask = BlockMask::new([1, 1, 2, 2], (2, 2), &[1, 0, 1, 1]).unwrap();
    let forward = |mask: BlockMask| {
        Cpu::new()
            .forward(&inputs, &AttentionOptions::default().block_mask(mask))
            .unwrap_err()
    };
    // Two heads claimed, one head's blocks held.
    let mut heads = mask.clone();
    heads.dims[1] = 2;
    let err = forward(heads);
    assert!(
        matches!(
            err,
            Error::DataLength {
                tensor: "block_mask",
                expected: 8,
                actual: 4,
                ..
            }
        ),
        "{err}"
    );
    // A grid wider than the dims it was built with.
    let mut grid = mask.clone();
    grid.grid.cols = 7;
    let err = forward(grid);
    assert!(
        matches!(
            err,
            Error::BlockMaskDim {
                value: 7,
                expected: 2,
                ..
            }
        ),
        "{err}"
    );
    // Smaller blocks, their count raised to match, over the same data.
    let mut rows = mask;
    rows.grid.bm = 1;
    rows.grid.rows = 4;
    rows.dims[2] = 4;
    let err = forward(rows);
    assert!(matches!(err, Error::DataLength { .. }), "{err}");
}

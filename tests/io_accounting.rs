//! The instrumented kernels' own access counts equal the analytic counts, for
//! every kernel and mask; and Theorem 2's shape: flash accesses fall like 1/M.

mod common;

use common::{engine, matrix, output_grad, Case};
use flashattn::{Accesses, AttentionOptions, Engine, ForwardInputs, KernelFamily, PlanOverrides};
use std::sync::OnceLock;

/// One instrumented engine for this process (calls run one at a time).
fn counting() -> Option<&'static std::sync::Mutex<Engine>> {
    engine()?;
    static E: OnceLock<std::sync::Mutex<Engine>> = OnceLock::new();
    Some(E.get_or_init(|| std::sync::Mutex::new(Engine::new().unwrap().with_io_counting())))
}

fn assert_counts(what: &str, analytic: Accesses, measured: Option<Accesses>) {
    assert_eq!(Some(analytic), measured, "{what}: analytic vs counted");
    assert!(analytic.reads > 0 && analytic.writes > 0, "{what}");
}

fn cases() -> Vec<Case> {
    let causal = AttentionOptions::default().causal(true);
    let window = AttentionOptions::default().window(Some(9), Some(4));
    vec![
        Case::new(97, 113, 64),
        Case::new(113, 97, 59).opts(causal.clone()),
        Case::new(40, 10, 32).opts(causal.clone()).heads(4, 2),
        Case::new(77, 90, 24).opts(window.clone()).batch(2),
        Case::new(64, 64, 16)
            .opts(AttentionOptions::default().softcap(5.0))
            .f16(),
        Case::new(33, 47, 40)
            .f16()
            .overrides(PlanOverrides::default().f16_native(false)),
        Case::new(1, 300, 64).heads(8, 1),
        // v with its own head dim (both ways), and a head dim past 256.
        Case::new(33, 41, 40).dv(24).heads(4, 2),
        Case::new(25, 30, 24).dv(40).opts(causal.clone()),
        Case::new(20, 27, 512).heads(2, 1),
        Case::new(45, 37, 59).opts(causal).bf16(),
    ]
}

/// Forward and backward on the kernel families `which` picks from the
/// planner's, the tiled and the registers: the analytic counts equal the
/// counted ones.
fn flash_counts_match(e: &Engine, case: &Case, which: &[usize]) {
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let tiled = case.overrides.kernel(KernelFamily::Tiled);
    let (_, g) = output_grad(case);
    let d_o = inputs.grad(&g);
    let registers = case.overrides.kernel(KernelFamily::Registers);
    let families = [
        ("planned", case.overrides),
        ("tiled", tiled),
        ("registers", registers),
    ];
    for &(kernel, overrides) in which.iter().map(|&i| &families[i]) {
        let fwd = e
            .forward_with(&ForwardInputs::new(q, k, v), &case.opts, &overrides)
            .unwrap();
        assert_counts(
            &format!("{kernel} forward {case:?}"),
            fwd.stats.accesses,
            fwd.stats.measured_accesses,
        );
        let bwd_inputs =
            flashattn::BackwardInputs::new(ForwardInputs::new(q, k, v), &fwd, d_o).unwrap();
        let bwd = e
            .backward_with(&bwd_inputs, &case.opts, &overrides)
            .unwrap();
        assert_counts(
            &format!("{kernel} backward {case:?}"),
            bwd.stats.accesses,
            bwd.stats.measured_accesses,
        );
    }
}

#[test]
fn flash_forward_and_backward_counts_match() {
    let Some(e) = counting() else { return };
    let e = e.lock().unwrap();
    // Each case on one family, in turn (on all three with
    // FLASHATTN_FULL_MATRIX=1): every family meets masks, GQA, both head
    // dims, a wide one and the low precisions.
    for (i, case) in cases().iter().enumerate() {
        flash_counts_match(&e, case, &matrix(vec![i % 3], vec![0, 1, 2]));
    }
}

/// Packed batches, ALiBi, sinks (and their gradients' passes) and block
/// masks: the side tables are not counted, skipped tiles are not loaded.
#[test]
fn layout_counts_match_and_skipped_tiles_are_not_loaded() {
    let Some(e) = counting() else { return };
    let e = e.lock().unwrap();
    let sparse = Case::new(59, 71, 32).heads(4, 2);
    let mask = common::block_mask(&sparse, (7, 13), 0.3, 4, 1);
    let packed = Case::new(1, 1, 24)
        .heads(4, 2)
        .varlen(&[9, 0, 37, 20], &[14, 23, 0, 33]);
    let packed_mask = common::block_mask(&packed, (16, 8), 0.5, 1, 2);
    let opts = AttentionOptions::default();
    let cases = [
        sparse.clone().opts(opts.clone().block_mask(mask.clone())),
        sparse
            .clone()
            .opts(opts.clone().causal(true).block_mask(mask))
            .f16(),
        packed.clone(),
        packed.clone().opts(
            opts.clone()
                .causal(true)
                .alibi(flashattn::Alibi::standard(4))
                .sinks(flashattn::Sinks::new(&[0.0, 1.0, -1.0, 2.0]))
                .block_mask(packed_mask),
        ),
    ];
    for case in &cases {
        flash_counts_match(&e, case, &[0, 1, 2]);
    }
    // With blocks as large as the tiles, the sparse forward reads K and V
    // only for about the allowed quarter of them.
    let case = Case::new(256, 256, 32).heads(2, 2);
    let quarter = common::block_mask(&case, (32, 32), 0.25, 2, 3);
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let dense = e
        .forward(&ForwardInputs::new(q, k, v), &opts)
        .unwrap()
        .stats
        .accesses;
    let sparse = e
        .forward(
            &ForwardInputs::new(q, k, v),
            &opts.block_mask(quarter.clone()),
        )
        .unwrap()
        .stats;
    assert_counts("quarter", sparse.accesses, sparse.measured_accesses);
    let kv = |a: flashattn::Accesses| a.reads - 256 * 2 * 32;
    let ratio = kv(sparse.accesses) as f64 / kv(dense) as f64;
    assert!(
        (ratio - quarter.density()).abs() < 0.02,
        "K/V reads {ratio} of dense, density {}",
        quarter.density()
    );
    assert_eq!(sparse.accesses.writes, dense.writes);
}

#[test]
fn naive_and_matmul_counts_match() {
    let Some(e) = counting() else { return };
    let e = e.lock().unwrap();
    // Every other case (all with FLASHATTN_FULL_MATRIX=1): aligned and
    // not, masks, GQA, v's own head dim, each precision.
    let all = cases();
    let picked = matrix(all.iter().step_by(2).cloned().collect(), all.clone());
    // Dropout writes P ∘ keep back in the dS kernel: with GQA (the dK/dV
    // kernel) and without (the transposes).
    let dropout = |o: AttentionOptions| o.dropout(0.3).dropout_seed(5);
    let dropped = [
        Case::new(40, 10, 32)
            .heads(4, 2)
            .opts(dropout(AttentionOptions::default().causal(true))),
        Case::new(33, 47, 16)
            .f16()
            .opts(dropout(Default::default())),
    ];
    for case in picked.into_iter().chain(dropped) {
        let inputs = case.inputs();
        let [q, k, v] = inputs.views();
        let fwd = e
            .naive_forward(&ForwardInputs::new(q, k, v), &case.opts)
            .unwrap();
        assert_counts(
            &format!("naive forward {case:?}"),
            fwd.stats.accesses,
            fwd.stats.measured_accesses,
        );
        let (_, g) = output_grad(&case);
        let d_o = inputs.grad(&g);
        let bwd = e
            .naive_backward(&ForwardInputs::new(q, k, v), &d_o, &case.opts)
            .unwrap();
        assert_counts(
            &format!("naive backward {case:?}"),
            bwd.stats.accesses,
            bwd.stats.measured_accesses,
        );
    }
    for shape in [
        flashattn::CeilingShape::Scores,
        flashattn::CeilingShape::Values,
    ] {
        let c = e.matmul_ceiling(shape, 100, 40, 1).unwrap();
        assert!(c.gflops() > 0.0);
    }
}

#[test]
fn split_problems_count_every_piece() {
    let Some(_) = counting() else { return };
    let e = Engine::new()
        .unwrap()
        .with_binding_limit(16 * 16 * 4)
        .with_io_counting();
    let case = Case::new(50, 70, 16)
        .heads(2, 1)
        .opts(AttentionOptions::default().causal(true));
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let fwd = e.forward(&ForwardInputs::new(q, k, v), &case.opts).unwrap();
    assert!(fwd.stats.dispatches > 4);
    assert_counts(
        "split forward",
        fwd.stats.accesses,
        fwd.stats.measured_accesses,
    );
}

/// Theorem 2: with Br ≈ Bc ≈ M/4d, K and V are read once per query block, so
/// flash reads ≈ 2·N·d·N/Br ∝ N²d²/M; the naive computation's accesses do not
/// depend on M and exceed flash's.
#[test]
fn flash_accesses_fall_like_one_over_m() {
    let Some(e) = engine() else { return };
    let case = Case::new(512, 512, 64).heads(1, 1);
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let mut last = u64::MAX;
    let mut products = Vec::new();
    for m in [4096u32, 8192, 16384, 32768] {
        if m > e.caps().max_workgroup_storage {
            continue;
        }
        let o = PlanOverrides::default().max_workgroup_storage(m);
        let out = e
            .forward_with(&ForwardInputs::new(q, k, v), &case.opts, &o)
            .unwrap();
        let a = out.stats.accesses.total();
        assert!(a < last, "M {m}: {a} accesses, not fewer than {last}");
        last = a;
        products.push(a as f64 * m as f64);
    }
    let (lo, hi) = products
        .iter()
        .fold((f64::MAX, 0f64), |(lo, hi), &p| (lo.min(p), hi.max(p)));
    assert!(
        hi / lo < 2.5,
        "accesses × M should be roughly constant: {products:?}"
    );
    let naive = e
        .naive_forward(&ForwardInputs::new(q, k, v), &case.opts)
        .unwrap();
    assert!(
        naive.stats.accesses.total() > last,
        "naive {:?} vs flash {last}",
        naive.stats.accesses
    );
}

/// Decoding: the counted accesses equal the analytic ones for every layout,
/// mask and split count; and without splits or appends, the reads are q
/// once plus each K/V element once per GQA group (a workgroup takes the
/// whole group, so a K/V row is loaded once for all its query heads).
#[test]
fn decode_counts_match_and_read_kv_once_per_group() {
    use common::decode::DecodeCase;
    let Some(e) = counting() else { return };
    let e = e.lock().unwrap();
    let causal = AttentionOptions::default().causal(true);
    let counted = [
        DecodeCase::new(&[300, 0, 45], 32)
            .append(3)
            .opts(causal.clone()),
        DecodeCase::new(&[513, 200], 64)
            .heads(16, 2)
            .seqlen_q(4)
            .append(2)
            .splits(3),
        DecodeCase::new(&[200, 37], 48)
            .heads(8, 2)
            .paged(16)
            .f16()
            .append(1)
            .splits(5),
        // V's head dim its own: K rows of 64, V and o rows of 32.
        DecodeCase::new(&[250, 9], 64)
            .dv(32)
            .heads(4, 2)
            .append(2)
            .splits(2),
    ];
    for case in counted {
        let data = case.data();
        let out = data.check(|c, s| e.decode_host(c, s, &case.opts, case.num_splits));
        assert_counts(
            &format!("decode {case:?}"),
            out.stats.accesses,
            out.stats.measured_accesses,
        );
    }
    for (lens, heads, d) in [(vec![1000, 7, 300], (8, 1), 64), (vec![4096], (32, 8), 128)] {
        let case = DecodeCase::new(&lens, d).heads(heads.0, heads.1).splits(1);
        let data = case.data();
        let out = data.check(|c, s| e.decode_host(c, s, &case.opts, Some(1)));
        let keys: usize = lens.iter().sum();
        let q = lens.len() * heads.0 * d;
        let kv_once_per_group = 2 * keys * heads.1 * d;
        let measured = out.stats.measured_accesses.unwrap();
        assert_eq!(measured.reads as usize, q + kv_once_per_group, "{case:?}");
        assert_eq!(out.stats.accesses, measured);
    }
}

/// The FP8 forward's quantization (each input element read by the max and
/// the codes pass) and attention counted as analysed, with and without the
/// transform, on both forward kernels where the adapter has two.
#[test]
fn fp8_forward_counts_match() {
    let Some(e) = counting() else { return };
    let e = e.lock().unwrap();
    let causal = AttentionOptions::default().causal(true);
    for (i, case) in [
        Case::new(45, 37, 59).opts(causal),
        Case::new(33, 50, 64).heads(4, 2),
    ]
    .into_iter()
    .enumerate()
    {
        let inputs = case.inputs();
        let [q, k, v] = inputs.views();
        for (j, fp8) in [
            flashattn::Fp8Options::default(),
            flashattn::Fp8Options::hadamard(3),
        ]
        .into_iter()
        .enumerate()
        {
            let kernels = [
                None,
                Some(KernelFamily::Tiled),
                Some(KernelFamily::Registers),
            ];
            // Each (case, transform) on one or two families, in turn (all
            // three with FLASHATTN_FULL_MATRIX=1).
            let picked = matrix(
                vec![kernels[(2 * i + j) % 3], kernels[(2 * i + j + 1) % 3]],
                kernels.to_vec(),
            );
            for kernel in picked {
                let mut o = PlanOverrides::default();
                o.kernel = kernel;
                let out = e
                    .forward_fp8_with(&ForwardInputs::new(q, k, v), &case.opts, &fp8, &o)
                    .unwrap();
                let what = format!("fp8 {fp8:?} {kernel:?} {case:?}");
                assert_counts(&what, out.stats.accesses, out.stats.measured_accesses);
            }
        }
    }
}

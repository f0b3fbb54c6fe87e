//! The loop model against the driver. On an adapter with a loop limit
//! (llvmpipe), kernels built with the meter (`Engine::with_loop_meter`)
//! report the loop iterations they took, as the limit counts them; each
//! kernel's model (`loop_cost`, from its plan) must never predict fewer —
//! else calls would run past the limit and need the guard — and not many
//! more, else calls would be cut into more pieces than needed. On an
//! adapter without a limit the same calls must report no iterations (there
//! is nothing to count against) and run whole: one piece, no rerun.

mod common;

use common::{engine, matrix, output_grad, Case};
use flashattn::kernels::loops::GUARD;
use flashattn::kernels::{BackwardPart, FlashBackward, FlashForward, LoopCost, Variant};
use flashattn::{BackwardInputs, Engine, ForwardInputs, KernelFamily, PlanOverrides, Precision};
use std::sync::OnceLock;

/// An engine whose kernels meter their loops (where the adapter has a limit).
fn metered() -> Option<&'static Engine> {
    engine()?;
    static METERED: OnceLock<Engine> = OnceLock::new();
    Some(METERED.get_or_init(|| Engine::new().unwrap().with_loop_meter()))
}

fn tiled() -> PlanOverrides {
    PlanOverrides::default().kernel(KernelFamily::Tiled)
}

/// Tiled kernels with these tiles (small ones have loops llvmpipe unrolls).
fn tiles(b: u32, threads_per_row: u32) -> PlanOverrides {
    tiled().br(b).bc(b).threads_per_row(threads_per_row)
}

/// Tiled kernels planned for a browser's 16 KiB of workgroup storage.
fn browser() -> PlanOverrides {
    tiled().max_workgroup_storage(16384)
}

/// `measured` within the model's prediction, and the prediction tight. The
/// meter takes the guard's place, so its iterations are not measured.
fn assert_modeled(what: &str, cost: &LoopCost, len: usize, measured: u32) {
    let predicted = cost.iterations(len) - GUARD;
    let m = measured as u64;
    eprintln!("{what} over {len}: measured {m}, predicted {predicted} {cost:?}");
    assert!(
        m <= predicted && predicted <= m + m / 4 + 32,
        "{what} over {len}: measured {m} loop iterations, the model predicts {predicted} ({cost:?})"
    );
}

/// The iterations the call's `kernel` took, where the adapter has a limit;
/// `None` where it has none, after asserting what the engine then does:
/// nothing metered, the call in one piece (decoding counts none), never rerun.
fn measured(e: &Engine, stats: &flashattn::CallStats, kernel: &str) -> Option<u32> {
    if e.loop_limit().is_none() {
        assert!(stats.loop_iterations.is_empty(), "{stats:?}");
        assert!(stats.pieces <= 1 && stats.reruns == 0, "{stats:?}");
        return None;
    }
    let found = stats.loop_iterations.iter().find(|(k, _)| *k == kernel);
    let n = found
        .map(|(_, n)| *n)
        .unwrap_or_else(|| panic!("{kernel} was not metered: {stats:?}"));
    Some(n)
}

/// The forward's iterations on `case` against its model.
fn forward_modeled(e: &Engine, case: &Case) {
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let out = e
        .forward_with(&ForwardInputs::new(q, k, v), &case.opts, &case.overrides)
        .unwrap();
    let plan = out.stats.plan.unwrap();
    let kernel = FlashForward {
        plan,
        variant: Variant::default(),
    };
    let what = format!(
        "{} forward d {} dv {}",
        plan.kernel.name(),
        case.head_dim,
        case.head_dim_v
    );
    if let Some(n) = measured(e, &out.stats, FlashForward::NAME) {
        assert_modeled(&what, &kernel.loop_cost(), case.seqlen_k, n);
    }
}

/// The backward's dK/dV and dQ iterations on `case` (seqlen_q = seqlen_k)
/// against their models.
fn backward_modeled(e: &Engine, case: &Case) {
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let overrides = &case.overrides;
    let fwd = e
        .forward_with(&ForwardInputs::new(q, k, v), &case.opts, overrides)
        .unwrap();
    let (_, g) = output_grad(case);
    let bwd_inputs =
        BackwardInputs::new(ForwardInputs::new(q, k, v), &fwd, inputs.grad(&g)).unwrap();
    let out = e.backward_with(&bwd_inputs, &case.opts, overrides).unwrap();
    let plan = e
        .plan_backward(&fwd.shape, Precision::F32, overrides)
        .unwrap()
        .plan;
    let group = (case.heads_q / case.heads_kv) as u32;
    for part in [BackwardPart::DkDv, BackwardPart::Dq] {
        let kernel = FlashBackward::new(part, plan, Variant::default());
        let what = format!(
            "{} {} d {} dv {} group {group}",
            plan.kernel.name(),
            kernel.name(),
            case.head_dim,
            case.head_dim_v
        );
        if let Some(n) = measured(e, &out.stats, kernel.name()) {
            assert_modeled(&what, &kernel.loop_cost(group), case.seqlen_q, n);
        }
    }
}

#[test]
fn forward_loops_are_modeled() {
    let Some(e) = metered() else { return };
    let cases = [
        (64, PlanOverrides::default()),
        (128, PlanOverrides::default()),
        (16, tiled()),
        (59, tiled()),
        (64, tiled()),
        (128, tiled()),
        (256, tiled()),
        (64, browser()),
        (256, browser()),
        (16, tiles(4, 1)),
        (64, tiles(4, 2)),
        (64, tiles(8, 4)),
        (32, tiles(8, 8)),
        (256, tiles(4, 16)),
    ];
    // Each plan shape of the model once: the default, tails and widths of
    // the tiled kernels, the browser's plans, unrolled and counted tile
    // loops (every listed one with FLASHATTN_FULL_MATRIX=1).
    let picked = matrix(vec![0, 3, 6, 8, 9, 12, 13], (0..cases.len()).collect());
    for (d, overrides) in picked.into_iter().map(|i| cases[i]) {
        for keys in [96, 384] {
            forward_modeled(e, &Case::new(64, keys, d).heads(1, 1).overrides(overrides));
        }
    }
}

#[test]
fn backward_loops_are_modeled() {
    let Some(e) = metered() else { return };
    let cases = [
        (64, PlanOverrides::default()),
        (59, tiled()),
        (64, tiled()),
        (128, tiled()),
        (256, tiled()),
        (64, browser()),
        (256, browser()),
        (16, tiles(4, 1)),
        (64, tiles(4, 4)),
        (64, tiles(8, 4)),
        (32, tiles(8, 8)),
        (256, tiles(4, 16)),
    ];
    // As in the forward: each plan shape once by default.
    let picked = matrix(vec![0, 1, 4, 6, 7, 10, 11], (0..cases.len()).collect());
    for (d, overrides) in picked.into_iter().map(|i| cases[i]) {
        for (heads, len) in [((1, 1), 96), ((2, 1), 200)] {
            let case = Case::new(len, len, d)
                .heads(heads.0, heads.1)
                .overrides(overrides);
            backward_modeled(e, &case);
        }
    }
}

/// Head dims past 256 and v's own head dim, forward and backward.
#[test]
fn wide_and_v_head_dims_are_modeled() {
    let Some(e) = metered() else { return };
    for (d, dv, overrides) in [
        (512, 512, PlanOverrides::default()),
        (384, 384, browser()),
        (192, 128, tiled()),
        (40, 24, PlanOverrides::default()),
        (24, 40, tiled()),
    ] {
        let case = |sq, sk| Case::new(sq, sk, d).dv(dv).heads(1, 1).overrides(overrides);
        forward_modeled(e, &case(32, 160));
        backward_modeled(e, &case(80, 80));
    }
}

/// The registers kernels with their settings: rows per invocation, subgroup
/// or workgroup-memory reductions, one or two K/V buffers.
fn registers(rm: u32, subgroup: bool, double: bool) -> PlanOverrides {
    PlanOverrides::default()
        .kernel(KernelFamily::Registers)
        .rows_per_thread(rm)
        .subgroup_reduce(subgroup)
        .double_buffer(double)
}

#[test]
fn registers_loops_are_modeled() {
    let Some(e) = metered() else { return };
    let sg = e.caps().subgroup.is_some();
    for (d, dv, overrides) in [
        (64, 64, registers(4, sg, false)),
        (64, 64, registers(4, false, true)),
        (59, 59, registers(2, false, false)),
        (16, 16, registers(1, sg, true)),
        (128, 128, registers(2, sg, false)),
        (256, 256, registers(1, false, false)),
        (512, 512, registers(1, false, false)),
        (40, 24, registers(4, sg, false)),
    ] {
        for keys in [96, 384] {
            let case = Case::new(64, keys, d)
                .dv(dv)
                .heads(1, 1)
                .overrides(overrides);
            forward_modeled(e, &case);
        }
        // The backward's registers kernels take neither setting.
        let mut backward = overrides;
        backward.subgroup_reduce = None;
        backward.double_buffer = None;
        for (heads, len) in [((1, 1), 96), ((2, 1), 200)] {
            let case = Case::new(len, len, d)
                .dv(dv)
                .heads(heads.0, heads.1)
                .overrides(backward);
            backward_modeled(e, &case);
        }
    }
}

/// The decode kernel over one split of every length a split may have.
#[test]
fn decode_loops_are_modeled() {
    use common::decode::DecodeCase;
    use flashattn::kernels::FlashDecode;
    use flashattn::plan::decode::decode_tiles;
    let Some(e) = metered() else { return };
    for (d, heads, seqlen_q) in [
        (64, (8, 1), 1),
        (128, (32, 8), 1),
        (59, (4, 2), 4),
        (256, (2, 1), 16),
        (32, (16, 1), 1),
        (16, (4, 1), 1),
    ] {
        for keys in [96, 1000] {
            let case = DecodeCase::new(&[keys], d)
                .heads(heads.0, heads.1)
                .seqlen_q(seqlen_q)
                .splits(1);
            let data = case.data();
            let step = data.step();
            let mut cache = data.cache.clone();
            let out = e
                .decode_host(&mut cache, &step, &case.opts, Some(1))
                .unwrap();
            let problem =
                flashattn::DecodeProblem::new(&step, &cache.shape, cache.precision()).unwrap();
            let plan = e.plan_decode(&problem, &case.opts, Some(1)).unwrap();
            let req = flashattn::plan::DecodeRequest {
                batch: 1,
                seqlen_q,
                heads_q: heads.0,
                heads_kv: heads.1,
                head_dim: d,
                head_dim_v: d,
                max_seqlen_k: keys,
                precision: Precision::F32,
                num_splits: Some(1),
                f16_native: None,
                kernel: None,
            };
            let tiles = decode_tiles(&req, &e.caps()).unwrap();
            assert_eq!(tiles, plan.tiles);
            let kernel = FlashDecode {
                tiles,
                partial: false,
                quant: None,
                variant: Variant::default(),
            };
            let what = format!("decode d {d} rows {}", tiles.rows);
            if let Some(n) = measured(e, &out.stats, FlashDecode::NAME) {
                assert_modeled(&what, &kernel.loop_cost(), keys, n);
            }
        }
    }
}

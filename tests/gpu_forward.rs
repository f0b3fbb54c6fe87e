//! GPU forward against the f64 reference under docs/semantics.md's accuracy rule.
//! All GPU tests of this file share one engine (one device) in one process.

mod common;

use common::{assert_accurate, engine, matrix, run_gpu, run_gpu_values, Case};
use flashattn::{
    AttentionOptions, CeilingShape, Error, ForwardInputs, KernelFamily, PlanOverrides, Precision,
    StorageKind, TensorView, Window,
};
use flashattn_testkit::Need;

fn causal() -> AttentionOptions {
    AttentionOptions::default().causal(true)
}

fn tiled() -> PlanOverrides {
    PlanOverrides::default().kernel(KernelFamily::Tiled)
}

/// Both f16 paths where the adapter has native f16, else the packed one.
fn f16_variants() -> Vec<PlanOverrides> {
    let mut v = vec![PlanOverrides::default().f16_native(false)];
    if engine().is_some_and(|e| e.caps().shader_f16) {
        v.push(PlanOverrides::default().f16_native(true));
    }
    v
}

#[test]
fn seeds_worked_example_gives_0_752() {
    let Some(e) = engine() else { return };
    // One query, three keys with scores 1.414, 0.707, 0.707 (scale 1), v = 1, 0, 1.
    let q = [1.414f32];
    let k = [1.0f32, 0.5, 0.5];
    let v = [1.0f32, 0.0, 1.0];
    let opts = AttentionOptions::default().scale(1.0);
    // Both block splits of the seeds: {2, 1} (Bc = 2) and {1, 2} (Bc = 1).
    for bc in [1u32, 2, 3] {
        let overrides = PlanOverrides::default().bc(bc).br(1).threads_per_row(1);
        let out = e
            .forward_with(
                &ForwardInputs::new(
                    TensorView::f32([1, 1, 1, 1], &q),
                    TensorView::f32([1, 3, 1, 1], &k),
                    TensorView::f32([1, 3, 1, 1], &v),
                ),
                &opts,
                &overrides,
            )
            .unwrap();
        let o = out.o.to_f32()[0];
        assert!((o - 0.7518).abs() < 1e-4, "Bc {bc}: {o}");
        assert_eq!(format!("{o:.3}"), "0.752");
    }
}

#[test]
fn odd_seqlens_f32() {
    let Some(e) = engine() else { return };
    for s in [1, 3, 97, 113, 255] {
        run_gpu_values(e, &Case::new(s, s, 64));
    }
    run_gpu_values(e, &Case::new(1023, 1023, 32).heads(1, 1));
}

#[test]
fn seqlen_q_differs_from_seqlen_k() {
    let Some(e) = engine() else { return };
    // Each shape plain or causal in turn (both with FLASHATTN_FULL_MATRIX=1).
    for (i, (sq, sk)) in [(1, 255), (255, 1), (113, 3), (3, 113), (97, 300), (300, 97)]
        .into_iter()
        .enumerate()
    {
        if matrix(i % 2 == 0, true) {
            run_gpu_values(e, &Case::new(sq, sk, 64));
        }
        if matrix(i % 2 == 1, true) {
            run_gpu_values(e, &Case::new(sq, sk, 64).opts(causal()));
        }
    }
}

#[test]
fn head_dims() {
    let Some(e) = engine() else { return };
    // Vec4 tails of 1 and 3, whole vec4s, and the widest the lanes kernels
    // take (every one listed with FLASHATTN_FULL_MATRIX=1).
    let dims = matrix(
        vec![1, 3, 32, 255, 256],
        vec![1, 3, 16, 32, 59, 64, 111, 128, 255, 256],
    );
    for d in dims {
        run_gpu(e, &Case::new(97, 113, d));
    }
}

/// Every low-precision storage path: f16 packed (and native where the
/// adapter has it), bf16 packed.
fn low_precisions() -> Vec<(Precision, PlanOverrides)> {
    let mut v: Vec<_> = f16_variants()
        .into_iter()
        .map(|o| (Precision::F16, o))
        .collect();
    v.push((Precision::Bf16, PlanOverrides::default()));
    v
}

#[test]
fn head_dims_past_256() {
    let Some(e) = engine() else { return };
    for d in matrix(vec![288, 512], vec![288, 384, 512]) {
        let out = run_gpu(e, &Case::new(37, 45, d).heads(2, 1));
        assert_eq!(out.stats.plan.unwrap().head_dim, d as u32);
    }
    run_gpu(e, &Case::new(29, 40, 512).opts(causal()).f16());
    // The browser's default 16 KiB of workgroup storage plans d 512 too.
    let browser = PlanOverrides::default().max_workgroup_storage(16384);
    let out = run_gpu(e, &Case::new(21, 30, 512).overrides(browser));
    assert!(out.stats.plan.unwrap().workgroup_bytes <= 16384);
    // The widest: MLA's latent width 576 for q/k with its first 512 as v,
    // odd sizes, on the planner's kernel and every other family, and on
    // the browser's 16 KiB.
    let out = run_gpu(e, &Case::new(13, 19, 576).dv(512).heads(2, 1));
    let plan = out.stats.plan.unwrap();
    assert_eq!((plan.head_dim, plan.head_dim_v), (576, 512));
    let out = run_gpu(
        e,
        &Case::new(7, 11, 576)
            .dv(512)
            .opts(causal())
            .overrides(browser),
    );
    assert!(out.stats.plan.unwrap().workgroup_bytes <= 16384);
}

#[test]
fn v_has_a_head_dim_of_its_own() {
    let Some(e) = engine() else { return };
    // DeepSeek's MLA (192 for q/k, 128 for v), and small odd pairs both ways.
    // Each pair plain in f32 or causal in f16, alternately (both with
    // FLASHATTN_FULL_MATRIX=1).
    for (i, (d, dv)) in [(192, 128), (40, 24), (24, 40), (59, 13)]
        .into_iter()
        .enumerate()
    {
        if matrix(i % 2 == 0, true) {
            let out = run_gpu(e, &Case::new(45, 53, d).dv(dv).heads(4, 2));
            assert_eq!(out.o.shape, vec![1, 45, 4, dv]);
        }
        if matrix(i % 2 == 1, true) {
            run_gpu(e, &Case::new(53, 45, d).dv(dv).opts(causal()).f16());
        }
    }
    let window = AttentionOptions::default().window(Some(7), Some(3));
    run_gpu(e, &Case::new(40, 40, 32).dv(512).opts(window.softcap(5.0)));
}

#[test]
fn head_dims_f16_and_bf16() {
    let Some(e) = engine() else { return };
    // Each storage path on a vec4 tail and on whole vec4s up to 256 (every
    // head dim in every one with FLASHATTN_FULL_MATRIX=1).
    let spread = [vec![1, 128], vec![59, 256], vec![111, 64]];
    for (i, (p, o)) in low_precisions().into_iter().enumerate() {
        let dims = matrix(spread[i].clone(), vec![1, 16, 32, 59, 64, 111, 128, 256]);
        for d in dims {
            run_gpu(e, &Case::new(97, 113, d).precision(p).overrides(o));
        }
    }
}

#[test]
fn bf16_odd_seqlens_and_batches() {
    let Some(e) = engine() else { return };
    for s in [1, 3, 113] {
        run_gpu_values(e, &Case::new(s, s, 64).bf16());
    }
    for (sq, sk) in [(1, 255), (255, 1), (3, 113)] {
        run_gpu_values(e, &Case::new(sq, sk, 40).bf16().opts(causal()));
    }
    run_gpu_values(e, &Case::new(37, 53, 64).batch(3).heads(5, 5).bf16());
}

#[test]
fn f16_paths_are_what_was_asked() {
    let Some(e) = engine() else { return };
    for o in f16_variants() {
        let out = run_gpu(e, &Case::new(33, 47, 64).f16().overrides(o));
        let storage = out.stats.plan.unwrap().storage;
        let want = if o.f16_native == Some(true) {
            StorageKind::F16Native
        } else {
            StorageKind::F16Packed
        };
        assert_eq!(storage, want);
    }
    let out = run_gpu(e, &Case::new(33, 47, 64).bf16());
    assert_eq!(out.stats.plan.unwrap().storage, StorageKind::Bf16);
}

#[test]
fn gqa_and_mqa() {
    let Some(e) = engine() else { return };
    // Each group size in one precision, in turn (every one in each with
    // FLASHATTN_FULL_MATRIX=1): the group is index arithmetic, the same code.
    for (i, (hq, hk)) in [(4, 2), (6, 3), (8, 1), (3, 1)].into_iter().enumerate() {
        let runs = |j: usize| matrix(i % 3 == j, true);
        if runs(0) {
            run_gpu_values(e, &Case::new(97, 113, 64).heads(hq, hk).batch(2));
        }
        if runs(1) {
            run_gpu_values(e, &Case::new(61, 61, 32).heads(hq, hk).opts(causal()).f16());
        }
        if runs(2) {
            run_gpu_values(
                e,
                &Case::new(61, 61, 32).heads(hq, hk).opts(causal()).bf16(),
            );
        }
    }
}

#[test]
fn causal_masks() {
    let Some(e) = engine() else { return };
    // Every shape in f32; the other storages on two shapes each, in turn
    // (on every shape with FLASHATTN_FULL_MATRIX=1).
    let lowp = low_precisions();
    for (i, (sq, sk)) in [(1, 1), (3, 3), (97, 97), (113, 255), (255, 113), (1, 300)]
        .into_iter()
        .enumerate()
    {
        run_gpu_values(e, &Case::new(sq, sk, 64).opts(causal()));
        for (j, &(p, o)) in lowp.iter().enumerate() {
            if matrix(i % lowp.len() == j, true) {
                let case = Case::new(sq, sk, 59).opts(causal()).precision(p);
                run_gpu(e, &case.overrides(o));
            }
        }
    }
}

#[test]
fn local_windows() {
    let Some(e) = engine() else { return };
    let windows = [
        (0, 0),
        (5, 0),
        (0, 7),
        (16, 16),
        (40, -1),
        (-1, 3),
        (-1, -1),
    ];
    // Windows are values of one masked code path: each window in one of
    // the four cases, in turn (all four with FLASHATTN_FULL_MATRIX=1).
    for (i, (l, r)) in windows.into_iter().enumerate() {
        let w = Window::from_signed(l, r);
        let opts = {
            let mut o = AttentionOptions::default();
            o.window = w;
            o
        };
        let runs = |j: usize| matrix(i % 4 == j, true);
        if runs(0) {
            run_gpu_values(e, &Case::new(113, 97, 64).opts(opts.clone()));
        }
        if runs(1) {
            run_gpu_values(e, &Case::new(97, 113, 32).opts(opts.clone().causal(true)));
        }
        if runs(2) {
            run_gpu_values(e, &Case::new(97, 113, 32).opts(opts.clone()).f16());
        }
        if runs(3) {
            run_gpu_values(e, &Case::new(97, 113, 32).opts(opts).bf16());
        }
    }
}

#[test]
fn softcap() {
    let Some(e) = engine() else { return };
    for cap in [5.0, 30.0] {
        let opts = AttentionOptions::default().softcap(cap);
        run_gpu(e, &Case::new(97, 113, 64).opts(opts.clone()).std(3.0));
        // The cap is a value: the other storages with one of them.
        if !matrix(cap == 5.0, true) {
            continue;
        }
        for p in [Precision::F16, Precision::Bf16] {
            let case = Case::new(97, 113, 64)
                .opts(opts.clone().causal(true))
                .std(3.0);
            run_gpu(e, &case.precision(p));
        }
    }
}

#[test]
fn custom_scale() {
    let Some(e) = engine() else { return };
    run_gpu_values(
        e,
        &Case::new(64, 80, 64).opts(AttentionOptions::default().scale(0.5)),
    );
    run_gpu_values(
        e,
        &Case::new(64, 80, 64).opts(AttentionOptions::default().scale(-0.25)),
    );
}

#[test]
fn empty_rows_give_zero_and_neg_inf() {
    let Some(e) = engine() else { return };
    // Causal with seqlen_q > seqlen_k: the first seqlen_q - seqlen_k rows see no key.
    for case in [
        Case::new(40, 10, 64).opts(causal()),
        Case::new(40, 10, 64).opts(causal()).f16(),
        Case::new(40, 10, 64).opts(causal()).bf16(),
        // A (0, 0) window with seqlen_q > seqlen_k: row i sees only key i - 20.
        Case::new(30, 10, 32).opts(AttentionOptions::default().window(Some(0), Some(0))),
    ] {
        let out = run_gpu(e, &case);
        let o = out.o.to_f32();
        let d = case.head_dim;
        let mut empty = 0;
        for h in 0..case.heads_q {
            for i in 0..case.seqlen_q {
                let lse = out.lse[h * case.seqlen_q + i];
                if lse == f32::NEG_INFINITY {
                    empty += 1;
                    let row = &o[(i * case.heads_q + h) * d..][..d];
                    assert!(row.iter().all(|&x| x == 0.0), "row {i} head {h} not zero");
                }
                assert!(!lse.is_nan());
            }
        }
        assert!(empty > 0, "{case:?} has no empty rows");
    }
}

#[test]
fn large_magnitude_scores_are_stable() {
    let Some(e) = engine() else { return };
    // q, k entries ~ N(0, 8²) at d = 32: scores have std ~ 8·8·sqrt(32)/sqrt(32) ≈ 64.
    run_gpu(e, &Case::new(97, 113, 32).std(8.0));
    run_gpu(e, &Case::new(97, 113, 32).std(8.0).opts(causal()));
    run_gpu(e, &Case::new(97, 113, 32).std(8.0).f16());
    run_gpu(e, &Case::new(97, 113, 32).std(8.0).bf16());
    run_gpu(e, &Case::new(97, 113, 32).std(8.0).opts(causal()).bf16());
}

#[test]
fn batches_and_heads() {
    let Some(e) = engine() else { return };
    run_gpu_values(e, &Case::new(37, 53, 64).batch(3).heads(5, 5));
    run_gpu_values(
        e,
        &Case::new(37, 53, 64)
            .batch(3)
            .heads(4, 2)
            .opts(causal())
            .f16(),
    );
}

#[test]
fn tile_overrides_give_the_same_answer() {
    let Some(e) = engine() else { return };
    let tiles = matrix(
        vec![(1, 1, 1), (8, 4, 4), (7, 13, 3)],
        vec![(1, 1, 1), (4, 8, 2), (8, 4, 4), (16, 16, 16), (7, 13, 3)],
    );
    for (br, bc, tc) in tiles {
        let o = PlanOverrides::default().br(br).bc(bc).threads_per_row(tc);
        run_gpu(e, &Case::new(53, 71, 24).overrides(o).opts(causal()));
    }
}

#[test]
fn browser_like_workgroup_storage() {
    let Some(e) = engine() else { return };
    let o = PlanOverrides::default().max_workgroup_storage(16384);
    for d in [64, 256] {
        let out = run_gpu(e, &Case::new(97, 113, d).overrides(o));
        assert!(out.stats.plan.unwrap().workgroup_bytes <= 16384);
    }
}

#[test]
fn problems_larger_than_a_binding_are_split() {
    let Some(e) = engine() else { return };
    let small = flashattn::Engine::new().unwrap();
    // Heads split: one kv head fits, two do not.
    let case = Case::new(64, 64, 16).heads(4, 2).batch(2);
    let small_heads = small.with_binding_limit(64 * 2 * 16 * 4);
    let out = run_gpu(&small_heads, &case);
    assert!(out.stats.dispatches > 1);
    // Rows and keys split (LSE merge), with a causal mask across the cuts.
    let tiny = flashattn::Engine::new()
        .unwrap()
        .with_binding_limit(16 * 16 * 4);
    let out = run_gpu(&tiny, &Case::new(50, 70, 16).heads(2, 1).opts(causal()));
    assert!(out.stats.dispatches > 4);
    run_gpu(&tiny, &Case::new(50, 70, 16).heads(2, 1).f16());
    run_gpu(
        &tiny,
        &Case::new(50, 70, 16).heads(2, 1).bf16().opts(causal()),
    );
    let _ = e;
}

#[test]
fn flash_allocates_no_quadratic_buffer_at_4096() {
    let Some(e) = engine() else { return };
    // batch 1, heads 8, seqlen 4096, d 64 (acceptance): every buffer is O(N·d).
    let case = Case::new(4096, 4096, 64).heads(8, 8);
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let out = e.forward(&ForwardInputs::new(q, k, v), &case.opts).unwrap();
    let n = 4096u64;
    let quadratic = n * n * 4;
    let largest = out.stats.largest_allocation().unwrap();
    assert!(largest.bytes < quadratic / 4, "{largest:?}");
    assert_eq!(largest.bytes, n * 8 * 64 * 4);
    // The f64 reference is too slow at this size; the CPU backend (f32, all
    // cores, its own tiling) is checked against it elsewhere, so agreeing with
    // it to f32 rounding is the check here.
    let cpu = flashattn::cpu::forward(&ForwardInputs::new(q, k, v), &case.opts).unwrap();
    let max_diff = |a: &[f32], b: &[f32]| {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max)
    };
    let (od, ld) = (
        max_diff(&out.o.to_f32(), &cpu.o.to_f32()),
        max_diff(&out.lse, &cpu.lse),
    );
    assert!(od < 1e-4 && ld < 1e-4, "GPU vs CPU: o {od}, lse {ld}");
}

#[test]
fn long_sequences_meet_the_rule() {
    let Some(e) = engine() else { return };
    // Many query and key blocks: a kernel that misbehaves only at scale shows up here.
    run_gpu(e, &Case::new(1024, 1024, 64).heads(1, 1));
    if flashattn_testkit::full_matrix() {
        run_gpu(e, &Case::new(1024, 1536, 128).heads(1, 1).opts(causal()));
    }
    run_gpu(e, &Case::new(1100, 1100, 192).heads(1, 1).opts(causal()));
}

#[test]
fn calls_past_the_loop_limit_are_split_before_they_run() {
    if engine().is_none() {
        return;
    }
    // A fresh engine, so nothing has been learned yet. d 256 over 2048 keys
    // takes more loop iterations than llvmpipe allows one invocation in one
    // dispatch: the plan predicts it and the call runs in pieces over keys,
    // merged by LSE, with no rerun. Adapters without a limit run it whole.
    let e = flashattn::Engine::new().unwrap();
    // The lanes kernel loops once per 8 keys; the tiled one many times per tile.
    let case = Case::new(64, 2048, 256).heads(1, 1).overrides(tiled());
    let out = run_gpu(&e, &case);
    assert_eq!(out.stats.reruns, 0, "{:?}", out.stats);
    if e.loop_limit().is_some() {
        assert!(out.stats.pieces >= 2, "{:?}", out.stats);
    } else {
        assert_eq!(out.stats.pieces, 1);
    }
}

#[test]
fn kernels_cut_short_by_the_loop_limit_rerun_in_pieces() {
    if engine().is_none() {
        return;
    }
    // Without the prediction only the guard protects: the kernel runs past
    // the limit, its guard reports it, the call reruns with the keys halved,
    // and the shorter length is remembered.
    let e = flashattn::Engine::new().unwrap().without_loop_prediction();
    let case = Case::new(64, 2048, 256).heads(1, 1).overrides(tiled());
    let out = run_gpu(&e, &case);
    if e.loop_limit().is_some() {
        assert!(out.stats.reruns >= 1, "{:?}", out.stats);
        assert!(out.stats.pieces >= 2);
        // The learned piece length is reused: no rerun the second time.
        assert_eq!(run_gpu(&e, &case).stats.reruns, 0);
    } else {
        assert_eq!(out.stats.reruns, 0);
    }
}

#[test]
fn naive_baseline_matches_and_materializes_scores() {
    let Some(e) = engine() else { return };
    // The tiled matmuls (GPUs) as well as the lanes ones (CPU adapters).
    let tiled = flashattn::Engine::new().unwrap().with_tiled_kernels_only();
    let cases = [
        Case::new(97, 113, 64),
        Case::new(97, 113, 64).opts(causal()).f16(),
        Case::new(40, 10, 32).opts(causal()).heads(4, 2),
        Case::new(64, 64, 32).opts(AttentionOptions::default().softcap(10.0)),
        // Multiples of the matmul tiles: the variants without bounds checks.
        Case::new(128, 192, 64).heads(4, 2),
        Case::new(128, 128, 64).opts(causal()).f16(),
        Case::new(97, 113, 59).opts(causal()).bf16(),
        Case::new(128, 128, 64).heads(4, 2).bf16(),
    ];
    // Each engine with aligned and unaligned shapes, masks and softcap in
    // each precision; every case on both with FLASHATTN_FULL_MATRIX=1.
    let default_engine = matrix(vec![0, 3, 5, 6], (0..8).collect());
    let tiled_engine = matrix(vec![1, 2, 4, 7], (0..8).collect());
    let runs = default_engine
        .into_iter()
        .map(|i| (e, i))
        .chain(tiled_engine.into_iter().map(|i| (&tiled, i)));
    for (e, case) in runs.map(|(e, i)| (e, cases[i].clone())) {
        let inputs = case.inputs();
        let [q, k, v] = inputs.views();
        let out = e
            .naive_forward(&ForwardInputs::new(q, k, v), &case.opts)
            .unwrap();
        assert_accurate(&case, &inputs, &out);
        let s = case.heads_q * case.seqlen_q * case.seqlen_k * 4;
        assert!(out.stats.allocations.iter().any(|a| a.bytes == s as u64));
    }
}

#[test]
fn matmul_ceiling_runs_and_reports_its_flops() {
    let Some(e) = engine() else { return };
    for shape in [CeilingShape::Scores, CeilingShape::Values] {
        let r = e.matmul_ceiling(shape, 128, 64, 2).unwrap();
        assert_eq!(r.shape, shape);
        assert_eq!(r.seconds.len(), 2);
        assert_eq!(r.flops, 2.0 * 128.0 * 128.0 * 64.0);
        assert!(r.gflops() > 0.0 && r.gflops().is_finite());
    }
}

/// q, k, v of `inputs` (f32), a zeroed o, and an lse buffer of `lse` on
/// the engine's device.
fn attention_buffers(
    e: &flashattn::Engine,
    inputs: &common::Inputs,
    lse: &[f32],
) -> [wgpu::Buffer; 5] {
    let make = |data: &[f32]| device_buffer(e, data);
    [
        make(&inputs.q),
        make(&inputs.k),
        make(&inputs.v),
        make(&vec![0.0; inputs.q.len()]),
        make(lse),
    ]
}

fn views(b: &[wgpu::Buffer; 5]) -> flashattn::AttentionBuffers<'_> {
    let [q, k, v, o, lse] = b;
    flashattn::AttentionBuffers { q, k, v, o, lse }
}

/// A storage buffer on the engine's device holding `data` (and copyable out).
fn device_buffer(e: &flashattn::Engine, data: &[f32]) -> wgpu::Buffer {
    use wgpu::util::DeviceExt;
    e.device()
        .create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: None,
            contents: bytemuck::cast_slice(data),
            usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
        })
}

#[test]
fn buffer_api_keeps_data_on_gpu() {
    let Some(e) = engine() else { return };
    let case = Case::new(45, 67, 32).heads(4, 2);
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let expected = e.forward(&ForwardInputs::new(q, k, v), &case.opts).unwrap();
    // Guard region after lse: it must stay untouched.
    let lse_len = expected.lse.len();
    let buffers = attention_buffers(e, &inputs, &vec![1234.5; lse_len + 64]);
    let bufs = views(&buffers);
    let (ob, lb) = (&buffers[3], &buffers[4]);
    let make = |data: &[f32]| device_buffer(e, data);
    let shape = expected.shape;
    e.forward_buffers(
        &bufs,
        &shape,
        Precision::F32,
        &case.opts,
        &PlanOverrides::default(),
    )
    .unwrap();
    let read = |b: &wgpu::Buffer| -> Vec<f32> { bytemuck::pod_collect_to_vec(&read_bytes(e, b)) };
    assert_eq!(read(ob), expected.o.to_f32());
    let lse = read(lb);
    assert_eq!(&lse[..lse_len], &expected.lse[..]);
    assert!(
        lse[lse_len..].iter().all(|&x| x == 1234.5),
        "lse guard overwritten"
    );
    // Too-small buffers are rejected by name.
    let short = make(&[0.0; 4]);
    let bad = flashattn::AttentionBuffers { o: &short, ..bufs };
    let err = e
        .forward_buffers(
            &bad,
            &shape,
            Precision::F32,
            &case.opts,
            &PlanOverrides::default(),
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::BufferTooSmall {
                buffer: "o",
                size: 16,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn bad_inputs_are_errors_not_panics() {
    let Some(e) = engine() else { return };
    let x = [0.0f32; 2 * 3 * 4];
    let q = TensorView::f32([1, 2, 3, 4], &x[..24]);
    let k = TensorView::f32([1, 2, 2, 4], &x[..16]);
    let err = e
        .forward(&ForwardInputs::new(q, k, k), &AttentionOptions::default())
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::HeadsNotDivisible {
                heads_q: 3,
                heads_kv: 2
            }
        ),
        "{err:?}"
    );
    let short = TensorView::f32([1, 2, 3, 4], &x[..10]);
    let err = e
        .forward(
            &ForwardInputs::new(short, short, short),
            &AttentionOptions::default(),
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::DataLength {
                tensor: "q",
                expected: 24,
                actual: 10,
                ..
            }
        ),
        "{err:?}"
    );
    let nan = AttentionOptions::default().scale(f32::NAN);
    let err = e.forward(&ForwardInputs::new(q, q, q), &nan).unwrap_err();
    assert!(
        matches!(err, Error::NonFiniteScale { scale } if scale.is_nan()),
        "{err:?}"
    );
    let wide = vec![0.0f32; 600];
    let big = TensorView::f32([1, 1, 1, 600], &wide);
    let err = e
        .forward(
            &ForwardInputs::new(big, big, big),
            &AttentionOptions::default(),
        )
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::HeadDimTooLarge {
                head_dim: 600,
                max: 576,
                ..
            }
        ),
        "{err:?}"
    );
}

#[test]
fn cpu_backend_meets_the_rule_too() {
    for case in [
        Case::new(97, 113, 64),
        Case::new(113, 97, 59).opts(causal()).f16(),
        Case::new(113, 97, 59).opts(causal()).bf16(),
        Case::new(97, 113, 256).heads(4, 2).bf16(),
        Case::new(97, 113, 32).std(8.0).bf16(),
        Case::new(64, 64, 16)
            .opts(AttentionOptions::default().softcap(5.0))
            .bf16(),
        Case::new(40, 10, 32).opts(causal()).heads(4, 1),
        Case::new(97, 113, 32).std(8.0),
        Case::new(64, 64, 16).opts(AttentionOptions::default().softcap(5.0)),
        Case::new(97, 113, 32).opts(AttentionOptions::default().window(Some(8), Some(3))),
    ] {
        let inputs = case.inputs();
        let [q, k, v] = inputs.views();
        let out = flashattn::cpu::forward(&ForwardInputs::new(q, k, v), &case.opts).unwrap();
        assert_accurate(&case, &inputs, &out);
    }
}

#[test]
fn buffer_api_reports_the_loop_limit_instead_of_a_wrong_answer() {
    let Some(e) = engine() else { return };
    // The device-buffer API cannot split, so past llvmpipe's loop limit it errs.
    let case = Case::new(64, 2048, 256).heads(1, 1);
    let inputs = case.inputs();
    let buffers = attention_buffers(e, &inputs, &[0.0; 64]);
    let bufs = views(&buffers);
    let shape = flashattn::AttentionShape {
        batch: 1,
        seqlen_q: 64,
        seqlen_k: 2048,
        heads_q: 1,
        heads_kv: 1,
        head_dim: 256,
        head_dim_v: 256,
    };
    let Some(limit) = e.loop_limit() else {
        // Without a limit the same call runs whole and gives forward()'s answer.
        e.forward_buffers(&bufs, &shape, Precision::F32, &case.opts, &tiled())
            .unwrap();
        let [q, k, v] = inputs.views();
        let expected = e
            .forward_with(&ForwardInputs::new(q, k, v), &case.opts, &tiled())
            .unwrap();
        assert_accurate(&case, &inputs, &expected);
        let o: Vec<f32> = bytemuck::pod_collect_to_vec(&read_bytes(e, &buffers[3]));
        assert_eq!(o, expected.o.to_f32());
        return;
    };
    // Predicted before running...
    let err = e
        .forward_buffers(&bufs, &shape, Precision::F32, &case.opts, &tiled())
        .unwrap_err();
    assert!(
        matches!(err, Error::LoopBudget { keys: 2048, limit: l, .. } if l == limit),
        "{err:?}"
    );
    // ...and caught by the guard when the prediction is off.
    let blind = flashattn::Engine::new().unwrap().without_loop_prediction();
    let buffers = attention_buffers(&blind, &inputs, &[0.0; 64]);
    let bufs = views(&buffers);
    let err = blind
        .forward_buffers(&bufs, &shape, Precision::F32, &case.opts, &tiled())
        .unwrap_err();
    assert!(matches!(err, Error::LoopBudget { .. }), "{err:?}");
}

/// The device-buffer forward with packed storage (f16 and bf16, two per
/// u32) writes exactly o's elements: the caller's buffer needs no COPY_DST
/// (it was once cleared whole with `clear_buffer`, which needs it and wiped
/// what followed o), and whatever it held before does not leak into the result.
#[test]
fn packed_buffer_forward_writes_only_o() {
    let Some(e) = engine() else { return };
    let packed_f16 = PlanOverrides::default().f16_native(false);
    for (precision, overrides) in [
        (Precision::F16, packed_f16),
        (Precision::Bf16, PlanOverrides::default()),
    ] {
        packed_forward_writes_only_o(e, precision, &overrides);
    }
}

fn packed_forward_writes_only_o(e: &flashattn::Engine, precision: Precision, o: &PlanOverrides) {
    use wgpu::util::DeviceExt;
    // An odd head dim: pairs straddle rows that different workgroups own.
    let case = Case::new(33, 45, 59).heads(2, 1).precision(precision);
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let expected = e
        .forward_with(&ForwardInputs::new(q, k, v), &case.opts, o)
        .unwrap();
    let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC;
    let buffer = |bytes: &[u8]| {
        let mut padded = bytes.to_vec();
        padded.resize(bytes.len().next_multiple_of(4), 0);
        e.device()
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: None,
                contents: &padded,
                usage,
            })
    };
    let (qb, kb, vb) = (
        buffer(q.data.as_bytes()),
        buffer(k.data.as_bytes()),
        buffer(v.data.as_bytes()),
    );
    let n = inputs.q.len() * 2;
    let o_bytes = n.next_multiple_of(4);
    // o starts full of garbage and is followed by a guard region.
    let ob = buffer(&vec![0xAB; o_bytes + 256]);
    let lb = buffer(&vec![0u8; expected.lse.len() * 4]);
    let bufs = flashattn::AttentionBuffers {
        q: &qb,
        k: &kb,
        v: &vb,
        o: &ob,
        lse: &lb,
    };
    e.forward_buffers(&bufs, &expected.shape, precision, &case.opts, o)
        .unwrap();
    let got = read_bytes(e, &ob);
    assert_eq!(
        &got[..n],
        expected.o.data.as_host().as_bytes(),
        "{precision}: o differs"
    );
    assert!(
        got[o_bytes..].iter().all(|&x| x == 0xAB),
        "{precision}: the guard after o was overwritten"
    );
}

/// A device buffer's bytes, read back.
fn read_bytes(e: &flashattn::Engine, b: &wgpu::Buffer) -> Vec<u8> {
    let dev = e.device();
    let staging = dev.create_buffer(&wgpu::BufferDescriptor {
        label: None,
        size: b.size(),
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut enc = dev.create_command_encoder(&Default::default());
    enc.copy_buffer_to_buffer(b, 0, &staging, 0, b.size());
    e.queue().submit([enc.finish()]);
    staging.slice(..).map_async(wgpu::MapMode::Read, |_| {});
    dev.poll(wgpu::PollType::wait_indefinitely()).unwrap();
    let bytes = staging.slice(..).get_mapped_range().unwrap().to_vec();
    bytes
}

/// The coop kernel (cooperative matrices) against the f64 reference, in
/// every precision it takes on this device: odd sequences and head dims
/// (padded to the matrices), head dim 256, masks, empty rows, softcap, GQA,
/// v's own head dim, and every layout and score term at once. Where the
/// device has no cooperative matrices (lavapipe, most browsers) it checks
/// that forcing the kernel is the typed error and lists that it did so
/// instead; FLASHATTN_REQUIRE_COOP=1 makes the absence a failure.
#[test]
fn coop_kernel_meets_the_rule_where_the_device_has_cooperative_matrices() {
    use flashattn::plan::coop::check_coop;
    let Some(e) = engine() else { return };
    let caps = e.caps();
    let coop = PlanOverrides::default().kernel(KernelFamily::Coop);
    let takes = |p: Precision| check_coop(&flashattn::plan::PlanRequest::new(64, p), &caps);
    let precisions: Vec<Precision> = [Precision::F16, Precision::Bf16, Precision::F32]
        .into_iter()
        .filter(|&p| takes(p).is_ok())
        .collect();
    if precisions.is_empty() {
        let case = Case::new(5, 7, 16).f16();
        let inputs = case.inputs();
        let [q, k, v] = inputs.views();
        let err = e
            .forward_with(&ForwardInputs::new(q, k, v), &case.opts, &coop)
            .unwrap_err();
        assert!(matches!(err, Error::CoopMatrixUnavailable { .. }), "{err}");
        flashattn_testkit::instead(
            Need::CoopMatrix,
            &err.to_string(),
            "forcing the coop kernel is the typed error; its code runs emulated \
             (coop_kernel_emulated_meets_the_rule)",
        );
        return;
    }
    for &p in &precisions {
        let cases = [
            Case::new(97, 113, 64),
            Case::new(1, 1, 16),
            Case::new(113, 97, 59).opts(causal()),
            Case::new(255, 300, 128).opts(causal()),
            Case::new(200, 200, 111).opts(AttentionOptions::default().window(Some(40), Some(7))),
            Case::new(64, 130, 256).heads(4, 1),
            Case::new(45, 61, 40).dv(24).heads(4, 2).batch(2),
            Case::new(80, 80, 96).opts(AttentionOptions::default().softcap(5.0)),
            common::everything_at_once(),
        ];
        for case in cases {
            let case = case.precision(p).overrides(coop);
            let out = run_gpu(e, &case);
            let plan = out.stats.plan.expect("a plan");
            assert_eq!(plan.kernel, KernelFamily::Coop, "{case:?}");
        }
        eprintln!(
            "coop forward ({p:?}, {:?}): 9 cases met the rule",
            takes(p).ok()
        );
    }
    // Where it runs f16, it is the default there.
    if precisions.contains(&Precision::F16) {
        let out = run_gpu(e, &Case::new(97, 113, 64).f16());
        assert_eq!(out.stats.plan.unwrap().kernel, KernelFamily::Coop);
    }
}

/// The coop kernel with its cooperative operations emulated in plain WGSL
/// (`Engine::with_emulated_coop`), on any adapter with subgroups (lavapipe
/// included): its tile walk, matrix layouts, softmax between the products
/// and every term, against the f64 reference, where no cooperative matrices
/// exist to run the real ones.
#[test]
fn coop_kernel_emulated_meets_the_rule() {
    // The emulation's matrices are spread over a subgroup (subgroup_id).
    if flashattn_testkit::engine_with(Need::Subgroups).is_none() {
        return;
    }
    let e = flashattn::Engine::new().unwrap().with_emulated_coop();
    let coop = PlanOverrides::default().kernel(KernelFamily::Coop);
    let cases = [
        Case::new(97, 113, 64),
        Case::new(1, 1, 3),
        Case::new(113, 97, 59).opts(causal()),
        Case::new(70, 90, 128).opts(AttentionOptions::default().window(Some(20), Some(5))),
        Case::new(45, 61, 40).dv(24).heads(4, 2).batch(2),
        Case::new(50, 50, 32).opts(AttentionOptions::default().softcap(5.0)),
        common::everything_at_once(),
    ];
    // Each case in one precision, in turn (all three with FLASHATTN_FULL_MATRIX=1).
    let precisions = [Precision::F32, Precision::F16, Precision::Bf16];
    for (i, case) in cases.into_iter().enumerate() {
        let each = vec![precisions[i % 3]];
        for p in matrix(each, precisions.to_vec()) {
            let case = case.clone().precision(p).overrides(coop);
            let out = run_gpu(&e, &case);
            let plan = out.stats.plan.expect("a plan");
            assert_eq!(
                plan.coop,
                Some(flashattn::plan::CoopForm::Emulated),
                "{case:?}"
            );
        }
    }
    // Emulated, f16 defaults to the coop kernel as on a device with
    // matrices, except where the lanes kernels (CPU adapters) come first.
    let out = run_gpu(&e, &Case::new(40, 40, 64).f16());
    let expected = match e.caps().lane_subgroup {
        Some(_) => KernelFamily::Lanes,
        None => KernelFamily::Coop,
    };
    assert_eq!(out.stats.plan.unwrap().kernel, expected);
    eprintln!("emulated coop forward: its cases met the rule");
}

/// The registers kernels forced with each of their settings: rows per
/// invocation, subgroup or workgroup-memory reductions (subgroups where the
/// adapter has SUBGROUP: lavapipe's 8 lanes), one or two K/V buffers.
fn register_settings(e: &flashattn::Engine) -> Vec<PlanOverrides> {
    let subgroups = e.caps().subgroup.is_some();
    [
        (4, false, false),
        (4, subgroups, true),
        (2, subgroups, false),
        (1, false, true),
    ]
    .into_iter()
    .map(|(rm, subgroup, double)| {
        PlanOverrides::default()
            .kernel(KernelFamily::Registers)
            .rows_per_thread(rm)
            .subgroup_reduce(subgroup)
            .double_buffer(double)
    })
    .collect()
}

#[test]
fn registers_kernels_in_every_setting() {
    let Some(e) = engine() else { return };
    let window = AttentionOptions::default().window(Some(9), Some(2));
    let cases = [
        Case::new(113, 97, 64),
        Case::new(1, 1, 1),
        Case::new(97, 113, 59).opts(causal()).heads(4, 2),
        Case::new(40, 70, 3)
            .dv(13)
            .opts(window.clone().softcap(5.0)),
    ];
    for (i, o) in register_settings(e).into_iter().enumerate() {
        // Two of the four cases per setting, each case twice (all four with
        // FLASHATTN_FULL_MATRIX=1).
        let picked = matrix(
            [[0, 2], [1, 3], [2, 3], [0, 1]][i].to_vec(),
            vec![0, 1, 2, 3],
        );
        for case in picked.into_iter().map(|j| cases[j].clone()) {
            let out = run_gpu(e, &case.overrides(o));
            let plan = out.stats.plan.unwrap();
            assert_eq!(plan.kernel, KernelFamily::Registers);
            assert_eq!(
                (
                    plan.rows_per_thread,
                    plan.subgroup_reduce,
                    plan.double_buffer
                ),
                (
                    o.rows_per_thread.unwrap(),
                    o.subgroup_reduce.unwrap(),
                    o.double_buffer.unwrap()
                )
            );
        }
    }
}

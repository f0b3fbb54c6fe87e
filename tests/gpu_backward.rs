//! GPU backward (dq, dk, dv) against the f64 reference under docs/semantics.md's rule
//! (R = 3), determinism, allocation accounting, finite differences.

mod common;

use common::{
    engine, matrix, other_families, output_grad, run_gpu_backward, run_gpu_backward_both, Case,
};

use flashattn::{
    AttentionOptions, BackwardInputs, Error, ForwardInputs, KernelFamily, PlanOverrides,
    TensorView, Window,
};

/// [`run_gpu_backward`], then the registers kernels (the GPUs' default) on
/// the same case, unless it forces a kernel or fixes tiles.
fn run_with_registers(e: &flashattn::Engine, case: &Case) -> flashattn::BackwardOutput {
    let out = run_gpu_backward(e, case);
    let registers = other_families(case, out.stats.plan.map(|p| p.kernel))
        .into_iter()
        .filter(|o| o.kernel == Some(KernelFamily::Registers));
    for o in registers {
        run_gpu_backward(e, &case.clone().overrides(o));
    }
    out
}

/// [`run_gpu_backward`] alone by default, for cases that are values of code
/// paths the other tests run on both families (sizes, group sizes,
/// windows); [`run_with_registers`] with FLASHATTN_FULL_MATRIX=1.
fn run_values(e: &flashattn::Engine, case: &Case) -> flashattn::BackwardOutput {
    if flashattn_testkit::full_matrix() {
        run_with_registers(e, case)
    } else {
        run_gpu_backward(e, case)
    }
}

fn causal() -> AttentionOptions {
    AttentionOptions::default().causal(true)
}

fn packed() -> PlanOverrides {
    PlanOverrides::default().f16_native(false)
}

#[test]
fn odd_sizes_f32() {
    let Some(e) = engine() else { return };
    for s in [1, 3, 97, 113] {
        run_values(e, &Case::new(s, s, 64));
    }
    run_values(e, &Case::new(255, 255, 32).heads(1, 1));
}

#[test]
fn seqlen_q_differs_from_seqlen_k() {
    let Some(e) = engine() else { return };
    for (sq, sk) in [(1, 97), (97, 1), (113, 37), (37, 113)] {
        run_values(e, &Case::new(sq, sk, 64));
        run_values(e, &Case::new(sq, sk, 40).opts(causal()));
    }
}

#[test]
fn head_dims() {
    let Some(e) = engine() else { return };
    // A one-element row, a vec4 tail and the widest the lanes kernels
    // take; the rest with FLASHATTN_FULL_MATRIX=1.
    for d in matrix(vec![1, 59, 256], vec![1, 16, 59, 111, 128, 256]) {
        run_with_registers(e, &Case::new(67, 53, d));
    }
}

#[test]
fn head_dims_past_256() {
    let Some(e) = engine() else { return };
    for d in matrix(vec![512], vec![288, 384, 512]) {
        run_with_registers(e, &Case::new(23, 31, d).heads(2, 1));
    }
    run_with_registers(e, &Case::new(31, 23, 512).opts(causal()).f16());
    let browser = PlanOverrides::default().max_workgroup_storage(16384);
    run_with_registers(e, &Case::new(17, 19, 512).overrides(browser));
    // The widest: MLA's latent width 576 with its first 512 as v.
    run_with_registers(e, &Case::new(11, 13, 576).dv(512).heads(2, 1));
    run_gpu_backward(
        e,
        &Case::new(7, 9, 576)
            .dv(512)
            .opts(causal())
            .overrides(browser),
    );
}

#[test]
fn v_has_a_head_dim_of_its_own() {
    let Some(e) = engine() else { return };
    // Each pair plain in f32 or causal in f16, alternately (both with
    // FLASHATTN_FULL_MATRIX=1).
    for (i, (d, dv)) in [(192, 128), (40, 24), (24, 40), (59, 13)]
        .into_iter()
        .enumerate()
    {
        // Every family on the first pair, the planner's and the registers
        // on the others (every family on each with FLASHATTN_FULL_MATRIX=1).
        let run = |case: &Case| {
            if matrix(i == 0, true) {
                run_gpu_backward_both(e, case)
            } else {
                run_with_registers(e, case)
            }
        };
        if matrix(i % 2 == 0, true) {
            let out = run(&Case::new(37, 45, d).dv(dv).heads(4, 2));
            assert_eq!(out.dv.shape, vec![1, 45, 2, dv]);
            assert_eq!(out.dk.shape, vec![1, 45, 2, d]);
        }
        if matrix(i % 2 == 1, true) {
            run(&Case::new(45, 37, d).dv(dv).opts(causal()).f16());
        }
    }
}

#[test]
fn f16_packed_and_native() {
    let Some(e) = engine() else { return };
    let mut variants = vec![packed()];
    if e.caps().shader_f16 {
        variants.push(PlanOverrides::default().f16_native(true));
    }
    // Each path on a vec4 tail and a whole number of vec4s, one plain and
    // one causal (every dim both ways with FLASHATTN_FULL_MATRIX=1).
    for (i, o) in variants.into_iter().enumerate() {
        let dims = matrix([[59, 128], [32, 59]][i].to_vec(), vec![32, 59, 128]);
        for (j, &d) in dims.iter().enumerate() {
            if matrix(j == 0, true) {
                run_with_registers(e, &Case::new(61, 83, d).f16().overrides(o));
            }
            if matrix(j == 1, true) {
                run_with_registers(e, &Case::new(83, 61, d).f16().overrides(o).opts(causal()));
            }
        }
    }
}

#[test]
fn bf16_sizes_and_head_dims() {
    let Some(e) = engine() else { return };
    // Odd head dims (pairs of bf16 straddle rows) and the widest the lanes
    // kernels take on both families; the sizes, scores and empty rows on the
    // planner's (more of each with FLASHATTN_FULL_MATRIX=1).
    for d in matrix(vec![59, 256], vec![1, 32, 59, 128, 256]) {
        run_with_registers(e, &Case::new(61, 83, d).bf16());
    }
    for (sq, sk) in [(1, 97), (97, 1), (83, 61)] {
        run_values(e, &Case::new(sq, sk, 40).bf16().opts(causal()));
    }
    run_values(e, &Case::new(97, 113, 32).std(6.0).bf16());
    let out = run_values(e, &Case::new(40, 10, 32).opts(causal()).bf16());
    // Rows 0..30 see no key: their dq is exactly zero.
    assert!(out.dq.to_f32()[..30 * 2 * 32].iter().all(|&x| x == 0.0));
}

#[test]
fn gqa_and_mqa_sum_over_groups() {
    let Some(e) = engine() else { return };
    // Each group size in one precision (every one in each with
    // FLASHATTN_FULL_MATRIX=1): the group is index arithmetic, the same code.
    for (i, (hq, hk)) in [(4, 2), (6, 3), (4, 1)].into_iter().enumerate() {
        let runs = |j: usize| matrix(i == j, true);
        if runs(0) {
            run_values(e, &Case::new(45, 70, 32).heads(hq, hk).batch(2));
        }
        if runs(1) {
            run_values(e, &Case::new(70, 45, 32).heads(hq, hk).opts(causal()).f16());
        }
        if runs(2) {
            run_values(
                e,
                &Case::new(70, 45, 32).heads(hq, hk).opts(causal()).bf16(),
            );
        }
    }
}

#[test]
fn causal_window_softcap() {
    let Some(e) = engine() else { return };
    // Windows are values of one masked code path: each window in one of
    // the three cases, in turn (all three with FLASHATTN_FULL_MATRIX=1).
    for (i, (l, r)) in [(5, 0), (0, 7), (16, 16), (-1, 3), (20, -1)]
        .into_iter()
        .enumerate()
    {
        let opts = {
            let mut o = AttentionOptions::default();
            o.window = Window::from_signed(l, r);
            o
        };
        let runs = |j: usize| matrix(i % 3 == j, true);
        if runs(0) {
            run_values(e, &Case::new(90, 77, 32).opts(opts.clone()));
        }
        if runs(1) {
            run_values(e, &Case::new(77, 90, 32).opts(opts.clone().causal(true)));
        }
        if runs(2) {
            run_values(e, &Case::new(77, 90, 32).opts(opts).bf16());
        }
    }
    for (i, cap) in [3.0, 20.0].into_iter().enumerate() {
        let opts = AttentionOptions::default().softcap(cap);
        if matrix(i == 0, true) {
            run_with_registers(e, &Case::new(70, 80, 64).opts(opts.clone()).std(2.0));
            run_with_registers(
                e,
                &Case::new(70, 80, 64)
                    .opts(opts.clone().causal(true))
                    .f16()
                    .std(2.0),
            );
        }
        if matrix(i == 1, true) {
            run_with_registers(
                e,
                &Case::new(70, 80, 64)
                    .opts(opts.causal(true))
                    .bf16()
                    .std(2.0),
            );
        }
    }
}

#[test]
fn empty_rows_and_large_scores() {
    let Some(e) = engine() else { return };
    let out = run_values(e, &Case::new(40, 10, 32).opts(causal()));
    let dq = out.dq.to_f32();
    // Rows 0..30 see no key: their dq is exactly zero.
    assert!(dq[..30 * 2 * 32].iter().all(|&x| x == 0.0));
    run_values(e, &Case::new(97, 113, 32).std(6.0));
}

#[test]
fn tile_overrides_agree() {
    let Some(e) = engine() else { return };
    for (b, tc) in matrix(
        vec![(1, 2), (8, 8), (12, 4)],
        vec![(1, 2), (4, 2), (8, 8), (12, 4)],
    ) {
        let o = PlanOverrides::default().br(b).bc(b).threads_per_row(tc);
        run_gpu_backward(e, &Case::new(37, 41, 24).overrides(o).opts(causal()));
    }
}

#[test]
fn split_problems_sum_partial_gradients() {
    let Some(_) = engine() else { return };
    let tiny = flashattn::Engine::new()
        .unwrap()
        .with_binding_limit(16 * 16 * 4);
    let out = run_gpu_backward(&tiny, &Case::new(50, 70, 16).heads(2, 1).opts(causal()));
    assert!(out.stats.dispatches > 6);
    let heads = flashattn::Engine::new()
        .unwrap()
        .with_binding_limit(64 * 2 * 16 * 4);
    run_gpu_backward(&heads, &Case::new(64, 64, 16).heads(4, 2).batch(2));
    let case = Case::new(50, 70, 16).heads(2, 1).opts(causal()).bf16();
    assert!(run_gpu_backward(&tiny, &case).stats.dispatches > 6);
}

#[test]
fn long_sequences_agree_with_the_cpu_backend() {
    let Some(e) = engine() else { return };
    // Many blocks and workgroups; the f64 reference is too slow here, the CPU
    // backend (checked against it elsewhere) is the yardstick.
    // (2048 keys with FLASHATTN_FULL_MATRIX=1; 1024 is already 128 lanes
    // blocks and 16 tiled ones.)
    let n = matrix(1024, 2048);
    for case in [
        Case::new(n, n, 64).heads(2, 1),
        // Past llvmpipe's loop limit in one dispatch: rerun in pieces there.
        Case::new(700, 1100, 256).heads(1, 1),
    ] {
        let inputs = case.inputs();
        let [q, k, v] = inputs.views();
        let (g, _) = output_grad(&case);
        let d_o = TensorView::f32(inputs.q_shape, &g);
        let fwd = e.forward(&ForwardInputs::new(q, k, v), &case.opts).unwrap();
        let inputs = BackwardInputs::new(ForwardInputs::new(q, k, v), &fwd, d_o).unwrap();
        let gpu = e.backward(&inputs, &case.opts).unwrap();
        let cpu = flashattn::cpu::backward(&inputs, &case.opts).unwrap();
        for (name, a, b) in [
            ("dq", &gpu.dq, &cpu.dq),
            ("dk", &gpu.dk, &cpu.dk),
            ("dv", &gpu.dv, &cpu.dv),
        ] {
            let diff = a
                .to_f32()
                .iter()
                .zip(b.to_f32())
                .map(|(x, y)| (x - y).abs())
                .fold(0f32, f32::max);
            assert!(
                diff < 1e-3,
                "{case:?} {name}: GPU and CPU differ by {diff} ({:?})",
                gpu.stats
            );
        }
    }
}

#[test]
fn two_runs_are_bit_identical() {
    let Some(e) = engine() else { return };
    for case in [
        Case::new(113, 97, 64).heads(4, 2).opts(causal()),
        Case::new(97, 113, 59).heads(4, 1).f16(),
        Case::new(97, 113, 59).heads(4, 1).bf16(),
    ] {
        let a = run_gpu_backward(e, &case);
        let b = run_gpu_backward(e, &case);
        assert_eq!(a.dq, b.dq);
        assert_eq!(a.dk, b.dk);
        assert_eq!(a.dv, b.dv);
    }
}

#[test]
fn flash_backward_has_no_quadratic_buffer_but_naive_does() {
    let Some(e) = engine() else { return };
    let case = Case::new(512, 512, 64).heads(2, 2);
    let out = run_gpu_backward(e, &case);
    let n2 = 512u64 * 512 * 2 * 4;
    // Every buffer is at most the size of q (N·heads·d); S would be N²·heads.
    let largest = out.stats.largest_allocation().unwrap();
    assert!(largest.bytes <= 512 * 2 * 64 * 4, "{largest:?}");
    assert!(largest.bytes * 8 <= n2);
    // Beyond inputs and gradients: only D (one f32 per row) and the LSE.
    let extra: u64 = out
        .stats
        .allocations
        .iter()
        .filter(|a| a.label.starts_with('D') || a.label == "lse")
        .map(|a| a.bytes)
        .sum();
    assert_eq!(extra, 2 * 512 * 2 * 4);

    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let (g, _) = output_grad(&case);
    let d_o = TensorView::f32(inputs.q_shape, &g);
    let naive = e
        .naive_backward(&ForwardInputs::new(q, k, v), &d_o, &case.opts)
        .unwrap();
    assert!(
        naive
            .stats
            .allocations
            .iter()
            .filter(|a| a.bytes == n2)
            .count()
            >= 3
    );
}

#[test]
fn naive_backward_meets_the_rule() {
    let Some(e) = engine() else { return };
    // The tiled matmuls (GPUs) as well as the lanes ones (CPU adapters, which
    // need multiples of 4).
    let tiled = flashattn::Engine::new().unwrap().with_tiled_kernels_only();
    let cases = [
        Case::new(61, 47, 32).heads(4, 2).opts(causal()),
        Case::new(47, 61, 24).f16(),
        Case::new(50, 50, 16).opts(AttentionOptions::default().softcap(4.0)),
        Case::new(64, 96, 32).heads(4, 2).opts(causal()),
        Case::new(64, 64, 16)
            .f16()
            .opts(AttentionOptions::default().softcap(4.0)),
        Case::new(47, 61, 24).bf16().opts(causal()),
    ];
    // Each engine with aligned and unaligned shapes in each precision;
    // every case on both with FLASHATTN_FULL_MATRIX=1.
    let default_engine = matrix(vec![0, 4, 5], (0..6).collect());
    let tiled_engine = matrix(vec![1, 2, 3], (0..6).collect());
    let runs = default_engine
        .into_iter()
        .map(|i| (e, i))
        .chain(tiled_engine.into_iter().map(|i| (&tiled, i)));
    for (e, case) in runs.map(|(e, i)| (e, cases[i].clone())) {
        let inputs = case.inputs();
        let [q, k, v] = inputs.views();
        let (_, g) = output_grad(&case);
        let d_o = inputs.grad(&g);
        let out = e
            .naive_backward(&ForwardInputs::new(q, k, v), &d_o, &case.opts)
            .unwrap();
        for c in flashattn::accuracy::check_backward(&out, &q, &k, &v, &d_o, &case.opts).unwrap() {
            assert!(c.passed(), "{case:?} {c}");
        }
    }
}

/// L = Σ o·dO; its gradient by central differences of the f64 reference
/// forward must match the GPU's analytic gradients.
#[test]
fn finite_differences_on_tiny_cases() {
    let Some(e) = engine() else { return };
    // The mask and softcap together by default (each alone too with
    // FLASHATTN_FULL_MATRIX=1).
    let all = vec![
        AttentionOptions::default(),
        causal(),
        AttentionOptions::default().softcap(2.0),
    ];
    let each = vec![AttentionOptions::default(), causal().softcap(2.0)];
    for opts in matrix(each, all) {
        let case = Case::new(3, 4, 5).heads(2, 1).opts(opts.clone());
        let inputs = case.inputs();
        let [q, k, v] = inputs.views();
        let (g, _) = output_grad(&case);
        let fwd = e.forward(&ForwardInputs::new(q, k, v), &opts).unwrap();
        let d_o = TensorView::f32(inputs.q_shape, &g);
        let bwd = BackwardInputs::new(ForwardInputs::new(q, k, v), &fwd, d_o).unwrap();
        let grads = e.backward(&bwd, &opts).unwrap();
        let loss = |q: &[f64], k: &[f64], v: &[f64]| {
            let r = flashattn::reference::forward_f64(q, k, v, &fwd.shape, &opts);
            r.o.iter().zip(&g).map(|(a, b)| a * *b as f64).sum::<f64>()
        };
        let widen = |x: &[f32]| x.iter().map(|&v| v as f64).collect::<Vec<f64>>();
        let (qf, kf, vf) = (widen(&inputs.q), widen(&inputs.k), widen(&inputs.v));
        let eps = 1e-5;
        for (which, analytic) in [
            (0, grads.dq.to_f32()),
            (1, grads.dk.to_f32()),
            (2, grads.dv.to_f32()),
        ] {
            for i in 0..analytic.len() {
                let mut t = [qf.clone(), kf.clone(), vf.clone()];
                t[which][i] += eps;
                let plus = loss(&t[0], &t[1], &t[2]);
                t[which][i] -= 2.0 * eps;
                let minus = loss(&t[0], &t[1], &t[2]);
                let fd = (plus - minus) / (2.0 * eps);
                assert!(
                    (fd - analytic[i] as f64).abs() < 1e-4 * (1.0 + fd.abs()),
                    "{opts:?} tensor {which} index {i}: finite difference {fd}, analytic {}",
                    analytic[i]
                );
            }
        }
    }
}

#[test]
fn bad_backward_inputs_are_errors() {
    let Some(e) = engine() else { return };
    let x = [0.5f32; 64];
    let q = TensorView::f32([1, 4, 2, 4], &x[..32]);
    let k = TensorView::f32([1, 4, 1, 4], &x[..16]);
    let wrong = TensorView::f32([1, 4, 1, 8], &x[..32]);
    let lse = [0.0f32; 8];
    let opts = AttentionOptions::default();
    let inputs = |lse, d_o| BackwardInputs {
        q,
        k,
        v: k,
        o: q,
        lse,
        d_o,
    };
    let err = e.backward(&inputs(&lse, wrong), &opts).unwrap_err();
    assert!(
        matches!(err, Error::ShapeMismatch { tensor: "do", .. }),
        "{err:?}"
    );
    let err = e.backward(&inputs(&lse[..3], q), &opts).unwrap_err();
    assert!(
        matches!(
            err,
            Error::DataLength {
                tensor: "lse",
                expected: 8,
                actual: 3,
                ..
            }
        ),
        "{err:?}"
    );
    let half_data = vec![half::f16::ZERO; 32];
    let f16_do = TensorView::f16([1, 4, 2, 4], &half_data);
    let err = e.backward(&inputs(&lse, f16_do), &opts).unwrap_err();
    assert!(
        matches!(
            err,
            Error::DtypeMismatch {
                tensor: "do",
                dtype: "f16",
                expected: "f32",
                ..
            }
        ),
        "{err:?}"
    );
}

/// `flash_bwd_pre` (D = rowsum(dO·O)) must follow the parameters' strides
/// like every other kernel, not assume rows packed `head_dim` apart: here
/// rows of o and dO are padded, as in a strided view of a larger tensor.
#[test]
fn dvec_follows_the_row_strides() {
    use flashattn::kernels::{
        binding, BackwardBuffers, BackwardPart, FlashBackward, Params, Piece, Sequences,
    };
    use flashattn::runtime::{Call, Dispatch};
    use wgpu::util::DeviceExt;
    let Some(e) = engine() else { return };
    let (b, s, h, d, pad) = (2usize, 5usize, 3usize, 7usize, 9usize);
    let shape = flashattn::AttentionShape::new(b, s, s, h, h, d).unwrap();
    let row = h * d + pad;
    let mut params = Params::new(&Piece::whole(shape), &AttentionOptions::default()).unwrap();
    params.o_row_stride = row as u32;
    let mut rng = flashattn::random::Rng::new(3);
    let (o, d_o) = (
        rng.normal_vec(b * s * row, 1.0),
        rng.normal_vec(b * s * row, 1.0),
    );
    let gpu = e.runtime();
    let buffer = |data: &[f32]| {
        gpu.device
            .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                label: None,
                contents: bytemuck::cast_slice(data),
                usage: wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC,
            })
    };
    let (ob, dob, dvec, unused) = (
        buffer(&o),
        buffer(&d_o),
        buffer(&vec![0.0; b * h * s]),
        buffer(&[0.0; 4]),
    );
    let bufs = BackwardBuffers {
        q: &unused,
        k: &unused,
        v: &unused,
        o: &ob,
        d_o: &dob,
        lse: &unused,
        dvec: &dvec,
        dq: &unused,
        dk: &unused,
        dv: &unused,
        dsinks: None,
    };
    let plan = e
        .plan_backward(&shape, flashattn::Precision::F32, &PlanOverrides::default())
        .unwrap()
        .plan;
    let kernel = FlashBackward::new(BackwardPart::Dvec, plan, gpu.variant(false, false));
    let got: Vec<f32> = pollster::block_on(async {
        let mut call = Call::new(gpu, None);
        let dispatch = Dispatch {
            kernel: kernel.into(),
            uniforms: vec![(binding::PARAMS, bytemuck::bytes_of(&params).to_vec())],
            buffers: kernel.entries(&bufs.bindings()),
            grid: kernel.grid(&params, &Sequences::dense(&params), gpu.max_groups()),
            walk: None,
        };
        call.run(&[dispatch]).await.unwrap();
        let bytes = call.read(&[(&dvec, (b * h * s * 4) as u64)]).await.unwrap();
        bytemuck::pod_collect_to_vec(&bytes[0])
    });
    for bi in 0..b {
        for hi in 0..h {
            for i in 0..s {
                let at = bi * s * row + i * row + hi * d;
                let want: f32 = (0..d).map(|x| o[at + x] * d_o[at + x]).sum();
                let got = got[(bi * h + hi) * s + i];
                assert!(
                    (got - want).abs() < 1e-5,
                    "b {bi} h {hi} row {i}: D = {got}, expected {want}"
                );
            }
        }
    }
}

/// The registers backward with 1, 2 and 4 rows (keys) per invocation on
/// odd sizes, GQA, masks and softcap.
#[test]
fn registers_backward_rows_per_invocation() {
    let Some(e) = engine() else { return };
    for (i, rm) in [1, 2, 4].into_iter().enumerate() {
        let o = PlanOverrides::default()
            .kernel(KernelFamily::Registers)
            .rows_per_thread(rm);
        let window = AttentionOptions::default().window(Some(9), Some(2));
        let cases = [
            Case::new(113, 97, 64).opts(causal()),
            Case::new(1, 1, 1),
            Case::new(97, 113, 59).heads(4, 2).opts(window.softcap(5.0)),
            Case::new(40, 70, 3).dv(13).bf16(),
        ];
        // Two of the four cases per setting, each case twice (all four with
        // FLASHATTN_FULL_MATRIX=1).
        let picked = matrix([[0, 3], [1, 2], [0, 2]][i].to_vec(), vec![0, 1, 2, 3]);
        for case in picked.into_iter().map(|j| cases[j].clone()) {
            let out = run_gpu_backward(e, &case.overrides(o));
            let plan = out.stats.plan.unwrap();
            assert_eq!(
                (plan.kernel, plan.rows_per_thread),
                (KernelFamily::Registers, rm)
            );
        }
    }
}

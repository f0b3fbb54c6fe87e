//! Unit tests of the planners: made-up limits, no device.

use super::*;
use crate::api::tensor::Precision;
use crate::error::Error;
use crate::api::shape::MAX_HEAD_DIM;

fn caps(kib: u32) -> DeviceCaps {
    DeviceCaps {
        max_workgroup_storage: kib * 1024,
        max_invocations: 1024,
        max_workgroup_size_x: 1024,
        shader_f16: false,
        lane_subgroup: None,
        subgroup: None,
        coop_matrix: Default::default(),
        hardware: false,
    }
}

#[test]
fn lanes_kernel_on_cpu_adapters_only() {
    let cpu = DeviceCaps {
        lane_subgroup: Some(8),
        ..caps(32)
    };
    let p = plan_forward(&PlanRequest::new(64, Precision::F32), &cpu).unwrap();
    assert_eq!(p.plan.kernel, KernelFamily::Lanes);
    assert_eq!((p.plan.br, p.plan.bc, p.plan.threads_per_row), (16, 8, 1));
    // Every departure from the formula says why.
    assert_eq!(p.clamps.len(), 2, "{p}");
    assert!(p.clamps.iter().all(|c| c.reason.contains("lanes kernel")));
    let short = PlanRequest::new(64, Precision::F32).seqlens(5, 100);
    assert_eq!(plan_forward(&short, &cpu).unwrap().plan.br, 8);
    assert_eq!((p.plan.workgroup_size, p.plan.workgroup_bytes), (8, 0));
    // The formula's values are still reported next to the lanes kernel.
    assert_eq!((p.plan.bc_formula, p.plan.br_formula), (32, 32));
    assert!(p.to_string().contains("kernel: lanes"), "{p}");
    // GPUs, head dims that are not a multiple of 4, and tile overrides: tiled.
    let gpu = plan_forward(&PlanRequest::new(64, Precision::F32), &caps(32)).unwrap();
    assert_eq!(gpu.plan.kernel, KernelFamily::Tiled);
    let odd = plan_forward(&PlanRequest::new(59, Precision::F16), &cpu).unwrap();
    assert_eq!(odd.plan.kernel, KernelFamily::Tiled);
    let sweep = PlanRequest::new(64, Precision::F32).overrides(PlanOverrides {
        max_workgroup_storage: Some(8192),
        ..Default::default()
    });
    assert_eq!(
        plan_forward(&sweep, &cpu).unwrap().plan.kernel,
        KernelFamily::Tiled
    );
}

#[test]
fn either_kernel_can_be_forced_where_it_runs() {
    let cpu = DeviceCaps {
        lane_subgroup: Some(8),
        ..caps(32)
    };
    let force = |kernel, d| {
        plan_forward(
            &PlanRequest::new(d, Precision::F32).overrides(PlanOverrides {
                kernel: Some(kernel),
                ..Default::default()
            }),
            &cpu,
        )
    };
    assert_eq!(
        force(KernelFamily::Tiled, 64).unwrap().plan.kernel,
        KernelFamily::Tiled
    );
    assert!(matches!(
        force(KernelFamily::Lanes, 62),
        Err(Error::LanesHeadDim {
            head_dim: 62,
            max: 128
        })
    ));
    assert!(matches!(
        force(KernelFamily::Lanes, 256),
        Err(Error::LanesHeadDim { head_dim: 256, .. })
    ));
    assert_eq!(
        plan_forward(&PlanRequest::new(256, Precision::F32), &cpu)
            .unwrap()
            .plan
            .kernel,
        KernelFamily::Tiled
    );
    let on_gpu = plan_forward(
        &PlanRequest::new(64, Precision::F32).overrides(PlanOverrides {
            kernel: Some(KernelFamily::Lanes),
            ..Default::default()
        }),
        &caps(32),
    );
    assert!(matches!(on_gpu, Err(Error::LanesUnavailable)), "{on_gpu:?}");
    // The backward follows: lanes where the forward is lanes, else tiles.
    let bwd = plan_backward(&PlanRequest::new(64, Precision::F32), &cpu).unwrap();
    assert_eq!(bwd.plan.kernel, KernelFamily::Lanes);
    assert_eq!((bwd.plan.br, bwd.plan.workgroup_bytes), (8, 0));
    let bwd = plan_backward(&PlanRequest::new(64, Precision::F32), &caps(32)).unwrap();
    assert_eq!(bwd.plan.kernel, KernelFamily::Tiled);
    assert!(bwd.plan.workgroup_bytes > 0);
    assert_eq!(
        "lanes".parse::<KernelFamily>().unwrap(),
        KernelFamily::Lanes
    );
    assert!(matches!(
        "wide".parse::<KernelFamily>(),
        Err(Error::UnknownName { what: "kernel", .. })
    ));
}

#[test]
fn formula_is_pinned() {
    // lavapipe: M = 32 KiB = 8192 f32 elements, d = 64: Bc = ceil(8192/256) = 32.
    let p = plan_forward(&PlanRequest::new(64, Precision::F32), &caps(32)).unwrap();
    assert_eq!((p.plan.bc_formula, p.plan.br_formula), (32, 32));
    assert_eq!((p.plan.bc, p.plan.br), (32, 32));
    assert!(p.plan.workgroup_bytes <= 32 * 1024);
    // Bc = ceil(M/4d) rounds up: M = 100 KiB, d = 59 → ceil(25600/236) = 109.
    let p = plan_forward(&PlanRequest::new(59, Precision::F32), &caps(100)).unwrap();
    assert_eq!(p.plan.bc_formula, 109);
    assert_eq!(p.plan.br_formula, 59);
}

#[test]
fn every_limit_and_head_dim_fits() {
    for kib in [16, 32, 48, 64, 100, 228] {
        for d in [32, 64, 128, 256, 288, 384, 512, 576] {
            let c = caps(kib);
            let p = plan_forward(&PlanRequest::new(d, Precision::F32), &c).unwrap();
            let m = kib * 1024 / 4;
            assert_eq!(
                p.plan.bc_formula,
                m.div_ceil(4 * d as u32),
                "{kib} KiB d {d}"
            );
            assert_eq!(p.plan.br_formula, p.plan.bc_formula.min(d as u32));
            assert!(p.plan.br <= p.plan.br_formula && p.plan.bc <= p.plan.bc_formula);
            assert_eq!(
                p.plan.workgroup_bytes,
                forward_workgroup_bytes(
                    p.plan.br,
                    p.plan.bc,
                    [d as u32; 2],
                    p.plan.threads_per_row
                )
            );
            assert!(p.plan.workgroup_bytes <= c.max_workgroup_storage, "{p}");
            assert!(p.plan.workgroup_size <= c.max_invocations);
            assert!(p.plan.scores_per_thread() <= MAX_SCORES_PER_THREAD);
            assert!(p.plan.acc_per_thread() <= MAX_ACC_PER_THREAD);
            if p.plan.br >= GRANULARITY {
                assert_eq!(p.plan.br % GRANULARITY, 0);
            }
            // Every deviation from the formula is explained.
            if p.plan.bc != p.plan.bc_formula {
                assert!(p.clamps.iter().any(|c| c.field == "Bc"), "{p}");
            }
            if p.plan.br != p.plan.br_formula {
                assert!(p.clamps.iter().any(|c| c.field == "Br"), "{p}");
            }
        }
    }
}

#[test]
fn larger_memory_never_gives_smaller_tiles() {
    for d in [32, 64, 128, 256] {
        let mut last = 0;
        for kib in [16, 32, 48, 64, 100, 228] {
            let p = plan_forward(&PlanRequest::new(d, Precision::F32), &caps(kib)).unwrap();
            assert!(p.plan.bc >= last, "d {d} {kib} KiB");
            last = p.plan.bc;
        }
    }
}

#[test]
fn storage_clamp_is_recorded() {
    // M = 1000 bytes = 250 elements, d = 8: Bc = ceil(250/32) = 8 = Br, but the
    // tiles plus row partials need 4·(64 + 128 + 64 + 8·8) = 1280 bytes.
    let c = DeviceCaps {
        max_workgroup_storage: 1000,
        ..caps(1)
    };
    let p = plan_forward(&PlanRequest::new(8, Precision::F32), &c).unwrap();
    assert_eq!((p.plan.bc_formula, p.plan.br_formula), (8, 8));
    assert!(p.plan.workgroup_bytes <= 1000, "{p}");
    assert!(
        p.clamps
            .iter()
            .any(|c| c.reason.contains("workgroup storage")),
        "{p}"
    );
}

#[test]
fn invocation_limit_clamps_br() {
    let c = DeviceCaps {
        max_invocations: 64,
        max_workgroup_size_x: 64,
        ..caps(64)
    };
    let p = plan_forward(&PlanRequest::new(64, Precision::F32), &c).unwrap();
    assert!(p.plan.workgroup_size <= 64);
    assert!(
        p.clamps.iter().any(|c| c.reason.contains("invocations")),
        "{p}"
    );
}

#[test]
fn short_sequences_shrink_tiles() {
    let p = plan_forward(
        &PlanRequest::new(64, Precision::F32).seqlens(1, 3),
        &caps(32),
    )
    .unwrap();
    assert_eq!((p.plan.br, p.plan.bc), (4, 4));
    assert!(p.clamps.iter().any(|c| c.reason.contains("seqlen_q")));
}

#[test]
fn overrides_are_checked() {
    let req = PlanRequest::new(64, Precision::F32).overrides(PlanOverrides {
        br: Some(64),
        bc: Some(64),
        ..Default::default()
    });
    let err = plan_forward(&req, &caps(16)).unwrap_err();
    assert!(
        matches!(
            err,
            Error::WorkgroupStorage {
                br: 64,
                bc: 64,
                head_dim: 64,
                max: 16384,
                ..
            }
        ),
        "{err:?}"
    );
    // Overrides that fit nothing are errors with their values.
    let zero = PlanRequest::new(64, Precision::F32).overrides(PlanOverrides {
        br: Some(0),
        ..Default::default()
    });
    assert!(matches!(
        plan_forward(&zero, &caps(32)),
        Err(Error::EmptyTile { br: 0, .. })
    ));
    let wide = PlanRequest::new(64, Precision::F32).overrides(PlanOverrides {
        br: Some(64),
        threads_per_row: Some(32),
        ..Default::default()
    });
    assert!(matches!(
        plan_forward(&wide, &caps(32)),
        Err(Error::WorkgroupTooLarge {
            invocations: 2048,
            max: 1024
        })
    ));
    let few = PlanRequest::new(64, Precision::F32).overrides(PlanOverrides {
        threads_per_row: Some(1),
        ..Default::default()
    });
    assert!(matches!(
        plan_forward(&few, &caps(32)),
        Err(Error::RegisterPressure {
            threads_per_row: 1,
            ..
        })
    ));
    let over = PlanRequest::new(64, Precision::F32).overrides(PlanOverrides {
        max_workgroup_storage: Some(1 << 20),
        ..Default::default()
    });
    assert!(matches!(
        plan_forward(&over, &caps(32)),
        Err(Error::StorageOverride {
            requested: 1048576,
            max: 32768
        })
    ));
    let req = PlanRequest::new(64, Precision::F32).overrides(PlanOverrides {
        br: Some(8),
        bc: Some(16),
        ..Default::default()
    });
    let p = plan_forward(&req, &caps(32)).unwrap();
    assert_eq!((p.plan.br, p.plan.bc), (8, 16));
}

#[test]
fn f16_path_follows_features() {
    let p = plan_forward(&PlanRequest::new(64, Precision::F16), &caps(32)).unwrap();
    assert_eq!(p.plan.storage, StorageKind::F16Packed);
    let c = DeviceCaps {
        shader_f16: true,
        ..caps(32)
    };
    let p = plan_forward(&PlanRequest::new(64, Precision::F16), &c).unwrap();
    assert_eq!(p.plan.storage, StorageKind::F16Native);
    let req = PlanRequest::new(64, Precision::F16).overrides(PlanOverrides {
        f16_native: Some(true),
        ..Default::default()
    });
    assert!(matches!(
        plan_forward(&req, &caps(32)),
        Err(Error::NativeF16Unavailable)
    ));
}

#[test]
fn backward_tiles_are_smaller_and_fit() {
    for kib in [16, 32, 48, 64, 100, 228] {
        for d in [32, 64, 128, 256, 384, 512, 576] {
            let c = caps(kib);
            let f = plan_forward(&PlanRequest::new(d, Precision::F32), &c).unwrap();
            let p = plan_backward(&PlanRequest::new(d, Precision::F32), &c).unwrap();
            assert_eq!(p.plan.br, p.plan.bc);
            assert!(p.plan.br <= f.plan.br, "{kib} KiB d {d}");
            assert_eq!(
                p.plan.workgroup_bytes,
                backward_workgroup_bytes(p.plan.br, [d as u32; 2])
            );
            assert!(p.plan.workgroup_bytes <= c.max_workgroup_storage);
            assert!(p.plan.workgroup_size <= c.max_invocations);
        }
    }
    // lavapipe, d = 64: Algorithm 1 gives 32, the backward's six tiles need 24.
    let p = plan_backward(&PlanRequest::new(64, Precision::F32), &caps(32)).unwrap();
    assert!(p.plan.br < 32);
    assert!(
        p.clamps.iter().any(|c| c.reason.contains("P and dS")),
        "{p}"
    );
}

#[test]
fn browser_limits_plan_every_head_dim() {
    for d in 1..=MAX_HEAD_DIM {
        let c = DeviceCaps::webgpu_default();
        let p = plan_forward(&PlanRequest::new(d, Precision::F32), &c).unwrap();
        assert!(
            p.plan.workgroup_bytes <= c.max_workgroup_storage,
            "d {d}: {p}"
        );
        assert!(p.plan.workgroup_size <= c.max_invocations, "d {d}: {p}");
        let p = plan_backward(&PlanRequest::new(d, Precision::F32), &c).unwrap();
        assert!(
            p.plan.workgroup_bytes <= c.max_workgroup_storage,
            "d {d}: {p}"
        );
        assert!(p.plan.workgroup_size <= c.max_invocations, "d {d}: {p}");
    }
}

#[test]
fn v_head_dims_count_in_m() {
    // Bc = ceil(M / (2d + 2dv)): lavapipe's 8192 f32 elements, d 192, dv 128.
    let req = PlanRequest::new(192, Precision::F32).head_dim_v(128);
    let p = plan_forward(&req, &caps(32)).unwrap();
    assert_eq!(p.plan.bc_formula, 8192u32.div_ceil(2 * (192 + 128)));
    assert_eq!((p.plan.head_dim, p.plan.head_dim_v), (192, 128));
    assert_eq!(
        p.plan.workgroup_bytes,
        forward_workgroup_bytes(p.plan.br, p.plan.bc, [192, 128], p.plan.threads_per_row)
    );
    assert!(p.to_string().contains("dv = 128"), "{p}");
    // Accumulators follow v's head dim; the backward fits both dims.
    assert_eq!(
        p.plan.acc_per_thread(),
        128u32.div_ceil(p.plan.threads_per_row)
    );
    for kib in [16, 32, 48] {
        for (d, dv) in [(192, 128), (40, 24), (24, 512), (512, 16), (576, 512)] {
            let req = PlanRequest::new(d, Precision::F32).head_dim_v(dv);
            let b = plan_backward(&req, &caps(kib)).unwrap();
            assert_eq!(
                b.plan.workgroup_bytes,
                backward_workgroup_bytes(b.plan.br, [d as u32, dv as u32])
            );
            assert!(b.plan.workgroup_bytes <= kib * 1024, "{b}");
        }
    }
    // Lanes need both dims to be multiples of 4 up to 128, and say why not.
    let cpu = DeviceCaps {
        lane_subgroup: Some(8),
        ..caps(32)
    };
    let mla = plan_forward(&req_dv(64, 128), &cpu).unwrap();
    assert_eq!(mla.plan.kernel, KernelFamily::Lanes);
    for (d, dv) in [(64, 256), (256, 64), (64, 62), (288, 288)] {
        let p = plan_forward(&req_dv(d, dv), &cpu).unwrap();
        assert_eq!(p.plan.kernel, KernelFamily::Tiled);
        assert!(p.kernel_reason.is_some(), "{p}");
        assert!(p.to_string().contains("kernel: tiled, not lanes"), "{p}");
    }
    assert!(matches!(
        plan_forward(&req_dv(64, 600), &caps(32)),
        Err(Error::HeadDimTooLarge {
            tensor: "v",
            head_dim: 600,
            max: MAX_HEAD_DIM
        })
    ));
}

fn req_dv(d: usize, dv: usize) -> PlanRequest {
    PlanRequest::new(d, Precision::F32).head_dim_v(dv)
}

#[test]
fn tiny_and_odd_head_dims_plan() {
    for d in [1, 3, 16, 59, 111, 255] {
        for kib in [16, 32] {
            let c = DeviceCaps {
                max_invocations: 256,
                max_workgroup_size_x: 256,
                ..caps(kib)
            };
            let p = plan_forward(&PlanRequest::new(d, Precision::F32), &c).unwrap();
            assert!(p.plan.workgroup_bytes <= c.max_workgroup_storage);
            assert!(p.plan.workgroup_size <= 256);
        }
    }
}

/// A plan is a key: `Copy`, `Eq` and `Hash`, with its explanation beside it.
#[test]
fn plans_are_plain_values() {
    fn key<T: Copy + Eq + std::hash::Hash>(_: T) {}
    let p = plan_forward(&PlanRequest::new(64, Precision::F32), &caps(32)).unwrap();
    key(p.plan);
    let mut seen = std::collections::HashSet::new();
    seen.insert(p.plan);
    assert!(seen.contains(&p.plan));
}

#[test]
fn head_dims_out_of_range_are_typed() {
    assert!(matches!(
        plan_forward(&PlanRequest::new(0, Precision::F32), &caps(32)),
        Err(Error::EmptyDim { dim: "head_dim" })
    ));
    assert!(matches!(
        plan_forward(&PlanRequest::new(600, Precision::F32), &caps(32)),
        Err(Error::HeadDimTooLarge {
            head_dim: 600,
            max: MAX_HEAD_DIM,
            ..
        })
    ));
}

fn decode_request(keys: usize, num_splits: Option<usize>) -> DecodeRequest {
    DecodeRequest {
        batch: 1,
        seqlen_q: 1,
        heads_q: 8,
        heads_kv: 1,
        head_dim: 64,
        head_dim_v: 64,
        max_seqlen_k: keys,
        precision: Precision::F32,
        num_splits,
        f16_native: None,
        kernel: None,
    }
}

fn split_limits(max_keys: usize) -> SplitLimits {
    SplitLimits {
        parallelism: 256,
        max_keys,
        max_binding: u64::MAX,
    }
}

#[test]
fn requested_splits_stay_within_what_the_merge_combines() {
    let unlimited = split_limits(usize::MAX);
    let splits = |keys, n| {
        plan_splits(&decode_request(keys, n), 64, 1, 0, &unlimited)
            .unwrap()
            .0
            .num_splits
    };
    // Zero asks the planner, as None does.
    assert_eq!(splits(12000, Some(0)), splits(12000, None));
    assert_eq!(splits(12000, Some(3)), 3);
    // Past the blocks, then past MAX_SPLITS: each clamp says why.
    assert_eq!(splits(100, Some(9)), 2);
    assert_eq!(splits(16384, Some(190)), decode::MAX_SPLITS);
    let (_, why) = plan_splits(&decode_request(16384, Some(190)), 64, 1, 0, &unlimited).unwrap();
    assert!(why.iter().any(|r| r.contains("merge combines")), "{why:?}");
}

#[test]
fn the_loop_limit_raises_splits_up_to_what_the_merge_combines() {
    // The loop model's limits are whole blocks.
    let (s, why) = plan_splits(
        &decode_request(10_000, Some(1)),
        64,
        1,
        0,
        &split_limits(1024),
    )
    .unwrap();
    assert_eq!(s.num_splits, 10, "{s:?}");
    assert!(s.keys_per_split <= 1024, "{s:?}");
    assert!(why.iter().any(|r| r.contains("loop limit")), "{why:?}");
    let too_long = plan_splits(
        &decode_request(200_000, None),
        64,
        1,
        0,
        &split_limits(1024),
    );
    assert!(matches!(
        too_long,
        Err(Error::TooManySplits {
            needed: 196,
            max: 128,
            ..
        })
    ));
}

#[test]
fn cooperative_matrix_shapes_wgsl_can_express() {
    use wgpu::{CooperativeMatrixProperties as P, CooperativeScalarType as T};
    let prop = |n: u32, k: u32, ab, cr| P {
        m_size: n,
        n_size: n,
        k_size: k,
        ab_type: ab,
        cr_type: cr,
        saturating_accumulation: false,
    };
    // NVIDIA-like: 16×16×16 f16 with either accumulator, and 16×8×16 WGSL cannot name.
    let nvidia = [
        prop(16, 16, T::F16, T::F32),
        prop(16, 16, T::F16, T::F16),
        prop(16, 8, T::F16, T::F32),
    ];
    let shapes = CoopMatrixShapes::from_properties(&nvidia);
    assert!(shapes.f16_16x16_f32 && shapes.f16_16x16_f16 && !shapes.f32_8x8);
    // Apple-like simdgroup matrices: 8×8 f32.
    let apple = CoopMatrixShapes::from_properties(&[prop(8, 8, T::F32, T::F32)]);
    assert!(apple.f32_8x8 && !apple.f16_16x16_f32 && apple.any());
    assert!(!CoopMatrixShapes::from_properties(&[prop(16, 8, T::F16, T::F32)]).any());
}

/// A GPU with `kib` of workgroup storage and subgroups of `sg` lanes (none: no SUBGROUP).
fn gpu(kib: u32, sg: Option<(u32, u32)>) -> DeviceCaps {
    DeviceCaps {
        subgroup: sg.map(|(min, max)| SubgroupSizes { min, max }),
        hardware: true,
        ..caps(kib)
    }
}

fn registers(overrides: PlanOverrides) -> PlanOverrides {
    PlanOverrides {
        kernel: Some(KernelFamily::Registers),
        ..overrides
    }
}

#[test]
fn registers_are_the_default_on_gpus_only() {
    let req = PlanRequest::new(64, Precision::F32);
    let nvidia = plan_forward(&req, &gpu(48, Some((32, 32)))).unwrap();
    assert_eq!(nvidia.plan.kernel, KernelFamily::Registers);
    let bwd = plan_backward(&req, &gpu(48, Some((32, 32)))).unwrap();
    assert_eq!(bwd.plan.kernel, KernelFamily::Registers);
    // CPU adapters keep theirs: lanes (lavapipe), tiled (no lanes).
    let lavapipe = DeviceCaps {
        lane_subgroup: Some(8),
        subgroup: Some(SubgroupSizes { min: 8, max: 8 }),
        ..caps(32)
    };
    assert_eq!(
        plan_forward(&req, &lavapipe).unwrap().plan.kernel,
        KernelFamily::Lanes
    );
    assert_eq!(
        plan_forward(&req, &caps(32)).unwrap().plan.kernel,
        KernelFamily::Tiled
    );
    // Forced anywhere; a registers parameter alone picks them.
    let forced = PlanRequest::new(64, Precision::F32).overrides(registers(Default::default()));
    assert_eq!(
        plan_forward(&forced, &lavapipe).unwrap().plan.kernel,
        KernelFamily::Registers
    );
    let rm = PlanRequest::new(64, Precision::F32).overrides(PlanOverrides {
        rows_per_thread: Some(2),
        ..Default::default()
    });
    let p = plan_forward(&rm, &lavapipe).unwrap();
    assert_eq!(
        (p.plan.kernel, p.plan.rows_per_thread),
        (KernelFamily::Registers, 2)
    );
    // ... but not with another family.
    let mixed = PlanRequest::new(64, Precision::F32).overrides(PlanOverrides {
        kernel: Some(KernelFamily::Tiled),
        double_buffer: Some(true),
        ..Default::default()
    });
    assert!(matches!(
        plan_forward(&mixed, &lavapipe),
        Err(Error::RegisterOverrideElsewhere { kernel: "tiled" })
    ));
    assert_eq!(
        "registers".parse::<KernelFamily>().unwrap(),
        KernelFamily::Registers
    );
    let err = "wide".parse::<KernelFamily>().unwrap_err().to_string();
    assert!(err.contains("registers"), "{err}");
}

/// One registers plan pair on `c`: within the device, consistent with the
/// storage functions, within the register budget, explained.
fn check_registers_plans(name: &str, c: &DeviceCaps, d: usize, dv: usize) {
    let req = req_dv(d, dv).seqlens(4096, 4096);
    let f = plan_forward(&req, c).unwrap_or_else(|e| panic!("{name} d {d}: {e}"));
    let p = f.plan;
    assert_eq!(p.kernel, KernelFamily::Registers, "{name}");
    assert!(p.workgroup_bytes <= c.max_workgroup_storage, "{name} {f}");
    assert!(p.workgroup_size <= c.max_workgroup(), "{name} {f}");
    assert_eq!(p.br % p.rows_per_thread, 0);
    assert_eq!(
        p.workgroup_size,
        p.br / p.rows_per_thread * p.threads_per_row
    );
    let tiles = RegTiles {
        br: p.br,
        bc: p.bc,
        threads_per_row: p.threads_per_row,
        buffers: p.buffers(),
        subgroup_reduce: p.subgroup_reduce,
    };
    assert_eq!(
        p.workgroup_bytes,
        registers_forward_bytes(tiles, [d as u32, dv as u32])
    );
    // Registers: scores and accumulators within the budget.
    assert!(
        p.rows_per_thread * p.scores_per_thread() <= REG_MAX_SCORES,
        "{f}"
    );
    assert!(
        p.rows_per_thread * 4 * p.acc_chunks(false) <= REG_MAX_ACC,
        "{f}"
    );
    // Subgroup reductions exactly where a row fits the smallest subgroup.
    let fits = c.subgroup.is_some_and(|s| p.threads_per_row <= s.min);
    assert_eq!(p.subgroup_reduce, fits, "{name} {f}");
    let text = f.to_string();
    assert!(text.contains("kernel: registers"), "{text}");
    assert!(text.contains(if fits {
        "subgroup shuffles"
    } else {
        "workgroup memory"
    }));
    let b = plan_backward(&req, c).unwrap_or_else(|e| panic!("{name} d {d} backward: {e}"));
    assert_eq!(b.plan.kernel, KernelFamily::Registers);
    assert!(
        b.plan.workgroup_bytes <= c.max_workgroup_storage,
        "{name} {b}"
    );
    assert_eq!(
        b.plan.workgroup_bytes,
        registers_backward_bytes(b.plan.br, [d as u32, dv as u32])
    );
    assert!(2 * b.plan.rows_per_thread * b.plan.scores_per_thread() <= REG_MAX_SCORES);
    let acc = b.plan.acc_chunks(true) + b.plan.acc_chunks(false);
    assert!(
        b.plan.rows_per_thread * 4 * acc <= REG_MAX_ACC,
        "{name} {b}"
    );
}

/// The registers plans on made-up GPUs: every choice within the device and
/// explained; storage from the same function the shaders' sizes follow.
#[test]
fn registers_plans_fit_gpu_families() {
    let families = [
        ("NVIDIA 48 KiB", gpu(48, Some((32, 32)))),
        ("NVIDIA 100 KiB", gpu(100, Some((32, 32)))),
        ("AMD", gpu(64, Some((32, 64)))),
        ("Apple", gpu(32, Some((32, 32)))),
        ("Intel", gpu(64, Some((8, 32)))),
        (
            "WebGPU default",
            DeviceCaps {
                hardware: true,
                ..DeviceCaps::webgpu_default()
            },
        ),
    ];
    for (name, c) in families {
        for (d, dv) in [
            (1, 1),
            (3, 3),
            (59, 59),
            (64, 64),
            (128, 128),
            (192, 128),
            (256, 256),
            (512, 512),
            (576, 512),
        ] {
            check_registers_plans(name, &c, d, dv);
        }
    }
    // Where M allows, K/V are double-buffered; where not, the clamp says why.
    let roomy = plan_forward(
        &PlanRequest::new(64, Precision::F32),
        &gpu(100, Some((32, 32))),
    )
    .unwrap();
    assert!(roomy.plan.double_buffer, "{roomy}");
    let tight = plan_forward(
        &PlanRequest::new(128, Precision::F32),
        &gpu(32, Some((32, 32))),
    )
    .unwrap();
    assert!(!tight.plan.double_buffer);
    assert!(
        tight.clamps.iter().any(|c| c.field == "K/V buffers"),
        "{tight}"
    );
}

#[test]
fn registers_overrides_apply_or_fail_clearly() {
    let intel = gpu(64, Some((8, 32)));
    let with = |o| {
        plan_forward(
            &PlanRequest::new(64, Precision::F32).overrides(registers(o)),
            &intel,
        )
    };
    let p = with(PlanOverrides {
        rows_per_thread: Some(2),
        subgroup_reduce: Some(false),
        double_buffer: Some(false),
        ..Default::default()
    })
    .unwrap();
    assert_eq!(
        (
            p.plan.rows_per_thread,
            p.plan.subgroup_reduce,
            p.plan.double_buffer
        ),
        (2, false, false)
    );
    assert!(p.to_string().contains("as asked"), "{p}");
    // 16 invocations per row do not fit Intel's smallest subgroup (8).
    let wide = with(PlanOverrides {
        threads_per_row: Some(16),
        subgroup_reduce: Some(true),
        ..Default::default()
    });
    assert!(
        matches!(
            wide,
            Err(Error::SubgroupReduce {
                threads_per_row: 16,
                subgroup: 8
            })
        ),
        "{wide:?}"
    );
    let fallback = with(PlanOverrides {
        threads_per_row: Some(16),
        ..Default::default()
    })
    .unwrap();
    assert!(!fallback.plan.subgroup_reduce);
    assert!(
        fallback
            .to_string()
            .contains("do not fit the smallest subgroup"),
        "{fallback}"
    );
    assert!(matches!(
        with(PlanOverrides {
            rows_per_thread: Some(9),
            ..Default::default()
        }),
        Err(Error::RowsPerThread { rows: 9, max: 8 })
    ));
    // A Br that RM does not divide lowers RM, and says so.
    let odd_br = with(PlanOverrides {
        br: Some(6),
        ..Default::default()
    })
    .unwrap();
    assert_eq!((odd_br.plan.br, odd_br.plan.rows_per_thread), (6, 2));
    assert!(odd_br.clamps.iter().any(|c| c.field == "RM"), "{odd_br}");
    // Short sequences get short tiles.
    let short = plan_forward(&PlanRequest::new(64, Precision::F32).seqlens(5, 7), &intel).unwrap();
    assert!(short.plan.br <= 8 && short.plan.bc <= 8, "{short}");
}

/// Every value of a backward plan that leaves Algorithm 1's formula names
/// its reason: where d is below Bc, Bc comes down to the square tile's B
/// (it came down with no clamp shown).
#[test]
fn backward_clamps_explain_every_departure_from_the_formula() {
    let mut planned = 0;
    for (kernel, c) in [
        (KernelFamily::Tiled, caps(32)),
        (KernelFamily::Tiled, caps(8)),
        (KernelFamily::Registers, gpu(32, Some((32, 32)))),
        (KernelFamily::Registers, gpu(16, None)),
    ] {
        for d in [1, 3, 8, 16, 24, 64, 100, 256] {
            let req = PlanRequest::new(d, Precision::F32).overrides(PlanOverrides {
                kernel: Some(kernel),
                ..Default::default()
            });
            let Ok(p) = plan_backward(&req, &c) else {
                continue;
            };
            planned += 1;
            let formula = [("Bc", p.plan.bc_formula), ("Br", p.plan.br_formula)];
            for ((field, from), to) in formula.into_iter().zip([p.plan.bc, p.plan.br]) {
                let shown = p.clamps.iter().fold(from, |v, c| {
                    let ours = c.field == field || c.field == "B";
                    if ours && c.from == v {
                        c.to
                    } else {
                        v
                    }
                });
                assert_eq!(shown, to, "{kernel:?} d {d} {field}: {p}");
            }
        }
    }
    assert!(planned >= 24, "{planned}");
}

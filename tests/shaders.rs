//! Every composed WGSL module is validated by naga, so a shader error fails a
//! test rather than a user's run. Capabilities come from wgpu's own mapping of
//! adapter features, with and without SHADER_F16.

use flashattn::gpu::shaders::{self, MatmulKernel, Variant};
use flashattn::{plan_backward, plan_forward, DeviceCaps, PlanRequest, Precision, StorageKind};

fn capabilities(f16: bool, subgroups: bool) -> naga::valid::Capabilities {
    let mut features = wgpu::Features::empty();
    if f16 {
        features |= wgpu::Features::SHADER_F16;
    }
    if subgroups {
        features |= wgpu::Features::SUBGROUP;
    }
    wgpu_naga_bridge::features_to_naga_capabilities(features, wgpu::DownlevelFlags::all())
}

fn validate(source: &str, f16: bool) -> Result<(), String> {
    validate_with(source, f16, false)
}

/// Validate with or without the SUBGROUP capability (the lanes kernels need it).
fn validate_with(source: &str, f16: bool, subgroups: bool) -> Result<(), String> {
    let module = naga::front::wgsl::parse_str(source).map_err(|e| e.emit_to_string(source))?;
    naga::valid::Validator::new(
        naga::valid::ValidationFlags::all(),
        capabilities(f16, subgroups),
    )
    .validate(&module)
    .map_err(|e| e.emit_to_string(source))?;
    Ok(())
}

fn variants() -> Vec<Variant> {
    let mut v = Vec::new();
    for masked in [false, true] {
        for softcap in [false, true] {
            for instrumented in 0..4 {
                v.push(Variant {
                    masked,
                    softcap,
                    count_io: instrumented & 1 != 0,
                    loop_guard: instrumented & 2 != 0,
                });
            }
        }
    }
    v
}

/// Lavapipe's limits (32 KiB of workgroup storage, f16), with or without
/// the lanes kernels.
fn lavapipe_like(lane_subgroup: Option<u32>) -> DeviceCaps {
    DeviceCaps {
        max_workgroup_storage: 32768,
        max_invocations: 1024,
        max_workgroup_size_x: 1024,
        shader_f16: true,
        lane_subgroup,
    }
}

fn storage_kinds() -> [(StorageKind, bool); 3] {
    [
        (StorageKind::F32, false),
        (StorageKind::F16Packed, false),
        (StorageKind::F16Native, true),
    ]
}

#[test]
fn lanes_forward_validates_for_every_subgroup_and_variant() {
    for sg in flashattn::plan::LANE_SUBGROUPS {
        let c = lavapipe_like(Some(sg));
        for d in [4, 8, 60, 64, 128] {
            let mut plan = plan_forward(&PlanRequest::new(d, Precision::F32), &c).unwrap();
            assert_eq!(plan.kernel, flashattn::KernelFamily::Lanes);
            for (storage, _) in storage_kinds() {
                plan.storage = storage;
                for variant in variants() {
                    let src = shaders::flash_forward(&plan, variant);
                    validate_with(&src, true, true)
                        .unwrap_or_else(|e| panic!("sg {sg} d {d} {storage:?} {variant:?}:\n{e}"));
                    assert!(!src.contains('$'), "unexpanded template line");
                }
            }
        }
    }
}

#[test]
fn flash_forward_validates_for_every_plan_and_variant() {
    let caps = [
        DeviceCaps::webgpu_default(),
        lavapipe_like(None),
        DeviceCaps {
            max_workgroup_storage: 49152,
            max_invocations: 1024,
            max_workgroup_size_x: 1024,
            shader_f16: true,
            lane_subgroup: None,
        },
    ];
    for c in caps {
        for d in [1, 3, 16, 59, 64, 111, 128, 256] {
            let mut plan = plan_forward(&PlanRequest::new(d, Precision::F32), &c).unwrap();
            for (storage, f16) in storage_kinds() {
                plan.storage = storage;
                for variant in variants() {
                    let src = shaders::flash_forward(&plan, variant);
                    validate(&src, f16)
                        .unwrap_or_else(|e| panic!("d {d} {storage:?} {variant:?}:\n{e}"));
                }
            }
        }
    }
}

#[test]
fn flash_backward_validates_for_every_plan_and_variant() {
    for c in [
        DeviceCaps::webgpu_default(),
        lavapipe_like(None),
        // The lanes backward (CPU adapters).
        lavapipe_like(Some(8)),
    ] {
        for d in [1, 3, 59, 64, 128, 256] {
            let mut plan = plan_backward(&PlanRequest::new(d, Precision::F32), &c).unwrap();
            let lanes = plan.kernel == flashattn::KernelFamily::Lanes;
            assert_eq!(lanes, c.lane_subgroup.is_some() && d % 4 == 0 && d <= 128);
            for (storage, f16) in storage_kinds() {
                plan.storage = storage;
                for variant in variants() {
                    for (name, src) in ["pre", "dkdv", "dq"]
                        .iter()
                        .zip(shaders::flash_backward(&plan, variant))
                    {
                        validate_with(&src, f16, lanes).unwrap_or_else(|e| {
                            panic!("{name} d {d} {storage:?} {variant:?}:\n{e}")
                        });
                    }
                }
            }
        }
    }
}

#[test]
fn naive_backward_validates() {
    for d in [1, 59, 256] {
        for (storage, f16) in storage_kinds() {
            for variant in variants() {
                let src = shaders::naive_backward(d, storage, variant);
                validate(&src, f16)
                    .unwrap_or_else(|e| panic!("d {d} {storage:?} {variant:?}:\n{e}"));
            }
        }
    }
}

#[test]
fn matmul_validates_in_every_configuration() {
    use shaders::Epilogue;
    for (storage, f16) in storage_kinds() {
        for b_trans in [false, true] {
            for kernel in [
                MatmulKernel::Tiled { aligned: false },
                MatmulKernel::Tiled { aligned: true },
                MatmulKernel::Lanes {
                    lanes: 8,
                    chunks: 16,
                    rows: 2,
                },
                MatmulKernel::Lanes {
                    lanes: 4,
                    chunks: 1,
                    rows: 1,
                },
            ] {
                for (epilogue, variant) in [
                    (Epilogue::Scale, Variant::default()),
                    (
                        Epilogue::Scores,
                        Variant {
                            masked: true,
                            softcap: true,
                            count_io: true,
                            loop_guard: true,
                        },
                    ),
                ] {
                    for [a, b, c] in [
                        [storage, storage, StorageKind::F32],
                        [StorageKind::F32, storage, storage],
                    ] {
                        // The lanes dot form stores f32 C only (MatmulSpec never asks otherwise).
                        let lanes = matches!(kernel, MatmulKernel::Lanes { .. });
                        if lanes && b_trans && c != StorageKind::F32 {
                            continue;
                        }
                        let src = shaders::matmul(a, b, c, b_trans, kernel, epilogue, variant);
                        validate_with(&src, f16, true)
                            .unwrap_or_else(|e| panic!("{storage:?} {b_trans} {kernel:?}:\n{e}"));
                        let entry = kernel.entry(b_trans);
                        assert!(src.contains(&format!("fn {entry}(")), "{entry}");
                    }
                }
            }
        }
    }
}

#[test]
fn naive_forward_validates() {
    for d in [1, 59, 64, 256] {
        for (storage, f16) in storage_kinds() {
            for variant in variants() {
                let src = shaders::naive_forward(d, storage, variant);
                validate(&src, f16)
                    .unwrap_or_else(|e| panic!("d {d} {storage:?} {variant:?}:\n{e}"));
            }
        }
    }
}

#[test]
fn native_f16_needs_the_capability_and_packed_does_not() {
    let mut plan = plan_forward(
        &PlanRequest::new(64, Precision::F16),
        &DeviceCaps::webgpu_default(),
    )
    .unwrap();
    assert_eq!(plan.storage, StorageKind::F16Packed);
    assert!(validate(&shaders::flash_forward(&plan, Variant::default()), false).is_ok());
    plan.storage = StorageKind::F16Native;
    assert!(validate(&shaders::flash_forward(&plan, Variant::default()), false).is_err());
}

/// Bytes of `var<workgroup>` a module declares, as naga lays them out.
fn workgroup_bytes(src: &str) -> u32 {
    let module = naga::front::wgsl::parse_str(src).unwrap();
    let mut layouter = naga::proc::Layouter::default();
    layouter.update(module.to_ctx()).unwrap();
    module
        .global_variables
        .iter()
        .filter(|(_, g)| g.space == naga::AddressSpace::WorkGroup)
        .map(|(_, g)| layouter[g.ty].size)
        .sum()
}

#[test]
fn declared_workgroup_storage_matches_the_plan() {
    // naga's view of each module's workgroup variables equals the planner's bytes.
    for d in [16, 59, 64, 256] {
        let caps = DeviceCaps::webgpu_default();
        let plan = plan_forward(&PlanRequest::new(d, Precision::F32), &caps).unwrap();
        let src = shaders::flash_forward(&plan, Variant::default());
        assert_eq!(workgroup_bytes(&src), plan.workgroup_bytes, "d {d}");
        let plan = plan_backward(&PlanRequest::new(d, Precision::F32), &caps).unwrap();
        for src in &shaders::flash_backward(&plan, Variant::default())[1..] {
            assert_eq!(workgroup_bytes(src), plan.workgroup_bytes, "backward d {d}");
        }
    }
}

//! Every composed WGSL module is validated by naga, so a shader error fails a
//! test rather than a user's run. Capabilities come from wgpu's own mapping of
//! adapter features, with and without SHADER_F16.

use flashattn::gpu::shaders::{self, Variant};
use flashattn::{plan_backward, plan_forward, DeviceCaps, PlanRequest, Precision, StorageKind};

fn capabilities(f16: bool) -> naga::valid::Capabilities {
    let features = if f16 {
        wgpu::Features::SHADER_F16
    } else {
        wgpu::Features::empty()
    };
    wgpu_naga_bridge::features_to_naga_capabilities(features, wgpu::DownlevelFlags::all())
}

fn validate(source: &str, f16: bool) -> Result<(), String> {
    let module = naga::front::wgsl::parse_str(source).map_err(|e| e.emit_to_string(source))?;
    naga::valid::Validator::new(naga::valid::ValidationFlags::all(), capabilities(f16))
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

fn storage_kinds() -> [(StorageKind, bool); 3] {
    [
        (StorageKind::F32, false),
        (StorageKind::F16Packed, false),
        (StorageKind::F16Native, true),
    ]
}

#[test]
fn lanes_forward_validates_for_every_subgroup_and_variant() {
    let caps = wgpu_naga_bridge::features_to_naga_capabilities(
        wgpu::Features::SHADER_F16 | wgpu::Features::SUBGROUP,
        wgpu::DownlevelFlags::all(),
    );
    for sg in flashattn::plan::LANE_SUBGROUPS {
        let c = DeviceCaps {
            max_workgroup_storage: 32768,
            max_invocations: 1024,
            max_workgroup_size_x: 1024,
            shader_f16: true,
            lane_subgroup: Some(sg),
        };
        for d in [4, 8, 60, 64, 128, 256] {
            let mut plan = plan_forward(&PlanRequest::new(d, Precision::F32), &c).unwrap();
            assert_eq!(plan.kernel, flashattn::ForwardKernel::Lanes);
            for (storage, _) in storage_kinds() {
                plan.storage = storage;
                for variant in variants() {
                    let src = shaders::flash_forward(&plan, variant);
                    let module = naga::front::wgsl::parse_str(&src)
                        .unwrap_or_else(|e| panic!("{}", e.emit_to_string(&src)));
                    naga::valid::Validator::new(naga::valid::ValidationFlags::all(), caps)
                        .validate(&module)
                        .unwrap_or_else(|e| {
                            panic!(
                                "sg {sg} d {d} {storage:?} {variant:?}:\n{}",
                                e.emit_to_string(&src)
                            )
                        });
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
        DeviceCaps {
            max_workgroup_storage: 32768,
            max_invocations: 1024,
            max_workgroup_size_x: 1024,
            shader_f16: true,
            lane_subgroup: None,
        },
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
        DeviceCaps {
            max_workgroup_storage: 32768,
            max_invocations: 1024,
            max_workgroup_size_x: 1024,
            shader_f16: true,
            lane_subgroup: None,
        },
    ] {
        for d in [1, 3, 59, 64, 128, 256] {
            let mut plan = plan_backward(&PlanRequest::new(d, Precision::F32), &c).unwrap();
            for (storage, f16) in storage_kinds() {
                plan.storage = storage;
                for variant in variants() {
                    for (name, src) in ["pre", "dkdv", "dq"]
                        .iter()
                        .zip(shaders::flash_backward(&plan, variant))
                    {
                        validate(&src, f16).unwrap_or_else(|e| {
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
            for aligned in [false, true] {
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
                    let src = shaders::matmul(
                        storage,
                        storage,
                        StorageKind::F32,
                        b_trans,
                        aligned,
                        epilogue,
                        variant,
                    );
                    validate(&src, f16)
                        .unwrap_or_else(|e| panic!("{storage:?} {b_trans} {aligned}:\n{e}"));
                    let src = shaders::matmul(
                        StorageKind::F32,
                        storage,
                        storage,
                        b_trans,
                        aligned,
                        epilogue,
                        variant,
                    );
                    validate(&src, f16)
                        .unwrap_or_else(|e| panic!("{storage:?} {b_trans} {aligned}:\n{e}"));
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

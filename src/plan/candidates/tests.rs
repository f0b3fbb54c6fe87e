//! The candidates on made-up adapters: every one plans, within the limits,
//! once, the formula plan first.

use super::*;
use crate::api::tensor::Precision;
use crate::error::Error;
use crate::plan::caps::{CoopMatrixShapes, SubgroupSizes, LANE_SUBGROUPS};

fn gpu(kib: u32, subgroups: Option<(u32, u32)>) -> DeviceCaps {
    DeviceCaps {
        max_workgroup_storage: kib * 1024,
        max_invocations: 1024,
        max_workgroup_size_x: 1024,
        shader_f16: true,
        lane_subgroup: None,
        hardware: true,
        subgroup: subgroups.map(|(min, max)| SubgroupSizes { min, max }),
        coop_matrix: Default::default(),
    }
}

/// A CPU adapter whose subgroups are always `n` lanes (lavapipe has 8).
fn cpu_adapter(n: u32) -> DeviceCaps {
    DeviceCaps {
        lane_subgroup: LANE_SUBGROUPS.contains(&n).then_some(n),
        hardware: false,
        ..gpu(32, Some((n, n)))
    }
}

/// `caps` with cooperative matrices: 16×16 f16 (NVIDIA, AMD, Intel) or
/// only 8×8 f32 (Apple's simdgroup matrices).
fn coop(caps: DeviceCaps, f16: bool) -> DeviceCaps {
    let coop_matrix = CoopMatrixShapes {
        f32_8x8: !f16,
        f16_16x16_f32: f16,
        f16_16x16_f16: f16,
    };
    DeviceCaps {
        coop_matrix,
        ..caps
    }
}

fn adapters() -> Vec<(String, DeviceCaps)> {
    let mut out = vec![
        ("nvidia 48 KiB".to_string(), gpu(48, Some((32, 32)))),
        ("nvidia 100 KiB".into(), gpu(100, Some((32, 32)))),
        ("nvidia, coop".into(), coop(gpu(100, Some((32, 32))), true)),
        ("amd".into(), gpu(64, Some((32, 64)))),
        ("amd, coop".into(), coop(gpu(64, Some((32, 64))), true)),
        ("apple".into(), gpu(32, Some((32, 32)))),
        (
            "apple, simdgroup".into(),
            coop(gpu(32, Some((32, 32))), false),
        ),
        ("intel".into(), gpu(64, Some((8, 32)))),
        ("intel, coop".into(), coop(gpu(64, Some((8, 32))), true)),
        ("lavapipe".into(), cpu_adapter(8)),
        ("webgpu default".into(), DeviceCaps::webgpu_default()),
    ];
    for n in [4, 8, 16, 32, 64, 128] {
        out.push((format!("gpu, subgroup {n}"), gpu(32, Some((n, n)))));
        out.push((format!("cpu, subgroup {n}"), cpu_adapter(n)));
    }
    out
}

fn requests() -> Vec<PlanRequest> {
    let mut out = Vec::new();
    for (d, dv) in [
        (32, 32),
        (59, 59),
        (64, 64),
        (128, 128),
        (192, 128),
        (256, 256),
    ] {
        for precision in [Precision::F32, Precision::F16, Precision::Bf16] {
            for (sq, sk) in [(1, 1), (128, 128), (100, 1000), (8192, 8192)] {
                out.push(
                    PlanRequest::new(d, precision)
                        .head_dim_v(dv)
                        .seqlens(sq, sk),
                );
            }
            out.push(PlanRequest::new(d, precision).head_dim_v(dv));
        }
    }
    out
}

/// Everything a candidate list must satisfy for `req` on `caps`.
fn check(name: &str, req: &PlanRequest, pass: Pass, caps: &DeviceCaps) -> usize {
    let formula = pass.plan(req, caps);
    let list = candidates(req, pass, caps);
    let what = format!("{name}, {pass:?}, {req:?}");
    let (formula, list) = match (formula, list) {
        (Ok(f), Ok(l)) => (f.plan, l),
        (Err(a), Err(b)) => {
            assert_eq!(a.to_string(), b.to_string(), "{what}");
            return 0;
        }
        (f, l) => panic!("{what}: formula {f:?} but candidates {l:?}"),
    };
    assert!(
        (1..=MAX_CANDIDATES).contains(&list.len()),
        "{what}: {list:?}"
    );
    let first = &list[0];
    assert_eq!(first.label, "formula", "{what}");
    assert_eq!(
        (first.plan, first.overrides),
        (formula, req.overrides),
        "{what}"
    );
    for (i, c) in list.iter().enumerate() {
        let again = pass.plan(&req.overrides(c.overrides), caps).map(|p| p.plan);
        assert_eq!(
            again.ok(),
            Some(c.plan),
            "{what}: {} does not replan",
            c.label
        );
        assert!(
            list[..i].iter().all(|o| o.plan != c.plan),
            "{what}: {} twice",
            c.label
        );
        assert!(
            list[..i].iter().all(|o| o.label != c.label),
            "{what}: {}",
            c.label
        );
        let p = &c.plan;
        assert!(
            p.workgroup_size <= caps.max_workgroup(),
            "{what}: {}",
            c.label
        );
        assert!(
            p.workgroup_bytes <= caps.max_workgroup_storage,
            "{what}: {}",
            c.label
        );
        assert!(
            (1..=MAX_THREADS_PER_ROW).contains(&p.threads_per_row),
            "{what}"
        );
        assert!(p.br >= 1 && p.bc >= 1, "{what}: {}", c.label);
        if p.kernel == KernelFamily::Lanes {
            assert_eq!(caps.lane_subgroup, Some(p.bc), "{what}: {}", c.label);
        }
        assert!(
            i == 0 || useful(req, pass, p),
            "{what}: {} covers too much",
            c.label
        );
    }
    list.len()
}

#[test]
fn every_candidate_plans_within_the_limits_once_after_the_formula_plan() {
    let mut lists = 0;
    for (name, caps) in adapters() {
        for req in requests() {
            for pass in [Pass::Forward, Pass::Backward] {
                lists += usize::from(check(&name, &req, pass, &caps) > 0);
            }
        }
    }
    // Only the WebGPU default's widest backward tiles cannot plan at all.
    assert!(lists > 1900, "{lists} lists");
}

#[test]
fn there_is_something_to_choose_on_gpus_and_cpu_adapters() {
    let req = PlanRequest::new(64, Precision::F32).seqlens(8192, 8192);
    let nvidia = candidates(&req, Pass::Forward, &gpu(48, Some((32, 32)))).unwrap();
    let labels: Vec<&str> = nvidia.iter().map(|c| c.label.as_str()).collect();
    // The formula plan is the registers kernels' on GPUs; their own knobs
    // come before the tiled kernels' tiles.
    assert_eq!(
        labels,
        [
            "formula",
            "tiled kernel",
            "registers RM 2",
            "registers workgroup reductions",
            "registers 2 K/V buffers",
            "Br/2",
            "Bc/2",
            "threads/row×2"
        ],
        "{nvidia:?}"
    );
    // The formula plan fills M: tiles shrink or change shape rather than grow.
    let narrow = PlanRequest::new(32, Precision::F32).seqlens(8192, 8192);
    let roomy = candidates(&narrow, Pass::Forward, &gpu(100, Some((32, 32)))).unwrap();
    let labels: Vec<&str> = roomy.iter().map(|c| c.label.as_str()).collect();
    assert!(
        labels.iter().all(|l| *l != "Br×2" && *l != "Bc×2"),
        "{roomy:?}"
    );
    // Where registers, not M, cut the tiled formula's Bc (Hopper's 228 KiB
    // at d 16), the tiles also grow.
    let small = PlanRequest::new(16, Precision::F32).seqlens(8192, 8192);
    let tiled_gpu = DeviceCaps {
        hardware: false,
        ..gpu(228, Some((32, 32)))
    };
    let hopper = candidates(&small, Pass::Forward, &tiled_gpu).unwrap();
    assert_eq!(hopper[0].plan.kernel, KernelFamily::Tiled);
    assert_eq!(hopper[1].label, "registers kernel");
    assert!(hopper.iter().any(|c| c.label == "Br×2"), "{hopper:?}");
    // WebGPU's default 16 KiB still leaves a choice.
    let web = candidates(&narrow, Pass::Forward, &DeviceCaps::webgpu_default()).unwrap();
    assert!(web.len() >= 3, "{web:?}");
    // The formula plan is lanes on lavapipe; the tiled kernels are a candidate.
    let lavapipe = candidates(&req, Pass::Forward, &cpu_adapter(8)).unwrap();
    assert_eq!(lavapipe[0].plan.kernel, KernelFamily::Lanes);
    assert_eq!(lavapipe[1].label, "tiled kernel");
    assert_eq!(lavapipe[1].plan.kernel, KernelFamily::Tiled);
    assert!(lavapipe.len() >= 4, "{lavapipe:?}");
    let backward = candidates(&req, Pass::Backward, &cpu_adapter(8)).unwrap();
    assert!(backward.iter().any(|c| c.label == "B/2"), "{backward:?}");
    assert!(backward.iter().all(|c| c.plan.br == c.plan.bc));
}

#[test]
fn the_requests_own_overrides_stay_in_every_candidate() {
    let req = PlanRequest::new(64, Precision::F16)
        .seqlens(1024, 1024)
        .overrides(PlanOverrides {
            max_workgroup_storage: Some(16384),
            f16_native: Some(false),
            ..Default::default()
        });
    for pass in [Pass::Forward, Pass::Backward] {
        for c in candidates(&req, pass, &gpu(64, None)).unwrap() {
            assert_eq!(c.plan.m_bytes, 16384, "{}", c.label);
            assert_eq!(c.overrides.f16_native, Some(false), "{}", c.label);
            assert!(c.plan.workgroup_bytes <= 16384, "{}", c.label);
        }
    }
}

#[test]
fn passes_parse_by_name() {
    assert_eq!("forward".parse::<Pass>().unwrap(), Pass::Forward);
    assert_eq!("backward".parse::<Pass>().unwrap().name(), "backward");
    assert!(matches!(
        "sideways".parse::<Pass>(),
        Err(Error::UnknownName { what: "pass", .. })
    ));
}

#[test]
fn cooperative_matrices_join_the_candidates_where_the_device_has_them() {
    let req = PlanRequest::new(64, Precision::F32).seqlens(8192, 8192);
    let kernels = |caps: &DeviceCaps| -> Vec<KernelFamily> {
        candidates(&req, Pass::Forward, caps)
            .unwrap()
            .iter()
            .map(|c| c.plan.kernel)
            .collect()
    };
    // f32 takes coop only when asked: the tuner asks on Apple's 8×8 f32 form.
    let apple = coop(gpu(32, Some((32, 32))), false);
    assert!(kernels(&apple).contains(&KernelFamily::Coop));
    assert!(!kernels(&gpu(32, Some((32, 32)))).contains(&KernelFamily::Coop));
    // f16 on NVIDIA-like tensor cores: the formula plan is coop already.
    let nvidia = coop(gpu(100, Some((32, 32))), true);
    let f16 = PlanRequest::new(128, Precision::F16).seqlens(8192, 8192);
    let first = &candidates(&f16, Pass::Forward, &nvidia).unwrap()[0];
    assert_eq!(first.plan.kernel, KernelFamily::Coop);
}

//! The cooperative-matrix forward (`KernelFamily::Coop`,
//! `flash_fwd_coop.wgsl`): which matrix form a device runs, when the planner
//! takes it, and its tiles.
//!
//! The kernel computes S = Q·Kᵀ and O += P·V as N×N cooperative-matrix tiles
//! (one subgroup per tile) and the online softmax in workgroup memory. Its
//! tiles are powers of two, multiples of N: Br query rows share the
//! workgroup's `COOP_WORKGROUP` invocations (TC = WG / Br per row, at most N,
//! so each row's invocations split Bc evenly), and Bc keys per block.

use super::caps::DeviceCaps;
pub use crate::api::kernel_plan::CoopForm;
use super::request::{KernelFamily, PlanRequest};
use super::tiles::{prev_pow2, round_up, Plan, Planned};
use crate::api::tensor::Precision;
use crate::error::{Error, Result};

/// Invocations per coop workgroup: four subgroups of 32 (NVIDIA, Apple),
/// two of 64 (AMD wave64); a multiple of every subgroup size up to 128.
pub const COOP_WORKGROUP: u32 = 128;
/// Widest head the coop kernel takes: Q and O rows stay in workgroup memory
/// (O in f32), so past 256 the smallest tiles outgrow 48 KiB.
pub const COOP_MAX_HEAD_DIM: usize = 256;
/// The Br and Bc the planner starts from before fitting workgroup storage.
pub const COOP_START_TILE: u32 = 64;

/// The form the coop kernel takes for `req` on `caps`, or what is missing.
/// f32 storage needs the f32 form (its inputs are not rounded to f16); f16
/// and bf16 take the f16 form where the device has it (bf16 converts exactly
/// to f16 for magnitudes in f16's normal range), else the f32 one.
pub fn coop_form(req: &PlanRequest, caps: &DeviceCaps) -> Result<CoopForm> {
    let m = caps.coop_matrix;
    let missing = |missing| Err(Error::CoopMatrixUnavailable { missing });
    if !m.any() {
        return missing("EXPERIMENTAL_COOPERATIVE_MATRIX (cooperative matrices)");
    }
    if caps.subgroup.is_none() {
        return missing("SUBGROUP (the kernel gives each subgroup its tiles by subgroup_id)");
    }
    let half = m.f16_16x16_f32 && caps.shader_f16;
    match req.precision {
        Precision::F32 if m.f32_8x8 => Ok(CoopForm::F32x8),
        Precision::F32 => {
            missing("8×8 f32 cooperative matrices (f32 inputs are not rounded to f16)")
        }
        _ if half => Ok(CoopForm::F16x16),
        _ if m.f32_8x8 => Ok(CoopForm::F32x8),
        _ if m.f16_16x16_f32 => missing("SHADER_F16 (for the f16 cooperative matrices)"),
        _ => missing("16×16 f16 (f32 accumulators) or 8×8 f32 cooperative matrices"),
    }
}

/// Whether the coop kernel can run `req` as asked: a form, head dims up to
/// [`COOP_MAX_HEAD_DIM`], no threads-per-row override (its layout is fixed).
pub fn check_coop(req: &PlanRequest, caps: &DeviceCaps) -> Result<CoopForm> {
    let form = coop_form(req, caps)?;
    let widest = req.head_dim.max(req.head_dim_v);
    if widest > COOP_MAX_HEAD_DIM {
        return Err(Error::CoopHeadDim {
            head_dim: widest,
            max: COOP_MAX_HEAD_DIM,
        });
    }
    if req.overrides.threads_per_row.is_some() {
        return Err(Error::ThreadsOverrideOnCoop);
    }
    Ok(form)
}

/// The default-choice rule: the coop kernel wherever it runs the f16 or
/// bf16 forward (its smallest tiles fitting), unless the caller forced a
/// kernel or fixed a tile parameter (M included, as for the lanes kernels:
/// sweeps of the tiled kernel). f32 keeps the tiled kernel by default.
pub fn coop_by_default(req: &PlanRequest, caps: &DeviceCaps) -> bool {
    let ov = req.overrides;
    let low = matches!(req.precision, Precision::F16 | Precision::Bf16);
    let m = caps.max_workgroup_storage;
    low && ov.kernel.is_none()
        && !ov.fixes_tiles()
        && check_coop(req, caps).is_ok_and(|form| {
            let dims = padded_dims(req, form);
            let wg = workgroup(caps);
            coop_workgroup_bytes(form, min_br(form, wg), form.n(), dims, wg) <= m
        })
}

/// Why the planner took, or did not take, the coop kernel on a device with
/// cooperative matrices (`None` on devices without, or where forced).
pub fn coop_reason(req: &PlanRequest, caps: &DeviceCaps, kernel: KernelFamily) -> Option<String> {
    if !caps.coop_matrix.any() || req.overrides.kernel.is_some() {
        return None;
    }
    let name = kernel.name();
    Some(match (kernel, check_coop(req, caps)) {
        (KernelFamily::Coop, Ok(form)) => format!("coop: the device runs {}", form.name()),
        (_, Err(e)) => format!("{name}, not coop: {e}"),
        (_, Ok(_)) if req.precision == Precision::F32 => format!(
            "{name}, not coop: coop is the default for f16 and bf16 (force f32 with --kernel coop)"
        ),
        (_, Ok(_)) => format!(
            "{name}, not coop: tile overrides, or its smallest tiles outgrow the workgroup storage"
        ),
    })
}

/// Plan the coop forward from `p` (the formula's values): Br and Bc from
/// [`COOP_START_TILE`] down to what the sequences need, then halved until the
/// tiles fit M.
pub fn coop_forward(mut p: Planned, req: &PlanRequest, caps: &DeviceCaps) -> Result<Planned> {
    let form = check_coop(req, caps)?;
    let (n, wg) = (form.n(), workgroup(caps));
    if let Some(sg) = caps.subgroup.filter(|s| s.max > wg) {
        return Err(Error::WorkgroupTooLarge {
            invocations: sg.max,
            max: wg,
        });
    }
    let ov = req.overrides;
    let why = format!("coop kernel: powers of two, multiples of its {n}×{n} matrices");
    let fit_seq = |len: usize, min: u32| {
        COOP_START_TILE
            .min(round_up(len, n).next_power_of_two())
            .max(min)
    };
    let br = ov
        .br
        .unwrap_or_else(|| fit_seq(req.seqlen_q, min_br(form, wg)).min(wg));
    let bc = ov.bc.unwrap_or_else(|| fit_seq(req.seqlen_k, n));
    let (f_br, f_bc) = (p.plan.br_formula, p.plan.bc_formula);
    let reason = |fixed: Option<u32>, len| match fixed {
        Some(_) => "set by the caller".to_string(),
        None => format!("{why}, up to what {len} needs"),
    };
    p.record("Br", f_br, br, reason(ov.br, "seqlen_q"));
    p.record("Bc", f_bc, bc, reason(ov.bc, "seqlen_k"));
    check_tiles(form, br, bc, wg)?;
    let dims = padded_dims(req, form);
    let (br, bc, bytes) = fit_coop(&mut p, form, [br, bc], wg, dims, [ov.br, ov.bc])?;
    p.plan = Plan {
        kernel: KernelFamily::Coop,
        br,
        bc,
        threads_per_row: wg / br,
        workgroup_size: wg,
        workgroup_bytes: bytes,
        coop: Some(form),
        ..p.plan
    };
    Ok(p)
}

/// Halve Bc (while at least Br, or Br is fixed), else Br, until the tiles
/// fit M; returns `(br, bc, bytes)`.
fn fit_coop(
    p: &mut Planned,
    form: CoopForm,
    [mut br, mut bc]: [u32; 2],
    wg: u32,
    dims: [u32; 2],
    [br_fixed, bc_fixed]: [Option<u32>; 2],
) -> Result<(u32, u32, u32)> {
    let m = p.plan.m_bytes;
    let (br0, bc0, n) = (br, bc, form.n());
    let mut bytes = coop_workgroup_bytes(form, br, bc, dims, wg);
    while bytes > m {
        if bc_fixed.is_none() && bc > n && (bc >= br || br_fixed.is_some()) {
            bc /= 2;
        } else if br_fixed.is_none() && br > min_br(form, wg) {
            br /= 2;
        } else {
            return Err(Error::WorkgroupStorage {
                br,
                bc,
                head_dim: dims[0].max(dims[1]),
                bytes,
                max: m,
            });
        }
        bytes = coop_workgroup_bytes(form, br, bc, dims, wg);
    }
    let why = format!("the coop kernel's Q, K/V, S, P and O tiles must fit in {m} bytes");
    p.record("Bc", bc0, bc, why.clone());
    p.record("Br", br0, br, why);
    Ok((br, bc, bytes))
}

/// Bytes of `var<workgroup>` the coop kernel declares: Q (Br×DP), K/V
/// (Bc×max(DP, DVP)) and P (Br×Bc) in the form's element type; S (Br×Bc),
/// O (Br×DVP) and one partial per invocation in f32.
pub fn coop_workgroup_bytes(form: CoopForm, br: u32, bc: u32, [dp, dvp]: [u32; 2], wg: u32) -> u32 {
    form.element_bytes() * (br * dp + bc * dp.max(dvp) + br * bc) + 4 * (br * bc + br * dvp + wg)
}

/// The head dims rounded up to the matrices' side (the tiles' row lengths).
pub fn padded_dims(req: &PlanRequest, form: CoopForm) -> [u32; 2] {
    [req.head_dim, req.head_dim_v].map(|d| round_up(d, form.n()))
}

/// The workgroup: [`COOP_WORKGROUP`] invocations, fewer (a power of two)
/// where the device allows fewer.
fn workgroup(caps: &DeviceCaps) -> u32 {
    prev_pow2(COOP_WORKGROUP.min(caps.max_workgroup()))
}

/// The fewest rows per workgroup: one matrix tall, and at most N
/// invocations per row (so a row's invocations split any Bc evenly).
fn min_br(form: CoopForm, wg: u32) -> u32 {
    form.n().max(wg / form.n()).min(wg)
}

/// Br and Bc as the kernel takes them: multiples of N, Br dividing the
/// workgroup (and at least [`min_br`]), Bc a multiple of the invocations
/// per row.
fn check_tiles(form: CoopForm, br: u32, bc: u32, wg: u32) -> Result<()> {
    if br == 0 || bc == 0 {
        return Err(Error::EmptyTile {
            br,
            bc,
            threads_per_row: 1,
        });
    }
    let n = form.n();
    // Short-circuits before `wg / br` unless Br divides the workgroup.
    let fits = br.is_multiple_of(n)
        && wg.is_multiple_of(br)
        && bc.is_multiple_of(n)
        && bc.is_multiple_of(wg / br)
        && br >= min_br(form, wg);
    if fits {
        Ok(())
    } else {
        Err(Error::CoopTile {
            br,
            bc,
            n,
            workgroup: wg,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::caps::{CoopMatrixShapes, SubgroupSizes};
    use crate::plan::{plan_backward, plan_forward, PlanOverrides};

    fn device(kib: u32, f16: bool, sg: Option<(u32, u32)>, coop: CoopMatrixShapes) -> DeviceCaps {
        DeviceCaps {
            max_workgroup_storage: kib * 1024,
            max_invocations: 1024,
            max_workgroup_size_x: 1024,
            shader_f16: f16,
            lane_subgroup: None,
            hardware: true,
            subgroup: sg.map(|(min, max)| SubgroupSizes { min, max }),
            coop_matrix: coop,
        }
    }

    const HALF: CoopMatrixShapes = CoopMatrixShapes {
        f32_8x8: false,
        f16_16x16_f32: true,
        f16_16x16_f16: true,
    };
    const SINGLE: CoopMatrixShapes = CoopMatrixShapes {
        f32_8x8: true,
        f16_16x16_f32: false,
        f16_16x16_f16: false,
    };

    /// Vulkan on NVIDIA: 48 KiB, 32-wide subgroups, 16×16 f16 matrices.
    fn nvidia() -> DeviceCaps {
        device(48, true, Some((32, 32)), HALF)
    }
    /// Vulkan on AMD RDNA3: 64 KiB, wave32 or wave64, 16×16 f16 matrices.
    fn amd() -> DeviceCaps {
        device(64, true, Some((32, 64)), HALF)
    }
    /// Metal on Apple: 32 KiB, 32-wide simdgroups, 8×8 f32 matrices only.
    fn apple() -> DeviceCaps {
        device(32, true, Some((32, 32)), SINGLE)
    }
    /// Vulkan on Intel Arc: its matrices (8×16×16) are not square, so WGSL
    /// expresses none of them.
    fn intel() -> DeviceCaps {
        device(64, true, Some((8, 32)), CoopMatrixShapes::default())
    }
    fn lavapipe() -> DeviceCaps {
        DeviceCaps {
            lane_subgroup: Some(8),
            ..device(32, true, Some((8, 8)), CoopMatrixShapes::default())
        }
    }

    fn req(d: usize, precision: Precision) -> PlanRequest {
        PlanRequest::new(d, precision).seqlens(4096, 4096)
    }

    fn forced(mut r: PlanRequest) -> PlanRequest {
        r.overrides.kernel = Some(KernelFamily::Coop);
        r
    }

    #[test]
    fn coop_is_the_default_for_f16_and_bf16_where_the_device_has_it() {
        for (name, caps, form) in [
            ("nvidia", nvidia(), CoopForm::F16x16),
            ("amd", amd(), CoopForm::F16x16),
            ("apple", apple(), CoopForm::F32x8),
        ] {
            for precision in [Precision::F16, Precision::Bf16] {
                let p = plan_forward(&req(128, precision), &caps).unwrap();
                assert_eq!(p.plan.kernel, KernelFamily::Coop, "{name}: {p}");
                assert_eq!(p.plan.coop, Some(form), "{name}");
                let shown = p.to_string();
                assert!(shown.contains("kernel: coop: the device runs"), "{shown}");
                assert!(shown.contains("kernel: coop — Q·Kᵀ and P·V"), "{shown}");
            }
            // f32 runs the GPUs' registers kernels by default, and the plan says why.
            let p = plan_forward(&req(128, Precision::F32), &caps).unwrap();
            assert_eq!(p.plan.kernel, KernelFamily::Registers, "{name}");
            assert!(p.to_string().contains("registers, not coop"), "{p}");
            // The backward has no coop kernel: the registers ones run.
            let b = plan_backward(&req(128, Precision::F16), &caps).unwrap();
            assert_eq!(b.plan.kernel, KernelFamily::Registers, "{name}");
        }
        let webgpu = DeviceCaps::webgpu_default();
        for (name, caps) in [
            ("intel", intel()),
            ("webgpu", webgpu),
            ("lavapipe", lavapipe()),
        ] {
            let p = plan_forward(&req(64, Precision::F16), &caps).unwrap();
            assert_ne!(p.plan.kernel, KernelFamily::Coop, "{name}");
            assert_eq!(p.plan.coop, None, "{name}");
            assert!(!p.to_string().contains("coop"), "{name}: {p}");
        }
    }

    #[test]
    fn forcing_coop_without_what_it_needs_names_the_missing_piece() {
        let missing = |r: PlanRequest, caps: &DeviceCaps| match plan_forward(&r, caps) {
            Err(Error::CoopMatrixUnavailable { missing }) => missing,
            other => panic!("{other:?}"),
        };
        let f16 = forced(req(64, Precision::F16));
        for caps in [intel(), DeviceCaps::webgpu_default(), lavapipe()] {
            assert!(missing(f16, &caps).contains("EXPERIMENTAL_COOPERATIVE_MATRIX"));
        }
        assert!(missing(forced(req(64, Precision::F32)), &nvidia()).contains("8×8 f32"));
        let no_f16 = device(48, false, Some((32, 32)), HALF);
        assert!(missing(f16, &no_f16).contains("SHADER_F16"));
        let no_subgroups = device(48, true, None, HALF);
        assert!(missing(f16, &no_subgroups).contains("SUBGROUP"));
        let f16_acc_only = CoopMatrixShapes {
            f16_16x16_f16: true,
            ..Default::default()
        };
        let m = missing(f16, &device(48, true, Some((32, 32)), f16_acc_only));
        assert!(m.contains("f32 accumulators"), "{m}");
        // The backward asks the same question of a forced kernel.
        assert!(matches!(
            plan_backward(&f16, &intel()),
            Err(Error::CoopMatrixUnavailable { .. })
        ));
        // f32 runs on the 8×8 f32 form when forced; f16 takes it where it is the only one.
        let p = plan_forward(&forced(req(64, Precision::F32)), &apple()).unwrap();
        assert_eq!(p.plan.coop, Some(CoopForm::F32x8));
    }

    #[test]
    fn head_dims_past_256_stay_tiled_or_fail_when_forced() {
        let p = plan_forward(&req(288, Precision::F16), &nvidia()).unwrap();
        assert_eq!(p.plan.kernel, KernelFamily::Registers);
        assert!(p.to_string().contains("up to 256"), "{p}");
        let wide_v = forced(req(128, Precision::F16).head_dim_v(320));
        assert!(matches!(
            plan_forward(&wide_v, &nvidia()),
            Err(Error::CoopHeadDim {
                head_dim: 320,
                max: 256
            })
        ));
        // Every head dim up to 256 plans on NVIDIA's 48 KiB, odd ones padded.
        for d in [1, 3, 16, 59, 64, 111, 128, 192, 255, 256] {
            let p = plan_forward(&req(d, Precision::F16), &nvidia()).unwrap();
            assert_eq!(p.plan.kernel, KernelFamily::Coop, "d {d}");
        }
        // Apple's 32 KiB holds the f32 tiles up to d 192, not 256: the
        // registers kernels there.
        let p = plan_forward(&req(256, Precision::F16), &apple()).unwrap();
        assert_eq!(p.plan.kernel, KernelFamily::Registers, "{p}");
        assert!(plan_forward(&req(192, Precision::F16), &apple()).is_ok());
        assert!(matches!(
            plan_forward(&forced(req(256, Precision::F16)), &apple()),
            Err(Error::WorkgroupStorage { .. })
        ));
    }

    #[test]
    fn tiles_are_matrix_multiples_that_fit_the_workgroup_storage() {
        let p = plan_forward(&req(128, Precision::F16), &nvidia()).unwrap();
        let plan = p.plan;
        // 64×64 needs 90624 bytes; Bc then Br halve to 32×32 (39424).
        assert_eq!((plan.br, plan.bc), (32, 32), "{p}");
        assert_eq!((plan.workgroup_size, plan.threads_per_row), (128, 4));
        assert_eq!(
            plan.workgroup_bytes,
            coop_workgroup_bytes(CoopForm::F16x16, 32, 32, [128, 128], 128)
        );
        assert_eq!(plan.workgroup_bytes, 39424);
        assert!(p.clamps.iter().any(|c| c.reason.contains("49152 bytes")));
        for (name, caps) in [("nvidia", nvidia()), ("amd", amd()), ("apple", apple())] {
            for (d, dv) in [(16, 16), (64, 64), (59, 59), (192, 128), (40, 24)] {
                let r = req(d, Precision::F16).head_dim_v(dv);
                let plan = plan_forward(&r, &caps).unwrap().plan;
                let n = plan.coop.unwrap().n();
                assert!(plan.workgroup_bytes <= caps.max_workgroup_storage, "{name}");
                assert_eq!(plan.br % n, 0, "{name} d {d}");
                assert_eq!(plan.bc % n, 0, "{name} d {d}");
                assert_eq!(plan.br * plan.threads_per_row, plan.workgroup_size);
                assert_eq!(plan.bc % plan.threads_per_row, 0, "{name} d {d}");
                assert!(plan.threads_per_row <= n, "{name} d {d}");
            }
        }
        // Short sequences take the smallest tiles that cover them.
        let short = PlanRequest::new(64, Precision::F16).seqlens(5, 40);
        let plan = plan_forward(&short, &amd()).unwrap().plan;
        assert_eq!((plan.br, plan.bc), (16, 64));
    }

    #[test]
    fn tile_overrides_are_checked_and_keep_the_default_tiled() {
        let with = |ov: PlanOverrides| {
            forced(req(64, Precision::F16)).overrides(PlanOverrides {
                kernel: Some(KernelFamily::Coop),
                ..ov
            })
        };
        let ok = plan_forward(
            &with(PlanOverrides {
                br: Some(32),
                bc: Some(48),
                ..Default::default()
            }),
            &nvidia(),
        )
        .unwrap();
        assert_eq!(
            (ok.plan.br, ok.plan.bc, ok.plan.threads_per_row),
            (32, 48, 4)
        );
        for (br, bc) in [(24, 32), (48, 32), (32, 40), (256, 32)] {
            let r = with(PlanOverrides {
                br: Some(br),
                bc: Some(bc),
                ..Default::default()
            });
            assert!(
                matches!(
                    plan_forward(&r, &nvidia()),
                    Err(Error::CoopTile { n: 16, .. })
                ),
                "Br {br} Bc {bc}"
            );
        }
        let tc = with(PlanOverrides {
            threads_per_row: Some(2),
            ..Default::default()
        });
        assert!(matches!(
            plan_forward(&tc, &nvidia()),
            Err(Error::ThreadsOverrideOnCoop)
        ));
        // Fixed tiles without a forced kernel keep the GPUs' registers kernels.
        let fixed = req(64, Precision::F16).overrides(PlanOverrides {
            br: Some(32),
            ..Default::default()
        });
        assert_eq!(
            plan_forward(&fixed, &nvidia()).unwrap().plan.kernel,
            KernelFamily::Registers
        );
        // A workgroup storage cap, like any tile override, is not coop's
        // default; one too small for a forced coop's smallest tiles
        // is an error.
        let cap = |kernel| {
            req(64, Precision::F16).overrides(PlanOverrides {
                max_workgroup_storage: Some(4096),
                kernel,
                ..Default::default()
            })
        };
        assert_ne!(
            plan_forward(&cap(None), &nvidia()).unwrap().plan.kernel,
            KernelFamily::Coop
        );
        assert!(matches!(
            plan_forward(&cap(Some(KernelFamily::Coop)), &nvidia()),
            Err(Error::WorkgroupStorage { max: 4096, .. })
        ));
    }

    #[test]
    fn coop_is_a_kernel_name() {
        assert_eq!("coop".parse::<KernelFamily>().unwrap(), KernelFamily::Coop);
        assert_eq!(KernelFamily::Coop.name(), "coop");
        let e = "tensor".parse::<KernelFamily>().unwrap_err();
        assert!(
            e.to_string().contains("tiled, lanes, registers or coop"),
            "{e}"
        );
    }
}

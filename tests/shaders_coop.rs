//! The cooperative-matrix forward (`flash_fwd_coop.wgsl`), checked without
//! a device as wgpu's backends will check it: every variant × storage ×
//! head dim × matrix form, planned for made-up devices that have the form,
//! parses and validates with naga (overrides applied), really contains
//! cooperative-matrix operations, writes SPIR-V (validated by `spirv-val`
//! where the installed one knows SPV_KHR_cooperative_matrix) and, for the
//! 8×8 f32 form that Metal's simdgroup matrices have, MSL; its workgroup
//! storage equals the plan's.

mod naga_layout;
mod spirv_val;
use flashattn::kernels::compose::{LoopCheck, Variant};
use flashattn::kernels::{FlashForward, KernelKey};
use flashattn::plan::{plan_forward, PlanRequest};
use flashattn::plan::{CoopForm, CoopMatrixShapes, SubgroupSizes};
use flashattn::{DeviceCaps, KernelFamily, Plan, PlanOverrides};
use flashattn::{Precision, StorageKind};
use flashattn_testkit::Need;
use naga::back::pipeline_constants::process_overrides;
use naga::valid::{Capabilities, ModuleInfo, ValidationFlags, Validator};
use naga_layout::workgroup_bytes;

/// The Vulkan environment the coop modules are validated for.
const COOP_ENV: &str = "vulkan1.3";

/// A device with `coop` cooperative matrices, f16 and 32-wide subgroups.
fn coop_device(coop: CoopMatrixShapes, workgroup_storage: u32) -> DeviceCaps {
    DeviceCaps {
        max_workgroup_storage: workgroup_storage,
        max_invocations: 1024,
        max_workgroup_size_x: 1024,
        shader_f16: true,
        lane_subgroup: None,
        hardware: true,
        subgroup: Some(SubgroupSizes { min: 32, max: 32 }),
        coop_matrix: coop,
    }
}

/// NVIDIA-like (16×16 f16, 48 KiB) and Apple-like (8×8 f32, 32 KiB) devices,
/// with the precision that plans each form.
fn forms() -> [(CoopForm, DeviceCaps, Precision); 2] {
    let half = CoopMatrixShapes {
        f16_16x16_f32: true,
        f16_16x16_f16: true,
        ..Default::default()
    };
    let single = CoopMatrixShapes {
        f32_8x8: true,
        ..Default::default()
    };
    [
        (CoopForm::F16x16, coop_device(half, 49152), Precision::F16),
        // 48 KiB, so that head dim 256 fits the f32 tiles too.
        (CoopForm::F32x8, coop_device(single, 49152), Precision::F32),
    ]
}

const STORAGE: [StorageKind; 5] = [
    StorageKind::F32,
    StorageKind::F16Packed,
    StorageKind::F16Native,
    StorageKind::Bf16,
    StorageKind::Fp8,
];

/// (q/k, v) head dims: every multiple of 16 up to 256 (the f16 form's
/// steps; the 8×8 form's in between), odd ones the kernel pads, and v with
/// its own head dim.
fn head_dims() -> Vec<(usize, usize)> {
    let mut dims: Vec<(usize, usize)> = (1..=16).map(|k| (16 * k, 16 * k)).collect();
    dims.extend([(1, 1), (8, 8), (59, 59), (111, 111), (200, 200)]);
    dims.extend([(192, 128), (40, 24), (24, 60)]);
    dims
}

/// Mask, softcap, access counters, loop guard (`all`: every combination),
/// each with no layout or score term and with all of them (ALiBi, sinks,
/// packed batches, block masks with the per-pair test, dropout).
fn variants(all: bool) -> Vec<Variant> {
    let flags: Vec<u8> = if all { (0..16).collect() } else { vec![0, 15] };
    let mut out = Vec::new();
    for f in flags {
        let base = Variant {
            masked: f & 1 != 0,
            softcap: f & 2 != 0,
            count_io: f & 4 != 0,
            loop_check: if f & 8 != 0 {
                LoopCheck::Guard
            } else {
                LoopCheck::Off
            },
            ..Default::default()
        };
        out.push(base);
        out.push(Variant {
            alibi: true,
            sinks: true,
            varlen: true,
            sparse: true,
            partial: true,
            dropout: true,
            ..base
        });
        if all {
            out.push(Variant {
                alibi: true,
                ..base
            });
            out.push(Variant {
                sinks: true,
                ..base
            });
            out.push(Variant {
                varlen: true,
                ..base
            });
            out.push(Variant {
                sparse: true,
                ..base
            });
            out.push(Variant {
                dropout: true,
                ..base
            });
        }
    }
    out
}

/// The coop plan for `(d, dv)` on a device with `form`, the kernel forced.
fn coop_plan(caps: &DeviceCaps, precision: Precision, (d, dv): (usize, usize)) -> Plan {
    let req = PlanRequest::new(d, precision)
        .head_dim_v(dv)
        .overrides(PlanOverrides::default().kernel(KernelFamily::Coop));
    let planned = plan_forward(&req, caps).unwrap_or_else(|e| panic!("d {d} dv {dv}: {e}"));
    assert_eq!(planned.plan.kernel, KernelFamily::Coop);
    planned.plan
}

/// Every coop kernel: form × head dims × storage × variant.
fn coop_kernels(dims: &[(usize, usize)], all: bool) -> Vec<(String, FlashForward)> {
    let mut out = Vec::new();
    for (form, caps, precision) in forms() {
        for &dims in dims {
            let plan = coop_plan(&caps, precision, dims);
            assert_eq!(plan.coop, Some(form));
            for storage in STORAGE {
                for variant in variants(all) {
                    let plan = Plan { storage, ..plan };
                    let label = format!("{form:?} {dims:?} {storage:?} {variant:?}");
                    out.push((label, FlashForward { plan, variant }));
                }
            }
        }
    }
    out
}

fn capabilities(coop: bool) -> Capabilities {
    let mut features = wgpu::Features::SHADER_F16 | wgpu::Features::SUBGROUP;
    if coop {
        features |= wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
    }
    wgpu_naga_bridge::features_to_naga_capabilities(features, wgpu::DownlevelFlags::all())
}

/// Parsed, validated, overrides applied (and validated again).
fn compile(k: &FlashForward, coop: bool) -> Result<(naga::Module, ModuleInfo), String> {
    let src = KernelKey::from(*k).source();
    let module =
        naga::front::wgsl::parse_str(&src.text).map_err(|e| e.emit_to_string(&src.text))?;
    let info = Validator::new(ValidationFlags::all(), capabilities(coop))
        .validate(&module)
        .map_err(|e| e.emit_to_string(&src.text))?;
    let constants: naga::back::PipelineConstants = src
        .overrides
        .iter()
        .map(|(n, v)| (n.to_string(), *v))
        .collect();
    let stage = Some((naga::ShaderStage::Compute, src.entry));
    let (module, info) = process_overrides(&module, &info, stage, &constants)
        .map_err(|e| format!("overrides {constants:?}: {e}"))?;
    Ok((module.into_owned(), info.into_owned()))
}

/// Cooperative multiply-adds and stores in the entry point (S = Q·Kᵀ and
/// O += P·V: at least one each).
fn coop_ops(module: &naga::Module) -> (usize, usize) {
    let f = &module.entry_points[0].function;
    let mads = f
        .expressions
        .iter()
        .filter(|(_, e)| matches!(e, naga::Expression::CooperativeMultiplyAdd { .. }))
        .count();
    fn stores(block: &naga::Block) -> usize {
        block
            .iter()
            .map(|s| match s {
                naga::Statement::CooperativeStore { .. } => 1,
                naga::Statement::Block(b) => stores(b),
                naga::Statement::If { accept, reject, .. } => stores(accept) + stores(reject),
                naga::Statement::Loop {
                    body, continuing, ..
                } => stores(body) + stores(continuing),
                _ => 0,
            })
            .sum()
    }
    (mads, stores(&f.body))
}

/// SPIR-V opcodes of `words` (after the 5-word header) equal to `op`.
fn count_op(words: &[u32], op: u32) -> usize {
    let (mut at, mut n) = (5, 0);
    while at < words.len() {
        let len = (words[at] >> 16).max(1) as usize;
        n += ((words[at] & 0xffff) == op) as usize;
        at += len;
    }
    n
}

/// OpCooperativeMatrixMulAddKHR (SPV_KHR_cooperative_matrix).
const OP_COOP_MULADD: u32 = 4459;

fn spirv(module: &naga::Module, info: &ModuleInfo) -> Result<Vec<u32>, String> {
    let options = naga::back::spv::Options {
        lang_version: (1, 4),
        ..Default::default()
    };
    naga::back::spv::write_vec(module, info, &options, None).map_err(|e| format!("SPIR-V: {e}"))
}

/// Whether spirv-val can check cooperative-matrix SPIR-V: installed, and
/// recent enough to accept naga's SPIR-V of a minimal cooperative-matrix
/// module (FLASHATTN_REQUIRE_SPIRV_VAL=1 makes either shortfall fail;
/// scripts/spirv-val.sh installs one that knows the extension).
fn spirv_val_knows_coop() -> bool {
    if !spirv_val::available() {
        return false;
    }
    let probe = "enable wgpu_cooperative_matrix;\n\
        @group(0) @binding(0) var<storage, read_write> x: array<f32>;\n\
        @compute @workgroup_size(32) fn main() {\n\
          let a = coopLoadT<coop_mat8x8<f32, A>>(&x[0], 8u);\n\
          let b = coopLoadT<coop_mat8x8<f32, B>>(&x[64], 8u);\n\
          var c = coop_mat8x8<f32, C>();\n\
          coopStoreT(coopMultiplyAdd(a, b, c), &x[128], 8u);\n}\n";
    let module = naga::front::wgsl::parse_str(probe).unwrap();
    let info = Validator::new(ValidationFlags::all(), capabilities(true))
        .validate(&module)
        .unwrap();
    let words = spirv(&module, &info).unwrap();
    let knows = spirv_val::validate(&words, COOP_ENV).map_err(|e| {
        format!(
            "{} rejects a minimal cooperative-matrix module (too old for \
             SPV_KHR_cooperative_matrix?): {}",
            spirv_val::bin(),
            e.lines().next().unwrap_or("")
        )
    });
    flashattn_testkit::available(Need::SpirvValCoop, knows)
}

fn msl(module: &naga::Module, info: &ModuleInfo) -> Result<String, String> {
    let options = naga::back::msl::Options {
        lang_version: (2, 4),
        ..Default::default()
    };
    let pipeline = naga::back::msl::PipelineOptions {
        entry_point: Some((naga::ShaderStage::Compute, "main".to_string())),
        ..Default::default()
    };
    naga::back::msl::write_string(module, info, &options, &pipeline)
        .map(|(text, _)| text)
        .map_err(|e| format!("MSL: {e}"))
}

/// Every combination of the optional code on head dims with padding,
/// without, and with v's own.
#[test]
fn every_coop_variant_validates_with_cooperative_ops() {
    let kernels = coop_kernels(&[(59, 59), (40, 24)], true);
    for (label, k) in &kernels {
        let (module, _) = compile(k, true).unwrap_or_else(|e| panic!("{label}:\n{e}"));
        let (mads, stores) = coop_ops(&module);
        assert!(
            mads >= 2 && stores >= 2,
            "{label}: {mads} multiply-adds, {stores} stores"
        );
        assert_eq!(workgroup_bytes(&module), k.plan.workgroup_bytes, "{label}");
    }
    eprintln!("{} coop modules validated", kernels.len());
}

/// Every head dim and storage (base and all-terms variants): SPIR-V with
/// its cooperative multiply-adds (spirv-val where it can), MSL for 8×8 f32.
#[test]
fn every_coop_kernel_translates_to_spirv_and_msl() {
    let check_spirv = spirv_val_knows_coop();
    let kernels = coop_kernels(&head_dims(), false);
    let mut metal = 0;
    for (label, k) in &kernels {
        let (module, info) = compile(k, true).unwrap_or_else(|e| panic!("{label}:\n{e}"));
        assert_eq!(workgroup_bytes(&module), k.plan.workgroup_bytes, "{label}");
        let words = spirv(&module, &info).unwrap_or_else(|e| panic!("{label}: {e}"));
        assert!(
            count_op(&words, OP_COOP_MULADD) >= 2,
            "{label}: no OpCooperativeMatrixMulAddKHR"
        );
        if check_spirv {
            spirv_val::validate(&words, COOP_ENV)
                .unwrap_or_else(|e| panic!("{label}: spirv-val: {e}"));
        }
        // Metal's simdgroup matrices are 8×8: naga's MSL of the 16×16 form
        // names types Metal does not have, so only the 8×8 form is Metal's.
        if k.plan.coop == Some(CoopForm::F32x8) {
            let text = msl(&module, &info).unwrap_or_else(|e| panic!("{label}: {e}"));
            assert!(text.contains("simdgroup_multiply_accumulate"), "{label}");
            metal += 1;
        }
    }
    eprintln!(
        "{} coop modules to SPIR-V{}; {metal} to MSL",
        kernels.len(),
        if check_spirv {
            " (spirv-val: valid)"
        } else {
            ""
        }
    );
}

/// The check above can fail: without the capability naga rejects the
/// module, and the other kernels carry no cooperative operations.
#[test]
fn coop_modules_need_the_capability_and_others_lack_the_ops() {
    let (_, k) = &coop_kernels(&[(64, 64)], false)[0];
    let err = compile(k, false).expect_err("validated without COOPERATIVE_MATRIX");
    assert!(err.to_lowercase().contains("cooperative"), "{err}");
    let tiled = FlashForward {
        plan: Plan {
            kernel: KernelFamily::Tiled,
            coop: None,
            ..plan_forward(
                &PlanRequest::new(64, Precision::F32),
                &DeviceCaps::webgpu_default(),
            )
            .unwrap()
            .plan
        },
        variant: Variant::default(),
    };
    let (module, _) = compile(&tiled, true).unwrap();
    assert_eq!(coop_ops(&module), (0, 0));
}

/// Function-scope `var`s all have initializers (Tint zeroes one without
/// only once per loop; see tests/shaders.rs).
#[test]
fn coop_vars_are_initialized() {
    for (label, k) in coop_kernels(&[(64, 64)], false) {
        let text = KernelKey::from(k).source().text;
        let mut depth = 0i32;
        for line in text.lines() {
            let t = line.trim();
            let bare = t.starts_with("var ") && t.ends_with(';') && !t.contains('=');
            assert!(!(depth > 0 && bare), "{label}: {t}");
            depth += line.matches('{').count() as i32 - line.matches('}').count() as i32;
        }
    }
}

/// The emulated form (the coop kernel with its cooperative operations in
/// plain WGSL, for devices without them) validates without the capability,
/// carries none of the operations, and declares the 8×8 form's storage.
#[test]
fn emulated_coop_validates_without_the_capability() {
    let kernels = coop_kernels(&[(59, 59), (64, 64), (40, 24), (128, 128)], false);
    let mut n = 0;
    for (label, k) in kernels
        .iter()
        .filter(|(_, k)| k.plan.coop == Some(CoopForm::F32x8))
    {
        let k = FlashForward {
            plan: Plan {
                coop: Some(CoopForm::Emulated),
                ..k.plan
            },
            ..*k
        };
        let text = KernelKey::from(k).source().text;
        assert!(
            !text.contains("coopLoad") && !text.contains("coopStore"),
            "{label}"
        );
        assert!(text.contains("emu_mad("), "{label}");
        let (module, _) = compile(&k, false).unwrap_or_else(|e| panic!("{label}:\n{e}"));
        assert_eq!(coop_ops(&module), (0, 0), "{label}");
        assert_eq!(workgroup_bytes(&module), k.plan.workgroup_bytes, "{label}");
        n += 1;
    }
    assert!(n > 0);
}

//! Every kernel flashattn composes is checked here, without a device, the
//! way wgpu's backends will check it: naga parses and validates the WGSL,
//! applies the pipeline's override values, and translates the result to
//! SPIR-V (Vulkan; validated by `spirv-val`, see tests/spirv_val), MSL (Metal),
//! HLSL (DX12) and GLSL (GL). Also: the workgroup storage each module
//! declares equals its plan's, the uniform structs equal their Rust twins
//! member by member, and every function-scope `var` is initialized.

mod naga_layout;
mod spirv_val;
use flashattn::kernels::compose::{LoopCheck, Variant};
use flashattn::kernels::{
    BackwardPart, BufferCopy, CopyParams, DecodeMerge, DecodeParams, Epilogue, FlashBackward,
    FlashDecode, FlashForward, Fp8Quantize, KernelKey, KernelSource, KvAppend, LoopProbe, Matmul,
    MatmulForm, MatmulParams, Naive, NaiveEntry, Params, QuantParams, QuantPass, Uniform,
};
use flashattn::plan::decode::decode_tiles;
use flashattn::plan::DecodeRequest;
use flashattn::plan::SubgroupSizes;
use flashattn::plan::{plan_backward, plan_forward, PlanRequest};
use flashattn::{
    CacheQuant, DeviceCaps, KernelFamily, Plan, PlanOverrides, Precision, StorageKind,
};
use flashattn_testkit::full_matrix;
use naga::back::pipeline_constants::process_overrides;
use naga::valid::{Capabilities, ModuleInfo, ValidationFlags, Validator};
use naga_layout::workgroup_bytes;

/// A kernel with what it needs of the device.
struct Kernel {
    label: String,
    key: KernelKey,
    f16: bool,
    subgroups: bool,
}

fn capabilities(f16: bool, subgroups: bool) -> Capabilities {
    let mut features = wgpu::Features::empty();
    if f16 {
        features |= wgpu::Features::SHADER_F16;
    }
    if subgroups {
        features |= wgpu::Features::SUBGROUP;
    }
    wgpu_naga_bridge::features_to_naga_capabilities(features, wgpu::DownlevelFlags::all())
}

/// The module as a pipeline sees it: parsed, validated, overrides applied
/// (and validated again).
fn compile(k: &Kernel) -> Result<(naga::Module, ModuleInfo), String> {
    let src = k.key.source();
    let module =
        naga::front::wgsl::parse_str(&src.text).map_err(|e| e.emit_to_string(&src.text))?;
    let mut validator = Validator::new(ValidationFlags::all(), capabilities(k.f16, k.subgroups));
    let info = validator
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

/// The variant whose optional pieces are the bits of `f`: mask, softcap,
/// access counters, loop guard, then ALiBi, sinks, packed batches, block
/// masks, dropout (the last five only the flash kernels have, and dropout
/// the naive ones too).
fn variant_of(f: u32) -> Variant {
    Variant {
        masked: f & 1 != 0,
        softcap: f & 2 != 0,
        count_io: f & 4 != 0,
        loop_check: if f & 8 != 0 {
            LoopCheck::Guard
        } else {
            LoopCheck::Off
        },
        alibi: f & 16 != 0,
        sinks: f & 32 != 0,
        varlen: f & 64 != 0,
        sparse: f & 128 != 0,
        dropout: f & 256 != 0,
        ..Default::default()
    }
}

fn variants(all: bool) -> Vec<Variant> {
    let flags: Vec<u32> = if all { (0..16).collect() } else { vec![0, 15] };
    flags.into_iter().map(variant_of).collect()
}

/// The naive kernels' variants: [`variants`], each with and without dropout.
fn naive_variants(all: bool) -> Vec<Variant> {
    variants(all)
        .into_iter()
        .flat_map(|v| [v, Variant { dropout: true, ..v }])
        .collect()
}

/// Rows of `flags` bits such that any `STRENGTH` of the bits take each of
/// their 2^STRENGTH settings in some row (a covering array): all off and
/// all on, then greedily the row covering most of what is still uncovered
/// (the first on a tie, so the set is the same on every run).
fn covering_rows(flags: usize) -> Vec<u32> {
    const STRENGTH: usize = 3;
    let mut sets: Vec<Vec<usize>> = vec![vec![]];
    for _ in 0..STRENGTH {
        sets = sets
            .into_iter()
            .flat_map(|s| {
                let from = s.last().map_or(0, |l| l + 1);
                (from..flags).map(move |f| [s.clone(), vec![f]].concat())
            })
            .collect();
    }
    let settings = |row: u32| -> Vec<(usize, u32)> {
        sets.iter()
            .enumerate()
            .map(|(i, s)| {
                let bits = s.iter().enumerate().map(|(b, &f)| (row >> f & 1) << b);
                (i, bits.sum())
            })
            .collect()
    };
    let mut uncovered: std::collections::HashSet<(usize, u32)> = (0..sets.len())
        .flat_map(|i| (0..1u32 << STRENGTH).map(move |v| (i, v)))
        .collect();
    let mut rows = Vec::new();
    let mut take = |row: u32, uncovered: &mut std::collections::HashSet<(usize, u32)>| {
        for s in settings(row) {
            uncovered.remove(&s);
        }
        rows.push(row);
    };
    take(0, &mut uncovered);
    take((1 << flags) - 1, &mut uncovered);
    while !uncovered.is_empty() {
        let best = (0..1u32 << flags)
            .max_by_key(|&r| {
                let new = settings(r).iter().filter(|s| uncovered.contains(s)).count();
                (new, std::cmp::Reverse(r))
            })
            .unwrap();
        take(best, &mut uncovered);
    }
    rows
}

/// The flash kernels' variants. Without `all`: [`variants`] with no layout
/// or score term and with every one (ALiBi, sinks, packed batches, block
/// masks, dropout). With `all`: rows of a covering array over the nine
/// optional pieces (mask, softcap, access counters, loop guard, ALiBi,
/// sinks, packed batches, block masks, dropout), so that every three of
/// them meet in each of their settings (all 512 combinations cost minutes
/// of CI for little more).
fn flash_variants(all: bool) -> Vec<Variant> {
    if !all {
        let every = |v: Variant| Variant {
            alibi: true,
            sinks: true,
            varlen: true,
            sparse: true,
            dropout: true,
            ..v
        };
        return variants(false)
            .into_iter()
            .flat_map(|v| [v, every(v)])
            .collect();
    }
    covering_rows(9).into_iter().map(variant_of).collect()
}

#[test]
fn the_covering_rows_meet_every_three_flags_in_every_setting() {
    let rows = covering_rows(9);
    for a in 0..9 {
        for b in a + 1..9 {
            for c in b + 1..9 {
                for v in 0..8u32 {
                    assert!(
                        rows.iter()
                            .any(|r| (r >> a & 1) | (r >> b & 1) << 1 | (r >> c & 1) << 2 == v),
                        "flags {a} {b} {c} never {v:03b}"
                    );
                }
            }
        }
    }
    assert!(rows.len() <= 20, "{} rows", rows.len());
    assert_eq!(rows[..2], [0, 511]);
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
        subgroup: None,
        coop_matrix: Default::default(),
        hardware: false,
    }
}

fn device_caps() -> Vec<DeviceCaps> {
    let big = DeviceCaps {
        max_workgroup_storage: 49152,
        ..lavapipe_like(None)
    };
    let mut caps = vec![DeviceCaps::webgpu_default(), lavapipe_like(None), big];
    caps.extend(flashattn::plan::LANE_SUBGROUPS.map(|sg| lavapipe_like(Some(sg))));
    caps
}

const STORAGE: [StorageKind; 4] = [
    StorageKind::F32,
    StorageKind::F16Packed,
    StorageKind::F16Native,
    StorageKind::Bf16,
];

/// Head dims every kernel is composed for.
const HEAD_DIMS: [usize; 11] = [1, 3, 4, 16, 59, 60, 64, 111, 128, 256, 512];

/// (q/k, v) head dims the flash kernels are composed for: every head dim
/// with v's alike, and v with a head dim of its own (MLA's 192/128, small
/// odd pairs both ways).
const FLASH_DIMS: [(usize, usize); 16] = [
    (1, 1),
    (3, 3),
    (4, 4),
    (16, 16),
    (59, 59),
    (60, 60),
    (64, 64),
    (111, 111),
    (128, 128),
    (256, 256),
    (288, 288),
    (512, 512),
    (576, 512),
    (192, 128),
    (40, 24),
    (24, 60),
];

/// The (q/k, v) head dims the registers kernels are composed for: tiny, odd,
/// vec4-aligned, the widest, and v's own both ways.
const REGISTER_DIMS: [(usize, usize); 9] = [
    (1, 1),
    (3, 3),
    (59, 59),
    (64, 64),
    (128, 128),
    (512, 512),
    (576, 512),
    (192, 128),
    (24, 60),
];

/// GPU-like devices, where the planner picks the registers kernels: NVIDIA
/// (48 KiB, 32 lanes: subgroup reductions) and a GPU with the WebGPU
/// defaults and no subgroups (workgroup-memory reductions, small tiles).
fn gpu_caps() -> Vec<DeviceCaps> {
    let gpu = |kib: u32, subgroup: Option<(u32, u32)>| DeviceCaps {
        max_workgroup_storage: kib * 1024,
        subgroup: subgroup.map(|(min, max)| SubgroupSizes { min, max }),
        hardware: true,
        ..lavapipe_like(None)
    };
    vec![
        gpu(48, Some((32, 32))),
        DeviceCaps {
            hardware: true,
            ..DeviceCaps::webgpu_default()
        },
    ]
}

/// The registers kernels' own settings beyond the planner's defaults:
/// one and two rows per invocation, workgroup-memory reductions, one
/// K/V buffer, and lavapipe-like subgroups of 8 forced on.
fn register_settings() -> Vec<PlanOverrides> {
    let base = PlanOverrides::default().kernel(KernelFamily::Registers);
    vec![
        base.rows_per_thread(1),
        base.rows_per_thread(2)
            .subgroup_reduce(false)
            .double_buffer(false),
    ]
}

/// The plans (forward and backward) for `dims` on every device.
fn plans(dims: &[(usize, usize)]) -> Vec<(String, Plan, Plan)> {
    let mut out = Vec::new();
    for (c, caps) in gpu_caps().into_iter().enumerate() {
        for &(d, dv) in dims.iter().filter(|&&dims| REGISTER_DIMS.contains(&dims)) {
            // Each plan adds a kernel per storage and variant: the defaults
            // on the first device at every head dim, the forced settings and
            // the second device (small tiles, no subgroups) at the head dims
            // where their code differs most (odd, aligned, widest, dv ≠ d).
            let edge = [(3, 3), (64, 64), (512, 512), (24, 60)].contains(&(d, dv));
            if c > 0 && !edge {
                continue;
            }
            let mut requests = vec![PlanOverrides::default()];
            if c == 0 && edge {
                requests.extend(register_settings());
            }
            for (i, overrides) in requests.into_iter().enumerate() {
                let req = PlanRequest::new(d, Precision::F32)
                    .head_dim_v(dv)
                    .overrides(overrides);
                // The defaults always plan; a forced setting may not fit.
                let planned =
                    plan_forward(&req, &caps).and_then(|f| Ok((f, plan_backward(&req, &caps)?)));
                let (fwd, bwd) = match planned {
                    Ok((f, b)) => (f.plan, b.plan),
                    Err(e) if i > 0 => {
                        eprintln!("registers {overrides:?} d {d} dv {dv}: {e}");
                        continue;
                    }
                    Err(e) => panic!("d {d} dv {dv} on {caps:?}: {e}"),
                };
                assert_eq!(fwd.kernel, KernelFamily::Registers);
                let label = format!(
                    "registers M {} sg {:?} d {d} dv {dv} {overrides:?}",
                    caps.max_workgroup_storage, caps.subgroup
                );
                out.push((label, fwd, bwd));
            }
        }
    }
    for caps in device_caps() {
        for &(d, dv) in dims {
            let req = PlanRequest::new(d, Precision::F32).head_dim_v(dv);
            let fwd = plan_forward(&req, &caps).unwrap().plan;
            let bwd = plan_backward(&req, &caps).unwrap().plan;
            let lanes = fwd.kernel == KernelFamily::Lanes;
            let lanes_dim = |d: usize| d.is_multiple_of(4) && d <= 128;
            assert_eq!(
                lanes,
                caps.lane_subgroup.is_some() && lanes_dim(d) && lanes_dim(dv)
            );
            let label = format!(
                "M {} sg {:?} d {d} dv {dv}",
                caps.max_workgroup_storage, caps.lane_subgroup
            );
            out.push((label, fwd, bwd));
        }
    }
    out
}

/// The flash kernels: each plan × storage × variant.
fn flash_kernels(dims: &[(usize, usize)], all_variants: bool) -> Vec<Kernel> {
    let mut out = Vec::new();
    for (label, fwd, bwd) in plans(dims) {
        for storage in STORAGE {
            let (fwd, bwd) = (Plan { storage, ..fwd }, Plan { storage, ..bwd });
            let f16 = storage == StorageKind::F16Native;
            let subgroups = fwd.kernel == KernelFamily::Lanes || fwd.subgroup_reduce;
            for variant in flash_variants(all_variants) {
                let mut keys = vec![KernelKey::from(FlashForward { plan: fwd, variant })];
                let sinks = [BackwardPart::SinkPartials, BackwardPart::SinkReduce];
                let parts = [BackwardPart::Dvec, BackwardPart::DkDv, BackwardPart::Dq];
                let with_sinks = variant.sinks.then_some(sinks).into_iter().flatten();
                for part in parts.into_iter().chain(with_sinks) {
                    keys.push(FlashBackward::new(part, bwd, variant).into());
                }
                for key in keys {
                    let label = format!("{} {label} {storage:?} {variant:?}", key.name());
                    out.push(Kernel {
                        label,
                        key,
                        f16,
                        subgroups,
                    });
                }
            }
        }
    }
    out
}

/// The matmul in every form, storage and epilogue; the naive kernels; the
/// copy; the probe.
fn other_kernels(all_variants: bool) -> Vec<Kernel> {
    let mut out = Vec::new();
    let forms = [
        MatmulForm::Tiled { aligned: false },
        MatmulForm::Tiled { aligned: true },
        MatmulForm::Lanes {
            lanes: 8,
            chunks: 16,
            rows: 2,
        },
        MatmulForm::Lanes {
            lanes: 4,
            chunks: 1,
            rows: 1,
        },
    ];
    for storage in STORAGE {
        let f16 = storage == StorageKind::F16Native;
        for form in forms {
            let subgroups = matches!(form, MatmulForm::Lanes { .. });
            for b_trans in [false, true] {
                for (epilogue, variant) in [
                    (Epilogue::Scale, Variant::default()),
                    (Epilogue::Scores, variants(false)[1]),
                ] {
                    for abc in [
                        [storage, storage, StorageKind::F32],
                        [StorageKind::F32, storage, storage],
                    ] {
                        // The lanes dot form stores f32 C only (the planner never asks otherwise).
                        if subgroups && b_trans && abc[2] != StorageKind::F32 {
                            continue;
                        }
                        let key = KernelKey::from(Matmul {
                            storage: abc,
                            b_trans,
                            form,
                            epilogue,
                            variant,
                        });
                        let label = format!("matmul {abc:?} {form:?} bT {b_trans} {epilogue:?}");
                        out.push(Kernel {
                            label,
                            key,
                            f16,
                            subgroups,
                        });
                    }
                }
            }
        }
        for d in [1, 59, 64, 256] {
            for entry in [
                NaiveEntry::Softmax,
                NaiveEntry::Ds,
                NaiveEntry::TransposeP,
                NaiveEntry::TransposeDs,
                NaiveEntry::DkDv,
            ] {
                for variant in naive_variants(all_variants) {
                    let key = KernelKey::from(Naive {
                        entry,
                        head_dim: d,
                        head_dim_v: d,
                        storage,
                        variant,
                    });
                    let label = format!("naive {entry:?} d {d} {storage:?} {variant:?}");
                    out.push(Kernel {
                        label,
                        key,
                        f16,
                        subgroups: false,
                    });
                }
            }
        }
    }
    for variant in variants(all_variants) {
        for rows in [false, true] {
            out.push(Kernel {
                label: format!("copy rows {rows} {variant:?}"),
                key: BufferCopy { variant, rows }.into(),
                f16: false,
                subgroups: false,
            });
        }
    }
    out.push(Kernel {
        label: "loop probe".into(),
        key: LoopProbe.into(),
        f16: false,
        subgroups: false,
    });
    out
}

/// The decode kernels: the split-KV attention for the tiles the planner
/// gives packed groups of 1, 4 and 16 rows on every device, both forms
/// (partials or final), with and without ALiBi and sinks (the score terms
/// decoding takes beside the band); the append and the merge. `dims` are
/// `(d, dv)` pairs.
fn decode_kernels(dims: &[(usize, usize)], all_variants: bool) -> Vec<Kernel> {
    let mut out = Vec::new();
    let score_terms: &[u32] = if all_variants {
        &[16, 32, 16 | 32 | 1]
    } else {
        &[16 | 32 | 15]
    };
    let decode_variants: Vec<Variant> = variants(all_variants)
        .into_iter()
        .chain(score_terms.iter().map(|&f| variant_of(f)))
        .collect();
    for storage in STORAGE {
        let f16 = storage == StorageKind::F16Native;
        let precision = storage.precision();
        for &(d, dv) in dims {
            for &variant in &decode_variants {
                // Plain caches, and (on the first variant) int8 and FP8 ones.
                let quants: &[Option<CacheQuant>] = if variant == decode_variants[0] {
                    &[None, Some(CacheQuant::Int8), Some(CacheQuant::Fp8)]
                } else {
                    &[None]
                };
                let mut keys: Vec<KernelKey> = quants
                    .iter()
                    .map(|&quant| {
                        KvAppend {
                            storage,
                            head_dim: d as u32,
                            head_dim_v: dv as u32,
                            quant,
                            variant,
                        }
                        .into()
                    })
                    .collect();
                keys.push(
                    DecodeMerge {
                        storage,
                        head_dim_v: dv as u32,
                        variant,
                    }
                    .into(),
                );
                for (caps, rows) in device_caps()
                    .into_iter()
                    .zip([1, 4, 16].into_iter().cycle())
                {
                    let req = DecodeRequest {
                        batch: 1,
                        seqlen_q: 1,
                        heads_q: rows,
                        heads_kv: 1,
                        head_dim: d,
                        head_dim_v: dv,
                        max_seqlen_k: 100,
                        precision,
                        num_splits: None,
                        f16_native: Some(f16),
                        kernel: None,
                    };
                    let Ok(tiles) = decode_tiles(&req, &caps) else {
                        continue;
                    };
                    for partial in [false, true] {
                        for &quant in quants {
                            keys.push(
                                FlashDecode {
                                    tiles,
                                    partial,
                                    quant,
                                    variant,
                                }
                                .into(),
                            );
                        }
                    }
                }
                for key in keys {
                    let label = format!("{} d {d}/{dv} {storage:?} {key:?}", key.name());
                    let subgroups = matches!(
                        key,
                        KernelKey::FlashDecode(f) if f.tiles.kernel == KernelFamily::Lanes
                    );
                    out.push(Kernel {
                        label,
                        key,
                        f16,
                        subgroups,
                    });
                }
            }
        }
    }
    out
}

/// The FP8 forward (its plans: the stored row, a multiple of 4, in f32
/// tiles; FP8 storage) and the quantization kernels, plain and through the
/// Hadamard transform, for `head_dims`.
fn fp8_kernels(head_dims: &[usize], all_variants: bool) -> Vec<Kernel> {
    let mut out = Vec::new();
    let stored: Vec<(usize, usize)> = head_dims
        .iter()
        .map(|&d| (d.next_multiple_of(4), d.next_multiple_of(4)))
        .collect();
    for (label, fwd, _) in plans(&stored) {
        let plan = Plan {
            storage: StorageKind::Fp8,
            ..fwd
        };
        for variant in variants(all_variants) {
            out.push(Kernel {
                label: format!("fp8 forward {label} {variant:?}"),
                key: FlashForward { plan, variant }.into(),
                f16: false,
                subgroups: plan.kernel == KernelFamily::Lanes || plan.subgroup_reduce,
            });
        }
    }
    for &d in head_dims {
        for hadamard in [false, true] {
            for pass in [QuantPass::Absmax, QuantPass::Scales, QuantPass::Codes] {
                for variant in variants(all_variants) {
                    let key = Fp8Quantize {
                        pass,
                        head_dim: d as u32,
                        hadamard,
                        variant,
                    };
                    out.push(Kernel {
                        label: format!("{key:?}"),
                        key: key.into(),
                        f16: false,
                        subgroups: false,
                    });
                }
            }
        }
    }
    out
}

/// Every kernel: each plan, storage and head dim, with no optional code and
/// with all of it.
fn all_kernels() -> Vec<Kernel> {
    let mut k = flash_kernels(&FLASH_DIMS, false);
    k.extend(other_kernels(false));
    k.extend(decode_kernels(&decode_dims(), false));
    k.extend(fp8_kernels(&HEAD_DIMS, false));
    k
}

/// The decode kernels' head dims: each of [`HEAD_DIMS`] for k and v, and v
/// head dims of their own (narrower, wider, odd, MLA's 512 under 192 and
/// its latent cache's 512 under 576).
fn decode_dims() -> Vec<(usize, usize)> {
    let own_v = [(64, 32), (48, 128), (59, 37), (192, 512), (576, 512)];
    HEAD_DIMS.iter().map(|&d| (d, d)).chain(own_v).collect()
}

/// The optional code in combination — every combination of mask, softcap,
/// access counters and loop guard in the other kernels, a covering array
/// of those and the layouts in the flash kernels ([`flash_variants`]) — on
/// the head dims that exercise partial tiles and full ones.
#[test]
fn every_variant_validates_with_its_overrides() {
    let mut kernels = flash_kernels(&[(59, 59), (64, 64), (40, 24)], true);
    kernels.extend(other_kernels(true));
    kernels.extend(decode_kernels(&[(59, 59), (64, 64), (64, 36)], true));
    kernels.extend(fp8_kernels(&[59, 64], true));
    for k in &kernels {
        compile(k).unwrap_or_else(|e| panic!("{}:\n{e}", k.label));
        let src = k.key.source();
        assert!(
            !src.text.contains('$'),
            "{}: unexpanded template line",
            k.label
        );
    }
}

/// The aliased form of a kernel (an app's outputs in its inputs' buffer)
/// is a key of its own whose tensors are all `read_write`, while the
/// engine's own tables stay read-only; it validates like the ordinary form
/// (checked here for a forward with every side table, its backward's dK/dV
/// and one quantization pass).
#[test]
fn the_aliased_form_declares_tensors_writable_and_validates() {
    let caps = lavapipe_like(None);
    let req = PlanRequest::new(64, Precision::F32);
    let (fwd, bwd) = (
        plan_forward(&req, &caps).unwrap().plan,
        plan_backward(&req, &caps).unwrap().plan,
    );
    let plain = flash_variants(false)[1];
    assert!(plain.sparse && !plain.aliased);
    let quant = |variant| Fp8Quantize {
        pass: QuantPass::Codes,
        head_dim: 59,
        hadamard: true,
        variant,
    };
    let keys = |variant| -> [KernelKey; 3] {
        [
            FlashForward { plan: fwd, variant }.into(),
            FlashBackward::new(BackwardPart::DkDv, bwd, variant).into(),
            quant(variant).into(),
        ]
    };
    let aliased = Variant {
        aliased: true,
        ..plain
    };
    for (ordinary, key) in keys(plain).into_iter().zip(keys(aliased)) {
        assert_ne!(ordinary, key);
        let (before, after) = (ordinary.source().text, key.source().text);
        let read_only = |t: &str| t.matches("var<storage, read> ").count();
        let writable = |t: &str| t.matches("var<storage, read_write> ").count();
        let tensors = before.matches("var<storage, read> ").count()
            - after.matches("var<storage, read> ").count();
        assert!(tensors >= 1, "{}: no tensor turned writable", key.name());
        assert_eq!(writable(&after), writable(&before) + tensors);
        assert_eq!(read_only(&after), read_only(&before) - tensors);
        for line in after.lines().filter(|l| l.contains("var<storage, read> ")) {
            assert!(!line.contains("_buf:"), "{}: {line}", key.name());
        }
        let kernel = Kernel {
            label: key.name().to_string(),
            key,
            f16: false,
            subgroups: fwd.kernel == KernelFamily::Lanes || fwd.subgroup_reduce,
        };
        compile(&kernel).unwrap_or_else(|e| panic!("{}:\n{e}", kernel.label));
    }
}

/// SPIR-V, MSL, HLSL and GLSL of one module; GLSL only where wgpu's GL
/// backend could run it (it offers neither SHADER_F16 nor SUBGROUP).
fn translate(
    k: &Kernel,
    module: &naga::Module,
    info: &ModuleInfo,
    check_spirv: bool,
) -> Result<(), String> {
    let entry = k.key.source().entry.to_string();
    let stage = (naga::ShaderStage::Compute, entry.clone());
    let spv_options = naga::back::spv::Options {
        lang_version: (1, 3),
        ..Default::default()
    };
    let spv = naga::back::spv::write_vec(module, info, &spv_options, None)
        .map_err(|e| format!("SPIR-V: {e}"))?;
    if check_spirv {
        spirv_val::validate(&spv, "vulkan1.1").map_err(|e| format!("spirv-val: {e}"))?;
    }
    let msl_options = naga::back::msl::Options {
        lang_version: (2, 4),
        ..Default::default()
    };
    let msl_pipeline = naga::back::msl::PipelineOptions {
        entry_point: Some(stage.clone()),
        ..Default::default()
    };
    naga::back::msl::write_string(module, info, &msl_options, &msl_pipeline)
        .map_err(|e| format!("MSL: {e}"))?;
    let hlsl_options = naga::back::hlsl::Options {
        shader_model: naga::back::hlsl::ShaderModel::V6_2,
        ..Default::default()
    };
    let hlsl_pipeline = naga::back::hlsl::PipelineOptions {
        entry_point: Some(stage),
    };
    let mut hlsl = String::new();
    naga::back::hlsl::Writer::new(&mut hlsl, &hlsl_options, &hlsl_pipeline)
        .write(module, info, None)
        .map_err(|e| format!("HLSL: {e}"))?;
    if !k.f16 && !k.subgroups {
        let glsl_options = naga::back::glsl::Options {
            version: naga::back::glsl::Version::Desktop(430),
            ..Default::default()
        };
        let glsl_pipeline = naga::back::glsl::PipelineOptions {
            shader_stage: naga::ShaderStage::Compute,
            entry_point: entry,
            multiview: None,
        };
        let mut glsl = String::new();
        let policies = naga::proc::BoundsCheckPolicies::default();
        naga::back::glsl::Writer::new(
            &mut glsl,
            module,
            info,
            &glsl_options,
            &glsl_pipeline,
            policies,
        )
        .and_then(|mut w| w.write())
        .map_err(|e| format!("GLSL: {e}"))?;
    }
    Ok(())
}

/// The workgroup storage a flash module must declare: its plan's.
fn planned_workgroup_bytes(k: &Kernel) -> Option<u32> {
    match k.key {
        KernelKey::FlashForward(f) => Some(f.plan.workgroup_bytes),
        // D = rowsum(dO·O) and the sinks' sums keep nothing on chip.
        KernelKey::FlashBackward(b) => {
            if matches!(b.part, BackwardPart::Dvec | BackwardPart::SinkReduce) {
                assert_eq!(b.workgroup_bytes(), 0, "{}", k.label);
            }
            Some(b.workgroup_bytes())
        }
        _ => None,
    }
}

/// Every kernel translates, and each flash kernel (the FP8 forward too)
/// declares the workgroup storage its plan has: one parse per module for
/// both checks, spread over the cores.
#[test]
fn every_kernel_translates_to_spirv_msl_hlsl_and_glsl() {
    let check_spirv = spirv_val::available();
    let kernels = all_kernels();
    // spirv-val (a process per module) once per distinct WGSL source and
    // capability set, where the generated code differs; the head dims that
    // reach a source only through its override values are translated by
    // naga but not validated again, unless FLASHATTN_FULL_MATRIX=1.
    let validated = std::sync::Mutex::new(std::collections::HashSet::new());
    let check = |k: &Kernel| -> Result<(), String> {
        let (module, info) = compile(k)?;
        if let Some(expected) = planned_workgroup_bytes(k) {
            let declared = workgroup_bytes(&module);
            if declared != expected {
                return Err(format!(
                    "declares {declared} B of workgroup storage, plans {expected}"
                ));
            }
        }
        let first = validated
            .lock()
            .unwrap()
            .insert((k.key.source().text, k.f16, k.subgroups));
        translate(k, &module, &info, check_spirv && (first || full_matrix()))
    };
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let failures: Vec<String> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let (kernels, check) = (&kernels, &check);
                s.spawn(move || {
                    kernels
                        .iter()
                        .skip(t)
                        .step_by(threads)
                        .filter_map(|k| check(k).err().map(|e| format!("{}:\n{e}", k.label)))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        workers
            .into_iter()
            .flat_map(|w| w.join().unwrap())
            .collect()
    });
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    let glsl = kernels.iter().filter(|k| !k.f16 && !k.subgroups).count();
    let sources = validated.lock().unwrap().len();
    eprintln!(
        "{} modules to SPIR-V{}, MSL and HLSL; {glsl} to GLSL",
        kernels.len(),
        if check_spirv {
            format!(" ({sources} distinct sources through spirv-val: valid)")
        } else {
            String::new()
        }
    );
}

#[test]
fn decode_workgroup_storage_matches_the_plan() {
    for k in decode_kernels(&decode_dims(), false) {
        let (module, _) = compile(&k).unwrap();
        let expected = match k.key {
            KernelKey::FlashDecode(f) => f.tiles.workgroup_bytes,
            KernelKey::DecodeMerge(_) => 4 * flashattn::plan::decode::MAX_SPLITS as u32,
            KernelKey::KvAppend(a) => a.workgroup_bytes(),
            _ => 0,
        };
        assert_eq!(workgroup_bytes(&module), expected, "{}", k.label);
    }
}

/// The WGSL struct `T::WGSL_NAME` in `source`, laid out by naga, must have
/// exactly `T::FIELDS` (names and offsets) and `T`'s size.
fn assert_layout<T: Uniform>(source: &KernelSource) {
    let module = naga::front::wgsl::parse_str(&source.text).unwrap();
    let mut layouter = naga::proc::Layouter::default();
    layouter.update(module.to_ctx()).unwrap();
    let (handle, ty) = module
        .types
        .iter()
        .find(|(_, t)| t.name.as_deref() == Some(T::WGSL_NAME))
        .unwrap_or_else(|| panic!("no struct {} in the module", T::WGSL_NAME));
    let naga::TypeInner::Struct { members, span } = &ty.inner else {
        panic!("{} is not a struct", T::WGSL_NAME);
    };
    let wgsl: Vec<(String, usize)> = members
        .iter()
        .map(|m| (m.name.clone().unwrap_or_default(), m.offset as usize))
        .collect();
    let rust: Vec<(String, usize)> = T::FIELDS.iter().map(|(n, o)| (n.to_string(), *o)).collect();
    assert_eq!(wgsl, rust, "{} members", T::WGSL_NAME);
    assert_eq!(
        *span as usize,
        std::mem::size_of::<T>(),
        "{} size",
        T::WGSL_NAME
    );
    assert_eq!(layouter[handle].size, *span);
}

#[test]
fn uniform_structs_match_their_wgsl_twins() {
    let (_, fwd, _) = plans(&[(64, 64)]).remove(0);
    let forward = FlashForward {
        plan: fwd,
        variant: Variant::default(),
    };
    assert_layout::<Params>(&forward.source());
    let matmul = Matmul {
        storage: [StorageKind::F32; 3],
        b_trans: true,
        form: MatmulForm::Tiled { aligned: false },
        epilogue: Epilogue::Scores,
        variant: Variant::default(),
    };
    assert_layout::<MatmulParams>(&matmul.source());
    assert_layout::<Params>(&matmul.source());
    let merge = DecodeMerge {
        storage: StorageKind::F32,
        head_dim_v: 64,
        variant: Variant::default(),
    };
    assert_layout::<DecodeParams>(&merge.source());
    assert_layout::<Params>(&merge.source());
    for rows in [false, true] {
        let copy = BufferCopy {
            variant: Variant::default(),
            rows,
        };
        assert_layout::<CopyParams>(&copy.source());
    }
    let quant = Fp8Quantize {
        pass: QuantPass::Codes,
        head_dim: 64,
        hadamard: true,
        variant: Variant::default(),
    };
    assert_layout::<QuantParams>(&quant.source());
}

/// The quantization kernels keep their rows in workgroup memory: at most
/// 512 f32 (plus the block maximum in the absmax pass), well inside
/// WebGPU's 16 KiB; the scales pass, which loads no rows, none.
#[test]
fn quantization_workgroup_storage_is_small() {
    for k in fp8_kernels(&HEAD_DIMS, false) {
        if let KernelKey::Fp8Quantize(q) = k.key {
            let (module, _) = compile(&k).unwrap();
            let rows = q.rows_per_group() * q.dim();
            let expected = match q.pass {
                QuantPass::Absmax => 4 * rows + 4,
                QuantPass::Codes => 4 * rows,
                QuantPass::Scales => 0,
            };
            assert_eq!(workgroup_bytes(&module), expected, "{}", k.label);
            assert!(rows <= 512 || q.rows_per_group() == 1, "{}", k.label);
        }
    }
}

/// Function-scope `var`s declared without an initializer, as `line: text`.
fn uninitialized_vars(text: &str) -> Vec<String> {
    let mut depth = 0i32;
    let mut found = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let t = line.trim();
        let declares =
            t.starts_with("var ") && t.contains(':') && t.ends_with(';') && !t.contains('=');
        if depth > 0 && declares {
            found.push(format!("{}: {t}", n + 1));
        }
        depth += line.matches('{').count() as i32 - line.matches('}').count() as i32;
    }
    found
}

/// Chromium's Tint zeroes a function-scope `var` without initializer once,
/// not each time a loop body (or a function called in a loop) declares it,
/// which once summed scores across blocks: every such `var` is initialized.
#[test]
fn every_function_var_has_an_initializer() {
    assert_eq!(
        uninitialized_vars("fn f() {\n  var a: f32;\n  var b = 0.0;\n}\nvar<workgroup> w: f32;\n"),
        vec!["2: var a: f32;"]
    );
    for k in all_kernels() {
        let bad = uninitialized_vars(&k.key.source().text);
        assert!(bad.is_empty(), "{}: {bad:?}", k.label);
    }
}

#[test]
fn native_f16_needs_the_capability_and_packed_does_not() {
    let plan = plan_forward(
        &PlanRequest::new(64, Precision::F16),
        &DeviceCaps::webgpu_default(),
    )
    .unwrap()
    .plan;
    assert_eq!(plan.storage, StorageKind::F16Packed);
    let kernel = |storage, f16| Kernel {
        label: format!("{storage:?}"),
        key: FlashForward {
            plan: Plan { storage, ..plan },
            variant: Variant::default(),
        }
        .into(),
        f16,
        subgroups: false,
    };
    assert!(compile(&kernel(StorageKind::F16Packed, false)).is_ok());
    assert!(compile(&kernel(StorageKind::F16Native, false)).is_err());
    assert!(compile(&kernel(StorageKind::F16Native, true)).is_ok());
}

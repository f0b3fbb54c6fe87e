//! The verification matrix of a wgpu device: every kernel family it offers
//! × forward, backward and decode × f32, f16 and bf16 × the layouts, each
//! run fresh (no cache) and judged by the accuracy rule. `flashattn doctor`
//! prints it; it is what a bug report needs.
//!
//! Rows per family, precision and call: the band case (the first-use
//! check: odd sizes, a causal window, GQA, wrapped K/V rings, a +100
//! score) and the layouts case (ALiBi, sinks, a block mask, a packed batch,
//! softcap, v's own head dim, at once); for decoding, a paged cache and a
//! dense one. The code-path flags the device would otherwise run too get
//! rows of their own: packed f16 where native f16 is the default, the
//! registers forward's workgroup reductions and single K/V buffer.

use super::cases::{DecodeLayout, Judgement};
use super::verdict::FamilyKey;
use super::wgpu::CaseKind;
use crate::error::Result;
// The wgpu rows (`flashattn doctor`): lab builds only.
#[cfg(feature = "lab")]
use {
    super::cases::DecodeCase,
    super::fault::Fault,
    super::verdict::CallKind,
    super::wgpu::{check_attention, check_decode, check_head_dim, check_plan, WgpuFamily},
    crate::api::tensor::Precision,
    crate::plan::decode::decode_tiles,
    crate::plan::{DeviceCaps, KernelFamily, Plan, PlanOverrides},
    crate::runtime::Gpu,
    web_time::Instant,
};

/// One case of the matrix.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MatrixCase {
    /// A forward or backward case.
    Attention(CaseKind),
    /// A decoding case.
    Decode(DecodeLayout),
}

impl MatrixCase {
    /// The layout column: a short name.
    pub fn name(self) -> &'static str {
        match self {
            MatrixCase::Attention(CaseKind::Band) => "band",
            MatrixCase::Attention(CaseKind::Layouts) => "layouts",
            MatrixCase::Decode(DecodeLayout::Paged) => "paged",
            MatrixCase::Decode(DecodeLayout::Dense) => "dense",
        }
    }

    /// What the case covers, in words.
    pub fn covers(self) -> &'static str {
        match self {
            MatrixCase::Attention(CaseKind::Band) => {
                "odd sizes, causal window, GQA, wrapped K/V ring, a +100 score"
            }
            MatrixCase::Attention(CaseKind::Layouts) => {
                "ALiBi, sinks, block mask, varlen, softcap, dv != d, window, GQA"
            }
            MatrixCase::Decode(DecodeLayout::Paged) => {
                "paged cache, append, GQA, causal window, 1 and 3 splits"
            }
            MatrixCase::Decode(DecodeLayout::Dense) => {
                "dense cache by batch index, append, softcap, window, 1 and 3 splits"
            }
        }
    }
}

#[cfg(feature = "lab")]
/// One row to run: a family (with its flags) and a case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct MatrixEntry {
    /// The family and its flags.
    pub family: WgpuFamily,
    /// The case it runs.
    pub case: MatrixCase,
}

/// How a row ended.
#[cfg(not(target_arch = "wasm32"))]
#[derive(Clone, Debug, PartialEq)]
pub enum RowResult {
    /// Every output met the rule (the worst is given).
    Pass(Judgement),
    /// An output did not (the first that failed is given).
    Fail(Judgement),
    /// The call returned an error.
    Error(String),
}

#[cfg(not(target_arch = "wasm32"))]
impl RowResult {
    /// A check's outcome as a row's result.
    pub fn of(judged: Result<Judgement>) -> Self {
        match judged {
            Ok(j) if j.passed => RowResult::Pass(j),
            Ok(j) => RowResult::Fail(j),
            Err(e) => RowResult::Error(e.to_string()),
        }
    }

    /// The result column: `pass`, `FAIL` or `error`.
    pub fn word(&self) -> &'static str {
        match self {
            RowResult::Pass(_) => "pass",
            RowResult::Fail(_) => "FAIL",
            RowResult::Error(_) => "error",
        }
    }

    /// Whether the row passed.
    pub fn passed(&self) -> bool {
        matches!(self, RowResult::Pass(_))
    }
}

/// A row that ran.
#[cfg(not(target_arch = "wasm32"))]
#[derive(Clone, Debug, PartialEq)]
pub struct MatrixRow {
    /// The family's key.
    pub family: FamilyKey,
    /// The case it ran.
    pub case: MatrixCase,
    /// How it ended.
    pub result: RowResult,
    /// Its time, compiling its kernels included.
    pub seconds: f64,
}

#[cfg(feature = "lab")]
/// A plan as the device runs it ([`Gpu::device_plan`]).
type DevicePlan<'a> = &'a dyn Fn(Plan) -> Plan;

#[cfg(feature = "lab")]
/// The families of `call` a device with `caps` offers, in each precision,
/// with the flags its planner picks at the check's sizes (`true`: the
/// device's default path), then the other code paths it may run (packed
/// f16 where native is the default, the registers forward's flags the
/// other way; `false`).
fn families(caps: &DeviceCaps, device: DevicePlan, call: CallKind) -> Vec<(WgpuFamily, bool)> {
    let mut kernels = vec![KernelFamily::Tiled, KernelFamily::Registers];
    if caps.lane_subgroup.is_some() {
        kernels.insert(0, KernelFamily::Lanes);
    }
    match call {
        CallKind::Forward if caps.coop_matrix.any() => kernels.push(KernelFamily::Coop),
        CallKind::Decode => kernels.retain(|k| *k != KernelFamily::Registers),
        _ => {}
    }
    let mut out: Vec<(WgpuFamily, bool)> = Vec::new();
    for kernel in kernels {
        for (precision, f16_native) in [
            (Precision::F32, None),
            (Precision::F16, None),
            (Precision::F16, Some(false)),
            (Precision::Bf16, None),
        ] {
            let o = PlanOverrides {
                kernel: Some(kernel),
                f16_native,
                ..Default::default()
            };
            if let Ok(f) = planned(caps, device, call, precision, o) {
                if !out.iter().any(|(g, _)| *g == f) {
                    out.push((f, f16_native.is_none()));
                }
            }
        }
    }
    let have: Vec<WgpuFamily> = out.iter().map(|(f, _)| *f).collect();
    let others = registers_paths(caps, device, call, &have);
    out.extend(others.into_iter().map(|f| (f, false)));
    out
}

#[cfg(feature = "lab")]
/// The registers forward's other flags, in f32: each of its two flags
/// (subgroup or workgroup reductions, one or two K/V buffers) the other
/// way, where the device can run it.
fn registers_paths(
    caps: &DeviceCaps,
    device: DevicePlan,
    call: CallKind,
    have: &[WgpuFamily],
) -> Vec<WgpuFamily> {
    let base = have
        .iter()
        .find(|f| f.kernel == KernelFamily::Registers && f.storage.precision() == Precision::F32);
    let Some(base) = base.filter(|_| call == CallKind::Forward) else {
        return Vec::new();
    };
    let mut out = Vec::new();
    let (sg, db) = (base.subgroup_reduce, base.double_buffer);
    for (subgroup_reduce, double_buffer) in [(!sg, db), (sg, !db)] {
        let o = PlanOverrides {
            subgroup_reduce: Some(subgroup_reduce),
            double_buffer: Some(double_buffer),
            ..base.overrides()
        };
        if let Ok(f) = planned(caps, device, call, Precision::F32, o) {
            if !have.contains(&f) && !out.contains(&f) {
                out.push(f);
            }
        }
    }
    out
}

#[cfg(feature = "lab")]
/// The family a check at its head dim runs under `overrides`.
fn planned(
    caps: &DeviceCaps,
    device: DevicePlan,
    call: CallKind,
    precision: Precision,
    overrides: PlanOverrides,
) -> Result<WgpuFamily> {
    let kernel = overrides.kernel.unwrap_or_default();
    if call == CallKind::Decode {
        let req = DecodeCase::request(precision, check_head_dim(kernel), kernel);
        return Ok(WgpuFamily::of_decode(&decode_tiles(&req, caps)?));
    }
    let plan = check_plan(caps, call, precision, overrides)?;
    Ok(WgpuFamily::of_plan(call, &device(plan)))
}

#[cfg(feature = "lab")]
/// Every row of the matrix on `gpu`: forward, backward, then decode; per
/// family, the band case, then the layouts.
pub fn entries(gpu: &Gpu) -> Vec<MatrixEntry> {
    entries_for(&gpu.caps(), &|p| gpu.device_plan(p))
}

#[cfg(feature = "lab")]
/// [`entries`] for a device with `caps` that runs plans as `device` says.
fn entries_for(caps: &DeviceCaps, device: DevicePlan) -> Vec<MatrixEntry> {
    let mut out = Vec::new();
    for call in [CallKind::Forward, CallKind::Backward, CallKind::Decode] {
        let cases: &[MatrixCase] = match call {
            CallKind::Decode => &[
                MatrixCase::Decode(DecodeLayout::Paged),
                MatrixCase::Decode(DecodeLayout::Dense),
            ],
            _ => &[
                MatrixCase::Attention(CaseKind::Band),
                MatrixCase::Attention(CaseKind::Layouts),
            ],
        };
        // The other code paths take the band case only: what they change
        // is the same under every layout.
        for (family, default) in families(caps, device, call) {
            for &case in &cases[..if default { cases.len() } else { 1 }] {
                out.push(MatrixEntry { family, case });
            }
        }
    }
    out
}

#[cfg(feature = "lab")]
/// Run one row on `gpu` (with `fault` planted, in lab builds' tests).
#[cfg(not(target_arch = "wasm32"))]
pub async fn run(gpu: &Gpu, entry: &MatrixEntry, fault: Option<&Fault>) -> MatrixRow {
    let start = Instant::now();
    let family = &entry.family;
    let judged = match entry.case {
        MatrixCase::Attention(kind) => check_attention(gpu, family, kind, fault).await,
        MatrixCase::Decode(layout) => check_decode(gpu, family, layout, fault).await,
    };
    MatrixRow {
        family: family.key(),
        case: entry.case,
        result: RowResult::of(judged),
        seconds: start.elapsed().as_secs_f64(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_matrix_covers_every_family_call_precision_and_path() {
        let rows = entries_for(&DeviceCaps::lavapipe(), &|p| p);
        let keys: Vec<String> = rows
            .iter()
            .map(|e| format!("{} {}", e.family.key(), e.case.name()))
            .collect();
        let has = |s: &str| keys.iter().any(|k| k == s);
        for call in ["forward", "backward"] {
            for family in ["lanes", "tiled", "registers"] {
                for p in ["f32", "f16 (native f16", "bf16"] {
                    for case in ["band", "layouts"] {
                        let prefix = format!("{family} {call} {p}");
                        assert!(
                            keys.iter()
                                .any(|k| k.starts_with(&prefix) && k.ends_with(case)),
                            "{prefix} {case} missing from {keys:#?}"
                        );
                    }
                }
            }
        }
        assert!(has("tiled backward f16 (packed f16) band"));
        assert!(!has("tiled backward f16 (packed f16) layouts"));
        assert!(
            has("lanes decode f32 paged") && has("tiled decode bf16 dense"),
            "{keys:#?}"
        );
        // Each registers flag the other way: workgroup reductions, and two
        // K/V buffers (the check's long keys leave room for one by default).
        assert!(
            has("registers forward f32 (workgroup reductions, one K/V buffer) band"),
            "{keys:#?}"
        );
        assert!(
            has("registers forward f32 (subgroup reductions, two K/V buffers) band"),
            "{keys:#?}"
        );
        assert!(!keys.iter().any(|k| k.starts_with("coop")));
        // With cooperative matrices, the coop forward joins (forward only).
        let coop = DeviceCaps {
            coop_matrix: crate::plan::CoopMatrixShapes {
                f32_8x8: true,
                ..Default::default()
            },
            ..DeviceCaps::lavapipe()
        };
        let with_coop = entries_for(&coop, &|p| p);
        assert!(with_coop
            .iter()
            .any(|e| e.family.kernel == KernelFamily::Coop && e.family.call == CallKind::Forward));
        assert!(!with_coop
            .iter()
            .any(|e| e.family.kernel == KernelFamily::Coop && e.family.call != CallKind::Forward));
    }
}

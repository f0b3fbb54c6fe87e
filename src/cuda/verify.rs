//! Verification of the CUDA kernel paths (see [`crate::verify`]): each
//! path's first-use check (forward, backward, decoding) through the real
//! CUDA ops, the walk Hopper → sm80 → scalar where one fails, and the matrix
//! `flashattn doctor --backend cuda` runs. The choice of path is the pure
//! walk of [`crate::verify::fallback`]; what is CUDA's here is which family
//! a plan runs and how a check runs it.

use super::backward::backward;
use super::context::CudaDevice;
use super::decode::decode_host;
use super::forward::forward;
use super::kernel::Family;
use super::plan::{plan, DeviceProps, KernelPath, PlanProblem};
use crate::api::options::AttentionOptions;
use crate::api::inputs::ForwardInputs;
use crate::api::problem::Problem;
use crate::api::tensor::Precision;
use crate::error::{Error, Result};
use crate::verify::cases::{AttentionCase, DecodeCase, DecodeLayout, Judgement};
use crate::verify::fallback::{cuda_chain, walk, CudaFamily, Route};
use crate::verify::matrix::{MatrixCase, MatrixRow, RowResult};
use crate::verify::store::Lookup;
use crate::verify::wgpu::{CaseKind, CheckRun};
use crate::verify::{
    CallKind, Checked, DeviceKey, Evidence, FamilyKey, Fault, VerdictStore, Verification,
    VerifyMode,
};
use web_time::Instant;

/// The family a compiled kernel belongs to.
pub fn family_of(f: Family) -> CudaFamily {
    match f {
        Family::ForwardWgmma | Family::BackwardWgmma => CudaFamily::Hopper,
        Family::ForwardMma | Family::BackwardMma => CudaFamily::Sm80,
        // Decoding's and the quantization's kernels are scalar f32 code
        // on every device.
        Family::Forward | Family::Backward | Family::Decode | Family::Fp8Quantize => {
            CudaFamily::Scalar
        }
    }
}

/// The kernel path that forces a family.
pub fn path_of(f: CudaFamily) -> KernelPath {
    match f {
        CudaFamily::Hopper => KernelPath::Hopper,
        CudaFamily::Sm80 => KernelPath::Mma,
        CudaFamily::Scalar => KernelPath::Scalar,
    }
}

/// The family of `call` that `problem` runs on `dev` under `path`.
pub fn planned_family(
    dev: &DeviceProps,
    call: CallKind,
    problem: &PlanProblem,
    path: KernelPath,
) -> Result<CudaFamily> {
    // Decoding's kernels (cuda/flash_decode.cu) serve every path; the
    // Hopper path has none of its own, so a step on it is the sm80 path's.
    let path = match (call, path) {
        (CallKind::Decode, KernelPath::Auto) => KernelPath::NoHopper,
        (CallKind::Decode, KernelPath::Hopper) => {
            return Err(Error::Unsupported {
                what: "the CUDA backend's Hopper path",
                feature: "decoding (the Hopper path's decode kernels are the sm80 path's)",
            })
        }
        _ => path,
    };
    let p = plan(dev, problem, path)?;
    let key = if call == CallKind::Backward {
        p.backward
    } else {
        p.forward
    };
    Ok(family_of(key.family))
}

/// The verification key of `family` serving `call` in `precision`, with
/// kernels compiled for `arch`.
pub fn family_key(
    call: CallKind,
    family: CudaFamily,
    precision: Precision,
    arch: &str,
) -> FamilyKey {
    FamilyKey {
        call,
        family: family.name(),
        precision,
        flags: vec![format!("kernels for {arch}")],
    }
}

/// The CUDA driver API's and NVRTC's versions as text ("unknown" where a
/// library does not answer): part of a verdict's key.
pub fn versions() -> (String, String) {
    let v = super::context::versions();
    let show = |v: Option<(i32, i32)>| v.map_or("unknown".into(), |(a, b)| format!("{a}.{b}"));
    (show(v.driver), show(v.nvrtc))
}

/// The device half of a CUDA verdict's key.
pub fn device_key(dev: &CudaDevice) -> DeviceKey {
    let p = &dev.props;
    let (driver, nvrtc) = versions();
    DeviceKey {
        api: "CUDA".into(),
        adapter: p.name.clone(),
        vendor: 0x10de,
        device: (p.major * 10 + p.minor) as u32,
        driver: format!("CUDA driver {driver}"),
        driver_info: format!("NVRTC {nvrtc}"),
    }
}

/// The head dim a family's check runs at: odd on the scalar kernels; a
/// multiple of 8 (padded to 64) on the tensor-core ones, whose TMA reads
/// whole 16-byte rows.
fn check_head_dim(family: CudaFamily) -> usize {
    match family {
        CudaFamily::Scalar => 37,
        CudaFamily::Hopper | CudaFamily::Sm80 => 40,
    }
}

/// The plan facts of a check at head dim `d`.
fn check_problem(precision: Precision, d: usize) -> PlanProblem {
    PlanProblem {
        precision,
        head_dim: d,
        band: true,
        softcap: false,
        positive_scale: true,
        dropout: false,
    }
}

/// What one check runs: the family, the call, the precision and the case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CudaEntry {
    /// The kind of call.
    pub call: CallKind,
    /// The kernel path's family.
    pub family: CudaFamily,
    /// The storage precision.
    pub precision: Precision,
    /// The case it runs.
    pub case: MatrixCase,
}

/// Run `entry` on `dev`, judged (with `fault` planted in lab builds' tests).
pub fn check(dev: &CudaDevice, entry: &CudaEntry, fault: Option<&Fault>) -> Result<Judgement> {
    let CudaEntry {
        call,
        family,
        precision,
        case,
    } = *entry;
    let (d, path) = (check_head_dim(family), path_of(family));
    let key = family_key(call, family, precision, &dev.arch());
    // The path must run this family on the case (and not another).
    let ran = planned_family(&dev.props, call, &check_problem(precision, d), path)?;
    if ran != family {
        return Err(Error::Unsupported {
            what: "this family's check",
            feature: "the case's layouts (the plan runs another family for them)",
        });
    }
    let tiles = plan(&dev.props, &check_problem(precision, d), path)?;
    let keys = match call {
        CallKind::Backward => tiles.backward.tiles().keys,
        _ => tiles.forward.tiles().keys,
    };
    let case = match case {
        MatrixCase::Decode(layout) => {
            let case = DecodeCase::new(precision, d, keys, layout)?;
            return check_decode(dev, &key, &case, fault);
        }
        MatrixCase::Attention(CaseKind::Band) => {
            AttentionCase::band(precision, d, keys, call == CallKind::Forward)?
        }
        // One head dim: the CUDA kernels take v's equal to q's.
        MatrixCase::Attention(CaseKind::Layouts) => AttentionCase::layouts(precision, d, d)?,
    };
    let [q, k, v, _] = case.views();
    if call == CallKind::Forward {
        let problem = Problem::forward(&ForwardInputs::new(q, k, v), &case.opts)?;
        let mut out = forward(dev, path, &q, &k, &v, &problem)?;
        Fault::perturb(fault, &key, &mut out.o);
        return case.judge_forward(&out);
    }
    let fwd = case.cpu_forward()?;
    let inputs = case.backward_inputs(&fwd)?;
    let problem = Problem::backward(&inputs, &case.opts)?;
    let mut out = backward(dev, path, &inputs, &problem)?;
    Fault::perturb(fault, &key, &mut out.dq);
    case.judge_backward(&out)
}

/// The decoding step of `case` (cuda/flash_decode.cu's kernels, which
/// every path shares; the planner's splits), judged; a planted `fault`
/// perturbs family `key`'s output.
fn check_decode(
    dev: &CudaDevice,
    key: &FamilyKey,
    case: &DecodeCase,
    fault: Option<&Fault>,
) -> Result<Judgement> {
    let mut cache = case.cache.clone();
    let mut out = decode_host(dev, &mut cache, &case.step(), &case.opts, None)?;
    Fault::perturb(fault, key, &mut out.o);
    case.judge(&out)
}

/// The verdicts of one CUDA device and (in lab builds) a planted fault.
#[derive(Debug)]
pub struct CudaVerifier {
    /// The device's verdicts.
    pub store: VerdictStore,
    /// A planted fault (lab builds' tests only).
    pub fault: Option<Fault>,
}

impl CudaVerifier {
    /// `FLASHATTN_VERIFY`'s mode, verdicts in flashattn's cache directory.
    pub fn new(dev: &CudaDevice) -> Result<Self> {
        let store = VerdictStore::new(VerifyMode::from_env()?, device_key(dev))
            .with_disk(crate::verify::VerdictCache::default_location());
        #[cfg(feature = "lab-fault")]
        let fault = Fault::from_env()?;
        #[cfg(not(feature = "lab-fault"))]
        let fault = None;
        Ok(Self { store, fault })
    }

    /// The verdict of `family` for `call` in `precision`: known, or its
    /// first-use check run now.
    fn verdict(
        &self,
        dev: &CudaDevice,
        call: CallKind,
        precision: Precision,
        family: CudaFamily,
    ) -> Result<crate::verify::Verdict> {
        let key = family_key(call, family, precision, &dev.arch());
        Ok(match self.store.lookup(&key)? {
            Lookup::Known(v) => v,
            Lookup::Busy => crate::verify::Verdict::NotYetChecked,
            Lookup::Run(claim) => {
                let case = match call {
                    CallKind::Decode => MatrixCase::Decode(DecodeLayout::Paged),
                    _ => MatrixCase::Attention(CaseKind::Band),
                };
                let entry = CudaEntry {
                    call,
                    family,
                    precision,
                    case,
                };
                let start = Instant::now();
                let run = CheckRun::of(check(dev, &entry, self.fault.as_ref()), start);
                claim.finish(run.verdict, run.persist, run.seconds)
            }
        })
    }

    /// The path a call of `problem` runs after verification (`path`: the
    /// handle's; anything but `Auto` is forced and runs whatever its
    /// verdict), and what verification decided (`None` where the call
    /// cannot be planned: the op reports why).
    pub fn route(
        &self,
        dev: &CudaDevice,
        call: CallKind,
        problem: &PlanProblem,
        path: KernelPath,
    ) -> Result<(KernelPath, Option<Verification>)> {
        let Ok(first) = planned_family(&dev.props, call, problem, path) else {
            return Ok((path, None));
        };
        let forced = path != KernelPath::Auto;
        let mut tried_keys = Vec::new();
        let walked = pollster::block_on(walk(cuda_chain(first), forced, async |f| {
            tried_keys.push(family_key(call, f, problem.precision, &dev.arch()));
            match planned_family(&dev.props, call, problem, path_of(f)) {
                Ok(ran) if ran == f => self.verdict(dev, call, problem.precision, f),
                Ok(_) | Err(_) => Ok(crate::verify::Verdict::Failed(Evidence {
                    detail: "it cannot run this call".into(),
                    seconds: 0.0,
                    cached: false,
                })),
            }
        }))?;
        let (route, tried) = walked;
        let verification = Verification {
            tried: tried_keys
                .into_iter()
                .zip(tried)
                .map(|(family, (_, verdict))| Checked { family, verdict })
                .collect(),
            forced,
            cpu_instead: None,
        };
        match route {
            Route::Run(f) if f == first => Ok((path, Some(verification))),
            Route::Run(f) => Ok((path_of(f), Some(verification))),
            Route::Exhausted => Err(Error::VerificationFailed {
                call: call.name(),
                tried: verification.to_string(),
            }),
        }
    }
}

/// The plan facts of a decoding step (cuda/flash_decode.cu: scalar code,
/// the cache read through its page table at run time), with the step's
/// band and softcap.
pub fn decode_problem(
    precision: Precision,
    head_dim: usize,
    opts: &AttentionOptions,
) -> PlanProblem {
    PlanProblem {
        precision,
        head_dim,
        band: opts.causal || !opts.window.is_unbounded(),
        softcap: opts.softcap_value() > 0.0,
        positive_scale: opts.scale.is_none_or(|s| s > 0.0),
        dropout: false,
    }
}

/// Every row of the CUDA matrix on a device with `dev`'s properties: the
/// families it runs (Hopper where compute capability 9.x and its build
/// allow, sm80 from 8.0, scalar everywhere) × forward, backward and decode
/// × the precisions each takes × the band and layouts cases (Hopper: its
/// forward and backward; its decoding is the sm80 path's).
pub fn entries(dev: &DeviceProps) -> Vec<CudaEntry> {
    let offered: Vec<CudaFamily> = [CudaFamily::Hopper, CudaFamily::Sm80, CudaFamily::Scalar]
        .into_iter()
        .filter(|&f| {
            let problem = check_problem(Precision::F16, check_head_dim(f));
            planned_family(dev, CallKind::Forward, &problem, path_of(f)).is_ok_and(|r| r == f)
        })
        .collect();
    let mut out = Vec::new();
    for call in [CallKind::Forward, CallKind::Backward, CallKind::Decode] {
        for &family in &offered {
            let cases: &[MatrixCase] = match (call, family) {
                (CallKind::Decode, CudaFamily::Hopper) => &[],
                (CallKind::Decode, _) => &[
                    MatrixCase::Decode(DecodeLayout::Paged),
                    MatrixCase::Decode(DecodeLayout::Dense),
                ],
                _ => &[
                    MatrixCase::Attention(CaseKind::Band),
                    MatrixCase::Attention(CaseKind::Layouts),
                ],
            };
            for precision in [Precision::F32, Precision::F16, Precision::Bf16] {
                if precision == Precision::F32 && family != CudaFamily::Scalar {
                    continue;
                }
                for &case in cases {
                    out.push(CudaEntry {
                        call,
                        family,
                        precision,
                        case,
                    });
                }
            }
        }
    }
    out
}

/// Run one row now on `dev` (no verdict read or kept).
pub fn run(dev: &CudaDevice, entry: &CudaEntry, fault: Option<&Fault>) -> MatrixRow {
    let start = Instant::now();
    MatrixRow {
        family: family_key(entry.call, entry.family, entry.precision, &dev.arch()),
        case: entry.case,
        result: RowResult::of(check(dev, entry, fault)),
        seconds: start.elapsed().as_secs_f64(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_matrix_of_each_device_runs_the_families_it_has() {
        let count = |dev: &DeviceProps, f: CudaFamily| {
            entries(dev).iter().filter(|e| e.family == f).count()
        };
        let h100 = DeviceProps::h100();
        // Hopper: its forward's and backward's band and layouts cases in
        // f16 and bf16.
        assert_eq!(count(&h100, CudaFamily::Hopper), 8);
        // sm80: forward and backward (band, layouts) and decode (paged,
        // dense) in f16 and bf16; scalar: the same in three precisions.
        assert_eq!(count(&h100, CudaFamily::Sm80), 12);
        assert_eq!(count(&h100, CudaFamily::Scalar), 18);
        let a100 = DeviceProps::a100();
        assert_eq!(count(&a100, CudaFamily::Hopper), 0);
        assert_eq!(count(&a100, CudaFamily::Sm80), 12);
        // The sm80 build on an H100 has no Hopper path.
        let mut sm80_build = h100.clone();
        sm80_build.arch = "compute_80".parse().unwrap();
        assert_eq!(count(&sm80_build, CudaFamily::Hopper), 0);
    }

    #[test]
    fn plans_name_their_family_and_paths_force_it() {
        let h100 = DeviceProps::h100();
        let band = check_problem(Precision::Bf16, 64);
        let family =
            |call, problem: &PlanProblem, path| planned_family(&h100, call, problem, path).unwrap();
        assert_eq!(
            family(CallKind::Forward, &band, KernelPath::Auto),
            CudaFamily::Hopper
        );
        // The Hopper path's backward is its own (dK/dV; dQ the sm80 one's).
        assert_eq!(
            family(CallKind::Backward, &band, KernelPath::Auto),
            CudaFamily::Hopper
        );
        assert_eq!(
            family(CallKind::Backward, &band, KernelPath::Mma),
            CudaFamily::Sm80
        );
        for f in [CudaFamily::Hopper, CudaFamily::Sm80, CudaFamily::Scalar] {
            assert_eq!(family(CallKind::Forward, &band, path_of(f)), f);
        }
        // Decoding is a packed batch: never the Hopper forward.
        let decoding = decode_problem(
            Precision::F16,
            64,
            &AttentionOptions::default().causal(true),
        );
        assert_eq!(
            family(CallKind::Decode, &decoding, KernelPath::Auto),
            CudaFamily::Sm80
        );
        // f32 runs the scalar kernels only.
        let f32 = check_problem(Precision::F32, 64);
        assert_eq!(
            family(CallKind::Forward, &f32, KernelPath::Auto),
            CudaFamily::Scalar
        );
        assert!(planned_family(&h100, CallKind::Forward, &f32, KernelPath::Mma).is_err());
        let key = family_key(
            CallKind::Forward,
            CudaFamily::Hopper,
            Precision::F16,
            "compute_90a",
        );
        assert_eq!(
            key.cache_text(),
            "forward hopper f16 [kernels for compute_90a]"
        );
    }
}

//! Verification of the wgpu kernels: a call's family key from the plan it
//! would run, the check run through the engine's own ops with that family
//! forced, and the walk down the fallback chain.

use super::cases::{AttentionCase, DecodeCase, DecodeLayout, Judgement};
use super::fallback::{walk, wgpu_chain, Route};
use super::fault::Fault;
use super::store::{Lookup, VerdictStore};
use super::verdict::{CallKind, Checked, Evidence, FamilyKey, Verdict, Verification};
use crate::api::decode::DecodeProblem;
use crate::api::output::CallStats;
use crate::api::inputs::ForwardInputs;
use crate::api::problem::Problem;
use crate::api::tensor::{Precision, Tensor};
use crate::error::{Error, Result};
use crate::ops;
use crate::ops::prepare::plan_request;
use crate::kv_quant::CacheQuant;
use crate::plan::decode::{decode_tiles, DecodeTiles};
use crate::plan::{
    CoopForm, DeviceCaps, KernelFamily, Pass, Plan, PlanOverrides, PlanRequest, StorageKind,
};
use crate::runtime::Gpu;
use web_time::Instant;

/// A wgpu kernel family in the planner's terms: what to force so that a
/// check, or a fallback, runs exactly its code.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct WgpuFamily {
    /// The kind of call.
    pub call: CallKind,
    /// The kernel family.
    pub kernel: KernelFamily,
    /// How q, k, v and o are stored.
    pub storage: StorageKind,
    /// Registers forward: row reductions by subgroup shuffles.
    pub subgroup_reduce: bool,
    /// Registers forward: two K/V tile buffers.
    pub double_buffer: bool,
    /// Coop forward: its matrices.
    pub coop: Option<CoopForm>,
    /// Attention dropout (the kernels' Philox mask, compiled in only then).
    pub dropout: bool,
    /// Decoding: the cache's codes (the quantized append and loads).
    pub cache: Option<CacheQuant>,
}

impl WgpuFamily {
    /// The family a forward or backward `plan` runs (as the device runs it).
    pub fn of_plan(call: CallKind, plan: &Plan) -> Self {
        let registers_forward = call == CallKind::Forward && plan.kernel == KernelFamily::Registers;
        Self {
            call,
            kernel: plan.kernel,
            storage: plan.storage,
            subgroup_reduce: registers_forward && plan.subgroup_reduce,
            double_buffer: registers_forward && plan.double_buffer,
            coop: plan.coop,
            dropout: false,
            cache: None,
        }
    }

    /// The same family with dropout `on` (a call's options, not its plan,
    /// say whether the kernels draw a mask).
    pub fn with_dropout(self, on: bool) -> Self {
        Self {
            dropout: on,
            ..self
        }
    }

    /// The family of a decode kernel.
    pub fn of_decode(tiles: &DecodeTiles) -> Self {
        Self {
            call: CallKind::Decode,
            kernel: tiles.kernel,
            storage: tiles.storage,
            subgroup_reduce: false,
            double_buffer: false,
            coop: None,
            dropout: false,
            cache: None,
        }
    }

    /// The same decode family on a cache of `quant` codes (`None`: plain).
    pub fn with_cache(self, quant: Option<CacheQuant>) -> Self {
        Self {
            cache: quant,
            ..self
        }
    }

    /// Its verification key.
    pub fn key(&self) -> FamilyKey {
        let mut flags = Vec::new();
        match self.storage {
            StorageKind::F16Native => flags.push("native f16".to_string()),
            StorageKind::F16Packed => flags.push("packed f16".to_string()),
            _ => {}
        }
        if self.call == CallKind::Forward && self.kernel == KernelFamily::Registers {
            flags.push(
                if self.subgroup_reduce {
                    "subgroup reductions"
                } else {
                    "workgroup reductions"
                }
                .into(),
            );
            flags.push(
                if self.double_buffer {
                    "two K/V buffers"
                } else {
                    "one K/V buffer"
                }
                .into(),
            );
        }
        if let Some(form) = self.coop {
            flags.push(form.name().to_string());
        }
        if self.dropout {
            flags.push("dropout".to_string());
        }
        if let Some(q) = self.cache {
            flags.push(format!("{} cache", q.name()));
        }
        FamilyKey {
            call: self.call,
            family: self.kernel.name(),
            precision: self.storage.precision(),
            flags,
        }
    }

    /// Overrides that force this family and its flags.
    pub fn overrides(&self) -> PlanOverrides {
        let registers = self.call == CallKind::Forward && self.kernel == KernelFamily::Registers;
        PlanOverrides {
            kernel: Some(self.kernel),
            f16_native: match self.storage {
                StorageKind::F16Native => Some(true),
                StorageKind::F16Packed => Some(false),
                _ => None,
            },
            subgroup_reduce: registers.then_some(self.subgroup_reduce),
            double_buffer: registers.then_some(self.double_buffer),
            ..Default::default()
        }
    }

    /// The head dim its check runs at.
    pub fn check_head_dim(&self) -> usize {
        check_head_dim(self.kernel)
    }
}

/// The head dim a family's check runs at: odd, but a multiple of 4 for the
/// lanes kernels (which take nothing else).
pub fn check_head_dim(kernel: KernelFamily) -> usize {
    match kernel {
        KernelFamily::Lanes => 20,
        _ => 19,
    }
}

/// The planner of a forward or backward call.
fn pass_of(call: CallKind) -> Pass {
    match call {
        CallKind::Backward => Pass::Backward,
        _ => Pass::Forward,
    }
}

/// The plan of the family `overrides` force at its check's head dim, with
/// long sequences (so that its key tile is its own, not the sequence's).
pub fn check_plan(
    caps: &DeviceCaps,
    call: CallKind,
    precision: Precision,
    overrides: PlanOverrides,
) -> Result<Plan> {
    let d = check_head_dim(overrides.kernel.unwrap_or_default());
    let req = PlanRequest::new(d, precision)
        .seqlens(64, 4096)
        .overrides(overrides);
    Ok(pass_of(call).plan(&req, caps)?.plan)
}

/// The family a forward or backward of `problem` runs under `overrides`.
pub fn attention_family(
    gpu: &Gpu,
    call: CallKind,
    problem: &Problem<'_>,
    overrides: &PlanOverrides,
) -> Result<WgpuFamily> {
    let req = plan_request(problem, *overrides);
    let plan = gpu.device_plan(pass_of(call).plan(&req, &gpu.caps())?.plan);
    Ok(WgpuFamily::of_plan(call, &plan).with_dropout(problem.opts.dropout.is_active()))
}

/// The family a decoding step of `p` runs (`kernel` forced, or the planner's).
pub fn decode_family(
    gpu: &Gpu,
    p: &DecodeProblem,
    kernel: Option<KernelFamily>,
) -> Result<WgpuFamily> {
    Ok(WgpuFamily::of_decode(&ops::decode::tiles(gpu, p, kernel)?))
}

/// A check's verdict, whether it is the rule's (kept on disk) rather than
/// an error's, and its seconds.
pub struct CheckRun {
    /// The check's verdict.
    pub verdict: Verdict,
    /// A verdict of the rule, kept on disk (not an error's, which may pass next time).
    pub persist: bool,
    /// Seconds the check took.
    pub seconds: f64,
}

impl CheckRun {
    /// The verdict of a judged run (or of the error it returned).
    pub fn of(judged: Result<Judgement>, start: Instant) -> Self {
        let seconds = start.elapsed().as_secs_f64();
        let evidence = |detail| Evidence {
            detail,
            seconds,
            cached: false,
        };
        match judged {
            Ok(j) if j.passed => Self {
                verdict: Verdict::Verified(evidence(j.worst)),
                persist: true,
                seconds,
            },
            Ok(j) => Self {
                verdict: Verdict::Failed(evidence(j.worst)),
                persist: true,
                seconds,
            },
            Err(e) => Self {
                verdict: Verdict::Failed(evidence(format!("the check's call failed: {e}"))),
                persist: false,
                seconds,
            },
        }
    }
}

/// Run `family`'s first-use check on `gpu`.
pub async fn check(gpu: &Gpu, family: &WgpuFamily, fault: Option<&Fault>) -> CheckRun {
    let start = Instant::now();
    let judged = match family.call {
        CallKind::Decode => check_decode(gpu, family, DecodeLayout::Paged, fault).await,
        _ => check_attention(gpu, family, CaseKind::Band, fault).await,
    };
    CheckRun::of(judged, start)
}

/// Which attention case to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CaseKind {
    /// [`AttentionCase::band`]: the first-use check.
    Band,
    /// [`AttentionCase::layouts`]: every layout at once (the matrix's).
    #[cfg(any(feature = "lab", feature = "cuda"))]
    Layouts,
}

/// The attention case `kind` for `family`: the band case's keys sized by
/// the family's key tile.
pub fn attention_case(gpu: &Gpu, family: &WgpuFamily, kind: CaseKind) -> Result<AttentionCase> {
    let (d, precision) = (family.check_head_dim(), family.storage.precision());
    match kind {
        CaseKind::Band => {
            let plan = check_plan(&gpu.caps(), family.call, precision, family.overrides())?;
            let hot = family.call == CallKind::Forward;
            let case = AttentionCase::band(precision, d, plan.bc as usize, hot)?;
            Ok(match family.dropout {
                true => case.with_dropout(),
                false => case,
            })
        }
        // A multiple of 4 for the lanes kernels, odd elsewhere; v narrower.
        #[cfg(any(feature = "lab", feature = "cuda"))]
        CaseKind::Layouts => AttentionCase::layouts(precision, d + 16, d + 4),
    }
}

/// The check's plan must be the family's: forcing it may not silently
/// change a flag.
fn ran_family(stats: &CallStats, family: &WgpuFamily) -> Result<()> {
    let ran = stats
        .plan
        .map(|p| WgpuFamily::of_plan(family.call, &p).with_dropout(family.dropout));
    match ran {
        Some(r) if r == *family => Ok(()),
        _ => Err(Error::Unsupported {
            what: "this family's check",
            feature: "the family's flags at the check's sizes (the planner chose others)",
        }),
    }
}

/// The forward (or backward) of case `kind` on `family`, judged.
pub async fn check_attention(
    gpu: &Gpu,
    family: &WgpuFamily,
    kind: CaseKind,
    fault: Option<&Fault>,
) -> Result<Judgement> {
    let case = attention_case(gpu, family, kind)?;
    let overrides = family.overrides();
    let [q, k, v, _] = case.views();
    if family.call == CallKind::Forward {
        let inputs = ForwardInputs::new(q, k, v);
        let problem = Problem::forward(&inputs, &case.opts)?;
        let mut out = ops::forward::forward(gpu, &inputs, &problem, &overrides).await?;
        ran_family(&out.stats, family)?;
        Fault::perturb(fault, &family.key(), &mut out.o);
        return case.judge_forward(&out);
    }
    let forward = case.cpu_forward()?;
    let inputs = case.backward_inputs(&forward)?;
    let problem = Problem::backward(&inputs, &case.opts)?;
    let mut out = ops::backward::backward(gpu, &inputs, &problem, &overrides).await?;
    ran_family(&out.stats, family)?;
    Fault::perturb(fault, &family.key(), &mut out.dq);
    case.judge_backward(&out)
}

/// A decoding step of case `layout` on `family`'s kernel, once unsplit and
/// once in three splits, judged.
pub async fn check_decode(
    gpu: &Gpu,
    family: &WgpuFamily,
    layout: DecodeLayout,
    fault: Option<&Fault>,
) -> Result<Judgement> {
    let (d, precision) = (family.check_head_dim(), family.storage.precision());
    // Keys for three of the kernel's blocks (one key per invocation).
    let req = DecodeCase::request(precision, d, family.kernel);
    let block = decode_tiles(&req, &gpu.caps())?.workgroup_size;
    let case = DecodeCase::new(precision, d, block as usize, layout)?;
    let quantized = family.cache.map(|q| case.quantized(q)).transpose()?;
    let (step, opts, kernel) = (case.step(), &case.opts, Some(family.kernel));
    let mut runs = Vec::new();
    for splits in [Some(1), Some(3)] {
        let (mut out, after) = match &quantized {
            Some(before) => {
                let mut cache = before.clone();
                let out = ops::decode::decode_quantized_host(
                    gpu, &mut cache, &step, opts, splits, kernel,
                )
                .await?;
                (out, Some(cache))
            }
            None => {
                let mut cache = case.cache.clone();
                let out =
                    ops::decode::decode_host(gpu, &mut cache, &step, opts, splits, kernel).await?;
                (out, None)
            }
        };
        Fault::perturb(fault, &family.key(), &mut out.o);
        runs.push(match (&quantized, &after) {
            (Some(before), Some(after)) => case.judge_quantized(before, after, &out)?,
            _ => case.judge(&out)?,
        });
    }
    Ok(Judgement::all(runs))
}

/// The verdict of `family`: known, or its check run now.
pub async fn verdict(
    store: &VerdictStore,
    gpu: &Gpu,
    family: &WgpuFamily,
    fault: Option<&Fault>,
) -> Result<Verdict> {
    match store.lookup(&family.key())? {
        Lookup::Known(v) => Ok(v),
        Lookup::Busy => Ok(Verdict::NotYetChecked),
        Lookup::Run(claim) => {
            let run = check(gpu, family, fault).await;
            Ok(claim.finish(run.verdict, run.persist, run.seconds))
        }
    }
}

/// What a call runs after verification.
#[derive(Clone, Debug)]
pub struct Routed {
    /// The overrides to run with (a fallback's family forced).
    pub overrides: PlanOverrides,
    /// The decode kernel to run (decoding only).
    pub decode_kernel: Option<KernelFamily>,
    /// What verification decided (`None` where the call could not be
    /// planned: the op reports why).
    pub verification: Option<Verification>,
}

impl Routed {
    /// Unverified: the call as it came (its op will report its error).
    fn unplanned(overrides: PlanOverrides) -> Self {
        Self {
            overrides,
            decode_kernel: None,
            verification: None,
        }
    }

    /// The family that runs.
    pub fn ran(&self) -> Option<&FamilyKey> {
        Some(&self.verification.as_ref()?.ran()?.family)
    }

    /// Put the verdict into the call's stats, and perturb `output` where a
    /// planted fault hits the family that ran.
    pub fn finish(self, stats: &mut CallStats, output: &mut Tensor, fault: Option<&Fault>) {
        if let Some(ran) = self.ran() {
            Fault::perturb(fault, ran, output);
        }
        stats.verification = self.verification;
    }
}

/// One backend's verification of wgpu calls: its verdicts and (in lab
/// builds) a planted fault.
#[derive(Debug)]
pub struct Verifier {
    /// The device's verdicts.
    pub store: VerdictStore,
    /// A planted fault (lab builds' tests only).
    pub fault: Option<Fault>,
}

impl Verifier {
    /// Verify the family a forward or backward of `problem` runs under
    /// `run` (the caller's overrides, or a tuned plan's): a failed family
    /// falls back unless `caller` forced it (a kernel, or a registers
    /// parameter).
    pub async fn route(
        &self,
        gpu: &Gpu,
        call: CallKind,
        problem: &Problem<'_>,
        caller: &PlanOverrides,
        run: PlanOverrides,
    ) -> Result<Routed> {
        let Ok(first) = attention_family(gpu, call, problem, &run) else {
            return Ok(Routed::unplanned(run));
        };
        let forced = caller.kernel.is_some() || caller.fixes_registers();
        let fallback = |kernel| PlanOverrides {
            kernel: Some(kernel),
            ..*caller
        };
        let family_of = |kernel| match kernel == first.kernel {
            true => Ok(first),
            false => attention_family(gpu, call, problem, &fallback(kernel)),
        };
        let (route, verification) = self.walk(gpu, first, forced, family_of).await?;
        match route {
            Route::Run(kernel) if kernel == first.kernel => Ok(Routed {
                verification: Some(verification),
                ..Routed::unplanned(run)
            }),
            Route::Run(kernel) => Ok(Routed {
                verification: Some(verification),
                ..Routed::unplanned(fallback(kernel))
            }),
            Route::Exhausted => Err(exhausted(call, &verification)),
        }
    }

    /// Verify the decode kernel a step of `p` runs: the lanes kernel falls
    /// back to the workgroup-memory one.
    pub async fn route_decode(
        &self,
        gpu: &Gpu,
        p: Option<&DecodeProblem>,
        cache: Option<CacheQuant>,
    ) -> Result<Routed> {
        let unplanned = || Ok(Routed::unplanned(PlanOverrides::default()));
        let Some(p) = p else { return unplanned() };
        let Ok(first) = decode_family(gpu, p, None) else {
            return unplanned();
        };
        let first = first.with_cache(cache);
        let family_of = |kernel| match kernel == first.kernel {
            true => Ok(first),
            false => decode_family(gpu, p, Some(kernel)).map(|f| f.with_cache(cache)),
        };
        let (route, verification) = self.walk(gpu, first, false, family_of).await?;
        match route {
            Route::Run(kernel) => Ok(Routed {
                decode_kernel: (kernel != first.kernel).then_some(kernel),
                verification: Some(verification),
                ..Routed::unplanned(PlanOverrides::default())
            }),
            Route::Exhausted => Err(exhausted(CallKind::Decode, &verification)),
        }
    }

    /// Walk `first`'s fallback chain (each family by `family_of`, checked
    /// where needed) to the family that runs.
    async fn walk(
        &self,
        gpu: &Gpu,
        first: WgpuFamily,
        forced: bool,
        family_of: impl Fn(KernelFamily) -> Result<WgpuFamily>,
    ) -> Result<(Route<KernelFamily>, Verification)> {
        let mut keys = Vec::new();
        let (route, tried) = walk(wgpu_chain(first.kernel), forced, async |kernel| {
            match family_of(kernel) {
                Ok(f) => {
                    keys.push(f.key());
                    verdict(&self.store, gpu, &f, self.fault.as_ref()).await
                }
                Err(e) => {
                    // A fallback that cannot take the call at all.
                    keys.push(FamilyKey {
                        family: kernel.name(),
                        ..first.key()
                    });
                    Ok(Verdict::Failed(Evidence {
                        detail: format!("it cannot run this call: {e}"),
                        seconds: 0.0,
                        cached: false,
                    }))
                }
            }
        })
        .await?;
        let tried = keys
            .into_iter()
            .zip(tried)
            .map(|(family, (_, verdict))| Checked { family, verdict })
            .collect();
        let verification = Verification {
            tried,
            forced,
            cpu_instead: None,
        };
        Ok((route, verification))
    }
}

/// Every family of the chain failed.
fn exhausted(call: CallKind, verification: &Verification) -> Error {
    Error::VerificationFailed {
        call: call.name(),
        tried: verification.to_string(),
    }
}

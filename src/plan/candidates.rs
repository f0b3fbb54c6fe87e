//! The autotuner's candidates: a handful of plans worth timing for one
//! (pass, head dims, precision, sequence lengths) on one device — the
//! formula plan first (it stays the fallback), then each knob's proposals
//! around it. Every candidate is a [`PlanOverrides`] the planner accepts on
//! these caps; candidates that plan to the same [`Plan`] are kept once.
//!
//! To add a kernel family, list it in [`FAMILIES`]; to add a knob (rows per
//! invocation, subgroup reductions, double buffering, ...), write a
//! [`Knob`] — a function from the [`Base`] to labelled overrides — and list
//! it in [`KNOBS`]. Proposals the planner rejects are dropped here, so a
//! knob may propose freely.

use super::caps::DeviceCaps;
use super::request::{KernelFamily, PlanOverrides, PlanRequest};
use super::pass::Pass;
use super::tiles::{round_up, Plan, GRANULARITY, MAX_THREADS_PER_ROW};
use crate::error::Result;

/// Most candidates [`candidates`] returns: each is compiled and timed, and
/// a pipeline compile alone takes up to a second on a CPU adapter.
pub const MAX_CANDIDATES: usize = 8;

/// One plan worth timing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Candidate {
    /// What this candidate changes (`formula` for the formula plan).
    pub label: String,
    /// What to hand the planner (the request's own overrides plus this
    /// candidate's).
    pub overrides: PlanOverrides,
    /// The plan they give on the caps the candidates were made for.
    pub plan: Plan,
}

/// What knobs propose around: the request, the formula plan, and the tiled
/// formula plan (the formula plan itself when it is tiled).
pub struct Base<'a> {
    pub req: &'a PlanRequest,
    pub pass: Pass,
    pub formula: Plan,
    pub tiled: Option<Plan>,
}

/// A knob: labelled overrides around the base, in order of preference.
pub type Knob = fn(&Base) -> Vec<(String, PlanOverrides)>;

/// Kernel families a candidate may switch to (where the planner takes them).
pub const FAMILIES: &[KernelFamily] = &[
    KernelFamily::Tiled,
    KernelFamily::Registers,
    KernelFamily::Lanes,
    KernelFamily::Coop,
];

/// The knobs, in order of preference: the list is cut at [`MAX_CANDIDATES`].
pub const KNOBS: &[Knob] = &[families, registers, query_rows, key_cols, threads, aspect];

/// The candidates for `req` on `caps`: the formula plan first, then each
/// knob's proposals that plan, each plan once, at most [`MAX_CANDIDATES`].
/// Fails only where the formula plan itself fails.
pub fn candidates(req: &PlanRequest, pass: Pass, caps: &DeviceCaps) -> Result<Vec<Candidate>> {
    let formula = pass.plan(req, caps)?.plan;
    let tiled = match formula.kernel {
        KernelFamily::Tiled => Some(formula),
        _ => plan_with(req, pass, caps, &with_kernel(req, KernelFamily::Tiled)),
    };
    let base = Base {
        req,
        pass,
        formula,
        tiled,
    };
    let mut out = vec![Candidate {
        label: "formula".into(),
        overrides: req.overrides,
        plan: formula,
    }];
    for (label, overrides) in KNOBS.iter().flat_map(|knob| knob(&base)) {
        if out.len() == MAX_CANDIDATES {
            break;
        }
        let Some(plan) = plan_with(req, pass, caps, &overrides) else {
            continue;
        };
        if useful(req, pass, &plan) && out.iter().all(|c| c.plan != plan) {
            out.push(Candidate {
                label,
                overrides,
                plan,
            });
        }
    }
    Ok(out)
}

/// The plan `overrides` give, where the planner accepts them.
fn plan_with(
    req: &PlanRequest,
    pass: Pass,
    caps: &DeviceCaps,
    overrides: &PlanOverrides,
) -> Option<Plan> {
    let req = PlanRequest {
        overrides: *overrides,
        ..*req
    };
    pass.plan(&req, caps).ok().map(|p| p.plan)
}

/// A tile longer than the (rounded) sequence it covers only adds masked
/// work: the forward's Br covers the queries and Bc the keys, the
/// backward's square tile the longer of the two.
fn useful(req: &PlanRequest, pass: Pass, plan: &Plan) -> bool {
    let cover = |n: usize| round_up(n, GRANULARITY).max(GRANULARITY);
    let (rows, cols) = match pass {
        Pass::Forward => (cover(req.seqlen_q), cover(req.seqlen_k)),
        Pass::Backward => {
            let n = cover(req.seqlen_q.max(req.seqlen_k));
            (n, n)
        }
    };
    plan.br <= rows && plan.bc <= cols
}

/// The request's overrides with the kernel family set.
fn with_kernel(req: &PlanRequest, kernel: KernelFamily) -> PlanOverrides {
    PlanOverrides {
        kernel: Some(kernel),
        ..req.overrides
    }
}

/// Tiled overrides fixing Br, Bc and (when given) threads per row; the
/// backward's square tile is Br.
fn tiled(req: &PlanRequest, br: u32, bc: u32, tc: Option<u32>) -> PlanOverrides {
    PlanOverrides {
        br: Some(br),
        bc: Some(bc),
        threads_per_row: tc,
        ..with_kernel(req, KernelFamily::Tiled)
    }
}

/// Half and double of `x`, the half where it is still a whole number of
/// granules (a tile the formula would pick).
fn half_and_double(x: u32) -> impl Iterator<Item = (&'static str, u32)> {
    let half = half(x).map(|h| ("/2", h));
    half.into_iter().chain([("×2", x * 2)])
}

/// Exactly half of `x`, where that is a multiple of the kernel granularity.
fn half(x: u32) -> Option<u32> {
    let h = x / 2;
    (x.is_multiple_of(2) && h >= GRANULARITY && h.is_multiple_of(GRANULARITY)).then_some(h)
}

/// The other kernel families, with the planner's tiles for them.
fn families(b: &Base) -> Vec<(String, PlanOverrides)> {
    FAMILIES
        .iter()
        .filter(|&&f| f != b.formula.kernel)
        .map(|&f| (format!("{} kernel", f.name()), with_kernel(b.req, f)))
        .collect()
}

/// The registers kernels' own knobs, where the formula plan is theirs (a
/// family the formula did not pick is tried with the planner's settings):
/// rows per invocation halved and doubled, the other row reduction, the
/// other number of K/V buffers (forward only).
fn registers(b: &Base) -> Vec<(String, PlanOverrides)> {
    let r = b.formula;
    if r.kernel != KernelFamily::Registers {
        return vec![];
    }
    let with = |o: PlanOverrides| PlanOverrides {
        kernel: Some(KernelFamily::Registers),
        ..o
    };
    let ov = b.req.overrides;
    let mut out = Vec::new();
    for rm in [r.rows_per_thread / 2, r.rows_per_thread * 2] {
        if (1..=4).contains(&rm) && rm != r.rows_per_thread {
            let o = with(PlanOverrides {
                rows_per_thread: Some(rm),
                ..ov
            });
            out.push((format!("registers RM {rm}"), o));
        }
    }
    let reduce = if r.subgroup_reduce {
        "workgroup"
    } else {
        "subgroup"
    };
    let o = with(PlanOverrides {
        subgroup_reduce: Some(!r.subgroup_reduce),
        ..ov
    });
    out.push((format!("registers {reduce} reductions"), o));
    if b.pass == Pass::Forward {
        let o = with(PlanOverrides {
            double_buffer: Some(!r.double_buffer),
            ..ov
        });
        let buffers = if r.double_buffer { 1 } else { 2 };
        out.push((format!("registers {buffers} K/V buffers"), o));
    }
    out
}

/// Br (the backward's square tile B) halved and doubled around the tiled
/// plan; threads per row left to the planner.
fn query_rows(b: &Base) -> Vec<(String, PlanOverrides)> {
    let Some(t) = b.tiled else { return vec![] };
    let name = match b.pass {
        Pass::Forward => "Br",
        Pass::Backward => "B",
    };
    half_and_double(t.br)
        .map(|(how, br)| {
            let bc = if b.pass == Pass::Backward { br } else { t.bc };
            (format!("{name}{how}"), tiled(b.req, br, bc, None))
        })
        .collect()
}

/// Bc halved and doubled around the tiled forward plan (the backward's
/// tiles are square: [`query_rows`] moves both).
fn key_cols(b: &Base) -> Vec<(String, PlanOverrides)> {
    let Some(t) = b.tiled.filter(|_| b.pass == Pass::Forward) else {
        return vec![];
    };
    half_and_double(t.bc)
        .map(|(how, bc)| (format!("Bc{how}"), tiled(b.req, t.br, bc, None)))
        .collect()
}

/// The forward's tile reshaped at about the same storage: twice the rows
/// and half the keys, and the reverse (where doubling one side alone does
/// not fit).
fn aspect(b: &Base) -> Vec<(String, PlanOverrides)> {
    let Some(t) = b.tiled.filter(|_| b.pass == Pass::Forward) else {
        return vec![];
    };
    let mut out = Vec::new();
    if let Some(bc) = half(t.bc) {
        out.push(("Br×2 Bc/2".into(), tiled(b.req, t.br * 2, bc, None)));
    }
    if let Some(br) = half(t.br) {
        out.push(("Br/2 Bc×2".into(), tiled(b.req, br, t.bc * 2, None)));
    }
    out
}

/// Invocations per row halved and doubled on the tiled plan's tiles.
fn threads(b: &Base) -> Vec<(String, PlanOverrides)> {
    let Some(t) = b.tiled else { return vec![] };
    let halves = (t.threads_per_row > 1).then_some(("/2", t.threads_per_row / 2));
    halves
        .into_iter()
        .chain([("×2", t.threads_per_row * 2)])
        .filter(|&(_, tc)| tc <= MAX_THREADS_PER_ROW)
        .map(|(how, tc)| {
            let o = tiled(b.req, t.br, t.bc, Some(tc));
            (format!("threads/row{how}"), o)
        })
        .collect()
}

#[cfg(test)]
mod tests;

//! The backward planner. The backward kernels keep six tiles on chip instead
//! of four, so starting from Algorithm 1's values the square tile
//! B = Br = Bc shrinks until Q, K (B×d), dO, V (B×dv), P and dS fit, and the
//! planner says so.

use super::caps::DeviceCaps;
use super::forward::{choose_kernel, plan_forward, registers_reason};
use super::registers;
use super::request::{KernelFamily, PlanOverrides, PlanRequest};
use super::tiles::{
    backward_workgroup_bytes, fit_invocations, round_down, round_up, shrink, threads_per_row, Plan,
    Planned, GRANULARITY, MAX_ACC_PER_THREAD, MAX_SCORES_PER_THREAD,
};
use crate::error::{Error, Result};

/// Plan the backward kernels for `req` on a device with `caps`.
pub fn plan_backward(req: &PlanRequest, caps: &DeviceCaps) -> Result<Planned> {
    match choose_kernel(req, caps)? {
        KernelFamily::Lanes => return lanes_backward(req, caps),
        KernelFamily::Registers => return registers_backward(req, caps),
        // The coop kernels are forward only: where they are the default,
        // the backward runs what GPUs run without them.
        KernelFamily::Coop if req.overrides.kernel.is_none() && caps.hardware => {
            return registers_backward(req, caps)
        }
        KernelFamily::Coop | KernelFamily::Tiled => {}
    }
    // Algorithm 1's values for this device (tile overrides apply to B below).
    let mut p = plan_forward(
        &PlanRequest {
            overrides: PlanOverrides {
                br: None,
                bc: None,
                threads_per_row: None,
                kernel: Some(KernelFamily::Tiled),
                ..req.overrides
            },
            ..*req
        },
        caps,
    )?;
    p.clamps.clear();
    let ov = req.overrides;
    let b = match ov.br.or(ov.bc) {
        Some(b) => b,
        None => {
            square(&mut p);
            square_tile(&mut p, req.seqlen_q.max(req.seqlen_k))
        }
    };
    if b == 0 || ov.threads_per_row == Some(0) {
        return Err(Error::EmptyTile {
            br: b,
            bc: b,
            threads_per_row: ov.threads_per_row.unwrap_or(1),
        });
    }
    let d = p.plan.widest_dim();
    let max_wg = caps.max_workgroup();
    // Two score arrays (S, dP) and two accumulator arrays (dK, dV) per invocation.
    let tc = ov
        .threads_per_row
        .unwrap_or_else(|| threads_per_row(d, b, b, max_wg, 2));
    let fixed = ov.br.is_some() || ov.bc.is_some();
    let (b, bytes) = fit(&mut p, b, tc, max_wg, fixed)?;
    p.plan = Plan {
        br: b,
        bc: b,
        threads_per_row: tc,
        workgroup_size: b * tc,
        workgroup_bytes: bytes,
        ..p.plan
    };
    Ok(p)
}

/// The lanes backward kernels own one query row (dQ) or key (dK/dV) per lane.
fn lanes_backward(req: &PlanRequest, caps: &DeviceCaps) -> Result<Planned> {
    let mut p = plan_forward(req, caps)?;
    p.clamps.retain(|c| c.field != "Br");
    let why = "lanes backward: one query row (dQ) or key (dK/dV) per lane";
    let (from, to) = (p.plan.br_formula, p.plan.bc);
    p.record("Br", from, to, why.into());
    p.plan.br = p.plan.bc;
    Ok(p)
}

/// The registers backward: Algorithm 1's values, then a micro-tile whose
/// two accumulator arrays (dK and dV) share the registers, and square tiles
/// of whole row groups (see [`super::registers`]).
fn registers_backward(req: &PlanRequest, caps: &DeviceCaps) -> Result<Planned> {
    let formula = PlanOverrides {
        br: None,
        bc: None,
        threads_per_row: None,
        kernel: Some(KernelFamily::Tiled),
        rows_per_thread: None,
        subgroup_reduce: None,
        double_buffer: None,
        ..req.overrides
    };
    let mut p = plan_forward(
        &PlanRequest {
            overrides: formula,
            ..*req
        },
        caps,
    )?;
    p.clamps.clear();
    square(&mut p);
    p.plan.kernel = KernelFamily::Registers;
    let widest = p.plan.widest_dim().div_ceil(4);
    let shape = registers::micro_tile(&mut p, req, caps, widest, 2)?;
    registers::backward_tiles(&mut p, req, caps, shape)?;
    p.kernel_reason = Some(format!(
        "registers ({}): RM {} query rows (S, dP, dQ) or keys (dK, dV) per invocation; \
         no row reductions; one buffer per tile (the tiles take turns as operands)",
        registers_reason(req, caps),
        shape.rm
    ));
    Ok(p)
}

/// The backward's tiles are square, B = Br = Bc, from Algorithm 1's
/// Br = min(Bc, d): where d is below Bc, Bc comes down to Br, and the plan
/// says so (every value that leaves the formula names its reason).
fn square(p: &mut Planned) {
    let (bc, br) = (p.plan.bc_formula, p.plan.br_formula);
    let why = "the backward's tiles are square: Bc = Br = min(Bc, d)".to_string();
    p.record("Bc", bc, br, why);
}

/// B from Algorithm 1's Br: rounded to the granularity, no longer than the
/// longer sequence.
fn square_tile(p: &mut Planned, longest: usize) -> u32 {
    let br = p.plan.br_formula;
    let mut b = round_down(br, GRANULARITY);
    let why = format!(
        "square tiles Br = Bc = min(Br, Bc), rounded down to the kernel granularity {GRANULARITY}"
    );
    p.record("B", br, b, why);
    let needed = round_up(longest, GRANULARITY);
    if b > needed {
        let why = format!("seqlen_q and seqlen_k are at most {longest}");
        p.record("B", b, needed, why);
        b = needed;
    }
    b
}

/// Shrink B until its invocations and its six tiles fit the device; returns
/// `(b, workgroup bytes)`.
fn fit(p: &mut Planned, b: u32, tc: u32, max_wg: u32, fixed: bool) -> Result<(u32, u32)> {
    let mut b = fit_invocations(p, "B", b, tc, max_wg, fixed)?;
    let (dims, m_bytes) = ([p.plan.head_dim, p.plan.head_dim_v], p.plan.m_bytes);
    let d = p.plan.widest_dim();
    let mut bytes = backward_workgroup_bytes(b, dims);
    let b0 = b;
    while bytes > m_bytes && !fixed && b > 1 {
        b = shrink(b);
        bytes = backward_workgroup_bytes(b, dims);
    }
    let why = format!("the backward keeps Q, K (2·B·d), dO, V (2·B·dv) plus P and dS (2·B²) on chip: they must fit in {m_bytes} bytes");
    p.record("B", b0, b, why);
    if bytes > m_bytes {
        return Err(Error::WorkgroupStorage {
            br: b,
            bc: b,
            head_dim: d,
            bytes,
            max: m_bytes,
        });
    }
    let (scores, accumulators) = (b.div_ceil(tc), d.div_ceil(tc));
    if scores > MAX_SCORES_PER_THREAD / 2 || accumulators > MAX_ACC_PER_THREAD / 2 {
        return Err(Error::RegisterPressure {
            threads_per_row: tc,
            scores,
            accumulators,
            max_scores: MAX_SCORES_PER_THREAD / 2,
            max_accumulators: MAX_ACC_PER_THREAD / 2,
        });
    }
    Ok((b, bytes))
}

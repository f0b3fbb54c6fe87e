//! The forward planner: a pure function from device limits and a problem to
//! a [`Planned`] plan.
//!
//! FlashAttention's Algorithm 1 keeps four tiles on chip (Q_i: Br×d, K_j and
//! V_j: Bc×d, S_ij: Br×Bc), so with M elements of workgroup storage it picks
//! `Bc = ceil(M / 4d)` and `Br = min(Bc, d)`. With v's own head dim dv the
//! Bc-row tiles are K_j (Bc×d) and V_j (Bc×dv), so `Bc = ceil(M / (2d +
//! 2dv))` (the same for dv = d). Our kernels keep those tiles in f32 (f16
//! inputs are widened on load), so M is counted in f32 elements.
//! The formula is then clamped to what the device can dispatch and what the
//! kernel can hold in registers, and every clamp is recorded with its reason.

use super::caps::DeviceCaps;
use super::coop;
use super::registers;
use super::request::{KernelFamily, PlanRequest, StorageKind};
use super::tiles::{
    fit_invocations, forward_workgroup_bytes, round_down, round_up, shrink, threads_per_row, Plan,
    Planned, GRANULARITY, MAX_ACC_PER_THREAD, MAX_SCORES_PER_THREAD, MAX_THREADS_PER_ROW,
    WORKING_BYTES,
};
use crate::api::shape::MAX_HEAD_DIM;
use crate::api::tensor::Precision;
use crate::error::{Error, Result};

/// Widest head the lanes kernels take. Their code is unrolled over the head
/// dim, and on lavapipe compiling the d 256 backward took ~80 s (d 128: ~15 s)
/// while the rows no longer fit in registers; wider heads run tiled.
pub const LANES_MAX_HEAD_DIM: usize = 128;
/// Query rows each lane of the lanes forward owns (Br = this × the subgroup
/// size): on lavapipe 2 rows ran 1.3x faster than 1 (more independent score
/// chains in flight), at twice the registers.
pub const LANES_ROWS_PER_LANE: u32 = 2;

/// Plan the forward kernel for `req` on a device with `caps`.
pub fn plan_forward(req: &PlanRequest, caps: &DeviceCaps) -> Result<Planned> {
    check_head_dims(req)?;
    let (d, dv) = (req.head_dim as u32, req.head_dim_v as u32);
    let m_bytes = match req.overrides.max_workgroup_storage {
        Some(requested) if requested > caps.max_workgroup_storage => {
            return Err(Error::StorageOverride {
                requested,
                max: caps.max_workgroup_storage,
            })
        }
        Some(cap) => cap,
        None => caps.max_workgroup_storage,
    };
    let bc_formula = (m_bytes / WORKING_BYTES).div_ceil(2 * (d + dv)).max(1);
    let kernel = choose_kernel(req, caps)?;
    let start = Planned {
        kernel_reason: tiled_reason(req, caps, kernel)
            .or_else(|| coop::coop_reason(req, caps, kernel)),
        plan: Plan {
            kernel,
            head_dim: d,
            head_dim_v: dv,
            storage: storage_kind(req, caps)?,
            m_bytes,
            bc_formula,
            br_formula: bc_formula.min(d),
            br: 0,
            bc: 0,
            threads_per_row: 0,
            workgroup_size: 0,
            workgroup_bytes: 0,
            coop: None,
            rows_per_thread: 1,
            subgroup_reduce: false,
            double_buffer: false,
        },
        clamps: Vec::new(),
    };
    match (start.plan.kernel, caps.lane_subgroup) {
        (KernelFamily::Lanes, Some(sg)) => Ok(lanes_forward(start, req, sg)),
        (KernelFamily::Coop, _) => coop::coop_forward(start, req, caps),
        (KernelFamily::Registers, _) => registers_forward(start, req, caps),
        _ => tiled_forward(start, req, caps),
    }
}

/// The registers forward: its micro-tile, then tiles that fit (see
/// [`super::registers`]); the kernel line says why each choice.
fn registers_forward(mut p: Planned, req: &PlanRequest, caps: &DeviceCaps) -> Result<Planned> {
    let v4 = p.plan.head_dim_v.div_ceil(4);
    let shape = registers::micro_tile(&mut p, req, caps, v4, 1)?;
    registers::forward_tiles(&mut p, req, caps, shape)?;
    let why = registers_reason(req, caps);
    let buffers = if p.plan.double_buffer {
        "two K/V buffers fit M"
    } else if req.overrides.double_buffer == Some(false) {
        "one K/V buffer, as asked"
    } else {
        "one K/V buffer (see the clamps)"
    };
    p.kernel_reason = Some(format!(
        "registers ({why}): RM {} rows per invocation (v rows of {} vec4s); row reductions by {} ({}); {buffers}",
        shape.rm,
        v4,
        if shape.subgroup { "subgroup shuffles" } else { "workgroup memory" },
        registers::reduce_reason(shape, caps, req.overrides),
    ));
    if let Some(coop) = coop::coop_reason(req, caps, KernelFamily::Registers) {
        p.kernel_reason = p.kernel_reason.map(|why| format!("{why}; {coop}"));
    }
    Ok(p)
}

/// Why the registers kernels run: asked for, or a hardware GPU's default.
pub(crate) fn registers_reason(req: &PlanRequest, caps: &DeviceCaps) -> &'static str {
    match req.overrides.kernel {
        Some(_) => "as asked",
        None if req.overrides.fixes_registers() => "register parameters were given",
        None if caps.hardware => "the default on a hardware GPU",
        None => "chosen",
    }
}

/// Both head dims in 1..=MAX_HEAD_DIM.
fn check_head_dims(req: &PlanRequest) -> Result<()> {
    for (dim, tensor, head_dim) in [
        ("head_dim", "q/k", req.head_dim),
        ("head_dim_v", "v", req.head_dim_v),
    ] {
        if head_dim == 0 {
            return Err(Error::EmptyDim { dim });
        }
        if head_dim > MAX_HEAD_DIM {
            return Err(Error::HeadDimTooLarge {
                tensor,
                head_dim,
                max: MAX_HEAD_DIM,
            });
        }
    }
    Ok(())
}

/// The lanes forward: one key per lane per step, `LANES_ROWS_PER_LANE`
/// query rows per lane (one for short sequences).
fn lanes_forward(mut p: Planned, req: &PlanRequest, sg: u32) -> Planned {
    // More rows per lane interleave more score chains (see
    // flash_fwd_lanes.wgsl); one is enough for short sequences.
    let rows = if req.seqlen_q > sg as usize {
        LANES_ROWS_PER_LANE
    } else {
        1
    };
    let why = format!("lanes kernel on a CPU adapter with {sg}-lane subgroups");
    let (bc0, br0) = (p.plan.bc_formula, p.plan.br_formula);
    p.record("Bc", bc0, sg, format!("{why}: one key per lane per step"));
    p.record(
        "Br",
        br0,
        sg * rows,
        format!("{why}: {rows} query rows per lane"),
    );
    p.plan = Plan {
        br: sg * rows,
        bc: sg,
        threads_per_row: 1,
        workgroup_size: sg,
        workgroup_bytes: 0,
        ..p.plan
    };
    p
}

/// The tiled forward: the formula's Br and Bc clamped to the kernel's
/// granularity, the sequence, registers, invocations and workgroup storage.
fn tiled_forward(mut p: Planned, req: &PlanRequest, caps: &DeviceCaps) -> Result<Planned> {
    let ov = req.overrides;
    let max_wg = caps.max_workgroup();
    let bc = ov.bc.unwrap_or_else(|| clamp_bc(&mut p, req.seqlen_k));
    let br = ov
        .br
        .unwrap_or_else(|| clamp_br(&mut p, req.seqlen_q, max_wg));
    if br == 0 || bc == 0 || ov.threads_per_row == Some(0) {
        return Err(Error::EmptyTile {
            br,
            bc,
            threads_per_row: ov.threads_per_row.unwrap_or(1),
        });
    }
    let dv = p.plan.head_dim_v;
    let tc = ov
        .threads_per_row
        .unwrap_or_else(|| threads_per_row(dv, br, bc, max_wg, 1));
    let br = fit_invocations(&mut p, "Br", br, tc, max_wg, ov.br.is_some())?;
    check_registers(bc, dv, tc)?;
    let (br, bc, bytes) = fit_storage(&mut p, [br, bc], tc, [ov.br.is_some(), ov.bc.is_some()])?;
    p.plan = Plan {
        br,
        bc,
        threads_per_row: tc,
        workgroup_size: br * tc,
        workgroup_bytes: bytes,
        ..p.plan
    };
    Ok(p)
}

/// Bc: the formula's value rounded to the granularity, no longer than the
/// keys, within what `MAX_THREADS_PER_ROW` invocations can hold.
fn clamp_bc(p: &mut Planned, seqlen_k: usize) -> u32 {
    let bc = p.plan.bc_formula;
    let rounded = round_down(bc, GRANULARITY);
    p.record(
        "Bc",
        bc,
        rounded,
        format!("rounded down to the kernel granularity {GRANULARITY}"),
    );
    let mut bc = rounded;
    let needed = round_up(seqlen_k, GRANULARITY);
    if bc > needed {
        p.record("Bc", bc, needed, format!("seqlen_k is only {seqlen_k}"));
        bc = needed;
    }
    let reg_max = MAX_THREADS_PER_ROW * MAX_SCORES_PER_THREAD;
    if bc > reg_max {
        let why = format!("register pressure: at most {MAX_SCORES_PER_THREAD} scores per invocation × {MAX_THREADS_PER_ROW} invocations per row");
        p.record("Bc", bc, reg_max, why);
        bc = reg_max;
    }
    bc
}

/// Br: the formula's value rounded to the granularity, no longer than the
/// rows, at most one row per invocation the device allows.
fn clamp_br(p: &mut Planned, seqlen_q: usize, max_wg: u32) -> u32 {
    let br = p.plan.br_formula;
    let rounded = round_down(br, GRANULARITY);
    p.record(
        "Br",
        br,
        rounded,
        format!("rounded down to the kernel granularity {GRANULARITY}"),
    );
    let mut br = rounded;
    let needed = round_up(seqlen_q, GRANULARITY);
    if br > needed {
        p.record("Br", br, needed, format!("seqlen_q is only {seqlen_q}"));
        br = needed;
    }
    if br > max_wg {
        let why = format!("the device allows {max_wg} invocations per workgroup");
        p.record("Br", br, max_wg, why);
        br = max_wg;
    }
    br
}

/// Every invocation's scores and output accumulators (over v's head dim)
/// must fit its registers.
fn check_registers(bc: u32, dv: u32, tc: u32) -> Result<()> {
    let (scores, accumulators) = (bc.div_ceil(tc), dv.div_ceil(tc));
    if scores > MAX_SCORES_PER_THREAD || accumulators > MAX_ACC_PER_THREAD {
        return Err(Error::RegisterPressure {
            threads_per_row: tc,
            scores,
            accumulators,
            max_scores: MAX_SCORES_PER_THREAD,
            max_accumulators: MAX_ACC_PER_THREAD,
        });
    }
    Ok(())
}

/// Shrink Bc first (it only costs more K/V passes), then Br, until the tiles
/// fit M; returns `(br, bc, workgroup bytes)`.
fn fit_storage(
    p: &mut Planned,
    [mut br, mut bc]: [u32; 2],
    tc: u32,
    [br_fixed, bc_fixed]: [bool; 2],
) -> Result<(u32, u32, u32)> {
    let (dims, m_bytes) = ([p.plan.head_dim, p.plan.head_dim_v], p.plan.m_bytes);
    let mut bytes = forward_workgroup_bytes(br, bc, dims, tc);
    let (bc0, br0) = (bc, br);
    while bytes > m_bytes {
        let shrink_bc = !bc_fixed && bc > 1 && (bc >= br || br_fixed);
        if shrink_bc {
            bc = shrink(bc);
        } else if !br_fixed && br > 1 {
            br = shrink(br);
        } else {
            return Err(Error::WorkgroupStorage {
                br,
                bc,
                head_dim: dims[0].max(dims[1]),
                bytes,
                max: m_bytes,
            });
        }
        bytes = forward_workgroup_bytes(br, bc, dims, tc);
    }
    let why = format!(
        "Q, K, V, P tiles plus row partials must fit in {m_bytes} bytes of workgroup storage"
    );
    p.record("Bc", bc0, bc, why.clone());
    p.record("Br", br0, br, why);
    Ok((br, bc, bytes))
}

/// How q, k, v and o are stored: f32; f16 native where SHADER_F16 allows
/// (unless overridden), else packed; bf16 packed (its only form).
pub(crate) fn storage_kind(req: &PlanRequest, caps: &DeviceCaps) -> Result<StorageKind> {
    Ok(match req.precision {
        Precision::F32 => StorageKind::F32,
        Precision::F16 => match req.overrides.f16_native {
            Some(true) if !caps.shader_f16 => return Err(Error::NativeF16Unavailable),
            Some(true) => StorageKind::F16Native,
            Some(false) => StorageKind::F16Packed,
            None if caps.shader_f16 => StorageKind::F16Native,
            None => StorageKind::F16Packed,
        },
        Precision::Bf16 => StorageKind::Bf16,
    })
}

/// Why `kernel` is tiled where the adapter has the lanes kernels and the
/// caller asked for neither: a head dim the lanes kernels do not take.
fn tiled_reason(req: &PlanRequest, caps: &DeviceCaps, kernel: KernelFamily) -> Option<String> {
    let ov = req.overrides;
    let chosen = ov.kernel.is_none() && !ov.fixes_tiles();
    (kernel == KernelFamily::Tiled && chosen && caps.lane_subgroup.is_some()).then(|| {
        format!(
            "tiled, not lanes: the lanes kernels take head dims that are multiples of 4 up to \
             {LANES_MAX_HEAD_DIM} (d {}, dv {}): their code is unrolled per head dim, and \
             wider rows no longer fit their registers and take lavapipe minutes to compile",
            req.head_dim, req.head_dim_v
        )
    })
}

/// The kernel family for `req`: lanes on CPU adapters with fixed subgroups
/// when both head dims allow (multiples of 4 up to [`LANES_MAX_HEAD_DIM`]:
/// the lanes code is unrolled per head dim and compiles slowly past it on
/// lavapipe) and no tile parameter is overridden; coop where
/// [`coop::coop_by_default`] says; registers on hardware GPUs or where a
/// registers parameter is given; else tiled.
pub(crate) fn choose_kernel(req: &PlanRequest, caps: &DeviceCaps) -> Result<KernelFamily> {
    let ov = req.overrides;
    let lanes_ok = |d: usize| d.is_multiple_of(4) && d <= LANES_MAX_HEAD_DIM;
    let lanes_dim = lanes_ok(req.head_dim) && lanes_ok(req.head_dim_v);
    let d = if lanes_ok(req.head_dim) {
        req.head_dim_v
    } else {
        req.head_dim
    };
    match ov.kernel {
        Some(KernelFamily::Lanes) if ov.fixes_tiles() => Err(Error::TileOverrideOnLanes),
        Some(k @ (KernelFamily::Lanes | KernelFamily::Tiled | KernelFamily::Coop))
            if ov.fixes_registers() =>
        {
            Err(Error::RegisterOverrideElsewhere { kernel: k.name() })
        }
        Some(KernelFamily::Lanes) if caps.lane_subgroup.is_none() => Err(Error::LanesUnavailable),
        Some(KernelFamily::Lanes) if !lanes_dim => Err(Error::LanesHeadDim {
            head_dim: d,
            max: LANES_MAX_HEAD_DIM,
        }),
        Some(KernelFamily::Coop) => coop::check_coop(req, caps).map(|_| KernelFamily::Coop),
        Some(kernel) => Ok(kernel),
        None if ov.fixes_registers() => Ok(KernelFamily::Registers),
        None if caps.lane_subgroup.is_some() && lanes_dim && !ov.fixes_tiles() => {
            Ok(KernelFamily::Lanes)
        }
        None if coop::coop_by_default(req, caps) => Ok(KernelFamily::Coop),
        // GPUs: the registers kernels (never on CPU adapters, whose lanes
        // or tiled kernels are the measured ones there).
        None if caps.hardware && caps.lane_subgroup.is_none() => Ok(KernelFamily::Registers),
        None => Ok(KernelFamily::Tiled),
    }
}

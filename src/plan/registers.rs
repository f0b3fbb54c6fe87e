//! The registers kernels' planner: the tiled kernels' Br/Bc formula, then
//! the micro-tile each invocation holds in registers (RM rows × its keys,
//! RM rows × its vec4 output columns), how rows are reduced (subgroup
//! shuffles or workgroup memory) and whether K/V tiles are double-buffered.
//! Every choice is explained in the plan's kernel line, every change to the
//! formula's values recorded as a clamp.

use super::caps::DeviceCaps;
use super::request::{PlanOverrides, PlanRequest};
use super::tiles::{
    padded_chunks, prev_pow2, registers_forward_bytes, round_down, round_up, shrink, Planned,
    RegTiles, GRANULARITY, WORKING_BYTES,
};
use crate::error::{Error, Result};

/// Most rows one invocation owns (RM).
pub const REG_MAX_ROWS: u32 = 8;
/// Most scores one invocation holds: RM × its keys of the tile.
pub const REG_MAX_SCORES: u32 = 32;
/// Most f32 accumulators one invocation holds: RM × 4 × its vec4 columns.
pub const REG_MAX_ACC: u32 = 64;
/// Invocations per row the planner starts from: 8 fits the smallest
/// subgroup of every GPU family we plan for (Intel's, lavapipe's), so rows
/// reduce by shuffles there too.
pub const REG_THREADS_PER_ROW: u32 = 8;
/// Invocations per workgroup the planner aims for (four warps on NVIDIA,
/// two wave32s on AMD: enough to hide the tile loads' latency).
pub const REG_TARGET_WORKGROUP: u32 = 128;

/// The registers kernels' choices before the storage fit.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Shape {
    pub rm: u32,
    pub tc: u32,
    pub subgroup: bool,
}

/// RM, invocations per row and the reduction for rows of `acc_chunks` vec4
/// columns (the widest accumulator row; `arrays` of them per invocation).
pub(crate) fn micro_tile(
    p: &mut Planned,
    req: &PlanRequest,
    caps: &DeviceCaps,
    acc_chunks: u32,
    arrays: u32,
) -> Result<Shape> {
    let ov = req.overrides;
    // Wider rows leave room for fewer of them (their accumulators).
    let wide = acc_chunks * 4;
    let default_rm = if wide <= 128 {
        4
    } else if wide <= 256 {
        2
    } else {
        1
    };
    let mut rm = ov.rows_per_thread.unwrap_or(default_rm);
    if rm == 0 || rm > REG_MAX_ROWS {
        return Err(Error::RowsPerThread {
            rows: rm,
            max: REG_MAX_ROWS,
        });
    }
    if let Some(br) = ov.br.filter(|br| !br.is_multiple_of(rm)) {
        let fit = 1 << br.trailing_zeros().min(rm.ilog2());
        let why = format!("Br {br} is not a multiple of {rm} rows per invocation");
        p.record("RM", rm, fit, why);
        rm = fit;
    }
    let per_inv = REG_MAX_ACC / (4 * rm * arrays);
    let min_tc = acc_chunks.div_ceil(per_inv.max(1)).next_power_of_two();
    let tc = ov
        .threads_per_row
        .unwrap_or_else(|| min_tc.max(REG_THREADS_PER_ROW));
    if tc == 0 {
        return Err(Error::EmptyTile {
            br: ov.br.unwrap_or(1),
            bc: ov.bc.unwrap_or(1),
            threads_per_row: 0,
        });
    }
    let subgroup = reduce_by_subgroup(tc, caps, ov)?;
    Ok(Shape { rm, tc, subgroup })
}

/// Whether rows of `tc` invocations reduce by subgroup shuffles: where the
/// device has SUBGROUP and `tc` is a power of two within its smallest
/// subgroup (so a row's invocations are lanes of one subgroup), unless the
/// caller says otherwise.
fn reduce_by_subgroup(tc: u32, caps: &DeviceCaps, ov: PlanOverrides) -> Result<bool> {
    let min = caps.subgroup.map_or(0, |s| s.min);
    let fits = tc.is_power_of_two() && tc <= min && tc <= 32;
    match ov.subgroup_reduce {
        Some(true) if !fits => Err(Error::SubgroupReduce {
            threads_per_row: tc,
            subgroup: min,
        }),
        Some(on) => Ok(on),
        None => Ok(fits),
    }
}

/// Why the rows reduce as they do, for the kernel line.
pub(crate) fn reduce_reason(s: Shape, caps: &DeviceCaps, ov: PlanOverrides) -> String {
    match (s.subgroup, caps.subgroup, ov.subgroup_reduce) {
        (_, _, Some(_)) => "as asked".into(),
        (true, Some(sg), _) => format!(
            "{} invocations per row within the smallest subgroup ({})",
            s.tc, sg.min
        ),
        (false, Some(sg), _) => format!(
            "{} invocations per row do not fit the smallest subgroup ({}) as a power of two",
            s.tc, sg.min
        ),
        (false, None, _) | (true, None, _) => "the device has no SUBGROUP".into(),
    }
}

/// The forward's Br, Bc and K/V buffers for micro-tile `s`: the formula's
/// values clamped to the registers and the device, shrunk to fit M, with a
/// second K/V buffer where it still fits. Fills `p.plan`.
pub(crate) fn forward_tiles(
    p: &mut Planned,
    req: &PlanRequest,
    caps: &DeviceCaps,
    s: Shape,
) -> Result<()> {
    let ov = req.overrides;
    let max_wg = caps.max_workgroup();
    let br = ov
        .br
        .unwrap_or_else(|| row_groups(p, "Br", req.seqlen_q, s, max_wg, u32::MAX));
    let bc = ov.bc.unwrap_or_else(|| clamp_bc(p, req.seqlen_k, s));
    if br == 0 || bc == 0 {
        return Err(Error::EmptyTile {
            br,
            bc,
            threads_per_row: s.tc,
        });
    }
    if (br / s.rm) * s.tc > max_wg {
        return Err(Error::WorkgroupTooLarge {
            invocations: (br / s.rm) * s.tc,
            max: max_wg,
        });
    }
    let scores = bc.div_ceil(s.tc) * s.rm;
    if scores > REG_MAX_SCORES {
        return Err(Error::RegisterPressure {
            threads_per_row: s.tc,
            scores,
            accumulators: s.rm * 4 * p.plan.head_dim_v.div_ceil(4).div_ceil(s.tc),
            max_scores: REG_MAX_SCORES,
            max_accumulators: REG_MAX_ACC,
        });
    }
    let (br, bc, double) = fit_forward(p, ov, s, [br, bc])?;
    let tiles = reg_tiles(s, br, bc, 1 + double as u32);
    p.plan.br = br;
    p.plan.bc = bc;
    p.plan.threads_per_row = s.tc;
    p.plan.workgroup_size = (br / s.rm) * s.tc;
    p.plan.workgroup_bytes = registers_forward_bytes(tiles, [p.plan.head_dim, p.plan.head_dim_v]);
    p.plan.rows_per_thread = s.rm;
    p.plan.subgroup_reduce = s.subgroup;
    p.plan.double_buffer = double;
    Ok(())
}

/// Rows of a tile (`field`): row groups of RM rows filling the target
/// workgroup (and `max_rows`), no more than `seqlen` needs.
fn row_groups(
    p: &mut Planned,
    field: &'static str,
    seqlen: usize,
    s: Shape,
    max_wg: u32,
    max_rows: u32,
) -> u32 {
    let groups = prev_pow2((REG_TARGET_WORKGROUP.min(max_wg) / s.tc).max(1));
    let from = p.plan.br_formula;
    let mut rows = (groups * s.rm).min(max_rows / s.rm * s.rm).max(s.rm);
    let why = format!(
        "{} row groups of {} rows × {} invocations per row (about {REG_TARGET_WORKGROUP} invocations{})",
        rows / s.rm,
        s.rm,
        s.tc,
        if max_rows < u32::MAX { ", registers" } else { "" }
    );
    p.record(field, from, rows, why);
    let needed = round_up(seqlen, s.rm).max(s.rm);
    let short = (prev_pow2(needed / s.rm).max(1) * s.rm).max(s.rm);
    if short < rows {
        p.record(
            field,
            rows,
            short,
            format!("the sequences are only {seqlen} long"),
        );
        rows = short;
    }
    rows
}

fn reg_tiles(s: Shape, br: u32, bc: u32, buffers: u32) -> RegTiles {
    RegTiles {
        br,
        bc,
        threads_per_row: s.tc,
        buffers,
        subgroup_reduce: s.subgroup,
    }
}

/// Shrink Bc, then Br (whole row groups), until the tiles fit M — with a
/// second K/V buffer if forced —; then add the second buffer where it
/// fits. Returns `(br, bc, double-buffered)`.
fn fit_forward(
    p: &mut Planned,
    ov: PlanOverrides,
    s: Shape,
    [mut br, mut bc]: [u32; 2],
) -> Result<(u32, u32, bool)> {
    let dims = [p.plan.head_dim, p.plan.head_dim_v];
    let m = p.plan.m_bytes;
    let forced = if ov.double_buffer == Some(true) { 2 } else { 1 };
    let bytes = |br, bc, n| registers_forward_bytes(reg_tiles(s, br, bc, n), dims);
    let (br0, bc0) = (br, bc);
    while bytes(br, bc, forced) > m {
        if ov.bc.is_none() && bc > 1 && (bc >= br || ov.br.is_some()) {
            bc = shrink(bc);
        } else if ov.br.is_none() && br > s.rm {
            br = (br / 2).max(s.rm) / s.rm * s.rm;
        } else {
            return Err(Error::WorkgroupStorage {
                br,
                bc,
                head_dim: dims[0].max(dims[1]),
                bytes: bytes(br, bc, forced),
                max: m,
            });
        }
    }
    let why = format!(
        "Q, K, V, P tiles (vec4 rows, Q and K padded) must fit in {m} bytes of workgroup storage"
    );
    p.record("Bc", bc0, bc, why.clone());
    p.record("Br", br0, br, why);
    let want = ov.double_buffer.unwrap_or(true);
    let double = want && bytes(br, bc, 2) <= m;
    if want && !double {
        let why = format!(
            "a second K/V buffer needs {} bytes, more than M = {m}",
            bytes(br, bc, 2)
        );
        p.record("K/V buffers", 2, 1, why);
    }
    Ok((br, bc, double))
}

/// Bc: the formula's value rounded to the granularity, no longer than the
/// keys, at most the scores the registers hold.
fn clamp_bc(p: &mut Planned, seqlen_k: usize, s: Shape) -> u32 {
    let bc = p.plan.bc_formula;
    let mut out = round_down(bc, GRANULARITY);
    p.record(
        "Bc",
        bc,
        out,
        format!("rounded down to the kernel granularity {GRANULARITY}"),
    );
    let needed = round_up(seqlen_k, GRANULARITY);
    if out > needed {
        p.record("Bc", out, needed, format!("seqlen_k is only {seqlen_k}"));
        out = needed;
    }
    let reg_max = s.tc * (REG_MAX_SCORES / s.rm);
    if out > reg_max {
        let why = format!(
            "registers: {} rows × at most {} keys per invocation ({REG_MAX_SCORES} scores) × {} invocations per row",
            s.rm,
            REG_MAX_SCORES / s.rm,
            s.tc
        );
        p.record("Bc", out, reg_max, why);
        out = reg_max;
    }
    out
}

/// Workgroup bytes of each registers backward kernel: Q·scale and K (B
/// padded vec4 rows of d), dO and V (B padded vec4 rows of dv), P and dS
/// (B×B), LSE and D per row, all f32.
pub fn registers_backward_bytes(b: u32, [d, dv]: [u32; 2]) -> u32 {
    let (dp, vp) = (padded_chunks(d.div_ceil(4)), padded_chunks(dv.div_ceil(4)));
    WORKING_BYTES * (2 * 4 * b * (dp + vp) + 2 * b * b + 2 * b)
}

/// The backward's square tile B (rows of query and key blocks) for
/// micro-tile `s`: a whole number of RM-row groups, within the registers'
/// scores (S and dP), the device's invocations and M. Fills `p.plan`.
pub(crate) fn backward_tiles(
    p: &mut Planned,
    req: &PlanRequest,
    caps: &DeviceCaps,
    s: Shape,
) -> Result<()> {
    let ov = req.overrides;
    let max_wg = caps.max_workgroup();
    let longest = req.seqlen_q.max(req.seqlen_k);
    // S and dP: 2 × RM × ceil(B / tc) scores.
    let reg_max = s.tc * (REG_MAX_SCORES / (2 * s.rm)).max(1);
    let mut b = ov
        .br
        .or(ov.bc)
        .unwrap_or_else(|| row_groups(p, "B", longest, s, max_wg, reg_max));
    if b == 0 {
        return Err(Error::EmptyTile {
            br: 0,
            bc: 0,
            threads_per_row: s.tc,
        });
    }
    let fixed = ov.br.is_some() || ov.bc.is_some();
    let dims = [p.plan.head_dim, p.plan.head_dim_v];
    let m = p.plan.m_bytes;
    let b0 = b;
    while ((b / s.rm) * s.tc > max_wg || registers_backward_bytes(b, dims) > m)
        && !fixed
        && b > s.rm
    {
        b = (b / 2).max(s.rm) / s.rm * s.rm;
    }
    let why = format!("Q, dO, K, V tiles, P and dS must fit in {m} bytes and {max_wg} invocations");
    p.record("B", b0, b, why);
    if (b / s.rm) * s.tc > max_wg || !b.is_multiple_of(s.rm) {
        return Err(Error::WorkgroupTooLarge {
            invocations: b.div_ceil(s.rm) * s.tc,
            max: max_wg,
        });
    }
    let bytes = registers_backward_bytes(b, dims);
    if bytes > m {
        return Err(Error::WorkgroupStorage {
            br: b,
            bc: b,
            head_dim: dims[0].max(dims[1]),
            bytes,
            max: m,
        });
    }
    let scores = 2 * s.rm * b.div_ceil(s.tc);
    if scores > REG_MAX_SCORES {
        return Err(Error::RegisterPressure {
            threads_per_row: s.tc,
            scores,
            accumulators: 0,
            max_scores: REG_MAX_SCORES,
            max_accumulators: REG_MAX_ACC,
        });
    }
    p.plan.br = b;
    p.plan.bc = b;
    p.plan.threads_per_row = s.tc;
    p.plan.workgroup_size = (b / s.rm) * s.tc;
    p.plan.workgroup_bytes = bytes;
    p.plan.rows_per_thread = s.rm;
    p.plan.subgroup_reduce = false;
    p.plan.double_buffer = false;
    Ok(())
}

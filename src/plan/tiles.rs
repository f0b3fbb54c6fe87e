//! The planner's result: a [`Plan`] (tile sizes and thread layout, defined
//! with the call statistics that report it) and, beside it,
//! the [`Clamp`]s that explain every departure from FlashAttention's formula.
//! The workgroup bytes the kernels declare are computed here, from the same
//! fields the shaders are built from.

pub use crate::api::kernel_plan::Plan;
use crate::api::kernel_plan::KernelFamily;

/// Bytes per on-chip element: tiles are f32 whatever the storage precision.
pub const WORKING_BYTES: u32 = 4;
/// Br and Bc are multiples of this (when at least this large).
pub const GRANULARITY: u32 = 4;
/// Most scores one invocation holds in registers (Bc / threads_per_row).
pub const MAX_SCORES_PER_THREAD: u32 = 16;
/// Most output columns one invocation accumulates (head dim / threads_per_row).
pub const MAX_ACC_PER_THREAD: u32 = 32;
/// Invocations per workgroup the planner aims for. Fewer invocations per
/// row means more work per invocation between barriers; on lavapipe, 64
/// measured fastest for both passes (forward Br 32 × 2, backward B 16–24 × 4:
/// 1.2x and 1.8x less CPU time than 256), and 64 is two warps on NVIDIA.
pub const TARGET_WORKGROUP: u32 = 64;
/// Most invocations that share one query row.
pub const MAX_THREADS_PER_ROW: u32 = 32;

impl Plan {
    /// Scores each invocation holds: `ceil(bc / threads_per_row)`.
    pub fn scores_per_thread(&self) -> u32 {
        self.bc.div_ceil(self.threads_per_row)
    }

    /// Output (and dV) columns each invocation accumulates: `ceil(dv /
    /// threads_per_row)`.
    pub fn acc_per_thread(&self) -> u32 {
        self.head_dim_v.div_ceil(self.threads_per_row)
    }

    /// dQ and dK columns each invocation accumulates: `ceil(d / threads_per_row)`.
    pub fn acc_k_per_thread(&self) -> u32 {
        self.head_dim.div_ceil(self.threads_per_row)
    }

    /// The wider of the two head dims.
    pub fn widest_dim(&self) -> u32 {
        self.head_dim.max(self.head_dim_v)
    }

    /// M in f32 elements.
    pub fn m_elements(&self) -> u32 {
        self.m_bytes / WORKING_BYTES
    }

    /// Registers kernels: vec4 chunks of a q/k row and of a v/o row.
    pub fn chunks(&self) -> [u32; 2] {
        [self.head_dim.div_ceil(4), self.head_dim_v.div_ceil(4)]
    }

    /// Registers kernels: vec4 output columns each invocation accumulates
    /// per row (v's chunks, or with `k` q/k's, over threads_per_row).
    pub fn acc_chunks(&self, k: bool) -> u32 {
        self.chunks()[!k as usize].div_ceil(self.threads_per_row)
    }

    /// K/V tile buffers of the registers kernels.
    pub fn buffers(&self) -> u32 {
        1 + self.double_buffer as u32
    }
}

impl std::fmt::Display for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let dims = if self.head_dim_v == self.head_dim {
            format!("d = {}", self.head_dim)
        } else {
            format!("d = {}, dv = {}", self.head_dim, self.head_dim_v)
        };
        writeln!(
            f,
            "M = {} bytes = {} f32 elements; {dims}; storage {}",
            self.m_bytes,
            self.m_elements(),
            self.storage.name()
        )?;
        let formula = if self.head_dim_v == self.head_dim {
            "ceil(M/4d)"
        } else {
            "ceil(M/(2d + 2dv))"
        };
        writeln!(
            f,
            "formula: Bc = {formula} = {}, Br = min(Bc, d) = {}",
            self.bc_formula, self.br_formula
        )?;
        if self.kernel == KernelFamily::Lanes {
            writeln!(
                f,
                "kernel: lanes — a CPU adapter with {}-lane subgroups: each lane owns rows, \
                 K/V rows are shared by subgroup broadcast, no workgroup storage (see the clamps)",
                self.bc
            )?;
        }
        if let Some(form) = self.coop {
            writeln!(
                f,
                "kernel: coop — Q·Kᵀ and P·V on {} (one subgroup per tile), online softmax in \
                 workgroup memory",
                form.name()
            )?;
        }
        if self.kernel == KernelFamily::Registers {
            writeln!(
                f,
                "kernel: registers — each invocation holds {} rows × {} keys of S and {} rows × {} \
                 vec4 columns of O in registers; the forward's row reductions by {}, its K/V tiles {}",
                self.rows_per_thread,
                self.scores_per_thread(),
                self.rows_per_thread,
                self.acc_chunks(false),
                if self.subgroup_reduce {
                    "subgroup shuffles"
                } else {
                    "workgroup memory"
                },
                if self.double_buffer {
                    "double-buffered"
                } else {
                    "single-buffered"
                }
            )?;
        }
        write!(
            f,
            "plan: Br = {}, Bc = {}, threads/row = {}, workgroup = {} invocations, {} bytes of workgroup storage",
            self.br, self.bc, self.threads_per_row, self.workgroup_size, self.workgroup_bytes
        )
    }
}

/// One change the planner made to the formula's value, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Clamp {
    /// The field moved.
    pub field: &'static str,
    /// Its value before.
    pub from: u32,
    /// Its value after.
    pub to: u32,
    /// Why.
    pub reason: String,
}

impl std::fmt::Display for Clamp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let Clamp {
            field,
            from,
            to,
            reason,
        } = self;
        write!(f, "{field} {from} -> {to}: {reason}")
    }
}

/// A plan and the explanation of every clamp that produced it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Planned {
    /// The plan.
    pub plan: Plan,
    /// Where the planner moved a value, and why.
    pub clamps: Vec<Clamp>,
    /// Why the planner took the tiled kernels on an adapter that has the
    /// lanes ones (the head dims), or took or passed over the coop kernel on
    /// a device with cooperative matrices, if it did; for the registers
    /// kernels, why each of their choices.
    pub kernel_reason: Option<String>,
}

impl Planned {
    /// Record that the planner moved `field` from `from` to `to` (if it did).
    pub(crate) fn record(&mut self, field: &'static str, from: u32, to: u32, reason: String) {
        record(&mut self.clamps, field, from, to, reason);
    }
}

impl std::fmt::Display for Planned {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(f, "{}", self.plan)?;
        if let Some(why) = &self.kernel_reason {
            writeln!(f, "kernel: {why}")?;
        }
        if self.clamps.is_empty() {
            return write!(f, "clamps: none");
        }
        write!(f, "clamps:")?;
        for c in &self.clamps {
            write!(f, "\n  - {c}")?;
        }
        Ok(())
    }
}

/// Push a clamp of `field` from `from` to `to` (if it moved).
pub(crate) fn record(
    clamps: &mut Vec<Clamp>,
    field: &'static str,
    from: u32,
    to: u32,
    reason: String,
) {
    if from != to {
        clamps.push(Clamp {
            field,
            from,
            to,
            reason,
        });
    }
}

/// Workgroup bytes of the forward kernel: Q (Br×d), K (Bc×d), V (Bc×dv),
/// P (Br×Bc) and one partial per invocation for row reductions, all f32.
pub fn forward_workgroup_bytes(br: u32, bc: u32, [d, dv]: [u32; 2], threads_per_row: u32) -> u32 {
    WORKING_BYTES * (br * d + bc * d + bc * dv + br * bc + br * threads_per_row)
}

/// Workgroup bytes of each backward kernel: Q·scale and K tiles (B×d), dO
/// and V tiles (B×dv), P and dS (B×B), and LSE and D per row, all f32.
pub fn backward_workgroup_bytes(b: u32, [d, dv]: [u32; 2]) -> u32 {
    WORKING_BYTES * (2 * b * d + 2 * b * dv + 2 * b * b + 2 * b)
}

/// A registers tile's row stride in vec4s: odd, so that invocations reading
/// consecutive rows of it hit different memory banks.
pub fn padded_chunks(chunks: u32) -> u32 {
    chunks | 1
}

/// The shape of a registers kernel's workgroup (what its storage depends on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RegTiles {
    pub br: u32,
    pub bc: u32,
    pub threads_per_row: u32,
    pub buffers: u32,
    pub subgroup_reduce: bool,
}

/// Workgroup bytes of the registers forward: Q (Br rows of padded vec4
/// chunks), `buffers` × (K with padded rows, V), P (Br×Bc), and without
/// subgroup reductions one partial per row and invocation, all f32.
pub fn registers_forward_bytes(t: RegTiles, [d, dv]: [u32; 2]) -> u32 {
    let (dp, v4) = (padded_chunks(d.div_ceil(4)), dv.div_ceil(4));
    let partials = if t.subgroup_reduce {
        0
    } else {
        t.br * t.threads_per_row
    };
    WORKING_BYTES * (4 * t.br * dp + t.buffers * 4 * t.bc * (dp + v4) + t.br * t.bc + partials)
}

/// `x` rounded down to a multiple of `g` (unless smaller than `g`).
pub(crate) fn round_down(x: u32, g: u32) -> u32 {
    if x >= g {
        x / g * g
    } else {
        x
    }
}

/// `x` rounded up to a multiple of `g`, saturating far below `u32::MAX`.
pub(crate) fn round_up(x: usize, g: u32) -> u32 {
    let x = x.min(u32::MAX as usize / 2) as u32;
    x.div_ceil(g) * g
}

/// The largest power of two `<= x` (1 for 0).
pub(crate) fn prev_pow2(x: u32) -> u32 {
    if x == 0 {
        1
    } else {
        1 << (31 - x.leading_zeros())
    }
}

/// Invocations per row: enough that each holds at most its share of
/// `arrays` score and accumulator arrays within the register budget
/// (`MAX_SCORES_PER_THREAD`, `MAX_ACC_PER_THREAD`, split between the
/// arrays), enough to fill the target workgroup, never more than the
/// device allows.
pub(crate) fn threads_per_row(d: u32, rows: u32, cols: u32, max_wg: u32, arrays: u32) -> u32 {
    let min_tc = d
        .div_ceil(MAX_ACC_PER_THREAD / arrays)
        .max(cols.div_ceil(MAX_SCORES_PER_THREAD / arrays))
        .next_power_of_two();
    prev_pow2((TARGET_WORKGROUP.min(max_wg) / rows).max(1))
        .min(MAX_THREADS_PER_ROW)
        .min(cols.next_power_of_two())
        .max(min_tc)
}

/// Fewer rows per workgroup (`field`: Br or B) until `rows × tc`
/// invocations fit the device, unless the rows are `fixed`.
pub(crate) fn fit_invocations(
    p: &mut Planned,
    field: &'static str,
    mut rows: u32,
    tc: u32,
    max_wg: u32,
    fixed: bool,
) -> crate::error::Result<u32> {
    while rows * tc > max_wg && !fixed && rows > 1 {
        let next = shrink(rows);
        let why = format!(
            "{rows} rows × {tc} invocations exceeds the device's {max_wg} invocations per workgroup"
        );
        p.record(field, rows, next, why);
        rows = next;
    }
    if rows * tc > max_wg {
        return Err(crate::error::Error::WorkgroupTooLarge {
            invocations: rows * tc,
            max: max_wg,
        });
    }
    Ok(rows)
}

/// The next smaller tile size: one granularity step down, at least 1.
pub(crate) fn shrink(b: u32) -> u32 {
    round_down(b - 1, GRANULARITY).max(1).min(b - 1)
}

//! The tile planner: a pure function from device limits and a problem to a [`Plan`].
//!
//! FlashAttention's Algorithm 1 keeps four tiles on chip (Q_i: Br×d, K_j and
//! V_j: Bc×d, S_ij: Br×Bc), so with M elements of workgroup storage it picks
//! `Bc = ceil(M / 4d)` and `Br = min(Bc, d)`. Our kernels keep those tiles in
//! f32 (f16 inputs are widened on load), so M is counted in f32 elements.
//! The formula is then clamped to what the device can dispatch and what the
//! kernel can hold in registers, and every clamp is recorded with its reason.
//! [`forward_workgroup_bytes`] is the single source of truth for the bytes the
//! shader declares: the shader text is generated from the same Plan fields.

use crate::error::{Error, Result};
use crate::tensor::{AttentionShape, Precision, MAX_HEAD_DIM};

/// Bytes per on-chip element: tiles are f32 whatever the storage precision.
pub const WORKING_BYTES: u32 = 4;
/// Br and Bc are multiples of this (when at least this large).
pub const GRANULARITY: u32 = 4;
/// Most scores one invocation holds in registers (Bc / threads_per_row).
pub const MAX_SCORES_PER_THREAD: u32 = 16;
/// Most output columns one invocation accumulates (head_dim / threads_per_row).
pub const MAX_ACC_PER_THREAD: u32 = 32;
/// Invocations per workgroup the planner aims for. Fewer invocations per
/// row means more work per invocation between barriers; on lavapipe, 64
/// measured fastest for both passes (forward Br 32 × 2, backward B 16–24 × 4:
/// 1.2x and 1.8x less CPU time than 256), and 64 is two warps on NVIDIA.
pub const TARGET_WORKGROUP: u32 = 64;
/// Most invocations that share one query row.
pub const MAX_THREADS_PER_ROW: u32 = 32;

/// The device limits the planner reads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceCaps {
    /// `max_compute_workgroup_storage_size`, bytes (M).
    pub max_workgroup_storage: u32,
    /// `max_compute_invocations_per_workgroup`.
    pub max_invocations: u32,
    /// `max_compute_workgroup_size_x`.
    pub max_workgroup_size_x: u32,
    /// SHADER_F16: native `f16` in storage buffers.
    pub shader_f16: bool,
    /// `Some(n)` on CPU adapters (lavapipe) whose subgroups are always `n`
    /// SIMD lanes and that support subgroup operations: there the lanes
    /// kernel ([`KernelFamily::Lanes`]) is the fast forward.
    pub lane_subgroup: Option<u32>,
}

impl DeviceCaps {
    pub fn from_wgpu(limits: &wgpu::Limits, features: wgpu::Features) -> Self {
        Self {
            max_workgroup_storage: limits.max_compute_workgroup_storage_size,
            max_invocations: limits.max_compute_invocations_per_workgroup,
            max_workgroup_size_x: limits.max_compute_workgroup_size_x,
            shader_f16: features.contains(wgpu::Features::SHADER_F16),
            lane_subgroup: None,
        }
    }

    /// The limits of a device with this adapter: [`DeviceCaps::from_wgpu`]
    /// plus the lanes kernel on CPU adapters with fixed-size subgroups.
    pub fn from_adapter(
        limits: &wgpu::Limits,
        features: wgpu::Features,
        info: &wgpu::AdapterInfo,
    ) -> Self {
        let fixed = info.subgroup_min_size == info.subgroup_max_size;
        let lanes = info.device_type == wgpu::DeviceType::Cpu
            && features.contains(wgpu::Features::SUBGROUP)
            && fixed
            && LANE_SUBGROUPS.contains(&info.subgroup_min_size);
        Self {
            lane_subgroup: lanes.then_some(info.subgroup_min_size),
            ..Self::from_wgpu(limits, features)
        }
    }

    /// WebGPU's default limits (what a browser grants unless asked for more).
    pub fn webgpu_default() -> Self {
        Self {
            max_workgroup_storage: 16384,
            max_invocations: 256,
            max_workgroup_size_x: 256,
            shader_f16: false,
            lane_subgroup: None,
        }
    }
}

/// Subgroup sizes the lanes kernel is generated for.
pub const LANE_SUBGROUPS: [u32; 3] = [4, 8, 16];
/// Widest head the lanes kernels take. Their code is unrolled over the head
/// dim, and on lavapipe compiling the d 256 backward took ~80 s (d 128: ~15 s)
/// while the rows no longer fit in registers; wider heads run tiled.
pub const LANES_MAX_HEAD_DIM: usize = 128;
/// Query rows each lane of the lanes forward owns (Br = this × the subgroup
/// size): on lavapipe 2 rows ran 1.3x faster than 1 (more independent score
/// chains in flight), at twice the registers.
pub const LANES_ROWS_PER_LANE: u32 = 2;

/// Which family of kernels a plan runs (forward or backward).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum KernelFamily {
    /// `flash_fwd.wgsl`, `flash_bwd_*.wgsl`: tiles in workgroup memory, sized
    /// by the Br/Bc formula. The kernels for GPUs (and for every head dim).
    #[default]
    Tiled,
    /// `flash_fwd_lanes.wgsl`, `flash_bwd_lanes.wgsl`: one row per lane of a
    /// subgroup-sized workgroup, the other operand's rows shared by subgroup
    /// broadcast, no workgroup memory. For CPU adapters, where
    /// per-invocation memory accesses are what costs.
    Lanes,
}

impl KernelFamily {
    pub fn name(self) -> &'static str {
        match self {
            KernelFamily::Tiled => "tiled",
            KernelFamily::Lanes => "lanes",
        }
    }
}

impl std::str::FromStr for KernelFamily {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "tiled" => Ok(KernelFamily::Tiled),
            "lanes" => Ok(KernelFamily::Lanes),
            _ => Err(Error::Option(format!(
                "unknown kernel `{s}` (expected `tiled` or `lanes`)"
            ))),
        }
    }
}

/// How q, k, v and o are stored in the kernel's storage buffers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum StorageKind {
    F32,
    /// f16 pairs packed in `u32`, `unpack2x16float`: runs on every adapter.
    F16Packed,
    /// `enable f16;` and `array<f16>`: needs SHADER_F16.
    F16Native,
}

impl StorageKind {
    pub fn precision(self) -> Precision {
        match self {
            StorageKind::F32 => Precision::F32,
            StorageKind::F16Packed | StorageKind::F16Native => Precision::F16,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            StorageKind::F32 => "f32",
            StorageKind::F16Packed => "f16 (packed u32)",
            StorageKind::F16Native => "f16 (native)",
        }
    }
}

/// Caller overrides of the planner's choices; `None` keeps the planner's value.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct PlanOverrides {
    pub br: Option<u32>,
    pub bc: Option<u32>,
    pub threads_per_row: Option<u32>,
    /// Cap M below the device's limit (Theorem 2 sweeps, browser-like limits).
    pub max_workgroup_storage: Option<u32>,
    /// For f16: force the packed (`false`) or native (`true`) path.
    pub f16_native: Option<bool>,
    /// Force the kernel family (`Lanes` needs a CPU adapter with fixed
    /// subgroups and a head dim that is a multiple of 4).
    pub kernel: Option<KernelFamily>,
}

impl PlanOverrides {
    /// Whether any tile parameter is fixed, which only the tiled kernel has.
    fn fixes_tiles(&self) -> bool {
        self.br.is_some()
            || self.bc.is_some()
            || self.threads_per_row.is_some()
            || self.max_workgroup_storage.is_some()
    }
}

/// What the planner is asked to plan for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PlanRequest {
    pub head_dim: usize,
    pub precision: Precision,
    /// Query rows per (batch, head); Br is not made larger than needed.
    pub seqlen_q: usize,
    /// Keys per (batch, head); Bc is not made larger than needed.
    pub seqlen_k: usize,
    pub overrides: PlanOverrides,
}

impl PlanRequest {
    pub fn new(head_dim: usize, precision: Precision) -> Self {
        Self {
            head_dim,
            precision,
            seqlen_q: usize::MAX,
            seqlen_k: usize::MAX,
            overrides: PlanOverrides::default(),
        }
    }

    /// The request for a whole attention problem.
    pub fn for_shape(
        shape: &AttentionShape,
        precision: Precision,
        overrides: PlanOverrides,
    ) -> Self {
        Self::new(shape.head_dim, precision)
            .seqlens(shape.seqlen_q, shape.seqlen_k)
            .overrides(overrides)
    }

    pub fn seqlens(mut self, seqlen_q: usize, seqlen_k: usize) -> Self {
        self.seqlen_q = seqlen_q;
        self.seqlen_k = seqlen_k;
        self
    }

    pub fn overrides(mut self, overrides: PlanOverrides) -> Self {
        self.overrides = overrides;
        self
    }
}

/// One change the planner made to the formula's value, and why.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Clamp {
    pub field: &'static str,
    pub from: u32,
    pub to: u32,
    pub reason: String,
}

impl std::fmt::Display for Clamp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} -> {}: {}",
            self.field, self.from, self.to, self.reason
        )
    }
}

/// Tile sizes and thread layout of the forward kernel.
///
/// Each workgroup owns `br` query rows of one (batch, head) and loops over
/// key/value blocks of `bc` rows; `threads_per_row` invocations share a row.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Plan {
    /// The kernel family; a lanes plan has `br = bc = ` the subgroup size,
    /// one invocation per row and no workgroup storage.
    pub kernel: KernelFamily,
    pub head_dim: u32,
    pub storage: StorageKind,
    /// M in bytes, as used (the device limit or an override).
    pub m_bytes: u32,
    /// The formula's values before clamping: `ceil(M/4d)` and `min(that, d)`.
    pub bc_formula: u32,
    pub br_formula: u32,
    pub br: u32,
    pub bc: u32,
    pub threads_per_row: u32,
    /// `br * threads_per_row`.
    pub workgroup_size: u32,
    /// Bytes of `var<workgroup>` the kernel declares.
    pub workgroup_bytes: u32,
    pub clamps: Vec<Clamp>,
}

impl Plan {
    /// Scores each invocation holds: `ceil(bc / threads_per_row)`.
    pub fn scores_per_thread(&self) -> u32 {
        self.bc.div_ceil(self.threads_per_row)
    }

    /// Output columns each invocation accumulates: `ceil(d / threads_per_row)`.
    pub fn acc_per_thread(&self) -> u32 {
        self.head_dim.div_ceil(self.threads_per_row)
    }

    /// M in f32 elements.
    pub fn m_elements(&self) -> u32 {
        self.m_bytes / WORKING_BYTES
    }
}

impl std::fmt::Display for Plan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "M = {} bytes = {} f32 elements; d = {}; storage {}",
            self.m_bytes,
            self.m_elements(),
            self.head_dim,
            self.storage.name()
        )?;
        writeln!(
            f,
            "formula: Bc = ceil(M/4d) = {}, Br = min(Bc, d) = {}",
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
        writeln!(
            f,
            "plan: Br = {}, Bc = {}, threads/row = {}, workgroup = {} invocations, {} bytes of workgroup storage",
            self.br, self.bc, self.threads_per_row, self.workgroup_size, self.workgroup_bytes
        )?;
        if self.clamps.is_empty() {
            write!(f, "clamps: none")
        } else {
            write!(f, "clamps:")?;
            for c in &self.clamps {
                write!(f, "\n  - {c}")?;
            }
            Ok(())
        }
    }
}

/// Workgroup bytes of the forward kernel: Q (Br×d), K and V (Bc×d), P (Br×Bc)
/// and one partial per invocation for row reductions, all f32.
pub fn forward_workgroup_bytes(br: u32, bc: u32, head_dim: u32, threads_per_row: u32) -> u32 {
    WORKING_BYTES * (br * head_dim + 2 * bc * head_dim + br * bc + br * threads_per_row)
}

/// Record that the planner moved `field` from `from` to `to` (if it did).
fn record_clamp(clamps: &mut Vec<Clamp>, field: &'static str, from: u32, to: u32, reason: String) {
    if from != to {
        clamps.push(Clamp {
            field,
            from,
            to,
            reason,
        });
    }
}

fn round_down(x: u32, g: u32) -> u32 {
    if x >= g {
        x / g * g
    } else {
        x
    }
}

fn round_up(x: usize, g: u32) -> u32 {
    let x = x.min(u32::MAX as usize / 2) as u32;
    x.div_ceil(g) * g
}

fn prev_pow2(x: u32) -> u32 {
    if x == 0 {
        1
    } else {
        1 << (31 - x.leading_zeros())
    }
}

/// Plan the forward kernel for `req` on a device with `caps`.
pub fn plan_forward(req: &PlanRequest, caps: &DeviceCaps) -> Result<Plan> {
    let d = req.head_dim as u32;
    if req.head_dim == 0 || req.head_dim > MAX_HEAD_DIM {
        return Err(Error::Shape(format!(
            "head_dim {} is outside 1..={MAX_HEAD_DIM}",
            req.head_dim
        )));
    }
    let ov = req.overrides;
    let storage = storage_kind(req, caps)?;
    let m_bytes = match ov.max_workgroup_storage {
        Some(cap) if cap > caps.max_workgroup_storage => {
            return Err(Error::Plan(format!(
                "requested workgroup storage {cap} bytes exceeds the device maximum {}",
                caps.max_workgroup_storage
            )))
        }
        Some(cap) => cap,
        None => caps.max_workgroup_storage,
    };
    let m = m_bytes / WORKING_BYTES;
    let bc_formula = m.div_ceil(4 * d).max(1);
    let br_formula = bc_formula.min(d);
    if let (KernelFamily::Lanes, Some(sg)) = (choose_kernel(req, caps)?, caps.lane_subgroup) {
        // More rows per lane interleave more score chains (see
        // flash_fwd_lanes.wgsl); one is enough for short sequences.
        let rows = if req.seqlen_q > sg as usize {
            LANES_ROWS_PER_LANE
        } else {
            1
        };
        let mut clamps = Vec::new();
        let why = format!("lanes kernel on a CPU adapter with {sg}-lane subgroups");
        record_clamp(
            &mut clamps,
            "Bc",
            bc_formula,
            sg,
            format!("{why}: one key per lane per step"),
        );
        record_clamp(
            &mut clamps,
            "Br",
            br_formula,
            sg * rows,
            format!("{why}: {rows} query rows per lane"),
        );
        return Ok(Plan {
            kernel: KernelFamily::Lanes,
            head_dim: d,
            storage,
            m_bytes,
            bc_formula,
            br_formula,
            br: sg * rows,
            bc: sg,
            threads_per_row: 1,
            workgroup_size: sg,
            workgroup_bytes: 0,
            clamps,
        });
    }
    let mut clamps = Vec::new();
    let mut clamp = |field, from, to, reason| record_clamp(&mut clamps, field, from, to, reason);

    let max_wg = caps.max_invocations.min(caps.max_workgroup_size_x).max(1);

    // --- Bc ---
    let mut bc = bc_formula;
    let rounded = round_down(bc, GRANULARITY);
    clamp(
        "Bc",
        bc,
        rounded,
        format!("rounded down to the kernel granularity {GRANULARITY}"),
    );
    bc = rounded;
    let needed = round_up(req.seqlen_k, GRANULARITY);
    if bc > needed {
        clamp(
            "Bc",
            bc,
            needed,
            format!("seqlen_k is only {}", req.seqlen_k),
        );
        bc = needed;
    }
    let bc_reg_max = MAX_THREADS_PER_ROW * MAX_SCORES_PER_THREAD;
    if bc > bc_reg_max {
        clamp(
            "Bc",
            bc,
            bc_reg_max,
            format!(
                "register pressure: at most {MAX_SCORES_PER_THREAD} scores per invocation × {MAX_THREADS_PER_ROW} invocations per row"
            ),
        );
        bc = bc_reg_max;
    }
    if let Some(o) = ov.bc {
        bc = o;
    }

    // --- Br ---
    let mut br = br_formula;
    let rounded = round_down(br, GRANULARITY);
    clamp(
        "Br",
        br,
        rounded,
        format!("rounded down to the kernel granularity {GRANULARITY}"),
    );
    br = rounded;
    let needed = round_up(req.seqlen_q, GRANULARITY);
    if br > needed {
        clamp(
            "Br",
            br,
            needed,
            format!("seqlen_q is only {}", req.seqlen_q),
        );
        br = needed;
    }
    if br > max_wg {
        clamp(
            "Br",
            br,
            max_wg,
            format!("the device allows {max_wg} invocations per workgroup"),
        );
        br = max_wg;
    }
    if let Some(o) = ov.br {
        br = o;
    }
    if br == 0 || bc == 0 {
        return Err(Error::Plan(format!(
            "Br and Bc must be at least 1 (Br {br}, Bc {bc})"
        )));
    }

    // --- threads per row: enough to keep registers bounded, enough to fill
    // the target workgroup, never more than the device allows.
    let target = TARGET_WORKGROUP.min(max_wg);
    let min_tc = d
        .div_ceil(MAX_ACC_PER_THREAD)
        .max(bc.div_ceil(MAX_SCORES_PER_THREAD))
        .next_power_of_two();
    let mut tc = prev_pow2((target / br).max(1))
        .min(MAX_THREADS_PER_ROW)
        .min(bc.next_power_of_two())
        .max(min_tc);
    if let Some(o) = ov.threads_per_row {
        tc = o;
    }
    if tc == 0 {
        return Err(Error::Plan("threads_per_row must be at least 1".into()));
    }
    // Too many invocations: fewer rows per workgroup.
    while br * tc > max_wg && ov.br.is_none() && br > 1 {
        let next = round_down(br - 1, GRANULARITY).max(1).min(br - 1);
        clamp(
            "Br",
            br,
            next,
            format!("{br} rows × {tc} invocations exceeds the device's {max_wg} invocations per workgroup"),
        );
        br = next;
    }
    if br * tc > max_wg {
        return Err(Error::Plan(format!(
            "workgroup of {} invocations (Br {br} × {tc} per row) exceeds the device maximum {max_wg}",
            br * tc
        )));
    }
    if bc.div_ceil(tc) > MAX_SCORES_PER_THREAD || d.div_ceil(tc) > MAX_ACC_PER_THREAD {
        return Err(Error::Plan(format!(
            "{tc} invocations per row leave {} scores and {} accumulators per invocation (max {MAX_SCORES_PER_THREAD} and {MAX_ACC_PER_THREAD})",
            bc.div_ceil(tc),
            d.div_ceil(tc)
        )));
    }

    // --- fit the workgroup storage: shrink Bc first (it only costs more
    // K/V passes), then Br.
    let mut bytes = forward_workgroup_bytes(br, bc, d, tc);
    if bytes > m_bytes && (ov.bc.is_some() && ov.br.is_some()) {
        return Err(Error::Plan(format!(
            "tiles Br {br} × Bc {bc} at d {d} need {bytes} bytes of workgroup storage, the maximum is {m_bytes}"
        )));
    }
    let (bc0, br0) = (bc, br);
    while bytes > m_bytes {
        if ov.bc.is_none() && bc > 1 && (bc >= br || ov.br.is_some()) {
            bc = round_down(bc - 1, GRANULARITY).max(1).min(bc - 1);
        } else if ov.br.is_none() && br > 1 {
            br = round_down(br - 1, GRANULARITY).max(1).min(br - 1);
        } else {
            return Err(Error::Plan(format!(
                "tiles Br {br} × Bc {bc} at d {d} need {bytes} bytes of workgroup storage, the maximum is {m_bytes}"
            )));
        }
        bytes = forward_workgroup_bytes(br, bc, d, tc);
    }
    let why = format!(
        "Q, K, V, P tiles plus row partials must fit in {m_bytes} bytes of workgroup storage"
    );
    clamp("Bc", bc0, bc, why.clone());
    clamp("Br", br0, br, why);

    Ok(Plan {
        kernel: KernelFamily::Tiled,
        head_dim: d,
        storage,
        m_bytes,
        bc_formula,
        br_formula,
        br,
        bc,
        threads_per_row: tc,
        workgroup_size: br * tc,
        workgroup_bytes: bytes,
        clamps,
    })
}

/// How q, k, v and o are stored: f32, or f16 native where SHADER_F16 allows
/// (unless overridden), else packed.
fn storage_kind(req: &PlanRequest, caps: &DeviceCaps) -> Result<StorageKind> {
    Ok(match req.precision {
        Precision::F32 => StorageKind::F32,
        Precision::F16 => match req.overrides.f16_native {
            Some(true) if !caps.shader_f16 => {
                return Err(Error::Unsupported(
                    "native f16 needs the SHADER_F16 feature, which this adapter lacks".into(),
                ))
            }
            Some(true) => StorageKind::F16Native,
            Some(false) => StorageKind::F16Packed,
            None if caps.shader_f16 => StorageKind::F16Native,
            None => StorageKind::F16Packed,
        },
    })
}

/// The kernel family for `req`: lanes on CPU adapters with fixed subgroups
/// when the head dim allows and no tile parameter is overridden, else tiled.
fn choose_kernel(req: &PlanRequest, caps: &DeviceCaps) -> Result<KernelFamily> {
    let ov = req.overrides;
    let d = req.head_dim;
    match ov.kernel {
        Some(KernelFamily::Lanes) if ov.fixes_tiles() => Err(Error::Plan(
            "Br, Bc, threads per row and workgroup storage apply to the tiled kernel only".into(),
        )),
        Some(KernelFamily::Lanes) if caps.lane_subgroup.is_none() => Err(Error::Unsupported(
            "the lanes kernel needs a CPU adapter with fixed-size subgroups and subgroup operations"
                .into(),
        )),
        Some(KernelFamily::Lanes) if d % 4 != 0 || d > LANES_MAX_HEAD_DIM => {
            Err(Error::Plan(format!(
                "the lanes kernels need a head dim that is a multiple of 4 up to {LANES_MAX_HEAD_DIM}, not {d}"
            )))
        }
        Some(kernel) => Ok(kernel),
        None if caps.lane_subgroup.is_some()
            && d % 4 == 0
            && d <= LANES_MAX_HEAD_DIM
            && !ov.fixes_tiles() =>
        {
            Ok(KernelFamily::Lanes)
        }
        None => Ok(KernelFamily::Tiled),
    }
}

/// Workgroup bytes of each backward kernel: Q·scale, dO, K, V tiles (B×d),
/// P and dS (B×B), and LSE and D per row, all f32.
pub fn backward_workgroup_bytes(b: u32, head_dim: u32) -> u32 {
    WORKING_BYTES * (4 * b * head_dim + 2 * b * b + 2 * b)
}

/// Plan the backward kernels. They keep six tiles on chip instead of four, so
/// starting from Algorithm 1's values the square tile B = Br = Bc shrinks until
/// Q, dO, K, V, P and dS fit, and the planner says so.
pub fn plan_backward(req: &PlanRequest, caps: &DeviceCaps) -> Result<Plan> {
    if choose_kernel(req, caps)? == KernelFamily::Lanes {
        // The lanes backward kernels own one row (dQ) or key (dK/dV) per lane.
        let mut fwd = plan_forward(req, caps)?;
        fwd.clamps.retain(|c| c.field != "Br");
        let why = "lanes backward: one query row (dQ) or key (dK/dV) per lane";
        record_clamp(&mut fwd.clamps, "Br", fwd.br_formula, fwd.bc, why.into());
        return Ok(Plan { br: fwd.bc, ..fwd });
    }
    let fwd = plan_forward(
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
    let d = fwd.head_dim;
    let m_bytes = fwd.m_bytes;
    let max_wg = caps.max_invocations.min(caps.max_workgroup_size_x).max(1);
    let mut clamps = Vec::new();
    let mut clamp = |field, from, to, reason| record_clamp(&mut clamps, field, from, to, reason);
    let mut b = round_down(fwd.br_formula, GRANULARITY);
    clamp("B", fwd.br_formula, b, format!("square tiles Br = Bc = min(Br, Bc), rounded down to the kernel granularity {GRANULARITY}"));
    let needed = round_up(req.seqlen_q.max(req.seqlen_k), GRANULARITY);
    if b > needed {
        clamp(
            "B",
            b,
            needed,
            format!(
                "seqlen_q and seqlen_k are at most {}",
                req.seqlen_q.max(req.seqlen_k)
            ),
        );
        b = needed;
    }
    if let Some(o) = req.overrides.br.or(req.overrides.bc) {
        b = o;
    }
    if b == 0 {
        return Err(Error::Plan("the backward tile B must be at least 1".into()));
    }
    // Two score arrays (S, dP) and two accumulator arrays (dK and dV) per invocation.
    let min_tc = d
        .div_ceil(MAX_ACC_PER_THREAD / 2)
        .max(b.div_ceil(MAX_SCORES_PER_THREAD / 2))
        .next_power_of_two();
    let mut tc = prev_pow2((TARGET_WORKGROUP.min(max_wg) / b).max(1))
        .min(MAX_THREADS_PER_ROW)
        .min(b.next_power_of_two())
        .max(min_tc);
    if let Some(o) = req.overrides.threads_per_row {
        tc = o;
    }
    let fixed = req.overrides.br.is_some() || req.overrides.bc.is_some();
    let shrink = |b: u32| round_down(b - 1, GRANULARITY).max(1).min(b - 1);
    while b * tc > max_wg && !fixed && b > 1 {
        let next = shrink(b);
        clamp("B", b, next, format!("{b} rows × {tc} invocations exceeds the device's {max_wg} invocations per workgroup"));
        b = next;
    }
    let mut bytes = backward_workgroup_bytes(b, d);
    let b0 = b;
    while bytes > m_bytes && !fixed && b > 1 {
        b = shrink(b);
        bytes = backward_workgroup_bytes(b, d);
    }
    clamp(
        "B",
        b0,
        b,
        format!("the backward keeps Q, dO, K, V (4·B·d) plus P and dS (2·B²) on chip: they must fit in {m_bytes} bytes"),
    );
    if bytes > m_bytes || b * tc > max_wg {
        return Err(Error::Plan(format!(
            "backward tile B {b} at d {d} needs {bytes} bytes of workgroup storage (max {m_bytes}) and {} invocations (max {max_wg})",
            b * tc
        )));
    }
    if b.div_ceil(tc) > MAX_SCORES_PER_THREAD / 2 || d.div_ceil(tc) > MAX_ACC_PER_THREAD / 2 {
        return Err(Error::Plan(format!(
            "{tc} invocations per row leave too many registers per invocation at B {b}, d {d}"
        )));
    }
    Ok(Plan {
        kernel: KernelFamily::Tiled,
        head_dim: d,
        storage: fwd.storage,
        m_bytes,
        bc_formula: fwd.bc_formula,
        br_formula: fwd.br_formula,
        br: b,
        bc: b,
        threads_per_row: tc,
        workgroup_size: b * tc,
        workgroup_bytes: bytes,
        clamps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(kib: u32) -> DeviceCaps {
        DeviceCaps {
            max_workgroup_storage: kib * 1024,
            max_invocations: 1024,
            max_workgroup_size_x: 1024,
            shader_f16: false,
            lane_subgroup: None,
        }
    }

    #[test]
    fn lanes_kernel_on_cpu_adapters_only() {
        let cpu = DeviceCaps {
            lane_subgroup: Some(8),
            ..caps(32)
        };
        let p = plan_forward(&PlanRequest::new(64, Precision::F32), &cpu).unwrap();
        assert_eq!(p.kernel, KernelFamily::Lanes);
        assert_eq!((p.br, p.bc, p.threads_per_row), (16, 8, 1));
        // Every departure from the formula says why.
        assert_eq!(p.clamps.len(), 2, "{p}");
        assert!(p.clamps.iter().all(|c| c.reason.contains("lanes kernel")));
        let short = PlanRequest::new(64, Precision::F32).seqlens(5, 100);
        assert_eq!(plan_forward(&short, &cpu).unwrap().br, 8);
        assert_eq!((p.workgroup_size, p.workgroup_bytes), (8, 0));
        // The formula's values are still reported next to the lanes kernel.
        assert_eq!((p.bc_formula, p.br_formula), (32, 32));
        assert!(p.to_string().contains("kernel: lanes"), "{p}");
        // GPUs, head dims that are not a multiple of 4, and tile overrides: tiled.
        let gpu = plan_forward(&PlanRequest::new(64, Precision::F32), &caps(32)).unwrap();
        assert_eq!(gpu.kernel, KernelFamily::Tiled);
        let odd = plan_forward(&PlanRequest::new(59, Precision::F16), &cpu).unwrap();
        assert_eq!(odd.kernel, KernelFamily::Tiled);
        let sweep = PlanRequest::new(64, Precision::F32).overrides(PlanOverrides {
            max_workgroup_storage: Some(8192),
            ..Default::default()
        });
        assert_eq!(
            plan_forward(&sweep, &cpu).unwrap().kernel,
            KernelFamily::Tiled
        );
        // Forcing either kernel.
        let force = |kernel, d| {
            plan_forward(
                &PlanRequest::new(d, Precision::F32).overrides(PlanOverrides {
                    kernel: Some(kernel),
                    ..Default::default()
                }),
                &cpu,
            )
        };
        assert_eq!(
            force(KernelFamily::Tiled, 64).unwrap().kernel,
            KernelFamily::Tiled
        );
        assert!(force(KernelFamily::Lanes, 62)
            .unwrap_err()
            .to_string()
            .contains("multiple of 4"));
        assert!(force(KernelFamily::Lanes, 256).is_err());
        assert_eq!(
            plan_forward(&PlanRequest::new(256, Precision::F32), &cpu)
                .unwrap()
                .kernel,
            KernelFamily::Tiled
        );
        let on_gpu = plan_forward(
            &PlanRequest::new(64, Precision::F32).overrides(PlanOverrides {
                kernel: Some(KernelFamily::Lanes),
                ..Default::default()
            }),
            &caps(32),
        );
        assert!(matches!(on_gpu, Err(Error::Unsupported(_))), "{on_gpu:?}");
        // The backward follows: lanes where the forward is lanes, else tiles.
        let bwd = plan_backward(&PlanRequest::new(64, Precision::F32), &cpu).unwrap();
        assert_eq!(bwd.kernel, KernelFamily::Lanes);
        assert_eq!((bwd.br, bwd.workgroup_bytes), (8, 0));
        let bwd = plan_backward(&PlanRequest::new(64, Precision::F32), &caps(32)).unwrap();
        assert_eq!(bwd.kernel, KernelFamily::Tiled);
        assert!(bwd.workgroup_bytes > 0);
        assert_eq!(
            "lanes".parse::<KernelFamily>().unwrap(),
            KernelFamily::Lanes
        );
        assert!("wide".parse::<KernelFamily>().is_err());
    }

    #[test]
    fn formula_is_pinned() {
        // lavapipe: M = 32 KiB = 8192 f32 elements, d = 64: Bc = ceil(8192/256) = 32.
        let p = plan_forward(&PlanRequest::new(64, Precision::F32), &caps(32)).unwrap();
        assert_eq!((p.bc_formula, p.br_formula), (32, 32));
        assert_eq!((p.bc, p.br), (32, 32));
        assert!(p.workgroup_bytes <= 32 * 1024);
        // Bc = ceil(M/4d) rounds up: M = 100 KiB, d = 59 → ceil(25600/236) = 109.
        let p = plan_forward(&PlanRequest::new(59, Precision::F32), &caps(100)).unwrap();
        assert_eq!(p.bc_formula, 109);
        assert_eq!(p.br_formula, 59);
    }

    #[test]
    fn every_limit_and_head_dim_fits() {
        for kib in [16, 32, 48, 64, 100, 228] {
            for d in [32, 64, 128, 256] {
                let c = caps(kib);
                let p = plan_forward(&PlanRequest::new(d, Precision::F32), &c).unwrap();
                let m = kib * 1024 / 4;
                assert_eq!(p.bc_formula, m.div_ceil(4 * d as u32), "{kib} KiB d {d}");
                assert_eq!(p.br_formula, p.bc_formula.min(d as u32));
                assert!(p.br <= p.br_formula && p.bc <= p.bc_formula);
                assert_eq!(
                    p.workgroup_bytes,
                    forward_workgroup_bytes(p.br, p.bc, d as u32, p.threads_per_row)
                );
                assert!(p.workgroup_bytes <= c.max_workgroup_storage, "{p}");
                assert!(p.workgroup_size <= c.max_invocations);
                assert!(p.scores_per_thread() <= MAX_SCORES_PER_THREAD);
                assert!(p.acc_per_thread() <= MAX_ACC_PER_THREAD);
                if p.br >= GRANULARITY {
                    assert_eq!(p.br % GRANULARITY, 0);
                }
                // Every deviation from the formula is explained.
                if p.bc != p.bc_formula {
                    assert!(p.clamps.iter().any(|c| c.field == "Bc"), "{p}");
                }
                if p.br != p.br_formula {
                    assert!(p.clamps.iter().any(|c| c.field == "Br"), "{p}");
                }
            }
        }
    }

    #[test]
    fn larger_memory_never_gives_smaller_tiles() {
        for d in [32, 64, 128, 256] {
            let mut last = 0;
            for kib in [16, 32, 48, 64, 100, 228] {
                let p = plan_forward(&PlanRequest::new(d, Precision::F32), &caps(kib)).unwrap();
                assert!(p.bc >= last, "d {d} {kib} KiB");
                last = p.bc;
            }
        }
    }

    #[test]
    fn storage_clamp_is_recorded() {
        // M = 1000 bytes = 250 elements, d = 8: Bc = ceil(250/32) = 8 = Br, but the
        // tiles plus row partials need 4·(64 + 128 + 64 + 8·8) = 1280 bytes.
        let c = DeviceCaps {
            max_workgroup_storage: 1000,
            ..caps(1)
        };
        let p = plan_forward(&PlanRequest::new(8, Precision::F32), &c).unwrap();
        assert_eq!((p.bc_formula, p.br_formula), (8, 8));
        assert!(p.workgroup_bytes <= 1000, "{p}");
        assert!(
            p.clamps
                .iter()
                .any(|c| c.reason.contains("workgroup storage")),
            "{p}"
        );
    }

    #[test]
    fn invocation_limit_clamps_br() {
        let c = DeviceCaps {
            max_invocations: 64,
            max_workgroup_size_x: 64,
            ..caps(64)
        };
        let p = plan_forward(&PlanRequest::new(64, Precision::F32), &c).unwrap();
        assert!(p.workgroup_size <= 64);
        assert!(
            p.clamps.iter().any(|c| c.reason.contains("invocations")),
            "{p}"
        );
    }

    #[test]
    fn short_sequences_shrink_tiles() {
        let p = plan_forward(
            &PlanRequest::new(64, Precision::F32).seqlens(1, 3),
            &caps(32),
        )
        .unwrap();
        assert_eq!((p.br, p.bc), (4, 4));
        assert!(p.clamps.iter().any(|c| c.reason.contains("seqlen_q")));
    }

    #[test]
    fn overrides_are_checked() {
        let req = PlanRequest::new(64, Precision::F32).overrides(PlanOverrides {
            br: Some(64),
            bc: Some(64),
            ..Default::default()
        });
        let err = plan_forward(&req, &caps(16)).unwrap_err().to_string();
        assert!(err.contains("bytes of workgroup storage"), "{err}");
        let req = PlanRequest::new(64, Precision::F32).overrides(PlanOverrides {
            br: Some(8),
            bc: Some(16),
            ..Default::default()
        });
        let p = plan_forward(&req, &caps(32)).unwrap();
        assert_eq!((p.br, p.bc), (8, 16));
    }

    #[test]
    fn f16_path_follows_features() {
        let p = plan_forward(&PlanRequest::new(64, Precision::F16), &caps(32)).unwrap();
        assert_eq!(p.storage, StorageKind::F16Packed);
        let c = DeviceCaps {
            shader_f16: true,
            ..caps(32)
        };
        let p = plan_forward(&PlanRequest::new(64, Precision::F16), &c).unwrap();
        assert_eq!(p.storage, StorageKind::F16Native);
        let req = PlanRequest::new(64, Precision::F16).overrides(PlanOverrides {
            f16_native: Some(true),
            ..Default::default()
        });
        assert!(plan_forward(&req, &caps(32)).is_err());
    }

    #[test]
    fn backward_tiles_are_smaller_and_fit() {
        for kib in [16, 32, 48, 64, 100, 228] {
            for d in [32, 64, 128, 256] {
                let c = caps(kib);
                let f = plan_forward(&PlanRequest::new(d, Precision::F32), &c).unwrap();
                let p = plan_backward(&PlanRequest::new(d, Precision::F32), &c).unwrap();
                assert_eq!(p.br, p.bc);
                assert!(p.br <= f.br, "{kib} KiB d {d}");
                assert_eq!(p.workgroup_bytes, backward_workgroup_bytes(p.br, d as u32));
                assert!(p.workgroup_bytes <= c.max_workgroup_storage);
                assert!(p.workgroup_size <= c.max_invocations);
            }
        }
        // lavapipe, d = 64: Algorithm 1 gives 32, the backward's six tiles need 24.
        let p = plan_backward(&PlanRequest::new(64, Precision::F32), &caps(32)).unwrap();
        assert!(p.br < 32);
        assert!(
            p.clamps.iter().any(|c| c.reason.contains("P and dS")),
            "{p}"
        );
    }

    #[test]
    fn browser_limits_plan_every_head_dim() {
        for d in 1..=256 {
            let c = DeviceCaps::webgpu_default();
            let p = plan_forward(&PlanRequest::new(d, Precision::F32), &c).unwrap();
            assert!(p.workgroup_bytes <= c.max_workgroup_storage, "d {d}: {p}");
            assert!(p.workgroup_size <= c.max_invocations, "d {d}: {p}");
            let p = plan_backward(&PlanRequest::new(d, Precision::F32), &c).unwrap();
            assert!(p.workgroup_bytes <= c.max_workgroup_storage, "d {d}: {p}");
            assert!(p.workgroup_size <= c.max_invocations, "d {d}: {p}");
        }
    }

    #[test]
    fn tiny_and_odd_head_dims_plan() {
        for d in [1, 3, 16, 59, 111, 255] {
            for kib in [16, 32] {
                let c = DeviceCaps {
                    max_invocations: 256,
                    max_workgroup_size_x: 256,
                    ..caps(kib)
                };
                let p = plan_forward(&PlanRequest::new(d, Precision::F32), &c).unwrap();
                assert!(p.workgroup_bytes <= c.max_workgroup_storage);
                assert!(p.workgroup_size <= 256);
            }
        }
    }
}

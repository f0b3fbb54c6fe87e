//! The flash backward's kernels: D = rowsum(dO·O) (`flash_bwd_pre`), dK/dV
//! over key blocks and dQ over query blocks, tiled (`flash_bwd_{dkdv,dq}.wgsl`
//! on `flash_bwd_common.wgsl`) or lanes (`flash_bwd_lanes.wgsl`), and with
//! sinks their gradients in two passes (`flash_bwd_sinks.wgsl`). All
//! atomic-free and deterministic; both P/dS kernels share their arithmetic
//! (`flash_bwd_math.wgsl`).

use super::compose::{
    binding, section, unroll, Access, Composer, KernelSource, Variant, DROPOUT,
};
use super::flash_forward::{lanes_unroll, registers_pieces};
use super::loops::{constant, counted, keep_tile, LoopCost, LoopDim, GUARD, VARLEN_SEARCH};
use super::params::Params;
use super::walk::{Sequences, Walk};
use crate::api::output::Accesses;
use crate::plan::{padded_chunks, KernelFamily, Plan, StorageKind};

const PRE: &str = include_str!("../../shaders/flash_bwd_pre.wgsl");
const MATH: &str = include_str!("../../shaders/flash_bwd_math.wgsl");
const COMMON: &str = include_str!("../../shaders/flash_bwd_common.wgsl");
const DKDV: &str = include_str!("../../shaders/flash_bwd_dkdv.wgsl");
const DQ: &str = include_str!("../../shaders/flash_bwd_dq.wgsl");
const LANES: &str = include_str!("../../shaders/flash_bwd_lanes.wgsl");
const SINKS: &str = include_str!("../../shaders/flash_bwd_sinks.wgsl");
const REGISTERS: &str = include_str!("../../shaders/flash_bwd_regs.wgsl");

/// Rows of D computed per workgroup of the `Dvec` kernel.
pub const PRE_ROWS: u32 = 64;
/// Rows each invocation of the sinks' first pass sums (64 invocations a
/// workgroup: one partial per 1024 rows of a head).
pub const SINK_ROWS: u32 = 16;
const SINK_WORKGROUP: u32 = 64;

/// Which of the backward kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackwardPart {
    /// D = rowsum(dO·O), one invocation per row.
    Dvec,
    /// dK and dV, one workgroup per key block of one kv head.
    DkDv,
    /// dQ, one workgroup per query block of one head.
    Dq,
    /// The sinks' gradient partials, one workgroup per chunk of a head's rows.
    SinkPartials,
    /// Each head's partials summed in order.
    SinkReduce,
}

/// One backward kernel for one plan and variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlashBackward {
    pub part: BackwardPart,
    pub plan: Plan,
    pub variant: Variant,
}

/// Device buffers of a backward.
#[derive(Clone, Copy, Debug)]
pub struct BackwardBuffers<'a> {
    pub q: &'a wgpu::Buffer,
    pub k: &'a wgpu::Buffer,
    pub v: &'a wgpu::Buffer,
    pub o: &'a wgpu::Buffer,
    pub d_o: &'a wgpu::Buffer,
    pub lse: &'a wgpu::Buffer,
    /// D = rowsum(dO·O), f32, lse's layout.
    pub dvec: &'a wgpu::Buffer,
    pub dq: &'a wgpu::Buffer,
    pub dk: &'a wgpu::Buffer,
    pub dv: &'a wgpu::Buffer,
    /// With sinks: the partials (heads_q × chunks, f32) and dsinks (heads_q, f32).
    pub dsinks: Option<[&'a wgpu::Buffer; 2]>,
}

/// The tensors of a backward as ranges of an app's device buffers (offsets
/// multiples of the device's `min_storage_buffer_offset_alignment`): the
/// forward's inputs and outputs, the output gradient `d_o`, and the
/// gradients written. Layouts and sizes as the host tensors'. All may lie in
/// one buffer; the gradients' ranges (and scratch's) may not intersect any
/// other range. `scratch`, where given, holds the call's scratch
/// (`Engine::scratch_size` bytes); else the engine creates it.
#[derive(Clone, Debug)]
pub struct GradientBindings<'a> {
    /// q, as the forward read it.
    pub q: wgpu::BufferBinding<'a>,
    /// k.
    pub k: wgpu::BufferBinding<'a>,
    /// v.
    pub v: wgpu::BufferBinding<'a>,
    /// The forward's o.
    pub o: wgpu::BufferBinding<'a>,
    /// The gradient of o.
    pub d_o: wgpu::BufferBinding<'a>,
    /// The forward's lse (f32).
    pub lse: wgpu::BufferBinding<'a>,
    /// dq, written.
    pub dq: wgpu::BufferBinding<'a>,
    /// dk, written.
    pub dk: wgpu::BufferBinding<'a>,
    /// dv, written.
    pub dv: wgpu::BufferBinding<'a>,
    /// Scratch of [`crate::Engine::scratch_size`] bytes where the call needs it.
    pub scratch: Option<wgpu::BufferBinding<'a>>,
}

/// [`BackwardBuffers`] as the ranges the kernels bind (an app's
/// sub-allocations, or whole buffers).
#[derive(Clone, Debug)]
pub struct BackwardBindings<'a> {
    pub q: wgpu::BufferBinding<'a>,
    pub k: wgpu::BufferBinding<'a>,
    pub v: wgpu::BufferBinding<'a>,
    pub o: wgpu::BufferBinding<'a>,
    pub d_o: wgpu::BufferBinding<'a>,
    pub lse: wgpu::BufferBinding<'a>,
    pub dvec: wgpu::BufferBinding<'a>,
    pub dq: wgpu::BufferBinding<'a>,
    pub dk: wgpu::BufferBinding<'a>,
    pub dv: wgpu::BufferBinding<'a>,
    pub dsinks: Option<[wgpu::BufferBinding<'a>; 2]>,
}

impl<'a> BackwardBindings<'a> {
    /// An app's ranges and D's scratch (no sinks).
    pub fn from_gradients(g: GradientBindings<'a>, dvec: wgpu::BufferBinding<'a>) -> Self {
        Self {
            dvec,
            dsinks: None,
            q: g.q,
            k: g.k,
            v: g.v,
            o: g.o,
            d_o: g.d_o,
            lse: g.lse,
            dq: g.dq,
            dk: g.dk,
            dv: g.dv,
        }
    }
}

impl<'a> BackwardBuffers<'a> {
    /// Every buffer whole.
    pub fn bindings(&self) -> BackwardBindings<'a> {
        let w = |b: &'a wgpu::Buffer| b.as_entire_buffer_binding();
        BackwardBindings {
            q: w(self.q),
            k: w(self.k),
            v: w(self.v),
            o: w(self.o),
            d_o: w(self.d_o),
            lse: w(self.lse),
            dvec: w(self.dvec),
            dq: w(self.dq),
            dk: w(self.dk),
            dv: w(self.dv),
            dsinks: self.dsinks.map(|[a, b]| [w(a), w(b)]),
        }
    }
}

impl FlashBackward {
    /// The kernel of `part` in a backward planned as `plan` with `variant`,
    /// keyed by what its code reads. D and the sinks' passes are elementwise
    /// and read no mask, layout or score term, so they get one pipeline per
    /// precision (and, for D, per v head dim) whatever the tiles: a driver
    /// compiles them once, not once per backward plan.
    pub fn new(part: BackwardPart, plan: Plan, variant: Variant) -> Self {
        let elementwise = Variant {
            count_io: variant.count_io,
            loop_check: variant.loop_check,
            aliased: variant.aliased,
            ..Variant::default()
        };
        let (plan, variant) = match part {
            BackwardPart::DkDv | BackwardPart::Dq => (plan, variant),
            BackwardPart::Dvec => (elementwise_plan(plan.storage, plan.head_dim_v), elementwise),
            BackwardPart::SinkPartials => (
                elementwise_plan(StorageKind::F32, 1),
                Variant {
                    sinks: true,
                    ..elementwise
                },
            ),
            BackwardPart::SinkReduce => (elementwise_plan(StorageKind::F32, 1), elementwise),
        };
        Self {
            part,
            plan,
            variant,
        }
    }

    pub fn name(&self) -> &'static str {
        match self.part {
            BackwardPart::Dvec => "backward D = rowsum(dO·O)",
            BackwardPart::DkDv => "backward dK/dV",
            BackwardPart::Dq => "backward dQ",
            BackwardPart::SinkPartials => "backward dsinks partials",
            BackwardPart::SinkReduce => "backward dsinks",
        }
    }

    pub fn source(&self) -> KernelSource {
        let mut c = self.prelude();
        match self.part {
            BackwardPart::Dvec => {
                c.storage(
                    self.plan.storage,
                    &[
                        ("do", binding::DO, Access::Read),
                        ("o", binding::O, Access::Read),
                    ],
                )
                .buffers(StorageKind::F32, &[("dvec", binding::DVEC, Access::Write)])
                .push(PRE);
            }
            BackwardPart::DkDv => {
                use binding::{DK, DV};
                let writes = [("dk", DK, Access::Write), ("dv", DV, Access::Write)];
                self.gradient_kernel(&mut c, &writes, DKDV, "dkdv");
            }
            BackwardPart::Dq => {
                self.gradient_kernel(&mut c, &[("dq", binding::DQ, Access::Write)], DQ, "dq");
            }
            BackwardPart::SinkPartials | BackwardPart::SinkReduce => self.sinks_kernel(&mut c),
        }
        c.finish("main")
    }

    /// One pass of the sinks' gradients (f32 buffers only).
    fn sinks_kernel(&self, c: &mut Composer) {
        use binding::*;
        let buffers: &[(&str, u32, Access)] = match self.part {
            BackwardPart::SinkPartials => &[
                ("lse", LSE, Access::Read),
                ("dvec", DVEC, Access::Read),
                ("part", DSINK_PART, Access::Write),
            ],
            _ => &[
                ("part", DSINK_PART, Access::Read),
                ("dsinks", DSINKS, Access::Write),
            ],
        };
        let pass = match self.part {
            BackwardPart::SinkPartials => "partials",
            _ => "reduce",
        };
        c.const_u32("SINK_ROWS", SINK_ROWS)
            .buffers(StorageKind::F32, buffers)
            .push(&section(SINKS, "shared"))
            .push(&section(SINKS, pass));
    }

    /// Overrides and constants of the plan, then common.wgsl.
    fn prelude(&self) -> Composer {
        let p = &self.plan;
        let mut c = Composer::new(p.storage);
        c.override_u32("D", p.head_dim)
            .override_u32("DV", p.head_dim_v);
        match p.kernel {
            KernelFamily::Lanes => c.override_u32("SG", p.bc),
            KernelFamily::Registers => {
                let [d4, v4] = p.chunks();
                c.override_u32("B", p.br)
                    .override_u32("D4", d4)
                    .override_u32("DV4", v4)
                    .override_u32("DM4", d4.max(v4))
                    .override_u32("DP", padded_chunks(d4))
                    .override_u32("VP", padded_chunks(v4))
                    .override_u32("TC", p.threads_per_row)
                    .override_u32("WG", p.workgroup_size)
                    .const_u32("RM", p.rows_per_thread)
                    .const_u32("SC", p.scores_per_thread())
                    .const_u32("ACC_K", p.acc_chunks(true))
                    .const_u32("ACC_V", p.acc_chunks(false))
            }
            // Backward plans are never coop (plan_backward plans tiled).
            KernelFamily::Tiled | KernelFamily::Coop => c
                .override_u32("B", p.br)
                .override_u32("DM", p.widest_dim())
                .override_u32("TC", p.threads_per_row)
                .override_u32("WG", p.workgroup_size)
                .const_u32("SC", p.scores_per_thread())
                .const_u32("ACC_K", p.acc_k_per_thread())
                .const_u32("ACC_V", p.acc_per_thread()),
        };
        c.common(self.variant);
        c
    }

    /// A P/dS kernel: q, k, v, do, lse, D read; `writes` written; the body
    /// `tiled`, or the lanes or registers file's section `section_name`.
    fn gradient_kernel(
        &self,
        c: &mut Composer,
        writes: &[(&str, u32, Access)],
        tiled: &str,
        section_name: &str,
    ) {
        use binding::*;
        let lanes = self.plan.kernel == KernelFamily::Lanes;
        let read = if lanes { Access::Read4 } else { Access::Read };
        let mut buffers = vec![
            ("q", Q, read),
            ("k", K, read),
            ("v", V, read),
            ("do", DO, read),
        ];
        buffers.extend_from_slice(writes);
        c.storage(self.plan.storage, &buffers)
            .buffers(
                StorageKind::F32,
                &[("lse", LSE, Access::Read), ("dvec", DVEC, Access::Read)],
            )
            .push(MATH);
        match self.plan.kernel {
            KernelFamily::Lanes => {
                c.push(&section(DROPOUT, "lanes"));
                let body = section(LANES, section_name);
                c.push(&unroll(&body, lanes_unroll(&self.plan)));
            }
            KernelFamily::Registers => {
                registers_pieces(c, &["q", "k", "v", "do"]);
                c.push(&section(REGISTERS, "common"))
                    .push(&section(REGISTERS, section_name))
                    .keep_tile("B", "B", "f32");
            }
            // Backward plans are never coop (plan_backward plans tiled).
            KernelFamily::Tiled | KernelFamily::Coop => {
                c.push(COMMON).push(tiled).keep_tile("B", "B", "f32");
            }
        }
    }

    /// The grid of one dispatch over `seqs` (the dispatch's params `p`):
    /// rows for D (spread over x and y past `max_groups`), key blocks × kv
    /// heads for dK/dV, query blocks × heads for dQ, z the batch (dense);
    /// the sinks' chunks × heads, then heads.
    pub fn grid(&self, p: &Params, seqs: &Sequences, max_groups: u32) -> [u32; 3] {
        let (b, z) = (self.plan.br, seqs.grid_z());
        let rows = p.batch * p.seqlen_q;
        match self.part {
            BackwardPart::Dvec => {
                let groups = (rows * p.heads_q).div_ceil(PRE_ROWS);
                let x = groups.min(max_groups).max(1);
                [x, groups.div_ceil(x), 1]
            }
            BackwardPart::DkDv => [seqs.grid_x(b, true), p.heads_q / p.group, z],
            BackwardPart::Dq => [seqs.grid_x(b, false), p.heads_q, z],
            BackwardPart::SinkPartials => [sink_chunks(p), p.heads_q, 1],
            BackwardPart::SinkReduce => [p.heads_q.div_ceil(SINK_WORKGROUP), 1, 1],
        }
    }

    /// Bytes of `var<workgroup>` the kernel declares: the plan's tiles for
    /// dK/dV and dQ, the tree of partials for the sinks' first pass.
    pub fn workgroup_bytes(&self) -> u32 {
        match self.part {
            BackwardPart::DkDv | BackwardPart::Dq => self.plan.workgroup_bytes,
            BackwardPart::SinkPartials => 4 * SINK_WORKGROUP,
            BackwardPart::Dvec | BackwardPart::SinkReduce => 0,
        }
    }

    /// The `(binding, buffer)` pairs this kernel reads and writes.
    pub fn entries<'a>(&self, b: &BackwardBindings<'a>) -> Vec<(u32, wgpu::BufferBinding<'a>)> {
        use binding::*;
        let b = b.clone();
        let [part, sums] = b.dsinks.clone().unwrap_or([b.dvec.clone(), b.dvec.clone()]);
        match self.part {
            BackwardPart::Dvec => vec![(DO, b.d_o), (O, b.o), (DVEC, b.dvec)],
            BackwardPart::SinkPartials => {
                vec![(LSE, b.lse), (DVEC, b.dvec), (DSINK_PART, part)]
            }
            BackwardPart::SinkReduce => vec![(DSINK_PART, part), (DSINKS, sums)],
            BackwardPart::DkDv | BackwardPart::Dq => {
                let mut e = vec![
                    (Q, b.q),
                    (K, b.k),
                    (V, b.v),
                    (DO, b.d_o),
                    (LSE, b.lse),
                    (DVEC, b.dvec),
                ];
                if self.part == BackwardPart::DkDv {
                    e.extend([(DK, b.dk), (DV, b.dv)]);
                } else {
                    e.push((DQ, b.dq));
                }
                e
            }
        }
    }

    /// Storage accesses of one dispatch with parameters `p` walking `walk`
    /// (dK/dV's walk by key blocks, dQ's by query blocks). The side buffer
    /// is not counted (metadata, like uniforms).
    pub fn accesses(&self, p: &Params, walk: &Walk) -> Accesses {
        let rows = (p.batch * p.seqlen_q) as u64;
        let (hq, dv) = (p.heads_q as u64, self.plan.head_dim_v as u64);
        let chunks = sink_chunks(p) as u64;
        match self.part {
            // dO and O read, D written, per row.
            BackwardPart::Dvec => Accesses {
                reads: hq * rows * 2 * dv,
                writes: hq * rows,
            },
            BackwardPart::DkDv => self.dkdv_accesses(p, walk),
            BackwardPart::Dq => self.dq_accesses(p, walk),
            // LSE and D of every row read; one partial per chunk written.
            BackwardPart::SinkPartials => Accesses {
                reads: hq * rows * 2,
                writes: hq * chunks,
            },
            BackwardPart::SinkReduce => Accesses {
                reads: hq * chunks,
                writes: hq,
            },
        }
    }

    /// q/k and v/o head dims.
    fn dims(&self) -> (u64, u64) {
        (self.plan.head_dim as u64, self.plan.head_dim_v as u64)
    }

    /// dK/dV: per key block and kv head, K and V read and written once; Q,
    /// dO, LSE and D of every tile each head of the group visits.
    fn dkdv_accesses(&self, p: &Params, walk: &Walk) -> Accesses {
        let (d, dv) = self.dims();
        let (g, heads_kv) = (p.group as usize, (p.heads_q / p.group) as usize);
        let mut a = Accesses::default();
        for o in walk.outer() {
            let keys = o.2;
            for hk in 0..heads_kv {
                a.reads += keys * (d + dv) + walk.visited(o, hk * g..(hk + 1) * g) * (d + dv + 2);
                a.writes += keys * (d + dv);
            }
        }
        a
    }

    /// dQ: per query block and head, Q, dO, LSE, D read once, K and V per
    /// visited tile; dQ written once.
    fn dq_accesses(&self, p: &Params, walk: &Walk) -> Accesses {
        let (d, dv) = self.dims();
        let heads = p.heads_q as usize;
        let mut a = Accesses::default();
        for o in walk.outer() {
            let (rows, h) = (o.2, heads as u64);
            a.reads += h * (rows * (d + dv) + 2 * rows) + walk.visited(o, 0..heads) * (d + dv);
            a.writes += h * rows * d;
        }
        a
    }

    /// Loop iterations per invocation (per 8 on llvmpipe), as a function of
    /// the rows (dK/dV) or keys (dQ) it walks; `group` query heads per kv
    /// head. See [`super::FlashForward::loop_cost`].
    pub fn loop_cost(&self, group: u32) -> LoopCost {
        let p = &self.plan;
        let g = group as u64;
        let (step, dim) = match self.part {
            BackwardPart::DkDv => (p.br, LoopDim::Rows),
            BackwardPart::Dq => (p.br, LoopDim::Keys),
            _ => (1, LoopDim::Rows),
        };
        // Dropout's keep tile, filled per tile (the lanes kernels have none).
        let keep = keep_tile(self.variant.dropout, p.br, p.br, p.workgroup_size);
        // Each long loop's last pass, and the loop-budget guard.
        let (per_step, mut fixed) = match (self.part, p.kernel) {
            (BackwardPart::Dvec, _) => (0, constant(p.head_dim_v, 12, 0) + GUARD),
            // The row loop and the tree, unrolled or not; the reduce's
            // loop over chunks is short (one per 1024 rows of a head).
            (BackwardPart::SinkPartials, _) => (0, counted(SINK_ROWS as u64, 0, 0) + 8 + GUARD),
            (BackwardPart::SinkReduce, _) => (0, 2 + GUARD),
            (BackwardPart::DkDv, KernelFamily::Lanes) => (g, 2 * g + 2 + GUARD),
            (BackwardPart::Dq, KernelFamily::Lanes) => (1, 1 + GUARD),
            (
                BackwardPart::DkDv,
                KernelFamily::Tiled | KernelFamily::Coop | KernelFamily::Registers,
            ) => {
                let t = tile_loops(p);
                // Each step loads a block of rows (two loops).
                let (step, nested) = t.step(t.rows, 2, t.dkdv);
                // The group loop around the query-block loop: per head its
                // own pass and the block loop's last; its own last pass
                // runs every loop nested in it once more.
                let exit = 1 + 1 + nested;
                let stores = self.stores(&[p.acc_chunks(true), p.acc_chunks(false)]);
                (g * (step + keep), t.keys + g * (2 + nested) + exit + stores + GUARD)
            }
            (
                BackwardPart::Dq,
                KernelFamily::Tiled | KernelFamily::Coop | KernelFamily::Registers,
            ) => {
                let t = tile_loops(p);
                // Each step loads a block of keys (one loop).
                let (step, nested) = t.step(t.keys, 1, t.dq);
                let stores = self.stores(&[p.acc_chunks(true)]);
                (step + keep, t.rows + 1 + nested + stores + GUARD)
            }
        };
        if self.variant.varlen && matches!(self.part, BackwardPart::DkDv | BackwardPart::Dq) {
            fixed += VARLEN_SEARCH;
        }
        LoopCost {
            dim,
            step,
            per_step,
            fixed,
        }
    }
}

impl FlashBackward {
    /// The registers kernels' output stores (none counted for the tiled ones).
    fn stores(&self, parts: &[u32]) -> u64 {
        match self.plan.kernel {
            KernelFamily::Registers => registers_stores(&self.plan, parts),
            _ => 0,
        }
    }
}

/// Chunks of the sinks' first pass per head: one per SINK_WORKGROUP ·
/// SINK_ROWS rows of (batch, row).
pub fn sink_chunks(p: &Params) -> u32 {
    (p.batch * p.seqlen_q).div_ceil(SINK_WORKGROUP * SINK_ROWS)
}

/// Counted iterations of the tiled backward's loops (see
/// [`super::FlashForward::loop_cost`]).
struct TileLoops {
    /// `load_row_tiles`: Q and dO tiles, then LSE and D rows.
    rows: u64,
    /// `load_key_tiles`: K and V tiles.
    keys: u64,
    /// `tile_p_ds`: S and dP over d (its loop over scores unrolled).
    dot: u64,
    /// dQ's update over one tile (its loop over outputs unrolled).
    dq: u64,
    /// dK/dV's update over one tile.
    dkdv: u64,
}

fn tile_loops(p: &Plan) -> TileLoops {
    if p.kernel == KernelFamily::Registers {
        return registers_loops(p);
    }
    let (b, dm, wg) = (p.br, p.widest_dim(), p.workgroup_size);
    let (sc, acc_k, acc_v) = (
        p.scores_per_thread(),
        p.acc_k_per_thread(),
        p.acc_per_thread(),
    );
    // Tiles load over the wider head dim, and so does the S and dP loop.
    let tile = counted((b * dm).div_ceil(wg) as u64, 0, 0);
    TileLoops {
        rows: tile + counted(b.div_ceil(wg) as u64, 0, 0),
        keys: tile,
        dot: constant(dm, 8 + 32 * sc, 0),
        dq: constant(b, 3 + 24 * acc_k, 0),
        dkdv: constant(b, 4 + 16 * (acc_k + acc_v), 0),
    }
}

/// The registers backward's loops: tiles load by vec4 chunks, S and dP
/// loop over the wider row's chunks (loops over rows and keys unrolled), the
/// updates over the tile's rows or keys (loops over RM and columns unrolled).
fn registers_loops(p: &Plan) -> TileLoops {
    let (b, wg, rm) = (p.br, p.workgroup_size, p.rows_per_thread);
    let dm4 = p.chunks()[0].max(p.chunks()[1]);
    let (sc, acc_k, acc_v) = (
        p.scores_per_thread(),
        p.acc_chunks(true),
        p.acc_chunks(false),
    );
    let tile = counted((b * dm4).div_ceil(wg) as u64, 0, 0);
    // S's and dP's loops over keys stay loops past the unroll budget.
    let keys = constant(sc, 8 + rm * 24, 0);
    TileLoops {
        rows: tile + counted(b.div_ceil(wg) as u64, 0, 0),
        keys: tile,
        dot: constant(dm4, 2 * (rm * 6 + sc * (8 + rm * 24)), 2 * keys),
        // The updates, and P/dS's loops over rows (a few passes each step
        // on lavapipe, whatever it unrolls).
        dq: constant(b, rm * 8 + acc_k * (12 + rm * 24), 0) + 4 + rm as u64,
        dkdv: constant(b, rm * 8 + (acc_k + acc_v) * (12 + rm * 24), 0) + 4 + rm as u64,
    }
}

/// The registers backward's output stores (`arrays` of them per row or
/// key), counted as loops (see the forward's).
pub(crate) fn registers_stores(p: &Plan, parts: &[u32]) -> u64 {
    let inner: u64 = parts.iter().map(|&acc| counted(acc as u64, 0, 0)).sum();
    counted(p.rows_per_thread as u64, inner, parts.len() as u64)
}

impl TileLoops {
    /// One step of the long loop — its own pass, loading the other side's
    /// tile (`loads` loops), P/dS, the update — and the loops in it that
    /// stay loops.
    fn step(&self, load: u64, loads: u64, update: u64) -> (u64, u64) {
        let step = 1 + load + self.dot + update;
        (step, loads + (self.dot > 0) as u64 + (update > 0) as u64)
    }
}

/// The plan an elementwise kernel (D, the sinks' passes) is keyed by: its
/// storage and v head dim, and fixed tile fields, which its code never
/// reads.
fn elementwise_plan(storage: StorageKind, head_dim_v: u32) -> Plan {
    Plan {
        kernel: KernelFamily::Tiled,
        head_dim: head_dim_v,
        head_dim_v,
        storage,
        m_bytes: 0,
        bc_formula: 1,
        br_formula: 1,
        br: 1,
        bc: 1,
        threads_per_row: 1,
        workgroup_size: PRE_ROWS,
        workgroup_bytes: 0,
        coop: None,
        rows_per_thread: 1,
        subgroup_reduce: false,
        double_buffer: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{plan_backward, DeviceCaps, PlanOverrides, PlanRequest};
    use crate::Precision;

    fn plan(family: KernelFamily, seqlen: usize, precision: Precision) -> Plan {
        let req = PlanRequest {
            head_dim_v: 48,
            seqlen_q: seqlen,
            seqlen_k: seqlen,
            overrides: PlanOverrides {
                kernel: Some(family),
                ..Default::default()
            },
            ..PlanRequest::new(32, precision)
        };
        plan_backward(&req, &DeviceCaps::lavapipe()).unwrap().plan
    }

    #[test]
    fn elementwise_parts_share_one_pipeline_across_plans_and_variants() {
        let plans = [
            plan(KernelFamily::Tiled, 300, Precision::F32),
            plan(KernelFamily::Registers, 17, Precision::F32),
            plan(KernelFamily::Lanes, 64, Precision::F32),
        ];
        assert!(plans[0] != plans[1] && plans[1] != plans[2]);
        let masked = Variant {
            masked: true,
            softcap: true,
            alibi: true,
            sinks: true,
            varlen: true,
            ..Variant::default()
        };
        for part in [
            BackwardPart::Dvec,
            BackwardPart::SinkPartials,
            BackwardPart::SinkReduce,
        ] {
            let first = FlashBackward::new(part, plans[0], Variant::default());
            for (p, v) in plans.iter().zip([masked, Variant::default(), masked]) {
                let k = FlashBackward::new(part, *p, v);
                assert_eq!(k, first, "{part:?}");
                assert_eq!(k.source().text, first.source().text);
            }
        }
        // What their code reads still splits them.
        let dvec = |p: Plan, v| FlashBackward::new(BackwardPart::Dvec, p, v);
        let f16 = plan(KernelFamily::Tiled, 300, Precision::F16);
        assert_ne!(dvec(plans[0], masked), dvec(f16, masked));
        let counted = Variant {
            count_io: true,
            ..masked
        };
        assert_ne!(dvec(plans[0], masked), dvec(plans[0], counted));
        // The tile kernels keep their plan and variant.
        for part in [BackwardPart::DkDv, BackwardPart::Dq] {
            let k = FlashBackward::new(part, plans[1], masked);
            assert_eq!((k.plan, k.variant), (plans[1], masked));
        }
    }
}

//! The flash backward's three kernels: D = rowsum(dO·O) (`flash_bwd_pre`),
//! dK/dV over key blocks and dQ over query blocks, tiled
//! (`flash_bwd_{dkdv,dq}.wgsl` on `flash_bwd_common.wgsl`) or lanes
//! (`flash_bwd_lanes.wgsl`). All atomic-free and deterministic; both P/dS
//! kernels share their arithmetic (`flash_bwd_math.wgsl`).

use super::band::{all_blocks, blocks, Band};
use super::compose::{binding, section, unroll, Access, Composer, KernelSource, Variant};
use super::flash_forward::lanes_unroll;
use super::loops::{constant, counted, LoopCost, LoopDim, GUARD};
use super::params::Params;
use crate::api::output::Accesses;
use crate::api::shape::AttentionShape;
use crate::plan::{KernelFamily, Plan, StorageKind};

const PRE: &str = include_str!("../../shaders/flash_bwd_pre.wgsl");
const MATH: &str = include_str!("../../shaders/flash_bwd_math.wgsl");
const COMMON: &str = include_str!("../../shaders/flash_bwd_common.wgsl");
const DKDV: &str = include_str!("../../shaders/flash_bwd_dkdv.wgsl");
const DQ: &str = include_str!("../../shaders/flash_bwd_dq.wgsl");
const LANES: &str = include_str!("../../shaders/flash_bwd_lanes.wgsl");

/// Rows of D computed per workgroup of the `Dvec` kernel.
pub const PRE_ROWS: u32 = 64;

/// Which of the three backward kernels.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BackwardPart {
    /// D = rowsum(dO·O), one invocation per row.
    Dvec,
    /// dK and dV, one workgroup per key block of one kv head.
    DkDv,
    /// dQ, one workgroup per query block of one head.
    Dq,
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
}

impl FlashBackward {
    pub fn name(&self) -> &'static str {
        match self.part {
            BackwardPart::Dvec => "backward D = rowsum(dO·O)",
            BackwardPart::DkDv => "backward dK/dV",
            BackwardPart::Dq => "backward dQ",
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
        }
        c.finish("main")
    }

    /// Overrides and constants of the plan, then common.wgsl.
    fn prelude(&self) -> Composer {
        let p = &self.plan;
        let mut c = Composer::new(p.storage);
        c.override_u32("D", p.head_dim)
            .override_u32("DV", p.head_dim_v);
        match p.kernel {
            KernelFamily::Lanes => c.override_u32("SG", p.bc),
            KernelFamily::Tiled => c
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

    /// A P/dS kernel: q, k, v, do, lse, D read; `writes` written.
    fn gradient_kernel(
        &self,
        c: &mut Composer,
        writes: &[(&str, u32, Access)],
        tiled: &str,
        lanes_section: &str,
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
        if lanes {
            let body = section(LANES, lanes_section);
            c.push(&unroll(&body, lanes_unroll(&self.plan)));
        } else {
            c.push(COMMON).push(tiled);
        }
    }

    /// The grid of one dispatch over `piece`: rows for D (spread over x and
    /// y past `max_groups`), key blocks × kv heads for dK/dV, query blocks ×
    /// heads for dQ; z is the batch.
    pub fn grid(&self, piece: &AttentionShape, max_groups: u32) -> [u32; 3] {
        let s = piece;
        let blocks = |n: usize| n.div_ceil(self.plan.br as usize) as u32;
        match self.part {
            BackwardPart::Dvec => {
                let groups = (s.batch * s.seqlen_q * s.heads_q).div_ceil(PRE_ROWS as usize) as u32;
                let x = groups.min(max_groups);
                [x, groups.div_ceil(x), 1]
            }
            BackwardPart::DkDv => [blocks(s.seqlen_k), s.heads_kv as u32, s.batch as u32],
            BackwardPart::Dq => [blocks(s.seqlen_q), s.heads_q as u32, s.batch as u32],
        }
    }

    /// The `(binding, buffer)` pairs this kernel reads and writes.
    pub fn entries<'a>(&self, b: &BackwardBuffers<'a>) -> Vec<(u32, &'a wgpu::Buffer)> {
        use binding::*;
        match self.part {
            BackwardPart::Dvec => vec![(DO, b.d_o), (O, b.o), (DVEC, b.dvec)],
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

    /// Storage accesses of one dispatch over `p`.
    pub fn accesses(&self, p: &Params) -> Accesses {
        let sq = p.seqlen_q as u64;
        let dv = self.plan.head_dim_v as u64;
        let (b, hq, group) = (p.batch as u64, p.heads_q as u64, p.group as u64);
        let band = Band {
            params: p,
            masked: self.variant.masked,
        };
        match self.part {
            // dO and O read, D written, per row.
            BackwardPart::Dvec => Accesses {
                reads: b * hq * sq * 2 * dv,
                writes: b * hq * sq,
            },
            BackwardPart::DkDv => self.dkdv_accesses(p, &band).times(b * hq / group),
            BackwardPart::Dq => self.dq_accesses(p, &band).times(b * hq),
        }
    }

    /// q/k and v/o head dims.
    fn dims(&self) -> (u64, u64) {
        (self.plan.head_dim as u64, self.plan.head_dim_v as u64)
    }

    /// One kv head's dK/dV: K, V read and written once per key block; Q,
    /// dO, LSE, D of every visible query block of every head in the group.
    fn dkdv_accesses(&self, p: &Params, band: &Band) -> Accesses {
        let (sq, sk) = (p.seqlen_q as u64, p.seqlen_k as u64);
        let (d, dv) = self.dims();
        // Workgroups own blocks of br keys and step through rows in blocks of bc.
        let (outer, inner) = (self.plan.br as u64, self.plan.bc as u64);
        let mut a = Accesses::default();
        for (k0, keys) in all_blocks(sk, outer) {
            a.reads += keys * (d + dv);
            a.writes += keys * (d + dv);
            let first = (p.k_start as u64 + k0) as i64;
            let (lo, hi) = band.rows(first, first + keys as i64 - 1);
            for (_, rows) in blocks(lo, hi, inner, sq) {
                a.reads += p.group as u64 * (rows * (d + dv) + 2 * rows);
            }
        }
        a
    }

    /// One query head's dQ: Q, dO, LSE, D read once per query block, K and
    /// V per visible key block; dQ written once.
    fn dq_accesses(&self, p: &Params, band: &Band) -> Accesses {
        let (sq, sk) = (p.seqlen_q as u64, p.seqlen_k as u64);
        let (d, dv) = self.dims();
        let (outer, inner) = (self.plan.br as u64, self.plan.bc as u64);
        let mut a = Accesses::default();
        for (q0, rows) in all_blocks(sq, outer) {
            a.reads += rows * (d + dv) + 2 * rows;
            a.writes += rows * d;
            let first = (p.q_start as u64 + q0) as i64;
            let (lo, hi) = band.keys(first, first + rows as i64 - 1);
            for (_, keys) in blocks(lo, hi, inner, sk) {
                a.reads += keys * (d + dv);
            }
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
            BackwardPart::Dvec => (1, LoopDim::Rows),
            BackwardPart::DkDv => (p.br, LoopDim::Rows),
            BackwardPart::Dq => (p.br, LoopDim::Keys),
        };
        // Each long loop's last pass, and the loop-budget guard.
        let (per_step, fixed) = match (self.part, p.kernel) {
            (BackwardPart::Dvec, _) => (0, constant(p.head_dim_v, 12, 0) + GUARD),
            (BackwardPart::DkDv, KernelFamily::Lanes) => (g, 2 * g + 2 + GUARD),
            (BackwardPart::Dq, KernelFamily::Lanes) => (1, 1 + GUARD),
            (BackwardPart::DkDv, KernelFamily::Tiled) => {
                let t = tile_loops(p);
                // Each step loads a block of rows (two loops).
                let (step, nested) = t.step(t.rows, 2, t.dkdv);
                // The group loop around the query-block loop: per head its
                // own pass and the block loop's last; its own last pass
                // runs every loop nested in it once more.
                let exit = 1 + 1 + nested;
                (g * step, t.keys + g * (2 + nested) + exit + GUARD)
            }
            (BackwardPart::Dq, KernelFamily::Tiled) => {
                let t = tile_loops(p);
                // Each step loads a block of keys (one loop).
                let (step, nested) = t.step(t.keys, 1, t.dq);
                (step, t.rows + 1 + nested + GUARD)
            }
        };
        LoopCost {
            dim,
            step,
            per_step,
            fixed,
        }
    }
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

impl TileLoops {
    /// One step of the long loop — its own pass, loading the other side's
    /// tile (`loads` loops), P/dS, the update — and the loops in it that
    /// stay loops.
    fn step(&self, load: u64, loads: u64, update: u64) -> (u64, u64) {
        let step = 1 + load + self.dot + update;
        (step, loads + (self.dot > 0) as u64 + (update > 0) as u64)
    }
}

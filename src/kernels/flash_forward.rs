//! The flash forward kernel, in its families: tiled (`flash_fwd.wgsl`,
//! tiles in workgroup memory, for GPUs), lanes (`flash_fwd_lanes.wgsl`,
//! rows owned by subgroup lanes, for CPU adapters) and coop
//! (`flash_forward_coop`, cooperative matrices). One workgroup per block
//! of Br query rows of one (batch, head); it streams the key blocks its rows
//! can see and writes O and LSE once.

use super::compose::{
    binding, section, unroll, Access, Composer, KernelSource, Unroll, Variant, DROPOUT,
};
use super::flash_forward_coop::{coop_composer, coop_loop_cost, emulated_body, COOP};
use super::loops::{constant, counted, keep_tile, LoopCost, LoopDim, GUARD, VARLEN_SEARCH};
use super::walk::{Sequences, Walk};
use crate::api::output::Accesses;
use crate::plan::{padded_chunks, CoopForm, KernelFamily, Plan, StorageKind};

const TILED: &str = include_str!("../../shaders/flash_fwd.wgsl");
const LANES: &str = include_str!("../../shaders/flash_fwd_lanes.wgsl");
const REGISTERS: &str = include_str!("../../shaders/flash_fwd_regs.wgsl");
const HEAD_SCALE: &str = include_str!("../../shaders/head_scale.wgsl");
/// The registers kernels' tile loads (`@common`, and `@chunk` per tensor).
pub(crate) const REGS_LOAD: &str = include_str!("../../shaders/regs_load.wgsl");
const ROW_REDUCE: &str = include_str!("../../shaders/row_reduce.wgsl");

/// The flash forward for one plan and variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlashForward {
    pub plan: Plan,
    pub variant: Variant,
}

/// Device buffers of a forward: q, k, v in the storage precision (f16 as
/// raw halves, padded to 4 bytes), o likewise, lse as f32. All need
/// `STORAGE` usage.
#[derive(Clone, Copy, Debug)]
pub struct AttentionBuffers<'a> {
    /// q.
    pub q: &'a wgpu::Buffer,
    /// k.
    pub k: &'a wgpu::Buffer,
    /// v.
    pub v: &'a wgpu::Buffer,
    /// o, written.
    pub o: &'a wgpu::Buffer,
    /// lse (f32), written.
    pub lse: &'a wgpu::Buffer,
}

/// The tensors of a forward as ranges of device buffers (an app's
/// sub-allocations, with offsets and sizes, or whole buffers): what the
/// kernels bind. Each range needs `STORAGE` usage, an offset that is a
/// multiple of the device's `min_storage_buffer_offset_alignment`, and room
/// for its tensor as [`AttentionBuffers`] describes it. All may lie in one
/// buffer, as long as o's and lse's ranges intersect no other.
#[derive(Clone, Debug)]
pub struct AttentionBindings<'a> {
    /// q.
    pub q: wgpu::BufferBinding<'a>,
    /// k.
    pub k: wgpu::BufferBinding<'a>,
    /// v.
    pub v: wgpu::BufferBinding<'a>,
    /// o, written.
    pub o: wgpu::BufferBinding<'a>,
    /// lse (f32), written.
    pub lse: wgpu::BufferBinding<'a>,
}

impl<'a> AttentionBindings<'a> {
    /// Every tensor's whole buffer.
    pub fn whole(b: &AttentionBuffers<'a>) -> Self {
        Self {
            q: b.q.as_entire_buffer_binding(),
            k: b.k.as_entire_buffer_binding(),
            v: b.v.as_entire_buffer_binding(),
            o: b.o.as_entire_buffer_binding(),
            lse: b.lse.as_entire_buffer_binding(),
        }
    }

    /// `(name, range)` of each tensor, in binding order.
    pub fn named(&self) -> [(&'static str, &wgpu::BufferBinding<'a>); 5] {
        [
            ("q", &self.q),
            ("k", &self.k),
            ("v", &self.v),
            ("o", &self.o),
            ("lse", &self.lse),
        ]
    }
}

impl FlashForward {
    pub const NAME: &'static str = "flash forward";

    pub fn source(&self) -> KernelSource {
        match self.plan.kernel {
            KernelFamily::Tiled => self.tiled_source(),
            KernelFamily::Lanes => self.lanes_source(),
            KernelFamily::Coop => self.coop_source(),
            KernelFamily::Registers => self.registers_source(),
        }
    }

    fn coop_source(&self) -> KernelSource {
        let mut c = coop_composer(&self.plan);
        c.common(self.variant);
        declare_buffers(&mut c, self.plan.storage, Access::Read);
        if self.plan.coop == Some(CoopForm::Emulated) {
            c.push(&emulated_body());
        } else {
            c.push(COOP);
        }
        c.keep_tile("BR", "BC", "CE")
            .finish("main")
    }

    fn registers_source(&self) -> KernelSource {
        let p = &self.plan;
        let [d4, v4] = p.chunks();
        let mut c = Composer::new(p.storage);
        c.override_u32("BR", p.br)
            .override_u32("BC", p.bc)
            .override_u32("D", p.head_dim)
            .override_u32("DV", p.head_dim_v)
            .override_u32("D4", d4)
            .override_u32("DV4", v4)
            .override_u32("DM4", d4.max(v4))
            .override_u32("DP", padded_chunks(d4))
            .override_u32("TC", p.threads_per_row)
            .override_u32("WG", p.workgroup_size)
            .override_u32("NBUF", p.buffers())
            .const_u32("RM", p.rows_per_thread)
            .const_u32("SC", p.scores_per_thread())
            .const_u32("ACC", p.acc_chunks(false))
            .common(self.variant);
        let reduce = if p.subgroup_reduce {
            "subgroup"
        } else {
            "workgroup"
        };
        // The partials' array is sized by a constant: with `array<f32, BR *
        // TC>` in this piece naga 30's override processing panicked (an
        // arena length assertion).
        c.const_u32("ROW_PARTS", p.br * p.threads_per_row)
            .push(&section(ROW_REDUCE, reduce));
        declare_buffers(&mut c, p.storage, Access::Read);
        registers_pieces(&mut c, &["q", "k", "v"]);
        c.push(REGISTERS)
            .keep_tile("BR", "BC", "f32")
            .finish("main")
    }

    fn tiled_source(&self) -> KernelSource {
        let p = &self.plan;
        let mut c = Composer::new(p.storage);
        c.override_u32("BR", p.br)
            .override_u32("BC", p.bc)
            .override_u32("D", p.head_dim)
            .override_u32("DV", p.head_dim_v)
            .override_u32("DM", p.widest_dim())
            .override_u32("TC", p.threads_per_row)
            .override_u32("WG", p.workgroup_size)
            .const_u32("SC", p.scores_per_thread())
            .const_u32("ACC", p.acc_per_thread())
            .common(self.variant);
        declare_buffers(&mut c, p.storage, Access::Read);
        c.push(TILED).keep_tile("BR", "BC", "f32").finish("main")
    }

    fn lanes_source(&self) -> KernelSource {
        let p = &self.plan;
        let mut c = Composer::new(p.storage);
        c.override_u32("SG", p.bc)
            .override_u32("RPL", p.br / p.bc)
            .override_u32("D", p.head_dim)
            .override_u32("DV", p.head_dim_v)
            .common(self.variant)
            .push(&section(DROPOUT, "lanes"));
        declare_buffers(&mut c, p.storage, Access::Read4);
        c.push(&unroll(LANES, lanes_unroll(p))).finish("main")
    }

    /// Workgroups along x: one per block of Br rows of one sequence (dense:
    /// the batch is z), or of every sequence (packed); heads are y.
    pub fn grid_x(&self, seqs: &Sequences) -> u32 {
        seqs.grid_x(self.plan.br, false)
    }

    /// The `(binding, range)` pairs of a dispatch (params go to binding 0).
    pub fn entries<'a>(b: &AttentionBindings<'a>) -> Vec<(u32, wgpu::BufferBinding<'a>)> {
        use binding::*;
        let b = b.clone();
        vec![(Q, b.q), (K, b.k), (V, b.v), (O, b.o), (LSE, b.lse)]
    }

    /// Storage accesses of one dispatch walking `walk` for `heads` query
    /// heads: each workgroup reads its Q rows once and K and V for every
    /// tile it visits (the band's blocks, or its tile list); writes O and
    /// LSE once. The side buffer is not counted (metadata, like uniforms).
    pub fn accesses(&self, walk: &Walk, heads: usize) -> Accesses {
        let (d, dv) = (self.plan.head_dim as u64, self.plan.head_dim_v as u64);
        let mut a = Accesses::default();
        for o in walk.outer() {
            let (rows, h) = (o.2, heads as u64);
            a.reads += h * rows * d + walk.visited(o, 0..heads) * (d + dv);
            a.writes += h * (rows * dv + rows);
        }
        a
    }

    /// Loop iterations per invocation (per 8 on llvmpipe), as a function of
    /// the keys it walks: the key-block loop and, in the tiled kernel, the
    /// loops in it that llvmpipe does not unroll. The lanes kernel's are all
    /// unrolled text. Op counts are generous estimates of each loop body's
    /// size (nearer the unroll budget the driver's choice is hard to
    /// predict, and counting too many only cuts calls a little shorter);
    /// `tests/loop_limit.rs` checks the totals against the driver.
    pub fn loop_cost(&self) -> LoopCost {
        let p = &self.plan;
        // Dropout's keep tile, filled per step (the lanes kernels have none).
        let keep = keep_tile(self.variant.dropout, p.br, p.bc, p.workgroup_size);
        // The key-block loop's last pass, and the loop-budget guard.
        let (per_step, mut fixed) = match p.kernel {
            KernelFamily::Coop => {
                let cost = coop_loop_cost(p, self.variant.varlen);
                return LoopCost {
                    per_step: cost.per_step + keep,
                    ..cost
                };
            }
            KernelFamily::Lanes => (1, 1 + GUARD),
            KernelFamily::Registers => {
                let (per_step, fixed) = registers_loops(p);
                (per_step + keep, fixed)
            }
            KernelFamily::Tiled => {
                let (d, bc, wg) = (p.head_dim, p.bc, p.workgroup_size);
                let (sc, acc) = (p.scores_per_thread(), p.acc_per_thread());
                let tile = |n: u32| counted(n.div_ceil(wg) as u64, 0, 0);
                // The K and V tiles' load (one loop over the wider head
                // dim), q·k over d (its loop over scores unrolled), then P·V
                // over the block's keys (its loop over outputs unrolled).
                let (dot, pv) = (constant(d, 6 + 24 * sc, 0), constant(bc, 3 + 24 * acc, 0));
                let nested = 1 + (dot > 0) as u64 + (pv > 0) as u64;
                (
                    1 + tile(bc * p.widest_dim()) + dot + pv + keep,
                    tile(p.br * d) + 1 + nested + GUARD,
                )
            }
        };
        if self.variant.varlen {
            fixed += VARLEN_SEARCH;
        }
        LoopCost {
            dim: LoopDim::Keys,
            step: p.bc,
            per_step,
            fixed,
        }
    }
}

/// The registers kernels' chunk loaders for `tensors` (after their accessors).
pub(crate) fn registers_pieces(c: &mut Composer, tensors: &[&str]) {
    c.push(&section(REGS_LOAD, "common"));
    let chunk = section(REGS_LOAD, "chunk");
    for name in tensors {
        c.push(&chunk.replace("{name}", name));
    }
}

/// q, k, v (read with `read`) in the storage precision, o in its output
/// precision (f32 for FP8); lse in f32; the per-head scales of FP8.
fn declare_buffers(c: &mut Composer, storage: StorageKind, read: Access) {
    use binding::*;
    let scales = if storage == StorageKind::Fp8 {
        "fp8"
    } else {
        "unit"
    };
    c.storage(storage, &[("q", Q, read), ("k", K, read), ("v", V, read)])
        .buffers(storage.output(), &[("o", O, Access::Write)])
        // LSE is f32 whatever the storage precision.
        .buffers(StorageKind::F32, &[("lse", LSE, Access::Write)])
        .push(&section(HEAD_SCALE, scales));
}

/// The registers forward's loop iterations `(per step, fixed)`: per step its
/// own pass, the K/V load, q·k over the vec4 chunks (loops over rows and
/// keys unrolled), and P·V over the block's keys; the Q load, the
/// reductions' loops (workgroup memory), the output stores (counted as
/// loops: on lavapipe whether they unroll varied with the plan by a few
/// iterations), the exits and the guard. Op counts are fitted to
/// `tests/loop_limit.rs`'s measurements.
fn registers_loops(p: &Plan) -> (u64, u64) {
    let (bc, wg, rm) = (p.bc, p.workgroup_size, p.rows_per_thread);
    let [d4, v4] = p.chunks();
    let (sc, acc) = (p.scores_per_thread(), p.acc_chunks(false));
    let tile = |n: u32| counted(n.div_ceil(wg) as u64, 0, 0);
    // The loop over keys in it stays a loop past the unroll budget.
    let keys = constant(sc, 8 + rm * 24, 0);
    let dot = constant(d4, rm * 6 + sc * (8 + rm * 24), keys);
    // Then a loop over the rows after it stays one too (measured).
    let rows = if keys > 0 {
        counted(rm as u64, 0, 0)
    } else {
        0
    };
    let pv = constant(bc, rm * 8 + acc * (12 + rm * 24), 0);
    let nested = 1 + (dot > 0) as u64 + (pv > 0) as u64;
    // Per reduction over rows of TC invocations: the loop over partials.
    let reduce = if p.subgroup_reduce {
        0
    } else {
        rm as u64 * constant(p.threads_per_row - 1, 6, 0)
    };
    let stores = counted(rm as u64, counted(acc as u64, 0, 0), 1);
    (
        1 + tile(bc * d4.max(v4)) + dot + rows + pv + reduce,
        tile(p.br * d4) + 1 + nested + reduce + stores + GUARD,
    )
}

/// A lanes plan's repetition counts: `bc` lanes (keys per step), `br / bc`
/// rows per lane, head dims / 4 chunks (q/k and v/o).
pub fn lanes_unroll(plan: &Plan) -> Unroll {
    Unroll {
        lanes: plan.bc,
        chunks: plan.head_dim / 4,
        v_chunks: plan.head_dim_v / 4,
        rows: plan.br / plan.bc,
        cols: 1,
    }
}

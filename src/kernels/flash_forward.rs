//! The flash forward kernel, in its families: tiled (`flash_fwd.wgsl`,
//! tiles in workgroup memory, for GPUs), lanes (`flash_fwd_lanes.wgsl`,
//! rows owned by subgroup lanes, for CPU adapters) and coop
//! (`flash_forward_coop`, cooperative matrices). One workgroup per block
//! of Br query rows of one (batch, head); it streams the key blocks its rows
//! can see and writes O and LSE once.

use super::compose::{binding, section, unroll, Access, Composer, KernelSource, Unroll, Variant};
use super::flash_forward_coop::{coop_composer, coop_loop_cost, emulated_body, COOP};
use super::loops::{constant, counted, LoopCost, LoopDim, GUARD, VARLEN_SEARCH};
use super::walk::{Sequences, Walk};
use crate::api::output::Accesses;
use crate::plan::{CoopForm, KernelFamily, Plan, StorageKind};

const TILED: &str = include_str!("../../shaders/flash_fwd.wgsl");
const LANES: &str = include_str!("../../shaders/flash_fwd_lanes.wgsl");
const HEAD_SCALE: &str = include_str!("../../shaders/head_scale.wgsl");

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
    pub q: &'a wgpu::Buffer,
    pub k: &'a wgpu::Buffer,
    pub v: &'a wgpu::Buffer,
    pub o: &'a wgpu::Buffer,
    pub lse: &'a wgpu::Buffer,
}

impl FlashForward {
    pub const NAME: &'static str = "flash forward";

    pub fn source(&self) -> KernelSource {
        match self.plan.kernel {
            KernelFamily::Tiled => self.tiled_source(),
            KernelFamily::Lanes => self.lanes_source(),
            KernelFamily::Coop => self.coop_source(),
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
        c.finish("main")
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
        c.push(TILED).finish("main")
    }

    fn lanes_source(&self) -> KernelSource {
        let p = &self.plan;
        let mut c = Composer::new(p.storage);
        c.override_u32("SG", p.bc)
            .override_u32("RPL", p.br / p.bc)
            .override_u32("D", p.head_dim)
            .override_u32("DV", p.head_dim_v)
            .common(self.variant);
        declare_buffers(&mut c, p.storage, Access::Read4);
        c.push(&unroll(LANES, lanes_unroll(p))).finish("main")
    }

    /// Workgroups along x: one per block of Br rows of one sequence (dense:
    /// the batch is z), or of every sequence (packed); heads are y.
    pub fn grid_x(&self, seqs: &Sequences) -> u32 {
        seqs.grid_x(self.plan.br, false)
    }

    /// The `(binding, buffer)` pairs of a dispatch (params go to binding 0).
    pub fn entries<'a>(b: &AttentionBuffers<'a>) -> [(u32, &'a wgpu::Buffer); 5] {
        use binding::*;
        [(Q, b.q), (K, b.k), (V, b.v), (O, b.o), (LSE, b.lse)]
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
        // The key-block loop's last pass, and the loop-budget guard.
        let (per_step, mut fixed) = match p.kernel {
            KernelFamily::Coop => return coop_loop_cost(p, self.variant.varlen),
            KernelFamily::Lanes => (1, 1 + GUARD),
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
                    1 + tile(bc * p.widest_dim()) + dot + pv,
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

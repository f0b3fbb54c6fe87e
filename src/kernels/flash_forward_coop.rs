//! The coop forward's module pieces (`flash_fwd_coop.wgsl`): a
//! `FlashForward` whose plan is `KernelFamily::Coop` composes its module
//! from these and counts its loops here. Bindings, grid and access count are
//! the tiled forward's.

use super::compose::Composer;
use super::loops::{counted, LoopCost, LoopDim, GUARD, VARLEN_SEARCH};
use crate::plan::{CoopForm, Plan, StorageKind};

/// The kernel body, after common.wgsl and the buffers.
pub const COOP: &str = include_str!("../../shaders/flash_fwd_coop.wgsl");

/// The element type and cooperative types of `form`, as WGSL declarations.
fn coop_types(form: CoopForm) -> String {
    let (n, e) = match form {
        CoopForm::F16x16 => (16, "f16"),
        CoopForm::F32x8 => (8, "f32"),
    };
    format!(
        "alias CE = {e};\nalias CA = coop_mat{n}x{n}<{e}, A>;\nalias CB = coop_mat{n}x{n}<{e}, B>;\n\
         alias CC = coop_mat{n}x{n}<f32, C>;\nconst CN = {n}u;\n"
    )
}

/// The plan's cooperative form (a coop plan always has one; f32's otherwise,
/// which every coop device can be asked for).
fn form(plan: &Plan) -> CoopForm {
    plan.coop.unwrap_or(CoopForm::F32x8)
}

/// The start of a coop plan's module: `enable` directives (f16 for the f16
/// form whatever the storage), the types and the overrides; common.wgsl,
/// the buffers and [`COOP`] follow.
pub fn coop_composer(p: &Plan) -> Composer {
    let form = form(p);
    let mut c = Composer::new(p.storage);
    if form == CoopForm::F16x16 && p.storage != StorageKind::F16Native {
        c.push("enable f16;\n");
    }
    // See flash_fwd_coop.wgsl: cooperative operations need subgroup-uniform
    // control flow, which naga cannot see through `subgroup_id`.
    c.push("enable wgpu_cooperative_matrix;\ndiagnostic(off, derivative_uniformity);\n")
        .push(&coop_types(form));
    let n = form.n();
    let (dp, dvp) = (p.head_dim.div_ceil(n) * n, p.head_dim_v.div_ceil(n) * n);
    c.override_u32("BR", p.br)
        .override_u32("BC", p.bc)
        .override_u32("D", p.head_dim)
        .override_u32("DV", p.head_dim_v)
        .override_u32("DP", dp)
        .override_u32("DVP", dvp)
        .override_u32("KP", dp.max(dvp))
        .override_u32("TC", p.threads_per_row)
        .override_u32("WG", p.workgroup_size);
    c
}

/// Loop iterations per invocation: per key block, the block loop, the K
/// and V loads, the subgroup's S and O tiles (each with its inner loop over
/// DP or Bc in steps of N), the score loops over the row's share of Bc, the
/// row-max and O-row loops; once, the Q and O loads and the row sum.
pub fn coop_loop_cost(p: &Plan, varlen: bool) -> LoopCost {
    let n = form(p).n();
    let (dp, dvp) = (p.head_dim.div_ceil(n) * n, p.head_dim_v.div_ceil(n) * n);
    let (br, bc, wg, tc) = (p.br, p.bc, p.workgroup_size, p.threads_per_row);
    let tile = |elems: u32| counted(elems.div_ceil(wg) as u64, 0, 0);
    // As if one subgroup took every tile (the most any can take).
    let tiles = |count: u32, inner: u32| counted(count as u64, inner as u64 + 1, 0);
    let per_step = 1
        + tile(bc * dp)
        + tile(bc * dvp)
        + tiles((br / n) * (bc / n), dp / n)
        + tiles((br / n) * (dvp / n), bc / n)
        + 2 * counted((bc / tc) as u64, 0, 0)
        + counted(tc as u64, 0, 0)
        + counted((dvp / tc) as u64, 0, 0);
    let mut fixed = tile(br * dp) + tile(br * dvp) + counted(tc as u64, 0, 0) + 1 + GUARD;
    if varlen {
        fixed += VARLEN_SEARCH;
    }
    LoopCost {
        dim: LoopDim::Keys,
        step: bc,
        per_step,
        fixed,
    }
}

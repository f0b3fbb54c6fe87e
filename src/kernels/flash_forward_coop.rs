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
        CoopForm::Emulated => return EMULATED_TYPES.to_string(),
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
    if form != CoopForm::Emulated {
        c.push("enable wgpu_cooperative_matrix;\n");
    }
    c.push("diagnostic(off, derivative_uniformity);\n")
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

/// The emulated form's matrices: 8×8 f32 arrays, row-major, each held
/// whole by every invocation of the subgroup that owns the tile.
const EMULATED_TYPES: &str = "alias CE = f32;\nalias CA = array<f32, 64>;\n\
    alias CB = array<f32, 64>;\nalias CC = array<f32, 64>;\nconst CN = 8u;\n";

/// The workgroup arrays the kernel's cooperative loads and stores name.
const TILES: [&str; 5] = ["q_tile", "kv_tile", "s_tile", "p_tile", "o_tile"];

/// [`COOP`] with every cooperative operation replaced by plain WGSL of the
/// same meaning ([`CoopForm::Emulated`]): `coopLoad[T]<M>(&tile[off],
/// stride)` by `emu_load_tile(off, stride, row_major)`, `coopStore[T]` by
/// `emu_store_tile`, `coopMultiplyAdd` by `emu_mad`; each invocation of a
/// subgroup computes the whole tile (they store the same values). So the
/// kernel's tile walk, layouts and softmax run, against the f64 reference,
/// on devices without cooperative matrices. Unrolled text: llvmpipe counts
/// loop iterations against its limit.
pub fn emulated_body() -> String {
    let mut out = String::new();
    for line in COOP.lines() {
        out.push_str(&rewrite_line(line));
        out.push('\n');
    }
    for tile in TILES {
        out.push_str(&emulated_access(tile));
    }
    out.push_str(&emulated_mad());
    out
}

/// One line with its cooperative calls rewritten (comments kept as they are).
fn rewrite_line(line: &str) -> String {
    if line.trim_start().starts_with("//") {
        return line.to_string();
    }
    let mut l = line.replace("coopMultiplyAdd(", "emu_mad(");
    for (call, row_major) in [("coopLoadT<", true), ("coopLoad<", false)] {
        while let Some(at) = l.find(call) {
            // coopLoad<M>(&tile[ → emu_load_tile(; `], stride)` → `, stride, rm)`.
            let Some(amp) = l[at..].find("(&").map(|i| at + i) else {
                break;
            };
            let Some(open) = l[amp..].find('[').map(|i| amp + i) else {
                break;
            };
            let tile = &l[amp + 2..open];
            let Some(close) = l[open..].find("], ").map(|i| open + i) else {
                break;
            };
            let Some(end) = l[close..].find(')').map(|i| close + i) else {
                break;
            };
            l = format!(
                "{}emu_load_{tile}({}{}, {row_major}){}",
                &l[..at],
                &l[open + 1..close],
                &l[close + 1..end],
                &l[end + 1..]
            );
        }
    }
    for call in ["coopStoreT(", "coopStore("] {
        if let Some(at) = l.find(call) {
            let row_major = call == "coopStoreT(";
            let rest = &l[at + call.len()..];
            if let (Some(amp), Some(open)) = (rest.find(", &"), rest.find('[')) {
                let (value, tile) = (&rest[..amp], &rest[amp + 3..open]);
                if let Some(close) = rest.find("], ") {
                    let end = rest.rfind(')').unwrap_or(rest.len());
                    l = format!(
                        "{}emu_store_{tile}({value}, {}{}, {row_major}){}",
                        &l[..at],
                        &rest[open + 1..close],
                        &rest[close + 1..end],
                        &rest[end + 1..]
                    );
                }
            }
        }
    }
    l
}

/// `emu_load_{tile}` and `emu_store_{tile}`: element (r, c) of an 8×8
/// matrix at `off + r·stride + c` (row-major) or `off + c·stride + r`.
fn emulated_access(tile: &str) -> String {
    let mut load = format!(
        "fn emu_load_{tile}(off: u32, stride: u32, row_major: bool) -> array<f32, 64> {{\n\
         var m = array<f32, 64>();\n"
    );
    let mut store = format!(
        "fn emu_store_{tile}(m: array<f32, 64>, off: u32, stride: u32, row_major: bool) {{\n"
    );
    for r in 0..8 {
        for c in 0..8 {
            let at = format!("off + select({c}u * stride + {r}u, {r}u * stride + {c}u, row_major)");
            load.push_str(&format!("m[{}] = f32({tile}[{at}]);\n", r * 8 + c));
            store.push_str(&format!("{tile}[{at}] = CE_{tile}(m[{}]);\n", r * 8 + c));
        }
    }
    load.push_str("return m;\n}\n");
    store.push_str("}\n");
    // s_tile and o_tile hold f32, the others the element type (f32 here).
    let elem = if matches!(tile, "s_tile" | "o_tile") {
        "f32"
    } else {
        "CE"
    };
    format!("{load}{}", store.replace(&format!("CE_{tile}"), elem))
}

/// `emu_mad(a, b, c)`: c + a·b for 8×8 row-major matrices, unrolled.
fn emulated_mad() -> String {
    let mut f = String::from(
        "fn emu_mad(a: array<f32, 64>, b: array<f32, 64>, c: array<f32, 64>) -> array<f32, 64> {\n\
         var d = c;\n",
    );
    for i in 0..8 {
        for j in 0..8 {
            let terms: Vec<String> = (0..8)
                .map(|k| format!("a[{}] * b[{}]", i * 8 + k, k * 8 + j))
                .collect();
            f.push_str(&format!("d[{}] += {};\n", i * 8 + j, terms.join(" + ")));
        }
    }
    f.push_str("return d;\n}\n");
    f
}

//! WGSL composition: the one place that turns a [`Plan`] and a [`Variant`] into
//! shader text. WGSL has no `#include`, so kernels are a generated prelude of
//! constants, `common.wgsl`, storage accessors instantiated from a template per
//! buffer, and the kernel body.

use crate::plan::{KernelFamily, Plan, StorageKind};

pub const COMMON: &str = include_str!("../../shaders/common.wgsl");
pub const IO_COUNT: &str = include_str!("../../shaders/io_count.wgsl");
pub const LOOP_BUDGET: &str = include_str!("../../shaders/loop_budget.wgsl");
pub const STORAGE_F32: &str = include_str!("../../shaders/storage_f32.wgsl");
pub const STORAGE_F16_PACKED: &str = include_str!("../../shaders/storage_f16_packed.wgsl");
pub const STORAGE_F16_NATIVE: &str = include_str!("../../shaders/storage_f16_native.wgsl");
pub const FLASH_FWD: &str = include_str!("../../shaders/flash_fwd.wgsl");
pub const FLASH_FWD_LANES: &str = include_str!("../../shaders/flash_fwd_lanes.wgsl");
pub const NAIVE_FWD: &str = include_str!("../../shaders/naive_fwd.wgsl");
pub const MATMUL: &str = include_str!("../../shaders/matmul.wgsl");
pub const MATMUL_COMMON: &str = include_str!("../../shaders/matmul_common.wgsl");
pub const MATMUL_LANES: &str = include_str!("../../shaders/matmul_lanes.wgsl");
pub const NAIVE_BWD: &str = include_str!("../../shaders/naive_bwd.wgsl");
pub const FLASH_BWD_COMMON: &str = include_str!("../../shaders/flash_bwd_common.wgsl");
pub const FLASH_BWD_MATH: &str = include_str!("../../shaders/flash_bwd_math.wgsl");
pub const FLASH_BWD_LANES: &str = include_str!("../../shaders/flash_bwd_lanes.wgsl");
pub const FLASH_BWD_PRE: &str = include_str!("../../shaders/flash_bwd_pre.wgsl");
pub const FLASH_BWD_DKDV: &str = include_str!("../../shaders/flash_bwd_dkdv.wgsl");
pub const FLASH_BWD_DQ: &str = include_str!("../../shaders/flash_bwd_dq.wgsl");

/// Which specialized code paths a kernel contains. A variant without a mask
/// contains no mask code (the flags are `const`, so branches fold away).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Variant {
    /// Causal and/or local window.
    pub masked: bool,
    pub softcap: bool,
    /// Count storage accesses into binding 15 (the instrumented build).
    pub count_io: bool,
    /// Report into binding 16 when llvmpipe's loop limiter cut the kernel short.
    pub loop_guard: bool,
}

/// Whether a buffer is read or written by the kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    /// Read four consecutive elements at a time (`load4_{name}`).
    Read4,
    /// Write four consecutive elements at a time (`store4_{name}`; f32 only).
    Write4,
    Write,
    ReadWrite,
}

fn template(storage: StorageKind) -> &'static str {
    match storage {
        StorageKind::F32 => STORAGE_F32,
        StorageKind::F16Packed => STORAGE_F16_PACKED,
        StorageKind::F16Native => STORAGE_F16_NATIVE,
    }
}

/// The text of one `// @section` of a storage template.
fn section(template: &str, name: &str) -> String {
    let marker = format!("// @{name}");
    let mut out = String::new();
    let mut inside = false;
    for line in template.lines() {
        if line.starts_with("// @") {
            inside = line.trim() == marker;
            continue;
        }
        if inside {
            out.push_str(line);
            out.push('\n');
        }
    }
    out
}

/// Declarations and accessors for the given buffers in one storage kind:
/// `load_{name}` for reads, `store_{name}` for writes, plus `round_storage`.
pub fn storage_decls(storage: StorageKind, buffers: &[(&str, u32, Access)]) -> String {
    let mut out = section(template(storage), "common");
    out.push_str(&buffer_decls(storage, buffers));
    out
}

/// Buffer declarations only (no `round_storage`), e.g. f32 LSE next to f16 tensors.
pub fn buffer_decls(storage: StorageKind, buffers: &[(&str, u32, Access)]) -> String {
    let t = template(storage);
    let mut out = String::new();
    for &(name, binding, access) in buffers {
        let part = match access {
            Access::Read => "read",
            Access::Read4 => "read4",
            Access::Write4 => "write4",
            Access::Write => "write",
            Access::ReadWrite => "read_write",
        };
        out.push_str(
            &section(t, part)
                .replace("{name}", name)
                .replace("{binding}", &binding.to_string()),
        );
    }
    out
}

/// `const` lines for every `(name, value)`.
fn consts(values: &[(&str, String)]) -> String {
    values
        .iter()
        .map(|(n, v)| format!("const {n} = {v};\n"))
        .collect()
}

fn prelude(storage: StorageKind, constants: &[(&str, String)], variant: Variant) -> String {
    let mut s = String::new();
    if storage == StorageKind::F16Native {
        s.push_str("enable f16;\n");
    }
    s.push_str(&consts(constants));
    s.push_str(COMMON);
    s.push_str(&section(
        IO_COUNT,
        if variant.count_io { "on" } else { "off" },
    ));
    s.push_str(&section(
        LOOP_BUDGET,
        if variant.loop_guard { "on" } else { "off" },
    ));
    s
}

/// Bindings shared by every kernel (0 is `params`). One table, so host code
/// and shaders agree on the numbers.
pub mod binding {
    pub const Q: u32 = 1;
    pub const K: u32 = 2;
    pub const V: u32 = 3;
    pub const O: u32 = 4;
    pub const LSE: u32 = 5;
    pub const S: u32 = 6;
    pub const P: u32 = 7;
    pub const DO: u32 = 8;
    pub const DVEC: u32 = 9;
    pub const DQ: u32 = 10;
    pub const DK: u32 = 11;
    pub const DV: u32 = 12;
    pub const DS: u32 = 13;
    pub const MATMUL: u32 = 14;
    pub const IO: u32 = 15;
    pub const LOOP_BUDGET: u32 = 16;
}

/// The q, k, v, o, lse bindings every forward kernel uses.
fn forward_buffers(storage: StorageKind) -> String {
    use binding::*;
    let mut s = storage_decls(
        storage,
        &[
            ("q", Q, Access::Read),
            ("k", K, Access::Read),
            ("v", V, Access::Read),
            ("o", O, Access::Write),
        ],
    );
    // LSE is f32 whatever the storage precision.
    s.push_str(&buffer_decls(
        StorageKind::F32,
        &[("lse", LSE, Access::Write)],
    ));
    s
}

fn flags(variant: Variant) -> [(&'static str, String); 2] {
    [
        ("IS_MASKED", variant.masked.to_string()),
        ("HAS_SOFTCAP", variant.softcap.to_string()),
    ]
}

/// The flash forward kernel for a plan: the tile sizes in the text are the
/// plan's, so the declared workgroup bytes equal `plan.workgroup_bytes`.
pub fn flash_forward(plan: &Plan, variant: Variant) -> String {
    if plan.kernel == KernelFamily::Lanes {
        return flash_forward_lanes(plan, variant);
    }
    let mut c = tile_consts(plan, false);
    c.extend(flags(variant));
    let mut s = prelude(plan.storage, &c, variant);
    s.push_str(&forward_buffers(plan.storage));
    s.push_str(FLASH_FWD);
    s
}

/// The lanes forward kernel, unrolled: subgroups of `plan.bc` lanes, each
/// owning `plan.br / plan.bc` query rows.
fn flash_forward_lanes(plan: &Plan, variant: Variant) -> String {
    use binding::*;
    let u = |x: u32| format!("{x}u");
    let rows = plan.br / plan.bc;
    let mut c = vec![
        ("SG", u(plan.bc)),
        ("RPL", u(rows)),
        ("D", u(plan.head_dim)),
    ];
    c.extend(flags(variant));
    let mut s = prelude(plan.storage, &c, variant);
    s.push_str(&storage_decls(
        plan.storage,
        &[
            ("q", Q, Access::Read4),
            ("k", K, Access::Read4),
            ("v", V, Access::Read4),
            ("o", O, Access::Write),
        ],
    ));
    s.push_str(&buffer_decls(
        StorageKind::F32,
        &[("lse", LSE, Access::Write)],
    ));
    s.push_str(&unroll(FLASH_FWD_LANES, lanes_unroll(plan)));
    s
}

/// A lanes plan's repetition counts: `bc` lanes (keys per step), `br / bc`
/// rows per lane, head dim / 4 chunks.
fn lanes_unroll(plan: &Plan) -> Unroll {
    Unroll {
        lanes: plan.bc,
        chunks: plan.head_dim / 4,
        rows: plan.br / plan.bc,
    }
}

/// The repetition counts of a lanes template (see [`unroll`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unroll {
    /// `$j`: lanes of a subgroup (and `$q`: quads of lanes).
    pub lanes: u32,
    /// `$i`: vec4 chunks of a row.
    pub chunks: u32,
    /// `$r`: rows each lane owns.
    pub rows: u32,
}

/// Expand a lanes template: a line containing `$r`, `$q`, `$j` or `$i`
/// repeats for each value of each placeholder it contains — r < `rows`,
/// q < `lanes / 4` (with `$q0`..`$q3` standing for 4q..4q+3), j < `lanes`,
/// i < `chunks` — nested in that order, or with i outermost when the line
/// ends in `// i outer`. Comment lines are dropped.
pub fn unroll(template: &str, n: Unroll) -> String {
    const I_OUTER: &str = " // i outer";
    let mut out = String::with_capacity(template.len() * 4);
    // Comments explain the template, not its expansion (and would repeat).
    for line in template
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
    {
        let (line, i_outer) = match line.strip_suffix(I_OUTER) {
            Some(l) => (l, true),
            None => (line, false),
        };
        let mut dims: Vec<(char, u32)> = [
            ('r', n.rows),
            ('q', n.lanes / 4),
            ('j', n.lanes),
            ('i', n.chunks),
        ]
        .into_iter()
        .filter(|(c, _)| line.contains(&format!("${c}")))
        .collect();
        if i_outer && dims.last().is_some_and(|d| d.0 == 'i') {
            dims.rotate_right(1);
        }
        // Every combination of the line's placeholders, first dim outermost.
        let mut lines = vec![line.to_string()];
        for (c, count) in dims.iter().rev() {
            lines = (0..*count)
                .flat_map(|v| {
                    lines.iter().map(move |l| {
                        let mut l = l.clone();
                        if *c == 'q' {
                            for k in 0..4 {
                                l = l.replace(&format!("$q{k}"), &(4 * v + k).to_string());
                            }
                        }
                        l.replace(&format!("${c}"), &v.to_string())
                    })
                })
                .collect();
        }
        for l in lines {
            out.push_str(&l);
            out.push('\n');
        }
    }
    out
}

/// The naive (materialized S/P) forward kernels; entry points `scores`,
/// `softmax`, `pv`.
pub fn naive_forward(head_dim: u32, storage: StorageKind, variant: Variant) -> String {
    let mut c = vec![("D", format!("{head_dim}u"))];
    c.extend(flags(variant));
    let mut s = prelude(storage, &c, variant);
    s.push_str(&forward_buffers(storage));
    s.push_str(&buffer_decls(
        StorageKind::F32,
        &[
            ("s", binding::S, Access::ReadWrite),
            ("p", binding::P, Access::ReadWrite),
        ],
    ));
    s.push_str(NAIVE_FWD);
    s
}

/// The naive backward: the naive forward's entry points plus `dp`, `ds`, `dq`, `dkdv`.
pub fn naive_backward(head_dim: u32, storage: StorageKind, variant: Variant) -> String {
    use binding::*;
    let mut s = naive_forward(head_dim, storage, variant);
    s.push_str(&buffer_decls(
        storage,
        &[
            ("do", DO, Access::Read),
            ("dq", DQ, Access::Write),
            ("dk", DK, Access::Write),
            ("dv", DV, Access::Write),
        ],
    ));
    s.push_str(&buffer_decls(
        StorageKind::F32,
        &[("ds", DS, Access::ReadWrite)],
    ));
    s.push_str(NAIVE_BWD);
    s
}

/// What the matmul kernel does with each result.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Epilogue {
    /// `alpha · acc`.
    Scale,
    /// Attention scores: `scale`, softcap and mask from the attention params.
    Scores,
}

/// Which matmul kernel runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum MatmulKernel {
    /// `matmul.wgsl`, any shape; `aligned`: M, N multiples of 64 and K of 16.
    Tiled { aligned: bool },
    /// `matmul_lanes.wgsl` on `lanes`-wide subgroups, `rows` rows of C per
    /// lane: the `dot` form when B is transposed (K = 4·`chunks`), else
    /// `axpy` (N = 4·`chunks`).
    Lanes { lanes: u32, chunks: u32, rows: u32 },
}

impl MatmulKernel {
    /// The entry point of this kernel's module.
    pub fn entry(self, b_trans: bool) -> &'static str {
        match self {
            MatmulKernel::Tiled { .. } => "main",
            MatmulKernel::Lanes { .. } if b_trans => "dot",
            MatmulKernel::Lanes { .. } => "axpy",
        }
    }
}

/// The matmul `C = epilogue(A · op(B))`; `a`, `b`, `c` give each operand's
/// storage kind. Bindings 1 (A), 2 (B), 3 (C), 14 (matmul params) and 0
/// (attention params, read by the scores epilogue); entry point
/// [`MatmulKernel::entry`].
#[allow(clippy::too_many_arguments)]
pub fn matmul(
    a: StorageKind,
    b: StorageKind,
    c: StorageKind,
    b_trans: bool,
    kernel: MatmulKernel,
    epilogue: Epilogue,
    variant: Variant,
) -> String {
    let native = [a, b, c].contains(&StorageKind::F16Native);
    let mut consts = vec![
        ("B_TRANS", b_trans.to_string()),
        ("EPILOGUE", format!("{}u", epilogue as u32)),
    ];
    let (a_access, c_access, body) = match kernel {
        MatmulKernel::Tiled { aligned } => {
            consts.push(("ALIGNED", aligned.to_string()));
            (Access::Read, Access::Write, MATMUL.to_string())
        }
        MatmulKernel::Lanes {
            lanes,
            chunks,
            rows,
        } => {
            consts.push(("SG", format!("{lanes}u")));
            consts.push(("RPL", format!("{rows}u")));
            let (a, c, form) = if b_trans {
                (Access::Read4, Access::Write4, "dot")
            } else {
                (Access::Read, Access::Write, "axpy")
            };
            let n = Unroll {
                lanes,
                chunks,
                rows,
            };
            let body = unroll(&section(MATMUL_LANES, form), n);
            (a, c, body)
        }
    };
    consts.extend(flags(variant));
    let mut s = prelude(
        if native {
            StorageKind::F16Native
        } else {
            StorageKind::F32
        },
        &consts,
        variant,
    );
    let b_access = match kernel {
        MatmulKernel::Tiled { .. } => Access::Read,
        MatmulKernel::Lanes { .. } => Access::Read4,
    };
    s.push_str(&buffer_decls(a, &[("a", 1, a_access)]));
    s.push_str(&buffer_decls(b, &[("b", 2, b_access)]));
    s.push_str(&buffer_decls(c, &[("c", 3, c_access)]));
    s.push_str(MATMUL_COMMON);
    s.push_str(&body);
    s
}

/// Tile constants of a plan, as WGSL `const` values.
fn tile_consts(plan: &Plan, square: bool) -> Vec<(&'static str, String)> {
    let u = |x: u32| format!("{x}u");
    let mut c = if square {
        vec![("B", u(plan.br))]
    } else {
        vec![("BR", u(plan.br)), ("BC", u(plan.bc))]
    };
    c.extend([
        ("D", u(plan.head_dim)),
        ("TC", u(plan.threads_per_row)),
        ("WG", u(plan.workgroup_size)),
        ("SC", u(plan.scores_per_thread())),
        ("ACC", u(plan.acc_per_thread())),
    ]);
    c
}

/// The three backward kernels of a backward plan: `(D = rowsum(dO·O), dK/dV, dQ)`,
/// tiled or lanes as the plan says.
pub fn flash_backward(plan: &Plan, variant: Variant) -> [String; 3] {
    use binding::*;
    let lanes = plan.kernel == KernelFamily::Lanes;
    let mut c = if lanes {
        let u = |x: u32| format!("{x}u");
        vec![("SG", u(plan.bc)), ("D", u(plan.head_dim))]
    } else {
        tile_consts(plan, true)
    };
    c.extend(flags(variant));
    let st = plan.storage;
    let pre = {
        let mut s = prelude(st, &c, variant);
        s.push_str(&storage_decls(
            st,
            &[("do", DO, Access::Read), ("o", O, Access::Read)],
        ));
        s.push_str(&buffer_decls(
            StorageKind::F32,
            &[("dvec", DVEC, Access::Write)],
        ));
        s.push_str(FLASH_BWD_PRE);
        s
    };
    let read = if lanes { Access::Read4 } else { Access::Read };
    let reads = [
        ("q", Q, read),
        ("k", K, read),
        ("v", V, read),
        ("do", DO, read),
    ];
    let stats = buffer_decls(
        StorageKind::F32,
        &[("lse", LSE, Access::Read), ("dvec", DVEC, Access::Read)],
    );
    let kernel = |writes: &[(&str, u32, Access)], tiled: &str, lanes_section: &str| {
        let mut s = prelude(st, &c, variant);
        let mut buffers = reads.to_vec();
        buffers.extend_from_slice(writes);
        s.push_str(&storage_decls(st, &buffers));
        s.push_str(&stats);
        s.push_str(FLASH_BWD_MATH);
        if lanes {
            let body = section(FLASH_BWD_LANES, lanes_section);
            s.push_str(&unroll(&body, lanes_unroll(plan)));
        } else {
            s.push_str(FLASH_BWD_COMMON);
            s.push_str(tiled);
        }
        s
    };
    let dkdv = kernel(
        &[("dk", DK, Access::Write), ("dv", DV, Access::Write)],
        FLASH_BWD_DKDV,
        "dkdv",
    );
    let dq = kernel(&[("dq", DQ, Access::Write)], FLASH_BWD_DQ, "dq");
    [pre, dkdv, dq]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unroll_repeats_lines_per_lane_and_chunk() {
        let n = |lanes, chunks, rows| Unroll {
            lanes,
            chunks,
            rows,
        };
        let t = "a\n// about $i\nx$i = $iu;\ns$j += q$i * k$j;\nb\n";
        assert_eq!(
            unroll(t, n(2, 3, 1)),
            "a\nx0 = 0u;\nx1 = 1u;\nx2 = 2u;\n\
             s0 += q0 * k0;\ns0 += q1 * k0;\ns0 += q2 * k0;\n\
             s1 += q0 * k1;\ns1 += q1 * k1;\ns1 += q2 * k1;\nb\n"
        );
        assert_eq!(
            unroll("s$j += q$i; // i outer\n", n(2, 2, 1)),
            "s0 += q0;\ns1 += q0;\ns0 += q1;\ns1 += q1;\n"
        );
        assert_eq!(
            unroll("c[$q] = f(s$q0, s$q3);\n", n(8, 1, 1)),
            "c[0] = f(s0, s3);\nc[1] = f(s4, s7);\n"
        );
        assert_eq!(
            unroll("s$r_$j += q$r_$i; // i outer\n", n(2, 2, 2)),
            "s0_0 += q0_0;\ns0_1 += q0_0;\ns1_0 += q1_0;\ns1_1 += q1_0;\n\
             s0_0 += q0_1;\ns0_1 += q0_1;\ns1_0 += q1_1;\ns1_1 += q1_1;\n"
        );
        assert_eq!(
            unroll("o$r[$q] = s$r_$q1;\n", n(8, 1, 2)),
            "o0[0] = s0_1;\no0[1] = s0_5;\no1[0] = s1_1;\no1[1] = s1_5;\n"
        );
    }

    #[test]
    fn sections_are_split() {
        let read = section(STORAGE_F32, "read");
        assert!(read.contains("fn load_{name}"));
        assert!(!read.contains("store_"));
        let decls = storage_decls(StorageKind::F16Packed, &[("q", 1, Access::Read)]);
        assert!(decls.contains("@binding(1) var<storage, read> q_buf: array<u32>"));
        assert!(decls.contains("fn round_storage"));
    }
}

//! WGSL composition: the one place that turns shader pieces into a module.
//!
//! WGSL has no `#include`, so a kernel's module is: `enable f16;` where
//! needed, its declarations, `common.wgsl`, the access counters and the
//! loop-budget guard (each `on` or `off`), storage accessors instantiated
//! from a template per buffer, shared pieces, and the kernel body.
//!
//! Values reach the WGSL in one of two ways, by one rule:
//! - **`override` constants** for everything that only sizes or selects
//!   (tile sizes, workgroup sizes, head dims, flags): declared here with
//!   [`Composer::override_u32`] / [`Composer::override_bool`] and supplied
//!   when the pipeline is created, so one text serves every value;
//! - **`const` text** only where WGSL demands a constant expression: the
//!   sizes of function-scope arrays (`array<f32, ACC>` holds an invocation's
//!   registers), via [`Composer::const_u32`];
//! - the lanes kernels are also *unrolled* text ([`unroll`]): WGSL has no
//!   unroll directive and llvmpipe keeps loop-indexed arrays in memory, so
//!   their per-lane, per-row and per-chunk lines are repeated by count.
//!   Measured on lavapipe (Intel Xeon, AVX-512): the lanes forward written
//!   with WGSL loops over private arrays instead ran 6.2–6.5x slower (median
//!   of 30, N 1024 and 4096, d 64 and 128; bit-identical results) and its
//!   first compile took 3x longer; looping only the lanes still cost 2x. The
//!   unroller serves the lanes kernels only; every other kernel is plain
//!   WGSL with override constants.

use crate::plan::StorageKind;

pub const COMMON: &str = include_str!("../../shaders/common.wgsl");
pub const IO_COUNT: &str = include_str!("../../shaders/io_count.wgsl");
pub const LOOP_BUDGET: &str = include_str!("../../shaders/loop_budget.wgsl");
pub const STORAGE_F32: &str = include_str!("../../shaders/storage_f32.wgsl");
pub const STORAGE_F16_PACKED: &str = include_str!("../../shaders/storage_f16_packed.wgsl");
pub const STORAGE_F16_NATIVE: &str = include_str!("../../shaders/storage_f16_native.wgsl");
pub const SIDE: &str = include_str!("../../shaders/side.wgsl");
pub const STORAGE_BF16: &str = include_str!("../../shaders/storage_bf16.wgsl");
pub const STORAGE_FP8: &str = include_str!("../../shaders/storage_fp8.wgsl");
/// The e4m3 format's functions (FP8 storage and quantization).
pub const E4M3: &str = include_str!("../../shaders/e4m3.wgsl");
/// Philox4x32-10 and dropout's keep bits (the same values as `crate::philox`).
pub const PHILOX: &str = include_str!("../../shaders/philox.wgsl");
/// Dropout's keep bits under a call's `Params`, and the keep tile.
pub const DROPOUT: &str = include_str!("../../shaders/dropout.wgsl");
/// Quantized KV caches: the rule's arithmetic, and the caches' accessors.
pub const KV_QUANT: &str = include_str!("../../shaders/kv_quant.wgsl");
pub const STORAGE_KV_QUANT: &str = include_str!("../../shaders/storage_kv_quant.wgsl");

/// Which optional code a kernel carries. A variant without a mask contains
/// no mask code (the flags are constants, so branches fold away).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Variant {
    /// Causal and/or local window.
    pub masked: bool,
    pub softcap: bool,
    /// ALiBi's bias (slopes in the side buffer).
    pub alibi: bool,
    /// Attention sinks (logits in the side buffer).
    pub sinks: bool,
    /// A packed batch: workgroups find their sequence (prefix sums in the
    /// side buffer).
    pub varlen: bool,
    /// A block mask: loops walk tile lists (and the mask) in the side buffer.
    pub sparse: bool,
    /// Some tile of the walk may need the block mask tested per pair: the
    /// kernel carries that test (on lavapipe its mere presence in the loop
    /// cost a full mask 1.5x the dense time).
    pub partial: bool,
    /// Attention dropout (`p > 0`): the kernels draw each pair's keep bit
    /// (`HAS_DROPOUT`; without it they carry no dropout code).
    pub dropout: bool,
    /// Count storage accesses into [`binding::IO`] (the instrumented build).
    pub count_io: bool,
    /// What the kernel does about the adapter's loop limit.
    pub loop_check: LoopCheck,
    /// The tensors' buffers (every declaration from a storage template, the
    /// ranges an app binds) declared `read_write`, inputs too: for calls
    /// whose outputs share a buffer with their inputs, which WebGPU allows
    /// only when every binding of that buffer is writable. Ordinary calls
    /// keep read-only inputs, whose loads drivers may cache.
    pub aliased: bool,
}

impl Variant {
    /// This variant with the layouts and score terms `opts` asks for.
    pub fn with_options(self, opts: &crate::api::options::AttentionOptions) -> Self {
        Self {
            alibi: opts.alibi.is_some(),
            sinks: opts.sinks.is_some(),
            varlen: opts.varlen.is_some(),
            sparse: opts.block_mask.is_some(),
            dropout: opts.dropout.is_active(),
            ..self
        }
    }

    /// This variant for tiles of `br` rows × `bc` keys: the per-pair mask
    /// test only where the mask's blocks are not whole numbers of tiles.
    /// (Tiles and blocks both count from a sequence's first row and key, so
    /// where `br | bm` and `bc | bn` every tile lies inside one block: all
    /// its pairs allowed, or it is skipped.)
    pub fn with_tiles(
        self,
        opts: &crate::api::options::AttentionOptions,
        [br, bc]: [u32; 2],
    ) -> Self {
        let partial = opts.block_mask.as_ref().is_some_and(|m| {
            !(m.grid.bm.is_multiple_of(br as usize) && m.grid.bn.is_multiple_of(bc as usize))
        });
        Self { partial, ..self }
    }

    /// Whether the kernel reads the side buffer.
    pub fn has_side(&self) -> bool {
        self.alibi || self.sinks || self.varlen || self.sparse
    }
}

/// How a kernel ends on an adapter with a loop limit (`loop_budget.wgsl`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum LoopCheck {
    /// No limit: nothing.
    #[default]
    Off,
    /// Report into [`binding::LOOP_BUDGET`] when the limit cut the kernel short.
    Guard,
    /// Measure the iterations the kernel took (tests of the loop model).
    Meter,
}

/// Bindings of group 0, one table for every kernel, so host code and
/// shaders agree on the numbers.
pub mod binding {
    pub const PARAMS: u32 = 0;
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
    /// The decode kernels' own: their parameters, the key counts and page
    /// table (one buffer), the appended rows, and the splits' partials.
    pub const DECODE: u32 = 17;
    pub const INDEX: u32 = 18;
    pub const K_NEW: u32 = 19;
    pub const V_NEW: u32 = 20;
    pub const O_PART: u32 = 21;
    pub const LSE_PART: u32 = 22;
    /// The copy kernel's parameters (its buffers use the matmul's A and C).
    pub const COPY: u32 = 23;
    /// The FP8 quantization kernels' parameters, per-(batch, head) maxima
    /// and scales (the forward kernels read the scales there too); their
    /// input is Q's binding, the signs K's, the codes V's.
    pub const QUANT: u32 = 24;
    pub const ABSMAX: u32 = 25;
    pub const FP8_SCALES: u32 = 26;
    pub const QUANT_X: u32 = 1;
    pub const SIGNS: u32 = 2;
    pub const CODES: u32 = 3;
    /// The side tables (`side.wgsl`): packed batches, slopes, sinks, tiles.
    pub const SIDE: u32 = 27;
    /// The sinks' gradients: per-workgroup partials, then the sums.
    pub const DSINK_PART: u32 = 28;
    pub const DSINKS: u32 = 29;
    pub const COPY_SRC: u32 = 1;
    pub const COPY_DST: u32 = 3;
    /// The matmul's operands (its own numbering: A, B, C).
    pub const A: u32 = 1;
    pub const B: u32 = 2;
    pub const C: u32 = 3;
}

/// How a kernel accesses one buffer (selects the storage template's section).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    /// Four consecutive elements at a time (`load4_{name}`).
    Read4,
    Write,
    /// Four consecutive elements at a time (`store4_{name}`; f32 only).
    Write4,
    ReadWrite,
}

impl Access {
    fn section(self) -> &'static str {
        match self {
            Access::Read => "read",
            Access::Read4 => "read4",
            Access::Write => "write",
            Access::Write4 => "write4",
            Access::ReadWrite => "read_write",
        }
    }
}

/// A compiled kernel's inputs: the module text, its entry point, and the
/// values of its `override` constants.
#[derive(Clone, Debug, PartialEq)]
pub struct KernelSource {
    pub text: String,
    pub entry: &'static str,
    pub overrides: Vec<(&'static str, f64)>,
}

/// Builds one module.
#[derive(Debug, Default)]
pub struct Composer {
    text: String,
    overrides: Vec<(&'static str, f64)>,
    /// Storage kinds whose template's `@helpers` are already in the text.
    helpers: Vec<StorageKind>,
    /// The variant's [`Variant::aliased`].
    aliased: bool,
}

impl Composer {
    /// A module whose tensors are stored as `storage` (native f16 enables f16).
    pub fn new(storage: StorageKind) -> Self {
        let mut c = Self::default();
        if storage == StorageKind::F16Native {
            c.text.push_str("enable f16;\n");
        }
        c
    }

    /// `override NAME: u32;`, supplied as `value` when the pipeline is made.
    pub fn override_u32(&mut self, name: &'static str, value: u32) -> &mut Self {
        self.text.push_str(&format!("override {name}: u32;\n"));
        self.overrides.push((name, value as f64));
        self
    }

    /// `override NAME: bool;`, supplied as `value` when the pipeline is made.
    pub fn override_bool(&mut self, name: &'static str, value: bool) -> &mut Self {
        self.text.push_str(&format!("override {name}: bool;\n"));
        self.overrides.push((name, value as u32 as f64));
        self
    }

    /// `const NAME = valueu;`, where WGSL demands a constant expression.
    pub fn const_u32(&mut self, name: &str, value: u32) -> &mut Self {
        self.text.push_str(&format!("const {name} = {value}u;\n"));
        self
    }

    /// `common.wgsl` with the variant's flags, the side buffer where it
    /// reads one, access counters and guard.
    pub fn common(&mut self, variant: Variant) -> &mut Self {
        self.aliased = variant.aliased;
        self.override_bool("IS_MASKED", variant.masked)
            .override_bool("HAS_SOFTCAP", variant.softcap)
            .override_bool("HAS_ALIBI", variant.alibi)
            .override_bool("HAS_SINKS", variant.sinks)
            .override_bool("IS_VARLEN", variant.varlen)
            .override_bool("IS_SPARSE", variant.sparse)
            .override_bool("HAS_PARTIAL", variant.partial)
            .override_bool("HAS_DROPOUT", variant.dropout);
        self.push(&section(SIDE, on_off(variant.has_side())))
            .push(COMMON)
            .push(PHILOX)
            .push(&section(DROPOUT, "common"))
            .push(&section(IO_COUNT, on_off(variant.count_io)))
            .push(&section(LOOP_BUDGET, loop_section(variant.loop_check)))
    }

    /// Dropout's keep factors in the kernel's `p_tile` (`dropout.wgsl`'s
    /// `@tile`): its rows and keys are the kernel's constants named `rows`
    /// and `cols`, its elements `elem`; for kernels whose invocations own
    /// strided keys. Needs the kernel's `WG`. The names are substituted,
    /// not declared (naga 30's override processing panicked on overrides
    /// of their own here).
    pub fn keep_tile(&mut self, rows: &str, cols: &str, elem: &str) -> &mut Self {
        let text = section(DROPOUT, "tile")
            .replace("KEEP_ROWS", rows)
            .replace("KEEP_COLS", cols)
            .replace("KEEP_T", elem);
        self.push(&text)
    }

    /// Declarations and accessors of `buffers` in `storage`: `load_{name}` /
    /// `store_{name}` (and the vec4 forms), plus `round_storage`.
    pub fn storage(&mut self, storage: StorageKind, buffers: &[(&str, u32, Access)]) -> &mut Self {
        self.helpers(storage)
            .push(&section(template(storage), "common"))
            .buffers(storage, buffers)
    }

    /// Buffer declarations only (e.g. f32 LSE next to f16 tensors).
    pub fn buffers(&mut self, storage: StorageKind, buffers: &[(&str, u32, Access)]) -> &mut Self {
        if !buffers.is_empty() {
            self.helpers(storage);
        }
        let t = template(storage);
        for &(name, binding, access) in buffers {
            let decl = section(t, access.section())
                .replace("{name}", name)
                .replace("{binding}", &binding.to_string());
            self.text.push_str(&decl);
        }
        self
    }

    /// A decode kernel's cache buffers: `quant` codes and block scales
    /// (`storage_kv_quant.wgsl`, with the rule's arithmetic), or `storage`
    /// elements whose rows' scales are 1. Either way `load_{name}` gives a
    /// row's element before its scale and `cache_{name}_scale(row, hk)` the
    /// scale. Needs `decode_common.wgsl`.
    pub fn cache_buffers(
        &mut self,
        storage: StorageKind,
        quant: Option<crate::kv_quant::CacheQuant>,
        buffers: &[(&str, u32, Access)],
    ) -> &mut Self {
        let Some(quant) = quant else {
            self.buffers(storage, buffers);
            for &(name, _, _) in buffers {
                self.push(&section(STORAGE_KV_QUANT, "plain").replace("{name}", name));
            }
            return self;
        };
        self.override_bool(
            "CACHE_FP8",
            quant == crate::kv_quant::CacheQuant::Fp8,
        );
        if !self.helpers.contains(&StorageKind::Fp8) {
            self.push(E4M3);
        }
        self.push(KV_QUANT);
        for &(name, binding, access) in buffers {
            let decl = section(STORAGE_KV_QUANT, access.section())
                .replace("{name}", name)
                .replace("{binding}", &binding.to_string());
            self.text.push_str(&decl);
        }
        self
    }

    pub fn push(&mut self, text: &str) -> &mut Self {
        self.text.push_str(text);
        self
    }

    /// The template's `@helpers` (functions its accessors share; FP8's are
    /// the e4m3 format), once per module.
    fn helpers(&mut self, storage: StorageKind) -> &mut Self {
        if !self.helpers.contains(&storage) {
            self.helpers.push(storage);
            if storage == StorageKind::Fp8 {
                self.text.push_str(E4M3);
            }
            self.text.push_str(&section(template(storage), "helpers"));
        }
        self
    }

    pub fn finish(&mut self, entry: &'static str) -> KernelSource {
        self.helpers.clear();
        let mut text = std::mem::take(&mut self.text);
        if std::mem::take(&mut self.aliased) {
            text = read_write_tensors(&text);
        }
        KernelSource {
            text,
            entry,
            overrides: std::mem::take(&mut self.overrides),
        }
    }
}

/// `text` with every tensor buffer (a storage template's `{name}_buf`)
/// declared `read_write`. The engine's own tables (side tables, transform
/// signs, FP8 scales, page index) are never in an app's buffer and stay
/// read-only: WGSL counts a load from a writable buffer as non-uniform, and
/// loops over side tables hold barriers.
fn read_write_tensors(text: &str) -> String {
    const READ: &str = "var<storage, read> ";
    let mut out = String::with_capacity(text.len() + 256);
    for line in text.lines() {
        let tensor = line
            .split_once(READ)
            .is_some_and(|(_, rest)| rest.split(':').next().is_some_and(|n| n.ends_with("_buf")));
        if tensor {
            out.push_str(&line.replace(READ, "var<storage, read_write> "));
        } else {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

fn on_off(on: bool) -> &'static str {
    if on {
        "on"
    } else {
        "off"
    }
}

fn loop_section(check: LoopCheck) -> &'static str {
    match check {
        LoopCheck::Off => "off",
        LoopCheck::Guard => "on",
        LoopCheck::Meter => "meter",
    }
}

fn template(storage: StorageKind) -> &'static str {
    match storage {
        StorageKind::F32 => STORAGE_F32,
        StorageKind::F16Packed => STORAGE_F16_PACKED,
        StorageKind::F16Native => STORAGE_F16_NATIVE,
        StorageKind::Bf16 => STORAGE_BF16,
        StorageKind::Fp8 => STORAGE_FP8,
    }
}

/// The text of one `// @name` section of a sectioned file (until the next
/// `// @` line).
pub fn section(template: &str, name: &str) -> String {
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

/// The repetition counts of a lanes template (see [`unroll`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Unroll {
    /// `$j`: lanes of a subgroup (and `$q`: quads of lanes).
    pub lanes: u32,
    /// `$i`: vec4 chunks of a q or k row.
    pub chunks: u32,
    /// `$v`: vec4 chunks of a v or o row (v's own head dim).
    pub v_chunks: u32,
    /// `$r`: rows each lane owns.
    pub rows: u32,
    /// `$c`: vec4 chunks of a row each lane owns (the lanes decode's outputs).
    pub cols: u32,
}

/// Expand a lanes template: a line containing `$r`, `$q`, `$j`, `$c`, `$i`
/// or `$v` repeats for each value of each placeholder it contains — r <
/// `rows`, q < `lanes / 4` (with `$q0`..`$q3` standing for 4q..4q+3), j <
/// `lanes`, c < `cols`, i < `chunks`, v < `v_chunks` — nested in that
/// order, or with i (or v) outermost when the line ends in `// i outer`
/// (`// v outer`). Comment lines are dropped.
pub fn unroll(template: &str, n: Unroll) -> String {
    let mut out = String::with_capacity(template.len() * 4);
    // Comments explain the template, not its expansion (and would repeat).
    for line in template
        .lines()
        .filter(|l| !l.trim_start().starts_with("//"))
    {
        for l in expand_line(line, n) {
            out.push_str(&l);
            out.push('\n');
        }
    }
    out
}

/// Every combination of one line's placeholders, first dim outermost.
fn expand_line(line: &str, n: Unroll) -> Vec<String> {
    let (line, outer) = match (
        line.strip_suffix(" // i outer"),
        line.strip_suffix(" // v outer"),
    ) {
        (Some(l), _) => (l, Some('i')),
        (_, Some(l)) => (l, Some('v')),
        _ => (line, None),
    };
    let mut dims: Vec<(char, u32)> = [
        ('r', n.rows),
        ('q', n.lanes / 4),
        ('j', n.lanes),
        ('c', n.cols),
        ('i', n.chunks),
        ('v', n.v_chunks),
    ]
    .into_iter()
    .filter(|(c, _)| line.contains(&format!("${c}")))
    .collect();
    if outer.is_some() && dims.last().map(|d| d.0) == outer {
        dims.rotate_right(1);
    }
    let mut lines = vec![line.to_string()];
    for &(c, count) in dims.iter().rev() {
        lines = (0..count)
            .flat_map(|v| lines.iter().map(move |l| substitute(l, c, v)))
            .collect();
    }
    lines
}

/// `$c` replaced by `v` (and, for quads, `$q0`..`$q3` by 4v..4v+3).
fn substitute(line: &str, c: char, v: u32) -> String {
    let mut l = line.to_string();
    if c == 'q' {
        for k in 0..4 {
            l = l.replace(&format!("$q{k}"), &(4 * v + k).to_string());
        }
    }
    l.replace(&format!("${c}"), &v.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_masks_whose_blocks_split_a_tile_carry_the_pair_test() {
        use crate::api::block_mask::{BlockGrid, BlockMask};
        use crate::api::options::AttentionOptions;
        let with = |block| {
            let grid = BlockGrid::new(300, 300, block).unwrap();
            AttentionOptions::default().block_mask(BlockMask::local_global(grid, 1, 1))
        };
        let partial =
            |opts: &AttentionOptions, tiles| Variant::default().with_tiles(opts, tiles).partial;
        assert!(!partial(&with((64, 64)), [32, 8]));
        assert!(!partial(&with((128, 256)), [64, 64]));
        assert!(
            partial(&with((64, 64)), [48, 8]),
            "48-row tiles cross 64-row blocks"
        );
        assert!(partial(&with((7, 13)), [16, 16]));
        assert!(
            !partial(&AttentionOptions::default(), [48, 8]),
            "no mask, no test"
        );
    }

    #[test]
    fn unroll_repeats_lines_per_lane_and_chunk() {
        let n = |lanes, chunks, rows| Unroll {
            lanes,
            chunks,
            v_chunks: 3,
            rows,
            cols: 2,
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
            unroll("a$j_$c += p$j * v$c;\n", n(2, 1, 1)),
            "a0_0 += p0 * v0;\na0_1 += p0 * v1;\na1_0 += p1 * v0;\na1_1 += p1 * v1;\n"
        );
        assert_eq!(
            unroll("a$v += p$j * w$v; // v outer\n", n(2, 1, 1)),
            "a0 += p0 * w0;\na0 += p1 * w0;\na1 += p0 * w1;\na1 += p1 * w1;\n\
             a2 += p0 * w2;\na2 += p1 * w2;\n"
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
        let src = Composer::new(StorageKind::F16Packed)
            .storage(StorageKind::F16Packed, &[("q", 1, Access::Read)])
            .finish("main");
        assert!(src
            .text
            .contains("@binding(1) var<storage, read> q_buf: array<u32>"));
        assert!(src.text.contains("fn round_storage"));
    }

    #[test]
    fn overrides_are_declared_and_valued() {
        let src = Composer::new(StorageKind::F16Native)
            .override_u32("BR", 32)
            .override_bool("IS_X", true)
            .const_u32("ACC", 8)
            .finish("main");
        assert!(src.text.starts_with("enable f16;\n"));
        assert!(src
            .text
            .contains("override BR: u32;\noverride IS_X: bool;\nconst ACC = 8u;\n"));
        assert_eq!(src.overrides, vec![("BR", 32.0), ("IS_X", 1.0)]);
    }
}

//! The decode kernels (docs/semantics.md, "KV cache and decoding"): the append
//! (`kv_append.wgsl`, k_new/v_new into the cache in place), the split-KV
//! attention (`flash_decode.wgsl`, one workgroup per split, row block, kv
//! head and sequence, the query group packed into its rows) and the merge
//! (`decode_merge.wgsl`, the splits combined by their LSE). All read the
//! cache through one page table (`decode_common.wgsl`).

use super::compose::{binding, unroll, Access, Composer, KernelSource, Unroll, Variant};
use super::loops::{constant, counted, LoopCost, LoopDim, GUARD};
use super::params::{DecodeParams, Params};
use crate::api::decode::DecodeProblem;
use crate::api::output::Accesses;
use crate::kv_quant::CacheQuant;
use crate::plan::decode::MAX_SPLITS;
use crate::plan::{DecodeTiles, KernelFamily, StorageKind};

const DECODE_COMMON: &str = include_str!("../../shaders/decode_common.wgsl");
const APPEND: &str = include_str!("../../shaders/kv_append.wgsl");
const APPEND_QUANT: &str = include_str!("../../shaders/kv_append_quant.wgsl");
const FLASH_DECODE: &str = include_str!("../../shaders/flash_decode.wgsl");
const FLASH_DECODE_LANES: &str = include_str!("../../shaders/flash_decode_lanes.wgsl");
const MERGE: &str = include_str!("../../shaders/decode_merge.wgsl");

/// Invocations of an append or merge workgroup.
pub const HELPER_WORKGROUP: u32 = 64;

/// The split-KV decode kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct FlashDecode {
    pub tiles: DecodeTiles,
    /// Write f32 partials for the merge (more than one split), or the final o and lse.
    pub partial: bool,
    /// The cache's codes (`None`: elements in the tiles' storage).
    pub quant: Option<CacheQuant>,
    pub variant: Variant,
}

/// Appends k_new/v_new to the cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KvAppend {
    pub storage: StorageKind,
    pub head_dim: u32,
    pub head_dim_v: u32,
    /// The cache's codes (`kv_append_quant.wgsl`), or elements in `storage`.
    pub quant: Option<CacheQuant>,
    pub variant: Variant,
}

/// Merges the splits' partial outputs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DecodeMerge {
    pub storage: StorageKind,
    /// o's head dim (v's).
    pub head_dim_v: u32,
    pub variant: Variant,
}

/// The app's buffer ranges one encoded decoding step binds
/// ([`Engine::encode_decode`](crate::Engine::encode_decode)), beside its
/// [`KvCache`](crate::KvCache). Each range needs `STORAGE` usage and an
/// offset that is a multiple of the device's
/// `min_storage_buffer_offset_alignment`. q is `(batch, seqlen_q, heads_q,
/// head_dim)` and o the same, in the cache's precision; lse `(batch,
/// heads_q, seqlen_q)` f32; `k_new`/`v_new` `(batch, seqlen_new, heads_kv,
/// head_dim)` in the cache's precision. Any of them may share a buffer
/// with the others and with the cache, so long as no range a dispatch
/// writes (o, lse, the cache during the append, the scratch) intersects
/// another (`OverlappingBindings`).
#[derive(Clone, Debug)]
pub struct DecodeBindings<'a> {
    /// The queries.
    pub q: wgpu::BufferBinding<'a>,
    /// The output.
    pub o: wgpu::BufferBinding<'a>,
    /// The output's log-sum-exp.
    pub lse: wgpu::BufferBinding<'a>,
    /// `[k_new, v_new]`, appended to the cache before attending (as
    /// [`DecodeStep::new_kv`](crate::DecodeStep::new_kv) is; a latent
    /// cache's `v_new` is never read, see [`append_latent`](Self::append_latent)); `None` when
    /// the step appends nothing or [`Engine::encode_append`](crate::Engine::encode_append)
    /// appended them.
    pub new_kv: Option<[wgpu::BufferBinding<'a>; 2]>,
    /// The splits' partial o and lse when a step runs in several
    /// ([`Engine::decode_scratch_size`](crate::Engine::decode_scratch_size)
    /// bytes, intersecting no other range); `None`: a buffer created for
    /// the call where one is needed.
    pub scratch: Option<wgpu::BufferBinding<'a>>,
}

impl<'a> DecodeBindings<'a> {
    /// A step that reads q and writes o and lse, appending nothing here.
    pub fn new(
        q: wgpu::BufferBinding<'a>,
        o: wgpu::BufferBinding<'a>,
        lse: wgpu::BufferBinding<'a>,
    ) -> Self {
        Self {
            q,
            o,
            lse,
            new_kv: None,
            scratch: None,
        }
    }

    /// Append `k_new` and `v_new` before attending.
    pub fn append(
        mut self,
        k_new: wgpu::BufferBinding<'a>,
        v_new: wgpu::BufferBinding<'a>,
    ) -> Self {
        self.new_kv = Some([k_new, v_new]);
        self
    }

    /// Append a latent cache's `k_new` alone before attending (its V is a
    /// view of K: the step has no `v_new`, and the append writes K only).
    pub fn append_latent(mut self, k_new: wgpu::BufferBinding<'a>) -> Self {
        self.new_kv = Some([k_new.clone(), k_new]);
        self
    }

    /// Keep the splits' partials in `scratch`.
    pub fn scratch(mut self, scratch: wgpu::BufferBinding<'a>) -> Self {
        self.scratch = Some(scratch);
        self
    }
}

/// A composer with the decode kernels' shared declarations: the head dims
/// of q and k (`D`) and of v and o (`DV`).
fn composer(storage: StorageKind, wg: u32, [d, dv]: [u32; 2]) -> Composer {
    let mut c = Composer::new(storage);
    c.override_u32("WG", wg)
        .override_u32("D", d)
        .override_u32("DV", dv);
    c
}

/// Add common.wgsl and decode_common.wgsl (after the kernel's own overrides).
fn finish_common(c: &mut Composer, variant: Variant) {
    c.common(variant).push(DECODE_COMMON);
}

impl FlashDecode {
    pub const NAME: &'static str = "flash decode";

    pub fn source(&self) -> KernelSource {
        let t = &self.tiles;
        let mut c = composer(t.storage, t.workgroup_size, [t.head_dim, t.head_dim_v]);
        c.override_bool("IS_PARTIAL", self.partial)
            .const_u32("RB", t.rows);
        // Decode tiles are never coop or registers (decode_tiles picks lanes
        // or tiled): those run tiled.
        let (read, body) = match t.kernel {
            KernelFamily::Tiled | KernelFamily::Coop | KernelFamily::Registers => {
                c.const_u32("ACC", t.acc_per_thread());
                (Access::Read, FLASH_DECODE.to_string())
            }
            KernelFamily::Lanes => {
                c.override_u32("SG", t.workgroup_size)
                    .const_u32("SGC", t.workgroup_size)
                    .const_u32("CPL", t.chunks_per_lane());
                let n = Unroll {
                    lanes: t.workgroup_size,
                    chunks: t.head_dim / 4,
                    v_chunks: t.head_dim_v / 4,
                    rows: t.rows,
                    cols: t.chunks_per_lane(),
                };
                (Access::Read4, unroll(FLASH_DECODE_LANES, n))
            }
        };
        finish_common(&mut c, self.variant);
        use binding::*;
        c.storage(t.storage, &[("q", Q, read)]).cache_buffers(
            t.storage,
            self.quant,
            &[("k", K, read), ("v", V, read)],
        );
        // Partials are f32 whatever the cache holds; the final o is not.
        let o_storage = if self.partial {
            StorageKind::F32
        } else {
            t.storage
        };
        c.buffers(o_storage, &[("o", O, Access::Write)])
            .buffers(StorageKind::F32, &[("lse", LSE, Access::Write)]);
        c.push(&body).finish("main")
    }

    /// `[splits × row blocks, heads_kv, batch]`.
    pub fn grid(&self, p: &DecodeProblem, dp: &DecodeParams) -> [u32; 3] {
        [
            dp.num_splits * dp.row_blocks,
            p.heads_kv as u32,
            p.batch as u32,
        ]
    }

    /// Storage accesses: each workgroup reads its q rows, then K and V once
    /// for every key it walks (the whole query group shares them), and
    /// writes its rows' o and lse. The index buffer (key counts, page
    /// table) is not counted, as uniforms are not.
    pub fn accesses(&self, p: &DecodeProblem, params: &Params, dp: &DecodeParams) -> Accesses {
        let (d, dv, rb) = (
            self.tiles.head_dim as u64,
            self.tiles.head_dim_v as u64,
            self.tiles.rows,
        );
        let mut a = Accesses::default();
        for b in 0..p.batch {
            for split in 0..dp.num_splits {
                for block in 0..dp.row_blocks {
                    let p0 = block * rb;
                    let rows = rb.min(dp.group_rows - p0) as u64;
                    let (lo, hi) = walked_keys(
                        params,
                        dp,
                        self.variant.masked,
                        p.seqlen_k(b),
                        split,
                        p0,
                        rows as u32,
                    );
                    a.reads += rows * d + (hi - lo) as u64 * (d + dv);
                    a.writes += rows * dv + rows;
                }
            }
        }
        a.times(p.heads_kv as u64)
    }

    /// Loop iterations per invocation as a function of the keys of its
    /// split: per block of WG keys, the block loop, the score loop over d
    /// (rows unrolled), the two softmax loops over the block (invocations
    /// < RB) and the P·V loop over its keys; once, loading q, reading the
    /// rows' slopes and storing.
    pub fn loop_cost(&self) -> LoopCost {
        let t = &self.tiles;
        if t.kernel == KernelFamily::Lanes {
            // Unrolled text: the block loop is its only loop.
            return LoopCost {
                dim: LoopDim::Keys,
                step: t.workgroup_size,
                per_step: 1,
                fixed: 1 + GUARD,
            };
        }
        let (d, wg, rb, acc) = (t.head_dim, t.workgroup_size, t.rows, t.acc_per_thread());
        // Op counts per trip, generous (see FlashForward::loop_cost): the
        // loops over rows inside are unrolled first, so a trip holds them all.
        let score = constant(d, 6 + 10 * rb, 0);
        let softmax = 2 * constant(wg, 12, 0);
        let rescale = constant(rb, 10 * acc + 10, 0);
        let pv_cols = constant(acc, 12 * rb + 8, 0);
        let pv = counted(wg as u64, pv_cols, (pv_cols > 0) as u64);
        let load_q = counted((rb * d).div_ceil(wg) as u64, 0, 0);
        let slopes = counted(rb as u64, 0, 0);
        let store_cols = constant(acc, 12, 0);
        let store = counted(rb as u64, store_cols, (store_cols > 0) as u64);
        LoopCost {
            dim: LoopDim::Keys,
            step: wg,
            per_step: 1 + score + softmax + rescale + pv,
            fixed: load_q + slopes + 1 + store + GUARD,
        }
    }
}

/// Keys `[lo, hi)` the decode workgroup of sequence `b` (`seqlen_k` keys),
/// split `split` and packed rows `p0..p0 + rows` walks, as
/// `flash_decode.wgsl` computes them.
pub fn walked_keys(
    params: &Params,
    dp: &DecodeParams,
    masked: bool,
    seqlen_k: usize,
    split: u32,
    p0: u32,
    rows: u32,
) -> (i64, i64) {
    let sk = seqlen_k as i64;
    let split_lo = (split as i64 * dp.keys_per_split as i64).min(sk);
    let (mut lo, mut hi) = (split_lo, (split_lo + dp.keys_per_split as i64).min(sk));
    if masked {
        let (g, offset) = (params.group as i64, sk - params.seqlen_q as i64);
        let first = p0 as i64 / g + offset;
        let last = (p0 + rows - 1) as i64 / g + offset;
        lo = lo.max(first - params.window_left as i64);
        hi = hi.min(last + params.window_right as i64 + 1);
    }
    (lo, hi.max(lo))
}

impl KvAppend {
    pub const NAME: &'static str = "kv append";

    pub fn source(&self) -> KernelSource {
        let mut c = composer(self.storage, HELPER_WORKGROUP, [self.head_dim, self.head_dim_v]);
        finish_common(&mut c, self.variant);
        use binding::*;
        let new = [("k_new", K_NEW, Access::Read), ("v_new", V_NEW, Access::Read)];
        if self.quant.is_some() {
            c.storage(self.storage, &new).cache_buffers(
                self.storage,
                self.quant,
                &[("k", K, Access::ReadWrite), ("v", V, Access::ReadWrite)],
            );
            return c.push(APPEND_QUANT).finish("main");
        }
        c.storage(self.storage, &new)
            .buffers(self.storage, &[("k", K, Access::Write), ("v", V, Access::Write)]);
        c.push(APPEND).finish("main")
    }

    /// Workgroup memory: a quantized cache's append reduces the block's
    /// largest magnitude there (one f32 per invocation, and the old scale).
    pub fn workgroup_bytes(&self) -> u32 {
        match self.quant {
            Some(_) => 4 * (HELPER_WORKGROUP + 1),
            None => 0,
        }
    }

    /// `[blocks, heads_kv, batch × 2]` workgroups on a quantized cache (a
    /// sequence's new tokens reach at most `blocks` scale blocks, of
    /// `block_tokens` each; a latent cache's `batch × 1`: K alone); `None`
    /// for a plain one, whose grid is one invocation per element.
    pub fn quant_grid(&self, p: &DecodeProblem, block_tokens: usize) -> Option<[u64; 3]> {
        self.quant?;
        let blocks = (p.seqlen_new.max(1) - 1) / block_tokens.max(1) + 2;
        let parts = if p.cache.latent { 1 } else { 2 };
        Some([blocks as u64, p.heads_kv as u64, parts * p.batch as u64])
    }

    /// Each appended element read once and written once, K and V.
    pub fn accesses(&self, p: &DecodeProblem) -> Accesses {
        // A latent cache appends K's rows alone.
        let v = if p.cache.latent { 0 } else { p.cache.v_row_len() };
        let n = (p.batch * p.seqlen_new * (p.cache.row_len() + v)) as u64;
        Accesses {
            reads: n,
            writes: n,
        }
    }

    /// No loops but the guard's.
    pub fn loop_cost(&self) -> LoopCost {
        fixed_cost(GUARD)
    }
}

impl DecodeMerge {
    pub const NAME: &'static str = "decode merge";

    pub fn source(&self) -> KernelSource {
        let dv = self.head_dim_v;
        let mut c = composer(self.storage, HELPER_WORKGROUP, [dv, dv]);
        c.const_u32("MAX_SPLITS", MAX_SPLITS as u32);
        finish_common(&mut c, self.variant);
        use binding::*;
        c.storage(self.storage, &[("o", O, Access::Write)]).buffers(
            StorageKind::F32,
            &[
                ("o_part", O_PART, Access::Read),
                ("lse_part", LSE_PART, Access::Read),
                ("lse", LSE, Access::Write),
            ],
        );
        c.push(MERGE).finish("main")
    }

    /// Per row: every split's lse and o row read once; o and lse written once.
    pub fn accesses(&self, p: &DecodeProblem, splits: u32) -> Accesses {
        let (rows, d, n) = (p.lse_len() as u64, p.head_dim_v as u64, splits as u64);
        Accesses {
            reads: rows * n * (d + 1),
            writes: rows * (d + 1),
        }
    }

    /// Its loops walk the splits, at most [`MAX_SPLITS`], never keys.
    pub fn loop_cost(&self) -> LoopCost {
        let splits = MAX_SPLITS as u64;
        let cols = (self.head_dim_v.div_ceil(HELPER_WORKGROUP)) as u64;
        fixed_cost(
            counted(1, 0, 0) + 2 * counted(splits, 0, 0) + counted(cols, splits + 1, 1) + GUARD,
        )
    }
}

/// The cost of a kernel whose loops do not grow with any sequence.
fn fixed_cost(fixed: u64) -> LoopCost {
    LoopCost {
        dim: LoopDim::Keys,
        step: u32::MAX,
        per_step: 0,
        fixed,
    }
}

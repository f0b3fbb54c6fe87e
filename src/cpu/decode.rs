//! Decoding on the CPU, the same way the WGSL kernels do it: `k_new`/`v_new`
//! written into the cache in place, then FlashDecoding's split and merge.
//! One task per (sequence, split of its keys) walks the split's key blocks
//! once, and every kv head runs the forward's inner loop on each
//! ([`Stream`]: the same online softmax, scores by
//! [`row_dots`](super::micro::row_dots) against the rows as they are) for
//! the packed rows of its query group. Where a block's rows are
//! consecutive, the products read an f16, bf16, int8 or FP8 cache's
//! elements where they lie and widen them in registers ([`stream_plain`],
//! [`stream_codes`]); elsewhere a quantized block's codes are first copied
//! into panels, and a plain block (every block of an f32 cache) is widened
//! to f32 for every kv head in one sequential sweep of the cache's rows. A
//! quantized cache's block scales multiply the scores and probabilities.
//! The merge combines the splits by their LSE, then adds the sinks. With
//! ALiBi each packed row carries its own query head's slope.

use crate::api::decode::{CacheLayout, DecodeOutput, DecodeProblem, DecodeStep, HostKvCache};
use crate::api::options::{AttentionOptions, Mask};
use crate::api::output::CallStats;
use crate::api::tensor::{HostData, TensorData, TensorView};
use crate::error::{Error, Result};
use crate::kv_quant::{CacheQuant, QuantKvCache};
use crate::plan::{plan_splits, DecodeRequest, SplitLimits, Splits};
use crate::quant::check_finite;
use bytemuck::TransparentWrapper;
use rayon::prelude::*;
use std::ops::Range;

use super::attend::{Geometry, KeyBlock, KeyScales, Keys, Partial, Query, Stream};
use super::codes::{E4m3Code, Int8Code};
use super::forward::clip;
use super::isa::{Isa, Task};
use super::merge::{merge_row, with_sink};
use super::micro::{Kernel, Mat, Operand, PAD};
use super::pool::Buffer;
use super::scores::{ScoreRow, ScoreRule};
use super::vmath::{rounding_of, Widen};

/// Bytes of one key block widened for every kv head (K and V): small
/// enough to stay in a core's L2 while each head reads it.
const BLOCK_BYTES: usize = 256 << 10;

/// Keys per block: as many as [`BLOCK_BYTES`] holds of what a block keeps
/// (`bytes` a key: f32 rows widened for every kv head, or a quantized
/// cache's codes), in whole micro-kernel panels, between one panel and 64.
fn block_keys(bytes: usize) -> usize {
    (BLOCK_BYTES / bytes.max(1) / PAD * PAD).clamp(PAD, 64)
}

/// Keys per block of a quantized cache: `bc`, or in a paged cache whose
/// blocks of `bc` would cross pages, the most panels that divide the page
/// (each block then lies in one page, whose codes are read in place).
fn within_pages(bc: usize, layout: CacheLayout) -> usize {
    match layout {
        CacheLayout::Paged { page_size, .. } if page_size % bc != 0 => (PAD..=bc)
            .rev()
            .step_by(PAD)
            .find(|b| page_size % b == 0)
            .unwrap_or(bc),
        _ => bc,
    }
}

/// One decoding step on a host cache: validate, append, attend. A step that
/// fails validation leaves the cache as it was.
pub(crate) fn decode(
    isa: Isa,
    cache: &mut HostKvCache,
    step: &DecodeStep,
    opts: &AttentionOptions,
    num_splits: Option<usize>,
) -> Result<DecodeOutput> {
    opts.validate()?;
    cache.check()?;
    let p = DecodeProblem::new(step, &cache.shape, cache.precision())?;
    opts.for_decoding(p.batch, p.heads_q)?;
    if let Some([k_new, v_new]) = &step.new_kv {
        append(&mut cache.k, k_new, &p, p.cache.row_len())?;
        append(&mut cache.v, v_new, &p, p.cache.v_row_len())?;
    }
    if let Some(k_new) = &step.new_latent {
        append(&mut cache.k, k_new, &p, p.cache.row_len())?;
    }
    attend(isa, &p, step, opts, num_splits, Source::Plain(cache))
}

/// One decoding step on a quantized cache: validate, append (quantizing,
/// by docs/kv-quantization.md's rule), attend on the dequantized values.
/// A step that fails validation leaves the cache as it was.
pub(crate) fn decode_quantized(
    isa: Isa,
    cache: &mut QuantKvCache,
    step: &DecodeStep,
    opts: &AttentionOptions,
    num_splits: Option<usize>,
) -> Result<DecodeOutput> {
    opts.validate()?;
    cache.check()?;
    let p = DecodeProblem::new(step, &cache.shape, cache.precision)?;
    opts.for_decoding(p.batch, p.heads_q)?;
    if let Some([k_new, v_new]) = &step.new_kv {
        let (k, v) = (k_new.data.to_f32(), v_new.data.to_f32());
        check_finite(&k, "k_new")?;
        check_finite(&v, "v_new")?;
        cache.append(&p, &k, &v);
    }
    if let Some(k_new) = &step.new_latent {
        let k = k_new.data.to_f32();
        check_finite(&k, "k_new")?;
        cache.append(&p, &k, &[]);
    }
    attend(isa, &p, step, opts, num_splits, Source::Quant(cache))
}

/// Split-KV attention of a validated step over its (appended) cache.
fn attend(
    isa: Isa,
    p: &DecodeProblem,
    step: &DecodeStep,
    opts: &AttentionOptions,
    num_splits: Option<usize>,
    cache: Source,
) -> Result<DecodeOutput> {
    let pad = super::pack::padded;
    let bc = match cache {
        Source::Plain(_) => {
            // As many keys as widened f32 rows fill (also the best measured
            // where an f16 or bf16 block is read in place: 16 and 64 keys
            // were no faster at 8 kv heads of 128).
            let bytes = std::mem::size_of::<f32>() * (pad(p.head_dim) + pad(p.head_dim_v));
            block_keys(p.heads_kv * bytes)
        }
        Source::Quant(_) => {
            let bc = block_keys(p.heads_kv * (p.head_dim + p.head_dim_v));
            within_pages(bc, p.cache.layout)
        }
    };
    let splits = cpu_splits(p, num_splits, bc)?;
    let work = Work {
        p,
        q: step.q.data.to_f32(),
        cache,
        rule: ScoreRule::new(opts, p.head_dim),
        opts,
        splits,
        g: Geometry::new([p.head_dim, p.head_dim_v], bc),
    };
    let tasks: Vec<(usize, usize)> = (0..p.batch)
        .flat_map(|b| (0..splits.num_splits).map(move |s| (b, s)))
        .collect();
    let per_task: Vec<Vec<Partial>> = tasks
        .par_iter()
        .map(|&task| isa.run(SplitTask { work: &work, task }))
        .collect();
    let (o, lse) = work.merge(per_task);
    let o = TensorData::from_f32(o, p.precision);
    Ok(DecodeOutput::new(
        p,
        o,
        lse,
        splits.num_splits,
        CallStats::default(),
    ))
}

/// The cache a step reads: plain elements, or codes and block scales.
#[derive(Clone, Copy)]
enum Source<'a> {
    Plain(&'a HostKvCache),
    Quant(&'a QuantKvCache),
}

/// The splits the planner gives the CPU: enough tasks for every thread.
fn cpu_splits(p: &DecodeProblem, num_splits: Option<usize>, bc: usize) -> Result<Splits> {
    let req = DecodeRequest {
        batch: p.batch,
        seqlen_q: p.seqlen_q,
        heads_q: p.heads_q,
        heads_kv: p.heads_kv,
        head_dim: p.head_dim,
        head_dim_v: p.head_dim_v,
        max_seqlen_k: p.max_seqlen_k(),
        precision: p.precision,
        num_splits,
        f16_native: None,
        kernel: None,
    };
    let limits = SplitLimits {
        parallelism: rayon::current_num_threads(),
        max_keys: usize::MAX,
        max_binding: u64::MAX,
    };
    Ok(plan_splits(&req, bc, p.batch, 0, &limits)?.0)
}

/// Copy the rows of `new` (`(batch, seqlen_new, heads_kv, d)`, `len`
/// elements a token) to their cache rows.
pub(crate) fn append(
    cache: &mut TensorData,
    new: &TensorView,
    p: &DecodeProblem,
    len: usize,
) -> Result<()> {
    fn copy<T: Copy>(c: &mut [T], n: &[T], p: &DecodeProblem, len: usize) {
        for (src, (_, _, dst)) in p.appended_rows().enumerate() {
            c[dst * len..][..len].copy_from_slice(&n[src * len..][..len]);
        }
    }
    match (cache, new.data) {
        (TensorData::F32(c), HostData::F32(n)) => copy(c, n, p, len),
        (TensorData::F16(c), HostData::F16(n)) => copy(c, n, p, len),
        (TensorData::Bf16(c), HostData::Bf16(n)) => copy(c, n, p, len),
        (c, n) => {
            return Err(Error::DtypeMismatch {
                tensor: "k_new/v_new",
                dtype: n.precision().name(),
                like: "the kv cache",
                expected: c.precision().name(),
            })
        }
    }
    Ok(())
}

/// What every task reads.
struct Work<'a> {
    p: &'a DecodeProblem,
    q: Vec<f32>,
    cache: Source<'a>,
    rule: ScoreRule<'static>,
    opts: &'a AttentionOptions,
    splits: Splits,
    g: Geometry,
}

impl Work<'_> {
    /// Packed rows of a kv head: its group's query heads × the tokens.
    fn group_rows(&self) -> usize {
        self.p.group() * self.p.seqlen_q
    }

    /// Packed row `r` of kv head `hk`: token `r / group`, query head `hk · group + r % group`.
    fn row(&self, hk: usize, r: usize) -> (usize, usize) {
        let g = self.p.group();
        (r / g, hk * g + r % g)
    }

    /// The group's packed q rows of sequence `b`, kv head `hk`, `(rows, dpad)`.
    fn packed_q(&self, b: usize, hk: usize) -> Vec<f32> {
        let p = self.p;
        let (d, dpad, rows) = (p.head_dim, self.g.dpad, self.group_rows());
        let mut q = vec![0f32; rows * dpad];
        for (r, out) in q.chunks_exact_mut(dpad).enumerate() {
            let (i, h) = self.row(hk, r);
            out[..d].copy_from_slice(&self.q[((b * p.seqlen_q + i) * p.heads_q + h) * d..][..d]);
        }
        q
    }

    /// The packed rows of sequence `b`, kv head `hk`, seeing `keys` of the
    /// split under `mask`: each with its query head's ALiBi slope.
    fn rows(&self, b: usize, hk: usize, mask: &Mask, split: &Range<usize>) -> Vec<ScoreRow> {
        let heads_q = self.p.heads_q;
        (0..self.group_rows())
            .map(|r| {
                let (i, h) = self.row(hk, r);
                ScoreRow {
                    i,
                    keys: clip(mask.key_range(i), split),
                    slope: self.opts.alibi.as_ref().map(|a| a.slope(b, h, heads_q)),
                }
            })
            .collect()
    }

    /// The score rule of a sequence whose band offset is `offset`: the
    /// call's, with ALiBi's offset (each row brings its own slope).
    fn rule(&self, offset: i64) -> ScoreRule<'static> {
        ScoreRule {
            alibi: self.opts.alibi.as_ref().map(|_| (0.0, offset)),
            ..self.rule
        }
    }

    /// Combine the splits of every row by their LSE (then add the sinks),
    /// into o's and lse's layouts. `per_task[b · splits + s][hk]` is split
    /// `s`'s partial of kv head `hk`.
    fn merge(&self, per_task: Vec<Vec<Partial>>) -> (Vec<f32>, Vec<f32>) {
        let p = self.p;
        let (dv, n) = (p.head_dim_v, self.splits.num_splits);
        let sinks = self.opts.sinks.as_ref().map(|s| s.logits());
        let mut o = vec![0f32; p.o_len()];
        let mut lse = vec![f32::NEG_INFINITY; p.lse_len()];
        // Regrouped by (b, hk), its splits side by side for merge_row.
        let mut by_head: Vec<Vec<Partial>> =
            (0..p.batch * p.heads_kv).map(|_| Vec::new()).collect();
        for (task, heads) in per_task.into_iter().enumerate() {
            for (hk, part) in heads.into_iter().enumerate() {
                by_head[task / n * p.heads_kv + hk].push(part);
            }
        }
        for (bh, chunk) in by_head.iter().enumerate() {
            let (b, hk) = (bh / p.heads_kv, bh % p.heads_kv);
            for r in 0..self.group_rows() {
                let (i, h) = self.row(hk, r);
                let out = &mut o[((b * p.seqlen_q + i) * p.heads_q + h) * dv..][..dv];
                let mut l = merge_row(chunk, r, self.g.dvpad, out);
                if let Some(sinks) = sinks {
                    l = with_sink(out, l, sinks[h]);
                }
                lse[(b * p.heads_q + h) * p.seqlen_q + i] = l;
            }
        }
        (o, lse)
    }
}

/// Sequence `b`, split `s`: every kv head's rows over the split's keys.
struct SplitTask<'a, 'w> {
    work: &'w Work<'a>,
    task: (usize, usize),
}

impl Task for SplitTask<'_, '_> {
    type Output = Vec<Partial>;
    #[inline(always)]
    fn run<K: Kernel>(self) -> Vec<Partial> {
        let (w, (b, s)) = (self.work, self.task);
        let (p, g) = (w.p, &w.g);
        let mask = p.mask(b, w.opts);
        let split = s * w.splits.keys_per_split;
        let split = split..(split + w.splits.keys_per_split).min(p.seqlen_k(b));
        let heads = 0..p.heads_kv;
        let rows: Vec<Vec<ScoreRow>> = heads
            .clone()
            .map(|hk| w.rows(b, hk, &mask, &split))
            .collect();
        let qs: Vec<Vec<f32>> = heads.map(|hk| w.packed_q(b, hk)).collect();
        let rule = w.rule(mask.offset);
        let queries: Vec<Query> = qs
            .iter()
            .zip(&rows)
            .map(|(q, rows)| Query {
                q: Mat::rows(q, g.dpad),
                rows,
            })
            .collect();
        let round_p = rounding_of(p.precision);
        let mut streams: Vec<Stream> = queries
            .iter()
            .map(|q| Stream::new(g, &rule, q, round_p))
            .collect();
        match w.cache {
            Source::Plain(cache) => {
                // A latent cache's V is a view of K's storage.
                let v = if cache.shape.latent {
                    &cache.k
                } else {
                    &cache.v
                };
                match (&cache.k, v) {
                    (TensorData::F32(k), TensorData::F32(v)) => {
                        stream_plain::<K, _>(w, b, &mut streams, k, v)
                    }
                    (TensorData::F16(k), TensorData::F16(v)) => {
                        stream_plain::<K, _>(w, b, &mut streams, k, v)
                    }
                    (TensorData::Bf16(k), TensorData::Bf16(v)) => {
                        stream_plain::<K, _>(w, b, &mut streams, k, v)
                    }
                    _ => unreachable!("decode checked that K and V share their precision"),
                }
            }
            Source::Quant(cache) => match cache.quant {
                CacheQuant::Int8 => stream_codes::<K, Int8Code>(w, cache, b, &mut streams),
                CacheQuant::Fp8 => stream_codes::<K, E4m3Code>(w, cache, b, &mut streams),
            },
        }
        streams.into_iter().map(Stream::finish).collect()
    }
}

/// f32s in a cache line.
const LINE_FLOATS: usize = 16;

/// Widened K rows then V rows, zeroed when made (padding columns are never
/// written), from a 64-byte boundary: rows of a multiple of 16 floats then
/// never straddle two cache lines with one vector (a split store or load
/// costs two), which the allocator's 16-byte alignment does not give.
/// Pooled: a fresh one every step would cost its page faults every step.
struct Rows {
    data: Buffer,
    /// Where the rows start in `data`.
    at: usize,
    /// Floats of K's part.
    half: usize,
}

impl Rows {
    fn new(k: usize, v: usize) -> Self {
        let data = Buffer::zeroed(k + v + LINE_FLOATS);
        let at = (LINE_FLOATS - data.as_ptr() as usize % 64 / 4) % LINE_FLOATS;
        Self { data, at, half: k }
    }

    fn k(&self) -> &[f32] {
        &self.data[self.at..][..self.half]
    }

    fn v(&self) -> &[f32] {
        &self.data[self.at + self.half..]
    }

    fn split_mut(&mut self) -> (&mut [f32], &mut [f32]) {
        self.data[self.at..].split_at_mut(self.half)
    }
}

/// One key block of the cache widened to f32 for every kv head, K's rows
/// then V's, head by head: head `hk`'s row for the block's `c`-th key is
/// at `(hk · bc + c) · dpad` (V's: `dvpad`), zero-padded to that width. (With the heads side
/// by side instead, a head's consecutive keys sit a whole row of heads
/// apart, 4 KiB at 8 heads of 128: in one L1 set, so P·V read them from
/// L2.)
struct Block {
    rows: Rows,
}

impl Block {
    fn new(g: &Geometry, heads_kv: usize) -> Self {
        Self {
            rows: Rows::new(g.bc * heads_kv * g.dpad, g.bc * heads_kv * g.dvpad),
        }
    }

    fn k(&self) -> &[f32] {
        self.rows.k()
    }

    fn v(&self) -> &[f32] {
        self.rows.v()
    }

    /// Each row of the block's keys, in cache order, as `(at, cache row)`:
    /// `at` its place in a head's part of the block; `None` past the sequence.
    #[inline(always)]
    fn key_rows<'w>(
        w: &'w Work,
        b: usize,
        kb: usize,
        keys: &Range<usize>,
    ) -> impl Iterator<Item = (usize, Option<usize>)> + 'w {
        let (bc, valid) = (w.g.bc, w.p.seqlen_k(b));
        keys.clone()
            .map(move |j| (j - kb * bc, (j < valid).then(|| w.p.cache_row(b, j))))
    }

    /// Keys `keys` (within block `kb`) of sequence `b` from K and V's
    /// storage, zero past its last key.
    #[inline(always)]
    fn widen<K: Kernel, T: Widen>(
        &mut self,
        w: &Work,
        b: usize,
        kb: usize,
        keys: &Range<usize>,
        k: &[T],
        v: &[T],
    ) {
        let g = &w.g;
        let (d, dv, heads) = (g.d, g.dv, w.p.heads_kv);
        let k_len = w.p.cache.row_len();
        let (v_stride, v_head) = (w.p.cache.v_row_stride(), w.p.cache.v_head_stride());
        // Zeroed when made: the padding columns are never written.
        let (ks, vs) = self.rows.split_mut();
        // Each cache row once, in order (the prefetchers follow it), its
        // heads scattered to their own parts of the block.
        for (c, row) in Self::key_rows(w, b, kb, keys) {
            for hk in 0..heads {
                let at = hk * g.bc + c;
                let (kr, vr) = (&mut ks[at * g.dpad..][..d], &mut vs[at * g.dvpad..][..dv]);
                match row {
                    Some(row) => {
                        T::widen::<K>(&k[row * k_len + hk * d..][..d], kr);
                        T::widen::<K>(&v[row * v_stride + hk * v_head..][..dv], vr);
                    }
                    None => {
                        kr.fill(0.0);
                        vr.fill(0.0);
                    }
                }
            }
        }
    }
}

/// Whether block `keys` of sequence `b` can be read where it lies: its keys
/// are consecutive cache rows from `row0` (a dense cache, or within a
/// page) that all exist, and each head's row is whole panels.
fn in_place(w: &Work, b: usize, keys: &Range<usize>, row0: usize) -> bool {
    let (p, g) = (w.p, &w.g);
    g.d == g.dpad
        && g.dv == g.dvpad
        && keys.end <= p.seqlen_k(b)
        && keys
            .clone()
            .all(|t| p.cache_row(b, t) == row0 + (t - keys.start))
}

/// Ask for head `hk`'s K and V rows of the block after next of one read in
/// place from `row0` (the hardware prefetchers miss them: short runs a
/// whole row apart; one block ahead is less than memory's latency for a
/// block). In a dense cache they follow these; in a page the rows may be
/// another sequence's, which is harmless.
fn prefetch_head<T: bytemuck::Pod>(
    w: &Work,
    k: &[T],
    v: &[T],
    row0: usize,
    keys: usize,
    hk: usize,
) {
    let (p, g, size) = (w.p, &w.g, std::mem::size_of::<T>());
    let next = row0 + keys + g.bc..row0 + keys + 2 * g.bc;
    let bytes = |c: Range<usize>| c.start * size..c.end * size;
    let k_cols = bytes(hk * g.d..(hk + 1) * g.d);
    prefetch_rows(
        bytemuck::cast_slice(k),
        next.clone(),
        p.cache.row_len() * size,
        k_cols,
    );
    // (A latent cache's V is K's rows: nothing more to ask.)
    if !p.cache.latent {
        let v_cols = bytes(hk * g.dv..(hk + 1) * g.dv);
        prefetch_rows(
            bytemuck::cast_slice(v),
            next,
            p.cache.v_row_stride() * size,
            v_cols,
        );
    }
}

/// Head `hk`'s K and V rows of a block of `keys` keys read in place from
/// cache row `row0`, and their row strides; the head's rows of the block
/// after next are asked for first ([`prefetch_head`]).
#[inline(always)]
fn head_in_place<'c, T: bytemuck::Pod>(
    w: &Work,
    k: &'c [T],
    v: &'c [T],
    row0: usize,
    keys: usize,
    hk: usize,
) -> (&'c [T], &'c [T], usize, usize) {
    prefetch_head(w, k, v, row0, keys, hk);
    let (cache, d) = (&w.p.cache, w.g.d);
    let (k_len, v_len) = (cache.row_len(), cache.v_row_stride());
    let v_at = row0 * v_len + hk * cache.v_head_stride();
    (&k[row0 * k_len + hk * d..], &v[v_at..], k_len, v_len)
}

/// Every kv head's streams over a plain cache's key blocks. The products
/// read an f16 or bf16 cache's elements as `T` where they lie
/// ([`in_place`]): the loads then overlap the arithmetic, where widening
/// first reads memory in one phase and computes in another (6–20% less
/// time a step on AVX-512 and 5–12% on AVX2, at caches of 8k and 32k, 8 kv
/// heads of 128). Other blocks,
/// and every block of an f32 cache, are widened to f32 for every head first
/// ([`Block::widen`]): a head's f32 rows read in place lie 4 KiB apart at 8
/// heads of 128, all in one L1 set, and measured no faster.
#[inline(always)]
fn stream_plain<K: Kernel, T: Operand + Widen + bytemuck::Pod>(
    w: &Work,
    b: usize,
    streams: &mut [Stream],
    k: &[T],
    v: &[T],
) {
    let (p, g) = (w.p, &w.g);
    let mut block = None;
    for kb in streams[0].key_blocks() {
        let Some(reach) = streams[0].reach(kb) else {
            continue;
        };
        let keys = &reach.keys;
        let row0 = p.cache_row(b, keys.start);
        if std::mem::size_of::<T>() == 2 && in_place(w, b, keys, row0) {
            for (hk, stream) in streams.iter_mut().enumerate() {
                let (kr, vr, ldk, ldv) = head_in_place(w, k, v, row0, keys.len(), hk);
                let blk = KeyBlock {
                    k: Keys::Rows(kr, ldk),
                    v: vr,
                    ldv,
                    from: keys.start - kb * g.bc,
                    scales: None,
                };
                stream.update::<K, T>(&reach, &blk);
            }
            continue;
        }
        let block = block.get_or_insert_with(|| Block::new(g, p.heads_kv));
        block.widen::<K, T>(w, b, kb, keys, k, v);
        for (hk, stream) in streams.iter_mut().enumerate() {
            let head = hk * g.bc;
            let blk = KeyBlock::plain(
                Keys::Rows(&block.k()[head * g.dpad..], g.dpad),
                &block.v()[head * g.dvpad..],
                g.dvpad,
            );
            stream.update::<K, f32>(&reach, &blk);
        }
    }
}

/// Every kv head's streams over a quantized cache's key blocks, the
/// products reading the codes as `B`: in place where the block's keys are
/// consecutive cache rows (a dense cache, within a page) that exist and each
/// head's row is whole panels, else from a copy ([`CodeBlock::stage`]).
#[inline(always)]
fn stream_codes<K: Kernel, B: Operand + TransparentWrapper<u8>>(
    w: &Work,
    cache: &QuantKvCache,
    b: usize,
    streams: &mut [Stream],
) {
    let (p, g) = (w.p, &w.g);
    // V's codes: K's, in a latent cache.
    let v_codes = &cache.v_view().codes;
    let mut block = CodeBlock::new(g, p.heads_kv);
    for kb in streams[0].key_blocks() {
        let Some(reach) = streams[0].reach(kb) else {
            continue;
        };
        let keys = &reach.keys;
        block.scales(w, cache, b, kb, keys);
        let row0 = p.cache_row(b, keys.start);
        let in_place = in_place(w, b, keys, row0);
        let from = if in_place {
            keys.start - kb * g.bc
        } else {
            block.stage(w, cache, b, kb, keys);
            0
        };
        for (hk, stream) in streams.iter_mut().enumerate() {
            let (kr, vr, ldk, ldv) = if in_place {
                head_in_place(w, &cache.k.codes, v_codes, row0, keys.len(), hk)
            } else {
                let (k, v) = block.head(g, hk);
                (k, v, g.dpad, g.dvpad)
            };
            let at = hk * g.bc + from;
            let blk = KeyBlock {
                k: Keys::Rows(B::wrap_slice(kr), ldk),
                v: B::wrap_slice(vr),
                ldv,
                from,
                scales: Some(KeyScales {
                    k: &block.k_scale[at..],
                    v: &block.v_scale[at..],
                }),
            };
            stream.update::<K, B>(&reach, &blk);
        }
    }
}

/// Ask for columns `cols` of rows `rows` (of `len` bytes) of `codes`, as far
/// as the cache goes, one cache line at a time (x86; elsewhere nothing).
#[inline(always)]
fn prefetch_rows(codes: &[u8], rows: Range<usize>, len: usize, cols: Range<usize>) {
    #[cfg(target_arch = "x86_64")]
    for row in rows {
        let Some(bytes) = codes.get(row * len + cols.start..row * len + cols.end) else {
            break;
        };
        for line in bytes.chunks(64) {
            // SAFETY: a prefetch reads nothing (and the address is in bounds).
            unsafe {
                use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
                _mm_prefetch::<_MM_HINT_T0>(line.as_ptr().cast())
            };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (codes, rows, len, cols);
}

/// A quantized cache's key block beside its rows: each (head, key)'s
/// scales, and, where the codes cannot be read in place, a copy of them in
/// panels (head `hk`'s row for the block's `c`-th key at `(hk · bc + c) ·
/// dpad`, V's at `· dvpad`, zero-padded; zero codes past the sequence's
/// last key).
struct CodeBlock {
    k: Vec<u8>,
    v: Vec<u8>,
    /// `(heads, bc)`; 0 past the sequence's last key.
    k_scale: Vec<f32>,
    v_scale: Vec<f32>,
}

impl CodeBlock {
    fn new(g: &Geometry, heads: usize) -> Self {
        Self {
            k: vec![0; heads * g.bc * g.dpad],
            v: vec![0; heads * g.bc * g.dvpad],
            k_scale: vec![0.0; heads * g.bc],
            v_scale: vec![0.0; heads * g.bc],
        }
    }

    /// Head `hk`'s copied K and V rows.
    fn head(&self, g: &Geometry, hk: usize) -> (&[u8], &[u8]) {
        (
            &self.k[hk * g.bc * g.dpad..][..g.bc * g.dpad],
            &self.v[hk * g.bc * g.dvpad..][..g.bc * g.dvpad],
        )
    }

    /// The scales of keys `keys` (within block `kb`) of sequence `b`.
    #[inline(always)]
    fn scales(&mut self, w: &Work, cache: &QuantKvCache, b: usize, kb: usize, keys: &Range<usize>) {
        let (bc, heads) = (w.g.bc, w.p.heads_kv);
        let blocks = cache.blocks();
        for (c, row) in Block::key_rows(w, b, kb, keys) {
            let first = row.map(|row| blocks.block(row) * heads);
            for hk in 0..heads {
                let scale = |s: &[f32]| first.map_or(0.0, |first| s[first + hk]);
                self.k_scale[hk * bc + c] = scale(&cache.k.scales);
                self.v_scale[hk * bc + c] = scale(&cache.v_view().scales);
            }
        }
    }

    /// Keys `keys` (within block `kb`) of sequence `b`: their codes, each
    /// head's row in its panels, in one sequential sweep of the cache's rows.
    #[inline(always)]
    fn stage(&mut self, w: &Work, cache: &QuantKvCache, b: usize, kb: usize, keys: &Range<usize>) {
        let g = &w.g;
        let (d, dv, heads) = (g.d, g.dv, w.p.heads_kv);
        let (k_len, v_codes) = (w.p.cache.row_len(), &cache.v_view().codes);
        for (c, row) in Block::key_rows(w, b, kb, keys) {
            for hk in 0..heads {
                let at = hk * g.bc + c;
                let (kd, vd) = (
                    &mut self.k[at * g.dpad..][..d],
                    &mut self.v[at * g.dvpad..][..dv],
                );
                match row {
                    Some(row) => {
                        kd.copy_from_slice(&cache.k.codes[row * k_len + hk * d..][..d]);
                        vd.copy_from_slice(&v_codes[w.p.cache.v_offset(row, hk)..][..dv]);
                    }
                    None => {
                        kd.fill(0);
                        vd.fill(0);
                    }
                }
            }
        }
    }
}

//! Decoding as an operation: a step validated against its cache before
//! anything is written, then one set of dispatches on buffer ranges — its
//! new rows appended in place, the split-KV kernel, the merge when there
//! are splits — either recorded into the app's encoder on its ranges (an
//! encoded step: nothing submitted) or run on the engine's own buffers with
//! o and lse read back (a host step: one submission and the readback). On
//! host caches: uploaded, decoded, read back.

use super::bindings::{self, Range};
use super::reruns::{piece_limits, with_reruns};
use crate::api::decode::{CacheShape, DecodeOutput, DecodeProblem, DecodeStep, HostKvCache};
use crate::api::options::AttentionOptions;
use crate::api::output::Accesses;
use crate::api::size::{grid_u32, to_u32};
use crate::api::tensor::{Precision, TensorData};
use crate::error::{Error, Result};
use crate::kv_quant::{CacheQuant, QuantKvCache, ScaleBlocks};
use crate::kernels::decode::HELPER_WORKGROUP;
use crate::kernels::side::SideTables;
use crate::kernels::{
    binding, DecodeBindings, DecodeMerge, DecodeParams, FlashDecode, KernelKey, KvAppend, LoopCost,
    Params, Uniform, Variant,
};
use crate::plan::decode::{decode_tiles, DecodeTiles};
use crate::plan::{plan_decode, DecodePlan, DecodeRequest, KernelFamily, PieceLimits, SplitLimits};
use crate::runtime::{padded, record, Call, Dispatch, Gpu, KvCache};

/// One step on a device cache, on the decode kernel `kernel` forces
/// (`None`: the planner's; see [`DecodeRequest::kernel`]): the encoded
/// path's dispatches on the engine's own buffers, run, rerun with more
/// splits when a loop guard fires, and read back.
pub async fn decode(
    gpu: &Gpu,
    cache: &KvCache,
    step: &DecodeStep<'_>,
    opts: &AttentionOptions,
    num_splits: Option<usize>,
    kernel: Option<KernelFamily>,
) -> Result<DecodeOutput> {
    let p = DecodeProblem::new(step, cache.shape(), cache.precision())?;
    if cache.quant().is_some() {
        crate::kv_quant::check_new_finite(step)?;
    }
    let run = Step::new(gpu, cache, &p, opts, num_splits, kernel)?;
    let loops = loops(gpu, &run.req, run.variant, cache.quant())?;
    let (mut out, reruns) =
        with_reruns(gpu, p.precision, &loops, |limits| run.attempt(step, limits)).await?;
    out.stats.reruns = reruns;
    Ok(out)
}

/// One step on a host cache: validated, uploaded, decoded, and the cache
/// read back when the step appended to it.
pub async fn decode_host(
    gpu: &Gpu,
    host: &mut HostKvCache,
    step: &DecodeStep<'_>,
    opts: &AttentionOptions,
    num_splits: Option<usize>,
    kernel: Option<KernelFamily>,
) -> Result<DecodeOutput> {
    opts.validate()?;
    let p = DecodeProblem::new(step, &host.shape, host.precision())?;
    opts.for_decoding(p.batch, p.heads_q)?;
    let cache = KvCache::upload(gpu, host)?;
    let out = decode(gpu, &cache, step, opts, num_splits, kernel).await?;
    if step.appends() {
        *host = cache.read(gpu).await?;
    }
    Ok(out)
}

/// One step on a quantized host cache: validated, uploaded, decoded (the
/// new rows quantized by the append kernel), and the codes and scales read
/// back when the step appended.
pub async fn decode_quantized_host(
    gpu: &Gpu,
    host: &mut QuantKvCache,
    step: &DecodeStep<'_>,
    opts: &AttentionOptions,
    num_splits: Option<usize>,
    kernel: Option<KernelFamily>,
) -> Result<DecodeOutput> {
    opts.validate()?;
    let p = DecodeProblem::new(step, &host.shape, host.precision)?;
    opts.for_decoding(p.batch, p.heads_q)?;
    // Checks the cache; `decode` checks the new rows.
    let cache = KvCache::upload_quantized(gpu, host)?;
    let out = decode(gpu, &cache, step, opts, num_splits, kernel).await?;
    if step.appends() {
        *host = cache.read_quantized(gpu).await?;
    }
    Ok(out)
}

/// A cache on the app's `k` and `v` ranges: each checked as an encoded
/// call's ranges are (aligned, inside its buffer, holding the cache, within
/// one storage binding).
pub fn cache_in(
    gpu: &Gpu,
    shape: CacheShape,
    precision: Precision,
    k: &wgpu::BufferBinding,
    v: &wgpu::BufferBinding,
) -> Result<KvCache> {
    let bytes = KvCache::bytes(gpu, &shape, precision)?;
    let k_range = [Range::new("k cache", k, bytes[0])];
    // A latent cache reads V from K's range: `v` is never bound. Else V is
    // checked as a written range (an append writes both), so one
    // intersecting K is `OverlappingBindings`, not rows written over rows.
    let v_range = [Range::new("v cache", v, bytes[1])];
    let v_range: &[Range] = if shape.latent { &[] } else { &v_range };
    bindings::check(gpu, &k_range, v_range)?;
    Ok(KvCache::in_ranges(gpu, shape, precision, k, v, bytes))
}

/// Bytes of the app's scratch an encoded step of `p` planned as `plan`
/// uses: the splits' f32 partial o, then (at the next aligned offset) their
/// partial lse; 0 for a step in one split, which needs none.
pub fn scratch_size(gpu: &Gpu, p: &DecodeProblem, plan: &DecodePlan) -> u64 {
    let splits = plan.splits.num_splits as u64;
    if splits <= 1 {
        return 0;
    }
    let [o, lse] = part_bytes(p, splits);
    lse_offset(gpu, o) + padded(lse)
}

/// Bytes of the splits' partial o and lse.
fn part_bytes(p: &DecodeProblem, splits: u64) -> [u64; 2] {
    [
        splits * p.o_len() as u64 * 4,
        splits * p.lse_len() as u64 * 4,
    ]
}

/// Where the partial lse starts in the scratch: past `o_bytes`, aligned.
fn lse_offset(gpu: &Gpu, o_bytes: u64) -> u64 {
    let align = gpu.limits.min_storage_buffer_offset_alignment as u64;
    o_bytes.next_multiple_of(align.max(4))
}

/// What the planner is asked for a step.
fn request(
    p: &DecodeProblem,
    num_splits: Option<usize>,
    kernel: Option<KernelFamily>,
) -> DecodeRequest {
    DecodeRequest {
        batch: p.batch,
        seqlen_q: p.seqlen_q,
        heads_q: p.heads_q,
        heads_kv: p.heads_kv,
        head_dim: p.head_dim,
        head_dim_v: p.head_dim_v,
        max_seqlen_k: p.max_seqlen_k(),
        precision: p.precision,
        num_splits: num_splits.filter(|&n| n > 0),
        f16_native: None,
        kernel,
    }
}

/// The decode kernel's tiles for a step of `p` on `gpu` (`kernel` as in
/// [`decode`]).
pub fn tiles(gpu: &Gpu, p: &DecodeProblem, kernel: Option<KernelFamily>) -> Result<DecodeTiles> {
    decode_tiles(&request(p, None, kernel), &gpu.caps())
}

/// The decode kernel in both forms (either may be the one whose loop limit
/// binds) and their loop costs.
fn loops(
    gpu: &Gpu,
    req: &DecodeRequest,
    variant: Variant,
    quant: Option<CacheQuant>,
) -> Result<[(KernelKey, LoopCost); 2]> {
    let tiles = decode_tiles(req, &gpu.caps())?;
    Ok([false, true].map(|partial| {
        let k = FlashDecode {
            tiles,
            partial,
            quant,
            variant,
        };
        (KernelKey::from(k), k.loop_cost())
    }))
}

/// The plan a step would run with on `gpu` (its splits within the loop
/// limit, as predicted or learned so far).
pub fn plan(
    gpu: &Gpu,
    p: &DecodeProblem,
    opts: &AttentionOptions,
    num_splits: Option<usize>,
    kernel: Option<KernelFamily>,
) -> Result<DecodePlan> {
    let req = request(p, num_splits, kernel);
    let variant = step_variant(gpu, p, opts);
    let limits = piece_limits(gpu, p.precision, &loops(gpu, &req, variant, None)?)?;
    plan_within(gpu, &req, limits.max_keys)
}

/// The decode kernel's variant for a step of `p` under `opts`.
fn step_variant(gpu: &Gpu, p: &DecodeProblem, opts: &AttentionOptions) -> Variant {
    gpu.variant(p.mask(0, opts).is_active(), opts.softcap_value() > 0.0)
        .with_options(opts)
}

/// The plan of a request on `gpu` with splits of at most `max_keys`.
fn plan_within(gpu: &Gpu, req: &DecodeRequest, max_keys: usize) -> Result<DecodePlan> {
    let limits = SplitLimits {
        parallelism: gpu.parallelism(),
        max_keys,
        max_binding: gpu.max_binding(),
    };
    plan_decode(req, &gpu.caps(), &limits)
}

/// A validated step and what it runs with.
pub struct Step<'a> {
    gpu: &'a Gpu,
    cache: &'a KvCache,
    p: &'a DecodeProblem,
    req: DecodeRequest,
    variant: Variant,
    /// The attention parameters, pointed at the side tables.
    params: Params,
    /// The side buffer's words: ALiBi's slopes and the sinks (none without).
    side: Vec<u32>,
}

/// The ranges one step's kernels bind: q, o and lse always; the new rows
/// when the step appends here; the splits' partials when there are several.
struct StepRanges<'b> {
    q: wgpu::BufferBinding<'b>,
    o: wgpu::BufferBinding<'b>,
    lse: wgpu::BufferBinding<'b>,
    new_kv: Option<[wgpu::BufferBinding<'b>; 2]>,
    parts: Option<[wgpu::BufferBinding<'b>; 2]>,
    /// Each sequence's keys, then the page table.
    index: &'b wgpu::Buffer,
    /// ALiBi's slopes and the sinks, where the step has them.
    side: Option<&'b wgpu::Buffer>,
}

/// The engine's own buffers of one attempt of a host step.
struct StepBuffers {
    q: wgpu::Buffer,
    index: wgpu::Buffer,
    side: Option<wgpu::Buffer>,
    o: wgpu::Buffer,
    lse: wgpu::Buffer,
    parts: Option<[wgpu::Buffer; 2]>,
    new: Option<[wgpu::Buffer; 2]>,
}

impl StepBuffers {
    fn ranges(&self) -> StepRanges<'_> {
        fn pair(b: &[wgpu::Buffer; 2]) -> [wgpu::BufferBinding<'_>; 2] {
            b.each_ref().map(|b| b.as_entire_buffer_binding())
        }
        StepRanges {
            q: self.q.as_entire_buffer_binding(),
            o: self.o.as_entire_buffer_binding(),
            lse: self.lse.as_entire_buffer_binding(),
            new_kv: self.new.as_ref().map(pair),
            parts: self.parts.as_ref().map(pair),
            index: &self.index,
            side: self.side.as_ref(),
        }
    }
}

/// The bytes each of a step's tensors needs in a binding (padded to 4);
/// `[k, v]` where their head dims may differ.
struct StepBytes {
    q: u64,
    o: u64,
    new: [u64; 2],
    lse: u64,
    cache: [u64; 2],
}

impl StepBytes {
    fn of(p: &DecodeProblem, cache: &KvCache) -> Self {
        let bytes = |n: usize| padded(n as u64 * p.precision.bytes() as u64);
        // Exactly the bytes the cache's ranges hold (a quantized one's codes
        // and scales).
        let cache_bytes =
            [cache.k_binding(), cache.v_binding()].map(|b| b.size.map_or(0, |s| s.get()));
        let rows = p.batch * p.seqlen_new;
        let k_new = bytes(rows * p.cache.row_len());
        // A latent step's v_new range is its k_new's (the append reads no V).
        let v_new = match p.cache.latent {
            true => k_new,
            false => bytes(rows * p.cache.v_row_len()),
        };
        Self {
            q: bytes(p.q_len()),
            o: bytes(p.o_len()),
            new: [k_new, v_new],
            lse: padded(p.lse_len() as u64 * 4),
            cache: cache_bytes,
        }
    }
}

/// `binding` cut to the `bytes` its tensor needs (so a range reaching far
/// past its tensor is never bound whole).
fn fitted<'b>(binding: &wgpu::BufferBinding<'b>, bytes: u64) -> wgpu::BufferBinding<'b> {
    wgpu::BufferBinding {
        size: wgpu::BufferSize::new(bytes),
        ..binding.clone()
    }
}

impl<'a> Step<'a> {
    /// A step of `p` on `cache` under `opts` (checked here), its splits as
    /// asked or planned, on the decode kernel `kernel` forces.
    pub fn new(
        gpu: &'a Gpu,
        cache: &'a KvCache,
        p: &'a DecodeProblem,
        opts: &'a AttentionOptions,
        num_splits: Option<usize>,
        kernel: Option<KernelFamily>,
    ) -> Result<Self> {
        cache.check_owner(gpu)?;
        opts.for_decoding(p.batch, p.heads_q)?;
        let mut params = Params::decode(p, opts)?;
        // V's rows in V's storage: K's, in a latent cache.
        params.v_row_stride = to_u32("v row stride", p.cache.v_row_stride())?;
        let tables = SideTables {
            alibi: opts.alibi.as_ref(),
            sinks: opts.sinks.as_ref(),
            ..SideTables::default()
        };
        let side = tables.build(&mut params, p.heads_q)?;
        Ok(Self {
            gpu,
            cache,
            p,
            req: request(p, num_splits, kernel),
            variant: step_variant(gpu, p, opts),
            params,
            side,
        })
    }

    /// The plan within the loop limit as predicted or learned so far (an
    /// encoded step runs whole: no guard is read after it).
    fn plan(&self) -> Result<DecodePlan> {
        let loops = loops(self.gpu, &self.req, self.variant, self.cache.quant())?;
        let limits = piece_limits(self.gpu, self.p.precision, &loops)?;
        plan_within(self.gpu, &self.req, limits.max_keys)
    }

    /// Record the step into `encoder` on the app's ranges `b` (every range
    /// checked first; on an error nothing is recorded), and return its plan.
    pub async fn encode(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        b: &DecodeBindings<'_>,
    ) -> Result<DecodePlan> {
        let (gpu, p) = (self.gpu, self.p);
        let plan = self.plan()?;
        let scratch_bytes = scratch_size(gpu, p, &plan);
        self.variant.aliased = self.check_bindings(b, scratch_bytes)?;
        // The index in a buffer of its own (not the pool's, which a later
        // call could take and overwrite before the app submits this one).
        let index = gpu.buffer_with(&index_words(p)?);
        let side = (!self.side.is_empty()).then(|| gpu.buffer_with(&self.side));
        let own;
        let parts = if scratch_bytes > 0 {
            let scratch = match &b.scratch {
                Some(s) => s.clone(),
                None => {
                    own = gpu.zeroed_buffer(scratch_bytes);
                    own.as_entire_buffer_binding()
                }
            };
            Some(self.parts_in(&scratch, plan.splits.num_splits as u64))
        } else {
            None
        };
        let t = StepBytes::of(p, self.cache);
        let appends = p.seqlen_new > 0;
        let new_kv = b.new_kv.as_ref().filter(|_| appends);
        let ranges = StepRanges {
            q: fitted(&b.q, t.q),
            o: fitted(&b.o, t.o),
            lse: fitted(&b.lse, t.lse),
            new_kv: new_kv.map(|[k, v]| [fitted(k, t.new[0]), fitted(v, t.new[1])]),
            parts,
            index: &index,
            side: side.as_ref(),
        };
        let (dispatches, _) = self.dispatches(&plan, &ranges)?;
        record(gpu, encoder, &dispatches).await?;
        Ok(plan)
    }

    /// Record only the append of the step's new rows, `[k_new, v_new]` on
    /// the app's ranges, into `encoder` (nothing when it appends none).
    pub async fn encode_append(
        &mut self,
        encoder: &mut wgpu::CommandEncoder,
        k_new: &wgpu::BufferBinding<'_>,
        v_new: &wgpu::BufferBinding<'_>,
    ) -> Result<()> {
        let t = StepBytes::of(self.p, self.cache);
        let (k, v) = (self.cache.k_binding(), self.cache.v_binding());
        let range = Range::new;
        let mut cache = vec![range("k cache", &k, t.cache[0])];
        if !self.p.cache.latent {
            cache.push(range("v cache", &v, t.cache[1]));
        }
        self.variant.aliased = bindings::check(
            self.gpu,
            &[range("k_new", k_new, t.new[0]), range("v_new", v_new, t.new[1])],
            &cache,
        )?;
        if self.p.seqlen_new == 0 {
            return Ok(());
        }
        let plan = self.plan()?;
        let index = self.gpu.buffer_with(&index_words(self.p)?);
        let u = self.uniforms(&plan)?;
        let (k_new, v_new) = (fitted(k_new, t.new[0]), fitted(v_new, t.new[1]));
        let (append, _) = self.append(&plan, &u, k_new, v_new, &index)?;
        record(self.gpu, encoder, &[append]).await
    }

    /// The app's ranges of an encoded step: inside their buffers at aligned
    /// offsets, large enough, and no range written in a dispatch
    /// intersecting one it reads or writes (o and lse apart from every
    /// input, the cache apart from the new rows, the scratch apart from
    /// all). Whether any written range shares a buffer with another range,
    /// so the step runs the kernels' aliased form.
    fn check_bindings(&self, b: &DecodeBindings, scratch_bytes: u64) -> Result<bool> {
        let t = StepBytes::of(self.p, self.cache);
        let (k, v) = (self.cache.k_binding(), self.cache.v_binding());
        let range = Range::new;
        let mut inputs = vec![
            range("q", &b.q, t.q),
            range("k cache", &k, t.cache[0]),
            range("v cache", &v, t.cache[1]),
        ];
        let new = b
            .new_kv
            .as_ref()
            .map(|[kn, vn]| [range("k_new", kn, t.new[0]), range("v_new", vn, t.new[1])]);
        inputs.extend(
            new.iter()
                .flatten()
                .map(|r| range(r.tensor, r.binding, r.needs)),
        );
        let outputs = [range("o", &b.o, t.o), range("lse", &b.lse, t.lse)];
        let mut aliased = bindings::check(self.gpu, &inputs, &outputs)?;
        if let Some(new) = &new {
            // The append writes the cache while it reads the new rows (a
            // latent cache's one range once).
            let cache = if self.p.cache.latent { 1..2 } else { 1..3 };
            aliased |= bindings::check(self.gpu, new, &inputs[cache])?;
        }
        let Some(scratch) = &b.scratch else {
            return Ok(aliased);
        };
        let mut every = inputs;
        every.extend(outputs);
        let scratch = [range("scratch", scratch, scratch_bytes)];
        Ok(aliased | bindings::check(self.gpu, &every, &scratch)?)
    }

    /// The splits' partial o and lse in `scratch` ([`scratch_size`]'s layout).
    fn parts_in<'b>(
        &self,
        scratch: &wgpu::BufferBinding<'b>,
        splits: u64,
    ) -> [wgpu::BufferBinding<'b>; 2] {
        let [o, lse] = part_bytes(self.p, splits);
        let at = |offset, bytes| wgpu::BufferBinding {
            buffer: scratch.buffer,
            offset: scratch.offset + offset,
            size: wgpu::BufferSize::new(padded(bytes)),
        };
        [at(0, o), at(lse_offset(self.gpu, o), lse)]
    }

    /// Plan within `limits`, run append, decode and merge on the engine's
    /// buffers, and read o and lse back.
    async fn attempt(&self, step: &DecodeStep<'_>, limits: PieceLimits) -> Result<DecodeOutput> {
        let (gpu, p) = (self.gpu, self.p);
        let plan = plan_within(gpu, &self.req, limits.max_keys)?;
        let mut call = Call::new(gpu, None);
        let bufs = self.buffers(&mut call, step, plan.splits.num_splits as u64)?;
        let (dispatches, accesses) = self.dispatches(&plan, &bufs.ranges())?;
        call.stats.accesses += accesses;
        call.run(&dispatches).await?;
        let (o_bytes, lse_bytes) = (
            (p.o_len() * p.precision.bytes()) as u64,
            p.lse_len() as u64 * 4,
        );
        let mut data = call
            .read(&[(&bufs.o, o_bytes), (&bufs.lse, lse_bytes)])
            .await?;
        let lse = bytemuck::pod_collect_to_vec(&data.pop().unwrap_or_default());
        let o = TensorData::from_bytes(&data.pop().unwrap_or_default(), p.precision, p.o_len())?;
        Ok(DecodeOutput::new(
            p,
            o,
            lse,
            plan.splits.num_splits,
            call.finish(),
        ))
    }

    fn buffers(&self, call: &mut Call, step: &DecodeStep, splits: u64) -> Result<StepBuffers> {
        let p = self.p;
        let (o_len, lse_len) = (p.o_len() as u64, p.lse_len() as u64);
        let new = match (step.new_kv, step.new_latent) {
            _ if p.seqlen_new == 0 => None,
            (Some([k, v]), _) => Some([
                call.upload("k_new", k.data.as_bytes())?,
                call.upload("v_new", v.data.as_bytes())?,
            ]),
            // A latent cache's append reads k_new alone; its v_new binding
            // is k_new's buffer, never read.
            (None, Some(k)) => {
                let k = call.upload("k_new", k.data.as_bytes())?;
                Some([k.clone(), k])
            }
            (None, None) => None,
        };
        let parts = if splits > 1 {
            let [o, lse] = part_bytes(p, splits);
            Some([
                call.storage("o partials", o)?,
                call.storage("lse partials", lse)?,
            ])
        } else {
            None
        };
        let side = &self.side;
        Ok(StepBuffers {
            q: call.upload("q", step.q.data.as_bytes())?,
            index: call.upload("index", bytemuck::cast_slice(&index_words(p)?))?,
            side: (!side.is_empty())
                .then(|| call.upload("side tables", bytemuck::cast_slice(side)))
                .transpose()?,
            o: call.storage("o", o_len * p.precision.bytes() as u64)?,
            lse: call.storage("lse", lse_len * 4)?,
            parts,
            new,
        })
    }

    fn uniforms(&self, plan: &DecodePlan) -> Result<Uniforms> {
        Ok(Uniforms {
            params: self.params,
            decode: decode_params(self.p, plan, self.cache)?,
        })
    }

    /// The step's dispatches on `r` — the append where it has new rows,
    /// the attention, the merge where it has partials — and their storage
    /// accesses.
    fn dispatches<'b>(
        &'b self,
        plan: &DecodePlan,
        r: &StepRanges<'b>,
    ) -> Result<(Vec<Dispatch<'b>>, Accesses)> {
        let u = self.uniforms(plan)?;
        let mut out = Vec::with_capacity(3);
        let mut accesses = Accesses::default();
        if let Some([k_new, v_new]) = &r.new_kv {
            let (d, a) = self.append(plan, &u, k_new.clone(), v_new.clone(), r.index)?;
            out.push(d);
            accesses += a;
        }
        let (d, a) = self.attend(plan, &u, r)?;
        out.push(d);
        accesses += a;
        if let Some([o_part, lse_part]) = &r.parts {
            let (d, a) = self.merge(plan, &u, o_part.clone(), lse_part.clone(), r)?;
            out.push(d);
            accesses += a;
        }
        Ok((out, accesses))
    }

    /// k_new/v_new into the cache.
    fn append<'b>(
        &'b self,
        plan: &DecodePlan,
        u: &Uniforms,
        k_new: wgpu::BufferBinding<'b>,
        v_new: wgpu::BufferBinding<'b>,
        index: &'b wgpu::Buffer,
    ) -> Result<(Dispatch<'b>, Accesses)> {
        let p = self.p;
        let kernel = KvAppend {
            storage: plan.tiles.storage,
            head_dim: plan.tiles.head_dim,
            head_dim_v: plan.tiles.head_dim_v,
            quant: self.cache.quant(),
            variant: self.helper_variant(),
        };
        let block_tokens = ScaleBlocks::of(&p.cache).tokens;
        let (grid, groups_x) = match kernel.quant_grid(p, block_tokens) {
            Some(grid) => {
                let grid = grid.map(grid_u32);
                check_grid(self.gpu, &grid)?;
                (grid, 1)
            }
            None => {
                // One invocation per element of the wider of K's and V's
                // new rows (a latent cache's: K's alone).
                let row = p.cache.row_len().max(v_new_len(p));
                let n = (p.batch * p.seqlen_new * row) as u64;
                wrapped_grid(self.gpu, n.div_ceil(HELPER_WORKGROUP as u64))?
            }
        };
        use binding::*;
        let d = Dispatch {
            kernel: kernel.into(),
            uniforms: u.with_groups_x(groups_x),
            buffers: vec![
                (K_NEW, k_new),
                (V_NEW, v_new),
                (K, self.cache.k_binding()),
                (V, self.cache.v_binding()),
                (INDEX, index.as_entire_buffer_binding()),
            ],
            grid,
            walk: None,
        };
        Ok((d, kernel.accesses(p)))
    }

    /// The split-KV attention: final o and lse, or the splits' partials.
    fn attend<'b>(
        &'b self,
        plan: &DecodePlan,
        u: &Uniforms,
        r: &StepRanges<'b>,
    ) -> Result<(Dispatch<'b>, Accesses)> {
        let kernel = FlashDecode {
            tiles: plan.tiles,
            partial: r.parts.is_some(),
            quant: self.cache.quant(),
            variant: self.variant,
        };
        let grid = kernel.grid(self.p, &u.decode);
        check_grid(self.gpu, &grid)?;
        let accesses = kernel.accesses(self.p, &u.params, &u.decode);
        let [o, lse] = r.parts.clone().unwrap_or([r.o.clone(), r.lse.clone()]);
        use binding::*;
        let mut buffers = vec![
            (Q, r.q.clone()),
            (K, self.cache.k_binding()),
            (V, self.cache.v_binding()),
            (O, o),
            (LSE, lse),
            (INDEX, r.index.as_entire_buffer_binding()),
        ];
        buffers.extend(r.side.map(|s| (SIDE, s.as_entire_buffer_binding())));
        let d = Dispatch {
            kernel: kernel.into(),
            uniforms: u.with_groups_x(1),
            buffers,
            grid,
            walk: Some((plan.splits.keys_per_split, plan.tiles.workgroup_size)),
        };
        Ok((d, accesses))
    }

    /// The splits' partials into o and lse.
    fn merge<'b>(
        &'b self,
        plan: &DecodePlan,
        u: &Uniforms,
        o_part: wgpu::BufferBinding<'b>,
        lse_part: wgpu::BufferBinding<'b>,
        r: &StepRanges<'b>,
    ) -> Result<(Dispatch<'b>, Accesses)> {
        let kernel = DecodeMerge {
            storage: plan.tiles.storage,
            head_dim_v: plan.tiles.head_dim_v,
            variant: self.helper_variant(),
        };
        let (grid, groups_x) = wrapped_grid(self.gpu, self.p.lse_len() as u64)?;
        let accesses = kernel.accesses(self.p, u.decode.num_splits);
        use binding::*;
        let d = Dispatch {
            kernel: kernel.into(),
            uniforms: u.with_groups_x(groups_x),
            buffers: vec![
                (O_PART, o_part),
                (LSE_PART, lse_part),
                (O, r.o.clone()),
                (LSE, r.lse.clone()),
            ],
            grid,
            walk: None,
        };
        Ok((d, accesses))
    }

    /// The append and merge have no masks or score terms (the sinks join
    /// the softmax of the split that holds key 0).
    fn helper_variant(&self) -> Variant {
        Variant {
            masked: false,
            softcap: false,
            alibi: false,
            sinks: false,
            ..self.variant
        }
    }
}

/// The two uniform blocks every decode kernel reads.
struct Uniforms {
    params: Params,
    decode: DecodeParams,
}

impl Uniforms {
    /// `(binding, bytes)` of both, for a grid `groups_x` wide.
    fn with_groups_x(&self, groups_x: u32) -> Vec<(u32, Vec<u8>)> {
        let decode = DecodeParams {
            groups_x,
            ..self.decode
        };
        vec![
            (binding::PARAMS, bytes(&self.params)),
            (binding::DECODE, bytes(&decode)),
        ]
    }
}

fn bytes<T: Uniform>(x: &T) -> Vec<u8> {
    bytemuck::bytes_of(x).to_vec()
}

/// The decode parameters of a plan on `cache`.
fn decode_params(p: &DecodeProblem, plan: &DecodePlan, cache: &KvCache) -> Result<DecodeParams> {
    let group_rows = p.group() * p.seqlen_q;
    let blocks = ScaleBlocks::of(&p.cache);
    let [k_scales_at, v_scales_at] = cache.scales_at()?;
    Ok(DecodeParams {
        page_size: to_u32("page size", p.table.page_size)?,
        max_pages: to_u32("max pages", p.table.max_pages)?,
        keys_per_split: to_u32("keys per split", plan.splits.keys_per_split)?,
        num_splits: to_u32("splits", plan.splits.num_splits)?,
        group_rows: to_u32("packed rows", group_rows)?,
        row_blocks: to_u32("row blocks", group_rows.div_ceil(plan.tiles.rows as usize))?,
        o_split_stride: to_u32("o partial stride", p.o_len())?,
        lse_split_stride: to_u32("lse partial stride", p.lse_len())?,
        seqlen_new: to_u32("seqlen_new", p.seqlen_new)?,
        groups_x: 1,
        pages_at: to_u32("batch", p.batch)?,
        heads_kv: to_u32("heads_kv", p.heads_kv)?,
        block_tokens: to_u32("tokens per scale block", blocks.tokens)?,
        blocks_per_page: to_u32("scale blocks per page", blocks.per_page)?,
        k_scales_at,
        v_scales_at,
        v_head_stride: to_u32("v head stride", p.cache.v_head_stride())?,
        v_new_len: to_u32("v_new row", v_new_len(p))?,
    })
}

/// Elements of one row of `v_new`: 0 on a latent cache, which appends
/// K's rows alone.
fn v_new_len(p: &DecodeProblem) -> usize {
    match p.cache.latent {
        true => 0,
        false => p.cache.v_row_len(),
    }
}

/// Each sequence's keys after the append, then the page table.
fn index_words(p: &DecodeProblem) -> Result<Vec<u32>> {
    let mut words = (0..p.batch)
        .map(|b| to_u32("a sequence's keys", p.seqlen_k(b)))
        .collect::<Result<Vec<u32>>>()?;
    words.extend_from_slice(&p.table.pages);
    Ok(words)
}

/// A grid of `groups` workgroups wrapped from x into y at the device's
/// limit, and its width.
fn wrapped_grid(gpu: &Gpu, groups: u64) -> Result<([u32; 3], u32)> {
    let max = gpu.max_groups() as u64;
    let x = groups.clamp(1, max);
    let grid = [x as u32, grid_u32(groups.div_ceil(x).max(1)), 1];
    check_grid(gpu, &grid)?;
    Ok((grid, x as u32))
}

fn check_grid(gpu: &Gpu, grid: &[u32; 3]) -> Result<()> {
    let max = gpu.max_groups();
    for (what, n) in ["splits × row blocks", "heads_kv or rows", "batch"]
        .into_iter()
        .zip(grid)
    {
        if *n > max {
            return Err(Error::GridTooLarge {
                what,
                groups: *n as u64,
                max,
            });
        }
    }
    Ok(())
}

//! Decoding as an operation: a step validated against its cache before
//! anything is written, its new rows appended in place, the split-KV
//! kernel, the merge when there are splits, and o and lse read back — one
//! submission. On host caches: uploaded, decoded, read back.

use super::reruns::{piece_limits, with_reruns};
use crate::api::decode::{DecodeOutput, DecodeProblem, DecodeStep, HostKvCache};
use crate::api::options::AttentionOptions;
use crate::api::size::{grid_u32, to_u32};
use crate::api::tensor::TensorData;
use crate::error::{Error, Result};
use crate::kernels::decode::HELPER_WORKGROUP;
use crate::kernels::{
    binding, DecodeMerge, DecodeParams, FlashDecode, KernelKey, KvAppend, LoopCost, Params,
    Uniform, Variant,
};
use crate::plan::decode::{decode_tiles, DecodeTiles};
use crate::plan::{plan_decode, DecodePlan, DecodeRequest, KernelFamily, PieceLimits, SplitLimits};
use crate::runtime::{whole, Call, Dispatch, Gpu, KvCache};

/// One step on a device cache, on the decode kernel `kernel` forces
/// (`None`: the planner's; see [`DecodeRequest::kernel`]).
pub async fn decode(
    gpu: &Gpu,
    cache: &KvCache,
    step: &DecodeStep<'_>,
    opts: &AttentionOptions,
    num_splits: Option<usize>,
    kernel: Option<KernelFamily>,
) -> Result<DecodeOutput> {
    opts.validate()?;
    opts.band_only("decoding")?;
    let p = DecodeProblem::new(step, cache.shape(), cache.precision())?;
    let req = request(&p, num_splits, kernel);
    let variant = gpu.variant(p.mask(0, opts).is_active(), opts.softcap_value() > 0.0);
    let loops = loops(gpu, &req, variant)?;
    let run = Step {
        gpu,
        cache,
        step,
        p: &p,
        opts,
        req,
        variant,
    };
    let (mut out, reruns) =
        with_reruns(gpu, p.precision, &loops, |limits| run.attempt(limits)).await?;
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
    opts.band_only("decoding")?;
    DecodeProblem::new(step, &host.shape, host.precision())?;
    let cache = KvCache::upload(gpu, host)?;
    let out = decode(gpu, &cache, step, opts, num_splits, kernel).await?;
    if step.new_kv.is_some() {
        *host = cache.read(gpu).await?;
    }
    Ok(out)
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
fn loops(gpu: &Gpu, req: &DecodeRequest, variant: Variant) -> Result<[(KernelKey, LoopCost); 2]> {
    let tiles = decode_tiles(req, &gpu.caps())?;
    Ok([false, true].map(|partial| {
        let k = FlashDecode {
            tiles,
            partial,
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
    let variant = gpu.variant(p.mask(0, opts).is_active(), opts.softcap_value() > 0.0);
    let limits = piece_limits(gpu, p.precision, &loops(gpu, &req, variant)?)?;
    plan_within(gpu, &req, limits.max_keys)
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
struct Step<'a> {
    gpu: &'a Gpu,
    cache: &'a KvCache,
    step: &'a DecodeStep<'a>,
    p: &'a DecodeProblem,
    opts: &'a AttentionOptions,
    req: DecodeRequest,
    variant: Variant,
}

/// The device buffers of one attempt: o and lse always; the splits'
/// partials when there are several; the new rows when the step appends.
struct StepBuffers {
    q: wgpu::Buffer,
    index: wgpu::Buffer,
    o: wgpu::Buffer,
    lse: wgpu::Buffer,
    parts: Option<[wgpu::Buffer; 2]>,
    new: Option<[wgpu::Buffer; 2]>,
}

impl Step<'_> {
    /// Plan within `limits` and run append, decode and merge.
    async fn attempt(&self, limits: PieceLimits) -> Result<DecodeOutput> {
        let (gpu, p) = (self.gpu, self.p);
        let plan = plan_within(gpu, &self.req, limits.max_keys)?;
        let mut call = Call::new(gpu, None);
        let bufs = self.buffers(&mut call, plan.splits.num_splits as u64)?;
        let dp = decode_params(p, &plan)?;
        let uniforms = Uniforms {
            params: Params::decode(p, self.opts)?,
            decode: dp,
        };
        let mut dispatches = Vec::new();
        if let Some(new) = &bufs.new {
            dispatches.push(self.append(&mut call, &plan, &uniforms, new, &bufs.index)?);
        }
        dispatches.push(self.attend(&mut call, &plan, &uniforms, &bufs)?);
        if let Some(parts) = &bufs.parts {
            dispatches.push(self.merge(&mut call, &plan, &uniforms, parts, &bufs)?);
        }
        call.run(&dispatches).await?;
        let (o_bytes, lse_bytes) = (
            (p.q_len() * p.precision.bytes()) as u64,
            p.lse_len() as u64 * 4,
        );
        let mut data = call
            .read(&[(&bufs.o, o_bytes), (&bufs.lse, lse_bytes)])
            .await?;
        let lse = bytemuck::pod_collect_to_vec(&data.pop().unwrap_or_default());
        let o = TensorData::from_bytes(&data.pop().unwrap_or_default(), p.precision, p.q_len());
        Ok(DecodeOutput::new(
            p,
            o,
            lse,
            plan.splits.num_splits,
            call.finish(),
        ))
    }

    fn buffers(&self, call: &mut Call, splits: u64) -> Result<StepBuffers> {
        let p = self.p;
        let (q_len, lse_len) = (p.q_len() as u64, p.lse_len() as u64);
        let new = match self.step.new_kv {
            Some([k, v]) => Some([
                call.upload("k_new", k.data.as_bytes())?,
                call.upload("v_new", v.data.as_bytes())?,
            ]),
            None => None,
        };
        let parts = if splits > 1 {
            Some([
                call.storage("o partials", splits * q_len * 4)?,
                call.storage("lse partials", splits * lse_len * 4)?,
            ])
        } else {
            None
        };
        Ok(StepBuffers {
            q: call.upload("q", self.step.q.data.as_bytes())?,
            index: call.upload("index", bytemuck::cast_slice(&index_words(p)?))?,
            o: call.storage("o", q_len * p.precision.bytes() as u64)?,
            lse: call.storage("lse", lse_len * 4)?,
            parts,
            new,
        })
    }

    /// k_new/v_new into the cache.
    fn append<'b>(
        &'b self,
        call: &mut Call,
        plan: &DecodePlan,
        u: &Uniforms,
        [k_new, v_new]: &'b [wgpu::Buffer; 2],
        index: &'b wgpu::Buffer,
    ) -> Result<Dispatch<'b>> {
        let p = self.p;
        let kernel = KvAppend {
            storage: plan.tiles.storage,
            head_dim: plan.tiles.head_dim,
            variant: self.helper_variant(),
        };
        let n = (p.batch * p.seqlen_new * p.cache.row_len()) as u64;
        let (grid, groups_x) = wrapped_grid(self.gpu, n.div_ceil(HELPER_WORKGROUP as u64))?;
        call.stats.accesses += kernel.accesses(p);
        use binding::*;
        Ok(Dispatch {
            kernel: kernel.into(),
            uniforms: u.with_groups_x(groups_x),
            buffers: whole([
                (K_NEW, k_new),
                (V_NEW, v_new),
                (K, self.cache.k()),
                (V, self.cache.v()),
                (INDEX, index),
            ]),
            grid,
            walk: None,
        })
    }

    /// The split-KV attention: final o and lse, or the splits' partials.
    fn attend<'b>(
        &'b self,
        call: &mut Call,
        plan: &DecodePlan,
        u: &Uniforms,
        b: &'b StepBuffers,
    ) -> Result<Dispatch<'b>> {
        let kernel = FlashDecode {
            tiles: plan.tiles,
            partial: b.parts.is_some(),
            variant: self.variant,
        };
        let grid = kernel.grid(self.p, &u.decode);
        check_grid(self.gpu, &grid)?;
        call.stats.accesses += kernel.accesses(self.p, &u.params, &u.decode);
        let [o, lse] = b.parts.as_ref().map_or([&b.o, &b.lse], |[o, l]| [o, l]);
        use binding::*;
        Ok(Dispatch {
            kernel: kernel.into(),
            uniforms: u.with_groups_x(1),
            buffers: whole([
                (Q, &b.q),
                (K, self.cache.k()),
                (V, self.cache.v()),
                (O, o),
                (LSE, lse),
                (INDEX, &b.index),
            ]),
            grid,
            walk: Some((plan.splits.keys_per_split, plan.tiles.workgroup_size)),
        })
    }

    /// The splits' partials into o and lse.
    fn merge<'b>(
        &'b self,
        call: &mut Call,
        plan: &DecodePlan,
        u: &Uniforms,
        [o_part, lse_part]: &'b [wgpu::Buffer; 2],
        b: &'b StepBuffers,
    ) -> Result<Dispatch<'b>> {
        let kernel = DecodeMerge {
            storage: plan.tiles.storage,
            head_dim: plan.tiles.head_dim,
            variant: self.helper_variant(),
        };
        let (grid, groups_x) = wrapped_grid(self.gpu, self.p.lse_len() as u64)?;
        call.stats.accesses += kernel.accesses(self.p, u.decode.num_splits);
        use binding::*;
        Ok(Dispatch {
            kernel: kernel.into(),
            uniforms: u.with_groups_x(groups_x),
            buffers: whole([
                (O_PART, o_part),
                (LSE_PART, lse_part),
                (O, &b.o),
                (LSE, &b.lse),
            ]),
            grid,
            walk: None,
        })
    }

    /// The append and merge have no masks or softcap.
    fn helper_variant(&self) -> Variant {
        Variant {
            masked: false,
            softcap: false,
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

/// The decode parameters of a plan.
fn decode_params(p: &DecodeProblem, plan: &DecodePlan) -> Result<DecodeParams> {
    let group_rows = p.group() * p.seqlen_q;
    Ok(DecodeParams {
        page_size: to_u32("page size", p.table.page_size)?,
        max_pages: to_u32("max pages", p.table.max_pages)?,
        keys_per_split: to_u32("keys per split", plan.splits.keys_per_split)?,
        num_splits: to_u32("splits", plan.splits.num_splits)?,
        group_rows: to_u32("packed rows", group_rows)?,
        row_blocks: to_u32("row blocks", group_rows.div_ceil(plan.tiles.rows as usize))?,
        o_split_stride: to_u32("o partial stride", p.q_len())?,
        lse_split_stride: to_u32("lse partial stride", p.lse_len())?,
        seqlen_new: to_u32("seqlen_new", p.seqlen_new)?,
        groups_x: 1,
        pages_at: to_u32("batch", p.batch)?,
        _pad: 0,
    })
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

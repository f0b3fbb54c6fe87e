//! The flash forward as an operation: on host tensors (planned, cut into
//! pieces where a binding, the grid or the loop limit requires, rerun when a
//! guard fires) and on caller-owned device buffers (one dispatch set, never
//! split).

use super::bindings::{self, Range, TensorBytes};
use super::pieces::ForwardAssembly;
use super::prepare::{pieces, plan_request, side_tables, Prepared};
use super::reruns::with_reruns;
use crate::api::inputs::ForwardInputs;
use crate::api::options::AttentionOptions;
use crate::api::output::{Accesses, CallStats, ForwardOutput};
use crate::api::problem::Problem;
use crate::api::shape::{AttentionShape, Layout};
use crate::api::size::grid_u32;
use crate::api::tensor::{Precision, TensorData, TensorView};
use crate::error::{Error, Result};
use crate::kernels::{
    binding, AttentionBindings, AttentionBuffers, FlashForward, KernelKey, Params, Walk,
};
use crate::plan::{plan_forward, PieceLimits, Plan, PlanOverrides};
use crate::runtime::{record, whole, Call, Dispatch, Gpu};

/// A forward's inputs and choices, validated.
struct Forward<'a> {
    qkv: [&'a TensorView<'a>; 3],
    opts: &'a AttentionOptions,
    shape: AttentionShape,
    kernel: FlashForward,
}

/// The flash kernel for `problem` under `overrides` on `gpu`.
fn kernel_for(gpu: &Gpu, problem: &Problem, overrides: &PlanOverrides) -> Result<FlashForward> {
    let req = plan_request(problem, *overrides);
    let plan = gpu.device_plan(plan_forward(&req, &gpu.caps())?.plan);
    let opts = problem.opts;
    Ok(FlashForward {
        plan,
        variant: gpu
            .variant(problem.banded(), problem.softcapped())
            .with_options(opts)
            .with_tiles(opts, [plan.br, plan.bc]),
    })
}

/// Exact attention forward on host tensors. Problems larger than one
/// storage binding, the dispatch grid or the adapter's loop limit are split,
/// never rejected.
pub async fn forward(
    gpu: &Gpu,
    inputs: &ForwardInputs<'_>,
    problem: &Problem<'_>,
    overrides: &PlanOverrides,
) -> Result<ForwardOutput> {
    let kernel = kernel_for(gpu, problem, overrides)?;
    let opts = problem.opts;
    let ForwardInputs { q, k, v } = inputs;
    let f = Forward {
        qkv: [q, k, v],
        opts,
        shape: problem.shape,
        kernel,
    };
    let loops = [(KernelKey::from(kernel), kernel.loop_cost())];
    let (mut out, reruns) = with_reruns(gpu, q.precision(), &loops, |limits| {
        in_pieces(gpu, &f, limits)
    })
    .await?;
    out.stats.reruns = reruns;
    Ok(out.packed(opts.varlen.is_some()))
}

/// One attempt: the problem in pieces within `limits`.
async fn in_pieces(gpu: &Gpu, f: &Forward<'_>, limits: PieceLimits) -> Result<ForwardOutput> {
    let (shape, precision) = (f.shape, f.qkv[0].precision());
    let pieces = pieces(&shape, f.opts, &limits)?;
    let mut call = Call::new(gpu, Some(f.kernel.plan));
    call.stats.pieces = pieces.len() as u32;
    let (o, lse) = match pieces.as_slice() {
        [p] if p.whole => {
            let [q, k, v] = f.qkv.map(|t| t.data.as_bytes());
            run_piece(&mut call, f, p, q, k, v).await?
        }
        _ => {
            let keys_split = pieces.iter().any(|p| p.piece.k_start > 0);
            let mut out = ForwardAssembly::new(shape, precision, keys_split);
            for p in &pieces {
                let (o, lse) = run_split(&mut call, f, p).await?;
                out.add(&p.rows, &o, &lse, p.lse_layout());
            }
            out.finish(precision)
        }
    };
    Ok(ForwardOutput::new(shape, o, lse, call.finish()))
}

/// Gather one piece of a split problem and run it.
async fn run_split(
    call: &mut Call<'_>,
    f: &Forward<'_>,
    p: &Prepared,
) -> Result<(TensorData, Vec<f32>)> {
    let [q, k, v] = f.qkv;
    let s = &f.shape;
    let parts = [
        p.rows.gather_q(q.data, Layout::q(s)),
        p.rows.gather_k(k.data, Layout::kv(s)),
        p.rows.gather_k(v.data, Layout::v(s)),
    ];
    let [q, k, v] = parts.each_ref().map(|p| p.as_host().as_bytes());
    run_piece(call, f, p, q, k, v).await
}

/// Upload one piece, run it, read o and lse back.
async fn run_piece(
    call: &mut Call<'_>,
    f: &Forward<'_>,
    p: &Prepared,
    q: &[u8],
    k: &[u8],
    v: &[u8],
) -> Result<(TensorData, Vec<f32>)> {
    let s = &p.piece.local;
    let precision = f.kernel.plan.storage.precision();
    let o_bytes = s.o_len() as u64 * precision.bytes() as u64;
    let lse_bytes = s.lse_len() as u64 * 4;
    let (q, k, v) = (
        call.upload("q", q)?,
        call.upload("k", k)?,
        call.upload("v", v)?,
    );
    let o = call.storage("o", o_bytes)?;
    let lse = call.storage("lse", lse_bytes)?;
    let bufs = AttentionBuffers {
        q: &q,
        k: &k,
        v: &v,
        o: &o,
        lse: &lse,
    };
    let launch = Launch::new(&f.kernel, p, f.opts)?;
    launch.check_grid(call.gpu)?;
    let side = launch.side_buffer(call)?;
    call.stats.accesses += launch.accesses;
    let bufs = AttentionBindings::whole(&bufs);
    call.run(&launch.dispatches(call.gpu, &f.kernel, &bufs, side.as_ref()))
        .await?;
    let mut data = call.read(&[(&o, o_bytes), (&lse, lse_bytes)]).await?;
    let lse = bytemuck::pod_collect_to_vec(&data.pop().unwrap_or_default());
    let o = TensorData::from_bytes(&data.pop().unwrap_or_default(), precision, s.o_len())?;
    Ok((o, lse))
}

/// One dispatch set of the flash forward over a piece: its parameters, the
/// side tables its variant reads, its grid and storage accesses.
struct Launch {
    params: Params,
    side: Vec<u32>,
    grid: [u32; 3],
    accesses: Accesses,
    /// The most keys a sequence has (what the key loop walks).
    keys: usize,
}

impl Launch {
    fn new(kernel: &FlashForward, p: &Prepared, opts: &AttentionOptions) -> Result<Self> {
        let mut params = Params::new(&p.piece, opts)?;
        let seqs = p.sequences(&params);
        let heads = p.piece.local.heads_q;
        let plan = &kernel.plan;
        let walk = Walk {
            params: &params,
            seqs: &seqs,
            masked: kernel.variant.masked,
            mask: opts.block_mask.as_ref(),
            tiles: [plan.br, plan.bc],
            by_keys: false,
        };
        let accesses = kernel.accesses(&walk, heads);
        let tables = side_tables(opts, &seqs, plan.br, Some(&walk), None, heads);
        let grid = [kernel.grid_x(&seqs), grid_u32(heads as u64), seqs.grid_z()];
        let keys = seqs.longest().1;
        let side = tables.build(&mut params, p.piece.full.heads_q)?;
        Ok(Self {
            params,
            side,
            grid,
            accesses,
            keys,
        })
    }

    /// The side buffer, where the variant reads one.
    fn side_buffer(&self, call: &mut Call) -> Result<Option<wgpu::Buffer>> {
        (!self.side.is_empty())
            .then(|| call.upload("side tables", bytemuck::cast_slice(&self.side)))
            .transpose()
    }

    /// The dispatches (the grid split at the device's per-dimension limit).
    fn dispatches<'a>(
        &self,
        gpu: &Gpu,
        kernel: &FlashForward,
        bufs: &AttentionBindings<'a>,
        side: Option<&'a wgpu::Buffer>,
    ) -> Vec<Dispatch<'a>> {
        let max = gpu.max_groups();
        let [blocks, heads, z] = self.grid;
        let mut buffers = FlashForward::entries(bufs);
        buffers.extend(whole(side.map(|b| (binding::SIDE, b))));
        (0..blocks)
            .step_by(max as usize)
            .map(|offset| Dispatch {
                kernel: (*kernel).into(),
                uniforms: vec![(
                    binding::PARAMS,
                    bytemuck::bytes_of(&self.params.at_block(offset)).to_vec(),
                )],
                buffers: buffers.clone(),
                grid: [(blocks - offset).min(max), heads, z],
                walk: Some((self.keys, kernel.plan.bc)),
            })
            .collect()
    }

    /// The grid's batch and heads must fit one dispatch dimension.
    fn check_grid(&self, gpu: &Gpu) -> Result<()> {
        let max = gpu.max_groups();
        for (what, n) in [("heads_q", self.grid[1]), ("batch", self.grid[2])] {
            if n > max {
                return Err(Error::GridTooLarge {
                    what,
                    groups: n as u64,
                    max,
                });
            }
        }
        Ok(())
    }
}

/// Forward on caller-owned device buffers (data stays on the GPU). Every
/// tensor must fit in one storage binding, and the call must stay within
/// the adapter's loop limit: this API never splits.
pub async fn forward_buffers(
    gpu: &Gpu,
    buffers: &AttentionBuffers<'_>,
    problem: &Problem<'_>,
    overrides: &PlanOverrides,
) -> Result<CallStats> {
    let bindings = AttentionBindings::whole(buffers);
    let (kernel, launches) = whole_call(gpu, &bindings, problem, overrides)?;
    let mut call = Call::new(gpu, Some(kernel.plan));
    for launch in &launches {
        let side = launch.side_buffer(&mut call)?;
        call.stats.accesses += launch.accesses;
        call.run(&launch.dispatches(gpu, &kernel, &bindings, side.as_ref()))
            .await?;
    }
    Ok(call.finish())
}

/// A call on the caller's bindings, which runs whole (never split): its
/// kernel and launches, with the bindings, the grid and the adapter's loop
/// limit checked.
fn whole_call(
    gpu: &Gpu,
    bindings: &AttentionBindings,
    problem: &Problem,
    overrides: &PlanOverrides,
) -> Result<(FlashForward, Vec<Launch>)> {
    let (shape, precision, opts) = (&problem.shape, problem.precision, problem.opts);
    let mut kernel = kernel_for(gpu, problem, overrides)?;
    kernel.variant.aliased = check_bindings(gpu, bindings, shape, precision)?;
    check_loop_limit(gpu, &kernel, shape, opts)?;
    let launches = pieces(shape, opts, &PieceLimits::unbounded(precision))?
        .iter()
        .map(|p| {
            let launch = Launch::new(&kernel, p, opts)?;
            launch.check_grid(gpu)?;
            Ok(launch)
        })
        .collect::<Result<_>>()?;
    Ok((kernel, launches))
}

/// The forward of `problem` recorded into `encoder` on the caller's
/// `bindings`: nothing is submitted, waited on or read back. Everything
/// is checked before anything is recorded — the bindings (alignment,
/// bounds, sizes), the grid and the adapter's loop limit (the call runs
/// whole, never split, so no guard has to be read after it).
pub async fn encode(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    bindings: &AttentionBindings<'_>,
    problem: &Problem<'_>,
    overrides: &PlanOverrides,
) -> Result<Plan> {
    let (kernel, launches) = whole_call(gpu, bindings, problem, overrides)?;
    // Side tables in buffers of their own (not the pool's), which the
    // recorded commands keep alive until they run.
    let sides: Vec<Option<wgpu::Buffer>> = launches
        .iter()
        .map(|l| (!l.side.is_empty()).then(|| gpu.buffer_with(&l.side)))
        .collect();
    let dispatches: Vec<Dispatch> = launches
        .iter()
        .zip(&sides)
        .flat_map(|(l, side)| l.dispatches(gpu, &kernel, bindings, side.as_ref()))
        .collect();
    record(gpu, encoder, &dispatches).await?;
    Ok(kernel.plan)
}

/// The dispatches of the flash kernel over a whole dense problem whose
/// options read no side tables (the FP8 forward's, on its own buffers) and
/// their storage accesses.
pub(crate) fn dispatches<'a>(
    gpu: &Gpu,
    kernel: &FlashForward,
    shape: &AttentionShape,
    opts: &AttentionOptions,
    bufs: &AttentionBindings<'a>,
) -> Result<(Vec<Dispatch<'a>>, Accesses)> {
    let elem = kernel.plan.storage.precision();
    let (mut out, mut accesses) = (Vec::new(), Accesses::default());
    for p in &pieces(shape, opts, &PieceLimits::unbounded(elem))? {
        let launch = Launch::new(kernel, p, opts)?;
        launch.check_grid(gpu)?;
        if !launch.side.is_empty() {
            return Err(Error::Unsupported {
                what: "a dispatch set on caller buffers without side tables",
                feature: "ALiBi, sinks, block masks or packed batches",
            });
        }
        accesses += launch.accesses;
        out.extend(launch.dispatches(gpu, kernel, bufs, None));
    }
    Ok((out, accesses))
}

/// Every binding must start at an offset the device binds, lie within its
/// buffer, hold its tensor and fit one storage binding; o and lse may
/// overlap nothing. Whether o or lse shares a buffer with an input.
pub(crate) fn check_bindings(
    gpu: &Gpu,
    b: &AttentionBindings,
    shape: &AttentionShape,
    precision: Precision,
) -> Result<bool> {
    let t = TensorBytes::of(shape, precision)?;
    let ranges = Range::attention(b, &t);
    bindings::check(gpu, &ranges[..3], &ranges[3..])
}

/// A call that cannot be split must fit the adapter's loop limit as planned
/// (over a packed batch's longest sequence).
pub(crate) fn check_loop_limit(
    gpu: &Gpu,
    kernel: &FlashForward,
    shape: &AttentionShape,
    opts: &AttentionOptions,
) -> Result<()> {
    let key = KernelKey::from(*kernel);
    let predict = !gpu.settings.no_loop_prediction;
    let max = gpu.loop_limit.max_len(&key, &kernel.loop_cost(), predict)?;
    let keys = opts
        .varlen
        .as_ref()
        .map_or(shape.seqlen_k, |v| v.max_seqlens().1);
    match gpu.loop_limit.limit() {
        Some(limit) if keys > max => Err(Error::LoopBudget {
            kernel: key.name(),
            rows: shape.seqlen_q,
            keys: shape.seqlen_k,
            limit,
        }),
        _ => Ok(()),
    }
}

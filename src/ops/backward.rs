//! The flash backward as an operation on host tensors: D = rowsum(dO·O),
//! then dK/dV over key blocks and dQ over query blocks, and with sinks
//! their gradients in two passes, all atomic-free and deterministic. Extra
//! storage beyond inputs and gradients is D (one f32 per row). Split
//! problems sum partial gradients in a fixed order.

use super::bindings::{self, Range, TensorBytes};
use super::pieces::GradAssembly;
use super::prepare::{pieces, plan_request, side_tables, Prepared};
use super::reruns::{piece_limits, with_reruns};
use crate::api::inputs::{BackwardInputs, ForwardInputs};
use crate::api::options::AttentionOptions;
use crate::api::output::{Accesses, BackwardOutput};
use crate::api::problem::Problem;
use crate::api::shape::{AttentionShape, Layout};
use crate::api::tensor::{Precision, TensorData, TensorView};
use crate::api::varlen::sequences;
use crate::error::{Error, Result};
use crate::kernels::{
    binding, BackwardBindings, BackwardBuffers, BackwardPart, FlashBackward, GradientBindings,
    KernelKey, LoopCost, Params, Variant, Walk,
};
use crate::plan::{plan_backward, PieceLimits, Plan, PlanOverrides};
use crate::runtime::{padded, record, whole, Call, Dispatch, Gpu};

/// The kernels of a backward, in order; with sinks the two passes of their
/// gradients follow.
const PARTS: [BackwardPart; 3] = [BackwardPart::Dvec, BackwardPart::DkDv, BackwardPart::Dq];
const SINK_PARTS: [BackwardPart; 2] = [BackwardPart::SinkPartials, BackwardPart::SinkReduce];

/// A backward's kernels for a validated problem.
struct Backward<'a> {
    opts: &'a AttentionOptions,
    shape: AttentionShape,
    /// The tile kernels' plan and variant (the elementwise ones carry less).
    plan: Plan,
    variant: Variant,
    kernels: Vec<FlashBackward>,
}

impl<'a> Backward<'a> {
    /// The planned kernels of `problem` under `overrides` on `gpu`.
    fn new(gpu: &Gpu, problem: &Problem<'a>, overrides: &PlanOverrides) -> Result<Self> {
        let opts = problem.opts;
        let req = plan_request(problem, *overrides);
        let plan = plan_backward(&req, &gpu.caps())?.plan;
        let variant = gpu
            .variant(problem.banded(), problem.softcapped())
            .with_options(opts)
            .with_tiles(opts, [plan.br, plan.bc]);
        let sinks = opts
            .sinks
            .is_some()
            .then_some(SINK_PARTS)
            .into_iter()
            .flatten();
        let kernels = PARTS
            .into_iter()
            .chain(sinks)
            .map(|part| FlashBackward::new(part, plan, variant))
            .collect();
        Ok(Self {
            opts,
            shape: problem.shape,
            plan,
            variant,
            kernels,
        })
    }

    /// Each kernel's key and loop cost (for the loop limit).
    fn loops(&self) -> Vec<(KernelKey, LoopCost)> {
        let group = self.shape.group() as u32;
        let cost = |k: &FlashBackward| ((*k).into(), k.loop_cost(group));
        self.kernels.iter().map(cost).collect()
    }
}

/// Gradients dq, dk, dv (and dsinks) on host tensors (split where needed,
/// never rejected).
pub async fn backward(
    gpu: &Gpu,
    inputs: &BackwardInputs<'_>,
    problem: &Problem<'_>,
    overrides: &PlanOverrides,
) -> Result<BackwardOutput> {
    let b = Backward::new(gpu, problem, overrides)?;
    let (mut out, reruns) = with_reruns(gpu, problem.precision, &b.loops(), |limits| {
        in_pieces(gpu, &b, inputs, limits)
    })
    .await?;
    out.stats.reruns = reruns;
    if problem.opts.sinks.is_some() && problem.precision != Precision::F32 {
        out.dsinks = Some(unrounded_dsinks(gpu, inputs, problem).await?);
    }
    Ok(out.packed(problem.packed()))
}

/// dsinks in f16/bf16 from an O recomputed in f32 on the same (exactly
/// widened) inputs, one forward more, as the CPU and CUDA backends take
/// them: `dsink_h` sums `P_sink · D` over every row of a head, and a D from
/// an O rounded to storage carries that rounding in every row, which puts
/// a small case's few dsinks anywhere within a few times the baseline's
/// error; from this O they sit at f32 rounding. (The gradients keep the
/// stored O's D, as flash-attention's do.)
async fn unrounded_dsinks(
    gpu: &Gpu,
    inputs: &BackwardInputs<'_>,
    problem: &Problem<'_>,
) -> Result<Vec<f32>> {
    let [q, k, v] = [&inputs.q, &inputs.k, &inputs.v].map(|t| t.data.to_f32());
    let f32_inputs = ForwardInputs::new(
        TensorView::f32(inputs.q.shape, &q),
        TensorView::f32(inputs.k.shape, &k),
        TensorView::f32(inputs.v.shape, &v),
    );
    let f32_problem = Problem::forward(&f32_inputs, problem.opts)?;
    let o = super::forward::forward(gpu, &f32_inputs, &f32_problem, &PlanOverrides::default())
        .await?
        .o
        .to_f32();
    let shape = problem.shape;
    let delta = crate::cpu::row_deltas(&shape, &o, &inputs.d_o.data.to_f32());
    let seqs = sequences(&shape, problem.opts.varlen.as_ref());
    let sinks = problem.opts.sinks.as_ref().map_or(&[][..], |s| s.logits());
    Ok(crate::cpu::sink_gradients(sinks, &seqs, inputs.lse, &delta))
}

/// The backward of `problem` recorded into `encoder` on the app's
/// `bindings`, D in the caller's scratch or a buffer created for the call:
/// nothing submitted, waited on or
/// read back. The bindings, the split (an encoded call runs whole) and the
/// loop limit are checked before anything is recorded.
pub async fn encode(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    bindings: &GradientBindings<'_>,
    problem: &Problem<'_>,
    overrides: &PlanOverrides,
) -> Result<Plan> {
    if problem.opts.sinks.is_some() {
        return Err(Error::Unsupported {
            what: "an encoded backward",
            feature: "sinks (their gradient has no binding)",
        });
    }
    let mut b = Backward::new(gpu, problem, overrides)?;
    let aliased = check_bindings(gpu, bindings, &b.shape, problem.precision)?;
    b.kernels
        .iter_mut()
        .for_each(|k| k.variant.aliased = aliased);
    let limits = piece_limits(gpu, problem.precision, &b.loops())?;
    let pieces = pieces(&b.shape, b.opts, &limits)?;
    let p = match pieces.as_slice() {
        [p] if p.whole => p,
        _ => {
            return Err(Error::EncodedCallSplit {
                call: "backward",
                pieces: pieces.len(),
            })
        }
    };
    let launch = Launch::new(&b, p, gpu.max_groups())?;
    let own;
    let dvec = match &bindings.scratch {
        Some(s) => s.clone(),
        None => {
            own = gpu.zeroed_buffer(scratch_size(&b.shape));
            own.as_entire_buffer_binding()
        }
    };
    let side = (!launch.side.is_empty()).then(|| gpu.buffer_with(&launch.side));
    let bufs = BackwardBindings::from_gradients(bindings.clone(), dvec);
    record(
        gpu,
        encoder,
        &launch.dispatches(gpu, &b.kernels, &bufs, side.as_ref()),
    )
    .await?;
    Ok(b.plan)
}

/// Every range must start at an offset the device binds, lie within its
/// buffer and hold its tensor; the gradients and D may overlap nothing.
/// Whether the call needs its aliased kernels: an output in an input's
/// buffer, or D (written by one kernel, read beside the gradients by the
/// next) in a buffer another tensor is bound from.
fn check_bindings(
    gpu: &Gpu,
    g: &GradientBindings,
    shape: &AttentionShape,
    precision: Precision,
) -> Result<bool> {
    let t = TensorBytes::of(shape, precision)?;
    let range = Range::new;
    let inputs = [
        range("q", &g.q, t.q),
        range("k", &g.k, t.kv),
        range("v", &g.v, t.v),
        range("o", &g.o, t.o),
        range("do", &g.d_o, t.o),
        range("lse", &g.lse, t.lse),
    ];
    let mut outputs = vec![
        range("dq", &g.dq, t.q),
        range("dk", &g.dk, t.kv),
        range("dv", &g.dv, t.v),
    ];
    let grads = outputs.len();
    if let Some(scratch) = &g.scratch {
        outputs.push(range("scratch", scratch, scratch_size(shape)));
    }
    let aliased = bindings::check(gpu, &inputs, &outputs)?;
    let d_shares = outputs
        .get(grads)
        .is_some_and(|d| bindings::shares_buffer(d, &outputs[..grads]));
    Ok(aliased || d_shares)
}

/// Bytes of scratch an encoded backward of `shape` uses: D, one f32 per row
/// and query head.
pub fn scratch_size(shape: &AttentionShape) -> u64 {
    padded(shape.lse_len() as u64 * 4)
}

/// One piece's gradients `[dq, dk, dv]` and its dsinks (with sinks).
type PieceGrads = ([TensorData; 3], Option<Vec<f32>>);

/// One attempt: the problem in pieces within `limits`.
async fn in_pieces(
    gpu: &Gpu,
    b: &Backward<'_>,
    i: &BackwardInputs<'_>,
    limits: PieceLimits,
) -> Result<BackwardOutput> {
    let shape = b.shape;
    let precision = i.q.precision();
    let pieces = pieces(&shape, b.opts, &limits)?;
    let mut call = Call::new(gpu, Some(b.plan));
    call.stats.pieces = pieces.len() as u32;
    let (grads, dsinks) = match pieces.as_slice() {
        [p] if p.whole => {
            let [q, k, v, o, d_o] = [i.q, i.k, i.v, i.o, i.d_o].map(|t| t.data.as_bytes());
            let inputs = PieceInputs {
                q,
                k,
                v,
                o,
                d_o,
                lse: i.lse,
            };
            run_piece(&mut call, b, p, &inputs).await?
        }
        _ => {
            let mut sum = GradAssembly::new(shape);
            for p in &pieces {
                let (grads, dsinks) = run_split(&mut call, b, i, p).await?;
                sum.add(&p.rows, &grads, dsinks.as_deref());
            }
            let (grads, dsinks) = sum.finish(precision);
            (grads, b.opts.sinks.is_some().then_some(dsinks))
        }
    };
    let [dq, dk, dv] = grads;
    Ok(BackwardOutput::new(&shape, dq, dk, dv, call.finish()).with_dsinks(dsinks))
}

/// Gather one piece (with its rows' LSE) and run it: its gradients are
/// partial sums (dQ over its keys, dK/dV over its rows).
async fn run_split(
    call: &mut Call<'_>,
    b: &Backward<'_>,
    i: &BackwardInputs<'_>,
    p: &Prepared,
) -> Result<PieceGrads> {
    let s = &b.shape;
    let r = &p.rows;
    let parts = [
        r.gather_q(i.q.data, Layout::q(s)),
        r.gather_k(i.k.data, Layout::kv(s)),
        r.gather_k(i.v.data, Layout::v(s)),
        r.gather_q(i.o.data, Layout::o(s)),
        r.gather_q(i.d_o.data, Layout::o(s)),
    ];
    let lse = r.gather_lse(i.lse, super::pieces::LseLayout::of(s), p.lse_layout());
    let [q, k, v, o, d_o] = parts.each_ref().map(|p| p.as_host().as_bytes());
    let inputs = PieceInputs {
        q,
        k,
        v,
        o,
        d_o,
        lse: &lse,
    };
    run_piece(call, b, p, &inputs).await
}

/// One piece's backward inputs: its tensors' bytes (each in the piece's
/// local layout) and its rows' LSE.
struct PieceInputs<'a> {
    q: &'a [u8],
    k: &'a [u8],
    v: &'a [u8],
    o: &'a [u8],
    d_o: &'a [u8],
    lse: &'a [f32],
}

/// Upload one piece, run the kernels, read dq, dk, dv (and dsinks) back.
async fn run_piece(
    call: &mut Call<'_>,
    b: &Backward<'_>,
    p: &Prepared,
    i: &PieceInputs<'_>,
) -> Result<PieceGrads> {
    let s = &p.piece.local;
    let precision = b.plan.storage.precision();
    let lens = [s.q_len(), s.kv_len(), s.v_len()];
    let [q_bytes, kv_bytes, v_bytes] = lens.map(|n| n as u64 * precision.bytes() as u64);
    let (q, k, v) = (
        call.upload("q", i.q)?,
        call.upload("k", i.k)?,
        call.upload("v", i.v)?,
    );
    let (o, d_o) = (call.upload("o", i.o)?, call.upload("do", i.d_o)?);
    let lse = call.upload("lse", bytemuck::cast_slice(i.lse))?;
    let dvec = call.storage("D = rowsum(dO·O)", s.lse_len() as u64 * 4)?;
    let dq = call.storage("dq", q_bytes)?;
    let (dk, dv) = (call.storage("dk", kv_bytes)?, call.storage("dv", v_bytes)?);
    let launch = Launch::new(b, p, call.gpu.max_groups())?;
    let dsinks = launch.dsink_buffers(call)?;
    let buffers = BackwardBuffers {
        q: &q,
        k: &k,
        v: &v,
        o: &o,
        d_o: &d_o,
        lse: &lse,
        dvec: &dvec,
        dq: &dq,
        dk: &dk,
        dv: &dv,
        dsinks: dsinks.as_ref().map(|[a, b]| [a, b]),
    };
    let bufs = buffers.bindings();
    let side = launch.side_buffer(call)?;
    call.stats.accesses += launch.accesses;
    let dispatches = launch.dispatches(call.gpu, &b.kernels, &bufs, side.as_ref());
    call.run(&dispatches).await?;
    let mut reads = vec![(&dq, q_bytes), (&dk, kv_bytes), (&dv, v_bytes)];
    if let Some([_, sums]) = &dsinks {
        reads.push((sums, s.heads_q as u64 * 4));
    }
    let data = call.read(&reads).await?;
    let [dq, dk, dv] = [0, 1, 2].map(|i| TensorData::from_bytes(&data[i], precision, lens[i]));
    let grads = [dq?, dk?, dv?];
    Ok((grads, data.get(3).map(|d| bytemuck::pod_collect_to_vec(d))))
}

/// The backward's dispatches over one piece: shared parameters and side
/// tables, each kernel's grid, and their storage accesses.
struct Launch {
    params: Params,
    side: Vec<u32>,
    grids: Vec<[u32; 3]>,
    accesses: Accesses,
    /// The longest rows and keys of a sequence (what the long loops walk).
    longest: (usize, usize),
    /// With sinks: the partials' length (heads × chunks); the piece holds
    /// key 0 of its rows (no other piece adds their dsinks).
    sink_partials: Option<u64>,
}

impl Launch {
    fn new(b: &Backward<'_>, p: &Prepared, max_groups: u32) -> Result<Self> {
        let mut params = Params::new(&p.piece, b.opts)?;
        let seqs = p.sequences(&params);
        let heads = p.piece.local.heads_q;
        let plan = &b.plan;
        let walk = |by_keys| Walk {
            params: &params,
            seqs: &seqs,
            masked: b.variant.masked,
            mask: b.opts.block_mask.as_ref(),
            tiles: [plan.br, plan.bc],
            by_keys,
        };
        let (by_keys, by_rows) = (walk(true), walk(false));
        let mut accesses = Accesses::default();
        let mut grids = Vec::new();
        for k in &b.kernels {
            let w = if k.part == BackwardPart::DkDv {
                &by_keys
            } else {
                &by_rows
            };
            accesses += k.accesses(&params, w);
            grids.push(k.grid(&params, &seqs, max_groups));
        }
        let tables = side_tables(
            b.opts,
            &seqs,
            plan.br,
            Some(&by_rows),
            Some(&by_keys),
            heads,
        );
        let sink_partials =
            b.opts.sinks.is_some().then(|| {
                heads as u64 * crate::kernels::flash_backward::sink_chunks(&params) as u64
            });
        let longest = seqs.longest();
        let side = tables.build(&mut params, p.piece.full.heads_q)?;
        Ok(Self {
            params,
            side,
            grids,
            accesses,
            longest,
            sink_partials,
        })
    }

    fn side_buffer(&self, call: &mut Call) -> Result<Option<wgpu::Buffer>> {
        (!self.side.is_empty())
            .then(|| call.upload("side tables", bytemuck::cast_slice(&self.side)))
            .transpose()
    }

    /// With sinks, the partials' and the sums' buffers.
    fn dsink_buffers(&self, call: &mut Call) -> Result<Option<[wgpu::Buffer; 2]>> {
        let Some(n) = self.sink_partials else {
            return Ok(None);
        };
        let heads = self.params.heads_q as u64;
        Ok(Some([
            call.storage("dsinks partials", n * 4)?,
            call.storage("dsinks", heads * 4)?,
        ]))
    }

    /// Every kernel's dispatches, each grid split at the device's
    /// per-dimension limit (D's rows already spread over x and y).
    fn dispatches<'a>(
        &self,
        gpu: &Gpu,
        kernels: &[FlashBackward],
        bufs: &BackwardBindings<'a>,
        side: Option<&'a wgpu::Buffer>,
    ) -> Vec<Dispatch<'a>> {
        let max = gpu.max_groups();
        let mut out = Vec::new();
        for (kernel, &[x, y, z]) in kernels.iter().zip(&self.grids) {
            let mut buffers = kernel.entries(bufs);
            if kernel.variant.has_side() {
                buffers.extend(whole(side.map(|b| (binding::SIDE, b))));
            }
            let walk = match kernel.part {
                BackwardPart::DkDv => Some((self.longest.0, kernel.plan.br)),
                BackwardPart::Dq => Some((self.longest.1, kernel.plan.br)),
                _ => None,
            };
            // D's rows already spread over x and y: one dispatch.
            let step = if kernel.part == BackwardPart::Dvec {
                x
            } else {
                max
            };
            for offset in (0..x).step_by(step.max(1) as usize) {
                out.push(Dispatch {
                    kernel: (*kernel).into(),
                    uniforms: vec![(
                        binding::PARAMS,
                        bytemuck::bytes_of(&self.params.at_block(offset)).to_vec(),
                    )],
                    buffers: buffers.clone(),
                    grid: [(x - offset).min(max), y, z],
                    walk,
                });
            }
        }
        out
    }
}

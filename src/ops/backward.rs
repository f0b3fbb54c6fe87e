//! The flash backward as an operation on host tensors: D = rowsum(dO·O),
//! then dK/dV over key blocks and dQ over query blocks, all atomic-free and
//! deterministic. Extra storage beyond inputs and gradients is D (one f32
//! per row). Split problems sum partial gradients in a fixed order.

use super::pieces::{
    gather_keys, gather_lse, gather_o_rows, gather_rows, gather_v_keys, GradAssembly,
};
use super::reruns::with_reruns;
use crate::api::inputs::BackwardInputs;
use crate::api::options::AttentionOptions;
use crate::api::output::BackwardOutput;
use crate::api::shape::AttentionShape;
use crate::api::tensor::TensorData;
use crate::error::Result;
use crate::kernels::{
    binding, BackwardBuffers, BackwardPart, FlashBackward, KernelKey, LoopCost, Params, Piece,
};
use crate::plan::{plan_backward, split, PieceLimits, Plan, PlanOverrides, PlanRequest, Split};
use crate::runtime::{Call, Dispatch, Gpu};

const PARTS: [BackwardPart; 3] = [BackwardPart::Dvec, BackwardPart::DkDv, BackwardPart::Dq];

/// A backward's inputs and kernels, validated.
struct Backward<'a> {
    inputs: &'a BackwardInputs<'a>,
    opts: &'a AttentionOptions,
    shape: AttentionShape,
    kernels: [FlashBackward; 3],
}

/// Gradients dq, dk, dv on host tensors (split where needed, never rejected).
pub async fn backward(
    gpu: &Gpu,
    inputs: &BackwardInputs<'_>,
    opts: &AttentionOptions,
    overrides: &PlanOverrides,
) -> Result<BackwardOutput> {
    let shape = inputs.shape()?;
    opts.validate_for(&shape)?;
    super::check_features(opts)?;
    let precision = inputs.q.precision();
    let req = PlanRequest::for_shape(&shape, precision, *overrides);
    let plan = plan_backward(&req, &gpu.caps())?.plan;
    let variant = gpu.variant(opts.mask(&shape).is_active(), opts.softcap_value() > 0.0);
    let b = Backward {
        inputs,
        opts,
        shape,
        kernels: PARTS.map(|part| FlashBackward {
            part,
            plan,
            variant,
        }),
    };
    let group = shape.group() as u32;
    let loops: Vec<(KernelKey, LoopCost)> = b
        .kernels
        .iter()
        .map(|k| ((*k).into(), k.loop_cost(group)))
        .collect();
    let (mut out, reruns) = with_reruns(gpu, precision, &loops, |limits| {
        in_pieces(gpu, &b, plan, limits)
    })
    .await?;
    out.stats.reruns = reruns;
    Ok(out)
}

/// One attempt: the problem in pieces within `limits`.
async fn in_pieces(
    gpu: &Gpu,
    b: &Backward<'_>,
    plan: Plan,
    limits: PieceLimits,
) -> Result<BackwardOutput> {
    let shape = b.shape;
    let precision = b.inputs.q.precision();
    let pieces = split(&shape, &limits)?;
    let mut call = Call::new(gpu, Some(plan));
    call.stats.pieces = pieces.len() as u32;
    let grads = if pieces.len() == 1 {
        let i = b.inputs;
        let tensors = [i.q, i.k, i.v, i.o, i.d_o].map(|t| t.data.as_bytes());
        run_piece(&mut call, b, &Piece::whole(shape), tensors, i.lse).await?
    } else {
        let mut sum = GradAssembly::new(shape);
        for s in &pieces {
            sum.add(s, &run_split(&mut call, b, s).await?);
        }
        sum.finish(precision)
    };
    Ok(BackwardOutput::new(&shape, grads, call.finish()))
}

/// Gather one piece (with the full rows' LSE) and run it: its gradients are
/// partial sums (dQ over its keys, dK/dV over its rows).
async fn run_split(call: &mut Call<'_>, b: &Backward<'_>, s: &Split) -> Result<[TensorData; 3]> {
    let (i, shape) = (b.inputs, &b.shape);
    let parts = [
        gather_rows(i.q.data, shape, s),
        gather_keys(i.k.data, shape, s),
        gather_v_keys(i.v.data, shape, s),
        gather_o_rows(i.o.data, shape, s),
        gather_o_rows(i.d_o.data, shape, s),
    ];
    let piece = Piece {
        local: s.shape(shape),
        full: *shape,
        q_start: s.rows.start,
        k_start: s.keys.start,
    };
    let bytes = parts.each_ref().map(|p| p.as_host().as_bytes());
    run_piece(call, b, &piece, bytes, &gather_lse(i.lse, shape, s)).await
}

/// Upload one piece, run the three kernels, read dq, dk, dv back.
async fn run_piece(
    call: &mut Call<'_>,
    b: &Backward<'_>,
    piece: &Piece,
    [q, k, v, o, d_o]: [&[u8]; 5],
    lse: &[f32],
) -> Result<[TensorData; 3]> {
    let s = &piece.local;
    let precision = b.kernels[0].plan.storage.precision();
    let lens = [s.q_len(), s.kv_len(), s.v_len()];
    let [q_bytes, kv_bytes, v_bytes] = lens.map(|n| n as u64 * precision.bytes() as u64);
    let (q, k, v) = (
        call.upload("q", q)?,
        call.upload("k", k)?,
        call.upload("v", v)?,
    );
    let (o, d_o) = (call.upload("o", o)?, call.upload("do", d_o)?);
    let lse = call.upload("lse", bytemuck::cast_slice(lse))?;
    let dvec = call.storage("D = rowsum(dO·O)", s.lse_len() as u64 * 4)?;
    let dq = call.storage("dq", q_bytes)?;
    let (dk, dv) = (call.storage("dk", kv_bytes)?, call.storage("dv", v_bytes)?);
    let bufs = BackwardBuffers {
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
    };
    let base = Params::new(piece, b.opts)?;
    let mut all = Vec::new();
    for kernel in &b.kernels {
        call.stats.accesses += kernel.accesses(&base);
        all.extend(dispatches(call.gpu, kernel, piece, &base, &bufs));
    }
    call.run(&all).await?;
    let data = call
        .read(&[(&dq, q_bytes), (&dk, kv_bytes), (&dv, v_bytes)])
        .await?;
    Ok([0, 1, 2].map(|i| TensorData::from_bytes(&data[i], precision, lens[i])))
}

/// The dispatches of one backward kernel over a piece, the block grid split
/// at the device's per-dimension limit.
fn dispatches<'a>(
    gpu: &Gpu,
    kernel: &FlashBackward,
    piece: &Piece,
    base: &Params,
    bufs: &BackwardBuffers<'a>,
) -> Vec<Dispatch<'a>> {
    let s = &piece.local;
    let max = gpu.max_groups();
    let [x, y, z] = kernel.grid(s, max);
    let walk = match kernel.part {
        BackwardPart::Dvec => None,
        BackwardPart::DkDv => Some((s.seqlen_q, kernel.plan.br)),
        BackwardPart::Dq => Some((s.seqlen_k, kernel.plan.br)),
    };
    let dispatch = |offset: u32, grid: [u32; 3]| Dispatch {
        kernel: (*kernel).into(),
        uniforms: vec![(
            binding::PARAMS,
            bytemuck::bytes_of(&base.at_block(offset)).to_vec(),
        )],
        buffers: kernel.entries(bufs),
        grid,
        walk,
    };
    if kernel.part == BackwardPart::Dvec {
        // D's rows already spread over x and y.
        return vec![dispatch(0, [x, y, z])];
    }
    (0..x)
        .step_by(max as usize)
        .map(|offset| dispatch(offset, [(x - offset).min(max), y, z]))
        .collect()
}

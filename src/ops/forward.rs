//! The flash forward as an operation: on host tensors (planned, cut into
//! pieces where a binding, the grid or the loop limit requires, rerun when a
//! guard fires) and on caller-owned device buffers (one dispatch set, never
//! split).

use super::pieces::{gather_keys, gather_rows, ForwardAssembly};
use super::reruns::with_reruns;
use crate::api::options::AttentionOptions;
use crate::api::output::{CallStats, ForwardOutput};
use crate::api::shape::AttentionShape;
use crate::api::tensor::{Precision, TensorData, TensorView};
use crate::error::{Error, Result};
use crate::kernels::{binding, AttentionBuffers, FlashForward, KernelKey, Params, Piece};
use crate::plan::{plan_forward, split, PieceLimits, PlanOverrides, PlanRequest, Split};
use crate::runtime::{padded, Call, Dispatch, Gpu};

/// A forward's inputs and choices, validated.
struct Forward<'a> {
    qkv: [&'a TensorView<'a>; 3],
    opts: &'a AttentionOptions,
    shape: AttentionShape,
    kernel: FlashForward,
}

/// The flash kernel for `shape` under `opts` and `overrides` on `gpu`.
fn kernel_for(
    gpu: &Gpu,
    shape: &AttentionShape,
    precision: Precision,
    opts: &AttentionOptions,
    overrides: &PlanOverrides,
) -> Result<FlashForward> {
    opts.validate()?;
    let req = PlanRequest::for_shape(shape, precision, *overrides);
    Ok(FlashForward {
        plan: plan_forward(&req, &gpu.caps())?.plan,
        variant: gpu.variant(opts.mask(shape).is_active(), opts.softcap_value() > 0.0),
    })
}

/// Exact attention forward on host tensors. Problems larger than one
/// storage binding, the dispatch grid or the adapter's loop limit are split,
/// never rejected.
pub async fn forward(
    gpu: &Gpu,
    [q, k, v]: [&TensorView<'_>; 3],
    opts: &AttentionOptions,
    overrides: &PlanOverrides,
) -> Result<ForwardOutput> {
    let shape = AttentionShape::from_views(q, k, v)?;
    let kernel = kernel_for(gpu, &shape, q.precision(), opts, overrides)?;
    let f = Forward {
        qkv: [q, k, v],
        opts,
        shape,
        kernel,
    };
    let loops = [(KernelKey::from(kernel), kernel.loop_cost())];
    let (mut out, reruns) = with_reruns(gpu, q.precision(), &loops, |limits| {
        in_pieces(gpu, &f, limits)
    })
    .await?;
    out.stats.reruns = reruns;
    Ok(out)
}

/// One attempt: the problem in pieces within `limits`.
async fn in_pieces(gpu: &Gpu, f: &Forward<'_>, limits: PieceLimits) -> Result<ForwardOutput> {
    let (shape, precision) = (f.shape, f.qkv[0].precision());
    let pieces = split(&shape, &limits)?;
    let mut call = Call::new(gpu, Some(f.kernel.plan));
    call.stats.pieces = pieces.len() as u32;
    let (o, lse) = if pieces.len() == 1 {
        let bytes = f.qkv.map(|t| t.data.as_bytes());
        run_piece(&mut call, f, &Piece::whole(shape), bytes).await?
    } else {
        let mut out = ForwardAssembly::new(shape, precision, &pieces);
        for s in &pieces {
            let (o, lse) = run_split(&mut call, f, s).await?;
            out.add(s, &o, &lse);
        }
        out.finish(precision)
    };
    Ok(ForwardOutput::new(shape, o, lse, call.finish()))
}

/// Gather one piece of a split problem and run it.
async fn run_split(
    call: &mut Call<'_>,
    f: &Forward<'_>,
    s: &Split,
) -> Result<(TensorData, Vec<f32>)> {
    let [q, k, v] = f.qkv;
    let parts = [
        gather_rows(q.data, &f.shape, s),
        gather_keys(k.data, &f.shape, s),
        gather_keys(v.data, &f.shape, s),
    ];
    let piece = Piece {
        local: s.shape(&f.shape),
        full: f.shape,
        q_start: s.rows.start,
        k_start: s.keys.start,
    };
    run_piece(
        call,
        f,
        &piece,
        parts.each_ref().map(|p| p.as_host().as_bytes()),
    )
    .await
}

/// Upload one piece, run it, read o and lse back.
async fn run_piece(
    call: &mut Call<'_>,
    f: &Forward<'_>,
    piece: &Piece,
    [q, k, v]: [&[u8]; 3],
) -> Result<(TensorData, Vec<f32>)> {
    let s = &piece.local;
    let precision = f.kernel.plan.storage.precision();
    let o_bytes = s.q_len() as u64 * precision.bytes() as u64;
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
    let (dispatches, accesses) = dispatches(call.gpu, &f.kernel, piece, f.opts, &bufs)?;
    call.stats.accesses += accesses;
    call.run(&dispatches).await?;
    let mut data = call.read(&[(&o, o_bytes), (&lse, lse_bytes)]).await?;
    let lse = bytemuck::pod_collect_to_vec(&data.pop().unwrap_or_default());
    let o = TensorData::from_bytes(&data.pop().unwrap_or_default(), precision, s.q_len());
    Ok((o, lse))
}

/// The dispatches of the flash kernel over one piece (the grid split at the
/// device's per-dimension limit) and their storage accesses.
pub(crate) fn dispatches<'a>(
    gpu: &Gpu,
    kernel: &FlashForward,
    piece: &Piece,
    opts: &AttentionOptions,
    bufs: &AttentionBuffers<'a>,
) -> Result<(Vec<Dispatch<'a>>, crate::api::output::Accesses)> {
    let s = &piece.local;
    let max = gpu.max_groups();
    for (what, n) in [("batch", s.batch), ("heads_q", s.heads_q)] {
        if n > max as usize {
            return Err(Error::GridTooLarge {
                what,
                groups: n as u64,
                max,
            });
        }
    }
    let base = Params::new(piece, opts)?;
    let blocks = kernel.blocks(s);
    let out = (0..blocks)
        .step_by(max as usize)
        .map(|offset| Dispatch {
            kernel: (*kernel).into(),
            uniforms: vec![(
                binding::PARAMS,
                bytemuck::bytes_of(&base.at_block(offset)).to_vec(),
            )],
            buffers: FlashForward::entries(bufs).to_vec(),
            grid: [(blocks - offset).min(max), s.heads_q as u32, s.batch as u32],
            walk: Some((s.seqlen_k, kernel.plan.bc)),
        })
        .collect();
    Ok((out, kernel.accesses(&base)))
}

/// Forward on caller-owned device buffers (data stays on the GPU). Every
/// tensor must fit in one storage binding, and the call must stay within
/// the adapter's loop limit: this API never splits.
pub async fn forward_buffers(
    gpu: &Gpu,
    buffers: &AttentionBuffers<'_>,
    shape: &AttentionShape,
    precision: Precision,
    (opts, overrides): (&AttentionOptions, &PlanOverrides),
) -> Result<CallStats> {
    let kernel = kernel_for(gpu, shape, precision, opts, overrides)?;
    check_buffers(gpu, buffers, shape, precision)?;
    check_loop_limit(gpu, &kernel, shape)?;
    let mut call = Call::new(gpu, Some(kernel.plan));
    let (dispatches, accesses) = dispatches(gpu, &kernel, &Piece::whole(*shape), opts, buffers)?;
    call.stats.accesses += accesses;
    call.run(&dispatches).await?;
    Ok(call.finish())
}

/// Every buffer must hold its tensor and fit one storage binding.
fn check_buffers(
    gpu: &Gpu,
    b: &AttentionBuffers,
    shape: &AttentionShape,
    precision: Precision,
) -> Result<()> {
    let elem = precision.bytes() as u64;
    let need = |n: usize, e: u64| padded(n as u64 * e);
    let checks = [
        ("q", b.q, need(shape.q_len(), elem)),
        ("k", b.k, need(shape.kv_len(), elem)),
        ("v", b.v, need(shape.kv_len(), elem)),
        ("o", b.o, need(shape.q_len(), elem)),
        ("lse", b.lse, need(shape.lse_len(), 4)),
    ];
    for (buffer, buf, bytes) in checks {
        if buf.size() < bytes {
            return Err(Error::BufferTooSmall {
                buffer,
                size: buf.size(),
                needed: bytes,
            });
        }
        if bytes > gpu.max_binding() {
            return Err(Error::BindingTooLarge {
                what: buffer,
                bytes,
                max: gpu.max_binding(),
            });
        }
    }
    Ok(())
}

/// A call that cannot be split must fit the adapter's loop limit as planned.
pub(crate) fn check_loop_limit(
    gpu: &Gpu,
    kernel: &FlashForward,
    shape: &AttentionShape,
) -> Result<()> {
    let key = KernelKey::from(*kernel);
    let predict = !gpu.settings.no_loop_prediction;
    let max = gpu.loop_limit.max_len(&key, &kernel.loop_cost(), predict)?;
    match gpu.loop_limit.limit() {
        Some(limit) if shape.seqlen_k > max => Err(Error::LoopBudget {
            kernel: key.name(),
            rows: shape.seqlen_q,
            keys: shape.seqlen_k,
            limit,
        }),
        _ => Ok(()),
    }
}

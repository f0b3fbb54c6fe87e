//! The naive baseline on the GPU: S and P (and for the backward dP/dS) are
//! materialized in storage buffers of batch·heads·Sq·Sk f32 each. Its
//! matmuls are the tuned matmuls that also measure the adapter's ceiling
//! (tiled, or lanes on CPU adapters), so a comparison with flash isolates
//! what tiling the softmax saves. It fails where the N×N buffers outgrow a
//! storage binding — which is the point — and it never splits. Dropout adds
//! no buffer: its row kernels redraw the keep bits where they store P (the
//! forward's P·V and the backward's dV take P ∘ keep) and the products
//! take `1 / (1 − p)` as their alpha (docs/dropout.md).

use crate::api::inputs::ForwardInputs;
use crate::api::options::AttentionOptions;
use crate::api::output::{BackwardOutput, ForwardOutput};
use crate::api::shape::AttentionShape;
use crate::api::size::grid_u32;
use crate::api::tensor::{Precision, TensorData, TensorView};
use crate::error::{Error, Result};
use crate::kernels::naive::{ROWS_PER_GROUP, TILE};
use crate::kernels::{
    binding, Epilogue, KernelKey, MatmulParams, MatmulProblem, Naive, NaiveEntry, Params, Piece,
    Variant,
};
use crate::plan::forward::storage_kind;
use crate::plan::{PlanRequest, StorageKind};
use crate::runtime::{whole, Call, Dispatch, Gpu};

/// A naive call's shape, storage and kernel flags.
struct Problem<'a> {
    shape: AttentionShape,
    storage: StorageKind,
    opts: &'a AttentionOptions,
    params: Params,
    /// The variant of kernels with the attention mask and softcap.
    variant: Variant,
    /// The variant of plain kernels (products without the scores epilogue).
    plain: Variant,
    /// Attention dropout: the row kernels draw the keep bits.
    dropout: bool,
    /// Bytes of one N×N f32 buffer.
    nn: u64,
}

impl<'a> Problem<'a> {
    fn new(
        gpu: &Gpu,
        shape: AttentionShape,
        precision: Precision,
        opts: &'a AttentionOptions,
    ) -> Result<Self> {
        opts.validate_for(&shape)?;
        // It materializes S for one dense batch with the band, softcap and
        // dropout.
        opts.band_only("the naive baseline")?;
        let storage = storage_kind(
            &PlanRequest::for_shape(&shape, precision, Default::default()),
            &gpu.caps(),
        )?;
        let nn = (shape.batch * shape.heads_q * shape.seqlen_q * shape.seqlen_k) as u64 * 4;
        gpu.within_binding("naive attention's N×N scores", nn)?;
        let rows = shape.batch * shape.heads_q * shape.seqlen_q;
        let widest = [
            shape.batch * shape.heads_q,
            shape.seqlen_q.div_ceil(TILE as usize),
            shape.seqlen_k.div_ceil(TILE as usize),
            rows.div_ceil(ROWS_PER_GROUP as usize),
        ];
        let groups = widest.into_iter().max().unwrap_or(0);
        if groups > gpu.max_groups() as usize {
            return Err(Error::GridTooLarge {
                what: "naive attention",
                groups: groups as u64,
                max: gpu.max_groups(),
            });
        }
        Ok(Self {
            storage,
            opts,
            params: Params::new(&Piece::whole(shape), opts)?,
            variant: gpu.variant(opts.mask(&shape).is_active(), opts.softcap_value() > 0.0),
            plain: gpu.variant(false, false),
            dropout: opts.dropout.is_active(),
            nn,
            shape,
        })
    }

    /// A naive kernel; `keep`: whether it draws dropout's keep bits (when
    /// the call has dropout).
    fn naive(&self, entry: NaiveEntry, keep: bool) -> Naive {
        let variant = if entry == NaiveEntry::Softmax || entry == NaiveEntry::Ds {
            self.variant
        } else {
            self.plain
        };
        let variant = Variant {
            dropout: keep && self.dropout,
            ..variant
        };
        Naive {
            entry,
            head_dim: self.shape.head_dim as u32,
            head_dim_v: self.shape.head_dim_v as u32,
            storage: self.storage,
            variant,
        }
    }

    /// A naive kernel's dispatch over `grid` with these buffers.
    fn step<'b>(
        &self,
        call: &mut Call,
        kernel: Naive,
        buffers: Vec<(u32, &'b wgpu::Buffer)>,
        grid: [usize; 3],
    ) -> Result<Dispatch<'b>> {
        call.stats.accesses += kernel.accesses(&self.params);
        check_loops(
            call.gpu,
            kernel.into(),
            kernel.loop_iterations(&self.params),
        )?;
        Ok(Dispatch {
            kernel: kernel.into(),
            uniforms: vec![(binding::PARAMS, bytemuck::bytes_of(&self.params).to_vec())],
            buffers: whole(buffers),
            grid: grid.map(|g| grid_u32(g as u64)),
            walk: None,
        })
    }

    /// `C = epilogue(A · op(B))` over the call's batch, with these strides,
    /// each operand in its `storage`.
    fn product(
        &self,
        b_trans: bool,
        epilogue: Epilogue,
        params: MatmulParams,
        storage: [StorageKind; 3],
    ) -> MatmulProblem {
        MatmulProblem {
            storage,
            b_trans,
            epilogue,
            params,
            batch: self.shape.batch,
        }
    }

    /// A matmul's dispatch: `problem` on `a`, `b` into `c`.
    fn matmul<'b>(
        &self,
        call: &mut Call,
        problem: MatmulProblem,
        a: &'b wgpu::Buffer,
        b: &'b wgpu::Buffer,
        c: &'b wgpu::Buffer,
    ) -> Result<Dispatch<'b>> {
        let variant = if problem.epilogue == Epilogue::Scores {
            self.variant
        } else {
            self.plain
        };
        let spec = problem.spec(variant, call.gpu.caps().lane_subgroup);
        call.stats.accesses += spec.accesses();
        check_loops(call.gpu, spec.kernel.into(), spec.loop_iterations())?;
        Ok(Dispatch {
            kernel: spec.kernel.into(),
            uniforms: vec![
                (binding::PARAMS, bytemuck::bytes_of(&self.params).to_vec()),
                (binding::MATMUL, bytemuck::bytes_of(&spec.params).to_vec()),
            ],
            buffers: whole([(binding::A, a), (binding::B, b), (binding::C, c)]),
            grid: spec.grid,
            walk: None,
        })
    }

    /// `1 / (1 − p)`, the alpha of the products over P ∘ keep (1 without
    /// dropout, so those products are the ones without it).
    fn keep_scale(&self) -> f32 {
        self.opts.dropout.scale()
    }

    /// S = scale·QKᵀ (soft-capped, masked), then P = softmax(S) and the LSE;
    /// `keep`: P is stored as P ∘ keep (the forward's, for P·V) rather than
    /// whole (the backward's, which dS needs).
    fn softmax_steps<'b>(
        &self,
        call: &mut Call,
        b: &ScoreBuffers<'b>,
        keep: bool,
    ) -> Result<Vec<Dispatch<'b>>> {
        let st = self.storage;
        let rows = self.shape.batch * self.shape.heads_q * self.shape.seqlen_q;
        let nt = nt_params(&self.shape, self.shape.head_dim, 1.0);
        let scores = self.product(true, Epilogue::Scores, nt, [st, st, StorageKind::F32]);
        Ok(vec![
            self.matmul(call, scores, b.q, b.k, b.s)?,
            self.step(
                call,
                self.naive(NaiveEntry::Softmax, keep),
                vec![(binding::LSE, b.lse), (binding::S, b.s), (binding::P, b.p)],
                [rows.div_ceil(ROWS_PER_GROUP as usize), 1, 1],
            )?,
        ])
    }
}

/// The buffers the scores and their softmax read and write.
struct ScoreBuffers<'b> {
    q: &'b wgpu::Buffer,
    k: &'b wgpu::Buffer,
    lse: &'b wgpu::Buffer,
    s: &'b wgpu::Buffer,
    p: &'b wgpu::Buffer,
}

/// Fail before running when a kernel would run past the adapter's loop
/// limit: this baseline cannot split.
fn check_loops(gpu: &Gpu, kernel: KernelKey, iterations: u64) -> Result<()> {
    match gpu.loop_limit.limit() {
        Some(limit) if iterations > limit as u64 && !gpu.settings.no_loop_prediction => {
            Err(Error::LoopBudget {
                kernel: kernel.name(),
                rows: 0,
                keys: 0,
                limit,
            })
        }
        _ => Ok(()),
    }
}

/// Naive attention: `S = scale·QKᵀ` and `P = softmax(S)` stored, then `O = PV`.
pub async fn naive_forward(
    gpu: &Gpu,
    inputs: &ForwardInputs<'_>,
    opts: &AttentionOptions,
) -> Result<ForwardOutput> {
    let shape = inputs.shape()?;
    let ForwardInputs { q, k, v } = inputs;
    let precision = q.precision();
    let n = Problem::new(gpu, shape, precision, opts)?;
    let mut call = Call::new(gpu, None);
    let o_bytes = shape.o_len() as u64 * precision.bytes() as u64;
    let lse_bytes = shape.lse_len() as u64 * 4;
    let (qb, kb, vb) = (
        call.upload("q", q.data.as_bytes())?,
        call.upload("k", k.data.as_bytes())?,
        call.upload("v", v.data.as_bytes())?,
    );
    let (ob, lb) = (call.storage("o", o_bytes)?, call.storage("lse", lse_bytes)?);
    let sb = call.storage("S (N×N scores)", n.nn)?;
    let pb = call.storage("P (N×N probabilities)", n.nn)?;
    let scores = ScoreBuffers {
        q: &qb,
        k: &kb,
        lse: &lb,
        s: &sb,
        p: &pb,
    };
    let mut steps = n.softmax_steps(&mut call, &scores, true)?;
    let st = n.storage;
    let nn = nn_params(&shape, shape.head_dim_v, n.keep_scale());
    let pv = n.product(false, Epilogue::Scale, nn, [StorageKind::F32, st, st]);
    steps.push(n.matmul(&mut call, pv, &pb, &vb, &ob)?);
    call.run(&steps).await?;
    let mut data = call.read(&[(&ob, o_bytes), (&lb, lse_bytes)]).await?;
    let lse = bytemuck::pod_collect_to_vec(&data.pop().unwrap_or_default());
    let o = TensorData::from_bytes(&data.pop().unwrap_or_default(), precision, shape.o_len())?;
    drop(steps);
    Ok(ForwardOutput::new(shape, o, lse, call.finish()))
}

/// The naive backward's buffers.
struct Grads {
    q: wgpu::Buffer,
    k: wgpu::Buffer,
    v: wgpu::Buffer,
    d_o: wgpu::Buffer,
    lse: wgpu::Buffer,
    s: wgpu::Buffer,
    p: wgpu::Buffer,
    ds: wgpu::Buffer,
    dq: wgpu::Buffer,
    dk: wgpu::Buffer,
    dv: wgpu::Buffer,
}

/// Naive gradients: S, P, dP/dS stored; dQ, dK, dV as matmuls over them
/// (the forward's o and LSE are recomputed, as a naive implementation does).
pub async fn naive_backward(
    gpu: &Gpu,
    inputs: &ForwardInputs<'_>,
    d_o: &TensorView<'_>,
    opts: &AttentionOptions,
) -> Result<BackwardOutput> {
    let shape = inputs.shape()?;
    let ForwardInputs { q, k, v } = inputs;
    shape.check_like_o(d_o, q, "do")?;
    let precision = q.precision();
    let n = Problem::new(gpu, shape, precision, opts)?;
    let mut call = Call::new(gpu, None);
    let b = grad_buffers(&mut call, &n, q, k, v, d_o)?;
    let scores = ScoreBuffers {
        q: &b.q,
        k: &b.k,
        lse: &b.lse,
        s: &b.s,
        p: &b.p,
    };
    let mut steps = n.softmax_steps(&mut call, &scores, false)?;
    steps.extend(grad_steps(&mut call, &n, &b)?);
    call.run(&steps).await?;
    drop(steps);
    let lens = [shape.q_len(), shape.kv_len(), shape.v_len()];
    let bytes = lens.map(|n| n as u64 * precision.bytes() as u64);
    let data = call
        .read(&[(&b.dq, bytes[0]), (&b.dk, bytes[1]), (&b.dv, bytes[2])])
        .await?;
    let [dq, dk, dv] = [0, 1, 2].map(|i| TensorData::from_bytes(&data[i], precision, lens[i]));
    let [dq, dk, dv] = [dq?, dk?, dv?];
    Ok(BackwardOutput::new(&shape, dq, dk, dv, call.finish()))
}

fn grad_buffers(
    call: &mut Call,
    n: &Problem,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    d_o: &TensorView,
) -> Result<Grads> {
    let elem = q.precision().bytes() as u64;
    let (q_bytes, kv_bytes, v_bytes) = (
        n.shape.q_len() as u64 * elem,
        n.shape.kv_len() as u64 * elem,
        n.shape.v_len() as u64 * elem,
    );
    Ok(Grads {
        q: call.upload("q", q.data.as_bytes())?,
        k: call.upload("k", k.data.as_bytes())?,
        v: call.upload("v", v.data.as_bytes())?,
        d_o: call.upload("do", d_o.data.as_bytes())?,
        lse: call.storage("lse", n.shape.lse_len() as u64 * 4)?,
        s: call.storage("S (N×N scores)", n.nn)?,
        p: call.storage("P (N×N probabilities)", n.nn)?,
        ds: call.storage("dP/dS (N×N)", n.nn)?,
        dq: call.storage("dq", q_bytes)?,
        dk: call.storage("dk", kv_bytes)?,
        dv: call.storage("dv", v_bytes)?,
    })
}

/// dP = dO·Vᵀ, dS in place, dQ = scale·dS·K, then dK and dV: the tuned
/// matmul over transposed P and dS, or (with GQA, which sums over each
/// group) a plain kernel.
fn grad_steps<'b>(call: &mut Call, n: &Problem, b: &'b Grads) -> Result<Vec<Dispatch<'b>>> {
    let (shape, st) = (&n.shape, n.storage);
    let f32_ = StorageKind::F32;
    let scale = n.opts.scale_for(shape.head_dim);
    let rows = shape.batch * shape.heads_q * shape.seqlen_q;
    let nt = nt_params(shape, shape.head_dim_v, 1.0);
    let dp = n.product(true, Epilogue::Scale, nt, [st, st, f32_]);
    let nn = nn_params(shape, shape.head_dim, scale);
    let dq = n.product(false, Epilogue::Scale, nn, [f32_, st, st]);
    let mut steps = vec![
        n.matmul(call, dp, &b.d_o, &b.v, &b.ds)?,
        n.step(
            call,
            n.naive(NaiveEntry::Ds, true),
            vec![(binding::S, &b.s), (binding::P, &b.p), (binding::DS, &b.ds)],
            [rows.div_ceil(ROWS_PER_GROUP as usize), 1, 1],
        )?,
        n.matmul(call, dq, &b.ds, &b.k, &b.dq)?,
    ];
    if shape.group() > 1 {
        use binding::*;
        let buffers = vec![
            (Q, &b.q),
            (DO, &b.d_o),
            (P, &b.p),
            (DS, &b.ds),
            (DK, &b.dk),
            (DV, &b.dv),
        ];
        let grid = [
            shape.head_dim.max(shape.head_dim_v).div_ceil(TILE as usize),
            shape.seqlen_k.div_ceil(TILE as usize),
            shape.batch * shape.heads_kv,
        ];
        steps.push(n.step(call, n.naive(NaiveEntry::DkDv, true), buffers, grid)?);
        return Ok(steps);
    }
    // dV = Pᵀ·dO (P ∘ keep, times 1 / (1 − p), with dropout) and
    // dK = scale·dSᵀ·Q: transpose (into the buffers of S and P, no longer
    // needed), then the tuned matmul.
    let elements = shape.batch * shape.heads_q * shape.seqlen_q * shape.seqlen_k;
    let groups = elements.div_ceil(ROWS_PER_GROUP as usize);
    let x = groups.min(call.gpu.max_groups() as usize);
    let grid = [x, groups.div_ceil(x), 1];
    steps.push(n.step(
        call,
        n.naive(NaiveEntry::TransposeP, false),
        vec![(binding::P, &b.p), (binding::S, &b.s)],
        grid,
    )?);
    steps.push(n.step(
        call,
        n.naive(NaiveEntry::TransposeDs, false),
        vec![(binding::DS, &b.ds), (binding::P, &b.p)],
        grid,
    )?);
    let (d, dv) = (shape.head_dim, shape.head_dim_v);
    for (dim, alpha, a, x, c) in [
        (dv, n.keep_scale(), &b.s, &b.d_o, &b.dv),
        (d, scale, &b.p, &b.q, &b.dk),
    ] {
        let tn = tn_params(shape, dim, alpha);
        let product = n.product(false, Epilogue::Scale, tn, [f32_, st, st]);
        steps.push(n.matmul(call, product, a, x, c)?);
    }
    Ok(steps)
}

/// (heads_q, heads_kv, dim, seqlen_q, seqlen_k) as the matmul's u32s, for
/// products over `dim` (q/k's head dim or v's).
fn dims(shape: &AttentionShape, dim: usize) -> [u32; 5] {
    let s = shape;
    [s.heads_q, s.heads_kv, dim, s.seqlen_q, s.seqlen_k].map(|x| x as u32)
}

/// Strides of the per-head `X·Yᵀ` products between two (batch, seq, heads, d)
/// tensors: rows of `x` (Sq rows, heads_q heads) against rows of `y` (Sk rows,
/// heads_kv heads, read through GQA), into an (Sq×Sk) f32 matrix per head:
/// S = Q·Kᵀ and dP = dO·Vᵀ (over `dim`, q/k's head dim or v's).
pub(crate) fn nt_params(shape: &AttentionShape, dim: usize, alpha: f32) -> MatmulParams {
    let [hq, hk, d, m, n] = dims(shape, dim);
    MatmulParams {
        m,
        n,
        k: d,
        lda: hq * d,
        ldb: hk * d,
        ldc: n,
        a_batch: m * hq * d,
        a_head: d,
        b_batch: n * hk * d,
        b_head: d,
        c_batch: hq * m * n,
        c_head: m * n,
        heads: hq,
        group: hq / hk,
        alpha,
        _pad: 0,
    }
}

/// Strides of `M·Y` where M is a per-head (Sq×Sk) f32 matrix and Y a
/// (batch, Sk, heads_kv, dim) tensor, into a (batch, Sq, heads_q, dim) tensor.
pub(crate) fn nn_params(shape: &AttentionShape, dim: usize, alpha: f32) -> MatmulParams {
    let [hq, hk, d, sq, sk] = dims(shape, dim);
    MatmulParams {
        m: sq,
        n: d,
        k: sk,
        lda: sk,
        ldb: hk * d,
        ldc: hq * d,
        a_batch: hq * sq * sk,
        a_head: sq * sk,
        b_batch: sk * hk * d,
        b_head: d,
        c_batch: sq * hq * d,
        c_head: d,
        heads: hq,
        group: hq / hk,
        alpha,
        _pad: 0,
    }
}

/// Strides of `Mᵀ·Y` where M is a per-head (Sq×Sk) f32 matrix stored
/// transposed (Sk×Sq) and Y a (batch, Sq, heads_q, d) tensor, into a (batch,
/// Sk, heads_kv, d) tensor: dV = Pᵀ·dO and dK = scale·dSᵀ·Q without GQA.
fn tn_params(shape: &AttentionShape, dim: usize, alpha: f32) -> MatmulParams {
    let [hq, hk, d, sq, sk] = dims(shape, dim);
    // The per-head matrices are laid out as in `nn_params`, only transposed.
    MatmulParams {
        m: sk,
        k: sq,
        lda: sq,
        ldb: hq * d,
        ldc: hk * d,
        b_batch: sq * hq * d,
        c_batch: sk * hk * d,
        group: 1,
        ..nn_params(shape, dim, alpha)
    }
}

//! The naive baseline on the GPU: S and P (and for the backward dP/dS) are
//! materialized in storage buffers of batch·heads·Sq·Sk f32 each. Its matmuls
//! are the tuned matmuls that also measure the adapter's ceiling (tiled, or
//! lanes on CPU adapters), so a comparison with flash isolates what tiling
//! the softmax saves. It fails where
//! the N×N buffers outgrow a storage binding — which is the point.

use super::engine::{CallStats, Engine, Step};
use super::matmul::{MatmulParams, MatmulSpec};
use super::params::{Params, Piece};
use super::shaders::{self, binding::*, Epilogue};
use crate::attention::{BackwardOutput, ForwardOutput};
use crate::error::{Error, Result};
use crate::options::AttentionOptions;
use crate::plan::{PlanOverrides, StorageKind};
use crate::reference::check_like_q;
use crate::tensor::{AttentionShape, Precision, Tensor, TensorData, TensorView};

const TILE: usize = 16;
const ROWS_PER_GROUP: usize = 64;

/// (heads_q, heads_kv, head_dim, seqlen_q, seqlen_k) as the matmul's u32s.
fn dims(shape: &AttentionShape) -> [u32; 5] {
    [
        shape.heads_q,
        shape.heads_kv,
        shape.head_dim,
        shape.seqlen_q,
        shape.seqlen_k,
    ]
    .map(|x| x as u32)
}

/// Strides of the per-head `X·Yᵀ` products between two (batch, seq, heads, d)
/// tensors: rows of `x` (Sq rows, heads_q heads) against rows of `y` (Sk rows,
/// heads_kv heads, read through GQA), into an (Sq×Sk) f32 matrix per head:
/// S = Q·Kᵀ and dP = dO·Vᵀ.
fn nt_params(shape: &AttentionShape) -> MatmulParams {
    let [hq, hk, d, m, n] = dims(shape);
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
        alpha: 1.0,
        _pad: 0,
    }
}

/// Strides of `M·Y` where M is a per-head (Sq×Sk) f32 matrix and Y a
/// (batch, Sk, heads_kv, d) tensor, into a (batch, Sq, heads_q, d) tensor.
fn nn_params(shape: &AttentionShape, alpha: f32) -> MatmulParams {
    let [hq, hk, d, sq, sk] = dims(shape);
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
fn tn_params(shape: &AttentionShape, alpha: f32) -> MatmulParams {
    let [hq, hk, d, sq, sk] = dims(shape);
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
        ..nn_params(shape, alpha)
    }
}

impl Engine {
    /// Naive attention: `S = scale·QKᵀ` and `P = softmax(S)` stored, then `O = PV`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn naive_forward(
        &self,
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        opts: &AttentionOptions,
    ) -> Result<ForwardOutput> {
        pollster::block_on(self.naive_forward_async(q, k, v, opts))
    }

    /// Naive gradients: S, P, dP/dS stored; dQ, dK, dV as matmuls over them.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn naive_backward(
        &self,
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        d_o: &TensorView,
        opts: &AttentionOptions,
    ) -> Result<BackwardOutput> {
        pollster::block_on(self.naive_backward_async(q, k, v, d_o, opts))
    }

    /// Check sizes and grids; returns the storage kind and the bytes of one N×N buffer.
    fn naive_check(
        &self,
        shape: &AttentionShape,
        precision: Precision,
    ) -> Result<(StorageKind, u64)> {
        let storage = self
            .plan(shape, precision, &PlanOverrides::default())?
            .storage;
        let nn = (shape.batch * shape.heads_q * shape.seqlen_q * shape.seqlen_k) as u64 * 4;
        if nn > self.max_binding() {
            return Err(Error::Unsupported(format!(
                "naive attention materializes N×N scores: {nn} bytes, more than one storage binding ({} bytes)",
                self.max_binding()
            )));
        }
        let max_groups = self.max_groups() as usize;
        let rows = shape.batch * shape.heads_q * shape.seqlen_q;
        let dims = [
            shape.batch * shape.heads_q,
            shape.seqlen_q.div_ceil(TILE),
            shape.seqlen_k.div_ceil(TILE),
            rows.div_ceil(ROWS_PER_GROUP),
        ];
        if dims.iter().any(|&d| d > max_groups) {
            return Err(Error::Unsupported(format!(
                "naive attention grid {dims:?} exceeds {max_groups} workgroups per dimension"
            )));
        }
        Ok((storage, nn))
    }

    /// Encode `steps` in one pass, run them, and count them in `stats`.
    pub(crate) async fn run_steps(
        &self,
        what: &str,
        steps: &[Step],
        params: &Params,
        clear: &[&wgpu::Buffer],
        stats: &mut CallStats,
    ) -> Result<()> {
        let uniform = self.uniform(params);
        let encoder = self
            .checked(what, || {
                let mut encoder = self.device().create_command_encoder(&Default::default());
                for b in clear {
                    encoder.clear_buffer(b, 0, None);
                }
                let binds: Vec<_> = steps
                    .iter()
                    .map(|(p, entries, _)| {
                        let mut all = vec![(0, &uniform)];
                        all.extend(entries.iter().map(|(b, buf)| (*b, buf)));
                        self.bind(stats, p, &all)
                    })
                    .collect();
                {
                    let mut pass = encoder.begin_compute_pass(&Default::default());
                    for ((pipeline, _, [x, y, z]), bind) in steps.iter().zip(&binds) {
                        pass.set_pipeline(pipeline);
                        pass.set_bind_group(0, bind, &[]);
                        pass.dispatch_workgroups(*x as u32, *y as u32, *z as u32);
                        stats.dispatches += 1;
                    }
                }
                Ok(encoder)
            })
            .await?;
        self.submit(encoder, stats).await?;
        Ok(())
    }

    /// S = scale·QKᵀ (soft-capped, masked) by the tiled matmul, then `softmax`:
    /// P stored, LSE written. Shared by the naive forward and backward.
    async fn naive_softmax_steps(
        &self,
        shape: &AttentionShape,
        storage: StorageKind,
        opts: &AttentionOptions,
        [qb, kb, lb, sb, pb]: [&wgpu::Buffer; 5],
        stats: &mut CallStats,
    ) -> Result<Vec<Step>> {
        let v = self.variant(opts.mask(shape).is_active(), opts.softcap_value() > 0.0);
        let scores = MatmulSpec::new(
            [storage, storage, StorageKind::F32],
            true,
            Epilogue::Scores,
            v,
            nt_params(shape),
            shape.batch,
            self.caps().lane_subgroup,
        );
        let source = shaders::naive_forward(shape.head_dim as u32, storage, v);
        let rows = shape.batch * shape.heads_q * shape.seqlen_q;
        stats.accesses += super::io::naive_softmax(&Params::new(&Piece::whole(*shape), opts)?);
        Ok(vec![
            self.matmul_step(&scores, [qb, kb, sb], stats).await?,
            (
                self.pipeline(&source, "softmax").await?,
                vec![(LSE, lb.clone()), (S, sb.clone()), (P, pb.clone())],
                [rows.div_ceil(ROWS_PER_GROUP), 1, 1],
            ),
        ])
    }

    /// [`Engine::naive_forward`] as a future.
    pub async fn naive_forward_async(
        &self,
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        opts: &AttentionOptions,
    ) -> Result<ForwardOutput> {
        let shape = AttentionShape::from_views(q, k, v)?;
        opts.validate()?;
        let precision = q.precision();
        let (storage, nn) = self.naive_check(&shape, precision)?;
        let mut stats = CallStats::default();
        let o_bytes = shape.q_len() as u64 * precision.bytes() as u64;
        let lse_bytes = shape.lse_len() as u64 * 4;
        let bufs = self
            .checked("allocating naive attention buffers", || {
                Ok([
                    self.upload(&mut stats, "q", q.data.as_bytes()),
                    self.upload(&mut stats, "k", k.data.as_bytes()),
                    self.upload(&mut stats, "v", v.data.as_bytes()),
                    self.storage(&mut stats, "o", o_bytes),
                    self.storage(&mut stats, "lse", lse_bytes),
                    self.storage(&mut stats, "S (N×N scores)", nn),
                    self.storage(&mut stats, "P (N×N probabilities)", nn),
                ])
            })
            .await?;
        let [qb, kb, vb, ob, lb, sb, pb] = &bufs;
        let mut steps = self
            .naive_softmax_steps(&shape, storage, opts, [qb, kb, lb, sb, pb], &mut stats)
            .await?;
        let pv = MatmulSpec::new(
            [StorageKind::F32, storage, storage],
            false,
            Epilogue::Scale,
            self.variant(false, false),
            nn_params(&shape, 1.0),
            shape.batch,
            self.caps().lane_subgroup,
        );
        steps.push(self.matmul_step(&pv, [pb, vb, ob], &mut stats).await?);
        let clear: Vec<&wgpu::Buffer> = if storage == StorageKind::F16Packed {
            vec![ob]
        } else {
            vec![]
        };
        let params = Params::new(&Piece::whole(shape), opts)?;
        self.run_steps(
            "running the naive forward kernels",
            &steps,
            &params,
            &clear,
            &mut stats,
        )
        .await?;
        let o = TensorData::from_bytes(
            &self.read_back(ob, o_bytes).await?,
            precision,
            shape.q_len(),
        );
        let lse = bytemuck::pod_collect_to_vec::<u8, f32>(&self.read_back(lb, lse_bytes).await?);
        Ok(ForwardOutput {
            o: Tensor {
                shape: shape.q_shape().to_vec(),
                data: o,
            },
            lse,
            shape,
            stats,
        })
    }

    /// [`Engine::naive_backward`] as a future.
    pub async fn naive_backward_async(
        &self,
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        d_o: &TensorView<'_>,
        opts: &AttentionOptions,
    ) -> Result<BackwardOutput> {
        let shape = AttentionShape::from_views(q, k, v)?;
        let precision = q.precision();
        check_like_q(&shape, precision, d_o, "do")?;
        opts.validate()?;
        let (storage, nn) = self.naive_check(&shape, precision)?;
        let source = shaders::naive_backward(
            shape.head_dim as u32,
            storage,
            self.variant(opts.mask(&shape).is_active(), opts.softcap_value() > 0.0),
        );
        let mut stats = CallStats::default();
        let elem = precision.bytes() as u64;
        let (q_bytes, kv_bytes) = (shape.q_len() as u64 * elem, shape.kv_len() as u64 * elem);
        let bufs = self
            .checked("allocating naive backward buffers", || {
                Ok([
                    self.upload(&mut stats, "q", q.data.as_bytes()),
                    self.upload(&mut stats, "k", k.data.as_bytes()),
                    self.upload(&mut stats, "v", v.data.as_bytes()),
                    self.upload(&mut stats, "do", d_o.data.as_bytes()),
                    self.storage(&mut stats, "lse", shape.lse_len() as u64 * 4),
                    self.storage(&mut stats, "S (N×N scores)", nn),
                    self.storage(&mut stats, "P (N×N probabilities)", nn),
                    self.storage(&mut stats, "dP/dS (N×N)", nn),
                    self.storage(&mut stats, "dq", q_bytes),
                    self.storage(&mut stats, "dk", kv_bytes),
                    self.storage(&mut stats, "dv", kv_bytes),
                ])
            })
            .await?;
        let [qb, kb, vb, dob, lb, sb, pb, dsb, dqb, dkb, dvb] = &bufs;
        let mut steps = self
            .naive_softmax_steps(&shape, storage, opts, [qb, kb, lb, sb, pb], &mut stats)
            .await?;
        // dP = dO·Vᵀ (same strides as S = Q·Kᵀ), dQ = scale·dS·K.
        let dp = MatmulSpec::new(
            [storage, storage, StorageKind::F32],
            true,
            Epilogue::Scale,
            self.variant(false, false),
            nt_params(&shape),
            shape.batch,
            self.caps().lane_subgroup,
        );
        let dq = MatmulSpec::new(
            [StorageKind::F32, storage, storage],
            false,
            Epilogue::Scale,
            self.variant(false, false),
            nn_params(&shape, opts.scale_for(shape.head_dim)),
            shape.batch,
            self.caps().lane_subgroup,
        );
        let rows = shape.batch * shape.heads_q * shape.seqlen_q;
        steps.push(self.matmul_step(&dp, [dob, vb, dsb], &mut stats).await?);
        steps.push((
            self.pipeline(&source, "ds").await?,
            vec![(S, sb.clone()), (P, pb.clone()), (DS, dsb.clone())],
            [rows.div_ceil(ROWS_PER_GROUP), 1, 1],
        ));
        steps.push(self.matmul_step(&dq, [dsb, kb, dqb], &mut stats).await?);
        if shape.group() == 1 {
            // dV = Pᵀ·dO and dK = scale·dSᵀ·Q: transpose, then the tuned matmul.
            let elements = shape.batch * shape.heads_q * shape.seqlen_q * shape.seqlen_k;
            let groups = elements.div_ceil(ROWS_PER_GROUP);
            let x = groups.min(self.max_groups() as usize);
            let grid = [x, groups.div_ceil(x), 1];
            steps.push((
                self.pipeline(&source, "p_transposed").await?,
                vec![(P, pb.clone()), (S, sb.clone())],
                grid,
            ));
            steps.push((
                self.pipeline(&source, "ds_transposed").await?,
                vec![(DS, dsb.clone()), (P, pb.clone())],
                grid,
            ));
            let lanes = self.caps().lane_subgroup;
            let storages = [StorageKind::F32, storage, storage];
            let scale = opts.scale_for(shape.head_dim);
            for (alpha, a, b, c) in [(1.0, sb, dob, dvb), (scale, pb, qb, dkb)] {
                let v = self.variant(false, false);
                let spec = MatmulSpec::new(
                    storages,
                    false,
                    Epilogue::Scale,
                    v,
                    tn_params(&shape, alpha),
                    shape.batch,
                    lanes,
                );
                steps.push(self.matmul_step(&spec, [a, b, c], &mut stats).await?);
            }
        } else {
            // With GQA, dK and dV sum over the query heads of each kv head: a plain kernel.
            steps.push((
                self.pipeline(&source, "dkdv").await?,
                vec![
                    (Q, qb.clone()),
                    (DO, dob.clone()),
                    (P, pb.clone()),
                    (DS, dsb.clone()),
                    (DK, dkb.clone()),
                    (DV, dvb.clone()),
                ],
                [
                    shape.head_dim.div_ceil(TILE),
                    shape.seqlen_k.div_ceil(TILE),
                    shape.batch * shape.heads_kv,
                ],
            ));
        }
        let clear: Vec<&wgpu::Buffer> = if storage == StorageKind::F16Packed {
            vec![dqb, dkb, dvb]
        } else {
            vec![]
        };
        let params = Params::new(&Piece::whole(shape), opts)?;
        stats.accesses += super::io::naive_backward_rows(
            &params,
            shape.head_dim as u32,
            opts.softcap_value() > 0.0,
        );
        self.run_steps(
            "running the naive backward kernels",
            &steps,
            &params,
            &clear,
            &mut stats,
        )
        .await?;
        let read = |b, bytes, n| async move {
            Ok::<_, Error>(TensorData::from_bytes(
                &self.read_back(b, bytes).await?,
                precision,
                n,
            ))
        };
        let tensor = |shape: [usize; 4], data| Tensor {
            shape: shape.to_vec(),
            data,
        };
        Ok(BackwardOutput {
            dq: tensor(shape.q_shape(), read(dqb, q_bytes, shape.q_len()).await?),
            dk: tensor(shape.kv_shape(), read(dkb, kv_bytes, shape.kv_len()).await?),
            dv: tensor(shape.kv_shape(), read(dvb, kv_bytes, shape.kv_len()).await?),
            stats,
        })
    }
}

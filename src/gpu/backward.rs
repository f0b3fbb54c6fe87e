//! Host side of the flash backward: D = rowsum(dO·O), then dK/dV over key
//! blocks and dQ over query blocks, all atomic-free and deterministic. Extra
//! storage beyond inputs and gradients is D (one f32 per row).

use super::engine::{CallStats, Engine};
use super::params::{Params, Piece};
use super::shaders::{self, binding};
use super::split::{gather_lse, host_gather, scatter_add};
use crate::attention::BackwardOutput;
// Only the native-only blocking `forward_backward` returns a forward output.
#[cfg(not(target_arch = "wasm32"))]
use crate::attention::ForwardOutput;
use crate::error::{Error, Result};
use crate::options::AttentionOptions;
use crate::plan::{plan_backward, Plan, PlanOverrides, PlanRequest, StorageKind};
use crate::reference::{validate_backward, Layout};
use crate::tensor::{AttentionShape, Precision, Tensor, TensorData, TensorView};

/// Rows of D computed per workgroup.
const PRE_ROWS: usize = 64;

impl Engine {
    /// The plan the backward kernels would run with.
    pub fn plan_backward(
        &self,
        shape: &AttentionShape,
        precision: Precision,
        overrides: &PlanOverrides,
    ) -> Result<Plan> {
        plan_backward(
            &PlanRequest::for_shape(shape, precision, *overrides),
            &self.caps(),
        )
    }

    /// Gradients dq, dk, dv from the forward's `o` and `lse` and the output gradient `d_o`.
    #[cfg(not(target_arch = "wasm32"))]
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        o: &TensorView,
        lse: &[f32],
        d_o: &TensorView,
        opts: &AttentionOptions,
    ) -> Result<BackwardOutput> {
        self.backward_with(q, k, v, o, lse, d_o, opts, &PlanOverrides::default())
    }

    /// [`Engine::backward`] with plan overrides.
    #[cfg(not(target_arch = "wasm32"))]
    #[allow(clippy::too_many_arguments)]
    pub fn backward_with(
        &self,
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        o: &TensorView,
        lse: &[f32],
        d_o: &TensorView,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<BackwardOutput> {
        pollster::block_on(self.backward_async(q, k, v, o, lse, d_o, opts, overrides))
    }

    /// Forward, then backward with its `o` and `lse`.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn forward_backward(
        &self,
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        d_o: &TensorView,
        opts: &AttentionOptions,
    ) -> Result<(ForwardOutput, BackwardOutput)> {
        let fwd = self.forward(q, k, v, opts)?;
        let o = fwd.o.view()?;
        let bwd = self.backward(q, k, v, &o, &fwd.lse, d_o, opts)?;
        Ok((fwd, bwd))
    }

    /// [`Engine::backward_with`] as a future.
    #[allow(clippy::too_many_arguments)]
    pub async fn backward_async(
        &self,
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        o: &TensorView<'_>,
        lse: &[f32],
        d_o: &TensorView<'_>,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<BackwardOutput> {
        let shape = validate_backward(q, k, v, o, lse, d_o, opts)?;
        let plan = self.plan_backward(&shape, q.precision(), overrides)?;
        let longest = shape.seqlen_q.max(shape.seqlen_k);
        let (mut out, reruns) = self
            .with_reruns("backward", &plan, longest, |max_seq| {
                self.backward_pieces([q, k, v, o, d_o], lse, opts, &shape, &plan, max_seq)
            })
            .await?;
        out.stats.reruns = reruns;
        Ok(out)
    }

    /// One attempt at a backward, in pieces of at most `max_seq` rows and keys.
    async fn backward_pieces(
        &self,
        [q, k, v, o, d_o]: [&TensorView<'_>; 5],
        lse: &[f32],
        opts: &AttentionOptions,
        shape: &AttentionShape,
        plan: &Plan,
        max_seq: usize,
    ) -> Result<BackwardOutput> {
        let shape = *shape;
        let precision = q.precision();
        let mut stats = CallStats::for_plan(plan);
        let pieces = self.pieces(&shape, precision, max_seq)?;
        let tensors = |[dq, dk, dv]: [TensorData; 3], stats| BackwardOutput {
            dq: Tensor {
                shape: shape.q_shape().to_vec(),
                data: dq,
            },
            dk: Tensor {
                shape: shape.kv_shape().to_vec(),
                data: dk,
            },
            dv: Tensor {
                shape: shape.kv_shape().to_vec(),
                data: dv,
            },
            stats,
        };
        if pieces.len() == 1 {
            let inputs = [q, k, v, o, d_o].map(|t| t.data.as_bytes());
            let grads = self
                .run_piece(&Piece::whole(shape), plan, opts, inputs, lse, &mut stats)
                .await?;
            return Ok(tensors(grads, stats));
        }

        // Split path: each piece's gradients are partial sums (dQ over its keys,
        // dK/dV over its rows, with the full rows' LSE), added in a fixed order.
        let (ql, kl) = (Layout::q(&shape), Layout::kv(&shape));
        let mut dq = vec![0f32; shape.q_len()];
        let mut dk = vec![0f32; shape.kv_len()];
        let mut dv = vec![0f32; shape.kv_len()];
        for s in &pieces {
            let qh = s.q_heads(&shape);
            let rows = |t: &TensorView| host_gather(t.data, ql, &s.batch, &s.rows, &qh);
            let keys = |t: &TensorView| host_gather(t.data, kl, &s.batch, &s.keys, &s.kv_heads);
            let parts = [rows(q), keys(k), keys(v), rows(o), rows(d_o)];
            let piece = Piece {
                local: s.shape(&shape),
                full: shape,
                q_start: s.rows.start,
                k_start: s.keys.start,
            };
            let inputs = [0, 1, 2, 3, 4].map(|i| parts[i].as_host().as_bytes());
            let [pq, pk, pv] = self
                .run_piece(
                    &piece,
                    plan,
                    opts,
                    inputs,
                    &gather_lse(lse, &shape, s),
                    &mut stats,
                )
                .await?;
            scatter_add(&mut dq, ql, &s.batch, &s.rows, &qh, &pq.to_f32());
            scatter_add(&mut dk, kl, &s.batch, &s.keys, &s.kv_heads, &pk.to_f32());
            scatter_add(&mut dv, kl, &s.batch, &s.keys, &s.kv_heads, &pv.to_f32());
        }
        let grads = [dq, dk, dv].map(|g| TensorData::from_f32(g, precision));
        Ok(tensors(grads, stats))
    }

    /// Upload one piece, run the three kernels, read dq, dk, dv back.
    async fn run_piece(
        &self,
        piece: &Piece,
        plan: &Plan,
        opts: &AttentionOptions,
        inputs: [&[u8]; 5],
        lse: &[f32],
        stats: &mut CallStats,
    ) -> Result<[TensorData; 3]> {
        let s = &piece.local;
        let precision = plan.storage.precision();
        let elem = precision.bytes() as u64;
        let (q_bytes, kv_bytes) = (s.q_len() as u64 * elem, s.kv_len() as u64 * elem);
        let variant = self.variant(
            opts.mask(&piece.full).is_active(),
            opts.softcap_value() > 0.0,
        );
        let [pre_src, dkdv_src, dq_src] = shaders::flash_backward(plan, variant);
        let pre = self.pipeline(&pre_src, "main").await?;
        let dkdv = self.pipeline(&dkdv_src, "main").await?;
        let dq = self.pipeline(&dq_src, "main").await?;
        let base = Params::new(piece, opts)?;
        stats.accesses += super::io::flash_backward(&base, plan, variant.masked);
        let max_groups = self.max_groups();

        let bufs = self
            .checked("allocating backward buffers", || {
                Ok([
                    self.upload(stats, "q", inputs[0]),
                    self.upload(stats, "k", inputs[1]),
                    self.upload(stats, "v", inputs[2]),
                    self.upload(stats, "o", inputs[3]),
                    self.upload(stats, "do", inputs[4]),
                    self.upload(stats, "lse", bytemuck::cast_slice(lse)),
                    self.storage(stats, "D = rowsum(dO·O)", s.lse_len() as u64 * 4),
                    self.storage(stats, "dq", q_bytes),
                    self.storage(stats, "dk", kv_bytes),
                    self.storage(stats, "dv", kv_bytes),
                ])
            })
            .await?;
        let [qb, kb, vb, ob, dob, lseb, dvecb, dqb, dkb, dvb] = &bufs;
        use binding::*;
        let encoder = self
            .checked("encoding the flash backward kernels", || {
                let mut encoder = self.device().create_command_encoder(&Default::default());
                if plan.storage == StorageKind::F16Packed {
                    for b in [dqb, dkb, dvb] {
                        encoder.clear_buffer(b, 0, None);
                    }
                }
                let uniform = |offset: u32| {
                    self.uniform(&Params {
                        block_offset: offset,
                        ..base
                    })
                };
                let mut work = Vec::new();
                // D: rows spread over x (and y past the dispatch limit).
                let groups = (s.batch * s.seqlen_q * s.heads_q).div_ceil(PRE_ROWS) as u32;
                let x = groups.min(max_groups);
                let p0 = uniform(0);
                work.push((
                    &pre,
                    self.bind(stats, &pre, &[(0, &p0), (DO, dob), (O, ob), (DVEC, dvecb)]),
                    [x, groups.div_ceil(x), 1],
                ));
                let blocks = |n: usize| n.div_ceil(plan.br as usize) as u32;
                let grids = [
                    (
                        &dkdv,
                        blocks(s.seqlen_k),
                        s.heads_kv,
                        vec![(DK, dkb), (DV, dvb)],
                    ),
                    (&dq, blocks(s.seqlen_q), s.heads_q, vec![(DQ, dqb)]),
                ];
                for (pipeline, n_blocks, heads, outputs) in grids {
                    for offset in (0..n_blocks).step_by(max_groups as usize) {
                        let params = uniform(offset);
                        let mut entries = vec![
                            (0, &params),
                            (Q, qb),
                            (K, kb),
                            (V, vb),
                            (DO, dob),
                            (LSE, lseb),
                            (DVEC, dvecb),
                        ];
                        entries.extend(outputs.iter().map(|&(b, buf)| (b, buf)));
                        let bind = self.bind(stats, pipeline, &entries);
                        work.push((
                            pipeline,
                            bind,
                            [
                                (n_blocks - offset).min(max_groups),
                                heads as u32,
                                s.batch as u32,
                            ],
                        ));
                    }
                }
                {
                    let mut pass = encoder.begin_compute_pass(&Default::default());
                    for (pipeline, bind, [x, y, z]) in &work {
                        pass.set_pipeline(pipeline);
                        pass.set_bind_group(0, bind, &[]);
                        pass.dispatch_workgroups(*x, *y, *z);
                        stats.dispatches += 1;
                    }
                }
                Ok(encoder)
            })
            .await?;
        self.submit(encoder, stats).await?;
        let read = |b, bytes, n| async move {
            Ok::<_, Error>(TensorData::from_bytes(
                &self.read_back(b, bytes).await?,
                precision,
                n,
            ))
        };
        Ok([
            read(dqb, q_bytes, s.q_len()).await?,
            read(dkb, kv_bytes, s.kv_len()).await?,
            read(dvb, kv_bytes, s.kv_len()).await?,
        ])
    }
}

//! Host side of the flash forward kernel: plan, upload, dispatch, read back,
//! and the splitting of problems larger than one storage binding or dispatch.

use super::engine::{CallStats, Engine};
use super::params::{Params, Piece};
use super::shaders;
use super::split::{host_gather, merge_piece, scatter};
use crate::attention::ForwardOutput;
use crate::error::{Error, Result};
use crate::options::AttentionOptions;
use crate::plan::{plan_forward, Plan, PlanOverrides, PlanRequest, StorageKind};
use crate::reference::Layout;
use crate::tensor::{AttentionShape, Precision, Tensor, TensorData, TensorView};

/// Caller-owned device buffers for [`Engine::forward_buffers`]: q, k, v in
/// the storage precision (f16 as raw halves, padded to 4 bytes), o likewise,
/// lse as f32. All need `STORAGE` usage.
#[derive(Clone, Copy, Debug)]
pub struct AttentionBuffers<'a> {
    pub q: &'a wgpu::Buffer,
    pub k: &'a wgpu::Buffer,
    pub v: &'a wgpu::Buffer,
    pub o: &'a wgpu::Buffer,
    pub lse: &'a wgpu::Buffer,
}

impl Engine {
    /// The plan this engine would run for a problem.
    pub fn plan(
        &self,
        shape: &AttentionShape,
        precision: Precision,
        overrides: &PlanOverrides,
    ) -> Result<Plan> {
        plan_forward(
            &PlanRequest::for_shape(shape, precision, *overrides),
            &self.caps(),
        )
    }

    /// Exact attention forward on host tensors (see [`Engine::forward_with`]).
    #[cfg(not(target_arch = "wasm32"))]
    pub fn forward(
        &self,
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        opts: &AttentionOptions,
    ) -> Result<ForwardOutput> {
        self.forward_with(q, k, v, opts, &PlanOverrides::default())
    }

    /// Exact attention forward on host tensors with plan overrides. Problems
    /// larger than one storage binding or dispatch are split, never rejected.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn forward_with(
        &self,
        q: &TensorView,
        k: &TensorView,
        v: &TensorView,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<ForwardOutput> {
        pollster::block_on(self.forward_async(q, k, v, opts, overrides))
    }

    /// [`Engine::forward_with`] as a future (the form to use on the web).
    pub async fn forward_async(
        &self,
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<ForwardOutput> {
        let shape = AttentionShape::from_views(q, k, v)?;
        opts.validate()?;
        let plan = self.plan(&shape, q.precision(), overrides)?;
        let longest = shape.seqlen_q.max(shape.seqlen_k);
        let (mut out, reruns) = self
            .with_reruns("forward", &plan, longest, |max_seq| {
                self.forward_pieces(q, k, v, opts, &shape, &plan, max_seq)
            })
            .await?;
        out.stats.reruns = reruns;
        Ok(out)
    }

    /// One attempt at a host-tensor forward, in pieces of at most `max_seq`
    /// rows and keys (besides the binding and dispatch limits).
    #[allow(clippy::too_many_arguments)]
    async fn forward_pieces(
        &self,
        q: &TensorView<'_>,
        k: &TensorView<'_>,
        v: &TensorView<'_>,
        opts: &AttentionOptions,
        shape: &AttentionShape,
        plan: &Plan,
        max_seq: usize,
    ) -> Result<ForwardOutput> {
        let shape = *shape;
        let precision = q.precision();
        let mut stats = CallStats::for_plan(plan);
        let pieces = self.pieces(&shape, precision, max_seq)?;

        if pieces.len() == 1 {
            let (o, lse) = self
                .run_uploaded(
                    &Piece::whole(shape),
                    plan,
                    opts,
                    [q.data.as_bytes(), k.data.as_bytes(), v.data.as_bytes()],
                    &mut stats,
                )
                .await?;
            return Ok(ForwardOutput {
                o: Tensor {
                    shape: shape.q_shape().to_vec(),
                    data: o,
                },
                lse,
                shape,
                stats,
            });
        }

        // Split path: gather each piece, run it, scatter (and merge split keys).
        let (ql, kl) = (Layout::q(&shape), Layout::kv(&shape));
        let mut o_full = vec![0f32; shape.q_len()];
        let mut o_exact = TensorData::from_f32(vec![0.0; shape.q_len()], precision);
        let mut lse_full = vec![f32::NEG_INFINITY; shape.lse_len()];
        let keys_split = pieces.iter().any(|p| p.keys.len() != shape.seqlen_k);
        for s in &pieces {
            let local = s.shape(&shape);
            let qh = s.q_heads(&shape);
            let qd = host_gather(q.data, ql, &s.batch, &s.rows, &qh);
            let kd = host_gather(k.data, kl, &s.batch, &s.keys, &s.kv_heads);
            let vd = host_gather(v.data, kl, &s.batch, &s.keys, &s.kv_heads);
            let piece = Piece {
                local,
                full: shape,
                q_start: s.rows.start,
                k_start: s.keys.start,
            };
            let bytes = [
                qd.as_host().as_bytes(),
                kd.as_host().as_bytes(),
                vd.as_host().as_bytes(),
            ];
            let (o, lse) = self
                .run_uploaded(&piece, plan, opts, bytes, &mut stats)
                .await?;
            if keys_split {
                merge_piece(&shape, s, &o.to_f32(), &lse, &mut o_full, &mut lse_full);
            } else {
                match (&mut o_exact, &o) {
                    (TensorData::F32(dst), TensorData::F32(src)) => {
                        scatter(dst, ql, &s.batch, &s.rows, &qh, src)
                    }
                    (TensorData::F16(dst), TensorData::F16(src)) => {
                        scatter(dst, ql, &s.batch, &s.rows, &qh, src)
                    }
                    _ => {
                        return Err(Error::Dtype(
                            "output precision changed between pieces".into(),
                        ))
                    }
                }
                for (bl, b) in s.batch.clone().enumerate() {
                    for (hl, h) in qh.clone().enumerate() {
                        let src =
                            &lse[(bl * local.heads_q + hl) * local.seqlen_q..][..local.seqlen_q];
                        let dst = (b * shape.heads_q + h) * shape.seqlen_q + s.rows.start;
                        lse_full[dst..dst + local.seqlen_q].copy_from_slice(src);
                    }
                }
            }
        }
        let o = if keys_split {
            TensorData::from_f32(o_full, precision)
        } else {
            o_exact
        };
        Ok(ForwardOutput {
            o: Tensor {
                shape: shape.q_shape().to_vec(),
                data: o,
            },
            lse: lse_full,
            shape,
            stats,
        })
    }

    /// Upload one piece, run it and read o and lse back.
    async fn run_uploaded(
        &self,
        piece: &Piece,
        plan: &Plan,
        opts: &AttentionOptions,
        qkv: [&[u8]; 3],
        stats: &mut CallStats,
    ) -> Result<(TensorData, Vec<f32>)> {
        let s = &piece.local;
        let precision = plan.storage.precision();
        let (o_bytes, lse_bytes) = (
            s.q_len() as u64 * precision.bytes() as u64,
            s.lse_len() as u64 * 4,
        );
        let bufs = self
            .checked("allocating attention buffers", || {
                Ok([
                    self.upload(stats, "q", qkv[0]),
                    self.upload(stats, "k", qkv[1]),
                    self.upload(stats, "v", qkv[2]),
                    self.storage(stats, "o", o_bytes),
                    self.storage(stats, "lse", lse_bytes),
                ])
            })
            .await?;
        let [q, k, v, o, lse] = &bufs;
        self.encode_and_run(
            &AttentionBuffers { q, k, v, o, lse },
            piece,
            plan,
            opts,
            stats,
        )
        .await?;
        let o = TensorData::from_bytes(&self.read_back(o, o_bytes).await?, precision, s.q_len());
        let lse = bytemuck::pod_collect_to_vec::<u8, f32>(&self.read_back(lse, lse_bytes).await?);
        Ok((o, lse))
    }

    /// Forward on caller-owned device buffers (data stays on the GPU). Every
    /// tensor must fit in one storage binding; returns what the call did.
    #[cfg(not(target_arch = "wasm32"))]
    pub fn forward_buffers(
        &self,
        buffers: &AttentionBuffers,
        shape: &AttentionShape,
        precision: Precision,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<CallStats> {
        pollster::block_on(self.forward_buffers_async(buffers, shape, precision, opts, overrides))
    }

    /// [`Engine::forward_buffers`] as a future.
    pub async fn forward_buffers_async(
        &self,
        buffers: &AttentionBuffers<'_>,
        shape: &AttentionShape,
        precision: Precision,
        opts: &AttentionOptions,
        overrides: &PlanOverrides,
    ) -> Result<CallStats> {
        opts.validate()?;
        let plan = self.plan(shape, precision, overrides)?;
        let elem = precision.bytes() as u64;
        let need = |n: usize, e: u64| (n as u64 * e).max(4).next_multiple_of(4);
        let checks = [
            ("q", buffers.q, need(shape.q_len(), elem)),
            ("k", buffers.k, need(shape.kv_len(), elem)),
            ("v", buffers.v, need(shape.kv_len(), elem)),
            ("o", buffers.o, need(shape.q_len(), elem)),
            ("lse", buffers.lse, need(shape.lse_len(), 4)),
        ];
        for (name, buffer, bytes) in checks {
            if buffer.size() < bytes {
                return Err(Error::Shape(format!(
                    "buffer {name} holds {} bytes, the problem needs {bytes}",
                    buffer.size()
                )));
            }
            if bytes > self.max_binding() {
                return Err(Error::Unsupported(format!(
                    "buffer {name} needs {bytes} bytes, more than one storage binding ({}); use the host-tensor API, which splits",
                    self.max_binding()
                )));
            }
        }
        let mut stats = CallStats::for_plan(&plan);
        self.encode_and_run(buffers, &Piece::whole(*shape), &plan, opts, &mut stats)
            .await?;
        Ok(stats)
    }

    /// Dispatch the flash kernel over one piece, splitting the grid at the
    /// device's per-dimension workgroup limit.
    async fn encode_and_run(
        &self,
        b: &AttentionBuffers<'_>,
        piece: &Piece,
        plan: &Plan,
        opts: &AttentionOptions,
        stats: &mut CallStats,
    ) -> Result<()> {
        let s = &piece.local;
        let variant = self.variant(
            opts.mask(&piece.full).is_active(),
            opts.softcap_value() > 0.0,
        );
        let max_groups = self.max_groups();
        if s.heads_q > max_groups as usize || s.batch > max_groups as usize {
            return Err(Error::Unsupported(format!(
                "batch {} × heads {} exceeds the device's {max_groups} workgroups per dimension; use the host-tensor API, which splits",
                s.batch, s.heads_q
            )));
        }
        let pipeline = self
            .pipeline(&shaders::flash_forward(plan, variant), "main")
            .await?;
        let base = Params::new(piece, opts)?;
        stats.accesses += super::io::flash_forward(&base, plan, variant.masked);
        let blocks = s.seqlen_q.div_ceil(plan.br as usize) as u32;
        let encoder = self
            .checked("encoding the flash forward kernel", || {
                let mut encoder = self.device().create_command_encoder(&Default::default());
                if plan.storage == StorageKind::F16Packed {
                    // Packed stores OR halves into zeroed words.
                    encoder.clear_buffer(b.o, 0, None);
                }
                let mut groups = Vec::new();
                for offset in (0..blocks).step_by(max_groups as usize) {
                    let params = self.uniform(&Params {
                        block_offset: offset,
                        ..base
                    });
                    let bind = self.bind(
                        stats,
                        &pipeline,
                        &[
                            (0, &params),
                            (1, b.q),
                            (2, b.k),
                            (3, b.v),
                            (4, b.o),
                            (5, b.lse),
                        ],
                    );
                    groups.push((bind, (blocks - offset).min(max_groups)));
                }
                {
                    let mut pass = encoder.begin_compute_pass(&Default::default());
                    pass.set_pipeline(&pipeline);
                    for (bind, x) in &groups {
                        pass.set_bind_group(0, bind, &[]);
                        pass.dispatch_workgroups(*x, s.heads_q as u32, s.batch as u32);
                        stats.dispatches += 1;
                    }
                }
                Ok(encoder)
            })
            .await?;
        self.submit(encoder, stats).await?;
        Ok(())
    }
}

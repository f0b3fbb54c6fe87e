//! The naive baseline on the GPU: S and P materialized in a storage buffer of
//! batch·heads·Sq·Sk f32. It exists to be measured against, and it fails where
//! that buffer outgrows a storage binding — which is the point.

use super::engine::{CallStats, Engine};
use super::params::{Params, Piece};
use super::shaders::{self, Variant};
use crate::attention::ForwardOutput;
use crate::error::{Error, Result};
use crate::options::AttentionOptions;
use crate::plan::{PlanOverrides, StorageKind};
use crate::tensor::{AttentionShape, Tensor, TensorData, TensorView};

const TILE: usize = 16;
const ROWS_PER_GROUP: usize = 64;

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
        let storage = self
            .plan(&shape, precision, &PlanOverrides::default())?
            .storage;
        let s_bytes = (shape.batch * shape.heads_q * shape.seqlen_q * shape.seqlen_k) as u64 * 4;
        if s_bytes > self.max_binding() {
            return Err(Error::Unsupported(format!(
                "naive attention materializes S: {s_bytes} bytes, more than one storage binding ({} bytes)",
                self.max_binding()
            )));
        }
        let max_groups = self.max_groups() as usize;
        let grid_z = shape.batch * shape.heads_q;
        if grid_z > max_groups
            || shape.seqlen_q.div_ceil(TILE) > max_groups
            || shape.seqlen_k.div_ceil(TILE) > max_groups
        {
            return Err(Error::Unsupported(format!(
                "naive attention grid ({} × {} × {grid_z}) exceeds {max_groups} workgroups per dimension",
                shape.seqlen_k.div_ceil(TILE),
                shape.seqlen_q.div_ceil(TILE)
            )));
        }
        let variant = Variant {
            masked: opts.mask(&shape).is_active(),
            softcap: opts.softcap_value() > 0.0,
        };
        let source = shaders::naive_forward(shape.head_dim as u32, storage, variant);
        let scores = self.pipeline(&source, "scores").await?;
        let softmax = self.pipeline(&source, "softmax").await?;
        let pv = self.pipeline(&source, "pv").await?;
        let params = Params::new(&Piece::whole(shape), opts)?;

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
                    self.storage(&mut stats, "s (N×N scores)", s_bytes),
                ])
            })
            .await?;
        let [qb, kb, vb, ob, lb, sb] = &bufs;
        let uniform = self.uniform(&params);
        let encoder = self
            .checked("encoding the naive forward kernels", || {
                let mut encoder = self.device().create_command_encoder(&Default::default());
                if storage == StorageKind::F16Packed {
                    encoder.clear_buffer(ob, 0, None);
                }
                let steps = [
                    (
                        &scores,
                        vec![(0, &uniform), (1, qb), (2, kb), (6, sb)],
                        [
                            shape.seqlen_k.div_ceil(TILE),
                            shape.seqlen_q.div_ceil(TILE),
                            grid_z,
                        ],
                    ),
                    (
                        &softmax,
                        vec![(0, &uniform), (5, lb), (6, sb)],
                        [(grid_z * shape.seqlen_q).div_ceil(ROWS_PER_GROUP), 1, 1],
                    ),
                    (
                        &pv,
                        vec![(0, &uniform), (3, vb), (4, ob), (6, sb)],
                        [
                            shape.head_dim.div_ceil(TILE),
                            shape.seqlen_q.div_ceil(TILE),
                            grid_z,
                        ],
                    ),
                ];
                let binds: Vec<_> = steps
                    .iter()
                    .map(|(p, entries, _)| self.bind(p, entries))
                    .collect();
                {
                    let mut pass = encoder.begin_compute_pass(&Default::default());
                    for ((pipeline, _, [x, y, z]), bind) in steps.iter().zip(&binds) {
                        if *x > max_groups {
                            return Err(Error::Unsupported(format!(
                            "naive softmax needs {x} workgroups, the device allows {max_groups}"
                        )));
                        }
                        pass.set_pipeline(pipeline);
                        pass.set_bind_group(0, bind, &[]);
                        pass.dispatch_workgroups(*x as u32, *y as u32, *z as u32);
                        stats.dispatches += 1;
                    }
                }
                Ok(encoder)
            })
            .await?;
        stats.kernel_seconds += self.submit(encoder).await?;
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
}

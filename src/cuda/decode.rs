//! Decoding on a host KV cache (flash_attn_with_kvcache) with the forward's
//! kernels: `k_new`/`v_new` are written into the cache on the host (in
//! place, as the CPU backend does), each sequence's keys are gathered from
//! its cache row or pages into a packed batch, and the forward runs it as a
//! varlen call — q's batch entries as sequences of `seqlen_q` rows, each
//! against its own `seqlen_k[b] = cache_seqlens[b] + seqlen_new` keys, so
//! the causal/window band is bottom-right aligned per sequence (`off_b =
//! seqlen_k[b] − seqlen_q`), as docs/semantics.md asks. One launch, no split (the
//! grid's blocks are the sequences' query tiles and heads); `num_splits`
//! is accepted and the result is the same within the rule for every value.

use super::context::CudaDevice;
use super::forward::forward;
use super::plan::KernelPath;
use super::problem::Call;
use crate::api::decode::{DecodeOutput, DecodeProblem, DecodeStep, HostKvCache};
use crate::api::options::AttentionOptions;
use crate::api::inputs::ForwardInputs;
use crate::api::problem::Problem;
use crate::api::shape::AttentionShape;
use crate::api::tensor::TensorData;
use crate::api::varlen::Varlen;
use crate::error::{Error, Result};

pub(crate) fn decode(
    dev: &CudaDevice,
    path: KernelPath,
    cache: &mut HostKvCache,
    step: &DecodeStep,
    opts: &AttentionOptions,
) -> Result<DecodeOutput> {
    opts.validate()?;
    let p = DecodeProblem::new(step, &cache.shape, cache.precision())?;
    opts.for_decoding(p.batch, p.heads_q)?;
    let total_q = p.batch * p.seqlen_q;
    let total_k = p.total_keys();
    let i32_of = |what, n: usize| {
        i32::try_from(n).map_err(|_| Error::Overflow {
            what,
            value: n as u64,
        })
    };
    let cu_q: Vec<i32> = (0..=p.batch)
        .map(|b| i32_of("decoding query rows", b * p.seqlen_q))
        .collect::<Result<_>>()?;
    let mut cu_k = vec![0i32];
    for b in 0..p.batch {
        let last = *cu_k.last().unwrap_or(&0) as usize;
        cu_k.push(i32_of("decoding keys", last + p.seqlen_k(b))?);
    }
    let packed = opts.clone().varlen(Varlen::new(&cu_q, &cu_k)?);
    // Everything the kernels check (v's own head dim among it), before the
    // cache changes (with no key at all, on a stand-in of one key per
    // sequence: nothing runs then).
    let (heads, d) = (p.heads_q, p.head_dim);
    let shape = |batch, sq, sk| {
        AttentionShape::new(batch, sq, sk, heads, p.heads_kv, d)?.with_head_dim_v(p.head_dim_v)
    };
    match total_k {
        0 => Call::new(&Problem::new(shape(p.batch, p.seqlen_q, 1)?, p.precision, opts)?)?,
        _ => Call::new(&Problem::new(shape(1, total_q, total_k)?, p.precision, &packed)?)?,
    };
    if let Some([k_new, v_new]) = &step.new_kv {
        crate::cpu::append_to_cache(&mut cache.k, k_new, &p, p.cache.row_len())?;
        crate::cpu::append_to_cache(&mut cache.v, v_new, &p, p.cache.v_row_len())?;
    }
    if total_k == 0 {
        // No sequence has a key: every row is empty (o = 0, lse = -inf).
        let o = TensorData::from_f32(vec![0.0; p.q_len()], p.precision);
        let lse = vec![f32::NEG_INFINITY; p.lse_len()];
        return Ok(DecodeOutput::new(&p, o, lse, 1, Default::default()));
    }
    let (k, v) = (gather(&cache.k, &p), gather(&cache.v, &p));
    let kv_shape = [1, total_k, p.heads_kv, p.head_dim];
    let q = step.q.data;
    let q = crate::api::tensor::TensorView {
        shape: [1, total_q, p.heads_q, p.head_dim],
        data: q,
    };
    let (k, v) = (k.view(kv_shape), v.view(kv_shape));
    let problem = Problem::forward(&ForwardInputs::new(q, k, v), &packed)?;
    let out = forward(dev, path, &q, &k, &v, &problem)?;
    // lse (heads_q, total_q) of the packed batch to (batch, heads_q, seqlen_q).
    let mut lse = vec![0.0; p.lse_len()];
    for b in 0..p.batch {
        for h in 0..p.heads_q {
            for i in 0..p.seqlen_q {
                lse[(b * p.heads_q + h) * p.seqlen_q + i] =
                    out.lse[h * total_q + b * p.seqlen_q + i];
            }
        }
    }
    // o (total_q, heads_q, d) is (batch, seqlen_q, heads_q, d) row for row.
    Ok(DecodeOutput::new(&p, out.o.data, lse, 1, out.stats))
}

/// Each sequence's keys (cache rows or pages, then the appended ones, in
/// token order), packed `(total_k, heads_kv, d)`.
fn gather(cache: &TensorData, p: &DecodeProblem) -> TensorData {
    fn rows<T: Copy>(c: &[T], p: &DecodeProblem) -> Vec<T> {
        let len = p.cache.row_len();
        let mut out = Vec::with_capacity(p.total_keys() * len);
        for b in 0..p.batch {
            for t in 0..p.seqlen_k(b) {
                out.extend_from_slice(&c[p.cache_row(b, t) * len..][..len]);
            }
        }
        out
    }
    match cache {
        TensorData::F32(c) => TensorData::F32(rows(c, p)),
        TensorData::F16(c) => TensorData::F16(rows(c, p)),
        TensorData::Bf16(c) => TensorData::Bf16(rows(c, p)),
    }
}

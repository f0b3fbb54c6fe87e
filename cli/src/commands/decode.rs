//! `flashattn decode`: one decoding step against a KV cache on `.npy` files
//! (docs/semantics.md, "KV cache and decoding"). Every file is read and the step
//! validated — shapes, dtypes, lengths against the cache's capacity, every
//! cache row and page index — before any device work; the outputs (o, lse,
//! the updated caches) are written only when all of them succeeded.

use super::attention::{convert, flags, open, output, Flags};
use super::pair;
use crate::args::DecodeArgs;
use crate::error::{CliError, Result};
use crate::npy::{self, IndexArray};
use flashattn::{
    AttentionOptions, AttentionShape, BackendKind, DecodeProblem, DecodeStep, HostKvCache,
    Operation, Precision, Tensor, Workload,
};
use std::path::{Path, PathBuf};

/// q, the index arrays and the new rows, in the precision of the step.
pub struct StepInputs {
    pub q: Tensor,
    pub cache_seqlens: Vec<i32>,
    pub cache_batch_idx: Option<Vec<i32>>,
    /// `(pages, max_pages)`, row-major `(batch, max_pages)`.
    pub block_table: Option<(Vec<i32>, usize)>,
    pub new_kv: Option<[Tensor; 2]>,
}

impl StepInputs {
    /// The step these inputs make.
    pub fn step(&self) -> Result<DecodeStep<'_>> {
        let mut step = DecodeStep::new(self.q.view()?, &self.cache_seqlens);
        if let Some(idx) = &self.cache_batch_idx {
            step = step.batch_idx(idx);
        }
        if let Some((pages, max_pages)) = &self.block_table {
            step = step.block_table(pages, *max_pages);
        }
        if let Some([k, v]) = &self.new_kv {
            step = step.append(k.view()?, v.view()?);
        }
        Ok(step)
    }
}

/// The dtypes of the input files, which the outputs keep.
#[derive(Clone, Copy, Debug)]
pub struct FileDtypes {
    pub q: Precision,
    pub k_cache: Precision,
    pub v_cache: Precision,
}

/// Everything a decoding step needs, validated.
pub struct Prepared {
    pub inputs: StepInputs,
    pub cache: HostKvCache,
    pub problem: DecodeProblem,
    pub dtypes: FileDtypes,
    pub opts: AttentionOptions,
    pub backend: BackendKind,
    /// `None`: the planner splits.
    pub num_splits: Option<usize>,
}

impl Prepared {
    /// What `auto` chooses a backend for. The chooser times forward
    /// kernels, so a decoding step stands as its equivalent forward
    /// problem: batch, seqlen_q query tokens against the longest sequence's
    /// keys after the append (at least 1), the step's heads and head dim.
    fn workload(&self) -> Result<Workload> {
        let p = &self.problem;
        let shape = AttentionShape::new(
            p.batch,
            p.seqlen_q,
            p.max_seqlen_k().max(1),
            p.heads_q,
            p.heads_kv,
            p.head_dim,
        )?;
        Ok(Workload::new(shape, p.precision, self.opts.clone()).operation(Operation::Decode))
    }
}

/// Decoding takes the band and score flags (ALiBi and sinks too), not the
/// layouts that index a call's own sequences.
fn layouts_unsupported(a: &crate::args::ScoreArgs) -> Result<()> {
    let given = [
        (a.block_mask.is_some(), "block-sparse masks (--block-mask)"),
        (
            a.cu_seqlens_q.is_some(),
            "packed batches (--cu-seqlens-q/-k)",
        ),
    ];
    match given.into_iter().find(|(on, _)| *on) {
        Some((_, feature)) => Err(flashattn::Error::Unsupported {
            what: "decoding",
            feature,
        }
        .into()),
        None => Ok(()),
    }
}

const TENSOR_DIMS: &str = "4 dims (batch, seqlen, heads, head_dim)";
const CACHE_DIMS: &str =
    "4 dims (batch_cache, capacity, heads_kv, head_dim), or (pages, page_size, heads_kv, head_dim) with --block-table";

/// A 4-d float tensor from `path`.
fn read4(what: &'static str, path: &Path, dims: &'static str) -> Result<Tensor> {
    let t = npy::read(what, path)?;
    if t.shape.len() != 4 {
        return Err(CliError::Rank {
            what,
            rank: t.shape.len(),
            shape: t.shape,
            expected: dims,
        });
    }
    Ok(t)
}

/// Without `--precision`, every tensor must have q's dtype.
fn same_dtype(q: &Tensor, others: &[(&'static str, &Tensor)]) -> Result<()> {
    for (tensor, t) in others {
        if t.precision() != q.precision() {
            return Err(flashattn::Error::DtypeMismatch {
                tensor,
                dtype: t.precision().name(),
                like: "q",
                expected: q.precision().name(),
            }
            .into());
        }
    }
    Ok(())
}

/// The index arrays: lengths, cache rows, block table (its rows must be
/// the batch).
fn read_indices(a: &DecodeArgs, batch: usize) -> Result<StepIndices> {
    let IndexArray { data: lens, .. } =
        npy::read_index("cache_seqlens", &a.cache_seqlens, 1, "1 dim (batch,)")?;
    let rows = a
        .cache_batch_idx
        .as_deref()
        .map(|p| npy::read_index("cache_batch_idx", p, 1, "1 dim (batch,)"))
        .transpose()?
        .map(|i| i.data);
    let table = match a.block_table.as_deref() {
        Some(p) => {
            let t = npy::read_index("block_table", p, 2, "2 dims (batch, max_pages)")?;
            if t.shape[0] != batch {
                return Err(flashattn::Error::DimMismatch {
                    dim: "batch",
                    tensor: "block_table",
                    value: t.shape[0],
                    other: "q",
                    other_value: batch,
                }
                .into());
            }
            Some((t.data, t.shape[1]))
        }
        None => None,
    };
    Ok((lens, rows, table))
}

type StepIndices = (Vec<i32>, Option<Vec<i32>>, Option<(Vec<i32>, usize)>);

/// Parse the flags, read every file and validate the step.
pub fn prepare(a: &DecodeArgs) -> Result<Prepared> {
    let Flags {
        opts,
        precision,
        fp8,
        backend,
        ..
    } = flags(&a.score)?;
    if fp8.is_some() {
        return Err(flashattn::Error::Fp8Unsupported {
            operation: "decoding",
        }
        .into());
    }
    layouts_unsupported(&a.score)?;
    let new_paths = pair((&a.k_new, "--k-new"), (&a.v_new, "--v-new"))?;
    pair(
        (&a.k_cache_out, "--k-cache-out"),
        (&a.v_cache_out, "--v-cache-out"),
    )?;
    let q = read4("q", &a.q, TENSOR_DIMS)?;
    let k_cache = read4("k_cache", &a.k_cache, CACHE_DIMS)?;
    let v_cache = read4("v_cache", &a.v_cache, CACHE_DIMS)?;
    let new_kv = match new_paths {
        Some((k, v)) => Some([
            read4("k_new", k, TENSOR_DIMS)?,
            read4("v_new", v, TENSOR_DIMS)?,
        ]),
        None => None,
    };
    let (cache_seqlens, cache_batch_idx, block_table) = read_indices(a, q.shape[0])?;
    let dtypes = FileDtypes {
        q: q.precision(),
        k_cache: k_cache.precision(),
        v_cache: v_cache.precision(),
    };
    if precision.is_none() {
        let mut others = vec![("k_cache", &k_cache), ("v_cache", &v_cache)];
        if let Some([k, v]) = &new_kv {
            others.extend([("k_new", k), ("v_new", v)]);
        }
        same_dtype(&q, &others)?;
    }
    let to = precision.unwrap_or(dtypes.q);
    let paged = block_table.is_some();
    let cache = HostKvCache::from_tensors(convert(k_cache, to), convert(v_cache, to), paged)?;
    let inputs = StepInputs {
        q: convert(q, to),
        cache_seqlens,
        cache_batch_idx,
        block_table,
        new_kv: new_kv.map(|kv| kv.map(|t| convert(t, to))),
    };
    let problem = DecodeProblem::new(&inputs.step()?, &cache.shape, cache.precision())?;
    let opts = super::layouts::read(&a.score, Default::default(), opts)?;
    opts.for_decoding(problem.batch, problem.heads_q)?;
    Ok(Prepared {
        inputs,
        cache,
        problem,
        dtypes,
        opts,
        backend,
        num_splits: (a.num_splits > 0).then_some(a.num_splits),
    })
}

pub fn run(a: DecodeArgs) -> Result<()> {
    let p = prepare(&a)?;
    let backend = open(p.backend, &p.workload()?)?;
    let step = p.inputs.step()?;
    let mut cache = p.cache;
    let out = backend.decode(&mut cache, &step, &p.opts, p.num_splits)?;
    super::attention::say_verified(&out.stats);
    let lse = out.lse_tensor();
    let o = output(out.o, p.dtypes.q);
    let mut outputs: Vec<(PathBuf, Tensor)> = vec![(a.out, o)];
    if let Some(path) = a.lse {
        outputs.push((path, lse));
    }
    if let (Some(k), Some(v)) = (a.k_cache_out, a.v_cache_out) {
        outputs.push((k, output(cache.k_tensor(), p.dtypes.k_cache)));
        outputs.push((v, output(cache.v_tensor(), p.dtypes.v_cache)));
    }
    let refs: Vec<(&Path, &Tensor)> = outputs.iter().map(|(p, t)| (p.as_path(), t)).collect();
    npy::write_all(&refs)
}

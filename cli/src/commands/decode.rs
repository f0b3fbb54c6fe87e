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
use crate::outputs;
use flashattn::{
    AttentionOptions, BackendKind, CacheQuant, CacheShape, DecodeProblem, DecodeStep, HostKvCache,
    Operation, Precision, QuantKvCache, QuantizedKv, Tensor, Workload,
};
use std::path::Path;

/// q, the index arrays and the new rows, in the precision of the step.
pub struct StepInputs {
    pub q: Tensor,
    pub cache_seqlens: Vec<i32>,
    pub cache_batch_idx: Option<Vec<i32>>,
    /// `(pages, max_pages)`, row-major `(batch, max_pages)`.
    pub block_table: Option<(Vec<i32>, usize)>,
    pub new_kv: Option<[Tensor; 2]>,
    /// A latent cache's new rows (`k_new` alone).
    pub new_latent: Option<Tensor>,
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
        if let Some(k) = &self.new_latent {
            step = step.append_latent(k.view()?);
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

/// The cache a step runs on: plain, or int8/FP8 codes with block scales.
pub enum StepCache {
    Plain(HostKvCache),
    Quant(QuantKvCache),
}

impl StepCache {
    fn shape(&self) -> &CacheShape {
        match self {
            StepCache::Plain(c) => &c.shape,
            StepCache::Quant(c) => &c.shape,
        }
    }
}

/// Everything a decoding step needs, validated.
pub struct Prepared {
    pub inputs: StepInputs,
    pub cache: StepCache,
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
    /// problem ([`DecodeProblem::widest_shape`](flashattn::DecodeProblem::widest_shape)).
    fn workload(&self) -> Result<Workload> {
        let p = &self.problem;
        let shape = p.widest_shape()?;
        let operation = match self.cache {
            StepCache::Plain(_) => Operation::Decode,
            StepCache::Quant(_) => Operation::QuantizedDecode,
        };
        Ok(Workload::new(shape, p.precision, self.opts.clone()).operation(operation))
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
    // A latent cache has no V of its own: its k flags stand alone.
    let latent = a.latent_v;
    let new_paths = match latent {
        Some(_) => None,
        None => pair((&a.k_new, "--k-new"), (&a.v_new, "--v-new"))?,
    };
    if latent.is_none() {
        pair(
            (&a.k_cache_out, "--k-cache-out"),
            (&a.v_cache_out, "--v-cache-out"),
        )?;
    }
    let quant = a
        .cache_precision
        .as_deref()
        .map(CacheQuant::parse)
        .transpose()?;
    // A latent cache's V reads K's codes and scales: its K flags alone.
    let (scales, scales_out) = match latent {
        Some(_) => (
            a.k_scales.as_ref().map(|k| (k, None)),
            a.k_scales_out.as_ref().map(|k| (k, None)),
        ),
        None => (
            pair((&a.k_scales, "--k-scales"), (&a.v_scales, "--v-scales"))?
                .map(|(k, v)| (k, Some(v))),
            pair(
                (&a.k_scales_out, "--k-scales-out"),
                (&a.v_scales_out, "--v-scales-out"),
            )?
            .map(|(k, v)| (k, Some(v))),
        ),
    };
    let (scales_flags, scales_out_flags) = match latent {
        Some(_) => ("--k-scales", "--k-scales-out"),
        None => (
            "--k-scales and --v-scales",
            "--k-scales-out and --v-scales-out",
        ),
    };
    let v_codes = match &a.v_cache {
        Some(v) => npy::holds_codes("v_cache", v)?,
        None => false,
    };
    let codes = npy::holds_codes("k_cache", &a.k_cache)? || v_codes;
    match (quant, codes, scales.is_some()) {
        (None, true, _) => {
            return Err(CliError::Needs {
                given: "a cache of int8 or uint8 codes",
                needs: "--cache-precision int8|fp8 and --k-scales/--v-scales",
            })
        }
        (Some(_), true, false) => {
            return Err(CliError::Needs {
                given: "a cache of codes",
                needs: scales_flags,
            })
        }
        (Some(_), false, true) => {
            return Err(CliError::Needs {
                given: "--k-scales/--v-scales",
                needs: "a cache of codes (int8, or uint8 for fp8)",
            })
        }
        _ => {}
    }
    if quant.is_some() && a.k_cache_out.is_some() && scales_out.is_none() {
        return Err(CliError::Needs {
            given: "--k-cache-out of a quantized cache",
            needs: scales_out_flags,
        });
    }
    if scales_out.is_some() && a.k_cache_out.is_none() {
        return Err(CliError::Needs {
            given: "--k-scales-out/--v-scales-out",
            needs: match latent {
                Some(_) => "--k-cache-out",
                None => "--k-cache-out and --v-cache-out",
            },
        });
    }
    let q = read4("q", &a.q, TENSOR_DIMS)?;
    let paged = a.block_table.is_some();
    // A cache of codes is read as codes; any other as floats.
    let v_path = || {
        a.v_cache.as_deref().ok_or(CliError::Needs {
            given: "a cache with a V of its own",
            needs: "--v-cache (or --latent-v for a latent cache)",
        })
    };
    let (k_cache, v_cache, code_cache) = match (quant, scales) {
        (Some(quant), Some((ks, vs))) => {
            let (k_shape, k) = npy::read_codes("k_cache", &a.k_cache, quant, CACHE_DIMS)?;
            let dims = |s: &[usize]| [s[0], s[1], s[2], s[3]];
            let (_, k_scales) = npy::read_f32("k_scales", ks)?;
            let k = QuantizedKv {
                codes: k,
                scales: k_scales,
            };
            let (shape, v) = match (latent, vs) {
                (Some(v_width), _) => (
                    latent_shape(dims(&k_shape), v_width, paged)?,
                    QuantizedKv::default(),
                ),
                (None, Some(vs)) => {
                    let (v_shape, v) = npy::read_codes("v_cache", v_path()?, quant, CACHE_DIMS)?;
                    let shape = CacheShape::from_kv_dims(dims(&k_shape), dims(&v_shape), paged)?;
                    let (_, v_scales) = npy::read_f32("v_scales", vs)?;
                    (
                        shape,
                        QuantizedKv {
                            codes: v,
                            scales: v_scales,
                        },
                    )
                }
                (None, None) => unreachable!("a cache with a V of its own takes both scales"),
            };
            (None, None, Some((quant, shape, k, v)))
        }
        _ if latent.is_some() => (Some(read4("k_cache", &a.k_cache, CACHE_DIMS)?), None, None),
        _ => (
            Some(read4("k_cache", &a.k_cache, CACHE_DIMS)?),
            Some(read4("v_cache", v_path()?, CACHE_DIMS)?),
            None,
        ),
    };
    let new_latent = match (latent, &a.k_new) {
        (Some(_), Some(k)) => Some(read4("k_new", k, TENSOR_DIMS)?),
        _ => None,
    };
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
        k_cache: k_cache.as_ref().map_or(q.precision(), Tensor::precision),
        v_cache: v_cache.as_ref().map_or(q.precision(), Tensor::precision),
    };
    if precision.is_none() {
        let mut others: Vec<(&'static str, &Tensor)> = Vec::new();
        if let (Some(k), Some(v)) = (&k_cache, &v_cache) {
            others.extend([("k_cache", k), ("v_cache", v)]);
        }
        if let Some([k, v]) = &new_kv {
            others.extend([("k_new", k), ("v_new", v)]);
        }
        if let (Some(k), None) = (&k_cache, &v_cache) {
            others.push(("k_cache", k));
        }
        if let Some(k) = &new_latent {
            others.push(("k_new", k));
        }
        same_dtype(&q, &others)?;
    }
    let to = precision.unwrap_or(dtypes.q);
    let cache = match (k_cache, v_cache, code_cache) {
        (_, _, Some((quant, shape, k, v))) => {
            StepCache::Quant(QuantKvCache::new(shape, quant, to, k, v)?)
        }
        (Some(k), Some(v), None) => {
            let plain = HostKvCache::from_tensors(convert(k, to), convert(v, to), paged)?;
            match quant {
                Some(quant) => StepCache::Quant(QuantKvCache::quantize(&plain, quant)?),
                None => StepCache::Plain(plain),
            }
        }
        (Some(k), None, None) => {
            // --latent-v: V is a view of this one tensor.
            let dims = [k.shape[0], k.shape[1], k.shape[2], k.shape[3]];
            let shape = latent_shape(dims, latent.unwrap_or(0), paged)?;
            let plain = HostKvCache::latent(shape, convert(k, to).data)?;
            match quant {
                Some(quant) => StepCache::Quant(QuantKvCache::quantize(&plain, quant)?),
                None => StepCache::Plain(plain),
            }
        }
        _ => unreachable!("a cache is read as codes or as floats"),
    };
    let inputs = StepInputs {
        q: convert(q, to),
        cache_seqlens,
        cache_batch_idx,
        block_table,
        new_kv: new_kv.map(|kv| kv.map(|t| convert(t, to))),
        new_latent: new_latent.map(|t| convert(t, to)),
    };
    let problem = DecodeProblem::new(&inputs.step()?, cache.shape(), to)?;
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

/// The latent cache of a K cache file's dims, V its first `v_width` columns.
fn latent_shape(dims: [usize; 4], v_width: usize, paged: bool) -> Result<CacheShape> {
    let s = CacheShape::from_dims(dims, paged)?;
    Ok(CacheShape::latent(
        s.layout, s.heads_kv, s.head_dim, v_width,
    )?)
}

pub fn run(a: DecodeArgs) -> Result<()> {
    outputs::check(&outputs::given(&[
        ("--out", Some(&a.out)),
        ("--lse", a.lse.as_ref()),
        ("--k-cache-out", a.k_cache_out.as_ref()),
        ("--v-cache-out", a.v_cache_out.as_ref()),
        ("--k-scales-out", a.k_scales_out.as_ref()),
        ("--v-scales-out", a.v_scales_out.as_ref()),
    ]))?;
    let p = prepare(&a)?;
    let backend = open(p.backend, &p.workload()?)?;
    let step = p.inputs.step()?;
    let mut cache = p.cache;
    let out = match &mut cache {
        StepCache::Plain(c) => backend.decode(c, &step, &p.opts, p.num_splits)?,
        StepCache::Quant(c) => backend.decode_quantized(c, &step, &p.opts, p.num_splits)?,
    };
    let lse = out.lse_tensor();
    let o = output(out.o, p.dtypes.q);
    let mut files: Vec<outputs::Output> = vec![("--out", &a.out, npy::encode(&o))];
    if let Some(path) = &a.lse {
        files.push(("--lse", path, npy::encode(&lse)));
    }
    // A latent cache writes its one tensor (--k-cache-out alone; a
    // quantized one its codes and --k-scales-out).
    if let (Some(k), true) = (&a.k_cache_out, cache.shape().latent) {
        match &cache {
            StepCache::Plain(c) => {
                let bytes = npy::encode(&output(c.k_tensor(), p.dtypes.k_cache));
                files.push(("--k-cache-out", k, bytes));
            }
            StepCache::Quant(c) => {
                let bytes = npy::encode_codes(&c.shape.dims(), &c.k.codes, c.quant);
                files.push(("--k-cache-out", k, bytes));
                if let Some(ks) = &a.k_scales_out {
                    let dims = [c.blocks().count() as u64, c.shape.heads_kv as u64];
                    files.push(("--k-scales-out", ks, npy::encode_array(&dims, &c.k.scales)));
                }
            }
        }
    }
    if let (Some(k), Some(v)) = (&a.k_cache_out, &a.v_cache_out) {
        match &cache {
            StepCache::Plain(c) => {
                let k_bytes = npy::encode(&output(c.k_tensor(), p.dtypes.k_cache));
                let v_bytes = npy::encode(&output(c.v_tensor(), p.dtypes.v_cache));
                files.push(("--k-cache-out", k, k_bytes));
                files.push(("--v-cache-out", v, v_bytes));
            }
            StepCache::Quant(c) => {
                let (s, quant) = (&c.shape, c.quant);
                let k_bytes = npy::encode_codes(&s.dims(), &c.k.codes, quant);
                let v_bytes = npy::encode_codes(&s.v_dims(), &c.v.codes, quant);
                files.push(("--k-cache-out", k, k_bytes));
                files.push(("--v-cache-out", v, v_bytes));
                if let (Some(ks), Some(vs)) = (&a.k_scales_out, &a.v_scales_out) {
                    let dims = [c.blocks().count() as u64, s.heads_kv as u64];
                    files.push(("--k-scales-out", ks, npy::encode_array(&dims, &c.k.scales)));
                    files.push(("--v-scales-out", vs, npy::encode_array(&dims, &c.v.scales)));
                }
            }
        }
    }
    outputs::write(files)?;
    // Said once the outputs are written: a failed command prints one line.
    super::attention::say_verified(&out.stats);
    Ok(())
}

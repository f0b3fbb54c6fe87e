//! Decoding on a device-resident KV cache (flash_attn_with_kvcache) with
//! cuda/flash_decode.cu: the cache — dense or paged, plain or of int8/FP8
//! codes with their block scales — stays in device memory between steps;
//! a step copies only its own inputs to the device (q, `k_new`/`v_new`,
//! the cache lengths, the page table, ALiBi slopes and sinks where given:
//! [`StepInputs`], counted into [`CallStats::uploaded_bytes`]), appends on
//! the device (`kv_append`, quantizing by docs/kv-quantization.md's rule
//! for a quantized cache), attends in splits (`flash_decode`, split-KV,
//! `num_splits` as asked or planned to fill the SMs) and merges the splits
//! by their log-sum-exp (`flash_decode_merge`, the sinks folded in there).
//! Each sequence's band is bottom-right aligned (`seqlen_k[b] =
//! cache_seqlens[b] + seqlen_new`), as docs/semantics.md asks.
//!
//! A latent cache ([`CacheShape::latent`], DeepSeek's MLA) is one device
//! buffer: `flash_decode` reads V through V's strides from K's buffer
//! ([`CacheShape::v_row_stride`], [`CacheShape::v_head_stride`]) and
//! `kv_append` writes a latent step's `k_new` alone.

use super::context::CudaDevice;
use super::driver_error::driver;
use super::jit::{timed, Launch};
use super::kernel::{Family, KernelKey, DECODE_KEYS, MAX_HEAD_DIM, DECODE_ROWS};
use super::problem::Problem;
use crate::api::decode::{CacheShape, DecodeOutput, DecodeProblem, DecodeStep, HostKvCache};
use crate::api::options::AttentionOptions;
use crate::api::output::{Allocation, CallStats, Timing};
use crate::api::tensor::{Precision, TensorData};
use crate::error::{Error, Result};
use crate::kv_quant::{CacheQuant, QuantKvCache, QuantizedKv, ScaleBlocks};
use std::borrow::Cow;
use std::sync::Arc;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig};

/// The most splits a step runs (the grid's z), and the planner's cap.
pub const MAX_SPLITS: usize = 128;

/// `struct DecodeArgs` of cuda/flash_decode.cu, field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct DecodeArgs {
    pages: u64,
    cache_lens: u64,
    alibi: u64,
    sinks: u64,
    batch: i32,
    seqlen_new: i32,
    max_pages: i32,
    page_size: i32,
    d_v: i32,
    keys_per_split: i32,
    alibi_batch_stride: i32,
    block_tokens: i32,
    v_row_stride: i32,
    v_head_stride: i32,
}

// SAFETY: a plain #[repr(C)] struct of 8- then 4-byte scalars, the C one's layout.
unsafe impl DeviceRepr for DecodeArgs {}

/// A KV cache in CUDA device memory (dense or paged, plain or quantized):
/// made by [`Cuda::kv_cache`](super::Cuda::kv_cache),
/// [`Cuda::upload_kv_cache`](super::Cuda::upload_kv_cache) or
/// [`Cuda::upload_quantized_kv_cache`](super::Cuda::upload_quantized_kv_cache),
/// stepped by [`Cuda::decode`](super::Cuda::decode) (which appends to it on
/// the device), read back by [`Cuda::read_kv_cache`](super::Cuda::read_kv_cache)
/// or [`Cuda::read_quantized_kv_cache`](super::Cuda::read_quantized_kv_cache).
pub struct CudaKvCache {
    shape: CacheShape,
    precision: Precision,
    quant: Option<CacheQuant>,
    k: CudaSlice<u8>,
    /// V's own storage; `None` in a latent cache, whose V is a view of `k`.
    v: Option<CudaSlice<u8>>,
    /// A quantized cache's `(blocks, heads_kv)` scales of K, and of V
    /// (`None` in a latent cache, whose V reads K's).
    scales: Option<(CudaSlice<f32>, Option<CudaSlice<f32>>)>,
}

impl std::fmt::Debug for CudaKvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaKvCache")
            .field("shape", &self.shape)
            .field("precision", &self.precision)
            .field("quant", &self.quant)
            .finish_non_exhaustive()
    }
}

impl CudaKvCache {
    /// The cache's shape.
    pub fn shape(&self) -> &CacheShape {
        &self.shape
    }

    /// The precision of its steps' q, `k_new`, `v_new` and o (a plain
    /// cache's storage too).
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The codes of a quantized cache (`None`: plain).
    pub fn quant(&self) -> Option<CacheQuant> {
        self.quant
    }

    /// Bytes it holds on the device: K and V, and a quantized cache's
    /// scales (a latent cache: K's alone, its V being a view of K).
    pub fn bytes(&self) -> usize {
        let scales = self.scales.as_ref().map_or(0, |(k, v)| 4 * (k.len() + v.as_ref().map_or(0, |v| v.len())));
        self.k.len() + self.v.as_ref().map_or(0, |v| v.len()) + scales
    }

    /// The buffer V is read from: its own, or K's in a latent cache.
    fn v_storage(&self) -> &CudaSlice<u8> {
        self.v.as_ref().unwrap_or(&self.k)
    }

    /// Elements per K and V code or value, in bytes.
    fn element_bytes(precision: Precision, quant: Option<CacheQuant>) -> usize {
        quant.map_or(precision.bytes(), |_| 1)
    }
}

/// An all-zero cache (a quantized one: every scale `MIN_CACHE_SCALE`).
pub(crate) fn alloc(
    dev: &CudaDevice,
    shape: CacheShape,
    precision: Precision,
    quant: Option<CacheQuant>,
) -> Result<CudaKvCache> {
    shape.checked()?;
    match quant {
        Some(q) => upload_quantized(dev, &QuantKvCache::zeros(shape, q, precision)),
        None => {
            let bytes = CudaKvCache::element_bytes(precision, None);
            let zeros = |n: usize| dev.stream.alloc_zeros::<u8>(n * bytes);
            Ok(CudaKvCache {
                shape,
                precision,
                quant: None,
                k: zeros(shape.len()).map_err(driver("allocating the k cache"))?,
                v: match shape.latent {
                    true => None,
                    false => Some(zeros(shape.v_len()).map_err(driver("allocating the v cache"))?),
                },
                scales: None,
            })
        }
    }
}

/// A host cache copied to the device.
pub(crate) fn upload(dev: &CudaDevice, host: &HostKvCache) -> Result<CudaKvCache> {
    host.shape.checked()?;
    host.check()?;
    let up = |t: &TensorData, dims: [usize; 4], during| {
        let bytes = t.view(dims).data.as_bytes();
        dev.stream.clone_htod(bytes).map_err(driver(during))
    };
    Ok(CudaKvCache {
        shape: host.shape,
        precision: host.precision(),
        quant: None,
        k: up(&host.k, host.shape.dims(), "uploading the k cache")?,
        v: match host.shape.latent {
            true => None,
            false => Some(up(&host.v, host.shape.v_dims(), "uploading the v cache")?),
        },
        scales: None,
    })
}

/// A quantized host cache (codes and scales) copied to the device.
pub(crate) fn upload_quantized(dev: &CudaDevice, host: &QuantKvCache) -> Result<CudaKvCache> {
    host.check()?;
    let s = &dev.stream;
    let up_codes = |c: &[u8], during| s.clone_htod(c).map_err(driver(during));
    let up_scales = |c: &[f32], during| s.clone_htod(c).map_err(driver(during));
    // A latent cache's V is a view of K's codes, at K's scales.
    let latent = host.shape.latent;
    Ok(CudaKvCache {
        shape: host.shape,
        precision: host.precision,
        quant: Some(host.quant),
        k: up_codes(&host.k.codes, "uploading the k codes")?,
        v: (!latent)
            .then(|| up_codes(&host.v.codes, "uploading the v codes"))
            .transpose()?,
        scales: Some((
            up_scales(&host.k.scales, "uploading the k scales")?,
            (!latent)
                .then(|| up_scales(&host.v.scales, "uploading the v scales"))
                .transpose()?,
        )),
    })
}

/// A plain device cache's contents on the host.
pub(crate) fn read(dev: &CudaDevice, cache: &CudaKvCache) -> Result<HostKvCache> {
    if cache.quant.is_some() {
        return Err(wrong_cache(cache, "a plain cache"));
    }
    let s = &dev.stream;
    let k = s.clone_dtoh(&cache.k).map_err(driver("reading the k cache"))?;
    let (shape, p) = (cache.shape, cache.precision);
    let k = TensorData::from_bytes(&k, p, shape.len())?;
    match &cache.v {
        None => HostKvCache::latent(shape, k),
        Some(v) => {
            let v = s.clone_dtoh(v).map_err(driver("reading the v cache"))?;
            HostKvCache::new(shape, k, TensorData::from_bytes(&v, p, shape.v_len())?)
        }
    }
}

/// A quantized device cache's codes and scales on the host.
pub(crate) fn read_quantized(dev: &CudaDevice, cache: &CudaKvCache) -> Result<QuantKvCache> {
    let (Some(quant), Some((ks, vs))) = (cache.quant, &cache.scales) else {
        return Err(wrong_cache(cache, "a quantized cache"));
    };
    let s = &dev.stream;
    let kv = |codes: &CudaSlice<u8>, scales: &CudaSlice<f32>| -> Result<QuantizedKv> {
        Ok(QuantizedKv {
            codes: s.clone_dtoh(codes).map_err(driver("reading cache codes"))?,
            scales: s.clone_dtoh(scales).map_err(driver("reading cache scales"))?,
        })
    };
    // A latent cache: K's codes and scales alone.
    let v = match (&cache.v, vs) {
        (Some(v), Some(vs)) => kv(v, vs)?,
        _ => QuantizedKv::default(),
    };
    QuantKvCache::new(cache.shape, quant, cache.precision, kv(&cache.k, ks)?, v)
}

/// The cache asked for is not this one's kind.
fn wrong_cache(cache: &CudaKvCache, expected: &'static str) -> Error {
    Error::CacheFormat {
        expected: expected.to_string(),
        found: match cache.quant {
            Some(q) => format!("{} codes", q.name()),
            None => format!("{} elements", cache.precision.name()),
        },
    }
}

/// Everything a step copies from the host, labelled: its own inputs
/// (q, the lengths, the page table, `k_new`/`v_new`, ALiBi slopes and
/// sinks where given), never the cache.
pub(crate) struct StepInputs<'a> {
    /// q, cache_seqlens and the page table, which every step copies.
    always: [(&'static str, Cow<'a, [u8]>); 3],
    /// `k_new`, `v_new`, slopes and sinks, where the step has them.
    optional: Vec<(&'static str, Cow<'a, [u8]>)>,
}

/// A step's inputs on the device.
struct StepBuffers {
    q: CudaSlice<u8>,
    cache_lens: CudaSlice<u8>,
    pages: CudaSlice<u8>,
    optional: Vec<(&'static str, CudaSlice<u8>)>,
}

impl StepBuffers {
    /// The device copy of optional part `label`, if the step has one.
    fn part(&self, label: &str) -> Option<&CudaSlice<u8>> {
        self.optional.iter().find(|(l, _)| *l == label).map(|(_, b)| b)
    }
}

impl<'a> StepInputs<'a> {
    /// The inputs of the validated step `p`.
    pub(crate) fn of(step: &'a DecodeStep, p: &DecodeProblem, opts: &'a AttentionOptions) -> Result<Self> {
        let ints = |what, x: &mut dyn Iterator<Item = usize>| -> Result<Cow<'a, [u8]>> {
            let mut bytes = Vec::new();
            for n in x {
                bytes.extend(to_i32(what, n)?.to_ne_bytes());
            }
            Ok(Cow::Owned(bytes))
        };
        let floats = |x: &[f32]| -> Cow<'a, [u8]> { Cow::Owned(x.iter().flat_map(|v| v.to_ne_bytes()).collect()) };
        let always = [
            ("q", Cow::Borrowed(step.q.data.as_bytes())),
            ("cache_seqlens", ints("cache_seqlens", &mut p.cache_lens.iter().copied())?),
            // As validated, every page a sequence's keys reach is inside the
            // cache (an i32 for the kernels); slots past them (-1 padding)
            // are never read.
            ("page table", Cow::Owned(p.table.pages.iter().flat_map(|v| v.to_ne_bytes()).collect())),
        ];
        let mut optional = Vec::new();
        if let Some([k, v]) = &step.new_kv {
            optional.push(("k_new", Cow::Borrowed(k.data.as_bytes())));
            optional.push(("v_new", Cow::Borrowed(v.data.as_bytes())));
        }
        // A latent cache's new rows: K's alone (its V view reads them).
        if let Some(k) = &step.new_latent {
            optional.push(("k_new", Cow::Borrowed(k.data.as_bytes())));
        }
        optional.extend(opts.alibi.as_ref().map(|a| ("ALiBi slopes", floats(a.slopes()))));
        optional.extend(opts.sinks.as_ref().map(|s| ("sinks", floats(s.logits()))));
        Ok(Self { always, optional })
    }

    /// Bytes of each copy, labelled.
    #[cfg(test)]
    pub(crate) fn copies(&self) -> Vec<(&'static str, usize)> {
        self.always
            .iter()
            .chain(&self.optional)
            .map(|(l, b)| (*l, b.len()))
            .collect()
    }

    /// Their sum: what a step moves host to device.
    #[cfg(test)]
    pub(crate) fn bytes(&self) -> u64 {
        self.copies().iter().map(|(_, n)| *n as u64).sum()
    }

    /// Every part copied to the device (the only host-to-device copies a
    /// step makes), and the bytes copied.
    fn upload(&self, s: &Arc<CudaStream>) -> Result<(StepBuffers, u64)> {
        let mut copied = 0;
        let mut up = |bytes: &[u8]| {
            copied += bytes.len() as u64;
            s.clone_htod(bytes).map_err(driver("uploading a decoding step's inputs"))
        };
        let [q, lens, pages] = &self.always;
        let mut bufs = StepBuffers {
            q: up(&q.1)?,
            cache_lens: up(&lens.1)?,
            pages: up(&pages.1)?,
            optional: Vec::new(),
        };
        for (label, bytes) in &self.optional {
            bufs.optional.push((*label, up(bytes)?));
        }
        Ok((bufs, copied))
    }
}

/// The splits of a step whose longest sequence has `keys` keys:
/// `(num_splits, keys_per_split)`. Asked (`Some(n > 0)`): `n` splits of
/// `⌈keys / n⌉` keys, fewer where the last would be empty; planned: enough
/// blocks (`blocks` per split) to fill `sms` SMs twice over, each split at
/// least [`DECODE_KEYS`] keys, at most [`MAX_SPLITS`].
pub fn splits(num_splits: Option<usize>, keys: usize, blocks: usize, sms: usize) -> (usize, usize) {
    let keys = keys.max(1);
    let wanted = match num_splits.filter(|&n| n > 0) {
        Some(n) => n.min(MAX_SPLITS),
        None => {
            let fill = (2 * sms).div_ceil(blocks.max(1)).max(1);
            fill.min((keys / DECODE_KEYS).max(1)).min(MAX_SPLITS)
        }
    };
    let per = keys.div_ceil(wanted);
    (keys.div_ceil(per), per)
}

fn to_i32(what: &'static str, n: usize) -> Result<i32> {
    i32::try_from(n).map_err(|_| Error::Overflow {
        what,
        value: n as u64,
    })
}

/// What a step launches with: its kernel key, arguments and grids.
struct Launches {
    key: KernelKey,
    problem: Problem,
    args: DecodeArgs,
    splits: usize,
    /// batch × seqlen_q.
    rows: usize,
    /// flash_decode_merge's: (rows, heads_q, 1).
    merge_grid: (u32, u32, u32),
    append_grid: Option<(u32, u32, u32)>,
    /// flash_decode's: (batch × chunks of the GQA group's rows, heads_kv, splits).
    decode_grid: (u32, u32, u32),
}

/// `n` as a grid dimension of at most `max`.
fn grid(what: &'static str, n: usize, max: u32) -> Result<u32> {
    u32::try_from(n).ok().filter(|&g| g <= max).ok_or(Error::GridTooLarge {
        what,
        groups: n as u64,
        max,
    })
}

/// The attention problem of the validated step `p` (its longest sequence's
/// keys), within the kernels' head dims.
fn attention_problem<'a>(p: &DecodeProblem, opts: &'a AttentionOptions) -> Result<crate::api::problem::Problem<'a>> {
    for (tensor, head_dim) in [("q/k", p.head_dim), ("v", p.head_dim_v)] {
        if head_dim > MAX_HEAD_DIM {
            return Err(Error::HeadDimTooLarge {
                tensor,
                head_dim,
                max: MAX_HEAD_DIM,
            });
        }
    }
    crate::api::problem::Problem::new(p.widest_shape()?, p.precision, opts)
}

/// kv_append's grid for the validated step `p` on a cache of `quant` codes
/// (scale blocks `blocks`): none without new rows; a block per new row of
/// a plain cache; per (scale block reached, kv head, sequence × {K, V}) of
/// a quantized one (× {K} of a latent one).
fn append_grid(p: &DecodeProblem, quant: Option<CacheQuant>, blocks: &ScaleBlocks) -> Result<Option<(u32, u32, u32)>> {
    Ok(match (p.seqlen_new, quant) {
        (0, _) => None,
        (n, None) => Some((grid("appended rows", p.batch * n, i32::MAX as u32)?, 1, 1)),
        (n, Some(_)) => {
            // The scale blocks a sequence's new tokens reach, in token order.
            let (bpp, page) = (blocks.per_page, blocks.page_size);
            let index = |t: usize| (t / page) * bpp + (t % page) / blocks.tokens;
            let most = (0..p.batch)
                .map(|b| index(p.cache_lens[b] + n - 1) - index(p.cache_lens[b]) + 1)
                .max()
                .unwrap_or(0);
            Some((
                grid("scale blocks appended to", most, i32::MAX as u32)?,
                grid("heads", p.heads_kv, 65535)?,
                grid("sequences × {K, V}", if p.cache.latent { 1 } else { 2 } * p.batch, 65535)?,
            ))
        }
    })
}

/// The kernels' problem and grids of the validated step `p`.
fn launches(
    sms: usize,
    quant: Option<CacheQuant>,
    p: &DecodeProblem,
    opts: &AttentionOptions,
    num_splits: Option<usize>,
) -> Result<Launches> {
    let attention = attention_problem(p, opts)?;
    let problem = Problem::of(&attention)?;
    let rows = p.batch * p.seqlen_q;
    let merge_grid = (
        grid("query rows", rows, i32::MAX as u32)?,
        grid("heads", p.heads_q, 65535)?,
        1,
    );
    // A decode block takes up to DECODE_ROWS of one kv head's group rows
    // (its query heads × seqlen_q), so the cache is read once per chunk.
    let chunks = (p.heads_q / p.heads_kv * p.seqlen_q).div_ceil(DECODE_ROWS);
    let x = grid("sequences × row chunks", p.batch * chunks, i32::MAX as u32)?;
    let (splits, per) = splits(num_splits, p.max_seqlen_k(), p.batch * chunks * p.heads_kv, sms);
    let decode_grid = (x, grid("kv heads", p.heads_kv, 65535)?, splits as u32);
    let blocks = ScaleBlocks::of(&p.cache);
    let alibi_batch_stride = match &opts.alibi {
        Some(a) if a.per_batch(p.heads_q) => to_i32("heads_q", p.heads_q)?,
        _ => 0,
    };
    let args = DecodeArgs {
        batch: to_i32("batch", p.batch)?,
        seqlen_new: to_i32("seqlen_new", p.seqlen_new)?,
        max_pages: to_i32("max_pages", p.table.max_pages)?,
        page_size: to_i32("page_size", p.table.page_size)?,
        d_v: to_i32("head_dim_v", p.head_dim_v)?,
        keys_per_split: to_i32("keys per split", per)?,
        alibi_batch_stride,
        block_tokens: to_i32("tokens per scale block", blocks.tokens)?,
        v_row_stride: to_i32("v row stride", p.cache.v_row_stride())?,
        v_head_stride: to_i32("v head stride", p.cache.v_head_stride())?,
        ..DecodeArgs::default()
    };
    // Cache rows and elements are size_t in the kernels; the rows of the
    // cache and the key positions are ints.
    to_i32("cache rows", p.cache.rows())?;
    let append_grid = append_grid(p, quant, &blocks)?;
    let key = KernelKey::new(
        Family::Decode,
        p.precision,
        p.head_dim.max(p.head_dim_v),
        attention.mask.is_active(),
        attention.softcap > 0.0,
    )
    .with_quant(quant);
    Ok(Launches {
        key,
        problem,
        args,
        splits,
        rows,
        append_grid,
        decode_grid,
        merge_grid,
    })
}

/// One step on a device cache. Validated first (the step against the
/// cache, the options, the new values finite for a quantized cache): on an
/// error nothing is copied or launched and the cache is untouched.
pub(crate) fn decode(
    dev: &CudaDevice,
    cache: &mut CudaKvCache,
    step: &DecodeStep,
    opts: &AttentionOptions,
    num_splits: Option<usize>,
) -> Result<DecodeOutput> {
    let p = validate(step, &cache.shape, cache.precision, cache.quant, opts)?;
    let l = launches(dev.props.sms, cache.quant, &p, opts, num_splits)?;
    let inputs = StepInputs::of(step, &p, opts)?;
    let s = &dev.stream;
    let (bufs, uploaded) = inputs.upload(s)?;
    let ptr = |b: Option<&CudaSlice<u8>>| b.map_or(0, |b| b.device_ptr(s).0);
    let args = DecodeArgs {
        pages: ptr(Some(&bufs.pages)),
        cache_lens: ptr(Some(&bufs.cache_lens)),
        alibi: ptr(bufs.part("ALiBi slopes")),
        sinks: ptr(bufs.part("sinks")),
        ..l.args
    };
    let mut out = StepOutputs::alloc(s, &l, &p)?;
    let seconds = timed(s, "running flash_decode", || run_kernels(dev, &l, cache, &bufs, &args, &mut out))?;
    let StepOutputs { part_o, part_lse, o, lse } = out;
    let o = s.clone_dtoh(&o).map_err(driver("reading o"))?;
    let lse = s.clone_dtoh(&lse).map_err(driver("reading lse"))?;
    let parts = part_lse.len();
    let o_bytes = p.o_len() * p.precision.bytes();
    drop((bufs, part_o, part_lse));
    let stats = CallStats {
        allocations: vec![
            Allocation {
                label: "splits' o and lse",
                bytes: (parts * (p.head_dim_v + 1) * 4) as u64,
            },
            Allocation {
                label: "o and lse",
                bytes: (o_bytes + 4 * p.lse_len()) as u64,
            },
        ],
        pieces: 1,
        dispatches: 2 + u32::from(l.append_grid.is_some()),
        kernel_seconds: seconds,
        timing: Timing::CudaEvents,
        uploaded_bytes: Some(uploaded),
        ..CallStats::default()
    };
    let o = TensorData::from_bytes(&o, p.precision, p.o_len())?;
    Ok(DecodeOutput::new(&p, o, lse, l.splits, stats))
}

/// A step's device outputs: the splits' o and lse (f32), and o and lse.
struct StepOutputs {
    part_o: CudaSlice<f32>,
    part_lse: CudaSlice<f32>,
    o: CudaSlice<u8>,
    lse: CudaSlice<f32>,
}

impl StepOutputs {
    /// Allocated for the validated step `p` launched as `l`.
    fn alloc(s: &Arc<CudaStream>, l: &Launches, p: &DecodeProblem) -> Result<Self> {
        let parts = l.splits * l.rows * p.heads_q;
        Ok(Self {
            part_o: s
                .alloc_zeros::<f32>(parts * p.head_dim_v)
                .map_err(driver("allocating the splits' o"))?,
            part_lse: s.alloc_zeros::<f32>(parts).map_err(driver("allocating the splits' lse"))?,
            o: s
                .alloc_zeros::<u8>(p.o_len() * p.precision.bytes())
                .map_err(driver("allocating o"))?,
            lse: s.alloc_zeros::<f32>(p.lse_len()).map_err(driver("allocating lse"))?,
        })
    }
}

/// A step's kernels queued on the device's stream: kv_append where the
/// step appends, flash_decode, flash_decode_merge (`args` with the step's
/// buffers' pointers set).
fn run_kernels(
    dev: &CudaDevice,
    l: &Launches,
    cache: &mut CudaKvCache,
    bufs: &StepBuffers,
    args: &DecodeArgs,
    out: &mut StepOutputs,
) -> Result<()> {
    let s = &dev.stream;
    let (append, attend, merge) = (
        dev.function(l.key, "kv_append")?,
        dev.function(l.key, "flash_decode")?,
        dev.function(l.key, "flash_decode_merge")?,
    );
    let cfg = |grid_dim| LaunchConfig {
        grid_dim,
        block_dim: (super::kernel::DECODE_THREADS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let splits_arg = to_i32("splits", l.splits)?;
    let null = 0u64;
    if let (Some(grid), Some(k_new)) = (l.append_grid, bufs.part("k_new")) {
        let mut launch = Launch::new(s, &append);
        launch.input(k_new);
        // A latent cache appends K's rows alone: v_new and its V null.
        match (bufs.part("v_new"), cache.v.as_mut()) {
            (Some(v_new), Some(v)) => launch.input(v_new).output(&mut cache.k).output(v),
            _ => launch.value(&null).output(&mut cache.k).value(&null),
        };
        match cache.scales.as_mut() {
            Some((k, Some(v))) => launch.output(k).output(v),
            // A latent cache's V scales are K's, never appended to.
            Some((k, None)) => launch.output(k).value(&null),
            None => launch.value(&null).value(&null),
        };
        launch.value(&l.problem).value(args);
        // SAFETY: kv_append's arguments in order (new rows, the cache's
        // K and V (null with v_new in a latent cache, validated to append
        // k_new alone), its scales or null, Problem and DecodeArgs by value);
        // the new rows hold batch × seqlen_new rows, every cache row the
        // page table names is inside the cache (validated), and the
        // buffers outlive the wait in `timed`.
        unsafe { launch.launch(cfg(grid), "launching kv_append") }?;
    }
    let mut launch = Launch::new(s, &attend);
    launch.input(&bufs.q).input(&cache.k).input(cache.v_storage());
    match cache.scales.as_ref() {
        Some((k, v)) => launch.input(k).input(v.as_ref().unwrap_or(k)),
        None => launch.value(&null).value(&null),
    };
    launch
        .output(&mut out.part_o)
        .output(&mut out.part_lse)
        .value(&l.problem)
        .value(args);
    // SAFETY: flash_decode's arguments in order; the partials hold
    // splits × rows × heads_q rows, the grid is (batch × row chunks,
    // heads_kv, splits), and every key a block reads is below its
    // sequence's seqlen_k, inside its pages, and V is read through the
    // cache's V strides (K's buffer and strides in a latent cache).
    unsafe { launch.launch(cfg(l.decode_grid), "launching flash_decode") }?;
    let mut launch = Launch::new(s, &merge);
    launch
        .input(&out.part_o)
        .input(&out.part_lse)
        .output(&mut out.o)
        .output(&mut out.lse)
        .value(&l.problem)
        .value(args)
        .value(&splits_arg);
    // SAFETY: flash_decode_merge's arguments in order; the grid is
    // (rows, heads_q), o and lse hold the step's rows.
    unsafe { launch.launch(cfg(l.merge_grid), "launching flash_decode_merge") }
}

/// The step checked against a cache of `shape`, `precision` and `quant`
/// codes, under `opts` (a quantized cache's new values finite).
fn validate(
    step: &DecodeStep,
    shape: &CacheShape,
    precision: Precision,
    quant: Option<CacheQuant>,
    opts: &AttentionOptions,
) -> Result<DecodeProblem> {
    opts.validate()?;
    let p = DecodeProblem::new(step, shape, precision)?;
    opts.for_decoding(p.batch, p.heads_q)?;
    if quant.is_some() {
        crate::kv_quant::check_new_finite(step)?;
    }
    Ok(p)
}

/// A host cache, plain or quantized (host emulation's input).
#[cfg(feature = "lab")]
#[derive(Clone, Copy, Debug)]
pub enum HostCache<'a> {
    /// Of the step's precision.
    Plain(&'a HostKvCache),
    /// Of int8 or FP8 codes.
    Quant(&'a QuantKvCache),
}

/// One step's kernels as host emulation runs them (tests/cuda.rs with
/// cuda/emulate/decode.cpp): the variant, and the launches' inputs as
/// blobs in the harness's order — `Problem`, `DecodeArgs` (pointers
/// unset), the grids `[append x, y, z, decode x, y, z, rows, heads_q]`
/// (flash_decode's z is the splits; the merge's grid is (rows, heads_q)), q, `k_new`,
/// `v_new`, the cache's K and V (V empty in a latent cache: the harness
/// reads V from K's blob, as a device step reads it from K's buffer), their scales, cache_seqlens, the page
/// table, ALiBi slopes, sinks (empty where absent) — all computed by the
/// code a device step runs, with `sms` SMs for the planner.
#[cfg(feature = "lab")]
pub fn emulated_step(
    cache: HostCache,
    step: &DecodeStep,
    opts: &AttentionOptions,
    num_splits: Option<usize>,
    sms: usize,
) -> Result<EmulatedStep> {
    let CacheBlobs {
        shape,
        precision,
        quant,
        k,
        v,
        scales,
    } = CacheBlobs::of(cache)?;
    let p = validate(step, &shape, precision, quant, opts)?;
    let l = launches(sms, quant, &p, opts, num_splits)?;
    let inputs = StepInputs::of(step, &p, opts)?;
    let raw = |x: &[u8]| x.to_vec();
    // SAFETY (of the reads): both are plain #[repr(C)] structs of scalars.
    let problem = unsafe {
        std::slice::from_raw_parts((&l.problem as *const Problem).cast::<u8>(), std::mem::size_of::<Problem>())
    };
    let args = unsafe {
        std::slice::from_raw_parts((&l.args as *const DecodeArgs).cast::<u8>(), std::mem::size_of::<DecodeArgs>())
    };
    let (ax, ay, az) = l.append_grid.unwrap_or((0, 0, 0));
    let (dx, dy, dz) = l.decode_grid;
    let grids = [ax, ay, az, dx, dy, dz, l.rows as u32, p.heads_q as u32]
        .map(|n| n as i32)
        .iter()
        .flat_map(|v| v.to_ne_bytes())
        .collect();
    let part = |label| {
        inputs
            .always
            .iter()
            .chain(&inputs.optional)
            .find(|(l, _)| *l == label)
            .map_or(Vec::new(), |(_, b)| b.to_vec())
    };
    let [ks, vs] = scales;
    let blobs = vec![
        raw(problem),
        raw(args),
        grids,
        part("q"),
        part("k_new"),
        part("v_new"),
        k,
        v,
        ks,
        vs,
        part("cache_seqlens"),
        part("page table"),
        part("ALiBi slopes"),
        part("sinks"),
    ];
    Ok(EmulatedStep {
        key: l.key,
        blobs,
        problem: p,
        splits: l.splits,
    })
}

/// A host cache as the harness's blobs: K, V (empty in a latent cache)
/// and their scales (empty in a plain cache), checked as an upload checks.
#[cfg(feature = "lab")]
struct CacheBlobs {
    shape: CacheShape,
    precision: Precision,
    quant: Option<CacheQuant>,
    k: Vec<u8>,
    v: Vec<u8>,
    scales: [Vec<u8>; 2],
}

#[cfg(feature = "lab")]
impl CacheBlobs {
    fn of(cache: HostCache) -> Result<Self> {
        let f32_bytes = |x: &[f32]| -> Vec<u8> { x.iter().flat_map(|v| v.to_ne_bytes()).collect() };
        // As the uploads check.
        match cache {
            HostCache::Plain(c) => c.check()?,
            HostCache::Quant(c) => c.check()?,
        }
        Ok(match cache {
            HostCache::Plain(c) => Self {
                shape: c.shape,
                precision: c.precision(),
                quant: None,
                k: c.k.view(c.shape.dims()).data.as_bytes().to_vec(),
                // A latent cache's V is K's storage: no blob of its own.
                v: match c.shape.latent {
                    true => Vec::new(),
                    false => c.v.view(c.shape.v_dims()).data.as_bytes().to_vec(),
                },
                scales: [Vec::new(), Vec::new()],
            },
            HostCache::Quant(c) => Self {
                shape: c.shape,
                precision: c.precision,
                quant: Some(c.quant),
                k: c.k.codes.clone(),
                v: c.v.codes.clone(),
                scales: [f32_bytes(&c.k.scales), f32_bytes(&c.v.scales)],
            },
        })
    }
}

/// [`emulated_step`]'s result.
#[cfg(feature = "lab")]
#[derive(Debug)]
pub struct EmulatedStep {
    /// The decode variant the step runs.
    pub key: KernelKey,
    /// The harness's inputs, in its order.
    pub blobs: Vec<Vec<u8>>,
    /// The validated step.
    pub problem: DecodeProblem,
    /// The splits it runs in.
    pub splits: usize,
}

/// A step on a host cache: uploaded once, the same kernels, and the cache
/// read back (in place) when the step appends. Validated before any copy.
pub(crate) fn decode_host(
    dev: &CudaDevice,
    host: &mut HostKvCache,
    step: &DecodeStep,
    opts: &AttentionOptions,
    num_splits: Option<usize>,
) -> Result<DecodeOutput> {
    host.check()?;
    check_before_upload(step, &host.shape, host.precision(), opts)?;
    let mut cache = upload(dev, host)?;
    let out = decode(dev, &mut cache, step, opts, num_splits)?;
    // (A latent step's new rows too: `appends`.)
    if step.appends() {
        *host = read(dev, &cache)?;
    }
    Ok(out)
}

/// [`decode_host`] on a quantized host cache (its codes and scales read
/// back when the step appends).
pub(crate) fn decode_quantized_host(
    dev: &CudaDevice,
    host: &mut QuantKvCache,
    step: &DecodeStep,
    opts: &AttentionOptions,
    num_splits: Option<usize>,
) -> Result<DecodeOutput> {
    host.check()?;
    check_before_upload(step, &host.shape, host.precision, opts)?;
    let mut cache = upload_quantized(dev, host)?;
    let out = decode(dev, &mut cache, step, opts, num_splits)?;
    if step.appends() {
        *host = read_quantized(dev, &cache)?;
    }
    Ok(out)
}

/// The step's checks that need no device, before a host cache is copied.
fn check_before_upload(
    step: &DecodeStep,
    shape: &CacheShape,
    precision: Precision,
    opts: &AttentionOptions,
) -> Result<()> {
    opts.validate()?;
    let p = DecodeProblem::new(step, shape, precision)?;
    opts.for_decoding(p.batch, p.heads_q)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::decode::CacheLayout;
    use crate::api::tensor::TensorView;

    /// The C struct is four pointers then ten ints.
    #[test]
    fn decode_args_have_the_c_struct_layout() {
        assert_eq!(std::mem::size_of::<DecodeArgs>(), 4 * 8 + 10 * 4);
        assert_eq!(std::mem::offset_of!(DecodeArgs, batch), 32);
        assert_eq!(std::mem::offset_of!(DecodeArgs, block_tokens), 60);
        assert_eq!(std::mem::offset_of!(DecodeArgs, v_head_stride), 68);
    }

    /// Asked splits are honoured (fewer only where the last would be
    /// empty); planned ones fill the SMs, at least DECODE_KEYS keys each.
    #[test]
    fn splits_are_asked_or_fill_the_device() {
        assert_eq!(splits(Some(3), 100, 8, 132), (3, 34));
        assert_eq!(splits(Some(1), 100, 8, 132), (1, 100));
        // 4 keys cannot make 5 splits of one key... they make 4.
        assert_eq!(splits(Some(5), 4, 8, 132), (4, 1));
        // 8 blocks per split, 132 SMs: 33 wanted, 4096 keys allow 64.
        assert_eq!(splits(None, 4096, 8, 132), (33, 125));
        // Short sequences: one split per DECODE_KEYS keys at most.
        assert_eq!(splits(None, 130, 8, 132), (2, 65));
        // Enough blocks already: one split.
        assert_eq!(splits(None, 4096, 1024, 132).0, 1);
        assert_eq!(splits(Some(1000), 1 << 20, 1, 1).0, MAX_SPLITS);
        assert_eq!(splits(None, 0, 1, 1), (1, 1));
    }

    /// A step copies q, the new rows, the lengths and the page table (and
    /// the options' slopes and sinks), never the cache: the same bytes for
    /// a cache 64 times larger.
    #[test]
    fn a_step_copies_its_inputs_and_never_the_cache() {
        let (batch, heads_q, heads_kv, d) = (2, 4, 2, 32);
        let q = vec![0.5f32; batch * heads_q * d];
        let new = vec![0.25f32; batch * heads_kv * d];
        let lens = [3, 9];
        for capacity in [16, 1024] {
            let shape = CacheShape::new(CacheLayout::Dense { batch, capacity }, heads_kv, d).unwrap();
            let step = DecodeStep::new(TensorView::f32([batch, 1, heads_q, d], &q), &lens).append(
                TensorView::f32([batch, 1, heads_kv, d], &new),
                TensorView::f32([batch, 1, heads_kv, d], &new),
            );
            let p = DecodeProblem::new(&step, &shape, Precision::F32).unwrap();
            let opts = AttentionOptions::default();
            let inputs = StepInputs::of(&step, &p, &opts).unwrap();
            let expected = 4 * (q.len() + 2 * new.len()) + 4 * batch + 4 * batch;
            assert_eq!(inputs.bytes(), expected as u64, "{:?}", inputs.copies());
            let labels: Vec<_> = inputs.copies().iter().map(|(l, _)| *l).collect();
            assert_eq!(labels, ["q", "cache_seqlens", "page table", "k_new", "v_new"]);
        }
    }
}

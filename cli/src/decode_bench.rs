//! `flashattn bench --decode`: one decoding step (one query token per
//! sequence, no append) against full dense KV caches, timed on wgpu, on
//! CUDA (with the `cuda` feature) and on the CPU backend, with the
//! planner's splits and with one split, next to the copy bandwidth
//! measured in the same run — decoding reads each K/V element once, so its
//! effective bandwidth, `2 · Σ seqlen_k · heads_kv · head_dim · bytes /
//! time`, is what it is held against.
//!
//! Timing: on wgpu the cache is uploaded once (`Engine::upload_kv_cache`)
//! and stays on the device between repeats; a step's time is its kernel
//! time (the decode and merge submission; q's upload and o's readback are
//! not counted), as the forward bench times kernels. On CUDA the same: the
//! cache is uploaded once (`Cuda::upload_kv_cache`, a `CudaKvCache`), each
//! step runs `Cuda::decode` on it and its time is the step's CUDA events
//! around the kernels (the wall time of the call, which waits for o, where
//! a step reports no kernel time); the yardstick is the driver's
//! device-to-device copy (`Cuda::copy_bandwidth`). On the CPU it is the
//! wall time of `flashattn::cpu::decode`. Nothing is appended in the timed
//! steps, so every repeat decodes the same cache. The `torch` backend is
//! the outside baseline: torch's `scaled_dot_product_attention` on the CPU
//! with `enable_gqa=True`, on caches of the same dtype in torch's own
//! contiguous `(batch, heads, seqlen, d)` layout, timed in the same run by
//! `cli/src/baselines.py` (one row per group: splits do not apply).

use crate::baselines::Baselines;
use crate::error::{one_line, CliError, Result};

use flashattn::{
    cpu, AttentionOptions, CacheLayout, CacheQuant, CacheShape, DecodeStep, Engine, HostKvCache,
    KvCache, Precision, QuantKvCache, TensorData, Timing, SCALE_BLOCK_TOKENS,
};
use rayon::prelude::*;
use serde::Serialize;
use std::time::Instant;

/// Where a configuration runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum DecodeBackend {
    Wgpu,
    Cpu,
    /// The CUDA backend on device 0 (builds with the `cuda` feature).
    Cuda,
    /// torch's SDPA on the CPU (the outside baseline).
    Torch,
}

impl DecodeBackend {
    pub fn name(self) -> &'static str {
        match self {
            DecodeBackend::Wgpu => "wgpu",
            DecodeBackend::Cpu => "cpu",
            DecodeBackend::Cuda => "cuda",
            DecodeBackend::Torch => "torch",
        }
    }
}

impl std::str::FromStr for DecodeBackend {
    type Err = CliError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "wgpu" => Ok(DecodeBackend::Wgpu),
            "cpu" => Ok(DecodeBackend::Cpu),
            "cuda" => Ok(DecodeBackend::Cuda),
            "torch" => Ok(DecodeBackend::Torch),
            other => Err(CliError::BadFlag {
                flag: "--backends",
                expected: "wgpu, cpu, cuda or torch",
                value: other.to_string(),
            }),
        }
    }
}

/// How many splits a configuration asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SplitMode {
    /// `num_splits = 0`: the planner chooses.
    Planner,
    /// `num_splits = n`, n ≥ 1 (kept within whole blocks; the loop limit may
    /// raise it).
    Fixed(usize),
}

impl SplitMode {
    pub fn name(self) -> String {
        match self {
            SplitMode::Planner => "planner".into(),
            SplitMode::Fixed(n) => n.to_string(),
        }
    }

    fn num_splits(self) -> Option<usize> {
        match self {
            SplitMode::Planner => None,
            SplitMode::Fixed(n) => Some(n),
        }
    }
}

impl Serialize for SplitMode {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.serialize_str(&self.name())
    }
}

impl std::str::FromStr for SplitMode {
    type Err = CliError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "planner" | "0" => Ok(SplitMode::Planner),
            n => match n.parse::<usize>() {
                Ok(n) if n > 0 => Ok(SplitMode::Fixed(n)),
                _ => Err(CliError::BadFlag {
                    flag: "--splits",
                    expected: "planner or a positive number of splits",
                    value: n.to_string(),
                }),
            },
        }
    }
}

/// A cache's dtype as `--dtypes` names it: a plain cache of f32, f16 or
/// bf16 (the step's dtype too), or an int8 or FP8 cache of f16 steps.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheDtype {
    /// The step's precision (q, o), and a plain cache's.
    pub precision: Precision,
    /// The codes of a quantized cache.
    pub quant: Option<CacheQuant>,
}

impl CacheDtype {
    pub fn name(self) -> &'static str {
        self.quant.map_or(self.precision.name(), CacheQuant::name)
    }

    /// Bytes per cached element (a quantized cache's scales apart).
    fn bytes(self) -> usize {
        self.quant.map_or(self.precision.bytes(), |_| 1)
    }
}

impl std::str::FromStr for CacheDtype {
    type Err = CliError;
    fn from_str(s: &str) -> Result<Self> {
        if let Ok(quant) = CacheQuant::parse(s) {
            return Ok(Self {
                precision: Precision::F16,
                quant: Some(quant),
            });
        }
        let precision = s.parse::<Precision>().map_err(|_| CliError::BadFlag {
            flag: "--dtypes",
            expected: "f32, f16, bf16, int8 or fp8, comma-separated",
            value: s.to_string(),
        })?;
        Ok(Self {
            precision,
            quant: None,
        })
    }
}

/// DeepSeek's MLA latent cache (`bench --decode --mla`): rows of this width...
pub const MLA_WIDTH: usize = 576;
/// ...whose first this many columns are V.
pub const MLA_V_WIDTH: usize = 512;

/// One table row's configuration.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct DecodeConfig {
    pub backend: DecodeBackend,
    pub batch: usize,
    /// Keys per sequence (the caches are full).
    pub cache_len: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    /// A latent cache's V width (V the first columns of K's rows).
    pub latent_v: Option<usize>,
    #[serde(serialize_with = "precision_name")]
    pub precision: Precision,
    /// A quantized cache's codes (its steps in `precision`).
    #[serde(serialize_with = "quant_name")]
    pub cache: Option<CacheQuant>,
    pub splits: SplitMode,
}

fn quant_name<S: serde::Serializer>(
    q: &Option<CacheQuant>,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(q.map_or("plain", CacheQuant::name))
}

fn precision_name<S: serde::Serializer>(
    p: &Precision,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(p.name())
}

impl DecodeConfig {
    /// The cache's dtype.
    pub fn dtype(&self) -> CacheDtype {
        CacheDtype {
            precision: self.precision,
            quant: self.cache,
        }
    }

    /// Bytes of K and V one step reads: `2 · batch · cache_len · heads_kv ·
    /// head_dim · bytes per element` (a latent cache's one tensor: half
    /// that), plus a quantized cache's scales (one f32 per 16 tokens and
    /// kv head, of each tensor).
    pub fn kv_bytes(&self) -> u64 {
        let tensors = if self.latent_v.is_some() { 1 } else { 2 };
        let rows = tensors * self.batch * self.cache_len * self.heads_kv;
        let scales = match self.cache {
            Some(_) => {
                tensors
                    * self.batch
                    * self.cache_len.div_ceil(SCALE_BLOCK_TOKENS)
                    * self.heads_kv
                    * 4
            }
            None => 0,
        };
        (rows * self.head_dim * self.dtype().bytes() + scales) as u64
    }
}

/// What one configuration measured; a failure (a cache past one storage
/// binding, say) is a result too.
#[derive(Clone, Debug, Serialize)]
pub struct DecodeResult {
    #[serde(flatten)]
    pub config: DecodeConfig,
    /// Seconds of each timed repeat (kernel time on wgpu and CUDA, wall
    /// time on the CPU).
    pub seconds: Vec<f64>,
    /// The clock the seconds come from (`Timing::describe`).
    pub clock: Option<&'static str>,
    /// The splits the step ran with.
    pub num_splits: Option<usize>,
    pub kv_bytes: u64,
    pub error: Option<String>,
}

impl DecodeResult {
    pub fn min_seconds(&self) -> Option<f64> {
        self.seconds.iter().copied().reduce(f64::min)
    }

    pub fn median_seconds(&self) -> Option<f64> {
        let mut s = self.seconds.clone();
        s.sort_by(|a, b| a.total_cmp(b));
        s.get(s.len() / 2).copied()
    }

    /// Effective K/V read bandwidth of the fastest repeat, GB/s (10⁹ bytes).
    pub fn gbps(&self) -> Option<f64> {
        self.min_seconds().map(|t| self.kv_bytes as f64 / t / 1e9)
    }
}

/// The configurations of one run.
#[derive(Clone, Debug)]
pub struct DecodeSet {
    pub backends: Vec<DecodeBackend>,
    pub batches: Vec<usize>,
    pub cache_lens: Vec<usize>,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    /// A latent cache (`--mla`): V the first this many columns of K.
    pub latent_v: Option<usize>,
    pub dtypes: Vec<CacheDtype>,
    /// The split modes each backend runs, in order.
    pub splits: Vec<SplitMode>,
    /// Skip a (batch, cache length) whose batch × length exceeds this (0: none).
    pub max_tokens: usize,
    pub repeats: usize,
}

/// One cache size and dtype: every backend and split mode of it runs on
/// the same data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Group {
    pub batch: usize,
    pub cache_len: usize,
    pub dtype: CacheDtype,
}

impl DecodeSet {
    /// The groups to run (batch-major, then cache length, then dtype) and
    /// the (batch, cache length) pairs skipped by `max_tokens`.
    pub fn groups(&self) -> (Vec<Group>, Vec<(usize, usize)>) {
        let (mut run, mut skipped) = (Vec::new(), Vec::new());
        for &batch in &self.batches {
            for &cache_len in &self.cache_lens {
                if self.max_tokens > 0 && batch * cache_len > self.max_tokens {
                    skipped.push((batch, cache_len));
                    continue;
                }
                for &dtype in &self.dtypes {
                    run.push(Group {
                        batch,
                        cache_len,
                        dtype,
                    });
                }
            }
        }
        (run, skipped)
    }

    /// The split modes `backend` runs: all of them, or the first for torch
    /// (which has none).
    fn modes(&self, backend: DecodeBackend) -> &[SplitMode] {
        match backend {
            DecodeBackend::Torch => &self.splits[..self.splits.len().min(1)],
            _ => &self.splits,
        }
    }

    fn config(&self, g: &Group, backend: DecodeBackend, splits: SplitMode) -> DecodeConfig {
        DecodeConfig {
            backend,
            batch: g.batch,
            cache_len: g.cache_len,
            heads_q: self.heads_q,
            heads_kv: self.heads_kv,
            head_dim: self.head_dim,
            latent_v: self.latent_v,
            precision: g.dtype.precision,
            cache: g.dtype.quant,
            splits,
        }
    }
}

/// Seeded values in [-1, 1), filled in parallel (caches run to GiBs).
pub fn fill(n: usize, seed: u64) -> Vec<f32> {
    let mut v = vec![0f32; n];
    v.par_chunks_mut(1 << 16)
        .enumerate()
        .for_each(|(c, chunk)| {
            let mut x = (seed ^ (c as u64 + 1)).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            for e in chunk {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                *e = (x >> 40) as f32 / (1u64 << 23) as f32 - 1.0;
            }
        });
    v
}

/// The data of one group: full caches, one query token per sequence.
struct GroupData {
    cache: HostKvCache,
    q: TensorData,
    q_shape: [usize; 4],
    lens: Vec<i32>,
}

impl GroupData {
    fn new(set: &DecodeSet, g: &Group) -> Result<Self> {
        let layout = CacheLayout::Dense {
            batch: g.batch,
            capacity: g.cache_len,
        };
        let seed = (g.batch * 1_000_003 + g.cache_len) as u64;
        let cache = match set.latent_v {
            Some(v_width) => {
                let shape = CacheShape::latent(layout, set.heads_kv, set.head_dim, v_width)?;
                let k = TensorData::from_f32(fill(shape.len(), seed), g.dtype.precision);
                HostKvCache::latent(shape, k)?
            }
            None => {
                let shape = CacheShape::new(layout, set.heads_kv, set.head_dim)?;
                let data = |s| TensorData::from_f32(fill(shape.len(), s), g.dtype.precision);
                HostKvCache::new(shape, data(seed), data(seed + 1))?
            }
        };
        let q_shape = [g.batch, 1, set.heads_q, set.head_dim];
        let q = TensorData::from_f32(fill(q_shape.iter().product(), seed + 2), g.dtype.precision);
        let len = i32::try_from(g.cache_len).map_err(|_| CliError::BadFlag {
            flag: "--cache-lens",
            expected: "lengths that fit in int32",
            value: g.cache_len.to_string(),
        })?;
        Ok(Self {
            cache,
            q,
            q_shape,
            lens: vec![len; g.batch],
        })
    }

    fn step(&self) -> DecodeStep<'_> {
        DecodeStep::new(self.q.view(self.q_shape), &self.lens)
    }
}

/// One timed step: its seconds, the splits it ran with and the clock.
struct Timed {
    seconds: f64,
    splits: usize,
    clock: Timing,
}

impl Timed {
    /// A step timed by the wall clock around it.
    fn wall(start: Instant, splits: usize) -> Self {
        Self {
            seconds: start.elapsed().as_secs_f64(),
            splits,
            clock: Timing::WallClock,
        }
    }
}

/// Run `once` untimed, then `repeats` times timed, into a result.
fn measure(
    config: DecodeConfig,
    repeats: usize,
    mut once: impl FnMut() -> Result<Timed>,
) -> DecodeResult {
    let mut r = DecodeResult {
        config,
        seconds: Vec::new(),
        clock: None,
        num_splits: None,
        kv_bytes: config.kv_bytes(),
        error: None,
    };
    for i in 0..=repeats {
        match once() {
            Ok(t) => {
                r.num_splits = Some(t.splits);
                r.clock = Some(t.clock.describe());
                if i > 0 {
                    r.seconds.push(t.seconds);
                }
            }
            Err(e) => {
                r.error = Some(one_line(&e));
                r.seconds.clear();
                break;
            }
        }
    }
    r
}

/// The CUDA backend of a run, opened once: its rows' device, or why they
/// cannot run.
#[cfg(feature = "cuda")]
pub type CudaBackend = std::result::Result<flashattn::cuda::Cuda, flashattn::Error>;

/// What a run's rows run on, each opened once for the run.
#[derive(Clone, Copy, Default)]
pub struct Devices<'a> {
    /// The wgpu engine (none: no adapter).
    pub engine: Option<&'a Engine>,
    /// torch's baselines (none: torch was not asked for).
    pub baselines: Option<&'a Baselines>,
    /// The CUDA backend (none: CUDA was not asked for).
    #[cfg(feature = "cuda")]
    pub cuda: Option<&'a CudaBackend>,
}

/// One group's data, its quantized cache where the dtype has codes, and
/// the row configurations of one backend.
struct Rows<'a> {
    set: &'a DecodeSet,
    group: &'a Group,
    data: &'a GroupData,
    quantized: Option<&'a QuantKvCache>,
    backend: DecodeBackend,
}

impl Rows<'_> {
    fn config(&self, m: SplitMode) -> DecodeConfig {
        self.set.config(self.group, self.backend, m)
    }

    /// Every split mode of the backend, failed with `e`.
    fn failed(&self, e: &dyn std::error::Error) -> Vec<DecodeResult> {
        let modes = self.set.modes(self.backend);
        modes
            .iter()
            .map(|&m| error_result(self.config(m), e))
            .collect()
    }

    /// Every split mode of the backend, each step timed by `step`.
    fn each_mode(&self, mut step: impl FnMut(Option<usize>) -> Result<Timed>) -> Vec<DecodeResult> {
        let modes = self.set.modes(self.backend);
        let repeats = self.set.repeats;
        modes
            .iter()
            .map(|&m| measure(self.config(m), repeats, || step(m.num_splits())))
            .collect()
    }
}

/// Every backend and split mode of group `g`, on one set of data.
pub fn run_group(devices: &Devices, set: &DecodeSet, g: &Group) -> Vec<DecodeResult> {
    let data = match GroupData::new(set, g) {
        Ok(d) => d,
        Err(e) => return failed(set, g, &e),
    };
    // Quantized once for every backend of the group.
    let quantized = g
        .dtype
        .quant
        .map(|q| QuantKvCache::quantize(&data.cache, q))
        .transpose();
    let quantized = match quantized {
        Ok(q) => q,
        Err(e) => return failed(set, g, &CliError::from(e)),
    };
    let mut out = Vec::new();
    for &backend in &set.backends {
        let rows = Rows {
            set,
            group: g,
            data: &data,
            quantized: quantized.as_ref(),
            backend,
        };
        out.extend(match backend {
            DecodeBackend::Cpu => cpu_rows(&rows),
            DecodeBackend::Wgpu => wgpu_rows(devices.engine, &rows),
            #[cfg(feature = "cuda")]
            DecodeBackend::Cuda => cuda_rows(devices.cuda, &rows),
            #[cfg(not(feature = "cuda"))]
            DecodeBackend::Cuda => {
                rows.failed(&flashattn::Error::BackendNotBuilt { backend: "cuda" })
            }
            DecodeBackend::Torch => torch_rows(devices.baselines, &rows),
        });
    }
    out
}

/// The CPU backend's rows: wall time of `cpu::decode` on a host cache.
fn cpu_rows(rows: &Rows) -> Vec<DecodeResult> {
    let opts = AttentionOptions::default();
    let step = rows.data.step();
    match rows.quantized {
        Some(q) => {
            let mut cache = q.clone();
            rows.each_mode(|splits| {
                let start = Instant::now();
                let r = cpu::decode_quantized(&mut cache, &step, &opts, splits)?;
                Ok(Timed::wall(start, r.num_splits))
            })
        }
        None => {
            let mut cache = rows.data.cache.clone();
            rows.each_mode(|splits| {
                let start = Instant::now();
                let r = cpu::decode(&mut cache, &step, &opts, splits)?;
                Ok(Timed::wall(start, r.num_splits))
            })
        }
    }
}

/// The wgpu rows: kernel time of `Engine::decode` on a device cache
/// uploaded once.
fn wgpu_rows(engine: Option<&Engine>, rows: &Rows) -> Vec<DecodeResult> {
    let cache = engine
        .ok_or(CliError::NeedsGpu {
            what: "the wgpu decode benchmark",
        })
        .and_then(|e| {
            let kv = match rows.quantized {
                Some(q) => e.upload_quantized_kv_cache(q)?,
                None => e.upload_kv_cache(&rows.data.cache)?,
            };
            Ok((e, kv))
        });
    let (e, mut kv): (&Engine, KvCache) = match cache {
        Ok(x) => x,
        Err(err) => return rows.failed(&err),
    };
    let (opts, step) = (AttentionOptions::default(), rows.data.step());
    rows.each_mode(|splits| {
        let r = e.decode(&mut kv, &step, &opts, splits)?;
        Ok(Timed {
            seconds: r.stats.kernel_seconds,
            splits: r.num_splits,
            clock: r.stats.timing,
        })
    })
}

/// The CUDA rows: `Cuda::decode` on a `CudaKvCache` uploaded once (a step
/// copies q and the lengths, never the cache), timed by the step's CUDA
/// events, or by the wall clock around the call (which waits for o) where
/// a step reports another clock.
#[cfg(feature = "cuda")]
fn cuda_rows(cuda: Option<&CudaBackend>, rows: &Rows) -> Vec<DecodeResult> {
    let cuda = match cuda {
        Some(Ok(cuda)) => cuda,
        Some(Err(e)) => return rows.failed(e),
        None => {
            return rows.failed(&CliError::CudaBench {
                message: "the CUDA backend was not opened for this run".into(),
            })
        }
    };
    let kv = match rows.quantized {
        Some(q) => cuda.upload_quantized_kv_cache(q),
        None => cuda.upload_kv_cache(&rows.data.cache),
    };
    let mut kv = match kv {
        Ok(kv) => kv,
        Err(e) => return rows.failed(&e),
    };
    let (opts, step) = (AttentionOptions::default(), rows.data.step());
    rows.each_mode(|splits| {
        let start = Instant::now();
        let r = cuda.decode(&mut kv, &step, &opts, splits)?;
        Ok(match r.stats.timing {
            Timing::CudaEvents => Timed {
                seconds: r.stats.kernel_seconds,
                splits: r.num_splits,
                clock: Timing::CudaEvents,
            },
            _ => Timed::wall(start, r.num_splits),
        })
    })
}

/// torch's rows (one per group; none for a quantized or latent cache,
/// which torch has no counterpart of).
fn torch_rows(baselines: Option<&Baselines>, rows: &Rows) -> Vec<DecodeResult> {
    if rows.quantized.is_some() || rows.set.latent_v.is_some() {
        return Vec::new();
    }
    let repeats = rows.set.repeats;
    rows.set
        .modes(rows.backend)
        .iter()
        .map(|&m| {
            let c = rows.config(m);
            let timed = baselines
                .ok_or(CliError::Baseline {
                    python: String::new(),
                    message: "no Python interpreter was set up".into(),
                })
                .and_then(|b| b.decode(&c, repeats));
            match timed {
                Ok(seconds) => DecodeResult {
                    seconds,
                    clock: Some(Timing::WallClock.describe()),
                    num_splits: None,
                    kv_bytes: c.kv_bytes(),
                    error: None,
                    config: c,
                },
                Err(e) => error_result(c, &e),
            }
        })
        .collect()
}

fn error_result(config: DecodeConfig, e: &dyn std::error::Error) -> DecodeResult {
    DecodeResult {
        config,
        seconds: Vec::new(),
        clock: None,
        num_splits: None,
        kv_bytes: config.kv_bytes(),
        error: Some(one_line(e)),
    }
}

/// Every row of a group whose data could not be made, failed.
fn failed(set: &DecodeSet, g: &Group, e: &CliError) -> Vec<DecodeResult> {
    set.backends
        .iter()
        .flat_map(|&b| set.modes(b).iter().map(move |&m| set.config(g, b, m)))
        .map(|c| error_result(c, e))
        .collect()
}

/// Host memory bandwidth: `bytes` copied between two buffers by every
/// rayon thread, `repeats` times after a warm-up; GB/s of bytes read plus
/// written by the fastest — the CPU backend's yardstick.
pub fn host_copy_gbps(bytes: usize, repeats: usize) -> f64 {
    let src: Vec<u8> = (0..bytes).map(|i| (i % 251) as u8).collect();
    let mut dst = vec![0u8; bytes];
    let mut best = f64::INFINITY;
    for i in 0..=repeats.max(1) {
        let start = Instant::now();
        dst.par_chunks_mut(1 << 20)
            .zip(src.par_chunks(1 << 20))
            .for_each(|(d, s)| d.copy_from_slice(s));
        let t = start.elapsed().as_secs_f64();
        if i > 0 {
            best = best.min(t);
        }
    }
    std::hint::black_box(&dst);
    2.0 * bytes as f64 / best / 1e9
}

/// The adapter's copy bandwidth, measured in the same run.
#[derive(Clone, Debug, Serialize)]
pub struct CopyBandwidth {
    pub bytes: u64,
    /// Bytes read plus written per second of the fastest repeat, GB/s.
    pub gbps: f64,
}

/// The CUDA device of a run and the driver's device-to-device copy on it
/// (the CUDA rows' yardstick), or why there is none.
#[derive(Clone, Debug, Serialize)]
pub struct CudaDevice {
    /// The device (`Cuda::describe`); none where it cannot be opened.
    pub device: Option<String>,
    pub copy: Option<CopyBandwidth>,
    /// Why there is no device or no copy bandwidth.
    pub error: Option<String>,
}

/// Bytes the CUDA copy bandwidth copies: `floor` (`--copy-mib`) or the
/// largest cache a CUDA row reads, whichever is more, so the copy streams
/// as much memory as the largest step.
pub fn cuda_copy_bytes(set: &DecodeSet, groups: &[Group], floor: u64) -> u64 {
    groups
        .iter()
        .map(|g| {
            set.config(g, DecodeBackend::Cuda, SplitMode::Planner)
                .kv_bytes()
        })
        .fold(floor, u64::max)
}

/// Everything one `bench --decode` run measured.
#[derive(Clone, Debug, Serialize)]
pub struct DecodeReport {
    pub adapter: String,
    /// How the wgpu rows' kernel times were taken.
    pub timing: String,
    /// The wgpu copy kernel's bandwidth (none without an adapter).
    pub copy: Option<CopyBandwidth>,
    /// Host memory copied by every CPU thread: the CPU rows' yardstick.
    pub host_copy: CopyBandwidth,
    /// The CUDA device and its copy bandwidth (none: CUDA was not asked for).
    pub cuda: Option<CudaDevice>,
    pub cpu_threads: usize,
    /// The CPU backend's instruction set.
    pub cpu_isa: String,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    /// A latent cache's V width (`--mla`).
    pub latent_v: Option<usize>,
    pub repeats: usize,
    pub results: Vec<DecodeResult>,
    /// `(batch, cache length)` pairs skipped by `--max-tokens`.
    pub skipped: Vec<(usize, usize)>,
    pub max_tokens: usize,
}

impl DecodeReport {
    /// The yardstick of a row: the copy kernel for wgpu, the driver's
    /// device-to-device copy for CUDA, host copy for the CPU.
    pub fn yardstick(&self, backend: DecodeBackend) -> Option<f64> {
        match backend {
            DecodeBackend::Wgpu => self.copy.as_ref().map(|c| c.gbps),
            DecodeBackend::Cuda => self.cuda.as_ref()?.copy.as_ref().map(|c| c.gbps),
            DecodeBackend::Cpu | DecodeBackend::Torch => Some(self.host_copy.gbps),
        }
    }

    /// The clock of `backend`'s rows (the first measured row's).
    fn clock(&self, backend: DecodeBackend) -> Option<&'static str> {
        self.results
            .iter()
            .filter(|r| r.config.backend == backend)
            .find_map(|r| r.clock)
    }

    /// Each group's fastest CPU-backend row against its torch row: the
    /// ratio of their min times (above 1: the CPU backend is faster).
    pub fn against_torch(&self) -> Vec<(Group, f64)> {
        let group = |c: &DecodeConfig| Group {
            batch: c.batch,
            cache_len: c.cache_len,
            dtype: c.dtype(),
        };
        let best = |backend: DecodeBackend, g: &Group| {
            self.results
                .iter()
                .filter(|r| r.config.backend == backend && group(&r.config) == *g)
                .filter_map(DecodeResult::min_seconds)
                .reduce(f64::min)
        };
        let mut out: Vec<(Group, f64)> = Vec::new();
        for r in self
            .results
            .iter()
            .filter(|r| r.config.backend == DecodeBackend::Torch)
        {
            let g = group(&r.config);
            if let (Some(cpu), Some(torch)) =
                (best(DecodeBackend::Cpu, &g), best(DecodeBackend::Torch, &g))
            {
                out.push((g, torch / cpu));
            }
        }
        out
    }

    /// The report on stdout: what was measured and how, then one row per
    /// configuration.
    pub fn print(&self) {
        println!("adapter: {}", self.adapter);
        println!("kernel times: {}; CPU rows: wall clock", self.timing);
        let mib = |b: u64| b as f64 / (1 << 20) as f64;
        match &self.copy {
            Some(c) => println!(
                "copy bandwidth (wgpu copy kernel, {:.0} MiB, read + written): {:.2} GB/s",
                mib(c.bytes),
                c.gbps
            ),
            None => println!("copy bandwidth (wgpu copy kernel): no adapter opened (no wgpu rows)"),
        }
        if let Some(cuda) = &self.cuda {
            self.print_cuda(cuda);
        }
        println!(
            "cpu backend: {}, {} threads",
            self.cpu_isa, self.cpu_threads
        );
        println!(
            "host copy bandwidth ({} threads, {:.0} MiB, read + written): {:.2} GB/s",
            self.cpu_threads,
            mib(self.host_copy.bytes),
            self.host_copy.gbps
        );
        if let Some(v) = self.latent_v {
            println!(
                "latent cache (MLA): one tensor of width {}, V its first {v} columns; \
                 K/V GB/s counts it once",
                self.head_dim
            );
        }
        println!(
            "decode: 1 query token per sequence, heads {}/{}, head_dim {}, full dense caches, \
             no append in the timed steps; min and median of {} repeats after a warm-up; \
             wgpu and cuda: kernel time with the cache kept on the device; cpu: wall time of \
             flashattn::cpu::decode; torch: wall time of SDPA (enable_gqa) on the CPU, \
             caches in torch's (batch, heads, seqlen, d) layout; \
             K/V GB/s = 2·batch·cache·heads_kv·d·bytes / min time; \
             % copy: of the copy kernel (wgpu rows), the device-to-device copy (cuda rows) \
             or the host copy (cpu and torch rows)",
            self.heads_q, self.heads_kv, self.head_dim, self.repeats
        );
        println!(
            "\n{:<7} {:<5} {:>5} {:>7} {:<8} {:>6} {:>10} {:>10} {:>9} {:>7}",
            "backend",
            "dtype",
            "batch",
            "cache",
            "splits",
            "used",
            "median ms",
            "min ms",
            "K/V GB/s",
            "% copy"
        );
        self.results
            .iter()
            .for_each(|r| println!("{}", self.row(r)));
        for (g, ratio) in self.against_torch() {
            println!(
                "cpu vs torch, {} batch {} cache {}: {ratio:.2}x (torch's min time / the CPU backend's)",
                g.dtype.name(), g.batch, g.cache_len
            );
        }
        if self.results.iter().any(|r| r.config.cache.is_some()) {
            println!(
                "int8 and fp8 rows: quantized caches (codes and a scale per 16 tokens and kv head, \
                 f16 steps); their K/V GB/s count codes and scales"
            );
        }
        if !self.skipped.is_empty() {
            let pairs: Vec<String> = self
                .skipped
                .iter()
                .map(|(b, n)| format!("batch {b} × cache {n}"))
                .collect();
            println!(
                "skipped (batch × cache length over --max-tokens {}; --max-tokens 0 runs them): {}",
                self.max_tokens,
                pairs.join(", ")
            );
        }
    }

    /// The CUDA device's lines: the device, its copy bandwidth and the
    /// clock of its rows, or why there are none.
    fn print_cuda(&self, cuda: &CudaDevice) {
        let Some(device) = &cuda.device else {
            println!(
                "cuda: no device ({})",
                cuda.error.as_deref().unwrap_or("unknown")
            );
            return;
        };
        let clock = self.clock(DecodeBackend::Cuda).unwrap_or("no row measured");
        println!("cuda: {device}; step times: {clock}");
        match &cuda.copy {
            Some(c) => println!(
                "cuda copy bandwidth (device-to-device copy, {:.0} MiB, read + written, \
                 CUDA events): {:.2} GB/s",
                c.bytes as f64 / (1 << 20) as f64,
                c.gbps
            ),
            None => println!(
                "cuda copy bandwidth: not measured ({})",
                cuda.error.as_deref().unwrap_or("unknown")
            ),
        }
    }

    /// One configuration's table row.
    fn row(&self, r: &DecodeResult) -> String {
        let c = &r.config;
        let head = format!(
            "{:<7} {:<5} {:>5} {:>7} {:<8}",
            c.backend.name(),
            c.dtype().name(),
            c.batch,
            c.cache_len,
            match c.backend {
                DecodeBackend::Torch => "-".into(),
                _ => c.splits.name(),
            }
        );
        let (Some(min), Some(med), Some(g)) = (r.min_seconds(), r.median_seconds(), r.gbps())
        else {
            return match &r.error {
                Some(e) => format!("{head}   FAILED: {e}"),
                None => format!("{head}   no measurement"),
            };
        };
        let frac = self
            .yardstick(c.backend)
            .map_or("-".into(), |x| format!("{:.0}%", 100.0 * g / x));
        let used = r.num_splits.map_or("-".into(), |n| n.to_string());
        format!(
            "{head} {used:>6} {:>10.3} {:>10.3} {g:>9.2} {frac:>7}",
            med * 1e3,
            min * 1e3
        )
    }
}

#[derive(Serialize)]
struct CsvRow<'a> {
    backend: &'a str,
    precision: &'a str,
    batch: usize,
    cache_len: usize,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    splits: String,
    num_splits: Option<usize>,
    median_ms: Option<f64>,
    min_ms: Option<f64>,
    kv_gbps: Option<f64>,
    copy_gbps: Option<f64>,
    clock: Option<&'a str>,
    error: Option<&'a str>,
}

/// The results table as CSV (`copy_gbps`: the row's yardstick).
pub fn csv_text(report: &DecodeReport) -> Result<String> {
    let mut w = csv::Writer::from_writer(Vec::new());
    for r in &report.results {
        let c = &r.config;
        w.serialize(CsvRow {
            backend: c.backend.name(),
            precision: c.dtype().name(),
            batch: c.batch,
            cache_len: c.cache_len,
            heads_q: c.heads_q,
            heads_kv: c.heads_kv,
            head_dim: c.head_dim,
            splits: c.splits.name(),
            num_splits: r.num_splits,
            median_ms: r.median_seconds().map(|t| t * 1e3),
            min_ms: r.min_seconds().map(|t| t * 1e3),
            kv_gbps: r.gbps(),
            copy_gbps: report.yardstick(c.backend),
            clock: r.clock,
            error: r.error.as_deref(),
        })?;
    }
    let bytes = w
        .into_inner()
        .map_err(|e| CliError::Csv(e.into_error().into()))?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A report of `results` without an adapter or a CUDA device, its host
    /// copy at 1 GB/s.
    fn report(results: Vec<DecodeResult>) -> DecodeReport {
        DecodeReport {
            adapter: String::new(),
            timing: String::new(),
            copy: None,
            host_copy: CopyBandwidth {
                bytes: 1,
                gbps: 1.0,
            },
            cuda: None,
            cpu_threads: 2,
            cpu_isa: "portable".into(),
            heads_q: 32,
            heads_kv: 8,
            head_dim: 128,
            latent_v: None,
            repeats: 2,
            results,
            skipped: Vec::new(),
            max_tokens: 0,
        }
    }

    fn set() -> DecodeSet {
        DecodeSet {
            backends: vec![DecodeBackend::Wgpu, DecodeBackend::Cpu],
            batches: vec![1, 8],
            cache_lens: vec![1024, 8192, 32768],
            heads_q: 32,
            heads_kv: 8,
            head_dim: 128,
            latent_v: None,
            dtypes: vec!["f16".parse().unwrap(), "f32".parse().unwrap()],
            splits: vec![SplitMode::Planner, SplitMode::Fixed(1)],
            max_tokens: 65536,
            repeats: 3,
        }
    }

    #[test]
    fn torch_runs_one_row_per_group_and_is_compared_with_the_fastest_cpu_row() {
        let mut set = set();
        set.backends = "cpu,torch".split(',').map(|b| b.parse().unwrap()).collect();
        assert_eq!(set.modes(DecodeBackend::Torch), &[SplitMode::Planner]);
        assert_eq!(set.modes(DecodeBackend::Cpu).len(), 2);
        let g = set.groups().0[0];
        let row = |backend, splits, seconds: &[f64]| DecodeResult {
            config: set.config(&g, backend, splits),
            seconds: seconds.to_vec(),
            clock: None,
            num_splits: None,
            kv_bytes: 0,
            error: None,
        };
        let results = vec![
            row(DecodeBackend::Cpu, SplitMode::Planner, &[0.002, 0.003]),
            row(DecodeBackend::Cpu, SplitMode::Fixed(1), &[0.004]),
            row(DecodeBackend::Torch, SplitMode::Planner, &[0.006, 0.005]),
        ];
        let report = report(results);
        let ratios = report.against_torch();
        assert_eq!(ratios.len(), 1);
        assert_eq!(ratios[0].0, g);
        assert!((ratios[0].1 - 2.5).abs() < 1e-12, "{}", ratios[0].1);
        assert!("gpu".parse::<DecodeBackend>().is_err());
    }

    #[test]
    fn split_modes_parse_and_name_themselves() {
        let modes: Vec<SplitMode> = ["planner", "0", "1", "16"]
            .iter()
            .map(|s| s.parse().unwrap())
            .collect();
        assert_eq!(
            modes,
            [
                SplitMode::Planner,
                SplitMode::Planner,
                SplitMode::Fixed(1),
                SplitMode::Fixed(16)
            ]
        );
        assert_eq!(modes[3].name(), "16");
        for bad in ["-1", "two", ""] {
            assert!(matches!(
                bad.parse::<SplitMode>(),
                Err(CliError::BadFlag {
                    flag: "--splits",
                    ..
                })
            ));
        }
    }

    #[test]
    fn max_tokens_skips_the_largest_pairs() {
        let (run, skipped) = set().groups();
        assert_eq!(skipped, vec![(8, 32768)]);
        assert_eq!(run.len(), 5 * 2);
        let all = DecodeSet {
            max_tokens: 0,
            ..set()
        };
        assert_eq!(all.groups().0.len(), 6 * 2);
    }

    #[test]
    fn kv_bytes_count_k_and_v_once() {
        let group = |dtype: &str| Group {
            batch: 8,
            cache_len: 1024,
            dtype: dtype.parse().unwrap(),
        };
        let bytes = |dtype| {
            set()
                .config(&group(dtype), DecodeBackend::Cpu, SplitMode::Fixed(1))
                .kv_bytes()
        };
        assert_eq!(bytes("f16"), 2 * 8 * 1024 * 8 * 128 * 2);
        // A byte per element, and a scale per 16 tokens and kv head.
        let scales = 2 * 8 * (1024 / 16) * 8 * 4;
        assert_eq!(bytes("int8"), 2 * 8 * 1024 * 8 * 128 + scales);
        assert_eq!(bytes("fp8"), bytes("int8"));
        // A latent cache is one tensor, read once for K and V.
        let mla = DecodeSet {
            heads_q: 128,
            heads_kv: 1,
            head_dim: MLA_WIDTH,
            latent_v: Some(MLA_V_WIDTH),
            ..set()
        };
        let latent = mla.config(&group("f16"), DecodeBackend::Cpu, SplitMode::Fixed(1));
        assert_eq!(latent.kv_bytes(), 8 * 1024 * 576 * 2);
        // Quantized: its codes and its one set of scales.
        let latent = mla.config(&group("int8"), DecodeBackend::Cpu, SplitMode::Fixed(1));
        assert_eq!(
            latent.kv_bytes(),
            (8 * 1024 * 576 + 8 * (1024 / 16) * 4) as u64
        );
        assert!("int4".parse::<CacheDtype>().is_err());
        // A float dtype it does not take names --dtypes and its values.
        assert!(matches!(
            "f64".parse::<CacheDtype>(),
            Err(CliError::BadFlag {
                flag: "--dtypes",
                ..
            })
        ));
        let int8: CacheDtype = "int8".parse().unwrap();
        assert_eq!((int8.name(), int8.precision), ("int8", Precision::F16));
    }

    /// kv_bytes against the caches the bench builds: a plain cache's K and
    /// V elements, a quantized one's codes and 4-byte scales, a latent
    /// cache's one tensor — for every dtype, dense and MLA.
    #[test]
    fn kv_bytes_are_the_bytes_of_the_caches_a_step_reads() {
        let small = DecodeSet {
            heads_q: 4,
            heads_kv: 2,
            head_dim: 32,
            ..set()
        };
        let mla = DecodeSet {
            heads_q: 8,
            heads_kv: 1,
            head_dim: MLA_WIDTH,
            latent_v: Some(MLA_V_WIDTH),
            ..set()
        };
        for set in [small, mla] {
            // 40 keys: the last scale block a partial one.
            for dtype in ["f32", "f16", "bf16", "int8", "fp8"] {
                let g = Group {
                    batch: 3,
                    cache_len: 40,
                    dtype: dtype.parse().unwrap(),
                };
                let data = GroupData::new(&set, &g).unwrap();
                let c = &data.cache;
                let held = match g.dtype.quant {
                    Some(q) => {
                        let q = QuantKvCache::quantize(c, q).unwrap();
                        let kv = [&q.k, &q.v];
                        kv.iter().map(|t| t.codes.len() + 4 * t.scales.len()).sum()
                    }
                    None => (c.k.len() + c.v.len()) * g.dtype.precision.bytes(),
                };
                let config = set.config(&g, DecodeBackend::Cuda, SplitMode::Planner);
                let latent = set.latent_v.is_some();
                assert_eq!(config.kv_bytes(), held as u64, "{dtype}, latent {latent}");
            }
        }
    }

    #[test]
    fn cuda_is_a_backend_with_its_own_yardstick() {
        let backends: Vec<DecodeBackend> = "wgpu,cpu,cuda,torch"
            .split(',')
            .map(|b| b.parse().unwrap())
            .collect();
        assert_eq!(backends[2], DecodeBackend::Cuda);
        assert_eq!(backends[2].name(), "cuda");
        let Err(CliError::BadFlag { expected, .. }) = "gpu".parse::<DecodeBackend>() else {
            panic!("gpu is no backend");
        };
        assert!(expected.contains("cuda"), "{expected}");
        let copy = |gbps| CopyBandwidth { bytes: 1, gbps };
        let mut r = report(Vec::new());
        r.copy = Some(copy(10.0));
        assert_eq!(r.yardstick(DecodeBackend::Cuda), None, "no CUDA device");
        r.cuda = Some(CudaDevice {
            device: Some("a device".into()),
            copy: None,
            error: Some("out of memory".into()),
        });
        assert_eq!(r.yardstick(DecodeBackend::Cuda), None, "no copy measured");
        r.cuda.as_mut().unwrap().copy = Some(copy(30.0));
        let yardsticks: Vec<Option<f64>> = backends.iter().map(|&b| r.yardstick(b)).collect();
        assert_eq!(yardsticks, [Some(10.0), Some(1.0), Some(30.0), Some(1.0)]);
        // The CSV's copy_gbps column is the row's own yardstick.
        let g = set().groups().0[0];
        r.results = backends
            .iter()
            .map(|&b| DecodeResult {
                config: set().config(&g, b, SplitMode::Planner),
                seconds: vec![1.0],
                clock: Some(Timing::CudaEvents.describe()),
                num_splits: Some(1),
                kv_bytes: 1,
                error: None,
            })
            .collect();
        let csv = csv_text(&r).unwrap();
        let cuda_row = csv.lines().find(|l| l.starts_with("cuda,")).unwrap();
        assert!(cuda_row.contains(",30.0,CUDA events"), "{csv}");
    }

    #[test]
    fn the_cuda_copy_covers_the_largest_cache() {
        let set = set();
        let (groups, _) = set.groups();
        // f32 at batch 8 × 8192 is the largest group under max_tokens.
        let largest = 2 * 8 * 8192 * 8 * 128 * 4;
        assert_eq!(cuda_copy_bytes(&set, &groups, 64 << 20), largest);
        assert_eq!(cuda_copy_bytes(&set, &groups, 1 << 40), 1 << 40);
        assert_eq!(cuda_copy_bytes(&set, &[], 64 << 20), 64 << 20);
    }

    /// CUDA rows without a device fail each with the reason, and the other
    /// backends' rows of the group still run.
    #[test]
    fn cuda_rows_without_a_device_fail_alone() {
        let set = DecodeSet {
            backends: vec![DecodeBackend::Cuda, DecodeBackend::Cpu],
            batches: vec![1],
            cache_lens: vec![32],
            heads_q: 4,
            heads_kv: 2,
            head_dim: 16,
            dtypes: vec!["f32".parse().unwrap(), "int8".parse().unwrap()],
            repeats: 1,
            ..set()
        };
        for g in set.groups().0 {
            let rows = run_group(&Devices::default(), &set, &g);
            assert_eq!(rows.len(), 4, "{rows:?}");
            for r in &rows[..2] {
                assert_eq!(r.config.backend, DecodeBackend::Cuda);
                let e = r.error.as_deref().unwrap();
                assert!(e.contains("cuda") || e.contains("CUDA"), "{e}");
                assert!(r.seconds.is_empty() && r.clock.is_none());
            }
            for r in &rows[2..] {
                assert_eq!(r.config.backend, DecodeBackend::Cpu);
                assert!(r.error.is_none(), "{r:?}");
                assert_eq!(r.seconds.len(), 1);
                assert_eq!(r.clock, Some(Timing::WallClock.describe()));
            }
        }
    }

    #[test]
    fn fill_is_seeded_and_bounded() {
        let a = fill(200_000, 7);
        assert_eq!(a, fill(200_000, 7));
        assert_ne!(a, fill(200_000, 8));
        assert!(a.iter().all(|x| (-1.0..1.0).contains(x)));
        let mean = a.iter().map(|&x| x as f64).sum::<f64>() / a.len() as f64;
        assert!(mean.abs() < 0.01, "{mean}");
    }
}

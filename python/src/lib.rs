//! `flashattn._native`: the engine's calls for the Python package.
//!
//! The package's Python layer (python/flashattn) checks every tensor (dtype,
//! device, shape, contiguity) and allocates the outputs; this module takes
//! each tensor as `(address, shape, dtype)` of contiguous host memory that
//! the caller keeps alive for the call, so torch tensors and numpy arrays
//! cross without a copy. The engine validates the problem in full before
//! any work, and results are copied into the outputs (and appends into the
//! caches) only after the call has succeeded: a failed call writes nothing.
//! Engine errors become the exception classes of `flashattn.errors`, with
//! the typed error's fields as attributes.

mod errors;
mod raw;

use flashattn::{
    accuracy, reference, Backend, BackendKind, BackwardInputs, Engine, ForwardInputs, Fp8Options,
    HostKvCache, PlanOverrides, Precision, TensorData,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use raw::{Opts, Raw, RawMut};
use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

/// A backend opened once per process and kind, with why it was chosen.
struct Opened {
    backend: Backend,
    reason: String,
}

/// `auto`: CUDA in a build with it where a device opens; else a hardware
/// GPU through wgpu; else the CPU backend (a software adapter such as
/// lavapipe is slower than the CPU backend for the calls Python makes).
fn open_auto() -> Opened {
    #[cfg(feature = "cuda")]
    let not_cuda = match Backend::open(BackendKind::Cuda, &dummy_workload()) {
        Ok(choice) => {
            return Opened {
                backend: choice.backend,
                reason: format!("{} (auto prefers CUDA)", choice.reason),
            }
        }
        Err(e) => format!(" (not CUDA: {e})"),
    };
    #[cfg(not(feature = "cuda"))]
    let not_cuda = String::new();
    match Engine::new() {
        Ok(engine) if engine.adapter_info().device_type != flashattn::wgpu::DeviceType::Cpu => {
            let reason = format!("wgpu on the hardware GPU {}{not_cuda}", engine.describe());
            Opened {
                backend: Backend::Wgpu(Box::new(engine)),
                reason,
            }
        }
        Ok(engine) => Opened {
            backend: Backend::Cpu,
            reason: format!(
                "the CPU backend: the only adapter, {}, runs on the CPU{not_cuda}",
                engine.describe()
            ),
        },
        Err(e) => Opened {
            backend: Backend::Cpu,
            reason: format!("the CPU backend: no GPU adapter ({e}){not_cuda}"),
        },
    }
}

#[cfg(feature = "cuda")]
fn dummy_workload() -> flashattn::Workload {
    let x = [0f32; 64];
    let view = flashattn::TensorView::f32([1, 1, 1, 64], &x);
    let shape = ForwardInputs::new(view, view, view)
        .shape()
        .expect("a 1x1x1x64 problem is valid");
    flashattn::Workload::new(
        shape,
        Precision::F32,
        flashattn::AttentionOptions::default(),
    )
}

fn open(kind: &str) -> Result<Arc<Opened>, flashattn::Error> {
    static OPEN: OnceLock<Mutex<HashMap<String, Arc<Opened>>>> = OnceLock::new();
    let kind_enum: BackendKind = kind.parse()?;
    let map = OPEN.get_or_init(Default::default);
    let mut map = map.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(o) = map.get(kind) {
        return Ok(o.clone());
    }
    let opened = match kind_enum {
        BackendKind::Cpu => Opened {
            backend: Backend::Cpu,
            reason: "the CPU backend, as requested".into(),
        },
        BackendKind::Wgpu => {
            let engine = Engine::new()?;
            let reason = format!("wgpu on {}, as requested", engine.describe());
            Opened {
                backend: Backend::Wgpu(Box::new(engine)),
                reason,
            }
        }
        #[cfg(feature = "cuda")]
        BackendKind::Cuda => {
            let choice = Backend::open(BackendKind::Cuda, &dummy_workload())?;
            Opened {
                backend: choice.backend,
                reason: choice.reason,
            }
        }
        _ if kind_enum == BackendKind::Cuda => {
            return Err(flashattn::Error::BackendNotBuilt { backend: "cuda" })
        }
        _ => open_auto(),
    };
    let opened = Arc::new(opened);
    map.insert(kind.to_string(), opened.clone());
    Ok(opened)
}

/// Which backend `kind` opens here, and why: `(kind, name, reason)`.
#[pyfunction]
fn backend_info(py: Python<'_>, kind: &str) -> PyResult<(String, String, String)> {
    let opened = py.detach(|| open(kind)).map_err(|e| errors::to_py(py, e))?;
    Ok((
        opened.backend.kind().name().to_string(),
        opened.backend.name(),
        opened.reason.clone(),
    ))
}

/// The engine's forward: o and lse into `o_out` and `lse_out`; returns
/// the name of the backend that ran and the seconds its call took (the
/// Rust side alone, for measuring what crossing from Python costs).
#[pyfunction]
#[pyo3(signature = (q, k, v, o_out, lse_out, opts, backend, fp8=false, hadamard=None))]
#[allow(clippy::too_many_arguments)]
fn forward(
    py: Python<'_>,
    q: Raw,
    k: Raw,
    v: Raw,
    o_out: RawMut,
    lse_out: RawMut,
    opts: Opts,
    backend: &str,
    fp8: bool,
    hadamard: Option<u64>,
) -> PyResult<(String, f64)> {
    let opts = opts.build().map_err(|e| errors::to_py(py, e))?;
    let result = py.detach(|| -> flashattn::Result<(String, f64)> {
        let opened = open(backend)?;
        let start = std::time::Instant::now();
        // SAFETY (all views and outputs below): the Python layer hands in
        // the addresses of live, contiguous tensors of these shapes and
        // dtypes, held for the call.
        let (q, k, v) = unsafe { (q.view()?, k.view()?, v.view()?) };
        let inputs = ForwardInputs::new(q, k, v);
        let none = PlanOverrides::default();
        let out = match (fp8, hadamard) {
            (false, _) => opened.backend.forward(&inputs, &opts, &none)?,
            (true, None) => {
                opened
                    .backend
                    .forward_fp8(&inputs, &opts, &Fp8Options::default(), &none)?
            }
            (true, Some(seed)) => {
                let fp8 = Fp8Options::hadamard(seed);
                opened.backend.forward_fp8(&inputs, &opts, &fp8, &none)?
            }
        };
        unsafe {
            o_out.write(&out.o.data, "o")?;
            lse_out.write(&TensorData::F32(out.lse), "lse")?;
        }
        Ok((opened.backend.name(), start.elapsed().as_secs_f64()))
    });
    result.map_err(|e| errors::to_py(py, e))
}

/// The engine's deterministic backward: dq, dk, dv into the outputs;
/// returns dsinks (with sinks).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn backward(
    py: Python<'_>,
    q: Raw,
    k: Raw,
    v: Raw,
    o: Raw,
    lse: Raw,
    d_o: Raw,
    dq_out: RawMut,
    dk_out: RawMut,
    dv_out: RawMut,
    opts: Opts,
    backend: &str,
) -> PyResult<Option<Vec<f32>>> {
    let opts = opts.build().map_err(|e| errors::to_py(py, e))?;
    let result = py.detach(|| -> flashattn::Result<Option<Vec<f32>>> {
        let opened = open(backend)?;
        // SAFETY: as in `forward`.
        let (q, k, v, o, d_o) =
            unsafe { (q.view()?, k.view()?, v.view()?, o.view()?, d_o.view()?) };
        let lse = unsafe { lse.f32s("lse")? };
        let inputs = BackwardInputs {
            q,
            k,
            v,
            o,
            lse,
            d_o,
        };
        let out = opened
            .backend
            .backward(&inputs, &opts, &PlanOverrides::default())?;
        unsafe {
            dq_out.write(&out.dq.data, "dq")?;
            dk_out.write(&out.dk.data, "dk")?;
            dv_out.write(&out.dv.data, "dv")?;
        }
        Ok(out.dsinks)
    });
    result.map_err(|e| errors::to_py(py, e))
}

/// A decoding step on a KV cache (appending `k_new`/`v_new` in place
/// first): o and lse into the outputs; returns the backend's name and the
/// splits it ran with. A latent cache (`latent_v`, V its first columns)
/// has no `v_cache` and appends `k_new` alone.
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, paged, new_kv, cache_seqlens, cache_batch_idx, block_table, o_out, lse_out, opts, backend, num_splits, latent_v=None))]
#[allow(clippy::too_many_arguments)]
fn decode(
    py: Python<'_>,
    q: Raw,
    k_cache: RawMut,
    v_cache: Option<RawMut>,
    paged: bool,
    new_kv: Option<(Raw, Option<Raw>)>,
    cache_seqlens: Vec<i32>,
    cache_batch_idx: Option<Vec<i32>>,
    block_table: Option<(Vec<i32>, usize)>,
    o_out: RawMut,
    lse_out: RawMut,
    opts: Opts,
    backend: &str,
    num_splits: usize,
    latent_v: Option<usize>,
) -> PyResult<(String, usize)> {
    let opts = opts.build().map_err(|e| errors::to_py(py, e))?;
    let result = py.detach(|| -> flashattn::Result<(String, usize)> {
        let opened = open(backend)?;
        // SAFETY: as in `forward`; the caches are read here and written
        // back only after the step succeeded.
        let mut cache = unsafe { host_cache(&k_cache, v_cache.as_ref(), latent_v, paged)? };
        let new = new_kv.as_ref().map(|(k, v)| (k, v.as_ref()));
        let step = unsafe { decode_step(&q, new, &cache_seqlens, &cache_batch_idx, &block_table)? };
        let splits = (num_splits > 0).then_some(num_splits);
        let out = opened.backend.decode(&mut cache, &step, &opts, splits)?;
        unsafe {
            o_out.write(&out.o.data, "o")?;
            lse_out.write(&TensorData::F32(out.lse), "lse")?;
            if new_kv.is_some() {
                k_cache.write(&cache.k, "k_cache")?;
                if let Some(v_cache) = &v_cache {
                    v_cache.write(&cache.v, "v_cache")?;
                }
            }
        }
        Ok((opened.backend.name(), out.num_splits))
    });
    result.map_err(|e| errors::to_py(py, e))
}

/// A quantized cache from the caller's code and scale tensors (copies).
///
/// # Safety
/// As [`Raw::view`].
/// `(codes, scales)` of K, and of V (none in a latent cache).
type CodesAndScales<'a> = (&'a RawMut, &'a RawMut);

unsafe fn quant_cache(
    k: CodesAndScales,
    v: Option<CodesAndScales>,
    latent_v: Option<usize>,
    quant: &str,
    precision: flashattn::Precision,
    paged: bool,
) -> flashattn::Result<flashattn::QuantKvCache> {
    let shape = cache_shape(k.0, v.map(|(codes, _)| codes), latent_v, paged)?;
    let part = |c: &RawMut, s: &RawMut, names| -> flashattn::Result<flashattn::QuantizedKv> {
        let (cn, sn) = names;
        Ok(flashattn::QuantizedKv {
            codes: c.codes(cn)?.to_vec(),
            scales: s.f32s(sn)?.to_vec(),
        })
    };
    // A latent cache's V reads K's codes and scales.
    let v = match v {
        Some((codes, scales)) => part(codes, scales, ("v_cache", "v_scales"))?,
        None => flashattn::QuantizedKv::default(),
    };
    flashattn::QuantKvCache::new(
        shape,
        flashattn::CacheQuant::parse(quant)?,
        precision,
        part(k.0, k.1, ("k_cache", "k_scales"))?,
        v,
    )
}

/// The shape of a cache given as K and V tensors, or as K alone with a
/// latent view `latent_v` wide.
fn cache_shape(
    k: &RawMut,
    v: Option<&RawMut>,
    latent_v: Option<usize>,
    paged: bool,
) -> flashattn::Result<flashattn::CacheShape> {
    let dims = |r: &RawMut, name: &'static str| -> flashattn::Result<[usize; 4]> {
        r.0.shape().try_into().map_err(|_| flashattn::Error::Rank {
            tensor: name,
            shape: r.0.shape().to_vec(),
            rank: r.0.shape().len(),
            expected: 4,
        })
    };
    match (v, latent_v) {
        (Some(v), None) => {
            flashattn::CacheShape::from_kv_dims(dims(k, "k_cache")?, dims(v, "v_cache")?, paged)
        }
        (None, Some(v_width)) => {
            let s = flashattn::CacheShape::from_dims(dims(k, "k_cache")?, paged)?;
            flashattn::CacheShape::latent(s.layout, s.heads_kv, s.head_dim, v_width)
        }
        // The Python layer passes exactly one of them.
        _ => Err(flashattn::Error::Unsupported {
            what: "a kv cache",
            feature: "both a v_cache and a latent head_dim_v, or neither",
        }),
    }
}

/// A decoding step on a quantized cache (int8 or fp8 codes with block
/// scales), appending `k_new`/`v_new` in place first (codes and scales
/// written back only after the step succeeded); o and lse into the
/// outputs; returns the backend's name and the splits it ran with.
#[pyfunction]
#[pyo3(signature = (q, k_codes, v_codes, k_scales, v_scales, quant, paged, new_kv, cache_seqlens, cache_batch_idx, block_table, o_out, lse_out, opts, backend, num_splits, latent_v=None))]
#[allow(clippy::too_many_arguments)]
fn decode_quantized(
    py: Python<'_>,
    q: Raw,
    k_codes: RawMut,
    v_codes: Option<RawMut>,
    k_scales: RawMut,
    v_scales: Option<RawMut>,
    quant: &str,
    paged: bool,
    new_kv: Option<(Raw, Option<Raw>)>,
    cache_seqlens: Vec<i32>,
    cache_batch_idx: Option<Vec<i32>>,
    block_table: Option<(Vec<i32>, usize)>,
    o_out: RawMut,
    lse_out: RawMut,
    opts: Opts,
    backend: &str,
    num_splits: usize,
    latent_v: Option<usize>,
) -> PyResult<(String, usize)> {
    let opts = opts.build().map_err(|e| errors::to_py(py, e))?;
    let result = py.detach(|| -> flashattn::Result<(String, usize)> {
        let opened = open(backend)?;
        // SAFETY: as in `decode`.
        let new = new_kv.as_ref().map(|(k, v)| (k, v.as_ref()));
        let step = unsafe { decode_step(&q, new, &cache_seqlens, &cache_batch_idx, &block_table)? };
        let v = v_codes.as_ref().zip(v_scales.as_ref());
        let mut cache = unsafe {
            quant_cache(
                (&k_codes, &k_scales),
                v,
                latent_v,
                quant,
                step.q.precision(),
                paged,
            )?
        };
        let splits = (num_splits > 0).then_some(num_splits);
        let out = opened
            .backend
            .decode_quantized(&mut cache, &step, &opts, splits)?;
        unsafe {
            o_out.write(&out.o.data, "o")?;
            lse_out.write(&TensorData::F32(out.lse), "lse")?;
            if new_kv.is_some() {
                k_codes.write_bytes(&cache.k.codes, "k_cache")?;
                k_scales.write(&TensorData::F32(cache.k.scales.clone()), "k_scales")?;
                if let Some((v_codes, v_scales)) = v {
                    v_codes.write_bytes(&cache.v.codes, "v_cache")?;
                    v_scales.write(&TensorData::F32(cache.v.scales.clone()), "v_scales")?;
                }
            }
        }
        Ok((opened.backend.name(), out.num_splits))
    });
    result.map_err(|e| errors::to_py(py, e))
}

/// A float cache quantized (each block's scale from its largest
/// magnitude) into the code and scale outputs; a latent cache (no `v`) into
/// K's alone.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn quantize_kv_cache(
    py: Python<'_>,
    k: RawMut,
    v: Option<RawMut>,
    quant: &str,
    paged: bool,
    k_codes: RawMut,
    v_codes: Option<RawMut>,
    k_scales: RawMut,
    v_scales: Option<RawMut>,
) -> PyResult<()> {
    let result = py.detach(|| -> flashattn::Result<()> {
        // SAFETY: as in `decode`. A latent cache's view is not read here:
        // its width is any, the whole row.
        let latent_v = v
            .is_none()
            .then(|| k.0.shape().last().copied().unwrap_or(0));
        let plain = unsafe { host_cache(&k, v.as_ref(), latent_v, paged)? };
        let cache =
            flashattn::QuantKvCache::quantize(&plain, flashattn::CacheQuant::parse(quant)?)?;
        unsafe {
            k_codes.write_bytes(&cache.k.codes, "k_codes")?;
            k_scales.write(&TensorData::F32(cache.k.scales.clone()), "k_scales")?;
            if let (Some(v_codes), Some(v_scales)) = (&v_codes, &v_scales) {
                v_codes.write_bytes(&cache.v.codes, "v_codes")?;
                v_scales.write(&TensorData::F32(cache.v.scales.clone()), "v_scales")?;
            }
        }
        Ok(())
    });
    result.map_err(|e| errors::to_py(py, e))
}

/// A quantized cache's values (f32, the codes times their block scales).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn dequantize_kv_cache(
    py: Python<'_>,
    k_codes: RawMut,
    v_codes: Option<RawMut>,
    k_scales: RawMut,
    v_scales: Option<RawMut>,
    quant: &str,
    paged: bool,
    k_out: RawMut,
    v_out: Option<RawMut>,
) -> PyResult<()> {
    let result = py.detach(|| -> flashattn::Result<()> {
        // SAFETY: as in `decode`. A latent cache (no V) as its whole rows.
        let v = v_codes.as_ref().zip(v_scales.as_ref());
        let latent_v = v
            .is_none()
            .then(|| k_codes.0.shape().last().copied().unwrap_or(0));
        let cache = unsafe {
            quant_cache(
                (&k_codes, &k_scales),
                v,
                latent_v,
                quant,
                flashattn::Precision::F32,
                paged,
            )?
        };
        let values = cache.dequantized();
        unsafe {
            k_out.write(&values.k, "k")?;
            if let Some(v_out) = &v_out {
                v_out.write(&values.v, "v")?;
            }
        }
        Ok(())
    });
    result.map_err(|e| errors::to_py(py, e))
}

/// A decoding step from the Python layer's arguments.
///
/// # Safety
/// As [`Raw::view`].
unsafe fn decode_step<'a>(
    q: &'a Raw,
    new_kv: Option<(&'a Raw, Option<&'a Raw>)>,
    cache_seqlens: &'a [i32],
    cache_batch_idx: &'a Option<Vec<i32>>,
    block_table: &'a Option<(Vec<i32>, usize)>,
) -> flashattn::Result<flashattn::DecodeStep<'a>> {
    let mut step = flashattn::DecodeStep::new(q.view()?, cache_seqlens);
    // k_new without v_new: a latent cache's rows (the step checks the cache is one).
    match new_kv {
        Some((k_new, Some(v_new))) => step = step.append(k_new.view()?, v_new.view()?),
        Some((k_new, None)) => step = step.append_latent(k_new.view()?),
        None => {}
    }
    if let Some(idx) = cache_batch_idx {
        step = step.batch_idx(idx);
    }
    if let Some((pages, max_pages)) = block_table {
        step = step.block_table(pages, *max_pages);
    }
    Ok(step)
}

/// A copy of the caller's cache tensors as the engine's host cache.
///
/// # Safety
/// As [`Raw::view`].
unsafe fn host_cache(
    k: &RawMut,
    v: Option<&RawMut>,
    latent_v: Option<usize>,
    paged: bool,
) -> flashattn::Result<HostKvCache> {
    let owned = |r: &RawMut| -> flashattn::Result<TensorData> {
        let view = r.host()?;
        TensorData::from_bytes(view.as_bytes(), view.precision(), view.len())
    };
    let shape = cache_shape(k, v, latent_v, paged)?;
    match v {
        Some(v) => HostKvCache::new(shape, owned(k)?, owned(v)?),
        None => HostKvCache::latent(shape, owned(k)?),
    }
}

/// The accuracy rule (docs/semantics.md) on a forward's `o` and `lse`
/// against the f64 reference: `[(name, max_error, bound, passed, line)]`.
#[pyfunction]
fn check_forward(
    py: Python<'_>,
    q: Raw,
    k: Raw,
    v: Raw,
    o: Raw,
    lse: Raw,
    opts: Opts,
) -> PyResult<Vec<CheckRow>> {
    let opts = opts.build().map_err(|e| errors::to_py(py, e))?;
    let result = py.detach(|| -> flashattn::Result<_> {
        // SAFETY: as in `forward`.
        let (q, k, v, o) = unsafe { (q.view()?, k.view()?, v.view()?, o.view()?) };
        let lse = unsafe { lse.f32s("lse")? };
        let reference = reference::forward(&q, &k, &v, &opts)?;
        let baseline = reference::naive_baseline(&q, &k, &v, &opts)?;
        Ok(o_lse_rows(&o, lse, &reference, &baseline, &opts))
    });
    result.map_err(|e| errors::to_py(py, e))
}

/// The accuracy rule on gradients against the f64 reference.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn check_backward(
    py: Python<'_>,
    q: Raw,
    k: Raw,
    v: Raw,
    d_o: Raw,
    dq: Raw,
    dk: Raw,
    dv: Raw,
    dsinks: Option<Vec<f32>>,
    opts: Opts,
) -> PyResult<Vec<CheckRow>> {
    let opts = opts.build().map_err(|e| errors::to_py(py, e))?;
    let result = py.detach(|| -> flashattn::Result<_> {
        // SAFETY: as in `forward`.
        let (q, k, v, d_o) = unsafe { (q.view()?, k.view()?, v.view()?, d_o.view()?) };
        let (dq, dk, dv) = unsafe { (dq.view()?, dk.view()?, dv.view()?) };
        let reference = reference::backward(&q, &k, &v, &d_o, &opts)?;
        let baseline = reference::naive_backward_baseline(&q, &k, &v, &d_o, &opts)?;
        let p = q.precision();
        let ratio = accuracy::BACKWARD_RATIO;
        let mut checks = vec![
            rule(
                "dq",
                &dq.data.to_f32(),
                &reference.dq,
                &baseline.dq,
                p,
                ratio,
            ),
            rule(
                "dk",
                &dk.data.to_f32(),
                &reference.dk,
                &baseline.dk,
                p,
                ratio,
            ),
            rule(
                "dv",
                &dv.data.to_f32(),
                &reference.dv,
                &baseline.dv,
                p,
                ratio,
            ),
        ];
        if let (Some(r), Some(b)) = (&reference.dsinks, &baseline.dsinks) {
            let got = dsinks.unwrap_or_default();
            checks.push(rule("dsinks", &got, r, b, Precision::F32, ratio));
        }
        Ok(checks)
    });
    result.map_err(|e| errors::to_py(py, e))
}

/// The accuracy rule on a decoding step's `o` and `lse` against the f64
/// reference, given the cache as it was before the step.
#[pyfunction]
#[pyo3(signature = (q, k_cache, v_cache, paged, new_kv, cache_seqlens, cache_batch_idx, block_table, o, lse, opts, latent_v=None))]
#[allow(clippy::too_many_arguments)]
fn check_decode(
    py: Python<'_>,
    q: Raw,
    k_cache: RawMut,
    v_cache: Option<RawMut>,
    paged: bool,
    new_kv: Option<(Raw, Option<Raw>)>,
    cache_seqlens: Vec<i32>,
    cache_batch_idx: Option<Vec<i32>>,
    block_table: Option<(Vec<i32>, usize)>,
    o: Raw,
    lse: Raw,
    opts: Opts,
    latent_v: Option<usize>,
) -> PyResult<Vec<CheckRow>> {
    let opts = opts.build().map_err(|e| errors::to_py(py, e))?;
    let result = py.detach(|| -> flashattn::Result<_> {
        // SAFETY: as in `forward`; the caches are only read.
        let cache = unsafe { host_cache(&k_cache, v_cache.as_ref(), latent_v, paged)? };
        let new = new_kv.as_ref().map(|(k, v)| (k, v.as_ref()));
        let step = unsafe { decode_step(&q, new, &cache_seqlens, &cache_batch_idx, &block_table)? };
        let [reference, baseline] = reference::decode(&cache, &step, &opts)?;
        let (o, lse) = unsafe { (o.view()?, lse.f32s("lse")?) };
        Ok(o_lse_rows(&o, lse, &reference, &baseline, &opts))
    });
    result.map_err(|e| errors::to_py(py, e))
}

/// The rule on a step on a quantized cache: o and lse against the f64
/// reference on the values of the codes and scales after the step (the
/// step's own rows in them), `cache_seqlens` those before it.
#[pyfunction]
#[pyo3(signature = (q, k_codes, v_codes, k_scales, v_scales, quant, paged, new_kv, cache_seqlens, cache_batch_idx, block_table, o, lse, opts, latent_v=None))]
#[allow(clippy::too_many_arguments)]
fn check_decode_quantized(
    py: Python<'_>,
    q: Raw,
    k_codes: RawMut,
    v_codes: Option<RawMut>,
    k_scales: RawMut,
    v_scales: Option<RawMut>,
    quant: &str,
    paged: bool,
    new_kv: Option<(Raw, Option<Raw>)>,
    cache_seqlens: Vec<i32>,
    cache_batch_idx: Option<Vec<i32>>,
    block_table: Option<(Vec<i32>, usize)>,
    o: Raw,
    lse: Raw,
    opts: Opts,
    latent_v: Option<usize>,
) -> PyResult<Vec<CheckRow>> {
    let opts = opts.build().map_err(|e| errors::to_py(py, e))?;
    let result = py.detach(|| -> flashattn::Result<_> {
        // SAFETY: as in `forward`; everything is only read.
        let new = new_kv.as_ref().map(|(k, v)| (k, v.as_ref()));
        let step = unsafe { decode_step(&q, new, &cache_seqlens, &cache_batch_idx, &block_table)? };
        let cache = unsafe {
            quant_cache(
                (&k_codes, &k_scales),
                v_codes.as_ref().zip(v_scales.as_ref()),
                latent_v,
                quant,
                step.q.precision(),
                paged,
            )?
        };
        let (o, lse) = unsafe { (o.view()?, lse.f32s("lse")?) };
        let out = flashattn::DecodeOutput {
            o: flashattn::Tensor {
                shape: o.shape.to_vec(),
                data: TensorData::from_bytes(o.data.as_bytes(), o.precision(), o.data.len())?,
            },
            lse: lse.to_vec(),
            lse_shape: [step.q.shape[0], step.q.shape[2], step.q.shape[1]],
            num_splits: 0,
            stats: Default::default(),
        };
        let checks = accuracy::check_decode_on_values(&out, &cache.dequantized(), &step, &opts)?;
        Ok(checks
            .iter()
            .map(|c| {
                (
                    c.name.clone(),
                    c.max_error,
                    c.bound,
                    c.passed(),
                    c.to_string(),
                )
            })
            .collect())
    });
    result.map_err(|e| errors::to_py(py, e))
}

/// One verdict of the accuracy rule: `(name, max_error, bound, passed, line)`.
type CheckRow = (String, f64, f64, bool, String);

/// The rule on a forward's (or decoding step's) `o` and `lse`.
fn o_lse_rows(
    o: &flashattn::TensorView,
    lse: &[f32],
    reference: &reference::ReferenceOutput,
    baseline: &reference::ReferenceOutput,
    opts: &flashattn::AttentionOptions,
) -> Vec<CheckRow> {
    let ratio = accuracy::forward_ratio(opts.softcap.is_some_and(|c| c > 0.0));
    let o32 = o.data.to_f32();
    vec![
        rule("o", &o32, &reference.o, &baseline.o, o.precision(), ratio),
        rule(
            "lse",
            lse,
            &reference.lse,
            &baseline.lse,
            Precision::F32,
            ratio,
        ),
    ]
}

fn rule(
    name: &str,
    got: &[f32],
    reference: &[f64],
    baseline: &[f64],
    dtype: Precision,
    ratio: f64,
) -> CheckRow {
    let got: Vec<f64> = got.iter().map(|&x| f64::from(x)).collect();
    let c = accuracy::check(name, &got, reference, baseline, dtype, ratio);
    (
        c.name.clone(),
        c.max_error,
        c.bound,
        c.passed(),
        c.to_string(),
    )
}

/// Exact attention in f64 (the reference every test checks against), on
/// the inputs as given: `(o, lse)` as flat lists in the standard layouts.
#[pyfunction]
fn reference_forward(
    py: Python<'_>,
    q: Raw,
    k: Raw,
    v: Raw,
    opts: Opts,
) -> PyResult<(Vec<f64>, Vec<f64>)> {
    let opts = opts.build().map_err(|e| errors::to_py(py, e))?;
    let result = py.detach(|| -> flashattn::Result<_> {
        // SAFETY: as in `forward`.
        let (q, k, v) = unsafe { (q.view()?, k.view()?, v.view()?) };
        let out = reference::forward(&q, &k, &v, &opts)?;
        Ok((out.o, out.lse))
    });
    result.map_err(|e| errors::to_py(py, e))
}

/// An error's variant name and fields from its `Debug` text (what
/// `flashattn.errors` builds exceptions from; exposed for its tests).
#[pyfunction]
fn _error_fields(py: Python<'_>, debug: &str) -> PyResult<(String, Py<PyDict>)> {
    let (name, fields) = errors::parse_debug(debug);
    let dict = PyDict::new(py);
    for (k, v) in fields {
        dict.set_item(k, errors::value_to_py(py, &v)?)?;
    }
    Ok((name, dict.unbind()))
}

/// The library's version.
#[pyfunction]
fn version() -> &'static str {
    env!("CARGO_PKG_VERSION")
}

/// The largest head dim the engine takes.
#[pyfunction]
fn max_head_dim() -> usize {
    flashattn::MAX_HEAD_DIM
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(backend_info, m)?)?;
    m.add_function(wrap_pyfunction!(forward, m)?)?;
    m.add_function(wrap_pyfunction!(backward, m)?)?;
    m.add_function(wrap_pyfunction!(decode, m)?)?;
    m.add_function(wrap_pyfunction!(decode_quantized, m)?)?;
    m.add_function(wrap_pyfunction!(quantize_kv_cache, m)?)?;
    m.add_function(wrap_pyfunction!(dequantize_kv_cache, m)?)?;
    m.add_function(wrap_pyfunction!(check_forward, m)?)?;
    m.add_function(wrap_pyfunction!(check_backward, m)?)?;
    m.add_function(wrap_pyfunction!(check_decode, m)?)?;
    m.add_function(wrap_pyfunction!(check_decode_quantized, m)?)?;
    m.add_function(wrap_pyfunction!(reference_forward, m)?)?;
    m.add_function(wrap_pyfunction!(_error_fields, m)?)?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add_function(wrap_pyfunction!(max_head_dim, m)?)?;
    Ok(())
}

//! A KV cache on the device: K and V ranges of storage buffers — the
//! engine's own or the app's — that decoding steps append to and read in
//! place, kept by the app between steps; read back only when asked. A
//! quantized cache (docs/kv-quantization.md) holds in each range its codes,
//! four per word, then its block scales. A latent cache's V range is K's:
//! one buffer, V read with K's row stride.

use super::buffers::{padded, STORAGE};
use super::gpu::Gpu;
use super::submit::read_back_at;
use crate::api::decode::{CacheShape, HostKvCache};
use crate::api::size;
use crate::api::tensor::{Precision, TensorData};
use crate::error::{Error, Result};
use crate::kv_quant::{CacheQuant, QuantKvCache, QuantizedKv, ScaleBlocks};

/// One of the caches: a range of a buffer (a clone of the handle, so the
/// buffer lives as long as the cache).
#[derive(Clone, Debug)]
struct CacheRange {
    buffer: wgpu::Buffer,
    offset: u64,
    /// Exactly the cache's bytes (padded to 4): what every kernel binds.
    size: u64,
}

impl CacheRange {
    fn binding(&self) -> wgpu::BufferBinding<'_> {
        wgpu::BufferBinding {
            buffer: &self.buffer,
            offset: self.offset,
            size: wgpu::BufferSize::new(self.size),
        }
    }
}

/// K and V caches of one shape and precision in device memory (f16 as raw
/// halves, two per word), in buffers the engine made
/// ([`Engine::kv_cache`](crate::Engine::kv_cache)) or on ranges of the
/// app's ([`Engine::kv_cache_in`](crate::Engine::kv_cache_in)); or int8 or
/// FP8 codes with their block scales
/// ([`Engine::upload_quantized_kv_cache`](crate::Engine::upload_quantized_kv_cache)),
/// whose steps' q, `k_new`, `v_new` and o are in `precision`.
#[derive(Debug)]
pub struct KvCache {
    shape: CacheShape,
    precision: Precision,
    quant: Option<CacheQuant>,
    k: CacheRange,
    v: CacheRange,
    /// The [`Gpu::id`] of the runtime that made it: the one engine it
    /// belongs to ([`KvCache::check_owner`]).
    owner: u64,
}

impl KvCache {
    /// Whether `gpu` is the runtime this cache was made on:
    /// `Error::ForeignCache` if not. wgpu's resource ids repeat across
    /// instances, so another engine would bind its own buffers of the
    /// same ids (reading or appending to the wrong cache, without an error).
    pub(crate) fn check_owner(&self, gpu: &Gpu) -> Result<()> {
        if self.owner != gpu.id {
            return Err(Error::ForeignCache);
        }
        Ok(())
    }

    /// An all-zero cache (wgpu zeroes new buffers) in buffers of its own.
    pub fn zeros(gpu: &Gpu, shape: CacheShape, precision: Precision) -> Result<Self> {
        let bytes = Self::bytes(gpu, &shape, precision)?;
        Ok(Self::in_new_buffers(gpu, shape, precision, None, bytes))
    }

    /// A cache in buffers of its own of `[k_bytes, v_bytes]` (zeroed).
    fn in_new_buffers(
        gpu: &Gpu,
        shape: CacheShape,
        precision: Precision,
        quant: Option<CacheQuant>,
        [k_bytes, v_bytes]: [u64; 2],
    ) -> Self {
        let range = |label, bytes| CacheRange {
            buffer: gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes,
                usage: STORAGE,
                mapped_at_creation: false,
            }),
            offset: 0,
            size: bytes,
        };
        let k = range("k cache", k_bytes);
        // A latent cache's V is a view of K: no buffer of its own.
        let v = if shape.latent {
            k.clone()
        } else {
            range("v cache", v_bytes)
        };
        Self {
            shape,
            precision,
            quant,
            k,
            v,
            owner: gpu.id,
        }
    }

    /// A device copy of a quantized host cache (checked as
    /// [`QuantKvCache::new`] checks).
    pub fn upload_quantized(gpu: &Gpu, host: &QuantKvCache) -> Result<Self> {
        host.check()?;
        host.check_codes()?;
        let bytes = Self::quantized_bytes(gpu, &host.shape)?;
        let cache = Self::in_new_buffers(gpu, host.shape, host.precision, Some(host.quant), bytes);
        let mut parts = vec![(&cache.k, &host.k)];
        // A latent cache's V range is K's.
        if !host.shape.latent {
            parts.push((&cache.v, &host.v));
        }
        for (range, kv) in parts {
            let mut words = kv.codes.clone();
            words.resize(padded(words.len() as u64) as usize, 0);
            words.extend_from_slice(bytemuck::cast_slice(&kv.scales));
            gpu.queue.write_buffer(&range.buffer, range.offset, &words);
        }
        Ok(cache)
    }

    /// An empty quantized cache: zero codes, every scale `MIN_CACHE_SCALE`.
    pub fn zeros_quantized(
        gpu: &Gpu,
        shape: CacheShape,
        quant: CacheQuant,
        precision: Precision,
    ) -> Result<Self> {
        // Through the host: the scales are not zero bits.
        Self::quantized_bytes(gpu, &shape)?;
        Self::upload_quantized(gpu, &QuantKvCache::zeros(shape, quant, precision))
    }

    /// The word where K's and V's scales start in their ranges (0 for a
    /// plain cache; a latent cache's V reads K's scales).
    pub(crate) fn scales_at(&self) -> Result<[u32; 2]> {
        if self.quant.is_none() {
            return Ok([0, 0]);
        }
        let at = |n: usize| size::to_u32("a cache's codes", padded(n as u64) as usize / 4);
        let k = at(self.shape.len())?;
        let v = if self.shape.latent { k } else { at(self.shape.v_len())? };
        Ok([k, v])
    }

    /// The quantized cache's contents, copied back to the host
    /// ([`Error::CacheFormat`] on a plain cache).
    pub async fn read_quantized(&self, gpu: &Gpu) -> Result<QuantKvCache> {
        self.check_owner(gpu)?;
        let Some(quant) = self.quant else {
            return Err(self.format_error(
                "int8 or fp8 codes".into(),
            ));
        };
        let lens = [self.shape.len(), self.shape.v_len()];
        // Each range is exactly its codes (padded) and scales; a latent
        // cache's V is K's range, no codes or scales of its own.
        let mut ranges = vec![&self.k];
        if !self.shape.latent {
            ranges.push(&self.v);
        }
        let ranges: Vec<_> = ranges.iter().map(|r| (&r.buffer, r.offset, r.size)).collect();
        let data = read_back_at(gpu, &ranges).await?;
        let part = |bytes: &[u8], n: usize| {
            let at = padded(n as u64) as usize;
            QuantizedKv {
                codes: bytes[..n].to_vec(),
                scales: bytemuck::pod_collect_to_vec(&bytes[at..]),
            }
        };
        let v = match data.get(1) {
            Some(bytes) => part(bytes, lens[1]),
            None => QuantizedKv::default(),
        };
        Ok(QuantKvCache {
            shape: self.shape,
            quant,
            precision: self.precision,
            k: part(&data[0], lens[0]),
            v,
        })
    }

    /// How the cache codes its elements: `None` for a plain cache.
    pub fn quant(&self) -> Option<CacheQuant> {
        self.quant
    }

    /// The error for a call that needs `expected` on this cache.
    pub(crate) fn format_error(&self, expected: String) -> Error {
        Error::CacheFormat {
            expected,
            found: self.format(),
        }
    }

    /// What the cache holds, in words.
    fn format(&self) -> String {
        match self.quant {
            Some(q) => format!("{} codes", q.name()),
            None => format!("{} elements", self.precision.name()),
        }
    }

    /// Bytes of K and of V of a quantized cache of `shape`: codes padded to
    /// 4, then the scales; each must fit one storage binding (a latent
    /// cache's V is K's range).
    pub fn quantized_bytes(gpu: &Gpu, shape: &CacheShape) -> Result<[u64; 2]> {
        // Checked first: a size of 0 would divide by zero in ScaleBlocks.
        shape.checked()?;
        let scales = size::elements("the scale blocks", &[ScaleBlocks::of(shape).count(), shape.heads_kv])?;
        let of = |what, dims: [usize; 4]| -> Result<u64> {
            let codes = size::elements(what, &dims)?;
            gpu.within_binding(what, padded(codes as u64) + 4 * scales as u64)
        };
        let k = of("the kv cache", shape.dims())?;
        if shape.latent {
            return Ok([k, k]);
        }
        Ok([k, of("the v cache", shape.v_dims())?])
    }

    /// A cache on ranges of the app's buffers, `k` and `v` already checked
    /// to lie inside their buffers at aligned offsets and to hold
    /// [`KvCache::bytes`]; only those bytes are ever bound. A latent cache
    /// reads V from `k`'s range (`v` is not bound).
    pub(crate) fn in_ranges(
        gpu: &Gpu,
        shape: CacheShape,
        precision: Precision,
        k: &wgpu::BufferBinding,
        v: &wgpu::BufferBinding,
        [k_bytes, v_bytes]: [u64; 2],
    ) -> Self {
        let range = |b: &wgpu::BufferBinding, size| CacheRange {
            buffer: b.buffer.clone(),
            offset: b.offset,
            size,
        };
        let k = range(k, k_bytes);
        let v = if shape.latent {
            k.clone()
        } else {
            range(v, v_bytes)
        };
        Self {
            shape,
            precision,
            quant: None,
            k,
            v,
            owner: gpu.id,
        }
    }

    /// A device copy of a host cache.
    pub fn upload(gpu: &Gpu, host: &HostKvCache) -> Result<Self> {
        let cache = Self::zeros(gpu, host.shape, host.precision())?;
        cache.write(gpu, host);
        Ok(cache)
    }

    /// `host`'s K and V written over this cache's (through the queue: they
    /// land before the next submission). The shapes must match.
    fn write(&self, gpu: &Gpu, host: &HostKvCache) {
        let mut parts = vec![(&self.k, &host.k)];
        if !self.shape.latent {
            parts.push((&self.v, &host.v));
        }
        for (range, data) in parts {
            let bytes = data.as_host().as_bytes();
            let mut words = bytes.to_vec();
            words.resize(padded(bytes.len() as u64) as usize, 0);
            gpu.queue.write_buffer(&range.buffer, range.offset, &words);
        }
    }

    /// The cache's contents, copied back to the host
    /// ([`Error::CacheFormat`] on a quantized cache).
    pub async fn read(&self, gpu: &Gpu) -> Result<HostKvCache> {
        self.check_owner(gpu)?;
        if self.quant.is_some() {
            return Err(self.format_error(format!("{} elements", self.precision.name())));
        }
        let lens = [self.shape.len(), self.shape.v_len()];
        let elem = self.precision.bytes() as u64;
        let mut ranges = vec![(&self.k.buffer, self.k.offset, lens[0] as u64 * elem)];
        // A latent cache's V is K's storage: nothing more to read.
        if !self.shape.latent {
            ranges.push((&self.v.buffer, self.v.offset, lens[1] as u64 * elem));
        }
        let mut data = read_back_at(gpu, &ranges).await?;
        let v = match self.shape.latent {
            true => TensorData::from_f32(Vec::new(), self.precision),
            false => TensorData::from_bytes(&data.pop().unwrap_or_default(), self.precision, lens[1])?,
        };
        let k = TensorData::from_bytes(&data.pop().unwrap_or_default(), self.precision, lens[0])?;
        HostKvCache::new(self.shape, k, v)
    }

    /// The cache's shape.
    pub fn shape(&self) -> &CacheShape {
        &self.shape
    }

    /// The cache's storage precision (a quantized cache: its steps').
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The buffer K is in (`(outer, inner, heads_kv, head_dim)`, row-major,
    /// from [`KvCache::k_binding`]'s offset).
    pub fn k(&self) -> &wgpu::Buffer {
        &self.k.buffer
    }

    /// The buffer V is in (K's, in a latent cache).
    pub fn v(&self) -> &wgpu::Buffer {
        &self.v.buffer
    }

    /// K's range: what the kernels bind.
    pub fn k_binding(&self) -> wgpu::BufferBinding<'_> {
        self.k.binding()
    }

    /// V's range (K's, in a latent cache: V rows are read with K's row
    /// stride, [`CacheShape::v_offset`]).
    pub fn v_binding(&self) -> wgpu::BufferBinding<'_> {
        self.v.binding()
    }

    /// Bytes of device storage the cache holds: K's range plus V's, or
    /// K's alone in a latent cache (one buffer, not two).
    pub fn storage_bytes(&self) -> u64 {
        match self.shape.latent {
            true => self.k.size,
            false => self.k.size + self.v.size,
        }
    }

    /// Bytes of K and of V for `shape` in `precision`, padded to 4; each
    /// must fit one storage binding. A latent cache's V takes none: it is
    /// a view of K.
    pub fn bytes(gpu: &Gpu, shape: &CacheShape, precision: Precision) -> Result<[u64; 2]> {
        // A shape built field by field is checked here as CacheShape::new
        // checks its own (sizes of 0, head dims past the maximum, counts).
        shape.checked()?;
        let of = |what, dims: [usize; 4]| -> Result<u64> {
            let elements = size::elements(what, &dims)?;
            gpu.within_binding(what, padded(elements as u64 * precision.bytes() as u64))
        };
        let k = of("the kv cache", shape.dims())?;
        if shape.latent {
            return Ok([k, 0]);
        }
        Ok([k, of("the v cache", shape.v_dims())?])
    }
}

//! A KV cache on the device: K and V ranges of storage buffers — the
//! engine's own or the app's — that decoding steps append to and read in
//! place, kept by the app between steps; read back only when asked.

use super::buffers::{padded, STORAGE};
use super::gpu::Gpu;
use super::submit::read_back_at;
use crate::api::decode::{CacheShape, HostKvCache};
use crate::api::size;
use crate::api::tensor::{Precision, TensorData};
use crate::error::Result;

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
/// app's ([`Engine::kv_cache_in`](crate::Engine::kv_cache_in)).
#[derive(Debug)]
pub struct KvCache {
    shape: CacheShape,
    precision: Precision,
    k: CacheRange,
    v: CacheRange,
}

impl KvCache {
    /// An all-zero cache (wgpu zeroes new buffers) in buffers of its own.
    pub fn zeros(gpu: &Gpu, shape: CacheShape, precision: Precision) -> Result<Self> {
        let [k_bytes, v_bytes] = Self::bytes(gpu, &shape, precision)?;
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
        Ok(Self {
            shape,
            precision,
            k: range("k cache", k_bytes),
            v: range("v cache", v_bytes),
        })
    }

    /// A cache on ranges of the app's buffers, `k` and `v` already checked
    /// to lie inside their buffers at aligned offsets and to hold
    /// [`KvCache::bytes`]; only those bytes are ever bound.
    pub(crate) fn in_ranges(
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
        Self {
            shape,
            precision,
            k: range(k, k_bytes),
            v: range(v, v_bytes),
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
        for (range, data) in [(&self.k, &host.k), (&self.v, &host.v)] {
            let bytes = data.as_host().as_bytes();
            let mut words = bytes.to_vec();
            words.resize(padded(bytes.len() as u64) as usize, 0);
            gpu.queue.write_buffer(&range.buffer, range.offset, &words);
        }
    }

    /// The cache's contents, copied back to the host.
    pub async fn read(&self, gpu: &Gpu) -> Result<HostKvCache> {
        let lens = [self.shape.len(), self.shape.v_len()];
        let elem = self.precision.bytes() as u64;
        let ranges = [(&self.k, lens[0]), (&self.v, lens[1])]
            .map(|(r, n)| (&r.buffer, r.offset, n as u64 * elem));
        let mut data = read_back_at(gpu, &ranges).await?;
        let v = TensorData::from_bytes(&data.pop().unwrap_or_default(), self.precision, lens[1]);
        let k = TensorData::from_bytes(&data.pop().unwrap_or_default(), self.precision, lens[0]);
        HostKvCache::new(self.shape, k, v)
    }

    /// The cache's shape.
    pub fn shape(&self) -> &CacheShape {
        &self.shape
    }

    /// The cache's storage precision.
    pub fn precision(&self) -> Precision {
        self.precision
    }

    /// The buffer K is in (`(outer, inner, heads_kv, head_dim)`, row-major,
    /// from [`KvCache::k_binding`]'s offset).
    pub fn k(&self) -> &wgpu::Buffer {
        &self.k.buffer
    }

    /// The buffer V is in.
    pub fn v(&self) -> &wgpu::Buffer {
        &self.v.buffer
    }

    /// K's range: what the kernels bind.
    pub fn k_binding(&self) -> wgpu::BufferBinding<'_> {
        self.k.binding()
    }

    /// V's range.
    pub fn v_binding(&self) -> wgpu::BufferBinding<'_> {
        self.v.binding()
    }

    /// Bytes of K and of V for `shape` in `precision`, padded to 4; each
    /// must fit one storage binding.
    pub fn bytes(gpu: &Gpu, shape: &CacheShape, precision: Precision) -> Result<[u64; 2]> {
        // A shape built field by field is checked here (CacheShape::new checks its own).
        let of = |what, dims: [usize; 4]| -> Result<u64> {
            let elements = size::elements(what, &dims)?;
            gpu.within_binding(what, padded(elements as u64 * precision.bytes() as u64))
        };
        Ok([
            of("the kv cache", shape.dims())?,
            of("the v cache", shape.v_dims())?,
        ])
    }
}

//! A KV cache on the device: K and V storage buffers that decoding steps
//! append to and read in place, kept by the app between steps; read back
//! only when asked.

use super::buffers::{padded, STORAGE};
use super::gpu::Gpu;
use super::submit::read_back;
use crate::api::decode::{CacheShape, HostKvCache};
use crate::api::size;
use crate::api::tensor::{Precision, TensorData};
use crate::error::{Error, Result};

/// K and V caches of one shape and precision in device memory (f16 as raw
/// halves, two per word).
#[derive(Debug)]
pub struct KvCache {
    shape: CacheShape,
    precision: Precision,
    k: wgpu::Buffer,
    v: wgpu::Buffer,
}

impl KvCache {
    /// An all-zero cache (wgpu zeroes new buffers).
    pub fn zeros(gpu: &Gpu, shape: CacheShape, precision: Precision) -> Result<Self> {
        let bytes = Self::bytes(gpu, &shape, precision)?;
        let buffer = |label| {
            gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size: bytes,
                usage: STORAGE,
                mapped_at_creation: false,
            })
        };
        Ok(Self {
            shape,
            precision,
            k: buffer("k cache"),
            v: buffer("v cache"),
        })
    }

    /// A device copy of a host cache.
    pub fn upload(gpu: &Gpu, host: &HostKvCache) -> Result<Self> {
        let cache = Self::zeros(gpu, host.shape, host.precision())?;
        for (buffer, data) in [(&cache.k, &host.k), (&cache.v, &host.v)] {
            let bytes = data.as_host().as_bytes();
            let mut words = bytes.to_vec();
            words.resize(padded(bytes.len() as u64) as usize, 0);
            gpu.queue.write_buffer(buffer, 0, &words);
        }
        Ok(cache)
    }

    /// The cache's contents, copied back to the host.
    pub async fn read(&self, gpu: &Gpu) -> Result<HostKvCache> {
        let bytes = (self.shape.len() * self.precision.bytes()) as u64;
        let mut data = read_back(gpu, &[(&self.k, bytes), (&self.v, bytes)]).await?;
        let n = self.shape.len();
        let v = TensorData::from_bytes(&data.pop().unwrap_or_default(), self.precision, n);
        let k = TensorData::from_bytes(&data.pop().unwrap_or_default(), self.precision, n);
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

    /// The K buffer (`(outer, inner, heads_kv, head_dim)`, row-major).
    pub fn k(&self) -> &wgpu::Buffer {
        &self.k
    }

    /// The V buffer (as the K buffer).
    pub fn v(&self) -> &wgpu::Buffer {
        &self.v
    }

    /// Bytes of one of the buffers; it must fit one storage binding.
    fn bytes(gpu: &Gpu, shape: &CacheShape, precision: Precision) -> Result<u64> {
        // A shape built field by field is checked here (CacheShape::new checks its own).
        let elements = size::elements("the kv cache", &shape.dims())?;
        let bytes = padded(elements as u64 * precision.bytes() as u64);
        if bytes > gpu.max_binding() {
            return Err(Error::BindingTooLarge {
                what: "the kv cache",
                bytes,
                max: gpu.max_binding(),
            });
        }
        Ok(bytes)
    }
}

//! Device buffers reused across calls. A call takes buffers of the exact
//! sizes it needs from the pool (or creates them) and gives them back when
//! it ends, so repeated calls on the same shapes — benchmarks, training
//! steps, decoding — allocate nothing after the first. Every buffer a call
//! uses is recorded in its stats (they coexist, so their sum is its peak).

use crate::error::{Error, Result};
use std::collections::HashMap;
use std::sync::Mutex;

/// Usage of every pooled storage buffer: kernels bind it, uploads write it,
/// readbacks copy from it.
pub const STORAGE: wgpu::BufferUsages = wgpu::BufferUsages::STORAGE
    .union(wgpu::BufferUsages::COPY_SRC)
    .union(wgpu::BufferUsages::COPY_DST);
/// Usage of pooled uniform buffers.
pub const UNIFORM: wgpu::BufferUsages =
    wgpu::BufferUsages::UNIFORM.union(wgpu::BufferUsages::COPY_DST);

/// Most bytes of idle buffers a pool keeps unless the engine is given
/// another cap; beyond it, returned buffers are dropped (freed).
pub const POOL_BYTES: u64 = 512 << 20;

/// Idle buffers by (size, usage), up to a byte cap. Calls on many threads
/// take and give back through one lock; a buffer is held by one call at a
/// time.
pub struct BufferPool {
    idle: Mutex<Idle>,
    /// Most bytes of idle buffers kept.
    cap: u64,
}

impl Default for BufferPool {
    fn default() -> Self {
        Self::with_cap(POOL_BYTES)
    }
}

#[derive(Default)]
struct Idle {
    buffers: HashMap<(u64, wgpu::BufferUsages), Vec<wgpu::Buffer>>,
    bytes: u64,
}

impl BufferPool {
    /// An empty pool that keeps at most `cap` bytes of idle buffers (0:
    /// none, every call allocates its own).
    pub fn with_cap(cap: u64) -> Self {
        Self {
            idle: Mutex::default(),
            cap,
        }
    }

    /// The most bytes of idle buffers this pool keeps.
    pub fn cap(&self) -> u64 {
        self.cap
    }

    /// Free every idle buffer (buffers calls in flight hold are not idle:
    /// they come back, up to the cap, when those calls end).
    pub fn trim(&self) {
        if let Ok(mut idle) = self.idle.lock() {
            *idle = Idle::default();
        }
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, Idle>> {
        self.idle.lock().map_err(|_| Error::Poisoned {
            what: "the buffer pool",
        })
    }

    /// An idle buffer of exactly `size` bytes and `usage`, or a new one.
    /// Its contents are whatever the last user left.
    pub fn take(
        &self,
        device: &wgpu::Device,
        label: &'static str,
        size: u64,
        usage: wgpu::BufferUsages,
    ) -> Result<wgpu::Buffer> {
        let mut idle = self.lock()?;
        if let Some(b) = idle.buffers.get_mut(&(size, usage)).and_then(Vec::pop) {
            idle.bytes -= size;
            return Ok(b);
        }
        drop(idle);
        Ok(device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(label),
            size,
            usage,
            mapped_at_creation: false,
        }))
    }

    /// Keep `buffer` for a later call (or free it when the pool is full).
    pub fn give_back(&self, buffer: wgpu::Buffer) {
        let Ok(mut idle) = self.idle.lock() else {
            return;
        };
        let size = buffer.size();
        if idle.bytes + size > self.cap {
            return;
        }
        idle.bytes += size;
        idle.buffers
            .entry((size, buffer.usage()))
            .or_default()
            .push(buffer);
    }

    /// Bytes of idle buffers held.
    pub fn idle_bytes(&self) -> u64 {
        self.idle.lock().map(|i| i.bytes).unwrap_or(0)
    }
}

/// `bytes` rounded up to a storage buffer's granularity (4, at least 4).
pub fn padded(bytes: u64) -> u64 {
    bytes.max(4).next_multiple_of(4)
}

//! Work buffers kept between calls. The packed inputs and the tasks'
//! partial sums are O(N·d) floats each, allocated and freed on every call;
//! fresh memory costs a page fault per 4 KiB on first touch (about 0.5 ms
//! per MiB on the machine the backend was tuned on, five times the cost of
//! copying it), which at N 1024 took a fifth of the backward. A buffer
//! dropped here is kept for the next call that needs one at least as
//! large, up to [`KEEP_BYTES`] in all; what a call returns to its caller
//! is never pooled. Contents are zeroed on reuse, so results never depend
//! on what ran before.

use std::ops::{Deref, DerefMut};
use std::sync::{Mutex, MutexGuard};

/// Idle bytes kept at most (the oldest buffers go first).
const KEEP_BYTES: usize = 512 << 20;

/// Buffers smaller than this are left to the allocator, which reuses them
/// without faults anyway.
const MIN_BYTES: usize = 256 << 10;

/// Idle buffers, oldest first.
static IDLE: Mutex<Vec<Vec<f32>>> = Mutex::new(Vec::new());

fn idle() -> MutexGuard<'static, Vec<Vec<f32>>> {
    // A panic elsewhere while holding the lock leaves a valid list.
    IDLE.lock().unwrap_or_else(|e| e.into_inner())
}

/// A zeroed work buffer of floats that goes back to the pool when dropped.
pub(crate) struct Buffer(Vec<f32>);

impl Buffer {
    /// `len` zeros: the smallest idle buffer that holds them, or a new one.
    pub fn zeroed(len: usize) -> Self {
        let reused = (len * 4 >= MIN_BYTES).then(|| take(len)).flatten();
        let mut v = reused.unwrap_or_default();
        v.clear();
        v.resize(len, 0.0);
        Buffer(v)
    }
}

/// The smallest idle buffer with room for `len` floats, out of the pool.
fn take(len: usize) -> Option<Vec<f32>> {
    let mut idle = idle();
    let (at, _) = idle
        .iter()
        .enumerate()
        .filter(|(_, v)| v.capacity() >= len)
        .min_by_key(|(_, v)| v.capacity())?;
    Some(idle.remove(at))
}

impl Drop for Buffer {
    fn drop(&mut self) {
        let v = std::mem::take(&mut self.0);
        if v.capacity() * 4 < MIN_BYTES {
            return;
        }
        let mut idle = idle();
        idle.push(v);
        let mut bytes: usize = idle.iter().map(|v| v.capacity() * 4).sum();
        while bytes > KEEP_BYTES {
            bytes -= idle.remove(0).capacity() * 4;
        }
    }
}

impl Deref for Buffer {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.0
    }
}

impl DerefMut for Buffer {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reused_buffers_are_zeroed_and_sized() {
        let n = MIN_BYTES; // floats: four times the pooling threshold
        let mut a = Buffer::zeroed(n);
        a.fill(7.0);
        drop(a);
        let b = Buffer::zeroed(n / 2);
        assert_eq!(b.len(), n / 2);
        assert!(b.iter().all(|&x| x == 0.0));
        let small = Buffer::zeroed(3);
        assert_eq!(&small[..], &[0.0; 3]);
    }
}

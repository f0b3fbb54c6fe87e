//! The app's buffers in the encoded-call tests: each tensor sub-allocated
//! at an aligned, non-zero offset of the buffer it is put in, the gaps (and
//! outputs before a call) filled with a float no kernel writes there, so a
//! test sees every byte a call wrote.

use flashattn::Engine;

/// What the buffers are filled with outside the tensors (and in o and lse
/// before the call): a float no kernel writes here.
pub const SENTINEL: f32 = 7.25;

/// The app's buffers, each tensor at an aligned, non-zero offset of the
/// buffer the test puts it in, with gaps between tensors.
pub struct Arena {
    pub buffers: Vec<wgpu::Buffer>,
    /// `(buffer, offset, bytes)` of each tensor.
    pub at: Vec<(usize, u64, u64)>,
}

impl Arena {
    /// `(buffer, contents)` of each tensor.
    pub fn new(e: &Engine, tensors: &[(usize, &[u8])]) -> Self {
        let align = e.limits().min_storage_buffer_offset_alignment as u64;
        let count = tensors.iter().map(|t| t.0).max().unwrap_or(0) + 1;
        let mut next = vec![align; count];
        let mut at = Vec::new();
        for &(buffer, bytes) in tensors {
            at.push((buffer, next[buffer], bytes.len() as u64));
            next[buffer] = (next[buffer] + bytes.len() as u64).div_ceil(align) * align + align;
        }
        let mut fill: Vec<Vec<f32>> = next
            .iter()
            .map(|&n| vec![SENTINEL; n as usize / 4])
            .collect();
        for (&(_, bytes), &(buffer, offset, _)) in tensors.iter().zip(&at) {
            let words: Vec<f32> = bytemuck::pod_collect_to_vec(bytes);
            let start = offset as usize / 4;
            fill[buffer][start..start + words.len()].copy_from_slice(&words);
        }
        use wgpu::util::DeviceExt;
        let buffers = fill
            .iter()
            .map(|words| {
                e.device()
                    .create_buffer_init(&wgpu::util::BufferInitDescriptor {
                        label: Some("app arena"),
                        contents: bytemuck::cast_slice(words),
                        usage: wgpu::BufferUsages::STORAGE
                            | wgpu::BufferUsages::COPY_SRC
                            | wgpu::BufferUsages::COPY_DST,
                    })
            })
            .collect();
        Self { buffers, at }
    }

    pub fn binding(&self, i: usize) -> wgpu::BufferBinding<'_> {
        let (buffer, offset, bytes) = self.at[i];
        wgpu::BufferBinding {
            buffer: &self.buffers[buffer],
            offset,
            size: wgpu::BufferSize::new(bytes),
        }
    }

    /// Record copies of every buffer into `encoder`, submit it once, and
    /// read the copies back.
    pub fn submit_and_read(&self, e: &Engine, mut encoder: wgpu::CommandEncoder) -> Vec<Vec<u8>> {
        let dev = e.device();
        let staging: Vec<wgpu::Buffer> = self
            .buffers
            .iter()
            .map(|b| {
                let staging = dev.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("app readback"),
                    size: b.size(),
                    usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                encoder.copy_buffer_to_buffer(b, 0, &staging, 0, b.size());
                staging
            })
            .collect();
        e.queue().submit([encoder.finish()]);
        for s in &staging {
            s.slice(..).map_async(wgpu::MapMode::Read, |_| {});
        }
        dev.poll(wgpu::PollType::wait_indefinitely()).unwrap();
        staging
            .iter()
            .map(|s| s.slice(..).get_mapped_range().unwrap().to_vec())
            .collect()
    }

    pub fn slice<'b>(&self, bytes: &'b [Vec<u8>], i: usize) -> &'b [u8] {
        let (buffer, offset, len) = self.at[i];
        &bytes[buffer][offset as usize..(offset + len) as usize]
    }

    /// Tensor `i` holds `want[i]` where given (a scratch is not
    /// compared), and everything outside the tensors is what the buffers
    /// were filled with (compared as bytes, reported without them: they
    /// are thousands).
    pub fn holds(&self, bytes: &[Vec<u8>], want: &[Option<&[u8]>]) {
        for (i, t) in want.iter().enumerate() {
            let got = self.slice(bytes, i);
            assert!(t.is_none_or(|t| got == t), "tensor {i} is not as expected");
        }
        for (n, bytes) in bytes.iter().enumerate() {
            let mut words: Vec<f32> = bytemuck::pod_collect_to_vec(bytes);
            for &(_, offset, len) in self.at.iter().filter(|a| a.0 == n) {
                words[offset as usize / 4..(offset + len) as usize / 4].fill(SENTINEL);
            }
            assert!(
                words.iter().all(|&w| w == SENTINEL),
                "bytes outside the tensors of buffer {n} changed"
            );
        }
    }
}

/// `bytes` bytes of [`SENTINEL`]: what an output range starts as.
pub fn sentinels(bytes: u64) -> Vec<u8> {
    bytemuck::cast_slice(&vec![SENTINEL; bytes as usize / 4]).to_vec()
}

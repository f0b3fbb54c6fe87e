//! Compiled pipelines, one per [`KernelKey`]: a kernel is composed and
//! compiled the first time a call needs it and reused afterwards.

use super::scope::checked;
use crate::error::{Error, Result};
use crate::kernels::KernelKey;
use std::collections::HashMap;
use std::sync::Mutex;

/// Pipelines by kernel key.
#[derive(Default)]
pub struct PipelineCache {
    pipelines: Mutex<HashMap<KernelKey, wgpu::ComputePipeline>>,
}

impl PipelineCache {
    fn lock(&self) -> Result<std::sync::MutexGuard<'_, HashMap<KernelKey, wgpu::ComputePipeline>>> {
        self.pipelines.lock().map_err(|_| Error::Poisoned {
            what: "the pipeline cache",
        })
    }

    /// Number of compiled pipelines held.
    pub fn len(&self) -> usize {
        self.pipelines.lock().map(|p| p.len()).unwrap_or(0)
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The pipeline of `key` on `device`, compiled on first use (device
    /// errors become `Err`).
    pub async fn get(
        &self,
        device: &wgpu::Device,
        key: &KernelKey,
    ) -> Result<wgpu::ComputePipeline> {
        if let Some(p) = self.lock()?.get(key) {
            return Ok(p.clone());
        }
        let started = web_time::Instant::now();
        let pipeline = checked(device, "compiling a kernel", || Ok(compile(device, key))).await?;
        if trace() {
            // What a test binary costs on a driver without a shader cache
            // (the thread names the test under libtest).
            eprintln!(
                "flashattn trace: compiled {} in {:.0} ms on {} ({key:?})",
                key.name(),
                started.elapsed().as_secs_f64() * 1e3,
                std::thread::current().name().unwrap_or("?")
            );
        }
        self.lock()?.insert(*key, pipeline.clone());
        Ok(pipeline)
    }
}

/// Whether `FLASHATTN_TRACE_PIPELINES=1` asks for each compile on stderr.
fn trace() -> bool {
    static TRACE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *TRACE.get_or_init(|| std::env::var("FLASHATTN_TRACE_PIPELINES").is_ok_and(|v| v == "1"))
}

fn compile(device: &wgpu::Device, key: &KernelKey) -> wgpu::ComputePipeline {
    let source = key.source();
    let label = Some(key.name());
    let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
        label,
        source: wgpu::ShaderSource::Wgsl(source.text.into()),
    });
    device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
        label,
        layout: None,
        module: &module,
        entry_point: Some(source.entry),
        compilation_options: wgpu::PipelineCompilationOptions {
            constants: &source.overrides,
            // Every kernel writes the workgroup memory it reads before
            // reading it, so the zeroing WebGPU would add is dead work —
            // and under llvmpipe's GL driver it made a tiled kernel's
            // first compile take ~30 s instead of 0.2 s.
            zero_initialize_workgroup_memory: false,
        },
        cache: None,
    })
}

//! Compiled pipelines, one per [`KernelKey`]: a kernel is composed and
//! compiled the first time a call needs it and reused afterwards.

use super::scope::checked;
use crate::error::{Error, Result};
use crate::kernels::KernelKey;
use std::collections::HashMap;
use std::sync::Mutex;

/// Pipelines by kernel key, and the runtime checks they are compiled with.
#[derive(Default)]
pub struct PipelineCache {
    pipelines: Mutex<HashMap<KernelKey, wgpu::ComputePipeline>>,
    checks: Option<ShaderChecks>,
}

impl PipelineCache {
    fn lock(&self) -> Result<std::sync::MutexGuard<'_, HashMap<KernelKey, wgpu::ComputePipeline>>> {
        self.pipelines.lock().map_err(|_| Error::Poisoned {
            what: "the pipeline cache",
        })
    }

    /// Keep naga's loop counters where the adapter has a loop limit
    /// (llvmpipe): the loop model of docs/kernels.md was measured on that
    /// code, and llvmpipe unrolls more loops without them, so the model
    /// would overcount and cut calls into needless pieces. Elsewhere they
    /// go (see [`ShaderChecks::NoLoopBounding`]). `FLASHATTN_SHADER_CHECKS`
    /// overrides both. Call before the first kernel past the loop probe.
    pub fn adapt_to_loop_limit(&mut self, limited: bool) {
        self.checks = Some(match (shader_checks_override(), limited) {
            (Some(checks), _) => checks,
            (None, true) => ShaderChecks::Checked,
            (None, false) => ShaderChecks::NoLoopBounding,
        });
    }

    /// The checks kernels are compiled with.
    pub fn checks(&self) -> ShaderChecks {
        self.checks
            .or_else(shader_checks_override)
            .unwrap_or(ShaderChecks::NoLoopBounding)
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
        let checks = self.checks();
        let pipeline = checked(device, "compiling a kernel", || {
            Ok(compile(device, key, checks))
        })
        .await?;
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

/// Which of wgpu's runtime checks the kernels are compiled with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ShaderChecks {
    /// Every check wgpu adds by default (bounds clamps and a counter in
    /// every loop).
    Checked,
    /// Bounds clamps without the loop counters (the default where the
    /// adapter has no loop limit): a counter in a loop with a constant trip
    /// count keeps a driver from unrolling it, and the arrays it indexes
    /// then live in memory instead of registers. On NVIDIA's Vulkan driver
    /// the counters made every kernel 8–15× slower (docs/kernels.md).
    NoLoopBounding,
    /// No checks injected (the platform's own robust buffer access only).
    Unchecked,
}

impl ShaderChecks {
    fn runtime_checks(self) -> wgpu::ShaderRuntimeChecks {
        let mut checks = wgpu::ShaderRuntimeChecks::checked();
        match self {
            Self::Checked => {}
            Self::NoLoopBounding => checks.force_loop_bounding = false,
            Self::Unchecked => checks = wgpu::ShaderRuntimeChecks::unchecked(),
        }
        checks
    }
}

/// `FLASHATTN_SHADER_CHECKS=checked|no-loop-bounding|unchecked`, read once.
fn shader_checks_override() -> Option<ShaderChecks> {
    static CHECKS: std::sync::OnceLock<Option<ShaderChecks>> = std::sync::OnceLock::new();
    *CHECKS.get_or_init(|| match std::env::var("FLASHATTN_SHADER_CHECKS").as_deref() {
        Ok("checked") => Some(ShaderChecks::Checked),
        Ok("no-loop-bounding") => Some(ShaderChecks::NoLoopBounding),
        Ok("unchecked") => Some(ShaderChecks::Unchecked),
        _ => None,
    })
}

fn compile(device: &wgpu::Device, key: &KernelKey, checks: ShaderChecks) -> wgpu::ComputePipeline {
    let source = key.source();
    let label = Some(key.name());
    let desc = wgpu::ShaderModuleDescriptor {
        label,
        source: wgpu::ShaderSource::Wgsl(source.text.into()),
    };
    // SAFETY: every loop of every kernel is counted by uniform sizes (none
    // can run forever), which is what dropping naga's loop bounding asks;
    // bounds checks are dropped only where FLASHATTN_SHADER_CHECKS says so.
    let module = unsafe { device.create_shader_module_trusted(desc, checks.runtime_checks()) };
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The counters stay where the adapter has a loop limit and go
    /// elsewhere (unless FLASHATTN_SHADER_CHECKS names a setting).
    #[test]
    fn loop_counters_stay_only_where_the_adapter_has_a_loop_limit() {
        let (mut limited, mut free) = (PipelineCache::default(), PipelineCache::default());
        limited.adapt_to_loop_limit(true);
        free.adapt_to_loop_limit(false);
        match shader_checks_override() {
            Some(o) => assert_eq!((limited.checks(), free.checks()), (o, o)),
            None => {
                assert_eq!(limited.checks(), ShaderChecks::Checked);
                assert_eq!(free.checks(), ShaderChecks::NoLoopBounding);
                assert!(!free.checks().runtime_checks().force_loop_bounding);
                assert!(free.checks().runtime_checks().bounds_checks);
                assert!(limited.checks().runtime_checks().force_loop_bounding);
            }
        }
    }
}

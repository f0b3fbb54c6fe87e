//! Finding adapters and opening a device on one: the adapter's real limits
//! are requested (the WebGPU defaults would halve the tiles), the features
//! flashattn uses where offered, and the loop-limit probe runs.

use super::call::{Call, Dispatch};
use super::gpu::Gpu;
use super::loop_limit::LoopLimit;
use crate::error::{Error, Result};
use crate::kernels::loop_probe::PROBE_BOUND;
use crate::kernels::LoopProbe;

/// Features flashattn uses when the adapter has them (cooperative matrices
/// for the coop kernel, `plan::coop`).
fn wanted_features(adapter: wgpu::Features) -> wgpu::Features {
    adapter
        & (wgpu::Features::SHADER_F16
            | wgpu::Features::TIMESTAMP_QUERY
            | wgpu::Features::SUBGROUP
            | wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
}

/// wgpu 30 refuses a device with an `EXPERIMENTAL_*` feature unless the
/// descriptor carries this token; only cooperative matrices ask for it.
fn experimental(features: wgpu::Features) -> wgpu::ExperimentalFeatures {
    if features.intersects(wgpu::Features::all_experimental_mask()) {
        // SAFETY: wgpu's experimental APIs may carry bugs; flashattn uses
        // only cooperative-matrix types and operations in one kernel, which
        // `tests/shaders_coop.rs` validates with naga for every variant.
        unsafe { wgpu::ExperimentalFeatures::enabled() }
    } else {
        wgpu::ExperimentalFeatures::disabled()
    }
}

/// Whether an adapter runs on the CPU (llvmpipe over Vulkan or GL,
/// SwiftShader, WARP) rather than on GPU hardware.
#[cfg(not(target_arch = "wasm32"))]
pub fn is_software(info: &wgpu::AdapterInfo) -> bool {
    info.device_type == wgpu::DeviceType::Cpu
}

/// How good an adapter is for attention: hardware before software, and
/// Vulkan, Metal or DX12 before GL (no f16, no subgroups, slow compiles).
#[cfg(not(target_arch = "wasm32"))]
fn rank(info: &wgpu::AdapterInfo) -> (u8, u8) {
    let kind = match info.device_type {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Other => 3,
        wgpu::DeviceType::Cpu => 4,
    };
    (kind, (info.backend == wgpu::Backend::Gl) as u8)
}

/// The instance descriptor: `WGPU_BACKEND` (e.g. `vulkan`, `gl`) restricts
/// the backends when set; else `backends`.
fn descriptor(backends: wgpu::Backends) -> (wgpu::InstanceDescriptor, bool) {
    let mut desc = wgpu::InstanceDescriptor::new_without_display_handle_from_env();
    let from_env = std::env::var_os("WGPU_BACKEND").is_some();
    if !from_env {
        desc.backends = backends;
    }
    (desc, from_env)
}

/// Every adapter this machine offers, best first. GL is tried only when
/// Vulkan, Metal and DX12 offer nothing (or `WGPU_BACKEND` asks for it).
#[cfg(not(target_arch = "wasm32"))]
pub async fn adapters() -> Vec<wgpu::Adapter> {
    let mut found = Vec::new();
    for backends in [wgpu::Backends::PRIMARY, wgpu::Backends::SECONDARY] {
        let (desc, from_env) = descriptor(backends);
        let instance = wgpu::Instance::new(desc);
        found = instance.enumerate_adapters(wgpu::Backends::all()).await;
        if !found.is_empty() || from_env {
            break;
        }
    }
    found.sort_by_key(|a| rank(&a.get_info()));
    found
}

/// The best adapter (the browser's on the web).
pub async fn best_adapter() -> Result<wgpu::Adapter> {
    #[cfg(not(target_arch = "wasm32"))]
    if let Some(a) = adapters().await.into_iter().next() {
        return Ok(a);
    }
    // Nothing enumerated (or the web): ask, to get wgpu's reason with the error.
    let (desc, _) = descriptor(wgpu::Backends::all());
    let options = wgpu::RequestAdapterOptions {
        power_preference: wgpu::PowerPreference::HighPerformance,
        ..Default::default()
    };
    wgpu::Instance::new(desc)
        .request_adapter(&options)
        .await
        .map_err(|source| Error::NoAdapter { source })
}

/// A device on `adapter` with its real limits, probed for its loop limit.
pub async fn open(adapter: &wgpu::Adapter) -> Result<Gpu> {
    let info = adapter.get_info();
    let features = wanted_features(adapter.features());
    let coop = wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX;
    let mut opened = request(adapter, features).await;
    if opened.is_err() && features.contains(coop) {
        // An experimental feature must not cost the device: without it
        // every kernel but the coop one still runs.
        opened = request(adapter, features - coop).await;
    }
    let (device, queue) = opened.map_err(|source| Error::RequestDevice {
        adapter: info.name.clone(),
        source,
    })?;
    let mut gpu = Gpu::new(device, queue, info);
    // The engine's own device: errors past its scopes are its to report.
    gpu.keep_uncaptured();
    gpu.coop_properties = adapter.cooperative_matrix_properties();
    probe(&mut gpu).await?;
    Ok(gpu)
}

/// A device on `adapter` with its real limits and `features`.
async fn request(
    adapter: &wgpu::Adapter,
    features: wgpu::Features,
) -> std::result::Result<(wgpu::Device, wgpu::Queue), wgpu::RequestDeviceError> {
    adapter
        .request_device(&wgpu::DeviceDescriptor {
            label: Some("flashattn"),
            required_features: features,
            required_limits: adapter.limits(),
            experimental_features: experimental(features),
            ..Default::default()
        })
        .await
}

/// A [`Gpu`] as a guest on an app's device (opened on `adapter`), probed
/// for its loop limit. The device's features and limits are what it was
/// opened with; the adapter gives its name and its cooperative-matrix
/// configurations. The app's uncaptured-error handler stays: the engine's
/// work runs inside error scopes only.
pub async fn wrap(
    adapter: &wgpu::Adapter,
    device: wgpu::Device,
    queue: wgpu::Queue,
) -> Result<Gpu> {
    let mut gpu = Gpu::new(device, queue, adapter.get_info());
    if gpu
        .features
        .contains(wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX)
    {
        gpu.coop_properties = adapter.cooperative_matrix_properties();
    }
    probe(&mut gpu).await?;
    Ok(gpu)
}

/// Run the loop-limit probe on `gpu` and record what it finds.
async fn probe(gpu: &mut Gpu) -> Result<()> {
    let done = {
        let mut call = Call::new(gpu, None);
        let words = call.upload("loop probe", bytemuck::cast_slice(&[PROBE_BOUND, 0]))?;
        let dispatch = Dispatch {
            kernel: LoopProbe.into(),
            uniforms: Vec::new(),
            buffers: super::call::whole([(0, &words)]),
            grid: [1, 1, 1],
            walk: None,
        };
        call.run(&[dispatch]).await?;
        let bytes = call.read(&[(&words, 8)]).await?;
        bytemuck::pod_read_unaligned::<u32>(&bytes[0][4..8])
    };
    gpu.loop_limit = LoopLimit::new((done < PROBE_BOUND).then_some(done));
    gpu.pipelines
        .adapt_to_loop_limit(gpu.loop_limit.limit().is_some());
    Ok(())
}

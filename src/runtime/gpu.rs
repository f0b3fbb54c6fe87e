//! The device flashattn runs on: wgpu handles, what the adapter offers, the
//! engine's settings, and the shared state calls use (pipelines, buffers,
//! the loop limit, errors no scope captured).

use super::buffers::BufferPool;
use super::loop_limit::LoopLimit;
use super::pipelines::PipelineCache;
use crate::error::{Error, Result};
use crate::kernels::{LoopCheck, Variant};
use crate::plan::decode::GPU_PARALLEL_WORKGROUPS;
use crate::plan::{CoopForm, DeviceCaps, Plan};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

/// Settings that change what the planner sees or what kernels carry.
#[derive(Clone, Copy, Debug, Default)]
pub struct Settings {
    /// Pretend storage bindings hold at most this many bytes.
    pub binding_cap: Option<u64>,
    /// Plan with at most this much workgroup storage.
    pub workgroup_storage_cap: Option<u32>,
    /// Default to the tiled kernels: never the lanes or coop ones, nor the
    /// registers ones unless asked for.
    pub tiled_only: bool,
    /// Plan as if the device had 8×8 f32 cooperative matrices and run the
    /// coop kernel with them emulated (`CoopForm::Emulated`): tests.
    pub emulate_coop: bool,
    /// Do not split calls by the predicted loop count (the guard still
    /// catches kernels cut short): for testing the guard.
    pub no_loop_prediction: bool,
    /// Kernels measure the loop iterations they take instead of guarding
    /// (testing the loop model; adapters with a loop limit only).
    pub loop_meter: bool,
}

/// The next [`Gpu::id`].
static NEXT_ID: AtomicU64 = AtomicU64::new(0);

/// One wgpu device and everything calls on it share.
pub struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub info: wgpu::AdapterInfo,
    pub limits: wgpu::Limits,
    pub features: wgpu::Features,
    /// The adapter's cooperative-matrix configurations (empty where unknown).
    pub coop_properties: Vec<wgpu::CooperativeMatrixProperties>,
    pub settings: Settings,
    /// Two atomic words (reads, writes) when kernels count their accesses.
    pub io_counter: Option<wgpu::Buffer>,
    pub loop_limit: LoopLimit,
    pub pipelines: PipelineCache,
    pub pool: BufferPool,
    /// The first device error no scope captured, reported by the next call
    /// (filled only on a device the engine opened: on a wrapped one,
    /// whatever escapes the engine's scopes is the app's).
    pub uncaptured: Arc<Mutex<Option<String>>>,
    /// Queue submissions the engine made itself (known-answer checks,
    /// host-tensor calls, read-backs); an app's encoded calls add none.
    pub submissions: AtomicU64,
    /// This runtime's own number, which the device caches it makes carry:
    /// wgpu's resource ids repeat across instances, so a cache bound
    /// through another engine's device would name that device's buffers.
    pub id: u64,
}

impl Gpu {
    /// Wrap a device (its limits and features are read from it), leaving
    /// its uncaptured-error handler alone. The loop limit is unknown until
    /// the probe of [`wrap`](super::adapter::wrap) (or
    /// [`open`](super::adapter::open)) runs.
    pub fn new(device: wgpu::Device, queue: wgpu::Queue, info: wgpu::AdapterInfo) -> Self {
        Self {
            limits: device.limits(),
            features: device.features(),
            coop_properties: Vec::new(),
            device,
            queue,
            info,
            settings: Settings::default(),
            io_counter: None,
            loop_limit: LoopLimit::default(),
            pipelines: PipelineCache::default(),
            pool: BufferPool::default(),
            uncaptured: Arc::default(),
            submissions: AtomicU64::new(0),
            id: NEXT_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
        }
    }

    /// Keep device errors no scope captured for the next call to report,
    /// rather than letting wgpu's default handler abort the program. Only
    /// for a device the engine opened: it replaces the device's handler.
    pub fn keep_uncaptured(&self) {
        let slot = self.uncaptured.clone();
        self.device.on_uncaptured_error(Arc::new(move |e| {
            if let Ok(mut s) = slot.lock() {
                s.get_or_insert_with(|| e.to_string());
            }
        }));
    }

    /// The limits the planner sees.
    pub fn caps(&self) -> DeviceCaps {
        let mut caps = DeviceCaps::from_adapter(
            &self.limits,
            self.features,
            &self.info,
            &self.coop_properties,
        );
        if let Some(cap) = self.settings.workgroup_storage_cap {
            caps.max_workgroup_storage = caps.max_workgroup_storage.min(cap);
        }
        if self.settings.tiled_only {
            caps.lane_subgroup = None;
            caps.hardware = false;
            caps.coop_matrix = Default::default();
        }
        if self.settings.emulate_coop && caps.subgroup.is_some() {
            // Only the form that is emulated, even where real ones exist.
            caps.coop_matrix = crate::plan::CoopMatrixShapes {
                f32_8x8: true,
                ..Default::default()
            };
        }
        caps
    }

    /// Workgroups that run at once and fill the device, for splitting work
    /// that has too few: a CPU adapter runs one per core (lavapipe's
    /// threads); a GPU cannot say, so [`GPU_PARALLEL_WORKGROUPS`].
    pub fn parallelism(&self) -> usize {
        match self.info.device_type {
            #[cfg(not(target_arch = "wasm32"))]
            wgpu::DeviceType::Cpu => std::thread::available_parallelism().map_or(1, |n| n.get()),
            _ => GPU_PARALLEL_WORKGROUPS,
        }
    }

    /// `plan` as this device runs it: with emulated cooperative matrices
    /// where [`Settings::emulate_coop`] asks for them.
    pub fn device_plan(&self, plan: Plan) -> Plan {
        match plan.coop {
            Some(CoopForm::F32x8) if self.settings.emulate_coop => Plan {
                coop: Some(CoopForm::Emulated),
                ..plan
            },
            _ => plan,
        }
    }

    /// The kernel variant for these flags on this device (instrumented, guarded).
    pub fn variant(&self, masked: bool, softcap: bool) -> Variant {
        Variant {
            masked,
            softcap,
            alibi: false,
            sinks: false,
            varlen: false,
            sparse: false,
            partial: false,
            dropout: false,
            aliased: false,
            count_io: self.io_counter.is_some(),
            loop_check: match (self.loop_limit.limit(), self.settings.loop_meter) {
                (None, _) => LoopCheck::Off,
                (Some(_), false) => LoopCheck::Guard,
                (Some(_), true) => LoopCheck::Meter,
            },
        }
    }

    /// Largest byte size one storage binding may have.
    pub fn max_binding(&self) -> u64 {
        let device = self
            .limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size);
        self.settings.binding_cap.map_or(device, |c| c.min(device))
    }

    /// `bytes` of `what`, or `BindingTooLarge` past [`max_binding`](Self::max_binding).
    pub fn within_binding(&self, what: &'static str, bytes: u64) -> Result<u64> {
        let max = self.max_binding();
        if bytes > max {
            return Err(Error::BindingTooLarge { what, bytes, max });
        }
        Ok(bytes)
    }

    /// Most workgroups per dispatch dimension.
    pub fn max_groups(&self) -> u32 {
        self.limits.max_compute_workgroups_per_dimension
    }

    /// One line naming the adapter and backend.
    pub fn describe(&self) -> String {
        let i = &self.info;
        format!(
            "{} ({:?}, {:?}, driver {} {})",
            i.name, i.backend, i.device_type, i.driver, i.driver_info
        )
    }

    /// The device error no scope captured since the last call, if any.
    pub fn take_uncaptured(&self) -> Result<()> {
        let mut slot = self.uncaptured.lock().map_err(|_| Error::Poisoned {
            what: "the uncaptured-error slot",
        })?;
        match slot.take() {
            Some(message) => Err(Error::Uncaptured { message }),
            None => Ok(()),
        }
    }
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("adapter", &self.info.name)
            .field("backend", &self.info.backend)
            .field("loop_limit", &self.loop_limit.limit())
            .finish()
    }
}

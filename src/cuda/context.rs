//! Finding the driver and a device, and the loaded modules of one
//! context, keyed by [`KernelKey`]: PTX from the disk cache (or NVRTC),
//! loaded by the driver's JIT with its logs kept ([`super::jit`]).

use super::compile::{nvrtc_present, nvrtc_version, Arch};
use super::disk_cache::cached_ptx;
use super::driver_error::driver;
use super::jit::{self, JitLog, JitModule, Kernel, KernelAttributes};
use super::kernel::{KernelKey, STATIC_SHARED_LIMIT};
use super::plan::DeviceProps;
use crate::error::{Error, Result};
use cudarc::driver::sys::{CUdevice_attribute, CUresult};
use cudarc::driver::{CudaContext, CudaStream, DriverError};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

/// The oldest compute capability the kernels run on (bf16 conversions).
const MIN_MAJOR: i32 = 8;

/// Whether libcuda (the NVIDIA driver) can be loaded.
pub fn driver_present() -> bool {
    // SAFETY: only tries to dlopen the library by its usual names.
    unsafe { cudarc::driver::sys::is_culib_present() }
}

/// The CUDA version the driver supports and NVRTC's, as (major, minor);
/// `None` for a library that does not load.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Versions {
    pub driver: Option<(i32, i32)>,
    pub nvrtc: Option<(i32, i32)>,
}

impl std::fmt::Display for Versions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let show =
            |v: Option<(i32, i32)>| v.map_or("not found".into(), |(a, b)| format!("{a}.{b}"));
        write!(
            f,
            "CUDA driver API {}, NVRTC {}",
            show(self.driver),
            show(self.nvrtc)
        )
    }
}

/// The driver's and NVRTC's versions (no device needed).
pub fn versions() -> Versions {
    let driver = driver_present().then(|| {
        let mut v = 0;
        // SAFETY: libcuda loads (checked); cuDriverGetVersion needs no cuInit.
        let ok = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) }
            .result()
            .is_ok();
        ok.then_some((v / 1000, v % 1000 / 10))
    });
    Versions {
        driver: driver.flatten(),
        nvrtc: nvrtc_version(),
    }
}

/// One module as the driver built it: its JIT logs and each kernel's
/// attributes (`Cuda::module_report`).
#[derive(Clone, Debug)]
pub struct ModuleReport {
    pub key: KernelKey,
    pub arch: String,
    pub log: JitLog,
    pub kernels: Vec<(&'static str, KernelAttributes)>,
}

impl ModuleReport {
    /// What the build must not show ([`jit::build_faults`]), each naming
    /// the kernel: spills as the JIT's verbose log counts them, or, where it
    /// counts none, the kernel's local memory.
    pub fn faults(&self) -> Vec<String> {
        let log = self.log.text();
        let logged = jit::spill_bytes(&log);
        self.kernels
            .iter()
            .flat_map(|(name, a)| {
                let spills = logged.unwrap_or(i64::from(a.local_bytes));
                jit::build_faults(self.key.family, &log, spills)
                    .into_iter()
                    .map(move |f| format!("{} {name}: {f}", self.key.label()))
            })
            .collect()
    }

    /// One line per kernel: registers, local and shared memory, JIT time.
    pub fn lines(&self) -> Vec<String> {
        self.kernels
            .iter()
            .map(|(name, a)| {
                format!(
                    "{:<36} {name:<15} {}: {} registers, {} B local (spills), {} B static + {} B dynamic shared, \
                     PTX {} SASS sm_{}, JIT {:.0} ms",
                    self.key.label(),
                    self.arch,
                    a.registers,
                    a.local_bytes,
                    a.static_shared_bytes,
                    self.key.dynamic_shared_bytes(),
                    a.ptx_version,
                    a.binary_version,
                    self.log.wall_ms,
                )
            })
            .collect()
    }
}

/// Whether libcuda and NVRTC both load: `Error::CudaUnavailable` naming
/// the first missing (a check before any file is read or device opened).
pub fn libraries_present() -> Result<()> {
    if !driver_present() {
        return Err(Error::CudaUnavailable {
            missing: "libcuda (the NVIDIA driver)",
        });
    }
    if !nvrtc_present() {
        return Err(Error::CudaUnavailable {
            missing: "NVRTC (libnvrtc, from the CUDA toolkit or pip's nvidia-cuda-nvrtc-cu12)",
        });
    }
    Ok(())
}

/// Device 0: its context, stream, architecture and compiled modules.
pub struct CudaDevice {
    pub(crate) stream: Arc<CudaStream>,
    name: String,
    capability: (i32, i32),
    pub(crate) props: DeviceProps,
    modules: Mutex<HashMap<KernelKey, Arc<JitModule>>>,
}

impl std::fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaDevice")
            .field("name", &self.name)
            .field("capability", &self.capability)
            .finish_non_exhaustive()
    }
}

impl CudaDevice {
    /// Open device 0. Each missing piece is its own [`Error::CudaUnavailable`]
    /// (checked before cudarc loads it: cudarc panics when a library is absent).
    pub fn open() -> Result<Self> {
        libraries_present()?;
        // A driver without a GPU (a container, a host whose card is gone)
        // says so at cuInit: that is a missing device, not a driver fault.
        let no_device = Error::CudaUnavailable {
            missing: "a CUDA device",
        };
        match CudaContext::device_count() {
            Ok(n) if n >= 1 => {}
            Ok(_) => return Err(no_device),
            Err(DriverError(CUresult::CUDA_ERROR_NO_DEVICE)) => return Err(no_device),
            Err(e) => return Err(driver("counting CUDA devices")(e)),
        }
        let ctx = CudaContext::new(0).map_err(driver("creating a CUDA context"))?;
        let name = ctx.name().map_err(driver("reading the device name"))?;
        let capability = ctx
            .compute_capability()
            .map_err(driver("reading the compute capability"))?;
        if capability.0 < MIN_MAJOR {
            return Err(Error::CudaArch {
                device: name,
                major: capability.0,
                minor: capability.1,
                needed: "8.0",
            });
        }
        let attr = |a, during| {
            ctx.attribute(a)
                .map(|v| v.max(0) as usize)
                .map_err(driver(during))
        };
        let props = DeviceProps {
            name: name.clone(),
            major: capability.0,
            minor: capability.1,
            sms: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
                "reading the SM count",
            )?,
            smem_per_block_optin: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
                "reading the shared memory per block",
            )?,
            smem_per_sm: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_MULTIPROCESSOR,
                "reading the shared memory per SM",
            )?,
            max_threads_per_sm: attr(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR,
                "reading the threads per SM",
            )?,
            arch: Arch::for_device(capability.0, capability.1),
        };
        let device = Self {
            stream: ctx.default_stream(),
            name,
            capability,
            props,
            modules: Mutex::new(HashMap::new()),
        };
        match std::env::var("FLASHATTN_CUDA_ARCH") {
            Ok(a) if !a.is_empty() => device.with_arch(a.parse()?),
            _ => Ok(device),
        }
    }

    /// The same device with its kernels compiled for `arch` (e.g.
    /// `compute_80` on an H100, to compare with the sm80 build); the plan
    /// then chooses by it. An architecture the device cannot run is
    /// `Error::CudaArchUnfit`.
    pub fn with_arch(mut self, arch: Arch) -> Result<Self> {
        arch.check_runs_on(&self.name, self.capability.0, self.capability.1)?;
        self.props.arch = arch;
        self.modules = Mutex::new(HashMap::new());
        Ok(self)
    }

    /// One line naming the device.
    pub fn describe(&self) -> String {
        let (major, minor) = self.capability;
        if self.props.arch == Arch::for_device(major, minor) {
            format!("{} (sm_{major}{minor})", self.name)
        } else {
            let arch = self.props.arch.name();
            format!("{} (sm_{major}{minor}, kernels for {arch})", self.name)
        }
    }

    /// The NVRTC architecture the kernels are compiled for: the device's
    /// (`compute_90a` on Hopper) or the one [`Self::with_arch`] set.
    pub fn arch(&self) -> String {
        self.props.arch.name()
    }

    /// `key`'s module: loaded on first use (PTX from the disk cache or
    /// NVRTC, then the driver's JIT), outside the lock, so threads load
    /// different modules at once (two loading the same keep the first).
    fn module(&self, key: KernelKey) -> Result<Arc<JitModule>> {
        let poisoned = || Error::Poisoned {
            what: "the CUDA module cache",
        };
        if let Some(m) = self.modules.lock().map_err(|_| poisoned())?.get(&key) {
            return Ok(m.clone());
        }
        let ptx = cached_ptx(&key, &self.arch())?;
        let loaded = Arc::new(jit::load(self.stream.context(), &key, &ptx.to_src())?);
        let mut modules = self.modules.lock().map_err(|_| poisoned())?;
        Ok(modules.entry(key).or_insert(loaded).clone())
    }

    /// Entry point `name` of `key`'s module, compiled and loaded on first use.
    pub(crate) fn function(&self, key: KernelKey, name: &str) -> Result<Kernel> {
        let func = Kernel::find(&self.module(key)?, name)?;
        // Past 48 KiB, dynamic shared memory needs the function's opt-in.
        let bytes = key.dynamic_shared_bytes();
        if bytes > STATIC_SHARED_LIMIT {
            func.allow_dynamic_shared(bytes)?;
        }
        Ok(func)
    }

    /// `key`'s module as the driver built it for this device (loaded as
    /// every call loads it): the JIT logs and each kernel's attributes.
    pub fn module_report(&self, key: KernelKey) -> Result<ModuleReport> {
        let module = self.module(key)?;
        let kernels = key
            .family
            .entry_points()
            .iter()
            .map(|&name| Ok((name, Kernel::find(&module, name)?.attributes()?)))
            .collect::<Result<_>>()?;
        Ok(ModuleReport {
            key,
            arch: self.arch(),
            log: module.log.clone(),
            kernels,
        })
    }
}

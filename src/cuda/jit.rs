//! PTX into a loaded module through the driver's own compiler
//! (`cuModuleLoadDataEx`), with its info and error logs kept: the one way
//! the backend loads kernels. The logs say what the driver's JIT did with
//! the PTX (registers, spills, a wgmma it serialized); they travel with a
//! failed load's error, every module keeps them ([`JitLog`]), and with
//! `FLASHATTN_CUDA_JIT_LOG=1` each load prints them to stderr. Each kernel
//! reports its registers, local memory and shared memory as the driver
//! built it ([`KernelAttributes`], `cuFuncGetAttribute`), and [`Launch`]
//! starts one on a stream.

use super::driver_error::driver;
use super::kernel::{Family, KernelKey};
use crate::error::{Error, Result};
use cudarc::driver::sys::{self, CUevent_flags, CUfunction_attribute, CUjit_option};
use cudarc::driver::{
    CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, DriverError,
    LaunchConfig, SyncOnDrop,
};
use std::ffi::{c_void, CString};
use std::sync::Arc;

/// Bytes of each JIT log buffer: ptxas's verbose report of a module with a
/// few entry points takes a few KiB.
const LOG_BYTES: usize = 64 * 1024;

/// What the driver's JIT said while compiling one module's PTX.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JitLog {
    /// The info log (`CU_JIT_LOG_VERBOSE`: ptxas's per-kernel report and warnings).
    pub info: String,
    /// The error log (empty after a successful load).
    pub error: String,
    /// Milliseconds the JIT took (`CU_JIT_WALL_TIME`).
    pub wall_ms: f32,
}

impl JitLog {
    /// Both logs, labelled, for an error message or a report.
    pub fn text(&self) -> String {
        let mut out = String::new();
        for (name, log) in [("info", &self.info), ("error", &self.error)] {
            if !log.trim().is_empty() {
                out += &format!("JIT {name} log:\n{}\n", log.trim_end());
            }
        }
        out
    }
}

/// One kernel as the driver compiled it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelAttributes {
    pub registers: i32,
    /// Local memory per thread: the stack and register spills.
    pub local_bytes: i32,
    /// Static shared memory (the tensor-core kernels' is dynamic).
    pub static_shared_bytes: i32,
    pub max_threads_per_block: i32,
    /// The PTX ISA and the SASS target, as `major * 10 + minor`.
    pub ptx_version: i32,
    pub binary_version: i32,
}

/// A module loaded into a context; unloaded when the last kernel of it goes.
#[derive(Debug)]
pub(crate) struct JitModule {
    raw: sys::CUmodule,
    ctx: Arc<CudaContext>,
    pub(crate) log: JitLog,
}

// SAFETY: a CUmodule is a handle the driver lets any thread use once its
// context is bound (every use here binds it first), as cudarc's CudaModule.
unsafe impl Send for JitModule {}
unsafe impl Sync for JitModule {}

impl Drop for JitModule {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: the module was loaded by `load` and is unloaded once.
            let _ = unsafe { sys::cuModuleUnload(self.raw) };
        }
    }
}

/// The NUL-terminated text the driver wrote into a log buffer.
fn log_text(buf: &[u8]) -> String {
    let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
    String::from_utf8_lossy(&buf[..end]).into_owned()
}

/// JIT-compile `ptx` (`key`'s module) into `ctx` with both logs captured.
pub(crate) fn load(ctx: &Arc<CudaContext>, key: &KernelKey, ptx: &str) -> Result<JitModule> {
    let label = key.label();
    let source = CString::new(ptx).map_err(|_| Error::CudaJit {
        kernel: label.clone(),
        message: "the PTX holds a NUL byte".into(),
        log: String::new(),
    })?;
    let (mut info, mut error) = (vec![0u8; LOG_BYTES], vec![0u8; LOG_BYTES]);
    let mut options = [
        CUjit_option::CU_JIT_INFO_LOG_BUFFER,
        CUjit_option::CU_JIT_INFO_LOG_BUFFER_SIZE_BYTES,
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER,
        CUjit_option::CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES,
        CUjit_option::CU_JIT_LOG_VERBOSE,
        CUjit_option::CU_JIT_WALL_TIME,
    ];
    // Sizes and flags travel in the pointer-sized slots themselves; the
    // wall time comes back as a float in its slot.
    let number = std::ptr::without_provenance_mut::<c_void>;
    let mut values: [*mut c_void; 6] = [
        info.as_mut_ptr().cast(),
        number(LOG_BYTES),
        error.as_mut_ptr().cast(),
        number(LOG_BYTES),
        number(1),
        std::ptr::null_mut(),
    ];
    let mut raw = std::ptr::null_mut();
    ctx.bind_to_thread().map_err(jit_error(&label, ""))?;
    // SAFETY: the image is NUL-terminated PTX; each option has its value in
    // the same position, the buffers are LOG_BYTES long and outlive the call.
    let loaded = unsafe {
        sys::cuModuleLoadDataEx(
            &mut raw,
            source.as_ptr().cast(),
            options.len() as u32,
            options.as_mut_ptr(),
            values.as_mut_ptr(),
        )
    }
    .result();
    let wall_ms = f32::from_bits(values[5].addr() as u32);
    let log = JitLog {
        info: log_text(&info),
        error: log_text(&error),
        wall_ms,
    };
    if let Err(e) = loaded {
        return Err(jit_error(&label, &log.text())(e));
    }
    if std::env::var("FLASHATTN_CUDA_JIT_LOG").is_ok_and(|v| v == "1") {
        eprintln!("flashattn: JIT of {label}: {wall_ms:.0} ms\n{}", log.text());
    }
    Ok(JitModule {
        raw,
        ctx: ctx.clone(),
        log,
    })
}

/// A driver error while loading `kernel`, with its JIT logs.
fn jit_error(kernel: &str, log: &str) -> impl FnOnce(DriverError) -> Error {
    let (kernel, log) = (kernel.to_string(), log.to_string());
    move |e| Error::CudaJit {
        kernel,
        message: format!("{e:?}"),
        log,
    }
}

/// One entry point of a loaded module.
#[derive(Clone, Debug)]
pub(crate) struct Kernel {
    raw: sys::CUfunction,
    module: Arc<JitModule>,
}

// SAFETY: as for JitModule; the function lives as long as its module,
// which this holds.
unsafe impl Send for Kernel {}
unsafe impl Sync for Kernel {}

impl Kernel {
    /// Entry point `name` of `module`.
    pub(crate) fn find(module: &Arc<JitModule>, name: &str) -> Result<Self> {
        let during = "finding a CUDA kernel";
        let c_name = CString::new(name).map_err(|_| Error::CudaDriver {
            during,
            message: format!("{name:?} holds a NUL byte"),
        })?;
        module.ctx.bind_to_thread().map_err(driver(during))?;
        let mut raw = std::ptr::null_mut();
        // SAFETY: the module is loaded (it is unloaded only when dropped).
        unsafe { sys::cuModuleGetFunction(&mut raw, module.raw, c_name.as_ptr()) }
            .result()
            .map_err(driver(during))?;
        Ok(Self {
            raw,
            module: module.clone(),
        })
    }

    fn attribute(&self, a: CUfunction_attribute) -> Result<i32> {
        let mut v = 0;
        // SAFETY: a valid function of a loaded module.
        unsafe { sys::cuFuncGetAttribute(&mut v, a, self.raw) }
            .result()
            .map_err(driver("reading a CUDA kernel's attributes"))?;
        Ok(v)
    }

    /// Its registers, local and shared memory as the driver built it.
    pub(crate) fn attributes(&self) -> Result<KernelAttributes> {
        use CUfunction_attribute as A;
        self.module
            .ctx
            .bind_to_thread()
            .map_err(driver("reading a CUDA kernel's attributes"))?;
        Ok(KernelAttributes {
            registers: self.attribute(A::CU_FUNC_ATTRIBUTE_NUM_REGS)?,
            local_bytes: self.attribute(A::CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES)?,
            static_shared_bytes: self.attribute(A::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)?,
            max_threads_per_block: self.attribute(A::CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK)?,
            ptx_version: self.attribute(A::CU_FUNC_ATTRIBUTE_PTX_VERSION)?,
            binary_version: self.attribute(A::CU_FUNC_ATTRIBUTE_BINARY_VERSION)?,
        })
    }

    /// Sets the dynamic shared memory a launch may ask for (past 48 KiB it
    /// needs this opt-in).
    pub(crate) fn allow_dynamic_shared(&self, bytes: usize) -> Result<()> {
        let during = "opting in to dynamic shared memory";
        self.module.ctx.bind_to_thread().map_err(driver(during))?;
        // SAFETY: a valid function; the driver checks the value.
        unsafe {
            sys::cuFuncSetAttribute(
                self.raw,
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        }
        .result()
        .map_err(driver(during))
    }
}

/// The spill stores and loads ptxas reports in `log` ("N bytes spill
/// stores, M bytes spill loads" per kernel, with `-v` or the JIT's verbose
/// log), summed; `None` where it reports none at all. Local memory is not
/// spills alone: printf's argument buffer (the bounded waits' report) is
/// a stack frame.
pub fn spill_bytes(log: &str) -> Option<i64> {
    let number_before = |line: &str, word: &str| -> Option<i64> {
        let at = line.find(word)?;
        line[..at].split_whitespace().last()?.parse().ok()
    };
    log.lines()
        .flat_map(|l| [" bytes spill stores", " bytes spill loads"].map(|w| number_before(l, w)))
        .flatten()
        .reduce(|a, b| a + b)
}

/// What the driver's build of a kernel of `family` must not show: for the
/// Hopper forward, register spills (`spill_bytes`) or a ptxas warning in
/// `log` that it serialized the wgmmas or ignored a setmaxnreg. The same
/// rule for the offline ptxas (tests/cuda.rs) and the driver's JIT
/// (`Cuda::module_report`).
pub fn build_faults(family: Family, log: &str, spill_bytes: i64) -> Vec<String> {
    let mut faults = Vec::new();
    if !family.is_wgmma() {
        return faults;
    }
    if spill_bytes > 0 {
        faults.push(format!("spills ({spill_bytes} B of local memory)"));
    }
    for warning in ["serialized", "C7508", "C7510", "C7515"] {
        if let Some(line) = log.lines().find(|l| l.contains(warning)) {
            faults.push(format!("{warning}: {}", line.trim()));
        }
    }
    faults
}

/// One kernel launch being put together: its arguments in the kernel's
/// order, then [`Launch::launch`].
pub(crate) struct Launch<'a> {
    stream: &'a CudaStream,
    kernel: &'a Kernel,
    /// Device addresses, boxed so the argument pointers to them stay put
    /// while the Vec grows.
    #[allow(clippy::vec_box)]
    addresses: Vec<Box<sys::CUdeviceptr>>,
    args: Vec<*mut c_void>,
    /// Each buffer's stream bookkeeping, done after the launch is queued.
    syncs: Vec<SyncOnDrop<'a>>,
}

impl<'a> Launch<'a> {
    pub(crate) fn new(stream: &'a CudaStream, kernel: &'a Kernel) -> Self {
        Self {
            stream,
            kernel,
            addresses: Vec::new(),
            args: Vec::new(),
            syncs: Vec::new(),
        }
    }

    fn address(&mut self, ptr: sys::CUdeviceptr, sync: SyncOnDrop<'a>) -> &mut Self {
        let boxed = Box::new(ptr);
        self.args
            .push((&*boxed as *const sys::CUdeviceptr).cast_mut().cast());
        self.addresses.push(boxed);
        self.syncs.push(sync);
        self
    }

    /// A buffer the kernel reads.
    pub(crate) fn input<T>(&mut self, buf: &'a CudaSlice<T>) -> &mut Self {
        let (ptr, sync) = buf.device_ptr(self.stream);
        self.address(ptr, sync)
    }

    /// A buffer the kernel writes.
    pub(crate) fn output<T>(&mut self, buf: &'a mut CudaSlice<T>) -> &mut Self {
        let (ptr, sync) = buf.device_ptr_mut(self.stream);
        self.address(ptr, sync)
    }

    /// A value passed by value (a struct, a tensor map, an integer).
    pub(crate) fn value<T: DeviceRepr>(&mut self, v: &'a T) -> &mut Self {
        self.args.push((v as *const T).cast_mut().cast());
        self
    }

    /// Queue the kernel on the stream.
    ///
    /// # Safety
    /// The arguments must be the kernel's, in order and of its types, and
    /// every buffer must hold what the grid indexes.
    pub(crate) unsafe fn launch(mut self, cfg: LaunchConfig, during: &'static str) -> Result<()> {
        self.kernel
            .module
            .ctx
            .bind_to_thread()
            .map_err(driver(during))?;
        let (g, b) = (cfg.grid_dim, cfg.block_dim);
        // SAFETY: the caller's; the argument pointers point at the boxed
        // addresses and the borrowed values, alive until this returns.
        unsafe {
            sys::cuLaunchKernel(
                self.kernel.raw,
                g.0,
                g.1,
                g.2,
                b.0,
                b.1,
                b.2,
                cfg.shared_mem_bytes,
                self.stream.cu_stream(),
                self.args.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(driver(during))?;
        drop(self.syncs);
        Ok(())
    }
}

/// Seconds the kernels `launch` queues on `stream` take, by CUDA events
/// recorded before and after them; waits for them.
pub(crate) fn timed(
    stream: &CudaStream,
    during: &'static str,
    launch: impl FnOnce() -> Result<()>,
) -> Result<f64> {
    let event = || {
        stream
            .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver("recording a CUDA event"))
    };
    let start = event()?;
    launch()?;
    let end = event()?;
    stream.synchronize().map_err(driver(during))?;
    let ms = start.elapsed_ms(&end).map_err(driver(during))?;
    Ok(f64::from(ms) / 1e3)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hopper_forward_may_not_spill_or_serialize_its_wgmmas() {
        let log = "ptxas info    : Used 168 registers\n\
                   ptxas warning : (C7510) Potential Performance Loss: wgmma.mma_async instructions are serialized due to ...";
        let faults = build_faults(Family::ForwardWgmma, log, 0);
        assert_eq!(faults.len(), 2, "{faults:?}"); // "serialized" and "C7510", one line
        assert!(faults[0].contains("wgmma.mma_async instructions are serialized"));
        let spilled = build_faults(Family::ForwardWgmma, "ptxas info : Used 255 registers", 16);
        assert_eq!(spilled, ["spills (16 B of local memory)"]);
        assert!(
            build_faults(Family::ForwardWgmma, "ptxas info : Used 168 registers", 0).is_empty()
        );
        // The rule is the Hopper forward's: the others are reported, not failed.
        assert!(build_faults(Family::BackwardMma, log, 64).is_empty());
    }

    #[test]
    fn spills_are_ptxas_spill_counts_summed() {
        let log = "ptxas info : Function properties for flash_fwd\n\
                   \x20   24 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads\n\
                   ptxas info : Function properties for flash_bwd_dq\n\
                   \x20   0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads";
        assert_eq!(spill_bytes(log), Some(20));
        assert_eq!(spill_bytes("ptxas info : Used 40 registers"), None);
    }

    #[test]
    fn logs_stop_at_the_drivers_nul_and_print_labelled() {
        let mut buf = b"ptxas info : Used 40 registers\n".to_vec();
        buf.extend([0, b'x', b'y']);
        assert_eq!(log_text(&buf), "ptxas info : Used 40 registers\n");
        let log = JitLog {
            info: log_text(&buf),
            error: String::new(),
            wall_ms: 3.0,
        };
        assert_eq!(
            log.text(),
            "JIT info log:\nptxas info : Used 40 registers\n"
        );
        assert_eq!(JitLog::default().text(), "");
    }
}

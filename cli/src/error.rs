//! The command line's errors: the library's, and those of files, flags,
//! charts and reports, each with the values a user needs to fix it. `main`
//! prints one line: the error and its sources, joined by ": ".

use std::path::PathBuf;
use thiserror::Error;

/// Everything a `flashattn` command can fail with.
#[derive(Debug, Error)]
pub enum CliError {
    #[error(transparent)]
    Attention(#[from] flashattn::Error),
    #[error("cannot read {what} from {}", path.display())]
    Read {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{what} file {} is not a valid .npy file", path.display())]
    NotNpy {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: crate::npy::header::HeaderError,
    },
    /// An `.npy` header whose shape has more elements than this machine
    /// can hold (its element count overflows): rejected before any data
    /// is read.
    #[error("{what} file {} has shape {shape:?}: its element count overflows (at most {max} on this target)", path.display())]
    NpyTooLarge {
        what: &'static str,
        path: PathBuf,
        shape: Vec<u64>,
        /// `flashattn::MAX_ELEMENTS`.
        max: u64,
    },
    /// An `.npy` file whose data is not the size its header's shape says.
    #[error("{what} file {}: its header says shape {shape:?}, {expected} bytes of data, but the file holds {actual}", path.display())]
    NpyDataLength {
        what: &'static str,
        path: PathBuf,
        shape: Vec<u64>,
        expected: u64,
        actual: u64,
    },
    #[error("{what} file {} is in Fortran order; save it C-contiguous", path.display())]
    FortranOrder { what: &'static str, path: PathBuf },
    #[error("{what} file {} has dtype {dtype}; expected float32 or float16 (little-endian)", path.display())]
    Dtype {
        what: &'static str,
        path: PathBuf,
        dtype: String,
    },
    /// A file that holds float32 only (ALiBi slopes, sinks, block scales).
    #[error("{what} file {} has dtype {dtype}; {what} must be float32", path.display())]
    F32Dtype {
        what: &'static str,
        path: PathBuf,
        dtype: String,
    },
    #[error("{what} file {} has dtype {dtype}; expected int32 (or int64 within int32's range, little-endian)", path.display())]
    IndexDtype {
        what: &'static str,
        path: PathBuf,
        dtype: String,
    },
    /// A cache file whose codes are not the ones `--cache-precision` names.
    #[error("{what} file {} has dtype {dtype}; --cache-precision {precision} reads {expected} codes (or a float cache, quantized on load)", path.display())]
    CacheCodes {
        what: &'static str,
        path: PathBuf,
        dtype: String,
        precision: &'static str,
        expected: &'static str,
    },
    #[error("{what} file {} has dtype {dtype}; expected bool or uint8", path.display())]
    MaskDtype {
        what: &'static str,
        path: PathBuf,
        dtype: String,
    },
    /// A flag that needs another flag given without it.
    #[error("{given} needs {needs}")]
    Needs {
        given: &'static str,
        needs: &'static str,
    },
    #[error("{what} file {}: entry {index} is {value}, outside int32's range", path.display())]
    IndexRange {
        what: &'static str,
        path: PathBuf,
        index: usize,
        value: i64,
    },
    #[error("{what} has rank {rank} (shape {shape:?}); expected {expected}")]
    Rank {
        what: &'static str,
        rank: usize,
        shape: Vec<usize>,
        expected: &'static str,
    },
    /// One of two flags that go together was given without the other.
    #[error("{given} needs {missing}: give both or neither")]
    Pair {
        given: &'static str,
        missing: &'static str,
    },
    /// An output path that cannot be written, found before any work.
    #[error("{flag} {}: {problem}", path.display())]
    OutputPath {
        flag: &'static str,
        path: PathBuf,
        #[source]
        problem: crate::outputs::PathProblem,
    },
    /// Two output flags naming one file.
    #[error("{first} and {second} both name {}: give each output its own file", path.display())]
    SameOutput {
        first: &'static str,
        second: &'static str,
        path: PathBuf,
    },
    #[error("cannot write {}", path.display())]
    Write {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A flag's value cannot be parsed or is out of range.
    #[error("{flag} expects {expected}, got `{value}`")]
    BadFlag {
        flag: &'static str,
        expected: &'static str,
        value: String,
    },
    #[error("{what} need a GPU adapter")]
    NeedsGpu { what: &'static str },
    #[error("{implementation} is an outside baseline: `flashattn bench` runs it through cli/src/baselines.py")]
    OutsideBaseline { implementation: &'static str },
    #[error("the baselines script ({python}) failed: {message}")]
    Baseline { python: String, message: String },
    #[error("the CUDA benchmarks cannot run: {message}")]
    CudaBench { message: String },
    /// A problem whose sizes (from flags) need more host memory than this
    /// machine can allocate: one line, not an allocation abort.
    #[error("{what} needs {bytes} bytes of host memory, more than this machine can allocate")]
    HostMemory { what: String, bytes: u64 },
    #[error("{flags} apply to the wgpu backend only")]
    WgpuOnly { flags: &'static str },
    #[error("{flag} applies to --backend cuda only")]
    CudaOnly { flag: &'static str },
    #[error("--hadamard applies to --precision fp8 only")]
    HadamardWithoutFp8,
    #[error("--max-workgroup-storage {requested} exceeds the device's {max} bytes")]
    StorageCap { requested: u32, max: u32 },
    #[error(transparent)]
    Plot(#[from] crate::plot::PlotError),
    #[error("--plot needs a file name, got {}", path.display())]
    PlotName { path: PathBuf },
    #[error("writing JSON")]
    Json(#[from] serde_json::Error),
    #[error("writing CSV")]
    Csv(#[from] csv::Error),
    #[error("progress bar")]
    Progress(#[from] indicatif::style::TemplateError),
    #[error("{failed} of {checked} outputs do not meet docs/semantics.md's accuracy rule")]
    Inaccurate { failed: usize, checked: usize },
    /// `flashattn doctor` found rows that failed or could not run.
    #[error("flashattn doctor: {failed} of {rows} checks failed and {errors} could not run (see the table)")]
    DoctorFailed {
        failed: usize,
        errors: usize,
        rows: usize,
    },
}

/// Shorthand for `Result<T, CliError>`.
pub type Result<T, E = CliError> = std::result::Result<T, E>;

/// The error and its sources on one line.
pub fn one_line(e: &dyn std::error::Error) -> String {
    let mut line = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !line.contains(&text) {
            line.push_str(": ");
            line.push_str(&text);
        }
        source = s.source();
    }
    line.replace('\n', " ")
}

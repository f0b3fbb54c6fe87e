//! One error type for the whole library, its variants grouped by who has to
//! act: the caller's input, the caller's configuration, the hardware, or the
//! execution. Every variant carries the values that caused it, so callers and
//! tests match on variants and fields, never on message text.
//!
//! This module depends on nothing else in the crate (names of tensors, dtypes
//! and kernels are `&'static str`), so every other module can use it.

use thiserror::Error;

/// Everything that can go wrong in flashattn.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum Error {
    // ---- bad input ----
    /// A size that must be at least 1 is 0.
    #[error("{dim} must be at least 1, got 0")]
    EmptyDim { dim: &'static str },
    #[error("the head dim of {tensor} ({head_dim}) is larger than the supported maximum {max}")]
    HeadDimTooLarge {
        tensor: &'static str,
        head_dim: usize,
        max: usize,
    },
    #[error("heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv})")]
    HeadsNotDivisible { heads_q: usize, heads_kv: usize },
    /// A size computed from the caller's dims (a shape's element count, the
    /// product or sum of two sizes) overflows, or passes what this target
    /// can hold (see `api::size`: `max` is 2⁶¹ − 1 on 64-bit targets,
    /// 2²⁹ − 1 on wasm32). Reported before anything is allocated.
    #[error("{what} {operands:?}: the {op} overflows (at most {max} on this target)")]
    SizeOverflow {
        what: &'static str,
        /// "element count", "product" or "sum".
        op: &'static str,
        /// The dims (or the two sizes) as given.
        operands: Vec<u64>,
        max: u64,
    },
    /// A tensor's data does not hold as many elements as its shape says.
    #[error("{tensor} has shape {shape:?} ({expected} elements) but {actual} elements of data")]
    DataLength {
        tensor: &'static str,
        shape: Vec<usize>,
        expected: usize,
        actual: usize,
    },
    #[error("{tensor} has rank {rank} (shape {shape:?}); expected {expected} dims")]
    Rank {
        tensor: &'static str,
        shape: Vec<usize>,
        rank: usize,
        expected: usize,
    },
    /// One dimension of two tensors that must agree differs.
    #[error("{dim} of {tensor} ({value}) and {other} ({other_value}) differ")]
    DimMismatch {
        dim: &'static str,
        tensor: &'static str,
        value: usize,
        other: &'static str,
        other_value: usize,
    },
    /// A tensor's shape differs from the one it must have.
    #[error("{tensor} has shape {shape:?}, expected {expected:?} (the shape of {like}); the shapes differ")]
    ShapeMismatch {
        tensor: &'static str,
        shape: Vec<usize>,
        like: &'static str,
        expected: Vec<usize>,
    },
    #[error("{tensor} has dtype {dtype} but {like} has {expected}: they must share one dtype")]
    DtypeMismatch {
        tensor: &'static str,
        dtype: &'static str,
        like: &'static str,
        expected: &'static str,
    },
    #[error("scale must be finite, got {scale}")]
    NonFiniteScale { scale: f32 },
    /// FP8 quantization needs finite inputs (a NaN or ±inf has no scale).
    #[error("{tensor}[{index}] is not finite; FP8 quantization needs finite inputs")]
    NonFiniteInput { tensor: &'static str, index: usize },
    #[error("softcap must be a finite value >= 0, got {softcap}")]
    InvalidSoftcap { softcap: f32 },
    /// A name (precision, backend, kernel) that is not one of the known ones.
    #[error("unknown {what} `{name}` (expected {expected})")]
    UnknownName {
        what: &'static str,
        name: String,
        expected: &'static str,
    },
    /// An index array (cache_seqlens, cache_batch_idx, block_table) has the wrong length.
    #[error("{tensor} has {len} entries, expected {expected}")]
    IndexLength {
        tensor: &'static str,
        len: usize,
        expected: usize,
    },
    #[error("{tensor}[{index}] is {value}; lengths and indices must not be negative")]
    NegativeIndex {
        tensor: &'static str,
        index: usize,
        value: i64,
    },
    /// A sequence's tokens after this step would not fit its cache.
    #[error("sequence {batch} would hold {cache_len} + {new} tokens, past its cache capacity of {capacity}")]
    CacheOverflow {
        batch: usize,
        cache_len: usize,
        new: usize,
        capacity: usize,
    },
    /// A cache row or page a sequence uses does not exist.
    #[error(
        "{tensor} entry {slot} of sequence {batch} is {page}, out of range for a cache of {pages}"
    )]
    PageOutOfRange {
        tensor: &'static str,
        batch: usize,
        slot: usize,
        page: i64,
        pages: usize,
    },
    /// Two sequences would append to the same cache row.
    #[error("sequences {first} and {second} both append to cache row {row}")]
    AppendConflict {
        first: usize,
        second: usize,
        row: usize,
    },
    /// The cache index arguments do not fit the cache's layout.
    #[error("{reason}")]
    CacheIndex { reason: &'static str },
    /// A cu_seqlens array that does not start at 0.
    #[error("{tensor} must start at 0, got {first}")]
    CuSeqlensStart { tensor: &'static str, first: i64 },
    /// A cu_seqlens array that decreases.
    #[error("{tensor} decreases at index {index}: {value} after {previous}")]
    CuSeqlensDecrease {
        tensor: &'static str,
        index: usize,
        value: i64,
        previous: i64,
    },
    /// A cu_seqlens array whose last entry is not the packed tensor's row count.
    #[error("{tensor} ends at {last}, but {rows_of} has {total} rows")]
    CuSeqlensTotal {
        tensor: &'static str,
        last: i64,
        rows_of: &'static str,
        total: usize,
    },
    /// A packed (varlen) call given a batched tensor.
    #[error("with cu_seqlens, {tensor} must be packed as (total, heads, head_dim), not batched ({batch} batch entries)")]
    PackedBatch { tensor: &'static str, batch: usize },
    /// ALiBi slopes of neither accepted length.
    #[error("alibi slopes have {len} entries; expected heads_q ({heads_q}) or batch × heads_q ({batch} × {heads_q})")]
    AlibiSlopes {
        len: usize,
        heads_q: usize,
        batch: usize,
    },
    /// An entry of a per-head input (ALiBi slopes, sinks) that is not finite.
    #[error("{tensor}[{index}] is {value}; every entry must be finite")]
    NonFinite {
        tensor: &'static str,
        index: usize,
        value: f32,
    },
    /// A block size below 1.
    #[error("block sizes must be at least 1, got {bm} × {bn}")]
    BlockSize { bm: usize, bn: usize },
    /// A block-mask dimension that does not fit the problem.
    #[error("the block mask's {dim} is {value}, expected {expected}{}", if *.broadcast { " (or 1, to broadcast)" } else { "" })]
    BlockMaskDim {
        dim: &'static str,
        value: usize,
        expected: usize,
        broadcast: bool,
    },
    /// A feature this backend or entry point does not implement.
    #[error("{what} does not support {feature}")]
    Unsupported {
        what: &'static str,
        feature: &'static str,
    },
    /// A caller-owned device buffer is smaller than the problem needs.
    #[error("buffer {buffer} holds {size} bytes, the problem needs {needed}")]
    BufferTooSmall {
        buffer: &'static str,
        size: u64,
        needed: u64,
    },
    /// A caller's binding starts at an offset the device cannot bind.
    #[error("{tensor}'s binding starts at byte {offset}, not a multiple of the device's storage-buffer offset alignment ({alignment} bytes)")]
    MisalignedBinding {
        tensor: &'static str,
        offset: u64,
        alignment: u32,
    },
    /// An output's binding intersects another tensor's range in the same
    /// buffer (an input's, or another output's). Ranges of one buffer that
    /// do not intersect are fine, outputs beside inputs included.
    #[error("{output}'s binding overlaps {other}'s in the same buffer; an output's range must not intersect any other tensor's")]
    OverlappingBindings {
        output: &'static str,
        other: &'static str,
    },
    /// An encoded call would have to be split to run.
    #[error("the encoded {call} would run in {pieces} pieces (past one storage binding, the dispatch grid or the adapter's loop limit); an encoded call runs whole: use the host-tensor call or a smaller problem")]
    EncodedCallSplit { call: &'static str, pieces: usize },
    /// A caller's binding reaches past the end of its buffer.
    #[error("{tensor}'s binding ({size} bytes at byte {offset}) reaches past the end of its {buffer_size}-byte buffer")]
    BindingOutsideBuffer {
        tensor: &'static str,
        offset: u64,
        size: u64,
        buffer_size: u64,
    },

    // ---- bad configuration (plans and overrides) ----
    #[error("requested workgroup storage of {requested} bytes exceeds the device maximum {max}")]
    StorageOverride { requested: u32, max: u32 },
    #[error("tiles Br {br} × Bc {bc} at d {head_dim} need {bytes} bytes of workgroup storage, the maximum is {max}")]
    WorkgroupStorage {
        br: u32,
        bc: u32,
        head_dim: u32,
        bytes: u32,
        max: u32,
    },
    #[error("a workgroup of {invocations} invocations exceeds the device maximum {max}")]
    WorkgroupTooLarge { invocations: u32, max: u32 },
    #[error("{threads_per_row} invocations per row leave {scores} scores and {accumulators} accumulators per invocation (max {max_scores} and {max_accumulators})")]
    RegisterPressure {
        threads_per_row: u32,
        scores: u32,
        accumulators: u32,
        max_scores: u32,
        max_accumulators: u32,
    },
    #[error("tile sizes must be at least 1 (Br {br}, Bc {bc}, threads per row {threads_per_row})")]
    EmptyTile {
        br: u32,
        bc: u32,
        threads_per_row: u32,
    },
    #[error("Br, Bc, threads per row and workgroup storage apply to the tiled kernels only, not to the lanes kernels")]
    TileOverrideOnLanes,
    #[error("rows per invocation, subgroup reductions and double buffering apply to the registers kernels only, not to the {kernel} kernels")]
    RegisterOverrideElsewhere { kernel: &'static str },
    #[error("rows per invocation must be 1..={max}, not {rows}")]
    RowsPerThread { rows: u32, max: u32 },
    #[error(
        "the lanes kernels need a head dim that is a multiple of 4 up to {max}, not {head_dim}"
    )]
    LanesHeadDim { head_dim: usize, max: usize },
    #[error("the coop kernel takes head dims up to {max}, not {head_dim}")]
    CoopHeadDim { head_dim: usize, max: usize },
    #[error("the coop kernel's Br and Bc must be multiples of its {n}×{n} matrices, Br must divide its {workgroup} invocations and Bc be a multiple of {workgroup}/Br (Br {br}, Bc {bc}); threads per row are its own")]
    CoopTile {
        br: u32,
        bc: u32,
        n: u32,
        workgroup: u32,
    },
    #[error("the coop kernel's threads per row follow from Br (its workgroup / Br); override Br, Bc or the workgroup storage instead")]
    ThreadsOverrideOnCoop,

    // ---- the hardware (or this build) can't ----
    #[error(
        "the lanes kernels need a CPU adapter with fixed-size subgroups and subgroup operations"
    )]
    LanesUnavailable,
    #[error("subgroup row reductions need the {threads_per_row} invocations of a row to be a power of two within the adapter's smallest subgroup ({subgroup}; 0: no SUBGROUP)")]
    SubgroupReduce { threads_per_row: u32, subgroup: u32 },
    #[error("the CPU backend's {isa} kernels need an instruction set this machine lacks")]
    IsaUnavailable { isa: &'static str },
    #[error("native f16 needs the SHADER_F16 feature, which this adapter lacks")]
    NativeF16Unavailable,
    /// The cooperative-matrix kernel needs what the device lacks (`missing`
    /// names it: the feature, a matrix shape, SHADER_F16, SUBGROUP).
    #[error("the coop kernel needs {missing}, which this device lacks")]
    CoopMatrixUnavailable { missing: &'static str },
    /// FP8 (e4m3) is built for the forward pass only.
    #[error("FP8 (e4m3) runs the forward pass only; {operation} with --precision fp8 is not built (use f32, f16 or bf16)")]
    Fp8Unsupported { operation: &'static str },
    /// One storage binding cannot hold what an API that does not split needs.
    #[error("{what} needs {bytes} bytes, more than one storage binding holds ({max} bytes)")]
    BindingTooLarge {
        what: &'static str,
        bytes: u64,
        max: u64,
    },
    #[error("{what} needs {groups} workgroups in one dimension, more than the device's {max}")]
    GridTooLarge {
        what: &'static str,
        groups: u64,
        max: u32,
    },
    #[error("{what} {value} does not fit in 32 bits")]
    Overflow { what: &'static str, value: u64 },
    /// A decoding step whose keys need more splits than the merge combines
    /// to stay within the adapter's loop limit.
    #[error("{keys} keys need {needed} splits of at most {max_keys} keys (the adapter's loop limit), more than the {max} splits the merge combines")]
    TooManySplits {
        keys: usize,
        needed: usize,
        max_keys: usize,
        max: usize,
    },
    #[error(
        "the {backend} backend is not built into this binary (rebuild with `--features {backend}`)"
    )]
    BackendNotBuilt { backend: &'static str },
    /// The CUDA backend needs a library or a device this machine lacks
    /// (checked before cudarc is asked to load it, which would panic).
    #[error("the CUDA backend cannot start: {missing} not found")]
    CudaUnavailable { missing: &'static str },
    /// The device's compute capability is below what the kernels need.
    #[error(
        "the CUDA kernels need compute capability {needed} or later; {device} has {major}.{minor}"
    )]
    CudaArch {
        device: String,
        major: i32,
        minor: i32,
        needed: &'static str,
    },
    /// PTX for this architecture cannot run on the device (`--arch`,
    /// `FLASHATTN_CUDA_ARCH`).
    #[error("the CUDA kernels cannot be compiled for {arch} on {device}: {why}")]
    CudaArchUnfit {
        arch: String,
        device: String,
        why: &'static str,
    },
    #[error(
        "no GPU adapter found; install a Vulkan driver (on Debian: `apt-get install -y mesa-vulkan-drivers` \
         gives the CPU-based lavapipe) or use the CPU backend (`--backend cpu`)"
    )]
    NoAdapter {
        #[source]
        source: wgpu::RequestAdapterError,
    },
    /// Even a piece one tile long runs past the adapter's loop limit.
    #[error("the {kernel} kernel runs past the adapter's loop limit ({limit} iterations per invocation) even on {length} rows or keys")]
    LoopLimitTooLow {
        kernel: &'static str,
        limit: u32,
        length: usize,
    },
    // ---- execution failed ----
    #[error("requesting a device on {adapter}")]
    RequestDevice {
        adapter: String,
        #[source]
        source: wgpu::RequestDeviceError,
    },
    /// The device rejected something (a validation error captured by a scope).
    #[error("{during}: the device reported an error")]
    Device {
        during: &'static str,
        #[source]
        source: wgpu::Error,
    },
    #[error("{during}: out of device memory")]
    OutOfMemory {
        during: &'static str,
        #[source]
        source: wgpu::Error,
    },
    /// An error no scope captured (reported by the device's handler).
    #[error("the device reported an error outside any call: {message}")]
    Uncaptured { message: String },
    #[error("waiting for the GPU")]
    Poll {
        #[source]
        source: wgpu::PollError,
    },
    #[error("mapping a readback buffer")]
    Map {
        #[source]
        source: wgpu::BufferAsyncError,
    },
    #[error("reading a mapped readback buffer")]
    MapRange {
        #[source]
        source: wgpu::MapRangeError,
    },
    #[error("the device was lost before the work completed")]
    DeviceLost,
    /// A kernel ran past the adapter's loop limit (llvmpipe stops every loop of
    /// an invocation after `limit` iterations in total) and stopped short, so
    /// its results were discarded. Host-tensor calls rerun in shorter pieces;
    /// this reaches callers only from APIs that cannot split.
    #[error("the {kernel} kernel ran past the adapter's loop limit ({limit} loop iterations per invocation) on {rows} rows × {keys} keys and stopped short, so its results were discarded; the host-tensor API splits such calls")]
    LoopBudget {
        kernel: &'static str,
        rows: usize,
        keys: usize,
        limit: u32,
    },
    /// NVRTC rejected a kernel variant's source (a bug in cuda/, or an
    /// NVRTC too old for the architecture asked for).
    #[error("NVRTC could not compile {kernel} for {arch}: {log}")]
    CudaCompile {
        kernel: String,
        arch: String,
        log: String,
    },
    /// The driver's JIT could not load a kernel's PTX; its info and error
    /// logs follow.
    #[error("the CUDA driver could not load {kernel}: {message}\n{log}")]
    CudaJit {
        kernel: String,
        message: String,
        log: String,
    },
    /// A CUDA driver call failed.
    #[error("{during}: the CUDA driver reported {message}")]
    CudaDriver {
        during: &'static str,
        message: String,
    },
    #[error("{what} was poisoned by a panic in another thread")]
    Poisoned { what: &'static str },
    /// Every kernel family that could run the call failed its known-answer
    /// check on this device (`crate::verify`): rather than wrong numbers,
    /// this error (`Backend` runs the CPU backend instead).
    #[error("every {call} kernel family failed its known-answer check on this device ({tried}); run `flashattn doctor` for the details, or set FLASHATTN_VERIFY=off to run them anyway")]
    VerificationFailed { call: &'static str, tried: String },
    /// The autotuner's winner could not be stored.
    #[error("cannot write the tuning cache {}", path.display())]
    TuneCacheWrite {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

/// Shorthand for `Result<T, flashattn::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

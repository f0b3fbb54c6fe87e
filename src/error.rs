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
    /// A shard's global position (`which`: q_offset or k_offset) is past `max`.
    #[error("{which} ({position}) is past the largest shard position {max}")]
    PositionTooLarge {
        /// q_offset or k_offset.
        which: &'static str,
        /// The position given.
        position: usize,
        /// The largest value allowed.
        max: usize,
    },
    /// A size that must be at least 1 is 0.
    #[error("{dim} must be at least 1, got 0")]
    EmptyDim {
        /// The dimension's name.
        dim: &'static str,
    },
    /// The head dim of `tensor` (`head_dim`) is larger than the supported maximum `max`.
    #[error("the head dim of {tensor} ({head_dim}) is larger than the supported maximum {max}")]
    HeadDimTooLarge {
        /// The tensor's name.
        tensor: &'static str,
        /// The head dim given.
        head_dim: usize,
        /// The largest value allowed.
        max: usize,
    },
    /// Heads_q (`heads_q`) must be a multiple of heads_kv (`heads_kv`).
    #[error("heads_q ({heads_q}) must be a multiple of heads_kv ({heads_kv})")]
    HeadsNotDivisible {
        /// The number of query heads.
        heads_q: usize,
        /// The number of key/value heads.
        heads_kv: usize,
    },
    /// A size computed from the caller's dims (a shape's element count, the
    /// product or sum of two sizes) overflows, or passes what this target
    /// can hold (see `api::size`: `max` is 2⁶¹ − 1 on 64-bit targets,
    /// 2²⁹ − 1 on wasm32). Reported before anything is allocated.
    #[error("{what} {operands:?}: the {op} overflows (at most {max} on this target)")]
    SizeOverflow {
        /// What it concerns.
        what: &'static str,
        /// "element count", "product" or "sum".
        op: &'static str,
        /// The dims (or the two sizes) as given.
        operands: Vec<u64>,
        /// The largest value allowed.
        max: u64,
    },
    /// A host result the caller asked for (a dropout mask) whose size fits
    /// the target's limits but not this machine's memory: reported instead
    /// of aborting in the allocator.
    #[error("{what} needs {bytes} bytes of host memory, more than this machine can allocate")]
    HostMemory {
        /// What it concerns.
        what: &'static str,
        /// The bytes asked for.
        bytes: u64,
    },
    /// A tensor's data does not hold as many elements as its shape says.
    #[error("{tensor} has shape {shape:?} ({expected} elements) but {actual} elements of data")]
    DataLength {
        /// The tensor's name.
        tensor: &'static str,
        /// The shape given.
        shape: Vec<usize>,
        /// What was expected.
        expected: usize,
        /// What was found.
        actual: usize,
    },
    /// `tensor` has rank `rank` (shape `shape`); expected `expected` dims.
    #[error("{tensor} has rank {rank} (shape {shape:?}); expected {expected} dims")]
    Rank {
        /// The tensor's name.
        tensor: &'static str,
        /// The shape given.
        shape: Vec<usize>,
        /// The rank given.
        rank: usize,
        /// What was expected.
        expected: usize,
    },
    /// One dimension of two tensors that must agree differs.
    #[error("{dim} of {tensor} ({value}) and {other} ({other_value}) differ")]
    DimMismatch {
        /// The dimension's name.
        dim: &'static str,
        /// The tensor's name.
        tensor: &'static str,
        /// The value given.
        value: usize,
        /// The other tensor.
        other: &'static str,
        /// The other tensor's value.
        other_value: usize,
    },
    /// A tensor's shape differs from the one it must have.
    #[error("{tensor} has shape {shape:?}, expected {expected:?} (the shape of {like}); the shapes differ")]
    ShapeMismatch {
        /// The tensor's name.
        tensor: &'static str,
        /// The shape given.
        shape: Vec<usize>,
        /// The tensor it must match.
        like: &'static str,
        /// What was expected.
        expected: Vec<usize>,
    },
    /// `tensor` has dtype `dtype` but `like` has `expected`: they must share one dtype.
    #[error("{tensor} has dtype {dtype} but {like} has {expected}: they must share one dtype")]
    DtypeMismatch {
        /// The tensor's name.
        tensor: &'static str,
        /// The dtype given.
        dtype: &'static str,
        /// The tensor it must match.
        like: &'static str,
        /// What was expected.
        expected: &'static str,
    },
    /// Scale must be finite, got `scale`.
    #[error("scale must be finite, got {scale}")]
    NonFiniteScale {
        /// The scale given.
        scale: f32,
    },
    /// Quantization (FP8 inputs, a quantized KV cache) needs finite values:
    /// a NaN or ±inf has no scale (or, as an FP8 cache code, is a NaN).
    #[error("{tensor}[{index}] is not finite; quantization needs finite values")]
    NonFiniteInput {
        /// The tensor's name.
        tensor: &'static str,
        /// The offending index.
        index: usize,
    },
    /// A quantized KV cache's block scale that is NaN, infinite or not positive.
    #[error("{tensor}[{index}] is {value}; a block scale must be a finite value > 0")]
    InvalidCacheScale {
        /// The scales' name (`k_scales`, `v_scales`).
        tensor: &'static str,
        /// The offending index.
        index: usize,
        /// The value given.
        value: f32,
    },
    /// A KV cache of one format where the call needs another: a quantized
    /// cache read as a plain one, a plain one decoded as quantized.
    #[error("the KV cache holds {found}; this call needs {expected}")]
    CacheFormat {
        /// What the call needs (`"int8 codes"`, `"f16 elements"`, ...).
        expected: String,
        /// What the cache holds.
        found: String,
    },
    /// A device KV cache given to an engine other than the one that made
    /// it (each engine's caches are its own, even on one device: make the
    /// cache with this engine, or wrap the same buffers with its
    /// `kv_cache_in`).
    #[error("this KV cache was made by another engine; a device cache works only with the engine that made it (wrap the same buffers with this engine's kv_cache_in)")]
    ForeignCache,
    /// Softcap must be a finite value >= 0, got `softcap`.
    #[error("softcap must be a finite value >= 0, got {softcap}")]
    InvalidSoftcap {
        /// The softcap given.
        softcap: f32,
    },
    /// The dropout probability must be in `[0, 1)`.
    #[error("dropout probability must be in [0, 1), got {p}")]
    InvalidDropout {
        /// The probability given.
        p: f32,
    },
    /// Dropout with `p > 0` needs a seed for its generator.
    #[error("dropout with p = {p} needs a seed")]
    MissingDropoutSeed {
        /// The probability given.
        p: f32,
    },
    /// A name (precision, backend, kernel) that is not one of the known ones.
    #[error("unknown {what} `{name}` (expected {expected})")]
    UnknownName {
        /// What it concerns.
        what: &'static str,
        /// The name given.
        name: String,
        /// What was expected.
        expected: &'static str,
    },
    /// An index array (cache_seqlens, cache_batch_idx, block_table) has the wrong length.
    #[error("{tensor} has {len} entries, expected {expected}")]
    IndexLength {
        /// The tensor's name.
        tensor: &'static str,
        /// The length.
        len: usize,
        /// What was expected.
        expected: usize,
    },
    /// `tensor` at `index` is `value`; lengths and indices must not be negative.
    #[error("{tensor}[{index}] is {value}; lengths and indices must not be negative")]
    NegativeIndex {
        /// The tensor's name.
        tensor: &'static str,
        /// The offending index.
        index: usize,
        /// The value given.
        value: i64,
    },
    /// A sequence's tokens after this step would not fit its cache.
    #[error("sequence {batch} would hold {cache_len} + {new} tokens, past its cache capacity of {capacity}")]
    CacheOverflow {
        /// The batch size.
        batch: usize,
        /// The cache length.
        cache_len: usize,
        /// The new value.
        new: usize,
        /// The capacity.
        capacity: usize,
    },
    /// A cache row or page a sequence uses does not exist.
    #[error(
        "{tensor} entry {slot} of sequence {batch} is {page}, out of range for a cache of {pages}"
    )]
    PageOutOfRange {
        /// The tensor's name.
        tensor: &'static str,
        /// The batch size.
        batch: usize,
        /// The slot.
        slot: usize,
        /// The page.
        page: i64,
        /// The number of pages.
        pages: usize,
    },
    /// Two sequences would append to the same cache row.
    #[error("sequences {first} and {second} both append to cache row {row}")]
    AppendConflict {
        /// The first one.
        first: usize,
        /// The second one.
        second: usize,
        /// The row.
        row: usize,
    },
    /// The cache index arguments do not fit the cache's layout.
    #[error("{reason}")]
    CacheIndex {
        /// Why.
        reason: &'static str,
    },
    /// A latent cache whose V view (`v_width` columns) is wider than its
    /// rows (`width`).
    #[error("the latent cache's v view ({v_width} columns) is wider than its rows ({width})")]
    LatentViewTooWide {
        /// The view's width, V's head dim.
        v_width: usize,
        /// The latent rows' width, K's head dim.
        width: usize,
    },
    /// A step's new rows do not fit its cache: `v_new` on a latent cache
    /// (its V is a view of K), or `k_new` alone on a cache with a V of its own.
    #[error("{reason}")]
    LatentAppend {
        /// Why.
        reason: &'static str,
    },
    /// A cu_seqlens array that does not start at 0.
    #[error("{tensor} must start at 0, got {first}")]
    CuSeqlensStart {
        /// The tensor's name.
        tensor: &'static str,
        /// The first one.
        first: i64,
    },
    /// A cu_seqlens array that decreases.
    #[error("{tensor} decreases at index {index}: {value} after {previous}")]
    CuSeqlensDecrease {
        /// The tensor's name.
        tensor: &'static str,
        /// The offending index.
        index: usize,
        /// The value given.
        value: i64,
        /// The previous value.
        previous: i64,
    },
    /// A cu_seqlens array whose last entry is not the packed tensor's row count.
    #[error("{tensor} ends at {last}, but {rows_of} has {total} rows")]
    CuSeqlensTotal {
        /// The tensor's name.
        tensor: &'static str,
        /// The last one.
        last: i64,
        /// Whose rows.
        rows_of: &'static str,
        /// The total.
        total: usize,
    },
    /// A packed (varlen) call given a batched tensor.
    #[error("with cu_seqlens, {tensor} must be packed as (total, heads, head_dim), not batched ({batch} batch entries)")]
    PackedBatch {
        /// The tensor's name.
        tensor: &'static str,
        /// The batch size.
        batch: usize,
    },
    /// ALiBi slopes of neither accepted length.
    #[error("alibi slopes have {len} entries; expected heads_q ({heads_q}) or batch × heads_q ({batch} × {heads_q})")]
    AlibiSlopes {
        /// The length.
        len: usize,
        /// The number of query heads.
        heads_q: usize,
        /// The batch size.
        batch: usize,
    },
    /// ALiBi slopes given with their shape ([`crate::Alibi::shaped`]) in
    /// neither accepted shape, whatever their count.
    #[error("alibi slopes have shape {}; expected (heads_q,) = ({heads_q},) or (batch, heads_q) = ({batch}, {heads_q})", tuple(shape))]
    AlibiShape {
        /// The shape given.
        shape: Vec<usize>,
        /// The number of query heads.
        heads_q: usize,
        /// The batch size (sequences, for a packed batch).
        batch: usize,
    },
    /// An entry of a per-head input (ALiBi slopes, sinks) that is not finite.
    #[error("{tensor}[{index}] is {value}; every entry must be finite")]
    NonFinite {
        /// The tensor's name.
        tensor: &'static str,
        /// The offending index.
        index: usize,
        /// The value given.
        value: f32,
    },
    /// A block size below 1.
    #[error("block sizes must be at least 1, got {bm} × {bn}")]
    BlockSize {
        /// Rows per matmul tile.
        bm: usize,
        /// Columns per matmul tile.
        bn: usize,
    },
    /// A block-mask dimension that does not fit the problem.
    #[error("the block mask's {dim} is {value}, expected {expected}{}", if *.broadcast { " (or 1, to broadcast)" } else { "" })]
    BlockMaskDim {
        /// The dimension's name.
        dim: &'static str,
        /// The value given.
        value: usize,
        /// What was expected.
        expected: usize,
        /// The broadcast shape.
        broadcast: bool,
    },
    /// A feature this backend or entry point does not implement.
    #[error("{what} does not support {feature}")]
    Unsupported {
        /// What it concerns.
        what: &'static str,
        /// The feature.
        feature: &'static str,
    },
    /// A caller-owned device buffer is smaller than the problem needs.
    #[error("buffer {buffer} holds {size} bytes, the problem needs {needed}")]
    BufferTooSmall {
        /// The buffer's name.
        buffer: &'static str,
        /// The size.
        size: u64,
        /// What is needed.
        needed: u64,
    },
    /// A caller's binding starts at an offset the device cannot bind.
    #[error("{tensor}'s binding starts at byte {offset}, not a multiple of the device's storage-buffer offset alignment ({alignment} bytes)")]
    MisalignedBinding {
        /// The tensor's name.
        tensor: &'static str,
        /// The offset.
        offset: u64,
        /// The alignment required.
        alignment: u32,
    },
    /// An output's binding intersects another tensor's range in the same
    /// buffer (an input's, or another output's). Ranges of one buffer that
    /// do not intersect are fine, outputs beside inputs included.
    #[error("{output}'s binding overlaps {other}'s in the same buffer; an output's range must not intersect any other tensor's")]
    OverlappingBindings {
        /// The output.
        output: &'static str,
        /// The tensor whose range it intersects.
        other: &'static str,
    },
    /// An encoded call would have to be split to run.
    #[error("the encoded {call} would run in {pieces} pieces (past one storage binding, the dispatch grid or the adapter's loop limit); an encoded call runs whole: use the host-tensor call or a smaller problem")]
    EncodedCallSplit {
        /// The call.
        call: &'static str,
        /// The number of pieces.
        pieces: usize,
    },
    /// A caller's binding reaches past the end of its buffer.
    #[error("{tensor}'s binding ({size} bytes at byte {offset}) reaches past the end of its {buffer_size}-byte buffer")]
    BindingOutsideBuffer {
        /// The tensor's name.
        tensor: &'static str,
        /// The offset.
        offset: u64,
        /// The size.
        size: u64,
        /// The buffer's size in bytes.
        buffer_size: u64,
    },
    /// A caller's buffer lacks a usage the call binds it with.
    #[error("{tensor}'s buffer lacks {missing} usage, which binding it needs (add wgpu::BufferUsages::{missing} where the buffer is made)")]
    BufferUsage {
        /// The tensor's name.
        tensor: &'static str,
        /// The missing usage flag.
        missing: &'static str,
    },

    // ---- bad configuration (plans and overrides) ----
    /// Requested workgroup storage of `requested` bytes exceeds the device maximum `max`.
    #[error("requested workgroup storage of {requested} bytes exceeds the device maximum {max}")]
    StorageOverride {
        /// What was requested.
        requested: u32,
        /// The largest value allowed.
        max: u32,
    },
    /// Tiles Br `br` × Bc `bc` at d `head_dim` need `bytes` bytes of workgroup storage, the maximum is `max`.
    #[error("tiles Br {br} × Bc {bc} at d {head_dim} need {bytes} bytes of workgroup storage, the maximum is {max}")]
    WorkgroupStorage {
        /// Query rows per tile.
        br: u32,
        /// Keys per tile.
        bc: u32,
        /// The head dim given.
        head_dim: u32,
        /// The bytes.
        bytes: u32,
        /// The largest value allowed.
        max: u32,
    },
    /// A workgroup of `invocations` invocations exceeds the device maximum `max`.
    #[error("a workgroup of {invocations} invocations exceeds the device maximum {max}")]
    WorkgroupTooLarge {
        /// The invocations.
        invocations: u32,
        /// The largest value allowed.
        max: u32,
    },
    /// `threads_per_row` invocations per row leave `scores` scores and `accumulators` accumulators per invocation (max `max_scores` and `max_accumulators`).
    #[error("{threads_per_row} invocations per row leave {scores} scores and {accumulators} accumulators per invocation (max {max_scores} and {max_accumulators})")]
    RegisterPressure {
        /// Invocations per query row.
        threads_per_row: u32,
        /// The scores.
        scores: u32,
        /// The accumulators.
        accumulators: u32,
        /// The most scores allowed.
        max_scores: u32,
        /// The most accumulators allowed.
        max_accumulators: u32,
    },
    /// Tile sizes must be at least 1 (Br `br`, Bc `bc`, threads per row `threads_per_row`).
    #[error("tile sizes must be at least 1 (Br {br}, Bc {bc}, threads per row {threads_per_row})")]
    EmptyTile {
        /// Query rows per tile.
        br: u32,
        /// Keys per tile.
        bc: u32,
        /// Invocations per query row.
        threads_per_row: u32,
    },
    /// Br, Bc, threads per row and workgroup storage apply to the tiled kernels only, not to the lanes kernels.
    #[error("Br, Bc, threads per row and workgroup storage apply to the tiled kernels only, not to the lanes kernels")]
    TileOverrideOnLanes,
    /// Rows per invocation, subgroup reductions and double buffering apply to the registers kernels only, not to the `kernel` kernels.
    #[error("rows per invocation, subgroup reductions and double buffering apply to the registers kernels only, not to the {kernel} kernels")]
    RegisterOverrideElsewhere {
        /// The kernel's name.
        kernel: &'static str,
    },
    /// Rows per invocation must be 1..=`max`, not `rows`.
    #[error("rows per invocation must be 1..={max}, not {rows}")]
    RowsPerThread {
        /// The rows.
        rows: u32,
        /// The largest value allowed.
        max: u32,
    },
    /// The lanes kernels take head dims that are multiples of 4 up to `max`.
    #[error(
        "the lanes kernels need a head dim that is a multiple of 4 up to {max}, not {head_dim}"
    )]
    LanesHeadDim {
        /// The head dim given.
        head_dim: usize,
        /// The largest value allowed.
        max: usize,
    },
    /// The coop kernel takes head dims up to `max`, not `head_dim`.
    #[error("the coop kernel takes head dims up to {max}, not {head_dim}")]
    CoopHeadDim {
        /// The head dim given.
        head_dim: usize,
        /// The largest value allowed.
        max: usize,
    },
    /// The coop kernel's Br and Bc must be multiples of its `n`×`n` matrices, Br must divide its `workgroup` invocations and Bc be a multiple of `workgroup`/Br (Br `br`, Bc `bc`); threads per row are its own.
    #[error("the coop kernel's Br and Bc must be multiples of its {n}×{n} matrices, Br must divide its {workgroup} invocations and Bc be a multiple of {workgroup}/Br (Br {br}, Bc {bc}); threads per row are its own")]
    CoopTile {
        /// Query rows per tile.
        br: u32,
        /// Keys per tile.
        bc: u32,
        /// The count.
        n: u32,
        /// The workgroup size.
        workgroup: u32,
    },
    /// The coop kernel's threads per row follow from Br (its workgroup / Br); override Br, Bc or the workgroup storage instead.
    #[error("the coop kernel's threads per row follow from Br (its workgroup / Br); override Br, Bc or the workgroup storage instead")]
    ThreadsOverrideOnCoop,

    // ---- the hardware (or this build) can't ----
    /// The lanes kernels need a CPU adapter with fixed-size subgroups.
    #[error(
        "the lanes kernels need a CPU adapter with fixed-size subgroups and subgroup operations"
    )]
    LanesUnavailable,
    /// Subgroup row reductions need the `threads_per_row` invocations of a row to be a power of two within the adapter's smallest subgroup (`subgroup`; 0: no SUBGROUP).
    #[error("subgroup row reductions need the {threads_per_row} invocations of a row to be a power of two within the adapter's smallest subgroup ({subgroup}; 0: no SUBGROUP)")]
    SubgroupReduce {
        /// Invocations per query row.
        threads_per_row: u32,
        /// The subgroup size.
        subgroup: u32,
    },
    /// The CPU backend's `isa` kernels need an instruction set this machine lacks.
    #[error("the CPU backend's {isa} kernels need an instruction set this machine lacks")]
    IsaUnavailable {
        /// The instruction set.
        isa: &'static str,
    },
    /// Native f16 needs the SHADER_F16 feature, which this adapter lacks.
    #[error("native f16 needs the SHADER_F16 feature, which this adapter lacks")]
    NativeF16Unavailable,
    /// The cooperative-matrix kernel needs what the device lacks (`missing`
    /// names it: the feature, a matrix shape, SHADER_F16, SUBGROUP).
    #[error("the coop kernel needs {missing}, which this device lacks")]
    CoopMatrixUnavailable {
        /// What is missing.
        missing: &'static str,
    },
    /// FP8 (e4m3) is built for the forward pass only.
    #[error("FP8 (e4m3) runs the forward pass only; {operation} with --precision fp8 is not built (use f32, f16 or bf16)")]
    Fp8Unsupported {
        /// The operation.
        operation: &'static str,
    },
    /// One storage binding cannot hold what an API that does not split needs.
    #[error("{what} needs {bytes} bytes, more than one storage binding holds ({max} bytes)")]
    BindingTooLarge {
        /// What it concerns.
        what: &'static str,
        /// The bytes.
        bytes: u64,
        /// The largest value allowed.
        max: u64,
    },
    /// `what` needs `groups` workgroups in one dimension, more than the device's `max`.
    #[error("{what} needs {groups} workgroups in one dimension, more than the device's {max}")]
    GridTooLarge {
        /// What it concerns.
        what: &'static str,
        /// The number of workgroups.
        groups: u64,
        /// The largest value allowed.
        max: u32,
    },
    /// `what` `value` does not fit in 32 bits.
    #[error("{what} {value} does not fit in 32 bits")]
    Overflow {
        /// What it concerns.
        what: &'static str,
        /// The value given.
        value: u64,
    },
    /// A decoding step whose keys need more splits than the merge combines
    /// to stay within the adapter's loop limit.
    #[error("{keys} keys need {needed} splits of at most {max_keys} keys (the adapter's loop limit), more than the {max} splits the merge combines")]
    TooManySplits {
        /// The keys.
        keys: usize,
        /// What is needed.
        needed: usize,
        /// The most keys allowed.
        max_keys: usize,
        /// The largest value allowed.
        max: usize,
    },
    /// A backend asked for whose cargo feature this build lacks.
    #[error(
        "the {backend} backend is not built into this binary (rebuild with `--features {backend}`)"
    )]
    BackendNotBuilt {
        /// The backend's name.
        backend: &'static str,
    },
    /// The CUDA backend needs a library or a device this machine lacks
    /// (checked before cudarc is asked to load it, which would panic).
    #[error("the CUDA backend cannot start: {missing} not found")]
    CudaUnavailable {
        /// What is missing.
        missing: &'static str,
    },
    /// The device's compute capability is below what the kernels need.
    #[error(
        "the CUDA kernels need compute capability {needed} or later; {device} has {major}.{minor}"
    )]
    CudaArch {
        /// The device.
        device: String,
        /// The major version.
        major: i32,
        /// The minor version.
        minor: i32,
        /// What is needed.
        needed: &'static str,
    },
    /// PTX for this architecture cannot run on the device (`--arch`,
    /// `FLASHATTN_CUDA_ARCH`).
    #[error("the CUDA kernels cannot be compiled for {arch} on {device}: {why}")]
    CudaArchUnfit {
        /// The architecture.
        arch: String,
        /// The device.
        device: String,
        /// Why.
        why: &'static str,
    },
    /// No wgpu adapter on this machine.
    #[error(
        "no GPU adapter found; install a Vulkan driver (on Debian: `apt-get install -y mesa-vulkan-drivers` \
         gives the CPU-based lavapipe) or use the CPU backend (`--backend cpu`)"
    )]
    NoAdapter {
        /// The underlying error.
        #[source]
        source: wgpu::RequestAdapterError,
    },
    /// Even a piece one tile long runs past the adapter's loop limit.
    #[error("the {kernel} kernel runs past the adapter's loop limit ({limit} iterations per invocation) even on {length} rows or keys")]
    LoopLimitTooLow {
        /// The kernel's name.
        kernel: &'static str,
        /// The limit.
        limit: u32,
        /// The length.
        length: usize,
    },
    // ---- execution failed ----
    /// Requesting a device on `adapter`.
    #[error("requesting a device on {adapter}")]
    RequestDevice {
        /// The adapter.
        adapter: String,
        /// The underlying error.
        #[source]
        source: wgpu::RequestDeviceError,
    },
    /// The device rejected something (a validation error captured by a scope).
    #[error("{during}: the device reported an error")]
    Device {
        /// What was running.
        during: &'static str,
        /// The underlying error.
        #[source]
        source: wgpu::Error,
    },
    /// `during`: out of device memory.
    #[error("{during}: out of device memory")]
    OutOfMemory {
        /// What was running.
        during: &'static str,
        /// The underlying error.
        #[source]
        source: wgpu::Error,
    },
    /// An error no scope captured (reported by the device's handler).
    #[error("the device reported an error outside any call: {message}")]
    Uncaptured {
        /// The message.
        message: String,
    },
    /// Waiting for the GPU.
    #[error("waiting for the GPU")]
    Poll {
        /// The underlying error.
        #[source]
        source: wgpu::PollError,
    },
    /// Mapping a readback buffer.
    #[error("mapping a readback buffer")]
    Map {
        /// The underlying error.
        #[source]
        source: wgpu::BufferAsyncError,
    },
    /// Reading a mapped readback buffer.
    #[error("reading a mapped readback buffer")]
    MapRange {
        /// The underlying error.
        #[source]
        source: wgpu::MapRangeError,
    },
    /// The device was lost before the work completed.
    #[error("the device was lost before the work completed")]
    DeviceLost,
    /// A kernel ran past the adapter's loop limit (llvmpipe stops every loop of
    /// an invocation after `limit` iterations in total) and stopped short, so
    /// its results were discarded. Host-tensor calls rerun in shorter pieces;
    /// this reaches callers only from APIs that cannot split.
    #[error("the {kernel} kernel ran past the adapter's loop limit ({limit} loop iterations per invocation) on {rows} rows × {keys} keys and stopped short, so its results were discarded; the host-tensor API splits such calls")]
    LoopBudget {
        /// The kernel's name.
        kernel: &'static str,
        /// The rows.
        rows: usize,
        /// The keys.
        keys: usize,
        /// The limit.
        limit: u32,
    },
    /// NVRTC rejected a kernel variant's source (a bug in cuda/, or an
    /// NVRTC too old for the architecture asked for).
    #[error("NVRTC could not compile {kernel} for {arch}: {log}")]
    CudaCompile {
        /// The kernel's name.
        kernel: String,
        /// The architecture.
        arch: String,
        /// The log.
        log: String,
    },
    /// The driver's JIT could not load a kernel's PTX; its info and error
    /// logs follow.
    #[error("the CUDA driver could not load {kernel}: {message}\n{log}")]
    CudaJit {
        /// The kernel's name.
        kernel: String,
        /// The message.
        message: String,
        /// The log.
        log: String,
    },
    /// A CUDA driver call failed.
    #[error("{during}: the CUDA driver reported {message}")]
    CudaDriver {
        /// What was running.
        during: &'static str,
        /// The message.
        message: String,
    },
    /// `what` was poisoned by a panic in another thread.
    #[error("{what} was poisoned by a panic in another thread")]
    Poisoned {
        /// What it concerns.
        what: &'static str,
    },
    /// Every kernel family that could run the call failed its known-answer
    /// check on this device (`crate::verify`): rather than wrong numbers,
    /// this error (`Backend` runs the CPU backend instead).
    #[error("every {call} kernel family failed its known-answer check on this device ({tried}); run `flashattn doctor` for the details, or set FLASHATTN_VERIFY=off to run them anyway")]
    VerificationFailed {
        /// The call.
        call: &'static str,
        /// What was tried, and how each ended.
        tried: String,
    },
    /// The autotuner's winner could not be stored.
    #[error("cannot write the tuning cache {}", path.display())]
    TuneCacheWrite {
        /// The path.
        path: std::path::PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
}

/// Shorthand for `Result<T, flashattn::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// A shape as numpy prints it: `(4,)`, `(2, 4)`.
fn tuple(shape: &[usize]) -> String {
    match shape {
        [d] => format!("({d},)"),
        _ => {
            let dims: Vec<String> = shape.iter().map(usize::to_string).collect();
            format!("({})", dims.join(", "))
        }
    }
}

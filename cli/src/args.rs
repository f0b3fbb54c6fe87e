//! Command-line definitions (clap), exactly the flags of docs/semantics.md.

use clap::{Args, Parser, Subcommand};
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "flashattn",
    version,
    about = "FlashAttention — exact, IO-aware attention on any GPU (wgpu) or the CPU"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Attention forward on .npy inputs: writes o (and optionally lse).
    Forward(ForwardArgs),
    /// Attention backward on .npy inputs: recomputes the forward, writes dq, dk, dv.
    Backward(BackwardArgs),
    /// One decoding step against a KV cache (dense or paged) on .npy inputs:
    /// appends k_new/v_new, writes o (and lse, and the updated caches).
    Decode(DecodeArgs),
    /// Show the adapter, its limits and the tile plan with the reason for each
    /// clamp, and the tuned plan where `flashattn tune` cached one.
    Plan(PlanArgs),
    /// Time the planner's candidate plans on this adapter and cache the
    /// fastest for forward/backward calls to use.
    Tune(TuneArgs),
    /// Benchmark flash vs naive WGSL vs CPU side by side: table, JSON, CSV,
    /// plots; with --decode, decoding against KV caches next to the copy bandwidth.
    Bench(BenchArgs),
    /// Run a forward at a realistic shape on the best adapter and check it against the f64 reference.
    Demo(DemoArgs),
    /// Check every kernel family this device offers: the adapter, driver,
    /// limits and features, then forward, backward and decode in f32, f16
    /// and bf16 over every layout, each result against the accuracy rule's
    /// bound. Exits non-zero if anything fails; attach its output (or
    /// --json) to a bug report.
    Doctor(DoctorArgs),
}

/// Score, mask, precision and backend flags shared by forward, backward and decode.
#[derive(Args, Debug, Clone)]
pub struct ScoreArgs {
    /// Bottom-right aligned causal mask.
    #[arg(long)]
    pub causal: bool,
    /// Local window LEFT,RIGHT; -1 is unbounded (e.g. --window=-1,10).
    #[arg(long, value_name = "L,R", allow_hyphen_values = true)]
    pub window: Option<String>,
    /// Soft-cap C: scores become C·tanh(s/C).
    #[arg(long, allow_hyphen_values = true)]
    pub softcap: Option<f32>,
    /// Score scale (default 1/sqrt(head_dim)).
    #[arg(long, allow_hyphen_values = true)]
    pub scale: Option<f32>,
    /// ALiBi slopes, f32, (heads_q,) or (batch, heads_q): s -= slope·|i + off - j|.
    #[arg(long, value_name = "SLOPES.npy")]
    pub alibi: Option<PathBuf>,
    /// Attention sinks: one f32 logit per query head, (heads_q,).
    #[arg(long, value_name = "SINKS.npy")]
    pub sinks: Option<PathBuf>,
    /// Block-sparse mask, bool or uint8, (mb, mh, ceil(seqlen_q/BM),
    /// ceil(seqlen_k/BN)) with mb 1 or batch and mh 1 or heads_q.
    #[arg(long, value_name = "M.npy")]
    pub block_mask: Option<PathBuf>,
    /// The block mask's block size BM,BN (any values >= 1).
    #[arg(long, value_name = "BM,BN")]
    pub block_size: Option<String>,
    /// A packed batch: prefix sums of the sequences' query rows, int32
    /// (batch + 1,); q, k, v are then (total, heads, head_dim).
    #[arg(long, value_name = "CQ.npy")]
    pub cu_seqlens_q: Option<PathBuf>,
    /// Prefix sums of the sequences' key rows, int32 (batch + 1,).
    #[arg(long, value_name = "CK.npy")]
    pub cu_seqlens_k: Option<PathBuf>,
    /// Storage precision: f32, f16 or bf16 (default: the inputs' dtype; bf16
    /// rounds the inputs on load and writes its outputs as f32), or fp8
    /// (e4m3 with per-(batch, head) scales; forward only, o written as f32).
    #[arg(long)]
    pub precision: Option<String>,
    /// With --precision fp8: multiply q and k by a seeded random orthogonal
    /// (Walsh–Hadamard) matrix before quantizing them (incoherent processing).
    #[arg(long)]
    pub hadamard: bool,
    /// auto, wgpu, cpu or cuda.
    #[arg(long, default_value = "auto")]
    pub backend: String,
}

/// Options shared by forward and backward.
#[derive(Args, Debug, Clone)]
pub struct AttentionArgs {
    /// Queries, (batch, seqlen_q, heads_q, head_dim) (packed: (total_q,
    /// heads_q, head_dim)), f32 or f16.
    #[arg(long)]
    pub q: PathBuf,
    /// Keys, (batch, seqlen_k, heads_kv, head_dim) (packed: (total_k, heads_kv, head_dim)).
    #[arg(long)]
    pub k: PathBuf,
    /// Values, shape of k but their own head dim.
    #[arg(long)]
    pub v: PathBuf,
    #[command(flatten)]
    pub score: ScoreArgs,
    /// Dropout probability P in [0, 1) of the attention probabilities (kept
    /// ones scaled by 1/(1-P)); P > 0 needs --seed. Every backend draws the
    /// same mask (docs/dropout.md).
    #[arg(long, value_name = "P", allow_hyphen_values = true)]
    pub dropout: Option<f32>,
    /// The seed of dropout's generator (Philox4x32-10).
    #[arg(long, value_name = "S")]
    pub seed: Option<u64>,
    /// The first (batch, head) stream of dropout's generator (default 0;
    /// docs/dropout.md).
    #[arg(long, value_name = "O")]
    pub dropout_offset: Option<u64>,
    /// Override the planner's Br (query rows per workgroup; wgpu only).
    #[arg(long, value_name = "BR")]
    pub block_q: Option<u32>,
    /// Override the planner's Bc (keys per block; wgpu only).
    #[arg(long, value_name = "BC")]
    pub block_k: Option<u32>,
    /// Force the kernels on wgpu: `tiled` (workgroup-memory tiles),
    /// `registers` (register micro-tiles, GPUs' default), `lanes` (one row
    /// per subgroup lane, CPU adapters) or `coop` (cooperative matrices,
    /// where the device has them); with --backend cuda, the kernel path:
    /// `auto`, `scalar`, `mma` (sm80 tensor cores), `hopper` (wgmma + TMA)
    /// or `no-hopper` (auto without the Hopper forward).
    #[arg(long, value_name = "KERNEL")]
    pub kernel: Option<String>,
    /// With --backend cuda: compile the kernels for this architecture
    /// (e.g. compute_80 on an H100, the sm80 build for comparison); default
    /// the device's own (compute_90a on Hopper).
    #[arg(long, value_name = "ARCH")]
    pub arch: Option<String>,
    /// Run the plan `flashattn tune` cached for this problem where there is
    /// one (wgpu; $FLASHATTN_CACHE_DIR, else $XDG_CACHE_HOME/flashattn, else
    /// ~/.cache/flashattn); the formula plan otherwise.
    #[arg(long, conflicts_with_all = ["block_q", "block_k", "kernel", "rows_per_thread", "subgroup_reduce", "double_buffer"])]
    pub tuned: bool,
    #[command(flatten)]
    pub registers: RegisterArgs,
}

/// The registers kernels' parameters (wgpu only; any of them picks the
/// registers kernels).
#[derive(Args, Debug, Clone, Default)]
pub struct RegisterArgs {
    /// Query rows (backward: rows or keys) each invocation holds (RM).
    #[arg(long, value_name = "RM")]
    pub rows_per_thread: Option<u32>,
    /// Row max and sum by subgroup shuffles (`on`) or workgroup memory (`off`).
    #[arg(long, value_name = "on|off", value_parser = on_off)]
    pub subgroup_reduce: Option<bool>,
    /// Two K/V tile buffers (`on`) or one (`off`).
    #[arg(long, value_name = "on|off", value_parser = on_off)]
    pub double_buffer: Option<bool>,
}

impl RegisterArgs {
    /// Whether any is given.
    pub fn any(&self) -> bool {
        self.rows_per_thread.is_some()
            || self.subgroup_reduce.is_some()
            || self.double_buffer.is_some()
    }
}

fn on_off(s: &str) -> std::result::Result<bool, String> {
    match s {
        "on" => Ok(true),
        "off" => Ok(false),
        other => Err(format!("expected on or off, not {other}")),
    }
}

#[derive(Args, Debug)]
pub struct ForwardArgs {
    #[command(flatten)]
    pub attention: AttentionArgs,
    /// Output o: q's shape with v's head dim, q's dtype.
    #[arg(long)]
    pub out: PathBuf,
    /// Optional output lse, (batch, heads_q, seqlen_q) (packed: (heads_q, total_q)), f32.
    #[arg(long)]
    pub lse: Option<PathBuf>,
    /// Optional output: dropout's mask, bool (batch, heads_q, seqlen_q,
    /// seqlen_k), true where kept (packed: one entry per sequence, at the
    /// longest lengths).
    #[arg(long, value_name = "M.npy")]
    pub dropout_mask_out: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct BackwardArgs {
    #[command(flatten)]
    pub attention: AttentionArgs,
    /// Gradient of the output: o's shape (q's, with v's head dim), q's dtype.
    #[arg(long = "do", value_name = "DO")]
    pub d_o: PathBuf,
    /// Output dq (shape of q).
    #[arg(long)]
    pub dq: PathBuf,
    /// Output dk (shape of k).
    #[arg(long)]
    pub dk: PathBuf,
    /// Output dv (shape of v).
    #[arg(long)]
    pub dv: PathBuf,
    /// Output dsinks, (heads_q,) f32 (with --sinks).
    #[arg(long)]
    pub dsinks: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct DecodeArgs {
    /// Queries, (batch, seqlen_q, heads_q, head_dim), f32 or f16.
    #[arg(long)]
    pub q: PathBuf,
    /// K cache: dense (batch_cache, capacity, heads_kv, head_dim), or paged
    /// (pages, page_size, heads_kv, head_dim) with --block-table.
    #[arg(long)]
    pub k_cache: PathBuf,
    /// V cache, shape of the K cache (but for its head dim); none with
    /// --latent-v.
    #[arg(
        long,
        required_unless_present = "latent_v",
        conflicts_with = "latent_v"
    )]
    pub v_cache: Option<PathBuf>,
    /// The K cache is a latent cache (DeepSeek's MLA, docs/decoding.md):
    /// V is the first V_WIDTH columns of each of its head rows, read in
    /// place. No --v-cache, --v-new or --v-cache-out: --k-new alone appends.
    /// With --cache-precision, V reads K's codes at K's block scales
    /// (--k-scales, --k-scales-out alone).
    #[arg(long, value_name = "V_WIDTH", conflicts_with_all = ["v_new", "v_cache_out", "v_scales", "v_scales_out"])]
    pub latent_v: Option<usize>,
    /// (batch,) int32: tokens already in each sequence's cache.
    #[arg(long)]
    pub cache_seqlens: PathBuf,
    /// (batch, max_pages) int32: token t of sequence b lives in page
    /// block_table[b, t / page_size]; makes the cache paged.
    #[arg(long)]
    pub block_table: Option<PathBuf>,
    /// (batch,) int32: each sequence's row of a dense cache (default: row b).
    #[arg(long)]
    pub cache_batch_idx: Option<PathBuf>,
    /// New keys (batch, seqlen_new, heads_kv, head_dim), written into the
    /// cache after each sequence's cache_seqlens tokens and attended to (with --v-new).
    #[arg(long)]
    pub k_new: Option<PathBuf>,
    /// New values, shape of --k-new.
    #[arg(long)]
    pub v_new: Option<PathBuf>,
    /// Split each sequence's keys across this many workgroups (FlashDecoding);
    /// 0 lets the planner choose.
    #[arg(long, default_value_t = 0, allow_negative_numbers = true)]
    pub num_splits: usize,
    #[command(flatten)]
    pub score: ScoreArgs,
    /// Output o, shape of q, dtype of q.
    #[arg(long)]
    pub out: PathBuf,
    /// Optional output lse, (batch, heads_q, seqlen_q) (packed: (heads_q, total_q)), f32.
    #[arg(long)]
    pub lse: Option<PathBuf>,
    /// Write the K cache after the append (with --v-cache-out).
    #[arg(long)]
    pub k_cache_out: Option<PathBuf>,
    /// Write the V cache after the append (with --k-cache-out).
    #[arg(long)]
    pub v_cache_out: Option<PathBuf>,
    /// A quantized cache (docs/kv-quantization.md): int8 or fp8. Float
    /// caches are quantized on load; int8 (int8 codes) or uint8 (fp8's
    /// e4m3 bytes) caches are read as codes with --k-scales/--v-scales.
    /// Every backend (cpu, wgpu, cuda) decodes them.
    #[arg(long, value_name = "int8|fp8")]
    pub cache_precision: Option<String>,
    /// The K cache's block scales, (blocks, heads_kv) float32: one per page,
    /// or per 16 tokens of a dense cache's row (with code caches).
    #[arg(long, requires = "cache_precision")]
    pub k_scales: Option<PathBuf>,
    /// The V cache's block scales (with --k-scales).
    #[arg(long, requires = "cache_precision")]
    pub v_scales: Option<PathBuf>,
    /// Write the K cache's scales after the append (a quantized cache with
    /// --k-cache-out).
    #[arg(long, requires = "cache_precision")]
    pub k_scales_out: Option<PathBuf>,
    /// Write the V cache's scales after the append.
    #[arg(long, requires = "cache_precision")]
    pub v_scales_out: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// wgpu (the adapter's plans) or cuda (the CUDA kernels: tiles, warps,
    /// stages, shared memory; feature `cuda`).
    #[arg(long, default_value = "wgpu")]
    pub backend: String,
    /// With --backend cuda: plan for made-up properties (a100, h100 or
    /// h200) instead of device 0's.
    #[arg(long, value_name = "DEVICE")]
    pub device_like: Option<String>,
    /// With --backend cuda: plan for kernels compiled for this
    /// architecture (e.g. compute_80 on an H100).
    #[arg(long, value_name = "ARCH")]
    pub arch: Option<String>,
    /// Head dimension to plan for (default: 32, 64, 128 and 256; required
    /// with --decode).
    #[arg(long, required_if_eq("decode", "true"))]
    pub head_dim: Option<usize>,
    /// Storage precision: f32, f16 or bf16, or fp8 (the FP8 forward's plan:
    /// f32 tiles over e4m3 storage).
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// Cap the workgroup storage M in bytes (below the device's limit).
    #[arg(long)]
    pub max_workgroup_storage: Option<u32>,
    /// Plan these kernels: tiled, registers, lanes or coop (wgpu); with
    /// --backend cuda, the kernel path: auto (default), scalar, mma (sm80),
    /// hopper or no-hopper (auto without the Hopper forward).
    #[arg(long, value_name = "KERNEL")]
    pub kernel: Option<String>,
    #[command(flatten)]
    pub registers: RegisterArgs,
    /// Show the decode plan (FlashDecoding's splits of a KV cache's keys)
    /// for --batch, --heads-q, --heads-kv, --head-dim and --cache-len.
    #[arg(long)]
    pub decode: bool,
    /// Sequences decoded at once (with --decode).
    #[arg(long, requires = "decode", default_value_t = 1)]
    pub batch: usize,
    /// Query heads (with --decode).
    #[arg(long, requires = "decode", required_if_eq("decode", "true"))]
    pub heads_q: Option<usize>,
    /// Key/value heads, dividing --heads-q (with --decode).
    #[arg(long, requires = "decode", required_if_eq("decode", "true"))]
    pub heads_kv: Option<usize>,
    /// Keys each sequence attends to (with --decode).
    #[arg(long, requires = "decode", required_if_eq("decode", "true"))]
    pub cache_len: Option<usize>,
    /// Query tokens per sequence (with --decode; speculative decoding verifies several).
    #[arg(long, requires = "decode", default_value_t = 1)]
    pub seqlen_q: usize,
    /// Splits asked for; 0 lets the planner choose (with --decode).
    #[arg(long, requires = "decode", default_value_t = 0)]
    pub num_splits: usize,
    /// Plan for this sequence length (seqlen_q = seqlen_k) and show its
    /// tuned plan (default: unbounded, and every length `flashattn tune` cached).
    #[arg(long, conflicts_with = "decode")]
    pub seqlen: Option<usize>,
    /// Show the tuned plan of the causal mask.
    #[arg(long, conflicts_with = "decode")]
    pub causal: bool,
    /// Where `flashattn tune` keeps its winners (default:
    /// $FLASHATTN_CACHE_DIR, else $XDG_CACHE_HOME/flashattn, else ~/.cache/flashattn).
    #[arg(long, conflicts_with = "decode")]
    pub cache_dir: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct TuneArgs {
    /// Sequence lengths (seqlen_q = seqlen_k), comma-separated; each tunes
    /// its power-of-two bucket.
    #[arg(long, visible_alias = "seqlen", default_value = "1024")]
    pub seqlens: String,
    /// Head dimensions, comma-separated.
    #[arg(long, visible_alias = "head-dims", default_value = "64")]
    pub head_dim: String,
    /// Storage precisions, comma-separated: f32, f16, bf16.
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// Bottom-right aligned causal mask.
    #[arg(long)]
    pub causal: bool,
    /// forward, backward or both.
    #[arg(long, default_value = "forward")]
    pub pass: String,
    /// Query (and key/value) heads of the timed problem.
    #[arg(long, default_value_t = 8)]
    pub heads: usize,
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// Timed runs per candidate after one untimed run (the best counts).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// The backend to tune: wgpu (the only one with candidate plans).
    #[arg(long, default_value = "wgpu")]
    pub backend: String,
    /// Where the winners are kept (default: $FLASHATTN_CACHE_DIR, else
    /// $XDG_CACHE_HOME/flashattn, else ~/.cache/flashattn).
    #[arg(long)]
    pub cache_dir: Option<PathBuf>,
    /// Write every candidate's time as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Sequence lengths (seqlen_q = seqlen_k), comma-separated.
    #[arg(
        long,
        default_value = "256,512,1024,2048,4096",
        conflicts_with = "decode"
    )]
    pub seqlens: String,
    /// Head dimensions, comma-separated.
    #[arg(long, default_value = "64", conflicts_with = "decode")]
    pub head_dims: String,
    /// Implementations: flash (the planner's kernels: lanes on CPU adapters
    /// with subgroups, registers on GPUs), tiled, registers or coop (those
    /// kernels forced; coop: forward only, where the adapter has cooperative
    /// matrices), naive, cpu, the outside baselines numpy (naive float32
    /// attention) and torch (SDPA on the CPU), run by cli/src/baselines.py
    /// under --python, and in a build with the `cuda` feature cuda (the
    /// CUDA backend's chosen kernels), cuda-scalar, cuda-mma (sm80) or
    /// cuda-hopper (those kernels forced).
    #[arg(long, default_value = "flash,naive,cpu", conflicts_with = "decode")]
    pub impls: String,
    /// The Python interpreter for the numpy and torch baselines (e.g. a venv's).
    #[arg(long, env = "FLASHATTN_PYTHON", default_value = "python3")]
    pub python: String,
    /// Passes: forward, backward.
    #[arg(long, default_value = "forward,backward", conflicts_with = "decode")]
    pub passes: String,
    /// Causal: no, yes or both.
    #[arg(long, default_value = "no", conflicts_with = "decode")]
    pub causal: String,
    /// Dropout probabilities, comma-separated: each case runs at each, where
    /// its implementation has dropout (the wgpu kernels, flash and naive,
    /// the CPU backend, the CUDA scalar and sm80 kernels), and the cost of
    /// dropout is reported against 0 measured in the same run.
    #[arg(long, default_value = "0", conflicts_with = "decode")]
    pub dropouts: String,
    #[arg(long, default_value_t = 1, conflicts_with = "decode")]
    pub heads: usize,
    #[arg(long, default_value_t = 1, conflicts_with = "decode")]
    pub batch: usize,
    /// f32, f16 or bf16.
    #[arg(long, default_value = "f32", conflicts_with = "decode")]
    pub precision: String,
    /// Timed repeats per case (after one untimed warm-up).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Sweep the workgroup storage M (Theorem 2) at --sweep-seqlen.
    #[arg(long, conflicts_with = "decode")]
    pub sweep_m: bool,
    #[arg(long, default_value_t = 1024, conflicts_with = "decode")]
    pub sweep_seqlen: usize,
    /// The block-sparse density sweep instead: forward and backward at each
    /// of --densities and dense, N --sparse-seqlen, blocks --sparse-block,
    /// the first --head-dims, against density × the dense time.
    #[arg(long, conflicts_with_all = ["decode", "varlen"])]
    pub sparse: bool,
    #[arg(long, default_value_t = 4096, requires = "sparse")]
    pub sparse_seqlen: usize,
    /// Densities (fractions of blocks allowed), comma-separated.
    #[arg(long, default_value = "0.1,0.25,0.5", requires = "sparse")]
    pub densities: String,
    /// The masks' block size BM,BN.
    #[arg(
        long,
        default_value = "64,64",
        value_name = "BM,BN",
        requires = "sparse"
    )]
    pub sparse_block: String,
    /// A packed batch (varlen) against its sequences one by one instead,
    /// forward and backward, the first --head-dims.
    #[arg(long, conflicts_with = "decode")]
    pub varlen: bool,
    /// The packed batch's sequence lengths, comma-separated.
    #[arg(
        long,
        default_value = "64,128,256,512,1024,2048,3072,4096",
        requires = "varlen"
    )]
    pub varlen_lens: String,
    /// Write every measurement as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the results table as CSV.
    #[arg(long)]
    pub csv: Option<PathBuf>,
    /// Draw FILE-time, FILE-memory and (with --sweep-m) FILE-accesses next
    /// to FILE (.svg or .png); with --sparse, FILE is the density chart.
    #[arg(long, conflicts_with = "decode")]
    pub plot: Option<PathBuf>,
    #[command(flatten)]
    pub decode: DecodeBenchArgs,
}

/// `bench --decode`: decoding steps against KV caches, wgpu and CPU, planner
/// splits and one split, next to the copy bandwidth.
#[derive(Args, Debug)]
pub struct DecodeBenchArgs {
    /// Benchmark decoding against KV caches instead of the forward and backward.
    #[arg(long = "decode", id = "decode")]
    pub on: bool,
    /// A tiny set for smoke tests: caches 128,512, batches 1,2, heads 4/2,
    /// head_dim 32, a 4 MiB copy (flags given explicitly still apply).
    #[arg(long, requires = "decode")]
    pub quick: bool,
    /// DeepSeek's MLA shape: a latent cache of width 576 whose first 512
    /// columns are V, 128 query heads on one kv head (--heads-q, --heads-kv
    /// and --head-dim given still apply).
    #[arg(long, requires = "decode")]
    pub mla: bool,
    /// Keys per sequence, comma-separated [default: 1024,8192,32768].
    #[arg(long, requires = "decode")]
    pub cache_lens: Option<String>,
    /// Batch sizes, comma-separated [default: 1,8].
    #[arg(long, requires = "decode")]
    pub batches: Option<String>,
    /// Query heads [default: 32].
    #[arg(long, requires = "decode")]
    pub heads_q: Option<usize>,
    /// Key/value heads [default: 8].
    #[arg(long, requires = "decode")]
    pub heads_kv: Option<usize>,
    /// Head dimension [default: 128].
    #[arg(long, requires = "decode")]
    pub head_dim: Option<usize>,
    /// Cache dtypes, comma-separated: f32, f16, bf16, and int8 or fp8
    /// (quantized caches of f16 steps) [default: f16,f32,int8,fp8].
    #[arg(long, requires = "decode")]
    pub dtypes: Option<String>,
    /// Backends, comma-separated: wgpu, cpu, cuda (device 0, with the `cuda`
    /// feature; its rows held against the device's own copy bandwidth), and
    /// torch (the outside baseline: SDPA with enable_gqa on the CPU, run by
    /// cli/src/baselines.py under --python).
    #[arg(long, requires = "decode", default_value = "wgpu,cpu")]
    pub backends: String,
    /// Split modes each backend runs, comma-separated: planner (num_splits
    /// 0) or a number of splits.
    #[arg(long, requires = "decode", default_value = "planner,1")]
    pub splits: String,
    /// Skip (batch, cache length) pairs holding more tokens than this in
    /// all (e.g. 65536 skips batch 8 × 32k, the largest caches); 0 runs every pair.
    #[arg(long, requires = "decode", default_value_t = 0)]
    pub max_tokens: usize,
    /// MiB the copy-bandwidth measurement copies (within one storage
    /// binding; on CUDA at least the largest cache) [default: 64].
    #[arg(long, requires = "decode")]
    pub copy_mib: Option<u64>,
}

#[derive(Args, Debug)]
pub struct DemoArgs {
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    #[arg(long, default_value_t = 1024)]
    pub seqlen: usize,
    #[arg(long, default_value_t = 8)]
    pub heads: usize,
    #[arg(long, default_value_t = 64)]
    pub head_dim: usize,
    #[arg(long)]
    pub causal: bool,
    /// f32, f16 or bf16.
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// auto, wgpu, cpu or cuda (a build with the `cuda` feature).
    #[arg(long, default_value = "auto")]
    pub backend: String,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

#[derive(Args, Debug)]
pub struct DoctorArgs {
    /// The same report as JSON on stdout (the table is not printed).
    #[arg(long)]
    pub json: bool,
    /// wgpu (the best adapter's kernel families) or cuda (the CUDA kernel
    /// paths of device 0; builds with the `cuda` feature).
    #[arg(long, default_value = "wgpu")]
    pub backend: String,
    /// Only the rows of this call: forward, backward or decode.
    #[arg(long, value_name = "CALL")]
    pub call: Option<String>,
}

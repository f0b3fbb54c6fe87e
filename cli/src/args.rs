//! Command-line definitions (clap), exactly the flags of SPEC.md.

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
    /// Show the adapter, its limits and the tile plan with the reason for each clamp.
    Plan(PlanArgs),
    /// Benchmark flash vs naive WGSL vs CPU side by side: table, JSON, CSV, plots.
    Bench(BenchArgs),
    /// Run a forward at a realistic shape on the best adapter and check it against the f64 reference.
    Demo(DemoArgs),
}

/// Options shared by every attention command.
#[derive(Args, Debug, Clone)]
pub struct AttentionArgs {
    /// Queries, (batch, seqlen_q, heads_q, head_dim), f32 or f16.
    #[arg(long)]
    pub q: PathBuf,
    /// Keys, (batch, seqlen_k, heads_kv, head_dim).
    #[arg(long)]
    pub k: PathBuf,
    /// Values, shape of k.
    #[arg(long)]
    pub v: PathBuf,
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
    /// Storage precision: f32 or f16 (default: the inputs' dtype).
    #[arg(long)]
    pub precision: Option<String>,
    /// auto, wgpu, cpu or cuda.
    #[arg(long, default_value = "auto")]
    pub backend: String,
    /// Override the planner's Br (query rows per workgroup; wgpu only).
    #[arg(long, value_name = "BR")]
    pub block_q: Option<u32>,
    /// Override the planner's Bc (keys per block; wgpu only).
    #[arg(long, value_name = "BC")]
    pub block_k: Option<u32>,
    /// Force the forward kernel: `tiled` (workgroup-memory tiles, for GPUs)
    /// or `lanes` (one row per subgroup lane, CPU adapters; wgpu only).
    #[arg(long, value_name = "KERNEL")]
    pub kernel: Option<String>,
}

#[derive(Args, Debug)]
pub struct ForwardArgs {
    #[command(flatten)]
    pub attention: AttentionArgs,
    /// Output o, same shape and dtype as q.
    #[arg(long)]
    pub out: PathBuf,
    /// Optional output lse, (batch, heads_q, seqlen_q), f32.
    #[arg(long)]
    pub lse: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct BackwardArgs {
    #[command(flatten)]
    pub attention: AttentionArgs,
    /// Gradient of the output, shape and dtype of q.
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
}

#[derive(Args, Debug)]
pub struct PlanArgs {
    /// Head dimension to plan for (default: 32, 64, 128 and 256).
    #[arg(long)]
    pub head_dim: Option<usize>,
    /// Storage precision: f32 or f16.
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// Cap the workgroup storage M in bytes (below the device's limit).
    #[arg(long)]
    pub max_workgroup_storage: Option<u32>,
}

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Sequence lengths (seqlen_q = seqlen_k), comma-separated.
    #[arg(long, default_value = "256,512,1024,2048,4096")]
    pub seqlens: String,
    /// Head dimensions, comma-separated.
    #[arg(long, default_value = "64")]
    pub head_dims: String,
    /// Implementations: flash, naive, cpu.
    #[arg(long, default_value = "flash,naive,cpu")]
    pub impls: String,
    /// Passes: forward, backward.
    #[arg(long, default_value = "forward,backward")]
    pub passes: String,
    /// Causal: no, yes or both.
    #[arg(long, default_value = "no")]
    pub causal: String,
    #[arg(long, default_value_t = 1)]
    pub heads: usize,
    #[arg(long, default_value_t = 1)]
    pub batch: usize,
    /// f32 or f16.
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// Timed repeats per case (after one untimed warm-up).
    #[arg(long, default_value_t = 3)]
    pub repeats: usize,
    /// Sweep the workgroup storage M (Theorem 2) at --sweep-seqlen.
    #[arg(long)]
    pub sweep_m: bool,
    #[arg(long, default_value_t = 1024)]
    pub sweep_seqlen: usize,
    /// Write every measurement as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    /// Write the results table as CSV.
    #[arg(long)]
    pub csv: Option<PathBuf>,
    /// Draw FILE-time, FILE-memory and FILE-accesses next to FILE (.svg or .png).
    #[arg(long)]
    pub plot: Option<PathBuf>,
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
    /// f32 or f16.
    #[arg(long, default_value = "f32")]
    pub precision: String,
    /// auto, wgpu or cpu.
    #[arg(long, default_value = "auto")]
    pub backend: String,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

//! Benchmark cases shared by `flashattn bench` and the criterion benches: one
//! case list, every case knows its FLOPs, and flash (the planner's kernels),
//! tiled (the tiled kernels forced), naive and CPU run side by side in one
//! process so results are ratios measured under the same load; numpy and
//! torch run in the same run through `cli/src/baselines.py` ([`crate::baselines`]).

use crate::error::{CliError, Result};
use flashattn::random::Rng;
use flashattn::{
    cpu, Accesses, AttentionOptions, AttentionShape, BackwardInputs, CallStats, Engine,
    ForwardInputs, KernelFamily, PlanOverrides, Precision, TensorData, TensorView,
};
use serde::Serialize;

/// Forward or backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pass {
    Forward,
    Backward,
}

/// Which implementation runs the case.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Implementation {
    /// The WGSL kernels the planner picks (lanes kernels on CPU adapters
    /// with fixed-size subgroups, else tiled).
    Flash,
    /// The tiled WGSL kernels, forced (the GPU path, on any adapter).
    Tiled,
    /// The register-tiled WGSL kernels, forced (GPUs' default).
    Registers,
    /// The cooperative-matrix WGSL forward, forced (where the adapter has
    /// cooperative matrices; forward only).
    Coop,
    /// The WGSL baseline with S and P in storage (tiled matmuls).
    Naive,
    /// The CPU backend.
    Cpu,
    /// numpy's naive float32 attention (outside baseline, `cli/src/baselines.py`).
    Numpy,
    /// torch's scaled_dot_product_attention on the CPU, or the GPU with
    /// FLASHATTN_TORCH_DEVICE=cuda (outside baseline).
    Torch,
    /// The CUDA backend's chosen kernels (tensor cores for f16/bf16 on
    /// CC 8.0+; feature `cuda`).
    Cuda,
    /// The CUDA backend's scalar kernels, forced.
    #[serde(rename = "cuda-scalar")]
    CudaScalar,
    /// The CUDA backend's sm80 tensor-core kernels, forced (on Hopper: the
    /// Hopper forward off, for comparison).
    #[serde(rename = "cuda-mma")]
    CudaMma,
    /// The CUDA backend's Hopper forward, forced (compute capability 9.x).
    #[serde(rename = "cuda-hopper")]
    CudaHopper,
}

impl Pass {
    pub fn name(self) -> &'static str {
        match self {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
        }
    }
}

impl Implementation {
    pub fn name(self) -> &'static str {
        match self {
            Implementation::Flash => "flash",
            Implementation::Tiled => "tiled",
            Implementation::Registers => "registers",
            Implementation::Coop => "coop",
            Implementation::Naive => "naive",
            Implementation::Cpu => "cpu",
            Implementation::Numpy => "numpy",
            Implementation::Torch => "torch",
            Implementation::Cuda => "cuda",
            Implementation::CudaScalar => "cuda-scalar",
            Implementation::CudaMma => "cuda-mma",
            Implementation::CudaHopper => "cuda-hopper",
        }
    }

    /// Whether it runs on the wgpu adapter.
    pub fn on_gpu(self) -> bool {
        matches!(
            self,
            Implementation::Flash
                | Implementation::Tiled
                | Implementation::Registers
                | Implementation::Coop
                | Implementation::Naive
        )
    }

    /// Whether it runs outside this process (the baselines script).
    pub fn outside(self) -> bool {
        matches!(self, Implementation::Numpy | Implementation::Torch)
    }

    /// Whether it draws a dropout mask (docs/dropout.md): the wgpu kernels
    /// (flash and naive), the CPU backend and the CUDA scalar and sm80
    /// kernels (not the outside baselines).
    pub fn takes_dropout(self) -> bool {
        self.on_gpu()
            || matches!(
                self,
                Implementation::Cpu
                    | Implementation::Cuda
                    | Implementation::CudaScalar
                    | Implementation::CudaMma
            )
    }
}

impl std::str::FromStr for Pass {
    type Err = CliError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "forward" | "fwd" => Ok(Pass::Forward),
            "backward" | "bwd" => Ok(Pass::Backward),
            other => Err(CliError::BadFlag {
                flag: "--passes",
                expected: "forward or backward",
                value: other.to_string(),
            }),
        }
    }
}

impl std::str::FromStr for Implementation {
    type Err = CliError;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "flash" => Ok(Implementation::Flash),
            "tiled" => Ok(Implementation::Tiled),
            "registers" => Ok(Implementation::Registers),
            "coop" => Ok(Implementation::Coop),
            "naive" => Ok(Implementation::Naive),
            "cpu" => Ok(Implementation::Cpu),
            "numpy" => Ok(Implementation::Numpy),
            "torch" => Ok(Implementation::Torch),
            "cuda" => Ok(Implementation::Cuda),
            "cuda-scalar" => Ok(Implementation::CudaScalar),
            "cuda-mma" => Ok(Implementation::CudaMma),
            "cuda-hopper" => Ok(Implementation::CudaHopper),
            other => Err(CliError::BadFlag {
                flag: "--impls",
                expected: "flash, tiled, registers, coop, naive, cpu, numpy, torch, cuda, \
                           cuda-scalar, cuda-mma or cuda-hopper",
                value: other.to_string(),
            }),
        }
    }
}

/// One benchmark case.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct BenchCase {
    pub pass: Pass,
    pub implementation: Implementation,
    pub batch: usize,
    pub heads: usize,
    pub seqlen: usize,
    pub head_dim: usize,
    pub causal: bool,
    #[serde(serialize_with = "precision_name")]
    pub precision: Precision,
    /// Dropout's probability (0: none), drawn with [`DROPOUT_SEED`].
    pub dropout: f32,
}

/// The seed of the benchmarks' dropout masks.
pub const DROPOUT_SEED: u64 = 0xd80;

fn precision_name<S: serde::Serializer>(
    p: &Precision,
    s: S,
) -> std::result::Result<S::Ok, S::Error> {
    s.serialize_str(p.name())
}

impl BenchCase {
    /// A few words naming the case (progress lines).
    pub fn label(&self) -> String {
        format!(
            "{} {} N {} d {}{}{}",
            self.pass.name(),
            self.implementation.name(),
            self.seqlen,
            self.head_dim,
            if self.causal { " causal" } else { "" },
            if self.dropout > 0.0 {
                format!(" dropout {}", self.dropout)
            } else {
                String::new()
            }
        )
    }

    pub fn shape(&self) -> flashattn::Result<AttentionShape> {
        AttentionShape::new(
            self.batch,
            self.seqlen,
            self.seqlen,
            self.heads,
            self.heads,
            self.head_dim,
        )
    }

    pub fn options(&self) -> AttentionOptions {
        let opts = AttentionOptions::default().causal(self.causal);
        if self.dropout > 0.0 {
            return opts.dropout(self.dropout).dropout_seed(DROPOUT_SEED);
        }
        opts
    }

    /// `4·Sq·Sk·d·heads·batch`, halved for causal; the backward does 2.5 times
    /// the forward's matmul work (five N×N×d products instead of two), the
    /// convention of flash-attention's benchmarks.
    pub fn flops(&self) -> f64 {
        let fwd = 4.0
            * (self.seqlen * self.seqlen * self.head_dim * self.heads * self.batch) as f64
            / if self.causal { 2.0 } else { 1.0 };
        match self.pass {
            Pass::Forward => fwd,
            Pass::Backward => 2.5 * fwd,
        }
    }

    /// Storage bytes the naive implementation needs (inputs, outputs, and the
    /// N×N buffers it materializes), whether or not the device allows them.
    pub fn naive_bytes(&self) -> u64 {
        let e = self.precision.bytes() as u64;
        let nd = (self.batch * self.heads * self.seqlen * self.head_dim) as u64;
        let rows = (self.batch * self.heads * self.seqlen) as u64;
        let nn = rows * self.seqlen as u64 * 4;
        match self.pass {
            Pass::Forward => 4 * nd * e + rows * 4 + 2 * nn,
            Pass::Backward => 7 * nd * e + rows * 4 + 3 * nn,
        }
    }
}

/// What one case measured. Failures (a naive run over the binding limit, say)
/// are results too: `error` says why.
#[derive(Clone, Debug, Serialize)]
pub struct BenchResult {
    #[serde(flatten)]
    pub case: BenchCase,
    /// Seconds of each timed repeat (kernel time on the GPU, wall time on the CPU).
    pub seconds: Vec<f64>,
    pub flops: f64,
    /// Bytes of storage buffers the call allocated (all alive at once).
    pub peak_bytes: u64,
    /// Storage-buffer elements read and written by the kernels (analytic).
    pub reads: u64,
    pub writes: u64,
    pub error: Option<String>,
    /// What ran, where it is not this build (the outside baselines' versions).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub note: Option<String>,
}

impl BenchResult {
    /// No measurement yet.
    pub fn new(case: &BenchCase) -> Self {
        Self {
            case: *case,
            seconds: Vec::new(),
            flops: case.flops(),
            peak_bytes: 0,
            reads: 0,
            writes: 0,
            error: None,
            note: None,
        }
    }

    pub fn min_seconds(&self) -> Option<f64> {
        self.seconds.iter().cloned().reduce(f64::min)
    }

    pub fn median_seconds(&self) -> Option<f64> {
        let mut s = self.seconds.clone();
        s.sort_by(|a, b| a.total_cmp(b));
        s.get(s.len() / 2).copied()
    }

    /// GFLOP/s of the fastest repeat.
    pub fn gflops(&self) -> Option<f64> {
        self.min_seconds().map(|t| self.flops / t / 1e9)
    }

    pub fn accesses(&self) -> Accesses {
        Accesses {
            reads: self.reads,
            writes: self.writes,
        }
    }
}

/// `n` seeded N(0, 1) values in `precision`, in chunks of 2^20 over the
/// cores (each chunk its own stream): a 16k-token case's inputs in a
/// fraction of a second.
fn normal_data(seed: u64, n: usize, precision: Precision) -> TensorData {
    use rayon::prelude::*;
    let mut values = vec![0f32; n];
    values
        .par_chunks_mut(1 << 20)
        .enumerate()
        .for_each(|(i, chunk)| {
            let mut rng = Rng::new(seed ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
            chunk.copy_from_slice(&rng.normal_vec(chunk.len(), 1.0));
        });
    TensorData::from_f32(values, precision)
}

/// That the host can allocate `bytes` for `what` (the sizes come from the
/// flags): reserved and released at once, so that a problem no machine
/// holds fails with one line instead of aborting in the allocator.
pub fn host_memory_ok(what: impl FnOnce() -> String, bytes: u64) -> Result<()> {
    let fits = usize::try_from(bytes)
        .ok()
        .is_some_and(|n| Vec::<u8>::new().try_reserve_exact(n).is_ok());
    match fits {
        true => Ok(()),
        false => Err(CliError::HostMemory {
            what: what(),
            bytes,
        }),
    }
}

/// Bytes of one problem's f32 q, k, v and dO (or o) on the host.
pub fn input_bytes(shape: &AttentionShape) -> u64 {
    4 * (2 * shape.q_len() as u64 + 2 * shape.kv_len() as u64)
}

/// Seeded inputs of a case, in its precision.
pub struct BenchInputs {
    pub shape: AttentionShape,
    pub q: TensorData,
    pub k: TensorData,
    pub v: TensorData,
    pub d_o: TensorData,
}

impl BenchInputs {
    /// Seeded by the shape alone: every implementation of a shape (and both
    /// passes) sees the same inputs.
    pub fn new(case: &BenchCase) -> Result<Self> {
        let shape = case.shape()?;
        host_memory_ok(
            || format!("the inputs of {}", case.label()),
            input_bytes(&shape),
        )?;
        let seed = (case.seqlen as u64 * 31 + case.head_dim as u64) * 4;
        let make = |t: u64, n| normal_data(seed + t, n, case.precision);
        Ok(Self {
            q: make(0, shape.q_len()),
            k: make(1, shape.kv_len()),
            v: make(2, shape.kv_len()),
            d_o: make(3, shape.q_len()),
            shape,
        })
    }

    pub fn views(&self) -> [TensorView<'_>; 4] {
        let s = &self.shape;
        [
            TensorView {
                shape: s.q_shape(),
                data: self.q.as_host(),
            },
            TensorView {
                shape: s.kv_shape(),
                data: self.k.as_host(),
            },
            TensorView {
                shape: s.kv_shape(),
                data: self.v.as_host(),
            },
            TensorView {
                shape: s.q_shape(),
                data: self.d_o.as_host(),
            },
        ]
    }
}

/// One timed run: seconds and the call's accounting.
struct Run {
    seconds: f64,
    peak_bytes: u64,
    accesses: Accesses,
}

/// Run `case` once untimed (compiles pipelines) and `repeats` times timed.
pub fn run(engine: Option<&Engine>, case: &BenchCase, repeats: usize) -> BenchResult {
    let mut result = BenchResult::new(case);
    let outcome = (|| -> Result<()> {
        let inputs = BenchInputs::new(case)?;
        let once = prepare(engine, case, &inputs)?;
        for i in 0..=repeats {
            let r = once()?;
            result.peak_bytes = r.peak_bytes;
            result.reads = r.accesses.reads;
            result.writes = r.accesses.writes;
            if i > 0 {
                result.seconds.push(r.seconds);
            }
        }
        Ok(())
    })();
    if let Err(e) = outcome {
        result.error = Some(crate::error::one_line(&e));
    }
    if case.implementation == Implementation::Cpu {
        result.note = Some(format!(
            "cpu {}, {} threads",
            cpu::Cpu::new().isa().name(),
            rayon::current_num_threads()
        ));
    }
    result
}

/// A closure running the case once. For backward cases the forward (o, lse)
/// is computed here, outside the timed closure.
fn prepare<'a>(
    engine: Option<&'a Engine>,
    case: &BenchCase,
    inputs: &'a BenchInputs,
) -> Result<Box<dyn Fn() -> Result<Run> + 'a>> {
    let opts = case.options();
    let [q, k, v, d_o] = inputs.views();
    let gpu = || {
        engine.ok_or(CliError::NeedsGpu {
            what: "the flash and naive benchmarks",
        })
    };
    let from_stats = |s: &CallStats| Run {
        seconds: s.kernel_seconds,
        peak_bytes: s.peak_bytes(),
        accesses: s.accesses,
    };
    let wall = |f: &dyn Fn() -> flashattn::Result<()>| -> Result<Run> {
        let start = std::time::Instant::now();
        f()?;
        Ok(Run {
            seconds: start.elapsed().as_secs_f64(),
            peak_bytes: 0,
            accesses: Accesses::default(),
        })
    };
    // The kernels forced, where the implementation forces them.
    let forced = |kernel| PlanOverrides::default().kernel(kernel);
    let tiled = match case.implementation {
        Implementation::Registers => forced(KernelFamily::Registers),
        Implementation::Coop => forced(KernelFamily::Coop),
        _ => forced(KernelFamily::Tiled),
    };
    Ok(match (case.pass, case.implementation) {
        (Pass::Forward, Implementation::Flash) => {
            let e = gpu()?;
            Box::new(move || {
                Ok(from_stats(
                    &e.forward(&ForwardInputs::new(q, k, v), &opts)?.stats,
                ))
            })
        }
        (
            Pass::Forward,
            Implementation::Tiled | Implementation::Registers | Implementation::Coop,
        ) => {
            let e = gpu()?;
            Box::new(move || {
                Ok(from_stats(
                    &e.forward_with(&ForwardInputs::new(q, k, v), &opts, &tiled)?
                        .stats,
                ))
            })
        }
        (Pass::Forward, Implementation::Naive) => {
            let e = gpu()?;
            Box::new(move || {
                Ok(from_stats(
                    &e.naive_forward(&ForwardInputs::new(q, k, v), &opts)?.stats,
                ))
            })
        }
        (Pass::Forward, Implementation::Cpu) => Box::new(move || {
            wall(&|| cpu::forward(&ForwardInputs::new(q, k, v), &opts).map(|_| ()))
        }),
        (Pass::Backward, Implementation::Flash) => {
            let e = gpu()?;
            let fwd = e.forward(&ForwardInputs::new(q, k, v), &opts)?;
            Box::new(move || {
                let inputs = BackwardInputs::new(ForwardInputs::new(q, k, v), &fwd, d_o)?;
                Ok(from_stats(&e.backward(&inputs, &opts)?.stats))
            })
        }
        (
            Pass::Backward,
            Implementation::Tiled | Implementation::Registers | Implementation::Coop,
        ) => {
            let e = gpu()?;
            let fwd = e.forward_with(&ForwardInputs::new(q, k, v), &opts, &tiled)?;
            Box::new(move || {
                let inputs = BackwardInputs::new(ForwardInputs::new(q, k, v), &fwd, d_o)?;
                Ok(from_stats(&e.backward_with(&inputs, &opts, &tiled)?.stats))
            })
        }
        (Pass::Backward, Implementation::Naive) => {
            let e = gpu()?;
            Box::new(move || {
                Ok(from_stats(
                    &e.naive_backward(&ForwardInputs::new(q, k, v), &d_o, &opts)?
                        .stats,
                ))
            })
        }
        (Pass::Backward, Implementation::Cpu) => {
            let fwd = cpu::forward(&ForwardInputs::new(q, k, v), &opts)?;
            Box::new(move || {
                let inputs = BackwardInputs::new(ForwardInputs::new(q, k, v), &fwd, d_o)?;
                wall(&|| cpu::backward(&inputs, &opts).map(|_| ()))
            })
        }
        (_, Implementation::Numpy | Implementation::Torch) => {
            return Err(CliError::OutsideBaseline {
                implementation: case.implementation.name(),
            })
        }
        (
            pass,
            Implementation::Cuda
            | Implementation::CudaScalar
            | Implementation::CudaMma
            | Implementation::CudaHopper,
        ) => return cuda_case(pass, case.implementation, [q, k, v, d_o], opts),
    })
}

/// The device's backend, opened once for every CUDA case of a run (its
/// module cache then compiles each variant once).
#[cfg(feature = "cuda")]
fn cuda_backend() -> Result<&'static flashattn::cuda::Cuda> {
    static CUDA: std::sync::OnceLock<std::result::Result<flashattn::cuda::Cuda, String>> =
        std::sync::OnceLock::new();
    CUDA.get_or_init(|| flashattn::cuda::Cuda::new().map_err(|e| e.to_string()))
        .as_ref()
        .map_err(|message| CliError::CudaBench {
            message: message.clone(),
        })
}

/// A CUDA case: the backend's own kernel timing (launch to synchronize,
/// no transfers); the backward's forward runs outside the timed closure.
#[cfg(feature = "cuda")]
fn cuda_case<'a>(
    pass: Pass,
    implementation: Implementation,
    [q, k, v, d_o]: [TensorView<'a>; 4],
    opts: AttentionOptions,
) -> Result<Box<dyn Fn() -> Result<Run> + 'a>> {
    use flashattn::cuda::KernelPath;
    let path = match implementation {
        Implementation::CudaScalar => KernelPath::Scalar,
        Implementation::CudaMma => KernelPath::Mma,
        Implementation::CudaHopper => KernelPath::Hopper,
        _ => KernelPath::Auto,
    };
    let base = cuda_backend()?;
    let run = |s: &CallStats| Run {
        seconds: s.kernel_seconds,
        peak_bytes: s.peak_bytes(),
        accesses: s.accesses,
    };
    Ok(match pass {
        Pass::Forward => Box::new(move || {
            Ok(run(&base
                .forward_on(path, &ForwardInputs::new(q, k, v), &opts)?
                .stats))
        }),
        Pass::Backward => {
            let fwd = base.forward_on(path, &ForwardInputs::new(q, k, v), &opts)?;
            Box::new(move || {
                let inputs = BackwardInputs::new(ForwardInputs::new(q, k, v), &fwd, d_o)?;
                Ok(run(&base.backward_on(path, &inputs, &opts)?.stats))
            })
        }
    })
}

#[cfg(not(feature = "cuda"))]
fn cuda_case<'a>(
    _: Pass,
    _: Implementation,
    _: [TensorView<'a>; 4],
    _: AttentionOptions,
) -> Result<Box<dyn Fn() -> Result<Run> + 'a>> {
    Err(flashattn::Error::BackendNotBuilt { backend: "cuda" }.into())
}

/// A case matrix: every combination of the lists, at one batch, head count
/// and precision.
#[derive(Clone, Debug)]
pub struct Matrix {
    pub passes: Vec<Pass>,
    pub implementations: Vec<Implementation>,
    pub seqlens: Vec<usize>,
    pub head_dims: Vec<usize>,
    pub causal: Vec<bool>,
    /// Dropout probabilities (0: none), run by the implementations that
    /// take dropout.
    pub dropouts: Vec<f32>,
    pub heads: usize,
    pub batch: usize,
    pub precision: Precision,
}

impl Matrix {
    /// The cases, pass-major, then head dim, causal, seqlen, implementation,
    /// dropout.
    pub fn cases(&self) -> Vec<BenchCase> {
        let mut out = Vec::new();
        for &pass in &self.passes {
            for &head_dim in &self.head_dims {
                for &causal in &self.causal {
                    for &seqlen in &self.seqlens {
                        for &implementation in &self.implementations {
                            for &dropout in &self.dropouts {
                                if dropout > 0.0 && !implementation.takes_dropout() {
                                    continue;
                                }
                                out.push(BenchCase {
                                    pass,
                                    implementation,
                                    batch: self.batch,
                                    heads: self.heads,
                                    seqlen,
                                    head_dim,
                                    causal,
                                    precision: self.precision,
                                    dropout,
                                });
                            }
                        }
                    }
                }
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Sizes past what the host can map are a typed error, not an abort.
    #[test]
    fn host_memory_past_the_address_space_is_an_error() {
        assert!(host_memory_ok(|| "small".into(), 1 << 20).is_ok());
        for bytes in [1u64 << 60, u64::MAX] {
            let e = host_memory_ok(|| "huge".into(), bytes).unwrap_err();
            assert!(matches!(e, CliError::HostMemory { bytes: b, .. } if b == bytes));
        }
    }

    fn case(pass: Pass, causal: bool) -> BenchCase {
        BenchCase {
            pass,
            implementation: Implementation::Flash,
            batch: 2,
            heads: 3,
            seqlen: 100,
            head_dim: 64,
            causal,
            precision: Precision::F32,
            dropout: 0.0,
        }
    }

    #[test]
    fn flops_follow_the_convention() {
        assert_eq!(
            case(Pass::Forward, false).flops(),
            4.0 * 100.0 * 100.0 * 64.0 * 6.0
        );
        assert_eq!(
            case(Pass::Forward, true).flops(),
            2.0 * 100.0 * 100.0 * 64.0 * 6.0
        );
        assert_eq!(
            case(Pass::Backward, false).flops(),
            2.5 * 4.0 * 100.0 * 100.0 * 64.0 * 6.0
        );
    }

    #[test]
    fn matrix_is_the_product() {
        let m = Matrix {
            passes: vec![Pass::Forward, Pass::Backward],
            implementations: vec![Implementation::Flash, Implementation::Naive],
            seqlens: vec![256, 512],
            head_dims: vec![64],
            causal: vec![false, true],
            dropouts: vec![0.0],
            heads: 1,
            batch: 1,
            precision: Precision::F32,
        }
        .cases();
        assert_eq!(m.len(), 2 * 2 * 2 * 2);
    }

    #[test]
    fn dropout_runs_where_the_implementation_takes_it() {
        let m = Matrix {
            passes: vec![Pass::Forward],
            implementations: vec![
                Implementation::Flash,
                Implementation::Naive,
                Implementation::Cpu,
                Implementation::Cuda,
                Implementation::Torch,
            ],
            seqlens: vec![256],
            head_dims: vec![64],
            causal: vec![false],
            dropouts: vec![0.0, 0.1],
            heads: 1,
            batch: 1,
            precision: Precision::F32,
        }
        .cases();
        let with: Vec<_> = m.iter().filter(|c| c.dropout > 0.0).collect();
        assert_eq!(m.len(), 9);
        let takers: Vec<_> = with.iter().map(|c| c.implementation).collect();
        assert_eq!(
            takers,
            [
                Implementation::Flash,
                Implementation::Naive,
                Implementation::Cpu,
                Implementation::Cuda
            ]
        );
        assert!(with[0].options().dropout.is_active());
    }
}

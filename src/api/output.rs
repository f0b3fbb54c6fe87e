//! What every backend returns: outputs in the inputs' precision, and what the
//! call did (plan, memory, dispatches, time, storage accesses).

use super::shape::AttentionShape;
use super::tensor::{Tensor, TensorData};
use super::kernel_plan::Plan;
use super::verdict::Verification;

/// The result of a forward pass.
#[derive(Clone, Debug)]
pub struct ForwardOutput {
    /// `(batch, seqlen_q, heads_q, head_dim_v)` (packed: `(total_q,
    /// heads_q, head_dim_v)`), in the inputs' precision.
    pub o: Tensor,
    /// `(batch, heads_q, seqlen_q)` (packed: `(heads_q, total_q)`), f32,
    /// natural log; `-inf` for rows with no allowed key (the sink's logit
    /// with sinks).
    pub lse: Vec<f32>,
    /// The problem's shape.
    pub shape: AttentionShape,
    /// What the call did on the device (empty on the CPU backend).
    pub stats: CallStats,
}

impl ForwardOutput {
    /// The output of a forward over `shape`: `o` in q's layout (with v's
    /// head dim).
    pub fn new(shape: AttentionShape, o: TensorData, lse: Vec<f32>, stats: CallStats) -> Self {
        Self {
            o: Tensor {
                shape: shape.o_shape().to_vec(),
                data: o,
            },
            lse,
            shape,
            stats,
        }
    }

    /// With `packed` (a varlen call), `o` as `(total_q, heads_q,
    /// head_dim_v)`, the layout its batch-of-one view has.
    pub fn packed(mut self, packed: bool) -> Self {
        if packed {
            self.o.shape.remove(0);
        }
        self
    }

    /// The LSE as an owned tensor: `(batch, heads_q, seqlen_q)`, or
    /// `(heads_q, total_q)` for a packed batch.
    pub fn lse_tensor(&self) -> Tensor {
        let mut shape = self.shape.lse_shape().to_vec();
        if self.o.shape.len() == 3 {
            shape.remove(0);
        }
        Tensor {
            shape,
            data: TensorData::F32(self.lse.clone()),
        }
    }
}

/// The result of a backward pass: gradients in the inputs' shapes and precision.
#[derive(Clone, Debug)]
pub struct BackwardOutput {
    /// The gradient of q.
    pub dq: Tensor,
    /// The gradient of k.
    pub dk: Tensor,
    /// The gradient of v.
    pub dv: Tensor,
    /// `(heads_q,)` f32: the sinks' gradients, with sinks.
    pub dsinks: Option<Vec<f32>>,
    /// What the call did on the device (empty on the CPU backend).
    pub stats: CallStats,
}

impl BackwardOutput {
    /// The gradients of a backward over `shape`, in q's, k's and v's layouts.
    pub fn new(
        shape: &AttentionShape,
        dq: TensorData,
        dk: TensorData,
        dv: TensorData,
        stats: CallStats,
    ) -> Self {
        let tensor = |shape: [usize; 4], data| Tensor {
            shape: shape.to_vec(),
            data,
        };
        Self {
            dq: tensor(shape.q_shape(), dq),
            dk: tensor(shape.kv_shape(), dk),
            dv: tensor(shape.v_shape(), dv),
            dsinks: None,
            stats,
        }
    }

    /// With `packed` (a varlen call), the gradients as `(total, heads, dim)`.
    pub fn packed(mut self, packed: bool) -> Self {
        if packed {
            for t in [&mut self.dq, &mut self.dk, &mut self.dv] {
                t.shape.remove(0);
            }
        }
        self
    }

    /// With the sinks' gradient (`None` without sinks).
    pub fn with_dsinks(mut self, dsinks: Option<Vec<f32>>) -> Self {
        self.dsinks = dsinks;
        self
    }
}

/// Elements read from and written to storage buffers ("HBM accesses").
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Accesses {
    /// Elements read.
    pub reads: u64,
    /// Elements written.
    pub writes: u64,
}

impl Accesses {
    /// Reads and writes together.
    pub fn total(&self) -> u64 {
        self.reads + self.writes
    }

    /// `n` times these accesses.
    pub fn times(self, n: u64) -> Self {
        Self {
            reads: self.reads * n,
            writes: self.writes * n,
        }
    }
}

impl std::ops::Add for Accesses {
    type Output = Self;
    fn add(self, o: Self) -> Self {
        Self {
            reads: self.reads + o.reads,
            writes: self.writes + o.writes,
        }
    }
}

impl std::ops::AddAssign for Accesses {
    fn add_assign(&mut self, o: Self) {
        *self = *self + o;
    }
}

/// One storage buffer a call used.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Allocation {
    /// What the buffer holds.
    pub label: &'static str,
    /// Its size in bytes.
    pub bytes: u64,
}

/// Which clock [`CallStats::kernel_seconds`] was read from.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum Timing {
    /// Host time from submit to completion: includes the driver's submission
    /// and wake-up latency (adapters without `TIMESTAMP_QUERY`, and the CPU
    /// backend's wall time).
    #[default]
    WallClock,
    /// The adapter's timestamps at the start and end of each compute pass
    /// (`TIMESTAMP_QUERY`): the kernels' own time on the device.
    GpuTimestamps,
    /// CUDA events recorded on the stream before the first kernel and
    /// after the last (the CUDA backend).
    CudaEvents,
}

impl Timing {
    /// The clock in words.
    pub fn describe(self) -> &'static str {
        match self {
            Timing::WallClock => "wall clock from submit to completion",
            Timing::GpuTimestamps => "GPU timestamp queries at the compute-pass boundaries",
            Timing::CudaEvents => "CUDA events around the kernels on the stream",
        }
    }
}

/// What one call did: the plan it ran, every storage buffer it used (all
/// alive at once, so their sum is the call's peak), how it was cut into
/// pieces, dispatch count and the time of its GPU submissions.
#[derive(Clone, Debug, Default)]
pub struct CallStats {
    /// The plan the call ran (the first piece's; `None` off wgpu).
    pub plan: Option<Plan>,
    /// The device buffers the call held at once.
    pub allocations: Vec<Allocation>,
    /// Pieces the problem was cut into (storage bindings, dispatch limits,
    /// the adapter's loop limit); 1 when it ran whole.
    pub pieces: u32,
    /// Compute dispatches recorded.
    pub dispatches: u32,
    /// Seconds the call's kernels took (no uploads or readbacks), by the
    /// clock `timing` names.
    pub kernel_seconds: f64,
    /// The clock `kernel_seconds` comes from.
    pub timing: Timing,
    /// Storage-buffer elements the kernels read and write, counted
    /// analytically from the plan (each kernel's own count).
    pub accesses: Accesses,
    /// The same, counted by the kernels themselves (engines made with
    /// `Engine::with_io_counting` only).
    pub measured_accesses: Option<Accesses>,
    /// Times the call was rerun in shorter pieces because the adapter's loop
    /// limit cut a kernel short although the plan predicted it would fit.
    pub reruns: u32,
    /// Loop iterations each kernel took, as the adapter's loop limit counts
    /// them, the most of any dispatch (engines made with
    /// `Engine::with_loop_meter` only): what the loop model must predict.
    pub loop_iterations: Vec<(&'static str, u32)>,
    /// The known-answer verdict of the kernel family that ran (`verified`,
    /// `failed → fallback to X`, `not yet checked`, `verification off`;
    /// see `verify`); `None` on the CPU backend and for the FP8
    /// forward (not held to the accuracy rule).
    pub verification: Option<Verification>,
    /// Bytes the call copied from host to device memory, where the backend
    /// counts its copies (the CUDA backend's decoding steps: q, the new
    /// rows, the lengths, the page table, never a device cache); `None`
    /// where they are not counted.
    pub uploaded_bytes: Option<u64>,
}

impl CallStats {
    /// The stats of a call that runs `plan`, before it has done anything.
    pub fn for_plan(plan: Plan) -> Self {
        Self {
            plan: Some(plan),
            ..Default::default()
        }
    }

    /// Bytes of all buffers the call used (they coexist).
    pub fn peak_bytes(&self) -> u64 {
        self.allocations.iter().map(|a| a.bytes).sum()
    }

    /// The largest single buffer.
    pub fn largest_allocation(&self) -> Option<&Allocation> {
        self.allocations.iter().max_by_key(|a| a.bytes)
    }
}

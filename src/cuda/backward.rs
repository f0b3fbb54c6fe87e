//! The backward on the CUDA device: D = rowsum(dO ∘ O), then dK/dV per key
//! block and dQ per query block (cuda/flash_bwd.cu, flash_bwd_mma.cu), in
//! order on one stream. On the Hopper path dK/dV is cuda/flash_bwd_wgmma.cu's,
//! which reads q, k, v and dO through TMA tensor maps and, at head dim 64,
//! adds dQ's partials, in a fixed order, into an f32 workspace that its
//! `flash_bwd_dq_convert` rounds to dq; past 64 its `flash_bwd_dq_wgmma`
//! computes dQ per query block from the same maps.

use super::context::CudaDevice;
use super::driver_error::driver;
use super::forward::tensor_map;
use super::tensor_map::TensorMap;
use super::jit::{timed, Launch};
use super::kernel::KernelKey;
use super::layout::{LaunchTiles, Side};
use super::plan::KernelPath;
use super::problem::Call;
use crate::api::inputs::{BackwardInputs, ForwardInputs};
use crate::api::output::{BackwardOutput, CallStats, Timing};
use crate::api::problem::Problem;
use crate::api::tensor::{TensorData, TensorView};
use crate::error::{Error, Result};
use crate::Precision;
use cudarc::driver::{CudaSlice, CudaStream, LaunchConfig};
use std::sync::Arc;

/// A null device pointer, for the Hopper dK/dV's unused dQ workspace.
static NULL: u64 = 0;

/// Threads per block of `flash_bwd_dot` (one row each).
const DOT_THREADS: u32 = 256;

/// The backward's device buffers: inputs, D, and the gradients.
struct Buffers {
    inputs: Uploaded,
    delta: CudaSlice<f32>,
    dq: CudaSlice<u8>,
    dk: CudaSlice<u8>,
    dv: CudaSlice<u8>,
}

/// The backward's inputs on the device.
struct Uploaded {
    q: CudaSlice<u8>,
    k: CudaSlice<u8>,
    v: CudaSlice<u8>,
    o: CudaSlice<u8>,
    d_o: CudaSlice<u8>,
    lse: CudaSlice<f32>,
}

impl Buffers {
    fn upload(stream: &Arc<CudaStream>, inputs: &BackwardInputs, rows: usize) -> Result<Self> {
        let up =
            |t: &TensorView, during| stream.clone_htod(t.data.as_bytes()).map_err(driver(during));
        let zeros = |t: &TensorView, during| {
            stream
                .alloc_zeros::<u8>(t.data.as_bytes().len())
                .map_err(driver(during))
        };
        let uploaded = Uploaded {
            q: up(&inputs.q, "uploading q")?,
            k: up(&inputs.k, "uploading k")?,
            v: up(&inputs.v, "uploading v")?,
            o: up(&inputs.o, "uploading o")?,
            d_o: up(&inputs.d_o, "uploading do")?,
            lse: stream
                .clone_htod(inputs.lse)
                .map_err(driver("uploading lse"))?,
        };
        Ok(Self {
            inputs: uploaded,
            delta: stream
                .alloc_zeros::<f32>(rows)
                .map_err(driver("allocating D"))?,
            dq: zeros(&inputs.q, "allocating dq")?,
            dk: zeros(&inputs.k, "allocating dk")?,
            dv: zeros(&inputs.v, "allocating dv")?,
        })
    }
}

pub(crate) fn backward(
    dev: &CudaDevice,
    path: KernelPath,
    inputs: &BackwardInputs,
    problem: &Problem,
) -> Result<BackwardOutput> {
    let (shape, opts) = (problem.shape, problem.opts);
    let call = Call::new(problem)?;
    let stream = &dev.stream;
    let mut b = Buffers::upload(stream, inputs, shape.lse_len())?;
    let side = Side::upload(stream, &shape, opts)?;
    let seconds = launch(dev, &call, &side, path, &mut b)?;
    // dsinks from D and the lse, summed on the host in f64 in row order.
    let dsinks = match opts.sinks {
        Some(_) if call.precision != Precision::F32 => {
            let o = unrounded_output(dev, inputs, problem)?;
            let delta = crate::cpu::row_deltas(&shape, &o, &inputs.d_o.data.to_f32());
            side.dsinks(inputs.lse, &delta)
        }
        Some(_) => {
            let delta = stream.clone_dtoh(&b.delta).map_err(driver("reading D"))?;
            side.dsinks(inputs.lse, &delta)
        }
        None => None,
    };

    let read = |buf, n: usize, during| -> Result<TensorData> {
        let bytes = stream.clone_dtoh(buf).map_err(driver(during))?;
        TensorData::from_bytes(&bytes, call.precision, n)
    };
    let count = |s: [usize; 4]| s.iter().product::<usize>();
    let grads = [
        read(&b.dq, count(shape.q_shape()), "reading dq")?,
        read(&b.dk, count(shape.kv_shape()), "reading dk")?,
        read(&b.dv, count(shape.v_shape()), "reading dv")?,
    ];
    let stats = CallStats {
        pieces: 1,
        dispatches: 3,
        kernel_seconds: seconds,
        timing: Timing::CudaEvents,
        ..CallStats::default()
    };
    let [dq, dk, dv] = grads;
    Ok(BackwardOutput::new(&shape, dq, dk, dv, stats)
        .with_dsinks(dsinks)
        .packed(opts.varlen.is_some()))
}

/// The forward's O in f32 from the same (exactly widened) inputs, on the
/// scalar kernels. `dsink_h` sums `P_sink · D` over every row of a head,
/// and a `D` from an O rounded to f16 or bf16 carries that rounding in
/// every row: a small case's few dsinks then land anywhere within a few
/// times the baseline's error (3.2× seen on an H200, against the rule's 3).
/// From this O they sit at f32 rounding, as the CPU backend's do.
fn unrounded_output(
    dev: &CudaDevice,
    inputs: &BackwardInputs,
    problem: &Problem,
) -> Result<Vec<f32>> {
    let [q, k, v] = [&inputs.q, &inputs.k, &inputs.v].map(|t| t.data.to_f32());
    let q = TensorView::f32(inputs.q.shape, &q);
    let k = TensorView::f32(inputs.k.shape, &k);
    let v = TensorView::f32(inputs.v.shape, &v);
    let f32_inputs = ForwardInputs::new(q, k, v);
    let problem = Problem::forward(&f32_inputs, problem.opts)?;
    let out = super::forward::forward(dev, KernelPath::Scalar, &q, &k, &v, &problem)?;
    Ok(out.o.to_f32())
}

/// D, then dK/dV, then dQ, in that order on the device's one stream (so
/// the gradient kernels see the finished D). On the Hopper path dK/dV also
/// adds dQ's partials into a workspace, and dQ is its rounding to storage.
/// Waits for them before it returns, as the tile lists it uploads are
/// dropped then; their seconds by CUDA events.
fn launch(
    dev: &CudaDevice,
    call: &Call,
    side: &Side,
    path: KernelPath,
    b: &mut Buffers,
) -> Result<f64> {
    let shape = &call.shape;
    let plan = call.plan(&dev.props, path)?;
    let key = plan.backward;
    let hopper_dq = key.adds_dq();
    let dot = dev.function(key, "flash_bwd_dot")?;
    let dkdv = dev.function(key, "flash_bwd_dkdv")?;
    let dq = dev.function(key, dq_entry(&key))?;
    let batch = i32::try_from(shape.batch).map_err(|_| Error::Overflow {
        what: "batch",
        value: shape.batch as u64,
    })?;
    let dkdv_cfg = call.launch(&key, true, shape.heads_kv)?;
    let dq_cfg = call.launch(&key, false, shape.heads_q)?;
    let stream = &dev.stream;
    let (key_lists, row_lists) = (
        side.lists(stream, launch_tiles(&key, true))?,
        side.lists(stream, launch_tiles(&key, false))?,
    );
    let maps = dkdv_maps(stream, call, &key, &b.inputs)?;
    let mut work = hopper_dq
        .then(|| DqWorkspace::zeroed(stream, call, &key))
        .transpose()?;
    let key_layout = side.layout(stream, key_lists.as_ref());
    let row_layout = side.layout(stream, row_lists.as_ref());
    let (scale, elements) = (call.problem.scale(), work.as_ref().map_or(0, |w| w.accum.len() as u64));
    let seconds = timed(stream, "running the backward", || {
        // SAFETY (all four): the arguments are the kernels', in order and
        // of their types (storage pointers or, for the Hopper dK/dV and dQ,
        // 128-byte tensor maps of q, k, v and dO by value and dK/dV's dQ
        // workspace; Problem, Layout and, but for flash_bwd_dot and the
        // Hopper kernels, Dropout by value), every buffer holds what the grids index, as sized from the
        // validated shape and options, and the lists live until the wait in
        // `timed` (the other side buffers, until the caller's).
        let mut l = Launch::new(stream, &dot);
        l.input(&b.inputs.o)
            .input(&b.inputs.d_o)
            .output(&mut b.delta)
            .value(&call.problem)
            .value(&batch)
            .value(&row_layout);
        unsafe { l.launch(row_launch(shape.lse_len()), "launching flash_bwd_dot") }?;
        let mut l = Launch::new(stream, &dkdv);
        gradient_inputs(&mut l, &maps, &b.inputs, &b.delta);
        l.output(&mut b.dk).output(&mut b.dv);
        workspace_args(&mut l, work.as_mut(), !maps.is_empty());
        l.value(&call.problem).value(&key_layout);
        if maps.is_empty() {
            l.value(&call.dropout_args);
        }
        unsafe { l.launch(dkdv_cfg, "launching flash_bwd_dkdv") }?;
        let mut l = Launch::new(stream, &dq);
        if let Some(w) = work.as_ref() {
            l.input(&w.accum).output(&mut b.dq).value(&scale).value(&elements);
            return unsafe { l.launch(row_launch(w.accum.len()), "launching flash_bwd_dq_convert") };
        }
        gradient_inputs(&mut l, &maps, &b.inputs, &b.delta);
        l.output(&mut b.dq).value(&call.problem).value(&row_layout);
        if maps.is_empty() {
            l.value(&call.dropout_args);
        }
        unsafe { l.launch(dq_cfg, "launching flash_bwd_dq") }
    })?;
    drop((key_lists, row_lists, work));
    Ok(seconds)
}

/// One thread a row (or element) of `n`, for the small kernels.
fn row_launch(n: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (n.div_ceil(DOT_THREADS as usize).min(65535) as u32, 1, 1),
        block_dim: (DOT_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The Hopper dK/dV's dQ workspace arguments: its buffers, or past head
/// dim 64 (no workspace) null pointers; none for the other dK/dV kernels.
fn workspace_args<'a>(l: &mut Launch<'a>, work: Option<&'a mut DqWorkspace>, hopper: bool) {
    match work {
        Some(w) => {
            l.output(&mut w.accum).output(&mut w.sems);
        }
        None if hopper => {
            l.value(&NULL).value(&NULL);
        }
        None => {}
    }
}

/// The Hopper dK/dV's dQ workspace, zeroed: dq's partial sums in f32, and
/// the semaphores that order their adds, one per (query tile, query head,
/// dQ warpgroup), sequence z's tiles numbered from its first row / 64 + z
/// (cuda/flash_bwd_wgmma.cu's `dq_semaphore`).
struct DqWorkspace {
    accum: CudaSlice<f32>,
    sems: CudaSlice<i32>,
}

impl DqWorkspace {
    fn zeroed(stream: &Arc<CudaStream>, call: &Call, key: &KernelKey) -> Result<Self> {
        let shape = &call.shape;
        let elements = shape.q_shape().iter().product::<usize>();
        let q_rows = elements / (shape.heads_q * shape.head_dim).max(1);
        let tiles = q_rows / key.tiles().keys + call.seqs + 1;
        Ok(Self {
            accum: stream
                .alloc_zeros::<f32>(elements)
                .map_err(driver("allocating dQ's workspace"))?,
            sems: stream
                .alloc_zeros::<i32>(tiles * shape.heads_q * 2)
                .map_err(driver("allocating dQ's semaphores"))?,
        })
    }
}

/// The tile lists' shape of `key`'s blocks (by keys: its dK/dV's).
fn launch_tiles(key: &KernelKey, by_keys: bool) -> LaunchTiles {
    let t = key.tiles();
    LaunchTiles {
        outer: t.rows,
        // The Hopper dQ walks tiles of a dK/dV block's keys (its K and V maps' boxes).
        inner: if key.family.is_wgmma() && !by_keys {
            t.rows
        } else {
            t.keys
        },
        by_keys,
    }
}

/// The Hopper dK/dV's tensor maps (none for the other modules): q and dO
/// in boxes of a step's queries, k and v of a block's keys.
fn dkdv_maps(stream: &CudaStream, call: &Call, key: &KernelKey, i: &Uploaded) -> Result<Vec<TensorMap>> {
    if !key.family.is_wgmma() {
        return Ok(Vec::new());
    }
    let (shape, t) = (&call.shape, key.tiles());
    let (q_rows, k_rows) = ((shape.seqlen_q, shape.heads_q), (shape.seqlen_k, shape.heads_kv));
    Ok(vec![
        tensor_map(stream, call, &i.q, q_rows, t.keys)?,
        tensor_map(stream, call, &i.k, k_rows, t.rows)?,
        tensor_map(stream, call, &i.v, k_rows, t.rows)?,
        tensor_map(stream, call, &i.d_o, q_rows, t.keys)?,
    ])
}

/// The first arguments of both gradient kernels: q, k, v, dO, lse and D
/// (the Hopper kernels' q, k, v and dO as tensor maps by value).
fn gradient_inputs<'a>(
    l: &mut Launch<'a>,
    maps: &'a [TensorMap],
    i: &'a Uploaded,
    delta: &'a CudaSlice<f32>,
) {
    match maps {
        [tq, tk, tv, tdo] => l.value(tq).value(tk).value(tv).value(tdo),
        _ => l.input(&i.q).input(&i.k).input(&i.v).input(&i.d_o),
    };
    l.input(&i.lse).input(delta);
}

/// The backward's dQ entry point in `key`'s module: the rounding of the
/// Hopper dK/dV's partials where it adds them, the Hopper dQ kernel
/// elsewhere on that path, the sm80 or scalar one off it.
fn dq_entry(key: &KernelKey) -> &'static str {
    match (key.adds_dq(), key.family.is_wgmma()) {
        (true, _) => "flash_bwd_dq_convert",
        (false, true) => "flash_bwd_dq_wgmma",
        (false, false) => "flash_bwd_dq",
    }
}

//! The forward on the CUDA device: upload (with the layouts' side
//! buffers), one `flash_fwd` launch (the sm80 module's `flash_fwd_unaligned`
//! where d % 8 != 0), readback. The Hopper kernel takes q, k and v as TMA
//! tensor maps (a packed batch's over the whole packed tensor, its batch of
//! one) and no dropout, the others pointers; every kernel takes the
//! `Layout`.

use super::context::CudaDevice;
use super::driver_error::driver;
use super::jit::{timed, Launch};
use super::kernel::{Family, KernelKey};
use super::layout::{LaunchTiles, Side};
use super::plan::KernelPath;
use super::problem::Call;
use super::tensor_map::{encode, params, TensorMap};
use crate::api::output::{Allocation, CallStats, ForwardOutput, Timing};
use crate::api::problem::Problem;
use crate::api::tensor::{TensorData, TensorView};
use crate::error::Error;
use crate::error::Result;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

pub(crate) fn forward(
    dev: &CudaDevice,
    path: KernelPath,
    q: &TensorView,
    k: &TensorView,
    v: &TensorView,
    problem: &Problem,
) -> Result<ForwardOutput> {
    let (shape, opts) = (problem.shape, problem.opts);
    let call = Call::new(problem)?;
    let key = call.plan(&dev.props, path)?.forward;
    let func = dev.function(key, entry_point(&key, shape.head_dim))?;
    let stream = &dev.stream;
    let upload = |t: &TensorView| stream.clone_htod(t.data.as_bytes());
    let (q_dev, k_dev, v_dev) = (
        upload(q).map_err(driver("uploading q"))?,
        upload(k).map_err(driver("uploading k"))?,
        upload(v).map_err(driver("uploading v"))?,
    );
    let o_bytes = q.data.as_bytes().len();
    let mut d_out = stream
        .alloc_zeros::<u8>(o_bytes)
        .map_err(driver("allocating o"))?;
    let mut d_lse = stream
        .alloc_zeros::<f32>(shape.lse_len())
        .map_err(driver("allocating lse"))?;
    let (cfg, work) = call.forward_launch(&key, dev.props.sms)?;
    let maps = if key.family.is_wgmma() {
        let io = MappedTensors {
            q: &q_dev,
            k: &k_dev,
            v: &v_dev,
            o: &d_out,
        };
        tensor_maps(stream, &key, &call, io)?
    } else {
        Vec::new()
    };
    let side = Side::upload(stream, &shape, opts)?;
    let t = key.tiles();
    let lists = side.lists(
        stream,
        LaunchTiles {
            outer: t.rows,
            inner: t.keys,
            by_keys: false,
        },
    )?;
    let layout = side.layout(stream, lists.as_ref());
    let seconds = timed(stream, "running flash_fwd", || {
        let mut launch = Launch::new(stream, &func);
        match &maps[..] {
            [tq, tk, tv, to] => launch.value(tq).value(tk).value(tv).value(to),
            _ => launch.input(&q_dev).input(&k_dev).input(&v_dev),
        };
        launch
            .output(&mut d_out)
            .output(&mut d_lse)
            .value(&call.problem)
            .value(&layout);
        match &work {
            Some(work) => launch.value(work),
            None => launch.value(&call.dropout_args),
        };
        // SAFETY: the arguments are flash_fwd's, in order and of its types
        // (storage pointers or, for the Hopper kernel, 128-byte tensor maps
        // of q, k, v and o by value, then o's pointer too; Problem, Layout,
        // then Dropout or, for the Hopper kernel, Work by value); every
        // buffer holds what the grid (or Work's item list) indexes, as
        // sized from the validated shape and options, and the buffers and
        // the side buffers Layout points at outlive the wait in `timed`.
        unsafe { launch.launch(cfg, "launching flash_fwd") }
    })?;
    let o = stream.clone_dtoh(&d_out).map_err(driver("reading o"))?;
    let lse = stream.clone_dtoh(&d_lse).map_err(driver("reading lse"))?;
    let stats = call_stats(o_bytes, lse.len(), seconds);
    let o = TensorData::from_bytes(&o, call.precision, shape.q_shape().iter().product())?;
    drop((side, lists));
    Ok(ForwardOutput::new(shape, o, lse, stats).packed(opts.varlen.is_some()))
}

/// The forward kernel of `key`'s module for head dim `d`: the sm80 one has
/// a kernel of its own for head dims off whole 16-byte chunks (element by
/// element loads, registers for one row tile).
fn entry_point(key: &KernelKey, d: usize) -> &'static str {
    if key.family == Family::ForwardMma && !d.is_multiple_of(8) {
        "flash_fwd_unaligned"
    } else {
        "flash_fwd"
    }
}

/// One launch's statistics: its buffers and time (CUDA events).
fn call_stats(o_bytes: usize, lse_len: usize, seconds: f64) -> CallStats {
    CallStats {
        allocations: vec![
            Allocation {
                label: "q, k, v",
                bytes: (3 * o_bytes) as u64,
            },
            Allocation {
                label: "o",
                bytes: o_bytes as u64,
            },
            Allocation {
                label: "lse",
                bytes: (lse_len * 4) as u64,
            },
        ],
        pieces: 1,
        dispatches: 1,
        kernel_seconds: seconds,
        timing: Timing::CudaEvents,
        ..CallStats::default()
    }
}

/// The device tensors the Hopper kernel reads and writes by TMA.
struct MappedTensors<'a> {
    q: &'a CudaSlice<u8>,
    k: &'a CudaSlice<u8>,
    v: &'a CudaSlice<u8>,
    o: &'a CudaSlice<u8>,
}

/// The Hopper kernel's TMA maps of q, k, v (boxes of its tiles' rows) and
/// o (boxes of a consumer warpgroup's half of them, for its TMA store): a
/// packed batch's `shape` is its batch of one, so its maps span the packed
/// tensor and each block adds its sequence's first row.
fn tensor_maps(
    stream: &CudaStream,
    key: &KernelKey,
    call: &Call,
    io: MappedTensors,
) -> Result<Vec<TensorMap>> {
    let MappedTensors { q, k, v, o } = io;
    let (t, shape) = (key.tiles(), &call.shape);
    let (q_rows, k_rows) = ((shape.seqlen_q, shape.heads_q), (shape.seqlen_k, shape.heads_kv));
    Ok(vec![
        tensor_map(stream, call, q, q_rows, t.rows)?,
        tensor_map(stream, call, k, k_rows, t.keys)?,
        tensor_map(stream, call, v, k_rows, t.keys)?,
        tensor_map(stream, call, o, q_rows, t.rows / 2)?,
    ])
}

/// The TMA map of `buf`, a (batch, seqlen, heads, d) tensor of the call's
/// precision with `(seqlen, heads)` as given, read `rows` rows a box (the
/// Hopper forward's and dK/dV's).
pub(super) fn tensor_map(
    stream: &CudaStream,
    call: &Call,
    buf: &CudaSlice<u8>,
    (seqlen, heads): (usize, usize),
    rows: usize,
) -> Result<TensorMap> {
    let shape = &call.shape;
    // The plan only picks the Hopper kernels where d % 8 == 0.
    let p = params([shape.batch, seqlen, heads, shape.head_dim], call.precision.bytes(), rows).ok_or(
        Error::Unsupported {
            what: "the CUDA backend's Hopper path",
            feature: "a head dim not a multiple of 8",
        },
    )?;
    let (address, _sync) = buf.device_ptr(stream);
    encode(&p, call.precision, address)
}

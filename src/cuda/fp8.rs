//! The FP8 (e4m3) forward on Hopper: cuda/flash_fwd_wgmma.cu's `IS_FP8`
//! variant ([`KernelKey::fp8_forward`]) on q, k and v already quantized on
//! the device (docs/semantics.md's "FP8 (e4m3)"): TMA maps over the codes
//! (bytes, boxes of 128), the per-(batch, head) scales as pointers, one
//! persistent launch timed by CUDA events. o comes back in f32 at the
//! kernel's padded row ([`fp8_row`]), lse in f32 in the usual layout.
//! [`forward_fp8`], the backend's FP8 entry point, quantizes q, k and v on
//! the device (src/cuda/fp8_quant.rs) and calls it.

use super::compile::Arch;
use super::context::CudaDevice;
use super::driver_error::driver;
use super::fp8_quant::quantize;
use super::jit::{timed, Launch};
use super::kernel::{KernelKey, FP8_HEAD_DIM};
use super::layout::Side;
use super::plan::DeviceProps;
use super::problem::Call;
use super::tensor_map::{encode_codes, params, TensorMap};
use crate::api::inputs::ForwardInputs;
use crate::api::options::{AttentionOptions, Fp8Options};
use crate::api::output::{CallStats, ForwardOutput, Timing};
use crate::api::problem::Problem;
use crate::api::shape::AttentionShape;
use crate::api::tensor::{Precision, TensorData};
use crate::error::{Error, Result};
use crate::quant::Fp8Layout;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};

/// What the FP8 forward is, in its errors.
const WHAT: &str = "the CUDA backend's FP8 forward";

/// q, k and v on the device as e4m3 codes, (batch, seqlen, heads, row)
/// bytes each, `row` = [`fp8_row`]`(dim)`; codes past a tensor's quantized
/// elements are zero. Scales: f32, (batch, heads_q) for q, (batch,
/// heads_kv) for k and v.
pub(crate) struct Fp8Codes {
    pub q: CudaSlice<u8>,
    pub k: CudaSlice<u8>,
    pub v: CudaSlice<u8>,
    pub q_scales: CudaSlice<f32>,
    pub k_scales: CudaSlice<f32>,
    pub v_scales: CudaSlice<f32>,
}

impl Fp8Codes {
    /// Whether the buffers hold `shape`'s rows of `row` codes and a scale
    /// per batch entry and head: `Error::BufferTooSmall` naming the first
    /// that does not.
    fn check_holds(&self, shape: &AttentionShape, row: usize) -> Result<()> {
        let (q_len, k_len) = (
            shape.batch * shape.seqlen_q * shape.heads_q,
            shape.batch * shape.seqlen_k * shape.heads_kv,
        );
        for (buffer, size, needed) in [
            ("FP8 q codes", self.q.len(), q_len * row),
            ("FP8 k codes", self.k.len(), k_len * row),
            ("FP8 v codes", self.v.len(), k_len * row),
            ("FP8 q scales", self.q_scales.len(), shape.batch * shape.heads_q),
            ("FP8 k scales", self.k_scales.len(), shape.batch * shape.heads_kv),
            ("FP8 v scales", self.v_scales.len(), shape.batch * shape.heads_kv),
        ] {
            if size < needed {
                return Err(Error::BufferTooSmall {
                    buffer,
                    size: size as u64,
                    needed: needed as u64,
                });
            }
        }
        Ok(())
    }
}

/// The kernel's stored row for `layout`'s quantized rows, or
/// `HeadDimTooLarge` past what it takes.
pub(crate) fn stored_row(layout: &Fp8Layout) -> Result<usize> {
    fp8_row(layout.dim()).ok_or(Error::HeadDimTooLarge {
        tensor: "q/k (FP8 on CUDA)",
        head_dim: layout.dim(),
        max: FP8_HEAD_DIM,
    })
}

/// The stored row (bytes = elements) of the FP8 kernel for a quantized row
/// of `dim` elements (the head dim, or the Hadamard order): the kernel's
/// padded head dim, `None` past what it takes.
pub(crate) fn fp8_row(dim: usize) -> Option<usize> {
    (1..=FP8_HEAD_DIM).contains(&dim).then_some(FP8_HEAD_DIM)
}

/// Whether the FP8 kernel runs on a device of `props`: wgmma on e4m3 codes
/// and setmaxnreg are sm_90a's, so a device of compute capability 9.x with
/// kernels compiled for compute_90a; else `Error::CudaArchUnfit` saying so.
pub(crate) fn runs_on(props: &DeviceProps) -> Result<()> {
    if props.major != 9 || props.arch != Arch::for_device(9, 0) {
        return Err(Error::CudaArchUnfit {
            arch: props.arch.name(),
            device: props.name.clone(),
            why: "the FP8 forward runs wgmma on e4m3 codes, compute_90a's (a device of compute capability 9.0)",
        });
    }
    Ok(())
}

/// Why the FP8 kernel `key` cannot run on `dev` (its architecture and
/// shared memory), if it cannot.
fn arch_blocker(dev: &CudaDevice, key: &KernelKey) -> Result<()> {
    runs_on(&dev.props)?;
    if key.dynamic_shared_bytes() > dev.props.smem_per_block_optin {
        return Err(Error::Unsupported {
            what: WHAT,
            feature: "a device giving a block less shared memory than the FP8 forward's",
        });
    }
    Ok(())
}

/// The FP8 forward on `codes` in rows of `row` ([`stored_row`]):
/// `problem` is FP8's (its options checked by [`Fp8Layout::checked`]), its
/// shape's head_dim the quantized row's ([`Fp8Layout::padded`]), its opts
/// the explicit score scale ([`Fp8Layout::options`]). Returns o as f32
/// (batch, seqlen_q, heads_q, `row`) on the device, lse (f32, the usual
/// layout), and the kernel's seconds (CUDA events).
fn forward_codes(
    dev: &CudaDevice,
    codes: &Fp8Codes,
    problem: &Problem,
    row: usize,
) -> Result<(CudaSlice<f32>, CudaSlice<f32>, f64)> {
    let (shape, opts) = (problem.shape, problem.opts);
    // The kernel takes each row's max of the raw dot products (exp2's
    // argument folds the scale in), as the Hopper forward does.
    if problem.scale <= 0.0 {
        return Err(Error::Unsupported {
            what: WHAT,
            feature: "a score scale of 0 or below",
        });
    }
    let call = Call::new(problem)?;
    let key = KernelKey::fp8_forward(shape.head_dim, call.band, call.softcap);
    arch_blocker(dev, &key)?;
    codes.check_holds(&shape, row)?;
    let q_len = shape.batch * shape.seqlen_q * shape.heads_q;
    let func = dev.function(key, "flash_fwd")?;
    let stream = &dev.stream;
    let mut d_out = stream
        .alloc_zeros::<f32>(q_len * row)
        .map_err(driver("allocating the FP8 forward's o"))?;
    let mut d_lse = stream
        .alloc_zeros::<f32>(shape.lse_len())
        .map_err(driver("allocating the FP8 forward's lse"))?;
    let (cfg, work) = call.persistent_launch(&key, dev.props.sms)?;
    let t = key.tiles();
    let (tq, tk, tv) = (
        code_map(stream, &codes.q, [shape.batch, shape.seqlen_q, shape.heads_q, row], t.rows)?,
        code_map(stream, &codes.k, [shape.batch, shape.seqlen_k, shape.heads_kv, row], t.keys)?,
        code_map(stream, &codes.v, [shape.batch, shape.seqlen_k, shape.heads_kv, row], t.keys)?,
    );
    // No layouts (check_supported refused them): every side buffer null.
    let side = Side::upload(stream, &shape, opts)?;
    let layout = side.layout(stream, None);
    let seconds = timed(stream, "running the FP8 flash_fwd", || {
        let mut launch = Launch::new(stream, &func);
        launch
            .value(&tq)
            .value(&tk)
            .value(&tv)
            .output(&mut d_out)
            .output(&mut d_lse)
            .input(&codes.q_scales)
            .input(&codes.k_scales)
            .input(&codes.v_scales)
            .value(&call.problem)
            .value(&layout)
            .value(&work);
        // SAFETY: the arguments are the FP8 flash_fwd's, in order and of its
        // types: three 128-byte tensor maps by value over the code buffers
        // (checked above to hold the shape's rows of `row` codes), o (f32,
        // the shape's query rows of `row`) and lse (lse_len f32), the three
        // scale buffers (checked to hold a scale per batch entry and head),
        // then Problem, Layout (all null) and Work by value; every buffer
        // outlives the wait in `timed`.
        unsafe { launch.launch(cfg, "launching the FP8 flash_fwd") }
    })?;
    drop(side);
    Ok((d_out, d_lse, seconds))
}

/// The FP8 forward (docs/semantics.md "FP8 (e4m3)") on `dev`: q, k and v
/// quantized on the device (fp8_quant: `crate::quant`'s codes and scales),
/// the Hopper FP8 kernel on the codes, o (f32, cut back to the head dim)
/// and lse read back.
pub(crate) fn forward_fp8(
    dev: &CudaDevice,
    inputs: &ForwardInputs,
    opts: &AttentionOptions,
    fp8: &Fp8Options,
) -> Result<ForwardOutput> {
    let (shape, layout) = Fp8Layout::checked(inputs, opts, fp8)?;
    let row = stored_row(&layout)?;
    let t = layout.transform.as_ref();
    let [q, k, v] = [(&inputs.q, "q", t), (&inputs.k, "k", t), (&inputs.v, "v", None)]
        .map(|(x, name, t)| quantize(dev, x, name, t, row));
    let (q, k, v) = (q?, k?, v?);
    let codes = Fp8Codes {
        q: q.codes,
        k: k.codes,
        v: v.codes,
        q_scales: q.scales,
        k_scales: k.scales,
        v_scales: v.scales,
    };
    let padded_opts = layout.options(opts);
    let problem = Problem::padded(layout.padded(&shape), Precision::F32, &padded_opts)?;
    let (o, lse, seconds) = forward_codes(dev, &codes, &problem, row)?;
    let s = &dev.stream;
    let o = s.clone_dtoh(&o).map_err(driver("reading o"))?;
    let lse = s.clone_dtoh(&lse).map_err(driver("reading lse"))?;
    let o: Vec<f32> = o.chunks(row).flat_map(|r| r[..shape.head_dim].iter().copied()).collect();
    let stats = CallStats {
        kernel_seconds: seconds,
        timing: Timing::CudaEvents,
        ..CallStats::default()
    };
    Ok(ForwardOutput::new(shape, TensorData::F32(o), lse, stats))
}

/// The TMA map of a (batch, seqlen, heads, row) tensor of e4m3 codes, read
/// `rows` rows a box.
fn code_map(stream: &CudaStream, buf: &CudaSlice<u8>, dims: [usize; 4], rows: usize) -> Result<TensorMap> {
    let p = params(dims, 1, rows).ok_or(Error::Unsupported {
        what: WHAT,
        feature: "rows of codes off whole 16-byte units",
    })?;
    let (address, _sync) = buf.device_ptr(stream);
    encode_codes(&p, address)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantized_rows_up_to_128_run_padded_to_128() {
        assert_eq!(fp8_row(1), Some(128));
        assert_eq!(fp8_row(64), Some(128));
        assert_eq!(fp8_row(128), Some(128));
        assert_eq!(fp8_row(129), None);
        assert_eq!(fp8_row(0), None);
        assert_eq!(KernelKey::fp8_forward(100, false, true).head_dim, fp8_row(100).unwrap());
    }
}

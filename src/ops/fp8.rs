//! The FP8 (e4m3) forward on the device (docs/semantics.md): q, k, v uploaded in f32
//! and quantized there (`kernels::quantize`: per-(batch, head) scales, q
//! and k through the seeded Walsh–Hadamard transform when asked), then the
//! flash forward on the codes (FP8 storage: decoded on load, the scales
//! applied to the scores and the output, P quantized at its own scale), all
//! in one submission; `o` (f32) and `lse` read back. The quantized values
//! are `crate::quant`'s, bit for bit. One dispatch set: a problem past one
//! storage binding, the grid or the adapter's loop limit is a typed error,
//! never split.

use super::bindings::{self, Range, TensorBytes};
use super::forward::{check_loop_limit, dispatches};
use crate::api::inputs::ForwardInputs;
use crate::api::options::{AttentionOptions, Fp8Options};
use crate::api::output::{Accesses, ForwardOutput};
use crate::api::problem::Problem;
use crate::api::shape::AttentionShape;
use crate::api::size::grid_u32;
use crate::api::tensor::{Precision, TensorData, TensorView};
use crate::error::{Error, Result};
use crate::kernels::params::to_u32;
use crate::kernels::{
    binding, AttentionBindings, AttentionBuffers, BufferCopy, CopyParams, FlashForward,
    Fp8Quantize, QuantParams, QuantPass, Variant,
};
use crate::plan::{plan_forward, Plan, PlanOverrides, PlanRequest, StorageKind};
use crate::quant::{check_finite, Fp8Layout, Fp8Tensor, Hadamard};
use crate::runtime::{record, whole, Call, Dispatch, Gpu};

/// One tensor to quantize: its shape, whether it is transformed, its rows'
/// stored length and where its scales go in the shared buffers.
#[derive(Clone, Copy, Debug)]
struct Spec {
    name: &'static str,
    shape: [usize; 4],
    hadamard: bool,
    row_len: usize,
    scale_offset: usize,
}

impl Spec {
    fn kernel(&self, gpu: &Gpu, pass: QuantPass, aliased: bool) -> Fp8Quantize {
        Fp8Quantize {
            pass,
            head_dim: self.shape[3] as u32,
            hadamard: self.hadamard,
            variant: Variant {
                aliased,
                ..gpu.variant(false, false)
            },
        }
    }

    fn heads(&self) -> usize {
        self.shape[0] * self.shape[2]
    }

    fn code_bytes(&self) -> u64 {
        (self.shape[0] * self.shape[1] * self.shape[2] * self.row_len) as u64
    }
}

/// The device ranges one tensor's quantization uses, and whether its
/// kernels run in their aliased form (x and the codes in one buffer).
struct QuantBuffers<'a> {
    x: wgpu::BufferBinding<'a>,
    signs: &'a wgpu::Buffer,
    absmax: &'a wgpu::Buffer,
    scales: &'a wgpu::Buffer,
    codes: wgpu::BufferBinding<'a>,
    aliased: bool,
}

/// The three passes over one tensor (max, scales, codes), and the storage
/// elements they read (each input element, twice).
fn quant_dispatches<'a>(
    gpu: &Gpu,
    s: &Spec,
    norm: f32,
    b: &QuantBuffers<'a>,
) -> Result<(Vec<Dispatch<'a>>, Accesses)> {
    let [batch, seqlen, heads, _] = s.shape;
    let params = QuantParams {
        seqlen: to_u32("seqlen", seqlen)?,
        heads: to_u32("heads", heads)?,
        batch: to_u32("batch", batch)?,
        row_len: to_u32("FP8 row length", s.row_len)?,
        scale_offset: to_u32("scale offset", s.scale_offset)?,
        norm,
        ..Default::default()
    };
    let uniform = vec![(binding::QUANT, bytemuck::bytes_of(&params).to_vec())];
    let rows = [
        (binding::QUANT_X, b.x.clone()),
        (binding::SIGNS, b.signs.as_entire_buffer_binding()),
    ];
    let passes = [
        (QuantPass::Absmax, whole([(binding::ABSMAX, b.absmax)])),
        (
            QuantPass::Scales,
            whole([(binding::ABSMAX, b.absmax), (binding::FP8_SCALES, b.scales)]),
        ),
        (
            QuantPass::Codes,
            vec![
                (binding::FP8_SCALES, b.scales.as_entire_buffer_binding()),
                (binding::CODES, b.codes.clone()),
            ],
        ),
    ];
    let mut out = Vec::new();
    for (pass, mut buffers) in passes {
        let kernel = s.kernel(gpu, pass, b.aliased);
        if pass != QuantPass::Scales {
            buffers.extend(rows.iter().cloned());
        }
        let grid = kernel.grid([batch, seqlen, heads].map(|x| grid_u32(x as u64)));
        if let Some(&n) = grid.iter().find(|&&n| n > gpu.max_groups()) {
            return Err(Error::GridTooLarge {
                what: "the FP8 quantization",
                groups: n as u64,
                max: gpu.max_groups(),
            });
        }
        out.push(Dispatch {
            kernel: kernel.into(),
            uniforms: uniform.clone(),
            buffers,
            grid,
            walk: None,
        });
    }
    let elements = s.shape.iter().product::<usize>() as u64;
    let accesses = Accesses {
        reads: 2 * elements,
        writes: 0,
    };
    Ok((out, accesses))
}


/// The transform's signs as a buffer (one unused element without it).
fn signs(call: &mut Call<'_>, t: Option<&Hadamard>) -> Result<wgpu::Buffer> {
    let signs = t.map_or(vec![1.0f32], |t| t.signs.clone());
    call.upload("fp8 hadamard signs", bytemuck::cast_slice(&signs))
}

/// Upload one tensor's f32 values (finite, checked), and make its codes.
fn upload_tensor(
    call: &mut Call<'_>,
    s: &Spec,
    x: &TensorView,
) -> Result<(wgpu::Buffer, wgpu::Buffer)> {
    x.check_len(s.name)?;
    let values = x.data.to_f32();
    check_finite(&values, s.name)?;
    call.gpu.within_binding(s.name, 4 * values.len() as u64)?;
    let bytes = call.gpu.within_binding("fp8 codes", s.code_bytes())?;
    Ok((
        call.upload(s.name, bytemuck::cast_slice(&values))?,
        call.storage("fp8 codes", bytes)?,
    ))
}

/// One tensor quantized on the device and read back (the codes and scales
/// the FP8 forward uses, for checking them against `crate::quant`).
pub async fn quantize(gpu: &Gpu, x: &TensorView<'_>, fp8: &Fp8Options) -> Result<Fp8Tensor> {
    // Before the transform's signs, which are as many as the head dim.
    x.check_len("x")?;
    let layout = Fp8Layout::new(x.shape[3], fp8);
    let transform = layout.transform.as_ref();
    let spec = Spec {
        name: "x",
        shape: x.shape,
        hadamard: transform.is_some(),
        row_len: layout.row_len,
        scale_offset: 0,
    };
    let mut call = Call::new(gpu, None);
    let (xb, codes) = upload_tensor(&mut call, &spec, x)?;
    let signs = signs(&mut call, transform)?;
    let n = 4 * spec.heads() as u64;
    let absmax = call.upload("fp8 absmax", &vec![0u8; n as usize])?;
    let scales = call.storage("fp8 scales", n)?;
    let bufs = QuantBuffers {
        x: xb.as_entire_buffer_binding(),
        signs: &signs,
        absmax: &absmax,
        scales: &scales,
        codes: codes.as_entire_buffer_binding(),
        aliased: false,
    };
    let norm = transform.map_or(1.0, |t| t.norm);
    let (ds, accesses) = quant_dispatches(gpu, &spec, norm, &bufs)?;
    call.stats.accesses += accesses;
    call.run(&ds).await?;
    let mut data = call
        .read(&[(&codes, spec.code_bytes()), (&scales, n)])
        .await?;
    let scales = bytemuck::pod_collect_to_vec(&data.pop().unwrap_or_default());
    let mut codes = data.pop().unwrap_or_default();
    codes.truncate(spec.code_bytes() as usize);
    Ok(Fp8Tensor {
        shape: x.shape,
        dim: layout.dim(),
        row_len: layout.row_len,
        codes,
        scales,
    })
}

/// The flash forward kernel over the stored rows, with FP8 storage.
fn attention_kernel(
    gpu: &Gpu,
    padded: &AttentionShape,
    opts: &AttentionOptions,
    overrides: &PlanOverrides,
) -> Result<FlashForward> {
    // Hadamard's rows are zero-padded to a power of two: past 512 that is
    // 1024, wider than the kernels' rows (the CPU backend takes it).
    if padded.head_dim > crate::api::shape::MAX_HEAD_DIM {
        return Err(Error::Unsupported {
            what: "the wgpu FP8 forward",
            feature: "the Hadamard transform at head dims above 512 (its rows pad to 1024); use the CPU backend or no transform",
        });
    }
    // Tiles are f32 on chip whatever the storage: plan as for f32.
    let req = PlanRequest::for_shape(padded, Precision::F32, *overrides);
    let plan = plan_forward(&req, &gpu.caps())?.plan;
    let kernel = FlashForward {
        plan: crate::plan::Plan {
            storage: StorageKind::Fp8,
            ..plan
        },
        variant: gpu.variant(opts.mask(padded).is_active(), opts.softcap_value() > 0.0),
    };
    check_loop_limit(gpu, &kernel, padded, opts)?;
    Ok(kernel)
}

/// The specs of q, k and v: their scales follow each other in one buffer.
fn specs(shape: &AttentionShape, layout: &Fp8Layout) -> [Spec; 3] {
    let t = layout.transform.is_some();
    let spec = |name, shape, hadamard, scale_offset| Spec {
        name,
        shape,
        hadamard,
        row_len: layout.row_len,
        scale_offset,
    };
    let (bq, bk) = (shape.batch * shape.heads_q, shape.batch * shape.heads_kv);
    [
        spec("q", shape.q_shape(), t, 0),
        spec("k", shape.kv_shape(), t, bq),
        spec("v", shape.kv_shape(), false, bq + bk),
    ]
}

/// FP8 attention forward on host tensors (any storage precision; their
/// values are quantized): `o` f32, `lse` as always.
pub async fn forward(
    gpu: &Gpu,
    inputs: &ForwardInputs<'_>,
    opts: &AttentionOptions,
    fp8: &Fp8Options,
    overrides: &PlanOverrides,
) -> Result<ForwardOutput> {
    let (shape, layout) = Fp8Layout::checked(inputs, opts, fp8)?;
    let padded = layout.padded(&shape);
    let kernel = attention_kernel(gpu, &padded, opts, overrides)?;
    let mut call = Call::new(gpu, Some(kernel.plan));
    let specs = specs(&shape, &layout);
    let mut tensors = Vec::with_capacity(3);
    for (s, x) in specs.iter().zip([&inputs.q, &inputs.k, &inputs.v]) {
        tensors.push(upload_tensor(&mut call, s, x)?);
    }
    let transform = layout.transform.as_ref();
    let signs = signs(&mut call, transform)?;
    let n = 4 * specs.iter().map(Spec::heads).sum::<usize>() as u64;
    let absmax = call.upload("fp8 absmax", &vec![0u8; n as usize])?;
    let scales = call.storage("fp8 scales", n)?;
    let o_bytes = gpu.within_binding("o", 4 * padded.q_len() as u64)?;
    let (o, lse) = (
        call.storage("o", o_bytes)?,
        call.storage("lse", 4 * shape.lse_len() as u64)?,
    );
    let norm = transform.map_or(1.0, |t| t.norm);
    let mut all = Vec::new();
    for (s, (x, codes)) in specs.iter().zip(&tensors) {
        let bufs = QuantBuffers {
            x: x.as_entire_buffer_binding(),
            signs: &signs,
            absmax: &absmax,
            scales: &scales,
            codes: codes.as_entire_buffer_binding(),
            aliased: false,
        };
        let (ds, accesses) = quant_dispatches(gpu, s, norm, &bufs)?;
        call.stats.accesses += accesses;
        all.extend(ds);
    }
    let bufs = AttentionBindings::whole(&AttentionBuffers {
        q: &tensors[0].1,
        k: &tensors[1].1,
        v: &tensors[2].1,
        o: &o,
        lse: &lse,
    });
    let (mut attention, accesses) =
        dispatches(gpu, &kernel, &padded, &layout.options(opts), &bufs)?;
    attention
        .iter_mut()
        .for_each(|d| d.buffers.extend(whole([(binding::FP8_SCALES, &scales)])));
    call.stats.accesses += accesses;
    all.extend(attention);
    call.run(&all).await?;
    let lse_bytes = 4 * shape.lse_len() as u64;
    let mut data = call.read(&[(&o, o_bytes), (&lse, lse_bytes)]).await?;
    let lse = bytemuck::pod_collect_to_vec(&data.pop().unwrap_or_default());
    let o: Vec<f32> = bytemuck::pod_collect_to_vec(&data.pop().unwrap_or_default());
    let o = TensorData::F32(layout.trim(&o[..padded.q_len()]));
    Ok(ForwardOutput::new(shape, o, lse, call.finish()))
}

/// Where an encoded FP8 forward's scratch keeps its pieces: the codes of q,
/// k and v, then the output in rows `row_len` long where those are longer
/// than the head dim (else the kernel writes the app's o directly), each
/// at an offset the device binds.
pub struct Scratch {
    /// `(offset, bytes)` of the q, k, v codes and the padded output (0
    /// bytes where there is none).
    pub parts: [(u64, u64); 4],
    /// Bytes in all.
    pub total: u64,
}

impl Scratch {
    /// The pieces of `shape`'s FP8 forward under `fp8` on `gpu`.
    pub fn new(gpu: &Gpu, shape: &AttentionShape, fp8: &Fp8Options) -> Self {
        let layout = Fp8Layout::new(shape.head_dim, fp8);
        let align = gpu.limits.min_storage_buffer_offset_alignment as u64;
        let [q, k, v] = specs(shape, &layout).map(|s| s.code_bytes());
        let padded = layout.row_len != shape.head_dim;
        let o = if padded {
            4 * layout.padded(shape).q_len() as u64
        } else {
            0
        };
        let mut parts = [(0, 0); 4];
        let mut next = 0;
        for (part, bytes) in parts.iter_mut().zip([q, k, v, o]) {
            *part = (next, bytes);
            next = (next + bytes).next_multiple_of(align);
        }
        let ends = parts.iter().filter(|(_, n)| *n > 0).map(|(at, n)| at + n);
        let total = ends.max().unwrap_or(0);
        Self { parts, total }
    }

    /// Whether the output goes through the scratch (rows padded).
    fn padded(&self) -> bool {
        self.parts[3].1 > 0
    }
}

/// An encoded FP8 forward's problem (f32 inputs, options it takes) and
/// the app's ranges checked (as [`bindings::check`], the scratch as an
/// output; each piece of the scratch within one binding): whether its
/// kernels run in their aliased form — an output or the scratch in an
/// input's buffer, or a caller's scratch read and written in one dispatch
/// (the codes and a padded output, or the codes and the app's o or lse in
/// one buffer).
fn check_encoded(
    gpu: &Gpu,
    b: &AttentionBindings,
    scratch: Option<&wgpu::BufferBinding>,
    problem: &Problem,
    parts: &Scratch,
) -> Result<bool> {
    if problem.precision != Precision::F32 {
        return Err(Error::Unsupported {
            what: "an encoded FP8 forward",
            feature: "q, k and v stored other than as f32 (it quantizes f32 ranges)",
        });
    }
    let shape = &problem.shape;
    Fp8Layout::check_supported(shape, problem.opts)?;
    let names = ["fp8 codes", "fp8 codes", "fp8 codes", "o"];
    for (part, &(_, bytes)) in names.iter().zip(&parts.parts) {
        gpu.within_binding(part, bytes)?;
    }
    let t = TensorBytes::of(shape, Precision::F32)?;
    let mut ranges = Range::attention(b, &t);
    if let Some(binding) = scratch {
        ranges.push(Range::new("scratch", binding, parts.total));
    }
    let (inputs, outputs) = ranges.split_at(3);
    let aliased = bindings::check(gpu, inputs, outputs)?;
    let scratch_shared = outputs
        .get(2)
        .is_some_and(|s| parts.padded() || bindings::shares_buffer(s, &outputs[..2]));
    Ok(aliased || scratch_shared)
}

/// The FP8 forward of `problem` recorded into `encoder` on the app's
/// `bindings`: f32 q, k and v quantized there into the scratch (the
/// caller's, [`Scratch::total`] bytes, or buffers created for the call),
/// the attention over the codes, and where the stored rows are longer than
/// the head dim a copy of the output's rows cut to it into the app's o.
/// Nothing is submitted, waited on or read back; everything is checked
/// before anything is recorded (the inputs' values cannot be: a non-finite
/// one gives non-finite outputs, not `NonFiniteInput`).
pub async fn encode(
    gpu: &Gpu,
    encoder: &mut wgpu::CommandEncoder,
    b: &AttentionBindings<'_>,
    scratch: Option<&wgpu::BufferBinding<'_>>,
    problem: &Problem<'_>,
    fp8: &Fp8Options,
    overrides: &PlanOverrides,
) -> Result<Plan> {
    let (shape, opts) = (problem.shape, problem.opts);
    let parts = Scratch::new(gpu, &shape, fp8);
    let aliased = check_encoded(gpu, b, scratch, problem, &parts)?;
    let layout = Fp8Layout::new(shape.head_dim, fp8);
    let padded = layout.padded(&shape);
    let mut kernel = attention_kernel(gpu, &padded, opts, overrides)?;
    kernel.variant.aliased = aliased;
    // Without a caller's scratch, a buffer per piece: nothing is read and
    // written in one buffer, so the ordinary kernels run.
    let own: Vec<wgpu::Buffer> = match scratch {
        Some(_) => Vec::new(),
        None => parts.parts.map(|(_, n)| gpu.zeroed_buffer(n)).into(),
    };
    let part = |i: usize| match scratch {
        Some(s) => wgpu::BufferBinding {
            buffer: s.buffer,
            offset: s.offset + parts.parts[i].0,
            size: wgpu::BufferSize::new(parts.parts[i].1),
        },
        None => own[i].as_entire_buffer_binding(),
    };
    let transform = layout.transform.as_ref();
    let signs = transform.map_or(vec![1.0f32], |t| t.signs.clone());
    let signs = gpu.buffer_with(bytemuck::cast_slice(&signs));
    let specs = specs(&shape, &layout);
    let n = 4 * specs.iter().map(Spec::heads).sum::<usize>() as u64;
    let (absmax, scales) = (gpu.zeroed_buffer(n), gpu.zeroed_buffer(n));
    let norm = transform.map_or(1.0, |t| t.norm);
    let mut all = Vec::new();
    for (i, (s, x)) in specs.iter().zip([&b.q, &b.k, &b.v]).enumerate() {
        let bufs = QuantBuffers {
            x: x.clone(),
            signs: &signs,
            absmax: &absmax,
            scales: &scales,
            codes: part(i),
            aliased,
        };
        all.extend(quant_dispatches(gpu, s, norm, &bufs)?.0);
    }
    let o = if parts.padded() { part(3) } else { b.o.clone() };
    let bufs = AttentionBindings {
        q: part(0),
        k: part(1),
        v: part(2),
        o: o.clone(),
        lse: b.lse.clone(),
    };
    let (mut attention, _) = dispatches(gpu, &kernel, &padded, &layout.options(opts), &bufs)?;
    attention
        .iter_mut()
        .for_each(|d| d.buffers.extend(whole([(binding::FP8_SCALES, &scales)])));
    all.extend(attention);
    if parts.padded() {
        let rows = [layout.row_len, shape.head_dim];
        all.push(trim_dispatch(
            gpu,
            shape.o_len(),
            rows,
            o,
            b.o.clone(),
            aliased,
        )?);
    }
    record(gpu, encoder, &all).await?;
    Ok(kernel.plan)
}

/// The row copy of `len` elements from rows `src_row` long in `from` into
/// rows `dst_row` long in `to`, its grid wrapped from x into y at the
/// device's limit.
fn trim_dispatch<'a>(
    gpu: &Gpu,
    len: usize,
    [src_row, dst_row]: [usize; 2],
    from: wgpu::BufferBinding<'a>,
    to: wgpu::BufferBinding<'a>,
    aliased: bool,
) -> Result<Dispatch<'a>> {
    let groups = BufferCopy::groups(len as u64);
    let max = gpu.max_groups() as u64;
    let x = groups.clamp(1, max);
    let y = groups.div_ceil(x).max(1);
    if y > max {
        return Err(Error::GridTooLarge {
            what: "the FP8 output's row copy",
            groups: y,
            max: gpu.max_groups(),
        });
    }
    let params = CopyParams {
        len: to_u32("o elements", len)?,
        groups_x: x as u32,
        src_row: to_u32("FP8 row length", src_row)?,
        dst_row: to_u32("head_dim", dst_row)?,
    };
    let kernel = BufferCopy {
        variant: Variant {
            aliased,
            ..gpu.variant(false, false)
        },
        rows: true,
    };
    Ok(Dispatch {
        kernel: kernel.into(),
        uniforms: vec![(binding::COPY, bytemuck::bytes_of(&params).to_vec())],
        buffers: vec![(binding::COPY_SRC, from), (binding::COPY_DST, to)],
        grid: [x as u32, y as u32, 1],
        walk: None,
    })
}

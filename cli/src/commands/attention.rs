//! `flashattn forward` and `flashattn backward` on `.npy` files. Everything
//! is validated before any device work, and outputs are written only when
//! every one of them succeeded.

use super::layouts::{self, LayoutFlags};
use super::parse_window;
use crate::args::{AttentionArgs, BackwardArgs, ForwardArgs, ScoreArgs};
use crate::error::{CliError, Result};
use crate::npy;
use crate::outputs;
use flashattn::tune::cache::overrides_text;
use flashattn::{
    AttentionOptions, AttentionShape, Backend, BackendKind, BackwardInputs, ForwardInputs,
    Fp8Options, Operation, Pass, PlanOverrides, Precision, Tensor, TensorData, TensorView,
    TuneCache, Workload,
};

/// Everything an attention command needs, validated before any device work.
pub struct Prepared {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    /// The dtype of the input files (outputs keep it).
    pub input_dtype: Precision,
    pub opts: AttentionOptions,
    /// `--precision fp8`: q, k, v as read, quantized by the backend.
    pub fp8: Option<Fp8Options>,
    pub overrides: PlanOverrides,
    pub backend: BackendKind,
    /// `--tuned`: where the wgpu engine looks up tuned plans.
    pub tuned: Option<TuneCache>,
    /// `--kernel` with `--backend cuda`: the CUDA kernel path.
    pub cuda_kernel: Option<String>,
    /// `--arch` (`--backend cuda` only): the architecture compiled for.
    pub cuda_arch: Option<String>,
    /// The wgpu plan flags given (`--block-q`, `--kernel`, `--tuned`, ...):
    /// with `--backend auto` they make it wgpu, the backend they apply to.
    pub wgpu_flags: Vec<&'static str>,
}

impl Prepared {
    fn views(&self) -> Result<[TensorView<'_>; 3]> {
        Ok([self.q.view()?, self.k.view()?, self.v.view()?])
    }

    /// What `auto` chooses a backend for (FP8 is timed as f32, its tiles).
    fn workload(&self, backward: bool) -> Result<Workload> {
        let [q, k, v] = self.views()?;
        let precision = match self.fp8 {
            Some(_) => Precision::F32,
            None => self.q.precision(),
        };
        Ok(Workload::new(
            AttentionShape::from_views(&q, &k, &v)?,
            precision,
            self.opts.clone(),
        )
        .backward(backward)
        .operation(match self.fp8 {
            Some(_) => Operation::Fp8,
            None => Operation::Attention,
        }))
    }
}

/// `t` in precision `to`.
pub fn convert(t: Tensor, to: Precision) -> Tensor {
    if t.precision() == to {
        return t;
    }
    Tensor {
        data: TensorData::from_f32(t.to_f32(), to),
        shape: t.shape,
    }
}

/// An output for a file whose inputs had `input_dtype`: outputs keep the
/// inputs' dtype, except bf16 results, which numpy cannot hold: they stay
/// bf16 and are written as f32 (exactly the bf16 values, docs/semantics.md).
pub fn output(t: Tensor, input_dtype: Precision) -> Tensor {
    if t.precision() == Precision::Bf16 {
        return t;
    }
    convert(t, input_dtype)
}

/// Parse the flags and read q, k, v (and the layout flags' files).
pub fn prepare(a: &AttentionArgs) -> Result<Prepared> {
    let Flags {
        opts,
        precision,
        fp8,
        backend,
        layouts: layout_flags,
    } = flags(&a.score)?;
    let opts = dropout(a, opts)?;
    // With --backend cuda, --kernel names the CUDA kernel path (checked
    // when the backend opens); otherwise a WGSL kernel family.
    let cuda_kernel = a.kernel.clone().filter(|_| backend == BackendKind::Cuda);
    let mut overrides = PlanOverrides::default();
    overrides.br = a.block_q;
    overrides.bc = a.block_k;
    overrides.kernel = match cuda_kernel {
        Some(_) => None,
        None => a.kernel.as_deref().map(str::parse).transpose()?,
    };
    overrides.rows_per_thread = a.registers.rows_per_thread;
    overrides.subgroup_reduce = a.registers.subgroup_reduce;
    overrides.double_buffer = a.registers.double_buffer;
    let wgpu_flags: Vec<&'static str> = [
        ("--block-q", a.block_q.is_some()),
        ("--block-k", a.block_k.is_some()),
        ("--kernel", a.kernel.is_some() && cuda_kernel.is_none()),
        ("--rows-per-thread", a.registers.rows_per_thread.is_some()),
        ("--subgroup-reduce", a.registers.subgroup_reduce.is_some()),
        ("--double-buffer", a.registers.double_buffer.is_some()),
        ("--tuned", a.tuned),
    ]
    .into_iter()
    .filter_map(|(flag, given)| given.then_some(flag))
    .collect();
    let tuned = a.block_q.is_some()
        || a.block_k.is_some()
        || a.kernel.is_some()
        || a.registers.any()
        || a.tuned;
    if backend == BackendKind::Cpu && tuned {
        return Err(CliError::WgpuOnly {
            flags: "--block-q, --block-k, --kernel, --rows-per-thread, --subgroup-reduce, --double-buffer and --tuned",
        });
    }
    if a.tuned && fp8.is_some() {
        return Err(CliError::BadFlag {
            flag: "--tuned",
            expected: "f32, f16 or bf16 (the FP8 forward has no tuned plans)",
            value: "--precision fp8".into(),
        });
    }
    let [q, k, v] =
        [("q", &a.q), ("k", &a.k), ("v", &a.v)].map(|(what, path)| npy::read(what, path));
    let (q, k, v) = (q?, k?, v?);
    let (rank, expected) = match layout_flags.packed {
        true => (3, "3 dims (total, heads, head_dim) with --cu-seqlens-q/-k"),
        false => (4, "4 dims (batch, seqlen, heads, head_dim)"),
    };
    for (what, t) in [("q", &q), ("k", &k), ("v", &v)] {
        if t.shape.len() != rank {
            return Err(CliError::Rank {
                what,
                rank: t.shape.len(),
                shape: t.shape.clone(),
                expected,
            });
        }
    }
    let shape = AttentionShape::from_views(&q.view()?, &k.view()?, &v.view()?)?;
    let opts = layouts::read(&a.score, layout_flags, opts)?;
    opts.validate_for(&shape)?;
    let input_dtype = q.precision();
    let to = precision.unwrap_or(input_dtype);
    Ok(Prepared {
        q: convert(q, to),
        k: convert(k, to),
        v: convert(v, to),
        input_dtype,
        opts,
        fp8,
        overrides,
        backend,
        tuned: if a.tuned {
            TuneCache::default_location()
        } else {
            None
        },
        cuda_kernel,
        cuda_arch: cuda_arch(a, backend)?,
        wgpu_flags,
    })
}

/// `--dropout`, `--seed` and `--dropout-offset` on `opts`, checked before
/// any file is read (a backend without dropout kernels refuses when it
/// opens or runs, before any output is written).
fn dropout(a: &AttentionArgs, mut opts: AttentionOptions) -> Result<AttentionOptions> {
    if let Some(p) = a.dropout {
        opts = opts.dropout(p);
    }
    if let Some(seed) = a.seed {
        opts = opts.dropout_seed(seed);
    }
    if let Some(offset) = a.dropout_offset {
        opts = opts.dropout_offset(offset);
    }
    opts.validate()?;
    Ok(opts)
}

/// `--arch`, checked before any file is read: `--backend cuda` only, a
/// name NVRTC takes.
fn cuda_arch(a: &AttentionArgs, backend: BackendKind) -> Result<Option<String>> {
    let Some(arch) = &a.arch else { return Ok(None) };
    if backend != BackendKind::Cuda {
        return Err(CliError::CudaOnly { flag: "--arch" });
    }
    #[cfg(feature = "cuda")]
    arch.parse::<flashattn::cuda::Arch>()?;
    Ok(Some(arch.clone()))
}

/// The flags every attention command shares, parsed and checked.
pub struct Flags {
    /// The options of the flags (the layout files not yet read).
    pub opts: AttentionOptions,
    /// `--precision`, if given and a storage precision.
    pub precision: Option<Precision>,
    /// `--precision fp8` (with `--hadamard`: its default seed).
    pub fp8: Option<Fp8Options>,
    pub backend: BackendKind,
    pub layouts: LayoutFlags,
}

/// Parse and check the score, mask, precision and backend flags (before
/// any file is read).
pub fn flags(a: &ScoreArgs) -> Result<Flags> {
    let backend: BackendKind = a.backend.parse()?;
    let fp8 = (a.precision.as_deref() == Some("fp8")).then(|| match a.hadamard {
        true => Fp8Options::hadamard(Fp8Options::DEFAULT_SEED),
        false => Fp8Options::default(),
    });
    if a.hadamard && fp8.is_none() {
        return Err(CliError::HadamardWithoutFp8);
    }
    let precision: Option<Precision> = match fp8 {
        Some(_) => None,
        // The library's error lists its storage precisions; these commands
        // also take fp8.
        None => a
            .precision
            .as_deref()
            .map(|p| {
                p.parse().map_err(|_| CliError::BadFlag {
                    flag: "--precision",
                    expected: "f32, f16, bf16 or fp8",
                    value: p.to_string(),
                })
            })
            .transpose()?,
    };
    let window = a.window.as_deref().map(parse_window).transpose()?;
    let mut opts = AttentionOptions::default().causal(a.causal);
    opts.window = window.unwrap_or_default();
    opts.softcap = a.softcap;
    opts.scale = a.scale;
    opts.validate()?;
    let layouts = layouts::flags(a)?;
    if backend == BackendKind::Cuda {
        // Fail before reading anything: no CUDA backend in this binary, or
        // no driver or NVRTC to run it.
        #[cfg(not(feature = "cuda"))]
        return Err(flashattn::Error::BackendNotBuilt { backend: "cuda" }.into());
        #[cfg(feature = "cuda")]
        flashattn::cuda::context::libraries_present()?;
    }
    Ok(Flags {
        opts,
        precision,
        fp8,
        backend,
        layouts,
    })
}

/// Open `kind` (for `auto`: the backend faster for `workload`), saying on
/// stderr which one auto chose and why.
pub fn open(kind: BackendKind, workload: &Workload) -> Result<Backend> {
    let choice = Backend::open(kind, workload)?;
    if kind == BackendKind::Auto {
        eprintln!("flashattn: {}", choice.reason);
    }
    Ok(choice.backend)
}

/// "--kernel applies to the wgpu backend only", "--block-q and --block-k
/// apply ...", "--block-q, --kernel and --tuned apply ...".
fn wgpu_only(flags: &[&str]) -> String {
    let (verb, list) = match flags {
        [one] => ("applies", one.to_string()),
        [init @ .., last] => ("apply", format!("{} and {last}", init.join(", "))),
        [] => ("apply", "no flags".into()),
    };
    format!("{list} {verb} to the wgpu backend only")
}

/// Open the backend, saying on stderr which one and why.
pub fn open_backend(p: &Prepared, backward: bool) -> Result<Backend> {
    let backend = match (p.backend, p.wgpu_flags.as_slice()) {
        // Plan flags name wgpu's kernels: auto takes wgpu rather than drop
        // them (or refuse them) on the backend it would have timed faster.
        (BackendKind::Auto, [_, ..]) => {
            let choice = Backend::open(BackendKind::Wgpu, &p.workload(backward)?)?;
            if let Backend::Wgpu(e) = &choice.backend {
                eprintln!(
                    "flashattn: wgpu on {}, as {}",
                    e.describe(),
                    wgpu_only(&p.wgpu_flags)
                );
            }
            choice.backend
        }
        _ => open(p.backend, &p.workload(backward)?)?,
    };
    #[cfg(feature = "cuda")]
    let backend = match (backend, &p.cuda_kernel) {
        (flashattn::Backend::Cuda(c), Some(path)) => {
            flashattn::Backend::Cuda(Box::new(c.with_kernels(path.parse()?)))
        }
        (b, _) => b,
    };
    #[cfg(feature = "cuda")]
    let backend = match (backend, &p.cuda_arch) {
        (flashattn::Backend::Cuda(c), Some(arch)) => {
            flashattn::Backend::Cuda(Box::new(c.with_arch(arch.parse()?)?))
        }
        (b, _) => b,
    };
    let tiles = p.overrides.br.is_some() || p.overrides.bc.is_some();
    if !matches!(backend, Backend::Wgpu(_)) && tiles {
        return Err(CliError::WgpuOnly {
            flags: "--block-q and --block-k",
        });
    }
    Ok(match (backend, p.tuned.clone()) {
        (Backend::Wgpu(e), Some(cache)) => {
            let e = e.with_tuned_plans(cache.clone());
            say_tuned(&e, p, &cache, backward)?;
            Backend::Wgpu(Box::new(e))
        }
        (backend, _) => backend,
    })
}

/// Say on stderr which plan `--tuned` found for each pass that runs.
fn say_tuned(e: &flashattn::Engine, p: &Prepared, cache: &TuneCache, backward: bool) -> Result<()> {
    let [q, k, v] = p.views()?;
    let shape = AttentionShape::from_views(&q, &k, &v)?;
    let passes: &[Pass] = match backward {
        true => &[Pass::Forward, Pass::Backward],
        false => &[Pass::Forward],
    };
    for &pass in passes {
        let found = e.tuned_overrides(pass, &shape, p.q.precision(), &p.opts);
        let what = found.map_or("none: the formula plan".into(), |o| overrides_text(&o));
        let path = cache.path().display();
        eprintln!("flashattn: tuned {} plan ({path}): {what}", pass.name());
    }
    Ok(())
}

/// The verdict of the kernel family a call ran, on stderr (`verification:
/// lanes forward f32: verified`, or which family failed and what ran).
pub fn say_verified(stats: &flashattn::CallStats) {
    if let Some(v) = &stats.verification {
        eprintln!("verification: {v}");
    }
}

pub fn forward(a: ForwardArgs) -> Result<()> {
    outputs::check(&outputs::given(&[
        ("--out", Some(&a.out)),
        ("--lse", a.lse.as_ref()),
        ("--dropout-mask-out", a.dropout_mask_out.as_ref()),
    ]))?;
    let p = prepare(&a.attention)?;
    // The mask depends on the shape and flags alone: drawn first, so that
    // one too large for this host fails before the forward runs.
    let mask = match &a.dropout_mask_out {
        Some(_) => {
            let [q, k, v] = p.views()?;
            let shape = AttentionShape::from_views(&q, &k, &v)?;
            Some(flashattn::dropout_mask(&shape, &p.opts)?)
        }
        None => None,
    };
    let backend = open_backend(&p, false)?;
    let [q, k, v] = p.views()?;
    let out = match &p.fp8 {
        Some(fp8) => {
            backend.forward_fp8(&ForwardInputs::new(q, k, v), &p.opts, fp8, &p.overrides)?
        }
        None => backend.forward(&ForwardInputs::new(q, k, v), &p.opts, &p.overrides)?,
    };
    let lse = out.lse_tensor();
    // FP8's o is f32 (docs/semantics.md), whatever the files held.
    let o = match p.fp8 {
        Some(_) => out.o,
        None => output(out.o, p.input_dtype),
    };
    let mut files: Vec<outputs::Output> = vec![("--out", &a.out, npy::encode(&o))];
    if let Some(path) = &a.lse {
        files.push(("--lse", path, npy::encode(&lse)));
    }
    if let (Some(path), Some(mask)) = (&a.dropout_mask_out, &mask) {
        let bytes = npy::encode_bool(&mask.dims, &mask.keep);
        files.push(("--dropout-mask-out", path, bytes));
    }
    outputs::write(files)?;
    // Said once the outputs are written: a failed command prints one line.
    say_verified(&out.stats);
    Ok(())
}

pub fn backward(a: BackwardArgs) -> Result<()> {
    if a.dsinks.is_some() && a.attention.score.sinks.is_none() {
        return Err(CliError::Needs {
            given: "--dsinks",
            needs: "--sinks",
        });
    }
    outputs::check(&outputs::given(&[
        ("--dq", Some(&a.dq)),
        ("--dk", Some(&a.dk)),
        ("--dv", Some(&a.dv)),
        ("--dsinks", a.dsinks.as_ref()),
    ]))?;
    let p = prepare(&a.attention)?;
    if p.fp8.is_some() {
        let operation = "the backward pass";
        return Err(flashattn::Error::Fp8Unsupported { operation }.into());
    }
    let d_o = npy::read("do", &a.d_o)?;
    // do has o's shape: q's, with v's head dim.
    let mut o_shape = p.q.shape.clone();
    if let (Some(last), Some(dv)) = (o_shape.last_mut(), p.v.shape.last()) {
        *last = *dv;
    }
    if d_o.shape != o_shape {
        return Err(flashattn::Error::ShapeMismatch {
            tensor: "do",
            shape: d_o.shape,
            like: "o",
            expected: o_shape,
        }
        .into());
    }
    if d_o.precision() != p.input_dtype {
        return Err(flashattn::Error::DtypeMismatch {
            tensor: "do",
            dtype: d_o.precision().name(),
            like: "q",
            expected: p.input_dtype.name(),
        }
        .into());
    }
    let d_o = convert(d_o, p.q.precision());
    let backend = open_backend(&p, true)?;
    let [q, k, v] = p.views()?;
    let fwd = backend.forward(&ForwardInputs::new(q, k, v), &p.opts, &p.overrides)?;
    let inputs = BackwardInputs::new(ForwardInputs::new(q, k, v), &fwd, d_o.view()?)?;
    let grads = backend.backward(&inputs, &p.opts, &p.overrides)?;
    let [dq, dk, dv] = [grads.dq, grads.dk, grads.dv].map(|t| output(t, p.input_dtype));
    let mut files: Vec<outputs::Output> = vec![
        ("--dq", &a.dq, npy::encode(&dq)),
        ("--dk", &a.dk, npy::encode(&dk)),
        ("--dv", &a.dv, npy::encode(&dv)),
    ];
    if let (Some(path), Some(d)) = (&a.dsinks, &grads.dsinks) {
        files.push(("--dsinks", path, npy::encode_array(&[d.len() as u64], d)));
    }
    outputs::write(files)?;
    // Said once the outputs are written: a failed command prints one line.
    say_verified(&fwd.stats);
    say_verified(&grads.stats);
    Ok(())
}

//! The `flashattn` command line: parsing lives in `args`, file I/O in `npy`,
//! one function per subcommand here and in `demo`.

pub mod args;
mod bench;
mod demo;
pub mod npy;
mod plots;

use args::{AttentionArgs, BackwardArgs, Command, ForwardArgs, PlanArgs};
use flashattn::{
    AttentionOptions, AttentionShape, Backend, BackendKind, Engine, Error, PlanOverrides,
    PlanRequest, Precision, Result, Tensor, TensorData, Window,
};

pub fn run(command: Command) -> Result<()> {
    match command {
        Command::Forward(a) => forward(a),
        Command::Backward(a) => backward(a),
        Command::Plan(a) => plan(a),
        Command::Demo(a) => demo::run(a),
        Command::Bench(a) => bench::run(a),
    }
}

/// Parse `L,R` (each an integer, negative = unbounded).
pub fn parse_window(s: &str) -> Result<Window> {
    let bad = || {
        Error::Option(format!(
            "--window expects LEFT,RIGHT such as 8,0 or -1,10; got `{s}`"
        ))
    };
    let (l, r) = s.split_once(',').ok_or_else(bad)?;
    let l: i64 = l.trim().parse().map_err(|_| bad())?;
    let r: i64 = r.trim().parse().map_err(|_| bad())?;
    Ok(Window::from_signed(l, r))
}

/// Everything an attention command needs, validated before any device work.
pub struct Prepared {
    pub q: Tensor,
    pub k: Tensor,
    pub v: Tensor,
    /// The dtype of the input files (outputs keep it).
    pub input_dtype: Precision,
    pub opts: AttentionOptions,
    pub overrides: PlanOverrides,
    pub backend: BackendKind,
}

fn convert(t: Tensor, to: Precision) -> Tensor {
    if t.precision() == to {
        return t;
    }
    Tensor {
        data: TensorData::from_f32(t.to_f32(), to),
        shape: t.shape,
    }
}

pub fn prepare(a: &AttentionArgs) -> Result<Prepared> {
    let backend: BackendKind = a.backend.parse()?;
    let precision: Option<Precision> = a.precision.as_deref().map(str::parse).transpose()?;
    let opts = AttentionOptions {
        causal: a.causal,
        window: a
            .window
            .as_deref()
            .map(parse_window)
            .transpose()?
            .unwrap_or_default(),
        softcap: a.softcap,
        scale: a.scale,
    };
    opts.validate()?;
    let overrides = PlanOverrides {
        br: a.block_q,
        bc: a.block_k,
        kernel: a.kernel.as_deref().map(str::parse).transpose()?,
        ..Default::default()
    };
    if backend == BackendKind::Cpu
        && (a.block_q.is_some() || a.block_k.is_some() || a.kernel.is_some())
    {
        return Err(Error::Unsupported(
            "--block-q, --block-k and --kernel apply to the wgpu backend only".into(),
        ));
    }
    if backend == BackendKind::Cuda {
        // Fail before reading anything: this binary has no CUDA backend.
        Backend::open(backend)?;
    }
    let q = npy::read("q", &a.q)?;
    let k = npy::read("k", &a.k)?;
    let v = npy::read("v", &a.v)?;
    for (name, t) in [("q", &q), ("k", &k), ("v", &v)] {
        if t.shape.len() != 4 {
            return Err(Error::Shape(format!(
                "{name} has rank {} (shape {:?}); expected 4 dims (batch, seqlen, heads, head_dim)",
                t.shape.len(),
                t.shape
            )));
        }
    }
    AttentionShape::from_views(&q.view()?, &k.view()?, &v.view()?)?;
    let input_dtype = q.precision();
    let to = precision.unwrap_or(input_dtype);
    Ok(Prepared {
        q: convert(q, to),
        k: convert(k, to),
        v: convert(v, to),
        input_dtype,
        opts,
        overrides,
        backend,
    })
}

/// Open the backend, saying on stderr which one `auto` picked.
pub fn open_backend(kind: BackendKind, overrides: &PlanOverrides) -> Result<Backend> {
    let (backend, notice) = Backend::open(kind)?;
    if let Some(n) = notice {
        eprintln!("flashattn: {n}");
    }
    if matches!(backend, Backend::Cpu) && (overrides.br.is_some() || overrides.bc.is_some()) {
        return Err(Error::Unsupported(
            "--block-q and --block-k apply to the wgpu backend only".into(),
        ));
    }
    Ok(backend)
}

fn forward(a: ForwardArgs) -> Result<()> {
    let p = prepare(&a.attention)?;
    let backend = open_backend(p.backend, &p.overrides)?;
    let out = backend.forward(
        &p.q.view()?,
        &p.k.view()?,
        &p.v.view()?,
        &p.opts,
        &p.overrides,
    )?;
    let o = convert(out.o.clone(), p.input_dtype);
    let lse = out.lse_tensor();
    let mut outputs = vec![(a.out.as_path(), &o)];
    if let Some(path) = &a.lse {
        outputs.push((path.as_path(), &lse));
    }
    npy::write_all(&outputs)
}

fn backward(a: BackwardArgs) -> Result<()> {
    let p = prepare(&a.attention)?;
    let d_o = npy::read("do", &a.d_o)?;
    if d_o.shape != p.q.shape {
        return Err(Error::Shape(format!(
            "do has shape {:?}, expected q's shape {:?}",
            d_o.shape, p.q.shape
        )));
    }
    if d_o.precision() != p.input_dtype {
        return Err(Error::Dtype(format!(
            "do is {} but q is {}",
            d_o.precision(),
            p.input_dtype
        )));
    }
    let d_o = convert(d_o, p.q.precision());
    let backend = open_backend(p.backend, &p.overrides)?;
    let (q, k, v) = (p.q.view()?, p.k.view()?, p.v.view()?);
    let fwd = backend.forward(&q, &k, &v, &p.opts, &p.overrides)?;
    let grads = backend.backward(
        &q,
        &k,
        &v,
        &fwd.o.view()?,
        &fwd.lse,
        &d_o.view()?,
        &p.opts,
        &p.overrides,
    )?;
    let [dq, dk, dv] = [grads.dq, grads.dk, grads.dv].map(|t| convert(t, p.input_dtype));
    npy::write_all(&[
        (a.dq.as_path(), &dq),
        (a.dk.as_path(), &dk),
        (a.dv.as_path(), &dv),
    ])
}

fn plan(a: PlanArgs) -> Result<()> {
    let precision: Precision = a.precision.parse()?;
    if let Some(d) = a.head_dim {
        AttentionShape::new(1, 1, 1, 1, 1, d)?;
    }
    let engine = Engine::new()?;
    let mut engine_caps = engine.caps();
    if let Some(m) = a.max_workgroup_storage {
        if m > engine_caps.max_workgroup_storage {
            return Err(Error::Plan(format!(
                "--max-workgroup-storage {m} exceeds the device's {} bytes",
                engine_caps.max_workgroup_storage
            )));
        }
        engine_caps.max_workgroup_storage = m;
    }
    let l = engine.limits();
    println!("adapter: {}", engine.describe());
    println!("limits:");
    println!(
        "  max_compute_workgroup_storage_size  {} bytes (M)",
        l.max_compute_workgroup_storage_size
    );
    println!(
        "  max_compute_invocations_per_workgroup  {}",
        l.max_compute_invocations_per_workgroup
    );
    println!(
        "  max_compute_workgroup_size_x  {}",
        l.max_compute_workgroup_size_x
    );
    println!(
        "  max_compute_workgroups_per_dimension  {}",
        l.max_compute_workgroups_per_dimension
    );
    println!(
        "  max_storage_buffer_binding_size  {} bytes",
        l.max_storage_buffer_binding_size
    );
    println!("  max_buffer_size  {} bytes", l.max_buffer_size);
    println!(
        "  SHADER_F16  {}",
        engine.features().contains(wgpu::Features::SHADER_F16)
    );
    let dims = a.head_dim.map_or(vec![32, 64, 128, 256], |d| vec![d]);
    for d in dims {
        let req = PlanRequest::new(d, precision);
        let forward = flashattn::plan_forward(&req, &engine_caps)?;
        println!("\nhead_dim {d}, {precision}, forward:");
        for line in forward.to_string().lines() {
            println!("  {line}");
        }
        // The backward needs more workgroup storage; a device may run only the forward.
        println!("head_dim {d}, {precision}, backward:");
        match flashattn::plan_backward(&req, &engine_caps) {
            Ok(plan) => plan.to_string().lines().for_each(|l| println!("  {l}")),
            Err(e) => println!("  not possible here: {e}"),
        }
    }
    Ok(())
}

/// Check a `--plot` path before any work: SVG or PNG by extension.
pub fn plot_path_ok(path: &std::path::Path) -> Result<()> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("svg") | Some("png") => Ok(()),
        _ => Err(Error::Option(format!(
            "--plot expects a .svg or .png file name, got {}",
            path.display()
        ))),
    }
}

/// Write `text` to `path` through a temporary file, so a failure leaves nothing.
pub fn write_text(path: &std::path::Path, text: &str) -> Result<()> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temp = path.with_file_name(format!(".{name}.{}.partial", std::process::id()));
    std::fs::write(&temp, text)
        .and_then(|()| std::fs::rename(&temp, path))
        .map_err(|e| {
            let _ = std::fs::remove_file(&temp);
            Error::Io(format!("cannot write {}: {e}", path.display()))
        })
}

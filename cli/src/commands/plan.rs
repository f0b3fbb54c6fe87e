//! `flashattn plan`: the adapter, its limits, and the forward and backward
//! plans with the reason for every clamp, each with its kernel family's
//! verification verdict (the check run now where it has not run on this
//! device yet, and the fallback's plan where the family failed) and
//! followed by the plan `flashattn tune` cached for it (if any); with
//! `--decode`, the decode plan (tiles, splits and why) for one decoding
//! problem, with its verdict.

use crate::args::PlanArgs;
use crate::error::{CliError, Result};
use flashattn::plan::{plan_backward, plan_forward, PlanRequest, StorageKind};
use flashattn::quant::Fp8Layout;
use flashattn::tune::cache::{overrides_text, seqlen_bucket};
use flashattn::tune::{MaskKind, TuneKey};
use flashattn::{
    AttentionOptions, AttentionShape, CacheLayout, CacheShape, DecodeProblem, DecodeStep, Engine,
    Fp8Options, Pass, PlanOverrides, Precision, TensorData, TuneCache,
};

pub fn run(a: PlanArgs) -> Result<()> {
    // fp8 keeps its tiles in f32 (docs/semantics.md): its plans are f32's.
    let fp8 = a.precision == "fp8";
    let precision: Precision = match fp8 {
        true => Precision::F32,
        false => a.precision.parse().map_err(|_| CliError::BadFlag {
            flag: "--precision",
            expected: "f32, f16, bf16 or fp8",
            value: a.precision.clone(),
        })?,
    };
    if let Some(d) = a.head_dim {
        AttentionShape::new(1, 1, 1, 1, 1, d)?;
    }
    if fp8 && a.decode {
        return Err(flashattn::Error::Fp8Unsupported {
            operation: "decoding",
        }
        .into());
    }
    match a.backend.as_str() {
        "wgpu" => {}
        "cuda" if fp8 => {
            return Err(CliError::BadFlag {
                flag: "--precision",
                expected: "f32, f16 or bf16 with --backend cuda",
                value: a.precision.clone(),
            })
        }
        "cuda" => return cuda(&a, precision),
        other => {
            return Err(CliError::BadFlag {
                flag: "--backend",
                expected: "wgpu or cuda",
                value: other.to_string(),
            })
        }
    }
    if a.arch.is_some() {
        return Err(CliError::CudaOnly { flag: "--arch" });
    }
    if a.device_like.is_some() {
        return Err(CliError::BadFlag {
            flag: "--device-like",
            expected: "only with --backend cuda",
            value: a.device_like.clone().unwrap_or_default(),
        });
    }
    if a.decode {
        return decode(&a, precision);
    }
    let engine = Engine::new()?;
    let mut caps = engine.caps();
    if let Some(requested) = a.max_workgroup_storage {
        storage_cap_ok(requested, caps.max_workgroup_storage)?;
        caps.max_workgroup_storage = requested;
    }
    print_device(&engine);
    print_verification_setting(&engine);
    let tuned = Tuned::new(&a, &engine, precision);
    for d in a.head_dim.map_or(vec![32, 64, 128, 256], |d| vec![d]) {
        let mut overrides = PlanOverrides::default();
        overrides.kernel = a.kernel.as_deref().map(str::parse).transpose()?;
        overrides.rows_per_thread = a.registers.rows_per_thread;
        overrides.subgroup_reduce = a.registers.subgroup_reduce;
        overrides.double_buffer = a.registers.double_buffer;
        if fp8 {
            fp8_plans(&a, &caps, d, overrides)?;
            continue;
        }
        let mut req = PlanRequest::new(d, precision).overrides(overrides);
        if let Some(n) = a.seqlen {
            AttentionShape::new(1, n, n, 1, 1, d)?;
            req = req.seqlens(n, n);
        }
        println!("\nhead_dim {d}, {precision}, forward:");
        let forward = verified(&engine, Pass::Forward, &req, a.causal);
        indent(&plan_forward(&forward, &caps)?.to_string());
        tuned.show(Pass::Forward, d);
        // The backward needs more workgroup storage; a device may run only the forward.
        println!("head_dim {d}, {precision}, backward:");
        let backward = verified(&engine, Pass::Backward, &req, a.causal);
        match plan_backward(&backward, &caps) {
            Ok(plan) => indent(&plan.to_string()),
            Err(e) => println!("  not possible here: {e}"),
        }
        tuned.show(Pass::Backward, d);
    }
    Ok(())
}

/// The FP8 forward's plan at head dim `d`: the f32 plan of its rows (q, k
/// and v stored `row_len` long, the head dim rounded up to a multiple of 4),
/// its storage e4m3 codes; and that there is no FP8 backward.
fn fp8_plans(
    a: &PlanArgs,
    caps: &flashattn::plan::DeviceCaps,
    d: usize,
    overrides: PlanOverrides,
) -> Result<()> {
    let layout = Fp8Layout::new(d, &Fp8Options::default());
    let mut req = PlanRequest::new(layout.row_len, Precision::F32).overrides(overrides);
    if let Some(n) = a.seqlen {
        AttentionShape::new(1, n, n, 1, 1, d)?;
        req = req.seqlens(n, n);
    }
    println!(
        "\nhead_dim {d}, fp8 (e4m3 codes, f32 tiles; rows of {}), forward:",
        layout.row_len
    );
    let mut forward = plan_forward(&req, caps)?;
    forward.plan.storage = StorageKind::Fp8;
    indent(&forward.to_string());
    println!("head_dim {d}, fp8, backward:");
    let none = flashattn::Error::Fp8Unsupported {
        operation: "the backward pass",
    };
    println!("  not possible: {none}");
    Ok(())
}

/// How this engine verifies kernels, and where it keeps the verdicts.
fn print_verification_setting(engine: &Engine) {
    let cache = engine
        .verdict_cache()
        .map_or("memory only".into(), |c| c.path().display().to_string());
    println!(
        "verification: {} (FLASHATTN_VERIFY); verdicts in {cache}",
        engine.verify_mode().name()
    );
}

/// Verify the family a call of `req` runs (its check run now where the
/// engine's mode says), print the verdict, and return the request as the
/// call runs it (a fallback's family forced).
fn verified(engine: &Engine, pass: Pass, req: &PlanRequest, causal: bool) -> PlanRequest {
    // Long sequences where none is given, as the plans shown assume.
    let n = if req.seqlen_q == usize::MAX {
        1 << 20
    } else {
        req.seqlen_q
    };
    let opts = AttentionOptions::default().causal(causal);
    let shape = AttentionShape::new(1, n, n, 1, 1, req.head_dim);
    let routed =
        shape.and_then(|s| engine.verify_call(pass, &s, req.precision, &opts, &req.overrides));
    match routed {
        Ok(r) => {
            if let Some(v) = &r.verification {
                println!("  verification: {v}");
            }
            req.overrides(r.overrides)
        }
        Err(e) => {
            println!("  verification: {e}");
            *req
        }
    }
}

/// What `flashattn tune` cached for the plans shown.
struct Tuned<'a> {
    engine: &'a Engine,
    cache: Option<TuneCache>,
    precision: Precision,
    mask: MaskKind,
    seqlen: Option<usize>,
}

impl<'a> Tuned<'a> {
    fn new(a: &PlanArgs, engine: &'a Engine, precision: Precision) -> Self {
        let cache = a
            .cache_dir
            .as_deref()
            .map(TuneCache::in_dir)
            .or_else(TuneCache::default_location);
        let mask = if a.causal {
            MaskKind::Causal
        } else {
            MaskKind::None
        };
        Self {
            engine,
            cache,
            precision,
            mask,
            seqlen: a.seqlen,
        }
    }

    /// The tuned plan of `pass` at head dim `d` (for `--seqlen`'s bucket,
    /// or every bucket cached), or that there is none.
    fn show(&self, pass: Pass, d: usize) {
        let Some(cache) = &self.cache else {
            println!(
                "  tuned: none (no cache directory: give --cache-dir or set FLASHATTN_CACHE_DIR)"
            );
            return;
        };
        let Ok(shape) = AttentionShape::new(1, 1, 1, 1, 1, d) else {
            return;
        };
        let key = TuneKey::new(
            self.engine.adapter_info(),
            pass,
            &shape,
            self.precision,
            self.mask,
        );
        let buckets: Vec<usize> = match self.seqlen {
            Some(n) => vec![seqlen_bucket(n, n)],
            None => (0..usize::BITS).map(|b| 1usize << b).collect(),
        };
        let mut found = false;
        for seqlen_bucket in buckets {
            let key = TuneKey {
                seqlen_bucket,
                ..key.clone()
            };
            if let Some(t) = cache.get(&key) {
                found = true;
                println!(
                    "  tuned (seqlen <= {seqlen_bucket}, {}): {} [{}] (from {})",
                    self.mask.name(),
                    t.note,
                    overrides_text(&t.overrides),
                    cache.path().display()
                );
            }
        }
        if !found {
            println!("  tuned: none — run flashattn tune");
        }
    }
}

fn storage_cap_ok(requested: u32, max: u32) -> Result<()> {
    if requested > max {
        return Err(CliError::StorageCap { requested, max });
    }
    Ok(())
}

/// The decode plan of `--batch` sequences of `--cache-len` keys each (a
/// dense cache of that capacity, nothing appended), on this adapter.
fn decode(a: &PlanArgs, precision: Precision) -> Result<()> {
    // clap requires these with --decode; the defaults never apply.
    let [hq, hk, d, n] = [a.heads_q, a.heads_kv, a.head_dim, a.cache_len].map(|x| x.unwrap_or(0));
    let (b, sq) = (a.batch, a.seqlen_q);
    AttentionShape::new(b, sq, n.max(1), hq, hk, d)?;
    let len = i32::try_from(n).map_err(|_| CliError::BadFlag {
        flag: "--cache-len",
        expected: "a length that fits in int32",
        value: n.to_string(),
    })?;
    let cache = CacheShape::new(
        CacheLayout::Dense {
            batch: b,
            capacity: n.max(1),
        },
        hk,
        d,
    )?;
    let q = TensorData::from_f32(vec![0.0; b * sq * hq * d], precision);
    let lens = vec![len; b];
    let step = DecodeStep::new(q.view([b, sq, hq, d]), &lens);
    let problem = DecodeProblem::new(&step, &cache, precision)?;
    let mut engine = Engine::new()?;
    if let Some(requested) = a.max_workgroup_storage {
        storage_cap_ok(requested, engine.caps().max_workgroup_storage)?;
        engine = engine.with_workgroup_storage_limit(requested);
    }
    print_device(&engine);
    print_verification_setting(&engine);
    let splits = (a.num_splits > 0).then_some(a.num_splits);
    println!(
        "\ndecode: batch {b}, seqlen_q {sq}, heads {hq}/{hk}, head_dim {d}, {n} keys per sequence, {precision}:"
    );
    let kernel = match engine.verify_decode(&problem) {
        Ok(routed) => {
            if let Some(v) = &routed.verification {
                println!("  verification: {v}");
            }
            routed.decode_kernel
        }
        Err(e) => {
            println!("  verification: {e}");
            None
        }
    };
    let plan = engine.plan_decode_on(&problem, &AttentionOptions::default(), splits, kernel)?;
    indent(&plan.to_string());
    Ok(())
}

fn indent(text: &str) {
    text.lines().for_each(|l| println!("  {l}"));
}

/// The adapter, the limits the planner reads, features and the loop limit.
fn print_device(engine: &Engine) {
    let l = engine.limits();
    println!("adapter: {}", engine.describe());
    println!("limits:");
    let rows: [(&str, u64, &str); 6] = [
        (
            "max_compute_workgroup_storage_size",
            l.max_compute_workgroup_storage_size.into(),
            " bytes (M)",
        ),
        (
            "max_compute_invocations_per_workgroup",
            l.max_compute_invocations_per_workgroup.into(),
            "",
        ),
        (
            "max_compute_workgroup_size_x",
            l.max_compute_workgroup_size_x.into(),
            "",
        ),
        (
            "max_compute_workgroups_per_dimension",
            l.max_compute_workgroups_per_dimension.into(),
            "",
        ),
        (
            "max_storage_buffer_binding_size",
            l.max_storage_buffer_binding_size,
            " bytes",
        ),
        ("max_buffer_size", l.max_buffer_size, " bytes"),
    ];
    for (name, value, unit) in rows {
        println!("  {name}  {value}{unit}");
    }
    let f = engine.features();
    for (name, feature) in [
        ("SHADER_F16", flashattn::wgpu::Features::SHADER_F16),
        ("SUBGROUP", flashattn::wgpu::Features::SUBGROUP),
    ] {
        println!("  {name}  {}", f.contains(feature));
    }
    match engine.loop_limit() {
        Some(n) => println!("  loop limit  {n} iterations per invocation (measured; calls are split to stay within it)"),
        None => println!("  loop limit  none (measured)"),
    }
}

/// The CUDA plans (tiles, warps, stages, shared memory and why) for each
/// head dim, causal, from device 0's properties or made-up ones.
#[cfg(feature = "cuda")]
fn cuda(a: &PlanArgs, precision: Precision) -> Result<()> {
    use flashattn::cuda::plan::{plan, DeviceProps, KernelPath, PlanProblem};
    let path: KernelPath = a.kernel.as_deref().unwrap_or("auto").parse()?;
    let mut props = match a.device_like.as_deref() {
        Some("a100") => DeviceProps::a100(),
        Some("h100") => DeviceProps::h100(),
        Some("h200") => DeviceProps::h200(),
        Some(other) => {
            return Err(CliError::BadFlag {
                flag: "--device-like",
                expected: "a100, h100 or h200",
                value: other.to_string(),
            })
        }
        None => flashattn::cuda::Cuda::new()?.props().clone(),
    };
    if let Some(arch) = &a.arch {
        let arch: flashattn::cuda::Arch = arch.parse()?;
        arch.check_runs_on(&props.name, props.major, props.minor)?;
        props.arch = arch;
    }
    println!(
        "CUDA device: {} (sm_{}{}, kernels for {}), {} SMs, {} B shared memory per SM, {} per block (opt-in)",
        props.name,
        props.major,
        props.minor,
        props.arch.name(),
        props.sms,
        props.smem_per_sm,
        props.smem_per_block_optin
    );
    for d in a.head_dim.map_or(vec![32, 64, 128, 256], |d| vec![d]) {
        let problem = PlanProblem {
            precision,
            head_dim: d,
            band: true,
            softcap: false,
            positive_scale: true,
            dropout: false,
        };
        println!("\nhead_dim {d}, {precision}, causal:");
        indent(&plan(&props, &problem, path)?.explain(&props).join("\n"));
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn cuda(_: &PlanArgs, _: Precision) -> Result<()> {
    Err(flashattn::Error::BackendNotBuilt { backend: "cuda" }.into())
}

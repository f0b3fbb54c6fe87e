//! The CUDA backend (feature `cuda`). Where no GPU is needed:
//!
//! - without libcuda, opening the backend is `Error::CudaUnavailable`
//!   naming the driver, in one line (no panic);
//! - every kernel variant ([`KernelKey::all`]) compiles with NVRTC to PTX
//!   for sm_80 and sm_90a (the Hopper kernel for sm_90a only), where
//!   libnvrtc loads; with
//!   `FLASHATTN_REQUIRE_NVRTC=1` a missing NVRTC fails instead of being waived;
//! - with `FLASHATTN_PTXAS` pointing at a `ptxas`, the f16/bf16 d 64/128
//!   forward and backward variants (every family, band and softcap, from
//!   the same compile) assemble for sm_80 and sm_90a with no register
//!   spills (registers and shared memory are printed), and the
//!   Hopper forward's for sm_90a with no spills and no wgmma serialized
//!   (and, with `FLASHATTN_NVDISASM` naming an nvdisasm, its SASS holding
//!   HGMMA, UTMALDG, UTMASTG and USETMAXREG), and the main forwards' interior loops
//!   within their instruction budget (docs/cuda.md);
//! - with `FLASHATTN_CXX` naming a C++20 compiler, kernel variants run on
//!   the CPU under cuda/emulate/ against attention in double, the GPU
//!   checks' Hopper smoke cases among them, and a deadlocked mbarrier wait
//!   is reported and trapped.
//!
//! On a device (what scripts/gpu-check.sh runs, one kernel path per process
//! with `FLASHATTN_CUDA_KERNEL`, every path in one process without it):
//! the device and its toolchain, the PTX cache warmed, the Hopper smoke
//! test, the driver's build of the main variants, tiny cases for
//! compute-sanitizer, the accuracy matrix and the layouts' cases (ALiBi,
//! sinks, block masks, packed batches, all at once), dropout's cases
//! (p = 0 bit-identical to none), bit-identical backward repeats (dsinks
//! too), decoding on host caches, latent (MLA) caches, and what stays
//! Unsupported.
//!
//! A test that cannot run here (no driver, no NVRTC, no C++ compiler) is
//! waived, not passed: it prints `WAIVED <test>: <why>` past the harness's
//! capture (and appends it to `$FLASHATTN_WAIVERS`); with
//! `FLASHATTN_REQUIRE_GPU=1` (or the CUDA script's `FLASHATTN_REQUIRE_NVRTC=1`
//! for the tools) it fails instead.
//!
//! ```text
//! python3 -m venv .cuda-venv
//! .cuda-venv/bin/pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-nvcc-cu12
//! SITE=$(.cuda-venv/bin/python -c 'import nvidia, os; print(os.path.dirname(nvidia.__path__[0]))')
//! LD_LIBRARY_PATH=$SITE/nvidia/cuda_nvrtc/lib FLASHATTN_PTXAS=$SITE/nvidia/cuda_nvcc/bin/ptxas \
//!   FLASHATTN_CXX=g++ FLASHATTN_REQUIRE_NVRTC=1 cargo test --release --features cuda --test cuda -- --nocapture
//! ```
#![cfg(feature = "cuda")]

use cudarc::nvrtc::Ptx;
use flashattn::cuda::compile::{compile_ptx_with, nvrtc_present, options_bounded};
use flashattn::cuda::jit::{build_faults, spill_bytes};
use flashattn::cuda::kernel::{Family, KernelKey, MAX_HEAD_DIM};
use flashattn::cuda::{driver_present, Cuda, KernelPath};
use flashattn::Precision;
use flashattn::{
    AttentionOptions, AttentionShape, Backend, BackendKind, Error, ForwardInputs, Operation,
    Workload,
};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;

const ARCHS: [(&str, &str); 2] = [("compute_80", "sm_80"), ("compute_90a", "sm_90a")];

/// The architectures `key` is built for: the Hopper kernel's wgmma and
/// setmaxnreg exist on sm_90a alone.
fn archs(key: &KernelKey) -> &'static [(&'static str, &'static str)] {
    if key.family.is_wgmma() {
        &ARCHS[1..]
    } else {
        &ARCHS
    }
}

/// Whether one of `vars` is `1`: the run requires what a test needs.
fn required(vars: &[&str]) -> Option<String> {
    vars.iter()
        .find(|v| std::env::var(v).is_ok_and(|x| x == "1"))
        .map(|v| v.to_string())
}

/// A test that cannot run here: a failure where one of `vars` is 1, else
/// a waiver — `WAIVED <test>: <why>` written past the harness's capture
/// (so `cargo test` shows it) and appended to `$FLASHATTN_WAIVERS`.
fn waive(vars: &[&str], why: &str) {
    if let Some(var) = required(vars) {
        panic!("{var}=1 but {why}");
    }
    let test = std::thread::current()
        .name()
        .unwrap_or("a CUDA test")
        .to_string();
    let line = format!("WAIVED {test}: {why}\n");
    let _ = std::io::stderr().write_all(line.as_bytes());
    if let Some(path) = std::env::var_os("FLASHATTN_WAIVERS") {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path);
        let _ = file.and_then(|mut f| f.write_all(line.as_bytes()));
    }
}

/// What makes a device test required: a GPU check's run.
const DEVICE_REQUIRED: &[&str] = &["FLASHATTN_REQUIRE_GPU"];
/// What makes the toolchain tests required: the CUDA scripts (and a GPU run).
const TOOLS_REQUIRED: &[&str] = &["FLASHATTN_REQUIRE_NVRTC", "FLASHATTN_REQUIRE_GPU"];

#[test]
fn without_a_driver_the_backend_is_a_typed_error_naming_it() {
    if driver_present() {
        waive(
            &[],
            "libcuda loads here: the no-driver error is not reachable",
        );
        return;
    }
    match Cuda::new() {
        Err(e @ Error::CudaUnavailable { missing }) => {
            assert!(missing.contains("libcuda"), "{missing}");
            let line = e.to_string();
            assert_eq!(line.lines().count(), 1, "{line}");
            assert!(
                line.contains("libcuda (the NVIDIA driver) not found"),
                "{line}"
            );
        }
        other => panic!("expected CudaUnavailable, got {other:?}"),
    }
}

fn workload(operation: Operation, opts: AttentionOptions) -> Workload {
    Workload::new(
        AttentionShape::new(1, 40, 40, 2, 2, 64).unwrap(),
        Precision::F16,
        opts,
    )
    .operation(operation)
}

/// `auto` takes CUDA for what its kernels run (checked without a device),
/// and says why not otherwise: without a driver, the reason names it.
#[test]
fn auto_prefers_cuda_for_what_its_kernels_take() {
    let plain = workload(
        Operation::Attention,
        AttentionOptions::default().causal(true),
    );
    flashattn::cuda::takes(&plain).unwrap();
    let alibi = AttentionOptions::default().alibi(flashattn::Alibi::standard(2));
    flashattn::cuda::takes(&workload(Operation::Attention, alibi.clone())).unwrap();
    flashattn::cuda::takes(&workload(Operation::Decode, AttentionOptions::default())).unwrap();
    flashattn::cuda::takes(&workload(Operation::Decode, alibi)).unwrap();
    let dropout = AttentionOptions::default().dropout(0.1).dropout_seed(7);
    flashattn::cuda::takes(&workload(Operation::Attention, dropout.clone())).unwrap();
    // Shard positions (ring attention's partial calls), not with dropout.
    let shard = AttentionOptions::default().causal(true).positions(64, 0);
    flashattn::cuda::takes(&workload(Operation::Attention, shard.clone())).unwrap();
    // FP8 on the Hopper forward: the band and score options (the device's
    // architecture is `Cuda::takes`'s to check).
    flashattn::cuda::takes(&workload(
        Operation::Fp8,
        AttentionOptions::default().causal(true),
    ))
    .unwrap();
    let wide_fp8 = Workload::new(
        AttentionShape::new(1, 40, 40, 2, 2, 192).unwrap(),
        Precision::F32,
        AttentionOptions::default(),
    )
    .operation(Operation::Fp8);
    assert!(matches!(
        flashattn::cuda::takes(&wide_fp8),
        Err(Error::Unsupported { .. })
    ));
    let mask = flashattn::BlockMask::new([1, 1, 1, 1], (64, 64), &[1]).unwrap();
    for (operation, opts) in [
        (Operation::Fp8, AttentionOptions::default().scale(-0.5)),
        (
            Operation::Fp8,
            AttentionOptions::default().alibi(flashattn::Alibi::standard(2)),
        ),
        (Operation::Attention, shard.dropout(0.1).dropout_seed(7)),
        (
            Operation::Decode,
            AttentionOptions::default().block_mask(mask),
        ),
        (Operation::Decode, dropout),
    ] {
        assert!(matches!(
            flashattn::cuda::takes(&workload(operation, opts)),
            Err(Error::Unsupported { .. })
        ));
    }
    let choice = Backend::open(BackendKind::Auto, &plain).unwrap();
    match Cuda::new() {
        Ok(_) => assert!(
            matches!(choice.backend, Backend::Cuda(_)),
            "{}",
            choice.reason
        ),
        Err(e) => {
            assert!(!matches!(choice.backend, Backend::Cuda(_)));
            assert!(
                choice.reason.contains(&format!("(not CUDA: {e})")),
                "{}",
                choice.reason
            );
        }
    }
}

/// NVRTC present, or a waiver (a failure in required mode).
fn nvrtc_or_waive() -> bool {
    if nvrtc_present() {
        return true;
    }
    waive(
        TOOLS_REQUIRED,
        "no NVRTC: libnvrtc does not load here (set LD_LIBRARY_PATH)",
    );
    false
}

/// The variants ptxas checks for spills (and, in the Hopper ones, for
/// serialized wgmma and an ignored setmaxnreg): f16/bf16 at d 64 and 128,
/// every family (forward and backward), every band/softcap combination;
/// decoding's widest (d 576: the most accumulators a thread holds); and
/// the scalar forward's and backward's wide variants (d 384, 512: the
/// forward's 32 columns a lane, 576: the backward's 2 × 18); the FP8
/// quantization (f32).
fn is_main(key: &KernelKey) -> bool {
    let widest = key.family == Family::Decode && key.head_dim == MAX_HEAD_DIM;
    let scalar = matches!(key.family, Family::Forward | Family::Backward);
    let wide = scalar && flashattn::cuda::kernel::WIDE_HEAD_DIMS.contains(&key.head_dim);
    let quantize = key.family == Family::Fp8Quantize;
    // The FP8 Hopper forward: e4m3 codes in, f32 out (its key's precision).
    quantize
        || (key.precision != Precision::F32 || key.is_fp8())
            && ([64, 128].contains(&key.head_dim) || widest || wide)
}

/// What ptxas (and nvdisasm, with `FLASHATTN_NVDISASM`) found wrong in one
/// main variant, if anything ([`build_faults`], the rule the driver's JIT
/// build is held to on the device); its registers and shared memory go to
/// stderr.
fn assembly_faults(ptxas_path: &PathBuf, key: &KernelKey, ptx: &Ptx, sm: &str) -> Vec<String> {
    let (regs, spills, report) = ptxas(ptxas_path, key, ptx, sm);
    eprintln!(
        "{:<40} {sm:<7} registers {regs:?}, spills {spills} B, static shared {} B, dynamic shared {} B",
        key.label(),
        key.shared_bytes(),
        key.dynamic_shared_bytes()
    );
    let mut faults: Vec<String> = build_faults(key.family, &report, spills)
        .into_iter()
        .map(|f| format!("{} {sm}: {f}", key.label()))
        .collect();
    if spills > 0 && !key.family.is_wgmma() {
        faults.push(format!("{} {sm}: spills: {report}", key.label()));
    }
    // The Hopper instructions, not a slower path.
    if key.family.is_wgmma() && std::env::var_os("FLASHATTN_NVDISASM").is_some() {
        let ops: &[&str] = if key.is_fp8() {
            // e4m3 products of k 32; o goes out from registers (no TMA store).
            &[FP8_OPS[0], FP8_OPS[1], "UTMALDG.4D", "USETMAXREG"]
        } else if key.family.is_forward() {
            &[
                "HGMMA.64x128x16.F32",
                "UTMALDG.4D",
                "UTMASTG.4D",
                "USETMAXREG",
            ]
        } else {
            // The dK/dV kernel: S^T and dP^T of 64 queries a step; no TMA store.
            &["HGMMA.64x64x16.F32", "UTMALDG.4D", "USETMAXREG"]
        };
        for &op in ops {
            if !report.contains(op) {
                faults.push(format!("{} {sm}: no {op} in its SASS", key.label()));
            }
        }
    }
    faults
}

/// The FP8 forward's products in SASS: wgmma m64n128k32 on e4m3 codes
/// (QGMMA, the 8-bit form of HGMMA), and P's paired conversion to codes.
const FP8_OPS: [&str; 2] = [
    "QGMMA.64x128x32.F32.E4M3.E4M3",
    "F2FP.SATFINITE.E4M3.F32.PACK_AB",
];

/// `f` of every job, spread over the cores (job i on thread i mod cores;
/// the results in no particular order).
fn over_cores<T: Sync, R: Send>(jobs: &[T], f: impl Fn(&T) -> R + Sync) -> Vec<R> {
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let f = &f;
                s.spawn(move || {
                    jobs.iter()
                        .skip(t)
                        .step_by(threads)
                        .map(f)
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    })
}

/// Whether `key`'s source compares `__CUDA_ARCH__` (not just tests that it
/// is defined, as a device compile does on every architecture): only such
/// a source gives sm_90a other code than sm_80.
fn branches_on_arch(key: &KernelKey) -> bool {
    let source = key.source();
    ["__CUDA_ARCH__ >", "__CUDA_ARCH__ <", "__CUDA_ARCH__ ="]
        .iter()
        .any(|test| source.contains(test))
}

/// The architectures `key` is compiled for here: both where it is a main
/// variant (ptxas checks it on each) or its source branches on the
/// architecture; else sm_80's alone, since the same source meets the same
/// front end for sm_90a (half the step's time: a compile costs about as
/// much whatever the target).
fn compiled_archs(key: &KernelKey) -> &'static [(&'static str, &'static str)] {
    let all = archs(key);
    if is_main(key) || branches_on_arch(key) {
        all
    } else {
        &all[..1]
    }
}

/// The Hopper variants also built with the GPU checks' bounded waits: one
/// per family and head dim (FP8's own), the one with every option. The
/// bound changes the mbarrier wait alone (hopper.cuh, the same code in every
/// variant), so assembling it once per kernel shows it assembles.
fn builds_bounded(key: &KernelKey) -> bool {
    key.family.is_wgmma()
        && key.band
        && key.softcap
        && (key.precision == Precision::F16 || key.is_fp8())
}

/// Every variant to PTX (NVRTC) for sm_80 and sm_90a ([`compiled_archs`];
/// the Hopper ones for sm_90a only, and some again with the GPU checks'
/// bounded waits: [`builds_bounded`]), spread over the cores; with
/// `FLASHATTN_PTXAS`, the main variants' PTX then to SASS with no spills
/// ([`is_main`]), from the same compile.
#[test]
fn every_kernel_variant_compiles_with_nvrtc_for_sm80_and_sm90a() {
    if !nvrtc_or_waive() {
        return;
    }
    let ptxas_path = std::env::var_os("FLASHATTN_PTXAS").map(PathBuf::from);
    if ptxas_path.is_none() {
        waive(
            TOOLS_REQUIRED,
            "no ptxas: FLASHATTN_PTXAS is not set (the PTX compiled, the SASS was not checked)",
        );
    }
    // FLASHATTN_VARIANTS=<text>: only the variants whose label holds it.
    let only = std::env::var("FLASHATTN_VARIANTS").ok();
    let keys: Vec<KernelKey> = KernelKey::all()
        .into_iter()
        .filter(|k| only.as_ref().is_none_or(|o| k.label().contains(o.as_str())))
        .collect();
    // Some Hopper variants a second time with their waits bounded, as the
    // GPU checks' smoke and accuracy steps build them. That build is a diagnostic:
    // the report's printf is a call, which serializes the wgmmas and spills
    // around it, so it is held to assembling only, not to the speed rules.
    let jobs: Vec<(KernelKey, &str, &str, Option<u32>)> = keys
        .iter()
        .flat_map(|k| {
            compiled_archs(k)
                .iter()
                .map(move |(arch, sm)| (*k, *arch, *sm))
        })
        .flat_map(|(k, arch, sm)| {
            let bounds = if builds_bounded(&k) {
                vec![None, Some(4000)]
            } else {
                vec![None]
            };
            bounds.into_iter().map(move |b| (k, arch, sm, b))
        })
        .collect();
    let keep = std::env::var_os("FLASHATTN_SASS_DIR").map(PathBuf::from);
    let faults: Vec<String> = over_cores(&jobs, |(key, arch, sm, bound)| {
        let options = options_bounded(key, arch, *bound);
        let compiled = compile_ptx_with(key, arch, options);
        if let (Some(dir), Ok(ptx), None) = (&keep, &compiled, bound) {
            std::fs::write(dir.join(format!("{}.{sm}.ptx", key.label())), ptx.to_src()).unwrap();
        }
        match (compiled, &ptxas_path) {
            (Err(e), _) => vec![e.to_string()],
            (Ok(ptx), Some(path)) if bound.is_some() => {
                // ptxas asserts it assembled.
                ptxas(path, key, &ptx, sm);
                Vec::new()
            }
            (Ok(ptx), Some(path)) if is_main(key) => assembly_faults(path, key, &ptx, sm),
            _ => Vec::new(),
        }
    })
    .into_iter()
    .flatten()
    .collect();
    assert!(
        faults.is_empty(),
        "{} of {} compiles failed or spilled:\n{}",
        faults.len(),
        jobs.len(),
        faults.join("\n")
    );
    let main = jobs.iter().filter(|(k, ..)| is_main(k)).count();
    eprintln!(
        "{} variants, {} compiles, {main} of them assembled",
        keys.len(),
        jobs.len()
    );
}

/// `ptxas -v` on one variant's PTX: (entry=registers per kernel, spill
/// bytes, report). ptxas's warnings are in the report: a wgmma it had to
/// serialize ("wgmma.mma_async instructions are serialized", C7510 and
/// kin) or a setmaxnreg it ignored (C7508). With `FLASHATTN_NVDISASM`
/// naming an nvdisasm, the report ends with the SASS.
fn ptxas(ptxas: &PathBuf, key: &KernelKey, ptx: &Ptx, sm: &str) -> (Vec<String>, i64, String) {
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join(format!("{}.ptx", key.label()));
    std::fs::write(&src, ptx.to_src()).unwrap();
    let out = Command::new(ptxas)
        .arg("-v")
        .arg(format!("--gpu-name={sm}"))
        .arg(&src)
        .arg("-o")
        .arg(dir.path().join("out.cubin"))
        .output()
        .unwrap();
    let mut report = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(
        out.status.success(),
        "ptxas failed on {}: {report}",
        key.label()
    );
    if let Some(nvdisasm) = std::env::var_os("FLASHATTN_NVDISASM") {
        let sass = Command::new(nvdisasm)
            .arg("-c")
            .arg(dir.path().join("out.cubin"))
            .output()
            .unwrap();
        assert!(sass.status.success(), "nvdisasm failed on {}", key.label());
        report += &String::from_utf8_lossy(&sass.stdout);
    }
    // "Used 72 registers, ..." per entry; "N bytes spill stores, M bytes spill loads".
    let mut registers = Vec::new();
    let mut entry = "";
    for line in report.lines() {
        // "Compiling entry function 'flash_fwd' for 'sm_80'" precedes its counts.
        if let Some(rest) = line.split("entry function '").nth(1) {
            entry = rest.split('\'').next().unwrap_or("");
        }
        let used = line.split("Used ").nth(1).and_then(|r| r.split(' ').next());
        if let Some(r) = used.filter(|_| line.contains(" registers")) {
            registers.push(format!("{entry}={r}"));
        }
    }
    let spills = spill_bytes(&report).unwrap_or(0);
    (registers, spills, report)
}

mod common;

/// The backend on this machine's device, or `None` after a waiver naming
/// why (a failure under FLASHATTN_REQUIRE_GPU=1, as the GPU checks run it).
fn device() -> Option<Cuda> {
    match Cuda::new() {
        Ok(c) => {
            eprintln!("CUDA tests run on {}", c.describe());
            Some(c)
        }
        Err(e) => {
            let what = if driver_present() {
                "no CUDA device"
            } else {
                "no driver"
            };
            waive(DEVICE_REQUIRED, &format!("{what}: {e}"));
            None
        }
    }
}

/// A short name of a case for the lines each finished case prints.
fn label(case: &common::Case) -> String {
    let o = &case.opts;
    format!(
        "{} b{} {}x{} heads {}:{} d {}{}{}{}",
        case.precision.name(),
        case.batch,
        case.seqlen_q,
        case.seqlen_k,
        case.heads_q,
        case.heads_kv,
        case.head_dim,
        if o.causal { " causal" } else { "" },
        if o.softcap.is_some() { " softcap" } else { "" },
        if o.alibi.is_some() || o.sinks.is_some() || o.block_mask.is_some() || o.varlen.is_some() {
            " layouts"
        } else {
            ""
        },
    )
}

/// The accuracy matrix: head dims off and on the compile step and the
/// wide ones (an odd 300, MLA's 576), every storage precision, masks (with
/// empty rows: more queries than keys under causal), softcap, GQA/MQA and
/// lengths that are not multiples of a tile.
fn matrix() -> Vec<common::Case> {
    use common::{causal, window, Case};
    let mut cases = Vec::new();
    for precision in [Precision::F32, Precision::F16, Precision::Bf16] {
        for d in [1, 40, 64, 128, 200, 256, 300, 576] {
            let base = Case::new(77, 77, d).precision(precision);
            cases.push(base.clone());
            cases.push(base.clone().opts(causal()));
            cases.push(
                Case::new(61, 130, d)
                    .precision(precision)
                    .heads(4, 1)
                    .opts(window(9, 3)),
            );
            cases.push(
                Case::new(90, 33, d)
                    .precision(precision)
                    .heads(4, 2)
                    .opts(causal()),
            );
            cases.push(base.clone().opts(causal().softcap(5.0)).batch(2));
        }
    }
    cases
}

/// The device's backend on each kernel path: with `FLASHATTN_CUDA_KERNEL`
/// set (the GPU checks: one path per process), that path alone; else the
/// chosen ones (the tensor-core kernels for f16/bf16 up to d 128, the
/// Hopper forward on 9.x), the scalar kernels forced, and on Hopper the
/// sm80 kernels forced.
fn paths(cuda: Cuda) -> Vec<(KernelPath, Cuda)> {
    if std::env::var("FLASHATTN_CUDA_KERNEL").is_ok_and(|v| !v.is_empty()) {
        return vec![(cuda.kernel_path(), cuda)];
    }
    let hopper = cuda.props().major == 9;
    let mut paths = vec![
        (KernelPath::Auto, cuda),
        (
            KernelPath::Scalar,
            Cuda::new().unwrap().with_kernels(KernelPath::Scalar),
        ),
    ];
    if hopper {
        let mma = Cuda::new().unwrap().with_kernels(KernelPath::Mma);
        paths.push((KernelPath::Mma, mma));
    }
    paths
}

/// Whether `path` takes a problem of this precision and head dim: the sm80
/// kernels forced (`FLASHATTN_CUDA_KERNEL=mma`) refuse f32 storage and head
/// dims past 128, which `refusal` must then be, as a typed error.
fn path_takes<T: std::fmt::Debug>(
    path: KernelPath,
    precision: Precision,
    head_dim: usize,
    refusal: impl FnOnce() -> flashattn::Result<T>,
) -> bool {
    if path != KernelPath::Mma || (precision != Precision::F32 && head_dim <= 128) {
        return true;
    }
    let out = refusal();
    assert!(matches!(out, Err(Error::Unsupported { .. })), "{out:?}");
    false
}

/// Whether `path` takes `case` ([`path_takes`], on its forward).
fn takes_case(path: KernelPath, cuda: &Cuda, case: &common::Case) -> bool {
    let forward = || {
        let inputs = case.inputs();
        let [q, k, v] = inputs.views();
        cuda.forward(&ForwardInputs::new(q, k, v), &case.opts)
    };
    path_takes(
        path,
        case.precision,
        case.head_dim.max(case.head_dim_v),
        forward,
    )
}

/// Every case's forward on `cuda` (kernel path `path`) under the rule,
/// each printed as it finishes.
fn forward_cases(path: KernelPath, cuda: &Cuda, cases: Vec<common::Case>) {
    for (i, case) in cases.into_iter().enumerate() {
        if !takes_case(path, cuda, &case) {
            continue;
        }
        let inputs = case.inputs();
        let [q, k, v] = inputs.views();
        let out = cuda
            .forward(&ForwardInputs::new(q, k, v), &case.opts)
            .unwrap_or_else(|e| panic!("{path:?} {case:?}: {e}"));
        let [o, lse] = common::assert_accurate(&case, &inputs, &out);
        eprintln!("forward {path:?} case {i} {}: {o} | {lse}", label(&case));
    }
}

#[test]
fn forward_meets_the_accuracy_rule_on_the_device() {
    let Some(cuda) = device() else { return };
    for (path, cuda) in paths(cuda) {
        forward_cases(path, &cuda, matrix());
    }
}

/// The plan of a typical call (bf16, d 128, causal) on `props` under `path`.
fn typical_plan(
    props: &flashattn::cuda::DeviceProps,
    path: KernelPath,
) -> flashattn::cuda::CudaPlan {
    let problem = flashattn::cuda::plan::PlanProblem {
        precision: Precision::Bf16,
        head_dim: 128,
        band: true,
        softcap: false,
        positive_scale: true,
        dropout: false,
    };
    flashattn::cuda::plan::plan(props, &problem, path).unwrap()
}

#[test]
fn f16_and_bf16_run_on_tensor_cores_where_the_device_has_them() {
    let Some(cuda) = device() else { return };
    let props = cuda.props().clone();
    let plan = typical_plan(&props, KernelPath::Auto);
    eprintln!("{}", plan.explain(&props).join("\n"));
    let (forward, backward) = match props.major {
        9 => (Family::ForwardWgmma, Family::BackwardWgmma),
        _ => (Family::ForwardMma, Family::BackwardMma),
    };
    assert_eq!(plan.forward.family, forward, "{props:?}");
    assert_eq!(plan.backward.family, backward, "{props:?}");
}

#[test]
fn backward_meets_the_accuracy_rule_and_repeats_bit_for_bit() {
    let Some(cuda) = device() else { return };
    for (path, cuda) in paths(cuda) {
        eprintln!("backward on the {path:?} path");
        backward_cases(path, &cuda, matrix());
    }
}

/// Forward, then the backward checked against the f64 reference (dsinks
/// too, with sinks) and repeated: bit-identical gradients and dsinks.
fn backward_cases(path: KernelPath, cuda: &Cuda, cases: Vec<common::Case>) {
    for case in cases {
        if !takes_case(path, cuda, &case) {
            continue;
        }
        let inputs = case.inputs();
        let [q, k, v] = inputs.views();
        let fwd = cuda
            .forward(&ForwardInputs::new(q, k, v), &case.opts)
            .unwrap_or_else(|e| panic!("{case:?}: {e}"));
        let (_, g) = common::output_grad(&case);
        let d_o = inputs.grad(&g);
        let bwd_inputs =
            flashattn::BackwardInputs::new(ForwardInputs::new(q, k, v), &fwd, d_o).unwrap();
        let out = cuda
            .backward(&bwd_inputs, &case.opts)
            .unwrap_or_else(|e| panic!("{case:?}: {e}"));
        let checks =
            flashattn::accuracy::check_backward(&out, &q, &k, &v, &d_o, &case.opts).unwrap();
        for c in &checks {
            assert!(c.passed(), "{case:?}\n{c}");
        }
        let lines: Vec<String> = checks.iter().map(|c| c.to_string()).collect();
        eprintln!("backward {}: {}", label(&case), lines.join(" | "));
        assert_eq!(out.dsinks.is_some(), case.opts.sinks.is_some(), "{case:?}");
        let again = cuda.backward(&bwd_inputs, &case.opts).unwrap();
        assert_eq!(
            (&out.dq, &out.dk, &out.dv, &out.dsinks),
            (&again.dq, &again.dk, &again.dv, &again.dsinks),
            "{case:?}"
        );
    }
}

/// The run-time layouts (tests/gpu_layouts.rs's cases, fewer): ALiBi per
/// head and per batch entry, sinks (with rows that see no key), block masks
/// of odd and tile-aligned block sizes, per head and broadcast, packed
/// batches with empty sequences, and all of them at once — each with
/// masks, softcap and GQA, in every storage precision.
fn layout_cases() -> Vec<common::Case> {
    use common::{block_mask, causal, window, Case};
    use flashattn::AttentionOptions;
    use flashattn::{Alibi, Sinks};
    let sinks = |h: usize| Sinks::new(&(0..h).map(|i| i as f32 - 1.5).collect::<Vec<_>>());
    let slopes: Vec<f32> = (0..6).map(|i| 0.05 + 0.3 * i as f32).collect();
    let mut cases = vec![
        Case::new(61, 77, 64)
            .heads(4, 2)
            .opts(causal().alibi(Alibi::standard(4))),
        Case::new(77, 61, 59)
            .opts(AttentionOptions::default().alibi(Alibi::standard(2)))
            .f16(),
        Case::new(45, 53, 32)
            .batch(2)
            .heads(3, 1)
            .opts(causal().alibi(Alibi::new(&slopes)))
            .bf16(),
        Case::new(37, 41, 128)
            .heads(4, 2)
            .opts(window(6, 6).softcap(8.0).alibi(Alibi::standard(4)))
            .f16(),
        Case::new(53, 61, 64)
            .heads(4, 1)
            .opts(AttentionOptions::default().sinks(sinks(4))),
        Case::new(40, 10, 32).opts(causal().sinks(sinks(2))),
        Case::new(47, 59, 32)
            .heads(4, 2)
            .opts(window(7, 3).sinks(sinks(4)))
            .f16(),
        Case::new(61, 53, 200)
            .opts(AttentionOptions::default().softcap(4.0).sinks(sinks(2)))
            .bf16(),
    ];
    let sparse = Case::new(67, 83, 32).heads(4, 2);
    for (i, (block, density)) in [((7, 13), 0.3), ((13, 7), 0.6), ((3, 5), 0.1)]
        .into_iter()
        .enumerate()
    {
        let mask = block_mask(&sparse, block, density, 4, i as u64);
        let opts = AttentionOptions::default().block_mask(mask);
        cases.push(sparse.clone().opts(opts.clone()));
        cases.push(sparse.clone().opts(opts).f16());
    }
    let square = Case::new(70, 70, 96).bf16();
    let mask = block_mask(&square, (7, 13), 0.5, 1, 9);
    cases.push(square.clone().opts(causal().block_mask(mask.clone())));
    cases.push(square.opts(window(20, 5).softcap(5.0).block_mask(mask)));
    // Blocks of whole tiles (64 × 64): every visited tile is full.
    let aligned = Case::new(200, 233, 64).heads(4, 2).f16();
    let mask = block_mask(&aligned, (64, 64), 0.4, 4, 11);
    cases.push(aligned.clone().opts(causal().block_mask(mask)));
    // Packed batches: no queries, no keys, more queries than keys.
    let (lq, lk) = ([9, 0, 37, 50, 20], [14, 23, 0, 31, 20]);
    let packed = |d| Case::new(1, 1, d).heads(4, 2).varlen(&lq, &lk);
    cases.push(packed(32).opts(causal()));
    cases.push(packed(64).opts(window(8, 2)).f16());
    cases.push(
        packed(128)
            .opts(AttentionOptions::default().softcap(5.0))
            .bf16(),
    );
    // Shards of a longer sequence (ring attention's partial calls): q 50
    // positions past k's start under causal; q before k under a window of
    // 20 (most rows see no key); ALiBi's distances from the moved diagonal.
    cases.push(
        Case::new(70, 150, 64)
            .heads(4, 2)
            .opts(causal().positions(50, 0))
            .f16(),
    );
    cases.push(
        Case::new(150, 70, 128)
            .opts(window(20, 0).positions(0, 60))
            .bf16(),
    );
    cases.push(
        Case::new(45, 70, 40)
            .heads(4, 2)
            .opts(window(9, 0).alibi(Alibi::standard(4)).positions(103, 0)),
    );
    // Everything at once (tests/common's case, with v's head dim q's).
    let all = common::everything_at_once().dv(40);
    cases.push(all.clone());
    cases.push(all.f16());
    cases
}

#[test]
fn layouts_meet_the_accuracy_rule_on_the_device() {
    let Some(cuda) = device() else { return };
    for (path, cuda) in paths(cuda) {
        forward_cases(path, &cuda, layout_cases());
        // Rows with no allowed key under a sink: o = 0 and lse = the sink, exactly.
        let case = layout_cases().swap_remove(5);
        let inputs = case.inputs();
        let [q, k, v] = inputs.views();
        let forward = || cuda.forward(&ForwardInputs::new(q, k, v), &case.opts);
        if !path_takes(path, case.precision, case.head_dim, forward) {
            continue;
        }
        let out = forward().unwrap();
        let (o, sinks) = (out.o.to_f32(), case.opts.sinks.as_ref().unwrap());
        for h in 0..2 {
            for i in 0..30 {
                assert_eq!(out.lse[h * 40 + i], sinks.logits()[h], "{path:?} row {i}");
                assert!(o[(i * 2 + h) * 32..][..32].iter().all(|&x| x == 0.0));
            }
        }
    }
}

/// Ring attention's primitives on the device: shards at global positions
/// (`Problem::shift`), merged by LSE, are the whole sequence's attention,
/// and the shard pairs' gradients sum to its gradients (tests/partial.rs's
/// cases, on every kernel path).
#[test]
fn shards_merge_into_the_whole_sequence_on_the_device() {
    let Some(cuda) = device() else { return };
    for (path, cuda) in paths(cuda) {
        for case in common::shards::cases() {
            eprintln!("{path:?}: {}", case.name);
            common::shards::check_case(&cuda, &case);
        }
    }
}

#[test]
fn layouts_backward_meets_the_accuracy_rule_and_repeats_bit_for_bit() {
    let Some(cuda) = device() else { return };
    for (path, cuda) in paths(cuda) {
        eprintln!("layouts backward on the {path:?} path");
        backward_cases(path, &cuda, layout_cases());
    }
}

/// Dropout's cases: odd sizes, causal and windows with GQA/MQA, softcap,
/// the layouts (a packed batch with empty sequences, ALiBi with sinks, a
/// block mask), an offset whose low word carries, in every storage
/// precision and on both sides of d 128 (the sm80 and scalar kernels).
fn dropout_cases() -> Vec<common::Case> {
    use common::{block_mask, causal, window, Case};
    use flashattn::{Alibi, Sinks};
    let drop = |o: AttentionOptions, p: f32, seed: u64| {
        o.dropout(p)
            .dropout_seed(seed)
            .dropout_offset((1 << 32) - 3)
    };
    let sparse = Case::new(67, 83, 32).heads(4, 2);
    let mask = block_mask(&sparse, (7, 13), 0.5, 4, 3);
    let mut cases = Vec::new();
    for precision in [Precision::F32, Precision::F16, Precision::Bf16] {
        cases.extend([
            Case::new(77, 77, 64).precision(precision).opts(drop(
                AttentionOptions::default(),
                0.1,
                1,
            )),
            Case::new(90, 33, 40)
                .heads(4, 2)
                .batch(2)
                .precision(precision)
                .opts(drop(causal(), 0.3, 2)),
            Case::new(61, 130, 128)
                .heads(4, 1)
                .precision(precision)
                .opts(drop(window(9, 3).softcap(5.0), 0.2, 3)),
            Case::new(45, 70, 200)
                .heads(2, 2)
                .precision(precision)
                .opts(drop(causal(), 0.5, 4)),
            Case::new(1, 1, 64)
                .heads(4, 2)
                .varlen(&[9, 0, 37, 50], &[14, 23, 0, 31])
                .precision(precision)
                .opts(drop(causal(), 0.25, 5)),
            Case::new(53, 61, 64)
                .heads(4, 2)
                .precision(precision)
                .opts(drop(
                    AttentionOptions::default()
                        .alibi(Alibi::standard(4))
                        .sinks(Sinks::new(&[0.5, -1.0, 1.5, 0.0])),
                    0.2,
                    6,
                )),
            sparse.clone().precision(precision).opts(drop(
                causal().block_mask(mask.clone()),
                0.2,
                7,
            )),
        ]);
    }
    cases
}

/// Dropout on the device, forward and backward on each path (the Hopper
/// path runs the sm80 forward for it; forced, it is `Unsupported`), under
/// the rule against the f64 reference drawing the same mask, the backward
/// repeating bit for bit; p = 0 is bit-identical to no dropout.
#[test]
fn dropout_meets_the_accuracy_rule_and_repeats_bit_for_bit_on_the_device() {
    let Some(cuda) = device() else { return };
    for (path, cuda) in paths(cuda) {
        let case = common::Case::new(45, 70, 64).f16();
        let inputs = case.inputs();
        let [q, k, v] = inputs.views();
        let run = |opts: &AttentionOptions| cuda.forward(&ForwardInputs::new(q, k, v), opts);
        if path == KernelPath::Hopper {
            let out = run(&dropout_cases()[0].opts);
            assert!(matches!(out, Err(Error::Unsupported { .. })), "{out:?}");
            continue;
        }
        let zero = AttentionOptions::default().dropout(0.0).dropout_seed(3);
        let (with, without) = (
            run(&zero).unwrap(),
            run(&AttentionOptions::default()).unwrap(),
        );
        assert_eq!((&with.o, &with.lse), (&without.o, &without.lse), "{path:?}");
        forward_cases(path, &cuda, dropout_cases());
        backward_cases(path, &cuda, dropout_cases());
    }
}

/// Decoding (tests/common/decode.rs's cases: dense and paged caches,
/// appends, batch indices, seqlen_q 1–16, GQA/MQA, masks, softcap, ALiBi,
/// sinks, v's own head dim, every precision, lengths 0–8192, every
/// num_splits) against the f64 reference, the cache updated exactly; then
/// the quantized cases (int8 and FP8) against the reference on the codes'
/// values and the documented append.
#[test]
fn decoding_matches_the_reference_on_the_device() {
    let Some(cuda) = device() else { return };
    let backend = flashattn::Backend::Cuda(Box::new(cuda));
    for case in common::decode::cases() {
        let data = case.data();
        data.check(|cache, step| backend.decode(cache, step, &case.opts, case.num_splits));
    }
    for case in common::kv_quant::quant_cases() {
        let data = case.data();
        for quant in flashattn::CacheQuant::ALL {
            data.check_quantized(quant, |cache, step| {
                backend.decode_quantized(cache, step, &case.opts, case.num_splits)
            });
        }
    }
}

/// A device cache stays on the device: each step copies q, the new rows,
/// the lengths and the page table (`stats.uploaded_bytes`, the same for a
/// cache 64 times larger), and steps appended one after another match the
/// reference on the cache read back.
#[test]
fn a_device_cache_step_copies_only_its_inputs() {
    let Some(cuda) = device() else { return };
    let (batch, heads_q, heads_kv, d) = (2, 8, 2, 64);
    let q = vec![0.25f32; batch * heads_q * d];
    let new: Vec<f32> = (0..batch * heads_kv * d)
        .map(|e| (e % 7) as f32 * 0.1)
        .collect();
    for capacity in [64, 4096] {
        let layout = flashattn::CacheLayout::Dense { batch, capacity };
        let shape = flashattn::CacheShape::new(layout, heads_kv, d).unwrap();
        let mut cache = cuda.kv_cache(shape, Precision::F32).unwrap();
        for t in 0..3i32 {
            let lens = [t, 2 * t];
            let new_view = flashattn::TensorView::f32([batch, 1, heads_kv, d], &new);
            let step = flashattn::DecodeStep::new(
                flashattn::TensorView::f32([batch, 1, heads_q, d], &q),
                &lens,
            )
            .append(new_view, new_view);
            let before = cuda.read_kv_cache(&cache).unwrap();
            let out = cuda
                .decode(&mut cache, &step, &AttentionOptions::default(), None)
                .unwrap();
            let expected = 4 * (q.len() + 2 * new.len() + 2 * batch);
            assert_eq!(
                out.stats.uploaded_bytes,
                Some(expected as u64),
                "capacity {capacity}"
            );
            let checks = flashattn::accuracy::check_decode(
                &out,
                &before,
                &step,
                &AttentionOptions::default(),
            )
            .unwrap();
            assert!(checks.iter().all(|c| c.passed()), "{checks:?}");
        }
    }
}

/// What the CUDA backend still does not take: a v head dim of its own,
/// block masks in decoding (which no backend takes) and quantized
/// latent caches (which none takes either): typed errors, never a panic,
/// and the cache untouched.
#[test]
fn what_stays_unsupported_is_a_typed_error() {
    let Some(cuda) = device() else { return };
    let case = common::Case::new(8, 8, 16).dv(8);
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    assert!(matches!(
        cuda.forward(&ForwardInputs::new(q, k, v), &case.opts),
        Err(Error::Unsupported { .. })
    ));
    let backend = flashattn::Backend::Cuda(Box::new(cuda));
    let data = common::decode::DecodeCase::new(&[5, 9], 16)
        .append(2)
        .data();
    let mut cache = data.cache.clone();
    let mask = flashattn::BlockMask::new([1, 1, 1, 1], (64, 64), &[1]).unwrap();
    let masked = flashattn::AttentionOptions::default().block_mask(mask);
    let out = backend.decode(&mut cache, &data.step(), &masked, None);
    assert!(matches!(out, Err(Error::Unsupported { .. })), "{out:?}");
    assert!(cache == data.cache, "a refused step left the cache changed");
}

/// The FP8 forward on the device, where the Hopper kernels run (elsewhere
/// a typed `CudaArchUnfit`, never a launch): tests/common/fp8.rs's cases,
/// with and without the Hadamard transform, within 10% of the naive f64
/// quantization's RMSE and the LSE under the accuracy rule (the wgpu and
/// CPU suites' judgement); the transform at least halving the error on
/// outlier channels; empty rows, a non-finite input and the layouts FP8
/// does not take; and the device's quantization bit for bit that of
/// src/quant.rs.
#[test]
fn the_fp8_forward_meets_its_rule_on_the_device() {
    use common::fp8::{
        assert_close_to_naive, cases, check_empty_rows_and_bad_inputs, quantizer_inputs, views,
        Fp8Case, HADAMARD,
    };
    use flashattn::accuracy::fp8_report;
    use flashattn::Fp8Options;
    let Some(cuda) = device() else { return };
    let fp8_workload = workload(Operation::Fp8, AttentionOptions::default());
    if let Err(e) = cuda.takes(&fp8_workload) {
        let case = Fp8Case::new(common::Case::new(8, 8, 16));
        let data = case.inputs();
        let [q, k, v] = views(&case, &data);
        let out = cuda.forward_fp8(
            &ForwardInputs::new(q, k, v),
            case.opts(),
            &Fp8Options::default(),
        );
        assert!(matches!(e, Error::CudaArchUnfit { .. }), "{e:?}");
        assert!(matches!(out, Err(Error::CudaArchUnfit { .. })), "{out:?}");
        return;
    }
    let report = |case: &Fp8Case, fp8: &Fp8Options| {
        let data = case.inputs();
        let [q, k, v] = views(case, &data);
        let inputs = ForwardInputs::new(q, k, v);
        let out = cuda.forward_fp8(&inputs, case.opts(), fp8).unwrap();
        assert_eq!(out.o.precision(), Precision::F32);
        assert_eq!(out.o.shape, case.shapes()[0].to_vec());
        fp8_report(&out, &inputs, case.opts(), fp8).unwrap()
    };
    for case in cases() {
        for fp8 in [Fp8Options::default(), HADAMARD] {
            assert_close_to_naive(&case, &fp8, &report(&case, &fp8));
        }
    }
    for case in [
        Fp8Case::new(common::Case::new(128, 128, 64)).outliers(),
        Fp8Case::new(common::Case::new(96, 128, 128).heads(4, 2)).outliers(),
    ] {
        let (plain, rotated) = (
            report(&case, &Fp8Options::default()),
            report(&case, &HADAMARD),
        );
        let gain = plain.o.rmse / rotated.o.rmse;
        assert!(gain >= 2.0, "{case:?}: Hadamard cut RMSE only {gain:.2}x");
    }
    check_empty_rows_and_bad_inputs(|i, opts| cuda.forward_fp8(i, opts, &HADAMARD));
    for d in [3, 59, 128] {
        let (seqlen, heads) = (13, 8);
        let x = quantizer_inputs(heads, seqlen, d);
        let view = flashattn::TensorView::f32([1, seqlen, heads, d], &x);
        for fp8 in [Fp8Options::default(), HADAMARD] {
            let device = cuda.quantize_fp8(&view, &fp8).unwrap();
            let layout = flashattn::quant::Fp8Layout::new(d, &fp8);
            let row = device.row_len;
            let host =
                flashattn::quant::quantize(&view, "x", layout.transform.as_ref(), row).unwrap();
            assert_eq!(device, host, "d {d} {fp8:?}");
        }
    }
}

/// DeepSeek's MLA on latent caches (tests/common/decode.rs's MLA cases:
/// d 576 / dv 512, 128:1, seqlen_q 1 and 4, dense and paged, split-KV, and
/// small odd latent caches of several kv heads) against the f64 reference,
/// the cache updated exactly; bad latent input typed, the cache untouched.
#[test]
fn latent_caches_match_the_reference_on_the_device() {
    let Some(cuda) = device() else { return };
    let backend = flashattn::Backend::Cuda(Box::new(cuda));
    for case in common::decode::mla_cases() {
        let data = case.data();
        let out =
            data.check(|cache, step| backend.decode(cache, step, &case.opts, case.num_splits));
        assert_eq!(out.o.shape[3], case.head_dim_v);
    }
    common::decode::check_latent_rejections(|c, s| {
        backend.decode(c, s, &AttentionOptions::default(), None)
    });
}

/// A device latent cache is one buffer of rows × 576 elements (V read from
/// it): steps append k_new alone as the reference's append says, the cache
/// read back is one tensor, a step with a v_new is `LatentAppend` and
/// leaves the cache as it was; its quantized form is one buffer of codes and
/// one of scales, and refuses a v_new alike.
#[test]
fn a_device_latent_cache_is_one_buffer() {
    let Some(cuda) = device() else { return };
    use flashattn::{CacheLayout, CacheShape, DecodeStep, TensorData};
    let (b, hq, d, dv, pages, page) = (2, 16, 576, 512, 6, 3);
    let layout = CacheLayout::Paged {
        pages,
        page_size: page,
    };
    let shape = CacheShape::latent(layout, 1, d, dv).unwrap();
    let mut cache = cuda.kv_cache(shape, Precision::F16).unwrap();
    assert_eq!(cache.bytes(), pages * page * d * 2);
    let mut host = flashattn::HostKvCache::zeros(shape, Precision::F16);
    let table = [4, 0, 2, 5, 1, 3];
    let mut rng = flashattn::random::Rng::new(11);
    let opts = AttentionOptions::default().causal(true);
    let mut t = |n| TensorData::from_f32(rng.normal_vec(n, 1.0), Precision::F16);
    for step in 0..4 {
        let lens = [2 * step, 2 * step];
        let (q, k) = (t(b * 2 * hq * d), t(b * 2 * d));
        let s = DecodeStep::new(q.view([b, 2, hq, d]), &lens)
            .block_table(&table, 3)
            .append_latent(k.view([b, 2, 1, d]));
        let before = host.clone();
        let out = cuda.decode(&mut cache, &s, &opts, Some(2)).unwrap();
        let checks = flashattn::accuracy::check_decode(&out, &before, &s, &opts).unwrap();
        assert!(checks.iter().all(|c| c.passed()), "step {step}: {checks:?}");
        host = flashattn::reference::decode_cache(&before, &s).unwrap();
    }
    let read = cuda.read_kv_cache(&cache).unwrap();
    common::decode::assert_one_latent_tensor(&read);
    assert!(read == host, "the device cache lost a row");
    let (q, k, v) = (t(b * hq * d), t(b * d), t(b * dv));
    let lens = [7, 7];
    let bad = DecodeStep::new(q.view([b, 1, hq, d]), &lens)
        .block_table(&table, 3)
        .append(k.view([b, 1, 1, d]), v.view([b, 1, 1, dv]));
    let err = cuda.decode(&mut cache, &bad, &opts, None).unwrap_err();
    assert!(matches!(err, Error::LatentAppend { .. }), "{err:?}");
    assert!(cuda.read_kv_cache(&cache).unwrap() == host);
    let uploaded = cuda.upload_kv_cache(&host).unwrap();
    assert_eq!(uploaded.bytes(), pages * page * d * 2);
    assert!(cuda.read_kv_cache(&uploaded).unwrap() == host);
    let mut quant = cuda
        .quantized_kv_cache(shape, flashattn::CacheQuant::Int8, Precision::F16)
        .unwrap();
    assert_eq!(quant.bytes(), pages * page * d + 4 * pages);
    let before = cuda.read_quantized_kv_cache(&quant).unwrap();
    let err = cuda.decode(&mut quant, &bad, &opts, None).unwrap_err();
    assert!(matches!(err, Error::LatentAppend { .. }), "{err:?}");
    assert!(cuda.read_quantized_kv_cache(&quant).unwrap() == before);
}

/// Builds `key`'s source with cuda/emulate/host.h and check.cpp under
/// `cxx` (with check.cpp's layout cases too where `layouts`, and `defines`
/// as `-D` flags) into an executable in `dir`.
fn build_emulation(
    cxx: &std::ffi::OsStr,
    dir: &Path,
    key: &KernelKey,
    layouts: bool,
    defines: &[&str],
) -> PathBuf {
    let name = format!("{}{}", key.label(), defines.join("").replace('=', "_"));
    build_emulation_of(cxx, dir, key, &key.source(), &name, layouts, defines)
}

/// [`build_emulation`] of `source` (`key`'s, or a copy of it with a bug
/// put in) as `name`.
fn build_emulation_of(
    cxx: &std::ffi::OsStr,
    dir: &Path,
    key: &KernelKey,
    source: &str,
    name: &str,
    layouts: bool,
    defines: &[&str],
) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("cuda/emulate");
    let host = std::fs::read_to_string(root.join("host.h")).unwrap();
    let check = std::fs::read_to_string(root.join("check.cpp")).unwrap();
    let src = dir.join(format!("{name}.cpp"));
    let exe = dir.join(name);
    let cases = format!("#define LAYOUT_CASES {}\n", u8::from(layouts));
    std::fs::write(&src, format!("{cases}{host}\n{source}\n{check}")).unwrap();
    let started = std::time::Instant::now();
    compile_cpp(cxx, &src, &exe, defines, &key.label());
    eprintln!(
        "{} built in {:.1} s",
        key.label(),
        started.elapsed().as_secs_f64()
    );
    exe
}

/// Runs an emulation build with `args`: its report, and whether it passed.
fn run_emulation(exe: &Path, args: &[String]) -> (String, bool) {
    let started = std::time::Instant::now();
    let ran = Command::new(exe).args(args).output().unwrap();
    let report = format!(
        "{}{}",
        String::from_utf8_lossy(&ran.stdout),
        String::from_utf8_lossy(&ran.stderr)
    );
    eprintln!(
        "{} (ran in {:.1} s)\n{report}",
        exe.display(),
        started.elapsed().as_secs_f64()
    );
    (report, ran.status.success())
}

/// Builds `key` with host.h and check.cpp and runs its built-in cases:
/// the failure report, if any.
fn emulate(cxx: &std::ffi::OsStr, dir: &Path, key: &KernelKey, layouts: bool) -> Option<String> {
    let exe = build_emulation(cxx, dir, key, layouts, &[]);
    let (report, passed) = run_emulation(&exe, &[]);
    (!passed).then(|| format!("{}:\n{report}", key.label()))
}

/// The C++20 compiler: `FLASHATTN_CXX`, or in required mode (a GPU run, or
/// the CUDA script's `FLASHATTN_REQUIRE_NVRTC=1`) `g++` or `c++` where one
/// is on PATH; else a waiver (a failure in required mode).
fn compiler() -> Option<std::ffi::OsString> {
    if let Some(cxx) = std::env::var_os("FLASHATTN_CXX").filter(|c| !c.is_empty()) {
        return Some(cxx);
    }
    if required(TOOLS_REQUIRED).is_some() {
        let found = ["g++", "c++"].into_iter().find(|c| {
            Command::new(c)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        });
        if let Some(c) = found {
            return Some(c.into());
        }
    }
    waive(
        TOOLS_REQUIRED,
        "no C++ compiler for the host emulation: FLASHATTN_CXX is not set (e.g. g++)",
    );
    None
}

/// The kernels' logic on the CPU: with `FLASHATTN_CXX` naming a C++20
/// compiler (e.g. `g++`), variants of every family and precision are built
/// with cuda/emulate/host.h (one std::thread per CUDA thread) and run
/// against attention in double by cuda/emulate/check.cpp — GQA, a head dim
/// below the compiled one, lengths off the tiles, empty rows, and on the
/// banded d 96 build of each family the run-time layouts (ALiBi per batch
/// entry, sinks, block masks of 7 × 13 blocks per head and of whole tiles
/// per batch entry with the tile lists the kernels walk, a packed batch
/// with empty sequences, and all of them at once; their code is the same
/// in every precision and head dim), no extra variant compiled. Not the
/// device's numerics (no FMA contraction rules, libm's expf), but every
/// index, mask, tile loop, reduction and barrier of the kernels.
#[test]
fn kernels_match_a_double_reference_under_host_emulation() {
    let Some(cxx) = compiler() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    // Each precision meets each shape once per family (a Latin square:
    // every thread of a block is an OS thread here, so each build costs).
    let shapes = [(32, false, false), (96, true, false), (256, true, true)];
    for family in [Family::Forward, Family::Backward] {
        for (i, precision) in [Precision::F32, Precision::F16, Precision::Bf16]
            .into_iter()
            .enumerate()
        {
            let shape = (i + family as usize) % shapes.len();
            let (d, band, softcap) = shapes[shape];
            let key = KernelKey::new(family, precision, d, band, softcap);
            failures.extend(emulate(&cxx, dir.path(), &key, shape == 1));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The scalar forward and backward at the wide head dims (cuda/emulate/
/// check.cpp's listed cases against attention in double): MLA's 576 on
/// the d 576 variants (GQA 4:1, a band, rows with no key, a head dim
/// below the compiled one), and an odd 300 on the d 384 ones; every
/// precision, small lengths (every thread is an OS thread here).
#[test]
fn wide_head_dims_match_a_double_reference_under_host_emulation() {
    let Some(cxx) = compiler() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    // name sq sk left right d hq hkv batch
    let cases = |d: usize, low: usize| -> Vec<String> {
        [
            format!("gqa 21 37 9 0 {d} 4 1 1"),
            format!("rows 40 19 -1 0 {d} 2 2 2"),
            format!("low 17 50 -1 3 {low} 2 1 1"),
        ]
        .iter()
        .flat_map(|c| c.split(' ').map(String::from).collect::<Vec<_>>())
        .collect()
    };
    let builds = [
        (Family::Forward, Precision::Bf16, 576, true, false),
        (Family::Backward, Precision::F16, 576, true, true),
        (Family::Forward, Precision::F32, 300, false, true),
        (Family::Backward, Precision::Bf16, 300, true, false),
    ];
    for (family, precision, d, band, softcap) in builds {
        let key = KernelKey::new(family, precision, d, band, softcap);
        let exe = build_emulation(&cxx, dir.path(), &key, false, &[]);
        let mut args = vec!["cases".to_string()];
        args.extend(cases(d, d - 7));
        let (report, passed) = run_emulation(&exe, &args);
        if !passed {
            failures.push(format!(
                "{}:
{report}",
                key.label()
            ));
        }
    }
    assert!(
        failures.is_empty(),
        "{}",
        failures.join(
            "
"
        )
    );
}

/// The tensor-core kernels under the same emulation, where cuda/emulate/
/// host.h gives mma.sync m16n8k16, ldmatrix (.x1/.x2/.x4, .trans) and
/// cp.async (held back until its group is waited for) their PTX per-lane
/// fragment semantics: f16 and bf16, d 64 and 128 and 96 (compiled; check.cpp
/// runs head dims 5 and 8 below and at it: element-wise and cp.async loads),
/// causal and not, softcap, GQA, seqlen_q ≠ seqlen_k, 113 × 113, and the
/// layouts on the d 96 band + softcap builds (f16 forward, bf16 backward)
/// and the bf16 d 128 band forward (128-row blocks); the sm80 forward also
/// a window whose blocks run tested, unmasked, then tested tiles, a
/// negative scale, and scores spread far past the conditional rescale's
/// threshold (its maxima pass the reference tile after tile, some rows of a
/// warp at a time); first, every wrapper (ldmatrix .x4/.x2/.x1, .x2/.x1
/// .trans, mma) against a plain product.
#[test]
fn tensor_core_kernels_match_a_double_reference_under_host_emulation() {
    let Some(cxx) = compiler() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    // Every shape in both families, the precisions alternating (f16 and
    // bf16 share all code but the conversions, which both still meet).
    let shapes = [(64, false, false), (128, true, false), (96, true, true)];
    for (f, family) in [Family::ForwardMma, Family::BackwardMma]
        .into_iter()
        .enumerate()
    {
        for (i, &(d, band, softcap)) in shapes.iter().enumerate() {
            let precision = [Precision::F16, Precision::Bf16][(i + f) % 2];
            let key = KernelKey::new(family, precision, d, band, softcap);
            // The forward's layouts at 32 rows a warp (d 128) too.
            let layouts = i == 2 || (family == Family::ForwardMma && i == 1);
            failures.extend(emulate(&cxx, dir.path(), &key, layouts));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Each variant (precision, d, band, softcap, layout cases) of `family`
/// under host emulation; every failure reported at once.
fn emulate_variants(family: Family, variants: &[(Precision, usize, bool, bool, bool)]) {
    let Some(cxx) = compiler() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for &(precision, d, band, softcap, layouts) in variants {
        let key = KernelKey::new(family, precision, d, band, softcap);
        failures.extend(emulate(&cxx, dir.path(), &key, layouts));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The Hopper forward under the same emulation, where cuda/emulate/host.h
/// gives wgmma (descriptors decoded with the 128B swizzle on absolute
/// shared offsets, register A, results applied at the wait that retires
/// them), TMA (4-D boxes, swizzled, zeros outside, landing on their mbarrier
/// only when waited for), mbarriers (arrivals, transaction bytes, phase
/// parity), setmaxnreg (warpgroup-uniform) and named barriers their PTX
/// semantics, and a TMA copy over bytes an unretired wgmma reads is a fault. Three variants: f16
/// d 64 with a band (the overlapped pipeline), bf16 d 128 with softcap (the
/// sequential one), f16 d 128 plain; check.cpp first tests the wrappers
/// against plain products, then runs d 24 and 8 below the padded one and
/// at it, GQA, 45 × 70, 70 × 45, 113 × 113 and 150 × 530 (the ring wraps),
/// and on the first two (the exp2 softmax and the softcap's) the run-time
/// layouts: ALiBi per batch entry over tiles that would otherwise run
/// unmasked, sinks, a 7 × 13 block mask per head and one of whole tiles per
/// batch entry, a packed batch with a sequence past a tile and empty ones,
/// and all at once; a block writing rows past the outputs' end fails.
#[test]
fn the_hopper_forward_matches_a_double_reference_under_host_emulation() {
    emulate_variants(
        Family::ForwardWgmma,
        &[
            (Precision::F16, 64, true, false, true),
            (Precision::Bf16, 128, false, true, true),
            (Precision::F16, 128, false, false, false),
        ],
    );
}

/// The Hopper dK/dV (cuda/flash_bwd_wgmma.cu) under the same emulation
/// (wgmma from descriptors and register A, TMA boxes, mbarriers with
/// arrival counts and transaction bytes, setmaxnreg), its dK and dV
/// against check.cpp's double reference: f16 and bf16, d 64 and 128 (and
/// head dims below them), causal and not, a window whose blocks run
/// tested, untested and tested steps, softcap, GQA 4:2 and 4:1, seqlen_q ≠
/// seqlen_k, lengths of 1, 113 and 255, rows with no key; on the f16 d 64
/// band build the layouts (ALiBi, sinks, block masks, packed batches with
/// empty sequences, all at once). At d 64 it adds dQ, checked too, and a
/// second run's dq must be the first's bits; at d 128 dQ is the module's
/// `flash_bwd_dq_wgmma` (also run and checked at d 64, with the layouts),
/// its repeat bit-identical too.
#[test]
fn the_hopper_backward_matches_a_double_reference_under_host_emulation() {
    emulate_variants(
        Family::BackwardWgmma,
        &[
            (Precision::F16, 64, true, false, true),
            (Precision::Bf16, 128, false, true, false),
            (Precision::Bf16, 64, false, false, false),
            (Precision::F16, 128, true, false, false),
        ],
    );
}

/// The emulation finds bugs put into the Hopper dK/dV: at d 128, dP^T read
/// before its wgmma retired (the wait for it dropped), and the MN-major Q
/// and dO descriptors' LBO (the second 64-column box) wrong, and in its dQ
/// kernel dP read before its wgmma retired, K's MN-major LBO wrong and a
/// tile's second 64 keys read from its first; at d 64, where
/// it adds dQ, half of dS written transposed into its buffer, and a
/// warpgroup waiting for one contribution more than come before it (a
/// deadlock, reported by the bounded wait). Each build runs one case of
/// several key blocks and must fail.
#[test]
fn bugs_put_into_the_hopper_backward_fail_its_emulation() {
    let Some(cxx) = compiler() else { return };
    let dir = tempfile::tempdir().unwrap();
    let dkdv = [
        (
            "no wait for dP",
            "                wgmma_wait<0>();\n                pin(dpt);\n",
            "                pin(dpt);\n",
        ),
        (
            "wrong LBO",
            "smem_desc_words(stages, BOX_BYTES(BLOCK_N), 1024)",
            "smem_desc_words(stages, BOX_BYTES(BLOCK_N) / 2, 1024)",
        ),
        (
            "dQ kernel: no wait for dP",
            "wgmma_wait<0>();\n                    pin(dp);\n#pragma unroll",
            "pin(dp);\n#pragma unroll",
        ),
        (
            "dQ kernel: K's MN-major LBO wrong",
            "smem_desc_words(kv_s, BOX_BYTES(BLOCK_M), 1024)",
            "smem_desc_words(kv_s, BOX_BYTES(BLOCK_M) / 2, 1024)",
        ),
        (
            "dQ kernel: the second half of a tile's keys read as the first",
            "s * 2 * KV_BYTES + half * 64 * 128;",
            "s * 2 * KV_BYTES;",
        ),
    ];
    let dq = [
        (
            "dS transposed",
            "swizzled_128b(i * 128 + j * 2)",
            "swizzled_128b(j * 128 + i * 2)",
        ),
        (
            "one turn late",
            "pass_until(h, tile);\n                    sem_wait(sem, turn);",
            "pass_until(h, tile);\n                    sem_wait(sem, turn + 1);",
        ),
    ];
    for (d, case, bugs) in [
        (128, "cases one 113 150 -1 -1 128 2 1 1", &dkdv[..]),
        (64, "cases one 150 300 -1 -1 64 4 2 2", &dq[..]),
    ] {
        let key = KernelKey::new(Family::BackwardWgmma, Precision::F16, d, false, false);
        let case: Vec<String> = case.split(' ').map(String::from).collect();
        bugs_fail(&cxx, dir.path(), &key, &case, bugs);
    }
}

/// Bugs put into the sm80 forward's interior loop fail its emulation
/// (check.cpp's whole run for the variant, whose "large scores" case moves
/// the exponents' reference tile after tile): O not rescaled when the
/// reference moves, P not taken again against the new reference (a row's
/// first tile then feeds 2^inf into P V), the interior tiles' row sums
/// left out of l.
#[test]
fn bugs_put_into_the_sm80_forward_fail_its_emulation() {
    let Some(cxx) = compiler() else { return };
    let dir = tempfile::tempdir().unwrap();
    let rescale = "acc[mi][c][e] *= alpha[e / 2];\n                    exp2_tile<RAW_INTERIOR>(pa[mi], ts, s, m[mi], sl2);";
    let bugs = [
        (
            "O not rescaled",
            rescale,
            "acc[mi][c][e] *= 1.0f;\n                    exp2_tile<RAW_INTERIOR>(pa[mi], ts, s, m[mi], sl2);",
        ),
        (
            "P not taken again",
            rescale,
            "acc[mi][c][e] *= alpha[e / 2];\n",
        ),
        (
            "sums left out",
            "l[mi][0] += ts[0];",
            "l[mi][0] += 0.0f * ts[0];",
        ),
    ];
    let key = KernelKey::new(Family::ForwardMma, Precision::F16, 64, false, false);
    bugs_fail(&cxx, dir.path(), &key, &[], &bugs);
}

/// Bugs put into the sm80 backward's untested steps fail its emulation
/// (one case, GQA 2:1, d 64: a window of 200 keys to the left and 64 to the
/// right over 500 keys, whose blocks run tested, untested and tested
/// steps): a step of dK/dV taken as untested from its first query alone
/// (the left edge), or from its block's first key alone (the right edge),
/// a dQ block's step from its first row alone, and dK/dV's walk over the
/// (query head, query tile) steps not starting the next head's tiles over.
#[test]
fn bugs_put_into_the_sm80_backward_fail_its_emulation() {
    let Some(cxx) = compiler() else { return };
    let dir = tempfile::tempdir().unwrap();
    let bugs = [
        (
            "dK dV from the first query",
            "band_covers(p, m0, min(m0 + BLOCK_N, p.seqlen_q) - 1, n0,",
            "band_covers(p, m0, m0, n0,",
        ),
        (
            "dK dV from the first key",
            "n0, min(n0 + BLOCK_M, p.seqlen_k) - 1);",
            "n0, n0);",
        ),
        (
            "dQ from the first row",
            "band_covers(p, m0, last_row,",
            "band_covers(p, m0, m0,",
        ),
        (
            "the step walk keeping its tile into the next head",
            "        a.tile = 0;\n",
            "",
        ),
        (
            "dK dV reading LSE and D from the stage being filled",
            "lse_t = rows_s + (pos.k % 2)",
            "lse_t = rows_s + (next.k % 2)",
        ),
    ];
    let key = KernelKey::new(Family::BackwardMma, Precision::F16, 64, true, false);
    let case: Vec<String> = "cases one 150 500 200 64 64 2 1 1"
        .split(' ')
        .map(String::from)
        .collect();
    bugs_fail(&cxx, dir.path(), &key, &case, &bugs);
}

/// The FP8 Hopper forward (cuda/flash_fwd_wgmma.cu's IS_FP8) under host
/// emulation, where host.h gives wgmma on e4m3 codes (k 32, register A in
/// the 8-bit fragment layout, K-major operands only, a NaN code read a
/// fault) and st.shared over bytes an unretired wgmma reads is a fault:
/// check.cpp tests the e4m3 wrappers against plain products (S from
/// descriptors, D from registers packed by the paired conversion), then
/// random codes with per-head scales (a q head and a v head of scale 0)
/// against attention in double on the dequantized values: GQA 4:2 and
/// 4:1, 45 × 70, 70 × 45 (empty rows under a band), 113 × 113 causal, 1 ×
/// 255, 255 × 1, head dims 128, 100 and 64 (padded to 128), a window;
/// lse by the accuracy rule, o by FP8's (its RMSE within 1.1 × that of the
/// naive FP8 computation in double). All four band/softcap variants.
#[test]
fn the_fp8_hopper_forward_matches_a_double_reference_under_host_emulation() {
    let Some(cxx) = compiler() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for (band, softcap) in [(false, false), (true, false), (false, true), (true, true)] {
        let key = KernelKey::fp8_forward(128, band, softcap);
        failures.extend(emulate(&cxx, dir.path(), &key, false));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The emulation finds bugs put into the FP8 forward: V^T's key
/// permutation not the one P's registers hold, sq or sv left out of the
/// scales, P V reading V^T after V's barrier rather than V^T's (built
/// with the transposing producers made late, FLASHATTN_EMULATION_LAG_MS,
/// so that the consumers overtake them), and the producers rewriting a
/// stage's V^T without waiting for its readers' release (they run a phase
/// ahead: the bounded wait reports the deadlock). 113 queries against 300
/// keys: three tiles, the ring wraps.
#[test]
fn bugs_put_into_the_fp8_hopper_forward_fail_its_emulation() {
    let Some(cxx) = compiler() else { return };
    let dir = tempfile::tempdir().unwrap();
    let key = KernelKey::fp8_forward(128, false, false);
    let case: Vec<String> = "cases one 113 300 -1 -1 128 2 1 1"
        .split(' ')
        .map(String::from)
        .collect();
    // Late producers, or on time (a producer running ahead shows then).
    let wait = "FLASHATTN_BOUNDED_WAIT_MS=3000";
    let late: &[&str] = &["FLASHATTN_EMULATION_LAG_MS=300", wait];
    let on_time: &[&str] = &[wait];
    let bugs = [
        (
            "keys swapped in V^T",
            "i % 2 + 8 * (i / 2)",
            "i / 2 + 8 * (i % 2)",
            on_time,
        ),
        (
            "no sq",
            "q_scales[it.z * p.heads_q + h] * k_scales",
            "k_scales",
            on_time,
        ),
        (
            "no sv",
            "o_scale = v_scales[it.z * p.heads_kv + hk_c] / P_FACTOR;",
            "o_scale = 1.0f / P_FACTOR;",
            on_time,
        ),
        (
            "V^T read after V's barrier",
            "mbar_wait(vt_full + g % STAGES, (g / STAGES) & 1, BAR_VT_FULL + g % STAGES);",
            "mbar_wait(v_full + g % STAGES, (g / STAGES) & 1, BAR_V_FULL + g % STAGES);",
            late,
        ),
        (
            "V^T rewritten before its release",
            "mbar_wait(v_empty + s, parity, BAR_V_EMPTY + s);\n                    emulation_lag();",
            "emulation_lag();",
            on_time,
        ),
    ];
    let source = key.source();
    for defines in [late, on_time] {
        let exe = build_emulation(&cxx, dir.path(), &key, false, defines);
        let (report, passed) = run_emulation(&exe, &case);
        assert!(passed, "the kernel as it is ({defines:?}):\n{report}");
    }
    for (what, from, to, defines) in bugs {
        assert_eq!(source.matches(from).count(), 1, "{what}: {from:?}");
        let name = format!("{}_{}", key.label(), what.replace([' ', '^', '\''], "_"));
        let bug = source.replace(from, to);
        let exe = build_emulation_of(&cxx, dir.path(), &key, &bug, &name, false, defines);
        let (report, passed) = run_emulation(&exe, &case);
        assert!(!passed, "{what} went unnoticed:\n{report}");
    }
}

/// The FP8 forward's four variants through NVRTC for sm_90a and ptxas:
/// no spills, no serialized wgmma or ignored setmaxnreg (C7510, C7508),
/// and (with FLASHATTN_NVDISASM) its products are QGMMA on E4M3 in SASS,
/// P's conversion F2FP.SATFINITE.E4M3 ([`FP8_OPS`]).
#[test]
fn the_fp8_hopper_forward_assembles_without_spills_on_e4m3_qgmma() {
    if !nvrtc_or_waive() {
        return;
    }
    let Some(ptxas_path) = std::env::var_os("FLASHATTN_PTXAS").map(PathBuf::from) else {
        waive(TOOLS_REQUIRED, "no ptxas: FLASHATTN_PTXAS is not set");
        return;
    };
    let keys: Vec<KernelKey> = KernelKey::all()
        .into_iter()
        .filter(|k| k.is_fp8())
        .collect();
    assert_eq!(keys.len(), 4);
    let faults: Vec<String> = over_cores(&keys, |key| {
        let ptx = compile_ptx_with(
            key,
            "compute_90a",
            options_bounded(key, "compute_90a", None),
        );
        match ptx {
            Ok(ptx) => assembly_faults(&ptxas_path, key, &ptx, "sm_90a"),
            Err(e) => vec![e.to_string()],
        }
    })
    .into_iter()
    .flatten()
    .collect();
    assert!(faults.is_empty(), "{}", faults.join("\n"));
}

/// Runs `case` on `key` as it is (it must pass), then with each bug put in
/// (each must fail).
fn bugs_fail(
    cxx: &std::ffi::OsStr,
    dir: &Path,
    key: &KernelKey,
    case: &[String],
    bugs: &[(&str, &str, &str)],
) {
    let source = key.source();
    let (report, passed) = run_emulation(&build_emulation(cxx, dir, key, false, &[]), case);
    assert!(passed, "the kernel as it is:\n{report}");
    for (what, from, to) in bugs {
        assert_eq!(source.matches(from).count(), 1, "{what}: {from:?}");
        let name = format!("{}_{}", key.label(), what.replace(' ', "_"));
        let exe = build_emulation_of(cxx, dir, key, &source.replace(from, to), &name, false, &[]);
        let (report, passed) = run_emulation(&exe, case);
        assert!(!passed, "{what} went unnoticed:\n{report}");
    }
}

/// Dropout's variants under the same emulation (the scalar and sm80
/// forwards and backwards; the Hopper forward has none, the plan sends
/// dropout to the sm80 one): check.cpp's cases against its double
/// reference drawing the same mask (GQA, head dims below the compiled one,
/// lengths off the tiles, causal windows, rows with no key; the layouts on
/// the scalar forward and the sm80 backward: a packed batch's sequences
/// draw their own streams), then the mask each kernel implies (check.cpp's
/// `mask`: read off o, dQ and dV) against [`flashattn::dropout_mask`] bit
/// for bit, from an offset whose low word carries within the problem.
#[test]
fn dropout_kernels_match_a_double_reference_and_the_mask_under_host_emulation() {
    let Some(cxx) = compiler() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for (family, precision, d, softcap, layouts) in [
        (Family::Forward, Precision::F32, 64, false, true),
        (Family::Backward, Precision::F16, 64, true, false),
        (Family::ForwardMma, Precision::Bf16, 128, false, false),
        (Family::BackwardMma, Precision::F16, 96, true, true),
    ] {
        let key = KernelKey::new(family, precision, d, true, softcap).with_dropout(true);
        let exe = build_emulation(&cxx, dir.path(), &key, layouts, &[]);
        let (report, passed) = run_emulation(&exe, &[]);
        if !passed {
            failures.push(format!("{}:\n{report}", key.label()));
        }
        failures.extend(implied_mask_faults(&exe, &key));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// check.cpp's `mask` on an emulation build of a dropout variant against
/// `dropout_mask`: a line naming each output whose implied mask differs.
fn implied_mask_faults(exe: &Path, key: &KernelKey) -> Vec<String> {
    let d = key.head_dim;
    let (sq, sk, hq, hkv, batch) = (d - 3, d - 11, 4, 2, 2);
    let (p, seed, offset) = (0.3f32, 0x0123_4567_89ab_cdefu64, (1u64 << 32) - 5);
    let args = [sq, sk, hq, hkv, batch].map(|n| n.to_string());
    let ran = Command::new(exe)
        .arg("mask")
        .args(args)
        .args([p.to_string(), seed.to_string(), offset.to_string()])
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&ran.stdout);
    let opts = AttentionOptions::default()
        .dropout(p)
        .dropout_seed(seed)
        .dropout_offset(offset);
    let shape = AttentionShape::new(batch, sq, sk, hq, hkv, d).unwrap();
    let want: String = flashattn::dropout_mask(&shape, &opts)
        .unwrap()
        .keep
        .iter()
        .map(|&k| if k { '1' } else { '0' })
        .collect();
    let names: &[&str] = if key.family.is_forward() {
        &["fwd"]
    } else {
        &["dq", "dv"]
    };
    let mut faults = Vec::new();
    for name in names {
        let got = out
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name} ")))
            .unwrap_or("");
        let wrong = got
            .chars()
            .zip(want.chars())
            .filter(|(a, b)| a != b)
            .count();
        let kept = got.chars().filter(|&c| c == '1').count();
        eprintln!(
            "{} {name}: implied mask of {} pairs, {kept} kept, {wrong} unlike dropout_mask's",
            key.label(),
            got.len()
        );
        if got.len() != want.len() || wrong > 0 || !ran.status.success() {
            faults.push(format!(
                "{} {name}: {wrong} of {} pairs unlike dropout_mask's ({} printed; {})",
                key.label(),
                want.len(),
                got.len(),
                String::from_utf8_lossy(&ran.stderr)
            ));
        }
    }
    faults
}

/// One of the Hopper smoke test's shapes (scripts/gpu-check.sh's step 3),
/// run on the device and, by check.cpp, under host emulation.
struct Smoke {
    name: &'static str,
    seqlen_q: usize,
    seqlen_k: usize,
    heads: (usize, usize),
    causal: bool,
}

/// One block; two blocks of 128 rows over five key tiles of 128 (the
/// two-stage K/V ring wraps, the barriers' phases flip); 1000 × 1500
/// causal with GQA 4:2 (rows with no key, tiles cut by the band). Each at
/// [`SMOKE_HEAD_DIMS`] in f16 and bf16.
const SMOKE: [Smoke; 3] = [
    Smoke {
        name: "one-block",
        seqlen_q: 100,
        seqlen_k: 120,
        heads: (1, 1),
        causal: false,
    },
    Smoke {
        name: "ring-wraps",
        seqlen_q: 256,
        seqlen_k: 640,
        heads: (1, 1),
        causal: false,
    },
    Smoke {
        name: "gqa-causal",
        seqlen_q: 1000,
        seqlen_k: 1500,
        heads: (4, 2),
        causal: true,
    },
];
const SMOKE_HEAD_DIMS: [usize; 3] = [40, 64, 128];
const SMOKE_PRECISIONS: [Precision; 2] = [Precision::F16, Precision::Bf16];

/// The environment step: the driver's and NVRTC's versions (the PTX NVRTC
/// writes must be one the driver's JIT reads), the device, and the plan it
/// gets for a typical call.
#[test]
fn the_device_and_its_toolchain() {
    let versions = flashattn::cuda::versions();
    eprintln!("{versions}");
    let Some(cuda) = device() else { return };
    let props = cuda.props().clone();
    eprintln!(
        "{}: {} SMs, {} B shared memory per block (opt-in), {} per SM, kernels for {}",
        cuda.describe(),
        props.sms,
        props.smem_per_block_optin,
        props.smem_per_sm,
        cuda.arch()
    );
    let plan = typical_plan(&props, cuda.kernel_path());
    eprintln!("{}", plan.explain(&props).join("\n"));
    let (Some(driver), Some(nvrtc)) = (versions.driver, versions.nvrtc) else {
        panic!("a device opened, yet {versions}");
    };
    // compute_90a needs NVRTC 12; the driver loads PTX of its own CUDA
    // version or older only.
    assert!(nvrtc.0 >= 12, "{versions}: NVRTC 12 or later is needed");
    assert!(
        driver >= nvrtc,
        "{versions}: this driver cannot load the PTX of a newer NVRTC; use the NVRTC of CUDA {}.{} or older",
        driver.0,
        driver.1
    );
}

/// The variants the device runs (its architecture's), through the PTX
/// disk cache over all cores: what every later process then finds there.
#[test]
fn warm_the_ptx_cache() {
    let Some(cuda) = device() else { return };
    let arch = cuda.arch();
    let keys: Vec<KernelKey> = KernelKey::all()
        .into_iter()
        .filter(|k| !k.family.is_wgmma() || arch == "compute_90a")
        .collect();
    let started = std::time::Instant::now();
    let errors = flashattn::cuda::warm_ptx_cache(&keys, &arch);
    eprintln!(
        "{} variants for {arch} in {:.1} s",
        keys.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(errors.is_empty(), "{errors:#?}");
}

/// The Hopper forward on the smoke shapes against the sm80 kernels and the
/// f64 reference, each case's errors printed; every case runs, then any
/// failure fails the test (scripts/gpu-check.sh then turns the Hopper path
/// off). Waived on a device that is not Hopper.
#[test]
fn hopper_smoke_test() {
    let Some(cuda) = device() else { return };
    if cuda.arch() != "compute_90a" {
        waive(
            &["FLASHATTN_REQUIRE_HOPPER"],
            &format!(
                "{} is not a Hopper build: no Hopper forward",
                cuda.describe()
            ),
        );
        return;
    }
    let mut failures = Vec::new();
    for precision in SMOKE_PRECISIONS {
        for d in SMOKE_HEAD_DIMS {
            for s in &SMOKE {
                let opts = AttentionOptions::default().causal(s.causal);
                let case = common::Case::new(s.seqlen_q, s.seqlen_k, d)
                    .heads(s.heads.0, s.heads.1)
                    .precision(precision)
                    .opts(opts);
                let what = format!("{} {} d {d}", s.name, precision.name());
                if let Err(e) = smoke_case(&cuda, &case, &what) {
                    failures.push(e);
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// One smoke case: the Hopper and sm80 forwards against the f64 reference
/// and each other, printed; `Err` names what failed.
fn smoke_case(cuda: &Cuda, case: &common::Case, what: &str) -> Result<(), String> {
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let run = |path| {
        let out = cuda
            .forward_on(path, &ForwardInputs::new(q, k, v), &case.opts)
            .map_err(|e| format!("{what}: {path:?}: {e}"))?;
        let checks = flashattn::accuracy::check_forward(&out, &q, &k, &v, &case.opts)
            .map_err(|e| format!("{what}: reference: {e}"))?;
        Ok::<_, String>((out, checks))
    };
    let (hopper, h) = run(KernelPath::Hopper)?;
    let (sm80, m) = run(KernelPath::Mma)?;
    let (a, b) = (hopper.o.to_f32(), sm80.o.to_f32());
    let apart = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0f32, f32::max);
    eprintln!(
        "smoke {what}: hopper {} | {}; sm80 {} | {}; max |hopper - sm80| {apart:.3e}",
        h[0], h[1], m[0], m[1]
    );
    match h.iter().chain(&m).find(|c| !c.passed()) {
        Some(c) => Err(format!("{what}: {c}")),
        None => Ok(()),
    }
}

/// The driver's own build of the main variants (f16/bf16 at d 64 and 128,
/// every family the device runs, band and softcap both ways; the scalar
/// kernels in f32), loaded the way every call loads them: each kernel's
/// registers, local memory (spills) and shared memory, and a failure if
/// the Hopper forward spills or its JIT log reports serialized wgmma.
/// Run with `CUDA_CACHE_DISABLE=1` so the driver's JIT runs and logs.
#[test]
fn jit_report_of_the_main_variants() {
    let Some(cuda) = device() else { return };
    let hopper = cuda.arch() == "compute_90a";
    let keys: Vec<KernelKey> = KernelKey::all()
        .into_iter()
        .filter(|k| [64, 128].contains(&k.head_dim))
        .filter(|k| (k.precision == Precision::F32) != (k.family.is_mma() || k.family.is_wgmma()))
        .filter(|k| hopper || !k.family.is_wgmma())
        // f16 is bf16's kernel with another conversion, and softcap adds
        // one tanh per score: the driver's JIT takes about a second a module.
        .filter(|k| !k.softcap && k.precision != Precision::F16)
        .collect();
    // Each report printed whole as it comes, so a timeout keeps what ran.
    let faults = over_cores(&keys, |k| match cuda.module_report(*k) {
        Ok(r) => {
            let mut text = r.lines().join("\n");
            if r.key.family.is_wgmma() {
                text = format!("{text}\n{}", r.log.text());
            }
            eprintln!("{text}");
            r.faults()
        }
        Err(e) => vec![e.to_string()],
    });
    let faults: Vec<String> = faults.into_iter().flatten().collect();
    assert!(faults.is_empty(), "{}", faults.join("\n"));
}

/// A few tiny cases on this process's kernel path (`FLASHATTN_CUDA_KERNEL`)
/// for compute-sanitizer (memcheck, synccheck, racecheck): a forward and
/// a backward each, under the rule; then two decoding steps (the decode
/// kernels are every path's): a plain paged cache and an int8 one, each
/// appending, in two splits, 24 rows of one kv head (two row chunks).
#[test]
fn tiny_cases_for_the_sanitizer() {
    use common::{causal, Case};
    let Some(cuda) = device() else { return };
    let cases = vec![
        Case::new(33, 47, 64).heads(2, 1).f16().opts(causal()),
        Case::new(17, 130, 128).bf16(),
        Case::new(20, 20, 40).f16().opts(causal().softcap(5.0)),
        Case::new(9, 31, 64)
            .bf16()
            .opts(AttentionOptions::default().sinks(flashattn::Sinks::new(&[0.5, -1.0]))),
        Case::new(33, 47, 64)
            .heads(2, 1)
            .bf16()
            .opts(causal().dropout(0.2).dropout_seed(5)),
    ];
    forward_cases(cuda.kernel_path(), &cuda, cases.clone());
    backward_cases(cuda.kernel_path(), &cuda, cases);
    let decode = common::decode::DecodeCase::new(&[21, 6], 64)
        .heads(8, 1)
        .seqlen_q(3)
        .paged(16)
        .append(3)
        .f16()
        .splits(2)
        .opts(causal());
    let opts = decode.opts.clone();
    let data = decode.data();
    data.check(|cache, step| cuda.decode_host(cache, step, &opts, decode.num_splits));
    data.check_quantized(flashattn::CacheQuant::Int8, |cache, step| {
        cuda.decode_quantized_host(cache, step, &opts, decode.num_splits)
    });
}

/// The GPU checks' Hopper smoke cases ([`SMOKE`]) under host emulation,
/// on the variants the device runs for them, against check.cpp's double
/// reference: what `scripts/gpu-check.sh dry` runs where no GPU is.
#[test]
fn the_hopper_smoke_cases_pass_under_host_emulation() {
    let Some(cxx) = compiler() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for precision in SMOKE_PRECISIONS {
        for padded in [64, 128] {
            for causal in [false, true] {
                let key = KernelKey::new(Family::ForwardWgmma, precision, padded, causal, false);
                let mut args = vec!["cases".to_string()];
                for d in SMOKE_HEAD_DIMS.into_iter().filter(|&d| {
                    key.head_dim
                        == KernelKey::new(Family::ForwardWgmma, precision, d, causal, false)
                            .head_dim
                }) {
                    for s in SMOKE.iter().filter(|s| s.causal == causal) {
                        let right = if s.causal { 0 } else { -1 };
                        args.extend([
                            s.name.to_string(),
                            s.seqlen_q.to_string(),
                            s.seqlen_k.to_string(),
                            "-1".into(),
                            right.to_string(),
                            d.to_string(),
                            s.heads.0.to_string(),
                            s.heads.1.to_string(),
                            "1".into(),
                        ]);
                    }
                }
                if args.len() == 1 {
                    continue;
                }
                let exe = build_emulation(&cxx, dir.path(), &key, false, &[]);
                let (report, passed) = run_emulation(&exe, &args);
                if !passed {
                    failures.push(format!("{}:\n{report}", key.label()));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// cuda/hopper.cuh's bounded mbarrier wait (the define the GPU checks turn
/// on), under host emulation: a wait no arrival completes prints the
/// block, thread, barrier and phase within the bound and traps.
#[test]
fn a_deadlocked_mbarrier_wait_reports_and_traps_under_host_emulation() {
    let Some(cxx) = compiler() else { return };
    let dir = tempfile::tempdir().unwrap();
    let key = KernelKey::new(Family::ForwardWgmma, Precision::F16, 64, false, false);
    let exe = build_emulation(
        &cxx,
        dir.path(),
        &key,
        false,
        &["FLASHATTN_BOUNDED_WAIT_MS=700"],
    );
    let started = std::time::Instant::now();
    let (report, passed) = run_emulation(&exe, &["deadlock".to_string()]);
    let seconds = started.elapsed().as_secs_f64();
    assert!(!passed, "the deadlocked wait returned:\n{report}");
    assert!(
        report.contains(
            "flashattn: mbarrier wait timed out after 700 ms: block (0,0,0) thread 0 barrier 6 phase parity 0"
        ),
        "{report}"
    );
    assert!(report.contains("trap"), "{report}");
    assert!((0.7..5.0).contains(&seconds), "{seconds} s");
}

/// The persistent Hopper forward's schedule, by the kernel's own
/// `item_index` and `enter_item` (check.cpp's `schedule`): causal 8k × 8k,
/// 16 heads, 2 sequences (2,048 items) over 132 blocks. Every item is taken
/// once; each block takes its items longest first; and every block's key
/// tiles are within 1% of the mean (the snake order over the longest-first
/// list: 1.0015 × the mean at most), where the list in its plain order
/// (query blocks fastest), dealt round-robin, spreads them to 8% over.
#[test]
fn the_persistent_hopper_schedule_takes_every_item_once_longest_first_and_balanced() {
    let Some(cxx) = compiler() else { return };
    let dir = tempfile::tempdir().unwrap();
    let key = KernelKey::new(Family::ForwardWgmma, Precision::F16, 64, true, false);
    let exe = build_emulation(&cxx, dir.path(), &key, false, &[]);
    let (n, heads, seqs, blocks) = (8192usize, 16usize, 2usize, 132usize);
    let args = ["schedule", "8192", "8192", "16", "2", "132"].map(String::from);
    let (report, passed) = run_emulation(&exe, &args);
    assert!(passed, "{report}");
    let m_blocks = n / 128;
    let mut seen = vec![0u32; m_blocks * heads * seqs];
    let mut work = Vec::new();
    for line in report.lines().filter(|l| l.starts_with("block ")) {
        let (_, items) = line.split_once(':').unwrap();
        let mut tiles = Vec::new();
        for item in items.split_whitespace() {
            let (at, count) = item.split_once(':').unwrap();
            let [m, h, z] = <[usize; 3]>::try_from(
                at.split(',')
                    .map(|x| x.parse().unwrap())
                    .collect::<Vec<_>>(),
            )
            .unwrap();
            let count: usize = count.parse().unwrap();
            assert_eq!(
                count,
                m + 1,
                "causal: query block {m} sees {} key tiles",
                m + 1
            );
            seen[(z * heads + h) * m_blocks + m] += 1;
            tiles.push(count);
        }
        assert!(
            tiles.windows(2).all(|w| w[0] >= w[1]),
            "not longest first: {line}"
        );
        work.push(tiles.iter().sum::<usize>());
    }
    assert_eq!(work.len(), blocks, "{report}");
    assert!(seen.iter().all(|&c| c == 1), "items taken other than once");
    let spread = |w: &[usize]| {
        let mean = w.iter().sum::<usize>() as f64 / w.len() as f64;
        *w.iter().max().unwrap() as f64 / mean
    };
    let mut plain = vec![0usize; blocks];
    for i in 0..m_blocks * heads * seqs {
        plain[i % blocks] += i % m_blocks + 1;
    }
    let (snake, dealt) = (spread(&work), spread(&plain));
    eprintln!("busiest block / mean: {snake:.4} (plain order dealt round-robin: {dealt:.4})");
    assert!(snake <= 1.01 && dealt > 1.05, "{snake} {dealt}");
}

/// Dropout's generator (cuda/philox.cuh; its values are checked under the
/// host emulation by tests/dropout.rs) builds with NVRTC for sm_80 and
/// sm_90a inside a kernel that draws the known answers and a row of keep
/// bits, as the attention kernels will.
#[test]
fn dropout_generator_compiles_with_nvrtc() {
    if !nvrtc_or_waive() {
        return;
    }
    let philox = include_str!("../cuda/philox.cuh");
    let kernel = r#"
extern "C" __global__ void philox_check(const unsigned int* in, unsigned int* out, int n) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= n) return;
    const unsigned int* c = in + 6 * t;
    const Philox4 r = philox4x32_10(Philox4{c[0], c[1], c[2], c[3]}, c[4], c[5]);
    out[5 * t] = r.x;
    out[5 * t + 1] = r.y;
    out[5 * t + 2] = r.z;
    out[5 * t + 3] = r.w;
    out[5 * t + 4] = dropout_keeps(c[4], c[5], c[2], c[3], 6554u, c[1], (unsigned int)t);
}
"#;
    for (arch, _) in ARCHS {
        let opts = cudarc::nvrtc::CompileOptions {
            options: vec![format!("--gpu-architecture={arch}"), "--std=c++17".into()],
            name: Some("philox_check.cu".into()),
            ..Default::default()
        };
        let src = format!("{philox}\n{kernel}");
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(&src, opts)
            .unwrap_or_else(|e| panic!("{arch}: {e:?}"));
        assert!(ptx.to_src().contains("philox_check"), "{arch}");
    }
}

/// The SASS of kernel `name` in nvdisasm's text of a module (each kernel's
/// addresses start at 0, so loops are found in one at a time).
fn function_sass<'a>(sass: &'a str, name: &str) -> &'a str {
    let header = format!(".section\t.text.{name},");
    let Some(start) = sass.find(&header) else {
        panic!("no {name} in the SASS")
    };
    let body = &sass[start + header.len()..];
    &body[..body.find(".section\t.text.").unwrap_or(body.len())]
}

/// One loop of a kernel's SASS: a backward branch and the instructions from
/// its target to it.
#[derive(Debug)]
struct SassLoop {
    /// Addresses of its first and last instruction (the branch).
    span: (u64, u64),
    /// Instructions in the body, the branch and any inner loop's included.
    instructions: usize,
    /// Tensor-core instructions among them (HGMMA, HMMA).
    mma: usize,
    /// Instructions among them that a forward branch on a warp vote
    /// (`VOTE.ANY P`, then `@!P BRA` past them) skips unless a lane asks:
    /// the sm80 forward's conditional rescale.
    voted: usize,
}

/// The instructions of `body` that forward branches on a warp vote skip:
/// from each `@!P BRA` that follows a `VOTE.ANY P, ...` (P not set again in
/// between) to its target.
fn voted_blocks(body: &[(u64, &str)], labels: &std::collections::HashMap<&str, u64>) -> usize {
    let mut voted = 0;
    let mut vote: Option<&str> = None;
    for &(addr, text) in body {
        if let Some(rest) = text.strip_prefix("VOTE.ANY ") {
            vote = rest.split(',').next().map(str::trim);
            continue;
        }
        let Some(p) = vote else { continue };
        let target = text
            .strip_prefix(&format!("@!{p} BRA "))
            .and_then(|t| t.split("`(").nth(1)?.split(')').next())
            .and_then(|l| labels.get(l).copied());
        if let Some(to) = target.filter(|&to| to > addr) {
            voted += body
                .iter()
                .filter(|(a, _)| (addr + 1..to).contains(a))
                .count();
            vote = None;
        } else if text
            .split_whitespace()
            .nth(1)
            .is_some_and(|d| d.trim_end_matches(',') == p)
        {
            vote = None; // P redefined
        }
    }
    voted
}

/// The loops of `sass` (nvdisasm's text of one kernel): each backward
/// branch (`BRA` to a label at or before it) closes one.
fn sass_loops(sass: &str) -> Vec<SassLoop> {
    let mut code: Vec<(u64, &str)> = Vec::new();
    let mut labels = std::collections::HashMap::new();
    let mut pending: Vec<&str> = Vec::new();
    for line in sass.lines() {
        let t = line.trim();
        if let Some(label) = t.strip_suffix(':').filter(|l| l.starts_with(".L")) {
            pending.push(label);
            continue;
        }
        // "/*0c30*/   @!P0 BRA `(.L_x_12) ;"
        let Some((addr, text)) = t.strip_prefix("/*").and_then(|r| r.split_once("*/")) else {
            continue;
        };
        let (Ok(addr), text) = (u64::from_str_radix(addr.trim(), 16), text.trim()) else {
            continue;
        };
        for l in pending.drain(..) {
            labels.insert(l, addr);
        }
        code.push((addr, text));
    }
    code.iter()
        .filter(|(_, text)| text.contains("BRA "))
        .filter_map(|&(addr, text)| {
            let target = text.split("`(").nth(1)?.split(')').next()?;
            let to = *labels.get(target)?;
            (to <= addr).then_some((to, addr))
        })
        .map(|span| {
            let body: Vec<(u64, &str)> = code
                .iter()
                .copied()
                .filter(|(a, _)| (span.0..=span.1).contains(a))
                .collect();
            SassLoop {
                span,
                instructions: body.len(),
                mma: body
                    .iter()
                    .filter(|(_, t)| t.contains("GMMA") || t.contains("HMMA"))
                    .count(),
                voted: voted_blocks(&body, &labels),
            }
        })
        .collect()
}

/// The interior loop of an attention kernel: the innermost loop holding
/// one trip's tensor-core instructions, `per_trip` (a loop with more holds
/// peeled or unrolled trips, or encloses the interior one); where tiles of
/// several kinds run in loops of their own, the leanest (the unmasked one).
fn interior_loop(loops: &[SassLoop], per_trip: usize) -> Option<&SassLoop> {
    let inside = |a: &SassLoop, b: &SassLoop| {
        a.span != b.span && b.span.0 <= a.span.0 && a.span.1 <= b.span.1
    };
    let trips: Vec<&SassLoop> = loops.iter().filter(|l| l.mma == per_trip).collect();
    trips
        .iter()
        .copied()
        .filter(|l| !trips.iter().any(|i| inside(i, l)))
        .min_by_key(|l| l.instructions)
}

/// The instruction budget of the main forwards (bf16, d 128, no mask): the
/// interior loop's hot path (its SASS, static, inner loops included) per
/// score element a thread computes in one trip (a warp's rows × the tile's
/// keys over its 32 lanes: 16 × 128 for the Hopper forward, 32 × 64 for
/// the sm80 one). The hot path is the loop less the blocks a forward branch
/// on a warp vote skips: the sm80 forward's conditional rescale (FA4's),
/// run only when a lane's part of some row's sum of P, taken against the
/// exponents' reference, passes 2^8, which after a row's first tile is
/// rare; its instructions and the loop's whole static count are printed
/// too (`FLASHATTN_SASS_DIR` keeps each kernel's PTX and SASS there). FA3
/// spends about 5–6. The Hopper forward is held to 8 (measured 7.7: an
/// unmasked tile's loop of its own, ex2 with the scale folded into one
/// FFMA, paired conversions, its descriptors in uniform registers); the
/// sm80 forward to 10 (measured 9.9 on the hot path, 17.0 with the rescale
/// block). Its floor is 9.0: mma.sync's m16n8k16 costs 4 per element at
/// d 128 (d / 64 for S and as many for P·V), `ldmatrix` 1.25 (Q's
/// fragments each tile, K's and V's each serving both row tiles of a
/// warp), the softmax 3.5 (an FFMA, an ex2 and an add per element, a
/// paired conversion per two) and `cp.async` 0.25; the rest is the loads'
/// addresses (a pointer step per 16 rows), two barriers, the vote and the
/// loop.
#[test]
fn the_main_forwards_stay_within_their_instruction_budget() {
    if !nvrtc_or_waive() {
        return;
    }
    let (Some(ptxas), Some(nvdisasm)) = (
        std::env::var_os("FLASHATTN_PTXAS"),
        std::env::var_os("FLASHATTN_NVDISASM"),
    ) else {
        waive(
            TOOLS_REQUIRED,
            "no ptxas or nvdisasm: FLASHATTN_PTXAS and FLASHATTN_NVDISASM name them",
        );
        return;
    };
    let mut over = Vec::new();
    let bf16 = |family| KernelKey::new(family, Precision::Bf16, 128, false, false);
    for (key, arch, sm, ceiling) in [
        (bf16(Family::ForwardWgmma), "compute_90a", "sm_90a", 8.0),
        (
            KernelKey::fp8_forward(128, false, false),
            "compute_90a",
            "sm_90a",
            8.0,
        ),
        (bf16(Family::ForwardMma), "compute_80", "sm_80", 10.0),
    ] {
        let family = key.family;
        let ptx = compile_ptx_with(&key, arch, options_bounded(&key, arch, None)).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let (src, cubin) = (dir.path().join("k.ptx"), dir.path().join("k.cubin"));
        std::fs::write(&src, ptx.to_src()).unwrap();
        let assembled = Command::new(&ptxas)
            .arg(format!("--gpu-name={sm}"))
            .arg(&src)
            .arg("-o")
            .arg(&cubin)
            .status()
            .unwrap();
        assert!(assembled.success(), "ptxas failed on {}", key.label());
        let out = Command::new(&nvdisasm)
            .arg("-c")
            .arg(&cubin)
            .output()
            .unwrap();
        assert!(out.status.success(), "nvdisasm failed on {}", key.label());
        let sass = String::from_utf8_lossy(&out.stdout);
        // For reading the loops (docs/cuda.md): each kernel's SASS kept there.
        if let Some(keep) = std::env::var_os("FLASHATTN_SASS_DIR") {
            let to = Path::new(&keep).join(format!("{}.{sm}", key.label()));
            std::fs::write(to.with_extension(format!("{sm}.sass")), sass.as_bytes()).unwrap();
            std::fs::copy(&src, to.with_extension(format!("{sm}.ptx"))).unwrap();
        }
        let loops = sass_loops(function_sass(&sass, "flash_fwd"));
        // One trip's products: S (a warp's rows × the tile's keys, k 16 at
        // a time) and P·V, in m64nNk16 (wgmma, 16 rows a warp) or m16n8k16
        // (mma: rows / 16 row tiles a warp) steps.
        let (d, t) = (key.head_dim, key.tiles());
        let keys = t.keys;
        let rows = match family {
            Family::ForwardWgmma => 16,
            _ => t.rows / t.warps(),
        };
        let per_trip = match family {
            // k 32 a step on e4m3 codes
            Family::ForwardWgmma if key.is_fp8() => d / 32 + keys / 32,
            Family::ForwardWgmma => d / 16 + keys / 16,
            _ => rows / 16 * (keys / 8 * (d / 16) + d / 8 * (keys / 16)),
        };
        let interior = interior_loop(&loops, per_trip).unwrap_or_else(|| {
            panic!(
                "{}: no loop holds one trip's {per_trip} tensor-core instructions",
                key.label()
            )
        });
        let elements = rows * keys / 32;
        let hot = interior.instructions - interior.voted;
        let per_element = hot as f64 / elements as f64;
        eprintln!(
            "{} {sm}: interior loop {} instructions ({} tensor-core; {:.1} per element), \
             {} of them skipped by a warp vote, {hot} on the hot path; {elements} score elements \
             per thread and trip: {per_element:.1} per element on the hot path (ceiling {ceiling})",
            key.label(),
            interior.instructions,
            interior.mma,
            interior.instructions as f64 / elements as f64,
            interior.voted,
        );
        if per_element > ceiling {
            over.push(format!("{}: {per_element:.1} > {ceiling}", key.label()));
        }
    }
    assert!(over.is_empty(), "past the instruction budget: {over:?}");
}

/// One decoding step's kernels (cuda/flash_decode.cu) run under host
/// emulation by cuda/emulate/decode.cpp on `cache` (plain or quantized,
/// updated in place from the emulated device cache), with the inputs,
/// variant, splits and grids src/cuda/decode.rs computes for a device of
/// 132 SMs: the step's output.
fn emulate_decode(
    exes: &mut std::collections::HashMap<String, PathBuf>,
    cxx: &std::ffi::OsStr,
    dir: &Path,
    cache: flashattn::cuda::decode::HostCache,
    step: &flashattn::DecodeStep,
    opts: &AttentionOptions,
    num_splits: Option<usize>,
) -> (flashattn::DecodeOutput, Vec<Vec<u8>>) {
    use flashattn::cuda::decode::emulated_step;
    let run = emulated_step(cache, step, opts, num_splits, 132).expect("a valid step");
    let exe = exes
        .entry(run.key.label())
        .or_insert_with(|| build_harness(cxx, dir, &run.key, "decode.cpp"))
        .clone();
    let blobs = run_harness(&exe, dir, &run.blobs, &run.key.label());
    let p = &run.problem;
    let o = flashattn::TensorData::from_bytes(&blobs[0], p.precision, p.o_len()).unwrap();
    let lse = blobs[1]
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let out = flashattn::DecodeOutput::new(p, o, lse, run.splits, Default::default());
    (out, blobs[2..].to_vec())
}

/// Builds `key`'s source after cuda/emulate/host.h and before the
/// harness `harness` (a file of cuda/emulate/ with its own `main`).
fn build_harness(cxx: &std::ffi::OsStr, dir: &Path, key: &KernelKey, harness: &str) -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("cuda/emulate");
    let host = std::fs::read_to_string(root.join("host.h")).unwrap();
    let main = std::fs::read_to_string(root.join(harness)).unwrap();
    let src = dir.join(format!("{}.cpp", key.label()));
    std::fs::write(&src, format!("{host}\n{}\n{main}", key.source())).unwrap();
    let exe = dir.join(key.label());
    compile_cpp(cxx, &src, &exe, &[], &key.label());
    exe
}

/// `src` built by `cxx` into `exe` as every emulation is (C++20, -O1,
/// threads), with `defines` as `-D` flags; a failure names `what`.
fn compile_cpp(cxx: &std::ffi::OsStr, src: &Path, exe: &Path, defines: &[&str], what: &str) {
    let built = Command::new(cxx)
        .args(["-std=c++20", "-O1", "-pthread"])
        .args(defines.iter().map(|d| format!("-D{d}")))
        .arg("-o")
        .arg(exe)
        .arg(src)
        .output()
        .unwrap();
    assert!(
        built.status.success(),
        "{what}: {}",
        String::from_utf8_lossy(&built.stderr)
    );
}

/// Runs a harness on `inputs` (each framed as a u64 length and its
/// bytes, the harness's framing both ways): its output blobs.
fn run_harness(exe: &Path, dir: &Path, inputs: &[Vec<u8>], what: &str) -> Vec<Vec<u8>> {
    let (input, output) = (dir.join("harness.in"), dir.join("harness.out"));
    let mut bytes = Vec::new();
    for b in inputs {
        bytes.extend((b.len() as u64).to_le_bytes());
        bytes.extend(b);
    }
    std::fs::write(&input, bytes).unwrap();
    let (report, passed) = run_emulation(
        exe,
        &[input.display().to_string(), output.display().to_string()],
    );
    assert!(passed, "{what}: {report}");
    let data = std::fs::read(&output).unwrap();
    let mut blobs = Vec::new();
    let mut at = 0;
    while at < data.len() {
        let n = u64::from_le_bytes(data[at..at + 8].try_into().unwrap()) as usize;
        blobs.push(data[at + 8..at + 8 + n].to_vec());
        at += 8 + n;
    }
    blobs
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// The FP8 forward's quantization (cuda/fp8_quant.cu: each head's max,
/// then its codes) under host emulation on the launches src/cuda/
/// fp8_quant.rs computes: codes and scales bit for bit those of
/// src/quant.rs, the rule every FP8 path shares. Head dims off the
/// transform's powers of two (3, 59, 96: zero-padded inside it), with and
/// without the transform, rows padded with zero codes to the stored row,
/// batches of 1, 2 and 3, a sequence of one row; common::fp8's hard heads
/// (zeros, below the smallest scale, subnormal inputs, values saturating at
/// ±448 and exactly on e4m3's rounding ties, magnitudes from 2^-60 to 2^60).
#[test]
fn the_fp8_quantization_gives_the_host_codes_under_host_emulation() {
    use flashattn::cuda::fp8_quant::quant_launch;
    use flashattn::quant::{quantize, Hadamard};
    let Some(cxx) = compiler() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut exes = std::collections::HashMap::new();
    // (shape, transform seed): batch 1 and 2 of common::fp8's hard heads
    // (zeros, below the smallest scale, subnormals, max 448 with values on
    // e4m3's ties, magnitudes from 2^-60 to 2^60).
    let cases: [([usize; 4], Option<u64>); 7] = [
        ([1, 7, 8, 59], None),
        ([2, 7, 4, 59], Some(7)),
        ([1, 5, 6, 96], Some(3)),
        ([1, 6, 5, 128], None),
        ([2, 4, 3, 128], Some(5)),
        ([1, 3, 5, 3], Some(11)),
        ([3, 1, 4, 32], None),
    ];
    let row = flashattn::cuda::kernel::FP8_HEAD_DIM;
    for (shape, seed) in cases {
        let [batch, seqlen, heads, d] = shape;
        let x = common::fp8::quantizer_inputs(batch * heads, seqlen, d);
        let view = flashattn::TensorView::f32(shape, &x);
        let transform = seed.map(|s| Hadamard::new(d, s));
        let host = quantize(&view, "x", transform.as_ref(), row).unwrap();
        let l = quant_launch(shape, transform.as_ref(), row).unwrap();
        let exe = exes
            .entry(l.key.label())
            .or_insert_with(|| build_harness(&cxx, dir.path(), &l.key, "quant.cpp"))
            .clone();
        // SAFETY (of the read): QuantArgs is a #[repr(C)] struct of scalars.
        let args = unsafe {
            std::slice::from_raw_parts(
                &l.args as *const _ as *const u8,
                std::mem::size_of_val(&l.args),
            )
        };
        let signs = transform.as_ref().map_or(vec![1.0], |t| t.signs.clone());
        let inputs = [
            args.to_vec(),
            (l.blocks as i32).to_le_bytes().to_vec(),
            bytemuck::cast_slice(&x).to_vec(),
            bytemuck::cast_slice(&signs).to_vec(),
        ];
        let what = format!("{shape:?} seed {seed:?}");
        let out = run_harness(&exe, dir.path(), &inputs, &what);
        let scales: Vec<u32> = f32s(&out[1]).iter().map(|s| s.to_bits()).collect();
        let want: Vec<u32> = host.scales.iter().map(|s| s.to_bits()).collect();
        assert_eq!(scales, want, "{what}: scales");
        let differ = out[0].iter().zip(&host.codes).position(|(a, b)| a != b);
        assert_eq!(out[0].len(), host.codes.len(), "{what}");
        assert!(
            differ.is_none(),
            "{what}: code {} is {:#x}, the host's {:#x}",
            differ.unwrap_or(0),
            out[0][differ.unwrap_or(0)],
            host.codes[differ.unwrap_or(0)]
        );
    }
}

/// Decoding's kernels (append, split-KV attention, the LSE merge) under
/// host emulation, on the inputs, grids and splits the host code computes:
/// o and lse within docs/semantics.md's rule against the f64 reference
/// (src/reference.rs; on a quantized cache, on its codes' values after the
/// append), and the cache after the step exactly the reference's append —
/// plain rows bit for bit, int8/FP8 codes and scales equal to the rule
/// restated in tests/common/kv_quant.rs (requantization at block
/// boundaries, growing scales). Splits 1, 3 and the planner's; dense rows,
/// shuffled rows (batch_idx) and shuffled pages; GQA and MQA (a kv head's
/// group of query heads × seqlen_q rows in one block, and in more than one
/// when it has more than `DECODE_ROWS`, the last partial); a sequence
/// of no keys; seqlen_q up to 4; causal and window bands; softcap; ALiBi
/// per batch × head; sinks; v's own head dim; odd head dims and ones past
/// 256 (the wide decode variants); quantized latent (MLA) caches; f32,
/// f16, bf16.
#[test]
fn decode_kernels_match_the_reference_and_the_append_rule_under_host_emulation() {
    use common::decode::DecodeCase;
    use flashattn::cuda::decode::HostCache;
    use flashattn::{Alibi, CacheQuant, QuantKvCache, Sinks};
    let Some(cxx) = compiler() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut exes = std::collections::HashMap::new();
    let causal = || AttentionOptions::default().causal(true);
    let per_batch: Vec<f32> = (0..8).map(|e| 0.05 + 0.07 * e as f32).collect();
    let plain = [
        DecodeCase::new(&[0, 70, 5], 32).append(2).splits(3),
        DecodeCase::new(&[37, 100], 32)
            .paged(16)
            .append(3)
            .splits(1)
            .opts(
                AttentionOptions::default()
                    .alibi(Alibi::new(&per_batch))
                    .sinks(Sinks::new(&[0.3, -1.0, 2.0, 0.0])),
            ),
        DecodeCase::new(&[20, 150], 29)
            .dv(24)
            .seqlen_q(3)
            .batch_idx()
            .append(1),
        DecodeCase::new(&[130, 9], 64)
            .heads(8, 1)
            .seqlen_q(4)
            .append(4)
            .f16()
            .splits(3)
            .opts(causal()),
        // 20 rows of one kv head: a full chunk of DECODE_ROWS and a partial one.
        DecodeCase::new(&[200], 50)
            .heads(10, 1)
            .seqlen_q(2)
            .f16()
            .opts(AttentionOptions::default().window(Some(20), Some(0))),
        DecodeCase::new(&[33, 80], 40)
            .heads(3, 3)
            .append(1)
            .bf16()
            .opts(AttentionOptions::default().softcap(5.0).scale(0.3)),
        // Past the forward's 256: an MLA-like group of 16 query heads on
        // one kv head, k at the API's largest head dim, v's its own.
        DecodeCase::new(&[40, 70], 512)
            .dv(448)
            .heads(16, 1)
            .append(1)
            .bf16()
            .splits(2),
    ];
    for case in plain {
        let data = case.data();
        let opts = case.opts.clone();
        data.check(|cache, step| {
            let (out, blobs) = emulate_decode(
                &mut exes,
                &cxx,
                dir.path(),
                HostCache::Plain(cache),
                step,
                &opts,
                case.num_splits,
            );
            let (k, v) = (cache.k.len(), cache.v.len());
            cache.k = flashattn::TensorData::from_bytes(&blobs[0], case.precision, k).unwrap();
            cache.v = flashattn::TensorData::from_bytes(&blobs[1], case.precision, v).unwrap();
            Ok(out)
        });
    }
    let quantized = [
        (
            DecodeCase::new(&[15, 16, 0, 31], 32).append(2),
            CacheQuant::Int8,
        ),
        (
            DecodeCase::new(&[37, 5], 32).paged(16).append(5).splits(3),
            CacheQuant::Int8,
        ),
        (
            DecodeCase::new(&[47, 3], 64)
                .paged(48)
                .append(4)
                .f16()
                .opts(causal()),
            CacheQuant::Fp8,
        ),
        (
            DecodeCase::new(&[100, 9], 32).dv(16).batch_idx().append(17),
            CacheQuant::Fp8,
        ),
        (
            DecodeCase::new(&[20, 33], 320).heads(4, 1).append(3),
            CacheQuant::Int8,
        ),
        // Latent (MLA): V K's codes at K's scales, none of its own (the
        // harness's V blobs come back empty).
        (
            DecodeCase::new(&[20, 37], 576)
                .dv(512)
                .heads(16, 1)
                .paged(16)
                .latent()
                .append(2)
                .f16()
                .splits(2),
            CacheQuant::Int8,
        ),
        (
            DecodeCase::new(&[29, 5], 59)
                .dv(37)
                .heads(4, 2)
                .seqlen_q(2)
                .latent()
                .append(3)
                .opts(causal()),
            CacheQuant::Fp8,
        ),
    ];
    for (case, quant) in quantized {
        let data = case.data();
        let opts = case.opts.clone();
        data.check_quantized(quant, |cache, step| {
            let (out, blobs) = emulate_decode(
                &mut exes,
                &cxx,
                dir.path(),
                HostCache::Quant(cache),
                step,
                &opts,
                case.num_splits,
            );
            cache.k.codes = blobs[0].clone();
            cache.v.codes = blobs[1].clone();
            cache.k.scales = f32s(&blobs[2]);
            cache.v.scales = f32s(&blobs[3]);
            Ok(out)
        });
    }
    // The block-boundary fixture: token 15 grows block 0's scale (its 15
    // codes requantized), token 16 opens block 1 at a scale 30 times larger.
    let boundary = common::kv_quant::BoundaryCase::new();
    for quant in CacheQuant::ALL {
        let before = QuantKvCache::quantize(&boundary.plain, quant).unwrap();
        let mut cache = before.clone();
        let step = boundary.step();
        let opts = AttentionOptions::default();
        let (_, blobs) = emulate_decode(
            &mut exes,
            &cxx,
            dir.path(),
            HostCache::Quant(&cache),
            &step,
            &opts,
            None,
        );
        cache.k.codes = blobs[0].clone();
        cache.v.codes = blobs[1].clone();
        cache.k.scales = f32s(&blobs[2]);
        cache.v.scales = f32s(&blobs[3]);
        let expected = common::kv_quant::expected_append(&before, &step);
        assert!(
            cache == expected,
            "{quant:?}: the boundary append differs from the rule"
        );
        assert!(
            cache.k.scales[0] > before.k.scales[0],
            "{quant:?}: block 0's scale did not grow"
        );
    }
}

/// DeepSeek's MLA under host emulation: latent caches (one tensor, V the
/// first 512 of K's 576 columns, read through K's strides; appends of
/// k_new alone) of 128 query heads on one kv head, seqlen_q 1 and 4,
/// dense and paged, one split and several, f32/f16/bf16, and a small odd
/// latent cache of two kv heads (V's head stride K's head dim, not V's);
/// o and lse against the f64 reference and the cache exactly the
/// reference's append. Then bad latent input, typed by the host code a
/// device step runs (the cache untouched); quantized latent caches are
/// among the quantized cases above. Short caches: the emulator runs a
/// thread per CUDA thread.
#[test]
fn latent_decode_matches_the_reference_under_host_emulation() {
    use common::decode::DecodeCase;
    use flashattn::cuda::decode::{emulated_step, HostCache};
    let Some(cxx) = compiler() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut exes = std::collections::HashMap::new();
    let causal = || AttentionOptions::default().causal(true);
    let cases = [
        DecodeCase::new(&[9, 70], 576)
            .dv(512)
            .heads(128, 1)
            .latent()
            .append(1)
            .splits(3),
        DecodeCase::new(&[30, 0], 576)
            .dv(512)
            .heads(128, 1)
            .seqlen_q(4)
            .paged(16)
            .latent()
            .append(4)
            .bf16()
            .splits(1)
            .opts(causal()),
        DecodeCase::new(&[12, 40], 576)
            .dv(512)
            .heads(128, 1)
            .batch_idx()
            .latent()
            .f16()
            .splits(2),
        DecodeCase::new(&[29, 5], 59)
            .dv(37)
            .heads(4, 2)
            .seqlen_q(2)
            .paged(7)
            .latent()
            .append(3)
            .f16()
            .opts(causal()),
    ];
    for case in cases {
        let data = case.data();
        common::decode::assert_one_latent_tensor(&data.cache);
        let opts = case.opts.clone();
        let out = data.check(|cache, step| {
            let (out, blobs) = emulate_decode(
                &mut exes,
                &cxx,
                dir.path(),
                HostCache::Plain(cache),
                step,
                &opts,
                case.num_splits,
            );
            assert!(blobs[1].is_empty(), "a latent cache has no V of its own");
            cache.k = flashattn::TensorData::from_bytes(&blobs[0], case.precision, cache.k.len())
                .unwrap();
            Ok(out)
        });
        if let Some(n) = case.num_splits {
            assert_eq!(out.num_splits, n, "{case:?}");
        }
    }
    common::decode::check_latent_rejections(|cache, step| {
        let opts = AttentionOptions::default();
        emulated_step(HostCache::Plain(cache), step, &opts, None, 132)?;
        let (out, _) = emulate_decode(
            &mut exes,
            &cxx,
            dir.path(),
            HostCache::Plain(cache),
            step,
            &opts,
            None,
        );
        Ok(out)
    });
}

//! The CUDA backend where no GPU is needed (feature `cuda`):
//!
//! - without libcuda, opening the backend is `Error::CudaUnavailable`
//!   naming the driver, in one line (no panic);
//! - every kernel variant ([`KernelKey::all`]) compiles with NVRTC to PTX
//!   for sm_80 and sm_90a (the Hopper kernel for sm_90a only), where
//!   libnvrtc loads; with
//!   `FLASHATTN_REQUIRE_NVRTC=1` a missing NVRTC fails instead of skipping;
//! - with `FLASHATTN_PTXAS` pointing at a `ptxas`, the f16/bf16 d 64/128
//!   forward and backward variants (every family, band and softcap, from
//!   the same compile) assemble for sm_80 and sm_90a with no register
//!   spills (registers and shared memory are printed), and the
//!   Hopper forward's for sm_90a with no spills and no wgmma serialized
//!   (and, with `FLASHATTN_NVDISASM` naming an nvdisasm, its SASS holding
//!   HGMMA, UTMALDG and USETMAXREG);
//! - with `FLASHATTN_CXX` naming a C++20 compiler, kernel variants run on
//!   the CPU under cuda/emulate/ against attention in double;
//! - on a device (FLASHATTN_REQUIRE_GPU=1 makes a missing one fail): the
//!   accuracy matrix and the layouts' cases (ALiBi, sinks, block masks,
//!   packed batches, all at once) on both kernel paths, bit-identical
//!   backward repeats (dsinks too), decoding on host caches, and what
//!   stays Unsupported.
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
use flashattn::api::tensor::Precision;
use flashattn::cuda::compile::{compile_ptx, nvrtc_present};
use flashattn::cuda::kernel::{Family, KernelKey};
use flashattn::cuda::{driver_present, Cuda, KernelPath};
use flashattn::{
    AttentionOptions, AttentionShape, Backend, BackendKind, Error, Operation, Workload,
};
use std::path::PathBuf;
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

#[test]
fn without_a_driver_the_backend_is_a_typed_error_naming_it() {
    if driver_present() {
        eprintln!("libcuda loads here: the no-driver error is not reachable");
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
    Workload {
        shape: AttentionShape::new(1, 40, 40, 2, 2, 64).unwrap(),
        precision: Precision::F16,
        opts,
        backward: false,
        operation,
    }
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
    let alibi = AttentionOptions::default().alibi(flashattn::api::scores::Alibi::standard(2));
    flashattn::cuda::takes(&workload(Operation::Attention, alibi.clone())).unwrap();
    flashattn::cuda::takes(&workload(Operation::Decode, AttentionOptions::default())).unwrap();
    for (operation, opts) in [
        (Operation::Fp8, AttentionOptions::default()),
        (Operation::Decode, alibi),
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

/// NVRTC present, or a skip (a failure under FLASHATTN_REQUIRE_NVRTC=1).
fn nvrtc_or_skip() -> bool {
    if nvrtc_present() {
        return true;
    }
    let required = std::env::var("FLASHATTN_REQUIRE_NVRTC").is_ok_and(|v| v == "1");
    assert!(
        !required,
        "FLASHATTN_REQUIRE_NVRTC=1 but libnvrtc does not load (set LD_LIBRARY_PATH)"
    );
    eprintln!("skipped: libnvrtc does not load here");
    false
}

/// The variants ptxas checks for spills (and, in the Hopper ones, for
/// serialized wgmma and an ignored setmaxnreg): f16/bf16 at d 64 and 128,
/// every family (forward and backward), every band/softcap combination.
fn is_main(key: &KernelKey) -> bool {
    key.precision != Precision::F32 && [64, 128].contains(&key.head_dim)
}

/// What ptxas (and nvdisasm, with `FLASHATTN_NVDISASM`) found wrong in one
/// main variant, if anything; its registers and shared memory go to stderr.
fn assembly_faults(ptxas_path: &PathBuf, key: &KernelKey, ptx: &Ptx, sm: &str) -> Vec<String> {
    let (regs, spills, report) = ptxas(ptxas_path, key, ptx, sm);
    eprintln!(
        "{:<40} {sm:<7} registers {regs:?}, spills {spills} B, static shared {} B, dynamic shared {} B",
        key.label(),
        key.shared_bytes(),
        key.dynamic_shared_bytes()
    );
    let mut faults = Vec::new();
    if spills > 0 {
        faults.push(format!("{} {sm}: spills: {report}", key.label()));
    }
    if key.family.is_wgmma() {
        for warning in ["serialized", "C7508", "C7510", "C7515"] {
            if report.contains(warning) {
                faults.push(format!("{} {sm}: {warning}: {report}", key.label()));
            }
        }
        // The Hopper instructions, not a slower path.
        if std::env::var_os("FLASHATTN_NVDISASM").is_some() {
            for op in ["HGMMA.64x128x16.F32", "UTMALDG.4D", "USETMAXREG"] {
                if !report.contains(op) {
                    faults.push(format!("{} {sm}: no {op} in its SASS", key.label()));
                }
            }
        }
    }
    faults
}

/// Every variant to PTX (NVRTC) for sm_80 and sm_90a (the Hopper ones for
/// sm_90a only), spread over the cores; with `FLASHATTN_PTXAS`, the main
/// variants' PTX then to SASS with no spills ([`is_main`]), from the same
/// compile.
#[test]
fn every_kernel_variant_compiles_with_nvrtc_for_sm80_and_sm90a() {
    if !nvrtc_or_skip() {
        return;
    }
    let ptxas_path = std::env::var_os("FLASHATTN_PTXAS").map(PathBuf::from);
    if ptxas_path.is_none() {
        eprintln!("ptxas skipped: FLASHATTN_PTXAS is not set");
    }
    let keys = KernelKey::all();
    let jobs: Vec<(KernelKey, &str, &str)> = keys
        .iter()
        .flat_map(|k| archs(k).iter().map(move |(arch, sm)| (*k, *arch, *sm)))
        .collect();
    let threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let faults: Vec<String> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let (jobs, ptxas_path) = (&jobs, &ptxas_path);
                s.spawn(move || {
                    let mut faults = Vec::new();
                    for (key, arch, sm) in jobs.iter().skip(t).step_by(threads) {
                        match (compile_ptx(key, arch), ptxas_path) {
                            (Err(e), _) => faults.push(e.to_string()),
                            (Ok(ptx), Some(path)) if is_main(key) => {
                                faults.extend(assembly_faults(path, key, &ptx, sm))
                            }
                            _ => {}
                        }
                    }
                    faults
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap())
            .collect()
    });
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
fn ptxas(ptxas: &PathBuf, key: &KernelKey, ptx: &Ptx, sm: &str) -> (Vec<String>, u32, String) {
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
    let number_before = |line: &str, word: &str| -> Option<u32> {
        let at = line.find(word)?;
        line[..at].split_whitespace().last()?.parse().ok()
    };
    let mut registers = Vec::new();
    let mut spills = 0;
    let mut entry = "";
    for line in report.lines() {
        // "Compiling entry function 'flash_fwd' for 'sm_80'" precedes its counts.
        if let Some(rest) = line.split("entry function '").nth(1) {
            entry = rest.split('\'').next().unwrap_or("");
        }
        if let Some(r) = number_before(line, " registers") {
            registers.push(format!("{entry}={r}"));
        }
        spills += number_before(line, " bytes spill stores").unwrap_or(0);
        spills += number_before(line, " bytes spill loads").unwrap_or(0);
    }
    (registers, spills, report)
}

mod common;

/// The backend on this machine's device, or `None` (a notice; a failure
/// under FLASHATTN_REQUIRE_GPU=1, as scripts/gpu-check.sh runs it).
fn device() -> Option<Cuda> {
    match Cuda::new() {
        Ok(c) => {
            eprintln!("CUDA tests run on {}", c.describe());
            Some(c)
        }
        Err(e) => {
            let required = std::env::var("FLASHATTN_REQUIRE_GPU").is_ok_and(|v| v == "1");
            assert!(!required, "FLASHATTN_REQUIRE_GPU=1 but no CUDA device: {e}");
            eprintln!("skipped: no CUDA device: {e}");
            None
        }
    }
}

/// The accuracy matrix: head dims off and on the compile step, every
/// storage precision, masks (with empty rows: more queries than keys under
/// causal), softcap, GQA/MQA and lengths that are not multiples of a tile.
fn matrix() -> Vec<common::Case> {
    use common::{causal, window, Case};
    let mut cases = Vec::new();
    for precision in [Precision::F32, Precision::F16, Precision::Bf16] {
        for d in [1, 40, 64, 128, 200, 256] {
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

/// The device's backend on each kernel path: the chosen ones (the
/// tensor-core kernels for f16/bf16 up to d 128, the Hopper forward on 9.x),
/// the scalar kernels forced, and on Hopper the sm80 kernels forced.
fn paths(cuda: Cuda) -> Vec<(KernelPath, Cuda)> {
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

/// Every case's forward on `cuda` (kernel path `path`) under the rule.
fn forward_cases(path: KernelPath, cuda: &Cuda, cases: Vec<common::Case>) {
    for case in cases {
        let inputs = case.inputs();
        let [q, k, v] = inputs.views();
        let out = cuda
            .forward(&q, &k, &v, &case.opts)
            .unwrap_or_else(|e| panic!("{path:?} {case:?}: {e}"));
        common::assert_accurate(&case, &inputs, &out);
    }
}

#[test]
fn forward_meets_the_accuracy_rule_on_the_device() {
    let Some(cuda) = device() else { return };
    for (path, cuda) in paths(cuda) {
        forward_cases(path, &cuda, matrix());
    }
}

#[test]
fn f16_and_bf16_run_on_tensor_cores_where_the_device_has_them() {
    let Some(cuda) = device() else { return };
    let props = cuda.props().clone();
    let problem = flashattn::cuda::plan::PlanProblem {
        precision: Precision::Bf16,
        head_dim: 128,
        band: true,
        softcap: false,
        layouts: false,
    };
    let plan = flashattn::cuda::plan::plan(&props, &problem, KernelPath::Auto).unwrap();
    eprintln!("{}", plan.explain(&props).join("\n"));
    let forward = match props.major {
        9 => Family::ForwardWgmma,
        _ => Family::ForwardMma,
    };
    assert_eq!(plan.forward.family, forward, "{props:?}");
    assert_eq!(plan.backward.family, Family::BackwardMma, "{props:?}");
}

#[test]
fn backward_meets_the_accuracy_rule_and_repeats_bit_for_bit() {
    let Some(cuda) = device() else { return };
    for (path, cuda) in paths(cuda) {
        eprintln!("backward on the {path:?} path");
        backward_matrix(&cuda);
    }
}

fn backward_matrix(cuda: &Cuda) {
    backward_cases(cuda, matrix());
}

/// Forward, then the backward checked against the f64 reference (dsinks
/// too, with sinks) and repeated: bit-identical gradients and dsinks.
fn backward_cases(cuda: &Cuda, cases: Vec<common::Case>) {
    for case in cases {
        let inputs = case.inputs();
        let [q, k, v] = inputs.views();
        let fwd = cuda
            .forward(&q, &k, &v, &case.opts)
            .unwrap_or_else(|e| panic!("{case:?}: {e}"));
        let (_, g) = common::output_grad(&case);
        let d_o = inputs.grad(&g);
        let bwd_inputs = flashattn::BackwardInputs::new([q, k, v], &fwd, d_o).unwrap();
        let out = cuda
            .backward(&bwd_inputs, &case.opts)
            .unwrap_or_else(|e| panic!("{case:?}: {e}"));
        let checks =
            flashattn::accuracy::check_backward(&out, &q, &k, &v, &d_o, &case.opts).unwrap();
        for c in &checks {
            assert!(c.passed(), "{case:?}\n{c}");
        }
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
    use flashattn::api::scores::{Alibi, Sinks};
    use flashattn::AttentionOptions;
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
        let out = cuda.forward(&q, &k, &v, &case.opts).unwrap();
        let (o, sinks) = (out.o.to_f32(), case.opts.sinks.as_ref().unwrap());
        for h in 0..2 {
            for i in 0..30 {
                assert_eq!(out.lse[h * 40 + i], sinks.logits()[h], "{path:?} row {i}");
                assert!(o[(i * 2 + h) * 32..][..32].iter().all(|&x| x == 0.0));
            }
        }
    }
}

#[test]
fn layouts_backward_meets_the_accuracy_rule_and_repeats_bit_for_bit() {
    let Some(cuda) = device() else { return };
    for (path, cuda) in paths(cuda) {
        eprintln!("layouts backward on the {path:?} path");
        backward_cases(&cuda, layout_cases());
    }
}

/// Decoding (tests/common/decode.rs's cases: dense and paged caches,
/// appends, batch indices, seqlen_q 1–16, GQA/MQA, masks, softcap, every
/// precision, lengths 0–8192, every num_splits) against the f64 reference,
/// the cache updated exactly.
#[test]
fn decoding_matches_the_reference_on_the_device() {
    let Some(cuda) = device() else { return };
    let backend = flashattn::Backend::Cuda(Box::new(cuda));
    for case in common::decode::cases() {
        let data = case.data();
        data.check(|cache, step| backend.decode(cache, step, &case.opts, case.num_splits));
    }
}

/// What the CUDA backend still does not take: a v head dim of its own,
/// FP8, and layouts in decoding (which no backend takes): typed errors,
/// never a panic, and the cache untouched.
#[test]
fn what_stays_unsupported_is_a_typed_error() {
    let Some(cuda) = device() else { return };
    let case = common::Case::new(8, 8, 16).dv(8);
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    assert!(matches!(
        cuda.forward(&q, &k, &v, &case.opts),
        Err(Error::Unsupported { .. })
    ));
    let backend = flashattn::Backend::Cuda(Box::new(cuda));
    let case = common::Case::new(8, 8, 16);
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let fp8 = backend.forward_fp8(
        [&q, &k, &v],
        &case.opts,
        &flashattn::Fp8Options::default(),
        &Default::default(),
    );
    assert!(matches!(fp8, Err(Error::Unsupported { .. })), "{fp8:?}");
    let data = common::decode::DecodeCase::new(&[5, 9], 16)
        .append(2)
        .data();
    let mut cache = data.cache.clone();
    let sinks =
        flashattn::AttentionOptions::default().sinks(flashattn::api::scores::Sinks::new(&[0.5]));
    let out = backend.decode(&mut cache, &data.step(), &sinks, None);
    assert!(matches!(out, Err(Error::Unsupported { .. })), "{out:?}");
    assert!(cache == data.cache, "a refused step left the cache changed");
}

/// Builds `key`'s source with cuda/emulate/host.h and check.cpp under
/// `cxx`, runs it (with check.cpp's layout cases too where `layouts`), and
/// returns the failure report, if any.
fn emulate(
    cxx: &std::ffi::OsStr,
    dir: &std::path::Path,
    key: &KernelKey,
    layouts: bool,
) -> Option<String> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("cuda/emulate");
    let host = std::fs::read_to_string(root.join("host.h")).unwrap();
    let check = std::fs::read_to_string(root.join("check.cpp")).unwrap();
    let src = dir.join(format!("{}.cpp", key.label()));
    let exe = dir.join(key.label());
    let cases = format!("#define LAYOUT_CASES {}\n", u8::from(layouts));
    std::fs::write(&src, format!("{cases}{host}\n{}\n{check}", key.source())).unwrap();
    let started = std::time::Instant::now();
    let built = Command::new(cxx)
        .args(["-std=c++20", "-O1", "-pthread", "-o"])
        .arg(&exe)
        .arg(&src)
        .output()
        .unwrap();
    assert!(
        built.status.success(),
        "{}: {}",
        key.label(),
        String::from_utf8_lossy(&built.stderr)
    );
    let build_seconds = started.elapsed().as_secs_f64();
    let ran = Command::new(&exe).output().unwrap();
    let report = String::from_utf8_lossy(&ran.stdout);
    eprintln!(
        "{} (built in {build_seconds:.1} s, ran in {:.1} s)\n{report}{}",
        key.label(),
        started.elapsed().as_secs_f64() - build_seconds,
        String::from_utf8_lossy(&ran.stderr)
    );
    (!ran.status.success()).then(|| format!("{}:\n{report}", key.label()))
}

/// The C++20 compiler `FLASHATTN_CXX` names, or a skip.
fn cxx_or_skip() -> Option<std::ffi::OsString> {
    let cxx = std::env::var_os("FLASHATTN_CXX");
    if cxx.is_none() {
        eprintln!("skipped: FLASHATTN_CXX is not set");
    }
    cxx
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
    let Some(cxx) = cxx_or_skip() else { return };
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

/// The tensor-core kernels under the same emulation, where cuda/emulate/
/// host.h gives mma.sync m16n8k16, ldmatrix (.x1/.x2/.x4, .trans) and
/// cp.async (held back until its group is waited for) their PTX per-lane
/// fragment semantics: f16 and bf16, d 64 and 128 and 96 (compiled; check.cpp
/// runs head dims 5 and 8 below and at it: element-wise and cp.async loads),
/// causal and not, softcap, GQA, seqlen_q ≠ seqlen_k, 113 × 113, and the
/// layouts on the d 96 band + softcap builds (f16 forward, bf16 backward);
/// first, every wrapper (ldmatrix .x4/.x2/.x1, .x2/.x1 .trans, mma) against
/// a plain product.
#[test]
fn tensor_core_kernels_match_a_double_reference_under_host_emulation() {
    let Some(cxx) = cxx_or_skip() else { return };
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
            failures.extend(emulate(&cxx, dir.path(), &key, i == 2));
        }
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
/// at it, GQA, 45 × 70, 70 × 45, 113 × 113 and 150 × 530 (the ring wraps).
#[test]
fn the_hopper_forward_matches_a_double_reference_under_host_emulation() {
    let Some(cxx) = cxx_or_skip() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut failures = Vec::new();
    for (precision, d, band, softcap) in [
        (Precision::F16, 64, true, false),
        (Precision::Bf16, 128, false, true),
        (Precision::F16, 128, false, false),
    ] {
        let key = KernelKey::new(Family::ForwardWgmma, precision, d, band, softcap);
        failures.extend(emulate(&cxx, dir.path(), &key, false));
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

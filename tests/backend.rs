//! Choosing a backend: explicit choices open what was asked; `auto` takes a
//! hardware GPU, else times the CPU adapters against the CPU backend on a
//! slice of the problem, and always says why.

mod common;

use flashattn::choice::{choose_with, Decision, ProbeCache};
use flashattn::{
    AttentionOptions, AttentionShape, Backend, BackendKind, Error, Precision, Workload,
};

fn workload(d: usize) -> Workload {
    Workload::new(
        AttentionShape::new(1, 300, 300, 4, 2, d).unwrap(),
        Precision::F32,
        AttentionOptions::default().causal(true),
    )
    .backward(true)
}

#[test]
fn explicit_backends_open_what_was_asked() {
    let cpu = Backend::open(BackendKind::Cpu, &workload(64)).unwrap();
    assert!(matches!(cpu.backend, Backend::Cpu));
    cuda_opens_or_says_why(Backend::open(BackendKind::Cuda, &workload(64)));
    assert!(matches!(
        "tpu".parse::<BackendKind>(),
        Err(Error::UnknownName {
            what: "backend",
            ..
        })
    ));
    if common::engine().is_some() {
        let gpu = Backend::open(BackendKind::Wgpu, &workload(64)).unwrap();
        assert!(matches!(gpu.backend, Backend::Wgpu(_)));
    }
}

/// `--backend cuda`: without the feature, `BackendNotBuilt`; with it, the
/// CUDA backend where a driver and a device exist, else the typed error
/// naming what is missing (here, with no driver: libcuda).
fn cuda_opens_or_says_why(opened: flashattn::Result<flashattn::Choice>) {
    #[cfg(not(feature = "cuda"))]
    assert!(
        matches!(opened, Err(Error::BackendNotBuilt { backend: "cuda" })),
        "{opened:?}"
    );
    #[cfg(feature = "cuda")]
    match (flashattn::cuda::Cuda::new(), opened) {
        (Ok(_), Ok(choice)) => assert!(matches!(choice.backend, Backend::Cuda(_))),
        (Err(expected), Err(got @ Error::CudaUnavailable { missing })) => {
            assert_eq!(got.to_string(), expected.to_string());
            if !flashattn::cuda::driver_present() {
                assert!(missing.contains("libcuda"), "{got}");
            }
        }
        (expected, got) => panic!("expected {expected:?}, got {got:?}"),
    }
}

#[test]
fn auto_says_why_with_the_times_it_measured_and_caches_them() {
    let Some(e) = common::engine() else { return };
    let hardware = e.adapter_info().device_type != flashattn::wgpu::DeviceType::Cpu;
    let dir = tempfile::tempdir().unwrap();
    let cache = ProbeCache::in_dir(dir.path());
    // d 64: lanes and tiled kernels on a CPU adapter with subgroups; d 59: tiled ones.
    for d in [64, 59] {
        let decide = || pollster::block_on(choose_with(&workload(d), Some(&cache))).unwrap();
        let (first, why) = split(decide());
        if hardware {
            assert!(first && why.contains("hardware GPU"), "{why}");
            continue;
        }
        // Every path was timed, and the winner is named with its margin.
        for needle in [
            "took",
            "ms",
            "CPU backend",
            "tiled kernels",
            "using",
            "faster than",
        ] {
            assert!(why.contains(needle), "{why}");
        }
        assert_eq!(why.contains("lanes kernels"), d == 64, "{why}");
        // The second call takes the cached winner without timing again.
        let (second, cached) = split(decide());
        assert_eq!(first, second);
        assert!(
            cached.starts_with(&why) && cached.contains("cached in"),
            "{cached}"
        );
    }
}

/// Whether the decision is a GPU engine, and its reason.
fn split(d: Decision) -> (bool, String) {
    match d {
        Decision::Gpu(_, why) => (true, why),
        Decision::Cpu(why) => (false, why),
    }
}

//! Choosing a backend: explicit choices open what was asked; `auto` takes a
//! hardware GPU, else times the CPU adapters against the CPU backend on a
//! slice of the problem, and always says why.

mod common;

use flashattn::{
    AttentionOptions, AttentionShape, Backend, BackendKind, Error, Precision, Workload,
};

fn workload(d: usize) -> Workload {
    Workload {
        shape: AttentionShape::new(1, 300, 300, 4, 2, d).unwrap(),
        precision: Precision::F32,
        opts: AttentionOptions::default().causal(true),
        backward: true,
    }
}

#[test]
fn explicit_backends_open_what_was_asked() {
    let cpu = Backend::open(BackendKind::Cpu, &workload(64)).unwrap();
    assert!(matches!(cpu.backend, Backend::Cpu));
    assert!(matches!(
        Backend::open(BackendKind::Cuda, &workload(64)),
        Err(Error::BackendNotBuilt { backend: "cuda" })
    ));
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

#[test]
fn auto_says_why_with_the_times_it_measured() {
    let Some(e) = common::engine() else { return };
    let hardware = e.adapter_info().device_type != flashattn::wgpu::DeviceType::Cpu;
    // d 64: lanes kernels on a CPU adapter with subgroups; d 59: tiled ones.
    for d in [64, 59] {
        let choice = Backend::open(BackendKind::Auto, &workload(d)).unwrap();
        if hardware {
            assert!(matches!(choice.backend, Backend::Wgpu(_)));
            assert!(choice.reason.contains("hardware GPU"), "{}", choice.reason);
        } else {
            // Both sides were timed, and the winner is named.
            for needle in ["took", "ms", "CPU backend", "using"] {
                assert!(choice.reason.contains(needle), "{}", choice.reason);
            }
        }
    }
}

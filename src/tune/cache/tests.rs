//! The cache's keys and lines, without a device.

use super::*;

fn info(driver_info: &str) -> wgpu::AdapterInfo {
    wgpu::AdapterInfo {
        name: "llvmpipe (LLVM 15.0.6, 256 bits)".into(),
        driver: "llvmpipe".into(),
        driver_info: driver_info.into(),
        ..wgpu::AdapterInfo::new(wgpu::DeviceType::Cpu, wgpu::Backend::Vulkan)
    }
}

fn shape(n: usize, d: usize) -> AttentionShape {
    AttentionShape::new(1, n, n, 2, 2, d).unwrap()
}

fn key(pass: Pass, n: usize, d: usize, precision: Precision, mask: MaskKind) -> TuneKey {
    TuneKey::new(&info("Mesa 22.3.6"), pass, &shape(n, d), precision, mask)
}

#[test]
fn overrides_round_trip_through_their_text() {
    let all = PlanOverrides {
        br: Some(32),
        bc: Some(16),
        threads_per_row: Some(4),
        max_workgroup_storage: Some(16384),
        f16_native: Some(false),
        kernel: Some(KernelFamily::Tiled),
        rows_per_thread: None,
        subgroup_reduce: None,
        double_buffer: None,
    };
    let registers = PlanOverrides {
        kernel: Some(KernelFamily::Registers),
        rows_per_thread: Some(2),
        subgroup_reduce: Some(true),
        double_buffer: Some(false),
        ..Default::default()
    };
    let lanes = PlanOverrides {
        kernel: Some(KernelFamily::Lanes),
        ..Default::default()
    };
    for o in [all, lanes, registers, PlanOverrides::default()] {
        assert_eq!(parse_overrides(&overrides_text(&o)), Some(o), "{o:?}");
    }
    assert_eq!(overrides_text(&PlanOverrides::default()), "formula");
    assert_eq!(
        overrides_text(&all),
        "kernel=tiled br=32 bc=16 threads_per_row=4 max_workgroup_storage=16384 f16_native=false"
    );
    for bad in [
        "",
        "br",
        "br=x",
        "br=-1",
        "speed=3",
        "kernel=fast",
        "formula br=4",
    ] {
        assert_eq!(parse_overrides(bad), None, "{bad:?}");
    }
}

#[test]
fn every_part_of_the_key_keeps_winners_apart() {
    let base = key(Pass::Forward, 128, 64, Precision::F32, MaskKind::None);
    assert_eq!(
        base.to_string(),
        format!(
            "llvmpipe (LLVM 15.0.6, 256 bits) | Vulkan | llvmpipe | Mesa 22.3.6 | flashattn {}; \
             forward d 64 dv 64 f32 mask none seqlen<=128",
            env!("CARGO_PKG_VERSION")
        )
    );
    let others = [
        key(Pass::Backward, 128, 64, Precision::F32, MaskKind::None),
        key(Pass::Forward, 129, 64, Precision::F32, MaskKind::None),
        key(Pass::Forward, 128, 128, Precision::F32, MaskKind::None),
        key(Pass::Forward, 128, 64, Precision::F16, MaskKind::None),
        key(Pass::Forward, 128, 64, Precision::F32, MaskKind::Causal),
        TuneKey::new(
            &info("Mesa 24.0"),
            Pass::Forward,
            &shape(128, 64),
            Precision::F32,
            MaskKind::None,
        ),
        TuneKey::new(
            &info("Mesa 22.3.6"),
            Pass::Forward,
            &shape(128, 64).with_head_dim_v(32).unwrap(),
            Precision::F32,
            MaskKind::None,
        ),
    ];
    for other in &others {
        assert_ne!(other.to_string(), base.to_string());
    }
    // Sequence lengths within one power-of-two bucket share a winner.
    assert_eq!(
        key(Pass::Forward, 100, 64, Precision::F32, MaskKind::None),
        base
    );
    assert_eq!(
        [1, 2, 3, 100, 128, 129].map(|n| seqlen_bucket(n, 1)),
        [1, 2, 4, 128, 128, 256]
    );
    assert_eq!(seqlen_bucket(100, 1000), 1024);
}

#[test]
fn only_plain_and_causal_options_have_tuned_plans() {
    let plain = AttentionOptions::default();
    assert_eq!(MaskKind::of(&plain), Some(MaskKind::None));
    assert_eq!(
        MaskKind::of(&plain.clone().causal(true)),
        Some(MaskKind::Causal)
    );
    assert_eq!(
        MaskKind::of(&plain.clone().scale(0.5)),
        Some(MaskKind::None)
    );
    assert_eq!(MaskKind::of(&plain.clone().window(Some(8), Some(0))), None);
    assert_eq!(MaskKind::of(&plain.softcap(30.0)), None);
}

#[test]
fn winners_are_stored_and_the_last_one_for_a_key_is_read_back() {
    let dir = tempfile::tempdir().unwrap();
    let cache = TuneCache::in_dir(&dir.path().join("nested"));
    assert_eq!(cache.path(), dir.path().join("nested").join(FILE_NAME));
    let (a, b) = (
        key(Pass::Forward, 128, 64, Precision::F32, MaskKind::None),
        key(Pass::Backward, 128, 64, Precision::F32, MaskKind::None),
    );
    assert_eq!(cache.get(&a), None);
    let tuned = |br| Tuned {
        overrides: PlanOverrides {
            br: Some(br),
            ..Default::default()
        },
        note: format!("Br {br}: 1.0 ms"),
    };
    cache.put(&a, &tuned(16)).unwrap();
    cache.put(&b, &tuned(8)).unwrap();
    cache.put(&a, &tuned(32)).unwrap();
    assert_eq!(cache.get(&a), Some(tuned(32)));
    assert_eq!(cache.get(&b), Some(tuned(8)));
}

#[test]
fn a_damaged_cache_reads_as_no_entry() {
    let dir = tempfile::tempdir().unwrap();
    let cache = TuneCache::in_dir(dir.path());
    let a = key(Pass::Forward, 128, 64, Precision::F32, MaskKind::None);
    for text in [
        b"\xff\xfe not utf-8\n".to_vec(),
        format!("{a}\n{a}\tbr=\n{a}\tkernel=warp\tnote\n").into_bytes(),
        format!("{a}\tbr=oops\tnote\n").into_bytes(),
    ] {
        std::fs::write(cache.path(), text).unwrap();
        assert_eq!(cache.get(&a), None);
    }
    // A cache directory that is a file cannot be written: a typed error.
    let blocked = TuneCache::in_dir(&cache.path().join("below-a-file"));
    let put = blocked.put(
        &a,
        &Tuned {
            overrides: PlanOverrides::default(),
            note: String::new(),
        },
    );
    assert!(matches!(put, Err(Error::TuneCacheWrite { .. })), "{put:?}");
}

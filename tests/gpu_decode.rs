//! Decoding on wgpu (lavapipe in CI) against the f64 reference: the same
//! cases as the CPU backend, on host caches and on a device cache kept
//! across steps; the storage-access count pins that each K/V element is read
//! once per GQA group.

mod common;

use common::decode::{cases, DecodeCase};
use common::engine;
use flashattn::Engine;
use flashattn::{AttentionOptions, CacheLayout, CacheShape, DecodeStep, Precision, TensorData};

fn run_cases(e: &Engine) {
    for case in cases() {
        let data = case.data();
        let out = data.check(|cache, step| e.decode_host(cache, step, &case.opts, case.num_splits));
        eprintln!("{:?}: {} splits", case.cache_lens, out.num_splits);
    }
}

#[test]
fn every_case_matches_the_reference() {
    let Some(e) = engine() else { return };
    run_cases(e);
}

#[test]
fn every_case_matches_the_reference_on_the_tiled_kernel() {
    let Some(e) = common::tiled_engine() else {
        return;
    };
    run_cases(e);
}

#[test]
fn requested_splits_are_run() {
    let Some(e) = engine() else { return };
    let case = DecodeCase::new(&[3000, 10], 64).heads(8, 1).append(1);
    let data = case.data();
    for (asked, splits) in [(1, 1), (3, 3)] {
        let out = data.check(|c, s| e.decode_host(c, s, &case.opts, Some(asked)));
        // The loop limit may raise the count, never lower it.
        assert!(
            out.num_splits >= splits,
            "asked {asked}, ran {}",
            out.num_splits
        );
        assert_eq!(
            out.stats.dispatches as usize,
            1 + 1 + (out.num_splits > 1) as usize
        );
    }
}

#[test]
fn a_device_cache_grows_step_by_step() {
    let Some(e) = engine() else { return };
    let (b, hq, hk, d, page) = (2, 8, 2, 32, 5);
    let layout = CacheLayout::Paged {
        pages: 12,
        page_size: page,
    };
    let shape = CacheShape::new(layout, hk, d).unwrap();
    let mut cache = e.kv_cache(shape, Precision::F16).unwrap();
    let mut host = flashattn::HostKvCache::zeros(shape, Precision::F16);
    // Sequence 0 owns pages 7, 2, 9; sequence 1 pages 0, 11, 4.
    let table = [7, 2, 9, 0, 11, 4];
    let mut rng = flashattn::random::Rng::new(9);
    let opts = AttentionOptions::default().causal(true);
    for step in 0..12 {
        let lens = [step, step];
        let mut t = |n| TensorData::from_f32(rng.normal_vec(n, 1.0), Precision::F16);
        let (q, k, v) = (t(b * hq * d), t(b * hk * d), t(b * hk * d));
        let s = DecodeStep::new(q.view([b, 1, hq, d]), &lens)
            .block_table(&table, 3)
            .append(k.view([b, 1, hk, d]), v.view([b, 1, hk, d]));
        let before = host.clone();
        let out = e.decode(&mut cache, &s, &opts, None).unwrap();
        let checks = flashattn::accuracy::check_decode(&out, &before, &s, &opts).unwrap();
        assert!(checks.iter().all(|c| c.passed()), "step {step}: {checks:?}");
        host = flashattn::reference::decode_cache(&before, &s).unwrap();
    }
    assert!(
        e.read_kv_cache(&cache).unwrap() == host,
        "the device cache lost a row"
    );
}

#[test]
fn a_failed_step_leaves_the_device_cache_untouched() {
    let Some(e) = engine() else { return };
    let layout = CacheLayout::Dense {
        batch: 1,
        capacity: 4,
    };
    let shape = CacheShape::new(layout, 1, 8).unwrap();
    let host = flashattn::HostKvCache::new(
        shape,
        TensorData::F32((0..32).map(|x| x as f32).collect()),
        TensorData::F32((0..32).map(|x| -(x as f32)).collect()),
    )
    .unwrap();
    let mut cache = e.upload_kv_cache(&host).unwrap();
    let q = TensorData::F32(vec![1.0; 8]);
    let new = TensorData::F32(vec![9.0; 16]);
    let s = DecodeStep::new(q.view([1, 1, 1, 8]), &[3])
        .append(new.view([1, 2, 1, 8]), new.view([1, 2, 1, 8]));
    let err = e
        .decode(&mut cache, &s, &AttentionOptions::default(), None)
        .unwrap_err();
    assert!(
        matches!(err, flashattn::Error::CacheOverflow { capacity: 4, .. }),
        "{err}"
    );
    assert!(e.read_kv_cache(&cache).unwrap() == host);
}

/// The copy kernel behind the bandwidth measurement copies, whole
/// workgroups and a partial last one alike.
#[test]
fn the_copy_kernel_copies() {
    let Some(e) = engine() else { return };
    let copy =
        |data: &[f32]| pollster::block_on(flashattn::ops::bandwidth::copy_f32(e.runtime(), data));
    for len4 in [1, 255, 256, 1003] {
        // Different values each time: pooled buffers are reused across calls.
        let data: Vec<f32> = (0..4 * len4)
            .map(|i| i as f32 * 0.5 - len4 as f32)
            .collect();
        assert_eq!(copy(&data).unwrap(), data, "{len4} vec4s");
    }
    assert!(matches!(
        copy(&[1.0; 6]),
        Err(flashattn::Error::DataLength { actual: 6, .. })
    ));
}

#[test]
fn copy_bandwidth_is_timed_and_bounded_by_one_binding() {
    let Some(e) = engine() else { return };
    let r = e.copy_bandwidth(1 << 20, 3).unwrap();
    assert_eq!((r.bytes, r.seconds.len()), (1 << 20, 3));
    assert!(r.gbps() > 0.0 && r.gbps().is_finite(), "{r:?}");
    // Rounded up to whole vec4s.
    assert_eq!(e.copy_bandwidth(17, 1).unwrap().bytes, 32);
    assert!(matches!(
        e.copy_bandwidth(0, 1),
        Err(flashattn::Error::EmptyDim { .. })
    ));
    let small = flashattn::Engine::new().unwrap().with_binding_limit(4096);
    assert!(matches!(
        small.copy_bandwidth(8192, 1),
        Err(flashattn::Error::BindingTooLarge {
            bytes: 8192,
            max: 4096,
            ..
        })
    ));
}

/// The merge combines at most MAX_SPLITS partials: a request for more is
/// capped (it once ran 188 splits and merged garbage).
#[test]
fn requests_past_max_splits_are_capped() {
    let Some(e) = engine() else { return };
    let case = DecodeCase::new(&[12000], 64).heads(8, 1).splits(190);
    let out = case
        .data()
        .check(|c, s| e.decode_host(c, s, &case.opts, case.num_splits));
    assert!(out.num_splits <= flashattn::plan::decode::MAX_SPLITS);
}

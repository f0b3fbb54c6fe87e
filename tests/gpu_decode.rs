//! Decoding on wgpu (lavapipe in CI) against the f64 reference: the same
//! cases as the CPU backend, on host caches and on a device cache kept
//! across steps; the storage-access count pins that each K/V element is read
//! once per GQA group.

mod common;

use common::decode::{
    assert_one_latent_tensor, cases, check_latent_rejections, mla_cases, DecodeCase,
};
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

/// A device cache belongs to the engine that made it: wgpu's resource ids
/// repeat across instances, so a second engine's calls would bind its own
/// buffers of the same ids (its cache read back as the first's, steps
/// appended into it) without an error.
#[test]
fn a_device_cache_works_only_with_the_engine_that_made_it() {
    let Some(e) = engine() else { return };
    let other = Engine::new().expect("a second engine on the same adapter");
    let layout = CacheLayout::Dense {
        batch: 1,
        capacity: 4,
    };
    let shape = CacheShape::new(layout, 1, 8).unwrap();
    let mine = flashattn::HostKvCache::new(
        shape,
        TensorData::F32((0..32).map(|x| x as f32).collect()),
        TensorData::F32((0..32).map(|x| -(x as f32)).collect()),
    )
    .unwrap();
    let theirs = flashattn::HostKvCache::zeros(shape, Precision::F32);
    let mut c1 = e.upload_kv_cache(&mine).unwrap();
    let mut c2 = other.upload_kv_cache(&theirs).unwrap();
    let q = TensorData::F32(vec![1.0; 8]);
    let s = DecodeStep::new(q.view([1, 1, 1, 8]), &[3]);
    let opts = AttentionOptions::default();
    let foreign = |r: flashattn::Result<_>| matches!(r, Err(flashattn::Error::ForeignCache));
    assert!(foreign(other.read_kv_cache(&c1).map(drop)));
    assert!(foreign(other.decode(&mut c1, &s, &opts, None).map(drop)));
    assert!(foreign(e.decode(&mut c2, &s, &opts, None).map(drop)));
    let quant = e.quantized_kv_cache(shape, flashattn::CacheQuant::Int8, Precision::F32);
    assert!(foreign(
        other.read_quantized_kv_cache(&quant.unwrap()).map(drop)
    ));
    // Each with its own engine: the caches as uploaded, a step runs.
    assert!(e.read_kv_cache(&c1).unwrap() == mine);
    assert!(other.read_kv_cache(&c2).unwrap() == theirs);
    e.decode(&mut c1, &s, &opts, None)
        .expect("the cache's own engine");
}

/// DeepSeek's MLA on a latent cache (V a view of K, one tensor), dense
/// and paged, GQA 128:1, seqlen_q 1 and 4, d 576 / dv 512, split-KV.
#[test]
fn latent_caches_match_the_reference() {
    let Some(e) = engine() else { return };
    for case in mla_cases() {
        let data = case.data();
        let out = data.check(|c, s| e.decode_host(c, s, &case.opts, case.num_splits));
        assert_eq!(out.o.shape[3], case.head_dim_v);
        // Split-KV: the keys are cut (the planner may take fewer splits
        // than asked for short sequences).
        if case.num_splits.is_some() {
            assert!(out.num_splits > 1, "{case:?}: {} splits", out.num_splits);
        }
    }
}

/// A device latent cache is one buffer of rows × 576 elements, V read from
/// it: it grows step by step (k_new alone appended) as the reference's
/// append says, and a step with a v_new is a typed error that leaves it
/// untouched.
#[test]
fn a_device_latent_cache_is_one_buffer() {
    let Some(e) = engine() else { return };
    let (b, hq, d, dv, pages, page) = (2, 16, 576, 512, 6, 3);
    let layout = CacheLayout::Paged {
        pages,
        page_size: page,
    };
    let shape = CacheShape::latent(layout, 1, d, dv).unwrap();
    let mut cache = e.kv_cache(shape, Precision::F16).unwrap();
    assert_eq!(cache.storage_bytes(), (pages * page * d * 2) as u64);
    let mut host = flashattn::HostKvCache::zeros(shape, Precision::F16);
    assert_one_latent_tensor(&host);
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
        let out = e.decode(&mut cache, &s, &opts, Some(2)).unwrap();
        let checks = flashattn::accuracy::check_decode(&out, &before, &s, &opts).unwrap();
        assert!(checks.iter().all(|c| c.passed()), "step {step}: {checks:?}");
        host = flashattn::reference::decode_cache(&before, &s).unwrap();
    }
    let read = e.read_kv_cache(&cache).unwrap();
    assert_one_latent_tensor(&read);
    assert!(read == host, "the device cache lost a row");
    let (q, k, v) = (t(b * hq * d), t(b * d), t(b * dv));
    let lens = [7, 7];
    let bad = DecodeStep::new(q.view([b, 1, hq, d]), &lens)
        .block_table(&table, 3)
        .append(k.view([b, 1, 1, d]), v.view([b, 1, 1, dv]));
    let err = e.decode(&mut cache, &bad, &opts, None).unwrap_err();
    assert!(
        matches!(err, flashattn::Error::LatentAppend { .. }),
        "{err:?}"
    );
    assert!(e.read_kv_cache(&cache).unwrap() == host);
    // Its quantized form is one buffer too, and refuses a V of its own
    // without a change.
    let mut quant = e
        .quantized_kv_cache(shape, flashattn::CacheQuant::Int8, Precision::F16)
        .unwrap();
    assert_eq!(quant.storage_bytes(), (pages * page * d + 4 * pages) as u64);
    let before = e.read_quantized_kv_cache(&quant).unwrap();
    let err = e.decode(&mut quant, &bad, &opts, None).unwrap_err();
    assert!(
        matches!(err, flashattn::Error::LatentAppend { .. }),
        "{err:?}"
    );
    assert!(e.read_quantized_kv_cache(&quant).unwrap() == before);
}

/// A cache shape built field by field is checked as `CacheShape::new`
/// checks it before a device cache is made: a size of 0 divided by zero in
/// the quantized cache's scale blocks, and a plain cache of a head dim past
/// the maximum was allocated, to fail only at its first step.
#[test]
fn device_caches_check_a_shape_built_field_by_field() {
    let Some(e) = engine() else { return };
    let good = CacheShape::new(
        CacheLayout::Dense {
            batch: 2,
            capacity: 8,
        },
        2,
        8,
    )
    .unwrap();
    let empty = CacheShape {
        layout: CacheLayout::Dense {
            batch: 2,
            capacity: 0,
        },
        ..good
    };
    for quant in flashattn::CacheQuant::ALL {
        let err = e
            .quantized_kv_cache(empty, quant, Precision::F32)
            .unwrap_err();
        assert!(
            matches!(
                err,
                flashattn::Error::EmptyDim {
                    dim: "cache capacity"
                }
            ),
            "{err:?}"
        );
    }
    let err = e.kv_cache(empty, Precision::F32).unwrap_err();
    assert!(matches!(err, flashattn::Error::EmptyDim { .. }), "{err:?}");
    let wide = CacheShape {
        head_dim: 4096,
        ..good
    };
    let err = e.kv_cache(wide, Precision::F32).unwrap_err();
    assert!(
        matches!(
            err,
            flashattn::Error::HeadDimTooLarge { head_dim: 4096, .. }
        ),
        "{err:?}"
    );
}

/// A decode problem is a value with public fields: one changed after
/// `DecodeProblem::new` (lengths emptied, a page size of 0, a page past
/// the cache) is a typed error from the planner, not an index panic.
#[test]
fn a_decode_problem_changed_field_by_field_is_checked_by_the_planner() {
    let Some(e) = engine() else { return };
    let layout = CacheLayout::Paged {
        pages: 3,
        page_size: 4,
    };
    let shape = CacheShape::new(layout, 2, 8).unwrap();
    let q = [0.25f32; 2 * 4 * 8];
    let q = flashattn::TensorView::f32([2, 1, 4, 8], &q);
    let step = DecodeStep::new(q, &[3, 5]).block_table(&[0, 1, 2, 0], 2);
    let good = flashattn::DecodeProblem::new(&step, &shape, Precision::F32).unwrap();
    let opts = AttentionOptions::default();
    e.plan_decode(&good, &opts, None)
        .expect("the problem as built");
    let plan = |edit: &dyn Fn(&mut flashattn::DecodeProblem)| {
        let mut p = good.clone();
        edit(&mut p);
        e.plan_decode(&p, &opts, None).unwrap_err()
    };
    use flashattn::Error;
    let err = plan(&|p| p.cache_lens.clear());
    assert!(
        matches!(
            err,
            Error::IndexLength {
                tensor: "cache_seqlens",
                len: 0,
                expected: 2
            }
        ),
        "{err:?}"
    );
    let err = plan(&|p| p.table.page_size = 0);
    assert!(matches!(err, Error::EmptyDim { .. }), "{err:?}");
    let err = plan(&|p| p.table.pages[3] = 7);
    assert!(
        matches!(
            err,
            Error::PageOutOfRange {
                page: 7,
                pages: 3,
                ..
            }
        ),
        "{err:?}"
    );
    let err = plan(&|p| p.table.pages.truncate(3));
    assert!(
        matches!(
            err,
            Error::IndexLength {
                tensor: "block_table",
                ..
            }
        ),
        "{err:?}"
    );
    let err = plan(&|p| p.head_dim_v = 16);
    assert!(
        matches!(
            err,
            Error::DimMismatch {
                dim: "head_dim_v",
                ..
            }
        ),
        "{err:?}"
    );
    let err = plan(&|p| p.heads_q = 3);
    assert!(matches!(err, Error::HeadsNotDivisible { .. }), "{err:?}");
}

#[test]
fn bad_latent_input_is_typed_and_leaves_the_cache_untouched() {
    let Some(e) = engine() else { return };
    check_latent_rejections(|c, s| e.decode_host(c, s, &AttentionOptions::default(), None));
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
    // A size whose rounding up to 16 would wrap to 0.
    assert!(matches!(
        e.copy_bandwidth(u64::MAX, 1),
        Err(flashattn::Error::BindingTooLarge {
            bytes: u64::MAX,
            ..
        })
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

//! Quantized KV caches on wgpu (lavapipe in CI): every quantized case
//! against the f64 reference on the codes' values, with the cache after
//! the append kernel equal, code for code and scale for scale, to the rule
//! restated apart (tests/common/kv_quant.rs), on the planner's decode kernel
//! and on the tiled one, latent (MLA) caches among them; a device cache
//! kept across steps that cross blocks and grow scales, plain and latent;
//! and bad input as typed errors that change nothing.

mod common;

use common::engine;
use common::kv_quant::{expected_append, quant_cases, quant_latent_cases};
use flashattn::{AttentionOptions, CacheLayout, CacheQuant, CacheShape, DecodeStep, Engine};
use flashattn::{Error, HostKvCache, Precision, QuantKvCache, TensorData};

fn run_cases(e: &Engine) {
    for quant in CacheQuant::ALL {
        for case in quant_cases().into_iter().chain(quant_latent_cases()) {
            let out = case.data().check_quantized(quant, |c, s| {
                e.decode_quantized_host(c, s, &case.opts, case.num_splits)
            });
            eprintln!("{quant:?} {:?}: {} splits", case.cache_lens, out.num_splits);
        }
    }
}

#[test]
fn every_quantized_case_matches_the_reference_and_the_rule() {
    let Some(e) = engine() else { return };
    run_cases(e);
}

#[test]
fn every_quantized_case_matches_on_the_tiled_kernel() {
    let Some(e) = common::tiled_engine() else {
        return;
    };
    run_cases(e);
}

/// Values whose codes test the rounding: ties at half steps, values at and
/// past ±QMAX of the scale, subnormals, both signs; and a block whose
/// scale grows step after step.
fn awkward(n: usize, step: usize, rng: &mut flashattn::random::Rng) -> Vec<f32> {
    (0..n)
        .map(|i| match i % 7 {
            0 => (i as f32 + 0.5) * 0.125 * (step + 1) as f32,
            1 => -(i as f32) * 0.0625,
            2 => f32::MIN_POSITIVE / 4.0,
            3 => (step as f32 + 1.0) * 3.0,
            _ => rng.normal() as f32 * (1 << step.min(8)) as f32,
        })
        .collect()
}

#[test]
fn a_device_cache_grows_step_by_step_by_the_rule() {
    let Some(e) = engine() else { return };
    let (b, hq, hk, d) = (2, 4, 2, 20);
    let cases = [
        (
            CacheLayout::Paged {
                pages: 8,
                page_size: 6,
            },
            Some([5usize, 0, 3, 1, 7, 2].map(|p| p as i32)),
        ),
        (
            CacheLayout::Dense {
                batch: 2,
                capacity: 40,
            },
            None,
        ),
    ];
    // Each layout also as a latent cache whose V is K's first 12 columns.
    for ((layout, table), latent) in cases.iter().flat_map(|&c| [(c, false), (c, true)]) {
        let shape = match latent {
            true => CacheShape::latent(layout, hk, d, 12).unwrap(),
            false => CacheShape::new(layout, hk, d).unwrap(),
        };
        for quant in CacheQuant::ALL {
            let mut host = QuantKvCache::zeros(shape, quant, Precision::F32);
            let mut cache = e.quantized_kv_cache(shape, quant, Precision::F32).unwrap();
            let mut rng = flashattn::random::Rng::new(11);
            let opts = AttentionOptions::default().causal(true);
            let mut len = 0;
            for step in 0..6 {
                // 1, 2 or 3 new tokens: appends that straddle blocks.
                let new = 1 + step % 3;
                let lens = [len, len];
                let q = TensorData::F32(rng.normal_vec(b * new * hq * d, 1.0));
                let k = TensorData::F32(awkward(b * new * hk * d, step, &mut rng));
                let v = TensorData::F32(awkward(b * new * hk * d, step + 1, &mut rng));
                let s = DecodeStep::new(q.view([b, new, hq, d]), &lens);
                let mut s = match latent {
                    true => s.append_latent(k.view([b, new, hk, d])),
                    false => s.append(k.view([b, new, hk, d]), v.view([b, new, hk, d])),
                };
                if let Some(t) = &table {
                    s = s.block_table(t, 3);
                }
                let out = e.decode(&mut cache, &s, &opts, None).unwrap();
                let after = expected_append(&host, &s);
                let checks = flashattn::accuracy::check_decode_on_values(
                    &out,
                    &after.dequantized(),
                    &s,
                    &opts,
                )
                .unwrap();
                assert!(
                    checks.iter().all(|c| c.passed()),
                    "{quant:?} {layout:?} latent {latent} step {step}: {checks:?}"
                );
                host = after;
                let read = e.read_quantized_kv_cache(&cache).unwrap();
                assert!(
                    read == host,
                    "{quant:?} {layout:?} latent {latent} step {step}: the device cache differs from the rule"
                );
                len += new as i32;
            }
            // The steps grew some block's scale past its first.
            assert!(host.k.scales.iter().any(|&s| s > 0.1), "{quant:?}");
        }
    }
}

/// common::kv_quant::BoundaryCase: block 0 is requantized, block 1 opened
/// at its scale.
#[test]
fn appends_requantize_at_block_boundaries() {
    let Some(e) = engine() else { return };
    let case = common::kv_quant::BoundaryCase::new();
    let (plain, step) = (&case.plain, case.step());
    for quant in CacheQuant::ALL {
        let before = QuantKvCache::quantize(plain, quant).unwrap();
        let mut cache = before.clone();
        e.decode_quantized_host(&mut cache, &step, &AttentionOptions::default(), None)
            .unwrap();
        let expected = expected_append(&before, &step);
        assert!(cache == expected, "{quant:?}");
        for hk in 0..2 {
            assert!(
                cache.k.scales[hk] > before.k.scales[hk],
                "{quant:?} block 0 grew"
            );
            assert_ne!(cache.k.codes[hk * 8..][..8], before.k.codes[hk * 8..][..8]);
        }
    }
}

#[test]
fn bad_input_is_a_typed_error_and_changes_nothing() {
    let Some(e) = engine() else { return };
    let layout = CacheLayout::Dense {
        batch: 1,
        capacity: 8,
    };
    let shape = CacheShape::new(layout, 1, 4).unwrap();
    let plain = HostKvCache::new(
        shape,
        TensorData::F32((0..32).map(|x| x as f32 / 8.0).collect()),
        TensorData::F32((0..32).map(|x| -(x as f32) / 8.0).collect()),
    )
    .unwrap();
    let good = QuantKvCache::quantize(&plain, CacheQuant::Int8).unwrap();
    let q = TensorData::F32(vec![1.0; 4]);
    let opts = AttentionOptions::default();
    let lens = [3];

    // A non-finite new value has no code: nothing is appended.
    let bad = TensorData::F32(vec![1.0, f32::NAN, 0.0, 0.0]);
    let s = DecodeStep::new(q.view([1, 1, 1, 4]), &lens)
        .append(bad.view([1, 1, 1, 4]), bad.view([1, 1, 1, 4]));
    let mut cache = good.clone();
    let err = e
        .decode_quantized_host(&mut cache, &s, &opts, None)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::NonFiniteInput {
                tensor: "k_new",
                ..
            }
        ),
        "{err}"
    );
    assert!(cache == good);
    let mut device = e.upload_quantized_kv_cache(&good).unwrap();
    let err = e.decode(&mut device, &s, &opts, None).unwrap_err();
    assert!(matches!(err, Error::NonFiniteInput { .. }), "{err}");
    assert!(e.read_quantized_kv_cache(&device).unwrap() == good);

    // A scale that is not a finite value > 0.
    for value in [0.0, -1.0, f32::NAN, f32::INFINITY] {
        let mut c = good.clone();
        c.v.scales[0] = value;
        let s = DecodeStep::new(q.view([1, 1, 1, 4]), &lens);
        let err = e
            .decode_quantized_host(&mut c, &s, &opts, None)
            .unwrap_err();
        assert!(
            matches!(
                err,
                Error::InvalidCacheScale {
                    tensor: "v_scales",
                    index: 0,
                    ..
                }
            ),
            "{value}: {err}"
        );
        assert!(matches!(
            e.upload_quantized_kv_cache(&c).unwrap_err(),
            Error::InvalidCacheScale { .. }
        ));
    }

    // A step in another precision than the cache's steps.
    let q16 = TensorData::from_f32(vec![1.0; 4], Precision::F16);
    let s = DecodeStep::new(q16.view([1, 1, 1, 4]), &lens);
    let mut c = good.clone();
    let err = e
        .decode_quantized_host(&mut c, &s, &opts, None)
        .unwrap_err();
    assert!(matches!(err, Error::DtypeMismatch { .. }), "{err}");

    // Each reader refuses the other format.
    let err = e.read_kv_cache(&device).unwrap_err();
    assert!(matches!(err, Error::CacheFormat { .. }), "{err}");
    let plain_device = e.upload_kv_cache(&plain).unwrap();
    let err = e.read_quantized_kv_cache(&plain_device).unwrap_err();
    assert!(matches!(err, Error::CacheFormat { .. }), "{err}");
    assert!(err.to_string().contains("f32 elements"), "{err}");
}

#[test]
fn one_device_cache_holds_a_byte_per_element_and_a_scale_per_block() {
    let Some(e) = engine() else { return };
    let layout = CacheLayout::Paged {
        pages: 10,
        page_size: 16,
    };
    let shape = CacheShape::new(layout, 2, 64)
        .unwrap()
        .with_head_dim_v(32)
        .unwrap();
    let cache = e
        .quantized_kv_cache(shape, CacheQuant::Fp8, Precision::F16)
        .unwrap();
    let (k, v) = (cache.k_binding(), cache.v_binding());
    let size = |b: &flashattn::wgpu::BufferBinding| b.size.unwrap().get();
    assert_eq!(size(&k), (10 * 16 * 2 * 64 + 10 * 2 * 4) as u64);
    assert_eq!(size(&v), (10 * 16 * 2 * 32 + 10 * 2 * 4) as u64);
    let host = e.read_quantized_kv_cache(&cache).unwrap();
    assert_eq!(
        host,
        QuantKvCache::zeros(shape, CacheQuant::Fp8, Precision::F16)
    );
    // A latent cache: K's codes and scales alone, V a view of them.
    let latent = CacheShape::latent(layout, 2, 64, 32).unwrap();
    let cache = e
        .quantized_kv_cache(latent, CacheQuant::Int8, Precision::F16)
        .unwrap();
    assert_eq!(
        cache.storage_bytes(),
        (10 * 16 * 2 * 64 + 10 * 2 * 4) as u64
    );
    let host = e.read_quantized_kv_cache(&cache).unwrap();
    assert_eq!((host.v.codes.len(), host.v.scales.len()), (0, 0));
    assert_eq!(
        host,
        QuantKvCache::zeros(latent, CacheQuant::Int8, Precision::F16)
    );
}

/// New values that are ties at the block's scale (1, from the largest
/// magnitude QMAX), subnormal, or past QMAX after requantization: the
/// append kernel's integer rounding against the rule's f64 one.
#[test]
fn ties_round_to_even_as_the_rule_says() {
    let Some(e) = engine() else { return };
    let layout = CacheLayout::Dense {
        batch: 1,
        capacity: 20,
    };
    let shape = CacheShape::new(layout, 1, 16).unwrap();
    for quant in CacheQuant::ALL {
        let qmax = if quant == CacheQuant::Int8 {
            127.0
        } else {
            448.0
        };
        let ties = [
            qmax,
            0.5,
            1.5,
            2.5,
            -0.5,
            -2.5,
            126.5,
            1.0625,
            17.0,
            0.0029296875,
            -0.0048828125,
            f32::MIN_POSITIVE / 2.0,
            -0.0,
            qmax - 0.5,
            3.25,
            0.75,
        ];
        let new = TensorData::F32(ties.to_vec());
        let q = TensorData::F32(vec![0.5; 16]);
        let lens = [0];
        let step = DecodeStep::new(q.view([1, 1, 1, 16]), &lens)
            .append(new.view([1, 1, 1, 16]), new.view([1, 1, 1, 16]));
        let before = QuantKvCache::zeros(shape, quant, Precision::F32);
        let mut cache = before.clone();
        e.decode_quantized_host(&mut cache, &step, &AttentionOptions::default(), None)
            .unwrap();
        assert_eq!(cache.k.scales[0], 1.0, "{quant:?}");
        let expected = expected_append(&before, &step);
        assert_eq!(cache.k.codes, expected.k.codes, "{quant:?}");
        // A second token of twice the magnitude doubles the scale: every
        // code so far is requantized, many of them ties again.
        let twice = TensorData::F32(ties.iter().map(|x| x * 2.0).collect());
        let lens = [1];
        let step = DecodeStep::new(q.view([1, 1, 1, 16]), &lens)
            .append(twice.view([1, 1, 1, 16]), twice.view([1, 1, 1, 16]));
        let before = cache.clone();
        e.decode_quantized_host(&mut cache, &step, &AttentionOptions::default(), None)
            .unwrap();
        assert_eq!(cache.k.scales[0], 2.0, "{quant:?}");
        assert!(cache == expected_append(&before, &step), "{quant:?}");
    }
}

/// A step recorded into the app's encoder on a quantized device cache, q,
/// the new rows, o and lse on ranges of the app's buffers: the host call's
/// o and lse bytes, and its codes and scales in the cache.
#[test]
fn an_encoded_step_on_a_quantized_cache_gives_the_host_call_s_bytes() {
    use common::arena::{sentinels, Arena};
    let Some(e) = engine() else { return };
    let case = common::decode::DecodeCase::new(&[37, 5], 32)
        .heads(4, 2)
        .paged(16)
        .append(2);
    let data = case.data();
    let step = data.step();
    let bytes = |t: &TensorData| t.as_host().as_bytes().to_vec();
    for quant in CacheQuant::ALL {
        let before = QuantKvCache::quantize(&data.cache, quant).unwrap();
        let mut host = before.clone();
        let expected = e
            .decode_quantized_host(&mut host, &step, &case.opts, case.num_splits)
            .unwrap();
        let o = bytes(&expected.o.data);
        let lse: Vec<u8> = bytemuck::cast_slice(&expected.lse).to_vec();
        let (o_fill, lse_fill) = (sentinels(o.len() as u64), sentinels(lse.len() as u64));
        let (q, k_new, v_new) = (bytes(&data.q), bytes(&data.k_new), bytes(&data.v_new));
        let arena = Arena::new(
            e,
            &[
                (0, &q),
                (1, &o_fill),
                (1, &lse_fill),
                (0, &k_new),
                (0, &v_new),
            ],
        );
        let cache = e.upload_quantized_kv_cache(&before).unwrap();
        let bindings =
            flashattn::DecodeBindings::new(arena.binding(0), arena.binding(1), arena.binding(2))
                .append(arena.binding(3), arena.binding(4));
        let mut encoder = e.device().create_command_encoder(&Default::default());
        e.encode_decode(
            &mut encoder,
            &cache,
            &step.spec(),
            &bindings,
            &case.opts,
            case.num_splits,
        )
        .unwrap();
        let read = arena.submit_and_read(e, encoder);
        let want = [&q, &o, &lse, &k_new, &v_new].map(|b| Some(&b[..]));
        arena.holds(&read, &want);
        assert!(
            e.read_quantized_kv_cache(&cache).unwrap() == host,
            "{quant:?}"
        );
    }
}

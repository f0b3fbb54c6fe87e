//! Quantized KV caches (docs/kv-quantization.md): the rule's values, the
//! CPU backend's decoding against the f64 reference on the codes' values on
//! every instruction set, the append against the rule restated apart
//! (block boundaries, growing scales, requantization), latent (MLA) caches
//! whose V is a view of K's codes, the footprint, and bad input as typed
//! errors that leave the cache untouched.

mod common;

use common::decode::DecodeCase;
use common::kv_quant::{quant_cases, quant_latent_cases, scale_of};
use flashattn::{cpu, CacheLayout, CacheQuant, CacheShape, DecodeStep, Error};
use flashattn::{AttentionOptions, Precision, QuantKvCache, QuantizedKv, TensorData};
use flashattn::{MIN_CACHE_SCALE, SCALE_BLOCK_TOKENS};

#[test]
fn the_rule_s_values() {
    let i8 = CacheQuant::Int8;
    assert_eq!(MIN_CACHE_SCALE, 2f32.powi(-100));
    assert_eq!(i8.scale_of(127.0), 1.0);
    assert_eq!(i8.scale_of(0.0), MIN_CACHE_SCALE);
    // Ties to even, clamped to ±127; the byte is the two's complement.
    let codes: Vec<i8> = [0.5, 1.5, 2.5, -1.5, -0.49, 126.6, 200.0, -1e9]
        .iter()
        .map(|&x| i8.encode(x, 1.0) as i8)
        .collect();
    assert_eq!(codes, [0, 2, 2, -2, 0, 127, 127, -127]);
    assert_eq!(i8.value((-3i8) as u8, 0.25), -0.75);
    let fp8 = CacheQuant::Fp8;
    assert_eq!(fp8.scale_of(448.0), 1.0);
    // e4m3 at scale 1: 1.0625 is a tie between 1 and 1.125 (to even: 1).
    assert_eq!(fp8.value(fp8.encode(1.0625, 1.0), 1.0), 1.0);
    assert_eq!(fp8.value(fp8.encode(-1000.0, 1.0), 1.0), -448.0);
    assert_eq!(fp8.value(fp8.encode(3.0, 0.5), 0.5), 3.0);
    // Subnormal inputs count as 0; the smallest scale keeps values normal.
    assert_eq!(i8.encode(f32::MIN_POSITIVE / 2.0, MIN_CACHE_SCALE), 0);
    assert!(fp8.value(1, MIN_CACHE_SCALE).is_normal());
    assert_eq!(CacheQuant::parse("fp8").unwrap(), fp8);
    assert!(matches!(
        CacheQuant::parse("int4"),
        Err(Error::UnknownName {
            what: "cache precision",
            ..
        })
    ));
}

#[test]
fn every_case_matches_the_reference_on_every_instruction_set() {
    for &isa in cpu::Isa::available() {
        let backend = cpu::Cpu::with_isa(isa).unwrap();
        for quant in CacheQuant::ALL {
            for case in quant_cases().into_iter().chain(quant_latent_cases()) {
                case.data().check_quantized(quant, |c, s| {
                    backend.decode_quantized(c, s, &case.opts, case.num_splits)
                });
            }
        }
    }
}

/// A quantized latent cache is K's codes and scales alone; V's columns are
/// read from them. Bad latent input leaves it untouched: a separate V
/// given to it, a step appending v_new, a view wider than its rows.
#[test]
fn a_quantized_latent_cache_is_one_set_of_codes_and_scales() {
    let case = DecodeCase::new(&[40, 9], 24)
        .dv(16)
        .heads(4, 2)
        .paged(16)
        .latent()
        .append(1);
    let data = case.data();
    let cache = QuantKvCache::quantize(&data.cache, CacheQuant::Int8).unwrap();
    let (rows, heads, blocks) = (cache.shape.rows(), 2, cache.blocks().count());
    assert_eq!(cache.k.codes.len(), rows * heads * 24);
    assert_eq!(cache.k.scales.len(), blocks * heads);
    assert_eq!((cache.v.codes.len(), cache.v.scales.len()), (0, 0));
    assert_eq!(cache.bytes(), rows * heads * 24 + 4 * blocks * heads);
    // V's values are K's first 16 columns: no tensor of their own.
    assert_eq!(cache.dequantized().v.len(), 0);

    let err = QuantKvCache::new(
        cache.shape,
        CacheQuant::Int8,
        Precision::F32,
        cache.k.clone(),
        cache.k.clone(),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            Error::DataLength {
                tensor: "v_cache",
                expected: 0,
                ..
            }
        ),
        "{err}"
    );
    let q = TensorData::F32(vec![0.5; 4 * 24]);
    let (k_new, v_new) = (
        TensorData::F32(vec![1.0; 48]),
        TensorData::F32(vec![2.0; 32]),
    );
    let lens = [3];
    let with_v = DecodeStep::new(q.view([1, 1, 4, 24]), &lens)
        .append(k_new.view([1, 1, 2, 24]), v_new.view([1, 1, 2, 16]));
    let mut c = cache.clone();
    let err =
        cpu::decode_quantized(&mut c, &with_v, &AttentionOptions::default(), None).unwrap_err();
    assert!(matches!(err, Error::LatentAppend { .. }), "{err}");
    assert!(c == cache, "a rejected step changed the cache");
    let mut too_wide = cache.clone();
    too_wide.shape.head_dim_v = 25;
    let before = too_wide.clone();
    let step = DecodeStep::new(q.view([1, 1, 4, 24]), &lens);
    let err = cpu::decode_quantized(&mut too_wide, &step, &AttentionOptions::default(), None)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::LatentViewTooWide {
                v_width: 25,
                width: 24
            }
        ),
        "{err}"
    );
    assert!(too_wide == before, "a rejected step changed the cache");
}

/// common::kv_quant::BoundaryCase: block 0 requantized, block 1 opened.
#[test]
fn appends_requantize_at_block_boundaries_when_the_scale_grows() {
    let case = common::kv_quant::BoundaryCase::new();
    let (new, step) = (&case.new, case.step());
    for quant in CacheQuant::ALL {
        let mut cache = QuantKvCache::quantize(&case.plain, quant).unwrap();
        let before = cache.clone();
        let out =
            cpu::decode_quantized(&mut cache, &step, &AttentionOptions::default(), None).unwrap();
        assert!(out.o.to_f32().iter().all(|v| v.is_finite()));
        assert_eq!(cache, common::kv_quant::expected_append(&before, &step));
        let per_row = 40usize.div_ceil(SCALE_BLOCK_TOKENS);
        for hk in 0..2 {
            // Token 15 is in block 0 and raised its scale: block 0's old
            // codes were requantized, and their values moved by at most
            // half a step of the new scale.
            let a0 = new[hk * 8..][..8].iter().fold(0f32, |m, v| m.max(v.abs()));
            let s0 = cache.k.scales[hk];
            assert_eq!(s0, scale_of(quant, a0), "{quant:?} head {hk}");
            assert!(s0 > before.k.scales[hk]);
            let old = before.dequantized().k.to_f32();
            let now = cache.dequantized().k.to_f32();
            for t in 0..15 {
                for e in 0..8 {
                    let i = (t * 2 + hk) * 8 + e;
                    let step_size = match quant {
                        CacheQuant::Int8 => s0,
                        _ => s0 * (old[i].abs() / s0).max(1.0) / 8.0,
                    };
                    assert!(
                        (now[i] - old[i]).abs() <= step_size * 0.5 + 1e-6,
                        "{quant:?} t{t}"
                    );
                }
            }
            // Token 16 opened block 1 at its own scale; block 2 untouched.
            let a1 = new[16 + hk * 8..][..8]
                .iter()
                .fold(0f32, |m, v| m.max(v.abs()));
            assert_eq!(cache.k.scales[2 + hk], scale_of(quant, a1));
            assert_eq!(cache.k.scales[2 * 2 + hk], MIN_CACHE_SCALE);
            // The second cache row's blocks are another sequence's.
            assert_eq!(
                cache.k.scales[per_row * 2..],
                before.k.scales[per_row * 2..]
            );
        }
    }
}

#[test]
fn a_smaller_new_token_keeps_the_block_s_scale_and_codes() {
    let case = DecodeCase::new(&[5], 16).heads(2, 1).append(1);
    let mut data = case.data();
    // The new token's values are far below the block's.
    data.k_new = TensorData::F32(data.k_new.to_f32().iter().map(|v| v * 1e-3).collect());
    let before = QuantKvCache::quantize(&data.cache, CacheQuant::Int8).unwrap();
    let mut cache = before.clone();
    cpu::decode_quantized(&mut cache, &data.step(), &case.opts, None).unwrap();
    assert_eq!(cache.k.scales, before.k.scales);
    assert_eq!(cache.k.codes[..5 * 16], before.k.codes[..5 * 16]);
}

#[test]
fn one_cache_holds_a_byte_per_element_and_a_scale_per_block() {
    let layout = CacheLayout::Paged {
        pages: 64,
        page_size: 16,
    };
    let shape = CacheShape::new(layout, 8, 128).unwrap();
    let f16 = shape.len() * 2 * 2;
    for quant in CacheQuant::ALL {
        let cache = QuantKvCache::zeros(shape, quant, Precision::F16);
        assert_eq!(cache.k.codes.len(), shape.len());
        assert_eq!(cache.k.scales.len(), 64 * 8);
        assert_eq!(cache.bytes(), 2 * shape.len() + 2 * 4 * 64 * 8);
        assert!(cache.bytes() as f64 <= 0.51 * f16 as f64);
    }
}

/// A 1-row dense int8 cache of 16 tokens, 1 head of 4, and a step on it.
fn small(scale: f32) -> Result<QuantKvCache, Error> {
    let layout = CacheLayout::Dense {
        batch: 1,
        capacity: 16,
    };
    let shape = CacheShape::new(layout, 1, 4).unwrap();
    let kv = |s| QuantizedKv {
        codes: vec![3; 64],
        scales: vec![s],
    };
    QuantKvCache::new(shape, CacheQuant::Int8, Precision::F32, kv(scale), kv(0.5))
}

#[test]
fn bad_input_is_a_typed_error_and_leaves_the_cache_untouched() {
    for bad in [f32::NAN, 0.0, -1.0, f32::INFINITY] {
        assert!(
            matches!(
                small(bad),
                Err(Error::InvalidCacheScale {
                    tensor: "k_scales",
                    index: 0,
                    ..
                })
            ),
            "{bad}"
        );
    }
    let mut cache = small(0.25).unwrap();
    let q = TensorData::F32(vec![1.0; 4]);
    let lens = [3];
    let opts = AttentionOptions::default();
    // A NaN in the new rows: no scale for it.
    let mut new = vec![1.0f32; 4];
    new[2] = f32::NAN;
    let nan = TensorData::F32(new);
    let ok = TensorData::F32(vec![1.0; 4]);
    let step = DecodeStep::new(q.view([1, 1, 1, 4]), &lens)
        .append(ok.view([1, 1, 1, 4]), nan.view([1, 1, 1, 4]));
    let before = cache.clone();
    let err = cpu::decode_quantized(&mut cache, &step, &opts, None).unwrap_err();
    assert!(
        matches!(
            err,
            Error::NonFiniteInput {
                tensor: "v_new",
                index: 2
            }
        ),
        "{err}"
    );
    assert_eq!(cache, before);
    // A scale set bad after construction is caught by the step.
    cache.v.scales[0] = f32::NAN;
    let step = DecodeStep::new(q.view([1, 1, 1, 4]), &lens)
        .append(ok.view([1, 1, 1, 4]), ok.view([1, 1, 1, 4]));
    let err = cpu::decode_quantized(&mut cache, &step, &opts, None).unwrap_err();
    assert!(
        matches!(
            err,
            Error::InvalidCacheScale {
                tensor: "v_scales",
                ..
            }
        ),
        "{err}"
    );
    assert_eq!(cache.k, before.k);
    // A step whose dtype is not the cache's.
    cache.v.scales[0] = 0.5;
    let q16 = TensorData::from_f32(vec![1.0; 4], Precision::F16);
    let step = DecodeStep::new(q16.view([1, 1, 1, 4]), &lens);
    let err = cpu::decode_quantized(&mut cache, &step, &opts, None).unwrap_err();
    assert!(
        matches!(err, Error::DtypeMismatch { tensor: "q", .. }),
        "{err}"
    );
    // A step that reads the cache and must fail.
    let read_fails = |cache: &mut QuantKvCache, opts: &AttentionOptions| {
        let step = DecodeStep::new(q.view([1, 1, 1, 4]), &lens);
        cpu::decode_quantized(cache, &step, opts, None).unwrap_err()
    };
    // Codes of the wrong length.
    let mut short = cache.clone();
    short.k.codes.pop();
    let err = read_fails(&mut short, &opts);
    assert!(
        matches!(
            err,
            Error::DataLength {
                tensor: "k_cache",
                ..
            }
        ),
        "{err}"
    );
    // FP8's NaN codes, refused where codes come in.
    let mut codes = cache.k.clone();
    codes.codes[5] = 0x7f;
    let err = QuantKvCache::new(
        cache.shape,
        CacheQuant::Fp8,
        Precision::F32,
        codes,
        cache.v.clone(),
    )
    .unwrap_err();
    assert!(
        matches!(
            err,
            Error::NonFiniteInput {
                tensor: "k_cache",
                index: 5
            }
        ),
        "{err}"
    );
    // Dropout has no place in decoding.
    let dropout = AttentionOptions::default().dropout(0.1).dropout_seed(1);
    let err = read_fails(&mut cache, &dropout);
    assert!(matches!(err, Error::Unsupported { .. }), "{err}");
}

#[test]
fn a_quantized_cache_is_close_to_the_plain_one() {
    // Normal values: int8 keeps o within 2% of the plain cache's, FP8 within 6%.
    let case = DecodeCase::new(&[900, 300], 64).heads(8, 2).append(1);
    let data = case.data();
    let plain = cpu::decode(&mut data.cache.clone(), &data.step(), &case.opts, None).unwrap();
    let p = plain.o.to_f32();
    let norm = (p.iter().map(|v| v * v).sum::<f32>() / p.len() as f32).sqrt();
    for (quant, tol) in [(CacheQuant::Int8, 0.02), (CacheQuant::Fp8, 0.06)] {
        let mut cache = QuantKvCache::quantize(&data.cache, quant).unwrap();
        let out = cpu::decode_quantized(&mut cache, &data.step(), &case.opts, None).unwrap();
        let o = out.o.to_f32();
        let rmse = (o
            .iter()
            .zip(&p)
            .map(|(a, b)| (a - b) * (a - b))
            .sum::<f32>()
            / p.len() as f32)
            .sqrt();
        assert!(
            rmse <= tol * norm,
            "{quant:?}: rmse {rmse} of o's rms {norm}"
        );
        assert!(
            rmse > 0.0,
            "{quant:?}: quantization left o exactly as it was"
        );
    }
}

#[test]
fn a_cleared_page_starts_again_at_the_smallest_scale() {
    let case = DecodeCase::new(&[40, 9], 16)
        .heads(4, 2)
        .paged(16)
        .append(1);
    let data = case.data();
    let mut cache = QuantKvCache::quantize(&data.cache, CacheQuant::Int8).unwrap();
    let pages = cache.blocks().pages;
    let before = cache.clone();
    cache.clear_page(1).unwrap();
    let (row, heads) = (cache.shape.row_len(), cache.shape.heads_kv);
    assert!(cache.k.codes[16 * row..32 * row].iter().all(|&c| c == 0));
    assert!(cache.v.scales[heads..2 * heads]
        .iter()
        .all(|&s| s == MIN_CACHE_SCALE));
    // Other pages are untouched.
    assert_eq!(cache.k.codes[..16 * row], before.k.codes[..16 * row]);
    assert_eq!(cache.k.scales[2 * heads..], before.k.scales[2 * heads..]);
    assert!(matches!(
        cache.clear_page(pages),
        Err(Error::PageOutOfRange {
            tensor: "clear_page",
            ..
        })
    ));
    // A dense cache's page is a row (of several blocks).
    let dense = DecodeCase::new(&[30], 8).data();
    let mut cache = QuantKvCache::quantize(&dense.cache, CacheQuant::Fp8).unwrap();
    cache.clear_page(0).unwrap();
    assert!(cache.k.scales.iter().all(|&s| s == MIN_CACHE_SCALE));
    assert!(cache.dequantized().k.to_f32().iter().all(|&x| x == 0.0));
}

/// A cache whose public fields were changed after it was built — its shape
/// given a size of 0, its codes or scales cut short — is a typed error in a
/// step and in `clear_page`, not a division by zero or a slice past the end.
#[test]
fn a_cache_changed_field_by_field_is_a_typed_error() {
    let q = TensorData::F32(vec![1.0; 4]);
    let lens = [3];
    let step = DecodeStep::new(q.view([1, 1, 1, 4]), &lens);
    let opts = AttentionOptions::default();
    let mut empty = small(0.25).unwrap();
    empty.shape.layout = CacheLayout::Dense {
        batch: 1,
        capacity: 0,
    };
    let before = empty.clone();
    let err = cpu::decode_quantized(&mut empty, &step, &opts, None).unwrap_err();
    assert!(
        matches!(
            err,
            Error::EmptyDim {
                dim: "cache capacity"
            }
        ),
        "{err}"
    );
    let err = empty.clear_page(0).unwrap_err();
    assert!(matches!(err, Error::EmptyDim { .. }), "{err}");
    assert_eq!(empty, before);
    let mut paged = small(0.25).unwrap();
    paged.shape.layout = CacheLayout::Paged {
        pages: 1,
        page_size: 0,
    };
    let err = paged.clear_page(0).unwrap_err();
    assert!(matches!(err, Error::EmptyDim { dim: "page_size" }), "{err}");
    // A float cache emptied field by field, quantized.
    let mut host = small(0.25).unwrap().dequantized();
    host.shape = empty.shape;
    host.k = TensorData::F32(Vec::new());
    host.v = TensorData::F32(Vec::new());
    let err = QuantKvCache::quantize(&host, CacheQuant::Int8).unwrap_err();
    assert!(matches!(err, Error::EmptyDim { .. }), "{err}");
    for cut in [true, false] {
        let mut short = small(0.25).unwrap();
        if cut {
            short.k.codes.truncate(5);
        } else {
            short.v.scales.clear();
        }
        let before = short.clone();
        let err = short.clear_page(0).unwrap_err();
        let tensor = if cut { "k_cache" } else { "v_scales" };
        assert!(
            matches!(err, Error::DataLength { tensor: t, .. } if t == tensor),
            "{err}"
        );
        assert_eq!(short, before);
    }
}

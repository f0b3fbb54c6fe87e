//! Decoding on the CPU backend (`flashattn::cpu::decode`) against the f64
//! reference, and its validation: bad steps are typed errors that leave the
//! cache untouched.

mod common;

use common::decode::{
    assert_one_latent_tensor, cases, check_latent_rejections, mla_cases, DecodeCase,
};
use flashattn::{cpu, AttentionOptions, Error, Precision, TensorData};
use flashattn::{CacheLayout, CacheShape, DecodeStep, HostKvCache};

#[test]
fn every_case_matches_the_reference_on_every_instruction_set() {
    for &isa in cpu::Isa::available() {
        let backend = cpu::Cpu::with_isa(isa).unwrap();
        for case in cases() {
            let data = case.data();
            data.check(|cache, step| backend.decode(cache, step, &case.opts, case.num_splits));
        }
    }
}

#[test]
fn every_case_matches_the_reference() {
    for case in cases() {
        let data = case.data();
        let out = data.check(|cache, step| cpu::decode(cache, step, &case.opts, case.num_splits));
        if let Some(n) = case.num_splits {
            let blocks = data.case.cache_lens.iter().max().unwrap() + case.seqlen_new;
            assert!(out.num_splits <= n.max(1) || out.num_splits <= blocks.div_ceil(64));
        }
    }
}

/// DeepSeek's MLA on a latent cache (V a view of K, one tensor), dense
/// and paged, GQA 128:1, seqlen_q 1 and 4, d 576 / dv 512, on every
/// instruction set.
#[test]
fn latent_caches_match_the_reference() {
    for &isa in cpu::Isa::available() {
        let backend = cpu::Cpu::with_isa(isa).unwrap();
        for case in mla_cases() {
            let data = case.data();
            assert_one_latent_tensor(&data.cache);
            let out = data.check(|c, s| backend.decode(c, s, &case.opts, case.num_splits));
            assert_eq!(out.o.shape[3], case.head_dim_v);
            if let Some(n) = case.num_splits {
                assert!(out.num_splits > 1 && out.num_splits <= n, "{case:?}");
            }
        }
    }
}

#[test]
fn bad_latent_input_is_typed_and_leaves_the_cache_untouched() {
    check_latent_rejections(|c, s| cpu::decode(c, s, &AttentionOptions::default(), None));
}

#[test]
fn splits_give_the_same_result_within_the_rule() {
    let case = DecodeCase::new(&[3000], 64).heads(8, 1);
    let data = case.data();
    let outs: Vec<_> = [1, 3, 64]
        .iter()
        .map(|&n| data.check(|c, s| cpu::decode(c, s, &case.opts, Some(n))))
        .collect();
    assert_eq!(outs[0].num_splits, 1);
    assert_eq!(outs[1].num_splits, 3);
    assert!(
        outs[2].num_splits > 3,
        "64 splits of 3000 keys become whole blocks"
    );
}

/// A 2-sequence dense f32 cache of capacity 8, 1 kv head, d 4.
fn small() -> (HostKvCache, Vec<f32>, Vec<f32>) {
    let layout = CacheLayout::Dense {
        batch: 2,
        capacity: 8,
    };
    let shape = CacheShape::new(layout, 1, 4).unwrap();
    let data = |x: f32| TensorData::F32((0..shape.len()).map(|i| i as f32 * x).collect());
    let cache = HostKvCache::new(shape, data(0.1), data(-0.2)).unwrap();
    (cache, vec![0.5; 2 * 4], vec![1.0; 2 * 4])
}

#[test]
fn bad_steps_are_typed_errors_and_leave_the_cache_untouched() {
    let (cache, q, new) = small();
    let qv = TensorData::F32(q.clone());
    let nv = TensorData::F32(new.clone());
    let q = qv.view([2, 1, 1, 4]);
    let kn = nv.view([2, 1, 1, 4]);
    let opts = AttentionOptions::default();
    let run = |step: DecodeStep| {
        let mut c = cache.clone();
        let r = cpu::decode(&mut c, &step, &opts, None);
        assert!(c == cache, "a failed step changed the cache");
        r.expect_err("the step must fail")
    };
    let e = run(DecodeStep::new(q, &[8, 0]).append(kn, kn));
    assert!(
        matches!(
            e,
            Error::CacheOverflow {
                batch: 0,
                cache_len: 8,
                new: 1,
                capacity: 8
            }
        ),
        "{e}"
    );
    let e = run(DecodeStep::new(q, &[-1, 0]));
    assert!(
        matches!(
            e,
            Error::NegativeIndex {
                tensor: "cache_seqlens",
                index: 0,
                value: -1
            }
        ),
        "{e}"
    );
    let e = run(DecodeStep::new(q, &[1]));
    assert!(
        matches!(
            e,
            Error::IndexLength {
                tensor: "cache_seqlens",
                len: 1,
                expected: 2
            }
        ),
        "{e}"
    );
    let e = run(DecodeStep::new(q, &[1, 1]).batch_idx(&[0, 2]));
    assert!(
        matches!(
            e,
            Error::PageOutOfRange {
                tensor: "cache_batch_idx",
                batch: 1,
                page: 2,
                ..
            }
        ),
        "{e}"
    );
    let e = run(DecodeStep::new(q, &[1, 1])
        .batch_idx(&[1, 1])
        .append(kn, kn));
    assert!(
        matches!(
            e,
            Error::AppendConflict {
                first: 0,
                second: 1,
                ..
            }
        ),
        "{e}"
    );
    let e = run(DecodeStep::new(q, &[1, 1]).block_table(&[0, 1], 1));
    assert!(matches!(e, Error::CacheIndex { .. }), "{e}");
    let bad_new = TensorData::F32(vec![0.0; 2 * 4 * 2]);
    let e = run(DecodeStep::new(q, &[1, 1]).append(bad_new.view([2, 1, 2, 4]), kn));
    assert!(
        matches!(
            e,
            Error::ShapeMismatch {
                tensor: "k_new",
                ..
            }
        ),
        "{e}"
    );
    let q16 = TensorData::from_f32(vec![0.0; 8], Precision::F16);
    let e = run(DecodeStep::new(q16.view([2, 1, 1, 4]), &[1, 1]));
    assert!(matches!(e, Error::DtypeMismatch { tensor: "q", .. }), "{e}");
    let q3 = TensorData::F32(vec![0.0; 2 * 3]);
    let e = run(DecodeStep::new(q3.view([2, 1, 1, 3]), &[1, 1]));
    assert!(
        matches!(
            e,
            Error::DimMismatch {
                dim: "head_dim",
                ..
            }
        ),
        "{e}"
    );
}

/// A cache whose v head dim is its own: V's data, `v_new` and the cache
/// tensors are checked against it, and bad ones are typed errors.
#[test]
fn v_head_dims_of_their_own_are_checked() {
    let layout = CacheLayout::Dense {
        batch: 2,
        capacity: 8,
    };
    let shape = CacheShape::new(layout, 1, 4).unwrap();
    assert_eq!(shape.head_dim_v, 4);
    let shape = shape.with_head_dim_v(6).unwrap();
    assert_eq!((shape.v_dims(), shape.v_len()), ([2, 8, 1, 6], 96));
    assert!(matches!(
        shape.with_head_dim_v(0),
        Err(Error::EmptyDim { dim: "head_dim_v" })
    ));
    assert!(matches!(
        shape.with_head_dim_v(100_000),
        Err(Error::HeadDimTooLarge { .. })
    ));
    // V's data must hold the v head dim's elements.
    let k = TensorData::F32(vec![0.5; 64]);
    let e = HostKvCache::new(shape, k.clone(), TensorData::F32(vec![0.5; 64])).unwrap_err();
    assert!(
        matches!(
            e,
            Error::DataLength {
                tensor: "v_cache",
                expected: 96,
                ..
            }
        ),
        "{e}"
    );
    // Tensors: V's dims are K's but for the head dim.
    let tensor = |shape: Vec<usize>| {
        let n = shape.iter().product();
        flashattn::Tensor {
            shape,
            data: TensorData::F32(vec![0.25; n]),
        }
    };
    let c = HostKvCache::from_tensors(tensor(vec![2, 8, 1, 4]), tensor(vec![2, 8, 1, 6]), false)
        .unwrap();
    assert_eq!(c.shape, shape);
    let e = HostKvCache::from_tensors(tensor(vec![2, 8, 1, 4]), tensor(vec![2, 7, 1, 6]), false)
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::ShapeMismatch {
                tensor: "v_cache",
                ..
            }
        ),
        "{e}"
    );
    // v_new has the v head dim; o does too.
    let q = TensorData::F32(vec![0.5; 8]);
    let q = q.view([2, 1, 1, 4]);
    let kn = TensorData::F32(vec![0.1; 8]);
    let vn = TensorData::F32(vec![0.2; 12]);
    let opts = AttentionOptions::default();
    let mut cache = c.clone();
    let e = cpu::decode(
        &mut cache,
        &DecodeStep::new(q, &[1, 1]).append(kn.view([2, 1, 1, 4]), kn.view([2, 1, 1, 4])),
        &opts,
        None,
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            Error::ShapeMismatch {
                tensor: "v_new",
                ..
            }
        ),
        "{e}"
    );
    assert!(cache == c, "a failed step changed the cache");
    let out = cpu::decode(
        &mut cache,
        &DecodeStep::new(q, &[1, 1]).append(kn.view([2, 1, 1, 4]), vn.view([2, 1, 1, 6])),
        &opts,
        None,
    )
    .unwrap();
    assert_eq!(out.o.shape, [2, 1, 1, 6]);
}

#[test]
fn paged_steps_check_every_page_they_use() {
    let layout = CacheLayout::Paged {
        pages: 3,
        page_size: 2,
    };
    let shape = CacheShape::new(layout, 1, 4).unwrap();
    let cache = HostKvCache::zeros(shape, Precision::F32);
    let q = TensorData::F32(vec![0.5; 4]);
    let q = q.view([1, 1, 1, 4]);
    let opts = AttentionOptions::default();
    let run = |table: &[i32], len: i32| {
        let mut c = cache.clone();
        cpu::decode(
            &mut c,
            &DecodeStep::new(q, &[len]).block_table(table, 2),
            &opts,
            None,
        )
    };
    // Padding past the last used page is never read.
    run(&[2, -1], 2).expect("one page used");
    let e = run(&[2, -1], 3).unwrap_err();
    assert!(
        matches!(
            e,
            Error::PageOutOfRange {
                tensor: "block_table",
                slot: 1,
                page: -1,
                ..
            }
        ),
        "{e}"
    );
    let e = run(&[3, 0], 1).unwrap_err();
    assert!(
        matches!(
            e,
            Error::PageOutOfRange {
                page: 3,
                pages: 3,
                ..
            }
        ),
        "{e}"
    );
    let e = run(&[0, 1], 5).unwrap_err();
    assert!(matches!(e, Error::CacheOverflow { capacity: 4, .. }), "{e}");
    let mut c = cache.clone();
    let e = cpu::decode(&mut c, &DecodeStep::new(q, &[1]), &opts, None).unwrap_err();
    assert!(matches!(e, Error::CacheIndex { .. }), "{e}");
}

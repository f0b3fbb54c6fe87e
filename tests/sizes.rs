//! Hostile sizes through every input path of the library: a shape whose
//! element count overflows (2²¹ × 2²¹ × 2²¹ × 8 wraps u64 to 0, so an empty
//! slice used to pass as its data) is `Error::SizeOverflow`, at once, with
//! nothing allocated: tensor views, shapes, the CPU backend, the f64
//! reference, wgpu, KV caches, block tables, block masks and windows. The
//! 32-bit (wasm32) limit is unit-tested in `api::size`. Property tests
//! check that arbitrary dims validate with an element count that fits, or
//! give the typed error, never a panic (bounded to about a second: raise
//! `PROPTEST_CASES` for a longer run).

mod common;

use flashattn::Alibi;
use flashattn::BlockMask;
use flashattn::ForwardInputs;
use flashattn::MAX_ELEMENTS;
use flashattn::{
    AttentionOptions, AttentionShape, BackwardInputs, CacheLayout, CacheShape, DecodeProblem,
    DecodeStep, Error, Fp8Options, HostKvCache, Layout, Mask, Precision, Tensor, TensorData,
    TensorView, Window,
};
use proptest::prelude::*;
use std::time::{Duration, Instant};

const H: usize = 1 << 21;
/// The shape: 2⁶⁶ elements, 0 in wrapping u64 arithmetic.
const WRAPPING: [usize; 4] = [H, H, H, 8];

fn is_overflow<T: std::fmt::Debug>(r: flashattn::Result<T>, tensor: &str) -> bool {
    match r {
        Err(Error::SizeOverflow { what, .. }) => what == tensor,
        other => panic!("expected SizeOverflow of {tensor}, got {other:?}"),
    }
}

#[test]
fn views_and_shapes_that_overflow_are_typed_errors() {
    let q = TensorView::f32(WRAPPING, &[]);
    match AttentionShape::from_views(&q, &q, &q) {
        Err(Error::SizeOverflow {
            what: "q",
            op: "element count",
            operands,
            max,
        }) => {
            assert_eq!(operands, WRAPPING.map(|d| d as u64));
            assert_eq!(max, MAX_ELEMENTS);
        }
        other => panic!("{other:?}"),
    }
    assert!(is_overflow(q.check_len("q"), "q"));
    // 2^32 · 2^32 wraps to 0 as well; packed views are checked the same way.
    let square = TensorView::f16([1 << 32, 1 << 32, 1, 1], &[]);
    assert!(is_overflow(square.check_len("k"), "k"));
    let packed = TensorView::packed_bf16([1 << 32, 1 << 32, 1], &[]);
    assert!(is_overflow(packed.check_len("q"), "q"));
    // o (q's rows, v's head dim) can overflow where q, k and v fit.
    let tall = AttentionShape::new(1, 1 << 53, 1, 1, 1, 1).unwrap();
    assert!(is_overflow(tall.with_head_dim_v(512), "o"));
    // A shape built field by field, as forward_buffers and the planner take.
    let literal = AttentionShape {
        seqlen_k: 1 << 62,
        ..tall
    };
    assert!(is_overflow(literal.check(), "k"));
}

/// Raw bytes shorter than the elements asked for (or a count whose bytes
/// overflow) are a typed error, not a slice panic.
#[test]
fn tensor_data_from_too_few_bytes_is_a_typed_error() {
    let bytes = [0u8; 10];
    let ok = TensorData::from_bytes(&bytes, Precision::F16, 5).unwrap();
    assert_eq!(ok.len(), 5);
    for (precision, n, held) in [(Precision::F32, 3, 2), (Precision::Bf16, usize::MAX, 5)] {
        match TensorData::from_bytes(&bytes, precision, n) {
            Err(Error::DataLength {
                expected, actual, ..
            }) => assert_eq!((expected, actual), (n, held)),
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn every_backend_rejects_the_wrapping_shape_at_once() {
    let start = Instant::now();
    let q = TensorView::f32(WRAPPING, &[]);
    let opts = AttentionOptions::default().causal(true);
    assert!(is_overflow(
        flashattn::cpu::forward(&ForwardInputs::new(q, q, q), &opts),
        "q"
    ));
    let fp8 = Fp8Options::default();
    assert!(is_overflow(
        flashattn::cpu::forward_fp8(&ForwardInputs::new(q, q, q), &opts, &fp8),
        "q"
    ));
    let inputs = BackwardInputs {
        q,
        k: q,
        v: q,
        o: q,
        lse: &[],
        d_o: q,
    };
    assert!(is_overflow(flashattn::cpu::backward(&inputs, &opts), "q"));
    assert!(is_overflow(
        flashattn::reference::forward(&q, &q, &q, &opts),
        "q"
    ));
    assert!(is_overflow(
        flashattn::reference::backward(&q, &q, &q, &q, &opts),
        "q"
    ));
    if let Some(e) = common::engine() {
        assert!(is_overflow(
            e.forward(&ForwardInputs::new(q, q, q), &opts),
            "q"
        ));
        assert!(is_overflow(e.backward(&inputs, &opts), "q"));
        assert!(is_overflow(
            e.forward_fp8(&ForwardInputs::new(q, q, q), &opts, &fp8),
            "q"
        ));
        assert!(is_overflow(e.quantize_fp8(&q, &fp8), "x"));
        // A head dim past any transform, with no data, is caught before the
        // transform's signs would be allocated.
        let wide = TensorView::f32([1, 1, 1, 1 << 40], &[]);
        let err = e.quantize_fp8(&wide, &Fp8Options::hadamard(1)).unwrap_err();
        assert!(matches!(err, Error::DataLength { .. }), "{err:?}");
        let cache = CacheShape {
            layout: CacheLayout::Paged {
                pages: 1 << 40,
                page_size: 1 << 40,
            },
            heads_kv: 1,
            head_dim: 8,
            head_dim_v: 8,
            latent: false,
        };
        assert!(is_overflow(
            e.kv_cache(cache, Precision::F16),
            "the kv cache"
        ));
    }
    // The CPU backend no longer spins over 2^21 batch entries of nothing.
    assert!(
        start.elapsed() < Duration::from_secs(1),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn decode_inputs_are_checked() {
    let paged =
        |pages, page_size, d| CacheShape::new(CacheLayout::Paged { pages, page_size }, 1, d);
    assert!(is_overflow(paged(1 << 40, 1 << 40, 8), "the kv cache"));
    let wrapping = Tensor {
        shape: WRAPPING.to_vec(),
        data: TensorData::F32(Vec::new()),
    };
    assert!(is_overflow(
        HostKvCache::from_tensors(wrapping.clone(), wrapping, false),
        "the kv cache"
    ));
    // batch × max_pages of a block table.
    let cache = paged(4, 4, 8).unwrap();
    let q = vec![0.0f32; 2 * 8];
    let step = DecodeStep::new(TensorView::f32([2, 1, 1, 8], &q), &[1, 1]);
    assert!(is_overflow(
        DecodeProblem::new(
            &step.block_table(&[0, 1], usize::MAX),
            &cache,
            Precision::F32
        ),
        "block_table (batch × max_pages)"
    ));
    // max_pages × page_size: 16 pages of 2^60 tokens.
    let cache = paged(1, 1 << 60, 1).unwrap();
    let q = [0.0f32];
    let step = DecodeStep::new(TensorView::f32([1, 1, 1, 1], &q), &[0]).block_table(&[0; 16], 16);
    assert!(is_overflow(
        DecodeProblem::new(&step, &cache, Precision::F32),
        "cache capacity (max_pages × page_size)"
    ));
}

#[test]
fn layouts_and_windows_are_checked() {
    assert!(is_overflow(
        BlockMask::new(WRAPPING, (1, 1), &[]),
        "block_mask"
    ));
    // batch × heads past usize is a length mismatch, not an overflow.
    assert!(matches!(
        Alibi::new(&[0.5]).validate_for(usize::MAX, 2),
        Err(Error::AlibiSlopes { .. })
    ));
    // Windows wider than any sequence allow every key, on every backend.
    let (sq, sk, h, d) = (5, 7, 2, 8);
    let mut rng = flashattn::random::Rng::new(5);
    let data = [sq, sk, sk].map(|s| rng.normal_vec(s * h * d, 1.0));
    let [q, k, v] = [0, 1, 2].map(|t| TensorView::f32([1, [sq, sk, sk][t], h, d], &data[t]));
    let plain = AttentionOptions::default();
    for window in [
        Window::from_signed(i64::MAX, i64::MAX),
        Window::new(Some(usize::MAX), Some(usize::MAX)),
    ] {
        let wide = AttentionOptions::default().window(window.left, window.right);
        let mask = wide.mask_for(sq, sk);
        assert!((0..sq).all(|i| mask.key_range(i) == (0..sk)));
        let want = flashattn::cpu::forward(&ForwardInputs::new(q, k, v), &plain).unwrap();
        let got = flashattn::cpu::forward(&ForwardInputs::new(q, k, v), &wide).unwrap();
        assert_eq!((got.o, got.lse), (want.o, want.lse));
        if let Some(e) = common::engine() {
            let got = e.forward(&ForwardInputs::new(q, k, v), &wide).unwrap();
            let [o, lse] = flashattn::accuracy::check_forward(&got, &q, &k, &v, &plain).unwrap();
            assert!(o.passed() && lse.passed(), "{o} {lse}");
        }
    }
}

/// `Problem::new` and `dropout_mask` take a shape that may have been
/// built field by field: its size rules are checked there too (an
/// overflowing batch used to reach an allocation, a 0 or an indivisible
/// head count passed as a valid problem).
#[test]
fn shapes_built_field_by_field_are_checked_where_they_are_taken() {
    let valid = AttentionShape::new(1, 4, 4, 2, 2, 8).unwrap();
    let opts = AttentionOptions::default();
    let dropout = AttentionOptions::default().dropout(0.5).dropout_seed(1);
    let huge = AttentionShape {
        batch: usize::MAX,
        seqlen_q: usize::MAX,
        ..valid
    };
    assert!(is_overflow(
        flashattn::Problem::new(huge, Precision::F32, &opts),
        "q"
    ));
    assert!(is_overflow(flashattn::dropout_mask(&huge, &dropout), "q"));
    let no_kv_heads = AttentionShape {
        heads_kv: 0,
        ..valid
    };
    let uneven = AttentionShape {
        heads_q: 3,
        ..valid
    };
    for shape in [no_kv_heads, uneven] {
        for err in [
            flashattn::Problem::new(shape, Precision::F32, &opts).map(|_| ()),
            flashattn::dropout_mask(&shape, &dropout).map(|_| ()),
        ] {
            assert!(
                matches!(
                    err,
                    Err(Error::EmptyDim { dim: "heads_kv" } | Error::HeadsNotDivisible { .. })
                ),
                "{err:?}"
            );
        }
    }
}

// ---- property tests ----

/// Sizes that exercise the checks: 0, small, powers of two, usize::MAX.
fn size() -> impl Strategy<Value = usize> {
    prop_oneof![
        4 => 0usize..6,
        3 => (0u32..usize::BITS).prop_map(|e| 1usize << e),
        1 => any::<usize>(),
        1 => Just(usize::MAX),
    ]
}

fn head_dim() -> impl Strategy<Value = usize> {
    prop_oneof![3 => 0usize..9, 1 => 500usize..520, 1 => size()]
}

/// The exact element count, or `None` past this target's limit (the
/// nonzero dims' product, so a 0 does not hide an overflow).
fn count(dims: &[usize]) -> Option<u128> {
    let nonzero: u128 = dims
        .iter()
        .filter(|&&d| d != 0)
        .try_fold(1u128, |acc, &d| acc.checked_mul(d as u128))?;
    (nonzero <= MAX_ELEMENTS as u128).then(|| if dims.contains(&0) { 0 } else { nonzero })
}

/// The band rule in i128, with no clamping: key j is allowed for row i iff
/// `i + off - left <= j <= i + off + right` and `0 <= j < seqlen_k`.
fn band(
    sq: usize,
    sk: usize,
    (left, right): (Option<usize>, Option<usize>),
    i: usize,
) -> (i128, i128) {
    let center = i as i128 + sk as i128 - sq as i128;
    let lo = left.map_or(0, |l| (center - l as i128).max(0));
    let hi = right.map_or(sk as i128, |r| (center + r as i128 + 1).min(sk as i128));
    (lo, hi)
}

fn window_side() -> impl Strategy<Value = Option<usize>> {
    prop_oneof![
        Just(None),
        (0usize..8).prop_map(Some),
        size().prop_map(Some)
    ]
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn shapes_validate_or_give_a_typed_error(
        [b, sq, sk, hq, hk] in [size(), size(), size(), size(), size()],
        (d, dv) in (head_dim(), head_dim()),
    ) {
        let r = AttentionShape::new(b, sq, sk, hq, hk, d).and_then(|s| s.with_head_dim_v(dv));
        let tensors = [
            ("q", [b, sq, hq, d]),
            ("k", [b, sk, hk, d]),
            ("v", [b, sk, hk, dv]),
            ("o", [b, sq, hq, dv]),
        ];
        match r {
            Ok(s) => {
                for (name, dims) in tensors {
                    prop_assert!(count(&dims).is_some(), "{name} {dims:?} passed");
                }
                prop_assert_eq!(Some(s.q_len() as u128), count(&tensors[0].1));
                prop_assert_eq!(Some(s.o_len() as u128), count(&tensors[3].1));
                prop_assert_eq!(s.lse_len() as u128, (b * hq * sq) as u128);
                // The last row of each layout ends at its tensor's end.
                let last = |l: Layout, rows: usize| l.row(b - 1, rows - 1, l.heads - 1) + l.dim;
                prop_assert_eq!(last(Layout::q(&s), sq), s.q_len());
                prop_assert_eq!(last(Layout::kv(&s), sk), s.kv_len());
                prop_assert_eq!(last(Layout::v(&s), sk), s.v_len());
                prop_assert_eq!(last(Layout::o(&s), sq), s.o_len());
                prop_assert_eq!(flashattn::api::shape::lse_index(&s, b - 1, hq - 1, sq - 1) + 1, s.lse_len());
            }
            Err(Error::EmptyDim { .. }) => {
                prop_assert!([b, sq, sk, hq, hk, d, dv].contains(&0));
            }
            Err(Error::HeadDimTooLarge { head_dim, .. }) => {
                prop_assert!(head_dim > flashattn::MAX_HEAD_DIM);
            }
            Err(Error::HeadsNotDivisible { .. }) => prop_assert!(hq % hk != 0),
            Err(Error::SizeOverflow { what, operands, .. }) => {
                let (_, dims) = tensors.iter().find(|(n, _)| *n == what).unwrap();
                prop_assert_eq!(&operands, &dims.map(|x| x as u64).to_vec());
                prop_assert!(count(dims).is_none());
            }
            Err(other) => prop_assert!(false, "unexpected {other:?}"),
        }
    }

    #[test]
    fn views_check_their_length(shape in [size(), size(), size(), size()], len in 0usize..40) {
        let data = vec![0.0f32; len];
        match TensorView::f32(shape, &data).check_len("x") {
            Ok(()) => prop_assert_eq!(count(&shape), Some(len as u128)),
            Err(Error::DataLength { expected, actual, .. }) => {
                prop_assert_eq!(Some(expected as u128), count(&shape));
                prop_assert_eq!(actual, len);
                prop_assert_ne!(expected, len);
            }
            Err(Error::SizeOverflow { .. }) => prop_assert!(count(&shape).is_none()),
            Err(other) => prop_assert!(false, "unexpected {other:?}"),
        }
    }

    #[test]
    fn caches_and_block_masks_validate_or_give_a_typed_error(
        (outer, inner, heads, d) in (size(), size(), size(), head_dim()),
        paged in any::<bool>(),
        len in 0usize..40,
    ) {
        let dims = [outer, inner, heads, d];
        match CacheShape::from_dims(dims, paged) {
            Ok(c) => prop_assert_eq!(Some(c.len() as u128), count(&dims)),
            Err(Error::SizeOverflow { .. }) => prop_assert!(count(&dims).is_none()),
            Err(Error::EmptyDim { .. } | Error::HeadDimTooLarge { .. }) => {}
            Err(other) => prop_assert!(false, "unexpected {other:?}"),
        }
        match BlockMask::new(dims, (1, 1), &vec![1; len]) {
            Ok(m) => prop_assert_eq!(m.data().len() as u128, len as u128),
            Err(Error::SizeOverflow { .. }) => prop_assert!(count(&dims).is_none()),
            Err(Error::DataLength { .. }) => prop_assert_ne!(count(&dims), Some(len as u128)),
            Err(other) => prop_assert!(false, "unexpected {other:?}"),
        }
    }

    #[test]
    fn the_band_matches_its_rule_for_any_window(
        (sq, sk) in (0usize..100_000, 0usize..100_000),
        window in (window_side(), window_side()),
        causal in any::<bool>(),
        row in any::<prop::sample::Index>(),
    ) {
        let opts = AttentionOptions::default().causal(causal).window(window.0, window.1);
        let mask: Mask = opts.mask_for(sq, sk);
        let right = if causal { Some(0) } else { window.1 };
        for i in [0, sq.saturating_sub(1), row.index(sq.max(1))] {
            let (lo, hi) = band(sq, sk, (window.0, right), i);
            let got = mask.key_range(i);
            if lo >= hi {
                prop_assert!(got.is_empty(), "row {i}: {got:?}");
            } else {
                prop_assert_eq!((got.start as i128, got.end as i128), (lo, hi));
            }
        }
    }

    #[test]
    fn decode_steps_validate_or_give_a_typed_error(
        (batch, max_pages) in (1usize..4, size()),
        (pages, page_size) in (size(), size()),
        lens in proptest::collection::vec(any::<i32>(), 1..4),
        table in proptest::collection::vec(-2i32..6, 0..16),
    ) {
        let Ok(cache) = CacheShape::new(CacheLayout::Paged { pages, page_size }, 1, 1) else {
            return Ok(());
        };
        let q = vec![0.0f32; batch];
        let step = DecodeStep::new(TensorView::f32([batch, 1, 1, 1], &q), &lens)
            .block_table(&table, max_pages);
        if let Ok(p) = DecodeProblem::new(&step, &cache, Precision::F32) {
            for b in 0..batch {
                prop_assert!(p.seqlen_k(b) as u128 <= max_pages as u128 * page_size as u128);
            }
        }
    }
}

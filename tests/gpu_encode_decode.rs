//! Encoded decoding: steps recorded into the app's own command encoder, on
//! a KV cache in the app's buffers and on ranges it sub-allocates (non-zero,
//! aligned offsets), give the bytes of the host call `Engine::decode` on the
//! same data (itself checked against the f64 reference), append exactly the
//! reference's rows and write nothing else; an app cache over several steps
//! (`encode_append`, then `encode_decode`) stays equal to an engine cache;
//! cache ranges the device cannot take, and outputs bound from an input's
//! buffer, are typed errors. The cases are tests/gpu_decode.rs's (f32, d 32).

mod common;

use common::arena::{sentinels, Arena};
use common::decode::DecodeCase;
use common::engine;
use flashattn::{
    Alibi, AttentionOptions, CacheLayout, CacheShape, DecodeBindings, DecodeProblem, DecodeStep,
    Engine, Error, HostKvCache, Precision, Sinks, TensorData,
};

fn host(t: &TensorData) -> &[u8] {
    t.as_host().as_bytes()
}

/// `Engine::decode` on a device copy of the host cache, the cache read
/// back into it.
fn host_decode(
    e: &Engine,
    cache: &mut HostKvCache,
    step: &DecodeStep,
    case: &DecodeCase,
) -> flashattn::Result<flashattn::DecodeOutput> {
    let mut device = e.upload_kv_cache(cache)?;
    let out = e.decode(&mut device, step, &case.opts, case.num_splits)?;
    *cache = e.read_kv_cache(&device)?;
    Ok(out)
}

/// V's bytes of a step's tensor `t`, or a latent step's `unused`
/// placeholder (it has no V of its own).
fn v_bytes<'a>(latent: bool, unused: &'a [u8], t: &'a TensorData) -> &'a [u8] {
    if latent {
        unused
    } else {
        host(t)
    }
}

/// The tensors' indices in an [`Arena`] of one step.
const Q: usize = 0;
const K_CACHE: usize = 1;
const V_CACHE: usize = 2;
const O: usize = 3;
const LSE: usize = 4;
const K_NEW: usize = 5;
const V_NEW: usize = 6;

/// One encoded step of `case` — q, the new rows and the cache on ranges of
/// the app's buffers, o and lse on ranges of another, the splits' partials
/// in the app's scratch where `app_scratch` — gives the host call's o and
/// lse bytes and its cache, and writes nothing else.
fn encoded_step_matches_the_host_call(e: &Engine, case: &DecodeCase, app_scratch: bool) {
    let data = case.data();
    let step = data.step();
    let expected = data.check(|c, s| host_decode(e, c, s, case));
    let after = flashattn::reference::decode_cache(&data.cache, &step).unwrap();
    let appends = case.seqlen_new > 0;
    // Inputs in buffer 0; the cache there too when the step only reads it,
    // else in buffer 1 (the append writes it while reading k_new, v_new);
    // outputs in buffer 2.
    let cache_in = if appends { 1 } else { 0 };
    // A latent step binds no V of its own (V is a view of K): a placeholder
    // in V's place, which it must leave alone.
    let unused = [0x5au8; 4];
    let v_of = |t| v_bytes(case.latent, &unused, t);
    let o = host(&expected.o.data);
    let lse: &[u8] = bytemuck::cast_slice(&expected.lse);
    let (o_fill, lse_fill) = (sentinels(o.len() as u64), sentinels(lse.len() as u64));
    let mut tensors = vec![
        (0, host(&data.q)),
        (cache_in, host(&data.cache.k)),
        (cache_in, v_of(&data.cache.v)),
        (2, &o_fill[..]),
        (2, &lse_fill[..]),
    ];
    if appends {
        tensors.extend([(0, host(&data.k_new)), (0, v_of(&data.v_new))]);
    }
    let arena = Arena::new(e, &tensors);
    let shape = data.cache.shape;
    let cache = e
        .kv_cache_in(
            shape,
            case.precision,
            arena.binding(K_CACHE),
            arena.binding(V_CACHE),
        )
        .unwrap();
    let mut bindings = DecodeBindings::new(arena.binding(Q), arena.binding(O), arena.binding(LSE));
    if appends && case.latent {
        bindings = bindings.append_latent(arena.binding(K_NEW));
    } else if appends {
        bindings = bindings.append(arena.binding(K_NEW), arena.binding(V_NEW));
    }
    let problem = DecodeProblem::new(&step, &shape, case.precision).unwrap();
    let planned = e
        .plan_decode(&problem, &case.opts, case.num_splits)
        .unwrap();
    let need = e.decode_scratch_size(&problem, &planned);
    let align = e.limits().min_storage_buffer_offset_alignment as u64;
    let scratch = e.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("app scratch"),
        size: align + need.max(4),
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    if app_scratch {
        assert!(need > 0, "{case:?} runs in one split");
        bindings = bindings.scratch(wgpu::BufferBinding {
            buffer: &scratch,
            offset: align,
            size: wgpu::BufferSize::new(need),
        });
    }
    let mut encoder = e.device().create_command_encoder(&Default::default());
    let spec = step.spec();
    let plan = e
        .encode_decode(
            &mut encoder,
            &cache,
            &spec,
            &bindings,
            &case.opts,
            case.num_splits,
        )
        .unwrap();
    assert_eq!(plan.splits.num_splits, expected.num_splits, "{case:?}");
    let bytes = arena.submit_and_read(e, encoder);
    let mut want = vec![host(&data.q), host(&after.k), v_of(&after.v), o, lse];
    if appends {
        want.extend([host(&data.k_new), v_of(&data.v_new)]);
    }
    let want: Vec<Option<&[u8]>> = want.into_iter().map(Some).collect();
    arena.holds(&bytes, &want);
}

#[test]
fn encoded_steps_on_sub_allocated_ranges_give_the_host_calls_bytes() {
    let Some(e) = engine() else { return };
    let causal = AttentionOptions::default().causal(true);
    let dense = DecodeCase::new(&[300, 0, 45], 32).opts(causal.clone());
    // Dense, with and without the append (the planner's splits, partials
    // in a buffer the engine makes where it plans several).
    encoded_step_matches_the_host_call(e, &dense.clone().append(3), false);
    encoded_step_matches_the_host_call(e, &dense, false);
    // Paged, appending, in three splits whose partials go in the app's
    // scratch.
    let paged = DecodeCase::new(&[1200, 70], 32)
        .paged(16)
        .seqlen_q(4)
        .append(4)
        .opts(causal.clone())
        .splits(3);
    encoded_step_matches_the_host_call(e, &paged, true);
    // ALiBi and sinks: the side tables in a buffer of the step's own.
    let scored = DecodeCase::new(&[900, 0], 32)
        .heads(4, 2)
        .append(1)
        .opts(
            causal
                .alibi(Alibi::standard(4))
                .sinks(Sinks::new(&[0.5, -1.0, 2.0, 0.0])),
        )
        .splits(2);
    encoded_step_matches_the_host_call(e, &scored, true);
    // A latent cache (MLA): one range, k_new alone appended, V read from K.
    let latent = DecodeCase::new(&[300, 45], 576)
        .dv(512)
        .heads(16, 1)
        .paged(16)
        .latent()
        .append(2)
        .splits(3);
    encoded_step_matches_the_host_call(e, &latent, true);
}

/// An app cache in one buffer (K and V at non-zero offsets), grown step by
/// step with `encode_append` then `encode_decode` recorded into one encoder
/// per step, gives every step the bytes an engine cache gives under
/// `Engine::decode`, and ends equal to it.
#[test]
fn an_app_cache_across_steps_equals_an_engine_cache() {
    let Some(e) = engine() else { return };
    let (b, hq, hk, d) = (2, 4, 2, 32);
    let layout = CacheLayout::Paged {
        pages: 12,
        page_size: 5,
    };
    let shape = CacheShape::new(layout, hk, d).unwrap();
    let mut engine_cache = e.kv_cache(shape, Precision::F32).unwrap();
    let bytes = (shape.len() * 4) as u64;
    let zeros = vec![0u8; bytes as usize];
    let q_bytes = vec![0u8; b * hq * d * 4];
    let lse_bytes = vec![0u8; b * hq * 4];
    let new_bytes = vec![0u8; b * hk * d * 4];
    // The cache in buffer 0; the step's inputs (written per step) in 1,
    // its outputs in 2.
    let arena = Arena::new(
        e,
        &[
            (0, &zeros[..]),
            (0, &zeros[..]),
            (1, &q_bytes[..]),
            (1, &new_bytes[..]),
            (1, &new_bytes[..]),
            (2, &q_bytes[..]),
            (2, &lse_bytes[..]),
        ],
    );
    let app_cache = e
        .kv_cache_in(shape, Precision::F32, arena.binding(0), arena.binding(1))
        .unwrap();
    let table = [7, 2, 9, 0, 11, 4];
    let mut rng = flashattn::random::Rng::new(9);
    let opts = AttentionOptions::default().causal(true);
    for n in 0..4 {
        let lens = [n, n + 3];
        let mut t = |len| TensorData::from_f32(rng.normal_vec(len, 1.0), Precision::F32);
        let (q, k, v) = (t(b * hq * d), t(b * hk * d), t(b * hk * d));
        let s = DecodeStep::new(q.view([b, 1, hq, d]), &lens)
            .block_table(&table, 3)
            .append(k.view([b, 1, hk, d]), v.view([b, 1, hk, d]));
        let expected = e.decode(&mut engine_cache, &s, &opts, None).unwrap();
        for (i, data) in [(2, &q), (3, &k), (4, &v)] {
            let (buffer, offset, _) = arena.at[i];
            e.queue()
                .write_buffer(&arena.buffers[buffer], offset, host(data));
        }
        let mut encoder = e.device().create_command_encoder(&Default::default());
        let spec = s.spec();
        e.encode_append(
            &mut encoder,
            &app_cache,
            &spec,
            arena.binding(3),
            arena.binding(4),
        )
        .unwrap();
        let outputs = DecodeBindings::new(arena.binding(2), arena.binding(5), arena.binding(6));
        let plan = e
            .encode_decode(&mut encoder, &app_cache, &spec, &outputs, &opts, None)
            .unwrap();
        assert_eq!(plan.splits.num_splits, expected.num_splits);
        let bytes = arena.submit_and_read(e, encoder);
        assert!(
            arena.slice(&bytes, 5) == host(&expected.o.data),
            "step {n}: o differs"
        );
        let lse: &[u8] = bytemuck::cast_slice(&expected.lse);
        assert!(arena.slice(&bytes, 6) == lse, "step {n}: lse differs");
    }
    assert!(
        e.read_kv_cache(&app_cache).unwrap() == e.read_kv_cache(&engine_cache).unwrap(),
        "the app cache differs from the engine's"
    );
}

/// Cache ranges the device cannot take are typed errors naming the cache;
/// outputs bound from an input's buffer too, and nothing is recorded.
#[test]
fn bad_cache_ranges_are_typed_errors() {
    let Some(e) = engine() else { return };
    let case = DecodeCase::new(&[300, 0, 45], 32).append(3);
    let data = case.data();
    let (k, v, q) = (host(&data.cache.k), host(&data.cache.v), host(&data.q));
    let new = host(&data.k_new);
    let lse = vec![0u8; 4 * case.batch() * case.heads_q];
    let arena = Arena::new(
        e,
        &[
            (0, q),
            (1, k),
            (1, v),
            (2, q),
            (2, &lse),
            (0, new),
            (0, new),
        ],
    );
    let (shape, f32) = (data.cache.shape, Precision::F32);
    let mut misaligned = arena.binding(K_CACHE);
    misaligned.offset += 4;
    let align = e.limits().min_storage_buffer_offset_alignment;
    assert!(matches!(
        e.kv_cache_in(shape, f32, misaligned, arena.binding(V_CACHE)),
        Err(Error::MisalignedBinding { tensor: "k cache", alignment, .. }) if alignment == align
    ));
    let mut short = arena.binding(V_CACHE);
    short.size = wgpu::BufferSize::new(v.len() as u64 - 4);
    assert!(matches!(
        e.kv_cache_in(shape, f32, arena.binding(K_CACHE), short),
        Err(Error::BufferTooSmall {
            buffer: "v cache",
            ..
        })
    ));
    let cache = e
        .kv_cache_in(shape, f32, arena.binding(K_CACHE), arena.binding(V_CACHE))
        .unwrap();
    let step = data.step();
    let spec = step.spec();
    let mut encoder = e.device().create_command_encoder(&Default::default());
    let mut try_with =
        |b: DecodeBindings| e.encode_decode(&mut encoder, &cache, &spec, &b, &case.opts, None);
    let good = || {
        DecodeBindings::new(arena.binding(Q), arena.binding(O), arena.binding(LSE))
            .append(arena.binding(K_NEW), arena.binding(V_NEW))
    };
    let o_on_cache = DecodeBindings {
        o: arena.binding(K_CACHE),
        ..good()
    };
    assert!(matches!(
        try_with(o_on_cache),
        Err(Error::OverlappingBindings {
            output: "o",
            other: "k cache"
        })
    ));
    let new_on_cache = good().append(arena.binding(K_NEW), arena.binding(V_CACHE));
    assert!(matches!(
        try_with(new_on_cache),
        Err(Error::OverlappingBindings {
            output: "v cache",
            other: "v_new"
        })
    ));
    let bytes = arena.submit_and_read(e, encoder);
    assert!(arena.slice(&bytes, K_CACHE) == k, "the cache was written");
    assert!(arena.slice(&bytes, O) == q, "o was written");
}

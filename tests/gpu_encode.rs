//! Encoded calls: the forward and the backward recorded into the app's own command encoder,
//! on ranges of buffers the app sub-allocates (non-zero, aligned offsets),
//! submitted by the app with its own copies in the same encoder, gives the
//! same bytes as the host-tensor call — also with every tensor of the
//! forward, the backward, the FP8 forward, an append and a decoding step in
//! ONE buffer; bindings the
//! device cannot take (misaligned, outside their buffer, too small, an
//! output range intersecting another) are typed errors and leave the
//! encoder empty.

mod common;

use common::arena::{sentinels, Arena, SENTINEL};
use common::decode::DecodeCase;
use common::{causal, engine, output_grad, Case};
use flashattn::{
    AttentionBindings, AttentionShape, BackwardInputs, DecodeBindings, DecodeProblem, Engine,
    Error, Fp8Options, GradientBindings, Pass, Plan, PlanOverrides, Problem, TensorData,
    VerdictCache, VerifyMode,
};
use flashattn::{BlockGrid, BlockMask, ForwardInputs};

/// The app's buffers for one call: the inputs sub-allocated in one, the
/// outputs (filler of the given sizes) in another.
fn split_arena(e: &Engine, inputs: &[&[u8]], outputs: &[u64]) -> Arena {
    let fills: Vec<Vec<u8>> = outputs.iter().map(|&o| sentinels(o)).collect();
    let tensors: Vec<(usize, &[u8])> = inputs
        .iter()
        .map(|i| (0, *i))
        .chain(fills.iter().map(|f| (1, &f[..])))
        .collect();
    Arena::new(e, &tensors)
}

/// A forward's bindings in an arena of q, k, v, then o, lse.
fn attention(a: &Arena) -> AttentionBindings<'_> {
    AttentionBindings {
        q: a.binding(0),
        k: a.binding(1),
        v: a.binding(2),
        o: a.binding(3),
        lse: a.binding(4),
    }
}

/// A backward's bindings in an arena of q, k, v, o, do, lse, then dq, dk, dv.
fn gradients(a: &Arena) -> GradientBindings<'_> {
    GradientBindings {
        q: a.binding(0),
        k: a.binding(1),
        v: a.binding(2),
        o: a.binding(3),
        d_o: a.binding(4),
        lse: a.binding(5),
        dq: a.binding(6),
        dk: a.binding(7),
        dv: a.binding(8),
        scratch: None,
    }
}

/// The inputs are as they were, the outputs hold `outputs`, nothing else
/// changed.
fn holds_io(a: &Arena, bytes: &[Vec<u8>], inputs: &[&[u8]], outputs: &[&[u8]]) {
    let want: Vec<Option<&[u8]>> = inputs.iter().chain(outputs).map(|t| Some(*t)).collect();
    a.holds(bytes, &want);
}

fn host(t: &TensorData) -> &[u8] {
    t.as_host().as_bytes()
}

/// The forward encoded on sub-allocated bindings gives the host call's
/// bytes, o and lse, and writes nothing else.
fn encoded_forward_matches_the_host_call(e: &Engine, case: &Case) -> Plan {
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let expected = e.forward(&ForwardInputs::new(q, k, v), &case.opts).unwrap();
    let ins = inputs.stored.each_ref().map(host);
    let lse: &[u8] = bytemuck::cast_slice(&expected.lse);
    let outs = [host(&expected.o.data), lse];
    let arena = split_arena(e, &ins, &outs.map(|o| o.len() as u64));
    let problem = Problem::forward(&ForwardInputs::new(q, k, v), &case.opts).unwrap();
    let mut encoder = e.device().create_command_encoder(&Default::default());
    let plan = e
        .encode_forward(&mut encoder, &problem, &attention(&arena))
        .unwrap();
    assert_eq!(Some(plan), expected.stats.plan, "the host call's plan");
    holds_io(&arena, &arena.submit_and_read(e, encoder), &ins, &outs);
    plan
}

/// The backward encoded the same way gives the host call's dq, dk, dv.
fn encoded_backward_matches_the_host_call(e: &Engine, case: &Case) {
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let fwd = e.forward(&ForwardInputs::new(q, k, v), &case.opts).unwrap();
    let (_, d_o) = output_grad(case);
    let host_inputs =
        BackwardInputs::new(ForwardInputs::new(q, k, v), &fwd, inputs.grad(&d_o)).unwrap();
    let expected = e.backward(&host_inputs, &case.opts).unwrap();
    let [qb, kb, vb] = inputs.stored.each_ref().map(host);
    let ins = [
        qb,
        kb,
        vb,
        host(&fwd.o.data),
        host(&d_o),
        bytemuck::cast_slice(&fwd.lse),
    ];
    let outs = [&expected.dq, &expected.dk, &expected.dv].map(|g| host(&g.data));
    let arena = split_arena(e, &ins, &outs.map(|o| o.len() as u64));
    let problem = Problem::backward(&host_inputs, &case.opts).unwrap();
    // D in a buffer the engine creates, then in the app's scratch (at a
    // non-zero offset of a buffer of its own).
    let need = e.scratch_size(Pass::Backward, &problem);
    assert_eq!(need, 4 * fwd.lse.len() as u64);
    let align = e.limits().min_storage_buffer_offset_alignment as u64;
    let scratch = e.device().create_buffer(&wgpu::BufferDescriptor {
        label: Some("app scratch"),
        size: align + need,
        usage: wgpu::BufferUsages::STORAGE,
        mapped_at_creation: false,
    });
    let theirs = wgpu::BufferBinding {
        buffer: &scratch,
        offset: align,
        size: wgpu::BufferSize::new(need),
    };
    for given in [None, Some(theirs.clone())] {
        let bindings = GradientBindings {
            scratch: given,
            ..gradients(&arena)
        };
        let mut encoder = e.device().create_command_encoder(&Default::default());
        let plan = e
            .encode_backward(&mut encoder, &problem, &bindings)
            .unwrap();
        assert_eq!(Some(plan), expected.stats.plan, "the host call's plan");
        holds_io(&arena, &arena.submit_and_read(e, encoder), &ins, &outs);
    }
    // Scratch beside the gradients, or too small, is a typed error.
    let mut encoder = e.device().create_command_encoder(&Default::default());
    let beside = GradientBindings {
        scratch: Some(arena.binding(6)),
        ..gradients(&arena)
    };
    assert!(matches!(
        e.encode_backward(&mut encoder, &problem, &beside),
        Err(Error::OverlappingBindings {
            output: "scratch",
            other: "dq"
        })
    ));
    let short = GradientBindings {
        scratch: Some(wgpu::BufferBinding {
            size: wgpu::BufferSize::new(need - 4),
            ..theirs
        }),
        ..gradients(&arena)
    };
    assert!(matches!(
        e.encode_backward(&mut encoder, &problem, &short),
        Err(Error::BufferTooSmall {
            buffer: "scratch",
            ..
        })
    ));
}

#[test]
fn encoded_forward_on_sub_allocated_bindings_gives_the_host_calls_bytes() {
    let Some(e) = engine() else { return };
    let plain = Case::new(37, 45, 16).heads(4, 2).opts(causal());
    encoded_forward_matches_the_host_call(e, &plain);
    // A block mask: the side tables (its tile lists) go with the recording.
    let grid = BlockGrid::new(37, 45, (8, 16)).unwrap();
    let mask = BlockMask::from_fn(grid, [1, 1], |_, _, r, c| (r + c) % 3 != 1);
    let opts = flashattn::AttentionOptions::default().block_mask(mask);
    encoded_forward_matches_the_host_call(e, &Case::new(37, 45, 16).opts(opts));
    // Dropout: the recording draws the host call's mask.
    let drop = causal().dropout(0.3).dropout_seed(7).dropout_offset(2);
    encoded_forward_matches_the_host_call(e, &Case::new(37, 45, 16).heads(4, 2).opts(drop));
}

#[test]
fn encoded_backward_on_sub_allocated_bindings_gives_the_host_calls_bytes() {
    let Some(e) = engine() else { return };
    encoded_backward_matches_the_host_call(e, &Case::new(37, 45, 16).heads(4, 2).opts(causal()));
    let drop = causal().dropout(0.3).dropout_seed(7);
    encoded_backward_matches_the_host_call(e, &Case::new(37, 45, 16).heads(4, 2).opts(drop));
}

/// Verification on first use gates an encoded call as any other: with the
/// planner's family failing its check (a planted fault), the call records a
/// verified fallback family, whose bytes are the host call's.
#[test]
fn an_encoded_call_runs_only_a_verified_family() {
    let Some(shared) = engine() else { return };
    let case = Case::new(37, 45, 16).heads(4, 2).opts(causal());
    let shape = AttentionShape::new(1, 37, 45, 4, 2, 16).unwrap();
    let none = PlanOverrides::default();
    let faulty = shared
        .plan(&shape, case.precision, &none)
        .unwrap()
        .plan
        .kernel;
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::new()
        .unwrap()
        .with_verification(VerifyMode::FirstUse)
        .with_verdict_cache(Some(VerdictCache::in_dir(dir.path())))
        .with_fault(faulty.name().parse().unwrap());
    let plan = encoded_forward_matches_the_host_call(&e, &case);
    assert_ne!(plan.kernel, faulty, "the faulty family was recorded");
}

/// Bindings the device cannot take, or too small for the shape, are typed
/// errors naming the tensor, and nothing is recorded: the encoder,
/// submitted anyway, leaves o as it was.
#[test]
fn bad_bindings_are_typed_errors_before_anything_is_recorded() {
    let Some(e) = engine() else { return };
    let case = Case::new(37, 45, 16).heads(4, 2).opts(causal());
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let ins = inputs.stored.each_ref().map(host);
    let lse_bytes = 4 * case.heads_q * case.seqlen_q;
    let arena = split_arena(e, &ins, &[ins[0].len() as u64, lse_bytes as u64]);
    let problem = Problem::forward(&ForwardInputs::new(q, k, v), &case.opts).unwrap();
    let mut encoder = e.device().create_command_encoder(&Default::default());
    let mut try_with = |b: AttentionBindings| e.encode_forward(&mut encoder, &problem, &b);
    let align = e.limits().min_storage_buffer_offset_alignment;
    let mut misaligned = attention(&arena);
    misaligned.k.offset += 4;
    misaligned.k.size = wgpu::BufferSize::new(arena.at[1].2 - 4);
    assert!(matches!(
        try_with(misaligned),
        Err(Error::MisalignedBinding { tensor: "k", offset, alignment })
            if offset == arena.at[1].1 + 4 && alignment == align
    ));
    let mut short = attention(&arena);
    short.o.size = wgpu::BufferSize::new(arena.at[3].2 - 4);
    assert!(matches!(
        try_with(short),
        Err(Error::BufferTooSmall { buffer: "o", .. })
    ));
    let mut outside = attention(&arena);
    outside.lse.offset = arena.buffers[1].size() - align as u64;
    assert!(matches!(
        try_with(outside),
        Err(Error::BindingOutsideBuffer { tensor: "lse", .. })
    ));
    let mut shared = attention(&arena);
    shared.o = arena.binding(0);
    assert!(matches!(
        try_with(shared),
        Err(Error::OverlappingBindings {
            output: "o",
            other: "q"
        })
    ));
    let bytes = arena.submit_and_read(e, encoder);
    let o: Vec<f32> = bytemuck::pod_collect_to_vec(arena.slice(&bytes, 3));
    assert!(o.iter().all(|&x| x == SENTINEL), "o was written");
}

/// The app's one buffer: every tensor of every call sub-allocated in it.
fn one_buffer(e: &Engine, contents: &[&[u8]]) -> Arena {
    let tensors: Vec<(usize, &[u8])> = contents.iter().map(|c| (0, *c)).collect();
    Arena::new(e, &tensors)
}

/// The tensors of [`every_encoded_op_in_one_buffer_gives_the_host_calls_bytes`], in
/// the buffer's order.
const Q: usize = 0;
const O: usize = 3;
const LSE: usize = 4;
const DO: usize = 5;
const DQ: usize = 6;
const SCRATCH: usize = 9;
const FQ: usize = 10;
const FP8_SCRATCH: usize = 15;
const DECODE_Q: usize = 16;

/// A backward's bindings in the one buffer's order (its scratch not given).
fn one_buffer_gradients(one: &Arena) -> GradientBindings<'_> {
    let b = |i| one.binding(i);
    GradientBindings {
        q: b(Q),
        k: b(Q + 1),
        v: b(Q + 2),
        o: b(O),
        d_o: b(DO),
        lse: b(LSE),
        dq: b(DQ),
        dk: b(DQ + 1),
        dv: b(DQ + 2),
        scratch: None,
    }
}

/// A decoding step's tensors (its q first, then the new rows, the cache, o,
/// lse and the splits' scratch) and what each should hold after the step.
struct DecodeTensors {
    contents: Vec<Vec<u8>>,
    want: Vec<Option<Vec<u8>>>,
}

/// `case`'s step through the host call on an engine cache (checked against
/// the f64 reference), as tensors for [`one_buffer`].
fn decode_tensors(e: &Engine, case: &DecodeCase, scratch: u64) -> DecodeTensors {
    let data = case.data();
    let step = data.step();
    let out = data.check(|cache, s| {
        let mut device = e.upload_kv_cache(cache)?;
        let out = e.decode(&mut device, s, &case.opts, case.num_splits)?;
        *cache = e.read_kv_cache(&device)?;
        Ok(out)
    });
    let after = flashattn::reference::decode_cache(&data.cache, &step).unwrap();
    let lse: Vec<u8> = bytemuck::cast_slice(&out.lse).to_vec();
    let contents = [
        &data.q,
        &data.k_new,
        &data.v_new,
        &data.cache.k,
        &data.cache.v,
    ]
    .map(|t| host(t).to_vec())
    .into_iter()
    .chain([
        sentinels(host(&out.o.data).len() as u64),
        sentinels(lse.len() as u64),
        sentinels(scratch),
    ])
    .collect();
    let want = [
        &data.q,
        &data.k_new,
        &data.v_new,
        &after.k,
        &after.v,
        &out.o.data,
    ]
    .map(|t| Some(host(t).to_vec()))
    .into_iter()
    .chain([Some(lse), None])
    .collect();
    DecodeTensors { contents, want }
}

/// The forward, its backward (reading the o and lse the recorded forward
/// writes), an FP8 forward (Hadamard over a head dim of 12: rows padded to
/// 16, trimmed into o), an append to a paged KV cache and a decoding step
/// over it in two splits, recorded into one encoder on ranges of ONE buffer
/// — inputs, outputs, the cache and every scratch at non-zero aligned
/// offsets — and submitted once give the host calls' bytes (the cache the
/// reference's, with the rows appended) and write nothing else.
#[test]
fn every_encoded_op_in_one_buffer_gives_the_host_calls_bytes() {
    let Some(e) = engine() else { return };
    let case = Case::new(37, 45, 16).heads(4, 2).opts(causal());
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let fwd = e.forward(&ForwardInputs::new(q, k, v), &case.opts).unwrap();
    let (_, d_o) = output_grad(&case);
    let host_inputs =
        BackwardInputs::new(ForwardInputs::new(q, k, v), &fwd, inputs.grad(&d_o)).unwrap();
    let bwd = e.backward(&host_inputs, &case.opts).unwrap();
    let fcase = Case::new(37, 45, 12).heads(4, 2).opts(causal());
    let finputs = fcase.inputs();
    let [fq, fk, fv] = finputs.views();
    let fp8 = Fp8Options::hadamard(9);
    let f8 = e
        .forward_fp8(&ForwardInputs::new(fq, fk, fv), &fcase.opts, &fp8)
        .unwrap();
    // A paged decoding step in two splits, appending 4 rows to each sequence.
    let dcase = DecodeCase::new(&[300, 70], 32)
        .paged(16)
        .append(4)
        .opts(causal())
        .splits(2);
    let ddata = dcase.data();
    let (dstep, dshape) = (ddata.step(), ddata.cache.shape);
    let dproblem = DecodeProblem::new(&dstep, &dshape, dcase.precision).unwrap();
    let dplan = e
        .plan_decode(&dproblem, &dcase.opts, dcase.num_splits)
        .unwrap();
    let dscratch = e.decode_scratch_size(&dproblem, &dplan);
    assert!(dscratch > 0, "two splits keep partials");
    let decode = decode_tensors(e, &dcase, dscratch);
    let problem = Problem::forward(&ForwardInputs::new(q, k, v), &case.opts).unwrap();
    let fproblem = Problem::forward(&ForwardInputs::new(fq, fk, fv), &fcase.opts).unwrap();
    let scratch = sentinels(e.scratch_size(Pass::Backward, &problem));
    let fscratch = sentinels(e.fp8_scratch_size(&fproblem, &fp8));
    let [qb, kb, vb] = inputs.stored.each_ref().map(host);
    let [fqb, fkb, fvb] = finputs.stored.each_ref().map(host);
    let lse = |l: &[f32]| -> Vec<u8> { bytemuck::cast_slice(l).to_vec() };
    let (o, l) = (host(&fwd.o.data), lse(&fwd.lse));
    let [dq, dk, dv] = [&bwd.dq, &bwd.dk, &bwd.dv].map(|g| host(&g.data));
    let (fo, fl) = (host(&f8.o.data), lse(&f8.lse));
    let mut want: Vec<Option<&[u8]>> = vec![
        Some(qb),
        Some(kb),
        Some(vb),
        Some(o),
        Some(&l),
        Some(host(&d_o)),
        Some(dq),
        Some(dk),
        Some(dv),
        None,
        Some(fqb),
        Some(fkb),
        Some(fvb),
        Some(fo),
        Some(&fl),
        None,
    ];
    want.extend(decode.want.iter().map(|w| w.as_deref()));
    // Outputs start as filler, like the gaps.
    let (o0, l0) = (sentinels(o.len() as u64), sentinels(l.len() as u64));
    let grads0 = [dq, dk, dv].map(|g| sentinels(g.len() as u64));
    let (fo0, fl0) = (sentinels(fo.len() as u64), sentinels(fl.len() as u64));
    let mut contents: Vec<&[u8]> = vec![
        qb,
        kb,
        vb,
        &o0,
        &l0,
        host(&d_o),
        &grads0[0],
        &grads0[1],
        &grads0[2],
        &scratch,
        fqb,
        fkb,
        fvb,
        &fo0,
        &fl0,
        &fscratch,
    ];
    contents.extend(decode.contents.iter().map(|c| &c[..]));
    let one = one_buffer(e, &contents);
    let b = |i| one.binding(i);
    let attention = |at: usize| AttentionBindings {
        q: b(at),
        k: b(at + 1),
        v: b(at + 2),
        o: b(at + O),
        lse: b(at + LSE),
    };
    let gradients = GradientBindings {
        scratch: Some(b(SCRATCH)),
        ..one_buffer_gradients(&one)
    };
    let mut encoder = e.device().create_command_encoder(&Default::default());
    let plan = e
        .encode_forward(&mut encoder, &problem, &attention(Q))
        .unwrap();
    assert_eq!(Some(plan), fwd.stats.plan, "the host forward's plan");
    let plan = e
        .encode_backward(&mut encoder, &problem, &gradients)
        .unwrap();
    assert_eq!(Some(plan), bwd.stats.plan, "the host backward's plan");
    let plan = e
        .encode_forward_fp8(
            &mut encoder,
            &fproblem,
            &fp8,
            &attention(FQ),
            Some(&b(FP8_SCRATCH)),
        )
        .unwrap();
    assert_eq!(Some(plan), f8.stats.plan, "the host FP8 forward's plan");
    // The append, then the step attending over the appended rows (its spec
    // counts them), on a cache whose K and V are ranges of the same buffer.
    let d = |i| b(DECODE_Q + i);
    let cache = e.kv_cache_in(dshape, dcase.precision, d(3), d(4)).unwrap();
    let spec = dstep.spec();
    e.encode_append(&mut encoder, &cache, &spec, d(1), d(2))
        .unwrap();
    let bindings = DecodeBindings::new(d(0), d(5), d(6)).scratch(d(7));
    let plan = e
        .encode_decode(
            &mut encoder,
            &cache,
            &spec,
            &bindings,
            &dcase.opts,
            dcase.num_splits,
        )
        .unwrap();
    assert_eq!(plan, dplan, "the planned decode");
    one.holds(&one.submit_and_read(e, encoder), &want);
}

/// In one buffer, an output range intersecting another tensor's — an
/// output's, an input's, the scratch's — is `OverlappingBindings` naming
/// both, and nothing is recorded: the encoder, submitted anyway, leaves the
/// buffer as it was.
#[test]
fn overlapping_ranges_in_one_buffer_are_typed_errors_before_anything_is_recorded() {
    let Some(e) = engine() else { return };
    let case = Case::new(37, 45, 16).heads(4, 2).opts(causal());
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let problem = Problem::forward(&ForwardInputs::new(q, k, v), &case.opts).unwrap();
    let fp8 = Fp8Options::default();
    let [qb, kb, vb] = inputs.stored.each_ref().map(host);
    let (o0, l0) = (
        sentinels(qb.len() as u64),
        sentinels(4 * (case.heads_q * case.seqlen_q) as u64),
    );
    let grads0 = [qb, kb, vb].map(|g| sentinels(g.len() as u64));
    let scratch = sentinels(e.fp8_scratch_size(&problem, &fp8));
    let contents: Vec<&[u8]> = vec![
        qb, kb, vb, &o0, &l0, &o0, &grads0[0], &grads0[1], &grads0[2], &scratch,
    ];
    let one = one_buffer(e, &contents);
    let b = |i| one.binding(i);
    let attention = attention(&one);
    let mut encoder = e.device().create_command_encoder(&Default::default());
    let align = e.limits().min_storage_buffer_offset_alignment as u64;
    // lse starting inside o.
    let lse_in_o = AttentionBindings {
        lse: wgpu::BufferBinding {
            offset: one.at[O].1 + align,
            ..b(LSE)
        },
        ..attention.clone()
    };
    assert!(matches!(
        e.encode_forward(&mut encoder, &problem, &lse_in_o),
        Err(Error::OverlappingBindings {
            output: "lse",
            other: "o"
        })
    ));
    // dk over k's range.
    let dk_on_k = GradientBindings {
        dk: b(Q + 1),
        ..one_buffer_gradients(&one)
    };
    assert!(matches!(
        e.encode_backward(&mut encoder, &problem, &dk_on_k),
        Err(Error::OverlappingBindings {
            output: "dk",
            other: "k"
        })
    ));
    // The FP8 forward's scratch running from o's start.
    let scratch_on_o = wgpu::BufferBinding {
        offset: one.at[O].1,
        ..b(SCRATCH)
    };
    assert!(matches!(
        e.encode_forward_fp8(
            &mut encoder,
            &problem,
            &fp8,
            &attention,
            Some(&scratch_on_o)
        ),
        Err(Error::OverlappingBindings {
            output: "scratch",
            other: "o"
        })
    ));
    let want: Vec<Option<&[u8]>> = contents.iter().map(|&c| Some(c)).collect();
    one.holds(&one.submit_and_read(e, encoder), &want);
}

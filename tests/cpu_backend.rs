//! The CPU backend (`flashattn::cpu`), forward and backward, against the
//! f64 reference under docs/semantics.md's rule, with the naive baseline — independent
//! code — as the rule's yardstick: the whole accuracy matrix (f32/f16,
//! causal, windows, softcap, GQA/MQA, odd sizes, seqlen_q ≠ seqlen_k, head
//! dims 1..=256, empty rows, large scores) on every instruction set this
//! machine runs (AVX-512, AVX2+FMA, NEON, portable).

use flashattn::accuracy::{check_backward, check_forward};
use flashattn::cpu::{Cpu, Isa};
use flashattn::random::Rng;
use flashattn::{
    AttentionOptions, BackwardInputs, BackwardOutput, ForwardInputs, Precision, TensorData,
    TensorView, Window,
};

/// One problem: sizes, options, dtype, the std of q and k, a seed.
#[derive(Clone, Debug)]
struct Case {
    batch: usize,
    sq: usize,
    sk: usize,
    hq: usize,
    hkv: usize,
    d: usize,
    opts: AttentionOptions,
    precision: Precision,
    qk_std: f32,
    seed: u64,
}

impl Case {
    fn new(sq: usize, sk: usize, d: usize) -> Self {
        Self {
            batch: 1,
            sq,
            sk,
            hq: 2,
            hkv: 2,
            d,
            opts: AttentionOptions::default(),
            precision: Precision::F32,
            qk_std: 1.0,
            seed: (sq * 1000 + sk) as u64 ^ ((d as u64) << 32),
        }
    }
    fn heads(self, hq: usize, hkv: usize) -> Self {
        Self { hq, hkv, ..self }
    }
    fn batch(self, batch: usize) -> Self {
        Self { batch, ..self }
    }
    fn opts(self, opts: AttentionOptions) -> Self {
        Self { opts, ..self }
    }
    fn f16(self) -> Self {
        self.precision(Precision::F16)
    }
    fn bf16(self) -> Self {
        self.precision(Precision::Bf16)
    }
    fn precision(self, precision: Precision) -> Self {
        Self { precision, ..self }
    }
    fn qk_std(self, qk_std: f32) -> Self {
        Self { qk_std, ..self }
    }
}

/// q, k, v, dO of a case, rounded to and stored in its precision.
struct Data {
    shapes: [[usize; 4]; 4],
    stored: [TensorData; 4],
}

impl Data {
    fn new(c: &Case) -> Self {
        let qs = [c.batch, c.sq, c.hq, c.d];
        let ks = [c.batch, c.sk, c.hkv, c.d];
        let shapes = [qs, ks, ks, qs];
        let stds = [c.qk_std, c.qk_std, 1.0, 1.0];
        let mut rng = Rng::new(c.seed);
        let stored: [TensorData; 4] = std::array::from_fn(|t| {
            let n = shapes[t].iter().product();
            TensorData::from_f32(rng.normal_vec(n, stds[t]), c.precision)
        });
        Self { shapes, stored }
    }

    fn views(&self) -> [TensorView<'_>; 4] {
        std::array::from_fn(|t| self.stored[t].view(self.shapes[t]))
    }
}

/// The CPU forward, then the CPU backward, on `cpu`.
fn grads(cpu: &Cpu, c: &Case, data: &Data) -> BackwardOutput {
    let [q, k, v, g] = data.views();
    let fwd = cpu.forward(&ForwardInputs::new(q, k, v), &c.opts).unwrap();
    let inputs = BackwardInputs::new(ForwardInputs::new(q, k, v), &fwd, g).unwrap();
    cpu.backward(&inputs, &c.opts).unwrap()
}

/// On every instruction set: o and lse must meet docs/semantics.md's rule (R = 2, 3
/// with softcap) and the gradients too (R = 3), against the f64 reference.
/// Returns the fastest set's gradients.
fn run(c: &Case) -> BackwardOutput {
    let data = Data::new(c);
    let [q, k, v, g] = data.views();
    let mut outs = Vec::new();
    for &isa in Isa::available() {
        let cpu = Cpu::with_isa(isa).unwrap();
        let fwd = cpu.forward(&ForwardInputs::new(q, k, v), &c.opts).unwrap();
        for check in check_forward(&fwd, &q, &k, &v, &c.opts).unwrap() {
            assert!(check.passed(), "{isa:?} forward {c:?}: {check}");
        }
        let out = grads(&cpu, c, &data);
        for check in check_backward(&out, &q, &k, &v, &g, &c.opts).unwrap() {
            assert!(check.passed(), "{isa:?} backward {c:?}: {check}");
        }
        outs.push(out);
    }
    outs.swap_remove(0)
}

/// The low storage precisions, which round P and dS before the products.
const LOW: [Precision; 2] = [Precision::F16, Precision::Bf16];

fn causal() -> AttentionOptions {
    AttentionOptions::default().causal(true)
}

fn window(left: i64, right: i64) -> AttentionOptions {
    {
        let mut o = AttentionOptions::default();
        o.window = Window::from_signed(left, right);
        o
    }
}

#[test]
fn cpu_seqlens_and_head_dims() {
    for s in [1, 3, 37, 113, 255] {
        for d in [1, 16, 59, 64, 111] {
            run(&Case::new(s, s, d));
        }
    }
}

#[test]
fn cpu_head_dims_up_to_the_maximum() {
    for d in [8, 24, 32, 48, 80, 96, 128, 160, 192, 200, 224, 255, 256] {
        run(&Case::new(70, 90, d));
    }
    run(&Case::new(113, 255, 256).opts(causal()));
    run(&Case::new(255, 113, 256).f16().heads(4, 1));
}

#[test]
fn cpu_decode_shaped_forward_splits_keys() {
    // Few rows, many keys: the forward splits the keys and merges by LSE
    // (one row block of one head splits on any number of threads).
    run(&Case::new(1, 3000, 64).heads(1, 1));
    for (sq, sk) in [(1, 3000), (3, 2049), (16, 1500)] {
        run(&Case::new(sq, sk, 64).heads(2, 1));
        run(&Case::new(sq, sk, 59).opts(causal()).f16());
        run(&Case::new(sq, sk, 32).opts(window(300, 0)));
    }
}

#[test]
fn cpu_seqlen_q_differs_from_seqlen_k() {
    for (sq, sk) in [
        (1, 37),
        (37, 1),
        (113, 37),
        (37, 113),
        (3, 113),
        (113, 3),
        (255, 1),
        (1, 255),
    ] {
        run(&Case::new(sq, sk, 59));
        run(&Case::new(sq, sk, 16).opts(causal()));
    }
}

#[test]
fn cpu_gqa_and_mqa_sum_over_groups() {
    for (hq, hkv) in [(4, 2), (6, 3), (4, 1)] {
        run(&Case::new(45, 70, 32).heads(hq, hkv).batch(2));
        for p in LOW {
            run(&Case::new(70, 45, 16)
                .heads(hq, hkv)
                .opts(causal())
                .precision(p));
        }
    }
}

#[test]
fn cpu_causal_and_local_windows() {
    let mut all = vec![causal()];
    all.extend([(5, 0), (-1, 3), (16, 16), (0, 0), (100, -1)].map(|(l, r)| window(l, r)));
    all.push(window(8, -1).causal(true));
    all.push(window(16, 16).causal(true));
    for opts in all {
        for (sq, sk) in [(113, 113), (97, 150), (150, 97)] {
            run(&Case::new(sq, sk, 64).opts(opts.clone()));
        }
        for p in LOW {
            run(&Case::new(113, 90, 59)
                .heads(4, 2)
                .opts(opts.clone())
                .precision(p));
        }
    }
}

/// Long enough for many of the forward's large blocks (128 rows, 256
/// keys at d 64) and the backward's tiles: blocks on a mask's edge are
/// narrowed to what their rows see, narrow windows take small blocks.
#[test]
fn cpu_long_sequences_cross_many_blocks() {
    let wide = window(1200, 100);
    for opts in [
        AttentionOptions::default(),
        causal(),
        window(300, 700),
        wide,
    ] {
        run(&Case::new(600, 777, 64).heads(2, 1).opts(opts.clone()));
        run(&Case::new(777, 600, 40).opts(opts).f16());
    }
}

#[test]
fn cpu_softcap() {
    for cap in [3.0, 20.0] {
        let soft = AttentionOptions::default().softcap(cap);
        run(&Case::new(113, 80, 64).qk_std(2.0).opts(soft.clone()));
        run(&Case::new(80, 113, 59)
            .qk_std(2.0)
            .opts(soft.clone().causal(true)));
        for p in LOW {
            run(&Case::new(113, 113, 64)
                .qk_std(2.0)
                .opts(soft.clone())
                .precision(p));
        }
    }
}

#[test]
fn cpu_empty_rows_have_zero_output_and_dq() {
    for c in [
        Case::new(113, 37, 64),
        Case::new(113, 37, 59).f16().heads(4, 2),
        Case::new(113, 37, 59).bf16().heads(4, 2),
    ] {
        let c = c.opts(causal());
        let out = run(&c);
        // Rows i with i + (sk - sq) < 0 see no key.
        let empty = c.sq - c.sk;
        let data = Data::new(&c);
        let [q, k, v, _] = data.views();
        let fwd = flashattn::cpu::forward(&ForwardInputs::new(q, k, v), &c.opts).unwrap();
        for (name, t) in [("o", fwd.o.to_f32()), ("dq", out.dq.to_f32())] {
            for (idx, x) in t.iter().enumerate() {
                let i = (idx / (c.hq * c.d)) % c.sq;
                if i < empty {
                    assert_eq!(x.to_bits(), 0, "{name} of empty row {i} is {x}");
                }
            }
        }
        for (idx, l) in fwd.lse.iter().enumerate() {
            assert_eq!(
                *l == f32::NEG_INFINITY,
                idx % c.sq < empty,
                "lse[{idx}] = {l}"
            );
        }
    }
}

#[test]
fn cpu_large_magnitude_scores() {
    for opts in [AttentionOptions::default(), causal()] {
        run(&Case::new(113, 97, 64).qk_std(6.0).opts(opts.clone()));
        for p in LOW {
            run(&Case::new(97, 113, 64)
                .qk_std(6.0)
                .opts(opts.clone())
                .precision(p));
        }
    }
}

#[test]
fn cpu_f16_and_bf16() {
    for p in LOW {
        for (sq, sk, d) in [
            (1, 1, 1),
            (3, 37, 16),
            (37, 3, 59),
            (113, 113, 64),
            (255, 255, 111),
        ] {
            run(&Case::new(sq, sk, d).precision(p));
            run(&Case::new(sq, sk, d).precision(p).batch(2).opts(causal()));
        }
        run(&Case::new(37, 29, 256).precision(p));
    }
}

/// Outputs keep the input dtype (docs/semantics.md): bf16 in, bf16 out.
#[test]
fn cpu_outputs_keep_the_dtype() {
    for p in [Precision::F32, Precision::F16, Precision::Bf16] {
        let out = run(&Case::new(37, 45, 59).precision(p).opts(causal()));
        for t in [&out.dq, &out.dk, &out.dv] {
            assert_eq!(t.precision(), p);
        }
    }
}

#[test]
fn cpu_backward_two_runs_are_bit_identical() {
    let c = Case::new(200, 170, 59).heads(6, 3).batch(2).opts(causal());
    let data = Data::new(&c);
    let cpu = Cpu::new();
    let (a, b) = (grads(&cpu, &c, &data), grads(&cpu, &c, &data));
    for (x, y) in [(&a.dq, &b.dq), (&a.dk, &b.dk), (&a.dv, &b.dv)] {
        let bits =
            |t: &flashattn::Tensor| t.to_f32().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(x), bits(y));
    }
}

/// The backward's tasks are strips of key blocks, as many as the threads
/// need, whose dQ sums are added afterwards: one strip per kv head on one
/// thread, three on three, one per key block on sixteen. Each meets the
/// rule and repeats bit for bit.
#[test]
fn cpu_backward_strips_on_any_thread_count() {
    let c = Case::new(300, 330, 64).heads(4, 2).batch(2).opts(causal());
    let data = Data::new(&c);
    for threads in [1, 3, 16] {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap();
        pool.install(|| {
            run(&c);
            let cpu = Cpu::new();
            let (a, b) = (grads(&cpu, &c, &data), grads(&cpu, &c, &data));
            for (x, y) in [(&a.dq, &b.dq), (&a.dk, &b.dk), (&a.dv, &b.dv)] {
                let bits = |t: &flashattn::Tensor| -> Vec<u32> {
                    t.to_f32().iter().map(|v| v.to_bits()).collect()
                };
                assert_eq!(bits(x), bits(y), "{threads} threads");
            }
        });
    }
}

#[test]
fn cpu_backward_is_not_the_baseline() {
    let c = Case::new(113, 97, 64).heads(4, 2);
    let data = Data::new(&c);
    let out = grads(&Cpu::new(), &c, &data);
    let [q, k, v, g] = data.views();
    let base = flashattn::reference::naive_backward_baseline(&q, &k, &v, &g, &c.opts).unwrap();
    let differs =
        |t: &flashattn::Tensor, b: &[f64]| t.to_f32().iter().zip(b).any(|(&x, &y)| x as f64 != y);
    assert!(differs(&out.dq, &base.dq));
    assert!(differs(&out.dk, &base.dk));
    assert!(differs(&out.dv, &base.dv));
}

/// A backward's o of the wrong shape is `ShapeMismatch` naming o and where
/// its expected shape comes from (it once read "(the shape of o)").
#[test]
fn a_backward_o_of_the_wrong_shape_names_the_expected_one() {
    let x = vec![0.1f32; 64];
    let view = flashattn::TensorView::f32([1, 4, 2, 8], &x);
    let inputs = flashattn::ForwardInputs::new(view, view, view);
    let cpu = flashattn::Cpu::new();
    let fwd = cpu
        .forward(&inputs, &flashattn::AttentionOptions::default())
        .unwrap();
    let mut bwd = flashattn::BackwardInputs::new(inputs, &fwd, view).unwrap();
    bwd.o = flashattn::TensorView::f32([1, 4, 2, 4], &x[..32]);
    let err = cpu
        .backward(&bwd, &flashattn::AttentionOptions::default())
        .unwrap_err();
    assert!(
        matches!(
            err,
            flashattn::Error::ShapeMismatch {
                tensor: "o",
                like: "the forward's o: q's with v's head dim",
                ..
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("q's with v's head dim"), "{err}");
}

/// A NaN in q or k reaches exactly the rows whose allowed scores meet it,
/// as in torch: those rows' o and lse are NaN (not an empty row's 0 and
/// −∞), and every other row is what it is without the NaN.
#[test]
fn a_nan_input_makes_the_rows_it_reaches_nan() {
    let (n, d) = (5, 8);
    let mut rng = Rng::new(11);
    let q = rng.normal_vec(n * d, 1.0);
    let k = rng.normal_vec(n * d, 1.0);
    let v = rng.normal_vec(n * d, 1.0);
    let opts = AttentionOptions::default().causal(true);
    let run = |q: &[f32], k: &[f32]| {
        let view = |x| TensorView::f32([1, n, 1, d], x);
        let inputs = ForwardInputs::new(view(q), view(k), view(&v));
        Cpu::new().forward(&inputs, &opts).unwrap()
    };
    let clean = run(&q, &k);
    let (mut q_nan, mut k_nan) = (q.clone(), k.clone());
    q_nan[d + 2] = f32::NAN; // row 1
    k_nan[3 * d + 5] = f32::NAN; // key 3: rows 3 and 4 see it
    let out = run(&q_nan, &k_nan);
    let (o, o_clean) = (out.o.to_f32(), clean.o.to_f32());
    for i in 0..n {
        let row = &o[i * d..][..d];
        if [1, 3, 4].contains(&i) {
            assert!(row.iter().all(|x| x.is_nan()), "row {i}: {row:?}");
            assert!(out.lse[i].is_nan(), "row {i}: lse {}", out.lse[i]);
        } else {
            assert_eq!(row, &o_clean[i * d..][..d], "row {i}");
            assert_eq!(out.lse[i], clean.lse[i], "row {i}");
        }
    }
}

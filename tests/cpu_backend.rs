//! The CPU backend's backward (`flashattn::cpu::backward`, FlashAttention-2's
//! algorithm on the CPU) against the f64 reference under SPEC.md's rule,
//! with the naive baseline — independent code — as the rule's yardstick.

use flashattn::accuracy::check_backward;
use flashattn::random::Rng;
use flashattn::{
    AttentionOptions, BackwardInputs, BackwardOutput, Precision, TensorData, TensorView, Window,
};

/// One problem: sizes, options, dtype, the std of q and k, a seed.
#[derive(Clone, Copy, Debug)]
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

/// CPU forward, then the CPU backward under test.
fn grads(c: &Case, data: &Data) -> BackwardOutput {
    let [q, k, v, g] = data.views();
    let fwd = flashattn::cpu::forward(&q, &k, &v, &c.opts).unwrap();
    let inputs = BackwardInputs::new([q, k, v], &fwd, g).unwrap();
    flashattn::cpu::backward(&inputs, &c.opts).unwrap()
}

/// The gradients must meet SPEC.md's rule (R = 3) against the f64 reference.
fn run(c: &Case) -> BackwardOutput {
    let data = Data::new(c);
    let out = grads(c, &data);
    let [q, k, v, g] = data.views();
    for check in check_backward(&out, &q, &k, &v, &g, &c.opts).unwrap() {
        assert!(check.passed(), "{c:?}: {check}");
    }
    out
}

/// The low storage precisions, which round P and dS before the products.
const LOW: [Precision; 2] = [Precision::F16, Precision::Bf16];

fn causal() -> AttentionOptions {
    AttentionOptions::default().causal(true)
}

fn window(left: i64, right: i64) -> AttentionOptions {
    AttentionOptions {
        window: Window::from_signed(left, right),
        ..Default::default()
    }
}

#[test]
fn cpu_backward_seqlens_and_head_dims() {
    for s in [1, 3, 37, 113] {
        for d in [1, 16, 59, 64] {
            run(&Case::new(s, s, d));
        }
    }
}

#[test]
fn cpu_backward_seqlen_q_differs_from_seqlen_k() {
    for (sq, sk) in [(1, 37), (37, 1), (113, 37), (37, 113), (3, 113), (113, 3)] {
        run(&Case::new(sq, sk, 59));
        run(&Case::new(sq, sk, 16).opts(causal()));
    }
}

#[test]
fn cpu_backward_gqa_and_mqa_sum_over_groups() {
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
fn cpu_backward_causal_and_local_windows() {
    let mut all = vec![causal()];
    all.extend([(5, 0), (-1, 3), (16, 16)].map(|(l, r)| window(l, r)));
    all.push(window(8, -1).causal(true));
    all.push(window(16, 16).causal(true));
    for opts in all {
        for (sq, sk) in [(113, 113), (97, 150), (150, 97)] {
            run(&Case::new(sq, sk, 64).opts(opts));
        }
        for p in LOW {
            run(&Case::new(113, 90, 59).heads(4, 2).opts(opts).precision(p));
        }
    }
}

#[test]
fn cpu_backward_softcap() {
    for cap in [3.0, 20.0] {
        let soft = AttentionOptions::default().softcap(cap);
        run(&Case::new(113, 80, 64).qk_std(2.0).opts(soft));
        run(&Case::new(80, 113, 59).qk_std(2.0).opts(soft.causal(true)));
        for p in LOW {
            run(&Case::new(113, 113, 64).qk_std(2.0).opts(soft).precision(p));
        }
    }
}

#[test]
fn cpu_backward_empty_rows_have_zero_dq() {
    for c in [
        Case::new(113, 37, 64),
        Case::new(113, 37, 59).f16().heads(4, 2),
        Case::new(113, 37, 59).bf16().heads(4, 2),
    ] {
        let c = c.opts(causal());
        let out = run(&c);
        let dq = out.dq.to_f32();
        // Rows i with i + (sk - sq) < 0 see no key.
        let empty = c.sq - c.sk;
        for (idx, x) in dq.iter().enumerate() {
            let i = (idx / (c.hq * c.d)) % c.sq;
            if i < empty {
                assert_eq!(x.to_bits(), 0, "dq of empty row {i} is {x}");
            }
        }
    }
}

#[test]
fn cpu_backward_large_magnitude_scores() {
    for opts in [AttentionOptions::default(), causal()] {
        run(&Case::new(113, 97, 64).qk_std(6.0).opts(opts));
        for p in LOW {
            run(&Case::new(97, 113, 64).qk_std(6.0).opts(opts).precision(p));
        }
    }
}

#[test]
fn cpu_backward_f16_and_bf16() {
    for p in LOW {
        for (sq, sk, d) in [(1, 1, 1), (3, 37, 16), (37, 3, 59), (113, 113, 64)] {
            run(&Case::new(sq, sk, d).precision(p));
            run(&Case::new(sq, sk, d).precision(p).batch(2).opts(causal()));
        }
        for d in [111, 256] {
            run(&Case::new(37, 29, d).precision(p));
        }
    }
}

/// Gradients keep the input dtype (SPEC.md): bf16 in, bf16 out.
#[test]
fn cpu_backward_outputs_keep_the_dtype() {
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
    let (a, b) = (grads(&c, &data), grads(&c, &data));
    for (x, y) in [(&a.dq, &b.dq), (&a.dk, &b.dk), (&a.dv, &b.dv)] {
        let bits =
            |t: &flashattn::Tensor| t.to_f32().iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(x), bits(y));
    }
}

#[test]
fn cpu_backward_is_not_the_baseline() {
    let c = Case::new(113, 97, 64).heads(4, 2);
    let data = Data::new(&c);
    let out = grads(&c, &data);
    let [q, k, v, g] = data.views();
    let base = flashattn::reference::naive_backward_baseline(&q, &k, &v, &g, &c.opts).unwrap();
    let differs =
        |t: &flashattn::Tensor, b: &[f64]| t.to_f32().iter().zip(b).any(|(&x, &y)| x as f64 != y);
    assert!(differs(&out.dq, &base.dq));
    assert!(differs(&out.dk, &base.dk));
    assert!(differs(&out.dv, &base.dv));
}

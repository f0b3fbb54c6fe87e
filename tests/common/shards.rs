//! Shards of a sequence attended with `AttentionOptions::positions` and
//! merged by LSE, against the f64 reference of the whole sequence: the
//! check of ring attention's primitives that every backend's suite runs.

use flashattn::accuracy::{check, forward_ratio, BACKWARD_RATIO};
use flashattn::random::Rng;
use flashattn::{
    merge_partials, reference, Alibi, AttentionBackend, AttentionOptions, BackwardInputs,
    ForwardInputs, ForwardOutput, PlanOverrides, Precision, TensorData, TensorView,
};
use std::ops::Range;

/// One problem: the whole sequence's q, k, v and its shards.
pub struct Case {
    pub name: &'static str,
    batch: usize,
    n: usize,
    heads: (usize, usize),
    d: usize,
    precision: Precision,
    opts: AttentionOptions,
    q_cuts: Vec<usize>,
    k_cuts: Vec<usize>,
}

pub fn cases() -> Vec<Case> {
    let base = |name, opts: AttentionOptions| Case {
        name,
        batch: 2,
        n: 45,
        heads: (4, 2),
        d: 32,
        precision: Precision::F32,
        opts,
        q_cuts: vec![0, 13, 30, 45],
        k_cuts: vec![0, 13, 30, 45],
    };
    let alibi = Alibi::new(&[0.5, 0.25, 0.125, 0.0625]);
    vec![
        base("causal", AttentionOptions::default().causal(true)),
        Case {
            // Query and key shards of their own sizes.
            q_cuts: vec![0, 20, 45],
            k_cuts: vec![0, 9, 31, 45],
            ..base(
                "causal, ragged shards",
                AttentionOptions::default().causal(true),
            )
        },
        base(
            "window (7, 3) with ALiBi",
            AttentionOptions::default()
                .window(Some(7), Some(3))
                .alibi(alibi.clone()),
        ),
        base(
            "causal window 5 with softcap",
            AttentionOptions::default()
                .causal(true)
                .window(Some(5), None)
                .softcap(4.0),
        ),
        Case {
            precision: Precision::Bf16,
            ..base(
                "causal ALiBi, bf16",
                AttentionOptions::default().causal(true).alibi(alibi),
            )
        },
        base("no mask", AttentionOptions::default()),
    ]
}

/// The case's tensors, rounded to its precision, as f32 `(batch, n, heads, d)`.
struct Data {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    d_o: Vec<f32>,
}

impl Case {
    fn data(&self) -> Data {
        let mut rng = Rng::new(7);
        let (hq, hkv) = self.heads;
        let round = |x: Vec<f32>| TensorData::from_f32(x, self.precision).to_f32();
        let nq = self.batch * self.n * hq * self.d;
        let nk = self.batch * self.n * hkv * self.d;
        Data {
            q: round(rng.normal_vec(nq, 1.5)),
            k: round(rng.normal_vec(nk, 1.5)),
            v: round(rng.normal_vec(nk, 1.0)),
            d_o: round(rng.normal_vec(nq, 1.0)),
        }
    }

    fn stored(&self, x: &[f32]) -> TensorData {
        TensorData::from_f32(x.to_vec(), self.precision)
    }

    /// Rows `r` of every batch entry of a `(batch, n, heads, d)` tensor.
    fn rows(&self, x: &[f32], heads: usize, r: &Range<usize>) -> Vec<f32> {
        let row = heads * self.d;
        (0..self.batch)
            .flat_map(|b| &x[(b * self.n + r.start) * row..(b * self.n + r.end) * row])
            .copied()
            .collect()
    }

    /// Add `part` (rows `r` of every batch entry) into `whole`.
    fn add_rows(&self, whole: &mut [f32], part: &[f32], heads: usize, r: &Range<usize>) {
        let row = heads * self.d;
        for b in 0..self.batch {
            let dst = &mut whole[(b * self.n + r.start) * row..(b * self.n + r.end) * row];
            let src = &part[b * r.len() * row..(b + 1) * r.len() * row];
            for (x, y) in dst.iter_mut().zip(src) {
                *x += y;
            }
        }
    }

    fn shards(cuts: &[usize]) -> Vec<Range<usize>> {
        cuts.windows(2).map(|w| w[0]..w[1]).collect()
    }
}

/// The merged forward of every query shard, assembled into the whole
/// sequence's o (f32) and lse.
fn sharded_forward(backend: &dyn AttentionBackend, case: &Case, x: &Data) -> (Vec<f32>, Vec<f32>) {
    let (hq, hkv) = case.heads;
    let mut o = vec![0f32; x.q.len()];
    let mut lse = vec![0f32; case.batch * hq * case.n];
    for qs in Case::shards(&case.q_cuts) {
        let q = case.stored(&case.rows(&x.q, hq, &qs));
        let parts: Vec<ForwardOutput> = Case::shards(&case.k_cuts)
            .iter()
            .map(|ks| {
                let (k, v) = (
                    case.stored(&case.rows(&x.k, hkv, ks)),
                    case.stored(&case.rows(&x.v, hkv, ks)),
                );
                let kv_shape = [case.batch, ks.len(), hkv, case.d];
                let inputs = ForwardInputs::new(
                    q.view([case.batch, qs.len(), hq, case.d]),
                    k.view(kv_shape),
                    v.view(kv_shape),
                );
                let opts = case.opts.clone().positions(qs.start, ks.start);
                backend
                    .forward(&inputs, &opts, &PlanOverrides::default())
                    .unwrap_or_else(|e| panic!("{}: {e}", case.name))
            })
            .collect();
        let merged = merge_partials(&parts).unwrap();
        case.add_rows(&mut o, &merged.o.to_f32(), hq, &qs);
        for b in 0..case.batch {
            for h in 0..hq {
                let at = (b * hq + h) * qs.len();
                let whole = (b * hq + h) * case.n + qs.start;
                lse[whole..whole + qs.len()].copy_from_slice(&merged.lse[at..at + qs.len()]);
            }
        }
    }
    (o, lse)
}

/// The shard pairs' gradients given the whole o and lse, summed.
fn sharded_backward(
    backend: &dyn AttentionBackend,
    case: &Case,
    x: &Data,
    o: &[f32],
    lse: &[f32],
) -> [Vec<f32>; 3] {
    let (hq, hkv) = case.heads;
    let (mut dq, mut dk, mut dv) = (
        vec![0f32; x.q.len()],
        vec![0f32; x.k.len()],
        vec![0f32; x.v.len()],
    );
    for qs in Case::shards(&case.q_cuts) {
        let q_shape = [case.batch, qs.len(), hq, case.d];
        let (q, o_s, d_o) = (
            case.stored(&case.rows(&x.q, hq, &qs)),
            case.stored(&case.rows(o, hq, &qs)),
            case.stored(&case.rows(&x.d_o, hq, &qs)),
        );
        let lse_s: Vec<f32> = (0..case.batch * hq)
            .flat_map(|bh| lse[bh * case.n + qs.start..bh * case.n + qs.end].to_vec())
            .collect();
        for ks in Case::shards(&case.k_cuts) {
            let kv_shape = [case.batch, ks.len(), hkv, case.d];
            let (k, v) = (
                case.stored(&case.rows(&x.k, hkv, &ks)),
                case.stored(&case.rows(&x.v, hkv, &ks)),
            );
            let inputs = BackwardInputs {
                q: q.view(q_shape),
                k: k.view(kv_shape),
                v: v.view(kv_shape),
                o: o_s.view(q_shape),
                lse: &lse_s,
                d_o: d_o.view(q_shape),
            };
            let opts = case.opts.clone().positions(qs.start, ks.start);
            let g = backend
                .backward(&inputs, &opts, &PlanOverrides::default())
                .unwrap_or_else(|e| panic!("{}: {e}", case.name));
            case.add_rows(&mut dq, &g.dq.to_f32(), hq, &qs);
            case.add_rows(&mut dk, &g.dk.to_f32(), hkv, &ks);
            case.add_rows(&mut dv, &g.dv.to_f32(), hkv, &ks);
        }
    }
    [dq, dk, dv]
}

fn widen(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

pub fn check_case(backend: &dyn AttentionBackend, case: &Case) {
    let x = case.data();
    let (hq, hkv) = case.heads;
    let (q, k, v, d_o) = (
        case.stored(&x.q),
        case.stored(&x.k),
        case.stored(&x.v),
        case.stored(&x.d_o),
    );
    let (q_shape, kv_shape) = (
        [case.batch, case.n, hq, case.d],
        [case.batch, case.n, hkv, case.d],
    );
    let views = [q.view(q_shape), k.view(kv_shape), v.view(kv_shape)];
    let d_o_view: TensorView = d_o.view(q_shape);
    // The whole problem, no positions: the reference and the baseline.
    let whole = reference::forward(&views[0], &views[1], &views[2], &case.opts).unwrap();
    let naive = reference::naive_baseline(&views[0], &views[1], &views[2], &case.opts).unwrap();
    let ratio = forward_ratio(case.opts.softcap.is_some());
    let (o, lse) = sharded_forward(backend, case, &x);
    for c in [
        check("o", &widen(&o), &whole.o, &naive.o, case.precision, ratio),
        check(
            "lse",
            &widen(&lse),
            &whole.lse,
            &naive.lse,
            Precision::F32,
            ratio,
        ),
    ] {
        assert!(c.passed(), "{} forward: {c}", case.name);
    }
    if case.precision != Precision::F32 {
        return; // the backward's sums of rounded shard gradients: f32 only
    }
    let grads =
        reference::backward(&views[0], &views[1], &views[2], &d_o_view, &case.opts).unwrap();
    let naive =
        reference::naive_backward_baseline(&views[0], &views[1], &views[2], &d_o_view, &case.opts)
            .unwrap();
    let [dq, dk, dv] = sharded_backward(backend, case, &x, &o, &lse);
    for (name, got, r, b) in [
        ("dq", &dq, &grads.dq, &naive.dq),
        ("dk", &dk, &grads.dk, &naive.dk),
        ("dv", &dv, &grads.dv, &naive.dv),
    ] {
        let c = check(name, &widen(got), r, b, case.precision, BACKWARD_RATIO);
        assert!(c.passed(), "{} backward: {c}", case.name);
    }
}

//! One `Engine` shared by many threads: it is `Send + Sync`, 8 threads
//! running forward, backward and decoding calls at once get the serial
//! run's bits, and the buffer pool keeps at most its cap and frees its idle
//! buffers on `trim()`.

mod common;

use common::decode::{CaseData, DecodeCase};
use common::{output_grad, Case, Inputs};
use flashattn::{BackwardInputs, Engine, ForwardInputs, ForwardOutput, TensorData};

/// Fails to compile unless `Engine` may move to and be shared by threads.
#[test]
fn engine_is_send_and_sync() {
    fn shareable<T: Send + Sync + 'static>() {}
    shareable::<Engine>();
}

/// The operations the threads mix.
#[derive(Clone, Copy, Debug)]
enum Op {
    Forward,
    Backward,
    Decode,
}

/// Every input the three operations take, built once.
struct Work {
    case: Case,
    inputs: Inputs,
    forward: ForwardOutput,
    grad: TensorData,
    decode: CaseData,
}

/// The bits of every output `op` returns.
fn run(engine: &Engine, work: &Work, op: Op) -> Vec<Vec<u32>> {
    let bits = |x: Vec<f32>| x.into_iter().map(f32::to_bits).collect();
    let [q, k, v] = work.inputs.views();
    let opts = &work.case.opts;
    match op {
        Op::Forward => {
            let out = engine.forward(&ForwardInputs::new(q, k, v), opts).unwrap();
            vec![bits(out.o.to_f32()), bits(out.lse)]
        }
        Op::Backward => {
            let d_o = work.inputs.grad(&work.grad);
            let inputs =
                BackwardInputs::new(ForwardInputs::new(q, k, v), &work.forward, d_o).unwrap();
            let out = engine.backward(&inputs, opts).unwrap();
            [out.dq, out.dk, out.dv].map(|t| bits(t.to_f32())).to_vec()
        }
        Op::Decode => {
            let mut cache = work.decode.cache.clone();
            let step = work.decode.step();
            let opts = &work.decode.case.opts;
            let out = engine.decode_host(&mut cache, &step, opts, None).unwrap();
            let cache = [&cache.k, &cache.v].map(|t| bits(t.to_f32()));
            [vec![bits(out.o.to_f32()), bits(out.lse)], cache.to_vec()].concat()
        }
    }
}

#[test]
fn eight_threads_get_the_serial_bits() {
    let Some(engine) = common::engine() else {
        return;
    };
    let case = Case::new(7, 12, 16);
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let forward = engine
        .forward(&ForwardInputs::new(q, k, v), &case.opts)
        .unwrap();
    let work = Work {
        grad: output_grad(&case).1,
        decode: DecodeCase::new(&[5, 20], 16).append(1).data(),
        forward,
        inputs,
        case,
    };
    let ops = [Op::Forward, Op::Backward, Op::Decode];
    let serial: Vec<_> = ops.iter().map(|&op| run(engine, &work, op)).collect();

    std::thread::scope(|s| {
        let threads: Vec<_> = (0..8)
            .map(|t| {
                let work = &work;
                // Each thread starts at a different operation, so all three
                // run at once.
                s.spawn(move || {
                    let order = (0..3).map(|i| (t + i) % 3);
                    order
                        .map(|i| (i, run(engine, work, ops[i])))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        for thread in threads {
            for (i, got) in thread.join().unwrap() {
                assert!(got == serial[i], "{:?} differs from the serial run", ops[i]);
            }
        }
    });

    // Every call gave its buffers back; trim frees them all.
    assert!(engine.pooled_bytes() > 0);
    engine.trim();
    assert_eq!(engine.pooled_bytes(), 0);
}

#[test]
fn the_pool_keeps_at_most_its_cap() {
    if common::engine().is_none() {
        return;
    }
    let engine = Engine::new().unwrap().with_pool_limit(0);
    let case = Case::new(7, 12, 16);
    let inputs = case.inputs();
    let [q, k, v] = inputs.views();
    let out = engine
        .forward(&ForwardInputs::new(q, k, v), &case.opts)
        .unwrap();
    assert!(!out.stats.allocations.is_empty());
    assert_eq!(engine.pooled_bytes(), 0);
}

use flashattn::*;
use std::time::Instant;
fn main() {
    let args: Vec<String> = std::env::args().collect();
    let which = args.get(1).map(String::as_str).unwrap_or("int8");
    let reps: usize = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(30);
    let len = 32768;
    let shape = CacheShape::new(
        CacheLayout::Dense {
            batch: 1,
            capacity: len,
        },
        8,
        128,
    )
    .unwrap();
    let mut rng = random::Rng::new(1);
    let vals = rng.normal_vec(shape.len(), 1.0);
    let plain = HostKvCache::new(
        shape,
        TensorData::from_f32(vals.clone(), Precision::F16),
        TensorData::from_f32(vals, Precision::F16),
    )
    .unwrap();
    let q = TensorData::from_f32(rng.normal_vec(32 * 128, 1.0), Precision::F16);
    let lens = [len as i32];
    let step = DecodeStep::new(q.view([1, 1, 32, 128]), &lens);
    let opts = AttentionOptions::default();
    let mut times = vec![];
    match which {
        "f16" => {
            let mut c = plain.clone();
            for _ in 0..reps {
                let t = Instant::now();
                cpu::decode(&mut c, &step, &opts, None).unwrap();
                times.push(t.elapsed().as_secs_f64());
            }
        }
        q => {
            let quant = CacheQuant::parse(q).unwrap();
            let mut c = QuantKvCache::quantize(&plain, quant).unwrap();
            for _ in 0..reps {
                let t = Instant::now();
                cpu::decode_quantized(&mut c, &step, &opts, None).unwrap();
                times.push(t.elapsed().as_secs_f64());
            }
        }
    }
    times.sort_by(|a, b| a.total_cmp(b));
    println!(
        "{which}: min {:.2} ms median {:.2} ms",
        times[0] * 1e3,
        times[times.len() / 2] * 1e3
    );
}

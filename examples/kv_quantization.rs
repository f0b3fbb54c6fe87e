//! What a quantized KV cache costs in accuracy: one decoding step over the
//! same cache held as f16, int8 and FP8 (e4m3) on the CPU backend, each
//! `o` against the f64 reference on the unquantized values, as a markdown
//! table (docs/kv-quantization.md quotes it). Two kinds of cache: normal
//! values, and keys with outlier channels (a few channels 20× the others,
//! as the K caches of large language models have).
//!
//! ```text
//! cargo run --release --example kv_quantization -- [--cache-len 4096] [--seed 1]
//! ```

use flashattn::random::Rng;
use flashattn::{cpu, reference, AttentionOptions, CacheLayout, CacheQuant, CacheShape};
use flashattn::{DecodeStep, HostKvCache, Precision, QuantKvCache, TensorData};

const HEADS_Q: usize = 32;
const HEADS_KV: usize = 8;
const HEAD_DIM: usize = 128;
/// Channels of each key head that are outliers, and their factor.
const OUTLIERS: usize = 4;
const OUTLIER_SCALE: f32 = 20.0;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut cache_len = 4096;
    let mut seed = 1;
    let mut args = std::env::args().skip(1);
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--cache-len" => cache_len = value.parse()?,
            "--seed" => seed = value.parse()?,
            _ => return Err(format!("unknown flag {flag}").into()),
        }
    }
    println!(
        "cache {cache_len} tokens, {HEADS_Q}/{HEADS_KV} heads, head dim {HEAD_DIM}, 1 query token; \
         RMSE of o against the f64 reference on the unquantized cache (and relative to o's RMS)\n"
    );
    println!("| cache | values | RMSE of o | relative |");
    println!("|---|---|---|---|");
    for outliers in [false, true] {
        let (plain, q) = case(cache_len, seed, outliers)?;
        let lens = [cache_len as i32];
        let opts = AttentionOptions::default();
        let step32 = DecodeStep::new(q.view([1, 1, HEADS_Q, HEAD_DIM]), &lens);
        let [exact, _] = reference::decode(&plain, &step32, &opts)?;
        let rms = (exact.o.iter().map(|x| x * x).sum::<f64>() / exact.o.len() as f64).sqrt();
        let q16 = TensorData::from_f32(q.to_f32(), Precision::F16);
        let step = DecodeStep::new(q16.view([1, 1, HEADS_Q, HEAD_DIM]), &lens);
        let f16 = HostKvCache {
            shape: plain.shape,
            k: TensorData::from_f32(plain.k.to_f32(), Precision::F16),
            v: TensorData::from_f32(plain.v.to_f32(), Precision::F16),
        };
        let mut rows = vec![("f16", cpu::decode(&mut f16.clone(), &step, &opts, None)?)];
        for quant in CacheQuant::ALL {
            let mut cache = QuantKvCache::quantize(&f16, quant)?;
            rows.push((
                quant.name(),
                cpu::decode_quantized(&mut cache, &step, &opts, None)?,
            ));
        }
        let kind = if outliers {
            "outlier key channels"
        } else {
            "normal"
        };
        for (name, out) in rows {
            let o = out.o.to_f32();
            let se: f64 = o
                .iter()
                .zip(&exact.o)
                .map(|(&x, r)| (x as f64 - r).powi(2))
                .sum();
            let rmse = (se / o.len() as f64).sqrt();
            println!("| {name} | {kind} | {rmse:.2e} | {:.2e} |", rmse / rms);
        }
    }
    Ok(())
}

/// A full dense f32 cache of normal values (keys with outlier channels when
/// asked) and one query token.
fn case(
    cache_len: usize,
    seed: u64,
    outliers: bool,
) -> Result<(HostKvCache, TensorData), flashattn::Error> {
    let layout = CacheLayout::Dense {
        batch: 1,
        capacity: cache_len,
    };
    let shape = CacheShape::new(layout, HEADS_KV, HEAD_DIM)?;
    let mut rng = Rng::new(seed);
    let mut k = rng.normal_vec(shape.len(), 1.0);
    if outliers {
        for (e, x) in k.iter_mut().enumerate() {
            if e % HEAD_DIM < OUTLIERS {
                *x *= OUTLIER_SCALE;
            }
        }
    }
    let v = rng.normal_vec(shape.len(), 1.0);
    // Scores of a spread a model's have: q scaled down so softmax is not one-hot.
    let q = rng.normal_vec(HEADS_Q * HEAD_DIM, 0.5);
    let cache = HostKvCache::new(shape, TensorData::F32(k), TensorData::F32(v))?;
    Ok((cache, TensorData::F32(q)))
}

//! Quantized KV caches in the tests: docs/kv-quantization.md's append
//! restated apart from the library (f64 arithmetic, the block of a row
//! from the layout's own sizes), the check of a step on a quantized cache,
//! and the quantized counterparts of the decode cases.

#![allow(dead_code)] // each test binary uses part of it
use super::decode::{CaseData, DecodeCase};
use flashattn::accuracy::check_decode_on_values;
use flashattn::quant::{e4m3_from_f64, e4m3_to_f32};
use flashattn::{CacheLayout, CacheQuant, DecodeOutput, DecodeStep, QuantKvCache, Result};
use flashattn::{CacheShape, HostKvCache, TensorData};

/// 2⁻¹⁰⁰.
pub fn min_scale() -> f32 {
    2f32.powi(-100)
}

fn qmax(q: CacheQuant) -> f64 {
    match q {
        CacheQuant::Int8 => 127.0,
        _ => 448.0,
    }
}

/// `max(a / QMAX, 2⁻¹⁰⁰)`, the quotient rounded once to f32 (an f64
/// quotient of f32s rounds to f32 as the f32 division does).
pub fn scale_of(q: CacheQuant, a: f32) -> f32 {
    ((a as f64 / qmax(q)) as f32).max(min_scale())
}

pub fn code(q: CacheQuant, x: f32, s: f32) -> u8 {
    if x.abs() < f32::MIN_POSITIVE {
        return 0;
    }
    let r = x as f64 / s as f64;
    match q {
        CacheQuant::Int8 => r.round_ties_even().clamp(-127.0, 127.0) as i8 as u8,
        _ => e4m3_from_f64(r),
    }
}

pub fn value(q: CacheQuant, c: u8, s: f32) -> f32 {
    let v = match q {
        CacheQuant::Int8 => c as i8 as f64,
        _ => e4m3_to_f32(c) as f64,
    };
    (v * s as f64) as f32
}

/// The block of cache row `row`: a page, or 16 tokens of a dense row.
fn block_of(cache: &QuantKvCache, row: usize) -> usize {
    match cache.shape.layout {
        CacheLayout::Paged { page_size, .. } => row / page_size,
        CacheLayout::Dense { capacity, .. } => {
            let per_row = capacity.div_ceil(16);
            row / capacity * per_row + row % capacity / 16
        }
        _ => unreachable!("two layouts"),
    }
}

/// `cache` after `step`'s append by the documented rule.
pub fn expected_append(cache: &QuantKvCache, step: &DecodeStep) -> QuantKvCache {
    let mut out = cache.clone();
    // A latent cache appends K's rows alone: its V is a view of them.
    let (k_new, v_new) = match (step.new_kv, step.new_latent) {
        (Some([k, v]), _) => (k, Some(v)),
        (None, Some(k)) => (k, None),
        (None, None) => return out,
    };
    let [batch, seqlen_new, heads, _] = k_new.shape;
    let q = cache.quant;
    // The cache row of token t of sequence b, from the step's own index.
    let row = |b: usize, t: usize| -> usize {
        let [_, inner, _, _] = cache.shape.dims();
        match (step.block_table, step.cache_batch_idx) {
            (Some(table), _) => {
                table.pages[b * table.max_pages + t / inner] as usize * inner + t % inner
            }
            (None, Some(idx)) => idx[b] as usize * inner + t,
            (None, None) => b * inner + t,
        }
    };
    let mut parts = vec![(&mut out.k, k_new)];
    if let Some(v_new) = v_new {
        parts.push((&mut out.v, v_new));
    }
    for (kv, new) in parts {
        let d = new.shape[3];
        let x = new.data.to_f32();
        let rows: Vec<(usize, usize)> = (0..batch)
            .flat_map(|b| (0..seqlen_new).map(move |t| (b, t)))
            .map(|(b, t)| {
                (
                    b * seqlen_new + t,
                    row(b, step.cache_seqlens[b] as usize + t),
                )
            })
            .collect();
        for blk in 0..kv.scales.len() / heads {
            for hk in 0..heads {
                let mine: Vec<&(usize, usize)> = rows
                    .iter()
                    .filter(|(_, r)| block_of(cache, *r) == blk)
                    .collect();
                if mine.is_empty() {
                    continue;
                }
                let a = mine
                    .iter()
                    .flat_map(|(src, _)| x[(src * heads + hk) * d..][..d].iter())
                    .map(|v| {
                        if v.abs() < f32::MIN_POSITIVE {
                            0.0
                        } else {
                            v.abs()
                        }
                    })
                    .fold(0f32, f32::max);
                let old = kv.scales[blk * heads + hk];
                let s = old.max(scale_of(q, a));
                if s > old {
                    let total_rows = kv.codes.len() / (heads * d);
                    for r in (0..total_rows).filter(|&r| block_of(cache, r) == blk) {
                        for c in &mut kv.codes[(r * heads + hk) * d..][..d] {
                            *c = code(q, value(q, *c, old), s);
                        }
                    }
                }
                kv.scales[blk * heads + hk] = s;
                for (src, r) in mine {
                    for e in 0..d {
                        kv.codes[(r * heads + hk) * d + e] =
                            code(q, x[(src * heads + hk) * d + e], s);
                    }
                }
            }
        }
    }
    out
}

impl CaseData {
    /// The case's cache quantized, `decode` run on it, and the checks: o and
    /// lse within the rule against the f64 reference on the codes' values
    /// after the append, and the cache (codes and scales) equal to the
    /// rule's append computed apart.
    pub fn check_quantized(
        &self,
        quant: CacheQuant,
        decode: impl FnOnce(&mut QuantKvCache, &DecodeStep) -> Result<DecodeOutput>,
    ) -> DecodeOutput {
        let step = self.step();
        let before = QuantKvCache::quantize(&self.cache, quant).expect("a finite cache");
        let mut cache = before.clone();
        let out =
            decode(&mut cache, &step).unwrap_or_else(|e| panic!("{:?} {quant:?}: {e}", self.case));
        let expected = expected_append(&before, &step);
        assert!(
            cache == expected,
            "{:?} {quant:?}: the cache differs from the documented append",
            self.case
        );
        let checks = check_decode_on_values(&out, &cache.dequantized(), &step, &self.case.opts)
            .expect("reference");
        for c in &checks {
            assert!(
                c.passed(),
                "{:?} {quant:?} (splits {}): {c}",
                self.case,
                out.num_splits
            );
        }
        out
    }
}

/// Cases for quantized caches: dense rows crossing 16-token blocks, pages
/// of 1, 16 and 48 tokens (at head dims of whole 16-element panels and not), appends of several tokens into one block, GQA,
/// ALiBi and sinks, v's own head dim, f32/f16/bf16 steps, splits.
pub fn quant_cases() -> Vec<DecodeCase> {
    use flashattn::{Alibi, AttentionOptions, Sinks};
    let causal = || AttentionOptions::default().causal(true);
    vec![
        DecodeCase::new(&[1], 64),
        DecodeCase::new(&[15, 16, 0, 31], 32).append(2),
        DecodeCase::new(&[300, 45], 128)
            .heads(8, 2)
            .append(5)
            .f16()
            .splits(3),
        DecodeCase::new(&[200, 37, 600], 64)
            .heads(8, 2)
            .paged(16)
            .append(3)
            .seqlen_q(2)
            .opts(causal()),
        DecodeCase::new(&[47, 3], 40)
            .heads(4, 1)
            .paged(48)
            .append(4)
            .bf16(),
        DecodeCase::new(&[500, 97], 64)
            .heads(4, 2)
            .paged(48)
            .append(2)
            .f16(),
        DecodeCase::new(&[9, 2], 3)
            .heads(3, 3)
            .paged(1)
            .append(2)
            .opts(causal()),
        DecodeCase::new(&[100, 250, 3], 48).batch_idx().append(17),
        DecodeCase::new(&[700, 64], 64)
            .dv(32)
            .heads(8, 2)
            .append(1)
            .opts(
                causal()
                    .alibi(Alibi::standard(8))
                    .sinks(Sinks::new(&[0.5; 8])),
            ),
        DecodeCase::new(&[2000], 128)
            .heads(16, 2)
            .seqlen_q(4)
            .append(1)
            .f16()
            .opts(causal()),
    ]
}

/// Quantized latent (MLA) caches: V the first columns of K's codes at K's
/// block scales. Width 576 / view 512 on one kv head (16 query heads to
/// keep the suites fast), seqlen_q 1 and 4, dense and paged; odd widths on
/// several kv heads (V's head stride is then K's head dim); pages of 48
/// whose codes are read in place; f16/bf16 steps, splits.
pub fn quant_latent_cases() -> Vec<DecodeCase> {
    use flashattn::AttentionOptions;
    let causal = || AttentionOptions::default().causal(true);
    vec![
        DecodeCase::new(&[77, 5], 576)
            .dv(512)
            .heads(16, 1)
            .latent()
            .append(1)
            .splits(3),
        DecodeCase::new(&[200, 0, 33], 576)
            .dv(512)
            .heads(16, 1)
            .seqlen_q(4)
            .paged(16)
            .latent()
            .append(4)
            .f16()
            .opts(causal()),
        DecodeCase::new(&[129, 5], 59)
            .dv(37)
            .heads(4, 2)
            .latent()
            .append(3)
            .opts(causal()),
        DecodeCase::new(&[300, 40], 64)
            .dv(32)
            .heads(8, 2)
            .paged(48)
            .latent()
            .append(2)
            .bf16()
            .splits(2),
    ]
}

/// A dense cache of 2 rows × 40 tokens, 2 kv heads of 8, one sequence of
/// 15 tokens of magnitude ≤ 1, and a step appending two tokens: the first
/// (token 15, block 0) of magnitude 3, the second (token 16, block 1) 100.
pub struct BoundaryCase {
    pub plain: HostKvCache,
    /// The appended rows (k_new and v_new alike), `(1, 2, 2, 8)`.
    pub new: Vec<f32>,
    q: TensorData,
    new_t: TensorData,
    lens: [i32; 1],
}

impl BoundaryCase {
    pub fn new() -> Self {
        let layout = CacheLayout::Dense {
            batch: 2,
            capacity: 40,
        };
        let shape = CacheShape::new(layout, 2, 8).unwrap();
        let mut rng = flashattn::random::Rng::new(7);
        let mut x = vec![0f32; shape.len()];
        for v in &mut x[..15 * 16] {
            *v = rng.normal() as f32 * 0.3;
        }
        let plain =
            HostKvCache::new(shape, TensorData::F32(x.clone()), TensorData::F32(x)).unwrap();
        let new: Vec<f32> = (0..32)
            .map(|e| {
                if e < 16 {
                    (e as f32 - 7.5) * 0.4
                } else {
                    (e as f32 - 24.0) * 12.5
                }
            })
            .collect();
        Self {
            plain,
            new_t: TensorData::F32(new.clone()),
            new,
            q: TensorData::F32(vec![0.1; 2 * 8]),
            lens: [15],
        }
    }

    pub fn step(&self) -> DecodeStep<'_> {
        DecodeStep::new(self.q.view([1, 1, 2, 8]), &self.lens)
            .append(self.new_t.view([1, 2, 2, 8]), self.new_t.view([1, 2, 2, 8]))
    }
}

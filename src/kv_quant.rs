//! Quantized KV caches (docs/kv-quantization.md): int8 or FP8 (e4m3) codes
//! with one f32 scale per block of tokens and kv head, K and V apart. A
//! block is a page of a paged cache, or [`SCALE_BLOCK_TOKENS`] tokens of a dense
//! cache's row. The rule, which every backend follows bit for bit:
//!
//! - **value** of a code `c` at scale `s`: `fl(value(c) · s)`, the f32
//!   product (`value` the integer of an int8 code, the e4m3 value of an FP8
//!   one). Decoding reads these values and accumulates in f32.
//! - **scale** of a block whose largest magnitude is `a`: `max(fl(a / QMAX),
//!   MIN_CACHE_SCALE)` (`QMAX` 127 for int8, 448 for FP8; [`MIN_CACHE_SCALE`] `= 2⁻¹⁰⁰`,
//!   so every value is a normal f32 or zero). An empty block has `MIN_CACHE_SCALE`.
//! - **code** of `x` at scale `s`: the exact quotient `x / s` rounded to
//!   nearest even (int8: to an integer, clamped to ±127; FP8: to e4m3,
//!   saturating at ±448). Subnormal `x` counts as 0.
//! - **append**: for each block and kv head a step writes to, `a` is the
//!   largest magnitude among the step's new values there. When `scale(a)`
//!   exceeds the block's scale `s`, the block takes `s' = scale(a)` and
//!   every code already in it is requantized: `c' = code(fl(value(c) · s),
//!   s')`. The new values are then coded at the block's (new) scale. One
//!   step is one update, however many of its tokens land in the block.

use crate::api::decode::{CacheShape, DecodeProblem, DecodeStep, HostKvCache};
use crate::api::tensor::{Precision, TensorData};
use crate::error::{Error, Result};
use crate::quant::{e4m3_from_f64, e4m3_to_f32, flush};
use std::ops::Range;

/// Tokens per scale block of a dense cache's row.
pub const SCALE_BLOCK_TOKENS: usize = 16;

/// The smallest block scale, 2⁻¹⁰⁰: a block of smaller values keeps it.
pub const MIN_CACHE_SCALE: f32 = f32::from_bits((127 - 100) << 23);

/// How a quantized cache codes its elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CacheQuant {
    /// Symmetric int8, codes −127..=127.
    Int8,
    /// FP8 e4m3 (`e4m3fn`), ±448 at most.
    Fp8,
}

impl CacheQuant {
    /// Every format.
    pub const ALL: [CacheQuant; 2] = [CacheQuant::Int8, CacheQuant::Fp8];

    /// `int8` or `fp8`, as the command line spells it.
    pub fn name(self) -> &'static str {
        match self {
            CacheQuant::Int8 => "int8",
            CacheQuant::Fp8 => "fp8",
        }
    }

    /// The format named `name` (`int8`, `fp8`).
    pub fn parse(name: &str) -> Result<Self> {
        Self::ALL
            .into_iter()
            .find(|q| q.name() == name)
            .ok_or_else(|| Error::UnknownName {
                what: "cache precision",
                name: name.to_string(),
                expected: "int8, fp8",
            })
    }

    /// The largest code value: 127 or 448.
    pub fn qmax(self) -> f32 {
        match self {
            CacheQuant::Int8 => 127.0,
            CacheQuant::Fp8 => crate::quant::E4M3_MAX,
        }
    }

    /// The scale of a block whose largest magnitude is `absmax`.
    pub fn scale_of(self, absmax: f32) -> f32 {
        (absmax / self.qmax()).max(MIN_CACHE_SCALE)
    }

    /// The code of `x` (finite) at scale `s` (a normal f32 > 0).
    pub fn encode(self, x: f32, s: f32) -> u8 {
        let x = flush(x);
        if x == 0.0 {
            return 0;
        }
        // The f64 quotient of two f32s rounds like the exact one: it is
        // never within 2⁻⁵³ (relative) of a rounding boundary it is not on.
        let q = x as f64 / s as f64;
        match self {
            CacheQuant::Int8 => q.round_ties_even().clamp(-127.0, 127.0) as i8 as u8,
            CacheQuant::Fp8 => e4m3_from_f64(q),
        }
    }

    /// The value a code stands for, before its scale.
    pub fn code_value(self, code: u8) -> f32 {
        match self {
            CacheQuant::Int8 => code as i8 as f32,
            CacheQuant::Fp8 => e4m3_to_f32(code),
        }
    }

    /// The value of `code` at scale `s`: `fl(value · s)`.
    pub fn value(self, code: u8, s: f32) -> f32 {
        self.code_value(code) * s
    }
}

/// Where a cache's scale blocks lie: block `b` holds rows
/// [`rows(b)`](Self::rows), a page of a paged cache or [`SCALE_BLOCK_TOKENS`]
/// tokens (fewer at a row's end) of a dense one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScaleBlocks {
    /// Tokens per page (a dense cache: per row).
    pub page_size: usize,
    /// Tokens per block.
    pub tokens: usize,
    /// Blocks per page.
    pub per_page: usize,
    /// Pages (a dense cache: rows).
    pub pages: usize,
}

impl ScaleBlocks {
    /// The blocks of a cache of `shape`.
    pub fn of(shape: &CacheShape) -> Self {
        let [pages, page_size, _, _] = shape.dims();
        let tokens = if shape.is_paged() {
            page_size
        } else {
            SCALE_BLOCK_TOKENS.min(page_size)
        };
        Self {
            page_size,
            tokens,
            per_page: page_size.div_ceil(tokens),
            pages,
        }
    }

    /// Blocks in the cache.
    pub fn count(&self) -> usize {
        self.pages * self.per_page
    }

    /// The block of cache row `row`.
    #[inline]
    pub fn block(&self, row: usize) -> usize {
        (row / self.page_size) * self.per_page + (row % self.page_size) / self.tokens
    }

    /// The cache rows of block `block`.
    pub fn rows(&self, block: usize) -> Range<usize> {
        let (page, i) = (block / self.per_page, block % self.per_page);
        let start = page * self.page_size + i * self.tokens;
        start..(start + self.tokens).min((page + 1) * self.page_size)
    }
}

/// One of a quantized cache's K and V: codes in the cache's layout, one
/// byte per element (an int8 code as its two's-complement byte), and
/// `(blocks, heads_kv)` scales. A latent cache's V is empty: V reads K's
/// codes and scales.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct QuantizedKv {
    /// Codes, `(rows, heads_kv, head dim)` row-major.
    pub codes: Vec<u8>,
    /// Scales, `(blocks, heads_kv)` row-major.
    pub scales: Vec<f32>,
}

/// A KV cache of int8 or FP8 codes in host memory: what the CPU backend
/// decodes on and the command line reads and writes. q, `k_new`, `v_new`
/// and o keep the step's own precision. A latent cache
/// ([`CacheShape::latent`]) is K's codes and scales alone: its V is the
/// view of their first `head_dim_v` columns, at K's block scales.
#[derive(Clone, Debug, PartialEq)]
pub struct QuantKvCache {
    /// The cache's shape.
    pub shape: CacheShape,
    /// How its elements are coded.
    pub quant: CacheQuant,
    /// The precision of the steps' q, `k_new`, `v_new` and o.
    pub precision: Precision,
    /// The keys.
    pub k: QuantizedKv,
    /// The values (empty in a latent cache).
    pub v: QuantizedKv,
}

impl QuantKvCache {
    /// A cache from its codes and scales, checked: lengths, every scale a
    /// finite value > 0 ([`Error::InvalidCacheScale`]), no FP8 NaN code.
    pub fn new(
        shape: CacheShape,
        quant: CacheQuant,
        precision: Precision,
        k: QuantizedKv,
        v: QuantizedKv,
    ) -> Result<Self> {
        let cache = Self {
            shape,
            quant,
            precision,
            k,
            v,
        };
        cache.check()?;
        cache.check_codes()?;
        Ok(cache)
    }

    /// An empty cache: zero codes, every scale [`MIN_CACHE_SCALE`].
    pub fn zeros(shape: CacheShape, quant: CacheQuant, precision: Precision) -> Self {
        let scales = vec![MIN_CACHE_SCALE; ScaleBlocks::of(&shape).count() * shape.heads_kv];
        let kv = |len| QuantizedKv {
            codes: vec![0; len],
            scales: scales.clone(),
        };
        Self {
            shape,
            quant,
            precision,
            k: kv(shape.len()),
            v: if shape.latent {
                QuantizedKv::default()
            } else {
                kv(shape.v_len())
            },
        }
    }

    /// The codes and scales V reads: K's in a latent cache, whose V is a
    /// view of them (rows [`CacheShape::v_offset`] apart).
    pub fn v_view(&self) -> &QuantizedKv {
        if self.shape.latent {
            &self.k
        } else {
            &self.v
        }
    }

    /// A plain cache quantized: each block's scale from its largest
    /// magnitude, as one append of all its rows to an empty block would
    /// give. Its values must be finite ([`Error::NonFiniteInput`]).
    pub fn quantize(cache: &HostKvCache, quant: CacheQuant) -> Result<Self> {
        cache.check()?;
        let shape = cache.shape;
        let blocks = ScaleBlocks::of(&shape);
        let part = |data: &TensorData, d: usize, tensor| -> Result<QuantizedKv> {
            let x = data.to_f32();
            crate::quant::check_finite(&x, tensor)?;
            let heads = shape.heads_kv;
            let mut out = QuantizedKv {
                codes: vec![0; x.len()],
                scales: vec![MIN_CACHE_SCALE; blocks.count() * heads],
            };
            for blk in 0..blocks.count() {
                for hk in 0..heads {
                    let segs = || {
                        blocks
                            .rows(blk)
                            .map(|r| (r * heads + hk) * d..(r * heads + hk + 1) * d)
                    };
                    let a = segs()
                        .flat_map(|s| x[s].iter())
                        .fold(0f32, |m, v| m.max(v.abs()));
                    let s = quant.scale_of(a);
                    out.scales[blk * heads + hk] = s;
                    for seg in segs() {
                        for e in seg {
                            out.codes[e] = quant.encode(x[e], s);
                        }
                    }
                }
            }
            Ok(out)
        };
        Ok(Self {
            shape,
            quant,
            precision: cache.precision(),
            k: part(&cache.k, shape.head_dim, "k_cache")?,
            v: if shape.latent {
                QuantizedKv::default()
            } else {
                part(&cache.v, shape.head_dim_v, "v_cache")?
            },
        })
    }

    /// Empty page `page` (a dense cache's row `page`) for a new owner: zero
    /// codes and every block scale [`MIN_CACHE_SCALE`]. Scales only grow as
    /// tokens are appended, so a page handed to another sequence keeps the
    /// old one's scales (and their coarser codes) until it is cleared.
    /// [`Error::PageOutOfRange`] past the last page; a cache whose fields
    /// were changed since it was built is checked first, as a step checks it.
    pub fn clear_page(&mut self, page: usize) -> Result<()> {
        // The fields are public: lengths changed since the cache was built
        // are an error, not a slice past the end.
        self.check()?;
        let blocks = self.blocks();
        if page >= blocks.pages {
            return Err(Error::PageOutOfRange {
                tensor: "clear_page",
                batch: 0,
                slot: 0,
                page: page as i64,
                pages: blocks.pages,
            });
        }
        let heads = self.shape.heads_kv;
        let rows = page * blocks.page_size..(page + 1) * blocks.page_size;
        let first = page * blocks.per_page * heads..(page + 1) * blocks.per_page * heads;
        let mut parts = vec![(&mut self.k, self.shape.row_len())];
        if !self.shape.latent {
            parts.push((&mut self.v, self.shape.v_row_len()));
        }
        for (kv, len) in parts {
            kv.codes[rows.start * len..rows.end * len].fill(0);
            kv.scales[first.clone()].fill(MIN_CACHE_SCALE);
        }
        Ok(())
    }

    /// The cache's scale blocks.
    pub fn blocks(&self) -> ScaleBlocks {
        ScaleBlocks::of(&self.shape)
    }

    /// The values the codes stand for, as an f32 cache of the same shape.
    ///
    /// # Panics
    ///
    /// Where public fields were changed so that the codes or scales no
    /// longer hold the shape's elements (the calls that take the cache,
    /// such as a decoding step, check that and return typed errors).
    pub fn dequantized(&self) -> HostKvCache {
        let blocks = self.blocks();
        let heads = self.shape.heads_kv;
        let part = |kv: &QuantizedKv, d: usize| -> TensorData {
            let values = kv
                .codes
                .iter()
                .enumerate()
                .map(|(e, &c)| {
                    let (row, hk) = (e / (heads * d), e / d % heads);
                    self.quant
                        .value(c, kv.scales[blocks.block(row) * heads + hk])
                })
                .collect();
            TensorData::F32(values)
        };
        // A latent cache's V, empty, stays empty: the view of K.
        HostKvCache {
            shape: self.shape,
            k: part(&self.k, self.shape.head_dim),
            v: part(&self.v, self.shape.head_dim_v),
        }
    }

    /// Bytes the cache holds: codes and scales.
    pub fn bytes(&self) -> usize {
        let part = |kv: &QuantizedKv| kv.codes.len() + 4 * kv.scales.len();
        part(&self.k) + part(&self.v)
    }

    /// What [`new`](Self::new) checks but the codes, again for a cache whose
    /// public fields were changed since: lengths and scales, every step.
    pub(crate) fn check(&self) -> Result<()> {
        // A shape changed field by field (a size of 0 would divide by zero
        // in the block arithmetic below) is checked as the constructors check.
        let s = &self.shape.checked()?;
        let scales = self.blocks().count() * s.heads_kv;
        // A latent cache's V is a view of K: no codes or scales of its own.
        let (v_dims, v_scales) = match s.latent {
            true => (vec![0], 0),
            false => (s.v_dims().to_vec(), scales),
        };
        let parts = [
            ("k_cache", "k_scales", &self.k, s.dims().to_vec(), scales),
            ("v_cache", "v_scales", &self.v, v_dims, v_scales),
        ];
        for (codes_name, scales_name, kv, dims, scales) in parts {
            let expected = dims.iter().product();
            if kv.codes.len() != expected {
                return Err(Error::DataLength {
                    tensor: codes_name,
                    shape: dims,
                    expected,
                    actual: kv.codes.len(),
                });
            }
            if kv.scales.len() != scales {
                return Err(Error::DataLength {
                    tensor: scales_name,
                    shape: vec![scales / s.heads_kv.max(1), s.heads_kv],
                    expected: scales,
                    actual: kv.scales.len(),
                });
            }
            if let Some((index, &value)) = kv
                .scales
                .iter()
                .enumerate()
                .find(|(_, v)| !(v.is_finite() && **v > 0.0))
            {
                return Err(Error::InvalidCacheScale {
                    tensor: scales_name,
                    index,
                    value,
                });
            }
        }
        Ok(())
    }

    /// FP8 codes that are e4m3's NaNs (0x7f, 0xff; no append writes one):
    /// [`Error::NonFiniteInput`]. Read once, where codes come in
    /// ([`new`](Self::new)), not every step: a whole pass over the cache.
    pub(crate) fn check_codes(&self) -> Result<()> {
        if self.quant == CacheQuant::Fp8 {
            for (tensor, kv) in [("k_cache", &self.k), ("v_cache", &self.v)] {
                if let Some(index) = kv.codes.iter().position(|&c| c & 0x7f == 0x7f) {
                    return Err(Error::NonFiniteInput { tensor, index });
                }
            }
        }
        Ok(())
    }

    /// Append a validated step's new rows (f32, `k_new`'s and `v_new`'s
    /// layouts, finite; a latent cache's `v_new` empty) by the rule in the
    /// module docs.
    pub(crate) fn append(&mut self, p: &DecodeProblem, k_new: &[f32], v_new: &[f32]) {
        let blocks = self.blocks();
        let (quant, heads) = (self.quant, self.shape.heads_kv);
        let rows: Vec<usize> = p.appended_rows().map(|(_, _, row)| row).collect();
        let mut parts = vec![(&mut self.k, k_new, self.shape.head_dim)];
        if !self.shape.latent {
            parts.push((&mut self.v, v_new, self.shape.head_dim_v));
        }
        for (kv, new, d) in parts {
            // The largest new magnitude of every (block, head) written.
            let mut grown = std::collections::BTreeMap::<usize, f32>::new();
            for (src, &row) in rows.iter().enumerate() {
                for hk in 0..heads {
                    let seg = &new[(src * heads + hk) * d..][..d];
                    let a = seg.iter().fold(0f32, |m, v| m.max(flush(*v).abs()));
                    let at = blocks.block(row) * heads + hk;
                    let e = grown.entry(at).or_insert(0.0);
                    *e = e.max(a);
                }
            }
            for (&at, &a) in &grown {
                let (old, new_scale) = (kv.scales[at], quant.scale_of(a));
                if new_scale > old {
                    let hk = at % heads;
                    for row in blocks.rows(at / heads) {
                        for c in &mut kv.codes[(row * heads + hk) * d..][..d] {
                            *c = quant.encode(quant.value(*c, old), new_scale);
                        }
                    }
                    kv.scales[at] = new_scale;
                }
            }
            for (src, &row) in rows.iter().enumerate() {
                for hk in 0..heads {
                    let s = kv.scales[blocks.block(row) * heads + hk];
                    let (from, to) = ((src * heads + hk) * d, (row * heads + hk) * d);
                    for x in 0..d {
                        kv.codes[to + x] = quant.encode(new[from + x], s);
                    }
                }
            }
        }
    }
}

/// `k_new` and `v_new` (a latent cache's `k_new`) finite: a quantized
/// cache has no code for the rest (`Error::NonFiniteInput`).
pub(crate) fn check_new_finite(step: &DecodeStep) -> Result<()> {
    if let Some([k, v]) = &step.new_kv {
        crate::quant::check_finite(&k.data.to_f32(), "k_new")?;
        crate::quant::check_finite(&v.data.to_f32(), "v_new")?;
    }
    if let Some(k) = &step.new_latent {
        crate::quant::check_finite(&k.data.to_f32(), "k_new")?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::decode::CacheLayout;

    fn blocks(layout: CacheLayout) -> ScaleBlocks {
        ScaleBlocks::of(&CacheShape::new(layout, 2, 8).unwrap())
    }

    #[test]
    fn dense_rows_cut_into_blocks_of_16_and_pages_are_blocks() {
        let dense = blocks(CacheLayout::Dense {
            batch: 3,
            capacity: 40,
        });
        assert_eq!((dense.per_page, dense.count()), (3, 9));
        let of: Vec<usize> = [0, 15, 16, 39, 40, 119].map(|r| dense.block(r)).to_vec();
        assert_eq!(of, [0, 0, 1, 2, 3, 8]);
        assert_eq!(dense.rows(2), 32..40);
        assert_eq!(dense.rows(4), 56..72);
        // A row shorter than 16 tokens is one block.
        let short = blocks(CacheLayout::Dense {
            batch: 2,
            capacity: 5,
        });
        assert_eq!(
            (short.count(), short.block(7), short.rows(1)),
            (2, 1, 5..10)
        );
        let paged = blocks(CacheLayout::Paged {
            pages: 6,
            page_size: 48,
        });
        assert_eq!(
            (paged.count(), paged.block(100), paged.rows(2)),
            (6, 2, 96..144)
        );
    }

    #[test]
    fn every_row_is_in_the_block_that_lists_it() {
        for layout in [
            CacheLayout::Dense {
                batch: 2,
                capacity: 37,
            },
            CacheLayout::Paged {
                pages: 5,
                page_size: 7,
            },
        ] {
            let b = blocks(layout);
            let mut seen = 0;
            for blk in 0..b.count() {
                for row in b.rows(blk) {
                    assert_eq!(b.block(row), blk);
                    assert_eq!(row, seen);
                    seen += 1;
                }
            }
            assert_eq!(seen, b.pages * b.page_size);
        }
    }
}

//! The side buffer of a dispatch (`shaders/side.wgsl`): the small tables
//! its variant reads — a packed batch's prefix sums, ALiBi slopes, sink
//! logits, tile lists and the block mask — laid out in one buffer of words,
//! with the offsets in [`Params`] that point at them.

use super::params::{to_u32, Params};
use super::walk::wgsl_words;
use crate::api::block_mask::BlockMask;
use crate::api::scores::{Alibi, Sinks};
use crate::api::tile_lists::TileLists;
use crate::error::Result;

/// The tables one dispatch's kernel reads (`None`: its variant has not the feature).
#[derive(Clone, Debug, Default)]
pub struct SideTables<'a> {
    /// A packed batch's table (`Sequences::table`).
    pub seqs: Option<Vec<u32>>,
    pub alibi: Option<&'a Alibi>,
    pub sinks: Option<&'a Sinks>,
    /// Tile lists by query block and by key block.
    pub qtiles: Option<TileLists>,
    pub ktiles: Option<TileLists>,
    pub mask: Option<&'a BlockMask>,
}

impl SideTables<'_> {
    /// The buffer's words, with `params` pointed at each table; `heads_q`
    /// is the whole problem's (slopes per batch entry are that far apart).
    pub fn build(&self, params: &mut Params, heads_q: usize) -> Result<Vec<u32>> {
        let mut words: Vec<u32> = Vec::new();
        let at = |words: &Vec<u32>| to_u32("side buffer offset", words.len());
        if let Some(t) = &self.seqs {
            params.seq_at = at(&words)?;
            params.block_stride = block_stride(t, params.seq_count as usize);
            words.extend_from_slice(t);
        }
        if let Some(a) = self.alibi {
            params.alibi_at = at(&words)?;
            params.alibi_batch_stride = if a.per_batch(heads_q) {
                heads_q as u32
            } else {
                0
            };
            words.extend(a.slopes().iter().map(|s| s.to_bits()));
        }
        if let Some(s) = self.sinks {
            params.sinks_at = at(&words)?;
            words.extend(s.logits().iter().map(|s| s.to_bits()));
        }
        for (lists, by_keys) in [(&self.qtiles, false), (&self.ktiles, true)] {
            if let Some(l) = lists {
                let l = wgsl_words(l)?;
                let starts = at(&words)?;
                words.extend_from_slice(&l.starts);
                let entries = at(&words)?;
                words.extend_from_slice(&l.entries);
                let fields = if by_keys {
                    (
                        &mut params.ktiles_at,
                        &mut params.ktiles_entries,
                        &mut params.ktiles_head_stride,
                    )
                } else {
                    (
                        &mut params.qtiles_at,
                        &mut params.qtiles_entries,
                        &mut params.qtiles_head_stride,
                    )
                };
                (*fields.0, *fields.1, *fields.2) = (starts, entries, l.head_stride);
            }
        }
        if let Some(m) = self.mask {
            params.mask_at = at(&words)?;
            point_at_mask(params, m)?;
            words.extend(
                m.data()
                    .chunks(4)
                    .map(|c| c.iter().rev().fold(0u32, |w, &b| (w << 8) | b as u32)),
            );
        }
        Ok(words)
    }
}

/// A stride coprime with both block counts of a packed batch's `table`
/// (`Sequences::table`) whose products with them stay within 32 bits: the
/// order workgroups take blocks in (`sequence()` in common.wgsl). Strides
/// near a hundred put blocks of every sequence into each run of consecutive
/// workgroups; 1 (the identity) where none fits.
pub fn block_stride(table: &[u32], sequences: usize) -> u32 {
    let total = |k: usize| table[k * (sequences + 1) + sequences] as u64;
    let (rows, keys) = (total(2), total(3));
    let coprime = |a: u64, b: u64| {
        let (mut a, mut b) = (a, b);
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a == 1
    };
    (97u64..1000)
        .find(|&s| {
            [rows, keys]
                .iter()
                .all(|&t| t == 0 || (coprime(s, t) && s * t < 1 << 32))
        })
        .unwrap_or(1) as u32
}

/// The block mask's geometry in `params` (`block_allows` in common.wgsl).
fn point_at_mask(params: &mut Params, m: &BlockMask) -> Result<()> {
    let [mb, mh, rows, cols] = m.dims;
    params.mask_bm = to_u32("block size bm", m.grid.bm)?;
    params.mask_bn = to_u32("block size bn", m.grid.bn)?;
    params.mask_cols = to_u32("block mask columns", cols)?;
    params.mask_head_stride = if mh > 1 {
        to_u32("block mask head stride", rows * cols)?
    } else {
        0
    };
    params.mask_batch_stride = if mb > 1 {
        to_u32("block mask batch stride", mh * rows * cols)?
    } else {
        0
    };
    Ok(())
}

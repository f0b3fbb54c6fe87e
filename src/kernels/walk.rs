//! What each workgroup of a flash kernel walks, per sequence of a dispatch:
//! the blocks of the causal/window band, or — with a block mask — the tiles
//! of its tile lists. One description gives the grid, the side tables the
//! kernels read (a packed batch's prefix sums, the tile lists) and the
//! analytic access counts, so the three cannot disagree.

use super::band::{blocks, Band};
use super::params::Params;
use crate::api::band::Mask;
use crate::api::block_mask::{tile_fate, BlockMask, Tile, TileFate};
use crate::api::size::{grid_u32, to_u32};
use crate::api::tile_lists::{TileListBuilder, TileLists};
use crate::error::{Error, Result};

/// One sequence of a dispatch: its batch entry in the whole problem, its
/// rows and keys here, and its mask offset (keys − rows of the whole
/// sequence).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeqDims {
    pub b: usize,
    pub rows: usize,
    pub keys: usize,
    pub offset: i64,
}

/// The sequences of one dispatch: `batch` entries of the parameters' sizes
/// (dense), or a packed batch whose workgroups find their sequence.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Sequences {
    pub seqs: Vec<SeqDims>,
    pub packed: bool,
}

impl Sequences {
    /// The batch entries of a dense dispatch.
    pub fn dense(p: &Params) -> Self {
        let one = |z: u32| SeqDims {
            b: (p.batch_start + z) as usize,
            rows: p.seqlen_q as usize,
            keys: p.seqlen_k as usize,
            offset: p.mask_offset as i64,
        };
        Self {
            seqs: (0..p.batch).map(one).collect(),
            packed: false,
        }
    }

    /// A packed batch's sequences (`b` is their index).
    pub fn packed(seqs: Vec<SeqDims>) -> Self {
        Self { seqs, packed: true }
    }

    /// Blocks of `size` over each sequence's rows (or keys).
    pub fn blocks(&self, size: u32, by_keys: bool) -> impl Iterator<Item = u32> + '_ {
        self.seqs.iter().map(move |s| {
            let n = if by_keys { s.keys } else { s.rows };
            n.div_ceil(size as usize) as u32
        })
    }

    /// Workgroups along x: one sequence's blocks (dense; the batch is z) or
    /// every sequence's (packed).
    pub fn grid_x(&self, size: u32, by_keys: bool) -> u32 {
        if self.packed {
            self.blocks(size, by_keys).sum()
        } else {
            self.blocks(size, by_keys).next().unwrap_or(0)
        }
    }

    /// The most rows and the most keys any sequence has.
    pub fn longest(&self) -> (usize, usize) {
        self.seqs
            .iter()
            .fold((0, 0), |(q, k), s| (q.max(s.rows), k.max(s.keys)))
    }

    /// Workgroups along z: the batch (dense) or 1 (packed).
    pub fn grid_z(&self) -> u32 {
        if self.packed {
            1
        } else {
            grid_u32(self.seqs.len() as u64)
        }
    }

    /// A packed batch's table (`sequence()` in common.wgsl): the prefix sums
    /// of rows, keys, row blocks and key blocks of `size`, then the offsets.
    pub fn table(&self, size: u32) -> Vec<u32> {
        let prefix = |f: &dyn Fn(&SeqDims) -> u32| {
            std::iter::once(0)
                .chain(self.seqs.iter().scan(0u32, move |acc, s| {
                    *acc += f(s);
                    Some(*acc)
                }))
                .collect::<Vec<u32>>()
        };
        let blocks = |n: usize| n.div_ceil(size as usize) as u32;
        let mut t = prefix(&|s| s.rows as u32);
        t.extend(prefix(&|s| s.keys as u32));
        t.extend(prefix(&|s| blocks(s.rows)));
        t.extend(prefix(&|s| blocks(s.keys)));
        t.extend(self.seqs.iter().map(|s| s.offset as i32 as u32));
        t
    }
}

/// One kernel's walk over a dispatch: each workgroup owns an outer block
/// (of rows, or of keys `by_keys`) of one sequence and one head, and loops
/// over inner tiles of the other side.
#[derive(Clone, Copy, Debug)]
pub struct Walk<'a> {
    pub params: &'a Params,
    pub seqs: &'a Sequences,
    /// The kernel variant has the band mask.
    pub masked: bool,
    pub mask: Option<&'a BlockMask>,
    /// `[outer, inner]` tile sizes.
    pub tiles: [u32; 2],
    pub by_keys: bool,
}

/// One tile a workgroup visits: its first local row or key, how many, and
/// whether the block mask needs testing per pair.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Visit {
    pub start: u64,
    pub len: u64,
    pub partial: bool,
}

impl Walk<'_> {
    /// Every outer block: (sequence, first local row or key, length).
    pub fn outer(&self) -> impl Iterator<Item = (usize, u64, u64)> + '_ {
        let size = self.tiles[0] as u64;
        self.seqs.seqs.iter().enumerate().flat_map(move |(n, s)| {
            let len = if self.by_keys { s.keys } else { s.rows } as u64;
            (0..len.div_ceil(size)).map(move |i| (n, i * size, size.min(len - i * size)))
        })
    }

    /// The inner tiles the workgroup of outer block `(n, start, len)` visits
    /// for query head `h` (of the dispatch).
    pub fn visits(&self, (n, start, len): (usize, u64, u64), h: usize) -> Vec<Visit> {
        let s = &self.seqs.seqs[n];
        let p = self.params;
        let band = Band {
            params: p,
            masked: self.masked,
            offset: s.offset,
            rows: s.rows as i64,
            keys: s.keys as i64,
        };
        let (outer0, inner0, n_inner) = if self.by_keys {
            (p.k_start, p.q_start, s.rows)
        } else {
            (p.q_start, p.k_start, s.keys)
        };
        let first = outer0 as i64 + start as i64;
        let last = first + len as i64 - 1;
        let (lo, hi) = if self.by_keys {
            band.rows(first, last)
        } else {
            band.keys(first, last)
        };
        let inner = self.tiles[1] as u64;
        let dense = blocks(lo, hi, inner, n_inner as u64);
        let Some(mask) = self.mask else {
            return dense
                .map(|(start, len)| Visit {
                    start,
                    len,
                    partial: false,
                })
                .collect();
        };
        let view = mask.view(s.b, p.head_start as usize + h);
        let band_mask = self.band_mask(s);
        let outer = first as usize..(last + 1) as usize;
        (0..(n_inner as u64).div_ceil(inner))
            .filter_map(|t| {
                let (i0, il) = (t * inner, inner.min(n_inner as u64 - t * inner));
                let inner_range =
                    inner0 as usize + i0 as usize..inner0 as usize + (i0 + il) as usize;
                let tile = match self.by_keys {
                    true => Tile {
                        rows: inner_range,
                        keys: outer.clone(),
                    },
                    false => Tile {
                        rows: outer.clone(),
                        keys: inner_range,
                    },
                };
                let fate = tile_fate(&view, &band_mask, &tile);
                (fate != TileFate::Skipped).then_some(Visit {
                    start: i0,
                    len: il,
                    partial: fate == TileFate::Partial,
                })
            })
            .collect()
    }

    /// The band of sequence `s` in absolute positions, as the kernels apply it.
    fn band_mask(&self, s: &SeqDims) -> Mask {
        let p = self.params;
        let side = |x: i32| self.masked.then_some(x as i64);
        Mask {
            offset: s.offset,
            left: side(p.window_left),
            right: side(p.window_right),
            seqlen_k: p.k_start as i64 + s.keys as i64,
        }
    }

    /// Entries (keys, or rows `by_keys`) of every tile the workgroups of
    /// outer block `o` visit for the query heads `heads`, summed.
    pub fn visited(&self, o: (usize, u64, u64), heads: std::ops::Range<usize>) -> u64 {
        let sum = |h: usize| self.visits(o, h).iter().map(|v| v.len).sum::<u64>();
        if self.list_heads(heads.end) > 1 {
            heads.map(sum).sum()
        } else {
            heads.len() as u64 * sum(0)
        }
    }

    /// Query heads whose lists differ: every head of the dispatch where the
    /// mask has a grid per head, else one shared list.
    fn list_heads(&self, heads: usize) -> usize {
        match self.mask {
            Some(m) if m.dims[1] > 1 => heads,
            _ => 1,
        }
    }

    /// The tile lists of a sparse kernel for `heads` query heads:
    /// list `h · head_stride + flat block` (see `tile_steps` in
    /// common.wgsl); [`wgsl_words`] lays them out.
    pub fn lists(&self, heads: usize) -> TileLists {
        let outer: Vec<(usize, u64, u64)> = self.outer().collect();
        let list_heads = self.list_heads(heads);
        let inner = self.tiles[1] as u64;
        let mut lists = TileListBuilder::new();
        for h in 0..list_heads {
            for &o in &outer {
                lists.open_list();
                for v in self.visits(o, h) {
                    let fate = if v.partial {
                        TileFate::Partial
                    } else {
                        TileFate::Full
                    };
                    lists.add(0, (v.start / inner) as usize, fate);
                }
            }
        }
        let head_stride = if list_heads > 1 { outer.len() } else { 0 };
        lists.finish(head_stride, 0)
    }
}

/// Tile lists as the side buffer holds them (`tile_steps` and `tile_at` in
/// common.wgsl): the lists' starts, and their entries — the tile index, bit
/// 31 set where the mask needs a per-pair test; lists serve one query head
/// each (no head field).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WgslTileLists {
    /// Lists between query heads (0: one list for every head).
    pub head_stride: u32,
    pub starts: Vec<u32>,
    pub entries: Vec<u32>,
}

/// The WGSL encoding of `lists`: `Overflow` past 32-bit words (or a tile
/// index reaching bit 31).
pub fn wgsl_words(lists: &TileLists) -> Result<WgslTileLists> {
    let starts = lists
        .starts
        .iter()
        .map(|&s| to_u32("tile-list start", s))
        .collect::<Result<_>>()?;
    let entries = lists
        .entries
        .iter()
        .map(|e| {
            let tile =
                u32::try_from(e.tile)
                    .ok()
                    .filter(|&t| t < 1 << 31)
                    .ok_or(Error::Overflow {
                        what: "tile index",
                        value: e.tile as u64,
                    })?;
            Ok(tile | if e.partial { 1 << 31 } else { 0 })
        })
        .collect::<Result<_>>()?;
    Ok(WgslTileLists {
        head_stride: to_u32("tile-list head stride", lists.head_stride)?,
        starts,
        entries,
    })
}

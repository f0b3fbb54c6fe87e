//! Block-sparse attention: a caller's block mask of any block size, the
//! builders of the usual layouts, the pair predicate every backend applies,
//! and the mapping of a mask (and the causal/window band) onto a kernel's
//! tiles, so a tile with no allowed pair is never visited.
//!
//! `block_mask` has shape `(mb, mh, ceil(seqlen_q / bm), ceil(seqlen_k /
//! bn))` with `mb` 1 or batch and `mh` 1 or heads_q (broadcast); pair `(i,
//! j)` of batch entry `b`, query head `h` is allowed only if
//! `block_mask[b, h, i / bm, j / bn]`, counted from each sequence's top-left
//! (for packed batches the longest sequence sizes the grid).

use super::band::Mask;
use super::size;
use crate::error::{Error, Result};
use crate::random::Rng;
use std::ops::Range;
use std::sync::Arc;

/// The block grid of a mask: block sizes and how many blocks cover the
/// query rows and the keys.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct BlockGrid {
    /// Query rows per block.
    pub bm: usize,
    /// Keys per block.
    pub bn: usize,
    /// `ceil(seqlen_q / bm)`.
    pub rows: usize,
    /// `ceil(seqlen_k / bn)`.
    pub cols: usize,
}

impl BlockGrid {
    /// The grid of `(bm, bn)` blocks over `seqlen_q × seqlen_k`.
    pub fn new(seqlen_q: usize, seqlen_k: usize, (bm, bn): (usize, usize)) -> Result<Self> {
        if bm == 0 || bn == 0 {
            return Err(Error::BlockSize { bm, bn });
        }
        Ok(Self {
            bm,
            bn,
            rows: seqlen_q.div_ceil(bm),
            cols: seqlen_k.div_ceil(bn),
        })
    }
}

/// A validated block mask (entries nonzero = allowed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BlockMask {
    /// `(mb, mh, rows, cols)`.
    pub dims: [usize; 4],
    /// The blocks' size and count.
    pub grid: BlockGrid,
    data: Arc<[u8]>,
}

impl BlockMask {
    /// A mask of `dims` = `(mb, mh, rows, cols)` over blocks of `(bm, bn)`,
    /// row-major `data`, one byte per block (bool or u8, nonzero allows).
    pub fn new(dims: [usize; 4], (bm, bn): (usize, usize), data: &[u8]) -> Result<Self> {
        if bm == 0 || bn == 0 {
            return Err(Error::BlockSize { bm, bn });
        }
        let expected = size::elements("block_mask", &dims)?;
        if data.len() != expected {
            return Err(Error::DataLength {
                tensor: "block_mask",
                shape: dims.to_vec(),
                expected,
                actual: data.len(),
            });
        }
        let grid = BlockGrid {
            bm,
            bn,
            rows: dims[2],
            cols: dims[3],
        };
        Ok(Self {
            dims,
            grid,
            data: data.iter().map(|&x| (x != 0) as u8).collect(),
        })
    }

    /// A mask of `mb × mh` grids whose block `(r, c)` of batch `b`, head
    /// `h` is `allow(b, h, r, c)`.
    ///
    /// # Panics
    ///
    /// Where `mb × mh × rows × cols` bytes overflow or cannot be allocated
    /// (as `Vec` does; so do the pattern constructors below):
    /// [`BlockMask::new`] takes the caller's bytes with typed size errors.
    pub fn from_fn(
        grid: BlockGrid,
        [mb, mh]: [usize; 2],
        allow: impl Fn(usize, usize, usize, usize) -> bool,
    ) -> Self {
        let mut data = Vec::with_capacity(mb * mh * grid.rows * grid.cols);
        for b in 0..mb {
            for h in 0..mh {
                for r in 0..grid.rows {
                    data.extend((0..grid.cols).map(|c| allow(b, h, r, c) as u8));
                }
            }
        }
        Self {
            dims: [mb, mh, grid.rows, grid.cols],
            grid,
            data: data.into(),
        }
    }

    /// Local attention of `window` blocks on each side of the diagonal
    /// block plus `global` blocks that see and are seen by everything
    /// (Longformer, ETC), one grid for every batch entry and head.
    pub fn local_global(grid: BlockGrid, window: usize, global: usize) -> Self {
        Self::from_fn(grid, [1, 1], |_, _, r, c| {
            r.abs_diff(c) <= window || r < global || c < global
        })
    }

    /// The Sparse Transformer's strided pattern: the `local` blocks up to
    /// and including the diagonal one, and every `stride`-th block before it.
    pub fn strided(grid: BlockGrid, local: usize, stride: usize) -> Self {
        let stride = stride.max(1);
        Self::from_fn(grid, [1, 1], |_, _, r, c| {
            c <= r && (r - c < local || (r - c) % stride == 0)
        })
    }

    /// BigBird-like: a band of `window` blocks on each side, `global`
    /// leading blocks, and `random` random blocks per block row, drawn per
    /// query head from `seed`.
    pub fn bigbird(
        grid: BlockGrid,
        heads: usize,
        window: usize,
        global: usize,
        random: usize,
        seed: u64,
    ) -> Self {
        let mut extra = vec![false; heads * grid.rows * grid.cols];
        let mut rng = Rng::new(seed);
        for row in extra.chunks_mut(grid.cols) {
            for _ in 0..random.min(grid.cols) {
                row[rng.below(grid.cols)] = true;
            }
        }
        Self::from_fn(grid, [1, heads], |_, h, r, c| {
            r.abs_diff(c) <= window
                || r < global
                || c < global
                || extra[(h * grid.rows + r) * grid.cols + c]
        })
    }

    /// Each block allowed with probability `density`, independently per
    /// query head, drawn from `seed` (for density sweeps).
    pub fn random(grid: BlockGrid, heads: usize, density: f64, seed: u64) -> Self {
        let mut rng = Rng::new(seed);
        let keep: Vec<bool> = (0..heads * grid.rows * grid.cols)
            .map(|_| rng.uniform() < density)
            .collect();
        Self::from_fn(grid, [1, heads], |_, h, r, c| {
            keep[(h * grid.rows + r) * grid.cols + c]
        })
    }

    /// The mask's bytes (0 or 1), row-major `(mb, mh, rows, cols)`.
    pub fn data(&self) -> &[u8] {
        &self.data
    }

    /// The fraction of allowed blocks.
    pub fn density(&self) -> f64 {
        let allowed = self.data.iter().filter(|&&x| x != 0).count();
        allowed as f64 / self.data.len().max(1) as f64
    }

    /// The mask must fit a problem of `batch` entries (sequences),
    /// `heads_q` query heads and (longest) sequences of `seqlen_q × seqlen_k`.
    /// Its public `dims` and `grid` are checked again here, against its data
    /// and each other, in case they were changed since it was built.
    pub fn validate_for(
        &self,
        batch: usize,
        heads_q: usize,
        (sq, sk): (usize, usize),
    ) -> Result<()> {
        let want = BlockGrid::new(sq, sk, (self.grid.bm, self.grid.bn))?;
        let expected = size::elements("block_mask", &self.dims)?;
        if self.data.len() != expected {
            return Err(Error::DataLength {
                tensor: "block_mask",
                shape: self.dims.to_vec(),
                expected,
                actual: self.data.len(),
            });
        }
        let checks = [
            ("batch dim", self.dims[0], batch, true),
            ("head dim", self.dims[1], heads_q, true),
            ("row-block count", self.dims[2], want.rows, false),
            ("column-block count", self.dims[3], want.cols, false),
            ("grid's row-block count", self.grid.rows, want.rows, false),
            ("grid's column-block count", self.grid.cols, want.cols, false),
        ];
        for (dim, value, expected, broadcast) in checks {
            if value != expected && !(broadcast && value == 1) {
                return Err(Error::BlockMaskDim {
                    dim,
                    value,
                    expected,
                    broadcast,
                });
            }
        }
        Ok(())
    }

    /// The grid of batch entry `b`, query head `h` (broadcast dims read 0).
    pub fn view(&self, b: usize, h: usize) -> MaskView<'_> {
        let [_, _, rows, cols] = self.dims;
        let at = self.offset(b, h);
        MaskView {
            grid: self.grid,
            blocks: &self.data[at..at + rows * cols],
        }
    }

    /// Index of block `(0, 0)` of batch entry `b`, query head `h` in [`Self::data`].
    pub fn offset(&self, b: usize, h: usize) -> usize {
        let [mb, mh, rows, cols] = self.dims;
        (if mb > 1 { b } else { 0 } * mh + if mh > 1 { h } else { 0 }) * rows * cols
    }
}

/// One (batch entry, query head)'s block grid.
#[derive(Clone, Copy, Debug)]
pub struct MaskView<'a> {
    pub grid: BlockGrid,
    blocks: &'a [u8],
}

impl MaskView<'_> {
    /// Whether pair `(i, j)` (sequence-relative) is allowed.
    pub fn allows(&self, i: usize, j: usize) -> bool {
        let (r, c) = (i / self.grid.bm, j / self.grid.bn);
        r < self.grid.rows && c < self.grid.cols && self.blocks[r * self.grid.cols + c] != 0
    }

    /// Whether block `(r, c)` is allowed.
    fn block(&self, r: usize, c: usize) -> bool {
        self.blocks[r * self.grid.cols + c] != 0
    }
}

/// How one tile fares under the mask and band.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TileFate {
    /// No allowed pair: never visited.
    Skipped,
    /// Every pair the band allows is also allowed by the mask: no
    /// per-element mask test needed (the band's own test still applies).
    Full,
    /// Some pairs the band allows are masked: test each pair.
    Partial,
}

/// What [`tile_fate`] examines: the rectangle of absolute rows × keys of a
/// tile (already clipped to the sequence) under a band and a mask view.
#[derive(Clone, Debug)]
pub struct Tile {
    pub rows: Range<usize>,
    pub keys: Range<usize>,
}

/// Whether the tile has any pair the band and the mask allow, and whether
/// the mask needs testing per pair.
pub fn tile_fate(mask: &MaskView, band: &Mask, tile: &Tile) -> TileFate {
    let g = mask.grid;
    if tile.rows.is_empty() || tile.keys.is_empty() {
        return TileFate::Skipped;
    }
    let (mut any, mut all) = (false, true);
    let (r0, r1) = (tile.rows.start / g.bm, (tile.rows.end - 1) / g.bm);
    let (c0, c1) = (tile.keys.start / g.bn, (tile.keys.end - 1) / g.bn);
    for r in r0..=r1.min(g.rows.saturating_sub(1)) {
        let rows = (r * g.bm).max(tile.rows.start)..((r + 1) * g.bm).min(tile.rows.end);
        for c in c0..=c1.min(g.cols.saturating_sub(1)) {
            let keys = (c * g.bn).max(tile.keys.start)..((c + 1) * g.bn).min(tile.keys.end);
            if !band_meets(band, &rows, &keys) {
                continue;
            }
            if mask.block(r, c) {
                any = true;
            } else {
                all = false;
            }
        }
    }
    if r1 >= g.rows || c1 >= g.cols {
        all = false;
    }
    match (any, all) {
        (false, _) => TileFate::Skipped,
        (true, true) => TileFate::Full,
        (true, false) => TileFate::Partial,
    }
}

/// Whether the band allows any pair of `rows × keys` (absolute positions).
/// Each row's keys are one interval that moves by one per row, so the rows'
/// union is the interval from the first row's start to the last row's end.
fn band_meets(band: &Mask, rows: &Range<usize>, keys: &Range<usize>) -> bool {
    let first = rows.start as i64 + band.offset;
    let last = rows.end as i64 - 1 + band.offset;
    let lo = band.left.map_or(0, |l| first - l).max(keys.start as i64);
    let hi = band
        .right
        .map_or(band.seqlen_k, |r| last + r + 1)
        .min(band.seqlen_k)
        .min(keys.end as i64);
    lo < hi
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grid(sq: usize, sk: usize, b: (usize, usize)) -> BlockGrid {
        BlockGrid::new(sq, sk, b).unwrap()
    }

    #[test]
    fn masks_validate_their_shape() {
        let m = BlockMask::local_global(grid(20, 30, (7, 13)), 0, 0);
        assert_eq!(m.dims, [1, 1, 3, 3]);
        assert!(m.validate_for(4, 8, (20, 30)).is_ok());
        assert!(matches!(
            m.validate_for(4, 8, (22, 30)),
            Err(Error::BlockMaskDim {
                value: 3,
                expected: 4,
                ..
            })
        ));
        assert!(matches!(
            BlockMask::new([1, 1, 2, 2], (0, 4), &[1; 4]),
            Err(Error::BlockSize { bm: 0, bn: 4 })
        ));
        assert!(matches!(
            BlockMask::new([2, 3, 2, 2], (4, 4), &[1; 4]),
            Err(Error::DataLength { expected: 24, .. })
        ));
        let per_head = BlockMask::new([1, 2, 1, 1], (4, 4), &[0, 1]).unwrap();
        assert!(matches!(
            per_head.validate_for(1, 3, (4, 4)),
            Err(Error::BlockMaskDim {
                value: 2,
                expected: 3,
                broadcast: true,
                ..
            })
        ));
        assert!(!per_head.view(5, 0).allows(0, 0));
        assert!(per_head.view(5, 1).allows(3, 3));
    }

    #[test]
    fn builders_make_the_usual_layouts() {
        let g = grid(64, 64, (8, 8));
        let lg = BlockMask::local_global(g, 1, 1);
        let v = lg.view(0, 0);
        assert!(v.allows(63, 0) && v.allows(0, 63) && v.allows(40, 48));
        assert!(!v.allows(40, 56));
        let st = BlockMask::strided(g, 2, 3);
        let v = st.view(0, 0);
        assert!(v.allows(56, 56) && v.allows(56, 48) && v.allows(56, 32) && !v.allows(56, 40));
        assert!(!v.allows(0, 8), "strided is causal at block level");
        let a = BlockMask::bigbird(g, 2, 0, 1, 2, 7);
        assert_eq!(a, BlockMask::bigbird(g, 2, 0, 1, 2, 7), "seeded");
        assert_ne!(a, BlockMask::bigbird(g, 2, 0, 1, 2, 8));
        let r = BlockMask::random(grid(1024, 1024, (16, 16)), 1, 0.25, 3);
        assert!((r.density() - 0.25).abs() < 0.03, "{}", r.density());
    }

    #[test]
    fn tiles_are_skipped_full_or_partial() {
        // Blocks of 7 × 13 over 28 × 26; allow only block (1, 0).
        let g = grid(28, 26, (7, 13));
        let m = BlockMask::from_fn(g, [1, 1], |_, _, r, c| (r, c) == (1, 0));
        let band = Mask::new(28, 26, None, None);
        let v = m.view(0, 0);
        let fate =
            |rows: Range<usize>, keys: Range<usize>| tile_fate(&v, &band, &Tile { rows, keys });
        assert_eq!(fate(0..7, 0..13), TileFate::Skipped);
        assert_eq!(fate(7..14, 0..13), TileFate::Full);
        assert_eq!(fate(8..12, 4..8), TileFate::Full);
        assert_eq!(fate(4..12, 0..8), TileFate::Partial);
        assert_eq!(fate(7..14, 10..20), TileFate::Partial);
        // The band: a causal tile above the diagonal has no allowed pair.
        let causal = Mask::new(28, 28, None, Some(0));
        let all = BlockMask::local_global(grid(28, 28, (7, 13)), 9, 0);
        let v = all.view(0, 0);
        let t = Tile {
            rows: 0..4,
            keys: 8..12,
        };
        assert_eq!(tile_fate(&v, &causal, &t), TileFate::Skipped);
        let t = Tile {
            rows: 8..12,
            keys: 8..12,
        };
        assert_eq!(tile_fate(&v, &causal, &t), TileFate::Full);
    }
}

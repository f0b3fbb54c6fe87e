//! A block mask's tile lists, built one way for every backend: per list
//! (a sequence, a head, an outer block of rows or keys) the inner tiles with
//! an allowed pair, CSR-style, each flagged where the mask needs testing per
//! pair. How the lists are laid out for a kernel is the kernel's own
//! encoder's business (the WGSL side buffer's words in `kernels::walk`,
//! CUDA's `Layout` arrays in `cuda::layout`); what goes into them is decided
//! here and by [`tile_fate`](super::block_mask::tile_fate).

use super::block_mask::TileFate;

/// One inner tile of a list.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileEntry {
    /// The tile's index along the inner side.
    pub tile: usize,
    /// The head within the list's group (lists that serve several query
    /// heads in turn, such as CUDA's dK/dV lists per kv head); else 0.
    pub head: usize,
    /// The mask needs testing per pair.
    pub partial: bool,
}

/// Tile lists, CSR-style: list `i`'s entries are
/// `entries[starts[i]..starts[i + 1]]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TileLists {
    /// Where each list starts, and one past the last.
    pub starts: Vec<usize>,
    pub entries: Vec<TileEntry>,
    /// Lists between heads (0: one list serves every head).
    pub head_stride: usize,
    /// Lists between sequences (0: one list serves every sequence).
    pub batch_stride: usize,
}

/// Builds [`TileLists`] list by list.
#[derive(Debug, Default)]
pub struct TileListBuilder {
    lists: TileLists,
}

impl TileListBuilder {
    /// No lists yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Begin the next list (entries added from now on are its own).
    pub fn open_list(&mut self) {
        self.lists.starts.push(self.lists.entries.len());
    }

    /// Add tile `tile` of head `head` to the open list as `fate` decides:
    /// skipped tiles are left out.
    pub fn add(&mut self, head: usize, tile: usize, fate: TileFate) {
        if fate != TileFate::Skipped {
            self.lists.entries.push(TileEntry {
                tile,
                head,
                partial: fate == TileFate::Partial,
            });
        }
    }

    /// The lists, with the strides their kernels index them by.
    pub fn finish(mut self, head_stride: usize, batch_stride: usize) -> TileLists {
        self.lists.starts.push(self.lists.entries.len());
        TileLists {
            head_stride,
            batch_stride,
            ..self.lists
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lists_keep_their_tiles_apart_and_skip_skipped_ones() {
        let mut b = TileListBuilder::new();
        b.open_list();
        b.add(0, 0, TileFate::Full);
        b.add(0, 1, TileFate::Skipped);
        b.add(1, 2, TileFate::Partial);
        b.open_list();
        b.open_list();
        b.add(0, 3, TileFate::Full);
        let l = b.finish(3, 0);
        assert_eq!(l.starts, vec![0, 2, 2, 3]);
        let tiles: Vec<(usize, usize, bool)> = l
            .entries
            .iter()
            .map(|e| (e.tile, e.head, e.partial))
            .collect();
        assert_eq!(tiles, vec![(0, 0, false), (2, 1, true), (3, 0, false)]);
        assert_eq!((l.head_stride, l.batch_stride), (3, 0));
        assert_eq!(TileListBuilder::new().finish(0, 0).starts, vec![0]);
    }
}

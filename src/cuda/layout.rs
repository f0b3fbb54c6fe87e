//! The run-time layouts of a call: `Layout` (the C struct of
//! cuda/common.cuh, the last argument of every kernel), the side buffers
//! it points at (ALiBi slopes, sink logits, a packed batch's prefix sums,
//! a block mask) and the tile lists a block mask gives each launch's tiles.
//! Nothing here is a compile-time variant: one kernel serves every layout,
//! branching uniformly on what the struct says is on.

use super::driver_error::driver;
use crate::api::block_mask::{tile_fate, BlockMask, Tile};
use crate::api::options::AttentionOptions;
use crate::api::shape::AttentionShape;
use crate::api::tile_lists::{TileEntry, TileListBuilder, TileLists};
use crate::api::varlen::{sequences, Sequence};
use crate::error::{Error, Result};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DeviceRepr};
use std::sync::Arc;

/// `struct Layout` of cuda/common.cuh, field for field: device pointers
/// (0 = off) then strides.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Layout {
    alibi: u64,
    sinks: u64,
    cu_q: u64,
    cu_k: u64,
    mask: u64,
    tile_starts: u64,
    tile_entries: u64,
    alibi_batch_stride: i32,
    bm: i32,
    bn: i32,
    mask_rows: i32,
    mask_cols: i32,
    mask_batch_stride: i32,
    mask_head_stride: i32,
    list_batch_stride: i32,
    list_head_stride: i32,
    pad: i32,
}

// SAFETY: a plain #[repr(C)] struct of 8- and 4-byte scalars, the layout of the C one.
unsafe impl DeviceRepr for Layout {}

/// The flag of a tile-list entry whose tile needs the per-pair mask test
/// (`TILE_PARTIAL` in cuda/common.cuh).
pub(crate) const TILE_PARTIAL: i32 = 1 << 30;
/// Where a dK/dV entry keeps its query head within the group
/// (`TILE_HEAD_SHIFT`); below it, the tile index.
pub(crate) const TILE_HEAD_SHIFT: u32 = 20;

fn to_i32(what: &'static str, value: usize) -> Result<i32> {
    i32::try_from(value).map_err(|_| Error::Overflow {
        what,
        value: value as u64,
    })
}

/// The tiles of one launch: blocks own `outer` rows (query rows, or keys
/// `by_keys`) and stream tiles of `inner` of the other side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LaunchTiles {
    pub outer: usize,
    pub inner: usize,
    pub by_keys: bool,
}

/// A launch's tile lists as `Layout` points at them: `starts`, then the
/// entries — the inner tile, [`TILE_PARTIAL`] where the mask needs testing
/// per pair, and (dK/dV's lists, per kv head) the query head within the
/// group at [`TILE_HEAD_SHIFT`] — then one entry never read, so that even a
/// mask that skips every tile has a buffer (a null one means no mask).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct CudaTileLists {
    pub starts: Vec<i32>,
    pub entries: Vec<i32>,
    pub batch_stride: i32,
    pub head_stride: i32,
}

/// The CUDA encoding of `lists`: `Unsupported` where a tile index or a
/// head does not fit its field, `Overflow` past 32-bit ints.
pub(crate) fn cuda_words(lists: &TileLists) -> Result<CudaTileLists> {
    let fits = lists
        .entries
        .iter()
        .all(|e| e.tile < 1 << TILE_HEAD_SHIFT && e.head < 1 << (30 - TILE_HEAD_SHIFT));
    if !fits {
        return Err(Error::Unsupported {
            what: super::problem::WHAT,
            feature: "a block mask over more than 2^20 tiles or 1024 query heads per kv head",
        });
    }
    let starts = lists
        .starts
        .iter()
        .map(|&s| to_i32("tile-list entries", s))
        .collect::<Result<_>>()?;
    let entry = |e: &TileEntry| {
        let partial = if e.partial { TILE_PARTIAL } else { 0 };
        ((e.head << TILE_HEAD_SHIFT) | e.tile) as i32 | partial
    };
    Ok(CudaTileLists {
        starts,
        entries: lists.entries.iter().map(entry).chain([0]).collect(),
        batch_stride: to_i32("tile lists", lists.batch_stride)?,
        head_stride: to_i32("tile lists", lists.head_stride)?,
    })
}

/// The lists of `mask` under `opts`' band for `tiles` over `seqs`: a list
/// per sequence (shared by a dense batch with one grid for every entry), per
/// query head where the mask has a grid per head (per kv head `by_keys`).
pub(crate) fn tile_lists(
    mask: &BlockMask,
    opts: &AttentionOptions,
    seqs: &[Sequence],
    [heads_q, heads_kv]: [usize; 2],
    tiles: LaunchTiles,
    packed: bool,
) -> TileLists {
    let longest = seqs
        .iter()
        .map(|s| if tiles.by_keys { s.len_k() } else { s.len_q() })
        .max()
        .unwrap_or(0);
    let outer_tiles = longest.div_ceil(tiles.outer);
    let group = heads_q / heads_kv;
    let (list_heads, heads_per_list) = match (tiles.by_keys, mask.dims[1] > 1) {
        (true, _) => (heads_kv, group),
        (false, true) => (heads_q, 1),
        (false, false) => (1, 1),
    };
    let shared = !packed && mask.dims[0] == 1;
    let list_seqs = if shared {
        &seqs[..seqs.len().min(1)]
    } else {
        seqs
    };
    let mut lists = TileListBuilder::new();
    for seq in list_seqs {
        let band = opts.mask_for(seq.len_q(), seq.len_k());
        let (n_outer, n_inner) = if tiles.by_keys {
            (seq.len_k(), seq.len_q())
        } else {
            (seq.len_q(), seq.len_k())
        };
        for lh in 0..list_heads {
            for o in 0..outer_tiles {
                lists.open_list();
                let outer = o * tiles.outer..((o + 1) * tiles.outer).min(n_outer);
                if outer.is_empty() {
                    continue;
                }
                for (g, t) in (0..heads_per_list)
                    .flat_map(|g| (0..n_inner.div_ceil(tiles.inner)).map(move |t| (g, t)))
                {
                    let view = mask.view(seq.index, lh * heads_per_list + g);
                    let inner = t * tiles.inner..((t + 1) * tiles.inner).min(n_inner);
                    let tile = if tiles.by_keys {
                        Tile {
                            rows: inner,
                            keys: outer.clone(),
                        }
                    } else {
                        Tile {
                            rows: outer.clone(),
                            keys: inner,
                        }
                    };
                    lists.add(g, t, tile_fate(&view, &band, &tile));
                }
            }
        }
    }
    lists.finish(
        if list_heads > 1 { outer_tiles } else { 0 },
        if shared { 0 } else { list_heads * outer_tiles },
    )
}

/// The side buffers of one call on the device (each `None` when off).
pub(crate) struct Side {
    opts: AttentionOptions,
    shape: AttentionShape,
    pub seqs: Vec<Sequence>,
    alibi: Option<CudaSlice<f32>>,
    sinks: Option<CudaSlice<f32>>,
    cu: Option<[CudaSlice<i32>; 2]>,
    mask: Option<CudaSlice<u8>>,
    base: Layout,
}

/// One launch's lists on the device.
pub(crate) struct DeviceLists {
    starts: CudaSlice<i32>,
    entries: CudaSlice<i32>,
    batch_stride: i32,
    head_stride: i32,
}

impl Side {
    /// Upload what `opts` turns on (validated against `shape` by the caller).
    pub fn upload(
        stream: &Arc<CudaStream>,
        shape: &AttentionShape,
        opts: &AttentionOptions,
    ) -> Result<Self> {
        let up_f32 = |x: &[f32], during| stream.clone_htod(x).map_err(driver(during));
        let alibi = opts
            .alibi
            .as_ref()
            .map(|a| up_f32(a.slopes(), "uploading ALiBi slopes"))
            .transpose()?;
        let sinks = opts
            .sinks
            .as_ref()
            .map(|s| up_f32(s.logits(), "uploading sinks"))
            .transpose()?;
        let cu = match &opts.varlen {
            Some(v) => Some([
                stream
                    .clone_htod(v.cu_seqlens_q())
                    .map_err(driver("uploading cu_seqlens_q"))?,
                stream
                    .clone_htod(v.cu_seqlens_k())
                    .map_err(driver("uploading cu_seqlens_k"))?,
            ]),
            None => None,
        };
        let mask = opts
            .block_mask
            .as_ref()
            .map(|m| {
                // One byte more: a mask of no blocks (a packed batch of
                // empty sequences) still gets a buffer; none is read past it.
                let mut bytes = m.data().to_vec();
                bytes.push(0);
                stream
                    .clone_htod(&bytes)
                    .map_err(driver("uploading the block mask"))
            })
            .transpose()?;
        let mut base = Layout::default();
        if let Some(a) = &opts.alibi {
            base.alibi_batch_stride = if a.per_batch(shape.heads_q) {
                to_i32("heads_q", shape.heads_q)?
            } else {
                0
            };
        }
        if let Some(m) = &opts.block_mask {
            let [mb, mh, rows, cols] = m.dims;
            base.bm = to_i32("the block mask's bm", m.grid.bm)?;
            base.bn = to_i32("the block mask's bn", m.grid.bn)?;
            base.mask_rows = to_i32("the block mask's rows", rows)?;
            base.mask_cols = to_i32("the block mask's columns", cols)?;
            let grid = rows * cols;
            base.mask_head_stride = if mh > 1 {
                to_i32("the block mask's entries", grid)?
            } else {
                0
            };
            base.mask_batch_stride = if mb > 1 {
                to_i32("the block mask's entries", mh * grid)?
            } else {
                0
            };
        }
        let side = Self {
            opts: opts.clone(),
            shape: *shape,
            seqs: sequences(shape, opts.varlen.as_ref()),
            alibi,
            sinks,
            cu,
            mask,
            base,
        };
        Ok(side)
    }

    /// With a block mask, the lists of a launch of `tiles`, on the device.
    pub fn lists(
        &self,
        stream: &Arc<CudaStream>,
        tiles: LaunchTiles,
    ) -> Result<Option<DeviceLists>> {
        let Some(mask) = &self.opts.block_mask else {
            return Ok(None);
        };
        let l = tile_lists(
            mask,
            &self.opts,
            &self.seqs,
            [self.shape.heads_q, self.shape.heads_kv],
            tiles,
            self.opts.varlen.is_some(),
        );
        let l = cuda_words(&l)?;
        to_i32("tile-list entries", l.entries.len())?;
        Ok(Some(DeviceLists {
            starts: stream
                .clone_htod(&l.starts)
                .map_err(driver("uploading tile lists"))?,
            entries: stream
                .clone_htod(&l.entries)
                .map_err(driver("uploading tile lists"))?,
            batch_stride: l.batch_stride,
            head_stride: l.head_stride,
        }))
    }

    /// The `Layout` argument of a launch with `lists` (the block mask's, for
    /// its tiles). The buffers outlive every launch on `stream` that takes
    /// it: the caller synchronizes before dropping them.
    pub fn layout(&self, stream: &CudaStream, lists: Option<&DeviceLists>) -> Layout {
        let ptr = |s: Option<&CudaSlice<f32>>| s.map_or(0, |s| s.device_ptr(stream).0);
        let mut l = self.base;
        l.alibi = ptr(self.alibi.as_ref());
        l.sinks = ptr(self.sinks.as_ref());
        if let Some([q, k]) = &self.cu {
            l.cu_q = q.device_ptr(stream).0;
            l.cu_k = k.device_ptr(stream).0;
        }
        if let (Some(mask), Some(lists)) = (&self.mask, lists) {
            l.mask = mask.device_ptr(stream).0;
            l.tile_starts = lists.starts.device_ptr(stream).0;
            l.tile_entries = lists.entries.device_ptr(stream).0;
            l.list_batch_stride = lists.batch_stride;
            l.list_head_stride = lists.head_stride;
        }
        l
    }

    /// `dsink_h = −Σ exp(sink_h − lse) · D` over every row of head `h`, in
    /// row order, in f64 (deterministic), from `lse` and the kernels' D.
    pub fn dsinks(&self, lse: &[f32], delta: &[f32]) -> Option<Vec<f32>> {
        let sinks = self.opts.sinks.as_ref()?.logits();
        Some(crate::cpu::sink_gradients(sinks, &self.seqs, lse, delta))
    }
}


#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::block_mask::BlockGrid;

    /// Seven 8-byte pointers and ten 4-byte ints, no padding: a field added
    /// on one side only would shift every one after it.
    #[test]
    fn layout_has_the_c_struct_layout() {
        assert_eq!(std::mem::size_of::<Layout>(), 7 * 8 + 10 * 4);
        assert_eq!(std::mem::align_of::<Layout>(), 8);
        assert_eq!(std::mem::offset_of!(Layout, alibi_batch_stride), 56);
        assert_eq!(std::mem::offset_of!(Layout, pad), 92);
    }

    #[test]
    fn tile_lists_skip_masked_tiles_and_flag_partial_ones() {
        // 16 x 16 over blocks of 4 x 8: only block (1, 0) allowed, tiles of 8 x 8.
        let shape = AttentionShape::new(2, 16, 16, 2, 1, 8).unwrap();
        let grid = BlockGrid::new(16, 16, (4, 8)).unwrap();
        let mask = BlockMask::from_fn(grid, [1, 1], |_, _, r, c| (r, c) == (1, 0));
        let opts = AttentionOptions::default().block_mask(mask.clone());
        let seqs = sequences(&shape, None);
        let rows = LaunchTiles {
            outer: 8,
            inner: 8,
            by_keys: false,
        };
        let l = cuda_words(&tile_lists(&mask, &opts, &seqs, [2, 1], rows, false)).unwrap();
        // One list per outer tile, shared by the batch and the heads:
        // rows 0..8 see key tile 0 partially (rows 4..8 only), rows 8..16 nothing.
        assert_eq!(l.starts, vec![0, 1, 1]);
        assert_eq!(l.entries, vec![TILE_PARTIAL, 0]);
        assert_eq!((l.batch_stride, l.head_stride), (0, 0));
        let keys = LaunchTiles {
            by_keys: true,
            ..rows
        };
        // dK/dV: per kv head, both query heads of its group in turn.
        let l = cuda_words(&tile_lists(&mask, &opts, &seqs, [2, 1], keys, false)).unwrap();
        assert_eq!(l.starts, vec![0, 2, 2]);
        let second = (1 << TILE_HEAD_SHIFT) | TILE_PARTIAL;
        assert_eq!(l.entries, vec![TILE_PARTIAL, second, 0]);
        assert_eq!((l.batch_stride, l.head_stride), (0, 0));
    }

    #[test]
    fn dsinks_sum_every_row_of_a_head() {
        let shape = AttentionShape::new(1, 2, 3, 2, 1, 4).unwrap();
        let seqs = sequences(&shape, None);
        // lse (1, 2, 2): head 0 rows at 0, 1; head 1 at 2, 3.
        let lse = [0.0, 1.0, 2.0, 0.5];
        let delta = [1.0, 2.0, -1.0, 4.0];
        let d = crate::cpu::sink_gradients(&[0.0, 0.5], &seqs, &lse, &delta);
        let want0 = -(1.0 + (-1f64).exp() * 2.0);
        let want1 = (0.5f64 - 2.0).exp() - 4.0;
        assert!((d[0] as f64 - want0).abs() < 1e-6 && (d[1] as f64 - want1).abs() < 1e-6);
    }
}

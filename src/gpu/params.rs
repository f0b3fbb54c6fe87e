//! The uniform block every kernel reads; the WGSL twin is `Params` in
//! `shaders/common.wgsl` (same field order).

use crate::error::{Error, Result};
use crate::options::AttentionOptions;
use crate::tensor::AttentionShape;
use bytemuck::{Pod, Zeroable};

#[repr(C)]
#[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
pub struct Params {
    pub seqlen_q: u32,
    pub seqlen_k: u32,
    pub q_start: u32,
    pub k_start: u32,
    pub heads_q: u32,
    pub group: u32,
    pub q_row_stride: u32,
    pub kv_row_stride: u32,
    pub q_batch_stride: u32,
    pub kv_batch_stride: u32,
    pub lse_batch_stride: u32,
    pub lse_head_stride: u32,
    pub block_offset: u32,
    pub mask_offset: i32,
    pub window_left: i32,
    pub window_right: i32,
    pub scale: f32,
    pub softcap: f32,
    pub _pad0: u32,
    pub batch: u32,
    pub _pad: [u32; 4],
}

/// A piece of a problem as laid out in the buffers bound for one dispatch:
/// `local` sizes index the buffers; `q_start`/`k_start` place it in `full`,
/// the problem the masks are defined on.
#[derive(Clone, Copy, Debug)]
pub struct Piece {
    pub local: AttentionShape,
    pub full: AttentionShape,
    pub q_start: usize,
    pub k_start: usize,
}

impl Piece {
    pub fn whole(shape: AttentionShape) -> Self {
        Self {
            local: shape,
            full: shape,
            q_start: 0,
            k_start: 0,
        }
    }
}

fn to_u32(what: &str, x: usize) -> Result<u32> {
    u32::try_from(x).map_err(|_| Error::Unsupported(format!("{what} {x} does not fit in 32 bits")))
}

impl Params {
    pub fn new(piece: &Piece, opts: &AttentionOptions) -> Result<Self> {
        let s = &piece.local;
        let d = s.head_dim;
        let scale = opts.scale_for(d);
        let softcap = opts.softcap_value();
        let mask = opts.mask(&piece.full);
        // "Unbounded" becomes a bound past both ends of the sequences.
        let unbounded = piece.full.seqlen_q as i64 + piece.full.seqlen_k as i64 + 1;
        if unbounded > i32::MAX as i64 / 2 {
            return Err(Error::Unsupported(format!(
                "seqlen_q + seqlen_k = {} is too long for 32-bit mask arithmetic",
                unbounded - 1
            )));
        }
        Ok(Self {
            seqlen_q: to_u32("seqlen_q", s.seqlen_q)?,
            seqlen_k: to_u32("seqlen_k", s.seqlen_k)?,
            q_start: to_u32("q_start", piece.q_start)?,
            k_start: to_u32("k_start", piece.k_start)?,
            heads_q: to_u32("heads_q", s.heads_q)?,
            group: to_u32("group", s.group())?,
            q_row_stride: to_u32("q row stride", s.heads_q * d)?,
            kv_row_stride: to_u32("kv row stride", s.heads_kv * d)?,
            q_batch_stride: to_u32("q batch stride", s.seqlen_q * s.heads_q * d)?,
            kv_batch_stride: to_u32("kv batch stride", s.seqlen_k * s.heads_kv * d)?,
            lse_batch_stride: to_u32("lse batch stride", s.heads_q * s.seqlen_q)?,
            lse_head_stride: to_u32("lse head stride", s.seqlen_q)?,
            block_offset: 0,
            mask_offset: mask.offset as i32,
            window_left: mask.left.unwrap_or(unbounded) as i32,
            window_right: mask.right.unwrap_or(unbounded) as i32,
            scale,
            softcap,
            _pad0: 0,
            batch: to_u32("batch", s.batch)?,
            _pad: [0; 4],
        })
    }
}

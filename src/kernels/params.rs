//! The uniform blocks kernels read. Each Rust struct has a WGSL twin
//! (`Params` in `shaders/common.wgsl`, `MatmulParams` in
//! `shaders/matmul_common.wgsl`); [`Uniform::FIELDS`] lists the Rust layout,
//! and a test checks it member by member against naga's layout of the WGSL
//! struct, so the two cannot drift apart unnoticed.

use crate::api::decode::DecodeProblem;
use crate::api::options::AttentionOptions;
use crate::api::shape::AttentionShape;
pub use crate::api::size::to_u32;
use crate::error::{Error, Result};
use bytemuck::{Pod, Zeroable};

/// A `#[repr(C)]` uniform struct whose layout a test compares with WGSL's.
pub trait Uniform: Pod {
    /// The WGSL struct's name.
    #[cfg(feature = "lab")]
    const WGSL_NAME: &'static str;
    /// Field names and byte offsets, in declaration order.
    #[cfg(feature = "lab")]
    const FIELDS: &'static [(&'static str, usize)];
}

/// Declares a uniform struct and its [`Uniform`] layout table.
macro_rules! uniform_struct {
    ($(#[$m:meta])* pub struct $name:ident as $wgsl:literal {
        $($(#[$fm:meta])* pub $field:ident: $ty:ty,)*
    }) => {
        $(#[$m])*
        #[repr(C)]
        #[derive(Clone, Copy, Debug, Default, Pod, Zeroable)]
        pub struct $name {
            $($(#[$fm])* pub $field: $ty,)*
        }

        impl Uniform for $name {
            #[cfg(feature = "lab")]
            const WGSL_NAME: &'static str = $wgsl;
            #[cfg(feature = "lab")]
            const FIELDS: &'static [(&'static str, usize)] =
                &[$((stringify!($field), std::mem::offset_of!($name, $field)),)*];
        }
    };
}

uniform_struct! {
    /// The call parameters every attention kernel reads (binding 0).
    pub struct Params as "Params" {
        pub seqlen_q: u32,
        pub seqlen_k: u32,
        pub q_start: u32,
        pub k_start: u32,
        pub heads_q: u32,
        pub group: u32,
        pub q_row_stride: u32,
        pub kv_row_stride: u32,
        pub o_row_stride: u32,
        pub v_row_stride: u32,
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
        pub batch: u32,
        pub batch_start: u32,
        pub head_start: u32,
        pub seq_at: u32,
        pub alibi_at: u32,
        pub alibi_batch_stride: u32,
        pub sinks_at: u32,
        pub qtiles_at: u32,
        pub qtiles_entries: u32,
        pub qtiles_head_stride: u32,
        pub ktiles_at: u32,
        pub ktiles_entries: u32,
        pub ktiles_head_stride: u32,
        pub mask_at: u32,
        pub mask_bm: u32,
        pub mask_bn: u32,
        pub mask_cols: u32,
        pub mask_batch_stride: u32,
        pub mask_head_stride: u32,
        pub seq_count: u32,
        pub block_stride: u32,
        pub drop_key_lo: u32,
        pub drop_key_hi: u32,
        pub drop_stream_lo: u32,
        pub drop_stream_hi: u32,
        pub drop_threshold: u32,
        pub drop_scale: f32,
        pub drop_heads: u32,
        pub drop_row0: u32,
        pub drop_col0: u32,
        pub _pad0: u32,
        pub _pad1: u32,
    }
}

uniform_struct! {
    /// The parameters of the matmul kernels (binding 14).
    pub struct MatmulParams as "MatmulParams" {
        pub m: u32,
        pub n: u32,
        pub k: u32,
        pub lda: u32,
        pub ldb: u32,
        pub ldc: u32,
        pub a_batch: u32,
        pub a_head: u32,
        pub b_batch: u32,
        pub b_head: u32,
        pub c_batch: u32,
        pub c_head: u32,
        pub heads: u32,
        pub group: u32,
        pub alpha: f32,
        pub _pad: u32,
    }
}

uniform_struct! {
    /// The parameters of the decode kernels (binding 17), beside [`Params`].
    pub struct DecodeParams as "DecodeParams" {
        pub page_size: u32,
        pub max_pages: u32,
        pub keys_per_split: u32,
        pub num_splits: u32,
        pub group_rows: u32,
        pub row_blocks: u32,
        pub o_split_stride: u32,
        pub lse_split_stride: u32,
        pub seqlen_new: u32,
        pub groups_x: u32,
        pub pages_at: u32,
        pub heads_kv: u32,
        pub block_tokens: u32,
        pub blocks_per_page: u32,
        pub k_scales_at: u32,
        pub v_scales_at: u32,
        pub v_head_stride: u32,
        pub v_new_len: u32,
    }
}

uniform_struct! {
    /// The parameters of the copy kernel (binding 23).
    pub struct CopyParams as "CopyParams" {
        /// Items to write: vec4s (the copy) or elements (the rows).
        pub len: u32,
        pub groups_x: u32,
        /// Elements of a source and of a destination row (the rows only).
        pub src_row: u32,
        pub dst_row: u32,
    }
}

uniform_struct! {
    /// The parameters of the FP8 quantization kernels (binding 24).
    pub struct QuantParams as "QuantParams" {
        pub seqlen: u32,
        pub heads: u32,
        pub batch: u32,
        pub row_len: u32,
        pub scale_offset: u32,
        pub norm: f32,
        pub _pad0: u32,
        pub _pad1: u32,
    }
}

/// A piece of a problem as laid out in the buffers bound for one dispatch:
/// `local` sizes index the buffers; `q_start`/`k_start` place it in `full`,
/// the problem the masks are defined on (for a packed batch: in each
/// sequence); `batch_start`/`head_start` are its first batch entry and
/// query head there.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    pub local: AttentionShape,
    pub full: AttentionShape,
    pub q_start: usize,
    pub k_start: usize,
    pub batch_start: usize,
    pub head_start: usize,
}

impl Piece {
    pub fn whole(shape: AttentionShape) -> Self {
        Self {
            local: shape,
            full: shape,
            q_start: 0,
            k_start: 0,
            batch_start: 0,
            head_start: 0,
        }
    }
}

impl Params {
    /// The parameters of `piece` under `opts`, in the contiguous layouts.
    pub fn new(piece: &Piece, opts: &AttentionOptions) -> Result<Self> {
        let s = &piece.local;
        let (d, dv) = (s.head_dim, s.head_dim_v);
        let mask = opts.mask(&piece.full);
        // "Unbounded" becomes a bound past both ends of the sequences from
        // any row's diagonal (a shard's may sit far from its corner).
        let unbounded =
            piece.full.seqlen_q as i64 + piece.full.seqlen_k as i64 + mask.offset.abs() + 1;
        if unbounded > i32::MAX as i64 / 2 {
            return Err(Error::Overflow {
                what: "seqlen_q + seqlen_k + the band's offset (for 32-bit mask arithmetic)",
                value: unbounded as u64 - 1,
            });
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
            o_row_stride: to_u32("o row stride", s.heads_q * dv)?,
            v_row_stride: to_u32("v row stride", s.heads_kv * dv)?,
            q_batch_stride: to_u32("q batch stride", s.seqlen_q * s.heads_q * d)?,
            kv_batch_stride: to_u32("kv batch stride", s.seqlen_k * s.heads_kv * d)?,
            lse_batch_stride: to_u32("lse batch stride", s.heads_q * s.seqlen_q)?,
            lse_head_stride: to_u32("lse head stride", s.seqlen_q)?,
            block_offset: 0,
            mask_offset: mask.offset as i32,
            window_left: mask.left.unwrap_or(unbounded) as i32,
            window_right: mask.right.unwrap_or(unbounded) as i32,
            scale: opts.scale_for(d),
            softcap: opts.softcap_value(),
            batch: to_u32("batch", s.batch)?,
            batch_start: to_u32("batch start", piece.batch_start)?,
            head_start: to_u32("head start", piece.head_start)?,
            seq_count: to_u32("sequences", opts.varlen.as_ref().map_or(0, |v| v.batch()))?,
            block_stride: 1,
            ..Self::dropout(&piece.full, opts)?
        })
    }

    /// Dropout's fields (zero without): key, first stream, threshold, scale,
    /// the streams' stride per sequence and the shard's origin.
    fn dropout(full: &AttentionShape, opts: &AttentionOptions) -> Result<Self> {
        let d = &opts.dropout;
        if !d.is_active() {
            return Ok(Self::default());
        }
        let heads = full.heads_q;
        // The kernels add batch · heads_q + head to the 64-bit offset in u32.
        let streams = opts.batch_of(full) as u64 * heads as u64;
        if u32::try_from(streams).is_err() {
            return Err(Error::Overflow {
                what: "dropout's streams (sequences × heads_q)",
                value: streams,
            });
        }
        let [key_lo, key_hi] = d.key();
        let [stream_lo, stream_hi] = d.stream(0, 0, heads);
        let (row0, col0) = opts.positions.map_or((0, 0), |p| (p.q_offset, p.k_offset));
        Ok(Self {
            drop_key_lo: key_lo,
            drop_key_hi: key_hi,
            drop_stream_lo: stream_lo,
            drop_stream_hi: stream_hi,
            drop_threshold: d.threshold(),
            drop_scale: d.scale(),
            drop_heads: to_u32("heads_q", heads)?,
            drop_row0: to_u32("q_offset", row0)?,
            drop_col0: to_u32("k_offset", col0)?,
            ..Self::default()
        })
    }

    /// The parameters of a decoding step: the longest sequence sizes the
    /// unbounded window; each sequence's offset is computed in the kernel
    /// from its own key count, so `mask_offset` is 0.
    pub fn decode(p: &DecodeProblem, opts: &AttentionOptions) -> Result<Self> {
        let shape = p.widest_shape()?;
        Ok(Self {
            mask_offset: 0,
            kv_batch_stride: 0,
            ..Self::new(&Piece::whole(shape), opts)?
        })
    }

    /// These parameters for the dispatch whose first block is `offset`.
    pub fn at_block(&self, offset: u32) -> Self {
        Self {
            block_offset: offset,
            ..*self
        }
    }
}

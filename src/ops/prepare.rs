//! A call's pieces, ready to run: each one's parameters' placement
//! ([`Piece`]), its sequences as the kernels walk them, and where its rows
//! lie in the whole problem — for dense batches and packed ones alike —
//! plus the side tables a kernel variant reads.

use super::pieces::{LseLayout, PieceRows};
use crate::api::options::AttentionOptions;
use crate::api::problem::Problem;
use crate::api::shape::AttentionShape;
use crate::api::tile_lists::TileLists;
use crate::error::Result;
use crate::kernels::{Params, Piece, Sequences, SideTables, Walk};
use crate::plan::{split, split_packed, PieceLimits, PlanOverrides, PlanRequest, Split};

/// The planner's request for a call: a packed batch's tiles are sized by
/// its longest sequence, not its total.
pub fn plan_request(problem: &Problem, overrides: PlanOverrides) -> PlanRequest {
    let req = PlanRequest::for_shape(&problem.shape, problem.precision, overrides);
    let (q, k) = problem.longest;
    match problem.packed() {
        true => req.seqlens(q.max(1), k.max(1)),
        false => req,
    }
}

/// One piece of a call.
#[derive(Clone, Debug)]
pub struct Prepared {
    pub piece: Piece,
    pub rows: PieceRows,
    /// The piece is the whole problem (its buffers are the caller's tensors).
    pub whole: bool,
    packed: Option<Sequences>,
}

impl Prepared {
    /// The piece's sequences under its parameters `p`.
    pub fn sequences(&self, p: &Params) -> Sequences {
        self.packed.clone().unwrap_or_else(|| Sequences::dense(p))
    }

    /// The lse layout of the piece's buffers.
    pub fn lse_layout(&self) -> LseLayout {
        LseLayout::of(&self.piece.local)
    }
}

/// The pieces of `shape` under `opts` within `limits`.
pub fn pieces(
    shape: &AttentionShape,
    opts: &AttentionOptions,
    limits: &PieceLimits,
) -> Result<Vec<Prepared>> {
    let Some(v) = &opts.varlen else {
        let splits = split(shape, limits)?;
        let whole = splits.len() == 1;
        return Ok(splits.iter().map(|s| dense(shape, s, whole)).collect());
    };
    let splits = split_packed(shape, v.max_seqlens(), limits)?;
    let whole = splits.len() == 1;
    Ok(splits
        .iter()
        .map(|s| {
            let rows = PieceRows::packed(shape, v, s);
            let (nq, nk) = rows.lens();
            let local = AttentionShape {
                seqlen_q: nq,
                seqlen_k: nk,
                ..s.shape(shape)
            };
            Prepared {
                piece: placed(local, shape, s),
                packed: Some(rows.sequences(v)),
                rows,
                whole,
            }
        })
        .collect())
}

/// Dense piece `s`.
fn dense(shape: &AttentionShape, s: &Split, whole: bool) -> Prepared {
    Prepared {
        piece: placed(s.shape(shape), shape, s),
        rows: PieceRows::dense(shape, s),
        whole,
        packed: None,
    }
}

fn placed(local: AttentionShape, full: &AttentionShape, s: &Split) -> Piece {
    Piece {
        local,
        full: *full,
        q_start: s.rows.start,
        k_start: s.keys.start,
        batch_start: s.batch.start,
        head_start: s.q_heads(full).start,
    }
}

/// The side tables of a kernel variant under `opts`: `seqs`' prefix sums
/// (for blocks of `size`), slopes, sinks, and with a block mask the tile
/// lists of the walks `q` (by query blocks) and `k` (by key blocks).
pub fn side_tables<'a>(
    opts: &'a AttentionOptions,
    seqs: &Sequences,
    size: u32,
    q: Option<&Walk>,
    k: Option<&Walk>,
    heads: usize,
) -> SideTables<'a> {
    let lists = |w: Option<&Walk>| -> Option<TileLists> {
        w.filter(|w| w.mask.is_some()).map(|w| w.lists(heads))
    };
    SideTables {
        seqs: seqs.packed.then(|| seqs.table(size)),
        alibi: opts.alibi.as_ref(),
        sinks: opts.sinks.as_ref(),
        qtiles: lists(q),
        ktiles: lists(k),
        mask: opts.block_mask.as_ref(),
    }
}

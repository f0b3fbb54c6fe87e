//! The layout and score-term flags shared by forward, backward and decode:
//! `--alibi`, `--sinks`, `--block-mask` with `--block-size`, and
//! `--cu-seqlens-q` with `--cu-seqlens-k` — parsed before any file is read,
//! then their files read into the options.

use super::pair;
use crate::args::ScoreArgs;
use crate::error::{CliError, Result};
use crate::npy;
use flashattn::AttentionOptions;
use flashattn::BlockMask;
use flashattn::Varlen;
use flashattn::{Alibi, Sinks};

/// What the layout flags ask for, checked before any file is read.
#[derive(Clone, Copy, Debug, Default)]
pub struct LayoutFlags {
    /// `--block-size`, with `--block-mask`.
    pub block: Option<(usize, usize)>,
    /// `--cu-seqlens-q/-k`: q, k, v are packed.
    pub packed: bool,
}

/// Check that the flags that go together come together and parse `--block-size`.
pub fn flags(a: &ScoreArgs) -> Result<LayoutFlags> {
    if a.block_mask.is_some() != a.block_size.is_some() {
        let (given, missing) = if a.block_mask.is_some() {
            ("--block-mask", "--block-size")
        } else {
            ("--block-size", "--block-mask")
        };
        return Err(CliError::Pair { given, missing });
    }
    let packed = pair(
        (&a.cu_seqlens_q, "--cu-seqlens-q"),
        (&a.cu_seqlens_k, "--cu-seqlens-k"),
    )?
    .is_some();
    let block = a
        .block_size
        .as_deref()
        .map(|s| parse_block_size("--block-size", s))
        .transpose()?;
    Ok(LayoutFlags { block, packed })
}

/// Parse `BM,BN` (both at least 1) of `flag`.
pub fn parse_block_size(flag: &'static str, s: &str) -> Result<(usize, usize)> {
    let bad = || CliError::BadFlag {
        flag,
        expected: "BM,BN with both at least 1, such as 64,64",
        value: s.to_string(),
    };
    let (m, n) = s.split_once(',').ok_or_else(bad)?;
    let parse = |x: &str| x.trim().parse::<usize>().ok().filter(|&v| v >= 1);
    Ok((parse(m).ok_or_else(bad)?, parse(n).ok_or_else(bad)?))
}

/// `opts` with the slopes, sinks, block mask and packed batch of the files
/// the flags name (each validated against the problem by the library).
pub fn read(
    a: &ScoreArgs,
    flags: LayoutFlags,
    mut opts: AttentionOptions,
) -> Result<AttentionOptions> {
    if let Some(path) = &a.alibi {
        let (shape, slopes) = npy::read_f32("alibi slopes", path)?;
        rank_in(
            "alibi slopes",
            &shape,
            &[1, 2],
            "1 dim (heads_q,) or 2 (batch, heads_q)",
        )?;
        // With their shape: (heads_q,) or (batch, heads_q) exactly, not
        // another shape of the same count (checked against the problem).
        opts.alibi = Some(Alibi::shaped(&shape, &slopes)?);
    }
    if let Some(path) = &a.sinks {
        let (shape, logits) = npy::read_f32("sinks", path)?;
        rank_in("sinks", &shape, &[1], "1 dim (heads_q,)")?;
        opts.sinks = Some(Sinks::new(&logits));
    }
    if let (Some(path), Some(block)) = (&a.block_mask, flags.block) {
        let dims = "4 dims (mb, mh, ceil(seqlen_q/BM), ceil(seqlen_k/BN))";
        let (shape, data) = npy::read_mask("block mask", path, 4, dims)?;
        let dims = [shape[0], shape[1], shape[2], shape[3]];
        opts.block_mask = Some(BlockMask::new(dims, block, &data)?);
    }
    if let (Some(cq), Some(ck)) = (&a.cu_seqlens_q, &a.cu_seqlens_k) {
        let q = npy::read_index("cu_seqlens_q", cq, 1, "1 dim (batch + 1,)")?;
        let k = npy::read_index("cu_seqlens_k", ck, 1, "1 dim (batch + 1,)")?;
        opts.varlen = Some(Varlen::new(&q.data, &k.data)?);
    }
    Ok(opts)
}

/// `shape` must have one of `ranks`.
fn rank_in(
    what: &'static str,
    shape: &[usize],
    ranks: &[usize],
    expected: &'static str,
) -> Result<()> {
    if ranks.contains(&shape.len()) {
        return Ok(());
    }
    Err(CliError::Rank {
        what,
        rank: shape.len(),
        shape: shape.to_vec(),
        expected,
    })
}

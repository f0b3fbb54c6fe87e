//! What every CUDA kernel is told about a call: `Problem` (the C struct of
//! cuda/common.cuh; the run-time layouts are `Layout`, in layout.rs;
//! dropout's generator inputs are `DropoutArgs`), and the checks of what
//! the kernels support.

use super::kernel::{KernelKey, MAX_HEAD_DIM};
use super::plan::{plan, CudaPlan, DeviceProps, KernelPath, PlanProblem};
use crate::api::problem::Problem as Attention;
use crate::api::shape::AttentionShape;
use crate::api::tensor::Precision;
use crate::error::{Error, Result};
use cudarc::driver::{DeviceRepr, LaunchConfig};

/// What the errors of this backend name.
pub(crate) const WHAT: &str = "the CUDA backend";

/// `struct Problem` of cuda/common.cuh, field for field.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct Problem {
    seqlen_q: i32,
    seqlen_k: i32,
    heads_q: i32,
    heads_kv: i32,
    d: i32,
    scale: f32,
    softcap: f32,
    /// -1: unbounded.
    left: i32,
    right: i32,
    /// The diagonal's shift past the bottom-right one: shard positions'
    /// `q_offset − k_offset − (seqlen_k − seqlen_q)`, else 0.
    shift: i32,
}

// SAFETY: a plain #[repr(C)] struct of 4-byte scalars, the layout of the C one.
unsafe impl DeviceRepr for Problem {}

/// `struct Work` of cuda/flash_fwd_wgmma.cu: the persistent Hopper
/// forward's list of items, `m_blocks` query blocks × heads × `seqs`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Work {
    m_blocks: i32,
    seqs: i32,
    /// heads × seqs.
    groups: i32,
    /// m_blocks × groups.
    items: i32,
}

// SAFETY: a plain #[repr(C)] struct of four i32s, the layout of the C one.
unsafe impl DeviceRepr for Work {}

impl Problem {
    /// The softmax scale (dQ's factor, applied as the Hopper dQ is rounded).
    pub fn scale(&self) -> f32 {
        self.scale
    }

    /// The kernels' sizes and score options of `p` (its band clamped to
    /// its lengths, so the bounds fit i32). Decoding's takes k's head dim
    /// here and v's apart.
    pub(crate) fn of(p: &Attention) -> Result<Self> {
        let shape = p.shape;
        let mask = p.mask;
        // Offsets stay below Positions::MAX (2^29), lengths below 2^31.
        let shift = p.opts.positions.map_or(0, |pos| {
            pos.diagonal() - (shape.seqlen_k as i64 - shape.seqlen_q as i64)
        });
        // Bounds past both lengths and the shift act as none; clamping
        // keeps them in i32.
        let reach = (shape.seqlen_q + shape.seqlen_k) as i64 + shift.abs();
        let bound =
            |b: Option<i64>| b.map_or(Ok(-1), |b| to_i32("a window bound", b.min(reach) as usize));
        Ok(Self {
            seqlen_q: to_i32("seqlen_q", shape.seqlen_q)?,
            seqlen_k: to_i32("seqlen_k", shape.seqlen_k)?,
            heads_q: to_i32("heads_q", shape.heads_q)?,
            heads_kv: to_i32("heads_kv", shape.heads_kv)?,
            d: to_i32("head_dim", shape.head_dim)?,
            scale: p.scale,
            softcap: p.softcap,
            left: bound(mask.left)?,
            right: bound(mask.right)?,
            shift: i32::try_from(shift).map_err(|_| Error::PositionTooLarge {
                which: "the diagonal's shift (q_offset − k_offset − (seqlen_k − seqlen_q))",
                position: shift.unsigned_abs() as usize,
                max: i32::MAX as usize,
            })?,
        })
    }
}

/// `struct Dropout` of cuda/dropout.cuh, field for field: the last argument
/// of every attention kernel (read only by the dropout variants).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub(crate) struct DropoutArgs {
    /// The Philox key: the seed's low and high words.
    key: [u32; 2],
    /// The call's first stream (its offset), low and high words; sequence
    /// `b`, query head `h` draw stream `offset + b · heads_q + h`.
    stream: [u32; 2],
    /// Kept iff an element's 16 bits are at least this.
    threshold: u32,
    /// `1 / (1 − p)`.
    scale: f32,
}

// SAFETY: a plain #[repr(C)] struct of 4-byte scalars, the layout of the C one.
unsafe impl DeviceRepr for DropoutArgs {}

impl DropoutArgs {
    /// The generator's inputs of `d` (docs/dropout.md's mapping): the first
    /// stream is the offset, to which the kernels add `b · heads_q + h`.
    fn of(d: &crate::api::dropout::Dropout) -> Self {
        Self {
            key: d.key(),
            stream: d.stream(0, 0, 0),
            threshold: d.threshold(),
            scale: d.scale(),
        }
    }
}

fn to_i32(what: &'static str, value: usize) -> Result<i32> {
    i32::try_from(value).map_err(|_| Error::Overflow {
        what,
        value: value as u64,
    })
}

/// A problem the kernels take, and its kernel key for `family`.
pub(crate) struct Call {
    pub problem: Problem,
    pub shape: AttentionShape,
    pub precision: Precision,
    pub band: bool,
    pub softcap: bool,
    /// Dropout's inputs, and whether it is on (`p > 0`: the dropout variants).
    pub dropout_args: DropoutArgs,
    pub dropout: bool,
    /// Sequences (the grid's z: batch entries, or a packed batch's
    /// sequences) and the longest one's query rows and keys.
    pub seqs: usize,
    pub max_q: usize,
    pub max_k: usize,
}

impl Call {
    /// Validate a call for the CUDA kernels (every mask, score and layout
    /// option but a v head dim of its own, which is `Unsupported`). For a
    /// packed batch `shape` is its batch of one; `Problem`'s lengths are
    /// then the totals, which each block replaces by its sequence's.
    pub fn new(p: &Attention) -> Result<Self> {
        let (shape, precision) = (p.shape, p.precision);
        // Shard positions move the kernels' diagonal (Problem::shift); the
        // kernels draw dropout's bits at the call's own positions, not the
        // whole sequence's.
        if p.opts.positions.is_some() && p.opts.dropout.is_active() {
            return Err(Error::Unsupported {
                what: WHAT,
                feature: "dropout with shard positions",
            });
        }
        if shape.head_dim_v != shape.head_dim {
            return Err(Error::Unsupported {
                what: WHAT,
                feature: "a v head dim other than q's and k's",
            });
        }
        if shape.head_dim > MAX_HEAD_DIM {
            return Err(Error::HeadDimTooLarge {
                tensor: "q/k",
                head_dim: shape.head_dim,
                max: MAX_HEAD_DIM,
            });
        }
        // Elements past 2^31 would overflow the kernels' int row indices
        // before they are widened; the rows themselves are size_t.
        for (what, n) in [
            (
                "q's rows × heads",
                shape.batch * shape.seqlen_q * shape.heads_q,
            ),
            (
                "k's rows × heads",
                shape.batch * shape.seqlen_k * shape.heads_kv,
            ),
        ] {
            to_i32(what, n)?;
        }
        let softcap = p.softcap;
        let seqs = p.opts.varlen.as_ref().map_or(shape.batch, |v| v.batch());
        let (max_q, max_k) = p.longest;
        let problem = Problem::of(p)?;
        Ok(Self {
            problem,
            shape,
            precision,
            band: p.mask.is_active(),
            softcap: softcap > 0.0,
            dropout_args: DropoutArgs::of(&p.opts.dropout),
            dropout: p.opts.dropout.is_active(),
            seqs,
            max_q,
            max_k,
        })
    }

    /// The plan's facts of this call.
    pub fn plan_problem(&self) -> PlanProblem {
        PlanProblem {
            precision: self.precision,
            head_dim: self.shape.head_dim,
            band: self.band,
            softcap: self.softcap,
            positive_scale: self.problem.scale > 0.0,
            dropout: self.dropout,
        }
    }

    /// The forward and backward kernels of this call on `dev` under `path`.
    pub fn plan(&self, dev: &DeviceProps, path: KernelPath) -> Result<CudaPlan> {
        plan(dev, &self.plan_problem(), path)
    }

    /// One block per `key`'s tile of the longest sequence's query rows (or
    /// keys, `by_keys`), per head, per sequence (blocks past a shorter
    /// sequence's rows exit at once).
    pub fn launch(&self, key: &KernelKey, by_keys: bool, heads: usize) -> Result<LaunchConfig> {
        let rows = if by_keys { self.max_k } else { self.max_q };
        let t = key.tiles();
        let grid = |what, n: usize, max: u32| {
            u32::try_from(n)
                .ok()
                .filter(|&g| g <= max)
                .ok_or(Error::GridTooLarge {
                    what,
                    groups: n as u64,
                    max,
                })
        };
        Ok(LaunchConfig {
            grid_dim: (
                grid("row blocks", rows.div_ceil(t.rows).max(1), i32::MAX as u32)?,
                grid("heads", heads, 65535)?,
                grid("sequences", self.seqs.max(1), 65535)?,
            ),
            block_dim: (t.threads() as u32, 1, 1),
            shared_mem_bytes: key.dynamic_shared_bytes() as u32,
        })
    }

    /// A forward's launch: the persistent grid and its item list for the
    /// Hopper kernel, a block per tile of query rows for the others.
    pub fn forward_launch(&self, key: &KernelKey, sms: usize) -> Result<(LaunchConfig, Option<Work>)> {
        if key.family.is_wgmma() {
            let (cfg, work) = self.persistent_launch(key, sms)?;
            return Ok((cfg, Some(work)));
        }
        Ok((self.launch(key, false, self.shape.heads_q)?, None))
    }

    /// The persistent Hopper forward's launch: one block an SM (its launch
    /// bound and shared memory allow no second), never more blocks than
    /// items, and the item list the blocks share.
    pub fn persistent_launch(&self, key: &KernelKey, sms: usize) -> Result<(LaunchConfig, Work)> {
        let t = key.tiles();
        let (m_blocks, seqs) = (self.max_q.div_ceil(t.rows).max(1), self.seqs.max(1));
        let groups = self.shape.heads_q * seqs;
        // Every field divides `items`, so all fit i32 once it does.
        let items = (m_blocks as u64).saturating_mul(groups as u64);
        if items > i32::MAX as u64 {
            return Err(Error::GridTooLarge {
                what: "work items (query blocks × heads × sequences)",
                groups: items,
                max: i32::MAX as u32,
            });
        }
        let work = Work {
            m_blocks: m_blocks as i32,
            seqs: seqs as i32,
            groups: groups as i32,
            items: items as i32,
        };
        let cfg = LaunchConfig {
            grid_dim: (items.min(sms.max(1) as u64) as u32, 1, 1),
            block_dim: (t.threads() as u32, 1, 1),
            shared_mem_bytes: key.dynamic_shared_bytes() as u32,
        };
        Ok((cfg, work))
    }
}

#[cfg(test)]
mod tests {
    /// The C struct is ten 4-byte fields with no padding; a field added on
    /// one side only would shift every argument after it.
    #[test]
    fn problem_has_the_c_struct_layout() {
        assert_eq!(std::mem::size_of::<super::Problem>(), 10 * 4);
        assert_eq!(std::mem::align_of::<super::Problem>(), 4);
    }

    /// `struct Dropout` is six 4-byte fields; a call with dropout gets the
    /// seed's words, the offset's as the first stream, the 16-bit threshold
    /// and 1 / (1 − p), and the dropout variants (no layout for it).
    #[test]
    fn dropout_args_have_the_c_struct_layout_and_the_mapping() {
        use crate::api::options::AttentionOptions;
        use crate::api::shape::AttentionShape;
        use crate::api::tensor::Precision;
        assert_eq!(std::mem::size_of::<super::DropoutArgs>(), 6 * 4);
        let shape = AttentionShape::new(2, 9, 9, 4, 2, 40).unwrap();
        let opts = AttentionOptions::default()
            .dropout(0.1)
            .dropout_seed(0x0000_0007_0000_0009)
            .dropout_offset((1 << 32) + 3);
        let p = super::Attention::new(shape, Precision::Bf16, &opts).unwrap();
        let call = super::Call::new(&p).unwrap();
        let args = call.dropout_args;
        assert_eq!((args.key, args.stream, args.threshold), ([9, 7], [3, 1], 6554));
        assert_eq!(args.scale, opts.dropout.scale());
        assert!(call.dropout && call.plan_problem().dropout);
        let defaults = AttentionOptions::default();
        let none = super::Attention::new(shape, Precision::Bf16, &defaults).unwrap();
        let plain = super::Call::new(&none).unwrap();
        // Off: the variants without dropout, which never read the arguments.
        assert!(!plain.dropout && !plain.plan_problem().dropout);
    }

    /// The persistent Hopper forward: one block an SM, never more blocks
    /// than items (query blocks of the longest sequence × heads ×
    /// sequences), and the list's sizes in `Work`, four 4-byte fields.
    #[test]
    fn the_persistent_launch_has_a_block_an_sm_and_the_item_list() {
        use crate::api::options::AttentionOptions;
        use crate::api::shape::AttentionShape;
        use crate::api::tensor::Precision;
        use crate::cuda::kernel::{Family, KernelKey};
        assert_eq!(std::mem::size_of::<super::Work>(), 4 * 4);
        let key = KernelKey::new(Family::ForwardWgmma, Precision::Bf16, 128, true, false);
        let call = |seqlen, heads, batch| {
            let shape = AttentionShape::new(batch, seqlen, seqlen, heads, heads, 128).unwrap();
            let opts = AttentionOptions::default().causal(true);
            let p = super::Attention::new(shape, Precision::Bf16, &opts).unwrap();
            super::Call::new(&p).unwrap()
        };
        // 8k, 16 heads, 2 sequences: 64 × 32 = 2048 items over 132 SMs.
        let (cfg, work) = call(8192, 16, 2).persistent_launch(&key, 132).unwrap();
        assert_eq!((cfg.grid_dim, cfg.block_dim), ((132, 1, 1), (384, 1, 1)));
        assert_eq!(cfg.shared_mem_bytes as usize, key.dynamic_shared_bytes());
        let expect = super::Work {
            m_blocks: 64,
            seqs: 2,
            groups: 32,
            items: 2048,
        };
        assert_eq!(work, expect);
        // 200 rows, 3 heads, 1 sequence: 2 × 3 items, so 6 blocks.
        let (cfg, work) = call(200, 3, 1).persistent_launch(&key, 132).unwrap();
        assert_eq!((cfg.grid_dim.0, work.items, work.groups), (6, 6, 3));
    }

    /// Shard positions move the kernels' diagonal (row i's diagonal key i +
    /// seqlen_k − seqlen_q + shift) to `q_offset − k_offset`; with dropout
    /// (whose bits the kernels draw at the call's own positions) they are
    /// refused by name.
    #[test]
    fn shard_positions_move_the_diagonal_and_refuse_dropout() {
        use crate::api::options::AttentionOptions;
        use crate::api::shape::AttentionShape;
        use crate::api::tensor::Precision;
        use crate::error::Error;
        let shape = AttentionShape::new(1, 8, 13, 2, 2, 32).unwrap();
        let at = |q, k| {
            let opts = AttentionOptions::default().causal(true).positions(q, k);
            let p = super::Attention::new(shape, Precision::F16, &opts).unwrap();
            super::Call::new(&p).unwrap().problem.shift
        };
        // Diagonal q_offset − k_offset against the bottom-right 13 − 8 = 5.
        assert_eq!((at(8, 0), at(0, 8), at(5, 0)), (3, -13, 0));
        let plain = AttentionOptions::default().causal(true);
        let p = super::Attention::new(shape, Precision::F16, &plain).unwrap();
        assert_eq!(super::Call::new(&p).unwrap().problem.shift, 0);
        let opts = plain.positions(8, 0).dropout(0.1).dropout_seed(1);
        let p = super::Attention::new(shape, Precision::F16, &opts).unwrap();
        match super::Call::new(&p) {
            Err(Error::Unsupported { feature, .. }) => {
                assert_eq!(feature, "dropout with shard positions")
            }
            Err(other) => panic!("expected Unsupported, got {other:?}"),
            Ok(_) => panic!("expected Unsupported, got a call"),
        }
    }
}

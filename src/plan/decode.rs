//! The decode planner (FlashDecoding): pure functions from a decoding
//! problem and the device's limits to the decode kernel's tiles and to the
//! number of splits of the keys.
//!
//! Decoding has few query rows (the query heads of one GQA group × 1..16
//! tokens) and many keys. One workgroup takes the rows of one kv head, so
//! each K/V row is read once per group; with `batch × heads_kv` workgroups
//! too few to fill the device, the keys of each sequence are split across
//! workgroups, each writes a partial output with its LSE, and a merge pass
//! combines them exactly.

use super::caps::DeviceCaps;
use super::forward::{storage_kind, LANES_MAX_HEAD_DIM};
use super::request::{KernelFamily, PlanOverrides, PlanRequest, StorageKind};
use super::tiles::{record, round_up, Clamp, TARGET_WORKGROUP, WORKING_BYTES};
use crate::api::tensor::Precision;
use crate::error::{Error, Result};

/// Most packed query rows (heads of a group × tokens) one workgroup holds:
/// each invocation keeps a score per row and its share of each row's
/// output in registers. 16 covers the GQA groups models use, so K/V are
/// read once per group when one token is decoded. On lavapipe (Xeon, 2
/// cores, 64 query heads over 8 kv heads, d 128, 8k f16 cache) the lanes
/// kernel ran 2x faster holding a group's 8 rows than reading K/V twice
/// for blocks of 4.
pub const MAX_DECODE_ROWS: u32 = 16;
/// Fewest keys a split is given when the planner chooses: shorter splits
/// cost more in partial outputs and merging than they gain in parallelism.
pub const MIN_KEYS_PER_SPLIT: usize = 256;
/// Most splits the planner chooses (flash-attention's limit too).
pub const MAX_SPLITS: usize = 128;
/// Workgroups that fill a GPU, where the adapter cannot say: an H100 has
/// 132 SMs and runs several decode workgroups on each; 256 fills most
/// desktop GPUs too.
pub const GPU_PARALLEL_WORKGROUPS: usize = 256;

/// The decode kernel's shape: what its pipeline depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DecodeTiles {
    /// `flash_decode.wgsl` (workgroup memory, GPUs) or
    /// `flash_decode_lanes.wgsl` (one subgroup, CPU adapters).
    pub kernel: KernelFamily,
    /// The head dim of q and k.
    pub head_dim: u32,
    /// The head dim of v and o.
    pub head_dim_v: u32,
    /// How q, the cache and o are stored.
    pub storage: StorageKind,
    /// Packed query rows per workgroup.
    pub rows: u32,
    /// Invocations per workgroup, and keys per block (one key each); for
    /// the lanes kernel, the subgroup size.
    pub workgroup_size: u32,
    /// Bytes of `var<workgroup>` the kernel declares.
    pub workgroup_bytes: u32,
}

impl DecodeTiles {
    /// Output columns each invocation accumulates per row.
    pub fn acc_per_thread(&self) -> u32 {
        self.head_dim_v.div_ceil(self.workgroup_size)
    }

    /// vec4 chunks of each row (of q, and of v and o) a lane of the lanes
    /// kernel owns.
    pub fn chunks_per_lane(&self) -> u32 {
        (self.head_dim.max(self.head_dim_v) / 4).div_ceil(self.workgroup_size)
    }
}

/// How the keys of each sequence are cut: split `s` covers keys
/// `s · keys_per_split ..` of every sequence (empty where a sequence is short).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Splits {
    /// Splits per sequence (1: none).
    pub num_splits: usize,
    /// Keys each split covers (the last may cover fewer).
    pub keys_per_split: usize,
}

/// A decode plan and the reasons for its choices.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DecodePlan {
    /// The kernel's tiles.
    pub tiles: DecodeTiles,
    /// How the keys are split.
    pub splits: Splits,
    /// Workgroups per split: `batch × heads_kv × row blocks`.
    pub workgroups: usize,
    /// Where the planner moved a value, and why.
    pub clamps: Vec<Clamp>,
    /// Why this many splits, in words.
    pub reasons: Vec<String>,
}

/// The sizes a decode plan depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DecodeRequest {
    pub batch: usize,
    pub seqlen_q: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    /// v's (and o's) head dim.
    pub head_dim_v: usize,
    /// The longest sequence's keys (after the append).
    pub max_seqlen_k: usize,
    pub precision: Precision,
    /// `Some(n)`, n ≥ 1: use n splits (within whole blocks and
    /// [`MAX_SPLITS`]; raised where the loop limit needs more). `None` or
    /// `Some(0)`: the planner chooses.
    pub num_splits: Option<usize>,
    /// Force f16 storage packed (`false`) or native (`true`).
    pub f16_native: Option<bool>,
    /// Force the lanes kernel (`Lanes`: an error where it cannot run) or
    /// the workgroup-memory one (any other family); `None`: the lanes
    /// kernel where the adapter has it.
    pub kernel: Option<KernelFamily>,
}

impl DecodeRequest {
    /// Packed rows of one kv head: its group's query heads × the tokens.
    pub fn group_rows(&self) -> usize {
        self.heads_q / self.heads_kv.max(1) * self.seqlen_q
    }
}

/// What bounds the splits on one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SplitLimits {
    /// Workgroups (or CPU tasks) that fill the device.
    pub parallelism: usize,
    /// Most keys one split may walk (the adapter's loop limit).
    pub max_keys: usize,
    /// Largest storage binding, bytes (the partial outputs must fit one).
    pub max_binding: u64,
}

/// Plan the decode kernel for `req` on a device with `caps`.
pub fn plan_decode(
    req: &DecodeRequest,
    caps: &DeviceCaps,
    limits: &SplitLimits,
) -> Result<DecodePlan> {
    let tiles = decode_tiles(req, caps)?;
    let mut clamps = Vec::new();
    let wanted = req.group_rows().min(MAX_DECODE_ROWS as usize) as u32;
    let reason = match tiles.kernel {
        KernelFamily::Lanes => format!(
            "the lanes kernel (a CPU adapter's {}-lane subgroups) keeps at most {MAX_DECODE_ROWS} rows in registers",
            tiles.workgroup_size
        ),
        KernelFamily::Tiled | KernelFamily::Coop | KernelFamily::Registers => format!(
            "{} bytes of workgroup storage hold q and P for {} rows at d {}",
            caps.max_workgroup_storage, tiles.rows, req.head_dim
        ),
    };
    record(&mut clamps, "rows", wanted, tiles.rows, reason);
    let row_blocks = req.group_rows().div_ceil(tiles.rows as usize);
    let workgroups = req.batch * req.heads_kv * row_blocks;
    let partial_bytes = (req.batch * req.heads_q * req.seqlen_q * req.head_dim_v * 4) as u64;
    let (splits, reasons) = plan_splits(
        req,
        tiles.workgroup_size as usize,
        workgroups,
        partial_bytes,
        limits,
    )?;
    Ok(DecodePlan {
        tiles,
        splits,
        workgroups,
        clamps,
        reasons,
    })
}

/// The decode kernel's tiles: one key per invocation and as many packed rows
/// as the workgroup storage holds (q rows, their P rows, per-row state).
pub fn decode_tiles(req: &DecodeRequest, caps: &DeviceCaps) -> Result<DecodeTiles> {
    let (d, dv) = (req.head_dim as u32, req.head_dim_v as u32);
    let plan_req = PlanRequest::new(req.head_dim, req.precision).overrides(PlanOverrides {
        f16_native: req.f16_native,
        ..Default::default()
    });
    let storage = storage_kind(&plan_req, caps)?;
    let group_rows = req.group_rows().max(1);
    let lanes_dim = [d, dv]
        .iter()
        .all(|&x| x.is_multiple_of(4) && x as usize <= LANES_MAX_HEAD_DIM);
    let lanes = caps
        .lane_subgroup
        .filter(|_| lanes_dim && matches!(req.kernel, None | Some(KernelFamily::Lanes)));
    match (req.kernel, caps.lane_subgroup) {
        (Some(KernelFamily::Lanes), None) => return Err(Error::LanesUnavailable),
        (Some(KernelFamily::Lanes), Some(_)) if !lanes_dim => {
            return Err(Error::LanesHeadDim {
                head_dim: if d.is_multiple_of(4) && d as usize <= LANES_MAX_HEAD_DIM {
                    req.head_dim_v
                } else {
                    req.head_dim
                },
                max: LANES_MAX_HEAD_DIM,
            })
        }
        _ => {}
    }
    if let Some(sg) = lanes {
        return Ok(DecodeTiles {
            kernel: KernelFamily::Lanes,
            head_dim: d,
            head_dim_v: dv,
            storage,
            rows: group_rows.min(MAX_DECODE_ROWS as usize) as u32,
            workgroup_size: sg,
            workgroup_bytes: 0,
        });
    }
    let wg = TARGET_WORKGROUP.min(caps.max_workgroup());
    let wanted = group_rows.min(MAX_DECODE_ROWS as usize) as u32;
    let rows = (1..=wanted)
        .rev()
        .find(|&r| decode_workgroup_bytes(r, wg, d) <= caps.max_workgroup_storage)
        .ok_or(Error::WorkgroupStorage {
            br: 1,
            bc: wg,
            head_dim: d,
            bytes: decode_workgroup_bytes(1, wg, d),
            max: caps.max_workgroup_storage,
        })?;
    Ok(DecodeTiles {
        kernel: KernelFamily::Tiled,
        head_dim: d,
        head_dim_v: dv,
        storage,
        rows,
        workgroup_size: wg,
        workgroup_bytes: decode_workgroup_bytes(rows, wg, d),
    })
}

/// Workgroup bytes of the decode kernel: q (rows × d), P (rows × keys per
/// block), three f32 per row (m, l, rescale) and a cache row per key.
pub fn decode_workgroup_bytes(rows: u32, wg: u32, d: u32) -> u32 {
    WORKING_BYTES * (rows * d + rows * wg + 3 * rows + wg)
}

/// How many splits, and why. `step` is the kernel's keys per block (splits
/// are whole blocks), `workgroups` the workgroups of one split,
/// `partial_bytes` the partial outputs of one split. A request is honoured
/// within whole blocks and [`MAX_SPLITS`] (what the merge combines); the
/// loop limit may raise it, and a step that needs more than [`MAX_SPLITS`]
/// splits to stay within the loop limit is an error.
pub fn plan_splits(
    req: &DecodeRequest,
    step: usize,
    workgroups: usize,
    partial_bytes: u64,
    limits: &SplitLimits,
) -> Result<(Splits, Vec<String>)> {
    let keys = req.max_seqlen_k.max(1);
    let blocks = keys.div_ceil(step);
    let mut reasons = Vec::new();
    let mut n = wanted_splits(req, workgroups, limits, &mut reasons);
    if n > blocks {
        reasons.push(format!(
            "{n} splits -> {blocks}: {keys} keys are {blocks} blocks of {step}"
        ));
        n = blocks;
    }
    if n > MAX_SPLITS {
        reasons.push(format!(
            "{n} splits -> {MAX_SPLITS}: the merge combines at most {MAX_SPLITS}"
        ));
        n = MAX_SPLITS;
    }
    // The partials of every split must fit one storage binding.
    let fit = (limits.max_binding / partial_bytes.max(1)).clamp(1, MAX_SPLITS as u64) as usize;
    if n > fit {
        reasons.push(format!(
            "{n} splits -> {fit}: the partial outputs of more would not fit one storage binding"
        ));
        n = fit;
    }
    let needed = keys.div_ceil(limits.max_keys.max(1));
    if needed > MAX_SPLITS {
        return Err(Error::TooManySplits {
            keys,
            needed,
            max_keys: limits.max_keys,
            max: MAX_SPLITS,
        });
    }
    if needed > fit && needed > 1 {
        return Err(Error::BindingTooLarge {
            what: "the partial outputs of the splits the loop limit needs",
            bytes: partial_bytes * needed as u64,
            max: limits.max_binding,
        });
    }
    if needed > n {
        reasons.push(format!(
            "{n} splits -> {needed}: the adapter's loop limit lets one workgroup walk at most {} keys",
            limits.max_keys
        ));
        n = needed;
    }
    let keys_per_split = round_up(keys.div_ceil(n), step as u32) as usize;
    let n = keys.div_ceil(keys_per_split);
    reasons.push(format!("{n} splits of {keys_per_split} keys"));
    Ok((
        Splits {
            num_splits: n,
            keys_per_split,
        },
        reasons,
    ))
}

/// The splits asked for (`num_splits`), or the planner's: enough to fill
/// the device, each at least [`MIN_KEYS_PER_SPLIT`] keys, at most
/// [`MAX_SPLITS`].
fn wanted_splits(
    req: &DecodeRequest,
    workgroups: usize,
    limits: &SplitLimits,
    reasons: &mut Vec<String>,
) -> usize {
    if let Some(n) = req.num_splits.filter(|&n| n > 0) {
        reasons.push(format!("{n} splits requested"));
        return n;
    }
    let keys = req.max_seqlen_k.max(1);
    let fill = limits.parallelism.div_ceil(workgroups.max(1)).max(1);
    let by_keys = (keys / MIN_KEYS_PER_SPLIT).max(1);
    let n = fill.min(by_keys).min(MAX_SPLITS);
    reasons.push(format!(
        "{workgroups} workgroups per split, {} fill the device: {fill} splits wanted",
        limits.parallelism
    ));
    if n < fill {
        reasons.push(format!(
            "at most {} splits: {keys} keys, at least {MIN_KEYS_PER_SPLIT} each, at most {MAX_SPLITS} splits",
            by_keys.min(MAX_SPLITS)
        ));
    }
    n
}

impl std::fmt::Display for DecodePlan {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let t = &self.tiles;
        writeln!(
            f,
            "decode plan: {} kernel, {} packed rows per workgroup, {} invocations (one key each per block), \
             {} bytes of workgroup storage; storage {}",
            t.kernel.name(),
            t.rows,
            t.workgroup_size,
            t.workgroup_bytes,
            t.storage.name()
        )?;
        writeln!(
            f,
            "splits: {} of {} keys; {} workgroups per split",
            self.splits.num_splits, self.splits.keys_per_split, self.workgroups
        )?;
        write!(f, "why:")?;
        for r in &self.reasons {
            write!(f, "\n  - {r}")?;
        }
        for c in &self.clamps {
            write!(f, "\n  - {c}")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lavapipe's limits without its lanes kernels (the GPUs' tiled kernel).
    fn lavapipe_tiled() -> DeviceCaps {
        DeviceCaps {
            lane_subgroup: None,
            subgroup: None,
            ..DeviceCaps::lavapipe()
        }
    }

    #[test]
    fn cpu_adapters_run_the_lanes_kernel_where_it_fits() {
        let caps = DeviceCaps {
            lane_subgroup: Some(8),
            ..lavapipe_tiled()
        };
        let p = plan_decode(&request(64, 8, 128, 8192), &caps, &limits(2, 1 << 20)).unwrap();
        assert_eq!(p.tiles.kernel, KernelFamily::Lanes);
        assert_eq!(
            (
                p.tiles.rows,
                p.tiles.workgroup_size,
                p.tiles.workgroup_bytes
            ),
            (8, 8, 0)
        );
        assert_eq!(p.tiles.chunks_per_lane(), 4);
        let wide = plan_decode(&request(64, 8, 256, 8192), &caps, &limits(2, 1 << 20)).unwrap();
        assert_eq!(wide.tiles.kernel, KernelFamily::Tiled);
        let odd = plan_decode(&request(64, 8, 59, 8192), &caps, &limits(2, 1 << 20)).unwrap();
        assert_eq!(odd.tiles.kernel, KernelFamily::Tiled);
        // Forced: the workgroup-memory kernel on a lanes adapter (what a
        // failed lanes check falls back to), or lanes where it cannot run.
        let tiled = DecodeRequest {
            kernel: Some(KernelFamily::Tiled),
            ..request(64, 8, 128, 8192)
        };
        let p = plan_decode(&tiled, &caps, &limits(2, 1 << 20)).unwrap();
        assert_eq!(p.tiles.kernel, KernelFamily::Tiled);
        let lanes = |d| DecodeRequest {
            kernel: Some(KernelFamily::Lanes),
            ..request(64, 8, d, 8192)
        };
        assert!(matches!(
            plan_decode(&lanes(59), &caps, &limits(2, 1 << 20)),
            Err(Error::LanesHeadDim { head_dim: 59, .. })
        ));
        assert!(matches!(
            plan_decode(&lanes(64), &lavapipe_tiled(), &limits(2, 1 << 20)),
            Err(Error::LanesUnavailable)
        ));
    }

    fn request(heads_q: usize, heads_kv: usize, d: usize, keys: usize) -> DecodeRequest {
        DecodeRequest {
            batch: 1,
            seqlen_q: 1,
            heads_q,
            heads_kv,
            head_dim: d,
            head_dim_v: d,
            max_seqlen_k: keys,
            precision: Precision::F16,
            num_splits: None,
            f16_native: Some(false),
            kernel: None,
        }
    }

    fn limits(parallelism: usize, max_keys: usize) -> SplitLimits {
        SplitLimits {
            parallelism,
            max_keys,
            max_binding: 1 << 30,
        }
    }

    #[test]
    fn a_gqa_group_is_one_workgroup() {
        let p = plan_decode(
            &request(32, 8, 128, 8192),
            &lavapipe_tiled(),
            &limits(2, 1 << 20),
        )
        .unwrap();
        assert_eq!(p.tiles.rows, 4);
        assert_eq!(p.tiles.workgroup_size, 64);
        assert_eq!(p.tiles.workgroup_bytes, 4 * (4 * 128 + 4 * 64 + 3 * 4 + 64));
        assert_eq!(p.workgroups, 8);
        assert!(p.clamps.is_empty());
    }

    #[test]
    fn rows_shrink_to_the_workgroup_storage() {
        let mut req = request(16, 1, 256, 100);
        req.seqlen_q = 4;
        let p = plan_decode(&req, &DeviceCaps::webgpu_default(), &limits(256, 1 << 20)).unwrap();
        assert!(p.tiles.workgroup_bytes <= 16384);
        assert_eq!(p.tiles.rows, 12);
        assert_eq!(p.workgroups, 6, "64 packed rows in blocks of 12");
        assert_eq!(p.clamps.len(), 1);
        assert_eq!((p.clamps[0].from, p.clamps[0].to), (16, 12));
    }

    #[test]
    fn splits_fill_the_device_but_stay_long() {
        let caps = lavapipe_tiled();
        let gpu = plan_decode(&request(32, 8, 128, 8192), &caps, &limits(256, 1 << 20)).unwrap();
        assert_eq!(gpu.splits.num_splits, 32, "{gpu}");
        assert_eq!(gpu.splits.keys_per_split, 256);
        let short = plan_decode(&request(32, 8, 128, 600), &caps, &limits(256, 1 << 20)).unwrap();
        assert_eq!(
            short.splits.num_splits, 2,
            "at least {MIN_KEYS_PER_SPLIT} keys each"
        );
        let cpu = plan_decode(&request(32, 8, 128, 8192), &caps, &limits(2, 1 << 20)).unwrap();
        assert_eq!(
            cpu.splits.num_splits, 1,
            "8 workgroups already fill 2 cores"
        );
        assert_eq!(cpu.splits.keys_per_split, 8192);
    }

    #[test]
    fn the_loop_limit_raises_any_split_count() {
        let mut req = request(8, 1, 64, 8192);
        req.num_splits = Some(1);
        let p = plan_decode(&req, &lavapipe_tiled(), &limits(2, 3000)).unwrap();
        assert_eq!(p.splits.num_splits, 3);
        assert!(p.splits.keys_per_split <= 3000 && p.splits.keys_per_split.is_multiple_of(64));
        assert!(p.reasons.iter().any(|r| r.contains("loop limit")), "{p}");
        let far = request(8, 1, 64, 1 << 30);
        let err = plan_decode(&far, &lavapipe_tiled(), &limits(2, 3000)).unwrap_err();
        assert!(matches!(err, Error::TooManySplits { .. }), "{err}");
    }

    #[test]
    fn requested_splits_are_whole_blocks_and_at_most_the_merges() {
        let mut req = request(8, 1, 64, 100);
        req.num_splits = Some(64);
        let p = plan_decode(&req, &lavapipe_tiled(), &limits(2, 1 << 20)).unwrap();
        assert_eq!((p.splits.num_splits, p.splits.keys_per_split), (2, 64));
        req.max_seqlen_k = 1 << 20;
        req.num_splits = Some(1000);
        let p = plan_decode(&req, &lavapipe_tiled(), &limits(2, 1 << 30)).unwrap();
        assert_eq!(p.splits.num_splits, MAX_SPLITS);
        req.num_splits = Some(3);
        req.max_seqlen_k = 3000;
        let p = plan_decode(&req, &lavapipe_tiled(), &limits(2, 1 << 20)).unwrap();
        assert_eq!((p.splits.num_splits, p.splits.keys_per_split), (3, 1024));
    }

    #[test]
    fn partials_must_fit_one_binding() {
        // 64 KiB of partials per split; 1 MiB holds 16 splits.
        let req = request(64, 8, 256, 1 << 16);
        let tight = SplitLimits {
            max_binding: 1 << 20,
            ..limits(256, 1 << 20)
        };
        let p = plan_decode(&req, &lavapipe_tiled(), &tight).unwrap();
        assert_eq!(p.splits.num_splits, 16, "{p}");
        let err = plan_decode(
            &req,
            &lavapipe_tiled(),
            &SplitLimits {
                max_keys: 1024,
                ..tight
            },
        )
        .unwrap_err();
        assert!(matches!(err, Error::BindingTooLarge { .. }), "{err}");
    }
}

//! The autotuner's disk cache: `tuned-plans.tsv` beside `auto`'s
//! measurements (same directory, same tab-separated, append-only format,
//! the last line for a key wins). A line is the key — adapter, backend,
//! driver, driver info, flashattn version, pass, head dims, precision, mask
//! kind and a sequence-length bucket — then the winner's overrides as
//! `name=value` words (`formula` for none), then a note (its label, plan
//! and time). A missing, unreadable or malformed entry reads as no entry:
//! the formula plan runs.

use crate::api::options::AttentionOptions;
use crate::api::shape::AttentionShape;
use crate::api::tensor::Precision;
use crate::disk_cache::{cache_dir, Entry, Table};
use crate::error::{Error, Result};
use crate::plan::{KernelFamily, Pass, PlanOverrides};
use std::path::Path;

/// The cache file's name in the cache directory.
pub const FILE_NAME: &str = "tuned-plans.tsv";

/// Where the autotuner keeps its winners.
#[derive(Clone, Debug)]
pub struct TuneCache {
    file: Table,
}

/// A cached winner: what to hand the planner, and a note on how it won.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Tuned {
    /// The overrides that give the winning plan.
    pub overrides: PlanOverrides,
    /// How it won (times, candidates), for people.
    pub note: String,
}

impl TuneCache {
    /// `tuned-plans.tsv` in `$FLASHATTN_CACHE_DIR`, else
    /// `$XDG_CACHE_HOME/flashattn`, else `~/.cache/flashattn`; `None` where
    /// none is set.
    pub fn default_location() -> Option<TuneCache> {
        Some(TuneCache::in_dir(&cache_dir()?))
    }

    /// The cache file in `dir`.
    pub fn in_dir(dir: &Path) -> TuneCache {
        TuneCache {
            file: Table::at(dir.join(FILE_NAME)),
        }
    }

    /// The cache file.
    pub fn path(&self) -> &Path {
        self.file.path()
    }

    /// The last winner stored under `key`, if it reads back.
    pub fn get(&self, key: &TuneKey) -> Option<Tuned> {
        let hit = self.file.get(&key.to_string())?;
        Some(Tuned {
            overrides: parse_overrides(&hit.value)?,
            note: hit.note,
        })
    }

    /// Store a winner under `key`.
    pub fn put(&self, key: &TuneKey, tuned: &Tuned) -> Result<()> {
        let entry = Entry {
            value: overrides_text(&tuned.overrides),
            note: tuned.note.clone(),
        };
        self.file
            .put(&key.to_string(), &entry)
            .map_err(|source| Error::TuneCacheWrite {
                path: self.path().to_path_buf(),
                source,
            })
    }
}

/// The masks a tuned plan is kept for; other options (windows, softcap,
/// ALiBi, sinks, block masks, packed batches) run the formula plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum MaskKind {
    /// No mask.
    None,
    /// The causal mask.
    Causal,
}

impl MaskKind {
    /// The kind of `opts`, where the tuner covers them.
    pub fn of(opts: &AttentionOptions) -> Option<MaskKind> {
        let plain = opts.window.left.is_none()
            && opts.window.right.is_none()
            && opts.softcap_value() == 0.0
            && opts.alibi.is_none()
            && opts.sinks.is_none()
            && opts.block_mask.is_none()
            && opts.varlen.is_none();
        plain.then_some(if opts.causal {
            MaskKind::Causal
        } else {
            MaskKind::None
        })
    }

    /// The name in cache files.
    pub fn name(self) -> &'static str {
        match self {
            MaskKind::None => "none",
            MaskKind::Causal => "causal",
        }
    }
}

/// What a tuned plan is kept for: the device and build, and the problem
/// class (sequence lengths by power-of-two bucket).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TuneKey {
    /// The adapter's name.
    pub adapter: String,
    /// The wgpu backend (Vulkan, Metal, ...).
    pub backend: String,
    /// The driver's name.
    pub driver: String,
    /// The driver's version.
    pub driver_info: String,
    /// flashattn's version.
    pub version: &'static str,
    /// Which pass.
    pub pass: Pass,
    /// The head dim of q and k.
    pub head_dim: usize,
    /// The head dim of v and o.
    pub head_dim_v: usize,
    /// The storage precision.
    pub precision: Precision,
    /// The mask.
    pub mask: MaskKind,
    /// The longer sequence rounded up to a power of two.
    pub seqlen_bucket: usize,
}

impl TuneKey {
    /// The key of `pass` over `shape` on the adapter `info` describes.
    pub fn new(
        info: &wgpu::AdapterInfo,
        pass: Pass,
        shape: &AttentionShape,
        precision: Precision,
        mask: MaskKind,
    ) -> TuneKey {
        TuneKey {
            adapter: info.name.clone(),
            backend: format!("{:?}", info.backend),
            driver: info.driver.clone(),
            driver_info: info.driver_info.clone(),
            version: env!("CARGO_PKG_VERSION"),
            pass,
            head_dim: shape.head_dim,
            head_dim_v: shape.head_dim_v,
            precision,
            mask,
            seqlen_bucket: seqlen_bucket(shape.seqlen_q, shape.seqlen_k),
        }
    }
}

impl std::fmt::Display for TuneKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} | {} | {} | {} | flashattn {}; {} d {} dv {} {} mask {} seqlen<={}",
            self.adapter,
            self.backend,
            self.driver,
            self.driver_info,
            self.version,
            self.pass.name(),
            self.head_dim,
            self.head_dim_v,
            self.precision,
            self.mask.name(),
            self.seqlen_bucket
        )
    }
}

/// The longer of two sequence lengths rounded up to a power of two.
pub fn seqlen_bucket(seqlen_q: usize, seqlen_k: usize) -> usize {
    seqlen_q
        .max(seqlen_k)
        .max(1)
        .checked_next_power_of_two()
        .unwrap_or(usize::MAX)
}

/// Overrides as `name=value` words; `formula` for none.
pub fn overrides_text(o: &PlanOverrides) -> String {
    let words: Vec<String> = [
        o.kernel.map(|k| format!("kernel={}", k.name())),
        o.br.map(|v| format!("br={v}")),
        o.bc.map(|v| format!("bc={v}")),
        o.threads_per_row.map(|v| format!("threads_per_row={v}")),
        o.max_workgroup_storage
            .map(|v| format!("max_workgroup_storage={v}")),
        o.f16_native.map(|v| format!("f16_native={v}")),
        o.rows_per_thread.map(|v| format!("rows_per_thread={v}")),
        o.subgroup_reduce.map(|v| format!("subgroup_reduce={v}")),
        o.double_buffer.map(|v| format!("double_buffer={v}")),
    ]
    .into_iter()
    .flatten()
    .collect();
    if words.is_empty() {
        "formula".into()
    } else {
        words.join(" ")
    }
}

/// The overrides [`overrides_text`] wrote; `None` for anything else.
pub fn parse_overrides(text: &str) -> Option<PlanOverrides> {
    let mut o = PlanOverrides::default();
    if text.trim() == "formula" {
        return Some(o);
    }
    for word in text.split_whitespace() {
        let (name, value) = word.split_once('=')?;
        match name {
            "kernel" => o.kernel = Some(value.parse::<KernelFamily>().ok()?),
            "br" => o.br = Some(value.parse().ok()?),
            "bc" => o.bc = Some(value.parse().ok()?),
            "threads_per_row" => o.threads_per_row = Some(value.parse().ok()?),
            "max_workgroup_storage" => o.max_workgroup_storage = Some(value.parse().ok()?),
            "f16_native" => o.f16_native = Some(value.parse().ok()?),
            "rows_per_thread" => o.rows_per_thread = Some(value.parse().ok()?),
            "subgroup_reduce" => o.subgroup_reduce = Some(value.parse().ok()?),
            "double_buffer" => o.double_buffer = Some(value.parse().ok()?),
            _ => return None,
        }
    }
    (o != PlanOverrides::default()).then_some(o)
}

#[cfg(test)]
mod tests;

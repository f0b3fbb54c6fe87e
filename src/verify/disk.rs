//! Verdicts kept between processes: one line per (device, flashattn
//! version, family) in `verified.tsv` of flashattn's cache directory, in
//! a [`Table`] of the cache directory (key, verdict, and
//! the worst output with the check's seconds; the last line for a key
//! wins). A missing, unreadable or unwritable file only means checking
//! again.

use super::key::DeviceKey;
use super::verdict::{Evidence, FamilyKey, Verdict};
use crate::disk_cache::{cache_dir, Entry, Table};
use std::path::Path;

/// The verdict cache's file name in the cache directory.
pub const FILE: &str = "verified.tsv";

/// Where verdicts are kept, and the flashattn version they are keyed by.
#[derive(Clone, Debug)]
pub struct VerdictCache {
    file: Table,
    version: String,
}

impl VerdictCache {
    /// `verified.tsv` in `$FLASHATTN_CACHE_DIR`, else
    /// `$XDG_CACHE_HOME/flashattn`, else `~/.cache/flashattn`; `None`
    /// where none is set.
    pub fn default_location() -> Option<Self> {
        Some(Self::in_dir(&cache_dir()?))
    }

    /// The cache in `dir`, keyed by this build's version.
    pub fn in_dir(dir: &Path) -> Self {
        Self {
            file: Table::at(dir.join(FILE)),
            version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }

    /// The same file keyed by another flashattn version: verdicts of other
    /// versions are never read (a new version checks again).
    pub fn with_version(self, version: &str) -> Self {
        Self {
            version: version.to_string(),
            ..self
        }
    }

    /// The file verdicts are kept in.
    pub fn path(&self) -> &Path {
        self.file.path()
    }

    /// The flashattn version verdicts are keyed by.
    pub fn version(&self) -> &str {
        &self.version
    }

    fn key(&self, device: &DeviceKey, family: &FamilyKey) -> String {
        format!(
            "{}; flashattn {}; {}",
            device.text(),
            self.version,
            family.cache_text()
        )
    }

    /// The verdict stored for `family` on `device` under this version.
    pub fn get(&self, device: &DeviceKey, family: &FamilyKey) -> Option<Verdict> {
        let hit = self.file.get(&self.key(device, family))?;
        // The reason is the detail, then the check's seconds in brackets.
        let (detail, seconds) = match hit.note.rsplit_once(" [") {
            Some((d, s)) => (d, s.trim_end_matches(" s]").parse().unwrap_or(0.0)),
            None => (hit.note.as_str(), 0.0),
        };
        let evidence = Evidence {
            detail: detail.to_string(),
            seconds,
            cached: true,
        };
        match hit.value.as_str() {
            "verified" => Some(Verdict::Verified(evidence)),
            "failed" => Some(Verdict::Failed(evidence)),
            _ => None,
        }
    }

    /// Store a verified or failed verdict (others are not kept).
    pub fn put(
        &self,
        device: &DeviceKey,
        family: &FamilyKey,
        verdict: &Verdict,
    ) -> std::io::Result<()> {
        let Some(evidence) = verdict.evidence() else {
            return Ok(());
        };
        let entry = Entry {
            value: verdict.word().to_string(),
            note: format!("{} [{:.3} s]", evidence.detail, evidence.seconds),
        };
        self.file.put(&self.key(device, family), &entry)
    }
}

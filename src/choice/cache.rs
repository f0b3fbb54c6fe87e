//! The disk cache of `auto`'s measurements: one line per (machine, problem
//! class) — the software adapters and their drivers, the CPU model, and
//! what decides the kernels' speed (head dim, precision, masks, softcap,
//! GQA group, the slice's size, forward or backward) — naming the winner
//! and the reason measured then. A later call with the same key takes the
//! winner without timing again. A missing, unreadable or unwritable cache
//! only means measuring again.

use crate::disk_cache::{cache_dir, Entry, Table};
use std::path::Path;

/// Where `auto` keeps its measurements: `auto-backend.tsv`, a
/// table whose entries are the winner's id and the reason measured then.
#[derive(Clone, Debug)]
pub struct ProbeCache {
    table: Table,
}

impl ProbeCache {
    /// `auto-backend.tsv` in flashattn's cache directory; `None` where it has none.
    pub fn default_location() -> Option<ProbeCache> {
        Some(ProbeCache::in_dir(&cache_dir()?))
    }

    /// The cache file in `dir`.
    pub fn in_dir(dir: &Path) -> ProbeCache {
        ProbeCache {
            table: Table::at(dir.join("auto-backend.tsv")),
        }
    }

    /// The file the measurements are kept in.
    pub fn path(&self) -> &Path {
        self.table.path()
    }

    /// The last decision stored under `key`: the winner's id and the reason.
    pub fn get(&self, key: &str) -> Option<Entry> {
        self.table.get(key)
    }

    /// Store a decision under `key` (appended: the last line wins).
    pub fn put(&self, key: &str, entry: &Entry) -> std::io::Result<()> {
        self.table.put(key, entry)
    }
}

/// The CPU's model name (`/proc/cpuinfo` on Linux), else the architecture.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split(':').nth(1))
                .map(|m| m.trim().to_string())
        })
        .unwrap_or_else(|| std::env::consts::ARCH.to_string())
}

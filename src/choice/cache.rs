//! The disk cache of `auto`'s measurements: one line per (machine, problem
//! class) — the software adapters and their drivers, the CPU model, and
//! what decides the kernels' speed (head dim, precision, masks, softcap,
//! GQA group, the slice's size, forward or backward) — naming the winner
//! and the reason measured then. A later call with the same key takes the
//! winner without timing again. A missing, unreadable or unwritable cache
//! only means measuring again.

use std::path::{Path, PathBuf};

/// Where `auto` keeps its measurements.
#[derive(Clone, Debug)]
pub struct ProbeCache {
    file: PathBuf,
}

/// A cached decision: the winner's id and the reason measured then.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Cached {
    pub winner: String,
    pub reason: String,
}

impl ProbeCache {
    /// `$FLASHATTN_CACHE_DIR`, else `$XDG_CACHE_HOME/flashattn`, else
    /// `~/.cache/flashattn`; `None` where none of them is set.
    pub fn default_location() -> Option<ProbeCache> {
        Some(ProbeCache::in_dir(&cache_dir()?))
    }

    /// The cache file in `dir`.
    pub fn in_dir(dir: &Path) -> ProbeCache {
        ProbeCache::at(dir.join("auto-backend.tsv"))
    }

    /// A cache of the same format in `file` (the autotuner's winners).
    pub fn at(file: PathBuf) -> ProbeCache {
        ProbeCache { file }
    }

    pub fn path(&self) -> &Path {
        &self.file
    }

    /// The last decision stored under `key`.
    pub fn get(&self, key: &str) -> Option<Cached> {
        let text = std::fs::read_to_string(&self.file).ok()?;
        text.lines().rev().find_map(|line| {
            let mut parts = line.splitn(3, '\t');
            match (parts.next(), parts.next(), parts.next()) {
                (Some(k), Some(winner), Some(reason)) if k == key => Some(Cached {
                    winner: winner.to_string(),
                    reason: reason.to_string(),
                }),
                _ => None,
            }
        })
    }

    /// Store a decision under `key` (appended: the last line wins).
    pub fn put(&self, key: &str, entry: &Cached) -> std::io::Result<()> {
        use std::io::Write;
        if let Some(dir) = self.file.parent() {
            std::fs::create_dir_all(dir)?;
        }
        let clean = |s: &str| s.replace(['\t', '\n'], " ");
        // One write of the whole line: appends from several threads or
        // processes (checks finishing at once) never interleave within it.
        let line = format!(
            "{}\t{}\t{}\n",
            clean(key),
            clean(&entry.winner),
            clean(&entry.reason)
        );
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.file)?
            .write_all(line.as_bytes())
    }
}

/// Where flashattn keeps what it measured: `$FLASHATTN_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/flashattn`, else `~/.cache/flashattn`; `None` where
/// none of them is set.
pub fn cache_dir() -> Option<PathBuf> {
    let env = |k: &str| {
        std::env::var_os(k)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    env("FLASHATTN_CACHE_DIR")
        .or_else(|| env("XDG_CACHE_HOME").map(|d| d.join("flashattn")))
        .or_else(|| env("HOME").map(|d| d.join(".cache").join("flashattn")))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_entry_for_a_key_wins_and_others_are_kept_apart() {
        let dir = tempfile::tempdir().unwrap();
        let cache = ProbeCache::in_dir(&dir.path().join("nested"));
        assert_eq!(cache.get("a"), None);
        let entry = |w: &str| Cached {
            winner: w.into(),
            reason: format!("{w} was faster"),
        };
        cache.put("a", &entry("cpu")).unwrap();
        cache.put("b", &entry("gpu\tx")).unwrap();
        cache.put("a", &entry("gpu")).unwrap();
        assert_eq!(cache.get("a"), Some(entry("gpu")));
        assert_eq!(cache.get("b").unwrap().winner, "gpu x");
        assert_eq!(cache.get("c"), None);
    }
}

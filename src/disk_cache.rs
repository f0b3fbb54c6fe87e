//! What flashattn keeps on disk between processes, in one place: the cache
//! directory, and the keyed tables kept there — `auto`'s measurements
//! (`auto-backend.tsv`), the autotuner's winners (`tuned-plans.tsv`) and
//! the verification verdicts (`verified.tsv`) — one tab-separated line per
//! entry (key, value, note), appended, the last line for a key winning.
//! The CUDA backend's PTX lives in a folder of the same directory
//! ([`cache_dir`]`/cuda`). A missing, unreadable or unwritable file only
//! means measuring, tuning or checking again.

use std::path::{Path, PathBuf};

/// Where flashattn keeps what it measured: `$FLASHATTN_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/flashattn`, else `~/.cache/flashattn`; `None` where
/// none of them is set.
pub fn cache_dir() -> Option<PathBuf> {
    env_dir("FLASHATTN_CACHE_DIR")
        .or_else(|| env_dir("XDG_CACHE_HOME").map(|d| d.join("flashattn")))
        .or_else(|| env_dir("HOME").map(|d| d.join(".cache").join("flashattn")))
}

/// The directory an environment variable names, where set and not empty.
pub(crate) fn env_dir(name: &str) -> Option<PathBuf> {
    std::env::var_os(name)
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
}

/// One keyed table on disk.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Table {
    file: PathBuf,
}

/// One entry of a [`Table`]: its value (a winner, overrides, a verdict) and
/// a note saying where it came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    pub value: String,
    pub note: String,
}

impl Table {
    /// The table in `file` (created on the first [`Table::put`]).
    pub fn at(file: PathBuf) -> Self {
        Self { file }
    }

    /// The file the table is kept in.
    pub fn path(&self) -> &Path {
        &self.file
    }

    /// The last entry stored under `key`.
    pub fn get(&self, key: &str) -> Option<Entry> {
        let text = std::fs::read_to_string(&self.file).ok()?;
        text.lines().rev().find_map(|line| {
            let mut parts = line.splitn(3, '\t');
            match (parts.next(), parts.next(), parts.next()) {
                (Some(k), Some(value), Some(note)) if k == key => Some(Entry {
                    value: value.to_string(),
                    note: note.to_string(),
                }),
                _ => None,
            }
        })
    }

    /// Store `entry` under `key` (appended: the last line wins); tabs and
    /// line breaks inside the fields become spaces.
    pub fn put(&self, key: &str, entry: &Entry) -> std::io::Result<()> {
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
            clean(&entry.value),
            clean(&entry.note)
        );
        std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.file)?
            .write_all(line.as_bytes())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_last_entry_for_a_key_wins_and_others_are_kept_apart() {
        let dir = tempfile::tempdir().unwrap();
        let table = Table::at(dir.path().join("nested").join("t.tsv"));
        assert_eq!(table.get("a"), None);
        let entry = |w: &str| Entry {
            value: w.into(),
            note: format!("{w} was faster"),
        };
        table.put("a", &entry("cpu")).unwrap();
        table.put("b", &entry("gpu\tx")).unwrap();
        table.put("a", &entry("gpu")).unwrap();
        assert_eq!(table.get("a"), Some(entry("gpu")));
        assert_eq!(table.get("b").unwrap().value, "gpu x");
        assert_eq!(table.get("c"), None);
    }
}

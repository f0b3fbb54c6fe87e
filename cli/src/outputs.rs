//! A command's output files: every path checked before any work
//! ([`check`]), then all of them committed together or none ([`write()`]).
//!
//! [`write()`] puts each file's bytes in a temporary file next to its
//! destination; only when every temporary is written are they renamed, in
//! order. If a rename fails, the temporaries not yet renamed are removed
//! and the renames already done are undone: the files they replaced are
//! put back (each was kept under a second name, a hard link, until the
//! last rename) and the new ones removed. A command leaves all its outputs
//! or none, and an output that names an input (a cache updated in place)
//! leaves the input as it was when the command fails.

use crate::error::{CliError, Result};
use std::ffi::OsString;
use std::path::{Path, PathBuf};
use thiserror::Error;

/// Why an output path cannot be written, found before any work.
#[derive(Debug, Error)]
pub enum PathProblem {
    /// The path is an existing directory.
    #[error("is a directory; name a file")]
    IsDirectory,
    /// The path ends in no file name (`/`, `..`).
    #[error("names no file")]
    NoFileName,
    /// The path ends in a separator, as a directory's does (`o.npy/`).
    #[error("ends in a separator; name a file")]
    TrailingSeparator,
    /// The directory that would hold the file does not exist.
    #[error("its directory {} does not exist", .0.display())]
    NoDirectory(PathBuf),
    /// What would hold the file exists but is not a directory.
    #[error("{} is not a directory", .0.display())]
    NotDirectory(PathBuf),
    /// The directory cannot be looked up (permissions, a loop of links).
    #[error("its directory {} cannot be opened", .0.display())]
    DirectoryUnreadable(PathBuf, #[source] std::io::Error),
}

/// Check the outputs of one command before any work: each path names a
/// file (not an existing directory) in an existing directory, and no two
/// flags name the same file (same canonical directory and file name).
pub fn check(outputs: &[(&'static str, &Path)]) -> Result<()> {
    let mut seen: Vec<((PathBuf, OsString), &'static str)> = Vec::new();
    for &(flag, path) in outputs {
        let key = file_key(path).map_err(|problem| CliError::OutputPath {
            flag,
            path: path.to_path_buf(),
            problem,
        })?;
        if let Some((_, first)) = seen.iter().find(|(k, _)| *k == key) {
            return Err(CliError::SameOutput {
                first,
                second: flag,
                path: path.to_path_buf(),
            });
        }
        seen.push((key, flag));
    }
    Ok(())
}

/// The output flags given, with their paths (for [`check`]).
pub fn given<'a>(flags: &[(&'static str, Option<&'a PathBuf>)]) -> Vec<(&'static str, &'a Path)> {
    flags
        .iter()
        .filter_map(|&(flag, path)| path.map(|p| (flag, p.as_path())))
        .collect()
}

/// The canonical directory and file name of an output path.
fn file_key(path: &Path) -> Result<(PathBuf, OsString), PathProblem> {
    if std::fs::metadata(path).is_ok_and(|m| m.is_dir()) {
        return Err(PathProblem::IsDirectory);
    }
    let last = path.as_os_str().to_string_lossy().chars().last();
    if last.is_some_and(std::path::is_separator) {
        return Err(PathProblem::TrailingSeparator);
    }
    let name = path.file_name().ok_or(PathProblem::NoFileName)?;
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    };
    match std::fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(PathProblem::NotDirectory(dir.to_path_buf())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(PathProblem::NoDirectory(dir.to_path_buf()))
        }
        Err(e) => return Err(PathProblem::DirectoryUnreadable(dir.to_path_buf(), e)),
    }
    let dir = std::fs::canonicalize(dir)
        .map_err(|e| PathProblem::DirectoryUnreadable(dir.to_path_buf(), e))?;
    Ok((dir, name.to_os_string()))
}

/// One output: its flag, its path, and its bytes (an encoding error is
/// that file's write error).
pub type Output<'a> = (&'static str, &'a Path, std::io::Result<Vec<u8>>);

/// Whether `path` (its links followed) is an existing file that is neither
/// a regular file nor a directory: a device such as `/dev/null`, a FIFO,
/// `/dev/stdout` on a pipe. Such an output is written in place: renaming a
/// temporary over it would replace the device node (or the link to it)
/// with a regular file, and its directory (`/dev`) may not take one.
pub fn is_special(path: &Path) -> bool {
    std::fs::metadata(path).is_ok_and(|m| !m.is_file() && !m.is_dir())
}

/// Write every output or none: [`check`] again, each file to a temporary
/// next to its destination, then [`commit`]. Special files ([`is_special`])
/// are written in place once every temporary is written, before the
/// renames (what a device took cannot be taken back).
pub fn write(outputs: Vec<Output<'_>>) -> Result<()> {
    let paths: Vec<(&'static str, &Path)> = outputs.iter().map(|(f, p, _)| (*f, *p)).collect();
    check(&paths)?;
    let mut renames: Vec<(PathBuf, &Path)> = Vec::new();
    let mut special: Vec<(&Path, Vec<u8>)> = Vec::new();
    for (index, (_, path, bytes)) in outputs.into_iter().enumerate() {
        if is_special(path) {
            match bytes {
                Ok(bytes) => special.push((path, bytes)),
                Err(source) => {
                    for (t, _) in &renames {
                        let _ = std::fs::remove_file(t);
                    }
                    return Err(CliError::Write {
                        path: path.to_path_buf(),
                        source,
                    });
                }
            }
            continue;
        }
        let temp = beside(path, index, "partial");
        if let Err(source) = bytes.and_then(|bytes| std::fs::write(&temp, bytes)) {
            let _ = std::fs::remove_file(&temp);
            for (t, _) in &renames {
                let _ = std::fs::remove_file(t);
            }
            return Err(CliError::Write {
                path: path.to_path_buf(),
                source,
            });
        }
        renames.push((temp, path));
    }
    for (path, bytes) in special {
        if let Err(source) = write_in_place(path, &bytes) {
            for (t, _) in &renames {
                let _ = std::fs::remove_file(t);
            }
            return Err(CliError::Write {
                path: path.to_path_buf(),
                source,
            });
        }
    }
    commit(&renames)
}

/// Write `bytes` to an existing special file, as it is (no truncation, no
/// temporary).
pub fn write_in_place(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    use std::io::Write;
    std::fs::OpenOptions::new()
        .write(true)
        .open(path)?
        .write_all(bytes)
}

/// The file beside `path` of output `index` of this process: its
/// temporary (`partial`) or the file it replaces, kept (`previous`).
fn beside(path: &Path, index: usize, kind: &str) -> PathBuf {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    path.with_file_name(format!(".{name}.{}.{index}.{kind}", std::process::id()))
}

/// Rename each `(temporary, destination)` in order, each file a rename
/// replaces kept under a second name (a hard link) until all are done. If
/// one fails, remove the temporaries not yet renamed, undo the renames
/// done (the files they replaced put back, the new ones removed), and
/// return that rename's error. Where no hard link can be made, a replaced
/// file cannot be put back and an undone output is removed.
pub fn commit(renames: &[(PathBuf, &Path)]) -> Result<()> {
    let mut done: Vec<(&Path, Option<PathBuf>)> = Vec::new();
    for (index, (temp, path)) in renames.iter().enumerate() {
        let kept = match std::fs::symlink_metadata(path) {
            Ok(_) => {
                let previous = beside(path, index, "previous");
                std::fs::hard_link(path, &previous)
                    .is_ok()
                    .then_some(previous)
            }
            Err(_) => None,
        };
        if let Err(source) = std::fs::rename(temp, path) {
            if let Some(previous) = &kept {
                let _ = std::fs::remove_file(previous);
            }
            for (t, _) in &renames[index..] {
                let _ = std::fs::remove_file(t);
            }
            for (path, kept) in done.iter().rev() {
                let _ = match kept {
                    Some(previous) => std::fs::rename(previous, path),
                    None => std::fs::remove_file(path),
                };
            }
            return Err(CliError::Write {
                path: path.to_path_buf(),
                source,
            });
        }
        done.push((path, kept));
    }
    for previous in done.into_iter().filter_map(|(_, kept)| kept) {
        let _ = std::fs::remove_file(previous);
    }
    Ok(())
}

/// The directory's entries, sorted: what a test expects a command to have
/// left there.
#[cfg(test)]
pub(crate) fn names(d: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir() -> tempfile::TempDir {
        tempfile::tempdir().unwrap()
    }

    #[test]
    fn a_failed_rename_undoes_every_output_of_the_command() {
        let d = dir();
        let p = |n: &str| d.path().join(n);
        // a.npy is new, b.npy replaces a file, c.npy became a directory
        // after the checks.
        std::fs::write(p("b.npy"), "old").unwrap();
        std::fs::create_dir(p("c.npy")).unwrap();
        for t in ["a.t", "b.t", "c.t"] {
            std::fs::write(p(t), "new").unwrap();
        }
        let (a, b, c) = (p("a.npy"), p("b.npy"), p("c.npy"));
        let renames = [(p("a.t"), a.as_path()), (p("b.t"), &b), (p("c.t"), &c)];
        match commit(&renames) {
            Err(CliError::Write { path, .. }) => assert_eq!(path, c),
            other => panic!("{other:?}"),
        }
        assert_eq!(names(d.path()), ["b.npy", "c.npy"]);
        assert_eq!(std::fs::read_to_string(&b).unwrap(), "old", "b put back");
        assert!(c.is_dir());
    }

    #[test]
    fn a_failed_first_rename_removes_every_temporary() {
        let d = dir();
        let p = |n: &str| d.path().join(n);
        std::fs::create_dir(p("a.npy")).unwrap();
        std::fs::write(p("a.t"), "new").unwrap();
        std::fs::write(p("b.t"), "new").unwrap();
        let (a, b) = (p("a.npy"), p("b.npy"));
        let renames = [(p("a.t"), a.as_path()), (p("b.t"), &b)];
        assert!(matches!(commit(&renames), Err(CliError::Write { .. })));
        assert!(!p("a.t").exists() && !p("b.t").exists() && !b.exists());
    }

    #[test]
    fn commit_renames_every_temporary() {
        let d = dir();
        let p = |n: &str| d.path().join(n);
        std::fs::write(p("a.npy"), "old").unwrap();
        std::fs::write(p("a.t"), "a").unwrap();
        std::fs::write(p("b.t"), "b").unwrap();
        let (a, b) = (p("a.npy"), p("b.npy"));
        commit(&[(p("a.t"), a.as_path()), (p("b.t"), &b)]).unwrap();
        assert_eq!(std::fs::read_to_string(&a).unwrap(), "a");
        assert_eq!(std::fs::read_to_string(&b).unwrap(), "b");
        assert_eq!(names(d.path()), ["a.npy", "b.npy"], "nothing kept");
    }

    #[test]
    fn write_leaves_all_files_or_none() {
        let d = dir();
        let p = |n: &str| d.path().join(n);
        let (a, b) = (p("a.npy"), p("b.npy"));
        write(vec![
            ("--a", &a, Ok(b"a".to_vec())),
            ("--b", &b, Ok(b"b".to_vec())),
        ])
        .unwrap();
        assert_eq!(std::fs::read(&b).unwrap(), b"b");
        // An encoding error on the second: nothing new, no temporary.
        let c = p("c.npy");
        let failed = std::io::Error::other("encoding");
        let result = write(vec![
            ("--a", &c, Ok(b"c".to_vec())),
            ("--b", &b, Err(failed)),
        ]);
        assert!(matches!(result, Err(CliError::Write { path, .. }) if path == b));
        assert_eq!(names(d.path()), ["a.npy", "b.npy"]);
        assert_eq!(std::fs::read(&b).unwrap(), b"b");
    }

    /// A special output (a FIFO here; `/dev/null`, `/dev/stdout` alike) is
    /// written in place, never replaced by a regular file, beside regular
    /// outputs committed as usual.
    #[cfg(unix)]
    #[test]
    fn a_special_output_is_written_in_place_not_replaced() {
        let d = dir();
        let fifo = d.path().join("fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        if !made.is_ok_and(|s| s.success()) {
            return; // no mkfifo here
        }
        assert!(is_special(&fifo));
        let reader = {
            let fifo = fifo.clone();
            std::thread::spawn(move || std::fs::read(fifo).unwrap())
        };
        let o = d.path().join("o.npy");
        write(vec![
            ("--out", &fifo, Ok(vec![1, 2, 3])),
            ("--lse", &o, Ok(vec![4])),
        ])
        .unwrap();
        assert!(is_special(&fifo), "the FIFO was replaced by a regular file");
        assert_eq!(reader.join().unwrap(), vec![1, 2, 3]);
        assert_eq!(std::fs::read(&o).unwrap(), vec![4]);
        assert_eq!(names(d.path()), vec!["fifo", "o.npy"]);
        // An encoding error of the special output writes nothing at all.
        let err = write(vec![
            ("--lse", &o, Ok(vec![5])),
            ("--out", &fifo, Err(std::io::Error::other("encoding"))),
        ])
        .unwrap_err();
        assert!(matches!(err, CliError::Write { .. }));
        assert_eq!(std::fs::read(&o).unwrap(), vec![4]);
        assert_eq!(names(d.path()), vec!["fifo", "o.npy"]);
    }

    #[test]
    fn check_names_the_flags_and_the_problem() {
        let d = dir();
        let p = |n: &str| d.path().join(n);
        std::fs::create_dir(p("sub")).unwrap();
        std::fs::write(p("file"), "").unwrap();
        let (o, sub) = (p("o.npy"), p("sub"));
        assert!(check(&[("--out", &o), ("--lse", &p("sub/../o2.npy"))]).is_ok());
        match check(&[("--out", &o), ("--lse", &sub)]) {
            Err(CliError::OutputPath {
                flag: "--lse",
                problem: PathProblem::IsDirectory,
                ..
            }) => {}
            other => panic!("{other:?}"),
        }
        let same = p("sub/../o.npy");
        match check(&[("--out", &o), ("--dq", &p("x.npy")), ("--lse", &same)]) {
            Err(CliError::SameOutput {
                first: "--out",
                second: "--lse",
                path,
            }) => assert_eq!(path, same),
            other => panic!("{other:?}"),
        }
        let missing = p("missing/o.npy");
        match check(&[("--out", &missing)]) {
            Err(CliError::OutputPath {
                flag: "--out",
                problem: PathProblem::NoDirectory(dir),
                ..
            }) => assert_eq!(dir, p("missing")),
            other => panic!("{other:?}"),
        }
        let trailing = d.path().join("o.npy/");
        assert!(matches!(
            check(&[("--out", &trailing)]),
            Err(CliError::OutputPath {
                problem: PathProblem::TrailingSeparator,
                ..
            })
        ));
        let under_file = p("file/o.npy");
        assert!(matches!(
            check(&[("--out", &under_file)]),
            Err(CliError::OutputPath {
                problem: PathProblem::NotDirectory(_),
                ..
            })
        ));
        assert!(matches!(
            check(&[("--out", Path::new("/"))]),
            Err(CliError::OutputPath {
                problem: PathProblem::IsDirectory,
                ..
            })
        ));
    }
}

//! The documentation as a reader meets it, checked on the repository's files
//! (no device, no build of anything else):
//!
//! - every relative link and anchor in the Markdown files (README.md,
//!   CHANGELOG.md, docs/*.md) leads to a tracked file, and to a heading of it
//!   as GitHub slugs headings;
//! - README.md stays within 200 lines, and its Rust example is
//!   examples/quickstart.rs verbatim (which `cargo test` builds);
//! - no tracked text file holds an absolute path of a machine (`/home/`,
//!   `/tmp/`, …) beyond the temporary folders the GPU scripts create, listed
//!   one by one in [`TEMPORARY_PATHS`];
//! - no tracked file refers to a contract outside the repository: the
//!   contract is docs/semantics.md.

use std::collections::{BTreeSet, HashMap};
use std::path::{Component, Path, PathBuf};
use std::process::Command;

/// The top folders of a machine's absolute paths: a user's home, scratch or
/// work folders, mounted volumes (each matched as `/<name>/`).
const MACHINE_FOLDERS: [&str; 7] = ["home", "root", "tmp", "work", "Users", "mnt", "var/folders"];

/// [`MACHINE_FOLDERS`] as the paths a line must not contain, and Windows'
/// user folders.
fn machine_paths() -> Vec<String> {
    let mut paths: Vec<String> = MACHINE_FOLDERS.iter().map(|f| format!("/{f}/")).collect();
    paths.push("C:\\Users\\".to_string());
    paths
}

/// The temporary folders scripts create at run time: (file, the path).
const TEMPORARY_PATHS: [(&str, &str); 5] = [
    ("scripts/cuda-check.sh", "/tmp/amd64"),
    ("scripts/cuda-check.sh", "/tmp/flashattn-ptx"),
    ("scripts/gpu-check.sh", "/tmp/amd64"),
    ("scripts/gpu-check.sh", "/tmp/cuda-cli"),
    ("scripts/nvrtc.sh", "/tmp/nvrtc"),
];

/// This file names the patterns it looks for.
const THIS_FILE: &str = "tests/docs.rs";

const README_MAX_LINES: usize = 200;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// The files git tracks, relative to the root.
fn tracked() -> BTreeSet<String> {
    let out = Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(root())
        .output()
        .expect("these checks need git and a git checkout (git ls-files)");
    assert!(out.status.success(), "git ls-files failed: {out:?}");
    String::from_utf8(out.stdout)
        .expect("git ls-files prints UTF-8 paths")
        .split('\0')
        .filter(|p| !p.is_empty())
        .map(str::to_string)
        .collect()
}

/// The text of a tracked file, `None` for binary files and symlinked folders.
fn text(path: &str) -> Option<String> {
    std::fs::read(root().join(path))
        .ok()
        .and_then(|bytes| String::from_utf8(bytes).ok())
}

/// The Markdown pages a reader sees: every tracked `.md` file, and every
/// page in docs/ (tracked or about to be).
fn markdown_files(tracked: &BTreeSet<String>) -> Vec<String> {
    let mut files: BTreeSet<String> = tracked
        .iter()
        .filter(|p| p.ends_with(".md"))
        .cloned()
        .collect();
    if let Ok(entries) = std::fs::read_dir(root().join("docs")) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.ends_with(".md") {
                files.insert(format!("docs/{name}"));
            }
        }
    }
    files.into_iter().collect()
}

/// The lines of a Markdown text outside fenced code blocks, numbered from 1.
fn prose_lines(markdown: &str) -> Vec<(usize, &str)> {
    let mut fenced = false;
    let mut lines = Vec::new();
    for (i, line) in markdown.lines().enumerate() {
        let trimmed = line.trim_start();
        if trimmed.starts_with("```") || trimmed.starts_with("~~~") {
            fenced = !fenced;
        } else if !fenced {
            lines.push((i + 1, line));
        }
    }
    lines
}

/// A heading's anchor as GitHub makes it: the rendered text lowercased,
/// punctuation dropped (letters, digits, `-` and `_` kept), spaces to `-`.
fn slug(heading: &str) -> String {
    heading
        .chars()
        .filter(|c| !matches!(c, '`' | '*'))
        .flat_map(char::to_lowercase)
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// Every anchor of a Markdown text; repeated headings get `-1`, `-2`, ….
fn anchors(markdown: &str) -> BTreeSet<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = BTreeSet::new();
    for (_, line) in prose_lines(markdown) {
        let hashes = line.chars().take_while(|&c| c == '#').count();
        if !(1..=6).contains(&hashes) || !line[hashes..].starts_with(' ') {
            continue;
        }
        let base = slug(line[hashes..].trim());
        let n = seen.entry(base.clone()).or_insert(0);
        out.insert(if *n == 0 {
            base.clone()
        } else {
            format!("{base}-{n}")
        });
        *n += 1;
    }
    out
}

/// A line without its inline code spans, where `](` is not a link.
fn without_code(line: &str) -> String {
    line.split('`').step_by(2).collect::<Vec<_>>().join(" ")
}

/// The targets of a line's inline links and images, and of a reference
/// definition (`[name]: target`).
fn link_targets(line: &str) -> Vec<String> {
    let line = without_code(line);
    let mut targets = Vec::new();
    let mut rest = line.as_str();
    while let Some(at) = rest.find("](") {
        let after = &rest[at + 2..];
        let end = after.find(')').unwrap_or(after.len());
        let target = after[..end].split_whitespace().next().unwrap_or("");
        targets.push(target.trim_matches(['<', '>']).to_string());
        rest = &after[end..];
    }
    let trimmed = line.trim_start();
    if trimmed.starts_with('[') && !trimmed.starts_with("[^") {
        if let Some((_, target)) = trimmed.split_once("]: ") {
            targets.push(target.split_whitespace().next().unwrap_or("").to_string());
        }
    }
    targets
}

/// `target` resolved against the folder of `from`, `..` folded in.
fn resolve(from: &str, target: &str) -> PathBuf {
    let mut path = PathBuf::new();
    let base = Path::new(from).parent().unwrap_or(Path::new(""));
    for part in base.join(target).components() {
        match part {
            Component::ParentDir => {
                path.pop();
            }
            Component::CurDir => {}
            other => path.push(other),
        }
    }
    path
}

/// What is wrong with one link of `from`, if anything.
fn dead_link(from: &str, target: &str, tracked: &BTreeSet<String>) -> Option<String> {
    let (path, anchor) = target.split_once('#').unwrap_or((target, ""));
    let file = if path.is_empty() {
        from.to_string()
    } else {
        resolve(from, path).to_string_lossy().into_owned()
    };
    let folder = format!("{}/", file.trim_end_matches('/'));
    if !tracked.contains(&file) && !tracked.iter().any(|t| t.starts_with(&folder)) {
        return Some(format!("{file} is not a tracked file or folder"));
    }
    if anchor.is_empty() || !file.ends_with(".md") {
        return None;
    }
    let page = text(&file).unwrap_or_default();
    (!anchors(&page).contains(anchor)).then(|| format!("{file} has no heading #{anchor}"))
}

#[test]
fn relative_links_and_anchors_lead_somewhere() {
    let mut tracked = tracked();
    let pages = markdown_files(&tracked);
    // Pages about to be committed count as there.
    tracked.extend(pages.iter().cloned());
    let mut dead = Vec::new();
    for page in &pages {
        let markdown = text(page).unwrap_or_else(|| panic!("{page} is not UTF-8 text"));
        for (line_no, line) in prose_lines(&markdown) {
            for target in link_targets(line) {
                let external = target.contains("://") || target.starts_with("mailto:");
                if target.is_empty() || external {
                    continue;
                }
                if let Some(why) = dead_link(page, &target, &tracked) {
                    dead.push(format!("{page}:{line_no}: ({target}): {why}"));
                }
            }
        }
    }
    assert!(
        dead.is_empty(),
        "dead links:\n{}\n(anchors are headings as GitHub slugs them: lowercase, punctuation dropped, spaces as -)",
        dead.join("\n")
    );
}

#[test]
fn readme_is_short_and_its_example_is_the_quickstart_example() {
    let readme = text("README.md").expect("README.md");
    let lines = readme.lines().count();
    assert!(
        lines <= README_MAX_LINES,
        "README.md has {lines} lines, more than {README_MAX_LINES}: move detail into docs/"
    );
    let example = text("examples/quickstart.rs").expect("examples/quickstart.rs");
    let block = readme
        .split_once("```rust\n")
        .and_then(|(_, rest)| rest.split_once("```"))
        .map(|(block, _)| block)
        .expect("README.md has a ```rust block");
    assert_eq!(
        block, example,
        "README.md's Rust example must be examples/quickstart.rs verbatim (cargo test builds that file)"
    );
}

#[test]
fn no_absolute_machine_paths_in_tracked_files() {
    let machine_paths = machine_paths();
    let mut found = Vec::new();
    for path in tracked().iter().filter(|p| p.as_str() != THIS_FILE) {
        let Some(content) = text(path) else { continue };
        for (i, line) in content.lines().enumerate() {
            let temporary = TEMPORARY_PATHS
                .iter()
                .any(|(file, tmp)| file == path && line.contains(tmp));
            let hit = machine_paths.iter().find(|p| line.contains(p.as_str()));
            if let (Some(pattern), false) = (hit, temporary) {
                found.push(format!("{path}:{}: {pattern}: {}", i + 1, line.trim()));
            }
        }
    }
    assert!(
        found.is_empty(),
        "absolute machine paths (use relative paths, $HOME or a temporary folder made at run time):\n{}",
        found.join("\n")
    );
}

#[test]
fn the_contract_is_docs_semantics_md() {
    let outside = ["SPEC", ".md"].concat();
    let found: Vec<String> = tracked()
        .iter()
        .filter(|path| text(path).is_some_and(|t| t.contains(&outside)))
        .cloned()
        .collect();
    assert!(
        found.is_empty(),
        "{outside} is not in the repository; name docs/semantics.md (and its section) instead, in:\n{}",
        found.join("\n")
    );
    assert!(root().join("docs/semantics.md").is_file());
}

#[test]
fn slugs_follow_github() {
    assert_eq!(slug("FP8 (e4m3)"), "fp8-e4m3");
    assert_eq!(slug("Packed batches (varlen)"), "packed-batches-varlen");
    assert_eq!(slug("`--backend auto`"), "--backend-auto");
    assert_eq!(slug("KV cache and decoding"), "kv-cache-and-decoding");
    assert_eq!(slug("What's new: f16 / bf16"), "whats-new-f16--bf16");
    let page = "# A\n## Notes\n```\n# not a heading\n```\n## Notes\n";
    let expected: BTreeSet<String> = ["a", "notes", "notes-1"].map(String::from).into();
    assert_eq!(anchors(page), expected);
    assert_eq!(
        link_targets("see [x](a.md#b) and `[y](no.md)` and ![i](p.png \"t\")"),
        ["a.md#b", "p.png"]
    );
    assert_eq!(
        resolve("docs/a.md", "../web/x.png"),
        PathBuf::from("web/x.png")
    );
}

//! One module per subcommand; shared helpers here.

pub mod attention;
pub mod bench;
pub mod decode;
pub mod demo;
pub mod doctor;
pub mod layouts;
pub mod plan;
pub mod tune;

use crate::args::Command;
use crate::error::{CliError, Result};
use flashattn::Window;
use std::path::Path;

/// Run one subcommand.
pub fn run(command: Command) -> Result<()> {
    match command {
        Command::Forward(a) => attention::forward(a),
        Command::Backward(a) => attention::backward(a),
        Command::Decode(a) => decode::run(a),
        Command::Plan(a) => plan::run(a),
        Command::Tune(a) => tune::run(a),
        Command::Demo(a) => demo::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Doctor(a) => doctor::run(a),
    }
}

/// Parse `L,R` (each an integer, negative = unbounded).
pub fn parse_window(s: &str) -> Result<Window> {
    let bad = || CliError::BadFlag {
        flag: "--window",
        expected: "LEFT,RIGHT such as 8,0 or -1,10",
        value: s.to_string(),
    };
    let (l, r) = s.split_once(',').ok_or_else(bad)?;
    let l: i64 = l.trim().parse().map_err(|_| bad())?;
    let r: i64 = r.trim().parse().map_err(|_| bad())?;
    Ok(Window::from_signed(l, r))
}

/// Check a `--plot` path before any work: SVG or PNG by extension.
pub fn plot_path_ok(path: &Path) -> Result<()> {
    match path.extension().and_then(|e| e.to_str()) {
        Some("svg") | Some("png") => Ok(()),
        _ => Err(CliError::BadFlag {
            flag: "--plot",
            expected: "a .svg or .png file name",
            value: path.display().to_string(),
        }),
    }
}

/// Write `text` to `path` through a temporary file, so a failure leaves
/// nothing; a special file (`/dev/stdout`, a FIFO) in place.
pub fn write_text(path: &Path, text: &str) -> Result<()> {
    if crate::outputs::is_special(path) {
        return crate::outputs::write_in_place(path, text.as_bytes()).map_err(|source| {
            CliError::Write {
                path: path.to_path_buf(),
                source,
            }
        });
    }
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temp = path.with_file_name(format!(".{name}.{}.partial", std::process::id()));
    std::fs::write(&temp, text)
        .and_then(|()| std::fs::rename(&temp, path))
        .map_err(|source| {
            let _ = std::fs::remove_file(&temp);
            CliError::Write {
                path: path.to_path_buf(),
                source,
            }
        })
}

/// Both flags of a pair or neither.
pub fn pair<'a, T>(
    (a, a_flag): (&'a Option<T>, &'static str),
    (b, b_flag): (&'a Option<T>, &'static str),
) -> Result<Option<(&'a T, &'a T)>> {
    match (a, b) {
        (Some(x), Some(y)) => Ok(Some((x, y))),
        (None, None) => Ok(None),
        (Some(_), None) => Err(CliError::Pair {
            given: a_flag,
            missing: b_flag,
        }),
        (None, Some(_)) => Err(CliError::Pair {
            given: b_flag,
            missing: a_flag,
        }),
    }
}

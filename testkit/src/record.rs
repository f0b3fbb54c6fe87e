//! What the harness decides for a missing need, and the waiver list it
//! appends to: pure decisions ([`Mode::outcome`]) and the one function
//! that acts on them ([`Mode::decide`]).

use crate::Need;
use std::io::Write;
use std::path::PathBuf;

/// Which needs this run requires and where waivers go.
#[derive(Clone, Debug, Default)]
pub struct Mode {
    /// `FLASHATTN_REQUIRE_ALL=1`: every need.
    pub require_all: bool,
    /// The variables set to `1` (see [`Need::variable`]).
    pub required: Vec<&'static str>,
    /// The file each waiver is appended to, one line each.
    pub waivers: Option<PathBuf>,
}

/// A missing need as one test met it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Record {
    pub test: String,
    pub need: Need,
    /// Why the need is missing.
    pub why: String,
    /// What the test checked instead, if anything: `None` is a waiver
    /// (the part of the test that needed it did not run).
    pub checked: Option<String>,
}

/// What a missing need comes to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// The run requires it: the test fails with this message.
    Fail(String),
    /// Recorded as this line of the waiver list.
    Listed(String),
}

impl Record {
    /// `test` did not run what needed `need`, missing for `why`.
    pub fn waived(test: String, need: Need, why: &str) -> Self {
        Self {
            test,
            need,
            why: one_line(why),
            checked: None,
        }
    }

    /// `test` checked `checked` where `need` is missing for `why`.
    pub fn instead(test: String, need: Need, why: &str, checked: &str) -> Self {
        Self {
            checked: Some(one_line(checked)),
            ..Self::waived(test, need, why)
        }
    }

    /// The waiver list's line: `WAIVED` or `INSTEAD`, the test, the need, why.
    pub fn line(&self) -> String {
        let (tag, tail) = match &self.checked {
            None => ("WAIVED", String::new()),
            Some(c) => ("INSTEAD", format!("; checked instead: {c}")),
        };
        format!(
            "{tag} {}: needs {} ({}=1 requires it): {}{tail}",
            self.test,
            self.need.describe(),
            self.need.variable(),
            self.why
        )
    }
}

impl Mode {
    /// Whether this mode requires `need`.
    pub fn requires(&self, need: Need) -> bool {
        self.require_all || self.required.contains(&need.variable())
    }

    /// What `record` comes to in this mode.
    pub fn outcome(&self, record: &Record) -> Outcome {
        if self.requires(record.need) {
            let by = if self.require_all {
                crate::REQUIRE_ALL
            } else {
                record.need.variable()
            };
            Outcome::Fail(format!(
                "{by}=1 but {} is missing: {}",
                record.need.describe(),
                record.why
            ))
        } else {
            Outcome::Listed(record.line())
        }
    }

    /// Act on `record`: panic where required, else print the waiver and
    /// append it to the list.
    pub fn decide(&self, record: &Record) {
        match self.outcome(record) {
            Outcome::Fail(message) => panic!("{message}"),
            Outcome::Listed(line) => {
                eprintln!("{line}");
                if let Some(path) = &self.waivers {
                    if let Err(e) = append(path, &line) {
                        panic!("cannot append to the waiver list {}: {e}", path.display());
                    }
                }
            }
        }
    }
}

/// One line, appended whole (one `write` on a file opened to append, so
/// test processes running at once do not interleave their lines).
fn append(path: &std::path::Path, line: &str) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)?;
    f.write_all(format!("{line}\n").as_bytes())
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record() -> Record {
        Record::waived("shaders::spirv".into(), Need::SpirvVal, "not on\nthe PATH")
    }

    #[test]
    fn required_needs_fail_and_name_the_variable() {
        let mode = Mode {
            required: vec!["FLASHATTN_REQUIRE_SPIRV_VAL"],
            ..Default::default()
        };
        assert_eq!(
            mode.outcome(&record()),
            Outcome::Fail(
                "FLASHATTN_REQUIRE_SPIRV_VAL=1 but spirv-val is missing: not on the PATH".into()
            )
        );
        // Another need's variable does not require this one.
        let gpu = Mode {
            required: vec!["FLASHATTN_REQUIRE_GPU"],
            ..Default::default()
        };
        assert!(matches!(gpu.outcome(&record()), Outcome::Listed(_)));
        let all = Mode {
            require_all: true,
            ..Default::default()
        };
        assert!(
            matches!(all.outcome(&record()), Outcome::Fail(m) if m.starts_with("FLASHATTN_REQUIRE_ALL=1"))
        );
    }

    #[test]
    fn both_gpu_needs_share_one_variable() {
        assert_eq!(Need::Adapter.variable(), Need::Subgroups.variable());
        assert_eq!(Need::SpirvVal.variable(), Need::SpirvValCoop.variable());
    }

    #[test]
    fn waivers_are_appended_one_line_each() {
        let dir = std::env::temp_dir().join(format!("testkit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("waivers.txt");
        let mode = Mode {
            waivers: Some(path.clone()),
            ..Default::default()
        };
        mode.decide(&record());
        let coop = Record::instead(
            "gpu_forward::coop".into(),
            Need::CoopMatrix,
            "llvmpipe has none",
            "the typed error and the emulated kernel",
        );
        mode.decide(&coop);
        let text = std::fs::read_to_string(&path).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines,
            [
                "WAIVED shaders::spirv: needs spirv-val (FLASHATTN_REQUIRE_SPIRV_VAL=1 requires it): not on the PATH",
                "INSTEAD gpu_forward::coop: needs cooperative matrices on the adapter \
                 (FLASHATTN_REQUIRE_COOP=1 requires it): llvmpipe has none; checked instead: \
                 the typed error and the emulated kernel",
            ]
        );
    }

    #[test]
    #[should_panic(expected = "FLASHATTN_REQUIRE_CXX=1 but a C++ compiler is missing")]
    fn deciding_a_required_need_panics() {
        let mode = Mode {
            required: vec!["FLASHATTN_REQUIRE_CXX"],
            ..Default::default()
        };
        mode.decide(&Record::waived("t".into(), Need::Cxx, "no g++"));
    }
}

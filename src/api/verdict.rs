//! What verification says about a kernel family: the key a check is run
//! per ([`FamilyKey`]), its [`Verdict`], and what one call ran after the
//! verdicts of the families it tried ([`Verification`]).
//!
//! Plain values, shared by the wgpu and CUDA backends, the call statistics
//! and the command line.

use crate::api::tensor::Precision;

/// The kind of call a kernel family serves; each is checked on its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum CallKind {
    /// A forward pass (`o`, `lse`).
    Forward,
    /// A backward pass (`dq`, `dk`, `dv`, `dsinks`).
    Backward,
    /// Decoding steps on a KV cache (their own kernels on wgpu).
    Decode,
}

impl CallKind {
    /// The call's name in keys and messages.
    pub fn name(self) -> &'static str {
        match self {
            CallKind::Forward => "forward",
            CallKind::Backward => "backward",
            CallKind::Decode => "decode",
        }
    }
}

/// One kernel family as verification sees it: a known-answer check runs
/// once per key (per device and flashattn version). The key holds what
/// changes the generated code: the family, the call it serves, the storage
/// precision and each code-path flag (f16 native or packed, subgroup or
/// workgroup reductions, one or two K/V buffers, the cooperative-matrix
/// shape, the CUDA architecture compiled for).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct FamilyKey {
    /// The kind of call the family serves.
    pub call: CallKind,
    /// `tiled`, `lanes`, `registers` or `coop` on wgpu; `hopper`, `sm80`
    /// or `scalar` on CUDA.
    pub family: &'static str,
    /// The storage precision.
    pub precision: Precision,
    /// The code-path flags, in a fixed order (e.g. `native f16`,
    /// `subgroup reductions`, `two K/V buffers`).
    pub flags: Vec<String>,
}

impl FamilyKey {
    /// The key's text in the verdict cache (one line, no tabs).
    pub fn cache_text(&self) -> String {
        format!(
            "{} {} {} [{}]",
            self.call.name(),
            self.family,
            self.precision,
            self.flags.join(", ")
        )
    }
}

impl std::fmt::Display for FamilyKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {}", self.family, self.call.name(), self.precision)?;
        if !self.flags.is_empty() {
            write!(f, " ({})", self.flags.join(", "))?;
        }
        Ok(())
    }
}

/// What a check found, with the numbers behind it.
#[derive(Clone, Debug, PartialEq)]
pub struct Evidence {
    /// The worst output against its bound (`o: max error 1.2e-7 <= bound
    /// 3.0e-6`), or why the check's call failed.
    pub detail: String,
    /// Seconds the check took (compiling its kernels included), when it ran.
    pub seconds: f64,
    /// Read from the verdict cache (an earlier process's check), not run now.
    pub cached: bool,
}

/// The verdict on one kernel family on this device.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum Verdict {
    /// Its known-answer check met the accuracy rule on this device.
    Verified(Evidence),
    /// Its check did not meet the rule (or its call failed): the planner
    /// skips it for the next family, unless the caller forced it.
    Failed(Evidence),
    /// No check has run for it (another call is running it, or it was
    /// forced before one finished).
    NotYetChecked,
    /// Verification is off (`FLASHATTN_VERIFY=off`, [`crate::VerifyMode::Off`]).
    Off,
}

impl Verdict {
    /// The family failed its check.
    pub fn is_failed(&self) -> bool {
        matches!(self, Verdict::Failed(_))
    }

    /// The family passed its check.
    pub fn is_verified(&self) -> bool {
        matches!(self, Verdict::Verified(_))
    }

    /// The check's evidence, where one ran (now or in the cache).
    pub fn evidence(&self) -> Option<&Evidence> {
        match self {
            Verdict::Verified(e) | Verdict::Failed(e) => Some(e),
            Verdict::NotYetChecked | Verdict::Off => None,
        }
    }

    /// One word or two: `verified`, `failed`, `not yet checked`, `off`.
    pub fn word(&self) -> &'static str {
        match self {
            Verdict::Verified(_) => "verified",
            Verdict::Failed(_) => "failed",
            Verdict::NotYetChecked => "not yet checked",
            Verdict::Off => "verification off",
        }
    }
}

impl std::fmt::Display for Verdict {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.word())?;
        match self {
            Verdict::Verified(e) if e.cached => f.write_str(" (cached)"),
            Verdict::Failed(e) => write!(
                f,
                " ({}{})",
                e.detail,
                if e.cached { "; cached" } else { "" }
            ),
            _ => Ok(()),
        }
    }
}

/// A family and its verdict.
#[derive(Clone, Debug, PartialEq)]
pub struct Checked {
    /// The family.
    pub family: FamilyKey,
    /// Its verdict.
    pub verdict: Verdict,
}

/// What verification decided for one call: the families tried in order —
/// the planner's choice (or the caller's), then each fallback — and the
/// last of them ran. A family the caller forced runs whatever its verdict.
#[derive(Clone, Debug, PartialEq)]
pub struct Verification {
    /// The families tried, in order; the last one ran.
    pub tried: Vec<Checked>,
    /// The caller forced the first family: it ran whatever its verdict.
    pub forced: bool,
    /// Every family failed and [`crate::Backend`] ran the CPU backend
    /// instead: why (`tried` is then empty).
    pub cpu_instead: Option<String>,
}

impl Verification {
    /// The verification of a call the CPU backend ran because every kernel
    /// family failed (`why`: the families and their verdicts).
    pub fn cpu_instead(why: String) -> Self {
        Self {
            tried: Vec::new(),
            forced: false,
            cpu_instead: Some(why),
        }
    }

    /// The family that ran and its verdict.
    pub fn ran(&self) -> Option<&Checked> {
        self.tried.last()
    }

    /// Whether a family failed and the call ran another.
    pub fn fell_back(&self) -> bool {
        self.tried.len() > 1
    }
}

impl std::fmt::Display for Verification {
    /// `lanes forward f32: verified`; `coop forward f16: failed (o: max
    /// error …) → fallback to registers forward f16: verified`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(why) = &self.cpu_instead {
            return write!(f, "{why} → the CPU backend ran the call");
        }
        for (i, c) in self.tried.iter().enumerate() {
            if i > 0 {
                f.write_str(" → fallback to ")?;
            }
            write!(f, "{}: {}", c.family, c.verdict)?;
        }
        if self.forced && self.ran().is_some_and(|c| c.verdict.is_failed()) {
            f.write_str(" — run anyway, as forced")?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(family: &'static str) -> FamilyKey {
        FamilyKey {
            call: CallKind::Forward,
            family,
            precision: Precision::F16,
            flags: vec!["native f16".into()],
        }
    }

    fn evidence(detail: &str) -> Evidence {
        Evidence {
            detail: detail.into(),
            seconds: 0.01,
            cached: false,
        }
    }

    #[test]
    fn a_fallback_chain_reads_as_one_line() {
        let v = Verification {
            tried: vec![
                Checked {
                    family: key("coop"),
                    verdict: Verdict::Failed(evidence("o: max error 3.0e-1 > bound 1.0e-3")),
                },
                Checked {
                    family: key("registers"),
                    verdict: Verdict::Verified(evidence("o: max error 1e-4 <= bound 1e-3")),
                },
            ],
            forced: false,
            cpu_instead: None,
        };
        assert_eq!(
            v.to_string(),
            "coop forward f16 (native f16): failed (o: max error 3.0e-1 > bound 1.0e-3) \
             → fallback to registers forward f16 (native f16): verified"
        );
        assert!(v.fell_back());
        assert_eq!(v.ran().unwrap().family.family, "registers");
        assert_eq!(
            key("coop").cache_text(),
            "forward coop f16 [native f16]",
            "the cache key's text"
        );
    }

    #[test]
    fn a_forced_family_that_failed_says_it_ran_anyway() {
        let v = Verification {
            tried: vec![Checked {
                family: key("registers"),
                verdict: Verdict::Failed(Evidence {
                    cached: true,
                    ..evidence("dq: NaN at index 3")
                }),
            }],
            forced: true,
            cpu_instead: None,
        };
        assert_eq!(
            v.to_string(),
            "registers forward f16 (native f16): failed (dq: NaN at index 3; cached) — run anyway, as forced"
        );
        assert_eq!(Verdict::NotYetChecked.to_string(), "not yet checked");
    }
}

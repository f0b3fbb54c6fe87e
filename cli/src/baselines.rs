//! The outside baselines of `flashattn bench` — numpy's naive float32
//! attention (always there with numpy) and torch's scaled_dot_product_attention
//! on the CPU (where torch imports) — measured in the same run as the
//! CPU backend by `cli/src/baselines.py`, under the Python interpreter the
//! user names (`--python`, else `$FLASHATTN_PYTHON`, else `python3`). The
//! script is compiled into the binary and written to a temporary file, so
//! the bench works from any directory. Neither library is a dependency.

use crate::bench::{BenchCase, BenchResult, Implementation, Pass};
use crate::decode_bench::DecodeConfig;
use crate::error::{CliError, Result};
use flashattn::Precision;
use std::path::PathBuf;
use std::process::Command;

const SCRIPT: &str = include_str!("baselines.py");

/// The interpreter and the script it runs.
pub struct Baselines {
    python: String,
    script: PathBuf,
}

impl Baselines {
    /// Write the script where `python` can run it.
    pub fn new(python: &str) -> Result<Self> {
        let script =
            std::env::temp_dir().join(format!("flashattn-baselines-{}.py", std::process::id()));
        std::fs::write(&script, SCRIPT).map_err(|source| CliError::Write {
            path: script.clone(),
            source,
        })?;
        Ok(Self {
            python: python.to_string(),
            script,
        })
    }

    /// Time `case` (one untimed warm-up, then `repeats` runs); a missing
    /// module or a failed run is the result's error.
    pub fn run(&self, case: &BenchCase, repeats: usize) -> BenchResult {
        let mut result = BenchResult::new(case);
        match self.seconds(case, repeats) {
            Ok((seconds, note)) => {
                result.seconds = seconds;
                result.note = note;
            }
            Err(e) => result.error = Some(crate::error::one_line(&e)),
        }
        result
    }

    fn seconds(&self, c: &BenchCase, repeats: usize) -> Result<(Vec<f64>, Option<String>)> {
        let fail = |message: String| CliError::Baseline {
            python: self.python.clone(),
            message,
        };
        // FLASHATTN_TORCH_DEVICE=cuda (scripts/cuda-check.sh): torch's SDPA
        // on the GPU, in the case's precision; on the CPU, f32 only.
        let device = std::env::var("FLASHATTN_TORCH_DEVICE").unwrap_or_else(|_| "cpu".into());
        let on_gpu = c.implementation == Implementation::Torch && device == "cuda";
        let dtype = match c.precision {
            Precision::F16 => "float16",
            Precision::Bf16 => "bfloat16",
            _ => "float32",
        };
        if c.precision != Precision::F32 && !on_gpu {
            return Err(fail(format!(
                "the baselines run f32 only, not {}",
                c.precision
            )));
        }
        let pass = match c.pass {
            Pass::Forward => "forward",
            Pass::Backward => "backward",
        };
        let mut cmd = Command::new(&self.python);
        cmd.arg(&self.script)
            .args(["--impl", c.implementation.name(), "--pass", pass])
            .args([
                "--batch",
                &c.batch.to_string(),
                "--heads",
                &c.heads.to_string(),
            ])
            .args(["--seqlen", &c.seqlen.to_string()])
            .args(["--head-dim", &c.head_dim.to_string()])
            .args(["--causal", if c.causal { "1" } else { "0" }])
            .args(["--repeats", &repeats.max(1).to_string()])
            .args(["--device", &device, "--dtype", dtype]);
        self.json_seconds(cmd)
    }
}

impl Baselines {
    /// Seconds of torch's SDPA on the CPU for one decoding step of `c`
    /// (`enable_gqa`, the cache's dtype): one untimed warm-up, then `repeats`.
    pub fn decode(&self, c: &DecodeConfig, repeats: usize) -> Result<Vec<f64>> {
        let dtype = match c.precision {
            Precision::F16 => "float16",
            Precision::Bf16 => "bfloat16",
            _ => "float32",
        };
        let args = [
            ("--batch", c.batch.to_string()),
            ("--heads", c.heads_q.to_string()),
            ("--heads-kv", c.heads_kv.to_string()),
            ("--seqlen", c.cache_len.to_string()),
            ("--head-dim", c.head_dim.to_string()),
            ("--repeats", repeats.max(1).to_string()),
            ("--dtype", dtype.to_string()),
        ];
        let mut cmd = Command::new(&self.python);
        cmd.arg(&self.script)
            .args(["--impl", "torch", "--pass", "decode"]);
        for (flag, value) in &args {
            cmd.args([flag, value.as_str()]);
        }
        self.json_seconds(cmd).map(|(seconds, _)| seconds)
    }

    /// Run `cmd` and read its one JSON object: the seconds, and a note
    /// naming the library's version and threads.
    fn json_seconds(&self, mut cmd: Command) -> Result<(Vec<f64>, Option<String>)> {
        let fail = |message: String| CliError::Baseline {
            python: self.python.clone(),
            message,
        };
        let out = cmd
            .output()
            .map_err(|e| fail(format!("cannot start it: {e}")))?;
        let text = String::from_utf8_lossy(&out.stdout);
        let json: serde_json::Value = serde_json::from_str(text.trim()).map_err(|_| {
            let err = String::from_utf8_lossy(&out.stderr);
            fail(format!(
                "no result ({})",
                err.lines().last().unwrap_or("no output")
            ))
        })?;
        if let Some(e) = json.get("error").and_then(|e| e.as_str()) {
            return Err(fail(e.to_string()));
        }
        let seconds: Vec<f64> = json
            .get("seconds")
            .and_then(|s| s.as_array())
            .map(|a| a.iter().filter_map(|x| x.as_f64()).collect())
            .unwrap_or_default();
        let note = json.get("version").and_then(|v| v.as_str()).map(|v| {
            let name = json
                .get("impl")
                .and_then(|i| i.as_str())
                .unwrap_or("baseline");
            let threads = json.get("threads").and_then(|t| t.as_u64());
            let threads = threads.map_or(String::new(), |t| format!(", {t} threads"));
            format!("{name} {v}{threads}")
        });
        Ok((seconds, note))
    }
}

impl Drop for Baselines {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.script);
    }
}

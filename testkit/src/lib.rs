//! The harness for tests that depend on the machine they run on: a GPU
//! adapter, its features, external tools (`spirv-val`, a C++ compiler,
//! NVRTC), the CUDA driver.
//!
//! A test states what it needs and whether this machine has it:
//!
//! ```no_run
//! use flashattn_testkit::{available, Need};
//! fn have_gxx() -> Result<(), String> {
//!     Err("g++ is not on the PATH".into())
//! }
//! # fn test() {
//! if !available(Need::Cxx, have_gxx()) {
//!     return; // waived: recorded, and listed at the end of scripts/test.sh
//! }
//! # }
//! ```
//!
//! The answer is one of three:
//! - **run**: the need is met (`true`);
//! - **fail**: it is not, and the run requires it — the test panics naming
//!   the need and why it is missing. Each need has a variable
//!   ([`Need::variable`]: `FLASHATTN_REQUIRE_GPU=1` for the adapter and its
//!   subgroups, `FLASHATTN_REQUIRE_SPIRV_VAL=1`, …) and
//!   `FLASHATTN_REQUIRE_ALL=1` requires every one;
//! - **waive**: it is not, and nothing requires it (`false`): the test
//!   returns, after the waiver is printed and appended to the file named by
//!   `FLASHATTN_WAIVERS` (scripts/test.sh lists that file when it ends).
//!
//! Where the machine lacks a device feature and the test checks what the
//! engine does without it instead (the typed error of a forced kernel, an
//! emulation), [`instead`] records that in the same list; it fails only
//! where the feature's variable requires the feature itself.
//!
//! [`engine`] is the process's wgpu engine, one per test binary, under
//! [`Need::Adapter`]. [`full_matrix`] says whether the GPU suites run every
//! combination (`FLASHATTN_FULL_MATRIX=1`) or each distinct code path once.

mod record;

pub use record::{Mode, Outcome, Record};

use flashattn::Engine;
use std::sync::OnceLock;

/// Something a device-dependent test needs from the machine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Need {
    /// A wgpu adapter (Vulkan, Metal, DX12 or GL; lavapipe counts).
    Adapter,
    /// The adapter's SUBGROUP feature (subgroup operations in WGSL).
    Subgroups,
    /// Cooperative matrices on the adapter (wgpu's experimental feature).
    CoopMatrix,
    /// `spirv-val` (Debian `spirv-tools`), to validate the kernels' SPIR-V.
    SpirvVal,
    /// A `spirv-val` that knows SPV_KHR_cooperative_matrix (2024 or later;
    /// Debian 12's 2023.1 does not).
    SpirvValCoop,
    /// A C++ compiler (`g++`), for the CUDA kernels' host emulation.
    Cxx,
    /// NVRTC, to compile the CUDA kernels.
    Nvrtc,
    /// The NVIDIA driver (`libcuda`) and a CUDA device.
    CudaDriver,
}

impl Need {
    /// Every need.
    pub const ALL: [Need; 8] = [
        Need::Adapter,
        Need::Subgroups,
        Need::CoopMatrix,
        Need::SpirvVal,
        Need::SpirvValCoop,
        Need::Cxx,
        Need::Nvrtc,
        Need::CudaDriver,
    ];

    /// The variable that, set to `1`, makes this need required.
    pub fn variable(self) -> &'static str {
        match self {
            Need::Adapter | Need::Subgroups => "FLASHATTN_REQUIRE_GPU",
            Need::CoopMatrix => "FLASHATTN_REQUIRE_COOP",
            Need::SpirvVal | Need::SpirvValCoop => "FLASHATTN_REQUIRE_SPIRV_VAL",
            Need::Cxx => "FLASHATTN_REQUIRE_CXX",
            Need::Nvrtc => "FLASHATTN_REQUIRE_NVRTC",
            Need::CudaDriver => "FLASHATTN_REQUIRE_CUDA",
        }
    }

    /// What the need is, for messages.
    pub fn describe(self) -> &'static str {
        match self {
            Need::Adapter => "a GPU adapter",
            Need::Subgroups => "subgroup operations on the adapter",
            Need::CoopMatrix => "cooperative matrices on the adapter",
            Need::SpirvVal => "spirv-val",
            Need::SpirvValCoop => "a spirv-val that knows SPV_KHR_cooperative_matrix",
            Need::Cxx => "a C++ compiler",
            Need::Nvrtc => "NVRTC",
            Need::CudaDriver => "the NVIDIA driver and a CUDA device",
        }
    }
}

/// The umbrella variable: every need required.
pub const REQUIRE_ALL: &str = "FLASHATTN_REQUIRE_ALL";
/// The file waivers are appended to.
pub const WAIVERS: &str = "FLASHATTN_WAIVERS";
/// Run every combination in the GPU suites, not each code path once.
pub const FULL_MATRIX: &str = "FLASHATTN_FULL_MATRIX";

fn set(var: &str) -> bool {
    std::env::var(var).is_ok_and(|v| v == "1")
}

/// The mode this process runs in, from the environment.
pub fn mode() -> Mode {
    Mode {
        require_all: set(REQUIRE_ALL),
        required: Need::ALL
            .into_iter()
            .map(Need::variable)
            .filter(|v| set(v))
            .collect(),
        waivers: std::env::var_os(WAIVERS).map(Into::into),
    }
}

/// Whether this run requires `need` (its variable or the umbrella is `1`).
pub fn required(need: Need) -> bool {
    mode().requires(need)
}

/// Whether the test may go on: `true` where `probe` is `Ok`. Where it is
/// `Err(why)`: a panic in required mode, else the waiver is recorded and
/// the answer is `false` (the test returns).
pub fn available(need: Need, probe: Result<(), String>) -> bool {
    match probe {
        Ok(()) => true,
        Err(why) => {
            mode().decide(&Record::waived(test_name(), need, &why));
            false
        }
    }
}

/// The machine lacks `need` (`why`) and the test checked `checked`
/// instead: recorded and listed, a panic only where `need` is required.
pub fn instead(need: Need, why: &str, checked: &str) {
    mode().decide(&Record::instead(test_name(), need, why, checked));
}

/// Whether the GPU suites run their full matrix (`FLASHATTN_FULL_MATRIX=1`)
/// rather than each distinct kernel code path once.
pub fn full_matrix() -> bool {
    set(FULL_MATRIX)
}

/// The wgpu engine of this process (one device for every test of the
/// binary), or `None` when no adapter exists and the run does not require
/// one (the waiver is recorded for each test that asked).
pub fn engine() -> Option<&'static Engine> {
    static ENGINE: OnceLock<Result<Engine, String>> = OnceLock::new();
    let e = ENGINE.get_or_init(|| {
        let e = Engine::new().map_err(|e| e.to_string());
        if let Ok(e) = &e {
            eprintln!("GPU tests run on {}", e.describe());
        }
        e
    });
    match e {
        Ok(e) => Some(e),
        Err(why) => {
            available(Need::Adapter, Err(why.clone()));
            None
        }
    }
}

/// The engine where the adapter also has `need`'s feature (subgroups), or
/// `None` as [`available`] decides.
pub fn engine_with(need: Need) -> Option<&'static Engine> {
    let e = engine()?;
    let probe = match need {
        Need::Subgroups => e
            .caps()
            .subgroup
            .map(|_| ())
            .ok_or_else(|| format!("{} has no SUBGROUP feature", e.describe())),
        Need::Adapter => Ok(()),
        other => panic!("engine_with takes adapter features, not {other:?}"),
    };
    available(need, probe).then_some(e)
}

/// The running test's name: the test binary and libtest's thread name
/// (`gpu_forward::odd_seqlens_f32`).
pub fn test_name() -> String {
    let exe = std::env::current_exe().ok();
    let binary = exe
        .as_deref()
        .and_then(|p| p.file_stem())
        .and_then(|s| s.to_str())
        .map(|s| {
            s.rsplit_once('-')
                .map_or(s, |(name, _hash)| name)
                .to_string()
        })
        .unwrap_or_default();
    let thread = std::thread::current();
    match thread.name() {
        Some(t) if t != "main" => format!("{binary}::{t}"),
        _ => binary,
    }
}

//! The command line end to end: results against the f64 reference, and every
//! bad input of docs/semantics.md giving one line on stderr, a non-zero exit and no file.

use flashattn::accuracy::check_forward;
use flashattn::random::Rng;
use flashattn::{AttentionOptions, TensorView};
use half::f16;
use npyz::WriterBuilder;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// The engine of this process, or `None` when no adapter exists and the
/// run does not require one (flashattn-testkit: FLASHATTN_REQUIRE_GPU=1, set
/// by CI and scripts/test.sh, makes a missing adapter fail the test).
use flashattn_testkit::engine;

/// The backends a test runs on: the CPU, and wgpu where an adapter exists.
fn backends() -> &'static [&'static str] {
    if engine().is_some() {
        &["cpu", "wgpu"]
    } else {
        &["cpu"]
    }
}

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_flashattn"));
    c.env("XDG_RUNTIME_DIR", std::env::temp_dir());
    c
}

fn write_f32(path: &Path, shape: &[u64], data: &[f32]) {
    write_array(path, shape, data);
}

fn write_f16(path: &Path, shape: &[u64], data: &[f32]) {
    let mut buf = Vec::new();
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(shape)
        .writer(&mut buf)
        .begin_nd()
        .unwrap();
    w.extend(data.iter().map(|&x| f16::from_f32(x))).unwrap();
    w.finish().unwrap();
    std::fs::write(path, buf).unwrap();
}

fn write_f64(path: &Path, shape: &[u64], n: usize) {
    let mut buf = Vec::new();
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(shape)
        .writer(&mut buf)
        .begin_nd()
        .unwrap();
    w.extend((0..n).map(|i| i as f64)).unwrap();
    w.finish().unwrap();
    std::fs::write(path, buf).unwrap();
}

fn read_f32(path: &Path) -> (Vec<u64>, Vec<f32>) {
    let bytes = std::fs::read(path).unwrap();
    let npy = npyz::NpyFile::new(&bytes[..]).unwrap();
    let shape = npy.shape().to_vec();
    (shape, npy.into_vec::<f32>().unwrap())
}

struct Files {
    dir: tempfile::TempDir,
}

impl Files {
    fn new() -> Self {
        Self {
            dir: tempfile::tempdir().unwrap(),
        }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// q (b, sq, hq, d), k and v (b, sk, hk, d) with seeded values.
    fn qkv(&self, b: usize, sq: usize, sk: usize, hq: usize, hk: usize, d: usize) -> [Vec<f32>; 3] {
        let mut rng = Rng::new(3);
        let q = rng.normal_vec(b * sq * hq * d, 1.0);
        let k = rng.normal_vec(b * sk * hk * d, 1.0);
        let v = rng.normal_vec(b * sk * hk * d, 1.0);
        let (qs, ks) = (
            [b, sq, hq, d].map(|x| x as u64),
            [b, sk, hk, d].map(|x| x as u64),
        );
        write_f32(&self.path("q.npy"), &qs, &q);
        write_f32(&self.path("k.npy"), &ks, &k);
        write_f32(&self.path("v.npy"), &ks, &v);
        [q, k, v]
    }

    /// Run `command` with each `(flag, file)` pointing into this directory.
    fn run(&self, command: &str, files: &[(&str, &str)], extra: &[&str]) -> Output {
        let mut c = bin();
        c.arg(command);
        for (flag, name) in files {
            c.arg(flag).arg(self.path(name));
        }
        c.args(extra).output().unwrap()
    }

    fn forward(&self, extra: &[&str]) -> Output {
        let files = [
            ("--q", "q.npy"),
            ("--k", "k.npy"),
            ("--v", "v.npy"),
            ("--out", "o.npy"),
        ];
        self.run("forward", &files, extra)
    }
}

/// A zero exit (else the stderr it printed).
fn assert_ok(out: &Output) {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Non-zero exit, exactly one non-empty stderr line mentioning `needle`, no o.npy.
fn assert_bad(files: &Files, out: &Output, needle: &str) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure, stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "stderr should be one line: {stderr:?}");
    assert!(
        lines[0].to_lowercase().contains(&needle.to_lowercase()),
        "stderr {:?} should mention {needle:?}",
        lines[0]
    );
    assert!(
        !files.path("o.npy").exists(),
        "a failed run left an output file"
    );
    let leftovers: Vec<_> = std::fs::read_dir(files.dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("partial"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left behind");
}

fn check_o(files: &Files, shape: [[usize; 4]; 2], qkv: &[Vec<f32>; 3], opts: &AttentionOptions) {
    let (oshape, o) = read_f32(&files.path("o.npy"));
    assert_eq!(oshape, shape[0].map(|x| x as u64).to_vec());
    let q = TensorView::f32(shape[0], &qkv[0]);
    let k = TensorView::f32(shape[1], &qkv[1]);
    let v = TensorView::f32(shape[1], &qkv[2]);
    let (_, lse) = read_f32(&files.path("lse.npy"));
    let out = flashattn::ForwardOutput {
        o: flashattn::Tensor {
            shape: shape[0].to_vec(),
            data: flashattn::TensorData::F32(o),
        },
        lse,
        shape: flashattn::AttentionShape::from_views(&q, &k, &v).unwrap(),
        stats: Default::default(),
    };
    for c in check_forward(&out, &q, &k, &v, opts).unwrap() {
        assert!(c.passed(), "{c}");
    }
}

#[test]
fn forward_cpu_matches_reference() {
    let f = Files::new();
    let qkv = f.qkv(2, 37, 45, 4, 2, 24);
    let lse = f.path("lse.npy");
    let out = f.forward(&[
        "--backend",
        "cpu",
        "--causal",
        "--window=-1,5",
        "--lse",
        lse.to_str().unwrap(),
    ]);
    assert_ok(&out);
    let (lshape, _) = read_f32(&lse);
    assert_eq!(lshape, vec![2, 4, 37]);
    let opts = AttentionOptions::default()
        .causal(true)
        .window(None, Some(5));
    check_o(&f, [[2, 37, 4, 24], [2, 45, 2, 24]], &qkv, &opts);
}

#[test]
fn forward_wgpu_matches_reference() {
    if engine().is_none() {
        return;
    }
    let f = Files::new();
    let qkv = f.qkv(1, 50, 33, 2, 1, 40);
    let lse = f.path("lse.npy");
    let out = f.forward(&[
        "--backend",
        "wgpu",
        "--softcap",
        "4",
        "--scale",
        "0.2",
        "--window",
        "7,-1",
        "--lse",
        lse.to_str().unwrap(),
    ]);
    assert_ok(&out);
    let opts = AttentionOptions::default()
        .softcap(4.0)
        .scale(0.2)
        .window(Some(7), None);
    check_o(&f, [[1, 50, 2, 40], [1, 33, 1, 40]], &qkv, &opts);
    // Either forward kernel on request (lanes only where the adapter has it).
    let lse = lse.to_str().unwrap();
    let out = f.forward(&["--backend", "wgpu", "--kernel", "tiled", "--lse", lse]);
    assert_ok(&out);
    check_o(
        &f,
        [[1, 50, 2, 40], [1, 33, 1, 40]],
        &qkv,
        &Default::default(),
    );
    let lanes = f.forward(&["--backend", "wgpu", "--kernel", "lanes", "--lse", lse]);
    if engine().is_some_and(|e| e.caps().lane_subgroup.is_some()) {
        assert_ok(&lanes);
        check_o(
            &f,
            [[1, 50, 2, 40], [1, 33, 1, 40]],
            &qkv,
            &Default::default(),
        );
    } else {
        assert_bad(&f, &lanes, "lanes kernel");
    }
}

#[test]
fn auto_backend_says_which_and_f16_keeps_dtype() {
    let f = Files::new();
    let mut rng = Rng::new(5);
    let q = rng.normal_vec(20 * 2 * 16, 1.0);
    write_f16(&f.path("q.npy"), &[1, 20, 2, 16], &q);
    write_f16(&f.path("k.npy"), &[1, 20, 2, 16], &q);
    write_f16(&f.path("v.npy"), &[1, 20, 2, 16], &q);
    let out = f.forward(&["--backend", "auto"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    // `auto` says which backend it chose and why, on one line.
    let why: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("flashattn: "))
        .collect();
    assert_eq!(why.len(), 1, "{stderr}");
    assert!(
        why[0].contains("wgpu") || why[0].contains("CPU backend"),
        "{stderr}"
    );
    let bytes = std::fs::read(f.path("o.npy")).unwrap();
    let npy = npyz::NpyFile::new(&bytes[..]).unwrap();
    assert_eq!(npy.dtype().descr(), "'<f2'");
}

#[test]
fn missing_file() {
    let f = Files::new();
    f.qkv(1, 4, 4, 1, 1, 8);
    std::fs::remove_file(f.path("k.npy")).unwrap();
    assert_bad(&f, &f.forward(&["--backend", "cpu"]), "k");
}

#[test]
fn wrong_rank() {
    let f = Files::new();
    f.qkv(1, 4, 4, 1, 1, 8);
    write_f32(&f.path("q.npy"), &[4, 8], &[0.0; 32]);
    assert_bad(&f, &f.forward(&["--backend", "cpu"]), "rank");
}

#[test]
fn mismatched_shapes() {
    let f = Files::new();
    f.qkv(1, 4, 4, 1, 1, 8);
    write_f32(&f.path("v.npy"), &[1, 5, 1, 8], &[0.0; 40]);
    assert_bad(&f, &f.forward(&["--backend", "cpu"]), "differ");
    f.qkv(1, 4, 4, 1, 1, 8);
    write_f32(&f.path("k.npy"), &[1, 4, 1, 7], &[0.0; 28]);
    write_f32(&f.path("v.npy"), &[1, 4, 1, 7], &[0.0; 28]);
    assert_bad(&f, &f.forward(&["--backend", "cpu"]), "head_dim");
    f.qkv(1, 4, 4, 1, 1, 8);
    write_f32(&f.path("k.npy"), &[2, 4, 1, 8], &[0.0; 64]);
    write_f32(&f.path("v.npy"), &[2, 4, 1, 8], &[0.0; 64]);
    assert_bad(&f, &f.forward(&["--backend", "cpu"]), "batch");
}

#[test]
fn heads_not_divisible() {
    let f = Files::new();
    f.qkv(1, 4, 4, 3, 2, 8);
    assert_bad(&f, &f.forward(&["--backend", "cpu"]), "heads");
}

#[test]
fn head_dim_too_large() {
    let f = Files::new();
    f.qkv(1, 2, 2, 1, 1, 577);
    assert_bad(&f, &f.forward(&["--backend", "cpu"]), "head dim");
}

#[test]
fn unsupported_dtype() {
    let f = Files::new();
    f.qkv(1, 4, 4, 1, 1, 8);
    write_f64(&f.path("q.npy"), &[1, 4, 1, 8], 32);
    assert_bad(&f, &f.forward(&["--backend", "cpu"]), "dtype");
    f.qkv(1, 4, 4, 1, 1, 8);
    write_f16(&f.path("k.npy"), &[1, 4, 1, 8], &[0.0; 32]);
    assert_bad(&f, &f.forward(&["--backend", "cpu"]), "dtype");
}

#[test]
fn non_finite_scale() {
    let f = Files::new();
    f.qkv(1, 4, 4, 1, 1, 8);
    assert_bad(
        &f,
        &f.forward(&["--backend", "cpu", "--scale", "nan"]),
        "scale",
    );
    assert_bad(
        &f,
        &f.forward(&["--backend", "cpu", "--scale", "inf"]),
        "scale",
    );
    assert_bad(
        &f,
        &f.forward(&["--backend", "cpu", "--softcap", "-1"]),
        "softcap",
    );
}

/// Built with `--features cuda` on a machine without the NVIDIA driver:
/// one line naming it, no output file (and no panic); with the driver, the
/// command runs on the device.
#[cfg(feature = "cuda")]
#[test]
fn cuda_without_a_driver_names_it() {
    if flashattn::cuda::driver_present() {
        // The no-driver error is not reachable here: the same command runs
        // on the CUDA device instead and meets the rule.
        let f = Files::new();
        let qkv = f.qkv(1, 4, 4, 1, 1, 8);
        let lse = f.path("lse.npy");
        let out = f.forward(&["--backend", "cuda", "--lse", lse.to_str().unwrap()]);
        assert_ok(&out);
        check_o(&f, [[1, 4, 1, 8]; 2], &qkv, &Default::default());
        return;
    }
    let f = Files::new();
    f.qkv(1, 4, 4, 1, 1, 8);
    let out = f.forward(&["--backend", "cuda"]);
    assert_bad(&f, &out, "libcuda (the NVIDIA driver) not found");
    // The layout flags parse and reach the CUDA backend (which takes them
    // all), forward and backward: the same one line.
    let f = Files::new();
    layout_files(&f);
    let outs = [("--out", "o.npy"), ("--lse", "lse.npy")];
    let out = layout_run(&f, "forward", &outs, &["--backend", "cuda"]);
    assert_bad(&f, &out, "libcuda (the NVIDIA driver) not found");
    std::fs::copy(f.path("q.npy"), f.path("do.npy")).unwrap();
    let grads = [
        ("--do", "do.npy"),
        ("--dq", "dq.npy"),
        ("--dk", "dk.npy"),
        ("--dv", "dv.npy"),
        ("--dsinks", "ds.npy"),
    ];
    let out = layout_run(&f, "backward", &grads, &["--backend", "cuda"]);
    assert_bad(&f, &out, "libcuda (the NVIDIA driver) not found");
}

/// `plan --backend cuda` from made-up properties needs no GPU: tiles,
/// warps, stages and shared memory of the tensor-core kernels; forcing them
/// for f32 names why not.
#[cfg(feature = "cuda")]
#[test]
fn cuda_plan_explains_the_kernels_from_made_up_properties() {
    let args = ["plan", "--backend", "cuda", "--device-like", "h200"];
    let out = bin()
        .args(args)
        .args(["--precision", "bf16", "--head-dim", "128"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The Hopper forward and backward (its dQ kernel in the same module,
    // whose 193 KiB of shared memory set the launch's).
    assert!(text.contains("flash_fwd_wgmma_bf16_d128_band"), "{text}");
    assert!(
        text.contains("128 rows × 128 streamed per block, 12 warps, 2 stages"),
        "{text}"
    );
    assert!(
        text.contains("backward: flash_bwd_wgmma_bf16_d128_band"),
        "{text}"
    );
    assert!(text.contains("2 stages, 197672 B shared"), "{text}");
    assert!(!text.contains("flash_bwd_mma"), "{text}");
    // Forced off: the sm80 forward, saying so.
    let off = bin()
        .args(args)
        .args([
            "--precision",
            "bf16",
            "--head-dim",
            "128",
            "--kernel",
            "mma",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&off.stdout);
    assert!(text.contains("flash_fwd_mma_bf16_d128_band"), "{text}");
    assert!(text.contains("not the Hopper forward"), "{text}");
    let forced = bin().args(args).args(["--kernel", "mma"]).output().unwrap();
    assert!(!forced.status.success());
    let err = String::from_utf8_lossy(&forced.stderr);
    assert!(err.contains("does not support f32 storage"), "{err}");
    // --arch: the sm80 build on Hopper plans the sm80 forward; an
    // architecture the device cannot run, or no architecture, is one line.
    let plan_arch = |device: &str, arch: &str| {
        bin()
            .args(["plan", "--backend", "cuda", "--device-like", device])
            .args(["--precision", "bf16", "--head-dim", "128", "--arch", arch])
            .output()
            .unwrap()
    };
    let sm80 = plan_arch("h100", "compute_80");
    let text = String::from_utf8_lossy(&sm80.stdout);
    assert!(
        sm80.status.success(),
        "{}",
        String::from_utf8_lossy(&sm80.stderr)
    );
    assert!(text.contains("kernels for compute_80"), "{text}");
    assert!(text.contains("flash_fwd_mma_bf16_d128_band"), "{text}");
    for (device, arch, needle) in [
        (
            "a100",
            "compute_90a",
            "the device is older than the architecture",
        ),
        ("h100", "volta", "unknown CUDA architecture"),
    ] {
        let out = plan_arch(device, arch);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && err.lines().count() == 1, "{err}");
        assert!(err.contains(needle), "{err}");
    }
}

#[test]
fn unsupported_backend_flags() {
    let f = Files::new();
    f.qkv(1, 4, 4, 1, 1, 8);
    assert_bad(&f, &f.forward(&["--backend", "cuda"]), "cuda");
    assert_bad(
        &f,
        &f.forward(&["--backend", "cpu", "--arch", "compute_80"]),
        "--arch applies to --backend cuda only",
    );
    assert_bad(
        &f,
        &f.forward(&["--backend", "cpu", "--block-q", "8"]),
        "wgpu",
    );
    assert_bad(
        &f,
        &f.forward(&["--backend", "cpu", "--kernel", "lanes"]),
        "wgpu",
    );
    assert_bad(&f, &f.forward(&["--kernel", "wide"]), "kernel");
    assert_bad(&f, &f.forward(&["--backend", "tpu"]), "backend");
    assert_bad(&f, &f.forward(&["--precision", "bf17"]), "precision");
    assert_bad(&f, &f.forward(&["--window", "3"]), "window");
    assert_bad(&f, &f.forward(&["--frobnicate"]), "frobnicate");
}

#[test]
fn unwritable_output_leaves_nothing() {
    let f = Files::new();
    f.qkv(1, 4, 4, 1, 1, 8);
    let out = bin()
        .args(["forward", "--backend", "cpu"])
        .arg("--q")
        .arg(f.path("q.npy"))
        .arg("--k")
        .arg(f.path("k.npy"))
        .arg("--v")
        .arg(f.path("v.npy"))
        .arg("--out")
        .arg(f.path("o.npy"))
        .arg("--lse")
        .arg(f.path("missing-dir/lse.npy"))
        .output()
        .unwrap();
    assert_bad(&f, &out, "lse.npy");
}

#[test]
fn plan_shows_formula_and_clamps() {
    if engine().is_none() {
        return;
    }
    let out = bin().args(["plan", "--head-dim", "64"]).output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert_ok(&out);
    for needle in [
        "adapter:",
        "max_compute_workgroup_storage_size",
        "Bc = ceil(M/4d)",
        "Br =",
        "workgroup =",
        "clamps:",
    ] {
        assert!(text.contains(needle), "missing {needle}: {text}");
    }
    let out = bin()
        .args([
            "plan",
            "--head-dim",
            "256",
            "--max-workgroup-storage",
            "4000",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("workgroup storage"), "{text}");
    let out = bin().args(["plan", "--head-dim", "600"]).output().unwrap();
    assert!(!out.status.success());
}

#[test]
fn tune_times_the_candidates_caches_the_winner_and_plan_shows_it() {
    if engine().is_none() {
        return;
    }
    let f = Files::new();
    let cache = f.path("cache");
    let plan = |extra: &[&str]| {
        let out = bin()
            .args(["plan", "--head-dim", "32", "--cache-dir"])
            .arg(&cache)
            .args(extra)
            .output()
            .unwrap();
        assert_ok(&out);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    assert!(plan(&[]).contains("tuned: none — run flashattn tune"));
    let out = bin()
        .args(["tune", "--seqlen", "64", "--head-dim", "32", "--heads", "1"])
        .args(["--repeats", "1", "--cache-dir"])
        .arg(&cache)
        .arg("--json")
        .arg(f.path("tune.json"))
        .output()
        .unwrap();
    assert_ok(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "adapter:",
        "timer: ",
        "forward, N 64, d 32, f32",
        "candidate",
        "Br×Bc",
        "invocations/row",
        "formula",
        "<- fastest",
        "winner: ",
        "cached in ",
        "tuned-plans.tsv",
    ] {
        assert!(text.contains(needle), "missing {needle}: {text}");
    }
    assert_eq!(text.matches("<- fastest").count(), 1, "{text}");
    let json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(f.path("tune.json")).unwrap()).unwrap();
    let rows = json["problems"][0]["candidates"].as_array().unwrap();
    assert!(rows.len() >= 2, "{json}");
    assert!(
        rows.iter().all(|r| r["ms"].as_f64().unwrap() > 0.0),
        "{json}"
    );
    assert_eq!(rows.iter().filter(|r| r["fastest"] == true).count(), 1);
    // `plan` shows the winner for N 64 (and the bucket it covers), not for
    // other lengths, masks or the backward.
    let shown = plan(&[]);
    let lines: Vec<&str> = shown.lines().filter(|l| l.contains("tuned")).collect();
    assert_eq!(lines.len(), 2, "{shown}");
    assert!(lines[0].contains("tuned (seqlen <= 64, none): "), "{shown}");
    assert!(lines[0].contains("tuned-plans.tsv"), "{shown}");
    assert!(
        lines[1].contains("tuned: none — run flashattn tune"),
        "{shown}"
    );
    assert!(plan(&["--seqlen", "40"]).contains("tuned (seqlen <= 64"));
    assert!(!plan(&["--seqlen", "65"]).contains("tuned (seqlen"));
    assert!(!plan(&["--causal"]).contains("tuned (seqlen"));
    // `forward --tuned` says which plan it found, for N 64 and not for N 65.
    let forward = |n: usize| {
        f.qkv(1, n, n, 1, 1, 32);
        let mut c = bin();
        c.env("FLASHATTN_CACHE_DIR", &cache).arg("forward");
        for (flag, name) in [
            ("--q", "q.npy"),
            ("--k", "k.npy"),
            ("--v", "v.npy"),
            ("--out", "o.npy"),
        ] {
            c.arg(flag).arg(f.path(name));
        }
        let out = c.args(["--backend", "wgpu", "--tuned"]).output().unwrap();
        assert_ok(&out);
        assert!(f.path("o.npy").exists());
        String::from_utf8_lossy(&out.stderr).into_owned()
    };
    let said = forward(64);
    assert!(said.contains("flashattn: tuned forward plan ("), "{said}");
    assert!(!said.contains("none: the formula plan"), "{said}");
    let said = forward(65);
    assert!(
        said.contains("tuned forward plan") && said.contains("none: the formula plan"),
        "{said}"
    );
    let out = f.forward(&["--backend", "cpu", "--tuned"]);
    assert_bad(&Files::new(), &out, "--tuned");
}

/// wgpu's plan flags with the default `--backend auto` run wgpu, the
/// backend they apply to, and say so — not the CPU backend that auto would
/// have timed faster, which refused --block-q/--block-k and dropped
/// --kernel, --rows-per-thread and --tuned.
#[test]
fn auto_with_plan_flags_runs_wgpu_and_says_why() {
    let f = Files::new();
    let qkv = f.qkv(1, 9, 11, 2, 1, 8);
    let (o, lse) = (f.path("o.npy"), f.path("lse.npy"));
    let outputs = ["--out", o.to_str().unwrap(), "--lse", lse.to_str().unwrap()];
    for (extra, said) in [
        (
            &["--block-q", "4", "--block-k", "4"][..],
            "as --block-q and --block-k apply to the wgpu backend only",
        ),
        (
            &["--kernel", "tiled"],
            "as --kernel applies to the wgpu backend only",
        ),
    ] {
        let out = f.run(
            "forward",
            &[("--q", "q.npy"), ("--k", "k.npy"), ("--v", "v.npy")],
            &[&outputs[..], extra].concat(),
        );
        if engine().is_none() {
            assert_bad(&f, &out, "adapter");
            continue;
        }
        assert_ok(&out);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(stderr.contains("flashattn: wgpu on "), "{stderr}");
        assert!(stderr.contains(said), "{stderr}");
        check_o(
            &f,
            [[1, 9, 2, 8], [1, 11, 1, 8]],
            &qkv,
            &AttentionOptions::default(),
        );
        std::fs::remove_file(&o).unwrap();
        std::fs::remove_file(&lse).unwrap();
    }
}

/// A flag that conflicts with several others names them all on its line.
#[test]
fn a_conflict_with_several_flags_names_them() {
    let f = Files::new();
    f.qkv(1, 4, 4, 1, 1, 8);
    let out = f.forward(&["--tuned", "--block-q", "8", "--kernel", "tiled"]);
    assert_eq!(out.status.code(), Some(2));
    assert_bad(&f, &out, "--tuned");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("--block-q") && stderr.contains("--kernel"),
        "{stderr}"
    );
}

#[test]
fn tune_rejects_bad_flags_in_one_line() {
    let f = Files::new();
    for (args, needle) in [
        (&["--backend", "cpu"][..], "--backend"),
        (&["--pass", "sideways"], "--pass"),
        (&["--head-dim", "0"], "--head-dim"),
        (&["--head-dim", "600"], "head dim"),
        (&["--seqlens", "12,x"], "--seqlens"),
        (&["--precision", "f8"], "precision"),
        (&["--repeats", "0"], "--repeats"),
    ] {
        let out = bin()
            .arg("tune")
            .args(args)
            .arg("--cache-dir")
            .arg(f.path("cache"))
            .output()
            .unwrap();
        assert_bad(&f, &out, needle);
        assert!(!f.path("cache").exists(), "{args:?} wrote a cache");
    }
    // A cache directory that is a file: one line before anything is timed.
    std::fs::write(f.path("file"), b"").unwrap();
    let out = bin()
        .args(["tune", "--seqlens", "16", "--repeats", "1", "--cache-dir"])
        .arg(f.path("file"))
        .output()
        .unwrap();
    assert_bad(&f, &out, "--cache-dir");
    assert!(out.stdout.is_empty(), "tune ran first");
}

/// Sizes no host can hold (2^50 bytes of inputs) are one line from demo
/// and a FAILED row from bench, not an abort in the allocator.
#[test]
fn demo_and_bench_refuse_sizes_the_host_cannot_hold() {
    let f = Files::new();
    let huge = [
        "--seqlen",
        "67108864",
        "--heads",
        "16384",
        "--head-dim",
        "64",
    ];
    let out = bin()
        .args(["demo", "--backend", "cpu"])
        .args(huge)
        .output()
        .unwrap();
    assert_bad(&f, &out, "host memory");
    let out = bin()
        .args([
            "bench",
            "--impls",
            "cpu",
            "--passes",
            "forward",
            "--repeats",
            "1",
        ])
        .args(["--seqlens", "67108864", "--heads", "16384"])
        .output()
        .unwrap();
    assert_ok(&out);
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(
        table.contains("FAILED") && table.contains("host memory"),
        "{table}"
    );
}

#[test]
fn demo_runs_and_passes() {
    let backend = if engine().is_some() { "wgpu" } else { "cpu" };
    let out = bin()
        .args([
            "demo",
            "--seqlen",
            "200",
            "--heads",
            "2",
            "--head-dim",
            "48",
            "--backend",
            backend,
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in ["backend:", "GFLOP/s", "max error", "PASS"] {
        assert!(text.contains(needle), "missing {needle}: {text}");
    }
}

/// Without a Vulkan driver (hidden here), `auto` still finds the fastest
/// path — the CPU backend, or llvmpipe over GL where Mesa's GL driver is
/// installed and faster — says why, and the demo passes quickly.
#[test]
fn demo_without_vulkan_chooses_and_says_why() {
    let start = std::time::Instant::now();
    let out = bin()
        .env("VK_ICD_FILENAMES", "/nonexistent")
        .args([
            "demo",
            "--seqlen",
            "256",
            "--heads",
            "2",
            "--head-dim",
            "32",
        ])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let why = text
        .lines()
        .find(|l| l.starts_with("why: "))
        .unwrap_or_default();
    assert!(why.contains("CPU") || why.contains("took"), "{text}");
    let backend = text
        .lines()
        .find(|l| l.starts_with("backend: "))
        .unwrap_or_default();
    assert!(!backend.contains("Vulkan"), "{text}");
    assert!(text.contains("PASS"), "{text}");
    assert!(start.elapsed().as_secs() < 60, "took {:?}", start.elapsed());
}

fn backward_cmd(f: &Files, extra: &[&str]) -> Output {
    let files = [
        ("--q", "q.npy"),
        ("--k", "k.npy"),
        ("--v", "v.npy"),
        ("--do", "do.npy"),
        ("--dq", "dq.npy"),
        ("--dk", "dk.npy"),
        ("--dv", "dv.npy"),
    ];
    f.run("backward", &files, extra)
}

fn check_grads(
    f: &Files,
    qs: [usize; 4],
    ks: [usize; 4],
    qkv: &[Vec<f32>; 3],
    g: &[f32],
    opts: &AttentionOptions,
) {
    let q = TensorView::f32(qs, &qkv[0]);
    let k = TensorView::f32(ks, &qkv[1]);
    let v = TensorView::f32(ks, &qkv[2]);
    let d_o = TensorView::f32(qs, g);
    let t = |name: &str, shape: [usize; 4]| {
        let (s, data) = read_f32(&f.path(name));
        assert_eq!(s, shape.map(|x| x as u64).to_vec(), "{name}");
        flashattn::Tensor {
            shape: shape.to_vec(),
            data: flashattn::TensorData::F32(data),
        }
    };
    let out = flashattn::BackwardOutput {
        dq: t("dq.npy", qs),
        dk: t("dk.npy", ks),
        dv: t("dv.npy", ks),
        dsinks: None,
        stats: Default::default(),
    };
    for c in flashattn::accuracy::check_backward(&out, &q, &k, &v, &d_o, opts).unwrap() {
        assert!(c.passed(), "{c}");
    }
}

#[test]
fn backward_matches_reference_on_each_backend() {
    let backends = backends();
    for backend in backends {
        let f = Files::new();
        let qkv = f.qkv(1, 29, 41, 4, 2, 24);
        let g = Rng::new(9).normal_vec(29 * 4 * 24, 1.0);
        write_f32(&f.path("do.npy"), &[1, 29, 4, 24], &g);
        let out = backward_cmd(&f, &["--backend", backend, "--causal", "--softcap", "5"]);
        assert!(
            out.status.success(),
            "{backend}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let opts = AttentionOptions::default().causal(true).softcap(5.0);
        check_grads(&f, [1, 29, 4, 24], [1, 41, 2, 24], &qkv, &g, &opts);
    }
}

/// `name`'s f32 values, each checked to be exactly a bf16 value.
fn read_bf16_values(f: &Files, name: &str) -> (Vec<u64>, TensorData) {
    let bytes = std::fs::read(f.path(name)).unwrap();
    let npy = npyz::NpyFile::new(&bytes[..]).unwrap();
    assert_eq!(npy.dtype().descr(), "'<f4'", "{name}: bf16 travels as f32");
    let (shape, data) = read_f32(&f.path(name));
    for x in &data {
        assert_eq!(x.to_bits() & 0xffff, 0, "{name}: {x} is not a bf16 value");
    }
    (shape, TensorData::from_f32(data, Precision::Bf16))
}

/// `--precision bf16` on f32 files: inputs rounded to bf16 on load, outputs
/// bf16 values written as f32, all within docs/semantics.md's rule (bf16 noise and a
/// bf16 baseline) against the f64 reference on the rounded inputs.
#[test]
fn bf16_rounds_inputs_and_writes_bf16_values_as_f32() {
    let backends = backends();
    let (qs, ks) = ([1, 29, 4, 24], [1, 41, 2, 24]);
    for backend in backends {
        let f = Files::new();
        let qkv = f.qkv(1, 29, 41, 4, 2, 24);
        let g = Rng::new(9).normal_vec(29 * 4 * 24, 1.0);
        write_f32(&f.path("do.npy"), &[1, 29, 4, 24], &g);
        let flags = ["--backend", backend, "--causal", "--precision", "bf16"];
        let lse = f.path("lse.npy");
        let mut fwd_flags = flags.to_vec();
        fwd_flags.extend(["--lse", lse.to_str().unwrap()]);
        assert_ok(&f.forward(&fwd_flags));
        assert_ok(&backward_cmd(&f, &flags));
        let opts = AttentionOptions::default().causal(true);
        let [q, k, v] = [(&qkv[0], qs), (&qkv[1], ks), (&qkv[2], ks)]
            .map(|(x, _)| TensorData::from_f32(x.clone(), Precision::Bf16));
        let d_o = TensorData::from_f32(g.clone(), Precision::Bf16);
        let views = [q.view(qs), k.view(ks), v.view(ks)];
        let (_, o) = read_bf16_values(&f, "o.npy");
        let out = flashattn::ForwardOutput {
            o: flashattn::Tensor {
                shape: qs.to_vec(),
                data: o,
            },
            lse: read_f32(&lse).1,
            shape: flashattn::AttentionShape::from_views(&views[0], &views[1], &views[2]).unwrap(),
            stats: Default::default(),
        };
        for c in check_forward(&out, &views[0], &views[1], &views[2], &opts).unwrap() {
            assert!(c.passed(), "{backend} forward: {c}");
        }
        let t = |name: &str, shape: [usize; 4]| flashattn::Tensor {
            shape: shape.to_vec(),
            data: read_bf16_values(&f, name).1,
        };
        let grads = flashattn::BackwardOutput {
            dq: t("dq.npy", qs),
            dk: t("dk.npy", ks),
            dv: t("dv.npy", ks),
            dsinks: None,
            stats: Default::default(),
        };
        let [q, k, v] = views;
        let checks =
            flashattn::accuracy::check_backward(&grads, &q, &k, &v, &d_o.view(qs), &opts).unwrap();
        for c in checks {
            assert!(c.passed(), "{backend} backward: {c}");
        }
    }
}

/// `--precision fp8 [--hadamard]` runs the FP8 forward: o written as f32,
/// its RMSE against the f64 reference within 10% of the same quantization
/// computed naively in f64 (docs/semantics.md); backward and decode refuse FP8, and
/// --hadamard needs it.
#[test]
fn fp8_forward_and_its_errors() {
    let backends = backends();
    let (qs, ks) = ([1, 37, 4, 40], [1, 45, 2, 40]);
    for backend in backends {
        for hadamard in [false, true] {
            let f = Files::new();
            let qkv = f.qkv(1, 37, 45, 4, 2, 40);
            let mut flags = vec!["--backend", backend, "--causal", "--precision", "fp8"];
            if hadamard {
                flags.push("--hadamard");
            }
            assert_ok(&f.forward(&flags));
            let (shape, o) = read_f32(&f.path("o.npy"));
            assert_eq!(shape, qs.map(|x| x as u64).to_vec());
            let views = [
                TensorView::f32(qs, &qkv[0]),
                TensorView::f32(ks, &qkv[1]),
                TensorView::f32(ks, &qkv[2]),
            ];
            let out = flashattn::ForwardOutput {
                o: Tensor {
                    shape: qs.to_vec(),
                    data: TensorData::F32(o),
                },
                lse: vec![0.0; 4 * 37],
                shape: flashattn::AttentionShape::from_views(&views[0], &views[1], &views[2])
                    .unwrap(),
                stats: Default::default(),
            };
            let fp8 = match hadamard {
                true => flashattn::Fp8Options::hadamard(flashattn::Fp8Options::DEFAULT_SEED),
                false => flashattn::Fp8Options::default(),
            };
            let opts = AttentionOptions::default().causal(true);
            let [q, k, v] = views;
            let inputs = flashattn::ForwardInputs::new(q, k, v);
            let r = flashattn::accuracy::fp8_report(&out, &inputs, &opts, &fp8).unwrap();
            assert!(
                r.rmse_ratio() <= 1.1,
                "{backend} {fp8:?}: {} vs {}",
                r.o,
                r.naive
            );
        }
    }
    let f = Files::new();
    f.qkv(1, 8, 8, 2, 1, 16);
    write_f32(&f.path("do.npy"), &[1, 8, 2, 16], &[0.0; 256]);
    let out = backward_cmd(&f, &["--backend", "cpu", "--precision", "fp8"]);
    assert_bad(&f, &out, "forward pass only");
    assert_bad(&f, &f.forward(&["--hadamard"]), "--hadamard");
    assert_bad(
        &f,
        &f.forward(&["--precision", "f16", "--hadamard"]),
        "--hadamard",
    );
    // An unknown precision lists every value these commands take, fp8 too.
    for bad in ["F16", "fp9", "e4m3", ""] {
        let out = f.forward(&["--backend", "cpu", "--precision", bad]);
        assert_bad(&f, &out, "--precision expects f32, f16, bf16 or fp8");
        let out = backward_cmd(&f, &["--backend", "cpu", "--precision", bad]);
        assert_bad(&f, &out, "--precision expects f32, f16, bf16 or fp8");
    }
}

/// `plan --precision fp8`: the FP8 forward's plan (f32 tiles over rows of
/// the head dim rounded up to a multiple of 4, e4m3 storage) and no
/// backward; fp8 decoding is one line.
#[test]
fn plan_shows_the_fp8_forward_plan() {
    let f = Files::new();
    let bad = bin()
        .args(["plan", "--precision", "fp8", "--decode", "--head-dim", "8"])
        .args(["--heads-q", "1", "--heads-kv", "1", "--cache-len", "4"])
        .output()
        .unwrap();
    assert_bad(&f, &bad, "forward pass only");
    let bad = bin().args(["plan", "--precision", "fp9"]).output().unwrap();
    assert_bad(&f, &bad, "f32, f16, bf16 or fp8");
    if engine().is_none() {
        return;
    }
    let out = bin()
        .args(["plan", "--precision", "fp8", "--head-dim", "6"])
        .output()
        .unwrap();
    assert_ok(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "head_dim 6, fp8",
        "rows of 8",
        "d = 8; storage fp8 e4m3",
        "Bc = ceil(M/4d)",
        "backward:\n  not possible: FP8 (e4m3) runs the forward pass only",
    ] {
        assert!(text.contains(needle), "missing {needle:?}: {text}");
    }
}

#[test]
fn backward_bad_inputs_write_nothing() {
    let f = Files::new();
    f.qkv(1, 8, 8, 2, 1, 16);
    write_f32(&f.path("do.npy"), &[1, 8, 2, 8], &[0.0; 128]);
    let out = backward_cmd(&f, &["--backend", "cpu"]);
    assert_bad(&f, &out, "do");
    for name in ["dq.npy", "dk.npy", "dv.npy"] {
        assert!(!f.path(name).exists());
    }
    std::fs::remove_file(f.path("do.npy")).unwrap();
    assert_bad(&f, &backward_cmd(&f, &["--backend", "cpu"]), "do");
    write_f16(&f.path("do.npy"), &[1, 8, 2, 16], &[0.0; 256]);
    assert_bad(&f, &backward_cmd(&f, &["--backend", "cpu"]), "do");
}

#[test]
fn bench_writes_table_json_csv_and_plots() {
    if engine().is_none() {
        return;
    }
    let f = Files::new();
    let (json, csv, plot) = (f.path("b.json"), f.path("b.csv"), f.path("b.svg"));
    let out = bin()
        .args([
            "bench",
            "--seqlens",
            "64,96",
            "--passes",
            "forward,backward",
            "--repeats",
            "1",
            "--sweep-m",
            "--sweep-seqlen",
            "64",
        ])
        .arg("--json")
        .arg(&json)
        .arg("--csv")
        .arg(&csv)
        .arg("--plot")
        .arg(&plot)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "ceiling:",
        "GFLOP/s",
        "forward  flash",
        "backward naive",
        "speedup of flash",
        "Theorem 2",
    ] {
        assert!(text.contains(needle), "missing {needle}: {text}");
    }
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let results = report["results"].as_array().unwrap();
    assert_eq!(results.len(), 2 * 2 * 3);
    assert!(results
        .iter()
        .all(|r| r["error"].is_null() && r["seconds"].as_array().unwrap().len() == 1));
    assert_eq!(
        std::fs::read_to_string(&csv).unwrap().lines().count(),
        1 + 12
    );
    for part in ["time", "memory", "accesses"] {
        let svg = std::fs::read_to_string(f.path(&format!("b-{part}.svg"))).unwrap();
        assert!(svg.starts_with("<svg") || svg.contains("<svg"), "{part}");
    }
}

#[test]
fn bench_bad_arguments() {
    let f = Files::new();
    let out = bin()
        .args(["bench", "--plot"])
        .arg(f.path("x.txt"))
        .output()
        .unwrap();
    assert_bad(&f, &out, "plot");
    let out = bin().args(["bench", "--seqlens", "0"]).output().unwrap();
    assert_bad(&f, &out, "seqlens");
    // Nothing to run is a mistake, not an empty table.
    for (flag, value) in [("--seqlens", ""), ("--seqlens", ","), ("--passes", "")] {
        let out = bin().args(["bench", flag, value]).output().unwrap();
        assert_bad(&f, &out, flag);
    }
    let out = bin().args(["tune", "--seqlens", ""]).output().unwrap();
    assert_bad(&f, &out, "--seqlens");
    // A report that cannot be written fails before the run, not after it.
    let nowhere = f.path("missing-dir/r.json");
    for (command, flag) in [("bench", "--json"), ("bench", "--csv"), ("tune", "--json")] {
        let out = bin()
            .args([command, "--seqlens", "16", "--repeats", "1", flag])
            .arg(&nowhere)
            .output()
            .unwrap();
        assert_bad(&f, &out, flag);
        assert!(out.stdout.is_empty(), "{command} {flag} ran first");
    }
    // A problem with no heads or no sequences is one line, not a table of
    // failed rows that exits 0.
    for flag in ["--heads", "--batch"] {
        let out = bin()
            .args(["bench", "--seqlens", "16", "--repeats", "1", flag, "0"])
            .output()
            .unwrap();
        assert_bad(&f, &out, flag);
    }
    // No timed repeat, nothing to report (as tune says), in every mode.
    for mode in [
        &["bench"][..],
        &["bench", "--decode"],
        &["bench", "--sparse"],
    ] {
        let out = bin().args(mode).args(["--repeats", "0"]).output().unwrap();
        assert_bad(&f, &out, "--repeats");
    }
    let out = bin().args(["bench", "--impls", "tpu"]).output().unwrap();
    assert_bad(&f, &out, "tpu");
    for bad in ["1", "0,1.5", "-0.1", "x"] {
        let out = bin()
            .arg("bench")
            .arg(format!("--dropouts={bad}"))
            .output()
            .unwrap();
        assert_bad(&f, &out, "--dropouts");
    }
}

/// `--dropouts`: each case the CPU backend runs at each probability, its
/// cost against none reported from the same run, in the table and the CSV.
#[test]
fn bench_measures_dropout_against_none() {
    let f = Files::new();
    let csv = f.path("b.csv");
    let args = [
        "bench",
        "--impls",
        "cpu",
        "--seqlens",
        "64",
        "--head-dims",
        "16",
    ];
    let more = [
        "--passes",
        "forward,backward",
        "--repeats",
        "1",
        "--dropouts",
        "0,0.25",
    ];
    let out = bin()
        .args(args)
        .args(more)
        .arg("--csv")
        .arg(&csv)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        text.lines().filter(|l| l.ends_with("dropout 0.25")).count(),
        2,
        "{text}"
    );
    let costs = text
        .split("dropout's cost")
        .nth(1)
        .expect("the cost section");
    assert!(
        costs.contains("forward cpu N 64 d 16: dropout 0.25"),
        "{text}"
    );
    assert!(
        costs.contains("backward cpu N 64 d 16: dropout 0.25"),
        "{text}"
    );
    let table = std::fs::read_to_string(&csv).unwrap();
    assert!(table.lines().next().unwrap().contains("dropout"));
    assert_eq!(table.lines().count(), 1 + 4);
}

#[test]
fn bench_runs_the_outside_baselines_or_says_why_not() {
    let bench = |python: &str| {
        let args = ["bench", "--impls", "cpu,numpy,torch", "--seqlens", "64"];
        let more = ["--passes", "forward", "--repeats", "1", "--python", python];
        let out = bin().args(args).args(more).output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let row = |text: &str, name: &str| {
        let found = text.lines().find(|l| l.contains(&format!(" {name} ")));
        found.unwrap().to_string()
    };
    // No interpreter: both baselines are rows that say why, the CPU row is measured.
    let text = bench("/nonexistent/python");
    for name in ["numpy", "torch"] {
        let row = row(&text, name);
        assert!(
            row.contains("FAILED") && row.contains("cannot start"),
            "{row}"
        );
    }
    assert!(!row(&text, "cpu").contains("FAILED"), "{text}");
    // python3: each baseline is measured (and a ratio printed) or not importable.
    let text = bench("python3");
    for name in ["numpy", "torch"] {
        let row = row(&text, name);
        assert!(
            row.contains("not importable") || text.contains(&format!("x {name}")),
            "{text}"
        );
    }
}

// ---- decode ----

#[allow(dead_code)]
#[path = "../../tests/common/decode.rs"]
mod decode;
#[path = "../../tests/common/kv_quant.rs"]
mod kv_quant;

use decode::{CaseData, DecodeCase, Index};
use flashattn::{DecodeOutput, HostKvCache, Precision, Tensor, TensorData};

fn write_i32(path: &Path, shape: &[u64], data: &[i32]) {
    write_array(path, shape, data);
}

fn write_i64(path: &Path, shape: &[u64], data: &[i64]) {
    write_array(path, shape, data);
}

/// A tensor in its own dtype.
fn write_tensor(path: &Path, shape: &[usize], data: &TensorData) {
    let shape: Vec<u64> = shape.iter().map(|&x| x as u64).collect();
    match data.precision() {
        Precision::F16 => write_f16(path, &shape, &data.to_f32()),
        _ => write_f32(path, &shape, &data.to_f32()),
    }
}

/// A tensor read back in its own dtype.
fn read_tensor(path: &Path) -> Tensor {
    let bytes = std::fs::read(path).unwrap();
    let npy = npyz::NpyFile::new(&bytes[..]).unwrap();
    let shape: Vec<usize> = npy.shape().iter().map(|&d| d as usize).collect();
    let data = if npy.dtype().descr() == "'<f2'" {
        TensorData::F16(npy.into_vec::<f16>().unwrap())
    } else {
        TensorData::F32(npy.into_vec::<f32>().unwrap())
    };
    Tensor { shape, data }
}

/// The files of a decoding case: q.npy, kc.npy, vc.npy, cs.npy, and as the
/// case has them ix.npy (cache_batch_idx), bt.npy (block table), kn.npy and
/// vn.npy (new rows); the flags naming them and its options.
fn write_decode_case(f: &Files, d: &CaseData) -> Vec<String> {
    let c = &d.case;
    let b = c.batch();
    let path = |name: &str| f.path(name).to_str().unwrap().to_string();
    write_tensor(
        &f.path("q.npy"),
        &[b, c.seqlen_q, c.heads_q, c.head_dim],
        &d.q,
    );
    write_tensor(&f.path("kc.npy"), &d.cache.shape.dims(), &d.cache.k);
    write_i32(&f.path("cs.npy"), &[b as u64], &d.lens);
    let mut args: Vec<String> = vec![];
    for (flag, name) in [
        ("--q", "q.npy"),
        ("--k-cache", "kc.npy"),
        ("--cache-seqlens", "cs.npy"),
        ("--out", "o.npy"),
        ("--lse", "lse.npy"),
    ] {
        args.extend([flag.to_string(), path(name)]);
    }
    // A latent cache is its one tensor: V its first head_dim_v columns.
    if c.latent {
        args.extend(["--latent-v".into(), c.head_dim_v.to_string()]);
    } else {
        write_tensor(&f.path("vc.npy"), &d.cache.shape.v_dims(), &d.cache.v);
        args.extend(["--v-cache".into(), path("vc.npy")]);
    }
    match &d.index {
        Index::Dense(None) => {}
        Index::Dense(Some(idx)) => {
            write_i32(&f.path("ix.npy"), &[b as u64], idx);
            args.extend(["--cache-batch-idx".into(), path("ix.npy")]);
        }
        Index::Paged(table, max_pages) => {
            write_i32(&f.path("bt.npy"), &[b as u64, *max_pages as u64], table);
            args.extend(["--block-table".into(), path("bt.npy")]);
        }
    }
    if c.seqlen_new > 0 && c.latent {
        let shape = [b, c.seqlen_new, c.heads_kv, c.head_dim];
        write_tensor(&f.path("kn.npy"), &shape, &d.k_new);
        args.extend(["--k-new".into(), path("kn.npy")]);
    } else if c.seqlen_new > 0 {
        let shape = |d| [b, c.seqlen_new, c.heads_kv, d];
        write_tensor(&f.path("kn.npy"), &shape(c.head_dim), &d.k_new);
        write_tensor(&f.path("vn.npy"), &shape(c.head_dim_v), &d.v_new);
        args.extend([
            "--k-new".into(),
            path("kn.npy"),
            "--v-new".into(),
            path("vn.npy"),
        ]);
    }
    let o = &c.opts;
    if o.causal {
        args.push("--causal".into());
    }
    if !o.window.is_unbounded() {
        let side = |x: Option<usize>| x.map_or(-1, |x| x as i64);
        args.push(format!(
            "--window={},{}",
            side(o.window.left),
            side(o.window.right)
        ));
    }
    if let Some(s) = o.softcap {
        args.extend(["--softcap".into(), s.to_string()]);
    }
    if let Some(s) = o.scale {
        args.extend(["--scale".into(), s.to_string()]);
    }
    if let Some(a) = &o.alibi {
        let slopes = a.slopes();
        let shape = if a.per_batch(c.heads_q) {
            vec![b as u64, c.heads_q as u64]
        } else {
            vec![c.heads_q as u64]
        };
        write_f32(&f.path("slopes.npy"), &shape, slopes);
        args.extend(["--alibi".into(), path("slopes.npy")]);
    }
    if let Some(s) = &o.sinks {
        write_f32(&f.path("sinks.npy"), &[c.heads_q as u64], s.logits());
        args.extend(["--sinks".into(), path("sinks.npy")]);
    }
    args.extend(["--num-splits".into(), c.num_splits.unwrap_or(0).to_string()]);
    args
}

fn decode_cmd(args: &[String], extra: &[&str]) -> Output {
    bin().arg("decode").args(args).args(extra).output().unwrap()
}

/// o and lse under docs/semantics.md's rule against the f64 reference, and the
/// written caches bit-identical to docs/semantics.md's append.
fn check_decoded(f: &Files, d: &CaseData, label: &str) {
    let step = d.step();
    let o = read_tensor(&f.path("o.npy"));
    assert_eq!(o.precision(), d.q.precision(), "{label}: o keeps q's dtype");
    let (lse_shape, lse) = read_f32(&f.path("lse.npy"));
    let c = &d.case;
    assert_eq!(
        lse_shape,
        [c.batch(), c.heads_q, c.seqlen_q].map(|x| x as u64)
    );
    assert_eq!(o.shape, [c.batch(), c.seqlen_q, c.heads_q, c.head_dim_v]);
    let out = DecodeOutput {
        o,
        lse,
        lse_shape: [c.batch(), c.heads_q, c.seqlen_q],
        num_splits: 0,
        stats: Default::default(),
    };
    for check in flashattn::accuracy::check_decode(&out, &d.cache, &step, &c.opts).unwrap() {
        assert!(check.passed(), "{label} {c:?}: {check}");
    }
    let expected = flashattn::reference::decode_cache(&d.cache, &step).unwrap();
    let written = HostKvCache::from_tensors(
        read_tensor(&f.path("kc2.npy")),
        read_tensor(&f.path("vc2.npy")),
        d.cache.shape.is_paged(),
    )
    .unwrap();
    assert!(
        written == expected,
        "{label} {c:?}: the written caches differ from docs/semantics.md's append"
    );
}

/// Decoding cases for the command line: dense, cache rows, paged (page
/// size 1 and 16 over shuffled pages), with and without new rows, masks,
/// softcap and scale, f16 and f32, one and three splits.
fn cli_decode_cases() -> Vec<DecodeCase> {
    let causal = AttentionOptions::default().causal(true);
    let window = AttentionOptions::default().window(Some(8), Some(0));
    vec![
        DecodeCase::new(&[37, 0, 90], 32),
        DecodeCase::new(&[20, 61], 16)
            .batch_idx()
            .append(2)
            .opts(causal.clone()),
        DecodeCase::new(&[45, 9], 24)
            .heads(4, 1)
            .paged(1)
            .append(1)
            .f16(),
        DecodeCase::new(&[70, 3, 33], 32)
            .paged(16)
            .seqlen_q(2)
            .append(3)
            .opts(window.softcap(4.0)),
        DecodeCase::new(&[50], 40)
            .f16()
            .opts(AttentionOptions::default().softcap(5.0).scale(0.3)),
        DecodeCase::new(&[700, 300], 64)
            .heads(8, 1)
            .append(1)
            .splits(1),
        DecodeCase::new(&[700, 300], 64)
            .heads(8, 1)
            .paged(16)
            .append(1)
            .splits(3)
            .opts(causal.clone()),
        // V's head dim its own: o has it too.
        DecodeCase::new(&[60, 7], 32).dv(24).paged(16).append(2),
        // ALiBi per sequence and sinks, a sequence with no key (lse = sink).
        DecodeCase::new(&[400, 0], 32)
            .heads(4, 2)
            .paged(16)
            .splits(3)
            .opts(
                causal
                    .alibi(flashattn::Alibi::new(&[
                        0.5, 0.1, 0.02, 0.0, 0.25, 0.05, 0.01, 1.0,
                    ]))
                    .sinks(flashattn::Sinks::new(&[0.5, -1.0, 0.0, 2.0])),
            ),
    ]
}

#[test]
fn decode_matches_reference_on_each_backend() {
    let backends = backends();
    for backend in backends {
        for case in cli_decode_cases() {
            let f = Files::new();
            let d = case.data();
            let args = write_decode_case(&f, &d);
            let (kc2, vc2) = (f.path("kc2.npy"), f.path("vc2.npy"));
            let out = decode_cmd(
                &args,
                &[
                    "--backend",
                    backend,
                    "--k-cache-out",
                    kc2.to_str().unwrap(),
                    "--v-cache-out",
                    vc2.to_str().unwrap(),
                ],
            );
            assert!(
                out.status.success(),
                "{backend} {case:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            check_decoded(&f, &d, backend);
        }
    }
}

/// DeepSeek's MLA on the command line: `--latent-v 512` reads a 576-wide
/// K cache as a latent cache (128 query heads on one kv head, dense and
/// paged, seqlen_q 1 and 4), `--k-new` alone appends, `--k-cache-out` writes
/// the one tensor; a v flag beside it, or a view wider than the rows, fails
/// and writes nothing.
#[test]
fn decode_reads_a_latent_cache() {
    let cases = [
        DecodeCase::new(&[40, 7], 576)
            .dv(512)
            .heads(128, 1)
            .latent()
            .append(1)
            .splits(3),
        DecodeCase::new(&[30, 0], 576)
            .dv(512)
            .heads(8, 1)
            .seqlen_q(4)
            .paged(16)
            .latent()
            .append(4)
            .opts(AttentionOptions::default().causal(true)),
    ];
    for backend in backends() {
        for case in &cases {
            let f = Files::new();
            let d = case.data();
            let args = write_decode_case(&f, &d);
            let kc2 = f.path("kc2.npy");
            let out = decode_cmd(
                &args,
                &["--backend", backend, "--k-cache-out", kc2.to_str().unwrap()],
            );
            assert!(
                out.status.success(),
                "{backend} {case:?}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            let step = d.step();
            let o = read_tensor(&f.path("o.npy"));
            let c = &d.case;
            assert_eq!(o.shape, [c.batch(), c.seqlen_q, c.heads_q, 512]);
            let (_, lse) = read_f32(&f.path("lse.npy"));
            let out = DecodeOutput {
                o,
                lse,
                lse_shape: [c.batch(), c.heads_q, c.seqlen_q],
                num_splits: 0,
                stats: Default::default(),
            };
            for check in flashattn::accuracy::check_decode(&out, &d.cache, &step, &c.opts).unwrap()
            {
                assert!(check.passed(), "{backend} {c:?}: {check}");
            }
            let expected = flashattn::reference::decode_cache(&d.cache, &step).unwrap();
            let written = read_tensor(&kc2);
            assert_eq!(written.shape, expected.shape.dims().to_vec());
            assert!(
                written.data == expected.k,
                "{backend} {c:?}: the written cache"
            );
            assert!(!f.path("vc2.npy").exists());
        }
    }
    let f = Files::new();
    let d = DecodeCase::new(&[5, 9], 16).dv(8).latent().append(1).data();
    let args = write_decode_case(&f, &d);
    let vc = f.path("kc.npy");
    let with_v = decode_cmd(&args, &["--v-cache", vc.to_str().unwrap()]);
    assert_decode_bad(&f, &with_v, "--latent-v");
    let wide = without(&args, "--latent-v");
    let wide = decode_cmd(&wide, &["--latent-v", "17"]);
    assert_decode_bad(&f, &wide, "wider");
}

/// Non-zero exit, one stderr line mentioning `needle`, and none of the
/// decode command's outputs (nor a temporary file) left behind.
fn assert_decode_bad(f: &Files, out: &Output, needle: &str) {
    assert_bad(f, out, needle);
    for name in ["lse.npy", "kc2.npy", "vc2.npy"] {
        assert!(!f.path(name).exists(), "a failed run left {name}");
    }
}

/// A small valid case (dense, 2 sequences, new rows), its files and flags
/// with the cache outputs.
fn bad_input_case(f: &Files) -> Vec<String> {
    let d = DecodeCase::new(&[5, 9], 8).append(2).data();
    bad_input_case_paths(f, &d)
}

/// `args` without `flag` and its value.
fn without(args: &[String], flag: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut skip = false;
    for a in args {
        if skip {
            skip = false;
        } else if a == flag {
            skip = true;
        } else {
            out.push(a.clone());
        }
    }
    out
}

#[test]
fn decode_bad_inputs_write_nothing() {
    let f = Files::new();
    let args = bad_input_case(&f);
    let run = |args: &[String], extra: &[&str]| {
        decode_cmd(args, &[&["--backend", "cpu"], extra].concat())
    };
    // The valid case runs, and writes everything.
    assert_ok(&run(&args, &[]));
    for name in ["o.npy", "lse.npy", "kc2.npy", "vc2.npy"] {
        assert!(f.path(name).exists(), "{name}");
        std::fs::remove_file(f.path(name)).unwrap();
    }
    let cs = f.path("cs.npy");
    let bad = |needle: &str, args: &[String], extra: &[&str]| {
        let out = run(args, extra);
        eprintln!("{needle}: {}", String::from_utf8_lossy(&out.stderr).trim());
        assert_decode_bad(&f, &out, needle);
    };
    // Lengths past the capacity (26 + 2 new > 9 + 16 + 2), negative lengths.
    write_i32(&cs, &[2], &[5, 26]);
    bad("capacity", &args, &[]);
    write_i32(&cs, &[2], &[-1, 3]);
    bad("negative", &args, &[]);
    write_i32(&cs, &[3], &[1, 2, 3]);
    bad("cache_seqlens", &args, &[]);
    write_i32(&cs, &[2, 1], &[1, 2]);
    bad("rank", &args, &[]);
    write_f32(&cs, &[2], &[1.0, 2.0]);
    bad("int32", &args, &[]);
    write_i64(&cs, &[2], &[1, 1 << 40]);
    bad("int32's range", &args, &[]);
    write_i64(&cs, &[2], &[5, 9]);
    assert_ok(&run(&args, &[]));
    std::fs::remove_file(f.path("o.npy")).unwrap();
    std::fs::remove_file(f.path("lse.npy")).unwrap();
    std::fs::remove_file(f.path("kc2.npy")).unwrap();
    std::fs::remove_file(f.path("vc2.npy")).unwrap();
    // Pairs of flags.
    bad("--v-new", &without(&args, "--v-new"), &[]);
    bad("--k-new", &without(&args, "--k-new"), &[]);
    bad("--v-cache-out", &without(&args, "--v-cache-out"), &[]);
    // Cache rows out of range.
    let ix = f.path("ix.npy").to_str().unwrap().to_string();
    write_i32(&f.path("ix.npy"), &[2], &[1, 2]);
    bad("out of range", &args, &["--cache-batch-idx", &ix]);
    write_i32(&f.path("ix.npy"), &[2], &[0, -1]);
    bad("negative", &args, &["--cache-batch-idx", &ix]);
    // Shapes and dtypes.
    write_f32(&f.path("vn.npy"), &[2, 2, 1, 8], &[0.0; 32]);
    bad("v_new", &args, &[]);
    write_f16(&f.path("vn.npy"), &[2, 2, 2, 8], &[0.0; 64]);
    bad("dtype", &args, &[]);
    write_f32(&f.path("vn.npy"), &[2, 2, 2, 8], &[0.0; 64]);
    write_f32(&f.path("vc.npy"), &[2, 21, 2, 4], &[0.0; 336]);
    bad("v_cache", &args, &[]);
    write_f32(&f.path("vc.npy"), &[2, 21, 2], &[0.0; 84]);
    bad("rank", &args, &[]);
    std::fs::remove_file(f.path("vc.npy")).unwrap();
    bad("v_cache", &args, &[]);
    // Flags.
    assert_decode_bad(&f, &decode_cmd(&args, &["--backend", "cuda"]), "cuda");
    let out = decode_cmd(&without(&args, "--out"), &[]);
    assert_decode_bad(&f, &out, "--out");
    bad(
        "num-splits",
        &without(&args, "--num-splits"),
        &["--num-splits", "-1"],
    );
    bad("precision", &args, &["--precision", "f64"]);
    bad("forward pass only", &args, &["--precision", "fp8"]);
    bad("scale", &args, &["--scale", "nan"]);
}

/// Slopes and sinks that fit neither the heads nor the batch, and the
/// layouts decoding does not take, are one line each and no output.
#[test]
fn decode_bad_score_terms_write_nothing() {
    let f = Files::new();
    let args = bad_input_case(&f);
    let file = |name: &str| f.path(name).to_str().unwrap().to_string();
    let bad = |needle: &str, extra: &[&str]| {
        let out = decode_cmd(&args, &[&["--backend", "cpu"], extra].concat());
        assert_decode_bad(&f, &out, needle);
    };
    write_f32(&f.path("slopes.npy"), &[3], &[0.5; 3]);
    bad("alibi", &["--alibi", &file("slopes.npy")]);
    write_f32(&f.path("sinks.npy"), &[5], &[0.0; 5]);
    bad("sinks", &["--sinks", &file("sinks.npy")]);
    write_f32(&f.path("sinks.npy"), &[4], &[0.0, f32::NAN, 0.0, 0.0]);
    bad("sinks", &["--sinks", &file("sinks.npy")]);
    write_array(&f.path("mask.npy"), &[1, 1, 1, 1], &[1u8]);
    bad(
        "block-sparse",
        &["--block-mask", &file("mask.npy"), "--block-size", "4,4"],
    );
}

#[test]
fn decode_paged_bad_inputs_write_nothing() {
    let f = Files::new();
    let d = DecodeCase::new(&[20, 3], 8).paged(4).append(1).data();
    let args = write_decode_case(&f, &d);
    let run = |extra: &[&str]| decode_cmd(&args, &[&["--backend", "cpu"], extra].concat());
    assert_ok(&run(&[]));
    std::fs::remove_file(f.path("o.npy")).unwrap();
    std::fs::remove_file(f.path("lse.npy")).unwrap();
    let Index::Paged(table, max_pages) = &d.index else {
        unreachable!()
    };
    let pages = d.cache.shape.dims()[0] as i32;
    let bt = f.path("bt.npy");
    let shape = [2, *max_pages as u64];
    // A page past the cache; the table's rows must be the batch.
    let mut t = table.clone();
    t[1] = pages;
    write_i32(&bt, &shape, &t);
    assert_decode_bad(&f, &run(&[]), "out of range");
    t[1] = -3;
    write_i32(&bt, &shape, &t);
    assert_decode_bad(&f, &run(&[]), "out of range");
    write_i32(&bt, &[1, *max_pages as u64], &table[..*max_pages]);
    assert_decode_bad(&f, &run(&[]), "batch");
    write_i32(&bt, &[2 * *max_pages as u64], table);
    assert_decode_bad(&f, &run(&[]), "rank");
    // A paged cache takes no cache_batch_idx.
    write_i32(&bt, &shape, table);
    write_i32(&f.path("ix.npy"), &[2], &[0, 1]);
    let ix = f.path("ix.npy").to_str().unwrap().to_string();
    assert_decode_bad(&f, &run(&["--cache-batch-idx", &ix]), "cache_batch_idx");
}

#[test]
fn decode_precision_converts_and_outputs_keep_file_dtypes() {
    let f = Files::new();
    let d = DecodeCase::new(&[30, 12], 16).append(1).data();
    let args = bad_input_case_paths(&f, &d);
    // f32 files run in f16: o and the caches come back as f32.
    let out = decode_cmd(&args, &["--backend", "cpu", "--precision", "f16"]);
    assert_ok(&out);
    for name in ["o.npy", "kc2.npy", "vc2.npy"] {
        assert_eq!(
            read_tensor(&f.path(name)).precision(),
            Precision::F32,
            "{name}"
        );
    }
    for name in ["o.npy", "lse.npy", "kc2.npy", "vc2.npy"] {
        std::fs::remove_file(f.path(name)).unwrap();
    }
    // Mixed dtypes need --precision.
    let k = d.cache.k.to_f32();
    let dims: Vec<u64> = d.cache.shape.dims().iter().map(|&x| x as u64).collect();
    write_f16(&f.path("kc.npy"), &dims, &k);
    assert_decode_bad(
        &f,
        &decode_cmd(&args, &["--backend", "cpu"]),
        "k_cache has dtype f16",
    );
    let out = decode_cmd(&args, &["--backend", "cpu", "--precision", "f32"]);
    assert_ok(&out);
    assert_eq!(read_tensor(&f.path("kc2.npy")).precision(), Precision::F16);
    assert_eq!(read_tensor(&f.path("vc2.npy")).precision(), Precision::F32);
}

/// The case's files and flags, with the cache outputs.
fn bad_input_case_paths(f: &Files, d: &CaseData) -> Vec<String> {
    let mut args = write_decode_case(f, d);
    for (flag, name) in [("--k-cache-out", "kc2.npy"), ("--v-cache-out", "vc2.npy")] {
        args.extend([flag.to_string(), f.path(name).to_str().unwrap().to_string()]);
    }
    args
}

#[test]
fn decode_auto_says_which_backend_and_why() {
    let f = Files::new();
    let d = DecodeCase::new(&[40, 7], 16).heads(4, 2).append(1).data();
    let args = write_decode_case(&f, &d);
    let out = decode_cmd(&args, &["--backend", "auto"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    let why: Vec<&str> = stderr
        .lines()
        .filter(|l| l.starts_with("flashattn: "))
        .collect();
    assert_eq!(why.len(), 1, "{stderr}");
    assert!(
        why[0].contains("wgpu") || why[0].contains("CPU backend") || why[0].contains("GPU"),
        "{stderr}"
    );
    assert!(f.path("o.npy").exists());
}

#[test]
fn plan_decode_prints_splits_and_reasons() {
    let plan = |extra: &[&str]| {
        let base = ["plan", "--decode", "--heads-q", "32", "--heads-kv", "8"];
        bin().args(base).args(extra).output().unwrap()
    };
    if engine().is_some() {
        let out = plan(&["--head-dim", "128", "--cache-len", "8192", "--batch", "2"]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert_ok(&out);
        for needle in [
            "adapter:",
            "decode: batch 2, seqlen_q 1, heads 32/8, head_dim 128, 8192 keys",
            "decode plan:",
            "packed rows per workgroup",
            "splits:",
            "why:",
            "workgroups per split",
        ] {
            assert!(text.contains(needle), "missing {needle}: {text}");
        }
        let out = plan(&[
            "--head-dim",
            "64",
            "--cache-len",
            "4096",
            "--num-splits",
            "3",
        ]);
        let text = String::from_utf8_lossy(&out.stdout);
        assert_ok(&out);
        assert!(text.contains("3 splits requested"), "{text}");
    }
    let f = Files::new();
    // Missing sizes are named; sizes are checked before any adapter is opened.
    assert_bad(&f, &plan(&["--head-dim", "64"]), "--cache-len");
    let out = bin()
        .args(["plan", "--decode", "--heads-q", "32", "--heads-kv", "5"])
        .args(["--head-dim", "64", "--cache-len", "10"])
        .output()
        .unwrap();
    assert_bad(&f, &out, "multiple of heads_kv");
    let out = bin().args(["plan", "--cache-len", "10"]).output().unwrap();
    assert_bad(&f, &out, "--decode");
}

#[test]
fn bench_decode_quick_prints_a_table_with_the_copy_bandwidth() {
    let f = Files::new();
    let (json, csv) = (f.path("d.json"), f.path("d.csv"));
    let backends = if engine().is_some() {
        "wgpu,cpu"
    } else {
        "cpu"
    };
    let out = bin()
        .args(["bench", "--decode", "--quick", "--repeats", "2"])
        .args(["--cache-lens", "64,300", "--backends", backends])
        .arg("--json")
        .arg(&json)
        .arg("--csv")
        .arg(&csv)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for needle in [
        "host copy bandwidth",
        "K/V GB/s",
        "% copy",
        "no append",
        "cpu     f16       2     300 planner",
        "cpu     f32       1      64 1",
        "cpu     int8      2     300 planner",
        "cpu     fp8       1      64 1",
        "int8 and fp8 rows: quantized caches",
    ]
    .into_iter()
    .chain(
        backends
            .contains("wgpu")
            .then_some([
                "wgpu    int8      2     300 planner",
                "wgpu    fp8       1      64 1",
            ])
            .into_iter()
            .flatten(),
    ) {
        assert!(text.contains(needle), "missing {needle}: {text}");
    }
    let backends_n = backends.split(',').count();
    // 2 batches × 2 lengths × 2 split modes, of 2 plain and 2 quantized
    // dtypes per backend.
    let rows = 8 * 4 * backends_n;
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let results = report["results"].as_array().unwrap();
    assert_eq!(results.len(), rows);
    for r in results {
        assert!(r["error"].is_null(), "{r}");
        assert_eq!(r["seconds"].as_array().unwrap().len(), 2, "{r}");
        assert!(r["num_splits"].as_u64().unwrap() >= 1, "{r}");
    }
    if engine().is_some() {
        assert!(
            text.contains("copy bandwidth (wgpu copy kernel, 4 MiB"),
            "{text}"
        );
        assert!(report["copy"]["gbps"].as_f64().unwrap() > 0.0);
        assert!(
            text.contains("wgpu    f32       2     300 planner"),
            "{text}"
        );
    }
    assert_eq!(
        std::fs::read_to_string(&csv).unwrap().lines().count(),
        1 + rows
    );
}

/// The CPU backend's instruction set as FLASHATTN_CPU_ISA chose it, and
/// torch's rows: measured under an interpreter with torch, else one failed
/// row per group saying why.
#[test]
fn bench_decode_names_the_isa_and_runs_torch_or_says_why_not() {
    let bench = |python: &str| {
        let out = bin()
            .env("FLASHATTN_CPU_ISA", "portable")
            .args(["bench", "--decode", "--quick", "--repeats", "1"])
            .args(["--cache-lens", "64", "--batches", "1", "--dtypes", "f32"])
            .args(["--backends", "cpu,torch", "--python", python])
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        assert!(
            out.status.success(),
            "{text}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        text
    };
    let text = bench("/nonexistent/python");
    assert!(text.contains("cpu backend: portable,"), "{text}");
    let torch: Vec<&str> = text.lines().filter(|l| l.starts_with("torch ")).collect();
    assert_eq!(torch.len(), 1, "one torch row per group: {text}");
    assert!(torch[0].contains("cannot start"), "{text}");
    assert_eq!(
        text.lines().filter(|l| l.starts_with("cpu     ")).count(),
        2,
        "{text}"
    );
    let text = bench("python3");
    let torch = text.lines().find(|l| l.starts_with("torch ")).unwrap();
    assert!(
        torch.contains("not importable") || text.contains("cpu vs torch, f32 batch 1 cache 64: "),
        "{text}"
    );
}

#[test]
fn bench_decode_mla_times_a_latent_cache() {
    let out = bin()
        .args(["bench", "--decode", "--quick", "--mla", "--repeats", "1"])
        .args([
            "--cache-lens",
            "64",
            "--batches",
            "1",
            "--dtypes",
            "f32,int8",
        ])
        .args(["--backends", "cpu"])
        .output()
        .unwrap();
    assert_ok(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "latent cache (MLA): one tensor of width 576, V its first 512 columns",
        "heads 128/1, head_dim 576",
        "cpu     f32       1      64 planner",
        "cpu     int8      1      64 planner",
    ] {
        assert!(text.contains(needle), "missing {needle}: {text}");
    }
}

/// `--backends cuda,cpu`: with the `cuda` feature, the CUDA rows are
/// measured on the device against its copy bandwidth, or each fails saying
/// why where there is none, and the CPU rows run either way; without the
/// feature, one line naming it.
#[test]
fn bench_decode_cuda_rows_run_or_say_why_beside_the_cpu_rows() {
    let f = Files::new();
    let (json, csv) = (f.path("d.json"), f.path("d.csv"));
    let out = bin()
        .args(["bench", "--decode", "--quick", "--repeats", "1"])
        .args([
            "--cache-lens",
            "64",
            "--batches",
            "1",
            "--dtypes",
            "f32,int8",
        ])
        .args(["--backends", "cuda,cpu"])
        .arg("--json")
        .arg(&json)
        .arg("--csv")
        .arg(&csv)
        .output()
        .unwrap();
    if !cfg!(feature = "cuda") {
        assert_bad(&f, &out, "--features cuda");
        assert!(!json.exists() && !csv.exists());
        return;
    }
    assert_ok(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    let rows =
        |prefix: &str| -> Vec<&str> { text.lines().filter(|l| l.starts_with(prefix)).collect() };
    // 2 dtypes × 2 split modes each.
    let (cuda, cpu) = (rows("cuda    "), rows("cpu     "));
    assert_eq!((cuda.len(), cpu.len()), (4, 4), "{text}");
    assert!(cpu.iter().all(|r| !r.contains("FAILED")), "{text}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    if cuda_device() {
        assert!(cuda.iter().all(|r| !r.contains("FAILED")), "{text}");
        assert!(
            text.contains("cuda copy bandwidth (device-to-device copy"),
            "{text}"
        );
        assert!(text.contains("step times: CUDA events"), "{text}");
        assert!(report["cuda"]["copy"]["gbps"].as_f64().unwrap() > 0.0);
    } else {
        for r in &cuda {
            assert!(
                r.contains("FAILED: the CUDA backend cannot start"),
                "{text}"
            );
        }
        assert!(
            text.contains("cuda: no device (the CUDA backend cannot start"),
            "{text}"
        );
        assert!(report["cuda"]["device"].is_null(), "{report}");
    }
    let csv = std::fs::read_to_string(&csv).unwrap();
    assert_eq!(csv.lines().count(), 1 + 8, "{csv}");
    assert_eq!(
        csv.lines().filter(|l| l.starts_with("cuda,")).count(),
        4,
        "{csv}"
    );
}

/// Whether this process can open the CUDA backend.
fn cuda_device() -> bool {
    #[cfg(feature = "cuda")]
    return flashattn::cuda::Cuda::new().is_ok();
    #[cfg(not(feature = "cuda"))]
    false
}

#[test]
fn bench_decode_bad_arguments() {
    let f = Files::new();
    let bench = |args: &[&str]| bin().arg("bench").args(args).output().unwrap();
    assert_bad(&f, &bench(&["--decode", "--cache-lens", "0"]), "cache-lens");
    assert_bad(&f, &bench(&["--decode", "--backends", "tpu"]), "tpu");
    assert_bad(&f, &bench(&["--decode", "--dtypes", "fp4"]), "fp4");
    // The list names the quantized dtypes too.
    let out = bench(&["--decode", "--dtypes", "f64"]);
    assert_bad(&f, &out, "f32, f16, bf16, int8 or fp8");
    assert_bad(
        &f,
        &bench(&["--decode", "--heads-q", "6", "--heads-kv", "4"]),
        "heads",
    );
    assert_bad(&f, &bench(&["--decode", "--seqlens", "64"]), "--seqlens");
    assert_bad(&f, &bench(&["--cache-lens", "64"]), "--decode");
}

/// Any plain array as `.npy` (bool, u8, f32, i32 …).
fn write_array<T: npyz::AutoSerialize + Copy>(path: &Path, shape: &[u64], data: &[T]) {
    let mut buf = Vec::new();
    let mut w = npyz::WriteOptions::new()
        .default_dtype()
        .shape(shape)
        .writer(&mut buf)
        .begin_nd()
        .unwrap();
    w.extend(data.iter().copied()).unwrap();
    w.finish().unwrap();
    std::fs::write(path, buf).unwrap();
}

/// A packed batch with every layout file: q (total_q, 4, 24), k/v (total_k,
/// 2, 24), cu_seqlens, slopes per sequence, sinks, a u8 block mask of 7×13
/// blocks (per head); returns the tensors and the options they stand for.
fn layout_files(f: &Files) -> ([Vec<f32>; 3], [[usize; 4]; 3], AttentionOptions) {
    let (lq, lk) = ([9usize, 0, 30, 17], [12usize, 20, 0, 25]);
    let (tq, tk): (usize, usize) = (lq.iter().sum(), lk.iter().sum());
    let (hq, hk, d) = (4, 2, 24);
    let mut rng = Rng::new(5);
    let q = rng.normal_vec(tq * hq * d, 1.0);
    let k = rng.normal_vec(tk * hk * d, 1.0);
    let v = rng.normal_vec(tk * hk * d, 1.0);
    write_f32(&f.path("q.npy"), &[tq as u64, hq as u64, d as u64], &q);
    write_f32(&f.path("k.npy"), &[tk as u64, hk as u64, d as u64], &k);
    write_f32(&f.path("v.npy"), &[tk as u64, hk as u64, d as u64], &v);
    let cu = |l: &[usize]| -> Vec<i32> {
        std::iter::once(0)
            .chain(l.iter().scan(0, |a, &n| {
                *a += n as i32;
                Some(*a)
            }))
            .collect()
    };
    write_i32(&f.path("cq.npy"), &[5], &cu(&lq));
    write_i32(&f.path("ck.npy"), &[5], &cu(&lk));
    let slopes: Vec<f32> = (0..16).map(|i| 0.03 * (i + 1) as f32).collect();
    write_f32(&f.path("slopes.npy"), &[4, 4], &slopes);
    let sinks = [0.5f32, -1.0, 0.0, 2.0];
    write_f32(&f.path("sinks.npy"), &[4], &sinks);
    // ceil(30 / 7) = 5 row blocks, ceil(25 / 13) = 2 column blocks.
    let mask: Vec<u8> = (0..4 * 5 * 2).map(|i| ((i * 7) % 3 != 0) as u8).collect();
    write_array(&f.path("mask.npy"), &[1, 4, 5, 2], &mask);
    let opts = AttentionOptions::default()
        .causal(true)
        .alibi(flashattn::Alibi::new(&slopes))
        .sinks(flashattn::Sinks::new(&sinks))
        .block_mask(flashattn::BlockMask::new([1, 4, 5, 2], (7, 13), &mask).unwrap())
        .varlen(flashattn::Varlen::new(&cu(&lq), &cu(&lk)).unwrap());
    let shapes = [[1, tq, hq, d], [1, tk, hk, d], [1, tk, hk, d]];
    ([q, k, v], shapes, opts)
}

/// The layout flags of [`layout_files`].
const LAYOUT_FLAGS: [(&str, &str); 5] = [
    ("--cu-seqlens-q", "cq.npy"),
    ("--cu-seqlens-k", "ck.npy"),
    ("--alibi", "slopes.npy"),
    ("--sinks", "sinks.npy"),
    ("--block-mask", "mask.npy"),
];

fn layout_run(f: &Files, command: &str, outputs: &[(&str, &str)], extra: &[&str]) -> Output {
    let mut files = vec![("--q", "q.npy"), ("--k", "k.npy"), ("--v", "v.npy")];
    files.extend(LAYOUT_FLAGS);
    files.extend_from_slice(outputs);
    let mut args = vec!["--causal", "--block-size", "7,13"];
    args.extend_from_slice(extra);
    f.run(command, &files, &args)
}

#[test]
fn layout_flags_forward_and_backward_match_the_reference() {
    for backend in backends() {
        let f = Files::new();
        let (qkv, [qs, ks, vs], opts) = layout_files(&f);
        let outs = [("--out", "o.npy"), ("--lse", "lse.npy")];
        assert_ok(&layout_run(&f, "forward", &outs, &["--backend", backend]));
        let (o_shape, o) = read_f32(&f.path("o.npy"));
        assert_eq!(o_shape, vec![qs[1] as u64, 4, 24], "packed o is rank 3");
        let (lse_shape, lse) = read_f32(&f.path("lse.npy"));
        assert_eq!(
            lse_shape,
            vec![4, qs[1] as u64],
            "lse is (heads_q, total_q)"
        );
        let [q, k, v] =
            [(qs, &qkv[0]), (ks, &qkv[1]), (vs, &qkv[2])].map(|(s, d)| TensorView::f32(s, d));
        let out = flashattn::ForwardOutput::new(
            flashattn::AttentionShape::from_views(&q, &k, &v).unwrap(),
            TensorData::F32(o),
            lse,
            Default::default(),
        );
        for c in check_forward(&out, &q, &k, &v, &opts).unwrap() {
            assert!(c.passed(), "{backend} {c}");
        }
        let g = Rng::new(11).normal_vec(qs[1] * 4 * 24, 1.0);
        write_f32(&f.path("do.npy"), &[qs[1] as u64, 4, 24], &g);
        let grads = [
            ("--do", "do.npy"),
            ("--dq", "dq.npy"),
            ("--dk", "dk.npy"),
            ("--dv", "dv.npy"),
            ("--dsinks", "ds.npy"),
        ];
        assert_ok(&layout_run(&f, "backward", &grads, &["--backend", backend]));
        let t = |name: &str, shape: [usize; 4]| {
            let (s, data) = read_f32(&f.path(name));
            assert_eq!(s, shape[1..].iter().map(|&x| x as u64).collect::<Vec<_>>());
            Tensor {
                shape: shape.to_vec(),
                data: TensorData::F32(data),
            }
        };
        let (ds_shape, ds) = read_f32(&f.path("ds.npy"));
        assert_eq!(ds_shape, vec![4]);
        let out = flashattn::BackwardOutput {
            dq: t("dq.npy", qs),
            dk: t("dk.npy", ks),
            dv: t("dv.npy", vs),
            dsinks: Some(ds),
            stats: Default::default(),
        };
        let d_o = TensorView::f32(qs, &g);
        let checks = flashattn::accuracy::check_backward(&out, &q, &k, &v, &d_o, &opts).unwrap();
        assert_eq!(checks.len(), 4);
        for c in checks {
            assert!(c.passed(), "{backend} {c}");
        }
    }
}

#[test]
fn layout_bad_inputs_are_one_line_and_write_nothing() {
    let f = Files::new();
    layout_files(&f);
    let outs = [("--out", "o.npy")];
    let bad = |f: &Files, extra: &[&str], needle: &str| {
        assert_bad(f, &layout_run(f, "forward", &outs, extra), needle);
    };
    // A cu_seqlens that decreases, or does not end at the total.
    write_i32(&f.path("cq.npy"), &[5], &[0, 9, 5, 39, 56]);
    bad(&f, &[], "decreases");
    write_i32(&f.path("cq.npy"), &[5], &[0, 9, 9, 39, 55]);
    bad(&f, &[], "ends at 55");
    write_i32(&f.path("cq.npy"), &[5], &[0, 9, 9, 39, 56]);
    // A mask of the wrong tile count, and the wrong dtype.
    write_array(&f.path("mask.npy"), &[1, 4, 4, 2], &[1u8; 32]);
    bad(&f, &[], "row-block count");
    write_f32(&f.path("mask.npy"), &[1, 4, 5, 2], &[1.0; 40]);
    bad(&f, &[], "bool or uint8");
    write_array(&f.path("mask.npy"), &[1, 4, 5, 2], &[true; 40]);
    bad(&f, &["--block-size", "0,4"], "--block-size");
    // Slopes of the wrong length, non-finite slopes and sinks.
    write_f32(&f.path("slopes.npy"), &[3], &[0.1; 3]);
    bad(&f, &[], "alibi slopes");
    write_f32(&f.path("slopes.npy"), &[4], &[0.1, f32::NAN, 0.1, 0.1]);
    bad(&f, &[], "finite");
    write_f32(&f.path("slopes.npy"), &[4], &[0.1; 4]);
    write_f32(&f.path("sinks.npy"), &[4], &[0.0, 0.0, f32::INFINITY, 0.0]);
    bad(&f, &[], "sinks");
    write_f32(&f.path("sinks.npy"), &[4], &[0.0; 4]);
    // Flags that go together, and packed tensors of rank 4.
    let plain = [
        ("--q", "q.npy"),
        ("--k", "k.npy"),
        ("--v", "v.npy"),
        ("--out", "o.npy"),
    ];
    for (flag, file, needle) in [
        ("--block-mask", "mask.npy", "--block-size"),
        ("--cu-seqlens-q", "cq.npy", "--cu-seqlens-k"),
    ] {
        let mut files = plain.to_vec();
        files.push((flag, file));
        assert_bad(&f, &f.run("forward", &files, &[]), needle);
    }
    write_f32(&f.path("q.npy"), &[1, 56, 4, 24], &vec![0.0; 56 * 96]);
    bad(&f, &[], "3 dims");
    layout_files(&f);
    let grads = [
        ("--do", "o.npy"),
        ("--dq", "dq.npy"),
        ("--dk", "dk.npy"),
        ("--dv", "dv.npy"),
        ("--dsinks", "ds.npy"),
    ];
    let mut files = vec![("--q", "q.npy"), ("--k", "k.npy"), ("--v", "v.npy")];
    files.extend(grads);
    assert_bad(&f, &f.run("backward", &files, &[]), "--sinks");
    for name in ["o.npy", "dq.npy", "dk.npy", "dv.npy", "ds.npy"] {
        assert!(!f.path(name).exists(), "{name} written");
    }
}

#[test]
fn bench_sparse_and_varlen_print_tables_and_json() {
    if engine().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (json, plot) = (
        dir.path().join("sparse.json"),
        dir.path().join("sparse.svg"),
    );
    let out = bin()
        .args([
            "bench",
            "--sparse",
            "--sparse-seqlen",
            "256",
            "--densities",
            "0.25,0.5",
        ])
        .args(["--sparse-block", "32,32", "--repeats", "1", "--json"])
        .arg(&json)
        .arg("--plot")
        .arg(&plot)
        .output()
        .unwrap();
    assert_ok(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    // Two densities, forward and backward: each counted access equals the analytic count.
    assert_eq!(text.matches("= analytic").count(), 4, "{text}");
    let report: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(report["points"].as_array().unwrap().len(), 4);
    assert!(std::fs::read_to_string(&plot).unwrap().contains("<svg"));
    let out = bin()
        .args([
            "bench",
            "--varlen",
            "--varlen-lens",
            "16,40,7",
            "--repeats",
            "1",
        ])
        .output()
        .unwrap();
    assert_ok(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    // One dispatch for the packed batch (three kernels backward), one per sequence otherwise.
    assert!(
        text.contains("| 1 vs 3 |") && text.contains("| 3 vs 9 |"),
        "{text}"
    );
}

/// A command keeping verification verdicts in `dir` (none of this
/// machine's cached verdicts, no verification setting or planted fault
/// from the caller's environment).
fn with_verdicts(dir: &Path) -> Command {
    let mut c = bin();
    c.env("FLASHATTN_CACHE_DIR", dir)
        .env_remove("FLASHATTN_VERIFY")
        .env_remove("FLASHATTN_LAB_FAULT");
    c
}

/// The verdict lines of `flashattn plan`'s passes, in order.
fn verdict_lines(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| l.starts_with("verification: ") && !l.contains("(FLASHATTN_VERIFY)"))
        .map(String::from)
        .collect()
}

#[test]
fn plan_and_forward_show_verdicts_kept_across_runs_and_fallbacks() {
    if engine().is_none() {
        return;
    }
    let f = Files::new();
    let plan = |cache: &str, env: &[(&str, &str)]| {
        let mut c = with_verdicts(&f.path(cache));
        c.envs(env.iter().copied())
            .args(["plan", "--head-dim", "32"]);
        let out = c.output().unwrap();
        assert_ok(&out);
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    // The first run checks the forward's and the backward's families.
    let first = verdict_lines(&plan("cache", &[]));
    assert_eq!(first.len(), 2, "{first:?}");
    assert!(
        first[0].contains(" forward f32") && first[0].ends_with(": verified"),
        "{first:?}"
    );
    assert!(
        first[1].contains(" backward f32") && first[1].ends_with(": verified"),
        "{first:?}"
    );
    assert!(f.path("cache").join("verified.tsv").exists());
    // A second process reads the verdicts back.
    let again = verdict_lines(&plan("cache", &[]));
    assert!(
        again.iter().all(|l| l.ends_with(": verified (cached)")),
        "{again:?}"
    );
    // A fault planted in the forward's family: it fails its check and the
    // plan shown is the fallback's.
    let family = first[0]["verification: ".len()..]
        .split(' ')
        .next()
        .unwrap()
        .to_string();
    let fault = format!("{family}:forward");
    let text = plan("faulty", &[("FLASHATTN_LAB_FAULT", &fault)]);
    let lines = verdict_lines(&text);
    let why = format!("{family} forward f32: failed (o: max error");
    assert!(
        lines[0].contains(&why) && lines[0].contains(" → fallback to "),
        "{lines:?}"
    );
    let forward = &text[..text.find("backward:").unwrap()];
    assert!(!forward.contains(&format!("kernel: {family}")), "{forward}");
    // Off: nothing runs; a bad setting is one line.
    let off = verdict_lines(&plan("off", &[("FLASHATTN_VERIFY", "off")]));
    assert!(
        off.iter().all(|l| l.ends_with("verification off")),
        "{off:?}"
    );
    let bad = with_verdicts(&f.path("bad"))
        .env("FLASHATTN_VERIFY", "sometimes")
        .args(["plan", "--head-dim", "32"])
        .output()
        .unwrap();
    assert_bad(&f, &bad, "FLASHATTN_VERIFY");

    // forward says which family ran and its verdict; with the fault, the
    // fallback's output still meets the rule.
    let shape = [[1, 33, 4, 32], [1, 47, 2, 32]];
    let qkv = f.qkv(1, 33, 47, 4, 2, 32);
    let opts = AttentionOptions::default().causal(true);
    for (cache, fault) in [("cache", ""), ("faulty", fault.as_str())] {
        let mut c = with_verdicts(&f.path(cache));
        c.env("FLASHATTN_LAB_FAULT", fault).arg("forward");
        for (flag, name) in [
            ("--q", "q.npy"),
            ("--k", "k.npy"),
            ("--v", "v.npy"),
            ("--out", "o.npy"),
            ("--lse", "lse.npy"),
        ] {
            c.arg(flag).arg(f.path(name));
        }
        let out = c.args(["--causal", "--backend", "wgpu"]).output().unwrap();
        assert_ok(&out);
        let stderr = String::from_utf8_lossy(&out.stderr);
        let said: Vec<&str> = stderr
            .lines()
            .filter(|l| l.starts_with("verification: "))
            .collect();
        assert_eq!(said.len(), 1, "{stderr}");
        match fault {
            "" => assert!(said[0].ends_with("verified (cached)"), "{stderr}"),
            _ => assert!(
                said[0].contains("failed (o: max error") && said[0].contains("fallback"),
                "{stderr}"
            ),
        }
        check_o(&f, shape, &qkv, &opts);
    }
}

/// `flashattn doctor --json` on this adapter: the report and its rows.
fn doctor_json(f: &Files, extra: &[&str]) -> (Output, serde_json::Value) {
    let out = with_verdicts(&f.path("cache"))
        .args(["doctor", "--json"])
        .args(extra)
        .output()
        .unwrap();
    let report = serde_json::from_slice(&out.stdout).unwrap_or(serde_json::Value::Null);
    (out, report)
}

#[test]
fn doctor_runs_the_full_matrix_all_passing_in_text_and_json() {
    if engine().is_none() {
        return;
    }
    let f = Files::new();
    let (out, report) = doctor_json(&f, &[]);
    assert_ok(&out);
    assert!(
        !report["device"]["name"].as_str().unwrap_or("").is_empty(),
        "{report}"
    );
    let names = |key: &str| -> Vec<String> {
        report["device"][key]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|n| n["name"].as_str().unwrap_or("").to_string())
                    .collect()
            })
            .unwrap_or_default()
    };
    assert!(names("limits").contains(&"max_compute_workgroup_storage_size".to_string()));
    assert!(names("features").contains(&"SUBGROUP".to_string()));
    assert!(names("about").contains(&"driver info".to_string()));
    let rows = report["rows"].as_array().expect("rows");
    let has = |call: &str, family: &str, precision: &str, layout: &str| {
        rows.iter().any(|r| {
            (
                r["call"].as_str(),
                r["family"].as_str(),
                r["precision"].as_str(),
                r["layout"].as_str(),
            ) == (Some(call), Some(family), Some(precision), Some(layout))
        })
    };
    for precision in ["f32", "f16", "bf16"] {
        for family in ["tiled", "registers"] {
            for call in ["forward", "backward"] {
                for layout in ["band", "layouts"] {
                    assert!(
                        has(call, family, precision, layout),
                        "{call} {family} {precision} {layout}"
                    );
                }
            }
        }
        for layout in ["paged", "dense"] {
            assert!(
                has("decode", "tiled", precision, layout),
                "decode {precision} {layout}"
            );
        }
    }
    for r in rows {
        let (e, b) = (
            r["max_error"].as_f64().unwrap(),
            r["bound"].as_f64().unwrap(),
        );
        assert!(r["result"] == "pass" && e <= b, "{r}");
    }
    assert_eq!(report["passed"].as_u64(), Some(rows.len() as u64));
    assert_eq!(
        (report["failed"].as_u64(), report["errors"].as_u64()),
        (Some(0), Some(0))
    );
    eprintln!(
        "doctor: {} checks in {:.1} s",
        rows.len(),
        report["seconds"].as_f64().unwrap_or(0.0)
    );

    // The table (the decode rows: the same code prints every row).
    let out = with_verdicts(&f.path("cache"))
        .args(["doctor", "--call", "decode"])
        .output()
        .unwrap();
    assert_ok(&out);
    let text = String::from_utf8_lossy(&out.stdout);
    for needle in [
        "device: ",
        "limits:",
        "features: ",
        "verification matrix: ",
        "worst output",
    ] {
        assert!(text.contains(needle), "missing {needle}: {text}");
    }
    let decode_rows = text.lines().filter(|l| l.contains(" decode ")).count();
    assert!(
        decode_rows >= 6
            && text
                .lines()
                .filter(|l| l.contains(" decode ") && l.contains(" pass "))
                .count()
                == decode_rows,
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "{decode_rows} checks: {decode_rows} pass, 0 FAIL, 0 error"
        )),
        "{text}"
    );
}

#[test]
fn doctor_exits_non_zero_naming_what_failed() {
    if engine().is_none() {
        return;
    }
    let f = Files::new();
    let out = with_verdicts(&f.path("cache"))
        .env("FLASHATTN_LAB_FAULT", "tiled:decode")
        .args(["doctor", "--call", "decode"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    let failed: Vec<&str> = text.lines().filter(|l| l.contains(" FAIL ")).collect();
    assert!(
        !failed.is_empty() && failed.iter().all(|l| l.starts_with("tiled ")),
        "{text}"
    );
    assert!(failed.iter().all(|l| l.contains("o: max error")), "{text}");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].contains(&format!("{} of ", failed.len())) && lines[0].contains("checks failed"),
        "{stderr}"
    );
    let (bad, _) = doctor_json(&f, &["--call", "sideways"]);
    assert_bad(&f, &bad, "--call");
}

/// `--backend wgpu --dropout P --seed S`: the kernels draw the reference's
/// mask, forward and backward.
#[test]
fn dropout_forward_and_backward_on_wgpu() {
    if engine().is_none() {
        return;
    }
    let f = Files::new();
    let qkv = f.qkv(2, 19, 23, 4, 2, 16);
    let flags = [
        "--backend",
        "wgpu",
        "--causal",
        "--dropout",
        "0.25",
        "--seed",
        "42",
    ];
    let lse = f.path("lse.npy");
    let mut extra = flags.to_vec();
    extra.extend(["--lse", lse.to_str().unwrap()]);
    assert_ok(&f.forward(&extra));
    let opts = AttentionOptions::default()
        .causal(true)
        .dropout(0.25)
        .dropout_seed(42);
    check_o(&f, [[2, 19, 4, 16], [2, 23, 2, 16]], &qkv, &opts);
    let g = Rng::new(9).normal_vec(2 * 19 * 4 * 16, 1.0);
    write_f32(&f.path("do.npy"), &[2, 19, 4, 16], &g);
    assert_ok(&backward_cmd(&f, &flags));
    check_grads(&f, [2, 19, 4, 16], [2, 23, 2, 16], &qkv, &g, &opts);
}

/// `--dropout P --seed S`: the forward and its mask, then the backward
/// regenerating it, each against the reference drawing the same mask.
#[test]
fn dropout_forward_mask_and_backward_on_the_cpu() {
    let f = Files::new();
    let qkv = f.qkv(2, 19, 23, 4, 2, 16);
    let (lse, mask) = (f.path("lse.npy"), f.path("mask.npy"));
    let flags = [
        "--backend",
        "cpu",
        "--causal",
        "--dropout",
        "0.25",
        "--seed",
        "42",
    ];
    let mut extra = flags.to_vec();
    extra.extend([
        "--dropout-offset",
        "3",
        "--lse",
        lse.to_str().unwrap(),
        "--dropout-mask-out",
        mask.to_str().unwrap(),
    ]);
    assert_ok(&f.forward(&extra));
    let opts = AttentionOptions::default()
        .causal(true)
        .dropout(0.25)
        .dropout_seed(42)
        .dropout_offset(3);
    check_o(&f, [[2, 19, 4, 16], [2, 23, 2, 16]], &qkv, &opts);
    let bytes = std::fs::read(&mask).unwrap();
    let npy = npyz::NpyFile::new(&bytes[..]).unwrap();
    assert_eq!(npy.dtype().descr(), "'|b1'");
    assert_eq!(npy.shape(), &[2, 4, 19, 23]);
    let got = npy.into_vec::<bool>().unwrap();
    let shape = flashattn::AttentionShape::new(2, 19, 23, 4, 2, 16).unwrap();
    assert_eq!(got, flashattn::dropout_mask(&shape, &opts).unwrap().keep);
    let kept = got.iter().filter(|&&k| k).count() as f64 / got.len() as f64;
    assert!((kept - 0.75).abs() < 0.05, "keep rate {kept}");

    let g = Rng::new(9).normal_vec(2 * 19 * 4 * 16, 1.0);
    write_f32(&f.path("do.npy"), &[2, 19, 4, 16], &g);
    let mut extra = flags.to_vec();
    extra.extend(["--dropout-offset", "3"]);
    assert_ok(&backward_cmd(&f, &extra));
    check_grads(&f, [2, 19, 4, 16], [2, 23, 2, 16], &qkv, &g, &opts);
}

/// `--dropout-mask-out` of a packed batch holds every sequence at the
/// longest lengths: 2^14 sequences, one of 2^14 tokens, 64 heads make 2^48
/// entries from 4 MiB files. One line, before the forward runs, and no
/// file — it aborted in the allocator.
#[test]
fn a_dropout_mask_no_host_can_hold_is_one_line() {
    let f = Files::new();
    let (n, heads) = (1usize << 14, 64);
    let x = vec![1.0f32; n * heads];
    for name in ["q.npy", "k.npy", "v.npy"] {
        write_f32(&f.path(name), &[n as u64, heads as u64, 1], &x);
    }
    let mut cu = vec![n as i32; n + 1];
    cu[0] = 0;
    write_array(&f.path("cu.npy"), &[cu.len() as u64], &cu);
    let cu = f.path("cu.npy");
    let out = f.forward(&[
        "--backend",
        "cpu",
        "--cu-seqlens-q",
        cu.to_str().unwrap(),
        "--cu-seqlens-k",
        cu.to_str().unwrap(),
        "--dropout",
        "0.1",
        "--seed",
        "1",
        "--dropout-mask-out",
        f.path("m.npy").to_str().unwrap(),
    ]);
    assert_bad(&f, &out, "the dropout mask needs 281474976710656 bytes");
    assert!(!f.path("m.npy").exists());
}

#[test]
fn dropout_errors_are_one_line_and_write_nothing() {
    let f = Files::new();
    f.qkv(1, 8, 8, 2, 1, 16);
    let mask = f.path("mask.npy");
    let with_mask = |extra: &[&str]| {
        let mut all = extra.to_vec();
        all.extend(["--dropout-mask-out", mask.to_str().unwrap()]);
        f.forward(&all)
    };
    for p in ["1", "1.5", "-0.1", "NaN"] {
        let out = with_mask(&["--backend", "cpu", "--dropout", p, "--seed", "1"]);
        assert_bad(&f, &out, "dropout probability must be in [0, 1)");
    }
    assert_bad(
        &f,
        &with_mask(&["--backend", "cpu", "--dropout", "0.1"]),
        "needs a seed",
    );
    // A backend without dropout kernels refuses it by name.
    let out = with_mask(&["--backend", "cuda", "--dropout", "0.1", "--seed", "1"]);
    assert_bad(&f, &out, "cuda");
    assert!(!mask.exists());
    write_f32(&f.path("do.npy"), &[1, 8, 2, 16], &[0.0; 256]);
    let out = backward_cmd(&f, &["--backend", "cpu", "--dropout", "2", "--seed", "1"]);
    assert_bad(&f, &out, "dropout");
    for name in ["dq.npy", "dk.npy", "dv.npy"] {
        assert!(!f.path(name).exists());
    }
}

/// A quantized cache's files read back: codes (int8 or uint8) and scales.
fn read_quant(f: &Files, d: &CaseData, quant: flashattn::CacheQuant) -> flashattn::QuantKvCache {
    let codes = |name: &str| -> Vec<u8> {
        let bytes = std::fs::read(f.path(name)).unwrap();
        let npy = npyz::NpyFile::new(&bytes[..]).unwrap();
        match quant {
            flashattn::CacheQuant::Int8 => {
                assert_eq!(npy.dtype().descr(), "'|i1'", "{name}");
                npy.into_vec::<i8>()
                    .unwrap()
                    .into_iter()
                    .map(|c| c as u8)
                    .collect()
            }
            _ => {
                assert_eq!(npy.dtype().descr(), "'|u1'", "{name}");
                npy.into_vec::<u8>().unwrap()
            }
        }
    };
    let scales = |name: &str| read_f32(&f.path(name)).1;
    let kv = |c: &str, s: &str| flashattn::QuantizedKv {
        codes: codes(c),
        scales: scales(s),
    };
    // A latent cache writes K's codes and scales alone.
    let v = match d.cache.shape.latent {
        true => flashattn::QuantizedKv::default(),
        false => kv("vc2.npy", "vs2.npy"),
    };
    flashattn::QuantKvCache::new(
        d.cache.shape,
        quant,
        d.q.precision(),
        kv("kc2.npy", "ks2.npy"),
        v,
    )
    .unwrap()
}

#[test]
fn decode_quantized_caches_match_the_reference_and_write_their_codes() {
    use flashattn::{CacheQuant, QuantKvCache};
    let cases = [
        DecodeCase::new(&[40, 3], 16).heads(4, 2).append(2),
        DecodeCase::new(&[30, 7], 8)
            .paged(16)
            .append(1)
            .f16()
            .opts(AttentionOptions::default().causal(true)),
        DecodeCase::new(&[20, 9], 24)
            .dv(16)
            .heads(4, 2)
            .paged(16)
            .latent()
            .append(1),
    ];
    let backends: &[&str] = if engine().is_some() {
        &["cpu", "wgpu"]
    } else {
        &["cpu"]
    };
    for (quant, backend) in CacheQuant::ALL
        .into_iter()
        .flat_map(|q| backends.iter().map(move |b| (q, *b)))
    {
        for case in &cases {
            let f = Files::new();
            let d = case.data();
            let args = write_decode_case(&f, &d);
            let latent = case.latent;
            let outs: Vec<String> = [
                ("--k-cache-out", "kc2.npy"),
                ("--v-cache-out", "vc2.npy"),
                ("--k-scales-out", "ks2.npy"),
                ("--v-scales-out", "vs2.npy"),
            ]
            .iter()
            .filter(|(flag, _)| !(latent && flag.starts_with("--v")))
            .flat_map(|(flag, name)| [flag.to_string(), f.path(name).to_str().unwrap().into()])
            .collect();
            let precision = ["--cache-precision", quant.name(), "--backend", backend];
            let out = decode_cmd(&[args.clone(), outs.clone()].concat(), &precision);
            assert_ok(&out);
            // The float cache was quantized on load, then the rows appended.
            let step = d.step();
            let loaded = QuantKvCache::quantize(&d.cache, quant).unwrap();
            let written = read_quant(&f, &d, quant);
            assert!(
                written == kv_quant::expected_append(&loaded, &step),
                "{quant:?} {case:?}"
            );
            let o = read_tensor(&f.path("o.npy"));
            let (_, lse) = read_f32(&f.path("lse.npy"));
            let out = DecodeOutput {
                o,
                lse,
                lse_shape: [d.case.batch(), d.case.heads_q, d.case.seqlen_q],
                num_splits: 0,
                stats: Default::default(),
            };
            let values = written.dequantized();
            for c in flashattn::accuracy::check_decode_on_values(&out, &values, &step, &case.opts)
                .unwrap()
            {
                assert!(c.passed(), "{quant:?} {case:?}: {c}");
            }
            // The written codes and scales are a cache the next step reads.
            let p = |name: &str| f.path(name).to_str().unwrap().to_string();
            let mut next = without(&without(&without(&args, "--k-new"), "--v-new"), "--k-cache");
            next = without(&next, "--v-cache");
            for (file, flag) in [
                ("kc2.npy", "--k-cache"),
                ("vc2.npy", "--v-cache"),
                ("ks2.npy", "--k-scales"),
                ("vs2.npy", "--v-scales"),
            ] {
                if latent && flag.starts_with("--v") {
                    assert!(!f.path(file).exists(), "a latent cache wrote {file}");
                    continue;
                }
                std::fs::rename(f.path(file), f.path(&format!("in_{file}"))).unwrap();
                next.extend([flag.into(), p(&format!("in_{file}"))]);
            }
            let lens: Vec<i32> = d
                .lens
                .iter()
                .map(|l| l + d.case.seqlen_new as i32)
                .collect();
            write_i32(&f.path("cs.npy"), &[lens.len() as u64], &lens);
            assert_ok(&decode_cmd(
                &next,
                &["--cache-precision", quant.name(), "--backend", backend],
            ));
            let again = read_tensor(&f.path("o.npy"));
            assert_eq!(
                again.to_f32(),
                out.o.to_f32(),
                "{quant:?} {backend}: the same cache, the same o"
            );
        }
    }
}

#[test]
fn decode_quantized_bad_inputs_write_nothing() {
    let f = Files::new();
    let d = DecodeCase::new(&[5, 9], 8).append(2).data();
    let args = write_decode_case(&f, &d);
    let p = |name: &str| f.path(name).to_str().unwrap().to_string();
    let run = |extra: &[String]| {
        decode_cmd(
            &[args.clone(), extra.to_vec()].concat(),
            &["--backend", "cpu"],
        )
    };
    let s = |v: &[&str]| -> Vec<String> { v.iter().map(|x| x.to_string()).collect() };
    // Codes of the other format, codes without a precision or scales.
    let [b, cap, h, dim] = d.cache.shape.dims();
    let shape = [b as u64, cap as u64, h as u64, dim as u64];
    write_array(&f.path("k_i8.npy"), &shape, &vec![1i8; b * cap * h * dim]);
    write_array(&f.path("v_i8.npy"), &shape, &vec![1i8; b * cap * h * dim]);
    let blocks = b * cap.div_ceil(16);
    write_f32(
        &f.path("ks.npy"),
        &[blocks as u64, h as u64],
        &vec![0.5; blocks * h],
    );
    let mut nan = vec![0.5; blocks * h];
    nan[1] = f32::NAN;
    write_f32(&f.path("ks_nan.npy"), &[blocks as u64, h as u64], &nan);
    let codes = without(&without(&args, "--k-cache"), "--v-cache");
    let with_codes = |extra: &[String]| {
        let mut a = codes.clone();
        a.extend([
            "--k-cache".into(),
            p("k_i8.npy"),
            "--v-cache".into(),
            p("v_i8.npy"),
        ]);
        a.extend(extra.iter().cloned());
        decode_cmd(&a, &["--backend", "cpu"])
    };
    let scales = |k: &str| s(&["--k-scales", &p(k), "--v-scales", &p("ks.npy")]);
    // (The int8 codes read as int8 first: the run is valid.)
    assert_ok(&with_codes(
        &[s(&["--cache-precision", "int8"]), scales("ks.npy")].concat(),
    ));
    std::fs::remove_file(f.path("o.npy")).unwrap();
    std::fs::remove_file(f.path("lse.npy")).unwrap();
    let fp8 = with_codes(&[s(&["--cache-precision", "fp8"]), scales("ks.npy")].concat());
    assert_decode_bad(&f, &fp8, "--cache-precision fp8 reads uint8");
    assert_decode_bad(&f, &with_codes(&[]), "needs --cache-precision");
    assert_decode_bad(
        &f,
        &with_codes(&s(&["--cache-precision", "int8"])),
        "needs --k-scales",
    );
    let bad_scale = with_codes(&[s(&["--cache-precision", "int8"]), scales("ks_nan.npy")].concat());
    assert_decode_bad(&f, &bad_scale, "k_scales[1] is NaN");
    // Scales with a float cache; an unknown format.
    assert_decode_bad(
        &f,
        &run(&[s(&["--cache-precision", "int8"]), scales("ks.npy")].concat()),
        "needs a cache of codes",
    );
    assert_decode_bad(
        &f,
        &run(&s(&["--cache-precision", "int4"])),
        "unknown cache precision",
    );
}

/// Non-zero exit, exactly one stderr line holding each of `needles`, and
/// none of `names` (nor a temporary file) in the directory.
fn assert_alone_and_nothing_left(f: &Files, out: &Output, needles: &[&str], names: &[&str]) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure, stderr: {stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "stderr should be one line: {stderr:?}");
    for needle in needles {
        assert!(lines[0].contains(needle), "{:?} lacks {needle:?}", lines[0]);
    }
    for name in names {
        assert!(!f.path(name).exists(), "a failed run left {name}");
    }
    let leftovers: Vec<_> = std::fs::read_dir(f.dir.path())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("partial"))
        .collect();
    assert!(leftovers.is_empty(), "temporary files left behind");
}

/// q (2, 8, 4, 16), k and v (2, 10, 2, 16), do, sinks (4,) and a directory
/// `adir`: the shapes of the output and ALiBi checks.
fn batch_of_two(f: &Files) {
    f.qkv(2, 8, 10, 4, 2, 16);
    let g = Rng::new(7).normal_vec(2 * 8 * 4 * 16, 1.0);
    write_f32(&f.path("do.npy"), &[2, 8, 4, 16], &g);
    write_f32(&f.path("s.npy"), &[4], &[0.5, -1.0, 0.0, 1.0]);
    std::fs::create_dir_all(f.path("adir")).unwrap();
}

/// `command` on q.npy, k.npy, v.npy (and do.npy for backward) with these
/// output flags and extra arguments.
fn attention_run(f: &Files, command: &str, outputs: &[(&str, &str)], extra: &[&str]) -> Output {
    let mut files = vec![("--q", "q.npy"), ("--k", "k.npy"), ("--v", "v.npy")];
    if command == "backward" {
        files.push(("--do", "do.npy"));
    }
    files.extend_from_slice(outputs);
    f.run(command, &files, extra)
}

#[test]
fn forward_output_paths_are_checked_before_any_work() {
    for &backend in backends() {
        let f = Files::new();
        batch_of_two(&f);
        let be = ["--backend", backend];
        let run = |outputs: &[(&str, &str)], extra: &[&str]| {
            attention_run(&f, "forward", outputs, &[&be[..], extra].concat())
        };
        assert_ok(&run(&[("--out", "o.npy"), ("--lse", "lse.npy")], &[]));
        for name in ["o.npy", "lse.npy"] {
            std::fs::remove_file(f.path(name)).unwrap();
        }
        // An output that is an existing directory.
        let out = run(&[("--out", "o.npy"), ("--lse", "adir")], &[]);
        assert_alone_and_nothing_left(&f, &out, &["--lse", "is a directory"], &["o.npy"]);
        let out = run(&[("--out", "adir"), ("--lse", "lse.npy")], &[]);
        assert_alone_and_nothing_left(&f, &out, &["--out", "is a directory"], &["lse.npy"]);
        let dropout = ["--dropout", "0.25", "--seed", "3"];
        let outputs = [("--out", "o.npy"), ("--dropout-mask-out", "adir")];
        let out = run(&outputs, &dropout);
        assert_alone_and_nothing_left(&f, &out, &["--dropout-mask-out", "adir"], &["o.npy"]);
        // One file named twice, however it is spelled.
        for lse in ["x.npy", "adir/../x.npy"] {
            let out = run(&[("--out", "x.npy"), ("--lse", lse)], &[]);
            let needles = ["--out and --lse both name", "x.npy"];
            assert_alone_and_nothing_left(&f, &out, &needles, &["x.npy"]);
        }
        let outputs = [("--out", "x.npy"), ("--dropout-mask-out", "x.npy")];
        let out = run(&outputs, &dropout);
        let needles = ["--out and --dropout-mask-out"];
        assert_alone_and_nothing_left(&f, &out, &needles, &["x.npy"]);
        // A directory that does not exist.
        let out = run(&[("--out", "o.npy"), ("--lse", "missing/lse.npy")], &[]);
        let needles = ["--lse", "missing", "does not exist"];
        assert_alone_and_nothing_left(&f, &out, &needles, &["o.npy"]);
        // Before any input is read: without q, the output is the error.
        std::fs::remove_file(f.path("q.npy")).unwrap();
        let out = run(&[("--out", "o.npy"), ("--lse", "adir")], &[]);
        assert_alone_and_nothing_left(&f, &out, &["--lse", "is a directory"], &["o.npy"]);
    }
}

#[test]
fn backward_output_paths_are_checked_before_any_work() {
    for &backend in backends() {
        let f = Files::new();
        batch_of_two(&f);
        let be = ["--backend", backend];
        let run = |outputs: &[(&str, &str)], extra: &[&str]| {
            attention_run(&f, "backward", outputs, &[&be[..], extra].concat())
        };
        let grads = |dv: &'static str| [("--dq", "dq.npy"), ("--dk", "dk.npy"), ("--dv", dv)];
        let all = ["dq.npy", "dk.npy", "dv.npy", "ds.npy"];
        let out = run(&grads("adir"), &[]);
        assert_alone_and_nothing_left(&f, &out, &["--dv", "is a directory"], &all);
        let sinks_path = f.path("s.npy");
        let sinks = ["--sinks", sinks_path.to_str().unwrap()];
        let with_dsinks = |ds: &'static str| {
            let mut outputs = grads("dv.npy").to_vec();
            outputs.push(("--dsinks", ds));
            run(&outputs, &sinks)
        };
        let out = with_dsinks("adir");
        assert_alone_and_nothing_left(&f, &out, &["--dsinks", "is a directory"], &all);
        let out = with_dsinks("dq.npy");
        let needles = ["--dq and --dsinks both name", "dq.npy"];
        assert_alone_and_nothing_left(&f, &out, &needles, &all);
        let out = run(&grads("dk.npy"), &[]);
        assert_alone_and_nothing_left(&f, &out, &["--dk and --dv"], &all);
        let out = run(&grads("missing/dv.npy"), &[]);
        assert_alone_and_nothing_left(&f, &out, &["--dv", "does not exist"], &all);
        // The valid call writes all four.
        assert_ok(&with_dsinks("ds.npy"));
        for name in all {
            assert!(f.path(name).exists(), "{name}");
        }
    }
}

#[test]
fn decode_output_paths_are_checked_before_any_work() {
    for &backend in backends() {
        let f = Files::new();
        let args = bad_input_case(&f);
        std::fs::create_dir(f.path("adir")).unwrap();
        let path = |name: &str| f.path(name).to_str().unwrap().to_string();
        let all = ["o.npy", "lse.npy", "kc2.npy", "vc2.npy"];
        let run = |flag: &str, name: &str| {
            let args = [without(&args, flag), vec![flag.into(), path(name)]].concat();
            decode_cmd(&args, &["--backend", backend])
        };
        let out = run("--v-cache-out", "adir");
        assert_alone_and_nothing_left(&f, &out, &["--v-cache-out", "is a directory"], &all);
        let out = run("--lse", "adir");
        assert_alone_and_nothing_left(&f, &out, &["--lse", "is a directory"], &all);
        let out = run("--lse", "o.npy");
        assert_alone_and_nothing_left(&f, &out, &["--out and --lse both name"], &all);
        let out = run("--v-cache-out", "kc2.npy");
        let needles = ["--k-cache-out and --v-cache-out both name"];
        assert_alone_and_nothing_left(&f, &out, &needles, &all);
        let out = run("--k-cache-out", "missing/kc2.npy");
        let needles = ["--k-cache-out", "does not exist"];
        assert_alone_and_nothing_left(&f, &out, &needles, &all);
        // An output may name an input: the cache is replaced once read.
        let out = run("--k-cache-out", "kc.npy");
        assert_ok(&out);
        for name in ["o.npy", "lse.npy", "vc2.npy"] {
            assert!(f.path(name).exists(), "{name}");
        }
    }
}

/// Slopes `(heads_q,)` and `(batch, heads_q)` run; any other shape, even of
/// the same count, is one line naming the shapes, on forward, backward and
/// decode; slopes of another dtype are one line saying float32.
#[test]
fn alibi_slopes_of_another_shape_are_one_line() {
    // batch 2, heads_q 4 in both directories.
    let f = Files::new();
    batch_of_two(&f);
    let fd = Files::new();
    let decode_args = bad_input_case(&fd);
    let slopes = f.path("slopes.npy");
    let alibi = ["--backend", "cpu", "--alibi", slopes.to_str().unwrap()];
    let grads = [("--dq", "dq.npy"), ("--dk", "dk.npy"), ("--dv", "dv.npy")];
    let outputs = [
        "o.npy", "dq.npy", "dk.npy", "dv.npy", "lse.npy", "kc2.npy", "vc2.npy",
    ];
    // Each command, the directory of its outputs.
    let run = || {
        [
            (
                "forward",
                &f,
                attention_run(&f, "forward", &[("--out", "o.npy")], &alibi),
            ),
            (
                "backward",
                &f,
                attention_run(&f, "backward", &grads, &alibi),
            ),
            ("decode", &fd, decode_cmd(&decode_args, &alibi)),
        ]
    };
    let values: Vec<f32> = (1..=8).map(|i| 0.05 * i as f32).collect();
    for shape in [&[4u64][..], &[2, 4]] {
        let n = shape.iter().product::<u64>() as usize;
        write_f32(&slopes, shape, &values[..n]);
        for (command, dir, out) in run() {
            assert_ok(&out);
            for name in outputs {
                let _ = std::fs::remove_file(dir.path(name));
            }
            eprintln!("{command} {shape:?}: ok");
        }
    }
    for (shape, text) in [
        (&[4u64, 2][..], "shape (4, 2)"),
        (&[1, 4], "shape (1, 4)"),
        (&[8], "shape (8,)"),
    ] {
        let n = shape.iter().product::<u64>() as usize;
        write_f32(&slopes, shape, &values[..n]);
        for (command, dir, out) in run() {
            let line = String::from_utf8_lossy(&out.stderr);
            eprintln!("{command} {shape:?}: {}", line.trim());
            let needles = [
                "alibi slopes have",
                text,
                "expected (heads_q,) = (4,) or (batch, heads_q) = (2, 4)",
            ];
            assert_alone_and_nothing_left(dir, &out, &needles, &outputs);
        }
    }
    write_f32(&slopes, &[2, 2, 2], &values);
    for (_, dir, out) in run() {
        assert_alone_and_nothing_left(dir, &out, &["alibi slopes", "rank 3"], &outputs);
    }
    // f16 (or int32) slopes: float32 only, said once.
    write_f16(&slopes, &[4], &values[..4]);
    for (_, dir, out) in run() {
        let needles = ["has dtype float16; alibi slopes must be float32"];
        assert_alone_and_nothing_left(dir, &out, &needles, &outputs);
    }
    write_i32(&slopes, &[4], &[1, 2, 3, 4]);
    for (_, dir, out) in run() {
        let needles = ["has dtype int32; alibi slopes must be float32"];
        assert_alone_and_nothing_left(dir, &out, &needles, &outputs);
    }
}

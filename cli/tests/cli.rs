//! The command line end to end: results against the f64 reference, and every
//! bad input of SPEC.md giving one line on stderr, a non-zero exit and no file.

use flashattn::accuracy::check_forward;
use flashattn::random::Rng;
use flashattn::{AttentionOptions, TensorView, Window};
use half::f16;
use npyz::WriterBuilder;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

/// An engine on the best adapter, or `None` (with a visible notice) when no
/// adapter exists. With FLASHATTN_REQUIRE_GPU=1 (set by CI and
/// scripts/test.sh) a missing adapter fails the test instead.
fn engine() -> Option<&'static flashattn::Engine> {
    static ENGINE: std::sync::OnceLock<Option<flashattn::Engine>> = std::sync::OnceLock::new();
    ENGINE
        .get_or_init(|| match flashattn::Engine::new() {
            Ok(e) => Some(e),
            Err(err) => {
                if std::env::var("FLASHATTN_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                    panic!("FLASHATTN_REQUIRE_GPU=1 but no adapter: {err}");
                }
                eprintln!("SKIPPED: GPU tests need an adapter: {err}");
                None
            }
        })
        .as_ref()
}

fn bin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_flashattn"));
    c.env("XDG_RUNTIME_DIR", std::env::temp_dir());
    c
}

fn write_f32(path: &Path, shape: &[u64], data: &[f32]) {
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
    let opts = AttentionOptions {
        causal: true,
        window: Window::from_signed(-1, 5),
        ..Default::default()
    };
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
    let opts = AttentionOptions {
        softcap: Some(4.0),
        scale: Some(0.2),
        window: Window::from_signed(7, -1),
        ..Default::default()
    };
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
    f.qkv(1, 2, 2, 1, 1, 257);
    assert_bad(&f, &f.forward(&["--backend", "cpu"]), "head_dim");
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

#[test]
fn unsupported_backend_flags() {
    let f = Files::new();
    f.qkv(1, 4, 4, 1, 1, 8);
    assert_bad(&f, &f.forward(&["--backend", "cuda"]), "cuda");
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
    assert_bad(&f, &f.forward(&["--precision", "bf16"]), "precision");
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
    let out = bin().args(["plan", "--head-dim", "300"]).output().unwrap();
    assert!(!out.status.success());
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
        stats: Default::default(),
    };
    for c in flashattn::accuracy::check_backward(&out, &q, &k, &v, &d_o, opts).unwrap() {
        assert!(c.passed(), "{c}");
    }
}

#[test]
fn backward_matches_reference_on_each_backend() {
    let backends: &[&str] = if engine().is_some() {
        &["cpu", "wgpu"]
    } else {
        &["cpu"]
    };
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
        let opts = AttentionOptions {
            causal: true,
            softcap: Some(5.0),
            ..Default::default()
        };
        check_grads(&f, [1, 29, 4, 24], [1, 41, 2, 24], &qkv, &g, &opts);
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
    let out = bin().args(["bench", "--impls", "tpu"]).output().unwrap();
    assert_bad(&f, &out, "tpu");
}

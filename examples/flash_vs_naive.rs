//! First timings: flash vs naive WGSL forward, side by side in one run.
//!
//! `cargo run --release --example flash_vs_naive -- 1024 2048 4096`
//! (seqlens; batch 1, heads 1, d 64; kernel time, median of 3 after a warm-up).

use flashattn::random::Rng;
use flashattn::{AttentionOptions, Engine, TensorView};

/// CPU seconds this process has used (user + system): on a CPU adapter such
/// as lavapipe it measures the work done, even when other processes compete.
fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    let fields: Vec<&str> = stat
        .rsplit(')')
        .next()
        .unwrap_or("")
        .split_whitespace()
        .collect();
    let ticks = |i: usize| {
        fields
            .get(i)
            .and_then(|f| f.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (ticks(11) + ticks(12)) / 100.0
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn main() -> flashattn::Result<()> {
    let engine = Engine::new()?;
    println!("adapter: {}", engine.describe());
    let seqlens: Vec<usize> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let seqlens = if seqlens.is_empty() {
        vec![1024, 2048, 4096]
    } else {
        seqlens
    };
    let d = 64;
    let opts = AttentionOptions::default();
    println!(
        "{:>7} {:>12} {:>12} {:>8} {:>10} {:>10}",
        "seqlen", "flash ms", "naive ms", "speedup", "flash GF/s", "naive GF/s"
    );
    for n in seqlens {
        let mut rng = Rng::new(n as u64);
        let q = rng.normal_vec(n * d, 1.0);
        let k = rng.normal_vec(n * d, 1.0);
        let v = rng.normal_vec(n * d, 1.0);
        let (qv, kv, vv) = (
            TensorView::f32([1, n, 1, d], &q),
            TensorView::f32([1, n, 1, d], &k),
            TensorView::f32([1, n, 1, d], &v),
        );
        let time = |naive: bool| -> flashattn::Result<f64> {
            let run = || {
                if naive {
                    engine.naive_forward(&qv, &kv, &vv, &opts)
                } else {
                    engine.forward(&qv, &kv, &vv, &opts)
                }
            };
            run()?;
            let mut t = Vec::new();
            let cpu0 = cpu_seconds();
            for _ in 0..3 {
                t.push(run()?.stats.kernel_seconds);
            }
            if std::env::var_os("CPU_TIME").is_some() {
                eprintln!(
                    "  {} cpu s/run: {:.3}",
                    if naive { "naive" } else { "flash" },
                    (cpu_seconds() - cpu0) / 3.0
                );
            }
            Ok(median(t))
        };
        let flash = time(false)?;
        let naive = time(true);
        let flops = 4.0 * (n * n * d) as f64;
        match naive {
            Ok(naive) => println!(
                "{n:>7} {:>12.1} {:>12.1} {:>7.2}x {:>10.2} {:>10.2}",
                flash * 1e3,
                naive * 1e3,
                naive / flash,
                flops / flash / 1e9,
                flops / naive / 1e9
            ),
            Err(e) => println!(
                "{n:>7} {:>12.1} {:>12} {:>8} {:>10.2}  naive: {e}",
                flash * 1e3,
                "-",
                "-",
                flops / flash / 1e9
            ),
        }
    }
    Ok(())
}

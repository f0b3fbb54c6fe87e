//! A generation loop on paged KV caches: a toy attention-only language model
//! with seeded random weights decodes a batch of sequences of different
//! prompt lengths, greedily, one token per sequence per step.
//!
//! Per layer: RMSNorm, q/k/v projections (host matrices), attention through
//! the engine against that layer's paged device cache (the step's k and v
//! appended in place by the same call), the output projection and a
//! residual. Logits come from the tied embedding; the next token is the
//! argmax. Pages are handed out from a shuffled free list as sequences grow
//! and the block table is built on the host, as a serving engine would.
//!
//! Prompts are prefilled through the same decode call (`seqlen_q` = prompt
//! length, causal), one sequence at a time; then every step decodes the
//! whole batch with `seqlen_q = 1`.
//!
//! On sampled steps (`--check-every`, default 32) every layer's attention is
//! checked: the layer's cache is read back before the step and the CPU
//! backend runs the same step on that copy; both outputs must pass docs/semantics.md's
//! accuracy rule against the f64 reference, and the device cache after the
//! step must equal the CPU's bit for bit. A failure exits non-zero.
//!
//! Without a GPU adapter it runs on the CPU backend (and says so).
//!
//! ```text
//! cargo run --release --example decode -- [--tokens 256] [--prompts 7,19,33]
//!     [--layers 4] [--heads 8] [--kv-heads 2] [--head-dim 64] [--vocab 256]
//!     [--page-size 16] [--precision f16|f32] [--num-splits 0]
//!     [--check-every 32] [--backend wgpu|cpu] [--seed 1]
//! ```
//! `FLASHATTN_DECODE_TOKENS` sets the default of `--tokens`.

use flashattn::accuracy::{check_decode, Check};
use flashattn::random::Rng;
use flashattn::{
    cpu, AttentionOptions, CacheLayout, CacheShape, DecodeOutput, DecodeStep, Engine, HostKvCache,
    KvCache, Precision, TensorData,
};
use std::collections::BTreeSet;
use std::time::{Duration, Instant};

const USAGE: &str = "usage: decode [--tokens N] [--prompts A,B,..] [--layers N] [--heads N] \
[--kv-heads N] [--head-dim N] [--vocab N] [--page-size N] [--precision f16|f32] \
[--num-splits N (0: planner)] [--check-every N (0: never)] [--backend wgpu|cpu] [--seed N]";

/// Which backend runs attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum BackendArg {
    /// wgpu, or the CPU backend (with a notice) when there is no adapter.
    Default,
    /// wgpu or an error.
    Wgpu,
    Cpu,
}

#[derive(Clone, Debug, PartialEq)]
struct Config {
    /// Decoding steps; each gives every sequence one token.
    tokens: usize,
    /// Prompt length of each sequence (its length is the batch).
    prompts: Vec<usize>,
    layers: usize,
    heads_q: usize,
    heads_kv: usize,
    head_dim: usize,
    vocab: usize,
    page_size: usize,
    precision: Precision,
    /// 0: the planner chooses.
    num_splits: usize,
    /// Check every n-th step (and the prefill); 0: never.
    check_every: usize,
    backend: BackendArg,
    seed: u64,
    /// Tests only: corrupt the attention output of this step (every layer)
    /// before it is checked, to show that the check catches it.
    fault_at: Option<usize>,
}

impl Default for Config {
    fn default() -> Self {
        Self {
            tokens: 256,
            prompts: vec![7, 19, 33],
            layers: 4,
            heads_q: 8,
            heads_kv: 2,
            head_dim: 64,
            vocab: 256,
            page_size: 16,
            precision: Precision::F16,
            num_splits: 0,
            check_every: 32,
            backend: BackendArg::Default,
            seed: 1,
            fault_at: None,
        }
    }
}

impl Config {
    /// The flags after the program name; `tokens_env` is
    /// `FLASHATTN_DECODE_TOKENS` (a flag wins over it).
    fn parse(args: &[String], tokens_env: Option<&str>) -> Result<Self, String> {
        let mut c = Config::default();
        if let Some(t) = tokens_env {
            c.tokens = number("FLASHATTN_DECODE_TOKENS", t)?;
        }
        let mut it = args.iter();
        while let Some(arg) = it.next() {
            let (flag, inline) = match arg.split_once('=') {
                Some((f, v)) => (f, Some(v.to_string())),
                None => (arg.as_str(), None),
            };
            if flag == "--help" || flag == "-h" {
                return Err(USAGE.into());
            }
            let value = match inline {
                Some(v) => v,
                None => it
                    .next()
                    .cloned()
                    .ok_or_else(|| format!("{flag} needs a value\n{USAGE}"))?,
            };
            match flag {
                "--tokens" => c.tokens = number(flag, &value)?,
                "--prompts" => {
                    c.prompts = value
                        .split(',')
                        .map(|s| number(flag, s.trim()))
                        .collect::<Result<_, _>>()?
                }
                "--layers" => c.layers = number(flag, &value)?,
                "--heads" => c.heads_q = number(flag, &value)?,
                "--kv-heads" => c.heads_kv = number(flag, &value)?,
                "--head-dim" => c.head_dim = number(flag, &value)?,
                "--vocab" => c.vocab = number(flag, &value)?,
                "--page-size" => c.page_size = number(flag, &value)?,
                "--precision" => c.precision = value.parse().map_err(|e| format!("{flag}: {e}"))?,
                "--num-splits" => c.num_splits = number(flag, &value)?,
                "--check-every" => c.check_every = number(flag, &value)?,
                "--seed" => c.seed = number(flag, &value)? as u64,
                "--backend" => {
                    c.backend = match value.as_str() {
                        "wgpu" => BackendArg::Wgpu,
                        "cpu" => BackendArg::Cpu,
                        other => return Err(format!("--backend: {other}? (wgpu or cpu)")),
                    }
                }
                other => return Err(format!("unknown flag {other}\n{USAGE}")),
            }
        }
        c.validate()?;
        Ok(c)
    }

    fn validate(&self) -> Result<(), String> {
        let positive = [
            ("--layers", self.layers),
            ("--heads", self.heads_q),
            ("--kv-heads", self.heads_kv),
            ("--head-dim", self.head_dim),
            ("--vocab", self.vocab),
            ("--page-size", self.page_size),
        ];
        if let Some((flag, _)) = positive.iter().find(|(_, v)| *v == 0) {
            return Err(format!("{flag} must be at least 1"));
        }
        if self.prompts.is_empty() || self.prompts.contains(&0) {
            return Err("--prompts: one length ≥ 1 per sequence".into());
        }
        if !self.heads_q.is_multiple_of(self.heads_kv) {
            return Err(format!(
                "--heads {} is not a multiple of --kv-heads {}",
                self.heads_q, self.heads_kv
            ));
        }
        Ok(())
    }

    fn batch(&self) -> usize {
        self.prompts.len()
    }

    fn d_model(&self) -> usize {
        self.heads_q * self.head_dim
    }

    fn kv_width(&self) -> usize {
        self.heads_kv * self.head_dim
    }

    fn splits(&self) -> Option<usize> {
        (self.num_splits > 0).then_some(self.num_splits)
    }
}

fn number(flag: &str, s: &str) -> Result<usize, String> {
    s.parse()
        .map_err(|_| format!("{flag}: {s:?} is not a non-negative integer"))
}

/// `x · w` for `rows` rows of `x` (row-major) and `w` of `(x cols, out)`.
fn matmul(x: &[f32], w: &[f32], out: usize) -> Vec<f32> {
    let n = w.len() / out;
    let mut y = vec![0.0f32; x.len() / n * out];
    for (xr, yr) in x.chunks(n).zip(y.chunks_mut(out)) {
        for (&a, wr) in xr.iter().zip(w.chunks(out)) {
            for (y, &b) in yr.iter_mut().zip(wr) {
                *y += a * b;
            }
        }
    }
    y
}

/// RMSNorm of each row of width `n` (no gain).
fn rms_norm(x: &[f32], n: usize) -> Vec<f32> {
    x.chunks(n)
        .flat_map(|r| {
            let s = (r.iter().map(|v| v * v).sum::<f32>() / n as f32 + 1e-6).sqrt();
            r.iter().map(move |v| v / s)
        })
        .collect()
}

/// Greedy decoding skips the last this many tokens of a sequence.
const NO_REPEAT: usize = 4;

struct Layer {
    wq: Vec<f32>,
    wk: Vec<f32>,
    wv: Vec<f32>,
    wo: Vec<f32>,
}

/// The toy model: token embedding (tied with the output) plus sinusoidal
/// positions, and attention-only layers.
struct Model {
    d_model: usize,
    vocab: usize,
    embed: Vec<f32>,
    layers: Vec<Layer>,
}

impl Model {
    fn new(c: &Config, rng: &mut Rng) -> Self {
        let dm = c.d_model();
        // Entries ~ N(0, 1), as the sinusoidal positions added to them.
        let embed = rng.normal_vec(c.vocab * dm, 1.0);
        let mut weights =
            |rows: usize, cols: usize| rng.normal_vec(rows * cols, 1.0 / (rows as f32).sqrt());
        let layers = (0..c.layers)
            .map(|_| Layer {
                wq: weights(dm, dm),
                wk: weights(dm, c.kv_width()),
                wv: weights(dm, c.kv_width()),
                wo: weights(dm, dm),
            })
            .collect();
        Self {
            d_model: dm,
            vocab: c.vocab,
            embed,
            layers,
        }
    }

    /// The input row of `token` at position `pos`.
    fn input(&self, token: u32, pos: usize) -> Vec<f32> {
        let dm = self.d_model;
        let e = &self.embed[token as usize * dm..][..dm];
        e.iter()
            .enumerate()
            .map(|(i, &x)| {
                let angle = pos as f32 / 10000f32.powf((i / 2 * 2) as f32 / dm as f32);
                x + if i % 2 == 0 { angle.sin() } else { angle.cos() }
            })
            .collect()
    }

    /// Greedy next token of a final hidden row (tied embedding logits),
    /// never one of the sequence's last `NO_REPEAT` tokens: a random model
    /// otherwise predicts the token it was fed, forever.
    fn next_token(&self, x: &[f32], history: &[u32]) -> u32 {
        let recent = &history[history.len().saturating_sub(NO_REPEAT)..];
        let h = rms_norm(x, self.d_model);
        let logit = |t: usize| -> f32 {
            let e = &self.embed[t * self.d_model..][..self.d_model];
            e.iter().zip(&h).map(|(a, b)| a * b).sum()
        };
        (0..self.vocab)
            .filter(|t| !recent.contains(&(*t as u32)))
            .map(|t| (t, logit(t)))
            .max_by(|a, b| a.1.total_cmp(&b.1))
            .map_or(0, |(t, _)| t as u32)
    }
}

/// The page pool and the block table: pages leave a shuffled free list as
/// sequences grow; entries past a sequence's last page are -1 (never read).
struct Pages {
    page_size: usize,
    max_pages: usize,
    free: Vec<i32>,
    table: Vec<i32>,
    held: Vec<usize>,
}

impl Pages {
    /// A pool with exactly the pages sequences of `final_lens` need.
    fn new(page_size: usize, final_lens: &[usize], rng: &mut Rng) -> Self {
        let need: Vec<usize> = final_lens.iter().map(|l| l.div_ceil(page_size)).collect();
        let max_pages = need.iter().copied().max().unwrap_or(1);
        let total: usize = need.iter().sum();
        let mut free: Vec<i32> = (0..total as i32).collect();
        for i in (1..free.len()).rev() {
            free.swap(i, (rng.next_u64() % (i as u64 + 1)) as usize);
        }
        Self {
            page_size,
            max_pages,
            free,
            table: vec![-1; final_lens.len() * max_pages],
            held: vec![0; final_lens.len()],
        }
    }

    fn total(&self) -> usize {
        self.free.len() + self.held.iter().sum::<usize>()
    }

    /// Give sequence `b` pages for its first `len` tokens.
    fn reserve(&mut self, b: usize, len: usize) -> Result<(), String> {
        while self.held[b] * self.page_size < len {
            let page = self
                .free
                .pop()
                .ok_or_else(|| format!("sequence {b}: the page pool is empty at {len} tokens"))?;
            self.table[b * self.max_pages + self.held[b]] = page;
            self.held[b] += 1;
        }
        Ok(())
    }

    /// Sequence `b`'s row of the block table.
    fn row(&self, b: usize) -> &[i32] {
        &self.table[b * self.max_pages..][..self.max_pages]
    }
}

/// One cache per layer, on the device or (the CPU backend) in host memory.
enum Caches<'e> {
    Gpu {
        engine: &'e Engine,
        layers: Vec<KvCache>,
    },
    Cpu {
        layers: Vec<HostKvCache>,
    },
}

impl Caches<'_> {
    fn new<'e>(
        engine: Option<&'e Engine>,
        c: &Config,
        shape: CacheShape,
    ) -> flashattn::Result<Caches<'e>> {
        Ok(match engine {
            Some(engine) => Caches::Gpu {
                engine,
                layers: (0..c.layers)
                    .map(|_| engine.kv_cache(shape, c.precision))
                    .collect::<flashattn::Result<_>>()?,
            },
            None => Caches::Cpu {
                layers: vec![HostKvCache::zeros(shape, c.precision); c.layers],
            },
        })
    }

    fn decode(
        &mut self,
        layer: usize,
        step: &DecodeStep,
        opts: &AttentionOptions,
        num_splits: Option<usize>,
    ) -> flashattn::Result<DecodeOutput> {
        match self {
            Caches::Gpu { engine, layers } => {
                engine.decode(&mut layers[layer], step, opts, num_splits)
            }
            Caches::Cpu { layers } => cpu::decode(&mut layers[layer], step, opts, num_splits),
        }
    }

    /// A layer's cache contents on the host (read back from the device).
    fn read(&self, layer: usize) -> flashattn::Result<HostKvCache> {
        match self {
            Caches::Gpu { engine, layers } => engine.read_kv_cache(&layers[layer]),
            Caches::Cpu { layers } => Ok(layers[layer].clone()),
        }
    }

    fn is_gpu(&self) -> bool {
        matches!(self, Caches::Gpu { .. })
    }
}

/// The engine to run on, or `None` for the CPU backend, and what to tell
/// the user about the choice.
fn open(
    backend: BackendArg,
    new_engine: impl FnOnce() -> flashattn::Result<Engine>,
) -> Result<(Option<Engine>, String), String> {
    match backend {
        BackendArg::Cpu => Ok((
            None,
            format!("backend: the CPU backend ({} threads), as requested", rayon::current_num_threads()),
        )),
        BackendArg::Wgpu => {
            let e = new_engine().map_err(|e| format!("--backend wgpu: {e}"))?;
            let line = format!("backend: wgpu on {}", e.describe());
            Ok((Some(e), line))
        }
        BackendArg::Default => match new_engine() {
            Ok(e) => {
                let line = format!("backend: wgpu on {}", e.describe());
                Ok((Some(e), line))
            }
            Err(e) => Ok((
                None,
                format!(
                    "backend: the CPU backend ({} threads), FALLING BACK because there is no GPU adapter: {e}",
                    rayon::current_num_threads()
                ),
            )),
        },
    }
}

/// Time spent, and what was checked.
#[derive(Debug, Default)]
struct Report {
    /// Generated tokens of each sequence (the prefill's first, then one per step).
    generated: Vec<Vec<u32>>,
    /// The prefill, checks excluded.
    prefill: Duration,
    /// The decode steps, checks excluded.
    decode: Duration,
    /// Attention calls of the decode steps (wall: upload, kernels, readback).
    attention: Duration,
    attention_calls: usize,
    /// Submit-to-completion time of their kernels (wgpu only).
    kernels: f64,
    checked_steps: usize,
    checks: usize,
    /// Largest |o_gpu − o_cpu| and |lse_gpu − lse_cpu| over the checks.
    max_o_diff: f64,
    max_lse_diff: f64,
    splits: BTreeSet<usize>,
    checking: Duration,
}

/// The rows of one attention call: `batch` sequences of `seqlen` tokens.
struct Call<'a> {
    batch: usize,
    seqlen: usize,
    lens: &'a [i32],
    table: &'a [i32],
    max_pages: usize,
    /// The step's label in check lines; `Some` when the call is checked.
    check: Option<(&'a str, Option<usize>)>,
}

/// The toy model on its caches.
struct Generator<'c, 'e> {
    cfg: &'c Config,
    model: Model,
    caches: Caches<'e>,
    opts: AttentionOptions,
    report: Report,
}

impl Generator<'_, '_> {
    /// One layer over the call's rows of `x` (`batch · seqlen` rows), in place.
    fn layer(&mut self, l: usize, x: &mut [f32], call: &Call) -> Result<(), String> {
        let c = self.cfg;
        let (dm, d) = (c.d_model(), c.head_dim);
        let layer = &self.model.layers[l];
        let h = rms_norm(x, dm);
        let p = c.precision;
        let q = TensorData::from_f32(matmul(&h, &layer.wq, dm), p);
        let k = TensorData::from_f32(matmul(&h, &layer.wk, c.kv_width()), p);
        let v = TensorData::from_f32(matmul(&h, &layer.wv, c.kv_width()), p);
        let (b, s) = (call.batch, call.seqlen);
        let step = DecodeStep::new(q.view([b, s, c.heads_q, d]), call.lens)
            .block_table(call.table, call.max_pages)
            .append(k.view([b, s, c.heads_kv, d]), v.view([b, s, c.heads_kv, d]));
        let before = match call.check {
            Some(_) => {
                let started = Instant::now();
                let host = self.caches.read(l);
                self.report.checking += started.elapsed();
                Some(host.map_err(|e| format!("reading layer {l}'s cache: {e}"))?)
            }
            None => None,
        };
        let start = Instant::now();
        let mut out = self
            .caches
            .decode(l, &step, &self.opts, c.splits())
            .map_err(|e| format!("layer {l}: decode failed: {e}"))?;
        self.report.attention += start.elapsed();
        self.report.attention_calls += 1;
        self.report.kernels += out.stats.kernel_seconds;
        self.report.splits.insert(out.num_splits);
        if let (Some(before), Some((label, step_index))) = (before, call.check) {
            let started = Instant::now();
            if step_index.is_some() && step_index == c.fault_at {
                let mut o = out.o.to_f32();
                o[0] += 0.5;
                out.o.data = TensorData::from_f32(o, p);
            }
            self.verify(l, label, &out, before, &step)?;
            self.report.checking += started.elapsed();
        }
        let attn = out.o.to_f32();
        for (xi, yi) in x
            .iter_mut()
            .zip(matmul(&attn, &self.model.layers[l].wo, dm))
        {
            *xi += yi;
        }
        Ok(())
    }

    /// Check one layer's attention: the device's output and the CPU
    /// backend's on the same cache contents against the f64 reference
    /// (docs/semantics.md's rule), and the device cache after the append against the
    /// CPU's.
    fn verify(
        &mut self,
        l: usize,
        label: &str,
        out: &DecodeOutput,
        before: HostKvCache,
        step: &DecodeStep,
    ) -> Result<(), String> {
        let fail = |what: String| format!("{label}, layer {l}: {what}");
        let mut line = format!("  check {label}, layer {l}:");
        let rule = |checks: [Check; 2], who: &str| -> Result<String, String> {
            let text = checks
                .iter()
                .map(|k| format!("{} {:.2e} ≤ {:.2e}", k.name, k.max_error, k.bound))
                .collect::<Vec<_>>()
                .join(", ");
            match checks.iter().find(|k| !k.passed()) {
                Some(bad) => Err(fail(format!(
                    "{who} fails docs/semantics.md's accuracy rule: {bad}"
                ))),
                None => Ok(text),
            }
        };
        let ours = check_decode(out, &before, step, &self.opts).map_err(|e| fail(e.to_string()))?;
        let who = if self.caches.is_gpu() { "wgpu" } else { "cpu" };
        line += &format!(" {who} {} ({} splits)", rule(ours, who)?, out.num_splits);
        if self.caches.is_gpu() {
            let mut cpu_cache = before.clone();
            let cpu_out = cpu::decode(&mut cpu_cache, step, &self.opts, self.cfg.splits())
                .map_err(|e| fail(format!("the CPU backend failed: {e}")))?;
            let theirs = check_decode(&cpu_out, &before, step, &self.opts)
                .map_err(|e| fail(e.to_string()))?;
            line += &format!("; cpu {}", rule(theirs, "the CPU backend")?);
            let diff = |a: &[f32], b: &[f32]| {
                a.iter()
                    .zip(b)
                    .filter(|(x, y)| x.is_finite() || y.is_finite())
                    .map(|(x, y)| (f64::from(*x) - f64::from(*y)).abs())
                    .fold(0.0, f64::max)
            };
            let (o_diff, lse_diff) = (
                diff(&out.o.to_f32(), &cpu_out.o.to_f32()),
                diff(&out.lse, &cpu_out.lse),
            );
            self.report.max_o_diff = self.report.max_o_diff.max(o_diff);
            self.report.max_lse_diff = self.report.max_lse_diff.max(lse_diff);
            line += &format!("; |wgpu − cpu| o {o_diff:.1e} lse {lse_diff:.1e}");
            let after = self
                .caches
                .read(l)
                .map_err(|e| fail(format!("reading the cache back: {e}")))?;
            if after != cpu_cache {
                return Err(fail(
                    "the device cache after the append differs from the CPU backend's".into(),
                ));
            }
            line += "; cache rows identical";
        }
        println!("{line}: ok");
        self.report.checks += 1;
        Ok(())
    }

    /// Prompts, one sequence at a time (causal, `seqlen_q` = prompt length).
    fn prefill(&mut self, prompts: &[Vec<u32>], pages: &mut Pages) -> Result<Vec<u32>, String> {
        let (start, checking_before) = (Instant::now(), self.report.checking);
        let dm = self.cfg.d_model();
        let mut first = Vec::new();
        for (b, prompt) in prompts.iter().enumerate() {
            pages.reserve(b, prompt.len())?;
            let mut x: Vec<f32> = prompt
                .iter()
                .enumerate()
                .flat_map(|(pos, &t)| self.model.input(t, pos))
                .collect();
            let label = format!("prefill of sequence {b} ({} tokens)", prompt.len());
            for l in 0..self.cfg.layers {
                let call = Call {
                    batch: 1,
                    seqlen: prompt.len(),
                    lens: &[0],
                    table: pages.row(b),
                    max_pages: pages.max_pages,
                    check: (self.cfg.check_every > 0).then_some((label.as_str(), None)),
                };
                self.layer(l, &mut x, &call)?;
            }
            first.push(self.model.next_token(&x[(prompt.len() - 1) * dm..], prompt));
        }
        self.report.prefill = start
            .elapsed()
            .saturating_sub(self.report.checking - checking_before);
        Ok(first)
    }

    /// `tokens` steps over the whole batch.
    fn decode(
        &mut self,
        prompts: &[Vec<u32>],
        pages: &mut Pages,
        mut last: Vec<u32>,
    ) -> Result<(), String> {
        let c = self.cfg;
        let dm = c.d_model();
        let mut lens: Vec<usize> = prompts.iter().map(Vec::len).collect();
        let mut history = prompts.to_vec();
        for (h, &t) in history.iter_mut().zip(&last) {
            h.push(t);
        }
        self.report.generated = last.iter().map(|&t| vec![t]).collect();
        let (attention_before, calls_before, kernels_before) = (
            self.report.attention,
            self.report.attention_calls,
            self.report.kernels,
        );
        let checking_before = self.report.checking;
        let start = Instant::now();
        for step in 0..c.tokens {
            for (b, &len) in lens.iter().enumerate() {
                pages.reserve(b, len + 1)?;
            }
            let mut x: Vec<f32> = last
                .iter()
                .zip(&lens)
                .flat_map(|(&t, &pos)| self.model.input(t, pos))
                .collect();
            let lens_i32: Vec<i32> = lens.iter().map(|&l| l as i32).collect();
            let checked = c.check_every > 0 && step % c.check_every == 0;
            let label = format!(
                "step {step} (cache lengths {})",
                lens.iter()
                    .map(|l| (l + 1).to_string())
                    .collect::<Vec<_>>()
                    .join("/")
            );
            if checked {
                self.report.checked_steps += 1;
            }
            for l in 0..c.layers {
                let call = Call {
                    batch: c.batch(),
                    seqlen: 1,
                    lens: &lens_i32,
                    table: &pages.table,
                    max_pages: pages.max_pages,
                    check: checked.then_some((label.as_str(), Some(step))),
                };
                self.layer(l, &mut x, &call)?;
            }
            last = x
                .chunks(dm)
                .zip(&history)
                .map(|(row, h)| self.model.next_token(row, h))
                .collect();
            for (b, &t) in last.iter().enumerate() {
                self.report.generated[b].push(t);
                history[b].push(t);
                lens[b] += 1;
            }
        }
        let r = &mut self.report;
        r.decode = start.elapsed().saturating_sub(r.checking - checking_before);
        r.attention -= attention_before;
        r.attention_calls -= calls_before;
        r.kernels -= kernels_before;
        Ok(())
    }
}

/// Generate, check and report; `Err` on any failure or check mismatch.
fn run(cfg: &Config, engine: Option<&Engine>) -> Result<Report, String> {
    let mut rng = Rng::new(cfg.seed);
    let model = Model::new(cfg, &mut rng);
    let prompts: Vec<Vec<u32>> = cfg
        .prompts
        .iter()
        .map(|&n| {
            (0..n)
                .map(|_| (rng.next_u64() % cfg.vocab as u64) as u32)
                .collect()
        })
        .collect();
    let final_lens: Vec<usize> = cfg.prompts.iter().map(|p| p + cfg.tokens).collect();
    let mut pages = Pages::new(cfg.page_size, &final_lens, &mut rng);
    let layout = CacheLayout::Paged {
        pages: pages.total(),
        page_size: cfg.page_size,
    };
    let shape = CacheShape::new(layout, cfg.heads_kv, cfg.head_dim).map_err(|e| e.to_string())?;
    let caches =
        Caches::new(engine, cfg, shape).map_err(|e| format!("allocating the caches: {e}"))?;
    println!(
        "model: {} layers, d_model {}, {} query heads / {} kv heads of d {}, vocab {}, {}; \
         batch {} (prompts {:?}); paged caches of {} pages × {} tokens ({} KiB a layer)",
        cfg.layers,
        cfg.d_model(),
        cfg.heads_q,
        cfg.heads_kv,
        cfg.head_dim,
        cfg.vocab,
        cfg.precision,
        cfg.batch(),
        cfg.prompts,
        pages.total(),
        cfg.page_size,
        2 * shape.len() * cfg.precision.bytes() / 1024,
    );
    let mut g = Generator {
        cfg,
        model,
        caches,
        opts: AttentionOptions::default().causal(true),
        report: Report::default(),
    };
    let first = g.prefill(&prompts, &mut pages)?;
    g.decode(&prompts, &mut pages, first)?;
    Ok(g.report)
}

fn summarize(cfg: &Config, r: &Report, gpu: bool) {
    for (b, tokens) in r.generated.iter().enumerate() {
        let shown: Vec<String> = tokens.iter().take(16).map(u32::to_string).collect();
        println!(
            "sequence {b}: prompt {} tokens → generated {} tokens: {}{}",
            cfg.prompts[b],
            tokens.len(),
            shown.join(" "),
            if tokens.len() > 16 { " …" } else { "" }
        );
    }
    let tokens = (cfg.tokens * cfg.batch()) as f64;
    let secs = |d: Duration| d.as_secs_f64().max(1e-9);
    println!(
        "prefill: {} prompts ({} tokens) in {:.1} ms",
        cfg.batch(),
        cfg.prompts.iter().sum::<usize>(),
        r.prefill.as_secs_f64() * 1e3
    );
    println!(
        "decode: {} steps × {} sequences = {} tokens in {:.2} s: {:.1} tokens/s in total \
         (host projections and logits included, checks excluded)",
        cfg.tokens,
        cfg.batch(),
        tokens,
        r.decode.as_secs_f64(),
        tokens / secs(r.decode)
    );
    let per_call = r.attention.as_secs_f64() / r.attention_calls.max(1) as f64;
    let kernels = if gpu {
        format!(
            ", of which {:.3} ms in kernels",
            r.kernels / r.attention_calls.max(1) as f64 * 1e3
        )
    } else {
        String::new()
    };
    println!(
        "attention: {} decode calls in {:.2} s ({:.3} ms a call{kernels}): {:.1} tokens/s from attention alone",
        r.attention_calls,
        r.attention.as_secs_f64(),
        per_call * 1e3,
        tokens / secs(r.attention)
    );
    let splits: Vec<String> = r.splits.iter().map(usize::to_string).collect();
    println!(
        "splits used: {} ({})",
        splits.join(", "),
        if cfg.num_splits == 0 {
            "planner".to_string()
        } else {
            format!("--num-splits {}", cfg.num_splits)
        }
    );
    if r.checks > 0 {
        let diff = if gpu {
            format!(
                "; largest |wgpu − cpu|: o {:.2e}, lse {:.2e}; device caches identical to the CPU's",
                r.max_o_diff, r.max_lse_diff
            )
        } else {
            String::new()
        };
        println!(
            "checks: PASS — prefill and {} sampled step(s), {} layer calls, all within docs/semantics.md's accuracy rule{diff} ({:.1} s)",
            r.checked_steps,
            r.checks,
            r.checking.as_secs_f64()
        );
    } else {
        println!("checks: none (--check-every 0)");
    }
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let env = std::env::var("FLASHATTN_DECODE_TOKENS").ok();
    let cfg = match Config::parse(&args, env.as_deref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    let (engine, line) = match open(cfg.backend, Engine::new) {
        Ok(x) => x,
        Err(e) => {
            eprintln!("decode: {e}");
            std::process::exit(1);
        }
    };
    if engine.is_none() && cfg.backend == BackendArg::Default {
        eprintln!(
            "NOTICE: no GPU adapter, so attention runs on the CPU backend; \
             the checks then hold it to the f64 reference only"
        );
    }
    println!("{line}");
    match run(&cfg, engine.as_ref()) {
        Ok(report) => summarize(&cfg, &report, engine.is_some()),
        Err(e) => {
            eprintln!("decode: FAILED: {e}");
            std::process::exit(1);
        }
    }
}

/// Run by `cargo test` (the example is registered with `test = true`).
#[cfg(test)]
mod tests {
    use super::*;
    /// The process's engine, `None` without an adapter (the harness lists
    /// the waiver; FLASHATTN_REQUIRE_GPU=1 makes it a failure): the example's
    /// GPU runs then go to the CPU backend.
    use flashattn_testkit::engine;

    fn args(s: &str) -> Vec<String> {
        s.split_whitespace().map(String::from).collect()
    }

    #[test]
    fn sixteen_tokens_pass_their_checks() {
        let cfg = Config::parse(&args("--tokens 16 --check-every 5"), None).unwrap();
        let r = run(&cfg, engine()).unwrap();
        summarize(&cfg, &r, engine().is_some());
        assert_eq!(r.generated.len(), 3);
        assert!(r.generated.iter().all(|g| g.len() == 17));
        assert!(r.generated.iter().flatten().all(|&t| t < 256));
        // Steps 0, 5, 10 and 15, plus the three prefills, every layer.
        assert_eq!(r.checked_steps, 4);
        assert_eq!(r.checks, (4 + 3) * 4);
        assert_eq!(r.attention_calls, 16 * 4);
    }

    #[test]
    fn forced_splits_and_f32_pages_of_one_token() {
        let cfg = Config::parse(
            &args("--tokens 6 --prompts 150,3 --layers 2 --page-size 1 --precision f32 --num-splits 3 --check-every 2"),
            None,
        )
        .unwrap();
        let r = run(&cfg, engine()).unwrap();
        assert_eq!(r.checks, (3 + 2) * 2);
        // The long sequence's keys are split as asked (a limit may raise the
        // count, never lower it); the short prefill's 3 keys are less than
        // one block of either decode kernel (the lanes kernel's blocks are a
        // subgroup: 8 keys on lavapipe, 4 at the least), and splits are whole blocks.
        assert!(r.splits.iter().any(|&s| s >= 3), "{:?}", r.splits);
        assert!(r.splits.contains(&1), "{:?}", r.splits);
    }

    #[test]
    fn without_an_adapter_it_falls_back_to_the_cpu_backend() {
        let missing = || -> flashattn::Result<Engine> {
            Err(flashattn::Error::NoAdapter {
                source: flashattn::wgpu::RequestAdapterError::EnvNotSet,
            })
        };
        let (engine, notice) = open(BackendArg::Default, missing).unwrap();
        assert!(engine.is_none());
        assert!(
            notice.contains("no GPU adapter") && notice.contains("CPU backend"),
            "{notice}"
        );
        // Asking for wgpu explicitly is an error, not a fallback.
        let err = open(BackendArg::Wgpu, missing).unwrap_err();
        assert!(err.contains("no GPU adapter"), "{err}");
        let cfg = Config::parse(&args("--tokens 8 --layers 2 --check-every 4"), None).unwrap();
        let r = run(&cfg, None).unwrap();
        assert_eq!(r.checks, (2 + 3) * 2);
        assert_eq!(r.kernels, 0.0);
    }

    #[test]
    fn a_corrupted_output_fails_the_check() {
        for gpu in [true, false] {
            let engine = if gpu { engine() } else { None };
            if gpu && engine.is_none() {
                continue;
            }
            let mut cfg =
                Config::parse(&args("--tokens 5 --layers 1 --check-every 2"), None).unwrap();
            cfg.fault_at = Some(2);
            let err = run(&cfg, engine).unwrap_err();
            assert!(
                err.contains("step 2") && err.contains("accuracy rule"),
                "{err}"
            );
        }
    }

    #[test]
    fn flags_and_the_environment() {
        let c = Config::parse(&[], Some("40")).unwrap();
        assert_eq!((c.tokens, c.prompts.clone()), (40, vec![7, 19, 33]));
        let c = Config::parse(
            &args("--tokens=12 --prompts 4,5 --backend cpu --precision f32"),
            Some("40"),
        )
        .unwrap();
        assert_eq!(c.tokens, 12);
        assert_eq!(c.prompts, vec![4, 5]);
        assert_eq!(c.backend, BackendArg::Cpu);
        assert_eq!(c.precision, Precision::F32);
        for bad in [
            "--tokens",
            "--heads 5",
            "--prompts 3,0",
            "--page-size 0",
            "--nope 1",
            "--backend gl",
            "--precision bf8",
        ] {
            assert!(Config::parse(&args(bad), None).is_err(), "{bad} accepted");
        }
    }
}

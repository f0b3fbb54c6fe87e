//! The known-answer cases and how a result is judged. Every backend runs
//! the same cases (sized for the family under test) and compares with the
//! f64 reference under the accuracy rule of docs/semantics.md
//! ([`crate::accuracy`]).
//!
//! - [`AttentionCase::band`], the first-use check: 2 batch entries × 37
//!   query rows (odd) × 4 query heads over 2 kv heads (GQA); keys for two
//!   and a half of the family's key tiles, so a ring of two K/V buffers
//!   wraps; a causal window; an odd head dim where the family takes one;
//!   and (forward) one row whose score against its diagonal key is +100.
//! - [`AttentionCase::layouts`]: every layout at once (a packed batch with
//!   an empty sequence, ALiBi per sequence, sinks, a block mask of 7×13
//!   blocks, softcap, a causal window, GQA, v's own head dim).
//! - [`DecodeCase`]: two sequences on a paged cache of 5-token pages (or a
//!   dense cache read through `cache_batch_idx`, with softcap), two tokens
//!   appended and two decoded under a causal window, GQA, a +100 score on
//!   an appended key, keys for three of the kernel's blocks.

use crate::accuracy::{check_backward, check_decode, check_decode_on_values, check_forward, Check};
use crate::kv_quant::{CacheQuant, QuantKvCache};
use crate::api::decode::{
    CacheLayout, CacheShape, DecodeOutput, DecodeProblem, DecodeStep, HostKvCache,
};
use crate::api::inputs::{BackwardInputs, ForwardInputs};
use crate::api::options::AttentionOptions;
use crate::api::output::{BackwardOutput, ForwardOutput};
use crate::api::shape::AttentionShape;
use crate::api::tensor::{Precision, TensorData, TensorView};
// The layouts case's inputs.
#[cfg(any(test, feature = "lab", feature = "cuda"))]
use crate::api::{
    block_mask::{BlockGrid, BlockMask},
    scores::{Alibi, Sinks},
    varlen::Varlen,
};
use crate::error::Result;
use crate::plan::{DecodeRequest, KernelFamily};
use crate::random::Rng;

/// The score the hot row reaches against its diagonal key.
pub const HOT_SCORE: f32 = 100.0;
/// Query rows of the band case (odd, more than one query tile).
const ROWS: usize = 37;

/// Seeded inputs of one attention case (q, k, v and the output gradient).
#[derive(Clone, Debug)]
pub struct AttentionCase {
    /// What the case covers (`band`, `layouts`), which the tests check.
    #[cfg_attr(not(test), allow(dead_code))]
    pub name: &'static str,
    /// The problem (a packed batch: its batch of one), which the tests check.
    #[cfg_attr(not(test), allow(dead_code))]
    pub shape: AttentionShape,
    /// The masks, scores and layouts of the case.
    pub opts: AttentionOptions,
    data: [TensorData; 4],
    /// Shapes of q, k, v and o as views (a packed batch is a batch of one).
    shapes: [[usize; 4]; 4],
}

/// Seeded normal(0, 1) values, one vector per length.
fn seeded<const N: usize>(seed: u64, lens: [usize; N]) -> [Vec<f32>; N] {
    let mut rng = Rng::new(seed);
    lens.map(|n| rng.normal_vec(n, 1.0))
}

impl AttentionCase {
    /// The first-use check for a family whose kernels take `head_dim` and
    /// walk keys in tiles of `key_tile`; with `hot`, the row of score +100.
    /// The backward's check goes without it: recomputing P = exp(S − LSE)
    /// from scores near 100 costs |S|·ε in f32 (as in every FlashAttention
    /// backward), while the rule's naive baseline subtracts the row's
    /// maximum first — a correct kernel would fail at the bound's edge.
    pub fn band(precision: Precision, head_dim: usize, key_tile: usize, hot: bool) -> Result<Self> {
        let keys = 2 * key_tile + key_tile / 2 + 1;
        let shape = AttentionShape::new(2, ROWS, keys.max(ROWS + 2), 4, 2, head_dim)?;
        let opts = AttentionOptions::default()
            .causal(true)
            .window(Some(shape.seqlen_k - 8), None);
        let [mut q, k, v, d_o] = seeded(
            0x7e57 ^ head_dim as u64,
            [shape.q_len(), shape.kv_len(), shape.v_len(), shape.o_len()],
        );
        if hot {
            hot_row(&mut q, &k, &shape, opts.scale_for(head_dim));
        }
        Ok(Self::new("band", shape, opts, [q, k, v, d_o], precision))
    }

    /// The case with attention dropout (p = 0.25, a fixed seed and an
    /// offset past the first Philox block): the reference draws the
    /// kernels' mask, so a kernel that draws another fails.
    pub fn with_dropout(mut self) -> Self {
        self.opts = self
            .opts
            .dropout(0.25)
            .dropout_seed(0x5eed)
            .dropout_offset(3);
        self
    }

    /// Every layout at once, at head dims `d` (q, k) and `dv` (v, o).
    #[cfg(any(test, feature = "lab", feature = "cuda"))]
    pub fn layouts(precision: Precision, d: usize, dv: usize) -> Result<Self> {
        let (lq, lk) = ([21, 0, 45, 30], [30, 12, 17, 30]);
        let cu = |lens: &[i32; 4]| -> Vec<i32> {
            std::iter::once(0)
                .chain(lens.iter().scan(0, |acc, n| {
                    *acc += n;
                    Some(*acc)
                }))
                .collect()
        };
        let varlen = Varlen::new(&cu(&lq), &cu(&lk))?;
        let (total_q, total_k) = varlen.totals();
        let shape = AttentionShape::new(1, total_q, total_k, 4, 2, d)?.with_head_dim_v(dv)?;
        let (max_q, max_k) = varlen.max_seqlens();
        let grid = BlockGrid::new(max_q, max_k, (7, 13))?;
        let slopes: Vec<f32> = (0..16).map(|i| 0.02 * (i + 1) as f32).collect();
        let opts = AttentionOptions::default()
            .causal(true)
            .window(Some(20), None)
            .softcap(7.0)
            .alibi(Alibi::new(&slopes))
            .sinks(Sinks::new(&[0.1, -0.3, 1.0, 2.0]))
            .block_mask(BlockMask::random(grid, 4, 0.5, 4))
            .varlen(varlen);
        let data = seeded(
            0x1a70 ^ d as u64,
            [shape.q_len(), shape.kv_len(), shape.v_len(), shape.o_len()],
        );
        Ok(Self::new("layouts", shape, opts, data, precision))
    }

    fn new(
        name: &'static str,
        shape: AttentionShape,
        opts: AttentionOptions,
        data: [Vec<f32>; 4],
        precision: Precision,
    ) -> Self {
        let shapes = [
            shape.q_shape(),
            shape.kv_shape(),
            shape.v_shape(),
            shape.o_shape(),
        ];
        Self {
            name,
            shape,
            opts,
            data: data.map(|d| TensorData::from_f32(d, precision)),
            shapes,
        }
    }

    /// The storage precision of the inputs.
    #[cfg(test)]
    pub fn precision(&self) -> Precision {
        self.data[0].precision()
    }

    /// q, k, v and the output gradient.
    pub fn views(&self) -> [TensorView<'_>; 4] {
        [0, 1, 2, 3].map(|i| self.data[i].view(self.shapes[i]))
    }

    /// The CPU backend's forward of the case: what the backward check
    /// starts from, so that a faulty forward cannot spoil it.
    pub fn cpu_forward(&self) -> Result<ForwardOutput> {
        let [q, k, v, _] = self.views();
        crate::cpu::forward(&ForwardInputs::new(q, k, v), &self.opts)
    }

    /// A forward result under the rule.
    pub fn judge_forward(&self, out: &ForwardOutput) -> Result<Judgement> {
        let [q, k, v, _] = self.views();
        Ok(Judgement::of(&check_forward(out, &q, &k, &v, &self.opts)?))
    }

    /// A backward result (from `forward`'s o and lse) under the rule.
    pub fn judge_backward(&self, out: &BackwardOutput) -> Result<Judgement> {
        let [q, k, v, d_o] = self.views();
        let checks = check_backward(out, &q, &k, &v, &d_o, &self.opts)?;
        Ok(Judgement::of(&checks))
    }

    /// The backward's inputs from `forward` (the CPU backend's).
    pub fn backward_inputs<'a>(&'a self, forward: &'a ForwardOutput) -> Result<BackwardInputs<'a>> {
        let [q, k, v, d_o] = self.views();
        BackwardInputs::new(ForwardInputs::new(q, k, v), forward, d_o)
    }
}

/// Aim query row 3 of batch 0, head 0 at its diagonal key (allowed by the
/// causal window), so their score is [`HOT_SCORE`]: the softmax of that
/// row must subtract its maximum before exponentiating.
fn hot_row(q: &mut [f32], k: &[f32], s: &AttentionShape, scale: f32) {
    let (row, d) = (3, s.head_dim);
    let key = row + s.seqlen_k - s.seqlen_q;
    let k_row = &k[key * s.heads_kv * d..][..d];
    let norm: f32 = k_row.iter().map(|x| x * x).sum();
    let factor = HOT_SCORE / (scale * norm.max(f32::MIN_POSITIVE));
    let q_row = &mut q[row * s.heads_q * d..][..d];
    for (qi, ki) in q_row.iter_mut().zip(k_row) {
        *qi = ki * factor;
    }
}

/// How a decode case's cache is laid out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DecodeLayout {
    /// Pages of 5 tokens, the sequences' pages interleaved, a causal window.
    Paged,
    /// A dense cache of 3 rows, the sequences in rows 2 and 0
    /// (`cache_batch_idx`), a causal window and softcap.
    Dense,
}

/// Seeded inputs of one decoding step.
#[derive(Clone, Debug)]
pub struct DecodeCase {
    /// The cache before the step.
    pub cache: HostKvCache,
    /// The band and score options of the step.
    pub opts: AttentionOptions,
    layout: DecodeLayout,
    q: TensorData,
    new: [TensorData; 2],
    lens: Vec<i32>,
    /// The block table (paged) or the cache rows (dense).
    pages: Vec<i32>,
    max_pages: usize,
    q_shape: [usize; 4],
    new_shape: [usize; 4],
}

/// Tokens decoded and appended per step; query and kv heads.
const DECODE_TOKENS: usize = 2;
const DECODE_HEADS: (usize, usize) = (4, 2);
const PAGE_SIZE: usize = 5;

impl DecodeCase {
    /// What the decode planner is asked for the case's kernel at head dim
    /// `d` (its tiles do not depend on the keys).
    pub fn request(precision: Precision, d: usize, kernel: KernelFamily) -> DecodeRequest {
        DecodeRequest {
            batch: 2,
            seqlen_q: DECODE_TOKENS,
            heads_q: DECODE_HEADS.0,
            heads_kv: DECODE_HEADS.1,
            head_dim: d,
            head_dim_v: d,
            max_seqlen_k: 1,
            precision,
            num_splits: None,
            f16_native: None,
            kernel: Some(kernel),
        }
    }

    /// The decode check for kernels of `head_dim` that walk keys in blocks
    /// of `block`: sequences of one block and a few keys, and of three.
    pub fn new(
        precision: Precision,
        head_dim: usize,
        block: usize,
        layout: DecodeLayout,
    ) -> Result<Self> {
        let ((heads_q, heads_kv), d, t) = (DECODE_HEADS, head_dim, DECODE_TOKENS);
        let lens = [block + 5, 3 * block - 1];
        let (cache, pages, max_pages) = cache_layout(layout, lens, heads_kv, d)?;
        let q_shape = [2, t, heads_q, d];
        let new_shape = [2, t, heads_kv, d];
        let n_new: usize = new_shape.iter().product();
        let [mut q, k, v, k_new, v_new] = seeded(
            0xdec0 ^ d as u64,
            [
                q_shape.iter().product(),
                cache.len(),
                cache.len(),
                n_new,
                n_new,
            ],
        );
        let mut opts = AttentionOptions::default()
            .causal(true)
            .window(Some(lens[1] - 4), None);
        if layout == DecodeLayout::Dense {
            opts = opts.softcap(5.0);
        }
        // Row 0 of sequence 1, head 0, aims at the first appended key (its
        // diagonal). Under softcap 5 no score reaches 100: the row still
        // tests a dominant key.
        let scale = opts.scale_for(d);
        let key = &k_new[(t * heads_kv) * d..][..d];
        let norm: f32 = key.iter().map(|x| x * x).sum();
        let factor = HOT_SCORE / (scale * norm.max(f32::MIN_POSITIVE));
        for (qi, ki) in q[(t * heads_q) * d..][..d].iter_mut().zip(key) {
            *qi = ki * factor;
        }
        let store = |x: Vec<f32>| TensorData::from_f32(x, precision);
        Ok(Self {
            cache: HostKvCache::new(cache, store(k), store(v))?,
            opts,
            layout,
            q: store(q),
            new: [store(k_new), store(v_new)],
            lens: lens.map(|l| l as i32).to_vec(),
            pages,
            max_pages,
            q_shape,
            new_shape,
        })
    }

    /// The step: q, the appended rows, the lengths and the block table
    /// (or the dense cache's rows).
    pub fn step(&self) -> DecodeStep<'_> {
        let step = DecodeStep::new(self.q.view(self.q_shape), &self.lens).append(
            self.new[0].view(self.new_shape),
            self.new[1].view(self.new_shape),
        );
        match self.layout {
            DecodeLayout::Paged => step.block_table(&self.pages, self.max_pages),
            DecodeLayout::Dense => step.batch_idx(&self.pages),
        }
    }

    /// A step's result under the rule (against the cache before the step).
    pub fn judge(&self, out: &DecodeOutput) -> Result<Judgement> {
        let checks = check_decode(out, &self.cache, &self.step(), &self.opts)?;
        Ok(Judgement::of(&checks))
    }

    /// The case's cache quantized as `quant` (finite values: never fails
    /// on the seeded ones).
    pub fn quantized(&self, quant: CacheQuant) -> Result<QuantKvCache> {
        QuantKvCache::quantize(&self.cache, quant)
    }

    /// A step on the quantized cache `before`: `after` must hold exactly
    /// the host rule's codes and scales, and `out` meet the rule against
    /// the f64 reference on their values.
    pub fn judge_quantized(
        &self,
        before: &QuantKvCache,
        after: &QuantKvCache,
        out: &DecodeOutput,
    ) -> Result<Judgement> {
        let step = self.step();
        let p = DecodeProblem::new(&step, &before.shape, before.precision)?;
        let mut expected = before.clone();
        expected.append(&p, &self.new[0].to_f32(), &self.new[1].to_f32());
        if *after != expected {
            let differ = |a: &[u8], b: &[u8]| a.iter().zip(b).filter(|(x, y)| x != y).count();
            return Ok(Judgement {
                passed: false,
                worst: format!(
                    "the appended cache is not the rule's: {} K and {} V codes differ, scales {}",
                    differ(&after.k.codes, &expected.k.codes),
                    differ(&after.v.codes, &expected.v.codes),
                    if after.k.scales == expected.k.scales && after.v.scales == expected.v.scales {
                        "equal"
                    } else {
                        "differ"
                    }
                ),
                max_error: f64::NAN,
                bound: f64::NAN,
            });
        }
        let checks = check_decode_on_values(out, &after.dequantized(), &step, &self.opts)?;
        Ok(Judgement::of(&checks))
    }
}

/// The cache of two sequences of `lens` tokens (plus the appended ones),
/// and its block table (paged: sequence 0 on the even pages, 1 on the odd
/// ones) or rows (dense) with the table's width.
fn cache_layout(
    layout: DecodeLayout,
    lens: [usize; 2],
    heads_kv: usize,
    d: usize,
) -> Result<(CacheShape, Vec<i32>, usize)> {
    let t = DECODE_TOKENS;
    if layout == DecodeLayout::Dense {
        let layout = CacheLayout::Dense {
            batch: 3,
            capacity: lens[1] + t + 3,
        };
        return Ok((CacheShape::new(layout, heads_kv, d)?, vec![2, 0], 1));
    }
    let pages_of = |len: usize| (len + t).div_ceil(PAGE_SIZE);
    let max_pages = pages_of(lens[1]);
    let total = pages_of(lens[0]) + max_pages;
    let mut order = (0..total as i32)
        .step_by(2)
        .chain((1..total as i32).step_by(2));
    let mut pages = vec![0; 2 * max_pages];
    for (b, &len) in lens.iter().enumerate() {
        for slot in &mut pages[b * max_pages..][..pages_of(len)] {
            *slot = order.next().unwrap_or(0);
        }
    }
    let layout = CacheLayout::Paged {
        pages: total,
        page_size: PAGE_SIZE,
    };
    Ok((CacheShape::new(layout, heads_kv, d)?, pages, max_pages))
}

/// The rule's verdict on every output of one run, in a line.
#[derive(Clone, Debug, PartialEq)]
pub struct Judgement {
    /// Every output met the rule.
    pub passed: bool,
    /// The worst output: the first that failed, else the one closest to its bound.
    pub worst: String,
    /// Its max error and bound (`NaN` bound where it failed on a non-finite value).
    pub max_error: f64,
    /// The bound it is held to.
    pub bound: f64,
}

impl Judgement {
    /// The verdict on `checks`.
    pub fn of(checks: &[Check]) -> Self {
        let ratio = |c: &Check| c.max_error / c.bound.max(f64::MIN_POSITIVE);
        let worst = checks
            .iter()
            .find(|c| !c.passed())
            .or_else(|| checks.iter().max_by(|a, b| ratio(a).total_cmp(&ratio(b))));
        let Some(c) = worst else {
            return Self {
                passed: false,
                worst: "no outputs were checked".into(),
                max_error: f64::NAN,
                bound: f64::NAN,
            };
        };
        let line = match &c.non_finite {
            Some(why) => format!("{}: {why}", c.name),
            None => format!(
                "{}: max error {:.2e} {} bound {:.2e}",
                c.name,
                c.max_error,
                if c.passed() { "<=" } else { ">" },
                c.bound
            ),
        };
        Self {
            passed: checks.iter().all(Check::passed),
            worst: line,
            max_error: c.max_error,
            bound: c.bound,
        }
    }

    /// The judgements of several runs as one: every run must pass; the
    /// worst of them is reported.
    pub fn all(runs: Vec<Judgement>) -> Self {
        let worst = runs.iter().position(|j| !j.passed).or_else(|| {
            (0..runs.len()).max_by(|&a, &b| {
                let r = |j: &Judgement| j.max_error / j.bound.max(f64::MIN_POSITIVE);
                r(&runs[a]).total_cmp(&r(&runs[b]))
            })
        });
        match worst {
            Some(i) => runs[i].clone(),
            None => Self::of(&[]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_band_case_wraps_rings_and_has_a_hot_row() {
        let case = AttentionCase::band(Precision::F32, 19, 64, true).unwrap();
        let s = case.shape;
        assert_eq!(
            (s.batch, s.seqlen_q, s.seqlen_k, s.heads_q, s.heads_kv),
            (2, 37, 161, 4, 2)
        );
        assert!(
            s.seqlen_k.div_ceil(64) >= 3,
            "more key tiles than two buffers"
        );
        let out = case.cpu_forward().unwrap();
        // The hot row's LSE is about its one dominant score.
        let lse = out.lse[3];
        assert!((lse - HOT_SCORE).abs() < 1.0, "lse {lse}");
        assert!(case.judge_forward(&out).unwrap().passed);
        // Every lse is finite: no row is empty.
        assert!(out.lse.iter().all(|x| x.is_finite()));
    }

    /// The dropout case passes on the CPU backend's mask, forward and
    /// backward, and fails on another seed's: a kernel drawing the wrong
    /// mask cannot pass its check.
    #[test]
    fn the_dropout_case_knows_its_mask() {
        let case = AttentionCase::band(Precision::F16, 19, 16, true)
            .unwrap()
            .with_dropout();
        assert!(case.opts.dropout.is_active());
        let fwd = case.cpu_forward().unwrap();
        assert!(case.judge_forward(&fwd).unwrap().passed);
        let bwd = crate::cpu::backward(&case.backward_inputs(&fwd).unwrap(), &case.opts).unwrap();
        assert!(case.judge_backward(&bwd).unwrap().passed);
        let [q, k, v, _] = case.views();
        let other = case.opts.clone().dropout_seed(0x5eee);
        let wrong = crate::cpu::forward(&ForwardInputs::new(q, k, v), &other).unwrap();
        assert!(!case.judge_forward(&wrong).unwrap().passed);
    }

    #[test]
    fn a_wrong_output_fails_and_names_the_worst_output() {
        let case = AttentionCase::band(Precision::F16, 20, 8, true).unwrap();
        let mut out = case.cpu_forward().unwrap();
        let mut o = out.o.to_f32();
        o[7] += 0.25;
        out.o.data = TensorData::from_f32(o, Precision::F16);
        let j = case.judge_forward(&out).unwrap();
        assert!(!j.passed);
        assert!(j.worst.starts_with("o: max error 2.5"), "{}", j.worst);
        let all = Judgement::all(vec![
            case.judge_forward(&case.cpu_forward().unwrap()).unwrap(),
            j.clone(),
        ]);
        assert_eq!(all, j);
    }

    #[test]
    fn the_layouts_and_decode_cases_pass_on_the_cpu_backend() {
        let case = AttentionCase::layouts(Precision::Bf16, 36, 20).unwrap();
        let fwd = case.cpu_forward().unwrap();
        assert!(case.judge_forward(&fwd).unwrap().passed);
        let bwd = crate::cpu::backward(&case.backward_inputs(&fwd).unwrap(), &case.opts).unwrap();
        assert!(bwd.dsinks.is_some());
        assert!(case.judge_backward(&bwd).unwrap().passed);
        for layout in [DecodeLayout::Paged, DecodeLayout::Dense] {
            let decode = DecodeCase::new(Precision::F16, 20, 8, layout).unwrap();
            let mut cache = decode.cache.clone();
            let out =
                crate::cpu::decode(&mut cache, &decode.step(), &decode.opts, Some(3)).unwrap();
            let j = decode.judge(&out).unwrap();
            assert!(j.passed, "{layout:?}: {}", j.worst);
            // lse is (batch, heads_q, tokens): sequence 1, head 0, token 0.
            let hot = out.lse[4 * DECODE_TOKENS];
            if layout == DecodeLayout::Paged {
                assert!((hot - HOT_SCORE).abs() < 1.0, "lse {hot}");
            }
        }
    }
}

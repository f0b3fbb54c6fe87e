//! Decoding test cases shared by the CPU and GPU suites: a random cache
//! (dense or paged, pages shuffled, garbage past every sequence's end),
//! a step (q, lengths, maybe k_new/v_new), and the checks — o and lse
//! under docs/semantics.md's rule against the f64 reference, and the updated cache
//! bit-identical to docs/semantics.md's append computed by the reference.

use flashattn::accuracy::check_decode;
use flashattn::random::Rng;
use flashattn::{Alibi, AttentionOptions, Error, Precision, Result, Sinks, TensorData};
use flashattn::{CacheLayout, CacheShape, DecodeOutput, DecodeStep, HostKvCache};

/// How the case's cache is laid out.
#[derive(Clone, Debug)]
pub enum Layout {
    /// `capacity` tokens per row; `rows` ≥ batch cache rows, sequences in
    /// shuffled rows (cache_batch_idx) when `shuffled`.
    Dense {
        capacity: usize,
        rows: usize,
        shuffled: bool,
    },
    /// Pages of `page_size`, shuffled, with spare pages.
    Paged { page_size: usize },
}

#[derive(Clone, Debug)]
pub struct DecodeCase {
    pub seqlen_q: usize,
    pub heads_q: usize,
    pub heads_kv: usize,
    pub head_dim: usize,
    /// v's (and o's) head dim.
    pub head_dim_v: usize,
    pub precision: Precision,
    /// Tokens in each sequence's cache before the step (its length is the batch).
    pub cache_lens: Vec<usize>,
    /// Tokens appended (0: no k_new/v_new).
    pub seqlen_new: usize,
    pub layout: Layout,
    pub opts: AttentionOptions,
    pub num_splits: Option<usize>,
    pub seed: u64,
    /// A latent cache: V a view of K's first `head_dim_v` columns, steps
    /// appending K's rows alone.
    pub latent: bool,
}

impl DecodeCase {
    pub fn new(cache_lens: &[usize], head_dim: usize) -> Self {
        let capacity = cache_lens.iter().max().copied().unwrap_or(0) + 16;
        Self {
            seqlen_q: 1,
            heads_q: 4,
            heads_kv: 2,
            head_dim,
            head_dim_v: head_dim,
            precision: Precision::F32,
            cache_lens: cache_lens.to_vec(),
            seqlen_new: 0,
            layout: Layout::Dense {
                capacity,
                rows: cache_lens.len(),
                shuffled: false,
            },
            opts: AttentionOptions::default(),
            num_splits: None,
            seed: cache_lens.iter().sum::<usize>() as u64 * 31 + head_dim as u64,
            latent: false,
        }
    }
    /// A latent cache (V a view of K).
    pub fn latent(self) -> Self {
        Self {
            latent: true,
            ..self
        }
    }
    pub fn heads(self, heads_q: usize, heads_kv: usize) -> Self {
        Self {
            heads_q,
            heads_kv,
            ..self
        }
    }
    pub fn seqlen_q(self, seqlen_q: usize) -> Self {
        Self { seqlen_q, ..self }
    }
    /// V (and o) of head dim `head_dim_v`.
    pub fn dv(self, head_dim_v: usize) -> Self {
        Self { head_dim_v, ..self }
    }
    pub fn append(self, seqlen_new: usize) -> Self {
        // Keep room for the new tokens in a dense cache.
        let layout = match self.layout {
            Layout::Dense {
                capacity,
                rows,
                shuffled,
            } => Layout::Dense {
                capacity: capacity + seqlen_new,
                rows,
                shuffled,
            },
            paged => paged,
        };
        Self {
            seqlen_new,
            layout,
            ..self
        }
    }
    pub fn paged(self, page_size: usize) -> Self {
        let layout = Layout::Paged { page_size };
        Self { layout, ..self }
    }
    /// A dense cache with spare rows, sequences in shuffled rows.
    pub fn batch_idx(self) -> Self {
        let n = self.cache_lens.len();
        let capacity = self.cache_lens.iter().max().copied().unwrap_or(0) + self.seqlen_new + 5;
        let layout = Layout::Dense {
            capacity,
            rows: n + 2,
            shuffled: true,
        };
        Self { layout, ..self }
    }
    pub fn opts(self, opts: AttentionOptions) -> Self {
        Self { opts, ..self }
    }
    pub fn f16(self) -> Self {
        let precision = Precision::F16;
        Self { precision, ..self }
    }
    pub fn bf16(self) -> Self {
        let precision = Precision::Bf16;
        Self { precision, ..self }
    }
    pub fn splits(self, n: usize) -> Self {
        let num_splits = (n > 0).then_some(n);
        Self { num_splits, ..self }
    }

    pub fn batch(&self) -> usize {
        self.cache_lens.len()
    }

    /// The cache and step data of this case.
    pub fn data(&self) -> CaseData {
        let mut rng = Rng::new(self.seed);
        let b = self.batch();
        let mut tensor = |n: usize| TensorData::from_f32(rng.normal_vec(n, 1.0), self.precision);
        let (shape, index) = self.cache_index(b);
        let cache = HostKvCache::new(shape, tensor(shape.len()), tensor(shape.v_len()))
            .expect("a consistent cache");
        let q = tensor(b * self.seqlen_q * self.heads_q * self.head_dim);
        let new_rows = b * self.seqlen_new * self.heads_kv;
        // A latent step appends K's rows alone.
        let v_new_len = if self.latent {
            0
        } else {
            new_rows * self.head_dim_v
        };
        let (k_new, v_new) = (tensor(new_rows * self.head_dim), tensor(v_new_len));
        CaseData {
            cache,
            q,
            k_new,
            v_new,
            lens: self.cache_lens.iter().map(|&x| x as i32).collect(),
            index,
            case: self.clone(),
        }
    }

    /// The cache shape and its index: cache_batch_idx (dense, shuffled) or a
    /// block table over shuffled pages, with spare pages and -1 padding.
    fn cache_index(&self, b: usize) -> (CacheShape, Index) {
        let mut rng = Rng::new(self.seed ^ 0x5eed);
        match self.layout {
            Layout::Dense {
                capacity,
                rows,
                shuffled,
            } => {
                let layout = CacheLayout::Dense {
                    batch: rows,
                    capacity,
                };
                let shape = self.shape(layout);
                let idx = shuffled.then(|| {
                    let mut all: Vec<i32> = (0..rows as i32).collect();
                    shuffle(&mut all, &mut rng);
                    all[..b].to_vec()
                });
                (shape, Index::Dense(idx))
            }
            Layout::Paged { page_size } => {
                let need: Vec<usize> = self
                    .cache_lens
                    .iter()
                    .map(|&l| (l + self.seqlen_new).div_ceil(page_size))
                    .collect();
                let max_pages = need.iter().max().copied().unwrap_or(0).max(1) + 1;
                let pages = need.iter().sum::<usize>() + 3;
                let mut order: Vec<i32> = (0..pages as i32).collect();
                shuffle(&mut order, &mut rng);
                let mut table = vec![-1i32; b * max_pages];
                let mut next = order.into_iter();
                for (s, &n) in need.iter().enumerate() {
                    for slot in 0..n {
                        table[s * max_pages + slot] = next.next().unwrap_or(0);
                    }
                }
                let layout = CacheLayout::Paged { pages, page_size };
                let shape = self.shape(layout);
                (shape, Index::Paged(table, max_pages))
            }
        }
    }
}

impl DecodeCase {
    /// The case's cache shape on `layout`: K and V, or latent.
    fn shape(&self, layout: CacheLayout) -> CacheShape {
        let (hk, d, dv) = (self.heads_kv, self.head_dim, self.head_dim_v);
        let shape = match self.latent {
            true => CacheShape::latent(layout, hk, d, dv),
            false => CacheShape::new(layout, hk, d).and_then(|s| s.with_head_dim_v(dv)),
        };
        shape.expect("a valid cache shape")
    }
}

fn shuffle(x: &mut [i32], rng: &mut Rng) {
    for i in (1..x.len()).rev() {
        let j = (rng.next_u64() % (i as u64 + 1)) as usize;
        x.swap(i, j);
    }
}

/// A dense cache's row per sequence, or a block table and its width.
#[derive(Clone, Debug)]
pub enum Index {
    Dense(Option<Vec<i32>>),
    Paged(Vec<i32>, usize),
}

/// The owned data of one case.
pub struct CaseData {
    pub cache: HostKvCache,
    pub q: TensorData,
    pub k_new: TensorData,
    pub v_new: TensorData,
    pub lens: Vec<i32>,
    pub index: Index,
    pub case: DecodeCase,
}

impl CaseData {
    pub fn step(&self) -> DecodeStep<'_> {
        let c = &self.case;
        let q_shape = [c.batch(), c.seqlen_q, c.heads_q, c.head_dim];
        let mut step = DecodeStep::new(self.q.view(q_shape), &self.lens);
        if c.seqlen_new > 0 && c.latent {
            let shape = [c.batch(), c.seqlen_new, c.heads_kv, c.head_dim];
            step = step.append_latent(self.k_new.view(shape));
        } else if c.seqlen_new > 0 {
            let shape = |d| [c.batch(), c.seqlen_new, c.heads_kv, d];
            step = step.append(
                self.k_new.view(shape(c.head_dim)),
                self.v_new.view(shape(c.head_dim_v)),
            );
        }
        match &self.index {
            Index::Dense(Some(idx)) => step.batch_idx(idx),
            Index::Dense(None) => step,
            Index::Paged(table, max_pages) => step.block_table(table, *max_pages),
        }
    }

    /// Run `decode` on a copy of the cache and check everything docs/semantics.md
    /// promises: o and lse within the rule, the cache updated exactly.
    pub fn check(
        &self,
        decode: impl FnOnce(&mut HostKvCache, &DecodeStep) -> Result<DecodeOutput>,
    ) -> DecodeOutput {
        let step = self.step();
        let mut cache = self.cache.clone();
        let out = decode(&mut cache, &step).unwrap_or_else(|e| panic!("{:?}: {e}", self.case));
        let checks = check_decode(&out, &self.cache, &step, &self.case.opts).expect("reference");
        for c in &checks {
            assert!(
                c.passed(),
                "{:?} (splits {}): {c}",
                self.case,
                out.num_splits
            );
        }
        let expected = flashattn::reference::decode_cache(&self.cache, &step).expect("reference");
        assert!(
            cache == expected,
            "{:?}: the cache differs from the input with the new rows appended",
            self.case
        );
        out
    }
}

/// The cases both backends run: layouts, page sizes, appends, batch
/// indices, seqlen_q 1/4/16, GQA 8:1 and MQA, masks, softcap, f32/f16/bf16, lengths from
/// 0 to 8192 varying across the batch, every `num_splits` in {0, 1, 3, 64}.
pub fn cases() -> Vec<DecodeCase> {
    let causal = AttentionOptions::default().causal(true);
    let window = AttentionOptions::default().window(Some(40), Some(0));
    let mut v = vec![
        DecodeCase::new(&[1], 64),
        DecodeCase::new(&[7, 130, 1, 64], 64).append(1),
        DecodeCase::new(&[300, 0, 45], 32)
            .append(3)
            .opts(causal.clone()),
        DecodeCase::new(&[513, 200], 128)
            .heads(16, 2)
            .seqlen_q(4)
            .append(4)
            .opts(causal.clone()),
        DecodeCase::new(&[100, 250, 3], 48).batch_idx().append(2),
        DecodeCase::new(&[900], 96)
            .heads(8, 1)
            .seqlen_q(16)
            .opts(causal.clone()),
        DecodeCase::new(&[400, 1000], 64)
            .heads(8, 1)
            .opts(window.clone())
            .append(1),
        DecodeCase::new(&[333], 40).opts(AttentionOptions::default().softcap(5.0).scale(0.3)),
        DecodeCase::new(&[8192, 1, 2000], 64)
            .heads(8, 1)
            .append(1)
            .f16(),
        DecodeCase::new(&[257, 64], 256).heads(2, 1).append(2).f16(),
        DecodeCase::new(&[5, 17], 3)
            .heads(3, 3)
            .append(3)
            .f16()
            .opts(causal.clone()),
    ];
    // Many kv heads: the CPU backend's blocks shrink to 32 and 16 keys.
    v.push(
        DecodeCase::new(&[300, 45], 128)
            .heads(16, 8)
            .append(1)
            .bf16(),
    );
    v.push(
        DecodeCase::new(&[170], 128)
            .heads(32, 16)
            .seqlen_q(2)
            .paged(48)
            .opts(causal.clone()),
    );
    for page_size in [1, 16, 48, 256] {
        v.push(
            DecodeCase::new(&[200, 37, 600], 64)
                .heads(8, 2)
                .paged(page_size)
                .append(2)
                .opts(causal.clone())
                .seqlen_q(2),
        );
    }
    v.push(DecodeCase::new(&[500, 3], 128).paged(48).f16().append(1));
    // bf16 caches: odd head dims and pages, appends, GQA, masks, splits.
    v.push(DecodeCase::new(&[500, 3], 128).paged(48).bf16().append(1));
    v.push(
        DecodeCase::new(&[5, 17], 3)
            .heads(3, 3)
            .append(3)
            .bf16()
            .opts(causal.clone()),
    );
    v.push(
        DecodeCase::new(&[1200, 70], 59)
            .heads(8, 2)
            .paged(7)
            .seqlen_q(4)
            .append(2)
            .opts(window)
            .bf16()
            .splits(3),
    );
    for splits in [0, 1, 3, 64] {
        v.push(
            DecodeCase::new(&[1500, 700], 64)
                .heads(8, 1)
                .append(1)
                .splits(splits),
        );
        v.push(
            DecodeCase::new(&[1200, 70], 32)
                .paged(16)
                .seqlen_q(4)
                .append(4)
                .opts(causal.clone())
                .splits(splits),
        );
    }
    v.extend(score_term_cases());
    v.extend(v_head_dim_cases());
    v
}

/// V's head dim its own (MLA-style caches): wider and narrower than K's,
/// odd ones (the tiled kernel), multiples of 4 (the lanes kernel), with
/// appends, pages, splits and GQA.
fn v_head_dim_cases() -> Vec<DecodeCase> {
    let causal = || AttentionOptions::default().causal(true);
    vec![
        DecodeCase::new(&[300, 0, 45], 64).dv(32).append(2),
        DecodeCase::new(&[700, 64], 48)
            .dv(128)
            .heads(8, 2)
            .seqlen_q(2)
            .paged(16)
            .append(1)
            .opts(causal())
            .splits(3),
        DecodeCase::new(&[129, 5], 59)
            .dv(37)
            .heads(4, 1)
            .append(3)
            .f16()
            .opts(causal()),
        DecodeCase::new(&[1000], 192)
            .dv(128)
            .heads(16, 1)
            .bf16()
            .opts(causal().sinks(Sinks::new(&[0.5; 16]))),
    ]
}

/// ALiBi (slopes per head and per sequence) and sinks: GQA groups whose
/// heads differ in slope and sink, splits that cut the keys, sequences
/// with no key (o = 0, lse = the sink), paged caches, every precision.
fn score_term_cases() -> Vec<DecodeCase> {
    let causal = || AttentionOptions::default().causal(true);
    let sinks = |h: usize| Sinks::new(&(0..h).map(|i| i as f32 * 0.7 - 1.5).collect::<Vec<_>>());
    // Per (sequence, head): steep and shallow, and one negative slope.
    let per_seq = |b: usize, h: usize| {
        let slopes: Vec<f32> = (0..b * h)
            .map(|i| [0.5, 0.01, -0.02, 0.125][i % 4] / (1 + i / 4) as f32)
            .collect();
        Alibi::new(&slopes)
    };
    let mut v = vec![
        DecodeCase::new(&[700, 0, 45], 64)
            .heads(8, 2)
            .seqlen_q(4)
            .append(1)
            .paged(16)
            .opts(causal().alibi(Alibi::standard(8)))
            .splits(3),
        DecodeCase::new(&[300, 2], 48)
            .heads(4, 4)
            .append(2)
            .f16()
            .opts(
                AttentionOptions::default()
                    .window(Some(100), Some(0))
                    .alibi(per_seq(2, 4)),
            ),
        DecodeCase::new(&[300, 0, 45], 64)
            .heads(4, 2)
            .opts(AttentionOptions::default().sinks(sinks(4))),
        DecodeCase::new(&[2000, 1], 64)
            .heads(8, 2)
            .opts(causal().sinks(sinks(8)).softcap(4.0))
            .splits(5),
        DecodeCase::new(&[500, 0, 33], 3)
            .heads(6, 1)
            .seqlen_q(2)
            .paged(48)
            .bf16()
            .opts(causal().alibi(per_seq(3, 6)).sinks(sinks(6))),
    ];
    // More query tokens than keys under a causal mask: the first rows see
    // no key (lse = the sink), sequence 1 none at all.
    v.push(
        DecodeCase::new(&[2, 0], 32)
            .heads(4, 2)
            .seqlen_q(4)
            .append(1)
            .opts(causal().alibi(Alibi::standard(4)).sinks(sinks(4))),
    );
    for splits in [1, 4] {
        v.push(
            DecodeCase::new(&[1100, 64], 128)
                .heads(16, 2)
                .append(1)
                .f16()
                .opts(causal().alibi(Alibi::standard(16)).sinks(sinks(16)))
                .splits(splits),
        );
    }
    v
}

/// DeepSeek's MLA decoding: a latent cache of width 576 whose first 512
/// columns are V, 128 query heads on one kv head (and fewer, to keep the
/// suites fast), seqlen_q 1 and 4, dense and paged, appends, splits; and
/// small odd latent caches of several kv heads (V's head stride is then
/// K's head dim), on the tiled kernel (odd) and the lanes one (multiples of 4).
pub fn mla_cases() -> Vec<DecodeCase> {
    let causal = || AttentionOptions::default().causal(true);
    vec![
        DecodeCase::new(&[77, 5], 576)
            .dv(512)
            .heads(128, 1)
            .latent()
            .append(1)
            .splits(3),
        DecodeCase::new(&[200, 0, 33], 576)
            .dv(512)
            .heads(128, 1)
            .seqlen_q(4)
            .paged(16)
            .latent()
            .append(4)
            .opts(causal())
            .splits(4),
        DecodeCase::new(&[150, 9], 576)
            .dv(512)
            .heads(8, 1)
            .seqlen_q(4)
            .batch_idx()
            .latent()
            .f16()
            .opts(causal()),
        DecodeCase::new(&[60, 129], 576)
            .dv(512)
            .heads(8, 1)
            .paged(7)
            .latent()
            .bf16()
            .append(1),
        DecodeCase::new(&[129, 5], 59)
            .dv(37)
            .heads(4, 2)
            .latent()
            .append(3)
            .opts(causal()),
        DecodeCase::new(&[300, 40], 64)
            .dv(32)
            .heads(8, 2)
            .seqlen_q(4)
            .paged(16)
            .latent()
            .append(2)
            .splits(3),
    ]
}

/// The footprint of a latent cache: one tensor of `rows × heads_kv × width`
/// elements, V taking none of its own.
pub fn assert_one_latent_tensor(cache: &HostKvCache) {
    let s = &cache.shape;
    let [outer, inner, heads, width] = s.dims();
    assert!(s.latent);
    assert_eq!(cache.k.len(), outer * inner * heads * width);
    assert_eq!(cache.v.len(), 0, "a latent cache holds no V of its own");
}

/// Bad latent input, each a typed error that leaves the cache as it was:
/// a view wider than the rows, v_new on a latent cache, k_new alone on a
/// cache with a V of its own, and a V tensor given to a latent cache.
pub fn check_latent_rejections(
    mut decode: impl FnMut(&mut HostKvCache, &DecodeStep) -> Result<DecodeOutput>,
) {
    let layout = CacheLayout::Dense {
        batch: 1,
        capacity: 8,
    };
    let err = CacheShape::latent(layout, 1, 64, 65).unwrap_err();
    assert!(
        matches!(
            err,
            Error::LatentViewTooWide {
                v_width: 65,
                width: 64
            }
        ),
        "{err:?}"
    );
    let shape = CacheShape::latent(layout, 1, 8, 4).unwrap();
    let err = shape.with_head_dim_v(9).unwrap_err();
    assert!(
        matches!(
            err,
            Error::LatentViewTooWide {
                v_width: 9,
                width: 8
            }
        ),
        "{err:?}"
    );
    let k = TensorData::F32((0..shape.len()).map(|i| i as f32 * 0.1).collect());
    let err = HostKvCache::new(shape, k.clone(), k.clone()).unwrap_err();
    assert!(
        matches!(
            err,
            Error::DataLength {
                tensor: "v_cache",
                expected: 0,
                ..
            }
        ),
        "{err:?}"
    );
    let latent = HostKvCache::latent(shape, k.clone()).unwrap();
    assert_one_latent_tensor(&latent);
    // A shape built field by field is checked at the step.
    let q = TensorData::F32(vec![0.5; 8]);
    let mut too_wide = latent.clone();
    too_wide.shape.head_dim_v = 9;
    let before = too_wide.clone();
    let step = DecodeStep::new(q.view([1, 1, 1, 8]), &[3]);
    let err = decode(&mut too_wide, &step).unwrap_err();
    assert!(
        matches!(
            err,
            Error::LatentViewTooWide {
                v_width: 9,
                width: 8
            }
        ),
        "{err:?}"
    );
    assert!(too_wide == before, "a rejected step changed the cache");
    let (k_new, v_new) = (TensorData::F32(vec![1.0; 8]), TensorData::F32(vec![2.0; 4]));
    let lens = [3];
    let with_v = DecodeStep::new(q.view([1, 1, 1, 8]), &lens)
        .append(k_new.view([1, 1, 1, 8]), v_new.view([1, 1, 1, 4]));
    let mut cache = latent.clone();
    let err = decode(&mut cache, &with_v).unwrap_err();
    assert!(matches!(err, Error::LatentAppend { .. }), "{err:?}");
    assert!(cache == latent, "a rejected step changed the latent cache");

    let plain_shape = CacheShape::new(layout, 1, 8)
        .unwrap()
        .with_head_dim_v(4)
        .unwrap();
    let plain = HostKvCache::zeros(plain_shape, Precision::F32);
    let alone =
        DecodeStep::new(q.view([1, 1, 1, 8]), &lens).append_latent(k_new.view([1, 1, 1, 8]));
    let mut cache = plain.clone();
    let err = decode(&mut cache, &alone).unwrap_err();
    assert!(matches!(err, Error::LatentAppend { .. }), "{err:?}");
    assert!(cache == plain, "a rejected step changed the cache");
}

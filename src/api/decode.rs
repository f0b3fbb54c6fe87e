//! Decoding against a KV cache (docs/semantics.md, "KV cache and decoding"): the
//! cache's layout, one step's inputs, and the validation every backend runs
//! before it writes anything, so a bad step leaves the cache untouched.
//!
//! Dense and paged caches are one thing to the kernels: token `t` of
//! sequence `b` lives in cache row `pages[b][t / page_size] · page_size +
//! t % page_size`, where a dense cache is one page per sequence (its cache
//! row, `cache_batch_idx[b]`) of `capacity` tokens.

use super::options::{AttentionOptions, Mask};
use super::output::CallStats;
use super::shape::{AttentionShape, MAX_HEAD_DIM};
use super::size;
use super::tensor::{Precision, Tensor, TensorData, TensorView};
use crate::error::{Error, Result};

/// How the first two dims of a cache are read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum CacheLayout {
    /// `(batch, capacity, heads_kv, head_dim)`: row `b` holds one sequence.
    Dense {
        /// Cache rows.
        batch: usize,
        /// Tokens per row.
        capacity: usize,
    },
    /// `(pages, page_size, heads_kv, head_dim)`: sequences own pages through
    /// a block table. Any page size ≥ 1.
    Paged {
        /// Pages in the cache.
        pages: usize,
        /// Tokens per page.
        page_size: usize,
    },
}

/// The shape of a K and V cache: one layout, V's rows `head_dim_v` wide.
///
/// A latent cache ([`CacheShape::latent`], DeepSeek's MLA) is one tensor:
/// K's rows are the latent vectors, `head_dim` wide, and V is a view of the
/// first `head_dim_v` columns of each of K's head rows, read with K's row
/// stride from K's storage; V has no storage of its own.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct CacheShape {
    /// Dense or paged, and its sizes.
    pub layout: CacheLayout,
    /// Key/value heads.
    pub heads_kv: usize,
    /// The head dim of k (and of q).
    pub head_dim: usize,
    /// The head dim of v (and of o): `head_dim` unless set by
    /// [`with_head_dim_v`](Self::with_head_dim_v).
    pub head_dim_v: usize,
    /// V is a view of K's storage (the first `head_dim_v` columns of each
    /// head's row of K), not a tensor of its own: set by
    /// [`latent`](Self::latent).
    pub latent: bool,
}

impl CacheShape {
    /// Check the sizes (every one ≥ 1, head dim within the maximum, the
    /// element count within this target's limit: [`Error::SizeOverflow`]).
    /// V has K's head dim.
    pub fn new(layout: CacheLayout, heads_kv: usize, head_dim: usize) -> Result<Self> {
        Self {
            layout,
            heads_kv,
            head_dim,
            head_dim_v: head_dim,
            latent: false,
        }
        .checked()
    }

    /// A latent cache: one tensor of `width`-wide rows per kv head whose
    /// first `v_width` columns are V (DeepSeek's MLA: width 576, `v_width`
    /// 512, one kv head). V is a view of K's storage, never a copy; steps
    /// append K's rows alone ([`DecodeStep::append_latent`]). A view wider
    /// than the rows is [`Error::LatentViewTooWide`].
    pub fn latent(
        layout: CacheLayout,
        heads_kv: usize,
        width: usize,
        v_width: usize,
    ) -> Result<Self> {
        Self {
            layout,
            heads_kv,
            head_dim: width,
            head_dim_v: v_width,
            latent: true,
        }
        .checked()
    }

    /// This shape with V's rows `head_dim_v` wide (as MLA-style models
    /// use: o then has that head dim too), checked as [`new`](Self::new) checks.
    pub fn with_head_dim_v(self, head_dim_v: usize) -> Result<Self> {
        Self { head_dim_v, ..self }.checked()
    }

    /// Every size ≥ 1, the head dims within the maximum, a latent view
    /// within its rows, K's and V's element counts within this target's limit.
    pub(crate) fn checked(self) -> Result<Self> {
        let [outer, inner, _, _] = self.dims();
        let names = match self.layout {
            CacheLayout::Dense { .. } => ["cache batch", "cache capacity"],
            CacheLayout::Paged { .. } => ["pages", "page_size"],
        };
        let fields = [
            (names[0], outer),
            (names[1], inner),
            ("heads_kv", self.heads_kv),
            ("head_dim", self.head_dim),
            ("head_dim_v", self.head_dim_v),
        ];
        if let Some((dim, _)) = fields.into_iter().find(|(_, v)| *v == 0) {
            return Err(Error::EmptyDim { dim });
        }
        for (tensor, head_dim) in [("the cache", self.head_dim), ("the v cache", self.head_dim_v)] {
            if head_dim > MAX_HEAD_DIM {
                return Err(Error::HeadDimTooLarge {
                    tensor,
                    head_dim,
                    max: MAX_HEAD_DIM,
                });
            }
        }
        if self.latent && self.head_dim_v > self.head_dim {
            return Err(Error::LatentViewTooWide {
                v_width: self.head_dim_v,
                width: self.head_dim,
            });
        }
        size::elements("the kv cache", &self.dims())?;
        size::elements("the v cache", &self.v_dims())?;
        Ok(self)
    }

    /// The shape of a cache tensor, read as paged or dense.
    pub fn from_dims([outer, inner, heads_kv, head_dim]: [usize; 4], paged: bool) -> Result<Self> {
        let layout = if paged {
            CacheLayout::Paged {
                pages: outer,
                page_size: inner,
            }
        } else {
            CacheLayout::Dense {
                batch: outer,
                capacity: inner,
            }
        };
        Self::new(layout, heads_kv, head_dim)
    }

    /// The shape of K and V caches of dims `k` and `v`, read as paged or
    /// dense: V's dims must be K's but for the head dim.
    pub fn from_kv_dims(k: [usize; 4], v: [usize; 4], paged: bool) -> Result<Self> {
        if k[..3] != v[..3] {
            return Err(Error::ShapeMismatch {
                tensor: "v_cache",
                shape: v.to_vec(),
                like: "k_cache (but for the head dim)",
                expected: [k[0], k[1], k[2], v[3]].to_vec(),
            });
        }
        Self::from_dims(k, paged)?.with_head_dim_v(v[3])
    }

    /// K's dims: `(outer, inner, heads_kv, head_dim)`.
    pub fn dims(&self) -> [usize; 4] {
        let (outer, inner) = match self.layout {
            CacheLayout::Dense { batch, capacity } => (batch, capacity),
            CacheLayout::Paged { pages, page_size } => (pages, page_size),
        };
        [outer, inner, self.heads_kv, self.head_dim]
    }

    /// V's dims: `(outer, inner, heads_kv, head_dim_v)` (a latent cache's:
    /// the view's).
    pub fn v_dims(&self) -> [usize; 4] {
        let [outer, inner, heads, _] = self.dims();
        [outer, inner, heads, self.head_dim_v]
    }

    /// Whether the cache is paged.
    pub fn is_paged(&self) -> bool {
        matches!(self.layout, CacheLayout::Paged { .. })
    }

    /// Token rows the cache holds (each `heads_kv × head_dim` elements).
    pub fn rows(&self) -> usize {
        let [outer, inner, _, _] = self.dims();
        outer * inner
    }

    /// Elements of one token row of K.
    pub fn row_len(&self) -> usize {
        self.heads_kv * self.head_dim
    }

    /// Elements of one token row of V (of `v_new`).
    pub fn v_row_len(&self) -> usize {
        self.heads_kv * self.head_dim_v
    }

    /// Elements between consecutive token rows of V in its storage: K's
    /// row length in a latent cache, whose V is a view of K.
    pub fn v_row_stride(&self) -> usize {
        if self.latent {
            self.row_len()
        } else {
            self.v_row_len()
        }
    }

    /// Elements between consecutive heads' rows of V in its storage: K's
    /// head dim in a latent cache.
    pub fn v_head_stride(&self) -> usize {
        if self.latent {
            self.head_dim
        } else {
            self.head_dim_v
        }
    }

    /// Where kv head `hk`'s row of V for cache row `row` starts in V's
    /// storage (K's, in a latent cache).
    #[inline]
    pub fn v_offset(&self, row: usize, hk: usize) -> usize {
        row * self.v_row_stride() + hk * self.v_head_stride()
    }

    /// Elements of the whole K cache.
    pub fn len(&self) -> usize {
        self.rows() * self.row_len()
    }

    /// Elements of V's own storage: 0 in a latent cache, whose V is a view
    /// of K's.
    pub fn v_len(&self) -> usize {
        if self.latent {
            0
        } else {
            self.rows() * self.v_row_len()
        }
    }

    /// Whether the cache holds no rows.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// A paged cache's block table: `(batch, max_pages)` page indices.
#[derive(Clone, Copy, Debug)]
pub struct BlockTable<'a> {
    /// Page indices, `(batch, max_pages)` row-major.
    pub pages: &'a [i32],
    /// Columns of the table (pages a sequence may own).
    pub max_pages: usize,
}

/// One decoding step's inputs (host memory; the cache is passed apart).
#[derive(Clone, Copy, Debug)]
pub struct DecodeStep<'a> {
    /// `(batch, seqlen_q, heads_q, head_dim)`.
    pub q: TensorView<'a>,
    /// `(batch,)`: tokens already in each sequence's cache.
    pub cache_seqlens: &'a [i32],
    /// `(batch,)`: each sequence's row of a dense cache (default: row b).
    pub cache_batch_idx: Option<&'a [i32]>,
    /// Where a paged cache's sequences live (required for paged caches).
    pub block_table: Option<BlockTable<'a>>,
    /// `k_new` `(batch, seqlen_new, heads_kv, head_dim)` and `v_new`
    /// `(batch, seqlen_new, heads_kv, head_dim_v)`: appended at
    /// `cache_seqlens[b]..`, then attended to. A latent cache takes
    /// [`new_latent`](Self::new_latent) instead.
    pub new_kv: Option<[TensorView<'a>; 2]>,
    /// A latent cache's new rows, `k_new` `(batch, seqlen_new, heads_kv,
    /// head_dim)` alone (its V is their first `head_dim_v` columns):
    /// appended at `cache_seqlens[b]..`, then attended to.
    pub new_latent: Option<TensorView<'a>>,
}

impl<'a> DecodeStep<'a> {
    /// A step on `q` `(batch, seqlen_q, heads_q, head_dim)` attending to the first `cache_seqlens[b]` cached tokens of each sequence.
    pub fn new(q: TensorView<'a>, cache_seqlens: &'a [i32]) -> Self {
        Self {
            q,
            cache_seqlens,
            cache_batch_idx: None,
            block_table: None,
            new_kv: None,
            new_latent: None,
        }
    }

    /// Append `k_new`, `v_new` before attending.
    pub fn append(mut self, k_new: TensorView<'a>, v_new: TensorView<'a>) -> Self {
        self.new_kv = Some([k_new, v_new]);
        self
    }

    /// Append a latent cache's new rows `k_new` before attending (V reads
    /// their first `head_dim_v` columns; there is no `v_new`).
    pub fn append_latent(mut self, k_new: TensorView<'a>) -> Self {
        self.new_latent = Some(k_new);
        self
    }

    /// `k_new`, whichever way the step appends it.
    pub fn k_new(&self) -> Option<TensorView<'a>> {
        self.new_kv.map(|[k, _]| k).or(self.new_latent)
    }

    /// Whether the step appends rows.
    pub fn appends(&self) -> bool {
        self.k_new().is_some()
    }

    /// The step without its tensors: q's shape, `k_new`'s rows per
    /// sequence, the index arrays.
    pub fn spec(&self) -> DecodeSpec<'a> {
        DecodeSpec {
            q_shape: self.q.shape,
            seqlen_new: self.k_new().map_or(0, |k| k.shape[1]),
            cache_seqlens: self.cache_seqlens,
            cache_batch_idx: self.cache_batch_idx,
            block_table: self.block_table,
        }
    }

    /// Read sequence `b` from cache row `idx[b]` (dense caches).
    pub fn batch_idx(mut self, idx: &'a [i32]) -> Self {
        self.cache_batch_idx = Some(idx);
        self
    }

    /// Read sequences through a block table of `max_pages` pages each (paged caches).
    pub fn block_table(mut self, pages: &'a [i32], max_pages: usize) -> Self {
        self.block_table = Some(BlockTable { pages, max_pages });
        self
    }
}

/// One decoding step described without its tensors: the shapes and the
/// host index arrays. What an encoded step ([`Engine::encode_decode`],
/// [`Engine::encode_append`]) takes beside the app's buffer ranges, and what
/// [`DecodeStep::spec`] reads off a host step; [`DecodeProblem`] is built
/// from it either way.
///
/// [`Engine::encode_decode`]: crate::Engine::encode_decode
/// [`Engine::encode_append`]: crate::Engine::encode_append
#[derive(Clone, Copy, Debug)]
pub struct DecodeSpec<'a> {
    /// `(batch, seqlen_q, heads_q, head_dim)` of q.
    pub q_shape: [usize; 4],
    /// Tokens appended per sequence (`k_new`/`v_new` are `(batch,
    /// seqlen_new, heads_kv, head_dim or head_dim_v)`); 0 for a step that
    /// appends none.
    pub seqlen_new: usize,
    /// `(batch,)`: tokens in each sequence's cache before the append.
    pub cache_seqlens: &'a [i32],
    /// `(batch,)`: each sequence's row of a dense cache (default: row b).
    pub cache_batch_idx: Option<&'a [i32]>,
    /// Where a paged cache's sequences live (required for paged caches).
    pub block_table: Option<BlockTable<'a>>,
}

impl<'a> DecodeSpec<'a> {
    /// A step of queries shaped `q_shape` that appends nothing.
    pub fn new(q_shape: [usize; 4], cache_seqlens: &'a [i32]) -> Self {
        Self {
            q_shape,
            cache_seqlens,
            cache_batch_idx: None,
            block_table: None,
            seqlen_new: 0,
        }
    }

    /// Append `seqlen_new` tokens per sequence before attending.
    pub fn append(mut self, seqlen_new: usize) -> Self {
        self.seqlen_new = seqlen_new;
        self
    }

    /// Read sequence `b` from cache row `idx[b]` (dense caches).
    pub fn batch_idx(mut self, idx: &'a [i32]) -> Self {
        self.cache_batch_idx = Some(idx);
        self
    }

    /// Read sequences through a block table of `max_pages` pages each (paged caches).
    pub fn block_table(mut self, pages: &'a [i32], max_pages: usize) -> Self {
        self.block_table = Some(BlockTable { pages, max_pages });
        self
    }
}

/// Token `t` of sequence `b` is cache row
/// `pages[b · max_pages + t / page_size] · page_size + t % page_size`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PageTable {
    /// Tokens per page (a dense cache: its capacity).
    pub page_size: usize,
    /// Pages per sequence.
    pub max_pages: usize,
    /// `(batch, max_pages)` page indices.
    pub pages: Vec<u32>,
}

impl PageTable {
    /// The cache row of token `t` of sequence `b`.
    #[inline]
    pub fn row(&self, b: usize, t: usize) -> usize {
        self.pages[b * self.max_pages + t / self.page_size] as usize * self.page_size
            + t % self.page_size
    }
}

/// A step validated against its cache: every index in range, every length
/// within capacity, no two sequences appending to one cache row.
#[derive(Clone, Debug, PartialEq)]
pub struct DecodeProblem {
    /// Sequences in the step.
    pub batch: usize,
    /// Query tokens per sequence.
    pub seqlen_q: usize,
    /// Query heads.
    pub heads_q: usize,
    /// Key/value heads.
    pub heads_kv: usize,
    /// The head dim of q and k.
    pub head_dim: usize,
    /// The head dim of v and o.
    pub head_dim_v: usize,
    /// Tokens appended per sequence (0 without `k_new`/`v_new`).
    pub seqlen_new: usize,
    /// The storage precision of q and the cache.
    pub precision: Precision,
    /// The cache's shape.
    pub cache: CacheShape,
    /// How sequences find their cache rows.
    pub table: PageTable,
    /// Tokens in each sequence's cache before this step's append.
    pub cache_lens: Vec<usize>,
}

impl DecodeProblem {
    /// Validate `step` against a cache of `cache` shape holding `precision`.
    pub fn new(step: &DecodeStep, cache: &CacheShape, precision: Precision) -> Result<Self> {
        step.q.check_len("q")?;
        dtype_like(step.q.precision(), "q", precision)?;
        new_rows(step, step.q.shape[0], cache, precision)?;
        Self::of_spec(&step.spec(), cache, precision)
    }

    /// Validate a step described by its shapes and index arrays (an
    /// encoded step's, whose tensors are the app's buffer ranges) against
    /// a cache of `cache` shape holding `precision`.
    pub fn of_spec(step: &DecodeSpec, cache: &CacheShape, precision: Precision) -> Result<Self> {
        // A shape built field by field (a latent view wider than its rows
        // would read past them) is checked as the constructors check.
        cache.checked()?;
        let [batch, seqlen_q, heads_q, head_dim] = step.q_shape;
        AttentionShape::new(batch, seqlen_q, 1, heads_q, cache.heads_kv, head_dim)?;
        if head_dim != cache.head_dim {
            return Err(Error::DimMismatch {
                dim: "head_dim",
                tensor: "q",
                value: head_dim,
                other: "the kv cache",
                other_value: cache.head_dim,
            });
        }
        // The new rows' element count must fit this target like q's.
        size::elements("k_new", &[batch, step.seqlen_new, cache.heads_kv, head_dim])?;
        size::elements("v_new", &[batch, step.seqlen_new, cache.heads_kv, cache.head_dim_v])?;
        size::elements("o", &[batch, seqlen_q, heads_q, cache.head_dim_v])?;
        let seqlen_new = step.seqlen_new;
        let cache_lens = lengths("cache_seqlens", step.cache_seqlens, batch)?;
        let table = page_table(step, cache, batch)?;
        let p = Self {
            batch,
            seqlen_q,
            heads_q,
            heads_kv: cache.heads_kv,
            head_dim,
            head_dim_v: cache.head_dim_v,
            seqlen_new,
            precision,
            cache: *cache,
            table,
            cache_lens,
        };
        p.check()?;
        Ok(p)
    }

    /// Every rule a problem keeps: [`DecodeProblem::new`] ends with it, and
    /// what takes a caller's problem, whose public fields may have been
    /// changed since ([`crate::Engine::plan_decode`] and its kin), calls it
    /// again before any index arithmetic.
    pub fn check(&self) -> Result<()> {
        self.cache.checked()?;
        AttentionShape::new(
            self.batch,
            self.seqlen_q,
            1,
            self.heads_q,
            self.heads_kv,
            self.head_dim,
        )?;
        for (dim, value, cache) in [
            ("heads_kv", self.heads_kv, self.cache.heads_kv),
            ("head_dim", self.head_dim, self.cache.head_dim),
            ("head_dim_v", self.head_dim_v, self.cache.head_dim_v),
        ] {
            if value != cache {
                return Err(Error::DimMismatch {
                    dim,
                    tensor: "the decode problem",
                    value,
                    other: "its kv cache",
                    other_value: cache,
                });
            }
        }
        if self.table.page_size == 0 {
            return Err(Error::EmptyDim {
                dim: "page_size (the page table's)",
            });
        }
        index_len("cache_seqlens", self.cache_lens.len(), self.batch)?;
        let entries = size::product("block_table (batch × max_pages)", self.batch, self.table.max_pages)?;
        index_len("block_table", self.table.pages.len(), entries)?;
        self.check_capacity()?;
        self.check_pages()?;
        self.check_appends()
    }

    /// Keys sequence `b` attends to: its cache plus the appended tokens.
    pub fn seqlen_k(&self, b: usize) -> usize {
        self.cache_lens[b] + self.seqlen_new
    }

    /// The longest sequence after this step's append.
    pub fn max_seqlen_k(&self) -> usize {
        (0..self.batch).map(|b| self.seqlen_k(b)).max().unwrap_or(0)
    }

    /// Keys summed over the batch.
    pub fn total_keys(&self) -> usize {
        (0..self.batch).map(|b| self.seqlen_k(b)).sum()
    }

    /// Query heads per kv head.
    pub fn group(&self) -> usize {
        self.heads_q / self.heads_kv
    }

    /// q's shape: `(batch, seqlen_q, heads_q, head_dim)`.
    pub fn q_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_q, self.heads_q, self.head_dim]
    }

    /// `k_new`'s shape: `(batch, seqlen_new, heads_kv, head_dim)`.
    pub fn new_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_new, self.heads_kv, self.head_dim]
    }

    /// `v_new`'s shape: `(batch, seqlen_new, heads_kv, head_dim_v)`.
    pub fn v_new_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_new, self.heads_kv, self.head_dim_v]
    }

    /// o's shape: `(batch, seqlen_q, heads_q, head_dim_v)`.
    pub fn o_shape(&self) -> [usize; 4] {
        [self.batch, self.seqlen_q, self.heads_q, self.head_dim_v]
    }

    /// Elements of o.
    pub fn o_len(&self) -> usize {
        self.o_shape().iter().product()
    }

    /// lse's shape: `(batch, heads_q, seqlen_q)`.
    pub fn lse_shape(&self) -> [usize; 3] {
        [self.batch, self.heads_q, self.seqlen_q]
    }

    /// Elements of q.
    pub fn q_len(&self) -> usize {
        self.q_shape().iter().product()
    }

    /// Elements of lse.
    pub fn lse_len(&self) -> usize {
        self.lse_shape().iter().product()
    }

    /// The step as one forward problem's shape: `seqlen_q` query rows
    /// against the longest sequence's keys after the append (at least one),
    /// the step's heads and both head dims.
    pub fn widest_shape(&self) -> Result<AttentionShape> {
        AttentionShape::new(
            self.batch,
            self.seqlen_q,
            self.max_seqlen_k().max(1),
            self.heads_q,
            self.heads_kv,
            self.head_dim,
        )?
        .with_head_dim_v(self.head_dim_v)
    }

    /// Sequence `b` alone as an attention problem (batch 1), `None` when it
    /// has no keys (every row is then empty).
    pub fn sequence(&self, b: usize) -> Option<AttentionShape> {
        let sk = self.seqlen_k(b);
        (sk > 0).then_some(AttentionShape {
            batch: 1,
            seqlen_q: self.seqlen_q,
            seqlen_k: sk,
            heads_q: self.heads_q,
            heads_kv: self.heads_kv,
            head_dim: self.head_dim,
            head_dim_v: self.head_dim_v,
        })
    }

    /// Sequence `b`'s mask: `off_b = seqlen_k[b] − seqlen_q`.
    pub fn mask(&self, b: usize, opts: &AttentionOptions) -> Mask {
        opts.mask_for(self.seqlen_q, self.seqlen_k(b))
    }

    /// The cache row of token `t` of sequence `b`.
    pub fn cache_row(&self, b: usize, t: usize) -> usize {
        self.table.row(b, t)
    }

    /// `(b, t, cache row)` of every appended token, in `k_new`'s row order.
    pub fn appended_rows(&self) -> impl Iterator<Item = (usize, usize, usize)> + '_ {
        (0..self.batch).flat_map(move |b| {
            (0..self.seqlen_new).map(move |t| (b, t, self.cache_row(b, self.cache_lens[b] + t)))
        })
    }

    /// Every sequence's keys fit its pages (checked sums: after this,
    /// [`DecodeProblem::seqlen_k`] cannot overflow).
    fn check_capacity(&self) -> Result<()> {
        let capacity = size::product(
            "cache capacity (max_pages × page_size)",
            self.table.max_pages,
            self.table.page_size,
        )?;
        for b in 0..self.batch {
            let keys = size::sum(
                "keys (cache_seqlens + seqlen_new)",
                self.cache_lens[b],
                self.seqlen_new,
            )?;
            if keys > capacity {
                return Err(Error::CacheOverflow {
                    batch: b,
                    cache_len: self.cache_lens[b],
                    new: self.seqlen_new,
                    capacity,
                });
            }
        }
        Ok(())
    }

    /// Pages a sequence uses must exist.
    fn check_pages(&self) -> Result<()> {
        let [outer, _, _, _] = self.cache.dims();
        let t = &self.table;
        for b in 0..self.batch {
            for slot in 0..self.seqlen_k(b).div_ceil(t.page_size) {
                let page = t.pages[b * t.max_pages + slot];
                if page as usize >= outer {
                    return Err(Error::PageOutOfRange {
                        tensor: self.index_name(),
                        batch: b,
                        slot,
                        page: page as i32 as i64,
                        pages: outer,
                    });
                }
            }
        }
        Ok(())
    }

    /// Two sequences writing one cache row would race (and lose a token).
    fn check_appends(&self) -> Result<()> {
        let mut owner = std::collections::HashMap::new();
        for (b, _, row) in self.appended_rows() {
            if let Some(first) = owner.insert(row, b) {
                return Err(Error::AppendConflict {
                    first,
                    second: b,
                    row,
                });
            }
        }
        Ok(())
    }

    fn index_name(&self) -> &'static str {
        if self.cache.is_paged() {
            "block_table"
        } else {
            "cache_batch_idx"
        }
    }
}

/// `k_new`/`v_new`: both or neither, `(batch, seqlen_new, heads_kv, d)`
/// (`d` the cache's head dim of each); a latent cache's `k_new` alone.
fn new_rows(step: &DecodeStep, batch: usize, cache: &CacheShape, p: Precision) -> Result<()> {
    let rows: Vec<(&'static str, TensorView, usize)> =
        match (cache.latent, step.new_kv, step.new_latent) {
            (_, None, None) => return Ok(()),
            (false, Some([k, v]), None) => vec![
                ("k_new", k, cache.head_dim),
                ("v_new", v, cache.head_dim_v),
            ],
            (true, None, Some(k)) => vec![("k_new", k, cache.head_dim)],
            (true, Some(_), _) => {
                return Err(Error::LatentAppend {
                    reason: "a latent cache appends k_new alone (DecodeStep::append_latent): \
                             its V is a view of K, so there is no v_new",
                })
            }
            (false, _, Some(_)) => {
                return Err(Error::LatentAppend {
                    reason: "k_new alone (DecodeStep::append_latent) needs a latent cache; \
                             this one has a V of its own, so append k_new and v_new",
                })
            }
        };
    for (name, t, _) in &rows {
        t.check_len(name)?;
        dtype_like(t.precision(), name, p)?;
    }
    let lead = [batch, rows[0].1.shape[1], cache.heads_kv];
    let expected = |d: usize| [lead[0], lead[1], lead[2], d];
    for (name, t, d) in &rows {
        let (name, d) = (*name, *d);
        let expected = expected(d);
        if t.shape != expected {
            return Err(Error::ShapeMismatch {
                tensor: name,
                shape: t.shape.to_vec(),
                like: "(batch of q, seqlen_new, heads_kv and head_dim of the cache)",
                expected: expected.to_vec(),
            });
        }
    }
    Ok(())
}

/// An i32 length array of `batch` entries, none negative.
fn lengths(tensor: &'static str, values: &[i32], batch: usize) -> Result<Vec<usize>> {
    index_len(tensor, values.len(), batch)?;
    values
        .iter()
        .enumerate()
        .map(|(index, &value)| {
            usize::try_from(value).map_err(|_| Error::NegativeIndex {
                tensor,
                index,
                value: value as i64,
            })
        })
        .collect()
}

/// The page table of either layout, its indices checked for sign.
fn page_table(step: &DecodeSpec, cache: &CacheShape, batch: usize) -> Result<PageTable> {
    match (cache.layout, step.block_table, step.cache_batch_idx) {
        (CacheLayout::Dense { .. }, Some(_), _) => Err(Error::CacheIndex {
            reason: "a block_table needs a paged cache; this cache is dense",
        }),
        (CacheLayout::Paged { .. }, None, _) => Err(Error::CacheIndex {
            reason: "a paged cache needs a block_table",
        }),
        (CacheLayout::Paged { .. }, Some(_), Some(_)) => Err(Error::CacheIndex {
            reason: "cache_batch_idx applies to dense caches; a paged cache uses its block_table",
        }),
        (
            CacheLayout::Dense {
                batch: rows,
                capacity,
            },
            None,
            idx,
        ) => {
            let pages = match idx {
                Some(idx) => {
                    let rows_of = lengths("cache_batch_idx", idx, batch)?;
                    if let Some((b, &row)) = rows_of.iter().enumerate().find(|(_, r)| **r >= rows) {
                        return Err(Error::PageOutOfRange {
                            tensor: "cache_batch_idx",
                            batch: b,
                            slot: 0,
                            page: row as i64,
                            pages: rows,
                        });
                    }
                    rows_of
                }
                None if batch > rows => {
                    return Err(Error::DimMismatch {
                        dim: "batch",
                        tensor: "q",
                        value: batch,
                        other: "the dense cache (without cache_batch_idx)",
                        other_value: rows,
                    })
                }
                None => (0..batch).collect(),
            };
            Ok(PageTable {
                page_size: capacity,
                max_pages: 1,
                pages: pages.into_iter().map(|p| p as u32).collect(),
            })
        }
        (CacheLayout::Paged { page_size, .. }, Some(table), None) => {
            if table.max_pages == 0 {
                return Err(Error::EmptyDim {
                    dim: "max_pages (block_table's second dim)",
                });
            }
            let entries = size::product("block_table (batch × max_pages)", batch, table.max_pages)?;
            index_len("block_table", table.pages.len(), entries)?;
            // Negative entries past a sequence's last page are padding
            // (never read); check_pages rejects any a sequence uses.
            Ok(PageTable {
                page_size,
                max_pages: table.max_pages,
                pages: table.pages.iter().map(|&p| p as u32).collect(),
            })
        }
    }
}

fn index_len(tensor: &'static str, len: usize, expected: usize) -> Result<()> {
    if len != expected {
        return Err(Error::IndexLength {
            tensor,
            len,
            expected,
        });
    }
    Ok(())
}

fn dtype_like(p: Precision, tensor: &'static str, cache: Precision) -> Result<()> {
    if p != cache {
        return Err(Error::DtypeMismatch {
            tensor,
            dtype: p.name(),
            like: "the kv cache",
            expected: cache.name(),
        });
    }
    Ok(())
}

/// A KV cache in host memory: what the command line reads and writes, and
/// what the CPU backend decodes on. A latent cache's `v` is empty: its V
/// is a view of `k`.
#[derive(Clone, Debug, PartialEq)]
pub struct HostKvCache {
    /// The cache's shape.
    pub shape: CacheShape,
    /// The keys.
    pub k: TensorData,
    /// The values (empty in a latent cache).
    pub v: TensorData,
}

impl HostKvCache {
    /// A cache of `shape` from K and V data of one dtype.
    pub fn new(shape: CacheShape, k: TensorData, v: TensorData) -> Result<Self> {
        let cache = Self { shape, k, v };
        cache.check()?;
        Ok(cache)
    }

    /// What [`new`](Self::new) checks, again for a cache whose public
    /// fields were changed since: the shape's sizes (as
    /// [`CacheShape::new`] checks them), K and V hold its elements, in one dtype.
    pub(crate) fn check(&self) -> Result<()> {
        let s = &self.shape.checked()?;
        // A latent cache's V is a view of K: its own tensor is empty.
        let v_dims = if s.latent { vec![0] } else { s.v_dims().to_vec() };
        for (tensor, t, dims) in [("k_cache", &self.k, s.dims().to_vec()), ("v_cache", &self.v, v_dims)] {
            let expected = dims.iter().product();
            if t.len() != expected {
                return Err(Error::DataLength {
                    tensor,
                    shape: dims,
                    expected,
                    actual: t.len(),
                });
            }
        }
        dtype_like(self.v.precision(), "v_cache", self.k.precision())
    }

    /// A cache from two 4-d tensors, read as paged or dense: V's shape is
    /// K's but for its head dim, which may be its own.
    pub fn from_tensors(k: Tensor, v: Tensor, paged: bool) -> Result<Self> {
        let dims = |t: &Tensor, tensor| -> Result<[usize; 4]> {
            t.shape.as_slice().try_into().map_err(|_| Error::Rank {
                tensor,
                shape: t.shape.clone(),
                rank: t.shape.len(),
                expected: 4,
            })
        };
        let shape = CacheShape::from_kv_dims(dims(&k, "k_cache")?, dims(&v, "v_cache")?, paged)?;
        Self::new(shape, k.data, v.data)
    }

    /// A latent cache of `shape` ([`CacheShape::latent`]) on its one
    /// tensor `k`: V is a view of it, no data of its own.
    pub fn latent(shape: CacheShape, k: TensorData) -> Result<Self> {
        let v = TensorData::from_f32(Vec::new(), k.precision());
        Self::new(shape, k, v)
    }

    /// An all-zero cache.
    pub fn zeros(shape: CacheShape, precision: Precision) -> Self {
        let zeros = |len| TensorData::from_f32(vec![0.0; len], precision);
        Self {
            shape,
            k: zeros(shape.len()),
            v: zeros(shape.v_len()),
        }
    }

    /// The cache's storage precision.
    pub fn precision(&self) -> Precision {
        self.k.precision()
    }

    /// K as a 4-d tensor (a copy).
    pub fn k_tensor(&self) -> Tensor {
        Tensor {
            shape: self.shape.dims().to_vec(),
            data: self.k.clone(),
        }
    }

    /// V as a 4-d tensor (a copy; of a latent cache, the view's columns
    /// of K).
    pub fn v_tensor(&self) -> Tensor {
        let s = &self.shape;
        let data = if s.latent {
            let k = self.k.to_f32();
            let dv = s.head_dim_v;
            let view = (0..s.rows() * s.heads_kv)
                .flat_map(|r| k[r * s.head_dim..][..dv].iter().copied())
                .collect();
            TensorData::from_f32(view, self.precision())
        } else {
            self.v.clone()
        };
        Tensor {
            shape: s.v_dims().to_vec(),
            data,
        }
    }
}

/// The result of a decoding step.
#[derive(Clone, Debug)]
pub struct DecodeOutput {
    /// `(batch, seqlen_q, heads_q, head_dim_v)`, in the cache's precision.
    pub o: Tensor,
    /// `(batch, heads_q, seqlen_q)`, f32; `-inf` for rows with no allowed key.
    pub lse: Vec<f32>,
    /// `(batch, heads_q, seqlen_q)`.
    pub lse_shape: [usize; 3],
    /// Splits the keys of each sequence were cut into (1: none).
    pub num_splits: usize,
    /// What the call did on the device (empty on the CPU backend).
    pub stats: CallStats,
}

impl DecodeOutput {
    /// The output of `problem`'s step: `o`, `lse` and the splits it ran with.
    pub fn new(
        problem: &DecodeProblem,
        o: TensorData,
        lse: Vec<f32>,
        num_splits: usize,
        stats: CallStats,
    ) -> Self {
        Self {
            o: Tensor {
                shape: problem.o_shape().to_vec(),
                data: o,
            },
            lse,
            lse_shape: problem.lse_shape(),
            num_splits,
            stats,
        }
    }

    /// The LSE as an owned tensor.
    pub fn lse_tensor(&self) -> Tensor {
        Tensor {
            shape: self.lse_shape.to_vec(),
            data: TensorData::F32(self.lse.clone()),
        }
    }
}

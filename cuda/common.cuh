// Shared pieces of the flashattn CUDA kernels, prepended to flash_fwd.cu and
// flash_bwd.cu by the host (src/cuda/kernel.rs) after the variant's defines:
//
//   HEAD_DIM      head dim padded to a multiple of 32 (the real one, `d`, is
//                 an argument; columns past it load as 0, so dot products are
//                 exact and nothing past `d` is written)
//   STORAGE       0 f32, 1 f16, 2 bf16 (math is f32 in every case)
//   HAS_BAND      a causal and/or local window mask (bounds are arguments)
//   HAS_SOFTCAP   s = C * tanh(s / C)
//   plus each kernel's tile sizes (BLOCK_M, BLOCK_N, THREADS_PER_ROW, ...).
//
// No headers: NVRTC then needs nothing but itself, and the f16/bf16
// conversions are single PTX instructions.

#if defined(FLASHATTN_HOST_EMULATION) && STORAGE == 1
// Run on the CPU by tests/cuda.rs through cuda/emulate/host.h (the asm
// below is device-only).
typedef _Float16 storage_t;
__device__ __forceinline__ float load_f32(storage_t x) { return (float)x; }
__device__ __forceinline__ storage_t store_f32(float x) { return host_f16_store(x); }
#elif defined(FLASHATTN_HOST_EMULATION) && STORAGE == 2
typedef unsigned short storage_t;
__device__ __forceinline__ float load_f32(storage_t x) { return host_bf16_load(x); }
__device__ __forceinline__ storage_t store_f32(float x) { return host_bf16_store(x); }
#elif STORAGE == 0
typedef float storage_t;
__device__ __forceinline__ float load_f32(storage_t x) { return x; }
__device__ __forceinline__ storage_t store_f32(float x) { return x; }
#elif STORAGE == 1
typedef unsigned short storage_t;
__device__ __forceinline__ float load_f32(storage_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}
__device__ __forceinline__ storage_t store_f32(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
#else
typedef unsigned short storage_t;
__device__ __forceinline__ float load_f32(storage_t x) {
    return __uint_as_float(((unsigned int)x) << 16);
}
__device__ __forceinline__ storage_t store_f32(float x) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
#endif

// What a materialized low-precision computation does to P and dS before
// the products that use them (docs/semantics.md): round to storage, keep f32.
__device__ __forceinline__ float round_storage(float x) { return load_f32(store_f32(x)); }

// 2^x on the special-function unit (ex2.approx: 2 ulp; -inf gives +0):
// one instruction where expf takes eight.
#if defined(FLASHATTN_HOST_EMULATION)
__device__ __forceinline__ float exp2_approx(float x) { return exp2f(x); }
#else
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}
#endif

// The launch's dynamic shared memory as `name` (16-byte aligned; under
// host emulation the harness's buffer of the launch's size).
#if defined(FLASHATTN_HOST_EMULATION)
#define DYNAMIC_SMEM(name) unsigned char* name = host_dynamic_smem()
#else
#define DYNAMIC_SMEM(name) extern __shared__ __align__(16) unsigned char name[]
#endif

// Division rounding toward -inf (b > 0), for tile bounds that can be negative.
__device__ __forceinline__ int floor_div(int a, int b) { return a >= 0 ? a / b : -((-a + b - 1) / b); }

#define NEG_INF (-__int_as_float(0x7f800000))
#define POS_INF __int_as_float(0x7f800000)
#define LOG2E 1.4426950408889634f

// The sizes and score options of one call, identical for every kernel.
struct Problem {
    int seqlen_q, seqlen_k, heads_q, heads_kv, d;
    float scale, softcap;
    // Window bounds around the diagonal (band_offset below); -1 is unbounded
    // (causal is right = 0). Only read when HAS_BAND.
    int left, right;
    // Where a shard of a longer sequence (ring attention's partial calls)
    // puts the diagonal past the bottom-right one: q_offset - k_offset -
    // (seqlen_k - seqlen_q), else 0. Never with packed batches or decoding,
    // whose kernels change the lengths.
    int shift;
};

// src/cuda/problem.rs mirrors this struct field for field.
static_assert(sizeof(Problem) == 10 * 4, "Problem must stay ten 4-byte fields");

// Row i's diagonal key is i + band_offset(p): the masks, the key and query
// spans and ALiBi's distances all go through it. The dropout variants leave
// the shift out (the host refuses dropout with shard positions: the bits are
// drawn at the call's own positions), and with it a register their loops
// have no room for.
__device__ __forceinline__ int band_offset(const Problem& p) {
#if HAS_DROPOUT
    return p.seqlen_k - p.seqlen_q;
#else
    return p.seqlen_k - p.seqlen_q + p.shift;
#endif
}

// Whether query row i may attend to key j (docs/semantics.md's masks; bounds included).
__device__ __forceinline__ bool allowed(const Problem& p, int i, int j) {
    if (j < 0 || j >= p.seqlen_k || i >= p.seqlen_q) return false;
#if HAS_BAND
    const int center = i + band_offset(p);
    if (p.left >= 0 && j < center - p.left) return false;
    if (p.right >= 0 && j > center + p.right) return false;
#endif
    return true;
}

// lse · log2 e, the backward's exp2 form of P: +inf for a row with no
// allowed key (lse = -inf), whose P is then 0.
__device__ __forceinline__ float lse_log2(float lse_i) { return lse_i == NEG_INF ? POS_INF : lse_i * LOG2E; }

// Whether the band allows every pair of queries [i0, i1] and keys [j0, j1]
// (bounds included; the lengths, ALiBi and block masks are the caller's):
// the tiles whose pairs need no test.
__device__ __forceinline__ bool band_covers(const Problem& p, int i0, int i1, int j0, int j1) {
#if HAS_BAND
    const int off = band_offset(p);
    if (p.right >= 0 && j1 > i0 + off + p.right) return false;
    if (p.left >= 0 && j0 < i1 + off - p.left) return false;
#endif
    return true;
}

// Keys [*lo, *hi) any of rows [i0, i1) may see: the tiles outside are never loaded.
__device__ __forceinline__ void key_span(const Problem& p, int i0, int i1, int* lo, int* hi) {
    *lo = 0;
    *hi = p.seqlen_k;
#if HAS_BAND
    const int off = band_offset(p);
    if (p.left >= 0) *lo = max(0, i0 + off - p.left);
    if (p.right >= 0) *hi = min(p.seqlen_k, i1 - 1 + off + p.right + 1);
#endif
}

// Query rows [*lo, *hi) that see any of keys [j0, j1) (the backward's dK/dV loop).
__device__ __forceinline__ void row_span(const Problem& p, int j0, int j1, int* lo, int* hi) {
    *lo = 0;
    *hi = p.seqlen_q;
#if HAS_BAND
    const int off = band_offset(p);
    if (p.right >= 0) *lo = max(0, j0 - off - p.right);
    if (p.left >= 0) *hi = min(p.seqlen_q, j1 - 1 - off + p.left + 1);
#endif
}

// The final score from a raw dot product; *dcap gets ds/ds_raw (the
// softcap's derivative, 1 without one) for the backward.
__device__ __forceinline__ float score(const Problem& p, float dot, float* dcap) {
    float s = dot * p.scale;
#if HAS_SOFTCAP
    const float t = tanhf(s / p.softcap);
    *dcap = 1.0f - t * t;
    s = p.softcap * t;
#else
    *dcap = 1.0f;
#endif
    return s;
}

// The run-time layouts of one call (src/cuda/problem.rs's `Layout` mirrors
// it field for field), the last argument of every kernel. Each is off when
// its pointer is null, and the same for the whole grid, so the branches on
// it are uniform: ALiBi slopes, attention sinks, a packed batch's prefix
// sums, a block mask with the tile lists the host built from it for this
// launch's tiles (lists of the inner tiles each outer tile visits, which
// leave out every tile with no allowed pair: those are never loaded).
struct Layout {
    const float* alibi;         // slopes, (heads_q,) or (batch, heads_q)
    const float* sinks;         // (heads_q,) logits
    const int* cu_q;            // cu_seqlens_q and cu_seqlens_k (batch + 1 each)
    const int* cu_k;
    const unsigned char* mask;  // (mb, mh, mask_rows, mask_cols), nonzero allows
    const int* tile_starts;     // per (sequence, query head, outer tile), and one past the end
    const int* tile_entries;    // inner tile | TILE_PARTIAL where the mask needs a test per pair (dK/dV:
                                // | the query head within the group << TILE_HEAD_SHIFT; lists per kv head)
    int alibi_batch_stride;     // heads_q for (batch, heads_q) slopes, else 0
    int bm, bn, mask_rows, mask_cols;
    int mask_batch_stride, mask_head_stride;  // in entries; 0 where the mask broadcasts
    int list_batch_stride, list_head_stride;  // in lists; 0 where the lists are shared
    int pad;
};
static_assert(sizeof(Layout) == 7 * 8 + 10 * 4, "Layout must stay seven pointers and ten ints");

#define TILE_PARTIAL (1 << 30)
#define TILE_HEAD_SHIFT 20
#define TILE_INDEX_MASK ((1 << TILE_HEAD_SHIFT) - 1)

// Where sequence z of the grid lives. Dense: batch entry z, rows z *
// seqlen.. of the tensors seen as (rows, heads, d). Packed: rows cu[z].. of
// the batch of one, whose lse is (heads_q, total_q).
struct Seq {
    int index;       // the sequence: block mask, slopes and tile lists
    int b;           // the batch index of the shifted tensors: always 0
    size_t q0, k0;   // first rows of q and of k/v
    size_t lse0;     // lse index of (head 0, row 0)
    int lse_stride;  // between heads
};

// Enter grid sequence z: *p becomes the sequence's problem (its own lengths,
// so the band's offset is its own); the kernels shift their row pointers by
// q0 / k0 rows and index the tensors as batch 0 (a batch index chosen at
// run time, with run-time lengths, cost the tensor-core kernels ~30
// registers of hoisted addresses). Uniform for the block.
__device__ __forceinline__ Seq enter_sequence(const Layout& L, Problem* p, int z) {
    Seq s;
    s.index = z;
    s.lse_stride = p->seqlen_q;
    if (L.cu_q) {
        s.b = 0;
        s.q0 = (size_t)L.cu_q[z];
        s.k0 = (size_t)L.cu_k[z];
        s.lse0 = s.q0;
        p->seqlen_q = L.cu_q[z + 1] - L.cu_q[z];
        p->seqlen_k = L.cu_k[z + 1] - L.cu_k[z];
    } else {
        s.b = 0;
        s.q0 = (size_t)z * p->seqlen_q;
        s.k0 = (size_t)z * p->seqlen_k;
        s.lse0 = (size_t)z * p->heads_q * p->seqlen_q;
    }
    return s;
}

__device__ __forceinline__ size_t lse_at(const Seq& s, int h, int i) {
    return s.lse0 + (size_t)h * s.lse_stride + i;
}

// Rows of a (rows, heads, d) tensor from row0 on.
template <class T>
__device__ __forceinline__ T* from_row(T* base, size_t row0, int heads, int d) {
    return base + row0 * (size_t)heads * (size_t)d;
}

// ALiBi's slope of (sequence, query head); 0 without ALiBi (and then the
// bias below is exactly 0).
__device__ __forceinline__ float alibi_slope(const Layout& L, const Seq& s, int h) {
    return L.alibi ? L.alibi[(size_t)s.index * L.alibi_batch_stride + h] : 0.0f;
}

// docs/semantics.md's score with ALiBi: s - slope * |i + off - j| (one f32 product,
// as the CPU backend rounds it).
__device__ __forceinline__ float with_alibi(const Problem& p, float slope, float s, int i, int j) {
    return s - slope * fabsf((float)(i + band_offset(p) - j));
}

// The block mask at pair (i, j) of sequence s, query head h (sequence-relative).
__device__ __forceinline__ bool block_allows(const Layout& L, const Seq& s, int h, int i, int j) {
    const int r = i / L.bm, c = j / L.bn;
    if (r >= L.mask_rows || c >= L.mask_cols) return false;
    const size_t base = (size_t)s.index * L.mask_batch_stride + (size_t)h * L.mask_head_stride;
    return L.mask[base + (size_t)r * L.mask_cols + c] != 0;
}

// The inner tiles outer tile `outer` visits: with a block mask its list,
// else every tile of [lo, hi) in `size` steps. (The list itself is read
// through L, a kernel parameter: no pointer is held in registers.)
struct Steps {
    int first, count;
};

__device__ __forceinline__ Steps tile_steps(const Layout& L, const Seq& s, int h, int outer, int lo, int hi,
                                            int size) {
    Steps t;
    if (L.tile_entries) {
        const int* st = L.tile_starts + (size_t)s.index * L.list_batch_stride +
                        (size_t)h * L.list_head_stride + outer;
        t.first = st[0];
        t.count = st[1] - st[0];
    } else {
        t.first = lo / size;
        t.count = max(0, (hi - t.first * size + size - 1) / size);
    }
    return t;
}

// Step k's first row (or key), and whether it needs the per-pair mask test.
__device__ __forceinline__ int step_start(const Layout& L, const Steps& t, int k, int size) {
    return (L.tile_entries ? (L.tile_entries[t.first + k] & TILE_INDEX_MASK) : t.first + k) * size;
}
__device__ __forceinline__ bool step_partial(const Layout& L, const Steps& t, int k) {
    return L.tile_entries && (L.tile_entries[t.first + k] & TILE_PARTIAL);
}

// A dK/dV block's steps: (query head of kv head hk's group, query tile) in
// order — with a block mask the list of (sequence, kv head, key tile),
// else every head's tiles of [lo, hi).
struct GroupSteps {
    int first, count, per_head;
};

__device__ __forceinline__ GroupSteps group_steps(const Layout& L, const Seq& s, int hk, int group, int outer,
                                                  int lo, int hi, int size) {
    GroupSteps t;
    const Steps one = tile_steps(L, s, hk, outer, lo, hi, size);
    t.first = one.first;
    t.per_head = one.count;
    t.count = L.tile_entries ? one.count : group * one.count;
    return t;
}

// A position in a GroupSteps walked in order: step k and, without a list,
// its (query head within the group, tile) kept by increments, not found by
// a division and a remainder each step (about 50 instructions a step).
struct GroupAt {
    int k, head, tile;
};
__device__ __forceinline__ GroupAt group_begin() { return GroupAt{0, 0, 0}; }
__device__ __forceinline__ GroupAt group_next(const GroupSteps& t, GroupAt a) {
    ++a.k;
    if (++a.tile == t.per_head) {
        a.tile = 0;
        ++a.head;
    }
    return a;
}

// The step's query head (within the group), first query row, and whether it
// needs the per-pair mask test.
__device__ __forceinline__ int group_step_head(const Layout& L, const GroupSteps& t, GroupAt a) {
    return L.tile_entries ? (L.tile_entries[t.first + a.k] & (TILE_PARTIAL - 1)) >> TILE_HEAD_SHIFT : a.head;
}
__device__ __forceinline__ int group_step_start(const Layout& L, const GroupSteps& t, GroupAt a, int size) {
    return (L.tile_entries ? (L.tile_entries[t.first + a.k] & TILE_INDEX_MASK) : t.first + a.tile) * size;
}
__device__ __forceinline__ bool group_step_partial(const Layout& L, const GroupSteps& t, GroupAt a) {
    return L.tile_entries && (L.tile_entries[t.first + a.k] & TILE_PARTIAL);
}

// A row's normalizer 1/l and LSE from its running max m and sum l, with the
// head's sink (a virtual key of score `sink` and value 0; NEG_INF: none).
// No allowed key: o = 0 and lse = -inf, or lse = sink exactly.
__device__ __forceinline__ void finish_row(float m, float l, float sink, float* inv_l, float* lse) {
    if (sink == NEG_INF) {
        *inv_l = l > 0.0f ? 1.0f / l : 0.0f;
        *lse = l > 0.0f ? m + logf(l) : NEG_INF;
        return;
    }
    const float top = l > 0.0f ? fmaxf(m, sink) : sink;
    const float a = l > 0.0f ? expf(m - top) : 0.0f;
    const float total = l * a + expf(sink - top);
    *inv_l = a / total;
    *lse = top + logf(total);
}

// Row-major (batch, seqlen, heads, d) element offset.
__device__ __forceinline__ size_t at(int b, int seqlen, int i, int heads, int h, int d) {
    return (((size_t)b * seqlen + i) * heads + h) * (size_t)d;
}

// Load `rows` rows of a (batch, seqlen, heads, d) tensor starting at row0
// into a padded f32 tile [rows][HEAD_DIM + 1] (the +1 spreads the columns
// of one row across banks); rows and columns past the tensor load 0.
__device__ __forceinline__ void load_tile(float* tile, int rows, const storage_t* src, int b,
                                          int row0, int seqlen, int heads, int h, int d) {
    for (int e = threadIdx.x; e < rows * HEAD_DIM; e += blockDim.x) {
        const int r = e / HEAD_DIM, c = e % HEAD_DIM;
        const int i = row0 + r;
        float x = 0.0f;
        if (i < seqlen && c < d) x = load_f32(src[at(b, seqlen, i, heads, h, d) + c]);
        tile[r * (HEAD_DIM + 1) + c] = x;
    }
}

__device__ __forceinline__ float dot_rows(const float* a, const float* b) {
    float s = 0.0f;
#pragma unroll 8
    for (int c = 0; c < HEAD_DIM; ++c) s = fmaf(a[c], b[c], s);
    return s;
}

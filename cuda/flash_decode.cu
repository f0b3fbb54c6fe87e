// Decoding on a device KV cache (flash_attn_with_kvcache): the step's new
// keys and values appended in place (kv_append), attention of each query
// row over its sequence's cached keys cut into splits (flash_decode, one
// block per (query row, head, split)), and the splits' partial o and lse
// merged by their log-sum-exp (flash_decode_merge). Dense and paged
// caches are one thing here: token t of sequence b is cache row
// pages[b · max_pages + t / page_size] · page_size + t % page_size, a
// dense cache being one page per sequence (its cache row).
//
// Defines beyond cuda/common.cuh's: HEAD_DIM is the padded larger of k's
// and v's head dims (both are arguments), CACHE_QUANT 0 for a cache of
// storage_t, 1 for int8 codes, 2 for FP8 e4m3 codes, each with one f32
// scale per (scale block, kv head) (docs/kv-quantization.md).
//
// Scores, masks and ALiBi are common.cuh's (the band bottom-right aligned
// per sequence: seqlen_k = cache_lens[b] + seqlen_new); the sinks are
// folded in at the merge, where every split's keys are known.

#define DECODE_THREADS 128
#define DECODE_WARPS (DECODE_THREADS / 32)
// Keys scored per tile (a warp per key, DECODE_KEYS / DECODE_WARPS each).
#define DECODE_KEYS 64
// Output columns a thread owns (column tid + c · DECODE_THREADS).
#define OUT_COLS ((HEAD_DIM + DECODE_THREADS - 1) / DECODE_THREADS)

#if defined(FLASHATTN_HOST_EMULATION)
#define __fmul_rn(a, b) ((float)(a) * (float)(b))
#define __fdiv_rn(a, b) ((float)(a) / (float)(b))
#define __ddiv_rn(a, b) ((double)(a) / (double)(b))
inline unsigned __float_as_uint(float x) { return float_bits(x); }
inline long long __double_as_longlong(double x) {
    long long y;
    std::memcpy(&y, &x, 8);
    return y;
}
#endif

#if CACHE_QUANT
typedef unsigned char cache_t;
#else
typedef storage_t cache_t;
#endif

// How sequences find their cache rows and what the step adds: src/cuda/
// decode.rs's `DecodeArgs` mirrors it field for field.
struct DecodeArgs {
    const int* pages;       // (batch, max_pages) page indices (a dense cache: each sequence's row)
    const int* cache_lens;  // (batch,) tokens cached before this step's append
    const float* alibi;     // slopes (heads_q,) or (batch, heads_q); null: none
    const float* sinks;     // (heads_q,) logits; null: none
    int batch, seqlen_new, max_pages, page_size;
    int d_v;                // v's (and o's) head dim; Problem's d is k's
    int keys_per_split;     // split s covers key positions [s · keys_per_split, (s + 1) · keys_per_split)
    int alibi_batch_stride; // heads_q for (batch, heads_q) slopes, else 0
    int block_tokens;       // tokens per scale block (quantized caches; a page when paged)
};
static_assert(sizeof(DecodeArgs) == 4 * 8 + 8 * 4, "DecodeArgs must stay four pointers and eight ints");

__device__ __forceinline__ size_t cache_row(const DecodeArgs& a, int b, int t) {
    return (size_t)a.pages[(size_t)b * a.max_pages + t / a.page_size] * a.page_size + t % a.page_size;
}

// The scale block of cache row `row` (src/kv_quant.rs's ScaleBlocks::block).
__device__ __forceinline__ size_t scale_block(const DecodeArgs& a, size_t row) {
    const int per_page = (a.page_size + a.block_tokens - 1) / a.block_tokens;
    return row / a.page_size * per_page + (int)(row % a.page_size) / a.block_tokens;
}

__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
    for (int w = 16; w > 0; w /= 2) x += __shfl_xor_sync(0xffffffffu, x, w);
    return x;
}

#if CACHE_QUANT
// ---- docs/kv-quantization.md's rule, bit for bit with src/kv_quant.rs ----
// Only IEEE-exact operations: f32 products and quotients rounded to
// nearest (the _rn intrinsics, never contracted into an FMA), the f64
// quotient of two f32s and its rounding to an integer, which is the host
// rule's own arithmetic (kv_quant.rs's encode), so codes and scales match it.

#define MIN_CACHE_SCALE __int_as_float(0x0d800000)  // 2^-100
#if CACHE_QUANT == 1
#define CACHE_QMAX 127.0f
#else
#define CACHE_QMAX 448.0f
#endif

// The value a code stands for, before its scale (exact in f32).
__device__ __forceinline__ float code_value(unsigned char c) {
#if CACHE_QUANT == 1
    return (float)(signed char)c;
#else
    const unsigned e = (c >> 3) & 15u, m = c & 7u;
    // Subnormal: m · 2^-9; normal: (8 + m) · 2^(e - 10), i.e. 1.m · 2^(e - 7).
    const float mag = e == 0 ? (float)m * (1.0f / 512.0f) : __uint_as_float((e + 120u) << 23 | m << 20);
    return c & 0x80u ? -mag : mag;
#endif
}

// fl(value(c) · s).
__device__ __forceinline__ float code_times(unsigned char c, float s) { return __fmul_rn(code_value(c), s); }

// A subnormal counts as 0 (kv_quant's flush).
__device__ __forceinline__ float flushed(float x) { return (__float_as_uint(x) & 0x7f800000u) == 0u ? 0.0f : x; }

// quant.rs's e4m3_from_f64: x rounded to e4m3, ties to even, saturating at ±448.
__device__ __forceinline__ unsigned char e4m3_of(double x) {
    const unsigned sign = x < 0.0 ? 0x80u : 0u;
    const double a = fabs(x);
    if (a >= 448.0) return (unsigned char)(sign | 0x7eu);
    if (a == 0.0) return 0;
    int e = (int)((__double_as_longlong(a) >> 52) & 0x7ff) - 1023;
    const int step = max(e, -6) - 3;
    unsigned n = (unsigned)rint(ldexp(a, -step));
    unsigned code;
    if (e >= -6) {
        if (n == 16) {
            n = 8;
            e += 1;
        }
        code = e > 8 || (e == 8 && n > 14) ? 0x7eu : ((unsigned)(e + 7) << 3) | (n - 8);
    } else {
        code = n;  // subnormal: n multiples of 2^-9
    }
    return code == 0 ? 0 : (unsigned char)(sign | code);
}

// The code of x at scale s (a normal f32 > 0): the exact quotient rounded.
__device__ __forceinline__ unsigned char code_of(float x, float s) {
    x = flushed(x);
    if (x == 0.0f) return 0;
    // The f64 quotient of two f32s rounds like the exact one (kv_quant.rs).
    const double q = __ddiv_rn((double)x, (double)s);
#if CACHE_QUANT == 1
    const double r = fmin(fmax(rint(q), -127.0), 127.0);
    return (unsigned char)(signed char)(int)r;
#else
    return e4m3_of(q);
#endif
}

// max(fl(a / QMAX), 2^-100).
__device__ __forceinline__ float scale_of(float a) { return fmaxf(__fdiv_rn(a, CACHE_QMAX), MIN_CACHE_SCALE); }
#endif

// Element e of a cache row at its block's scale s: the stored value, or
// fl(value(c) · s) for a code.
__device__ __forceinline__ float cache_value(const cache_t* row, int e, float s) {
#if CACHE_QUANT
    return code_times(row[e], s);
#else
    return load_f32(row[e]);
#endif
}

// The scale of cache row `row`, kv head hk (1 for a plain cache, unread).
__device__ __forceinline__ float row_scale(const float* scales, const DecodeArgs& a, size_t row, int heads_kv,
                                           int hk) {
#if CACHE_QUANT
    return scales[scale_block(a, row) * heads_kv + hk];
#else
    return 1.0f;
#endif
}

#if CACHE_QUANT
// One block per (scale block the step's new tokens reach, kv head,
// sequence × {K, V}), the blocks of a sequence in token order from the one
// holding its first new token: the largest new magnitude there; where it
// asks for a larger scale, the block takes it and its other codes are
// requantized in place; then the new values are coded at the block's
// scale. A block belongs to one sequence (validated: no two sequences
// append to one cache row), so no two thread blocks share a scale.
extern "C" __global__ void __launch_bounds__(DECODE_THREADS)
kv_append(const storage_t* __restrict__ k_new, const storage_t* __restrict__ v_new, cache_t* kc, cache_t* vc,
          float* k_scales, float* v_scales, Problem p, const DecodeArgs a) {
    __shared__ float block_max[DECODE_THREADS];
    const int b = blockIdx.z / 2, hk = blockIdx.y, tid = threadIdx.x;
    const bool is_v = blockIdx.z % 2 == 1;
    const int d = is_v ? a.d_v : p.d;
    const storage_t* src = is_v ? v_new : k_new;
    cache_t* codes = is_v ? vc : kc;
    float* scales = is_v ? v_scales : k_scales;
    const int t0 = a.cache_lens[b], t1 = t0 + a.seqlen_new;
    const int bpp = (a.page_size + a.block_tokens - 1) / a.block_tokens;
    const int first = (t0 / a.page_size) * bpp + (t0 % a.page_size) / a.block_tokens;
    const int j = first + blockIdx.x;
    const int start = (j / bpp) * a.page_size + (j % bpp) * a.block_tokens;
    const int end = min(start + a.block_tokens, (j / bpp + 1) * a.page_size);
    const int lo = max(t0, start), hi = min(t1, end);
    if (lo >= hi) return;  // uniform: past this sequence's new tokens
    const size_t at = scale_block(a, cache_row(a, b, start)) * p.heads_kv + hk;
    auto new_value = [&](int t, int c) {
        return load_f32(src[(((size_t)b * a.seqlen_new + (t - t0)) * p.heads_kv + hk) * d + c]);
    };
    const int n = (hi - lo) * d;
    float m = 0.0f;
    for (int e = tid; e < n; e += DECODE_THREADS) m = fmaxf(m, fabsf(flushed(new_value(lo + e / d, e % d))));
    block_max[tid] = m;
    const float old = scales[at];  // read by every thread before any writes it
    for (int w = DECODE_THREADS / 2; w > 0; w /= 2) {
        __syncthreads();
        if (tid < w) block_max[tid] = fmaxf(block_max[tid], block_max[tid + w]);
    }
    __syncthreads();
    const float grown = scale_of(block_max[0]);
    float s = old;
    if (grown > old) {
        s = grown;
        // The block's other rows (the new tokens' are written below).
        for (int e = tid; e < (end - start) * d; e += DECODE_THREADS) {
            const int t = start + e / d;
            if (t < lo || t >= hi) {
                cache_t* c = codes + (cache_row(a, b, t) * p.heads_kv + hk) * d + e % d;
                *c = code_of(code_times(*c, old), s);
            }
        }
        if (tid == 0) scales[at] = s;
    }
    for (int e = tid; e < n; e += DECODE_THREADS) {
        const int t = lo + e / d;
        codes[(cache_row(a, b, t) * p.heads_kv + hk) * d + e % d] = code_of(new_value(t, e % d), s);
    }
}
#else
// One block per new token (b, t): its K and V rows copied to cache row
// cache_row(b, cache_lens[b] + t).
extern "C" __global__ void __launch_bounds__(DECODE_THREADS)
kv_append(const storage_t* __restrict__ k_new, const storage_t* __restrict__ v_new, cache_t* kc, cache_t* vc,
          float* k_scales, float* v_scales, Problem p, const DecodeArgs a) {
    const int b = blockIdx.x / a.seqlen_new, t = blockIdx.x % a.seqlen_new;
    const size_t row = cache_row(a, b, a.cache_lens[b] + t);
    const size_t k_len = (size_t)p.heads_kv * p.d, v_len = (size_t)p.heads_kv * a.d_v;
    for (size_t e = threadIdx.x; e < k_len; e += DECODE_THREADS) kc[row * k_len + e] = k_new[blockIdx.x * k_len + e];
    for (size_t e = threadIdx.x; e < v_len; e += DECODE_THREADS) vc[row * v_len + e] = v_new[blockIdx.x * v_len + e];
}
#endif

// One block per (query row b · seqlen_q + i, query head, split): the
// online softmax over the split's allowed keys, a warp per key for the
// scores (lanes over the head dim, coalesced), each thread owning output
// columns for P·V. Writes the split's o normalized by its own sum, and
// its lse (-inf with no allowed key), in f32.
extern "C" __global__ void __launch_bounds__(DECODE_THREADS)
flash_decode(const storage_t* __restrict__ q, const cache_t* __restrict__ kc, const cache_t* __restrict__ vc,
             const float* __restrict__ k_scales, const float* __restrict__ v_scales, float* __restrict__ part_o,
             float* __restrict__ part_lse, Problem p, const DecodeArgs a) {
    __shared__ float q_row[HEAD_DIM];
    __shared__ float s_tile[DECODE_KEYS];
    __shared__ float p_tile[DECODE_KEYS];
    const int row = blockIdx.x, h = blockIdx.y, split = blockIdx.z;
    const int b = row / p.seqlen_q, i = row % p.seqlen_q;
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    p.seqlen_k = a.cache_lens[b] + a.seqlen_new;
    const int hk = h / (p.heads_q / p.heads_kv);
    const float slope = a.alibi ? a.alibi[(size_t)b * a.alibi_batch_stride + h] : 0.0f;
    for (int c = tid; c < HEAD_DIM; c += DECODE_THREADS)
        q_row[c] = c < p.d ? load_f32(q[((size_t)row * p.heads_q + h) * p.d + c]) : 0.0f;

    int lo, hi;
    key_span(p, i, i + 1, &lo, &hi);
    lo = max(lo, split * a.keys_per_split);
    hi = min(hi, (split + 1) * a.keys_per_split);
    float acc[OUT_COLS];
#pragma unroll
    for (int c = 0; c < OUT_COLS; ++c) acc[c] = 0.0f;
    float m = NEG_INF, l = 0.0f;
    for (int n0 = lo; n0 < hi; n0 += DECODE_KEYS) {
        __syncthreads();  // q_row written; the previous tile's scores and P read
        for (int jj = warp; jj < DECODE_KEYS; jj += DECODE_WARPS) {
            const int j = n0 + jj;
            float s = NEG_INF;
            if (j < hi && allowed(p, i, j)) {  // uniform in the warp
                const size_t r = cache_row(a, b, j);
                const cache_t* k_row = kc + (r * p.heads_kv + hk) * p.d;
                const float ks = row_scale(k_scales, a, r, p.heads_kv, hk);
                float dot = 0.0f;
                for (int c = lane; c < p.d; c += 32) dot = fmaf(q_row[c], cache_value(k_row, c, ks), dot);
                float dcap;
                s = with_alibi(p, slope, score(p, warp_sum(dot), &dcap), i, j);
            }
            if (lane == 0) s_tile[jj] = s;
        }
        __syncthreads();
        float tile_max = NEG_INF;
        for (int jj = 0; jj < DECODE_KEYS; ++jj) tile_max = fmaxf(tile_max, s_tile[jj]);
        const float m_new = fmaxf(m, tile_max);
        // A row that has seen no allowed key yet keeps m = -inf and adds nothing.
        const float alpha = m_new == NEG_INF ? 1.0f : expf(m - m_new);
        if (tid < DECODE_KEYS) p_tile[tid] = s_tile[tid] == NEG_INF ? 0.0f : expf(s_tile[tid] - m_new);
        __syncthreads();
        float sum = 0.0f;  // the sums take P unrounded, as the forward's do
        for (int jj = 0; jj < DECODE_KEYS; ++jj) sum += p_tile[jj];
        l = l * alpha + sum;
        m = m_new;
#pragma unroll
        for (int c = 0; c < OUT_COLS; ++c) acc[c] *= alpha;
        const int keys = min(DECODE_KEYS, hi - n0);
        for (int jj = 0; jj < keys; ++jj) {
            const float pj = round_storage(p_tile[jj]);
            if (pj == 0.0f) continue;  // uniform (shared): a masked key's V is never read
            const size_t r = cache_row(a, b, n0 + jj);
            const cache_t* v_row = vc + (r * p.heads_kv + hk) * a.d_v;
            const float vs = row_scale(v_scales, a, r, p.heads_kv, hk);
#pragma unroll
            for (int c = 0; c < OUT_COLS; ++c) {
                const int col = tid + c * DECODE_THREADS;
                if (col < a.d_v) acc[c] = fmaf(pj, cache_value(v_row, col, vs), acc[c]);
            }
        }
    }
    const size_t at = ((size_t)split * gridDim.x + row) * p.heads_q + h;
    const float inv_l = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
    for (int c = 0; c < OUT_COLS; ++c) {
        const int col = tid + c * DECODE_THREADS;
        if (col < a.d_v) part_o[at * a.d_v + col] = acc[c] * inv_l;
    }
    if (tid == 0) part_lse[at] = l > 0.0f ? m + logf(l) : NEG_INF;
}

// One block per (query row, query head): the splits' partials merged by
// their lse, the head's sink (a virtual key of value 0) folded in; o in
// storage, lse (batch, heads_q, seqlen_q). No allowed key anywhere: o = 0
// and lse = -inf, or lse = the sink exactly.
extern "C" __global__ void __launch_bounds__(DECODE_THREADS)
flash_decode_merge(const float* __restrict__ part_o, const float* __restrict__ part_lse, storage_t* __restrict__ o,
                   float* __restrict__ lse, Problem p, const DecodeArgs a, int splits) {
    const int row = blockIdx.x, h = blockIdx.y, tid = threadIdx.x;
    const int b = row / p.seqlen_q, i = row % p.seqlen_q;
    const size_t rows = gridDim.x;
    auto part = [&](int s) { return ((size_t)s * rows + row) * p.heads_q + h; };
    const float sink = a.sinks ? a.sinks[h] : NEG_INF;
    float top = sink;
    for (int s = 0; s < splits; ++s) top = fmaxf(top, part_lse[part(s)]);
    float total = sink == NEG_INF ? 0.0f : expf(sink - top);
    if (top != NEG_INF)
        for (int s = 0; s < splits; ++s) total += expf(part_lse[part(s)] - top);
    const float out_lse = top == NEG_INF ? NEG_INF : top + logf(total);
    float acc[OUT_COLS];
#pragma unroll
    for (int c = 0; c < OUT_COLS; ++c) acc[c] = 0.0f;
    for (int s = 0; s < splits; ++s) {
        const float ls = part_lse[part(s)];
        if (ls == NEG_INF) continue;  // a split with no allowed key
        const float w = expf(ls - out_lse);
#pragma unroll
        for (int c = 0; c < OUT_COLS; ++c) {
            const int col = tid + c * DECODE_THREADS;
            if (col < a.d_v) acc[c] = fmaf(w, part_o[part(s) * a.d_v + col], acc[c]);
        }
    }
#pragma unroll
    for (int c = 0; c < OUT_COLS; ++c) {
        const int col = tid + c * DECODE_THREADS;
        if (col < a.d_v) o[((size_t)row * p.heads_q + h) * a.d_v + col] = store_f32(acc[c]);
    }
    if (tid == 0) lse[((size_t)b * p.heads_q + h) * p.seqlen_q + i] = out_lse;
}

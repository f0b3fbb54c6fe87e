// Decoding on a device KV cache (flash_attn_with_kvcache): the step's new
// keys and values appended in place (kv_append), attention of each query
// row over its sequence's cached keys cut into splits (flash_decode, one
// block per (sequence, kv head, split) and up to DECODE_ROWS of its GQA
// group's query rows), and the splits' partial o and lse
// merged by their log-sum-exp (flash_decode_merge). Dense and paged
// caches are one thing here: token t of sequence b is cache row
// pages[b · max_pages + t / page_size] · page_size + t % page_size, a
// dense cache being one page per sequence (its cache row).
//
// A latent cache (DeepSeek's MLA) is one tensor: V is a view of the first
// d_v columns of K's rows, read through V's own strides (DecodeArgs'
// v_row_stride and v_head_stride: K's row length and head dim there) from
// K's buffer, and an append writes K's rows alone (v_new null).
//
// Defines beyond cuda/common.cuh's: HEAD_DIM is the padded larger of k's
// and v's head dims (both are arguments), CACHE_QUANT 0 for a cache of
// storage_t, 1 for int8 codes, 2 for FP8 e4m3 codes, each with one f32
// scale per (scale block, kv head) (docs/kv-quantization.md).
//
// Scores, masks and ALiBi are common.cuh's (the band bottom-right aligned
// per sequence: seqlen_k = cache_lens[b] + seqlen_new); the sinks are
// folded in at the merge, where every split's keys are known.

// DECODE_THREADS (a block's), DECODE_KEYS (keys scored per tile) and
// DECODE_ROWS (the query rows of one sequence and kv head a flash_decode
// block owns) are src/cuda/kernel.rs's, defined there.
#define DECODE_WARPS (DECODE_THREADS / 32)
// Keys a warp scores at once: each q element read from shared memory
// serves them all, and the warp's KEYS_AT_ONCE × DECODE_ROWS partial dots
// are exactly one per lane after the reduction.
#define KEYS_AT_ONCE (32 / DECODE_ROWS)
static_assert(KEYS_AT_ONCE * DECODE_ROWS == 32, "one dot per lane after the reduction");
static_assert(DECODE_KEYS % (DECODE_WARPS * KEYS_AT_ONCE) == 0, "whole key pairs per warp");
// Output columns a thread owns (column tid + c · DECODE_THREADS).
#define OUT_COLS ((HEAD_DIM + DECODE_THREADS - 1) / DECODE_THREADS)

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
    int v_row_stride;       // elements between cache rows of V (K's row length in a latent cache)
    int v_head_stride;      // elements between kv heads' rows of V (K's head dim in a latent cache)
};
static_assert(sizeof(DecodeArgs) == 4 * 8 + 10 * 4, "DecodeArgs must stay four pointers and ten ints");

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

// One step of a warp's 32 sums of 32 values (v[e] on every lane): of its
// first 2W values a lane keeps the half its lane bit W selects, plus the
// partner lane's (lane ^ W) copy of that half, in v[0, W). After the steps
// W = 16, 8, 4, 2, 1, lane l holds the warp's sum of v[l]. W a template
// argument, so that v stays in registers.
template <int W>
__device__ __forceinline__ void fold(float (&v)[32], int lane) {
    const bool upper = (lane & W) != 0;
#pragma unroll
    for (int e = 0; e < W; ++e) {
        const float send = upper ? v[e] : v[e + W];
        const float keep = upper ? v[e + W] : v[e];
        v[e] = keep + __shfl_xor_sync(0xffffffffu, send, W);
    }
}

__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
    for (int w = 16; w > 0; w /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, w));
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
    return e4m3_value(c);
#endif
}

// fl(value(c) · s).
__device__ __forceinline__ float code_times(unsigned char c, float s) { return __fmul_rn(code_value(c), s); }

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
// sequence × {K, V}; a latent cache's sequence × {K}, v_new null), the
// blocks of a sequence in token order from the one
// holding its first new token: the largest new magnitude there; where it
// asks for a larger scale, the block takes it and its other codes are
// requantized in place; then the new values are coded at the block's
// scale. A block belongs to one sequence (validated: no two sequences
// append to one cache row), so no two thread blocks share a scale.
extern "C" __global__ void __launch_bounds__(DECODE_THREADS)
kv_append(const storage_t* __restrict__ k_new, const storage_t* __restrict__ v_new, cache_t* kc, cache_t* vc,
          float* k_scales, float* v_scales, Problem p, const DecodeArgs a) {
    __shared__ float block_max[DECODE_THREADS];
    const int parts = v_new ? 2 : 1;
    const int b = blockIdx.z / parts, hk = blockIdx.y, tid = threadIdx.x;
    const bool is_v = blockIdx.z % parts == 1;
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
// cache_row(b, cache_lens[b] + t); a latent cache's K rows alone (v_new
// and vc null: its V view reads them).
extern "C" __global__ void __launch_bounds__(DECODE_THREADS)
kv_append(const storage_t* __restrict__ k_new, const storage_t* __restrict__ v_new, cache_t* kc, cache_t* vc,
          float* k_scales, float* v_scales, Problem p, const DecodeArgs a) {
    const int b = blockIdx.x / a.seqlen_new, t = blockIdx.x % a.seqlen_new;
    const size_t row = cache_row(a, b, a.cache_lens[b] + t);
    const size_t k_len = (size_t)p.heads_kv * p.d, v_len = (size_t)p.heads_kv * a.d_v;
    for (size_t e = threadIdx.x; e < k_len; e += DECODE_THREADS) kc[row * k_len + e] = k_new[blockIdx.x * k_len + e];
    if (v_new)  // uniform: null for a latent cache
        for (size_t e = threadIdx.x; e < v_len; e += DECODE_THREADS)
            vc[row * v_len + e] = v_new[blockIdx.x * v_len + e];
}
#endif

// One block per (sequence b, kv head hk, chunk of its GQA group's rows,
// split): the group's query heads × seqlen_q positions are DECODE_ROWS
// rows a block (row r: position r / group, head hk · group + r % group),
// so each K and V row a block loads serves all of them, and a group of
// up to DECODE_ROWS rows (MQA and MLA decoding's one kv head included)
// reads its split of the cache once, not once per query head. Scores: a
// warp per KEYS_AT_ONCE keys, lanes over the head dim, every row's dot
// from one load of each K element; softmax: a warp per row, lanes over
// the tile's keys; P·V: each thread owning output columns of every row,
// one load of each V element (read through V's strides: a latent cache's
// vc is kc). Writes each row's o normalized by its own sum, and its lse
// (-inf with no allowed key), in f32.
// The launch bound's 1 block an SM: without it ptxas aimed the sm_80
// f16/bf16 variants at 80 registers for occupancy and spilled.
extern "C" __global__ void __launch_bounds__(DECODE_THREADS, 1)
flash_decode(const storage_t* __restrict__ q, const cache_t* __restrict__ kc, const cache_t* __restrict__ vc,
             const float* __restrict__ k_scales, const float* __restrict__ v_scales, float* __restrict__ part_o,
             float* __restrict__ part_lse, Problem p, const DecodeArgs a) {
    __shared__ float q_rows[DECODE_ROWS][HEAD_DIM];
    // A tile's scores, then P (storage-rounded) in place; the padding column
    // spreads the score writes (a lane per row) over the banks.
    __shared__ float p_tile[DECODE_ROWS][DECODE_KEYS + 1];
    __shared__ float row_m[DECODE_ROWS], row_l[DECODE_ROWS], row_alpha[DECODE_ROWS];
    const int group = p.heads_q / p.heads_kv, group_rows = group * p.seqlen_q;
    const int chunks = (group_rows + DECODE_ROWS - 1) / DECODE_ROWS;
    const int b = blockIdx.x / chunks, r0 = blockIdx.x % chunks * DECODE_ROWS;
    const int hk = blockIdx.y, split = blockIdx.z;
    const int rows = min(DECODE_ROWS, group_rows - r0);  // uniform: the predicate of every row loop
    const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
    p.seqlen_k = a.cache_lens[b] + a.seqlen_new;
    // Row r's query position and head.
    auto pos = [&](int r) { return (r0 + r) / group; };
    auto head = [&](int r) { return hk * group + (r0 + r) % group; };
    for (int e = tid; e < DECODE_ROWS * HEAD_DIM; e += DECODE_THREADS) {
        const int r = e / HEAD_DIM, c = e % HEAD_DIM;
        q_rows[r][c] =
            r < rows && c < p.d ? load_f32(q[(((size_t)b * p.seqlen_q + pos(r)) * p.heads_q + head(r)) * p.d + c])
                                : 0.0f;
    }
    if (tid < DECODE_ROWS) {
        row_m[tid] = NEG_INF;
        row_l[tid] = 0.0f;
    }

    int lo, hi;
    key_span(p, pos(0), pos(rows - 1) + 1, &lo, &hi);
    lo = max(lo, split * a.keys_per_split);
    hi = min(hi, (split + 1) * a.keys_per_split);
    float acc[DECODE_ROWS][OUT_COLS];
#pragma unroll
    for (int r = 0; r < DECODE_ROWS; ++r)
#pragma unroll
        for (int c = 0; c < OUT_COLS; ++c) acc[r][c] = 0.0f;
    for (int n0 = lo; n0 < hi; n0 += DECODE_KEYS) {
        __syncthreads();  // q_rows and the row state written; the previous tile's P read
        for (int j0 = warp * KEYS_AT_ONCE; j0 < DECODE_KEYS; j0 += DECODE_WARPS * KEYS_AT_ONCE) {
            // dot[u · DECODE_ROWS + r]: this lane's part of row r · key n0 + j0 + u.
            float dot[KEYS_AT_ONCE * DECODE_ROWS];
#pragma unroll
            for (int e = 0; e < KEYS_AT_ONCE * DECODE_ROWS; ++e) dot[e] = 0.0f;
            const cache_t* k_row[KEYS_AT_ONCE];
            float ks[KEYS_AT_ONCE];
#pragma unroll
            for (int u = 0; u < KEYS_AT_ONCE; ++u) {
                // A key past the span reads key lo's row (in the cache) and is masked below.
                const int j = n0 + j0 + u < hi ? n0 + j0 + u : lo;
                const size_t cr = cache_row(a, b, j);
                k_row[u] = kc + (cr * p.heads_kv + hk) * p.d;
                ks[u] = row_scale(k_scales, a, cr, p.heads_kv, hk);
            }
            for (int c = lane; c < p.d; c += 32) {
                float kv[KEYS_AT_ONCE];
#pragma unroll
                for (int u = 0; u < KEYS_AT_ONCE; ++u) kv[u] = cache_value(k_row[u], c, ks[u]);
#pragma unroll
                for (int r = 0; r < DECODE_ROWS; ++r) {
                    if (r < rows) {
                        const float qc = q_rows[r][c];
#pragma unroll
                        for (int u = 0; u < KEYS_AT_ONCE; ++u)
                            dot[u * DECODE_ROWS + r] = fmaf(qc, kv[u], dot[u * DECODE_ROWS + r]);
                    }
                }
            }
            // The warp's 32 sums, lane l ending with dot[l]'s (31 shuffles).
            fold<16>(dot, lane);
            fold<8>(dot, lane);
            fold<4>(dot, lane);
            fold<2>(dot, lane);
            fold<1>(dot, lane);
            const int u = lane / DECODE_ROWS, r = lane % DECODE_ROWS, j = n0 + j0 + u;
            float s = NEG_INF;
            if (r < rows && j < hi && allowed(p, pos(r), j)) {
                const float slope = a.alibi ? a.alibi[(size_t)b * a.alibi_batch_stride + head(r)] : 0.0f;
                float dcap;
                s = with_alibi(p, slope, score(p, dot[0], &dcap), pos(r), j);
            }
            p_tile[r][j0 + u] = s;
        }
        __syncthreads();
        // Each row's online softmax over the tile: a warp per row.
        for (int r = warp; r < rows; r += DECODE_WARPS) {
            float tile_max = NEG_INF;
            for (int jj = lane; jj < DECODE_KEYS; jj += 32) tile_max = fmaxf(tile_max, p_tile[r][jj]);
            tile_max = warp_max(tile_max);
            const float m = row_m[r], m_new = fmaxf(m, tile_max);
            // A row that has seen no allowed key yet keeps m = -inf and adds nothing.
            const float alpha = m_new == NEG_INF ? 1.0f : expf(m - m_new);
            float sum = 0.0f;  // the sums take P unrounded, as the forward's do
            for (int jj = lane; jj < DECODE_KEYS; jj += 32) {
                const float s = p_tile[r][jj];
                const float pj = s == NEG_INF ? 0.0f : expf(s - m_new);
                sum += pj;
                p_tile[r][jj] = round_storage(pj);
            }
            sum = warp_sum(sum);
            if (lane == 0) {
                row_l[r] = row_l[r] * alpha + sum;
                row_m[r] = m_new;
                row_alpha[r] = alpha;
            }
        }
        __syncthreads();
#pragma unroll
        for (int r = 0; r < DECODE_ROWS; ++r)
            if (r < rows)
#pragma unroll
                for (int c = 0; c < OUT_COLS; ++c) acc[r][c] *= row_alpha[r];
        const int keys = min(DECODE_KEYS, hi - n0);
        for (int jj = 0; jj < keys; ++jj) {
            float pr[DECODE_ROWS];
            bool any = false;
#pragma unroll
            for (int r = 0; r < DECODE_ROWS; ++r) {
                pr[r] = r < rows ? p_tile[r][jj] : 0.0f;
                any = any || pr[r] != 0.0f;
            }
            if (!any) continue;  // uniform (shared): a key no row may see has its V never read
            const size_t cr = cache_row(a, b, n0 + jj);
            const cache_t* v_row = vc + cr * a.v_row_stride + (size_t)hk * a.v_head_stride;
            const float vs = row_scale(v_scales, a, cr, p.heads_kv, hk);
#pragma unroll
            for (int c = 0; c < OUT_COLS; ++c) {
                const int col = tid + c * DECODE_THREADS;
                if (col < a.d_v) {
                    const float v = cache_value(v_row, col, vs);
#pragma unroll
                    for (int r = 0; r < DECODE_ROWS; ++r)
                        // A row's masked key adds nothing, even where its V is not finite.
                        if (pr[r] != 0.0f) acc[r][c] = fmaf(pr[r], v, acc[r][c]);
                }
            }
        }
    }
    __syncthreads();  // the row state final (and written, where no tile ran)
    const size_t all_rows = (size_t)a.batch * p.seqlen_q;
#pragma unroll
    for (int r = 0; r < DECODE_ROWS; ++r) {
        if (r >= rows) continue;
        const size_t at = ((size_t)split * all_rows + (size_t)b * p.seqlen_q + pos(r)) * p.heads_q + head(r);
        const float l = row_l[r], inv_l = l > 0.0f ? 1.0f / l : 0.0f;
#pragma unroll
        for (int c = 0; c < OUT_COLS; ++c) {
            const int col = tid + c * DECODE_THREADS;
            if (col < a.d_v) part_o[at * a.d_v + col] = acc[r][c] * inv_l;
        }
        if (tid == 0) part_lse[at] = l > 0.0f ? row_m[r] + logf(l) : NEG_INF;
    }
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

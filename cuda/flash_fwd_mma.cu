// FlashAttention-2 forward on tensor cores (sm80+, f16/bf16 storage, f32
// accumulation), FA2's shape: one block of 4 warps per (BLOCK_M query
// rows, query head, batch entry), each warp owning MT row tiles of 16 (128
// rows and MT = 2 where registers allow, else 64 and 1: src/cuda/kernel.rs
// decides); key tiles of BLOCK_N keys. One buffer of K and one of V, each
// loading by cp.async while the other is in use: V_j during S = Q K_j^T and
// the softmax, K_{j+1} during O += P V_j. Q's fragments are reloaded by
// ldmatrix for every tile, leaving the registers to O and S. Dynamic shared
// memory, in elements of ROW:
//
//   Q [BLOCK_M][ROW] | K [BLOCK_N][ROW] | V [BLOCK_N][ROW]
//
// S = Q K^T and O += P V are mma.sync m16n8k16 on ldmatrix fragments, S
// of all of a warp's row tiles at once (each K fragment serves them all,
// as each V fragment does in P V). The online softmax runs on S's
// accumulator fragments in base 2 (a row lives in one quad: max and sum by
// two shuffles): m is the exponents' reference (a running max of score ·
// log2 e), P = 2^(x - m) by ex2, the LSE is converted once at the end. A
// tile whose every pair is allowed (no ALiBi, inside seqlen_k and every
// row's band, not a partial block-mask tile) runs in a loop of its own with
// no test per pair and no max: P is taken against m as it stands (without
// a softcap one FFMA and one ex2 of the raw dot product: the scale's sign
// goes into Q, so the max of raw dots is the max of scores), and only when
// a lane's part of some row's sum of P passes RESCALE_LIMIT does the warp
// take the maxima and rescale (FA4's conditional rescale). That loop
// prefetches whole rows of K (its successor is interior too: each run's
// last interior tile runs with the boundary tiles). The other tiles'
// allowed pairs are worked out by the block into a bit each in shared
// memory, as dropout's keep bits are, and take the plain step: max, then
// P. P is rounded to storage by paired conversions as the A operand of P
// V; each lane keeps its partial row sums (of P unrounded) until the end.

#define WARPS 4
#define MT (BLOCK_M / (16 * WARPS))  // row tiles of 16 per warp
#define LN2 0.6931471805599453f
static_assert(MT == 1 || MT == 2, "16 or 32 rows per warp");
static_assert(BLOCK_N % 32 == 0, "whole words of allowed bits");
static_assert((BLOCK_M + 2 * BLOCK_N) * ROW * 2 == SMEM_BYTES,
              "src/cuda/kernel.rs launches with this layout's bytes");
// Without a softcap (whose tanh needs each scaled score) an interior tile
// works on raw dot products and folds the scale into the FFMA.
#define RAW_INTERIOR (!HAS_SOFTCAP)
// S of a warp's row tiles at once (each K fragment serves them all), but
// in the dropout variants (their keep bits) and for sm_90 (whose ptxas
// schedules otherwise; there the Hopper kernels are the fast path), which
// spill with it: there each row tile takes its own.
#if HAS_DROPOUT || (defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900)
#define SHARED_K 0
#else
#define SHARED_K 1
#endif

// How far a lane's part of an interior tile's row sum of P may grow, P
// taken against the reference max, before O and l are rescaled: P stays <=
// 2^8, exact in f32 sums and as wide as storage's exponent allows.
#define RESCALE_LIMIT 256.0f

// The conditional rescale's P for a lane's two rows of a tile (16 rows x
// BLOCK_N keys a warp): 2^(x sl2 - m) (RAW: x a raw dot product) or
// 2^(x - m), against the reference m as it stands, rounded straight into
// P's A fragments (pack_a's order); ts[r] gets the lane's sum of its pairs
// of row r, unrounded (the LSE's accuracy needs the sums of P as computed,
// not as rounded).
template <bool RAW>
__device__ __forceinline__ void exp2_tile(unsigned (&pa)[BLOCK_N / 16][4], float (&ts)[2],
                                          const float (&s)[BLOCK_N / 8][4], const float (&m)[2], float sl2) {
    auto p = [&](float x, int r) { return exp2_approx(RAW ? fmaf(x, sl2, -m[r]) : x - m[r]); };
    ts[0] = ts[1] = 0.0f;
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const float(&x)[4] = s[2 * kk + j / 2];
            const int r = j % 2;
            const float lo = p(x[2 * r], r), hi = p(x[2 * r + 1], r);
            ts[r] += lo + hi;
            pa[kk][j] = pack2(lo, hi);
        }
}

// P's A fragments with the dropped pairs zeroed, what P V takes: kept[r][w]
// holds row r's keep bits, pair (c, e) at bit 8 (c % 4) + e % 2.
__device__ __forceinline__ void drop_pairs(unsigned (&pa)[BLOCK_N / 16][4], const unsigned (&kept)[2][BLOCK_N / 32]) {
#pragma unroll
    for (int kk = 0; kk < BLOCK_N / 16; ++kk)
#pragma unroll
        for (int j = 0; j < 4; ++j) {
            const int c = 2 * kk + j / 2;
            const unsigned b = kept[j % 2][c / 4] >> (c % 4 * 8);
            pa[kk][j] &= (b & 1u ? 0xffffu : 0u) | (b & 2u ? 0xffff0000u : 0u);
        }
}

// Query rows m0.. of the block, RT row tiles of 16 a warp (16 WARPS RT
// rows). ALIGNED: d % 8 == 0, K and V stream by cp.async in whole chunks;
// else element by element, and the block's rows in passes of RT = 1 (that
// copy then holds one row tile's registers, as it does nothing fast).
template <bool ALIGNED, int RT>
__device__ __forceinline__ void forward_rows(const storage_t* __restrict__ q, const storage_t* __restrict__ k,
                                             const storage_t* __restrict__ v, storage_t* __restrict__ o,
                                             float* __restrict__ lse, const Problem& problem, const Layout& L,
                                             const Dropout& D, unsigned char* smem, KeepTile<BLOCK_M, BLOCK_N>& keep,
                                             unsigned* allow_bits, const int m0) {
    constexpr int ROWS = 16 * WARPS * RT;
    storage_t* q_s = (storage_t*)smem;
    storage_t* k_s = q_s + ROWS * ROW;
    storage_t* v_s = k_s + BLOCK_N * ROW;

    const int h = blockIdx.y;
    Problem p = problem;
    const Seq seq = enter_sequence(L, &p, blockIdx.z);
    if (m0 >= p.seqlen_q) return;  // past a short sequence of a packed batch
    const int b = seq.b;
    q = from_row(q, seq.q0, p.heads_q, p.d);
    // K and V rows are found from the arguments by the sequence's first row
    // each time (two 64-bit pointers held through the loop spilled at d 128).
    const int k0 = (int)seq.k0;
    const int hk = h / (p.heads_q / p.heads_kv);
    const float slope = alibi_slope(L, seq, h);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
    const int w0 = warp * 16 * RT + lane / 4;  // this lane's rows from m0: w0 + 16 mi + 8 r
    const int r0 = m0 + w0;

    int lo, hi;
    key_span(p, m0, min(m0 + ROWS, p.seqlen_q), &lo, &hi);
    const Steps steps = tile_steps(L, seq, h, blockIdx.x, lo, hi, BLOCK_N);
    const int tiles = steps.count;
    // Keys [inner_lo, inner_hi) are allowed for every row
    // (below seqlen_k and, with a band, inside every row's window); with
    // ALiBi no tile is interior (its bias is per pair). Rows past seqlen_q
    // are computed either way and never written.
    int inner_lo = 0, inner_hi = L.alibi ? 0 : p.seqlen_k;
#if HAS_BAND
    {
        const int off = band_offset(p), last_row = min(m0 + ROWS, p.seqlen_q) - 1;
        if (p.right >= 0) inner_hi = min(inner_hi, m0 + off + p.right + 1);
        if (p.left >= 0) inner_lo = max(inner_lo, last_row + off - p.left);
    }
#endif
    // Step `tile`'s first key and whether the block mask needs a test per
    // pair, the list read by index each time (ptxas held a pointer stepping
    // along it, a 64-bit register the loop cannot spare).
    auto start = [&](int tile) { return step_start(L, steps, (int)opaque((unsigned)tile), BLOCK_N); };
    auto partial = [&](int tile) { return step_partial(L, steps, (int)opaque((unsigned)tile)); };
    // Whether step `tile` is interior: one read of the list's entry for
    // its first key and its partial bit (step_start, step_partial).
    auto interior = [&](int tile) {
        const int k = steps.first + (int)opaque((unsigned)tile);
        const int entry = L.tile_entries ? L.tile_entries[k] : k;
        const int n0 = (L.tile_entries ? entry & TILE_INDEX_MASK : entry) * BLOCK_N;
        return n0 >= inner_lo && n0 + BLOCK_N <= inner_hi && !(L.tile_entries && (entry & TILE_PARTIAL));
    };

    // K or V rows n0.. into `tile` (`aligned` and `inside`: constants in
    // each copy of the loops below; k0 + n0 >= 0: its unsigned widening
    // costs no sign).
    auto stream = [&](storage_t* tile, const storage_t* src, int n0, bool inside, bool aligned) {
        stream_rows<BLOCK_N, WARPS * 32>(tile, src, (unsigned)(k0 + n0), p.seqlen_k - n0, p.heads_kv, hk, p.d,
                                         aligned, inside);
    };
    load_rows(q_s, ROWS, q, b, m0, p.seqlen_q, p.heads_q, h, p.d);
    if (tiles > 0)
        load_rows(k_s, BLOCK_N, from_row(k, seq.k0, p.heads_kv, p.d), b, start(0), p.seqlen_k, p.heads_kv, hk, p.d);
    cp_async_commit();
    if (p.scale < 0.0f) {
        // scale · q · k = |scale| · (-q) · k: the max of raw dots is then the max of scores.
        cp_async_wait<0>();
        __syncthreads();
        for (int e = threadIdx.x; e < ROWS * ROW; e += blockDim.x) q_s[e] = store_f32(-load_f32(q_s[e]));
        p.scale = -p.scale;
    }
    const float sl2 = p.scale * LOG2E;

    float acc[RT][HEAD_DIM / 8][4];
#pragma unroll
    for (int mi = 0; mi < RT; ++mi)
#pragma unroll
        for (int c = 0; c < HEAD_DIM / 8; ++c) acc[mi][c][0] = acc[mi][c][1] = acc[mi][c][2] = acc[mi][c][3] = 0.0f;
    // Per row (mi, r): the running max of scores in log2 units, and the sum.
    float m[RT][2], l[RT][2];
#pragma unroll
    for (int mi = 0; mi < RT; ++mi)
#pragma unroll
        for (int r = 0; r < 2; ++r) m[mi][r] = NEG_INF, l[mi][r] = 0.0f;

    // One key tile, its first key n0 (start(tile), carried from the last
    // trip's prefetch); the next tile's first key is returned. `inner`:
    // every pair allowed, tested nowhere (every call passes a constant, and
    // the inlined copy keeps only its own branch).
    auto trip = [&](int tile, int n0, bool inner, bool aligned) {
        // Dropout's keep bits and a boundary tile's allowed pairs (the last
        // tile's were read before the last barrier): the mask tests by the
        // block together in a rolled loop, not unrolled over each lane's pairs.
        keep.fill(D, p.heads_q, seq.index, h, m0, n0);
        if (!inner) {
            const bool tested = partial(tile);
#pragma unroll 1
            for (int w = threadIdx.x; w < ROWS * BLOCK_N / 32; w += WARPS * 32) {
                const int i = m0 + w / (BLOCK_N / 32), j0 = n0 + w % (BLOCK_N / 32) * 32;
                unsigned word = 0;
#pragma unroll 1
                for (int x = 0; x < 32; ++x)
                    word |= (unsigned)(allowed(p, i, j0 + x) && (!tested || block_allows(L, seq, h, i, j0 + x)))
                            << x;
                allow_bits[w] = word;
            }
        }
        cp_async_wait<0>();
        __syncthreads();  // K of this tile landed, the keep bits are in; every warp is done with V
        stream(v_s, v, n0, inner, aligned);  // an interior tile's rows are all below seqlen_k
        cp_async_commit();

        const bool raw = inner && RAW_INTERIOR, voted = inner && ALIGNED;
        // S of every row tile at once where SHARED_K (each K fragment serves
        // them all), else of each before its softmax; then one row tile at a
        // time: its softmax, P packed.
        unsigned pa[RT][BLOCK_N / 16][4];
        float sr[RT][BLOCK_N / 8][4];
#pragma unroll
        for (int mi = 0; mi < RT; ++mi)
#pragma unroll
            for (int c = 0; c < BLOCK_N / 8; ++c) sr[mi][c][0] = sr[mi][c][1] = sr[mi][c][2] = sr[mi][c][3] = 0.0f;
        if (SHARED_K) mma_abt_rows<RT, BLOCK_N, HEAD_DIM>(sr, q_s + warp * RT * 16 * ROW, k_s);
#pragma unroll
        for (int mi = 0; mi < RT; ++mi) {
            float(&s)[BLOCK_N / 8][4] = sr[mi];
            if (!SHARED_K) mma_abt<BLOCK_N, HEAD_DIM>(s, q_s + (warp * RT + mi) * 16 * ROW, k_s);
            // This lane's allowed (and with dropout, kept) bits: row r's word
            // c / 4, from bit 2t; pair (c, e) is then bit 8 (c % 4) + e % 2.
            unsigned bits[2][BLOCK_N / 32], kept[2][BLOCK_N / 32];
#pragma unroll
            for (int r = 0; r < 2; ++r)
#pragma unroll
                for (int w = 0; w < BLOCK_N / 32; ++w) {
                    const int row = w0 + 16 * mi + 8 * r;
                    bits[r][w] = inner ? ~0u : allow_bits[row * (BLOCK_N / 32) + w] >> (2 * t);
#if HAS_DROPOUT
                    kept[r][w] = keep.word(row, w) >> (2 * t);
#else
                    kept[r][w] = ~0u;
#endif
                }
            if (voted) {
                // FA4's conditional rescale, with no max on the hot path: P is
                // taken against the reference m as it stands; only when some
                // lane's part of a row of the warp sums past RESCALE_LIMIT (or
                // to inf: a row's first keys, m = -inf) are the maxima taken,
                // O and l rescaled and P taken again, so that P <=
                // RESCALE_LIMIT. The unaligned copy, which does nothing fast,
                // keeps the plain step.
                if (!raw)
#pragma unroll
                    for (int c = 0; c < BLOCK_N / 8; ++c)
#pragma unroll
                        for (int e = 0; e < 4; ++e) {
                            float dcap;
                            s[c][e] = score(p, s[c][e], &dcap) * LOG2E;  // no ALiBi on an interior tile
                        }
                float ts[2];
                exp2_tile<RAW_INTERIOR>(pa[mi], ts, s, m[mi], sl2);
                if (__any_sync(0xffffffffu, !(ts[0] <= RESCALE_LIMIT && ts[1] <= RESCALE_LIMIT))) {
                    float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
                    for (int c = 0; c < BLOCK_N / 8; ++c)
#pragma unroll
                        for (int e = 0; e < 4; ++e) mx[e / 2] = fmaxf(mx[e / 2], s[c][e]);
                    float alpha[2];
#pragma unroll
                    for (int r = 0; r < 2; ++r) {
                        float ignored;
                        alpha[r] = online_step_log2<true>(raw ? mx[r] * sl2 : mx[r], m[mi][r], l[mi][r], &ignored);
                    }
#pragma unroll
                    for (int c = 0; c < HEAD_DIM / 8; ++c)
#pragma unroll
                        for (int e = 0; e < 4; ++e) acc[mi][c][e] *= alpha[e / 2];
                    exp2_tile<RAW_INTERIOR>(pa[mi], ts, s, m[mi], sl2);
                }
                l[mi][0] += ts[0];
                l[mi][1] += ts[1];
#if HAS_DROPOUT
                drop_pairs(pa[mi], kept);
#endif
                continue;
            }
            float mx[2] = {NEG_INF, NEG_INF};
#pragma unroll
            for (int c = 0; c < BLOCK_N / 8; ++c)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    float& x = s[c][e];  // raw: the dot product; else the score · log2 e, or -inf
                    if (!raw) {
                        float dcap;
                        const int i = r0 + 16 * mi + 8 * (e / 2), j = n0 + c * 8 + 2 * t + e % 2;
                        const bool ok = inner || (bits[e / 2][c / 4] >> (c % 4 * 8 + e % 2)) & 1u;
                        x = ok ? with_alibi(p, slope, score(p, x, &dcap), i, j) * LOG2E : NEG_INF;
                    }
                    mx[e / 2] = fmaxf(mx[e / 2], x);
                }
            float alpha[2], ms[2];
#pragma unroll
            for (int r = 0; r < 2; ++r)
                alpha[r] = inner ? online_step_log2<true>(raw ? mx[r] * sl2 : mx[r], m[mi][r], l[mi][r], &ms[r])
                                 : online_step_log2<false>(mx[r], m[mi][r], l[mi][r], &ms[r]);
#pragma unroll
            for (int c = 0; c < BLOCK_N / 8; ++c)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const float x = s[c][e];
                    const float pj = exp2_approx(raw ? fmaf(x, sl2, -ms[e / 2]) : x - ms[e / 2]);
                    l[mi][e / 2] += pj;  // the sums take P unrounded, as the scalar kernel's do
                    s[c][e] = dropped(pj, (kept[e / 2][c / 4] >> (c % 4 * 8 + e % 2)) & 1u);
                }
            pack_a<BLOCK_N>(pa[mi], s);
#pragma unroll
            for (int c = 0; c < HEAD_DIM / 8; ++c)
#pragma unroll
                for (int e = 0; e < 4; ++e) acc[mi][c][e] *= alpha[e / 2];
        }
        cp_async_wait<0>();
        __syncthreads();  // V landed; every warp is done with K
        // An interior tile's successor is interior too (the loops below
        // leave each run's last tile to the boundary trip): in the tensor.
        const bool more = inner || tile + 1 < tiles;
        const int next = more ? start(tile + 1) : 0;
        if (more) stream(k_s, k, next, inner, aligned);
        cp_async_commit();
        mma_pv_rows<RT, BLOCK_N, HEAD_DIM>(acc, pa, v_s);
        return next;
    };
    // Where the run of interior tiles from `tile` ends (`tile` itself, if
    // not interior): without a block list the steps are consecutive tiles,
    // and the run ends at the first past inner_hi; with one, the list is
    // read ahead (the interior loop then tests nothing per tile).
    auto interior_end = [&](int tile) {
        if (tile >= tiles || !interior(tile)) return tile;
        if (!L.tile_entries) return min(tiles, inner_hi / BLOCK_N - steps.first);
        int end = tile;
        while (end < tiles && interior(end)) ++end;
        return end;
    };
    // Interior tiles in a loop of their own, each prefetching the next
    // one's K as whole rows, but for the last of a run, which runs with
    // the boundary tiles (tested per pair), whose prefetch tests rows.
    auto run = [&](bool aligned) {
        int n0 = tiles > 0 ? start(0) : 0;
        for (int tile = 0; tile < tiles; ++tile) {
            for (const int end = interior_end(tile) - 1; tile < end; ++tile) n0 = trip(tile, n0, true, aligned);
            n0 = trip(tile, n0, false, aligned);
        }
    };
    run(ALIGNED);
    cp_async_wait<0>();

    // The sequence again (the loop then held none of what only the output needs).
    Problem pe = problem;
    const Seq se = enter_sequence(L, &pe, blockIdx.z);
    o = from_row(o, se.q0, pe.heads_q, pe.d);
#pragma unroll
    for (int mi = 0; mi < RT; ++mi)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = r0 + 16 * mi + 8 * r;
            const float sum = quad_sum(l[mi][r]);
            if (i >= pe.seqlen_q) continue;
            // A row with no allowed key: o = 0 and lse = -inf (or the sink), never NaN.
            float inv_l, row_lse;
            finish_row(m[mi][r] * LN2, sum, L.sinks ? L.sinks[h] : NEG_INF, &inv_l, &row_lse);
            inv_l = keep_scaled(D, inv_l);
            const size_t row = at(se.b, pe.seqlen_q, i, pe.heads_q, h, pe.d);
#pragma unroll
            for (int c = 0; c < HEAD_DIM / 8; ++c)
#pragma unroll
                for (int e = 0; e < 2; ++e) {
                    const int col = c * 8 + 2 * t + e;
                    if (col < pe.d) o[row + col] = store_f32(acc[mi][c][2 * r + e] * inv_l);
                }
            if (t == 0) lse[lse_at(se, h, i)] = row_lse;
        }
}

// Two entry points, each with its own registers: flash_fwd where d % 8 ==
// 0, flash_fwd_unaligned for the rest (src/cuda/forward.rs picks one).
#define FORWARD_UNALIGNED_ENTRY 1
#define FORWARD_ARGS                                                                                  \
    const storage_t *__restrict__ q, const storage_t *__restrict__ k, const storage_t *__restrict__ v, \
        storage_t *__restrict__ o, float *__restrict__ lse, const Problem p, const Layout L, const Dropout D
// The static tiles: dropout's keep bits, a boundary tile's allowed pairs
// (a bit each, row-major, 32 keys a word).
#define FORWARD_SHARED                            \
    DYNAMIC_SMEM(smem);                           \
    __shared__ KeepTile<BLOCK_M, BLOCK_N> keep;   \
    __shared__ unsigned allow_bits[BLOCK_M * BLOCK_N / 32]

// (A minimum of one block a multiprocessor: shared memory bounds the
// blocks anyway, and without it ptxas spills for occupancy.)
extern "C" __global__ void __launch_bounds__(WARPS * 32, 1) flash_fwd(FORWARD_ARGS) {
    FORWARD_SHARED;
    forward_rows<true, MT>(q, k, v, o, lse, p, L, D, smem, keep, allow_bits, blockIdx.x * BLOCK_M);
}

extern "C" __global__ void __launch_bounds__(WARPS * 32, 1) flash_fwd_unaligned(FORWARD_ARGS) {
    FORWARD_SHARED;
    for (int pass = 0; pass < MT; ++pass) {
        if (pass > 0) __syncthreads();  // the last pass is done with the tiles
        forward_rows<false, 1>(q, k, v, o, lse, p, L, D, smem, keep, allow_bits,
                               blockIdx.x * BLOCK_M + pass * 16 * WARPS);
    }
}

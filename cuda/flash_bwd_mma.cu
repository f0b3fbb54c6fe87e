// FlashAttention-2 backward on tensor cores (sm80+, f16/bf16 storage, f32
// accumulation), the same three kernels and order as flash_bwd.cu (D,
// then dK/dV, then dQ, with P and dP recomputed in both gradient kernels:
// no atomics, so a repeat is bit-identical by construction).
//
// Both gradient kernels: 4 warps; the block owns BLOCK_M = 64 rows of one
// side (keys for dK/dV, queries for dQ), 16 per warp, and streams tiles of
// BLOCK_N rows of the other side through two cp.async stages. Dynamic
// shared memory, in elements of ROW:
//
//   owned A [BLOCK_M][ROW], owned B [BLOCK_M][ROW] | stage 0: X [BLOCK_N][ROW], Y [BLOCK_N][ROW] | stage 1
//   | f32 rows: stage 0: LSE [BLOCK_N], D [BLOCK_N] | stage 1
//
//   flash_bwd_dkdv  A, B = K, V; X, Y = Q, dO of each (query head of the
//                   group, query tile) in order. S^T = K Q^T, dP^T = V dO^T
//                   (the warp's 16 keys x BLOCK_N queries), then
//                   dV += P^T dO, dK += dS^T Q from the same fragments.
//                   The step's queries' LSE and D come with Q and dO
//                   (f32 rows; dQ owns its rows' and leaves them unused).
//   flash_bwd_dq    A, B = Q, dO; X, Y = K, V. S = Q K^T, dP = dO V^T,
//                   dQ += dS K.
// P and dS are rounded to storage as the A operands, as the materialized
// baseline rounds them. Steps where every pair is allowed (the band covers
// them; no ALiBi, block-mask entry or dropout) run with no test per pair
// and take P in the exp2 form, one FFMA and ex2 against the row's
// lse · log2 e; the others test each pair and take expf.

#define WARPS 4
#define STAGE (2 * BLOCK_N * ROW)
static_assert(BLOCK_M == 16 * WARPS, "16 owned rows per warp");
static_assert(2 * BLOCK_N <= WARPS * 32, "a thread a row's LSE or D");
static_assert((2 * BLOCK_M + 2 * STAGE / ROW) * ROW * 2 + 2 * 2 * BLOCK_N * 4 == SMEM_BYTES,
              "src/cuda/kernel.rs launches with this layout's bytes");

__device__ __forceinline__ void zero_acc(float (&acc)[HEAD_DIM / 8][4]) {
#pragma unroll
    for (int c = 0; c < HEAD_DIM / 8; ++c) acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = 0.0f;
}

// P (dropped where not kept: dV's factor) and dS of query i against key j
// from the raw dot products s and dp (0 where the band masks the pair; a
// partial tile's block mask is applied after, by mask_pairs); in place.
// `slope` is ALiBi's (0 without).
__device__ __forceinline__ void p_and_ds(const Problem& p, const Dropout& D, bool kept, float slope, int i, int j,
                                         float lse_i, float delta_i, float* s, float* dp) {
    float pr = 0.0f, ds = 0.0f;
    if (allowed(p, i, j)) {
        float dcap;
        const float sc = with_alibi(p, slope, score(p, *s, &dcap), i, j);
        // lse = -inf: a row with no allowed key has no gradient (and exp would be inf).
        pr = lse_i == NEG_INF ? 0.0f : expf(sc - lse_i);
        ds = pr * (dropout_dp(D, *dp, kept) - delta_i) * dcap;
    }
    *s = dropped(pr, kept);
    *dp = ds;
}

// p_and_ds on a step with no test per pair (every pair allowed, no ALiBi
// or dropout): P in the exp2 form, one FFMA and ex2 (lse2 = lse · log2 e,
// +inf where P is 0: a row past seqlen_q or with no allowed key).
__device__ __forceinline__ void p_and_ds_inside(const Problem& p, float sl2, float lse2, float delta_i, float* s,
                                                float* dp) {
    float dcap;
#if HAS_SOFTCAP
    const float pr = exp2_approx(score(p, *s, &dcap) * LOG2E - lse2);
#else
    dcap = 1.0f;
    const float pr = exp2_approx(fmaf(*s, sl2, -lse2));
#endif
    *dp = pr * (*dp - delta_i) * dcap;
    *s = pr;
}

// A partial tile's block mask on P and dS (in a pass of its own, apart
// from the scores: the per-pair test then adds no registers to theirs).
// Element (c, e) of a lane is row row0 + 8 (e / 2) of the warp's tile
// against column col0 + c * 8 + 2 t + e % 2, as (query, key) or, for dK/dV,
// (key, query).
template <bool BY_KEYS>
__device__ __forceinline__ void mask_pairs(const Layout& L, const Seq& seq, int h, int row0, int col0,
                                           float (&s)[BLOCK_N / 8][4], float (&dp)[BLOCK_N / 8][4]) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int c = 0; c < BLOCK_N / 8; ++c)
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int r = row0 + 8 * (e / 2), x = col0 + c * 8 + 2 * t + e % 2;
            if (!block_allows(L, seq, h, BY_KEYS ? x : r, BY_KEYS ? r : x)) s[c][e] = dp[c][e] = 0.0f;
        }
}

// Accumulator rows [g, g + 8] of a 16 x HEAD_DIM warp tile to rows r0 and
// r0 + 8 of a (batch, seqlen, heads, d) tensor, times `factor`.
__device__ __forceinline__ void store_rows(storage_t* dst, const float (&acc)[HEAD_DIM / 8][4], int r0,
                                           int seqlen, int heads, int h, int b, int d, float factor) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = r0 + 8 * r;
        if (i >= seqlen) continue;
        const size_t row = at(b, seqlen, i, heads, h, d);
#pragma unroll
        for (int c = 0; c < HEAD_DIM / 8; ++c)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = c * 8 + 2 * t + e;
                if (col < d) dst[row + col] = store_f32(acc[c][2 * r + e] * factor);
            }
    }
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
flash_bwd_dkdv(const storage_t* __restrict__ q, const storage_t* __restrict__ k,
               const storage_t* __restrict__ v, const storage_t* __restrict__ d_o,
               const float* __restrict__ lse, const float* __restrict__ delta,
               storage_t* __restrict__ dk, storage_t* __restrict__ dv, Problem p, const Layout L,
               const Dropout D) {
    DYNAMIC_SMEM(smem);
    __shared__ KeepTile<BLOCK_N, BLOCK_M> keep;  // [query row][key]
    storage_t* k_s = (storage_t*)smem;
    storage_t* v_s = k_s + BLOCK_M * ROW;
    storage_t* stages = v_s + BLOCK_M * ROW;
    float* rows_s = (float*)(stages + 2 * STAGE);  // [stage][LSE, D][BLOCK_N]

    const int n0 = blockIdx.x * BLOCK_M, hk = blockIdx.y;
    const Seq seq = enter_sequence(L, &p, blockIdx.z);
    if (n0 >= p.seqlen_k) return;  // past a short sequence of a packed batch
    const int b = seq.b;
    q = from_row(q, seq.q0, p.heads_q, p.d);
    d_o = from_row(d_o, seq.q0, p.heads_q, p.d);
    k = from_row(k, seq.k0, p.heads_kv, p.d);
    v = from_row(v, seq.k0, p.heads_kv, p.d);
    dk = from_row(dk, seq.k0, p.heads_kv, p.d);
    dv = from_row(dv, seq.k0, p.heads_kv, p.d);
    const int group = p.heads_q / p.heads_kv;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
    const int j0 = n0 + warp * 16 + lane / 4;  // this lane's keys: j0 and j0 + 8

    int lo, hi;
    row_span(p, n0, min(n0 + BLOCK_M, p.seqlen_k), &lo, &hi);
    // (query head of the group, query tile) in order.
    const GroupSteps steps = group_steps(L, seq, hk, group, blockIdx.x, lo, hi, BLOCK_N);
    const int tiles = steps.count;
    auto fetch = [&](GroupAt pos) {
        storage_t* st = stages + (pos.k % 2) * STAGE;
        const int h = hk * group + group_step_head(L, steps, pos);
        const int m0 = group_step_start(L, steps, pos, BLOCK_N);
        const int left = p.seqlen_q - m0;
        stream_rows<BLOCK_N, WARPS * 32>(st, q, (unsigned)m0, left, p.heads_q, h, p.d, p.d % 8 == 0, false);
        stream_rows<BLOCK_N, WARPS * 32>(st + BLOCK_N * ROW, d_o, (unsigned)m0, left, p.heads_q, h, p.d,
                                         p.d % 8 == 0, false);
        // Zeros past seqlen_q.
        if (threadIdx.x < 2 * BLOCK_N) {
            const int r = threadIdx.x % BLOCK_N;
            const bool row = r < left;
            const float* from = threadIdx.x < BLOCK_N ? lse : delta;
            cp_async4(rows_s + (pos.k % 2) * 2 * BLOCK_N + threadIdx.x, row ? from + lse_at(seq, h, m0 + r) : from,
                      row ? 4 : 0);
        }
    };
    load_rows(k_s, BLOCK_M, k, b, n0, p.seqlen_k, p.heads_kv, hk, p.d);
    load_rows(v_s, BLOCK_M, v, b, n0, p.seqlen_k, p.heads_kv, hk, p.d);
    if (tiles > 0) fetch(group_begin());
    cp_async_commit();

    float dk_acc[HEAD_DIM / 8][4], dv_acc[HEAD_DIM / 8][4];
    zero_acc(dk_acc);
    zero_acc(dv_acc);
    const float sl2 = p.scale * LOG2E;
    for (GroupAt pos = group_begin(), next; pos.k < tiles; pos = next) {
        next = group_next(steps, pos);
        if (next.k < tiles) fetch(next);
        cp_async_commit();
        const storage_t* q_t = stages + (pos.k % 2) * STAGE;
        const storage_t* do_t = q_t + BLOCK_N * ROW;
        const float* lse_t = rows_s + (pos.k % 2) * 2 * BLOCK_N;
        const float* delta_t = lse_t + BLOCK_N;
        const int h = hk * group + group_step_head(L, steps, pos);
        const int m0 = group_step_start(L, steps, pos, BLOCK_N);
        const bool partial = group_step_partial(L, steps, pos);
        // Dropout's keep bits while the copies fly (without it, nothing).
        keep.fill(D, p.heads_q, seq.index, h, m0, n0);
        cp_async_wait<1>();
        __syncthreads();
        const float slope = alibi_slope(L, seq, h);
        // No test per pair: no dropout, ALiBi or partial block, and the band
        // allowing every pair of the step's queries (up to seqlen_q: past it
        // Q and dO are zero rows, so P = 1 adds nothing to dV and dS is 0)
        // and the block's keys (up to seqlen_k: past it nothing is written).
        const bool in = !HAS_DROPOUT && !L.alibi && !partial &&
                        band_covers(p, m0, min(m0 + BLOCK_N, p.seqlen_q) - 1, n0, min(n0 + BLOCK_M, p.seqlen_k) - 1);

        float s[BLOCK_N / 8][4], dp[BLOCK_N / 8][4];
#pragma unroll
        for (int c = 0; c < BLOCK_N / 8; ++c)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[c][e] = dp[c][e] = 0.0f;
        mma_abt<BLOCK_N, HEAD_DIM>(s, k_s + warp * 16 * ROW, q_t);
        mma_abt<BLOCK_N, HEAD_DIM>(dp, v_s + warp * 16 * ROW, do_t);
        if (in) {
            // Element (c, e): query m0 + 8 c + 2 t + e % 2, key j0 + 8 (e / 2);
            // each query's LSE and D read once (finite: the query has a key).
#pragma unroll
            for (int c = 0; c < BLOCK_N / 8; ++c)
#pragma unroll
                for (int x = 0; x < 2; ++x) {
                    const int i = c * 8 + 2 * t + x;
#pragma unroll
                    for (int r = 0; r < 2; ++r)
                        p_and_ds_inside(p, sl2, lse_t[i] * LOG2E, delta_t[i], &s[c][2 * r + x], &dp[c][2 * r + x]);
                }
        } else {
#pragma unroll
            for (int c = 0; c < BLOCK_N / 8; ++c)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int x = c * 8 + 2 * t + e % 2, i = m0 + x;
                    const bool row = i < p.seqlen_q;
                    const bool kept = KEPT(keep, x, j0 + 8 * (e / 2) - n0);
                    p_and_ds(p, D, kept, slope, i, j0 + 8 * (e / 2), row ? lse_t[x] : NEG_INF, delta_t[x],
                             &s[c][e], &dp[c][e]);
                }
            if (partial) mask_pairs<true>(L, seq, h, j0, m0, s, dp);
        }
        mma_pv<BLOCK_N, HEAD_DIM>(dv_acc, s, do_t);
        mma_pv<BLOCK_N, HEAD_DIM>(dk_acc, dp, q_t);
        __syncthreads();  // the next iteration refills this stage
    }
    cp_async_wait<0>();
    store_rows(dk, dk_acc, j0, p.seqlen_k, p.heads_kv, hk, b, p.d, p.scale);
    store_rows(dv, dv_acc, j0, p.seqlen_k, p.heads_kv, hk, b, p.d, keep_scaled(D, 1.0f));
}

// (A minimum of one block a multiprocessor, as the forward has: without it
// ptxas held dQ to 168 registers and spilled; shared memory bounds the
// blocks anyway, two on A100 from d 64 on.)
extern "C" __global__ void __launch_bounds__(WARPS * 32, 1)
flash_bwd_dq(const storage_t* __restrict__ q, const storage_t* __restrict__ k,
             const storage_t* __restrict__ v, const storage_t* __restrict__ d_o,
             const float* __restrict__ lse, const float* __restrict__ delta,
             storage_t* __restrict__ dq, Problem p, const Layout L, const Dropout D) {
    DYNAMIC_SMEM(smem);
    __shared__ KeepTile<BLOCK_M, BLOCK_N> keep;
    storage_t* q_s = (storage_t*)smem;
    storage_t* do_s = q_s + BLOCK_M * ROW;
    storage_t* stages = do_s + BLOCK_M * ROW;

    const int m0 = blockIdx.x * BLOCK_M, h = blockIdx.y;
    const Seq seq = enter_sequence(L, &p, blockIdx.z);
    if (m0 >= p.seqlen_q) return;  // past a short sequence of a packed batch
    const int b = seq.b;
    q = from_row(q, seq.q0, p.heads_q, p.d);
    d_o = from_row(d_o, seq.q0, p.heads_q, p.d);
    dq = from_row(dq, seq.q0, p.heads_q, p.d);
    // K and V rows are found from the arguments by the sequence's first row
    // each time, as the forward finds them (two pointers held through the
    // loop spilled).
    const unsigned k0 = (unsigned)seq.k0;
    const int hk = h / (p.heads_q / p.heads_kv);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
    const int r0 = m0 + warp * 16 + lane / 4;  // this lane's rows: r0 and r0 + 8
    const float slope = alibi_slope(L, seq, h);
    float lse_r[2], delta_r[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = r0 + 8 * r;
        const size_t e = lse_at(seq, h, i);
        lse_r[r] = i < p.seqlen_q ? lse[e] : NEG_INF;
        delta_r[r] = i < p.seqlen_q ? delta[e] : 0.0f;
    }

    int lo, hi;
    key_span(p, m0, min(m0 + BLOCK_M, p.seqlen_q), &lo, &hi);
    const Steps steps = tile_steps(L, seq, h, blockIdx.x, lo, hi, BLOCK_N);
    const int tiles = steps.count;
    auto fetch = [&](int tile) {
        storage_t* st = stages + (tile % 2) * STAGE;
        const int n0 = step_start(L, steps, tile, BLOCK_N);
        const int left = p.seqlen_k - n0;
        stream_rows<BLOCK_N, WARPS * 32>(st, k, k0 + n0, left, p.heads_kv, hk, p.d, p.d % 8 == 0, false);
        stream_rows<BLOCK_N, WARPS * 32>(st + BLOCK_N * ROW, v, k0 + n0, left, p.heads_kv, hk, p.d, p.d % 8 == 0,
                                         false);
    };
    load_rows(q_s, BLOCK_M, q, b, m0, p.seqlen_q, p.heads_q, h, p.d);
    load_rows(do_s, BLOCK_M, d_o, b, m0, p.seqlen_q, p.heads_q, h, p.d);
    if (tiles > 0) fetch(0);
    cp_async_commit();

    float dq_acc[HEAD_DIM / 8][4];
    zero_acc(dq_acc);
    const float sl2 = p.scale * LOG2E;
    const float lse2_r[2] = {lse_log2(lse_r[0]), lse_log2(lse_r[1])};
    const int last_row = min(m0 + BLOCK_M, p.seqlen_q) - 1;
    for (int tile = 0; tile < tiles; ++tile) {
        if (tile + 1 < tiles) fetch(tile + 1);
        cp_async_commit();
        keep.fill(D, p.heads_q, seq.index, h, m0, step_start(L, steps, tile, BLOCK_N));  // while the copies fly
        cp_async_wait<1>();
        __syncthreads();
        const storage_t* k_t = stages + (tile % 2) * STAGE;
        const int n0 = step_start(L, steps, tile, BLOCK_N);
        const bool partial = step_partial(L, steps, tile);
        // No test per pair: no dropout, ALiBi or partial block, the step's
        // keys inside seqlen_k, and the band allowing every pair of them and
        // the block's queries (up to seqlen_q: past it the LSE makes P 0).
        const bool in = !HAS_DROPOUT && !L.alibi && !partial && n0 + BLOCK_N <= p.seqlen_k &&
                        band_covers(p, m0, last_row, n0, n0 + BLOCK_N - 1);

        float s[BLOCK_N / 8][4], dp[BLOCK_N / 8][4];
#pragma unroll
        for (int c = 0; c < BLOCK_N / 8; ++c)
#pragma unroll
            for (int e = 0; e < 4; ++e) s[c][e] = dp[c][e] = 0.0f;
        mma_abt<BLOCK_N, HEAD_DIM>(s, q_s + warp * 16 * ROW, k_t);
        mma_abt<BLOCK_N, HEAD_DIM>(dp, do_s + warp * 16 * ROW, k_t + BLOCK_N * ROW);
        if (in) {
#pragma unroll
            for (int c = 0; c < BLOCK_N / 8; ++c)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    p_and_ds_inside(p, sl2, lse2_r[e / 2], delta_r[e / 2], &s[c][e], &dp[c][e]);
        } else {
#pragma unroll
            for (int c = 0; c < BLOCK_N / 8; ++c)
#pragma unroll
                for (int e = 0; e < 4; ++e)
                    p_and_ds(p, D, KEPT(keep, r0 + 8 * (e / 2) - m0, c * 8 + 2 * t + e % 2), slope,
                             r0 + 8 * (e / 2), n0 + c * 8 + 2 * t + e % 2, lse_r[e / 2], delta_r[e / 2], &s[c][e],
                             &dp[c][e]);
            if (partial) mask_pairs<false>(L, seq, h, r0, n0, s, dp);
        }
        mma_pv<BLOCK_N, HEAD_DIM>(dq_acc, dp, k_t);
        __syncthreads();
    }
    cp_async_wait<0>();
    store_rows(dq, dq_acc, r0, p.seqlen_q, p.heads_q, h, b, p.d, p.scale);
}

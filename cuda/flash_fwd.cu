// FlashAttention-2 forward. One thread block per (query block, query head,
// batch entry); K/V blocks stream through shared memory with an online
// softmax (running max m and sum l, rescaled per block, normalized once).
//
// Threads: BLOCK_M rows x THREADS_PER_ROW lanes (a power of two, so a row's
// lanes are adjacent in one warp and reduce by shuffles). Lane l of a row
// computes the scores of keys l, l + THREADS_PER_ROW, ... and owns output
// columns l, l + THREADS_PER_ROW, ... (COLS of them) in registers.

#define COLS (HEAD_DIM / THREADS_PER_ROW)
#define KEYS_PER_LANE ((BLOCK_N + THREADS_PER_ROW - 1) / THREADS_PER_ROW)
#define PAD (HEAD_DIM + 1)

__device__ __forceinline__ float row_max(float x) {
#pragma unroll
    for (int w = THREADS_PER_ROW / 2; w > 0; w /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, w));
    return x;
}

__device__ __forceinline__ float row_sum(float x) {
#pragma unroll
    for (int w = THREADS_PER_ROW / 2; w > 0; w /= 2) x += __shfl_xor_sync(0xffffffffu, x, w);
    return x;
}

// With dropout, a minimum of 4 blocks per SM (at most 128 registers a
// thread): left to itself, sm_90's ptxas caps this kernel at 80 registers,
// and the Philox rounds beside the accumulators spill at d 64.
#if HAS_DROPOUT
#define FORWARD_BOUNDS __launch_bounds__(BLOCK_M * THREADS_PER_ROW, 4)
#else
#define FORWARD_BOUNDS __launch_bounds__(BLOCK_M * THREADS_PER_ROW)
#endif

extern "C" __global__ void FORWARD_BOUNDS
flash_fwd(const storage_t* __restrict__ q, const storage_t* __restrict__ k,
          const storage_t* __restrict__ v, storage_t* __restrict__ o, float* __restrict__ lse,
          Problem p, const Layout L, const Dropout D) {
    __shared__ float q_tile[BLOCK_M * PAD];
    // K, then V of the same block (one buffer: a block needs them in turn).
    __shared__ float kv_tile[BLOCK_N * PAD];
    __shared__ float p_tile[BLOCK_M * BLOCK_N];
    __shared__ KeepTile<BLOCK_M, BLOCK_N> keep;

    const int m0 = blockIdx.x * BLOCK_M, h = blockIdx.y;
    const Seq seq = enter_sequence(L, &p, blockIdx.z);
    if (m0 >= p.seqlen_q) return;  // past a short sequence of a packed batch
    const int b = seq.b;
    q = from_row(q, seq.q0, p.heads_q, p.d);
    o = from_row(o, seq.q0, p.heads_q, p.d);
    k = from_row(k, seq.k0, p.heads_kv, p.d);
    v = from_row(v, seq.k0, p.heads_kv, p.d);
    const int hk = h / (p.heads_q / p.heads_kv);
    const float slope = alibi_slope(L, seq, h);
    const int r = threadIdx.x / THREADS_PER_ROW, lane = threadIdx.x % THREADS_PER_ROW;
    const int i = m0 + r;

    load_tile(q_tile, BLOCK_M, q, b, m0, p.seqlen_q, p.heads_q, h, p.d);

    float acc[COLS];
#pragma unroll
    for (int c = 0; c < COLS; ++c) acc[c] = 0.0f;
    float m = NEG_INF, l = 0.0f;

    int lo, hi;
    key_span(p, m0, min(m0 + BLOCK_M, p.seqlen_q), &lo, &hi);
    const Steps steps = tile_steps(L, seq, h, blockIdx.x, lo, hi, BLOCK_N);
    for (int step = 0; step < steps.count; ++step) {
        const int n0 = step_start(L, steps, step, BLOCK_N);
        const bool partial = step_partial(L, steps, step);
        __syncthreads();  // the previous block's V is no longer read
        load_tile(kv_tile, BLOCK_N, k, b, n0, p.seqlen_k, p.heads_kv, hk, p.d);
        keep.fill(D, p.heads_q, seq.index, h, m0, n0);
        __syncthreads();

        float s[KEYS_PER_LANE];
        float block_max = NEG_INF;
#pragma unroll
        for (int t = 0; t < KEYS_PER_LANE; ++t) {
            const int jj = lane + t * THREADS_PER_ROW;
            s[t] = NEG_INF;
            const int j = n0 + jj;
            if (jj < BLOCK_N && allowed(p, i, j) && (!partial || block_allows(L, seq, h, i, j))) {
                float dcap;
                s[t] = score(p, dot_rows(&q_tile[r * PAD], &kv_tile[jj * PAD]), &dcap);
                s[t] = with_alibi(p, slope, s[t], i, j);
            }
            block_max = fmaxf(block_max, s[t]);
        }
        const float m_new = fmaxf(m, row_max(block_max));
        // Rows that have seen no allowed key yet keep m = -inf and add nothing.
        const float alpha = m_new == NEG_INF ? 1.0f : expf(m - m_new);
        float sum = 0.0f;
#pragma unroll
        for (int t = 0; t < KEYS_PER_LANE; ++t) {
            const int jj = lane + t * THREADS_PER_ROW;
            const float pj = s[t] == NEG_INF ? 0.0f : expf(s[t] - m_new);
            sum += pj;  // the sums take P unrounded, as the CPU backend's do
            if (jj < BLOCK_N) p_tile[r * BLOCK_N + jj] = round_storage(dropped(pj, KEPT(keep, r, jj)));
        }
        l = l * alpha + row_sum(sum);
        m = m_new;

        __syncthreads();  // K read by every row; P written
        load_tile(kv_tile, BLOCK_N, v, b, n0, p.seqlen_k, p.heads_kv, hk, p.d);
        __syncthreads();
#pragma unroll
        for (int c = 0; c < COLS; ++c) acc[c] *= alpha;
        for (int jj = 0; jj < BLOCK_N; ++jj) {
            const float pj = p_tile[r * BLOCK_N + jj];
#pragma unroll
            for (int c = 0; c < COLS; ++c)
                acc[c] = fmaf(pj, kv_tile[jj * PAD + lane + c * THREADS_PER_ROW], acc[c]);
        }
    }

    if (i >= p.seqlen_q) return;
    // A row with no allowed key: o = 0 and lse = -inf (or the sink), never NaN.
    float inv_l, row_lse;
    finish_row(m, l, L.sinks ? L.sinks[h] : NEG_INF, &inv_l, &row_lse);
    inv_l = keep_scaled(D, inv_l);
    const size_t row = at(b, p.seqlen_q, i, p.heads_q, h, p.d);
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
        const int col = lane + c * THREADS_PER_ROW;
        if (col < p.d) o[row + col] = store_f32(acc[c] * inv_l);
    }
    if (lane == 0) lse[lse_at(seq, h, i)] = row_lse;
}

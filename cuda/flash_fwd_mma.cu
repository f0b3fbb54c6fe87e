// FlashAttention-2 forward on tensor cores (sm80+, f16/bf16 storage, f32
// accumulation): one block of 4 warps per (BLOCK_M = 64 query rows, query
// head, batch entry), each warp owning 16 rows; key tiles of BLOCK_N keys
// stream through two cp.async stages (tile j + 1 loads while tile j is
// computed). Dynamic shared memory, in elements of ROW:
//
//   Q [BLOCK_M][ROW] | stage 0: K [BLOCK_N][ROW], V [BLOCK_N][ROW] | stage 1: K, V
//
// S = Q K^T and O += P V are mma.sync m16n8k16 on ldmatrix fragments; the
// online softmax runs on S's accumulator fragments (a row lives in one
// quad: max and sum by two shuffles), P is rounded to storage as the A
// operand of P V, and each lane keeps its partial row sum until the end.

#define WARPS 4
#define STAGE (2 * BLOCK_N * ROW)
static_assert(BLOCK_M == 16 * WARPS, "16 rows per warp");
static_assert((BLOCK_M + 2 * STAGE / ROW) * ROW * 2 == SMEM_BYTES,
              "src/cuda/kernel.rs launches with this layout's bytes");

extern "C" __global__ void __launch_bounds__(WARPS * 32)
flash_fwd(const storage_t* __restrict__ q, const storage_t* __restrict__ k,
          const storage_t* __restrict__ v, storage_t* __restrict__ o, float* __restrict__ lse,
          Problem p, const Layout L, const Dropout D) {
    DYNAMIC_SMEM(smem);
    __shared__ KeepTile<BLOCK_M, BLOCK_N> keep;
    storage_t* q_s = (storage_t*)smem;
    storage_t* kv_s = q_s + BLOCK_M * ROW;

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
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, t = lane % 4;
    const int r0 = m0 + warp * 16 + lane / 4;  // this lane's rows: r0 and r0 + 8

    int lo, hi;
    key_span(p, m0, min(m0 + BLOCK_M, p.seqlen_q), &lo, &hi);
    const Steps steps = tile_steps(L, seq, h, blockIdx.x, lo, hi, BLOCK_N);
    const int tiles = steps.count;
    auto fetch = [&](int tile) {
        storage_t* st = kv_s + (tile % 2) * STAGE;
        const int n0 = step_start(L, steps, tile, BLOCK_N);
        load_rows(st, BLOCK_N, k, b, n0, p.seqlen_k, p.heads_kv, hk, p.d);
        load_rows(st + BLOCK_N * ROW, BLOCK_N, v, b, n0, p.seqlen_k, p.heads_kv, hk, p.d);
    };
    load_rows(q_s, BLOCK_M, q, b, m0, p.seqlen_q, p.heads_q, h, p.d);
    if (tiles > 0) fetch(0);
    cp_async_commit();

    float acc[HEAD_DIM / 8][4];
#pragma unroll
    for (int c = 0; c < HEAD_DIM / 8; ++c) acc[c][0] = acc[c][1] = acc[c][2] = acc[c][3] = 0.0f;
    float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f};

    for (int tile = 0; tile < tiles; ++tile) {
        if (tile + 1 < tiles) fetch(tile + 1);
        cp_async_commit();
        // Dropout's keep bits while the copies fly (without it, nothing:
        // the tile's start is read after the barrier, as it always was).
        keep.fill(D, p.heads_q, seq.index, h, m0, step_start(L, steps, tile, BLOCK_N));
        cp_async_wait<1>();  // this tile's group (and Q's) landed
        __syncthreads();
        const storage_t* k_s = kv_s + (tile % 2) * STAGE;
        const int n0 = step_start(L, steps, tile, BLOCK_N);
        const bool partial = step_partial(L, steps, tile);

        float s[BLOCK_N / 8][4];
#pragma unroll
        for (int c = 0; c < BLOCK_N / 8; ++c) s[c][0] = s[c][1] = s[c][2] = s[c][3] = 0.0f;
        mma_abt<BLOCK_N, HEAD_DIM>(s, q_s + warp * 16 * ROW, k_s);

        float mx[2] = {m[0], m[1]};
#pragma unroll
        for (int c = 0; c < BLOCK_N / 8; ++c)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                float dcap;
                const int i = r0 + 8 * (e / 2), j = n0 + c * 8 + 2 * t + e % 2;
                s[c][e] = allowed(p, i, j) && (!partial || block_allows(L, seq, h, i, j))
                              ? with_alibi(p, slope, score(p, s[c][e], &dcap), i, j)
                              : NEG_INF;
                mx[e / 2] = fmaxf(mx[e / 2], s[c][e]);
            }
        float alpha[2];
        online_max(mx, m, l, alpha);
#pragma unroll
        for (int c = 0; c < BLOCK_N / 8; ++c)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const float pj = s[c][e] == NEG_INF ? 0.0f : expf(s[c][e] - m[e / 2]);
                l[e / 2] += pj;  // the sums take P unrounded, as the scalar kernel's do
                s[c][e] = dropped(pj, KEPT(keep, warp * 16 + lane / 4 + 8 * (e / 2), c * 8 + 2 * t + e % 2));
            }
#pragma unroll
        for (int c = 0; c < HEAD_DIM / 8; ++c)
#pragma unroll
            for (int e = 0; e < 4; ++e) acc[c][e] *= alpha[e / 2];
        mma_pv<BLOCK_N, HEAD_DIM>(acc, s, k_s + BLOCK_N * ROW);
        __syncthreads();  // the next iteration refills this stage
    }
    cp_async_wait<0>();

#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int i = r0 + 8 * r;
        const float sum = quad_sum(l[r]);
        if (i >= p.seqlen_q) continue;
        // A row with no allowed key: o = 0 and lse = -inf (or the sink), never NaN.
        float inv_l, row_lse;
        finish_row(m[r], sum, L.sinks ? L.sinks[h] : NEG_INF, &inv_l, &row_lse);
        inv_l = keep_scaled(D, inv_l);
        const size_t row = at(b, p.seqlen_q, i, p.heads_q, h, p.d);
#pragma unroll
        for (int c = 0; c < HEAD_DIM / 8; ++c)
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int col = c * 8 + 2 * t + e;
                if (col < p.d) o[row + col] = store_f32(acc[c][2 * r + e] * inv_l);
            }
        if (t == 0) lse[lse_at(seq, h, i)] = row_lse;
    }
}

// FlashAttention-2 backward, recomputing P from the forward's LSE, in three
// kernels with no float atomics, so gradients are bit-identical on repeat:
//
//   flash_bwd_dot   D = rowsum(dO * O), f32, (batch, heads_q, seqlen_q):
//                   cuda/bwd_dot.cuh, shared with flash_bwd_mma.cu
//   flash_bwd_dkdv  one block per (key block, kv head, batch entry): dK, dV
//                   summed over every query head of the kv head's group
//                   (GQA) and every query block that sees the keys, in order
//   flash_bwd_dq    one block per (query block, query head, batch entry):
//                   dQ over the key blocks its rows see (P and dP are
//                   recomputed: FA2 adds dQ with atomics instead, which is
//                   not deterministic)
//
// Both gradient kernels use BLOCK rows x BLOCK keys tiles and BLOCK x
// THREADS_PER_ROW threads; lane l owns columns l, l + THREADS_PER_ROW, ....
// P and dS are rounded to the storage precision before the products that
// use them, as the materialized baseline does.

#define COLS (HEAD_DIM / THREADS_PER_ROW)
#define PER_LANE ((BLOCK + THREADS_PER_ROW - 1) / THREADS_PER_ROW)
#define PAD (HEAD_DIM + 1)

// The four (BLOCK x PAD) f32 tiles a, b, c, d: static shared memory up to
// d 256; at the wide head dims (src/cuda/kernel.rs: 8 x 8 tiles, whole
// groups of 8 keys for dropout's keep bits, 72 KiB at d 576) the launch's
// dynamic shared memory, opted in past 48 KiB.
#if SMEM_BYTES > 0
static_assert(4 * BLOCK * PAD * 4 == SMEM_BYTES, "the four tiles are the dynamic shared memory");
#define BWD_TILES(a, b, c, d)                 \
    DYNAMIC_SMEM(tiles_raw);                  \
    float* const a = (float*)tiles_raw;       \
    float* const b = a + BLOCK * PAD;         \
    float* const c = b + BLOCK * PAD;         \
    float* const d = c + BLOCK * PAD
#else
#define BWD_TILES(a, b, c, d)            \
    __shared__ float a[BLOCK * PAD];     \
    __shared__ float b[BLOCK * PAD];     \
    __shared__ float c[BLOCK * PAD];     \
    __shared__ float d[BLOCK * PAD]
#endif

// The wide variants fit at most 3 blocks an SM by their shared memory; the
// launch bound's 1 block lets ptxas take the registers they need (left to
// itself it aimed the sm_80 d 384 dK/dV at 64 registers and spilled).
#if SMEM_BYTES > 0
#define BWD_BOUNDS __launch_bounds__(BLOCK * THREADS_PER_ROW, 1)
#else
#define BWD_BOUNDS __launch_bounds__(BLOCK * THREADS_PER_ROW)
#endif

// P (dropped where not kept: dV's factor) and dS of query row i against
// key j (already known to be allowed); `slope` is ALiBi's (0 without).
__device__ __forceinline__ void p_and_ds(const Problem& p, const Dropout& D, bool kept, float slope, int i, int j,
                                         const float* q_row, const float* k_row, const float* do_row,
                                         const float* v_row, float lse_i, float delta_i, float* p_ij, float* ds_ij) {
    float dcap;
    const float s = with_alibi(p, slope, score(p, dot_rows(q_row, k_row), &dcap), i, j);
    // lse = -inf: a row with no allowed key has no gradient (and exp would be inf).
    const float pr = lse_i == NEG_INF ? 0.0f : expf(s - lse_i);
    const float dp = dropout_dp(D, dot_rows(do_row, v_row), kept);
    *p_ij = round_storage(dropped(pr, kept));
    // dS w.r.t. the raw scaled score: the softcap's derivative included.
    *ds_ij = round_storage(pr * (dp - delta_i) * dcap);
}

extern "C" __global__ void BWD_BOUNDS
flash_bwd_dkdv(const storage_t* __restrict__ q, const storage_t* __restrict__ k,
               const storage_t* __restrict__ v, const storage_t* __restrict__ d_o,
               const float* __restrict__ lse, const float* __restrict__ delta,
               storage_t* __restrict__ dk, storage_t* __restrict__ dv, Problem p, const Layout L,
               const Dropout D) {
    BWD_TILES(k_tile, v_tile, q_tile, do_tile);
    // Transposed: [key][row], so a key's lanes sum along their own row.
    __shared__ float p_t[BLOCK * BLOCK];
    __shared__ float ds_t[BLOCK * BLOCK];
    __shared__ float lse_tile[BLOCK];
    __shared__ float delta_tile[BLOCK];
    __shared__ KeepTile<BLOCK, BLOCK> keep;  // [query row][key]

    const int n0 = blockIdx.x * BLOCK, hk = blockIdx.y;
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
    const int jj = threadIdx.x / THREADS_PER_ROW, lane = threadIdx.x % THREADS_PER_ROW;
    const int j = n0 + jj;

    load_tile(k_tile, BLOCK, k, b, n0, p.seqlen_k, p.heads_kv, hk, p.d);
    load_tile(v_tile, BLOCK, v, b, n0, p.seqlen_k, p.heads_kv, hk, p.d);

    float dk_acc[COLS], dv_acc[COLS];
#pragma unroll
    for (int c = 0; c < COLS; ++c) dk_acc[c] = dv_acc[c] = 0.0f;

    int lo, hi;
    row_span(p, n0, min(n0 + BLOCK, p.seqlen_k), &lo, &hi);
    // (query head of the group, query tile) in order.
    const GroupSteps steps = group_steps(L, seq, hk, group, blockIdx.x, lo, hi, BLOCK);
    for (GroupAt pos = group_begin(); pos.k < steps.count; pos = group_next(steps, pos)) {
        const int h = hk * group + group_step_head(L, steps, pos);
        const int m0 = group_step_start(L, steps, pos, BLOCK);
        const bool partial = group_step_partial(L, steps, pos);
        const float slope = alibi_slope(L, seq, h);
        __syncthreads();  // the previous tiles are no longer read
        load_tile(q_tile, BLOCK, q, b, m0, p.seqlen_q, p.heads_q, h, p.d);
        load_tile(do_tile, BLOCK, d_o, b, m0, p.seqlen_q, p.heads_q, h, p.d);
        for (int r = threadIdx.x; r < BLOCK; r += blockDim.x) {
            const int i = m0 + r;
            const size_t e = lse_at(seq, h, i);
            lse_tile[r] = i < p.seqlen_q ? lse[e] : NEG_INF;
            delta_tile[r] = i < p.seqlen_q ? delta[e] : 0.0f;
        }
        keep.fill(D, p.heads_q, seq.index, h, m0, n0);
        __syncthreads();
#pragma unroll
        for (int t = 0; t < PER_LANE; ++t) {
            const int r = lane + t * THREADS_PER_ROW;
            if (r >= BLOCK) break;
            float pr = 0.0f, ds = 0.0f;
            const int i = m0 + r;
            if (allowed(p, i, j) && (!partial || block_allows(L, seq, h, i, j)))
                p_and_ds(p, D, KEPT(keep, r, jj), slope, i, j, &q_tile[r * PAD], &k_tile[jj * PAD],
                         &do_tile[r * PAD], &v_tile[jj * PAD], lse_tile[r], delta_tile[r], &pr, &ds);
            p_t[jj * BLOCK + r] = pr;
            ds_t[jj * BLOCK + r] = ds;
        }
        __syncthreads();
        for (int r = 0; r < BLOCK; ++r) {
            const float pr = p_t[jj * BLOCK + r], ds = ds_t[jj * BLOCK + r];
#pragma unroll
            for (int c = 0; c < COLS; ++c) {
                const int col = lane + c * THREADS_PER_ROW;
                dv_acc[c] = fmaf(pr, do_tile[r * PAD + col], dv_acc[c]);
                dk_acc[c] = fmaf(ds, q_tile[r * PAD + col], dk_acc[c]);
            }
        }
    }

    if (j >= p.seqlen_k) return;
    const size_t row = at(b, p.seqlen_k, j, p.heads_kv, hk, p.d);
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
        const int col = lane + c * THREADS_PER_ROW;
        if (col < p.d) {
            dk[row + col] = store_f32(dk_acc[c] * p.scale);
            dv[row + col] = store_f32(keep_scaled(D, dv_acc[c]));
        }
    }
}

extern "C" __global__ void BWD_BOUNDS
flash_bwd_dq(const storage_t* __restrict__ q, const storage_t* __restrict__ k,
             const storage_t* __restrict__ v, const storage_t* __restrict__ d_o,
             const float* __restrict__ lse, const float* __restrict__ delta,
             storage_t* __restrict__ dq, Problem p, const Layout L, const Dropout D) {
    BWD_TILES(q_tile, do_tile, k_tile, v_tile);
    __shared__ float ds_tile[BLOCK * BLOCK];
    __shared__ KeepTile<BLOCK, BLOCK> keep;

    const int m0 = blockIdx.x * BLOCK, h = blockIdx.y;
    const Seq seq = enter_sequence(L, &p, blockIdx.z);
    if (m0 >= p.seqlen_q) return;  // past a short sequence of a packed batch
    const int b = seq.b;
    q = from_row(q, seq.q0, p.heads_q, p.d);
    d_o = from_row(d_o, seq.q0, p.heads_q, p.d);
    dq = from_row(dq, seq.q0, p.heads_q, p.d);
    k = from_row(k, seq.k0, p.heads_kv, p.d);
    v = from_row(v, seq.k0, p.heads_kv, p.d);
    const int hk = h / (p.heads_q / p.heads_kv);
    const int r = threadIdx.x / THREADS_PER_ROW, lane = threadIdx.x % THREADS_PER_ROW;
    const int i = m0 + r;
    const float slope = alibi_slope(L, seq, h);

    load_tile(q_tile, BLOCK, q, b, m0, p.seqlen_q, p.heads_q, h, p.d);
    load_tile(do_tile, BLOCK, d_o, b, m0, p.seqlen_q, p.heads_q, h, p.d);
    const size_t e = lse_at(seq, h, i);
    const float lse_i = i < p.seqlen_q ? lse[e] : NEG_INF;
    const float delta_i = i < p.seqlen_q ? delta[e] : 0.0f;

    float dq_acc[COLS];
#pragma unroll
    for (int c = 0; c < COLS; ++c) dq_acc[c] = 0.0f;

    int lo, hi;
    key_span(p, m0, min(m0 + BLOCK, p.seqlen_q), &lo, &hi);
    const Steps steps = tile_steps(L, seq, h, blockIdx.x, lo, hi, BLOCK);
    for (int step = 0; step < steps.count; ++step) {
        const int n0 = step_start(L, steps, step, BLOCK);
        const bool partial = step_partial(L, steps, step);
        __syncthreads();
        load_tile(k_tile, BLOCK, k, b, n0, p.seqlen_k, p.heads_kv, hk, p.d);
        load_tile(v_tile, BLOCK, v, b, n0, p.seqlen_k, p.heads_kv, hk, p.d);
        keep.fill(D, p.heads_q, seq.index, h, m0, n0);
        __syncthreads();
#pragma unroll
        for (int t = 0; t < PER_LANE; ++t) {
            const int jj = lane + t * THREADS_PER_ROW;
            if (jj >= BLOCK) break;
            float pr = 0.0f, ds = 0.0f;
            const int j = n0 + jj;
            if (allowed(p, i, j) && (!partial || block_allows(L, seq, h, i, j)))
                p_and_ds(p, D, KEPT(keep, r, jj), slope, i, j, &q_tile[r * PAD], &k_tile[jj * PAD],
                         &do_tile[r * PAD], &v_tile[jj * PAD], lse_i, delta_i, &pr, &ds);
            ds_tile[r * BLOCK + jj] = ds;
        }
        __syncthreads();
        for (int jj = 0; jj < BLOCK; ++jj) {
            const float ds = ds_tile[r * BLOCK + jj];
#pragma unroll
            for (int c = 0; c < COLS; ++c)
                dq_acc[c] = fmaf(ds, k_tile[jj * PAD + lane + c * THREADS_PER_ROW], dq_acc[c]);
        }
    }

    if (i >= p.seqlen_q) return;
    const size_t row = at(b, p.seqlen_q, i, p.heads_q, h, p.d);
#pragma unroll
    for (int c = 0; c < COLS; ++c) {
        const int col = lane + c * THREADS_PER_ROW;
        if (col < p.d) dq[row + col] = store_f32(dq_acc[c] * p.scale);
    }
}

// FlashAttention-3-style dK/dV for Hopper (sm_90a, f16/bf16 storage, f32
// accumulation, padded head dim 64 or 128, d % 8 == 0), after
// flash_bwd_dot (D = rowsum(dO ∘ O), bwd_dot.cuh). At d 64 it also adds
// dQ's partials (dS K) into an f32 workspace in key-block order, which
// flash_bwd_dq_convert then rounds to dq; at d 128 the host runs
// flash_bwd_dq_wgmma (the end of this file) after it. No float atomics: a block
// owns its keys' dK and dV and walks the GQA group's query heads in order,
// and semaphores order dQ's adds, so a repeat is bit-identical.
//
// A block of three warpgroups owns BLOCK_M = 128 keys of one kv head and
// sequence:
//
//   warpgroup 0, the producer (setmaxnreg.dec): thread 0 loads K and V
//     once by TMA, then streams the (query head, query tile) steps' Q and
//     dO tiles of BLOCK_N rows through a ring of STAGES, each stage's
//     "full" mbarrier completing on the copies' bytes; warps 1 and 2 (one
//     thread a query row) write the step's LSE · log2 e and D into the
//     stage (+inf for a row past seqlen_q or with no key: its P is then 0
//     with no test) and arrive on the same barrier.
//   warpgroups 1 and 2, the consumers (setmaxnreg.inc), 64 keys each, per
//     step: S^T = K Q^T and dP^T = V dO^T by wgmma from shared memory
//     (K-major both), P^T = exp2(S^T · scale · log2 e − LSE · log2 e) on
//     S^T's fragments while dP^T is in flight, dS^T = P^T ∘ (dP^T − D),
//     then dV += P^T dO and dK += dS^T Q with P^T and dS^T, rounded to
//     storage, as register A fragments (S^T's accumulator layout is
//     wgmma's A layout) and dO, Q by descriptor (MN-major); then the
//     stage's "empty" mbarrier (every consumer thread) frees it.
//   dQ (d 64): each consumer writes its dS^T, transposed, into a dS buffer
//     and computes dS K over its own 64 keys by wgmma (both operands by
//     descriptor), then adds it to dq_accum in its turn (dq_semaphore).
//   dK (times scale) and dV go out from the accumulators, rows past
//     seqlen_k not written: nothing else reads them, so the key rows a box
//     reads past the sequence's end (zeros, or a packed batch's next
//     sequence) need no mask.
//
// Dynamic shared memory, every tile 1024-byte aligned (128B swizzle atoms),
// tiles stored as TMA boxes of 64 columns (128 B rows) x rows:
//
//   [align] K | V (HEAD_DIM/64 boxes of BLOCK_M rows each) | stage s: Q, dO
//   (boxes of BLOCK_N rows) | at d 64: dS x 2 (boxes of BLOCK_N rows), dQ
//   partials x 2 (BLOCK_N rows of DQ_ROW floats) | stage s: LSE·log2 e, D
//   (BLOCK_N floats each) | mbarriers

#define THREADS 384
#define KV_BYTES (BLOCK_M * HEAD_DIM * 2)
#define TILE_BYTES (BLOCK_N * HEAD_DIM * 2)
#define STAGES 2
#define ROWS_BYTES (STAGES * 2 * BLOCK_N * 4)
// A step's dS (queries x the block's keys), two buffers: a warpgroup
// writes step s + 2's while the other may still read step s + 1's.
#define DS_BYTES (BLOCK_N * BLOCK_M * 2)
// dQ = dS K (64 queries x HEAD_DIM) by both consumers, 64 columns of
// accumulators each: at d 64 each over its own 64 keys, two ordered
// contributions of the block to the same columns; at d 128 each over all
// 128 keys, its own 64 columns.
#define DQ_SPLIT_KEYS (HEAD_DIM == 64)
#define DQ_KSTEPS (DQ_SPLIT_KEYS ? 4 : BLOCK_M / 16)
// A warpgroup's dQ partial staged in f32 (rows of 64 + 8, the padding
// spreading the accumulators' rows over the banks) for its adds: the
// bounds tests there are on shared memory, not on wgmma's registers (a
// branch on those serialized the wgmmas, C7520).
#define DQ_ROW 72
#define DQ_STAGE_BYTES (BLOCK_N * DQ_ROW * 4)
// dQ here at d 64 only: at d 128 its accumulators and descriptors beside
// dK's and dV's spilled, and the host runs flash_bwd_dq_wgmma instead
// (dq_accum and dq_sems then unused).
#define HAS_DQ (HEAD_DIM == 64)
#define DQ_BYTES (HAS_DQ ? 2 * DS_BYTES + 2 * DQ_STAGE_BYTES : 0)
// K and V full, Q/dO full x STAGES, Q/dO empty x STAGES: these numbers in a deadlock report
#define BARRIERS 5
#define BAR_KV_FULL 0
#define BAR_FULL 1
#define BAR_EMPTY 3
static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "whole 64-column boxes");
static_assert(BLOCK_M == 128 && BLOCK_N == 64, "two consumer warpgroups of 64 keys; wgmma n = 64 queries");
static_assert(1024 + 2 * KV_BYTES + 2 * STAGES * TILE_BYTES + DQ_BYTES + ROWS_BYTES + BARRIERS * 8 <= SMEM_BYTES,
              "src/cuda/kernel.rs launches with this layout's bytes");

#define PRODUCER_REGS 24
#define CONSUMER_REGS 240
// P^T computed while dP^T is in flight, but with a softcap: its
// derivative of each pair would be held beside dP^T.
#define OVERLAP_DP (!HAS_SOFTCAP)
// The producer's threads that write a step's LSE and D rows (warps 1 and 2).
#define ROW_WRITER0 32
// Named barriers: the consumers' dS written (256 threads); a dQ
// warpgroup's semaphore taken and its adds done (128).
#define BAR_DS_WRITTEN 1
#define BAR_DQ_ORDER 2

// The semaphore of (query head h, query tile `tile`, 64 columns `half`)
// of sequence `seq`: its tiles numbered from q0 / BLOCK_N + index, which no
// earlier sequence's tiles reach (src/cuda/backward.rs sizes the array). It
// counts the contributions added: key block x's warpgroup wg is number
// 2x + wg at d 64 (both on columns 0..63), x at d 128 (wg's own half).
__device__ __forceinline__ int* dq_semaphore(int* sems, const Seq& seq, const Problem& p, int h, int tile, int half) {
    const size_t t = seq.q0 / BLOCK_N + (size_t)seq.index + (size_t)tile;
    return sems + (t * p.heads_q + h) * 2 + half;
}

// dq = dq_accum · scale in storage, one thread an element.
extern "C" __global__ void flash_bwd_dq_convert(const float* __restrict__ acc, storage_t* __restrict__ dq,
                                                float scale, unsigned long long n) {
    for (unsigned long long e = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; e < n;
         e += (unsigned long long)gridDim.x * blockDim.x)
        dq[e] = store_f32(acc[e] * scale);
}

// What P's exp2 form takes of a step: the scale and ALiBi's slope in log2
// units, the diagonal's offset (band_offset), and whether the step is a
// block mask's partial tile.
struct PRule {
    float sl2, slope2;
    int off;
    bool partial;
};

// P of query i against key j from their raw product x, against the row's
// l2 = lse · log2 e, in both kernels' consumers; `in`: a step with no test
// per pair (every call passes a constant, and each inlined copy keeps only
// its own branch). *dcap the softcap's derivative (1 without).
__device__ __forceinline__ float p_exp2(const Problem& p, const Layout& L, const Seq& seq, int h, const PRule& r,
                                        bool in, int i, int j, float x, float l2, float* dcap) {
#if HAS_SOFTCAP
    const float sx = score(p, x, dcap) * LOG2E - l2;
    const float arg = in ? sx : sx - r.slope2 * fabsf((float)(i + r.off - j));
#else
    *dcap = 1.0f;
    const float arg = in ? fmaf(x, r.sl2, -l2) : fmaf(x, r.sl2, -fmaf(r.slope2, fabsf((float)(i + r.off - j)), l2));
#endif
    const bool ok = in || (allowed(p, i, j) && (!r.partial || block_allows(L, seq, h, i, j)));
    return ok ? exp2_approx(arg) : 0.0f;
}

// A dQ warpgroup's own barrier (ids are compile-time).
__device__ __forceinline__ void dq_order_sync(int wg) {
    if (wg == 0)
        named_bar_sync<BAR_DQ_ORDER, 128>();
    else
        named_bar_sync<BAR_DQ_ORDER + 1, 128>();
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
flash_bwd_dkdv(const __grid_constant__ TensorMap tq, const __grid_constant__ TensorMap tk,
               const __grid_constant__ TensorMap tv, const __grid_constant__ TensorMap tdo,
               const float* __restrict__ lse, const float* __restrict__ delta, storage_t* __restrict__ dk,
               storage_t* __restrict__ dv, float* __restrict__ dq_accum, int* __restrict__ dq_sems, Problem p,
               const Layout L) {
    DYNAMIC_SMEM(smem_raw);
    // Swizzling works on absolute shared addresses: align the tiles themselves.
    unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
    unsigned char* k_s = smem;
    unsigned char* v_s = k_s + KV_BYTES;
    unsigned char* stages = v_s + KV_BYTES;
    unsigned char* ds_s = stages + 2 * STAGES * TILE_BYTES;          // [buffer] boxes of 64 keys x BLOCK_N
    float* dq_s = (float*)(ds_s + 2 * DS_BYTES);                       // [warpgroup][BLOCK_N][DQ_ROW]
    float* rows_s = (float*)(ds_s + DQ_BYTES);                            // [stage][lse2, D][BLOCK_N]
    const Bar bars = bar_at(rows_s + 2 * STAGES * BLOCK_N);
    const Bar kv_full = bars + BAR_KV_FULL, full = bars + BAR_FULL, empty = bars + BAR_EMPTY;

    const int n0 = blockIdx.x * BLOCK_M, hk = blockIdx.y;
    const Seq seq = enter_sequence(L, &p, blockIdx.z);
    if (n0 >= p.seqlen_k) return;  // past a short sequence of a packed batch (uniform: no barrier yet)
    const int group = p.heads_q / p.heads_kv;
    int lo, hi;
    row_span(p, n0, min(n0 + BLOCK_M, p.seqlen_k), &lo, &hi);
    // (query head of the group, query tile) in order: a fixed order, so dK
    // and dV sum the same way every time.
    const GroupSteps steps = group_steps(L, seq, hk, group, blockIdx.x, lo, hi, BLOCK_N);
    const int tiles = steps.count;
    // TMA coordinates: a packed batch's maps span the packed tensor (its
    // batch of one), the sequence starting at row q0 / k0.
    const int tb = L.cu_q ? 0 : (int)seq.index;
    const int q_row0 = L.cu_q ? (int)seq.q0 : 0, k_row0 = L.cu_q ? (int)seq.k0 : 0;

    if (threadIdx.x == 0) {
        mbar_init(kv_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full + s, 1 + BLOCK_N);  // the copies' thread and one writer a row
            mbar_init(empty + s, 2 * 128);     // every consumer thread releases
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (threadIdx.x < 128) {
        setmaxnreg_dec<PRODUCER_REGS>();
        const int writer = (int)threadIdx.x - ROW_WRITER0;
        if (threadIdx.x == 0 && tiles > 0) {
            mbar_arrive_expect_tx(kv_full, 2 * KV_BYTES);
            for (int box = 0; box < HEAD_DIM / 64; ++box) {
                tma_load_4d(k_s + box * BOX_BYTES(BLOCK_M), &tk, box * 64, hk, k_row0 + n0, tb, kv_full);
                tma_load_4d(v_s + box * BOX_BYTES(BLOCK_M), &tv, box * 64, hk, k_row0 + n0, tb, kv_full);
            }
        }
        if (threadIdx.x == 0 || (writer >= 0 && writer < BLOCK_N)) {
            for (GroupAt pos = group_begin(); pos.k < tiles; pos = group_next(steps, pos)) {
                const int step = pos.k, s = step % STAGES, h = hk * group + group_step_head(L, steps, pos);
                const int m0 = group_step_start(L, steps, pos, BLOCK_N);
                // A fresh barrier counts as having completed the phase before
                // its first (parity 1): the first pass through the ring waits for nothing.
                mbar_wait(empty + s, ((step / STAGES) & 1) ^ 1, BAR_EMPTY + s);
                if (threadIdx.x == 0) {
                    unsigned char* q_t = stages + s * 2 * TILE_BYTES;
                    mbar_arrive_expect_tx(full + s, 2 * TILE_BYTES);
                    for (int box = 0; box < HEAD_DIM / 64; ++box) {
                        tma_load_4d(q_t + box * BOX_BYTES(BLOCK_N), &tq, box * 64, h, q_row0 + m0, tb, full + s);
                        tma_load_4d(q_t + TILE_BYTES + box * BOX_BYTES(BLOCK_N), &tdo, box * 64, h, q_row0 + m0,
                                    tb, full + s);
                    }
                } else {
                    const int i = m0 + writer;
                    float l2 = POS_INF, dd = 0.0f;  // P = 0
                    if (i < p.seqlen_q) {
                        l2 = lse_log2(lse[lse_at(seq, h, i)]);
                        dd = delta[lse_at(seq, h, i)];
                    }
                    rows_s[(s * 2) * BLOCK_N + writer] = l2;
                    rows_s[(s * 2 + 1) * BLOCK_N + writer] = dd;
                    mbar_arrive(full + s);  // release: the rows are seen by the barrier's waiters
                }
            }
        }
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        // wg broadcast from lane 0, as the forward does: warp-uniform
        // descriptors in uniform registers.
        const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128 - 1, 0);
        const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32, t = lane % 4;
        const int j0 = n0 + wg * 64 + warp * 16 + lane / 4;  // this lane's keys: j0 and j0 + 8
        // K and V (this warpgroup's 64 rows, K-major), stage 0's Q and dO
        // K-major (for S^T, dP^T) and MN-major (for dK, dV: 8 rows of 128 B
        // per 1024 B atom, the second 64 columns one box, LBO, further).
        const SmemDesc k_desc = smem_desc_words(k_s + wg * 64 * 128, 16, 1024);
        const SmemDesc v_desc = smem_desc_words(v_s + wg * 64 * 128, 16, 1024);
        const SmemDesc q_desc = smem_desc_words(stages, 16, 1024);
        const SmemDesc q_mn = smem_desc_words(stages, BOX_BYTES(BLOCK_N), 1024);
        // dQ = dS K: dS K-major from its buffer, K MN-major (64 columns a
        // box); this warpgroup's first key step and its columns' box.
        const SmemDesc ds_desc = smem_desc_words(ds_s, 16, 1024);
        const int dq_k0 = DQ_SPLIT_KEYS ? wg * DQ_KSTEPS : 0, half = DQ_SPLIT_KEYS ? 0 : wg;
        const int turn = DQ_SPLIT_KEYS ? 2 * blockIdx.x + wg : blockIdx.x;  // this warpgroup's contribution
        const SmemDesc k_mn = smem_desc_words(k_s + half * BOX_BYTES(BLOCK_M), BOX_BYTES(BLOCK_M), 1024);
        const float sl2 = p.scale * LOG2E;
        const int off = band_offset(p);
        // dQ's ordered adds: a warpgroup's first thread walks every (query
        // head of the group, query tile) of the sequence in order, waiting
        // for its semaphore to reach `turn` (every earlier contribution
        // added), then adding this warpgroup's partial where the block has
        // a step or passing the tile on where it has none.
        const bool leader = threadIdx.x % 128 == 0;
        const int q_tiles = (p.seqlen_q + BLOCK_N - 1) / BLOCK_N;
        int pass_h = hk * group, pass_tile = 0;  // the next tile not yet added or passed
        auto next_tile = [&] {
            if (++pass_tile == q_tiles) pass_tile = 0, ++pass_h;
        };
        auto pass_until = [&](int h, int tile) {
            while (pass_h < h || (pass_h == h && pass_tile < tile)) {
                int* sem = dq_semaphore(dq_sems, seq, p, pass_h, pass_tile, half);
                sem_wait(sem, turn);
                st_release_gpu(sem, turn + 1);
                next_tile();
            }
        };
        float* dq_seq = from_row(dq_accum, seq.q0, p.heads_q, p.d);

        float dk_acc[HEAD_DIM / 2], dv_acc[HEAD_DIM / 2];
#pragma unroll
        for (int c = 0; c < HEAD_DIM / 2; ++c) dk_acc[c] = dv_acc[c] = 0.0f;
        if (tiles > 0) mbar_wait(kv_full, 0, BAR_KV_FULL);

        for (GroupAt pos = group_begin(); pos.k < tiles; pos = group_next(steps, pos)) {
            const int step = pos.k, s = step % STAGES, h = hk * group + group_step_head(L, steps, pos);
            const int m0 = group_step_start(L, steps, pos, BLOCK_N);
            const bool partial = group_step_partial(L, steps, pos);
            const float slope2 = alibi_slope(L, seq, h) * LOG2E;
            // No pair of the block masked by the band (keys past seqlen_k are
            // never written, queries past seqlen_q have P = 0), the block mask
            // or ALiBi: no test per pair.
            const bool inner = !L.alibi && !partial && band_covers(p, m0, m0 + BLOCK_N - 1, n0, n0 + BLOCK_M - 1);
            const unsigned stage_bytes = s * 2 * TILE_BYTES;
            const SmemDesc q_stage = desc_moved(q_desc, stage_bytes), do_stage = desc_moved(q_stage, TILE_BYTES);
            const float* lse2_s = rows_s + (s * 2) * BLOCK_N;
            const float* delta_s = lse2_s + BLOCK_N;
            float st[BLOCK_N / 2], dpt[BLOCK_N / 2];
            mbar_wait(full + s, (step / STAGES) & 1, BAR_FULL + s);
            // S^T = K Q^T, then dP^T = V dO^T.
            wgmma_fence();
            wgmma_ss_over_d<BLOCK_N>(st, k_desc, BLOCK_M, q_stage, BLOCK_N);
            wgmma_commit();
            wgmma_fence();
            wgmma_ss_over_d<BLOCK_N>(dpt, v_desc, BLOCK_M, do_stage, BLOCK_N);
            wgmma_commit();
            // P^T of element (c, e): key j0 + 8 (e / 2), query m0 + 8 c + 2 t + e % 2;
            // *dcap the softcap's derivative (1 without). `in`: a step with no
            // test per pair (every call passes a constant, and each inlined
            // copy keeps only its own branch).
            const PRule rule{sl2, slope2, off, partial};
            auto p_of = [&](bool in, int c, int e, float x, float* dcap) {
                const int col = 8 * c + 2 * t + e % 2;
                return p_exp2(p, L, seq, h, rule, in, m0 + col, j0 + 8 * (e / 2), x, lse2_s[col], dcap);
            };
            auto ds_of = [&](int c, float pr, float dp, float dcap) {
                return pr * (dp - delta_s[8 * (c / 4) + 2 * t + c % 2]) * dcap;
            };
            // P^T in st and dS^T in dpt, once both products are issued.
            auto p_and_ds = [&](bool in) {
#if !OVERLAP_DP
                // Both products first: P^T of a pair (and the softcap's
                // derivative) used at once, not held beside dP^T in flight.
                wgmma_wait<0>();
                pin(st);
                pin(dpt);
#pragma unroll
                for (int c = 0; c < BLOCK_N / 2; ++c) {
                    float dcap;
                    st[c] = p_of(in, c / 4, c % 4, st[c], &dcap);
                    dpt[c] = ds_of(c, st[c], dpt[c], dcap);
                }
#else
                // P^T while dP^T is in flight.
                wgmma_wait<1>();
                pin(st);
#pragma unroll
                for (int c = 0; c < BLOCK_N / 2; ++c) {
                    float dcap;
                    st[c] = p_of(in, c / 4, c % 4, st[c], &dcap);
                }
                wgmma_wait<0>();
                pin(dpt);
#pragma unroll
                for (int c = 0; c < BLOCK_N / 2; ++c) dpt[c] = ds_of(c, st[c], dpt[c], 1.0f);
#endif
            };
            if (inner)
                p_and_ds(true);
            else
                p_and_ds(false);
            unsigned pa[BLOCK_N / 16][4], da[BLOCK_N / 16][4];
            // P^T and dS^T as A operands (a C fragment pair is an A fragment).
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    pa[kk][r] = pack2(st[8 * kk + 2 * r], st[8 * kk + 2 * r + 1]);
                    da[kk][r] = pack2(dpt[8 * kk + 2 * r], dpt[8 * kk + 2 * r + 1]);
                }
            // dS (as rounded for dK) into this step's buffer, [query][key]:
            // this warpgroup's keys are box wg, a pair of queries two rows.
            if (HAS_DQ) {
                unsigned char* ds_mine = ds_s + (step % 2) * DS_BYTES + wg * BOX_BYTES(BLOCK_N);
#pragma unroll
                for (int kk = 0; kk < BLOCK_N / 16; ++kk)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        const int i = 16 * kk + 8 * (r / 2) + 2 * t, j = warp * 16 + lane / 4 + 8 * (r % 2);
                        *(unsigned short*)(ds_mine + swizzled_128b(i * 128 + j * 2)) = (unsigned short)da[kk][r];
                        *(unsigned short*)(ds_mine + swizzled_128b((i + 1) * 128 + j * 2)) =
                            (unsigned short)(da[kk][r] >> 16);
                    }
                fence_proxy_async();  // the generic stores before wgmma's reads
                named_bar_sync<BAR_DS_WRITTEN, 256>();
            }
            // dV += P^T dO, dK += dS^T Q: k16 steps along the queries, 16 rows
            // (2 KiB) apart in each box; dQ = dS K: k16 steps along the keys,
            // 32 B apart in dS's boxes and 16 rows apart in K's.
            const SmemDesc q_b = desc_moved(q_mn, stage_bytes), do_b = desc_moved(q_b, TILE_BYTES);
            const SmemDesc ds_b = desc_moved(ds_desc, (step % 2) * DS_BYTES);
            wgmma_fence();
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) wgmma_rs<HEAD_DIM, 1>(dv_acc, pa[kk], desc_at(do_b, kk * 16 * 128));
#pragma unroll
            for (int kk = 0; kk < BLOCK_N / 16; ++kk) wgmma_rs<HEAD_DIM, 1>(dk_acc, da[kk], desc_at(q_b, kk * 16 * 128));
            wgmma_commit();
            wgmma_wait<0>();
            pin(dv_acc);
            pin(dk_acc);
            pin(pa);
            pin(da);
            mbar_arrive(empty + s);  // Q, dO, LSE and D of this stage read
            // After dK and dV's: P^T and dS^T's registers free for dQ's.
            if (HAS_DQ) {
                float dq_acc[32];
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < DQ_KSTEPS; ++kk) {
                    const int ks = dq_k0 + kk;
                    wgmma_ss_tb<64>(dq_acc, desc_at(ds_b, (ks / 4) * BOX_BYTES(BLOCK_N) + (ks % 4) * 32),
                                    desc_at(k_mn, ks * 16 * 128), kk > 0);
                }
                wgmma_commit();
                wgmma_wait<0>();
                pin(dq_acc);
                float* stage = dq_s + wg * BLOCK_N * DQ_ROW;
#pragma unroll
                for (int c = 0; c < 8; ++c)
#pragma unroll
                    for (int e = 0; e < 4; ++e)
                        stage[(warp * 16 + lane / 4 + 8 * (e / 2)) * DQ_ROW + 8 * c + 2 * t + e % 2] =
                            dq_acc[4 * c + e];
                const int tile = m0 / BLOCK_N;
                int* sem = dq_semaphore(dq_sems, seq, p, h, tile, half);
                if (leader) {
                    pass_until(h, tile);
                    sem_wait(sem, turn);
                }
                dq_order_sync(wg);  // staged, and the turn taken
                // Row by row, 64 columns (256 B) at a time.
#pragma unroll 4
                for (int it = 0; it < BLOCK_N * 64 / 128; ++it) {  // trip count uniform (not from threadIdx)
                    const int e = it * 128 + (int)threadIdx.x % 128, i = m0 + e / 64, col = half * 64 + e % 64;
                    add_global_if(dq_seq + at(0, p.seqlen_q, i, p.heads_q, h, p.d) + col,
                                  stage[(e / 64) * DQ_ROW + e % 64], i < p.seqlen_q && col < p.d);
                }
                dq_order_sync(wg);
                if (leader) {
                    fence_gpu();  // the warpgroup's adds (ordered by the barrier) before the release
                    st_release_gpu(sem, turn + 1);
                    next_tile();
                }
            }
        }
        if (HAS_DQ && leader && q_tiles > 0) pass_until(hk * group + group, 0);

        storage_t* dk_seq = from_row(dk, seq.k0, p.heads_kv, p.d);
        storage_t* dv_seq = from_row(dv, seq.k0, p.heads_kv, p.d);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int j = j0 + 8 * r;
            if (j >= p.seqlen_k) continue;
            const size_t row = at(0, p.seqlen_k, j, p.heads_kv, hk, p.d);
            store_acc_row(dk_seq + row, dk_acc, r, p.d, p.scale);
            store_acc_row(dv_seq + row, dv_acc, r, p.d, 1.0f);
        }
    }
}

// dQ where the dK/dV kernel does not add it (d 128: its accumulators beside
// dK's and dV's spilled): FA2's dQ kernel on wgmma, S and dP recomputed.
// A block of three warpgroups owns BLOCK_M = 128 queries of one query head
// and sequence and walks the key tiles of BLOCK_M keys its rows see (the
// dK/dV kernel's tensor maps: Q and dO come in two boxes of BLOCK_N rows):
//
//   warpgroup 0, the producer: thread 0 loads Q and dO once by TMA, then
//     streams each tile's K and V through a ring of STAGES.
//   warpgroups 1 and 2, 64 queries each, their rows' LSE · log2 e and D in
//     registers; per tile, per half of 64 keys: S = Q K^T and dP = dO V^T
//     by wgmma (K-major both), P = exp2(S · scale · log2 e − LSE · log2 e)
//     while dP is in flight, dS = P ∘ (dP − D), then dQ += dS K with dS,
//     rounded to storage, as register A fragments and K by descriptor
//     (MN-major); then the stage's "empty" mbarrier frees it.
//   dQ (times scale) goes out from the accumulators, rows past seqlen_q
//     not written. A block owns its rows' dQ whole: no partials, no order
//     to keep, and a repeat is bit-identical.
//
// Dynamic shared memory: [align] Q | dO (HEAD_DIM/64 boxes of BLOCK_M rows)
// | stage s: K, V (the same) | mbarriers (Q and dO full, K/V full x
// STAGES, K/V empty x STAGES: the dK/dV kernel's numbers).
#define DQ_LAYOUT_BYTES (1024 + 2 * KV_BYTES + STAGES * 2 * KV_BYTES + BARRIERS * 8)
static_assert(DQ_LAYOUT_BYTES <= SMEM_BYTES, "src/cuda/kernel.rs launches with this layout's bytes");

extern "C" __global__ void __launch_bounds__(THREADS, 1)
flash_bwd_dq_wgmma(const __grid_constant__ TensorMap tq, const __grid_constant__ TensorMap tk,
                   const __grid_constant__ TensorMap tv, const __grid_constant__ TensorMap tdo,
                   const float* __restrict__ lse, const float* __restrict__ delta, storage_t* __restrict__ dq,
                   Problem p, const Layout L) {
    DYNAMIC_SMEM(smem_raw);
    unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
    unsigned char* q_s = smem;
    unsigned char* do_s = q_s + KV_BYTES;
    unsigned char* kv_s = do_s + KV_BYTES;  // [stage] K, V
    const Bar bars = bar_at(kv_s + STAGES * 2 * KV_BYTES);
    const Bar qdo_full = bars + BAR_KV_FULL, full = bars + BAR_FULL, empty = bars + BAR_EMPTY;

    const int m0 = blockIdx.x * BLOCK_M, h = blockIdx.y;
    const Seq seq = enter_sequence(L, &p, blockIdx.z);
    if (m0 >= p.seqlen_q) return;  // past a short sequence of a packed batch (uniform: no barrier yet)
    const int hk = h / (p.heads_q / p.heads_kv);
    int lo, hi;
    key_span(p, m0, min(m0 + BLOCK_M, p.seqlen_q), &lo, &hi);
    const Steps steps = tile_steps(L, seq, h, blockIdx.x, lo, hi, BLOCK_M);
    const int tiles = steps.count;
    const int tb = L.cu_q ? 0 : (int)seq.index;
    const int q_row0 = L.cu_q ? (int)seq.q0 : 0, k_row0 = L.cu_q ? (int)seq.k0 : 0;

    if (threadIdx.x == 0) {
        mbar_init(qdo_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(full + s, 1);
            mbar_init(empty + s, 2 * 128);  // every consumer thread releases
        }
        mbar_init_fence();
    }
    __syncthreads();

    if (threadIdx.x < 128) {
        setmaxnreg_dec<PRODUCER_REGS>();
        if (threadIdx.x == 0 && tiles > 0) {
            mbar_arrive_expect_tx(qdo_full, 2 * KV_BYTES);
            for (int box = 0; box < HEAD_DIM / 64; ++box)
                for (int r = 0; r < BLOCK_M; r += BLOCK_N) {
                    const unsigned at = box * BOX_BYTES(BLOCK_M) + BOX_BYTES(r);
                    tma_load_4d(q_s + at, &tq, box * 64, h, q_row0 + m0 + r, tb, qdo_full);
                    tma_load_4d(do_s + at, &tdo, box * 64, h, q_row0 + m0 + r, tb, qdo_full);
                }
            for (int step = 0; step < tiles; ++step) {
                const int s = step % STAGES, n0 = step_start(L, steps, step, BLOCK_M);
                // A fresh barrier counts as having completed the phase before
                // its first (parity 1): the first pass through the ring waits for nothing.
                mbar_wait(empty + s, ((step / STAGES) & 1) ^ 1, BAR_EMPTY + s);
                unsigned char* k_t = kv_s + s * 2 * KV_BYTES;
                mbar_arrive_expect_tx(full + s, 2 * KV_BYTES);
                for (int box = 0; box < HEAD_DIM / 64; ++box) {
                    tma_load_4d(k_t + box * BOX_BYTES(BLOCK_M), &tk, box * 64, hk, k_row0 + n0, tb, full + s);
                    tma_load_4d(k_t + KV_BYTES + box * BOX_BYTES(BLOCK_M), &tv, box * 64, hk, k_row0 + n0, tb,
                                full + s);
                }
            }
        }
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128 - 1, 0);
        const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32, t = lane % 4;
        const int i0 = m0 + wg * 64, r0 = i0 + warp * 16 + lane / 4;  // this lane's rows: r0 and r0 + 8
        const int i1 = min(i0 + 63, p.seqlen_q - 1);                   // the warpgroup's last row
        float lse2_r[2], delta_r[2];  // +inf and 0 past seqlen_q or with no key: P = 0 there
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = r0 + 8 * r;
            const bool row = i < p.seqlen_q;
            lse2_r[r] = row ? lse_log2(lse[lse_at(seq, h, i)]) : POS_INF;
            delta_r[r] = row ? delta[lse_at(seq, h, i)] : 0.0f;
        }
        const float sl2 = p.scale * LOG2E, slope2 = alibi_slope(L, seq, h) * LOG2E;
        const int off = band_offset(p);
        // Q and dO (this warpgroup's 64 rows) and K, V K-major for S and
        // dP; K MN-major for dQ (64 columns a box, the next box LBO on).
        const SmemDesc q_desc = smem_desc_words(q_s + wg * 64 * 128, 16, 1024);
        const SmemDesc do_desc = smem_desc_words(do_s + wg * 64 * 128, 16, 1024);
        const SmemDesc k_desc = smem_desc_words(kv_s, 16, 1024);
        const SmemDesc k_mn = smem_desc_words(kv_s, BOX_BYTES(BLOCK_M), 1024);

        float dq_acc[HEAD_DIM / 2];
#pragma unroll
        for (int c = 0; c < HEAD_DIM / 2; ++c) dq_acc[c] = 0.0f;
        if (tiles > 0) mbar_wait(qdo_full, 0, BAR_KV_FULL);

        for (int step = 0; step < tiles; ++step) {
            const int s = step % STAGES, n0 = step_start(L, steps, step, BLOCK_M);
            const bool partial = step_partial(L, steps, step);
            mbar_wait(full + s, (step / STAGES) & 1, BAR_FULL + s);
#pragma unroll 1
            for (int half = 0; half < 2; ++half) {
                const int j0 = n0 + half * 64;
                const unsigned k_bytes = s * 2 * KV_BYTES + half * 64 * 128;  // this half's first key row
                // No pair masked by the band, the block mask or seqlen_k
                // (rows past seqlen_q have P = 0 by their LSE), no ALiBi:
                // no test per pair.
                const bool inner = !L.alibi && !partial && j0 + 63 < p.seqlen_k && band_covers(p, i0, i1, j0, j0 + 63);
                float sc[32], dp[32];
                wgmma_fence();
                wgmma_ss_over_d<64>(sc, q_desc, BLOCK_M, desc_moved(k_desc, k_bytes), BLOCK_M);
                wgmma_commit();
                wgmma_fence();
                wgmma_ss_over_d<64>(dp, do_desc, BLOCK_M, desc_moved(k_desc, k_bytes + KV_BYTES), BLOCK_M);
                wgmma_commit();
                // P of element (c, e): query r0 + 8 (e / 2), key j0 + 8 c + 2 t + e % 2;
                // *dcap the softcap's derivative (1 without).
                const PRule rule{sl2, slope2, off, partial};
                auto p_of = [&](bool in, int c, int e, float x, float* dcap) {
                    const int i = r0 + 8 * (e / 2), j = j0 + 8 * c + 2 * t + e % 2;
                    return p_exp2(p, L, seq, h, rule, in, i, j, x, lse2_r[e / 2], dcap);
                };
                auto p_and_ds = [&](bool in) {
#if !OVERLAP_DP
                    wgmma_wait<0>();
                    pin(sc);
                    pin(dp);
#pragma unroll
                    for (int c = 0; c < 32; ++c) {
                        float dcap;
                        sc[c] = p_of(in, c / 4, c % 4, sc[c], &dcap);
                        dp[c] = sc[c] * (dp[c] - delta_r[(c % 4) / 2]) * dcap;
                    }
#else
                    wgmma_wait<1>();
                    pin(sc);
#pragma unroll
                    for (int c = 0; c < 32; ++c) {
                        float dcap;
                        sc[c] = p_of(in, c / 4, c % 4, sc[c], &dcap);
                    }
                    wgmma_wait<0>();
                    pin(dp);
#pragma unroll
                    for (int c = 0; c < 32; ++c) dp[c] = sc[c] * (dp[c] - delta_r[(c % 4) / 2]);
#endif
                };
                if (inner)
                    p_and_ds(true);
                else
                    p_and_ds(false);
                // dS as A operands (a C fragment pair is an A fragment), then
                // dQ += dS K: k16 steps along the keys, 16 rows (2 KiB) apart.
                unsigned da[4][4];
#pragma unroll
                for (int kk = 0; kk < 4; ++kk)
#pragma unroll
                    for (int r = 0; r < 4; ++r) da[kk][r] = pack2(dp[8 * kk + 2 * r], dp[8 * kk + 2 * r + 1]);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < 4; ++kk)
                    wgmma_rs<HEAD_DIM, 1>(dq_acc, da[kk], desc_at(k_mn, k_bytes + kk * 16 * 128));
                wgmma_commit();
                wgmma_wait<0>();
                pin(dq_acc);
                pin(da);
            }
            mbar_arrive(empty + s);  // K and V of this stage read
        }

        storage_t* dq_seq = from_row(dq, seq.q0, p.heads_q, p.d);
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            const int i = r0 + 8 * r;
            if (i < p.seqlen_q)
                store_acc_row(dq_seq + at(0, p.seqlen_q, i, p.heads_q, h, p.d), dq_acc, r, p.d, p.scale);
        }
    }
}

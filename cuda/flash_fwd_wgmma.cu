// FlashAttention-3-style forward for Hopper (sm_90a, f16/bf16 storage, f32
// accumulation, padded head dim 64 or 128, d % 8 == 0; or, IS_FP8 below,
// e4m3 codes at padded head dim 128): a persistent grid
// of blocks of three warpgroups (one block an SM), each block working
// through items (BLOCK_M = 128 query rows, query head, sequence) of the
// list `Work` describes.
//
//   Scheduling: item n of a block is the list's entry n · blocks + the
//     block's index, counted backwards on odd rounds (a snake: a block
//     that took a long item in one round takes a short one in the next).
//     Under a causal (right-bounded) band the list runs longest first: the
//     last query blocks, which see the most keys, lead every round, so the
//     short ones fill the tail. Otherwise query blocks come fastest, so the
//     blocks at work at once share their K and V in L2.
//   Across items nothing restarts: the K/V ring and its barriers' phases
//     run on (the producer loads the next item's tiles while the consumers
//     finish this one), Q's barriers alternate, full then empty, once an
//     item, and the ping-pong turns balance within each item.
//
//   warpgroup 0, the producer: gives its registers away (setmaxnreg.dec),
//     and one thread issues TMA copies: Q once, then K and V tiles of
//     BLOCK_N keys into a two-stage ring. K and V complete on separate
//     "full" mbarriers, so Q K^T starts before V has landed, and are
//     released on separate "empty" ones, so K's slot refills once both
//     consumers' S = Q K^T retired, without waiting for their P V.
//   warpgroups 1 and 2, the consumers (setmaxnreg.inc), 64 query rows each:
//     S = Q K^T and O += P V by wgmma (Q, K, V from shared memory through
//     descriptors, P from registers), the online softmax on S's fragments.
//     Intra-warpgroup overlap (FA3's algorithm 2): S_{j+1} = Q K_{j+1}^T is
//     issued before O += P_j V_j, and the softmax of S_{j+1} runs while that
//     product is in flight; O is rescaled after it completes. Ping-pong
//     between the two (FA3's inter-warpgroup overlap): they take turns, by
//     two named barriers, at issuing their products, so one's softmax runs
//     while the other's matmuls hold the tensor cores.
//   O goes out normalized through shared memory (each consumer's own Q
//     rows, read by nothing once its last S retired) by a TMA store,
//     rows past seqlen_q clipped at the map's bounds; a packed batch's from
//     registers (its map spans the packed tensor: a box past a sequence's
//     end would write the next sequence's rows).
//
// Dynamic shared memory, every tile 1024-byte aligned (128B swizzle atoms),
// tiles stored as TMA boxes of 64 columns (128 B rows) x rows:
//
//   [align] Q (HEAD_DIM/64 boxes of BLOCK_M rows) | stage 0: K, V | stage 1: K, V | mbarriers
//
// Q's bytes are also where O goes out: a Q empty barrier (both consumers,
// after their stores have read it) frees them for the next item's Q.
//
// IS_FP8 (src/cuda/fp8.rs): the same kernel on e4m3 codes, padded head dim
// 128 (a row of 128 codes is one 128-byte box), f32 out.
//   Scores: S = Q K^T by wgmma k32 steps on the codes, each (sequence,
//     head)'s sq · sk · scale folded into the exp2 FFMA's factor (sl2), or
//     (softcap) into the raw dot product before the tanh.
//   P: p = exp(s - running max) rounded by cvt.rn.satfinite.e4m3x2.f32 at
//     p · 448 (P's own scale, 1/448; the exp2 FFMA gives p · 448 directly),
//     l summed from the unrounded values (over 448 at the end); o = acc ·
//     sv / 448 / l once, written as f32 from registers (4x Q's bytes:
//     staging it for a TMA store would take 64 KiB more).
//   V^T: an 8-bit B operand is K-major only, so P V needs V^T (keys
//     contiguous). The whole producer warpgroup transposes each V tile into
//     a V^T buffer of its stage (after V's full barrier and the consumers'
//     release of that buffer, then fence.proxy.async and the V^T full
//     barrier); a producer named barrier keeps the next TMA of V out of a
//     slot still being read. The transpose permutes the keys so that P
//     needs no shuffle: S's accumulator gives lane 4g + t, of each 32 keys,
//     keys 2t, 2t+1, 8+2t, 9+2t (row g and g+8; and the same + 16), where
//     the k32 A fragment wants k 4t..4t+3 (and + 16). So A's k = 4t + i
//     is key 2t + i%2 + 8(i/2) (fp8_key below), V^T's column k holds that
//     key's codes, and P's registers pack in the order they hold. The
//     transpose moves words (4 columns of 4 keys) by byte permutes.
//
//   [align] Q | stage 0: K, V, V^T | stage 1: K, V, V^T | mbarriers

#define THREADS 384
#define ROW_BYTES (HEAD_DIM * OPERAND_BYTES)
#define BOXES (ROW_BYTES / 128)  // 128-byte boxes across a row
#define Q_BYTES (BLOCK_M * ROW_BYTES)
#define TILE_BYTES (BLOCK_N * ROW_BYTES)
#define STAGES 2
// K, V (and the FP8 variant's V^T: HEAD_DIM rows of BLOCK_N codes)
#define STAGE_BYTES ((IS_FP8 ? 3 : 2) * TILE_BYTES)
// Q full, K full x2, V full x2, K empty x2, V empty x2 (FP8: V^T read), Q
// empty, (FP8) V^T full x2: these numbers in a deadlock report
#define BARRIERS (IS_FP8 ? 12 : 10)
#define BAR_Q_FULL 0
#define BAR_K_FULL 1
#define BAR_V_FULL 3
#define BAR_K_EMPTY 5
#define BAR_V_EMPTY 7
#define BAR_Q_EMPTY 9
#define BAR_VT_FULL 10
static_assert(HEAD_DIM == 64 || HEAD_DIM == 128, "whole 64-column boxes");
static_assert(!IS_FP8 || HEAD_DIM == 128, "FP8: a row of 128 codes, one box; transpose_v's 32 column words");
static_assert(BLOCK_M == 128 && BLOCK_N == 128, "two consumer warpgroups of 64 rows; wgmma n = 128 keys");
static_assert(1024 + Q_BYTES + STAGES * STAGE_BYTES + BARRIERS * 8 <= SMEM_BYTES,
              "src/cuda/kernel.rs launches with this layout's bytes");

// FA3's split for two consumer warpgroups: 24 + 2 x 240 registers per
// thread x 128 threads stay within the 64K-register file; the FP8
// producers, which transpose V, 40 (40 + 2 x 232).
#define PRODUCER_REGS (IS_FP8 ? 40 : 24)
#define CONSUMER_REGS (IS_FP8 ? 232 : 240)
// The overlap keeps S (64 floats), P (32 registers) and O in flight at once;
// at d 128 the softcap's tanhf no longer fits beside them in 240 registers
// (ptxas spilled; in the FP8 variant too, P's 16 registers fewer), so that
// variant issues its products one after the other.
#define OVERLAP (HEAD_DIM < 128 || !HAS_SOFTCAP)
// Without a softcap (whose tanh needs each scaled score) the softmax takes
// FA3's form: m over the raw dot products, P = 2^(s·sl2 − m·sl2) by one
// FFMA and one ex2 (the plan sends scales of 0 or below to the sm80 kernels;
// src/cuda/fp8.rs refuses them).
#define EXP2_SOFTMAX (!HAS_SOFTCAP)
// What the softmax's P holds: p, or (FP8) p · 448, ready for its codes
// (P's scale 1/448); l sums the same and is divided by 448 once at the end.
#if IS_FP8
#define P_FACTOR 448.0f
#define P_LOG2 8.807354922057604f  // log2(448)
#else
#define P_FACTOR 1.0f
#define P_LOG2 0.0f
#endif

#if IS_FP8
// The key whose codes V^T's column k holds, in each 32 keys (the header's
// permutation): A's k = 4t + i (and + 16) is the key lane t's accumulators hold there.
__device__ __forceinline__ int fp8_key(int k) {
    const int i = k % 4;
    return (k & ~15) + 2 * ((k % 16) / 4) + i % 2 + 8 * (i / 2);
}
// The producer warpgroup's thread `tid`'s share of V^T from the V tile
// (both 128-byte rows in the 128B swizzle): 4 head-dim columns (a word of
// V's rows) by 8 of V^T's words along the keys. For V^T's word w (k 4w..
// 4w+3) it reads the word of those columns from the 4 keys fp8_key gives
// and turns the 4 x 4 bytes by byte permutes into 4 words of V^T's rows.
// A warp's loads: 8 neighbouring words of 4 rows 2 keys apart, whose
// swizzled chunks differ (no bank conflict); its stores, 4-way.
__device__ __forceinline__ void transpose_v(unsigned v_at, unsigned vt_at, int tid) {
    const int nb = tid / 32 * 8 + tid % 8, sub = tid % 32 / 8;
#pragma unroll 1  // within the producers' 40 registers (unrolled, ptxas spilled)
    for (int j = 0; j < BLOCK_N / 16; ++j) {
        const int w = sub + 4 * j;
        unsigned in[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) in[i] = ld_shared_b32(v_at + swizzled_128b(fp8_key(4 * w + i) * 128 + 4 * nb));
        // Bytes c of in[0..3] to out[c]: pairs interleaved, then pairs of pairs.
        const unsigned lo01 = __byte_perm(in[0], in[1], 0x5140), lo23 = __byte_perm(in[2], in[3], 0x5140);
        const unsigned hi01 = __byte_perm(in[0], in[1], 0x7362), hi23 = __byte_perm(in[2], in[3], 0x7362);
        const unsigned out[4] = {__byte_perm(lo01, lo23, 0x5410), __byte_perm(lo01, lo23, 0x7632),
                                 __byte_perm(hi01, hi23, 0x5410), __byte_perm(hi01, hi23, 0x7632)};
#pragma unroll
        for (int c = 0; c < 4; ++c) st_shared_b32(vt_at + swizzled_128b((4 * nb + c) * 128 + 4 * w), out[c]);
    }
}
#endif

// The persistent grid's list: m_blocks query blocks (of the longest
// sequence) x heads_q x seqs sequences; the products come from the host
// (src/cuda/problem.rs's `Work`), read from the parameters where used: a
// product kept in a register across the item loop spilled.
struct Work {
    int m_blocks, seqs;
    int groups;  // heads_q x seqs: the items of one query block
    int items;   // m_blocks x groups
};
static_assert(sizeof(Work) == 4 * 4, "Work must stay four ints");

// One item: its query block, head and sequence, and the problem, rows and
// key tiles that follow (`skip`: past a short sequence of a packed batch).
struct Item {
    Problem p;
    Seq seq;
    int m0, h, z;
    bool skip;
    Steps steps;
};

// Item n of this block's list, or -1 past its end (the snake order above).
__device__ __forceinline__ int item_index(int n, const Work& W) {
    const int at = n * (int)gridDim.x + (n & 1 ? (int)gridDim.x - 1 - (int)blockIdx.x : (int)blockIdx.x);
    return at < W.items ? at : -1;
}

__device__ __forceinline__ Item enter_item(const Problem& problem, const Layout& L, const Work& W, int index) {
    Item it;
    // Longest first where a right bound makes later query blocks see more keys.
    const bool longest_first = HAS_BAND && problem.right >= 0;
    const int mb = longest_first ? W.m_blocks - 1 - index / W.groups : index % W.m_blocks;
    const int rest = longest_first ? index % W.groups : index / W.m_blocks;
    it.h = rest % problem.heads_q;
    it.z = rest / problem.heads_q;
    it.m0 = mb * BLOCK_M;
    it.p = problem;
    it.seq = enter_sequence(L, &it.p, it.z);
    it.skip = it.m0 >= it.p.seqlen_q;
    int lo, hi;
    key_span(it.p, it.m0, min(it.m0 + BLOCK_M, it.p.seqlen_q), &lo, &hi);
    // The key tiles this item visits: [lo, hi) in order, or a block
    // mask's list (tiles with no allowed pair left out, never loaded).
    it.steps = tile_steps(L, it.seq, it.h, mb, lo, hi, BLOCK_N);
    return it;
}

extern "C" __global__ void __launch_bounds__(THREADS, 1)
flash_fwd(const __grid_constant__ TensorMap tq, const __grid_constant__ TensorMap tk,
          const __grid_constant__ TensorMap tv,
#if IS_FP8
          // o (batch, seqlen_q, heads_q, HEAD_DIM) f32; each tensor's scales
          // per (batch entry, head): (batch, heads_q) for q, heads_kv for k, v
          float* __restrict__ o_all, float* __restrict__ lse, const float* __restrict__ q_scales,
          const float* __restrict__ k_scales, const float* __restrict__ v_scales,
#else
          const __grid_constant__ TensorMap to, storage_t* __restrict__ o_all, float* __restrict__ lse,
#endif
          const Problem problem, const Layout L, const Work W) {
    DYNAMIC_SMEM(smem_raw);
    // Swizzling works on absolute shared addresses: align the tiles themselves.
    unsigned char* smem = smem_raw + ((1024 - smem_addr(smem_raw) % 1024) % 1024);
    unsigned char* q_s = smem;
    unsigned char* kv_s = smem + Q_BYTES;
    const Bar bars = bar_at(kv_s + STAGES * STAGE_BYTES);
    const Bar q_full = bars + BAR_Q_FULL, k_full = bars + BAR_K_FULL, v_full = bars + BAR_V_FULL,
              k_empty = bars + BAR_K_EMPTY, v_empty = bars + BAR_V_EMPTY, q_empty = bars + BAR_Q_EMPTY;
#if IS_FP8
    const Bar vt_full = bars + BAR_VT_FULL;
#endif
    // TMA coordinates (row, batch entry): a dense batch's maps are 4-D, the
    // sequence a batch entry; a packed batch's span the packed tensor (a
    // batch of one), the sequence starting at row q0 / k0. Its boxes then
    // read the next sequence's rows past its end, which the mask hides
    // (keys) or nothing writes (queries).
    auto tma_batch = [&](const Item& it) { return L.cu_q ? 0 : it.z; };
    auto q_row0 = [&](const Item& it) { return L.cu_q ? (int)it.seq.q0 : 0; };
    auto k_row0 = [&](const Item& it) { return L.cu_q ? (int)it.seq.k0 : 0; };

    if (threadIdx.x == 0) {
        mbar_init(q_full, 1);
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(k_full + s, 1);
            mbar_init(v_full + s, 1);
            mbar_init(k_empty + s, 2 * 128);  // every consumer thread releases
            mbar_init(v_empty + s, 2 * 128);
#if IS_FP8
            mbar_init(vt_full + s, 128);  // every producer thread's row of V^T
#endif
        }
        mbar_init(q_empty, 2);  // each consumer's last thread out
        mbar_init_fence();
    }
    __syncthreads();

    if (threadIdx.x < 128) {
        setmaxnreg_dec<PRODUCER_REGS>();
        // One thread issues the copies; under FP8 the whole warpgroup walks
        // the items too, to transpose each V tile.
        const bool issuer = threadIdx.x == 0;
        if (IS_FP8 || issuer) {
            // ring: K/V tiles loaded for earlier items; taken: items whose Q
            // barriers turned (a skipped item turns none).
            int ring = 0, taken = 0;
            for (int n = 0, index; (index = item_index(n, W)) >= 0; ++n) {
                const Item it = enter_item(problem, L, W, index);
                if (it.skip) continue;
                const int tiles = it.steps.count, tb = tma_batch(it), k_row = k_row0(it);
                const int hk = it.h / (it.p.heads_q / it.p.heads_kv);
                // The last item's Q (and O's staging in its bytes) released.
                if (issuer && taken > 0) mbar_wait(q_empty, (taken - 1) & 1, BAR_Q_EMPTY);
                if (issuer && tiles > 0) {
                    mbar_arrive_expect_tx(q_full, Q_BYTES);
                    for (int box = 0; box < BOXES; ++box)
                        tma_load_4d(q_s + box * BOX_BYTES(BLOCK_M), &tq, box * 64, it.h, q_row0(it) + it.m0, tb,
                                    q_full);
                } else if (issuer) {
                    mbar_arrive(q_full);  // no keys: the consumers write o = 0 through Q's bytes all the same
                }
                for (int tile = 0; tile < tiles; ++tile) {
                    const int g = ring + tile, s = g % STAGES, n0 = k_row + step_start(L, it.steps, tile, BLOCK_N);
                    unsigned char* k_s = kv_s + s * STAGE_BYTES;
                    // A fresh barrier counts as having completed the phase before
                    // its first (parity 1): the first pass through the ring waits for nothing.
                    const unsigned parity = ((g / STAGES) & 1) ^ 1;
                    if (issuer) {
                        mbar_wait(k_empty + s, parity, BAR_K_EMPTY + s);
                        mbar_arrive_expect_tx(k_full + s, TILE_BYTES);
                        for (int box = 0; box < BOXES; ++box)
                            tma_load_4d(k_s + box * BOX_BYTES(BLOCK_N), &tk, box * 64, hk, n0, tb, k_full + s);
                        // FP8: V's slot is free once the warpgroup's last
                        // transpose of it passed the named barrier below.
                        if (!IS_FP8) mbar_wait(v_empty + s, parity, BAR_V_EMPTY + s);
                        mbar_arrive_expect_tx(v_full + s, TILE_BYTES);
                        for (int box = 0; box < BOXES; ++box)
                            tma_load_4d(k_s + TILE_BYTES + box * BOX_BYTES(BLOCK_N), &tv, box * 64, hk, n0, tb,
                                        v_full + s);
                    }
#if IS_FP8
                    // V landed and the consumers are done with this stage's
                    // V^T: this thread's row of it, fenced for wgmma's (async
                    // proxy) reads, then V^T full; the named barrier: every
                    // read of V done before the next copy into its slot.
                    mbar_wait(v_full + s, parity ^ 1, BAR_V_FULL + s);
                    mbar_wait(v_empty + s, parity, BAR_V_EMPTY + s);
                    emulation_lag();
                    transpose_v(smem_addr(k_s + TILE_BYTES), smem_addr(k_s + 2 * TILE_BYTES), threadIdx.x);
                    fence_proxy_async();
                    mbar_arrive(vt_full + s);
                    named_bar_sync<5, 128>();
#endif
                }
                ring += tiles;
                ++taken;
            }
        }
    } else {
        setmaxnreg_inc<CONSUMER_REGS>();
        // wg broadcast from lane 0, as CUTLASS does: ptxas then knows it is
        // warp-uniform and keeps Q's descriptors in uniform registers.
        const int wg = __shfl_sync(0xffffffffu, threadIdx.x / 128 - 1, 0);
        const int warp = threadIdx.x / 32 % 4, lane = threadIdx.x % 32, t = lane % 4;
        // The descriptors of this warpgroup's Q rows and of stage 0's K and
        // V (K-major, and V MN-major: 8 keys of 128 B per 1024 B atom, the
        // second 64 columns of d one box, LBO, further).
        const SmemDesc q_desc = smem_desc_words(q_s + wg * 64 * 128, 16, 1024);
        const SmemDesc k_desc = smem_desc_words(kv_s, 16, 1024);
#if IS_FP8
        // V^T: HEAD_DIM rows of BLOCK_N codes, K-major as K is.
        const SmemDesc v_desc = smem_desc_words(kv_s + 2 * TILE_BYTES, 16, 1024);
#else
        const SmemDesc v_desc = smem_desc_words(kv_s + TILE_BYTES, BOX_BYTES(BLOCK_N), 1024);
#endif
        // The turn to issue products: named barrier 1 + wg, completed by this
        // warpgroup's sync and the other's arrive (256 threads). Consumer 1
        // lets consumer 0 go first, and skips its last pass, so every arrive
        // meets a sync: tiles + 1 turns each, in every item.
        auto take_turn = [&] { wg == 0 ? named_bar_sync<1, 256>() : named_bar_sync<2, 256>(); };
        auto pass_turn = [&] { wg == 0 ? named_bar_arrive<2, 256>() : named_bar_arrive<1, 256>(); };
#if !IS_FP8
        const float sl2 = problem.scale * 1.4426950408889634f;  // scale · log2 e
#endif

        int ring = 0, taken = 0;  // as the producer counts them
        for (int n = 0, index; (index = item_index(n, W)) >= 0; ++n) {
            // Broadcast from lane 0, as wg is, so that ptxas may take the
            // item and the ring's position (and what follows from them) as
            // warp-uniform.
            index = __shfl_sync(0xffffffffu, index, 0);
            ring = __shfl_sync(0xffffffffu, ring, 0);
            const Item it = enter_item(problem, L, W, index);
            if (it.skip) continue;
            const Problem& p = it.p;
            const Seq& seq = it.seq;
            const Steps& steps = it.steps;
            const int m0 = it.m0, h = it.h, tiles = steps.count;
            const int r0 = m0 + wg * 64 + warp * 16 + lane / 4;  // this lane's rows: r0 and r0 + 8
            float acc[HEAD_DIM / 2], s[BLOCK_N / 2];
            // P, rounded to storage (FP8: e4m3 codes of p · 448): wgmma's register A fragments
            unsigned pa[BLOCK_N * OPERAND_BYTES / 32][4];
#if IS_FP8
            // This (sequence, head)'s scales: sqk = sq · sk turns a dot
            // product of codes into one of values; sc = scale · sqk into
            // score units. sl2 stays above 0 (a head of scale 0 has zero
            // codes: any factor gives its scores, all 0; a masked score's
            // -inf times 0 would be NaN).
            const int hk_c = h / (p.heads_q / p.heads_kv);
            const float sqk = q_scales[it.z * p.heads_q + h] * k_scales[it.z * p.heads_kv + hk_c];
            const float sc = p.scale * sqk;
            const float sl2 = fmaxf(sc * 1.4426950408889634f, 1.17549435e-38f);
            // P's codes stand for p · 448: o = acc · sv / 448 / l.
            const float o_scale = v_scales[it.z * p.heads_kv + hk_c] / P_FACTOR;
#endif
#pragma unroll
            for (int c = 0; c < HEAD_DIM / 2; ++c) acc[c] = 0.0f;
            float m[2] = {NEG_INF, NEG_INF}, l[2] = {0.0f, 0.0f}, alpha[2];
            float ms[2] = {0.0f, 0.0f};
            // ALiBi's slope, and (in the exp2 form, whose max is over raw dot
            // products) the same in raw units: the bias is -slope · |i + off - j|.
            const float slope = alibi_slope(L, seq, h);
            const float raw_slope = EXP2_SOFTMAX ? slope / p.scale : slope;
            const int off = band_offset(p);
            // Key tiles [inner_lo, inner_hi) hold no pair the band or seqlen_k
            // masks for any row of the block (whole tiles below seqlen_k and,
            // with a band, inside every row's window). Rows past seqlen_q are
            // computed either way and never written.
            int inner_lo = 0, inner_hi = p.seqlen_k / BLOCK_N;
#if HAS_BAND
            {
                const int last_row = min(m0 + BLOCK_M, p.seqlen_q) - 1;
                if (p.right >= 0) inner_hi = min(inner_hi, floor_div(m0 + off + p.right + 1, BLOCK_N));
                if (p.left >= 0) inner_lo = max(inner_lo, -floor_div(p.left - last_row - off, BLOCK_N));
            }
#endif
            // Step k's softmax tests nothing where its tile is one of those, the
            // block mask (if any) allows all of it, and no ALiBi bias applies.
            auto unmasked = [&](int k) {
                const int n = step_start(L, steps, k, BLOCK_N) / BLOCK_N;
                return !L.alibi && n >= inner_lo && n < inner_hi && !step_partial(L, steps, k);
            };
            // S = Q K^T for the item's tile `tile` (ring slot g = ring + tile).
            auto issue_qk = [&](int tile) {
                const int g = ring + tile;
                const SmemDesc k_stage = desc_moved(k_desc, (g % STAGES) * STAGE_BYTES);
                mbar_wait(k_full + g % STAGES, (g / STAGES) & 1, BAR_K_FULL + g % STAGES);
                wgmma_fence();
                wgmma_ss_over_d<BLOCK_N>(s, q_desc, BLOCK_M, k_stage, BLOCK_N);
                wgmma_commit();
            };
            // O += P V for tile `tile`.
            auto issue_pv = [&](int tile) {
                const int g = ring + tile;
                const SmemDesc v_stage = desc_moved(v_desc, (g % STAGES) * STAGE_BYTES);
#if IS_FP8
                mbar_wait(vt_full + g % STAGES, (g / STAGES) & 1, BAR_VT_FULL + g % STAGES);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BLOCK_N / 32; ++kk) wgmma_rs_e4m3<HEAD_DIM>(acc, pa[kk], desc_at(v_stage, kk * 32));
#else
                mbar_wait(v_full + g % STAGES, (g / STAGES) & 1, BAR_V_FULL + g % STAGES);
                wgmma_fence();
#pragma unroll
                for (int kk = 0; kk < BLOCK_N / 16; ++kk)
                    wgmma_rs<HEAD_DIM, 1>(acc, pa[kk], desc_at(v_stage, kk * 16 * 128));
#endif
                wgmma_commit();
            };
            // The online softmax of S (tile `tile`) in place: s becomes P
            // (unrounded), m and l move on, alpha rescales what O held. `inner`:
            // a tile with no masked pair, tested nowhere (every call passes a
            // constant, and the inlined copy keeps only its own branch).
            auto softmax = [&](int tile, bool inner) {
                const int n0 = step_start(L, steps, tile, BLOCK_N);
                const bool partial = step_partial(L, steps, tile);
                float mx[2] = {m[0], m[1]};
#pragma unroll
                for (int c = 0; c < BLOCK_N / 8; ++c)
#pragma unroll
                    for (int e = 0; e < 4; ++e) {
                        const int i = r0 + 8 * (e / 2), j = n0 + c * 8 + 2 * t + e % 2;
                        float& x = s[4 * c + e];
                        const bool ok = allowed(p, i, j) && (!partial || block_allows(L, seq, h, i, j));
#if EXP2_SOFTMAX
                        if (!inner) x = ok ? x - raw_slope * fabsf((float)(i + off - j)) : NEG_INF;
#else
                        float dcap;
#if IS_FP8
                        x *= sqk;  // the dot product of codes to one of values
#endif
                        x = ok ? with_alibi(p, raw_slope, score(p, x, &dcap), i, j) : NEG_INF;
#endif
                        mx[e / 2] = fmaxf(mx[e / 2], x);
                    }
#if EXP2_SOFTMAX
                online_max_exp2(mx, m, l, alpha, ms, sl2);
#if IS_FP8
                // p · 448 (P's scale) by the same FFMA, its log2 taken off
                // the rows' shifts once a trip (no multiply per score).
                const float shift[2] = {ms[0] - P_LOG2, ms[1] - P_LOG2};
#else
                const float shift[2] = {ms[0], ms[1]};
#endif
#pragma unroll
                for (int c = 0; c < BLOCK_N / 2; ++c) {
                    const float pj = exp2_approx(fmaf(s[c], sl2, -shift[(c % 4) / 2]));
                    l[(c % 4) / 2] += pj;  // the sums take P unrounded, as the other kernels' do
                    s[c] = pj;
                }
#else
                online_max(mx, m, l, alpha);
#pragma unroll
                for (int c = 0; c < BLOCK_N / 2; ++c) {
                    const float pj = s[c] == NEG_INF ? 0.0f : expf(s[c] - m[(c % 4) / 2]) * P_FACTOR;
                    l[(c % 4) / 2] += pj;
                    s[c] = pj;
                }
#endif
            };
            // P as the A operand (FA2's register reuse: a C fragment pair is an A fragment).
            auto pack_p = [&] {
#if IS_FP8
                // P · 448 (what s holds) to codes, each 32 keys' registers in
                // the order they hold (V^T's keys are permuted to match: fp8_key).
#pragma unroll
                for (int kk = 0; kk < BLOCK_N / 32; ++kk) {
                    const float* q = s + 16 * kk;
                    pa[kk][0] = pack4_e4m3(q[0], q[1], q[4], q[5]);
                    pa[kk][1] = pack4_e4m3(q[2], q[3], q[6], q[7]);
                    pa[kk][2] = pack4_e4m3(q[8], q[9], q[12], q[13]);
                    pa[kk][3] = pack4_e4m3(q[10], q[11], q[14], q[15]);
                }
#else
#pragma unroll
                for (int kk = 0; kk < BLOCK_N / 16; ++kk) {
                    pa[kk][0] = pack2(s[8 * kk + 0], s[8 * kk + 1]);
                    pa[kk][1] = pack2(s[8 * kk + 2], s[8 * kk + 3]);
                    pa[kk][2] = pack2(s[8 * kk + 4], s[8 * kk + 5]);
                    pa[kk][3] = pack2(s[8 * kk + 6], s[8 * kk + 7]);
                }
#endif
            };

            mbar_wait(q_full, taken & 1, BAR_Q_FULL);
            if (tiles > 0) {
                if (wg == 1) pass_turn();
                take_turn();
                issue_qk(0);
                pass_turn();
                wgmma_wait<0>();
                pin(s);
                mbar_arrive(k_empty + ring % STAGES);  // K of tile 0 read
                softmax(0, false);
                pack_p();
            }
            // P V of tile `tile` done: its registers and its V slot are free.
            auto retire_pv = [&](int tile) {
                pin(acc);
                pin(pa);
                mbar_arrive(v_empty + (ring + tile) % STAGES);
            };
            // One trip: S of `tile` and P V of the tile before it.
            auto trip = [&](int tile, bool inner) {
                const int prev = tile - 1;
                take_turn();
                if (OVERLAP) issue_qk(tile);
                issue_pv(prev);
                if (!OVERLAP) {
                    wgmma_wait<0>();
                    retire_pv(prev);
                    issue_qk(tile);
                }
                pass_turn();
                wgmma_wait<OVERLAP>();  // S of this tile (with OVERLAP, P V of the last still in flight)
                pin(s);
                mbar_arrive(k_empty + (ring + tile) % STAGES);  // its K read
                softmax(tile, inner);
                if (OVERLAP) {
                    wgmma_wait<0>();
                    retire_pv(prev);
                }
#pragma unroll
                for (int c = 0; c < HEAD_DIM / 2; ++c) acc[c] *= alpha[(c % 4) / 2];
                pack_p();
            };
            // Runs of masked steps (a window's left edge, the diagonal, the
            // last keys, a block mask's partial tiles) and of unmasked ones, the
            // latter in a loop of their own.
            int tile = 1;
            while (tile < tiles) {
                int end = tile;
                while (end < tiles && !unmasked(end)) ++end;
                for (; tile < end; ++tile) trip(tile, false);
                while (end < tiles && unmasked(end)) ++end;
                for (; tile < end; ++tile) trip(tile, true);
            }
            if (tiles > 0) {
                const int last = tiles - 1;
                take_turn();
                issue_pv(last);
                if (wg == 0) pass_turn();
                wgmma_wait<0>();
                retire_pv(last);
            }

            const bool tma_o = !IS_FP8 && !L.cu_q;
            unsigned char* o_s = q_s + wg * 64 * 128;  // this warpgroup's rows of each Q box
#pragma unroll
            for (int r = 0; r < 2; ++r) {
                const int i = r0 + 8 * r;
                const float sum = quad_sum(l[r]);
                // A row with no allowed key: o = 0 and lse = -inf (or the sink), never NaN.
                float inv_l, row_lse;
#if IS_FP8
                // m in score units; l of p, the sum of p · 448 over 448
                finish_row(EXP2_SOFTMAX ? m[r] * sc : m[r], sum / P_FACTOR, NEG_INF, &inv_l, &row_lse);
                if (i >= p.seqlen_q) continue;
                {
                    float* o = from_row(o_all, seq.q0, p.heads_q, HEAD_DIM);
                    const size_t row = at(0, p.seqlen_q, i, p.heads_q, h, HEAD_DIM);
                    const float f = o_scale * inv_l;
#pragma unroll
                    for (int c = 0; c < HEAD_DIM / 8; ++c) {
                        o[row + c * 8 + 2 * t] = acc[4 * c + 2 * r] * f;
                        o[row + c * 8 + 2 * t + 1] = acc[4 * c + 2 * r + 1] * f;
                    }
                }
                if (t == 0) lse[lse_at(seq, h, i)] = row_lse;
#else
                finish_row(EXP2_SOFTMAX ? m[r] * p.scale : m[r], sum, L.sinks ? L.sinks[h] : NEG_INF, &inv_l,
                           &row_lse);  // m in score units
                if (tma_o) {
                    const unsigned rr = (warp * 16 + lane / 4 + 8 * r) * 128;
#pragma unroll
                    for (int c = 0; c < HEAD_DIM / 8; ++c) {
                        const unsigned col = c * 8 + 2 * t;
                        st_shared_b32(smem_addr(o_s) + swizzled_128b((col / 64) * BOX_BYTES(BLOCK_M) + rr + (col % 64) * 2),
                                      pack2(acc[4 * c + 2 * r] * inv_l, acc[4 * c + 2 * r + 1] * inv_l));
                    }
                }
                if (i >= p.seqlen_q) continue;
                if (!tma_o) {
                    storage_t* o = from_row(o_all, seq.q0, p.heads_q, p.d);
                    store_acc_row(o + at(0, p.seqlen_q, i, p.heads_q, h, p.d), acc, r, p.d, inv_l);
                }
                if (t == 0) lse[lse_at(seq, h, i)] = row_lse;
#endif
            }
            // Every writer's fence (for the TMA store), then the warpgroup's
            // barrier (3 + wg, its 128 threads: its last reads of Q retired,
            // its O rows written); one thread stores the 64-row boxes, waits
            // until they are read, and releases Q's bytes for the next item.
            if (tma_o) fence_proxy_async();
            wg == 0 ? named_bar_sync<3, 128>() : named_bar_sync<4, 128>();
            if (threadIdx.x % 128 == 0) {
                if (tma_o) {
#if !IS_FP8
                    for (int box = 0; box < HEAD_DIM / 64; ++box)
                        tma_store_4d(&to, box * 64, h, m0 + wg * 64, it.z, o_s + box * BOX_BYTES(BLOCK_M));
#endif
                    bulk_commit();
                    bulk_wait_read();
                }
                mbar_arrive(q_empty);
            }
            ring += tiles;
            ++taken;
        }
    }
}

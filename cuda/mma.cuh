// Tensor-core building blocks of the sm80 kernels (flash_fwd_mma.cu,
// flash_bwd_mma.cu), f16/bf16 storage only: every mma.sync, ldmatrix and
// cp.async goes through the few functions here, so that
// cuda/emulate/host.h can give each the PTX ISA's per-lane semantics and
// the kernels run, fragment for fragment, on the CPU (tests/cuda.rs).
//
//   mma_16816          d += a * b, m16n8k16 .row.col, f32 accumulators;
//                      lane l (g = l / 4, t = l % 4) holds
//                      A: a0 (g, 2t..2t+1), a1 (g+8, 2t..), a2 (g, 2t+8..), a3 (g+8, 2t+8..)
//                      B: b0 (k 2t..2t+1, n g), b1 (k 2t+8.., n g)
//                      C: c0, c1 (g, 2t..2t+1), c2, c3 (g+8, 2t..2t+1)
//   ldmatrix_x{1,2,4}[_trans]  8x8 b16 matrices, lanes 8i..8i+7 give the
//                      row addresses of matrix i; lane l gets row l/4, cols
//                      2(l%4)..+1 of each (transposed: col l/4, rows 2(l%4)..+1)
//   cp_async16         16 bytes global -> shared, the bytes past src_bytes
//                      zero-filled; visible after cp_async_wait<N> (all but
//                      the newest N committed groups) and a barrier
//   cp_async4          the same for 4 bytes
//   ..._at             ldmatrix and cp.async on a shared-window address
//                      (smem_addr), for a base register and immediate offsets
//
// Extra defines (src/cuda/kernel.rs): BLOCK_M, BLOCK_N, SMEM_BYTES (the
// dynamic shared memory the host launches with).

#define ROW (HEAD_DIM + 8)  // elements per shared row: 16 B of padding spread ldmatrix's rows over the banks

#if defined(FLASHATTN_HOST_EMULATION)
__device__ __forceinline__ unsigned storage_bits(storage_t x) {
    unsigned short b;
    std::memcpy(&b, &x, 2);
    return b;
}
__device__ __forceinline__ float bits_to_f32(unsigned b) {
    storage_t x;
    const unsigned short h = (unsigned short)b;
    std::memcpy(&x, &h, 2);
    return load_f32(x);
}
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
    host_mma_16816(d, a, b0, b1, bits_to_f32);
}
#define LDMATRIX(name, count, trans)                                              \
    __device__ __forceinline__ void name(unsigned (&r)[count], const void* row) { \
        host_ldmatrix(r, count, trans, row);                                      \
    }                                                                             \
    __device__ __forceinline__ void name##_at(unsigned (&r)[count], unsigned row) { \
        host_ldmatrix(r, count, trans, host_dynamic_smem() + row);                \
    }
__device__ __forceinline__ unsigned smem_addr(const void* p) { return host_smem_offset(p); }
__device__ __forceinline__ unsigned smem_window(const void* p) { return host_smem_offset(p); }
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    host_cp_async16(dst, src, src_bytes);
}
__device__ __forceinline__ void cp_async16_at(unsigned dst, const void* src, int src_bytes) {
    host_cp_async16(host_dynamic_smem() + dst, src, src_bytes);
}
template <int OFF>
__device__ __forceinline__ void cp_async16_off(unsigned dst, const void* src, int src_bytes) {
    host_cp_async16(host_dynamic_smem() + dst + OFF, (const char*)src + OFF, src_bytes);
}
__device__ __forceinline__ void cp_async4(void* dst, const void* src, int src_bytes) {
    host_cp_async(dst, src, 4, src_bytes);
}
__device__ __forceinline__ void cp_async_commit() { host_cp_async_commit(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { host_cp_async_wait(N); }
#else
__device__ __forceinline__ unsigned storage_bits(storage_t x) { return x; }
__device__ __forceinline__ unsigned smem_addr(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// smem_addr as the compiler's own conversion, which it can fold into the
// dynamic shared memory's symbol (an immediate base) or keep from one use
// to the next.
__device__ __forceinline__ unsigned smem_window(const void* p) { return (unsigned)__cvta_generic_to_shared(p); }
__device__ __forceinline__ void mma_16816(float (&d)[4], const unsigned (&a)[4], unsigned b0, unsigned b1) {
#if STORAGE == 1
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
#else
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
#endif
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
#define LDMATRIX_ASM_1 "{%0}, [%1];" : "=r"(r[0]) : "r"(row)
#define LDMATRIX_ASM_2 "{%0,%1}, [%2];" : "=r"(r[0]), "=r"(r[1]) : "r"(row)
#define LDMATRIX_ASM_4 "{%0,%1,%2,%3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(row)
#define LDMATRIX_TRANS_0 ""
#define LDMATRIX_TRANS_1 ".trans"
// name_at takes the row's shared-window address (smem_addr).
#define LDMATRIX(name, count, trans)                                                                         \
    __device__ __forceinline__ void name##_at(unsigned (&r)[count], unsigned row) {                          \
        asm volatile("ldmatrix.sync.aligned.m8n8.x" #count LDMATRIX_TRANS_##trans ".shared.b16 "            \
                     LDMATRIX_ASM_##count);                                                                  \
    }                                                                                                        \
    __device__ __forceinline__ void name(unsigned (&r)[count], const void* row) { name##_at(r, smem_addr(row)); }
// dst as a shared-window address (smem_addr): unrolled copies to one tile
// then share a base register, their offsets immediates.
__device__ __forceinline__ void cp_async16_at(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
    cp_async16_at(smem_addr(dst), src, src_bytes);
}
// cp_async16_at of dst + OFF and src + OFF bytes, the offset an immediate
// of the instruction on both sides (one global pointer for a row's chunks).
template <int OFF>
__device__ __forceinline__ void cp_async16_off(unsigned dst, const void* src, int src_bytes) {
    asm volatile("cp.async.cg.shared.global [%0+%3], [%1+%3], 16, %2;" ::"r"(dst), "l"(src), "r"(src_bytes),
                 "n"(OFF)
                 : "memory");
}
// 4 bytes (through L1: .cg takes only 16).
__device__ __forceinline__ void cp_async4(void* dst, const void* src, int src_bytes) {
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_addr(dst)), "l"(src), "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}
#endif
LDMATRIX(ldmatrix_x1, 1, 0)
LDMATRIX(ldmatrix_x2, 2, 0)
LDMATRIX(ldmatrix_x4, 4, 0)
LDMATRIX(ldmatrix_x1_trans, 1, 1)
LDMATRIX(ldmatrix_x2_trans, 2, 1)
LDMATRIX(ldmatrix_x4_trans, 4, 1)

// A shared address the compiler cannot see through: addresses derived from
// it are formed where used (one base register, immediate offsets) rather
// than each hoisted out of the loop into a register of its own.
#if defined(FLASHATTN_HOST_EMULATION)
__device__ __forceinline__ unsigned opaque(unsigned a) { return a; }
#else
__device__ __forceinline__ unsigned opaque(unsigned a) {
    asm volatile("" : "+r"(a));
    return a;
}
#endif

// Two values rounded to storage, as one b32 operand (the lower index in
// the low half): one paired conversion (cvt.rn.{bf16x2,f16x2}.f32, whose
// first source goes to the high half) on the device.
#if defined(FLASHATTN_HOST_EMULATION)
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    return storage_bits(store_f32(lo)) | (storage_bits(store_f32(hi)) << 16);
}
#else
__device__ __forceinline__ unsigned pack2(float lo, float hi) {
    unsigned r;
#if STORAGE == 1
    asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#else
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
#endif
    return r;
}
#endif

// `rows` rows of a (batch, seqlen, heads, d) tensor from row0 into shared
// [rows][ROW], zeros past the tensor and past d. With d a multiple of 8 the
// rows are 16-byte aligned and go by cp.async (the caller commits and
// waits); otherwise element by element, visible after the next barrier.
__device__ __forceinline__ void load_rows(storage_t* tile, int rows, const storage_t* src, int b,
                                          int row0, int seqlen, int heads, int h, int d) {
    constexpr int CHUNKS = HEAD_DIM / 8;
    for (int e = threadIdx.x; e < rows * CHUNKS; e += blockDim.x) {
        const int r = e / CHUNKS, c = e % CHUNKS, i = row0 + r;
        storage_t* dst = tile + r * ROW + c * 8;
        const bool row_ok = i < seqlen;
        const storage_t* from = row_ok ? src + at(b, seqlen, i, heads, h, d) + c * 8 : src;
        if (d % 8 == 0) {
            cp_async16(dst, from, row_ok && c * 8 < d ? 16 : 0);
        } else {
            for (int x = 0; x < 8; ++x)
                dst[x] = row_ok && c * 8 + x < d ? from[x] : store_f32(0.0f);
        }
    }
}

// load_rows where d % 8 == 0, by THREADS threads, unrolled, as FA2 copies:
// TPR threads a row, each with G chunks of 16 bytes TPR apart, so that a
// warp's copies land as whole runs of 64 or 128 bytes of a few rows; rows
// STEP apart. The chunks' offsets are immediates from one shared base and
// one global pointer, which steps once a pass. `src` points at row0's head
// of a (rows, heads, d) tensor, `left` rows of which remain from row0 on,
// `stride` elements apart. Past the tensor nothing is read (src-size 0) and
// the chunk is zeros; INSIDE: every row is in the tensor (`left` is not
// read), only the columns are tested.
template <int ROWS, int THREADS, bool INSIDE = false>
__device__ __forceinline__ void load_rows_async(storage_t* tile, const storage_t* src, int left, size_t stride,
                                                int d) {
    constexpr int CHUNKS = HEAD_DIM / 8, TPR = CHUNKS % 8 == 0 ? 8 : 4, G = CHUNKS / TPR, STEP = THREADS / TPR;
    constexpr int E = sizeof(storage_t);
    static_assert(CHUNKS % TPR == 0 && THREADS % TPR == 0 && ROWS % STEP == 0, "whole passes of whole rows");
    static_assert(G <= 3, "head dims up to 128");
    const int r = threadIdx.x / TPR, c = threadIdx.x % TPR;
    const unsigned dst = smem_window(tile + r * ROW + c * 8);
    const storage_t* from = src + r * stride + c * 8;
#pragma unroll
    for (int k = 0; k < ROWS / STEP; ++k) {
        const unsigned at = dst + k * STEP * ROW * E;
        const bool row = INSIDE || k * STEP < left - r;
        cp_async16_off<0>(at, from, row && c * 8 < d ? 16 : 0);
        if constexpr (G > 1) cp_async16_off<TPR * 8 * E>(at, from, row && (c + TPR) * 8 < d ? 16 : 0);
        if constexpr (G > 2) cp_async16_off<2 * TPR * 8 * E>(at, from, row && (c + 2 * TPR) * 8 < d ? 16 : 0);
        from += STEP * stride;
    }
}

// load_rows_async's rows for any d: element by element in a rolled loop
// (few registers), visible after the next barrier.
__device__ __forceinline__ void load_rows_each(storage_t* tile, int rows, const storage_t* src, int left,
                                               size_t stride, int d) {
#pragma unroll 1
    for (int e = threadIdx.x; e < rows * HEAD_DIM; e += blockDim.x) {
        const int r = e / HEAD_DIM, c = e % HEAD_DIM;
        tile[r * ROW + c] = r < left && c < d ? src[r * stride + c] : store_f32(0.0f);
    }
}

// A streamed tile: ROWS rows from row0 on of head h of a (rows, heads, d)
// tensor into `tile`, `left` of them in it (zeros past), by THREADS
// threads: by cp.async in whole chunks where `aligned` (d % 8 == 0), no
// row tested where `inside` (every row in the tensor), else element by
// element. Callers pass constants where they can: each inlined copy then
// keeps one branch.
template <int ROWS, int THREADS>
__device__ __forceinline__ void stream_rows(storage_t* tile, const storage_t* src, size_t row0, int left, int heads,
                                            int h, int d, bool aligned, bool inside) {
    const storage_t* from = from_row(src, row0, heads, d) + h * d;
    const size_t stride = (size_t)heads * d;
    if (aligned && inside)
        load_rows_async<ROWS, THREADS, true>(tile, from, 0, stride, d);
    else if (aligned)
        load_rows_async<ROWS, THREADS>(tile, from, left, stride, d);
    else
        load_rows_each(tile, ROWS, from, left, stride, d);
}

// acc[MT][N/8][4] += A * B^T for one warp: A's MT x 16 rows and B's N rows
// of K elements, row-major in shared memory (ROW apart); each B fragment
// serves all MT row tiles. S = Q K^T, dP = dO V^T.
template <int MT, int N, int K>
__device__ __forceinline__ void mma_abt_rows(float (&acc)[MT][N / 8][4], const storage_t* a, const storage_t* b) {
    static_assert(N % 16 == 0 && K % 16 == 0, "whole ldmatrix.x4 loads");
    const int lane = threadIdx.x % 32;
    // Each lane's row addresses: one base per operand, the rest immediates.
    constexpr int E = sizeof(storage_t);
    const unsigned al = opaque(smem_addr(a + (lane % 16) * ROW + (lane / 16) * 8));
    const unsigned bl = opaque(smem_addr(b + ((lane / 16) * 8 + lane % 8) * ROW + ((lane / 8) % 2) * 8));
#pragma unroll
    for (int ks = 0; ks < K / 16; ++ks) {
        unsigned af[MT][4];
#pragma unroll
        for (int mi = 0; mi < MT; ++mi) ldmatrix_x4_at(af[mi], al + (mi * 16 * ROW + ks * 16) * E);
#pragma unroll
        for (int nt = 0; nt < N / 8; nt += 2) {
            // Matrices: (nt, k 0-7), (nt, k 8-15), (nt+1, k 0-7), (nt+1, k 8-15).
            unsigned bf[4];
            ldmatrix_x4_at(bf, bl + (nt * 8 * ROW + ks * 16) * E);
#pragma unroll
            for (int mi = 0; mi < MT; ++mi) {
                mma_16816(acc[mi][nt], af[mi], bf[0], bf[1]);
                mma_16816(acc[mi][nt + 1], af[mi], bf[2], bf[3]);
            }
        }
    }
}

// mma_abt_rows for one row tile (16 rows).
template <int N, int K>
__device__ __forceinline__ void mma_abt(float (&acc)[N / 8][4], const storage_t* a, const storage_t* b) {
    mma_abt_rows<1, N, K>(reinterpret_cast<float(&)[1][N / 8][4]>(acc), a, b);
}

// acc[MT][D/8][4] += P * B for one warp: P (MT x 16 rows x N) already
// rounded to storage as A fragments (pa[mi][kk]: keys 16kk..16kk+15 of row
// tile mi); B's N rows of D elements in shared memory, read transposed,
// each fragment serving all MT row tiles.
template <int MT, int N, int D>
__device__ __forceinline__ void mma_pv_rows(float (&acc)[MT][D / 8][4], const unsigned (&pa)[MT][N / 16][4],
                                            const storage_t* b) {
    const int lane = threadIdx.x % 32;
    constexpr int E = sizeof(storage_t);
    const unsigned bl = opaque(smem_addr(b + (lane % 8 + ((lane / 8) % 2) * 8) * ROW + (lane / 16) * 8));
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
#pragma unroll
        for (int dn = 0; dn < D / 8; dn += 2) {
            // Matrices: (k 0-7, dn), (k 8-15, dn), (k 0-7, dn+1), (k 8-15, dn+1).
            unsigned bf[4];
            ldmatrix_x4_trans_at(bf, bl + (kk * 16 * ROW + dn * 8) * E);
#pragma unroll
            for (int mi = 0; mi < MT; ++mi) {
                mma_16816(acc[mi][dn], pa[mi][kk], bf[0], bf[1]);
                mma_16816(acc[mi][dn + 1], pa[mi][kk], bf[2], bf[3]);
            }
        }
    }
}

// The A fragments of P (16 rows x N, in mma_abt's accumulator layout):
// FA2's register reuse, a C fragment pair is an A fragment.
template <int N>
__device__ __forceinline__ void pack_a(unsigned (&pa)[N / 16][4], const float (&pm)[N / 8][4]) {
#pragma unroll
    for (int kk = 0; kk < N / 16; ++kk) {
        pa[kk][0] = pack2(pm[2 * kk][0], pm[2 * kk][1]);
        pa[kk][1] = pack2(pm[2 * kk][2], pm[2 * kk][3]);
        pa[kk][2] = pack2(pm[2 * kk + 1][0], pm[2 * kk + 1][1]);
        pa[kk][3] = pack2(pm[2 * kk + 1][2], pm[2 * kk + 1][3]);
    }
}

// acc[D/8][4] += P * B for one warp's 16 rows, P (16 x N) in mma_abt's
// accumulator layout, rounded to storage here. O += P V, dV += P^T dO,
// dK += dS^T Q, dQ += dS K.
template <int N, int D>
__device__ __forceinline__ void mma_pv(float (&acc)[D / 8][4], const float (&pm)[N / 8][4],
                                       const storage_t* b) {
    unsigned pa[1][N / 16][4];
    pack_a<N>(pa[0], pm);
    mma_pv_rows<1, N, D>(reinterpret_cast<float(&)[1][D / 8][4]>(acc), pa, b);
}

// Max and sum over the quad of lanes that holds one accumulator row.
__device__ __forceinline__ float quad_max(float x) {
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

// The online softmax's new maxima for a lane's two accumulator rows (the
// tensor-core forwards): mx holds this lane's maxima of the tile and m's,
// and becomes the quad's; alpha rescales what l (and O) held; m moves on.
// Rows that have seen no allowed key keep m = -inf and add nothing.
__device__ __forceinline__ void online_max(float (&mx)[2], float (&m)[2], float (&l)[2], float (&alpha)[2]) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        mx[r] = quad_max(mx[r]);
        alpha[r] = mx[r] == NEG_INF ? 1.0f : expf(m[r] - mx[r]);
        l[r] *= alpha[r];
        m[r] = mx[r];
    }
}

// online_max with m in raw dot-product units and exponentials in base 2,
// the scale folded in (sl2 = scale · log2 e > 0, so the max commutes with
// it): ms[r] = m·sl2 is what each score's FFMA subtracts, 0 while a row has
// seen no key (every score then -inf, and 2^-inf = 0).
__device__ __forceinline__ void online_max_exp2(float (&mx)[2], float (&m)[2], float (&l)[2], float (&alpha)[2],
                                                float (&ms)[2], float sl2) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        mx[r] = quad_max(mx[r]);
        alpha[r] = mx[r] == NEG_INF ? 1.0f : exp2_approx((m[r] - mx[r]) * sl2);
        l[r] *= alpha[r];
        m[r] = mx[r];
        ms[r] = mx[r] == NEG_INF ? 0.0f : mx[r] * sl2;
    }
}

// One row's step of the online softmax in base 2 (the sm80 forward): mx is
// this lane's max of the tile's scores in log2 units (-inf: none allowed),
// and becomes the quad's; m (the running max, log2 units) moves on, l is
// rescaled, and the factor for what O held is returned. *ms gets what each
// score's exponent subtracts: m, or 0 while the row has seen no key (every
// score then -inf, and 2^-inf = 0). ANY: the tile allows a key in every
// row, so the new m is finite and needs no guard.
template <bool ANY>
__device__ __forceinline__ float online_step_log2(float mx, float& m, float& l, float* ms) {
    const float next = fmaxf(m, quad_max(mx));
    const float alpha = ANY || next != NEG_INF ? exp2_approx(m - next) : 1.0f;
    l *= alpha;
    m = next;
    *ms = ANY || next != NEG_INF ? next : 0.0f;
    return alpha;
}

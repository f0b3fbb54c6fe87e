// Hopper (sm_90a) building blocks of cuda/flash_fwd_wgmma.cu and
// cuda/flash_bwd_wgmma.cu, f16/bf16 storage or (the forward's IS_FP8
// variant) e4m3 codes: every wgmma, mbarrier,
// TMA copy and setmaxnreg goes through the few functions here, so that
// cuda/emulate/host.h can give each the PTX ISA's semantics and the
// kernels run on the CPU (tests/cuda.rs).
//
//   wgmma_ss<N> / wgmma_rs<N>  d[N/2] (+)= A (64 x 16) * B (16 x N), f32
//                      accumulators in mma.m16n8k16's C layout per warp of
//                      the warpgroup (warp w: rows 16w + l/4 and + 8;
//                      d[4c + e]: cols 8c + 2(l%4) + e%2, rows + 8 for e >= 2);
//                      A by descriptor (K-major) or from registers (the same
//                      per-warp A layout as mma.m16n8k16), B by descriptor,
//                      K-major or, transposed, MN-major. Asynchronous:
//                      (the FP8 forward: wgmma_ss_e4m3 / wgmma_rs_e4m3,
//                      m64nNk32 on e4m3 codes, both operands K-major, the
//                      PTX ISA allowing no transpose of 8-bit types; a
//                      register A fragment holds 4 codes a register: lane
//                      4g + t: a[0] row g, k 4t..4t+3 (lowest k in the low
//                      byte), a[1] row g + 8, a[2] and a[3] the same at k + 16)
//                      wgmma_fence before, wgmma_commit after, wgmma_wait<N>
//                      before the accumulators are touched.
//   smem_desc          a descriptor for a 128B-swizzled tile: rows of 128
//                      bytes in atoms of 8 rows (1024 B, 1024-aligned), the
//                      16-byte chunk index XORed with the row in the atom
//                      (TMA's CU_TENSOR_MAP_SWIZZLE_128B writes exactly this)
//   mbar_*             mbarriers: arrival count, transaction bytes, phase
//                      parity; mbar_wait bounded under FLASHATTN_BOUNDED_WAIT_MS
//   tma_load_4d        a box of a tensor map into shared memory, its bytes
//                      completing on an mbarrier; zeros outside the tensor
//   tma_store_4d       a box of shared memory into a tensor map's tensor,
//                      clipped at its bounds; after every writing thread's
//                      fence_proxy_async and a barrier, before bulk_commit
//                      and bulk_wait_read (the box read: it may be reused)
//   setmaxnreg_inc/dec registers per thread of a warpgroup's role
//   named_bar_sync/arrive<ID, COUNT>  barrier ID in 1..15 (0 is __syncthreads')
//                      over COUNT threads (whole warps): sync waits for the
//                      count, arrive counts itself and goes on (compile-time
//                      ids: ptxas then reserves only the barriers used)
//
// After cuda/mma.cuh, whose storage_bits, smem_addr, pack2, quad_max, online_max,
// quad_sum and DYNAMIC_SMEM it shares. Extra defines (src/cuda/kernel.rs):
// BLOCK_M, BLOCK_N, SMEM_BYTES.

// Bytes of one operand element: e4m3 codes in the FP8 forward, else f16/bf16.
#if IS_FP8
#define OPERAND_BYTES 1
#else
#define OPERAND_BYTES 2
#endif

// A CUtensorMap: 128 opaque bytes, 64-aligned, made by the host
// (cuTensorMapEncodeTiled) and passed by value as a __grid_constant__
// parameter. NVRTC has no cuda.h, hence our own declaration.
struct __align__(64) TensorMap {
    unsigned long long opaque[16];
};

// An mbarrier by its shared-window address (smem_addr): one 32-bit value a
// kernel keeps for all its barriers, `bars + i` the i-th after it (8 bytes
// each), where 64-bit generic pointers to each were registers apiece.
struct Bar {
    unsigned at;
    __device__ __forceinline__ Bar operator+(int i) const { return Bar{at + 8u * (unsigned)i}; }
};
__device__ __forceinline__ Bar bar_at(const void* p) { return Bar{smem_addr(p)}; }

#if defined(FLASHATTN_HOST_EMULATION)
inline unsigned long long* host_bar(Bar b) { return (unsigned long long*)(host_dynamic_smem() + b.at); }
__device__ __forceinline__ void wgmma_fence() { host_wgmma_fence(); }
__device__ __forceinline__ void wgmma_commit() { host_wgmma_commit(); }
template <int N>
__device__ __forceinline__ void wgmma_wait() { host_wgmma_wait(N); }
template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], unsigned long long a, unsigned long long b, int scale_d) {
    host_wgmma(d, N, nullptr, a, b, false, scale_d, bits_to_f32);
}
template <int N, int TRANS_B>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long b) {
    host_wgmma(d, N, a, 0, b, TRANS_B, 1, bits_to_f32);
}
template <int N>
__device__ __forceinline__ void wgmma_ss_tb(float (&d)[N / 2], unsigned long long a, unsigned long long b, int scale_d) {
    host_wgmma(d, N, nullptr, a, b, true, scale_d, bits_to_f32);
}
template <int N>
__device__ __forceinline__ void wgmma_ss_e4m3(float (&d)[N / 2], unsigned long long a, unsigned long long b,
                                              int scale_d) {
    host_wgmma(d, N, nullptr, a, b, false, scale_d, host_e4m3_to_f32, 1);
}
template <int N>
__device__ __forceinline__ void wgmma_rs_e4m3(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long b) {
    host_wgmma(d, N, a, 0, b, false, 1, host_e4m3_to_f32, 1);
}
// Four floats to e4m3 codes (round to nearest even, saturating at ±448),
// the first in the low byte, as cvt.rn.satfinite.e4m3x2.f32 pairs them.
__device__ __forceinline__ unsigned pack4_e4m3(float x0, float x1, float x2, float x3) {
    return host_e4m3_from_f32(x0) | host_e4m3_from_f32(x1) << 8 | host_e4m3_from_f32(x2) << 16 |
           (unsigned)host_e4m3_from_f32(x3) << 24;
}
__device__ __forceinline__ unsigned ld_shared_b32(unsigned at) {
    unsigned v;
    std::memcpy(&v, smem_at(at, 4, "ld.shared past the shared memory"), 4);
    return v;
}
// A writer of shared memory that others wait for by a barrier, made late
// here (as a slow warp may be on the chip): a reader that skips the barrier
// then reads the buffer unwritten or stale, or has its wgmma read it while
// it is written (a fault), instead of finding it done by chance.
__device__ __forceinline__ void emulation_lag() { host_lag(); }
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    const int v = std::atomic_ref<int>(*const_cast<int*>(p)).load(std::memory_order_acquire);
    std::this_thread::yield();  // a spin on it lets the threads it waits for run
    return v;
}
__device__ __forceinline__ void st_release_gpu(int* p, int v) {
    std::atomic_ref<int>(*p).store(v, std::memory_order_release);
}
__device__ __forceinline__ void fence_gpu() { std::atomic_thread_fence(std::memory_order_seq_cst); }
__device__ __forceinline__ void add_global_if(float* p, float v, bool ok) {
    if (ok) *p += v;
}
template <int N>
__device__ __forceinline__ void pin(float (&d)[N]) {}
template <int N>
__device__ __forceinline__ void pin(unsigned (&d)[N][4]) {}
__device__ __forceinline__ void mbar_init(Bar bar, unsigned count) { host_mbar_init(host_bar(bar), count); }
__device__ __forceinline__ void mbar_init_fence() {}
__device__ __forceinline__ void mbar_arrive(Bar bar) { host_mbar_arrive(host_bar(bar), 0); }
__device__ __forceinline__ void mbar_arrive_expect_tx(Bar bar, unsigned bytes) { host_mbar_arrive(host_bar(bar), bytes); }
__device__ __forceinline__ bool mbar_try_wait(Bar bar, unsigned parity) {
    return host_mbar_try_wait(host_bar(bar), parity);
}
__device__ __forceinline__ unsigned long long clock_ns() { return host_clock_ns(); }
__device__ __forceinline__ bool first_active_lane() { return true; }  // no warps here: each thread reports
__device__ __forceinline__ void trap() { host_trap(); }
__device__ __forceinline__ void tma_load_4d(void* dst, const TensorMap* map, int c0, int c1, int c2, int c3, Bar bar) {
    host_tma_load_4d(dst, map->opaque, c0, c1, c2, c3, host_bar(bar));
}
__device__ __forceinline__ void fence_proxy_async() { host_fence_proxy_async(); }
__device__ __forceinline__ void st_shared_b32(unsigned at, unsigned v) { host_st_shared(at, &v, 4); }
__device__ __forceinline__ void tma_store_4d(const TensorMap* map, int c0, int c1, int c2, int c3, const void* src) {
    host_tma_store_4d(src, map->opaque, c0, c1, c2, c3);
}
__device__ __forceinline__ void bulk_commit() {}
__device__ __forceinline__ void bulk_wait_read() { host_bulk_wait_read(); }
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() { host_setmaxnreg(REGS); }
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() { host_setmaxnreg(REGS); }
template <int ID, int COUNT>
__device__ __forceinline__ void named_bar_sync() { host_named_barrier(ID, COUNT, true); }
template <int ID, int COUNT>
__device__ __forceinline__ void named_bar_arrive() { host_named_barrier(ID, COUNT, false); }
#else
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void wgmma_wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
}
// Keeps the compiler from moving accumulator reads or writes across an
// asynchronous wgmma (CUTLASS's warpgroup_fence_operand): without it ptxas
// serializes the wgmmas (warning C7510) to stay safe.
template <int N>
__device__ __forceinline__ void pin(float (&d)[N]) {
#pragma unroll
    for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}
// The register A operand too: live (unchanged) until the wait after its wgmma.
template <int N>
__device__ __forceinline__ void pin(unsigned (&a)[N][4]) {
#pragma unroll
    for (int i = 0; i < N; ++i)
        asm volatile("" : "+r"(a[i][0]), "+r"(a[i][1]), "+r"(a[i][2]), "+r"(a[i][3])::"memory");
}
#if STORAGE == 1
#define WGMMA_TYPES ".f32.f16.f16"
#else
#define WGMMA_TYPES ".f32.bf16.bf16"
#endif
#define ACC8(d, i) \
    "+f"(d[i]), "+f"(d[i + 1]), "+f"(d[i + 2]), "+f"(d[i + 3]), "+f"(d[i + 4]), "+f"(d[i + 5]), "+f"(d[i + 6]), "+f"(d[i + 7])
#define ACC32(d) ACC8(d, 0), ACC8(d, 8), ACC8(d, 16), ACC8(d, 24)
#define ACC64(d) ACC32(d), ACC8(d, 32), ACC8(d, 40), ACC8(d, 48), ACC8(d, 56)
#define REGS32                                                                                            \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26," \
    "%27,%28,%29,%30,%31}"
#define REGS64                                                                                            \
    "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26," \
    "%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,%48,%49,%50,"    \
    "%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}"
// S = Q K^T: A and B both K-major in shared memory; scale_d 0 overwrites d.
template <int N>
__device__ __forceinline__ void wgmma_ss(float (&d)[N / 2], unsigned long long a, unsigned long long b, int scale_d);
template <>
__device__ __forceinline__ void wgmma_ss<128>(float (&d)[64], unsigned long long a, unsigned long long b, int scale_d) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16" WGMMA_TYPES " " REGS64
                 ", %64, %65, p, 1, 1, 0, 0; }"
                 : ACC64(d)
                 : "l"(a), "l"(b), "r"(scale_d));
}
// The backward's S^T = K Q^T and dP^T = V dO^T: 64 queries a step.
template <>
__device__ __forceinline__ void wgmma_ss<64>(float (&d)[32], unsigned long long a, unsigned long long b, int scale_d) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16" WGMMA_TYPES " " REGS32
                 ", %32, %33, p, 1, 1, 0, 0; }"
                 : ACC32(d)
                 : "l"(a), "l"(b), "r"(scale_d));
}
// O += P V: P from registers, B by descriptor (MN-major when TRANS_B).
template <int N, int TRANS_B>
__device__ __forceinline__ void wgmma_rs(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long b);
template <>
__device__ __forceinline__ void wgmma_rs<128, 1>(float (&d)[64], const unsigned (&a)[4], unsigned long long b) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k16" WGMMA_TYPES " " REGS64
                 ", {%64,%65,%66,%67}, %68, p, 1, 1, 1; }"
                 : ACC64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
template <>
__device__ __forceinline__ void wgmma_rs<64, 1>(float (&d)[32], const unsigned (&a)[4], unsigned long long b) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %37, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16" WGMMA_TYPES " " REGS32
                 ", {%32,%33,%34,%35}, %36, p, 1, 1, 1; }"
                 : ACC32(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
// dQ = dS K: A (dS) by descriptor K-major, B (K) by descriptor MN-major.
template <int N>
__device__ __forceinline__ void wgmma_ss_tb(float (&d)[N / 2], unsigned long long a, unsigned long long b, int scale_d);
template <>
__device__ __forceinline__ void wgmma_ss_tb<64>(float (&d)[32], unsigned long long a, unsigned long long b,
                                                int scale_d) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %34, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n64k16" WGMMA_TYPES " " REGS32
                 ", %32, %33, p, 1, 1, 0, 1; }"
                 : ACC32(d)
                 : "l"(a), "l"(b), "r"(scale_d));
}
// The FP8 forward's products (e4m3 codes, f32 accumulators, k 32 a step):
// S = Q K^T from descriptors, O += P V^T-in-shared-memory with P from
// registers; both B operands K-major (no transpose exists for 8-bit types).
template <int N>
__device__ __forceinline__ void wgmma_ss_e4m3(float (&d)[N / 2], unsigned long long a, unsigned long long b,
                                              int scale_d);
template <>
__device__ __forceinline__ void wgmma_ss_e4m3<128>(float (&d)[64], unsigned long long a, unsigned long long b,
                                                   int scale_d) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %66, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " REGS64 ", %64, %65, p, 1, 1; }"
                 : ACC64(d)
                 : "l"(a), "l"(b), "r"(scale_d));
}
template <int N>
__device__ __forceinline__ void wgmma_rs_e4m3(float (&d)[N / 2], const unsigned (&a)[4], unsigned long long b);
template <>
__device__ __forceinline__ void wgmma_rs_e4m3<128>(float (&d)[64], const unsigned (&a)[4], unsigned long long b) {
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %69, 0;\n"
                 "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 " REGS64
                 ", {%64,%65,%66,%67}, %68, p, 1, 1; }"
                 : ACC64(d)
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1));
}
// Four floats to e4m3 codes, the first in the low byte: two paired
// conversions (cvt puts its first source in the high half).
__device__ __forceinline__ unsigned pack4_e4m3(float x0, float x1, float x2, float x3) {
    unsigned short lo, hi;
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(lo) : "f"(x1), "f"(x0));
    asm("cvt.rn.satfinite.e4m3x2.f32 %0, %1, %2;" : "=h"(hi) : "f"(x3), "f"(x2));
    return (unsigned)lo | (unsigned)hi << 16;
}
__device__ __forceinline__ void emulation_lag() {}
// A load by shared-window address (after the barrier that made it valid).
__device__ __forceinline__ unsigned ld_shared_b32(unsigned at) {
    unsigned v;
    asm volatile("ld.shared.b32 %0, [%1];" : "=r"(v) : "r"(at) : "memory");
    return v;
}
// A semaphore in global memory between blocks: an acquire load at gpu
// scope (the spin's reads), a release store after fence_gpu.
__device__ __forceinline__ int ld_acquire_gpu(const int* p) {
    int v;
    asm volatile("ld.acquire.gpu.global.b32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_gpu(int* p, int v) {
    asm volatile("st.release.gpu.global.b32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void fence_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
// *p += v where ok, by predication (no branch: one around a loop after
// wgmma serialized them, C7520), through L2 only: another SM's earlier adds
// are never met in a stale L1 line.
__device__ __forceinline__ void add_global_if(float* p, float v, bool ok) {
    asm volatile(
        "{ .reg .pred q; .reg .f32 x; setp.ne.b32 q, %2, 0;\n"
        "@q ld.global.cg.f32 x, [%0]; @q add.f32 x, x, %1; @q st.global.cg.f32 [%0], x; }" ::"l"(p),
        "f"(v), "r"((int)ok)
        : "memory");
}
__device__ __forceinline__ void mbar_init(Bar bar, unsigned count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar.at), "r"(count) : "memory");
}
// Makes the initialized barriers visible to the copy engine (then a __syncthreads).
__device__ __forceinline__ void mbar_init_fence() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
__device__ __forceinline__ void mbar_arrive(Bar bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar.at) : "memory");
}
__device__ __forceinline__ void mbar_arrive_expect_tx(Bar bar, unsigned bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar.at), "r"(bytes) : "memory");
}
// Whether the phase of parity `parity` has completed (one try; the
// hardware may suspend the thread a while before it says no).
__device__ __forceinline__ bool mbar_try_wait(Bar bar, unsigned parity) {
    unsigned done;
    asm volatile("{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2; selp.u32 %0, 1, 0, p; }"
                 : "=r"(done)
                 : "r"(bar.at), "r"(parity)
                 : "memory");
    return done != 0;
}
__device__ __forceinline__ unsigned long long clock_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// The lowest lane of the warp among those here (one report per warp).
__device__ __forceinline__ bool first_active_lane() {
    return (__activemask() & ((1u << (threadIdx.x % 32)) - 1u)) == 0;
}
__device__ __forceinline__ void trap() { asm volatile("trap;"); }
// Coordinates innermost first, in elements: (column, head, row, batch).
__device__ __forceinline__ void tma_load_4d(void* dst, const TensorMap* map, int c0, int c1, int c2, int c3, Bar bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];" ::"r"(smem_addr(dst)),
        "l"(map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar.at)
        : "memory");
}
// Orders this thread's generic-proxy writes to shared memory before the
// async proxy's (TMA's) reads of them.
__device__ __forceinline__ void fence_proxy_async() { asm volatile("fence.proxy.async.shared::cta;" ::: "memory"); }
// A store by shared-window address: no 64-bit generic pointer kept for it.
__device__ __forceinline__ void st_shared_b32(unsigned at, unsigned v) {
    asm volatile("st.shared.b32 [%0], %1;" ::"r"(at), "r"(v) : "memory");
}
__device__ __forceinline__ void tma_store_4d(const TensorMap* map, int c0, int c1, int c2, int c3, const void* src) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];" ::"l"(map),
                 "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(smem_addr(src))
                 : "memory");
}
__device__ __forceinline__ void bulk_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Until the committed stores have read their shared memory.
__device__ __forceinline__ void bulk_wait_read() { asm volatile("cp.async.bulk.wait_group.read 0;" ::: "memory"); }
template <int REGS>
__device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(REGS));
}
template <int REGS>
__device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(REGS));
}
template <int ID, int COUNT>
__device__ __forceinline__ void named_bar_sync() {
    asm volatile("bar.sync %0, %1;" ::"n"(ID), "n"(COUNT) : "memory");
}
template <int ID, int COUNT>
__device__ __forceinline__ void named_bar_arrive() {
    asm volatile("bar.arrive %0, %1;" ::"n"(ID), "n"(COUNT) : "memory");
}
#endif

// Emulation always bounds the waits: a deadlock there is reported, not hung.
#if defined(FLASHATTN_HOST_EMULATION) && !defined(FLASHATTN_BOUNDED_WAIT_MS)
#define FLASHATTN_BOUNDED_WAIT_MS 10000
#endif

// Until the phase of parity `parity` of barrier `bar` (number `id` in the
// kernel's list) has completed. With FLASHATTN_BOUNDED_WAIT_MS (the GPU
// checks define it, src/cuda/compile.rs), a wait past that many
// milliseconds is a deadlock: the warp's first waiting lane prints where
// it is stuck and the thread traps, ending the launch with an error
// instead of hanging the process.
__device__ __forceinline__ void mbar_wait(Bar bar, unsigned parity, int id) {
#ifdef FLASHATTN_BOUNDED_WAIT_MS
    const unsigned long long start = clock_ns();
    while (!mbar_try_wait(bar, parity)) {
        if (clock_ns() - start > FLASHATTN_BOUNDED_WAIT_MS * 1000000ull) {
            if (first_active_lane())
                printf("flashattn: mbarrier wait timed out after %d ms: block (%u,%u,%u) thread %u barrier %d "
                       "phase parity %u\n",
                       FLASHATTN_BOUNDED_WAIT_MS, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, id, parity);
            trap();
        }
    }
#else
    while (!mbar_try_wait(bar, parity)) {
    }
#endif
}

// Until the semaphore at `sem` holds `value` (set by an earlier block of
// the grid, resident or finished: blocks start in index order), bounded as
// mbar_wait is.
__device__ __forceinline__ void sem_wait(const int* sem, int value) {
#ifdef FLASHATTN_BOUNDED_WAIT_MS
    const unsigned long long start = clock_ns();
    while (ld_acquire_gpu(sem) != value) {
        if (clock_ns() - start > FLASHATTN_BOUNDED_WAIT_MS * 1000000ull) {
            printf("flashattn: semaphore wait timed out after %d ms: block (%u,%u,%u) thread %u wants %d, has %d\n",
                   FLASHATTN_BOUNDED_WAIT_MS, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x, value,
                   ld_acquire_gpu(sem));
            trap();
        }
    }
#else
    while (ld_acquire_gpu(sem) != value) {
    }
#endif
}

// A wgmma shared-memory descriptor (PTX ISA, "Matrix Descriptor Format"):
// start address >> 4 in bits 0-13, leading byte offset >> 4 in 16-29,
// stride byte offset >> 4 in 32-45, swizzle mode 1 (128B) in bits 62-63.
// K-major: rows of 128 B along K, SBO = 1024 B between 8-row groups, LBO
// unused (1). MN-major: LBO = bytes between 64-element atoms along MN,
// SBO = 1024 B between groups of 8 along K.
__device__ __forceinline__ unsigned long long smem_desc(const void* p, unsigned lbo, unsigned sbo) {
    return (unsigned long long)((smem_addr(p) & 0x3ffff) >> 4) | (unsigned long long)(lbo >> 4) << 16 |
           (unsigned long long)(sbo >> 4) << 32 | 1ull << 62;
}

// Byte `offset` of a 1024-aligned tile in the 128B swizzle (TMA's and
// the descriptors'): the 16-byte chunk XOR the row in the 8-row atom.
// Row r of a lane's rows (0: its row g of each warp's 16, 1: g + 8) of a
// warpgroup's m64nHEAD_DIM accumulators, times `factor`, into `row`, a row
// of d elements (the columns past d not written).
__device__ __forceinline__ void store_acc_row(storage_t* row, const float (&acc)[HEAD_DIM / 2], int r, int d,
                                              float factor) {
    const int t = threadIdx.x % 4;
#pragma unroll
    for (int c = 0; c < HEAD_DIM / 8; ++c)
#pragma unroll
        for (int e = 0; e < 2; ++e) {
            const int col = c * 8 + 2 * t + e;
            if (col < d) row[col] = store_f32(acc[4 * c + 2 * r + e] * factor);
        }
}

__device__ __forceinline__ unsigned swizzled_128b(unsigned offset) { return offset ^ (((offset >> 7) & 7u) << 4); }

// A box of 128-byte rows (the 128B swizzle's width: 64 columns of 2-byte
// elements, or 128 e4m3 codes): the unit of every TMA copy and wgmma
// operand over the head dim.
#define BOX_BYTES(rows) ((rows) * 128)

// A descriptor as its two words, made once outside the loops: `desc_at`
// moves it `bytes` on (16-byte aligned) by one add to the low word, since
// shared addresses stay below 256 KiB and the 14-bit field cannot carry.
struct SmemDesc {
    unsigned lo, hi;
};
__device__ __forceinline__ SmemDesc smem_desc_words(const void* p, unsigned lbo, unsigned sbo) {
    const unsigned long long d = smem_desc(p, lbo, sbo);
    return {(unsigned)d, (unsigned)(d >> 32)};
}
__device__ __forceinline__ SmemDesc desc_moved(SmemDesc d, unsigned bytes) { return {d.lo + (bytes >> 4), d.hi}; }
__device__ __forceinline__ unsigned long long desc_at(SmemDesc d, unsigned bytes) {
    const SmemDesc at = desc_moved(d, bytes);
    return (unsigned long long)at.hi << 32 | at.lo;
}

// A product over the head dim with both operands K-major in shared memory,
// in boxes of 128-byte rows (`a_rows` and `b_rows` rows a box): steps of
// 32 bytes (k16 of 2-byte elements, or k32 of e4m3 codes under IS_FP8)
// inside a box, the next box past its 128 bytes. The first step overwrites d.
template <int N>
__device__ __forceinline__ void wgmma_ss_over_d(float (&d)[N / 2], SmemDesc a, unsigned a_rows, SmemDesc b,
                                                unsigned b_rows) {
#pragma unroll
    for (int ks = 0; ks < HEAD_DIM * OPERAND_BYTES / 32; ++ks) {
        const unsigned box = ks / 4, col = (ks % 4) * 32;
        const unsigned long long ad = desc_at(a, box * BOX_BYTES(a_rows) + col),
                                 bd = desc_at(b, box * BOX_BYTES(b_rows) + col);
#if IS_FP8
        wgmma_ss_e4m3<N>(d, ad, bd, ks > 0);
#else
        wgmma_ss<N>(d, ad, bd, ks > 0);
#endif
    }
}

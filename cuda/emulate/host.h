// The few CUDA built-ins the flashattn kernels use, on the CPU: one
// std::thread per CUDA thread, one block at a time, __syncthreads as a
// barrier and shuffles through a shared array between two barriers (every
// kernel calls them from all threads of a block). Slow and only for
// checking the kernels' logic where no GPU exists (tests/cuda.rs).
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <thread>
#include <vector>
#include <algorithm>

#define FLASHATTN_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(x)
#define __shared__ static
using std::max;
using std::min;

struct Dim { unsigned x = 1, y = 1, z = 1; };
thread_local Dim threadIdx, blockIdx;
Dim blockDim, gridDim;
static std::barrier<>* block_barrier;
static float shuffle_slots[1024];

inline void __syncthreads() { block_barrier->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float x, int w) {
    shuffle_slots[threadIdx.x] = x;
    __syncthreads();
    const float y = shuffle_slots[threadIdx.x ^ w];
    __syncthreads();
    return y;
}
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned float_bits(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }

// Storage conversions for cuda/common.cuh's host branch (which picks one
// by STORAGE, defined after this header).
inline _Float16 host_f16_store(float x) { return (_Float16)x; }
inline unsigned short host_bf16_store(float x) {  // round to nearest even (inputs are finite)
    const unsigned b = float_bits(x);
    return (unsigned short)((b + 0x7fffu + ((b >> 16) & 1u)) >> 16);
}
inline float host_bf16_load(unsigned short x) { return __uint_as_float((unsigned)x << 16); }

// Warp-collective operations (cuda/mma.cuh), emulated like the shuffles:
// each lane posts its operands, a barrier, each lane computes its own
// result from its warp's posts, a barrier. Fragment layouts follow the PTX
// ISA (mma.m16n8k16 .row.col for f16/bf16, ldmatrix .m8n8 .b16).
struct WarpPost {
    const unsigned char* row;
    uint32_t a[4], b[2];
};
static WarpPost warp_posts[1024];
static std::vector<unsigned char> dynamic_smem;
inline unsigned char* host_dynamic_smem() { return dynamic_smem.data(); }

[[noreturn]] inline void emulation_fault(const char* what) {
    std::fprintf(stderr, "emulation: %s (thread %u of block %u,%u,%u)\n", what, threadIdx.x, blockIdx.x, blockIdx.y,
                 blockIdx.z);
    std::abort();
}
// Shared-memory operands of ldmatrix and cp.async: inside the dynamic
// shared memory and 16-byte aligned, as the instructions require.
inline void check_shared_16(const void* p, const char* what) {
    const unsigned char* c = (const unsigned char*)p;
    if (c < dynamic_smem.data() || c + 16 > dynamic_smem.data() + dynamic_smem.size()) emulation_fault(what);
    if ((uintptr_t)c % 16) emulation_fault(what);
}

// ldmatrix.sync.aligned.m8n8.x{count}[.trans].shared.b16: lanes 8i..8i+7
// give the 16-byte rows of matrix i; lane l receives, for each i, elements
// (l/4, 2(l%4)) and (l/4, 2(l%4)+1) of it, or with .trans (2(l%4), l/4)
// and (2(l%4)+1, l/4), the first in the low half.
inline void host_ldmatrix(uint32_t* r, int count, bool trans, const void* row) {
    const unsigned lane = threadIdx.x % 32, base = threadIdx.x - lane;
    if (lane < 8u * count) check_shared_16(row, "ldmatrix row address");
    warp_posts[threadIdx.x].row = (const unsigned char*)row;
    __syncthreads();
    const unsigned g = lane / 4, t = lane % 4;
    for (int i = 0; i < count; ++i) {
        uint16_t lo, hi;
        const WarpPost* m = &warp_posts[base + 8 * i];
        if (!trans) {
            std::memcpy(&lo, m[g].row + 4 * t, 2);
            std::memcpy(&hi, m[g].row + 4 * t + 2, 2);
        } else {
            std::memcpy(&lo, m[2 * t].row + 2 * g, 2);
            std::memcpy(&hi, m[2 * t + 1].row + 2 * g, 2);
        }
        r[i] = lo | (uint32_t)hi << 16;
    }
    __syncthreads();
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: d += A * B for the
// warp, A 16x16 and B 16x8 gathered from the lanes' fragments (see
// cuda/mma.cuh), products summed in f32 in k order.
inline void host_mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                           float (*decode)(unsigned)) {
    const unsigned lane = threadIdx.x % 32, base = threadIdx.x - lane;
    WarpPost& mine = warp_posts[threadIdx.x];
    std::memcpy(mine.a, a, sizeof mine.a);
    mine.b[0] = b0;
    mine.b[1] = b1;
    __syncthreads();
    auto half = [](uint32_t w, int k) { return k % 2 ? w >> 16 : w & 0xffffu; };
    auto A = [&](int row, int col) {
        const uint32_t w = warp_posts[base + (row % 8) * 4 + (col % 8) / 2].a[(row >= 8) + 2 * (col >= 8)];
        return decode(half(w, col));
    };
    auto B = [&](int k, int n) { return decode(half(warp_posts[base + n * 4 + (k % 8) / 2].b[k >= 8], k)); };
    const int g = lane / 4, t = lane % 4;
    float out[4];
    for (int e = 0; e < 4; ++e) {
        const int row = g + 8 * (e / 2), col = 2 * t + e % 2;
        float acc = d[e];
        for (int k = 0; k < 16; ++k) acc = std::fma(A(row, k), B(k, col), acc);
        out[e] = acc;
    }
    __syncthreads();
    std::memcpy(d, out, sizeof out);
}

// cp.async.cg.shared.global, 16 bytes with zero fill past src_bytes: the
// copy is held back until a cp.async.wait_group retires its group, so a
// kernel that reads a tile before waiting reads stale data here too.
struct PendingCopy {
    void* dst;
    const void* src;
    int bytes;
};
thread_local std::vector<PendingCopy> open_copies;
thread_local std::vector<std::vector<PendingCopy>> committed_copies;
inline void host_cp_async16(void* dst, const void* src, int src_bytes) {
    check_shared_16(dst, "cp.async destination");
    if ((uintptr_t)src % 16) emulation_fault("cp.async source not 16-byte aligned");
    if (src_bytes < 0 || src_bytes > 16) emulation_fault("cp.async src-size past 16");
    open_copies.push_back({dst, src, src_bytes});
}
inline void host_cp_async_commit() {
    committed_copies.push_back(std::move(open_copies));
    open_copies.clear();
}
inline void host_cp_async_wait(int newest_pending) {
    while ((int)committed_copies.size() > newest_pending) {
        for (const PendingCopy& c : committed_copies.front()) {
            std::memset(c.dst, 0, 16);
            std::memcpy(c.dst, c.src, c.bytes);
        }
        committed_copies.erase(committed_copies.begin());
    }
}

// Run `kernel` on a grid, block by block, with `smem_bytes` of dynamic
// shared memory (filled with a NaN pattern: a read of what no one wrote shows).
template <class F>
void launch(Dim grid, unsigned threads, F kernel, size_t smem_bytes = 0) {
    gridDim = grid;
    blockDim = Dim{threads, 1, 1};
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                dynamic_smem.assign(smem_bytes, 0xff);
                std::barrier<> bar(threads);
                block_barrier = &bar;
                std::vector<std::thread> team;
                for (unsigned t = 0; t < threads; ++t)
                    team.emplace_back([&, t] {
                        threadIdx = Dim{t, 0, 0};
                        blockIdx = Dim{x, y, z};
                        kernel();
                        if (!open_copies.empty() || !committed_copies.empty())
                            emulation_fault("cp.async copies never waited for");
                    });
                for (auto& th : team) th.join();
            }
}

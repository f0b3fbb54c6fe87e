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

// Run `kernel` on a grid, block by block.
template <class F>
void launch(Dim grid, unsigned threads, F kernel) {
    gridDim = grid;
    blockDim = Dim{threads, 1, 1};
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                std::barrier<> bar(threads);
                block_barrier = &bar;
                std::vector<std::thread> team;
                for (unsigned t = 0; t < threads; ++t)
                    team.emplace_back([&, t] {
                        threadIdx = Dim{t, 0, 0};
                        blockIdx = Dim{x, y, z};
                        kernel();
                    });
                for (auto& th : team) th.join();
            }
}

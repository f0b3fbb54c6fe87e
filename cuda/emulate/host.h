// The few CUDA built-ins the flashattn kernels use, on the CPU: one
// std::thread per CUDA thread, one block at a time, __syncthreads as a
// block-wide barrier, shuffles and the warp-collective instructions
// through a shared array between two barriers of their warp, the
// warpgroup-collective ones (wgmma, setmaxnreg) between two of their
// warpgroup's (the Hopper kernel's warpgroups run different code). Slow
// and only for checking the kernels' logic where no GPU exists (tests/cuda.rs).
#include <atomic>
#include <barrier>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <fstream>
#include <map>
#include <memory>
#include <mutex>
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
#define __launch_bounds__(...)
#define __grid_constant__
#define __align__(n) alignas(n)
#define __shared__ static
using std::max;
using std::min;

struct Dim { unsigned x = 1, y = 1, z = 1; };
thread_local Dim threadIdx, blockIdx;
Dim blockDim, gridDim;
static std::barrier<>* block_barrier;
static std::vector<std::unique_ptr<std::barrier<>>> warp_barriers, warpgroup_barriers;
static float shuffle_slots[1024];

inline void __syncthreads() { block_barrier->arrive_and_wait(); }
inline void warp_sync() { warp_barriers[threadIdx.x / 32]->arrive_and_wait(); }
inline void warpgroup_sync() { warpgroup_barriers[threadIdx.x / 128]->arrive_and_wait(); }
inline void __syncwarp() { warp_sync(); }
inline unsigned atomicMax(unsigned* at, unsigned x) {
    std::atomic_ref<unsigned> a(*at);
    unsigned old = a.load();
    while (old < x && !a.compare_exchange_weak(old, x)) {
    }
    return old;
}
inline float __shfl_xor_sync(unsigned, float x, int w) {
    shuffle_slots[threadIdx.x] = x;
    warp_sync();
    const float y = shuffle_slots[threadIdx.x ^ w];
    warp_sync();
    return y;
}
static int shuffle_ints[1024];
inline int __shfl_sync(unsigned, int x, int lane) {
    shuffle_ints[threadIdx.x] = x;
    warp_sync();
    const int y = shuffle_ints[threadIdx.x / 32 * 32 + lane];
    warp_sync();
    return y;
}
static int vote_slots[1024];
inline int __any_sync(unsigned, int pred) {
    vote_slots[threadIdx.x] = pred != 0;
    warp_sync();
    int any = 0;
    for (unsigned l = threadIdx.x / 32 * 32; l < threadIdx.x / 32 * 32 + 32; ++l) any |= vote_slots[l];
    warp_sync();
    return any;
}
// prmt.b32 (selectors 0-7: the bytes of y:x, no sign replication).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const uint64_t v = (uint64_t)y << 32 | x;
    unsigned r = 0;
    for (int i = 0; i < 4; ++i) r |= (unsigned)(v >> (8 * ((s >> (4 * i)) & 7u)) & 0xffu) << (8 * i);
    return r;
}
inline float __int_as_float(int x) { float f; std::memcpy(&f, &x, 4); return f; }
inline float __uint_as_float(unsigned x) { float f; std::memcpy(&f, &x, 4); return f; }
inline unsigned float_bits(float f) { unsigned x; std::memcpy(&x, &f, 4); return x; }
inline unsigned __float_as_uint(float x) { return float_bits(x); }
inline long long __double_as_longlong(double x) { long long y; std::memcpy(&y, &x, 8); return y; }
// The round-to-nearest intrinsics (never contracted into an FMA on the
// device; the emulation builds for baseline x86-64, which has no FMA).
#define __fmul_rn(a, b) ((float)(a) * (float)(b))
#define __fdiv_rn(a, b) ((float)(a) / (float)(b))
#define __fadd_rn(a, b) ((float)(a) + (float)(b))
#define __fsub_rn(a, b) ((float)(a) - (float)(b))
#define __ddiv_rn(a, b) ((double)(a) / (double)(b))

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

// The harnesses' files (decode.cpp, quant.cpp and tests/cuda.rs): blobs,
// each a u64 length then its bytes; reading faults unless there are `count`.
static std::vector<std::vector<unsigned char>> read_blobs(const char* path, size_t count) {
    std::ifstream in(path, std::ios::binary);
    std::vector<std::vector<unsigned char>> blobs;
    unsigned long long n;
    while (in.read((char*)&n, 8)) {
        std::vector<unsigned char> b(n);
        if (n && !in.read((char*)b.data(), (std::streamsize)n)) emulation_fault("a truncated input blob");
        blobs.push_back(std::move(b));
    }
    if (blobs.size() != count) emulation_fault("the input has the wrong number of blobs");
    return blobs;
}
static void write_blob(std::ofstream& out, const void* p, size_t bytes) {
    const unsigned long long n = bytes;
    out.write((const char*)&n, 8);
    out.write((const char*)p, (std::streamsize)bytes);
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
    warp_sync();
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
    warp_sync();
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
    warp_sync();
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
    warp_sync();
    std::memcpy(d, out, sizeof out);
}

// cp.async.{cg,ca}.shared.global, 16 or 4 bytes with zero fill past
// src_bytes: the copy is held back until a cp.async.wait_group retires its
// group, so a kernel that reads a tile before waiting reads stale data
// here too.
struct PendingCopy {
    void* dst;
    const void* src;
    int bytes;
    int size;
};
thread_local std::vector<PendingCopy> open_copies;
thread_local std::vector<std::vector<PendingCopy>> committed_copies;
inline void host_cp_async(void* dst, const void* src, int size, int src_bytes) {
    const unsigned char* c = (const unsigned char*)dst;
    if (c < dynamic_smem.data() || c + size > dynamic_smem.data() + dynamic_smem.size() || (uintptr_t)c % size)
        emulation_fault("cp.async destination");
    if ((uintptr_t)src % size) emulation_fault("cp.async source not aligned to its size");
    if (src_bytes < 0 || src_bytes > size) emulation_fault("cp.async src-size past its size");
    open_copies.push_back({dst, src, src_bytes, size});
}
inline void host_cp_async16(void* dst, const void* src, int src_bytes) { host_cp_async(dst, src, 16, src_bytes); }
inline void host_cp_async_commit() {
    committed_copies.push_back(std::move(open_copies));
    open_copies.clear();
}
inline void host_cp_async_wait(int newest_pending) {
    while ((int)committed_copies.size() > newest_pending) {
        for (const PendingCopy& c : committed_copies.front()) {
            std::memset(c.dst, 0, c.size);
            std::memcpy(c.dst, c.src, c.bytes);
        }
        committed_copies.erase(committed_copies.begin());
    }
}

// ---- Hopper (cuda/hopper.cuh) ----
// Shared-memory addresses as the kernels see them: offsets into the
// dynamic shared memory (the 128B swizzle works on these, so a kernel
// that does not align its tiles to 1024 B goes wrong here as on the chip).
inline unsigned host_smem_offset(const void* p) {
    const unsigned char* c = (const unsigned char*)p;
    if (c < dynamic_smem.data() || c > dynamic_smem.data() + dynamic_smem.size())
        emulation_fault("shared-memory address outside the dynamic shared memory");
    return (unsigned)(c - dynamic_smem.data());
}
inline const unsigned char* smem_at(unsigned offset, unsigned bytes, const char* what) {
    if ((size_t)offset + bytes > dynamic_smem.size()) emulation_fault(what);
    return dynamic_smem.data() + offset;
}
// CU_TENSOR_MAP_SWIZZLE_128B and the wgmma descriptors' swizzle mode 1:
// the 16-byte chunk index (address bits 4-6) XOR the row in the 1024-byte
// atom (bits 7-9).
inline unsigned swizzle_128b(unsigned offset) { return offset ^ (((offset >> 7) & 7u) << 4); }

// What check.cpp writes into a TensorMap's 128 bytes in place of the
// driver's encoding: the same parameters src/cuda/tensor_map.rs passes it.
struct EmuTensorMap {
    const unsigned char* base;
    uint64_t dims[4];     // elements, innermost first
    uint64_t strides[3];  // bytes, dims 1..3
    uint32_t box[4];
    uint32_t elem_bytes;
};
static_assert(sizeof(EmuTensorMap) <= 128, "fits a CUtensorMap");

// mbarriers: a side table by address (the 8 bytes in shared memory stay
// untouched), arrival count, pending transaction bytes and phase, under one
// lock. A phase completes when its arrivals and its bytes are all in.
struct MbarState {
    int count = 0, pending = 0;
    long long tx = 0;
    unsigned phase = 0;
};
static std::mutex mbar_mutex;
static std::condition_variable mbar_changed;  // a phase completed, or a copy was issued
static std::map<const void*, MbarState> mbars;
// TMA copies in flight: performed only when someone waits on their
// barrier, so a kernel that reads a tile before waiting reads stale data.
struct PendingTma {
    unsigned dst;
    EmuTensorMap map;
    int coord[4];
    const void* bar;
};
static std::vector<PendingTma> tma_in_flight;
// The shared-memory bytes each committed, unretired wgmma group reads
// (under mbar_mutex): a TMA copy into them is a stage released too early,
// which the copy engine's lateness here would otherwise hide.
struct SmemRead {
    unsigned lo, hi, thread;
    unsigned long long group;
};
static std::vector<SmemRead> wgmma_reads;
thread_local unsigned long long wgmma_serial;

inline MbarState& mbar_state(const void* bar) {
    auto it = mbars.find(bar);
    if (it == mbars.end()) emulation_fault("mbarrier used before mbarrier.init");
    return it->second;
}
inline void mbar_complete_if_done(MbarState& m) {
    if (m.pending == 0 && m.tx == 0) {
        m.phase ^= 1u;
        m.pending = m.count;
        mbar_changed.notify_all();
    }
}
inline void host_mbar_init(unsigned long long* bar, unsigned count) {
    host_smem_offset(bar);
    if ((uintptr_t)bar % 8) emulation_fault("mbarrier not 8-byte aligned");
    std::lock_guard<std::mutex> lock(mbar_mutex);
    mbars[bar] = MbarState{(int)count, (int)count, 0, 0};
}
// mbarrier.arrive (tx 0) and mbarrier.arrive.expect_tx (tx bytes expected first).
inline void host_mbar_arrive(unsigned long long* bar, unsigned tx) {
    std::lock_guard<std::mutex> lock(mbar_mutex);
    MbarState& m = mbar_state(bar);
    m.tx += tx;
    if (--m.pending < 0) emulation_fault("more mbarrier arrivals than its count");
    mbar_complete_if_done(m);
}
// The copy engine's side: every copy in flight onto `bar` lands (lock held).
inline void tma_land(const void* bar) {
    for (size_t n = 0; n < tma_in_flight.size();) {
        PendingTma c = tma_in_flight[n];
        if (c.bar != bar) {
            ++n;
            continue;
        }
        tma_in_flight.erase(tma_in_flight.begin() + n);
        const EmuTensorMap& t = c.map;
        const unsigned eb = t.elem_bytes, row = t.box[0] * eb;
        unsigned long long bytes = 0, linear = 0;
        for (unsigned i3 = 0; i3 < t.box[3]; ++i3)
            for (unsigned i2 = 0; i2 < t.box[2]; ++i2)
                for (unsigned i1 = 0; i1 < t.box[1]; ++i1)
                    for (unsigned i0 = 0; i0 < t.box[0]; ++i0, linear += eb) {
                        const long long g[4] = {(long long)c.coord[0] + i0, (long long)c.coord[1] + i1,
                                                (long long)c.coord[2] + i2, (long long)c.coord[3] + i3};
                        bool inside = true;
                        for (int k = 0; k < 4; ++k) inside = inside && g[k] >= 0 && g[k] < (long long)t.dims[k];
                        unsigned char* dst = (unsigned char*)smem_at(swizzle_128b(c.dst + (unsigned)linear), eb,
                                                                     "TMA destination past the shared memory");
                        if (inside)
                            std::memcpy(dst, t.base + g[0] * eb + g[1] * t.strides[0] + g[2] * t.strides[1] +
                                                 g[3] * t.strides[2],
                                        eb);
                        else
                            std::memset(dst, 0, eb);  // out of bounds: zeros
                        bytes += eb;
                    }
        (void)row;
        MbarState& m = mbar_state(bar);
        m.tx -= (long long)bytes;
        mbar_complete_if_done(m);
    }
}
// mbarrier.try_wait.parity, once: done once the phase of that parity has
// completed, i.e. the current phase's parity differs. A "no" sleeps a
// little on a condition variable first (the chip suspends the thread a
// while too); cuda/hopper.cuh's mbar_wait loops and bounds the wait.
inline bool host_mbar_try_wait(unsigned long long* bar, unsigned parity) {
    std::unique_lock<std::mutex> lock(mbar_mutex);
    tma_land(bar);
    if (mbar_state(bar).phase != (parity & 1u)) return true;
    mbar_changed.wait_for(lock, std::chrono::milliseconds(20));
    tma_land(bar);
    return mbar_state(bar).phase != (parity & 1u);
}
inline unsigned long long host_clock_ns() {
    return (unsigned long long)std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
}
// PTX's trap: the launch ends in an error; here the process, after what was printed.
[[noreturn]] inline void host_trap() {
    std::fflush(stdout);
    std::fprintf(stderr, "emulation: trap (thread %u of block %u,%u,%u)\n", threadIdx.x, blockIdx.x, blockIdx.y,
                 blockIdx.z);
    std::abort();
}
// cp.async.bulk.tensor.4d ... mbarrier::complete_tx::bytes, 128B swizzle.
inline void host_tma_load_4d(void* dst, const unsigned long long* opaque, int c0, int c1, int c2, int c3,
                             unsigned long long* bar) {
    PendingTma c;
    c.dst = host_smem_offset(dst);
    if (c.dst % 1024) emulation_fault("TMA destination not 1024-byte aligned (128B swizzle atoms)");
    std::memcpy(&c.map, opaque, sizeof c.map);
    if (c.map.box[0] * c.map.elem_bytes != 128) emulation_fault("TMA box row is not the swizzle's 128 bytes");
    c.coord[0] = c0, c.coord[1] = c1, c.coord[2] = c2, c.coord[3] = c3;
    c.bar = bar;
    const unsigned bytes = c.map.box[0] * c.map.box[1] * c.map.box[2] * c.map.box[3] * c.map.elem_bytes;
    std::lock_guard<std::mutex> lock(mbar_mutex);
    mbar_state(bar);
    for (const SmemRead& r : wgmma_reads)
        if (c.dst < r.hi && r.lo < c.dst + bytes)
            emulation_fault("TMA copy over shared memory an unretired wgmma reads (a stage released too early)");
    tma_in_flight.push_back(c);
    mbar_changed.notify_all();  // its waiters land it
}

// cuda/hopper.cuh's emulation_lag: a writer others wait for, made
// FLASHATTN_EMULATION_LAG_MS late (tests/cuda.rs's injected-bug builds:
// emulated threads are slow, a reader that skipped its barrier needs the
// writer this late to overtake it); by default not at all.
inline void host_lag() {
#ifdef FLASHATTN_EMULATION_LAG_MS
    std::this_thread::sleep_for(std::chrono::milliseconds(FLASHATTN_EMULATION_LAG_MS));
#endif
}

// st.shared by address: a store into bytes an unretired wgmma group reads
// (the FP8 forward's V^T written before its readers released it) is a fault.
inline void host_st_shared(unsigned at, const void* v, unsigned bytes) {
    unsigned char* dst = (unsigned char*)smem_at(at, bytes, "st.shared past the shared memory");
    {
        std::lock_guard<std::mutex> lock(mbar_mutex);
        for (const SmemRead& r : wgmma_reads)
            if (at < r.hi && r.lo < at + bytes)
                emulation_fault("st.shared over shared memory an unretired wgmma reads (released too early)");
    }
    std::memcpy(dst, v, bytes);
}

// cp.async.bulk.tensor.4d.global.shared::cta (TMA stores): shared memory
// written by plain stores reaches the async proxy only after each writer's
// fence.proxy.async, so every thread of the issuing thread's warpgroup
// must have fenced since the warpgroup's last store (a missing fence is a
// fault, not a race that happens to work). The box is read, unswizzled
// and written inside the tensor's bounds at the issuer's wait_group.read.
static bool proxy_fenced[1024];
inline void host_fence_proxy_async() { proxy_fenced[threadIdx.x] = true; }
struct PendingStore {
    unsigned src;
    EmuTensorMap map;
    int coord[4];
};
thread_local std::vector<PendingStore> tma_stores;
inline void host_tma_store_4d(const void* src, const unsigned long long* opaque, int c0, int c1, int c2, int c3) {
    PendingStore s;
    s.src = host_smem_offset(src);
    if (s.src % 1024) emulation_fault("TMA store source not 1024-byte aligned (128B swizzle atoms)");
    std::memcpy(&s.map, opaque, sizeof s.map);
    if (s.map.box[0] * s.map.elem_bytes != 128) emulation_fault("TMA box row is not the swizzle's 128 bytes");
    s.coord[0] = c0, s.coord[1] = c1, s.coord[2] = c2, s.coord[3] = c3;
    const unsigned base = threadIdx.x / 128 * 128;
    for (unsigned t = base; t < base + 128 && t < blockDim.x; ++t)
        if (!proxy_fenced[t])
            emulation_fault("TMA store of shared memory without fence.proxy.async after the warpgroup's writes");
    tma_stores.push_back(s);
}
inline void host_bulk_wait_read() {
    const unsigned base = threadIdx.x / 128 * 128;
    for (unsigned t = base; t < base + 128 && t < blockDim.x; ++t) proxy_fenced[t] = false;
    for (const PendingStore& s : tma_stores) {
        const EmuTensorMap& t = s.map;
        const unsigned eb = t.elem_bytes;
        unsigned long long linear = 0;
        for (unsigned i3 = 0; i3 < t.box[3]; ++i3)
            for (unsigned i2 = 0; i2 < t.box[2]; ++i2)
                for (unsigned i1 = 0; i1 < t.box[1]; ++i1)
                    for (unsigned i0 = 0; i0 < t.box[0]; ++i0, linear += eb) {
                        const long long g[4] = {(long long)s.coord[0] + i0, (long long)s.coord[1] + i1,
                                                (long long)s.coord[2] + i2, (long long)s.coord[3] + i3};
                        bool inside = true;
                        for (int k = 0; k < 4; ++k) inside = inside && g[k] >= 0 && g[k] < (long long)t.dims[k];
                        const unsigned char* from = smem_at(swizzle_128b(s.src + (unsigned)linear), eb,
                                                            "TMA store source past the shared memory");
                        if (inside)  // clipped at the tensor's bounds
                            std::memcpy((unsigned char*)t.base + g[0] * eb + g[1] * t.strides[0] +
                                            g[2] * t.strides[1] + g[3] * t.strides[2],
                                        from, eb);
                    }
    }
    tma_stores.clear();
}

// setmaxnreg: nothing to do on the CPU but check what the chip requires,
// a multiple of 8 in 24..256, the same across the warpgroup.
static unsigned warpgroup_posts[1024];
inline void host_setmaxnreg(unsigned regs) {
    if (regs < 24 || regs > 256 || regs % 8) emulation_fault("setmaxnreg count not a multiple of 8 in 24..256");
    warpgroup_posts[threadIdx.x] = regs;
    warpgroup_sync();
    if (warpgroup_posts[threadIdx.x / 128 * 128] != regs) emulation_fault("setmaxnreg not warpgroup-uniform");
    warpgroup_sync();
}

// bar.sync / bar.arrive on named barriers 1..15: a generation count per
// barrier under a lock; sync sleeps until its generation's count is in.
struct NamedBarrier {
    int arrived = 0;
    unsigned long long generation = 0;
};
static NamedBarrier named_barriers[16];
static std::mutex named_mutex;
static std::condition_variable named_changed;
inline void host_named_barrier(int id, int count, bool wait) {
    if (id < 1 || id > 15) emulation_fault("named barrier id outside 1..15");
    if (count <= 0 || count % 32 || count > (int)blockDim.x) emulation_fault("named barrier count not whole warps");
    const auto start = std::chrono::steady_clock::now();
    std::unique_lock<std::mutex> lock(named_mutex);
    NamedBarrier& b = named_barriers[id];
    const unsigned long long mine = b.generation;
    if (++b.arrived == count) {
        b.arrived = 0;
        ++b.generation;
        named_changed.notify_all();
        return;
    }
    if (b.arrived > count) emulation_fault("named barrier: more arrivals than its count");
    while (wait && b.generation == mine) {
        named_changed.wait_for(lock, std::chrono::milliseconds(100));
        if (std::chrono::steady_clock::now() - start > std::chrono::seconds(10))
            emulation_fault("named barrier never completed (deadlock)");
    }
}

// e4m3 (e4m3fn) codes: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits,
// ±448 at most, 0x7f/0xff NaN. A wgmma fed a NaN code reads bytes no one
// wrote (the shared memory starts as 0xff) or a stale tile: a fault here.
inline float host_e4m3_to_f32(unsigned code) {
    code &= 0xffu;
    const unsigned e = (code >> 3) & 15u, m = code & 7u;
    if (e == 15 && m == 7) emulation_fault("wgmma operand is an e4m3 NaN code (0x7f/0xff): unwritten or stale shared memory");
    const float mag = e == 0 ? (float)m / 512.0f : std::ldexp((float)(8 + m), (int)e - 10);
    return code & 0x80u ? -mag : mag;
}
// cvt.rn.satfinite.e4m3.f32 of one value: nearest, ties to even, saturating
// at ±448 (NaN: 0x7f).
inline unsigned host_e4m3_from_f32(float x) {
    if (std::isnan(x)) return 0x7fu;
    const unsigned sign = std::signbit(x) ? 0x80u : 0u;
    const double a = std::fabs((double)x);
    if (a >= 448.0) return sign | 0x7eu;
    if (a == 0.0) return sign;
    int e;
    std::frexp(a, &e);  // a = f 2^e, f in [0.5, 1)
    int E = std::max(e - 1, -6);
    double n = std::nearbyint(std::ldexp(a, 3 - E));  // ties to even (the default rounding mode)
    if (n < 8) return sign | (unsigned)n;  // subnormal: multiples of 2^-9
    if (n == 16) n = 8, ++E;
    if (E > 8 || (E == 8 && n > 14)) return sign | 0x7eu;
    return sign | (unsigned)((E + 7) << 3) | (unsigned)(n - 8);
}

// wgmma.mma_async m64nNk16 (2-byte elements) or m64nNk32 (e4m3 codes),
// f32 accumulators. Issued collectively by a
// warpgroup: at the commit, between two warpgroup barriers, the group's
// descriptors are checked uniform and the register A fragments gathered;
// the product is computed at the wgmma.wait_group that retires the group,
// from shared memory as it is then, so a kernel that reads the
// accumulators, or lets a stage be overwritten, before waiting is caught.
struct WgmmaOp {
    float* d;
    int n;
    bool a_regs, trans_b, scale_d;
    unsigned long long a_desc, b_desc;
    uint32_t a[4];        // this thread's register A fragment
    float a_rows[2][32];  // this thread's rows of A (register A), gathered at the commit
    float (*decode)(unsigned);
    unsigned eb;  // bytes an element: 2, or 1 (e4m3); k = 32 / eb a step
};
static const std::vector<WgmmaOp>* wgmma_posts[1024];
thread_local std::vector<WgmmaOp> wgmma_open;
thread_local std::deque<std::vector<WgmmaOp>> wgmma_groups;
thread_local bool wgmma_fenced;

// Shared-memory element (row, k) of a K-major operand or (k, n) of an
// MN-major one, by the descriptor as the hardware decodes it, of `eb`-byte
// elements (8-bit ones K-major only, as the PTX ISA allows).
inline unsigned desc_offset(unsigned long long desc, bool mn_major, int mn, int k, unsigned eb = 2) {
    const unsigned start = (unsigned)(desc & 0x3fff) << 4, lbo = (unsigned)((desc >> 16) & 0x3fff) << 4,
                   sbo = (unsigned)((desc >> 32) & 0x3fff) << 4;
    if ((desc >> 62) != 1) emulation_fault("wgmma descriptor: swizzle mode is not 128B");
    if ((desc >> 49) & 7) emulation_fault("wgmma descriptor: nonzero base offset");
    if (mn_major && eb != 2) emulation_fault("wgmma: an 8-bit operand MN-major (transposed)");
    const unsigned linear = mn_major ? (k / 8) * sbo + (k % 8) * 128 + (mn / 64) * lbo + (mn % 64) * 2
                                     : (mn / 8) * sbo + (mn % 8) * 128 + k * eb;
    return swizzle_128b(start + linear);
}
inline float desc_load(unsigned long long desc, bool mn_major, int mn, int k, float (*decode)(unsigned),
                       unsigned eb = 2) {
    uint16_t bits = 0;
    std::memcpy(&bits, smem_at(desc_offset(desc, mn_major, mn, k, eb), eb, "wgmma operand past the shared memory"),
                eb);
    return decode(bits);
}
inline void host_wgmma_fence() { wgmma_fenced = true; }
// Bytes [lo, hi) an operand of `rows` (M or N) by one step's K (32 bytes) spans, whole 128-byte rows.
inline SmemRead operand_bytes(unsigned long long desc, bool mn_major, int rows, unsigned eb) {
    const unsigned last = desc_offset(desc, mn_major, rows - 1, 32 / eb - 1, eb);
    return SmemRead{desc_offset(desc, mn_major, 0, 0, eb) & ~127u, (last | 127u) + 1, threadIdx.x, wgmma_serial};
}
inline void host_wgmma(float* d, int n, const uint32_t* a, unsigned long long a_desc, unsigned long long b_desc,
                       bool trans_b, bool scale_d, float (*decode)(unsigned), unsigned eb = 2) {
    if (wgmma_open.empty() && !wgmma_fenced) emulation_fault("wgmma without a wgmma.fence before its group");
    if (blockDim.x % 128) emulation_fault("wgmma in a block of partial warpgroups");
    WgmmaOp op{d, n, a != nullptr, trans_b, scale_d, a_desc, b_desc, {}, {}, decode, eb};
    if (a) std::memcpy(op.a, a, sizeof op.a);
    wgmma_open.push_back(op);
}
inline void host_wgmma_commit() {
    const unsigned lane = threadIdx.x % 32, warp_base = threadIdx.x - lane, wg_base = threadIdx.x / 128 * 128;
    wgmma_posts[threadIdx.x] = &wgmma_open;
    warpgroup_sync();
    const std::vector<WgmmaOp>& lead = *wgmma_posts[wg_base];
    if (lead.size() != wgmma_open.size()) emulation_fault("wgmma groups differ in a warpgroup");
    for (size_t n = 0; n < wgmma_open.size(); ++n) {
        WgmmaOp& op = wgmma_open[n];
        if (lead[n].b_desc != op.b_desc || lead[n].n != op.n || (!op.a_regs && lead[n].a_desc != op.a_desc))
            emulation_fault("wgmma descriptors differ in a warpgroup");
        if (lead[n].eb != op.eb) emulation_fault("wgmma element types differ in a warpgroup");
        if (!op.a_regs) continue;
        // The A layout per warp, of e = 4 / eb elements a register and K =
        // 32 / eb: lane 4g + t holds row g, k e t.. (a[0]), row g + 8 (a[1]),
        // and both at k + K/2 (a[2], a[3]); the lowest k in the low bits
        // (mma.m16n8k16's for 2-byte elements, m16n8k32's for bytes).
        const unsigned g = lane / 4, per = 4 / op.eb, kk = 32 / op.eb, half = kk / 2, bits = 8 * op.eb;
        for (int r = 0; r < 2; ++r)
            for (unsigned k = 0; k < kk; ++k) {
                const uint32_t w = (*wgmma_posts[warp_base + g * 4 + (k % half) / per])[n].a[r + 2 * (k >= half)];
                const unsigned mask = op.eb == 2 ? 0xffffu : 0xffu;
                op.a_rows[r][k] = op.decode((w >> (bits * (k % per))) & mask);
            }
    }
    warpgroup_sync();
    {
        std::lock_guard<std::mutex> lock(mbar_mutex);
        for (const WgmmaOp& op : wgmma_open) {
            wgmma_reads.push_back(operand_bytes(op.b_desc, op.trans_b, op.n, op.eb));
            if (!op.a_regs) wgmma_reads.push_back(operand_bytes(op.a_desc, false, 64, op.eb));
        }
    }
    ++wgmma_serial;
    wgmma_groups.push_back(std::move(wgmma_open));
    wgmma_open.clear();
    wgmma_fenced = false;
}
inline void host_wgmma_wait(int newest_pending) {
    const unsigned lane = threadIdx.x % 32, g = lane / 4, t = lane % 4, row0 = (threadIdx.x / 32 % 4) * 16 + g;
    while ((int)wgmma_groups.size() > newest_pending) {
        for (const WgmmaOp& op : wgmma_groups.front()) {
            // This thread's two rows of A and n/4 columns of B, decoded once
            // (the products below read each n/8 or 2 times).
            const int kk = 32 / (int)op.eb;
            float a[2][32], b[64][32];
            if (op.n > 256 || op.n % 8) emulation_fault("wgmma n outside 8..256 in steps of 8");
            for (int r = 0; r < 2; ++r)
                for (int k = 0; k < kk; ++k)
                    a[r][k] = op.a_regs ? op.a_rows[r][k]
                                        : desc_load(op.a_desc, false, row0 + 8 * r, k, op.decode, op.eb);
            for (int j = 0; j < op.n / 4; ++j)
                for (int k = 0; k < kk; ++k)
                    b[j][k] = desc_load(op.b_desc, op.trans_b, 8 * (j / 2) + 2 * t + j % 2, k, op.decode, op.eb);
            for (int i = 0; i < op.n / 2; ++i) {
                const int c = i / 4, e = i % 4;
                float acc = op.scale_d ? op.d[i] : 0.0f;
                for (int k = 0; k < kk; ++k) acc = std::fma(a[e / 2][k], b[2 * c + e % 2][k], acc);
                op.d[i] = acc;
            }
        }
        wgmma_groups.pop_front();
        const unsigned long long retired = wgmma_serial - wgmma_groups.size() - 1;
        std::lock_guard<std::mutex> lock(mbar_mutex);
        std::erase_if(wgmma_reads,
                      [&](const SmemRead& r) { return r.thread == threadIdx.x && r.group == retired; });
    }
}

// Run `kernel` on a grid, block by block, with `smem_bytes` of dynamic
// shared memory (filled with a NaN pattern: a read of what no one wrote
// shows). Last block first, so that a block that writes into a later
// block's rows is not hidden by that block's writes coming after it; but
// `in_order` for a kernel whose blocks wait on earlier ones (the
// hardware's order of starting blocks).
template <class F>
void launch(Dim grid, unsigned threads, F kernel, size_t smem_bytes = 0, bool in_order = false) {
    gridDim = grid;
    blockDim = Dim{threads, 1, 1};
    const size_t blocks = (size_t)grid.x * grid.y * grid.z;
    for (size_t b = 0; b < blocks; ++b) {
        const size_t linear = in_order ? b : blocks - 1 - b;
        const unsigned x = (unsigned)(linear % grid.x), y = (unsigned)(linear / grid.x % grid.y),
                       z = (unsigned)(linear / grid.x / grid.y);
        dynamic_smem.assign(smem_bytes, 0xff);
        std::barrier<> bar(threads);
        block_barrier = &bar;
        warp_barriers.clear();
        warpgroup_barriers.clear();
        for (unsigned w = 0; w < threads; w += 32)
            warp_barriers.push_back(std::make_unique<std::barrier<>>(std::min(32u, threads - w)));
        for (unsigned w = 0; w < threads; w += 128)
            warpgroup_barriers.push_back(std::make_unique<std::barrier<>>(std::min(128u, threads - w)));
        mbars.clear();
        for (NamedBarrier& n : named_barriers) n = NamedBarrier{};
        std::fill(std::begin(proxy_fenced), std::end(proxy_fenced), false);
        std::vector<std::thread> team;
        for (unsigned t = 0; t < threads; ++t)
            team.emplace_back([&, t] {
                threadIdx = Dim{t, 0, 0};
                blockIdx = Dim{x, y, z};
                kernel();
                if (!open_copies.empty() || !committed_copies.empty())
                    emulation_fault("cp.async copies never waited for");
                if (!wgmma_open.empty() || !wgmma_groups.empty())
                    emulation_fault("wgmma never waited for");
                if (!tma_stores.empty()) emulation_fault("TMA stores never waited for (their reads)");
            });
        for (auto& th : team) th.join();
        if (!tma_in_flight.empty()) emulation_fault("TMA copies never waited for");
        for (const NamedBarrier& n : named_barriers)
            if (n.arrived) emulation_fault("a named barrier left with arrivals no sync met");
    }
}

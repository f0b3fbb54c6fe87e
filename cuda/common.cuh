// Shared pieces of the flashattn CUDA kernels, prepended to flash_fwd.cu and
// flash_bwd.cu by the host (src/cuda/kernel.rs) after the variant's defines:
//
//   HEAD_DIM      head dim padded to a multiple of 32 (the real one, `d`, is
//                 an argument; columns past it load as 0, so dot products are
//                 exact and nothing past `d` is written)
//   STORAGE       0 f32, 1 f16, 2 bf16 (math is f32 in every case)
//   HAS_BAND      a causal and/or local window mask (bounds are arguments)
//   HAS_SOFTCAP   s = C * tanh(s / C)
//   plus each kernel's tile sizes (BLOCK_M, BLOCK_N, THREADS_PER_ROW, ...).
//
// No headers: NVRTC then needs nothing but itself, and the f16/bf16
// conversions are single PTX instructions.

#if defined(FLASHATTN_HOST_EMULATION) && STORAGE == 1
// Run on the CPU by tests/cuda.rs through cuda/emulate/host.h (the asm
// below is device-only).
typedef _Float16 storage_t;
__device__ __forceinline__ float load_f32(storage_t x) { return (float)x; }
__device__ __forceinline__ storage_t store_f32(float x) { return host_f16_store(x); }
#elif defined(FLASHATTN_HOST_EMULATION) && STORAGE == 2
typedef unsigned short storage_t;
__device__ __forceinline__ float load_f32(storage_t x) { return host_bf16_load(x); }
__device__ __forceinline__ storage_t store_f32(float x) { return host_bf16_store(x); }
#elif STORAGE == 0
typedef float storage_t;
__device__ __forceinline__ float load_f32(storage_t x) { return x; }
__device__ __forceinline__ storage_t store_f32(float x) { return x; }
#elif STORAGE == 1
typedef unsigned short storage_t;
__device__ __forceinline__ float load_f32(storage_t x) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(x));
    return f;
}
__device__ __forceinline__ storage_t store_f32(float x) {
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
#else
typedef unsigned short storage_t;
__device__ __forceinline__ float load_f32(storage_t x) {
    return __uint_as_float(((unsigned int)x) << 16);
}
__device__ __forceinline__ storage_t store_f32(float x) {
    unsigned short h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(x));
    return h;
}
#endif

// What a materialized low-precision computation does to P and dS before
// the products that use them (SPEC.md): round to storage, keep f32.
__device__ __forceinline__ float round_storage(float x) { return load_f32(store_f32(x)); }

#define NEG_INF (-__int_as_float(0x7f800000))

// The sizes and score options of one call, identical for every kernel.
struct Problem {
    int seqlen_q, seqlen_k, heads_q, heads_kv, d;
    float scale, softcap;
    // Window bounds around the bottom-right diagonal; -1 is unbounded
    // (causal is right = 0). Only read when HAS_BAND.
    int left, right;
};

// src/cuda/problem.rs mirrors this struct field for field.
static_assert(sizeof(Problem) == 9 * 4, "Problem must stay nine 4-byte fields");

__device__ __forceinline__ int band_offset(const Problem& p) { return p.seqlen_k - p.seqlen_q; }

// Whether query row i may attend to key j (SPEC.md's masks; bounds included).
__device__ __forceinline__ bool allowed(const Problem& p, int i, int j) {
    if (j < 0 || j >= p.seqlen_k || i >= p.seqlen_q) return false;
#if HAS_BAND
    const int center = i + band_offset(p);
    if (p.left >= 0 && j < center - p.left) return false;
    if (p.right >= 0 && j > center + p.right) return false;
#endif
    return true;
}

// Keys [*lo, *hi) any of rows [i0, i1) may see: the tiles outside are never loaded.
__device__ __forceinline__ void key_span(const Problem& p, int i0, int i1, int* lo, int* hi) {
    *lo = 0;
    *hi = p.seqlen_k;
#if HAS_BAND
    const int off = band_offset(p);
    if (p.left >= 0) *lo = max(0, i0 + off - p.left);
    if (p.right >= 0) *hi = min(p.seqlen_k, i1 - 1 + off + p.right + 1);
#endif
}

// Query rows [*lo, *hi) that see any of keys [j0, j1) (the backward's dK/dV loop).
__device__ __forceinline__ void row_span(const Problem& p, int j0, int j1, int* lo, int* hi) {
    *lo = 0;
    *hi = p.seqlen_q;
#if HAS_BAND
    const int off = band_offset(p);
    if (p.right >= 0) *lo = max(0, j0 - off - p.right);
    if (p.left >= 0) *hi = min(p.seqlen_q, j1 - 1 - off + p.left + 1);
#endif
}

// The final score from a raw dot product; *dcap gets ds/ds_raw (the
// softcap's derivative, 1 without one) for the backward.
__device__ __forceinline__ float score(const Problem& p, float dot, float* dcap) {
    float s = dot * p.scale;
#if HAS_SOFTCAP
    const float t = tanhf(s / p.softcap);
    *dcap = 1.0f - t * t;
    s = p.softcap * t;
#else
    *dcap = 1.0f;
#endif
    return s;
}

// Row-major (batch, seqlen, heads, d) element offset.
__device__ __forceinline__ size_t at(int b, int seqlen, int i, int heads, int h, int d) {
    return (((size_t)b * seqlen + i) * heads + h) * (size_t)d;
}

// Load `rows` rows of a (batch, seqlen, heads, d) tensor starting at row0
// into a padded f32 tile [rows][HEAD_DIM + 1] (the +1 spreads the columns
// of one row across banks); rows and columns past the tensor load 0.
__device__ __forceinline__ void load_tile(float* tile, int rows, const storage_t* src, int b,
                                          int row0, int seqlen, int heads, int h, int d) {
    for (int e = threadIdx.x; e < rows * HEAD_DIM; e += blockDim.x) {
        const int r = e / HEAD_DIM, c = e % HEAD_DIM;
        const int i = row0 + r;
        float x = 0.0f;
        if (i < seqlen && c < d) x = load_f32(src[at(b, seqlen, i, heads, h, d) + c]);
        tile[r * (HEAD_DIM + 1) + c] = x;
    }
}

__device__ __forceinline__ float dot_rows(const float* a, const float* b) {
    float s = 0.0f;
#pragma unroll 8
    for (int c = 0; c < HEAD_DIM; ++c) s = fmaf(a[c], b[c], s);
    return s;
}

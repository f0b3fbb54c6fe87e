// Philox4x32-10 and dropout's keep bit: the same values as src/philox.rs,
// src/api/dropout.rs and shaders/philox.wgsl, bit for bit
// (docs/dropout.md has the mapping). Device functions only, put before
// cuda/dropout.cuh in every kernel's source by src/cuda/kernel.rs; the host
// emulation (cuda/emulate/host.h) compiles them as plain C++.

#define PHILOX_M0 0xD2511F53u
#define PHILOX_M1 0xCD9E8D57u
#define PHILOX_W0 0x9E3779B9u
#define PHILOX_W1 0xBB67AE85u

struct Philox4 {
    unsigned int x, y, z, w;
};

// The high word of a * b (__umulhi on the device).
__device__ __forceinline__ unsigned int philox_mulhi(unsigned int a, unsigned int b) {
#ifdef __CUDA_ARCH__
    return __umulhi(a, b);
#else
    return (unsigned int)(((unsigned long long)a * b) >> 32);
#endif
}

__device__ __forceinline__ Philox4 philox4x32_10(Philox4 c, unsigned int k0, unsigned int k1) {
#pragma unroll
    for (int r = 0; r < 10; ++r) {
        if (r > 0) {
            k0 += PHILOX_W0;
            k1 += PHILOX_W1;
        }
        const unsigned int hi0 = philox_mulhi(PHILOX_M0, c.x), lo0 = PHILOX_M0 * c.x;
        const unsigned int hi1 = philox_mulhi(PHILOX_M1, c.z), lo1 = PHILOX_M1 * c.z;
        c = Philox4{hi1 ^ c.y ^ k0, lo1, hi0 ^ c.w ^ k1, lo0};
    }
    return c;
}

// Whether element (row, col) of the stream (s0, s1) = offset + batch *
// heads_q + head is kept: its 16 bits of the call covering columns
// (col & ~7) .. (col | 7) are at least `threshold`.
__device__ __forceinline__ bool dropout_keeps(unsigned int k0, unsigned int k1, unsigned int s0,
                                              unsigned int s1, unsigned int threshold,
                                              unsigned int row, unsigned int col) {
    const Philox4 out = philox4x32_10(Philox4{col >> 3, row, s0, s1}, k0, k1);
    const unsigned int e = col & 7u;
    const unsigned int word = e < 2 ? out.x : e < 4 ? out.y : e < 6 ? out.z : out.w;
    return ((word >> (16u * (e & 1u))) & 0xffffu) >= threshold;
}

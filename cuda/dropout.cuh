// Dropout in the attention kernels (docs/dropout.md), on cuda/philox.cuh:
// what a call passes (`Dropout`, every attention kernel's last argument),
// the keep bits of a tile of pairs, and what the kernels do with them.
// Without HAS_DROPOUT (p = 0) the tile holds nothing, every pair is kept
// and each function returns its input, so the kernels compile to the code
// they have without dropout (the argument is then never read).
//
// A block draws a tile's bits together, one Philox call per row and 8
// keys, into shared memory where the tile's operands load (before the
// barrier that publishes them, so no barrier of its own); each lane then
// reads the bits of the pairs it owns.

// src/cuda/problem.rs's `DropoutArgs` mirrors this struct field for field.
struct Dropout {
    unsigned int key0, key1;        // the seed, low and high words
    unsigned int stream0, stream1;  // the call's first stream (its offset), low and high words
    unsigned int threshold;         // kept iff an element's 16 bits are at least this
    float scale;                    // 1 / (1 - p)
};
static_assert(sizeof(Dropout) == 6 * 4, "Dropout must stay six 4-byte fields");

// The keep bits of a ROWS x COLS tile of (query row, key) pairs: byte
// r * COLS / 8 + c / 8, bit c % 8 is pair (r, c).
template <int ROWS, int COLS>
struct KeepTile {
    static_assert(COLS % 8 == 0, "whole Philox calls: 8 keys each");
#if HAS_DROPOUT
    __align__(4) unsigned char bits[ROWS * COLS / 8];
#endif

    // Query rows row0.. against keys col0.. (a multiple of 8; both in the
    // sequence) of sequence `seq`, query head h: stream offset + seq *
    // heads_q + h (64-bit, wrapping). The block's threads together;
    // visible after the next barrier.
    __device__ __forceinline__ void fill(const Dropout& D, int heads_q, int seq, int h, int row0, int col0) {
#if HAS_DROPOUT
        const unsigned long long stream = ((unsigned long long)D.stream1 << 32 | D.stream0) +
                                          (unsigned long long)seq * (unsigned)heads_q + (unsigned)h;
        constexpr int GROUPS = COLS / 8;
        for (int e = threadIdx.x; e < ROWS * GROUPS; e += blockDim.x) {
            const Philox4 r = philox4x32_10(
                Philox4{(unsigned)(col0 / 8 + e % GROUPS), (unsigned)(row0 + e / GROUPS), (unsigned)stream,
                        (unsigned)(stream >> 32)},
                D.key0, D.key1);
            const unsigned int w[4] = {r.x, r.y, r.z, r.w};
            unsigned int byte = 0;
#pragma unroll
            for (int k = 0; k < 8; ++k)
                byte |= (unsigned)(((w[k >> 1] >> (16 * (k & 1))) & 0xffffu) >= D.threshold) << k;
            bits[e] = (unsigned char)byte;
        }
#endif
    }

#if HAS_DROPOUT
    // Whether pair (r, c) of the tile is kept (the kernels ask through KEPT).
    __device__ __forceinline__ bool kept(int r, int c) const { return (bits[r * (COLS / 8) + c / 8] >> (c % 8)) & 1u; }
    // Row r's pairs 32w..32w+31 at once, bit c % 32 (the byte order above, little-endian).
    __device__ __forceinline__ unsigned word(int r, int w) const {
        static_assert(COLS % 32 == 0, "whole words per row");
        return ((const unsigned*)bits)[r * (COLS / 32) + w];
    }
#endif
};

// KEPT(tile, r, c): tile.kept(r, c), and without dropout `true` before the
// compiler sees the index arithmetic (which, dead as it is, still moved the
// sm80 forward's register choices).
#if HAS_DROPOUT
#define KEPT(tile, r, c) (tile).kept(r, c)
#else
#define KEPT(tile, r, c) true
#endif

// P where kept, 0 where dropped: what P·V and dV take (the row sums take
// the undropped P: the LSE is the undropped one).
__device__ __forceinline__ float dropped(float x, bool kept) { return kept ? x : 0.0f; }

// A sum of kept P times 1 / (1 - p): O's normalization, dV's sums.
__device__ __forceinline__ float keep_scaled(const Dropout& D, float x) {
#if HAS_DROPOUT
    return x * D.scale;
#else
    return x;
#endif
}

// dP' = dP * keep / (1 - p), the backward's dP under dropout.
__device__ __forceinline__ float dropout_dp(const Dropout& D, float dp, bool kept) {
#if HAS_DROPOUT
    return kept ? dp * D.scale : 0.0f;
#else
    return dp;
#endif
}

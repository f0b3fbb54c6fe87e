// The FP8 forward's quantization (docs/semantics.md "FP8 (e4m3)"): q, k
// and v in f32 to e4m3 codes with one f32 scale per (batch, head), q and k
// first through the seeded Walsh–Hadamard transform when asked, bit for bit
// src/quant.rs's codes and scales. Two launches per tensor over the same
// rows, a warp a row:
//
//   fp8_absmax  each (batch, head)'s max |x| of its transformed rows, by
//               atomicMax on the f32 bits (non-negative floats order as
//               their bits, so the result is the exact maximum, whatever
//               the order)
//   fp8_codes   the head's scale (quant.rs's head_scale), the row
//               transformed again (the same operations: the same bits) and
//               its codes, zeros past the quantized elements up to the
//               stored row of HEAD_DIM codes (the FP8 forward's padded head
//               dim); a head's first row writes its scale
//
// The transform runs in the order quant.rs's Hadamard::apply does: signs,
// butterflies h = 1, 2, 4, … pairing j with j + h, then 1/√n, each result's
// subnormals flushed; f32 adds, subtracts and products by the _rn
// intrinsics (never contracted into an FMA).

#define QUANT_WARPS 4
#define QUANT_THREADS (QUANT_WARPS * 32)

// src/cuda/fp8_quant.rs's `QuantArgs`, field for field.
struct QuantArgs {
    int rows;      // batch · seqlen · heads
    int seqlen, heads;
    int d;         // elements of an input row
    int dim;       // elements of a quantized row: d, or the transform's order
    int hadamard;  // 1: through the transform (signs, 1/√dim = norm)
    float norm;
};
static_assert(sizeof(QuantArgs) == 7 * 4, "QuantArgs must stay six ints and a float");

// 2^-117: below it a head's max / 448 would not be a normal f32 (quant.rs's MIN_ABSMAX).
#define MIN_ABSMAX __int_as_float(10 << 23)

// Row r of x, transformed, into buf (dim floats) by the warp's lanes.
__device__ __forceinline__ void transformed_row(const float* x, const float* signs, float* buf, int r,
                                                const QuantArgs& a, int lane) {
    for (int i = lane; i < a.dim; i += 32) {
        const float v = i < a.d ? flushed(x[(size_t)r * a.d + i]) : 0.0f;
        buf[i] = a.hadamard ? v * signs[i] : v;  // ±1: exact
    }
    if (a.hadamard) {
        for (int h = 1; h < a.dim; h *= 2) {
            __syncwarp();
            // Pair p of this stage: elements j and j + h, one lane's alone.
            for (int p = lane; p < a.dim / 2; p += 32) {
                const int j = p / h * 2 * h + p % h;
                const float u = buf[j], w = buf[j + h];
                buf[j] = flushed(__fadd_rn(u, w));
                buf[j + h] = flushed(__fsub_rn(u, w));
            }
        }
        __syncwarp();
        for (int i = lane; i < a.dim; i += 32) buf[i] = flushed(__fmul_rn(buf[i], a.norm));
    }
    __syncwarp();
}

// The (batch, head) of row r of a (batch, seqlen, heads) tensor.
__device__ __forceinline__ int row_head(int r, const QuantArgs& a) {
    return r / (a.seqlen * a.heads) * a.heads + r % a.heads;
}

extern "C" __global__ void __launch_bounds__(QUANT_THREADS)
fp8_absmax(const float* __restrict__ x, const float* __restrict__ signs, unsigned* __restrict__ absmax,
           const QuantArgs a) {
    __shared__ float rows[QUANT_WARPS][HEAD_DIM];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r = blockIdx.x * QUANT_WARPS + warp;
    if (r >= a.rows) return;
    transformed_row(x, signs, rows[warp], r, a, lane);
    float m = 0.0f;
    for (int i = lane; i < a.dim; i += 32) m = fmaxf(m, fabsf(rows[warp][i]));
    for (int w = 16; w > 0; w /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, w));
    if (lane == 0) atomicMax(absmax + row_head(r, a), __float_as_uint(m));
}

extern "C" __global__ void __launch_bounds__(QUANT_THREADS)
fp8_codes(const float* __restrict__ x, const float* __restrict__ signs, const unsigned* __restrict__ absmax,
          float* __restrict__ scales, unsigned char* __restrict__ codes, const QuantArgs a) {
    __shared__ float rows[QUANT_WARPS][HEAD_DIM];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int r = blockIdx.x * QUANT_WARPS + warp;
    if (r >= a.rows) return;
    transformed_row(x, signs, rows[warp], r, a, lane);
    const int bh = row_head(r, a);
    const float top = __uint_as_float(absmax[bh]);
    const float scale = top < MIN_ABSMAX ? 0.0f : __fdiv_rn(top, 448.0f);
    if (lane == 0 && r / a.heads % a.seqlen == 0) scales[bh] = scale;
    for (int i = lane; i < HEAD_DIM; i += 32) {
        const float v = i < a.dim ? rows[warp][i] : 0.0f;
        // The exact quotient rounded: the f64 quotient of two f32s rounds like it (quant.rs).
        codes[(size_t)r * HEAD_DIM + i] = scale == 0.0f || v == 0.0f ? 0 : e4m3_of(__ddiv_rn((double)v, (double)scale));
    }
}

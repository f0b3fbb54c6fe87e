// e4m3 (FP8, `e4m3fn`) codes exactly as src/quant.rs defines them, shared by
// the quantized KV cache (cuda/flash_decode.cu) and the FP8 forward's
// quantization (cuda/fp8_quant.cu). Only IEEE-exact operations: the f64
// quotient of two f32s and its rounding, which is the host rule's own
// arithmetic, so codes match it bit for bit.

// A subnormal f32 counts as 0 (quant.rs's flush).
__device__ __forceinline__ float flushed(float x) { return (__float_as_uint(x) & 0x7f800000u) == 0u ? 0.0f : x; }

// The value of e4m3 code c (exact in f32; 0x7f/0xff, NaN, are never stored).
__device__ __forceinline__ float e4m3_value(unsigned char c) {
    const unsigned e = (c >> 3) & 15u, m = c & 7u;
    // Subnormal: m · 2^-9; normal: (8 + m) · 2^(e - 10), i.e. 1.m · 2^(e - 7).
    const float mag = e == 0 ? (float)m * (1.0f / 512.0f) : __uint_as_float((e + 120u) << 23 | m << 20);
    return c & 0x80u ? -mag : mag;
}

// quant.rs's e4m3_from_f64: x rounded to e4m3, ties to even, saturating at ±448.
__device__ __forceinline__ unsigned char e4m3_of(double x) {
    const unsigned sign = x < 0.0 ? 0x80u : 0u;
    const double a = fabs(x);
    if (a >= 448.0) return (unsigned char)(sign | 0x7eu);
    if (a == 0.0) return 0;
    int e = (int)((__double_as_longlong(a) >> 52) & 0x7ff) - 1023;
    const int step = max(e, -6) - 3;
    unsigned n = (unsigned)rint(ldexp(a, -step));
    unsigned code;
    if (e >= -6) {
        if (n == 16) {
            n = 8;
            e += 1;
        }
        code = e > 8 || (e == 8 && n > 14) ? 0x7eu : ((unsigned)(e + 7) << 3) | (n - 8);
    } else {
        code = n;  // subnormal: n multiples of 2^-9
    }
    return code == 0 ? 0 : (unsigned char)(sign | code);
}

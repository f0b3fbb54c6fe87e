//! A KV cache's stored elements as operands of the micro-kernels
//! ([`Operand`]): each load widens 16 of them to their exact f32 values in
//! registers, so decoding reads an f16, bf16, int8 or FP8 cache's bytes in
//! place, with no f32 copy of the cache. A quantized cache's block scale is
//! not applied here: decoding multiplies each key's score by its K scale
//! and each probability by its V scale instead (the same values up to f32
//! rounding, which the accuracy rule allows).

use super::micro::Operand;
use bytemuck::TransparentWrapper;

/// A symmetric int8 code: its value is the signed byte.
#[derive(Clone, Copy, TransparentWrapper)]
#[repr(transparent)]
pub(crate) struct Int8Code(u8);

/// An FP8 e4m3 code (docs/kv-quantization.md). Widened by moving its
/// exponent and mantissa into f32's fields and multiplying by 2¹²⁰, which
/// rebases the exponent from 7 to 127 and turns an e4m3 subnormal (exponent
/// 0) into an f32 subnormal that the product normalizes, all exactly. The
/// NaN codes never reach a kernel: caches are checked for them.
#[derive(Clone, Copy, TransparentWrapper)]
#[repr(transparent)]
pub(crate) struct E4m3Code(u8);

/// 2^(127 − 7): e4m3's exponent bias to f32's.
const E4M3_REBASE: f32 = f32::from_bits((127 + 120) << 23);

impl Operand for Int8Code {
    #[inline(always)]
    fn value(self) -> f32 {
        self.0 as i8 as f32
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn zmm(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(p.cast())))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn ymm2(p: *const Self) -> [std::arch::x86_64::__m256; 2] {
        use std::arch::x86_64::*;
        let x = _mm_loadu_si128(p.cast());
        let widen = |x| _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x));
        [widen(x), widen(_mm_srli_si128::<8>(x))]
    }
    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    unsafe fn q4(p: *const Self) -> [std::arch::aarch64::float32x4_t; 4] {
        use std::arch::aarch64::*;
        let x = vld1q_s8(p.cast());
        let (lo, hi) = (vmovl_s8(vget_low_s8(x)), vmovl_s8(vget_high_s8(x)));
        let f = |x| vcvtq_f32_s32(x);
        [
            f(vmovl_s16(vget_low_s16(lo))),
            f(vmovl_s16(vget_high_s16(lo))),
            f(vmovl_s16(vget_low_s16(hi))),
            f(vmovl_s16(vget_high_s16(hi))),
        ]
    }
}

impl Operand for E4m3Code {
    #[inline(always)]
    fn value(self) -> f32 {
        let c = self.0 as u32;
        let magnitude = f32::from_bits((c & 0x7f) << 20) * E4M3_REBASE;
        f32::from_bits(magnitude.to_bits() | (c & 0x80) << 24)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn zmm(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let c = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.cast()));
        let body = _mm512_slli_epi32::<20>(_mm512_and_si512(c, _mm512_set1_epi32(0x7f)));
        let magnitude = _mm512_mul_ps(_mm512_castsi512_ps(body), _mm512_set1_ps(E4M3_REBASE));
        let sign = _mm512_slli_epi32::<24>(_mm512_and_si512(c, _mm512_set1_epi32(0x80)));
        _mm512_castsi512_ps(_mm512_or_si512(_mm512_castps_si512(magnitude), sign))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn ymm2(p: *const Self) -> [std::arch::x86_64::__m256; 2] {
        use std::arch::x86_64::*;
        let x = _mm_loadu_si128(p.cast());
        let widen = |x| {
            let c = _mm256_cvtepu8_epi32(x);
            let body = _mm256_slli_epi32::<20>(_mm256_and_si256(c, _mm256_set1_epi32(0x7f)));
            let magnitude = _mm256_mul_ps(_mm256_castsi256_ps(body), _mm256_set1_ps(E4M3_REBASE));
            let sign = _mm256_slli_epi32::<24>(_mm256_and_si256(c, _mm256_set1_epi32(0x80)));
            _mm256_castsi256_ps(_mm256_or_si256(_mm256_castps_si256(magnitude), sign))
        };
        [widen(x), widen(_mm_srli_si128::<8>(x))]
    }
    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    unsafe fn q4(p: *const Self) -> [std::arch::aarch64::float32x4_t; 4] {
        use std::arch::aarch64::*;
        let x = vld1q_u8(p.cast());
        let (lo, hi) = (vmovl_u8(vget_low_u8(x)), vmovl_u8(vget_high_u8(x)));
        let f = |c: uint32x4_t| {
            let body = vshlq_n_u32::<20>(vandq_u32(c, vdupq_n_u32(0x7f)));
            let magnitude = vmulq_n_f32(vreinterpretq_f32_u32(body), E4M3_REBASE);
            let sign = vshlq_n_u32::<24>(vandq_u32(c, vdupq_n_u32(0x80)));
            vreinterpretq_f32_u32(vorrq_u32(vreinterpretq_u32_f32(magnitude), sign))
        };
        [
            f(vmovl_u16(vget_low_u16(lo))),
            f(vmovl_u16(vget_high_u16(lo))),
            f(vmovl_u16(vget_low_u16(hi))),
            f(vmovl_u16(vget_high_u16(hi))),
        ]
    }
}

/// f16 as f32, exactly: `vcvtph2ps` on x86 (AVX-512F, F16C); on NEON the
/// bits moved into f32's fields and rebased by 2¹¹², as
/// `micro::widen_f16_bits` does for one element.
impl Operand for half::f16 {
    #[inline(always)]
    fn value(self) -> f32 {
        self.to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn zmm(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        _mm512_cvtph_ps(_mm256_loadu_si256(p.cast()))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn ymm2(p: *const Self) -> [std::arch::x86_64::__m256; 2] {
        use std::arch::x86_64::*;
        [
            _mm256_cvtph_ps(_mm_loadu_si128(p.cast())),
            _mm256_cvtph_ps(_mm_loadu_si128(p.add(8).cast())),
        ]
    }
    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    unsafe fn q4(p: *const Self) -> [std::arch::aarch64::float32x4_t; 4] {
        use std::arch::aarch64::*;
        const REBASE: f32 = f32::from_bits((127 + 112) << 23);
        let f = |h: uint16x4_t| {
            let h = vmovl_u16(h);
            let body = vshlq_n_u32::<13>(vandq_u32(h, vdupq_n_u32(0x7fff)));
            let finite = vmulq_n_f32(vreinterpretq_f32_u32(body), REBASE);
            let special = vorrq_u32(body, vdupq_n_u32(0x7f80_0000));
            let all_ones = vceqq_u32(vandq_u32(h, vdupq_n_u32(0x7c00)), vdupq_n_u32(0x7c00));
            let x = vbslq_u32(all_ones, special, vreinterpretq_u32_f32(finite));
            let sign = vshlq_n_u32::<16>(vandq_u32(h, vdupq_n_u32(0x8000)));
            vreinterpretq_f32_u32(vorrq_u32(x, sign))
        };
        let (a, b) = (vld1q_u16(p.cast()), vld1q_u16(p.add(8).cast()));
        [
            f(vget_low_u16(a)),
            f(vget_high_u16(a)),
            f(vget_low_u16(b)),
            f(vget_high_u16(b)),
        ]
    }
}

/// bf16 as f32: its bits in f32's upper half.
impl Operand for half::bf16 {
    #[inline(always)]
    fn value(self) -> f32 {
        self.to_f32()
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn zmm(p: *const Self) -> std::arch::x86_64::__m512 {
        use std::arch::x86_64::*;
        let x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p.cast()));
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(x))
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn ymm2(p: *const Self) -> [std::arch::x86_64::__m256; 2] {
        use std::arch::x86_64::*;
        let widen = |q: *const Self| {
            let x = _mm256_cvtepu16_epi32(_mm_loadu_si128(q.cast()));
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(x))
        };
        [widen(p), widen(p.add(8))]
    }
    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    unsafe fn q4(p: *const Self) -> [std::arch::aarch64::float32x4_t; 4] {
        use std::arch::aarch64::*;
        let f = |h: uint16x4_t| vreinterpretq_f32_u32(vshll_n_u16::<16>(h));
        let (a, b) = (vld1q_u16(p.cast()), vld1q_u16(p.add(8).cast()));
        [
            f(vget_low_u16(a)),
            f(vget_high_u16(a)),
            f(vget_low_u16(b)),
            f(vget_high_u16(b)),
        ]
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kv_quant::CacheQuant;

    #[test]
    fn every_code_widens_to_the_rules_value() {
        for c in 0..=255u8 {
            let (int8, fp8) = (Int8Code(c).value(), E4m3Code(c).value());
            assert_eq!(int8.to_bits(), CacheQuant::Int8.code_value(c).to_bits());
            if c & 0x7f != 0x7f {
                assert_eq!(
                    fp8.to_bits(),
                    CacheQuant::Fp8.code_value(c).to_bits(),
                    "{c:#x}"
                );
            }
        }
    }
}

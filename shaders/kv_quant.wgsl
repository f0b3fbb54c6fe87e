// Quantized KV caches (docs/kv-quantization.md): int8 or e4m3 codes, four
// per u32 word in the cache's layout, then one f32 scale per (block, kv
// head) in the same buffer from word `decode.k_scales_at` (V's:
// `v_scales_at`). The rule is src/kv_quant.rs's, bit for bit: only integer
// and exact float operations (no division of floats, no rounding
// builtins), so every adapter gets the host's codes and scales.
//
// The composer declares the override CACHE_FP8 and adds e4m3.wgsl and
// decode_common.wgsl.

// 2^-100, the smallest block scale (kv_quant::MIN_CACHE_SCALE); from its
// bits at run time (naga folds no bitcast in a constant).
fn min_cache_scale() -> f32 {
    let bits = 0x0d800000u;
    return bitcast<f32>(bits);
}

// The value the code in the low 8 bits of c stands for, before its scale.
fn cache_code_value(c: u32) -> f32 {
    if (CACHE_FP8) {
        return e4m3_value(c);
    }
    return f32(bitcast<i32>(c << 24u) >> 24u);
}

// The int8 code (its two's-complement byte) of the exact quotient x / s,
// rounded to nearest even and clamped to ±127; x normal, s a normal
// positive f32.
fn int8_quotient(x: f32, s: f32) -> u32 {
    let qt = mantissa_quotient(x, s);
    let num = qt.num;
    let den = qt.den;
    let e = qt.e;
    // |x / s| = (num / den) · 2^e: below 1/2 it rounds to 0, from 128 on it
    // clamps.
    var n = 127u;
    if (e < -1) {
        n = 0u;
    } else if (e < 7) {
        var wide = num;
        var div = den;
        if (e >= 0) {
            wide = num << u32(e);
        } else {
            div = den << 1u;
        }
        n = wide / div;
        let twice_rem = 2u * (wide - n * div);
        if (twice_rem > div || (twice_rem == div && (n & 1u) == 1u)) {
            n += 1u;
        }
        n = min(n, 127u);
    }
    return select(n, (256u - n) & 0xffu, x < 0.0);
}

// The code of x at scale s (a normal f32 > 0): 0 for zero and subnormal x.
fn cache_code(x: f32, s: f32) -> u32 {
    if ((bitcast<u32>(x) & 0x7f800000u) == 0u) {
        return 0u;
    }
    if (CACHE_FP8) {
        return e4m3_quotient(x, s);
    }
    return int8_quotient(x, s);
}

// RN(a / 127) as an f32, for a >= 2^-94 (where the result is normal): the
// mantissa · 2^8 over 127, a 25- or 26-bit quotient (e4m3.wgsl's rn_quotient).
fn div_127(a: f32) -> f32 {
    return rn_quotient(a, 127u, 8u, 1u, 0u);
}

// The scale of a block whose largest magnitude is a: max(RN(a / QMAX),
// 2^-100). Below 2^-94 the quotient is below 2^-100 whatever its rounding.
fn cache_scale_of(a: f32) -> f32 {
    let two_to_minus_94 = 0x10800000u;
    if (a < bitcast<f32>(two_to_minus_94)) {
        return min_cache_scale();
    }
    var s = 0.0;
    if (CACHE_FP8) {
        s = div_448(a);
    } else {
        s = div_127(a);
    }
    return max(s, min_cache_scale());
}

// The scale block of cache row `row`: a page of a paged cache, or
// `block_tokens` tokens of a dense cache's row (its page).
fn cache_block(row: u32) -> u32 {
    let page = row / decode.page_size;
    return page * decode.blocks_per_page + (row % decode.page_size) / decode.block_tokens;
}

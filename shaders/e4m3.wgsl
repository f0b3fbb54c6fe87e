// The e4m3 format (FP8 as FlashAttention-3 uses it, `e4m3fn`): 1 sign, 4
// exponent bits (bias 7), 3 mantissa bits, no infinities, ±448 the largest
// finite value, subnormals multiples of 2^-9. Shared by the quantization
// kernels (fp8_quant.wgsl) and the FP8 storage template. Only integer and
// exact float operations are used (no division, no rounding builtins), so
// every adapter gets the bits the host gets (src/quant.rs).

// The code of +448: saturation.
const E4M3_SATURATED: u32 = 0x7eu;
// P's own scale (src/quant.rs P_SCALE): P <= 1 maps onto [0, 448].
const P_SCALE: f32 = 1.0 / 448.0;

// The value of the e4m3 code in the low 8 bits of c.
fn e4m3_value(c: u32) -> f32 {
    let e = (c >> 3u) & 0xfu;
    let m = c & 7u;
    // m · 2^-9 (exact), or (1 + m/8) · 2^(e - 7) built from its bits.
    var magnitude = f32(m) * 0.001953125;
    if (e != 0u) {
        magnitude = bitcast<f32>(((e + 120u) << 23u) | (m << 20u));
    }
    return bitcast<f32>(bitcast<u32>(magnitude) | ((c & 0x80u) << 24u));
}

// |x| / s as (num / den) · 2^e with num / den in [1, 2): the two 24-bit
// mantissas (num doubled where it is the smaller) and the exponents'
// difference; x and s normal.
struct Quotient {
    num: u32,
    den: u32,
    e: i32,
}

fn mantissa_quotient(x: f32, s: f32) -> Quotient {
    let ax = bitcast<u32>(x) & 0x7fffffffu;
    let sb = bitcast<u32>(s);
    let den = (sb & 0x7fffffu) | 0x800000u;
    let num = (ax & 0x7fffffu) | 0x800000u;
    let e = i32(ax >> 23u) - i32(sb >> 23u);
    if (num < den) {
        return Quotient(num << 1u, den, e - 1);
    }
    return Quotient(num, den, e);
}

// The e4m3 code of the exact quotient x / s, rounded to nearest even and
// saturating at ±448; x is 0 or a normal f32, s a normal positive f32 or 0
// (a head of zeros: code 0). Zero of either sign is code 0.
fn e4m3_quotient(x: f32, s: f32) -> u32 {
    let xb = bitcast<u32>(x);
    if ((xb & 0x7fffffffu) == 0u || s == 0.0) {
        return 0u;
    }
    let qt = mantissa_quotient(x, s);
    let num = qt.num;
    let den = qt.den;
    var e = qt.e;
    let sign = (xb >> 24u) & 0x80u;
    if (e > 8) {
        return sign | E4M3_SATURATED;
    }
    if (e < -10) {
        return 0u;
    }
    // n = the quotient in units of the e4m3 step at its exponent (2^-9
    // below 2^-6), rounded to nearest even from the integer remainder.
    var n = select(0u, 1u, num > den);
    if (e > -10) {
        let wide = num << u32(select(e + 9, 3, e >= -6));
        n = wide / den;
        let twice_rem = 2u * (wide - n * den);
        if (twice_rem > den || (twice_rem == den && (n & 1u) == 1u)) {
            n += 1u;
        }
    }
    var code = n;
    if (e >= -6) {
        if (n == 16u) {
            n = 8u;
            e = e + 1;
        }
        code = (u32(e + 7) << 3u) | (n - 8u);
        if (e > 8 || (e == 8 && n > 14u)) {
            code = E4M3_SATURATED;
        }
    }
    return select(sign | code, 0u, code == 0u);
}

// RN(a / d) · 2^-k as an f32, for a small odd divisor d and an a whose
// result is normal: a's mantissa · 2^shift divided by d in u32, the
// quotient (24 + drop_lo or 25 + drop_lo bits) kept to 24 bits, to nearest
// even from the dropped bits and the remainder. With a = m · 2^(e − 150),
// the result is kept · 2^(e + drop − shift − k − 150): its biased exponent
// is e + drop − shift − k.
fn rn_quotient(a: f32, d: u32, shift: u32, drop_lo: u32, k: u32) -> f32 {
    let ab = bitcast<u32>(a);
    let num = ((ab & 0x7fffffu) | 0x800000u) << shift;
    let q = num / d;
    let rem = num - q * d;
    let drop = select(drop_lo, drop_lo + 1u, q >= (1u << (24u + drop_lo)));
    var kept = q >> drop;
    let lost = q & ((1u << drop) - 1u);
    let half = 1u << (drop - 1u);
    if (lost > half || (lost == half && (rem != 0u || (kept & 1u) == 1u))) {
        kept += 1u;
    }
    var biased = (ab >> 23u) + drop - shift - k;
    if (kept == 0x1000000u) {
        kept = 0x800000u;
        biased += 1u;
    }
    return bitcast<f32>((biased << 23u) | (kept & 0x7fffffu));
}

// RN(a / 448) as an f32, for a >= 2^-117 (where the result is normal):
// a / 7 (the mantissa · 2^5: a 26- or 27-bit quotient), the exponent less
// 6 (448 = 7 · 2^6).
fn div_448(a: f32) -> f32 {
    return rn_quotient(a, 7u, 5u, 2u, 6u);
}

// y rounded to the nearest e4m3 value (ties to even), saturating at ±448.
fn e4m3_round(y: f32) -> f32 {
    let a = abs(y);
    var r = 448.0;
    if (a < 448.0) {
        let bits = bitcast<u32>(a);
        if (bits < 0x3c800000u) {
            // Below 2^-6: multiples of 2^-9 (a · 512, floor and the rest are exact).
            let f = a * 512.0;
            let i = floor(f);
            let rest = f - i;
            let up = rest > 0.5 || (rest == 0.5 && (u32(i) & 1u) == 1u);
            r = select(i, i + 1.0, up) * 0.001953125;
        } else {
            // Keep 3 mantissa bits, to nearest even (480 saturates to 448).
            r = min(bitcast<f32>((bits + 0x7ffffu + ((bits >> 20u) & 1u)) & 0xfff00000u), 448.0);
        }
    }
    return select(r, -r, y < 0.0);
}

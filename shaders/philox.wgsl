// Philox4x32-10 and dropout's keep bits, in u32 arithmetic only (WGSL has
// no 64-bit integers): the same values as src/philox.rs and
// src/api/dropout.rs, bit for bit (docs/dropout.md has the mapping). Pure
// functions of their arguments; dropout.wgsl gives them a call's Params.

const PHILOX_M0: u32 = 0xD2511F53u;
const PHILOX_M1: u32 = 0xCD9E8D57u;
const PHILOX_W0: u32 = 0x9E3779B9u;
const PHILOX_W1: u32 = 0xBB67AE85u;

// (hi, lo) of the 64-bit product a * b, from its 16-bit halves.
fn philox_mulhilo(a: u32, b: u32) -> vec2<u32> {
    let a0 = a & 0xffffu;
    let a1 = a >> 16u;
    let b0 = b & 0xffffu;
    let b1 = b >> 16u;
    let p01 = a0 * b1;
    let p10 = a1 * b0;
    // Below 3 * 2^16: the carry into the high word fits.
    let mid = ((a0 * b0) >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
    let hi = a1 * b1 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u);
    return vec2<u32>(hi, a * b);
}

// One round: the two multiplies and the xors with the round's key.
fn philox_round(c: vec4<u32>, k: vec2<u32>) -> vec4<u32> {
    let p0 = philox_mulhilo(PHILOX_M0, c.x);
    let p1 = philox_mulhilo(PHILOX_M1, c.z);
    return vec4<u32>(p1.x ^ c.y ^ k.x, p1.y, p0.x ^ c.w ^ k.y, p0.y);
}

// The ten rounds written out: no loop for llvmpipe to count against its
// loop limit (see loop_budget.wgsl) or to keep rolled.
fn philox4x32_10(counter: vec4<u32>, key: vec2<u32>) -> vec4<u32> {
    let w = vec2<u32>(PHILOX_W0, PHILOX_W1);
    var c = philox_round(counter, key);
    c = philox_round(c, key + w);
    c = philox_round(c, key + 2u * w);
    c = philox_round(c, key + 3u * w);
    c = philox_round(c, key + 4u * w);
    c = philox_round(c, key + 5u * w);
    c = philox_round(c, key + 6u * w);
    c = philox_round(c, key + 7u * w);
    c = philox_round(c, key + 8u * w);
    return philox_round(c, key + 9u * w);
}

// The keep bits of the 8 elements one call covers (bit e: element e, the
// 16 bits `out[e >> 1] >> (16 * (e & 1))`) under `threshold`.
fn dropout_byte(out: vec4<u32>, threshold: u32) -> u32 {
    let t = vec4<u32>(threshold);
    let low = select(vec4<u32>(0u), vec4<u32>(1u, 4u, 16u, 64u), (out & vec4<u32>(0xffffu)) >= t);
    let high = select(vec4<u32>(0u), vec4<u32>(2u, 8u, 32u, 128u), (out >> vec4<u32>(16u)) >= t);
    let v = low | high;
    return v.x | v.y | v.z | v.w;
}

// Whether element (row, col) of the stream `stream` (counter words 2 and 3:
// offset + batch * heads_q + head) is kept: its 16 bits of the call that
// covers columns (col & ~7) .. (col | 7) are at least `threshold`.
fn dropout_keeps(key: vec2<u32>, stream: vec2<u32>, threshold: u32, row: u32, col: u32) -> bool {
    let out = philox4x32_10(vec4<u32>(col >> 3u, row, stream.x, stream.y), key);
    let e = col & 7u;
    let bits = (out[e >> 1u] >> (16u * (e & 1u))) & 0xffffu;
    return bits >= threshold;
}

// The keep bits of columns col .. col + n - 1 of `row` (1 <= n <= 32): bit j
// for column col + j, bits from n on 0. One call per 8 columns (the groups
// col >> 3 .. (col + n - 1) >> 3, at most 5), shared by the whole run: the
// per-element cost of the kernels' mask. No loop (llvmpipe counts loops).
fn dropout_run(key: vec2<u32>, stream: vec2<u32>, threshold: u32, row: u32, col: u32, n: u32) -> u32 {
    let g = col >> 3u;
    let s = col & 7u;
    let calls = (s + n + 7u) >> 3u;
    var lo = dropout_byte(philox4x32_10(vec4<u32>(g, row, stream.x, stream.y), key), threshold);
    var hi = 0u;
    if (calls > 1u) {
        lo |= dropout_byte(philox4x32_10(vec4<u32>(g + 1u, row, stream.x, stream.y), key), threshold) << 8u;
    }
    if (calls > 2u) {
        lo |= dropout_byte(philox4x32_10(vec4<u32>(g + 2u, row, stream.x, stream.y), key), threshold) << 16u;
    }
    if (calls > 3u) {
        lo |= dropout_byte(philox4x32_10(vec4<u32>(g + 3u, row, stream.x, stream.y), key), threshold) << 24u;
    }
    if (calls > 4u) {
        hi = dropout_byte(philox4x32_10(vec4<u32>(g + 4u, row, stream.x, stream.y), key), threshold);
    }
    // The 40-bit window hi:lo shifted right by s (a shift by 32 is not one).
    let bits = select((lo >> s) | (hi << ((32u - s) & 31u)), lo, s == 0u);
    return select(bits & ((1u << (n & 31u)) - 1u), bits, n >= 32u);
}

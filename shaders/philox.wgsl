// Philox4x32-10 and dropout's keep bit, in u32 arithmetic only (WGSL has
// no 64-bit integers): the same values as src/philox.rs and
// src/api/dropout.rs, bit for bit (docs/dropout.md has the mapping).

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

fn philox4x32_10(counter: vec4<u32>, key: vec2<u32>) -> vec4<u32> {
    var c = counter;
    var k = key;
    for (var r = 0u; r < 10u; r++) {
        if (r > 0u) {
            k += vec2<u32>(PHILOX_W0, PHILOX_W1);
        }
        let p0 = philox_mulhilo(PHILOX_M0, c.x);
        let p1 = philox_mulhilo(PHILOX_M1, c.z);
        c = vec4<u32>(p1.x ^ c.y ^ k.x, p1.y, p0.x ^ c.w ^ k.y, p0.y);
    }
    return c;
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

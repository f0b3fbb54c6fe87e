// Storage template for bf16 tensors packed two per u32 (WGSL has no bf16
// type): element i lives in half (i & 1) of word i >> 1. A bf16 is the high
// half of an f32, so widening is a shift; narrowing rounds to nearest even
// with integer operations (NaN stays NaN). Stores update their half of a
// word atomically, as the packed f16 template does, since odd head dims put
// one word across rows that different workgroups own. `@helpers` is emitted
// once per module that declares any bf16 buffer.
// @helpers
// The bf16 bits of x, rounded to nearest even; a NaN stays a (quiet) NaN.
fn bf16_bits(x: f32) -> u32 {
    let u = bitcast<u32>(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (u >> 16u) | 0x40u;
    }
    return (u + 0x7fffu + ((u >> 16u) & 1u)) >> 16u;
}
// Half `half` (0: low, 1: high) of a word, widened to f32.
fn bf16_half(w: u32, half: u32) -> f32 {
    return bitcast<f32>(select(w << 16u, w & 0xffff0000u, half == 1u));
}
// @common
fn round_storage(x: f32) -> f32 {
    return bitcast<f32>(bf16_bits(x) << 16u);
}
// @read
@group(0) @binding({binding}) var<storage, read> {name}_buf: array<u32>;
fn load_{name}(i: u32) -> f32 {
    io_read();
    return bf16_half({name}_buf[i >> 1u], i & 1u);
}
// @read4
@group(0) @binding({binding}) var<storage, read> {name}_buf: array<vec2<u32>>;
fn load4_{name}(i: u32) -> vec4<f32> {
    io_read4();
    let w = {name}_buf[i];
    return vec4<f32>(bf16_half(w.x, 0u), bf16_half(w.x, 1u), bf16_half(w.y, 0u), bf16_half(w.y, 1u));
}
// @write
@group(0) @binding({binding}) var<storage, read_write> {name}_buf: array<atomic<u32>>;
fn store_{name}(i: u32, x: f32) {
    io_write();
    let shift = (i & 1u) * 16u;
    // Clear this half, then set it; the other half is left alone.
    atomicAnd(&{name}_buf[i >> 1u], ~(0xffffu << shift));
    atomicOr(&{name}_buf[i >> 1u], bf16_bits(x) << shift);
}

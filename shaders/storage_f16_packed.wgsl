// Storage template for f16 tensors packed two per u32: runs on every adapter,
// SHADER_F16 or not. Element i lives in half (i & 1) of word i >> 1.
// Odd head dims put a word across two rows that different workgroups own, so
// stores update their half of a word atomically instead of read-modify-write.
// @common
fn round_storage(x: f32) -> f32 {
    return unpack2x16float(pack2x16float(vec2<f32>(x, 0.0))).x;
}
// @read
@group(0) @binding({binding}) var<storage, read> {name}_buf: array<u32>;
fn load_{name}(i: u32) -> f32 {
    io_read();
    return unpack2x16float({name}_buf[i >> 1u])[i & 1u];
}
// @read4
@group(0) @binding({binding}) var<storage, read> {name}_buf: array<vec2<u32>>;
fn load4_{name}(i: u32) -> vec4<f32> {
    io_read4();
    let w = {name}_buf[i];
    return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
}
// @write
@group(0) @binding({binding}) var<storage, read_write> {name}_buf: array<atomic<u32>>;
fn store_{name}(i: u32, x: f32) {
    io_write();
    let shift = (i & 1u) * 16u;
    let bits = (pack2x16float(vec2<f32>(x, 0.0)) & 0xffffu) << shift;
    // Each half has one writer: clear this half, then set it. The other half
    // (maybe another workgroup's element) is left alone, whatever the buffer
    // held before, so outputs need no zeroing and the caller's buffers no
    // COPY_DST.
    atomicAnd(&{name}_buf[i >> 1u], ~(0xffffu << shift));
    atomicOr(&{name}_buf[i >> 1u], bits);
}

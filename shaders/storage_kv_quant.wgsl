// Storage template for a quantized KV cache's K or V (kv_quant.wgsl):
// codes four per word, the block scales after them from word
// `{name}_scales_at`. Loads give a code's value before its scale; the
// kernels multiply by `cache_{name}_scale` once per cache row.
// @read
@group(0) @binding({binding}) var<storage, read> {name}_buf: array<u32>;
fn load_{name}(i: u32) -> f32 {
    io_read();
    return cache_code_value({name}_buf[i >> 2u] >> ((i & 3u) * 8u));
}
fn cache_{name}_scale(row: u32, hk: u32) -> f32 {
    return bitcast<f32>({name}_buf[decode.{name}_scales_at + cache_block(row) * decode.heads_kv + hk]);
}
// @read4
@group(0) @binding({binding}) var<storage, read> {name}_buf: array<u32>;
fn load4_{name}(i: u32) -> vec4<f32> {
    io_read4();
    let w = {name}_buf[i];
    return vec4<f32>(cache_code_value(w), cache_code_value(w >> 8u), cache_code_value(w >> 16u), cache_code_value(w >> 24u));
}
fn cache_{name}_scale(row: u32, hk: u32) -> f32 {
    return bitcast<f32>({name}_buf[decode.{name}_scales_at + cache_block(row) * decode.heads_kv + hk]);
}
// @read_write
// The append's view: words as atomics, since neighbouring codes in a word
// may belong to another workgroup's block or head.
@group(0) @binding({binding}) var<storage, read_write> {name}_buf: array<atomic<u32>>;
fn code_{name}(i: u32) -> u32 {
    return (atomicLoad(&{name}_buf[i >> 2u]) >> ((i & 3u) * 8u)) & 0xffu;
}
fn set_code_{name}(i: u32, c: u32) {
    let shift = (i & 3u) * 8u;
    atomicAnd(&{name}_buf[i >> 2u], ~(0xffu << shift));
    atomicOr(&{name}_buf[i >> 2u], c << shift);
}
fn scale_{name}(at: u32) -> f32 {
    return bitcast<f32>(atomicLoad(&{name}_buf[decode.{name}_scales_at + at]));
}
fn set_scale_{name}(at: u32, s: f32) {
    atomicStore(&{name}_buf[decode.{name}_scales_at + at], bitcast<u32>(s));
}
// @plain
// A plain cache's rows have no scale.
fn cache_{name}_scale(row: u32, hk: u32) -> f32 {
    return 1.0;
}

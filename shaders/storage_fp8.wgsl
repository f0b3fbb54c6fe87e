// Storage template for FP8 (e4m3) tensors: q, k and v as codes from the
// quantization kernels (fp8_quant.wgsl), four per u32, rows padded to a
// multiple of 4 codes, decoded on load (e4m3.wgsl, which the composer adds).
// A load gives the code's value; the per-(batch, head) scales multiply the
// scores and the output instead (head_scale.wgsl). Outputs are f32: kernels
// declare them with the f32 template.
// @common
// P quantized to e4m3 with its own scale P_SCALE before P·V.
fn round_storage(x: f32) -> f32 {
    return e4m3_round(x * 448.0) * P_SCALE;
}
// @read
@group(0) @binding({binding}) var<storage, read> {name}_buf: array<u32>;
fn load_{name}(i: u32) -> f32 {
    io_read();
    return e4m3_value({name}_buf[i >> 2u] >> ((i & 3u) * 8u));
}
// @read4
@group(0) @binding({binding}) var<storage, read> {name}_buf: array<u32>;
fn load4_{name}(i: u32) -> vec4<f32> {
    io_read4();
    let w = {name}_buf[i];
    return vec4<f32>(e4m3_value(w), e4m3_value(w >> 8u), e4m3_value(w >> 16u), e4m3_value(w >> 24u));
}

// Storage template for native f16 tensors (needs SHADER_F16; the composer
// adds `enable f16;`).
// @common
fn round_storage(x: f32) -> f32 {
    return f32(f16(x));
}
// @read
@group(0) @binding({binding}) var<storage, read> {name}_buf: array<f16>;
fn load_{name}(i: u32) -> f32 {
    io_read();
    return f32({name}_buf[i]);
}
// @read4
@group(0) @binding({binding}) var<storage, read> {name}_buf: array<vec4<f16>>;
fn load4_{name}(i: u32) -> vec4<f32> {
    io_read4();
    return vec4<f32>({name}_buf[i]);
}
// @write
@group(0) @binding({binding}) var<storage, read_write> {name}_buf: array<f16>;
fn store_{name}(i: u32, x: f32) {
    io_write();
    {name}_buf[i] = f16(x);
}

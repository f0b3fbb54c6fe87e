// Storage template for f32 tensors. The composer emits `@common` once and
// `@read` / `@read4` / `@write` / `@read_write` once per buffer, replacing
// {name} and {binding} (`@read4` / `@write4`: vec4 accesses, for the lanes
// kernels).
// Accessors count elements for the IO accounting (io_count.wgsl).
// @common
fn round_storage(x: f32) -> f32 {
    return x;
}
// @read
@group(0) @binding({binding}) var<storage, read> {name}_buf: array<f32>;
fn load_{name}(i: u32) -> f32 {
    io_read();
    return {name}_buf[i];
}
// @read4
@group(0) @binding({binding}) var<storage, read> {name}_buf: array<vec4<f32>>;
fn load4_{name}(i: u32) -> vec4<f32> {
    io_read4();
    return {name}_buf[i];
}
// @write
@group(0) @binding({binding}) var<storage, read_write> {name}_buf: array<f32>;
fn store_{name}(i: u32, x: f32) {
    io_write();
    {name}_buf[i] = x;
}
// @write4
@group(0) @binding({binding}) var<storage, read_write> {name}_buf: array<vec4<f32>>;
fn store4_{name}(i: u32, x: vec4<f32>) {
    io_write4();
    {name}_buf[i] = x;
}
// @read_write
@group(0) @binding({binding}) var<storage, read_write> {name}_buf: array<f32>;
fn load_{name}(i: u32) -> f32 {
    io_read();
    return {name}_buf[i];
}
fn store_{name}(i: u32, x: f32) {
    io_write();
    {name}_buf[i] = x;
}

// Per-(batch, head) factors of the forward kernels' scores and outputs:
// `@unit` for f32, f16 and bf16 storage (the score scale, and 1); `@fp8`
// for FP8 storage, whose loads give e4m3 values: the scores take q's and
// k's quantization scales, the output v's. The scales buffer holds q's
// (batch, heads_q), then k's and v's (batch, heads_kv) each.
// @unit
fn score_scale(b: u32, h: u32) -> f32 {
    return params.scale;
}
fn out_scale(b: u32, h: u32) -> f32 {
    return 1.0;
}
// @fp8
@group(0) @binding(26) var<storage, read> fp8_scales: array<f32>;
fn kv_scale_index(b: u32, h: u32) -> u32 {
    return b * (params.heads_q / params.group) + h / params.group;
}
fn score_scale(b: u32, h: u32) -> f32 {
    let k_scales = params.batch * params.heads_q;
    let sq = fp8_scales[b * params.heads_q + h];
    return params.scale * sq * fp8_scales[k_scales + kv_scale_index(b, h)];
}
fn out_scale(b: u32, h: u32) -> f32 {
    let v_scales = params.batch * (params.heads_q + params.heads_q / params.group);
    return fp8_scales[v_scales + kv_scale_index(b, h)];
}

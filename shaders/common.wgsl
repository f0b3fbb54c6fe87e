// Shared by every attention kernel: the call parameters and the mask band.
// The Rust twin of `Params` is `gpu::params::Params`; keep field order equal.

struct Params {
    // Rows and keys visible to this dispatch (local indices start at 0).
    seqlen_q: u32,
    seqlen_k: u32,
    // Absolute index of local row 0 / key 0, so masks see true positions.
    q_start: u32,
    k_start: u32,
    heads_q: u32,
    // Query heads per kv head (GQA); query head h reads kv head h / group.
    group: u32,
    // Element strides of the (batch, seq, heads, dim) layouts.
    q_row_stride: u32,
    kv_row_stride: u32,
    q_batch_stride: u32,
    kv_batch_stride: u32,
    // LSE is (batch, heads_q, seqlen_q).
    lse_batch_stride: u32,
    lse_head_stride: u32,
    // First query block of this dispatch (grids are split at the dispatch limit).
    block_offset: u32,
    // Mask band: key j is allowed for row i iff
    // i + mask_offset - window_left <= j <= i + mask_offset + window_right
    // (absolute indices; the host turns "unbounded" into a bound past the ends).
    mask_offset: i32,
    window_left: i32,
    window_right: i32,
    // Scores are q·k · q_scale; with softcap C: C·tanh(q·k·q_scale / C).
    // Without softcap q_scale already carries log2(e) so exp2 can be used.
    q_scale: f32,
    softcap: f32,
    // C·log2(e): brings soft-capped scores into the exp2 domain.
    softcap_log2: f32,
    // Batch entries in this dispatch.
    batch: u32,
}

@group(0) @binding(0) var<uniform> params: Params;

// Masked scores are set to this finite sentinel; exp2 of anything relative to a
// real maximum underflows to 0, and an all-masked row keeps l = 0.
const NEG_BIG: f32 = -1.0e30;
const LN2: f32 = 0.6931471805599453;

// -inf, for the LSE of empty rows. WGSL makes a constant expression that
// evaluates to infinity a shader-creation error (browsers' Tint enforces it,
// naga does not); an identifier declared with `let` is never a constant
// expression, so this bitcast happens at run time.
fn neg_inf() -> f32 {
    let bits = 0xff800000u;
    return bitcast<f32>(bits);
}

// Whether absolute row `i` may attend to absolute key `j` under the band mask.
fn band_allows(i: i32, j: i32) -> bool {
    let center = i + params.mask_offset;
    return j >= center - params.window_left && j <= center + params.window_right;
}

// Shared by every attention kernel: the call parameters and the mask band.
// The Rust twin of `Params` is `kernels::params::Params`; a test compares
// their layouts member by member (naga's layout of this struct).

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
    // Element strides of the (batch, seq, heads, dim) layouts: q (and dq)
    // and k (and dk) rows hold head_dim per head, o (and do) and v (and dv)
    // rows head_dim_v.
    q_row_stride: u32,
    kv_row_stride: u32,
    o_row_stride: u32,
    v_row_stride: u32,
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
    // Scores are scale · q·k; with softcap C > 0: C·tanh(scale · q·k / C).
    scale: f32,
    softcap: f32,
    // Batch entries in this dispatch.
    batch: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> params: Params;

// Masked scores are set to this finite sentinel; exp of anything relative to a
// real maximum underflows to 0, and an all-masked row keeps l = 0.
// Scores stay in natural units (exp, not exp2 with log2(e) folded into q): the
// backward recomputes each score with the same arithmetic as the forward, so
// s - lse is exact for a row's largest score and large-magnitude rows keep
// their precision; the extra multiply per score is negligible next to the dot.
const NEG_BIG: f32 = -1.0e30;

// -inf, for the LSE of empty rows. WGSL makes a constant expression that
// evaluates to infinity a shader-creation error (browsers' Tint enforces it,
// naga does not); an identifier declared with `let` is never a constant
// expression, so this bitcast happens at run time.
fn neg_inf() -> f32 {
    let bits = 0xff800000u;
    return bitcast<f32>(bits);
}

// The score after the optional softcap.
fn cap_score(s: f32) -> f32 {
    if (HAS_SOFTCAP) {
        return params.softcap * tanh(s / params.softcap);
    }
    return s;
}

// One sequence of a dispatch as a workgroup sees it: its rows and keys
// here, where they are stored, and its mask offset.
struct Seq {
    // Batch entry (of this dispatch).
    b: u32,
    // The workgroup's block within the sequence.
    block: u32,
    rows: u32,
    keys: u32,
    // Storage rows of local row 0 of q (o, do, dq) and of local key 0 of k
    // (v, dk, dv); the LSE index of (head 0, local row 0).
    q_row: u32,
    k_row: u32,
    lse: u32,
    // Key j is on row i's diagonal at j = i + offset (bottom-right aligned).
    offset: i32,
}

// The sequence of workgroup `wg`, whose x counts blocks (of rows or keys).
fn sequence(wg: vec3<u32>) -> Seq {
    let b = wg.z;
    return Seq(b, wg.x + params.block_offset, params.seqlen_q, params.seqlen_k,
        b * params.seqlen_q, b * params.seqlen_k, b * params.lse_batch_stride, params.mask_offset);
}

// Whether absolute row `i` may attend to absolute key `j` under the band
// mask, with the diagonal at j = i + offset.
fn band_allows(offset: i32, i: i32, j: i32) -> bool {
    let center = i + offset;
    return j >= center - params.window_left && j <= center + params.window_right;
}

// Local key range [x, y) of `seq` that any of the absolute rows first..=last may see.
fn visible_keys(seq: Seq, first_row: i32, last_row: i32) -> vec2<i32> {
    let n = i32(seq.keys);
    if (!IS_MASKED) {
        return vec2<i32>(0, n);
    }
    let k0 = i32(params.k_start);
    let lo = clamp(first_row + seq.offset - params.window_left - k0, 0, n);
    let hi = clamp(last_row + seq.offset + params.window_right + 1 - k0, 0, n);
    return vec2<i32>(lo, max(lo, hi));
}

// Local row range [x, y) of `seq` that may see any of the absolute keys first..=last.
fn visible_rows(seq: Seq, first_key: i32, last_key: i32) -> vec2<i32> {
    let n = i32(seq.rows);
    if (!IS_MASKED) {
        return vec2<i32>(0, n);
    }
    let q0 = i32(params.q_start);
    let lo = clamp(first_key - seq.offset - params.window_right - q0, 0, n);
    let hi = clamp(last_key - seq.offset + params.window_left + 1 - q0, 0, n);
    return vec2<i32>(lo, max(lo, hi));
}

// The blocks of `size` that cover the local range [r.x, r.y) of visible_keys
// or visible_rows, as [begin, end) block indices (empty if the range is).
fn block_range(r: vec2<i32>, size: u32) -> vec2<u32> {
    let begin = u32(r.x) / size;
    return vec2<u32>(begin, select(begin, (u32(r.y) + size - 1u) / size, r.y > r.x));
}

// Whether every (row, key) of the tile rows first..=last × keys k_first..=k_last
// is allowed by the band, so the tile needs no per-element mask.
fn band_covers(offset: i32, first_row: i32, last_row: i32, k_first: i32, k_last: i32) -> bool {
    return !IS_MASKED || (band_allows(offset, last_row, k_first) && band_allows(offset, first_row, k_last));
}

// s + a·b summed in order of dimension, as the tiled kernels' loops sum (the
// lanes kernels, which work on vec4s, use it to round the same way).
fn add_dot(s: f32, a: vec4<f32>, b: vec4<f32>) -> f32 {
    return (((s + a.x * b.x) + a.y * b.y) + a.z * b.z) + a.w * b.w;
}

// Whether the (row, key) pair of a lanes kernel's block takes part: always
// where the block needs no mask; else both in range and allowed by the band.
fn pair_allowed(masking: bool, in_range: bool, offset: i32, row_abs: i32, key_abs: i32) -> bool {
    if (!masking) {
        return true;
    }
    return in_range && (!IS_MASKED || band_allows(offset, row_abs, key_abs));
}

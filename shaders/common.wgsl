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
    // Batch entries (sequences, when packed) in this dispatch.
    batch: u32,
    // This dispatch's first batch entry and first query head in the whole
    // problem (slopes, sinks and the block mask are indexed globally).
    batch_start: u32,
    head_start: u32,
    // Where the side tables start, in words of the side buffer (side.wgsl).
    // A packed batch: cu_q, cu_k, cu_qblocks, cu_kblocks (batch + 1 each),
    // then each sequence's mask offset.
    seq_at: u32,
    // ALiBi slope of (batch entry b, query head h): alibi_at + b·alibi_batch_stride + h.
    alibi_at: u32,
    alibi_batch_stride: u32,
    // Sink logit of query head h: sinks_at + h.
    sinks_at: u32,
    // Block-sparse tile lists, by query block (forward, dQ) and by key
    // block (dK/dV): list r spans entries starts[r]..starts[r + 1], where
    // r = h·head_stride + the block's flat index; each entry is a tile index,
    // bit 31 set where the block mask needs testing per pair.
    qtiles_at: u32,
    qtiles_entries: u32,
    qtiles_head_stride: u32,
    ktiles_at: u32,
    ktiles_entries: u32,
    ktiles_head_stride: u32,
    // The block mask, one byte per block, four per word: byte
    // b·mask_batch_stride + h·mask_head_stride + (i / mask_bm)·mask_cols + j / mask_bn.
    mask_at: u32,
    mask_bm: u32,
    mask_bn: u32,
    mask_cols: u32,
    mask_batch_stride: u32,
    mask_head_stride: u32,
    // Sequences of a packed batch (whose `batch` is 1).
    seq_count: u32,
    // A packed batch's workgroups take their blocks in this stride (coprime
    // with the blocks' count), so that runs of consecutive workgroups — what
    // each of lavapipe's threads takes — mix long and short sequences.
    block_stride: u32,
    // Dropout (dropout.wgsl): the Philox key (the seed), the call's first
    // stream (its offset, 64-bit), the 16-bit threshold and 1 / (1 − p);
    // streams advance by drop_heads (the whole problem's heads_q) per
    // sequence; drop_row0 / drop_col0 place the sequence's rows and keys
    // (a shard's positions).
    drop_key_lo: u32,
    drop_key_hi: u32,
    drop_stream_lo: u32,
    drop_stream_hi: u32,
    drop_threshold: u32,
    drop_scale: f32,
    drop_heads: u32,
    drop_row0: u32,
    drop_col0: u32,
    _pad0: u32,
    _pad1: u32,
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
    // Batch entry (sequence) in the whole problem.
    b: u32,
    // The workgroup's block within the sequence, and its flat index over
    // every sequence of the dispatch (the tile lists' row).
    block: u32,
    flat: u32,
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

// The sequence of workgroup `wg`, whose x counts blocks of `size` rows (or
// keys, `by_keys`). Dense batches: z is the batch entry. Packed batches
// (IS_VARLEN): x counts the blocks of every sequence, and the workgroup finds
// its own by a binary search of the blocks' prefix sums.
fn sequence(wg: vec3<u32>, size: u32, by_keys: bool) -> Seq {
    let x = wg.x + params.block_offset;
    if (!IS_VARLEN) {
        let z = wg.z;
        let n = select(params.seqlen_q, params.seqlen_k, by_keys);
        return Seq(params.batch_start + z, x, z * ((n + size - 1u) / size) + x,
            params.seqlen_q, params.seqlen_k, z * params.seqlen_q, z * params.seqlen_k,
            z * params.lse_batch_stride, params.mask_offset);
    }
    let n = params.seq_count;
    let cu_q = params.seq_at;
    let cu_k = cu_q + n + 1u;
    let cu_blocks = select(cu_k + n + 1u, cu_k + 2u * (n + 1u), by_keys);
    // The block this workgroup takes: a permutation of x.
    let flat = (x * params.block_stride) % side_word(cu_blocks + n);
    // The last sequence whose first block is at most flat (empty ones have none).
    var lo = 0u;
    var len = n;
    while (len > 1u) {
        let half = len / 2u;
        if (side_word(cu_blocks + lo + half) <= flat) {
            lo += half;
        }
        len -= half;
    }
    let q_row = side_word(cu_q + lo);
    let k_row = side_word(cu_k + lo);
    let offset = bitcast<i32>(side_word(cu_k + 3u * (n + 1u) + lo));
    return Seq(lo, flat - side_word(cu_blocks + lo), flat,
        side_word(cu_q + lo + 1u) - q_row, side_word(cu_k + lo + 1u) - k_row,
        q_row, k_row, q_row, offset);
}

// ALiBi's slope for query head h (of this dispatch) of `seq`.
fn alibi_slope(seq: Seq, h: u32) -> f32 {
    return alibi_slope_at(seq.b, h);
}

// ALiBi's slope for query head h (of this dispatch) of batch entry b.
fn alibi_slope_at(b: u32, h: u32) -> f32 {
    if (!HAS_ALIBI) {
        return 0.0;
    }
    let at = params.alibi_at + b * params.alibi_batch_stride + params.head_start + h;
    return bitcast<f32>(side_word(at));
}

// ALiBi's bias slope · |i + offset − j| of absolute row i and key j (0 without).
fn alibi_bias(slope: f32, offset: i32, i: i32, j: i32) -> f32 {
    if (!HAS_ALIBI) {
        return 0.0;
    }
    return slope * f32(abs(i + offset - j));
}

// The sink logit of query head h (of this dispatch).
fn sink_logit(h: u32) -> f32 {
    return bitcast<f32>(side_word(params.sinks_at + params.head_start + h));
}

// A row's running max and sum before its first key: with sinks (in the
// piece that holds key 0) the sink is a key of score sink_h and value 0.
fn softmax_start(h: u32) -> vec2<f32> {
    if (HAS_SINKS && params.k_start == 0u) {
        return vec2<f32>(sink_logit(h), 1.0);
    }
    return vec2<f32>(NEG_BIG, 0.0);
}

// The range of a workgroup's loop over tiles: the band's blocks [x, y) of
// `size` covering the local range `visible`, or (IS_SPARSE) the entries of
// its tile list for query head h.
fn tile_steps(seq: Seq, h: u32, visible: vec2<i32>, size: u32, by_keys: bool) -> vec2<u32> {
    if (!IS_SPARSE) {
        return block_range(visible, size);
    }
    let at = select(params.qtiles_at, params.ktiles_at, by_keys);
    let stride = select(params.qtiles_head_stride, params.ktiles_head_stride, by_keys);
    let r = at + h * stride + seq.flat;
    return vec2<u32>(side_word(r), side_word(r + 1u));
}

// The tile of loop step `i` (a block index; bit 31: test the mask per pair).
fn tile_at(i: u32, by_keys: bool) -> u32 {
    if (!IS_SPARSE) {
        return i;
    }
    return side_word(select(params.qtiles_entries, params.ktiles_entries, by_keys) + i);
}

// The tile of the step after `step` of `steps` (the last step's own at the
// end): loops read it a step ahead, so the read of a sparse list is never
// what the step's loads wait on (on lavapipe that wait cost 40%).
fn tile_after(step: u32, steps: vec2<u32>, by_keys: bool) -> u32 {
    return tile_at(min(step + 1u, steps.y - 1u), by_keys);
}

// The block index of a tile, and whether its pairs need the mask test.
fn tile_index(tile: u32) -> u32 {
    return tile & 0x7fffffffu;
}

fn tile_partial(tile: u32) -> bool {
    return IS_SPARSE && HAS_PARTIAL && tile >= 0x80000000u;
}

// Byte index of block (0, 0) of the block mask of `seq` and query head h.
fn mask_base(seq: Seq, h: u32) -> u32 {
    if (!IS_SPARSE) {
        return 0u;
    }
    return seq.b * params.mask_batch_stride + (params.head_start + h) * params.mask_head_stride;
}

// Whether the block mask allows absolute row i, key j (sequence-relative)
// of a partial tile: in range and set. Kernels test it only in tiles that
// need it (`if (partial)`, one branch per tile, uniform across a workgroup).
fn block_allows(in_range: bool, base: u32, i: i32, j: i32) -> bool {
    if (!in_range) {
        return false;
    }
    let e = base + (u32(i) / params.mask_bm) * params.mask_cols + u32(j) / params.mask_bn;
    let word = side_word(params.mask_at + e / 4u);
    return ((word >> (8u * (e % 4u))) & 0xffu) != 0u;
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

// What a kernel's block of pairs needs to score them: the diagonal offset,
// ALiBi's slope, whether pairs are tested against the band and the
// sequence (`masking`, see pair_allowed) and against the block mask
// (`partial`, whose base is mask_at).
struct Block {
    offset: i32,
    slope: f32,
    masking: bool,
    partial: bool,
    mask_at: u32,
}

// Whether the pair of absolute row i and key j of block `b` takes part.
fn block_pair_ok(b: Block, in_range: bool, i: i32, j: i32) -> bool {
    var ok = pair_allowed(b.masking, in_range, b.offset, i, j);
    if (b.partial) {
        ok = ok && block_allows(in_range, b.mask_at, i, j);
    }
    return ok;
}

// The final score of raw score s (softcap, ALiBi), NEG_BIG where the pair
// does not take part.
fn block_score(b: Block, s: f32, in_range: bool, i: i32, j: i32) -> f32 {
    let sc = cap_score(s) - alibi_bias(b.slope, b.offset, i, j);
    return select(NEG_BIG, sc, block_pair_ok(b, in_range, i, j));
}

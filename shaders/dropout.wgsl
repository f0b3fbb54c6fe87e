// Dropout in the attention kernels (docs/dropout.md): the keep bits of a
// call's pairs from its Params (philox.wgsl draws them), and what the
// kernels do with them. With HAS_DROPOUT false (p = 0) each function here
// returns a constant the compiler folds, so the kernels carry no dropout
// code. Rows and keys are the absolute positions the masks use (in the
// sequence); the shard's origin, the global batch and query head are added
// here, so every piece of a split call draws the whole problem's mask.
// @common

// The Philox stream (counter words 2 and 3) of sequence b, query head h of
// this dispatch: offset + b · heads_q + head, 64-bit (the host checks that
// b · heads_q + head fits 32 bits).
fn dropout_stream(b: u32, h: u32) -> vec2<u32> {
    let x = b * params.drop_heads + params.head_start + h;
    let lo = params.drop_stream_lo + x;
    return vec2<u32>(lo, params.drop_stream_hi + select(0u, 1u, lo < x));
}

// The keep bits of sequence b, query head h, row `row` over keys col ..
// col + n - 1 (1 <= n <= 32): bit j for key col + j. All set without dropout.
fn dropout_bits(b: u32, h: u32, row: i32, col: i32, n: u32) -> u32 {
    if (!HAS_DROPOUT) {
        return 0xffffffffu;
    }
    let key = vec2<u32>(params.drop_key_lo, params.drop_key_hi);
    return dropout_run(key, dropout_stream(b, h), params.drop_threshold,
        u32(row) + params.drop_row0, u32(col) + params.drop_col0, n);
}

// Whether bit j of keep bits is set (always without dropout).
fn dropout_kept(bits: u32, j: u32) -> bool {
    if (!HAS_DROPOUT) {
        return true;
    }
    return ((bits >> j) & 1u) != 0u;
}

// P where kept, 0 where dropped: what P·V (and dV) takes. The row sum takes
// the undropped P, so the LSE is the undropped one.
fn dropout_p(p: f32, kept: bool) -> f32 {
    return select(0.0, p, kept);
}

// 1 / (1 − p): applied once to the f32 sums (O's normalization, dV's sums),
// as the CPU backend does; 1 without dropout.
fn dropout_scale() -> f32 {
    if (!HAS_DROPOUT) {
        return 1.0;
    }
    return params.drop_scale;
}

// dP' = dP ∘ keep / (1 − p), the backward's dP under dropout.
fn dropout_dp(dp: f32, kept: bool) -> f32 {
    if (!HAS_DROPOUT) {
        return dp;
    }
    return select(0.0, dp * params.drop_scale, kept);
}
// @tile
// The keep factors of a tile, for kernels whose invocations own strided keys
// (the tiled, registers and coop families): the workgroup draws them
// together where it loads the tile's operands, 32 keys at one Philox call
// per 8, into P's own tile (p_tile: KEEP_ROWS × KEEP_COLS of KEEP_T, 1 kept,
// 0 dropped; free until P is written), and each pair reads its factor
// where it writes its P over it: no workgroup storage beyond the plan's.
// The composer names the kernel's own sizes and type for KEEP_ROWS,
// KEEP_COLS and KEEP_T.
fn fill_keep_tile(tid: u32, b: u32, h: u32, row0: i32, col0: i32) {
    if (!HAS_DROPOUT) {
        return;
    }
    let words = (KEEP_COLS + 31u) / 32u;
    for (var e = tid; e < KEEP_ROWS * words; e += WG) {
        let r = e / words;
        let c0 = 32u * (e % words);
        let bits = dropout_bits(b, h, row0 + i32(r), col0 + i32(c0), min(32u, KEEP_COLS - c0));
        for (var j = 0u; j < 32u; j++) {
            if (c0 + j < KEEP_COLS) {
                p_tile[r * KEEP_COLS + c0 + j] = KEEP_T(select(0.0, 1.0, ((bits >> j) & 1u) != 0u));
            }
        }
    }
}

// Whether pair (r, c) of the tile is kept (always without dropout); read by
// the invocation that then writes P there.
fn tile_kept(r: u32, c: u32) -> bool {
    if (!HAS_DROPOUT) {
        return true;
    }
    return p_tile[r * KEEP_COLS + c] != KEEP_T(0.0);
}
// @lanes
// The lanes kernels' keep bits: a row against a step's SG keys col.. (bit j
// of word j / 32 for key col + j), drawn by the lane that owns the row.
fn dropout_lanes(b: u32, h: u32, row: i32, col: i32) -> vec2<u32> {
    if (!HAS_DROPOUT) {
        return vec2<u32>(0xffffffffu);
    }
    var high = 0u;
    if (SG > 32u) {
        high = dropout_bits(b, h, row, col + 32, min(SG - 32u, 32u));
    }
    return vec2<u32>(dropout_bits(b, h, row, col, min(SG, 32u)), high);
}

// Whether key j of the step is kept under dropout_lanes' bits.
fn lanes_kept(bits: vec2<u32>, j: u32) -> bool {
    return dropout_kept(select(bits.x, bits.y, j >= 32u), j & 31u);
}

// Naive attention, the baseline flash is measured against: S = scale·Q·Kᵀ
// (matmul.wgsl, scores epilogue) and P = softmax(S) are materialized in
// storage buffers (batch·heads·Sq·Sk f32 each), then O = P·V (matmul.wgsl).
// This file holds the softmax between them; the composer declares S and P
// (load_s/store_s, load_p/store_p).
//
// Dropout (dropout.wgsl) costs the baseline no buffer: the mask is a pure
// function of coordinates, so the row kernels redraw it where they store P
// or dS, and the matmuls take 1 / (1 − p) as their alpha.

// The keep bits of a row's walk over its keys 0, 1, ...: redrawn for the
// next 32 keys at every 32nd one (bit j & 31 is key j's), else `bits`.
fn walk_bits(bits: u32, b: u32, h: u32, i: u32, j: u32) -> u32 {
    if (!HAS_DROPOUT || (j & 31u) != 0u) {
        return bits;
    }
    return dropout_bits(b, h, i32(i), i32(j), min(32u, params.seqlen_k - j));
}

// (batch, query head, row in the sequence) of row `row` of S.
fn row_coords(row: u32) -> vec3<u32> {
    let bh = row / params.seqlen_q;
    return vec3<u32>(bh / params.heads_q, bh % params.heads_q, row % params.seqlen_q);
}

// One invocation per row: P = softmax(S), LSE written. With dropout (the
// forward's variant) P is stored as P·V takes it, dropped entries zeroed;
// the LSE is the undropped one.
@compute @workgroup_size(64)
fn softmax(@builtin(global_invocation_id) gid: vec3<u32>) {
    let row = gid.x;
    if (row >= params.batch * params.heads_q * params.seqlen_q) {
        return;
    }
    let c = row_coords(row);
    let base = row * params.seqlen_k;
    var m = NEG_BIG;
    for (var j = 0u; j < params.seqlen_k; j++) {
        m = max(m, load_s(base + j));
    }
    var l = 0.0;
    for (var j = 0u; j < params.seqlen_k; j++) {
        let sc = load_s(base + j);
        l += select(0.0, exp(sc - m), sc > NEG_BIG);
    }
    let inv_l = select(0.0, 1.0 / l, l > 0.0);
    var bits = 0u;
    for (var j = 0u; j < params.seqlen_k; j++) {
        bits = walk_bits(bits, c.x, c.y, c.z, j);
        let sc = load_s(base + j);
        let p = round_storage(select(0.0, exp(sc - m), sc > NEG_BIG) * inv_l);
        store_p(base + j, dropout_p(p, dropout_kept(bits, j & 31u)));
    }
    store_lse(c.x * params.lse_batch_stride + c.y * params.lse_head_stride + c.z, select(neg_inf(), m + log(l), l > 0.0));
    io_flush();
    check_loop_budget();
}

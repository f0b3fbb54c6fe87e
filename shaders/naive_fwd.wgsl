// Naive attention, the baseline flash is measured against: S = scale·Q·Kᵀ
// (matmul.wgsl, scores epilogue) and P = softmax(S) are materialized in
// storage buffers (batch·heads·Sq·Sk f32 each), then O = P·V (matmul.wgsl).
// This file holds the softmax between them; the composer declares S and P
// (load_s/store_s, load_p/store_p).

// One invocation per row: P = softmax(S), LSE written.
@compute @workgroup_size(64)
fn softmax(@builtin(global_invocation_id) gid: vec3<u32>) {
    let row = gid.x;
    if (row >= params.batch * params.heads_q * params.seqlen_q) {
        return;
    }
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
    for (var j = 0u; j < params.seqlen_k; j++) {
        let sc = load_s(base + j);
        store_p(base + j, round_storage(select(0.0, exp(sc - m), sc > NEG_BIG) * inv_l));
    }
    let bh = row / params.seqlen_q;
    let i = row % params.seqlen_q;
    let b = bh / params.heads_q;
    let h = bh % params.heads_q;
    store_lse(b * params.lse_batch_stride + h * params.lse_head_stride + i, select(neg_inf(), m + log(l), l > 0.0));
    io_flush();
    check_loop_budget();
}

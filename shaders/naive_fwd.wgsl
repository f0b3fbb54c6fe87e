// Naive attention, the baseline flash is measured against: S = Q·Kᵀ and
// P = softmax(S) are materialized in storage buffers (batch·heads·Sq·Sk f32
// each), then O = P·V. Same prelude as flash_fwd.wgsl (D, IS_MASKED,
// HAS_SOFTCAP, common, storage). Binding numbers follow `shaders::binding`.

@group(0) @binding(6) var<storage, read_write> s_buf: array<f32>;
@group(0) @binding(7) var<storage, read_write> p_buf: array<f32>;

// One invocation per score; z = batch·heads_q + head.
@compute @workgroup_size(16, 16)
fn scores(@builtin(global_invocation_id) gid: vec3<u32>) {
    let j = gid.x;
    let i = gid.y;
    let bh = gid.z;
    if (i >= params.seqlen_q || j >= params.seqlen_k) {
        return;
    }
    let b = bh / params.heads_q;
    let h = bh % params.heads_q;
    let qb = b * params.q_batch_stride + i * params.q_row_stride + h * D;
    let kb = b * params.kv_batch_stride + j * params.kv_row_stride + (h / params.group) * D;
    var dot = 0.0;
    for (var x = 0u; x < D; x++) {
        dot += load_q(qb + x) * load_k(kb + x);
    }
    var sc = cap_score(dot * params.scale);
    if (IS_MASKED) {
        sc = select(NEG_BIG, sc, band_allows(i32(params.q_start + i), i32(params.k_start + j)));
    }
    s_buf[(bh * params.seqlen_q + i) * params.seqlen_k + j] = sc;
}

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
        m = max(m, s_buf[base + j]);
    }
    var l = 0.0;
    for (var j = 0u; j < params.seqlen_k; j++) {
        let sc = s_buf[base + j];
        l += select(0.0, exp(sc - m), sc > NEG_BIG);
    }
    let inv_l = select(0.0, 1.0 / l, l > 0.0);
    for (var j = 0u; j < params.seqlen_k; j++) {
        let sc = s_buf[base + j];
        p_buf[base + j] = round_storage(select(0.0, exp(sc - m), sc > NEG_BIG) * inv_l);
    }
    let bh = row / params.seqlen_q;
    let i = row % params.seqlen_q;
    let b = bh / params.heads_q;
    let h = bh % params.heads_q;
    store_lse(b * params.lse_batch_stride + h * params.lse_head_stride + i, select(neg_inf(), m + log(l), l > 0.0));
}

// One invocation per output element; z = batch·heads_q + head.
@compute @workgroup_size(16, 16)
fn pv(@builtin(global_invocation_id) gid: vec3<u32>) {
    let x = gid.x;
    let i = gid.y;
    let bh = gid.z;
    if (i >= params.seqlen_q || x >= D) {
        return;
    }
    let b = bh / params.heads_q;
    let h = bh % params.heads_q;
    let vb = b * params.kv_batch_stride + (h / params.group) * D + x;
    let pb = (bh * params.seqlen_q + i) * params.seqlen_k;
    var acc = 0.0;
    for (var j = 0u; j < params.seqlen_k; j++) {
        acc += p_buf[pb + j] * load_v(vb + j * params.kv_row_stride);
    }
    store_o(b * params.q_batch_stride + i * params.q_row_stride + h * D + x, acc);
}

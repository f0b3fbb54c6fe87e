// Naive backward, the baseline for the flash backward: after the naive
// forward has stored S and P, dP = dO·Vᵀ is stored (matmul.wgsl), turned into
// dS in place here, dQ = scale·dS·K is a matmul, and dK, dV — sums over the
// query heads of each kv head — are computed here over the stored matrices.
// Appended to naive_fwd.wgsl (same prelude and buffers).

// Per row: D_i = Σ_j P·dP', then dS = P·(dP' - D_i), times the softcap
// derivative, where dP' = dP ∘ keep / (1 − p) under dropout (dP without).
// P here is the undropped one (the backward's softmax stores it whole); with
// dropout each P is then overwritten by P ∘ keep, what dV takes (the matmul
// or dkdv applies 1 / (1 − p) to its sums). The keep bits are drawn in both
// passes: recomputing them costs no storage traffic.
@compute @workgroup_size(64)
fn ds(@builtin(global_invocation_id) gid: vec3<u32>) {
    let row = gid.x;
    if (row >= params.batch * params.heads_q * params.seqlen_q) {
        return;
    }
    let c = row_coords(row);
    let base = row * params.seqlen_k;
    var dsum = 0.0;
    var bits = 0u;
    for (var j = 0u; j < params.seqlen_k; j++) {
        bits = walk_bits(bits, c.x, c.y, c.z, j);
        dsum += load_p(base + j) * dropout_dp(load_ds(base + j), dropout_kept(bits, j & 31u));
    }
    for (var j = 0u; j < params.seqlen_k; j++) {
        bits = walk_bits(bits, c.x, c.y, c.z, j);
        let kept = dropout_kept(bits, j & 31u);
        let p = load_p(base + j);
        var g = p * (dropout_dp(load_ds(base + j), kept) - dsum);
        if (HAS_SOFTCAP) {
            // s_buf holds C·tanh(x/C) for allowed entries.
            let sc = load_s(base + j);
            let th = select(0.0, sc / params.softcap, sc > NEG_BIG);
            g *= 1.0 - th * th;
        }
        store_ds(base + j, round_storage(g));
        if (HAS_DROPOUT) {
            store_p(base + j, dropout_p(p, kept));
        }
    }
    io_flush();
    check_loop_budget();
}

// Without GQA, dV = Pᵀ·dO and dK = scale·dSᵀ·Q are matmuls over transposed
// copies (P and dS are transposed into the buffers of S and P, which are no
// longer needed). One invocation per element; rows spread over x and y.
fn transposed_indices(gid: vec3<u32>, groups: vec3<u32>) -> vec3<u32> {
    let e = gid.x + gid.y * groups.x * 64u;
    let per_head = params.seqlen_q * params.seqlen_k;
    let z = e / per_head;
    let i = (e % per_head) / params.seqlen_k;
    let j = e % params.seqlen_k;
    // (in range, source index, destination index)
    let ok = select(0u, 1u, e < params.batch * params.heads_q * per_head);
    return vec3<u32>(ok, e, z * per_head + j * params.seqlen_q + i);
}

@compute @workgroup_size(64)
fn p_transposed(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
) {
    let t = transposed_indices(gid, groups);
    if (t.x == 1u) {
        store_s(t.z, load_p(t.y));
    }
    io_flush();
    check_loop_budget();
}

@compute @workgroup_size(64)
fn ds_transposed(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
) {
    let t = transposed_indices(gid, groups);
    if (t.x == 1u) {
        store_p(t.z, load_ds(t.y));
    }
    io_flush();
    check_loop_budget();
}

// With GQA: dK[j, x] = scale · Σ_{h in group} Σ_i dS[i, j] Q[i, x] and
// dV[j, x] = Σ P[i, j] dO[i, x] (P ∘ keep, times 1 / (1 − p), with dropout), summed over the group by one plain kernel
// (x < D for dK, x < DV for dV); z = batch·heads_kv + kv head.
@compute @workgroup_size(16, 16)
fn dkdv(@builtin(global_invocation_id) gid: vec3<u32>) {
    let x = gid.x;
    let j = gid.y;
    let bk = gid.z;
    if (j >= params.seqlen_k || x >= max(D, DV)) {
        return;
    }
    let heads_kv = params.heads_q / params.group;
    let b = bk / heads_kv;
    let hk = bk % heads_kv;
    var dk = 0.0;
    var dv = 0.0;
    for (var g = 0u; g < params.group; g++) {
        let h = hk * params.group + g;
        let bh = b * params.heads_q + h;
        for (var i = 0u; i < params.seqlen_q; i++) {
            let e = (bh * params.seqlen_q + i) * params.seqlen_k + j;
            let row = b * params.seqlen_q + i;
            if (x < D) {
                dk += load_ds(e) * load_q(row * params.q_row_stride + h * D + x);
            }
            if (x < DV) {
                dv += load_p(e) * load_do(row * params.o_row_stride + h * DV + x);
            }
        }
    }
    let key = b * params.seqlen_k + j;
    if (x < D) {
        store_dk(key * params.kv_row_stride + hk * D + x, dk * params.scale);
    }
    if (x < DV) {
        store_dv(key * params.v_row_stride + hk * DV + x, dv * dropout_scale());
    }
    io_flush();
    check_loop_budget();
}

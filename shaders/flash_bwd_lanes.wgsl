// FlashAttention backward for CPU adapters, the lanes counterpart of
// flash_bwd_dkdv.wgsl and flash_bwd_dq.wgsl (see flash_fwd_lanes.wgsl for
// why lanes, and for the `$j` / `$i` unrolling). A workgroup is one subgroup
// of SG lanes. dQ: each lane owns a query row and walks the visible key
// blocks, one key's K and V per lane per step. dK/dV: each lane owns a key
// and walks the visible query blocks of every head of its GQA group, one
// query's Q, dO, LSE and D per lane per step. Both recompute S, dP, P and dS
// with the tiled kernels' arithmetic (add_dot, p_and_ds); no atomics, so
// results are deterministic. The composer emits one section.
//
// Prelude: SG, D (a multiple of 4), IS_MASKED, HAS_SOFTCAP; load4_q/k/v/do,
// load_lse, load_dvec, store_dq or store_dk/store_dv, round_storage;
// flash_bwd_math.wgsl.
// @dq
@compute @workgroup_size(SG)
fn main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let q0 = (wg.x + params.block_offset) * SG;
    let h = wg.y;
    let b = wg.z;
    let rows_here = min(SG, params.seqlen_q - q0);
    let row_valid = tid < rows_here;
    let q_base = b * params.q_batch_stride + h * D + (q0 + tid) * params.q_row_stride;
    let kv_base = b * params.kv_batch_stride + (h / params.group) * D;
    var qr$i = vec4<f32>(0.0);
    var dor$i = vec4<f32>(0.0);
    var lse = 0.0;
    var dvec = 0.0;
    if (row_valid) {
        qr$i = load4_q(q_base / 4u + $iu) * params.scale;
        dor$i = load4_do(q_base / 4u + $iu);
        let g = b * params.lse_batch_stride + h * params.lse_head_stride + q0 + tid;
        lse = finite_lse(load_lse(g));
        dvec = load_dvec(g);
    }

    let first_row = i32(params.q_start + q0);
    let last_row = first_row + i32(rows_here) - 1;
    let keys = visible_keys(first_row, last_row);
    let key_blocks = block_range(keys, SG);
    let row_abs = first_row + i32(tid);
    var dq$i = vec4<f32>(0.0);
    for (var kb = key_blocks.x; kb < key_blocks.y; kb++) {
        let k0 = kb * SG;
        // Lane j holds key k0 + j; keys past the end read as zero.
        var kr$i = vec4<f32>(0.0);
        var vr$i = vec4<f32>(0.0);
        if (k0 + lane < params.seqlen_k) {
            let g = (kv_base + (k0 + lane) * params.kv_row_stride) / 4u;
            kr$i = load4_k(g + $iu);
            vr$i = load4_v(g + $iu);
        }
        var s$j = 0.0;
        var dp$j = 0.0;
        s$j = add_dot(s$j, qr$i, subgroupBroadcast(kr$i, $ju)); // i outer
        dp$j = add_dot(dp$j, dor$i, subgroupBroadcast(vr$i, $ju)); // i outer
        let k_abs0 = i32(params.k_start + k0);
        let masking = k0 + SG > params.seqlen_k || rows_here < SG
            || !band_covers(first_row, last_row, k_abs0, k_abs0 + i32(SG) - 1);
        let in$j = row_valid && k0 + $ju < params.seqlen_k;
        let pds$j = p_and_ds(s$j, dp$j, lse, dvec, pair_allowed(masking, in$j, row_abs, k_abs0 + $j));
        dq$i += pds$j.y * subgroupBroadcast(kr$i, $ju);
    }
    if (row_valid) {
        store_dq(q_base + 4u * $iu, dq$i.x * params.scale);
        store_dq(q_base + 4u * $iu + 1u, dq$i.y * params.scale);
        store_dq(q_base + 4u * $iu + 2u, dq$i.z * params.scale);
        store_dq(q_base + 4u * $iu + 3u, dq$i.w * params.scale);
    }
    io_flush();
    check_loop_budget();
}
// @dkdv
@compute @workgroup_size(SG)
fn main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let k0 = (wg.x + params.block_offset) * SG;
    let hk = wg.y;
    let b = wg.z;
    let keys_here = min(SG, params.seqlen_k - k0);
    let key_valid = tid < keys_here;
    let kv_row = b * params.kv_batch_stride + (k0 + tid) * params.kv_row_stride + hk * D;
    var kr$i = vec4<f32>(0.0);
    var vr$i = vec4<f32>(0.0);
    if (key_valid) {
        kr$i = load4_k(kv_row / 4u + $iu);
        vr$i = load4_v(kv_row / 4u + $iu);
    }

    // Skip, don't mask: only query blocks that see one of these keys.
    let key_abs0 = i32(params.k_start + k0);
    let key_abs = key_abs0 + i32(tid);
    let rows = visible_rows(key_abs0, key_abs0 + i32(keys_here) - 1);
    let row_blocks = block_range(rows, SG);
    var dk$i = vec4<f32>(0.0);
    var dv$i = vec4<f32>(0.0);
    for (var g = 0u; g < params.group; g++) {
        let h = hk * params.group + g;
        for (var qb = row_blocks.x; qb < row_blocks.y; qb++) {
            let q0 = qb * SG;
            let rows_here = min(SG, params.seqlen_q - q0);
            // Lane j holds query row q0 + j; rows past the end read as zero.
            var qr$i = vec4<f32>(0.0);
            var dor$i = vec4<f32>(0.0);
            var lse = 0.0;
            var dvec = 0.0;
            if (lane < rows_here) {
                let qg = (b * params.q_batch_stride + h * D + (q0 + lane) * params.q_row_stride) / 4u;
                qr$i = load4_q(qg + $iu) * params.scale;
                dor$i = load4_do(qg + $iu);
                let lg = b * params.lse_batch_stride + h * params.lse_head_stride + q0 + lane;
                lse = finite_lse(load_lse(lg));
                dvec = load_dvec(lg);
            }
            var s$j = 0.0;
            var dp$j = 0.0;
            s$j = add_dot(s$j, subgroupBroadcast(qr$i, $ju), kr$i); // i outer
            dp$j = add_dot(dp$j, subgroupBroadcast(dor$i, $ju), vr$i); // i outer
            let row_abs0 = i32(params.q_start + q0);
            let masking = rows_here < SG || keys_here < SG
                || !band_covers(row_abs0, row_abs0 + i32(SG) - 1, key_abs0, key_abs0 + i32(SG) - 1);
            let in$j = key_valid && $ju < rows_here;
            let ok$j = pair_allowed(masking, in$j, row_abs0 + $j, key_abs);
            let pds$j = p_and_ds(s$j, dp$j, subgroupBroadcast(lse, $ju), subgroupBroadcast(dvec, $ju), ok$j);
            // dV += Pᵀ dO, dK += dSᵀ (Q·scale), over this block's rows.
            dv$i += pds$j.x * subgroupBroadcast(dor$i, $ju);
            dk$i += pds$j.y * subgroupBroadcast(qr$i, $ju);
        }
    }
    if (key_valid) {
        store_dk(kv_row + 4u * $iu, dk$i.x);
        store_dk(kv_row + 4u * $iu + 1u, dk$i.y);
        store_dk(kv_row + 4u * $iu + 2u, dk$i.z);
        store_dk(kv_row + 4u * $iu + 3u, dk$i.w);
        store_dv(kv_row + 4u * $iu, dv$i.x);
        store_dv(kv_row + 4u * $iu + 1u, dv$i.y);
        store_dv(kv_row + 4u * $iu + 2u, dv$i.z);
        store_dv(kv_row + 4u * $iu + 3u, dv$i.w);
    }
    io_flush();
    check_loop_budget();
}

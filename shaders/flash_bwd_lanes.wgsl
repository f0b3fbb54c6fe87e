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
// `$i` repeats over the vec4s of a q or k row (D/4), `$v` over those of a
// v or dO row (DV/4).
//
// Prelude: SG, D and DV (multiples of 4), IS_MASKED, HAS_SOFTCAP; load4_q/k/v/do,
// load_lse, load_dvec, store_dq or store_dk/store_dv, round_storage;
// flash_bwd_math.wgsl; dropout_lanes (dropout.wgsl).
// @dq
@compute @workgroup_size(SG)
fn main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let seq = sequence(wg, SG, false);
    let q0 = seq.block * SG;
    let h = wg.y;
    let hk = h / params.group;
    let rows_here = min(SG, seq.rows - q0);
    let row_valid = tid < rows_here;
    let q_row = seq.q_row + q0 + tid;
    let q_base = q_row * params.q_row_stride + h * D;
    var qr$i = vec4<f32>(0.0);
    var dor$v = vec4<f32>(0.0);
    var lse = 0.0;
    var dvec = 0.0;
    if (row_valid) {
        qr$i = load4_q(q_base / 4u + $iu) * params.scale;
        dor$v = load4_do((q_row * params.o_row_stride + h * DV) / 4u + $vu);
        let g = seq.lse + h * params.lse_head_stride + q0 + tid;
        lse = finite_lse(load_lse(g));
        dvec = load_dvec(g);
    }

    let first_row = i32(params.q_start + q0);
    let last_row = first_row + i32(rows_here) - 1;
    let steps = tile_steps(seq, h, visible_keys(seq, first_row, last_row), SG, false);
    let slope = alibi_slope(seq, h);
    let mask_at = mask_base(seq, h);
    let row_abs = first_row + i32(tid);
    var dq$i = vec4<f32>(0.0);
    var next = tile_at(steps.x, false);
    for (var step = steps.x; step < steps.y; step++) {
        let tile = next;
        next = tile_after(step, steps, false);
        let partial = tile_partial(tile);
        let k0 = tile_index(tile) * SG;
        // Lane j holds key k0 + j; keys past the end read as zero.
        var kr$i = vec4<f32>(0.0);
        var vr$v = vec4<f32>(0.0);
        if (k0 + lane < seq.keys) {
            let key = seq.k_row + k0 + lane;
            let k_at = (key * params.kv_row_stride + hk * D) / 4u;
            let v_at = (key * params.v_row_stride + hk * DV) / 4u;
            kr$i = load4_k(k_at + $iu);
            vr$v = load4_v(v_at + $vu);
        }
        var s$j = 0.0;
        var dp$j = 0.0;
        s$j = add_dot(s$j, qr$i, subgroupBroadcast(kr$i, $ju)); // i outer
        dp$j = add_dot(dp$j, dor$v, subgroupBroadcast(vr$v, $ju)); // v outer
        let k_abs0 = i32(params.k_start + k0);
        let masking = partial || k0 + SG > seq.keys || rows_here < SG
            || !band_covers(seq.offset, first_row, last_row, k_abs0, k_abs0 + i32(SG) - 1);
        let in$j = row_valid && k0 + $ju < seq.keys;
        var ok$j = pair_allowed(masking, in$j, seq.offset, row_abs, k_abs0 + $j);
        if (partial) {
        ok$j = ok$j && block_allows(in$j, mask_at, row_abs, k_abs0 + $j);
        }
        let keep = dropout_lanes(seq.b, h, row_abs, k_abs0);
        let pds$j = p_and_ds(s$j, alibi_bias(slope, seq.offset, row_abs, k_abs0 + $j), dp$j, lse, dvec, ok$j, lanes_kept(keep, $ju));
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
    let seq = sequence(wg, SG, true);
    let k0 = seq.block * SG;
    let hk = wg.y;
    let keys_here = min(SG, seq.keys - k0);
    let key_valid = tid < keys_here;
    let key_row = seq.k_row + k0 + tid;
    let k_row = key_row * params.kv_row_stride + hk * D;
    let v_row = key_row * params.v_row_stride + hk * DV;
    var kr$i = vec4<f32>(0.0);
    var vr$v = vec4<f32>(0.0);
    if (key_valid) {
        kr$i = load4_k(k_row / 4u + $iu);
        vr$v = load4_v(v_row / 4u + $vu);
    }

    // Skip, don't mask: only query blocks that see one of these keys.
    let key_abs0 = i32(params.k_start + k0);
    let key_abs = key_abs0 + i32(tid);
    let rows = visible_rows(seq, key_abs0, key_abs0 + i32(keys_here) - 1);
    var dk$i = vec4<f32>(0.0);
    var dv$v = vec4<f32>(0.0);
    for (var g = 0u; g < params.group; g++) {
        let h = hk * params.group + g;
        let steps = tile_steps(seq, h, rows, SG, true);
        let slope = alibi_slope(seq, h);
        let mask_at = mask_base(seq, h);
        var next = tile_at(steps.x, true);
        for (var step = steps.x; step < steps.y; step++) {
            let tile = next;
            next = tile_after(step, steps, true);
            let partial = tile_partial(tile);
            let q0 = tile_index(tile) * SG;
            let rows_here = min(SG, seq.rows - q0);
            // Lane j holds query row q0 + j; rows past the end read as zero.
            var qr$i = vec4<f32>(0.0);
            var dor$v = vec4<f32>(0.0);
            var lse = 0.0;
            var dvec = 0.0;
            if (lane < rows_here) {
                let row = seq.q_row + q0 + lane;
                qr$i = load4_q((row * params.q_row_stride + h * D) / 4u + $iu) * params.scale;
                dor$v = load4_do((row * params.o_row_stride + h * DV) / 4u + $vu);
                let lg = seq.lse + h * params.lse_head_stride + q0 + lane;
                lse = finite_lse(load_lse(lg));
                dvec = load_dvec(lg);
            }
            var s$j = 0.0;
            var dp$j = 0.0;
            s$j = add_dot(s$j, subgroupBroadcast(qr$i, $ju), kr$i); // i outer
            dp$j = add_dot(dp$j, subgroupBroadcast(dor$v, $ju), vr$v); // v outer
            let row_abs0 = i32(params.q_start + q0);
            let masking = partial || rows_here < SG || keys_here < SG
                || !band_covers(seq.offset, row_abs0, row_abs0 + i32(SG) - 1, key_abs0, key_abs0 + i32(SG) - 1);
            let in$j = key_valid && $ju < rows_here;
            var ok$j = pair_allowed(masking, in$j, seq.offset, row_abs0 + $j, key_abs);
            if (partial) {
            ok$j = ok$j && block_allows(in$j, mask_at, row_abs0 + $j, key_abs);
            }
            let bias$j = alibi_bias(slope, seq.offset, row_abs0 + $j, key_abs);
            // Lane j draws row j's bits for the step's keys; each lane reads its key's.
            let keep = dropout_lanes(seq.b, h, row_abs0 + i32(lane), key_abs0);
            let pds$j = p_and_ds(s$j, bias$j, dp$j, subgroupBroadcast(lse, $ju), subgroupBroadcast(dvec, $ju), ok$j, lanes_kept(subgroupBroadcast(keep, $ju), tid));
            // dV += Pᵀ dO, dK += dSᵀ (Q·scale), over this block's rows.
            dv$v += pds$j.x * subgroupBroadcast(dor$v, $ju);
            dk$i += pds$j.y * subgroupBroadcast(qr$i, $ju);
        }
    }
    if (key_valid) {
        store_dk(k_row + 4u * $iu, dk$i.x);
        store_dk(k_row + 4u * $iu + 1u, dk$i.y);
        store_dk(k_row + 4u * $iu + 2u, dk$i.z);
        store_dk(k_row + 4u * $iu + 3u, dk$i.w);
        store_dv(v_row + 4u * $vu, dv$v.x * dropout_scale());
        store_dv(v_row + 4u * $vu + 1u, dv$v.y * dropout_scale());
        store_dv(v_row + 4u * $vu + 2u, dv$v.z * dropout_scale());
        store_dv(v_row + 4u * $vu + 3u, dv$v.w * dropout_scale());
    }
    io_flush();
    check_loop_budget();
}

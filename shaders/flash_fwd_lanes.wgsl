// FlashAttention forward for CPU adapters (lavapipe): the planner picks it
// where a workgroup of SG invocations is one SIMD subgroup, so that a
// subgroup broadcast from a constant lane is a register shuffle. Each lane
// owns RPL query rows — q and the output accumulators live in registers as
// D/4 vec4s per row — and at each step loads one key's K and V rows; every
// lane then reads all SG keys through subgroupBroadcast. No workgroup memory
// and no barriers: llvmpipe turns every per-invocation load into a loop over
// the SIMD lanes, so the tiled kernel, which loads from workgroup memory once
// per multiply-add, is bound by loads; here SG keys cost D/2 vec4 loads per
// lane. Online softmax, masking and precision follow flash_fwd.wgsl.
//
// The composer unrolls this text (shaders.rs, `unroll`): a line containing
// `$r` repeats for each of a lane's rows r < RPL (row q0 + r·SG + lane), `$j`
// for each lane j < SG, `$i` for each vec4 i < D/4 of a q or k row, `$v` for
// each vec4 v < DV/4 of a v or o row; nested r, j, i (or v), or i (v)
// outermost where the line ends in `// i outer` (`// v outer`). WGSL has no unroll
// directive, and llvmpipe keeps arrays that loops index in memory, which
// would cost as much as the loads this kernel saves. The order matters: each
// score is a chain of dependent adds (add_dot), LLVM keeps the order it is
// given, and RPL·SG interleaved chains hide the adds' latency.
//
// Prelude: SG, RPL, D and DV (multiples of 4), IS_MASKED, HAS_SOFTCAP; load4_q/k/v
// (four consecutive elements at vec4 index i), store_o, store_lse,
// round_storage from a storage template; score_scale, out_scale
// (head_scale.wgsl); dropout_lanes (dropout.wgsl).

@compute @workgroup_size(SG)
fn main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let seq = sequence(wg, SG * RPL, false);
    let q0 = seq.block * SG * RPL;
    let h = wg.y;
    let hk = h / params.group;
    let rows_here = min(SG * RPL, seq.rows - q0);
    let row_valid$r = $ru * SG + tid < rows_here;
    let q_row$r = seq.q_row + q0 + $ru * SG + tid;
    let q_base$r = q_row$r * params.q_row_stride + h * D;
    let o_base$r = q_row$r * params.o_row_stride + h * DV;
    let q_scale = score_scale(seq.b, h);
    var qr$r_$i = vec4<f32>(0.0);
    if (row_valid$r) { qr$r_$i = load4_q(q_base$r / 4u + $iu) * q_scale; }

    // Skip, don't mask: only key blocks some row of this block may see are visited.
    let first_row = i32(params.q_start + q0);
    let last_row = first_row + i32(rows_here) - 1;
    let steps = tile_steps(seq, h, visible_keys(seq, first_row, last_row), SG, false);
    let slope = alibi_slope(seq, h);
    let mask_at = mask_base(seq, h);
    let row_abs$r = first_row + i32($ru * SG + tid);
    let start = softmax_start(h);
    var m_run$r = start.x;
    var l$r = start.y;
    var acc$r_$v = vec4<f32>(0.0);

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

        // Summed like the tiled kernels (add_dot): the backward recomputes
        // scores that way, and s − LSE must be exact for a row's largest score.
        var s$r_$j = 0.0;
        s$r_$j = add_dot(s$r_$j, qr$r_$i, subgroupBroadcast(kr$i, $ju)); // i outer
        // Mask only where the block crosses a boundary of the band or the sequence.
        let k_abs0 = i32(params.k_start + k0);
        let masking = partial || k0 + SG > seq.keys || rows_here < SG * RPL
            || !band_covers(seq.offset, first_row, last_row, k_abs0, k_abs0 + i32(SG) - 1);
        let in$r_$j = row_valid$r && k0 + $ju < seq.keys;
        var ok$r_$j = pair_allowed(masking, in$r_$j, seq.offset, row_abs$r, k_abs0 + $j);
        if (partial) {
        ok$r_$j = ok$r_$j && block_allows(in$r_$j, mask_at, row_abs$r, k_abs0 + $j);
        }
        s$r_$j = select(NEG_BIG, cap_score(s$r_$j) - alibi_bias(slope, seq.offset, row_abs$r, k_abs0 + $j), ok$r_$j);
        let keep$r = dropout_lanes(seq.b, h, row_abs$r, k_abs0);

        var m_new$r = m_run$r;
        m_new$r = max(m_new$r, s$r_$j);
        let alpha$r = exp(m_run$r - m_new$r);
        m_run$r = m_new$r;
        l$r *= alpha$r;
        acc$r_$v *= alpha$r;
        // Row sums use the unrounded, undropped P; P·V uses P in storage
        // precision, zero where dropout drops it.
        let p$r_$j = select(0.0, exp(s$r_$j - m_new$r), s$r_$j > NEG_BIG);
        l$r += p$r_$j;
        let pv$r_$j = round_storage(dropout_p(p$r_$j, lanes_kept(keep$r, $ju)));
        acc$r_$v += pv$r_$j * subgroupBroadcast(vr$v, $ju);
    }

    let inv_l$r = select(0.0, out_scale(seq.b, h) * dropout_scale() / l$r, l$r > 0.0);
    let lse$r = select(neg_inf(), m_run$r + log(l$r), l$r > 0.0);
    let lse_base = seq.lse + h * params.lse_head_stride + q0 + tid;
    if (row_valid$r) { store_o(o_base$r + 4u * $vu, acc$r_$v.x * inv_l$r); }
    if (row_valid$r) { store_o(o_base$r + 4u * $vu + 1u, acc$r_$v.y * inv_l$r); }
    if (row_valid$r) { store_o(o_base$r + 4u * $vu + 2u, acc$r_$v.z * inv_l$r); }
    if (row_valid$r) { store_o(o_base$r + 4u * $vu + 3u, acc$r_$v.w * inv_l$r); }
    if (row_valid$r) { store_lse(lse_base + $ru * SG, lse$r); }
    io_flush();
    check_loop_budget();
}

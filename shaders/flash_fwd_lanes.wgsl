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
// for each lane j < SG, `$i` for each vec4 i < D/4 of a row; nested r, j, i,
// or i outermost where the line ends in `// i outer`. WGSL has no unroll
// directive, and llvmpipe keeps arrays that loops index in memory, which
// would cost as much as the loads this kernel saves. The order matters: each
// score is a chain of dependent adds (add_dot), LLVM keeps the order it is
// given, and RPL·SG interleaved chains hide the adds' latency.
//
// Prelude: SG, RPL, D (a multiple of 4), IS_MASKED, HAS_SOFTCAP; load4_q/k/v
// (four consecutive elements at vec4 index i), store_o, store_lse,
// round_storage from a storage template; score_scale, out_scale
// (head_scale.wgsl).

@compute @workgroup_size(SG)
fn main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let q0 = (wg.x + params.block_offset) * SG * RPL;
    let h = wg.y;
    let b = wg.z;
    let rows_here = min(SG * RPL, params.seqlen_q - q0);
    let kv_base = b * params.kv_batch_stride + (h / params.group) * D;
    let row_valid$r = $ru * SG + tid < rows_here;
    let q_base$r = b * params.q_batch_stride + h * D + (q0 + $ru * SG + tid) * params.q_row_stride;
    let q_scale = score_scale(b, h);
    var qr$r_$i = vec4<f32>(0.0);
    if (row_valid$r) { qr$r_$i = load4_q(q_base$r / 4u + $iu) * q_scale; }

    // Skip, don't mask: only key blocks some row of this block may see are visited.
    let first_row = i32(params.q_start + q0);
    let last_row = first_row + i32(rows_here) - 1;
    let keys = visible_keys(first_row, last_row);
    let key_blocks = block_range(keys, SG);
    let row_abs$r = first_row + i32($ru * SG + tid);
    var m_run$r = NEG_BIG;
    var l$r = 0.0;
    var acc$r_$i = vec4<f32>(0.0);

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

        // Summed like the tiled kernels (add_dot): the backward recomputes
        // scores that way, and s − LSE must be exact for a row's largest score.
        var s$r_$j = 0.0;
        s$r_$j = add_dot(s$r_$j, qr$r_$i, subgroupBroadcast(kr$i, $ju)); // i outer
        // Mask only where the block crosses a boundary of the band or the sequence.
        let k_abs0 = i32(params.k_start + k0);
        let masking = k0 + SG > params.seqlen_k || rows_here < SG * RPL
            || !band_covers(first_row, last_row, k_abs0, k_abs0 + i32(SG) - 1);
        let in$r_$j = row_valid$r && k0 + $ju < params.seqlen_k;
        s$r_$j = select(NEG_BIG, cap_score(s$r_$j), pair_allowed(masking, in$r_$j, row_abs$r, k_abs0 + $j));

        var m_new$r = m_run$r;
        m_new$r = max(m_new$r, s$r_$j);
        let alpha$r = exp(m_run$r - m_new$r);
        m_run$r = m_new$r;
        l$r *= alpha$r;
        acc$r_$i *= alpha$r;
        // Row sums use the unrounded P; P·V uses P in storage precision.
        let p$r_$j = select(0.0, exp(s$r_$j - m_new$r), s$r_$j > NEG_BIG);
        l$r += p$r_$j;
        acc$r_$i += round_storage(p$r_$j) * subgroupBroadcast(vr$i, $ju);
    }

    let inv_l$r = select(0.0, out_scale(b, h) / l$r, l$r > 0.0);
    let lse$r = select(neg_inf(), m_run$r + log(l$r), l$r > 0.0);
    let lse_base = b * params.lse_batch_stride + h * params.lse_head_stride + q0 + tid;
    if (row_valid$r) { store_o(q_base$r + 4u * $iu, acc$r_$i.x * inv_l$r); }
    if (row_valid$r) { store_o(q_base$r + 4u * $iu + 1u, acc$r_$i.y * inv_l$r); }
    if (row_valid$r) { store_o(q_base$r + 4u * $iu + 2u, acc$r_$i.z * inv_l$r); }
    if (row_valid$r) { store_o(q_base$r + 4u * $iu + 3u, acc$r_$i.w * inv_l$r); }
    if (row_valid$r) { store_lse(lse_base + $ru * SG, lse$r); }
    io_flush();
    check_loop_budget();
}

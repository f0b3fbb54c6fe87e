// FlashAttention forward for CPU adapters (lavapipe): the planner picks it
// where a workgroup of SG invocations is one SIMD subgroup, so that a
// subgroup broadcast from a constant lane is a register shuffle. Each lane
// owns one query row — q and the output accumulator live in registers as
// D/4 vec4s — and at each step loads one key's K and V rows; every lane then
// reads all SG keys through subgroupBroadcast. No workgroup memory and no
// barriers: llvmpipe turns every per-invocation load into a loop over the
// SIMD lanes, so the tiled kernel, which loads from workgroup memory once
// per multiply-add, is bound by loads; here SG keys cost D/2 vec4 loads per
// lane. Online softmax, masking and precision follow flash_fwd.wgsl.
//
// The composer unrolls this text: a line containing `$j` is repeated for
// each lane j < SG, one containing `$i` for each vec4 i < D/4 of a row,
// j outer unless the line ends in `// i outer`. WGSL has no unroll
// directive, and llvmpipe keeps arrays that loops index in memory, which
// would cost as much as the loads this kernel saves. The order matters:
// each score is a chain of dependent adds (see add_dot), and LLVM keeps the
// order it is given, so the SG chains are interleaved.
//
// Prelude: SG, D (a multiple of 4), IS_MASKED, HAS_SOFTCAP; load4_q/k/v
// (four consecutive elements at vec4 index i), store_o, store_lse,
// round_storage from a storage template.

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
    if (row_valid) {
        qr$i = load4_q(q_base / 4u + $iu) * params.scale;
    }

    // Skip, don't mask: only key blocks some row of this block may see are visited.
    let first_row = i32(params.q_start + q0);
    let last_row = first_row + i32(rows_here) - 1;
    let keys = visible_keys(first_row, last_row);
    let kb_begin = u32(keys.x) / SG;
    let kb_end = select(kb_begin, (u32(keys.y) + SG - 1u) / SG, keys.y > keys.x);
    let row_abs = first_row + i32(tid);
    var m_run = NEG_BIG;
    var l = 0.0;
    var acc$i = vec4<f32>(0.0);

    for (var kb = kb_begin; kb < kb_end; kb++) {
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
        // Summed like the tiled kernels (add_dot): the backward recomputes
        // scores that way, and s − LSE must be exact for a row's largest score.
        s$j = add_dot(s$j, qr$i, subgroupBroadcast(kr$i, $ju)); // i outer
        // Mask only where the block crosses a boundary of the band or the sequence.
        let k_abs0 = i32(params.k_start + k0);
        let masking = k0 + SG > params.seqlen_k || rows_here < SG
            || !band_covers(first_row, last_row, k_abs0, k_abs0 + i32(SG) - 1);
        s$j = select(NEG_BIG, cap_score(s$j), pair_allowed(masking, row_valid && k0 + $ju < params.seqlen_k, row_abs, k_abs0 + $j));

        var m_new = m_run;
        m_new = max(m_new, s$j);
        let alpha = exp(m_run - m_new);
        m_run = m_new;
        l *= alpha;
        acc$i *= alpha;
        // Row sums use the unrounded P; P·V uses P in storage precision.
        let p$j = select(0.0, exp(s$j - m_new), s$j > NEG_BIG);
        l += p$j;
        acc$i += round_storage(p$j) * subgroupBroadcast(vr$i, $ju);
    }

    if (row_valid) {
        let inv_l = select(0.0, 1.0 / l, l > 0.0);
        store_o(q_base + 4u * $iu, acc$i.x * inv_l);
        store_o(q_base + 4u * $iu + 1u, acc$i.y * inv_l);
        store_o(q_base + 4u * $iu + 2u, acc$i.z * inv_l);
        store_o(q_base + 4u * $iu + 3u, acc$i.w * inv_l);
        let lse = select(neg_inf(), m_run + log(l), l > 0.0);
        store_lse(b * params.lse_batch_stride + h * params.lse_head_stride + q0 + tid, lse);
    }
    io_flush();
    check_loop_budget();
}

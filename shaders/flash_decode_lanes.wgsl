// Split-KV decoding for CPU adapters (lavapipe), as flash_fwd_lanes.wgsl is
// the forward for them: a workgroup is one subgroup of SG lanes and takes
// the same rows, keys and outputs as flash_decode.wgsl's workgroup (packed
// rows of one kv head's query group, the keys of one split), with no
// workgroup memory and no barriers. Each lane owns the vec4 chunks
// lane + c·SG of every row: it loads those of q once (so q is read once)
// and every lane gets all of q by subgroup broadcast into registers. v and
// o rows have head dim DV, whose chunks lanes own the same way. Lane j
// scores key k0 + j of each block against every row; the rows' maxima and
// sums are subgroup reductions; for P·V each lane accumulates its own
// chunks, taking each key's P and cache row by subgroup broadcast.
//
// The composer unrolls this text (compose.rs, `unroll`): `$r` repeats for
// each row < RB, `$j` for each lane < SG, `$c` for each owned chunk < CPL,
// `$i` for each vec4 of a row < D/4.
//
// Prelude: SG = WG (and SGC, the same as a const for broadcast lanes), RB,
// D and DV (multiples of 4), CPL = ceil(max(D, DV)/4 / SG),
// IS_PARTIAL, IS_MASKED, HAS_SOFTCAP, HAS_ALIBI, HAS_SINKS; common.wgsl; decode_common.wgsl;
// load4_q/k/v (k and v before cache_k_scale, cache_v_scale), store_o,
// store_lse, round_storage.

fn empty_lse() -> f32 {
    if (IS_PARTIAL) {
        return NEG_BIG;
    }
    return neg_inf();
}

@compute @workgroup_size(SG)
fn main(
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let split = wg.x / decode.row_blocks;
    let pb = (wg.x % decode.row_blocks) * RB;
    let hk = wg.y;
    let b = wg.z;
    let g = params.group;
    let rows_here = min(RB, decode.group_rows - pb);
    let keys_b = seqlen_k(b);
    let offset = i32(keys_b) - i32(params.seqlen_q);
    let row_ok$r = $ru < rows_here;
    // Rows past the group's end read the last row's q and are never stored.
    let prow$r = min(pb + $ru, decode.group_rows - 1u);
    let q_at$r = q_offset(b, prow$r / g, hk * g + prow$r % g);
    let row_abs$r = i32(prow$r / g) + offset;
    let chunk$c = lane + $cu * SG;
    let own$c = chunk$c < D / 4u;
    let own_v$c = chunk$c < DV / 4u;
    var qa$r = array<vec4<f32>, CPL>();
    if (row_ok$r && own$c) { qa$r[$c] = load4_q(q_at$r / 4u + chunk$c); }
    let q$r_$i = subgroupBroadcast(qa$r[$iu / SGC], $iu % SGC);

    let split_lo = min(split * decode.keys_per_split, keys_b);
    var lo = i32(split_lo);
    var hi = i32(min(split_lo + decode.keys_per_split, keys_b));
    if (IS_MASKED) {
        lo = max(lo, i32(pb / g) + offset - params.window_left);
        hi = min(hi, i32((pb + rows_here - 1u) / g) + offset + params.window_right + 1);
    }

    let head$r = hk * g + prow$r % g;
    let slope$r = alibi_slope_at(b, head$r);
    let start$r = decode_start(split, head$r);
    var m$r = start$r.x;
    // Each lane's share of a row's sum (the rescales are uniform); lane 0
    // holds the sink's.
    var l$r = select(0.0, start$r.y, lane == 0u);
    var acc$r_$c = vec4<f32>(0.0);
    for (var k0 = lo; k0 < hi; k0 += i32(SG)) {
        let j = k0 + i32(lane);
        var row = 0u;
        var s$r = 0.0;
        if (j < hi) {
            row = cache_row(b, u32(j));
            let k_at = (row * params.kv_row_stride + hk * D) / 4u;
            let k_scale = cache_k_scale(row, hk);
            let kr$i = load4_k(k_at + $iu) * k_scale;
            s$r = add_dot(s$r, q$r_$i, kr$i); // i outer
        }
        let ok$r = j < hi && row_ok$r && (!IS_MASKED || band_allows(0, row_abs$r, j));
        s$r = select(NEG_BIG, cap_score(s$r * params.scale) - alibi_bias(slope$r, 0, row_abs$r, j), ok$r);
        let m_new$r = max(m$r, subgroupMax(s$r));
        let alpha$r = exp(m$r - m_new$r);
        m$r = m_new$r;
        // Row sums use the unrounded P; P·V uses P in storage precision.
        let pf$r = select(0.0, exp(s$r - m_new$r), s$r > NEG_BIG);
        l$r = l$r * alpha$r + pf$r;
        let pr$r = round_storage(pf$r);
        acc$r_$c *= alpha$r;
        let row$j = subgroupBroadcast(row, $ju);
        let p$r_$j = subgroupBroadcast(pr$r, $ju);
        // Keys past the block's end are skipped, not weighted by 0: a cache
        // row may hold anything, NaN included.
        let live$j = k0 + $j < hi;
        let v_at$j = v_offset(row$j, hk) / 4u;
        var v$j_$c = vec4<f32>(0.0);
        let v_scale$j = cache_v_scale(row$j, hk);
        if (live$j && own_v$c) { v$j_$c = load4_v(v_at$j + chunk$c) * v_scale$j; }
        acc$r_$c += p$r_$j * v$j_$c;
    }

    let l_sum$r = subgroupAdd(l$r);
    let inv_l$r = select(0.0, 1.0 / l_sum$r, l_sum$r > 0.0);
    let o_at$r = split * decode.o_split_stride + o_offset(b, prow$r / g, head$r);
    if (row_ok$r && own_v$c) { store_o(o_at$r + 4u * chunk$c, acc$r_$c.x * inv_l$r); }
    if (row_ok$r && own_v$c) { store_o(o_at$r + 4u * chunk$c + 1u, acc$r_$c.y * inv_l$r); }
    if (row_ok$r && own_v$c) { store_o(o_at$r + 4u * chunk$c + 2u, acc$r_$c.z * inv_l$r); }
    if (row_ok$r && own_v$c) { store_o(o_at$r + 4u * chunk$c + 3u, acc$r_$c.w * inv_l$r); }
    let lse$r = select(empty_lse(), m$r + log(l_sum$r), l_sum$r > 0.0);
    let lse_at$r = split * decode.lse_split_stride + lse_offset(b, head$r, prow$r / g);
    if (row_ok$r && lane == 0u) { store_lse(lse_at$r, lse$r); }
    io_flush();
    check_loop_budget();
}

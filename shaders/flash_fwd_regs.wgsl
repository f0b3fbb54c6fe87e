// FlashAttention forward, register-tiled: the tiled kernel's loop (a block of
// BR query rows of one (batch, head) streams K/V blocks of BC keys through
// workgroup memory with an online softmax), but each invocation (g, t) owns a
// micro-tile in registers: rows g·RM.. of S for keys t + k·TC (RM × SC
// scores) and of O for vec4 columns t + a·TC (RM × ACC vec4s). Per vec4 of
// the head dim it reads RM q chunks and SC k chunks from workgroup memory for
// RM·SC dot products, per key RM p values and ACC v chunks for RM·ACC vec4
// FMAs. Row max and sum go through row_reduce (row_reduce.wgsl: subgroup
// shuffles or workgroup memory). With NBUF = 2 the next K/V tile loads into
// the other buffer while this one is used (one barrier fewer per step).
//
// The composer declares: overrides BR, BC, D, DV, D4 / DV4 (vec4 chunks of a
// q/k and of a v/o row), DM4 = max(D4, DV4), DP (padded q/k row stride in
// vec4s), TC, WG = (BR / RM)·TC, NBUF; constants RM, SC = ceil(BC/TC), ACC =
// ceil(DV4/TC); common.wgsl; the storage accessors, chunk_q/k/v
// (regs_load.wgsl), row_reduce; score_scale and out_scale (head_scale.wgsl);
// the keep tile (dropout.wgsl).

override FULL_SC: bool = (BC % TC) == 0u;
override FULL_ACC: bool = (DV4 % TC) == 0u;

var<workgroup> q_tile: array<vec4<f32>, BR * DP>;
// [buffer][key][chunk]
var<workgroup> k_tile: array<vec4<f32>, NBUF * BC * DP>;
var<workgroup> v_tile: array<vec4<f32>, NBUF * BC * DV4>;
var<workgroup> p_tile: array<f32, BR * BC>;

// Keys k0.. of kv head hk into K/V buffer `buf` (keys past the sequence as 0).
fn load_kv_tile(tid: u32, seq: Seq, hk: u32, k0: u32, buf: u32) {
    for (var e = tid; e < BC * DM4; e += WG) {
        let c = e / DM4;
        let x4 = e % DM4;
        let row = seq.k_row + k0 + c;
        let in_range = k0 + c < seq.keys;
        if (x4 < D4) {
            let at = row * params.kv_row_stride + hk * D + 4u * x4;
            k_tile[(buf * BC + c) * DP + x4] = chunk_k(at, chunk_len(D, x4, in_range));
        }
        if (x4 < DV4) {
            let at = row * params.v_row_stride + hk * DV + 4u * x4;
            v_tile[(buf * BC + c) * DV4 + x4] = chunk_v(at, chunk_len(DV, x4, in_range));
        }
    }
}

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let t = tid % TC;
    let row0 = (tid / TC) * RM;
    let seq = sequence(wg, BR, false);
    let q0 = seq.block * BR;
    let h = wg.y;
    let hk = h / params.group;
    let rows_here = min(BR, seq.rows - q0);
    let q_scale = score_scale(seq.b, h);

    for (var e = tid; e < BR * D4; e += WG) {
        let row = e / D4;
        let x4 = e % D4;
        let at = (seq.q_row + q0 + row) * params.q_row_stride + h * D + 4u * x4;
        q_tile[row * DP + x4] = chunk_q(at, chunk_len(D, x4, row < rows_here)) * q_scale;
    }

    // Skip, don't mask: only key blocks some row of this block may see are visited.
    let first_row = i32(params.q_start + q0);
    let last_row = first_row + i32(rows_here) - 1;
    let steps = tile_steps(seq, h, visible_keys(seq, first_row, last_row), BC, false);
    let slope = alibi_slope(seq, h);
    let mask_at = mask_base(seq, h);

    // One invocation of each row holds the sink's share of the sum.
    let start = softmax_start(h);
    var m_run = array<f32, RM>();
    var l_part = array<f32, RM>();
    for (var i = 0u; i < RM; i++) {
        m_run[i] = start.x;
        l_part[i] = select(0.0, start.y, t == 0u);
    }
    var acc = array<vec4<f32>, RM * ACC>();

    var next = tile_at(steps.x, false);
    if (NBUF == 2u && steps.x < steps.y) {
        load_kv_tile(tid, seq, hk, tile_index(next) * BC, 0u);
    }
    for (var step = steps.x; step < steps.y; step++) {
        let tile = next;
        next = tile_after(step, steps, false);
        let k0 = tile_index(tile) * BC;
        let buf = (step - steps.x) % NBUF;
        // The previous step's reads of P, and of the buffer loaded next, must finish.
        workgroupBarrier();
        fill_keep_tile(tid, seq.b, h, first_row, i32(params.k_start + k0));
        if (NBUF == 1u) {
            load_kv_tile(tid, seq, hk, k0, 0u);
            workgroupBarrier();
        } else {
            // With two buffers no barrier follows the loads: one for the
            // keep factors (a uniform branch: HAS_DROPOUT is an override).
            if (HAS_DROPOUT) {
                workgroupBarrier();
            }
            if (step + 1u < steps.y) {
                load_kv_tile(tid, seq, hk, tile_index(next) * BC, 1u - buf);
            }
        }

        // Initialized explicitly each block (Chromium's Tint zeroes a
        // loop-body `var` without initializer only once).
        var s = array<f32, RM * SC>();
        for (var x4 = 0u; x4 < D4; x4++) {
            var qv = array<vec4<f32>, RM>();
            for (var i = 0u; i < RM; i++) {
                qv[i] = q_tile[(row0 + i) * DP + x4];
            }
            for (var k = 0u; k < SC; k++) {
                let c = t + k * TC;
                if (FULL_SC || c < BC) {
                    let kv = k_tile[(buf * BC + c) * DP + x4];
                    for (var i = 0u; i < RM; i++) {
                        s[i * SC + k] = add_dot(s[i * SC + k], qv[i], kv);
                    }
                }
            }
        }

        // Mask only where the block crosses a boundary of the band or the sequence.
        let k_abs0 = i32(params.k_start + k0);
        let needs_mask = tile_partial(tile) || k0 + BC > seq.keys || rows_here < BR
            || !band_covers(seq.offset, first_row, last_row, k_abs0, k_abs0 + i32(BC) - 1);
        let blk = Block(seq.offset, slope, needs_mask, tile_partial(tile), mask_at);
        var m_new = array<f32, RM>();
        for (var i = 0u; i < RM; i++) {
            let row_abs = first_row + i32(row0 + i);
            var mx = NEG_BIG;
            for (var k = 0u; k < SC; k++) {
                let c = t + k * TC;
                let in_range = row0 + i < rows_here && k0 + c < seq.keys;
                // Invocations past the tile's last key hold no score at all.
                let sc = select(NEG_BIG, block_score(blk, s[i * SC + k], in_range, row_abs, k_abs0 + i32(c)),
                    FULL_SC || c < BC);
                s[i * SC + k] = sc;
                mx = max(mx, sc);
            }
            m_new[i] = max(m_run[i], mx);
        }
        row_reduce(tid, &m_new, true);

        for (var i = 0u; i < RM; i++) {
            let alpha = exp(m_run[i] - m_new[i]);
            m_run[i] = m_new[i];
            l_part[i] *= alpha;
            for (var k = 0u; k < SC; k++) {
                let c = t + k * TC;
                // Row sums use the unrounded, undropped P; P·V uses P in
                // storage precision, zero where dropout drops it.
                let p = select(0.0, exp(s[i * SC + k] - m_new[i]), s[i * SC + k] > NEG_BIG);
                l_part[i] += p;
                if (FULL_SC || c < BC) {
                    p_tile[(row0 + i) * BC + c] = round_storage(dropout_p(p, tile_kept(row0 + i, c)));
                }
            }
            for (var a = 0u; a < ACC; a++) {
                acc[i * ACC + a] *= alpha;
            }
        }
        workgroupBarrier();

        for (var c = 0u; c < BC; c++) {
            var p = array<f32, RM>();
            for (var i = 0u; i < RM; i++) {
                p[i] = p_tile[(row0 + i) * BC + c];
            }
            for (var a = 0u; a < ACC; a++) {
                let x4 = t + a * TC;
                if (FULL_ACC || x4 < DV4) {
                    let vv = v_tile[(buf * BC + c) * DV4 + x4];
                    for (var i = 0u; i < RM; i++) {
                        acc[i * ACC + a] += p[i] * vv;
                    }
                }
            }
        }
    }

    row_reduce(tid, &l_part, false);
    let o_scale = out_scale(seq.b, h) * dropout_scale();
    for (var i = 0u; i < RM; i++) {
        let r = row0 + i;
        if (r < rows_here) {
            let l = l_part[i];
            let inv_l = select(0.0, o_scale / l, l > 0.0);
            let at = (seq.q_row + q0 + r) * params.o_row_stride + h * DV;
            for (var a = 0u; a < ACC; a++) {
                let x4 = t + a * TC;
                let o = acc[i * ACC + a] * inv_l;
                for (var j = 0u; j < 4u; j++) {
                    if ((FULL_ACC || x4 < DV4) && 4u * x4 + j < DV) {
                        store_o(at + 4u * x4 + j, o[j]);
                    }
                }
            }
            if (t == 0u) {
                let lse = select(neg_inf(), m_run[i] + log(l), l > 0.0);
                store_lse(seq.lse + h * params.lse_head_stride + r + q0, lse);
            }
        }
    }
    io_flush();
    check_loop_budget();
}

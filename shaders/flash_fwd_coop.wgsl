// FlashAttention forward on cooperative matrices (tensor cores, Apple's
// simdgroup matrices): the two products S = Q·Kᵀ and O += P·V run as CN×CN
// cooperative-matrix tiles, one subgroup per output tile; the online softmax
// between them runs per element in workgroup memory, since a cooperative
// matrix allows no per-element access.
//
// Each workgroup owns BR query rows of one (batch, head) and streams K/V
// blocks of BC keys, FA2 loop order as flash_fwd.wgsl. Per key block:
//   1. K → kv_tile (element type CE), dropout's keep tile      barrier
//   2. S tiles (BR/CN × BC/CN) by subgroup: Q·Kᵀ → s_tile (f32) barrier
//   3. V → kv_tile; each row's invocations mask S, take the block max
//                                                             barrier
//   4. running max, P = exp(S - m) → p_tile (CE), O rows × alpha  barrier
//   5. O tiles (BR/CN × DVP/CN) by subgroup: O += P·V in o_tile (f32)
// O lives in workgroup memory so the softmax can rescale its rows.
//
// The composer declares: `enable` directives, the alias CE (f16 or f32) and
// the cooperative types CA, CB (inputs) and CC (f32 accumulator), const CN
// (8 or 16); overrides BR, BC, D, DV, DP / DVP (D, DV rounded up to CN), KP
// = max(DP, DVP), TC (invocations per row), WG = BR·TC; common.wgsl; the
// storage accessors; score_scale and out_scale (head_scale.wgsl); the keep
// tile (dropout.wgsl).
//
// Every cooperative operation sits in a loop whose trip count is the same
// for every invocation of a subgroup (the subgroup's own tiles): the
// subgroup-uniform control flow they need. naga's uniformity analysis
// counts `subgroup_id` as non-uniform, hence the composer's
// `diagnostic(off, derivative_uniformity)`.

var<workgroup> q_tile: array<CE, BR * DP>;
// K (rows of DP) in steps 1-2, then V (rows of DVP) in steps 3-5.
var<workgroup> kv_tile: array<CE, BC * KP>;
var<workgroup> s_tile: array<f32, BR * BC>;
var<workgroup> p_tile: array<CE, BR * BC>;
var<workgroup> o_tile: array<f32, BR * DVP>;
// One partial (row max, then row sum) per invocation.
var<workgroup> row_part: array<f32, WG>;

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) n_sg: u32,
) {
    let r = tid / TC;
    let t = tid % TC;
    let seq = sequence(wg, BR, false);
    let q0 = seq.block * BR;
    let h = wg.y;
    let hk = h / params.group;
    let rows_here = min(BR, seq.rows - q0);
    let q_scale = score_scale(seq.b, h);

    // Q in the cooperative element type, zero past the rows and the head dim
    // (the padding adds nothing to the dots).
    for (var e = tid; e < BR * DP; e += WG) {
        let row = e / DP;
        let x = e % DP;
        var qx = 0.0;
        if (row < rows_here && x < D) {
            qx = load_q((seq.q_row + q0 + row) * params.q_row_stride + h * D + x);
        }
        q_tile[e] = CE(qx);
    }
    for (var e = tid; e < BR * DVP; e += WG) {
        o_tile[e] = 0.0;
    }

    let first_row = i32(params.q_start + q0);
    let last_row = first_row + i32(rows_here) - 1;
    let steps = tile_steps(seq, h, visible_keys(seq, first_row, last_row), BC, false);
    let slope = alibi_slope(seq, h);
    let mask_at = mask_base(seq, h);

    let row_abs = first_row + i32(r);
    let row_valid = r < rows_here;
    let start = softmax_start(h);
    var m_run = start.x;
    var l_part = select(0.0, start.y, t == 0u);

    var next = tile_at(steps.x, false);
    for (var step = steps.x; step < steps.y; step++) {
        let tile = next;
        next = tile_after(step, steps, false);
        let partial = tile_partial(tile);
        let k0 = tile_index(tile) * BC;
        // The previous block's P·V must be done with kv_tile and o_tile.
        workgroupBarrier();
        load_kv(seq, hk, k0, tid, true);
        fill_keep_tile(tid, seq.b, h, first_row, i32(params.k_start + k0));
        workgroupBarrier();

        // S = Q·Kᵀ: A is Q's rows (row-major, stride DP); B is Kᵀ, i.e. K's
        // rows read column-major.
        for (var st = sg; st < (BR / CN) * (BC / CN); st += n_sg) {
            let i = st / (BC / CN);
            let j = st % (BC / CN);
            var acc = CC();
            for (var x = 0u; x < DP; x += CN) {
                let a = coopLoadT<CA>(&q_tile[i * CN * DP + x], DP);
                let b = coopLoad<CB>(&kv_tile[j * CN * DP + x], DP);
                acc = coopMultiplyAdd(a, b, acc);
            }
            coopStoreT(acc, &s_tile[i * CN * BC + j * CN], BC);
        }
        workgroupBarrier();

        // V replaces K (only the P·V below reads it); meanwhile each row's
        // invocations finish their scores in place.
        load_kv(seq, hk, k0, tid, false);
        let k_abs0 = i32(params.k_start + k0);
        let needs_mask = partial || k0 + BC > seq.keys || rows_here < BR
            || !band_covers(seq.offset, first_row, last_row, k_abs0, k_abs0 + i32(BC) - 1);
        var block_max = NEG_BIG;
        for (var c = t; c < BC; c += TC) {
            let key_abs = k_abs0 + i32(c);
            let sc = cap_score(s_tile[r * BC + c] * q_scale)
                - alibi_bias(slope, seq.offset, row_abs, key_abs);
            let in_range = row_valid && k0 + c < seq.keys;
            var ok = pair_allowed(needs_mask, in_range, seq.offset, row_abs, key_abs);
            if (partial) {
                ok = ok && block_allows(in_range, mask_at, row_abs, key_abs);
            }
            let s = select(NEG_BIG, sc, ok);
            s_tile[r * BC + c] = s;
            block_max = max(block_max, s);
        }
        row_part[tid] = block_max;
        workgroupBarrier();

        var m_new = m_run;
        for (var u = 0u; u < TC; u++) {
            m_new = max(m_new, row_part[r * TC + u]);
        }
        let alpha = exp(m_run - m_new);
        m_run = m_new;
        l_part *= alpha;
        for (var c = t; c < BC; c += TC) {
            let s = s_tile[r * BC + c];
            // Row sums use the unrounded, undropped P; P·V uses P in storage
            // precision, zero where dropout drops it.
            let p = select(0.0, exp(s - m_new), s > NEG_BIG);
            l_part += p;
            p_tile[r * BC + c] = CE(round_storage(dropout_p(p, tile_kept(r, c))));
        }
        for (var x = t; x < DVP; x += TC) {
            o_tile[r * DVP + x] *= alpha;
        }
        workgroupBarrier();

        // O += P·V: A is P (row-major, stride BC), B is V (row-major, stride DVP).
        for (var ot = sg; ot < (BR / CN) * (DVP / CN); ot += n_sg) {
            let i = ot / (DVP / CN);
            let j = ot % (DVP / CN);
            var acc = coopLoadT<CC>(&o_tile[i * CN * DVP + j * CN], DVP);
            for (var c = 0u; c < BC; c += CN) {
                let a = coopLoadT<CA>(&p_tile[i * CN * BC + c], BC);
                let b = coopLoadT<CB>(&kv_tile[c * DVP + j * CN], DVP);
                acc = coopMultiplyAdd(a, b, acc);
            }
            coopStoreT(acc, &o_tile[i * CN * DVP + j * CN], DVP);
        }
    }

    // Row sum = sum of the invocations' partials (row_part's last reads were
    // before the last P barrier); the barrier also ends the last P·V.
    row_part[tid] = l_part;
    workgroupBarrier();
    var l = 0.0;
    for (var u = 0u; u < TC; u++) {
        l += row_part[r * TC + u];
    }
    if (row_valid) {
        let row = q0 + r;
        let inv_l = select(0.0, out_scale(seq.b, h) * dropout_scale() / l, l > 0.0);
        for (var x = t; x < DV; x += TC) {
            store_o((seq.q_row + row) * params.o_row_stride + h * DV + x, o_tile[r * DVP + x] * inv_l);
        }
        if (t == 0u) {
            let lse = select(neg_inf(), m_run + log(l), l > 0.0);
            store_lse(seq.lse + h * params.lse_head_stride + row, lse);
        }
    }
    io_flush();
    check_loop_budget();
}

// Block k0's K rows (`keys`, rows of DP) or V rows (rows of DVP) into
// kv_tile in the cooperative element type, zero past the keys and the head
// dim (zero V rows keep masked keys' P·V exactly 0).
fn load_kv(seq: Seq, hk: u32, k0: u32, tid: u32, keys: bool) {
    let width = select(DVP, DP, keys);
    let dim = select(DV, D, keys);
    for (var e = tid; e < BC * width; e += WG) {
        let c = e / width;
        let x = e % width;
        var kx = 0.0;
        if (k0 + c < seq.keys && x < dim) {
            let row = seq.k_row + k0 + c;
            if (keys) {
                kx = load_k(row * params.kv_row_stride + hk * D + x);
            } else {
                kx = load_v(row * params.v_row_stride + hk * DV + x);
            }
        }
        kv_tile[e] = CE(kx);
    }
}

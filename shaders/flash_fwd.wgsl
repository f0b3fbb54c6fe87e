// FlashAttention forward, FA2 loop order: each workgroup owns BR query rows of
// one (batch, head) and streams K/V blocks of BC keys through workgroup memory,
// keeping a running max and sum per row (online softmax). S and P live only in
// workgroup memory; O and LSE are written once at the end.
//
// The composer declares: overrides BR, BC, D (q/k head dim), DV (v/o head
// dim), DM = max(D, DV), TC (invocations per row), WG = BR·TC, IS_MASKED, HAS_SOFTCAP;
// constants SC = ceil(BC/TC) scores and ACC = ceil(DV/TC) outputs per
// invocation (register arrays need constant sizes); common.wgsl; and
// load_q/k/v, store_o, store_lse, round_storage from a storage template;
// score_scale and out_scale (head_scale.wgsl); the keep tile (dropout.wgsl).

override FULL_SC: bool = (BC % TC) == 0u;
override FULL_ACC: bool = (DV % TC) == 0u;

var<workgroup> q_tile: array<f32, BR * D>;
var<workgroup> k_tile: array<f32, BC * D>;
var<workgroup> v_tile: array<f32, BC * DV>;
var<workgroup> p_tile: array<f32, BR * BC>;
// One partial (row max, then row sum) per invocation.
var<workgroup> row_part: array<f32, BR * TC>;

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let r = tid / TC;
    let t = tid % TC;
    let seq = sequence(wg, BR, false);
    let q0 = seq.block * BR;
    let h = wg.y;
    let hk = h / params.group;
    let rows_here = min(BR, seq.rows - q0);
    let q_scale = score_scale(seq.b, h);

    for (var e = tid; e < BR * D; e += WG) {
        let row = e / D;
        var x = 0.0;
        if (row < rows_here) {
            x = load_q((seq.q_row + q0 + row) * params.q_row_stride + h * D + e % D) * q_scale;
        }
        q_tile[e] = x;
    }

    // Skip, don't mask: only key blocks some row of this block may see are visited.
    let first_row = i32(params.q_start + q0);
    let last_row = first_row + i32(rows_here) - 1;
    let steps = tile_steps(seq, h, visible_keys(seq, first_row, last_row), BC, false);
    let slope = alibi_slope(seq, h);
    let mask_at = mask_base(seq, h);

    let row_abs = first_row + i32(r);
    let row_valid = r < rows_here;
    // One invocation of the row holds the sink's share of the sum.
    let start = softmax_start(h);
    var m_run = start.x;
    var l_part = select(0.0, start.y, t == 0u);
    var acc = array<f32, ACC>();

    var next = tile_at(steps.x, false);
    for (var step = steps.x; step < steps.y; step++) {
        let tile = next;
        next = tile_after(step, steps, false);
        let partial = tile_partial(tile);
        let k0 = tile_index(tile) * BC;
        // Previous block's P·V must finish before its tiles are overwritten.
        workgroupBarrier();
        // One loop over the wider head dim loads both tiles (DM = max(D, DV)).
        for (var e = tid; e < BC * DM; e += WG) {
            let c = e / DM;
            let x = e % DM;
            let row = seq.k_row + k0 + c;
            let in_range = k0 + c < seq.keys;
            if (D == DV || x < D) {
                var kx = 0.0;
                if (in_range) {
                    kx = load_k(row * params.kv_row_stride + hk * D + x);
                }
                // K is stored transposed ([x][key]) so the invocations of a
                // row, which own consecutive keys, read consecutive words.
                k_tile[x * BC + c] = kx;
            }
            if (D == DV || x < DV) {
                var vx = 0.0;
                if (in_range) {
                    vx = load_v(row * params.v_row_stride + hk * DV + x);
                }
                v_tile[c * DV + x] = vx;
            }
        }
        fill_keep_tile(tid, seq.b, h, first_row, i32(params.k_start + k0));
        workgroupBarrier();

        // Initialized explicitly each block: a loop-body `var` without
        // initializer should be re-zeroed per iteration, but Chromium's
        // WebGPU (Tint on SwiftShader) zeroes it only once, which summed
        // scores across blocks. Every function-scope `var` has an
        // initializer (a test checks).
        var s = array<f32, SC>();
        for (var x = 0u; x < D; x++) {
            let qx = q_tile[r * D + x];
            for (var k = 0u; k < SC; k++) {
                let c = t + k * TC;
                if (FULL_SC || c < BC) {
                    s[k] += qx * k_tile[x * BC + c];
                }
            }
        }

        // Mask only where the block crosses a boundary of the band or the sequence.
        let k_abs0 = i32(params.k_start + k0);
        let needs_mask = partial || k0 + BC > seq.keys || rows_here < BR
            || !band_covers(seq.offset, first_row, last_row, k_abs0, k_abs0 + i32(BC) - 1);
        let blk = Block(seq.offset, slope, needs_mask, partial, mask_at);
        var block_max = NEG_BIG;
        for (var k = 0u; k < SC; k++) {
            let c = t + k * TC;
            let in_range = row_valid && k0 + c < seq.keys;
            var sc = block_score(blk, s[k], in_range, row_abs, k_abs0 + i32(c));
            if (!FULL_SC && c >= BC) {
                // Lanes past the tile's last column hold no score at all.
                sc = NEG_BIG;
            }
            s[k] = sc;
            block_max = max(block_max, sc);
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
        for (var k = 0u; k < SC; k++) {
            let c = t + k * TC;
            // Row sums use the unrounded, undropped P; P·V uses P in storage
            // precision, zero where dropout drops it.
            let p = select(0.0, exp(s[k] - m_new), s[k] > NEG_BIG);
            l_part += p;
            if (FULL_SC || c < BC) {
                p_tile[r * BC + c] = round_storage(dropout_p(p, tile_kept(r, c)));
            }
        }
        for (var k = 0u; k < ACC; k++) {
            acc[k] *= alpha;
        }
        workgroupBarrier();

        for (var c = 0u; c < BC; c++) {
            let p = p_tile[r * BC + c];
            for (var k = 0u; k < ACC; k++) {
                let x = t + k * TC;
                if (FULL_ACC || x < DV) {
                    acc[k] += p * v_tile[c * DV + x];
                }
            }
        }
    }

    // Row sum = sum of the invocations' partials. The last block's reads of
    // row_part happened before its P barrier, so overwriting is safe.
    row_part[tid] = l_part;
    workgroupBarrier();
    var l = 0.0;
    for (var u = 0u; u < TC; u++) {
        l += row_part[r * TC + u];
    }
    if (row_valid) {
        let row = q0 + r;
        let inv_l = select(0.0, out_scale(seq.b, h) * dropout_scale() / l, l > 0.0);
        for (var k = 0u; k < ACC; k++) {
            let x = t + k * TC;
            if (FULL_ACC || x < DV) {
                store_o((seq.q_row + row) * params.o_row_stride + h * DV + x, acc[k] * inv_l);
            }
        }
        if (t == 0u) {
            let lse = select(neg_inf(), m_run + log(l), l > 0.0);
            store_lse(seq.lse + h * params.lse_head_stride + row, lse);
        }
    }
    io_flush();
    check_loop_budget();
}

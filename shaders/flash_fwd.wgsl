// FlashAttention forward, FA2 loop order: each workgroup owns BR query rows of
// one (batch, head) and streams K/V blocks of BC keys through workgroup memory,
// keeping a running max and sum per row (online softmax). S and P live only in
// workgroup memory; O and LSE are written once at the end.
//
// The composer declares: overrides BR, BC, D, TC (invocations per row),
// WG = BR·TC, IS_MASKED, HAS_SOFTCAP; constants SC = ceil(BC/TC) scores and
// ACC = ceil(D/TC) outputs per invocation (register arrays need constant
// sizes); common.wgsl; load_q/k/v, store_o, store_lse, round_storage from
// a storage template; score_scale and out_scale (head_scale.wgsl).

override FULL_SC: bool = (BC % TC) == 0u;
override FULL_ACC: bool = (D % TC) == 0u;

var<workgroup> q_tile: array<f32, BR * D>;
var<workgroup> k_tile: array<f32, BC * D>;
var<workgroup> v_tile: array<f32, BC * D>;
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
    let q0 = (wg.x + params.block_offset) * BR;
    let h = wg.y;
    let b = wg.z;
    let q_base = b * params.q_batch_stride + h * D;
    let kv_base = b * params.kv_batch_stride + (h / params.group) * D;
    let rows_here = min(BR, params.seqlen_q - q0);
    let q_scale = score_scale(b, h);

    for (var e = tid; e < BR * D; e += WG) {
        let row = e / D;
        var x = 0.0;
        if (row < rows_here) {
            x = load_q(q_base + (q0 + row) * params.q_row_stride + e % D) * q_scale;
        }
        q_tile[e] = x;
    }

    // Skip, don't mask: only key blocks some row of this block may see are visited.
    let first_row = i32(params.q_start + q0);
    let last_row = first_row + i32(rows_here) - 1;
    let keys = visible_keys(first_row, last_row);
    let key_blocks = block_range(keys, BC);

    let row_abs = first_row + i32(r);
    let row_valid = r < rows_here;
    var m_run = NEG_BIG;
    var l_part = 0.0;
    var acc = array<f32, ACC>();

    for (var kb = key_blocks.x; kb < key_blocks.y; kb++) {
        let k0 = kb * BC;
        // Previous block's P·V must finish before its tiles are overwritten.
        workgroupBarrier();
        for (var e = tid; e < BC * D; e += WG) {
            let key = k0 + e / D;
            var kx = 0.0;
            var vx = 0.0;
            if (key < params.seqlen_k) {
                let g = kv_base + key * params.kv_row_stride + e % D;
                kx = load_k(g);
                vx = load_v(g);
            }
            // K is stored transposed ([x][key]) so the invocations of a row,
            // which own consecutive keys, read consecutive words.
            k_tile[(e % D) * BC + e / D] = kx;
            v_tile[e] = vx;
        }
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
        let needs_mask = k0 + BC > params.seqlen_k || rows_here < BR
            || !band_covers(first_row, last_row, k_abs0, k_abs0 + i32(BC) - 1);
        var block_max = NEG_BIG;
        for (var k = 0u; k < SC; k++) {
            let c = t + k * TC;
            var sc = cap_score(s[k]);
            if (!FULL_SC && c >= BC) {
                // Lanes past the tile's last column hold no score at all.
                sc = NEG_BIG;
            } else {
                let in_range = row_valid && k0 + c < params.seqlen_k;
                let ok = pair_allowed(needs_mask, in_range, row_abs, k_abs0 + i32(c));
                sc = select(NEG_BIG, sc, ok);
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
            // Row sums use the unrounded P; P·V uses P in storage precision.
            let p = select(0.0, exp(s[k] - m_new), s[k] > NEG_BIG);
            l_part += p;
            if (FULL_SC || c < BC) {
                p_tile[r * BC + c] = round_storage(p);
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
                if (FULL_ACC || x < D) {
                    acc[k] += p * v_tile[c * D + x];
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
        let inv_l = select(0.0, out_scale(b, h) / l, l > 0.0);
        for (var k = 0u; k < ACC; k++) {
            let x = t + k * TC;
            if (FULL_ACC || x < D) {
                store_o(q_base + row * params.q_row_stride + x, acc[k] * inv_l);
            }
        }
        if (t == 0u) {
            let lse = select(neg_inf(), m_run + log(l), l > 0.0);
            store_lse(b * params.lse_batch_stride + h * params.lse_head_stride + row, lse);
        }
    }
    io_flush();
    check_loop_budget();
}

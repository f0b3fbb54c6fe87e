// FlashAttention forward, FA2 loop order: each workgroup owns BR query rows of
// one (batch, head) and streams K/V blocks of BC keys through workgroup memory,
// keeping a running max and sum per row (online softmax). S and P live only in
// workgroup memory; O and LSE are written once at the end.
//
// Invocation (g, t) owns rows g·RT .. g·RT + RT - 1 and, of each, the keys and
// output columns t + k·TC: every K or V word it reads from workgroup memory
// feeds RT rows (register tiling), so loads per multiply-add fall by up to RT.
//
// The composer prepends: BR, BC, D, TC (invocations per row), RT (rows per
// invocation), WG = BR/RT·TC, SC = ceil(BC/TC) scores and ACC = ceil(D/TC)
// outputs per row and invocation, IS_MASKED, HAS_SOFTCAP; common.wgsl; and
// load_q/k/v, store_o, store_lse, round_storage from a storage template.

const FULL_SC: bool = (BC % TC) == 0u;
const FULL_ACC: bool = (D % TC) == 0u;

var<workgroup> q_tile: array<f32, BR * D>;
// K transposed ([x][key]): the invocations of a row own consecutive keys.
var<workgroup> k_tile: array<f32, BC * D>;
var<workgroup> v_tile: array<f32, BC * D>;
var<workgroup> p_tile: array<f32, BR * BC>;
// One partial (row max, then row sum) per row and lane.
var<workgroup> row_part: array<f32, BR * TC>;

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let r0 = (tid / TC) * RT;
    let t = tid % TC;
    let q0 = (wg.x + params.block_offset) * BR;
    let h = wg.y;
    let b = wg.z;
    let q_base = b * params.q_batch_stride + h * D;
    let kv_base = b * params.kv_batch_stride + (h / params.group) * D;
    let rows_here = min(BR, params.seqlen_q - q0);

    for (var e = tid; e < BR * D; e += WG) {
        let row = e / D;
        var x = 0.0;
        if (row < rows_here) {
            x = load_q(q_base + (q0 + row) * params.q_row_stride + e % D) * params.scale;
        }
        q_tile[e] = x;
    }

    // Skip, don't mask: only key blocks some row of this block may see are visited.
    let first_row = i32(params.q_start + q0);
    let last_row = first_row + i32(rows_here) - 1;
    let keys = visible_keys(first_row, last_row);
    let kb_begin = u32(keys.x) / BC;
    let kb_end = select(kb_begin, (u32(keys.y) + BC - 1u) / BC, keys.y > keys.x);

    var m_run: array<f32, RT>;
    var l_part: array<f32, RT>;
    var acc: array<f32, RT * ACC>;
    for (var i = 0u; i < RT; i++) {
        m_run[i] = NEG_BIG;
        l_part[i] = 0.0;
    }
    for (var k = 0u; k < RT * ACC; k++) {
        acc[k] = 0.0;
    }

    for (var kb = kb_begin; kb < kb_end; kb++) {
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
            k_tile[(e % D) * BC + e / D] = kx;
            v_tile[e] = vx;
        }
        workgroupBarrier();

        // Zeroed explicitly each block: a loop-body `var` without initializer
        // should be re-zeroed per iteration, but Chromium's WebGPU (Tint on
        // SwiftShader) zeroes it only once, which summed scores across blocks.
        var s: array<f32, RT * SC>;
        for (var k = 0u; k < RT * SC; k++) {
            s[k] = 0.0;
        }
        for (var x = 0u; x < D; x++) {
            var qx: array<f32, RT>;
            for (var i = 0u; i < RT; i++) {
                qx[i] = q_tile[(r0 + i) * D + x];
            }
            for (var k = 0u; k < SC; k++) {
                let c = t + k * TC;
                if (FULL_SC || c < BC) {
                    let kx = k_tile[x * BC + c];
                    for (var i = 0u; i < RT; i++) {
                        s[i * SC + k] += qx[i] * kx;
                    }
                }
            }
        }

        // Mask only where the block crosses a boundary of the band or the sequence.
        let k_abs0 = i32(params.k_start + k0);
        let needs_mask = k0 + BC > params.seqlen_k || rows_here < BR
            || !band_covers(first_row, last_row, k_abs0, k_abs0 + i32(BC) - 1);
        for (var i = 0u; i < RT; i++) {
            var block_max = NEG_BIG;
            for (var k = 0u; k < SC; k++) {
                let c = t + k * TC;
                var sc = cap_score(s[i * SC + k]);
                if (!FULL_SC && c >= BC) {
                    // Lanes past the tile's last column hold no score at all.
                    sc = NEG_BIG;
                } else if (needs_mask) {
                    var ok = r0 + i < rows_here && k0 + c < params.seqlen_k;
                    if (IS_MASKED) {
                        ok = ok && band_allows(first_row + i32(r0 + i), k_abs0 + i32(c));
                    }
                    sc = select(NEG_BIG, sc, ok);
                }
                s[i * SC + k] = sc;
                block_max = max(block_max, sc);
            }
            row_part[(r0 + i) * TC + t] = block_max;
        }
        workgroupBarrier();

        for (var i = 0u; i < RT; i++) {
            var m_new = m_run[i];
            for (var u = 0u; u < TC; u++) {
                m_new = max(m_new, row_part[(r0 + i) * TC + u]);
            }
            let alpha = exp(m_run[i] - m_new);
            m_run[i] = m_new;
            l_part[i] *= alpha;
            for (var k = 0u; k < SC; k++) {
                let c = t + k * TC;
                // Row sums use the unrounded P; P·V uses P in storage precision.
                let sc = s[i * SC + k];
                let p = select(0.0, exp(sc - m_new), sc > NEG_BIG);
                l_part[i] += p;
                if (FULL_SC || c < BC) {
                    p_tile[(r0 + i) * BC + c] = round_storage(p);
                }
            }
            for (var k = 0u; k < ACC; k++) {
                acc[i * ACC + k] *= alpha;
            }
        }
        workgroupBarrier();

        for (var c = 0u; c < BC; c++) {
            var p: array<f32, RT>;
            for (var i = 0u; i < RT; i++) {
                p[i] = p_tile[(r0 + i) * BC + c];
            }
            for (var k = 0u; k < ACC; k++) {
                let x = t + k * TC;
                if (FULL_ACC || x < D) {
                    let vx = v_tile[c * D + x];
                    for (var i = 0u; i < RT; i++) {
                        acc[i * ACC + k] += p[i] * vx;
                    }
                }
            }
        }
    }

    // Row sum = sum of the lanes' partials. The last block's reads of
    // row_part happened before its P barrier, so overwriting is safe.
    for (var i = 0u; i < RT; i++) {
        row_part[(r0 + i) * TC + t] = l_part[i];
    }
    workgroupBarrier();
    for (var i = 0u; i < RT; i++) {
        let row = r0 + i;
        var l = 0.0;
        for (var u = 0u; u < TC; u++) {
            l += row_part[row * TC + u];
        }
        if (row < rows_here) {
            let inv_l = select(0.0, 1.0 / l, l > 0.0);
            for (var k = 0u; k < ACC; k++) {
                let x = t + k * TC;
                if (FULL_ACC || x < D) {
                    store_o(q_base + (q0 + row) * params.q_row_stride + x, acc[i * ACC + k] * inv_l);
                }
            }
            if (t == 0u) {
                let lse = select(neg_inf(), m_run[i] + log(l), l > 0.0);
                store_lse(b * params.lse_batch_stride + h * params.lse_head_stride + q0 + row, lse);
            }
        }
    }
    io_flush();
}

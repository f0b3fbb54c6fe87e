// Split-KV decoding (FlashDecoding): one workgroup per (split × row block,
// kv head, sequence). Its rows are packed rows of the kv head's query group:
// packed row p is token p / group of query head kv_head · group + p % group,
// so every K/V row the workgroup reads serves the whole group. Invocation t
// owns key t of each block of WG keys (its scores for every row) and output
// columns t, t + WG, … of every row (P·V; o and v have head dim DV). K/V rows come from the cache
// through the page table, each read once. The workgroup covers the keys of
// its split that its rows may see (skip, don't mask) and writes, with
// splits, its rows' normalized partial o and LSE (NEG_BIG when it saw no
// key) for the merge; without, the final o and lse. ALiBi's slope and the
// sink are each packed row's own query head's; split 0's rows start from
// the sink.
//
// The composer declares overrides WG, D, DV, IS_PARTIAL, IS_MASKED,
// HAS_SOFTCAP, HAS_ALIBI, HAS_SINKS; constants RB (packed rows per workgroup) and ACC =
// ceil(DV / WG) (register arrays need constant sizes); common.wgsl;
// decode_common.wgsl; load_q, load_k, load_v (the cache, before the
// scales cache_k_scale, cache_v_scale of a quantized one), store_o,
// store_lse, round_storage.

override FULL_ACC: bool = (DV % WG) == 0u;

var<workgroup> q_tile: array<f32, RB * D>;
var<workgroup> p_tile: array<f32, RB * WG>;
var<workgroup> row_alpha: array<f32, RB>;
var<workgroup> row_m: array<f32, RB>;
var<workgroup> row_l: array<f32, RB>;
var<workgroup> key_rows: array<u32, WG>;

// The LSE of a row that saw no key: the merge's sentinel, or docs/semantics.md's -inf.
fn empty_lse() -> f32 {
    if (IS_PARTIAL) {
        return NEG_BIG;
    }
    return neg_inf();
}

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let split = wg.x / decode.row_blocks;
    let p0 = (wg.x % decode.row_blocks) * RB;
    let hk = wg.y;
    let b = wg.z;
    let g = params.group;
    let rows_here = min(RB, decode.group_rows - p0);
    let keys_b = seqlen_k(b);
    // Row i of sequence b sits at absolute position i + keys_b − seqlen_q.
    let offset = i32(keys_b) - i32(params.seqlen_q);

    for (var e = tid; e < RB * D; e += WG) {
        let r = e / D;
        var x = 0.0;
        if (r < rows_here) {
            let p = p0 + r;
            x = load_q(q_offset(b, p / g, hk * g + p % g) + e % D) * params.scale;
        }
        q_tile[e] = x;
    }

    // This split's keys, narrowed to those some row of the block may see.
    let split_lo = min(split * decode.keys_per_split, keys_b);
    var lo = i32(split_lo);
    var hi = i32(min(split_lo + decode.keys_per_split, keys_b));
    if (IS_MASKED) {
        let first = i32(p0 / g) + offset;
        let last = i32((p0 + rows_here - 1u) / g) + offset;
        lo = max(lo, first - params.window_left);
        hi = min(hi, last + params.window_right + 1);
    }

    // Each row's ALiBi slope, read once (0 without ALiBi).
    var slopes = array<f32, RB>();
    for (var r = 0u; r < RB; r++) {
        slopes[r] = alibi_slope_at(b, hk * g + (p0 + r) % g);
    }
    // Row tid's running max and sum (tid < RB).
    let start = decode_start(split, hk * g + (p0 + tid) % g);
    var m_run = start.x;
    var l_run = start.y;
    var acc = array<f32, RB * ACC>();
    for (var k0 = lo; k0 < hi; k0 += i32(WG)) {
        // The previous block's P·V must finish before p_tile is rewritten.
        workgroupBarrier();
        let j = k0 + i32(tid);
        // Initialized per block: Tint on SwiftShader zeroes a loop-body var
        // only once (see flash_fwd.wgsl).
        var s = array<f32, RB>();
        if (j < hi) {
            let row = cache_row(b, u32(j));
            key_rows[tid] = row;
            let base = row * params.kv_row_stride + hk * D;
            let k_scale = cache_k_scale(row, hk);
            for (var x = 0u; x < D; x++) {
                let kx = load_k(base + x) * k_scale;
                for (var r = 0u; r < RB; r++) {
                    s[r] += q_tile[r * D + x] * kx;
                }
            }
        }
        for (var r = 0u; r < RB; r++) {
            let row_abs = i32((p0 + r) / g) + offset;
            let ok = j < hi && r < rows_here && (!IS_MASKED || band_allows(0, row_abs, j));
            let bias = alibi_bias(slopes[r], 0, row_abs, j);
            p_tile[r * WG + tid] = select(NEG_BIG, cap_score(s[r]) - bias, ok);
        }
        workgroupBarrier();

        if (tid < RB) {
            var m_new = m_run;
            for (var c = 0u; c < WG; c++) {
                m_new = max(m_new, p_tile[tid * WG + c]);
            }
            let alpha = exp(m_run - m_new);
            l_run *= alpha;
            for (var c = 0u; c < WG; c++) {
                let sc = p_tile[tid * WG + c];
                // Row sums use the unrounded P; P·V uses P in storage precision.
                let p = select(0.0, exp(sc - m_new), sc > NEG_BIG);
                l_run += p;
                p_tile[tid * WG + c] = round_storage(p);
            }
            m_run = m_new;
            row_alpha[tid] = alpha;
        }
        workgroupBarrier();

        for (var r = 0u; r < RB; r++) {
            for (var k = 0u; k < ACC; k++) {
                acc[r * ACC + k] *= row_alpha[r];
            }
        }
        let keys = u32(min(i32(WG), hi - k0));
        for (var c = 0u; c < keys; c++) {
            let base = v_offset(key_rows[c], hk);
            let v_scale = cache_v_scale(key_rows[c], hk);
            for (var k = 0u; k < ACC; k++) {
                let x = tid + k * WG;
                if (FULL_ACC || x < DV) {
                    let vx = load_v(base + x) * v_scale;
                    for (var r = 0u; r < RB; r++) {
                        acc[r * ACC + k] += p_tile[r * WG + c] * vx;
                    }
                }
            }
        }
    }

    if (tid < RB) {
        row_m[tid] = m_run;
        row_l[tid] = l_run;
    }
    workgroupBarrier();
    for (var r = 0u; r < rows_here; r++) {
        let p = p0 + r;
        let i = p / g;
        let h = hk * g + p % g;
        let l = row_l[r];
        let inv_l = select(0.0, 1.0 / l, l > 0.0);
        let o_at = split * decode.o_split_stride + o_offset(b, i, h);
        for (var k = 0u; k < ACC; k++) {
            let x = tid + k * WG;
            if (FULL_ACC || x < DV) {
                store_o(o_at + x, acc[r * ACC + k] * inv_l);
            }
        }
        if (tid == 0u) {
            let lse = select(empty_lse(), row_m[r] + log(l), l > 0.0);
            store_lse(split * decode.lse_split_stride + lse_offset(b, h, i), lse);
        }
    }
    io_flush();
    check_loop_budget();
}

// Merges the splits of the split-KV decode: per row (b, i, h), the total LSE
// of the splits' LSEs, then o = Σ_s exp(lse_s − lse) · o_s in f32. A split
// that saw no key wrote NEG_BIG and weighs 0; a row no split saw gets o = 0
// and lse = -inf. One workgroup per row; invocations own output columns.
//
// The composer declares WG, D, MAX_SPLITS; common.wgsl; decode_common.wgsl;
// load_o_part, load_lse_part (f32); store_o (storage precision), store_lse.

var<workgroup> split_lse: array<f32, MAX_SPLITS>;

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let row = wg.y * decode.groups_x + wg.x;
    let rows = params.batch * params.seqlen_q * params.heads_q;
    // o's rows are (b, i, h) in order.
    let h = row % params.heads_q;
    let i = (row / params.heads_q) % params.seqlen_q;
    let b = row / (params.heads_q * params.seqlen_q);
    let lse_at = lse_offset(b, h, i);
    if (row < rows) {
        for (var s = tid; s < decode.num_splits; s += WG) {
            split_lse[s] = load_lse_part(s * decode.lse_split_stride + lse_at);
        }
    }
    workgroupBarrier();
    if (row < rows) {
        var m = NEG_BIG;
        for (var s = 0u; s < decode.num_splits; s++) {
            m = max(m, split_lse[s]);
        }
        var sum = 0.0;
        for (var s = 0u; s < decode.num_splits; s++) {
            sum += exp(split_lse[s] - m);
        }
        let seen = m > NEG_BIG;
        let total = m + log(sum);
        for (var x = tid; x < D; x += WG) {
            var acc = 0.0;
            for (var s = 0u; s < decode.num_splits; s++) {
                let w = select(0.0, exp(split_lse[s] - total), seen);
                acc += w * load_o_part(s * decode.o_split_stride + row * D + x);
            }
            store_o(row * D + x, acc);
        }
        if (tid == 0u) {
            store_lse(lse_at, select(neg_inf(), total, seen));
        }
    }
    io_flush();
    check_loop_budget();
}

// Appends k_new (batch, seqlen_new, heads_kv, D) and v_new (..., DV) into
// the cache in place: element x of row (b, t) goes to token seqlen_k(b) -
// seqlen_new + t of sequence b. One invocation per element of the wider
// row; the host checked every row is in range and written by one sequence
// only. A latent cache appends k_new alone (v_new_len 0): its V is K's.
//
// The composer declares WG, D, DV; common.wgsl; decode_common.wgsl;
// load_k_new, load_v_new; store_k, store_v (the cache).

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let e = wrapped(wg, tid);
    let k_len = params.kv_row_stride;
    let v_len = decode.v_new_len;
    let row_len = max(k_len, v_len);
    if (e < params.batch * decode.seqlen_new * row_len) {
        let bt = e / row_len;
        let x = e % row_len;
        let b = bt / decode.seqlen_new;
        let t = seqlen_k(b) - decode.seqlen_new + bt % decode.seqlen_new;
        let row = cache_row(b, t);
        if (x < k_len) {
            store_k(row * k_len + x, load_k_new(bt * k_len + x));
        }
        if (x < v_len) {
            store_v(row * params.v_row_stride + x, load_v_new(bt * v_len + x));
        }
    }
    io_flush();
    check_loop_budget();
}

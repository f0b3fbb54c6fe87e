// Appends k_new and v_new (batch, seqlen_new, heads_kv, D) into the cache in
// place: element e of row (b, t) goes to token seqlen_k(b) - seqlen_new + t of
// sequence b. One invocation per element; the host checked every row is in
// range and written by one sequence only.
//
// The composer declares WG, D; common.wgsl; decode_common.wgsl; load_k_new,
// load_v_new; store_k, store_v (the cache).

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let e = wrapped(wg, tid);
    let row_len = params.kv_row_stride;
    if (e < params.batch * decode.seqlen_new * row_len) {
        let bt = e / row_len;
        let b = bt / decode.seqlen_new;
        let t = seqlen_k(b) - decode.seqlen_new + bt % decode.seqlen_new;
        let at = cache_row(b, t) * row_len + e % row_len;
        store_k(at, load_k_new(e));
        store_v(at, load_v_new(e));
    }
    io_flush();
    check_loop_budget();
}

// dQ: one workgroup per block of B query rows of one head, looping over the
// key blocks the rows can see (FA2's parallel-over-Q structure). Recomputing
// P and dS here instead of accumulating dQ with float atomics in the dK/dV
// pass costs one more S and dP per tile but keeps dQ deterministic.

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let r = tid / TC;
    let t = tid % TC;
    let seq = sequence(wg, B, false);
    let q0 = seq.block * B;
    let h = wg.y;
    let hk = h / params.group;
    let rows_here = min(B, seq.rows - q0);
    let row_abs0 = i32(params.q_start + q0);
    load_row_tiles(tid, seq, h, q0, rows_here);

    let keys = visible_keys(seq, row_abs0, row_abs0 + i32(rows_here) - 1);
    let steps = tile_steps(seq, h, keys, B, false);
    let slope = alibi_slope(seq, h);
    let mask_at = mask_base(seq, h);

    var dq = array<f32, ACC_K>();
    var next = tile_at(steps.x, false);
    for (var step = steps.x; step < steps.y; step++) {
        let blk = next;
        next = tile_after(step, steps, false);
        let k0 = tile_index(blk) * B;
        let keys_here = min(B, seq.keys - k0);
        workgroupBarrier();
        load_key_tiles(tid, seq, hk, k0, keys_here);
        fill_keep_tile(tid, seq.b, h, row_abs0, i32(params.k_start + k0));
        workgroupBarrier();
        let tile = Tile(seq.offset, row_abs0, rows_here, i32(params.k_start + k0), keys_here,
            slope, tile_partial(blk), mask_at);
        tile_p_ds(r, t, tile);
        workgroupBarrier();
        for (var c = 0u; c < B; c++) {
            let ds = ds_tile[r * B + c];
            for (var k = 0u; k < ACC_K; k++) {
                let x = t + k * TC;
                if (FULL_K || x < D) {
                    dq[k] += ds * k_tile[c * D + x];
                }
            }
        }
    }
    if (r < rows_here) {
        let row = seq.q_row + q0 + r;
        for (var k = 0u; k < ACC_K; k++) {
            let x = t + k * TC;
            if (FULL_K || x < D) {
                store_dq(row * params.q_row_stride + h * D + x, dq[k] * params.scale);
            }
        }
    }
    io_flush();
    check_loop_budget();
}

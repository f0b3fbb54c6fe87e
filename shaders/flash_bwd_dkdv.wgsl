// dK and dV: one workgroup per block of B keys of one kv head. It loops over
// every query head of its GQA group and every query block that can see its
// keys, in a fixed order, accumulating in registers: no atomics, so results
// are bit-for-bit deterministic and the group sum needs no second pass.

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let r = tid / TC;
    let t = tid % TC;
    let seq = sequence(wg, B, true);
    let k0 = seq.block * B;
    let hk = wg.y;
    let keys_here = min(B, seq.keys - k0);
    let key_abs0 = i32(params.k_start + k0);
    load_key_tiles(tid, seq, hk, k0, keys_here);

    // Skip, don't mask: only query blocks that see one of these keys.
    let rows = visible_rows(seq, key_abs0, key_abs0 + i32(keys_here) - 1);

    var dk = array<f32, ACC_K>();
    var dv = array<f32, ACC_V>();
    for (var g = 0u; g < params.group; g++) {
        let h = hk * params.group + g;
        let steps = tile_steps(seq, h, rows, B, true);
        var next = tile_at(steps.x, true);
        for (var step = steps.x; step < steps.y; step++) {
            let blk = next;
            next = tile_after(step, steps, true);
            let q0 = tile_index(blk) * B;
            let rows_here = min(B, seq.rows - q0);
            // The previous tile's readers must finish before it is overwritten.
            workgroupBarrier();
            load_row_tiles(tid, seq, h, q0, rows_here);
            fill_keep_tile(tid, seq.b, h, i32(params.q_start + q0), key_abs0);
            workgroupBarrier();
            let tile = Tile(seq.offset, i32(params.q_start + q0), rows_here, key_abs0, keys_here,
                alibi_slope(seq, h), tile_partial(blk), mask_base(seq, h));
            tile_p_ds(r, t, tile);
            workgroupBarrier();
            // Now invocation (r, t) owns key r: dV_r += Pᵀ dO, dK_r += dSᵀ (Q·scale).
            for (var i = 0u; i < B; i++) {
                let p = p_tile[i * B + r];
                let ds = ds_tile[i * B + r];
                for (var k = 0u; k < ACC_V; k++) {
                    let x = t + k * TC;
                    if (FULL_V || x < DV) {
                        dv[k] += p * do_tile[i * DV + x];
                    }
                }
                for (var k = 0u; k < ACC_K; k++) {
                    let x = t + k * TC;
                    if (FULL_K || x < D) {
                        dk[k] += ds * q_tile[i * D + x];
                    }
                }
            }
        }
    }
    if (r < keys_here) {
        let row = seq.k_row + k0 + r;
        for (var k = 0u; k < ACC_K; k++) {
            let x = t + k * TC;
            if (FULL_K || x < D) {
                store_dk(row * params.kv_row_stride + hk * D + x, dk[k]);
            }
        }
        for (var k = 0u; k < ACC_V; k++) {
            let x = t + k * TC;
            if (FULL_V || x < DV) {
                store_dv(row * params.v_row_stride + hk * DV + x, dv[k] * dropout_scale());
            }
        }
    }
    io_flush();
    check_loop_budget();
}

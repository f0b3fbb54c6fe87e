// D_i = rowsum(dO_i · O_i): one invocation per (batch, row, head), written in
// LSE's (batch, head, row) layout. The dot product is taken with O as stored,
// so low-precision O is used exactly as the caller holds it.

@compute @workgroup_size(64)
fn main(
    @builtin(global_invocation_id) gid: vec3<u32>,
    @builtin(num_workgroups) groups: vec3<u32>,
) {
    let row = gid.x + gid.y * groups.x * 64u;
    let rows = params.batch * params.seqlen_q * params.heads_q;
    if (row >= rows) {
        return;
    }
    let h = row % params.heads_q;
    let i = (row / params.heads_q) % params.seqlen_q;
    let b = row / (params.heads_q * params.seqlen_q);
    let base = (b * params.seqlen_q + i) * params.o_row_stride + h * DV;
    var acc = 0.0;
    for (var x = 0u; x < DV; x++) {
        acc += load_do(base + x) * load_o(base + x);
    }
    store_dvec(b * params.lse_batch_stride + h * params.lse_head_stride + i, acc);
    io_flush();
    check_loop_budget();
}

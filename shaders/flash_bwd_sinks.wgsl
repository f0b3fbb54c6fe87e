// The sinks' gradients, dsink_h = −Σ_{b,i} exp(sink_h − lse_{b,h,i}) · D_{b,h,i},
// deterministic and atomic-free in two passes: `partials` has workgroup
// (c, h) sum rows c·SINK_CHUNK.. of query head h in a fixed tree; `reduce`
// then adds each head's partials in order. Rows run over (batch, row) of
// lse's (batch, heads_q, seqlen_q) layout (a packed batch is a batch of one).
// The composer emits the section of the pass.
//
// Prelude: overrides IS_MASKED, HAS_SOFTCAP, HAS_SINKS (true); constant
// SINK_ROWS (rows per invocation); load_lse, load_dvec (f32); the partials'
// store_part / load_part and store_dsinks.
// @shared
const SINK_WG: u32 = 64u;
const SINK_CHUNK: u32 = SINK_WG * SINK_ROWS;

// Rows of one head, and how many chunks of SINK_CHUNK cover them.
fn sink_rows() -> u32 {
    return params.batch * params.seqlen_q;
}

fn sink_chunks() -> u32 {
    return (sink_rows() + SINK_CHUNK - 1u) / SINK_CHUNK;
}
// @partials
var<workgroup> part: array<f32, SINK_WG>;

@compute @workgroup_size(SINK_WG)
fn main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let c = wg.x;
    let h = wg.y;
    let sink = sink_logit(h);
    var acc = 0.0;
    for (var k = 0u; k < SINK_ROWS; k++) {
        let row = c * SINK_CHUNK + k * SINK_WG + tid;
        if (row < sink_rows()) {
            let b = row / params.seqlen_q;
            let g = b * params.lse_batch_stride + h * params.lse_head_stride + row % params.seqlen_q;
            acc += exp(sink - load_lse(g)) * load_dvec(g);
        }
    }
    part[tid] = acc;
    workgroupBarrier();
    for (var width = SINK_WG / 2u; width > 0u; width /= 2u) {
        if (tid < width) {
            part[tid] += part[tid + width];
        }
        workgroupBarrier();
    }
    if (tid == 0u) {
        store_part(h * sink_chunks() + c, -part[0]);
    }
    io_flush();
    check_loop_budget();
}
// @reduce
@compute @workgroup_size(SINK_WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let h = gid.x;
    if (h < params.heads_q) {
        let chunks = sink_chunks();
        var acc = 0.0;
        for (var c = 0u; c < chunks; c++) {
            acc += load_part(h * chunks + c);
        }
        store_dsinks(h, acc);
    }
    io_flush();
    check_loop_budget();
}

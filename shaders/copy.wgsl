// Copies `src` into `dst`: four f32 at a time (`@copy`), or rows (`@rows`).
// The vec4 copy does nothing but the copy, so its time gives the adapter's
// storage bandwidth (bytes read plus bytes written per second), the
// yardstick for kernels that stream memory, such as decoding against a
// long KV cache. The row copy keeps the first `dst_row` elements of each
// `src_row`-long row (the FP8 forward's output, its padded rows trimmed).
// Either way one invocation per destination item, the grid wrapped from x
// into y at the device's limit.
//
// The composer declares WG; common.wgsl (access counters, loop guard);
// load4_src, store4_dst (the copy) or load_src, store_dst (the rows).
// @common
struct CopyParams {
    // Items to write: vec4s (the copy) or elements (the rows).
    len: u32,
    // Workgroups per row of the grid.
    groups_x: u32,
    // Elements of a source row and of a destination row (the rows only).
    src_row: u32,
    dst_row: u32,
}

@group(0) @binding(23) var<uniform> copy_params: CopyParams;

fn copy_item(tid: u32, wg: vec3<u32>) -> u32 {
    return (wg.y * copy_params.groups_x + wg.x) * WG + tid;
}
// @copy
@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let i = copy_item(tid, wg);
    if (i < copy_params.len) {
        store4_dst(i, load4_src(i));
    }
    io_flush();
    check_loop_budget();
}
// @rows
@compute @workgroup_size(WG)
fn rows_main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let i = copy_item(tid, wg);
    if (i < copy_params.len) {
        let row = i / copy_params.dst_row;
        let col = i - row * copy_params.dst_row;
        store_dst(i, load_src(row * copy_params.src_row + col));
    }
    io_flush();
    check_loop_budget();
}

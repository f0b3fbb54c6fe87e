// Copies `src` into `dst`, four f32 at a time: one vec4 per invocation, the
// grid wrapped from x into y at the device's limit. The kernel does nothing
// but the copy, so its time gives the adapter's storage bandwidth (bytes
// read plus bytes written per second), the yardstick for kernels that
// stream memory, such as decoding against a long KV cache.
//
// The composer declares WG; common.wgsl (access counters, loop guard);
// load4_src, store4_dst (f32, vec4 accesses).

struct CopyParams {
    // vec4s to copy.
    len4: u32,
    // Workgroups per row of the grid.
    groups_x: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(23) var<uniform> copy_params: CopyParams;

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let i = (wg.y * copy_params.groups_x + wg.x) * WG + tid;
    if (i < copy_params.len4) {
        store4_dst(i, load4_src(i));
    }
    io_flush();
    check_loop_budget();
}

// Measures the adapter's loop limit at engine creation. One invocation runs
// a loop whose bound the compiler cannot see (word 0, set by the host far
// above any known limit) and writes how many iterations it completed into
// word 1. llvmpipe (lavapipe, Mesa's GL on a CPU) ends every loop of an
// invocation once it has counted 65535 iterations in total, so it writes the
// limit; other adapters complete the loop and write the bound itself.

@group(0) @binding(0) var<storage, read_write> probe: array<u32, 2>;

@compute @workgroup_size(1)
fn main() {
    let bound = probe[0];
    var done = 0u;
    loop {
        if (done >= bound) {
            break;
        }
        done += 1u;
    }
    probe[1] = done;
}

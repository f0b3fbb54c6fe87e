// Storage-access accounting. Every load_*/store_* accessor calls io_read()
// or io_write() (load4_*/store4_*: io_read4()/io_write4()); every entry point ends with
// io_flush(). The composer emits the `@off` section (empty functions,
// compiled away) unless the engine counts accesses, then `@on`:
// per-invocation private counters, added atomically to a two-word buffer
// once per invocation so counting barely perturbs the kernel.
// @off
fn io_read() {}
fn io_read4() {}
fn io_write() {}
fn io_write4() {}
fn io_flush() {}
// @on
@group(0) @binding(15) var<storage, read_write> io_counts: array<atomic<u32>, 2>;
var<private> io_reads: u32;
var<private> io_writes: u32;
fn io_read() {
    io_reads += 1u;
}
fn io_read4() {
    io_reads += 4u;
}
fn io_write() {
    io_writes += 1u;
}
fn io_write4() {
    io_writes += 4u;
}
fn io_flush() {
    if (io_reads > 0u) {
        atomicAdd(&io_counts[0], io_reads);
    }
    if (io_writes > 0u) {
        atomicAdd(&io_counts[1], io_writes);
    }
}

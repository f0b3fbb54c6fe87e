// The side buffer: the small per-call tables some variants read — a packed
// batch's prefix sums, ALiBi slopes, sink logits, block-sparse tile lists
// and the block mask — in one buffer of words (storage bindings are few:
// WebGPU guarantees 8 per stage). The composer emits `@on` when the variant
// reads any of them, else `@off` (no binding). Like the decode kernels'
// index buffer, it is metadata: the access counters do not count it, as
// they do not count uniforms. Offsets are Params' `*_at` fields.
// @off
fn side_word(i: u32) -> u32 {
    return 0u;
}
// @on
@group(0) @binding(27) var<storage, read> side: array<u32>;
fn side_word(i: u32) -> u32 {
    return side[i];
}

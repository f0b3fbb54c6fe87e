// Tile loading of the registers kernels. `@chunk` is a template emitted
// once per tensor the kernel reads ({name}: q, k, v, do): four consecutive
// elements of a row as one vec4, the first n (0..4) loaded and the rest 0
// (past the end of a head dim that is not a multiple of 4, or of the
// sequence), so zero-padded chunks add nothing to dot products.
// @common
// Elements of chunk x4 of a row of `dim` that exist: 4, fewer in the last
// chunk, none where the row does not (`valid` false).
fn chunk_len(dim: u32, x4: u32, valid: bool) -> u32 {
    return select(0u, min(4u, dim - 4u * x4), valid);
}
// @chunk
fn chunk_{name}(at: u32, n: u32) -> vec4<f32> {
    var x = vec4<f32>();
    for (var j = 0u; j < 4u; j++) {
        if (j < n) {
            x[j] = load_{name}(at + j);
        }
    }
    return x;
}

// Row max and row sum of the registers kernels, for the RM rows an
// invocation owns (prelude: TC, RM, ROW_PARTS = BR·TC). A row's partials are held by its TC
// invocations, consecutive in local_invocation_index; after the reduction
// every one of them holds the same value (the sum's order is the same in
// each). The composer emits one section:
// - `@subgroup`: XOR butterflies of subgroupShuffleXor, where TC is a power
//   of two within the smallest subgroup, so a row's invocations are lanes of
//   one subgroup (no barrier, no workgroup memory);
// - `@workgroup`: partials through workgroup memory, between two barriers.
// Both are called in workgroup-uniform control flow.
// @subgroup
fn butterfly(x: f32, is_max: bool) -> f32 {
    var v = x;
    if (TC > 16u) {
        let y = subgroupShuffleXor(v, 16u);
        v = select(v + y, max(v, y), is_max);
    }
    if (TC > 8u) {
        let y = subgroupShuffleXor(v, 8u);
        v = select(v + y, max(v, y), is_max);
    }
    if (TC > 4u) {
        let y = subgroupShuffleXor(v, 4u);
        v = select(v + y, max(v, y), is_max);
    }
    if (TC > 2u) {
        let y = subgroupShuffleXor(v, 2u);
        v = select(v + y, max(v, y), is_max);
    }
    if (TC > 1u) {
        let y = subgroupShuffleXor(v, 1u);
        v = select(v + y, max(v, y), is_max);
    }
    return v;
}

fn row_reduce(tid: u32, x: ptr<function, array<f32, RM>>, is_max: bool) {
    for (var i = 0u; i < RM; i++) {
        (*x)[i] = butterfly((*x)[i], is_max);
    }
}
// @workgroup
var<workgroup> row_part: array<f32, ROW_PARTS>;

fn row_reduce(tid: u32, x: ptr<function, array<f32, RM>>, is_max: bool) {
    let base = (tid / TC) * RM * TC;
    for (var i = 0u; i < RM; i++) {
        row_part[base + i * TC + tid % TC] = (*x)[i];
    }
    workgroupBarrier();
    for (var i = 0u; i < RM; i++) {
        var v = row_part[base + i * TC];
        for (var u = 1u; u < TC; u++) {
            let y = row_part[base + i * TC + u];
            v = select(v + y, max(v, y), is_max);
        }
        (*x)[i] = v;
    }
    // The partials are rewritten by the next reduction.
    workgroupBarrier();
}

// Matmul for CPU adapters (lavapipe), the same idea as flash_fwd_lanes.wgsl:
// a workgroup is one subgroup of SG lanes, each lane owns one row of C, and
// each step one lane loads one row of B that all lanes read by subgroup
// broadcast. Two forms, chosen by the composer:
// - `dot` (B_TRANS, C = A·Bᵀ with K = 4·CH): the lane's row of A lives in
//   registers; each step yields SG columns of C (S = QKᵀ, dP = dO·Vᵀ).
// - `axpy` (C = A·B with N = 4·CH): the lane's row of C lives in registers;
//   each step adds SG rows of B, weighted by the lane's A entries (O = PV).
// Lines with `$j` / `$i` are unrolled by the composer as in
// flash_fwd_lanes.wgsl (j < SG lanes, i < CH vec4 chunks); a line with `$q`
// repeats for each quad q < SG/4 of lanes, `$q0`..`$q3` being 4q..4q+3.
//
// The composer emits one of the two sections. Prelude: SG, B_TRANS,
// EPILOGUE, IS_MASKED, HAS_SOFTCAP, load4_a and store4_c (dot) or load_a
// and store_c (axpy), load4_b; matmul_common.wgsl.
// @dot
@compute @workgroup_size(SG)
fn dot(
    @builtin(local_invocation_index) tid: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let off = matmul_offsets(wg.z);
    let row = wg.y * SG + tid;
    let row_ok = row < mm.m;
    var ar$i = vec4<f32>(0.0);
    if (row_ok) {
        ar$i = load4_a((off.x + row * mm.lda) / 4u + $iu);
    }
    for (var c0 = 0u; c0 < mm.n; c0 += SG) {
        var br$i = vec4<f32>(0.0);
        if (c0 + lane < mm.n) {
            br$i = load4_b((off.y + (c0 + lane) * mm.ldb) / 4u + $iu);
        }
        var s$j = 0.0;
        s$j = add_dot(s$j, ar$i, subgroupBroadcast(br$i, $ju)); // i outer
        // Four columns per store (N and the row starts are multiples of 4).
        let c4 = (off.z + row * mm.ldc + c0) / 4u;
        if (row_ok && c0 + 4u * $qu < mm.n) { store4_c(c4 + $qu, vec4<f32>(epilogue(row, c0 + $q0u, s$q0), epilogue(row, c0 + $q1u, s$q1), epilogue(row, c0 + $q2u, s$q2), epilogue(row, c0 + $q3u, s$q3))); }
    }
    io_flush();
    check_loop_budget();
}

// @axpy
@compute @workgroup_size(SG)
fn axpy(
    @builtin(local_invocation_index) tid: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let off = matmul_offsets(wg.z);
    let row = wg.y * SG + tid;
    let row_ok = row < mm.m;
    let a = off.x + row * mm.lda;
    var acc$i = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < mm.k; k0 += SG) {
        var br$i = vec4<f32>(0.0);
        if (k0 + lane < mm.k) {
            br$i = load4_b((off.y + (k0 + lane) * mm.ldb) / 4u + $iu);
        }
        var a$j = 0.0;
        if (row_ok && k0 + $ju < mm.k) { a$j = load_a(a + k0 + $ju); }
        acc$i += a$j * subgroupBroadcast(br$i, $ju);
    }
    if (row_ok) {
        let c = off.z + row * mm.ldc;
        store_c(c + 4u * $iu, epilogue(row, 4u * $iu, acc$i.x));
        store_c(c + 4u * $iu + 1u, epilogue(row, 4u * $iu + 1u, acc$i.y));
        store_c(c + 4u * $iu + 2u, epilogue(row, 4u * $iu + 2u, acc$i.z));
        store_c(c + 4u * $iu + 3u, epilogue(row, 4u * $iu + 3u, acc$i.w));
    }
    io_flush();
    check_loop_budget();
}

// Matmul for CPU adapters (lavapipe), the same idea as flash_fwd_lanes.wgsl:
// a workgroup is one subgroup of SG lanes, each lane owns RPL rows of C, and
// each step one lane loads one row of B that all lanes read by subgroup
// broadcast. Two forms, chosen by the composer:
// - `dot` (B_TRANS, C = A·Bᵀ with K = 4·chunks): the lane's rows of A live in
//   registers; each step yields SG columns of C (S = QKᵀ, dP = dO·Vᵀ).
// - `axpy` (C = A·B with N = 4·chunks): the lane's rows of C live in
//   registers; each step adds SG rows of B, weighted by the lane's A entries
//   (O = PV, dQ = dS·K, dV = Pᵀ·dO).
// Lines with `$r`, `$j`, `$i` are unrolled by the composer as in
// flash_fwd_lanes.wgsl (row r of a lane is row0 + r·SG + lane); a line with
// `$q` repeats for each quad q < SG/4 of lanes, `$q0`..`$q3` being 4q..4q+3.
//
// The composer emits one of the two sections. Prelude: SG, RPL, B_TRANS,
// EPILOGUE, IS_MASKED, HAS_SOFTCAP, load4_a and store4_c (dot) or load_a and
// store_c (axpy), load4_b; matmul_common.wgsl.
// @dot
@compute @workgroup_size(SG)
fn dot(
    @builtin(local_invocation_index) tid: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let off = matmul_offsets(wg.z);
    let row$r = wg.y * SG * RPL + $ru * SG + tid;
    let row_ok$r = row$r < mm.m;
    var ar$r_$i = vec4<f32>(0.0);
    if (row_ok$r) { ar$r_$i = load4_a((off.x + row$r * mm.lda) / 4u + $iu); }
    for (var c0 = 0u; c0 < mm.n; c0 += SG) {
        var br$i = vec4<f32>(0.0);
        if (c0 + lane < mm.n) {
            br$i = load4_b((off.y + (c0 + lane) * mm.ldb) / 4u + $iu);
        }
        var s$r_$j = 0.0;
        s$r_$j = add_dot(s$r_$j, ar$r_$i, subgroupBroadcast(br$i, $ju)); // i outer
        // Four columns per store (N and the row starts are multiples of 4).
        let c4$r = (off.z + row$r * mm.ldc + c0) / 4u;
        if (row_ok$r && c0 + 4u * $qu < mm.n) { store4_c(c4$r + $qu, vec4<f32>(epilogue(row$r, c0 + $q0u, s$r_$q0), epilogue(row$r, c0 + $q1u, s$r_$q1), epilogue(row$r, c0 + $q2u, s$r_$q2), epilogue(row$r, c0 + $q3u, s$r_$q3))); }
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
    let row$r = wg.y * SG * RPL + $ru * SG + tid;
    let row_ok$r = row$r < mm.m;
    let a$r = off.x + row$r * mm.lda;
    var acc$r_$i = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < mm.k; k0 += SG) {
        var br$i = vec4<f32>(0.0);
        if (k0 + lane < mm.k) {
            br$i = load4_b((off.y + (k0 + lane) * mm.ldb) / 4u + $iu);
        }
        var a$r_$j = 0.0;
        if (row_ok$r && k0 + $ju < mm.k) { a$r_$j = load_a(a$r + k0 + $ju); }
        acc$r_$i += a$r_$j * subgroupBroadcast(br$i, $ju);
    }
    let c$r = off.z + row$r * mm.ldc;
    if (row_ok$r) { store_c(c$r + 4u * $iu, epilogue(row$r, 4u * $iu, acc$r_$i.x)); }
    if (row_ok$r) { store_c(c$r + 4u * $iu + 1u, epilogue(row$r, 4u * $iu + 1u, acc$r_$i.y)); }
    if (row_ok$r) { store_c(c$r + 4u * $iu + 2u, epilogue(row$r, 4u * $iu + 2u, acc$r_$i.z)); }
    if (row_ok$r) { store_c(c$r + 4u * $iu + 3u, epilogue(row$r, 4u * $iu + 3u, acc$r_$i.w)); }
    io_flush();
    check_loop_budget();
}

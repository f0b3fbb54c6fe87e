// The register-tiled backward: the tiled kernels' structure (square B×B
// tiles, P and dS recomputed on chip from Q, dO, K, V, LSE and D; dK/dV over
// key blocks, dQ over query blocks; no atomics) with micro-tiles in
// registers. Invocation (g, t) computes S and dP for rows g·RM.. × keys
// t + k·TC (vec4 reads of Q, dO, K, V), and accumulates RM rows (dQ) or RM
// keys (dK, dV) × vec4 columns t + a·TC.
//
// Prelude: overrides B, D, DV, D4 / DV4 (vec4 chunks of q/k and v/o rows),
// DM4 = max(D4, DV4), DP / VP (their padded row strides), TC, WG = (B/RM)·TC,
// IS_MASKED, HAS_SOFTCAP; constants RM, SC = ceil(B/TC), ACC_K = ceil(D4/TC),
// ACC_V = ceil(DV4/TC); the accessors, chunk_q/k/v/do (regs_load.wgsl);
// flash_bwd_math.wgsl; the keep tile (dropout.wgsl). Sections: `@common`,
// then `@dkdv` or `@dq`.
// @common
override FULL_SC: bool = (B % TC) == 0u;
override FULL_K: bool = (D4 % TC) == 0u;
override FULL_V: bool = (DV4 % TC) == 0u;

var<workgroup> q_tile: array<vec4<f32>, B * DP>;   // q · scale
var<workgroup> do_tile: array<vec4<f32>, B * VP>;
var<workgroup> k_tile: array<vec4<f32>, B * DP>;
var<workgroup> v_tile: array<vec4<f32>, B * VP>;
var<workgroup> p_tile: array<f32, B * B>;   // [row][key]
var<workgroup> ds_tile: array<f32, B * B>;  // [row][key]
var<workgroup> lse_tile: array<f32, B>;
var<workgroup> dvec_tile: array<f32, B>;

// Query rows q0.. of head h (rows past n_rows as 0): Q·scale and dO in one
// loop over the wider row's chunks, then LSE and D.
fn load_row_tiles(tid: u32, seq: Seq, h: u32, q0: u32, n_rows: u32) {
    for (var e = tid; e < B * DM4; e += WG) {
        let i = e / DM4;
        let x4 = e % DM4;
        let row = seq.q_row + q0 + i;
        if (x4 < D4) {
            let at = row * params.q_row_stride + h * D + 4u * x4;
            q_tile[i * DP + x4] = chunk_q(at, chunk_len(D, x4, i < n_rows)) * params.scale;
        }
        if (x4 < DV4) {
            let at = row * params.o_row_stride + h * DV + 4u * x4;
            do_tile[i * VP + x4] = chunk_do(at, chunk_len(DV, x4, i < n_rows));
        }
    }
    for (var row = tid; row < B; row += WG) {
        let stats = row_stats(seq, h, q0, row, n_rows);
        lse_tile[row] = stats.x;
        dvec_tile[row] = stats.y;
    }
}

// Keys k0.. of kv head hk (keys past n_keys as 0), K and V in one loop.
fn load_key_tiles(tid: u32, seq: Seq, hk: u32, k0: u32, n_keys: u32) {
    for (var e = tid; e < B * DM4; e += WG) {
        let c = e / DM4;
        let x4 = e % DM4;
        let row = seq.k_row + k0 + c;
        if (x4 < D4) {
            let at = row * params.kv_row_stride + hk * D + 4u * x4;
            k_tile[c * DP + x4] = chunk_k(at, chunk_len(D, x4, c < n_keys));
        }
        if (x4 < DV4) {
            let at = row * params.v_row_stride + hk * DV + 4u * x4;
            v_tile[c * VP + x4] = chunk_v(at, chunk_len(DV, x4, c < n_keys));
        }
    }
}

// Where a B×B tile lies: its first absolute row and key and how many of
// each it has, and how its pairs are scored.
struct Span {
    row0: i32,
    rows: u32,
    key0: i32,
    keys: u32,
}

// The tile's Block: pairs tested where it crosses a boundary of the band or
// of the sequences, or (partial) the block mask.
fn span_block(sp: Span, offset: i32, slope: f32, partial: bool, mask_at: u32) -> Block {
    let masking = partial || sp.rows < B || sp.keys < B
        || !band_covers(offset, sp.row0, sp.row0 + i32(B) - 1, sp.key0, sp.key0 + i32(B) - 1);
    return Block(offset, slope, masking, partial, mask_at);
}

// Invocation tid fills p_tile and ds_tile for its RM rows × SC keys.
fn tile_p_ds(tid: u32, sp: Span, blk: Block) {
    let t = tid % TC;
    let row0 = (tid / TC) * RM;
    var s = array<f32, RM * SC>();
    var dp = array<f32, RM * SC>();
    for (var x4 = 0u; x4 < DM4; x4++) {
        if (x4 < D4) {
            var a = array<vec4<f32>, RM>();
            for (var i = 0u; i < RM; i++) {
                a[i] = q_tile[(row0 + i) * DP + x4];
            }
            for (var k = 0u; k < SC; k++) {
                let c = t + k * TC;
                if (FULL_SC || c < B) {
                    let b = k_tile[c * DP + x4];
                    for (var i = 0u; i < RM; i++) {
                        s[i * SC + k] = add_dot(s[i * SC + k], a[i], b);
                    }
                }
            }
        }
        if (x4 < DV4) {
            var a = array<vec4<f32>, RM>();
            for (var i = 0u; i < RM; i++) {
                a[i] = do_tile[(row0 + i) * VP + x4];
            }
            for (var k = 0u; k < SC; k++) {
                let c = t + k * TC;
                if (FULL_SC || c < B) {
                    let b = v_tile[c * VP + x4];
                    for (var i = 0u; i < RM; i++) {
                        dp[i * SC + k] = add_dot(dp[i * SC + k], a[i], b);
                    }
                }
            }
        }
    }
    for (var i = 0u; i < RM; i++) {
        let r = row0 + i;
        let row_abs = sp.row0 + i32(r);
        for (var k = 0u; k < SC; k++) {
            let c = t + k * TC;
            if (FULL_SC || c < B) {
                let key_abs = sp.key0 + i32(c);
                let ok = block_pair_ok(blk, r < sp.rows && c < sp.keys, row_abs, key_abs);
                let bias = alibi_bias(blk.slope, blk.offset, row_abs, key_abs);
                let pds = p_and_ds(s[i * SC + k], bias, dp[i * SC + k], lse_tile[r], dvec_tile[r], ok, tile_kept(r, c));
                p_tile[r * B + c] = pds.x;
                ds_tile[r * B + c] = pds.y;
            }
        }
    }
}
// @dkdv
// dK and dV: one workgroup per block of B keys of one kv head, looping over
// every query head of its GQA group and every query block that sees its
// keys in a fixed order (deterministic, no atomics). Invocation (g, t) owns
// keys g·RM.. in the accumulation.
@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let t = tid % TC;
    let key0 = (tid / TC) * RM;
    let seq = sequence(wg, B, true);
    let k0 = seq.block * B;
    let hk = wg.y;
    let keys_here = min(B, seq.keys - k0);
    let key_abs0 = i32(params.k_start + k0);
    load_key_tiles(tid, seq, hk, k0, keys_here);

    // Skip, don't mask: only query blocks that see one of these keys.
    let rows = visible_rows(seq, key_abs0, key_abs0 + i32(keys_here) - 1);

    var dk = array<vec4<f32>, RM * ACC_K>();
    var dv = array<vec4<f32>, RM * ACC_V>();
    for (var g = 0u; g < params.group; g++) {
        let h = hk * params.group + g;
        let steps = tile_steps(seq, h, rows, B, true);
        var next = tile_at(steps.x, true);
        for (var step = steps.x; step < steps.y; step++) {
            let blk = next;
            next = tile_after(step, steps, true);
            let q0 = tile_index(blk) * B;
            let rows_here = min(B, seq.rows - q0);
            // The previous tile's readers must finish before it is overwritten.
            workgroupBarrier();
            load_row_tiles(tid, seq, h, q0, rows_here);
            fill_keep_tile(tid, seq.b, h, i32(params.q_start + q0), key_abs0);
            workgroupBarrier();
            let sp = Span(i32(params.q_start + q0), rows_here, key_abs0, keys_here);
            tile_p_ds(tid, sp, span_block(sp, seq.offset, alibi_slope(seq, h), tile_partial(blk), mask_base(seq, h)));
            workgroupBarrier();
            // dV += Pᵀ dO, dK += dSᵀ (Q·scale) for this invocation's keys.
            for (var i = 0u; i < B; i++) {
                var p = array<f32, RM>();
                var ds = array<f32, RM>();
                for (var j = 0u; j < RM; j++) {
                    p[j] = p_tile[i * B + key0 + j];
                    ds[j] = ds_tile[i * B + key0 + j];
                }
                for (var a = 0u; a < ACC_V; a++) {
                    let x4 = t + a * TC;
                    if (FULL_V || x4 < DV4) {
                        let g4 = do_tile[i * VP + x4];
                        for (var j = 0u; j < RM; j++) {
                            dv[j * ACC_V + a] += p[j] * g4;
                        }
                    }
                }
                for (var a = 0u; a < ACC_K; a++) {
                    let x4 = t + a * TC;
                    if (FULL_K || x4 < D4) {
                        let q4 = q_tile[i * DP + x4];
                        for (var j = 0u; j < RM; j++) {
                            dk[j * ACC_K + a] += ds[j] * q4;
                        }
                    }
                }
            }
        }
    }
    for (var j = 0u; j < RM; j++) {
        if (key0 + j < keys_here) {
            let row = seq.k_row + k0 + key0 + j;
            for (var a = 0u; a < ACC_K; a++) {
                let x4 = t + a * TC;
                for (var e = 0u; e < 4u; e++) {
                    if (4u * x4 + e < D) {
                        store_dk(row * params.kv_row_stride + hk * D + 4u * x4 + e, dk[j * ACC_K + a][e]);
                    }
                }
            }
            for (var a = 0u; a < ACC_V; a++) {
                let x4 = t + a * TC;
                for (var e = 0u; e < 4u; e++) {
                    if (4u * x4 + e < DV) {
                        store_dv(row * params.v_row_stride + hk * DV + 4u * x4 + e, dv[j * ACC_V + a][e] * dropout_scale());
                    }
                }
            }
        }
    }
    io_flush();
    check_loop_budget();
}
// @dq
// dQ: one workgroup per block of B query rows of one head, looping over the
// key blocks the rows can see; P and dS recomputed as in dK/dV, so dQ needs
// no atomics either.
@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let t = tid % TC;
    let row0 = (tid / TC) * RM;
    let seq = sequence(wg, B, false);
    let q0 = seq.block * B;
    let h = wg.y;
    let hk = h / params.group;
    let rows_here = min(B, seq.rows - q0);
    let row_abs0 = i32(params.q_start + q0);
    load_row_tiles(tid, seq, h, q0, rows_here);

    let keys = visible_keys(seq, row_abs0, row_abs0 + i32(rows_here) - 1);
    let steps = tile_steps(seq, h, keys, B, false);
    let slope = alibi_slope(seq, h);
    let mask_at = mask_base(seq, h);

    var dq = array<vec4<f32>, RM * ACC_K>();
    var next = tile_at(steps.x, false);
    for (var step = steps.x; step < steps.y; step++) {
        let blk = next;
        next = tile_after(step, steps, false);
        let k0 = tile_index(blk) * B;
        let keys_here = min(B, seq.keys - k0);
        workgroupBarrier();
        load_key_tiles(tid, seq, hk, k0, keys_here);
        fill_keep_tile(tid, seq.b, h, row_abs0, i32(params.k_start + k0));
        workgroupBarrier();
        let sp = Span(row_abs0, rows_here, i32(params.k_start + k0), keys_here);
        tile_p_ds(tid, sp, span_block(sp, seq.offset, slope, tile_partial(blk), mask_at));
        workgroupBarrier();
        for (var c = 0u; c < B; c++) {
            var ds = array<f32, RM>();
            for (var j = 0u; j < RM; j++) {
                ds[j] = ds_tile[(row0 + j) * B + c];
            }
            for (var a = 0u; a < ACC_K; a++) {
                let x4 = t + a * TC;
                if (FULL_K || x4 < D4) {
                    let k4 = k_tile[c * DP + x4];
                    for (var j = 0u; j < RM; j++) {
                        dq[j * ACC_K + a] += ds[j] * k4;
                    }
                }
            }
        }
    }
    for (var j = 0u; j < RM; j++) {
        if (row0 + j < rows_here) {
            let row = seq.q_row + q0 + row0 + j;
            for (var a = 0u; a < ACC_K; a++) {
                let x4 = t + a * TC;
                for (var e = 0u; e < 4u; e++) {
                    if (4u * x4 + e < D) {
                        store_dq(row * params.q_row_stride + h * D + 4u * x4 + e, dq[j * ACC_K + a][e] * params.scale);
                    }
                }
            }
        }
    }
    io_flush();
    check_loop_budget();
}

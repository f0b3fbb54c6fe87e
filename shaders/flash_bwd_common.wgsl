// Shared by the two backward kernels (dK/dV over key blocks, dQ over query
// blocks). Both recompute P = exp(S - LSE) and dS = P·(dP - D) for a B×B tile
// on chip from Q, dO, K, V, LSE and D = rowsum(dO·O); neither writes S or P
// to storage. Tiles are square (B rows × B keys) so that "invocation r of the
// tile" can own query row r in one phase and key row r in the other.
//
// Prelude: overrides B, D, TC, WG = B·TC, IS_MASKED, HAS_SOFTCAP; constants
// SC = ceil(B/TC), ACC = ceil(D/TC); load_q/k/v/do, load_lse, load_dvec,
// round_storage; flash_bwd_math.wgsl.

override FULL_SC: bool = (B % TC) == 0u;
override FULL_ACC: bool = (D % TC) == 0u;

var<workgroup> q_tile: array<f32, B * D>;   // q · scale
var<workgroup> do_tile: array<f32, B * D>;
var<workgroup> k_tile: array<f32, B * D>;
var<workgroup> v_tile: array<f32, B * D>;
var<workgroup> p_tile: array<f32, B * B>;   // [row][key]
var<workgroup> ds_tile: array<f32, B * B>;  // [row][key]
var<workgroup> lse_tile: array<f32, B>;
var<workgroup> dvec_tile: array<f32, B>;

// Query rows q0.. of head h (rows past n_rows read as zero).
fn load_row_tiles(tid: u32, b: u32, h: u32, q0: u32, n_rows: u32) {
    let base = b * params.q_batch_stride + h * D;
    for (var e = tid; e < B * D; e += WG) {
        let row = e / D;
        var qx = 0.0;
        var gx = 0.0;
        if (row < n_rows) {
            let g = base + (q0 + row) * params.q_row_stride + e % D;
            qx = load_q(g) * params.scale;
            gx = load_do(g);
        }
        q_tile[e] = qx;
        do_tile[e] = gx;
    }
    for (var row = tid; row < B; row += WG) {
        var lse = 0.0;
        var dv = 0.0;
        if (row < n_rows) {
            let g = b * params.lse_batch_stride + h * params.lse_head_stride + q0 + row;
            lse = finite_lse(load_lse(g));
            dv = load_dvec(g);
        }
        lse_tile[row] = lse;
        dvec_tile[row] = dv;
    }
}

// Keys k0.. of kv head hk (keys past n_keys read as zero).
fn load_key_tiles(tid: u32, b: u32, hk: u32, k0: u32, n_keys: u32) {
    let base = b * params.kv_batch_stride + hk * D;
    for (var e = tid; e < B * D; e += WG) {
        let key = e / D;
        var kx = 0.0;
        var vx = 0.0;
        if (key < n_keys) {
            let g = base + (k0 + key) * params.kv_row_stride + e % D;
            kx = load_k(g);
            vx = load_v(g);
        }
        k_tile[e] = kx;
        v_tile[e] = vx;
    }
}

// Invocation (r, t) fills p_tile and ds_tile for row r, keys t + k·TC.
// `row_abs0`/`key_abs0` place the tile in the full problem for the mask.
fn tile_p_ds(r: u32, t: u32, row_abs0: i32, n_rows: u32, key_abs0: i32, n_keys: u32) {
    // Initialized explicitly: Chromium's Tint zeroes a function's `var`
    // without initializer only once, not at every call from a loop.
    var s = array<f32, SC>();
    var dp = array<f32, SC>();
    for (var x = 0u; x < D; x++) {
        let qx = q_tile[r * D + x];
        let gx = do_tile[r * D + x];
        for (var k = 0u; k < SC; k++) {
            let c = t + k * TC;
            if (FULL_SC || c < B) {
                s[k] += qx * k_tile[c * D + x];
                dp[k] += gx * v_tile[c * D + x];
            }
        }
    }
    let needs_mask = n_rows < B || n_keys < B
        || !band_covers(row_abs0, row_abs0 + i32(B) - 1, key_abs0, key_abs0 + i32(B) - 1);
    let row_abs = row_abs0 + i32(r);
    for (var k = 0u; k < SC; k++) {
        let c = t + k * TC;
        if (!FULL_SC && c >= B) {
            continue;
        }
        let ok = pair_allowed(needs_mask, r < n_rows && c < n_keys, row_abs, key_abs0 + i32(c));
        let pds = p_and_ds(s[k], dp[k], lse_tile[r], dvec_tile[r], ok);
        p_tile[r * B + c] = pds.x;
        ds_tile[r * B + c] = pds.y;
    }
}

// Shared by the two backward kernels (dK/dV over key blocks, dQ over query
// blocks). Both recompute P = exp(S - LSE) and dS = P·(dP - D) for a B×B tile
// on chip from Q, dO, K, V, LSE and D = rowsum(dO·O); neither writes S or P
// to storage. Tiles are square (B rows × B keys) so that "invocation r of the
// tile" can own query row r in one phase and key row r in the other.
//
// Prelude: overrides B, D (q/k head dim), DV (v/o head dim), DM = max(D,
// DV), TC, WG = B·TC,
// IS_MASKED, HAS_SOFTCAP; constants SC = ceil(B/TC), ACC_K = ceil(D/TC),
// ACC_V = ceil(DV/TC); load_q/k/v/do, load_lse, load_dvec, round_storage;
// flash_bwd_math.wgsl; the keep tile (dropout.wgsl), filled with the tile's
// loads.

override FULL_SC: bool = (B % TC) == 0u;
override FULL_K: bool = (D % TC) == 0u;
override FULL_V: bool = (DV % TC) == 0u;

var<workgroup> q_tile: array<f32, B * D>;   // q · scale
var<workgroup> do_tile: array<f32, B * DV>;
var<workgroup> k_tile: array<f32, B * D>;
var<workgroup> v_tile: array<f32, B * DV>;
var<workgroup> p_tile: array<f32, B * B>;   // [row][key]
var<workgroup> ds_tile: array<f32, B * B>;  // [row][key]
var<workgroup> lse_tile: array<f32, B>;
var<workgroup> dvec_tile: array<f32, B>;

// Query rows q0.. of head h of `seq` (rows past n_rows read as zero): one
// loop over the wider head dim (DM = max(D, DV)) loads Q and dO.
fn load_row_tiles(tid: u32, seq: Seq, h: u32, q0: u32, n_rows: u32) {
    for (var e = tid; e < B * DM; e += WG) {
        let i = e / DM;
        let x = e % DM;
        let row = seq.q_row + q0 + i;
        if (D == DV || x < D) {
            var qx = 0.0;
            if (i < n_rows) {
                qx = load_q(row * params.q_row_stride + h * D + x) * params.scale;
            }
            q_tile[i * D + x] = qx;
        }
        if (D == DV || x < DV) {
            var gx = 0.0;
            if (i < n_rows) {
                gx = load_do(row * params.o_row_stride + h * DV + x);
            }
            do_tile[i * DV + x] = gx;
        }
    }
    for (var row = tid; row < B; row += WG) {
        let stats = row_stats(seq, h, q0, row, n_rows);
        lse_tile[row] = stats.x;
        dvec_tile[row] = stats.y;
    }
}

// Keys k0.. of kv head hk of `seq` (keys past n_keys read as zero), K and V
// in one loop like load_row_tiles.
fn load_key_tiles(tid: u32, seq: Seq, hk: u32, k0: u32, n_keys: u32) {
    for (var e = tid; e < B * DM; e += WG) {
        let c = e / DM;
        let x = e % DM;
        let row = seq.k_row + k0 + c;
        if (D == DV || x < D) {
            var kx = 0.0;
            if (c < n_keys) {
                kx = load_k(row * params.kv_row_stride + hk * D + x);
            }
            k_tile[c * D + x] = kx;
        }
        if (D == DV || x < DV) {
            var vx = 0.0;
            if (c < n_keys) {
                vx = load_v(row * params.v_row_stride + hk * DV + x);
            }
            v_tile[c * DV + x] = vx;
        }
    }
}

// Where a B×B tile lies: its first absolute row and key (sequence-relative)
// and how many of each it has, the sequence's diagonal offset, ALiBi's slope,
// and the block mask (whether to test it per pair, and its base).
struct Tile {
    offset: i32,
    row0: i32,
    rows: u32,
    key0: i32,
    keys: u32,
    slope: f32,
    partial: bool,
    mask_at: u32,
}

// Invocation (r, t) fills p_tile and ds_tile for row r, keys t + k·TC.
fn tile_p_ds(r: u32, t: u32, tile: Tile) {
    // Initialized explicitly: Chromium's Tint zeroes a function's `var`
    // without initializer only once, not at every call from a loop.
    var s = array<f32, SC>();
    var dp = array<f32, SC>();
    for (var x = 0u; x < DM; x++) {
        if (D == DV) {
            let qx = q_tile[r * D + x];
            let gx = do_tile[r * D + x];
            for (var k = 0u; k < SC; k++) {
                let c = t + k * TC;
                if (FULL_SC || c < B) {
                    s[k] += qx * k_tile[c * D + x];
                    dp[k] += gx * v_tile[c * D + x];
                }
            }
            continue;
        }
        if (x < D) {
            let qx = q_tile[r * D + x];
            for (var k = 0u; k < SC; k++) {
                let c = t + k * TC;
                if (FULL_SC || c < B) {
                    s[k] += qx * k_tile[c * D + x];
                }
            }
        }
        if (x < DV) {
            let gx = do_tile[r * DV + x];
            for (var k = 0u; k < SC; k++) {
                let c = t + k * TC;
                if (FULL_SC || c < B) {
                    dp[k] += gx * v_tile[c * DV + x];
                }
            }
        }
    }
    let needs_mask = tile.partial || tile.rows < B || tile.keys < B
        || !band_covers(tile.offset, tile.row0, tile.row0 + i32(B) - 1, tile.key0, tile.key0 + i32(B) - 1);
    let row_abs = tile.row0 + i32(r);
    for (var k = 0u; k < SC; k++) {
        let c = t + k * TC;
        if (!FULL_SC && c >= B) {
            continue;
        }
        let key_abs = tile.key0 + i32(c);
        let in_range = r < tile.rows && c < tile.keys;
        var ok = pair_allowed(needs_mask, in_range, tile.offset, row_abs, key_abs);
        if (tile.partial) {
            ok = ok && block_allows(in_range, tile.mask_at, row_abs, key_abs);
        }
        let bias = alibi_bias(tile.slope, tile.offset, row_abs, key_abs);
        let pds = p_and_ds(s[k], bias, dp[k], lse_tile[r], dvec_tile[r], ok, tile_kept(r, c));
        p_tile[r * B + c] = pds.x;
        ds_tile[r * B + c] = pds.y;
    }
}

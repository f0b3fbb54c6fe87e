// Appends k_new and v_new to a quantized cache by docs/kv-quantization.md's
// rule: one workgroup per (scale block the step's new tokens reach, kv
// head, sequence × {K, V}; a latent cache's sequence × {K}: its V is a
// view of K). It finds the largest new magnitude in its
// block; where that asks for a larger scale, the block takes it and its
// other codes are requantized in place; then the new values are coded at
// the block's scale. A block belongs to one sequence, so no two workgroups
// share a scale; codes sharing a word with another workgroup's are written
// by atomics (storage_kv_quant.wgsl's read_write section).
//
// The composer declares WG (a power of two), D, DV, CACHE_FP8;
// common.wgsl; decode_common.wgsl; e4m3.wgsl; kv_quant.wgsl; load_k_new,
// load_v_new; the cache's k and v (read_write).

var<workgroup> wg_max: array<f32, WG>;
var<workgroup> wg_old: f32;

fn load_new(is_v: bool, i: u32) -> f32 {
    if (is_v) {
        return load_v_new(i);
    }
    return load_k_new(i);
}

fn code_at(is_v: bool, i: u32) -> u32 {
    if (is_v) {
        return code_v(i);
    }
    return code_k(i);
}

fn set_code(is_v: bool, i: u32, c: u32) {
    if (is_v) {
        set_code_v(i, c);
    } else {
        set_code_k(i, c);
    }
}

// |x|, a subnormal counting as 0 (as the code of one is 0).
fn flushed_abs(x: f32) -> f32 {
    return select(abs(x), 0.0, (bitcast<u32>(x) & 0x7f800000u) == 0u);
}

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let parts = select(2u, 1u, decode.v_new_len == 0u);
    let b = wg.z / parts;
    let is_v = wg.z % parts == 1u;
    let hk = wg.y;
    let d = select(D, DV, is_v);
    let t1 = seqlen_k(b);
    let t0 = t1 - decode.seqlen_new;
    // Blocks in token order: block j of a sequence is block j % bpp of its
    // page slot j / bpp, tokens [start, end).
    let bpp = decode.blocks_per_page;
    let first = (t0 / decode.page_size) * bpp + (t0 % decode.page_size) / decode.block_tokens;
    let j = first + wg.x;
    let start = (j / bpp) * decode.page_size + (j % bpp) * decode.block_tokens;
    let end = min(start + decode.block_tokens, (j / bpp + 1u) * decode.page_size);
    let lo = max(t0, start);
    let hi = min(t1, end);
    if (lo >= hi) {
        return;
    }
    let at = cache_block(cache_row(b, start)) * decode.heads_kv + hk;
    let src_row = select(params.kv_row_stride, params.v_row_stride, is_v);
    let n = (hi - lo) * d;

    var m = 0.0;
    for (var e = tid; e < n; e += WG) {
        let t = lo + e / d;
        m = max(m, flushed_abs(load_new(is_v, (b * decode.seqlen_new + t - t0) * src_row + hk * d + e % d)));
    }
    wg_max[tid] = m;
    if (tid == 0u) {
        if (is_v) {
            wg_old = scale_v(at);
        } else {
            wg_old = scale_k(at);
        }
    }
    for (var w = WG / 2u; w > 0u; w /= 2u) {
        workgroupBarrier();
        if (tid < w) {
            wg_max[tid] = max(wg_max[tid], wg_max[tid + w]);
        }
    }
    let a = workgroupUniformLoad(&wg_max[0]);
    let old = workgroupUniformLoad(&wg_old);

    var s = old;
    let grown = cache_scale_of(a);
    if (grown > old) {
        s = grown;
        // The block's other rows (those of the new tokens are rewritten below).
        for (var e = tid; e < (end - start) * d; e += WG) {
            let t = start + e / d;
            if (t < lo || t >= hi) {
                let i = (cache_row(b, t) * decode.heads_kv + hk) * d + e % d;
                set_code(is_v, i, cache_code(cache_code_value(code_at(is_v, i)) * old, s));
            }
        }
        if (tid == 0u) {
            if (is_v) {
                set_scale_v(at, s);
            } else {
                set_scale_k(at, s);
            }
        }
    }
    for (var e = tid; e < n; e += WG) {
        let t = lo + e / d;
        let x = load_new(is_v, (b * decode.seqlen_new + t - t0) * src_row + hk * d + e % d);
        set_code(is_v, (cache_row(b, t) * decode.heads_kv + hk) * d + e % d, cache_code(x, s));
    }
    io_flush();
    check_loop_budget();
}

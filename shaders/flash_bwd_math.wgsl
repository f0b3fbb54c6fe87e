// The per-entry arithmetic of the backward, shared by the tiled kernels
// (flash_bwd_common.wgsl) and the lanes kernels (flash_bwd_lanes.wgsl), so
// both recompute P and dS exactly alike.

// A row's LSE as the backward uses it: empty rows carry lse = -inf; all their
// entries are masked, so any finite stand-in keeps the arithmetic free of
// infinities.
fn finite_lse(x: f32) -> f32 {
    return select(x, 0.0, bitcast<u32>(x) == 0xff800000u);
}

// P = exp(s - lse) and dS = P·(dP - D), times the softcap's derivative, from
// the raw score s and ALiBi's bias (the forward's arithmetic: s - lse is
// exact for a row's largest score, see common.wgsl); both rounded to the
// storage precision before the matmuls that use them. Entries that do not
// take part are 0. The bias is a constant of the pair: no gradient term.
// Under dropout (`kept`, dropout.wgsl) dP is dP ∘ keep / (1 − p) and the
// first value, dV's factor, P ∘ keep (dV's sums take 1 / (1 − p)).
fn p_and_ds(s: f32, bias: f32, dp: f32, lse: f32, dvec: f32, ok: bool, kept: bool) -> vec2<f32> {
    var sc = s;
    // d(softcap)/ds = 1 - tanh²: the chain rule factor on dS.
    var dcap = 1.0;
    if (HAS_SOFTCAP) {
        let th = tanh(sc / params.softcap);
        sc = params.softcap * th;
        dcap = 1.0 - th * th;
    }
    let p = select(0.0, exp(sc - bias - lse), ok);
    let ds = p * (dropout_dp(dp, kept) - dvec) * dcap;
    return vec2<f32>(round_storage(dropout_p(p, kept)), round_storage(ds));
}

// LSE (finite, see finite_lse) and D of local row q0 + row of head h of
// `seq`, zeros past n_rows: what the backward kernels keep per row.
fn row_stats(seq: Seq, h: u32, q0: u32, row: u32, n_rows: u32) -> vec2<f32> {
    if (row >= n_rows) {
        return vec2<f32>(0.0, 0.0);
    }
    let g = seq.lse + h * params.lse_head_stride + q0 + row;
    return vec2<f32>(finite_lse(load_lse(g)), load_dvec(g));
}

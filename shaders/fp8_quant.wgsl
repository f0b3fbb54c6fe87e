// FP8 quantization (docs/semantics.md) of one tensor (batch, seqlen, heads, D) of f32,
// on the device, in three entry points run in order:
// - `absmax`: max |x| of each (batch, head) after the optional transform
//   (hadamard.wgsl), combined by atomicMax on the values' bits (which order
//   like the values: they are never negative);
// - `scales`: scale = max|x| / 448 per (batch, head), exactly rounded
//   (div_448), 0 for a head below 2^-117;
// - `codes`: x8 = e4m3(x / scale) of the exact quotient (e4m3_quotient),
//   four codes per u32, each row padded with zero codes to `row_len`.
// Each workgroup of absmax and codes loads QROWS rows of one (batch, head)
// into workgroup memory (zero past the row's QN values), transforming them
// when HADAMARD. Everything matches src/quant.rs bit for bit.
//
// The composer declares WG, D, QN, QROWS, HADAMARD; common.wgsl (access
// counters, loop guard); e4m3.wgsl; hadamard.wgsl; load_x (f32).

struct QuantParams {
    seqlen: u32,
    heads: u32,
    batch: u32,
    // Codes per stored row (a multiple of 4, at least QN).
    row_len: u32,
    // This tensor's first entry in the absmax and scales buffers.
    scale_offset: u32,
    // 1 / sqrt(QN), as the host computes it.
    norm: f32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(24) var<uniform> quant: QuantParams;
@group(0) @binding(25) var<storage, read_write> absmax: array<atomic<u32>>;
@group(0) @binding(26) var<storage, read_write> scales: array<f32>;
@group(0) @binding(3) var<storage, read_write> codes: array<u32>;

var<workgroup> rows: array<f32, QROWS * QN>;
var<workgroup> block_max: atomic<u32>;

// x, or 0 where x is zero or subnormal (decided on its bits, so adapters
// that flush subnormals agree with those that do not).
fn flush(x: f32) -> f32 {
    return select(x, 0.0, (bitcast<u32>(x) & 0x7f800000u) == 0u);
}

// Rows s0.. of head h of batch entry b into `rows`, transformed; how many.
fn load_rows(tid: u32, b: u32, h: u32, s0: u32) -> u32 {
    let here = min(QROWS, quant.seqlen - s0);
    for (var e = tid; e < QROWS * QN; e += WG) {
        let r = e / QN;
        let x = e % QN;
        var value = 0.0;
        if (r < here && x < D) {
            value = hadamard_input(x, load_x(((b * quant.seqlen + s0 + r) * quant.heads + h) * D + x));
        }
        rows[e] = value;
    }
    hadamard_rows(tid);
    return here;
}

@compute @workgroup_size(WG)
fn absmax_main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    if (tid == 0u) {
        atomicStore(&block_max, 0u);
    }
    let here = load_rows(tid, wg.z, wg.y, wg.x * QROWS);
    var m = 0.0;
    for (var e = tid; e < here * QN; e += WG) {
        m = max(m, abs(hadamard_value(e)));
    }
    atomicMax(&block_max, bitcast<u32>(m));
    workgroupBarrier();
    if (tid == 0u) {
        let i = quant.scale_offset + wg.z * quant.heads + wg.y;
        atomicMax(&absmax[i], atomicLoad(&block_max));
    }
    io_flush();
    check_loop_budget();
}

@compute @workgroup_size(WG)
fn scales_main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < quant.batch * quant.heads) {
        let i = quant.scale_offset + gid.x;
        let bits = atomicLoad(&absmax[i]);
        // Below 2^-117 (biased exponent 10), a / 448 would not be a normal f32.
        scales[i] = select(div_448(bitcast<f32>(bits)), 0.0, bits < 0x05000000u);
    }
    io_flush();
    check_loop_budget();
}

@compute @workgroup_size(WG)
fn codes_main(
    @builtin(local_invocation_index) tid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let b = wg.z;
    let h = wg.y;
    let s0 = wg.x * QROWS;
    let here = load_rows(tid, b, h, s0);
    let scale = scales[quant.scale_offset + b * quant.heads + h];
    let words = quant.row_len / 4u;
    for (var w = tid; w < here * words; w += WG) {
        let r = w / words;
        let x0 = (w % words) * 4u;
        var word = 0u;
        for (var j = 0u; j < 4u; j++) {
            if (x0 + j < QN) {
                word |= e4m3_quotient(hadamard_value(r * QN + x0 + j), scale) << (8u * j);
            }
        }
        codes[((b * quant.seqlen + s0 + r) * quant.heads + h) * words + w % words] = word;
    }
    io_flush();
    check_loop_budget();
}

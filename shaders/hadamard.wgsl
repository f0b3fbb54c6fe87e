// Incoherent processing (FlashAttention-3): rows multiplied by H·diag(signs)
// / sqrt(QN), H the Walsh–Hadamard matrix of order QN (a power of two; rows
// of D < QN values are zero-padded), applied in place to QROWS rows of
// `rows` in workgroup memory by the fast transform: log2(QN) stages of
// butterflies (a + b, a - b) on elements j and j + h, h = 1, 2, 4, ... —
// the order src/quant.rs (`Hadamard::apply`) uses, with every subnormal
// result flushed to zero, so the bits agree with the host's. The 1/sqrt(QN)
// is applied on reading (`hadamard_value`), after every addition, so no
// multiply-add can be fused.
//
// Needs: overrides QN, QROWS, WG, HADAMARD; `rows: array<f32, QROWS * QN>`
// in workgroup memory; flush().

@group(0) @binding(2) var<storage, read> signs: array<f32>;

// Element x of a row as loaded: flushed, times its sign.
fn hadamard_input(x: u32, value: f32) -> f32 {
    if (!HADAMARD) {
        return flush(value);
    }
    return flush(value) * signs[x];
}

// The butterflies over every row (all invocations of the workgroup call
// it; it ends with a barrier, so the rows are ready to read).
fn hadamard_rows(tid: u32) {
    if (!HADAMARD) {
        workgroupBarrier();
        return;
    }
    // Butterflies per row (at least 1, so QN = 1 divides by nothing).
    let pairs = max(QN / 2u, 1u);
    for (var h = 1u; h < QN; h = h * 2u) {
        workgroupBarrier();
        for (var p = tid; p < QROWS * pairs; p += WG) {
            let r = p / pairs;
            let k = p % pairs;
            let j = r * QN + (k / h) * 2u * h + k % h;
            let a = rows[j];
            let b = rows[j + h];
            rows[j] = flush(a + b);
            rows[j + h] = flush(a - b);
        }
    }
    workgroupBarrier();
}

// Element j of the rows buffer, transformed.
fn hadamard_value(j: u32) -> f32 {
    if (!HADAMARD) {
        return rows[j];
    }
    return flush(rows[j] * quant.norm);
}

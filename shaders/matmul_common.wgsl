// Shared by the matmul kernels (matmul.wgsl, tiled; matmul_lanes.wgsl, for
// CPU adapters): C[z] = epilogue(A[z] · op(B[z])), A is M×K, op(B) is K×N
// (B stored N×K and read transposed when B_TRANS, else stored K×N). The
// composer prepends B_TRANS, EPILOGUE (0: alpha·acc, 1: attention scores
// with scale, softcap and mask) and load_a, load_b, store_c.

struct MatmulParams {
    m: u32,
    n: u32,
    k: u32,
    lda: u32,
    ldb: u32,
    ldc: u32,
    // Offsets of batch z = b·heads + h: b·x_batch + h·x_head (B uses h / group).
    a_batch: u32,
    a_head: u32,
    b_batch: u32,
    b_head: u32,
    c_batch: u32,
    c_head: u32,
    heads: u32,
    group: u32,
    alpha: f32,
    _pad: u32,
}

@group(0) @binding(14) var<uniform> mm: MatmulParams;

// Offsets of A, B and C in batch entry z = b·heads + h.
fn matmul_offsets(z: u32) -> vec3<u32> {
    let b = z / mm.heads;
    let h = z % mm.heads;
    return vec3<u32>(
        b * mm.a_batch + h * mm.a_head,
        b * mm.b_batch + (h / mm.group) * mm.b_head,
        b * mm.c_batch + h * mm.c_head,
    );
}

fn epilogue(row: u32, col: u32, acc: f32) -> f32 {
    if (EPILOGUE == 1u) {
        let s = cap_score(acc * params.scale);
        if (IS_MASKED && !band_allows(params.mask_offset, i32(params.q_start + row), i32(params.k_start + col))) {
            return NEG_BIG;
        }
        return s;
    }
    return acc * mm.alpha;
}


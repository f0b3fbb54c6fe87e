// Tiled matmul, the practical ceiling on GPUs and the engine of the naive
// baseline there (matmul_common.wgsl has the parameters and the epilogue).
// A workgroup of MW×MW invocations computes a 64×64 tile of C, each invocation
// an MT×MT block in registers (rows ty + MW·i, columns tx + MW·j, so
// neighbouring invocations read neighbouring words); K advances 16 at a time
// through workgroup memory. 16×16 invocations of 4×4 measured fastest on
// lavapipe too (1.84 GFLOP/s at N 2048, d 64, against 1.17 for 8×8 of 8×8
// and 0.73 for 4×4 of 16×16). ALIGNED variants (M, N multiples of 64, K of 16) carry no
// bounds checks.
//
// The composer prepends ALIGNED and matmul_common.wgsl.

const MW: u32 = 16u;
const MT: u32 = 4u;
const TM: u32 = 64u;
const TN: u32 = 64u;
const TK: u32 = 16u;

var<workgroup> a_tile: array<f32, TK * TM>; // [k][row]
var<workgroup> b_tile: array<f32, TK * TN>; // [k][col]

@compute @workgroup_size(MW, MW)
fn main(
    @builtin(local_invocation_id) lid: vec3<u32>,
    @builtin(local_invocation_index) tid: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let row0 = wg.y * TM;
    let col0 = wg.x * TN;
    let off = matmul_offsets(wg.z);
    let a_off = off.x;
    let b_off = off.y;
    let c_off = off.z;
    var acc = array<f32, MT * MT>();

    for (var k0 = 0u; k0 < mm.k; k0 += TK) {
        workgroupBarrier();
        // MW² invocations load 64×16 of A and of B between them.
        for (var e = tid; e < TK * TM; e += MW * MW) {
            let kk = e % TK;
            let rr = e / TK;
            var av = 0.0;
            if (ALIGNED || (row0 + rr < mm.m && k0 + kk < mm.k)) {
                av = load_a(a_off + (row0 + rr) * mm.lda + k0 + kk);
            }
            a_tile[kk * TM + rr] = av;
            var bv = 0.0;
            if (B_TRANS) {
                if (ALIGNED || (col0 + rr < mm.n && k0 + kk < mm.k)) {
                    bv = load_b(b_off + (col0 + rr) * mm.ldb + k0 + kk);
                }
                b_tile[kk * TN + rr] = bv;
            } else {
                let kr = e / TN;
                let cc = e % TN;
                if (ALIGNED || (col0 + cc < mm.n && k0 + kr < mm.k)) {
                    bv = load_b(b_off + (k0 + kr) * mm.ldb + col0 + cc);
                }
                b_tile[kr * TN + cc] = bv;
            }
        }
        workgroupBarrier();
        for (var kk = 0u; kk < TK; kk++) {
            var a = array<f32, MT>();
            var bb = array<f32, MT>();
            for (var i = 0u; i < MT; i++) {
                a[i] = a_tile[kk * TM + lid.y + MW * i];
                bb[i] = b_tile[kk * TN + lid.x + MW * i];
            }
            for (var i = 0u; i < MT; i++) {
                for (var j = 0u; j < MT; j++) {
                    acc[i * MT + j] += a[i] * bb[j];
                }
            }
        }
    }
    for (var i = 0u; i < MT; i++) {
        let row = row0 + lid.y + MW * i;
        for (var j = 0u; j < MT; j++) {
            let col = col0 + lid.x + MW * j;
            if (ALIGNED || (row < mm.m && col < mm.n)) {
                store_c(c_off + row * mm.ldc + col, epilogue(row, col, acc[i * MT + j]));
            }
        }
    }
    io_flush();
    check_loop_budget();
}

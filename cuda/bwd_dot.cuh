// The backward's first kernel, shared by flash_bwd.cu and flash_bwd_mma.cu
// (src/cuda/kernel.rs puts it before either): D = rowsum(dO * O) in f32,
// one row per thread, (batch, heads_q, seqlen_q) in lse order (a packed
// batch as its batch of one: no Layout field is read).
extern "C" __global__ void flash_bwd_dot(const storage_t* __restrict__ o,
                                         const storage_t* __restrict__ d_o,
                                         float* __restrict__ delta, const Problem p, int batch,
                                         const Layout L) {
    const size_t rows = (size_t)batch * p.heads_q * p.seqlen_q;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < rows;
         e += (size_t)gridDim.x * blockDim.x) {
        // e indexes (b, h, i) in lse order; o is (b, i, h, d).
        const int i = e % p.seqlen_q, h = (e / p.seqlen_q) % p.heads_q,
                  b = e / ((size_t)p.seqlen_q * p.heads_q);
        const size_t row = at(b, p.seqlen_q, i, p.heads_q, h, p.d);
        float s = 0.0f;
        for (int c = 0; c < p.d; ++c) s = fmaf(load_f32(o[row + c]), load_f32(d_o[row + c]), s);
        delta[e] = s;
    }
}

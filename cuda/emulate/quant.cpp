// Appended after host.h and the FP8 quantization's source (tests/cuda.rs):
// runs fp8_absmax then fp8_codes on the CPU over one tensor — the blobs of
// the file argv[1] (each a u64 length then its bytes): QuantArgs, the grid's
// blocks (an i32), x (f32 rows), the transform's signs — and writes the
// codes and the scales to argv[2] in the same framing, for tests/cuda.rs to
// hold against src/quant.rs's bit for bit.

int main(int argc, char** argv) {
    if (argc != 3) emulation_fault("usage: quant <inputs> <outputs>");
    auto blobs = read_blobs(argv[1], 4);
    QuantArgs a;
    int blocks;
    if (blobs[0].size() != sizeof a || blobs[1].size() != sizeof blocks) emulation_fault("QuantArgs or grid size");
    std::memcpy(&a, blobs[0].data(), sizeof a);
    std::memcpy(&blocks, blobs[1].data(), sizeof blocks);
    const float* x = (const float*)blobs[2].data();
    const float* signs = (const float*)blobs[3].data();
    const size_t heads = (size_t)(a.seqlen ? a.rows / a.seqlen : 0);
    std::vector<unsigned> absmax(heads, 0u);
    // NaN-filled and 0x7f (e4m3's NaN): anything the kernels fail to write shows.
    std::vector<float> scales(heads, NAN);
    std::vector<unsigned char> codes((size_t)a.rows * HEAD_DIM, 0x7f);
    const Dim grid{(unsigned)blocks, 1, 1};
    launch(grid, QUANT_THREADS, [&] { fp8_absmax(x, signs, absmax.data(), a); });
    launch(grid, QUANT_THREADS, [&] { fp8_codes(x, signs, absmax.data(), scales.data(), codes.data(), a); });
    std::ofstream out(argv[2], std::ios::binary);
    write_blob(out, codes.data(), codes.size());
    write_blob(out, scales.data(), scales.size() * 4);
    return out.good() ? 0 : 1;
}

// Appended after host.h and a decode variant's source (tests/cuda.rs):
// runs one decoding step's kernels — kv_append where the step appends,
// flash_decode over its splits, flash_decode_merge — on the CPU, with
// the inputs src/cuda/decode.rs's `emulated_step` computed (the blobs of
// the file argv[1], each a u64 length then its bytes, in its order), and
// writes o, lse and the cache's K, V (empty for a latent cache, whose V
// is read from K's blob) and scales after the step to argv[2]
// in the same framing. tests/cuda.rs judges them against the f64
// reference and the host's quantization rule.

template <class T>
static T* as(std::vector<unsigned char>& b) {
    return b.empty() ? nullptr : (T*)b.data();
}

int main(int argc, char** argv) {
    if (argc != 3) emulation_fault("usage: decode <inputs> <outputs>");
    auto blobs = read_blobs(argv[1], 14);
    Problem p;
    DecodeArgs a;
    if (blobs[0].size() != sizeof p || blobs[1].size() != sizeof a) emulation_fault("Problem or DecodeArgs size");
    std::memcpy(&p, blobs[0].data(), sizeof p);
    std::memcpy(&a, blobs[1].data(), sizeof a);
    const int* g = (const int*)blobs[2].data();
    const int ax = g[0], ay = g[1], az = g[2], dx = g[3], dy = g[4], splits = g[5], rows = g[6], heads = g[7];
    auto &q = blobs[3], &k_new = blobs[4], &v_new = blobs[5], &kc = blobs[6], &vc = blobs[7];
    auto &ks = blobs[8], &vs = blobs[9];
    // A latent cache has no V of its own: V is a view of K's storage, at
    // K's scales where quantized.
    cache_t* v_view = vc.empty() ? as<cache_t>(kc) : as<cache_t>(vc);
    float* v_scales = vs.empty() ? as<float>(ks) : as<float>(vs);
    a.cache_lens = as<int>(blobs[10]);
    a.pages = as<int>(blobs[11]);
    a.alibi = as<float>(blobs[12]);
    a.sinks = as<float>(blobs[13]);
    if (ax)
        launch(Dim{(unsigned)ax, (unsigned)ay, (unsigned)az}, DECODE_THREADS, [&] {
            kv_append(as<storage_t>(k_new), as<storage_t>(v_new), as<cache_t>(kc), as<cache_t>(vc), as<float>(ks),
                      as<float>(vs), p, a);
        });
    const size_t parts = (size_t)splits * rows * heads;
    // NaN-filled: a partial the kernel fails to write shows in the merge.
    std::vector<float> part_o(parts * a.d_v, NAN), part_lse(parts, NAN);
    launch(Dim{(unsigned)dx, (unsigned)dy, (unsigned)splits}, DECODE_THREADS, [&] {
        flash_decode(as<storage_t>(q), as<cache_t>(kc), v_view, as<float>(ks), v_scales, part_o.data(),
                     part_lse.data(), p, a);
    });
    std::vector<storage_t> o((size_t)rows * heads * a.d_v);
    std::vector<float> lse((size_t)rows * heads, NAN);
    launch(Dim{(unsigned)rows, (unsigned)heads, 1}, DECODE_THREADS,
           [&] { flash_decode_merge(part_o.data(), part_lse.data(), o.data(), lse.data(), p, a, splits); });
    std::ofstream out(argv[2], std::ios::binary);
    write_blob(out, o.data(), o.size() * sizeof(storage_t));
    write_blob(out, lse.data(), lse.size() * 4);
    for (auto* b : {&kc, &vc, &ks, &vs}) write_blob(out, b->data(), b->size());
    return out.good() ? 0 : 1;
}

// Appended after host.h and a kernel variant's source (tests/cuda.rs):
// runs the variant's kernels under host emulation on small problems (GQA,
// a head dim below the compiled one, lengths off the tiles, rows with no
// allowed key) and then, where LAYOUT_CASES is 1 (tests/cuda.rs's
// choice), the run-time layouts (ALiBi, sinks, a block mask with the tile
// lists the kernels walk, a packed batch, all at once), and compares them with attention computed here in double, with its own
// mask, bias, sink and tile rules; the dropout variants draw every case's mask too, and the reference takes the same
// one (cuda/philox.cuh's keep bit, tested against the Rust mask bit for bit by tests/dropout.rs). Exit status 1 on
// a mismatch. `mask` prints the mask the kernels imply instead (implied_mask below).

static unsigned long long rng_state = 0x9e3779b97f4a7c15ull;
static float uniform() {  // in [-1, 1)
    rng_state = rng_state * 6364136223846793005ull + 1442695040888963407ull;
    return (float)((rng_state >> 40) & 0xffffff) / 8388608.0f - 1.0f;
}

struct Data {
    std::vector<storage_t> stored;
    std::vector<float> value;  // the stored values, widened
};
static Data random_data(size_t n, float amplitude) {
    Data t;
    for (size_t e = 0; e < n; ++e) {
        t.stored.push_back(store_f32(amplitude * uniform()));
        t.value.push_back(load_f32(t.stored.back()));
    }
    return t;
}

static double max_abs(const std::vector<double>& x) {
    double m = 0;
    for (double v : x) m = std::max(m, std::fabs(v));
    return m;
}

// |got - ref| relative to max|ref|, or a huge number on NaN.
static double rel_error(const std::vector<float>& got, const std::vector<double>& ref) {
    double m = 0;
    for (size_t e = 0; e < ref.size(); ++e) {
        if (std::isnan(got[e])) return 1e30;
        m = std::max(m, std::fabs(got[e] - ref[e]));
    }
    return m / std::max(1e-30, max_abs(ref));
}

template <class T>
static std::vector<float> widen(const std::vector<T>& x) {
    std::vector<float> out;
    for (T v : x) out.push_back(load_f32(v));
    return out;
}

#if IS_WGMMA
// src/cuda/tensor_map.rs's rule: a (batch, seqlen, heads, d) tensor as
// (d, heads, seqlen, batch), innermost first, in boxes of 64 columns × 1
// head × rows × 1 batch entry (TMA needs rows of whole 16-byte units).
static TensorMap tensor_map(const storage_t* base, int batch, int seqlen, int heads, int d, int rows) {
    if (d % 8) emulation_fault("a tensor map needs d % 8 == 0");
    const uint64_t row = (uint64_t)d * sizeof(storage_t);
    const EmuTensorMap t{(const unsigned char*)base,
                         {(uint64_t)d, (uint64_t)heads, (uint64_t)seqlen, (uint64_t)batch},
                         {row, row * heads, row * heads * seqlen},
                         {64, 1, (uint32_t)rows, 1},
                         (uint32_t)sizeof(storage_t)};
    TensorMap m{};
    std::memcpy(m.opaque, &t, sizeof t);
    return m;
}
#endif

// One problem: dense batches of two (sq x sk each) unless lens_q/lens_k
// give a packed batch; the window applies where the variant has a band.
struct Case {
    const char* name;
    int sq, sk, left, right, d;
    bool alibi = false, alibi_per_batch = false, sinks = false;
    int bm = 0, bn = 0;            // a block mask of these blocks (0: none)
    bool mask_per_head = false, mask_per_batch = false;
    double density = 0.5;
    std::vector<int> lens_q, lens_k;  // a packed batch's lengths
    bool negative_scale = false;      // -1/sqrt(d) (the sm80 forward folds the sign into Q)
    int batch = 2;                    // dense batch entries
    int hq = 4, hkv = 2;              // query and key/value heads
    float amplitude = 2.0f;           // q and k uniform in [-amplitude, amplitude)
    // The persistent Hopper forward's blocks: fewer than its items, so each
    // takes several (its ring and barrier phases carried across them).
    int ctas = 3;
    // A shard of a longer sequence: the diagonal moved this far past the
    // bottom-right one (Problem::shift; q_offset - k_offset - (sk - sq)).
    int shift = 0;
};


#if IS_FP8
// The FP8 Hopper forward (IS_FP8): e4m3 codes of q, k, v (a row of
// HEAD_DIM codes, zeros past the case's d) with one positive f32 scale per
// (batch entry, head), one q head and (where there are two) one v head of
// scale 0 with zero codes; against attention in double on the dequantized values. lse by the
// accuracy rule (P's rounding never reaches it: the row sum is kept from
// the unrounded P), against twice an f32 naive LSE's error; o by FP8's rule:
// RMSE(o - exact) <= 1.1 RMSE(naive - exact) + 1e-7 max|exact|, `naive`
// the double computation with P = exp(s - the final row max) rounded as
// round_p (e4m3(p · 448) / 448), l from the unrounded P.
static TensorMap code_map(const unsigned char* base, int batch, int seqlen, int heads, int rows) {
    const uint64_t row = HEAD_DIM;
    const EmuTensorMap t{base,
                         {(uint64_t)HEAD_DIM, (uint64_t)heads, (uint64_t)seqlen, (uint64_t)batch},
                         {row, row * heads, row * heads * seqlen},
                         {HEAD_DIM, 1, (uint32_t)rows, 1},
                         1};
    TensorMap m{};
    std::memcpy(m.opaque, &t, sizeof t);
    return m;
}
static float e4m3(unsigned code) { return host_e4m3_to_f32(code); }

static int run_fp8(const Case& cs) {
    const int HQ = cs.hq, HKV = cs.hkv, group = HQ / HKV, d = cs.d, B = cs.batch, sq = cs.sq, sk = cs.sk;
    const int left = HAS_BAND ? cs.left : -1, right = HAS_BAND ? cs.right : -1;
    const Problem p{sq, sk, HQ, HKV, d, 1.0f / std::sqrt((float)d), HAS_SOFTCAP ? 5.0f : 0.0f, left, right, cs.shift};
    // Codes of uniform values in (-448, 448) (never 0x7f/0xff), zero past d;
    // scales in [0.5, 1) · amplitude / 448, 0 (and zero codes) for `zero_head`.
    auto codes = [&](int seqlen, int heads, int zero_b, int zero_h, std::vector<float>& scales) {
        std::vector<unsigned char> c((size_t)B * seqlen * heads * HEAD_DIM, 0);
        scales.assign((size_t)B * heads, 0.0f);
        for (int b = 0; b < B; ++b)
            for (int h = 0; h < heads; ++h)
                if (!(b == zero_b && h == zero_h))
                    scales[b * heads + h] = cs.amplitude / 448.0f * (0.75f + 0.25f * uniform());
        for (size_t r = 0; r < c.size() / HEAD_DIM; ++r) {
            const int h = (int)(r % heads), b = (int)(r / heads / seqlen);
            for (int x = 0; x < d; ++x)
                c[r * HEAD_DIM + x] = scales[b * heads + h] == 0.0f ? 0 : host_e4m3_from_f32(447.0f * uniform());
        }
        return c;
    };
    std::vector<float> qs, ks, vs;
    const std::vector<unsigned char> q = codes(sq, HQ, 0, 0, qs), k = codes(sk, HKV, -1, -1, ks),
                                     v = codes(sk, HKV, B * HKV > 1 ? B - 1 : -1, HKV - 1, vs);
    auto val = [&](const std::vector<unsigned char>& c, const std::vector<float>& sc, int seqlen, int heads, int b,
                   int i, int h, int x) {
        return (double)e4m3(c[(((size_t)b * seqlen + i) * heads + h) * HEAD_DIM + x]) * sc[b * heads + h];
    };
    const size_t o_size = (size_t)B * sq * HQ * HEAD_DIM, lse_size = (size_t)B * HQ * sq;
    std::vector<double> exact(o_size, 0.0), naive(o_size, 0.0), lse_ref(lse_size);
    std::vector<float> lse_f32(lse_size);
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < HQ; ++h)
            for (int i = 0; i < sq; ++i) {
                const int hk = h / group, off = sk - sq + cs.shift;
                std::vector<double> s(sk);
                std::vector<float> s32(sk);
                std::vector<bool> ok(sk);
                double m = -INFINITY;
                float m32 = -INFINITY;
                for (int j = 0; j < sk; ++j) {
                    ok[j] = !(right >= 0 && j > i + off + right) && !(left >= 0 && j < i + off - left);
                    if (!ok[j]) continue;
                    double dot = 0;
                    float dot32 = 0;
                    for (int x = 0; x < d; ++x) {
                        const double a = val(q, qs, sq, HQ, b, i, h, x), c = val(k, ks, sk, HKV, b, j, hk, x);
                        dot += a * c;
                        dot32 += (float)a * (float)c;
                    }
                    s[j] = dot * p.scale;
                    s32[j] = dot32 * p.scale;
                    if (HAS_SOFTCAP) {
                        s[j] = p.softcap * std::tanh(s[j] / p.softcap);
                        s32[j] = p.softcap * std::tanh(s32[j] / p.softcap);
                    }
                    m = std::max(m, s[j]);
                    m32 = std::max(m32, s32[j]);
                }
                double l = 0;
                float l32 = 0;
                for (int j = 0; j < sk; ++j)
                    if (ok[j]) l += std::exp(s[j] - m), l32 += std::exp(s32[j] - m32);
                const size_t li = ((size_t)b * HQ + h) * sq + i;
                lse_ref[li] = l > 0 ? m + std::log(l) : -INFINITY;
                lse_f32[li] = l32 > 0 ? m32 + std::log(l32) : -INFINITY;
                if (l == 0) continue;
                const size_t oi = (((size_t)b * sq + i) * HQ + h) * HEAD_DIM;
                for (int j = 0; j < sk; ++j) {
                    if (!ok[j]) continue;
                    const double e = std::exp(s[j] - m);
                    const double rounded = e4m3(host_e4m3_from_f32((float)e * 448.0f)) / 448.0;
                    for (int x = 0; x < d; ++x) {
                        const double vv = val(v, vs, sk, HKV, b, j, hk, x);
                        exact[oi + x] += e / l * vv;
                        naive[oi + x] += rounded / l * vv;
                    }
                }
            }
    // Rows past the outputs' ends hold a mark: a block that writes there fails.
    std::vector<float> o(o_size + (size_t)BLOCK_M * HQ * HEAD_DIM, 7.0f), lse(lse_size + BLOCK_M, 7.0f);
    std::fill(o.begin(), o.begin() + o_size, 0.0f);
    std::fill(lse.begin(), lse.begin() + lse_size, 0.0f);
    const TensorMap tq = code_map(q.data(), B, sq, HQ, BLOCK_M), tk = code_map(k.data(), B, sk, HKV, BLOCK_N),
                    tv = code_map(v.data(), B, sk, HKV, BLOCK_N);
    const Layout L{};
    const int m_blocks = (sq + BLOCK_M - 1) / BLOCK_M;
    const Work work{m_blocks, B, HQ * B, m_blocks * HQ * B};
    launch(Dim{std::min((unsigned)cs.ctas, (unsigned)work.items), 1, 1}, BLOCK_THREADS,
           [&] { flash_fwd(tq, tk, tv, o.data(), lse.data(), qs.data(), ks.data(), vs.data(), p, L, work); },
           SMEM_BYTES);
    bool past_end = false;
    for (size_t e = o_size; e < o.size(); ++e) past_end = past_end || o[e] != 7.0f;
    for (size_t e = lse_size; e < lse.size(); ++e) past_end = past_end || lse[e] != 7.0f;
    double se = 0, se_naive = 0, max_exact = 0, lse_err = 0, lse_base = 0, max_lse = 0;
    bool nan = false;
    for (size_t e = 0; e < o_size; ++e) {
        nan = nan || !std::isfinite(o[e]);
        se += (o[e] - exact[e]) * (o[e] - exact[e]);
        se_naive += (naive[e] - exact[e]) * (naive[e] - exact[e]);
        max_exact = std::max(max_exact, std::fabs(exact[e]));
    }
    for (size_t e = 0; e < lse_size; ++e) {
        if (std::isinf(lse_ref[e])) {
            if (!(std::isinf(lse[e]) && lse[e] < 0)) lse_err = 1e30;  // empty rows: exactly -inf
            continue;
        }
        if (std::isnan(lse[e])) lse_err = 1e30;
        lse_err = std::max(lse_err, std::fabs(lse[e] - lse_ref[e]));
        lse_base = std::max(lse_base, std::fabs(lse_f32[e] - lse_ref[e]));
        max_lse = std::max(max_lse, std::fabs(lse_ref[e]));
    }
    const double rmse = std::sqrt(se / o_size), rmse_naive = std::sqrt(se_naive / o_size);
    const double o_tol = 1.1 * rmse_naive + 1e-7 * max_exact;
    const double lse_tol = 2 * lse_base + 2 * std::ldexp(1.0, std::ilogb(std::max(max_lse, 1e-30)) - 23) +
                           1e-5 * std::max(1.0, max_lse);
    std::printf("%-8s sq %d sk %d window (%d, %d) d %d hq %d hkv %d: o RMSE %.3g (naive %.3g, tolerance %.3g), "
                "lse max error %.3g (tolerance %.3g)%s%s\n",
                cs.name, sq, sk, left, right, d, HQ, HKV, rmse, rmse_naive, o_tol, lse_err, lse_tol,
                nan ? ", o not finite" : "", past_end ? ", rows written past the outputs' end" : "");
    return (nan || past_end || !(rmse <= o_tol) || !(lse_err <= lse_tol)) ? 1 : 0;
}

// cuda/hopper.cuh's e4m3 wrappers against plain products, on one
// warpgroup: A (64 x 64 codes) and B (128 x 64) TMA-loaded (1-byte
// elements) and S = A B^T by two k32 steps from descriptors; then D = P B'
// with P (64 x 32) from registers packed by pack4_e4m3 in the documented
// fragment layout and B' (128 x 32, K-major) by descriptor. Small integers,
// exact in e4m3 and in f32 sums: every entry must equal the product.
static int fp8_self_test() {
    auto a = [](int r, int c) { return (float)((r * 7 + c * 3) % 9 - 4); };
    auto b = [](int n, int k) { return (float)((n * 5 + k * 2) % 7 - 3); };
    auto pm = [](int r, int k) { return (float)((r * 3 + k * 5) % 5 - 2); };
    std::vector<unsigned char> ga(64 * HEAD_DIM, 0), gb(128 * HEAD_DIM, 0);
    for (int e = 0; e < 64 * 64; ++e) ga[(e / 64) * HEAD_DIM + e % 64] = host_e4m3_from_f32(a(e / 64, e % 64));
    for (int e = 0; e < 128 * 64; ++e) gb[(e / 64) * HEAD_DIM + e % 64] = host_e4m3_from_f32(b(e / 64, e % 64));
    const TensorMap ta = code_map(ga.data(), 1, 64, 1, 64), tb = code_map(gb.data(), 1, 128, 1, 128);
    std::vector<int> bad(128, 0);
    launch(
        Dim{1, 1, 1}, 128,
        [&] {
            unsigned char* s = host_dynamic_smem();
            unsigned char *sa = s, *sb = s + 64 * 128;
            const Bar bar = bar_at(sb + 128 * 128);
            if (threadIdx.x == 0) {
                mbar_init(bar, 1);
                mbar_arrive_expect_tx(bar, (64 + 128) * 128);
                tma_load_4d(sa, &ta, 0, 0, 0, 0, bar);
                tma_load_4d(sb, &tb, 0, 0, 0, 0, bar);
            }
            __syncthreads();
            mbar_wait(bar, 0, 0);
            const int lane = threadIdx.x % 32, t = lane % 4, r0 = threadIdx.x / 32 * 16 + lane / 4;
            float sacc[64], dacc[64] = {};
            wgmma_fence();
            for (int ks = 0; ks < 2; ++ks)
                wgmma_ss_e4m3<128>(sacc, smem_desc(sa + ks * 32, 16, 1024), smem_desc(sb + ks * 32, 16, 1024), ks > 0);
            wgmma_commit();
            // Lane 4g + t: a[0] row g, k 4t..4t+3; a[1] row g + 8; a[2], a[3] at k + 16.
            unsigned frag[4];
            for (int x = 0; x < 4; ++x) {
                const int r = r0 + 8 * (x % 2), k = 4 * t + 16 * (x / 2);
                frag[x] = pack4_e4m3(pm(r, k), pm(r, k + 1), pm(r, k + 2), pm(r, k + 3));
            }
            wgmma_fence();
            wgmma_rs_e4m3<128>(dacc, frag, smem_desc(sb + 32, 16, 1024));
            wgmma_commit();
            wgmma_wait<0>();
            for (int i = 0; i < 64; ++i) {
                const int row = r0 + 8 * ((i % 4) / 2), col = 8 * (i / 4) + 2 * t + i % 2;
                float want = 0, want_d = 0;
                for (int k = 0; k < 64; ++k) want += a(row, k) * b(col, k);
                for (int k = 0; k < 32; ++k) want_d += pm(row, k) * b(col, 32 + k);
                bad[threadIdx.x] += (sacc[i] != want) + (dacc[i] != want_d);
            }
        },
        SMEM_BYTES);
    int total = 0;
    for (int x : bad) total += x;
    std::printf("wgmma e4m3 + TMA (64x128 S from descriptors, k32 x 2; 64x128 D from register A): %d of %d "
                "entries wrong\n",
                total, 128 * 128);
    return total ? 1 : 0;
}
#endif

#ifdef BLOCK_N
#define INNER BLOCK_N
#else
#define INNER BLOCK
#endif

// The forward kernel for head dim d: the sm80 module has one of its own
// where d % 8 != 0 (src/cuda/forward.rs picks it the same way).
#ifdef FORWARD_UNALIGNED_ENTRY
#define FORWARD_FOR(d) ((d) % 8 == 0 ? flash_fwd : flash_fwd_unaligned)
#else
#define FORWARD_FOR(d) flash_fwd
#endif

// The kernels' Dropout of (p, seed, offset), as src/cuda/problem.rs makes it.
static Dropout dropout_args(double p, unsigned long long seed, unsigned long long offset) {
    return Dropout{(unsigned)seed, (unsigned)(seed >> 32), (unsigned)offset, (unsigned)(offset >> 32),
                   (unsigned)std::llround((double)(float)p * 65536.0), (float)(1.0 / (1.0 - (double)(float)p))};
}

// Whether pair (i, j) of sequence b, query head h of `heads` is kept under D.
static bool keeps(const Dropout& D, int heads, int b, int h, int i, int j) {
    const unsigned long long stream = ((unsigned long long)D.stream1 << 32 | D.stream0) + (unsigned long long)b * heads + h;
    return dropout_keeps(D.key0, D.key1, (unsigned)stream, (unsigned)(stream >> 32), D.threshold, i, j);
}

// The dropout variants' cases: p = 0.3, and an offset whose low word carries
// into the high one within the problem's streams.
static const double case_p = HAS_DROPOUT ? 0.3 : 0.0;
static const Dropout case_dropout = HAS_DROPOUT ? dropout_args(case_p, 0x9e3779b97f4a7c15ull, 0xfffffffdull) : Dropout{};

static int run(const Case& cs) {
#if IS_FP8
    return run_fp8(cs);
#else
    const int HQ = cs.hq, HKV = cs.hkv, group = HQ / HKV, d = cs.d;
    const bool packed = !cs.lens_q.empty();
    const int B = packed ? (int)cs.lens_q.size() : cs.batch;
    const int left = HAS_BAND ? cs.left : -1, right = HAS_BAND ? cs.right : -1;
    // Each sequence's first rows and lengths in the flat (rows, heads, d) tensors.
    std::vector<int> q0(B), k0(B), lq(B), lk(B);
    int total_q = 0, total_k = 0, max_q = 0, max_k = 0;
    for (int b = 0; b < B; ++b) {
        lq[b] = packed ? cs.lens_q[b] : cs.sq;
        lk[b] = packed ? cs.lens_k[b] : cs.sk;
        q0[b] = total_q;
        k0[b] = total_k;
        total_q += lq[b];
        total_k += lk[b];
        max_q = std::max(max_q, lq[b]);
        max_k = std::max(max_k, lk[b]);
    }
    Problem p{packed ? total_q : cs.sq, packed ? total_k : cs.sk, HQ, HKV, d,
              (cs.negative_scale ? -1.0f : 1.0f) / std::sqrt((float)d), HAS_SOFTCAP ? 5.0f : 0.0f, left, right,
              cs.shift};
    Data q = random_data((size_t)total_q * HQ * d, cs.amplitude),
         k = random_data((size_t)total_k * HKV * d, cs.amplitude),
         v = random_data((size_t)total_k * HKV * d, 1.0f), d_o = random_data((size_t)total_q * HQ * d, 1.0f);

    // The layouts' inputs.
    std::vector<float> slopes(cs.alibi_per_batch ? B * HQ : HQ), sinks(HQ);
    for (size_t e = 0; e < slopes.size(); ++e) slopes[e] = 0.05f + 0.11f * (float)(e % 7);
    for (int h = 0; h < HQ; ++h) sinks[h] = -1.5f + 1.1f * (float)h;
    const int mrows = cs.bm ? (max_q + cs.bm - 1) / cs.bm : 0, mcols = cs.bn ? (max_k + cs.bn - 1) / cs.bn : 0;
    const int mb = cs.mask_per_batch ? B : 1, mh = cs.mask_per_head ? HQ : 1;
    std::vector<unsigned char> mask((size_t)mb * mh * mrows * mcols);
    for (auto& x : mask) x = (uniform() + 1.0) / 2.0 < cs.density;
    std::vector<int> cu_q(B + 1, total_q), cu_k(B + 1, total_k);
    for (int b = 0; b < B; ++b) cu_q[b] = q0[b], cu_k[b] = k0[b];

    // What the reference allows, scores and sinks: docs/semantics.md in double.
    auto allows = [&](int b, int h, int i, int j) {
        const int off = lk[b] - lq[b] + cs.shift;
        if (i < 0 || i >= lq[b] || j < 0 || j >= lk[b]) return false;
        if (right >= 0 && j > i + off + right) return false;
        if (left >= 0 && j < i + off - left) return false;
        if (!cs.bm) return true;
        const size_t g = ((size_t)(mb > 1 ? b : 0) * mh + (mh > 1 ? h : 0)) * mrows * mcols;
        return mask[g + (size_t)(i / cs.bm) * mcols + j / cs.bn] != 0;
    };
    auto slope_of = [&](int b, int h) { return cs.alibi ? (double)slopes[cs.alibi_per_batch ? b * HQ + h : h] : 0.0; };
    auto lse_index = [&](int b, int h, int i) {
        return packed ? (size_t)h * total_q + q0[b] + i : ((size_t)b * HQ + h) * cs.sq + i;
    };
    auto qi = [&](int b, int i, int h) { return (((size_t)q0[b] + i) * HQ + h) * d; };
    auto kj = [&](int b, int j, int h) { return (((size_t)k0[b] + j) * HKV + h) * d; };
    const Dropout drop = case_dropout;
    // P·V's factor of a pair: keep / (1 - p), 1 without dropout.
    auto factor = [&](int b, int h, int i, int j) {
        return HAS_DROPOUT ? (keeps(drop, HQ, b, h, i, j) ? 1.0 / (1.0 - case_p) : 0.0) : 1.0;
    };

    std::vector<double> o_ref(q.value.size(), 0.0), lse_ref((size_t)HQ * total_q);
    std::vector<double> dq_ref(q.value.size(), 0.0), dk_ref(k.value.size(), 0.0), dv_ref(v.value.size(), 0.0);
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < HQ; ++h)
            for (int i = 0; i < lq[b]; ++i) {
                const int hk = h / group, off = lk[b] - lq[b] + cs.shift;
                std::vector<double> s(lk[b]), cap(lk[b], 1.0);
                std::vector<bool> ok(lk[b]);
                double m = cs.sinks ? (double)sinks[h] : -INFINITY;
                for (int j = 0; j < lk[b]; ++j) {
                    ok[j] = allows(b, h, i, j);
                    if (!ok[j]) continue;
                    double dot = 0;
                    for (int c = 0; c < d; ++c) dot += (double)q.value[qi(b, i, h) + c] * k.value[kj(b, j, hk) + c];
                    s[j] = dot * p.scale;
                    if (HAS_SOFTCAP) {
                        const double t = std::tanh(s[j] / p.softcap);
                        s[j] = p.softcap * t;
                        cap[j] = 1 - t * t;
                    }
                    s[j] -= slope_of(b, h) * std::abs(i + off - j);
                    m = std::max(m, s[j]);
                }
                double l = cs.sinks ? std::exp(sinks[h] - m) : 0.0;
                for (int j = 0; j < lk[b]; ++j)
                    if (ok[j]) l += std::exp(s[j] - m);
                const double lse = l > 0 ? m + std::log(l) : -INFINITY;
                lse_ref[lse_index(b, h, i)] = lse;
                if (l == 0) continue;
                for (int j = 0; j < lk[b]; ++j)
                    if (ok[j])
                        for (int c = 0; c < d; ++c)
                            o_ref[qi(b, i, h) + c] += std::exp(s[j] - lse) * factor(b, h, i, j) * v.value[kj(b, j, hk) + c];
                if (IS_FORWARD) continue;  // the gradients' reference only for the backward
                double D = 0;
                for (int c = 0; c < d; ++c) D += o_ref[qi(b, i, h) + c] * d_o.value[qi(b, i, h) + c];
                for (int j = 0; j < lk[b]; ++j) {
                    if (!ok[j]) continue;
                    const double P = std::exp(s[j] - lse);
                    double dP = 0;
                    for (int c = 0; c < d; ++c) dP += (double)d_o.value[qi(b, i, h) + c] * v.value[kj(b, j, hk) + c];
                    const double f = factor(b, h, i, j);
                    const double dS = P * (dP * f - D) * cap[j] * p.scale;
                    for (int c = 0; c < d; ++c) {
                        dq_ref[qi(b, i, h) + c] += dS * k.value[kj(b, j, hk) + c];
                        dk_ref[kj(b, j, hk) + c] += dS * q.value[qi(b, i, h) + c];
                        dv_ref[kj(b, j, hk) + c] += P * f * d_o.value[qi(b, i, h) + c];
                    }
                }
            }

    // The tile lists of a launch whose blocks own `outer` rows (queries, or
    // keys when by_keys) and stream `inner` of the other side: per
    // (sequence, list head, outer tile) the inner tiles with an allowed
    // pair, found pair by pair, flagged partial where a pair the band
    // allows is masked. dK/dV's lists are per kv head, (query head of the
    // group, query tile) in order.
    struct Lists {
        std::vector<int> starts, entries;
        int heads, outer_tiles;
    };
    auto lists = [&](int outer, int inner, bool by_keys) {
        Lists t;
        t.heads = by_keys ? HKV : mh;
        t.outer_tiles = ((by_keys ? max_k : max_q) + outer - 1) / outer;
        for (int b = 0; b < B; ++b)
            for (int lh = 0; lh < t.heads; ++lh)
                for (int o = 0; o < t.outer_tiles; ++o) {
                    t.starts.push_back((int)t.entries.size());
                    for (int g = 0; g < (by_keys ? group : 1); ++g) {
                        const int h = by_keys ? lh * group + g : lh;
                        const int n_inner = ((by_keys ? lq[b] : lk[b]) + inner - 1) / inner;
                        for (int n = 0; n < n_inner; ++n) {
                            bool any = false, all = true;
                            for (int x = o * outer; x < (o + 1) * outer; ++x)
                                for (int y = n * inner; y < (n + 1) * inner; ++y) {
                                    const int i = by_keys ? y : x, j = by_keys ? x : y;
                                    if (i >= lq[b] || j >= lk[b]) continue;
                                    const int off = lk[b] - lq[b] + cs.shift;
                                    const bool band =
                                        (right < 0 || j <= i + off + right) && (left < 0 || j >= i + off - left);
                                    if (!band) continue;
                                    if (allows(b, h, i, j)) any = true; else all = false;
                                }
                            if (any) t.entries.push_back(n | g << TILE_HEAD_SHIFT | (all ? 0 : TILE_PARTIAL));
                        }
                    }
                }
        t.starts.push_back((int)t.entries.size());
        t.entries.push_back(0);  // never read: an empty list still has a pointer (null is "no mask")
        return t;
    };
    auto layout = [&](const Lists& t) {
        Layout L{};
        if (cs.alibi) L.alibi = slopes.data(), L.alibi_batch_stride = cs.alibi_per_batch ? HQ : 0;
        if (cs.sinks) L.sinks = sinks.data();
        if (packed) L.cu_q = cu_q.data(), L.cu_k = cu_k.data();
        if (cs.bm) {
            L.mask = mask.data();
            L.bm = cs.bm, L.bn = cs.bn, L.mask_rows = mrows, L.mask_cols = mcols;
            L.mask_head_stride = mh > 1 ? mrows * mcols : 0;
            L.mask_batch_stride = mb > 1 ? mh * mrows * mcols : 0;
            L.tile_starts = t.starts.data();
            L.tile_entries = t.entries.data();
            L.list_head_stride = t.heads > 1 ? t.outer_tiles : 0;
            L.list_batch_stride = t.heads * t.outer_tiles;
        }
        return L;
    };

    // About two units of the storage precision's rounding at max|ref|.
    const double tol = STORAGE == 0 ? 2e-5 : STORAGE == 1 ? 2e-3 : 1.6e-2;
    auto report = [&](const char* what, double err) {
        std::printf("%-8s sq %d sk %d window (%d, %d) d %d %s: max error %.3g of max|ref| (tolerance %.3g)\n", cs.name,
                    max_q, max_k, left, right, d, what, err, tol);
        return err <= tol ? 0 : 1;
    };
    int failed = 0;
    auto blocks = [](int n) { return (unsigned)std::max(1, (n + BLOCK_ROWS - 1) / BLOCK_ROWS); };
#if IS_FORWARD
    const Lists fl = lists(BLOCK_ROWS, INNER, false);
    const Layout L = layout(fl);
    // A tile's rows past the outputs' ends, holding a mark: a block that
    // writes rows past its (last) sequence's end writes there.
    const size_t o_size = q.stored.size(), lse_size = lse_ref.size();
    const storage_t mark = store_f32(7.0f);
    std::vector<storage_t> o(o_size + (size_t)BLOCK_ROWS * HQ * d, mark);
    std::vector<float> lse(lse_size + BLOCK_ROWS, 7.0f);
    std::fill(o.begin(), o.begin() + o_size, store_f32(0.0f));
    std::fill(lse.begin(), lse.begin() + lse_size, 0.0f);
#if IS_WGMMA
    // A packed batch's maps span the packed tensor, a batch of one (src/cuda/forward.rs's rule).
    const int map_b = packed ? 1 : B;
    const TensorMap tq = tensor_map(q.stored.data(), map_b, p.seqlen_q, HQ, d, BLOCK_M),
                    tk = tensor_map(k.stored.data(), map_b, p.seqlen_k, HKV, d, BLOCK_N),
                    tv = tensor_map(v.stored.data(), map_b, p.seqlen_k, HKV, d, BLOCK_N),
                    to = tensor_map(o.data(), map_b, p.seqlen_q, HQ, d, BLOCK_M / 2);  // a consumer's rows
    const Work work{(int)blocks(max_q), B, HQ * B, (int)blocks(max_q) * HQ * B};
    launch(Dim{std::min((unsigned)cs.ctas, (unsigned)work.items), 1, 1}, BLOCK_THREADS,
           [&] { flash_fwd(tq, tk, tv, to, o.data(), lse.data(), p, L, work); }, SMEM_BYTES);
#else
    launch(Dim{blocks(max_q), (unsigned)HQ, (unsigned)B}, BLOCK_THREADS,
           [&] { FORWARD_FOR(p.d)(q.stored.data(), k.stored.data(), v.stored.data(), o.data(), lse.data(), p, L, drop); },
           SMEM_BYTES);
#endif
    bool past_end = false;
    for (size_t e = o_size; e < o.size(); ++e) past_end = past_end || load_f32(o[e]) != 7.0f;
    for (size_t e = lse_size; e < lse.size(); ++e) past_end = past_end || lse[e] != 7.0f;
    if (past_end) std::printf("%-8s rows written past the outputs' end\n", cs.name);
    failed += past_end;
    o.resize(o_size), lse.resize(lse_size);
    failed += report("o", rel_error(widen(o), o_ref));
    double lse_err = 0;
    for (size_t e = 0; e < lse.size(); ++e) {
        if (std::isinf(lse_ref[e])) {
            if (!(std::isinf(lse[e]) && lse[e] < 0)) lse_err = 1e30;  // empty rows: exactly -inf
        } else {
            lse_err = std::max(lse_err, std::fabs(lse[e] - lse_ref[e]));
        }
    }
    failed += report("lse (absolute)", lse_err);
#else
    // The backward from the reference's o (in storage) and lse.
    std::vector<storage_t> o_st;
    for (double x : o_ref) o_st.push_back(store_f32((float)x));
    std::vector<float> lse(lse_ref.begin(), lse_ref.end()), delta(lse.size());
    std::vector<storage_t> dq(q.stored.size()), dk(k.stored.size()), dv(v.stored.size());
    // (The Hopper dQ walks key tiles of a dK/dV block's keys.)
    const Lists kl = lists(BLOCK_ROWS, INNER, true), ql = lists(BLOCK_ROWS, IS_WGMMA ? BLOCK_ROWS : INNER, false);
    const Layout Lk = layout(kl), Lq = layout(ql);
    launch(Dim{1, 1, 1}, 256,
           [&] { flash_bwd_dot(o_st.data(), d_o.stored.data(), delta.data(), p, packed ? 1 : B, Lq); });
#if IS_WGMMA
    // The Hopper dK/dV, which at d 64 adds dQ's partials into an f32
    // workspace in key-block order (blocks in index order, as the hardware
    // starts them), then dq from it (at d 128 flash_bwd_dq_wgmma's, from
    // the same maps): q and dO in boxes of a step's queries, k and v of
    // the block's keys; a packed batch's maps span the packed tensor. Twice:
    // the second dq must be the first's bits.
    const int map_b = packed ? 1 : B;
    const TensorMap tq = tensor_map(q.stored.data(), map_b, p.seqlen_q, HQ, d, BLOCK_N),
                    tdo = tensor_map(d_o.stored.data(), map_b, p.seqlen_q, HQ, d, BLOCK_N),
                    tk = tensor_map(k.stored.data(), map_b, p.seqlen_k, HKV, d, BLOCK_M),
                    tv = tensor_map(v.stored.data(), map_b, p.seqlen_k, HKV, d, BLOCK_M);
    const size_t q_rows = q.stored.size() / ((size_t)HQ * d);
    std::vector<storage_t> first;
    for (int repeat = 0; repeat < 2; ++repeat) {
        std::vector<float> dq_accum(q.stored.size(), 0.0f);
        std::vector<int> sems((q_rows / BLOCK_N + B + 1) * HQ * 2, 0);
        launch(
            Dim{blocks(max_k), (unsigned)HKV, (unsigned)B}, BLOCK_THREADS,
            [&] {
                flash_bwd_dkdv(tq, tk, tv, tdo, lse.data(), delta.data(), dk.data(), dv.data(),
                               HAS_DQ ? dq_accum.data() : nullptr, HAS_DQ ? sems.data() : nullptr, p, Lk);
            },
            SMEM_BYTES, true);
        if (HAS_DQ)
            launch(Dim{4, 1, 1}, 64,
                   [&] { flash_bwd_dq_convert(dq_accum.data(), dq.data(), p.scale, dq_accum.size()); });
        else
            launch(
                Dim{blocks(max_q), (unsigned)HQ, (unsigned)B}, BLOCK_THREADS,
                [&] { flash_bwd_dq_wgmma(tq, tk, tv, tdo, lse.data(), delta.data(), dq.data(), p, Lq); },
                SMEM_BYTES, true);
        if (repeat == 0) first = dq;
    }
    const bool repeats = std::memcmp(first.data(), dq.data(), dq.size() * sizeof(storage_t)) == 0;
    if (!repeats) std::printf("%-8s dq differs on a repeat\n", cs.name);
    failed += !repeats;
    failed += report("dq", rel_error(widen(dq), dq_ref));
    if (HAS_DQ) {
        // flash_bwd_dq_wgmma is generic in the head dim: at d 64 too (where
        // the layouts build runs), against the same reference.
        std::vector<storage_t> dq_alone(dq.size());
        launch(
            Dim{blocks(max_q), (unsigned)HQ, (unsigned)B}, BLOCK_THREADS,
            [&] { flash_bwd_dq_wgmma(tq, tk, tv, tdo, lse.data(), delta.data(), dq_alone.data(), p, Lq); },
            SMEM_BYTES, true);
        failed += report("dq (flash_bwd_dq_wgmma)", rel_error(widen(dq_alone), dq_ref));
    }
#else
    launch(
        Dim{blocks(max_k), (unsigned)HKV, (unsigned)B}, BLOCK_THREADS,
        [&] {
            flash_bwd_dkdv(q.stored.data(), k.stored.data(), v.stored.data(), d_o.stored.data(), lse.data(),
                           delta.data(), dk.data(), dv.data(), p, Lk, drop);
        },
        SMEM_BYTES);
    launch(
        Dim{blocks(max_q), (unsigned)HQ, (unsigned)B}, BLOCK_THREADS,
        [&] {
            flash_bwd_dq(q.stored.data(), k.stored.data(), v.stored.data(), d_o.stored.data(), lse.data(),
                         delta.data(), dq.data(), p, Lq, drop);
        },
        SMEM_BYTES);
    failed += report("dq", rel_error(widen(dq), dq_ref));
#endif
    failed += report("dk", rel_error(widen(dk), dk_ref));
    failed += report("dv", rel_error(widen(dv), dv_ref));
#endif
    return failed;
#endif
}

static int run(int sq, int sk, int left, int right, int d) { return run(Case{"dense", sq, sk, left, right, d}); }

// Shards of a longer sequence (ring attention's partial calls): the
// diagonal moved off the bottom-right one. Under a band, q 50 positions
// past k's start, causal (rows see part of the shard, then all of it), and
// q before k under a window of 20 (most rows see nothing); ALiBi's
// distances from the moved diagonal, where the variant has layouts.
static int shard_cases(int d) {
    int failed = 0;
    // The dropout variants never take shard positions (the host refuses them).
    if (HAS_DROPOUT) return 0;
    if (HAS_BAND) {
        Case after{"shard after", 70, 150, -1, 0, d};
        after.shift = 50 - (150 - 70);
        Case before{"shard before", 150, 70, 20, 0, d};
        before.shift = -60;
        failed += run(after) + run(before);
    }
#if LAYOUT_CASES
    Case alibi{"alibi shard", 45, 70, 9, 0, d};
    alibi.alibi = true, alibi.shift = 33;
    failed += run(alibi);
#endif
    return failed;
}

#if TENSOR_CORES
// cuda/mma.cuh's fragment wrappers against a plain product, on one warp:
// A (16 x 16) and B (16 x 8, held both n-major and k-major) of small
// integers (exact in f16 and bf16) to fragments by ldmatrix .x4, .x2,
// .x1, .x2.trans and .x1.trans, one mma each, and D read back by the
// accumulator layout the kernels index (c0, c1: row l/4, cols 2(l%4)..+1;
// c2, c3: row l/4 + 8) must equal A * B exactly.
static int fragment_self_test() {
    auto a = [](int r, int c) { return (float)((r * 7 + c * 3) % 9 - 4); };
    auto b = [](int k, int n) { return (float)((k * 5 + n * 2) % 7 - 3); };
    std::vector<int> bad(32, 0);
    launch(
        Dim{1, 1, 1}, 32,
        [&] {
            storage_t* s = (storage_t*)host_dynamic_smem();
            storage_t *bn = s + 16 * ROW, *bk = bn + 8 * ROW;  // B^T [n][k], B [k][n]
            for (int e = threadIdx.x; e < 16 * 16; e += 32) {
                s[(e / 16) * ROW + e % 16] = store_f32(a(e / 16, e % 16));
                if (e < 8 * 16) bn[(e / 16) * ROW + e % 16] = store_f32(b(e % 16, e / 16));
                if (e < 16 * 8) bk[(e / 8) * ROW + e % 8] = store_f32(b(e / 8, e % 8));
            }
            __syncthreads();
            const int lane = threadIdx.x % 32;
            unsigned af[4], x2[2], lo[1], hi[1], t2[2], tlo[1], thi[1];
            ldmatrix_x4(af, s + (lane % 16) * ROW + (lane / 16) * 8);
            ldmatrix_x2(x2, bn + (lane % 8) * ROW + ((lane / 8) % 2) * 8);
            ldmatrix_x1(lo, bn + (lane % 8) * ROW);
            ldmatrix_x1(hi, bn + (lane % 8) * ROW + 8);
            ldmatrix_x2_trans(t2, bk + (lane % 16) * ROW);
            ldmatrix_x1_trans(tlo, bk + (lane % 8) * ROW);
            ldmatrix_x1_trans(thi, bk + (lane % 8 + 8) * ROW);
            float d[4][4] = {};
            mma_16816(d[0], af, x2[0], x2[1]);
            mma_16816(d[1], af, lo[0], hi[0]);
            mma_16816(d[2], af, t2[0], t2[1]);
            mma_16816(d[3], af, tlo[0], thi[0]);
            for (int e = 0; e < 4; ++e) {
                const int row = lane / 4 + 8 * (e / 2), col = 2 * (lane % 4) + e % 2;
                float want = 0;
                for (int k = 0; k < 16; ++k) want += a(row, k) * b(k, col);
                for (int v = 0; v < 4; ++v) bad[lane] += d[v][e] != want;
            }
        },
        SMEM_BYTES);
    int total = 0;
    for (int x : bad) total += x;
    std::printf("fragments (ldmatrix x4/x2/x1, x2/x1 trans, mma m16n8k16): %d of 512 entries wrong\n", total);
    return total ? 1 : 0;
}
#else
static int fragment_self_test() { return 0; }
#endif

#if IS_WGMMA
// cuda/hopper.cuh's wrappers against plain products, on one warpgroup:
// A (50 x 40 in global memory: the 64 x 64 box reads zeros past it) and B
// (128 x 64) TMA-loaded with the 128B swizzle on one mbarrier, S = A B^T by
// four wgmma m64n128k16 from descriptors (K-major, k advanced 32 B in the
// atom); then O = P V with P (64 x 128) from registers and V (128 x
// HEAD_DIM, MN-major, two boxes at d 128) by descriptor. Small integers,
// exact in f16 and bf16: every entry must equal the product.
static int wgmma_self_test() {
    auto a = [](int r, int c) { return (float)((r * 7 + c * 3) % 9 - 4); };
    auto b = [](int n, int k) { return (float)((n * 5 + k * 2) % 7 - 3); };
    auto pm = [](int r, int j) { return (float)((r * 3 + j * 5) % 5 - 2); };
    auto vm = [](int j, int c) { return (float)((j * 3 + c * 7) % 5 - 2); };
    const int ra = 50, da = 40;
    std::vector<storage_t> ga(ra * da), gb(128 * 64), gv(128 * HEAD_DIM);
    for (int e = 0; e < ra * da; ++e) ga[e] = store_f32(a(e / da, e % da));
    for (int e = 0; e < 128 * 64; ++e) gb[e] = store_f32(b(e / 64, e % 64));
    for (int e = 0; e < 128 * HEAD_DIM; ++e) gv[e] = store_f32(vm(e / HEAD_DIM, e % HEAD_DIM));
    const TensorMap ta = tensor_map(ga.data(), 1, ra, 1, da, 64), tb = tensor_map(gb.data(), 1, 128, 1, 64, 128),
                    tv = tensor_map(gv.data(), 1, 128, 1, HEAD_DIM, 128);
    std::vector<int> bad(128, 0);
    launch(
        Dim{1, 1, 1}, 128,
        [&] {
            unsigned char* s = host_dynamic_smem();
            unsigned char *sa = s, *sb = s + 64 * 128, *sv = sb + 128 * 128;
            const Bar bar = bar_at(sv + 128 * HEAD_DIM * 2);
            if (threadIdx.x == 0) {
                mbar_init(bar, 1);
                mbar_arrive_expect_tx(bar, (64 + 128) * 128 + 128 * HEAD_DIM * 2);
                tma_load_4d(sa, &ta, 0, 0, 0, 0, bar);
                tma_load_4d(sb, &tb, 0, 0, 0, 0, bar);
                for (int box = 0; box < HEAD_DIM / 64; ++box)
                    tma_load_4d(sv + box * 128 * 128, &tv, box * 64, 0, 0, 0, bar);
            }
            __syncthreads();
            mbar_wait(bar, 0, 0);
            const int lane = threadIdx.x % 32, t = lane % 4, r0 = threadIdx.x / 32 * 16 + lane / 4;
            float sacc[64], oacc[HEAD_DIM / 2] = {};
            wgmma_fence();
            for (int ks = 0; ks < 4; ++ks)
                wgmma_ss<128>(sacc, smem_desc(sa + ks * 32, 16, 1024), smem_desc(sb + ks * 32, 16, 1024), ks > 0);
            wgmma_commit();
            unsigned frag[8][4];
            for (int kk = 0; kk < 8; ++kk)
                for (int x = 0; x < 4; ++x) {
                    const int r = r0 + 8 * (x % 2), j = 16 * kk + 2 * t + 8 * (x / 2);
                    frag[kk][x] = pack2(pm(r, j), pm(r, j + 1));
                }
            wgmma_fence();
            for (int kk = 0; kk < 8; ++kk)
                wgmma_rs<HEAD_DIM, 1>(oacc, frag[kk], smem_desc(sv + kk * 16 * 128, 128 * 128, 1024));
            wgmma_commit();
            wgmma_wait<0>();
            for (int i = 0; i < 64; ++i) {
                const int row = r0 + 8 * ((i % 4) / 2), col = 8 * (i / 4) + 2 * t + i % 2;
                float want = 0;
                for (int k = 0; k < 64; ++k) want += (row < ra && k < da ? a(row, k) : 0.0f) * b(col, k);
                bad[threadIdx.x] += sacc[i] != want;
            }
            for (int i = 0; i < HEAD_DIM / 2; ++i) {
                const int row = r0 + 8 * ((i % 4) / 2), col = 8 * (i / 4) + 2 * t + i % 2;
                float want = 0;
                for (int j = 0; j < 128; ++j) want += pm(row, j) * vm(j, col);
                bad[threadIdx.x] += oacc[i] != want;
            }
        },
        SMEM_BYTES);
    int total = 0;
    for (int x : bad) total += x;
    std::printf("wgmma + TMA (64x128 S from descriptors, 64x%d O from register A, zero fill): %d of %d entries wrong\n",
                HEAD_DIM, total, 128 * (64 + HEAD_DIM / 2));
    return total ? 1 : 0;
}
#endif

#if IS_WGMMA
// A barrier no one arrives at: cuda/hopper.cuh's bounded mbar_wait must
// print block, thread, barrier and phase, and trap (tests/cuda.rs runs
// this with a short FLASHATTN_BOUNDED_WAIT_MS).
static int deadlock() {
    launch(
        Dim{1, 1, 1}, 32,
        [&] {
            const Bar bar = bar_at(host_dynamic_smem());
            if (threadIdx.x == 0) mbar_init(bar, 1);
            __syncthreads();
            if (threadIdx.x == 0) mbar_wait(bar, 0, 6);
        },
        64);
    std::printf("deadlock: the wait returned\n");
    return 1;
}
#endif

#if IS_WGMMA && IS_FORWARD
// `schedule sq sk heads batch blocks`: the persistent forward's items as its
// blocks take them (dense; causal where the variant has a band), by the
// kernel's own item_index and enter_item: a line a block, "block c:" then
// each item's "m_block,head,sequence:key tiles".
static int schedule(int argc, char** argv) {
    if (argc != 7) return 2;
    const int sq = std::atoi(argv[2]), sk = std::atoi(argv[3]), heads = std::atoi(argv[4]),
              batch = std::atoi(argv[5]), ctas = std::atoi(argv[6]);
    const Problem problem{sq, sk, heads, heads, HEAD_DIM, 1.0f / std::sqrt((float)HEAD_DIM), 0.0f, -1,
                          HAS_BAND ? 0 : -1};
    const Layout L{};
    const int m_blocks = (sq + BLOCK_M - 1) / BLOCK_M;
    const Work W{m_blocks, batch, heads * batch, m_blocks * heads * batch};
    gridDim = Dim{(unsigned)ctas, 1, 1};
    for (int c = 0; c < ctas; ++c) {
        blockIdx = Dim{(unsigned)c, 0, 0};
        std::printf("block %d:", c);
        for (int n = 0, index; (index = item_index(n, W)) >= 0; ++n) {
            const Item it = enter_item(problem, L, W, index);
            std::printf(" %d,%d,%d:%d", it.m0 / BLOCK_M, it.h, it.z, it.skip ? 0 : it.steps.count);
        }
        std::printf("\n");
    }
    return 0;
}
#endif

#if !IS_WGMMA
// `mask sq sk hq hkv batch p seed offset`: the mask the kernels imply, read
// off their outputs, one line of 0/1 per output in (batch, query head,
// row, key) order (tests/cuda.rs compares them with flashattn's
// dropout_mask). Every score is 0 (q = 0), so P = 1 / sk on every pair, and
// one-hot rows make each output entry one pair's: the forward's o[i][j] =
// keep_ij / (1 - p) / sk (v_j = e_j), the backward's dq[i][j] = scale *
// keep_ij / (1 - p) / sk (k_j = e_j, v all ones, dO_i = e_i, o = 0 so D =
// 0) and dv[j][i] = keep_ij / (1 - p) / sk, one query head of each group
// at a time (dO is 0 on the others). Needs sq, sk <= HEAD_DIM.
static int implied_mask(int argc, char** argv) {
    if (argc != 10) return 2;
    const int sq = std::atoi(argv[2]), sk = std::atoi(argv[3]), HQ = std::atoi(argv[4]), HKV = std::atoi(argv[5]),
              B = std::atoi(argv[6]), d = HEAD_DIM, group = HQ / HKV;
    if (sq > d || sk > d) return 2;
    const Dropout drop = dropout_args(std::atof(argv[7]), std::strtoull(argv[8], nullptr, 0), std::strtoull(argv[9], nullptr, 0));
    const Problem p{sq, sk, HQ, HKV, d, 1.0f / std::sqrt((float)d), HAS_SOFTCAP ? 5.0f : 0.0f, -1, -1, 0};
    const Layout L{};
    const storage_t zero = store_f32(0.0f), one = store_f32(1.0f);
    auto qi = [&](int b, int i, int h) { return (((size_t)b * sq + i) * HQ + h) * d; };
    auto kj = [&](int b, int j, int h) { return (((size_t)b * sk + j) * HKV + h) * d; };
    auto mask_at = [&](int b, int h, int i, int j) { return (((size_t)b * HQ + h) * sq + i) * sk + j; };
    std::vector<storage_t> q((size_t)B * sq * HQ * d, zero), onehot_k((size_t)B * sk * HKV * d, zero);
    for (int b = 0; b < B; ++b)
        for (int j = 0; j < sk; ++j)
            for (int h = 0; h < HKV; ++h) onehot_k[kj(b, j, h) + j] = one;
    auto blocks = [](int n) { return (unsigned)std::max(1, (n + BLOCK_ROWS - 1) / BLOCK_ROWS); };
    auto print = [](const char* what, const std::vector<char>& bits) {
        std::printf("%s ", what);
        std::fwrite(bits.data(), 1, bits.size(), stdout);
        std::printf("\n");
    };
#if IS_FORWARD
    std::vector<storage_t> o(q.size());
    std::vector<float> lse((size_t)B * HQ * sq);
    launch(Dim{blocks(sq), (unsigned)HQ, (unsigned)B}, BLOCK_THREADS,
           [&] { FORWARD_FOR(p.d)(q.data(), q.data(), onehot_k.data(), o.data(), lse.data(), p, L, drop); }, SMEM_BYTES);
    std::vector<char> fwd((size_t)B * HQ * sq * sk);
    for (int b = 0; b < B; ++b)
        for (int h = 0; h < HQ; ++h)
            for (int i = 0; i < sq; ++i)
                for (int j = 0; j < sk; ++j) fwd[mask_at(b, h, i, j)] = load_f32(o[qi(b, i, h) + j]) != 0.0f ? '1' : '0';
    print("fwd", fwd);
#else
    std::vector<storage_t> ones((size_t)B * sk * HKV * d, one), d_o(q.size()), dq(q.size()), dk(ones.size()),
        dv(ones.size());
    std::vector<float> lse((size_t)B * HQ * sq, std::log((float)sk)), delta(lse.size(), 0.0f);
    std::vector<char> dq_bits((size_t)B * HQ * sq * sk), dv_bits(dq_bits.size());
    for (int g = 0; g < group; ++g) {
        for (int b = 0; b < B; ++b)
            for (int i = 0; i < sq; ++i)
                for (int h = 0; h < HQ; ++h)
                    for (int c = 0; c < d; ++c) d_o[qi(b, i, h) + c] = h % group == g && c == i ? one : zero;
        launch(Dim{blocks(sk), (unsigned)HKV, (unsigned)B}, BLOCK_THREADS, [&] {
            flash_bwd_dkdv(q.data(), onehot_k.data(), ones.data(), d_o.data(), lse.data(), delta.data(), dk.data(),
                           dv.data(), p, L, drop);
        }, SMEM_BYTES);
        launch(Dim{blocks(sq), (unsigned)HQ, (unsigned)B}, BLOCK_THREADS, [&] {
            flash_bwd_dq(q.data(), onehot_k.data(), ones.data(), d_o.data(), lse.data(), delta.data(), dq.data(), p,
                         L, drop);
        }, SMEM_BYTES);
        for (int b = 0; b < B; ++b)
            for (int hk = 0; hk < HKV; ++hk) {
                const int h = hk * group + g;
                for (int i = 0; i < sq; ++i)
                    for (int j = 0; j < sk; ++j) {
                        dq_bits[mask_at(b, h, i, j)] = load_f32(dq[qi(b, i, h) + j]) != 0.0f ? '1' : '0';
                        dv_bits[mask_at(b, h, i, j)] = load_f32(dv[kj(b, j, hk) + i]) != 0.0f ? '1' : '0';
                    }
            }
    }
    print("dq", dq_bits);
    print("dv", dv_bits);
#endif
    return 0;
}
#endif

// `cases` then groups of nine: name sq sk left right d hq hkv batch (the
// GPU checks' Hopper smoke cases, tests/cuda.rs), run instead of the
// built-in ones.
static int listed_cases(int argc, char** argv) {
    int failed = 0;
    for (int a = 2; a + 9 <= argc; a += 9) {
        Case c{argv[a], std::atoi(argv[a + 1]), std::atoi(argv[a + 2]), std::atoi(argv[a + 3]),
               std::atoi(argv[a + 4]), std::atoi(argv[a + 5])};
        c.hq = std::atoi(argv[a + 6]), c.hkv = std::atoi(argv[a + 7]), c.batch = std::atoi(argv[a + 8]);
        failed += run(c);
    }
    return failed ? 1 : 0;
}

#if IS_WGMMA && LAYOUT_CASES
// The run-time layouts on a Hopper kernel's tiles: ALiBi per batch entry
// (the bias on every tile, the unmasked ones too); sinks with a band (rows
// with no key: lse = the sink); a 7 x 13 block mask per head over
// `block_keys` keys (partial tiles); one of whole tiles (`tile_q` x
// `tile_k`) per batch entry over `aligned_keys` keys (unmasked runs); a
// packed batch with a sequence past a tile, one with no queries and one
// with no keys; and all at once.
static int hopper_layout_cases(int low, int block_keys, int aligned_keys, int tile_q, int tile_k) {
    Case alibi{"alibi", 45, 300, -1, 0, low};
    alibi.alibi = alibi.alibi_per_batch = true;
    Case sinks{"sinks", 70, 45, 9, 0, HEAD_DIM};
    sinks.sinks = true, sinks.batch = 1;
    Case blocks{"blocks", 61, block_keys, -1, 3, low};
    blocks.bm = 7, blocks.bn = 13, blocks.mask_per_head = true, blocks.density = 0.4, blocks.batch = 1;
    Case aligned{"aligned", 130, aligned_keys, -1, 0, low};
    aligned.bm = tile_q, aligned.bn = tile_k, aligned.mask_per_batch = true, aligned.density = 0.6;
    Case packed{"varlen", 0, 0, 150, 2, low};
    packed.lens_q = {130, 0, 37, 20}, packed.lens_k = {300, 23, 0, 140};
    Case mix{"mix", 0, 0, 200, 0, low};
    mix.lens_q = {21, 0, 140, 30}, mix.lens_k = {30, 12, 270, 9};
    mix.alibi = mix.alibi_per_batch = mix.sinks = mix.mask_per_head = true;
    mix.bm = 7, mix.bn = 13;
    int failed = 0;
    for (const Case& c : {alibi, sinks, blocks, aligned, packed, mix}) failed += run(c);
    return failed;
}
#endif

int main(int argc, char** argv) {
    if (argc > 1 && std::strcmp(argv[1], "cases") == 0) return listed_cases(argc, argv);
#if !IS_WGMMA
    if (argc > 1 && std::strcmp(argv[1], "mask") == 0) return implied_mask(argc, argv);
#endif
#if IS_WGMMA
    if (argc > 1 && std::strcmp(argv[1], "deadlock") == 0) return deadlock();
#endif
#if IS_WGMMA && IS_FORWARD
    if (argc > 1 && std::strcmp(argv[1], "schedule") == 0) return schedule(argc, argv);
#endif
#if IS_FP8
    // The FP8 forward: the wrappers first, then GQA 4:2 (and 4:1), lengths
    // off the tiles both ways, causal at 113, 1 x 255 and 255 x 1, a head
    // dim below the padded one, and with a band a window and rows with no
    // key; 300 keys: the ring (and V^T's buffers) wrap.
    int failed = fp8_self_test() + run(45, 70, 9, 0, HEAD_DIM) + run(70, 45, 9, 0, 100);
    failed += run(113, 113, -1, 0, HEAD_DIM) + run(1, 255, -1, 0, HEAD_DIM) + run(255, 1, -1, 0, 64);
    Case gqa{"gqa 4:1", 150, 300, 100, 20, HEAD_DIM};
    gqa.hq = 4, gqa.hkv = 1, gqa.batch = 1;
    failed += run(gqa);
    if (HAS_BAND) failed += run(61, 130, -1, 3, HEAD_DIM);
#elif IS_WGMMA && !IS_FORWARD
    // The Hopper dK/dV: head dims below the padded one and at it; GQA
    // (4:2); a key block's 128 keys against 64-query steps; lengths of 1,
    // 113 and 255 (a key block with one key, query tiles past a
    // sequence's end); more queries than keys (rows with no key under a
    // band); and with a band a window of 300 keys to the left and 100 to
    // the right over 600 keys, whose blocks run tested, untested and
    // tested steps in turn.
    const int low = HEAD_DIM - 24;  // 40 at 64, 104 at 128
    int failed = wgmma_self_test() + run(45, 70, 9, 0, low) + run(70, 45, 9, 0, low);
    failed += run(113, 113, -1, 0, HEAD_DIM) + run(1, 255, -1, 0, HEAD_DIM) + run(255, 1, -1, 0, low);
    if (HAS_BAND) failed += run(61, 130, -1, 3, low) + run(200, 600, 300, 100, low);
    Case gqa{"gqa 4:1", 150, 300, -1, 0, HEAD_DIM - 8};
    gqa.hq = 4, gqa.hkv = 1, gqa.batch = 1;
    failed += run(gqa) + shard_cases(low);
#if LAYOUT_CASES
    // The run-time layouts: ALiBi (every step tested), sinks (in the lse
    // alone), block masks (partial steps; whole 64 x 128 tiles), a packed
    // batch with a sequence past a key block, one with no queries and one
    // with no keys, and all at once.
    failed += hopper_layout_cases(low, 300, 260, BLOCK_N, BLOCK_M);
#endif
#elif IS_WGMMA
    // TMA takes d % 8 == 0: a head dim below the padded one and one at it;
    // more queries than keys (rows with no key under a band); and 300 keys
    // for 150 queries, three tiles of 128: the two-stage ring wraps and
    // stage 0's barriers flip parity. With a band, a window of 500 keys to
    // the left and 100 to the right over 1200 keys: each block runs masked
    // tiles (the left edge), unmasked ones in their own loop, then masked
    // ones again (the right edge, the last keys).
    const int low = HEAD_DIM - 24;  // 40 at 64, 104 at 128
    int failed = wgmma_self_test() + run(45, 70, 9, 0, low) + run(70, 45, 9, 0, low);
    if (HAS_BAND) failed += run(61, 130, -1, 3, low) + run(256, 1200, 500, 100, low);
    failed += run(113, 113, -1, 0, HEAD_DIM) + run(150, 300, -1, 0, HEAD_DIM - 8);
    Case one_each{"a block an item", 150, 300, -1, 0, HEAD_DIM};  // as many blocks as items
    one_each.ctas = 1 << 20;
    failed += run(one_each);
    failed += shard_cases(low);
#if LAYOUT_CASES
    // The run-time layouts on the Hopper forward's tiles (128 x 128): keys
    // past a tile so that, but for the layout, steps would run unmasked.
    failed += hopper_layout_cases(low, 600, 520, BLOCK_ROWS, INNER);
#endif
#else
    // A head dim below the compiled one and off the 8-element chunks (the
    // mma kernels' element-wise loads), then one on them (their cp.async
    // loads). Keys past queries, and (with a band) queries past keys: rows
    // with no key; a causal window of 9 keys, a window open to the left,
    // and plain causal at an odd length.
    const int odd = std::max(1, HEAD_DIM - 5), even = HEAD_DIM - 8;
    int failed = fragment_self_test() + run(45, 70, 9, 0, odd) + run(70, 45, 9, 0, odd);
    if (HAS_BAND) failed += run(61, 130, -1, 3, odd);
    failed += run(113, 113, -1, 0, even) + run(33, 97, 9, 0, HEAD_DIM);
    failed += shard_cases(odd);
#ifdef FORWARD_UNALIGNED_ENTRY
    // The sm80 forward: with a band, a window of 200 keys to the left and
    // 64 to the right over 500 keys, so that its blocks run tiles tested
    // per pair (the left edge), unmasked ones in their own loop, then tested
    // ones again (the right edge); a negative scale (its sign folded into
    // Q); and scores of a spread (~50) past the conditional rescale's
    // threshold, whose maxima keep passing it tile after tile, some rows
    // of a warp at a time.
    if (HAS_BAND) failed += run(150, 500, 200, 64, even);
    Case negative{"negative scale", 70, 150, 40, 0, even};
    negative.negative_scale = true, negative.batch = 1;
    Case large{"large scores", 70, 400, -1, 0, even};
    large.amplitude = 12.0f, large.batch = 1;
    failed += run(negative) + run(large);
#endif
#if TENSOR_CORES && !IS_FORWARD && !HAS_DROPOUT
    // The sm80 backward: the same window, so that its dK/dV and dQ blocks
    // run steps tested per pair, then untested ones (the exp2 form), then
    // tested ones again (dropout's variants test every step).
    if (HAS_BAND) failed += run(150, 500, 200, 64, even);
#endif

#if LAYOUT_CASES
    // The run-time layouts, on this same variant (under its band and softcap).
    Case alibi{"alibi", 45, 70, 9, 0, odd};
    alibi.alibi = alibi.alibi_per_batch = true;
    // One batch entry where a second adds nothing (each block is an OS
    // thread per CUDA thread here: the layouts' runs stay small).
    Case sinks{"sinks", 70, 45, 9, 0, even};  // with a band, rows with no key: lse = the sink
    sinks.sinks = true, sinks.batch = 1;
    Case blocks{"blocks", 61, 83, -1, 3, odd};  // 7 x 13 blocks, a grid per head
    blocks.bm = 7, blocks.bn = 13, blocks.mask_per_head = true, blocks.density = 0.4, blocks.batch = 1;
    // The same with no window: partial tiles where every pair would
    // otherwise be allowed (a kernel's unmasked loop must not take them).
    Case open{"open blocks", 61, 200, -1, -1, even};
    open.bm = 7, open.bn = 13, open.mask_per_head = true, open.density = 0.4, open.batch = 1;
    Case aligned{"aligned", 70, 96, -1, 0, even};  // blocks of whole tiles, a grid per batch entry
    aligned.bm = BLOCK_ROWS, aligned.bn = INNER, aligned.mask_per_batch = true;
    Case packed{"varlen", 0, 0, 8, 2, even};  // no queries, no keys, more queries than keys
    packed.lens_q = {9, 0, 37, 20}, packed.lens_k = {14, 23, 0, 33};
    Case mix{"mix", 0, 0, 20, 0, odd};
    mix.lens_q = {21, 0, 45, 30}, mix.lens_k = {30, 12, 17, 30};
    mix.alibi = mix.alibi_per_batch = mix.sinks = mix.mask_per_head = true;
    mix.bm = 7, mix.bn = 13;
    for (const Case& c : {alibi, sinks, blocks, open, aligned, packed, mix}) failed += run(c);
#endif
#endif
    return failed ? 1 : 0;
}

//! Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2,
//! 3", SC11), the counter-based generator behind attention dropout: a pure
//! function of a 128-bit counter and a 64-bit key, so every backend draws
//! the same bits for the same element without any state. The WGSL copy is
//! `shaders/philox.wgsl`, the CUDA one `cuda/philox.cuh`; all three pass
//! Random123's published known-answer vectors.

/// The round multipliers of Philox4x32.
const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
/// The key schedule's Weyl increments (golden ratio, √3 − 1).
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;
/// Philox4x32's recommended round count.
pub const ROUNDS: usize = 10;

/// `(hi, lo)` of the 64-bit product `a · b`.
#[inline(always)]
fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = a as u64 * b as u64;
    ((p >> 32) as u32, p as u32)
}

/// Philox4x32-10 of `counter` under `key`: four 32-bit outputs.
#[inline(always)]
pub fn philox4x32_10(counter: [u32; 4], key: [u32; 2]) -> [u32; 4] {
    let [mut c0, mut c1, mut c2, mut c3] = counter;
    let [mut k0, mut k1] = key;
    for round in 0..ROUNDS {
        if round > 0 {
            k0 = k0.wrapping_add(W0);
            k1 = k1.wrapping_add(W1);
        }
        let (hi0, lo0) = mulhilo(M0, c0);
        let (hi1, lo1) = mulhilo(M1, c2);
        (c0, c1, c2, c3) = (hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0);
    }
    [c0, c1, c2, c3]
}

/// [`philox4x32_10`] of `N` counters at once, word by word (`counters[w][n]`
/// is word `w` of counter `n`), so that the compiler turns each round into
/// vector multiplies (`vpmuludq`) of `N` lanes. The same values as `N`
/// scalar calls.
#[inline(always)]
pub fn philox4x32_10_lanes<const N: usize>(
    counters: [[u32; N]; 4],
    key: [u32; 2],
) -> [[u32; N]; 4] {
    let [mut c0, mut c1, mut c2, mut c3] = counters;
    let [mut k0, mut k1] = key;
    for round in 0..ROUNDS {
        if round > 0 {
            k0 = k0.wrapping_add(W0);
            k1 = k1.wrapping_add(W1);
        }
        let mut n = [[0u32; N]; 4];
        for l in 0..N {
            let p0 = M0 as u64 * c0[l] as u64;
            let p1 = M1 as u64 * c2[l] as u64;
            n[0][l] = (p1 >> 32) as u32 ^ c1[l] ^ k0;
            n[1][l] = p1 as u32;
            n[2][l] = (p0 >> 32) as u32 ^ c3[l] ^ k1;
            n[3][l] = p0 as u32;
        }
        [c0, c1, c2, c3] = n;
    }
    [c0, c1, c2, c3]
}

/// Random123's published known-answer vectors for Philox4x32-10
/// (`kat_vectors`): `(counter, key, output)`. Every implementation of the
/// generator in the project is tested against these.
#[cfg(any(test, feature = "lab"))]
pub const KNOWN_ANSWERS: [([u32; 4], [u32; 2], [u32; 4]); 3] = [
    (
        [0, 0, 0, 0],
        [0, 0],
        [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8],
    ),
    (
        [u32::MAX; 4],
        [u32::MAX; 2],
        [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd],
    ),
    (
        [0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344],
        [0xa409_3822, 0x299f_31d0],
        [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1],
    ),
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random123_known_answers() {
        for (counter, key, want) in KNOWN_ANSWERS {
            assert_eq!(philox4x32_10(counter, key), want, "counter {counter:08x?}");
        }
    }

    #[test]
    fn lanes_match_scalar_calls() {
        let mut counters = [[0u32; 8]; 4];
        for (w, word) in counters.iter_mut().enumerate() {
            for (l, x) in word.iter_mut().enumerate() {
                *x = (w as u32 + 1).wrapping_mul(0x0101_0101) ^ (l as u32).wrapping_mul(0x9e37_79b9);
            }
        }
        let key = [0x1234_5678, 0x9abc_def0];
        let out = philox4x32_10_lanes(counters, key);
        for l in 0..8 {
            let one = philox4x32_10(counters.map(|w| w[l]), key);
            assert_eq!(one, out.map(|w| w[l]), "lane {l}");
        }
        // The known answers through the lanes too.
        for (counter, key, want) in KNOWN_ANSWERS {
            let out = philox4x32_10_lanes::<1>(counter.map(|x| [x]), key);
            assert_eq!(out.map(|w| w[0]), want);
        }
    }
}

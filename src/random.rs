//! Deterministic pseudo-random inputs (SplitMix64), so demos, tests and
//! benchmarks are reproducible without a dependency.

/// A SplitMix64 generator.
#[derive(Clone, Debug)]
pub struct Rng(u64);

impl Rng {
    /// A generator seeded with `seed`.
    pub fn new(seed: u64) -> Self {
        Self(seed)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `[0, 1)`.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in `0..n` (`n` at least 1).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n.max(1) as u64) as usize
    }

    /// Standard normal (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        let u1 = self.uniform().max(1e-300);
        let u2 = self.uniform();
        (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
    }

    /// `n` normal values times `std`.
    pub fn normal_vec(&mut self, n: usize, std: f32) -> Vec<f32> {
        (0..n).map(|_| self.normal() as f32 * std).collect()
    }

    /// `n` values `N(0, 1) + N(0, outlier_std²)·Bernoulli(rate)`: the
    /// inputs of FlashAttention-3's FP8 accuracy study (rate 0.001, std 10).
    pub fn normal_with_outliers(&mut self, n: usize, rate: f64, outlier_std: f32) -> Vec<f32> {
        (0..n)
            .map(|_| {
                let x = self.normal() as f32;
                let hit = self.uniform() < rate;
                x + if hit {
                    self.normal() as f32 * outlier_std
                } else {
                    0.0
                }
            })
            .collect()
    }
}

/// The outlier channels the FP8 tests and the precision study use: four of
/// a head dim's channels ×10, ×20, ×35 and ×50.
pub fn outlier_channels(head_dim: usize) -> [(usize, f32); 4] {
    let d = head_dim.max(3);
    [(1, 10.0), (d / 3, 20.0), (d / 2, 35.0), (d - 2, 50.0)]
}

/// Multiply channel `c` of every row of `x` (rows of `dim` values) by
/// `factor`, for each `(c, factor)`: the outlier channels of LLM
/// activations (a few of q's and k's channels 10–50× larger than the rest).
pub fn scale_channels(x: &mut [f32], dim: usize, channels: &[(usize, f32)]) {
    for row in x.chunks_mut(dim) {
        for &(c, factor) in channels {
            if let Some(v) = row.get_mut(c) {
                *v *= factor;
            }
        }
    }
}

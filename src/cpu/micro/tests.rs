//! Every instruction set's kernels against their own scalar chains (bit
//! for bit) and f64, dispatched through [`Isa`] as the backend does.

use super::*;
use crate::cpu::codes::{E4m3Code, Int8Code};
use crate::cpu::isa::{Isa, Task};
use bytemuck::TransparentWrapper;

/// Values in [-2, 2] that differ from one element to the next.
fn values(len: usize, mul: usize) -> Vec<f32> {
    (0..len)
        .map(|i| ((i * mul % 101) as f32 - 50.0) / 25.0)
        .collect()
}

/// Whether `got` is `want` bit for bit (NaN padding included).
fn same_bits(got: &[f32], want: &[f32]) -> bool {
    got.len() == want.len()
        && got
            .iter()
            .zip(want)
            .all(|(g, w)| g.to_bits() == w.to_bits())
}

/// `c0 + Σ terms` in f64, and `1 + |c0| + Σ |terms|`: the f32 sums
/// below round at most 128 times in a chain (k 64, unfused), so they
/// are within `128 · 2⁻²⁴ < 1e-5` times it, under any cancellation.
fn sum_and_size(terms: impl Iterator<Item = f64>, c0: f64) -> (f64, f64) {
    terms.fold((c0, 1.0 + c0.abs()), |(s, a), t| (s + t, a + t.abs()))
}

/// One [`gemm`] on a kernel, and the same sums as a chain of that
/// kernel's scalar `madd` in k's order: whatever the tile shape, every
/// element of C is that chain, so the two must agree bit for bit.
struct GemmCase<'a, B = f32> {
    dims: Dims,
    a: Mat<'a>,
    b: &'a [B],
    c: Vec<f32>,
    ldc: usize,
    accumulate: bool,
}

impl<B: Operand> Task for GemmCase<'_, B> {
    type Output = (Vec<f32>, Vec<f32>);
    fn run<K: Kernel>(self) -> Self::Output {
        let Dims { m, n, k } = self.dims;
        let (a, b, ldc) = (self.a, self.b, self.ldc);
        let mut want = self.c.clone();
        for r in 0..m {
            for j in 0..n {
                let mut s = if self.accumulate {
                    want[r * ldc + j]
                } else {
                    0.0
                };
                for x in 0..k {
                    s = K::madd(a.data[r * a.rs + x * a.cs], b[x * n + j].value(), s);
                }
                want[r * ldc + j] = s;
            }
        }
        let mut got = self.c;
        gemm::<K, _>(
            self.dims,
            a,
            Mat::rows(b, n),
            &mut got,
            ldc,
            self.accumulate,
        );
        (got, want)
    }
}

#[test]
fn every_instruction_sets_tiles_are_their_madd_chains_at_odd_sizes() {
    for &isa in Isa::available() {
        for m in [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 20, 25] {
            for k in [0, 1, 5, 17, 64] {
                for n in [16, 32, 48] {
                    for (transposed, accumulate) in
                        [(false, false), (false, true), (true, false), (true, true)]
                    {
                        let a_data = values(m * k, 37);
                        let a = if transposed {
                            Mat::transposed(&a_data, m)
                        } else {
                            Mat::rows(&a_data, k)
                        };
                        let b = values(k * n, 53);
                        // Two padding columns that must stay NaN; C's
                        // own elements NaN too unless accumulated into.
                        let ldc = n + 2;
                        let c: Vec<f32> = (0..m * ldc)
                            .map(|i| {
                                if accumulate && i % ldc < n {
                                    0.5
                                } else {
                                    f32::NAN
                                }
                            })
                            .collect();
                        let dims = Dims { m, n, k };
                        let case = GemmCase {
                            dims,
                            a,
                            b: &b,
                            c,
                            ldc,
                            accumulate,
                        };
                        let (got, want) = isa.run(case);
                        let at = format!("{isa:?} m {m} k {k} n {n} transposed {transposed} accumulate {accumulate}");
                        assert!(same_bits(&got, &want), "{at}");
                        for r in 0..m {
                            for j in 0..n {
                                let terms = (0..k).map(|x| {
                                    a.data[r * a.rs + x * a.cs] as f64 * b[x * n + j] as f64
                                });
                                let c0 = if accumulate { 0.5 } else { 0.0 };
                                let (dot, size) = sum_and_size(terms, c0);
                                let err = (got[r * ldc + j] as f64 - dot).abs();
                                assert!(err < 1e-5 * size, "{at}: c[{r}][{j}] off by {err}");
                            }
                        }
                    }
                }
            }
        }
    }
}

/// [`row_dots`] on a kernel, and the same sums as 16 lanes of that
/// kernel's scalar `madd` folded in the documented tree (lane `j` with
/// `j + 8`, then `+ 4`, `+ 2`, `+ 1`).
struct DotsCase<'a, B = f32> {
    dims: Dims,
    q: &'a [f32],
    k: &'a [B],
    lds: usize,
}

impl<B: Operand> Task for DotsCase<'_, B> {
    type Output = (Vec<f32>, Vec<f32>);
    fn run<K: Kernel>(self) -> Self::Output {
        let Dims { m, n, k: d } = self.dims;
        let (q, k, lds) = (self.q, self.k, self.lds);
        let mut want = vec![f32::NAN; m * lds];
        for r in 0..m {
            for c in 0..n {
                let mut l = [0f32; PAD];
                for x in (0..d).step_by(PAD) {
                    for (j, l) in l.iter_mut().enumerate() {
                        *l = K::madd(q[r * d + x + j], k[c * d + x + j].value(), *l);
                    }
                }
                let h: [f32; 8] = std::array::from_fn(|j| l[j] + l[j + 8]);
                let h: [f32; 4] = std::array::from_fn(|j| h[j] + h[j + 4]);
                want[r * lds + c] = (h[0] + h[2]) + (h[1] + h[3]);
            }
        }
        let mut got = vec![f32::NAN; m * lds];
        row_dots::<K, _>(self.dims, Mat::rows(q, d), Mat::rows(k, d), &mut got, lds);
        (got, want)
    }
}

#[test]
fn every_instruction_sets_row_dots_fold_in_one_tree_and_match_f64() {
    for &isa in Isa::available() {
        for (m, n, d) in [
            (1, 1, 16),
            (2, 7, 16),
            (3, 5, 16),
            (4, 17, 48),
            (4, 10, 64),
            (2, 9, 128),
            (5, 2, 32),
            (7, 64, 128),
            (9, 3, 32),
            (13, 11, 256),
        ] {
            let q = values(m * d, 37);
            let k = values(n * d, 53);
            let lds = n + 3;
            let dims = Dims { m, n, k: d };
            let (s, want) = isa.run(DotsCase {
                dims,
                q: &q,
                k: &k,
                lds,
            });
            assert!(same_bits(&s, &want), "{isa:?} ({m},{n},{d})");
            for r in 0..m {
                for c in 0..n {
                    let terms = (0..d).map(|x| q[r * d + x] as f64 * k[c * d + x] as f64);
                    let (dot, size) = sum_and_size(terms, 0.0);
                    let err = (s[r * lds + c] as f64 - dot).abs();
                    assert!(
                        err < 1e-5 * size,
                        "{isa:?} ({m},{n},{d}) s[{r}][{c}] off by {err}"
                    );
                }
            }
        }
    }
}

/// Every code byte in turn (but e4m3's NaNs, which caches never hold),
/// from `start`.
fn codes(len: usize, start: usize) -> Vec<u8> {
    (0..)
        .map(|i| ((start + 7 * i) % 256) as u8)
        .filter(|c| c & 0x7f != 0x7f)
        .take(len)
        .collect()
}

/// Every finite f16 in turn from `start` (subnormals and −0 among them),
/// and bf16s of exponents around 1 (and zero and subnormal ones), whose
/// products stay finite: a cache holds finite values only.
fn halves(len: usize, start: usize) -> (Vec<half::f16>, Vec<half::bf16>) {
    let f16 = (0..)
        .map(|i| half::f16::from_bits(((start + 7 * i) % 65536) as u16))
        .filter(|h| h.is_finite())
        .take(len)
        .collect();
    let bf16 = (0..len)
        .map(|i| {
            let bits = (start + 7 * i) as u16;
            let exponent = [0, 1, 100, 120, 127, 140, 150][i % 7];
            half::bf16::from_bits((bits & 0x807f) | exponent << 7)
        })
        .collect();
    (f16, bf16)
}

/// One B element type's gemm `(m, k, n)` and row dots (m rows against n
/// keys of `d` columns) against their madd chains, bit for bit.
fn products_on<B: Operand>(
    isa: Isa,
    name: &str,
    (m, k, n): (usize, usize, usize),
    b: &[B],
    d: usize,
    kc: &[B],
) {
    let a = values(m * k, 37);
    for accumulate in [false, true] {
        let ldc = n + 1;
        let (got, want) = isa.run(GemmCase {
            dims: Dims { m, n, k },
            a: Mat::rows(&a, k),
            b,
            c: vec![0.25f32; m * ldc],
            ldc,
            accumulate,
        });
        assert!(same_bits(&got, &want), "{isa:?} gemm {name} ({m},{k},{n})");
    }
    let q = values(m * d, 41);
    let (got, want) = isa.run(DotsCase {
        dims: Dims { m, n, k: d },
        q: &q,
        k: kc,
        lds: n + 2,
    });
    assert!(same_bits(&got, &want), "{isa:?} dots {name} ({m},{n},{d})");
}

/// The tiles and the row dots reading a cache's elements as B (int8 and
/// e4m3 codes, f16, bf16) widen each to its value on load: the results are
/// the madd chains on those values, bit for bit, on every instruction set
/// (its vector loads are what differs from f32's).
#[test]
fn every_instruction_sets_products_on_cache_elements_are_the_chains_on_their_values() {
    for &isa in Isa::available() {
        for (m, k, n) in [
            (1usize, 5usize, 16usize),
            (4, 17, 32),
            (3, 64, 48),
            (6, 33, 128),
            (9, 2, 16),
            (12, 19, 64),
        ] {
            let size = (m, k, n);
            // The row dots' head dim: k in whole panels.
            let d = k.div_ceil(PAD) * PAD;
            let (b, kc) = (codes(k * n, 11), codes(n * d, 3));
            products_on(
                isa,
                "int8",
                size,
                Int8Code::wrap_slice(&b),
                d,
                Int8Code::wrap_slice(&kc),
            );
            products_on(
                isa,
                "e4m3",
                size,
                E4m3Code::wrap_slice(&b),
                d,
                E4m3Code::wrap_slice(&kc),
            );
            let ((b16, bb16), (k16, kb16)) = (halves(k * n, 11), halves(n * d, 3));
            products_on(isa, "f16", size, &b16, d, &k16);
            products_on(isa, "bf16", size, &bb16, d, &kb16);
        }
    }
}

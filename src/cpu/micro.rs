//! The register-blocked matmul micro-kernel every product of the CPU
//! backend runs on (Q·Kᵀ, P·V, and the backward's dP, dV, dK, dQ).
//!
//! `C (m×n) = or += A (m×k) · B (k×n)`, B and C row-major, A at any strides
//! (so Pᵀ and dSᵀ are read in place). A micro-tile keeps `MR × NR` sums of C
//! in vector registers and, for each step of k, loads one row of B (`NR`
//! floats: one to four vectors), broadcasts `MR` elements of A and does
//! `MR × NR` multiply-adds — the outer-product form of BLAS micro-kernels.
//! The x86 and NEON tiles are intrinsics over arrays of vector registers;
//! the portable one is plain Rust over fixed-size arrays. Every element of
//! C is the same chain of the kernel's `madd` in k's order whatever the
//! tile's shape, so the fused sets agree bit for bit. Operands are small
//! blocks already resident in L1/L2, so there is no packing step: the
//! callers lay K, V, Q and dO out once per call in the shapes the products
//! read.
//!
//! `n` must be a multiple of [`PAD`]: callers pad head-dim rows with zeros.

/// Column granularity: every `n` is a multiple of it.
pub(crate) const PAD: usize = 16;

/// `f::<[T,] R>(p, d, n)` for as many rows as `left` allows, four at most
/// (the row counts of [`Kernel::dots`]).
macro_rules! by_rows {
    ($f:ident [$($t:ty,)?] $p:expr, $left:expr, $d:expr, $n:expr) => {
        match $left {
            4.. => $f::<$($t,)? 4, _>($p, $d, $n),
            3 => $f::<$($t,)? 3, _>($p, $d, $n),
            2 => $f::<$($t,)? 2, _>($p, $d, $n),
            _ => $f::<$($t,)? 1, _>($p, $d, $n),
        }
    };
}

/// `t::<R>(p, k, acc)` for as many rows as `left` allows, six at most (the
/// row counts of the 6 × 16 tiles); evaluates to the rows taken.
#[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
macro_rules! six_rows {
    ($($t:ident)::+, $p:expr, $left:expr, $k:expr, $acc:expr) => {
        match $left {
            6.. => {
                $($t)::+::<6, _>($p, $k, $acc);
                6
            }
            4 | 5 => {
                $($t)::+::<4, _>($p, $k, $acc);
                4
            }
            2 | 3 => {
                $($t)::+::<2, _>($p, $k, $acc);
                2
            }
            _ => {
                $($t)::+::<1, _>($p, $k, $acc);
                1
            }
        }
    };
}

/// One instruction set's micro-tiles.
pub(crate) trait Kernel {
    /// Whether a full micro-tile is 32 columns wide (else 16).
    const WIDE: bool;
    /// The next rows of C at one column panel (16 or, `wide`, 32 columns):
    /// as many of the `left` rows as one micro-tile holds; returns how many.
    ///
    /// # Safety
    /// `p` must address `left` rows of A and C and the panel's columns of B and C.
    unsafe fn tile<B: Operand>(
        p: &Ptrs<B>,
        left: usize,
        k: usize,
        wide: bool,
        accumulate: bool,
    ) -> usize;
    /// [`row_dots`] for the next rows of q (A) against every one of the
    /// `n` keys (rows of B), into C: as many of the `left` rows as share
    /// a key's loads; returns how many.
    ///
    /// # Safety
    /// `p` must address `left` rows of A and C, `n` rows of B, `d` columns.
    unsafe fn dots<B: Operand>(p: &Ptrs<B>, left: usize, d: usize, n: usize) -> usize;
    /// `a · b + c`, fused where the instruction set has FMA: what the
    /// elementwise math ([`super::vmath`]) is built on.
    fn madd(a: f32, b: f32, c: f32) -> f32;
    /// f16 to f32, exactly: the set's conversion instruction where it has
    /// one, else [`widen_f16_bits`].
    ///
    /// # Safety
    /// The instruction set must be present (as for every method).
    #[inline(always)]
    unsafe fn widen_f16(src: &[half::f16], dst: &mut [f32]) {
        widen_f16_bits(src, dst)
    }
}

/// An element type of B (the right operand: K's rows, V): f32 as it is, or
/// a quantized cache's codes ([`super::codes`]), each widened to its exact
/// f32 value as it loads, so the products read a cache's codes in place.
/// Every load takes 16 elements (a column panel's width).
pub(crate) trait Operand: Copy {
    /// The element's value (the plain-Rust tiles' load).
    fn value(self) -> f32;
    /// 16 values in one zmm.
    ///
    /// # Safety
    /// `p` must address 16 elements; AVX-512F must be present.
    #[cfg(target_arch = "x86_64")]
    unsafe fn zmm(p: *const Self) -> std::arch::x86_64::__m512;
    /// 16 values in two ymm.
    ///
    /// # Safety
    /// `p` must address 16 elements; AVX2 must be present.
    #[cfg(target_arch = "x86_64")]
    unsafe fn ymm2(p: *const Self) -> [std::arch::x86_64::__m256; 2];
    /// 16 values in four q registers.
    ///
    /// # Safety
    /// `p` must address 16 elements.
    #[cfg(target_arch = "aarch64")]
    unsafe fn q4(p: *const Self) -> [std::arch::aarch64::float32x4_t; 4];
}

impl Operand for f32 {
    #[inline(always)]
    fn value(self) -> f32 {
        self
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn zmm(p: *const f32) -> std::arch::x86_64::__m512 {
        std::arch::x86_64::_mm512_loadu_ps(p)
    }
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn ymm2(p: *const f32) -> [std::arch::x86_64::__m256; 2] {
        use std::arch::x86_64::_mm256_loadu_ps;
        [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8))]
    }
    #[cfg(target_arch = "aarch64")]
    #[inline(always)]
    unsafe fn q4(p: *const f32) -> [std::arch::aarch64::float32x4_t; 4] {
        std::array::from_fn(|v| std::arch::aarch64::vld1q_f32(p.add(4 * v)))
    }
}

/// f16 to f32 exactly, branch-free, for sets without a conversion
/// instruction: the exponent and mantissa moved into f32's fields and
/// multiplied by 2^112 (rebasing the exponent; an f16 subnormal becomes an
/// f32 subnormal that the product normalizes exactly); infinities and NaNs
/// (exponent all ones) keep their payload under f32's all-ones exponent.
#[inline(always)]
fn widen_f16_bits(src: &[half::f16], dst: &mut [f32]) {
    const REBASE: f32 = f32::from_bits((127 + 112) << 23);
    for (d, s) in dst.iter_mut().zip(src) {
        let h = s.to_bits() as u32;
        let body = (h & 0x7fff) << 13;
        let finite = f32::from_bits(body) * REBASE;
        let special = f32::from_bits(body | 0x7f80_0000);
        let x = if h & 0x7c00 == 0x7c00 {
            special
        } else {
            finite
        };
        *d = f32::from_bits(x.to_bits() | (h & 0x8000) << 16);
    }
}

/// Up to 12 × 32 tiles: 24 of the 32 zmm registers hold C (against 8
/// rows, 3–8% less time in the forward at d 64 and 128, the backward's
/// 64-row tiles unchanged; 14 rows leave the backward a 8-row tail per
/// 64 and were slower there).
#[cfg(target_arch = "x86_64")]
pub(crate) struct Avx512;
#[cfg(target_arch = "x86_64")]
impl Kernel for Avx512 {
    const WIDE: bool = true;
    #[inline(always)]
    fn madd(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
    #[inline(always)]
    unsafe fn tile<B: Operand>(p: &Ptrs<B>, left: usize, k: usize, wide: bool, acc: bool) -> usize {
        use x86::tile512 as t;
        macro_rules! at {
            ($mr:literal) => {{
                if wide {
                    t::<$mr, 2, B>(p, k, acc)
                } else {
                    t::<$mr, 1, B>(p, k, acc)
                }
                $mr
            }};
        }
        match left {
            12.. => at!(12),
            8..=11 => at!(8),
            4..=7 => at!(4),
            2 | 3 => at!(2),
            _ => at!(1),
        }
    }
    #[inline(always)]
    unsafe fn dots<B: Operand>(p: &Ptrs<B>, left: usize, d: usize, n: usize) -> usize {
        use x86::dots512;
        by_rows!(dots512 [] p, left, d, n)
    }
    #[inline(always)]
    unsafe fn widen_f16(src: &[half::f16], dst: &mut [f32]) {
        x86::widen_f16_512(src, dst)
    }
}

/// Up to 6 × 16 tiles: 12 of the 16 ymm registers hold C.
#[cfg(target_arch = "x86_64")]
pub(crate) struct Avx2;
#[cfg(target_arch = "x86_64")]
impl Kernel for Avx2 {
    const WIDE: bool = false;
    #[inline(always)]
    fn madd(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
    #[inline(always)]
    unsafe fn tile<B: Operand>(p: &Ptrs<B>, left: usize, k: usize, _: bool, acc: bool) -> usize {
        six_rows!(x86::tile256, p, left, k, acc)
    }
    #[inline(always)]
    unsafe fn dots<B: Operand>(p: &Ptrs<B>, left: usize, d: usize, n: usize) -> usize {
        use x86::dots256;
        by_rows!(dots256 [] p, left, d, n)
    }
    #[inline(always)]
    unsafe fn widen_f16(src: &[half::f16], dst: &mut [f32]) {
        x86::widen_f16_256(src, dst)
    }
}

/// Up to 6 × 16 tiles: 24 of NEON's 32 q registers hold C, 4 a row of B.
#[cfg(target_arch = "aarch64")]
pub(crate) struct Neon;
#[cfg(target_arch = "aarch64")]
impl Kernel for Neon {
    const WIDE: bool = false;
    #[inline(always)]
    fn madd(a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
    #[inline(always)]
    unsafe fn tile<B: Operand>(p: &Ptrs<B>, left: usize, k: usize, _: bool, acc: bool) -> usize {
        six_rows!(arm::tile128, p, left, k, acc)
    }
    #[inline(always)]
    unsafe fn dots<B: Operand>(p: &Ptrs<B>, left: usize, d: usize, n: usize) -> usize {
        use arm::dots128;
        by_rows!(dots128 [] p, left, d, n)
    }
}

/// Up to 4 × 16 tiles in plain Rust, separate multiply and add (a fused
/// one without hardware FMA is a library call).
pub(crate) struct Portable;
impl Kernel for Portable {
    const WIDE: bool = false;
    #[inline(always)]
    fn madd(a: f32, b: f32, c: f32) -> f32 {
        Unfused::madd(a, b, c)
    }
    #[inline(always)]
    unsafe fn tile<B: Operand>(p: &Ptrs<B>, left: usize, k: usize, _: bool, acc: bool) -> usize {
        generic_tile::<Unfused, B>(p, left, k, acc)
    }
    #[inline(always)]
    unsafe fn dots<B: Operand>(p: &Ptrs<B>, left: usize, d: usize, n: usize) -> usize {
        generic_dots::<Unfused, B>(p, left, d, n)
    }
}

/// A scalar multiply-add for the plain-Rust tiles.
trait Madd {
    fn madd(a: f32, b: f32, c: f32) -> f32;
}

struct Unfused;
impl Madd for Unfused {
    #[inline(always)]
    fn madd(a: f32, b: f32, c: f32) -> f32 {
        a * b + c
    }
}

/// A read-only operand: element `(r, x)` at `data[r * rs + x * cs]`.
pub(crate) struct Mat<'a, T = f32> {
    pub data: &'a [T],
    pub rs: usize,
    pub cs: usize,
}

impl<T> Clone for Mat<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Mat<'_, T> {}

impl<'a, T> Mat<'a, T> {
    /// Row-major with row stride `ld`.
    pub fn rows(data: &'a [T], ld: usize) -> Self {
        Self {
            data,
            rs: ld,
            cs: 1,
        }
    }

    /// The transpose of a row-major matrix with row stride `ld`.
    pub fn transposed(data: &'a [T], ld: usize) -> Self {
        Self {
            data,
            rs: 1,
            cs: ld,
        }
    }

    /// Whether every element `(r < m, x < n)` is in bounds.
    fn holds(&self, m: usize, n: usize) -> bool {
        m == 0 || n == 0 || (m - 1) * self.rs + (n - 1) * self.cs < self.data.len()
    }
}

/// The sizes of one product: C is `m × n`, the sum runs over `k`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Dims {
    pub m: usize,
    pub n: usize,
    pub k: usize,
}

/// Raw operands of one micro-tile, bounds checked by [`gemm`].
pub(crate) struct Ptrs<B = f32> {
    a: *const f32,
    rs: usize,
    cs: usize,
    b: *const B,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
}

/// `C = A·B` (`accumulate` false) or `C += A·B`; C row-major with stride `ldc`.
///
/// # Panics
/// If an operand is too short for `dims` or `n` is not a multiple of [`PAD`]
/// (callers size every buffer from the same dims: a bug, not bad input).
#[inline(always)]
pub(crate) fn gemm<K: Kernel, B: Operand>(
    dims: Dims,
    a: Mat,
    b: Mat<B>,
    c: &mut [f32],
    ldc: usize,
    accumulate: bool,
) {
    let Dims { m, n, k } = dims;
    assert!(n % PAD == 0 && b.cs == 1 && a.holds(m, k) && b.holds(k, n));
    assert!(m == 0 || (m - 1) * ldc + n <= c.len());
    if m == 0 || n == 0 {
        return;
    }
    let mut j = 0;
    while j < n {
        let wide = K::WIDE && n - j >= 2 * PAD;
        let mut r = 0;
        while r < m {
            let p = Ptrs {
                // SAFETY: r < m and j < n, within the bounds asserted above.
                a: unsafe { a.data.as_ptr().add(r * a.rs) },
                rs: a.rs,
                cs: a.cs,
                b: unsafe { b.data.as_ptr().add(j) },
                ldb: b.rs,
                c: unsafe { c.as_mut_ptr().add(r * ldc + j) },
                ldc,
            };
            // SAFETY: the tile covers at most rows r..m and columns j..j+16 or +32 <= n.
            r += unsafe { K::tile(&p, m - r, k, wide, accumulate) };
        }
        j += if wide { 2 * PAD } else { PAD };
    }
}

/// `S = Q·Kᵀ` against K's rows as they are (a KV cache's layout, no
/// transpose): `s[r·lds + c] = q_r · k_c` for the `m` rows of `q` and the
/// `n` rows of `k`, over `k` columns (a multiple of [`PAD`]; rows
/// zero-padded). Up to four query rows share each load of a key's chunk,
/// and each sum folds its 16 lanes in one fixed tree (lane `j` with
/// `j + 8`, then `+ 4`, `+ 2`, `+ 1`) on every instruction set. The
/// products decoding needs (a few rows per key) cost this much less than
/// transposing K.
///
/// # Panics
/// If an operand is too short for `dims` or the width is not a multiple of
/// [`PAD`] (a bug, as for [`gemm`]).
#[inline(always)]
pub(crate) fn row_dots<K: Kernel, B: Operand>(
    dims: Dims,
    q: Mat,
    k: Mat<B>,
    s: &mut [f32],
    lds: usize,
) {
    let Dims { m, n, k: d } = dims;
    assert!(d % PAD == 0 && q.cs == 1 && k.cs == 1 && q.holds(m, d) && k.holds(n, d));
    assert!(m == 0 || n == 0 || (m - 1) * lds + n <= s.len());
    if n == 0 {
        return;
    }
    let mut r = 0;
    while r < m {
        let p = Ptrs {
            // SAFETY: r < m, within the bounds asserted above.
            a: unsafe { q.data.as_ptr().add(r * q.rs) },
            rs: q.rs,
            cs: 1,
            b: k.data.as_ptr(),
            ldb: k.rs,
            c: unsafe { s.as_mut_ptr().add(r * lds) },
            ldc: lds,
        };
        // SAFETY: at most rows r..m of q and s, the n rows of k, d columns.
        r += unsafe { K::dots(&p, m - r, d, n) };
    }
}

/// The plain-Rust [`Kernel::dots`]: `R` rows, every key.
#[inline(always)]
unsafe fn generic_dots<M: Madd, B: Operand>(p: &Ptrs<B>, left: usize, d: usize, n: usize) -> usize {
    by_rows!(dots [M,] p, left, d, n)
}

#[inline(always)]
unsafe fn dots<M: Madd, const R: usize, B: Operand>(p: &Ptrs<B>, d: usize, n: usize) -> usize {
    for c in 0..n {
        let key = p.b.add(c * p.ldb);
        let mut acc = [[0f32; PAD]; R];
        for x in (0..d).step_by(PAD) {
            for (r, a) in acc.iter_mut().enumerate() {
                let q = p.a.add(r * p.rs + x);
                for (j, a) in a.iter_mut().enumerate() {
                    *a = M::madd(*q.add(j), (*key.add(x + j)).value(), *a);
                }
            }
        }
        for (r, a) in acc.iter().enumerate() {
            let h: [f32; 8] = std::array::from_fn(|j| a[j] + a[j + 8]);
            let h: [f32; 4] = std::array::from_fn(|j| h[j] + h[j + 4]);
            *p.c.add(r * p.ldc + c) = (h[0] + h[2]) + (h[1] + h[3]);
        }
    }
    R
}

/// The plain-Rust tiles: up to 4 rows × 16 columns.
#[inline(always)]
unsafe fn generic_tile<M: Madd, B: Operand>(
    p: &Ptrs<B>,
    left: usize,
    k: usize,
    acc: bool,
) -> usize {
    macro_rules! at {
        ($mr:literal) => {{
            tile::<$mr, M, B>(p, k, acc);
            $mr
        }};
    }
    match left {
        4.. => at!(4),
        2 | 3 => at!(2),
        _ => at!(1),
    }
}

/// `MR × NR` sums of C in registers over the whole of k.
#[inline(always)]
unsafe fn tile<const MR: usize, M: Madd, B: Operand>(p: &Ptrs<B>, k: usize, accumulate: bool) {
    const NR: usize = PAD;
    let mut acc = [[0f32; NR]; MR];
    if accumulate {
        for (r, row) in acc.iter_mut().enumerate() {
            for (j, x) in row.iter_mut().enumerate() {
                *x = *p.c.add(r * p.ldc + j);
            }
        }
    }
    for x in 0..k {
        let brow = p.b.add(x * p.ldb);
        let mut bv = [0f32; NR];
        for (j, b) in bv.iter_mut().enumerate() {
            *b = (*brow.add(j)).value();
        }
        let a = p.a.add(x * p.cs);
        for (r, row) in acc.iter_mut().enumerate() {
            let av = *a.add(r * p.rs);
            for (c, b) in row.iter_mut().zip(&bv) {
                *c = M::madd(av, *b, *c);
            }
        }
    }
    for (r, row) in acc.iter().enumerate() {
        for (j, x) in row.iter().enumerate() {
            *p.c.add(r * p.ldc + j) = *x;
        }
    }
}

/// The x86 tiles in intrinsics: with arrays of vector registers (not of
/// floats) the compiler keeps every sum in a register.
#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Operand, Ptrs};
    use std::arch::x86_64::*;

    /// f16 to f32 with `vcvtph2ps` (exact), 16 at a time.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn widen_f16_512(src: &[half::f16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let whole = n - n % 16;
        for i in (0..whole).step_by(16) {
            let h = _mm256_loadu_si256(src.as_ptr().add(i).cast());
            _mm512_storeu_ps(dst.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
        }
        super::widen_f16_bits(&src[whole..n], &mut dst[whole..n]);
    }

    /// f16 to f32 with F16C's `vcvtph2ps` (exact), 8 at a time.
    #[inline]
    #[target_feature(enable = "avx2,f16c")]
    pub(super) unsafe fn widen_f16_256(src: &[half::f16], dst: &mut [f32]) {
        let n = src.len().min(dst.len());
        let whole = n - n % 8;
        for i in (0..whole).step_by(8) {
            let h = _mm_loadu_si128(src.as_ptr().add(i).cast());
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
        super::widen_f16_bits(&src[whole..n], &mut dst[whole..n]);
    }

    /// `MR` rows × `NV` zmm vectors (16 floats each) of C.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn tile512<const MR: usize, const NV: usize, B: Operand>(
        p: &Ptrs<B>,
        k: usize,
        accumulate: bool,
    ) {
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        if accumulate {
            for (r, row) in acc.iter_mut().enumerate() {
                for (v, x) in row.iter_mut().enumerate() {
                    *x = _mm512_loadu_ps(p.c.add(r * p.ldc + 16 * v));
                }
            }
        }
        for x in 0..k {
            let brow = p.b.add(x * p.ldb);
            let b: [__m512; NV] = std::array::from_fn(|v| B::zmm(brow.add(16 * v)));
            let a = p.a.add(x * p.cs);
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm512_set1_ps(*a.add(r * p.rs));
                for (c, b) in row.iter_mut().zip(&b) {
                    *c = _mm512_fmadd_ps(av, *b, *c);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (v, x) in row.iter().enumerate() {
                _mm512_storeu_ps(p.c.add(r * p.ldc + 16 * v), *x);
            }
        }
    }

    /// `R` rows of q against every key: four keys at a time (one zmm of
    /// sums per row and key, the four folded together), then one at a time.
    #[inline]
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dots512<const R: usize, B: Operand>(
        p: &Ptrs<B>,
        d: usize,
        n: usize,
    ) -> usize {
        let mut c = 0;
        while c + 4 <= n {
            let keys: [*const B; 4] = std::array::from_fn(|i| p.b.add((c + i) * p.ldb));
            let mut acc = [[_mm512_setzero_ps(); 4]; R];
            for x in (0..d).step_by(16) {
                let k: [__m512; 4] = std::array::from_fn(|i| B::zmm(keys[i].add(x)));
                for (r, a) in acc.iter_mut().enumerate() {
                    let q = _mm512_loadu_ps(p.a.add(r * p.rs + x));
                    for (a, k) in a.iter_mut().zip(&k) {
                        *a = _mm512_fmadd_ps(q, *k, *a);
                    }
                }
            }
            for (r, a) in acc.iter().enumerate() {
                _mm_storeu_ps(p.c.add(r * p.ldc + c), fold4(a));
            }
            c += 4;
        }
        for c in c..n {
            let key = p.b.add(c * p.ldb);
            let mut acc = [_mm512_setzero_ps(); R];
            for x in (0..d).step_by(16) {
                let k = B::zmm(key.add(x));
                for (r, a) in acc.iter_mut().enumerate() {
                    *a = _mm512_fmadd_ps(_mm512_loadu_ps(p.a.add(r * p.rs + x)), k, *a);
                }
            }
            for (r, a) in acc.iter().enumerate() {
                // The upper half through the f64 view: AVX-512F alone has no f32x8 extract.
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(*a)));
                let h = _mm256_add_ps(_mm512_castps512_ps256(*a), hi);
                *p.c.add(r * p.ldc + c) = sum8(h);
            }
        }
        R
    }

    /// Four zmm's sums, each in the fixed tree (lane `j` with `j + 8`,
    /// `+ 4`, `+ 2`, `+ 1`), four vectors' steps sharing each shuffle.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn fold4(a: &[__m512; 4]) -> __m128 {
        // + 8: quarters (0, 1) of a pair plus quarters (2, 3); lanes 0..8
        // then hold the first vector's sums, 8..16 the second's.
        let pair = |x, y| {
            _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(x, y),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(x, y),
            )
        };
        let (ab, cd) = (pair(a[0], a[1]), pair(a[2], a[3]));
        // + 4: quarter v of the result holds vector v's four sums.
        let u = _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(ab, cd),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(ab, cd),
        );
        // + 2, then + 1, within each quarter: its lane 0 is the total.
        let u = _mm512_add_ps(u, _mm512_permute_ps::<0b01_00_11_10>(u));
        let u = _mm512_add_ps(u, _mm512_permute_ps::<0b10_11_00_01>(u));
        let firsts = _mm512_set_epi32(0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 12, 8, 4, 0);
        _mm512_castps512_ps128(_mm512_permutexvar_ps(firsts, u))
    }

    /// `R` rows of q against every key, two ymm of sums per row (lanes
    /// `0..8` and `8..16`, as the zmm's halves).
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn dots256<const R: usize, B: Operand>(
        p: &Ptrs<B>,
        d: usize,
        n: usize,
    ) -> usize {
        for c in 0..n {
            let key = p.b.add(c * p.ldb);
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            for x in (0..d).step_by(16) {
                let k = B::ymm2(key.add(x));
                for (r, a) in acc.iter_mut().enumerate() {
                    let q = p.a.add(r * p.rs + x);
                    a[0] = _mm256_fmadd_ps(_mm256_loadu_ps(q), k[0], a[0]);
                    a[1] = _mm256_fmadd_ps(_mm256_loadu_ps(q.add(8)), k[1], a[1]);
                }
            }
            for (r, a) in acc.iter().enumerate() {
                *p.c.add(r * p.ldc + c) = sum8(_mm256_add_ps(a[0], a[1]));
            }
        }
        R
    }

    /// Lane `j` with `j + 4`, then `+ 2`, then `+ 1`.
    #[inline]
    #[target_feature(enable = "avx2")]
    unsafe fn sum8(h: __m256) -> f32 {
        let q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        let q = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(q, _mm_movehdup_ps(q)))
    }

    /// `MR` rows × 16 floats (two ymm vectors) of C.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(super) unsafe fn tile256<const MR: usize, B: Operand>(
        p: &Ptrs<B>,
        k: usize,
        accumulate: bool,
    ) {
        let mut acc = [[_mm256_setzero_ps(); 2]; MR];
        if accumulate {
            for (r, row) in acc.iter_mut().enumerate() {
                for (v, x) in row.iter_mut().enumerate() {
                    *x = _mm256_loadu_ps(p.c.add(r * p.ldc + 8 * v));
                }
            }
        }
        for x in 0..k {
            let brow = p.b.add(x * p.ldb);
            let b = B::ymm2(brow);
            let a = p.a.add(x * p.cs);
            for (r, row) in acc.iter_mut().enumerate() {
                let av = _mm256_set1_ps(*a.add(r * p.rs));
                for (c, b) in row.iter_mut().zip(&b) {
                    *c = _mm256_fmadd_ps(av, *b, *c);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (v, x) in row.iter().enumerate() {
                _mm256_storeu_ps(p.c.add(r * p.ldc + 8 * v), *x);
            }
        }
    }
}

/// The NEON tiles in intrinsics, as the x86 ones: arrays of q registers.
#[cfg(target_arch = "aarch64")]
mod arm {
    use super::{Operand, Ptrs};
    use std::arch::aarch64::*;

    /// `MR` rows × 16 floats (four q registers) of C: with `MR` 6, 24
    /// sums, 4 of B and A's broadcast element fit the 32 q registers.
    #[inline]
    #[target_feature(enable = "neon")]
    pub(super) unsafe fn tile128<const MR: usize, B: Operand>(
        p: &Ptrs<B>,
        k: usize,
        accumulate: bool,
    ) {
        let mut acc = [[vdupq_n_f32(0.0); 4]; MR];
        if accumulate {
            for (r, row) in acc.iter_mut().enumerate() {
                for (v, x) in row.iter_mut().enumerate() {
                    *x = vld1q_f32(p.c.add(r * p.ldc + 4 * v));
                }
            }
        }
        for x in 0..k {
            let brow = p.b.add(x * p.ldb);
            let b = B::q4(brow);
            let a = p.a.add(x * p.cs);
            for (r, row) in acc.iter_mut().enumerate() {
                let av = *a.add(r * p.rs);
                for (c, b) in row.iter_mut().zip(&b) {
                    *c = vfmaq_n_f32(*c, *b, av);
                }
            }
        }
        for (r, row) in acc.iter().enumerate() {
            for (v, x) in row.iter().enumerate() {
                vst1q_f32(p.c.add(r * p.ldc + 4 * v), *x);
            }
        }
    }

    /// `R` rows of q against every key, four q registers of sums per row
    /// (lanes `0..4`, `4..8`, `8..12`, `12..16`).
    #[inline]
    #[target_feature(enable = "neon")]
    pub(super) unsafe fn dots128<const R: usize, B: Operand>(
        p: &Ptrs<B>,
        d: usize,
        n: usize,
    ) -> usize {
        for c in 0..n {
            let key = p.b.add(c * p.ldb);
            let mut acc = [[vdupq_n_f32(0.0); 4]; R];
            for x in (0..d).step_by(16) {
                let k = B::q4(key.add(x));
                for (r, a) in acc.iter_mut().enumerate() {
                    let q = p.a.add(r * p.rs + x);
                    for (v, (a, k)) in a.iter_mut().zip(&k).enumerate() {
                        *a = vfmaq_f32(*a, vld1q_f32(q.add(4 * v)), *k);
                    }
                }
            }
            for (r, a) in acc.iter().enumerate() {
                *p.c.add(r * p.ldc + c) = sum16(a);
            }
        }
        R
    }

    /// The 16 lanes in the tree of every instruction set: lane `j` with
    /// `j + 8` (register 0 with 2, 1 with 3), then `+ 4` (the two sums),
    /// then `+ 2` (the halves), then `+ 1`. `vaddvq_f32` would pair
    /// neighbours first (`(0 + 1) + (2 + 3)`), a different rounding.
    #[inline]
    #[target_feature(enable = "neon")]
    unsafe fn sum16(a: &[float32x4_t; 4]) -> f32 {
        let q = vaddq_f32(vaddq_f32(a[0], a[2]), vaddq_f32(a[1], a[3]));
        vpadds_f32(vadd_f32(vget_low_f32(q), vget_high_f32(q)))
    }
}

#[cfg(test)]
mod tests;

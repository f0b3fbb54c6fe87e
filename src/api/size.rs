//! Checked size arithmetic for every size a caller controls: the element
//! count of a shape (tensors, KV caches, block tables, block masks, `.npy`
//! headers), the product or sum of two caller sizes (a block table's
//! `batch × max_pages`, a sequence's cached plus appended tokens), and the
//! 32-bit values the kernels index with.
//!
//! Products are computed in `u64` with checked operations and compared with
//! this target's limit, so a shape whose element count wraps around (2²¹ ×
//! 2²¹ × 2²¹ × 8 is 2⁶⁶, which `u64` wraps to 0) is an error instead of an
//! empty tensor, and the same code is right on 64-bit hosts and on wasm32,
//! where `usize` is 32 bits. Every check runs before anything is allocated.
//!
//! The limit: a tensor's elements, at the 4 bytes of the f32 the engine
//! widens every tensor to, must fit one allocation (`isize::MAX` bytes:
//! 2⁶¹ − 1 elements on 64-bit targets, 2²⁹ − 1 on wasm32). The product of
//! a shape's nonzero dims must fit even when another dim is 0, so no order
//! of multiplying the dims (a stride, a partial product) can overflow.

use crate::error::{Error, Result};

/// The most bytes one allocation may hold on this target (`isize::MAX`).
pub const MAX_ALLOCATION: u64 = isize::MAX as u64;

/// Bytes per element of the widest copy the engine makes of a tensor (f32).
pub const WIDEST_ELEMENT: u64 = 4;

/// The most elements one tensor may have on this target.
pub const MAX_ELEMENTS: u64 = MAX_ALLOCATION / WIDEST_ELEMENT;

/// The element count of a tensor of `shape` (`tensor` names it in the
/// error), or [`Error::SizeOverflow`] past [`MAX_ELEMENTS`].
pub fn elements(tensor: &'static str, shape: &[usize]) -> Result<usize> {
    let dims: Vec<u64> = shape.iter().map(|&d| d as u64).collect();
    elements_u64(tensor, &dims)
}

/// [`elements`] of a shape given in `u64` (an `.npy` header's), whose dims
/// may not even fit this target's `usize`.
pub fn elements_u64(tensor: &'static str, shape: &[u64]) -> Result<usize> {
    let n = elements_within(tensor, shape, MAX_ELEMENTS)?;
    // At most MAX_ELEMENTS, which is below usize::MAX on every target.
    usize::try_from(n).map_err(|_| overflow(tensor, "element count", shape, MAX_ELEMENTS))
}

/// The element count of `shape` if the product of its nonzero dims is at
/// most `max` (0 when a dim is 0). `max` is a parameter so that tests check
/// the 32-bit target's limit on a 64-bit host.
pub fn elements_within(tensor: &'static str, shape: &[u64], max: u64) -> Result<u64> {
    bounded_product(shape, max).ok_or_else(|| overflow(tensor, "element count", shape, max))
}

/// `a × b`, two caller sizes whose product sizes something (`what` names
/// it), at most [`MAX_ELEMENTS`].
pub fn product(what: &'static str, a: usize, b: usize) -> Result<usize> {
    let operands = [a as u64, b as u64];
    bounded_product(&operands, MAX_ELEMENTS)
        .and_then(|n| usize::try_from(n).ok())
        .ok_or_else(|| overflow(what, "product", &operands, MAX_ELEMENTS))
}

/// The product of `dims` (0 if one is 0), or `None` if the product of the
/// nonzero ones overflows or passes `max`.
fn bounded_product(dims: &[u64], max: u64) -> Option<u64> {
    let nonzero = dims
        .iter()
        .filter(|&&d| d != 0)
        .try_fold(1u64, |acc, &d| acc.checked_mul(d).filter(|&n| n <= max))?;
    Some(if dims.contains(&0) { 0 } else { nonzero })
}

/// `a + b`, two caller sizes (lengths, counts) whose sum `what` is, at most
/// [`MAX_ELEMENTS`].
pub fn sum(what: &'static str, a: usize, b: usize) -> Result<usize> {
    a.checked_add(b)
        .filter(|&n| n as u64 <= MAX_ELEMENTS)
        .ok_or_else(|| overflow(what, "sum", &[a as u64, b as u64], MAX_ELEMENTS))
}

/// `x` as the `u32` a kernel reads, or [`Error::Overflow`] naming it.
pub fn to_u32(what: &'static str, x: usize) -> Result<u32> {
    u32::try_from(x).map_err(|_| Error::Overflow {
        what,
        value: x as u64,
    })
}

/// A workgroup count as the `u32` a dispatch grid takes, saturated: a
/// count past `u32::MAX` then fails the check against the device's limit
/// (at most 65535 per dimension) that every dispatch runs, instead of
/// wrapping into a small, wrong grid.
pub fn grid_u32(n: u64) -> u32 {
    u32::try_from(n).unwrap_or(u32::MAX)
}

fn overflow(what: &'static str, op: &'static str, operands: &[u64], max: u64) -> Error {
    Error::SizeOverflow {
        what,
        op,
        operands: operands.to_vec(),
        max,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What `MAX_ELEMENTS` is on wasm32, where `isize::MAX` is 2³¹ − 1.
    const WASM32_MAX: u64 = (i32::MAX as u64) / WIDEST_ELEMENT;

    fn is_overflow(r: Result<u64>, want_what: &str) -> bool {
        matches!(r, Err(Error::SizeOverflow { what, op: "element count", .. }) if what == want_what)
    }

    #[test]
    fn the_limits_are_the_targets() {
        #[cfg(target_pointer_width = "64")]
        assert_eq!(MAX_ELEMENTS, (1 << 61) - 1);
        #[cfg(target_pointer_width = "32")]
        assert_eq!(MAX_ELEMENTS, WASM32_MAX);
        assert_eq!(WASM32_MAX, (1 << 29) - 1);
    }

    #[test]
    fn a_wrapping_shape_is_an_error_on_both_widths() {
        // 2^21 · 2^21 · 2^21 · 8 = 2^66: u64 wraps it to 0.
        let hostile = [1 << 21, 1 << 21, 1 << 21, 8];
        assert_eq!(
            hostile
                .iter()
                .fold(0u64.wrapping_add(1), |a, &d| a.wrapping_mul(d)),
            0
        );
        for max in [MAX_ELEMENTS, WASM32_MAX] {
            assert!(is_overflow(elements_within("q", &hostile, max), "q"));
        }
        // 2^32 · 2^32 wraps u64 to 0 too.
        assert!(is_overflow(
            elements_within("k", &[1 << 32, 1 << 32], u64::MAX),
            "k"
        ));
        assert!(matches!(
            elements_u64("v", &hostile),
            Err(Error::SizeOverflow { what: "v", ref operands, .. }) if operands == &hostile
        ));
    }

    #[test]
    fn the_32_bit_limit_rejects_what_64_bits_hold() {
        // 2^32 f32 elements: 16 GiB, past a 2 GiB wasm32 allocation.
        let shape = [1, 1 << 20, 32, 128];
        assert_eq!(
            elements_within("q", &shape, MAX_ELEMENTS).ok(),
            Some(1 << 32)
        );
        assert!(is_overflow(elements_within("q", &shape, WASM32_MAX), "q"));
        // The largest tensor wasm32 holds, and one element more.
        assert_eq!(
            elements_within("q", &[WASM32_MAX], WASM32_MAX).ok(),
            Some(WASM32_MAX)
        );
        assert!(is_overflow(
            elements_within("q", &[WASM32_MAX + 1], WASM32_MAX),
            "q"
        ));
        // A shape both hold.
        for max in [MAX_ELEMENTS, WASM32_MAX] {
            assert_eq!(
                elements_within("q", &[2, 1024, 16, 64], max).ok(),
                Some(2 << 20)
            );
        }
    }

    #[test]
    fn zero_dims_do_not_hide_an_overflow() {
        assert_eq!(elements_within("q", &[0, 5, 7], u64::MAX).ok(), Some(0));
        assert_eq!(elements_within("q", &[], u64::MAX).ok(), Some(1));
        // (2^40, 2^40, 0) holds no element, but its strides overflow.
        assert!(is_overflow(
            elements_within("q", &[1 << 40, 1 << 40, 0], MAX_ELEMENTS),
            "q"
        ));
    }

    #[test]
    fn products_and_sums_are_checked() {
        assert_eq!(product("block_table", 3, 5).ok(), Some(15));
        assert!(matches!(
            product("block_table", usize::MAX, 2),
            Err(Error::SizeOverflow {
                what: "block_table",
                op: "product",
                ..
            })
        ));
        assert_eq!(sum("keys", 3, 5).ok(), Some(8));
        assert!(matches!(
            sum("keys", usize::MAX, 1),
            Err(Error::SizeOverflow { op: "sum", .. })
        ));
        assert_eq!(to_u32("x", 7).ok(), Some(7));
        assert_eq!(grid_u32(1 << 32), u32::MAX);
        assert_eq!(grid_u32(65535), 65535);
        assert!(matches!(
            to_u32("x", u32::MAX as usize + 1),
            Err(Error::Overflow { value, .. }) if value == 1 << 32
        ));
    }
}

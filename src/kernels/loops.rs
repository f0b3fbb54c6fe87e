//! How many loop iterations one invocation of a kernel takes, as llvmpipe
//! counts them, so that calls which would run past an adapter's loop limit
//! are split before they run (see `runtime::loop_limit`).
//!
//! Every kernel has one long loop, over key blocks (forward, dQ) or query
//! blocks (dK/dV, times the GQA group), plus loops whose trip counts do not
//! grow with the sequence. The count is `fixed + per_step · steps`.

/// The sequence a kernel's long loop walks.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum LoopDim {
    Rows,
    Keys,
}

/// A kernel's loop iterations per invocation as a function of the length
/// of the sequence it walks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoopCost {
    pub dim: LoopDim,
    /// Entries per step of the long loop (the block size).
    pub step: u32,
    /// Counted iterations per step, the step's own included.
    pub per_step: u64,
    /// Counted iterations that do not grow with the length (the loop-budget
    /// guard's own two included).
    pub fixed: u64,
}

impl LoopCost {
    /// Iterations one invocation takes over `len` entries.
    pub fn iterations(&self, len: usize) -> u64 {
        self.fixed + self.per_step * (len as u64).div_ceil(self.step as u64)
    }

    /// The longest length whose iterations stay within `limit`, in whole
    /// steps; 0 when not even one step fits.
    pub fn max_len(&self, limit: u32) -> usize {
        let budget = (limit as u64).saturating_sub(self.fixed);
        let steps = budget / self.per_step.max(1);
        (steps * self.step as u64).min(usize::MAX as u64) as usize
    }
}

/// Iterations llvmpipe counts for a loop whose trip count only the
/// invocation knows (a bound read from memory, or a start that depends on
/// the lane): every pass counts, `per_trip` more in each for what is nested,
/// plus the pass that leaves, in which each of the `nested` loops that stay
/// loops runs once more.
pub fn counted(trips: u64, per_trip: u64, nested: u64) -> u64 {
    trips * (1 + per_trip) + 1 + nested
}

/// Iterations llvmpipe counts for a loop whose trip count is a constant of
/// the pipeline, with a body of about `ops` instructions and `per_trip`
/// counted iterations nested in each trip: none when its compiler unrolls
/// it — at most [`UNROLLED_TRIP`] trips, nothing nested left a loop, and
/// `trips × (ops + 10) <= 832` (measured on Mesa 22.3: NIR's unroll budget,
/// with the loop counter naga adds) — else as [`counted`].
pub fn constant(trips: u32, ops: u32, per_trip: u64) -> u64 {
    if unrolled(trips, ops, per_trip) {
        0
    } else {
        counted(trips as u64, per_trip, (per_trip > 0) as u64)
    }
}

/// Whether llvmpipe unrolls a constant loop (see [`constant`]).
pub fn unrolled(trips: u32, ops: u32, per_trip: u64) -> bool {
    per_trip == 0 && trips <= UNROLLED_TRIP && trips * (ops + 10) <= 832
}

/// Iterations of the loop that fills dropout's keep factors (`dropout.wgsl`)
/// for `rows` × `cols` pairs on `wg` invocations, per tile (its loop over a
/// word's 32 keys as a constant loop); none without dropout.
pub fn keep_tile(dropout: bool, rows: u32, cols: u32, wg: u32) -> u64 {
    if !dropout {
        return 0;
    }
    let word = constant(32, 12, 0);
    counted((rows * cols.div_ceil(32)).div_ceil(wg) as u64, word, (word > 0) as u64)
}

/// Iterations a packed batch's binary search for the workgroup's sequence
/// may take (`sequence()` in common.wgsl: at most 32 halvings, and the
/// pass that leaves).
pub const VARLEN_SEARCH: u64 = 33;

/// Iterations of the loop-budget guard every kernel ends with (its loop
/// breaks at the end of its body, so its two passes are all it takes).
pub const GUARD: u64 = 2;

/// The longest constant-trip loop llvmpipe's compiler unrolls (Mesa 22.3).
pub const UNROLLED_TRIP: u32 = 32;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn max_len_inverts_iterations() {
        let c = LoopCost {
            dim: LoopDim::Keys,
            step: 8,
            per_step: 3,
            fixed: 5,
        };
        let limit = 65535;
        let n = c.max_len(limit);
        assert!(c.iterations(n) <= limit as u64);
        assert!(c.iterations(n + c.step as usize) > limit as u64);
        assert_eq!(n % 8, 0);
        let tiny = LoopCost {
            per_step: 70000,
            ..c
        };
        assert_eq!(tiny.max_len(limit), 0);
    }
}

//! IO accounting: how many storage-buffer elements ("HBM accesses") each
//! kernel reads and writes, computed from the plan with the same block ranges
//! the kernels use. Instrumented kernels (`Engine::with_io_counting`) count the
//! real accesses; tests require the two to be equal. This is what makes
//! FlashAttention's Theorem 2 — O(N²d²/M) accesses for flash against
//! Θ(Nd + N²) for standard attention — a measurement here, not a claim.

use super::matmul::{MatmulSpec, TILE_MN};
use super::params::Params;
use super::shaders::MatmulKernel;
use crate::plan::Plan;

/// Elements read from and written to storage buffers.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Accesses {
    pub reads: u64,
    pub writes: u64,
}

impl Accesses {
    pub fn total(&self) -> u64 {
        self.reads + self.writes
    }
}

impl std::ops::Add for Accesses {
    type Output = Self;
    fn add(self, o: Self) -> Self {
        Self {
            reads: self.reads + o.reads,
            writes: self.writes + o.writes,
        }
    }
}

impl std::ops::AddAssign for Accesses {
    fn add_assign(&mut self, o: Self) {
        *self = *self + o;
    }
}

/// The band arithmetic of `visible_keys` / `visible_rows` in common.wgsl.
struct Band<'a>(&'a Params, bool);

impl Band<'_> {
    /// Local keys [lo, hi) that absolute rows first..=last may see.
    fn keys(&self, first: i64, last: i64) -> (i64, i64) {
        let p = self.0;
        let n = p.seqlen_k as i64;
        if !self.1 {
            return (0, n);
        }
        let k0 = p.k_start as i64;
        let lo = (first + p.mask_offset as i64 - p.window_left as i64 - k0).clamp(0, n);
        let hi = (last + p.mask_offset as i64 + p.window_right as i64 + 1 - k0).clamp(0, n);
        (lo, hi.max(lo))
    }

    /// Local rows [lo, hi) that may see absolute keys first..=last.
    fn rows(&self, first: i64, last: i64) -> (i64, i64) {
        let p = self.0;
        let n = p.seqlen_q as i64;
        if !self.1 {
            return (0, n);
        }
        let q0 = p.q_start as i64;
        let lo = (first - p.mask_offset as i64 - p.window_right as i64 - q0).clamp(0, n);
        let hi = (last - p.mask_offset as i64 + p.window_left as i64 + 1 - q0).clamp(0, n);
        (lo, hi.max(lo))
    }
}

/// Blocks of `b` covering [lo, hi), as the kernels loop over them, with the
/// number of in-range entries in each.
fn blocks(lo: i64, hi: i64, b: u64, n: u64) -> impl Iterator<Item = (u64, u64)> {
    let begin = lo as u64 / b;
    let end = if hi > lo {
        (hi as u64).div_ceil(b)
    } else {
        begin
    };
    (begin..end).map(move |i| (i * b, b.min(n - i * b)))
}

/// Every block of `b` over `n` entries: (start, entries).
fn all_blocks(n: u64, b: u64) -> impl Iterator<Item = (u64, u64)> {
    blocks(0, n as i64, b, n)
}

/// The flash forward: each workgroup reads its Q rows once and K and V for
/// every visible key block; writes O and LSE once.
pub(crate) fn flash_forward(p: &Params, plan: &Plan, masked: bool) -> Accesses {
    let (sq, sk, d) = (p.seqlen_q as u64, p.seqlen_k as u64, plan.head_dim as u64);
    let band = Band(p, masked);
    let mut per_head = Accesses::default();
    for (q0, rows) in all_blocks(sq, plan.br as u64) {
        per_head.reads += rows * d;
        per_head.writes += rows * d + rows;
        let first = (p.q_start as u64 + q0) as i64;
        let (lo, hi) = band.keys(first, first + rows as i64 - 1);
        for (_, keys) in blocks(lo, hi, plan.bc as u64, sk) {
            per_head.reads += 2 * keys * d;
        }
    }
    let heads = p.batch as u64 * p.heads_q as u64;
    Accesses {
        reads: per_head.reads * heads,
        writes: per_head.writes * heads,
    }
}

/// The flash backward: D = rowsum(dO·O); dK/dV workgroups read their K, V
/// once and Q, dO, LSE, D of every visible query block of every head in the
/// group; dQ workgroups read their Q, dO, LSE, D once and K, V per visible block.
pub(crate) fn flash_backward(p: &Params, plan: &Plan, masked: bool) -> Accesses {
    let (sq, sk, d) = (p.seqlen_q as u64, p.seqlen_k as u64, plan.head_dim as u64);
    let (b, hq, group) = (p.batch as u64, p.heads_q as u64, p.group as u64);
    // Workgroups own blocks of br rows (dQ) or keys (dK/dV) and step through
    // the other side in blocks of bc (equal in tiled plans).
    let (outer, inner) = (plan.br as u64, plan.bc as u64);
    let band = Band(p, masked);
    let mut total = Accesses {
        reads: b * hq * sq * 2 * d,
        writes: b * hq * sq,
    };
    let mut per_kv_head = Accesses::default();
    for (k0, keys) in all_blocks(sk, outer) {
        per_kv_head.reads += 2 * keys * d;
        per_kv_head.writes += 2 * keys * d;
        let first = (p.k_start as u64 + k0) as i64;
        let (lo, hi) = band.rows(first, first + keys as i64 - 1);
        for (_, rows) in blocks(lo, hi, inner, sq) {
            per_kv_head.reads += group * (2 * rows * d + 2 * rows);
        }
    }
    let mut per_q_head = Accesses::default();
    for (q0, rows) in all_blocks(sq, outer) {
        per_q_head.reads += 2 * rows * d + 2 * rows;
        per_q_head.writes += rows * d;
        let first = (p.q_start as u64 + q0) as i64;
        let (lo, hi) = band.keys(first, first + rows as i64 - 1);
        for (_, keys) in blocks(lo, hi, inner, sk) {
            per_q_head.reads += 2 * keys * d;
        }
    }
    let kv_heads = b * hq / group;
    total.reads += per_kv_head.reads * kv_heads + per_q_head.reads * b * hq;
    total.writes += per_kv_head.writes * kv_heads + per_q_head.writes * b * hq;
    total
}

/// The tiled matmul: A is read once per column tile, B once per row tile.
pub(crate) fn matmul(spec: &MatmulSpec) -> Accesses {
    let (m, n, k) = (
        spec.params.m as u64,
        spec.params.n as u64,
        spec.params.k as u64,
    );
    let z = spec.grid[2] as u64;
    let reads = match spec.kernel {
        // Every 64-row tile of A meets every 64-column tile of B.
        MatmulKernel::Tiled { .. } => {
            let tiles = |x: u64| x.div_ceil(TILE_MN as u64);
            m * k * tiles(n) + n * k * tiles(m)
        }
        // A once; all of B for every subgroup of rows.
        MatmulKernel::Lanes { lanes, rows, .. } => {
            m * k + n * k * m.div_ceil((lanes * rows) as u64)
        }
    };
    Accesses {
        reads: z * reads,
        writes: z * m * n,
    }
}

/// The naive softmax over stored S: three passes over each row of S, P and
/// LSE written.
pub(crate) fn naive_softmax(p: &Params) -> Accesses {
    let rows = p.batch as u64 * p.heads_q as u64 * p.seqlen_q as u64;
    let sk = p.seqlen_k as u64;
    Accesses {
        reads: rows * 3 * sk,
        writes: rows * (sk + 1),
    }
}

/// The naive dS pass (P and dP read twice, S once more with softcap) and
/// either the transposes of P and dS (no GQA) or the dK/dV pass (dS, Q, P, dO
/// for every query row of the group per element).
pub(crate) fn naive_backward_rows(p: &Params, head_dim: u32, softcap: bool) -> Accesses {
    let (b, hq, sq, sk, d) = (
        p.batch as u64,
        p.heads_q as u64,
        p.seqlen_q as u64,
        p.seqlen_k as u64,
        head_dim as u64,
    );
    let rows = b * hq * sq;
    let ds = Accesses {
        reads: rows * sk * (4 + softcap as u64),
        writes: rows * sk,
    };
    let dkdv = if p.group == 1 {
        // P and dS transposed (the matmuls that follow count themselves).
        Accesses {
            reads: 2 * rows * sk,
            writes: 2 * rows * sk,
        }
    } else {
        let kv_elements = b * (hq / p.group as u64) * sk * d;
        Accesses {
            reads: kv_elements * p.group as u64 * sq * 4,
            writes: kv_elements * 2,
        }
    };
    ds + dkdv
}

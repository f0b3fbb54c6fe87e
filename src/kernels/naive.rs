//! The naive baseline's own kernels (`naive_fwd.wgsl`, `naive_bwd.wgsl`):
//! the softmax over a stored S, dS from stored P and dP, the transposes that
//! let the tuned matmul compute dK and dV, and a plain dK/dV kernel for GQA.
//! Its products are [`super::matmul`] kernels. With dropout (the variant's
//! `HAS_DROPOUT`) the softmax and dS kernels redraw the keep bits where they
//! store P, so no kernel stores a mask (docs/dropout.md).

use super::compose::{binding, Access, Composer, KernelSource, Variant};
use super::params::Params;
use crate::api::output::Accesses;
use crate::plan::StorageKind;

const FORWARD: &str = include_str!("../../shaders/naive_fwd.wgsl");
const BACKWARD: &str = include_str!("../../shaders/naive_bwd.wgsl");

/// Rows (or elements) per workgroup of the row kernels.
pub const ROWS_PER_GROUP: u32 = 64;
/// Workgroup tile of the GQA dK/dV kernel.
pub const TILE: u32 = 16;

/// Which naive kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum NaiveEntry {
    /// P = softmax(S) per row, LSE written; with dropout, P ∘ keep stored.
    Softmax,
    /// dS = P·(dP' − rowsum(P·dP')) in place of dP, with dP' = dP ∘ keep /
    /// (1 − p) under dropout, which also stores P ∘ keep in place of P.
    Ds,
    /// P transposed into S's buffer.
    TransposeP,
    /// dS transposed into P's buffer.
    TransposeDs,
    /// dK, dV summed over each kv head's group (dV times 1 / (1 − p)).
    DkDv,
}

/// One naive kernel for head dims (q/k and v), storage kind and variant.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Naive {
    pub entry: NaiveEntry,
    pub head_dim: u32,
    pub head_dim_v: u32,
    pub storage: StorageKind,
    pub variant: Variant,
}

impl Naive {
    pub const NAME: &'static str = "naive attention";

    pub fn entry_point(&self) -> &'static str {
        match self.entry {
            NaiveEntry::Softmax => "softmax",
            NaiveEntry::Ds => "ds",
            NaiveEntry::TransposeP => "p_transposed",
            NaiveEntry::TransposeDs => "ds_transposed",
            NaiveEntry::DkDv => "dkdv",
        }
    }

    /// The forward module (softmax), or the backward one (every entry).
    pub fn source(&self) -> KernelSource {
        use binding::*;
        let mut c = Composer::new(self.storage);
        c.override_u32("D", self.head_dim)
            .override_u32("DV", self.head_dim_v)
            .common(self.variant);
        c.storage(
            self.storage,
            &[
                ("q", Q, Access::Read),
                ("k", K, Access::Read),
                ("v", V, Access::Read),
                ("o", O, Access::Write),
            ],
        )
        .buffers(
            StorageKind::F32,
            &[
                ("lse", LSE, Access::Write),
                ("s", S, Access::ReadWrite),
                ("p", P, Access::ReadWrite),
            ],
        )
        .push(FORWARD);
        if self.entry != NaiveEntry::Softmax {
            let grads = [
                ("do", DO, Access::Read),
                ("dq", DQ, Access::Write),
                ("dk", DK, Access::Write),
                ("dv", DV, Access::Write),
            ];
            c.buffers(self.storage, &grads)
                .buffers(StorageKind::F32, &[("ds", DS, Access::ReadWrite)])
                .push(BACKWARD);
        }
        c.finish(self.entry_point())
    }

    /// Loop iterations per invocation over a problem with these parameters.
    pub fn loop_iterations(&self, p: &Params) -> u64 {
        let sk = p.seqlen_k as u64;
        2 + match self.entry {
            NaiveEntry::Softmax => 3 * sk,
            NaiveEntry::Ds => 2 * sk,
            NaiveEntry::TransposeP | NaiveEntry::TransposeDs => 0,
            NaiveEntry::DkDv => p.group as u64 * (1 + p.seqlen_q as u64),
        }
    }

    /// Storage accesses over a problem with these parameters.
    pub fn accesses(&self, p: &Params) -> Accesses {
        let (b, hq, sq, sk) = (
            p.batch as u64,
            p.heads_q as u64,
            p.seqlen_q as u64,
            p.seqlen_k as u64,
        );
        let rows = b * hq * sq;
        match self.entry {
            // Three passes over each row of S; P and LSE written.
            NaiveEntry::Softmax => Accesses {
                reads: rows * 3 * sk,
                writes: rows * (sk + 1),
            },
            // P and dP read twice, S once more with softcap; P ∘ keep
            // written back with dropout.
            NaiveEntry::Ds => Accesses {
                reads: rows * sk * (4 + self.variant.softcap as u64),
                writes: rows * sk * (1 + self.variant.dropout as u64),
            },
            NaiveEntry::TransposeP | NaiveEntry::TransposeDs => Accesses {
                reads: rows * sk,
                writes: rows * sk,
            },
            // dS and Q for every query row of the group per dK element,
            // P and dO per dV element.
            NaiveEntry::DkDv => {
                let keys = b * (hq / p.group as u64) * sk;
                let elements = keys * (self.head_dim + self.head_dim_v) as u64;
                Accesses {
                    reads: elements * p.group as u64 * sq * 2,
                    writes: elements,
                }
            }
        }
    }
}

//! What the planner is asked: head dim, precision, sequence lengths, and the
//! caller's overrides. The two choices it makes before sizing tiles (kernel
//! family and storage kind) are defined with the plan in `api::kernel_plan`.

use crate::api::shape::AttentionShape;
use crate::api::tensor::Precision;
pub use crate::api::kernel_plan::{KernelFamily, StorageKind};

/// Caller overrides of the planner's choices; `None` keeps the planner's
/// value. Build one from the default with the setters:
///
/// ```
/// use flashattn::{KernelFamily, PlanOverrides};
///
/// let tiles = PlanOverrides::default().kernel(KernelFamily::Tiled).br(32).bc(32);
/// assert_eq!(tiles.br, Some(32));
/// assert!(tiles.fixes_tiles());
/// ```
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub struct PlanOverrides {
    /// Query rows per workgroup tile (tiled kernels).
    pub br: Option<u32>,
    /// Keys per K/V tile (tiled kernels).
    pub bc: Option<u32>,
    /// Invocations sharing one query row (tiled kernels).
    pub threads_per_row: Option<u32>,
    /// Cap M below the device's limit (Theorem 2 sweeps, browser-like limits).
    pub max_workgroup_storage: Option<u32>,
    /// For f16: force the packed (`false`) or native (`true`) path.
    pub f16_native: Option<bool>,
    /// Force the kernel family (`Lanes` needs a CPU adapter with fixed
    /// subgroups and head dims that are multiples of 4 up to 128).
    pub kernel: Option<KernelFamily>,
    /// Registers kernels: query rows per invocation (RM).
    pub rows_per_thread: Option<u32>,
    /// Registers kernels: row reductions by subgroup shuffles (`true`, needs
    /// SUBGROUP and a row within the smallest subgroup) or workgroup memory.
    pub subgroup_reduce: Option<bool>,
    /// Registers kernels: two K/V tile buffers (`true`) or one.
    pub double_buffer: Option<bool>,
}

/// A setter per field: `Some(value)`, the rest unchanged.
macro_rules! setters {
    ($($(#[$doc:meta])* $field:ident: $ty:ty;)*) => {
        $($(#[$doc])*
        pub fn $field(mut self, $field: $ty) -> Self {
            self.$field = Some($field);
            self
        })*
    };
}

impl PlanOverrides {
    setters! {
        /// Fix [`PlanOverrides::br`].
        br: u32;
        /// Fix [`PlanOverrides::bc`].
        bc: u32;
        /// Fix [`PlanOverrides::threads_per_row`].
        threads_per_row: u32;
        /// Fix [`PlanOverrides::max_workgroup_storage`].
        max_workgroup_storage: u32;
        /// Fix [`PlanOverrides::f16_native`].
        f16_native: bool;
        /// Fix [`PlanOverrides::kernel`].
        kernel: KernelFamily;
        /// Fix [`PlanOverrides::rows_per_thread`].
        rows_per_thread: u32;
        /// Fix [`PlanOverrides::subgroup_reduce`].
        subgroup_reduce: bool;
        /// Fix [`PlanOverrides::double_buffer`].
        double_buffer: bool;
    }

    /// Whether any tile parameter is fixed, which only the tiled kernels have.
    pub fn fixes_tiles(&self) -> bool {
        self.br.is_some()
            || self.bc.is_some()
            || self.threads_per_row.is_some()
            || self.max_workgroup_storage.is_some()
    }

    /// Whether any parameter only the registers kernels have is fixed.
    pub fn fixes_registers(&self) -> bool {
        self.rows_per_thread.is_some()
            || self.subgroup_reduce.is_some()
            || self.double_buffer.is_some()
    }
}

/// What the planner is asked to plan for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PlanRequest {
    /// The head dim of q and k.
    pub head_dim: usize,
    /// The head dim of v and o.
    pub head_dim_v: usize,
    pub precision: Precision,
    /// Query rows per (batch, head); Br is not made larger than needed.
    pub seqlen_q: usize,
    /// Keys per (batch, head); Bc is not made larger than needed.
    pub seqlen_k: usize,
    pub overrides: PlanOverrides,
}

impl PlanRequest {
    pub fn new(head_dim: usize, precision: Precision) -> Self {
        Self {
            head_dim,
            head_dim_v: head_dim,
            precision,
            seqlen_q: usize::MAX,
            seqlen_k: usize::MAX,
            overrides: PlanOverrides::default(),
        }
    }

    /// The request for a whole attention problem.
    pub fn for_shape(
        shape: &AttentionShape,
        precision: Precision,
        overrides: PlanOverrides,
    ) -> Self {
        Self::new(shape.head_dim, precision)
            .head_dim_v(shape.head_dim_v)
            .seqlens(shape.seqlen_q, shape.seqlen_k)
            .overrides(overrides)
    }

    /// v's own head dim.
    pub fn head_dim_v(mut self, head_dim_v: usize) -> Self {
        self.head_dim_v = head_dim_v;
        self
    }

    pub fn seqlens(mut self, seqlen_q: usize, seqlen_k: usize) -> Self {
        self.seqlen_q = seqlen_q;
        self.seqlen_k = seqlen_k;
        self
    }

    pub fn overrides(mut self, overrides: PlanOverrides) -> Self {
        self.overrides = overrides;
        self
    }
}

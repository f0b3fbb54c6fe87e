//! The cooperative-matrix forms the coop kernel is built for (its own
//! module so that [`super::tiles::Plan`] can name one without importing the
//! coop planner, which imports the tiles).

/// The cooperative-matrix configuration a coop kernel is built for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CoopForm {
    /// 16×16×16, f16 inputs, f32 accumulators (NVIDIA, AMD, Intel).
    F16x16,
    /// 8×8×8, f32 inputs and accumulators (Apple's simdgroup matrices).
    F32x8,
}

impl CoopForm {
    /// The matrices' side N.
    pub fn n(self) -> u32 {
        match self {
            CoopForm::F16x16 => 16,
            CoopForm::F32x8 => 8,
        }
    }

    /// Bytes of one input element in workgroup memory (Q, K/V and P tiles).
    pub fn element_bytes(self) -> u32 {
        match self {
            CoopForm::F16x16 => 2,
            CoopForm::F32x8 => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CoopForm::F16x16 => "16×16 f16 cooperative matrices with f32 accumulators",
            CoopForm::F32x8 => "8×8 f32 cooperative matrices",
        }
    }
}

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
    /// The 8×8 f32 kernel with its cooperative operations written out in
    /// plain WGSL (`kernels::flash_forward_coop::emulated_body`): never
    /// planned from a device's caps; `Engine::with_emulated_coop` swaps it
    /// in for F32x8 so the kernel runs on devices without cooperative
    /// matrices (lavapipe), for tests.
    Emulated,
}

impl CoopForm {
    /// The matrices' side N.
    pub fn n(self) -> u32 {
        match self {
            CoopForm::F16x16 => 16,
            CoopForm::F32x8 | CoopForm::Emulated => 8,
        }
    }

    /// Bytes of one input element in workgroup memory (Q, K/V and P tiles).
    pub fn element_bytes(self) -> u32 {
        match self {
            CoopForm::F16x16 => 2,
            CoopForm::F32x8 | CoopForm::Emulated => 4,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            CoopForm::F16x16 => "16×16 f16 cooperative matrices with f32 accumulators",
            CoopForm::F32x8 => "8×8 f32 cooperative matrices",
            CoopForm::Emulated => "8×8 f32 matrices emulated in plain WGSL",
        }
    }
}

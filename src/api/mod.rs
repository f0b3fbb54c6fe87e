//! The backend-neutral API: what callers hand in (tensors, shapes, options,
//! backward inputs) and what every backend hands back (outputs and stats).

pub mod inputs;
pub mod options;
pub mod output;
pub mod shape;
pub mod tensor;

//! The `flashattn` command line as a library: its commands, `.npy` I/O,
//! benchmark cases and reports (attention and decoding), charts and the
//! precision study (one row's softmax, and whole problems in every storage
//! format). The root
//! crate's criterion benches and precision example use it; apps embedding
//! attention need only the `flashattn` crate.

pub mod args;
pub mod baselines;
pub mod bench;
pub mod charts;
pub mod commands;
pub mod decode_bench;
pub mod error;
pub mod layout_bench;
pub mod lowp;
pub mod npy;
pub mod outputs;
pub mod plot;
pub mod precision;
pub mod report;

pub use error::{CliError, Result};

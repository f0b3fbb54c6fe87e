//! A failed CUDA driver call as the crate's error, naming the call.

use crate::error::Error;
use cudarc::driver::DriverError;

/// A driver error, with the call it came from.
pub(crate) fn driver(during: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::CudaDriver {
        during,
        message: format!("{e:?}"),
    }
}

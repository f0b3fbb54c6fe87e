//! The wgpu runtime: the device and its settings ([`Gpu`]), adapters and
//! device creation, compiled pipelines by kernel key, pooled buffers, one
//! call's dispatches and readbacks, and the adapter's loop limit, and device KV caches.

pub mod adapter;
pub mod buffers;
pub mod call;
mod encode;
pub mod gpu;
pub mod kv_cache;
pub mod loop_limit;
pub mod pipelines;
pub mod scope;
pub mod submit;

pub use buffers::padded;
pub use call::{whole, Call, Dispatch};
pub use encode::record;
pub use gpu::Gpu;
#[cfg(feature = "lab")]
pub use gpu::Settings;
pub use kv_cache::KvCache;

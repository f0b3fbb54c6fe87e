//! The backend-neutral API: what callers hand in (tensors, shapes, options,
//! backward inputs, decoding steps and KV caches) and what every backend hands back (outputs and stats).

pub mod band;
pub mod block_mask;
pub mod decode;
pub mod dropout;
pub mod dropout_rule;
pub mod inputs;
pub mod kernel_plan;
pub mod merge;
pub mod options;
pub mod output;

pub mod pair_rule;
pub mod problem;
pub mod scores;
pub mod shape;
pub mod size;
pub mod tensor;
pub mod tile_lists;
pub mod varlen;
pub mod verdict;

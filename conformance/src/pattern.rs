//! The deterministic inputs of the cases (`anyccl_core::pattern`, shared with the benchmark).
pub use anyccl_core::pattern::*;

//! The cases, by group. Each is a plain function of one rank's view.

pub mod collectives;
pub mod errors;
pub mod groups;
pub mod lifecycle;
pub mod p2p;
pub mod register;
pub mod streams;
pub mod warmup;
pub mod window;

use anyccl_core::{Capabilities, DType, ReduceOp};

/// Element counts every data case runs through: empty, one, odd, prime, and more than a
/// ring step's worth.
pub const SIZES: &[usize] = &[0, 1, 7, 31, 1031];

/// Elements in 4 MiB of `dtype`.
pub fn four_mib(dtype: DType) -> usize {
    (4 << 20) / dtype.size()
}

pub(crate) fn need_dtype(c: &Capabilities, d: DType) -> Option<String> {
    (!c.supports_dtype(d)).then(|| format!("backend does not support dtype {d}"))
}

pub(crate) fn need_op(c: &Capabilities, d: DType, op: ReduceOp) -> Option<String> {
    need_dtype(c, d).or_else(|| (!c.supports_reduce_op(op)).then(|| format!("backend does not support reduce op {op}")))
}

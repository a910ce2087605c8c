//! The cases, by group, and the list of them all ([`all_cases`]). Each is a plain function
//! of one rank's view.

pub mod collectives;
pub mod errors;
pub mod groups;
pub mod lifecycle;
pub mod p2p;
pub mod rebuild;
pub mod register;
pub mod sleep;
pub mod streams;
pub mod warmup;
pub mod window;

use crate::registry::Case;
use anyccl_core::{Capabilities, DType, ReduceOp};

/// Every registered case: each group's `register`, one line each.
pub fn all_cases() -> Vec<Case> {
    let mut v = Vec::new();
    collectives::register(&mut v);
    p2p::register(&mut v);
    groups::register(&mut v);
    errors::register(&mut v);
    lifecycle::register(&mut v);
    warmup::register(&mut v);
    rebuild::register(&mut v);
    register::register(&mut v);
    window::register(&mut v);
    sleep::register(&mut v);
    streams::register(&mut v);
    v
}

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

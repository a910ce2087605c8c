//! Argument checks shared by the operations: every call is validated once, here, before
//! any communication.

use super::Communicator;
use crate::buffer::{overlaps, Buf, BufMut};
use crate::dtype::{DType, ReduceOp};
use crate::error::{Error, Result};

/// What every call is checked against, read once from the backend: a lookup per call, not
/// a search of its lists through the trait object.
#[derive(Debug, Clone, Copy)]
pub(super) struct Accepts {
    /// Bit `d as u32` for every accepted dtype `d`.
    dtypes: u32,
    /// Bit `op as u32` for every accepted reduce op.
    reduce_ops: u32,
    /// The communicator's device.
    device: crate::buffer::Device,
}

impl Accepts {
    pub(super) fn of(caps: &crate::capability::Capabilities, device: crate::buffer::Device) -> Accepts {
        Accepts {
            dtypes: caps.dtypes.iter().fold(0, |m, &d| m | 1 << d as u32),
            reduce_ops: caps.reduce_ops.iter().fold(0, |m, &o| m | 1 << o as u32),
            device,
        }
    }
}

impl Communicator {
    pub(super) fn invalid(&self, op: &'static str, arg: &'static str, msg: impl Into<String>) -> Error {
        Error::InvalidArgument { op, arg, rank: self.rank(), group: self.spec.name.clone(), msg: msg.into() }
    }

    pub(super) fn check_dtype(&self, op: &'static str, arg: &'static str, dtype: DType) -> Result<()> {
        if self.accepts.dtypes & 1 << dtype as u32 == 0 {
            return Err(self.invalid(
                op,
                arg,
                format!("dtype {dtype} is not supported by the {} backend", self.info().backend),
            ));
        }
        Ok(())
    }

    pub(super) fn check_reduce_op(&self, op: &'static str, rop: ReduceOp) -> Result<()> {
        if self.accepts.reduce_ops & 1 << rop as u32 == 0 {
            return Err(self.invalid(
                op,
                "op",
                format!("reduce op {rop} is not supported by the {} backend", self.info().backend),
            ));
        }
        Ok(())
    }

    pub(super) fn check_device(&self, op: &'static str, arg: &'static str, dev: crate::buffer::Device) -> Result<()> {
        let want = self.accepts.device;
        if dev != want {
            return Err(self.invalid(op, arg, format!("buffer is on {dev}, the communicator uses {want}")));
        }
        Ok(())
    }

    pub(super) fn check_rank(&self, op: &'static str, arg: &'static str, r: usize) -> Result<()> {
        if r >= self.size() {
            return Err(self.invalid(
                op,
                arg,
                format!("{arg} {r} is out of range for a group of {} ranks", self.size()),
            ));
        }
        Ok(())
    }

    /// Out of place, send and recv hold the same number of elements.
    pub(super) fn check_same_count(&self, op: &'static str, send: &Option<Buf<'_>>, recv: &BufMut<'_>) -> Result<()> {
        match send {
            Some(s) if s.count() != recv.count() => Err(self.invalid(
                op,
                "recv",
                format!("send has {} elements, recv {}; they must match", s.count(), recv.count()),
            )),
            _ => Ok(()),
        }
    }

    pub(super) fn check_pair(&self, op: &'static str, send: &Option<Buf<'_>>, recv: &BufMut<'_>) -> Result<()> {
        self.check_dtype(op, "recv", recv.dtype())?;
        self.check_device(op, "recv", recv.device())?;
        if let Some(s) = send {
            self.check_device(op, "send", s.device())?;
            if s.dtype() != recv.dtype() {
                return Err(self.invalid(
                    op,
                    "send",
                    format!("send dtype {} differs from recv dtype {}", s.dtype(), recv.dtype()),
                ));
            }
            if overlaps(s.ptr() as usize, s.bytes(), recv.ptr() as usize, recv.bytes()) {
                return Err(self.invalid(
                    op,
                    "send",
                    "send and recv buffers overlap; pass send = None for an in-place operation",
                ));
            }
        }
        Ok(())
    }
}

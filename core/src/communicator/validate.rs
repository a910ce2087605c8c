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
        self.ctx().invalid(op, arg, msg)
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

    /// all_gather: out of place, `recv` holds `size` times `send`; in place, `recv` divides
    /// by the group size.
    pub(super) fn check_gathered(&self, send: &Option<Buf<'_>>, recv: &BufMut<'_>) -> Result<()> {
        const OP: &str = "all_gather";
        let n = self.size();
        match &send {
            Some(s) if s.count() * n != recv.count() => {
                return Err(self.invalid(
                    OP,
                    "recv",
                    format!(
                        "recv has {} elements; it must hold {} = group size {n} x send count {}",
                        recv.count(),
                        s.count() * n,
                        s.count()
                    ),
                ));
            }
            None if !recv.count().is_multiple_of(n) => {
                return Err(self.invalid(
                    OP,
                    "recv",
                    format!("in-place recv of {} elements is not divisible by the group size {n}", recv.count()),
                ));
            }
            _ => {}
        }
        Ok(())
    }

    /// reduce_scatter: out of place, `send` holds `size` times `recv`; in place, `recv`
    /// divides by the group size.
    pub(super) fn check_scattered(&self, send: &Option<Buf<'_>>, recv: &BufMut<'_>) -> Result<()> {
        const OP: &str = "reduce_scatter";
        let n = self.size();
        match &send {
            Some(s) if s.count() != recv.count() * n => {
                return Err(self.invalid(
                    OP,
                    "send",
                    format!(
                        "send has {} elements; it must hold group size {n} x recv count {} = {}",
                        s.count(),
                        recv.count(),
                        recv.count() * n
                    ),
                ));
            }
            None if !recv.count().is_multiple_of(n) => {
                return Err(self.invalid(
                    OP,
                    "recv",
                    format!("in-place buffer of {} elements is not divisible by the group size {n}", recv.count()),
                ));
            }
            _ => {}
        }
        Ok(())
    }

    /// all_to_all: equal splits divide by the group size; explicit ones list every rank and
    /// add up to the buffers.
    pub(super) fn check_all_to_all(
        &self,
        send: &Buf<'_>,
        recv: &BufMut<'_>,
        splits: Option<&crate::collective::AllToAllSplits>,
    ) -> Result<()> {
        const OP: &str = "all_to_all";
        let n = self.size();
        match splits {
            None => {
                if send.count() != recv.count() {
                    return Err(self.invalid(
                        OP,
                        "recv",
                        format!(
                            "send has {} elements, recv {}; equal splits need equal counts",
                            send.count(),
                            recv.count()
                        ),
                    ));
                }
                if !send.count().is_multiple_of(n) {
                    return Err(self.invalid(
                        OP,
                        "send",
                        format!("{} elements do not split equally over {n} ranks", send.count()),
                    ));
                }
                if !self.capabilities().all_to_all {
                    return Err(self.invalid(OP, "send", "the backend has no all_to_all"));
                }
            }
            Some(sp) => {
                if !self.capabilities().all_to_all_v {
                    return Err(self.invalid(OP, "splits", "the backend has no all_to_all with explicit splits"));
                }
                if sp.send_counts.len() != n || sp.recv_counts.len() != n {
                    return Err(self.invalid(
                        OP,
                        "splits",
                        format!(
                            "splits list {} send and {} recv counts; the group has {n} ranks",
                            sp.send_counts.len(),
                            sp.recv_counts.len()
                        ),
                    ));
                }
                let me = self.rank();
                if sp.send_counts[me] != sp.recv_counts[me] {
                    return Err(self.invalid(
                        OP,
                        "splits",
                        format!(
                            "this rank sends {} elements to itself but expects to receive {}",
                            sp.send_counts[me], sp.recv_counts[me]
                        ),
                    ));
                }
                let (ss, rs): (usize, usize) = (sp.send_counts.iter().sum(), sp.recv_counts.iter().sum());
                if ss != send.count() {
                    return Err(self.invalid(
                        OP,
                        "splits",
                        format!("send counts add up to {ss}, send holds {}", send.count()),
                    ));
                }
                if rs != recv.count() {
                    return Err(self.invalid(
                        OP,
                        "splits",
                        format!("recv counts add up to {rs}, recv holds {}", recv.count()),
                    ));
                }
            }
        }
        Ok(())
    }

    pub(super) fn check_p2p_peer(&self, op: &'static str, peer: usize, allow_self: bool) -> Result<()> {
        self.check_rank(op, "peer", peer)?;
        if !allow_self && peer == self.rank() {
            return Err(self.invalid(
                op,
                "peer",
                format!("peer {peer} is this rank; an unbatched send or recv to itself can never complete"),
            ));
        }
        Ok(())
    }

    /// A batch of sends and receives: the backend batches, it is not empty, every peer and
    /// buffer is valid, and sends to this rank pair up with receives from it. The batch's
    /// first dtype and its bytes.
    pub(super) fn check_p2p_batch(&self, ops: &[crate::collective::P2POp<'_>]) -> Result<(Option<DType>, usize)> {
        use crate::collective::P2POp;
        const OP: &str = "p2p_group";
        if !self.capabilities().p2p_group {
            return Err(self.invalid(OP, "ops", "the backend has no batched point-to-point"));
        }
        if ops.is_empty() {
            return Err(self.invalid(OP, "ops", "empty batch"));
        }
        let mut bytes = 0;
        let mut dtype = None;
        // Sends to and receives from this rank must pair up in order with equal sizes; an
        // unmatched one would wait on itself forever.
        let me = self.rank();
        for o in ops {
            self.check_p2p_peer(OP, o.peer(), true)?;
            let (d, dev, b) = match o {
                P2POp::Send(b, _) => (b.dtype(), b.device(), b.bytes()),
                P2POp::Recv(b, _) => (b.dtype(), b.device(), b.bytes()),
            };
            self.check_dtype(OP, "ops", d)?;
            self.check_device(OP, "ops", dev)?;
            bytes += b;
            dtype.get_or_insert(d);
        }
        // Compared without collecting them (this runs on every batch; two empty lists compared
        // through `memcmp` were a sixth of a small sendrecv's time, sampled).
        let to_self = |send: bool| {
            ops.iter().filter_map(move |o| match o {
                P2POp::Send(b, p) if send && *p == me => Some(b.bytes()),
                P2POp::Recv(b, p) if !send && *p == me => Some(b.bytes()),
                _ => None,
            })
        };
        if !to_self(true).eq(to_self(false)) {
            let (sends, recvs): (Vec<usize>, Vec<usize>) = (to_self(true).collect(), to_self(false).collect());
            return Err(self.invalid(
                OP,
                "ops",
                format!("sends to this rank ({sends:?} bytes) and receives from it ({recvs:?} bytes) do not pair up"),
            ));
        }
        Ok((dtype, bytes))
    }
}

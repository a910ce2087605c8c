//! The operations the benchmark times: their names, buffer shapes, bus-bandwidth factors,
//! in-place layouts, and the call that issues each one.

use anyccl::raw::Ctx;
use anyccl::{Communicator, DType, DeviceMemory, P2POp, ReduceOp, Result, Work};

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(crate) enum Op {
    AllReduce,
    AllGather,
    ReduceScatter,
    Broadcast,
    Reduce,
    AllToAll,
    SendRecv,
    /// The buffers go unused: a row's size names the buffers, not the barrier's messages.
    Barrier,
}

impl Op {
    pub(crate) fn parse(s: &str) -> Option<Op> {
        Some(match s.trim_end_matches("_perf") {
            "all_reduce" | "allreduce" => Op::AllReduce,
            "all_gather" | "allgather" => Op::AllGather,
            "reduce_scatter" | "reducescatter" => Op::ReduceScatter,
            "broadcast" => Op::Broadcast,
            "reduce" => Op::Reduce,
            "all_to_all" | "alltoall" => Op::AllToAll,
            "sendrecv" => Op::SendRecv,
            "barrier" => Op::Barrier,
            _ => return None,
        })
    }
    /// nccl-tests' bus bandwidth factor.
    /// The operation's name as the library says it.
    pub(crate) fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::ReduceScatter => "reduce_scatter",
            Op::Broadcast => "broadcast",
            Op::Reduce => "reduce",
            Op::AllToAll => "all_to_all",
            Op::SendRecv => "sendrecv",
            Op::Barrier => "barrier",
        }
    }

    pub(crate) fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::AllGather | Op::ReduceScatter | Op::AllToAll => (n - 1.0) / n,
            Op::Broadcast | Op::Reduce | Op::SendRecv => 1.0,
            Op::Barrier => 0.0,
        }
    }
    /// The element count of a row is a multiple of this: the rank count where the buffer is
    /// split among the ranks, else 1 (an 8-byte float32 all_reduce on 4 ranks is 2 elements).
    pub(crate) fn unit(self, n: usize) -> usize {
        match self {
            Op::AllGather | Op::ReduceScatter | Op::AllToAll => n.max(1),
            _ => 1,
        }
    }
    pub(crate) fn reduces(self) -> bool {
        matches!(self, Op::AllReduce | Op::ReduceScatter | Op::Reduce)
    }
    pub(crate) fn rooted(self) -> bool {
        matches!(self, Op::Broadcast | Op::Reduce)
    }
    /// In place, whether a call writes every output element from inputs that no call writes
    /// (broadcast: the root's buffer; all_gather: each rank's own chunk), so that calls
    /// repeated on the same buffer run as the first did and leave the same result: the
    /// benchmark then fills the buffers once a run, where MPI's loop times `MPI_Bcast` over
    /// one buffer too. The others read what the last call wrote (a reduction's sum grows),
    /// so their inputs are put back before each chunk, outside the timing.
    pub(crate) fn in_place_repeatable(self) -> bool {
        matches!(self, Op::Broadcast | Op::AllGather)
    }
}

/// Buffers of one row: element counts of the send and receive buffers.
pub(crate) fn counts(op: Op, bytes: usize, es: usize, n: usize) -> (usize, usize) {
    let unit = op.unit(n);
    let total = (bytes / es / unit) * unit;
    match op {
        Op::AllGather => (total / n, total),
        Op::ReduceScatter => (total, total / n),
        _ => (total, total),
    }
}

/// In place, as nccl-tests does it: the receive buffer holds the input (all_reduce,
/// broadcast, reduce), this rank's chunk of the output holds it (all_gather), or the
/// buffer is the whole input and the output is this rank's chunk (reduce_scatter).
/// Returns the in-place buffer's element count and its input, made from this rank's
/// out-of-place input (`send`, `sc` elements); None where the op has no in-place form
/// (all_to_all, sendrecv).
pub(crate) fn in_place_layout(
    op: Op,
    me: usize,
    sc: usize,
    rc: usize,
    dtype: DType,
    send: Vec<u8>,
) -> Option<(usize, Vec<u8>)> {
    match op {
        Op::AllReduce | Op::Broadcast | Op::Reduce | Op::ReduceScatter => Some((sc, send)),
        Op::AllGather => {
            let es = dtype.size();
            let mut buf = vec![0u8; rc * es];
            buf[me * sc * es..(me + 1) * sc * es].copy_from_slice(&send);
            Some((rc, buf))
        }
        Op::AllToAll | Op::SendRecv | Op::Barrier => None,
    }
}

pub(crate) fn issue<'a>(
    comm: &'a Communicator,
    op: Op,
    send: Option<&'a dyn DeviceMemory>,
    recv: &'a mut dyn DeviceMemory,
    rop: ReduceOp,
    root: usize,
) -> Result<Work<'a>> {
    let (me, n) = (comm.rank(), comm.size());
    let s = send.map(|s| s.view());
    match op {
        Op::Barrier => comm.barrier(),
        Op::AllReduce => comm.all_reduce(s, recv.view_mut(), rop),
        Op::AllGather => comm.all_gather(s, recv.view_mut()),
        Op::ReduceScatter => comm.reduce_scatter(s, recv.view_mut(), rop),
        Op::Broadcast => comm.broadcast(s, recv.view_mut(), root),
        Op::Reduce => comm.reduce(s, recv.view_mut(), rop, root),
        Op::AllToAll => match s {
            Some(s) => comm.all_to_all(s, recv.view_mut(), None),
            None => Err(Ctx::new(comm.info().backend, me, &comm.spec().name).unsupported("all_to_all", "in place")),
        },
        Op::SendRecv => {
            let (to, from) = ((me + 1) % n, (me + n - 1) % n);
            match s {
                Some(s) => comm.p2p_group(vec![P2POp::Send(s, to), P2POp::Recv(recv.view_mut(), from)]),
                None => Err(Ctx::new(comm.info().backend, me, &comm.spec().name).unsupported("sendrecv", "in place")),
            }
        }
    }
}

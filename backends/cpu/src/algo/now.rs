//! all_reduce tried as it is issued (`comm::eager`): the direct exchange's messages, sent
//! at once, the peers' taken if they have arrived, and the receives left for later.

use super::*;

/// [`direct_pair`] tried as the all_reduce is issued, as operation number `seq`: `Done`
/// with the result in `data`; `Later` when the peer's input had not arrived within `spin`
/// (or is not to be received now: `None`; `data` untouched: [`all_reduce_rest`] receives
/// it); `NotStarted`: nothing was sent.
pub(crate) fn all_reduce_now(
    mesh: &Mesh,
    seq: u64,
    data: &mut [u8],
    src: Option<&[u8]>,
    (dtype, op): (DType, ReduceOp),
    spin: Option<std::time::Duration>,
) -> Result<Eager> {
    let (me, len) = (mesh.rank, data.len());
    let mut kept = Kept::new();
    let own: &[u8] = match src {
        Some(s) => s,
        None => keep(&mut kept, data),
    };
    let mut fold =
        |at: usize, b: &[u8]| fold_pair(me, &mut data[at..at + b.len()], &own[at..at + b.len()], b, dtype, op);
    let got = mesh.exchange_now((OP_ALL_REDUCE, seq), 1 - me, Some(own), Some((len, &mut fold)), spin)?;
    if got == Eager::Done && op == ReduceOp::Avg {
        finish_avg(data, dtype, 2);
    }
    Ok(got)
}

/// The rest of an [`all_reduce_now`] that sent `own` (operation number `seq`): the peer's
/// input received and folded with it into `data`.
pub(crate) fn all_reduce_rest(
    mesh: &Mesh,
    seq: u64,
    data: &mut [u8],
    own: &[u8],
    (dtype, op): (DType, ReduceOp),
) -> Result<()> {
    let me = mesh.rank;
    mesh.recv_coll_with(1 - me, OP_ALL_REDUCE, seq, data.len(), &mut |at, b| {
        fold_pair(me, &mut data[at..at + b.len()], &own[at..at + b.len()], b, dtype, op)
    })?;
    if op == ReduceOp::Avg {
        finish_avg(data, dtype, 2);
    }
    Ok(())
}

/// The direct all_reduce among more than two ranks of one host ([`direct_all_reduce`])
/// tried as it is issued, as operation number `seq`: this rank's input (`src`, or `data` in
/// place) sent to every rank, and, where every rank's has arrived within `spin`, every input
/// folded into `data` in rank order, as [`fold_in_rank_order`] folds them (the same bits):
/// `Done`. `Later`: sent, `data` untouched ([`direct_all_reduce_rest`] receives them);
/// `NotStarted`: nothing was sent.
pub(crate) fn direct_all_reduce_now(
    mesh: &Mesh,
    seq: u64,
    data: &mut [u8],
    src: Option<&[u8]>,
    (dtype, op): (DType, ReduceOp),
    spin: Option<std::time::Duration>,
) -> Result<Eager> {
    let (n, me, len) = (mesh.size, mesh.rank, data.len());
    let mut kept = Kept::new();
    let own: &[u8] = match src {
        Some(s) => s,
        None => keep(&mut kept, data),
    };
    // The inputs in rank order, each peer's message taken whole before the next's: rank 0's
    // copied, every other folded in, this rank's at its place.
    let mut own_in = false;
    let mut sink = |p: usize, at: usize, b: &[u8]| {
        if !own_in && (me == 0 || p > me) {
            if me == 0 {
                if let Some(s) = src {
                    data.copy_from_slice(s);
                }
            } else {
                reduce_into(data, own, dtype, op);
            }
            own_in = true;
        }
        let d = &mut data[at..at + b.len()];
        if p == 0 {
            d.copy_from_slice(b);
        } else {
            reduce_into(d, b, dtype, op);
        }
    };
    let got = mesh.exchange_all_now((OP_ALL_REDUCE, seq), &|_| own, (len, &mut sink), spin)?;
    if got == Eager::Done {
        if !own_in {
            // This rank is the last.
            reduce_into(data, own, dtype, op);
        }
        if op == ReduceOp::Avg {
            finish_avg(data, dtype, n);
        }
    }
    Ok(got)
}

/// The rest of a [`direct_all_reduce_now`] that sent `own` (operation number `seq`): every
/// other rank's input received and folded with it into `data` in rank order.
pub(crate) fn direct_all_reduce_rest(
    mesh: &Mesh,
    seq: u64,
    data: &mut [u8],
    own: &[u8],
    (dtype, op): (DType, ReduceOp),
) -> Result<()> {
    let (n, me) = (mesh.size, mesh.rank);
    if me == 0 {
        data.copy_from_slice(own);
    } else {
        mesh.recv_coll_into(0, OP_ALL_REDUCE, seq, data, crate::shm::copy)?;
    }
    for r in 1..n {
        if r == me {
            reduce_into(data, own, dtype, op);
        } else {
            mesh.recv_coll_with(r, OP_ALL_REDUCE, seq, data.len(), &mut |at, b| {
                reduce_into(&mut data[at..at + b.len()], b, dtype, op)
            })?;
        }
    }
    if op == ReduceOp::Avg {
        finish_avg(data, dtype, n);
    }
    Ok(())
}

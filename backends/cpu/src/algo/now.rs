//! all_reduce, reduce_scatter and broadcast tried as they are issued (`comm::eager`): the
//! direct exchange's or the binomial tree's messages, sent at once, the peers' taken if
//! they have arrived, and the receives left for later.

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
/// `Done`. `Later`: sent, `data` untouched ([`fold_all_rest`] receives them);
/// `NotStarted`: nothing was sent.
pub(crate) fn direct_all_reduce_now(
    mesh: &Mesh,
    seq: u64,
    data: &mut [u8],
    src: Option<&[u8]>,
    how: (DType, ReduceOp),
    spin: Option<std::time::Duration>,
) -> Result<Eager> {
    let mut kept = Kept::new();
    let own: &[u8] = match src {
        Some(s) => s,
        None => keep(&mut kept, data),
    };
    fold_all_now(mesh, (OP_ALL_REDUCE, seq), data, own, &|_| own, how, spin)
}

/// The direct reduce_scatter among more than two ranks of one host (`reduce_scatter`'s
/// direct branch) tried as it is issued, as operation number `seq`: each rank's chunk of
/// `input` sent to it, and, where every rank's piece of this rank's chunk has arrived within
/// `spin`, all folded into `out` in rank order (the bits of the same buffer's all_reduce):
/// as [`direct_all_reduce_now`].
pub(crate) fn direct_reduce_scatter_now(
    mesh: &Mesh,
    seq: u64,
    out: &mut [u8],
    input: &[u8],
    how: (DType, ReduceOp),
    spin: Option<std::time::Duration>,
) -> Result<Eager> {
    let c = out.len();
    let chunk = |p: usize| &input[p * c..(p + 1) * c];
    fold_all_now(mesh, (OP_REDUCE_SCATTER_DIRECT, seq), out, chunk(mesh.rank), &chunk, how, spin)
}

/// Send `send(peer)` to every other rank as collective message `code` number `seq`, and,
/// where every rank's message has arrived within `spin`, fold them with `own`, this rank's
/// operand, into `data` in rank order ([`fold_in_rank_order`]'s order: the same bits), the
/// average divided at the end.
#[allow(clippy::too_many_arguments)] // the message, the operands and the reduction, the look
fn fold_all_now<'d>(
    mesh: &Mesh,
    (code, seq): (u8, u64),
    data: &mut [u8],
    own: &[u8],
    send: &dyn Fn(usize) -> &'d [u8],
    (dtype, op): (DType, ReduceOp),
    spin: Option<std::time::Duration>,
) -> Result<Eager> {
    let (n, me, len) = (mesh.size, mesh.rank, data.len());
    // The operands in rank order, each peer's message taken whole before the next's: rank
    // 0's copied, every other folded in, this rank's at its place.
    let mut own_in = false;
    let mut sink = |p: usize, at: usize, b: &[u8]| {
        if !own_in && (me == 0 || p > me) {
            if me == 0 {
                data.copy_from_slice(own);
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
    let got = mesh.exchange_all_now((code, seq), send, (len, &mut sink), spin)?;
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

/// The rest of a [`direct_all_reduce_now`] or [`direct_reduce_scatter_now`] (message `code`
/// number `seq`) that sent its messages: every other rank's received and folded with `own`,
/// this rank's operand, into `data` in rank order.
pub(crate) fn fold_all_rest(
    mesh: &Mesh,
    (code, seq): (u8, u64),
    data: &mut [u8],
    own: &[u8],
    (dtype, op): (DType, ReduceOp),
) -> Result<()> {
    let (n, me) = (mesh.size, mesh.rank);
    if me == 0 {
        data.copy_from_slice(own);
    } else {
        mesh.recv_coll_into(0, code, seq, data, crate::shm::copy)?;
    }
    for r in 1..n {
        if r == me {
            reduce_into(data, own, dtype, op);
        } else {
            mesh.recv_coll_with(r, code, seq, data.len(), &mut |at, b| {
                reduce_into(&mut data[at..at + b.len()], b, dtype, op)
            })?;
        }
    }
    if op == ReduceOp::Avg {
        finish_avg(data, dtype, n);
    }
    Ok(())
}

/// The binomial tree's parent of rank `me` of `n` (`None`: the root) and its children, in
/// the order [`broadcast`] sends to them, for a broadcast from `root`.
pub(crate) fn tree((n, me): (usize, usize), root: usize) -> (Option<usize>, smallvec::SmallVec<[usize; 8]>) {
    let v = (me + n - root) % n;
    let real = |vr: usize| (vr + root) % n;
    let (mut parent, mut children) = (None, smallvec::SmallVec::new());
    let mut mask = 1;
    while mask < n {
        if v >= mask && v < 2 * mask {
            parent = Some(real(v - mask));
        } else if v < mask && v + mask < n {
            children.push(real(v + mask));
        }
        mask <<= 1;
    }
    (parent, children)
}

/// [`broadcast`] from `root` among more than two ranks of one host tried as it is issued, as
/// operation number `seq`: the root sends its input (`src`, or `data` in place) to its
/// children where every ring has room now (`Done`, `src` then copied to `data`; else
/// `NotStarted`); any other rank takes its parent's message if it has arrived within `spin`
/// and then sends it on to its children (waiting for room only where a ring has none, which
/// this thread's own sends alone fill): `Done`; where it has not, a leaf leaves the receive
/// for later (`Later`) and a rank with children goes the usual way (`NotStarted`: nothing
/// taken and nothing sent).
pub(crate) fn tree_broadcast_now(
    mesh: &Mesh,
    seq: u64,
    data: &mut [u8],
    src: Option<&[u8]>,
    root: usize,
    spin: Option<std::time::Duration>,
) -> Result<Eager> {
    let (parent, children) = tree((mesh.size, mesh.rank), root);
    let op = (OP_BROADCAST, seq);
    let Some(parent) = parent else {
        let got = mesh.send_all_now(op, &children, src.unwrap_or(data))?;
        if let (Eager::Done, Some(s)) = (got, src) {
            data.copy_from_slice(s);
        }
        return Ok(got);
    };
    let len = data.len();
    let mut take = |at: usize, b: &[u8]| data[at..at + b.len()].copy_from_slice(b);
    let got = mesh.exchange_now(op, parent, None, Some((len, &mut take)), spin)?;
    if got != Eager::Done {
        // A receive left for later must only receive: the calls issued after it send at
        // their issue, and a message this rank forwarded later would reach a child behind
        // theirs. A rank with children goes the usual way (queued, so the later calls do
        // too), a leaf leaves its receive for later.
        return Ok(if children.is_empty() { got } else { Eager::NotStarted });
    }
    if mesh.send_all_now(op, &children, data)? == Eager::NotStarted {
        for c in children {
            mesh.send(c, Kind::Coll, OP_BROADCAST, seq, data)?;
        }
    }
    Ok(Eager::Done)
}

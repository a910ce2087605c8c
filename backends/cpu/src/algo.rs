//! Collective algorithms over the mesh. All of them are deterministic: every rank of an
//! all_reduce gets bit-identical results, and the same sizes always take the same path.

use crate::reduce::{finish_avg, reduce_into};
use crate::transport::{Kind, Mesh};
use anyccl_core::{DType, ReduceOp, Result};

pub(crate) const OP_ALL_REDUCE: u8 = 1;
pub(crate) const OP_REDUCE: u8 = 2;
pub(crate) const OP_BROADCAST: u8 = 3;
pub(crate) const OP_ALL_GATHER: u8 = 4;
pub(crate) const OP_REDUCE_SCATTER: u8 = 5;
pub(crate) const OP_ALL_TO_ALL: u8 = 6;
pub(crate) const OP_BARRIER: u8 = 7;

/// all_reduce size up to which whole buffers are exchanged (MPICH's short-message
/// threshold; measured here, ring reduce-scatter + all-gather is faster from 2-8 KiB on).
pub(crate) const DIRECT_MAX: usize = 2 << 10;

/// Size thresholds that pick algorithms; `ANYCCL_CPU_*` overrides.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Tuning {
    /// all_reduce at or below this many bytes exchanges whole buffers in one round
    /// (latency-bound); above it, ring reduce-scatter + all-gather (bandwidth-bound).
    pub all_reduce_direct_max: usize,
}

impl Tuning {
    pub(crate) fn from_env(rank: usize, label: &str) -> Result<Self> {
        Ok(Tuning { all_reduce_direct_max: env_bytes("ANYCCL_CPU_ALLREDUCE_DIRECT_MAX", DIRECT_MAX, rank, label)? })
    }
}

/// A byte count from the environment variable `name` (`default` when unset).
///
/// # Errors
/// `InvalidArgument` naming the variable, the rank and the group when it is malformed.
pub(crate) fn env_bytes(name: &str, default: usize, rank: usize, label: &str) -> Result<usize> {
    match std::env::var(name) {
        Err(_) => Ok(default),
        Ok(v) => v.trim().parse().map_err(|_| anyccl_core::Error::InvalidArgument {
            op: "connect",
            arg: "environment",
            rank,
            group: label.into(),
            msg: format!("{name}={v:?} is not a number of bytes"),
        }),
    }
}

/// One collective's view of the mesh: its op code and sequence number.
pub(crate) struct Coll<'m> {
    pub mesh: &'m Mesh,
    pub op: u8,
    pub seq: u64,
}

impl Coll<'_> {
    fn rank(&self) -> usize {
        self.mesh.rank
    }
    fn size(&self) -> usize {
        self.mesh.size
    }
    fn send(&self, peer: usize, data: &[u8]) -> Result<()> {
        self.mesh.send(peer, Kind::Coll, self.op, self.seq, data)
    }
    /// Receive `dst.len()` bytes from `peer` straight into `dst`.
    fn recv_into(&self, peer: usize, dst: &mut [u8]) -> Result<()> {
        self.mesh.recv_coll_with(peer, self.op, self.seq, dst.len(), &mut |at, b| {
            crate::shm::copy(&mut dst[at..at + b.len()], b)
        })
    }
    /// Send `out` to `to` while receiving `incoming` bytes from `from` into `sink`.
    fn exchange(
        &self,
        to: usize,
        out: &[u8],
        from: usize,
        incoming: usize,
        sink: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        self.mesh.exchange((self.op, self.seq), to, out, from, incoming, sink)
    }
    /// Receive `acc.len()` bytes from `peer`, reducing them into `acc` as they arrive.
    fn recv_reduce(&self, peer: usize, acc: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
        self.mesh.recv_coll_with(peer, self.op, self.seq, acc.len(), &mut |at, b| {
            reduce_into(&mut acc[at..at + b.len()], b, dtype, op)
        })
    }
}

/// Balanced element ranges `(offset, len)` of `count` elements over `n` chunks.
pub(crate) fn chunks(count: usize, n: usize) -> Vec<(usize, usize)> {
    let (q, r) = (count / n, count % n);
    let mut off = 0;
    (0..n)
        .map(|i| {
            let len = q + usize::from(i < r);
            let c = (off, len);
            off += len;
            c
        })
        .collect()
}

/// `data[a]` to read and `data[b]` to write, two ranges that do not overlap.
fn disjoint(data: &mut [u8], a: std::ops::Range<usize>, b: std::ops::Range<usize>) -> (&[u8], &mut [u8]) {
    debug_assert!(a.end <= b.start || b.end <= a.start);
    if a.start < b.start {
        let (lo, hi) = data.split_at_mut(b.start);
        (&lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = data.split_at_mut(a.start);
        (&hi[..a.end - a.start], &mut lo[b])
    }
}

fn byte_range(c: (usize, usize), esize: usize) -> std::ops::Range<usize> {
    c.0 * esize..(c.0 + c.1) * esize
}

pub(crate) fn all_reduce(cx: &Coll<'_>, data: &mut [u8], dtype: DType, op: ReduceOp, tune: &Tuning) -> Result<()> {
    let n = cx.size();
    if n > 1 {
        let count = data.len() / dtype.size();
        if data.len() <= tune.all_reduce_direct_max || count < n {
            direct_all_reduce(cx, data, dtype, op)?;
        } else {
            let ch = chunks(count, n);
            ring_reduce_scatter(cx, data, dtype, op, &ch)?;
            ring_all_gather(cx, data, dtype.size(), &ch)?;
        }
    }
    if op == ReduceOp::Avg {
        finish_avg(data, dtype, n);
    }
    Ok(())
}

/// Every rank sends its whole buffer to every other and folds all of them in rank order
/// (the same order on every rank, so the results are bit-identical), each as it arrives.
fn direct_all_reduce(cx: &Coll<'_>, data: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let (n, me) = (cx.size(), cx.rank());
    for k in 1..n {
        cx.send((me + k) % n, data)?;
    }
    fold_in_rank_order(cx, data, dtype, op)
}

/// Replace `data` (this rank's contribution) by every rank's, received from the others,
/// folded in rank order: the same order, so the same bits, on every rank that folds.
fn fold_in_rank_order(cx: &Coll<'_>, data: &mut [u8], dtype: DType, op: ReduceOp) -> Result<()> {
    let (n, me) = (cx.size(), cx.rank());
    let mine = (me != 0).then(|| data.to_vec());
    if me != 0 {
        cx.recv_into(0, data)?;
    }
    for r in 1..n {
        match &mine {
            Some(m) if r == me => reduce_into(data, m, dtype, op),
            _ => cx.recv_reduce(r, data, dtype, op)?,
        }
    }
    Ok(())
}

/// Ring reduce-scatter in place: afterwards chunk `rank` of `data` is fully reduced.
fn ring_reduce_scatter(
    cx: &Coll<'_>,
    data: &mut [u8],
    dtype: DType,
    op: ReduceOp,
    ch: &[(usize, usize)],
) -> Result<()> {
    let (n, me, es) = (cx.size(), cx.rank(), dtype.size());
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    for s in 0..n - 1 {
        let send_c = ch[(me + 2 * n - s - 1) % n];
        let recv_c = ch[(me + 2 * n - s - 2) % n];
        let (out, acc) = disjoint(data, byte_range(send_c, es), byte_range(recv_c, es));
        cx.exchange(right, out, left, acc.len(), &mut |at, b| reduce_into(&mut acc[at..at + b.len()], b, dtype, op))?;
    }
    Ok(())
}

/// Ring all-gather in place: chunk `rank` is this rank's; afterwards every chunk is filled.
fn ring_all_gather(cx: &Coll<'_>, data: &mut [u8], es: usize, ch: &[(usize, usize)]) -> Result<()> {
    let (n, me) = (cx.size(), cx.rank());
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    for s in 0..n - 1 {
        let send_c = ch[(me + n - s) % n];
        let recv_c = ch[(me + 2 * n - s - 1) % n];
        let (out, dst) = disjoint(data, byte_range(send_c, es), byte_range(recv_c, es));
        cx.exchange(right, out, left, dst.len(), &mut |at, b| crate::shm::copy(&mut dst[at..at + b.len()], b))?;
    }
    Ok(())
}

/// Reduce to `root`: every other rank sends to the root, which folds in rank order.
pub(crate) fn reduce(cx: &Coll<'_>, data: &mut [u8], dtype: DType, op: ReduceOp, root: usize) -> Result<()> {
    let (n, me) = (cx.size(), cx.rank());
    if me != root {
        return cx.send(root, data);
    }
    fold_in_rank_order(cx, data, dtype, op)?;
    if op == ReduceOp::Avg {
        finish_avg(data, dtype, n);
    }
    Ok(())
}

/// Binomial-tree broadcast from `root`.
pub(crate) fn broadcast(cx: &Coll<'_>, data: &mut [u8], root: usize) -> Result<()> {
    let (n, me) = (cx.size(), cx.rank());
    let v = (me + n - root) % n;
    let real = |vr: usize| (vr + root) % n;
    let mut mask = 1;
    while mask < n {
        if v >= mask && v < 2 * mask {
            cx.recv_into(real(v - mask), data)?;
        } else if v < mask && v + mask < n {
            cx.send(real(v + mask), data)?;
        }
        mask <<= 1;
    }
    Ok(())
}

/// Ring all-gather of equal chunks: `out` holds `size` chunks, chunk `rank` already filled.
pub(crate) fn all_gather(cx: &Coll<'_>, out: &mut [u8], chunk_bytes: usize) -> Result<()> {
    let n = cx.size();
    if n == 1 || chunk_bytes == 0 {
        return Ok(());
    }
    let ch: Vec<(usize, usize)> = (0..n).map(|i| (i * chunk_bytes, chunk_bytes)).collect();
    ring_all_gather(cx, out, 1, &ch)
}

/// Ring reduce-scatter of equal chunks: returns this rank's reduced chunk.
pub(crate) fn reduce_scatter(cx: &Coll<'_>, data: &mut [u8], dtype: DType, op: ReduceOp) -> Result<Vec<u8>> {
    let (n, me) = (cx.size(), cx.rank());
    let count = data.len() / dtype.size() / n;
    let ch: Vec<(usize, usize)> = (0..n).map(|i| (i * count, count)).collect();
    if n > 1 && count > 0 {
        ring_reduce_scatter(cx, data, dtype, op, &ch)?;
    }
    let mut mine = data[byte_range(ch[me], dtype.size())].to_vec();
    if op == ReduceOp::Avg {
        finish_avg(&mut mine, dtype, n);
    }
    Ok(mine)
}

/// Pairwise exchange: segment `j` of `send` to rank `j`, segment `i` of `recv` from rank `i`.
pub(crate) fn all_to_all(
    cx: &Coll<'_>,
    send: &[u8],
    send_bytes: &[usize],
    recv: &mut [u8],
    recv_bytes: &[usize],
) -> Result<()> {
    let (n, me) = (cx.size(), cx.rank());
    let offsets = |v: &[usize]| -> Vec<usize> {
        v.iter()
            .scan(0, |acc, &x| {
                let o = *acc;
                *acc += x;
                Some(o)
            })
            .collect()
    };
    let (so, ro) = (offsets(send_bytes), offsets(recv_bytes));
    crate::shm::copy(&mut recv[ro[me]..ro[me] + recv_bytes[me]], &send[so[me]..so[me] + send_bytes[me]]);
    // Pairwise: at step k, to rank me + k and from rank me - k, both streams at once (the
    // peer at me + k receives from this rank at its own step k).
    for k in 1..n {
        let (to, from) = ((me + k) % n, (me + n - k) % n);
        let dst = &mut recv[ro[from]..ro[from] + recv_bytes[from]];
        cx.exchange(to, &send[so[to]..so[to] + send_bytes[to]], from, dst.len(), &mut |at, b| {
            crate::shm::copy(&mut dst[at..at + b.len()], b)
        })?;
    }
    Ok(())
}

/// Dissemination barrier: ceil(log2 n) rounds of empty messages.
pub(crate) fn barrier(cx: &Coll<'_>) -> Result<()> {
    let (n, me) = (cx.size(), cx.rank());
    let mut k = 1;
    while k < n {
        cx.send((me + k) % n, &[])?;
        cx.recv_into((me + n - k) % n, &mut [])?;
        k <<= 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::chunks;

    #[test]
    fn chunks_cover_everything_once() {
        for count in [0, 1, 5, 7, 64, 1001] {
            for n in 1..9 {
                let c = chunks(count, n);
                assert_eq!(c.len(), n);
                assert_eq!(c.iter().map(|x| x.1).sum::<usize>(), count);
                for w in c.windows(2) {
                    assert_eq!(w[0].0 + w[0].1, w[1].0);
                }
            }
        }
    }
}

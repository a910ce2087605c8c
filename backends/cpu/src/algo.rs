//! Collective algorithms over the mesh. All of them are deterministic: every rank of an
//! all_reduce gets bit-identical results, and the same sizes always take the same path.

use crate::reduce::{finish_avg, reduce_into, reduce_to};
use crate::settings::{Tuning, BARRIER_DIRECT_MAX};
use crate::transport::{Copier, Eager, Kind, Mesh, Sink};
use anyccl_core::{DType, ReduceOp, Result};

mod now;
mod path;
pub(crate) use now::{
    all_reduce_now, all_reduce_rest, direct_all_reduce_now, direct_reduce_scatter_now, fold_all_rest, tree,
    tree_broadcast_now,
};
pub(crate) use path::path;

pub(crate) use crate::transport::{
    OP_ALL_GATHER, OP_ALL_GATHER_DIRECT, OP_ALL_REDUCE, OP_ALL_TO_ALL, OP_BARRIER, OP_BROADCAST, OP_REDUCE,
    OP_REDUCE_SCATTER, OP_REDUCE_SCATTER_DIRECT,
};

/// One collective's view of the mesh: its op code and sequence number.
pub(crate) struct Coll<'m> {
    pub mesh: &'m Mesh,
    pub op: u8,
    pub seq: u64,
    /// Received bytes and folded results go to their destination with streaming stores
    /// (an output far larger than the cache, [`Tuning::stream_min`]), except a message sent
    /// by reference, which the kernel copies straight out of the sender's memory ([`Sink::Into`]).
    pub stream: bool,
}

impl<'m> Coll<'m> {
    /// This view, writing its outputs with streaming stores when `on`.
    fn streaming(&self, on: bool) -> Coll<'m> {
        Coll { mesh: self.mesh, op: self.op, seq: self.seq, stream: on }
    }
    /// This view, its messages carrying op code `op` (an algorithm of the operation's own).
    fn as_op(&self, op: u8) -> Coll<'m> {
        Coll { mesh: self.mesh, op, seq: self.seq, stream: self.stream }
    }
    /// Copy received bytes `b` to their destination.
    fn put(&self, dst: &mut [u8], b: &[u8]) {
        (self.copier())(dst, b)
    }
    /// How this view writes its outputs.
    fn copier(&self) -> Copier {
        if self.stream {
            crate::shm::copy_streaming
        } else {
            crate::shm::copy
        }
    }
    fn rank(&self) -> usize {
        self.mesh.rank
    }
    fn size(&self) -> usize {
        self.mesh.size
    }
    fn send(&self, peer: usize, data: &[u8]) -> Result<()> {
        self.mesh.send(peer, Kind::Coll, self.op, self.seq, data)
    }
    /// Receive `dst.len()` bytes from `peer` into `dst`, written as [`Coll::put`] does (a
    /// message sent by reference copied once, straight out of the sender's memory).
    fn recv_into(&self, peer: usize, dst: &mut [u8]) -> Result<()> {
        self.mesh.recv_coll_into(peer, self.op, self.seq, dst, self.copier())
    }
    /// Send `out` to `to` while receiving `incoming` bytes from `from` into `sink`; with
    /// `mirror`, also copy `out` into it as it goes ([`Mesh::exchange`]).
    fn exchange(
        &self,
        to: usize,
        (out, mirror): (&[u8], Option<&mut [u8]>),
        from: usize,
        incoming: usize,
        sink: &mut dyn FnMut(usize, &[u8]),
    ) -> Result<()> {
        let mirror = mirror.map(|m| (m, self.copier()));
        self.mesh.exchange((self.op, self.seq), to, out, mirror, from, incoming, &mut Sink::With(sink))
    }
    /// [`Coll::exchange`] into `dst`, written as [`Coll::put`] does (a message sent by
    /// reference copied once, straight out of the sender's memory).
    fn exchange_into(
        &self,
        to: usize,
        (out, mirror): (&[u8], Option<&mut [u8]>),
        from: usize,
        dst: &mut [u8],
    ) -> Result<()> {
        let copy = self.copier();
        let mirror = mirror.map(|m| (m, copy));
        self.mesh.exchange((self.op, self.seq), to, out, mirror, from, dst.len(), &mut Sink::Into(dst, copy))
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
    let (a, b) = two_mut(data, a, b);
    (a, b)
}

fn byte_range(c: (usize, usize), esize: usize) -> std::ops::Range<usize> {
    c.0 * esize..(c.0 + c.1) * esize
}

/// all_reduce of `data`: whole buffers exchanged up to the tuning's size, ring
/// reduce-scatter + all-gather above it, and, between two ranks, from the tuning's pair
/// size, the pairwise exchange a piece at a time.
///
/// `src`: this rank's input, when it is not `data` already (out of place). The ring then
/// reads it where it is needed, a piece at a time, instead of copying all of it first: a
/// chunk this rank sends first goes out of `src`, and a received chunk is folded with
/// `src`'s into `data` while both are in cache.
pub(crate) fn all_reduce(
    cx: &Coll<'_>,
    data: &mut [u8],
    src: Option<&[u8]>,
    dtype: DType,
    op: ReduceOp,
    tune: &Tuning,
) -> Result<()> {
    let n = cx.size();
    let count = data.len() / dtype.size();
    if n == 2 && data.len() > tune.all_reduce_direct_max && data.len() >= tune.pair_min {
        let cx = &cx.streaming(data.len() >= tune.stream_min);
        pairwise_all_reduce(cx, data, src, dtype, op, tune.pair_piece)?;
    } else if n > 1 && data.len() > tune.all_reduce_direct_max && count >= n {
        let ch = chunks(count, n);
        let cx = &cx.streaming(data.len() >= tune.stream_min);
        ring_reduce_scatter(cx, data, src, dtype, op, &ch)?;
        ring_all_gather(cx, data, None, dtype.size(), &ch)?;
    } else if n > 1 {
        direct_all_reduce(cx, data, src, dtype, op)?;
    } else if let Some(src) = src {
        crate::shm::copy(data, src);
    }
    if op == ReduceOp::Avg {
        finish_avg(data, dtype, n);
    }
    Ok(())
}

/// all_reduce between two ranks, a piece at a time: each rank sends the other its input of
/// the other's half of the piece and folds the half it receives with its own; then sends
/// the folded half, which is still in cache, while it receives the other's. With streaming
/// stores (an output far larger than the cache), the fold goes into a cache-sized scratch
/// that is sent from there and streamed to the output, so the input is read once and the
/// output written once (a ring over the whole buffer reads each folded half back from
/// memory to send it). Each element is folded once, by one rank, in the ring's order (own
/// op received): the same bits on both.
fn pairwise_all_reduce(
    cx: &Coll<'_>,
    data: &mut [u8],
    src: Option<&[u8]>,
    dtype: DType,
    op: ReduceOp,
    piece: usize,
) -> Result<()> {
    let (me, es) = (cx.rank(), dtype.size());
    let peer = 1 - me;
    let count = data.len() / es;
    let per = (piece / es).max(2);
    let mut scratch = if cx.stream { vec![0u8; per.min(count).div_ceil(2) * es] } else { Vec::new() };
    let mut start = 0;
    while start < count {
        let len = per.min(count - start);
        let ch = chunks(len, 2);
        let (mine, theirs) =
            (byte_range((start + ch[me].0, ch[me].1), es), byte_range((start + ch[peer].0, ch[peer].1), es));
        let (m, t) = two_mut(data, mine.clone(), theirs.clone());
        let (out, own) = match src {
            Some(s) => (&s[theirs], Some(&s[mine])),
            None => (&*t, None),
        };
        let folded: &[u8] = if cx.stream {
            let f = &mut scratch[..m.len()];
            let own = own.unwrap_or(m);
            cx.exchange(peer, (out, None), peer, f.len(), &mut |at, b| {
                let r = at..at + b.len();
                reduce_to(&mut f[r.clone()], &own[r], b, dtype, op)
            })?;
            crate::shm::copy_streaming(m, f);
            f
        } else {
            cx.exchange(peer, (out, None), peer, m.len(), &mut |at, b| {
                let r = at..at + b.len();
                fold_piece(&mut m[r.clone()], own.map(|o| &o[r]), b, dtype, op)
            })?;
            m
        };
        cx.exchange_into(peer, (folded, None), peer, t)?;
        start += len;
    }
    Ok(())
}

/// Every rank sends its whole buffer to every other and folds all of them in rank order
/// (the same order on every rank, so the results are bit-identical), each as it arrives.
/// Out of place (`src`), the input is sent and folded where it is, never copied first.
fn direct_all_reduce(cx: &Coll<'_>, data: &mut [u8], src: Option<&[u8]>, dtype: DType, op: ReduceOp) -> Result<()> {
    let (n, me) = (cx.size(), cx.rank());
    if n == 2 {
        return direct_pair(cx, data, src, dtype, op);
    }
    let input = src.unwrap_or(data);
    for k in 1..n {
        cx.send((me + k) % n, input)?;
    }
    fold_in_rank_order(cx, data, src, dtype, op)
}

/// [`direct_all_reduce`] of two ranks in one exchange: each sends its input while it folds
/// the other's as it arrives, rank 0's operand first on both.
fn direct_pair(cx: &Coll<'_>, data: &mut [u8], src: Option<&[u8]>, dtype: DType, op: ReduceOp) -> Result<()> {
    let (me, len) = (cx.rank(), data.len());
    // In place, the input is sent from a copy ([`keep`]), since the fold overwrites it as
    // the other's arrives.
    let mut kept = Kept::new();
    let own: &[u8] = match src {
        Some(s) => s,
        None => keep(&mut kept, data),
    };
    cx.exchange(1 - me, (own, None), 1 - me, len, &mut |at, b| {
        fold_pair(me, &mut data[at..at + b.len()], &own[at..at + b.len()], b, dtype, op)
    })
}

/// `d = own op theirs` between two ranks, rank 0's operand first on both (the same bits).
fn fold_pair(me: usize, d: &mut [u8], own: &[u8], theirs: &[u8], dtype: DType, op: ReduceOp) {
    if me == 0 {
        reduce_to(d, own, theirs, dtype, op)
    } else {
        reduce_to(d, theirs, own, dtype, op)
    }
}

/// A copy of a small input: on the stack up to the default direct size of two ranks (the
/// smallest, latency-bound calls), in words so that every element type is aligned for the reduction.
type Kept = smallvec::SmallVec<[u64; crate::settings::DIRECT_MAX_PAIR / 8]>;

/// Fill `kept` with a copy of `data` and return it. Filled where it lies: a move of the
/// vector would copy its whole inline array.
fn keep<'k>(kept: &'k mut Kept, data: &[u8]) -> &'k [u8] {
    let len = data.len();
    kept.resize(len.div_ceil(8), 0);
    let bytes = &mut bytemuck::cast_slice_mut::<u64, u8>(kept)[..len];
    bytes.copy_from_slice(data);
    bytes
}

/// Replace `data` (this rank's contribution) by every rank's, received from the others,
/// folded in rank order: the same order, so the same bits, on every rank that folds.
///
/// `src`: this rank's contribution when it is not in `data` (out of place).
fn fold_in_rank_order(cx: &Coll<'_>, data: &mut [u8], src: Option<&[u8]>, dtype: DType, op: ReduceOp) -> Result<()> {
    let (n, me) = (cx.size(), cx.rank());
    // This rank's contribution, kept aside unless it is first (rank 0) or lies elsewhere.
    let mut kept = Kept::new();
    let mine = src.or_else(|| (me != 0).then(|| keep(&mut kept, data)));
    if me != 0 {
        cx.recv_into(0, data)?;
    } else if let Some(src) = src {
        crate::shm::copy(data, src);
    }
    for r in 1..n {
        match mine {
            Some(m) if r == me => reduce_into(data, m, dtype, op),
            _ => cx.recv_reduce(r, data, dtype, op)?,
        }
    }
    Ok(())
}

/// Ring reduce-scatter: afterwards chunk `rank` of `data` is fully reduced. In place, or,
/// with `src`, out of place: every chunk is received exactly once, and the first chunk sent
/// is one never received, so `src` is read there and at each fold (`data = src op
/// received`, the operands in the in-place order: the same bits).
fn ring_reduce_scatter(
    cx: &Coll<'_>,
    data: &mut [u8],
    src: Option<&[u8]>,
    dtype: DType,
    op: ReduceOp,
    ch: &[(usize, usize)],
) -> Result<()> {
    let (n, me, es) = (cx.size(), cx.rank(), dtype.size());
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    let mut scratch = Vec::new();
    for s in 0..n - 1 {
        let (send_i, recv_i) = rs_step(n, me, s);
        let (send_c, recv_c) = (ch[send_i], ch[recv_i]);
        let (out, acc) = disjoint(data, byte_range(send_c, es), byte_range(recv_c, es));
        let out = match src {
            Some(src) if s == 0 => &src[byte_range(send_c, es)],
            _ => out,
        };
        let own = src.map(|src| &src[byte_range(recv_c, es)]);
        cx.exchange(right, (out, None), left, acc.len(), &mut |at, b| {
            let r = at..at + b.len();
            match own {
                // Out of place with streaming stores, at the last step (earlier steps' folds
                // are sent at the next, so they stay in cache): folded in a cache-sized
                // scratch, then streamed to the output, whose lines are never read.
                Some(own) if cx.stream && s == n - 2 => {
                    scratch.resize(b.len(), 0);
                    reduce_to(&mut scratch, &own[r.clone()], b, dtype, op);
                    crate::shm::copy_streaming(&mut acc[r], &scratch);
                }
                _ => fold_piece(&mut acc[r.clone()], own.map(|o| &o[r]), b, dtype, op),
            }
        })?;
    }
    Ok(())
}

/// The chunks a rank sends and receives at step `s` of a ring reduce-scatter.
fn rs_step(n: usize, me: usize, s: usize) -> (usize, usize) {
    ((me + 2 * n - s - 1) % n, (me + 2 * n - s - 2) % n)
}

/// Fold a received piece `b` into `acc`: `acc = own op b` out of place (`own`: this rank's
/// input of the piece), `acc = acc op b` in place.
pub(crate) fn fold_piece(acc: &mut [u8], own: Option<&[u8]>, b: &[u8], dtype: DType, op: ReduceOp) {
    match own {
        Some(own) => reduce_to(acc, own, b, dtype, op),
        None => reduce_into(acc, b, dtype, op),
    }
}

/// Ring all-gather: chunk `rank` is this rank's; afterwards every chunk is filled. In place,
/// or, with `src` (this rank's chunk, out of place), copying `src` into its chunk as the first
/// step sends it (read once for both).
fn ring_all_gather(cx: &Coll<'_>, data: &mut [u8], src: Option<&[u8]>, es: usize, ch: &[(usize, usize)]) -> Result<()> {
    let (n, me) = (cx.size(), cx.rank());
    let (right, left) = ((me + 1) % n, (me + n - 1) % n);
    for s in 0..n - 1 {
        let send_c = ch[(me + n - s) % n];
        let recv_c = ch[(me + 2 * n - s - 1) % n];
        let (sent, dst) = two_mut(data, byte_range(send_c, es), byte_range(recv_c, es));
        // The first step of an out-of-place call sends `src`, filling this rank's chunk.
        let out: (&[u8], Option<&mut [u8]>) = match src {
            Some(src) if s == 0 => (src, Some(sent)),
            _ => (sent, None),
        };
        cx.exchange_into(right, out, left, dst)?;
    }
    Ok(())
}

/// `data[a]` and `data[b]` for writing, two ranges that do not overlap.
fn two_mut(data: &mut [u8], a: std::ops::Range<usize>, b: std::ops::Range<usize>) -> (&mut [u8], &mut [u8]) {
    debug_assert!(a.end <= b.start || b.end <= a.start);
    if a.start < b.start {
        let (lo, hi) = data.split_at_mut(b.start);
        (&mut lo[a], &mut hi[..b.end - b.start])
    } else {
        let (lo, hi) = data.split_at_mut(a.start);
        (&mut hi[..a.end - a.start], &mut lo[b])
    }
}

/// Reduce to `root`: every other rank sends to the root, which folds in rank order.
///
/// `src`: this rank's input when it is not `data` (out of place; `data` of a rank other than
/// the root is then left as it is).
pub(crate) fn reduce(
    cx: &Coll<'_>,
    data: &mut [u8],
    src: Option<&[u8]>,
    dtype: DType,
    op: ReduceOp,
    root: usize,
) -> Result<()> {
    let (n, me) = (cx.size(), cx.rank());
    if me != root {
        return cx.send(root, src.unwrap_or(data));
    }
    fold_in_rank_order(cx, data, src, dtype, op)?;
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

/// All-gather of equal chunks: `out` holds `size` chunks; chunk `rank` is filled already (in
/// place), or comes from `src` (out of place). Between more than two ranks, chunks of at most
/// `direct_max` bytes go directly (every rank's to every rank: one round of waiting, where the
/// ring waits `size - 1` times in a row), larger ones round the ring.
pub(crate) fn all_gather(
    cx: &Coll<'_>,
    out: &mut [u8],
    src: Option<&[u8]>,
    chunk_bytes: usize,
    direct_max: usize,
) -> Result<()> {
    let (n, me) = (cx.size(), cx.rank());
    if n == 1 || chunk_bytes == 0 {
        if let Some(src) = src {
            cx.put(&mut out[me * chunk_bytes..(me + 1) * chunk_bytes], src);
        }
        return Ok(());
    }
    if n > 2 && chunk_bytes <= direct_max {
        let cx = cx.as_op(OP_ALL_GATHER_DIRECT);
        let part = |r: usize| r * chunk_bytes..(r + 1) * chunk_bytes;
        if let Some(src) = src {
            cx.put(&mut out[part(me)], src);
        }
        for k in 1..n {
            cx.send((me + k) % n, src.unwrap_or(&out[part(me)]))?;
        }
        for k in 1..n {
            let from = (me + n - k) % n;
            cx.recv_into(from, &mut out[part(from)])?;
        }
        return Ok(());
    }
    let ch: Vec<(usize, usize)> = (0..n).map(|i| (i * chunk_bytes, chunk_bytes)).collect();
    ring_all_gather(cx, out, src, 1, &ch)
}

/// A reduce-scatter's input, by chunk: the chunks before and after this rank's, and this
/// rank's own unless the output buffer holds it already (in place).
pub(crate) struct Parts<'a> {
    pub(crate) before: &'a [u8],
    pub(crate) own: Option<&'a [u8]>,
    pub(crate) after: &'a [u8],
}

impl<'a> Parts<'a> {
    /// The chunks of `input` (out of place), chunk `me` included, of `chunk` bytes each.
    pub(crate) fn of(input: &'a [u8], me: usize, chunk: usize) -> Parts<'a> {
        let (before, rest) = input.split_at(me * chunk);
        let (own, after) = rest.split_at(chunk);
        Parts { before, own: Some(own), after }
    }

    /// Chunk `i` (not this rank's, `me`) of `chunk` bytes.
    fn other(&self, i: usize, me: usize, chunk: usize) -> &'a [u8] {
        if i < me {
            &self.before[i * chunk..(i + 1) * chunk]
        } else {
            &self.after[(i - me - 1) * chunk..(i - me) * chunk]
        }
    }
}

/// Reduce-scatter into `out`, this rank's chunk, with the bits of an all_reduce of the same
/// buffer's chunk: among more than two ranks, where that all_reduce is direct (a whole buffer
/// of at most `direct_max` bytes), every rank sends each other rank its chunk and folds the
/// ones it receives in rank order, as that all_reduce does (one round of waiting). Otherwise
/// the ring: each step sends what the last one folded (the first sends an input chunk) and
/// folds a received chunk with this rank's input of it into a temporary, the last into
/// `out`. The input is only read, and only the two chunk-sized temporaries in `scratch` are
/// written (2 chunks of bytes from 3 ranks on; none at 2 ranks); the operands are folded in
/// the order of the in-place ring, as the ring all_reduce folds them.
pub(crate) fn reduce_scatter(
    cx: &Coll<'_>,
    parts: &Parts<'_>,
    out: &mut [u8],
    scratch: &mut [u8],
    (dtype, op): (DType, ReduceOp),
    direct_max: usize,
) -> Result<()> {
    let (n, me, c) = (cx.size(), cx.rank(), out.len());
    if let Some(own) = parts.own {
        if n == 1 || c == 0 {
            crate::shm::copy(out, own);
        }
    }
    if n > 2 && c > 0 && n * c <= direct_max {
        let cx = cx.as_op(OP_REDUCE_SCATTER_DIRECT);
        for k in 1..n {
            let to = (me + k) % n;
            cx.send(to, parts.other(to, me, c))?;
        }
        fold_in_rank_order(&cx, out, parts.own, dtype, op)?;
    } else if n > 1 && c > 0 {
        let (right, left) = ((me + 1) % n, (me + n - 1) % n);
        // The chunk folded at the last step (sent at this one) and the one folded now.
        let half = if n > 2 { c } else { 0 };
        let (mut sent, mut fold) = scratch[..2 * half].split_at_mut(half);
        for s in 0..n - 1 {
            let (send_i, recv_i) = rs_step(n, me, s);
            let to_send: &[u8] = if s == 0 { parts.other(send_i, me, c) } else { sent };
            let (dst, own): (&mut [u8], Option<&[u8]>) =
                if s == n - 2 { (&mut *out, parts.own) } else { (&mut *fold, Some(parts.other(recv_i, me, c))) };
            cx.exchange(right, (to_send, None), left, c, &mut |at, b| {
                let r = at..at + b.len();
                fold_piece(&mut dst[r.clone()], own.map(|o| &o[r]), b, dtype, op)
            })?;
            std::mem::swap(&mut sent, &mut fold);
        }
    }
    if op == ReduceOp::Avg {
        finish_avg(out, dtype, n);
    }
    Ok(())
}

/// Segment `j` of `send` to rank `j`, segment `i` of `recv` from rank `i`: among more than
/// two ranks, small segments (none above `direct_max` bytes) all sent, then all received,
/// so a rank waits once for its peers rather than once per step; larger ones, and any
/// between two ranks (one step: 8 B-4 KiB 1.40-3.00 us against 1.71-3.27 sent then
/// received), by pairwise exchange. Each rank chooses
/// alone (the choice depends on its own segments): the messages are the same either way.
pub(crate) fn all_to_all(
    cx: &Coll<'_>,
    send: &[u8],
    send_bytes: &[usize],
    recv: &mut [u8],
    recv_bytes: &[usize],
    direct_max: usize,
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
    cx.put(&mut recv[ro[me]..ro[me] + recv_bytes[me]], &send[so[me]..so[me] + send_bytes[me]]);
    // Two ranks: the one pairwise step is the exchange, whatever the size.
    if n > 2 && send_bytes.iter().chain(recv_bytes).all(|&b| b <= direct_max) {
        // Small: the rings (and sockets) hold every segment, so no send waits for a peer.
        for k in 1..n {
            let to = (me + k) % n;
            cx.send(to, &send[so[to]..so[to] + send_bytes[to]])?;
        }
        for k in 1..n {
            let from = (me + n - k) % n;
            cx.recv_into(from, &mut recv[ro[from]..ro[from] + recv_bytes[from]])?;
        }
        return Ok(());
    }
    // Pairwise: at step k, to rank me + k and from rank me - k, both streams at once (the
    // peer at me + k receives from this rank at its own step k).
    for k in 1..n {
        let (to, from) = ((me + k) % n, (me + n - k) % n);
        let dst = &mut recv[ro[from]..ro[from] + recv_bytes[from]];
        cx.exchange_into(to, (&send[so[to]..so[to] + send_bytes[to]], None), from, dst)?;
    }
    Ok(())
}

/// Barrier: among up to [`BARRIER_DIRECT_MAX`] ranks, an empty message to every other rank,
/// then every other rank's (one wait for all of them, as the direct all_gather of nothing);
/// among more, dissemination: ceil(log2 n) rounds of empty messages, each round's send and
/// receive in one exchange.
pub(crate) fn barrier(cx: &Coll<'_>) -> Result<()> {
    let (n, me) = (cx.size(), cx.rank());
    if n <= BARRIER_DIRECT_MAX {
        for k in 1..n {
            cx.send((me + k) % n, &[])?;
        }
        for k in 1..n {
            cx.recv_into((me + n - k) % n, &mut [])?;
        }
        return Ok(());
    }
    let mut k = 1;
    while k < n {
        cx.exchange((me + k) % n, (&[], None), (me + n - k) % n, 0, &mut |_, _| {})?;
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
